//! Routing hints across a cluster of three real `kvtier serve` processes sharing a real
//! `redis-server` on loopback: asked of any node, the hint reports for every member the prefix it
//! holds (checked against the placement the nodes compute) and which node holds a session; a node
//! stalled (SIGSTOP) or killed with `kill -9` is reported unknown (or gone) within the peer
//! timeout, never a hang.

use std::time::{Duration, Instant};

use kvtier_client::ParkOptions;
use kvtier_proto::{BlockKey, NamespaceId};

use kvtier_tests::redis::Redis;
use kvtier_tests::*;

const IDS: [&str; 3] = ["n1", "n2", "n3"];

fn node(redis: &Redis, dir: &std::path::Path, id: &str) -> ServerProcess {
    let cfg = dir.join(format!("{id}.toml"));
    let body = format!(
        "cluster = \"{}\"\nnode_id = \"{id}\"\ncluster_ttl = \"2s\"\npeer_rebalance = \"off\"\ncluster_rf = 1\npeer_timeout = \"1s\"\n",
        redis.url()
    );
    std::fs::write(&cfg, body).unwrap();
    ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"])
}

fn owner(ns: &NamespaceId, key: &BlockKey) -> &'static str {
    let p = kvtier_tests::redis::placement(&IDS, 64 << 20);
    let i = p.owners(ns, key, 1)[0];
    IDS[IDS.iter().position(|id| *id == p.members()[i].id.as_str()).unwrap()]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hint_names_each_nodes_prefix_and_the_sessions_node_and_a_dead_node_as_unknown() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let mut nodes: Vec<ServerProcess> = IDS.iter().map(|id| node(&redis, dir.path(), id)).collect();
    until_members(&nodes, 3);
    let (a, b, c) = (nodes[0].client().await, nodes[1].client().await, nodes[2].client().await);
    let spec = namespace("acme", b"route-salt", small_layout());
    let (ns_a, ns_b, ns_c) = (
        a.register(spec.clone()).await.unwrap(),
        b.register(spec.clone()).await.unwrap(),
        c.register(spec).await.unwrap(),
    );

    // A document stored through n1: n1 holds all of it, each other node the blocks it owns.
    let doc = tokens(1, 24 * 16);
    a.store(&ns_a, &doc, &full_block_payloads(&ns_a, &doc)).await.unwrap().ok().unwrap();
    let owners: Vec<&str> = ns_a.keys(&doc).iter().map(|k| owner(&ns_a.id, k)).collect();
    let forwarded = owners.iter().filter(|o| **o != "n1").count() as f64;
    let deadline = Instant::now() + Duration::from_secs(20);
    while metric(&nodes[0].scrape(), "kvtier_peer_forwarded_blocks_total", &[]) < forwarded {
        assert!(Instant::now() < deadline, "forwarding did not finish");
        std::thread::sleep(Duration::from_millis(20));
    }
    // An agent's session parked on n3.
    let turn = tokens(9, 5 * 16 + 3);
    c.park(&ns_c, "agent-7", &turn, &session_payloads(&ns_c, &turn), &ParkOptions::default(), 0).await.unwrap();

    let t = Instant::now();
    let hint = b.route_hint(&ns_b, &doc, Some("agent-7")).await.unwrap();
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    assert_eq!((hint.total_blocks, hint.block_tokens, hint.nodes.len()), (24, 16, 3));
    assert!(hint.nodes[0].answering && hint.nodes[0].node_id == "n2", "the answering node first: {hint:?}");
    for (i, id) in IDS.iter().enumerate() {
        let n = hint.node(id).unwrap_or_else(|| panic!("{id} missing: {hint:?}"));
        assert!(n.reachable, "{id}: {:?}", n.error);
        assert_eq!(n.grpc_addr, nodes[i].grpc_addr());
        let want = if *id == "n1" { 24 } else { owners.iter().take_while(|o| *o == id).count() };
        assert_eq!((n.prefix_blocks, n.prefix_tokens), (want, want as u64 * 16), "{id}: owners {owners:?}");
        assert_eq!(n.holds_session, *id == "n3", "{id}");
    }
    assert_eq!(hint.node("n3").unwrap().session_tokens, turn.len() as u64);
    assert_eq!(hint.best().unwrap().node_id, "n3", "the session's node wins");
    let no_session = b.route_hint(&ns_b, &doc, None).await.unwrap();
    assert_eq!(no_session.best().unwrap().node_id, "n1", "the longest prefix wins");

    // n2 stalled (SIGSTOP: its sockets accept, nothing answers): unknown within the peer
    // timeout (1 s), never a hang.
    stop_process(nodes[1].child.id());
    let t = Instant::now();
    let hint = a.route_hint(&ns_a, &doc, Some("agent-7")).await;
    let took = t.elapsed();
    continue_process(nodes[1].child.id());
    let hint = hint.unwrap();
    assert!(took < Duration::from_secs(3), "a stalled node held the hint {took:?}");
    let n2 = hint.node("n2").expect("n2 is still a member");
    assert!(!n2.reachable && n2.error.is_some(), "{n2:?}");
    assert!(hint.node("n3").is_some_and(|n| n.reachable && n.holds_session), "{hint:?}");

    // Resumed, it is asked again once the 2 s its failure is remembered have passed.
    let deadline = Instant::now() + Duration::from_secs(15);
    while !a.route_hint(&ns_a, &doc, None).await.unwrap().node("n2").is_some_and(|n| n.reachable) {
        assert!(Instant::now() < deadline, "n2 was not asked again after it resumed");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // kill -9 n3 (still a member until its TTL): reported unknown within the peer timeout.
    let _ = nodes[2].child.kill();
    let _ = nodes[2].child.wait();
    let t = Instant::now();
    let hint = a.route_hint(&ns_a, &doc, Some("agent-7")).await.unwrap();
    let took = t.elapsed();
    assert!(took < Duration::from_secs(3), "a dead node held the hint {took:?}");
    if let Some(n3) = hint.node("n3") {
        assert!(!n3.reachable && n3.error.is_some(), "{n3:?}");
        assert!(!n3.holds_session);
    }
    assert!(hint.node("n1").is_some_and(|n| n.reachable && n.prefix_blocks == 24));
    assert!(hint.node("n2").is_some_and(|n| n.reachable));
    assert!(hint.best().is_some_and(|n| n.node_id == "n1"), "{hint:?}");
    // Once its TTL ran out it is no longer listed at all.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let hint = a.route_hint(&ns_a, &doc, None).await.unwrap();
        if hint.node("n3").is_none() {
            assert_eq!(hint.nodes.len(), 2);
            break;
        }
        assert!(Instant::now() < deadline, "n3 is still listed: {hint:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
