//! AVX2 + F16C row kernels, eight lanes at a time. They do the same IEEE operations in the same
//! order as [`super::scalar`] (a division, a multiplication, a bit-exact conversion), so they write
//! the same bytes; the tails that do not fill a vector go through the scalar code.
//!
//! Safety, once for the whole file: every function here is `#[target_feature(enable =
//! "avx2,f16c")]` and is only called through [`super::Isa::Avx2`], which is only constructed after
//! `is_x86_feature_detected!("avx2")` and `("f16c")` both returned true. Every unaligned load or
//! store reads or writes whole elements `i..i + 8` of a slice, and each loop checks `i + 8 <= n`
//! (with `n` the slice's element count) before it, so no access leaves its slice. Nothing depends
//! on the MXCSR rounding mode: rounding is explicit (`_MM_FROUND_TO_NEAREST_INT`).

use std::arch::x86_64::*;

use kvtier_proto::DType;

use super::scalar;
use crate::formats::{e4m3_to_f32, E2M1_VALUES};

const ABS: i32 = 0x7FFF_FFFF;

const BF16: u8 = DType::Bf16 as u8;
const FP16: u8 = DType::Fp16 as u8;
const FP32: u8 = DType::Fp32 as u8;
const FP8: u8 = DType::Fp8E4m3 as u8;

/// The dtype of a const-generic code: the loops are instantiated once per dtype, so the match on
/// the dtype happens once per row, not once per vector.
#[inline]
const fn dt(d: u8) -> DType {
    match d {
        BF16 => DType::Bf16,
        FP16 => DType::Fp16,
        FP32 => DType::Fp32,
        _ => DType::Fp8E4m3,
    }
}

/// Calls `$f::<D>($args)` with `D` the const code of `$dtype`.
macro_rules! by_dtype {
    ($dtype:expr, $f:ident($($a:expr),*)) => {
        match $dtype {
            DType::Bf16 => $f::<BF16>($($a),*),
            DType::Fp16 => $f::<FP16>($($a),*),
            DType::Fp32 => $f::<FP32>($($a),*),
            DType::Fp8E4m3 => $f::<FP8>($($a),*),
        }
    };
}

/// Loads elements `i..i + 8` of `src` (little-endian `dtype`) as f32.
/// Invariant: `(i + 8) * dtype.size() <= src.len()` and `dtype` is not FP8 (callers route FP8 to
/// the scalar kernels).
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn load8<const D: u8>(src: &[u8], i: usize) -> __m256 {
    let dtype = dt(D);
    debug_assert!((i + 8) * dtype.size() as usize <= src.len());
    match dtype {
        DType::Bf16 => {
            // SAFETY: 16 bytes at 2*i are inside src (invariant above).
            let v = _mm_loadu_si128(src.as_ptr().add(2 * i) as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(v)))
        }
        DType::Fp16 => {
            // SAFETY: as above.
            _mm256_cvtph_ps(_mm_loadu_si128(src.as_ptr().add(2 * i) as *const __m128i))
        }
        DType::Fp32 => {
            // SAFETY: 32 bytes at 4*i are inside src.
            _mm256_loadu_ps(src.as_ptr().add(4 * i) as *const f32)
        }
        DType::Fp8E4m3 => {
            let mut a = [0f32; 8];
            for (k, v) in a.iter_mut().enumerate() {
                *v = e4m3_to_f32(src[i + k]);
            }
            _mm256_loadu_ps(a.as_ptr())
        }
    }
}

/// Stores eight f32 as elements `i..i + 8` of `dst` in `dtype`, rounding to nearest even (FP16
/// saturating to ±65504), exactly like `block::store_f32`.
/// Invariant: `(i + 8) * dtype.size() <= dst.len()`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn store8<const D: u8>(dst: &mut [u8], i: usize, v: __m256) {
    let dtype = dt(D);
    debug_assert!((i + 8) * dtype.size() as usize <= dst.len());
    match dtype {
        DType::Bf16 => {
            let b = _mm256_castps_si256(v);
            let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(1));
            let r = _mm256_srli_epi32::<16>(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb));
            // r holds values ≤ 0xFFFF, so the unsigned saturating pack is exact; it interleaves the
            // two 128-bit halves, which the permute undoes.
            let p = _mm256_permute4x64_epi64::<0b1000>(_mm256_packus_epi32(r, r));
            // SAFETY: 16 bytes at 2*i are inside dst.
            _mm_storeu_si128(dst.as_mut_ptr().add(2 * i) as *mut __m128i, _mm256_castsi256_si128(p));
        }
        DType::Fp16 => {
            let c = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-65504.0)), _mm256_set1_ps(65504.0));
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(c);
            // SAFETY: 16 bytes at 2*i are inside dst.
            _mm_storeu_si128(dst.as_mut_ptr().add(2 * i) as *mut __m128i, h);
        }
        // SAFETY: 32 bytes at 4*i are inside dst.
        DType::Fp32 => _mm256_storeu_ps(dst.as_mut_ptr().add(4 * i) as *mut f32, v),
        DType::Fp8E4m3 => store8_u8(dst, i, e4m3_8(v)),
    }
}

/// Writes the low byte of each 32-bit lane to `dst[i..i + 8]`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn store8_u8(dst: &mut [u8], i: usize, v: __m256i) {
    let shuf = _mm256_setr_epi8(
        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, //
        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
    );
    let p = _mm256_shuffle_epi8(v, shuf);
    let lo = _mm256_extract_epi32::<0>(p) as u32 as u64;
    let hi = _mm256_extract_epi32::<4>(p) as u32 as u64;
    dst[i..i + 8].copy_from_slice(&(lo | (hi << 32)).to_le_bytes());
}

/// Eight f32 → E4M3 codes in 32-bit lanes; the vector form of `formats::e4m3_from_f32` for
/// non-NaN inputs.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn e4m3_8(q: __m256) -> __m256i {
    let bits = _mm256_castps_si256(q);
    let sign = _mm256_and_si256(_mm256_srli_epi32::<24>(bits), _mm256_set1_epi32(0x80));
    let a = _mm256_min_ps(_mm256_and_ps(q, _mm256_castsi256_ps(_mm256_set1_epi32(ABS))), _mm256_set1_ps(448.0));
    let ab = _mm256_castps_si256(a);
    let lsb = _mm256_and_si256(_mm256_srli_epi32::<20>(ab), _mm256_set1_epi32(1));
    let normal = _mm256_sub_epi32(
        _mm256_srli_epi32::<20>(_mm256_add_epi32(_mm256_add_epi32(ab, _mm256_set1_epi32(0x7FFFF)), lsb)),
        _mm256_set1_epi32(960),
    );
    let scaled = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(a, _mm256_set1_ps(512.0)));
    let sub = _mm256_cvttps_epi32(scaled);
    let is_sub = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LT_OQ>(a, _mm256_set1_ps(0.015625)));
    _mm256_or_si256(_mm256_blendv_epi8(normal, sub, is_sub), sign)
}

/// Eight f32 → E2M1 codes (sign in bit 3) in 32-bit lanes; the vector form of
/// `formats::e2m1_from_f32`: each comparison mask is -1 where true, so subtracting it counts.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn e2m1_8(q: __m256) -> __m256i {
    let bits = _mm256_castps_si256(q);
    let sign = _mm256_and_si256(_mm256_srli_epi32::<28>(bits), _mm256_set1_epi32(8));
    let a = _mm256_and_ps(q, _mm256_castsi256_ps(_mm256_set1_epi32(ABS)));
    macro_rules! count {
        ($c:expr, $cmp:ident, $t:expr) => {
            _mm256_sub_epi32($c, _mm256_castps_si256(_mm256_cmp_ps::<$cmp>(a, _mm256_set1_ps($t))))
        };
    }
    let mut c = _mm256_setzero_si256();
    c = count!(c, _CMP_GT_OQ, 0.25);
    c = count!(c, _CMP_GE_OQ, 0.75);
    c = count!(c, _CMP_GT_OQ, 1.25);
    c = count!(c, _CMP_GE_OQ, 1.75);
    c = count!(c, _CMP_GT_OQ, 2.5);
    c = count!(c, _CMP_GE_OQ, 3.5);
    c = count!(c, _CMP_GT_OQ, 5.0);
    _mm256_or_si256(c, sign)
}

/// Packs eight 4-bit codes (one per 32-bit lane) into a u32, lane 2k in the low nibble of byte k.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn pack_nibbles8(c: __m256i) -> u32 {
    // Within each 64-bit lane, bring code 2k+1 (bits 32..36) down to bits 4..8 beside code 2k.
    let t = _mm256_or_si256(c, _mm256_srli_epi64::<28>(c));
    let shuf = _mm256_setr_epi8(
        0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, //
        0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
    );
    let p = _mm256_shuffle_epi8(t, shuf);
    let lo = _mm256_extract_epi16::<0>(p) as u16 as u32;
    let hi = _mm256_extract_epi16::<8>(p) as u16 as u32;
    lo | (hi << 16)
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn hmax_ps(v: __m256) -> f32 {
    let mut a = [0f32; 8];
    _mm256_storeu_ps(a.as_mut_ptr(), v);
    a.iter().copied().fold(0f32, f32::max)
}

/// See `scalar::row_amax_bits`.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn row_amax_bits(dtype: DType, src: &[u8]) -> u32 {
    by_dtype!(dtype, row_amax_bits_t(src))
}

#[target_feature(enable = "avx2,f16c")]
unsafe fn row_amax_bits_t<const D: u8>(src: &[u8]) -> u32 {
    let dtype = dt(D);
    let es = dtype.size() as usize;
    let n = src.len() / es;
    let abs = _mm256_set1_epi32(ABS);
    let mut acc = _mm256_setzero_si256();
    let mut i = 0;
    while i + 8 <= n {
        let x = _mm256_castps_si256(load8::<D>(src, i));
        acc = _mm256_max_epu32(acc, _mm256_and_si256(x, abs));
        i += 8;
    }
    let mut a = [0u32; 8];
    _mm256_storeu_si256(a.as_mut_ptr() as *mut __m256i, acc);
    let m = a.iter().copied().max().unwrap_or(0);
    m.max(scalar::row_amax_bits(dtype, &src[i * es..]))
}

/// See `scalar::fp8_encode_row`.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn fp8_encode_row(dtype: DType, src: &[u8], factor: f32, divide: bool, dst: &mut [u8]) {
    if divide {
        by_dtype!(dtype, fp8_encode_t_div(src, factor, dst))
    } else {
        by_dtype!(dtype, fp8_encode_t_mul(src, factor, dst))
    }
}

#[target_feature(enable = "avx2,f16c")]
unsafe fn fp8_encode_t_div<const D: u8>(src: &[u8], factor: f32, dst: &mut [u8]) {
    fp8_encode_t::<D, true>(src, factor, dst)
}

#[target_feature(enable = "avx2,f16c")]
unsafe fn fp8_encode_t_mul<const D: u8>(src: &[u8], factor: f32, dst: &mut [u8]) {
    fp8_encode_t::<D, false>(src, factor, dst)
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn fp8_encode_t<const D: u8, const DIV: bool>(src: &[u8], factor: f32, dst: &mut [u8]) {
    let es = dt(D).size() as usize;
    let n = dst.len();
    let f = _mm256_set1_ps(factor);
    macro_rules! scale {
        ($x:expr) => {
            if DIV {
                _mm256_div_ps($x, f)
            } else {
                _mm256_mul_ps($x, f)
            }
        };
    }
    let mut i = 0;
    while i + 32 <= n {
        let c0 = e4m3_8(scale!(load8::<D>(src, i)));
        let c1 = e4m3_8(scale!(load8::<D>(src, i + 8)));
        let c2 = e4m3_8(scale!(load8::<D>(src, i + 16)));
        let c3 = e4m3_8(scale!(load8::<D>(src, i + 24)));
        // Codes are 0..=255 in 32-bit lanes: the saturating packs are exact; they interleave the
        // 128-bit halves, which the final permute undoes.
        let p = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
        let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        // SAFETY: 32 bytes at i are inside dst (loop condition).
        _mm256_storeu_si256(dst.as_mut_ptr().add(i) as *mut __m256i, p);
        i += 32;
    }
    while i + 8 <= n {
        store8_u8(dst, i, e4m3_8(scale!(load8::<D>(src, i))));
        i += 8;
    }
    scalar::fp8_encode_row(dt(D), &src[i * es..], factor, DIV, &mut dst[i..]);
}

/// See `scalar::fp8_decode_row`. E4M3 code `c` is turned into the FP16 bit pattern whose value
/// is `c · 2^-8` (same sign, exponent rebias 7 → 15, subnormals included), converted by F16C, and
/// multiplied by `256 · scale` — one rounding, the same product as the scalar `table[c] · scale`.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn fp8_decode_row(codes: &[u8], scale: f32, out: DType, dst: &mut [u8]) -> bool {
    by_dtype!(out, fp8_decode_t(codes, scale, dst))
}

#[target_feature(enable = "avx2,f16c")]
unsafe fn fp8_decode_t<const D: u8>(codes: &[u8], scale: f32, dst: &mut [u8]) -> bool {
    let out = dt(D);
    let os = out.size() as usize;
    let n = codes.len();
    let sc = _mm256_set1_ps(scale * 256.0);
    let m7f = _mm_set1_epi8(0x7F);
    let mut bad = _mm_setzero_si128();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: 8 bytes at i are inside codes; the upper 8 lanes are zeroed by the load.
        let b = _mm_loadl_epi64(codes.as_ptr().add(i) as *const __m128i);
        bad = _mm_or_si128(bad, _mm_cmpeq_epi8(_mm_and_si128(b, m7f), m7f));
        let w = _mm_cvtepu8_epi16(b);
        let h = _mm_or_si128(
            _mm_slli_epi16::<7>(_mm_and_si128(w, _mm_set1_epi16(0x7F))),
            _mm_slli_epi16::<8>(_mm_and_si128(w, _mm_set1_epi16(0x80))),
        );
        store8::<D>(dst, i, _mm256_mul_ps(_mm256_cvtph_ps(h), sc));
        i += 8;
    }
    let tail_bad = scalar::fp8_decode_row(&codes[i..], scale, out, &mut dst[i * os..]);
    _mm_movemask_epi8(bad) != 0 || tail_bad
}

/// See `scalar::nvfp4_encode_row`.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn nvfp4_encode_row(dtype: DType, src: &[u8], g: f32, enc: f32, bs: &mut [u8], codes: &mut [u8]) {
    by_dtype!(dtype, nvfp4_encode_t(src, g, enc, bs, codes))
}

#[target_feature(enable = "avx2,f16c")]
unsafe fn nvfp4_encode_t<const D: u8>(src: &[u8], g: f32, enc: f32, bs: &mut [u8], codes: &mut [u8]) {
    let dtype = dt(D);
    let es = dtype.size() as usize;
    let n = src.len() / es;
    let full = n / 16;
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(ABS));
    for b in 0..full {
        let x0 = load8::<D>(src, 16 * b);
        let x1 = load8::<D>(src, 16 * b + 8);
        let amax_b = hmax_ps(_mm256_max_ps(_mm256_and_ps(x0, abs), _mm256_and_ps(x1, abs)));
        let (s, _d, inv) = scalar::nvfp4_block_scale(amax_b, g, enc);
        bs[b] = s;
        let iv = _mm256_set1_ps(inv);
        let w0 = pack_nibbles8(e2m1_8(_mm256_mul_ps(x0, iv)));
        let w1 = pack_nibbles8(e2m1_8(_mm256_mul_ps(x1, iv)));
        codes[8 * b..8 * b + 4].copy_from_slice(&w0.to_le_bytes());
        codes[8 * b + 4..8 * b + 8].copy_from_slice(&w1.to_le_bytes());
    }
    if full * 16 < n {
        bs[full] = scalar::nvfp4_encode_block(dtype, &src[full * 16 * es..], g, enc, &mut codes[full * 8..]);
    }
}

/// See `scalar::nvfp4_decode_row`. Nibble `k` of a little-endian u32 is selected by a per-lane
/// variable shift, and its magnitude looked up with a lane permute of the eight E2M1 values.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn nvfp4_decode_row(bs: &[u8], codes: &[u8], g: f32, n: usize, out: DType, dst: &mut [u8]) -> bool {
    by_dtype!(out, nvfp4_decode_t(bs, codes, g, n, dst))
}

#[target_feature(enable = "avx2,f16c")]
unsafe fn nvfp4_decode_t<const D: u8>(bs: &[u8], codes: &[u8], g: f32, n: usize, dst: &mut [u8]) -> bool {
    let out = dt(D);
    let table = _mm256_loadu_ps(E2M1_VALUES.as_ptr());
    let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    let full = n / 16;
    let mut bad = false;
    for b in 0..full {
        let s = bs[b];
        bad |= s >= 0x7F;
        let d = _mm256_set1_ps(e4m3_to_f32(s) * g);
        for h in 0..2 {
            let o = 8 * b + 4 * h;
            let w = u32::from_le_bytes([codes[o], codes[o + 1], codes[o + 2], codes[o + 3]]);
            let c = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w as i32), shifts), _mm256_set1_epi32(0xF));
            let mag = _mm256_permutevar8x32_ps(table, _mm256_and_si256(c, _mm256_set1_epi32(7)));
            let sign = _mm256_slli_epi32::<28>(_mm256_and_si256(c, _mm256_set1_epi32(8)));
            let v = _mm256_or_ps(mag, _mm256_castsi256_ps(sign));
            store8::<D>(dst, 16 * b + 8 * h, _mm256_mul_ps(v, d));
        }
    }
    scalar::nvfp4_decode_row(bs, codes, g, full * 16, n, out, dst) || bad
}

/// E2M1 code of each f32 (one per byte, unscaled); a test hook for the golden vectors.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn e2m1_slice(xs: &[f32], out: &mut [u8]) {
    let n = xs.len().min(out.len());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: elements i..i+8 are inside xs (loop condition).
        let x = _mm256_loadu_ps(xs.as_ptr().add(i));
        store8_u8(out, i, e2m1_8(x));
        i += 8;
    }
    for k in i..n {
        out[k] = crate::formats::e2m1_from_f32(xs[k]);
    }
}
