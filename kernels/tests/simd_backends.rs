//! Every SIMD backend writes the scalar reference's bytes — and returns its errors — on hostile
//! input: rows mixing ordinary values with zeros of both signs, subnormals (of f32 and of the
//! engine dtype), values near the formats' and the rotation's limits (2^100), the largest finite
//! values, infinities and NaNs, for odd head dims and row counts; and on payloads with corrupted
//! codes, block scales and scales (NaN codes, invalid block scales, scales near the fused
//! decoders' bounds). Encode and decode (with and without AVX512-BF16), every codec, serial and
//! split over threads.

mod common;

use common::*;
use kvtier_kernels::{Backend, BlockSpec, Codec, Fp8Scaling, KvBlockView, PayloadParts};
use kvtier_proto::{CodecId, DType, MemoryOrder};
use proptest::prelude::*;
use rand::Rng;

const CODECS: [(CodecId, Fp8Scaling); 8] = [
    (CodecId::FP8_E4M3, Fp8Scaling::PerTokenHead),
    (CodecId::FP8_E4M3, Fp8Scaling::PerTensor),
    (CodecId::NVFP4, Fp8Scaling::PerTokenHead),
    (CodecId::FP8_E4M3_HAD, Fp8Scaling::PerTokenHead),
    (CodecId::FP8_E4M3_HAD, Fp8Scaling::PerTensor),
    (CodecId::FP8_E4M3_HAD_LZ4, Fp8Scaling::PerTokenHead),
    (CodecId::NVFP4_HAD, Fp8Scaling::PerTokenHead),
    (CodecId::NVFP4_HAD_LZ4, Fp8Scaling::PerTokenHead),
];

fn arb_spec() -> impl Strategy<Value = BlockSpec> {
    (
        1u16..3,
        1u32..10,
        1u16..4,
        prop::sample::select(vec![1u16, 3, 7, 16, 24, 32, 40, 48, 64, 80, 96, 100, 112, 128, 144, 192, 256, 320, 576]),
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

/// Rows of Gaussian values at a random power-of-two magnitude per row, with, at random, special
/// values sprinkled in (`specials` of 1000 elements; 0 keeps every row finite and in range).
fn hostile(spec: &BlockSpec, seed: u64, specials: u32) -> Vec<u8> {
    let mut r = rng(seed);
    let mut x = gaussian(&mut r, spec.elements());
    let (lo, hi) = match spec.dtype {
        DType::Fp16 => (-20, 12),
        _ => (-130, 96),
    };
    for row in x.chunks_mut(spec.row_len()) {
        let m = 2f32.powi(r.random_range(lo..hi));
        let kind = r.random_range(0..12u32);
        for v in row.iter_mut() {
            *v *= m;
            match kind {
                0 => *v = 0.0,
                1 => *v = -0.0,
                2 => *v = f32::from_bits(r.random_range(1..0x0080_0000u32)) * if r.random() { 1.0 } else { -1.0 },
                _ => {}
            }
            if specials > 0 && r.random_range(0..1000) < specials {
                *v = match r.random_range(0..9u32) {
                    0 => f32::NAN,
                    1 => f32::INFINITY,
                    2 => f32::NEG_INFINITY,
                    3 => f32::MAX,
                    4 => 2f32.powi(100),
                    5 => -2f32.powi(100) * 1.01,
                    6 => 448.0 * 6.0,
                    7 => f32::MIN_POSITIVE,
                    _ => -f32::from_bits(1),
                };
            }
        }
    }
    to_bytes(spec.dtype, &x)
}

fn backends() -> Vec<(Backend, usize)> {
    let mut b = vec![(Backend::Scalar, 0), (Backend::Auto, usize::MAX), (Backend::Auto, 0)];
    if Backend::avx2_available() {
        b.push((Backend::Avx2, usize::MAX));
        b.push((Backend::Avx2, 0));
    }
    if Backend::avx512_available() {
        b.push((Backend::Avx512, usize::MAX));
        b.push((Backend::Avx512, 0));
    }
    b
}

fn codec(id: CodecId, scaling: &Fp8Scaling, b: Backend, par: usize) -> Codec {
    Codec::new(id).with_fp8_scaling(scaling.clone()).with_backend(b).with_parallel_min_bytes(par)
}

/// Every backend's decode of `payload` (bytes or error) into every output dtype equals the
/// scalar one's.
fn decodes_agree(id: CodecId, scaling: &Fp8Scaling, spec: BlockSpec, payload: &[u8]) -> Result<(), TestCaseError> {
    for out in [DType::Bf16, DType::Fp16, DType::Fp32, DType::Fp8E4m3] {
        let n = spec.elements() * out.size() as usize;
        let mut want = vec![0u8; n];
        let want_res = codec(id, scaling, Backend::Scalar, usize::MAX).decode_into(payload, &spec, out, &mut want);
        for (b, par, bf16) in backends().into_iter().flat_map(|(b, par)| [(b, par, true), (b, par, false)]) {
            // Both routes of the AVX-512 BF16 store (AVX512-BF16 where the CPU has it, or not).
            kvtier_kernels::__testing::avx512_bf16(bf16);
            let mut got = vec![0u8; n];
            let got_res = codec(id, scaling, b, par).decode_into(payload, &spec, out, &mut got);
            kvtier_kernels::__testing::avx512_bf16(true);
            prop_assert_eq!(
                format!("{got_res:?}"),
                format!("{want_res:?}"),
                "{} decode to {:?}, {:?}/{}: {:?}",
                id.name(),
                out,
                b,
                par,
                spec
            );
            if want_res.is_ok() {
                let first = got.iter().zip(&want).position(|(a, b)| a != b);
                prop_assert!(
                    got == want,
                    "{} decode to {:?}, {:?}/{}: {:?}, first difference at byte {:?} of {}, scales {:?}",
                    id.name(),
                    out,
                    b,
                    par,
                    spec,
                    first,
                    n,
                    PayloadParts::open(payload).unwrap().scales()
                );
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn encode_matches_scalar_on_hostile_rows(spec in arb_spec(), seed in any::<u64>(), specials in prop::sample::select(vec![0u32, 0, 1, 20])) {
        let bytes = hostile(&spec, seed, specials);
        let view = KvBlockView::new(spec, &bytes).unwrap();
        for (id, scaling) in CODECS.iter() {
            let want = codec(*id, scaling, Backend::Scalar, usize::MAX).encode(&view);
            for (b, par) in backends() {
                let got = codec(*id, scaling, b, par).encode(&view);
                // Compared as text: a NonFinite error carries the NaN it found.
                prop_assert_eq!(format!("{got:?}"), format!("{want:?}"), "{} encode, {:?}/{}: {:?}", id.name(), b, par, spec);
            }
            if let Ok(payload) = want {
                decodes_agree(*id, scaling, spec, &payload)?;
            }
        }
    }

    #[test]
    fn decode_matches_scalar_on_corrupted_payloads(spec in arb_spec(), seed in any::<u64>(), hits in 1usize..6) {
        let bytes = hostile(&spec, seed, 0);
        let view = KvBlockView::new(spec, &bytes).unwrap();
        let mut r = rng(seed ^ 0x5DEE_CE66);
        for (id, scaling) in CODECS.iter().filter(|(id, _)| !matches!(*id, CodecId::FP8_E4M3_HAD_LZ4 | CodecId::NVFP4_HAD_LZ4)) {
            let Ok(mut payload) = codec(*id, scaling, Backend::Scalar, usize::MAX).encode(&view) else { continue };
            let (ns, nb, nc) = {
                let p = PayloadParts::open(&payload).unwrap();
                (p.scale_bytes().len(), p.block_scales().len(), p.codes().len())
            };
            let end = payload.len();
            let (codes0, bs0, sc0) = (end - nc, end - nc - nb, end - nc - nb - ns);
            for _ in 0..hits {
                match r.random_range(0..4u32) {
                    0 => { let i = r.random_range(codes0..end); payload[i] = [0x7F, 0xFF, 0x7E, 0x80][r.random_range(0..4)]; }
                    1 if nb > 0 => { let i = r.random_range(bs0..codes0); payload[i] = [0x7F, 0x80, 0xFE, 0x7E, 0][r.random_range(0..5)]; }
                    2 if ns > 0 => {
                        let k = r.random_range(0..ns / 4);
                        let s = [2f32.powi(100), 2f32.powi(98), 2f32.powi(98) * 1.5, 2f32.powi(101), 2f32.powi(120), 1e-40, 0.0][r.random_range(0..7)];
                        payload[sc0 + 4 * k..sc0 + 4 * k + 4].copy_from_slice(&s.to_le_bytes());
                    }
                    _ => { let i = r.random_range(codes0..end); payload[i] = r.random(); }
                }
            }
            decodes_agree(*id, scaling, spec, &payload)?;
        }
    }
}

/// The rotated codecs refuse a row holding a NaN, an infinity or a value beyond 2^100 with the
/// scalar reference's error on every backend, also where the range check rides on a fused kernel's
/// rotated max (AVX2 and AVX-512, head dims whose chunks they hold in registers: 64, 96, 128,
/// 256) — the special value in the first, a middle or the last row of a batch of eight, at the
/// first or last channel — and accept values at exactly 2^100 with the scalar bytes.
#[test]
fn rotated_codecs_refuse_hostile_rows_like_the_scalar_reference() {
    let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::MAX, -2f32.powi(101), 2f32.powi(100)];
    for hd in [64u16, 96, 128, 256] {
        for dtype in [DType::Bf16, DType::Fp16, DType::Fp32] {
            let spec = BlockSpec::new(2, 9, 2, hd, dtype);
            let mut r = rng(u64::from(hd) ^ dtype as u64);
            let base = gaussian(&mut r, spec.elements());
            for (n, &special) in specials.iter().enumerate() {
                if dtype == DType::Fp16 && special.is_finite() && special.abs() > 65504.0 {
                    continue; // not representable: FP16 stores it as infinity, covered above
                }
                let row = [0, 5, 7, 8, spec.rows() - 1][n % 5];
                let dim = if n % 2 == 0 { 0 } else { usize::from(hd) - 1 };
                let mut x = base.clone();
                x[row * usize::from(hd) + dim] = special;
                let bytes = to_bytes(dtype, &x);
                let view = KvBlockView::new(spec, &bytes).unwrap();
                for id in [CodecId::FP8_E4M3_HAD, CodecId::NVFP4_HAD] {
                    let scaling = Fp8Scaling::PerTokenHead;
                    let want = codec(id, &scaling, Backend::Scalar, usize::MAX).encode(&view);
                    // Only exactly 2^100 is in range.
                    assert_eq!(want.is_ok(), special == 2f32.powi(100), "{} {dtype:?} hd {hd} {special}", id.name());
                    for (b, par) in backends() {
                        let got = codec(id, &scaling, b, par).encode(&view);
                        assert_eq!(
                            format!("{got:?}"),
                            format!("{want:?}"),
                            "{} {dtype:?} hd {hd} {special} row {row}, {b:?}/{par}",
                            id.name()
                        );
                    }
                }
            }
        }
    }
}
