//! The data plane over streams other than TCP, under injected faults: in-memory duplex streams
//! and Unix sockets to real in-process nodes (`kvtier_tests::harness`), with bytes corrupted,
//! streams cut and stalled by `kvtier_tests::faults`. Every flow runs over both transports.

use std::time::{Duration, Instant};

use kvtier_client::{BlockDest, ClientError, ItemStatus, KvClient, NamespaceHandle};
use kvtier_proto::dataplane::{CHECKSUM_LEN, REQUEST_HEADER_LEN, RESPONSE_HEADER_LEN};
use kvtier_proto::FRAME_HEADER_LEN;
use kvtier_tests::faults::Dir;
use kvtier_tests::harness::{Cluster, Transport};
use kvtier_tests::*;

const RH: u64 = REQUEST_HEADER_LEN as u64;
const FH: u64 = FRAME_HEADER_LEN as u64;
/// The checksum after each payload of a `PUT` (protocol 2 sends them after).
const SUM: u64 = CHECKSUM_LEN as u64;

async fn register(client: &KvClient) -> NamespaceHandle {
    client.register(namespace("streams", b"s", small_layout())).await.expect("register")
}

/// Opens (and says hello on) the client's one data connection, so that offsets of faults set
/// next count from the next request's first byte.
async fn warm(client: &KvClient, h: &NamespaceHandle) {
    client.exists_keys(h, &h.keys(&tokens(999, 16))).await.expect("warm the data connection");
}

async fn dram_blocks(client: &KvClient) -> u64 {
    let stats = client.stats().await.expect("stats");
    stats.tiers.iter().filter(|t| t.tier == "dram").map(|t| t.blocks).sum()
}

async fn round_trip(transport: Transport) {
    let cluster = Cluster::start_with(1, transport, |_, _| {}).await;
    let link = cluster.link(0).await;
    let h = register(&link.client).await;
    let doc = tokens(1, 16 * 8);
    let blocks = full_block_payloads(&h, &doc);
    link.client.store(&h, &doc, &blocks).await.unwrap().ok().unwrap();
    assert_eq!(link.client.lookup(&h, &doc).await.unwrap(), doc.len());
    assert_eq!(link.client.load(&h, &doc).await.unwrap(), blocks);
    assert!(link.client.exists_keys(&h, &h.keys(&doc)).await.unwrap().iter().all(|x| *x));
    assert!(link.faults.moved(Dir::Write) >= blocks.len() as u64 * h.block_bytes(), "the bytes went through the link");
    cluster.stop().await;
}

async fn corrupted_on_the_way_in_is_refused_and_never_stored(transport: Transport) {
    let cluster = Cluster::start_with(1, transport, |_, _| {}).await;
    let link = cluster.link(0).await;
    let h = register(&link.client).await;
    warm(&link.client, &h).await;
    let doc = tokens(2, 16 * 3);
    let blocks = full_block_payloads(&h, &doc);
    // A bit of the second block's payload flips on its way to the server.
    link.faults.corrupt_at(Dir::Write, RH + (FH + h.block_bytes() + SUM) + FH + 1234, 0x10);
    let report = link.client.store(&h, &doc, &blocks).await.unwrap();
    assert_eq!(link.faults.corrupted(), 1);
    assert_eq!(report.rejected, vec![(1, ItemStatus::ChecksumMismatch)]);
    assert_eq!(report.stored, 2);
    let keys = h.keys(&doc);
    assert_eq!(link.client.exists_keys(&h, &keys).await.unwrap(), vec![true, false, true]);
    assert_eq!(link.client.lookup(&h, &doc).await.unwrap(), 16, "the prefix stops at the refused block");
    assert_eq!(dram_blocks(&link.client).await, 2, "nothing of the damaged block is held");
    // Sent again undamaged it is stored, and what comes back is what was sent.
    link.client.store(&h, &doc, &blocks).await.unwrap().ok().unwrap();
    assert_eq!(link.client.load(&h, &doc).await.unwrap(), blocks);
    cluster.stop().await;
}

/// Blocks of 512 KiB stored by key, each in two parts (K and V): hashed as they are sent, a
/// piece at a time, with each checksum after its payload. A bit flipped in the second block's
/// second piece is caught by the node; the others land byte-exact and load back verified.
async fn hashed_on_the_way_in_and_checked_after_the_payload(transport: Transport) {
    let cluster = Cluster::start_with(1, transport, |_, _| {}).await;
    let link = cluster.link(0).await;
    let layout = kvtier_proto::KvLayout::new(16, 8, 64, kvtier_proto::DType::Fp16, 16);
    let h = link.client.register(namespace("streams", b"big", layout)).await.expect("register");
    let bb = h.block_bytes();
    assert_eq!(bb, 512 << 10);
    warm(&link.client, &h).await;
    let keys = h.keys(&tokens(7, 16 * 3));
    let blocks: Vec<Vec<bytes::Bytes>> = keys
        .iter()
        .map(|k| {
            let p = payload_for(k, bb);
            vec![p.slice(..bb as usize / 2), p.slice(bb as usize / 2..)]
        })
        .collect();
    link.faults.corrupt_at(Dir::Write, RH + (FH + bb + SUM) + FH + 300_000, 0x20);
    let st = link.client.store_keys(&h, &keys, &blocks).await.unwrap();
    assert_eq!(link.faults.corrupted(), 1);
    assert_eq!(st, vec![ItemStatus::Ok, ItemStatus::ChecksumMismatch, ItemStatus::Ok]);
    assert_eq!(link.client.exists_keys(&h, &keys).await.unwrap(), vec![true, false, true]);
    let got = link.client.load_keys(&h, &keys).await.unwrap();
    assert_eq!(got[0].as_ref().map(|f| f.payload.clone()), Some(payload_for(&keys[0], bb)));
    assert!(got[1].is_none());
    assert_eq!(got[2].as_ref().map(|f| f.payload.clone()), Some(payload_for(&keys[2], bb)));
    // Sent again undamaged, it is stored; the checksum the node kept is the one sent after it.
    assert_eq!(link.client.store_keys(&h, &keys[1..2], &blocks[1..2]).await.unwrap(), vec![ItemStatus::Ok]);
    let got = link.client.load_keys(&h, &keys[1..2]).await.unwrap();
    assert_eq!(got[0].as_ref().map(|f| f.payload.clone()), Some(payload_for(&keys[1], bb)));
    cluster.stop().await;
}

async fn corrupted_on_the_way_out_is_never_handed_over(transport: Transport) {
    let cluster = Cluster::start_with(1, transport, |_, _| {}).await;
    let link = cluster.link(0).await;
    let h = register(&link.client).await;
    let doc = tokens(3, 16 * 2);
    let blocks = full_block_payloads(&h, &doc);
    let keys = h.keys(&doc);
    link.client.store(&h, &doc, &blocks).await.unwrap().ok().unwrap();

    // Into a buffer of its own (`load_keys`): the first block's payload is damaged.
    warm(&link.client, &h).await;
    link.faults.corrupt_at(Dir::Read, RESPONSE_HEADER_LEN as u64 + 1 + FH + 500, 0x04);
    let frames = link.client.load_keys(&h, &keys).await.unwrap();
    assert!(frames[0].is_none(), "a damaged block handed over as good");
    assert_eq!(frames[1].as_ref().map(|f| &f.payload), Some(&blocks[1]));
    assert_eq!(link.faults.corrupted(), 1);

    // Into the caller's memory (`load_keys_into`): the damaged block is a miss, never good bytes.
    warm(&link.client, &h).await;
    link.faults.corrupt_at(Dir::Read, RESPONSE_HEADER_LEN as u64 + 1 + FH + 77, 0x01);
    let mut bufs = vec![vec![0u8; h.block_bytes() as usize]; 2];
    let mut dests: Vec<BlockDest<'_>> = bufs.iter_mut().map(|b| vec![&mut b[..]]).collect();
    match link.client.load_keys_into(&h, &keys, &mut dests, false).await {
        Err(e) => assert_ne!(e.reason(), "timeout", "{e}"),
        Ok(landed) => {
            assert_eq!(landed, vec![false, true]);
            assert_eq!(&bufs[1][..], &blocks[1][..]);
        }
    }
    assert_eq!(link.faults.corrupted(), 2);

    // The server's copy was never touched.
    assert_eq!(link.client.load(&h, &doc).await.unwrap(), blocks);
    cluster.stop().await;
}

/// A block that went bad in the node's DRAM after it was checked in (a flipped bit) is served
/// unchecked and checked once sent: the client takes it for a miss, never for data, and the node
/// drops it, so the next load is a plain miss; its neighbours load byte-exact throughout.
async fn damaged_in_dram_is_a_miss_at_the_client_and_dropped_by_the_node(transport: Transport) {
    let cluster = Cluster::start_with(1, transport, |_, _| {}).await;
    let link = cluster.link(0).await;
    let h = register(&link.client).await;
    let doc = tokens(5, 16 * 3);
    let blocks = full_block_payloads(&h, &doc);
    let keys = h.keys(&doc);
    let tiers = cluster.node(0).state().tiers();
    for (i, (key, payload)) in keys.iter().zip(&blocks).enumerate() {
        let frame = h.frame(*key, h.block_tokens() as u32, payload.clone()).unwrap();
        let mut slot = tiers.reserve(&h.id, payload.len()).unwrap();
        slot.buf_mut().copy_from_slice(payload);
        if i == 1 {
            slot.buf_mut()[321] ^= 0x08;
        }
        tiers.commit(slot, frame.header, kvtier_server::dram::Priority::Normal).unwrap();
    }
    async fn load(
        client: &KvClient,
        h: &NamespaceHandle,
        keys: &[kvtier_proto::BlockKey],
    ) -> (Vec<bool>, Vec<Vec<u8>>) {
        let mut bufs = vec![vec![0u8; h.block_bytes() as usize]; keys.len()];
        let mut dests: Vec<BlockDest<'_>> = bufs.iter_mut().map(|b| vec![&mut b[..]]).collect();
        let landed = client.load_keys_into(h, keys, &mut dests, false).await.unwrap();
        (landed, bufs)
    }
    // Into a buffer of its own (`load_keys`), then into the caller's memory (`load_keys_into`,
    // the block dropped by then or not): a miss either way, never data, the others exact.
    let frames = link.client.load_keys(&h, &keys).await.unwrap();
    assert!(frames[1].is_none(), "a block damaged in DRAM handed over as good");
    assert_eq!(frames[0].as_ref().map(|f| &f.payload), Some(&blocks[0]));
    assert_eq!(frames[2].as_ref().map(|f| &f.payload), Some(&blocks[2]));
    let (landed, got) = load(&link.client, &h, &keys).await;
    assert_eq!(landed, vec![true, false, true], "the damaged block is a miss");
    assert_eq!((&got[0][..], &got[2][..]), (&blocks[0][..], &blocks[2][..]));
    let t = Instant::now();
    while tiers.holds(&h.id, &keys[1]) {
        assert!(t.elapsed() < Duration::from_secs(5), "the node kept a block it found damaged");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (landed, got) = load(&link.client, &h, &keys).await;
    assert_eq!(landed, vec![true, false, true], "a plain miss now");
    assert_eq!((&got[0][..], &got[2][..]), (&blocks[0][..], &blocks[2][..]));
    assert!(tiers.holds(&h.id, &keys[0]) && tiers.holds(&h.id, &keys[2]));
    assert_eq!(link.client.lookup(&h, &doc).await.unwrap(), 16, "the prefix stops where the block was");
    cluster.stop().await;
}

async fn a_cut_mid_put_leaves_no_partial_block(transport: Transport) {
    let cluster = Cluster::start_with(1, transport, |_, _| {}).await;
    let (cut, other) = (cluster.link(0).await, cluster.link(0).await);
    let h = register(&cut.client).await;
    let h2 = register(&other.client).await;
    warm(&cut.client, &h).await;
    let doc = tokens(4, 16 * 4);
    let blocks = full_block_payloads(&h, &doc);
    let keys = h.keys(&doc);
    // The stream ends halfway through the third block's payload.
    cut.faults.cut_after(Dir::Write, RH + 2 * (FH + h.block_bytes() + SUM) + FH + h.block_bytes() / 2);
    let other_doc = tokens(5, 16 * 6);
    let other_blocks = full_block_payloads(&h2, &other_doc);
    let (failed, served) = tokio::join!(cut.client.store(&h, &doc, &blocks), async {
        other.client.store(&h2, &other_doc, &other_blocks).await?.ok()?;
        other.client.load(&h2, &other_doc).await
    });
    let err = failed.expect_err("a cut stream fails the store");
    assert_eq!(err.reason(), "io", "{err}");
    assert_eq!(served.unwrap(), other_blocks, "another connection is served meanwhile");

    let held = other.client.exists_keys(&h2, &keys).await.unwrap();
    assert!(!held[2] && !held[3], "the block cut in half (and the one after) are not visible: {held:?}");
    for (i, frame) in other.client.load_keys(&h2, &keys).await.unwrap().iter().enumerate() {
        if let Some(f) = frame {
            assert_eq!(f.payload, blocks[i], "block {i} was received whole, or not at all");
        }
    }
    assert_eq!(dram_blocks(&other.client).await, 6 + held.iter().filter(|x| **x).count() as u64);

    // The link back, the same client stores the whole document on a fresh connection.
    cut.faults.clear();
    cut.client.store(&h, &doc, &blocks).await.unwrap().ok().unwrap();
    assert_eq!(other.client.load(&h2, &doc).await.unwrap(), blocks);
    cluster.stop().await;
}

async fn a_stall_past_the_timeout_is_a_timeout_then_a_fresh_connection_works(transport: Transport) {
    let cluster = Cluster::start_with(1, transport, |_, _| {}).await;
    let link = cluster.link(0).await; // request_timeout 2 s
    let h = register(&link.client).await;
    let doc = tokens(6, 16 * 2);
    let blocks = full_block_payloads(&h, &doc);
    link.client.store(&h, &doc, &blocks).await.unwrap().ok().unwrap();

    link.faults.stall();
    let t = Instant::now();
    let err = link.client.load(&h, &doc).await.unwrap_err();
    assert!(matches!(err, ClientError::Timeout(_)), "{err}");
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
    let t = Instant::now();
    let err = link.client.store(&h, &tokens(7, 16), &full_block_payloads(&h, &tokens(7, 16))).await.unwrap_err();
    assert!(matches!(err, ClientError::Timeout(_)), "a store on a stalled link: {err}");
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());

    link.faults.release();
    assert_eq!(link.client.load(&h, &doc).await.unwrap(), blocks);
    // A stall shorter than the timeout only slows the request down.
    link.faults.stall_for(Duration::from_millis(300));
    let t = Instant::now();
    assert_eq!(link.client.load(&h, &doc).await.unwrap(), blocks);
    assert!(t.elapsed() >= Duration::from_millis(250), "took {:?}", t.elapsed());
    cluster.stop().await;
}

async fn three_nodes_one_cut(transport: Transport) {
    let cluster = Cluster::start_with(3, transport, |_, _| {}).await;
    let mut links = Vec::new();
    let mut docs = Vec::new();
    for i in 0..cluster.len() {
        let link = cluster.link(i).await;
        let h = register(&link.client).await;
        let doc = tokens(10 + i as u32, 16 * 5);
        let blocks = full_block_payloads(&h, &doc);
        link.client.store(&h, &doc, &blocks).await.unwrap().ok().unwrap();
        links.push((link, h));
        docs.push((doc, blocks));
    }
    // Each node holds what was written to it, and only that.
    for (i, (link, h)) in links.iter().enumerate() {
        for (j, (doc, _)) in docs.iter().enumerate() {
            let held = link.client.exists_keys(h, &h.keys(doc)).await.unwrap();
            assert_eq!(held.iter().all(|x| *x), i == j, "node {i}, document {j}: {held:?}");
        }
    }

    cluster.node(1).faults.cut();
    for i in [0, 2] {
        let (link, h) = &links[i];
        assert_eq!(link.client.load(h, &docs[i].0).await.unwrap(), docs[i].1, "node {i} still serves");
    }
    let (link, h) = &links[1];
    let t = Instant::now();
    let err = link.client.load(h, &docs[1].0).await.unwrap_err();
    assert!(matches!(err, ClientError::Io(_) | ClientError::Connect { .. }), "a clean failure, not {err:?}");
    let fresh = cluster.link(1).await;
    let err = fresh.client.exists_keys(h, &h.keys(&docs[1].0)).await.unwrap_err();
    assert!(matches!(err, ClientError::Io(_) | ClientError::Connect { .. }), "a clean failure, not {err:?}");
    assert!(t.elapsed() < Duration::from_secs(1), "failing took {:?}", t.elapsed());

    // Healed, node 1 serves what it held.
    cluster.node(1).faults.clear();
    assert_eq!(link.client.load(h, &docs[1].0).await.unwrap(), docs[1].1);
    assert_eq!(fresh.client.load(h, &docs[1].0).await.unwrap(), docs[1].1);
    cluster.stop().await;
}

macro_rules! over_both {
    ($($flow:ident),* $(,)?) => {
        mod duplex {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $flow() {
                    super::$flow(super::Transport::Duplex).await
                }
            )*
        }
        mod unix {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $flow() {
                    super::$flow(super::Transport::Unix).await
                }
            )*
        }
    };
}

over_both!(
    round_trip,
    corrupted_on_the_way_in_is_refused_and_never_stored,
    hashed_on_the_way_in_and_checked_after_the_payload,
    corrupted_on_the_way_out_is_never_handed_over,
    damaged_in_dram_is_a_miss_at_the_client_and_dropped_by_the_node,
    a_cut_mid_put_leaves_no_partial_block,
    a_stall_past_the_timeout_is_a_timeout_then_a_fresh_connection_works,
    three_nodes_one_cut,
);
