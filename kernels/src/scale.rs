//! Scale math shared by the codecs and every row kernel (scalar, AVX2, AVX-512, CUDA later): an
//! amax to its FP8 scale, an NVFP4 plane's global scale and encode factor, and an NVFP4
//! micro-block's E4M3 scale code. The exact rules are written in [`crate::codec`]'s module doc;
//! this module depends only on [`crate::formats`].

use crate::formats::{
    canonical_scale, e4m3_from_f32, e4m3_to_f32, E2M1_MAX, E4M3_MAX, FP8_SCALE_BITS, NVFP4_GLOBAL_BITS,
};

/// An amax below this is treated as 0 (the scale arithmetic would leave the f32 normal range).
pub(crate) const FLUSH_AMAX: f32 = 7.888_609e-31; // 2^-100

/// The FP8 scale of an amax (per row or per tensor): `canonical(fl(amax / 448), 20 bits)`, or 0
/// below [`FLUSH_AMAX`].
#[inline]
pub(crate) fn fp8_scale(amax: f32) -> f32 {
    if amax < FLUSH_AMAX {
        0.0
    } else {
        canonical_scale(amax / E4M3_MAX, FP8_SCALE_BITS)
    }
}

/// An NVFP4 plane's global decode scale `g = canonical(fl(amax / 2688), 18 bits)` and encode
/// factor `enc = fl(2688 / amax)`; both 0 below [`FLUSH_AMAX`].
#[inline]
pub(crate) fn nvfp4_plane_scales(amax: f32) -> (f32, f32) {
    if amax < FLUSH_AMAX {
        (0.0, 0.0)
    } else {
        (canonical_scale(amax / (E4M3_MAX * E2M1_MAX), NVFP4_GLOBAL_BITS), (E4M3_MAX * E2M1_MAX) / amax)
    }
}

/// The NVFP4 block scale code, decoded block scale and reciprocal for a micro-block of amax
/// `amax_b`, given the plane's global decode scale `g` and encode factor `enc = 448·6 / amax`.
#[inline]
pub(crate) fn nvfp4_block_scale(amax_b: f32, g: f32, enc: f32) -> (u8, f32, f32) {
    let bs = e4m3_from_f32((amax_b / 6.0) * enc);
    let d = e4m3_to_f32(bs) * g;
    let inv = if d == 0.0 { 0.0 } else { 1.0 / d };
    (bs, d, inv)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flushed_amaxes_give_zero_scales() {
        assert_eq!(FLUSH_AMAX, 2f32.powi(-100));
        assert_eq!(fp8_scale(FLUSH_AMAX / 2.0), 0.0);
        assert_eq!(nvfp4_plane_scales(0.0), (0.0, 0.0));
        assert_eq!(fp8_scale(448.0), 1.0);
        assert_eq!(nvfp4_block_scale(6.0, 1.0, 448.0).0, e4m3_from_f32(448.0));
    }
}
