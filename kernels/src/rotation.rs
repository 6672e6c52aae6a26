//! The randomized Hadamard rotation of the `+had` codecs: an orthogonal transform along
//! `head_dim` applied to every row before quantization and undone after decoding, so that a few
//! outlier channels (common in keys) are spread over the whole row instead of setting its scale.
//!
//! For a row `x` of `head_dim` elements (one layer, K|V, token and head), in f32:
//!
//! - **Chunks.** `head_dim` is split into powers of two, largest first (its binary digits):
//!   128 → `[128]`, 96 → `[64, 32]`, 80 → `[64, 16]`, 100 → `[64, 32, 4]`, 7 → `[4, 2, 1]`. Each chunk of
//!   `n` channels is rotated on its own (the transform is block-diagonal), see [`rotation_chunks`].
//!   A chunk of 1 is only a sign flip.
//! - **Signs.** `s_i = ±1` for channel `i`, from the seed: `word_k` is the `k`-th output of
//!   SplitMix64 started at state `seed` (`state += 0x9E3779B97F4A7C15`, then the usual mix), and
//!   `s_i = -1` where bit `i % 64` of `word_{i / 64}` is set. See [`rotation_signs`].
//! - **Forward** (encode), per chunk: `y = H · diag(s) · x / sqrt(n)` with `H` the `n × n`
//!   Sylvester–Hadamard matrix (entries ±1), computed as `m_i = s_i · fl(1/sqrt(n))`, one product
//!   `x_i · m_i` per element, then the fast Walsh–Hadamard transform (`log2 n` stages of
//!   butterflies `(a, b) → (a + b, a - b)`, stage `h = 1, 2, 4, …`).
//! - **Inverse** (decode), per chunk: `x = diag(s) · H · y / sqrt(n)`: the same butterflies on `y`,
//!   then one product `· m_i` per element. `H · H = n · I`, so this undoes the forward transform
//!   up to f32 rounding (about 1e-7 relative).
//!
//! Every step is a single IEEE operation in a fixed order, so the AVX2 kernel (stages 1, 2 and 4
//! inside a vector, the wider ones across vectors, two stages per pass) writes exactly the scalar
//! bytes.
//!
//! **Accuracy, measured** (`tests/rotation.rs`): the rotation does spread outliers (on Gaussian
//! rows with 2 of 64 channels ×20, a row's amax / RMS falls from 6.5 to 1.9), but on that data it
//! *raises* the mean squared error of both formats: plain / rotated MSE = 0.70 for NVFP4 and 0.25
//! for FP8 per (token, head). Both are floating-point formats with fine-grained scales, so their
//! error follows the local magnitude; the rotation moves the outliers' energy into every element.
//! (For a per-row INT4 quantizer the same rotation lowers the MSE ~8×: that is where rotations
//! pay.) Measure on real KV before choosing a `+had` codec.
//!
//! **Range.** The codecs rotate rows whose `|x|` is at most [`ROTATION_MAX_INPUT`] (2^100) and
//! refuse others with [`crate::CodecError::InvalidInput`]: then every intermediate value of the
//! forward transform (at most `sqrt(n) · |x|`) and of the inverse on decoded values (at most
//! `n · |ŷ|`, `n ≤ 2^15`) stays far inside f32, and a decoded value beyond [`ROTATION_MAX_DECODED`]
//! (which the encoder cannot produce) marks a corrupt payload.
//!
//! ```
//! use kvtier_kernels::rotation::{Rotation, DEFAULT_ROTATION_SEED};
//! let rot = Rotation::new(64, DEFAULT_ROTATION_SEED);
//! let x: Vec<f32> = (0..64).map(|i| if i == 5 { 20.0 } else { (i as f32 * 0.3).sin() }).collect();
//! let mut y = x.clone();
//! rot.forward(&mut y);
//! // The outlier is spread: no rotated channel is anywhere near 20.
//! assert!(y.iter().all(|v| v.abs() < 5.0));
//! rot.inverse(&mut y);
//! assert!(x.iter().zip(&y).all(|(a, b)| (a - b).abs() < 1e-5));
//! ```

use kvtier_proto::DType;

use crate::block::{bf16_bits_rne, load_f32, store_f32, F16_MAX};
use crate::fwht::fwht;

/// The seed [`crate::Codec`] rotates with unless told otherwise
/// ([`crate::Codec::with_rotation_seed`]). Every payload records its own seed, so decoding never
/// depends on this value.
pub const DEFAULT_ROTATION_SEED: u16 = 0x4B56;

/// The largest `|x|` the rotated codecs accept (2^100, the mirror of the 2^-100 below which an
/// amax counts as zero).
pub const ROTATION_MAX_INPUT: f32 = 1.267_650_6e30;

/// The largest decoded (still rotated) `|value|` a rotated payload may hold: 2^110, above anything
/// the encoder writes for inputs up to [`ROTATION_MAX_INPUT`] (at most `sqrt(n) · 2^100 · 9/8`).
pub const ROTATION_MAX_DECODED: f32 = 1.298_074_2e33;

/// The power-of-two chunk lengths a row of `head_dim` channels is rotated in, largest first (the
/// binary digits of `head_dim`; one chunk when it is a power of two).
///
/// ```
/// assert_eq!(kvtier_kernels::rotation::rotation_chunks(128), vec![128]);
/// assert_eq!(kvtier_kernels::rotation::rotation_chunks(100), vec![64, 32, 4]);
/// ```
pub fn rotation_chunks(head_dim: usize) -> Vec<usize> {
    (0..usize::BITS).rev().map(|b| 1usize << b).filter(|&p| head_dim & p != 0).collect()
}

/// The ±1 sign of each of `head_dim` channels for `seed` (see the module doc).
pub fn rotation_signs(head_dim: usize, seed: u16) -> Vec<f32> {
    let mut state = u64::from(seed);
    let mut word = 0u64;
    (0..head_dim)
        .map(|i| {
            if i % 64 == 0 {
                word = splitmix64(&mut state);
            }
            if (word >> (i % 64)) & 1 == 1 {
                -1.0
            } else {
                1.0
            }
        })
        .collect()
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The rotation of rows of one `head_dim` for one seed, with its per-channel factors precomputed.
#[derive(Debug, Clone, PartialEq)]
pub struct Rotation {
    seed: u16,
    /// `s_i · fl(1/sqrt(n))` of channel `i`'s chunk.
    mul: Vec<f32>,
    /// Chunk lengths, largest first; they add up to `head_dim`.
    chunks: Vec<usize>,
}

impl Rotation {
    pub fn new(head_dim: usize, seed: u16) -> Self {
        let chunks = rotation_chunks(head_dim);
        let signs = rotation_signs(head_dim, seed);
        let mut mul = Vec::with_capacity(head_dim);
        for &n in &chunks {
            let c = 1.0 / (n as f32).sqrt();
            mul.extend(signs[mul.len()..mul.len() + n].iter().map(|s| s * c));
        }
        Rotation { seed, mul, chunks }
    }

    pub fn seed(&self) -> u16 {
        self.seed
    }

    pub fn head_dim(&self) -> usize {
        self.mul.len()
    }

    /// `s_i · fl(1/sqrt(n))` of every channel (what the kernels multiply by).
    pub(crate) fn mul(&self) -> &[f32] {
        &self.mul
    }

    /// The chunk lengths, largest first.
    pub(crate) fn chunks(&self) -> &[usize] {
        &self.chunks
    }

    /// `y = H · diag(s) · x / sqrt(n)` per chunk, in place.
    ///
    /// # Panics
    /// If `x.len()` is not `head_dim` (a caller's bug, as with `copy_from_slice`: the codecs
    /// size every row from a validated spec).
    pub fn forward(&self, x: &mut [f32]) {
        assert_eq!(x.len(), self.head_dim(), "row length");
        x.iter_mut().zip(&self.mul).for_each(|(v, m)| *v *= m);
        self.butterflies(x);
    }

    /// `x = diag(s) · H · y / sqrt(n)` per chunk, in place: the inverse of [`Rotation::forward`].
    ///
    /// # Panics
    /// If `y.len()` is not `head_dim`, as [`Rotation::forward`].
    pub fn inverse(&self, y: &mut [f32]) {
        assert_eq!(y.len(), self.head_dim(), "row length");
        self.butterflies(y);
        y.iter_mut().zip(&self.mul).for_each(|(v, m)| *v *= m);
    }

    fn butterflies(&self, x: &mut [f32]) {
        let mut rest = x;
        for &n in &self.chunks {
            let (chunk, tail) = rest.split_at_mut(n);
            fwht(chunk);
            rest = tail;
        }
    }

    /// Loads whole rows of `dtype` from `src`, rotates them and writes them to `out` as
    /// little-endian f32 (4 bytes per element): the scalar reference of the row kernels'
    /// `rotate_rows` (`crate::kernel`), which write the same bytes.
    pub(crate) fn forward_rows_ref(&self, dtype: DType, src: &[u8], out: &mut [u8]) {
        let hd = self.head_dim();
        let es = dtype.size() as usize;
        let mut row = vec![0f32; hd];
        for (s, o) in src.chunks_exact(hd * es).zip(out.chunks_exact_mut(hd * 4)) {
            match dtype {
                DType::Bf16 => {
                    for ((v, b), m) in row.iter_mut().zip(s.chunks_exact(2)).zip(&self.mul) {
                        *v = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16) * m;
                    }
                }
                DType::Fp32 => {
                    for ((v, b), m) in row.iter_mut().zip(s.chunks_exact(4)).zip(&self.mul) {
                        *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * m;
                    }
                }
                _ => {
                    for (i, (v, m)) in row.iter_mut().zip(&self.mul).enumerate() {
                        *v = load_f32(dtype, s, i) * m;
                    }
                }
            }
            self.butterflies(&mut row);
            for (d, v) in o.chunks_exact_mut(4).zip(&row) {
                d.copy_from_slice(&v.to_le_bytes());
            }
        }
    }

    /// Inverse-rotates whole rows of little-endian f32 in `src` and stores them as `dtype` in
    /// `dst` (round to nearest even; FP16 saturates to ±65504, like the plain decoders): the
    /// scalar reference of the row kernels' `unrotate_rows` (`crate::kernel`).
    pub(crate) fn inverse_rows_ref(&self, src: &[u8], dtype: DType, dst: &mut [u8]) {
        let hd = self.head_dim();
        let es = dtype.size() as usize;
        let mut row = vec![0f32; hd];
        for (s, o) in src.chunks_exact(hd * 4).zip(dst.chunks_exact_mut(hd * es)) {
            for (v, b) in row.iter_mut().zip(s.chunks_exact(4)) {
                *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
            self.butterflies(&mut row);
            match dtype {
                DType::Bf16 => {
                    for ((d, v), m) in o.chunks_exact_mut(2).zip(&row).zip(&self.mul) {
                        d.copy_from_slice(&bf16_bits_rne(v * m).to_le_bytes());
                    }
                }
                DType::Fp32 => {
                    for ((d, v), m) in o.chunks_exact_mut(4).zip(&row).zip(&self.mul) {
                        d.copy_from_slice(&(v * m).to_le_bytes());
                    }
                }
                DType::Fp16 => {
                    for ((d, v), m) in o.chunks_exact_mut(2).zip(&row).zip(&self.mul) {
                        let h = half::f16::from_f32((v * m).clamp(-F16_MAX, F16_MAX));
                        d.copy_from_slice(&h.to_bits().to_le_bytes());
                    }
                }
                DType::Fp8E4m3 => {
                    for (i, (v, m)) in row.iter().zip(&self.mul).enumerate() {
                        store_f32(dtype, o, i, v * m);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Sylvester–Hadamard matrix entry `H[i][j] = (-1)^popcount(i & j)`.
    fn h(i: usize, j: usize) -> f64 {
        if (i & j).count_ones() & 1 == 0 {
            1.0
        } else {
            -1.0
        }
    }

    fn pseudo_random(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n).map(|_| (splitmix64(&mut s) >> 40) as f32 / (1u64 << 23) as f32 - 1.0).collect()
    }

    #[test]
    fn limits_are_powers_of_two() {
        assert_eq!(ROTATION_MAX_INPUT, 2f32.powi(100));
        assert_eq!(ROTATION_MAX_DECODED, 2f32.powi(110));
    }

    #[test]
    fn chunks_are_the_binary_digits() {
        assert_eq!(rotation_chunks(1), vec![1]);
        assert_eq!(rotation_chunks(7), vec![4, 2, 1]);
        assert_eq!(rotation_chunks(96), vec![64, 32]);
        assert_eq!(rotation_chunks(256), vec![256]);
        for d in 1..600 {
            assert_eq!(rotation_chunks(d).iter().sum::<usize>(), d);
        }
    }

    #[test]
    fn signs_are_fixed_by_the_seed() {
        let a = rotation_signs(200, 1);
        assert_eq!(a, rotation_signs(200, 1));
        assert_ne!(a, rotation_signs(200, 2));
        assert_eq!(&a[..64], &rotation_signs(64, 1)[..]);
        let neg = a.iter().filter(|s| **s < 0.0).count();
        assert!((70..130).contains(&neg), "{neg} negative signs of 200");
        // Pinned: the signs are part of the payload format (seed → signs must never change).
        let first: String =
            rotation_signs(16, DEFAULT_ROTATION_SEED).iter().map(|s| if *s < 0.0 { '-' } else { '+' }).collect();
        assert_eq!(first, PINNED_SIGNS);
    }

    const PINNED_SIGNS: &str = "+-++---+--+++---"; // checked against an independent SplitMix64

    /// Rotating then unrotating returns x within 1e-6 relative (of the row's norm), for power-of-two
    /// and composite head dims; the rotation keeps the norm.
    #[test]
    fn rotation_is_orthogonal() {
        for hd in [1usize, 2, 3, 16, 64, 80, 96, 100, 128, 256, 576] {
            for seed in [0u16, 7, DEFAULT_ROTATION_SEED] {
                let rot = Rotation::new(hd, seed);
                let x = pseudo_random(hd, hd as u64 * 31 + u64::from(seed));
                let mut y = x.clone();
                rot.forward(&mut y);
                let norm = |v: &[f32]| v.iter().map(|a| f64::from(*a).powi(2)).sum::<f64>().sqrt();
                assert!((norm(&y) / norm(&x) - 1.0).abs() < 1e-6, "hd {hd} norm");
                rot.inverse(&mut y);
                let err = x.iter().zip(&y).map(|(a, b)| f64::from(a - b).powi(2)).sum::<f64>().sqrt();
                assert!(err <= 1e-6 * norm(&x), "hd {hd} seed {seed}: {err}");
                // Against the matrix, chunk by chunk.
                let mut z = x.clone();
                rot.forward(&mut z);
                let signs = rotation_signs(hd, seed);
                let mut off = 0;
                for n in rotation_chunks(hd) {
                    for i in 0..n {
                        let want: f64 =
                            (0..n).map(|j| h(i, j) * f64::from(signs[off + j]) * f64::from(x[off + j])).sum::<f64>()
                                / (n as f64).sqrt();
                        assert!((f64::from(z[off + i]) - want).abs() < 1e-5, "hd {hd} chunk {n} i {i}");
                    }
                    off += n;
                }
            }
        }
    }
}
