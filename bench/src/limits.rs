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
fn stream_gbps<S: Read + Write + Send + 'static>(mut tx: S, mut rx: S, total: usize) -> anyhow::Result<f64> {
    let r = std::thread::spawn(move || -> std::io::Result<()> {
        let mut buf = vec![0u8; MIB];
        let mut left = total;
        while left > 0 {
            let n = rx.read(&mut buf)?;
            if n == 0 {
                break;
            }
            left -= n.min(left);
        }
        rx.write_all(b"k")
    });
    let buf = vec![1u8; MIB];
    let t = Instant::now();
    for _ in 0..total / MIB {
        tx.write_all(&buf)?;
    }
    let mut ack = [0u8; 1];
    tx.read_exact(&mut ack)?;
    let secs = t.elapsed().as_secs_f64();
    r.join().map_err(|_| anyhow::anyhow!("receiver panicked"))??;
    Ok((total / MIB * MIB) as f64 / secs / 1e9)
}

pub fn tcp_gbps(total: usize) -> anyhow::Result<f64> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let tx = TcpStream::connect(l.local_addr()?)?;
    tx.set_nodelay(true)?;
    let (rx, _) = l.accept()?;
    stream_gbps(tx, rx, total)
}

pub fn unix_gbps(total: usize) -> anyhow::Result<f64> {
    let (a, b) = UnixStream::pair()?;
    stream_gbps(a, b, total)
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
        tcp.push(tcp_gbps(total)?);
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
        unix: median(unix),
        disk_write: median(dw),
        disk_read: median(dr),
        disk_dir: disk_dir.to_path_buf(),
        runs,
    })
}

/// Loopback TCP sampled through a run (one short stream before each cell's run of each phase),
/// so every cell has a baseline measured at about the time it ran, not only at the start, on a
/// machine whose other load comes and goes.
pub struct TcpSampler {
    bytes: usize,
    samples: std::sync::Mutex<std::collections::BTreeMap<(usize, usize), Vec<f64>>>,
}

impl TcpSampler {
    pub fn new(bytes: usize) -> TcpSampler {
        TcpSampler { bytes: bytes.max(MIB), samples: Default::default() }
    }

    /// Streams `bytes` over loopback now (blocking, tens of ms) and files the figure under the
    /// cell (`size`, `c`).
    pub fn sample(&self, size: usize, c: usize) -> anyhow::Result<()> {
        let g = tcp_gbps(self.bytes)?;
        self.samples.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.entry((size, c)).or_default().push(g);
        Ok(())
    }

    /// One `tcp` load cell per (size, concurrency): median and range of its samples.
    pub fn cells(&self) -> Vec<crate::blocks::Cell> {
        let s = self.samples.lock().map(|s| s.clone()).unwrap_or_default();
        s.iter().map(|(&(size, c), v)| crate::blocks::Cell::from_runs("tcp", "load", size, c, v, &[])).collect()
    }
}
