//! Bit-exactness against `ml_dtypes`: runs `tests/golden/gen_golden.py` with the pinned reference
//! and compares every scalar conversion and every block case, on every backend.
//!
//! Python: `$KVTIER_PYTHON` if set, else `<repo root>/.venv/bin/python`, with the packages in
//! `kernels/tests/golden/requirements.txt`. Without them this test fails (it never skips):
//!
//! ```text
//! python3 -m venv .venv && .venv/bin/pip install -r kernels/tests/golden/requirements.txt
//! ```

use std::path::{Path, PathBuf};
use std::process::Command;

use kvtier_kernels::__testing::{e2m1_codes, e4m3_codes};
use kvtier_kernels::formats::{e2m1_from_f32, e2m1_to_f32, e4m3_from_f32, e4m3_to_f32};
use kvtier_kernels::{Backend, BlockSpec, Codec, Fp8Scaling, KvBlockView, PayloadParts};
use kvtier_proto::{CodecId, DType, MemoryOrder};

const INSTALL: &str = "python3 -m venv .venv && .venv/bin/pip install -r kernels/tests/golden/requirements.txt (from the repository root), or point KVTIER_PYTHON at a Python that has them";

fn generate() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = match std::env::var_os("KVTIER_PYTHON") {
        Some(p) => PathBuf::from(p),
        None => manifest.join("..").join(".venv").join("bin").join("python"),
    };
    assert!(
        python.exists(),
        "golden vectors need Python with the pinned ml_dtypes; {} does not exist. Install: {INSTALL}",
        python.display()
    );
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kvtier-golden");
    let run = Command::new(&python)
        .arg(manifest.join("tests/golden/gen_golden.py"))
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap_or_else(|e| panic!("could not run {}: {e}. Install: {INSTALL}", python.display()));
    assert!(
        run.status.success(),
        "gen_golden.py failed ({}):\n{}\n{}\nInstall: {INSTALL}",
        run.status,
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    out
}

fn read(dir: &Path, name: &str) -> Vec<u8> {
    std::fs::read(dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn backends() -> Vec<Backend> {
    let mut b = vec![Backend::Scalar];
    if Backend::avx512_available() {
        b.push(Backend::Avx512);
    }
    if Backend::avx2_available() {
        b.push(Backend::Avx2);
    } else {
        eprintln!("note: no AVX2+F16C on this CPU; only the scalar backend is checked");
    }
    b
}

#[test]
fn golden_vectors_match_ml_dtypes() {
    let dir = generate();
    check_tables(&dir);
    check_scalar(&dir);
    check_blocks(&dir);
}

fn check_tables(dir: &Path) {
    for (c, want) in f32s(&read(dir, "e4m3_values.f32")).into_iter().enumerate() {
        let got = e4m3_to_f32(c as u8);
        assert!(
            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
            "e4m3 code {c:#x}: {got} vs {want}"
        );
    }
    for (c, want) in f32s(&read(dir, "e2m1_values.f32")).into_iter().enumerate() {
        assert_eq!(e2m1_to_f32(c as u8).to_bits(), want.to_bits(), "e2m1 code {c:#x}");
    }
}

fn check_scalar(dir: &Path) {
    let xs = f32s(&read(dir, "scalar.f32"));
    let e4 = read(dir, "scalar.e4m3");
    let e2 = read(dir, "scalar.e2m1");
    assert_eq!(xs.len(), e4.len());
    assert_eq!(xs.len(), e2.len());
    assert!(xs.len() > 2 * 65536, "expected every fp16 and bf16 pattern");
    let mut checked = 0;
    for (i, &x) in xs.iter().enumerate() {
        let c = e4m3_from_f32(x);
        if x.is_nan() {
            assert_eq!(c & 0x7F, 0x7F, "NaN must encode as a NaN code");
            assert_eq!(e4[i] & 0x7F, 0x7F);
            continue;
        }
        assert_eq!(c, e4[i], "e4m3({x:e} = {:#010x}): ours {c:#04x}, ml_dtypes {:#04x}", x.to_bits(), e4[i]);
        assert_eq!(e2m1_from_f32(x), e2[i], "e2m1({x:e} = {:#010x})", x.to_bits());
        checked += 1;
    }
    // The vector kernels on the same inputs (NaN excluded: the codecs reject NaN before them).
    let finite: Vec<usize> = (0..xs.len()).filter(|&i| !xs[i].is_nan()).collect();
    let fx: Vec<f32> = finite.iter().map(|&i| xs[i]).collect();
    for b in backends() {
        let got4 = e4m3_codes(b, &fx).unwrap();
        let got2 = e2m1_codes(b, &fx).unwrap();
        for (k, &i) in finite.iter().enumerate() {
            assert_eq!(got4[k], e4[i], "{b:?} e4m3({:e})", xs[i]);
            assert_eq!(got2[k], e2[i], "{b:?} e2m1({:e})", xs[i]);
        }
    }
    eprintln!("{checked} scalar cases match ml_dtypes");
}

fn check_blocks(dir: &Path) {
    let manifest = String::from_utf8(read(dir, "blocks.txt")).unwrap();
    let mut n = 0;
    for line in manifest.lines().filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(f.len(), 9, "bad manifest line {line:?}");
        let name = f[0];
        let dtype = DType::parse(f[1]).unwrap();
        let num = |s: &str| s.parse::<u32>().unwrap();
        let mut spec = BlockSpec::new(num(f[2]) as u16, num(f[3]), num(f[4]) as u16, num(f[5]) as u16, dtype);
        spec.order = if f[6] == "block" { MemoryOrder::BlockFirst } else { MemoryOrder::LayerFirst };
        let (id, scaling) = match (f[7], f[8]) {
            ("fp8", "row") => (CodecId::FP8_E4M3, Fp8Scaling::PerTokenHead),
            ("fp8", "tensor") => (CodecId::FP8_E4M3, Fp8Scaling::PerTensor),
            ("nvfp4", _) => (CodecId::NVFP4, Fp8Scaling::PerTokenHead),
            other => panic!("unknown case {other:?}"),
        };
        let input = read(dir, &format!("{name}.in"));
        let view = KvBlockView::new(spec, &input).unwrap();
        for b in backends() {
            for lz4 in [false, true] {
                let id = if lz4 { CodecId(id.0 + 1) } else { id };
                let codec = Codec::new(id).with_fp8_scaling(scaling.clone()).with_backend(b);
                let payload = codec.encode(&view).unwrap();
                let parts = PayloadParts::open(&payload).unwrap();
                assert_eq!(parts.scale_bytes(), &read(dir, &format!("{name}.scales"))[..], "{name} {b:?}: scales");
                assert_eq!(parts.block_scales(), &read(dir, &format!("{name}.bs"))[..], "{name} {b:?}: block scales");
                let want_codes = read(dir, &format!("{name}.codes"));
                if let Some(i) = (0..want_codes.len()).find(|&i| parts.codes()[i] != want_codes[i]) {
                    panic!(
                        "{name} {b:?}: code byte {i}: ours {:#04x}, reference {:#04x}",
                        parts.codes()[i],
                        want_codes[i]
                    );
                }
                for (out, suffix) in [(DType::Bf16, "bf16"), (DType::Fp16, "f16"), (DType::Fp32, "f32")] {
                    let mut got = vec![0u8; spec.elements() * out.size() as usize];
                    codec.decode_into(&payload, &spec, out, &mut got).unwrap();
                    let want = read(dir, &format!("{name}.out_{suffix}"));
                    if let Some(i) = (0..want.len()).find(|&i| got[i] != want[i]) {
                        panic!("{name} {b:?}: decoded {suffix} differs at byte {i}");
                    }
                }
                n += 1;
            }
        }
    }
    assert!(n >= 15, "only {n} block cases ran");
    eprintln!("{n} block encodes match the reference");
}
