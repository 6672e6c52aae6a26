//! Remote load through the G4 peer tier beside a local load and raw loopback TCP, same run:
//! `cargo build --release --bins && cargo run --release -p kvtier-tests --example peer_load`
//! (needs `redis-server`). Two real nodes, 1 MiB blocks, `peer_cache = false` so every remote load
//! crosses nodes; medians of 5 runs. Three clusters one after the other: plain TCP between the
//! nodes, TLS over TCP, and QUIC (`peer_transport = "quic"`, TLS 1.3 inside) — QUIC's fair peer is
//! TLS over TCP. Not a test: figures depend on the machine.

use std::time::{Duration, Instant};

use kvtier_proto::{BlockKey, DType, KvLayout};
use kvtier_tests::redis::Redis;
use kvtier_tests::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BLOCKS: usize = 256;

const TOKEN: &str = "bench-operator-token-0001";

#[derive(Clone, Copy, Debug, PartialEq)]
enum Between {
    Tcp,
    Tls,
    Quic,
}

/// A CA and a node certificate for 127.0.0.1 in `dir` (`kvtier cert`).
fn pki(dir: &std::path::Path) {
    for args in [&["ca"][..], &["node", "--name", "node", "--host", "127.0.0.1"][..]] {
        let out = std::process::Command::new(kvtier_bin())
            .arg("cert")
            .args(args)
            .arg("--dir")
            .arg(dir)
            .output()
            .expect("kvtier cert");
        assert!(out.status.success(), "kvtier cert: {}", String::from_utf8_lossy(&out.stderr));
    }
}

fn node(redis: &Redis, dir: &std::path::Path, id: &str, between: Between) -> ServerProcess {
    let cfg = dir.join(format!("{id}.toml"));
    let mut toml = format!(
        "auth_token = \"{TOKEN}\"\ncluster = \"{}\"\nnode_id = \"{id}\"\npeer_cache = false\npeer_timeout = \"10s\"\n",
        redis.url()
    );
    if between == Between::Quic {
        toml.push_str("peer_transport = \"quic\"\n");
    }
    if between != Between::Tcp {
        let p = |f: &str| dir.join(f).display().to_string();
        toml.push_str(&format!(
            "\n[tls]\ncert = \"{}\"\nkey = \"{}\"\nclient_ca = \"{}\"\n",
            p("node.pem"),
            p("node.key"),
            p("ca.pem")
        ));
    }
    std::fs::write(&cfg, toml).unwrap();
    ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "1GiB"])
}

async fn client(node: &ServerProcess, dir: &std::path::Path, between: Between) -> kvtier_client::KvClient {
    let tls = (between != Between::Tcp).then(|| {
        kvtier_client::ClientTls::from_files(
            &dir.join("ca.pem"),
            Some((dir.join("node.pem").as_path(), dir.join("node.key").as_path())),
        )
        .unwrap()
    });
    let cfg = kvtier_client::ClientConfig { tls, auth_token: Some(TOKEN.into()), ..Default::default() };
    kvtier_client::KvClient::connect(&node.grpc_addr(), cfg).await.expect("connect")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// GB/s of one stream writing `bytes` through loopback TCP in 1 MiB writes.
async fn loopback(bytes: usize) -> f64 {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let reader = tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut buf = vec![0u8; 1 << 20];
        let mut n = 0;
        while n < bytes {
            n += s.read(&mut buf).await.unwrap();
        }
    });
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.set_nodelay(true).unwrap();
    let chunk = vec![7u8; 1 << 20];
    let t = Instant::now();
    for _ in 0..bytes >> 20 {
        s.write_all(&chunk).await.unwrap();
    }
    reader.await.unwrap();
    bytes as f64 / t.elapsed().as_secs_f64() / 1e9
}

#[tokio::main]
async fn main() {
    let mut rows = Vec::new();
    for between in [Between::Tcp, Between::Tls, Between::Quic] {
        rows.push((between, run(between).await));
    }
    println!("| between the nodes | local load GB/s | remote load GB/s | remote / local | loopback TCP GB/s | remote / TCP |");
    println!("|---|---|---|---|---|---|");
    for (b, (n, l, p, t)) in &rows {
        println!("| {b:?} ({n} x 1 MiB) | {l:.2} | {p:.2} | {:.2}x | {t:.2} | {:.2}x |", p / l, p / t);
    }
    let remote = |b: Between| rows.iter().find(|r| r.0 == b).map(|r| r.1 .2).unwrap_or(f64::NAN);
    println!("QUIC / TLS over TCP, remote loads: {:.2}x", remote(Between::Quic) / remote(Between::Tls));
}

/// (blocks, local GB/s, remote GB/s, loopback TCP GB/s): medians of 5 runs.
async fn run(between: Between) -> (usize, f64, f64, f64) {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    if between != Between::Tcp {
        pki(dir.path());
    }
    let (n1, n2) = (node(&redis, dir.path(), "n1", between), node(&redis, dir.path(), "n2", between));
    until_members([&n1, &n2], 2);
    let layout = KvLayout::new(8, 8, 128, DType::Bf16, 32); // 1 MiB blocks
    let spec = namespace("bench", b"bench", layout);
    let (c1, c2) = (client(&n1, dir.path(), between).await, client(&n2, dir.path(), between).await);
    let ns1 = c1.register(spec.clone()).await.unwrap();
    let ns2 = c2.register(spec).await.unwrap();
    let toks = tokens(9, BLOCKS * 32);
    let payloads = full_block_payloads(&ns1, &toks);
    c1.store(&ns1, &toks, &payloads).await.unwrap().ok().unwrap();
    // Forwarding to n2 (the owner of about half the blocks) runs after the store: wait until
    // n1's count of forwarded blocks stops moving.
    let mut last = -1.0;
    for _ in 0..60 {
        std::thread::sleep(Duration::from_millis(500));
        let now = metric(&n1.scrape(), "kvtier_peer_forwarded_blocks_total", &[]);
        if now > 0.0 && now == last {
            break;
        }
        last = now;
    }
    // Blocks n2 doesn't hold itself (a peer's EXISTS: n2's own tiers, not the cluster's): every
    // load of them through n2 goes to n1.
    let keys = ns1.keys(&toks);
    let held = c2.peer_exists_keys(&ns2, &keys).await.unwrap();
    let remote: Vec<BlockKey> = keys.iter().zip(&held).filter(|(_, h)| !**h).map(|(k, _)| *k).collect();
    let bytes = remote.len() as f64 * layout.block_bytes() as f64;
    let (mut local, mut peer, mut tcp) = (vec![], vec![], vec![]);
    for _ in 0..5 {
        let t = Instant::now();
        let got = c1.load_keys(&ns1, &remote).await.unwrap();
        local.push(bytes / t.elapsed().as_secs_f64() / 1e9);
        assert!(got.iter().all(Option::is_some));
        let t = Instant::now();
        let got = c2.load_keys(&ns2, &remote).await.unwrap();
        peer.push(bytes / t.elapsed().as_secs_f64() / 1e9);
        assert!(got.iter().all(Option::is_some), "remote load missed");
        tcp.push(loopback(remote.len() << 20).await);
    }
    if between == Between::Quic {
        assert!(metric(&n1.scrape(), "kvtier_quic_streams_total", &[]) >= 1.0, "the peer load went over QUIC");
    }
    (remote.len(), median(local), median(peer), median(tcp))
}
