//! The machine's limits: memcpy (1 and N threads), loopback TCP (one iperf3-style stream: a
//! sender thread writing 1 MiB buffers, a receiver thread reading them), a Unix socket, and
//! sequential disk write/read on the data directory. Each figure is the median of `runs` runs, in GB/s.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;

use crate::stats::median;

const MIB: usize = 1 << 20;

#[derive(Debug, Clone, Serialize)]
pub struct Limits {
    pub memcpy_1: f64,
    pub memcpy_n: f64,
    pub threads: usize,
    pub tcp: f64,
    /// Slowest and fastest run of `tcp`.
    pub tcp_min: f64,
    pub tcp_max: f64,
    /// The congestion control `tcp` ran (the system's, as an iperf3 stream's, unless `KVTIER_SAME_HOST_CONGESTION` names one).
    pub tcp_congestion: String,
    /// `tcp` on a congestion control that does not pace (`tcp_unpaced_congestion`).
    pub tcp_unpaced: f64,
    pub tcp_unpaced_congestion: String,
    pub unix: f64,
    pub disk_write: f64,
    pub disk_read: f64,
    pub disk_dir: PathBuf,
    pub runs: usize,
}

/// GB/s of copying `total` bytes through a `buf`-byte buffer on each of `threads` threads
/// (buffers allocated and touched before the clock starts).
pub fn memcpy_gbps(total: usize, buf: usize, threads: usize) -> f64 {
    let per = total / threads;
    let iters = per.div_ceil(buf);
    let barrier = std::sync::Barrier::new(threads + 1);
    let t = std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let src = vec![7u8; buf];
                let mut dst = vec![0u8; buf];
                dst.copy_from_slice(&src);
                barrier.wait();
                for _ in 0..iters {
                    dst.copy_from_slice(std::hint::black_box(&src));
                    std::hint::black_box(&mut dst);
                }
                barrier.wait();
            });
        }
        barrier.wait();
        let t = Instant::now();
        barrier.wait();
        t.elapsed()
    });
    (iters * buf * threads) as f64 / t.as_secs_f64() / 1e9
}

/// One sender and one receiver thread moving `total` bytes in 1 MiB writes over a stream pair.
/// The sender stands for a server (on the servers' CPUs in a pinned run, [`crate::placement`]),
/// the receiver, this thread, for a client.
fn stream_gbps<S: Read + Write + Send + 'static>(mut tx: S, mut rx: S, total: usize) -> anyhow::Result<f64> {
    let (ready_tx, ready) = std::sync::mpsc::channel();
    let sender = std::thread::spawn(move || -> std::io::Result<f64> {
        crate::placement::move_to_server_cpus()?;
        let buf = vec![1u8; MIB];
        let _ = ready_tx.send(());
        let t = Instant::now();
        for _ in 0..total / MIB {
            tx.write_all(&buf)?;
        }
        let mut ack = [0u8; 1];
        tx.read_exact(&mut ack)?;
        Ok(t.elapsed().as_secs_f64())
    });
    // Receiving from when the sender is placed and ready.
    let _ = ready.recv();
    let mut buf = vec![0u8; MIB];
    let mut left = total / MIB * MIB;
    while left > 0 {
        let n = rx.read(&mut buf)?;
        if n == 0 {
            break;
        }
        left -= n.min(left);
    }
    rx.write_all(b"k")?;
    let secs = sender.join().map_err(|_| anyhow::anyhow!("sender panicked"))??;
    Ok((total / MIB * MIB) as f64 / secs / 1e9)
}

/// A connected loopback TCP pair, Nagle off, both ends on the system's congestion control (as
/// an iperf3 stream's would be), or the one `KVTIER_SAME_HOST_CONGESTION` names for a data-plane
/// connection's life ([`kvtier_proto::tcp::tune_data_socket`]); or, with `choice`, the first of
/// it the kernel takes. (By default the server runs a connection unpaced while it is alone: read
/// those cells against the unpaced stream too.)
fn tcp_pair(choice: Option<&[&str]>) -> anyhow::Result<(TcpStream, TcpStream)> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let tx = TcpStream::connect(l.local_addr()?)?;
    let (rx, _) = l.accept()?;
    for s in [&tx, &rx] {
        s.set_nodelay(true)?;
        let peer = s.peer_addr()?.ip();
        let _ = match choice {
            Some(c) => kvtier_proto::tcp::tune_with(s, peer, c),
            None => kvtier_proto::tcp::tune_data_socket(s, peer),
        };
    }
    Ok((tx, rx))
}

/// One loopback TCP stream's GB/s, its sockets set as kvtier's data plane sets a same-host
/// connection's.
pub fn tcp_gbps(total: usize) -> anyhow::Result<f64> {
    Ok(tcp_stream(total, None)?.0)
}

/// One loopback TCP stream's GB/s on the congestion control `tcp_pair(choice)` gives it (e.g.
/// [`kvtier_proto::tcp::UNPACED`]: what one stream moves where the system's default, e.g. BBR,
/// paces loopback sends), and that control's name.
pub fn tcp_stream(total: usize, choice: Option<&[&str]>) -> anyhow::Result<(f64, String)> {
    let (tx, rx) = tcp_pair(choice)?;
    let cc = kvtier_proto::tcp::congestion(&tx).unwrap_or_else(|| "unknown".into());
    Ok((stream_gbps(tx, rx, total)?, cc))
}

pub fn unix_gbps(total: usize) -> anyhow::Result<f64> {
    let (a, b) = UnixStream::pair()?;
    stream_gbps(a, b, total)
}

/// Which way a round-trip baseline ([`tcp_round_trips`]) moves its blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoundTrip {
    /// The client writes a block, the server answers one byte.
    Store,
    /// The client writes one byte, the server answers a block.
    Load,
}

/// Where the two sides of a round-trip baseline send from and receive into: one buffer each,
/// larger than the last-level cache and touched before any clock starts, walked a block at a
/// time (as a store lands in the next slot of the server's arena and a load in the next pages of
/// an engine's buffer), so no figure rides on a cache-hot 1 MiB buffer.
pub struct RoundTripBuffers {
    client: Vec<u8>,
    server: Vec<u8>,
}

impl RoundTripBuffers {
    pub fn new(span: usize) -> RoundTripBuffers {
        RoundTripBuffers { client: vec![1u8; span], server: vec![2u8; span] }
    }
}

/// The `i`-th block's range in a buffer of `span` bytes (blocks back to back, wrapping).
fn place(i: usize, block: usize, span: usize) -> std::ops::Range<usize> {
    let slots = (span / block).max(1);
    let at = (i % slots) * block;
    at..at + block
}

/// Loopback TCP, one block per round trip: `total` bytes in `block`-byte blocks, each answered
/// before the next is asked for ([`RoundTrip`]), over blocking sockets with Nagle off (a thread
/// each side, as the stream of [`tcp_gbps`]), blocks taken from and put into `bufs`. What the
/// plainest protocol that answers every block before the next moves here, now: a store or load
/// of one block per call is read against this as well as against the stream, whose sender never
/// waits for its receiver. (Busy-polling both sides instead was measured: on two shared cores the
/// pollers took the CPU from the side with work, 5–30× slower.) Returns GB/s and each round
/// trip's seconds.
pub fn tcp_round_trips(
    total: usize,
    block: usize,
    way: RoundTrip,
    bufs: &mut RoundTripBuffers,
) -> anyhow::Result<(f64, Vec<f64>)> {
    anyhow::ensure!(block > 0, "a round trip moves at least one byte");
    let n = (total / block).max(1);
    let (mut tx, mut rx) = tcp_pair(None)?;
    let RoundTripBuffers { client, server } = bufs;
    let (span_c, span_s) = (client.len(), server.len());
    anyhow::ensure!(span_c >= block && span_s >= block, "round-trip buffers smaller than a block");
    std::thread::scope(|scope| {
        let server = scope.spawn(move || -> std::io::Result<()> {
            crate::placement::move_to_server_cpus()?;
            let mut one = [0u8; 1];
            for i in 0..n {
                let r = place(i, block, span_s);
                match way {
                    RoundTrip::Store => {
                        rx.read_exact(&mut server[r])?;
                        rx.write_all(b"k")?;
                    }
                    RoundTrip::Load => {
                        rx.read_exact(&mut one)?;
                        rx.write_all(&server[r])?;
                    }
                }
            }
            Ok(())
        });
        let mut lat = Vec::with_capacity(n);
        let mut one = [0u8; 1];
        let t = Instant::now();
        let run = (|| -> std::io::Result<()> {
            for i in 0..n {
                let r = place(i, block, span_c);
                let t0 = Instant::now();
                match way {
                    RoundTrip::Store => {
                        tx.write_all(&client[r])?;
                        tx.read_exact(&mut one)?;
                    }
                    RoundTrip::Load => {
                        tx.write_all(b"g")?;
                        tx.read_exact(&mut client[r])?;
                    }
                }
                lat.push(t0.elapsed().as_secs_f64());
            }
            Ok(())
        })();
        let secs = t.elapsed().as_secs_f64();
        // The server ends when the client's socket closes, whatever happened to the client.
        drop(tx);
        let served = server.join().map_err(|_| anyhow::anyhow!("round-trip server panicked"))?;
        run?;
        served?;
        Ok(((n * block) as f64 / secs / 1e9, lat))
    })
}

/// Sequential write (4 MiB writes, then fsync) and read (after dropping the file's pages from the
/// page cache with `posix_fadvise(DONTNEED)`) of a `total`-byte file in `dir`.
pub fn disk_gbps(dir: &Path, total: usize) -> anyhow::Result<(f64, f64)> {
    use std::os::fd::AsRawFd;
    std::fs::create_dir_all(dir)?;
    let path = dir.join(format!(".kvtier-bench-disk-{}", std::process::id()));
    let chunk = 4 * MIB;
    let buf: Vec<u8> = (0..chunk).map(|i| (i * 31 % 251) as u8).collect();
    let n = total.div_ceil(chunk);
    let result = (|| {
        let mut f = std::fs::File::create(&path)?;
        let t = Instant::now();
        for _ in 0..n {
            f.write_all(&buf)?;
        }
        f.sync_all()?;
        let w = (n * chunk) as f64 / t.elapsed().as_secs_f64() / 1e9;
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        drop(f);
        let mut f = std::fs::File::open(&path)?;
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        let mut rbuf = vec![0u8; chunk];
        let t = Instant::now();
        let mut got = 0usize;
        loop {
            let k = f.read(&mut rbuf)?;
            if k == 0 {
                break;
            }
            got += k;
        }
        let r = got as f64 / t.elapsed().as_secs_f64() / 1e9;
        Ok::<_, anyhow::Error>((w, r))
    })();
    let _ = std::fs::remove_file(&path);
    result
}

pub fn measure(disk_dir: &Path, quick: bool, runs: usize, progress: &indicatif::ProgressBar) -> anyhow::Result<Limits> {
    let total = if quick { 256 * MIB } else { 1024 * MIB };
    let disk_total = if quick { 256 * MIB } else { 1024 * MIB };
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let mut m1 = Vec::new();
    let mut mn = Vec::new();
    let mut tcp = Vec::new();
    let mut tcp_unpaced = Vec::new();
    let (mut tcp_cc, mut unpaced_cc) = (String::new(), String::new());
    let mut unix = Vec::new();
    let mut dw = Vec::new();
    let mut dr = Vec::new();
    progress.set_length((runs * 5) as u64);
    for _ in 0..runs {
        // A 64 MiB buffer is larger than the last-level cache: this is DRAM bandwidth.
        progress.set_message("memcpy");
        m1.push(memcpy_gbps(total, 64 * MIB, 1));
        progress.inc(1);
        mn.push(memcpy_gbps(total, 64 * MIB, threads));
        progress.inc(1);
        progress.set_message("loopback TCP");
        let (g, cc) = tcp_stream(total, None)?;
        tcp.push(g);
        tcp_cc = cc;
        let (g, cc) = tcp_stream(total, Some(&kvtier_proto::tcp::UNPACED))?;
        tcp_unpaced.push(g);
        unpaced_cc = cc;
        progress.inc(1);
        progress.set_message("Unix socket");
        unix.push(unix_gbps(total)?);
        progress.inc(1);
        progress.set_message("disk");
        let (w, r) = disk_gbps(disk_dir, disk_total)?;
        dw.push(w);
        dr.push(r);
        progress.inc(1);
    }
    Ok(Limits {
        memcpy_1: median(m1),
        memcpy_n: median(mn),
        threads,
        tcp_min: tcp.iter().copied().fold(f64::NAN, f64::min),
        tcp_max: tcp.iter().copied().fold(f64::NAN, f64::max),
        tcp: median(tcp),
        tcp_congestion: tcp_cc,
        tcp_unpaced: median(tcp_unpaced),
        tcp_unpaced_congestion: unpaced_cc,
        unix: median(unix),
        disk_write: median(dw),
        disk_read: median(dr),
        disk_dir: disk_dir.to_path_buf(),
        runs,
    })
}

/// Loopback TCP sampled through a run (one short stream before each cell's run of each phase),
/// so every cell has a baseline measured at about the time it ran, not only at the start, on a
/// machine whose other load comes and goes. Cells of concurrency 1 also get the round-trip
/// baselines ([`tcp_round_trips`], system `tcp-rr`): a store and a load of the cell's block size,
/// one block per round trip.
pub struct TcpSampler {
    bytes: usize,
    samples: std::sync::Mutex<std::collections::BTreeMap<(usize, usize), Vec<f64>>>,
    /// The round-trip cells' samples.
    round_trips: std::sync::Mutex<RoundTripSamples>,
}

#[derive(Default)]
struct RoundTripSamples {
    bufs: Option<RoundTripBuffers>,
    /// By (op, block size).
    by_cell: std::collections::BTreeMap<(&'static str, usize), RoundTripCell>,
}

/// GB/s of each sample of one round-trip cell, and every round trip's seconds.
#[derive(Default)]
struct RoundTripCell {
    gbps: Vec<f64>,
    lat: Vec<f64>,
}

impl TcpSampler {
    pub fn new(bytes: usize) -> TcpSampler {
        TcpSampler { bytes: bytes.max(MIB), samples: Default::default(), round_trips: Default::default() }
    }

    /// Streams `bytes` over loopback now (blocking, tens of ms) and files the figure under the
    /// cell (`size`, `c`); at `c == 1` also a store and a load of `bytes` one `size` block per
    /// round trip.
    pub fn sample(&self, size: usize, c: usize) -> anyhow::Result<()> {
        let g = tcp_gbps(self.bytes)?;
        self.samples.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.entry((size, c)).or_default().push(g);
        if c == 1 {
            let mut rt = self.round_trips.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
            let RoundTripSamples { bufs, by_cell } = &mut *rt;
            // One sample's bytes (at least 1 MiB; 64 MiB in the blocks bench, above the last-level
            // caches here), made and touched once.
            let bufs = bufs.get_or_insert_with(|| RoundTripBuffers::new(self.bytes.max(size)));
            for (op, way) in [("store", RoundTrip::Store), ("load", RoundTrip::Load)] {
                let (gbps, lat) = tcp_round_trips(self.bytes, size, way, bufs)?;
                let cell = by_cell.entry((op, size)).or_default();
                cell.gbps.push(gbps);
                cell.lat.extend(lat);
            }
        }
        Ok(())
    }

    /// One `tcp` load cell per (size, concurrency): median and range of its samples; and the
    /// `tcp-rr` store and load cells of concurrency 1, with their round trips' latencies.
    pub fn cells(&self) -> Vec<crate::blocks::Cell> {
        let s = self.samples.lock().map(|s| s.clone()).unwrap_or_default();
        let mut cells: Vec<_> =
            s.iter().map(|(&(size, c), v)| crate::blocks::Cell::from_runs("tcp", "load", size, c, v, &[])).collect();
        if let Ok(rt) = self.round_trips.lock() {
            for (&(op, size), c) in &rt.by_cell {
                cells.push(crate::blocks::Cell::from_runs("tcp-rr", op, size, 1, &c.gbps, &c.lat));
            }
        }
        cells
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn patterned(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
    }

    #[test]
    fn a_round_trip_store_lands_each_block_in_its_place_and_a_load_brings_it_back() {
        // Three places of 1000 bytes, five blocks: places wrap, the last writes win.
        let mut bufs = RoundTripBuffers { client: patterned(3000, 7), server: vec![0; 3000] };
        let (gbps, lat) = tcp_round_trips(5000, 1000, RoundTrip::Store, &mut bufs).unwrap();
        assert!(gbps > 0.0 && gbps.is_finite());
        assert_eq!(lat.len(), 5);
        assert_eq!(bufs.server, bufs.client, "the server's places hold the client's blocks");

        bufs.server = patterned(3000, 99);
        bufs.client = vec![0; 3000];
        let (_, lat) = tcp_round_trips(3000, 1000, RoundTrip::Load, &mut bufs).unwrap();
        assert_eq!(lat.len(), 3);
        assert_eq!(bufs.client, bufs.server, "every block came back into its place");
    }

    #[test]
    fn a_round_trip_needs_buffers_of_a_block() {
        let mut bufs = RoundTripBuffers::new(100);
        let e = tcp_round_trips(1000, 200, RoundTrip::Load, &mut bufs).unwrap_err();
        assert!(e.to_string().contains("smaller than a block"), "{e}");
    }

    #[test]
    fn only_cells_of_one_caller_get_round_trip_baselines() {
        let s = TcpSampler::new(MIB);
        s.sample(64 << 10, 1).unwrap();
        s.sample(64 << 10, 1).unwrap();
        s.sample(64 << 10, 4).unwrap();
        let cells = s.cells();
        let rr: Vec<_> = cells.iter().filter(|c| c.system == "tcp-rr").collect();
        assert_eq!(rr.len(), 2, "a store and a load cell");
        for c in &rr {
            assert_eq!((c.block_bytes, c.concurrency), (64 << 10, 1));
            // Two samples of 16 round trips each, every one timed.
            assert_eq!(c.ops, 32, "{}", c.op);
            assert!(c.p50_ms > 0.0 && c.p50_ms <= c.p99_ms);
        }
        assert_eq!(cells.iter().filter(|c| c.system == "tcp").count(), 2, "(64 KiB, 1) and (64 KiB, 4)");
    }
}
