//! The same-node protocol: a client on the server's host registers buffers of its own shared
//! memory (memfds passed with `SCM_RIGHTS` over a Unix socket) and then asks for blocks by
//! (key → offset in my buffer). Payloads never cross the socket: the server copies a verified
//! block from its slot into the client's buffer (load), or from the client's buffer into a slot,
//! verifying its own copy before publishing it (store). Only fixed little-endian headers, keys,
//! offsets and statuses go over the socket. I/O-free, like [`crate::dataplane`].
//!
//! Why a protocol of its own rather than more data-plane ops: registration carries a file
//! descriptor, which needs `recvmsg` on the raw socket, and a payload-free request/response shape
//! has nothing in common with the data plane's frame streaming; the data plane's ops stay
//! available over a Unix socket through `dataplane::serve_unix`.
//!
//! A connection opens with a hello ([`encode_hello`]: magic `KVSN`, version, token) answered by
//! a data-plane [`HelloReply`](crate::dataplane::HelloReply). Then requests, answered in order,
//! each a [`SnRequest`] (32 bytes) and a body:
//!
//! - `REGISTER`: body = the buffer's claimed length (`u64`). The request's first byte carries one
//!   file descriptor (`SCM_RIGHTS`). Answer: a [`ResponseHeader`] whose `count` is the new
//!   buffer id, or a request-level error (not a memfd sealed against shrinking, smaller than
//!   claimed, too many buffers).
//! - `UNREGISTER`: `buffer` names the buffer; the server unmaps it. Answer: a [`ResponseHeader`].
//! - `LOAD`: `namespace`, `buffer`, `count` [`LoadItem`]s (key, offset, room). Answer: a
//!   [`ResponseHeader`], `count` [`ItemStatus`] bytes, then one 128-byte frame header per `Ok`
//!   item, in order (the block's codec and length; its payload is at the item's offset). With
//!   [`FLAG_STOP_AT_MISS`] every item after the first one not delivered is a `Miss`, unlooked;
//!   the server checks every block it hands over against its checksum exactly once (a DRAM
//!   block as it copies it), whatever the flags say.
//! - `STORE`: `buffer`, `count` [`StoreItem`]s (frame header, offset of its payload). Answer: a
//!   [`ResponseHeader`] and `count` [`ItemStatus`] bytes (`Ok`, `Present` already held, or why
//!   refused).
//! - `LOAD_SEGMENTS` / `STORE_SEGMENTS` (protocol 2; a connection whose hello said 1 is ended
//!   with `BadRequest` when it sends one): as `LOAD` / `STORE`, for blocks whose bytes lie in
//!   several places of the buffer (an engine's page split into K and V halves, or into one piece
//!   per layer: SGLang's host pool). The items are `LOAD`'s and `STORE`'s, each `offset` field
//!   holding the number of the item's [`Segment`]s (a `LOAD_SEGMENTS` item's `room` is ignored), and
//!   after them the segment table: every item's segments in order, 16 bytes each (offset,
//!   length). A block fills its segments in order (a load's payload may end before the last
//!   segment does; a store's payload is exactly its segments). At most
//!   [`MAX_SEGMENTS_PER_ITEM`] per item and [`MAX_SEGMENTS_PER_REQUEST`] per request (past
//!   them the request is answered `BadRequest` and the connection ends, its table unread).
//!   Answers as `LOAD`'s and `STORE`'s, with their own op byte.
//! - Checksums after (protocol 3): a `STORE` or `STORE_SEGMENTS` with [`FLAG_CHECKSUMS_AFTER`]
//!   ignores its items' header checksums; after the request (items, then any segment table) come
//!   `count` checksums, 8 bytes each ([`encode_checksums`]), which the client may send while the
//!   server copies. The server copies every item into a slot of its own hashing the copy, then
//!   reads the checksums, and publishes an item only if its copy's hash is the item's checksum
//!   (`ChecksumMismatch` otherwise). The client hashes its blocks while the server copies them,
//!   instead of before it sends the request. Sent on an older connection, or on another op, the
//!   flag ends the connection with `BadRequest` (what follows the request can't be known).
//!
//! A request-level error is a [`ResponseHeader`] with a non-zero status and a message; since
//! every body has a length known from its header, the connection keeps serving after one.

pub use crate::dataplane::{ItemStatus, ResponseHeader, Status, FLAG_STOP_AT_MISS, RESPONSE_HEADER_LEN};
use crate::{BlockKey, FrameHeader, NamespaceId, ProtoError, FRAME_HEADER_LEN, KEY_LEN, NAMESPACE_ID_LEN};

pub const HELLO_MAGIC: [u8; 4] = *b"KVSN";
/// The version a client says in its hello. 2 added `LOAD_SEGMENTS` / `STORE_SEGMENTS`, 3
/// [`FLAG_CHECKSUMS_AFTER`].
pub const PROTOCOL_VERSION: u16 = 3;
/// The oldest version a server still accepts: a version-1 connection gets every op but the
/// segmented ones.
pub const MIN_PROTOCOL_VERSION: u16 = 1;
/// The first version with the segmented ops.
pub const SEGMENTS_SINCE_VERSION: u16 = 2;
/// The first version with [`FLAG_CHECKSUMS_AFTER`].
pub const CHECKSUMS_AFTER_SINCE_VERSION: u16 = 3;
/// `STORE` / `STORE_SEGMENTS` flag: the items' checksums follow the request (see the module docs).
pub const FLAG_CHECKSUMS_AFTER: u16 = 16;
/// Bytes of one checksum after a [`FLAG_CHECKSUMS_AFTER`] request.
pub const CHECKSUM_LEN: usize = 8;
pub const HELLO_LEN: usize = 8;
pub const REQUEST_LEN: usize = 32;
/// Bytes of a `REGISTER` body.
pub const REGISTER_BODY_LEN: usize = 8;
pub const LOAD_ITEM_LEN: usize = KEY_LEN + 16;
pub const STORE_ITEM_LEN: usize = FRAME_HEADER_LEN + 8;
const MARKER: u8 = 0x5A;
/// `LOAD` flag sent by older clients to ask for a checked copy. Ignored: every block is now
/// checked once whatever the flags (a block damaged in the server's memory is `ChecksumMismatch`).
pub const FLAG_VERIFY: u16 = 8;

/// The hello's fixed part and the token after it.
pub fn encode_hello(token: &[u8]) -> Vec<u8> {
    encode_hello_version(PROTOCOL_VERSION, token)
}

/// [`encode_hello`] saying `version` (a client asking an older server again).
pub fn encode_hello_version(version: u16, token: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(HELLO_LEN + token.len());
    v.extend_from_slice(&HELLO_MAGIC);
    v.extend_from_slice(&version.to_le_bytes());
    v.extend_from_slice(&(token.len().min(u16::MAX as usize) as u16).to_le_bytes());
    v.extend_from_slice(&token[..token.len().min(u16::MAX as usize)]);
    v
}

/// Version and token length of a hello's fixed part.
pub fn decode_hello(b: &[u8; HELLO_LEN]) -> Result<(u16, u16), ProtoError> {
    if b[0..4] != HELLO_MAGIC {
        return Err(ProtoError::Malformed("not a kvtier same-node connection (bad hello magic)".into()));
    }
    let token_len = u16::from_le_bytes([b[6], b[7]]);
    if token_len as usize > crate::dataplane::MAX_TOKEN_LEN {
        return Err(ProtoError::Malformed(format!("auth token of {token_len} bytes is too long")));
    }
    Ok((u16::from_le_bytes([b[4], b[5]]), token_len))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum SnOp {
    Register = 16,
    Unregister = 17,
    Load = 18,
    Store = 19,
    LoadSegments = 20,
    StoreSegments = 21,
}

impl SnOp {
    pub fn from_u8(v: u8) -> Result<Self, ProtoError> {
        Ok(match v {
            16 => SnOp::Register,
            17 => SnOp::Unregister,
            18 => SnOp::Load,
            19 => SnOp::Store,
            20 => SnOp::LoadSegments,
            21 => SnOp::StoreSegments,
            other => return Err(ProtoError::Malformed(format!("unknown same-node op {other}"))),
        })
    }

    /// Bytes of body after the header of a request with `count` items (for the segmented ops,
    /// the items; their segment table follows, [`segment_table_len`]).
    pub fn body_len(self, count: u32) -> usize {
        match self {
            SnOp::Register => REGISTER_BODY_LEN,
            SnOp::Unregister => 0,
            SnOp::Load | SnOp::LoadSegments => count as usize * LOAD_ITEM_LEN,
            SnOp::Store | SnOp::StoreSegments => count as usize * STORE_ITEM_LEN,
        }
    }

    /// Whether the items are followed by a segment table.
    pub fn is_segmented(self) -> bool {
        matches!(self, SnOp::LoadSegments | SnOp::StoreSegments)
    }

    /// The load or store op that moves blocks in one piece each.
    pub fn unsegmented(self) -> SnOp {
        match self {
            SnOp::LoadSegments => SnOp::Load,
            SnOp::StoreSegments => SnOp::Store,
            other => other,
        }
    }
}

/// The checksums that follow a [`FLAG_CHECKSUMS_AFTER`] request, in item order.
pub fn encode_checksums(sums: &[u64]) -> Vec<u8> {
    sums.iter().flat_map(|c| c.to_le_bytes()).collect()
}

/// The checksums `b` holds (a whole number of them).
pub fn decode_checksums(b: &[u8]) -> Result<Vec<u64>, ProtoError> {
    if !b.len().is_multiple_of(CHECKSUM_LEN) {
        return Err(ProtoError::Malformed(format!("{} bytes of checksums", b.len())));
    }
    Ok(b.chunks_exact(CHECKSUM_LEN).map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect())
}

/// Bytes of one [`Segment`] in a segment table.
pub const SEGMENT_LEN: usize = 16;
/// Most segments one block of a segmented request may have (SGLang's `layer_first` pages have
/// two per layer).
pub const MAX_SEGMENTS_PER_ITEM: u64 = 1024;
/// Most segments in one request (a table of 1 MiB).
pub const MAX_SEGMENTS_PER_REQUEST: usize = 65536;

/// One piece of a block in a registered buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub offset: u64,
    pub len: u64,
}

impl Segment {
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
    }

    /// The segment table `b` (a whole number of segments).
    pub fn decode_table(b: &[u8]) -> Result<Vec<Segment>, ProtoError> {
        if !b.len().is_multiple_of(SEGMENT_LEN) {
            return Err(ProtoError::Malformed(format!("a segment table of {} bytes", b.len())));
        }
        Ok(b.chunks_exact(SEGMENT_LEN)
            .map(|c| {
                let (o, l) = c.split_at(8);
                let u = |x: &[u8]| u64::from_le_bytes(x.try_into().unwrap_or([0; 8]));
                Segment { offset: u(o), len: u(l) }
            })
            .collect())
    }
}

/// The number of segments of each item of a segmented request's `items` (its body before the
/// table), and the table's length in bytes; an error past the limits (the request can't be
/// served, and its table is not read).
pub fn segment_counts(op: SnOp, items: &[u8]) -> Result<(Vec<u32>, usize), ProtoError> {
    let (item_len, at) = match op {
        SnOp::LoadSegments => (LOAD_ITEM_LEN, KEY_LEN),
        SnOp::StoreSegments => (STORE_ITEM_LEN, FRAME_HEADER_LEN),
        other => return Err(ProtoError::Malformed(format!("{other:?} has no segment table"))),
    };
    let mut counts = Vec::with_capacity(items.len() / item_len);
    let mut total = 0usize;
    for (i, item) in items.chunks_exact(item_len).enumerate() {
        let n = u64::from_le_bytes(item[at..at + 8].try_into().unwrap_or([0; 8]));
        if n == 0 || n > MAX_SEGMENTS_PER_ITEM {
            return Err(ProtoError::Malformed(format!(
                "item {i} has {n} segments; a block has 1 to {MAX_SEGMENTS_PER_ITEM}"
            )));
        }
        total += n as usize;
        if total > MAX_SEGMENTS_PER_REQUEST {
            return Err(ProtoError::Malformed(format!("more than {MAX_SEGMENTS_PER_REQUEST} segments in one request")));
        }
        counts.push(n as u32);
    }
    Ok((counts, total * SEGMENT_LEN))
}

/// Starts every same-node request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnRequest {
    pub op: SnOp,
    /// Bit set of `FLAG_*` ([`FLAG_STOP_AT_MISS`] for `LOAD`).
    pub flags: u16,
    pub request_id: u32,
    /// Items in the body (`LOAD`, `STORE`).
    pub count: u32,
    /// The registered buffer the items' offsets point into (`LOAD`, `STORE`, `UNREGISTER`).
    pub buffer: u32,
    /// The namespace of a `LOAD` (a `STORE`'s frame headers name their own).
    pub namespace: NamespaceId,
}

impl SnRequest {
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        b[0] = self.op as u8;
        b[1] = MARKER;
        b[2..4].copy_from_slice(&self.flags.to_le_bytes());
        b[4..8].copy_from_slice(&self.request_id.to_le_bytes());
        b[8..12].copy_from_slice(&self.count.to_le_bytes());
        b[12..16].copy_from_slice(&self.buffer.to_le_bytes());
        b[16..16 + NAMESPACE_ID_LEN].copy_from_slice(&self.namespace.0);
        b
    }

    pub fn decode(b: &[u8; REQUEST_LEN]) -> Result<Self, ProtoError> {
        if b[1] != MARKER {
            return Err(ProtoError::Malformed("same-node request marker missing (stream out of sync?)".into()));
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut ns = [0u8; NAMESPACE_ID_LEN];
        ns.copy_from_slice(&b[16..32]);
        Ok(SnRequest {
            op: SnOp::from_u8(b[0])?,
            flags: u16::from_le_bytes([b[2], b[3]]),
            request_id: u32_at(4),
            count: u32_at(8),
            buffer: u32_at(12),
            namespace: NamespaceId(ns),
        })
    }
}

/// One block of a `LOAD`: where in the buffer it goes and how many bytes it may take there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadItem {
    pub key: BlockKey,
    pub offset: u64,
    pub room: u64,
}

impl LoadItem {
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.key.0);
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.room.to_le_bytes());
    }

    pub fn decode(b: &[u8]) -> Result<Self, ProtoError> {
        if b.len() != LOAD_ITEM_LEN {
            return Err(ProtoError::Malformed(format!("a load item is {LOAD_ITEM_LEN} bytes, got {}", b.len())));
        }
        let mut key = [0u8; KEY_LEN];
        key.copy_from_slice(&b[..KEY_LEN]);
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        Ok(LoadItem { key: BlockKey(key), offset: u64_at(KEY_LEN), room: u64_at(KEY_LEN + 8) })
    }
}

/// One block of a `STORE`: its frame header (checksum included) and where its payload is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreItem {
    pub header: FrameHeader,
    pub offset: u64,
}

impl StoreItem {
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.header.encode());
        out.extend_from_slice(&self.offset.to_le_bytes());
    }

    /// The raw header bytes (decoded by the server, so that one bad header is one bad item) and
    /// the offset.
    pub fn split(b: &[u8]) -> Result<(&[u8; FRAME_HEADER_LEN], u64), ProtoError> {
        if b.len() != STORE_ITEM_LEN {
            return Err(ProtoError::Malformed(format!("a store item is {STORE_ITEM_LEN} bytes, got {}", b.len())));
        }
        let (h, o) = b.split_at(FRAME_HEADER_LEN);
        let h: &[u8; FRAME_HEADER_LEN] = h.try_into().map_err(|_| ProtoError::Malformed("store item header".into()))?;
        let mut x = [0u8; 8];
        x.copy_from_slice(o);
        Ok((h, u64::from_le_bytes(x)))
    }
}

/// A successful answer to a same-node request.
pub fn ok(op: SnOp, request_id: u32, count: u32) -> ResponseHeader {
    ResponseHeader { op: op as u8, status: Status::Ok, msg_len: 0, request_id, count, flags: 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_round_trip_and_a_partial_one_is_refused() {
        let sums = [0, 1, u64::MAX, 0x0123_4567_89ab_cdef];
        let b = encode_checksums(&sums);
        assert_eq!(b.len(), sums.len() * CHECKSUM_LEN);
        assert_eq!(decode_checksums(&b).unwrap(), sums);
        assert!(decode_checksums(&b[..7]).is_err());
    }

    #[test]
    fn requests_and_items_round_trip() {
        let r = SnRequest {
            op: SnOp::Load,
            flags: FLAG_STOP_AT_MISS,
            request_id: 9,
            count: 2,
            buffer: 7,
            namespace: NamespaceId([3; 16]),
        };
        assert_eq!(SnRequest::decode(&r.encode()).unwrap(), r);
        let mut bad = r.encode();
        bad[1] = 0;
        assert!(SnRequest::decode(&bad).is_err());
        bad = r.encode();
        bad[0] = 2;
        assert!(SnRequest::decode(&bad).is_err(), "a data-plane op is not a same-node op");
        let item = LoadItem { key: BlockKey([5; 32]), offset: 1 << 40, room: 4096 };
        let mut v = Vec::new();
        item.encode_into(&mut v);
        assert_eq!(v.len(), SnOp::Load.body_len(1));
        assert_eq!(LoadItem::decode(&v).unwrap(), item);
        assert!(LoadItem::decode(&v[1..]).is_err());
        let (ver, tl) = decode_hello(encode_hello(b"tok")[..HELLO_LEN].try_into().unwrap()).unwrap();
        assert_eq!((ver, tl), (PROTOCOL_VERSION, 3));
        assert!(decode_hello(b"KVDP\x01\x00\x00\x00").is_err(), "a data-plane hello is refused");
    }

    #[test]
    fn segment_tables_are_counted_and_bounded() {
        let mut items = Vec::new();
        for n in [2u64, 3] {
            LoadItem { key: BlockKey([1; 32]), offset: n, room: 0 }.encode_into(&mut items);
        }
        let (counts, len) = segment_counts(SnOp::LoadSegments, &items).unwrap();
        assert_eq!((counts, len), (vec![2, 3], 5 * SEGMENT_LEN));
        let mut table = Vec::new();
        let segs = [Segment { offset: 1 << 33, len: 7 }, Segment { offset: 0, len: u64::MAX }];
        segs.iter().for_each(|s| s.encode_into(&mut table));
        assert_eq!(Segment::decode_table(&table).unwrap(), segs);
        assert!(Segment::decode_table(&table[1..]).is_err());
        let mut zero = Vec::new();
        LoadItem { key: BlockKey([1; 32]), offset: 0, room: 0 }.encode_into(&mut zero);
        assert!(segment_counts(SnOp::LoadSegments, &zero).is_err(), "a block in no segment");
        let mut many = Vec::new();
        LoadItem { key: BlockKey([1; 32]), offset: MAX_SEGMENTS_PER_ITEM + 1, room: 0 }.encode_into(&mut many);
        assert!(segment_counts(SnOp::LoadSegments, &many).is_err());
        let mut total = Vec::new();
        for _ in 0..=MAX_SEGMENTS_PER_REQUEST / MAX_SEGMENTS_PER_ITEM as usize {
            LoadItem { key: BlockKey([1; 32]), offset: MAX_SEGMENTS_PER_ITEM, room: 0 }.encode_into(&mut total);
        }
        assert!(segment_counts(SnOp::LoadSegments, &total).is_err(), "over the per-request cap");
        assert!(segment_counts(SnOp::Load, &items).is_err());
    }
}
