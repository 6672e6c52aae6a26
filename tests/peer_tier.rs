//! The G4 peer tier between real `kvtier serve` processes sharing a real `redis-server` on
//! loopback: a block stored through one node loads through another (exact bytes, one peer
//! request per owner per client request, counted by the server itself), a replica serves when
//! the other owner was killed, and a stalled or killed sole owner gives a miss within a bounded
//! time, never a hang.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvtier_client::{KvClient, SharedBuffer};
use kvtier_proto::{pb, BlockKey, NamespaceId};
use kvtier_server::cluster::Placement;
use kvtier_tests::redis::Redis;
use kvtier_tests::*;

const IDS: [&str; 3] = ["n1", "n2", "n3"];

/// A node of the cluster (64 MiB of DRAM, so every node has the same placement weight).
fn node(redis: &Redis, dir: &std::path::Path, id: &str, rf: usize) -> ServerProcess {
    node_ttl(redis, dir, id, rf, "2s")
}

/// [`node`] with a membership TTL of `ttl` (a node stalled for less stays a member).
fn node_ttl(redis: &Redis, dir: &std::path::Path, id: &str, rf: usize, ttl: &str) -> ServerProcess {
    let cfg = dir.join(format!("{id}.toml"));
    std::fs::write(
        &cfg,
        format!(
            "cluster = \"{}\"\nnode_id = \"{id}\"\ncluster_ttl = \"{ttl}\"\npeer_rebalance = \"off\"\ncluster_rf = {rf}\npeer_timeout = \"1s\"\n",
            redis.url()
        ),
    )
    .unwrap();
    ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"])
}

/// Three nodes that see each other.
fn cluster(redis: &Redis, dir: &std::path::Path, rf: usize) -> Vec<ServerProcess> {
    let nodes: Vec<ServerProcess> = IDS.iter().map(|id| node(redis, dir, id, rf)).collect();
    until_members(&nodes, 3);
    nodes
}

/// The placement every node computes (same ids, same host label, same capacity).
fn placement() -> Placement {
    kvtier_tests::redis::placement(&IDS, 64 << 20)
}

fn owners(p: &Placement, ns: &NamespaceId, key: &BlockKey, rf: usize) -> BTreeSet<&'static str> {
    p.owners(ns, key, rf)
        .into_iter()
        .map(|i| IDS[IDS.iter().position(|id| *id == p.members()[i].id.as_str()).unwrap()])
        .collect()
}

/// The peer tier's line of a node's `Stats`.
async fn peer_stats(c: &KvClient) -> pb::TierStats {
    c.stats().await.unwrap().tiers.into_iter().find(|t| t.tier == "peer").expect("a peer tier in Stats")
}

/// The DRAM tier's line of a node's `Stats`.
async fn dram_stats(c: &KvClient) -> pb::TierStats {
    c.stats().await.unwrap().tiers.into_iter().find(|t| t.tier == "dram").expect("a DRAM tier in Stats")
}

/// Waits until `node` has forwarded `n` blocks to their other owners.
fn until_forwarded(node: &ServerProcess, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let m = node.scrape();
        let done = metric(&m, "kvtier_peer_forwarded_blocks_total", &[]);
        // The queue's gauge is lowered just after the count is raised.
        if done >= n as f64 && metric(&m, "kvtier_peer_forward_queue_bytes", &[]) == 0.0 {
            return;
        }
        assert!(Instant::now() < deadline, "forwarded {done} of {n} blocks");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_stored_via_one_node_loads_via_another_with_one_request_per_peer() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let nodes = cluster(&redis, dir.path(), 1);
    let (a, c) = (nodes[0].client().await, nodes[2].client().await);
    let spec = namespace("acme", b"peer-salt", small_layout());
    let ns_a = a.register(spec.clone()).await.unwrap();
    let toks = tokens(1, 24 * 16);
    let payloads = full_block_payloads(&ns_a, &toks);
    a.store(&ns_a, &toks, &payloads).await.unwrap().ok().unwrap();

    let p = placement();
    let keys = ns_a.keys(&toks);
    let owner: Vec<&str> = keys.iter().map(|k| *owners(&p, &ns_a.id, k, 1).iter().next().unwrap()).collect();
    until_forwarded(&nodes[0], owner.iter().filter(|o| **o != "n1").count());
    // The forward queue, and DRAM's open leases, are gauges: drained to 0 once forwarded.
    let m = nodes[0].scrape();
    assert!(m.contains("kvtier_peer_forward_queue_bytes ") && m.contains("kvtier_dram_leases "), "{m}");
    assert_eq!(metric(&m, "kvtier_peer_forward_queue_bytes", &[]), 0.0, "{m}");
    assert_eq!(metric(&m, "kvtier_dram_leased_bytes", &[]), 0.0, "{m}");

    // Through n3: its own blocks were forwarded to it; the others come from n1 and n2.
    let ns_c = c.register(spec).await.unwrap();
    // A lookup through n3 sees the whole prefix (its owners answer for what n3 lacks).
    assert_eq!(c.lookup(&ns_c, &toks).await.unwrap(), toks.len());
    let (before, dram_before) = (peer_stats(&c).await, dram_stats(&c).await);
    let loaded = c.load(&ns_c, &toks).await.unwrap();
    assert_eq!(loaded.len(), payloads.len(), "every block loads through n3");
    assert!(loaded == payloads, "exact bytes");
    let (after, dram_after) = (peer_stats(&c).await, dram_stats(&c).await);
    let remote: BTreeSet<&str> = owner.iter().copied().filter(|o| *o != "n3").collect();
    let remote_blocks = owner.iter().filter(|o| **o != "n3").count() as u64;
    assert!(remote_blocks > 0 && !remote.is_empty(), "some blocks live elsewhere: {owner:?}");
    assert_eq!(after.requests - before.requests, remote.len() as u64, "one request per peer: {remote:?}");
    assert_eq!(after.hits - before.hits, remote_blocks);
    assert_eq!(after.errors, 0);
    // Each block counted once, where it came from: n3's own from its DRAM, the others from the
    // peers and as DRAM misses (not also as DRAM hits of the copies the fetch cached).
    let local_blocks = keys.len() as u64 - remote_blocks;
    assert_eq!(dram_after.hits - dram_before.hits, local_blocks, "DRAM hits of one load");
    assert_eq!(dram_after.misses - dram_before.misses, remote_blocks, "DRAM misses of one load");

    // Cached on n3 (peer_cache): the same load asks no peer.
    let again = c.load(&ns_c, &toks).await.unwrap();
    assert!(again == payloads);
    assert_eq!(peer_stats(&c).await.requests, after.requests, "served from n3's DRAM");
    assert_eq!(dram_stats(&c).await.hits - dram_after.hits, keys.len() as u64, "every block a DRAM hit");
    // The CLI's stats: the peer line says what was asked of the others, not tier sizes.
    let (ok, out, err) = cli(&["stats", "--server", &nodes[2].grpc_addr()]);
    let peer = out.lines().find(|l| l.starts_with("peer:")).unwrap_or_default();
    let want = format!("peer: {} requests, 0 errors; hits {remote_blocks} ", after.requests);
    assert!(ok && peer.starts_with(&want) && !peer.contains("resident"), "{out} {err}");
}

/// A document of `blocks` blocks (tokens of `seed`) stored through n1 of the rf 2 cluster `nodes`
/// and forwarded to its other owners: the namespace, n1's handle of it, the tokens, the payloads.
async fn stored_through_n1(
    nodes: &[ServerProcess],
    salt: &[u8],
    seed: u32,
    blocks: usize,
) -> (kvtier_proto::Namespace, kvtier_client::NamespaceHandle, Vec<u32>, Vec<Bytes>) {
    let a = nodes[0].client().await;
    let spec = namespace("acme", salt, small_layout());
    let ns = a.register(spec.clone()).await.unwrap();
    let toks = tokens(seed, blocks * 16);
    let payloads = full_block_payloads(&ns, &toks);
    a.store(&ns, &toks, &payloads).await.unwrap().ok().unwrap();
    let p = placement();
    let copies: usize =
        ns.keys(&toks).iter().map(|k| owners(&p, &ns.id, k, 2).iter().filter(|o| **o != "n1").count()).sum();
    until_forwarded(&nodes[0], copies);
    (spec, ns, toks, payloads)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_rf2_a_killed_owner_leaves_the_other_replica() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let mut nodes = cluster(&redis, dir.path(), 2);
    let (spec, ns, toks, payloads) = stored_through_n1(&nodes, b"rf2-salt", 2, 24).await;
    let p = placement();
    let keys = ns.keys(&toks);
    let on_n1_n2 = keys.iter().filter(|k| owners(&p, &ns.id, k, 2) == BTreeSet::from(["n1", "n2"])).count();
    assert!(on_n1_n2 > 0, "some blocks are owned by n1 and n2 only");

    // kill -9 n2 while it is still a member: n3 finds n1's replica of what n2 co-owned.
    let _ = nodes[1].child.kill();
    let _ = nodes[1].child.wait();
    let c = nodes[2].client().await;
    let ns_c = c.register(spec).await.unwrap();
    let t = Instant::now();
    let loaded = c.load(&ns_c, &toks).await.unwrap();
    assert!(loaded == payloads, "all {} blocks, exact, without n2", payloads.len());
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_or_killed_sole_owner_is_a_bounded_miss() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let mut nodes = cluster(&redis, dir.path(), 1);
    let a = nodes[0].client().await;
    let spec = namespace("acme", b"dead-salt", small_layout());
    let ns = a.register(spec.clone()).await.unwrap();
    let toks = tokens(3, 32 * 16);
    let payloads = full_block_payloads(&ns, &toks);
    a.store(&ns, &toks, &payloads).await.unwrap().ok().unwrap();
    let p = placement();
    let keys = ns.keys(&toks);
    let owner: Vec<&str> = keys.iter().map(|k| *owners(&p, &ns.id, k, 1).iter().next().unwrap()).collect();
    until_forwarded(&nodes[0], owner.iter().filter(|o| **o != "n1").count());
    let on_n2: Vec<BlockKey> = keys.iter().zip(&owner).filter(|(_, o)| **o == "n2").map(|(k, _)| *k).collect();
    assert!(!on_n2.is_empty());

    let on_n1: Vec<BlockKey> = keys.iter().zip(&owner).filter(|(_, o)| **o == "n1").map(|(k, _)| *k).collect();
    assert!(!on_n1.is_empty());
    let c = nodes[2].client().await;
    let ns_c = c.register(spec).await.unwrap();

    // Killed (kill -9), still a member for up to its TTL: its keys miss at once.
    let _ = nodes[1].child.kill();
    let _ = nodes[1].child.wait();
    let t = Instant::now();
    let got = c.load_keys(&ns_c, &on_n2).await.unwrap();
    assert!(got.iter().all(Option::is_none), "n2's blocks miss");
    assert!(t.elapsed() < Duration::from_secs(3), "a killed owner held the load {:?}", t.elapsed());
    assert!(peer_stats(&c).await.errors >= 1, "the peer error is counted");

    // Stalled (SIGSTOP): its socket accepts, nothing answers. A miss within peer_timeout (1 s).
    stop_process(nodes[0].child.id());
    let t = Instant::now();
    let got = c.load_keys(&ns_c, &on_n1).await.unwrap();
    let took = t.elapsed();
    continue_process(nodes[0].child.id());
    assert!(got.iter().all(Option::is_none), "n1's blocks miss while it stalls");
    assert!(took < Duration::from_secs(3), "a stalled owner held the load {took:?}");

    // What n3 holds itself still loads, exact.
    let mine: Vec<(BlockKey, &Bytes)> =
        keys.iter().zip(&payloads).zip(&owner).filter(|(_, o)| **o == "n3").map(|((k, p), _)| (*k, p)).collect();
    let got = c.load_keys(&ns_c, &mine.iter().map(|r| r.0).collect::<Vec<_>>()).await.unwrap();
    for ((_, want), f) in mine.iter().zip(got) {
        assert_eq!(&f.expect("held by n3").payload, *want);
    }
}

/// The data plane's `EXISTS` and the same-node path see the cluster, not just the node: through
/// n3, `exists_keys` reports blocks held by n1 and n2, a same-node load into a shared buffer gets
/// them (exact bytes, counted as peer hits), and a same-node store on n1 reaches the blocks'
/// other owners.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exists_and_the_same_node_path_see_the_other_nodes() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let nodes = cluster(&redis, dir.path(), 1);
    let (a, c) = (nodes[0].client().await, nodes[2].client().await);
    let spec = namespace("acme", b"near-salt", small_layout());
    let ns_a = a.register(spec.clone()).await.unwrap();
    let ns_c = c.register(spec).await.unwrap();
    let toks = tokens(5, 24 * 16);
    let payloads = full_block_payloads(&ns_a, &toks);
    let keys = ns_a.keys(&toks);
    let p = placement();
    let owner: Vec<&str> = keys.iter().map(|k| *owners(&p, &ns_a.id, k, 1).iter().next().unwrap()).collect();
    let elsewhere = owner.iter().filter(|o| **o != "n1").count();
    assert!(elsewhere > 0 && owner.iter().any(|o| *o != "n3"), "{owner:?}");

    // Stored through n1's same-node socket, then forwarded to the other owners.
    let bb = ns_a.block_bytes() as usize;
    let mut src = SharedBuffer::new(keys.len() * bb).unwrap();
    for (i, pl) in payloads.iter().enumerate() {
        src.as_mut_slice()[i * bb..(i + 1) * bb].copy_from_slice(pl);
    }
    let offsets: Vec<u64> = (0..keys.len() as u64).map(|i| i * bb as u64).collect();
    let mut near_a = a.samenode().await.expect("n1's same-node socket");
    let st = near_a.store_from_buffer(&ns_a, &keys, &src, &offsets).await.unwrap();
    assert!(st.iter().all(|s| *s == kvtier_client::ItemStatus::Ok), "{st:?}");
    until_forwarded(&nodes[0], elsewhere);

    // EXISTS through n3 answers for the cluster (before: only n3's own share).
    let held = c.exists_keys(&ns_c, &keys).await.unwrap();
    assert!(held.iter().all(|h| *h), "every block is held somewhere: {held:?}");

    // A same-node load through n3 gets every block, the remote ones from their owners.
    let (before, dram_before) = (peer_stats(&c).await, dram_stats(&c).await);
    let mut near_c = c.samenode().await.expect("n3's same-node socket");
    let mut dst = SharedBuffer::new(keys.len() * bb).unwrap();
    let got = near_c.load_into_buffer(&ns_c, &keys, &mut dst, &offsets, false).await.unwrap();
    assert!(got.iter().all(|g| *g), "{got:?}");
    assert!(dst.as_slice() == src.as_slice(), "exact bytes");
    let (after, dram_after) = (peer_stats(&c).await, dram_stats(&c).await);
    let remote = owner.iter().filter(|o| **o != "n3").count() as u64;
    assert_eq!(after.hits - before.hits, remote, "n3 loaded the blocks it doesn't own from their owners");
    assert_eq!(dram_after.hits - dram_before.hits, keys.len() as u64 - remote, "DRAM hits: n3's own blocks");
}

/// A remote load larger than one chunk (`cluster::fetch::CHUNK_BYTES`, 16 MiB) is fetched in
/// chunks that run ahead of the answer — more than one request per owner — and every block is
/// still exact and in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_remote_load_comes_in_chunks_and_exact() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let nodes = cluster(&redis, dir.path(), 1);
    let (a, c) = (nodes[0].client().await, nodes[2].client().await);
    let layout = kvtier_proto::KvLayout::new(8, 8, 128, kvtier_proto::DType::Bf16, 32); // 1 MiB blocks
    let spec = namespace("acme", b"chunks", layout);
    let ns_a = a.register(spec.clone()).await.unwrap();
    let ns_c = c.register(spec).await.unwrap();
    let toks = tokens(8, 40 * 32);
    let payloads = full_block_payloads(&ns_a, &toks);
    a.store(&ns_a, &toks, &payloads).await.unwrap().ok().unwrap();
    let p = placement();
    let keys = ns_a.keys(&toks);
    let owner: Vec<&str> = keys.iter().map(|k| *owners(&p, &ns_a.id, k, 1).iter().next().unwrap()).collect();
    until_forwarded(&nodes[0], owner.iter().filter(|o| **o != "n1").count());
    let remote = owner.iter().filter(|o| **o != "n3").count();
    assert!(remote > 16, "more than one chunk of remote blocks: {remote}");
    let owners_asked: BTreeSet<&str> = owner.iter().copied().filter(|o| *o != "n3").collect();

    let before = peer_stats(&c).await;
    let loaded = c.load(&ns_c, &toks).await.unwrap();
    assert!(loaded == payloads, "all {} blocks, exact and in order", payloads.len());
    let after = peer_stats(&c).await;
    assert_eq!(after.hits - before.hits, remote as u64);
    assert!(
        after.requests - before.requests > owners_asked.len() as u64,
        "chunked: {} requests for {} owners",
        after.requests - before.requests,
        owners_asked.len()
    );
}

/// A purge or an unregistration asked of one node reaches every member, so no node keeps (and
/// hands back through the peer tier) what was deleted; a member that was away (stopped past its
/// TTL) is named in the answer and asked again when it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_or_an_unregistration_reaches_every_member_and_one_that_was_away() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    // rf 3: every node holds every block.
    let nodes = cluster(&redis, dir.path(), 3);
    let (a, b, c) = (nodes[0].client().await, nodes[1].client().await, nodes[2].client().await);
    let spec = namespace("acme", b"purge-salt", small_layout());
    let ns = a.register(spec.clone()).await.unwrap();
    let (ns_b, ns_c) = (b.register(spec.clone()).await.unwrap(), c.register(spec.clone()).await.unwrap());
    let toks = tokens(3, 8 * 16);
    let payloads = full_block_payloads(&ns, &toks);
    a.store(&ns, &toks, &payloads).await.unwrap().ok().unwrap();
    until_forwarded(&nodes[0], 16);
    assert_eq!(c.lookup(&ns_c, &toks).await.unwrap(), toks.len());

    let d = a.purge(&ns).await.unwrap();
    assert_eq!(d.blocks_removed, 8, "{d:?}");
    let peers = d.peers.clone().expect("a cluster's purge says what its other members did");
    assert_eq!((peers.members_done, peers.blocks_removed), (2, 16), "{d:?}");
    assert!(d.missed().is_empty(), "{d:?}");
    for (client, h) in [(&a, &ns), (&b, &ns_b), (&c, &ns_c)] {
        assert_eq!(client.lookup(h, &toks).await.unwrap(), 0, "a member kept purged blocks");
    }

    // n3 is away (stopped until its TTL ran out) while n1 purges: n1 names it, and purges it
    // when it is back. n1 and n2 hold nothing after the purge, so n3's lookup answering 0 says
    // its own copies went.
    a.store(&ns, &toks, &payloads).await.unwrap().ok().unwrap();
    until_forwarded(&nodes[0], 32);
    let pid3 = nodes[2].child.id();
    stop_process(pid3);
    until_members(&nodes[..2], 2);
    let d = a.purge(&ns).await.unwrap();
    assert_eq!(d.peers.as_ref().map(|p| p.members_done), Some(1), "{d:?}");
    assert!(d.missed().is_empty(), "a member away is no failure: {d:?}");
    assert_eq!(d.away().iter().map(|m| m.node_id.as_str()).collect::<Vec<_>>(), ["n3"], "{d:?}");
    continue_process(pid3);
    until_members(&nodes, 3);
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.lookup(&ns_c, &toks).await.unwrap() != 0 {
        assert!(Instant::now() < deadline, "n3 still holds blocks purged while it was away");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Counted once n3's answer is back and the log saved: after n3's lookup can answer 0.
    until_metric(&nodes[0], "kvtier_peer_deletes_retried_total", &[], 1.0);

    // An unregistration: the namespace is gone from every member.
    a.store(&ns, &toks, &payloads).await.unwrap().ok().unwrap();
    until_forwarded(&nodes[0], 48);
    let d = a.unregister(&ns).await.unwrap();
    assert_eq!((d.blocks_removed, d.peers.as_ref().map(|p| (p.members_done, p.blocks_removed))), (8, Some((2, 16))));
    for (client, h) in [(&b, &ns_b), (&c, &ns_c)] {
        let err = client.lookup(h, &toks).await.unwrap_err();
        assert!(matches!(err, kvtier_client::ClientError::UnknownNamespace(_)), "{err}");
    }
}

/// An unregistration owed to a member that was away survives a restart of the node that took
/// it (kept in its `owed_deletes.log`): the node killed and started again before the member comes
/// back still asks it, and the member serves nothing of the namespace afterwards. Before, what
/// was owed lived in memory only, and the member kept serving the deleted namespace for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unregistration_owed_to_a_member_away_survives_a_restart_of_the_node_that_took_it() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let mut nodes = cluster(&redis, dir.path(), 3);
    let (a, c) = (nodes[0].client().await, nodes[2].client().await);
    let spec = namespace("acme", b"owed-salt", small_layout());
    let ns = a.register(spec.clone()).await.unwrap();
    let ns_c = c.register(spec.clone()).await.unwrap();
    let toks = tokens(4, 8 * 16);
    a.store(&ns, &toks, &full_block_payloads(&ns, &toks)).await.unwrap().ok().unwrap();
    until_forwarded(&nodes[0], 16);
    assert_eq!(c.lookup(&ns_c, &toks).await.unwrap(), toks.len());

    // n3 away (stopped past its TTL) while n1 unregisters the namespace.
    let pid3 = nodes[2].child.id();
    stop_process(pid3);
    until_members(&nodes[..2], 2);
    let d = a.unregister(&ns).await.unwrap();
    assert_eq!(d.away().iter().map(|m| m.node_id.as_str()).collect::<Vec<_>>(), ["n3"], "{d:?}");
    assert!(nodes[0].dir.join("owed_deletes.log").exists(), "what n1 owes is on disk before it answers");

    // n1 killed and started again on its data directory before n3 is back.
    let _ = nodes[0].child.kill();
    let _ = nodes[0].child.wait();
    let cfg = dir.path().join("n1.toml");
    let again = nodes[0].restart_in_place(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"]);
    let _before = std::mem::replace(&mut nodes[0], again);
    until_members(&nodes[..2], 2);
    continue_process(pid3);
    until_members(&nodes, 3);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        match c.lookup(&ns_c, &toks).await {
            Err(kvtier_client::ClientError::UnknownNamespace(_)) => break,
            other => assert!(Instant::now() < deadline, "n3 still serves the unregistered namespace: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Asked by the restarted n1.
    until_metric(&nodes[0], "kvtier_peer_deletes_retried_total", &[], 1.0);
}

/// Blocks stored while one of their owners was down — stalled, still a member — reach it once it
/// answers again (hinted handoff), so the other nodes find them through their owner. Before, a
/// forward to an owner known to be down was dropped: with one copy per block they were held only
/// by the node that stored them, and every other node missed them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_an_owner_missed_while_it_was_down_are_handed_to_it_when_it_answers() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    // A TTL far above the stall: n3 stays a member, and calls to it fail.
    let nodes: Vec<ServerProcess> = IDS.iter().map(|id| node_ttl(&redis, dir.path(), id, 1, "60s")).collect();
    until_members(&nodes, 3);
    let (a, b) = (nodes[0].client().await, nodes[1].client().await);
    let spec = namespace("acme", b"handoff-salt", small_layout());
    let ns = a.register(spec.clone()).await.unwrap();
    let ns_b = b.register(spec).await.unwrap();
    let toks = tokens(6, 24 * 16);
    let payloads = full_block_payloads(&ns, &toks);
    let p = placement();
    let to_n3 = ns.keys(&toks).iter().filter(|k| owners(&p, &ns.id, k, 1).contains("n3")).count();
    assert!(to_n3 > 0, "n3 owns some of the blocks");

    let pid3 = nodes[2].child.id();
    stop_process(pid3);
    a.store(&ns, &toks, &payloads).await.unwrap().ok().unwrap();
    let n1 = |name: &str| metric(&nodes[0].scrape(), name, &[]);
    // n1's forward to n3 times out (peer_timeout 1 s): its blocks are held as hints.
    let deadline = Instant::now() + Duration::from_secs(10);
    while n1("kvtier_peer_handoff_pending") < to_n3 as f64 {
        assert!(Instant::now() < deadline, "{} of {to_n3} blocks held for n3", n1("kvtier_peer_handoff_pending"));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(n1("kvtier_peer_forward_dropped_total"), 0.0);
    continue_process(pid3);
    let deadline = Instant::now() + Duration::from_secs(15);
    while n1("kvtier_peer_handoff_sent_total") < to_n3 as f64 {
        assert!(Instant::now() < deadline, "{} of {to_n3} blocks handed to n3", n1("kvtier_peer_handoff_sent_total"));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A pass raises the sent count, then sets the pending gauge: polled, not read once.
    let deadline = Instant::now() + Duration::from_secs(15);
    while n1("kvtier_peer_handoff_pending") != 0.0 {
        assert!(Instant::now() < deadline, "{} hints still pending", n1("kvtier_peer_handoff_pending"));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Through n2: n3's blocks from n3, n1's from n1, its own from itself; exact bytes.
    let loaded = b.load(&ns_b, &toks).await.unwrap();
    assert_eq!(loaded.len(), payloads.len(), "every block loads through n2");
    assert!(loaded == payloads, "exact bytes");
}

/// The hints survive a restart of the node that holds them, for the blocks its disk tier keeps:
/// n1 (a disk tier under 16 MiB of DRAM) stores a document while its owner n3 is stalled, then
/// more, which pushes the document to disk; n1 is killed and comes back, takes its hints back from
/// `peer_hints.log`, and hands the document's blocks to n3 once n3 answers: n3 serves them. Before, a restart forgot them (hints lived in memory only), and with one
/// copy per block the other nodes missed those blocks for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hints_survive_a_restart_of_the_node_that_holds_them() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let cfg = |id: &str| {
        let cfg = dir.path().join(format!("{id}.toml"));
        let text = format!(
            "cluster = \"{}\"\nnode_id = \"{id}\"\ncluster_ttl = \"60s\"\npeer_rebalance = \"off\"\ncluster_rf = 1\npeer_timeout = \"1s\"\n\
             disk_capacity = \"112MiB\"\n",
            redis.url()
        );
        std::fs::write(&cfg, text).unwrap();
        cfg
    };
    // Every node 16 MiB of DRAM and 112 MiB of disk: one capacity, so the placement below is theirs.
    let paths: Vec<_> = IDS.iter().map(|id| cfg(id)).collect();
    let args: Vec<[&str; 4]> =
        paths.iter().map(|c| ["--config", c.to_str().unwrap(), "--dram-capacity", "16MiB"]).collect();
    let nodes: Vec<ServerProcess> = args.iter().map(|a| ServerProcess::start(a)).collect();
    until_members(&nodes, 3);
    let a = nodes[0].client().await;
    let ns = a.register(namespace("acme", b"hints-restart", small_layout())).await.unwrap();
    let doc = tokens(16, 24 * 16);
    let payloads = full_block_payloads(&ns, &doc);
    let p = kvtier_tests::redis::placement(&IDS, 128 << 20);
    let to_n3 = ns.keys(&doc).iter().filter(|k| owners(&p, &ns.id, k, 1).contains("n3")).count();
    assert!(to_n3 > 0, "n3 owns some of the blocks");

    let pid3 = nodes[2].child.id();
    stop_process(pid3);
    a.store(&ns, &doc, &payloads).await.unwrap().ok().unwrap();
    // 32 MiB more, in pieces: the document goes down to n1's disk.
    for i in 0..8u32 {
        let more = tokens(100 + i, 128 * 16);
        a.store(&ns, &more, &full_block_payloads(&ns, &more)).await.unwrap();
    }
    let n1 = |name: &str| metric(&nodes[0].scrape(), name, &[]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while n1("kvtier_disk_queue_depth") > 0.0 || n1("kvtier_peer_handoff_pending") < to_n3 as f64 {
        assert!(
            Instant::now() < deadline,
            "{} hints, {} queued for disk",
            n1("kvtier_peer_handoff_pending"),
            n1("kvtier_disk_queue_depth")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Saved every 2 s while they change: once on disk, n1 is killed (no stop to save at) and
    // started again on its data directory.
    let saved = || std::fs::metadata(nodes[0].dir.join("peer_hints.log")).map_or(0, |m| m.len());
    let deadline = Instant::now() + Duration::from_secs(30);
    while saved() < (to_n3 * 40) as u64 {
        assert!(Instant::now() < deadline, "peer_hints.log holds {} bytes", saved());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut nodes = nodes;
    let _ = nodes[0].child.kill();
    let _ = nodes[0].child.wait();
    let again = nodes[0].restart_in_place(&args[0]);
    let _old = std::mem::replace(&mut nodes[0], again);
    let n1 = |name: &str| metric(&nodes[0].scrape(), name, &[]);
    // Read back by a task of its own, soon after start.
    let deadline = Instant::now() + Duration::from_secs(30);
    while n1("kvtier_peer_handoff_pending") < to_n3 as f64 {
        assert!(Instant::now() < deadline, "{} hints taken back at start", n1("kvtier_peer_handoff_pending"));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    continue_process(pid3);
    let deadline = Instant::now() + Duration::from_secs(30);
    while n1("kvtier_peer_handoff_pending") > 0.0 {
        assert!(Instant::now() < deadline, "{} hints left after the restart", n1("kvtier_peer_handoff_pending"));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The document's blocks handed to n3.
    until_metric(&nodes[0], "kvtier_peer_handoff_sent_total", &[], to_n3 as f64);
    // n3 holds its blocks of the document now: served by n3 itself (their only owner), exact.
    let c3 = nodes[2].client().await;
    let ns3 = c3.register(namespace("acme", b"hints-restart", small_layout())).await.unwrap();
    let keys = ns.keys(&doc);
    let mine: Vec<usize> = (0..keys.len()).filter(|&i| owners(&p, &ns.id, &keys[i], 1).contains("n3")).collect();
    let got = c3.load_keys(&ns3, &mine.iter().map(|&i| keys[i]).collect::<Vec<_>>()).await.unwrap();
    for (&i, f) in mine.iter().zip(got) {
        let f = f.unwrap_or_else(|| panic!("n3 lacks block {i} of the document"));
        assert!(f.payload == payloads[i], "block {i}: wrong bytes");
    }
}

/// A node killed and started again with empty memory (rf 2) is still its keys' first replica
/// for the others, and misses them all: each miss it answers is asked of the key's other replica,
/// so every block still loads through another node, and the blocks it missed are sent back to it
/// (read repair). Before, a block whose first replica was the restarted node was a miss until
/// stored again, though its other replica held it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_restarted_empty_is_backed_by_the_other_replicas_and_repaired_by_reads() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let mut nodes = cluster(&redis, dir.path(), 2);
    let (spec, _, toks, payloads) = stored_through_n1(&nodes, b"restart-salt", 7, 48).await;

    // n2 killed and started again in place: its DRAM is empty.
    restart_n2_empty(&mut nodes, dir.path());
    let b = nodes[1].client().await;
    assert_eq!(dram_stats(&b).await.blocks, 0, "n2 came back empty");

    // Through n3 (once it has seen n2's new registration): every block, exact.
    let c = nodes[2].client().await;
    let ns_c = c.register(spec).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let loaded = c.load(&ns_c, &toks).await.unwrap();
        if loaded.len() == payloads.len() {
            assert!(loaded == payloads, "exact bytes");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {} blocks load through n3 with n2 restarted empty (rf 2)",
            loaded.len(),
            payloads.len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // What n2 missed was sent back to it: it holds those blocks now.
    let repaired = metric(&nodes[2].scrape(), "kvtier_peer_read_repairs_total", &[]);
    assert!(repaired > 0.0, "n3 asked n2 first for some of n1 and n2's blocks");
    let deadline = Instant::now() + Duration::from_secs(10);
    while (dram_stats(&b).await.blocks as f64) < repaired {
        assert!(
            Instant::now() < deadline,
            "n2 holds {} of the {repaired} blocks sent back",
            dram_stats(&b).await.blocks
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(metric(&nodes[2].scrape(), "kvtier_peer_moved_on_keys_total", &[]) >= repaired);
}

/// Kills n2 (`nodes[1]`, a node of [`node`] or [`rebalancing_node`]) and starts it again in
/// place, DRAM empty; returns once every node sees three members.
fn restart_n2_empty(nodes: &mut [ServerProcess], dir: &std::path::Path) {
    let _ = nodes[1].child.kill();
    let _ = nodes[1].child.wait();
    let cfg = dir.join("n2.toml");
    let again = nodes[1].restart_in_place(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"]);
    nodes[1] = again;
    until_members(&*nodes, 3);
}

/// What [`stored_before_n3_joins`] stored through n1 of a two-node `cluster_rf` 1 cluster.
struct BeforeTheJoin {
    spec: kvtier_proto::Namespace,
    toks: Vec<u32>,
    payloads: Vec<Bytes>,
    keys: Vec<BlockKey>,
    /// Indices of the keys n3 owns once it joins.
    moved: Vec<usize>,
}

/// Stores 48 blocks through n1 of `nodes` (n1 and n2, `cluster_rf` 1) and waits until n2 holds
/// those it owns.
async fn stored_before_n3_joins(nodes: &[ServerProcess], salt: &[u8], seed: u32) -> BeforeTheJoin {
    let a = nodes[0].client().await;
    let spec = namespace("acme", salt, small_layout());
    let ns = a.register(spec.clone()).await.unwrap();
    let toks = tokens(seed, 48 * 16);
    let payloads = full_block_payloads(&ns, &toks);
    a.store(&ns, &toks, &payloads).await.unwrap().ok().unwrap();
    let (two, three) = (kvtier_tests::redis::placement(&IDS[..2], 64 << 20), placement());
    let keys = ns.keys(&toks);
    let owner = |p: &Placement, k: &BlockKey| p.members()[p.owners(&ns.id, k, 1)[0]].id.to_string();
    until_forwarded(&nodes[0], keys.iter().filter(|k| owner(&two, k) == "n2").count());
    let moved: Vec<usize> = (0..keys.len()).filter(|&i| owner(&three, &keys[i]) == "n3").collect();
    assert!(!moved.is_empty(), "some keys move to n3");
    BeforeTheJoin { spec, toks, payloads, keys, moved }
}

/// A node joins (rf 1): keys that moved to it are stored with their former owners. A lookup and a
/// load through the newcomer find them there, and it keeps them as their owner; the old members
/// then find them at it. Before, every key that moved was a miss until stored again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_that_moved_to_a_node_that_joined_load_from_their_former_owners() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let mut nodes: Vec<ServerProcess> = IDS[..2].iter().map(|id| node(&redis, dir.path(), id, 1)).collect();
    until_members(&nodes, 2);
    let BeforeTheJoin { spec, toks, payloads, keys, moved } = stored_before_n3_joins(&nodes, b"join-salt", 8).await;

    nodes.push(node(&redis, dir.path(), "n3", 1));
    until_members(&nodes, 3);
    let c = nodes[2].client().await;
    let ns_c = c.register(spec.clone()).await.unwrap();
    assert_eq!(c.lookup(&ns_c, &toks).await.unwrap(), toks.len(), "a lookup through the newcomer");
    let loaded = c.load(&ns_c, &toks).await.unwrap();
    assert_eq!(loaded.len(), payloads.len(), "every block loads through the newcomer");
    assert!(loaded == payloads, "exact bytes");
    assert_eq!(
        metric(&nodes[2].scrape(), "kvtier_peer_repaired_here_total", &[]),
        moved.len() as f64,
        "kept as their owner"
    );
    // The old members find the moved keys at their new owner now.
    let b = nodes[1].client().await;
    let ns_b = b.register(spec).await.unwrap();
    let before = peer_stats(&c).await;
    let moved_keys: Vec<BlockKey> = moved.iter().map(|&i| keys[i]).collect();
    let got = b.load_keys(&ns_b, &moved_keys).await.unwrap();
    assert!(got.iter().all(Option::is_some), "n2 loads every moved block");
    assert_eq!(peer_stats(&c).await.requests, before.requests, "n3 asked nobody: it holds them");
}

/// A node of [`node`]'s kind that hands the blocks it holds to their new owners once a
/// membership change has been quiet for 1 s.
fn rebalancing_node(redis: &Redis, dir: &std::path::Path, id: &str, rf: usize) -> ServerProcess {
    let cfg = dir.join(format!("{id}.toml"));
    std::fs::write(
        &cfg,
        format!(
            "cluster = \"{}\"\nnode_id = \"{id}\"\ncluster_ttl = \"2s\"\ncluster_rf = {rf}\npeer_timeout = \"1s\"\n\
             peer_rebalance = \"1s\"\n",
            redis.url()
        ),
    )
    .unwrap();
    ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"])
}

/// Sum of a metric over `nodes`.
fn summed(nodes: &[ServerProcess], name: &str) -> f64 {
    nodes.iter().map(|n| metric(&n.scrape(), name, &[])).fold(0.0, |a, b| a + b)
}

/// Waits (up to 90 s: past the backup pass a minute after a change, should the first pass have
/// left a member out on a loaded host) until `c`'s node holds `n` blocks in DRAM; `what` for the
/// message.
async fn until_dram_blocks(c: &KvClient, n: usize, nodes: &[ServerProcess], what: &str) {
    let deadline = Instant::now() + Duration::from_secs(90);
    while dram_stats(c).await.blocks < n as u64 {
        assert!(
            Instant::now() < deadline,
            "{what} holds {} of the {n} blocks it owns ({} queued for new owners)",
            dram_stats(c).await.blocks,
            summed(nodes, "kvtier_peer_rebalance_queued_total")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// With `cluster_rf` 2, a node restarted with empty memory is handed the blocks it owns by
/// their other owners, before anyone reads them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_restarted_empty_is_handed_its_blocks_by_the_other_replicas_before_anyone_reads_them() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let mut nodes: Vec<ServerProcess> = IDS.iter().map(|id| rebalancing_node(&redis, dir.path(), id, 2)).collect();
    until_members(&nodes, 3);
    let (_, ns, toks, _) = stored_through_n1(&nodes, b"rebalance-restart-salt", 10, 48).await;
    let owned_by_n2 = ns.keys(&toks).iter().filter(|k| owners(&placement(), &ns.id, k, 2).contains("n2")).count();
    assert!(owned_by_n2 > 0);
    restart_n2_empty(&mut nodes, dir.path());
    let b = nodes[1].client().await;
    until_dram_blocks(&b, owned_by_n2, &nodes, "the restarted n2").await;
    assert_eq!(dram_stats(&b).await.blocks, owned_by_n2 as u64, "only the blocks n2 owns");
}

/// A node that joins is handed the blocks it now owns by their former owners, before anyone
/// reads them: once that is done, it serves them with the other nodes stalled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_that_moved_to_a_node_that_joined_are_handed_to_it_before_anyone_reads_them() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let mut nodes: Vec<ServerProcess> = IDS[..2].iter().map(|id| rebalancing_node(&redis, dir.path(), id, 1)).collect();
    until_members(&nodes, 2);
    let BeforeTheJoin { spec, payloads, keys, moved, .. } = stored_before_n3_joins(&nodes, b"rebalance-salt", 9).await;

    nodes.push(rebalancing_node(&redis, dir.path(), "n3", 1));
    until_members(&nodes, 3);
    // Nobody reads: n1 and n2 queue the moved blocks they own for n3, and handoff sends them.
    let queued = || summed(&nodes[..2], "kvtier_peer_rebalance_queued_total");
    let c = nodes[2].client().await;
    until_dram_blocks(&c, moved.len(), &nodes, "n3").await;
    // Once by its former owner; twice where n1 took n2's and n3's arrivals as one change (it
    // then counts itself the former owner of every block).
    assert!(queued() >= moved.len() as f64, "{} queued", queued());
    assert_eq!(dram_stats(&c).await.blocks, moved.len() as u64, "only the blocks n3 owns");

    // n1 and n2 stalled: n3 serves what it was handed, exact bytes, asking nobody.
    let ns_c = c.register(spec).await.unwrap();
    let before = peer_stats(&c).await;
    let pids: Vec<u32> = nodes[..2].iter().map(|n| n.child.id()).collect();
    pids.iter().for_each(|&p| stop_process(p));
    let moved_keys: Vec<BlockKey> = moved.iter().map(|&i| keys[i]).collect();
    let got = c.load_keys(&ns_c, &moved_keys).await;
    pids.iter().for_each(|&p| continue_process(p));
    let got = got.unwrap();
    for (j, &i) in moved.iter().enumerate() {
        let got = got[j].as_ref().map(|f| &f.payload);
        assert!(got == Some(&payloads[i]), "block {i}: {:?} bytes", got.map(|b| b.len()));
    }
    assert_eq!(peer_stats(&c).await.requests, before.requests, "n3 asked nobody");
}

const OPERATOR: &str = "operator-secret-0123456789";
const TOKEN_T: &str = "tenant-t-secret-0123456789";

/// Two nodes (`cluster_rf` 2) with an operator token and one tenant `t`, whose quota is
/// `quota` (a TOML line); `extra` flags for both.
fn tenant_pair(redis: &Redis, dir: &std::path::Path, quota: &str, extra: &[&str]) -> Vec<ServerProcess> {
    let nodes: Vec<ServerProcess> = ["n1", "n2"]
        .iter()
        .map(|id| {
            let cfg = dir.join(format!("{id}.toml"));
            std::fs::write(
                &cfg,
                format!(
                    "cluster = \"{}\"\nnode_id = \"{id}\"\ncluster_ttl = \"2s\"\npeer_rebalance = \"off\"\ncluster_rf = 2\npeer_timeout = \"1s\"\n\
                     auth_token = \"{OPERATOR}\"\n\n[[tenants]]\nname = \"t\"\ntokens = [\"{TOKEN_T}\"]\n{quota}\n",
                    redis.url()
                ),
            )
            .unwrap();
            let cfg = cfg.to_str().unwrap().to_string();
            let mut args = vec!["--config", cfg.as_str(), "--dram-capacity", "64MiB"];
            args.extend_from_slice(extra);
            ServerProcess::start(&args)
        })
        .collect();
    until_members(&nodes, 2);
    nodes
}

async fn client_as(node: &ServerProcess, token: &str) -> KvClient {
    let cfg = kvtier_client::ClientConfig { auth_token: Some(token.into()), ..Default::default() };
    KvClient::connect(&node.grpc_addr(), cfg).await.unwrap()
}

/// A tenant at its `max_namespaces` on a node is held to it there when its blocks arrive
/// forwarded from another node (the forwarding node registers them as the operator); and that
/// refusal is the tenant's, not a sign the node is down: it stays in use for everyone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_s_quota_holds_for_forwarded_blocks_and_its_refusal_takes_no_node_down() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let nodes = tenant_pair(&redis, dir.path(), "max_namespaces = 1", &[]);
    let (t1, t2, op1) = (
        client_as(&nodes[0], TOKEN_T).await,
        client_as(&nodes[1], TOKEN_T).await,
        client_as(&nodes[0], OPERATOR).await,
    );
    let m1 = t1.register(namespace("t", b"m1", small_layout())).await.unwrap();
    // n2's one namespace of t.
    t2.register(namespace("t", b"m2", small_layout())).await.unwrap();
    let toks = tokens(5, 4 * 16);
    t1.store(&m1, &toks, &full_block_payloads(&m1, &toks)).await.unwrap().ok().unwrap();
    let dropped = || metric(&nodes[0].scrape(), "kvtier_peer_forward_dropped_total", &[]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while dropped() < 4.0 {
        assert!(Instant::now() < deadline, "n2 did not refuse t's second namespace: {} dropped", dropped());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(t2.stats().await.unwrap().namespaces, 1, "n2 holds more than t's max_namespaces");
    // Right after the refusal, n1 still asks n2.
    let ops = op1.register(namespace("op", b"o", small_layout())).await.unwrap();
    let hint = op1.route_hint(&ops, &toks, None).await.unwrap();
    assert!(hint.node("n2").is_some_and(|n| n.reachable), "n2 was taken for down after a tenant's refusal: {hint:?}");
    assert!(metric(&nodes[0].scrape(), "kvtier_peer_errors_total", &[("op", "put")]) >= 1.0);
}

/// Blocks a tenant's DRAM quota evicts within the very store that wrote them (to disk) still
/// reach their other owners: read back from disk and forwarded, none dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_evicted_within_their_store_are_still_forwarded() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let nodes = tenant_pair(&redis, dir.path(), "dram_bytes = \"1MiB\"", &["--disk-capacity", "64MiB"]);
    let t1 = client_as(&nodes[0], TOKEN_T).await;
    let ns = t1.register(namespace("t", b"quota-forward", small_layout())).await.unwrap();
    // 64 blocks of 32 KiB: twice the tenant's DRAM quota, in one store.
    let toks = tokens(9, 64 * 16);
    t1.store(&ns, &toks, &full_block_payloads(&ns, &toks)).await.unwrap().ok().unwrap();
    assert!(metric(&nodes[0].scrape(), "kvtier_quota_evictions_total", &[]) > 0.0, "the quota evicted nothing");
    until_forwarded(&nodes[0], 64);
    assert_eq!(metric(&nodes[0].scrape(), "kvtier_peer_forward_dropped_total", &[]), 0.0);
}

/// A node whose `auth_token` differs from its peers' joins the cluster (membership is Redis's),
/// but every call it makes to them is refused: it says so at WARN and counts each refusal in
/// `kvtier_peer_credential_refused_total`, which its operator can alert on. Before, its misses
/// and lost copies showed only at DEBUG.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_auth_token_differs_counts_its_peers_refusals() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let nodes: Vec<ServerProcess> = [("n1", OPERATOR), ("n2", "another-operator-secret-0123")]
        .iter()
        .map(|(id, token)| {
            let cfg = dir.path().join(format!("{id}.toml"));
            std::fs::write(
                &cfg,
                format!(
                    "cluster = \"{}\"\nnode_id = \"{id}\"\ncluster_ttl = \"2s\"\npeer_rebalance = \"off\"\n\
                     cluster_rf = 2\npeer_timeout = \"1s\"\nauth_token = \"{token}\"\n",
                    redis.url()
                ),
            )
            .unwrap();
            ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"])
        })
        .collect();
    until_members(&nodes, 2);
    let c2 = client_as(&nodes[1], "another-operator-secret-0123").await;
    let ns = c2.register(namespace("acme", b"mismatch", small_layout())).await.unwrap();
    let toks = tokens(3, 4 * 16);
    // Stored on n2; its copies for n1 are refused there.
    c2.store(&ns, &toks, &full_block_payloads(&ns, &toks)).await.unwrap().ok().unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let m = nodes[1].scrape();
        if metric(&m, "kvtier_peer_credential_refused_total", &[]) >= 1.0 {
            break;
        }
        assert!(Instant::now() < deadline, "no refusal counted on n2: {m}");
        std::thread::sleep(Duration::from_millis(100));
    }
    // n1 took no call with n2's credential.
    assert_eq!(metric(&nodes[0].scrape(), "kvtier_peer_credential_refused_total", &[]), 0.0);
}
