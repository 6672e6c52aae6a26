//! Test support: starts real `kvtier` server processes on loopback (ephemeral ports, a fresh data
//! directory each) and builds namespaces and payloads whose bytes can be checked.
//!
//! - [`fabric`]: the agent's loopback fabric as a node's one-sided fabric (no RDMA NIC here).
//! - [`faults`]: a fault-injecting wrapper for any byte stream (delay, stall, cut, corrupt).
//! - [`harness`]: N real nodes in this process, their data planes reached over in-memory streams
//!   (or Unix sockets) through that wrapper.
//! - [`raw`]: a blocking data-plane connection that sends hand-built requests.
//! - [`redis`]: a real `redis-server` on loopback for the cluster tests.

pub mod fabric;
pub mod faults;
pub mod harness;
pub mod raw;
pub mod redis;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvtier_client::{ClientConfig, KvClient, NamespaceHandle};
use kvtier_proto::{BlockKey, DType, HashScheme, KvLayout, Namespace};

/// The `kvtier` binary of this build (`cargo build --bins` puts it beside the test binaries).
pub fn kvtier_bin() -> PathBuf {
    if let Ok(p) = std::env::var("KVTIER_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("test binary path");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target profile directory");
    let bin = dir.join("kvtier");
    assert!(
        bin.exists(),
        "{} is missing: run `cargo build --bins` before the tests (the README's test command does)",
        bin.display()
    );
    bin
}

/// A running server process; killed (by its pid) when dropped.
pub struct ServerProcess {
    pub child: Child,
    pub grpc: SocketAddr,
    pub data: SocketAddr,
    pub metrics: Option<SocketAddr>,
    /// The data directory (a fresh temporary one unless the test gave its own).
    pub dir: PathBuf,
    _tmp: Option<tempfile::TempDir>,
    pub stdout: Vec<String>,
}

impl ServerProcess {
    /// Starts `kvtier serve` on ephemeral loopback ports with `extra` flags.
    pub fn start(extra: &[&str]) -> ServerProcess {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().to_path_buf();
        let mut s = Self::start_in(&dir, extra);
        s._tmp = Some(tmp);
        s
    }

    /// [`ServerProcess::start`] with `env` set in the server's environment.
    pub fn start_env(extra: &[&str], env: &[(&str, &str)]) -> ServerProcess {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().to_path_buf();
        let mut s = Self::start_in_env(&dir, extra, env);
        s._tmp = Some(tmp);
        s
    }

    /// Starts a server on a data directory the test owns (to restart on it).
    pub fn start_in(dir: &std::path::Path, extra: &[&str]) -> ServerProcess {
        Self::start_in_env(dir, extra, &[])
    }

    /// A server started again where `self` ran: the same data directory and listening addresses
    /// (its peers and clients find it where it was), with `extra` flags. `self` must have stopped.
    /// The temporary data directory `self` made, if any, goes with the new process (dropping
    /// `self` no longer removes it from under the new one).
    pub fn restart_in_place(&mut self, extra: &[&str]) -> ServerProcess {
        let (grpc, data) = (self.grpc.to_string(), self.data.to_string());
        let mut again = Self::start_with(&self.dir, [&grpc, &data], extra, &[]);
        again._tmp = self._tmp.take();
        again
    }

    fn start_in_env(dir: &std::path::Path, extra: &[&str], env: &[(&str, &str)]) -> ServerProcess {
        Self::start_with(dir, ["127.0.0.1:0", "127.0.0.1:0"], extra, env)
    }

    fn start_with(dir: &std::path::Path, listen: [&str; 2], extra: &[&str], env: &[(&str, &str)]) -> ServerProcess {
        let mut cmd = Command::new(kvtier_bin());
        cmd.arg("serve")
            .args(["--listen", listen[0], "--data-listen", listen[1], "--metrics", "127.0.0.1:0"])
            .arg("--data-dir")
            .arg(dir)
            .args(extra)
            .env_remove("KVTIER_CONFIG")
            .env_remove(kvtier_proto::tcp::CONGESTION_ENV)
            // `KVTIER_TEST_LOG=info cargo test ...` shows the nodes' logs at that level.
            .env("KVTIER_LOG", std::env::var("KVTIER_TEST_LOG").unwrap_or_else(|_| "warn".into()))
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().expect("spawn kvtier serve");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut seen = Vec::new();
        while Instant::now() < deadline {
            let Some(Ok(line)) = lines.next() else { break };
            seen.push(line.clone());
            if line.contains("listening") {
                let field = |name: &str| {
                    line.split_whitespace()
                        .find_map(|w| w.strip_prefix(&format!("{name}=")))
                        .map(|v| v.trim_start_matches("http://").trim_end_matches("/metrics").to_string())
                };
                let grpc = field("grpc").and_then(|v| v.parse().ok()).expect("grpc address");
                let data = field("data").and_then(|v| v.parse().ok()).expect("data address");
                let metrics = field("metrics").and_then(|v| v.parse().ok());
                // Keep draining stdout so the server never blocks on a full pipe.
                std::thread::spawn(move || for _ in lines {});
                return ServerProcess { child, grpc, data, metrics, dir: dir.to_path_buf(), _tmp: None, stdout: seen };
            }
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("kvtier serve did not report its addresses; stdout: {seen:?}");
    }

    pub fn grpc_addr(&self) -> String {
        self.grpc.to_string()
    }

    pub async fn client(&self) -> KvClient {
        KvClient::connect(&self.grpc_addr(), ClientConfig::default()).await.expect("connect")
    }

    /// The Prometheus text from `/metrics`.
    pub fn scrape(&self) -> String {
        let addr = self.metrics.expect("metrics enabled");
        let mut s = std::net::TcpStream::connect(addr).expect("connect metrics");
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").expect("write");
        let mut out = String::new();
        s.read_to_string(&mut out).expect("read");
        out
    }

    /// Is the process still running?
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sum of a metric's samples whose label set contains every `labels` pair.
pub fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| labels.iter().all(|(k, v)| l.contains(&format!("{k}=\"{v}\""))))
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .sum()
}

/// Waits (up to 15 s) until `node`'s metric `name` (summed over the samples with `labels`)
/// reaches `at_least`. A count raised after the effect a test saw (a retry counted once its
/// answer is back and saved) is read by polling, not once.
pub fn until_metric(node: &ServerProcess, name: &str, labels: &[(&str, &str)], at_least: f64) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let now = metric(&node.scrape(), name, labels);
        if now >= at_least {
            return;
        }
        assert!(Instant::now() < deadline, "{name} {labels:?} stayed at {now}, expected {at_least} or more");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits (up to 15 s) until every one of `nodes` counts `n` cluster members.
pub fn until_members<'a>(nodes: impl IntoIterator<Item = &'a ServerProcess>, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(15);
    for s in nodes {
        while metric(&s.scrape(), "kvtier_membership_members", &[]) != n as f64 {
            assert!(Instant::now() < deadline, "the nodes did not see {n} members");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Stops process `pid` (SIGSTOP) and returns once every one of its threads is stopped. `kill`
/// returns before that: the kernel wakes one thread to take the signal, and until it has, the
/// process's other threads go on answering requests that arrive — a test that sends a request
/// right after `kill` could be answered by the "stalled" process.
pub fn stop_process(pid: u32) {
    let raw = rustix::process::Pid::from_raw(pid as i32).expect("a child's pid is positive");
    rustix::process::kill_process(raw, rustix::process::Signal::STOP).expect("SIGSTOP to a child");
    let deadline = Instant::now() + Duration::from_secs(5);
    let stopped = || {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return false };
        tasks.flatten().all(|t| {
            let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
            // The state follows the command's closing parenthesis.
            stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('T'))
        })
    };
    while !stopped() {
        assert!(Instant::now() < deadline, "process {pid} did not stop");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Lets a process stopped by [`stop_process`] go on (SIGCONT).
pub fn continue_process(pid: u32) {
    let raw = rustix::process::Pid::from_raw(pid as i32).expect("a child's pid is positive");
    rustix::process::kill_process(raw, rustix::process::Signal::CONT).expect("SIGCONT to a child");
}

/// A small layout: 4 layers, 2 KV heads of 64, fp16, 16 tokens per block = 32 KiB per block.
pub fn small_layout() -> KvLayout {
    KvLayout::new(4, 2, 64, DType::Fp16, 16)
}

/// A tiny layout for long contexts: 1 layer, 1 head of 16, fp16, 16 tokens = 1 KiB per block.
pub fn tiny_layout() -> KvLayout {
    KvLayout::new(1, 1, 16, DType::Fp16, 16)
}

pub fn namespace(tenant: &str, salt: &[u8], layout: KvLayout) -> Namespace {
    Namespace::new(tenant, "test-model@1", layout, HashScheme::Blake3, salt)
}

/// Deterministic payload bytes for a block, derived from its key (so any reader can check them).
pub fn payload_for(key: &BlockKey, len: u64) -> Bytes {
    let mut out = vec![0u8; len as usize];
    blake3::Hasher::new().update(b"payload").update(&key.0).finalize_xof().fill(&mut out);
    Bytes::from(out)
}

/// Payloads of every full block of `tokens`.
pub fn full_block_payloads(ns: &NamespaceHandle, tokens: &[u32]) -> Vec<Bytes> {
    ns.keys(tokens).iter().map(|k| payload_for(k, ns.block_bytes())).collect()
}

/// Payloads of every full block of `tokens` then its tail, as a session parks them.
pub fn session_payloads(ns: &NamespaceHandle, tokens: &[u32]) -> Vec<Bytes> {
    let mut v = full_block_payloads(ns, tokens);
    if let Some(t) = ns.tail_key(tokens) {
        let n = (tokens.len() % ns.block_tokens()) as u32;
        v.push(payload_for(&t, ns.namespace.layout.bytes_for_tokens(n)));
    }
    v
}

/// `n` tokens of a document identified by `seed`.
pub fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| seed.wrapping_mul(1_000_003).wrapping_add(i.wrapping_mul(7919)) % 128_000).collect()
}

/// Runs a `kvtier` client subcommand; returns (success, stdout, stderr).
pub fn cli(args: &[&str]) -> (bool, String, String) {
    use std::io::Read;
    let mut child = Command::new(kvtier_bin())
        .args(args)
        .env_remove("KVTIER_SERVER")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run kvtier");
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = r.read_to_end(&mut v);
            String::from_utf8_lossy(&v).into_owned()
        })
    };
    let out = drain(Box::new(child.stdout.take().expect("piped stdout")));
    let err = drain(Box::new(child.stderr.take().expect("piped stderr")));
    // A command that should have ended (a `serve` expected to refuse to start, a client command
    // against a node that hangs) fails the test instead of hanging it.
    let deadline = Instant::now() + CLI_LIMIT;
    let status = loop {
        match child.try_wait().expect("wait for kvtier") {
            Some(status) => break Some(status),
            None if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            None => std::thread::sleep(Duration::from_millis(10)),
        }
    };
    let (out, mut err) = (out.join().unwrap_or_default(), err.join().unwrap_or_default());
    if status.is_none() {
        err.push_str(&format!("\n[killed by the test: still running after {CLI_LIMIT:?}]"));
    }
    (status.is_some_and(|s| s.success()), out, err)
}

/// Longest a [`cli`] command may run.
const CLI_LIMIT: Duration = Duration::from_secs(120);
