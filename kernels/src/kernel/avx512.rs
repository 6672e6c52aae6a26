//! AVX-512 row kernels for the rotated (`+had`) codecs, sixteen f32 lanes at a time: the forward
//! rotation, the inverse rotation, the forward rotation fused with FP8 quantization, FP8 and
//! NVFP4 dequantization fused with the inverse rotation, and the NVFP4 quantizer of rotated
//! planes. They write the same bytes as [`super::scalar`] and [`super::avx2`]: the same IEEE
//! operations on the same values in the same order (the butterflies of [`crate::fwht::avx512`]),
//! the same exact quotient as `avx2::quot`, the same E4M3/E2M1 rounding constructions as
//! `avx2::e4m3_mag8_biased` and `avx2::e2m1_mag8_x64`, the same block-scale arithmetic as
//! `avx2::block_scales8`.
//!
//! A row is held in registers chunk by chunk (a chunk of 128 is eight vectors): loaded, rotated,
//! and then stored as f32 (`rotate_rows`, `rotate_rows_max`), or stored as f32 in an L1 buffer of
//! eight rows whose scales are computed together before their codes are written
//! (`fp8_encode_rows_rotated`); decoding, codes are dequantized into registers, transformed,
//! multiplied and stored in the output dtype (`fp8_decode_rows_rotated`,
//! `nvfp4_decode_rows_rotated`, and their `_bf16ne` forms storing BF16 by `vcvtne2ps2bf16`).
//! The range check of the rotated encoders (finite, within 2^100) is read off the rotated values
//! ([`fwd_chunk`], [`ROTATED_SAFE_BITS`]). Rows whose chunks have no register form here (a chunk
//! shorter than 16 or longer than 256) and FP8 sources or outputs go to the AVX2 kernels, which
//! every CPU with these features also runs.
//!
//! Safety, once for the whole file: every function here is `#[target_feature(enable = "avx512f,
//! avx512bw, avx512vl, avx512dq, avx2, f16c, fma")]` (or `inline(always)` and only called from
//! such functions) and is only called through [`super::Isa::Avx512`], which is only constructed
//! after `is_x86_feature_detected!` returned true for every one of those features; the `_bf16ne`
//! kernels also enable "avx512bf16" and are only called when the `Isa`'s token says it was
//! detected too. Every
//! unaligned load or store reads or writes whole elements `i..i + 16` of a slice whose length was
//! checked by an `assert!` in the same function, as noted at each access.

use std::arch::x86_64::*;

use kvtier_proto::DType;

use super::avx2;
use crate::fwht::avx512::wht_regs16;

const ABS: i32 = 0x7FFF_FFFF;

/// `(e + 6)·8 = (m >> 20) − 141·8` in [`e4m3_mag16`] (as `avx2::E4M3_BIAS`).
const E4M3_BIAS: i32 = 1128;

/// Whether rows with these chunk lengths and this dtype have a register form here.
pub(crate) fn covers(dtype: DType, chunks: &[usize]) -> bool {
    dtype != DType::Fp8E4m3 && chunks.iter().all(|n| (16..=256).contains(n))
}

/// Loads elements `i..i + 16` of `src` (little-endian `dtype`, not FP8) as f32.
/// Invariant: `(i + 16) * dtype.size() <= src.len()`.
#[inline(always)]
unsafe fn load16(dtype: DType, src: &[u8], i: usize) -> __m512 {
    debug_assert!((i + 16) * dtype.size() as usize <= src.len());
    match dtype {
        // SAFETY (all three): the bytes of elements i..i + 16 are inside src (invariant above).
        DType::Bf16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
            src.as_ptr().add(2 * i) as *const __m256i,
        )))),
        DType::Fp16 => _mm512_cvtph_ps(_mm256_loadu_si256(src.as_ptr().add(2 * i) as *const __m256i)),
        _ => _mm512_loadu_ps(src.as_ptr().add(4 * i) as *const f32),
    }
}

/// Stores sixteen f32 as elements `i..i + 16` of `dst` in `dtype` (not FP8), rounding to nearest
/// even (FP16 saturating to ±65504), exactly like `block::store_f32` and `avx2::store8`.
/// Invariant: `(i + 16) * dtype.size() <= dst.len()`.
#[inline(always)]
unsafe fn store16(dtype: DType, dst: &mut [u8], i: usize, v: __m512) {
    debug_assert!((i + 16) * dtype.size() as usize <= dst.len());
    match dtype {
        DType::Bf16 => {
            let b = _mm512_castps_si512(v);
            let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
            let r = _mm512_srli_epi32::<16>(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb));
            // SAFETY: 32 bytes at 2*i are inside dst (invariant above); r's lanes fit in 16 bits,
            // so the truncating narrowing keeps them.
            _mm256_storeu_si256(dst.as_mut_ptr().add(2 * i) as *mut __m256i, _mm512_cvtepi32_epi16(r));
        }
        DType::Fp16 => {
            // The bound first, so a NaN stays NaN (as in `avx2::store8`).
            let c = _mm512_min_ps(_mm512_set1_ps(65504.0), _mm512_max_ps(_mm512_set1_ps(-65504.0), v));
            let h = _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(c);
            // SAFETY: 32 bytes at 2*i are inside dst.
            _mm256_storeu_si256(dst.as_mut_ptr().add(2 * i) as *mut __m256i, h);
        }
        // SAFETY: 64 bytes at 4*i are inside dst.
        _ => _mm512_storeu_ps(dst.as_mut_ptr().add(4 * i) as *mut f32, v),
    }
}

/// `max(|a|, |b|)` with the sign cleared, lane by lane, in one operation (`vrangeps`, "max
/// absolute value, sign cleared"): on finite and infinite lanes the same bits as the max of the
/// magnitudes' bits. A NaN operand may be dropped, so NaNs are found another way (see
/// [`fwd_chunk`]).
#[inline(always)]
unsafe fn max_abs(a: __m512, b: __m512) -> __m512 {
    _mm512_range_ps::<0b1011>(a, b)
}

/// The forward rotation of one chunk, elements `off..off + 16N` of the row `s` (dtype `dtype`):
/// times `mul`, [`wht_regs16`], left in `v`. Returns the max magnitude of the rotated values in
/// sixteen lanes ([`max_abs`]; meaningful when they are all finite), and folds the magnitude bits
/// of the chunk's first rotated vector into `probe` (integer max, so NaN and Inf show): every
/// rotated value of a chunk depends on every one of its inputs through the butterflies, so one
/// NaN or infinite input makes *every* rotated value of its chunk NaN or infinite, and one
/// vector tells. Together with [`ROTATED_SAFE_BITS`] this is the rotated codecs' range check.
#[inline(always)]
unsafe fn fwd_chunk<const N: usize>(
    dtype: DType,
    s: &[u8],
    mul: &[f32],
    off: usize,
    v: &mut [__m512; N],
    probe: &mut __m512i,
) -> __m512 {
    let end = off + 16 * N;
    assert!(end <= mul.len() && end * dtype.size() as usize <= s.len());
    for (k, x) in v.iter_mut().enumerate() {
        // SAFETY: elements off + 16k .. off + 16k + 16 ≤ end are inside s and mul (assert above).
        *x = _mm512_mul_ps(load16(dtype, s, off + 16 * k), _mm512_loadu_ps(mul.as_ptr().add(off + 16 * k)));
    }
    wht_regs16(v);
    *probe = _mm512_max_epu32(*probe, _mm512_and_si512(_mm512_castps_si512(v[0]), _mm512_set1_epi32(ABS)));
    // A tree, so its latency is log2(N) operations.
    let mut m = *v;
    let mut w = N;
    while w > 1 {
        for k in 0..w / 2 {
            m[k] = max_abs(m[k], m[k + w / 2]);
        }
        w /= 2;
    }
    m[0]
}

/// The largest lane of [`max_abs`] results, as f32 bits (sign cleared).
#[inline(always)]
unsafe fn max_bits(m: __m512) -> u32 {
    _mm512_reduce_max_epu32(_mm512_and_si512(_mm512_castps_si512(m), _mm512_set1_epi32(ABS)))
}

/// Stores `v` (a chunk of `16N` f32) at elements `off..` of `o` as little-endian f32.
#[inline(always)]
unsafe fn store_f32s<const N: usize>(v: &[__m512; N], off: usize, o: &mut [u8]) {
    assert!(4 * (off + 16 * N) <= o.len());
    for (k, x) in v.iter().enumerate() {
        // SAFETY: bytes 4·(off + 16k) .. + 64 are inside o (assert above).
        _mm512_storeu_ps(o.as_mut_ptr().add(4 * (off + 16 * k)) as *mut f32, *x);
    }
}

/// Calls `$body` with `$v` bound to the registers of the chunk of length `$n` (16..=256).
macro_rules! by_chunk {
    ($n:expr, |$v:ident| $body:expr) => {
        match $n {
            16 => {
                let mut $v = [_mm512_setzero_ps(); 1];
                $body
            }
            32 => {
                let mut $v = [_mm512_setzero_ps(); 2];
                $body
            }
            64 => {
                let mut $v = [_mm512_setzero_ps(); 4];
                $body
            }
            128 => {
                let mut $v = [_mm512_setzero_ps(); 8];
                $body
            }
            _ => {
                let mut $v = [_mm512_setzero_ps(); 16];
                $body
            }
        }
    };
}

/// The forward rotation of `crate::rotation::Rotation` on whole rows, as `avx2::rotate_rows`:
/// elements of `dtype` from `src`, times `mul`, the transform per chunk, written to `out` as
/// little-endian f32. `buf`: head_dim f32 of scratch for the AVX2 fallback.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,fma")]
pub(crate) unsafe fn rotate_rows(
    dtype: DType,
    src: &[u8],
    mul: &[f32],
    chunks: &[usize],
    buf: &mut [f32],
    out: &mut [u8],
) {
    if !covers(dtype, chunks) {
        return avx2::rotate_rows(dtype, src, mul, chunks, buf, out);
    }
    let hd = mul.len();
    for (s, o) in src.chunks_exact(hd * dtype.size() as usize).zip(out.chunks_exact_mut(hd * 4)) {
        let mut off = 0;
        for &n in chunks {
            by_chunk!(n, |v| {
                let mut probe = _mm512_setzero_si512();
                fwd_chunk(dtype, s, mul, off, &mut v, &mut probe);
                store_f32s(&v, off, o);
            });
            off += n;
        }
    }
}

/// The inverse rotation on whole rows, as `avx2::unrotate_rows`: little-endian f32 from `src`, the
/// transform per chunk, times `mul`, stored as `dtype` in `dst`. Returns the largest magnitude
/// bits of `src`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,fma")]
pub(crate) unsafe fn unrotate_rows(
    src: &[u8],
    mul: &[f32],
    chunks: &[usize],
    buf: &mut [f32],
    dtype: DType,
    dst: &mut [u8],
) -> u32 {
    if !covers(dtype, chunks) {
        return avx2::unrotate_rows(src, mul, chunks, buf, dtype, dst);
    }
    let hd = mul.len();
    let es = dtype.size() as usize;
    let abs = _mm512_set1_epi32(ABS);
    let mut acc = _mm512_setzero_si512();
    for (s, o) in src.chunks_exact(hd * 4).zip(dst.chunks_exact_mut(hd * es)) {
        let mut off = 0;
        for &n in chunks {
            by_chunk!(n, |v| {
                assert!(off + n <= hd);
                for (k, x) in v.iter_mut().enumerate() {
                    // SAFETY: bytes 4·(off + 16k) .. + 64 ≤ 4·hd = s.len() (assert above).
                    *x = _mm512_loadu_ps(s.as_ptr().add(4 * (off + 16 * k)) as *const f32);
                    acc = _mm512_max_epu32(acc, _mm512_and_si512(_mm512_castps_si512(*x), abs));
                }
                wht_regs16(&mut v);
                for (k, x) in v.iter().enumerate() {
                    // SAFETY: elements off + 16k .. + 16 ≤ hd are inside mul and o (o holds hd
                    // elements of dtype).
                    store16(dtype, o, off + 16 * k, _mm512_mul_ps(*x, _mm512_loadu_ps(mul.as_ptr().add(off + 16 * k))));
                }
            });
            off += n;
        }
    }
    _mm512_reduce_max_epu32(acc)
}

/// E4M3 codes (sign in bit 7) of the sixteen quotients `x / s`, `x` finite with
/// `|x| ≤ 448·s`-ish as `avx2::fp8_step32_f32` has them: with `EXACT`, `|x| / s` as
/// `avx2::quot::<true>` (`fl(a·p + fl(a·q))`, proven equal to the division for the scales
/// `avx2::exact_ok` accepts; no saturation needed, the quotient is at most 448·(1 + 2^-23));
/// without, the true division, saturated at 448. The rounding is `avx2::e4m3_mag8_biased`'s.
#[inline(always)]
unsafe fn e4m3_codes16<const EXACT: bool>(x: __m512, p: __m512, q: __m512) -> __m128i {
    let xb = _mm512_castps_si512(x);
    let a = _mm512_castsi512_ps(_mm512_and_si512(xb, _mm512_set1_epi32(ABS)));
    let a = if EXACT {
        _mm512_fmadd_ps(a, p, _mm512_mul_ps(a, q))
    } else {
        _mm512_min_ps(_mm512_div_ps(a, p), _mm512_set1_ps(448.0))
    };
    let ab = _mm512_castps_si512(a);
    let m = _mm512_max_epi32(
        _mm512_add_epi32(_mm512_and_si512(ab, _mm512_set1_epi32(0x7F80_0000)), _mm512_set1_epi32(20 << 23)),
        _mm512_set1_epi32(141 << 23),
    );
    let t = _mm512_castps_si512(_mm512_add_ps(a, _mm512_castsi512_ps(m)));
    let mag = _mm512_add_epi32(_mm512_sub_epi32(t, m), _mm512_srli_epi32::<20>(m));
    let mag = _mm512_sub_epi32(mag, _mm512_set1_epi32(E4M3_BIAS));
    let sign = _mm512_and_si512(_mm512_srli_epi32::<24>(xb), _mm512_set1_epi32(0x80));
    _mm512_cvtepi32_epi8(_mm512_or_si512(mag, sign))
}

/// The E4M3 code of `x / s` (as [`e4m3_codes16`]) in a signed 32-bit form, from the signed
/// quotient, with no `|x|` taken: `r = 16·(code + E4M3_BIAS) − 32768·sign`.
///
/// The quotient `y` is computed from the signed `x` (`EXACT`: `fl(x·p + fl(x·q))`; else the
/// division clamped to ±448 by [`clamp448`]); rounding is symmetric, so `|q|` is the quotient of
/// `|x|` bit for bit, and `y` has the sign of `x`, zeros included (with `EXACT` that needs `q ≥ 0`,
/// which [`recip_split_rd`] guarantees: `−0·p + −0·q = −0`, where a negative `q` would give
/// `+0`). The rounding magnitude `m` of [`e4m3_codes16`] is built with that sign: the exponent
/// field of `y` with its sign bit, plus 20, then `vrangeps` "max absolute value, sign of the first
/// operand" against 2^14 (the `max` with `141 << 23` and the copy of the sign in one operation);
/// `t = y + m` is then `±(|q| + m)`, the same magnitude bits as there, with the sign in bit 31. Its
/// low word is the count of E4M3 steps (≤ 16), its high word as an i16 is
/// `(m >> 16) − 32768·sign`; one `vpmaddwd` with weights (16, 1) gives `r`, in
/// [−14720, 20096]. [`e4m3_codes64`] finishes it on words.
#[inline(always)]
unsafe fn e4m3_x16s<const EXACT: bool>(x: __m512, p: __m512, q: __m512) -> __m512i {
    let y = if EXACT { _mm512_fmadd_ps(x, p, _mm512_mul_ps(x, q)) } else { clamp448(_mm512_div_ps(x, p)) };
    // The sign and exponent of the quotient y, the exponent plus 20 (at most 135 + 20: no carry
    // into the sign).
    let e = _mm512_add_epi32(
        _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(0xFF80_0000u32 as i32)),
        _mm512_set1_epi32(20 << 23),
    );
    // ±max(|e|, 2^14) with e's sign: "max absolute value" (imm bits 1:0 = 0b11), "sign of the first operand" (bits 3:2 = 0b00).
    let m = _mm512_range_ps::<0b0011>(_mm512_castsi512_ps(e), _mm512_set1_ps(16384.0));
    let t = _mm512_castps_si512(_mm512_add_ps(y, m));
    _mm512_madd_epi16(t, _mm512_set1_epi32(0x0001_0010))
}

/// `±min(|v|, 448)` with `v`'s sign (`vrangeps` "min absolute value, sign of the first
/// operand"): the saturation of the division path of [`e4m3_x16s`], on finite `v`.
#[inline(always)]
unsafe fn clamp448(v: __m512) -> __m512 {
    _mm512_range_ps::<0b0010>(v, _mm512_set1_ps(448.0))
}

/// The 64 E4M3 codes of four vectors (elements in order: `x0`'s sixteen, then `x1`'s, …), the
/// bytes of [`e4m3_codes16`] on each: [`e4m3_x16s`] of each, packed to words with signed
/// saturation (exact: every value is in i16), so a word is `16·(code + E4M3_BIAS) + 32768·sign`
/// (as u16); minus `16·E4M3_BIAS` and `>> 4` that is `code | sign << 11` (`code ≤ 126`), and one
/// `vpmaddubsw` with byte weights (1, 16) moves the sign to bit 7: `code + 16·(8·sign)`; packed to
/// bytes (no saturation: at most 254); one lane permute undoes the packs' interleaving of the
/// 128-bit lanes.
#[inline(always)]
unsafe fn e4m3_codes64<const EXACT: bool>(x: &[__m512; 4], p: __m512, q: __m512) -> __m512i {
    let w0 = _mm512_packs_epi32(e4m3_x16s::<EXACT>(x[0], p, q), e4m3_x16s::<EXACT>(x[1], p, q));
    let w1 = _mm512_packs_epi32(e4m3_x16s::<EXACT>(x[2], p, q), e4m3_x16s::<EXACT>(x[3], p, q));
    let bias = _mm512_set1_epi16((16 * E4M3_BIAS) as i16);
    let weights = _mm512_set1_epi16(0x1001);
    let c0 = _mm512_maddubs_epi16(_mm512_srli_epi16::<4>(_mm512_sub_epi16(w0, bias)), weights);
    let c1 = _mm512_maddubs_epi16(_mm512_srli_epi16::<4>(_mm512_sub_epi16(w1, bias)), weights);
    let codes = _mm512_packus_epi16(c0, c1);
    // Dword 4i + L (elements 16i + 4L ..) sits at 4L + i after the packs.
    _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), codes)
}

/// `(fl↓(1/s), fl(1/s − fl↓(1/s)))`: the reciprocal split of `avx2::recip_split` with the high
/// part rounded down, so the low part is never negative (what [`e4m3_x16s`] needs for the sign of
/// zeros). The quotient `fl(a·p + fl(a·q))` is still exactly the division for the scales
/// `avx2::exact_ok` accepts: the argument at `avx2::quot` holds with `|q| < ulp(p)` instead of
/// half of it, which doubles its error terms to at most `2^-46` (scaled to `a, s ∈ [1, 2)`),
/// still inside the `2^-45` that separates `a/s` from every rounding midpoint. The low part is
/// the rounded difference of an f64 reciprocal and `p` (exact in f64; not negative because
/// rounding to f64 keeps `1/s ≥ p`). `tests::rd_split_quotient_is_the_division` checks it.
#[inline]
pub(crate) fn recip_split_rd(s: f32) -> (f32, f32) {
    let r = 1.0 / f64::from(s);
    let mut hi = 1.0 / s;
    if f64::from(hi) > r {
        // s > 0 and finite here, so hi is positive and finite: one step down is the next f32.
        hi = f32::from_bits(hi.to_bits() - 1);
    }
    (hi, (r - f64::from(hi)) as f32)
}

/// [`recip_split_rd`] of eight lanes (positive normal scales): the high part by a division
/// rounded toward −∞, the low part from an f64 reciprocal.
#[inline(always)]
unsafe fn recip_split_rd8(s: __m256) -> (__m256, __m256) {
    let hi = _mm512_castps512_ps256(_mm512_div_round_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(
        _mm512_set1_ps(1.0),
        _mm512_castps256_ps512(s),
    ));
    let r = _mm512_div_pd(_mm512_set1_pd(1.0), _mm512_cvtps_pd(s));
    (hi, _mm512_cvtpd_ps(_mm512_sub_pd(r, _mm512_cvtps_pd(hi))))
}

/// `avx2::fp8_encode_rows_rotated` on AVX-512, one row at a time and without a buffer when the
/// row is a single chunk: rotated in registers, its amax reduced from them, its scale
/// (`crate::scale::fp8_scale`) computed, and its codes written from the same registers. Rows of
/// several chunks are rotated into `fb` (head_dim f32, in L1) first. The bytes are those of
/// rotating every row and encoding the f32 rows with `fp8_encode_rows`.
///
/// Returns the largest rotated magnitude as f32 bits (NaN and Inf above every finite value, see
/// [`fwd_chunk`]'s probe): at most [`ROTATED_SAFE_BITS`] proves every source value finite and
/// within `crate::rotation::ROTATION_MAX_INPUT`, so the range check costs no pass of its own;
/// above it the caller checks the source rows (and discards what was written if it refuses
/// them). Any input is safe here: non-finite or huge values only make meaningless codes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,fma")]
pub(crate) unsafe fn fp8_encode_rows_rotated(
    dtype: DType,
    src: &[u8],
    mul: &[f32],
    chunks: &[usize],
    scales: &mut [u8],
    codes: &mut [u8],
) -> u32 {
    debug_assert!(covers(dtype, chunks));
    let hd = mul.len();
    let row_bytes = hd * dtype.size() as usize;
    let rows = codes.len() / hd.max(1);
    assert!(rows * row_bytes <= src.len() && 4 * rows <= scales.len());
    // The range check: NaN/Inf probes, and the rotated amaxes (integer max of their bits).
    let mut probe = _mm512_setzero_si512();
    let mut rot_max = _mm256_setzero_si256();
    // Eight rows at a time: each rotated in registers chunk by chunk and stored as f32 into `buf`
    // (in L1), its amax taken from the registers; then the eight scales computed together
    // (`avx2::fp8_scale8`, the lanes of `crate::scale::fp8_scale`) and the codes written from
    // `buf`. No row waits on its own scale's chain of divisions.
    let mut buf = vec![0f32; 8 * hd];
    let mut r = 0;
    while r + 8 <= rows {
        let mut amax = [_mm256_setzero_si256(); 8];
        for (k, am) in amax.iter_mut().enumerate() {
            let s = &src[(r + k) * row_bytes..(r + k + 1) * row_bytes];
            let m = fwd_row(dtype, s, mul, chunks, &mut buf[k * hd..(k + 1) * hd], &mut probe);
            *am = _mm256_castps_si256(_mm256_max_ps(_mm512_castps512_ps256(m), _mm512_extractf32x8_ps::<1>(m)));
        }
        // The magnitudes' bits (sign cleared): an integer max orders them like the values.
        let amax = avx2::reduce8::<{ avx2::FP32 }>(&amax);
        rot_max = _mm256_max_epu32(rot_max, _mm256_castps_si256(amax));
        let s = avx2::fp8_scale8(amax);
        // s = 0 (amax below 2^-100) encodes with scale 1, as the scalar code does.
        let is0 = _mm256_cmp_ps::<_CMP_EQ_OQ>(s, _mm256_setzero_ps());
        let se = _mm256_blendv_ps(s, _mm256_set1_ps(1.0), is0);
        let (yh, yl) = recip_split_rd8(se);
        // SAFETY: 32 bytes at 4r are inside scales (r + 8 ≤ rows, assert above).
        _mm256_storeu_ps(scales.as_mut_ptr().add(4 * r) as *mut f32, s);
        let mut sv = [0f32; 8];
        // SAFETY: sv is 32 bytes.
        _mm256_storeu_ps(sv.as_mut_ptr(), se);
        let all_exact = avx2::exact_ok8(se);
        for (k, &sk) in sv.iter().enumerate() {
            let row = &buf[k * hd..(k + 1) * hd];
            let dst = &mut codes[(r + k) * hd..(r + k + 1) * hd];
            let idx = _mm512_set1_epi32(k as i32);
            if all_exact || avx2::exact_ok(sk) {
                let p = _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(yh));
                let q = _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(yl));
                quantize_row::<true>(row, p, q, dst);
            } else {
                let p = _mm512_set1_ps(sk);
                quantize_row::<false>(row, p, p, dst);
            }
        }
        r += 8;
    }
    // The rows left (fewer than eight), one at a time.
    for r in r..rows {
        let s = &src[r * row_bytes..(r + 1) * row_bytes];
        let row = &mut buf[..hd];
        let m = fwd_row(dtype, s, mul, chunks, row, &mut probe);
        let bits = max_bits(m);
        rot_max = _mm256_max_epu32(rot_max, _mm256_set1_epi32(bits as i32));
        let se = row_scale(bits, &mut scales[4 * r..4 * r + 4]);
        let dst = &mut codes[r * hd..(r + 1) * hd];
        if avx2::exact_ok(se) {
            let (hi, lo) = recip_split_rd(se);
            quantize_row::<true>(row, _mm512_set1_ps(hi), _mm512_set1_ps(lo), dst);
        } else {
            let p = _mm512_set1_ps(se);
            quantize_row::<false>(row, p, p, dst);
        }
    }
    _mm512_reduce_max_epu32(_mm512_max_epu32(probe, _mm512_castsi256_si512(rot_max)))
}

/// One row of `s` rotated chunk by chunk in registers ([`fwd_chunk`]) and stored into `row`
/// (f32); returns the max magnitude of the rotated values in sixteen lanes ([`max_abs`]).
#[inline(always)]
unsafe fn fwd_row(
    dtype: DType,
    s: &[u8],
    mul: &[f32],
    chunks: &[usize],
    row: &mut [f32],
    probe: &mut __m512i,
) -> __m512 {
    let mut acc = _mm512_setzero_ps();
    let mut off = 0;
    for &n in chunks {
        by_chunk!(n, |v| {
            acc = max_abs(acc, fwd_chunk(dtype, s, mul, off, &mut v, probe));
            assert!(off + 16 * v.len() <= row.len());
            for (k, x) in v.iter().enumerate() {
                // SAFETY: elements off + 16k .. + 16 are inside row (assert above).
                _mm512_storeu_ps(row.as_mut_ptr().add(off + 16 * k), *x);
            }
        });
        off += n;
    }
    acc
}

/// The E4M3 codes of the f32 `row` divided by the scale whose [`e4m3_codes16`] operands are `p`,
/// `q`, into `dst` (`row.len()` a multiple of 16): 64 at a time ([`e4m3_codes64`]), then 16.
#[inline(always)]
unsafe fn quantize_row<const EXACT: bool>(row: &[f32], p: __m512, q: __m512, dst: &mut [u8]) {
    let n = row.len();
    assert!(n.is_multiple_of(16) && dst.len() >= n);
    let (rp, dp) = (row.as_ptr(), dst.as_mut_ptr());
    let mut i = 0;
    while i + 64 <= n {
        // SAFETY: elements i .. i + 64 are inside row and dst (loop condition, assert above).
        let x = [
            _mm512_loadu_ps(rp.add(i)),
            _mm512_loadu_ps(rp.add(i + 16)),
            _mm512_loadu_ps(rp.add(i + 32)),
            _mm512_loadu_ps(rp.add(i + 48)),
        ];
        _mm512_storeu_si512(dp.add(i) as *mut _, e4m3_codes64::<EXACT>(&x, p, q));
        i += 64;
    }
    while i < n {
        // SAFETY: elements i .. i + 16 are inside row and dst (n is a multiple of 16).
        _mm_storeu_si128(dp.add(i) as *mut __m128i, e4m3_codes16::<EXACT>(_mm512_loadu_ps(rp.add(i)), p, q));
        i += 16;
    }
}

/// Writes the FP8 scale of a row of amax bits `bits` into `sc` (4 bytes, little-endian) and
/// returns the divisor its codes use (the scale, or 1 for a zero scale).
#[inline(always)]
fn row_scale(bits: u32, sc: &mut [u8]) -> f32 {
    let s = crate::scale::fp8_scale(f32::from_bits(bits));
    sc.copy_from_slice(&s.to_le_bytes());
    if s == 0.0 {
        1.0
    } else {
        s
    }
}

/// FP8 codes of one chunk (`16N` bytes at `off` of the row `c`) as f32 times `sc = 256·scale`
/// into `v`: code → the FP16 pattern of `code·2^-8` (sign-extend the byte to 16 bits, shift the
/// magnitude under the FP16 exponent, keep bit 15 as the sign), FP16 → f32 (exact), one product:
/// `fl(e4m3(code) · scale)`, the scalar decoder's value (`avx2::fp8_decode_row`'s construction on
/// sixteen lanes).
/// Returns the running max of `code & 0x7F` (0x7F: a NaN code) folded into `bad`.
#[inline(always)]
unsafe fn fp8_dequant_chunk<const N: usize>(
    c: &[u8],
    off: usize,
    sc: __m512,
    v: &mut [__m512; N],
    bad: __m128i,
) -> __m128i {
    assert!(off + 16 * N <= c.len());
    let mut bad = bad;
    // Thirty-two codes at a time where the chunk has them: the NaN check, the sign extension and
    // the FP16 construction on one 256/512-bit vector each, then two conversions.
    let mut bad32 = _mm256_setzero_si256();
    let mut k = 0;
    while k + 2 <= N {
        // SAFETY: bytes off + 16k .. + 32 are inside c (assert above, k + 2 ≤ N).
        let b = _mm256_loadu_si256(c.as_ptr().add(off + 16 * k) as *const __m256i);
        bad32 = _mm256_max_epu8(bad32, _mm256_and_si256(b, _mm256_set1_epi8(0x7F)));
        let h = _mm512_and_si512(_mm512_slli_epi16::<7>(_mm512_cvtepi8_epi16(b)), _mm512_set1_epi16(0xBF80u16 as i16));
        v[k] = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), sc);
        v[k + 1] = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(h)), sc);
        k += 2;
    }
    if k < N {
        // SAFETY: bytes off + 16k .. + 16 are inside c (assert above, k < N).
        let b = _mm_loadu_si128(c.as_ptr().add(off + 16 * k) as *const __m128i);
        bad = _mm_max_epu8(bad, _mm_and_si128(b, _mm_set1_epi8(0x7F)));
        let h = _mm256_and_si256(_mm256_slli_epi16::<7>(_mm256_cvtepi8_epi16(b)), _mm256_set1_epi16(0xBF80u16 as i16));
        v[k] = _mm512_mul_ps(_mm512_cvtph_ps(h), sc);
    }
    _mm_max_epu8(bad, _mm_max_epu8(_mm256_castsi256_si128(bad32), _mm256_extracti128_si256::<1>(bad32)))
}

/// Multiplies a chunk by `mul` (elements `off..off + 16N`) and stores it at elements `off..` of
/// the row `o` in `dtype`: BF16 two vectors at a time, by `vcvtne2ps2bf16` with `NE`
/// ([`store32_bf16_ne`]) else by [`store32_bf16`].
#[inline(always)]
unsafe fn store_chunk<const N: usize, const NE: bool>(
    v: &[__m512; N],
    mul: &[f32],
    off: usize,
    dtype: DType,
    o: &mut [u8],
) {
    assert!(off + 16 * N <= mul.len() && (off + 16 * N) * dtype.size() as usize <= o.len());
    let mp = mul.as_ptr().add(off);
    let mut k = 0;
    if dtype == DType::Bf16 {
        while k + 2 <= N {
            // SAFETY: elements off + 16k .. + 32 are inside mul and o (assert above, k + 2 ≤ N).
            let (a, b) = (
                _mm512_mul_ps(v[k], _mm512_loadu_ps(mp.add(16 * k))),
                _mm512_mul_ps(v[k + 1], _mm512_loadu_ps(mp.add(16 * k + 16))),
            );
            let p = o.as_mut_ptr().add(2 * (off + 16 * k));
            if NE {
                store32_bf16_ne(p, a, b);
            } else {
                store32_bf16(p, a, b);
            }
            k += 2;
        }
    }
    while k < N {
        // SAFETY: elements off + 16k .. + 16 are inside mul and o (assert above).
        store16(dtype, o, off + 16 * k, _mm512_mul_ps(v[k], _mm512_loadu_ps(mp.add(16 * k))));
        k += 1;
    }
}

/// [`store32_bf16`] by one `vcvtne2ps2bf16` (AVX512-BF16), which rounds to nearest even like it
/// but reads subnormal inputs as zero: the callers take it only for rows that cannot hold a
/// subnormal value (see [`BF16NE_MIN_SCALE`]) and no NaN.
///
/// # Safety
///
/// AVX-512F and AVX512-BF16 (the calling kernel enables both and is only reached after they were
/// detected); `p .. p + 64` writable.
#[inline(always)]
unsafe fn store32_bf16_ne(p: *mut u8, a: __m512, b: __m512) {
    // The second operand fills the low half.
    let r = _mm512_cvtne2ps_pbh(b, a);
    // SAFETY: p .. p + 64 is writable (this function's contract); __m512bh is 64 bytes of bits.
    _mm512_storeu_si512(p as *mut _, std::mem::transmute::<__m512bh, __m512i>(r));
}

/// Rows whose decode scale is 0 or at least this (2^-80) decode with no subnormal f32 anywhere
/// (so [`store32_bf16_ne`] is exact on them). Every dequantized value `fl(e4m3 · s)` (or
/// `fl(e2m1 · fl(e4m3 · g))`) is 0 or a multiple of `2^(e − 35)` (`e` the scale's exponent: the
/// codes are at least 2^-10 of the scale, and a rounded value is a multiple of its own ulp); the
/// butterflies' sums and differences stay multiples of it (rounding only to coarser multiples);
/// the final product by `±fl(1/sqrt(n)) ≥ 1/16` keeps nonzero values above `2^(e − 40)`, normal
/// for `e ≥ −80`.
const BF16NE_MIN_SCALE: f32 = 8.271_806e-25; // 2^-80

/// Stores 32 f32 (`a` then `b`) as BF16 at `p` (64 bytes), rounding to nearest even: the bytes of
/// [`store16`]'s `(bits + 0x7FFF + lsb) >> 16`, on words: the high halves `h` and low halves `l`
/// of all 32 gathered by two word permutes, then `h + 1` where `l + (h & 1) > 0x8000` (the
/// saturating add keeps `l = 0xFFFF` above the threshold): the carry of the 32-bit sum.
///
/// # Safety
///
/// AVX-512F/BW (the file's contract); `p .. p + 64` writable.
#[inline(always)]
unsafe fn store32_bf16(p: *mut u8, a: __m512, b: __m512) {
    let (a, b) = (_mm512_castps_si512(a), _mm512_castps_si512(b));
    let odd = _mm512_set_epi16(
        63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9,
        7, 5, 3, 1,
    );
    let one = _mm512_set1_epi16(1);
    let h = _mm512_permutex2var_epi16(a, odd, b);
    let l = _mm512_permutex2var_epi16(a, _mm512_sub_epi16(odd, one), b);
    let up =
        _mm512_cmpgt_epu16_mask(_mm512_adds_epu16(l, _mm512_and_si512(h, one)), _mm512_set1_epi16(0x8000u16 as i16));
    // SAFETY: p .. p + 64 is writable (this function's contract).
    _mm512_storeu_si512(p as *mut _, _mm512_mask_add_epi16(h, up, h, one));
}

/// FP8 decoding fused with the inverse rotation, one row at a time in registers: each chunk's
/// codes dequantized ([`fp8_dequant_chunk`], the decoder's `fl(code · scale)`), the transform
/// ([`wht_regs16`]), times `mul`, stored as `dtype`: the bytes of decoding every row into f32
/// and unrotating those ([`unrotate_rows`]), with no f32 row in memory. `scale(k)`: the scale of
/// row `k` of `codes` (`mul.len()` codes per row). Returns whether a NaN code (never written by
/// the encoder) was met; `dst` is then unspecified. The caller has checked [`covers`] and that
/// every scale is small enough that no decoded value can pass
/// `crate::rotation::ROTATION_MAX_DECODED` (the check `unrotate_rows`' amax serves).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,fma")]
pub(crate) unsafe fn fp8_decode_rows_rotated<F: Fn(usize) -> f32>(
    codes: &[u8],
    scale: F,
    mul: &[f32],
    chunks: &[usize],
    dtype: DType,
    dst: &mut [u8],
) -> bool {
    fp8_decode_rows_rotated_t::<F, false>(codes, scale, mul, chunks, dtype, dst)
}

/// [`fp8_decode_rows_rotated`] storing BF16 by `vcvtne2ps2bf16` in the rows whose scale allows
/// it ([`bf16ne_ok`]).
///
/// # Safety
///
/// As [`fp8_decode_rows_rotated`], and AVX512-BF16 detected.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,fma,avx512bf16")]
pub(crate) unsafe fn fp8_decode_rows_rotated_bf16ne<F: Fn(usize) -> f32>(
    codes: &[u8],
    scale: F,
    mul: &[f32],
    chunks: &[usize],
    dtype: DType,
    dst: &mut [u8],
) -> bool {
    fp8_decode_rows_rotated_t::<F, true>(codes, scale, mul, chunks, dtype, dst)
}

/// Whether rows of this decode scale may take [`store32_bf16_ne`] (see [`BF16NE_MIN_SCALE`]).
#[inline(always)]
fn bf16ne_ok(s: f32) -> bool {
    s == 0.0 || s >= BF16NE_MIN_SCALE
}

#[inline(always)]
unsafe fn fp8_decode_rows_rotated_t<F: Fn(usize) -> f32, const NE: bool>(
    codes: &[u8],
    scale: F,
    mul: &[f32],
    chunks: &[usize],
    dtype: DType,
    dst: &mut [u8],
) -> bool {
    debug_assert!(covers(dtype, chunks));
    let hd = mul.len();
    let mut bad = _mm_setzero_si128();
    for (r, (c, o)) in codes.chunks_exact(hd).zip(dst.chunks_exact_mut(hd * dtype.size() as usize)).enumerate() {
        let s = scale(r);
        let sc = _mm512_set1_ps(s * 256.0);
        bad = if NE && bf16ne_ok(s) {
            fp8_decode_row::<true>(c, sc, mul, chunks, dtype, o, bad)
        } else {
            fp8_decode_row::<false>(c, sc, mul, chunks, dtype, o, bad)
        };
    }
    _mm_movemask_epi8(_mm_cmpeq_epi8(bad, _mm_set1_epi8(0x7F))) != 0
}

/// One row of [`fp8_decode_rows_rotated_t`]: codes `c`, `sc = 256·scale`, into `o`.
#[inline(always)]
unsafe fn fp8_decode_row<const NE: bool>(
    c: &[u8],
    sc: __m512,
    mul: &[f32],
    chunks: &[usize],
    dtype: DType,
    o: &mut [u8],
    bad: __m128i,
) -> __m128i {
    let mut bad = bad;
    let mut off = 0;
    for &n in chunks {
        by_chunk!(n, |v| {
            bad = fp8_dequant_chunk(c, off, sc, &mut v, bad);
            wht_regs16(&mut v);
            store_chunk::<_, NE>(&v, mul, off, dtype, o);
        });
        off += n;
    }
    bad
}

/// See `scalar::fp8_decode_row`: the plain (unrotated) FP8 decoder on sixteen lanes, for a run
/// of rows of `hd` codes (row `k` of `codes`, scale `scale(k)`, into row `k` of `dst`, so the
/// feature check, the dtype dispatch and the call happen once per run): thirty-two codes a step
/// ([`fp8_dequant_chunk`], `avx2::fp8_decode_row`'s construction), BF16 stored thirty-two at a
/// time ([`store32_bf16`]), other dtypes by [`store16`]; the last codes of a row not filling a
/// step by the AVX2 kernel. The same bytes as the scalar decoder; returns whether a NaN code
/// (never written by the encoder) was met, `dst` then unspecified.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,fma")]
pub(crate) unsafe fn fp8_decode_plain_rows<F: Fn(usize) -> f32>(
    codes: &[u8],
    hd: usize,
    scale: F,
    out: DType,
    dst: &mut [u8],
) -> bool {
    fp8_decode_plain_rows_t::<F, false>(codes, hd, scale, out, dst)
}

/// [`fp8_decode_plain_rows`] storing BF16 by `vcvtne2ps2bf16` in the rows whose scale allows it
/// ([`bf16ne_ok`]: no decoded value is then subnormal, so the instruction's rounding is the
/// scalar one).
///
/// # Safety
///
/// As [`fp8_decode_plain_rows`], and AVX512-BF16 detected.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,fma,avx512bf16")]
pub(crate) unsafe fn fp8_decode_plain_rows_bf16ne<F: Fn(usize) -> f32>(
    codes: &[u8],
    hd: usize,
    scale: F,
    out: DType,
    dst: &mut [u8],
) -> bool {
    fp8_decode_plain_rows_t::<F, true>(codes, hd, scale, out, dst)
}

#[inline(always)]
unsafe fn fp8_decode_plain_rows_t<F: Fn(usize) -> f32, const NE: bool>(
    codes: &[u8],
    hd: usize,
    scale: F,
    out: DType,
    dst: &mut [u8],
) -> bool {
    super::any_row(codes, hd, dst, hd * out.size() as usize, |k, c, o| fp8_decode_plain_t::<NE>(c, scale(k), out, o))
}

#[inline(always)]
unsafe fn fp8_decode_plain_t<const NE: bool>(codes: &[u8], scale: f32, out: DType, dst: &mut [u8]) -> bool {
    if !(scale * 256.0).is_finite() {
        // As in the AVX2 kernel: `256 · scale` would overflow where `code · scale` does not.
        return super::scalar::fp8_decode_row(codes, scale, out, dst);
    }
    let os = out.size() as usize;
    let n = codes.len();
    assert!(n * os <= dst.len());
    let sc = _mm512_set1_ps(scale * 256.0);
    let ne = NE && bf16ne_ok(scale);
    let mut bad = _mm_setzero_si128();
    let mut i = 0;
    while i + 32 <= n {
        let mut v = [_mm512_setzero_ps(); 2];
        bad = fp8_dequant_chunk(codes, i, sc, &mut v, bad);
        if out == DType::Bf16 {
            // SAFETY: elements i .. i + 32 (64 bytes at 2i) are inside dst (assert above).
            let p = dst.as_mut_ptr().add(2 * i);
            if ne {
                store32_bf16_ne(p, v[0], v[1]);
            } else {
                store32_bf16(p, v[0], v[1]);
            }
        } else {
            // SAFETY: elements i .. i + 32 are inside dst (assert above).
            store16(out, dst, i, v[0]);
            store16(out, dst, i + 16, v[1]);
        }
        i += 32;
    }
    let tail_bad = i < n && avx2::fp8_decode_row(&codes[i..], scale, out, &mut dst[i * os..]);
    _mm_movemask_epi8(_mm_cmpeq_epi8(bad, _mm_set1_epi8(0x7F))) != 0 || tail_bad
}

/// The sixteen E2M1 values in code order (sign in bit 3), for a lane permute.
const E2M1_SIGNED: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// NVFP4 decoding fused with the inverse rotation, one row at a time in registers (see
/// [`fp8_decode_rows_rotated`]): a row's block scales `d = fl(e4m3(bs) · g)` computed sixteen at
/// a time (the FP16 construction of [`fp8_dequant_chunk`], times `256·g`), then for each
/// micro-block (one vector) the sixteen products `fl(e2m1(c) · d)` as a table and each element's
/// nibble picking its entry by a lane permute; then the transform, times `mul`, stored as `dtype`.
/// The bytes of `scalar::nvfp4_decode_row` into f32 followed by [`unrotate_rows`]. `g(k)`: the
/// global scale of row `k`. Returns whether a block scale code is not a valid unsigned E4M3 code
/// (`dst` is then unspecified). The caller has checked [`covers`] (so `mul.len()` is a multiple
/// of 16) and that every global scale is at most 2^98 (so no decoded value can pass
/// `crate::rotation::ROTATION_MAX_DECODED`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,fma")]
pub(crate) unsafe fn nvfp4_decode_rows_rotated<F: Fn(usize) -> f32>(
    bs: &[u8],
    codes: &[u8],
    g: F,
    mul: &[f32],
    chunks: &[usize],
    dtype: DType,
    dst: &mut [u8],
) -> bool {
    nvfp4_decode_rows_rotated_t::<F, false>(bs, codes, g, mul, chunks, dtype, dst)
}

/// [`nvfp4_decode_rows_rotated`] storing BF16 by `vcvtne2ps2bf16` in the rows whose global scale
/// allows it ([`bf16ne_ok`]).
///
/// # Safety
///
/// As [`nvfp4_decode_rows_rotated`], and AVX512-BF16 detected.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,fma,avx512bf16")]
pub(crate) unsafe fn nvfp4_decode_rows_rotated_bf16ne<F: Fn(usize) -> f32>(
    bs: &[u8],
    codes: &[u8],
    g: F,
    mul: &[f32],
    chunks: &[usize],
    dtype: DType,
    dst: &mut [u8],
) -> bool {
    nvfp4_decode_rows_rotated_t::<F, true>(bs, codes, g, mul, chunks, dtype, dst)
}

#[inline(always)]
unsafe fn nvfp4_decode_rows_rotated_t<F: Fn(usize) -> f32, const NE: bool>(
    bs: &[u8],
    codes: &[u8],
    g: F,
    mul: &[f32],
    chunks: &[usize],
    dtype: DType,
    dst: &mut [u8],
) -> bool {
    debug_assert!(covers(dtype, chunks));
    let hd = mul.len();
    assert!(hd.is_multiple_of(16));
    let (nb, cb) = (hd / 16, hd / 2);
    let mut d = vec![0f32; nb.next_multiple_of(16)];
    let mut bad = _mm_setzero_si128();
    let rows = codes.len() / cb.max(1);
    assert!(rows * nb <= bs.len());
    for (r, (c, o)) in codes.chunks_exact(cb).zip(dst.chunks_exact_mut(hd * dtype.size() as usize)).enumerate() {
        let rbs = &bs[r * nb..(r + 1) * nb];
        let gr = g(r);
        let gs = _mm512_set1_ps(gr * 256.0);
        let mut b = 0;
        while b < nb {
            let m = (nb - b).min(16);
            let k: __mmask16 = if m == 16 { 0xFFFF } else { (1u16 << m) - 1 };
            // SAFETY: the mask keeps the load to bytes b..b + m of rbs (masked-out bytes are not
            // read and read as 0); d has room for sixteen lanes at b (its length is a multiple
            // of 16 above nb).
            let s = _mm_maskz_loadu_epi8(k, rbs.as_ptr().add(b) as *const i8);
            bad = _mm_max_epu8(bad, s);
            let h = _mm256_slli_epi16::<7>(_mm256_cvtepu8_epi16(s));
            _mm512_storeu_ps(d.as_mut_ptr().add(b), _mm512_mul_ps(_mm512_cvtph_ps(h), gs));
            b += 16;
        }
        if NE && bf16ne_ok(gr) {
            nvfp4_decode_row::<true>(c, &d, mul, chunks, dtype, o);
        } else {
            nvfp4_decode_row::<false>(c, &d, mul, chunks, dtype, o);
        }
    }
    // Valid block scales are unsigned E4M3 codes below 0x7F (NaN).
    _mm_movemask_epi8(_mm_cmpeq_epi8(_mm_max_epu8(bad, _mm_set1_epi8(0x7F)), bad)) != 0
}

/// One row of [`nvfp4_decode_rows_rotated_t`]: code bytes `c`, block scales `d` (decoded), into
/// `o`.
#[inline(always)]
unsafe fn nvfp4_decode_row<const NE: bool>(
    c: &[u8],
    d: &[f32],
    mul: &[f32],
    chunks: &[usize],
    dtype: DType,
    o: &mut [u8],
) {
    let hd = mul.len();
    assert!(c.len() == hd / 2 && d.len() >= hd / 16);
    let table = _mm512_loadu_ps(E2M1_SIGNED.as_ptr());
    let shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    let halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    let mut off = 0;
    for &n in chunks {
        by_chunk!(n, |v| {
            assert!(off + 16 * v.len() <= hd);
            for (k, x) in v.iter_mut().enumerate() {
                let blk = off / 16 + k;
                let t = _mm512_mul_ps(table, _mm512_set1_ps(d[blk]));
                // SAFETY: the 8 code bytes of block blk (8·blk .. + 8 ≤ hd / 2 = c.len()) are
                // inside c (assert above).
                let w = _mm_loadl_epi64(c.as_ptr().add(8 * blk) as *const __m128i);
                let idx = _mm512_srlv_epi32(_mm512_permutexvar_epi32(halves, _mm512_castsi128_si512(w)), shifts);
                *x = _mm512_permutexvar_ps(idx, t);
            }
            wht_regs16(&mut v);
            store_chunk::<_, NE>(&v, mul, off, dtype, o);
        });
        off += n;
    }
}

/// [`rotate_rows`] for rows this file covers ([`covers`]), returning the largest magnitude of the
/// rotated values as f32 bits (NaN above every finite value; a source holding a NaN, an infinity
/// or a value beyond `crate::rotation::ROTATION_MAX_INPUT` always gives more than
/// [`ROTATED_SAFE_BITS`]), taken from the registers: the NVFP4 plane amax without another pass.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,fma")]
pub(crate) unsafe fn rotate_rows_max(dtype: DType, src: &[u8], mul: &[f32], chunks: &[usize], out: &mut [u8]) -> u32 {
    debug_assert!(covers(dtype, chunks));
    let hd = mul.len();
    let mut acc = _mm512_setzero_ps();
    let mut probe = _mm512_setzero_si512();
    for (s, o) in src.chunks_exact(hd * dtype.size() as usize).zip(out.chunks_exact_mut(hd * 4)) {
        let mut off = 0;
        for &n in chunks {
            by_chunk!(n, |v| {
                acc = max_abs(acc, fwd_chunk(dtype, s, mul, off, &mut v, &mut probe));
                store_f32s(&v, off, o);
            });
            off += n;
        }
    }
    max_bits(acc).max(_mm512_reduce_max_epu32(probe))
}

/// Rotated values all at most 2^90 in magnitude prove the source finite and within
/// `crate::rotation::ROTATION_MAX_INPUT` (2^100): a chunk of `n ≤ 256` channels holding `|x| >
/// 2^100` has a rotated norm above 2^100 (the rotation keeps norms, to f32 rounding), so some
/// rotated value above `2^100 / sqrt(n) ≥ 2^96`; a NaN or infinity makes NaN or infinite rotated
/// values. Above it, the caller checks the source itself.
pub(crate) const ROTATED_SAFE_BITS: u32 = 0x6C80_0000; // 2^90

/// NVFP4 codes of rows of little-endian f32 (`hd` a multiple of 16 per row) of one plane, with
/// its global scale `g` and encode factor `enc`: the bytes of `scalar::nvfp4_encode_row` (and of
/// `avx2::nvfp4_encode_rows`). Three steps over the plane, so that no row waits on its own
/// chain of divisions: every micro-block's amax ([`block_amax8`], eight blocks per tree), then
/// every block scale code and reciprocal sixteen at a time ([`block_scales16`]), then every
/// block's codes ([`nvfp4_codes8`]) with its reciprocal broadcast from memory.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,fma")]
pub(crate) unsafe fn nvfp4_encode_rows_f32(src: &[u8], hd: usize, g: f32, enc: f32, bs: &mut [u8], codes: &mut [u8]) {
    assert!(hd.is_multiple_of(16) && hd > 0);
    let (nb, cb) = (hd / 16, hd / 2);
    let rows = bs.len() / nb;
    let blocks = rows * nb;
    assert!(src.len() >= blocks * 64 && codes.len() >= rows * cb && bs.len() == blocks);
    // Block amaxes, then reciprocals, in one buffer (padded to whole vectors).
    let mut t = vec![0f32; blocks.next_multiple_of(16)];
    let mut b = 0;
    while b < blocks {
        let m = (blocks - b).min(8);
        // SAFETY: blocks b .. b + m are inside src (assert above); t has room for eight lanes at
        // b (its length is a multiple of 16 at or above blocks, and b is a multiple of 8).
        let am = block_amax8(src.as_ptr().add(64 * b) as *const f32, m);
        _mm256_storeu_ps(t.as_mut_ptr().add(b), am);
        b += 8;
    }
    let mut b = 0;
    while b < blocks {
        let m = (blocks - b).min(16);
        let k: __mmask16 = if m == 16 { 0xFFFF } else { (1u16 << m) - 1 };
        // SAFETY: t has sixteen lanes at b (see above); the byte store is masked to bs's m bytes
        // at b.
        let (c, inv) = block_scales16(_mm512_loadu_ps(t.as_ptr().add(b)), g, enc);
        _mm512_storeu_ps(t.as_mut_ptr().add(b), inv);
        _mm512_mask_cvtepi32_storeu_epi8(bs.as_mut_ptr().add(b) as *mut i8, k, c);
        b += 16;
    }
    let mut b = 0;
    while b < blocks {
        // Eight blocks at a time, never across a row (the rows' codes are contiguous, so only
        // the count matters).
        let m = (nb - b % nb).min(8);
        // SAFETY: blocks b .. b + m are inside src, t and codes (8 bytes per block; asserts above).
        nvfp4_codes8(src.as_ptr().add(64 * b) as *const f32, t.as_ptr().add(b), m, codes.as_mut_ptr().add(8 * b));
        b += m;
    }
}

/// The amaxes of micro-blocks `0..m` (`1 ≤ m ≤ 8`; sixteen f32 each at `p`) in lanes `0..m`
/// (0 in the others): a tree of unpacks and [`max_abs`] keeping each lane to one block's
/// elements, then the 128-bit lanes folded.
///
/// # Safety
///
/// AVX-512 (the file's contract); `p .. p + 16m` readable.
#[inline(always)]
unsafe fn block_amax8(p: *const f32, m: usize) -> __m256 {
    let mut x = [_mm512_setzero_ps(); 8];
    for (k, v) in x.iter_mut().enumerate().take(m) {
        // SAFETY: block k < m is readable (this function's contract).
        *v = _mm512_loadu_ps(p.add(16 * k));
    }
    // After the 32-bit and 64-bit unpack levels each 128-bit lane L holds, for four blocks, the
    // max over that lane's four elements.
    let (p01, p23, p45, p67) = (amax_l1(x[0], x[1]), amax_l1(x[2], x[3]), amax_l1(x[4], x[5]), amax_l1(x[6], x[7]));
    let (q0, q1) = (amax_l2(p01, p23), amax_l2(p45, p67));
    // [q0.L0, q0.L2, q1.L0, q1.L2] ∨ [q0.L1, q0.L3, q1.L1, q1.L3], then the two halves of each.
    let r = _mm512_max_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(q0, q1), _mm512_shuffle_f32x4::<0b11_01_11_01>(q0, q1));
    let r = _mm512_max_ps(r, _mm512_shuffle_f32x4::<0b10_11_00_01>(r, r));
    // Blocks 0–3 in lanes 0–3, blocks 4–7 in lanes 8–11.
    _mm512_castps512_ps256(_mm512_permutexvar_ps(
        _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 0, 0, 0, 0, 0, 0, 0, 0),
        r,
    ))
}

/// `avx2::block_scales8` on sixteen lanes: the block scale codes (32-bit lanes) and multipliers
/// `1/d` (0 where `d = 0`) of sixteen micro-block amaxes, with the same operations as
/// `crate::scale::nvfp4_block_scale` (a division by 6, a product, the saturating E4M3 rounding,
/// the code's exact value times `g`, a division).
#[inline(always)]
unsafe fn block_scales16(amax: __m512, g: f32, enc: f32) -> (__m512i, __m512) {
    let t = _mm512_mul_ps(_mm512_div_ps(amax, _mm512_set1_ps(6.0)), _mm512_set1_ps(enc));
    let a = _mm512_min_ps(t, _mm512_set1_ps(448.0));
    let ab = _mm512_castps_si512(a);
    let m = _mm512_max_epi32(
        _mm512_add_epi32(_mm512_and_si512(ab, _mm512_set1_epi32(0x7F80_0000)), _mm512_set1_epi32(20 << 23)),
        _mm512_set1_epi32(141 << 23),
    );
    let tt = _mm512_castps_si512(_mm512_add_ps(a, _mm512_castsi512_ps(m)));
    let c = _mm512_sub_epi32(
        _mm512_add_epi32(_mm512_sub_epi32(tt, m), _mm512_srli_epi32::<20>(m)),
        _mm512_set1_epi32(E4M3_BIAS),
    );
    // The code's exact value: normal codes by their bit pattern, subnormal ones as c · 2^-9.
    let normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32::<20>(c), _mm512_set1_epi32(120 << 23)));
    let sub = _mm512_mul_ps(_mm512_cvtepi32_ps(c), _mm512_set1_ps(0.001953125));
    let is_sub = _mm512_cmplt_epi32_mask(c, _mm512_set1_epi32(8));
    let d = _mm512_mul_ps(_mm512_mask_blend_ps(is_sub, normal, sub), _mm512_set1_ps(g));
    let nz = _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(d, _mm512_setzero_ps());
    (c, _mm512_maskz_div_ps(nz, _mm512_set1_ps(1.0), d))
}

/// The E2M1 code bytes of micro-blocks `0..m` (`1 ≤ m ≤ 8`; sixteen f32 each at `p`), each
/// multiplied by its reciprocal `inv[k]`, into `8m` bytes at `out` (element 2i in the low
/// nibble): [`e2m1_x64`] per vector, packed and paired by [`e2m1_pairs`], one word permute into
/// element order.
///
/// # Safety
///
/// AVX-512 (the file's contract); `p .. p + 16m` and `inv .. inv + m` readable, `out .. out + 8m`
/// writable.
#[inline(always)]
unsafe fn nvfp4_codes8(p: *const f32, inv: *const f32, m: usize, out: *mut u8) {
    let mut qs = [_mm512_setzero_ps(); 8];
    for (k, q) in qs.iter_mut().enumerate().take(m) {
        // SAFETY: block k < m and its reciprocal are readable (this function's contract).
        *q = _mm512_mul_ps(_mm512_loadu_ps(p.add(16 * k)), _mm512_set1_ps(*inv.add(k)));
    }
    let nib = _mm512_packus_epi16(e2m1_pairs(&qs, 0), e2m1_pairs(&qs, 4));
    // Lane L, word j (vector j's elements 4L .. 4L + 3) → word 4j + L.
    let idx = _mm512_set_epi16(
        31, 23, 15, 7, 30, 22, 14, 6, 29, 21, 13, 5, 28, 20, 12, 4, 27, 19, 11, 3, 26, 18, 10, 2, 25, 17, 9, 1, 24, 16,
        8, 0,
    );
    let k: __mmask64 = if m == 8 { u64::MAX } else { (1u64 << (8 * m)) - 1 };
    // SAFETY: the mask keeps the store to the 8m writable bytes at out.
    _mm512_mask_storeu_epi8(out as *mut i8, k, _mm512_permutexvar_epi16(idx, nib));
}

/// The first level of [`block_amax8`]'s tree: per 128-bit lane, `[a0∨a2, c0∨c2, a1∨a3,
/// c1∨c3]` of the magnitudes.
#[inline(always)]
unsafe fn amax_l1(a: __m512, c: __m512) -> __m512 {
    max_abs(_mm512_unpacklo_ps(a, c), _mm512_unpackhi_ps(a, c))
}

/// The second level: per 128-bit lane, the four blocks' maxes over the lane.
#[inline(always)]
unsafe fn amax_l2(a: __m512, c: __m512) -> __m512 {
    let (a, c) = (_mm512_castps_pd(a), _mm512_castps_pd(c));
    _mm512_max_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, c)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, c)))
}

/// The E2M1 codes of the products `q[o..o + 4]` with their signs, packed to bytes (per 128-bit
/// lane L: each vector's elements 4L .. 4L + 3) and paired into nibbles: eight words per lane.
#[inline(always)]
unsafe fn e2m1_pairs(q: &[__m512; 8], o: usize) -> __m512i {
    let w0 = _mm512_packus_epi32(e2m1_x64(q[o]), e2m1_x64(q[o + 1]));
    let w1 = _mm512_packus_epi32(e2m1_x64(q[o + 2]), e2m1_x64(q[o + 3]));
    let bias = _mm512_set1_epi16(avx2::E2M1_BIAS as i16);
    let s0 = _mm512_srli_epi16::<12>(_mm512_packs_epi32(_mm512_castps_si512(q[o]), _mm512_castps_si512(q[o + 1])));
    let s1 = _mm512_srli_epi16::<12>(_mm512_packs_epi32(_mm512_castps_si512(q[o + 2]), _mm512_castps_si512(q[o + 3])));
    let eight = _mm512_set1_epi16(8);
    // code | (sign & 8)
    let c0 = _mm512_ternarylogic_epi32::<0xF8>(_mm512_sub_epi16(_mm512_srli_epi16::<6>(w0), bias), s0, eight);
    let c1 = _mm512_ternarylogic_epi32::<0xF8>(_mm512_sub_epi16(_mm512_srli_epi16::<6>(w1), bias), s1, eight);
    _mm512_maddubs_epi16(_mm512_packus_epi16(c0, c1), _mm512_set1_epi16(0x1001))
}

/// `min(|q|, 6)` with the sign cleared, in one operation (`vrangeps`, "min absolute value, sign
/// cleared"), for finite `q`.
#[inline(always)]
unsafe fn min_abs6(q: __m512) -> __m512 {
    _mm512_range_ps::<0b1010>(q, _mm512_set1_ps(6.0))
}

/// `64·(code + E2M1_BIAS)` of sixteen finite f32: `avx2::e2m1_mag8_x64` on sixteen lanes.
#[inline(always)]
unsafe fn e2m1_x64(q: __m512) -> __m512i {
    let a = min_abs6(q);
    let ab = _mm512_castps_si512(a);
    let m = _mm512_max_epi32(
        _mm512_add_epi32(_mm512_and_si512(ab, _mm512_set1_epi32(0x7F80_0000)), _mm512_set1_epi32(22 << 23)),
        _mm512_set1_epi32(149 << 23),
    );
    let t = _mm512_castps_si512(_mm512_add_ps(a, _mm512_castsi512_ps(m)));
    _mm512_madd_epi16(t, _mm512_set1_epi32(0x0001_0040))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The quotient of [`recip_split_rd`]'s parts is the division, for the scales the exact path
    /// takes (20 significant bits, 2^-60 ..= 2^100) and every `a ≤ 448·s` tried: every bf16
    /// mantissa at every binade up to the bound, and random f32 quotients; the low part is never
    /// negative.
    #[test]
    fn rd_split_quotient_is_the_division() {
        let mut st = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            st ^= st << 13;
            st ^= st >> 7;
            st ^= st << 17;
            st
        };
        let mut scales =
            vec![1.0f32, 2f32.powi(-60), 2f32.powi(100), crate::scale::fp8_scale(1.0), crate::scale::fp8_scale(3.3e-7)];
        for _ in 0..3000 {
            let e = (next() % 160) as i32 - 60;
            let m = (next() as u32) & 0x007F_FFF0;
            scales.push(f32::from_bits((((e + 127) as u32) << 23) | m));
        }
        for &s in &scales {
            assert!(avx2::exact_ok(s), "{s:e}");
            let (p, q) = recip_split_rd(s);
            assert!(q >= 0.0 && q.is_sign_positive(), "{s:e}: {q:e}");
            let quot = |a: f32| a.mul_add(p, a * q);
            for mant in 0..128u32 {
                for binade in 0..10 {
                    let a = f32::from_bits(((127 + binade) << 23) | (mant << 16)) * s / 2f32.powi(9);
                    let a = f32::from_bits(a.to_bits() & 0xFFFF_0000); // a bf16 value
                    if a <= 448.0 * s {
                        assert_eq!(quot(a).to_bits(), (a / s).to_bits(), "a {a:e} s {s:e}");
                    }
                }
            }
            for _ in 0..64 {
                let a = f32::from_bits((next() as u32) & 0x7F7F_FFFF);
                let a = a.min(448.0 * s);
                let code = crate::formats::e4m3_from_f32;
                if a / s >= 2f32.powi(-12) {
                    assert_eq!(quot(a).to_bits(), (a / s).to_bits(), "a {a:e} s {s:e}");
                    assert_eq!(quot(-a).to_bits(), (-a / s).to_bits(), "-a {a:e} s {s:e}");
                }
                // Below 2^-12 the quotient may leave the normal range; both are code ±0 then.
                assert_eq!(code(quot(-a)), code(-a / s), "-a {a:e} s {s:e}");
            }
            assert_eq!(quot(-0.0).to_bits(), (-0.0f32).to_bits());
        }
    }

    /// `vrangeps` with "sign of the first operand" copies the first operand's sign, as
    /// [`e4m3_x16s`] and [`clamp448`] rely on.
    #[test]
    fn range_takes_the_sign_of_the_first_operand() {
        if !crate::Backend::avx512_available() {
            return;
        }
        #[target_feature(enable = "avx512f,avx512dq")]
        unsafe fn go(a: f32, b: f32) -> (f32, f32) {
            let (va, vb) = (_mm512_set1_ps(a), _mm512_set1_ps(b));
            let mut o = [0f32; 32];
            // SAFETY: o holds 32 f32.
            unsafe {
                _mm512_storeu_ps(o.as_mut_ptr(), _mm512_range_ps::<0b0011>(va, vb));
                _mm512_storeu_ps(o.as_mut_ptr().add(16), _mm512_range_ps::<0b0010>(va, vb));
            }
            (o[0], o[16])
        }
        for (a, b, mx, mn) in [
            (-3.0f32, 2.0f32, -3.0f32, -2.0f32),
            (3.0, -2.0, 3.0, 2.0),
            (-1.0, 16384.0, -16384.0, -1.0),
            (-0.0, 448.0, -448.0, -0.0),
            (500.0, 448.0, 500.0, 448.0),
            (-500.0, 448.0, -500.0, -448.0),
        ] {
            // SAFETY: AVX-512F and DQ were detected (avx512_available).
            let (x, n) = unsafe { go(a, b) };
            assert_eq!((x.to_bits(), n.to_bits()), (mx.to_bits(), mn.to_bits()), "{a} {b}");
        }
    }
}
