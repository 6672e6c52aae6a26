//! The fast Walsh–Hadamard transform on AVX-512 vectors (sixteen f32 lanes), bit-exact with the
//! scalar [`super::fwht`]: the building blocks of the rotation kernels in `crate::kernel::avx512`.
//!
//! Safety, once for the whole file: [`fwht16`] is `#[target_feature(enable = "avx512f")]` and
//! [`wht_regs16`] is `inline(always)` and only called from functions enabling AVX-512F; both are
//! only reached from the kernels of `crate::kernel::avx512`, themselves only called after
//! `is_x86_feature_detected!` returned true for "avx512f" (and the others that module names).
//! Neither touches memory.

use std::arch::x86_64::*;

/// Stages `h = 1, 2, 4, 8` of [`super::fwht`] on sixteen lanes, in the reference's order: for
/// each stage, lane `j` with `j & h == 0` takes `x[j] + x[j + h]` and lane `j + h` takes
/// `x[j] - x[j + h]`. Each is one FMA `x · (±1) + swapped`: the product is exact (a sign), so the
/// single rounding is that of the reference's `p + q` or `p - q`, signed zeros included (the same
/// argument as `super::avx2::fwht8`).
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn fwht16(x: __m512) -> __m512 {
    let (p, m) = (1.0f32, -1.0f32);
    // h = 1: lanes [1, 0, 3, 2, …]; odd lanes take the difference.
    let s = _mm512_permute_ps::<0b10_11_00_01>(x);
    let x = _mm512_fmadd_ps(x, _mm512_setr_ps(p, m, p, m, p, m, p, m, p, m, p, m, p, m, p, m), s);
    // h = 2: lanes [2, 3, 0, 1, …]; lanes 2, 3 of every four take the difference.
    let s = _mm512_permute_ps::<0b01_00_11_10>(x);
    let x = _mm512_fmadd_ps(x, _mm512_setr_ps(p, p, m, m, p, p, m, m, p, p, m, m, p, p, m, m), s);
    // h = 4: 128-bit quarters [1, 0, 3, 2]; the upper four of every eight take the difference.
    let s = _mm512_shuffle_f32x4::<0b10_11_00_01>(x, x);
    let x = _mm512_fmadd_ps(x, _mm512_setr_ps(p, p, p, p, m, m, m, m, p, p, p, p, m, m, m, m), s);
    // h = 8: the two 256-bit halves swapped; the upper half takes the difference.
    let s = _mm512_shuffle_f32x4::<0b01_00_11_10>(x, x);
    _mm512_fmadd_ps(x, _mm512_setr_ps(p, p, p, p, p, p, p, p, m, m, m, m, m, m, m, m), s)
}

/// [`super::fwht`] on one chunk of `16·N` elements held in `N` vectors (element `16k + l` in lane
/// `l` of `v[k]`), without touching memory: stages 1–8 inside each vector ([`fwht16`]), then stage
/// `16h` for `h = 1, 2, …, N/2` between `v[j]` and `v[j + h]` (`j & h == 0`) as `(a + b, a − b)`:
/// the reference's operations on the same values, stage by stage in the same order. `N` is a
/// constant, so the loops unroll and the chunk stays in registers (eight of them for 128
/// elements). No `target_feature` (it cannot be combined with `inline(always)`): callers enable
/// AVX-512F, and the intrinsics are compiled with it once inlined.
///
/// # Safety
///
/// The CPU must support AVX-512F (callers are `#[target_feature(enable = "avx512f")]` functions
/// reached only after it was detected).
#[inline(always)]
pub(crate) unsafe fn wht_regs16<const N: usize>(v: &mut [__m512; N]) {
    for x in v.iter_mut() {
        // SAFETY: AVX-512F is available (this function's contract).
        *x = unsafe { fwht16(*x) };
    }
    let mut h = 1;
    while h < N {
        let mut j = 0;
        while j < N {
            for t in j..j + h {
                let (a, b) = (v[t], v[t + h]);
                // SAFETY: as above.
                unsafe {
                    v[t] = _mm512_add_ps(a, b);
                    v[t + h] = _mm512_sub_ps(a, b);
                }
            }
            j += 2 * h;
        }
        h *= 2;
    }
}
