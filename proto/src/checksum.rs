//! The payload checksum every frame carries: xxh3-64, seed 0.
//!
//! Computed with `twox-hash`, which picks its AVX2 loop at run time. `xxhash-rust` compiles its
//! SIMD loop in only when the whole build targets AVX2, so the portable release build ran its
//! SSE2 loop: 4–5 GB/s on the 2-core Xeon VM against 10–25 GB/s here, and the server spent a
//! third of its CPU on 1 MiB loads in it (perf, 1 MiB blocks, 4 clients). The bits are the same:
//! the tests below check them against `xxhash-rust`, one-shot and streamed.

use std::hash::Hasher;

/// The xxh3-64 of `data`: a frame's payload checksum.
pub fn checksum(data: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(data)
}

/// The xxh3-64 of pieces fed in order (a payload gathered from several segments, or hashed
/// chunk by chunk as it is copied); the same value as [`checksum`] of their concatenation.
pub struct Checksummer(twox_hash::XxHash3_64);

impl Default for Checksummer {
    fn default() -> Self {
        Checksummer(twox_hash::XxHash3_64::with_seed(0))
    }
}

impl Checksummer {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn update(&mut self, data: &[u8]) {
        self.0.write(data);
    }

    pub fn digest(&self) -> u64 {
        self.0.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_bits_as_xxhash_rust_one_shot_and_streamed() {
        let data: Vec<u8> = (0..2_100_000usize).map(|i| (i * 7 + i / 251) as u8).collect();
        let lens = (0..1100).chain([4095, 4096, 65_536, 65_537, 1 << 20, 2_100_000]);
        for len in lens {
            let want = xxhash_rust::xxh3::xxh3_64(&data[..len]);
            assert_eq!(checksum(&data[..len]), want, "one-shot, {len} bytes");
            for piece in [1usize, 63, 64, 777, 65_536] {
                if len > 70_000 && piece < 777 {
                    continue;
                }
                let mut h = Checksummer::new();
                for c in data[..len].chunks(piece) {
                    h.update(c);
                }
                assert_eq!(h.digest(), want, "streamed in pieces of {piece}, {len} bytes");
            }
        }
    }
}
