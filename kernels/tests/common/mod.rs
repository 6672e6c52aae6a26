//! Shared helpers for the integration tests: seeded data and block builders.
#![allow(dead_code)]

use half::{bf16, f16};
use kvtier_kernels::{BlockSpec, Codec, KvBlockView, PayloadParts};
use kvtier_proto::DType;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// Standard normal samples (Box–Muller).
pub fn gaussian(rng: &mut StdRng, n: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(n + 1);
    while v.len() < n {
        let u1: f64 = rng.random::<f64>().max(1e-300);
        let u2: f64 = rng.random();
        let r = (-2.0 * u1.ln()).sqrt();
        v.push((r * (2.0 * std::f64::consts::PI * u2).cos()) as f32);
        v.push((r * (2.0 * std::f64::consts::PI * u2).sin()) as f32);
    }
    v.truncate(n);
    v
}

/// Multiplies 1% of the channels (the last index, `head_dim`, across heads) by `factor`.
pub fn outlier_channels(spec: &BlockSpec, x: &mut [f32], rng: &mut StdRng, factor: f32) {
    let channels = usize::from(spec.kv_heads) * spec.row_len();
    let k = (channels / 100).max(1);
    let chosen: Vec<usize> = (0..k).map(|_| rng.random_range(0..channels)).collect();
    for (i, v) in x.iter_mut().enumerate() {
        if chosen.contains(&(i % channels)) {
            *v *= factor;
        }
    }
}

/// Encodes `x` in `dtype` (rounding to nearest even).
pub fn to_bytes(dtype: DType, x: &[f32]) -> Vec<u8> {
    match dtype {
        DType::Bf16 => x.iter().flat_map(|v| bf16::from_f32(*v).to_bits().to_le_bytes()).collect(),
        DType::Fp16 => x.iter().flat_map(|v| f16::from_f32(*v).to_bits().to_le_bytes()).collect(),
        DType::Fp32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::Fp8E4m3 => x.iter().map(|v| kvtier_kernels::formats::e4m3_from_f32(*v)).collect(),
    }
}

pub fn from_bytes(dtype: DType, b: &[u8]) -> Vec<f32> {
    match dtype {
        DType::Bf16 => b.chunks_exact(2).map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()).collect(),
        DType::Fp16 => b.chunks_exact(2).map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()).collect(),
        DType::Fp32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        DType::Fp8E4m3 => b.iter().map(|c| kvtier_kernels::formats::e4m3_to_f32(*c)).collect(),
    }
}

/// Encodes `bytes` of `spec` and returns the payload.
pub fn enc(codec: &Codec, spec: BlockSpec, bytes: &[u8]) -> Vec<u8> {
    codec.encode(&KvBlockView::new(spec, bytes).unwrap()).unwrap()
}

/// (scales, block scales, codes) of a payload.
pub fn sections(payload: &[u8]) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    let p = PayloadParts::open(payload).unwrap();
    (p.scale_bytes().to_vec(), p.block_scales().to_vec(), p.codes().to_vec())
}

/// Decodes into f32 values.
pub fn dec_f32(codec: &Codec, payload: &[u8], spec: BlockSpec) -> Vec<f32> {
    let mut out = vec![0u8; spec.elements() * 4];
    codec.decode_into(payload, &spec, DType::Fp32, &mut out).unwrap();
    from_bytes(DType::Fp32, &out)
}
