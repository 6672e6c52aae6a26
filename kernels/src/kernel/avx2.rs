//! AVX2 + F16C (+ FMA) row kernels, eight f32 lanes at a time. They write the same bytes as
//! [`super::scalar`]: every rounding the reference does happens here too, on the same value, in
//! the same IEEE operation or in one proven to give the identical result (each such substitution
//! is documented at its function and checked by a test):
//!
//! - FP8 per (token, head): rows eight at a time — their amaxes reduced into one vector, their
//!   scales computed together ([`fp8_scale8`]) — then the codes 32 elements per step. The division
//!   `x / s` is replaced by [`quot`]'s exact reciprocal form (one product and one FMA) when the
//!   scale allows it; the E4M3 rounding is one f32 addition of a per-lane power of two
//!   ([`e4m3_mag8`]); signs are taken from the input bytes; bf16 is widened by unpacking.
//! - NVFP4: micro-blocks eight at a time ([`nvfp4_group`]): their amaxes reduced into one vector
//!   ([`reduce8`]), their block scales and reciprocals computed together ([`block_scales8`]), the
//!   E2M1 rounding by the same addition trick ([`e2m1_mag8_biased`]), nibbles paired by one
//!   multiply-add.
//!
//! - The rotated (`+had`) codecs: the transform held in registers chunk by chunk
//!   ([`crate::fwht::avx2`]; chunks of 128 and 256 as sub-chunks of eight vectors, so sixteen
//!   registers do not spill), fused with FP8 quantization (eight rows through an L1 buffer, the
//!   range check read off the rotated values, [`fp8_encode_rows_rotated`]) and with FP8 and NVFP4
//!   dequantization (no f32 row in memory, [`fp8_decode_rows_rotated`],
//!   [`nvfp4_decode_rows_rotated`]); the NVFP4 plane rotation returns its amax
//!   ([`rotate_rows_max`]). For the head dims of [`covers`], as the AVX-512 kernels.
//!
//! Tails that do not fill a vector go through the scalar code.
//!
//! Safety, once for the whole file: every function here is `#[target_feature(enable =
//! "avx2,f16c,fma")]` and is only called through [`super::Isa::Avx2`], which is only constructed
//! after `is_x86_feature_detected!` returned true for "avx2", "f16c" and "fma". Every unaligned load
//! or store reads or writes whole elements `i..i + k` of a slice (k = 8, 16 or 32 as named at the
//! access), and each loop checks `i + k <= n` (with `n` the slice's element count) before it, so
//! no access leaves its slice; prefetches only hint and never dereference. Conversions round
//! explicitly (`_MM_FROUND_TO_NEAREST_INT`); arithmetic uses the default round-to-nearest-even
//! mode, like the scalar reference.

use std::arch::x86_64::*;

use kvtier_proto::DType;

use super::scalar;
use crate::formats::{e4m3_to_f32, E2M1_VALUES};
use crate::fwht::avx2::{fwht8, wht_cross, wht_regs, wht_rest};

const ABS: i32 = 0x7FFF_FFFF;

const BF16: u8 = DType::Bf16 as u8;
const FP16: u8 = DType::Fp16 as u8;
pub(crate) const FP32: u8 = DType::Fp32 as u8;
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
#[target_feature(enable = "avx2,f16c,fma")]
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
#[target_feature(enable = "avx2,f16c,fma")]
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
            // The bound first: `maxps`/`minps` return their second operand when one is NaN, so a
            // NaN stays NaN, as `f32::clamp` keeps it in the scalar code.
            let c = _mm256_min_ps(_mm256_set1_ps(65504.0), _mm256_max_ps(_mm256_set1_ps(-65504.0), v));
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
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn store8_u8(dst: &mut [u8], i: usize, v: __m256i) {
    let b = bytes8(v).to_le_bytes();
    dst[i..i + 8].copy_from_slice(&b);
}

/// The low byte of each 32-bit lane, lane k in byte k of the result.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
pub(crate) unsafe fn bytes8(v: __m256i) -> u64 {
    let shuf = _mm256_setr_epi8(
        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, //
        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
    );
    let p = _mm256_shuffle_epi8(v, shuf);
    let lo = _mm256_extract_epi32::<0>(p) as u32 as u64;
    let hi = _mm256_extract_epi32::<4>(p) as u32 as u64;
    lo | (hi << 32)
}

/// E4M3 magnitude codes (0..=126, in 32-bit lanes) of eight non-negative, non-NaN f32, rounding
/// to nearest even: the magnitude part of `formats::e4m3_from_f32`. With `sat` (a constant after
/// inlining) every input
/// saturates at 448; without, inputs must be below 464 (where 448's rounding interval ends).
///
/// One rounding for every range: with `e = max(exponent(a), -6)` (−6 being E4M3's smallest normal
/// exponent), `m = 2^(e+20)` has an ulp of `2^(e-3)`, E4M3's spacing at `a`, so the f32 addition
/// `a + m` rounds `a` to E4M3 precision with round-to-nearest-even, and `bits(a + m) − bits(m)`
/// is `a` in units of that spacing: 8..=16 for a normal `a` (16: the rounding carried into the
/// next exponent), 0..=8 for a subnormal one. The code is then `(e + 6)·8 + units`, which also
/// covers the carry; `e + 6` is the exponent field of `m`'s source `max(bits(a) & exp, 121 << 23)`
/// minus 121.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn e4m3_mag8(a: __m256, sat: bool) -> __m256i {
    _mm256_sub_epi32(e4m3_mag8_biased(a, sat), _mm256_set1_epi32(E4M3_BIAS))
}

/// [`e4m3_mag8`] plus [`E4M3_BIAS`] (the subtraction is left to the caller, who can do it once per
/// sixteen codes on packed words): `(t − m) + (m >> 20)`, at most 1254.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn e4m3_mag8_biased(a: __m256, sat: bool) -> __m256i {
    let a = if sat { _mm256_min_ps(a, _mm256_set1_ps(448.0)) } else { a };
    let ab = _mm256_castps_si256(a);
    // m = 2^(max(exponent, -6) + 20), built as max(2^(exponent + 20), 2^14) so that the compiler
    // cannot re-associate `t − m` through it (which costs an extra operation).
    let m = _mm256_max_epi32(
        _mm256_add_epi32(_mm256_and_si256(ab, _mm256_set1_epi32(0x7F80_0000)), _mm256_set1_epi32(20 << 23)),
        _mm256_set1_epi32(141 << 23),
    );
    let t = _mm256_castps_si256(_mm256_add_ps(a, _mm256_castsi256_ps(m)));
    _mm256_add_epi32(_mm256_sub_epi32(t, m), _mm256_srli_epi32::<20>(m))
}

/// How far ahead (in rows) the row loops prefetch the input they will read next.
const PREFETCH_ROWS: usize = 32;

/// `(e + 6)·8 = (m >> 20) − 141·8` in [`e4m3_mag8_biased`] (m's exponent field is e + 147).
const E4M3_BIAS: i32 = 1128;

/// E2M1 magnitude codes (0..=7, in 32-bit lanes) of eight non-negative, non-NaN f32, saturating
/// at 6 (±Inf included): [`e2m1_mag8_biased`] minus [`E2M1_BIAS`], clamped to 7.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn e2m1_mag8(a: __m256) -> __m256i {
    _mm256_min_epi32(_mm256_sub_epi32(e2m1_mag8_biased(a), _mm256_set1_epi32(E2M1_BIAS)), _mm256_set1_epi32(7))
}

/// The construction of [`e4m3_mag8_biased`] for E2M1 (1 mantissa bit, smallest normal exponent
/// 0): `m = 2^(max(exponent, 0) + 22)`, whose ulp is E2M1's spacing at `a`; the code plus
/// [`E2M1_BIAS`] is `(t − m) + (m >> 22)`, where `t − m` counts units of that spacing (2..=4 for
/// `a ≥ 1`, 0..=2 below). Without saturation: every `a ≥ 6` gives a code ≥ 7 (a code of 7 or 8
/// for `a < 8`, more above; non-negative, no overflow for any finite or infinite `a`), so a
/// clamp to 7 afterwards — once per sixteen packed words — saturates exactly as the scalar code.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn e2m1_mag8_biased(a: __m256) -> __m256i {
    let ab = _mm256_castps_si256(a);
    let m = _mm256_max_epi32(
        _mm256_add_epi32(_mm256_and_si256(ab, _mm256_set1_epi32(0x7F80_0000)), _mm256_set1_epi32(22 << 23)),
        _mm256_set1_epi32(149 << 23),
    );
    let t = _mm256_castps_si256(_mm256_add_ps(a, _mm256_castsi256_ps(m)));
    _mm256_add_epi32(_mm256_sub_epi32(t, m), _mm256_srli_epi32::<22>(m))
}

/// `2e = (m >> 22) − 149·2` in [`e2m1_mag8_biased`].
pub(crate) const E2M1_BIAS: i32 = 298;

/// `64·(code + E2M1_BIAS)` for eight non-negative, non-NaN f32, saturating at 6: the E2M1 code
/// of [`e2m1_mag8_biased`], with its last three operations replaced by one multiply-add. After
/// the clamp to 6, `t = bits(a + m)` has `units` (0..=4) in its low 16 bits and
/// `(e + 149)·128 ≤ 151·128` (a positive i16) in its high 16 bits, so `_mm256_madd_epi16` with
/// weights (64, 1) gives `64·units + 128·(e + 149) = 64·(units + 2e + 298)`. The caller removes
/// the factor and the bias once per sixteen packed words (`>> 6`, `− 298`).
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn e2m1_mag8_x64(a: __m256) -> __m256i {
    let a = _mm256_min_ps(a, _mm256_set1_ps(6.0));
    let ab = _mm256_castps_si256(a);
    let m = _mm256_max_epi32(
        _mm256_add_epi32(_mm256_and_si256(ab, _mm256_set1_epi32(0x7F80_0000)), _mm256_set1_epi32(22 << 23)),
        _mm256_set1_epi32(149 << 23),
    );
    let t = _mm256_castps_si256(_mm256_add_ps(a, _mm256_castsi256_ps(m)));
    _mm256_madd_epi16(t, _mm256_set1_epi32(0x0001_0040))
}

/// Eight f32 → E4M3 codes in 32-bit lanes; the vector form of `formats::e4m3_from_f32` for
/// non-NaN inputs (±Inf saturates).
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn e4m3_8(q: __m256) -> __m256i {
    let bits = _mm256_castps_si256(q);
    let sign = _mm256_and_si256(_mm256_srli_epi32::<24>(bits), _mm256_set1_epi32(0x80));
    let a = _mm256_and_ps(q, _mm256_castsi256_ps(_mm256_set1_epi32(ABS)));
    _mm256_or_si256(e4m3_mag8(a, true), sign)
}

/// Eight f32 → E2M1 codes (sign in bit 3) in 32-bit lanes; the vector form of
/// `formats::e2m1_from_f32`, NaN lanes included (→ ±0, as the scalar comparisons give).
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn e2m1_8(q: __m256) -> __m256i {
    let bits = _mm256_castps_si256(q);
    let sign = _mm256_and_si256(_mm256_srli_epi32::<28>(bits), _mm256_set1_epi32(8));
    let a = _mm256_and_ps(q, _mm256_castsi256_ps(_mm256_set1_epi32(ABS)));
    let ordered = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_ORD_Q>(a, a));
    _mm256_or_si256(_mm256_and_si256(e2m1_mag8(a), ordered), sign)
}

/// Exact E4M3 value (f32) of magnitude codes 0..=126 in 32-bit lanes: `(c << 20) + (120 << 23)`
/// is the f32 pattern of a normal code, `c · 2^-9` (exact) the value of a subnormal one.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn e4m3_mag_to_f32_8(c: __m256i) -> __m256 {
    let normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32::<20>(c), _mm256_set1_epi32(120 << 23)));
    let sub = _mm256_mul_ps(_mm256_cvtepi32_ps(c), _mm256_set1_ps(0.001953125));
    let is_sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), c));
    _mm256_blendv_ps(normal, sub, is_sub)
}

/// `fl(a / s)` for non-negative `a`. With `EXACT`, `p` and `q` are [`recip_split`]`(s)`, the
/// reciprocal as a sum of two f32, and the quotient is `fl(a·p + fl(a·q))`, one FMA after one
/// product; else `p = s` and this is a true division.
///
/// `EXACT` requires (checked by the callers, see [`exact_ok`]): `s` a normal f32 with at most 20
/// significant bits, `2^-60 ≤ s ≤ 2^100`, and `a ≤ 448·s`. Why it is then exactly the division:
/// scale `a` and `s` into [1, 2). `p + q` is `1/s` within 2^-48.9 relative (`q` is the rounded
/// remainder of an f64 reciprocal) and `fl(a·q)` adds at most `2^-24·|a·q| ≤ 2^-48·a/s`, so the
/// FMA rounds a value within `1.5·2^-48·(a/s) < 2^-46.4` of `a/s`. Meanwhile `a/s` is never
/// within 2^-45 of a rounding midpoint `m` (25 significant bits): `a − s·m` is a multiple of
/// `ulp(s)·ulp(m) = 2^-19·2^-25`, and it is not 0 because `s·m`, an odd 25-bit number times
/// anything, has more than 24 significant bits; divided by `s < 2` that is more than 2^-45. So
/// both round to the same f32. The range of `s` keeps every term normal whenever the quotient
/// reaches 2^-12 (below that, every candidate encodes as code 0), and `a ≤ 448·s` keeps it far from
/// overflow. `tests::exact_quotient_is_the_division` checks it over every bf16 mantissa and many
/// scales; an exhaustive run over every bf16 and fp16 mantissa and every scale (done once, ~5 min).
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn quot<const EXACT: bool>(a: __m256, p: __m256, q: __m256) -> __m256 {
    if EXACT {
        _mm256_fmadd_ps(a, p, _mm256_mul_ps(a, q))
    } else {
        _mm256_div_ps(a, p)
    }
}

/// `(fl(1/s), fl(1/s − fl(1/s)))` for [`quot`], the low part from an f64 reciprocal.
#[inline]
pub(crate) fn recip_split(s: f32) -> (f32, f32) {
    let hi = 1.0 / s;
    let lo = ((1.0 / f64::from(s)) - f64::from(hi)) as f32;
    (hi, lo)
}

/// [`recip_split`] of eight lanes.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
pub(crate) unsafe fn recip_split8(s: __m256) -> (__m256, __m256) {
    let hi = _mm256_div_ps(_mm256_set1_ps(1.0), s);
    let one = _mm256_set1_pd(1.0);
    let lo = |s4: __m128, h4: __m128| {
        _mm256_cvtpd_ps(_mm256_sub_pd(_mm256_div_pd(one, _mm256_cvtps_pd(s4)), _mm256_cvtps_pd(h4)))
    };
    let l0 = lo(_mm256_castps256_ps128(s), _mm256_castps256_ps128(hi));
    let l1 = lo(_mm256_extractf128_ps::<1>(s), _mm256_extractf128_ps::<1>(hi));
    (hi, _mm256_set_m128(l1, l0))
}

/// Loads sixteen 16-bit elements `i..i + 16` (bf16 or fp16 bits).
/// Invariant: `(i + 16) * 2 <= src.len()`.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn load16x16(src: &[u8], i: usize) -> __m256i {
    debug_assert!((i + 16) * 2 <= src.len());
    // SAFETY: 32 bytes at 2*i are inside src (invariant above).
    _mm256_loadu_si256(src.as_ptr().add(2 * i) as *const __m256i)
}

/// Magnitudes of sixteen elements `i..i + 16` as two f32 vectors `(lo, hi)` and the sign-bearing
/// raw value, in an order that [`join16`] undoes: for bf16 the lanes are unpacked (`lo` holds
/// elements 0–3 and 8–11, `hi` 4–7 and 12–15), which `_mm256_packus_epi32(lo, hi)` puts back in
/// order; for fp16 and fp32 `lo` is 0–7 and `hi` 8–15.
/// Invariant: elements `i..i + 16` are inside `src` and `D` is not FP8.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn mags16<const D: u8>(src: &[u8], i: usize) -> (__m256, __m256) {
    match dt(D) {
        DType::Bf16 | DType::Fp16 => widen16::<D>(_mm256_and_si256(load16x16(src, i), _mm256_set1_epi16(0x7FFF))),
        _ => {
            let abs = _mm256_castsi256_ps(_mm256_set1_epi32(ABS));
            (_mm256_and_ps(load8::<D>(src, i), abs), _mm256_and_ps(load8::<D>(src, i + 8), abs))
        }
    }
}

/// [`mags16`] of sixteen bf16 or fp16 magnitudes already loaded.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn widen16<const D: u8>(a: __m256i) -> (__m256, __m256) {
    if D == BF16 {
        let z = _mm256_setzero_si256();
        (_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, a)), _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, a)))
    } else {
        (_mm256_cvtph_ps(_mm256_castsi256_si128(a)), _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(a)))
    }
}

/// Packs the codes of [`mags16`]'s two halves (32-bit lanes, values ≤ 0xFFFF) into sixteen words
/// in element order: elements 0–7 in the low 128-bit lane, 8–15 in the high one.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn join16<const D: u8>(lo: __m256i, hi: __m256i) -> __m256i {
    // The pack works within 128-bit lanes, which undoes bf16's unpack exactly; for the other
    // dtypes it leaves [0–3, 8–11 | 4–7, 12–15], which the 64-bit permute puts in order.
    let p = _mm256_packus_epi32(lo, hi);
    if D == BF16 {
        p
    } else {
        _mm256_permute4x64_epi64::<0xD8>(p)
    }
}

/// The sign bit of elements `i..i + 16` moved to bit `B` of sixteen words in element order.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn signs16<const D: u8, const B: i32>(src: &[u8], i: usize) -> __m256i {
    let m = _mm256_set1_epi16(1 << B);
    match dt(D) {
        DType::Bf16 | DType::Fp16 => {
            let v = load16x16(src, i);
            // Each word's bit 15 to bit B: a logical shift by 15 - B, then the mask.
            let s = match B {
                3 => _mm256_srli_epi16::<12>(v),
                _ => _mm256_srli_epi16::<8>(v),
            };
            _mm256_and_si256(s, m)
        }
        _ => {
            // SAFETY: 64 bytes at 4*i are inside src (elements i..i+16).
            let a = _mm256_srli_epi32::<16>(_mm256_castps_si256(load8::<D>(src, i)));
            let b = _mm256_srli_epi32::<16>(_mm256_castps_si256(load8::<D>(src, i + 8)));
            let w = _mm256_permute4x64_epi64::<0xD8>(_mm256_packus_epi32(a, b));
            let s = match B {
                3 => _mm256_srli_epi16::<12>(w),
                _ => _mm256_srli_epi16::<8>(w),
            };
            _mm256_and_si256(s, m)
        }
    }
}

/// FP8 magnitude codes of elements `i..i + 16` as sixteen words in element order.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn fp8_mag_words16<const D: u8, const EXACT: bool>(src: &[u8], i: usize, p: __m256, q: __m256) -> __m256i {
    let (lo, hi) = mags16::<D>(src, i);
    // The exact quotient of a bounded row is at most 448·(1 + 2^-23): no saturation needed.
    let c = join16::<D>(
        e4m3_mag8_biased(quot::<EXACT>(lo, p, q), !EXACT),
        e4m3_mag8_biased(quot::<EXACT>(hi, p, q), !EXACT),
    );
    _mm256_sub_epi16(c, _mm256_set1_epi16(E4M3_BIAS as i16))
}

/// The FP8 sign bits (0x80) of elements `i..i + 16` and `j..j + 16`, laid out like
/// `_mm256_packus_epi16` of their [`fp8_mag_words16`]: [i 0–7, j 0–7 | i 8–15, j 8–15].
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn fp8_sign_bytes<const D: u8>(src: &[u8], i: usize, j: usize) -> __m256i {
    if D == BF16 || D == FP16 {
        // Signed saturation maps every word with the sign bit set (a negative finite value,
        // at most 0xFF7F for bf16 and 0xFBFF for fp16 as i16) to 0x80, and every other word to
        // 0x00..=0x7F, so bit 7 of the byte is the sign.
        let p = _mm256_packs_epi16(load16x16(src, i), load16x16(src, j));
        _mm256_and_si256(p, _mm256_set1_epi8(0x80u8 as i8))
    } else {
        _mm256_packus_epi16(signs16::<D, 7>(src, i), signs16::<D, 7>(src, j))
    }
}

/// Horizontal max of sixteen u16.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn hmax_epu16(v: __m256i) -> u16 {
    let m = _mm_max_epu16(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let m = _mm_max_epu16(m, _mm_srli_si128::<8>(m));
    let m = _mm_max_epu16(m, _mm_srli_si128::<4>(m));
    let m = _mm_max_epu16(m, _mm_srli_si128::<2>(m));
    _mm_extract_epi16::<0>(m) as u16
}

/// See `scalar::row_amax_bits`.
#[target_feature(enable = "avx2,f16c,fma")]
pub(crate) unsafe fn row_amax_bits(dtype: DType, src: &[u8]) -> u32 {
    by_dtype!(dtype, row_amax_bits_t(src))
}

/// For bf16 and fp16 the magnitude bits order like the values (NaN and Inf above every finite
/// value), so the max is taken on 16-bit words and widened once at the end.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn row_amax_bits_t<const D: u8>(src: &[u8]) -> u32 {
    let dtype = dt(D);
    let es = dtype.size() as usize;
    let n = src.len() / es;
    let mut i = 0;
    let m = match dtype {
        DType::Bf16 | DType::Fp16 => {
            let abs = _mm256_set1_epi16(0x7FFF);
            let (mut a0, mut a1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
            while i + 32 <= n {
                a0 = _mm256_max_epu16(a0, _mm256_and_si256(load16x16(src, i), abs));
                a1 = _mm256_max_epu16(a1, _mm256_and_si256(load16x16(src, i + 16), abs));
                i += 32;
            }
            while i + 16 <= n {
                a0 = _mm256_max_epu16(a0, _mm256_and_si256(load16x16(src, i), abs));
                i += 16;
            }
            let h = hmax_epu16(_mm256_max_epu16(a0, a1));
            if D == BF16 {
                u32::from(h) << 16
            } else {
                half::f16::from_bits(h).to_f32().to_bits()
            }
        }
        _ => {
            let abs = _mm256_set1_epi32(ABS);
            let mut acc = _mm256_setzero_si256();
            while i + 8 <= n {
                let x = _mm256_castps_si256(load8::<D>(src, i));
                acc = _mm256_max_epu32(acc, _mm256_and_si256(x, abs));
                i += 8;
            }
            let mut a = [0u32; 8];
            // SAFETY: a is 32 bytes.
            _mm256_storeu_si256(a.as_mut_ptr() as *mut __m256i, acc);
            a.iter().copied().max().unwrap_or(0)
        }
    };
    m.max(scalar::row_amax_bits(dtype, &src[i * es..]))
}

/// Encodes a run of rows with one FP8 scale per row (per (token, head)): `src` holds whole rows
/// of `hd` elements, `scales` 4 bytes and `codes` `hd` bytes per row. Returns the index of the
/// first row holding a NaN or Inf (its scale and codes, and those after it, are not written).
#[target_feature(enable = "avx2,f16c,fma")]
pub(crate) unsafe fn fp8_encode_rows(
    dtype: DType,
    src: &[u8],
    hd: usize,
    scales: &mut [u8],
    codes: &mut [u8],
) -> Option<usize> {
    by_dtype!(dtype, fp8_encode_rows_t(src, hd, scales, codes))
}

#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn fp8_encode_rows_t<const D: u8>(src: &[u8], hd: usize, scales: &mut [u8], codes: &mut [u8]) -> Option<usize> {
    let row_bytes = hd * dt(D).size() as usize;
    let rows = codes.len() / hd.max(1);
    let mut r = 0;
    // Eight rows at a time: their amaxes reduced into one vector and their scales computed
    // together (no scalar division chain per row), then the rows encoded back to back. The scales
    // of the next eight rows are computed before this batch's codes, so that their dependency
    // chain (amax, two divisions) overlaps this batch's work instead of stalling the next one.
    let mut cur = if rows >= 8 { fp8_batch_scales::<D>(src, 0, row_bytes) } else { None };
    while let Some((s, se, yh, yl)) = cur {
        cur = if r + 16 <= rows { fp8_batch_scales::<D>(src, r + 8, row_bytes) } else { None };
        // SAFETY: 32 bytes at 4*r are inside scales (rows r..r+8 exist, 4 bytes each).
        _mm256_storeu_ps(scales.as_mut_ptr().add(4 * r) as *mut f32, s);
        // Bring rows a few batches ahead (read first by their amax pass) toward L1 meanwhile.
        let next = src.as_ptr().wrapping_add((r + PREFETCH_ROWS) * row_bytes);
        let mut off = 0;
        while off < 8 * row_bytes {
            // SAFETY: a prefetch never faults and reads nothing the program can observe; the
            // address is computed with wrapping arithmetic and never dereferenced.
            _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(off) as *const i8);
            off += 64;
        }
        if hd.is_multiple_of(32) && exact_ok8(se) {
            // The common case (every row's scale allows the exact reciprocal form, a head_dim of
            // whole 32-element steps): one flat loop over the eight rows.
            let bsrc = &src[r * row_bytes..(r + 8) * row_bytes];
            let bdst = &mut codes[r * hd..(r + 8) * hd];
            for k in 0..8 {
                let idx = _mm256_set1_epi32(k as i32);
                let (p, q) = (_mm256_permutevar8x32_ps(yh, idx), _mm256_permutevar8x32_ps(yl, idx));
                let mut i = k * hd;
                while i < (k + 1) * hd {
                    fp8_step32::<D, true>(bsrc, bdst, i, p, q);
                    i += 32;
                }
            }
            r += 8;
            continue;
        }
        let mut sv = [0f32; 8];
        // SAFETY: sv is 32 bytes.
        _mm256_storeu_ps(sv.as_mut_ptr(), se);
        for (k, &sk) in sv.iter().enumerate() {
            let row = &src[(r + k) * row_bytes..(r + k + 1) * row_bytes];
            let dst = &mut codes[(r + k) * hd..(r + k + 1) * hd];
            let idx = _mm256_set1_epi32(k as i32);
            // Every |x| ≤ amax ≤ 448·s (s is rounded up), or all |x| < 2^-100 ≤ 448 when s = 0.
            if exact_ok(sk) {
                let (p, q) = (_mm256_permutevar8x32_ps(yh, idx), _mm256_permutevar8x32_ps(yl, idx));
                fp8_encode_loop::<D, true>(row, sk, p, q, dst);
            } else {
                let p = _mm256_permutevar8x32_ps(se, idx);
                fp8_encode_loop::<D, false>(row, sk, p, p, dst);
            }
        }
        r += 8;
    }
    // The rows left (fewer than eight, or from a batch holding a NaN or Inf, which this loop
    // finds and reports), one at a time.
    for (k, (dst, sc)) in codes[r * hd..].chunks_exact_mut(hd).zip(scales[4 * r..].chunks_exact_mut(4)).enumerate() {
        let row = &src[(r + k) * row_bytes..(r + k + 1) * row_bytes];
        let bits = row_amax_bits_t::<D>(row);
        if bits >= 0x7F80_0000 {
            return Some(r + k);
        }
        let s = crate::scale::fp8_scale(f32::from_bits(bits));
        sc.copy_from_slice(&s.to_le_bytes());
        fp8_encode_t::<D, true>(row, if s == 0.0 { 1.0 } else { s }, dst);
    }
    None
}

/// Scales of rows `r..r + 8` (whole rows of `row_bytes` in `src`): `(s, se, yh, yl)` with `s` the
/// scales as stored, `se` the scales encoded with (1 where `s = 0`), `(yh, yl)` their
/// [`recip_split8`]; `None` when one of the rows holds a NaN or Inf.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn fp8_batch_scales<const D: u8>(
    src: &[u8],
    r: usize,
    row_bytes: usize,
) -> Option<(__m256, __m256, __m256, __m256)> {
    let mut v = [_mm256_setzero_si256(); 8];
    for (k, slot) in v.iter_mut().enumerate() {
        *slot = row_abs_partial::<D>(&src[(r + k) * row_bytes..(r + k + 1) * row_bytes]);
    }
    let amax = reduce8::<D>(&v);
    // Magnitude bits ≤ 0x7FFF_FFFF, so a signed compare finds NaN and Inf.
    let bad = _mm256_cmpgt_epi32(_mm256_castps_si256(amax), _mm256_set1_epi32(0x7F7F_FFFF));
    if _mm256_testz_si256(bad, bad) == 0 {
        return None;
    }
    let s = fp8_scale8(amax);
    // s = 0 (amax below 2^-100) encodes with scale 1, as the scalar code does.
    let is0 = _mm256_cmp_ps::<_CMP_EQ_OQ>(s, _mm256_setzero_ps());
    let se = _mm256_blendv_ps(s, _mm256_set1_ps(1.0), is0);
    let (yh, yl) = recip_split8(se);
    Some((s, se, yh, yl))
}

/// The row-wide partial max of magnitudes, in the layout [`reduce8`] takes: sixteen u16 for
/// bf16/fp16 (then the 32-bit lane pairs of the result hold the same row), eight u32 for fp32;
/// elements past the last full vector are folded in through the scalar code.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn row_abs_partial<const D: u8>(src: &[u8]) -> __m256i {
    let dtype = dt(D);
    let es = dtype.size() as usize;
    let n = src.len() / es;
    let mut i = 0;
    if D == BF16 || D == FP16 {
        let abs = _mm256_set1_epi16(0x7FFF);
        let (mut a0, mut a1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
        while i + 32 <= n {
            a0 = _mm256_max_epu16(a0, _mm256_and_si256(load16x16(src, i), abs));
            a1 = _mm256_max_epu16(a1, _mm256_and_si256(load16x16(src, i + 16), abs));
            i += 32;
        }
        while i + 16 <= n {
            a0 = _mm256_max_epu16(a0, _mm256_and_si256(load16x16(src, i), abs));
            i += 16;
        }
        let mut a = _mm256_max_epu16(a0, a1);
        if i < n {
            // The tail's max magnitude as a 16-bit pattern, broadcast.
            let t = (i..n).map(|j| u16::from_le_bytes([src[2 * j], src[2 * j + 1]]) & 0x7FFF).max().unwrap_or(0);
            a = _mm256_max_epu16(a, _mm256_set1_epi16(t as i16));
        }
        a
    } else {
        let abs = _mm256_set1_epi32(ABS);
        let mut acc = _mm256_setzero_si256();
        while i + 8 <= n {
            acc = _mm256_max_epu32(acc, _mm256_and_si256(_mm256_castps_si256(load8::<D>(src, i)), abs));
            i += 8;
        }
        if i < n {
            acc = _mm256_max_epu32(acc, _mm256_set1_epi32(scalar::row_amax_bits(dtype, &src[i * es..]) as i32));
        }
        acc
    }
}

/// `codec::fp8_scale` of eight amaxes: `canonical(amax / 448, 20 bits)`, 0 below 2^-100.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
pub(crate) unsafe fn fp8_scale8(amax: __m256) -> __m256 {
    let s = _mm256_castps_si256(_mm256_div_ps(amax, _mm256_set1_ps(crate::formats::E4M3_MAX)));
    let low = _mm256_and_si256(s, _mm256_set1_epi32(0xF));
    let up = _mm256_add_epi32(_mm256_or_si256(s, _mm256_set1_epi32(0xF)), _mm256_set1_epi32(1));
    let exact = _mm256_cmpeq_epi32(low, _mm256_setzero_si256());
    let c = _mm256_castsi256_ps(_mm256_blendv_epi8(up, s, exact));
    let flush = _mm256_cmp_ps::<_CMP_LT_OQ>(amax, _mm256_set1_ps(crate::scale::FLUSH_AMAX));
    _mm256_andnot_ps(flush, c)
}

/// [`exact_ok`] of all eight lanes.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
pub(crate) unsafe fn exact_ok8(s: __m256) -> bool {
    let low = _mm256_and_si256(_mm256_castps_si256(s), _mm256_set1_epi32(0xF));
    let canon = _mm256_castsi256_ps(_mm256_cmpeq_epi32(low, _mm256_setzero_si256()));
    let lo = _mm256_cmp_ps::<_CMP_GE_OQ>(s, _mm256_set1_ps(8.673_617e-19));
    let hi = _mm256_cmp_ps::<_CMP_LE_OQ>(s, _mm256_set1_ps(1.267_650_6e30));
    _mm256_movemask_ps(_mm256_and_ps(canon, _mm256_and_ps(lo, hi))) == 0xFF
}

/// Whether a bounded row with this (nonzero) scale may use the exact reciprocal form: see [`quot`].
#[inline]
pub(crate) fn exact_ok(scale: f32) -> bool {
    const LO: f32 = 8.673_617e-19; // 2^-60
    const HI: f32 = 1.267_650_6e30; // 2^100
    scale.to_bits() & 0xF == 0 && (LO..=HI).contains(&scale)
}

/// See `scalar::fp8_encode_row`. `bounded`: the caller guarantees `|x| ≤ 448·scale` for every
/// element (true for computed per-row and per-tensor scales, not for static ones).
#[target_feature(enable = "avx2,f16c,fma")]
pub(crate) unsafe fn fp8_encode_row(dtype: DType, src: &[u8], scale: f32, bounded: bool, dst: &mut [u8]) {
    if bounded {
        by_dtype!(dtype, fp8_encode_t_bounded(src, scale, dst))
    } else {
        by_dtype!(dtype, fp8_encode_t_div(src, scale, dst))
    }
}

#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn fp8_encode_t_bounded<const D: u8>(src: &[u8], scale: f32, dst: &mut [u8]) {
    fp8_encode_t::<D, true>(src, scale, dst)
}

#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn fp8_encode_t_div<const D: u8>(src: &[u8], scale: f32, dst: &mut [u8]) {
    fp8_encode_t::<D, false>(src, scale, dst)
}

/// `e4m3(x / scale)` for a row. With `BOUNDED` (`|x| ≤ 448·scale`) and a scale that meets the rest
/// of [`quot`]'s conditions, the division is replaced by the exact reciprocal form.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn fp8_encode_t<const D: u8, const BOUNDED: bool>(src: &[u8], scale: f32, dst: &mut [u8]) {
    if BOUNDED && exact_ok(scale) {
        let (hi, lo) = recip_split(scale);
        fp8_encode_loop::<D, true>(src, scale, _mm256_set1_ps(hi), _mm256_set1_ps(lo), dst)
    } else {
        let s = _mm256_set1_ps(scale);
        fp8_encode_loop::<D, false>(src, scale, s, s, dst)
    }
}

/// Codes of elements `i..i + 32` of `src` into `dst[i..i + 32]`, one scale (`p`, `q` as for
/// [`quot`]). Invariant: `i + 32 <= dst.len()` and elements `i..i + 32` are inside `src`.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn fp8_step32<const D: u8, const EXACT: bool>(src: &[u8], dst: &mut [u8], i: usize, p: __m256, q: __m256) {
    debug_assert!(i + 32 <= dst.len() && (i + 32) * dt(D).size() as usize <= src.len());
    if D == FP32 {
        return fp8_step32_f32::<EXACT>(src, dst, i, p, q);
    }
    let m0 = fp8_mag_words16::<D, EXACT>(src, i, p, q);
    let m1 = fp8_mag_words16::<D, EXACT>(src, i + 16, p, q);
    // Words ≤ 0x7E: the pack is exact; it leaves [0–7, 16–23 | 8–15, 24–31].
    let b = _mm256_or_si256(_mm256_packus_epi16(m0, m1), fp8_sign_bytes::<D>(src, i, i + 16));
    let b = _mm256_permute4x64_epi64::<0xD8>(b);
    // SAFETY: 32 bytes at i are inside dst (invariant above).
    _mm256_storeu_si256(dst.as_mut_ptr().add(i) as *mut __m256i, b);
}

/// [`fp8_step32`] for f32 rows: the codes of elements `i..i + 32` of the little-endian f32 `src`
/// into `dst[i..i + 32]`. The four vectors' magnitude codes and their signs are packed the same
/// way (32 → 16 → 8 bits; the signs by signed saturation, which maps every negative f32 pattern,
/// −0 included, to 0x80 and every other to 0x00..=0x7F), so one lane permute puts both in order.
/// Invariant: `i + 32 <= dst.len()` and `4·(i + 32) <= src.len()`.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn fp8_step32_f32<const EXACT: bool>(src: &[u8], dst: &mut [u8], i: usize, p: __m256, q: __m256) {
    debug_assert!(i + 32 <= dst.len() && 4 * (i + 32) <= src.len());
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(ABS));
    let mut x = [_mm256_setzero_ps(); 4];
    let mut c = [_mm256_setzero_si256(); 4];
    for k in 0..4 {
        // SAFETY: bytes 4·(i + 8k) .. + 32 are inside src (invariant above).
        x[k] = _mm256_loadu_ps(src.as_ptr().add(4 * (i + 8 * k)) as *const f32);
        // The exact quotient of a bounded row is at most 448·(1 + 2^-23): no saturation needed.
        c[k] = e4m3_mag8_biased(quot::<EXACT>(_mm256_and_ps(x[k], abs), p, q), !EXACT);
    }
    // Words ≤ 1254: exact; [0–3, 8–11 | 4–7, 12–15] and [16–19, 24–27 | 20–23, 28–31].
    let bias = _mm256_set1_epi16(E4M3_BIAS as i16);
    let w01 = _mm256_sub_epi16(_mm256_packus_epi32(c[0], c[1]), bias);
    let w23 = _mm256_sub_epi16(_mm256_packus_epi32(c[2], c[3]), bias);
    let mags = _mm256_packus_epi16(w01, w23);
    let s01 = _mm256_packs_epi32(_mm256_castps_si256(x[0]), _mm256_castps_si256(x[1]));
    let s23 = _mm256_packs_epi32(_mm256_castps_si256(x[2]), _mm256_castps_si256(x[3]));
    let signs = _mm256_and_si256(_mm256_packs_epi16(s01, s23), _mm256_set1_epi8(0x80u8 as i8));
    // 32-bit groups [0–3, 8–11, 16–19, 24–27 | 4–7, 12–15, 20–23, 28–31] into element order.
    let b = _mm256_permutevar8x32_epi32(_mm256_or_si256(mags, signs), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    // SAFETY: 32 bytes at i are inside dst (invariant above).
    _mm256_storeu_si256(dst.as_mut_ptr().add(i) as *mut __m256i, b);
}

/// One row: `p`, `q` are [`quot`]'s operands for `scale`, broadcast.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn fp8_encode_loop<const D: u8, const EXACT: bool>(
    src: &[u8],
    scale: f32,
    p: __m256,
    q: __m256,
    dst: &mut [u8],
) {
    let es = dt(D).size() as usize;
    let n = dst.len();
    debug_assert!(n * es <= src.len());
    let mut i = 0;
    while i + 32 <= n {
        fp8_step32::<D, EXACT>(src, dst, i, p, q);
        i += 32;
    }
    while i + 16 <= n {
        let m = fp8_mag_words16::<D, EXACT>(src, i, p, q);
        let b = _mm256_or_si256(_mm256_packus_epi16(m, m), fp8_sign_bytes::<D>(src, i, i));
        let p = _mm256_permute4x64_epi64::<0xD8>(b);
        // SAFETY: 16 bytes at i are inside dst (loop condition).
        _mm_storeu_si128(dst.as_mut_ptr().add(i) as *mut __m128i, _mm256_castsi256_si128(p));
        i += 16;
    }
    // The exact form and the scalar division give the same quotient, so the tail may divide.
    if i < n {
        scalar::fp8_encode_row(dt(D), &src[i * es..], scale, &mut dst[i..]);
    }
}

/// The per-block partial magnitudes of micro-block `b` (elements `16b..16b + 16`): sixteen u16
/// magnitudes for bf16/fp16, eight u32 (the max of the two halves) for fp32.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn block_abs<const D: u8>(src: &[u8], b: usize) -> __m256i {
    if D == BF16 || D == FP16 {
        _mm256_and_si256(load16x16(src, 16 * b), _mm256_set1_epi16(0x7FFF))
    } else {
        let abs = _mm256_set1_epi32(ABS);
        let x0 = _mm256_and_si256(_mm256_castps_si256(load8::<D>(src, 16 * b)), abs);
        let x1 = _mm256_and_si256(_mm256_castps_si256(load8::<D>(src, 16 * b + 8)), abs);
        _mm256_max_epu32(x0, x1)
    }
}

/// Reduces eight [`block_abs`] vectors to one f32 vector whose lane k is block k's amax. Each
/// step keeps every 32-bit lane holding elements of a single block: interleave pairs of vectors
/// by 32 then 64 bits and take the max, then fold the 128-bit lanes; for 16-bit dtypes the two
/// words of each lane are folded last.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
pub(crate) unsafe fn reduce8<const D: u8>(v: &[__m256i; 8]) -> __m256 {
    let w16 = D == BF16 || D == FP16;
    let mx = |a: __m256i, b: __m256i| if w16 { _mm256_max_epu16(a, b) } else { _mm256_max_epu32(a, b) };
    let t01 = mx(_mm256_unpacklo_epi32(v[0], v[1]), _mm256_unpackhi_epi32(v[0], v[1])); // [A B A B]
    let t23 = mx(_mm256_unpacklo_epi32(v[2], v[3]), _mm256_unpackhi_epi32(v[2], v[3])); // [C D C D]
    let t45 = mx(_mm256_unpacklo_epi32(v[4], v[5]), _mm256_unpackhi_epi32(v[4], v[5]));
    let t67 = mx(_mm256_unpacklo_epi32(v[6], v[7]), _mm256_unpackhi_epi32(v[6], v[7]));
    let u0 = mx(_mm256_unpacklo_epi64(t01, t23), _mm256_unpackhi_epi64(t01, t23)); // [A B C D | A B C D]
    let u1 = mx(_mm256_unpacklo_epi64(t45, t67), _mm256_unpackhi_epi64(t45, t67)); // [E F G H | E F G H]
    let r = mx(_mm256_permute2x128_si256::<0x20>(u0, u1), _mm256_permute2x128_si256::<0x31>(u0, u1));
    match dt(D) {
        DType::Bf16 => {
            // Both words' max in the high word, which is the bf16 pattern of the f32.
            let m = _mm256_max_epu16(r, _mm256_slli_epi32::<16>(r));
            _mm256_castsi256_ps(_mm256_and_si256(m, _mm256_set1_epi32(0xFFFF_0000u32 as i32)))
        }
        DType::Fp16 => {
            let m = _mm256_and_si256(_mm256_max_epu16(r, _mm256_srli_epi32::<16>(r)), _mm256_set1_epi32(0xFFFF));
            let p = _mm256_permute4x64_epi64::<0x08>(_mm256_packus_epi32(m, m));
            _mm256_cvtph_ps(_mm256_castsi256_si128(p))
        }
        _ => _mm256_castsi256_ps(r),
    }
}

/// Block scale codes (32-bit lanes) and code multipliers `1/d` (0 where `d = 0`) of eight
/// micro-blocks from their amax: `crate::scale::nvfp4_block_scale`, lane by lane, with the same
/// operations (a division by 6, two products, a division).
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
pub(crate) unsafe fn block_scales8(amax: __m256, g: f32, enc: f32) -> (__m256i, __m256) {
    let t = _mm256_mul_ps(_mm256_div_ps(amax, _mm256_set1_ps(6.0)), _mm256_set1_ps(enc));
    let c = e4m3_mag8(t, true);
    let d = _mm256_mul_ps(e4m3_mag_to_f32_8(c), _mm256_set1_ps(g));
    let zero = _mm256_cmp_ps::<_CMP_EQ_OQ>(d, _mm256_setzero_ps());
    (c, _mm256_andnot_ps(zero, _mm256_div_ps(_mm256_set1_ps(1.0), d)))
}

/// E2M1 magnitude codes of micro-block `b` times `inv`, as sixteen words in element order.
/// `abs16`: the block's sixteen magnitudes for bf16/fp16 (from [`block_abs`]); unused for fp32.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn e2m1_mag_words16<const D: u8>(src: &[u8], b: usize, abs16: __m256i, inv: __m256) -> __m256i {
    let (lo, hi) = if D == BF16 || D == FP16 { widen16::<D>(abs16) } else { mags16::<D>(src, 16 * b) };
    let c = join16::<D>(e2m1_mag8_x64(_mm256_mul_ps(lo, inv)), e2m1_mag8_x64(_mm256_mul_ps(hi, inv)));
    // 64·(code + bias) ≤ 64·311 fits a word; remove the factor and the bias.
    _mm256_sub_epi16(_mm256_srli_epi16::<6>(c), _mm256_set1_epi16(E2M1_BIAS as i16))
}

/// The E2M1 sign bits (0x08) of micro-blocks `b0` and `b1`, laid out like `_mm256_packus_epi16`
/// of their [`e2m1_mag_words16`]: [b0 0–7, b1 0–7 | b0 8–15, b1 8–15].
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn e2m1_sign_bytes<const D: u8>(src: &[u8], b0: usize, b1: usize) -> __m256i {
    if D == BF16 || D == FP16 {
        // As in `fp8_sign_bytes`: bit 7 of the signed-saturating pack is the sign; a 16-bit shift
        // by 4 then moves bit 7 of both bytes of a word to bit 3 of the same byte.
        let p = _mm256_packs_epi16(load16x16(src, 16 * b0), load16x16(src, 16 * b1));
        _mm256_srli_epi16::<4>(_mm256_and_si256(p, _mm256_set1_epi8(0x80u8 as i8)))
    } else {
        _mm256_packus_epi16(signs16::<D, 3>(src, 16 * b0), signs16::<D, 3>(src, 16 * b1))
    }
}

/// The code bytes of two micro-blocks from their [`e2m1_mag_words16`] and [`e2m1_sign_bytes`]:
/// block 0's eight bytes, then block 1's, element 2i in the low nibble.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn nibbles2(w0: __m256i, w1: __m256i, signs: __m256i) -> __m128i {
    // Bytes [b0 0–7, b1 0–7 | b0 8–15, b1 8–15]; multiply-add pairs: byte 2i + 16 · byte 2i+1
    // (≤ 255, no saturation); pack; then gather the 32-bit groups of each block.
    let bytes = _mm256_or_si256(_mm256_packus_epi16(w0, w1), signs);
    let nib = _mm256_maddubs_epi16(bytes, _mm256_set1_epi16(0x1001));
    let p = _mm256_packus_epi16(nib, nib);
    let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_castsi256_si128(p)
}

/// See `scalar::nvfp4_encode_row`, for a run of rows: row `k` of `src` is row `r0 + k` of `spec`,
/// with the global scale and encode factor of its plane from `g` and `enc`. `ahead` (any bytes,
/// possibly empty) is prefetched toward L2 along the way.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,f16c,fma")]
pub(crate) unsafe fn nvfp4_encode_rows(
    spec: &crate::BlockSpec,
    r0: usize,
    src: &[u8],
    ahead: &[u8],
    g: &[f32],
    enc: &[f32],
    bs: &mut [u8],
    codes: &mut [u8],
) {
    by_dtype!(spec.dtype, nvfp4_encode_rows_t(spec, r0, src, ahead, g, enc, bs, codes))
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn nvfp4_encode_rows_t<const D: u8>(
    spec: &crate::BlockSpec,
    r0: usize,
    src: &[u8],
    ahead: &[u8],
    g: &[f32],
    enc: &[f32],
    bs: &mut [u8],
    codes: &mut [u8],
) {
    let hd = spec.row_len();
    let row_bytes = hd * dt(D).size() as usize;
    let (nb, cb) = (hd.div_ceil(16), hd.div_ceil(2));
    let (mut p, mut run_end) = (0, r0);
    for (k, (b, c)) in bs.chunks_exact_mut(nb).zip(codes.chunks_exact_mut(cb)).enumerate() {
        // Spread the prefetch of `ahead` (the input the caller reads next) over the rows.
        let mut off = k * row_bytes;
        while off < ((k + 1) * row_bytes).min(ahead.len()) {
            // SAFETY: `off` is inside `ahead`; a prefetch reads nothing the program observes.
            _mm_prefetch::<_MM_HINT_T1>(ahead.as_ptr().add(off) as *const i8);
            off += 64;
        }
        if r0 + k >= run_end {
            p = spec.plane_of_row(r0 + k);
            run_end = spec.plane_run_end(r0 + k);
        }
        nvfp4_encode_row_t::<D>(&src[k * row_bytes..(k + 1) * row_bytes], g[p], enc[p], b, c);
    }
}

/// Eight micro-blocks at a time: their amaxes reduced into one vector, their block scales and
/// reciprocals computed together, then each block's codes with its reciprocal broadcast.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn nvfp4_encode_row_t<const D: u8>(src: &[u8], g: f32, enc: f32, bs: &mut [u8], codes: &mut [u8]) {
    let dtype = dt(D);
    let es = dtype.size() as usize;
    let n = src.len() / es;
    let full = n / 16;
    let mut b = 0;
    // Groups of eight full micro-blocks (a 128-wide head is one group), straight-line code.
    while b + 8 <= full {
        nvfp4_group::<D, true>(src, b, 8, g, enc, bs, codes);
        b += 8;
    }
    if b < full {
        nvfp4_group::<D, false>(src, b, full - b, g, enc, bs, codes);
    }
    if full * 16 < n {
        bs[full] = scalar::nvfp4_encode_block(dtype, &src[full * 16 * es..], g, enc, &mut codes[full * 8..]);
    }
}

/// Micro-blocks `b..b + m` (all full, `m ≤ 8`; `m = 8` when `EIGHT`): block scales and codes.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn nvfp4_group<const D: u8, const EIGHT: bool>(
    src: &[u8],
    b: usize,
    m: usize,
    g: f32,
    enc: f32,
    bs: &mut [u8],
    codes: &mut [u8],
) {
    let m = if EIGHT { 8 } else { m };
    let mut v = [_mm256_setzero_si256(); 8];
    for (k, slot) in v.iter_mut().enumerate() {
        if k < m {
            *slot = block_abs::<D>(src, b + k);
        }
    }
    let (sc, inv) = block_scales8(reduce8::<D>(&v), g, enc);
    bs[b..b + m].copy_from_slice(&bytes8(sc).to_le_bytes()[..m]);
    let mut k = 0;
    while k + 2 <= m {
        let i0 = _mm256_permutevar8x32_ps(inv, _mm256_set1_epi32(k as i32));
        let i1 = _mm256_permutevar8x32_ps(inv, _mm256_set1_epi32(k as i32 + 1));
        // The magnitudes are loaded again (one load and one AND) rather than kept in eight
        // registers across the loop.
        let w0 = e2m1_mag_words16::<D>(src, b + k, v[k], i0);
        let w1 = e2m1_mag_words16::<D>(src, b + k + 1, v[k + 1], i1);
        let x = nibbles2(w0, w1, e2m1_sign_bytes::<D>(src, b + k, b + k + 1));
        let o = 8 * (b + k);
        debug_assert!(o + 16 <= codes.len());
        // SAFETY: blocks b+k and b+k+1 are full, so their 16 code bytes are inside codes.
        _mm_storeu_si128(codes.as_mut_ptr().add(o) as *mut __m128i, x);
        k += 2;
    }
    if k < m {
        let i0 = _mm256_permutevar8x32_ps(inv, _mm256_set1_epi32(k as i32));
        // The second half (block k again) is computed but not stored.
        let w0 = e2m1_mag_words16::<D>(src, b + k, block_abs::<D>(src, b + k), i0);
        let x = nibbles2(w0, _mm256_setzero_si256(), e2m1_sign_bytes::<D>(src, b + k, b + k));
        let o = 8 * (b + k);
        codes[o..o + 8].copy_from_slice(&(_mm_cvtsi128_si64(x) as u64).to_le_bytes());
    }
}

/// See `scalar::fp8_decode_row`. E4M3 code `c` is turned into the FP16 bit pattern whose value
/// is `c · 2^-8` (same sign, exponent rebias 7 → 15, subnormals included), converted by F16C, and
/// multiplied by `256 · scale` — one rounding, the same product as the scalar `table[c] · scale`.
/// Sixteen codes a step ([`fp8_dequant_chunk`], the fused decoder's), BF16 stored sixteen at a
/// time ([`store16_bf16`]); then at most one step of eight, then the scalar kernel.
#[target_feature(enable = "avx2,f16c,fma")]
pub(crate) unsafe fn fp8_decode_row(codes: &[u8], scale: f32, out: DType, dst: &mut [u8]) -> bool {
    by_dtype!(out, fp8_decode_t(codes, scale, dst))
}

/// [`fp8_decode_row`] for a run of rows of `hd` codes: row `k` of `codes` with scale `scale(k)`
/// into row `k` of `dst` (one call and one dtype dispatch per run).
#[target_feature(enable = "avx2,f16c,fma")]
pub(crate) unsafe fn fp8_decode_rows<F: Fn(usize) -> f32>(
    codes: &[u8],
    hd: usize,
    scale: F,
    out: DType,
    dst: &mut [u8],
) -> bool {
    by_dtype!(out, fp8_decode_rows_t(codes, hd, scale, dst))
}

#[inline(always)]
unsafe fn fp8_decode_rows_t<const D: u8>(
    codes: &[u8],
    hd: usize,
    scale: impl Fn(usize) -> f32,
    dst: &mut [u8],
) -> bool {
    let row = hd * dt(D).size() as usize;
    super::any_row(codes, hd, dst, row, |k, c, o| fp8_decode_t::<D>(c, scale(k), o))
}

#[inline(always)]
unsafe fn fp8_decode_t<const D: u8>(codes: &[u8], scale: f32, dst: &mut [u8]) -> bool {
    let out = dt(D);
    if !(scale * 256.0).is_finite() {
        // A scale above 2^119.9 (never written by the encoder, whose scales stay below
        // f32::MAX / 448): `256 · scale` would overflow where `code · scale` does not.
        return scalar::fp8_decode_row(codes, scale, out, dst);
    }
    let os = out.size() as usize;
    let n = codes.len();
    assert!(n * os <= dst.len());
    let sc = _mm256_set1_ps(scale * 256.0);
    // The max of `code & 0x7F` over the row: 0x7F is a NaN code.
    let mut worst = _mm_setzero_si128();
    let mut i = 0;
    while i + 16 <= n {
        let mut v = [_mm256_setzero_ps(); 2];
        worst = fp8_dequant_chunk(codes, i, sc, &mut v, worst);
        if D == BF16 {
            // SAFETY: elements i .. i + 16 (32 bytes at 2i) are inside dst (assert above).
            store16_bf16(dst.as_mut_ptr().add(2 * i), v[0], v[1]);
        } else {
            store8::<D>(dst, i, v[0]);
            store8::<D>(dst, i + 8, v[1]);
        }
        i += 16;
    }
    if i + 8 <= n {
        // SAFETY: 8 bytes at i are inside codes; the upper 8 lanes are zeroed by the load.
        let b = _mm_loadl_epi64(codes.as_ptr().add(i) as *const __m128i);
        worst = _mm_max_epu8(worst, _mm_and_si128(b, _mm_set1_epi8(0x7F)));
        // As in fp8_dequant_chunk: sign-extend, magnitude under the FP16 exponent, bit 15 the sign.
        let h = _mm_and_si128(_mm_slli_epi16::<7>(_mm_cvtepi8_epi16(b)), _mm_set1_epi16(0xBF80u16 as i16));
        store8::<D>(dst, i, _mm256_mul_ps(_mm256_cvtph_ps(h), sc));
        i += 8;
    }
    let tail_bad = i < n && scalar::fp8_decode_row(&codes[i..], scale, out, &mut dst[i * os..]);
    _mm_movemask_epi8(_mm_cmpeq_epi8(worst, _mm_set1_epi8(0x7F))) != 0 || tail_bad
}

/// See `scalar::nvfp4_decode_row`. Per micro-block, the eight products `fl(e2m1(c) · d)` of the
/// magnitudes and `d = fl(e4m3(bs) · g)` as a table; nibble `k` of a little-endian u32 selected by
/// a per-lane variable shift picks its entry by a lane permute (which reads the low three bits),
/// the nibble's sign bit or-ed on. That is the scalar value: `fl(−a·d) = −fl(a·d)` for `d ≥ 0` or
/// `+∞`, zeros and `0·∞`'s default NaN (sign set) included, and the codec refuses a negative or
/// non-finite `g` before decoding, so `d` is below 0 or NaN only for a block scale this function
/// flags (`s ≥ 0x7F`, `dst` then unspecified). BF16 stored sixteen at a time ([`store16_bf16`]).
#[target_feature(enable = "avx2,f16c,fma")]
pub(crate) unsafe fn nvfp4_decode_row(bs: &[u8], codes: &[u8], g: f32, n: usize, out: DType, dst: &mut [u8]) -> bool {
    by_dtype!(out, nvfp4_decode_t(bs, codes, g, n, dst))
}

#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn nvfp4_decode_t<const D: u8>(bs: &[u8], codes: &[u8], g: f32, n: usize, dst: &mut [u8]) -> bool {
    let out = dt(D);
    let full = n / 16;
    assert!(full <= bs.len() && 8 * full <= codes.len() && n * out.size() as usize <= dst.len());
    let mags = _mm256_loadu_ps(E2M1_VALUES.as_ptr());
    let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    let sign = _mm256_set1_epi32(i32::MIN);
    let mut worst = 0u8;
    for (b, &s) in bs.iter().enumerate().take(full) {
        worst = worst.max(s);
        let tab = _mm256_mul_ps(mags, _mm256_set1_ps(e4m3_to_f32(s) * g));
        let mut v = [_mm256_setzero_ps(); 2];
        for (h, x) in v.iter_mut().enumerate() {
            // SAFETY: the 4 code bytes 8b + 4h .. + 4 ≤ 8·full are inside codes (assert above).
            let w = (codes.as_ptr().add(8 * b + 4 * h) as *const u32).read_unaligned();
            let cv = _mm256_srlv_epi32(_mm256_set1_epi32(w as i32), shifts);
            let neg = _mm256_and_si256(_mm256_slli_epi32::<28>(cv), sign);
            *x = _mm256_or_ps(_mm256_permutevar8x32_ps(tab, cv), _mm256_castsi256_ps(neg));
        }
        if D == BF16 {
            // SAFETY: elements 16b .. 16b + 16 (32 bytes at 32b) are inside dst (assert above).
            store16_bf16(dst.as_mut_ptr().add(32 * b), v[0], v[1]);
        } else {
            store8::<D>(dst, 16 * b, v[0]);
            store8::<D>(dst, 16 * b + 8, v[1]);
        }
    }
    // Valid block scales are unsigned E4M3 codes below 0x7F (NaN).
    scalar::nvfp4_decode_row(bs, codes, g, full * 16, n, out, dst) || worst >= 0x7F
}

/// E2M1 code of each f32 (one per byte, unscaled); a test hook for the golden vectors.
#[target_feature(enable = "avx2,f16c,fma")]
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

/// The forward rotation of one chunk, elements `off..off + 8N` of the row `s` (dtype `D`): times
/// `mul`, [`wht_regs`], stored as little-endian f32 at elements `off..off + 8N` of `o`. Returns
/// the max of the stored values' magnitude bits in eight u32 lanes.
#[inline(always)]
unsafe fn fwd_chunk<const D: u8, const N: usize>(s: &[u8], mul: &[f32], off: usize, o: &mut [u8]) -> __m256i {
    let end = off + 8 * N;
    assert!(end <= mul.len() && end * dt(D).size() as usize <= s.len() && 4 * end <= o.len());
    let mut v = [_mm256_setzero_ps(); N];
    for (k, x) in v.iter_mut().enumerate() {
        // SAFETY: elements off + 8k .. off + 8k + 8 ≤ end are inside s and mul (assert above).
        *x = _mm256_mul_ps(load8::<D>(s, off + 8 * k), _mm256_loadu_ps(mul.as_ptr().add(off + 8 * k)));
    }
    wht_regs(&mut v);
    let abs = _mm256_set1_epi32(ABS);
    let mut m = _mm256_setzero_si256();
    for (k, x) in v.iter().enumerate() {
        // SAFETY: bytes 4·(off + 8k) .. + 32 ≤ 4·end are inside o (assert above).
        _mm256_storeu_ps(o.as_mut_ptr().add(4 * (off + 8 * k)) as *mut f32, *x);
        m = _mm256_max_epu32(m, _mm256_and_si256(_mm256_castps_si256(*x), abs));
    }
    m
}

/// [`fwd_chunk`] for a chunk of `64·S` elements (128 or 256), in `S` sub-chunks of eight vectors
/// each rotated through stage 32 ([`wht_regs`]) and stored into `o`, then the stages between
/// them ([`wht_cross`]) vector by vector, in place in `o` (which is in L1): the same bytes, with
/// no more than eight vectors live during the first five stages and no spills (kept in registers
/// the compiler interleaves the sub-chunks and spills; this measured ~4% faster).
#[inline(always)]
unsafe fn fwd_chunk_split<const D: u8, const S: usize>(s: &[u8], mul: &[f32], off: usize, o: &mut [u8]) -> __m256i {
    let end = off + 64 * S;
    assert!(end <= mul.len() && end * dt(D).size() as usize <= s.len() && 4 * end <= o.len());
    let op = o.as_mut_ptr() as *mut f32;
    for q in 0..S {
        let mut v = [_mm256_setzero_ps(); 8];
        for (k, x) in v.iter_mut().enumerate() {
            let i = off + 64 * q + 8 * k;
            // SAFETY: elements i .. i + 8 ≤ end are inside s and mul (assert above).
            *x = _mm256_mul_ps(load8::<D>(s, i), _mm256_loadu_ps(mul.as_ptr().add(i)));
        }
        wht_regs(&mut v);
        for (k, x) in v.iter().enumerate() {
            // SAFETY: f32 elements off + 64q + 8k .. + 8 ≤ end are inside o (assert above).
            _mm256_storeu_ps(op.add(off + 64 * q + 8 * k), *x);
        }
    }
    let abs = _mm256_set1_epi32(ABS);
    let mut m = _mm256_setzero_si256();
    for k in 0..8 {
        let mut t = [[_mm256_setzero_ps(); 1]; S];
        for (q, x) in t.iter_mut().enumerate() {
            // SAFETY: as above.
            x[0] = _mm256_loadu_ps(op.add(off + 64 * q + 8 * k));
        }
        wht_cross(&mut t);
        for (q, x) in t.iter().enumerate() {
            // SAFETY: as above.
            _mm256_storeu_ps(op.add(off + 64 * q + 8 * k), x[0]);
            m = _mm256_max_epu32(m, _mm256_and_si256(_mm256_castps_si256(x[0]), abs));
        }
    }
    m
}

/// [`fwd_chunk`] for a chunk of any power-of-two length `n` (those with no register form:
/// shorter than 8 or longer than 256), through `buf` (head_dim f32): the vector steps and
/// [`wht_rest`] for `n ≥ 8`, the scalar reference below.
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn fwd_chunk_mem<const D: u8>(
    s: &[u8],
    mul: &[f32],
    off: usize,
    n: usize,
    buf: &mut [f32],
    o: &mut [u8],
) -> __m256i {
    let dtype = dt(D);
    assert!(off + n <= mul.len() && (off + n) * dtype.size() as usize <= s.len() && 4 * (off + n) <= o.len());
    let b = &mut buf[off..off + n];
    if n >= 8 {
        let mut k = 0;
        while k + 8 <= n {
            // SAFETY: elements off + k .. off + k + 8 ≤ off + n are inside s and mul (assert above).
            let x = _mm256_mul_ps(load8::<D>(s, off + k), _mm256_loadu_ps(mul.as_ptr().add(off + k)));
            _mm256_storeu_ps(b[k..k + 8].as_mut_ptr(), fwht8(x));
            k += 8;
        }
        wht_rest(b, &[n]);
    } else {
        for (k, v) in b.iter_mut().enumerate() {
            *v = crate::block::load_f32(dtype, s, off + k) * mul[off + k];
        }
        crate::fwht::fwht(b);
    }
    let mut m = 0u32;
    for (k, v) in b.iter().enumerate() {
        o[4 * (off + k)..4 * (off + k + 1)].copy_from_slice(&v.to_le_bytes());
        m = m.max(v.to_bits() & 0x7FFF_FFFF);
    }
    _mm256_set1_epi32(m as i32)
}

/// The forward rotation of one row `s` (dtype `D`) into `o` (little-endian f32), chunk by chunk,
/// each in registers where it has a register form. Returns the max magnitude bits of the rotated
/// row, reduced to eight u32 lanes. `buf`: head_dim f32 of scratch.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn fwd_row<const D: u8>(s: &[u8], mul: &[f32], chunks: &[usize], buf: &mut [f32], o: &mut [u8]) -> __m256i {
    let mut acc = _mm256_setzero_si256();
    let mut off = 0;
    for &n in chunks {
        let m = match n {
            8 => fwd_chunk::<D, 1>(s, mul, off, o),
            16 => fwd_chunk::<D, 2>(s, mul, off, o),
            32 => fwd_chunk::<D, 4>(s, mul, off, o),
            64 => fwd_chunk::<D, 8>(s, mul, off, o),
            128 => fwd_chunk_split::<D, 2>(s, mul, off, o),
            256 => fwd_chunk_split::<D, 4>(s, mul, off, o),
            _ => fwd_chunk_mem::<D>(s, mul, off, n, buf, o),
        };
        acc = _mm256_max_epu32(acc, m);
        off += n;
    }
    acc
}

/// The inverse rotation of one chunk: little-endian f32 elements `off..off + 8N` of `s`,
/// [`wht_regs`], times `mul`, stored as `D` at elements `off..off + 8N` of `o` (rounding like
/// `block::store_f32`). Returns the max magnitude bits of the chunk's input in eight u32 lanes.
#[inline(always)]
unsafe fn inv_chunk<const D: u8, const N: usize>(s: &[u8], mul: &[f32], off: usize, o: &mut [u8]) -> __m256i {
    let end = off + 8 * N;
    assert!(end <= mul.len() && 4 * end <= s.len() && end * dt(D).size() as usize <= o.len());
    let abs = _mm256_set1_epi32(ABS);
    let mut m = _mm256_setzero_si256();
    let mut v = [_mm256_setzero_ps(); N];
    for (k, x) in v.iter_mut().enumerate() {
        // SAFETY: bytes 4·(off + 8k) .. + 32 ≤ 4·end are inside s (assert above).
        *x = _mm256_loadu_ps(s.as_ptr().add(4 * (off + 8 * k)) as *const f32);
        m = _mm256_max_epu32(m, _mm256_and_si256(_mm256_castps_si256(*x), abs));
    }
    wht_regs(&mut v);
    for (k, x) in v.iter().enumerate() {
        // SAFETY: elements off + 8k .. off + 8k + 8 ≤ end are inside mul and o (assert above).
        store8::<D>(o, off + 8 * k, _mm256_mul_ps(*x, _mm256_loadu_ps(mul.as_ptr().add(off + 8 * k))));
    }
    m
}

/// [`inv_chunk`] for a chunk with no register form, through `buf` (see [`fwd_chunk_mem`]).
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn inv_chunk_mem<const D: u8>(
    s: &[u8],
    mul: &[f32],
    off: usize,
    n: usize,
    buf: &mut [f32],
    o: &mut [u8],
) -> __m256i {
    let dtype = dt(D);
    assert!(off + n <= mul.len() && 4 * (off + n) <= s.len() && (off + n) * dtype.size() as usize <= o.len());
    let b = &mut buf[off..off + n];
    let mut m = 0u32;
    for (k, v) in b.iter_mut().enumerate() {
        let i = 4 * (off + k);
        *v = f32::from_le_bytes([s[i], s[i + 1], s[i + 2], s[i + 3]]);
        m = m.max(v.to_bits() & 0x7FFF_FFFF);
    }
    if n >= 8 {
        let mut k = 0;
        while k + 8 <= n {
            let p = b[k..k + 8].as_mut_ptr();
            // SAFETY: elements k..k + 8 of b.
            _mm256_storeu_ps(p, fwht8(_mm256_loadu_ps(p)));
            k += 8;
        }
        wht_rest(b, &[n]);
        let mut k = 0;
        while k + 8 <= n {
            // SAFETY: elements k..k + 8 of b, off + k .. off + k + 8 of mul and o (assert above).
            let x = _mm256_mul_ps(_mm256_loadu_ps(b.as_ptr().add(k)), _mm256_loadu_ps(mul.as_ptr().add(off + k)));
            store8::<D>(o, off + k, x);
            k += 8;
        }
    } else {
        crate::fwht::fwht(b);
        for (k, v) in b.iter().enumerate() {
            crate::block::store_f32(dtype, o, off + k, v * mul[off + k]);
        }
    }
    _mm256_set1_epi32(m as i32)
}

/// The forward rotation of `crate::rotation::Rotation` on whole rows: elements of `dtype` from
/// `src`, times `mul`, then the transform per chunk; written to `out` as little-endian f32.
/// `buf` is scratch of `mul.len()` (= head_dim) elements.
#[target_feature(enable = "avx2,f16c,fma")]
pub(crate) unsafe fn rotate_rows(
    dtype: DType,
    src: &[u8],
    mul: &[f32],
    chunks: &[usize],
    buf: &mut [f32],
    out: &mut [u8],
) {
    by_dtype!(dtype, rotate_rows_t(src, mul, chunks, buf, out));
}

/// [`rotate_rows`], returning the largest magnitude of the rotated values as f32 bits: an
/// integer max over every value written, so a NaN or an infinity anywhere shows above every
/// finite value (the AVX-512 kernels' `rotate_rows_max`: the rotated NVFP4 encoder's plane amax
/// and, against `super::ROTATED_SAFE_BITS`, its range check, without another pass).
#[target_feature(enable = "avx2,f16c,fma")]
pub(crate) unsafe fn rotate_rows_max(
    dtype: DType,
    src: &[u8],
    mul: &[f32],
    chunks: &[usize],
    buf: &mut [f32],
    out: &mut [u8],
) -> u32 {
    by_dtype!(dtype, rotate_rows_t(src, mul, chunks, buf, out))
}

#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn rotate_rows_t<const D: u8>(
    src: &[u8],
    mul: &[f32],
    chunks: &[usize],
    buf: &mut [f32],
    out: &mut [u8],
) -> u32 {
    let hd = mul.len();
    assert!(buf.len() == hd);
    let mut acc = _mm256_setzero_si256();
    for (s, o) in src.chunks_exact(hd * dt(D).size() as usize).zip(out.chunks_exact_mut(hd * 4)) {
        acc = _mm256_max_epu32(acc, fwd_row::<D>(s, mul, chunks, buf, o));
    }
    hmax_epu32(acc)
}

/// The inverse rotation of `crate::rotation::Rotation` on whole rows: little-endian f32 from
/// `src`, the transform per chunk, then times `mul`, stored as `dtype` in `dst` (rounding like
/// `block::store_f32`). `buf` is scratch of `mul.len()` elements. Returns the largest magnitude
/// bits of `src` (as `scalar::row_amax_bits` of all of it).
#[target_feature(enable = "avx2,f16c,fma")]
pub(crate) unsafe fn unrotate_rows(
    src: &[u8],
    mul: &[f32],
    chunks: &[usize],
    buf: &mut [f32],
    dtype: DType,
    dst: &mut [u8],
) -> u32 {
    by_dtype!(dtype, unrotate_rows_t(src, mul, chunks, buf, dst))
}

#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn unrotate_rows_t<const D: u8>(
    src: &[u8],
    mul: &[f32],
    chunks: &[usize],
    buf: &mut [f32],
    dst: &mut [u8],
) -> u32 {
    let hd = mul.len();
    assert!(buf.len() == hd);
    let mut acc = _mm256_setzero_si256();
    for (s, o) in src.chunks_exact(hd * 4).zip(dst.chunks_exact_mut(hd * dt(D).size() as usize)) {
        let mut off = 0;
        for &n in chunks {
            let m = match n {
                8 => inv_chunk::<D, 1>(s, mul, off, o),
                16 => inv_chunk::<D, 2>(s, mul, off, o),
                32 => inv_chunk::<D, 4>(s, mul, off, o),
                64 => inv_chunk::<D, 8>(s, mul, off, o),
                128 => inv_chunk::<D, 16>(s, mul, off, o),
                256 => inv_chunk::<D, 32>(s, mul, off, o),
                _ => inv_chunk_mem::<D>(s, mul, off, n, buf, o),
            };
            acc = _mm256_max_epu32(acc, m);
            off += n;
        }
    }
    hmax_epu32(acc)
}

/// Horizontal max of eight u32.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn hmax_epu32(v: __m256i) -> u32 {
    let m = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let m = _mm_max_epu32(m, _mm_shuffle_epi32::<0b00_00_11_10>(m));
    let m = _mm_max_epu32(m, _mm_shuffle_epi32::<0b00_00_00_01>(m));
    _mm_cvtsi128_si32(m) as u32
}

/// [`fp8_encode_rows`] of rows rotated on the way (the `+had` codecs), one pass per row: each
/// row of `src` (dtype `dtype`, `mul.len()` elements) is rotated in registers ([`fwd_row`]) into
/// a small f32 buffer of eight rows, its amax taken from the registers, then the eight rows'
/// scales computed together and their codes written from the buffer while it is in L1. The bytes
/// are those of rotating every row (`rotate_rows`) and encoding the f32 rows with
/// [`fp8_encode_rows`].
///
/// Returns the largest rotated magnitude as f32 bits, the integer max over every rotated value
/// (NaN and Inf above every finite value): the range check of the rotated codecs folded into the
/// pass, as the AVX-512 kernel's (see `super::ROTATED_SAFE_BITS`; every rotated value of a chunk
/// depends on all of its inputs, so a NaN or infinite input makes the whole chunk NaN or
/// infinite). At most `ROTATED_SAFE_BITS` proves the rows finite and within
/// `crate::rotation::ROTATION_MAX_INPUT`; above it the caller checks the source rows and discards
/// what was written if it refuses them. Any input is safe here: non-finite or huge values only
/// make meaningless codes (no lane operation traps, and the scalar tails saturate NaN).
#[target_feature(enable = "avx2,f16c,fma")]
pub(crate) unsafe fn fp8_encode_rows_rotated(
    dtype: DType,
    src: &[u8],
    mul: &[f32],
    chunks: &[usize],
    scales: &mut [u8],
    codes: &mut [u8],
) -> u32 {
    by_dtype!(dtype, fp8_encode_rows_rot_t(src, mul, chunks, scales, codes))
}

#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn fp8_encode_rows_rot_t<const D: u8>(
    src: &[u8],
    mul: &[f32],
    chunks: &[usize],
    scales: &mut [u8],
    codes: &mut [u8],
) -> u32 {
    let hd = mul.len();
    let row_bytes = hd * dt(D).size() as usize;
    let rows = codes.len() / hd.max(1);
    assert!(rows * row_bytes <= src.len() && 4 * rows <= scales.len());
    let mut fb = vec![0f32; hd];
    // Eight rotated rows, f32.
    let mut buf = vec![0u8; 8 * hd * 4];
    // The magnitude bits of every rotated value, integer max.
    let mut rot_max = _mm256_setzero_si256();
    let mut r = 0;
    while r + 8 <= rows {
        let mut v = [_mm256_setzero_si256(); 8];
        for (k, slot) in v.iter_mut().enumerate() {
            let row = &src[(r + k) * row_bytes..(r + k + 1) * row_bytes];
            *slot = fwd_row::<D>(row, mul, chunks, &mut fb, &mut buf[k * hd * 4..(k + 1) * hd * 4]);
        }
        // The same scales as `fp8_batch_scales` on the rotated rows (when they are finite).
        let amax = reduce8::<FP32>(&v);
        rot_max = _mm256_max_epu32(rot_max, _mm256_castps_si256(amax));
        let s = fp8_scale8(amax);
        let is0 = _mm256_cmp_ps::<_CMP_EQ_OQ>(s, _mm256_setzero_ps());
        let se = _mm256_blendv_ps(s, _mm256_set1_ps(1.0), is0);
        let (yh, yl) = recip_split8(se);
        // SAFETY: 32 bytes at 4r are inside scales (r + 8 ≤ rows, assert above).
        _mm256_storeu_ps(scales.as_mut_ptr().add(4 * r) as *mut f32, s);
        let bdst = &mut codes[r * hd..(r + 8) * hd];
        if hd.is_multiple_of(32) && exact_ok8(se) {
            for k in 0..8 {
                let idx = _mm256_set1_epi32(k as i32);
                let (p, q) = (_mm256_permutevar8x32_ps(yh, idx), _mm256_permutevar8x32_ps(yl, idx));
                let mut i = k * hd;
                while i < (k + 1) * hd {
                    fp8_step32_f32::<true>(&buf, bdst, i, p, q);
                    i += 32;
                }
            }
        } else {
            let mut sv = [0f32; 8];
            // SAFETY: sv is 32 bytes.
            _mm256_storeu_ps(sv.as_mut_ptr(), se);
            for (k, &sk) in sv.iter().enumerate() {
                let row = &buf[k * hd * 4..(k + 1) * hd * 4];
                let dst = &mut bdst[k * hd..(k + 1) * hd];
                let idx = _mm256_set1_epi32(k as i32);
                if exact_ok(sk) {
                    let (p, q) = (_mm256_permutevar8x32_ps(yh, idx), _mm256_permutevar8x32_ps(yl, idx));
                    fp8_encode_loop::<FP32, true>(row, sk, p, q, dst);
                } else {
                    let p = _mm256_permutevar8x32_ps(se, idx);
                    fp8_encode_loop::<FP32, false>(row, sk, p, p, dst);
                }
            }
        }
        r += 8;
    }
    // The rows left (fewer than eight), one at a time, as `fp8_encode_rows` does.
    for k in r..rows {
        let row = &src[k * row_bytes..(k + 1) * row_bytes];
        let f = &mut buf[..hd * 4];
        let bits = hmax_epu32(fwd_row::<D>(row, mul, chunks, &mut fb, f));
        rot_max = _mm256_max_epu32(rot_max, _mm256_set1_epi32(bits as i32));
        let s = crate::scale::fp8_scale(f32::from_bits(bits));
        scales[4 * k..4 * k + 4].copy_from_slice(&s.to_le_bytes());
        fp8_encode_t::<FP32, true>(f, if s == 0.0 { 1.0 } else { s }, &mut codes[k * hd..(k + 1) * hd]);
    }
    hmax_epu32(rot_max)
}

/// Whether rows with these chunk lengths and this dtype take the fused rotated kernels here
/// ([`fp8_encode_rows_rotated`] with its range check, `rotate_rows` as the NVFP4 plane amax,
/// [`fp8_decode_rows_rotated`], [`nvfp4_decode_rows_rotated`]): every chunk has a register form
/// of at least two vectors (16..=256 elements, so `head_dim` is a multiple of 16), the dtype is
/// not FP8. The set of `super::avx512::covers`, so both backends take the same routes.
pub(crate) fn covers(dtype: DType, chunks: &[usize]) -> bool {
    dtype != DType::Fp8E4m3 && chunks.iter().all(|n| (16..=256).contains(n))
}

/// Calls `$body` with `$t` bound to the registers of the chunk of length `$n` (16..=256, a power
/// of two; eight elements a vector) as sub-chunks of at most 64 elements, `[[__m256; M]; S]`:
/// one of `n / 8` vectors up to 64, else `n / 64` of eight (see [`wht_cross`]).
macro_rules! by_chunk8 {
    ($n:expr, |$t:ident| $body:expr) => {
        match $n {
            16 => {
                let mut $t = [[_mm256_setzero_ps(); 2]; 1];
                $body
            }
            32 => {
                let mut $t = [[_mm256_setzero_ps(); 4]; 1];
                $body
            }
            64 => {
                let mut $t = [[_mm256_setzero_ps(); 8]; 1];
                $body
            }
            128 => {
                let mut $t = [[_mm256_setzero_ps(); 8]; 2];
                $body
            }
            n => {
                debug_assert_eq!(n, 256);
                let mut $t = [[_mm256_setzero_ps(); 8]; 4];
                $body
            }
        }
    };
}

/// The end of a fused decoder's chunk of `S·M·8` elements at `off`, held as `S` sub-chunks of
/// `M` vectors each already transformed through its own stages ([`wht_regs`]): the stages
/// between sub-chunks ([`wht_cross`], when `S > 1`, where `M` is 8), then times `mul` and stored
/// as `D` ([`store_chunk`]).
#[inline(always)]
unsafe fn cross_store<const D: u8, const M: usize, const S: usize>(
    t: &mut [[__m256; M]; S],
    mul: &[f32],
    off: usize,
    o: &mut [u8],
) {
    wht_cross(t);
    for (q, v) in t.iter().enumerate() {
        store_chunk::<D, M>(v, mul, off + 8 * M * q, o);
    }
}

/// Multiplies a chunk held in `v` by `mul` (elements `off..off + 8N`) and stores it at elements
/// `off..` of the row `o` as `D`, rounding like `block::store_f32` (BF16 sixteen at a time, see
/// [`store16_bf16`]; the others by [`store8`]).
#[inline(always)]
unsafe fn store_chunk<const D: u8, const N: usize>(v: &[__m256; N], mul: &[f32], off: usize, o: &mut [u8]) {
    assert!(off + 8 * N <= mul.len() && (off + 8 * N) * dt(D).size() as usize <= o.len());
    let mp = mul.as_ptr().add(off);
    let mut k = 0;
    if D == BF16 {
        while k + 2 <= N {
            // SAFETY: elements off + 8k .. + 16 are inside mul and o (assert above, k + 2 ≤ N).
            let a = _mm256_mul_ps(v[k], _mm256_loadu_ps(mp.add(8 * k)));
            let b = _mm256_mul_ps(v[k + 1], _mm256_loadu_ps(mp.add(8 * k + 8)));
            store16_bf16(o.as_mut_ptr().add(2 * (off + 8 * k)), a, b);
            k += 2;
        }
    }
    while k < N {
        // SAFETY: elements off + 8k .. + 8 are inside mul and o (assert above).
        store8::<D>(o, off + 8 * k, _mm256_mul_ps(v[k], _mm256_loadu_ps(mp.add(8 * k))));
        k += 1;
    }
}

/// Sixteen f32 (`a` then `b`) stored as BF16 at `p` (32 bytes): [`store8`]'s rounding
/// `(bits + 0x7FFF + lsb) >> 16` on both, one pack (exact: the values fit in 16 bits) and one
/// lane permute for the two, one store.
///
/// # Safety
///
/// AVX2 (the file's contract); `p .. p + 32` writable.
#[inline(always)]
unsafe fn store16_bf16(p: *mut u8, a: __m256, b: __m256) {
    let round = |v: __m256| {
        let b = _mm256_castps_si256(v);
        let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(1));
        _mm256_srli_epi32::<16>(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb))
    };
    // [a 0–3, b 0–3 | a 4–7, b 4–7] → [a 0–7 | b 0–7].
    let w = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(round(a), round(b)));
    // SAFETY: p .. p + 32 is writable (this function's contract).
    _mm256_storeu_si256(p as *mut __m256i, w);
}

/// FP8 codes of one chunk (`8N` bytes at `off` of the row `c`, `N` even) as f32 times
/// `sc = 256·scale` into `v`: code → the FP16 pattern of `code·2^-8` (sign-extend the byte to 16
/// bits, shift the magnitude under the FP16 exponent, keep bit 15 as the sign), FP16 → f32
/// (exact), one product: `fl(e4m3(code) · scale)`, the scalar decoder's value (as
/// [`fp8_decode_row`]). Folds the max of `code & 0x7F` (0x7F: a NaN code) into `bad`.
#[inline(always)]
unsafe fn fp8_dequant_chunk<const N: usize>(
    c: &[u8],
    off: usize,
    sc: __m256,
    v: &mut [__m256; N],
    bad: __m128i,
) -> __m128i {
    assert!(off + 8 * N <= c.len() && N.is_multiple_of(2));
    let mut bad = bad;
    let mut k = 0;
    while k + 2 <= N {
        // SAFETY: bytes off + 8k .. + 16 are inside c (assert above, k + 2 ≤ N).
        let b = _mm_loadu_si128(c.as_ptr().add(off + 8 * k) as *const __m128i);
        bad = _mm_max_epu8(bad, _mm_and_si128(b, _mm_set1_epi8(0x7F)));
        let h = _mm256_and_si256(_mm256_slli_epi16::<7>(_mm256_cvtepi8_epi16(b)), _mm256_set1_epi16(0xBF80u16 as i16));
        v[k] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), sc);
        v[k + 1] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256::<1>(h)), sc);
        k += 2;
    }
    bad
}

/// FP8 decoding fused with the inverse rotation, one row at a time in registers: each chunk's
/// codes dequantized ([`fp8_dequant_chunk`], the decoder's `fl(code · scale)`), the transform
/// ([`wht_regs`]), times `mul`, stored as `dtype`: the bytes of decoding every row into f32 and
/// [`unrotate_rows`], with no f32 row in memory (the AVX-512 kernel's construction on eight
/// lanes). `scale(k)`: the scale of row `k` of `codes` (`mul.len()` codes per row). Returns
/// whether a NaN code (never written by the encoder) was met; `dst` is then unspecified. The
/// caller has checked [`covers`] and that every scale is at most
/// `crate::rotation::ROTATION_MAX_INPUT` (so `256·scale` is finite and no decoded value can pass
/// `crate::rotation::ROTATION_MAX_DECODED`, the check `unrotate_rows`' amax serves).
#[target_feature(enable = "avx2,f16c,fma")]
pub(crate) unsafe fn fp8_decode_rows_rotated(
    codes: &[u8],
    scale: impl Fn(usize) -> f32,
    mul: &[f32],
    chunks: &[usize],
    dtype: DType,
    dst: &mut [u8],
) -> bool {
    by_dtype!(dtype, fp8_decode_rows_rot_t(codes, scale, mul, chunks, dst))
}

#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn fp8_decode_rows_rot_t<const D: u8>(
    codes: &[u8],
    scale: impl Fn(usize) -> f32,
    mul: &[f32],
    chunks: &[usize],
    dst: &mut [u8],
) -> bool {
    debug_assert!(covers(dt(D), chunks));
    let hd = mul.len();
    let mut bad = _mm_setzero_si128();
    for (r, (c, o)) in codes.chunks_exact(hd).zip(dst.chunks_exact_mut(hd * dt(D).size() as usize)).enumerate() {
        let sc = _mm256_set1_ps(scale(r) * 256.0);
        let mut off = 0;
        for &n in chunks {
            by_chunk8!(n, |t| {
                for (q, v) in t.iter_mut().enumerate() {
                    bad = fp8_dequant_chunk(c, off + 64 * q, sc, v, bad);
                    wht_regs(v);
                }
                cross_store::<D, _, _>(&mut t, mul, off, o);
            });
            off += n;
        }
    }
    _mm_movemask_epi8(_mm_cmpeq_epi8(bad, _mm_set1_epi8(0x7F))) != 0
}

/// NVFP4 decoding fused with the inverse rotation, one row at a time in registers (see
/// [`fp8_decode_rows_rotated`]): for each micro-block its scale `d = fl(e4m3(bs) · g)` (the
/// scalar decoder's), the eight products `fl(e2m1(c) · d)` of the magnitudes as a table, and each
/// element's nibble picking its entry by a lane permute (which reads the low three bits) with the
/// nibble's sign bit or-ed on: `fl(−a·d) = −fl(a·d)` for `d ≥ 0`, zeros included, so the value of
/// `scalar::nvfp4_decode_row`; then the transform, times `mul`, stored as `dtype`. The bytes of
/// that decoder into f32 followed by [`unrotate_rows`]. `g(k)`: the global scale of row `k`.
/// Returns whether a block scale code is not a valid unsigned E4M3 code (`dst` is then
/// unspecified; a negative or NaN `d` only comes from such a code). The caller has checked
/// [`covers`] (so `mul.len()` is a multiple of 16) and that every global scale is at most 2^98
/// (so no decoded value can pass `crate::rotation::ROTATION_MAX_DECODED`).
#[target_feature(enable = "avx2,f16c,fma")]
pub(crate) unsafe fn nvfp4_decode_rows_rotated(
    bs: &[u8],
    codes: &[u8],
    g: impl Fn(usize) -> f32,
    mul: &[f32],
    chunks: &[usize],
    dtype: DType,
    dst: &mut [u8],
) -> bool {
    by_dtype!(dtype, nvfp4_decode_rows_rot_t(bs, codes, g, mul, chunks, dst))
}

#[target_feature(enable = "avx2,f16c,fma")]
unsafe fn nvfp4_decode_rows_rot_t<const D: u8>(
    bs: &[u8],
    codes: &[u8],
    g: impl Fn(usize) -> f32,
    mul: &[f32],
    chunks: &[usize],
    dst: &mut [u8],
) -> bool {
    debug_assert!(covers(dt(D), chunks));
    let hd = mul.len();
    assert!(hd.is_multiple_of(16));
    let (nb, cb) = (hd / 16, hd / 2);
    let rows = codes.len() / cb.max(1);
    assert!(rows * nb <= bs.len());
    let mags = _mm256_loadu_ps(E2M1_VALUES.as_ptr());
    let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    let sign = _mm256_set1_epi32(i32::MIN);
    let mut worst = 0u8;
    for (r, (c, o)) in codes.chunks_exact(cb).zip(dst.chunks_exact_mut(hd * dt(D).size() as usize)).enumerate() {
        let rbs = &bs[r * nb..(r + 1) * nb];
        let gr = g(r);
        let mut off = 0;
        for &n in chunks {
            by_chunk8!(n, |t| {
                assert!(off + n <= hd && c.len() == cb);
                for (k, pair) in t.iter_mut().flat_map(|v| v.chunks_exact_mut(2)).enumerate() {
                    let blk = off / 16 + k;
                    let s = rbs[blk];
                    worst = worst.max(s);
                    let tab = _mm256_mul_ps(mags, _mm256_set1_ps(e4m3_to_f32(s) * gr));
                    for (h, x) in pair.iter_mut().enumerate() {
                        // SAFETY: the 4 code bytes 8·blk + 4h .. + 4 ≤ 8·(blk + 1) ≤ hd / 2 =
                        // c.len() are inside c (assert above: blk < (off + n) / 16 ≤ hd / 16).
                        let w = (c.as_ptr().add(8 * blk + 4 * h) as *const u32).read_unaligned();
                        let cv = _mm256_srlv_epi32(_mm256_set1_epi32(w as i32), shifts);
                        let neg = _mm256_and_si256(_mm256_slli_epi32::<28>(cv), sign);
                        *x = _mm256_or_ps(_mm256_permutevar8x32_ps(tab, cv), _mm256_castsi256_ps(neg));
                    }
                }
                for v in t.iter_mut() {
                    wht_regs(v);
                }
                cross_store::<D, _, _>(&mut t, mul, off, o);
            });
            off += n;
        }
    }
    // Valid block scales are unsigned E4M3 codes below 0x7F (NaN).
    worst >= 0x7F
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::{e2m1_from_f32, e4m3_from_f32};

    fn have() -> bool {
        super::super::Backend::avx2_available()
    }

    /// `quot::<true>` against the division for every `a` mantissa of `a_bits` significant bits in
    /// [1, 2) (quotients on both sides of 1) and every `step`-th 20-bit scale mantissa in [1, 2),
    /// at a few exponent offsets.
    fn check_quotients(a_bits: u32, step: u32) {
        let mut bad = 0;
        for am in 0..(1u32 << (a_bits - 1)) {
            let a = f32::from_bits(0x3F80_0000 | (am << (24 - a_bits)));
            for e in [-40i32, -3, 0, 5, 60] {
                let a = a * 2f32.powi(e);
                let mut sm = 0;
                while sm < (1u32 << 19) {
                    let s = f32::from_bits((0x3F80_0000 | (sm << 4)).wrapping_add(((e + 1) as u32) << 23));
                    let mut got = [0f32; 8];
                    // SAFETY: avx2, f16c and fma were detected (`have`).
                    unsafe {
                        let (hi, lo) = recip_split(s);
                        let q = quot::<true>(_mm256_set1_ps(a), _mm256_set1_ps(hi), _mm256_set1_ps(lo));
                        _mm256_storeu_ps(got.as_mut_ptr(), q);
                    }
                    if got[0].to_bits() != (a / s).to_bits() {
                        bad += 1;
                    }
                    sm += step;
                }
            }
        }
        assert_eq!(bad, 0);
    }

    #[test]
    fn exact_quotient_is_the_division() {
        if !have() {
            return;
        }
        check_quotients(8, 61); // bf16 mantissas
        check_quotients(11, 997); // fp16 mantissas
        check_quotients(24, 1 << 19); // a few fp32 ones with scale mantissa 0
                                      // Random fp32 numerators with random 20-bit scales over the allowed range.
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let s = f32::from_bits(((x as u32) & 0x007F_FFF0) | (((x >> 32) as u32 % 160 + 67) << 23));
            // The vector split is the scalar one.
            let (hi, lo) = recip_split(s);
            // SAFETY: as above.
            let (vh, vl) = unsafe {
                let (h, l) = recip_split8(_mm256_set1_ps(s));
                (_mm256_cvtss_f32(h), _mm256_cvtss_f32(l))
            };
            assert_eq!((vh.to_bits(), vl.to_bits()), (hi.to_bits(), lo.to_bits()), "split of {s:e}");
            let a = (s * 448.0)
                * f32::from_bits(((x >> 40) as u32 & 0x007F_FFFF) | 0x3F00_0000)
                * 2f32.powi(-((x >> 60) as i32));
            // SAFETY: as above.
            let got = unsafe {
                let mut o = [0f32; 8];
                let (hi, lo) = recip_split(s);
                _mm256_storeu_ps(
                    o.as_mut_ptr(),
                    quot::<true>(_mm256_set1_ps(a), _mm256_set1_ps(hi), _mm256_set1_ps(lo)),
                );
                o[0]
            };
            assert_eq!(got.to_bits(), (a / s).to_bits(), "{a:e} / {s:e}");
        }
    }

    // The exhaustive versions of these two checks (every bf16/fp16 mantissa against every scale,
    // every f32 pattern from 0 to 480) were run once while writing them (about 5 minutes in
    // release) and passed; the tests below sample the same spaces on every run.

    /// The vector E4M3 and E2M1 magnitude conversions against the scalar ones on f32 patterns
    /// from 0 to past the saturation points, every `step`-th pattern.
    fn check_mags(step: u32) {
        let mut bits = 0u32;
        let end = 0x43F0_0000; // 480
        while bits < end {
            let mut xs = [0f32; 8];
            for (k, x) in xs.iter_mut().enumerate() {
                *x = f32::from_bits((bits + k as u32 * step).min(end));
            }
            let (mut c4, mut c2) = ([0u32; 8], [0u32; 8]);
            // SAFETY: as above.
            unsafe {
                let v = _mm256_loadu_ps(xs.as_ptr());
                _mm256_storeu_si256(c4.as_mut_ptr() as *mut __m256i, e4m3_mag8(v, true));
                let mut u = [0u32; 8];
                _mm256_storeu_si256(u.as_mut_ptr() as *mut __m256i, e4m3_mag8(v, false));
                for k in 0..8 {
                    if xs[k] < 464.0 {
                        assert_eq!(u[k], u32::from(e4m3_from_f32(xs[k])), "unsaturated e4m3 {:#x}", xs[k].to_bits());
                    }
                }
                _mm256_storeu_si256(c2.as_mut_ptr() as *mut __m256i, e2m1_mag8(v));
                let mut c64 = [0u32; 8];
                _mm256_storeu_si256(c64.as_mut_ptr() as *mut __m256i, e2m1_mag8_x64(v));
                for k in 0..8 {
                    assert_eq!(
                        (c64[k] >> 6) as i32 - E2M1_BIAS,
                        i32::from(e2m1_from_f32(xs[k])),
                        "x64 e2m1 {:#x}",
                        xs[k].to_bits()
                    );
                    assert_eq!(c64[k] & 63, 0);
                }
            }
            for k in 0..8 {
                assert_eq!(c4[k], u32::from(e4m3_from_f32(xs[k])), "e4m3 {:#x}", xs[k].to_bits());
                assert_eq!(c2[k], u32::from(e2m1_from_f32(xs[k])), "e2m1 {:#x}", xs[k].to_bits());
            }
            bits += 8 * step;
        }
    }

    #[test]
    fn magnitude_codes_match_scalar() {
        if have() {
            check_mags(4099);
        }
    }
}
