//! The shared Redis tier between real `kvtier serve` processes (no kvtier cluster membership)
//! and real `redis-server`s on loopback, started and killed by pid: a block stored through one
//! node loads through another byte-identical; a session parked on one resumes on another; a value
//! damaged in Redis (with `redis-cli`) is a miss; a dead Redis makes misses within the timeout
//! while stores still succeed, and a restarted one works again; the byte budget holds in Redis
//! itself; on a 3-master Redis Cluster blocks spread over the masters and a master killed
//! mid-load gives misses, never wrong bytes, while the node keeps serving.

use std::time::{Duration, Instant};

use kvtier_client::{KvClient, NamespaceHandle, ParkOptions};
use kvtier_proto::{pb, BlockKey};
use kvtier_tests::redis::{redis_cli, redis_keys, Redis, RedisCluster};
use kvtier_tests::*;

const PREFIX: &str = "kvt";

/// A node whose Redis tier is `redis_tier` (the lines of the `[redis_tier]` table), with a 2 s
/// timeout: a live Redis on a busy machine answers within it, so the tests that count on hits get
/// them; a killed one refuses connections at once, so its misses come well within it.
fn node(dir: &std::path::Path, name: &str, redis_tier: &str) -> ServerProcess {
    let cfg = dir.join(format!("{name}.toml"));
    std::fs::write(&cfg, format!("[redis_tier]\nkey_prefix = \"{PREFIX}\"\ntimeout = \"2s\"\n{redis_tier}\n")).unwrap();
    ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"])
}

fn one_redis(r: &Redis, budget: &str) -> String {
    format!("url = \"{}\"\nbudget = \"{budget}\"\n", r.url())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The Redis key of a block.
fn block_name(ns: &NamespaceHandle, key: &BlockKey) -> String {
    format!("{PREFIX}:{}:b:{}", hex(&ns.id.0), hex(&key.0))
}

/// Waits (up to 30 s) until `node` has written `n` keys to Redis.
fn until_written(node: &ServerProcess, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let done = metric(&node.scrape(), "kvtier_redis_written_keys_total", &[]);
        if done >= n as f64 {
            return;
        }
        assert!(Instant::now() < deadline, "wrote {done} of {n} keys to Redis");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The Redis tier's line of a node's `Stats`.
async fn redis_stats(c: &KvClient) -> pb::TierStats {
    c.stats().await.unwrap().tiers.into_iter().find(|t| t.tier == "redis").expect("a redis tier in Stats")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_stored_on_one_node_loads_on_another_byte_identical() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let (n1, n2) =
        (node(dir.path(), "n1", &one_redis(&redis, "64MiB")), node(dir.path(), "n2", &one_redis(&redis, "64MiB")));
    let (a, b) = (n1.client().await, n2.client().await);
    let spec = namespace("acme", b"redis-salt", small_layout());
    let ns_a = a.register(spec.clone()).await.unwrap();
    let toks = tokens(1, 24 * 16);
    let payloads = full_block_payloads(&ns_a, &toks);
    a.store(&ns_a, &toks, &payloads).await.unwrap().ok().unwrap();
    until_written(&n1, 24);
    assert_eq!(redis_keys(redis.port, &format!("{PREFIX}:*")).len(), 24);

    let ns_b = b.register(spec).await.unwrap();
    assert_eq!(b.lookup(&ns_b, &toks).await.unwrap(), toks.len(), "n2's lookup counts what Redis holds");
    let before = redis_stats(&b).await;
    let loaded = b.load(&ns_b, &toks).await.unwrap();
    assert!(loaded == payloads, "exact bytes through n2 ({} of 24 blocks)", loaded.len());
    let after = redis_stats(&b).await;
    assert_eq!(after.hits - before.hits, 24);
    assert_eq!(after.errors, 0);
    // Kept in n2's DRAM: the same load doesn't ask Redis.
    assert!(b.load(&ns_b, &toks).await.unwrap() == payloads);
    assert_eq!(redis_stats(&b).await.requests, after.requests);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_parked_on_one_node_resumes_on_another() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let (n1, n2) =
        (node(dir.path(), "n1", &one_redis(&redis, "64MiB")), node(dir.path(), "n2", &one_redis(&redis, "64MiB")));
    let (a, b) = (n1.client().await, n2.client().await);
    let spec = namespace("agents", b"s", small_layout());
    let ns_a = a.register(spec.clone()).await.unwrap();
    let turn = tokens(7, 300); // 18 full blocks and a tail of 12
    let blocks = session_payloads(&ns_a, &turn);
    let opts = ParkOptions { ttl: Some(Duration::from_secs(120)), ..ParkOptions::default() };
    let info = a.park(&ns_a, "agent-7", &turn, &blocks, &opts, 0).await.unwrap();
    let name = format!("{PREFIX}:{}:s:{}", hex(&ns_a.id.0), hex(b"agent-7"));
    let ttl: i64 = redis_cli(redis.port, &["PTTL", &name]).trim().parse().unwrap();
    assert!(ttl > 120_000, "the manifest lives the session's TTL plus the slack: {ttl} ms");

    let ns_b = b.register(spec).await.unwrap();
    let r = b.resume(&ns_b, "agent-7").await.unwrap();
    assert_eq!((r.info.version, r.info.token_count, r.info.has_tail), (info.version, 300, true));
    assert!(r.blocks == blocks, "the session's KV, exact, through n2");
    // An unknown session is still not found.
    assert!(b.resume(&ns_b, "agent-8").await.is_err());
    // Dropped on n1: gone from Redis too.
    assert!(a.drop_session(&ns_a, "agent-7").await.unwrap());
    assert!(b.resume(&ns_b, "agent-7").await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_damaged_in_redis_is_a_miss_and_counted() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let (n1, n2) =
        (node(dir.path(), "n1", &one_redis(&redis, "64MiB")), node(dir.path(), "n2", &one_redis(&redis, "64MiB")));
    let (a, b) = (n1.client().await, n2.client().await);
    let spec = namespace("acme", b"damage", small_layout());
    let ns_a = a.register(spec.clone()).await.unwrap();
    let toks = tokens(3, 12 * 16);
    let payloads = full_block_payloads(&ns_a, &toks);
    a.store(&ns_a, &toks, &payloads).await.unwrap().ok().unwrap();
    until_written(&n1, 12);
    // Four bytes of block 5's payload (past the 128-byte frame header) overwritten in Redis.
    let keys = ns_a.keys(&toks);
    assert_eq!(
        redis_cli(redis.port, &["SETRANGE", &block_name(&ns_a, &keys[5]), "1000", "XYZW"]).trim().parse::<u64>().ok(),
        Some(128 + 32768)
    );
    let ns_b = b.register(spec).await.unwrap();
    let loaded = b.load(&ns_b, &toks).await.unwrap();
    assert_eq!(loaded.len(), 5, "the load stops at the damaged block");
    assert!(loaded[..] == payloads[..5]);
    let got = b.load_keys(&ns_b, &keys).await.unwrap();
    assert!(got[5].is_none(), "never the damaged bytes");
    assert_eq!(got.iter().filter(|f| f.is_some()).count(), 11);
    assert!(metric(&n2.scrape(), "kvtier_redis_bad_values_total", &[]) >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_redis_makes_misses_in_time_stores_still_succeed_and_a_restarted_one_works_again() {
    let mut redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let (n1, n2) =
        (node(dir.path(), "n1", &one_redis(&redis, "64MiB")), node(dir.path(), "n2", &one_redis(&redis, "64MiB")));
    let (a, b) = (n1.client().await, n2.client().await);
    let spec = namespace("acme", b"dead", small_layout());
    let (ns_a, ns_b) = (a.register(spec.clone()).await.unwrap(), b.register(spec).await.unwrap());
    let doc1 = tokens(11, 8 * 16);
    a.store(&ns_a, &doc1, &full_block_payloads(&ns_a, &doc1)).await.unwrap().ok().unwrap();
    until_written(&n1, 8);

    redis.kill();
    let t = Instant::now();
    assert_eq!(b.lookup(&ns_b, &doc1).await.unwrap(), 0);
    assert_eq!(b.load(&ns_b, &doc1).await.unwrap().len(), 0, "misses, no error");
    // Refused at once, not timed out: two calls that each waited out their 2 s would take 4 s.
    assert!(t.elapsed() < Duration::from_secs(3), "a lookup and a load with Redis dead took {:?}", t.elapsed());
    // Stores still succeed, and serve locally.
    let doc2 = tokens(12, 8 * 16);
    let p2 = full_block_payloads(&ns_a, &doc2);
    a.store(&ns_a, &doc2, &p2).await.unwrap().ok().unwrap();
    assert!(a.load(&ns_a, &doc2).await.unwrap() == p2);
    assert!(metric(&n2.scrape(), "kvtier_redis_errors_total", &[]) >= 1.0);

    redis.restart(); // empty: Redis lost its data
                     // The first write after the restart may still meet the broken connection: a new document
                     // each round until one crosses.
    let deadline = Instant::now() + Duration::from_secs(15);
    for round in 0.. {
        let doc = tokens(1000 + round, 8 * 16);
        let p = full_block_payloads(&ns_a, &doc);
        let before = metric(&n1.scrape(), "kvtier_redis_written_keys_total", &[]);
        a.store(&ns_a, &doc, &p).await.unwrap().ok().unwrap();
        let wait = Instant::now() + Duration::from_secs(2);
        while metric(&n1.scrape(), "kvtier_redis_written_keys_total", &[]) < before + 8.0 && Instant::now() < wait {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let got = b.load(&ns_b, &doc).await.unwrap();
        if got.len() == 8 {
            assert!(got == p, "exact bytes after the restart");
            break;
        }
        assert!(Instant::now() < deadline, "the Redis tier did not come back after Redis restarted");
    }
    assert!(metric(&n1.scrape(), "kvtier_redis_requests_total", &[]) > 0.0, "metrics are reported");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_byte_budget_holds_in_redis() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let n1 = node(dir.path(), "n1", &one_redis(&redis, "1MiB"));
    let a = n1.client().await;
    let ns = a.register(namespace("acme", b"budget", small_layout())).await.unwrap();
    // 96 blocks of 32 KiB: three times the budget.
    for doc in 0..6 {
        let toks = tokens(100 + doc, 16 * 16);
        a.store(&ns, &toks, &full_block_payloads(&ns, &toks)).await.unwrap().ok().unwrap();
    }
    until_written(&n1, 96);
    let keys = redis_keys(redis.port, &format!("{PREFIX}:*"));
    let bytes: u64 = keys
        .iter()
        .map(|k| redis_cli(redis.port, &["STRLEN", k]).trim().parse::<u64>().unwrap() + k.len() as u64)
        .sum();
    assert!(bytes <= 1 << 20, "{} keys, {bytes} bytes in Redis past the 1 MiB budget", keys.len());
    assert!(keys.len() >= 16, "the budget is used: {} keys", keys.len());
    let s = redis_stats(&a).await;
    assert!(s.resident_bytes <= 1 << 20 && s.capacity_bytes == 1 << 20 && s.evictions >= 60, "{s:?}");
    // The newest document is the one kept.
    let last = tokens(105, 16 * 16);
    let newest: Vec<String> = ns.keys(&last).iter().map(|k| block_name(&ns, k)).collect();
    assert!(newest.iter().all(|k| keys.contains(k)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cluster_spreads_blocks_and_a_master_killed_mid_load_gives_misses_never_wrong_bytes() {
    let mut cluster = RedisCluster::start();
    let dir = tempfile::tempdir().unwrap();
    let urls: Vec<String> = cluster.urls().iter().map(|u| format!("\"{u}\"")).collect();
    let section = format!("cluster = true\nurls = [{}]\nbudget = \"64MiB\"\n", urls.join(", "));
    let (n1, n2) = (node(dir.path(), "n1", &section), node(dir.path(), "n2", &section));
    let (a, b) = (n1.client().await, n2.client().await);
    let spec = namespace("acme", b"cluster", small_layout());
    let (ns_a, ns_b) = (a.register(spec.clone()).await.unwrap(), b.register(spec).await.unwrap());
    let docs: Vec<Vec<u32>> = (0..4).map(|d| tokens(200 + d, 24 * 16)).collect();
    let payloads: Vec<Vec<bytes::Bytes>> = docs.iter().map(|t| full_block_payloads(&ns_a, t)).collect();
    for (t, p) in docs.iter().zip(&payloads) {
        a.store(&ns_a, t, p).await.unwrap().ok().unwrap();
    }
    until_written(&n1, 96);
    let per_master: Vec<Vec<String>> = cluster.ports.iter().map(|&p| redis_keys(p, &format!("{PREFIX}:*"))).collect();
    let counts: Vec<usize> = per_master.iter().map(Vec::len).collect();
    assert_eq!(counts.iter().sum::<usize>(), 96, "{counts:?}");
    assert!(counts.iter().all(|&c| c >= 16), "blocks spread over the three masters: {counts:?}");
    assert!(b.load(&ns_b, &docs[0]).await.unwrap() == payloads[0], "all there before the kill");

    // Loads of document 1 run while master 0 is killed: each block is a miss or its exact bytes.
    let keys1 = ns_b.keys(&docs[1]);
    let load = {
        let (b, ns_b, keys1) = (b.clone(), ns_b.clone(), keys1.clone());
        tokio::spawn(async move {
            let mut rounds = Vec::new();
            for _ in 0..15 {
                let t = Instant::now();
                rounds.push((b.load_keys(&ns_b, &keys1).await.unwrap(), t.elapsed()));
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
            rounds
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    cluster.kill(0);
    for (got, took) in load.await.unwrap() {
        for (f, want) in got.iter().zip(&payloads[1]) {
            if let Some(f) = f {
                assert!(f.payload == *want, "wrong bytes from the Redis tier");
            }
        }
        assert!(took < Duration::from_secs(3), "a load took {took:?}");
    }
    // Afterwards documents 2 and 3: exactly the blocks on the live masters load, exact.
    for d in 2..4 {
        let keys = ns_b.keys(&docs[d]);
        let got = b.load_keys(&ns_b, &keys).await.unwrap();
        for (i, (f, want)) in got.iter().zip(&payloads[d]).enumerate() {
            let on_dead = per_master[0].contains(&block_name(&ns_b, &keys[i]));
            match f {
                Some(f) => assert!(!on_dead && f.payload == *want, "block {i} of document {d}"),
                None => assert!(on_dead, "block {i} of document {d} lives on a live master but missed"),
            }
        }
    }
    // The node keeps serving: its own stores and loads, and Stats.
    let doc = tokens(300, 8 * 16);
    let p = full_block_payloads(&ns_b, &doc);
    b.store(&ns_b, &doc, &p).await.unwrap().ok().unwrap();
    assert!(b.load(&ns_b, &doc).await.unwrap() == p);
    assert!(redis_stats(&b).await.errors >= 1);
}
