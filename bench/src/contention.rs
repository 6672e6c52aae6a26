//! Tail latency while sessions park: p50/p99 of a `Lookup`, a `ResumeSession` (manifest only) and
//! a 1 MiB load into the caller's buffer, first on an idle node and then while other clients park
//! sessions on it (each park sends fresh blocks that must reach disk and be `fsync`ed before it is
//! acknowledged). Run against this build and, given `--baseline-bin`, an older build in the same
//! run, so the effect of moving disk work out of the node's locks is measured side by side.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use kvtier_client::{BlockDest, ClientConfig, KvClient, ParkOptions};
use kvtier_proto::{pb, BlockKey, HashScheme, Namespace};
use serde::Serialize;

use crate::blocks::layout_for;
use crate::servers::KvtierServer;
use crate::stats::percentile;

/// Latencies of one phase, milliseconds.
#[derive(Debug, Clone, Serialize)]
pub struct Phase {
    pub samples: usize,
    pub lookup_p50_ms: f64,
    pub lookup_p99_ms: f64,
    pub resume_p50_ms: f64,
    pub resume_p99_ms: f64,
    pub load_p50_ms: f64,
    pub load_p99_ms: f64,
    /// Parks acknowledged per second meanwhile (0 when idle).
    pub parks_per_s: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Contention {
    pub build: String,
    pub idle: Phase,
    pub parking: Phase,
}

const LOAD_BYTES: usize = 1 << 20;
const PARK_BLOCK: usize = 256 << 10;
const PARK_BLOCKS: usize = 4;
const PARKERS: usize = 2;

fn bytes_of(seed: u64, size: usize) -> Bytes {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    Bytes::from(
        (0..size)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect::<Vec<u8>>(),
    )
}

/// Starts `bin` with a disk tier in `dir` and measures both phases.
pub fn run(build: &str, bin: &Path, dir: &Path, log: &Path, samples: usize) -> anyhow::Result<Contention> {
    let _ = std::fs::remove_dir_all(dir);
    let server = KvtierServer::start_with(bin, dir, 256 << 20, log, &["--disk-capacity", "4GiB"])?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let out = rt.block_on(measure(&server.grpc_addr, samples));
    drop(server);
    let _ = std::fs::remove_dir_all(dir);
    let (idle, parking) = out?;
    Ok(Contention { build: build.to_string(), idle, parking })
}

async fn measure(addr: &str, samples: usize) -> anyhow::Result<(Phase, Phase)> {
    let client = KvClient::connect(addr, ClientConfig::default()).await?;
    let ns =
        client.register(Namespace::new("bench", "contention", layout_for(LOAD_BYTES), HashScheme::Blake3, b"")).await?;
    // What the measuring client reads: a parked 8-block session (its blocks stay in DRAM).
    let bt = ns.block_tokens();
    let tokens: Vec<u32> = (0..(8 * bt) as u32).collect();
    let kv: Vec<Bytes> = (0..8).map(|i| bytes_of(i, LOAD_BYTES)).collect();
    client.park(&ns, "reader", &tokens, &kv, &ParkOptions::default(), 0).await?;
    let keys = ns.keys(&tokens);

    let idle = phase(&client, &ns, &keys, samples, None).await?;

    let parked = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let pns = client
        .register(Namespace::new("bench", "contention-parks", layout_for(PARK_BLOCK), HashScheme::Blake3, b""))
        .await?;
    let parkers: Vec<_> = (0..PARKERS)
        .map(|p| {
            let (client, pns, parked, stop) = (client.clone(), pns.clone(), parked.clone(), stop.clone());
            tokio::spawn(async move {
                let pbt = pns.block_tokens() as u32;
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    // Fresh tokens, so fresh keys: every park writes its blocks to disk.
                    let base = (p as u32) << 28 | ((i as u32) * PARK_BLOCKS as u32 * pbt);
                    let toks: Vec<u32> = (0..PARK_BLOCKS as u32 * pbt).map(|t| base + t).collect();
                    let blocks: Vec<Bytes> =
                        (0..PARK_BLOCKS).map(|b| bytes_of((p as u64) << 40 | i << 8 | b as u64, PARK_BLOCK)).collect();
                    let id = format!("parker-{p}-{i}");
                    client.park(&pns, &id, &toks, &blocks, &ParkOptions::default(), 0).await?;
                    parked.fetch_add(1, Ordering::Relaxed);
                    client.drop_session(&pns, &id).await?;
                    i += 1;
                }
                Ok::<_, anyhow::Error>(())
            })
        })
        .collect();
    let parking = phase(&client, &ns, &keys, samples, Some(&parked)).await;
    stop.store(true, Ordering::Relaxed);
    for p in parkers {
        p.await??;
    }
    Ok((idle, parking?))
}

async fn phase(
    client: &KvClient,
    ns: &kvtier_client::NamespaceHandle,
    keys: &[BlockKey],
    samples: usize,
    parked: Option<&AtomicU64>,
) -> anyhow::Result<Phase> {
    let (mut lookup, mut resume, mut load) = (Vec::new(), Vec::new(), Vec::new());
    let mut buf = vec![1u8; LOAD_BYTES];
    let start_parks = parked.map_or(0, |p| p.load(Ordering::Relaxed));
    let t0 = Instant::now();
    for i in 0..samples {
        let t = Instant::now();
        let hit = client.lookup_keys(ns, keys).await?;
        lookup.push(t.elapsed().as_secs_f64());
        anyhow::ensure!(hit == keys.len(), "lookup found {hit} of {} blocks", keys.len());
        let req = pb::ResumeRequest { namespace_id: Bytes::copy_from_slice(&ns.id.0), session_id: "reader".into() };
        let t = Instant::now();
        let m = client.raw_grpc().resume_session(req).await?.into_inner();
        resume.push(t.elapsed().as_secs_f64());
        anyhow::ensure!(m.keys.len() == keys.len(), "resume listed {} blocks", m.keys.len());
        let key = [keys[i % keys.len()]];
        let mut dests: Vec<BlockDest<'_>> = vec![vec![&mut buf[..]]];
        let t = Instant::now();
        let ok = client.load_keys_into(ns, &key, &mut dests, true).await?;
        load.push(t.elapsed().as_secs_f64());
        anyhow::ensure!(ok == [true], "a parked block was not loaded");
    }
    let secs = t0.elapsed().as_secs_f64();
    let ms = |v: &[f64], p| percentile(v, p) * 1e3;
    Ok(Phase {
        samples,
        lookup_p50_ms: ms(&lookup, 50.0),
        lookup_p99_ms: ms(&lookup, 99.0),
        resume_p50_ms: ms(&resume, 50.0),
        resume_p99_ms: ms(&resume, 99.0),
        load_p50_ms: ms(&load, 50.0),
        load_p99_ms: ms(&load, 99.0),
        parks_per_s: parked.map_or(0.0, |p| (p.load(Ordering::Relaxed) - start_parks) as f64 / secs),
    })
}

/// A Markdown table of every build's figures, with the ratio parking / idle per figure.
pub fn table(rows: &[Contention]) -> String {
    let mut s = String::from(
        "| build | phase | Lookup p50 / p99 ms | Resume p50 / p99 ms | 1 MiB load p50 / p99 ms | parks/s |\n|---|---|---|---|---|---|\n",
    );
    for r in rows {
        for (name, p) in [("idle", &r.idle), ("parking", &r.parking)] {
            s += &format!(
                "| {} | {name} | {:.2} / {:.2} | {:.2} / {:.2} | {:.2} / {:.2} | {:.1} |\n",
                r.build,
                p.lookup_p50_ms,
                p.lookup_p99_ms,
                p.resume_p50_ms,
                p.resume_p99_ms,
                p.load_p50_ms,
                p.load_p99_ms,
                p.parks_per_s
            );
        }
        let q = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
        s += &format!(
            "| {} | p99 parking / idle | {:.1}× | {:.1}× | {:.1}× | |\n",
            r.build,
            q(r.parking.lookup_p99_ms, r.idle.lookup_p99_ms),
            q(r.parking.resume_p99_ms, r.idle.resume_p99_ms),
            q(r.parking.load_p99_ms, r.idle.load_p99_ms)
        );
    }
    s
}
