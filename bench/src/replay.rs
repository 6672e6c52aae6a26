//! Replays a [`Trace`] against a real kvtier server, as engine replicas would drive it, and turns
//! what it measured into prefill saved on a named GPU.
//!
//! Token counts and block boundaries are the trace's own (full size), so hit rates in tokens are
//! exact. Only the *bytes per token* are scaled down by `scale` (a 1-layer, 1-head layout of
//! `bytes_per_token / scale` bytes per token), and the DRAM cap with them, so a 2-core machine can
//! replay 128K-token contexts. Bytes moved are reported at full size (measured × scale).

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use bytes::Bytes;
use kvtier_client::{ClientConfig, KvClient, OwnerRouter, ParkOptions};
use kvtier_proto::{pb, BlockKey, DType, HashScheme, KvLayout, Namespace};
use serde::Serialize;

use crate::model::{Codec, Gpu, Link, Model};
use crate::stats::median;
use crate::trace::{tokens, Op, Trace};

pub const BLOCK_TOKENS: u32 = 16;

fn doc_stream(doc: u32) -> u64 {
    u64::from(doc)
}
fn suffix_stream(request: u32) -> u64 {
    (1 << 40) | u64::from(request)
}
fn session_stream(session: u32) -> u64 {
    (1 << 41) | u64::from(session)
}

/// The replay layout: 1 layer, 1 KV head, bf16, `head_dim` chosen so that a token is
/// `model bytes per token / scale` bytes.
pub fn replay_layout(model: &Model, scale: u64) -> anyhow::Result<KvLayout> {
    let b = model.kv_bytes_per_token(Codec::Bf16) as u64;
    anyhow::ensure!(
        b.is_multiple_of(4 * scale) && b / (4 * scale) <= 4096,
        "scale {scale} does not divide {} bytes per token into a valid layout",
        b
    );
    Ok(KvLayout::new(1, 1, (b / (4 * scale)) as u16, DType::Bf16, BLOCK_TOKENS))
}

/// Full blocks' bytes (at replay scale) of every distinct document, and the peak bytes parked
/// sessions hold at once: what a DRAM cap is sized from.
pub fn working_set(trace: &Trace, layout: &KvLayout) -> (u64, u64) {
    let bt = u64::from(layout.block_tokens);
    let mut used = std::collections::BTreeSet::new();
    let mut live: HashMap<u32, u64> = HashMap::new();
    let mut peak = 0u64;
    for e in &trace.events {
        match e.op {
            Op::Prefix { doc, .. } => {
                used.insert(doc);
            }
            Op::Park { session, tokens } | Op::Extend { session, tokens } => {
                live.insert(session, tokens);
            }
            Op::Drop { session } => {
                live.remove(&session);
            }
            Op::Resume { .. } => {}
        }
        peak = peak.max(live.values().map(|t| t.div_ceil(bt) * layout.block_bytes()).sum());
    }
    let docs = used.iter().map(|&d| trace.doc_tokens[d as usize] / bt * layout.block_bytes()).sum();
    (docs, peak)
}

/// Token hit rate of the trace's prefix requests under an LRU cache of `capacity_blocks` blocks,
/// longest-prefix lookups as kvtier does them (sessions left out). A model to read the measured
/// kvtier points against.
pub fn lru_hit_rate(trace: &Trace, ns: &Namespace, capacity_blocks: usize) -> f64 {
    let chain = kvtier_proto::KeyChain::new(ns);
    let mut stamp_of: HashMap<BlockKey, u64> = HashMap::new();
    let mut by_stamp: BTreeMap<u64, BlockKey> = BTreeMap::new();
    let (mut now, mut hit_tokens, mut all_tokens) = (0u64, 0u64, 0u64);
    for e in &trace.events {
        let Op::Prefix { doc, suffix_tokens, request, .. } = e.op else { continue };
        let toks = request_tokens(trace, doc, suffix_tokens, request);
        let keys = chain.full_blocks(&toks);
        all_tokens += toks.len() as u64;
        let hit = keys.iter().take_while(|k| stamp_of.contains_key(k)).count();
        hit_tokens += (hit * BLOCK_TOKENS as usize) as u64;
        for k in &keys {
            now += 1;
            if let Some(old) = stamp_of.insert(*k, now) {
                by_stamp.remove(&old);
            }
            by_stamp.insert(now, *k);
            while stamp_of.len() > capacity_blocks {
                let (_, victim) = by_stamp.pop_first().expect("non-empty");
                stamp_of.remove(&victim);
            }
        }
    }
    hit_tokens as f64 / all_tokens.max(1) as f64
}

fn request_tokens(trace: &Trace, doc: u32, suffix: u64, request: u32) -> Vec<u32> {
    let mut t: Vec<u32> = tokens(doc_stream(doc), 0, trace.doc_tokens[doc as usize]).collect();
    t.extend(tokens(suffix_stream(request), 0, suffix));
    t
}

#[derive(Debug, Clone, Serialize)]
pub struct TierHits {
    pub tier: String,
    pub hits: u64,
    pub misses: u64,
    pub hit_rate: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ReplayResult {
    pub model: &'static str,
    /// Nodes the replicas were spread over (1: one shared node).
    pub nodes: usize,
    /// Full-size bytes the nodes fetched from each other (their peer tiers' bytes in).
    pub bytes_between_nodes: f64,
    pub gpu: &'static str,
    pub link: &'static str,
    pub scale: u64,
    /// DRAM cap, as a fraction of the distinct documents' bytes (sessions' peak added on top).
    pub cache_fraction: f64,
    pub dram_capacity_full_bytes: f64,
    pub prefix_requests: u64,
    pub prefix_tokens: u64,
    pub prefix_hit_tokens: u64,
    pub prefix_token_hit_rate: f64,
    /// Requests whose hit came from a document another replica computed.
    pub cross_replica_hits: u64,
    pub resumes: u64,
    pub resume_hits: u64,
    pub park_failures: u64,
    pub tiers: Vec<TierHits>,
    /// Full-size bytes (measured bytes × scale).
    pub bytes_stored: f64,
    pub bytes_loaded: f64,
    /// Loopback reload rate measured here, at replay scale (smaller blocks than the real model's).
    pub measured_load_gb_per_s: f64,
    pub prefill_flops_saved: f64,
    pub gpu_seconds_saved: f64,
    pub reload_seconds_modeled: f64,
    /// Mean over every request and resume of (prefill time of the hit − modeled reload time).
    pub ttft_saved_mean_s: f64,
    pub ttft_saved_median_s: f64,
    /// Mean prefill time of a request with nothing cached, for scale.
    pub ttft_cold_mean_s: f64,
    pub wall_s: f64,
}

pub struct ReplayConfig {
    /// In a cluster: replicas store and load prefix blocks straight to their owners
    /// (`OwnerRouter`) instead of through their own node.
    pub direct_to_owners: bool,
    pub model: Model,
    pub scale: u64,
    pub gpu: Gpu,
    pub link: Link,
    pub cache_fraction: f64,
}

/// Replays `trace` against the servers at `addrs` (whose DRAM caps the caller sized): one node,
/// or the nodes of a cluster, replica `r`'s requests going to node `r % n`; a session parks on
/// node `session % n`, resumes where the trace's replica for that turn runs, and is extended
/// and dropped there.
pub async fn replay(
    addrs: &[String],
    trace: &Trace,
    cfg: &ReplayConfig,
    dram_cap: u64,
    pb: &indicatif::ProgressBar,
) -> anyhow::Result<ReplayResult> {
    let wall = Instant::now();
    let layout = replay_layout(&cfg.model, cfg.scale)?;
    anyhow::ensure!(!addrs.is_empty(), "no server to replay against");
    let mut clients = Vec::with_capacity(addrs.len());
    let mut handles = Vec::with_capacity(addrs.len());
    for addr in addrs {
        let c = KvClient::connect(addr, ClientConfig { data_connections: 4, ..Default::default() }).await?;
        let ns = c
            .register(Namespace::new(
                "bench",
                format!("{} bytes/{}", cfg.model.name, cfg.scale),
                layout,
                HashScheme::Blake3,
                b"trace",
            ))
            .await?;
        clients.push(c);
        handles.push(ns);
    }
    let node_count = addrs.len() as u32;
    let mut routers = Vec::new();
    if cfg.direct_to_owners {
        for c in &clients {
            routers
                .push(OwnerRouter::new(c.clone(), ClientConfig { data_connections: 4, ..Default::default() }).await?);
        }
    }
    let ns = handles[0].clone();
    let block = Bytes::from(vec![0x5au8; layout.block_bytes() as usize]);
    let bpt = cfg.model.kv_bytes_per_token(Codec::Bf16);
    let before = cluster_stats(&clients).await?;
    // Where each session is now (the node its last park, extend or resume went to).
    let mut at: HashMap<u32, usize> = HashMap::new();

    let mut r = ReplayResult {
        model: cfg.model.name,
        nodes: addrs.len(),
        bytes_between_nodes: 0.0,
        gpu: cfg.gpu.name,
        link: cfg.link.name,
        scale: cfg.scale,
        cache_fraction: cfg.cache_fraction,
        dram_capacity_full_bytes: dram_cap as f64 * cfg.scale as f64,
        prefix_requests: 0,
        prefix_tokens: 0,
        prefix_hit_tokens: 0,
        prefix_token_hit_rate: 0.0,
        cross_replica_hits: 0,
        resumes: 0,
        resume_hits: 0,
        park_failures: 0,
        tiers: Vec::new(),
        bytes_stored: 0.0,
        bytes_loaded: 0.0,
        measured_load_gb_per_s: 0.0,
        prefill_flops_saved: 0.0,
        gpu_seconds_saved: 0.0,
        reload_seconds_modeled: 0.0,
        ttft_saved_mean_s: 0.0,
        ttft_saved_median_s: 0.0,
        ttft_cold_mean_s: 0.0,
        wall_s: 0.0,
    };
    let mut saved: Vec<f64> = Vec::new();
    let mut cold: Vec<f64> = Vec::new();
    let mut load_bytes = 0u64;
    let mut load_secs = 0.0f64;
    let mut store_bytes = 0u64;
    let mut owner: HashMap<u32, u32> = HashMap::new();
    // session -> (version, tokens)
    let mut sessions: HashMap<u32, (u64, u64)> = HashMap::new();
    let account = |hit_tokens: f64, total: f64, saved: &mut Vec<f64>, cold: &mut Vec<f64>, r: &mut ReplayResult| {
        let flops = cfg.model.prefill_flops(hit_tokens);
        let gpu_s = cfg.gpu.prefill_seconds(&cfg.model, hit_tokens);
        let reload = cfg.link.reload_seconds(hit_tokens * bpt);
        r.prefill_flops_saved += flops;
        r.gpu_seconds_saved += gpu_s;
        r.reload_seconds_modeled += reload;
        saved.push(gpu_s - reload);
        cold.push(cfg.gpu.prefill_seconds(&cfg.model, total));
    };
    pb.set_length(trace.events.len() as u64);
    pb.set_position(0);
    for e in &trace.events {
        match e.op {
            Op::Prefix { replica, doc, suffix_tokens, request } => {
                let (client, ns) =
                    (&clients[(replica % node_count) as usize], &handles[(replica % node_count) as usize]);
                let toks = request_tokens(trace, doc, suffix_tokens, request);
                let keys = ns.keys(&toks);
                let hit = client.lookup_keys(ns, &keys).await?;
                let mut loaded = 0;
                if hit > 0 {
                    let t = Instant::now();
                    let frames = match routers.get((replica % node_count) as usize) {
                        Some(r) => r.load_keys(ns, &keys[..hit]).await?,
                        None => client.load_keys(ns, &keys[..hit]).await?,
                    };
                    load_secs += t.elapsed().as_secs_f64();
                    loaded = frames.iter().take_while(|f| f.is_some()).count();
                    load_bytes += frames.iter().flatten().map(|f| f.payload.len() as u64).sum::<u64>();
                    let doc_blocks = trace.doc_tokens[doc as usize] as usize / BLOCK_TOKENS as usize;
                    if owner.get(&doc).is_some_and(|&o| o != replica) && loaded > 0 && loaded <= doc_blocks.max(1) {
                        r.cross_replica_hits += 1;
                    }
                }
                // The replica prefilled the rest and stores it, as an engine's connector would.
                let frames = keys[loaded..]
                    .iter()
                    .map(|k| ns.frame(*k, BLOCK_TOKENS, block.clone()))
                    .collect::<Result<Vec<_>, _>>()?;
                if !frames.is_empty() {
                    let st = match routers.get((replica % node_count) as usize) {
                        Some(r) => r.store_frames(ns, &frames).await?,
                        None => client.store_frames(&frames).await?,
                    };
                    store_bytes += st.iter().filter(|s| **s == kvtier_client::ItemStatus::Ok).count() as u64
                        * layout.block_bytes();
                    owner.insert(doc, replica);
                }
                r.prefix_requests += 1;
                r.prefix_tokens += toks.len() as u64;
                let hit_tokens = (loaded * BLOCK_TOKENS as usize) as u64;
                r.prefix_hit_tokens += hit_tokens;
                account(hit_tokens as f64, toks.len() as f64, &mut saved, &mut cold, &mut r);
            }
            Op::Park { session, tokens: n } => {
                let node = (session % node_count) as usize;
                at.insert(session, node);
                let (client, ns) = (&clients[node], &handles[node]);
                let toks: Vec<u32> = tokens(session_stream(session), 0, n).collect();
                let blocks = session_blocks(&layout, &block, 0, n);
                store_bytes += blocks.iter().map(|b| b.len() as u64).sum::<u64>();
                match client.park(ns, &format!("s{session}"), &toks, &blocks, &ParkOptions::default(), 0).await {
                    Ok(info) => {
                        sessions.insert(session, (info.version, n));
                    }
                    Err(_) => r.park_failures += 1,
                }
            }
            Op::Resume { session, replica } => {
                let node = (replica % node_count) as usize;
                at.insert(session, node);
                let (client, ns) = (&clients[node], &handles[node]);
                r.resumes += 1;
                let total = sessions.get(&session).map(|s| s.1).unwrap_or(0);
                let t = Instant::now();
                match client.resume(ns, &format!("s{session}")).await {
                    Ok(res) => {
                        load_secs += t.elapsed().as_secs_f64();
                        load_bytes += res.blocks.iter().map(|b| b.len() as u64).sum::<u64>();
                        r.resume_hits += 1;
                        account(
                            res.info.token_count as f64,
                            res.info.token_count as f64,
                            &mut saved,
                            &mut cold,
                            &mut r,
                        );
                    }
                    Err(_) => {
                        sessions.remove(&session);
                        account(0.0, total as f64, &mut saved, &mut cold, &mut r);
                    }
                }
            }
            Op::Extend { session, tokens: n } => {
                let node = at.get(&session).copied().unwrap_or((session % node_count) as usize);
                let (client, ns) = (&clients[node], &handles[node]);
                let toks: Vec<u32> = tokens(session_stream(session), 0, n).collect();
                let id = format!("s{session}");
                let ok = match sessions.get(&session).copied() {
                    Some((version, prev)) => {
                        let blocks = session_blocks(&layout, &block, prev, n);
                        store_bytes += blocks.iter().map(|b| b.len() as u64).sum::<u64>();
                        client.extend(ns, &id, version, prev as usize, &toks, &blocks).await.ok()
                    }
                    None => {
                        // Lost earlier: the engine recomputed it and parks it afresh.
                        let _ = client.drop_session(ns, &id).await;
                        let blocks = session_blocks(&layout, &block, 0, n);
                        store_bytes += blocks.iter().map(|b| b.len() as u64).sum::<u64>();
                        client.park(ns, &id, &toks, &blocks, &ParkOptions::default(), 0).await.ok()
                    }
                };
                match ok {
                    Some(info) => {
                        sessions.insert(session, (info.version, n));
                    }
                    None => {
                        r.park_failures += 1;
                        sessions.remove(&session);
                    }
                }
            }
            Op::Drop { session } => {
                let node = at.remove(&session).unwrap_or((session % node_count) as usize);
                let _ = clients[node].drop_session(&handles[node], &format!("s{session}")).await;
                sessions.remove(&session);
            }
        }
        pb.inc(1);
    }
    let after = cluster_stats(&clients).await?;
    let peer_in = |s: &[pb::TierStats]| s.iter().filter(|t| t.tier == "peer").map(|t| t.bytes_in).sum::<u64>();
    r.bytes_between_nodes = (peer_in(&after) - peer_in(&before)) as f64 * cfg.scale as f64;
    for t in merged(&after) {
        let b = merged(&before).into_iter().find(|x| x.tier == t.tier);
        let hits = t.hits - b.as_ref().map(|x| x.hits).unwrap_or(0);
        let misses = t.misses - b.map(|x| x.misses).unwrap_or(0);
        r.tiers.push(TierHits {
            tier: t.tier.clone(),
            hits,
            misses,
            hit_rate: hits as f64 / (hits + misses).max(1) as f64,
        });
    }
    let scale = cfg.scale as f64;
    r.prefix_token_hit_rate = r.prefix_hit_tokens as f64 / r.prefix_tokens.max(1) as f64;
    r.bytes_stored = store_bytes as f64 * scale;
    r.bytes_loaded = load_bytes as f64 * scale;
    r.measured_load_gb_per_s = if load_secs > 0.0 { load_bytes as f64 / load_secs / 1e9 } else { f64::NAN };
    r.ttft_saved_mean_s = saved.iter().sum::<f64>() / saved.len().max(1) as f64;
    r.ttft_saved_median_s = median(saved);
    r.ttft_cold_mean_s = cold.iter().sum::<f64>() / cold.len().max(1) as f64;
    for c in &clients {
        let _ = c.purge(&ns).await;
    }
    r.wall_s = wall.elapsed().as_secs_f64();
    Ok(r)
}

/// Every node's tier counters (one list, node after node).
async fn cluster_stats(clients: &[KvClient]) -> anyhow::Result<Vec<pb::TierStats>> {
    let mut out = Vec::new();
    for c in clients {
        out.extend(c.stats().await?.tiers);
    }
    Ok(out)
}

/// Tier counters summed over nodes, one entry per tier.
fn merged(stats: &[pb::TierStats]) -> Vec<pb::TierStats> {
    let mut out: Vec<pb::TierStats> = Vec::new();
    for t in stats {
        match out.iter_mut().find(|x| x.tier == t.tier) {
            Some(x) => {
                x.hits += t.hits;
                x.misses += t.misses;
                x.bytes_in += t.bytes_in;
            }
            None => out.push(t.clone()),
        }
    }
    out
}

/// Payloads of a session's full blocks from token `from` (rounded down to a block) to `to`, then
/// its tail: what park/extend send.
fn session_blocks(layout: &KvLayout, block: &Bytes, from: u64, to: u64) -> Vec<Bytes> {
    let bt = u64::from(layout.block_tokens);
    let mut v: Vec<Bytes> = (from / bt..to / bt).map(|_| block.clone()).collect();
    if !to.is_multiple_of(bt) {
        v.push(block.slice(..layout.bytes_for_tokens((to % bt) as u32) as usize));
    }
    v
}

/// The namespace a replay registers (for [`lru_hit_rate`]'s key chain).
pub fn replay_namespace(model: &Model, scale: u64) -> anyhow::Result<Namespace> {
    Ok(Namespace::new(
        "bench",
        format!("{} bytes/{}", model.name, scale),
        replay_layout(model, scale)?,
        HashScheme::Blake3,
        b"trace",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::TraceConfig;

    #[test]
    fn replay_layout_scales_bytes_per_token() {
        let l = replay_layout(&Model::LLAMA3_8B, 256).unwrap();
        assert_eq!(l.bytes_per_token() * 256, 131072);
        let l = replay_layout(&Model::LLAMA3_70B, 1024).unwrap();
        assert_eq!(l.bytes_per_token() * 1024, 327680);
        assert!(replay_layout(&Model::LLAMA3_8B, 3).is_err());
    }

    #[test]
    fn lru_model_is_deterministic_and_monotone() {
        let cfg = TraceConfig { prefix_requests: 60, docs: 12, max_ctx: 8192, sessions: 0, ..Default::default() };
        let tr = Trace::generate(&cfg);
        let ns = replay_namespace(&Model::LLAMA3_8B, 1024).unwrap();
        let small = lru_hit_rate(&tr, &ns, 64);
        let big = lru_hit_rate(&tr, &ns, 1 << 20);
        assert_eq!(small, lru_hit_rate(&tr, &ns, 64));
        assert!(small <= big && big > 0.0 && big < 1.0, "{small} {big}");
    }
}
