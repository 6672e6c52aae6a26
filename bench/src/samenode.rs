//! `kvtier-bench samenode`: the same-node path (buffers registered over the node's Unix socket,
//! blocks copied by offset) beside a memcpy of the same bytes (one thread), the TCP data plane's
//! fused paths (`load_keys_into`, `store_keys`) and Redis over its own Unix socket (GET, then a
//! copy into the destination; SET), in the same run against one real `kvtier` process and one
//! real `redis-server` (skipped with a line saying why when it is not installed).
//!
//! Every path moves blocks of one size between the same shapes of memory: a working set of
//! `WORKING_SET` bytes of stored blocks, loaded block `i` → offset `i` of the destination, stored
//! from offset `i` of a source of the same size under keys never stored before. GB/s is the
//! median over runs; p50/p99 are per call, pooled over runs.

use std::path::Path;
use std::time::Instant;

use anyhow::{ensure, Context};
use bytes::Bytes;
use kvtier_client::{ClientConfig, ItemStatus, KvClient, SharedBuffer};
use kvtier_proto::{BlockKey, HashScheme, Namespace};
use serde::Serialize;

use crate::blocks::layout_for;
use crate::servers::{KvtierServer, RedisServer};
use crate::stats::{median, percentile, ratio};

/// Bytes of stored blocks the loads cycle over (past the last-level cache).
const WORKING_SET: usize = 128 << 20;

/// What a path-by-path bench (`samenode`, `tls`) measures: block sizes, concurrency levels, bytes
/// each path moves per run and cell, runs.
#[derive(Debug, Clone)]
pub struct CellsConfig {
    pub sizes: Vec<usize>,
    pub concurrency: Vec<usize>,
    /// Bytes each path moves per run and cell.
    pub bytes_per_cell: usize,
    pub runs: usize,
}

/// One path's figure in one cell (size, concurrency, operation) of a path-by-path bench.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub size: usize,
    pub concurrency: usize,
    pub op: &'static str,
    pub path: &'static str,
    pub gbps: f64,
    pub gbps_runs: Vec<f64>,
    pub p50_us: f64,
    pub p99_us: f64,
}

fn key(size: usize, run: usize, task: usize, op: usize) -> BlockKey {
    let mut k = [0u8; 32];
    k[..8].copy_from_slice(&(size as u64).to_le_bytes());
    k[8..16].copy_from_slice(&(run as u64).to_le_bytes());
    k[16..24].copy_from_slice(&(task as u64).to_le_bytes());
    k[24..32].copy_from_slice(&(op as u64).to_le_bytes());
    BlockKey(*blake3::hash(&k).as_bytes())
}

fn fill(buf: &mut [u8], seed: usize) {
    let mut pattern = [0u8; 4093];
    for (i, b) in pattern.iter_mut().enumerate() {
        *b = ((i.wrapping_mul(131) + seed * 7) % 253) as u8;
    }
    for chunk in buf.chunks_mut(pattern.len()) {
        chunk.copy_from_slice(&pattern[..chunk.len()]);
    }
}

/// Samples of one cell: each run's GB/s and every call's latency (s).
#[derive(Default)]
struct Acc {
    gbps: Vec<f64>,
    lat: Vec<f64>,
}

impl Acc {
    fn add(&mut self, bytes: usize, wall: f64, lat: Vec<f64>) {
        self.gbps.push(bytes as f64 / wall / 1e9);
        self.lat.extend(lat);
    }
}

/// One thread copying `ops` blocks of `size` from a source to a destination of the working set's
/// size, block `i` to offset `i`, with `copy`.
fn memcpy(size: usize, ops: usize, src: &[u8], dst: &mut [u8], copy: fn(&[u8], &mut [u8])) -> (f64, Vec<f64>) {
    let n = src.len() / size;
    let mut lat = Vec::with_capacity(ops);
    let t = Instant::now();
    for op in 0..ops {
        let at = (op % n) * size;
        let s = Instant::now();
        copy(&src[at..at + size], &mut dst[at..at + size]);
        std::hint::black_box(&dst[at]);
        lat.push(s.elapsed().as_secs_f64());
    }
    (t.elapsed().as_secs_f64(), lat)
}

/// The copy a plain `memcpy` makes.
fn plain_copy(src: &[u8], dst: &mut [u8]) {
    dst.copy_from_slice(src);
}

/// The copy the same-node server makes into a client's buffer: streaming stores, published.
fn streaming_copy(src: &[u8], dst: &mut [u8]) {
    // SAFETY: `dst` is a slice of `src`'s length, and a `&mut` can't overlap `src`.
    unsafe { kvtier_kernels::copy::copy_streaming(src, dst.as_mut_ptr()) };
    kvtier_kernels::copy::publish();
}

/// [`memcpy`] of the same `ops` blocks by two threads, each taking every other block: what the
/// memory system gives a process that copies with both cores.
fn memcpy_2_threads(size: usize, ops: usize, src: &[u8], dst: &mut [u8]) -> (f64, Vec<f64>) {
    let n = src.len() / size;
    let t = Instant::now();
    // Block `i` of `dst` is `halves[i % 2][i / 2]`.
    let (even, odd): (Vec<_>, Vec<_>) = dst.chunks_mut(size).enumerate().partition(|(i, _)| i % 2 == 0);
    let lat = std::thread::scope(|scope| {
        let threads = [(0, even), (1, odd)].map(|(parity, mut mine)| {
            scope.spawn(move || {
                let mut lat = Vec::new();
                for i in (0..ops).map(|op| op % n).filter(|i| i % 2 == parity) {
                    let s = Instant::now();
                    let d = &mut mine[i / 2].1;
                    d.copy_from_slice(&src[i * size..(i + 1) * size]);
                    std::hint::black_box(&d[0]);
                    lat.push(s.elapsed().as_secs_f64());
                }
                lat
            })
        });
        threads.into_iter().flat_map(|h| h.join().unwrap_or_default()).collect()
    });
    (t.elapsed().as_secs_f64(), lat)
}

pub fn run(bin: &Path, dir: &Path, log: &Path, cfg: &CellsConfig) -> anyhow::Result<Vec<Row>> {
    let max_c = cfg.concurrency.iter().copied().max().unwrap_or(1);
    // Room for the working set plus every store of a run (evicted as they age).
    let dram = (WORKING_SET * 2 + cfg.bytes_per_cell * 2 + (256 << 20)) as u64;
    // A node dedicated to the cache faults its DRAM in at start: stores measure the copy, not
    // the first fill's page faults (which a full cache, reusing its slots, doesn't pay either).
    let server = KvtierServer::start_with(bin, dir, dram, log, &["--dram-prefault"])?;
    let redis = match crate::servers::find_redis(None) {
        Ok(bin) => match RedisServer::start_with_unix(&bin, &dir.join("redis")) {
            Ok(r) => Some(r),
            Err(e) => {
                eprintln!("samenode: Redis over its Unix socket skipped: {e:#}");
                None
            }
        },
        Err(why) => {
            eprintln!("samenode: Redis over its Unix socket skipped: {why}");
            None
        }
    };
    let redis_url =
        redis.as_ref().and_then(|r| r.unix_socket.as_ref()).map(|p| format!("redis+unix://{}", p.display()));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(max_c.clamp(2, 8)).enable_all().build()?;
    let out = rt.block_on(measure(&server.grpc_addr, cfg, redis_url.as_deref()));
    drop(server);
    drop(redis);
    out
}

/// Keys a task's Redis stores cycle over (overwritten, so Redis holds a bounded amount).
const REDIS_STORE_KEYS: usize = 64;

async fn measure(addr: &str, cfg: &CellsConfig, redis_url: Option<&str>) -> anyhow::Result<Vec<Row>> {
    let redis = match redis_url {
        Some(url) => Some(redis::Client::open(url)?),
        None => None,
    };
    let ccfg = ClientConfig { data_connections: 4, ..ClientConfig::default() };
    let client = KvClient::connect(addr, ccfg).await?;
    let mut rows = Vec::new();
    for &size in &cfg.sizes {
        let layout = layout_for(size);
        let ns = client
            .register(Namespace::new("bench", format!("samenode-{size}"), layout, HashScheme::Blake3, b"bench"))
            .await?;
        let n = WORKING_SET / size;
        // The working set the loads read, stored once.
        let mut seed_src = vec![0u8; WORKING_SET];
        fill(&mut seed_src, 1);
        let seed_src = Bytes::from(seed_src);
        let wkeys: Vec<BlockKey> = (0..n).map(|i| key(size, usize::MAX, 0, i)).collect();
        for (chunk_keys, chunk) in wkeys.chunks(64).zip((0..n).collect::<Vec<_>>().chunks(64)) {
            let blocks: Vec<Vec<Bytes>> =
                chunk.iter().map(|&i| vec![seed_src.slice(i * size..(i + 1) * size)]).collect();
            let st = client.store_keys(&ns, chunk_keys, &blocks).await?;
            ensure!(st.iter().all(|s| s.is_held()), "seeding the working set: {st:?}");
        }
        let mut mem_src = vec![0u8; WORKING_SET];
        fill(&mut mem_src, 2);
        let mut mem_dst = vec![0u8; WORKING_SET];
        fill(&mut mem_dst, 3);
        let mut shm_dst = SharedBuffer::new(WORKING_SET)?;
        fill(shm_dst.as_mut_slice(), 4);
        // The same working set in Redis, under its own keys.
        let redis_key = |i: usize| format!("ws:{size}:{i}");
        if let Some(r) = &redis {
            let mut conn = r.get_multiplexed_async_connection().await?;
            redis::cmd("FLUSHALL").query_async::<()>(&mut conn).await?;
            for chunk in (0..n).collect::<Vec<_>>().chunks(16) {
                let mut p = redis::pipe();
                for &i in chunk {
                    p.cmd("SET").arg(redis_key(i)).arg(&seed_src[i * size..(i + 1) * size]).ignore();
                }
                p.query_async::<()>(&mut conn).await?;
            }
        }
        for &c in &cfg.concurrency {
            let ops = (cfg.bytes_per_cell / (size * c)).max(4);
            let bytes = ops * c * size;
            // Per task: a same-node connection, a destination and a source of the working set's size.
            let mut tasks = Vec::new();
            for t in 0..c {
                let mut near = client.samenode().await.context("the same-node path (is the server on this host?)")?;
                let dst = SharedBuffer::new(WORKING_SET)?;
                let mut src = SharedBuffer::new(WORKING_SET)?;
                fill(src.as_mut_slice(), 10 + t);
                near.register(&dst).await?;
                near.register(&src).await?;
                let mut tcp_src = vec![0u8; WORKING_SET];
                fill(&mut tcp_src, 20 + t);
                tasks.push((near, dst, src, vec![0u8; WORKING_SET], Bytes::from(tcp_src)));
            }
            let mut redis_conns = Vec::new();
            if let Some(r) = &redis {
                for _ in 0..c {
                    redis_conns.push(r.get_multiplexed_async_connection().await?);
                }
            }
            let mut acc: [Acc; 11] = Default::default();
            for run in 0..cfg.runs {
                if c == 1 {
                    let (wall, lat) = memcpy(size, ops, &mem_src, &mut mem_dst, plain_copy);
                    acc[0].add(bytes, wall, lat);
                    let (wall, lat) = memcpy(size, ops, &mem_src, shm_dst.as_mut_slice(), plain_copy);
                    acc[6].add(bytes, wall, lat);
                    let (wall, lat) = memcpy(size, ops, &mem_src, shm_dst.as_mut_slice(), streaming_copy);
                    acc[10].add(bytes, wall, lat);
                    let (wall, lat) = memcpy_2_threads(size, ops, &mem_src, &mut mem_dst);
                    acc[5].add(bytes, wall, lat);
                }
                // Loads: TCP fused, then same-node (checked by the server as it copies).
                for (pi, same) in [(1usize, false), (2, true)] {
                    let t0 = Instant::now();
                    let results = futures::future::try_join_all(tasks.iter_mut().enumerate().map(|(t, task)| {
                        let (client, ns, wkeys) = (&client, &ns, &wkeys);
                        async move {
                            let mut lat = Vec::with_capacity(ops);
                            for op in 0..ops {
                                let i = (op * c + t) % n;
                                let s = Instant::now();
                                let ok = if same {
                                    let off = (i * size) as u64;
                                    task.0.load_into_buffer(ns, &wkeys[i..=i], &mut task.1, &[off], true).await?
                                } else {
                                    let mut d = vec![vec![&mut task.3[i * size..(i + 1) * size]]];
                                    client.load_keys_into(ns, &wkeys[i..=i], &mut d, true).await?
                                };
                                lat.push(s.elapsed().as_secs_f64());
                                ensure!(ok == [true], "block {i} did not load");
                            }
                            Ok::<_, anyhow::Error>(lat)
                        }
                    }))
                    .await?;
                    acc[pi].add(bytes, t0.elapsed().as_secs_f64(), results.concat());
                }
                // Eight consecutive blocks per call: what a call's fixed cost is.
                {
                    let t0 = Instant::now();
                    let calls = (ops / 8).max(1);
                    let results = futures::future::try_join_all(tasks.iter_mut().enumerate().map(|(t, task)| {
                        let (ns, wkeys) = (&ns, &wkeys);
                        async move {
                            let mut lat = Vec::with_capacity(calls);
                            for call in 0..calls {
                                let first = ((call * c + t) * 8) % (n - n % 8).max(8);
                                let keys = &wkeys[first..(first + 8).min(n)];
                                let offs: Vec<u64> = (first..first + keys.len()).map(|i| (i * size) as u64).collect();
                                let s = Instant::now();
                                let ok = task.0.load_into_buffer(ns, keys, &mut task.1, &offs, true).await?;
                                lat.push(s.elapsed().as_secs_f64());
                                ensure!(ok.iter().all(|x| *x), "blocks {first}.. did not load");
                            }
                            Ok::<_, anyhow::Error>(lat)
                        }
                    }))
                    .await?;
                    acc[7].add(calls * c * 8 * size, t0.elapsed().as_secs_f64(), results.concat());
                }
                // Stores under new keys: TCP fused, then same-node.
                for (pi, same) in [(3usize, false), (4, true)] {
                    let t0 = Instant::now();
                    let results = futures::future::try_join_all(tasks.iter_mut().enumerate().map(|(t, task)| {
                        let (client, ns) = (&client, &ns);
                        async move {
                            let mut lat = Vec::with_capacity(ops);
                            for op in 0..ops {
                                let i = (op * c + t) % n;
                                let k = [key(size, run * 8 + pi, t + 1000 * c, op)];
                                let s = Instant::now();
                                let st = if same {
                                    task.0.store_from_buffer(ns, &k, &task.2, &[(i * size) as u64]).await?
                                } else {
                                    let b = vec![vec![task.4.slice(i * size..(i + 1) * size)]];
                                    client.store_keys(ns, &k, &b).await?
                                };
                                lat.push(s.elapsed().as_secs_f64());
                                ensure!(st == [ItemStatus::Ok], "store {op}: {st:?}");
                            }
                            Ok::<_, anyhow::Error>(lat)
                        }
                    }))
                    .await?;
                    acc[pi].add(bytes, t0.elapsed().as_secs_f64(), results.concat());
                }
                // Redis over its Unix socket: GET then a copy into the destination; SET.
                if !redis_conns.is_empty() {
                    let t0 = Instant::now();
                    let results = futures::future::try_join_all(
                        redis_conns.iter().zip(tasks.iter_mut()).enumerate().map(|(t, (conn, task))| {
                            let mut conn = conn.clone();
                            async move {
                                let mut lat = Vec::with_capacity(ops);
                                for op in 0..ops {
                                    let i = (op * c + t) % n;
                                    let s = Instant::now();
                                    let v: Vec<u8> = redis::cmd("GET").arg(redis_key(i)).query_async(&mut conn).await?;
                                    ensure!(v.len() == size, "Redis returned {} bytes for block {i}", v.len());
                                    task.3[i * size..(i + 1) * size].copy_from_slice(&v);
                                    lat.push(s.elapsed().as_secs_f64());
                                }
                                Ok::<_, anyhow::Error>(lat)
                            }
                        }),
                    )
                    .await?;
                    acc[8].add(bytes, t0.elapsed().as_secs_f64(), results.concat());
                    let t0 = Instant::now();
                    let results = futures::future::try_join_all(redis_conns.iter().zip(tasks.iter()).enumerate().map(
                        |(t, (conn, task))| {
                            let mut conn = conn.clone();
                            async move {
                                let mut lat = Vec::with_capacity(ops);
                                for op in 0..ops {
                                    let i = (op * c + t) % n;
                                    let s = Instant::now();
                                    redis::cmd("SET")
                                        .arg(format!("st:{t}:{}", op % REDIS_STORE_KEYS))
                                        .arg(&task.4[i * size..(i + 1) * size])
                                        .query_async::<()>(&mut conn)
                                        .await?;
                                    lat.push(s.elapsed().as_secs_f64());
                                }
                                Ok::<_, anyhow::Error>(lat)
                            }
                        },
                    ))
                    .await?;
                    acc[9].add(bytes, t0.elapsed().as_secs_f64(), results.concat());
                }
            }
            let names = [
                ("copy", "memcpy (1 thread)"),
                ("load", "TCP load_keys_into"),
                ("load", "same-node load_into_buffer"),
                ("store", "TCP store_keys"),
                ("store", "same-node store_from_buffer"),
                ("copy", "memcpy (2 threads)"),
                ("copy2", "memcpy into a memfd buffer (1 thread)"),
                ("load", "same-node load_into_buffer x8 per call"),
                ("load", "Redis GET over its Unix socket, + copy"),
                ("store", "Redis SET over its Unix socket"),
                ("copy2", "memcpy into a memfd buffer, streaming stores (1 thread)"),
            ];
            for (a, (op, path)) in acc.into_iter().zip(names) {
                if a.gbps.is_empty() {
                    continue;
                }
                rows.push(Row {
                    size,
                    concurrency: c,
                    op,
                    path,
                    gbps: median(a.gbps.clone()),
                    gbps_runs: a.gbps,
                    p50_us: percentile(&a.lat, 50.0) * 1e6,
                    p99_us: percentile(&a.lat, 99.0) * 1e6,
                });
            }
        }
    }
    Ok(rows)
}

/// A markdown table: GB/s, its ratio to memcpy of the same size (concurrency 1) and to the TCP
/// path of the same op, size and concurrency, and per-call latency.
pub fn table(rows: &[Row]) -> String {
    let mut s = String::from(
        "| block | conc | path | GB/s (runs) | × memcpy | × TCP | p50 µs | p99 µs |\n|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let memcpy = rows.iter().find(|m| m.size == r.size && m.op == "copy").map_or(f64::NAN, |m| m.gbps);
        let tcp = rows
            .iter()
            .find(|m| m.size == r.size && m.concurrency == r.concurrency && m.op == r.op && m.path.starts_with("TCP"))
            .map_or(f64::NAN, |m| m.gbps);
        let runs: Vec<String> = r.gbps_runs.iter().map(|g| format!("{g:.2}")).collect();
        let fmt = |x: f64| if x.is_finite() { format!("{x:.2}") } else { "—".into() };
        s.push_str(&format!(
            "| {} | {} | {} | **{:.2}** ({}) | {} | {} | {:.0} | {:.0} |\n",
            crate::report::size(r.size),
            r.concurrency,
            r.path,
            r.gbps,
            runs.join(", "),
            fmt(ratio(r.gbps, memcpy)),
            if r.op == "copy" { "—".into() } else { fmt(ratio(r.gbps, tcp)) },
            r.p50_us,
            r.p99_us
        ));
    }
    s
}
