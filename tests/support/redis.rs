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
        })
        .collect();
    Placement::new(&members)
}
