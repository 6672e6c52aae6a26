//! The one error type of `kvtier-proto`: everything that can be wrong with bytes or shapes.

/// What is wrong with a layout, key, namespace or frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    #[error("invalid KV layout: {0}")]
    InvalidLayout(String),
    #[error("invalid namespace: {0}")]
    InvalidNamespace(String),
    #[error("invalid cluster member: {0}")]
    InvalidMember(String),
    #[error("unknown dtype code {0}")]
    UnknownDType(u32),
    #[error("unknown memory order code {0}")]
    UnknownOrder(u32),
    #[error("unknown hashing scheme code {0}")]
    UnknownHashScheme(u32),
    #[error("block key must be {expected} bytes, got {actual}")]
    KeyLength { expected: usize, actual: usize },
    #[error("namespace id must be {expected} bytes, got {actual}")]
    NamespaceIdLength { expected: usize, actual: usize },
    #[error("frame truncated: need {need} bytes, have {have}")]
    Truncated { need: usize, have: usize },
    #[error("bad frame magic {0:#010x}")]
    BadMagic(u32),
    #[error("unsupported frame version {0}")]
    UnsupportedVersion(u16),
    #[error("frame header checksum mismatch")]
    HeaderChecksum,
    #[error("frame header has unknown flag bits {0:#06x}")]
    UnknownFlags(u16),
    #[error("payload checksum mismatch: header says {expected:#018x}, payload hashes to {actual:#018x}")]
    PayloadChecksum { expected: u64, actual: u64 },
    #[error("payload of {actual} bytes exceeds the limit of {limit} bytes")]
    PayloadTooLarge { actual: u64, limit: u64 },
    #[error("block holds {tokens} tokens but the layout's blocks hold at most {block_tokens}")]
    TooManyTokens { tokens: u32, block_tokens: u32 },
    #[error("payload is {actual} bytes but {tokens} tokens of this layout with codec {codec} take {expected}")]
    SizeMismatch { expected: u64, actual: u64, tokens: u32, codec: u16 },
    #[error("codec {codec} quantizes, and this namespace is lossless (an opaque layout or `lossless`): only raw and raw+lz4 apply")]
    LossyCodec { codec: u16 },
    #[error("unknown codec id {0}")]
    UnknownCodec(u16),
    #[error("metadata log header: {0}")]
    LogHeader(String),
    #[error("malformed data-plane message: {0}")]
    Malformed(String),
}
