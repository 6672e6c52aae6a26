//! `kvtier-bench`: measures kvtier beside the machine's limits in one run and prints medians and
//! ratios. `kvtier-bench dataplane [--blocks N] [--runs R] [--connections C]`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use anyhow::Context;
use bytes::Bytes;
use kvtier_bench::{gbps, median};
use kvtier_client::{ClientConfig, KvClient};
use kvtier_proto::{DType, HashScheme, KvLayout, Namespace};
use kvtier_server::config::{ByteSize, ServerConfig};

struct Args {
    blocks: usize,
    runs: usize,
    connections: usize,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut a = Args { blocks: 256, runs: 5, connections: 4 };
    let mut it = std::env::args().skip(1);
    match it.next().as_deref() {
        Some("dataplane") => {}
        other => anyhow::bail!("usage: kvtier-bench dataplane [--blocks N] [--runs R] [--connections C] (got {other:?})"),
    }
    while let Some(flag) = it.next() {
        let v: usize = it.next().context("flag needs a value")?.parse().context("not a number")?;
        match flag.as_str() {
            "--blocks" => a.blocks = v,
            "--runs" => a.runs = v,
            "--connections" => a.connections = v,
            other => anyhow::bail!("unknown flag {other}"),
        }
    }
    Ok(a)
}

const MIB: usize = 1 << 20;

fn memcpy_gbps(total: usize) -> f64 {
    let src = vec![7u8; MIB];
    let mut dst = vec![0u8; MIB];
    gbps(total as u64, || {
        for _ in 0..total / MIB {
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&mut dst);
        }
    })
}

/// One sender thread, one receiver thread, 1 MiB writes over loopback TCP.
fn raw_tcp_gbps(total: usize) -> anyhow::Result<f64> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    let rx = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = l.accept()?;
        let mut buf = vec![0u8; MIB];
        let mut left = total;
        while left > 0 {
            let n = s.read(&mut buf)?;
            if n == 0 {
                break;
            }
            left -= n.min(left);
        }
        s.write_all(b"k")
    });
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    let buf = vec![1u8; MIB];
    let t = Instant::now();
    for _ in 0..total / MIB {
        s.write_all(&buf)?;
    }
    let mut ack = [0u8; 1];
    s.read_exact(&mut ack)?;
    let secs = t.elapsed().as_secs_f64();
    rx.join().map_err(|_| anyhow::anyhow!("receiver panicked"))??;
    Ok(total as f64 / secs / 1e9)
}

fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    let total = args.blocks * MIB;

    // The server runs on its own runtime, as a separate process would.
    let server_rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let data_dir = std::env::temp_dir().join(format!("kvtier-bench-{}", std::process::id()));
    let cfg = ServerConfig {
        listen: "127.0.0.1:0".parse()?,
        data_listen: "127.0.0.1:0".parse()?,
        metrics_listen: None,
        data_dir: data_dir.clone(),
        dram_capacity: ByteSize((total as u64) * 2 + (256 << 20)),
        ..Default::default()
    };
    let server = server_rt.block_on(kvtier_server::start(cfg, None))?;
    let addr = server.grpc_addr.to_string();

    let client_rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    // Llama-3-8B-like: 32 layers x 8 KV heads x 128 x bf16 = 128 KiB per token; 8 tokens = 1 MiB.
    let layout = KvLayout::new(32, 8, 128, DType::Bf16, 8);
    assert_eq!(layout.block_bytes() as usize, MIB);
    let (store, load) = client_rt.block_on(async {
        let client = KvClient::connect(&addr, ClientConfig { data_connections: args.connections, max_batch_blocks: 16, ..Default::default() }).await?;
        let ns = client.register(Namespace::new("bench", "llama-3-8b", layout, HashScheme::Blake3, b"")).await?;
        let mut store = Vec::new();
        let mut load = Vec::new();
        for run in 0..args.runs {
            let tokens: Vec<u32> = (0..(args.blocks * 8) as u32).map(|i| i.wrapping_mul(2654435761) ^ run as u32).collect();
            let blocks: Vec<Bytes> = (0..args.blocks).map(|i| Bytes::from(vec![(i + run) as u8; MIB])).collect();
            let t = Instant::now();
            client.store(&ns, &tokens, &blocks).await?.ok()?;
            store.push(total as f64 / t.elapsed().as_secs_f64() / 1e9);
            let t = Instant::now();
            let got = client.load(&ns, &tokens).await?;
            load.push(total as f64 / t.elapsed().as_secs_f64() / 1e9);
            anyhow::ensure!(got.len() == args.blocks && got[0] == blocks[0], "loaded blocks differ");
            client.purge(&ns).await?;
        }
        Ok::<_, anyhow::Error>((median(store), median(load)))
    })?;
    let memcpy = median((0..args.runs).map(|_| memcpy_gbps(total)).collect());
    let tcp = median((0..args.runs).map(|_| raw_tcp_gbps(total)).collect::<anyhow::Result<Vec<_>>>()?);
    drop(server);
    let _ = std::fs::remove_dir_all(&data_dir);

    println!("| figure (1 MiB blocks, {} MiB per run, median of {} runs, {} connections) | GB/s | / raw TCP | / memcpy |", args.blocks, args.runs, args.connections);
    println!("|---|---|---|---|");
    println!("| memcpy, one thread | {memcpy:.2} | | 1.00 |");
    println!("| raw loopback TCP, one stream | {tcp:.2} | 1.00 | {:.2} |", tcp / memcpy);
    println!("| kvtier store | {store:.2} | {:.2} | {:.2} |", store / tcp, store / memcpy);
    println!("| kvtier load | {load:.2} | {:.2} | {:.2} |", load / tcp, load / memcpy);
    Ok(())
}
