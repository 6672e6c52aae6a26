//! The one error type of `kvtier-server`, with variants a caller can act on, and their stable codes.

use kvtier_proto::{codes, NamespaceId, ProtoError};

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// No room: every resident byte is pinned, or pinning more would pass the pinned-bytes limit.
    #[error("no capacity: {0}")]
    Capacity(String),
    /// A block is larger than the whole tier.
    #[error("block of {len} bytes can never fit a tier of {capacity} bytes")]
    TooLarge { len: u64, capacity: u64 },
    /// Pinning failed because these blocks are not resident (indices into the caller's list).
    #[error("{} block(s) not resident{}", missing.len(), if *missing_tail { " (tail included)" } else { "" })]
    MissingBlocks { missing: Vec<u32>, missing_tail: bool },
    #[error("unknown namespace {0}; register it first")]
    UnknownNamespace(NamespaceId),
    #[error("session {0:?} not found")]
    SessionNotFound(String),
    /// Parked, then lost when the node last started (a block of it was damaged or gone from
    /// disk): not found, saying why.
    #[error(
        "session {0:?} not found: it was lost when the node last started (a block of it on disk was damaged or gone)"
    )]
    SessionLost(String),
    /// Held by no member up now, while members that left the cluster lately may hold it: a
    /// session whose copies were all on them comes back when one of them rejoins.
    #[error(
        "session {id:?} not found on any member up now; {left} left the cluster lately and may hold it (a session \
         has cluster_rf copies, one with cluster_rf = 1; it comes back when its holder rejoins): try again then, or \
         park it anew"
    )]
    SessionAway { id: String, left: String },
    #[error("session {id:?} expired {ago_ms} ms ago")]
    SessionExpired { id: String, ago_ms: u64 },
    #[error("session {0:?} already exists; pass its version to replace it")]
    SessionExists(String),
    #[error("session {id:?} is at version {actual}, not {expected}")]
    VersionConflict { id: String, expected: u64, actual: u64 },
    /// Two nodes took a write of the session at the same time, each making `version`: neither is
    /// acknowledged (the copies may differ until the next write).
    #[error(
        "session {id:?}: node {node} holds another context at version {version} (another write made it at the \
         same time); this one is not acknowledged (resume to see what the session holds, then write again)"
    )]
    ConcurrentWrite { id: String, version: u64, node: String },
    #[error("context of {tokens} tokens exceeds the configured maximum of {max}")]
    ContextTooLong { tokens: u64, max: u64 },
    /// The principal may not touch this namespace (it is another tenant's and not granted).
    #[error("forbidden: {0}")]
    Forbidden(String),
    /// The tenant is at one of its quotas.
    #[error("quota exceeded: {0}")]
    QuotaExceeded(String),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Proto(#[from] ProtoError),
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// A peer node (the G4 tier) could not be reached or answered wrongly; callers turn it into
    /// a miss.
    #[error("peer {peer}: {reason}")]
    Peer { peer: String, reason: String },
    /// A replicated session was kept here but fewer members than its replication factor took a
    /// copy (they failed or are down); said to the client, who may park again to retry.
    #[error("too few copies: {0}")]
    ShortOfCopies(String),
}

impl ServerError {
    /// The stable code shown to clients.
    pub fn code(&self) -> &'static str {
        match self {
            ServerError::Capacity(_) | ServerError::TooLarge { .. } => codes::CAPACITY,
            ServerError::MissingBlocks { .. } => codes::INVALID_REQUEST,
            ServerError::UnknownNamespace(_) => codes::UNKNOWN_NAMESPACE,
            ServerError::SessionNotFound(_) | ServerError::SessionLost(_) | ServerError::SessionAway { .. } => {
                codes::SESSION_NOT_FOUND
            }
            ServerError::SessionExpired { .. } => codes::SESSION_EXPIRED,
            ServerError::SessionExists(_) => codes::SESSION_EXISTS,
            ServerError::VersionConflict { .. } | ServerError::ConcurrentWrite { .. } => codes::SESSION_VERSION,
            ServerError::ContextTooLong { .. } => codes::CONTEXT_TOO_LONG,
            ServerError::Forbidden(_) => codes::FORBIDDEN,
            ServerError::QuotaExceeded(_) => codes::QUOTA,
            ServerError::Proto(ProtoError::KeyLength { .. }) => codes::KEY_LENGTH,
            ServerError::Proto(ProtoError::InvalidNamespace(_) | ProtoError::InvalidLayout(_)) => {
                codes::INVALID_NAMESPACE
            }
            ServerError::InvalidRequest(_) | ServerError::Proto(_) => codes::INVALID_REQUEST,
            ServerError::Io(e) if e.kind() == std::io::ErrorKind::StorageFull => codes::DISK_FULL,
            ServerError::Peer { .. } | ServerError::ShortOfCopies(_) => codes::UNAVAILABLE,
            ServerError::Config(_) | ServerError::Io(_) => codes::INTERNAL,
        }
    }

    /// A short label for the `kvtier_errors_total{kind=...}` metric.
    pub fn kind(&self) -> &'static str {
        match self {
            ServerError::Capacity(_) | ServerError::TooLarge { .. } => "capacity",
            ServerError::MissingBlocks { .. } => "missing_blocks",
            ServerError::UnknownNamespace(_) => "unknown_namespace",
            ServerError::SessionNotFound(_) => "session_not_found",
            ServerError::SessionLost(_) => "session_lost",
            ServerError::SessionAway { .. } => "session_away",
            ServerError::SessionExpired { .. } => "session_expired",
            ServerError::SessionExists(_) => "session_exists",
            ServerError::VersionConflict { .. } => "version_conflict",
            ServerError::ConcurrentWrite { .. } => "concurrent_write",
            ServerError::ContextTooLong { .. } => "context_too_long",
            ServerError::Forbidden(_) => "forbidden",
            ServerError::QuotaExceeded(_) => "quota",
            ServerError::Proto(ProtoError::KeyLength { .. }) => "key_length",
            ServerError::InvalidRequest(_) | ServerError::Proto(_) => "invalid_request",
            ServerError::Config(_) => "config",
            ServerError::Io(e) if e.kind() == std::io::ErrorKind::StorageFull => "disk_full",
            ServerError::Io(_) => "io",
            ServerError::Peer { .. } => "peer",
            ServerError::ShortOfCopies(_) => "short_of_copies",
        }
    }
}
