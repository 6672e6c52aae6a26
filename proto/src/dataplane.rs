//! The bulk data plane: a framed TCP protocol that moves block payloads. Messages are fixed
//! little-endian headers followed by block frames, so the server can read a payload straight into
//! its destination slab and write a stored one straight from DRAM to the socket.
//!
//! A connection opens with a [`Hello`] (magic, version, optional auth token) answered by a
//! [`HelloReply`]. Then any number of requests follow; the server answers them in order, so a
//! client may pipeline.
//!
//! - `PUT`: [`RequestHeader`] with `count` frames after it (each a 128-byte frame header and its
//!   payload). Answer: [`ResponseHeader`] then `count` [`ItemStatus`] bytes.
//! - `GET`: [`RequestHeader`] (namespace set) with `count` 32-byte keys after it. Answer:
//!   [`ResponseHeader`] then, per key, an [`ItemStatus`] byte followed — when `Ok` — by the stored
//!   frame (header + payload). A reader must check each payload against its header's checksum
//!   and take a mismatch for a miss: a server checks a block from its DRAM only after sending it
//!   (and drops one it finds damaged), so the reader's check is what keeps damaged bytes out.
//!
//!   With [`FLAG_STOP_AT_MISS`] the server stops loading at the first key it can't serve and
//!   answers `Miss` for every key after it without looking: an engine's lookup and load of the
//!   longest stored prefix in one round trip.
//! - `EXISTS`: [`RequestHeader`] (namespace set) with `count` 32-byte keys after it. Answer:
//!   [`ResponseHeader`] then one [`ItemStatus`] byte per key (`Ok` present, `Miss` absent), each
//!   key on its own (engines store chunks out of order, so a hole does not hide later keys).
//! - `RELEASE`: [`RequestHeader`] with `count` 0. Unpins every block this connection stored or
//!   touched with [`FLAG_PIN_LEASE`]. Answer: a [`ResponseHeader`].
//!
//! A `PUT` with [`FLAG_REPORT_PRESENT`] answers [`ItemStatus::Present`] instead of `Ok` for a
//! block the server already held (its bytes were not taken), so a writer learns what it didn't
//! need to send; after the item statuses come one little-endian `u16` per item: the codec of the
//! copy the server holds (for `Ok` and `Present`), or [`NO_CODEC`].
//!
//! A `PUT` with [`FLAG_PIN_LEASE`] pins each stored (or already present) block for as long as the
//! connection lives or until `RELEASE`, so a session's blocks can't be evicted between their upload
//! and the park that pins them for good; a client that dies mid-park leaks nothing.
//!
//! A `GET` or `PUT` with [`FLAG_PEER`] comes from another node of the cluster asking on a
//! client's behalf: it is served from the node's own tiers and never forwarded again.
//!
//! A `PUT` with [`FLAG_CHECKSUM_AFTER`] (protocol 2) ignores its frame headers' checksums: each
//! payload is followed by its checksum, 8 bytes little-endian ([`CHECKSUM_LEN`]). The client
//! hashes each piece of a payload after it has written it, while the server is receiving it,
//! instead of hashing the whole block before its first byte leaves; the server hashes the pieces
//! as they land and takes a block only if the trailer matches (`ChecksumMismatch` otherwise). The
//! checksum the server keeps with the block is the trailer's. Sent on a protocol-1 connection, or
//! on another op, the flag ends the connection with `BadRequest` (what follows can't be framed).
//!
//! Versions: a server accepts a hello of [`MIN_PROTOCOL_VERSION`] to [`PROTOCOL_VERSION`] and
//! answers any other with `UnsupportedVersion` and a close; a client that gets that answer for
//! its own version connects again saying the oldest (a rolling upgrade, new clients first).
//!
//! A request-level error (bad header, too many items, unknown namespace) is a [`ResponseHeader`]
//! with a non-zero status and a UTF-8 message of `msg_len` bytes; no item statuses follow. After a
//! request-level error the server closes the connection when it can't find the next request's start.

use crate::{NamespaceId, ProtoError, NAMESPACE_ID_LEN};

pub const HELLO_MAGIC: [u8; 4] = *b"KVDP";
/// The version a client says in its hello: 2 added [`FLAG_CHECKSUM_AFTER`].
pub const PROTOCOL_VERSION: u16 = 2;
/// The oldest version a server still accepts (every op, no [`FLAG_CHECKSUM_AFTER`]).
pub const MIN_PROTOCOL_VERSION: u16 = 1;
/// The first version with [`FLAG_CHECKSUM_AFTER`].
pub const CHECKSUM_AFTER_SINCE_VERSION: u16 = 2;
/// Bytes of the checksum after each payload of a [`FLAG_CHECKSUM_AFTER`] `PUT`.
pub const CHECKSUM_LEN: usize = 8;
pub const HELLO_LEN: usize = 8;
pub const REQUEST_HEADER_LEN: usize = 32;
pub const RESPONSE_HEADER_LEN: usize = 16;
pub const MAX_TOKEN_LEN: usize = 1024;
/// The ALPN protocol of the data plane over QUIC (one bidirectional stream per connection).
pub const QUIC_ALPN: &[u8] = b"kvtier-data/1";
/// `PUT` flag: keep the blocks pinned until `RELEASE` or the end of the connection.
pub const FLAG_PIN_LEASE: u16 = 1;
/// `GET` flag: stop at the first miss (the longest stored prefix in one request).
pub const FLAG_STOP_AT_MISS: u16 = 2;
/// `PUT` flag: answer [`ItemStatus::Present`] for blocks already held.
pub const FLAG_REPORT_PRESENT: u16 = 4;
/// `GET`, `PUT`: sent by a node on a client's behalf (the G4 peer tier). The peer answers from
/// its own tiers only and forwards nothing, so a request never travels further than one hop.
pub const FLAG_PEER: u16 = 8;
/// `PUT` flag (protocol 2): each payload is followed by its checksum; the frame headers'
/// checksums are ignored (see the module docs).
pub const FLAG_CHECKSUM_AFTER: u16 = 16;
/// In a [`FLAG_REPORT_PRESENT`] answer: no copy held (the item was refused).
pub const NO_CODEC: u16 = u16::MAX;

/// Opens a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub version: u16,
    pub token_len: u16,
}

impl Hello {
    /// The fixed part; `token_len` bytes of token follow it.
    pub fn encode(version: u16, token: &[u8]) -> Vec<u8> {
        let mut v = Vec::with_capacity(HELLO_LEN + token.len());
        v.extend_from_slice(&HELLO_MAGIC);
        v.extend_from_slice(&version.to_le_bytes());
        v.extend_from_slice(&(token.len() as u16).to_le_bytes());
        v.extend_from_slice(token);
        v
    }

    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Self, ProtoError> {
        if b[0..4] != HELLO_MAGIC {
            return Err(ProtoError::Malformed("not a kvtier data-plane connection (bad hello magic)".into()));
        }
        let token_len = u16::from_le_bytes([b[6], b[7]]);
        if token_len as usize > MAX_TOKEN_LEN {
            return Err(ProtoError::Malformed(format!("auth token of {token_len} bytes is too long")));
        }
        Ok(Hello { version: u16::from_le_bytes([b[4], b[5]]), token_len })
    }
}

/// The server's answer to a [`Hello`]: a [`Status`] byte, a reserved byte and a message length,
/// then the message.
pub struct HelloReply;

impl HelloReply {
    pub fn encode(status: Status, msg: &str) -> Vec<u8> {
        let msg = &msg.as_bytes()[..msg.len().min(u16::MAX as usize)];
        let mut v = Vec::with_capacity(4 + msg.len());
        v.push(status as u8);
        v.push(0);
        v.extend_from_slice(&(msg.len() as u16).to_le_bytes());
        v.extend_from_slice(msg);
        v
    }

    /// Status and message length.
    pub fn decode(b: &[u8; 4]) -> Result<(Status, u16), ProtoError> {
        Ok((Status::from_u8(b[0])?, u16::from_le_bytes([b[2], b[3]])))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    Put = 1,
    Get = 2,
    Release = 3,
    Exists = 4,
}

impl Op {
    pub fn from_u8(v: u8) -> Result<Self, ProtoError> {
        match v {
            1 => Ok(Op::Put),
            2 => Ok(Op::Get),
            3 => Ok(Op::Release),
            4 => Ok(Op::Exists),
            other => Err(ProtoError::Malformed(format!("unknown data-plane op {other}"))),
        }
    }
}

/// Request-level outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Status {
    Ok = 0,
    BadRequest = 1,
    TooLarge = 2,
    Unauthenticated = 3,
    UnknownNamespace = 4,
    Internal = 5,
    UnsupportedVersion = 6,
    /// The connection's tenant may not touch the request's namespace.
    Forbidden = 7,
}

impl Status {
    pub fn from_u8(v: u8) -> Result<Self, ProtoError> {
        Ok(match v {
            0 => Status::Ok,
            1 => Status::BadRequest,
            2 => Status::TooLarge,
            3 => Status::Unauthenticated,
            4 => Status::UnknownNamespace,
            5 => Status::Internal,
            6 => Status::UnsupportedVersion,
            7 => Status::Forbidden,
            other => return Err(ProtoError::Malformed(format!("unknown status {other}"))),
        })
    }
}

/// Per-block outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ItemStatus {
    Ok = 0,
    Miss = 1,
    ChecksumMismatch = 2,
    SizeMismatch = 3,
    UnknownNamespace = 4,
    /// No room: the tier is full of pinned blocks (or the block is larger than the tier).
    Capacity = 5,
    /// The frame's layout is not its namespace's layout.
    LayoutMismatch = 6,
    BadHeader = 7,
    Internal = 8,
    /// A quantizing codec in a lossless namespace (an opaque layout, or one made `lossless`).
    LossyCodec = 9,
    /// Already held (a `PUT` with [`FLAG_REPORT_PRESENT`]): nothing was written.
    Present = 10,
    /// Same-node path: the item's offset and length fall outside the registered buffer, or the
    /// block is longer than the room the item gave it.
    OutOfRange = 11,
    /// The connection's tenant may not write (or read) the frame's namespace.
    Forbidden = 12,
}

impl ItemStatus {
    pub fn from_u8(v: u8) -> Result<Self, ProtoError> {
        Ok(match v {
            0 => ItemStatus::Ok,
            1 => ItemStatus::Miss,
            2 => ItemStatus::ChecksumMismatch,
            3 => ItemStatus::SizeMismatch,
            4 => ItemStatus::UnknownNamespace,
            5 => ItemStatus::Capacity,
            6 => ItemStatus::LayoutMismatch,
            7 => ItemStatus::BadHeader,
            8 => ItemStatus::Internal,
            9 => ItemStatus::LossyCodec,
            10 => ItemStatus::Present,
            11 => ItemStatus::OutOfRange,
            12 => ItemStatus::Forbidden,
            other => return Err(ProtoError::Malformed(format!("unknown item status {other}"))),
        })
    }

    /// Whether the server holds the block after a `PUT` (stored now, or already there).
    pub fn is_held(self) -> bool {
        matches!(self, ItemStatus::Ok | ItemStatus::Present)
    }

    pub fn describe(self) -> &'static str {
        match self {
            ItemStatus::Ok => "ok",
            ItemStatus::Miss => "miss",
            ItemStatus::ChecksumMismatch => "checksum mismatch",
            ItemStatus::SizeMismatch => "payload size does not match the layout",
            ItemStatus::UnknownNamespace => "unknown namespace",
            ItemStatus::Capacity => "no capacity: every resident byte is pinned",
            ItemStatus::LayoutMismatch => "frame layout differs from the namespace layout",
            ItemStatus::BadHeader => "bad frame header",
            ItemStatus::Internal => "internal error",
            ItemStatus::LossyCodec => "a quantizing codec in a lossless namespace",
            ItemStatus::Present => "already present",
            ItemStatus::OutOfRange => "offset and length outside the registered buffer (or the item's room)",
            ItemStatus::Forbidden => "the namespace belongs to another tenant that granted no access",
        }
    }
}

/// Starts every request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    pub op: Op,
    /// Bit set of `FLAG_*`.
    pub flags: u16,
    pub request_id: u32,
    pub count: u32,
    /// The namespace of a `GET`; ignored for `PUT` (each frame names its own).
    pub namespace: NamespaceId,
}

impl RequestHeader {
    pub fn encode(&self) -> [u8; REQUEST_HEADER_LEN] {
        let mut b = [0u8; REQUEST_HEADER_LEN];
        b[0] = self.op as u8;
        b[1] = 0xD1; // a marker that catches a desynchronised stream early
        b[2..4].copy_from_slice(&self.flags.to_le_bytes());
        b[4..8].copy_from_slice(&self.request_id.to_le_bytes());
        b[8..12].copy_from_slice(&self.count.to_le_bytes());
        b[16..16 + NAMESPACE_ID_LEN].copy_from_slice(&self.namespace.0);
        b
    }

    pub fn decode(b: &[u8; REQUEST_HEADER_LEN]) -> Result<Self, ProtoError> {
        if b[1] != 0xD1 {
            return Err(ProtoError::Malformed("request header marker missing (stream out of sync?)".into()));
        }
        let mut ns = [0u8; NAMESPACE_ID_LEN];
        ns.copy_from_slice(&b[16..32]);
        Ok(RequestHeader {
            op: Op::from_u8(b[0])?,
            flags: u16::from_le_bytes([b[2], b[3]]),
            request_id: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
            count: u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
            namespace: NamespaceId(ns),
        })
    }
}

/// Starts every response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResponseHeader {
    pub op: u8,
    pub status: Status,
    pub msg_len: u16,
    pub request_id: u32,
    pub count: u32,
}

impl ResponseHeader {
    pub fn encode(&self) -> [u8; RESPONSE_HEADER_LEN] {
        let mut b = [0u8; RESPONSE_HEADER_LEN];
        b[0] = self.op;
        b[1] = self.status as u8;
        b[2..4].copy_from_slice(&self.msg_len.to_le_bytes());
        b[4..8].copy_from_slice(&self.request_id.to_le_bytes());
        b[8..12].copy_from_slice(&self.count.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; RESPONSE_HEADER_LEN]) -> Result<Self, ProtoError> {
        Ok(ResponseHeader {
            op: b[0],
            status: Status::from_u8(b[1])?,
            msg_len: u16::from_le_bytes([b[2], b[3]]),
            request_id: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
            count: u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
        })
    }

    /// A successful answer to request `request_id` of `count` items (their statuses follow).
    pub fn ok(op: Op, request_id: u32, count: u32) -> Self {
        ResponseHeader { op: op as u8, status: Status::Ok, msg_len: 0, request_id, count }
    }

    /// A request-level error with its message, ready to write.
    pub fn error(op: u8, request_id: u32, status: Status, msg: &str) -> Vec<u8> {
        let msg = &msg.as_bytes()[..msg.len().min(u16::MAX as usize)];
        let h = ResponseHeader { op, status, msg_len: msg.len() as u16, request_id, count: 0 };
        let mut v = h.encode().to_vec();
        v.extend_from_slice(msg);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip() {
        let r = RequestHeader {
            op: Op::Get,
            flags: FLAG_PIN_LEASE,
            request_id: 77,
            count: 3,
            namespace: NamespaceId([4; 16]),
        };
        assert_eq!(RequestHeader::decode(&r.encode()).unwrap(), r);
        let mut bad = r.encode();
        bad[1] = 0;
        assert!(RequestHeader::decode(&bad).is_err());
        bad = r.encode();
        bad[0] = 9;
        assert!(RequestHeader::decode(&bad).is_err());
        let s = ResponseHeader { op: 1, status: Status::TooLarge, msg_len: 5, request_id: 1, count: 0 };
        assert_eq!(ResponseHeader::decode(&s.encode()).unwrap(), s);
        let hello = Hello::encode(PROTOCOL_VERSION, b"tok");
        let mut fixed = [0u8; HELLO_LEN];
        fixed.copy_from_slice(&hello[..HELLO_LEN]);
        assert_eq!(Hello::decode(&fixed).unwrap(), Hello { version: PROTOCOL_VERSION, token_len: 3 });
        for v in 0..=11u8 {
            assert_eq!(ItemStatus::from_u8(v).unwrap() as u8, v);
        }
        assert!(ItemStatus::from_u8(200).is_err());
    }
}
