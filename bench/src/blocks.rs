//! Block store/load throughput and latency against kvtier and Redis, same bytes, same concurrency.
//!
//! One operation is one block: a kvtier data-plane PUT/GET of one frame (checksummed by the client,
//! verified by the server and again by the client), or a Redis `SET`/`GET` of the same payload
//! bytes. `c` tasks run operations back to back, each on its own connection (kvtier: a pool of `c`
//! data-plane connections; Redis: `c` connections). Pipelined Redis sends `depth` commands per
//! round trip; its latency figures are per round trip.

use std::time::Instant;

use bytes::Bytes;
use kvtier_client::{ClientConfig, KvClient, NamespaceHandle};
use kvtier_proto::{BlockKey, DType, HashScheme, KvLayout, Namespace};
use serde::Serialize;

use crate::stats::{median, percentile};

#[derive(Debug, Clone)]
pub struct BlocksConfig {
    pub sizes: Vec<usize>,
    pub concurrency: Vec<usize>,
    /// Bytes each cell moves per run (at least 2 operations per task).
    pub bytes_per_cell: usize,
    pub runs: usize,
    pub pipeline_depth: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct Cell {
    pub system: String,
    pub op: &'static str,
    pub block_bytes: usize,
    pub concurrency: usize,
    /// Median over runs.
    pub gb_per_s: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// Operations measured, all runs together.
    pub ops: usize,
}

impl BlocksConfig {
    pub fn cells(&self) -> usize {
        self.sizes.len() * self.concurrency.len()
    }

    fn ops_per_task(&self, size: usize, c: usize) -> usize {
        (self.bytes_per_cell / (size * c)).max(2)
    }
}

/// A layout of 32 layers × head dim 128 in bf16 whose block is exactly `size` bytes.
pub fn layout_for(size: usize) -> KvLayout {
    let per_head_token = 2 * 32 * 128 * 2; // 16 KiB
    let (heads, bt) =
        if size >= per_head_token * 8 { (8, size / (per_head_token * 8)) } else { ((size / per_head_token).max(1), 1) };
    let l = KvLayout::new(32, heads as u16, 128, DType::Bf16, bt as u32);
    debug_assert_eq!(l.block_bytes() as usize, size);
    l
}

fn key(size: usize, run: usize, task: usize, op: usize) -> BlockKey {
    let mut k = [0u8; 32];
    k[..8].copy_from_slice(&(size as u64).to_le_bytes());
    k[8..16].copy_from_slice(&(run as u64).to_le_bytes());
    k[16..24].copy_from_slice(&(task as u64).to_le_bytes());
    k[24..32].copy_from_slice(&(op as u64).to_le_bytes());
    BlockKey(*blake3::hash(&k).as_bytes())
}

fn payload(size: usize, seed: usize) -> Bytes {
    Bytes::from((0..size).map(|i| ((i * 131 + seed * 7) % 253) as u8).collect::<Vec<u8>>())
}

struct Sample {
    store_s: f64,
    load_s: f64,
    store_lat: Vec<f64>,
    load_lat: Vec<f64>,
}

fn cells(system: &str, size: usize, c: usize, samples: Vec<Sample>, bytes: usize) -> [Cell; 2] {
    let mut sl = Vec::new();
    let mut ll = Vec::new();
    for s in &samples {
        sl.extend_from_slice(&s.store_lat);
        ll.extend_from_slice(&s.load_lat);
    }
    let ms = |v: &[f64], p| percentile(v, p) * 1e3;
    [
        Cell {
            system: system.into(),
            op: "store",
            block_bytes: size,
            concurrency: c,
            gb_per_s: median(samples.iter().map(|s| bytes as f64 / s.store_s / 1e9).collect()),
            p50_ms: ms(&sl, 50.0),
            p99_ms: ms(&sl, 99.0),
            ops: sl.len(),
        },
        Cell {
            system: system.into(),
            op: "load",
            block_bytes: size,
            concurrency: c,
            gb_per_s: median(samples.iter().map(|s| bytes as f64 / s.load_s / 1e9).collect()),
            p50_ms: ms(&ll, 50.0),
            p99_ms: ms(&ll, 99.0),
            ops: ll.len(),
        },
    ]
}

/// Runs every (size, concurrency) cell against the kvtier server at `addr`.
pub async fn run_kvtier(addr: &str, cfg: &BlocksConfig, pb: &indicatif::ProgressBar) -> anyhow::Result<Vec<Cell>> {
    let mut out = Vec::new();
    for &c in &cfg.concurrency {
        let client =
            KvClient::connect(addr, ClientConfig { data_connections: c, max_batch_blocks: 1, ..Default::default() })
                .await?;
        for &size in &cfg.sizes {
            pb.set_message(format!("kvtier {} KiB x{c}", size >> 10));
            let ns = client
                .register(Namespace::new("bench", format!("blocks-{size}"), layout_for(size), HashScheme::Blake3, b""))
                .await?;
            let data = payload(size, c);
            let n = cfg.ops_per_task(size, c);
            let mut samples = Vec::new();
            for run in 0..cfg.runs {
                samples.push(kvtier_sample(&client, &ns, &data, size, c, n, run).await?);
                client.purge(&ns).await?;
            }
            out.extend(cells("kvtier", size, c, samples, size * c * n));
            pb.inc(1);
        }
    }
    Ok(out)
}

async fn kvtier_sample(
    client: &KvClient,
    ns: &NamespaceHandle,
    data: &Bytes,
    size: usize,
    c: usize,
    n: usize,
    run: usize,
) -> anyhow::Result<Sample> {
    let bt = ns.block_tokens() as u32;
    let t = Instant::now();
    let tasks: Vec<_> = (0..c)
        .map(|task| {
            let (client, ns, data) = (client.clone(), ns.clone(), data.clone());
            tokio::spawn(async move {
                let mut lat = Vec::with_capacity(n);
                for op in 0..n {
                    let t = Instant::now();
                    let frame = ns.frame(key(size, run, task, op), bt, data.clone())?;
                    let st = client.store_frames(std::slice::from_ref(&frame)).await?;
                    anyhow::ensure!(
                        st.iter().all(|s| *s == kvtier_client::ItemStatus::Ok),
                        "kvtier refused a block: {st:?}"
                    );
                    lat.push(t.elapsed().as_secs_f64());
                }
                Ok::<_, anyhow::Error>(lat)
            })
        })
        .collect();
    let mut store_lat = Vec::new();
    for t in tasks {
        store_lat.extend(t.await??);
    }
    let store_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let tasks: Vec<_> = (0..c)
        .map(|task| {
            let (client, ns) = (client.clone(), ns.clone());
            tokio::spawn(async move {
                let mut lat = Vec::with_capacity(n);
                for op in 0..n {
                    let t = Instant::now();
                    let got = client.load_keys(&ns, &[key(size, run, task, op)]).await?;
                    let f = got
                        .into_iter()
                        .next()
                        .flatten()
                        .ok_or_else(|| anyhow::anyhow!("kvtier lost a block it acknowledged"))?;
                    anyhow::ensure!(f.payload.len() == size, "short block");
                    lat.push(t.elapsed().as_secs_f64());
                }
                Ok::<_, anyhow::Error>(lat)
            })
        })
        .collect();
    let mut load_lat = Vec::new();
    for t in tasks {
        load_lat.extend(t.await??);
    }
    Ok(Sample { store_s, load_s: t.elapsed().as_secs_f64(), store_lat, load_lat })
}

/// Runs every cell against Redis at `url`, plain and pipelined.
pub async fn run_redis(url: &str, cfg: &BlocksConfig, pb: &indicatif::ProgressBar) -> anyhow::Result<Vec<Cell>> {
    let client = redis::Client::open(url)?;
    let mut out = Vec::new();
    for &c in &cfg.concurrency {
        let mut conns = Vec::new();
        for _ in 0..c {
            // The crate's default 500 ms response timeout is shorter than a pipeline of 4 MiB values
            // at concurrency 16 on two shared cores.
            let cfg =
                redis::AsyncConnectionConfig::new().set_response_timeout(Some(std::time::Duration::from_secs(60)));
            conns.push(client.get_multiplexed_async_connection_with_config(&cfg).await?);
        }
        for &size in &cfg.sizes {
            let data = payload(size, c);
            let n = cfg.ops_per_task(size, c);
            for depth in [1, cfg.pipeline_depth] {
                let system = if depth == 1 { "redis".to_string() } else { format!("redis-pipelined-{depth}") };
                pb.set_message(format!("{system} {} KiB x{c}", size >> 10));
                // Whole pipelines per task.
                let n = n.div_ceil(depth) * depth;
                let mut samples = Vec::new();
                for run in 0..cfg.runs {
                    samples.push(redis_sample(&conns, &data, size, n, depth, run).await?);
                    redis::cmd("FLUSHALL").query_async::<()>(&mut conns[0].clone()).await?;
                }
                out.extend(cells(&system, size, c, samples, size * c * n));
            }
            pb.inc(1);
        }
    }
    Ok(out)
}

async fn redis_sample(
    conns: &[redis::aio::MultiplexedConnection],
    data: &Bytes,
    size: usize,
    n: usize,
    depth: usize,
    run: usize,
) -> anyhow::Result<Sample> {
    let rkey = move |task: usize, op: usize| key(size, run, task, op).0.to_vec();
    let t = Instant::now();
    let tasks: Vec<_> = conns
        .iter()
        .enumerate()
        .map(|(task, con)| {
            let (mut con, data) = (con.clone(), data.clone());
            tokio::spawn(async move {
                let mut lat = Vec::new();
                for first in (0..n).step_by(depth) {
                    let t = Instant::now();
                    let mut p = redis::pipe();
                    for op in first..first + depth {
                        p.cmd("SET").arg(rkey(task, op)).arg(&data[..]).ignore();
                    }
                    p.query_async::<()>(&mut con).await?;
                    lat.push(t.elapsed().as_secs_f64());
                }
                Ok::<_, anyhow::Error>(lat)
            })
        })
        .collect();
    let mut store_lat = Vec::new();
    for t in tasks {
        store_lat.extend(t.await??);
    }
    let store_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let tasks: Vec<_> = conns
        .iter()
        .enumerate()
        .map(|(task, con)| {
            let mut con = con.clone();
            tokio::spawn(async move {
                let mut lat = Vec::new();
                for first in (0..n).step_by(depth) {
                    let t = Instant::now();
                    let mut p = redis::pipe();
                    for op in first..first + depth {
                        p.cmd("GET").arg(rkey(task, op));
                    }
                    let got: Vec<Vec<u8>> = p.query_async(&mut con).await?;
                    anyhow::ensure!(
                        got.len() == depth && got.iter().all(|v| v.len() == size),
                        "redis returned short values"
                    );
                    lat.push(t.elapsed().as_secs_f64());
                }
                Ok::<_, anyhow::Error>(lat)
            })
        })
        .collect();
    let mut load_lat = Vec::new();
    for t in tasks {
        load_lat.extend(t.await??);
    }
    Ok(Sample { store_s, load_s: t.elapsed().as_secs_f64(), store_lat, load_lat })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_match_the_block_sizes() {
        for size in [64 << 10, 256 << 10, 1 << 20, 4 << 20] {
            let l = layout_for(size);
            l.validate().unwrap();
            assert_eq!(l.block_bytes() as usize, size);
        }
    }
}
