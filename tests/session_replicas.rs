//! Replicated sessions between real `kvtier serve` processes sharing a real `redis-server` on
//! loopback (`cluster_rf = 2`): a park is acknowledged once two nodes hold it; a node killed
//! with SIGKILL under load loses no acknowledged session (each resumes, exact bytes, from any
//! other node); a rolling restart of every node — each coming back empty — loses none either,
//! because the copies are re-made after each membership change; a resume anywhere sees the
//! newest version; a drop reaches the copies; and only the operator may touch a node's copies.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvtier_client::{ClientConfig, ClientError, KvClient, NamespaceHandle, ParkOptions};
use kvtier_proto::pb;
use kvtier_tests::redis::Redis;
use kvtier_tests::*;

const IDS: [&str; 3] = ["n1", "n2", "n3"];

/// A node's config: `peer_timeout` 1 s unless `extra` sets it.
fn config(redis: &Redis, dir: &std::path::Path, id: &str, rf: usize, extra: &str) -> std::path::PathBuf {
    let cfg = dir.join(format!("{id}.toml"));
    let timeout = if extra.contains("peer_timeout") { "" } else { "peer_timeout = \"1s\"\n" };
    std::fs::write(
        &cfg,
        format!(
            "cluster = \"{}\"\nnode_id = \"{id}\"\ncluster_ttl = \"2s\"\npeer_rebalance = \"off\"\ncluster_rf = {rf}\n{timeout}{extra}",
            redis.url()
        ),
    )
    .unwrap();
    cfg
}

/// Node `i` killed (if it still runs) and started again with `args` on its data directory and
/// addresses; its client reconnected.
async fn restart_node(nodes: &mut [ServerProcess], clients: &mut [KvClient], i: usize, args: &[&str]) {
    let _ = nodes[i].child.kill();
    let _ = nodes[i].child.wait();
    let again = nodes[i].restart_in_place(args);
    nodes[i] = again;
    clients[i] = nodes[i].client().await;
}

/// A DRAM-only node with `cluster_rf` = `rf` (a restart starts it empty).
fn node_rf(redis: &Redis, dir: &std::path::Path, id: &str, rf: usize) -> ServerProcess {
    let cfg = config(redis, dir, id, rf, "");
    ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"])
}

/// A DRAM-only node of `dram` bytes with `cluster_rf` 2 and a 10 s `peer_timeout`: copies of
/// 20 MiB sessions in 16 MiB chunks beside the parks' own forwards, on two cores, are too much
/// for a second per peer call.
fn node_rf2_slow_peers(redis: &Redis, dir: &std::path::Path, id: &str, dram: &str) -> ServerProcess {
    let cfg = config(redis, dir, id, 2, "peer_timeout = \"10s\"\n");
    ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", dram])
}

fn node(redis: &Redis, dir: &std::path::Path, id: &str) -> ServerProcess {
    node_rf(redis, dir, id, 2)
}

fn cluster(redis: &Redis, dir: &std::path::Path) -> Vec<ServerProcess> {
    let nodes: Vec<ServerProcess> = IDS.iter().map(|id| node(redis, dir, id)).collect();
    until_members(&nodes, 3);
    nodes
}

async fn handle(c: &KvClient) -> NamespaceHandle {
    c.register(namespace("agents", b"replicas", small_layout())).await.unwrap()
}

/// Session `i`'s tokens (a few blocks and a tail) and every block's bytes.
fn session(ns: &NamespaceHandle, i: u32) -> (Vec<u32>, Vec<Bytes>) {
    let toks = tokens(1000 + i, 16 * 5 + 7);
    let blocks = session_payloads(ns, &toks);
    (toks, blocks)
}

/// How many nodes hold each session (their own copies, from `ListSessions` on each).
async fn copies(clients: &[&KvClient]) -> HashMap<String, usize> {
    let mut out = HashMap::new();
    for c in clients {
        for s in c.list_sessions(None).await.unwrap() {
            *out.entry(s.id).or_insert(0) += 1;
        }
    }
    out
}

async fn until_every_session_has_two_copies(clients: &[&KvClient], n: usize) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let c = copies(clients).await;
        if c.len() == n && c.values().all(|&k| k >= 2) {
            return;
        }
        assert!(Instant::now() < deadline, "copies not re-made: {c:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The three nodes, a client of each, and each client's handle of the test namespace.
async fn fleet(redis: &Redis, dir: &std::path::Path) -> (Vec<ServerProcess>, [KvClient; 3], Vec<NamespaceHandle>) {
    let nodes = cluster(redis, dir);
    let clients = [nodes[0].client().await, nodes[1].client().await, nodes[2].client().await];
    let ns = futures::future::join_all(clients.iter().map(|c| async move { handle(c).await })).await;
    (nodes, clients, ns)
}

/// Waits (up to 20 s) until no node holds a copy of session `id`.
async fn until_no_copy(clients: &[&KvClient], id: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while copies(clients).await.contains_key(id) {
        assert!(Instant::now() < deadline, "copies of {id:?} outlived the drop");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_sessions_survive_a_node_killed_under_load() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let mut nodes = cluster(&redis, dir.path());
    let c1 = nodes[0].client().await;
    let ns1 = handle(&c1).await;
    const N: u32 = 12;
    for i in 0..N {
        let (toks, blocks) = session(&ns1, i);
        let info = c1.park(&ns1, &format!("s{i}"), &toks, &blocks, &ParkOptions::default(), 0).await.unwrap();
        assert_eq!(info.version, 1);
    }
    // Acknowledged means two nodes hold each one already (n1 and at least one other).
    let (c2, c3) = (nodes[1].client().await, nodes[2].client().await);
    let held = copies(&[&c1, &c2, &c3]).await;
    assert_eq!(held.len(), N as usize);
    assert!(held.values().all(|&k| k >= 2), "{held:?}");

    // Load on n1 while it dies: a client keeps storing and loading blocks through it.
    let load = {
        let c = nodes[0].client().await;
        let ns = handle(&c).await;
        tokio::spawn(async move {
            let mut i = 0u32;
            let t = Instant::now();
            while t.elapsed() < Duration::from_secs(3) {
                let toks = tokens(50_000 + i, 16 * 4);
                let p = full_block_payloads(&ns, &toks);
                if c.store(&ns, &toks, &p).await.is_ok() {
                    if let Ok(got) = c.load(&ns, &toks).await {
                        assert!(got.iter().zip(&p).all(|(g, p)| g.is_empty() || g == p), "wrong bytes under load");
                    }
                }
                i += 1;
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = nodes[0].child.kill();
    let _ = nodes[0].child.wait();
    load.await.unwrap();

    // Every acknowledged session resumes, exact bytes, through either survivor, at once (before
    // n1's TTL has even run out of the membership).
    let (ns2, ns3) = (handle(&c2).await, handle(&c3).await);
    for i in 0..N {
        let (c, ns) = if i % 2 == 0 { (&c2, &ns2) } else { (&c3, &ns3) };
        let t = Instant::now();
        let r = c.resume(ns, &format!("s{i}")).await.unwrap_or_else(|e| panic!("s{i}: {e}"));
        assert!(t.elapsed() < Duration::from_secs(3), "resume of s{i} took {:?}", t.elapsed());
        assert_eq!(r.info.version, 1);
        assert!(r.blocks == session(ns, i).1, "s{i}: wrong bytes");
    }
    // A session nobody parked is still not found, promptly.
    let err = c2.resume(&ns2, "never-parked").await.unwrap_err();
    assert!(matches!(err, ClientError::SessionNotFound(_)), "{err}");
    assert!(nodes[1].alive() && nodes[2].alive());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_of_every_node_loses_no_parked_session() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let mut nodes = cluster(&redis, dir.path());
    const N: u32 = 9;
    {
        // Parked through all three nodes in turn.
        for i in 0..N {
            let c = nodes[i as usize % 3].client().await;
            let ns = handle(&c).await;
            let (toks, blocks) = session(&ns, i);
            c.park(&ns, &format!("r{i}"), &toks, &blocks, &ParkOptions::default(), 0).await.unwrap();
        }
    }
    for k in 0..3 {
        // A graceful stop, then the node comes back with nothing (a fresh data directory).
        let pid = rustix::process::Pid::from_raw(nodes[k].child.id() as i32).unwrap();
        rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
        let _ = nodes[k].child.wait();
        nodes[k] = node(&redis, dir.path(), IDS[k]);
        until_members(&nodes, 3);
        let clients = [nodes[0].client().await, nodes[1].client().await, nodes[2].client().await];
        until_every_session_has_two_copies(&clients.iter().collect::<Vec<_>>(), N as usize).await;
    }
    // Nothing lost: every session resumes, exact bytes, from every node.
    for (j, n) in nodes.iter().enumerate() {
        let c = n.client().await;
        let ns = handle(&c).await;
        for i in 0..N {
            let r = c.resume(&ns, &format!("r{i}")).await.unwrap_or_else(|e| panic!("r{i} on {}: {e}", IDS[j]));
            assert!(r.blocks == session(&ns, i).1, "r{i} on {}: wrong bytes", IDS[j]);
        }
    }
    // A copy re-made is counted once its new holder has answered (after it lists it): polled.
    let recopied = || -> f64 { nodes.iter().map(|n| metric(&n.scrape(), "kvtier_session_recopied_total", &[])).sum() };
    let deadline = Instant::now() + Duration::from_secs(15);
    while recopied() <= 0.0 {
        assert!(Instant::now() < deadline, "the copies were re-made by re-replication");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_anywhere_sees_the_newest_version_and_a_drop_reaches_the_copies() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let (_nodes, clients, ns) = fleet(&redis, dir.path()).await;
    let turn1 = tokens(77, 16 * 3);
    let b1 = session_payloads(&ns[0], &turn1);
    clients[0].park(&ns[0], "agent", &turn1, &b1, &ParkOptions::default(), 0).await.unwrap();

    // Turn 2 on n2 (it adopts version 1 on resume, then extends it to 2), turn 3 on n3.
    let mut turn2 = turn1.clone();
    turn2.extend(tokens(78, 16 * 2));
    let b2 = session_payloads(&ns[1], &turn2);
    assert_eq!(clients[1].resume(&ns[1], "agent").await.unwrap().info.version, 1);
    let info = clients[1].extend(&ns[1], "agent", 1, 3 * 16, &turn2, &b2[3..]).await.unwrap();
    assert_eq!(info.version, 2);
    let mut turn3 = turn2.clone();
    turn3.extend(tokens(79, 9));
    let b3 = session_payloads(&ns[2], &turn3);
    assert_eq!(clients[2].resume(&ns[2], "agent").await.unwrap().info.version, 2);
    let info = clients[2].extend(&ns[2], "agent", 2, 5 * 16, &turn3, &b3[5..]).await.unwrap();
    assert_eq!(info.version, 3);

    // n1 parked version 1 and was never told of 2 or 3 directly: its resume still answers 3.
    for (c, ns) in clients.iter().zip(&ns) {
        let r = c.resume(ns, "agent").await.unwrap();
        assert_eq!(r.info.version, 3);
        assert_eq!(r.info.token_count, turn3.len() as u64);
        assert!(r.blocks == b3, "wrong bytes");
    }

    // A drop through one node reaches the others' copies.
    assert!(clients[1].drop_session(&ns[1], "agent").await.unwrap());
    until_no_copy(&clients.iter().collect::<Vec<_>>(), "agent").await;
    for (c, ns) in clients.iter().zip(&ns) {
        let err = c.resume(ns, "agent").await.unwrap_err();
        assert!(matches!(err, ClientError::SessionNotFound(_)), "{err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_park_with_too_few_live_nodes_is_not_acknowledged_and_tenants_cannot_touch_copies() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    // One node alone in a cluster that wants two copies.
    let cfg = config(
        &redis,
        dir.path(),
        "solo",
        2,
        "auth_token = \"operator-secret-0123456789\"\n[[tenants]]\nname = \"agents\"\ntokens = [\"agents-secret-0123456789\"]\n",
    );
    let solo = ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"]);
    let addr = solo.grpc_addr();
    let connect = |token: &str| {
        let cfg = kvtier_client::ClientConfig { auth_token: Some(token.into()), ..Default::default() };
        KvClient::connect(&addr, cfg)
    };
    let tenant = connect("agents-secret-0123456789").await.unwrap();
    let ns = handle(&tenant).await;
    let (toks, blocks) = session(&ns, 1);
    let err = tenant.park(&ns, "lonely", &toks, &blocks, &ParkOptions::default(), 0).await.unwrap_err();
    // Said as the cluster's state, not the node's fault: worth retrying.
    assert!(matches!(err, ClientError::Unavailable(ref m) if m.contains("held by 1 of 2 nodes")), "{err}");
    assert!(err.to_string().starts_with("KV:Cluster:Unavailable: too few copies: session"), "{err}");

    // A node's copies answer the operator only.
    let req = pb::SessionReplicaRequest {
        namespace_id: Bytes::copy_from_slice(&ns.id.0),
        session_id: "lonely".into(),
        ..Default::default()
    };
    let err = tenant.session_replica(req.clone()).await.unwrap_err();
    assert!(err.to_string().to_lowercase().contains("forbidden"), "{err}");
    let op = connect("operator-secret-0123456789").await.unwrap();
    let r = op.session_replica(req).await.unwrap();
    assert!(r.held, "the node keeps its own copy of a park it could not replicate");
    assert!(metric(&solo.scrape(), "kvtier_session_underreplicated_total", &[]) >= 1.0);
}

/// Two DRAM-only nodes with `cluster_rf` = 1 that see each other, a client of each and its
/// handle of the test namespace.
async fn pair_rf1(redis: &Redis, dir: &std::path::Path) -> ([ServerProcess; 2], [KvClient; 2], [NamespaceHandle; 2]) {
    // A node without a copy asks the other within peer_timeout: 5 s, not 1, on a loaded host.
    let start = |id: &str| {
        let cfg = config(redis, dir, id, 1, "peer_timeout = \"5s\"\n");
        ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"])
    };
    let nodes = [start("n1"), start("n2")];
    until_members(&nodes, 2);
    let clients = [nodes[0].client().await, nodes[1].client().await];
    let ns = [handle(&clients[0]).await, handle(&clients[1]).await];
    (nodes, clients, ns)
}

/// With `cluster_rf` = 1 a session has one copy, and it follows the agent: a resume on another
/// node moves it there (exact bytes), and the old node's copy goes, so it can't go stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_one_copy_a_session_moves_to_the_node_that_resumes_it() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let (_nodes, [c1, c2], [ns1, ns2]) = pair_rf1(&redis, dir.path()).await;
    let (toks, blocks) = session(&ns1, 5);
    c1.park(&ns1, "mover", &toks, &blocks, &ParkOptions::default(), 0).await.unwrap();
    let r = c2.resume(&ns2, "mover").await.unwrap();
    assert!(r.blocks == blocks, "wrong bytes after the move");
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (on1, on2) = (c1.list_sessions(None).await.unwrap().len(), c2.list_sessions(None).await.unwrap().len());
        if (on1, on2) == (0, 1) {
            break;
        }
        assert!(Instant::now() < deadline, "copies on n1, n2: {on1}, {on2}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Extended on n2, then resumed on n1 again: n1 gets the new version, not its old one.
    let mut turn2 = toks.clone();
    turn2.extend(tokens(6, 40));
    let b2 = session_payloads(&ns2, &turn2);
    let info = c2.extend(&ns2, "mover", 1, 5 * 16, &turn2, &b2[5..]).await.unwrap();
    assert_eq!(info.version, 2);
    let r = c1.resume(&ns1, "mover").await.unwrap();
    assert_eq!(r.info.version, 2);
    assert!(r.blocks == b2, "wrong bytes after the second move");
}

/// Two creates of one session id through two nodes at the same moment: one is made, the other
/// is refused `KV:Session:Exists`, and both nodes then serve the one made. Before, each create
/// asked the other node while neither had parked yet, both were made, and the two nodes served
/// two contexts under one id and version until the copies met.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_creates_of_one_id_at_once_make_one_session() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let (_nodes, [c1, c2], [ns1, ns2]) = pair_rf1(&redis, dir.path()).await;
    for round in 0..6u32 {
        let id = format!("race-{round}");
        let (t1, b1) = session(&ns1, 100 + round);
        let (t2, b2) = session(&ns2, 200 + round);
        let opts = ParkOptions::default();
        let (r1, r2) = tokio::join!(c1.park(&ns1, &id, &t1, &b1, &opts, 0), c2.park(&ns2, &id, &t2, &b2, &opts, 0));
        let made = match (&r1, &r2) {
            (Ok(_), Err(ClientError::SessionExists(_))) => &b1,
            (Err(ClientError::SessionExists(_)), Ok(_)) => &b2,
            _ => panic!("round {round}: one create is made and the other refused, got {r1:?} and {r2:?}"),
        };
        for (c, ns) in [(&c1, &ns1), (&c2, &ns2)] {
            let r = c.resume(ns, &id).await.unwrap();
            assert!(&r.blocks == made, "round {round}: a node serves another context than the one made");
            assert_eq!(r.info.version, 1);
        }
    }
}

/// A create waits while another node holds the claim on its id; a client that gives up on it
/// meanwhile (its request timeout) resets the call, and the node counts it: a request whose code
/// is `cancelled`. Before, a call dropped unanswered was counted nowhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_waits_for_another_node_s_claim_and_a_call_given_up_is_counted() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let (nodes, [c1, _c2], [ns1, _ns2]) = pair_rf1(&redis, dir.path()).await;
    // Another node creating "claimed" right now, as far as Redis says.
    let key = format!("{{kvtier}}:claim:create:{}:claimed", ns1.id);
    assert_eq!(kvtier_tests::redis::redis_cli(redis.port, &["SET", &key, "elsewhere", "PX", "4000"]).trim(), "OK");
    let cfg = ClientConfig { request_timeout: Duration::from_millis(1500), ..ClientConfig::default() };
    let impatient = KvClient::connect(&nodes[0].grpc_addr(), cfg).await.unwrap();
    let (t, b) = session(&ns1, 9);
    let opts = ParkOptions::default();
    let err = impatient.park(&ns1, "claimed", &t, &b, &opts, 0).await.unwrap_err();
    assert!(matches!(err, ClientError::Timeout(_)), "{err}");
    until_metric(&nodes[0], "kvtier_request_errors_total", &[("op", "park"), ("code", "cancelled")], 1.0);
    // Once the claim runs out, the create is made.
    let started = Instant::now();
    let made = c1.park(&ns1, "claimed", &t, &b, &opts, 0).await.unwrap();
    assert_eq!(made.version, 1);
    assert!(started.elapsed() < Duration::from_secs(5), "waited {:?}", started.elapsed());
}

/// Creates waiting for another node's claim are bounded per node (64): past it a create is
/// refused `Unavailable` at once, saying so, instead of asking Redis a few times a second for up
/// to 11 s; the others wait, and once the claim runs out one is made and the rest find it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_waiting_for_a_claim_are_bounded() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let (nodes, _clients, [ns1, _ns2]) = pair_rf1(&redis, dir.path()).await;
    // Enough data-plane connections that 80 parks reach their commit at once.
    let cfg = ClientConfig { data_connections: 96, ..ClientConfig::default() };
    let c1 = KvClient::connect(&nodes[0].grpc_addr(), cfg).await.unwrap();
    let key = format!("{{kvtier}}:claim:create:{}:crowded", ns1.id);
    assert_eq!(kvtier_tests::redis::redis_cli(redis.port, &["SET", &key, "elsewhere", "PX", "3000"]).trim(), "OK");
    let (t, b) = session(&ns1, 11);
    let opts = ParkOptions::default();
    let parks = (0..80).map(|_| c1.park(&ns1, "crowded", &t, &b, &opts, 0));
    let results = futures::future::join_all(parks).await;
    let (mut made, mut exists, mut refused) = (0, 0, 0);
    for r in &results {
        match r {
            Ok(_) => made += 1,
            Err(ClientError::SessionExists(_)) => exists += 1,
            Err(ClientError::Unavailable(m)) if m.contains("creates wait on this node already") => refused += 1,
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!((made, exists + refused), (1, 79), "one made");
    assert!(refused >= 80 - 64, "{refused} refused at once past the 64 waiting");
}

/// A tenant's creates ask the cluster 32 at a time: 40 creates of ids another node is creating
/// (claimed in Redis for 9 s) hold 32 slots while they wait, the other 8 wait 5 s for a slot
/// and are refused `KV:Capacity` naming the tenant, and another tenant's create goes through
/// meanwhile. The 32 are made once the claims run out. Before, all 40 waited on the claims.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_s_creates_ask_the_cluster_a_few_at_a_time() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let tenants = "auth_token = \"operator-secret-0123456789\"\n\
                   [[tenants]]\nname = \"agents\"\ntokens = [\"agents-secret-0123456789\"]\n\
                   [[tenants]]\nname = \"others\"\ntokens = [\"others-secret-0123456789\"]\n";
    let cfg = config(&redis, dir.path(), "solo", 1, tenants);
    let solo = ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"]);
    until_members([&solo], 1);
    let addr = solo.grpc_addr();
    let connect = |token: &str| {
        let cfg = ClientConfig { auth_token: Some(token.into()), data_connections: 48, ..Default::default() };
        KvClient::connect(&addr, cfg)
    };
    let (agents, others) =
        (connect("agents-secret-0123456789").await.unwrap(), connect("others-secret-0123456789").await.unwrap());
    let ns = handle(&agents).await;
    let theirs = others.register(namespace("others", b"replicas", small_layout())).await.unwrap();
    for i in 0..40 {
        let key = format!("{{kvtier}}:claim:create:{}:c{i}", ns.id);
        let set = kvtier_tests::redis::redis_cli(redis.port, &["SET", &key, "elsewhere", "PX", "9000"]);
        assert_eq!(set.trim(), "OK");
    }
    let (t, b) = session(&ns, 12);
    let opts = ParkOptions::default();
    let ids: Vec<String> = (0..40).map(|i| format!("c{i}")).collect();
    let crowd = futures::future::join_all(ids.iter().map(|id| agents.park(&ns, id, &t, &b, &opts, 0)));
    let other = async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (t, b) = session(&theirs, 13);
        let at = Instant::now();
        others.park(&theirs, "free", &t, &b, &opts, 0).await.unwrap();
        at.elapsed()
    };
    let (results, took) = tokio::join!(crowd, other);
    assert!(took < Duration::from_secs(3), "another tenant's create took {took:?}");
    let (mut made, mut refused) = (0, 0);
    for r in &results {
        match r {
            Ok(_) => made += 1,
            Err(ClientError::Capacity(m)) if m.contains("tenant \"agents\" has 32 session creates") => refused += 1,
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!((made, refused), (32, 8));
    assert!(solo.scrape().contains("kvtier_session_create_checks_refused_total 8"));
}

/// The config of node `id` of a one-copy cluster whose killed or stalled members stay members
/// for 60 s, with `peer_timeout`.
fn rf1_ttl60(redis: &Redis, dir: &std::path::Path, id: &str, peer_timeout: &str) -> std::path::PathBuf {
    let cfg = dir.join(format!("{id}.toml"));
    std::fs::write(
        &cfg,
        format!(
            "cluster = \"{}\"\nnode_id = \"{id}\"\ncluster_ttl = \"60s\"\npeer_rebalance = \"off\"\n\
             cluster_rf = 1\npeer_timeout = \"{peer_timeout}\"\n",
            redis.url()
        ),
    )
    .unwrap();
    cfg
}

/// Two nodes with one copy per session, members for 60 s after a kill, n2 with a disk tier (so
/// it comes back with its sessions), each with a client and the test namespace's handle.
struct RfOnePair {
    n1: ServerProcess,
    n2: ServerProcess,
    /// n2's command line, to start it again in place.
    args2: Vec<String>,
    c1: KvClient,
    c2: KvClient,
    ns1: NamespaceHandle,
    ns2: NamespaceHandle,
}

async fn rf1_pair_n2_on_disk(redis: &Redis, dir: &std::path::Path) -> RfOnePair {
    let (cfg1, cfg2) = (rf1_ttl60(redis, dir, "n1", "2s"), rf1_ttl60(redis, dir, "n2", "2s"));
    let args2: Vec<String> =
        ["--config", cfg2.to_str().unwrap(), "--dram-capacity", "64MiB", "--disk-capacity", "64MiB"]
            .map(String::from)
            .to_vec();
    let n1 = ServerProcess::start(&["--config", cfg1.to_str().unwrap(), "--dram-capacity", "64MiB"]);
    let n2 = ServerProcess::start(&args2.iter().map(String::as_str).collect::<Vec<_>>());
    until_members([&n1, &n2], 2);
    let (c1, c2) = (n1.client().await, n2.client().await);
    let (ns1, ns2) = (handle(&c1).await, handle(&c2).await);
    RfOnePair { n1, n2, args2, c1, c2, ns1, ns2 }
}

/// With one copy, the node holding a session is killed (SIGKILL; still a member, its TTL 60 s):
/// a resume through the other says the holder gave no answer (`Unavailable`, naming it), not
/// "not found"; the agent parks a new context under the id there, and once the holder is back
/// with its old copy (recovered from its disk), a resume through it drops that copy and serves
/// the new context, as does every node after. A park creating the id again while a member holds
/// it is refused (`SessionExists`), as on one node. Before, the two nodes served two contexts
/// under one id and version indefinitely.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_parked_anew_while_its_holder_was_down_supersedes_the_holders_copy() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let RfOnePair { n1, mut n2, args2, c1, c2, ns1, ns2 } = rf1_pair_n2_on_disk(&redis, dir.path()).await;
    let args2: Vec<&str> = args2.iter().map(String::as_str).collect();
    let (old_toks, old_blocks) = session(&ns2, 31);
    c2.park(&ns2, "agent", &old_toks, &old_blocks, &ParkOptions::default(), 0).await.unwrap();
    // Held by n2: a create through n1 is refused as it would be on n2.
    // Another context, of another length.
    let new_toks = tokens(1032, 16 * 7 + 3);
    let new_blocks = session_payloads(&ns1, &new_toks);
    let err = c1.park(&ns1, "agent", &new_toks, &new_blocks, &ParkOptions::default(), 0).await.unwrap_err();
    assert!(matches!(err, ClientError::SessionExists(_)), "{err}");

    // The agent's next turn comes later (a copy touched within a second before the park that
    // supersedes it is not superseded).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let _ = n2.child.kill();
    let _ = n2.child.wait();
    let err = c1.resume(&ns1, "agent").await.unwrap_err();
    assert!(
        matches!(err, ClientError::Unavailable(ref m) if m.contains("n2") && m.contains("did not answer")),
        "{err}"
    );
    // The agent recomputes and parks its new context through n1.
    let info = c1.park(&ns1, "agent", &new_toks, &new_blocks, &ParkOptions::default(), 0).await.unwrap();
    assert_eq!(info.version, 1);
    assert_eq!(metric(&n1.scrape(), "kvtier_session_created_unverified_total", &[]), 1.0);

    // n2 back with its old copy.
    let again = n2.restart_in_place(&args2);
    n2 = again;
    until_members([&n1, &n2], 2);
    let c2 = n2.client().await;
    let ns2 = handle(&c2).await;
    let listed: Vec<String> = c2.list_sessions(None).await.unwrap().into_iter().map(|s| s.id).collect();
    assert_eq!(listed, ["agent"], "n2 recovered its old copy");
    let r = c2.resume(&ns2, "agent").await.unwrap();
    assert_eq!(r.info.token_count, new_toks.len() as u64, "n2 served its old context");
    assert!(r.blocks == new_blocks, "wrong bytes through n2");
    // n1 gave its copy to n2 (one copy: it follows the resume), and asks n2 for it — once it
    // has seen n2 again (a resume meanwhile says n2 did not answer).
    let deadline = Instant::now() + Duration::from_secs(15);
    let r = loop {
        match c1.resume(&ns1, "agent").await {
            Ok(r) => break r,
            Err(ClientError::Unavailable(m)) if Instant::now() < deadline && m.contains("n2") => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => panic!("resume through n1: {e}"),
        }
    };
    assert!(r.blocks == new_blocks, "wrong bytes through n1");
    let r = c2.resume(&ns2, "agent").await.unwrap();
    assert!(r.blocks == new_blocks, "wrong bytes through n2, again");
}

/// With one copy, the holder stopped gracefully leaves the cluster at once, and its copy with it:
/// a resume through the other node says the session may be on the member that left, naming it,
/// not a bare "not found"; once the holder is back (its disk recovered), the resume finds the
/// session. An id asked while no member has left is plain "not found".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_while_the_only_holder_has_left_says_it_may_be_there() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let RfOnePair { n1, mut n2, args2, c1, c2, ns1, ns2 } = rf1_pair_n2_on_disk(&redis, dir.path()).await;
    let args2: Vec<&str> = args2.iter().map(String::as_str).collect();
    let plain = |e: &ClientError| matches!(e, ClientError::SessionNotFound(m) if !m.contains("left the cluster"));
    let err = c1.resume(&ns1, "never").await.unwrap_err();
    assert!(plain(&err), "{err}");
    let (toks, blocks) = session(&ns2, 41);
    c2.park(&ns2, "away", &toks, &blocks, &ParkOptions::default(), 0).await.unwrap();

    let pid = rustix::process::Pid::from_raw(n2.child.id() as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let _ = n2.child.wait();
    until_members([&n1], 1);
    // The gauge may say 1 a moment before the node's placement does (then n2 "did not answer").
    let deadline = Instant::now() + Duration::from_secs(10);
    let err = loop {
        match c1.resume(&ns1, "away").await.unwrap_err() {
            ClientError::Unavailable(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            e => break e,
        }
    };
    assert!(
        matches!(&err, ClientError::SessionNotFound(m) if m.starts_with("KV:Session:NotFound")
            && m.contains("member n2 (") && m.contains("left the cluster lately")),
        "{err}"
    );

    // n2 back with its copy: the session is found through n1 (once n1 has seen n2 again), and
    // with no member away an unknown id is plain "not found" again.
    n2 = n2.restart_in_place(&args2);
    until_members([&n1, &n2], 2);
    let deadline = Instant::now() + Duration::from_secs(15);
    let r = loop {
        match c1.resume(&ns1, "away").await {
            Ok(r) => break r,
            Err(ClientError::SessionNotFound(_) | ClientError::Unavailable(_)) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => panic!("resume through n1: {e}"),
        }
    };
    assert!(r.blocks == blocks, "wrong bytes through n1");
    let err = c1.resume(&ns1, "never").await.unwrap_err();
    assert!(plain(&err), "{err}");
}

/// As above with the holder cut off (SIGSTOPped) rather than killed: it is not restarted, so it
/// never rechecks its copy — instead the node that took the new park tells it, once it answers
/// again, that its copy is superseded; it drops it, and a resume through it serves the new
/// context. Before, it went on serving the old one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_cut_off_while_the_session_was_parked_anew_drops_its_copy_once_it_answers() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let start = |id: &str| {
        let cfg = rf1_ttl60(&redis, dir.path(), id, "1s");
        ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"])
    };
    let (n1, n2) = (start("n1"), start("n2"));
    until_members([&n1, &n2], 2);
    let (c1, c2) = (n1.client().await, n2.client().await);
    let (ns1, ns2) = (handle(&c1).await, handle(&c2).await);
    let (old_toks, old_blocks) = session(&ns2, 41);
    c2.park(&ns2, "agent", &old_toks, &old_blocks, &ParkOptions::default(), 0).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;

    stop_process(n2.child.id());
    let err = c1.resume(&ns1, "agent").await.unwrap_err();
    assert!(matches!(err, ClientError::Unavailable(ref m) if m.contains("n2")), "{err}");
    let new_toks = tokens(1042, 16 * 7 + 3);
    let new_blocks = session_payloads(&ns1, &new_toks);
    c1.park(&ns1, "agent", &new_toks, &new_blocks, &ParkOptions::default(), 0).await.unwrap();
    continue_process(n2.child.id());

    let deadline = Instant::now() + Duration::from_secs(30);
    while copies(&[&c2]).await.contains_key("agent") {
        assert!(Instant::now() < deadline, "n2 kept its superseded copy");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(metric(&n1.scrape(), "kvtier_session_superseded_copies_dropped_total", &[]), 1.0);
    let r = c2.resume(&ns2, "agent").await.unwrap();
    assert_eq!(r.info.token_count, new_toks.len() as u64, "n2 served the old context");
    assert!(r.blocks == new_blocks, "wrong bytes through n2");
}

/// A session that expired on the node holding it says "expired" through a node without a copy
/// too, as through its holder (the owners' answers carry the expiry). Before, "not found".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_session_says_expired_through_a_node_without_a_copy() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let (_nodes, [c1, c2], [ns1, ns2]) = pair_rf1(&redis, dir.path()).await;
    let (toks, blocks) = session(&ns1, 9);
    let short = ParkOptions { ttl: Some(Duration::from_millis(300)), ..ParkOptions::default() };
    c1.park(&ns1, "brief", &toks, &blocks, &short, 0).await.unwrap();
    c1.park(&ns1, "kept", &toks, &blocks, &ParkOptions::default(), 0).await.unwrap();
    tokio::time::sleep(Duration::from_millis(800)).await;
    let err = c2.resume(&ns2, "brief").await.unwrap_err();
    assert!(matches!(err, ClientError::SessionExpired(_)), "through n2: {err}");
    let err = c1.resume(&ns1, "brief").await.unwrap_err();
    assert!(matches!(err, ClientError::SessionExpired(_)), "through n1: {err}");
    // A session nobody had is still "not found"; a live one still moves.
    let err = c2.resume(&ns2, "never").await.unwrap_err();
    assert!(matches!(err, ClientError::SessionNotFound(_)), "{err}");
    assert!(c2.resume(&ns2, "kept").await.unwrap().blocks == blocks);
}

/// A node too small for a session is passed over for the next owner, and not sent the
/// session's blocks again and again: parks through n1 keep their two copies (n1 and n3) although
/// n2, a 16 MiB node, may come first in placement; with n3 killed, re-replication finds no room on
/// n2 and leaves it alone (nothing sent, n2 not taken for down), and when n3 is back the copies are
/// made there. Before, n2 was sent every block on each park and every 5 s of re-replication (its
/// DRAM churned), and the refusal ("lost N blocks before the manifest") marked it down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_too_small_for_a_session_is_passed_over_not_churned() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let start = |id: &str, dram: &str| node_rf2_slow_peers(&redis, dir.path(), id, dram);
    let n1 = start("n1", "96MiB");
    let n2 = start("n2", "16MiB");
    let mut n3 = start("n3", "96MiB");
    until_members([&n1, &n2, &n3], 3);
    let (c1, c2, c3) = (n1.client().await, n2.client().await, n3.client().await);
    let ns = handle(&c1).await;
    let bytes_into = |c: &KvClient| {
        let c = c.clone();
        async move {
            let s = c.stats().await.unwrap();
            s.tiers.iter().find(|t| t.tier == "dram").unwrap().bytes_in
        }
    };
    // Sessions of 20 MiB (640 blocks of 32 KiB): more than n2 can hold.
    let mut parked = Vec::new();
    for i in 0..3u32 {
        let toks = tokens(3000 + i, 640 * 16);
        let blocks = session_payloads(&ns, &toks);
        let id = format!("big-{i}");
        c1.park(&ns, &id, &toks, &blocks, &ParkOptions::default(), 0).await.unwrap();
        parked.push((id, toks, blocks));
    }
    assert_eq!(copies(&[&c3]).await.len(), 3, "n3 holds the copies");
    // n3 killed: n1's re-replication finds only n2, which has no room; n2 is sent nothing (what
    // it took before are the blocks' own copies, forwarded by the parks' stores).
    // The parks' own forwards (n2 owns some of the blocks) done before the baseline.
    let deadline = Instant::now() + Duration::from_secs(20);
    let n1_owes = || {
        let m = n1.scrape();
        metric(&m, "kvtier_peer_forward_queue_bytes", &[]) + metric(&m, "kvtier_peer_handoff_pending", &[])
    };
    // Forwards that timed out are handed over later (hints): done too.
    while n1_owes() > 0.0 {
        assert!(Instant::now() < deadline, "n1's forwards never drained");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = bytes_into(&c2).await;
    let _ = n3.child.kill();
    let _ = n3.child.wait();
    until_members([&n1, &n2], 2);
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(&n1.scrape(), "kvtier_session_copies_refused_total", &[]) < 3.0 {
        assert!(Instant::now() < deadline, "n1 never asked n2 for the copies n3 held");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(6)).await; // past a retry of re-replication
    assert_eq!(bytes_into(&c2).await - before, 0, "n2 was sent blocks of sessions it can't hold");
    assert_eq!(metric(&n1.scrape(), "kvtier_session_copies_refused_total", &[]), 3.0, "asked n2 again");
    // n2 still serves, and is not taken for down: a small park through n1 gets its copy there
    // when n2 is its owner, or on n1 alone otherwise; either way it resumes through n2.
    let (toks, blocks) = session(&ns, 77);
    let _ = c1.park(&ns, "small", &toks, &blocks, &ParkOptions::default(), 0).await;
    let ns2 = handle(&c2).await;
    assert!(c2.resume(&ns2, "small").await.unwrap().blocks == blocks);
    // n3 back (empty): the copies are made there again.
    n3 = start("n3", "96MiB");
    let c3 = n3.client().await;
    until_members([&n1, &n2, &n3], 3);
    let deadline = Instant::now() + Duration::from_secs(20);
    while copies(&[&c3]).await.len() < 3 {
        assert!(Instant::now() < deadline, "the copies were not made again on n3: {:?}", copies(&[&c3]).await);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let ns3 = handle(&c3).await;
    for (id, _, blocks) in &parked {
        assert!(c3.resume(&ns3, id).await.unwrap().blocks == *blocks, "{id} on n3");
    }
}

/// A node is passed over for a session larger than it can hold *as stored*: an NVFP4 session of
/// 24 MiB of raw KV is about 7 MiB, so a 16 MiB node takes its copy (rf 2: the park is
/// acknowledged only then). Before, the pre-check compared the manifest's raw size
/// with the node's capacity, and the park failed with `KV:Capacity` naming a node with room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quantized_session_is_copied_to_a_node_smaller_than_its_raw_kv() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let start = |id: &str, dram: &str| node_rf2_slow_peers(&redis, dir.path(), id, dram);
    let n1 = start("n1", "96MiB");
    let n2 = start("n2", "16MiB");
    until_members([&n1, &n2], 2);
    let (c1, c2) = (n1.client().await, n2.client().await);
    let ns1 = handle(&c1).await.with_codec(kvtier_proto::CodecId::NVFP4).unwrap();
    // 768 blocks of 32 KiB: 24 MiB of smooth fp16 KV (quantizable), no tail.
    let toks = tokens(4000, 768 * 16);
    let elements = small_layout().block_bytes() as usize / 2;
    let blocks: Vec<Bytes> = (0..768)
        .map(|b| {
            (0..elements)
                .flat_map(|i| {
                    let v = ((i * 7 + b * 13) as f32 * 0.011).sin() * 3.0;
                    half::f16::from_f32(v).to_bits().to_le_bytes()
                })
                .collect::<Vec<u8>>()
                .into()
        })
        .collect();
    let info = c1.park(&ns1, "quantized", &toks, &blocks, &ParkOptions::default(), 0).await.unwrap();
    assert_eq!(info.bytes, 24 << 20, "the manifest counts raw KV");
    assert_eq!(copies(&[&c1, &c2]).await.get("quantized"), Some(&2), "both nodes hold a copy");
    assert_eq!(metric(&n1.scrape(), "kvtier_session_copies_refused_total", &[]), 0.0);
    // A copy is held whole (its blocks pinned there); it resumes through either node alike.
    let from_n1 = c1.resume(&ns1, "quantized").await.unwrap().blocks;
    assert_eq!(from_n1.len(), 768);
    let from_n2 = c2.resume(&handle(&c2).await, "quantized").await.unwrap().blocks;
    assert!(from_n2 == from_n1, "n2 serves what n1 serves");
}

/// A namespace's own `replicas` overrides the cluster's `cluster_rf`: in an rf = 1 cluster, a
/// namespace registered with 2 has its sessions on two nodes and they survive n1's SIGKILL,
/// while the default namespace's session (one copy, on n1) is unavailable afterwards, promptly,
/// naming n1 (still a member: it may hold it), not "not found".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_chooses_its_own_replication_factor() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let mut nodes: Vec<ServerProcess> = IDS.iter().map(|id| node_rf(&redis, dir.path(), id, 1)).collect();
    until_members(&nodes, 3);
    let spec = |replicas: u8| namespace("agents", b"own-rf", small_layout()).with_replicas(replicas);
    let c1 = nodes[0].client().await;
    let (two, one) = (c1.register(spec(2)).await.unwrap(), c1.register(spec(0)).await.unwrap());
    assert_ne!(two.id, one.id, "replicas is part of the namespace's identity");
    let (t2, b2) = session(&two, 1);
    let (t1, b1) = session(&one, 1);
    c1.park(&two, "kept", &t2, &b2, &ParkOptions::default(), 0).await.unwrap();
    c1.park(&one, "single", &t1, &b1, &ParkOptions::default(), 0).await.unwrap();
    let clients = [c1, nodes[1].client().await, nodes[2].client().await];
    let held = copies(&clients.iter().collect::<Vec<_>>()).await;
    assert!(held["kept"] >= 2, "{held:?}");
    assert_eq!(held["single"], 1, "{held:?}");

    let _ = nodes[0].child.kill();
    let _ = nodes[0].child.wait();
    let c2 = &clients[1];
    let (two2, one2) = (c2.register(spec(2)).await.unwrap(), c2.register(spec(0)).await.unwrap());
    let r = c2.resume(&two2, "kept").await.unwrap();
    assert!(r.blocks == b2, "wrong bytes");
    let t = Instant::now();
    let err = c2.resume(&one2, "single").await.unwrap_err();
    assert!(
        matches!(err, ClientError::Unavailable(ref m) if m.contains("n1") && m.contains("did not answer")),
        "{err}"
    );
    assert!(t.elapsed() < Duration::from_secs(3), "the miss took {:?}", t.elapsed());
}

/// Parks session `id` (the tokens of `seed`) through n1, stops a node other than n1 that holds a
/// copy until the others see it gone (its TTL), and drops the session through n1: the stopped
/// node's index and pid (still stopped).
async fn dropped_while_a_holder_is_away(
    nodes: &[ServerProcess],
    clients: &[KvClient],
    ns: &[NamespaceHandle],
    id: &str,
    seed: u32,
) -> (usize, u32) {
    let (toks, blocks) = session(&ns[0], seed);
    clients[0].park(&ns[0], id, &toks, &blocks, &ParkOptions::default(), 0).await.unwrap();
    let mut away = None;
    for (i, c) in clients.iter().enumerate().skip(1) {
        if c.list_sessions(None).await.unwrap().iter().any(|s| s.id == id) {
            away = Some(i);
        }
    }
    let away = away.expect("a second node holds a copy");
    let pid = nodes[away].child.id();
    stop_process(pid);
    until_members(nodes.iter().enumerate().filter(|(i, _)| *i != away).map(|(_, n)| n), 2);
    assert!(clients[0].drop_session(&ns[0], id).await.unwrap());
    (away, pid)
}

/// A node away (stopped past its TTL) while a session was dropped comes back with its old copy:
/// the nodes that saw the drop remember it, so no resume anywhere takes the copy back (the node
/// that was away drops it), and no node holds it afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_dropped_while_a_copy_holder_was_away_stays_dropped() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let (nodes, clients, ns) = fleet(&redis, dir.path()).await;
    let (away, pid) = dropped_while_a_holder_is_away(&nodes, &clients, &ns, "gone", 7).await;
    continue_process(pid);
    until_members(&nodes, 3);
    // The node that was away last, so the others answer while its copy is still there.
    let mut order: Vec<usize> = (0..3).filter(|&i| i != away).collect();
    order.push(away);
    for i in order {
        let err = clients[i].resume(&ns[i], "gone").await.unwrap_err();
        assert!(matches!(err, ClientError::SessionNotFound(_)), "n{}: {err}", i + 1);
    }
    let c = copies(&clients.iter().collect::<Vec<_>>()).await;
    assert!(!c.contains_key("gone"), "a dropped session is held again: {c:?}");
    // Counted after the copy is gone (by re-replication's pass, maybe while the resume ran).
    until_metric(&nodes[away], "kvtier_session_stale_copies_dropped_total", &[], 1.0);

    // Parked again under the same id after the drop: a new session, replicated and resumed as
    // any other (the drop is remembered against older copies only).
    let (toks, blocks) = session(&ns[away], 8);
    clients[away].park(&ns[away], "gone", &toks, &blocks, &ParkOptions::default(), 0).await.unwrap();
    for (c, ns) in clients.iter().zip(&ns) {
        let r = c.resume(ns, "gone").await.unwrap();
        assert!(r.blocks == blocks, "wrong bytes");
    }

    // Dropped through a node that holds no copy of its own (rf 2 of 3 nodes: one has none):
    // it says the session was dropped (the owners' copies went), not "no session".
    let (toks, blocks) = session(&ns[0], 9);
    clients[0].park(&ns[0], "elsewhere", &toks, &blocks, &ParkOptions::default(), 0).await.unwrap();
    let mut without = None;
    for (i, c) in clients.iter().enumerate() {
        if !c.list_sessions(None).await.unwrap().iter().any(|s| s.id == "elsewhere") {
            without = Some(i);
        }
    }
    let i = without.expect("a node without a copy");
    assert!(clients[i].drop_session(&ns[i], "elsewhere").await.unwrap(), "n{} said no session", i + 1);
    until_no_copy(&clients.iter().collect::<Vec<_>>(), "elsewhere").await;
}

/// The nodes that saw a session's drop remember it across a restart (the drop is in their
/// session logs): killed and started again before the node that was away comes back, they still
/// refuse its old copy, and no node serves or holds the session afterwards. Before, the drop was
/// remembered in memory only, and the old copy was taken back everywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drop_is_remembered_across_a_restart_of_the_nodes_that_saw_it() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let args: Vec<Vec<String>> = IDS
        .iter()
        .map(|id| {
            let cfg = config(&redis, dir.path(), id, 2, "disk_capacity = \"64MiB\"\n");
            ["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"].map(String::from).to_vec()
        })
        .collect();
    let strs = |i: usize| args[i].iter().map(String::as_str).collect::<Vec<_>>();
    let mut nodes: Vec<ServerProcess> = (0..3).map(|i| ServerProcess::start(&strs(i))).collect();
    until_members(&nodes, 3);
    let mut clients = vec![nodes[0].client().await, nodes[1].client().await, nodes[2].client().await];
    let ns = futures::future::join_all(clients.iter().map(|c| async move { handle(c).await })).await;
    let (away, pid) = dropped_while_a_holder_is_away(&nodes, &clients, &ns, "gone", 21).await;

    // Both nodes that saw the drop are killed and started again on their data, the away node
    // still stopped.
    for i in (0..3).filter(|&i| i != away) {
        restart_node(&mut nodes, &mut clients, i, &strs(i)).await;
    }
    until_members(nodes.iter().enumerate().filter(|(i, _)| *i != away).map(|(_, n)| n), 2);
    continue_process(pid);
    until_members(&nodes, 3);
    // The re-replication the return sets off has had its pass (copies refused, the stale one
    // dropped) before anyone asks.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut order: Vec<usize> = (0..3).filter(|&i| i != away).collect();
    order.push(away);
    for i in order {
        let err = clients[i].resume(&ns[i], "gone").await.unwrap_err();
        assert!(matches!(err, ClientError::SessionNotFound(_)), "n{}: {err}", i + 1);
    }
    until_no_copy(&clients.iter().collect::<Vec<_>>(), "gone").await;
}

/// A park left short of copies (the other owner stalled, still a member) is made up for once
/// that node answers again, without a membership change to set re-replication off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_park_short_of_copies_is_made_up_for_when_the_owner_answers_again() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    // A TTL far above the stall: the stalled node stays a member throughout.
    let nodes: Vec<ServerProcess> = IDS[..2]
        .iter()
        .map(|id| {
            let cfg = dir.path().join(format!("{id}.toml"));
            let text = format!(
                "cluster = \"{}\"\nnode_id = \"{id}\"\ncluster_ttl = \"60s\"\npeer_rebalance = \"off\"\ncluster_rf = 2\npeer_timeout = \"1s\"\n",
                redis.url()
            );
            std::fs::write(&cfg, text).unwrap();
            ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"])
        })
        .collect();
    until_members(&nodes, 2);
    let clients = [nodes[0].client().await, nodes[1].client().await];
    let ns = handle(&clients[0]).await;
    let (toks, blocks) = session(&ns, 9);
    let pid = nodes[1].child.id();
    stop_process(pid);
    let err = clients[0].park(&ns, "short", &toks, &blocks, &ParkOptions::default(), 0).await.unwrap_err();
    assert!(matches!(err, ClientError::Unavailable(ref m) if m.contains("held by 1 of 2 nodes")), "{err}");
    continue_process(pid);
    let deadline = Instant::now() + Duration::from_secs(20);
    while copies(&[&clients[0], &clients[1]]).await.get("short") != Some(&2) {
        assert!(
            Instant::now() < deadline,
            "the missing copy was never made: {}",
            nodes[0]
                .scrape()
                .lines()
                .filter(|l| l.contains("session") || l.contains("peer_err"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(metric(&nodes[0].scrape(), "kvtier_membership_members", &[]), 2.0, "the membership changed");
    // Counted once n2 has answered the copy, which it may list before that.
    until_metric(&nodes[0], "kvtier_session_recopied_total", &[], 1.0);
    let ns1 = handle(&clients[1]).await;
    assert!(clients[1].resume(&ns1, "short").await.unwrap().blocks == blocks, "wrong bytes");
}

/// A resume through a node where the tenant is at its `max_sessions` can't take the session
/// another node holds: it says so (a quota), not "not found".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_refused_by_the_tenant_s_quota_here_says_so() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let extra = "auth_token = \"operator-secret-0123456789\"\n[[tenants]]\nname = \"agents\"\n\
                 tokens = [\"agents-secret-0123456789\"]\nmax_sessions = 1\n";
    let nodes: Vec<ServerProcess> = IDS[..2]
        .iter()
        .map(|id| {
            let cfg = config(&redis, dir.path(), id, 1, extra);
            ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"])
        })
        .collect();
    until_members(&nodes, 2);
    let connect = |n: usize| {
        let cfg =
            kvtier_client::ClientConfig { auth_token: Some("agents-secret-0123456789".into()), ..Default::default() };
        let addr = nodes[n].grpc_addr();
        async move { KvClient::connect(&addr, cfg).await.unwrap() }
    };
    let (c1, c2) = (connect(0).await, connect(1).await);
    let (ns1, ns2) = (handle(&c1).await, handle(&c2).await);
    let (t1, b1) = session(&ns1, 21);
    let (t2, b2) = session(&ns2, 22);
    c1.park(&ns1, "first", &t1, &b1, &ParkOptions::default(), 0).await.unwrap();
    c2.park(&ns2, "second", &t2, &b2, &ParkOptions::default(), 0).await.unwrap();
    let err = c2.resume(&ns2, "first").await.unwrap_err();
    assert!(matches!(err, ClientError::QuotaExceeded(ref m) if m.contains("held by node n1")), "{err}");
    // Where the tenant has room, it resumes as before.
    assert!(c1.resume(&ns1, "first").await.unwrap().blocks == b1, "wrong bytes");
}

/// A session dropped while a holder of a copy was away, then parked again under its id through
/// another node before that holder is back: every node answers the new session, exact bytes,
/// before and after the holder met the drop (remembered as of when it was made, the drop never
/// takes the new session for a dropped one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_parked_again_while_a_holder_of_the_dropped_one_was_away_is_the_one_served() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let (nodes, clients, ns) = fleet(&redis, dir.path()).await;
    let (_, pid) = dropped_while_a_holder_is_away(&nodes, &clients, &ns, "s", 11).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (toks, new) = session(&ns[0], 12);
    clients[0].park(&ns[0], "s", &toks, &new, &ParkOptions::default(), 0).await.unwrap();
    continue_process(pid);
    until_members(&nodes, 3);
    for round in 0..2 {
        // The second round after the re-replication passes the membership change set off.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        for (i, (c, ns)) in clients.iter().zip(&ns).enumerate() {
            let r = c.resume(ns, "s").await.unwrap_or_else(|e| panic!("round {round}, n{}: {e}", i + 1));
            assert!(r.blocks == new, "round {round}, n{}: the dropped session's bytes", i + 1);
        }
    }
}

/// Two extends of one session at the same version through two nodes at once are never both
/// acknowledged: a node whose copy meets another context at the version it made answers
/// `VersionConflict`. Before, both writers were told their turn was stored, and the nodes served
/// different bytes for that version for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_writes_of_one_version_through_two_nodes_are_never_both_acknowledged() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let (nodes, clients, ns) = fleet(&redis, dir.path()).await;
    let mut raced = 0;
    // Parks whose other copy went to n3 (about half, and all of them while n1 skips a slow n2
    // for a moment) are passed over.
    let deadline = Instant::now() + Duration::from_secs(60);
    for round in 0..400u32 {
        if raced == 8 || Instant::now() > deadline {
            break;
        }
        let id = format!("race-{round}");
        let (toks, blocks) = session(&ns[0], 50 + round);
        clients[0].park(&ns[0], &id, &toks, &blocks, &ParkOptions::default(), 0).await.unwrap();
        // Written through its two holders (n1, and n2 when it holds the other copy). One passed
        // over is dropped (its pins would add up round after round), and a moment let pass: a
        // busy machine can have n1 skip a slow n2 for a while.
        if !copies(&[&clients[1]]).await.contains_key(&id) {
            clients[0].drop_session(&ns[0], &id).await.unwrap();
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        raced += 1;
        let turn = |seed: u32| {
            let mut t = toks.clone();
            t.extend(tokens(seed, 16));
            t
        };
        let (ta, tb) = (turn(3000 + round), turn(4000 + round));
        let (pa, pb) = (session_payloads(&ns[0], &ta), session_payloads(&ns[1], &tb));
        let base = toks.len() / ns[0].block_tokens();
        let (a, b) = tokio::join!(
            clients[0].extend(&ns[0], &id, 1, toks.len(), &ta, &pa[base..]),
            clients[1].extend(&ns[1], &id, 1, toks.len(), &tb, &pb[base..]),
        );
        assert!(!(a.is_ok() && b.is_ok()), "round {round}: both writes of version 2 were acknowledged");
        let acked = match (&a, &b) {
            (Ok(_), _) => Some(&ta),
            (_, Ok(_)) => Some(&tb),
            _ => None,
        };
        for r in [a, b] {
            if let Err(e) = r {
                assert!(matches!(e, ClientError::VersionConflict(_)), "round {round}: {e}");
            }
        }
        // Both holders serve one context: the acknowledged write's, or with none the session as
        // it was (a write refused as concurrent is undone where it was made).
        let want = acked.map_or(toks.len(), |t| t.len()) as u64;
        let (r1, r2) = (clients[0].resume(&ns[0], &id).await.unwrap(), clients[1].resume(&ns[1], &id).await.unwrap());
        assert_eq!((r1.info.token_count, r2.info.token_count), (want, want), "round {round}");
        assert!(r1.blocks == r2.blocks, "round {round}: the holders serve different bytes");
        clients[0].drop_session(&ns[0], &id).await.unwrap();
    }
    assert_eq!(raced, 8, "sessions held by n1 and n2");
    // The writes did meet (not only one after the other, the second refused by its version).
    let met: f64 = nodes[..2].iter().map(|n| metric(&n.scrape(), "kvtier_session_concurrent_writes_total", &[])).sum();
    assert!(met >= 1.0, "no round had its two writes meet");
}

/// n1 and n3 with a disk tier (a killed one keeps its copies) and n2 DRAM-only (a restart
/// forgets): each node's `serve` arguments (for restarts), the nodes, a client of each and each
/// client's handle of the test namespace.
async fn disk_and_dram_fleet(
    redis: &Redis,
    dir: &std::path::Path,
) -> (Vec<Vec<String>>, Vec<ServerProcess>, [KvClient; 3], Vec<NamespaceHandle>) {
    let args: Vec<Vec<String>> = IDS
        .iter()
        .map(|id| {
            let disk = if *id == "n2" { "" } else { "disk_capacity = \"64MiB\"\n" };
            let cfg = config(redis, dir, id, 2, disk);
            ["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"].map(String::from).to_vec()
        })
        .collect();
    let nodes: Vec<ServerProcess> =
        args.iter().map(|a| ServerProcess::start(&a.iter().map(String::as_str).collect::<Vec<_>>())).collect();
    until_members(&nodes, 3);
    let clients = [nodes[0].client().await, nodes[1].client().await, nodes[2].client().await];
    let ns = futures::future::join_all(clients.iter().map(|c| async move { handle(c).await })).await;
    (args, nodes, clients, ns)
}

/// Parks sessions through `clients[0]` until one's other copy is on `clients[with]` and none on
/// `clients[without]`; its id.
async fn park_held_by(clients: &[KvClient; 3], ns: &NamespaceHandle, with: usize, without: usize, seed: u32) -> String {
    for i in 0..32u32 {
        let sid = format!("held-by-n1-n{}-{i}", with + 1);
        let (toks, blocks) = session(ns, seed + i);
        clients[0].park(ns, &sid, &toks, &blocks, &ParkOptions::default(), 0).await.unwrap();
        let held_with = copies(&[&clients[with]]).await.contains_key(&sid);
        if held_with && !copies(&[&clients[without]]).await.contains_key(&sid) {
            return sid;
        }
    }
    panic!("no session held by n1 and n{} alone", with + 1);
}

/// A drop taken by a node that holds no copy is remembered there too (in its session log): with
/// one holder killed during the drop and the other (DRAM-only) restarted since, the killed one
/// comes back with its old copy and no node serves the session. Before, only nodes whose copy
/// went remembered the drop, and the session came back everywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drop_taken_by_a_node_without_a_copy_is_remembered_there() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    // n1 and n3 with a disk tier (a killed n1 keeps its copy), n2 DRAM-only (a restart forgets).
    let (args, mut nodes, mut clients, ns) = disk_and_dram_fleet(&redis, dir.path()).await;
    let strs = |i: usize| args[i].iter().map(String::as_str).collect::<Vec<_>>();
    // A session parked through n1 whose other copy is on n2, so n3 holds none.
    let id = park_held_by(&clients, &ns[0], 1, 2, 70).await;

    let _ = nodes[0].child.kill();
    let _ = nodes[0].child.wait();
    assert!(clients[2].drop_session(&ns[2], &id).await.unwrap(), "n2's copy went");
    // n2 restarts empty (DRAM-only: its memory of the drop goes), then n1 comes back with its copy.
    let _ = nodes[1].child.kill();
    let _ = nodes[1].child.wait();
    for i in [1, 0] {
        restart_node(&mut nodes, &mut clients, i, &strs(i)).await;
    }
    until_members(&nodes, 3);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for i in [2, 1, 0] {
        let h = handle(&clients[i]).await;
        let err = clients[i].resume(&h, &id).await.unwrap_err();
        assert!(matches!(err, ClientError::SessionNotFound(_)), "n{}: {err}", i + 1);
    }
    until_no_copy(&clients.iter().collect::<Vec<_>>(), &id).await;
}

/// A node restarted after a session it holds was dropped elsewhere drops its copy on its own,
/// soon after it starts (its re-replication meets the drop), not only when a resume through it
/// asks: before, the copy was listed, pinned and routed to for as long as nobody resumed it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_dropped_elsewhere_goes_soon_after_its_holder_restarts() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let (args, mut nodes, mut clients, ns) = disk_and_dram_fleet(&redis, dir.path()).await;
    let strs = |i: usize| args[i].iter().map(String::as_str).collect::<Vec<_>>();
    // Held by n1 and n3 (both with a disk tier), not by n2.
    let id = park_held_by(&clients, &ns[0], 2, 1, 90).await;
    let _ = nodes[2].child.kill();
    let _ = nodes[2].child.wait();
    until_members(&nodes[..2], 2);
    assert!(clients[0].drop_session(&ns[0], &id).await.unwrap());
    restart_node(&mut nodes, &mut clients, 2, &strs(2)).await;
    until_members(&nodes, 3);
    let deadline = Instant::now() + Duration::from_secs(30);
    while copies(&[&clients[2]]).await.contains_key(&id) {
        assert!(Instant::now() < deadline, "n3 still holds a copy of a session dropped while it was away");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Counted just after the copy is gone from n3's list.
    until_metric(&nodes[2], "kvtier_session_stale_copies_dropped_total", &[], 1.0);
}

/// With two copies per session, both holders of a session at version 3 (n1 and n3, with disk
/// tiers) leave the membership (killed past their TTL), the session is parked anew under its id
/// through n2, left alone (version 1, a new context; short of its second copy but kept), and the
/// holders come back from their disks with version 3. The nodes, their clients and namespace
/// handles, the session's id and the new context's blocks.
async fn created_anew_while_both_holders_were_out(
    redis: &Redis,
    dir: &std::path::Path,
) -> (Vec<ServerProcess>, [KvClient; 3], String, Vec<Bytes>) {
    let (args, mut nodes, mut clients, ns) = disk_and_dram_fleet(redis, dir).await;
    let strs = |i: usize| args[i].iter().map(String::as_str).collect::<Vec<_>>();
    let id = park_held_by(&clients, &ns[0], 2, 1, 130).await;
    let (old_toks, old_blocks) = session(&ns[0], 140);
    for v in 1..=2 {
        clients[0].park(&ns[0], &id, &old_toks, &old_blocks, &ParkOptions::default(), v).await.unwrap();
    }
    for i in [0, 2] {
        let _ = nodes[i].child.kill();
        let _ = nodes[i].child.wait();
    }
    until_members(&nodes[1..2], 1);
    let err = clients[1].resume(&ns[1], &id).await.unwrap_err();
    assert!(matches!(err, ClientError::SessionNotFound(_)), "{err}");
    let (new_toks, new_blocks) = session(&ns[1], 150);
    let err = clients[1].park(&ns[1], &id, &new_toks, &new_blocks, &ParkOptions::default(), 0).await.unwrap_err();
    assert!(matches!(err, ClientError::Unavailable(ref m) if m.contains("version 1")), "{err}");
    for i in [0, 2] {
        restart_node(&mut nodes, &mut clients, i, &strs(i)).await;
    }
    until_members(&nodes, 3);
    (nodes, clients, id, new_blocks)
}

/// Waits (up to 30 s) until at least two nodes hold session `id` and every copy is version 1.
async fn until_only_version_1(clients: &[KvClient; 3], id: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut held = Vec::new();
        for c in clients {
            held.extend(c.list_sessions(None).await.unwrap().into_iter().filter(|s| s.id == id).map(|s| s.version));
        }
        if held.len() >= 2 && held.iter().all(|&v| v == 1) {
            return;
        }
        assert!(Instant::now() < deadline, "copies of the old session are still held: versions {held:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Every node serves the session created anew (see [`created_anew_while_both_holders_were_out`]),
/// a resume through a returned holder first: a copy last touched before a session's creation is
/// an older session's, whatever its version. Before, the holders' version 3 won there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_created_anew_while_both_holders_were_out_is_served_not_their_higher_version() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let (_nodes, clients, id, new_blocks) = created_anew_while_both_holders_were_out(&redis, dir.path()).await;
    for i in [0, 2, 1] {
        let h = handle(&clients[i]).await;
        let r = clients[i].resume(&h, &id).await.unwrap();
        assert_eq!(r.info.version, 1, "n{}: the old session's version", i + 1);
        assert!(r.blocks == new_blocks, "n{}: the old session's context", i + 1);
    }
    until_only_version_1(&clients, &id).await;
}

/// Left alone (no resume), re-replication settles the same way: n2 copies the new session over
/// the returned holders' older one, which they drop. Before, n2 adopted their version 3 over it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_created_anew_while_both_holders_were_out_replaces_their_copies() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let (nodes, clients, id, new_blocks) = created_anew_while_both_holders_were_out(&redis, dir.path()).await;
    until_only_version_1(&clients, &id).await;
    until_metric(&nodes[0], "kvtier_session_stale_copies_dropped_total", &[], 1.0);
    for (i, c) in clients.iter().enumerate() {
        let r = c.resume(&handle(c).await, &id).await.unwrap();
        assert!(r.info.version == 1 && r.blocks == new_blocks, "n{}: the old session", i + 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_of_a_namespace_unregistered_while_a_holder_was_away_do_not_come_back() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    // n1 and n3 with a disk tier (n3 comes back with its copy), n2 DRAM-only.
    let (args, mut nodes, mut clients, ns) = disk_and_dram_fleet(&redis, dir.path()).await;
    let strs = |i: usize| args[i].iter().map(String::as_str).collect::<Vec<_>>();
    // A session parked through n1 whose other copy is on n3, so n2 holds none.
    let id = park_held_by(&clients, &ns[0], 2, 1, 90).await;

    // n3 is away while the namespace is unregistered through n1 (n2 takes it too); then n1,
    // which owes n3 the unregistration, goes down before it can pass it on.
    let _ = nodes[2].child.kill();
    let _ = nodes[2].child.wait();
    let gone = clients[0].unregister(&ns[0]).await.unwrap();
    assert_eq!(gone.sessions_dropped, 1, "{gone:?}");
    let _ = nodes[0].child.kill();
    let _ = nodes[0].child.wait();
    restart_node(&mut nodes, &mut clients, 2, &strs(2)).await;
    until_members(&nodes[1..], 2);
    assert!(copies(&[&clients[2]]).await.contains_key(&id), "n3 came back with its copy");

    // A resume through n2 registers the namespace again (as a client's first call does) and
    // must not adopt n3's copy; one through n3 must not serve it either.
    for i in [1, 2] {
        let h = handle(&clients[i]).await;
        let got = clients[i].resume(&h, &id).await;
        assert!(matches!(got, Err(ClientError::SessionNotFound(_))), "n{}: {:?}", i + 1, got.map(|r| r.info.version));
    }
    until_no_copy(&[&clients[1], &clients[2]], &id).await;
}
