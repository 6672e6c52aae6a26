//! The two narrow number formats, one value at a time: OCP FP8 E4M3 (`e4m3fn`) and FP4 E2M1,
//! plus the scale rules built on them. This is the scalar reference every faster path (AVX2 here,
//! CUDA later) must match bit for bit; the golden tests check it against `ml_dtypes`.
//!
//! - **E4M3** (`e4m3fn`): 1 sign, 4 exponent (bias 7), 3 mantissa bits. Largest finite ±448,
//!   smallest subnormal 2^-9, no infinities, NaN = `0x7F`/`0xFF`. [`e4m3_from_f32`] rounds to
//!   nearest even and **saturates** to ±448 (so it equals `ml_dtypes` applied to
//!   `clip(x, -448, 448)`).
//! - **E2M1**: 1 sign, 2 exponent (bias 1), 1 mantissa bit: ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}, no
//!   NaN. [`e2m1_from_f32`] rounds to nearest even and saturates to ±6 (0.25 → 0, 2.5 → 2, 5 → 4).
//! - **Scales**: [`canonical_scale`] rounds a scale up to a few significant bits so that
//!   decoding and re-encoding reproduce the same scale exactly (see its doc).

/// Largest finite E4M3 magnitude.
pub const E4M3_MAX: f32 = 448.0;
/// Largest E2M1 magnitude.
pub const E2M1_MAX: f32 = 6.0;
/// Smallest normal E4M3 magnitude, 2^-6.
const E4M3_MIN_NORMAL: f32 = 0.015625;

/// Magnitudes of the eight non-negative E2M1 codes, in code order.
pub const E2M1_VALUES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// FP32 → E4M3 code: round to nearest even, saturate to ±448 (±Inf saturates too); NaN → `0x7F`
/// with the input's sign bit.
///
/// ```
/// use kvtier_kernels::formats::{e4m3_from_f32, e4m3_to_f32};
/// assert_eq!(e4m3_to_f32(e4m3_from_f32(1000.0)), 448.0);
/// assert_eq!(e4m3_from_f32(-0.0), 0x80);
/// assert_eq!(e4m3_to_f32(e4m3_from_f32(1.0625)), 1.0); // a tie goes to the even mantissa
/// ```
#[inline]
pub fn e4m3_from_f32(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let a = f32::from_bits(bits & 0x7FFF_FFFF);
    if a.is_nan() {
        return sign | 0x7F;
    }
    if a >= E4M3_MAX {
        return sign | 0x7E;
    }
    if a < E4M3_MIN_NORMAL {
        // Subnormal: a value of q * 2^-9. Scaling by 2^9 is exact, so one rounding happens.
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    // Normal: drop 20 of f32's 23 mantissa bits with round-to-nearest-even, then rebias the
    // exponent from 127 to 7. A carry out of the mantissa bumps the exponent, as it should; it
    // cannot pass 448 because everything at or above 448 was saturated above and 448 is itself a
    // code, so rounding never goes past it.
    let abits = a.to_bits();
    let rounded = (abits + 0x7FFFF + ((abits >> 20) & 1)) >> 20;
    sign | (rounded - ((127 - 7) << 3)) as u8
}

/// E4M3 code → FP32 (exact). `0x7F`/`0xFF` decode to NaN.
#[inline]
pub fn e4m3_to_f32(code: u8) -> f32 {
    E4M3_TABLE[code as usize]
}

/// All 256 E4M3 values, built at compile time.
pub static E4M3_TABLE: [f32; 256] = build_e4m3_table();

const fn build_e4m3_table() -> [f32; 256] {
    let mut t = [0f32; 256];
    let mut c = 0usize;
    while c < 256 {
        let e = ((c >> 3) & 0xF) as u32;
        let m = (c & 7) as u32;
        let mag = if e == 0xF && m == 7 {
            f32::NAN
        } else if e == 0 {
            // m * 2^-9, built from bits: exact for m in 0..8.
            let mut v = 0f32;
            let mut i = 0;
            while i < m {
                v += 0.001953125;
                i += 1;
            }
            v
        } else {
            f32::from_bits(((e + 120) << 23) | (m << 20))
        };
        t[c] = if c & 0x80 != 0 { -mag } else { mag };
        c += 1;
    }
    t
}

/// FP32 → E2M1 code (4 bits, sign in bit 3): round to nearest even, saturate to ±6 (±Inf
/// saturates too). NaN is not a valid input (the codecs reject it earlier); it maps to ±0.
///
/// ```
/// use kvtier_kernels::formats::{e2m1_from_f32, e2m1_to_f32};
/// assert_eq!(e2m1_to_f32(e2m1_from_f32(0.25)), 0.0);
/// assert_eq!(e2m1_to_f32(e2m1_from_f32(2.5)), 2.0);
/// assert_eq!(e2m1_to_f32(e2m1_from_f32(5.0)), 4.0);
/// assert_eq!(e2m1_to_f32(e2m1_from_f32(-100.0)), -6.0);
/// ```
#[inline]
pub fn e2m1_from_f32(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 28) & 0x8) as u8;
    let a = f32::from_bits(bits & 0x7FFF_FFFF);
    // Each threshold is a midpoint between two neighbours; `>` where the lower neighbour has the
    // even code (ties stay down), `>=` where the upper one has (ties go up).
    let code = (a > 0.25) as u8
        + (a >= 0.75) as u8
        + (a > 1.25) as u8
        + (a >= 1.75) as u8
        + (a > 2.5) as u8
        + (a >= 3.5) as u8
        + (a > 5.0) as u8;
    sign | code
}

/// E2M1 code (low 4 bits) → FP32 (exact).
#[inline]
pub fn e2m1_to_f32(code: u8) -> f32 {
    let mag = E2M1_VALUES[(code & 7) as usize];
    if code & 8 != 0 {
        -mag
    } else {
        mag
    }
}

/// Rounds a non-negative finite scale **up** to `sig_bits` significant bits.
///
/// Why: a decoded value is `code × scale`. When the scale has few enough significant bits, that
/// product is exact in FP32, and so is `max_code × scale` — the amax the encoder will see when it
/// re-encodes decoded data — so re-encoding recomputes exactly the same scale and the same codes
/// (a property test checks it). Rounding up, not to nearest, keeps `amax / scale ≤ max_code`.
/// The cost is a relative change below 2^-(sig_bits-1), far below the codes' own precision.
/// Zero stays zero; the rounding commutes with multiplying by a power of two.
#[inline]
pub fn canonical_scale(scale: f32, sig_bits: u32) -> f32 {
    debug_assert!((1..=24).contains(&sig_bits));
    let drop = 24 - sig_bits;
    let mask = (1u32 << drop) - 1;
    let bits = scale.to_bits();
    if bits & mask == 0 || !scale.is_finite() {
        return scale;
    }
    // Clearing the low bits and adding one unit carries into the exponent when the mantissa
    // overflows, which is the right answer; f32::MAX / 448 is far from overflowing.
    f32::from_bits((bits | mask) + 1)
}

/// Significant bits of an FP8 per-(token, head) or per-tensor computed scale: 3 bits of the code,
/// 20 of the scale, ≤ 24 in their product.
pub const FP8_SCALE_BITS: u32 = 20;
/// Significant bits of an NVFP4 global scale: 2 bits of the E2M1 code, 4 of the E4M3 block scale,
/// 18 of the global scale.
pub const NVFP4_GLOBAL_BITS: u32 = 18;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_table_round_trips() {
        for c in 0..=255u8 {
            let v = e4m3_to_f32(c);
            if c & 0x7F == 0x7F {
                assert!(v.is_nan());
                assert_eq!(e4m3_from_f32(v) & 0x7F, 0x7F);
            } else {
                assert_eq!(e4m3_from_f32(v), c, "code {c:#x} value {v}");
            }
        }
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
    }

    #[test]
    fn e4m3_rounding_and_saturation() {
        assert_eq!(e4m3_from_f32(f32::INFINITY), 0x7E);
        assert_eq!(e4m3_from_f32(f32::NEG_INFINITY), 0xFE);
        assert_eq!(e4m3_from_f32(464.01), 0x7E);
        assert_eq!(e4m3_from_f32(2f32.powi(-10)), 0); // tie between 0 and 2^-9 → 0
        assert_eq!(e4m3_from_f32(3.0 * 2f32.powi(-10)), 2); // tie between 1 and 2 → 2
        assert_eq!(e4m3_to_f32(e4m3_from_f32(1.1875)), 1.25); // tie between 1.125 and 1.25 → 1.25
    }

    #[test]
    fn e2m1_codes() {
        for c in 0..16u8 {
            assert_eq!(e2m1_from_f32(e2m1_to_f32(c)), c);
        }
        assert_eq!(e2m1_from_f32(0.75), 2);
        assert_eq!(e2m1_from_f32(1.75), 4);
        assert_eq!(e2m1_from_f32(3.5), 6);
        assert_eq!(e2m1_from_f32(-0.1), 8);
    }

    #[test]
    fn canonical_scale_rounds_up() {
        assert_eq!(canonical_scale(1.0, 20), 1.0);
        assert_eq!(canonical_scale(0.0, 20), 0.0);
        let s = f32::from_bits(0x3F80_0001);
        let c = canonical_scale(s, 20);
        assert!(c > s && c.to_bits() & 0xF == 0);
        assert_eq!(canonical_scale(f32::from_bits(0x3FFF_FFFF), 20), 2.0);
    }
}
