//! The real servers a run measures: a `kvtier` process and a `redis-server` process, both started
//! on loopback by the bench and stopped by their own pid when the run ends.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

/// Where the `kvtier` binary is: the flag, else beside this executable (same target dir).
pub fn find_kvtier(flag: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(p) = flag {
        anyhow::ensure!(p.is_file(), "--kvtier-bin {} is not a file", p.display());
        return Ok(p.to_path_buf());
    }
    let exe = std::env::current_exe()?;
    let dir = exe.parent().context("executable has no folder")?;
    for cand in [dir.join("kvtier"), dir.join("../kvtier")] {
        if cand.is_file() {
            return Ok(cand);
        }
    }
    bail!(
        "no kvtier binary beside {} — build it with `cargo build --release --bin kvtier` (same target dir), or pass --kvtier-bin PATH or --server ADDR",
        exe.display()
    )
}

/// A `kvtier serve` child process on loopback ports chosen by the OS.
pub struct KvtierServer {
    child: Child,
    pub grpc_addr: String,
}

impl KvtierServer {
    pub fn start(bin: &Path, data_dir: &Path, dram_capacity: u64, log: &Path) -> anyhow::Result<KvtierServer> {
        std::fs::create_dir_all(data_dir)?;
        let log_file = std::fs::File::create(log)?;
        let mut cmd = Command::new(bin);
        cmd.args(["serve", "--listen", "127.0.0.1:0", "--data-listen", "127.0.0.1:0", "--no-metrics", "--log", "warn"])
            .arg("--data-dir")
            .arg(data_dir)
            .arg("--dram-capacity")
            .arg(format!("{}MiB", dram_capacity.div_ceil(1 << 20)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log_file);
        // If the bench dies (Ctrl-C, a kill), the server goes with it.
        unsafe {
            use std::os::unix::process::CommandExt;
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        let mut child = cmd.spawn().with_context(|| format!("starting {}", bin.display()))?;
        let stdout = child.stdout.take().context("no stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(l)) = lines.next() {
                let _ = tx.send(l);
            }
            for _ in lines {} // keep draining so the server never blocks on a full pipe
        });
        let mut server = KvtierServer { child, grpc_addr: String::new() };
        let line = match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(l) => l,
            Err(_) => bail!("kvtier did not say where it listens within 20 s; its log: {}", log.display()),
        };
        server.grpc_addr = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("grpc="))
            .with_context(|| format!("unexpected first line from kvtier: {line:?}"))?
            .to_string();
        Ok(server)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for KvtierServer {
    fn drop(&mut self) {
        // SIGTERM our own child by pid, give it a moment, then SIGKILL it.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(5) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `redis-server` binary: the flag, else the first on PATH. `Err` says why not.
pub fn find_redis(flag: Option<&Path>) -> Result<PathBuf, String> {
    if let Some(p) = flag {
        return if p.is_file() {
            Ok(p.to_path_buf())
        } else {
            Err(format!("--redis-bin {} is not a file", p.display()))
        };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path).chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/local/bin")]) {
        let cand = dir.join("redis-server");
        if cand.is_file() {
            return Ok(cand);
        }
    }
    Err("redis-server is not installed (not on PATH); install it with `apt-get install -y redis-server`".into())
}

pub fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A daemonized `redis-server` on loopback with persistence off, stopped by its pidfile's pid.
pub struct RedisServer {
    pub port: u16,
    pid: i32,
    pub version: String,
}

impl RedisServer {
    pub fn start(bin: &Path, dir: &Path) -> anyhow::Result<RedisServer> {
        std::fs::create_dir_all(dir)?;
        let port = free_port()?;
        let pidfile = dir.join(format!("redis-{port}.pid"));
        let _ = std::fs::remove_file(&pidfile);
        let status = Command::new(bin)
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "yes",
            ])
            .arg("--pidfile")
            .arg(&pidfile)
            .arg("--dir")
            .arg(dir)
            .arg("--logfile")
            .arg(dir.join("redis.log"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .status()
            .with_context(|| format!("starting {}", bin.display()))?;
        anyhow::ensure!(status.success(), "redis-server exited with {status}; see {}", dir.join("redis.log").display());
        let t = Instant::now();
        let pid = loop {
            if let Some(pid) = std::fs::read_to_string(&pidfile).ok().and_then(|s| s.trim().parse::<i32>().ok()) {
                break pid;
            }
            anyhow::ensure!(
                t.elapsed() < Duration::from_secs(10),
                "redis-server wrote no pidfile {} in 10 s",
                pidfile.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        let version = Command::new(bin)
            .arg("--version")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.split_whitespace().find_map(|w| w.strip_prefix("v=").map(str::to_string)))
            .unwrap_or_default();
        Ok(RedisServer { port, pid, version })
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if self.pid <= 1 {
            return;
        }
        unsafe { libc::kill(self.pid, libc::SIGTERM) };
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(5) {
            if unsafe { libc::kill(self.pid, 0) } != 0 {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        unsafe { libc::kill(self.pid, libc::SIGKILL) };
    }
}
