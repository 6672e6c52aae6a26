//! A real `redis-server` on a free loopback port (`$REDIS_SERVER` or the PATH), for the cluster
//! tests; killed by its pid when dropped. And the placement the nodes of such a test cluster
//! compute, so a test knows which node owns a key.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Redis {
    child: Child,
    pub port: u16,
    _dir: tempfile::TempDir,
}

impl Redis {
    pub fn start() -> Redis {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let dir = tempfile::tempdir().unwrap();
        let child = spawn(port, dir.path());
        Redis { child, port, _dir: dir }
    }

    /// Kills this redis-server (SIGKILL: its data is gone, as after a crash).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// A fresh, empty redis-server on the same port (after [`Redis::kill`]).
    pub fn restart(&mut self) {
        self.kill();
        self.child = spawn(self.port, self._dir.path());
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

/// Starts `redis-server` on `port` and waits until it accepts connections.
fn spawn(port: u16, dir: &std::path::Path) -> Child {
    let bin = std::env::var("REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
    let child = Command::new(&bin)
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{bin}: {e} (the cluster tests need redis-server: apt-get install redis-server)"));
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "redis-server did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The placement every node of a test cluster computes: members `ids` on this host (the
/// hostname label every node gets), `capacity` bytes of DRAM each.
pub fn placement(ids: &[&str], capacity: u64) -> kvtier_server::cluster::Placement {
    use kvtier_server::cluster::{Labels, Member, NodeId, Placement};
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_default();
    let members: Vec<Member> = ids
        .iter()
        .map(|id| Member {
            id: NodeId::new(*id).expect("a node id"),
            grpc_addr: String::new(),
            data_addr: String::new(),
            labels: Labels::new(Some(&host), None, None),
            capacity,
            since_ms: 0,
        })
        .collect();
    Placement::new(&members)
}

/// Runs `redis-cli -p <port> <args>` (next to `$REDIS_SERVER` or on the PATH); its stdout.
pub fn redis_cli(port: u16, args: &[&str]) -> String {
    let bin = std::env::var("REDIS_SERVER")
        .ok()
        .and_then(|s| std::path::Path::new(&s).parent().map(|d| d.join("redis-cli")))
        .filter(|p| p.is_file())
        .map_or_else(|| "redis-cli".to_string(), |p| p.display().to_string());
    let out =
        Command::new(&bin).args(["-p", &port.to_string()]).args(args).output().unwrap_or_else(|e| panic!("{bin}: {e}"));
    assert!(out.status.success(), "redis-cli {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The keys matching `pattern` on the server at `port` (its own keys only, on a cluster node).
pub fn redis_keys(port: u16, pattern: &str) -> Vec<String> {
    redis_cli(port, &["--scan", "--pattern", pattern]).lines().filter(|l| !l.is_empty()).map(String::from).collect()
}

/// Three cluster-enabled `redis-server`s joined as a Redis Cluster of three masters without
/// replicas, `cluster-require-full-coverage no` (the others keep serving when one dies) and a
/// 1 s node timeout; each killed by its pid when dropped.
pub struct RedisCluster {
    pub masters: Vec<Option<Child>>,
    pub ports: Vec<u16>,
    _dirs: Vec<tempfile::TempDir>,
}

impl RedisCluster {
    pub fn start() -> RedisCluster {
        let bin = std::env::var("REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
        let mut c = RedisCluster { masters: Vec::new(), ports: Vec::new(), _dirs: Vec::new() };
        for _ in 0..3 {
            let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            let dir = tempfile::tempdir().unwrap();
            let child = Command::new(&bin)
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "1000"])
                .args(["--cluster-require-full-coverage", "no", "--cluster-config-file", "nodes.conf"])
                .arg("--dir")
                .arg(dir.path())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| panic!("{bin}: {e}"));
            c.masters.push(Some(child));
            c.ports.push(port);
            c._dirs.push(dir);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        for &p in &c.ports {
            while std::net::TcpStream::connect(("127.0.0.1", p)).is_err() {
                assert!(Instant::now() < deadline, "redis-server did not start");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let addrs: Vec<String> = c.ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let mut args = vec!["--cluster", "create"];
        args.extend(addrs.iter().map(String::as_str));
        args.push("--cluster-yes");
        redis_cli(c.ports[0], &args);
        let deadline = Instant::now() + Duration::from_secs(20);
        for &p in &c.ports {
            while !redis_cli(p, &["CLUSTER", "INFO"]).contains("cluster_state:ok") {
                assert!(Instant::now() < deadline, "the Redis Cluster did not become ok");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        c
    }

    pub fn urls(&self) -> Vec<String> {
        self.ports.iter().map(|p| format!("redis://127.0.0.1:{p}")).collect()
    }

    /// Kills master `i` (SIGKILL to the pid this test started).
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.masters[i].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for i in 0..self.masters.len() {
            self.kill(i);
        }
    }
}
