//! A real `redis-server` child for this crate's unit tests (cluster membership, the Redis tier):
//! started on a loopback port, plain or cluster-enabled, frozen, restarted or killed by its pid.
//! Without a `redis-server` the tests that need one fail, saying how to get it.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `redis-server` (or `redis-cli`, its sibling) from `$REDIS_SERVER`, the PATH or /usr/bin.
pub(crate) fn binary(name: &str) -> String {
    if let Ok(p) = std::env::var("REDIS_SERVER") {
        let p = std::path::Path::new(&p);
        assert!(p.is_file(), "$REDIS_SERVER={} is not a file: these tests need a real redis-server", p.display());
        if name == "redis-server" {
            return p.display().to_string();
        }
        if let Some(sibling) = p.parent().map(|d| d.join(name)).filter(|s| s.is_file()) {
            return sibling.display().to_string();
        }
    }
    for dir in std::env::var("PATH").unwrap_or_default().split(':').chain(["/usr/bin", "/usr/local/bin"]) {
        let p = std::path::Path::new(dir).join(name);
        if p.is_file() {
            return p.display().to_string();
        }
    }
    panic!(
        "{name} not found (PATH, /usr/bin, $REDIS_SERVER): these tests need a real Redis. Install it \
         (`apt-get install -y redis-server`; .ci/run does) or point $REDIS_SERVER at one."
    );
}

/// A `redis-server` child on a loopback port; killed by its pid when dropped.
pub(crate) struct RedisProc {
    pub port: u16,
    child: Option<Child>,
    dir: tempfile::TempDir,
    cluster: bool,
}

impl RedisProc {
    /// A server that answers PING; `cluster`: cluster-enabled (for a Redis Cluster of several).
    pub fn start(cluster: bool) -> Self {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut s = RedisProc { port, child: None, dir: tempfile::tempdir().unwrap(), cluster };
        s.restart();
        s
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Starts the server (again) on the same port and data directory; waits until it answers PING.
    pub fn restart(&mut self) {
        assert!(self.child.is_none());
        let mut cmd = Command::new(binary("redis-server"));
        cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path());
        if self.cluster {
            cmd.args(["--cluster-enabled", "yes", "--cluster-node-timeout", "1000"]).args([
                "--cluster-require-full-coverage",
                "no",
                "--cluster-config-file",
                "nodes.conf",
            ]);
        }
        let child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn();
        self.child = Some(child.unwrap_or_else(|e| panic!("starting redis-server: {e}")));
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(mut c) = redis::Client::open(self.url()).and_then(|c| c.get_connection()) {
                if redis::cmd("PING").query::<String>(&mut c).is_ok() {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "redis-server on port {} did not answer within 10 s", self.port);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the server (SIGKILL to the pid this test started) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Freezes (`SIGSTOP`) or thaws (`SIGCONT`) the server: connections stay open, nothing answers.
    /// A freeze returns once every thread of the server is stopped (within 5 s, or it panics):
    /// `kill` returns before that, and until the kernel has stopped them all, the server's other
    /// threads may still answer.
    pub fn freeze(&self, frozen: bool) {
        use rustix::process::{kill_process, Pid, Signal};
        let child = self.child.as_ref().expect("redis-server is running");
        kill_process(Pid::from_child(child), if frozen { Signal::STOP } else { Signal::CONT }).unwrap();
        if !frozen {
            return;
        }
        let pid = child.id();
        let stopped = || {
            let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return false };
            tasks.flatten().all(|t| {
                let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
                // The state follows the command's closing parenthesis.
                stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('T'))
            })
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        while !stopped() {
            assert!(Instant::now() < deadline, "redis-server (pid {pid}) did not stop within 5 s");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// A blocking connection.
    pub fn con(&self) -> redis::Connection {
        redis::Client::open(self.url()).unwrap().get_connection().unwrap()
    }
}

impl Drop for RedisProc {
    fn drop(&mut self) {
        self.kill();
    }
}
