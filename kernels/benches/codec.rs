//! Codec throughput beside memcpy of the same buffer, measured in the same run.
//!
//! `cargo bench -p kvtier-kernels` (or `cargo bench -p kvtier-kernels --bench codec -- --quick`).
//! For every codec it prints the median GB/s of **input** bytes (the engine's bf16 block) for
//! encode and decode (into a reused bf16 buffer), and the ratio to the median memcpy of the same
//! block. "1 core" rows keep everything on the calling thread; "all cores" rows let rayon split the
//! block; where AVX-512 is available, "1 core avx2" rows force the AVX2 kernels. No timing is asserted anywhere: this is a report, not a test. The `+had` rows are the
//! rotated codecs (a randomized Hadamard rotation along `head_dim` before quantizing, undone
//! after decoding), beside their plain forms.
//!
//! Arguments after `--` that do not start with `-` keep only the rows whose codec name or
//! "codec threads" label equals one of them (e.g. `-- --quick "fp8 (token,head) 1 core" nvfp4`),
//! for profiling. `--min` reports the fastest run instead of the median (memcpy too).
//! Output buffers are allocated once and reused by every call (`encode_into`, `decode_into`), so
//! the timings hold no allocation or page faults.

use std::hint::black_box;
use std::time::Instant;

use kvtier_kernels::{Backend, BlockSpec, Codec, Fp8Scaling, KvBlockView};
use kvtier_proto::{CodecId, DType};

/// Median seconds of `f` over `reps` runs after a warm-up (the fastest run instead with `--min`,
/// for A/B comparisons of kernels on a machine shared with other jobs, where every disturbance
/// only slows a run down).
fn median<F: FnMut()>(reps: usize, mut f: F) -> f64 {
    for _ in 0..3 {
        f();
    }
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    if std::env::args().any(|a| a == "--min") {
        return t[0];
    }
    t[t.len() / 2]
}

/// A cheap deterministic N(0,1)-ish generator (sum of uniforms), so the bench needs no rand crate.
fn data(n: usize) -> Vec<u8> {
    let mut next = kvtier_kernels::__testing::uniform_source(0x9E37_79B9_7F4A_7C15);
    (0..n)
        .flat_map(|_| {
            let g = (0..4).map(|_| next()).sum::<f32>() - 2.0;
            half::bf16::from_f32(g * 1.7).to_bits().to_le_bytes()
        })
        .collect()
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let filters: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let reps = std::env::args()
        .find_map(|a| a.strip_prefix("--reps=").and_then(|n| n.parse().ok()))
        .unwrap_or(if quick { 9 } else { 41 });
    // Llama-3-8B-like block: 32 layers, 16 tokens, 8 KV heads of 128, bf16 → 2 MiB.
    // `--layers=N` changes the layer count (e.g. a small, cache-resident block for profiling).
    let layers = std::env::args().find_map(|a| a.strip_prefix("--layers=").and_then(|n| n.parse().ok())).unwrap_or(32);
    let spec = BlockSpec::new(layers, 16, 8, 128, DType::Bf16);
    let input = data(spec.elements());
    let bytes = input.len();
    let view = KvBlockView::new(spec, &input).expect("bench block");
    let gbs = |secs: f64| bytes as f64 / secs / 1e9;

    let mut dst = vec![0u8; bytes];
    let memcpy = median(reps, || {
        dst.copy_from_slice(black_box(&input));
        black_box(&dst);
    });
    println!(
        "block: {spec:?}, {bytes} bytes; AVX2+F16C available: {}; AVX-512 available: {}",
        Backend::avx2_available(),
        Backend::avx512_available()
    );
    println!("memcpy of the same buffer: {:.2} GB/s (median of {reps})", gbs(memcpy));
    println!();
    println!(
        "{:<18} {:<14} {:>10} {:>8} {:>10} {:>8} {:>7}",
        "codec", "threads", "enc GB/s", "enc/cpy", "dec GB/s", "dec/cpy", "ratio"
    );

    let cases: Vec<(&str, CodecId, Fp8Scaling)> = vec![
        ("raw+lz4", CodecId::RAW_LZ4, Fp8Scaling::PerTokenHead),
        ("fp8 (token,head)", CodecId::FP8_E4M3, Fp8Scaling::PerTokenHead),
        ("fp8 per-tensor", CodecId::FP8_E4M3, Fp8Scaling::PerTensor),
        ("fp8+lz4", CodecId::FP8_E4M3_LZ4, Fp8Scaling::PerTokenHead),
        ("nvfp4", CodecId::NVFP4, Fp8Scaling::PerTokenHead),
        ("nvfp4+lz4", CodecId::NVFP4_LZ4, Fp8Scaling::PerTokenHead),
        ("fp8+had", CodecId::FP8_E4M3_HAD, Fp8Scaling::PerTokenHead),
        ("fp8+had+lz4", CodecId::FP8_E4M3_HAD_LZ4, Fp8Scaling::PerTokenHead),
        ("nvfp4+had", CodecId::NVFP4_HAD, Fp8Scaling::PerTokenHead),
        ("nvfp4+had+lz4", CodecId::NVFP4_HAD_LZ4, Fp8Scaling::PerTokenHead),
    ];
    let mut variants = vec![("1 core", Backend::Auto, usize::MAX), ("1 core scalar", Backend::Scalar, usize::MAX)];
    if Backend::avx512_available() {
        // Auto picks AVX-512 here: the AVX2 kernels alone, for comparison in the same run.
        variants.insert(1, ("1 core avx2", Backend::Avx2, usize::MAX));
    }
    if std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) > 1 {
        variants.push(("all cores", Backend::Auto, 0));
    }
    let mut out = Vec::with_capacity(bytes + 4096);
    let mut decoded = vec![0u8; bytes];
    for (name, id, scaling) in &cases {
        for (threads, backend, par) in &variants {
            let label = format!("{name} {threads}");
            if !filters.is_empty() && !filters.iter().any(|f| label == *f || name == f) {
                continue;
            }
            let codec =
                Codec::new(*id).with_fp8_scaling(scaling.clone()).with_backend(*backend).with_parallel_min_bytes(*par);
            let e = median(reps, || codec.encode_into(black_box(&view), &mut out).expect("encode"));
            let payload = out.clone();
            let d = median(reps, || {
                codec.decode_into(black_box(&payload), &spec, DType::Bf16, &mut decoded).expect("decode")
            });
            println!(
                "{:<18} {:<14} {:>10.2} {:>8.2} {:>10.2} {:>8.2} {:>6.2}x",
                name,
                threads,
                gbs(e),
                memcpy / e,
                gbs(d),
                memcpy / d,
                bytes as f64 / payload.len() as f64
            );
        }
    }
}
