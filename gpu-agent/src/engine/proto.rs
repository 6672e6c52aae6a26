//! The engine socket's wire format, without I/O: an engine on the same node (or its stand-in)
//! opens a namespace, registers its KV buffer (a sealed memfd on the host backend, a CUDA IPC
//! handle on a GPU), saves pages layer by layer under block keys and loads keys into pages with
//! one completion per layer — the shape of vLLM's `save_kv_layer` / `wait_for_save` and
//! `start_load_kv` / `wait_for_layer_load`. A key on this socket is the engine's own 32-byte
//! block hash: the agent salts it into the open namespace (`BlockKey::opaque`) as the client's
//! engine-key calls do, so a block saved here is found through the client under the same hash.
//!
//! Every message, both ways, is a 12-byte header then a body; integers little-endian:
//!
//! ```text
//! header   u32 body_len | u8 op | u8 status (answers; 0 in requests) | u16 aux | u32 request_id
//! OPEN     u16 n, tenant | u16 n, model | u16 layers | u16 kv_heads | u16 head_dim | u8 dtype
//!          | u8 hashing | u32 block_tokens | u16 n, salt
//!   answer u64 block_bytes | u32 layers | 16 bytes namespace id
//! REGISTER u8 kind (0 memfd, attached with SCM_RIGHTS; 1 CUDA IPC) | 3 bytes 0 | u64 len
//!          | u32 pages | 64 bytes IPC handle (kind 1; zeros otherwise)
//!   answer u32 buffer id. The buffer holds `[layer][page][layer_bytes]`,
//!          layer_bytes = block_bytes / layers.
//! SAVE     u32 buffer | u16 layer | u16 0 | u32 n | n × (u32 page | 32 bytes key)
//!   answer u32 copied | u32 committed, once the layer's copies have landed. Layer 0 reserves
//!          the keys' G1 pages, the last layer commits them.
//! LOAD     u32 buffer | u32 n | n × (u32 page | 32 bytes key)
//!   answer u32 found (the leading keys that will land) | u32 from_g1 | u32 from_g2, then one
//!          LAYER frame per layer (aux = layer, status its outcome, empty body) as each lands.
//! UNREGISTER u32 buffer
//! ```
//!
//! An answer whose status is not `Ok` carries a UTF-8 message as its body.

use kvtier_proto::{BlockKey, DType, HashScheme, KvLayout, Namespace, NamespaceId, KEY_LEN};

/// Bytes of every header.
pub const HEADER_LEN: usize = 12;
/// The largest body a request may carry (larger is refused before it is read).
pub const MAX_BODY: usize = 1 << 20;
/// The most items (page, key) in one SAVE or LOAD.
pub const MAX_ITEMS: usize = 4096;
/// The longest tenant, model or salt string.
const MAX_STRING: usize = 1024;
const ITEM_LEN: usize = 4 + KEY_LEN;

/// What a message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    Open = 1,
    Register = 2,
    Save = 3,
    Load = 4,
    /// One layer of a LOAD has landed (answers only).
    Layer = 5,
    Unregister = 6,
}

impl Op {
    pub fn from_u8(v: u8) -> Option<Op> {
        Some(match v {
            1 => Op::Open,
            2 => Op::Register,
            3 => Op::Save,
            4 => Op::Load,
            5 => Op::Layer,
            6 => Op::Unregister,
            _ => return None,
        })
    }
}

/// The outcome of a request (or of one layer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Status {
    Ok = 0,
    /// Malformed, or not allowed in this state (e.g. no OPEN yet).
    BadRequest = 1,
    /// A page or layer past the end of the registered buffer.
    OutOfRange = 2,
    UnknownBuffer = 3,
    /// A SAVE of layer > 0 for a key whose layer 0 was not saved on this connection.
    UnknownKey = 4,
    /// Out of room (every G1 page pinned, a per-connection limit reached): try later or recompute.
    Busy = 5,
    Internal = 6,
    /// Sizes that do not fit: a buffer smaller than its pages, a block size the pool can't hold.
    SizeMismatch = 7,
}

/// A header, either direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub body_len: u32,
    pub op: u8,
    pub status: u8,
    pub aux: u16,
    pub request_id: u32,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&self.body_len.to_le_bytes());
        b[4] = self.op;
        b[5] = self.status;
        b[6..8].copy_from_slice(&self.aux.to_le_bytes());
        b[8..12].copy_from_slice(&self.request_id.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; HEADER_LEN]) -> Header {
        Header {
            body_len: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            op: b[4],
            status: b[5],
            aux: u16::from_le_bytes([b[6], b[7]]),
            request_id: u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
        }
    }
}

/// A request that failed to parse: the status and message to answer with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub status: Status,
    pub message: String,
}

impl Refusal {
    pub fn new(status: Status, message: impl Into<String>) -> Self {
        Refusal { status, message: message.into() }
    }

    fn bad(message: impl Into<String>) -> Self {
        Refusal::new(Status::BadRequest, message)
    }
}

/// Where a registered buffer comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BufferSource {
    /// A memfd sent with the request (`SCM_RIGHTS`).
    Memfd,
    /// A CUDA IPC handle's 64 bytes.
    CudaIpc([u8; 64]),
}

/// One (engine page, block key) pair of a SAVE or LOAD.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Item {
    pub page: u32,
    pub key: BlockKey,
}

/// A parsed request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Open(Namespace),
    Register { source: BufferSource, len: u64, pages: u32 },
    Save { buffer: u32, layer: u16, items: Vec<Item> },
    Load { buffer: u32, items: Vec<Item> },
    Unregister { buffer: u32 },
}

/// Reads a body front to back; every read is bounds-checked.
struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Refusal> {
        if self.b.len() < n {
            return Err(Refusal::bad("request body too short"));
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    fn u8(&mut self) -> Result<u8, Refusal> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, Refusal> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, Refusal> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, Refusal> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    fn string(&mut self, what: &str) -> Result<&'a [u8], Refusal> {
        let n = self.u16()? as usize;
        if n > MAX_STRING {
            return Err(Refusal::bad(format!("{what} longer than {MAX_STRING} bytes")));
        }
        self.take(n)
    }
    fn items(&mut self) -> Result<Vec<Item>, Refusal> {
        let n = self.u32()? as usize;
        if n > MAX_ITEMS {
            return Err(Refusal::bad(format!("{n} items in one request; at most {MAX_ITEMS}")));
        }
        if self.b.len() != n * ITEM_LEN {
            return Err(Refusal::bad(format!("{n} items need {} bytes, the body has {}", n * ITEM_LEN, self.b.len())));
        }
        (0..n)
            .map(|_| {
                let page = self.u32()?;
                let mut key = [0u8; KEY_LEN];
                key.copy_from_slice(self.take(KEY_LEN)?);
                Ok(Item { page, key: BlockKey(key) })
            })
            .collect()
    }
    fn end(&self) -> Result<(), Refusal> {
        match self.b.len() {
            0 => Ok(()),
            n => Err(Refusal::bad(format!("{n} unexpected bytes at the end of the request"))),
        }
    }
}

/// Parses a request's body. Never panics on any bytes.
pub fn decode_request(op: u8, body: &[u8]) -> Result<Request, Refusal> {
    let mut r = Reader { b: body };
    let op = Op::from_u8(op).ok_or_else(|| Refusal::bad(format!("unknown op {op}")))?;
    let req = match op {
        Op::Open => {
            let utf8 = |b: &[u8], what: &str| {
                String::from_utf8(b.to_vec()).map_err(|_| Refusal::bad(format!("{what} is not UTF-8")))
            };
            let tenant = utf8(r.string("tenant")?, "tenant")?;
            let model = utf8(r.string("model")?, "model")?;
            let (layers, kv_heads, head_dim) = (r.u16()?, r.u16()?, r.u16()?);
            let dtype = DType::from_code(u32::from(r.u8()?)).map_err(|e| Refusal::bad(e.to_string()))?;
            let hashing = HashScheme::from_code(u32::from(r.u8()?)).map_err(|e| Refusal::bad(e.to_string()))?;
            let block_tokens = r.u32()?;
            let salt = r.string("salt")?.to_vec();
            let layout = KvLayout::new(layers, kv_heads, head_dim, dtype, block_tokens);
            layout.validate().map_err(|e| Refusal::bad(format!("layout: {e}")))?;
            Request::Open(Namespace::new(tenant, model, layout, hashing, &salt))
        }
        Op::Register => {
            let kind = r.u8()?;
            r.take(3)?;
            let len = r.u64()?;
            let pages = r.u32()?;
            let mut handle = [0u8; 64];
            handle.copy_from_slice(r.take(64)?);
            let source = match kind {
                0 => BufferSource::Memfd,
                1 => BufferSource::CudaIpc(handle),
                k => return Err(Refusal::bad(format!("unknown buffer kind {k}"))),
            };
            Request::Register { source, len, pages }
        }
        Op::Save => {
            let buffer = r.u32()?;
            let layer = r.u16()?;
            r.u16()?;
            Request::Save { buffer, layer, items: r.items()? }
        }
        Op::Load => {
            let buffer = r.u32()?;
            Request::Load { buffer, items: r.items()? }
        }
        Op::Unregister => Request::Unregister { buffer: r.u32()? },
        Op::Layer => return Err(Refusal::bad("LAYER is an answer, not a request")),
    };
    r.end()?;
    Ok(req)
}

fn put_string(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u16).to_le_bytes());
    out.extend_from_slice(s);
}

fn put_items(out: &mut Vec<u8>, items: &[Item]) {
    out.extend_from_slice(&(items.len() as u32).to_le_bytes());
    for it in items {
        out.extend_from_slice(&it.page.to_le_bytes());
        out.extend_from_slice(&it.key.0);
    }
}

impl Request {
    pub fn op(&self) -> Op {
        match self {
            Request::Open(_) => Op::Open,
            Request::Register { .. } => Op::Register,
            Request::Save { .. } => Op::Save,
            Request::Load { .. } => Op::Load,
            Request::Unregister { .. } => Op::Unregister,
        }
    }

    /// The whole message (header and body) under `request_id`: the engine's side, and tests.
    pub fn encode(&self, request_id: u32) -> Vec<u8> {
        let mut body = Vec::new();
        match self {
            Request::Open(ns) => {
                put_string(&mut body, ns.tenant.as_bytes());
                put_string(&mut body, ns.model.as_bytes());
                let l = &ns.layout;
                for v in [l.layers, l.kv_heads, l.head_dim] {
                    body.extend_from_slice(&v.to_le_bytes());
                }
                body.push(l.dtype as u8);
                body.push(ns.hashing as u8);
                body.extend_from_slice(&l.block_tokens.to_le_bytes());
                put_string(&mut body, &ns.salt);
            }
            Request::Register { source, len, pages } => {
                let (kind, handle) = match source {
                    BufferSource::Memfd => (0u8, [0u8; 64]),
                    BufferSource::CudaIpc(h) => (1, *h),
                };
                body.extend_from_slice(&[kind, 0, 0, 0]);
                body.extend_from_slice(&len.to_le_bytes());
                body.extend_from_slice(&pages.to_le_bytes());
                body.extend_from_slice(&handle);
            }
            Request::Save { buffer, layer, items } => {
                body.extend_from_slice(&buffer.to_le_bytes());
                body.extend_from_slice(&layer.to_le_bytes());
                body.extend_from_slice(&0u16.to_le_bytes());
                put_items(&mut body, items);
            }
            Request::Load { buffer, items } => {
                body.extend_from_slice(&buffer.to_le_bytes());
                put_items(&mut body, items);
            }
            Request::Unregister { buffer } => body.extend_from_slice(&buffer.to_le_bytes()),
        }
        let h = Header { body_len: body.len() as u32, op: self.op() as u8, status: 0, aux: 0, request_id };
        let mut out = h.encode().to_vec();
        out.extend_from_slice(&body);
        out
    }
}

/// An answer: header and body in one buffer.
pub fn encode_answer(op: Op, status: Status, aux: u16, request_id: u32, body: &[u8]) -> Vec<u8> {
    let h = Header { body_len: body.len() as u32, op: op as u8, status: status as u8, aux, request_id };
    let mut out = h.encode().to_vec();
    out.extend_from_slice(body);
    out
}

/// A refusal as an answer to `op`.
pub fn encode_refusal(op: Op, request_id: u32, r: &Refusal) -> Vec<u8> {
    encode_answer(op, r.status, 0, request_id, r.message.as_bytes())
}

/// The OPEN answer's body.
pub fn open_answer(block_bytes: u64, layers: u32, id: &NamespaceId) -> Vec<u8> {
    let mut b = block_bytes.to_le_bytes().to_vec();
    b.extend_from_slice(&layers.to_le_bytes());
    b.extend_from_slice(&id.0);
    b
}

/// Two `u32`s: the SAVE and LOAD answers' bodies.
pub fn counts(values: &[u32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn items(n: u32) -> Vec<Item> {
        (0..n).map(|i| Item { page: i * 3, key: BlockKey([i as u8; KEY_LEN]) }).collect()
    }

    fn round_trip(req: Request) {
        let msg = req.encode(77);
        let h = Header::decode(msg[..HEADER_LEN].try_into().unwrap());
        assert_eq!(h.request_id, 77);
        assert_eq!(h.body_len as usize, msg.len() - HEADER_LEN);
        assert_eq!(decode_request(h.op, &msg[HEADER_LEN..]), Ok(req));
    }

    #[test]
    fn every_request_round_trips() {
        let layout = KvLayout::new(4, 2, 64, DType::Fp16, 16);
        round_trip(Request::Open(Namespace::new("t", "m", layout, HashScheme::Sha256, b"salt")));
        round_trip(Request::Register { source: BufferSource::Memfd, len: 1 << 20, pages: 32 });
        round_trip(Request::Register { source: BufferSource::CudaIpc([5; 64]), len: 4096, pages: 1 });
        round_trip(Request::Save { buffer: 2, layer: 3, items: items(5) });
        round_trip(Request::Load { buffer: 1, items: items(0) });
        round_trip(Request::Load { buffer: 1, items: items(MAX_ITEMS as u32) });
        round_trip(Request::Unregister { buffer: 9 });
    }

    #[test]
    fn malformed_requests_are_refused_with_a_reason() {
        let bad = |op: u8, body: &[u8]| decode_request(op, body).unwrap_err();
        assert!(bad(99, &[]).message.contains("unknown op"));
        assert!(bad(Op::Layer as u8, &[]).message.contains("answer"));
        let load = Request::Load { buffer: 1, items: items(2) }.encode(1);
        let body = &load[HEADER_LEN..];
        assert!(bad(Op::Load as u8, &body[..body.len() - 1]).message.contains("need"));
        let mut long = body.to_vec();
        long.push(0);
        assert!(bad(Op::Load as u8, &long).message.contains("need"));
        let mut many = 1u32.to_le_bytes().to_vec();
        many.extend_from_slice(&(MAX_ITEMS as u32 + 1).to_le_bytes());
        assert!(bad(Op::Load as u8, &many).message.contains("at most"));
        let unreg = Request::Unregister { buffer: 1 }.encode(1);
        let mut extra = unreg[HEADER_LEN..].to_vec();
        extra.push(1);
        assert!(bad(Op::Unregister as u8, &extra).message.contains("unexpected"));
        let reg = Request::Register { source: BufferSource::Memfd, len: 1, pages: 1 }.encode(1);
        let mut kind = reg[HEADER_LEN..].to_vec();
        kind[0] = 7;
        assert!(bad(Op::Register as u8, &kind).message.contains("kind"));
        // A layout the proto refuses (0 layers), a dtype that does not exist.
        let open =
            Request::Open(Namespace::new("t", "m", KvLayout::new(0, 2, 64, DType::Fp16, 16), HashScheme::Blake3, b""))
                .encode(1);
        assert!(bad(Op::Open as u8, &open[HEADER_LEN..]).message.contains("layout"));
        let mut dtype =
            Request::Open(Namespace::new("t", "m", KvLayout::new(1, 2, 64, DType::Fp16, 16), HashScheme::Blake3, b""))
                .encode(1)[HEADER_LEN..]
                .to_vec();
        dtype[2 + 1 + 2 + 1 + 6] = 42;
        assert_eq!(bad(Op::Open as u8, &dtype).status, Status::BadRequest);
        for n in 0..40 {
            let _ = decode_request(Op::Open as u8, &vec![0xff; n]);
            let _ = decode_request(Op::Save as u8, &vec![0xff; n]);
        }
    }

    #[test]
    fn answers_carry_status_aux_and_body() {
        let a = encode_answer(Op::Layer, Status::Internal, 3, 9, b"copy failed");
        let h = Header::decode(a[..HEADER_LEN].try_into().unwrap());
        assert_eq!((h.op, h.status, h.aux, h.request_id, h.body_len), (5, 6, 3, 9, 11));
        assert_eq!(&a[HEADER_LEN..], b"copy failed");
        assert_eq!(counts(&[1, 2]), [1, 0, 0, 0, 2, 0, 0, 0]);
    }
}
