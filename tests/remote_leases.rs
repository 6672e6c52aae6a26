//! Remote leases against a real in-process node over loopback TCP: a peer leases slots of the
//! node's DRAM arena over the data plane and moves the bytes one-sidedly. The fabric is the
//! agent's loopback fabric (a copy in place of an RDMA NIC, which this machine has not), plugged
//! in behind the server's `Fabric` seam and driven through the agent's `BulkMover` trait, as the
//! verbs mover would be.
//!
//! What is checked: committed blocks load byte for byte through a plain `GET`; read leases hand
//! out stored payloads and keep their slots from reuse until ended; bytes that don't match their
//! header, unknown or repeated lease ids, an unknown namespace, a peer that leaves before its
//! commit, a lease past its deadline, a connection over its lease limit and peers over their
//! node-wide share of read-leased or write-leased bytes are refused each with its own status, and
//! nothing refused becomes visible; a node without a fabric says so and
//! serves on.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvtier_agent::mover::loopback::{LoopbackFabric, LoopbackMover, LoopbackRegion};
use kvtier_agent::mover::{BulkMover, EndpointDescriptor};
use kvtier_agent::{AgentError, HostBuffer};
use kvtier_client::{
    ClientConfig, ClientError, GetGrant, ItemStatus, KvClient, LeaseSession, NamespaceHandle, PutGrant,
};
use kvtier_proto::dataplane::SlotDescriptor;
use kvtier_proto::{BlockFrame, BlockKey, FrameHeader};
use kvtier_server::config::{ByteSize, DurationStr};
use kvtier_server::fabric::{MAX_REMOTE_LEASES, WRITE_QUARANTINE};
use kvtier_server::{RunningServer, ServerConfig};
use kvtier_tests::fabric::{connect_peer, peer_endpoint, ArenaOnLoopback};
use kvtier_tests::*;

const T: Duration = Duration::from_secs(5);

/// A lease session connected to the node's fabric, and `peer`'s mover connected to the node's end.
async fn connected_peer(client: &KvClient, peer: &Peer) -> LeaseSession {
    let mut session = client.lease_session().await.unwrap();
    let node = session.connect(&peer_endpoint()).await.unwrap();
    EndpointDescriptor::decode(&node).expect("the node's endpoint comes back");
    connect_peer(&peer.mover, &node).unwrap();
    session
}

/// A node (with the loopback fabric attached when `fabric`), a client and a namespace.
struct Setup {
    _dir: tempfile::TempDir,
    server: RunningServer,
    client: KvClient,
    ns: NamespaceHandle,
    fabric: Arc<LoopbackFabric>,
}

async fn setup(fabric: bool, tweak: impl FnOnce(&mut ServerConfig)) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let mut config =
        ServerConfig { dram_capacity: ByteSize(8 << 20), ..kvtier_tests::harness::node_config(dir.path()) };
    tweak(&mut config);
    let token = config.auth_token.clone();
    let server = kvtier_server::start(config, None).await.expect("start");
    let loopback = LoopbackFabric::new();
    if fabric {
        server.state.attach_fabric(Arc::new(ArenaOnLoopback(loopback.clone()))).expect("attach");
        let again = server.state.attach_fabric(Arc::new(ArenaOnLoopback(loopback.clone())));
        assert!(again.is_err(), "a second fabric is refused");
    }
    // The node's operator (its `auth_token`, if it has one).
    let cfg = ClientConfig { auth_token: token, ..ClientConfig::default() };
    let client = KvClient::connect(&server.grpc_addr.to_string(), cfg).await.unwrap();
    let ns = client.register(namespace("remote", b"r", small_layout())).await.unwrap();
    Setup { _dir: dir, server, client, ns, fabric: loopback }
}

/// The peer's side: its own mover on the fabric and a registered staging buffer.
struct Peer {
    mover: LoopbackMover,
    staging: LoopbackRegion,
}

impl Peer {
    fn new(fabric: &Arc<LoopbackFabric>, len: usize) -> Peer {
        let mover = LoopbackMover::new(fabric);
        let staging = mover.register(&HostBuffer::new(len)).unwrap();
        Peer { mover, staging }
    }

    /// Writes `bytes` into `slot` one-sidedly.
    fn put(&self, slot: &SlotDescriptor, bytes: &[u8]) -> Result<(), AgentError> {
        kvtier_agent::mover::MoverRegion::buffer(&self.staging).write(0, bytes)?;
        self.mover.write(&self.staging, 0, slot, 0, bytes.len(), T)
    }

    /// Reads `slot` one-sidedly.
    fn get(&self, slot: &SlotDescriptor) -> Vec<u8> {
        let n = slot.len as usize;
        self.mover.read(slot, 0, &self.staging, 0, n, T).unwrap();
        let mut out = vec![0u8; n];
        kvtier_agent::mover::MoverRegion::buffer(&self.staging).read(0, &mut out).unwrap();
        out
    }
}

fn frames(ns: &NamespaceHandle, seed: u32, n: usize) -> Vec<BlockFrame> {
    let toks = tokens(seed, ns.block_tokens() * n);
    ns.keys(&toks)
        .into_iter()
        .map(|k| ns.frame(k, ns.block_tokens() as u32, payload_for(&k, ns.block_bytes())).unwrap())
        .collect()
}

fn granted(g: &PutGrant) -> kvtier_proto::dataplane::LeaseGrant {
    match g {
        PutGrant::Granted(g) => *g,
        other => panic!("expected a grant, got {other:?}"),
    }
}

async fn loaded(client: &KvClient, ns: &NamespaceHandle, keys: &[BlockKey]) -> Vec<Option<Bytes>> {
    client.load_keys(ns, keys).await.unwrap().into_iter().map(|f| f.map(|f| f.payload)).collect()
}

/// Waits (up to `within`) until `done` holds: the node's connection tasks act on their own time.
async fn until(within: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !done() {
        assert!(Instant::now() < deadline, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Writes `bytes` into `slot` through `peer` until the write is refused (up to 10 s), and the
/// refusal: the node drops a connection's endpoint when its task sees the connection end, a
/// little after the client closed it. (The writes before that land in the slot the peer leased.)
async fn until_cut_off(peer: &Peer, slot: &SlotDescriptor, bytes: &[u8]) -> AgentError {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match peer.put(slot, bytes) {
            Err(e) => return e,
            Ok(()) => {
                assert!(Instant::now() < deadline, "the peer still reaches the arena 10 s after its connection closed")
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until a lease granted before `granted_by` is past its `ttl` on the node's clock (the
/// same clock: the node runs in this process), and a little more. A lease's end can't be polled
/// for: a commit or `END_GET` before its deadline would end it early.
async fn past_deadline(granted_by: Instant, ttl: Duration) {
    tokio::time::sleep_until((granted_by + ttl + Duration::from_millis(100)).into()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_writes_blocks_one_sidedly_and_commits_them() {
    let s = setup(true, |_| {}).await;
    let peer = Peer::new(&s.fabric, s.ns.block_bytes() as usize);
    let blocks = frames(&s.ns, 1, 4);
    let headers: Vec<FrameHeader> = blocks.iter().map(|b| b.header).collect();
    let keys: Vec<BlockKey> = headers.iter().map(|h| h.key).collect();
    let mut session = connected_peer(&s.client, &peer).await;
    let grants = session.lease_put(&headers).await.unwrap();
    assert_eq!(grants.len(), 4);
    let mut ids = Vec::new();
    for (g, b) in grants.iter().zip(&blocks) {
        let g = granted(g);
        assert_eq!(g.slot.len, b.header.payload_len, "the slot is exactly the payload");
        peer.put(&g.slot, &b.payload).unwrap();
        ids.push(g.lease);
    }
    // Written but not committed: nobody sees them yet.
    assert_eq!(s.client.exists_keys(&s.ns, &keys).await.unwrap(), vec![false; 4]);
    assert_eq!(session.commit(&ids).await.unwrap(), vec![ItemStatus::Ok; 4]);
    let got = loaded(&s.client, &s.ns, &keys).await;
    for (g, b) in got.iter().zip(&blocks) {
        assert_eq!(g.as_deref(), Some(&b.payload[..]), "byte for byte");
    }
    // Held now: a second lease asks for nothing to be written.
    assert_eq!(session.lease_put(&headers[..1]).await.unwrap(), vec![PutGrant::Present]);
    // A committed lease is over.
    assert_eq!(session.commit(&ids[..1]).await.unwrap(), vec![ItemStatus::NoLease]);
    s.server.stop(T).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_leases_hand_out_stored_payloads_and_keep_their_slots_until_ended() {
    let s = setup(true, |_| {}).await;
    let peer = Peer::new(&s.fabric, s.ns.block_bytes() as usize);
    let blocks = frames(&s.ns, 2, 3);
    assert_eq!(s.client.store_frames(&blocks).await.unwrap(), vec![ItemStatus::Ok; 3]);
    let missing = frames(&s.ns, 3, 1)[0].header.key;
    let keys = [blocks[0].header.key, blocks[1].header.key, missing, blocks[2].header.key];
    let mut session = connected_peer(&s.client, &peer).await;

    let grants = session.lease_get(s.ns.id, &keys, false).await.unwrap();
    assert_eq!(grants[2], GetGrant::Miss);
    let mut ids = Vec::new();
    for (i, b) in [(0, &blocks[0]), (1, &blocks[1]), (3, &blocks[2])] {
        let GetGrant::Granted { header, grant } = grants[i] else { panic!("{:?}", grants[i]) };
        assert_eq!(header.key, b.header.key);
        let bytes = peer.get(&grant.slot);
        header.verify_payload(&bytes).expect("what a read lease reads checks out");
        assert!(bytes == b.payload, "the read lease's bytes are the stored block's");
        ids.push(grant.lease);
    }

    // The longest stored prefix: everything after the first miss is a miss, unlooked-at.
    let prefix = session.lease_get(s.ns.id, &[keys[0], missing, keys[1]], true).await.unwrap();
    assert!(matches!(prefix[0], GetGrant::Granted { .. }));
    assert_eq!(&prefix[1..], &[GetGrant::Miss, GetGrant::Miss]);

    // A leased slot is not reused: the block purged and the arena filled with other blocks, the
    // lease still reads the block's bytes.
    let held = match grants[0] {
        GetGrant::Granted { grant, .. } => grant,
        _ => unreachable!(),
    };
    s.client.purge(&s.ns).await.unwrap();
    assert_eq!(loaded(&s.client, &s.ns, &keys[..1]).await, vec![None]);
    let others = frames(&s.ns, 4, 300); // ~9.4 MiB through an 8 MiB tier
    for chunk in others.chunks(32) {
        s.client.store_frames(chunk).await.unwrap();
    }
    assert!(peer.get(&held.slot) == blocks[0].payload, "a leased slot was reused while leased");

    assert_eq!(session.end_get(&ids).await.unwrap(), vec![ItemStatus::Ok; 3]);
    assert_eq!(session.end_get(&ids[..1]).await.unwrap(), vec![ItemStatus::NoLease], "ended once");
    s.server.stop(T).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_writes_and_bad_ids_are_refused_and_nothing_refused_is_seen() {
    let s = setup(true, |_| {}).await;
    let peer = Peer::new(&s.fabric, 2 * s.ns.block_bytes() as usize);
    let blocks = frames(&s.ns, 5, 4);
    let keys: Vec<BlockKey> = blocks.iter().map(|b| b.header.key).collect();
    let mut session = connected_peer(&s.client, &peer).await;
    let grants = session.lease_put(&[blocks[0].header, blocks[1].header]).await.unwrap();
    let (g0, g1) = (granted(&grants[0]), granted(&grants[1]));

    // Bytes that don't match the header: refused, not stored.
    let mut wrong = blocks[0].payload.to_vec();
    wrong[100] ^= 1;
    peer.put(&g0.slot, &wrong).unwrap();
    // A write past the slot is refused by the mover before it is posted.
    let long = vec![7u8; g1.slot.len as usize + 1];
    assert!(matches!(peer.put(&g1.slot, &long), Err(AgentError::OutsideLease { .. })));
    peer.put(&g1.slot, &blocks[1].payload).unwrap();
    let st = session.commit(&[g0.lease, g1.lease, 999_999, g1.lease]).await.unwrap();
    assert_eq!(st, vec![ItemStatus::ChecksumMismatch, ItemStatus::Ok, ItemStatus::NoLease, ItemStatus::NoLease]);
    let got = loaded(&s.client, &s.ns, &keys[..2]).await;
    assert_eq!(got[0], None, "a mismatched block is not stored");
    assert_eq!(got[1].as_deref(), Some(&blocks[1].payload[..]));

    // An unknown namespace is refused per item.
    let mut stranger = blocks[2].header;
    stranger.namespace = kvtier_proto::NamespaceId([0xab; 16]);
    let st = session.lease_put(&[stranger, blocks[2].header]).await.unwrap();
    assert_eq!(st[0], PutGrant::Refused(ItemStatus::UnknownNamespace));
    let g2 = granted(&st[1]);

    // A peer that leaves before its commit: nothing it wrote becomes visible, once the node has
    // seen its connection end.
    peer.put(&g2.slot, &blocks[2].payload).unwrap();
    drop(session);
    until_cut_off(&peer, &g2.slot, &blocks[2].payload).await;
    assert_eq!(s.client.exists_keys(&s.ns, &keys[2..3]).await.unwrap(), vec![false]);

    // The node serves on: the same block leased, written and committed on a new connection.
    let mut again = connected_peer(&s.client, &peer).await;
    let g = granted(&again.lease_put(&[blocks[2].header]).await.unwrap()[0]);
    peer.put(&g.slot, &blocks[2].payload).unwrap();
    assert_eq!(again.commit(&[g.lease]).await.unwrap(), vec![ItemStatus::Ok]);
    assert_eq!(loaded(&s.client, &s.ns, &keys[2..3]).await[0].as_deref(), Some(&blocks[2].payload[..]));
    s.server.stop(T).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_past_their_deadline_end_and_their_commits_are_refused() {
    let s = setup(true, |c| c.lease_timeout = DurationStr(Duration::from_millis(300))).await;
    let peer = Peer::new(&s.fabric, s.ns.block_bytes() as usize);
    let blocks = frames(&s.ns, 6, 4);
    assert_eq!(s.client.store_frames(&blocks[3..]).await.unwrap(), vec![ItemStatus::Ok]);
    let mut session = connected_peer(&s.client, &peer).await;
    let grants = session.lease_put(&[blocks[0].header, blocks[1].header]).await.unwrap();
    let (late, reaped) = (granted(&grants[0]), granted(&grants[1]));
    peer.put(&late.slot, &blocks[0].payload).unwrap();
    peer.put(&reaped.slot, &blocks[1].payload).unwrap();
    let read = match session.lease_get(s.ns.id, &[blocks[3].header.key], false).await.unwrap()[0] {
        GetGrant::Granted { grant, .. } => grant,
        other => panic!("{other:?}"),
    };
    let arena = s.server.state.arena_access().unwrap().clone();
    assert_eq!(arena.read_leased_bytes(), s.ns.block_bytes(), "the read lease is counted");
    // The connection wakes at the deadline with nothing sent: the read lease ends then.
    until(Duration::from_secs(10), "the read lease ends at its deadline", || arena.read_leased_bytes() == 0).await;
    // Committed late (its deadline came before the read lease's): refused.
    assert_eq!(session.commit(&[late.lease]).await.unwrap(), vec![ItemStatus::NoLease]);
    // A lease granted now is fresh. It too lasts 300 ms, less the node's commit margin of 30 ms:
    // a machine so busy that the grant, the write and the commit took longer than that tries
    // again with another.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let asked = Instant::now();
        let fresh = granted(&session.lease_put(&[blocks[2].header]).await.unwrap()[0]);
        peer.put(&fresh.slot, &blocks[2].payload).unwrap();
        let st = session.commit(&[reaped.lease, fresh.lease]).await.unwrap();
        if st[1] == ItemStatus::NoLease && asked.elapsed() >= Duration::from_millis(270) && Instant::now() < deadline {
            continue;
        }
        assert_eq!(st, vec![ItemStatus::NoLease, ItemStatus::Ok]);
        break;
    }
    assert_eq!(session.end_get(&[read.lease]).await.unwrap(), vec![ItemStatus::NoLease], "the read lease ended too");
    let keys: Vec<BlockKey> = blocks.iter().map(|b| b.header.key).collect();
    assert_eq!(s.client.exists_keys(&s.ns, &keys).await.unwrap(), vec![false, false, true, true]);
    s.server.stop(T).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_holds_at_most_its_lease_limit_and_the_node_its_read_leased_bytes() {
    let s = setup(true, |_| {}).await;
    let peer = Peer::new(&s.fabric, s.ns.block_bytes() as usize);
    // 1 KiB blocks: 4096 read leases are 4 MiB, half the node's cap (half its 16 MiB headroom).
    let tiny = s.client.register(namespace("remote", b"tiny", tiny_layout())).await.unwrap();
    let block = &frames(&tiny, 7, 1)[0];
    assert_eq!(s.client.store_frames(std::slice::from_ref(block)).await.unwrap(), vec![ItemStatus::Ok]);
    let mut session = connected_peer(&s.client, &peer).await;
    let keys = vec![block.header.key; MAX_REMOTE_LEASES / 2];
    let mut ids = Vec::new();
    for _ in 0..2 {
        for g in session.lease_get(tiny.id, &keys, false).await.unwrap() {
            let GetGrant::Granted { grant, .. } = g else { panic!("{g:?}") };
            ids.push(grant.lease);
        }
    }
    assert_eq!(ids.len(), MAX_REMOTE_LEASES);
    let over = session.lease_get(tiny.id, &keys[..2], false).await.unwrap();
    assert_eq!(over, vec![GetGrant::Refused(ItemStatus::Capacity); 2]);
    let over = session.lease_put(&[frames(&s.ns, 9, 1)[0].header]).await.unwrap();
    assert_eq!(over, vec![PutGrant::Refused(ItemStatus::Capacity)]);
    // Ending one makes room for one; another connection has its own limit.
    assert_eq!(session.end_get(&ids[..1]).await.unwrap(), vec![ItemStatus::Ok]);
    let one = session.lease_get(tiny.id, &keys[..2], false).await.unwrap();
    assert!(matches!(one[0], GetGrant::Granted { .. }));
    assert_eq!(one[1], GetGrant::Refused(ItemStatus::Capacity));
    // Another connection has a limit of its own, and the node its cap of read-leased bytes: the
    // 4 MiB left of it are 128 blocks of 32 KiB.
    let arena = s.server.state.arena_access().unwrap().clone();
    assert_eq!(arena.read_leased_bytes(), 4 << 20);
    let big = &frames(&s.ns, 8, 1)[0];
    assert_eq!(s.client.store_frames(std::slice::from_ref(big)).await.unwrap(), vec![ItemStatus::Ok]);
    let mut other = connected_peer(&s.client, &peer).await;
    let got = other.lease_get(s.ns.id, &vec![big.header.key; 130], false).await.unwrap();
    assert!(got[..128].iter().all(|g| matches!(g, GetGrant::Granted { .. })));
    assert_eq!(&got[128..], &[GetGrant::Refused(ItemStatus::Capacity); 2]);
    assert_eq!(arena.read_leased_bytes(), 8 << 20);
    // Connections that end give their bytes back.
    drop((session, other));
    until(Duration::from_secs(10), "the ended connections give their read-leased bytes back", || {
        arena.read_leased_bytes() == 0
    })
    .await;
    s.server.stop(T).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_write_leases_hold_half_the_lease_budget_and_plain_puts_keep_the_rest() {
    // 8 MiB of DRAM: a lease budget of 4 MiB (128 slots of 32 KiB), of which peers' write leases
    // may hold 2 MiB, node-wide. Leases last 3 s here.
    let s = setup(true, |c| c.lease_timeout = DurationStr(Duration::from_secs(3))).await;
    let peer = Peer::new(&s.fabric, s.ns.block_bytes() as usize);
    let arena = s.server.state.arena_access().unwrap().clone();
    let bb = s.ns.block_bytes();
    let blocks = frames(&s.ns, 21, 131);
    let headers: Vec<FrameHeader> = blocks.iter().map(|f| f.header).collect();
    let mut first = connected_peer(&s.client, &peer).await;
    let mut second = connected_peer(&s.client, &peer).await;
    // Peers ask for more than the whole budget: they get their half, whichever connection asks.
    let a = first.lease_put(&headers[..100]).await.unwrap();
    let a_granted = Instant::now();
    let b = second.lease_put(&headers[100..130]).await.unwrap();
    let grants = a.iter().chain(&b).filter(|g| matches!(g, PutGrant::Granted(_))).count();
    assert_eq!(grants, 64, "{a:?} {b:?}");
    assert!(a[64..].iter().chain(&b).all(|g| *g == PutGrant::Refused(ItemStatus::Capacity)));
    assert_eq!(arena.write_leased_bytes(), 2 << 20);
    // The node's own clients still store: their slots come from the other half of the budget.
    let own = frames(&s.ns, 22, 8);
    assert_eq!(s.client.store_frames(&own).await.unwrap(), vec![ItemStatus::Ok; 8]);
    // A commit gives its bytes back, and the next lease fits again.
    let g = granted(&a[0]);
    peer.put(&g.slot, &blocks[0].payload).unwrap();
    assert_eq!(first.commit(&[g.lease]).await.unwrap(), vec![ItemStatus::Ok]);
    assert_eq!(arena.write_leased_bytes(), (2 << 20) - bb);
    let last = second.lease_put(&headers[130..131]).await.unwrap();
    assert!(matches!(last[0], PutGrant::Granted(_)), "{last:?}");
    assert_eq!(arena.write_leased_bytes(), 2 << 20);
    // Past their deadline the leases end (a commit finds none), but their slots stay counted
    // while quarantined (a late write may still land in them: for 5 s from the deadline at the
    // soonest, so the check right after the commit has seconds to spare), and are given back
    // after.
    past_deadline(a_granted, Duration::from_secs(3)).await;
    assert_eq!(first.commit(&[granted(&a[1]).lease]).await.unwrap(), vec![ItemStatus::NoLease]);
    assert_eq!(arena.write_leased_bytes(), 2 << 20);
    until(WRITE_QUARANTINE + Duration::from_secs(10), "the quarantined slots are given back", || {
        arena.write_leased_bytes() == 0
    })
    .await;
    assert_eq!(loaded(&s.client, &s.ns, &[blocks[0].header.key]).await, vec![Some(blocks[0].payload.clone())]);
    drop((first, second));
    s.server.stop(T).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_header_in_a_lease_put_is_refused_alone_and_the_connection_stays_in_step() {
    use kvtier_proto::dataplane::{LeaseGrant, Op};
    use kvtier_tests::raw::Raw;

    let s = setup(true, |_| {}).await;
    let blocks = frames(&s.ns, 31, 4);
    let data = s.server.data_addr;
    let (statuses, again) = tokio::task::spawn_blocking(move || {
        use std::io::Write;
        let mut c = Raw::open(data);
        let endpoint = peer_endpoint();
        c.request(Op::Connect, 0, endpoint.len() as u32);
        c.0.write_all(&endpoint).unwrap();
        let h = c.response().unwrap();
        c.bytes(h.count as usize);
        // Three headers, the middle one damaged (its own checksum no longer matches).
        let mut bad = blocks[1].header.encode();
        bad[40] ^= 0xFF;
        c.request(Op::LeasePut, 0, 3);
        c.0.write_all(&blocks[0].header.encode()).unwrap();
        c.0.write_all(&bad).unwrap();
        c.0.write_all(&blocks[2].header.encode()).unwrap();
        assert_eq!(c.response().unwrap().count, 3);
        let mut items = Vec::new();
        for _ in 0..3 {
            let st = c.statuses(1)[0];
            if st == ItemStatus::Ok {
                LeaseGrant::decode(&c.bytes(LeaseGrant::LEN).try_into().unwrap()).unwrap();
            }
            items.push(st);
        }
        // The next request is read where it starts.
        c.request(Op::LeasePut, 0, 1);
        c.0.write_all(&blocks[3].header.encode()).unwrap();
        c.response().unwrap();
        (items, c.statuses(1)[0])
    })
    .await
    .unwrap();
    assert_eq!(statuses, [ItemStatus::Ok, ItemStatus::BadHeader, ItemStatus::Ok]);
    assert_eq!(again, ItemStatus::Ok);
    s.server.stop(T).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_a_fabric_refuses_leases_and_serves_on() {
    let s = setup(false, |_| {}).await;
    let blocks = frames(&s.ns, 9, 2);
    let mut session: LeaseSession = s.client.lease_session().await.unwrap();
    for err in [
        session.connect(&peer_endpoint()).await.unwrap_err(),
        session.lease_put(&[blocks[0].header]).await.unwrap_err(),
        session.lease_get(s.ns.id, &[blocks[0].header.key], false).await.unwrap_err(),
        session.commit(&[1, 2]).await.unwrap_err(),
    ] {
        assert!(
            matches!(&err, ClientError::Refused { code, message } if code == "dataplane:BadRequest" && message.contains("no one-sided fabric")),
            "{err:?}"
        );
    }
    // Read leases were never granted; the connection is still in step.
    assert_eq!(session.end_get(&[1]).await.unwrap(), vec![ItemStatus::NoLease]);
    assert_eq!(s.client.store_frames(&blocks).await.unwrap(), vec![ItemStatus::Ok; 2]);
    let keys: Vec<BlockKey> = blocks.iter().map(|b| b.header.key).collect();
    assert_eq!(loaded(&s.client, &s.ns, &keys).await[1].as_deref(), Some(&blocks[1].payload[..]));
    s.server.stop(T).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_connects_once_with_a_well_formed_endpoint_before_any_lease() {
    let s = setup(true, |_| {}).await;
    let block = &frames(&s.ns, 10, 1)[0];
    let mut session = s.client.lease_session().await.unwrap();
    let refused = |e: ClientError, what: &str| {
        assert!(
            matches!(&e, ClientError::Refused { code, message } if code == "dataplane:BadRequest" && message.contains(what)),
            "{e:?}"
        )
    };
    refused(session.lease_put(&[block.header]).await.unwrap_err(), "connect to the node's fabric first");
    refused(session.lease_get(s.ns.id, &[block.header.key], false).await.unwrap_err(), "first");
    refused(session.connect(b"not an endpoint").await.unwrap_err(), "loopback could not connect");
    // Each refusal left the connection in step: the peer connects, then leases.
    session.connect(&peer_endpoint()).await.unwrap();
    refused(session.connect(&peer_endpoint()).await.unwrap_err(), "connected to the fabric already");
    assert!(matches!(session.lease_put(&[block.header]).await.unwrap()[0], PutGrant::Granted(_)));
    // An endpoint over 256 bytes can't be a queue pair's: refused, and the connection ends.
    let mut big = s.client.lease_session().await.unwrap();
    let e = big.connect(&[0u8; 300]).await.unwrap_err();
    assert!(matches!(&e, ClientError::InvalidArgument(m) if m.contains("at most 256")), "{e:?}");
    assert!(big.lease_put(&[block.header]).await.is_err(), "that connection is gone");
    assert!(big.lease_put(&[block.header]).await.unwrap_err().to_string().contains("broke earlier"));
    s.server.stop(T).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_is_cut_off_with_its_connection_and_a_late_write_lands_in_no_other_block() {
    let s = setup(true, |c| c.lease_timeout = DurationStr(Duration::from_millis(300))).await;
    let peer = Peer::new(&s.fabric, s.ns.block_bytes() as usize);
    let blocks = frames(&s.ns, 11, 3);
    // The connection ends: the peer's moves no longer reach the arena at all.
    let mut session = connected_peer(&s.client, &peer).await;
    let gone = granted(&session.lease_put(&[blocks[0].header]).await.unwrap()[0]);
    drop(session);
    let e = until_cut_off(&peer, &gone.slot, &blocks[0].payload).await;
    assert!(matches!(&e, AgentError::RemoteAccess(m) if m.contains("connection")), "{e:?}");

    // A lease that passed its deadline while its peer stays connected: revoked, its slot kept
    // out of use, so the peer's late write lands in no block stored after it.
    let other = Peer::new(&s.fabric, s.ns.block_bytes() as usize);
    let mut session = connected_peer(&s.client, &other).await;
    let late = granted(&session.lease_put(&[blocks[1].header]).await.unwrap()[0]);
    past_deadline(Instant::now(), Duration::from_millis(300)).await;
    // Stored now, it would take the late lease's slot, were that slot free.
    assert_eq!(s.client.store_frames(&blocks[2..]).await.unwrap(), vec![ItemStatus::Ok]);
    other.put(&late.slot, &vec![0xEE; late.slot.len as usize]).unwrap();
    let got = loaded(&s.client, &s.ns, &[blocks[2].header.key]).await;
    assert!(got[0].as_deref() == Some(&blocks[2].payload[..]), "the block stored after the lease is intact");
    assert_eq!(session.commit(&[late.lease]).await.unwrap(), vec![ItemStatus::NoLease]);
    s.server.stop(T).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_operator_connects_to_the_fabric() {
    const OPERATOR: &str = "operator-token-0123456789";
    const TENANT: &str = "tenant-token-abcdefghijkl";
    let s = setup(true, |c| {
        c.auth_token = Some(OPERATOR.into());
        c.tenants = vec![kvtier_server::config::TenantConfig {
            name: "remote".into(),
            tokens: vec![TENANT.into()],
            ..Default::default()
        }];
    })
    .await;
    let as_tenant = KvClient::connect(
        &s.server.grpc_addr.to_string(),
        ClientConfig { auth_token: Some(TENANT.into()), ..ClientConfig::default() },
    )
    .await
    .unwrap();
    let mut session = as_tenant.lease_session().await.unwrap();
    // One registration covers every tenant's blocks: a tenant may not reach it one-sidedly.
    let e = session.connect(&peer_endpoint()).await.unwrap_err();
    assert!(matches!(&e, ClientError::Forbidden(m) if m.contains("only the operator")), "{e:?}");
    let e = session.lease_get(s.ns.id, &[BlockKey([1; 32])], false).await.unwrap_err();
    assert!(e.to_string().contains("connect to the node's fabric first"), "{e}");
    // The operator (the agent, the cluster's nodes) may.
    let peer = Peer::new(&s.fabric, s.ns.block_bytes() as usize);
    let mut session = connected_peer(&s.client, &peer).await;
    let block = &frames(&s.ns, 12, 1)[0];
    assert!(matches!(session.lease_put(&[block.header]).await.unwrap()[0], PutGrant::Granted(_)));
    s.server.stop(T).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_outside_dram_is_elsewhere_and_loads_over_get() {
    let s = setup(true, |c| c.disk_capacity = ByteSize(64 << 20)).await;
    let peer = Peer::new(&s.fabric, s.ns.block_bytes() as usize);
    let blocks = frames(&s.ns, 13, 300); // 9.4 MiB through an 8 MiB DRAM tier: the first go to disk
    for chunk in blocks.chunks(32) {
        s.client.store_frames(chunk).await.unwrap();
    }
    let first = blocks[0].header.key;
    let mut session = connected_peer(&s.client, &peer).await;
    let mut answer = GetGrant::Miss;
    // Up to ~15 s: the demotion to disk runs on a thread of its own.
    for _ in 0..300 {
        answer = session.lease_get(s.ns.id, &[first], false).await.unwrap()[0];
        if answer == GetGrant::Elsewhere {
            break;
        }
        if let GetGrant::Granted { grant, .. } = answer {
            session.end_get(&[grant.lease]).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(answer, GetGrant::Elsewhere, "demoted to disk: held, but not where a one-sided read reaches");
    assert!(loaded(&s.client, &s.ns, &[first]).await[0].as_deref() == Some(&blocks[0].payload[..]));
    s.server.stop(T).await.unwrap();
}
