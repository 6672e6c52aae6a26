//! The Redis tier: its ledger and manifest format as plain data, and the tier itself against real
//! `redis-server` processes on loopback (one Redis, and a 3-master Redis Cluster), started and
//! killed by pid: blocks round-trip byte-identical, a damaged value is a miss, a dead Redis makes
//! misses within the timeout, the byte budget holds in Redis itself, and a master killed mid-load
//! gives misses, never wrong bytes.

use std::net::TcpListener;
use std::process::Command;
use std::time::{Duration, Instant};

use kvtier_proto::{BlockFrame, CodecId, DType, HashScheme, KvLayout};

use super::*;
use crate::config::{ByteSize, DurationStr};
use crate::test_redis::{binary, RedisProc};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// This server's keys under `prefix` and the bytes of their values.
fn usage(r: &RedisProc, prefix: &str) -> (u64, u64) {
    let mut c = r.con();
    let keys: Vec<String> = redis::cmd("KEYS").arg(format!("{prefix}:*")).query(&mut c).unwrap();
    let mut bytes = 0u64;
    for k in &keys {
        bytes += redis::cmd("STRLEN").arg(k).query::<u64>(&mut c).unwrap() + k.len() as u64 + KEY_OVERHEAD;
    }
    (keys.len() as u64, bytes)
}

/// Three cluster-enabled servers joined into a Redis Cluster of three masters (no replicas), with
/// `cluster-require-full-coverage no`: when one dies the others keep serving their slots.
fn redis_cluster() -> Vec<RedisProc> {
    let nodes: Vec<RedisProc> = (0..3).map(|_| RedisProc::start(true)).collect();
    let addrs: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
    let out = Command::new(binary("redis-cli"))
        .arg("--cluster")
        .arg("create")
        .args(&addrs)
        .arg("--cluster-yes")
        .output()
        .expect("redis-cli --cluster create");
    assert!(out.status.success(), "redis-cli --cluster create: {}", String::from_utf8_lossy(&out.stdout));
    let deadline = Instant::now() + Duration::from_secs(20);
    for n in &nodes {
        loop {
            let info: String = redis::cmd("CLUSTER").arg("INFO").query(&mut n.con()).unwrap();
            if info.contains("cluster_state:ok") {
                break;
            }
            assert!(Instant::now() < deadline, "the Redis Cluster did not become ok: {info}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    nodes
}

fn settings(urls: Vec<String>, cluster: bool, budget: u64) -> RedisTierConfig {
    RedisTierConfig {
        url: None,
        urls,
        cluster,
        budget: ByteSize(budget),
        block_ttl: DurationStr(Duration::from_secs(600)),
        session_ttl_slack: DurationStr(Duration::from_secs(60)),
        // Long enough for a live Redis on a busy machine (the tests count on its hits); a killed
        // one refuses connections at once, so its misses still come in milliseconds.
        timeout: DurationStr(Duration::from_secs(2)),
        key_prefix: format!("kvt{}", free_port()),
        write_queue_bytes: ByteSize(64 << 20),
    }
}

fn one(url: String, budget: u64) -> RedisTierConfig {
    RedisTierConfig { url: Some(url), urls: Vec::new(), ..settings(Vec::new(), false, budget) }
}

fn ns() -> Namespace {
    Namespace::new("t", "m@1", KvLayout::new(2, 2, 64, DType::Fp16, 16), HashScheme::Blake3, b"salt")
}

fn block(ns: &Namespace, i: u32) -> StoredBlock {
    let key = BlockKey(*blake3::hash(&i.to_le_bytes()).as_bytes());
    let len = ns.layout.block_bytes() as usize;
    let payload: Vec<u8> = (0..len).map(|j| (j as u32).wrapping_mul(31).wrapping_add(i) as u8).collect();
    let f = BlockFrame::new(ns.id(), key, ns.layout, CodecId::RAW, 16, Bytes::from(payload));
    StoredBlock { header: f.header, payload: f.payload }
}

fn stop() -> (watch::Sender<bool>, watch::Receiver<bool>) {
    watch::channel(false)
}

#[test]
fn the_ledger_lets_go_of_its_oldest_keys_and_never_under_counts() {
    let now = Instant::now();
    let later = now + Duration::from_secs(60);
    let mut l = Ledger::new(100);
    assert_eq!(l.admit("a", 40, later, now), Some(vec![]));
    assert_eq!(l.admit("b", 40, later, now), Some(vec![]));
    // Written again: counted once, and now the newest.
    assert_eq!(l.admit("a", 40, later, now), Some(vec![]));
    assert_eq!(l.used(), 80);
    let gone = l.admit("c", 40, later, now).unwrap();
    assert_eq!(gone.iter().map(|e| e.key.as_str()).collect::<Vec<_>>(), vec!["b"], "the oldest write goes first");
    assert_eq!((l.used(), l.len()), (80, 2));
    assert_eq!(l.admit("huge", 101, later, now), None, "larger than the budget alone: refused");
    // A delete that failed counts again (as the oldest), so the next write makes room for it.
    l.restore(gone);
    assert_eq!(l.used(), 120);
    let gone = l.admit("d", 10, later, now).unwrap();
    assert_eq!(gone.iter().map(|e| e.key.as_str()).collect::<Vec<_>>(), vec!["b"]);
    assert_eq!(l.used(), 90);
    // Expired keys leave the count without a delete.
    let mut l = Ledger::new(100);
    l.admit("old", 90, now + Duration::from_secs(1), now).unwrap();
    assert_eq!(l.admit("new", 50, later, now + Duration::from_secs(2)), Some(vec![]));
    assert_eq!(l.used(), 50);
    assert!(!l.holds_until("new", now), "not acknowledged yet: written again by the next store");
    l.confirm("new");
    assert!(l.holds_until("new", now + Duration::from_secs(59)) && !l.holds_until("old", now));
}

#[test]
fn a_manifest_round_trips_and_a_damaged_one_is_refused() {
    let now = Instant::now();
    let n = ns();
    let m = SessionManifest {
        namespace: n.id(),
        id: "agent-{7}".into(),
        keys: (0..5).map(|i| block(&n, i).header.key).collect(),
        tail: Some(block(&n, 99).header.key),
        token_count: 5 * 16 + 3,
        ttl: Duration::from_secs(30),
        expires_at: now + Duration::from_secs(30),
        priority: Priority::High,
        version: 4,
        bytes: 12345,
        created: None,
    };
    let v = encode_manifest(&m);
    assert_eq!(decode_manifest(&v, now), Some(m.clone()));
    for i in [0, 5, 20, v.len() / 2, v.len() - 1] {
        let mut bad = v.to_vec();
        bad[i] ^= 0x10;
        assert_eq!(decode_manifest(&bad, now), None, "a flipped byte at {i}");
    }
    assert_eq!(decode_manifest(&v[..v.len() - 3], now), None);
    // Braces in a session id don't become a hash tag.
    assert!(!session_key("kvtier", &m.namespace, &m.id).contains('{'));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_round_trip_through_redis_and_a_damaged_value_is_a_miss() {
    let r = RedisProc::start(false);
    let (_s, stop_rx) = stop();
    let (tier, _task) = RedisTier::start(one(r.url(), 64 << 20), stop_rx).unwrap();
    let n = ns();
    let blocks: Vec<StoredBlock> = (0..8).map(|i| block(&n, i)).collect();
    let keys: Vec<BlockKey> = blocks.iter().map(|b| b.header.key).collect();
    tier.store(blocks.clone());
    assert!(tier.flush(Duration::from_secs(5)).await);
    assert_eq!(tier.held(&n.id(), &keys).await, vec![true; 8]);
    let got = tier.fetch(&n, &keys).await;
    for (b, g) in blocks.iter().zip(&got) {
        let g = g.as_ref().expect("a hit");
        assert_eq!((g.header, &g.payload), (b.header, &b.payload));
    }
    // Someone overwrites one value, another with a different (valid) block: both are misses.
    let mut c = r.con();
    let k0 = block_key(tier.key_prefix(), &n.id(), &keys[0]);
    let mut damaged = frame_value(&blocks[0]).to_vec();
    damaged[FRAME_HEADER_LEN + 100] ^= 1;
    redis::cmd("SET").arg(&k0).arg(damaged).query::<()>(&mut c).unwrap();
    let k1 = block_key(tier.key_prefix(), &n.id(), &keys[1]);
    redis::cmd("SET").arg(&k1).arg(frame_value(&blocks[2]).to_vec()).query::<()>(&mut c).unwrap();
    let got = tier.fetch(&n, &keys[..3]).await;
    assert!(got[0].is_none() && got[1].is_none(), "damaged or misplaced values are misses");
    assert_eq!(got[2].as_ref().map(|b| &b.payload), Some(&blocks[2].payload));
    assert_eq!(tier.value_counts().0, 2, "both counted");
    // Another namespace never sees these keys.
    let other = Namespace::new("u", "m@1", n.layout, HashScheme::Blake3, b"other");
    assert_eq!(tier.fetch(&other, &keys[2..4]).await.iter().filter(|b| b.is_some()).count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_redis_makes_misses_within_the_timeout_and_a_restarted_one_works_again() {
    let mut r = RedisProc::start(false);
    let (_s, stop_rx) = stop();
    let (tier, _task) = RedisTier::start(one(r.url(), 64 << 20), stop_rx).unwrap();
    let n = ns();
    let b = block(&n, 1);
    tier.store(vec![b.clone()]);
    assert!(tier.flush(Duration::from_secs(5)).await);
    r.kill();
    let t = Instant::now();
    assert!(tier.fetch(&n, &[b.header.key]).await[0].is_none());
    assert_eq!(tier.held(&n.id(), &[b.header.key]).await, vec![false]);
    tier.store(vec![block(&n, 2)]);
    assert!(tier.flush(Duration::from_secs(5)).await, "a write to a dead Redis is dropped, not queued forever");
    // Refused at once, not timed out: three calls that each waited out their 2 s would take 6 s.
    assert!(t.elapsed() < Duration::from_secs(3), "three calls to a killed Redis took {:?}", t.elapsed());
    assert!(tier.stats().errors >= 2);
    r.restart(); // empty: Redis lost its data
    let b3 = block(&n, 3);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        tier.store(vec![b3.clone()]);
        assert!(tier.flush(Duration::from_secs(5)).await);
        if tier.fetch(&n, &[b3.header.key]).await[0].is_some() {
            break;
        }
        assert!(Instant::now() < deadline, "the tier did not reconnect to the restarted Redis");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_byte_budget_holds_in_redis_itself() {
    let r = RedisProc::start(false);
    let (_s, stop_rx) = stop();
    let budget = 1 << 20;
    let (tier, _task) = RedisTier::start(one(r.url(), budget), stop_rx).unwrap();
    let n = ns();
    let size = n.layout.block_bytes() + FRAME_HEADER_LEN as u64; // 8 KiB + header
    let count = 3 * budget / size; // three budgets' worth
    for i in 0..count as u32 {
        tier.store(vec![block(&n, i)]);
        if i % 16 == 0 {
            assert!(tier.flush(Duration::from_secs(5)).await);
        }
    }
    assert!(tier.flush(Duration::from_secs(5)).await);
    let (keys, bytes) = usage(&r, tier.key_prefix());
    assert!(bytes <= budget, "{keys} keys, {bytes} bytes in Redis past the {budget}-byte budget");
    assert!(bytes > budget / 2, "the budget is used, not starved: {bytes} bytes");
    assert!(tier.stats().evictions > 0);
    // The newest blocks are the ones kept.
    let last = block(&n, count as u32 - 1);
    assert!(tier.fetch(&n, &[last.header.key]).await[0].is_some());
    assert!(tier.fetch(&n, &[block(&n, 0).header.key]).await[0].is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cluster_spreads_blocks_over_its_masters_and_a_dead_master_gives_misses_never_wrong_bytes() {
    let mut nodes = redis_cluster();
    let (_s, stop_rx) = stop();
    let urls: Vec<String> = nodes.iter().map(RedisProc::url).collect();
    let (tier, _task) = RedisTier::start(settings(urls, true, 64 << 20), stop_rx).unwrap();
    assert!(tier.is_cluster());
    let n = ns();
    let blocks: Vec<StoredBlock> = (0..60).map(|i| block(&n, i)).collect();
    let keys: Vec<BlockKey> = blocks.iter().map(|b| b.header.key).collect();
    tier.store(blocks.clone());
    assert!(tier.flush(Duration::from_secs(10)).await);
    let per_master: Vec<u64> = nodes.iter().map(|m| usage(m, tier.key_prefix()).0).collect();
    assert_eq!(per_master.iter().sum::<u64>(), 60, "{per_master:?}");
    assert!(per_master.iter().all(|&k| k >= 8), "blocks spread over the masters: {per_master:?}");
    assert_eq!(tier.fetch(&n, &keys).await.iter().filter(|b| b.is_some()).count(), 60);
    // A master killed while loads run: every answer is a miss or the right bytes.
    let check = |got: Vec<Option<StoredBlock>>| {
        let mut hits = 0;
        for (b, g) in blocks.iter().zip(got) {
            if let Some(g) = g {
                assert_eq!((g.header, &g.payload), (b.header, &b.payload), "wrong bytes from the cluster");
                hits += 1;
            }
        }
        hits
    };
    let loads = {
        let tier = tier.clone();
        let (n, keys) = (n.clone(), keys.clone());
        tokio::spawn(async move {
            let mut rounds = Vec::new();
            for _ in 0..20 {
                let t = Instant::now();
                rounds.push((tier.fetch(&n, &keys).await, t.elapsed()));
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            rounds
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let dead_keys = per_master[0];
    nodes[0].kill();
    for (got, took) in loads.await.unwrap() {
        check(got);
        assert!(took < Duration::from_secs(3), "a load took {took:?} with a master dead");
    }
    // Past the cluster's node timeout (1 s): the dead master is marked failed, the slot map read
    // again, and still only its own keys are lost.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // Afterwards: the dead master's keys are misses, the others' still hits.
    let hits = check(tier.fetch(&n, &keys).await);
    assert_eq!(hits as u64, 60 - dead_keys, "the live masters keep serving their keys");
}
