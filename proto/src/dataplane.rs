//! The bulk data plane: a framed TCP protocol that moves block payloads. Messages are fixed
//! little-endian headers followed by block frames, so the server can read a payload straight into
//! its destination slab and write a stored one straight from DRAM to the socket.
//!
//! A connection opens with a [`Hello`] (magic, version, optional auth token) answered by a
//! [`HelloReply`]. Then any number of requests follow; the server answers them in order, so a
//! client may pipeline. An answer's header may carry hints in its `flags` byte
//! ([`ANSWER_ALONE`]); a client that knows none ignores them.
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
//! # Remote leases (one-sided writes and reads of the node's DRAM arena)
//!
//! On a node whose DRAM arena is registered with a one-sided fabric (RDMA verbs; see the
//! server's `fabric` module), a peer can move payloads without the node's CPU touching them
//! (Mooncake's PutStart / PutEnd). Every lease belongs to the connection that took it and ends
//! with it, or at the node's `lease_timeout`. A node without a fabric answers `CONNECT`,
//! `LEASE_PUT`, `COMMIT` and `LEASE_GET` with a request-level `BadRequest` saying so (and
//! `END_GET` with `NoLease` for each id: there is none).
//!
//! - `CONNECT`: [`RequestHeader`] with `count` bytes of the peer's fabric endpoint after it (an
//!   RDMA queue pair's, at most [`MAX_ENDPOINT_LEN`]). Answer: [`ResponseHeader`] whose `count` is
//!   the length of the node's endpoint, then those bytes. Once per connection, before any lease;
//!   the node's endpoint lives as long as the connection. The arena is registered once, so a
//!   connected peer's NIC reaches all of it: only the operator may connect (`Forbidden`
//!   otherwise). An endpoint over [`MAX_ENDPOINT_LEN`] is `TooLarge` and ends the connection.
//! - `LEASE_PUT`: [`RequestHeader`] with `count` 128-byte frame headers after it (no payloads;
//!   each header's checksum is the payload's to come). Answer: [`ResponseHeader`], then per item
//!   an [`ItemStatus`] byte followed — when `Ok` — by a [`LeaseGrant`] (the lease id and the
//!   [`SlotDescriptor`] of exactly `payload_len` bytes to write). `Present`: already held, write
//!   nothing. Any other status: refused, as a `PUT` would refuse it.
//! - `COMMIT`: [`RequestHeader`] with `count` lease ids (`u64` each) after it. The node hashes
//!   each leased slot and publishes the block when it matches the header's checksum. Answer:
//!   [`ResponseHeader`] then one status per id: `Ok`, `ChecksumMismatch` (nothing stored, the
//!   lease ended), [`ItemStatus::NoLease`] (no such lease on this connection, or at its
//!   deadline), `Capacity` or `Internal` (the node's tier failed it).
//! - `LEASE_GET`: [`RequestHeader`] (namespace set) with `count` keys after it (a `GET`'s, with
//!   [`FLAG_STOP_AT_MISS`] allowed). Answer: [`ResponseHeader`], then per key a status byte
//!   followed — when `Ok` — by the stored frame's header and a [`LeaseGrant`] of its payload,
//!   which stays where it is until `END_GET`, the lease's deadline or the connection's end.
//!   [`ItemStatus::Elsewhere`]: held, but not in the registered arena (on disk, in a peer or the
//!   agent): load it with `GET`. The reader checks what it read against the header's checksum,
//!   as for a `GET` (a lease that ended before its read finished is a mismatch, never data).
//! - `END_GET`: [`RequestHeader`] with `count` lease ids after it; ends those read leases.
//!   Answer: [`ResponseHeader`] then one status per id (`Ok`, or `NoLease`).
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
    /// Remote leases (see the module docs).
    LeasePut = 5,
    Commit = 6,
    LeaseGet = 7,
    EndGet = 8,
    Connect = 9,
}

impl Op {
    pub fn from_u8(v: u8) -> Result<Self, ProtoError> {
        match v {
            1 => Ok(Op::Put),
            2 => Ok(Op::Get),
            3 => Ok(Op::Release),
            4 => Ok(Op::Exists),
            5 => Ok(Op::LeasePut),
            6 => Ok(Op::Commit),
            7 => Ok(Op::LeaseGet),
            8 => Ok(Op::EndGet),
            9 => Ok(Op::Connect),
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
    /// Hello only, sent by the server before it closes a connection over its limits
    /// (`max_connections_per_peer`): the message says which.
    TooManyConnections = 8,
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
            8 => Status::TooManyConnections,
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
    /// No room: nothing evictable frees enough (pinned or leased blocks, the tenant's share, the
    /// lease budget, `max_pinned_ratio`), or the block is larger than the tier.
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
    /// Remote leases: no such lease on this connection (never granted, already ended, or a read
    /// lease past its deadline).
    NoLease = 13,
    /// Remote leases: the block is held, but not in memory a one-sided read can reach (on disk,
    /// in a peer, in the agent's HBM); load it with `GET`.
    Elsewhere = 14,
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
            13 => ItemStatus::NoLease,
            14 => ItemStatus::Elsewhere,
            other => return Err(ProtoError::Malformed(format!("unknown item status {other}"))),
        })
    }

    /// Whether the server holds the block after a `PUT` (stored now, or already there).
    pub fn is_held(self) -> bool {
        matches!(self, ItemStatus::Ok | ItemStatus::Present)
    }

    /// The stable code of a refusal (as a gRPC error's, [`crate::codes`]), for a caller to act on
    /// without parsing [`Self::describe`]; `None` for the answers that are no refusal (`Ok`,
    /// `Present`, `Miss`).
    pub fn code(self) -> Option<&'static str> {
        use crate::codes;
        Some(match self {
            ItemStatus::Ok | ItemStatus::Present | ItemStatus::Miss => return None,
            ItemStatus::ChecksumMismatch => codes::BLOCK_CHECKSUM,
            ItemStatus::SizeMismatch | ItemStatus::LayoutMismatch | ItemStatus::BadHeader | ItemStatus::LossyCodec => {
                codes::BLOCK_INVALID
            }
            ItemStatus::UnknownNamespace => codes::UNKNOWN_NAMESPACE,
            ItemStatus::Capacity => codes::CAPACITY,
            ItemStatus::Internal => codes::INTERNAL,
            ItemStatus::OutOfRange => codes::BLOCK_OUT_OF_RANGE,
            ItemStatus::Forbidden => codes::FORBIDDEN,
            ItemStatus::NoLease => codes::LEASE,
            ItemStatus::Elsewhere => codes::BLOCK_ELSEWHERE,
        })
    }

    /// What the status means, in words (after [`Self::code`] where it has one).
    pub fn describe(self) -> &'static str {
        match self {
            ItemStatus::Ok => "ok",
            ItemStatus::Miss => "miss",
            ItemStatus::ChecksumMismatch => "checksum mismatch",
            ItemStatus::SizeMismatch => "payload size does not match the layout",
            ItemStatus::UnknownNamespace => "unknown namespace",
            ItemStatus::Capacity => "no capacity: no room could be made for it (the DRAM tier, or the tenant's dram_bytes share of it, holds only pinned or leased blocks; the bytes leased to connections are at their limit; or pinning it would pass max_pinned_ratio of dram_capacity), or it is larger than the tier",
            ItemStatus::LayoutMismatch => "frame layout differs from the namespace layout",
            ItemStatus::BadHeader => "bad frame header",
            ItemStatus::Internal => "internal error",
            ItemStatus::LossyCodec => "a quantizing codec in a lossless namespace",
            ItemStatus::Present => "already present",
            ItemStatus::OutOfRange => "offset and length outside the registered buffer (or the item's room)",
            ItemStatus::Forbidden => "forbidden: this tenant may not do this to another tenant's namespace (a read grant allows reads only)",
            ItemStatus::NoLease => "no such lease on this connection (never granted, ended, or past its deadline)",
            ItemStatus::Elsewhere => "held outside the registered arena (disk, peer or agent): load it with GET",
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

/// [`ResponseHeader::flags`]: as the answered request started, its connection had the node to
/// itself (no other data-plane connection serving a request, or having started one within
/// 500 µs), and it stays on the server's host, whose congestion control paces. A client on that
/// host may run its end of the connection unpaced for its next requests, as the server runs its
/// own ([`crate::tcp::PaceSwitch`]). Servers before it send 0 in that byte.
pub const ANSWER_ALONE: u8 = 1;

/// Starts every response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResponseHeader {
    pub op: u8,
    pub status: Status,
    pub msg_len: u16,
    pub request_id: u32,
    pub count: u32,
    /// Byte 12: hints to the client ([`ANSWER_ALONE`]); 0 from servers before them, and the
    /// rest of the header's 16 bytes stays 0.
    pub flags: u8,
}

impl ResponseHeader {
    pub fn encode(&self) -> [u8; RESPONSE_HEADER_LEN] {
        let mut b = [0u8; RESPONSE_HEADER_LEN];
        b[0] = self.op;
        b[1] = self.status as u8;
        b[2..4].copy_from_slice(&self.msg_len.to_le_bytes());
        b[4..8].copy_from_slice(&self.request_id.to_le_bytes());
        b[8..12].copy_from_slice(&self.count.to_le_bytes());
        b[12] = self.flags;
        b
    }

    pub fn decode(b: &[u8; RESPONSE_HEADER_LEN]) -> Result<Self, ProtoError> {
        Ok(ResponseHeader {
            op: b[0],
            status: Status::from_u8(b[1])?,
            msg_len: u16::from_le_bytes([b[2], b[3]]),
            request_id: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
            count: u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
            flags: b[12],
        })
    }

    /// A successful answer to request `request_id` of `count` items (their statuses follow).
    pub fn ok(op: Op, request_id: u32, count: u32) -> Self {
        ResponseHeader { op: op as u8, status: Status::Ok, msg_len: 0, request_id, count, flags: 0 }
    }

    /// This answer with [`ANSWER_ALONE`] set if `alone`.
    pub fn alone(mut self, alone: bool) -> Self {
        if alone {
            self.flags |= ANSWER_ALONE;
        }
        self
    }

    /// A request-level error with its message, ready to write.
    pub fn error(op: u8, request_id: u32, status: Status, msg: &str) -> Vec<u8> {
        let msg = &msg.as_bytes()[..msg.len().min(u16::MAX as usize)];
        let h = ResponseHeader { op, status, msg_len: msg.len() as u16, request_id, count: 0, flags: 0 };
        let mut v = h.encode().to_vec();
        v.extend_from_slice(msg);
        v
    }
}

/// Magic of an encoded [`SlotDescriptor`].
const SLOT_MAGIC: [u8; 4] = *b"KVS1";
/// Bytes of an encoded [`SlotDescriptor`].
pub const SLOT_DESCRIPTOR_LEN: usize = 24;
/// Bytes of an encoded [`LeaseGrant`].
pub const LEASE_GRANT_LEN: usize = 8 + SLOT_DESCRIPTOR_LEN;
/// Longest fabric endpoint a `CONNECT` may carry.
pub const MAX_ENDPOINT_LEN: usize = 256;
/// Bytes of a lease id in `COMMIT` and `END_GET`.
pub const LEASE_ID_LEN: usize = 8;

/// A leased slot of a node's registered memory, as the node describes it: the remote virtual
/// address of its first byte, the remote key of the registration holding it, and its length.
///
/// ```
/// use kvtier_proto::dataplane::SlotDescriptor;
/// let slot = SlotDescriptor { addr: 0x7f00_0000_1000, rkey: 0x1234, len: 4096 };
/// assert_eq!(SlotDescriptor::decode(&slot.encode()).unwrap(), slot);
/// assert!(slot.window(4000, 200).is_none());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotDescriptor {
    pub addr: u64,
    pub rkey: u32,
    pub len: u64,
}

impl SlotDescriptor {
    /// Little-endian: magic `KVS1`, rkey (u32), addr (u64), len (u64).
    pub fn encode(&self) -> [u8; SLOT_DESCRIPTOR_LEN] {
        let mut b = [0u8; SLOT_DESCRIPTOR_LEN];
        b[0..4].copy_from_slice(&SLOT_MAGIC);
        b[4..8].copy_from_slice(&self.rkey.to_le_bytes());
        b[8..16].copy_from_slice(&self.addr.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes and checks a descriptor from a peer: exact length, magic, and an address range
    /// that does not wrap.
    pub fn decode(bytes: &[u8]) -> Result<Self, ProtoError> {
        if bytes.len() != SLOT_DESCRIPTOR_LEN {
            return Err(ProtoError::Malformed(format!(
                "slot descriptor is {} bytes, {SLOT_DESCRIPTOR_LEN} expected",
                bytes.len()
            )));
        }
        if bytes[0..4] != SLOT_MAGIC {
            return Err(ProtoError::Malformed(format!("bad slot descriptor magic {:02x?}", &bytes[0..4])));
        }
        let word = |r: std::ops::Range<usize>| {
            let mut w = [0u8; 8];
            w[..r.len()].copy_from_slice(&bytes[r]);
            u64::from_le_bytes(w)
        };
        let d = SlotDescriptor { rkey: word(4..8) as u32, addr: word(8..16), len: word(16..24) };
        if d.addr.checked_add(d.len).is_none() {
            return Err(ProtoError::Malformed(format!("slot {:#x}+{} wraps the address space", d.addr, d.len)));
        }
        Ok(d)
    }

    /// The part `offset..offset + len` of the slot; `None` when it leaves the slot.
    pub fn window(&self, offset: u64, len: u64) -> Option<SlotDescriptor> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Some(SlotDescriptor { addr: self.addr + offset, rkey: self.rkey, len }),
            _ => None,
        }
    }
}

/// What a `LEASE_PUT` or `LEASE_GET` grants per item: the lease's id on this connection and the
/// slot it covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseGrant {
    pub lease: u64,
    pub slot: SlotDescriptor,
}

impl LeaseGrant {
    /// Bytes of an encoded grant.
    pub const LEN: usize = LEASE_GRANT_LEN;

    /// Little-endian: lease id (u64), then the [`SlotDescriptor`].
    pub fn encode(&self) -> [u8; LEASE_GRANT_LEN] {
        let mut b = [0u8; LEASE_GRANT_LEN];
        b[..8].copy_from_slice(&self.lease.to_le_bytes());
        b[8..].copy_from_slice(&self.slot.encode());
        b
    }

    pub fn decode(b: &[u8; LEASE_GRANT_LEN]) -> Result<Self, ProtoError> {
        let mut id = [0u8; 8];
        id.copy_from_slice(&b[..8]);
        Ok(LeaseGrant { lease: u64::from_le_bytes(id), slot: SlotDescriptor::decode(&b[8..])? })
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
        bad[0] = 200;
        assert!(RequestHeader::decode(&bad).is_err());
        let s = ResponseHeader {
            op: 1,
            status: Status::TooLarge,
            msg_len: 5,
            request_id: 1,
            count: 0,
            flags: ANSWER_ALONE,
        };
        assert_eq!(ResponseHeader::decode(&s.encode()).unwrap(), s);
        let hello = Hello::encode(PROTOCOL_VERSION, b"tok");
        let mut fixed = [0u8; HELLO_LEN];
        fixed.copy_from_slice(&hello[..HELLO_LEN]);
        assert_eq!(Hello::decode(&fixed).unwrap(), Hello { version: PROTOCOL_VERSION, token_len: 3 });
        for v in 0..=14u8 {
            assert_eq!(ItemStatus::from_u8(v).unwrap() as u8, v);
        }
        assert!(ItemStatus::from_u8(15).is_err());
        for v in 1..=9u8 {
            assert_eq!(Op::from_u8(v).unwrap() as u8, v);
        }
        assert!(Op::from_u8(10).is_err());
    }

    #[test]
    fn slot_descriptors_and_grants_round_trip_and_refuse_garbage() {
        for d in [
            SlotDescriptor { addr: 0, rkey: 0, len: 0 },
            SlotDescriptor { addr: 0x7fff_dead_b000, rkey: u32::MAX, len: 1 << 30 },
            SlotDescriptor { addr: u64::MAX - 10, rkey: 7, len: 10 },
        ] {
            let e = d.encode();
            assert_eq!(&e[..4], b"KVS1");
            assert_eq!(SlotDescriptor::decode(&e).unwrap(), d);
            let g = LeaseGrant { lease: 0xfeed_0000_0001, slot: d };
            assert_eq!(LeaseGrant::decode(&g.encode()).unwrap(), g);
        }
        let good = SlotDescriptor { addr: 4096, rkey: 9, len: 64 }.encode();
        assert!(SlotDescriptor::decode(&good[..23]).is_err());
        let mut long = good.to_vec();
        long.push(0);
        assert!(SlotDescriptor::decode(&long).is_err());
        let mut magic = good;
        magic[0] = b'X';
        assert!(matches!(SlotDescriptor::decode(&magic), Err(ProtoError::Malformed(m)) if m.contains("magic")));
        let wraps = SlotDescriptor { addr: u64::MAX - 10, rkey: 7, len: 11 }.encode();
        assert!(matches!(SlotDescriptor::decode(&wraps), Err(ProtoError::Malformed(m)) if m.contains("wraps")));
        let mut grant = LeaseGrant { lease: 1, slot: SlotDescriptor { addr: 1, rkey: 1, len: 1 } }.encode();
        grant[8] = 0;
        assert!(LeaseGrant::decode(&grant).is_err());
    }

    #[test]
    fn windows_stay_inside_the_slot() {
        let s = SlotDescriptor { addr: 1000, rkey: 3, len: 100 };
        assert_eq!(s.window(0, 100), Some(s));
        assert_eq!(s.window(40, 60), Some(SlotDescriptor { addr: 1040, rkey: 3, len: 60 }));
        assert_eq!(s.window(100, 0).unwrap().len, 0);
        for (off, len) in [(0, 101), (1, 100), (101, 0), (u64::MAX, 2), (50, u64::MAX)] {
            assert_eq!(s.window(off, len), None, "{off}+{len}");
        }
    }
}
