//! kvtier codecs: quantization (FP8 E4M3, NVFP4) and a lossless LZ4 layer that shrink KV blocks
//! on their way into a tier, and the policy that picks a codec per namespace and tier.
//!
//! - [`formats`]: E4M3 and E2M1 one value at a time — the scalar reference, bit-exact against
//!   `ml_dtypes` (see `tests/golden.rs`).
//! - [`block`]: [`BlockSpec`] and [`KvBlockView`], the K and V planes `[tokens, kv_heads,
//!   head_dim]` of every layer of a block, in bf16, fp16 or fp32, in either memory order.
//! - [`codec`]: [`Codec`], [`encode`] and [`decode`] for the ids named in
//!   [`kvtier_proto::CodecId`]: raw, raw+LZ4, FP8 E4M3, FP8+LZ4, NVFP4, NVFP4+LZ4, and the rotated
//!   `+had` forms of the four quantizing ones. The exact scale arithmetic is written at the top of
//!   that module.
//! - [`rotation`]: the randomized Hadamard rotation along `head_dim` of the `+had` codecs, which
//!   spreads outlier channels before quantization and is undone after decoding.
//! - [`payload`]: the self-describing payload (format, shape, dtype, scales) of every codec but raw.
//! - [`Backend`]: the scalar reference, AVX2+F16C kernels, or AVX-512 ones for the rotated codecs
//!   (chosen at run time, identical bytes).
//! - [`copy`]: bulk copies into another process's shared memory with streaming stores (the
//!   same-node path's loads), and the fence that publishes them.
//! - [`policy`]: [`policy::CodecPolicy`] — which codec per tier, the age rule, `lossless_only`.
//! - [`par`]: the thread pool parallel work runs on, a forked child's own included.
//! - Private leaf math, shared by every backend: `scale` (amax → FP8 scale, NVFP4 global and
//!   block scales) and `fwht` (the Walsh–Hadamard butterflies, scalar and vector).
//!
//! The modules form layers, each using only those below it (no cycles):
//! `formats`, `fwht`, `error` → `scale`, `block` → `rotation` → `kernel` → `codec` (with
//! `payload`, which needs only `block`) → `policy`; `copy` and `par` stand alone (`codec` runs its
//! parallel sections through `par`).
//!
//! ```
//! use kvtier_kernels::{decode, encode, BlockSpec, KvBlockView};
//! use kvtier_proto::{CodecId, DType};
//! let spec = BlockSpec::new(1, 2, 1, 16, DType::Bf16);
//! let bytes: Vec<u8> = (0..spec.elements())
//!     .flat_map(|i| half::bf16::from_f32(i as f32 - 8.0).to_bits().to_le_bytes())
//!     .collect();
//! let payload = encode(CodecId::NVFP4, &KvBlockView::new(spec, &bytes).unwrap()).unwrap();
//! let back = decode(CodecId::NVFP4, &payload, &spec).unwrap();
//! assert_eq!(back.len(), bytes.len());
//! ```

pub mod block;
pub mod codec;
pub mod copy;
mod error;
pub mod formats;
mod fwht;
mod kernel;
pub mod par;
pub mod payload;
pub mod policy;
pub mod rotation;
mod scale;

pub use block::{BlockSpec, KvBlockView};
pub use codec::{decode, encode, is_lossless, is_rotated, rotated_variant, split_codec, Codec, Fp8Scaling};
pub use error::CodecError;
pub use kernel::Backend;
pub use payload::{inspect, Format, Fp8ScaleMode, PayloadInfo, PayloadParts};
pub use rotation::{Rotation, DEFAULT_ROTATION_SEED};

/// Hooks for this crate's own integration tests (golden vectors, backend equality). Not a stable
/// API.
#[doc(hidden)]
pub mod __testing {
    use crate::{Backend, CodecError};

    /// Unscaled E4M3 codes of `xs` (saturating) through `backend`'s vector kernel.
    pub fn e4m3_codes(backend: Backend, xs: &[f32]) -> Result<Vec<u8>, CodecError> {
        let mut out = vec![0u8; xs.len()];
        backend.resolve()?.e4m3_slice(xs, &mut out);
        Ok(out)
    }

    /// A deterministic source of uniform `f32`s in `[0, 1)` (xorshift64 from `seed`), for
    /// benchmarks that build KV-like data without a rand crate.
    pub fn uniform_source(seed: u64) -> impl FnMut() -> f32 {
        let mut s = seed;
        move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32
        }
    }

    /// Whether AVX-512 backends resolved from now on may use AVX512-BF16 where the CPU has it
    /// (default: yes); a process-wide switch, so that tests can compare both routes.
    pub fn avx512_bf16(enabled: bool) {
        crate::kernel::AVX512_BF16_OFF.store(!enabled, std::sync::atomic::Ordering::Relaxed);
    }

    /// Unscaled E2M1 codes of `xs`, one per byte, through `backend`'s vector kernel.
    pub fn e2m1_codes(backend: Backend, xs: &[f32]) -> Result<Vec<u8>, CodecError> {
        let mut out = vec![0u8; xs.len()];
        backend.resolve()?.e2m1_slice(xs, &mut out);
        Ok(out)
    }
}
