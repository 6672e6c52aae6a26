//! The rotated codecs' vector path (the transform held in registers per chunk, and for FP8 per
//! (token, head) rotated and quantized in one pass per row) writes the bytes of the scalar
//! reference (rotate every row into f32, then quantize), encoding and decoding, for the head dims
//! whose chunks take each kernel form: 8 to 256 in registers, shorter and longer chunks through
//! memory, composite head dims, and row counts around the batch of eight rows. The AVX2 and
//! AVX-512 backends both fuse the head dims whose chunks are 16 to 256 (forced explicitly below
//! with `Backend::Avx2` / `Backend::Avx512` where the CPU has them; that they take the fused
//! routes is checked in `kernel::fused_rotated_tests`).

mod common;

use common::*;
use kvtier_kernels::{Backend, BlockSpec, Codec, Fp8Scaling, KvBlockView};
use kvtier_proto::{CodecId, DType, MemoryOrder};
use proptest::prelude::*;

const CODECS: [(CodecId, Fp8Scaling); 3] = [
    (CodecId::FP8_E4M3_HAD, Fp8Scaling::PerTokenHead),
    (CodecId::FP8_E4M3_HAD, Fp8Scaling::PerTensor),
    (CodecId::NVFP4_HAD, Fp8Scaling::PerTokenHead),
];

fn arb_spec() -> impl Strategy<Value = BlockSpec> {
    (
        1u16..3,
        1u32..12,
        1u16..3,
        prop::sample::select(vec![1u16, 3, 8, 16, 24, 32, 64, 80, 96, 100, 128, 192, 256, 320, 512, 576]),
        prop::sample::select(vec![DType::Bf16, DType::Fp16, DType::Fp32]),
        any::<bool>(),
    )
        .prop_map(|(l, t, h, d, dtype, bf)| {
            let mut s = BlockSpec::new(l, t, h, d, dtype);
            if bf {
                s.order = MemoryOrder::BlockFirst;
            }
            s
        })
}

/// Gaussian rows at per-row magnitudes 2^-20..2^20 (FP16 ones kept in range), outlier channels,
/// some rows of zeros and of negative zeros.
fn values(spec: &BlockSpec, seed: u64) -> Vec<u8> {
    let mut r = rng(seed);
    let mut x = gaussian(&mut r, spec.elements());
    outlier_channels(spec, &mut x, &mut r, 30.0);
    let span = if spec.dtype == DType::Fp16 { 8 } else { 20 };
    for (i, row) in x.chunks_mut(spec.row_len()).enumerate() {
        let m = 2f32.powi(((seed as usize + i * 13) % (2 * span + 1)) as i32 - span as i32);
        row.iter_mut().for_each(|v| *v *= m);
        match i % 11 {
            4 => row.iter_mut().for_each(|v| *v = 0.0),
            9 => row.iter_mut().for_each(|v| *v = -0.0),
            _ => {}
        }
    }
    to_bytes(spec.dtype, &x)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn vector_path_writes_the_scalar_bytes(spec in arb_spec(), seed in any::<u64>()) {
        let bytes = values(&spec, seed);
        let view = KvBlockView::new(spec, &bytes).unwrap();
        let mut backends = vec![(Backend::Auto, usize::MAX), (Backend::Auto, 0)];
        if Backend::avx2_available() {
            backends.push((Backend::Avx2, usize::MAX));
            backends.push((Backend::Avx2, 0));
        }
        if Backend::avx512_available() {
            backends.push((Backend::Avx512, usize::MAX));
            backends.push((Backend::Avx512, 0));
        }
        for (id, scaling) in CODECS.iter().cloned() {
            let codec = |b: Backend, par: usize| {
                Codec::new(id).with_fp8_scaling(scaling.clone()).with_backend(b).with_parallel_min_bytes(par)
            };
            let reference = codec(Backend::Scalar, usize::MAX);
            let payload = reference.encode(&view).unwrap();
            for &(b, par) in &backends {
                let got = codec(b, par).encode(&view).unwrap();
                prop_assert!(got == payload, "{} encode, {:?}, parallel from {}: {:?}", id.name(), b, par, spec);
            }
            for out in [DType::Bf16, DType::Fp16, DType::Fp32] {
                let n = spec.elements() * out.size() as usize;
                let mut want = vec![0u8; n];
                reference.decode_into(&payload, &spec, out, &mut want).unwrap();
                for &(b, par) in &backends {
                    let mut got = vec![0u8; n];
                    codec(b, par).decode_into(&payload, &spec, out, &mut got).unwrap();
                    prop_assert!(got == want, "{} decode to {:?}, {:?}, parallel from {}: {:?}", id.name(), out, b, par, spec);
                }
            }
        }
    }
}
