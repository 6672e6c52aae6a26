//! Scalar reference row kernels: one element at a time, through [`crate::formats`]. Every other
//! backend must produce the same bytes; the SIMD kernels also call these for the tails that do not
//! fill a vector.

use kvtier_proto::DType;

use crate::block::{load_f32, store_f32};
use crate::formats::{e2m1_from_f32, e2m1_to_f32, e4m3_from_f32, e4m3_to_f32};
use crate::scale::nvfp4_block_scale;

/// Largest `|x|` of a row as f32 bits. Comparing the bits of non-negative floats as integers
/// orders them like the floats, and any NaN or Inf gives a result ≥ `0x7F80_0000`, so one pass
/// finds both the amax and whether the row is finite.
pub(crate) fn row_amax_bits(dtype: DType, src: &[u8]) -> u32 {
    let n = src.len() / dtype.size() as usize;
    (0..n).map(|i| load_f32(dtype, src, i).to_bits() & 0x7FFF_FFFF).max().unwrap_or(0)
}

/// FP8 codes of a row: `e4m3(x / scale)`, saturating.
pub(crate) fn fp8_encode_row(dtype: DType, src: &[u8], scale: f32, dst: &mut [u8]) {
    for (i, d) in dst.iter_mut().enumerate() {
        *d = e4m3_from_f32(load_f32(dtype, src, i) / scale);
    }
}

/// Decodes FP8 codes times `scale` into `out`. Returns true when a NaN code was met (never
/// written by the encoder; the caller turns it into an error).
pub(crate) fn fp8_decode_row(codes: &[u8], scale: f32, out: DType, dst: &mut [u8]) -> bool {
    let mut nan = false;
    for (i, &c) in codes.iter().enumerate() {
        nan |= c & 0x7F == 0x7F;
        store_f32(out, dst, i, e4m3_to_f32(c) * scale);
    }
    nan
}

/// Encodes one micro-block of `src` (1..=16 elements) into its block scale and `ceil(n/2)` code
/// bytes (element 2i in the low nibble).
pub(crate) fn nvfp4_encode_block(dtype: DType, src: &[u8], g: f32, enc: f32, codes: &mut [u8]) -> u8 {
    let n = src.len() / dtype.size() as usize;
    let amax_b = (0..n).map(|i| load_f32(dtype, src, i).abs()).fold(0f32, f32::max);
    let (bs, _d, inv) = nvfp4_block_scale(amax_b, g, enc);
    for (j, byte) in codes.iter_mut().enumerate() {
        let mut b = 0u8;
        for half in 0..2 {
            let i = 2 * j + half;
            if i < n {
                // With inv = 0 (a zero block scale) every code is ±0, keeping the sign.
                b |= e2m1_from_f32(load_f32(dtype, src, i) * inv) << (4 * half);
            }
        }
        *byte = b;
    }
    bs
}

/// Encodes a row as NVFP4: `ceil(head_dim/16)` block scales and `ceil(head_dim/2)` code bytes.
pub(crate) fn nvfp4_encode_row(dtype: DType, src: &[u8], g: f32, enc: f32, bs: &mut [u8], codes: &mut [u8]) {
    let es = dtype.size() as usize;
    for (b, s) in bs.iter_mut().enumerate() {
        let start = b * 16 * es;
        let end = (start + 16 * es).min(src.len());
        let cstart = b * 8;
        let cend = (cstart + 8).min(codes.len());
        *s = nvfp4_encode_block(dtype, &src[start..end], g, enc, &mut codes[cstart..cend]);
    }
}

/// Decodes an NVFP4 row of `n` elements. Returns true when a block scale is not a valid unsigned
/// E4M3 code (NaN or sign bit set; never written by the encoder).
/// Only elements `start..n` are written (the SIMD kernel does the ones before).
pub(crate) fn nvfp4_decode_row(
    bs: &[u8],
    codes: &[u8],
    g: f32,
    start: usize,
    n: usize,
    out: DType,
    dst: &mut [u8],
) -> bool {
    let mut nan = false;
    for i in start..n {
        let s = bs[i / 16];
        nan |= s >= 0x7F;
        let d = e4m3_to_f32(s) * g;
        let c = (codes[i / 2] >> (4 * (i % 2))) & 0xF;
        store_f32(out, dst, i, e2m1_to_f32(c) * d);
    }
    nan
}

/// Converts a row between dtypes (used by raw decoding into another dtype).
pub(crate) fn convert_row(src_dtype: DType, src: &[u8], out: DType, dst: &mut [u8]) {
    let n = src.len() / src_dtype.size() as usize;
    for i in 0..n {
        store_f32(out, dst, i, load_f32(src_dtype, src, i));
    }
}
