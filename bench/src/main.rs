//! `kvtier-bench`: kvtier measured beside the machine's limits, a real Redis and the prefill it
//! saves, in one run. `kvtier-bench [all|limits|blocks|trace|plan] [--quick] [--out DIR]`.
//! Markdown on stdout, `results.json` and PNG plots in the output folder.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use kvtier_bench::blocks::{self, BlocksConfig, Cell};
use kvtier_bench::model::{self, Codec, Gpu, Link, Model, PlanInput};
use kvtier_bench::plot::{self, Chart, Series};
use kvtier_bench::pydriver::{self, Driver};
use kvtier_bench::replay::{self, ReplayConfig};
use kvtier_bench::servers::{self, KvtierServer, LmcacheServer, RedisServer};
use kvtier_bench::trace::{Trace, TraceConfig};
use kvtier_bench::{limits, report};
use serde_json::json;

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum, Debug)]
enum What {
    /// Everything below.
    All,
    /// memcpy, loopback TCP, Unix socket, disk.
    Limits,
    /// Block store/load vs Redis and the limits.
    Blocks,
    /// Synthetic replicas + agent sessions workload replayed against kvtier.
    Trace,
    /// p50/p99 of lookups, resumes and 1 MiB loads while sessions park to disk (this build and
    /// `--baseline-bin`). Not part of `all`.
    Contention,
    /// The same-node path (registered buffers over the node's Unix socket) beside memcpy and the
    /// TCP data plane, same run. Not part of `all`.
    Samenode,
    /// The data plane over TLS (client certificates) beside plain TCP and the loopback limit,
    /// same run. Not part of `all`.
    Tls,
    /// 1, 2 and 3 nodes sharing a real redis-server: cross-node loads beside local loads and
    /// loopback TCP, and the trace with its replicas over 3 nodes beside one shared node. Not
    /// part of `all`.
    Cluster,
    /// Capacity planner (pure arithmetic, no servers).
    Plan,
}

#[derive(Parser, Debug)]
#[command(name = "kvtier-bench", about = "kvtier beside Redis, the machine's limits and the prefill it saves")]
struct Args {
    #[arg(value_enum, default_value = "all")]
    what: What,
    /// A first look in about a minute: fewer bytes, one run per figure, smaller trace.
    #[arg(long)]
    quick: bool,
    /// Output folder for results.json and the PNG plots.
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
    /// Runs per figure (median reported). Default: 1 with --quick, else 3.
    #[arg(long)]
    runs: Option<usize>,
    /// The kvtier binary to start (default: `kvtier` beside this executable).
    #[arg(long)]
    kvtier_bin: Option<PathBuf>,
    /// An older `kvtier` binary `contention` measures beside this build's, in the same run.
    #[arg(long)]
    baseline_bin: Option<PathBuf>,
    /// Use an already running kvtier at this gRPC address instead of starting one (blocks only;
    /// the trace needs its own server to set the DRAM cap).
    #[arg(long)]
    server: Option<String>,
    /// The redis-server binary (default: from PATH).
    #[arg(long)]
    redis_bin: Option<PathBuf>,
    /// Skip Redis.
    #[arg(long)]
    no_redis: bool,
    /// The redis-benchmark binary (default: from PATH).
    #[arg(long)]
    redis_benchmark_bin: Option<PathBuf>,
    /// Block sizes of `blocks`, comma-separated (64KiB, 1MiB, 4194304...).
    #[arg(long, default_value = "64KiB,256KiB,1MiB,4MiB")]
    sizes: String,
    /// Concurrency levels of `blocks`, comma-separated.
    #[arg(long, default_value = "1,4,16")]
    concurrency: String,
    /// Block sizes of `samenode`, comma-separated.
    #[arg(long, default_value = "64KiB,1MiB,4MiB")]
    samenode_sizes: String,
    /// Concurrency levels of `samenode` (one same-node connection per task), comma-separated.
    #[arg(long, default_value = "1,4")]
    samenode_concurrency: String,
    /// Block sizes of `tls`, comma-separated.
    #[arg(long, default_value = "64KiB,1MiB")]
    tls_sizes: String,
    /// Concurrency levels of `tls`, comma-separated.
    #[arg(long, default_value = "1,4")]
    tls_concurrency: String,
    /// The Python that runs the Python client's figures and LMCache's server (default:
    /// $KVTIER_BENCH_PYTHON, the active virtualenv, the checkout's .venv, python3).
    #[arg(long)]
    python: Option<PathBuf>,
    /// Skip the Python client's figures.
    #[arg(long)]
    no_python: bool,
    /// Every server (kvtier, Redis, LMCache) on the upper half of the CPUs, every client (this
    /// process's tasks, the Python driver, redis-benchmark) on the rest, and the TCP baseline's
    /// sender and receiver likewise: the same placement for every system measured.
    #[arg(long)]
    pin: bool,
    /// Skip LMCache's server.
    #[arg(long)]
    no_lmcache: bool,
    /// gRPC round trips timed for the Lookup / ResumeSession latencies.
    #[arg(long, default_value_t = 200)]
    round_trips: usize,
    /// Data directory for the servers and the disk figures (default: OUT/data).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Redis pipeline depth.
    #[arg(long, default_value_t = 8)]
    pipeline: usize,
    /// Trace / plan model: llama-3-8b, llama-3-70b, or both (trace only).
    #[arg(long, default_value = "both")]
    model: String,
    /// GPU the prefill-saved figures are for: A100, L40S, H100, H200, B200.
    #[arg(long, default_value = "H100")]
    gpu: String,
    /// Fraction of the GPU's dense BF16 peak prefill reaches.
    #[arg(long, default_value_t = 0.5)]
    mfu: f64,
    /// Link the trace's reloads are modeled over (index in the plan's link table, 0-based; 1 = PCIe Gen5).
    #[arg(long, default_value_t = 1)]
    link: usize,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Bytes-per-token scale of the trace replay (default 1024 with --quick, else 256).
    #[arg(long)]
    scale: Option<u64>,
    /// Planner: KV codec (bf16, fp8, nvfp4).
    #[arg(long, default_value = "bf16")]
    codec: String,
    #[arg(long, default_value_t = 40.0)]
    hbm_gb: f64,
    #[arg(long, default_value_t = 1000.0)]
    dram_gb: f64,
    #[arg(long, default_value_t = 8000.0)]
    nvme_gb: f64,
    #[arg(long, default_value_t = 32768.0)]
    avg_context: f64,
    #[arg(long, default_value_t = 10.0)]
    rps: f64,
    #[arg(long, default_value_t = 0.5)]
    session_fraction: f64,
    #[arg(long, default_value_t = 60.0)]
    think_s: f64,
    /// Planner model overrides.
    #[arg(long)]
    layers: Option<u32>,
    #[arg(long)]
    kv_heads: Option<u32>,
    #[arg(long)]
    heads: Option<u32>,
    #[arg(long)]
    head_dim: Option<u32>,
    /// Parameters, billions.
    #[arg(long)]
    params_b: Option<f64>,
}

fn bar(len: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template("{prefix:>8} [{elapsed_precise}] {bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb.set_prefix(what.to_string());
    pb.enable_steady_tick(Duration::from_millis(250));
    pb
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.into());
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|k| k.parse::<f64>().ok())
        })
        .map(|kb| format!("{:.0} GiB RAM", kb / (1 << 20) as f64))
        .unwrap_or_default();
    format!("{cpu}, {cores} cores, {mem}, {} {}", std::env::consts::OS, std::env::consts::ARCH)
}

/// `64KiB`, `1MiB`, `4194304`.
fn parse_size(s: &str) -> anyhow::Result<usize> {
    let s = s.trim();
    let (num, mul) = if let Some(n) = s.strip_suffix("KiB").or_else(|| s.strip_suffix('K')) {
        (n, 1 << 10)
    } else if let Some(n) = s.strip_suffix("MiB").or_else(|| s.strip_suffix('M')) {
        (n, 1 << 20)
    } else {
        (s, 1)
    };
    Ok(num.trim().parse::<usize>().with_context(|| format!("bad size {s:?}"))? * mul)
}

fn list<T>(s: &str, f: impl Fn(&str) -> anyhow::Result<T>) -> anyhow::Result<Vec<T>> {
    s.split(',').filter(|x| !x.trim().is_empty()).map(f).collect()
}

fn models(s: &str) -> anyhow::Result<Vec<Model>> {
    if s == "both" {
        return Ok(vec![Model::LLAMA3_8B, Model::LLAMA3_70B]);
    }
    Ok(vec![Model::by_name(s).with_context(|| format!("unknown model {s:?} (llama-3-8b, llama-3-70b, both)"))?])
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let quick = a.quick;
    let runs = a.runs.unwrap_or(if quick { 1 } else { 3 }).max(1);
    std::fs::create_dir_all(&a.out)?;
    let out = a.out.canonicalize()?;
    let data_dir = a.data_dir.clone().unwrap_or_else(|| out.join("data"));
    let mut gpu = Gpu::by_name(&a.gpu).with_context(|| format!("unknown GPU {:?}", a.gpu))?;
    gpu.mfu = a.mfu;
    let link = *Link::ALL.get(a.link).context("--link is an index into the link table")?;
    let started = Instant::now();
    let cmdline: Vec<String> = std::env::args().collect();
    let mach = machine();
    // Before any runtime or thread starts (they inherit the clients' CPUs), after the machine's
    // own count.
    let pinned = if a.pin { Some(kvtier_bench::placement::pin()?) } else { None };
    println!(
        "# kvtier-bench {}\n\nMachine: {mach}. Command: `{}`.\n",
        if quick { "(quick)" } else { "" },
        cmdline.join(" ")
    );
    if let Some(p) = pinned {
        println!("Pinned: servers on CPUs {:?}, clients on CPUs {:?}.\n", p.servers, p.clients);
    }
    let mut json = json!({ "machine": mach, "command": cmdline, "quick": quick, "runs": runs, "pinned": pinned });
    let all = a.what == What::All;
    let mut plots = Vec::new();

    // Limits: their own section, and the baseline the blocks' ratios use.
    let mut lim = None;
    if all || matches!(a.what, What::Limits | What::Blocks) {
        let pb = bar(5, "limits");
        // With `blocks` the limits are the ratios' baselines: as many runs as the cells, to show
        // their spread too, and the smaller transfer of --quick.
        let l = limits::measure(&data_dir, quick || a.what == What::Blocks, runs, &pb)?;
        pb.finish_and_clear();
        println!("{}", report::limits_table(&l));
        json["limits"] = serde_json::to_value(&l)?;
        lim = Some(l);
    }

    if all || a.what == What::Blocks {
        let cfg = BlocksConfig {
            sizes: list(&a.sizes, parse_size)?,
            concurrency: list(&a.concurrency, |c| Ok(c.trim().parse::<usize>()?))?,
            bytes_per_cell: if quick { 32 << 20 } else { 256 << 20 },
            runs,
            pipeline_depth: a.pipeline,
        };
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
        let mut cells: Vec<Cell> = Vec::new();
        // kvtier: a real process on loopback (or the one given).
        // Three store paths per run (store_frames, store_keys, store_keys of 8), each under keys
        // of its own, all held until the run's loads are done.
        let cap = 3 * cfg.bytes_per_cell.max(2 * (4 << 20) * 16) as u64 + (256 << 20);
        let (server, addr) = match &a.server {
            Some(s) => (None, s.clone()),
            None => {
                let bin = servers::find_kvtier(a.kvtier_bin.as_deref())?;
                let s =
                    KvtierServer::start(&bin, &data_dir.join("kvtier-blocks"), cap, &out.join("kvtier-blocks.log"))?;
                let addr = s.grpc_addr.clone();
                eprintln!("started {} (pid {}) at {addr}", bin.display(), s.pid());
                (Some(s), addr)
            }
        };
        let tcp_sampler = limits::TcpSampler::new(cfg.bytes_per_cell.min(64 << 20));
        let pb = bar(cfg.cells() as u64, "kvtier");
        let server_pid = server.as_ref().map(KvtierServer::pid);
        cells.extend(rt.block_on(blocks::run_kvtier(&addr, server_pid, &cfg, &tcp_sampler, &pb))?);
        pb.finish_and_clear();
        let mut notes: Vec<String> = Vec::new();
        // gRPC round trips alone: Lookup and ResumeSession of an 8-block session.
        let rtt = rt.block_on(blocks::round_trips(&addr, 8, a.round_trips))?;
        let python = pydriver::find_python(a.python.as_deref());
        // The Python client, against the same server.
        let py = if a.no_python { Err("skipped by --no-python".to_string()) } else { Driver::new(&python, "kvtier") };
        match &py {
            Err(why) => notes.push(format!("Python client figures are skipped: {why}.")),
            Ok(d) => {
                let pb = bar(cfg.cells() as u64, "python");
                let grpc = rt.block_on(kvtier_client::KvClient::connect(&addr, Default::default()))?;
                // Paths the driver left out: the first reason for each.
                let mut skipped = std::collections::BTreeMap::new();
                for &c in &cfg.concurrency {
                    for &size in &cfg.sizes {
                        pb.set_message(format!("python {} KiB x{c}", size >> 10));
                        let mut runs_ = Vec::new();
                        for run in 0..cfg.runs {
                            tcp_sampler.sample(size, c)?;
                            let mut to = vec!["--server".to_string(), addr.clone()];
                            if let Some(pid) = server_pid {
                                to.extend(["--server-pid".to_string(), pid.to_string()]);
                            }
                            let r = d.run("kvtier", &to, size, c, cfg.ops_per_task(size, c), run)?;
                            for id in &r.namespaces {
                                let req = kvtier_proto::pb::PurgeRequest {
                                    namespace_id: pydriver::unhex(id)?.into(),
                                    local_only: false,
                                };
                                rt.block_on(grpc.raw_grpc().purge(req))?;
                            }
                            for (path, why) in &r.skipped {
                                skipped.entry(path.clone()).or_insert_with(|| why.clone());
                            }
                            runs_.push(r);
                        }
                        cells.extend(pydriver::cells(&runs_, size, c));
                        pb.inc(1);
                    }
                }
                pb.finish_and_clear();
                notes.push(format!(
                    "Python client: {} (one `kvtier.Client` with `connections=c`, c threads, one block per call).",
                    d.python().display()
                ));
                for (path, why) in skipped {
                    notes.push(format!("Python `{path}` figures are skipped: {why}."));
                }
            }
        }
        drop(server);
        // LMCache's standalone server, driven by its own `lm://` client protocol from Python.
        let lm = if a.no_lmcache {
            Err("skipped by --no-lmcache".to_string())
        } else {
            Driver::new(&python, "lmcache.v1.protocol").and_then(|d| {
                LmcacheServer::start(&python, &out.join("lmcache-server.log"))
                    .map(|s| (d, s))
                    .map_err(|e| e.to_string())
            })
        };
        match lm {
            Err(why) => notes.push(format!("LMCache figures are skipped: {why}.")),
            Ok((d, s)) => {
                eprintln!("started lmcache.v1.server {} (pid {}) on port {}", s.version, s.pid(), s.port);
                let pb = bar(cfg.cells() as u64, "lmcache");
                for &c in &cfg.concurrency {
                    for &size in &cfg.sizes {
                        pb.set_message(format!("lmcache {} KiB x{c}", size >> 10));
                        let mut runs_ = Vec::new();
                        for run in 0..cfg.runs {
                            tcp_sampler.sample(size, c)?;
                            runs_.push(d.run(
                                "lmcache",
                                &["--port".into(), s.port.to_string(), "--server-pid".into(), s.pid().to_string()],
                                size,
                                c,
                                cfg.ops_per_task(size, c),
                                run,
                            )?);
                        }
                        cells.extend(pydriver::cells(&runs_, size, c));
                        pb.inc(1);
                    }
                }
                pb.finish_and_clear();
                notes.push(format!("LMCache {}: its standalone server (`python -m lmcache.v1.server 127.0.0.1 PORT cpu`), one connection per thread speaking its `lm://` protocol (PUT, unanswered, so each thread's store phase ends with an EXIST round trip; then GET received with `recv_into` into the caller's buffer).", s.version));
                drop(s);
            }
        }
        // Redis: only a real one, never a made-up figure.
        let redis_note: Option<String>;
        let redis_bin = if a.no_redis {
            Err("skipped by --no-redis".to_string())
        } else {
            servers::find_redis(a.redis_bin.as_deref())
        };
        match redis_bin {
            Err(why) => {
                let line = format!("Redis figures are skipped: {why}.");
                println!("{line}\n");
                redis_note = Some(line);
            }
            Ok(bin) => {
                let r = RedisServer::start(&bin, &data_dir.join("redis"))?;
                eprintln!("started redis-server {} on port {}", r.version, r.port);
                let pb = bar(cfg.cells() as u64, "redis");
                cells.extend(rt.block_on(blocks::run_redis(&r.url(), Some(r.pid()), &cfg, &tcp_sampler, &pb))?);
                pb.finish_and_clear();
                // Redis's own C client, on the same server.
                match servers::find_bin("redis-benchmark", a.redis_benchmark_bin.as_deref()) {
                    Err(why) => notes.push(format!("redis-benchmark figures are skipped: {why}.")),
                    Ok(rb) => {
                        let pb = bar(cfg.cells() as u64, "redis-benchmark");
                        for &c in &cfg.concurrency {
                            for &size in &cfg.sizes {
                                cells.extend(blocks::redis_benchmark_cells(&rb, r.port, &cfg, size, c, &tcp_sampler)?);
                                pb.inc(1);
                            }
                        }
                        pb.finish_and_clear();
                        notes.push("redis-benchmark: `redis-benchmark -t set,get -d SIZE -c C -n N --csv` (Redis's own C client; the SET test writes the value the GET test reads; latencies are its own p50/p99, medians over runs).".into());
                    }
                }
                redis_note = Some(format!("redis-server {} on loopback, `--save \"\" --appendonly no`, one connection per task, values = the same payload bytes.", r.version));
                drop(r);
            }
        }
        cells.extend(tcp_sampler.cells());
        let tcp = lim.as_ref().map(|l| l.tcp).unwrap_or(f64::NAN);
        println!("{}", report::blocks_table(&cells, tcp, redis_note.as_deref(), a.pipeline));
        if let Some(l) = &lim {
            println!("{}", report::wire_tables(&cells, l, &rtt, &notes));
        }
        json["blocks"] = json!({ "cells": cells, "tcp_limit_gb_per_s": tcp, "redis": redis_note, "bytes_per_cell": cfg.bytes_per_cell, "round_trips": rtt, "notes": notes });
        for (op, verb) in [("store", "SET"), ("load", "GET")] {
            let mut series = Vec::new();
            let mut systems: Vec<&str> = Vec::new();
            for c in &cells {
                if !systems.contains(&c.system.as_str()) {
                    systems.push(&c.system);
                }
            }
            let idx = |b: usize| cfg.sizes.iter().position(|&s| s == b).unwrap_or(0) as f64;
            for sys in systems {
                for &c in &cfg.concurrency {
                    let pts: Vec<(f64, f64)> = cells
                        .iter()
                        .filter(|x| x.system == sys && x.op == op && x.concurrency == c)
                        .map(|x| (idx(x.block_bytes), x.gb_per_s))
                        .collect();
                    if !pts.is_empty() {
                        series.push(Series { name: format!("{sys} x{c}"), points: pts, markers_only: false });
                    }
                }
            }
            if tcp.is_finite() {
                series.push(Series {
                    name: "loopback TCP limit".into(),
                    points: cfg.sizes.iter().map(|&s| (idx(s), tcp)).collect(),
                    markers_only: false,
                });
            }
            let path = out.join(format!("blocks_{op}.png"));
            let title = format!("kvtier {op} vs Redis {verb}: GB/s by block size and concurrency");
            plot::line_chart(
                &path,
                &Chart {
                    title: &title,
                    x_desc: "block size",
                    y_desc: "GB/s",
                    log_x: false,
                    log_y: false,
                    series,
                    x_names: Some(cfg.sizes.iter().map(|&s| report::size(s)).collect()),
                },
            )?;
            plots.push(path);
        }
    }

    if a.what == What::Samenode {
        let cfg = kvtier_bench::samenode::CellsConfig {
            sizes: list(&a.samenode_sizes, parse_size)?,
            concurrency: list(&a.samenode_concurrency, |c| Ok(c.trim().parse::<usize>()?))?,
            bytes_per_cell: if quick { 64 << 20 } else { 256 << 20 },
            runs,
        };
        let bin = servers::find_kvtier(a.kvtier_bin.as_deref())?;
        let rows = kvtier_bench::samenode::run(&bin, &data_dir.join("samenode"), &out.join("samenode.log"), &cfg)?;
        let table = kvtier_bench::samenode::table(&rows);
        println!("{table}");
        std::fs::write(out.join("samenode.md"), &table)?;
        std::fs::write(out.join("samenode.json"), serde_json::to_string_pretty(&rows)?)?;
        return Ok(());
    }

    if a.what == What::Tls {
        let cfg = kvtier_bench::samenode::CellsConfig {
            sizes: list(&a.tls_sizes, parse_size)?,
            concurrency: list(&a.tls_concurrency, |c| Ok(c.trim().parse::<usize>()?))?,
            bytes_per_cell: if quick { 64 << 20 } else { 256 << 20 },
            runs,
        };
        let bin = servers::find_kvtier(a.kvtier_bin.as_deref())?;
        let rows = kvtier_bench::tls::run(&bin, &data_dir.join("tls"), &out, &cfg)?;
        let table = kvtier_bench::tls::table(&rows);
        println!("{table}");
        std::fs::write(out.join("tls.md"), &table)?;
        std::fs::write(out.join("tls.json"), serde_json::to_string_pretty(&rows)?)?;
        return Ok(());
    }

    if a.what == What::Contention {
        let samples = if quick { 300 } else { 1500 };
        let mut builds = vec![("this build".to_string(), servers::find_kvtier(a.kvtier_bin.as_deref())?)];
        if let Some(b) = &a.baseline_bin {
            builds.insert(0, ("baseline".to_string(), servers::find_kvtier(Some(b))?));
        }
        let mut rows = Vec::new();
        for _ in 0..runs {
            for (name, bin) in &builds {
                eprintln!("contention: {name} ({})", bin.display());
                let dir = data_dir.join(format!("contention-{}", rows.len()));
                let log = out.join(format!("contention-{}.log", rows.len()));
                rows.push(kvtier_bench::contention::run(name, bin, &dir, &log, samples)?);
            }
        }
        let table = kvtier_bench::contention::table(&rows);
        println!("{table}");
        std::fs::write(out.join("contention.md"), &table)?;
        std::fs::write(out.join("contention.json"), serde_json::to_string_pretty(&rows)?)?;
        return Ok(());
    }

    if a.what == What::Cluster {
        let bin = servers::find_kvtier(a.kvtier_bin.as_deref())?;
        let redis_bin = servers::find_redis(a.redis_bin.as_deref()).map_err(anyhow::Error::msg)?;
        let dir = data_dir.join("cluster");
        let blocks_n = if quick { 64 } else { 256 };
        let loads = kvtier_bench::cluster::loads(&bin, &redis_bin, &dir, &out, blocks_n, runs)?;
        let tcfg = if quick {
            TraceConfig { seed: a.seed, prefix_requests: 150, sessions: 8, turns: 3, docs: 48, ..Default::default() }
        } else {
            TraceConfig { seed: a.seed, prefix_requests: 400, sessions: 24, turns: 4, docs: 64, ..Default::default() }
        };
        let trace = Trace::generate(&tcfg);
        let scale = a.scale.unwrap_or(if quick { 1024 } else { 256 });
        let m = models(&a.model)?[0];
        let layout = replay::replay_layout(&m, scale)?;
        let (docs, sessions) = replay::working_set(&trace, &layout);
        // Half the distinct documents fit, in total, in every set-up.
        let cap = (0.5 * docs as f64) as u64 + (sessions as f64 / 0.85) as u64 + (48 << 20);
        let cfg = ReplayConfig { model: m, scale, gpu, link, cache_fraction: 0.5, direct_to_owners: false };
        let replays = kvtier_bench::cluster::replays(&bin, &redis_bin, &dir, &out, &trace, &cfg, cap)?;
        let table = kvtier_bench::cluster::table(&loads, &replays);
        println!(
            "{table}\nTrace: {} replicas over the nodes, {} documents, {} prefix requests, {} sessions × {} turns; {} bytes/token scaled 1/{scale}; total DRAM the same in every set-up (half the documents' KV plus the sessions' peak). The nodes share this machine's 2 cores.",
            tcfg.replicas, tcfg.docs, tcfg.prefix_requests, tcfg.sessions, tcfg.turns, m.name
        );
        std::fs::write(out.join("cluster.md"), &table)?;
        let pts = |f: &dyn Fn(&kvtier_bench::cluster::LoadRow) -> f64| -> Vec<(f64, f64)> {
            loads.iter().filter(|r| f(r).is_finite()).map(|r| (r.nodes as f64 - 1.0, f(r))).collect()
        };
        let series = vec![
            Series {
                name: "local load (the node holding them)".into(),
                points: pts(&|r| r.local_gbps),
                markers_only: false,
            },
            Series {
                name: "through a node that holds none".into(),
                points: pts(&|r| r.remote_gbps),
                markers_only: false,
            },
            Series {
                name: "client straight to the owner".into(),
                points: pts(&|r| r.direct_gbps),
                markers_only: false,
            },
            Series { name: "loopback TCP, one stream".into(), points: pts(&|r| r.tcp_gbps), markers_only: false },
        ];
        let path = out.join("cluster_loads.png");
        plot::line_chart(
            &path,
            &Chart {
                title: "1 MiB loads by cluster size (nodes share 2 cores)",
                x_desc: "nodes",
                y_desc: "GB/s",
                log_x: false,
                log_y: false,
                series,
                x_names: Some(loads.iter().map(|r| format!("{} node(s)", r.nodes)).collect()),
            },
        )?;
        let path2 = out.join("cluster_trace.png");
        plot::line_chart(
            &path2,
            &Chart {
                title: "Trace over 3 nodes: prefix token hit rate (same total DRAM)",
                x_desc: "set-up",
                y_desc: "token hit rate",
                log_x: false,
                log_y: false,
                series: vec![Series {
                    name: "prefix token hit rate".into(),
                    points: replays
                        .iter()
                        .enumerate()
                        .map(|(i, r)| (i as f64, r.result.prefix_token_hit_rate))
                        .collect(),
                    markers_only: true,
                }],
                x_names: Some(replays.iter().map(|r| r.setup.clone()).collect()),
            },
        )?;
        eprintln!("plots: {} {}", path.display(), path2.display());
        std::fs::write(
            out.join("cluster.json"),
            serde_json::to_string_pretty(&json!({ "loads": loads, "replays": replays }))?,
        )?;
        return Ok(());
    }

    if all || a.what == What::Trace {
        let tcfg = if quick {
            TraceConfig { seed: a.seed, prefix_requests: 150, sessions: 8, turns: 3, docs: 48, ..Default::default() }
        } else {
            TraceConfig { seed: a.seed, prefix_requests: 600, sessions: 32, turns: 4, docs: 96, ..Default::default() }
        };
        let trace = Trace::generate(&tcfg);
        let scale = a.scale.unwrap_or(if quick { 1024 } else { 256 });
        let fractions: Vec<f64> = if quick { vec![0.25, 1.0] } else { vec![0.1, 0.25, 0.5, 1.0] };
        let bin = servers::find_kvtier(a.kvtier_bin.as_deref())?;
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
        let ms = models(&a.model)?;
        // The LRU model's hit rate depends on tokens and blocks only, not on the model's bytes.
        let ns0 = replay::replay_namespace(&ms[0], scale)?;
        let layout0 = replay::replay_layout(&ms[0], scale)?;
        let (docs0, _) = replay::working_set(&trace, &layout0);
        let curve: Vec<(f64, f64)> = [0.02, 0.05, 0.1, 0.175, 0.25, 0.375, 0.5, 0.75, 1.0, 1.5]
            .iter()
            .map(|&f| {
                (f, replay::lru_hit_rate(&trace, &ns0, ((f * docs0 as f64) / layout0.block_bytes() as f64) as usize))
            })
            .collect();
        let mut results = Vec::new();
        for (mi, m) in ms.iter().enumerate() {
            // The 70B-class model replays at the largest cache only in quick mode.
            let fr: Vec<f64> = if mi > 0 && quick { vec![1.0] } else { fractions.clone() };
            let layout = replay::replay_layout(m, scale)?;
            let (docs, sessions) = replay::working_set(&trace, &layout);
            for f in fr {
                let cap = (f * docs as f64) as u64 + (sessions as f64 / 0.85) as u64 + (16 << 20);
                let s = KvtierServer::start(&bin, &data_dir.join("kvtier-trace"), cap, &out.join("kvtier-trace.log"))?;
                let pb = bar(trace.events.len() as u64, "trace");
                pb.set_message(format!("{} cache {f}× docs", m.name));
                let cfg = ReplayConfig { model: *m, scale, gpu, link, cache_fraction: f, direct_to_owners: false };
                let r = rt.block_on(replay::replay(std::slice::from_ref(&s.grpc_addr), &trace, &cfg, cap, &pb))?;
                pb.finish_and_clear();
                drop(s);
                results.push(r);
            }
        }
        println!(
            "{}\nTrace: seed {}, {} replicas, {} documents (Zipf s={}), {} prefix requests, {} sessions × {} turns, contexts {}–{} tokens, {} events; replayed with bytes per token scaled 1/{scale} (DRAM cap likewise; bytes shown at full size). TTFT saved = prefill time of the hit on {} at {:.0}% MFU − its reload over {}.\n",
            report::trace_table(&results, &curve),
            tcfg.seed,
            tcfg.replicas,
            tcfg.docs,
            tcfg.zipf_s,
            tcfg.prefix_requests,
            tcfg.sessions,
            tcfg.turns,
            tcfg.min_ctx,
            tcfg.max_ctx,
            trace.events.len(),
            gpu.name,
            gpu.mfu * 100.0,
            link.name
        );
        json["trace"] = json!({ "config": tcfg, "scale": scale, "results": results, "lru_model": curve });
        let mut series = vec![Series {
            name: "LRU model (prefix requests only)".into(),
            points: curve.clone(),
            markers_only: false,
        }];
        for m in &ms {
            let pts: Vec<(f64, f64)> = results
                .iter()
                .filter(|r| r.model == m.name)
                .map(|r| (r.cache_fraction, r.prefix_token_hit_rate))
                .collect();
            series.push(Series { name: format!("kvtier measured, {}", m.name), points: pts, markers_only: true });
        }
        let path = out.join("trace_hit_rate.png");
        plot::line_chart(
            &path,
            &Chart {
                title: "Prefix token hit rate vs DRAM size",
                x_desc: "DRAM cap / distinct documents' KV",
                y_desc: "token hit rate",
                log_x: false,
                log_y: false,
                series,
                x_names: None,
            },
        )?;
        plots.push(path);
    }

    if all || a.what == What::Plan {
        let base = match a.model.as_str() {
            "both" => Model::LLAMA3_70B,
            s => Model::by_name(s).with_context(|| format!("unknown model {s:?}"))?,
        };
        let m = Model {
            name: if a.layers.is_some()
                || a.kv_heads.is_some()
                || a.heads.is_some()
                || a.head_dim.is_some()
                || a.params_b.is_some()
            {
                "custom"
            } else {
                base.name
            },
            params: a.params_b.map(|p| p * 1e9).unwrap_or(base.params),
            layers: a.layers.unwrap_or(base.layers),
            heads: a.heads.unwrap_or(base.heads),
            kv_heads: a.kv_heads.unwrap_or(base.kv_heads),
            head_dim: a.head_dim.unwrap_or(base.head_dim),
        };
        let codec =
            Codec::parse(&a.codec).with_context(|| format!("unknown codec {:?} (bf16, fp8, nvfp4)", a.codec))?;
        let p = model::plan(PlanInput {
            model: m,
            codec,
            gpu,
            hbm_kv_gb: a.hbm_gb,
            dram_gb: a.dram_gb,
            nvme_gb: a.nvme_gb,
            avg_context_tokens: a.avg_context,
            requests_per_s: a.rps,
            session_fraction: a.session_fraction,
            think_s: a.think_s,
        });
        println!("{}", report::plan_table(&p));
        json["plan"] = serde_json::to_value(&p)?;
        let ctx: Vec<f64> = (10..=20).map(|e| f64::from(1u32 << e)).collect();
        let mut series = vec![Series {
            name: format!("recompute on {}", gpu.name),
            points: ctx.iter().map(|&t| (t, gpu.prefill_seconds(&m, t))).collect(),
            markers_only: false,
        }];
        for l in Link::ALL {
            series.push(Series {
                name: format!("reload over {}", l.name),
                points: ctx.iter().map(|&t| (t, l.reload_seconds(t * m.kv_bytes_per_token(codec)))).collect(),
                markers_only: false,
            });
        }
        let path = out.join("plan_reload_vs_recompute.png");
        let title = format!("{} ({}): time to get the KV of a context back", m.name, codec.name());
        plot::line_chart(
            &path,
            &Chart {
                title: &title,
                x_desc: "context, tokens",
                y_desc: "seconds",
                log_x: true,
                log_y: true,
                series,
                x_names: None,
            },
        )?;
        plots.push(path);
    }

    let json_path = out.join("results.json");
    json["wall_s"] = json!(started.elapsed().as_secs_f64());
    std::fs::write(&json_path, serde_json::to_string_pretty(&json)?)?;
    let fonts = if plot::font_available() { "" } else { " (no TTF font found: plots have no text)" };
    println!(
        "Wrote {} and {} plot(s){fonts}: {} — {:.0} s in all.",
        json_path.display(),
        plots.len(),
        plots
            .iter()
            .map(|p| p.file_name().map(|f| f.to_string_lossy().to_string()).unwrap_or_default())
            .collect::<Vec<_>>()
            .join(", "),
        started.elapsed().as_secs_f64()
    );
    let _ = std::fs::remove_dir_all(data_dir.join("kvtier-blocks"));
    let _ = std::fs::remove_dir_all(data_dir.join("kvtier-trace"));
    Ok(())
}
