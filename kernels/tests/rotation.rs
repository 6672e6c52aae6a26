//! The rotated codecs (`+had`): they quantize exactly what the plain codecs would quantize given
//! the rotated rows, their round-trip error is bounded by the plain format's bound carried through
//! an orthogonal map, they beat the plain codecs on outlier channels, and a corrupted rotation
//! header is an error. Prints the measured figures.

mod common;

use common::*;
use kvtier_kernels::formats::e4m3_to_f32;
use kvtier_kernels::rotation::{rotation_chunks, Rotation, DEFAULT_ROTATION_SEED};
use kvtier_kernels::{
    decode, encode, inspect, is_lossless, is_rotated, rotated_variant, split_codec, BlockSpec, Codec, CodecError,
    Fp8Scaling, KvBlockView, PayloadParts,
};
use kvtier_proto::{CodecId, DType, MemoryOrder};

const PAIRS: [(CodecId, CodecId); 4] = [
    (CodecId::FP8_E4M3, CodecId::FP8_E4M3_HAD),
    (CodecId::FP8_E4M3_LZ4, CodecId::FP8_E4M3_HAD_LZ4),
    (CodecId::NVFP4, CodecId::NVFP4_HAD),
    (CodecId::NVFP4_LZ4, CodecId::NVFP4_HAD_LZ4),
];

/// `x` with every row rotated by the public [`Rotation`].
fn rotated(spec: &BlockSpec, x: &[f32], seed: u16) -> Vec<f32> {
    let rot = Rotation::new(spec.row_len(), seed);
    let mut y = x.to_vec();
    y.chunks_mut(spec.row_len()).for_each(|row| rot.forward(row));
    y
}

fn mse(x: &[f32], y: &[f32]) -> f64 {
    x.iter().zip(y).map(|(a, b)| (f64::from(*a) - f64::from(*b)).powi(2)).sum::<f64>() / x.len() as f64
}

#[test]
fn ids_names_and_policy_helpers() {
    for (plain, had) in PAIRS {
        assert_eq!(split_codec(plain).unwrap(), split_codec(had).unwrap());
        assert!(is_rotated(had) && !is_rotated(plain));
        assert!(!is_lossless(had));
        assert_eq!(rotated_variant(plain), Some(had));
        assert_eq!(rotated_variant(had), Some(had));
        assert_eq!(CodecId::from_name(had.name()), Some(had));
        assert_eq!(kvtier_kernels::policy::lossless_variant(had), kvtier_kernels::policy::lossless_variant(plain));
    }
    assert_eq!(rotated_variant(CodecId::RAW_LZ4), None);
    assert_eq!(rotated_variant(CodecId(10)), None);
    assert!(matches!(split_codec(CodecId(10)), Err(CodecError::UnknownCodec(10))));
}

/// A rotated payload is, section for section, the plain payload of the rotated rows (in f32): the
/// same scale rules, the same codes. The header differs only in the rotation fields.
#[test]
fn rotated_payload_is_the_plain_payload_of_the_rotated_rows() {
    for (hd, dtype, order) in [
        (128u16, DType::Bf16, MemoryOrder::LayerFirst),
        (64, DType::Fp16, MemoryOrder::BlockFirst),
        (96, DType::Fp32, MemoryOrder::LayerFirst),
        (100, DType::Bf16, MemoryOrder::BlockFirst),
        (7, DType::Fp32, MemoryOrder::LayerFirst),
    ] {
        let mut spec = BlockSpec::new(2, 5, 3, hd, dtype);
        spec.order = order;
        let mut r = rng(u64::from(hd));
        let mut x = gaussian(&mut r, spec.elements());
        outlier_channels(&spec, &mut x, &mut r, 20.0);
        let x = from_bytes(dtype, &to_bytes(dtype, &x));
        let spec32 = spec.with_dtype(DType::Fp32);
        for seed in [DEFAULT_ROTATION_SEED, 0, 12345] {
            let y = to_bytes(DType::Fp32, &rotated(&spec, &x, seed));
            for (plain, had) in PAIRS {
                for scaling in [Fp8Scaling::PerTokenHead, Fp8Scaling::PerTensor] {
                    let rc = Codec::new(had).with_fp8_scaling(scaling.clone()).with_rotation_seed(seed);
                    let pc = Codec::new(plain).with_fp8_scaling(scaling);
                    let p = enc(&rc, spec, &to_bytes(dtype, &x));
                    let q = enc(&pc, spec32, &y);
                    assert_eq!(sections(&p), sections(&q), "{hd} {dtype:?} {order:?} {had:?} seed {seed}");
                    let info = inspect(&p).unwrap();
                    assert_eq!(info.rotation_seed, Some(seed));
                    assert_eq!(info.spec, spec);
                    assert_eq!(inspect(&q).unwrap().rotation_seed, None);
                    assert_eq!(p[5] & 2, 2, "flags bit 1");
                    assert_eq!(p[9], 1, "rotation scheme");
                    assert_eq!(&p[10..12], &seed.to_le_bytes());
                    assert_eq!(&p[18..20], &(!seed).to_le_bytes());
                }
            }
        }
    }
}

/// Round trip error: in the rotated domain every element obeys its plain format's bound; the
/// inverse rotation is orthogonal, so each row's L2 error is at most the L2 norm of those bounds
/// (plus f32 rounding of the rotations and of the output dtype). Also relative RMSE ceilings on
/// N(0,1) and on outlier channels.
#[test]
fn round_trip_error_bounds() {
    let spec = BlockSpec::new(2, 64, 4, 128, DType::Fp32);
    let hd = spec.row_len();
    for outliers in [false, true] {
        let mut r = rng(if outliers { 21 } else { 20 });
        let mut x = gaussian(&mut r, spec.elements());
        if outliers {
            outlier_channels(&spec, &mut x, &mut r, 20.0);
        }
        let y = rotated(&spec, &x, DEFAULT_ROTATION_SEED);
        for had in [CodecId::FP8_E4M3_HAD, CodecId::FP8_E4M3_HAD_LZ4, CodecId::NVFP4_HAD, CodecId::NVFP4_HAD_LZ4] {
            let codec = Codec::new(had);
            let p = enc(&codec, spec, &to_bytes(DType::Fp32, &x));
            let back = dec_f32(&codec, &p, spec);
            let parts = PayloadParts::open(&p).unwrap();
            let scales = parts.scales();
            let nvfp4 = split_codec(had).unwrap().0 == kvtier_kernels::Format::Nvfp4;
            // Per-element bound in the rotated domain.
            let bound = |i: usize| -> f64 {
                let row = i / hd;
                if nvfp4 {
                    let g = scales[spec.plane_of_row(row)];
                    let bs = parts.block_scales()[row * hd.div_ceil(16) + (i % hd) / 16];
                    f64::from(e4m3_to_f32(bs).max(3.0 / 512.0) * g)
                } else {
                    // E4M3: half an ulp of the normal range (2^-4 relative), half the subnormal step.
                    let s = f64::from(scales[row]);
                    (f64::from(y[i].abs()) / 17.0).max(s * 2f64.powi(-10))
                }
            };
            let mut worst = 0f64;
            for row in 0..spec.rows() {
                let idx = row * hd..(row + 1) * hd;
                let err: f64 = idx.clone().map(|i| (f64::from(x[i]) - f64::from(back[i])).powi(2)).sum::<f64>().sqrt();
                let allowed: f64 = idx.clone().map(|i| bound(i).powi(2)).sum::<f64>().sqrt();
                let norm: f64 = idx.map(|i| f64::from(x[i]).powi(2)).sum::<f64>().sqrt();
                assert!(err <= allowed * (1.0 + 1e-5) + 1e-6 * norm, "{had:?} row {row}: {err} > {allowed}");
                worst = worst.max(err / allowed);
            }
            let rel = (mse(&x, &back) / mse(&x, &vec![0.0; x.len()])).sqrt();
            eprintln!(
                "{}, outliers={outliers}: relative RMSE {rel:.5}, worst row error / bound {worst:.4}",
                had.name()
            );
            assert!(rel <= if nvfp4 { 0.12 } else { 0.035 }, "{had:?} relative RMSE {rel}");
            // The LZ4 forms decode to the same values.
            if had == CodecId::FP8_E4M3_HAD_LZ4 || had == CodecId::NVFP4_HAD_LZ4 {
                let plain_had = CodecId(had.0 - 1);
                let q = enc(&Codec::new(plain_had), spec, &to_bytes(DType::Fp32, &x));
                assert_eq!(back, dec_f32(&Codec::new(plain_had), &q, spec));
            }
        }
    }
}

/// Outlier channels along head_dim (2 of 64 channels ×20, the same channels in every row, as keys
/// have them). The rotation does what it is for: it spreads the outliers over the row (the
/// rotated rows' amax / RMS falls from 6.5 to 1.9), so no micro-block or row scale is set by one
/// channel any more.
///
/// But it does **not** lower the mean squared error of these two formats on this data: measured,
/// plain NVFP4 MSE / rotated NVFP4 MSE = 0.70 (the rotated error is 1.4× larger) and FP8 0.25.
/// Both formats are floating point with fine-grained scales, so their error is roughly relative
/// to the local magnitude: plain NVFP4 confines the outliers' coarse steps to the 2 of 4
/// micro-blocks that hold them, while the rotation spreads the outliers' energy (≈ 93% of the
/// row's) into every element, and the error follows it (rotated MSE ≈ 1.26 × NVFP4's relative MSE
/// on Gaussians × the row's mean energy). An independent numpy model (ideal
/// block scales, the same E2M1 grid) gives 0.65 for NVFP4 on this data, and 8.5 for a per-row
/// INT4 quantizer — the setting where rotations are known to help. The ratios are pinned here, as
/// measured, so a change of either codec that moves them shows up.
#[test]
fn rotation_on_outlier_channels_measured() {
    let spec = BlockSpec::new(4, 128, 8, 64, DType::Bf16);
    let mut x = gaussian(&mut rng(64), spec.elements());
    for (i, v) in x.iter_mut().enumerate() {
        if matches!(i % 64, 5 | 41) {
            *v *= 20.0;
        }
    }
    let x = from_bytes(DType::Bf16, &to_bytes(DType::Bf16, &x));
    let bytes = to_bytes(DType::Bf16, &x);
    let view = KvBlockView::new(spec, &bytes).unwrap();
    let err = |id: CodecId| {
        let back = from_bytes(DType::Bf16, &decode(id, &encode(id, &view).unwrap(), &spec).unwrap());
        mse(&x, &back)
    };
    // The spreading itself: mean over rows of amax / RMS.
    let crest = |v: &[f32]| {
        let rows = v.chunks(64).map(|r| {
            let rms = (r.iter().map(|a| f64::from(*a).powi(2)).sum::<f64>() / 64.0).sqrt();
            r.iter().map(|a| f64::from(a.abs())).fold(0.0, f64::max) / rms
        });
        rows.sum::<f64>() / (v.len() / 64) as f64
    };
    let (c_plain, c_rot) = (crest(&x), crest(&rotated(&spec, &x, DEFAULT_ROTATION_SEED)));
    eprintln!("amax / RMS per row: plain {c_plain:.2}, rotated {c_rot:.2}");
    assert!(c_rot < 0.75 * c_plain, "{c_plain} {c_rot}");

    let (nv, nv_had) = (err(CodecId::NVFP4), err(CodecId::NVFP4_HAD));
    let (f8, f8_had) = (err(CodecId::FP8_E4M3), err(CodecId::FP8_E4M3_HAD));
    eprintln!("outliers 2/64 ×20: nvfp4 MSE {nv:.6}, nvfp4+had {nv_had:.6}, plain/rotated {:.2}", nv / nv_had);
    eprintln!("outliers 2/64 ×20: fp8 MSE {f8:.7}, fp8+had {f8_had:.7}, plain/rotated {:.2}", f8 / f8_had);
    assert!((0.55..0.85).contains(&(nv / nv_had)), "nvfp4 {nv} vs rotated {nv_had}");
    assert!((0.15..0.40).contains(&(f8 / f8_had)), "fp8 {f8} vs rotated {f8_had}");

    // Without outliers the rotation changes nothing (a rotated Gaussian row is a Gaussian row).
    let g = gaussian(&mut rng(65), spec.elements());
    let gb = to_bytes(DType::Bf16, &g);
    let g = from_bytes(DType::Bf16, &gb);
    let gv = KvBlockView::new(spec, &gb).unwrap();
    let gerr = |id: CodecId| mse(&g, &from_bytes(DType::Bf16, &decode(id, &encode(id, &gv).unwrap(), &spec).unwrap()));
    let (a, b) = (gerr(CodecId::NVFP4), gerr(CodecId::NVFP4_HAD));
    eprintln!("gaussian: nvfp4 MSE {a:.6}, nvfp4+had {b:.6}, plain/rotated {:.2}", a / b);
    assert!((0.9..1.1).contains(&(a / b)), "{a} vs {b}");
    // With outliers, the rotated error follows the mean energy (measured 1.26× the Gaussian
    // relative error: the rotated rows are dominated by the two outliers' ± sums, not Gaussian).
    let energy = |v: &[f32]| v.iter().map(|a| f64::from(*a).powi(2)).sum::<f64>() / v.len() as f64;
    let (rel_out, rel_gauss) = (nv_had / energy(&x), b / energy(&g));
    eprintln!("nvfp4+had MSE / mean energy: outliers {rel_out:.5}, gaussian {rel_gauss:.5}");
    assert!((0.9..1.6).contains(&(rel_out / rel_gauss)), "{rel_out} vs {rel_gauss}");
}

/// A corrupted rotation flag, scheme or seed is an error; no header byte flip panics.
#[test]
fn corrupted_rotation_header_is_an_error() {
    let spec = BlockSpec::new(2, 4, 2, 32, DType::Bf16);
    let bytes = to_bytes(DType::Bf16, &gaussian(&mut rng(7), spec.elements()));
    let view = KvBlockView::new(spec, &bytes).unwrap();
    for (plain, had) in PAIRS {
        let p = encode(had, &view).unwrap();
        let q = encode(plain, &view).unwrap();
        assert!(decode(had, &p, &spec).is_ok());
        // Each codec reads only its own kind of payload.
        assert!(matches!(decode(plain, &p, &spec), Err(CodecError::Corrupt(_))), "{plain:?}");
        assert!(matches!(decode(had, &q, &spec), Err(CodecError::Corrupt(_))), "{had:?}");
        // Every bit of the flags, the scheme, the seed and its check.
        for byte in [5usize, 9, 10, 11, 18, 19] {
            for bit in 0..8 {
                for (payload, id) in [(&p, had), (&q, plain)] {
                    let mut bad = payload.clone();
                    bad[byte] ^= 1 << bit;
                    let res = decode(id, &bad, &spec);
                    assert!(matches!(res, Err(CodecError::Corrupt(_))), "{id:?} byte {byte} bit {bit}: {res:?}");
                    // Only the LZ4 flag makes a header that reads (and then fails against the codec).
                    let lz4_bit = byte == 5 && bit == 0;
                    assert_eq!(inspect(&bad).is_ok(), lz4_bit, "{id:?} byte {byte} bit {bit}");
                    for other in (0..12).map(CodecId) {
                        let _ = decode(other, &bad, &spec);
                    }
                }
            }
        }
        // No flip anywhere in the header panics, whatever codec decodes it.
        for bit in 0..256 {
            let mut bad = p.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            for other in (0..12).map(CodecId) {
                let _ = decode(other, &bad, &spec);
            }
        }
        // A rotated raw payload is not a thing.
        let mut raw = encode(CodecId::RAW_LZ4, &view).unwrap();
        raw[5] |= 2;
        raw[9] = 1;
        raw[10..12].copy_from_slice(&7u16.to_le_bytes());
        raw[18..20].copy_from_slice(&(!7u16).to_le_bytes());
        assert!(matches!(inspect(&raw), Err(CodecError::Corrupt(_))));
    }
}

/// The seed is recorded, so any seed decodes with default options; different seeds give
/// different codes and (nearly) the same accuracy.
#[test]
fn seed_is_recorded_in_the_payload() {
    let spec = BlockSpec::new(1, 16, 4, 64, DType::Fp32);
    let x = gaussian(&mut rng(3), spec.elements());
    let bytes = to_bytes(DType::Fp32, &x);
    let view = KvBlockView::new(spec, &bytes).unwrap();
    let a = Codec::new(CodecId::NVFP4_HAD).encode(&view).unwrap();
    let b = Codec::new(CodecId::NVFP4_HAD).with_rotation_seed(99).encode(&view).unwrap();
    assert_ne!(sections(&a).2, sections(&b).2);
    let (ya, yb) =
        (dec_f32(&Codec::new(CodecId::NVFP4_HAD), &a, spec), dec_f32(&Codec::new(CodecId::NVFP4_HAD), &b, spec));
    let (ea, eb) = (mse(&x, &ya), mse(&x, &yb));
    assert!(ea < 0.02 && eb < 0.02, "{ea} {eb}");
    // Decoding with a codec configured for another seed still uses the payload's seed.
    assert_eq!(dec_f32(&Codec::new(CodecId::NVFP4_HAD).with_rotation_seed(5), &b, spec), yb);
}

/// Every head_dim works: non-powers of two are rotated block-diagonally on the binary digits of
/// head_dim, and each chunk is orthogonal, so the error stays in the plain codec's range.
#[test]
fn composite_head_dims() {
    for hd in [1u16, 3, 24, 80, 96, 100, 192, 576] {
        let spec = BlockSpec::new(1, 8, 2, hd, DType::Fp32);
        let x = gaussian(&mut rng(u64::from(hd)), spec.elements());
        let bytes = to_bytes(DType::Fp32, &x);
        for (plain, had) in [(CodecId::FP8_E4M3, CodecId::FP8_E4M3_HAD), (CodecId::NVFP4, CodecId::NVFP4_HAD)] {
            let view = KvBlockView::new(spec, &bytes).unwrap();
            let e_had = mse(&x, &from_bytes(DType::Fp32, &decode(had, &encode(had, &view).unwrap(), &spec).unwrap()));
            let e = mse(&x, &from_bytes(DType::Fp32, &decode(plain, &encode(plain, &view).unwrap(), &spec).unwrap()));
            assert!(e_had <= e * 2.0 + 1e-9, "hd {hd} {had:?}: {e_had} vs plain {e}");
        }
        assert_eq!(rotation_chunks(usize::from(hd)).iter().sum::<usize>(), usize::from(hd));
    }
}

/// Values beyond 2^100 are refused with a clear error (not saturated silently); NaN/Inf is
/// reported as for the plain codecs; a payload whose decoded values are beyond anything the
/// encoder writes is corrupt.
#[test]
fn range_limits() {
    let spec = BlockSpec::new(1, 2, 1, 64, DType::Fp32);
    let mut x = vec![1.0f32; spec.elements()];
    x[64 * 2 + 3] = 1.0e30; // below 2^100: fine
    let ok = to_bytes(DType::Fp32, &x);
    for id in [CodecId::NVFP4_HAD, CodecId::FP8_E4M3_HAD] {
        let p = encode(id, &KvBlockView::new(spec, &ok).unwrap()).unwrap();
        let y = from_bytes(DType::Fp32, &decode(id, &p, &spec).unwrap());
        assert!((y[64 * 2 + 3] - 1.0e30).abs() < 0.2e30, "{id:?} {}", y[64 * 2 + 3]);
    }
    x[64 * 3 + 7] = -2.0e30; // row 3: layer 0, V, token 1
    let big = to_bytes(DType::Fp32, &x);
    let view = KvBlockView::new(spec, &big).unwrap();
    assert!(encode(CodecId::NVFP4, &view).is_ok());
    for id in [CodecId::NVFP4_HAD, CodecId::FP8_E4M3_HAD, CodecId::NVFP4_HAD_LZ4] {
        for scaling in [Fp8Scaling::PerTokenHead, Fp8Scaling::PerTensor] {
            match Codec::new(id).with_fp8_scaling(scaling).encode(&view) {
                Err(CodecError::InvalidInput(m)) => {
                    assert!(m.contains("2^100") && m.contains("V, token 1"), "{m}")
                }
                other => panic!("{id:?} {other:?}"),
            }
        }
    }
    // A NaN is still reported as the input's NaN, at its place.
    x[64 * 3 + 9] = f32::NAN;
    let nan = to_bytes(DType::Fp32, &x);
    let view = KvBlockView::new(spec, &nan).unwrap();
    assert!(matches!(encode(CodecId::FP8_E4M3_HAD, &view), Err(CodecError::NonFinite { dim: 9, .. })));
    // A payload with a huge (finite) FP8 scale: values the encoder never writes.
    let mut p = encode(CodecId::FP8_E4M3_HAD, &KvBlockView::new(spec, &ok).unwrap()).unwrap();
    p[32..36].copy_from_slice(&3.0e38f32.to_le_bytes());
    assert!(matches!(decode(CodecId::FP8_E4M3_HAD, &p, &spec), Err(CodecError::Corrupt(_))));
}
