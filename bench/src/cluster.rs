//! `kvtier-bench cluster`: 1, 2 and 3 `kvtier serve` nodes on this machine sharing a real
//! `redis-server` for membership. Two measurements, each beside its baseline in the same run:
//!
//! - **Cross-node loads**: 1 MiB blocks stored through n1 (which keeps them all and forwards each
//!   to its owner); those the last node does not own are loaded through it — every block crosses
//!   nodes through the G4 peer tier — beside the same blocks loaded from n1, which holds them
//!   (the same-node figure), a client of the last node sending each key straight to its owner
//!   (`OwnerRouter`, one hop instead of two), and one loopback TCP stream (the wire's limit). The nodes share this
//!   machine's cores, so read the ratios.
//! - **Trace replay over a cluster**: the synthetic replicas + sessions trace with its 4 replicas
//!   spread over 3 nodes (the same total DRAM as one shared node), with and without the locality
//!   preference (`peer_cache`: a block fetched from a peer is kept on the reader's node, so the
//!   next read stays inside the node), beside one shared node: prefix hit rate and bytes moved
//!   between nodes.

use std::path::Path;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvtier_client::{ClientConfig, KvClient, OwnerRouter};
use kvtier_proto::{BlockKey, DType, HashScheme, KvLayout, Namespace};
use serde::Serialize;

use crate::limits;
use crate::replay::{self, ReplayConfig, ReplayResult};
use crate::report::{bytes, f2};
use crate::servers::{KvtierServer, RedisServer};
use crate::stats::median;
use crate::trace::Trace;

/// One cluster size's load figures (GB/s, medians over runs).
#[derive(Debug, Clone, Serialize)]
pub struct LoadRow {
    pub nodes: usize,
    pub blocks: usize,
    /// Loaded from the node that holds them.
    pub local_gbps: f64,
    /// Loaded through a node that holds none of them (NaN with one node).
    pub remote_gbps: f64,
    /// Loaded by a client of that node sending each key straight to its owner (`OwnerRouter`).
    pub direct_gbps: f64,
    pub tcp_gbps: f64,
}

/// Starts `n` nodes of one cluster (ids n1..), each with `dram` bytes and `extra` TOML lines,
/// and waits until every node sees all `n`.
fn start_cluster(
    bin: &Path,
    redis: &RedisServer,
    dir: &Path,
    out: &Path,
    n: usize,
    dram: u64,
    extra: &str,
) -> anyhow::Result<Vec<KvtierServer>> {
    let mut nodes = Vec::with_capacity(n);
    for i in 1..=n {
        let d = dir.join(format!("n{i}"));
        std::fs::create_dir_all(&d)?;
        let cfg = d.join("node.toml");
        // Measured as a settled cluster: no rebalance pass (30 s after the nodes joined) walks
        // the blocks the run stored while it measures.
        std::fs::write(
            &cfg,
            format!(
                "cluster = \"{}\"\nnode_id = \"n{i}\"\ncluster_ttl = \"3s\"\npeer_timeout = \"10s\"\npeer_rebalance = \"off\"\n{extra}",
                redis.url()
            ),
        )?;
        let log = out.join(format!("cluster-n{i}.log"));
        nodes.push(KvtierServer::start_with(
            bin,
            &d.join("data"),
            dram,
            &log,
            &["--config", cfg.to_str().unwrap_or("")],
        )?);
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(20);
        for s in &nodes {
            let c = KvClient::connect(&s.grpc_addr, ClientConfig::default()).await?;
            let ns = c.register(namespace(KvLayout::new(1, 1, 16, DType::Bf16, 16))).await?;
            loop {
                let hint = c.route_hint_keys(&ns, &[BlockKey([0; 32])], None).await?;
                if hint.nodes.len() == n {
                    break;
                }
                anyhow::ensure!(Instant::now() < deadline, "the {n} nodes did not see each other within 20 s");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(nodes)
}

fn namespace(layout: KvLayout) -> Namespace {
    Namespace::new("bench", "cluster-bench", layout, HashScheme::Blake3, b"cluster")
}

/// Cross-node loads with 1, 2 and 3 nodes: `blocks` × 1 MiB per run, medians of `runs`.
pub fn loads(
    bin: &Path,
    redis_bin: &Path,
    dir: &Path,
    out: &Path,
    blocks: usize,
    runs: usize,
) -> anyhow::Result<Vec<LoadRow>> {
    let mut rows = Vec::new();
    for n in 1..=3usize {
        eprintln!("cluster: loads with {n} node(s)");
        let redis = RedisServer::start(redis_bin, &dir.join(format!("redis-loads-{n}")))?;
        let dram = (blocks as u64 * (1 << 20)) * 2 + (64 << 20);
        // Every remote load crosses nodes: nothing fetched is kept on the reader's node.
        let nodes = start_cluster(bin, &redis, &dir.join(format!("loads-{n}")), out, n, dram, "peer_cache = false\n")?;
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
        let row = rt.block_on(measure_loads(&nodes, blocks, runs))?;
        rows.push(row);
        drop(nodes);
        drop(redis);
    }
    Ok(rows)
}

async fn measure_loads(nodes: &[KvtierServer], blocks: usize, runs: usize) -> anyhow::Result<LoadRow> {
    let layout = KvLayout::new(8, 8, 128, DType::Bf16, 32); // 1 MiB blocks
    let mut clients = Vec::new();
    let mut handles = Vec::new();
    for s in nodes {
        let c = KvClient::connect(&s.grpc_addr, ClientConfig::default()).await?;
        handles.push(c.register(namespace(layout)).await?);
        clients.push(c);
    }
    // Stored through n1, which keeps every block and forwards each to its owner; the blocks the
    // last node (the reader) does not own are then loaded through it, each crossing nodes.
    let ns = &handles[0];
    let payload = Bytes::from(vec![0xa5u8; layout.block_bytes() as usize]);
    let keys: Vec<BlockKey> = (0..blocks as u64)
        .map(|i| {
            let mut k = [0u8; 32];
            k[..8].copy_from_slice(&i.to_le_bytes());
            k[8..16].copy_from_slice(&(nodes.len() as u64).to_le_bytes());
            BlockKey(k)
        })
        .collect();
    let frames =
        keys.iter().map(|k| ns.frame(*k, layout.block_tokens, payload.clone())).collect::<Result<Vec<_>, _>>()?;
    for f in frames.chunks(16) {
        clients[0].store_frames(f).await?;
    }
    // Forwarding runs after the acknowledgement: wait until n1's bytes sent to peers stop moving.
    let forwarded = |s: kvtier_proto::pb::StatsResponse| {
        s.tiers.iter().filter(|t| t.tier == "peer").map(|t| t.bytes_out).sum::<u64>()
    };
    let mut last = u64::MAX;
    for _ in 0..60 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = forwarded(clients[0].stats().await?);
        if now == last {
            break;
        }
        last = now;
    }
    let reader = nodes.len() - 1;
    let remote: Vec<BlockKey> = if nodes.len() == 1 {
        keys.clone()
    } else {
        let held = clients[reader].peer_exists_keys(&handles[reader], &keys).await?;
        keys.iter().zip(held).filter(|(_, h)| !h).map(|(k, _)| *k).collect()
    };
    let bytes = (remote.len() as u64 * layout.block_bytes()) as f64;
    let (mut local, mut cross, mut direct, mut tcp) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let router = OwnerRouter::new(clients[reader].clone(), ClientConfig::default()).await?;
    for _ in 0..runs {
        // Local: from n1, which holds them all.
        let t = Instant::now();
        let got = clients[0].load_keys(ns, &remote).await?;
        local.push(bytes / t.elapsed().as_secs_f64() / 1e9);
        anyhow::ensure!(got.iter().all(Option::is_some), "a local load missed");
        if nodes.len() > 1 {
            let t = Instant::now();
            let got = clients[reader].load_keys(&handles[reader], &remote).await?;
            cross.push(bytes / t.elapsed().as_secs_f64() / 1e9);
            anyhow::ensure!(got.iter().all(Option::is_some), "a cross-node load missed");
            let t = Instant::now();
            let got = router.load_keys(&handles[reader], &remote).await?;
            direct.push(bytes / t.elapsed().as_secs_f64() / 1e9);
            anyhow::ensure!(got.iter().all(Option::is_some), "a direct load missed");
        }
        tcp.push(limits::tcp_gbps(remote.len() << 20)?);
    }
    let _ = clients[0].purge(ns).await;
    Ok(LoadRow {
        nodes: nodes.len(),
        blocks: remote.len(),
        local_gbps: median(local),
        remote_gbps: if cross.is_empty() { f64::NAN } else { median(cross) },
        direct_gbps: if direct.is_empty() { f64::NAN } else { median(direct) },
        tcp_gbps: median(tcp),
    })
}

/// One replay of the trace over a cluster set-up.
#[derive(Debug, Clone, Serialize)]
pub struct ReplayRow {
    pub setup: String,
    pub result: ReplayResult,
}

/// The trace with its replicas over one shared node, then over 3 nodes with and without
/// `peer_cache`, and with clients storing and loading straight to the owners; every set-up has
/// the same total DRAM (`dram_total`).
pub fn replays(
    bin: &Path,
    redis_bin: &Path,
    dir: &Path,
    out: &Path,
    trace: &Trace,
    cfg: &ReplayConfig,
    dram_total: u64,
) -> anyhow::Result<Vec<ReplayRow>> {
    let setups: [(&str, usize, &str, bool); 4] = [
        ("1 shared node", 1, "", false),
        ("3 nodes, locality (peer_cache on)", 3, "peer_cache = true\n", false),
        ("3 nodes, no locality (peer_cache off)", 3, "peer_cache = false\n", false),
        ("3 nodes, clients straight to the owners", 3, "peer_cache = false\n", true),
    ];
    let mut rows = Vec::new();
    for (i, (setup, n, extra, direct)) in setups.iter().enumerate() {
        eprintln!("cluster: trace replay, {setup}");
        let redis = RedisServer::start(redis_bin, &dir.join(format!("redis-replay-{i}")))?;
        let nodes =
            start_cluster(bin, &redis, &dir.join(format!("replay-{i}")), out, *n, dram_total / *n as u64, extra)?;
        let addrs: Vec<String> = nodes.iter().map(|s| s.grpc_addr.clone()).collect();
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
        let pb = indicatif::ProgressBar::hidden();
        let cfg = ReplayConfig { direct_to_owners: *direct, ..*cfg };
        let result = rt.block_on(replay::replay(&addrs, trace, &cfg, dram_total / *n as u64, &pb))?;
        rows.push(ReplayRow { setup: setup.to_string(), result });
        drop(nodes);
        drop(redis);
    }
    Ok(rows)
}

/// The markdown tables of both measurements.
pub fn table(loads: &[LoadRow], replays: &[ReplayRow]) -> String {
    let mut s = String::from(
        "| nodes | blocks × 1 MiB | local load GB/s | cross-node load GB/s | straight to the owner GB/s | loopback TCP GB/s | cross-node / local | owner / local | cross-node / TCP |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in loads {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.nodes,
            r.blocks,
            f2(r.local_gbps),
            f2(r.remote_gbps),
            f2(r.direct_gbps),
            f2(r.tcp_gbps),
            f2(r.remote_gbps / r.local_gbps),
            f2(r.direct_gbps / r.local_gbps),
            f2(r.remote_gbps / r.tcp_gbps),
        ));
    }
    s.push_str("\n| set-up | prefix token hit rate | resumes that hit | bytes between nodes (full size) | bytes loaded (full size) |\n|---|---|---|---|---|\n");
    let base = replays.first().map(|r| r.result.prefix_token_hit_rate).unwrap_or(f64::NAN);
    for r in replays {
        let x = &r.result;
        s.push_str(&format!(
            "| {} | {} ({}× one node) | {}/{} | {} | {} |\n",
            r.setup,
            f2(x.prefix_token_hit_rate),
            f2(x.prefix_token_hit_rate / base),
            x.resume_hits,
            x.resumes,
            bytes(x.bytes_between_nodes),
            bytes(x.bytes_loaded),
        ));
    }
    s
}
