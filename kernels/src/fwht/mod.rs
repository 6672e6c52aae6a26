//! The unnormalized fast Walsh–Hadamard transform, the butterfly core of the `+had` rotation:
//! the scalar reference [`fwht`] and its bit-exact vector forms ([`avx2`], [`avx512`]), which
//! depend on nothing else in the crate.
//!
//! Every form does the same IEEE operations on the same values in the same order (stage
//! `h = 1, 2, 4, …`), so all of them write the same bytes.

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;

/// The unnormalized fast Walsh–Hadamard transform of a power-of-two slice, in place: stages
/// `h = 1, 2, 4, …, n/2`, each replacing every pair `(x[j], x[j + h])` (with `j & h == 0`) by
/// `(x[j] + x[j + h], x[j] - x[j + h])`.
pub(crate) fn fwht(x: &mut [f32]) {
    let n = x.len();
    debug_assert!(n.is_power_of_two());
    let mut h = 1;
    while h < n {
        for pair in x.chunks_exact_mut(2 * h) {
            let (a, b) = pair.split_at_mut(h);
            for (u, v) in a.iter_mut().zip(b.iter_mut()) {
                let (p, q) = (*u, *v);
                *u = p + q;
                *v = p - q;
            }
        }
        h *= 2;
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

    #[test]
    fn fwht_is_the_hadamard_matrix() {
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        for n in [1usize, 2, 4, 8, 16, 64] {
            let x: Vec<f32> = (0..n)
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
                })
                .collect();
            let mut y = x.clone();
            fwht(&mut y);
            for (i, yi) in y.iter().enumerate() {
                let want: f64 = (0..n).map(|j| h(i, j) * f64::from(x[j])).sum();
                assert!((f64::from(*yi) - want).abs() < 1e-5, "n {n} i {i}");
            }
        }
    }
}
