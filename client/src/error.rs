//! The one error type of `kvtier-client`: what went wrong, in terms a caller can act on.

use kvtier_proto::dataplane::ItemStatus;
use kvtier_proto::{codes, ProtoError};

#[derive(Debug, Clone, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to {addr}: {reason}")]
    Connect { addr: String, reason: String },
    #[error("timed out after {0:?}")]
    Timeout(std::time::Duration),
    #[error("connection failed: {0}")]
    Io(String),
    #[error("protocol error: {0}")]
    Protocol(#[from] ProtoError),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("server refused: {code}: {message}")]
    Refused { code: String, message: String },
    #[error("no capacity on the server: {0}")]
    Capacity(String),
    #[error("unknown namespace: {0}")]
    UnknownNamespace(String),
    #[error("context too long: {0}")]
    ContextTooLong(String),
    #[error("session not found: {0}")]
    SessionNotFound(String),
    #[error("session expired: {0}")]
    SessionExpired(String),
    #[error("session exists: {0}")]
    SessionExists(String),
    #[error("session version conflict: {0}")]
    VersionConflict(String),
    #[error("unauthenticated: {0}")]
    Unauthenticated(String),
    /// Authenticated, but the namespace belongs to another tenant that granted no such access.
    #[error("forbidden: {0}")]
    Forbidden(String),
    /// The tenant is at one of its quotas (namespaces, sessions, session bytes).
    #[error("quota exceeded: {0}")]
    QuotaExceeded(String),
    #[error("block {index} rejected: {}", status.describe())]
    Rejected { index: usize, status: ItemStatus },
    #[error("block {index} is missing on the server")]
    Missing { index: usize },
    /// The same-node path can't be used with this server (another host, no socket advertised).
    #[error("not on the server's host: {0}")]
    NotSameNode(String),
    /// Encoding a block for the namespace's codec, or decoding a stored one, failed.
    #[error("codec: {0}")]
    Codec(String),
}

impl ClientError {
    /// A short label for metrics and never-raise miss reasons.
    pub fn reason(&self) -> &'static str {
        match self {
            ClientError::Connect { .. } => "connect",
            ClientError::Timeout(_) => "timeout",
            ClientError::Io(_) => "io",
            ClientError::Protocol(_) => "protocol",
            ClientError::InvalidArgument(_) => "invalid_argument",
            ClientError::Refused { .. } => "refused",
            ClientError::Capacity(_) => "capacity",
            ClientError::UnknownNamespace(_) => "unknown_namespace",
            ClientError::ContextTooLong(_) => "context_too_long",
            ClientError::SessionNotFound(_) => "session_not_found",
            ClientError::SessionExpired(_) => "session_expired",
            ClientError::SessionExists(_) => "session_exists",
            ClientError::VersionConflict(_) => "version_conflict",
            ClientError::Unauthenticated(_) => "unauthenticated",
            ClientError::Forbidden(_) => "forbidden",
            ClientError::QuotaExceeded(_) => "quota",
            ClientError::Rejected { status: ItemStatus::Forbidden, .. } => "forbidden",
            ClientError::Rejected { status: ItemStatus::Capacity, .. } => "capacity",
            ClientError::Rejected { .. } => "rejected",
            ClientError::Missing { .. } => "missing",
            ClientError::Codec(_) => "codec",
            ClientError::NotSameNode(_) => "not_same_node",
        }
    }
}

impl From<kvtier_kernels::CodecError> for ClientError {
    fn from(e: kvtier_kernels::CodecError) -> Self {
        ClientError::Codec(e.to_string())
    }
}

impl From<std::io::Error> for ClientError {
    fn from(e: std::io::Error) -> Self {
        ClientError::Io(e.to_string())
    }
}

impl From<tonic::Status> for ClientError {
    fn from(s: tonic::Status) -> Self {
        let code =
            s.metadata().get(codes::METADATA_KEY).and_then(|v| v.to_str().ok()).map(str::to_string).unwrap_or_default();
        let message = s.message().to_string();
        match code.as_str() {
            codes::CAPACITY => ClientError::Capacity(message),
            codes::UNKNOWN_NAMESPACE => ClientError::UnknownNamespace(message),
            codes::CONTEXT_TOO_LONG => ClientError::ContextTooLong(message),
            codes::SESSION_NOT_FOUND => ClientError::SessionNotFound(message),
            codes::SESSION_EXPIRED => ClientError::SessionExpired(message),
            codes::SESSION_EXISTS => ClientError::SessionExists(message),
            codes::SESSION_VERSION => ClientError::VersionConflict(message),
            codes::FORBIDDEN => ClientError::Forbidden(message),
            codes::QUOTA => ClientError::QuotaExceeded(message),
            _ if s.code() == tonic::Code::Unauthenticated => ClientError::Unauthenticated(message),
            // No kvtier code: the transport failed (server gone, connection reset), not the server.
            "" if matches!(
                s.code(),
                tonic::Code::Unavailable
                    | tonic::Code::DeadlineExceeded
                    | tonic::Code::Unknown
                    | tonic::Code::Cancelled
            ) =>
            {
                ClientError::Io(format!("{:?}: {message}", s.code()))
            }
            "" => ClientError::Refused { code: format!("{:?}", s.code()), message },
            _ => ClientError::Refused { code, message },
        }
    }
}

impl From<tonic::transport::Error> for ClientError {
    fn from(e: tonic::transport::Error) -> Self {
        ClientError::Io(e.to_string())
    }
}
