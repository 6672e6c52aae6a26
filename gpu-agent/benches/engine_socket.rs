//! A load through the agent's engine socket as an engine sees it (host backend): an engine's
//! memfd KV buffer registered over the real Unix socket, every block saved layer by layer into
//! G1, then `LOAD` of all of them into other pages — time from sending the request to the first
//! `LAYER` answer and to the last — beside a baseline measured in the same run: a CPU memcpy of
//! the same bytes in the same page-sized pieces (what the copies themselves cost), run alternately
//! with the loads.
//!
//! `cargo bench -p kvtier-agent --bench engine_socket`; `LAYERS`, `PAGES`, `LAYER_KIB`, `RUNS`
//! override the shape; `MEMCPY=0` leaves the baseline out. On a busy machine the first layer's time includes waking the agent's
//! connection and stream threads (back-to-back loads, with no memcpy between them, answer the first
//! layer several times sooner).

use std::io::{IoSlice, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_agent::engine::proto::{BufferSource, Header, Item, Request, HEADER_LEN};
use kvtier_agent::engine::{Agent, AgentConfig, EngineServer};
use kvtier_agent::pool::{Capacity, MemorySpill};
use kvtier_agent::HostDevice;
use kvtier_proto::{BlockKey, DType, HashScheme, KvLayout, Namespace, KEY_LEN};
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};

type BenchResult<T> = Result<T, Box<dyn std::error::Error>>;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn answer(s: &mut UnixStream) -> BenchResult<(Header, Vec<u8>)> {
    let mut h = [0u8; HEADER_LEN];
    s.read_exact(&mut h)?;
    let h = Header::decode(&h);
    let mut body = vec![0u8; h.body_len as usize];
    s.read_exact(&mut body)?;
    if h.status != 0 {
        return Err(format!("refused: {}", String::from_utf8_lossy(&body)).into());
    }
    Ok((h, body))
}

fn main() -> BenchResult<()> {
    let (layers, pages, lb, runs) = (env("LAYERS", 32), env("PAGES", 64), env("LAYER_KIB", 16) << 10, env("RUNS", 7));
    // K and V × heads × head_dim × fp16 × tokens = one layer's bytes of a block.
    let tokens = (lb / (2 * 8 * 128 * 2)).max(1) as u32;
    let layout = KvLayout::new(layers as u16, 8, 128, DType::Fp16, tokens);
    let block = layout.block_bytes() as usize;
    let lb = block / layers;
    let mut cfg = AgentConfig::new(block);
    cfg.capacity = Capacity::Bytes(pages * block);
    cfg.max_store_bytes_per_load = block;
    let dev = Arc::new(HostDevice::new(0, 2 * pages * block + (64 << 20)));
    let agent = Arc::new(Agent::new(dev, MemorySpill::default(), cfg)?);
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("agent.sock");
    let _server = EngineServer::bind(agent.clone(), &path)?;

    let mut s = UnixStream::connect(&path)?;
    s.write_all(&Request::Open(Namespace::new("bench", "m", layout, HashScheme::Blake3, b"s")).encode(1))?;
    answer(&mut s)?;
    let len = 2 * pages * block; // pages 0..P hold the saved blocks, P..2P receive the loads
    let fd = rustix::fs::memfd_create("bench", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
    rustix::fs::ftruncate(&fd, len as u64)?;
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW)?;
    let msg = Request::Register { source: BufferSource::Memfd, len: len as u64, pages: 2 * pages as u32 }.encode(2);
    let fds = [fd.as_fd()];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut anc = SendAncillaryBuffer::new(&mut space);
    anc.push(SendAncillaryMessage::ScmRights(&fds));
    let n = rustix::net::sendmsg(&s, &[IoSlice::new(&msg)], &mut anc, SendFlags::NOSIGNAL)?;
    s.write_all(&msg[n..])?;
    let buffer = u32::from_le_bytes(answer(&mut s)?.1[..4].try_into()?);

    let key = |i: usize| {
        let mut k = [0u8; KEY_LEN];
        k[..8].copy_from_slice(&(i as u64).to_le_bytes());
        BlockKey(k)
    };
    let saved: Vec<Item> = (0..pages).map(|i| Item { page: i as u32, key: key(i) }).collect();
    for layer in 0..layers {
        s.write_all(&Request::Save { buffer, layer: layer as u16, items: saved.clone() }.encode(10))?;
        answer(&mut s)?;
    }
    let into: Vec<Item> = (0..pages).map(|i| Item { page: (pages + i) as u32, key: key(i) }).collect();
    // The baseline runs alternately with the loads, so both see the same machine.
    let src: Vec<u8> = (0..layers * pages * lb).map(|i| (i % 251) as u8).collect();
    let mut dst = vec![1u8; src.len()];
    let (mut first, mut last, mut paged) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..runs {
        let t = Instant::now();
        s.write_all(&Request::Load { buffer, items: into.clone() }.encode(100 + r as u32))?;
        let (_, body) = answer(&mut s)?;
        assert_eq!(u32::from_le_bytes(body[4..8].try_into()?), pages as u32, "all from G1");
        for l in 0..layers {
            answer(&mut s)?;
            if l == 0 {
                first.push(t.elapsed());
            }
        }
        last.push(t.elapsed());
        if env("MEMCPY", 1) == 0 {
            continue;
        }
        let t = Instant::now();
        for (d, c) in dst.chunks_mut(lb).zip(src.chunks(lb)) {
            d.copy_from_slice(c);
        }
        std::hint::black_box(&dst);
        paged.push(t.elapsed());
    }
    if paged.is_empty() {
        paged.push(Duration::from_nanos(1));
    }
    let (first, last, paged) = (median(first), median(last), median(paged));
    let mib = (layers * pages * lb) as f64 / (1 << 20) as f64;
    println!(
        "engine socket load, host backend: {layers} layers × {pages} pages × {lb} B = {mib:.0} MiB, medians of {runs}"
    );
    println!(
        "  first layer answered {:.2} ms, last {:.2} ms (first/last {:.3}; ideal 1/{layers} = {:.3})",
        first.as_secs_f64() * 1e3,
        last.as_secs_f64() * 1e3,
        first.as_secs_f64() / last.as_secs_f64(),
        1.0 / layers as f64
    );
    println!(
        "  baseline page-by-page memcpy {:.2} ms ({:.1} GB/s); load through the socket {:.1} GB/s = {:.2}x memcpy",
        paged.as_secs_f64() * 1e3,
        mib * 1.048576e-3 / paged.as_secs_f64(),
        mib * 1.048576e-3 / last.as_secs_f64(),
        paged.as_secs_f64() / last.as_secs_f64()
    );
    Ok(())
}
