//! `kvtier-bench tls`: what TLS costs on the data plane. Two real `kvtier` processes in one run —
//! one plain, one with `[tls]` (certificates from `kvtier cert`, a client certificate naming the
//! tenant) — loaded and stored through the same client calls (`load_keys_into`, `store_keys`),
//! beside a loopback TCP stream sampled before each run. GB/s is the median over runs; p50/p99
//! are per call, pooled over runs.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{ensure, Context};
use bytes::Bytes;
use kvtier_client::{ClientConfig, ClientTls, ItemStatus, KvClient};
use kvtier_proto::{BlockKey, HashScheme, Namespace};

use crate::blocks::layout_for;
use crate::samenode::{CellsConfig, Row};
use crate::servers::KvtierServer;
use crate::stats::{median, percentile, ratio};

/// Bytes of stored blocks the loads cycle over.
const WORKING_SET: usize = 64 << 20;

fn cert(bin: &Path, args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(bin).arg("cert").args(args).output().context("running kvtier cert")?;
    ensure!(out.status.success(), "kvtier cert {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    Ok(())
}

fn key(size: usize, tag: usize, i: usize) -> BlockKey {
    let mut k = [0u8; 24];
    k[..8].copy_from_slice(&(size as u64).to_le_bytes());
    k[8..16].copy_from_slice(&(tag as u64).to_le_bytes());
    k[16..].copy_from_slice(&(i as u64).to_le_bytes());
    BlockKey(*blake3::hash(&k).as_bytes())
}

pub fn run(bin: &Path, dir: &Path, log_dir: &Path, cfg: &CellsConfig) -> anyhow::Result<Vec<Row>> {
    let pki = dir.join("pki");
    let _ = std::fs::remove_dir_all(&pki);
    let p = pki.to_str().context("a UTF-8 path")?;
    cert(bin, &["ca", "--dir", p])?;
    cert(bin, &["node", "--dir", p, "--name", "node", "--host", "127.0.0.1"])?;
    cert(bin, &["client", "--dir", p, "--name", "bench"])?;
    let toml = dir.join("tls.toml");
    std::fs::write(
        &toml,
        format!(
            "[tls]\ncert = \"{p}/node.pem\"\nkey = \"{p}/node.key\"\nclient_ca = \"{p}/ca.pem\"\n\n\
             [[tenants]]\nname = \"bench\"\ncert_names = [\"bench\"]\n"
        ),
    )?;
    let dram = (WORKING_SET * 2 + cfg.bytes_per_cell * 2 + (256 << 20)) as u64;
    let plain = KvtierServer::start(bin, &dir.join("plain"), dram, &log_dir.join("tls-plain.log"))?;
    let toml_s = toml.to_str().context("a UTF-8 path")?;
    let tls =
        KvtierServer::start_with(bin, &dir.join("tls"), dram, &log_dir.join("tls-tls.log"), &["--config", toml_s])?;
    let client_tls =
        ClientTls::from_files(&pki.join("ca.pem"), Some((&pki.join("bench.pem"), &pki.join("bench.key"))))?;
    let max_c = cfg.concurrency.iter().copied().max().unwrap_or(1);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(max_c.clamp(2, 8)).enable_all().build()?;
    rt.block_on(async {
        let ccfg = |tls| ClientConfig { data_connections: max_c.max(4), tls, ..ClientConfig::default() };
        let clients = [
            ("plain TCP", KvClient::connect(&plain.grpc_addr, ccfg(None)).await?),
            ("TLS (client certificate)", KvClient::connect(&tls.grpc_addr, ccfg(Some(client_tls))).await?),
        ];
        measure(&clients, cfg).await
    })
}

type Acc = (Vec<f64>, Vec<f64>);

async fn measure(clients: &[(&'static str, KvClient); 2], cfg: &CellsConfig) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    for &size in &cfg.sizes {
        let n = WORKING_SET / size;
        let mut src = vec![0u8; WORKING_SET];
        for (i, b) in src.iter_mut().enumerate() {
            *b = (i.wrapping_mul(131) % 251) as u8;
        }
        let src = Bytes::from(src);
        let mut nss = Vec::new();
        for (_, client) in clients {
            let ns = client
                .register(Namespace::new("bench", format!("tls-{size}"), layout_for(size), HashScheme::Blake3, b""))
                .await?;
            let keys: Vec<BlockKey> = (0..n).map(|i| key(size, 0, i)).collect();
            for chunk in (0..n).collect::<Vec<_>>().chunks(64) {
                let blocks: Vec<Vec<Bytes>> =
                    chunk.iter().map(|&i| vec![src.slice(i * size..(i + 1) * size)]).collect();
                let st = client.store_keys(&ns, &keys[chunk[0]..chunk[0] + chunk.len()], &blocks).await?;
                ensure!(st.iter().all(|s| s.is_held()), "seeding: {st:?}");
            }
            nss.push((ns, keys));
        }
        for &c in &cfg.concurrency {
            let ops = (cfg.bytes_per_cell / (size * c)).max(4);
            let bytes = ops * c * size;
            // [path][op]: load, store; and the TCP limit sampled before each run.
            let mut acc: [[Acc; 2]; 2] = Default::default();
            let mut tcp = Vec::new();
            for run in 0..cfg.runs {
                tcp.push(tokio::task::block_in_place(|| crate::limits::tcp_gbps(cfg.bytes_per_cell.min(256 << 20)))?);
                let src = &src;
                for (pi, ((_, client), (ns, keys))) in clients.iter().zip(&nss).enumerate() {
                    // Each task's destination, written (its pages faulted in) before the clock starts.
                    let mut dsts: Vec<Vec<u8>> = (0..c).map(|_| vec![1u8; size]).collect();
                    let t0 = Instant::now();
                    let lat = futures::future::try_join_all(dsts.iter_mut().enumerate().map(|(t, dst)| async move {
                        let mut lat = Vec::with_capacity(ops);
                        for op in 0..ops {
                            let i = (op * c + t) % n;
                            let s = Instant::now();
                            let ok = client.load_keys_into(ns, &keys[i..=i], &mut [vec![&mut dst[..]]], true).await?;
                            lat.push(s.elapsed().as_secs_f64());
                            ensure!(ok == [true], "block {i} did not load");
                        }
                        ensure!(dst[..] == src[((ops - 1) * c + t) % n * size..][..size], "wrong bytes");
                        Ok::<_, anyhow::Error>(lat)
                    }))
                    .await?;
                    acc[pi][0].0.push(bytes as f64 / t0.elapsed().as_secs_f64() / 1e9);
                    acc[pi][0].1.extend(lat.concat());
                    let t0 = Instant::now();
                    let lat = futures::future::try_join_all((0..c).map(|t| async move {
                        let mut lat = Vec::with_capacity(ops);
                        for op in 0..ops {
                            let i = (op * c + t) % n;
                            let k = [key(size, 1 + c * 100_000 + run * 1000 + t, op)];
                            let s = Instant::now();
                            let st = client.store_keys(ns, &k, &[vec![src.slice(i * size..(i + 1) * size)]]).await?;
                            lat.push(s.elapsed().as_secs_f64());
                            ensure!(st == [ItemStatus::Ok], "store {op}: {st:?}");
                        }
                        Ok::<_, anyhow::Error>(lat)
                    }))
                    .await?;
                    acc[pi][1].0.push(bytes as f64 / t0.elapsed().as_secs_f64() / 1e9);
                    acc[pi][1].1.extend(lat.concat());
                }
            }
            rows.push(Row {
                size,
                concurrency: c,
                op: "tcp",
                path: "loopback TCP, one stream",
                gbps: median(tcp.clone()),
                gbps_runs: tcp,
                p50_us: f64::NAN,
                p99_us: f64::NAN,
            });
            for (pi, path_acc) in acc.into_iter().enumerate() {
                for (oi, (g, lat)) in path_acc.into_iter().enumerate() {
                    rows.push(Row {
                        size,
                        concurrency: c,
                        op: ["load", "store"][oi],
                        path: clients[pi].0,
                        gbps: median(g.clone()),
                        gbps_runs: g,
                        p50_us: percentile(&lat, 50.0) * 1e6,
                        p99_us: percentile(&lat, 99.0) * 1e6,
                    });
                }
            }
        }
    }
    Ok(rows)
}

/// A markdown table: GB/s, its ratio to the plain path of the same op and cell and to the TCP
/// limit of that cell, and per-call latency.
pub fn table(rows: &[Row]) -> String {
    let mut s = String::from(
        "| block | conc | op | path | GB/s (runs) | × plain | × TCP | p50 µs | p99 µs |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    let fmt = |x: f64| if x.is_finite() { format!("{x:.2}") } else { "—".into() };
    for r in rows.iter().filter(|r| r.op != "tcp") {
        let same = |m: &&Row| m.size == r.size && m.concurrency == r.concurrency;
        let plain =
            rows.iter().filter(same).find(|m| m.op == r.op && m.path == "plain TCP").map_or(f64::NAN, |m| m.gbps);
        let tcp = rows.iter().filter(same).find(|m| m.op == "tcp").map_or(f64::NAN, |m| m.gbps);
        let runs: Vec<String> = r.gbps_runs.iter().map(|g| format!("{g:.2}")).collect();
        s.push_str(&format!(
            "| {} | {} | {} | {} | **{:.2}** ({}) | {} | {} | {:.0} | {:.0} |\n",
            crate::report::size(r.size),
            r.concurrency,
            r.op,
            r.path,
            r.gbps,
            runs.join(", "),
            fmt(ratio(r.gbps, plain)),
            fmt(ratio(r.gbps, tcp)),
            r.p50_us,
            r.p99_us
        ));
    }
    s
}
