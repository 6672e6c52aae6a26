//! A partition between two nodes of a three-node cluster (real `kvtier serve` processes, a real
//! `redis-server`, `cluster_rf = 2`): n1 and n2 refuse each other — each accepts only its own
//! and n3's node certificate as the operator (mTLS between nodes), so every call between them
//! fails as a cut link would — while both reach n3 and Redis, which still lists all three.
//! Nothing hangs, nothing comes back wrong: loads through n2 get every block with an owner it
//! can reach and miss only those whose owners are n1 and n2; sessions parked on n1 are
//! acknowledged on n1 and n3, and resume on n2 from n3's copy.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use kvtier_client::{ClientConfig, ClientTls, KvClient, ParkOptions};
use kvtier_proto::NamespaceId;
use kvtier_tests::redis::Redis;
use kvtier_tests::*;

const IDS: [&str; 3] = ["n1", "n2", "n3"];
const TENANT_TOKEN: &str = "agents-token-0123456789";

fn pki(dir: &std::path::Path) {
    let mut runs: Vec<Vec<&str>> = vec![vec!["ca"]];
    for id in IDS {
        runs.push(vec!["node", "--name", id, "--host", id, "--host", "127.0.0.1"]);
    }
    for args in runs {
        let out = std::process::Command::new(kvtier_bin())
            .arg("cert")
            .args(&args)
            .arg("--dir")
            .arg(dir)
            .output()
            .expect("kvtier cert");
        assert!(out.status.success(), "kvtier cert: {}", String::from_utf8_lossy(&out.stderr));
    }
}

/// Node `id`, taking the node certificates named in `operators` as the operator.
fn node(redis: &Redis, dir: &std::path::Path, id: &str, operators: &[&str]) -> ServerProcess {
    let p = |f: String| dir.join(f).display().to_string();
    let names: Vec<String> = operators.iter().map(|n| format!("\"{n}\"")).collect();
    let cfg = dir.join(format!("{id}.toml"));
    std::fs::write(
        &cfg,
        format!(
            "cluster = \"{}\"\nnode_id = \"{id}\"\ncluster_ttl = \"2s\"\npeer_rebalance = \"off\"\ncluster_rf = 2\npeer_timeout = \"1s\"\n\
             [[tenants]]\nname = \"agents\"\ntokens = [\"{TENANT_TOKEN}\"]\n\
             [tls]\ncert = \"{}\"\nkey = \"{}\"\nclient_ca = \"{}\"\noperator_names = [{}]\nrequire_client_cert = false\n",
            redis.url(),
            p(format!("{id}.pem")),
            p(format!("{id}.key")),
            p("ca.pem".into()),
            names.join(", ")
        ),
    )
    .unwrap();
    ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"])
}

async fn client(n: &ServerProcess, dir: &std::path::Path) -> KvClient {
    let tls = ClientTls::from_files(&dir.join("ca.pem"), None).unwrap();
    let cfg = ClientConfig { tls: Some(tls), auth_token: Some(TENANT_TOKEN.into()), ..Default::default() };
    KvClient::connect(&n.grpc_addr(), cfg).await.expect("connect")
}

fn owners(ns: &NamespaceId, key: &kvtier_proto::BlockKey) -> BTreeSet<&'static str> {
    let p = kvtier_tests::redis::placement(&IDS, 64 << 20);
    p.owners(ns, key, 2)
        .into_iter()
        .map(|i| IDS[IDS.iter().position(|id| *id == p.members()[i].id.as_str()).unwrap()])
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_between_two_nodes_gives_misses_and_replica_reads_never_hangs_or_wrong_bytes() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    pki(dir.path());
    let mut nodes = vec![
        node(&redis, dir.path(), "n1", &["n1", "n3"]),
        node(&redis, dir.path(), "n2", &["n2", "n3"]),
        node(&redis, dir.path(), "n3", &["n1", "n2", "n3"]),
    ];
    until_members(&nodes, 3);
    let (c1, c2) = (client(&nodes[0], dir.path()).await, client(&nodes[1], dir.path()).await);
    let spec = namespace("agents", b"partition", small_layout());
    let (ns1, ns2) = (c1.register(spec.clone()).await.unwrap(), c2.register(spec).await.unwrap());

    // Blocks stored through n1: forwarded to their other owner, which fails when that is n2.
    let toks = tokens(3, 16 * 48);
    let payloads = full_block_payloads(&ns1, &toks);
    c1.store(&ns1, &toks, &payloads).await.unwrap().ok().unwrap();
    let keys = ns1.keys(&toks);
    let forwarded = |n: &ServerProcess| metric(&n.scrape(), "kvtier_peer_forwarded_blocks_total", &[]);
    let expect_n3: usize = keys.iter().filter(|k| owners(&ns1.id, k).contains("n3")).count();
    let deadline = Instant::now() + Duration::from_secs(10);
    while forwarded(&nodes[0]) < expect_n3 as f64 {
        assert!(Instant::now() < deadline, "n1 forwarded {} of {expect_n3} blocks to n3", forwarded(&nodes[0]));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Refused (n2 does not take n1's credential): dropped, not held as hints for a node that is
    // up and will refuse them again.
    let to_n2 = keys.iter().filter(|k| owners(&ns1.id, k).contains("n2")).count();
    assert!(to_n2 > 0, "n2 owns some of the blocks");
    let refused = || metric(&nodes[0].scrape(), "kvtier_peer_forward_dropped_total", &[]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while refused() == 0.0 {
        assert!(Instant::now() < deadline, "n1's forwards to n2 are not refused");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(metric(&nodes[0].scrape(), "kvtier_peer_handoff_pending", &[]), 0.0, "refused forwards held as hints");

    // Through n2, one block at a time (so one refusal doesn't skip n1 for the rest): every block
    // with an owner n2 reaches (n3, or n2 itself) comes back exact; those owned by n1 and n2
    // only miss; each answer within two peer timeouts.
    let mut misses = 0;
    for (i, k) in keys.iter().enumerate() {
        let o = owners(&ns1.id, k);
        let t = Instant::now();
        let got = c2.load_keys(&ns2, std::slice::from_ref(k)).await.unwrap();
        assert!(t.elapsed() < Duration::from_millis(2500), "block {i} took {:?}", t.elapsed());
        match (&got[0], o.contains("n3")) {
            (Some(f), _) => assert!(f.payload == payloads[i], "block {i}: wrong bytes"),
            (None, true) => panic!("block {i} (owners {o:?}) missed though n3 holds it"),
            (None, false) => misses += 1,
        }
    }
    let cut_off = keys.iter().filter(|k| !owners(&ns1.id, k).contains("n3")).count();
    assert!(cut_off > 0, "some blocks are owned by n1 and n2 only");
    assert_eq!(misses, cut_off, "exactly the blocks n2 can't reach miss");

    // Sessions parked on n1 are acknowledged on n1 and n3 (n2 refuses), and resume through n2
    // from n3's copy, exact bytes.
    for i in 0..6u32 {
        let st = tokens(100 + i, 16 * 3 + 5);
        let b = session_payloads(&ns1, &st);
        let t = Instant::now();
        c1.park(&ns1, &format!("p{i}"), &st, &b, &ParkOptions::default(), 0)
            .await
            .unwrap_or_else(|e| panic!("p{i}: {e}"));
        assert!(t.elapsed() < Duration::from_secs(3), "park p{i} took {:?}", t.elapsed());
        let r = c2.resume(&ns2, &format!("p{i}")).await.unwrap_or_else(|e| panic!("resume p{i} on n2: {e}"));
        assert!(r.blocks == b, "p{i}: wrong bytes");
    }
    assert!(nodes.iter_mut().all(|n| n.alive()));
    // Redis still lists all three: the partition is between the nodes, not in the membership.
    assert_eq!(metric(&nodes[1].scrape(), "kvtier_membership_members", &[]), 3.0);
}
