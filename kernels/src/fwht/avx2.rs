//! The fast Walsh–Hadamard transform on AVX2 + FMA vectors (eight f32 lanes), bit-exact with the
//! scalar [`super::fwht`]: the building blocks of the rotation kernels in `crate::kernel::avx2`.
//!
//! Safety, once for the whole file: every function here is `#[target_feature(enable =
//! "avx2,f16c,fma")]` (or `inline(always)` and only called from such functions) and is only
//! reached from the kernels of `crate::kernel::avx2`, themselves only called after
//! `is_x86_feature_detected!` returned true for "avx2", "f16c" and "fma". Every unaligned load or
//! store touches elements `j..j + 8` of `buf` with `j + 8` at most the end of the chunk being
//! transformed, as noted at each access.

use std::arch::x86_64::*;

/// Stages `h = 1, 2, 4` of the fast Walsh–Hadamard transform ([`super::fwht`]) on eight
/// lanes, in the reference's order: for each stage, lane `j` with `j & h == 0` takes
/// `x[j] + x[j + h]` and lane `j + h` takes `x[j] - x[j + h]`. Each is one FMA
/// `x · (±1) + swapped`: the product is exact (a sign), so the single rounding is that of the
/// reference's `p + q` (lane `j`: `x[j] · 1 + x[j + h]`) or `p - q` (lane `j + h`:
/// `x[j + h] · (-1) + x[j]`), signed zeros included.
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
pub(crate) unsafe fn fwht8(x: __m256) -> __m256 {
    // h = 1: lanes [1, 0, 3, 2, …]; odd lanes take the difference.
    let s = _mm256_permute_ps::<0b10_11_00_01>(x);
    let x = _mm256_fmadd_ps(x, _mm256_setr_ps(1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0), s);
    // h = 2: lanes [2, 3, 0, 1, …]; lanes 2, 3, 6, 7 take the difference.
    let s = _mm256_permute_ps::<0b01_00_11_10>(x);
    let x = _mm256_fmadd_ps(x, _mm256_setr_ps(1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0), s);
    // h = 4: the two halves swapped; the upper half takes the difference.
    let s = _mm256_permute2f128_ps::<1>(x, x);
    _mm256_fmadd_ps(x, _mm256_setr_ps(1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0), s)
}

/// The butterfly stages of [`super::fwht`] that [`fwht8`] does not do, on a row already
/// through [`fwht8`] in its first `hd & !7` elements: stages `h ≥ 8` of every chunk of 16 or
/// more, two stages at a time where it can (four vectors `a, b, c, d` at `j, j + h, j + 2h,
/// j + 3h`: `(a + b) ± (c + d)`, `(a - b) ± (c - d)`, the same operations in the same order as two
/// separate stages), and every stage of the chunks shorter than 8 (scalar).
#[inline]
#[target_feature(enable = "avx2,f16c,fma")]
pub(crate) unsafe fn wht_rest(buf: &mut [f32], chunks: &[usize]) {
    let p = buf.as_mut_ptr();
    let mut off = 0;
    for &n in chunks {
        if n < 8 {
            super::fwht(&mut buf[off..off + n]);
            off += n;
            continue;
        }
        debug_assert!(off + n <= buf.len() && off % 8 == 0);
        let mut h = 8;
        while h < n {
            let mut b = off;
            if 2 * h < n {
                // Stages h and 2h together.
                while b < off + n {
                    let mut j = b;
                    while j < b + h {
                        // SAFETY: j + 3h + 8 ≤ b + 4h ≤ off + n ≤ buf.len() (b steps by 4h inside the chunk).
                        let (a, bb) = (_mm256_loadu_ps(p.add(j)), _mm256_loadu_ps(p.add(j + h)));
                        let (c, d) = (_mm256_loadu_ps(p.add(j + 2 * h)), _mm256_loadu_ps(p.add(j + 3 * h)));
                        let (s0, s1) = (_mm256_add_ps(a, bb), _mm256_sub_ps(a, bb));
                        let (s2, s3) = (_mm256_add_ps(c, d), _mm256_sub_ps(c, d));
                        _mm256_storeu_ps(p.add(j), _mm256_add_ps(s0, s2));
                        _mm256_storeu_ps(p.add(j + h), _mm256_add_ps(s1, s3));
                        _mm256_storeu_ps(p.add(j + 2 * h), _mm256_sub_ps(s0, s2));
                        _mm256_storeu_ps(p.add(j + 3 * h), _mm256_sub_ps(s1, s3));
                        j += 8;
                    }
                    b += 4 * h;
                }
                h *= 4;
            } else {
                while b < off + n {
                    let mut j = b;
                    while j < b + h {
                        // SAFETY: j + h + 8 ≤ b + 2h ≤ off + n ≤ buf.len().
                        let (a, bb) = (_mm256_loadu_ps(p.add(j)), _mm256_loadu_ps(p.add(j + h)));
                        _mm256_storeu_ps(p.add(j), _mm256_add_ps(a, bb));
                        _mm256_storeu_ps(p.add(j + h), _mm256_sub_ps(a, bb));
                        j += 8;
                    }
                    b += 2 * h;
                }
                h *= 2;
            }
        }
        off += n;
    }
}

/// The transform of [`super::fwht`] on one chunk of `8·N` elements held in `N` vectors
/// (element `8k + l` in lane `l` of `v[k]`), without touching memory: stages 1, 2 and 4 inside
/// each vector ([`fwht8`]), then stage `8h` for `h = 1, 2, …, N/2` between `v[j]` and `v[j + h]`
/// (`j & h == 0`) as `(a + b, a − b)`: the reference's operations on the same values, stage by
/// stage in the same order, so the same bytes. `N` is a constant, so the loops unroll and the
/// chunk stays in registers (sixteen of them for 128 elements).
///
/// This one, [`fwd_chunk`] and [`inv_chunk`] carry no `target_feature` (which cannot be combined
/// with `inline(always)`) so that they are always inlined: called only from functions of this
/// file that enable the features, their intrinsics are then compiled with them, and the chunk's
/// vectors never go through memory.
#[inline(always)]
pub(crate) unsafe fn wht_regs<const N: usize>(v: &mut [__m256; N]) {
    for x in v.iter_mut() {
        *x = fwht8(*x);
    }
    let mut h = 1;
    while h < N {
        let mut j = 0;
        while j < N {
            for t in j..j + h {
                let (a, b) = (v[t], v[t + h]);
                v[t] = _mm256_add_ps(a, b);
                v[t + h] = _mm256_sub_ps(a, b);
            }
            j += 2 * h;
        }
        h *= 2;
    }
}

/// The last stages of [`super::fwht`] on a chunk of `64·S` elements (`S` = 2 or 4; 1: nothing
/// to do) held as `S` sub-chunks of 64, each already through [`wht_regs`]`::<8>` (stages 1–32),
/// or any `M` of their vectors (the same `M` of each sub-chunk): stage
/// 64 between sub-chunks `(0, 1)` and `(2, 3)`, then stage 128 between `(0, 2)` and `(1, 3)`, as
/// `(a + b, a − b)`; the reference's operations on the same values, so the same bytes (each
/// value of a stage depends only on the stage before, whatever order they are computed in).
/// Splitting a chunk of 128 or 256 so keeps eight vectors live while its first five stages run
/// (AVX2 has sixteen registers; [`wht_regs`]`::<16>` spills at every stage).
#[inline(always)]
#[allow(clippy::needless_range_loop)] // k picks the same vector of every sub-chunk at once
pub(crate) unsafe fn wht_cross<const M: usize, const S: usize>(t: &mut [[__m256; M]; S]) {
    debug_assert!(S <= 4 && S.is_power_of_two());
    for k in 0..M {
        if S == 1 {
            break;
        } else if S == 2 {
            let (a, b) = (t[0][k], t[1][k]);
            t[0][k] = _mm256_add_ps(a, b);
            t[1][k] = _mm256_sub_ps(a, b);
        } else {
            let (a, b, c, d) = (t[0][k], t[1][k], t[2][k], t[3][k]);
            let (s0, s1) = (_mm256_add_ps(a, b), _mm256_sub_ps(a, b));
            let (s2, s3) = (_mm256_add_ps(c, d), _mm256_sub_ps(c, d));
            t[0][k] = _mm256_add_ps(s0, s2);
            t[1][k] = _mm256_add_ps(s1, s3);
            t[2][k] = _mm256_sub_ps(s0, s2);
            t[3][k] = _mm256_sub_ps(s1, s3);
        }
    }
}
