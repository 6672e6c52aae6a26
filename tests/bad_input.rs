//! Bad input against a real server: each case gets a clear error, the server keeps serving and
//! every other block stays intact. Frames are hand-built here to send what a correct client never
//! would.

use std::io::{Read, Write};
use std::net::TcpStream;

use bytes::Bytes;
use kvtier_client::{ClientError, ParkOptions};
use kvtier_proto::dataplane::{
    Hello, ItemStatus, Op, RequestHeader, Status, FLAG_CHECKSUM_AFTER, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION,
};
use kvtier_proto::{pb, NamespaceId};
use kvtier_tests::raw::Raw;
use kvtier_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_input_gets_a_clear_error_and_nothing_is_lost() {
    let server = ServerProcess::start(&["--dram-capacity", "64MiB", "--max-context-tokens", "65536"]);
    let client = server.client().await;
    let ns = client.register(namespace("bad", b"x", small_layout())).await.unwrap();
    let reference = tokens(42, 256);
    let reference_blocks = full_block_payloads(&ns, &reference);
    client.store(&ns, &reference, &reference_blocks).await.unwrap().ok().unwrap();
    let bb = ns.block_bytes() as usize;
    let fresh = |seed: u32| {
        let t = tokens(seed, 16);
        let k = ns.keys(&t)[0];
        ns.frame(k, 16, payload_for(&k, bb as u64)).unwrap()
    };

    // 1. A block whose size doesn't match its layout; the same connection then stores a good one.
    let mut raw = Raw::open(server.data);
    let bad = fresh(1);
    let mut h = bad.header;
    h.payload_len = 100;
    raw.put_header(2);
    raw.send_frame(&h, &[0u8; 100]);
    let good = fresh(2);
    raw.send_frame(&good.header, &good.payload);
    raw.response().unwrap();
    assert_eq!(raw.statuses(2), vec![ItemStatus::SizeMismatch, ItemStatus::Ok]);
    assert_eq!(client.lookup_keys(&ns, &[bad.header.key]).await.unwrap(), 0);
    assert_eq!(client.lookup_keys(&ns, &[good.header.key]).await.unwrap(), 1);

    // 2. Unknown namespace, on the data plane and the control plane.
    let mut f = fresh(3);
    f.header.namespace = NamespaceId([0xEE; 16]);
    raw.put_header(1);
    raw.send_frame(&f.header, &f.payload);
    raw.response().unwrap();
    assert_eq!(raw.statuses(1), vec![ItemStatus::UnknownNamespace]);
    let get = RequestHeader { op: Op::Get, flags: 0, request_id: 5, count: 1, namespace: NamespaceId([0xEE; 16]) };
    raw.0.write_all(&get.encode()).unwrap();
    raw.0.write_all(&[0u8; 32]).unwrap();
    let (st, msg) = raw.response().unwrap_err();
    assert_eq!(st, Status::UnknownNamespace);
    assert!(msg.contains("unknown namespace"), "{msg}");
    let mut g = client.raw_grpc();
    let e =
        g.lookup(pb::LookupRequest { namespace_id: Bytes::from_static(&[0xEE; 16]), keys: vec![] }).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);
    assert!(e.message().contains("KV:Namespace:Unknown"), "{}", e.message());

    // 3. Checksum mismatch: refused, not stored, the connection goes on.
    let f = fresh(4);
    let mut corrupt = f.payload.to_vec();
    corrupt[1234] ^= 0x10;
    raw.put_header(1);
    raw.send_frame(&f.header, &corrupt);
    raw.response().unwrap();
    assert_eq!(raw.statuses(1), vec![ItemStatus::ChecksumMismatch]);
    assert_eq!(client.lookup_keys(&ns, &[f.header.key]).await.unwrap(), 0);

    // 4. A key of the wrong length.
    let e = g
        .lookup(pb::LookupRequest {
            namespace_id: Bytes::copy_from_slice(&ns.id.0),
            keys: vec![Bytes::from_static(&[1u8; 31])],
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("KV:Key:Length") && e.message().contains("31"), "{}", e.message());

    // 5. Oversized frame: a request-level error, then this connection (only) is closed.
    let f = fresh(5);
    let mut h = f.header;
    h.payload_len = 1 << 40;
    raw.put_header(1);
    raw.send_frame(&h, &[]);
    let (st, msg) = raw.response().unwrap_err();
    assert_eq!(st, Status::TooLarge);
    assert!(msg.contains("exceeds the limit"), "{msg}");
    assert!(raw.closed());

    // 6. Truncated frame: the client dies half-way through a payload. Nothing becomes visible.
    let mut raw = Raw::open(server.data);
    let f = fresh(6);
    raw.put_header(1);
    raw.0.write_all(&f.header.encode()).unwrap();
    raw.0.write_all(&f.payload[..bb / 2]).unwrap();
    drop(raw);
    // 7. Garbage where a frame header belongs, and too many blocks in one request.
    let mut raw = Raw::open(server.data);
    raw.put_header(1);
    raw.0.write_all(&[0xAB; 128]).unwrap();
    let (st, msg) = raw.response().unwrap_err();
    assert_eq!(st, Status::BadRequest);
    assert!(msg.contains("magic"), "{msg}");
    let mut raw = Raw::open(server.data);
    raw.put_header(1_000_000);
    let (st, msg) = raw.response().unwrap_err();
    assert_eq!(st, Status::TooLarge);
    assert!(msg.contains("max_blocks_per_request"), "{msg}");
    // 8. Not our protocol at all.
    let mut s = TcpStream::connect(server.data).unwrap();
    s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    let mut r = [0u8; 4];
    s.read_exact(&mut r).unwrap();
    assert_eq!(r[0], Status::BadRequest as u8);

    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert_eq!(client.lookup_keys(&ns, &[f.header.key]).await.unwrap(), 0, "a truncated block is never visible");

    // 9. A tail key of the wrong length in a park; a session resumed after its TTL.
    let mut g = client.raw_grpc();
    let e = g
        .park_session(pb::ParkRequest {
            namespace_id: Bytes::copy_from_slice(&ns.id.0),
            session_id: "s".into(),
            keys: vec![],
            tail_key: Bytes::from_static(&[1u8; 33]),
            token_count: 3,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(e.message().contains("KV:Key:Length"), "{}", e.message());

    // Through all of that the server kept serving and every stored block is intact.
    assert!(server_alive(&server));
    let loaded = client.load(&ns, &reference).await.unwrap();
    assert_eq!(loaded, reference_blocks);
    let m = server.scrape();
    for kind in ["size_mismatch", "unknown_namespace", "checksum_mismatch", "key_length", "dataplane_protocol"] {
        assert!(metric(&m, "kvtier_errors_total", &[("kind", kind)]) >= 1.0, "no {kind} error counted:\n{m}");
    }
}

/// Protocol 2's checksums after the payloads, sent by hand: the trailer decides (the header's
/// checksum is ignored), a frame refused before its payload is read still has its trailer drained
/// so the stream stays in step, and the flag is refused where it can't be framed — on a
/// protocol-1 connection and on a `GET` — while protocol-1 stores still work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checksums_after_the_payloads_are_checked_and_refused_where_they_cannot_be_framed() {
    let server = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    let client = server.client().await;
    let ns = client.register(namespace("after", b"x", small_layout())).await.unwrap();
    let bb = ns.block_bytes() as usize;
    let fresh = |seed: u32| {
        let k = ns.keys(&tokens(seed, 16))[0];
        ns.frame(k, 16, payload_for(&k, bb as u64)).unwrap()
    };
    let (good, wrong, short, last) = (fresh(1), fresh(2), fresh(3), fresh(4));
    let mut raw = Raw::open(server.data);
    raw.put_header_flags(4, FLAG_CHECKSUM_AFTER);
    // Good, its header's checksum zeroed: the trailer is what counts.
    let mut h = good.header;
    h.checksum = 0;
    raw.send_frame(&h, &good.payload);
    raw.0.write_all(&good.header.checksum.to_le_bytes()).unwrap();
    // The header's checksum right, the trailer wrong.
    raw.send_frame(&wrong.header, &wrong.payload);
    raw.0.write_all(&(wrong.header.checksum ^ 1).to_le_bytes()).unwrap();
    // Refused on its size before its payload is read: payload and trailer are drained.
    let mut h = short.header;
    h.payload_len = 100;
    raw.send_frame(&h, &[7u8; 100]);
    raw.0.write_all(&[0xAB; 8]).unwrap();
    raw.send_frame(&last.header, &last.payload);
    raw.0.write_all(&last.header.checksum.to_le_bytes()).unwrap();
    raw.response().unwrap();
    assert_eq!(
        raw.statuses(4),
        vec![ItemStatus::Ok, ItemStatus::ChecksumMismatch, ItemStatus::SizeMismatch, ItemStatus::Ok]
    );
    let keys = [good.header.key, wrong.header.key, short.header.key, last.header.key];
    assert_eq!(client.exists_keys(&ns, &keys).await.unwrap(), vec![true, false, false, true]);
    // What is held carries the trailer's checksum: it loads back verified.
    let got = client.load_keys(&ns, &keys).await.unwrap();
    assert_eq!(got[0].as_ref().map(|f| f.payload.clone()), Some(good.payload.clone()));
    assert_eq!(got[3].as_ref().map(|f| f.payload.clone()), Some(last.payload.clone()));

    // A protocol-1 connection stores as before, and is refused the flag.
    let mut old = Raw::open_version(server.data, MIN_PROTOCOL_VERSION).unwrap();
    let one = fresh(5);
    old.put_header(1);
    old.send_frame(&one.header, &one.payload);
    old.response().unwrap();
    assert_eq!(old.statuses(1), vec![ItemStatus::Ok]);
    old.put_header_flags(1, FLAG_CHECKSUM_AFTER);
    let (st, msg) = old.response().unwrap_err();
    assert_eq!(st, Status::BadRequest);
    assert!(msg.contains("protocol 2") && msg.contains("protocol 1"), "{msg}");
    assert!(old.closed(), "the rest of that request can't be framed");
    // On a GET the flag means nothing it could frame either.
    let mut raw = Raw::open(server.data);
    let get = RequestHeader { op: Op::Get, flags: FLAG_CHECKSUM_AFTER, request_id: 3, count: 1, namespace: ns.id };
    raw.0.write_all(&get.encode()).unwrap();
    raw.0.write_all(&good.header.key.0).unwrap();
    let (st, msg) = raw.response().unwrap_err();
    assert_eq!(st, Status::BadRequest);
    assert!(msg.contains("Get"), "{msg}");
    assert!(raw.closed());
    // A version the server doesn't speak is named in the refusal.
    let (st, msg) = Raw::open_version(server.data, PROTOCOL_VERSION + 1).err().expect("refused");
    assert_eq!(st, Status::UnsupportedVersion as u8);
    assert!(msg.contains(&format!("{MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION}")), "{msg}");

    // The client's own stores of blocks hashed on the way out (512 KiB, two pieces each) land
    // byte-exact over TCP, and the server kept serving through all of the above.
    let layout = kvtier_proto::KvLayout::new(16, 8, 64, kvtier_proto::DType::Fp16, 16);
    let big = client.register(namespace("after", b"big", layout)).await.unwrap();
    let keys = big.keys(&tokens(9, 16 * 3));
    let blocks: Vec<Vec<Bytes>> = keys.iter().map(|k| vec![payload_for(k, big.block_bytes())]).collect();
    assert!(client.store_keys(&big, &keys, &blocks).await.unwrap().iter().all(|s| *s == ItemStatus::Ok));
    let got = client.load_keys(&big, &keys).await.unwrap();
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(got[i].as_ref().map(|f| f.payload.clone()), Some(payload_for(k, big.block_bytes())), "block {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_dies_mid_park_leaks_no_pins() {
    let server = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    let client = server.client().await;
    let ns = client.register(namespace("lease", b"", small_layout())).await.unwrap();
    let t = tokens(77, 64);
    let mut raw = Raw::open(server.data);
    let h = RequestHeader {
        op: Op::Put,
        flags: kvtier_proto::dataplane::FLAG_PIN_LEASE,
        request_id: 1,
        count: 4,
        namespace: NamespaceId([0; 16]),
    };
    raw.0.write_all(&h.encode()).unwrap();
    for k in ns.keys(&t) {
        let f = ns.frame(k, 16, payload_for(&k, ns.block_bytes())).unwrap();
        raw.send_frame(&f.header, &f.payload);
    }
    raw.response().unwrap();
    assert_eq!(raw.statuses(4), vec![ItemStatus::Ok; 4]);
    assert_eq!(client.stats().await.unwrap().tiers[0].pinned_bytes, 4 * ns.block_bytes(), "leased blocks are pinned");
    drop(raw); // the client dies before parking
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while client.stats().await.unwrap().tiers[0].pinned_bytes != 0 {
        assert!(std::time::Instant::now() < deadline, "leases outlived their connection");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // The blocks themselves stay cached, just evictable again.
    assert_eq!(client.lookup(&ns, &t).await.unwrap(), 64);
}

fn server_alive(server: &ServerProcess) -> bool {
    TcpStream::connect(server.grpc).is_ok() && TcpStream::connect(server.data).is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn longest_context_works_and_ten_percent_more_changes_nothing() {
    // The default maximum context (1M tokens) with 4 KiB blocks of 64 tokens: 64 MiB of KV.
    let server = ServerProcess::start(&["--dram-capacity", "256MiB"]);
    let client = server.client().await;
    let max = client.server_info().max_context_tokens as usize;
    assert_eq!(max, 1 << 20);
    let mut layout = tiny_layout();
    layout.block_tokens = 64;
    let ns = client.register(namespace("long", b"", layout)).await.unwrap();

    let longest = tokens(5, max);
    let blocks = session_payloads(&ns, &longest);
    let info = client.park(&ns, "longest", &longest, &blocks, &ParkOptions::default(), 0).await.unwrap();
    assert_eq!(info.token_count as usize, max);
    assert_eq!(client.lookup(&ns, &longest).await.unwrap(), max);
    let r = client.resume(&ns, "longest").await.unwrap();
    assert!(r.blocks == blocks, "the longest session came back different");

    let before = client.stats().await.unwrap();
    let over = tokens(6, max + max / 10);
    let over_blocks = session_payloads(&ns, &over);
    let e = client.park(&ns, "too-long", &over, &over_blocks, &ParkOptions::default(), 0).await.unwrap_err();
    assert!(matches!(e, ClientError::ContextTooLong(_)), "{e}");
    assert!(e.to_string().contains("1048576"), "{e}");
    let e = client.lookup(&ns, &over).await.unwrap_err();
    assert!(matches!(e, ClientError::ContextTooLong(_)), "{e}");
    let e = client.store(&ns, &over, &full_block_payloads(&ns, &over)).await.unwrap_err();
    assert!(matches!(e, ClientError::ContextTooLong(_)), "{e}");
    // A raw park that skips the client's own check is refused by the server just the same.
    let keys: Vec<Bytes> = ns.keys(&over).iter().map(|k| Bytes::copy_from_slice(&k.0)).collect();
    let e = client
        .raw_grpc()
        .park_session(pb::ParkRequest {
            namespace_id: Bytes::copy_from_slice(&ns.id.0),
            session_id: "raw-too-long".into(),
            keys,
            token_count: (over.len() / 64 * 64) as u64,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(e.message().contains("KV:Request:ContextTooLong"), "{}", e.message());

    let after = client.stats().await.unwrap();
    assert_eq!(after.sessions, before.sessions);
    assert_eq!(after.tiers[0].pinned_bytes, before.tiers[0].pinned_bytes);
    assert_eq!(after.tiers[0].blocks, before.tiers[0].blocks, "nothing was stored");
}

/// A client that announces an auth token and never sends it is cut off with the hello's deadline
/// (10 s), so such connections can't hold the data plane's slots; the server keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hello_that_never_finishes_is_cut_off() {
    let server = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    let mut s = std::net::TcpStream::connect(server.data).unwrap();
    let mut hello = Hello::encode(PROTOCOL_VERSION, &[b'x'; 100]);
    hello.truncate(hello.len() - 90); // 10 of the 100 announced token bytes
    s.write_all(&hello).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(30))).unwrap();
    let t = std::time::Instant::now();
    let mut buf = [0u8; 16];
    let n = s.read(&mut buf).unwrap_or(0);
    assert_eq!(n, 0, "the server closes the connection without answering");
    let waited = t.elapsed();
    assert!(waited >= std::time::Duration::from_secs(8) && waited < std::time::Duration::from_secs(25), "{waited:?}");
    let m = server.scrape();
    assert!(metric(&m, "kvtier_errors_total", &[("kind", "dataplane_hello_timeout")]) >= 1.0, "{m}");
    // Others are served meanwhile and after.
    let client = server.client().await;
    let ns = client.register(namespace("after", b"", small_layout())).await.unwrap();
    let t = tokens(9, 64);
    client.store(&ns, &t, &full_block_payloads(&ns, &t)).await.unwrap().ok().unwrap();
    assert_eq!(client.lookup(&ns, &t).await.unwrap(), 64);
}

/// Re-putting blocks with pin leases pins each once (the connection's lease list doesn't grow),
/// and one connection leases at most `MAX_LEASED_PINS` blocks: the rest are refused per block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pin_leases_count_each_block_once_and_are_capped_per_connection() {
    use kvtier_server::dataplane::MAX_LEASED_PINS;
    let server = ServerProcess::start(&["--dram-capacity", "512MiB"]);
    let client = server.client().await;
    let mut layout = tiny_layout();
    layout.block_tokens = 64; // 4 KiB blocks: one slot each
    let ns = client.register(namespace("leases", b"", layout)).await.unwrap();
    let bb = ns.block_bytes();
    let mut raw = Raw::open(server.data);
    let mut put_leased = |frames: &[&kvtier_proto::BlockFrame]| -> Vec<ItemStatus> {
        let h = RequestHeader {
            op: Op::Put,
            flags: kvtier_proto::dataplane::FLAG_PIN_LEASE,
            request_id: 1,
            count: frames.len() as u32,
            namespace: NamespaceId([0; 16]),
        };
        raw.0.write_all(&h.encode()).unwrap();
        for f in frames {
            raw.send_frame(&f.header, &f.payload);
        }
        raw.response().unwrap();
        raw.statuses(frames.len())
    };
    let frames_of = |seed: u32, blocks: usize| -> Vec<kvtier_proto::BlockFrame> {
        ns.keys(&tokens(seed, blocks * 64)).into_iter().map(|k| ns.frame(k, 64, payload_for(&k, bb)).unwrap()).collect()
    };

    // The same 4 blocks, 1,000 times each.
    let four = frames_of(1, 4);
    let again: Vec<_> = four.iter().cycle().take(4000).collect();
    assert!(put_leased(&again).iter().all(|s| *s == ItemStatus::Ok));
    assert_eq!(client.stats().await.unwrap().tiers[0].pinned_bytes, 4 * bb);

    // Past the per-connection lease count, blocks are refused (and not stored pinned).
    let many = frames_of(2, MAX_LEASED_PINS + 12);
    let mut refused = 0;
    for chunk in many.chunks(4096) {
        let refs: Vec<_> = chunk.iter().collect();
        refused += put_leased(&refs).iter().filter(|s| **s == ItemStatus::Capacity).count();
    }
    assert_eq!(refused, 16, "4 + {} blocks leased, {MAX_LEASED_PINS} allowed", MAX_LEASED_PINS + 12);
    assert_eq!(client.stats().await.unwrap().tiers[0].pinned_bytes, MAX_LEASED_PINS as u64 * bb);
    drop(raw);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while client.stats().await.unwrap().tiers[0].pinned_bytes != 0 {
        assert!(std::time::Instant::now() < deadline, "leases outlived their connection");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}
