//! Writes a seed corpus for each fuzz target into `fuzz/corpus/<target>/`: valid encodings the
//! fuzzer mutates from (a frame past its checksum, every request header, a payload of every codec,
//! segments and metadata logs as the server's encoders write them), so that it starts beyond the
//! magic numbers, checksums and keyed tags. `bash scripts/test fuzz` runs it first.

use std::path::Path;

use bytes::Bytes;
use kvtier_kernels::{encode, BlockSpec, KvBlockView};
use kvtier_proto::dataplane::{Hello, LeaseGrant, Op, RequestHeader, SlotDescriptor};
use kvtier_proto::record_log::deletes::{self, OwedDeleteRecord};
use kvtier_proto::record_log::hints::PeerHintsRecord;
use kvtier_proto::record_log::namespaces::NamespaceRecord;
use kvtier_proto::record_log::sessions::{encode_body, LoggedSession, DROP, DROPPED, PUT};
use kvtier_proto::record_log::{encode_log_header, encode_record, LogKey, LogKind};
use kvtier_proto::{BlockFrame, BlockKey, CodecId, DType, KvLayout, NamespaceId, Priority};

fn write(target: &str, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus").join(target);
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join(name), bytes)
}

fn main() -> std::io::Result<()> {
    for len in [0usize, 16, 4096] {
        let payload: Vec<u8> = (0..len).map(|i| (i * 31) as u8).collect();
        let layout = KvLayout::opaque(len.max(1) as u64, DType::Fp16, 16);
        let f = BlockFrame::new(NamespaceId([7; 16]), BlockKey([9; 32]), layout, CodecId::RAW, 1, Bytes::from(payload));
        write("frame", &format!("frame-{len}"), &f.to_bytes())?;
    }
    let ops =
        [Op::Put, Op::Get, Op::Exists, Op::Release, Op::LeasePut, Op::Commit, Op::LeaseGet, Op::EndGet, Op::Connect];
    for (i, op) in ops.into_iter().enumerate() {
        let h = RequestHeader { op, flags: 0, request_id: 1, count: 3, namespace: NamespaceId([1; 16]) };
        write("messages", &format!("request-{i}"), &h.encode())?;
    }
    write("messages", "hello", &Hello::encode(1, b"a-token-of-sixteen-bytes"))?;
    let grant = LeaseGrant { lease: 7, slot: SlotDescriptor { addr: 0x7f00_0000_1000, rkey: 0x1234, len: 1 << 20 } };
    write("messages", "lease-grant", &grant.encode())?;
    for (di, dtype) in [DType::Fp16, DType::Bf16, DType::Fp32].into_iter().enumerate() {
        let spec = BlockSpec::new(2, 16, 2, 64, dtype);
        let raw: Vec<u8> = match dtype {
            DType::Fp32 => (0..spec.elements()).flat_map(|i| ((i % 97) as f32 * 0.01 - 0.4).to_le_bytes()).collect(),
            _ => (0..spec.elements()).flat_map(|i| (0x3800u16 + (i % 509) as u16).to_le_bytes()).collect(),
        };
        let view = KvBlockView::new(spec, &raw).map_err(std::io::Error::other)?;
        for codec in (0u16..).map(CodecId).take_while(|c| c.is_known()) {
            if let Ok(p) = encode(codec, &view) {
                // The target's first two bytes pick the dtype and head_dim (64 is index 1).
                let mut seed = vec![di as u8, 1];
                seed.extend_from_slice(&p);
                write("codec_payload", &format!("{}-{di}", codec.0), &seed)?;
            }
        }
    }
    segments()?;
    logs()
}

/// Segments of 1, 3 and 4 records (payloads under, at and over 4 KiB), the last one damaged.
fn segments() -> std::io::Result<()> {
    let mut seg = Vec::new();
    for (i, len) in [100usize, 4096 - 104, 5000, 64].into_iter().enumerate() {
        let payload: Vec<u8> = (0..len).map(|j| (j * 7 + i) as u8).collect();
        let layout = KvLayout::opaque(len as u64, DType::Fp16, 16);
        let f = BlockFrame::new(
            NamespaceId([3; 16]),
            BlockKey([i as u8; 32]),
            layout,
            CodecId::RAW,
            1,
            Bytes::from(payload),
        );
        seg.extend(kvtier_proto::segment::encode_record(&f.header, &f.payload));
        if i == 0 || i == 2 {
            write("segment", &format!("records-{}", i + 1), &seg)?;
        }
    }
    seg[2 * 4096 + 20] ^= 0x10; // the third record's header
    write("segment", "damaged", &seg)?;
    // Torn: the last record cut short.
    write("segment", "torn", &seg[..seg.len() - 100])
}

/// A `sessions.log` and a `namespaces.log` as the server writes them (the first byte picks the
/// log in the target), whole and with one damaged record.
fn logs() -> std::io::Result<()> {
    let key = LogKey([0x5a; 32]);
    let session = |id: &str, keys: usize| LoggedSession {
        namespace: NamespaceId([1; 16]),
        id: id.into(),
        keys: (0..keys).map(|i| BlockKey([i as u8; 32])).collect(),
        tail: Some(BlockKey([9; 32])),
        token_count: keys as u64 * 16,
        ttl_ms: 60_000,
        expires_unix_ms: 1 << 41,
        priority: Priority::High,
        version: 2,
        dropped_unix_ms: 0,
        created_unix_ms: 0,
    };
    let mut sessions = vec![0u8];
    sessions.extend(encode_log_header(LogKind::Sessions, &key));
    sessions.extend(encode_record(&key, &encode_body(PUT, 1, &session("a", 3))));
    sessions.extend(encode_record(&key, &encode_body(PUT, 2, &session("b", 1))));
    sessions.extend(encode_record(
        &key,
        &encode_body(DROP, 3, &LoggedSession::tombstone(NamespaceId([1; 16]), "a".into())),
    ));
    let remembered =
        LoggedSession { dropped_unix_ms: 1 << 40, ..LoggedSession::tombstone(NamespaceId([1; 16]), "a".into()) };
    sessions.extend(encode_record(&key, &encode_body(DROPPED, 4, &remembered)));
    write("logs", "sessions", &sessions)?;
    let n = sessions.len();
    sessions[n - 30] ^= 4;
    write("logs", "sessions-damaged", &sessions)?;
    let mut namespaces = vec![1u8];
    namespaces.extend(encode_log_header(LogKind::Namespaces, &key));
    // A registration carries the server's protobuf `NamespaceSpec`, opaque at this layer (this
    // crate builds the vocabulary without the gRPC messages, and the target does not decode it).
    let spec = b"tenant t, model m, layout 2x16x2x64 fp16, salt";
    namespaces.extend(encode_record(&key, &NamespaceRecord::Register(spec).encode()));
    namespaces.extend(encode_record(
        &key,
        &NamespaceRecord::Unregister { id: NamespaceId([2; 16]), mark: (3, 4096) }.encode(),
    ));
    namespaces.extend(encode_record(&key, &NamespaceRecord::Register(b"tenant u").encode()));
    namespaces
        .extend(encode_record(&key, &NamespaceRecord::Purge { id: NamespaceId([4; 16]), mark: (5, 8192) }.encode()));
    write("logs", "namespaces", &namespaces)?;
    let n = namespaces.len();
    namespaces[n - 40] ^= 4;
    write("logs", "namespaces-damaged", &namespaces)?;
    let mut owed = vec![2u8];
    owed.extend(encode_log_header(LogKind::OwedDeletes, &key));
    for (member, what) in [("n2", deletes::UNREGISTER), ("node-three:7070", deletes::PURGE)] {
        let r = OwedDeleteRecord { member, what, asked_unix_ms: 1 << 40, spec: b"tenant t, model m" };
        owed.extend(encode_record(&key, &r.encode()));
    }
    write("logs", "owed-deletes", &owed)?;
    let n = owed.len();
    owed[n - 20] ^= 4;
    write("logs", "owed-deletes-damaged", &owed)?;
    let mut hints = vec![3u8];
    hints.extend(encode_log_header(LogKind::PeerHints, &key));
    for (member, n) in [("n3", 2u8), ("node-two:7070", 1)] {
        let owed = (0..n).map(|i| (kvtier_proto::BlockKey([i; 32]), 1u64 << 40)).collect();
        let r = PeerHintsRecord { member, namespace: NamespaceId([5; 16]), hints: owed };
        hints.extend(encode_record(&key, &r.encode()));
    }
    write("logs", "peer-hints", &hints)?;
    let n = hints.len();
    hints[n - 20] ^= 4;
    write("logs", "peer-hints-damaged", &hints)
}
