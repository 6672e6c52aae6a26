//! Membership against a real `redis-server` on loopback, started and killed by pid: members see
//! each other, a graceful leave is seen at once, a dropped member goes after its TTL, Redis down
//! keeps the snapshot (stale) with every call bounded, Redis back makes members re-register, a
//! restarted process takes its id over, and a second live node with one id does not start.
//! Without `redis-server` these tests fail, saying so.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::AsyncCommands;

use super::*;
use crate::error::ServerError;
use crate::test_redis::RedisProc;

/// The ids in Redis's membership set.
async fn member_set(redis: &RedisProc) -> BTreeSet<String> {
    let client = redis::Client::open(redis.url()).unwrap();
    let mut con = client.get_multiplexed_async_connection().await.unwrap();
    con.smembers("{kvtier}:members").await.unwrap()
}

fn member(id: &str) -> Member {
    Member {
        id: NodeId::new(id).unwrap(),
        grpc_addr: format!("127.0.0.1:{}", 7000 + id.len()),
        data_addr: format!("127.0.0.1:{}", 8000 + id.len()),
        labels: Labels::new(Some(id), Some("r0"), Some("z0")),
        capacity: 1 << 30,
        since_ms: 0,
    }
}

fn config(redis: &RedisProc, id: &str, ttl_ms: u64) -> RedisMembershipConfig {
    config_for(redis, member(id), ttl_ms)
}

fn config_for(redis: &RedisProc, m: Member, ttl_ms: u64) -> RedisMembershipConfig {
    RedisMembershipConfig::new(redis.url(), m)
        .with_ttl(Duration::from_millis(ttl_ms))
        .with_poll_interval(Duration::from_millis(100))
        .with_op_timeout(Duration::from_millis(300))
}

fn ids(s: &Snapshot) -> Vec<&str> {
    s.members.iter().map(|m| m.id.as_str()).collect()
}

/// How long `key` has left to live in Redis (`PTTL`: negative when it has no TTL or is gone).
async fn time_to_live(redis: &RedisProc, key: &str) -> i64 {
    let client = redis::Client::open(redis.url()).unwrap();
    let mut con = client.get_multiplexed_async_connection().await.unwrap();
    con.pttl(key).await.unwrap()
}

/// Waits until `m`'s snapshot satisfies `pred`; panics with the last snapshot after `within`.
async fn until(m: &dyn Membership, within: Duration, what: &str, pred: impl Fn(&Snapshot) -> bool) {
    let mut rx = m.watch();
    if tokio::time::timeout(within, rx.wait_for(|s| pred(s))).await.is_err() {
        panic!("{}: not {what} within {within:?}; snapshot {:?}", m.local().id, m.snapshot());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_see_each_other_and_a_graceful_leave_is_seen_at_once() {
    let redis = RedisProc::start(false);
    // A long TTL: a member that disappears within a second was deleted, not expired.
    let ttl = 5000;
    let a = RedisMembership::start(config(&redis, "a", ttl)).await.unwrap();
    let b = RedisMembership::start(config(&redis, "b", ttl)).await.unwrap();
    let c = RedisMembership::start(config(&redis, "c", ttl)).await.unwrap();
    for m in [&a as &dyn Membership, &b, &c] {
        until(m, Duration::from_secs(15), "seeing a, b, c", |s| ids(s) == ["a", "b", "c"]).await;
        let s = m.snapshot();
        assert!(!s.stale);
        let got = s.get(&NodeId::new("b").unwrap()).cloned();
        // When b's process first registered travels too (its own view keeps 0 for itself).
        let since = got.as_ref().map_or(0, |g| g.since_ms);
        let now_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
        if m.local().id.as_str() != "b" {
            assert!(now_ms.abs_diff(since) < 60_000, "b's since_ms {since}, now {now_ms}");
        }
        assert_eq!(got, Some(Member { since_ms: since, ..member("b") }), "every field travels");
    }
    let left_at = Instant::now();
    b.leave().await.unwrap();
    for m in [&a as &dyn Membership, &c] {
        until(m, Duration::from_secs(1), "without b", |s| ids(s) == ["a", "c"]).await;
    }
    eprintln!("graceful leave seen by both others after {:?}", left_at.elapsed());
    assert_eq!(member_set(&redis).await, BTreeSet::from(["a".to_string(), "c".to_string()]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_dropped_without_leaving_disappears_after_its_ttl() {
    let redis = RedisProc::start(false);
    let ttl = Duration::from_millis(1500);
    let a = RedisMembership::start(config(&redis, "a", 1500)).await.unwrap();
    let b = RedisMembership::start(config(&redis, "b", 1500)).await.unwrap();
    until(&a, Duration::from_secs(15), "seeing b", |s| s.members.len() == 2).await;
    // What b's registration has left to live, read just before the drop: b's last refresh may
    // have come late on a busy machine, and one still under way at the drop only pushes the
    // expiry further out. The key can't expire before `left` has passed since `read_at`.
    let read_at = Instant::now();
    let left = time_to_live(&redis, "{kvtier}:member:b").await;
    assert!(left > 0 && left <= ttl.as_millis() as i64, "b's key has {left} ms left of its {ttl:?} TTL");
    let left = Duration::from_millis(left as u64);
    drop(b); // A crash: the heartbeat stops, nothing is deleted.
    until(&a, Duration::from_secs(15), "without b", |s| ids(s) == ["a"]).await;
    let gone_after = read_at.elapsed();
    eprintln!("a dropped member (TTL {ttl:?}, {left:?} left) left the others' snapshot after {gone_after:?}");
    // 5 ms for Redis's clock (milliseconds, wall time) against this one.
    assert!(gone_after + Duration::from_millis(5) >= left, "gone after {gone_after:?}, before its TTL ran out");
    assert_eq!(member_set(&redis).await, BTreeSet::from(["a".to_string()]), "the expired id is pruned from the set");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_keeps_the_snapshot_and_redis_back_re_registers() {
    let mut redis = RedisProc::start(false);
    let a = RedisMembership::start(config(&redis, "a", 1500)).await.unwrap();
    let b = RedisMembership::start(config(&redis, "b", 1500)).await.unwrap();
    until(&a, Duration::from_secs(15), "seeing b", |s| s.members.len() == 2).await;
    until(&b, Duration::from_secs(15), "seeing a", |s| s.members.len() == 2).await;

    // Record every snapshot `a` publishes from here on.
    let mut rx = a.watch();
    let seen = tokio::spawn(async move {
        let mut smallest = usize::MAX;
        while rx.changed().await.is_ok() {
            smallest = smallest.min(rx.borrow_and_update().members.len());
        }
        smallest
    });

    redis.kill();
    for m in [&a as &dyn Membership, &b] {
        until(m, Duration::from_secs(15), "stale", |s| s.stale).await;
        assert_eq!(ids(&m.snapshot()), ["a", "b"], "the last known members are kept");
    }
    // Calls stay bounded while Redis is down: a start (alone, stale) and a leave.
    let t = Instant::now();
    let c = RedisMembership::start(config(&redis, "c", 1500)).await.unwrap();
    let started_in = t.elapsed();
    assert!(c.snapshot().stale);
    assert_eq!(ids(&c.snapshot()), ["c"]);
    let t = Instant::now();
    assert!(c.leave().await.is_err(), "a leave with Redis down fails");
    let left_in = t.elapsed();
    eprintln!("with Redis down: start returned in {started_in:?}, leave in {left_in:?} (Redis timeout 300 ms)");
    assert!(started_in < Duration::from_secs(2) && left_in < Duration::from_secs(2));

    // Several TTLs pass with Redis down; then it comes back, empty, on the same port.
    tokio::time::sleep(Duration::from_millis(2000)).await;
    assert_eq!(ids(&a.snapshot()), ["a", "b"]);
    redis.restart();
    for m in [&a as &dyn Membership, &b] {
        until(m, Duration::from_secs(15), "fresh", |s| !s.stale).await;
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    while member_set(&redis).await.len() < 2 {
        assert!(Instant::now() < deadline, "a and b did not re-register: {:?}", member_set(&redis).await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(member_set(&redis).await, BTreeSet::from(["a".to_string(), "b".to_string()]));
    // Past the grace period both are still there: they re-registered.
    tokio::time::sleep(Duration::from_millis(1800)).await;
    assert_eq!(ids(&a.snapshot()), ["a", "b"]);
    assert_eq!(ids(&b.snapshot()), ["a", "b"]);
    drop(a);
    assert_eq!(seen.await.unwrap(), 2, "no snapshot of a lost b, through the outage and the restart");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_process_takes_its_id_over() {
    let redis = RedisProc::start(false);
    let watcher = RedisMembership::start(config(&redis, "w", 5000)).await.unwrap();
    let old = RedisMembership::start(config(&redis, "a", 5000)).await.unwrap();
    until(&watcher, Duration::from_secs(15), "seeing a", |s| s.members.len() == 2).await;
    // Killed (no leave: its registration lives on for its TTL) and started again at another
    // address: the new process sees the registration go unrefreshed and takes the id over, well
    // before the old TTL runs out.
    drop(old);
    // A refresh the old process had already sent would bump the beat after the new one read it
    // (the live-holder signal): let it land first, as a killed process's last packets do.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut moved = member("a");
    moved.grpc_addr = "127.0.0.1:9999".into();
    let started = Instant::now();
    let new = RedisMembership::start(config_for(&redis, moved, 5000)).await.unwrap();
    // Its watch is about 0.8 s here; the old registration would live 5 s.
    assert!(started.elapsed() < Duration::from_millis(4500), "took {:?} to take a dead id over", started.elapsed());
    let id = NodeId::new("a").unwrap();
    until(&watcher, Duration::from_secs(15), "seeing a's new address", |s| {
        s.get(&id).is_some_and(|m| m.grpc_addr == "127.0.0.1:9999")
    })
    .await;
    // Killed again and restarted at the same addresses while its registration is still there:
    // taken at once (no other process can hold those addresses).
    let same = new.local().clone();
    drop(new);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = Instant::now();
    let again = RedisMembership::start(config_for(&redis, same, 5000)).await.unwrap();
    assert!(started.elapsed() < Duration::from_secs(1), "took {:?} at the same addresses", started.elapsed());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(watcher.snapshot().get(&id).map(|m| m.grpc_addr.as_str()), Some("127.0.0.1:9999"));
    assert!(tokio::time::timeout(Duration::from_millis(300), again.fenced()).await.is_err());
    again.leave().await.unwrap();
    until(&watcher, Duration::from_secs(1), "without a", |s| ids(s) == ["w"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_live_node_with_the_same_id_does_not_start() {
    let redis = RedisProc::start(false);
    let watcher = RedisMembership::start(config(&redis, "w", 5000)).await.unwrap();
    let first = RedisMembership::start(config(&redis, "a", 5000)).await.unwrap();
    until(&watcher, Duration::from_secs(15), "seeing a", |s| s.members.len() == 2).await;
    let first_addr = first.local().grpc_addr.clone();
    let mut twin = member("a");
    twin.grpc_addr = "127.0.0.1:9998".into();
    twin.data_addr = "127.0.0.1:9997".into();
    // A watch of about 4 s (two ticks and two Redis timeouts), under the 5 s TTL: a loaded host
    // that holds the live node's heartbeat back a second does not pass it for dead.
    let r = RedisMembership::start(config_for(&redis, twin, 5000).with_op_timeout(Duration::from_secs(2))).await;
    match r {
        Err(ServerError::Config(why)) => {
            assert!(why.contains(&first_addr) && why.contains("node_id"), "{why}");
        }
        other => panic!("a twin of a live node started: {:?}", other.err()),
    }
    // The live node keeps its id and its registration.
    let id = NodeId::new("a").unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(watcher.snapshot().get(&id).map(|m| m.grpc_addr.clone()), Some(first_addr));
    assert!(
        tokio::time::timeout(Duration::from_millis(300), first.fenced()).await.is_err(),
        "the live node was fenced"
    );
    assert!(time_to_live(&redis, "{kvtier}:member:a").await > 4000, "its registration is refreshed");
}

/// A node given a running node's id while Redis was down (it starts stale, unchecked) and
/// registered first when Redis came back empty does not take the id from the node that held it:
/// that node was cut off, not gone, and has held the id longer, so it takes it back and the
/// newcomer stops. Before, the node that held the id stopped (with its data), and could not
/// start again while the newcomer ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cut_off_from_redis_keeps_its_id_against_a_newcomer() {
    let mut redis = RedisProc::start(false);
    let watcher = RedisMembership::start(config(&redis, "w", 1500)).await.unwrap();
    // The node that holds the id ticks slowly, so the newcomer registers first.
    let held =
        RedisMembership::start(config(&redis, "a", 1500).with_poll_interval(Duration::from_millis(400))).await.unwrap();
    until(&watcher, Duration::from_secs(15), "seeing a", |s| s.members.len() == 2).await;
    redis.kill();
    until(&held, Duration::from_secs(15), "stale", |s| s.stale).await;
    let mut twin = member("a");
    twin.grpc_addr = "127.0.0.1:9996".into();
    let newcomer = RedisMembership::start(config_for(&redis, twin, 1500)).await.unwrap();
    assert!(newcomer.snapshot().stale, "started with Redis down, unchecked");
    tokio::time::sleep(Duration::from_millis(2000)).await; // past the TTL
    redis.restart();
    let why = tokio::time::timeout(Duration::from_secs(15), newcomer.fenced()).await.expect("the newcomer stops");
    assert!(why.contains("node_id"), "{why}");
    let id = NodeId::new("a").unwrap();
    let addr = held.local().grpc_addr.clone();
    until(&watcher, Duration::from_secs(15), "seeing a at the holder's address", |s| {
        s.get(&id).is_some_and(|m| m.grpc_addr == addr)
    })
    .await;
    assert!(tokio::time::timeout(Duration::from_millis(1500), held.fenced()).await.is_err(), "the holder stopped");
    assert_eq!(watcher.snapshot().get(&id).map(|m| m.grpc_addr.clone()), Some(addr));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_url_is_a_config_error() {
    let r = RedisMembership::start(RedisMembershipConfig::new("http://nope", member("a"))).await;
    assert!(matches!(r, Err(ServerError::Config(_))), "{:?}", r.err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_redis_makes_calls_time_out_not_hang() {
    let redis = RedisProc::start(false);
    let a = RedisMembership::start(config(&redis, "a", 1500)).await.unwrap();
    let b = RedisMembership::start(config(&redis, "b", 1500)).await.unwrap();
    until(&a, Duration::from_secs(15), "seeing b", |s| s.members.len() == 2).await;
    // Connections stay open and every request waits: only timeouts bound the calls.
    redis.freeze(true);
    until(&a, Duration::from_secs(15), "stale", |s| s.stale).await;
    assert_eq!(ids(&a.snapshot()), ["a", "b"]);
    let t = Instant::now();
    let left = b.leave().await;
    let took = t.elapsed();
    assert!(left.is_err(), "a leave cannot finish while Redis is frozen");
    assert!(took < Duration::from_secs(1), "leave took {took:?} with a 300 ms Redis timeout");
    let t = Instant::now();
    let c = RedisMembership::start(config(&redis, "c", 1500)).await.unwrap();
    let took = t.elapsed();
    assert!(took < Duration::from_secs(1), "start took {took:?} with a 300 ms Redis timeout");
    assert!(c.snapshot().stale);
    redis.freeze(false);
    until(&a, Duration::from_secs(15), "fresh", |s| !s.stale).await;
    until(&c, Duration::from_secs(15), "registered and seeing a", |s| !s.stale && s.members.len() >= 2).await;
    // b stopped refreshing: whether its queued leave ran late or not, it is gone within its TTL.
    until(&a, Duration::from_secs(4), "without b", |s| ids(s) == ["a", "c"]).await;
}

/// A claim is one node's at a time: another's waits (`None`) until it is given back or its TTL
/// runs out; giving back with another token (a claim that had expired and was taken anew) leaves
/// it; with Redis gone, claiming fails within the op timeout rather than hanging.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_is_one_node_s_until_given_back_or_past_its_ttl() {
    let mut redis = RedisProc::start(false);
    let a = RedisMembership::start(config(&redis, "a", 1500)).await.unwrap();
    let b = RedisMembership::start(config(&redis, "b", 1500)).await.unwrap();
    let ttl = Duration::from_secs(10);
    let token = a.claim("create:x", ttl).await.unwrap().expect("claimed");
    assert_eq!(b.claim("create:x", ttl).await.unwrap(), None, "held by a");
    assert!(b.claim("create:y", ttl).await.unwrap().is_some(), "another id is free");
    b.release("create:x", "not-a-s-token".into()).await;
    assert_eq!(b.claim("create:x", ttl).await.unwrap(), None, "given back only with its token");
    a.release("create:x", token).await;
    let again = b.claim("create:x", Duration::from_millis(300)).await.unwrap().expect("given back: b's now");
    assert_eq!(a.claim("create:x", ttl).await.unwrap(), None);
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(a.claim("create:x", ttl).await.unwrap().is_some(), "b's ran out");
    drop(again);
    redis.kill();
    let t = Instant::now();
    assert!(a.claim("create:z", ttl).await.is_err(), "no store: no claim");
    assert!(t.elapsed() < Duration::from_secs(2), "bounded: {:?}", t.elapsed());
}

/// A held claim is renewed while it lives, well past its TTL, so another node keeps waiting;
/// dropping it gives it back, from a blocking thread too (where a create's park job lets go of
/// it). One whose key went (it ran out while Redis did not answer) is known lost, and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_claim_is_renewed_past_its_ttl_and_given_back_when_dropped() {
    let redis = RedisProc::start(false);
    let a: Arc<dyn Membership> = Arc::new(RedisMembership::start(config(&redis, "a", 1500)).await.unwrap());
    let b = RedisMembership::start(config(&redis, "b", 1500)).await.unwrap();
    let ttl = Duration::from_millis(900);
    let held = HeldClaim::take(&a, "create:x".into(), ttl).await.unwrap().expect("claimed");
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(b.claim("create:x", ttl).await.unwrap(), None, "held by a, renewed past its {ttl:?}");
    }
    assert!(!held.is_lost());
    assert!(HeldClaim::take(&a, "create:x".into(), ttl).await.unwrap().is_none(), "one holder, a itself included");
    tokio::task::spawn_blocking(move || drop(held)).await.unwrap();
    let t = Instant::now();
    while b.claim("create:x", ttl).await.unwrap().is_none() {
        assert!(
            t.elapsed() < Duration::from_millis(250),
            "not given back when dropped (renewed a third of {ttl:?} ago at most)"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let ttl = Duration::from_millis(300);
    let held = HeldClaim::take(&a, "create:y".into(), ttl).await.unwrap().expect("claimed");
    let _: () = redis::cmd("DEL").arg("{kvtier}:claim:create:y").query(&mut redis.con()).unwrap();
    let taken = b.claim("create:y", Duration::from_secs(10)).await.unwrap().expect("gone from Redis: b's now");
    let t = Instant::now();
    while !held.is_lost() {
        assert!(t.elapsed() < Duration::from_secs(2), "a claim taken by another is not known lost");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(held);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(a.claim("create:y", ttl).await.unwrap(), None, "a lost claim given back leaves b's");
    b.release("create:y", taken).await;
}
