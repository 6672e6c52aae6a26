//! A client that sends stores and loads straight to each block's owner (`OwnerRouter`), against
//! three real `kvtier serve` nodes sharing a real `redis-server` (`cluster_rf = 1`): each block
//! lands on its owner alone (the home node is no relay: it receives only its own), loads come
//! back exact without the home node asking a peer, and with an owner killed its stores go
//! through the home node and its loads are misses — never an error or wrong bytes. A node that
//! relays a client's store keeps its copy at low priority: under pressure it goes before the
//! blocks the node owns.

use std::time::{Duration, Instant};

use kvtier_client::{ClientConfig, KvClient, OwnerRouter};
use kvtier_proto::{pb, BlockFrame};
use kvtier_tests::redis::Redis;
use kvtier_tests::*;

const IDS: [&str; 3] = ["n1", "n2", "n3"];

fn node(redis: &Redis, dir: &std::path::Path, id: &str) -> ServerProcess {
    node_with(redis, dir, id, "64MiB")
}

fn node_with(redis: &Redis, dir: &std::path::Path, id: &str, dram: &str) -> ServerProcess {
    let cfg = dir.join(format!("{id}.toml"));
    std::fs::write(
        &cfg,
        format!(
            "cluster = \"{}\"\nnode_id = \"{id}\"\ncluster_ttl = \"2s\"\npeer_rebalance = \"off\"\npeer_timeout = \"1s\"\npeer_cache = false\n",
            redis.url()
        ),
    )
    .unwrap();
    ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", dram])
}

async fn tier(c: &KvClient, name: &str) -> pb::TierStats {
    c.stats().await.unwrap().tiers.into_iter().find(|t| t.tier == name).expect("tier in Stats")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_and_loads_go_straight_to_the_owners_and_fall_back_through_home() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let mut nodes: Vec<ServerProcess> = IDS.iter().map(|id| node(&redis, dir.path(), id)).collect();
    until_members(&nodes, 3);
    let home = nodes[0].client().await;
    let router = OwnerRouter::new(home.clone(), ClientConfig::default()).await.unwrap();
    assert_eq!(router.members().len(), 3);
    let ns = home.register(namespace("acme", b"owners", small_layout())).await.unwrap();
    let toks = tokens(21, 16 * 60);
    let payloads = full_block_payloads(&ns, &toks);
    let keys = ns.keys(&toks);
    let frames: Vec<BlockFrame> =
        keys.iter().zip(&payloads).map(|(k, p)| ns.frame(*k, 16, p.clone()).unwrap()).collect();

    let st = router.store_frames(&ns, &frames).await.unwrap();
    assert!(st.iter().all(|s| s.is_held()), "{st:?}");
    // Each block is on its owner only: the home node took just its own share.
    let p = kvtier_tests::redis::placement(&IDS, 64 << 20);
    let owner = |k: &kvtier_proto::BlockKey| p.members()[p.owners(&ns.id, k, 1)[0]].id.as_str().to_string();
    let clients = [home.clone(), nodes[1].client().await, nodes[2].client().await];
    for (i, c) in clients.iter().enumerate() {
        let h = c.register(ns.namespace.clone()).await.unwrap();
        let held = c.peer_exists_keys(&h, &keys).await.unwrap();
        for (k, h) in keys.iter().zip(held) {
            assert_eq!(h, owner(k) == IDS[i], "{} holds exactly the blocks it owns", IDS[i]);
        }
    }
    let mine = keys.iter().filter(|k| owner(k) == "n1").count() as u64;
    assert_eq!(tier(&home, "dram").await.bytes_in, mine * ns.block_bytes(), "the home node relayed nothing");

    // Loads: exact bytes, none through the home node's peer tier.
    let got = router.load_keys(&ns, &keys).await.unwrap();
    for (i, g) in got.iter().enumerate() {
        assert!(g.as_ref().is_some_and(|f| f.payload == payloads[i]), "block {i}");
    }
    assert_eq!(tier(&home, "peer").await.requests, 0, "no block went through the home node");

    // n2 killed: its blocks are misses (rf = 1), the rest exact; stores it owned go through home.
    let _ = nodes[1].child.kill();
    let _ = nodes[1].child.wait();
    let t = Instant::now();
    let got = router.load_keys(&ns, &keys).await.unwrap();
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
    for (i, (g, k)) in got.iter().zip(&keys).enumerate() {
        match g {
            Some(f) => assert!(f.payload == payloads[i], "block {i}: wrong bytes"),
            None => assert_eq!(owner(k), "n2", "block {i} missed though its owner is alive"),
        }
    }
    let toks2 = tokens(22, 16 * 12);
    let p2 = full_block_payloads(&ns, &toks2);
    let frames2: Vec<BlockFrame> =
        ns.keys(&toks2).iter().zip(&p2).map(|(k, p)| ns.frame(*k, 16, p.clone()).unwrap()).collect();
    let st = router.store_frames(&ns, &frames2).await.unwrap();
    assert!(st.iter().all(|s| s.is_held()), "{st:?}");
    assert!(ns.keys(&toks2).iter().any(|k| owner(k) == "n2"), "some went n2's way");
    let got = home.load_keys(&ns, &ns.keys(&toks2)).await.unwrap();
    for (i, g) in got.iter().enumerate() {
        if owner(&ns.keys(&toks2)[i]) != "n3" {
            assert!(g.as_ref().is_some_and(|f| f.payload == p2[i]), "block {i} is on the home node");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relayed_copy_goes_before_the_blocks_a_node_owns() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let ids = ["n1", "n2"];
    let nodes: Vec<ServerProcess> = ids.iter().map(|id| node_with(&redis, dir.path(), id, "4MiB")).collect();
    until_members(&nodes, 2);
    let c1 = nodes[0].client().await;
    let ns = c1.register(namespace("acme", b"relay", small_layout())).await.unwrap();
    // About 5 MiB of blocks through n1 (4 MiB of DRAM): half are n2's, relayed.
    let toks = tokens(31, 16 * 160);
    let payloads = full_block_payloads(&ns, &toks);
    let keys = ns.keys(&toks);
    for (k, p) in keys.chunks(16).zip(payloads.chunks(16)) {
        let frames: Vec<BlockFrame> = k.iter().zip(p).map(|(k, p)| ns.frame(*k, 16, p.clone()).unwrap()).collect();
        c1.store_frames(&frames).await.unwrap();
    }
    let p = kvtier_tests::redis::placement(&ids, 4 << 20);
    let mine = |k: &kvtier_proto::BlockKey| p.members()[p.owners(&ns.id, k, 1)[0]].id.as_str() == "n1";
    let held = c1.peer_exists_keys(&ns, &keys).await.unwrap();
    let owned = keys.iter().filter(|k| mine(k)).count();
    let owned_held = keys.iter().zip(&held).filter(|(k, h)| mine(k) && **h).count();
    let relayed_held = keys.iter().zip(&held).filter(|(k, h)| !mine(k) && **h).count();
    assert!(relayed_held < keys.len() - owned, "n1 had to evict ({relayed_held} relayed copies kept)");
    assert_eq!(owned_held, owned, "n1 kept every block it owns ({relayed_held} relayed copies kept)");
}
