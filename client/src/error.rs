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
    /// Bytes or shapes that are wrong (the error is carried, not a source: its text is in this
    /// one's already, and error-chain printers would say it twice).
    #[error("protocol error: {0}")]
    Protocol(ProtoError),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("server refused: {}", coded(code, message))]
    Refused { code: String, message: String },
    #[error("{}", labeled("no capacity on the server", .0))]
    Capacity(String),
    #[error("{}", labeled("unknown namespace", .0))]
    UnknownNamespace(String),
    #[error("{}", labeled("context too long", .0))]
    ContextTooLong(String),
    #[error("{}", labeled("session not found", .0))]
    SessionNotFound(String),
    #[error("{}", labeled("session expired", .0))]
    SessionExpired(String),
    #[error("{}", labeled("session exists", .0))]
    SessionExists(String),
    #[error("{}", labeled("session version conflict", .0))]
    VersionConflict(String),
    #[error("unauthenticated: {0}")]
    Unauthenticated(String),
    /// Authenticated, but the namespace belongs to another tenant that granted no such access.
    #[error("{}", labeled("forbidden", .0))]
    Forbidden(String),
    /// The tenant is at one of its quotas (namespaces, sessions, session bytes).
    #[error("{}", labeled("quota exceeded", .0))]
    QuotaExceeded(String),
    /// The server is up, but other members of its cluster it needed could not be reached in time
    /// (a park left short of its copies, a peer down). A park or extend said so was kept on the
    /// node at its new version: write again with that version (the message says which).
    #[error("{}", labeled("cluster unavailable", .0))]
    Unavailable(String),
    /// The data plane refused a block (`status` says why; its [`ItemStatus::code`] leads the
    /// message).
    #[error("{}block {index} rejected: {}", status.code().map(|c| format!("{c}: ")).unwrap_or_default(), status.describe())]
    Rejected { index: usize, status: ItemStatus },
    #[error("block {index} is missing on the server")]
    Missing { index: usize },
    /// The same-node path can't be used with this server (another host, no socket advertised,
    /// the socket unreachable).
    #[error("same-node path unavailable: {0}")]
    NotSameNode(String),
    /// Encoding a block for the namespace's codec, or decoding a stored one, failed.
    #[error("codec: {0}")]
    Codec(String),
}

/// `label: message`, or the message alone where it is the server's (`KV:…: what went wrong`):
/// its stable code and its words already say which kind of failure it is, and saying it again
/// reads `quota exceeded: KV:Quota:Exceeded: quota exceeded: …`.
fn labeled(label: &str, message: &str) -> String {
    if message.starts_with("KV:") {
        message.to_string()
    } else {
        format!("{label}: {message}")
    }
}

/// `code: message`, the code once: the server's messages start with their code already.
fn coded(code: &str, message: &str) -> String {
    match message.strip_prefix(code).and_then(|m| m.strip_prefix(": ")) {
        Some(_) => message.to_string(),
        None => format!("{code}: {message}"),
    }
}

impl From<ProtoError> for ClientError {
    fn from(e: ProtoError) -> Self {
        ClientError::Protocol(e)
    }
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
            ClientError::Unavailable(_) => "unavailable",
            ClientError::Rejected { status: ItemStatus::Forbidden, .. } => "forbidden",
            ClientError::Rejected { status: ItemStatus::Capacity, .. } => "capacity",
            ClientError::Rejected { status: ItemStatus::UnknownNamespace, .. } => "unknown_namespace",
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
            codes::UNAVAILABLE => ClientError::Unavailable(message),
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
                // What failed underneath ("tcp connect error: Connection refused"): the status's
                // own message is only "transport error".
                let mut why = String::new();
                let mut source = std::error::Error::source(&s);
                while let Some(e) = source {
                    let e_text = e.to_string();
                    if !message.contains(&e_text) && !why.contains(&e_text) {
                        why.push_str(": ");
                        why.push_str(&e_text);
                    }
                    source = e.source();
                }
                ClientError::Io(format!("{:?}: {message}{why}", s.code()))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_block_leads_with_its_stable_code() {
        let e = ClientError::Rejected { index: 2, status: ItemStatus::Forbidden };
        assert!(e.to_string().starts_with("KV:Auth:Forbidden: block 2 rejected: forbidden"), "{e}");
        // Every refusal a server can give a block has a code; the answers that are none, none.
        for v in 0..=255u8 {
            let Ok(st) = ItemStatus::from_u8(v) else { continue };
            let refusal = !matches!(st, ItemStatus::Ok | ItemStatus::Present | ItemStatus::Miss);
            assert_eq!(st.code().is_some_and(|c| c.starts_with("KV:")), refusal, "{st:?}");
        }
    }

    #[test]
    fn a_transport_failure_says_what_failed_underneath() {
        let cause = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "tcp connect error: Connection refused");
        let mut s = tonic::Status::new(tonic::Code::Unknown, "transport error");
        s.set_source(std::sync::Arc::new(cause));
        let e = ClientError::from(s);
        assert!(matches!(e, ClientError::Io(ref m) if m.contains("transport error: tcp connect error")), "{e}");
    }

    fn refusal(code: &str, message: &str) -> ClientError {
        let mut s = tonic::Status::new(tonic::Code::InvalidArgument, message);
        s.metadata_mut().insert(codes::METADATA_KEY, code.parse().unwrap());
        ClientError::from(s)
    }

    /// The server words a refusal `CODE: what went wrong`; the client's text says the code and
    /// the kind once each, wherever it came from.
    #[test]
    fn errors_say_their_code_and_kind_once() {
        let e = refusal(codes::INVALID_REQUEST, "KV:Request:Invalid: invalid request: base_blocks 9 is past 3");
        assert_eq!(e.to_string(), "server refused: KV:Request:Invalid: invalid request: base_blocks 9 is past 3");
        let e = refusal(codes::QUOTA, "KV:Quota:Exceeded: quota exceeded: tenant \"t\" is at max_sessions 2");
        assert!(matches!(e, ClientError::QuotaExceeded(_)));
        assert_eq!(e.to_string(), "KV:Quota:Exceeded: quota exceeded: tenant \"t\" is at max_sessions 2");
        let e = refusal(codes::FORBIDDEN, "KV:Auth:Forbidden: forbidden: namespace of tenant \"a\"");
        assert_eq!(e.to_string(), "KV:Auth:Forbidden: forbidden: namespace of tenant \"a\"");
        // Raised by the client itself: the kind leads.
        let e = ClientError::ContextTooLong("90 tokens exceed the server's max_context_tokens 64".into());
        assert_eq!(e.to_string(), "context too long: 90 tokens exceed the server's max_context_tokens 64");
        let e = ClientError::Refused { code: "dataplane:Internal".into(), message: "disk read failed".into() };
        assert_eq!(e.to_string(), "server refused: dataplane:Internal: disk read failed");
        // A carried protocol error is not also a source: a chain printer says it once.
        let e = ClientError::from(ProtoError::InvalidLayout("layers must be > 0".into()));
        assert!(std::error::Error::source(&e).is_none());
    }
}
