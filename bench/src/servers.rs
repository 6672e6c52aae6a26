//! The real servers a run measures: a `kvtier` process, a `redis-server` process and LMCache's
//! standalone server, all started on loopback by the bench and stopped by their own pid when the
//! run ends; and the peers' own clients (`redis-benchmark`).

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
        Self::start_with(bin, data_dir, dram_capacity, log, &[])
    }

    /// [`KvtierServer::start`] with more `serve` flags (a disk tier, a codec).
    pub fn start_with(
        bin: &Path,
        data_dir: &Path,
        dram_capacity: u64,
        log: &Path,
        extra: &[&str],
    ) -> anyhow::Result<KvtierServer> {
        std::fs::create_dir_all(data_dir)?;
        let log_file = std::fs::File::create(log)?;
        let mut cmd = Command::new(bin);
        cmd.args(["serve", "--listen", "127.0.0.1:0", "--data-listen", "127.0.0.1:0", "--no-metrics", "--log", "warn"])
            .arg("--data-dir")
            .arg(data_dir)
            .arg("--dram-capacity")
            .arg(format!("{}MiB", dram_capacity.div_ceil(1 << 20)))
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log_file);
        // A pinned run: the node confines itself to the servers' CPUs (its own `--cpus`).
        if let Some(p) = crate::placement::current() {
            cmd.arg("--cpus").arg(p.servers_cpulist());
        }
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
    find_bin("redis-server", flag)
}

/// `name`: the flag, else the first on PATH (then /usr/bin, /usr/local/bin). `Err` says why not.
pub fn find_bin(name: &str, flag: Option<&Path>) -> Result<PathBuf, String> {
    if let Some(p) = flag {
        return if p.is_file() { Ok(p.to_path_buf()) } else { Err(format!("{} is not a file", p.display())) };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path).chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/local/bin")]) {
        let cand = dir.join(name);
        if cand.is_file() {
            return Ok(cand);
        }
    }
    Err(format!("{name} is not installed (not on PATH); Debian's `apt-get install -y redis-server` has it"))
}

pub fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A daemonized `redis-server` on loopback with persistence off, stopped by its pidfile's pid.
pub struct RedisServer {
    pub port: u16,
    pid: i32,
    pub version: String,
    /// Its Unix socket, when started with one ([`RedisServer::start_with_unix`]).
    pub unix_socket: Option<PathBuf>,
}

impl RedisServer {
    pub fn start(bin: &Path, dir: &Path) -> anyhow::Result<RedisServer> {
        Self::start_inner(bin, dir, false)
    }

    /// [`RedisServer::start`] that also listens on a Unix socket in `dir` (mode 0700): the fair
    /// peer of a same-node path.
    pub fn start_with_unix(bin: &Path, dir: &Path) -> anyhow::Result<RedisServer> {
        Self::start_inner(bin, dir, true)
    }

    fn start_inner(bin: &Path, dir: &Path, unix: bool) -> anyhow::Result<RedisServer> {
        std::fs::create_dir_all(dir)?;
        let port = free_port()?;
        let pidfile = dir.join(format!("redis-{port}.pid"));
        let _ = std::fs::remove_file(&pidfile);
        let unix_socket = unix.then(|| dir.join(format!("redis-{port}.sock")));
        let mut cmd = Command::new(bin);
        if let Some(sock) = &unix_socket {
            cmd.arg("--unixsocket").arg(sock).args(["--unixsocketperm", "700"]);
        }
        crate::placement::on_server_cpus(&mut cmd);
        let status = cmd
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
        Ok(RedisServer { port, pid, version, unix_socket })
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// The server's pid (for its CPU clock).
    pub fn pid(&self) -> u32 {
        self.pid as u32
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

/// Waits until something accepts connections on `127.0.0.1:port`.
fn wait_listening(port: u16, within: Duration, child: &mut Child, what: &str, log: &Path) -> anyhow::Result<()> {
    let t = Instant::now();
    loop {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        if let Ok(Some(st)) = child.try_wait() {
            bail!("{what} exited with {st} before listening; its log: {}", log.display());
        }
        anyhow::ensure!(
            t.elapsed() < within,
            "{what} did not listen on port {port} within {within:?}; its log: {}",
            log.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// LMCache's standalone server (`python -m lmcache.v1.server HOST PORT cpu`, the process its
/// `lm://` remote connector talks to), stopped by its pid.
pub struct LmcacheServer {
    child: Child,
    pub port: u16,
    pub version: String,
}

impl LmcacheServer {
    /// Starts it with `python` if `lmcache` imports there; `Err` says why not.
    pub fn start(python: &Path, log: &Path) -> anyhow::Result<LmcacheServer> {
        let probe = Command::new(python)
            .args(["-I", "-c", "import lmcache.v1.server, importlib.metadata as m; print(m.version('lmcache'))"])
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("running {}", python.display()))?;
        if !probe.status.success() {
            let err = String::from_utf8_lossy(&probe.stderr);
            bail!(
                "lmcache does not import in {}: {}",
                python.display(),
                err.lines().last().unwrap_or("no message").trim()
            );
        }
        let version = String::from_utf8_lossy(&probe.stdout).trim().to_string();
        let port = free_port()?;
        let mut cmd = Command::new(python);
        cmd.args(["-I", "-m", "lmcache.v1.server", "127.0.0.1", &port.to_string(), "cpu"])
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(log)?)
            .stderr(std::fs::File::create(log.with_extension("err.log"))?);
        crate::placement::on_server_cpus(&mut cmd);
        unsafe {
            use std::os::unix::process::CommandExt;
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        let mut child = cmd.spawn().context("starting lmcache.v1.server")?;
        // Importing torch takes a while on a busy machine.
        if let Err(e) = wait_listening(port, Duration::from_secs(120), &mut child, "lmcache.v1.server", log) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
        Ok(LmcacheServer { child, port, version })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for LmcacheServer {
    fn drop(&mut self) {
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

/// What `redis-benchmark` (Redis's own C client) measured for one test.
#[derive(Debug, Clone, PartialEq)]
pub struct RedisBenchRow {
    pub test: String,
    pub rps: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

/// Parses `redis-benchmark --csv` output: a header line
/// `"test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms","p99_latency_ms","max_latency_ms"`
/// then one line per test.
pub fn parse_redis_benchmark_csv(out: &str) -> Vec<RedisBenchRow> {
    let unq = |s: &str| s.trim().trim_matches('"').to_string();
    let mut cols: Vec<String> = Vec::new();
    let mut rows = Vec::new();
    for line in out.lines() {
        let f: Vec<String> = line.split(',').map(unq).collect();
        if f.first().map(|x| x == "test").unwrap_or(false) {
            cols = f;
            continue;
        }
        let col = |name: &str| cols.iter().position(|c| c == name).and_then(|i| f.get(i)?.parse::<f64>().ok());
        if let (Some(test), Some(rps)) = (f.first(), col("rps")) {
            rows.push(RedisBenchRow {
                test: test.clone(),
                rps,
                p50_ms: col("p50_latency_ms").unwrap_or(f64::NAN),
                p99_ms: col("p99_latency_ms").unwrap_or(f64::NAN),
            });
        }
    }
    rows
}

/// Runs `redis-benchmark -t set,get` (the SET test writes the value the GET test reads) with
/// `clients` connections and `requests` requests of `size`-byte values against the Redis on `port`.
pub fn redis_benchmark(
    bin: &Path,
    port: u16,
    size: usize,
    clients: usize,
    requests: usize,
) -> anyhow::Result<Vec<RedisBenchRow>> {
    let out = Command::new(bin)
        .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-t", "set,get", "--csv"])
        .args(["-d", &size.to_string(), "-c", &clients.to_string(), "-n", &requests.to_string()])
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {}", bin.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "redis-benchmark exited with {}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    let rows = parse_redis_benchmark_csv(&String::from_utf8_lossy(&out.stdout));
    anyhow::ensure!(!rows.is_empty(), "no figures in redis-benchmark's output");
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_redis_benchmark_csv() {
        let out = "\"test\",\"rps\",\"avg_latency_ms\",\"min_latency_ms\",\"p50_latency_ms\",\"p95_latency_ms\",\"p99_latency_ms\",\"max_latency_ms\"\n\"SET\",\"1234.57\",\"0.700\",\"0.300\",\"0.650\",\"1.000\",\"1.500\",\"3.000\"\n\"GET\",\"2000.00\",\"0.400\",\"0.200\",\"0.390\",\"0.600\",\"0.900\",\"2.000\"\n";
        let rows = parse_redis_benchmark_csv(out);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].test, "SET");
        assert_eq!(rows[1], RedisBenchRow { test: "GET".into(), rps: 2000.0, p50_ms: 0.39, p99_ms: 0.9 });
        assert!(parse_redis_benchmark_csv("garbage\n").is_empty());
    }
}
