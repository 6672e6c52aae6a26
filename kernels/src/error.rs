//! The one error type of this crate.

use kvtier_proto::DType;

/// Everything that can go wrong encoding or decoding a block. Nothing here panics on a caller's
/// data: a bad block or a bad payload comes back as one of these.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum CodecError {
    /// NaN or ±Inf in the input of a quantizing codec. The location is the first one found.
    #[error("input holds a non-finite value ({value}) at layer {layer}, {kv}, token {token}, head {head}, dim {dim}; quantizing codecs accept finite values only")]
    NonFinite { layer: usize, kv: &'static str, token: usize, head: usize, dim: usize, value: f32 },
    #[error("unknown codec id {0}")]
    UnknownCodec(u16),
    #[error("codec {codec} does not accept {dtype:?} ({why})")]
    UnsupportedDType { codec: &'static str, dtype: DType, why: &'static str },
    /// The block or the options do not fit together (wrong byte length, empty shape, bad scale).
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// The payload is not one this crate wrote, or does not match the shape it is decoded as.
    #[error("corrupt payload: {0}")]
    Corrupt(String),
    /// The payload's shape differs from the one the caller expects.
    #[error("payload shape {found} does not match the expected {expected}")]
    ShapeMismatch { expected: String, found: String },
    /// The AVX2/F16C backend was requested on a machine without it.
    #[error("backend {0} is not available on this CPU")]
    BackendUnavailable(&'static str),
}
