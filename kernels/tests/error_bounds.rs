//! Accuracy on ≥ 1M-element blocks: relative RMSE on N(0,1) and on N(0,1) with 1% outlier channels
//! ×20, and the per-element worst case of each format. Prints the measured figures.

mod common;

use common::*;
use kvtier_kernels::{BlockSpec, Codec, PayloadParts};
use kvtier_proto::{CodecId, DType};

/// 2 · 4 layers · 256 tokens · 8 heads · 128 = 2,097,152 elements.
fn spec() -> BlockSpec {
    BlockSpec::new(4, 256, 8, 128, DType::Fp32)
}

fn rel_rmse(x: &[f32], y: &[f32]) -> f64 {
    let (mut e, mut s) = (0f64, 0f64);
    for (a, b) in x.iter().zip(y) {
        e += (f64::from(*a) - f64::from(*b)).powi(2);
        s += f64::from(*a).powi(2);
    }
    (e / s).sqrt()
}

fn data(outliers: bool) -> Vec<f32> {
    let s = spec();
    let mut r = rng(if outliers { 11 } else { 10 });
    let mut x = gaussian(&mut r, s.elements());
    if outliers {
        outlier_channels(&s, &mut x, &mut r, 20.0);
    }
    x
}

#[test]
fn fp8_per_token_head_error() {
    let s = spec();
    let codec = Codec::new(CodecId::FP8_E4M3);
    for outliers in [false, true] {
        let x = data(outliers);
        let p = enc(&codec, s, &to_bytes(DType::Fp32, &x));
        let y = dec_f32(&codec, &p, s);
        let e = rel_rmse(&x, &y);
        eprintln!("fp8 per-(token, head), outliers={outliers}: relative RMSE {e:.5} over {} elements", x.len());
        assert!(e <= 0.028, "fp8 relative RMSE {e}");
        // Per element, in E4M3's normal range (|x / scale| ≥ 2^-6): relative error ≤ 2^-4 / (1 + 2^-4).
        let scales = PayloadParts::open(&p).unwrap().scales();
        let bound = 0.0625 / 1.0625;
        let mut worst = 0f64;
        for (i, (a, b)) in x.iter().zip(&y).enumerate() {
            let sc = scales[i / s.row_len()];
            if (a / sc).abs() >= 0.015625 {
                let rel = f64::from((a - b).abs() / a.abs());
                worst = worst.max(rel);
            }
        }
        eprintln!("  worst normal-range relative error {worst:.6} (bound {bound:.6})");
        assert!(worst <= bound * (1.0 + 1e-6), "worst {worst}");
    }
    // Per tensor, for the record (one scale per plane).
    let x = data(false);
    let c = Codec::new(CodecId::FP8_E4M3).with_fp8_scaling(kvtier_kernels::Fp8Scaling::PerTensor);
    let e = rel_rmse(&x, &dec_f32(&c, &enc(&c, s, &to_bytes(DType::Fp32, &x)), s));
    eprintln!("fp8 per-tensor: relative RMSE {e:.5}");
    assert!(e <= 0.04);
}

#[test]
fn nvfp4_error() {
    let s = spec();
    let codec = Codec::new(CodecId::NVFP4);
    for outliers in [false, true] {
        let x = data(outliers);
        let p = enc(&codec, s, &to_bytes(DType::Fp32, &x));
        let y = dec_f32(&codec, &p, s);
        let e = rel_rmse(&x, &y);
        eprintln!("nvfp4, outliers={outliers}: relative RMSE {e:.5} over {} elements", x.len());
        assert!(e <= 0.10, "nvfp4 relative RMSE {e}");
        // Per element: |error| ≤ one decoded block-scale step, max(e4m3(bs), 3·2^-9) · g (the 3·2^-9
        // covers blocks whose scale is E4M3-subnormal or rounds to zero).
        let parts = PayloadParts::open(&p).unwrap();
        let g = parts.scales();
        let bs = parts.block_scales();
        let hd = s.row_len();
        let nb = hd.div_ceil(16);
        let mut worst = 0f64;
        for (i, (a, b)) in x.iter().zip(&y).enumerate() {
            let r = i / hd;
            let gp = g[s.plane_of_row(r)];
            let step = kvtier_kernels::formats::e4m3_to_f32(bs[r * nb + (i % hd) / 16]).max(3.0 / 512.0) * gp;
            let ratio = f64::from((a - b).abs()) / f64::from(step);
            worst = worst.max(ratio);
        }
        eprintln!("  worst |error| / block-scale step {worst:.4} (bound 1)");
        assert!(worst <= 1.0 + 1e-6, "worst {worst}");
    }
}
