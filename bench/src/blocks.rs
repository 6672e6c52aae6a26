//! Block store/load throughput and latency against kvtier and Redis, same bytes, same concurrency.
//!
//! One operation is one block: a kvtier data-plane PUT/GET of one frame (checksummed by the client,
//! verified by the server and again by the client), or a Redis `SET`/`GET` of the same payload
//! bytes. `c` tasks run operations back to back, each on its own connection (kvtier: a pool of `c`
//! data-plane connections; Redis: `c` connections). Pipelined Redis sends `depth` commands per
//! round trip; its latency figures are per round trip.
//!
//! kvtier is measured along the paths a user takes, on the same blocks in the same run:
//! - `kvtier` — the raw Rust path: `store_frames`, and `load_keys` of keys known to be there
//!   (a frame in a buffer the client allocates; no lookup, no copy into the caller's memory);
//! - `engine-old` — what an engine did before the fused request: a gRPC `lookup_keys`, then
//!   `load_keys`, then a copy into the caller's buffer;
//! - `engine-fused` — `load_keys_into(.., stop_at_miss)`: lookup and load in one data-plane
//!   request, received from the socket straight into the caller's buffer and verified there
//!   (what `load_prefix_into` and Python's `Client.load_into` run); its store is `store_keys`;
//! - `engine-fused-x8` — the same, 8 blocks per call (an engine loading a prefix), striped over
//!   the pool's connections when the call moves 4 MiB or more; its store is `store_keys` of 8
//!   blocks per call, striped likewise;
//! - `engine-parked` — `engine-fused`'s load with `ClientConfig::dataplane_poll` at zero: every
//!   wait for the answer parks the task (what loads did before answers were polled for), so the
//!   gain of polling is read in the same run. (Stores are never polled for.)
//! - `engine-fp8-x8` — `engine-fused-x8` in a namespace that stores `fp8_e4m3` (bf16 blocks of
//!   KV-like values): `store_keys` encodes on the client, `load_keys_into` decodes into the
//!   caller's buffer. Its GB/s counts the blocks' bf16 bytes, not the bytes on the wire, so its
//!   ratio to `engine-fused-x8` is the ratio of KV tokens/s.
//!
//! At concurrency 1 the one task runs on the caller's thread, awaited where it is (what the Python
//! client does: `block_on` on the caller's thread); above 1 each task is `tokio::spawn`ed.

use std::time::Instant;

use bytes::Bytes;
use kvtier_client::{BlockDest, ClientConfig, ItemStatus, KvClient, NamespaceHandle};
use kvtier_proto::{pb, BlockKey, CodecId, DType, HashScheme, KvLayout, Namespace};
use serde::{Deserialize, Serialize};

use crate::cpu::{CpuMark, CpuSpent};
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

/// One (system, operation, block size, concurrency) figure: GB/s as the median over runs, with
/// the slowest and fastest run beside it, and per-operation latency over all runs together.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Cell {
    pub system: String,
    pub op: String,
    pub block_bytes: usize,
    pub concurrency: usize,
    /// Median over runs.
    pub gb_per_s: f64,
    /// Slowest run.
    pub gb_per_s_min: f64,
    /// Fastest run.
    pub gb_per_s_max: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// Operations measured, all runs together.
    pub ops: usize,
    /// Milliseconds of the server's CPU time per GB moved, median over runs (see [`crate::cpu`]);
    /// `None` where the bench could not read the server's clock (a `--server` it did not start).
    #[serde(default)]
    pub server_cpu_ms_per_gb: Option<f64>,
    /// The same for the client's process (the bench for the Rust paths, the Python driver's).
    #[serde(default)]
    pub client_cpu_ms_per_gb: Option<f64>,
}

impl Cell {
    /// A cell from each run's GB/s and every operation's latency in seconds.
    pub fn from_runs(
        system: &str,
        op: &str,
        block_bytes: usize,
        concurrency: usize,
        runs_gbps: &[f64],
        lat_s: &[f64],
    ) -> Cell {
        let ms = |p| percentile(lat_s, p) * 1e3;
        Cell {
            system: system.into(),
            op: op.into(),
            block_bytes,
            concurrency,
            gb_per_s: median(runs_gbps.to_vec()),
            gb_per_s_min: runs_gbps.iter().copied().fold(f64::NAN, f64::min),
            gb_per_s_max: runs_gbps.iter().copied().fold(f64::NAN, f64::max),
            p50_ms: ms(50.0),
            p99_ms: ms(99.0),
            ops: lat_s.len(),
            server_cpu_ms_per_gb: None,
            client_cpu_ms_per_gb: None,
        }
    }

    /// The cell with each run's CPU time (server and client, seconds) for `bytes` moved per run.
    pub fn with_cpu(mut self, spent: &[CpuSpent], bytes: usize) -> Cell {
        let (server, client): (Vec<_>, Vec<_>) = spent.iter().map(|s| (s.server_s, s.client_s)).unzip();
        self.server_cpu_ms_per_gb = crate::cpu::ms_per_gb(&server, bytes);
        self.client_cpu_ms_per_gb = crate::cpu::ms_per_gb(&client, bytes);
        self
    }

    /// (max − min) / median over runs: how far apart the runs were.
    pub fn spread(&self) -> f64 {
        (self.gb_per_s_max - self.gb_per_s_min) / self.gb_per_s
    }
}

impl BlocksConfig {
    pub fn cells(&self) -> usize {
        self.sizes.len() * self.concurrency.len()
    }

    pub fn ops_per_task(&self, size: usize, c: usize) -> usize {
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

/// `size` bytes of bf16 values shaped like attention KV: roughly normal around zero (a sum of
/// four uniforms) with one channel in 16 an outlier 8× as large, which is what the codecs'
/// per-block scales are for. Deterministic in `seed`.
fn bf16_kv(size: usize, seed: usize) -> Bytes {
    let mut x = (seed as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut unit = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let mut out = Vec::with_capacity(size);
    for i in 0..size / 2 {
        let v = (unit() + unit() + unit() + unit()) * if i % 128 % 16 == 3 { 8.0 } else { 1.0 };
        // bf16 is the top half of an f32 (truncated).
        out.extend_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes());
    }
    Bytes::from(out)
}

struct Sample {
    store_s: f64,
    load_s: f64,
    store_lat: Vec<f64>,
    load_lat: Vec<f64>,
    store_cpu: CpuSpent,
    load_cpu: CpuSpent,
}

fn cells(system: &str, size: usize, c: usize, samples: Vec<Sample>, bytes: usize) -> [Cell; 2] {
    let mut sl = Vec::new();
    let mut ll = Vec::new();
    for s in &samples {
        sl.extend_from_slice(&s.store_lat);
        ll.extend_from_slice(&s.load_lat);
    }
    let st: Vec<f64> = samples.iter().map(|s| bytes as f64 / s.store_s / 1e9).collect();
    let ld: Vec<f64> = samples.iter().map(|s| bytes as f64 / s.load_s / 1e9).collect();
    let sc: Vec<CpuSpent> = samples.iter().map(|s| s.store_cpu).collect();
    let lc: Vec<CpuSpent> = samples.iter().map(|s| s.load_cpu).collect();
    [
        Cell::from_runs(system, "store", size, c, &st, &sl).with_cpu(&sc, bytes),
        Cell::from_runs(system, "load", size, c, &ld, &ll).with_cpu(&lc, bytes),
    ]
}

/// The kvtier paths measured (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    /// `store_frames` of one frame.
    StoreFrames,
    /// `store_keys` of one block (the engine's store), under keys of their own.
    StoreKeys,
    /// `load_keys` of one known key.
    LoadKeys,
    /// gRPC `lookup_keys`, `load_keys`, copy into the caller's buffer.
    LookupLoadCopy,
    /// `load_keys_into(stop_at_miss)` into the caller's buffer.
    LoadInto,
    /// `load_keys_into(stop_at_miss)` of 8 blocks into the caller's buffer.
    LoadInto8,
    /// `store_keys` of 8 blocks per call, under keys of their own.
    StoreKeys8,
    /// `store_keys` of 8 blocks per call through an `fp8_e4m3` namespace handle.
    StoreFp8x8,
    /// `load_keys_into(stop_at_miss)` of 8 `fp8_e4m3` blocks, decoded into the caller's buffer.
    LoadFp8x8,
}

/// Blocks the caller's buffer of a load holds, filled in turn (the most blocks per call); the
/// Python driver (`wire_bench.py`) loads its kvtier and LMCache paths the same way.
const DEST_SLOTS: usize = 8;

/// Blocks per call of a path.
fn per_call(p: Path) -> usize {
    if matches!(p, Path::LoadInto8 | Path::StoreKeys8 | Path::StoreFp8x8 | Path::LoadFp8x8) {
        8
    } else {
        1
    }
}

/// Key space of a path's blocks: `store_keys` writes keys of its own, raw loads read what
/// `store_frames` wrote, the fp8 load what the fp8 store wrote.
fn space(p: Path, run: usize) -> usize {
    match p {
        Path::StoreKeys => run + (1 << 32),
        Path::StoreKeys8 => run + (2 << 32),
        Path::StoreFp8x8 | Path::LoadFp8x8 => run + (3 << 32),
        _ => run,
    }
}

/// Runs `n` operations of `path` on each of `c` tasks at once; the wall time and every call's
/// latency in seconds. One task is awaited on the caller's thread; several are spawned.
#[allow(clippy::too_many_arguments)]
async fn run_path(
    client: &KvClient,
    ns: &NamespaceHandle,
    data: &Bytes,
    path: Path,
    c: usize,
    n: usize,
    kspace: usize,
    server_pid: Option<u32>,
) -> anyhow::Result<(f64, Vec<f64>, CpuSpent)> {
    // Each task's destination (an engine's KV pages): room for 8 blocks on every path, filled in
    // turn, so a one-block load lands in memory as cold as an 8-block one does (a one-block
    // buffer would stay in the core's cache and flatter the one-block paths). Written here,
    // before the clock starts, so no page is faulted in on the clock (the Python driver's
    // destinations are made before its clock too).
    let mut bufs: Vec<Vec<u8>> = (0..c).map(|_| vec![1u8; data.len() * DEST_SLOTS]).collect();
    let cpu = CpuMark::now(server_pid);
    let t = Instant::now();
    if c == 1 {
        let buf = bufs.pop().unwrap_or_default();
        let (lat, buf) = path_task(client.clone(), ns.clone(), data.clone(), path, 0, n, kspace, buf).await?;
        let secs = t.elapsed().as_secs_f64();
        let spent = cpu.spent();
        drop(buf);
        return Ok((secs, lat, spent));
    }
    let tasks: Vec<_> = bufs
        .into_iter()
        .enumerate()
        .map(|(task, buf)| {
            tokio::spawn(path_task(client.clone(), ns.clone(), data.clone(), path, task, n, kspace, buf))
        })
        .collect();
    let (mut lat, mut bufs) = (Vec::new(), Vec::with_capacity(c));
    for t in tasks {
        let (l, buf) = t.await??;
        lat.extend(l);
        bufs.push(buf);
    }
    let secs = t.elapsed().as_secs_f64();
    let spent = cpu.spent();
    drop(bufs);
    Ok((secs, lat, spent))
}

/// One task's `n` operations of `path`, back to back, loading into `buf` (`DEST_SLOTS` blocks);
/// every call's latency in seconds.
#[allow(clippy::too_many_arguments)]
async fn path_task(
    client: KvClient,
    ns: NamespaceHandle,
    data: Bytes,
    path: Path,
    task: usize,
    n: usize,
    kspace: usize,
    mut buf: Vec<u8>,
) -> anyhow::Result<(Vec<f64>, Vec<u8>)> {
    let size = data.len();
    let per = per_call(path);
    let mut lat = Vec::with_capacity(n / per);
    for first in (0..n).step_by(per) {
        let keys: Vec<BlockKey> = (first..(first + per).min(n)).map(|op| key(size, kspace, task, op)).collect();
        let t = Instant::now();
        match path {
            Path::StoreFrames => {
                let frame = ns.frame(keys[0], ns.block_tokens() as u32, data.clone())?;
                let st = client.store_frames(std::slice::from_ref(&frame)).await?;
                anyhow::ensure!(st.iter().all(|s| *s == ItemStatus::Ok), "kvtier refused a block: {st:?}");
            }
            Path::StoreKeys | Path::StoreKeys8 | Path::StoreFp8x8 => {
                let blocks = vec![vec![data.clone()]; keys.len()];
                let st = client.store_keys(&ns, &keys, &blocks).await?;
                anyhow::ensure!(
                    st.iter().all(|s| matches!(s, ItemStatus::Ok | ItemStatus::Present)),
                    "kvtier refused a block: {st:?}"
                );
            }
            Path::LoadKeys => {
                let got = client.load_keys(&ns, &keys).await?;
                let f = got
                    .into_iter()
                    .next()
                    .flatten()
                    .ok_or_else(|| anyhow::anyhow!("kvtier lost a block it acknowledged"))?;
                anyhow::ensure!(f.payload.len() == size, "short block");
            }
            Path::LookupLoadCopy => {
                let hit = client.lookup_keys(&ns, &keys).await?;
                anyhow::ensure!(hit == keys.len(), "lookup found {hit} of {} blocks", keys.len());
                let got = client.load_keys(&ns, &keys).await?;
                let f = got
                    .into_iter()
                    .next()
                    .flatten()
                    .ok_or_else(|| anyhow::anyhow!("kvtier lost a block it acknowledged"))?;
                let at = (first % DEST_SLOTS) * size;
                buf[at..at + size].copy_from_slice(&f.payload);
            }
            Path::LoadInto | Path::LoadInto8 | Path::LoadFp8x8 => {
                let at = (first % DEST_SLOTS) * size;
                let room = &mut buf[at..at + size * keys.len()];
                let mut dests: Vec<BlockDest<'_>> = room.chunks_exact_mut(size).map(|c| vec![c]).collect();
                let ok = client.load_keys_into(&ns, &keys, &mut dests, true).await?;
                anyhow::ensure!(ok.iter().all(|x| *x), "kvtier lost a block it acknowledged: {ok:?}");
            }
        }
        lat.push(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&buf);
    // Handed back so it is freed after the clock stops.
    Ok((lat, buf))
}

/// Runs every (size, concurrency) cell against the kvtier server at `addr`, along every path;
/// with `server_pid`, the server's CPU time per GB beside the bench's own.
pub async fn run_kvtier(
    addr: &str,
    server_pid: Option<u32>,
    cfg: &BlocksConfig,
    tcp: &crate::limits::TcpSampler,
    pb: &indicatif::ProgressBar,
) -> anyhow::Result<Vec<Cell>> {
    let mut out = Vec::new();
    // The last field: whether the path runs on the client that never polls for answers.
    let paths = [
        ("kvtier", "store", Path::StoreFrames, false),
        ("engine-fused", "store", Path::StoreKeys, false),
        ("engine-fused-x8", "store", Path::StoreKeys8, false),
        ("kvtier", "load", Path::LoadKeys, false),
        ("engine-old", "load", Path::LookupLoadCopy, false),
        ("engine-fused", "load", Path::LoadInto, false),
        ("engine-parked", "load", Path::LoadInto, true),
        ("engine-fused-x8", "load", Path::LoadInto8, false),
        ("engine-fp8-x8", "store", Path::StoreFp8x8, false),
        ("engine-fp8-x8", "load", Path::LoadFp8x8, false),
    ];
    for &c in &cfg.concurrency {
        let config = ClientConfig { data_connections: c, max_batch_blocks: 256, ..Default::default() };
        let client = KvClient::connect(addr, config.clone()).await?;
        let parked =
            KvClient::connect(addr, ClientConfig { dataplane_poll: std::time::Duration::ZERO, ..config }).await?;
        for &size in &cfg.sizes {
            pb.set_message(format!("kvtier {} KiB x{c}", size >> 10));
            let ns = client
                .register(Namespace::new("bench", format!("blocks-{size}"), layout_for(size), HashScheme::Blake3, b""))
                .await?;
            let fp8 = ns.clone().with_codec(CodecId::FP8_E4M3)?;
            let data = payload(size, c);
            let kv = bf16_kv(size, c);
            let n = cfg.ops_per_task(size, c).div_ceil(8) * 8;
            let bytes = size * c * n;
            let mut gbps = vec![Vec::new(); paths.len()];
            let mut lats = vec![Vec::new(); paths.len()];
            let mut cpus = vec![Vec::new(); paths.len()];
            for run in 0..cfg.runs {
                // Blocking, but nothing else runs on the runtime between two cells' runs.
                tcp.sample(size, c)?;
                // Paths take turns within each run, so a burst of load from elsewhere on the
                // machine hits them alike rather than one path's every run.
                for (i, &(_, _, path, park)) in paths.iter().enumerate() {
                    let client = if park { &parked } else { &client };
                    let (ns, data) =
                        if matches!(path, Path::StoreFp8x8 | Path::LoadFp8x8) { (&fp8, &kv) } else { (&ns, &data) };
                    let (secs, lat, cpu) = run_path(client, ns, data, path, c, n, space(path, run), server_pid).await?;
                    gbps[i].push(bytes as f64 / secs / 1e9);
                    lats[i].extend(lat);
                    cpus[i].push(cpu);
                }
                client.purge(&ns).await?;
            }
            for (i, &(system, op, _, _)) in paths.iter().enumerate() {
                out.push(Cell::from_runs(system, op, size, c, &gbps[i], &lats[i]).with_cpu(&cpus[i], bytes));
            }
            pb.inc(1);
        }
    }
    Ok(out)
}

/// gRPC round trips measured alone: `Lookup` of `blocks` keys and `ResumeSession` of a session
/// of `blocks` blocks (the manifest only), each `n` times; and a whole `resume` (manifest, then
/// its blocks over the data plane).
#[derive(Debug, Clone, Serialize)]
pub struct RoundTrips {
    pub blocks: usize,
    pub block_bytes: usize,
    pub n: usize,
    pub lookup_p50_ms: f64,
    pub lookup_p99_ms: f64,
    pub resume_manifest_p50_ms: f64,
    pub resume_manifest_p99_ms: f64,
    pub resume_full_p50_ms: f64,
    pub resume_full_p99_ms: f64,
}

pub async fn round_trips(addr: &str, blocks: usize, n: usize) -> anyhow::Result<RoundTrips> {
    let client = KvClient::connect(addr, ClientConfig::default()).await?;
    let size = 64 << 10;
    let ns = client.register(Namespace::new("bench", "round-trips", layout_for(size), HashScheme::Blake3, b"")).await?;
    let bt = ns.block_tokens();
    let tokens: Vec<u32> = (0..(blocks * bt) as u32).collect();
    let kv: Vec<Bytes> = (0..blocks).map(|i| payload(size, i)).collect();
    client.park(&ns, "rt", &tokens, &kv, &kvtier_client::ParkOptions::default(), 0).await?;
    let keys = ns.keys(&tokens);
    let ms = |v: &[f64], p| percentile(v, p) * 1e3;
    let mut lookup = Vec::with_capacity(n);
    let mut manifest = Vec::with_capacity(n);
    let mut full = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let hit = client.lookup_keys(&ns, &keys).await?;
        lookup.push(t.elapsed().as_secs_f64());
        anyhow::ensure!(hit == blocks, "lookup found {hit} of {blocks} parked blocks");
        let req = pb::ResumeRequest { namespace_id: Bytes::copy_from_slice(&ns.id.0), session_id: "rt".into() };
        let t = Instant::now();
        let m = client.raw_grpc().resume_session(req).await?.into_inner();
        manifest.push(t.elapsed().as_secs_f64());
        anyhow::ensure!(m.keys.len() == blocks, "resume listed {} of {blocks} blocks", m.keys.len());
        let t = Instant::now();
        let r = client.resume(&ns, "rt").await?;
        full.push(t.elapsed().as_secs_f64());
        anyhow::ensure!(r.blocks.len() == blocks, "resume gave {} of {blocks} blocks", r.blocks.len());
    }
    client.drop_session(&ns, "rt").await?;
    client.purge(&ns).await?;
    Ok(RoundTrips {
        blocks,
        block_bytes: size,
        n,
        lookup_p50_ms: ms(&lookup, 50.0),
        lookup_p99_ms: ms(&lookup, 99.0),
        resume_manifest_p50_ms: ms(&manifest, 50.0),
        resume_manifest_p99_ms: ms(&manifest, 99.0),
        resume_full_p50_ms: ms(&full, 50.0),
        resume_full_p99_ms: ms(&full, 99.0),
    })
}

/// Runs every cell against Redis at `url`, plain and pipelined.
pub async fn run_redis(
    url: &str,
    server_pid: Option<u32>,
    cfg: &BlocksConfig,
    tcp: &crate::limits::TcpSampler,
    pb: &indicatif::ProgressBar,
) -> anyhow::Result<Vec<Cell>> {
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
                    // Blocking, but nothing else runs on the runtime between two runs.
                    tcp.sample(size, c)?;
                    samples.push(redis_sample(&conns, &data, size, n, depth, run, server_pid).await?);
                    redis::cmd("FLUSHALL").query_async::<()>(&mut conns[0].clone()).await?;
                }
                out.extend(cells(&system, size, c, samples, size * c * n));
            }
            pb.inc(1);
        }
    }
    Ok(out)
}

/// `redis-benchmark`'s own figures for one cell: its SET and GET of `size`-byte values with `c`
/// clients, as many requests as the cell's other systems make, `cfg.runs` times (GB/s = requests/s
/// × size; latencies: the median over runs of its own p50 and p99).
pub fn redis_benchmark_cells(
    bin: &std::path::Path,
    port: u16,
    cfg: &BlocksConfig,
    size: usize,
    c: usize,
    tcp: &crate::limits::TcpSampler,
) -> anyhow::Result<Vec<Cell>> {
    let n = cfg.ops_per_task(size, c) * c;
    let mut rows = Vec::new();
    for _ in 0..cfg.runs {
        tcp.sample(size, c)?;
        rows.extend(crate::servers::redis_benchmark(bin, port, size, c, n)?);
    }
    let mut cells = Vec::new();
    for (test, op) in [("SET", "store"), ("GET", "load")] {
        let mine: Vec<_> = rows.iter().filter(|r| r.test == test).collect();
        let g: Vec<f64> = mine.iter().map(|r| r.rps * size as f64 / 1e9).collect();
        let mut cell = Cell::from_runs("redis-benchmark", op, size, c, &g, &[]);
        cell.p50_ms = median(mine.iter().map(|r| r.p50_ms).collect());
        cell.p99_ms = median(mine.iter().map(|r| r.p99_ms).collect());
        cell.ops = n * mine.len();
        cells.push(cell);
    }
    Ok(cells)
}

async fn redis_sample(
    conns: &[redis::aio::MultiplexedConnection],
    data: &Bytes,
    size: usize,
    n: usize,
    depth: usize,
    run: usize,
    server_pid: Option<u32>,
) -> anyhow::Result<Sample> {
    let rkey = move |task: usize, op: usize| key(size, run, task, op).0.to_vec();
    let cpu = CpuMark::now(server_pid);
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
    let store_cpu = cpu.spent();
    let cpu = CpuMark::now(server_pid);
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
    let load_s = t.elapsed().as_secs_f64();
    Ok(Sample { store_s, load_s, store_lat, load_lat, store_cpu, load_cpu: cpu.spent() })
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

    /// The fp8 path's blocks halve on the wire and come back close: finite bf16 values the codec
    /// keeps within a few percent (a block of NaNs or zeros would measure nothing real).
    #[test]
    fn fp8_blocks_are_kv_like_and_halve() {
        let size = 1 << 20;
        let kv = bf16_kv(size, 3);
        assert_eq!(kv.len(), size);
        assert_ne!(kv, bf16_kv(size, 4));
        let f = |b: &[u8]| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
        assert!(kv.chunks_exact(2).all(|b| f(b).is_finite()));
        let spec = kvtier_kernels::BlockSpec::from_layout(&layout_for(size), layout_for(size).block_tokens);
        let view = kvtier_kernels::KvBlockView::new(spec, &kv).unwrap();
        let enc = kvtier_kernels::encode(CodecId::FP8_E4M3, &view).unwrap();
        assert!(enc.len() * 100 <= size * 55, "fp8 is {} of {size} bytes", enc.len());
        let dec = kvtier_kernels::decode(CodecId::FP8_E4M3, &enc, &spec).unwrap();
        let (mut err, mut norm) = (0f64, 0f64);
        for (a, b) in kv.chunks_exact(2).zip(dec.chunks_exact(2)) {
            let (a, b) = (f(a) as f64, f(b) as f64);
            err += (a - b) * (a - b);
            norm += a * a;
        }
        assert!(norm > 0.0 && (err / norm).sqrt() < 0.1, "relative RMS error {}", (err / norm).sqrt());
    }
}
