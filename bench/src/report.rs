//! Markdown tables for stdout and the README.

use crate::blocks::{Cell, RoundTrips};
use crate::limits::Limits;
use crate::model::Plan;
use crate::replay::ReplayResult;
use crate::stats::ratio;

pub fn f2(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.2}")
    } else {
        "—".into()
    }
}

fn f3(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.3}")
    } else {
        "—".into()
    }
}

pub fn size(b: usize) -> String {
    if b >= 1 << 20 {
        format!("{} MiB", b >> 20)
    } else {
        format!("{} KiB", b >> 10)
    }
}

/// Human bytes in powers of 1000 (GB) or 1024 below that.
pub fn bytes(b: f64) -> String {
    if b >= 1e12 {
        format!("{:.2} TB", b / 1e12)
    } else if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else {
        format!("{:.1} MB", b / 1e6)
    }
}

pub fn secs(s: f64) -> String {
    if !s.is_finite() {
        "—".into()
    } else if s.abs() >= 1.0 {
        format!("{s:.2} s")
    } else {
        format!("{:.1} ms", s * 1e3)
    }
}

pub fn limits_table(l: &Limits) -> String {
    let mut s = format!(
        "### Machine limits (GB/s, median of {} runs)\n\n| figure | GB/s | / memcpy 1 thread |\n|---|---|---|\n",
        l.runs
    );
    let rows = [
        ("memcpy, 1 thread".to_string(), l.memcpy_1),
        (format!("memcpy, {} threads", l.threads), l.memcpy_n),
        (format!("loopback TCP, 1 stream ({}: the ratios' baseline)", l.tcp_congestion), l.tcp),
        (format!("loopback TCP, 1 stream, not paced ({})", l.tcp_unpaced_congestion), l.tcp_unpaced),
        ("Unix socket, 1 stream".into(), l.unix),
        (format!("disk sequential write + fsync ({})", l.disk_dir.display()), l.disk_write),
        ("disk sequential read (page cache dropped)".into(), l.disk_read),
    ];
    for (name, v) in rows {
        s += &format!("| {name} | {} | {} |\n", f2(v), f2(ratio(v, l.memcpy_1)));
    }
    s
}

/// The same-node path from Python beside the peers and the TCP paths of the same run: what an
/// engine on the server's host gets (the vLLM and SGLang adapters register their host memory).
/// No goal marks: the goals are read over TCP, in the ratios table above.
fn samenode_ratios(sizes: &[usize], concs: &[usize], g: &dyn Fn(&str, &str, usize, usize) -> f64, tcp0: f64) -> String {
    let mut s = String::from(
        "### The same-node path from Python (blocks in `Client.alloc_buffer` memory; ratios, same run)\n\n\
         | block | conc | load / TCP | load / Python over TCP | load / LMCache | load / Redis GET | store / TCP | store / Python `store_keys` over TCP | store / LMCache PUT |\n\
         |---|---|---|---|---|---|---|---|---|\n",
    );
    for &size in sizes {
        for &c in concs {
            let tcp = match g("tcp", "load", size, c) {
                t if t.is_finite() => t,
                _ => tcp0,
            };
            let (ld, st) = (g("python-samenode", "load", size, c), g("python-samenode", "store", size, c));
            s += &format!(
                "| {} | {c} | {} | {} | {} | {} | {} | {} | {} |\n",
                crate::report::size(size),
                f2(ratio(ld, tcp)),
                f2(ratio(ld, g("python-keys", "load", size, c))),
                f2(ratio(ld, g("lmcache", "load", size, c))),
                f2(ratio(ld, g("redis", "load", size, c))),
                f2(ratio(st, tcp)),
                f2(ratio(st, g("python-keys", "store", size, c))),
                f2(ratio(st, g("lmcache", "store", size, c))),
            );
        }
    }
    s + "\n"
}

fn find<'a>(cells: &'a [Cell], system: &str, op: &str, size: usize, c: usize) -> Option<&'a Cell> {
    cells.iter().find(|x| x.system == system && x.op == op && x.block_bytes == size && x.concurrency == c)
}

/// One table per operation: kvtier beside Redis (plain and pipelined) and loopback TCP.
pub fn blocks_table(cells: &[Cell], tcp: f64, redis_note: Option<&str>, depth: usize) -> String {
    let mut sizes: Vec<usize> = cells.iter().map(|c| c.block_bytes).collect();
    sizes.sort();
    sizes.dedup();
    let mut concs: Vec<usize> = cells.iter().map(|c| c.concurrency).collect();
    concs.sort();
    concs.dedup();
    let piped = format!("redis-pipelined-{depth}");
    let mut s = String::new();
    for (op, verb) in [("store", "SET"), ("load", "GET")] {
        s += &format!(
            "### kvtier {op} vs Redis {verb} (GB/s; latency per op, ms; TCP = loopback TCP limit {} GB/s)\n\n| block | conc | kvtier GB/s | p50 | p99 | Redis GB/s | p50 | p99 | Redis pipelined×{depth} GB/s | kvtier/Redis | kvtier/Redis pipelined | kvtier/TCP |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
            f2(tcp)
        );
        for &size in &sizes {
            for &c in &concs {
                let k = find(cells, "kvtier", op, size, c);
                let r = find(cells, "redis", op, size, c);
                let p = find(cells, &piped, op, size, c);
                let g = |x: Option<&Cell>| x.map(|x| x.gb_per_s).unwrap_or(f64::NAN);
                let l =
                    |x: Option<&Cell>, p50: bool| x.map(|x| if p50 { x.p50_ms } else { x.p99_ms }).unwrap_or(f64::NAN);
                s += &format!(
                    "| {} | {c} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                    crate::report::size(size),
                    f2(g(k)),
                    f2(l(k, true)),
                    f2(l(k, false)),
                    f2(g(r)),
                    f2(l(r, true)),
                    f2(l(r, false)),
                    f2(g(p)),
                    f2(ratio(g(k), g(r))),
                    f2(ratio(g(k), g(p))),
                    f2(ratio(g(k), tcp)),
                );
            }
        }
        s += "\n";
    }
    if let Some(n) = redis_note {
        s += &format!("Redis: {n}\n");
    }
    s
}

pub fn trace_table(rs: &[ReplayResult], lru: &[(f64, f64)]) -> String {
    let mut s = String::from(
        "### Trace replay (prefix sharing across replicas + agent sessions)\n\n| model | DRAM cap (full size) | prefix token hit rate | LRU model | DRAM block hit rate | cross-replica hits | resumes hit | KV loaded | KV stored | prefill saved (GPU) | reload (modeled) | TTFT saved / request (mean, median) | cold TTFT mean | measured reload here |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rs {
        let lru_at = lru.iter().find(|(f, _)| (*f - r.cache_fraction).abs() < 1e-9).map(|x| x.1).unwrap_or(f64::NAN);
        let dram = r.tiers.iter().find(|t| t.tier.to_ascii_lowercase().contains("dram")).or(r.tiers.first());
        s += &format!(
            "| {} | {} ({}× docs) | {} | {} | {} | {} / {} | {} / {} | {} | {} | {} on {} | {} over {} | {}, {} | {} | {} GB/s |\n",
            r.model,
            bytes(r.dram_capacity_full_bytes),
            r.cache_fraction,
            f3(r.prefix_token_hit_rate),
            f3(lru_at),
            dram.map(|t| f3(t.hit_rate)).unwrap_or_else(|| "—".into()),
            r.cross_replica_hits,
            r.prefix_requests,
            r.resume_hits,
            r.resumes,
            bytes(r.bytes_loaded),
            bytes(r.bytes_stored),
            secs(r.gpu_seconds_saved),
            r.gpu,
            secs(r.reload_seconds_modeled),
            r.link.split(" (").next().unwrap_or(r.link),
            secs(r.ttft_saved_mean_s),
            secs(r.ttft_saved_median_s),
            secs(r.ttft_cold_mean_s),
            f2(r.measured_load_gb_per_s),
        );
    }
    s
}

pub fn plan_table(p: &Plan) -> String {
    let i = &p.input;
    let mut s = format!(
        "### Capacity plan: {} ({} layers, {} KV heads × {}), {}, on {} at {:.0}% MFU\n\nKV per token: {} bytes; one {:.0}-token context: {}. Traffic: {} req/s, {:.0}% agent turns, {} s think time → {:.0} sessions parked at once ({}), {} GB/s of reload.\n\n| tier | capacity | tokens | sessions of {:.0} tokens |\n|---|---|---|---|\n",
        i.model.name,
        i.model.layers,
        i.model.kv_heads,
        i.model.head_dim,
        i.codec.name(),
        i.gpu.name,
        i.gpu.mfu * 100.0,
        p.kv_bytes_per_token,
        i.avg_context_tokens,
        bytes(p.bytes_per_avg_context),
        i.requests_per_s,
        i.session_fraction * 100.0,
        i.think_s,
        p.parked_sessions,
        bytes(p.parked_gb * 1e9),
        f2(p.reload_gb_per_s),
        i.avg_context_tokens,
    );
    for t in &p.tiers {
        s += &format!("| {} | {} | {:.3e} | {:.0} |\n", t.tier, bytes(t.capacity_gb * 1e9), t.tokens, t.sessions);
    }
    s += &format!(
        "\n| link (assumed effective GB/s) | GB/s | reload beats recompute from | reload {:.0} tokens | recompute {:.0} tokens | link busy at this traffic |\n|---|---|---|---|---|---|\n",
        i.avg_context_tokens, i.avg_context_tokens
    );
    for l in &p.links {
        let from = if l.crossover_tokens <= 0.0 {
            "any length".to_string()
        } else {
            format!("{:.0} tokens", l.crossover_tokens)
        };
        s += &format!(
            "| {} | {} | {} | {} | {} | {:.0}% |\n",
            l.link,
            l.gb_per_s,
            from,
            secs(l.reload_s),
            secs(l.recompute_s),
            l.utilisation * 100.0
        );
    }
    s
}

/// `median [min–max]` of a cell's GB/s, or a dash.
fn spread_cell(c: Option<&Cell>) -> String {
    match c {
        Some(c) if c.gb_per_s.is_finite() => {
            if c.gb_per_s_min < c.gb_per_s_max {
                format!("{} [{}–{}]", f2(c.gb_per_s), f2(c.gb_per_s_min), f2(c.gb_per_s_max))
            } else {
                f2(c.gb_per_s)
            }
        }
        _ => "—".into(),
    }
}

/// "server + client" ms of CPU per GB of a cell, `—` where it has no figure.
fn cpu_cell(c: Option<&Cell>) -> String {
    let ms = |x: Option<f64>| x.map_or("—".to_string(), |v| format!("{v:.0}"));
    match c {
        Some(c) if c.server_cpu_ms_per_gb.is_some() || c.client_cpu_ms_per_gb.is_some() => {
            format!("{} + {}", ms(c.server_cpu_ms_per_gb), ms(c.client_cpu_ms_per_gb))
        }
        _ => "—".into(),
    }
}

/// What each system's server and client spend per GB moved, loads then stores, and the other
/// servers' CPU per GB as a multiple of kvtier's (fused `load_keys_into` / `store_keys`).
fn cpu_tables(cells: &[Cell], sizes: &[usize], concs: &[usize]) -> String {
    let sys = [
        ("engine-fused", "kvtier fused (Rust)"),
        ("engine-fused-x8", "kvtier fused, 8 blocks/call"),
        ("python", "kvtier Python"),
        ("lmcache", "LMCache"),
        ("redis", "Redis (Rust client)"),
    ];
    let mut s = String::from(
        "\n### CPU per GB moved (ms of CPU time per GB: server + client, medians of the runs)\n\nThe kernel's per-process CPU clocks (user + system, every thread), read before and after each phase; client = the bench's process for the Rust paths, the Python driver's for the Python client and LMCache. On 2 shared cores a concurrent cell's GB/s is bound by the CPU that client, server and kernel need per byte: this is that need.\n\n",
    );
    for op in ["load", "store"] {
        s += "| block | conc | op |";
        for (_, name) in &sys {
            s += &format!(" {name} |");
        }
        s += " LMCache server / kvtier server | Redis server / kvtier server | LMCache total / kvtier total | Redis total / kvtier total |\n|---|---|---|";
        s += &"---|".repeat(sys.len() + 4);
        s += "\n";
        for &size in sizes {
            for &c in concs {
                let f = |sys: &str| find(cells, sys, op, size, c);
                let server = |sys: &str| f(sys).and_then(|x| x.server_cpu_ms_per_gb).unwrap_or(f64::NAN);
                let total = |sys: &str| {
                    f(sys).and_then(|x| Some(x.server_cpu_ms_per_gb? + x.client_cpu_ms_per_gb?)).unwrap_or(f64::NAN)
                };
                s += &format!("| {} | {c} | {op} |", crate::report::size(size));
                for (name, _) in &sys {
                    s += &format!(" {} |", cpu_cell(f(name)));
                }
                s += &format!(
                    " {} | {} | {} | {} |\n",
                    f2(ratio(server("lmcache"), server("engine-fused"))),
                    f2(ratio(server("redis"), server("engine-fused"))),
                    f2(ratio(total("lmcache"), total("engine-fused"))),
                    f2(ratio(total("redis"), total("engine-fused"))),
                );
            }
        }
        s += "\n";
    }
    s
}

/// A ratio against a goal: `1.23 ✓` met, `0.80 ✗` not, the bare ratio when there is no goal.
fn vs_goal(r: f64, goal: Option<f64>) -> String {
    match goal {
        Some(g) if r.is_finite() => format!("{} {}", f2(r), if r >= g { "✓" } else { "✗" }),
        _ => f2(r),
    }
}

/// The engine's view, for the README: every path and peer per (size, concurrency) as median
/// GB/s with the runs' range, then the ratios the issue sets goals on, then the gRPC round trips.
pub fn wire_tables(cells: &[Cell], l: &crate::limits::Limits, rt: &RoundTrips, notes: &[String]) -> String {
    let mut sizes: Vec<usize> = cells.iter().map(|c| c.block_bytes).collect();
    sizes.sort();
    sizes.dedup();
    let mut concs: Vec<usize> = cells.iter().map(|c| c.concurrency).collect();
    concs.sort();
    concs.dedup();
    let g = |sys: &str, op: &str, size: usize, c: usize| {
        find(cells, sys, op, size, c).map(|x| x.gb_per_s).unwrap_or(f64::NAN)
    };
    let mut s = format!(
        "### What an engine gets: loads (GB/s, median [slowest–fastest] of {} runs)\n\nLoopback TCP, 1 stream, at the start: {} GB/s [{}–{}]; memcpy 1 thread: {} GB/s. The `TCP` column: one stream sampled before every run of every phase of that cell (the ratios' baseline).\n\n",
        l.runs,
        f2(l.tcp),
        f2(l.tcp_min),
        f2(l.tcp_max),
        f2(l.memcpy_1)
    );
    let load_sys = [
        ("tcp", "TCP"),
        ("tcp-rr", "TCP, 1 block per round trip"),
        ("kvtier", "Rust `load_keys` (raw)"),
        ("engine-old", "lookup + `load_keys` + copy"),
        ("engine-fused", "fused `load_keys_into`"),
        ("engine-parked", "fused, parked"),
        ("engine-fused-x8", "fused, 8 blocks/call"),
        ("engine-fp8-x8", "fp8, 8 blocks/call (bf16 bytes)"),
        ("python", "Python `load_into`"),
        ("python-keys", "Python `load_keys_into`"),
        ("python-samenode", "Python `load_keys_into`, same node"),
        ("lmcache", "LMCache server"),
        ("redis", "Redis GET (Rust)"),
        ("redis-benchmark", "redis-benchmark GET"),
    ];
    let store_sys = [
        ("tcp", "TCP"),
        ("tcp-rr", "TCP, 1 block per round trip"),
        ("kvtier", "Rust `store_frames`"),
        ("engine-fused", "Rust `store_keys`"),
        ("engine-fused-x8", "`store_keys`, 8 blocks/call"),
        ("engine-fp8-x8", "fp8 `store_keys`, 8 blocks/call (bf16 bytes)"),
        ("python", "Python `store`"),
        ("python-keys", "Python `store_keys`"),
        ("python-samenode", "Python `store_keys`, same node"),
        ("lmcache", "LMCache PUT"),
        ("redis", "Redis SET (Rust)"),
        ("redis-benchmark", "redis-benchmark SET"),
    ];
    for (op, systems) in [("load", &load_sys[..]), ("store", &store_sys[..])] {
        if op == "store" {
            s += &format!("### Stores (GB/s, median [slowest–fastest] of {} runs)\n\n", l.runs);
        }
        s += "| block | conc |";
        for (_, name) in systems {
            s += &format!(" {name} |");
        }
        s += "\n|---|---|";
        s += &"---|".repeat(systems.len());
        s += "\n";
        for &size in &sizes {
            for &c in &concs {
                s += &format!("| {} | {c} |", crate::report::size(size));
                for (sys, _) in systems {
                    // TCP is one figure for both directions.
                    let op = if *sys == "tcp" { "load" } else { op };
                    s += &format!(" {} |", spread_cell(find(cells, sys, op, size, c)));
                }
                s += "\n";
            }
        }
        s += "\n";
    }
    s += "### Ratios (same run; ✓/✗ against the issue's goals)\n\n| block | conc | fused / TCP (≥0.85 at 1 MiB ×1) | Python / TCP (≥0.85 at 1 MiB ×1) | fused / old engine path | fused / LMCache (≥1.5 at 1 MiB) | Python / LMCache | fused / Redis GET (≥1.5 at 1 MiB, ≥2 at 64 KiB) | Python / Redis GET | fused / redis-benchmark GET | raw Rust / TCP | store_keys / TCP (≥0.8 at 1 MiB ×1) | Python store / TCP | fp8 / raw KV tokens/s, load ×8 (≥1.8 at 1 MiB) | fp8 / raw, store ×8 | fused / TCP round trips | store_keys / TCP round trips |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
    for &size in &sizes {
        for &c in &concs {
            let mib = size == 1 << 20;
            let one = mib && c == 1;
            let fused = g("engine-fused", "load", size, c);
            // This cell's TCP samples, else the figure from the start of the run.
            let tcp = match g("tcp", "load", size, c) {
                t if t.is_finite() => t,
                _ => l.tcp,
            };
            let py = g("python", "load", size, c);
            let redis_goal = if mib {
                Some(1.5)
            } else if size == 64 << 10 {
                Some(2.0)
            } else {
                None
            };
            s += &format!(
                "| {} | {c} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                crate::report::size(size),
                vs_goal(ratio(fused, tcp), one.then_some(0.85)),
                vs_goal(ratio(py, tcp), one.then_some(0.85)),
                f2(ratio(fused, g("engine-old", "load", size, c))),
                vs_goal(ratio(fused, g("lmcache", "load", size, c)), mib.then_some(1.5)),
                vs_goal(ratio(py, g("lmcache", "load", size, c)), mib.then_some(1.5)),
                vs_goal(ratio(fused, g("redis", "load", size, c)), redis_goal),
                vs_goal(ratio(py, g("redis", "load", size, c)), redis_goal),
                f2(ratio(fused, g("redis-benchmark", "load", size, c))),
                f2(ratio(g("kvtier", "load", size, c), tcp)),
                vs_goal(ratio(g("engine-fused", "store", size, c), tcp), one.then_some(0.8)),
                vs_goal(ratio(g("python", "store", size, c), tcp), one.then_some(0.8)),
                vs_goal(
                    ratio(g("engine-fp8-x8", "load", size, c), g("engine-fused-x8", "load", size, c)),
                    mib.then_some(1.8)
                ),
                f2(ratio(g("engine-fp8-x8", "store", size, c), g("engine-fused-x8", "store", size, c))),
                f2(ratio(fused, g("tcp-rr", "load", size, c))),
                f2(ratio(g("engine-fused", "store", size, c), g("tcp-rr", "store", size, c))),
            );
        }
    }
    if cells.iter().any(|x| x.system == "python-samenode") {
        s += &samenode_ratios(&sizes, &concs, &g, l.tcp);
    }
    if cells.iter().any(|x| x.server_cpu_ms_per_gb.is_some()) {
        s += &cpu_tables(cells, &sizes, &concs);
    }
    s += "\n### Per-operation latency, loads (ms, p50 / p99 over every run; 8 blocks/call: per call)\n\n| block | conc |";
    let load_sys = &load_sys[1..];
    for (_, name) in load_sys {
        s += &format!(" {name} |");
    }
    s += "\n|---|---|";
    s += &"---|".repeat(load_sys.len());
    s += "\n";
    for &size in &sizes {
        for &c in &concs {
            s += &format!("| {} | {c} |", crate::report::size(size));
            for (sys, _) in load_sys {
                match find(cells, sys, "load", size, c) {
                    Some(x) => s += &format!(" {} / {} |", f2(x.p50_ms), f2(x.p99_ms)),
                    None => s += " — |",
                }
            }
            s += "\n";
        }
    }
    s += &format!(
        "\n### gRPC round trips ({} each; {}-block session of {} blocks)\n\n| call | p50 ms | p99 ms |\n|---|---|---|\n| Lookup of {} keys | {} | {} |\n| ResumeSession (manifest only) | {} | {} |\n| `resume` (manifest + blocks over the data plane) | {} | {} |\n\n",
        rt.n,
        rt.blocks,
        crate::report::size(rt.block_bytes),
        rt.blocks,
        f3(rt.lookup_p50_ms),
        f3(rt.lookup_p99_ms),
        f3(rt.resume_manifest_p50_ms),
        f3(rt.resume_manifest_p99_ms),
        f3(rt.resume_full_p50_ms),
        f3(rt.resume_full_p99_ms),
    );
    for n in notes {
        s += &format!("{n}\n\n");
    }
    s
}
