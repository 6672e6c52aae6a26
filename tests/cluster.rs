//! `kvtier serve --cluster redis://...` against a real redis-server: nodes register themselves and
//! see each other; a node that stops gracefully leaves at once, one that is killed is gone after
//! its TTL; a node without `--cluster` is one node, as before.

use std::time::{Duration, Instant};

use kvtier_tests::redis::Redis;
use kvtier_tests::*;

fn members(server: &ServerProcess) -> f64 {
    metric(&server.scrape(), "kvtier_membership_members", &[])
}

/// Waits until `server` counts `n` members; how long that took.
fn until_members(server: &ServerProcess, n: f64, within: Duration) -> Duration {
    let t = Instant::now();
    while members(server) != n {
        assert!(t.elapsed() < within, "still {} members after {within:?}, expected {n}", members(server));
        std::thread::sleep(Duration::from_millis(50));
    }
    t.elapsed()
}

fn node(redis: &Redis, dir: &std::path::Path, id: &str) -> ServerProcess {
    let cfg = dir.join(format!("{id}.toml"));
    std::fs::write(
        &cfg,
        format!("cluster = \"redis://127.0.0.1:{}\"\nnode_id = \"{id}\"\ncluster_ttl = \"2s\"\n", redis.port),
    )
    .unwrap();
    ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"])
}

#[test]
fn nodes_see_each_other_leave_at_once_and_expire_when_killed() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let mut n1 = node(&redis, dir.path(), "n1");
    let mut n2 = node(&redis, dir.path(), "n2");
    until_members(&n1, 2.0, Duration::from_secs(10));
    until_members(&n2, 2.0, Duration::from_secs(10));

    // A graceful stop (SIGTERM): gone well before the 2 s TTL would expire it.
    let pid = rustix::process::Pid::from_raw(n2.child.id() as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let _ = n2.child.wait();
    let left = until_members(&n1, 1.0, Duration::from_secs(5));
    assert!(left < Duration::from_millis(1500), "a graceful leave took {left:?}");

    // Killed (SIGKILL): gone once its TTL runs out, not before.
    let mut n3 = node(&redis, dir.path(), "n3");
    until_members(&n1, 2.0, Duration::from_secs(10));
    let _ = n3.child.kill();
    let _ = n3.child.wait();
    let gone = until_members(&n1, 1.0, Duration::from_secs(10));
    assert!(gone >= Duration::from_millis(800), "a killed node vanished after {gone:?}, before its TTL");
    assert!(n1.alive());
}

#[test]
fn a_bad_cluster_url_is_refused_at_start() {
    let (ok, _, err) = cli(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--data-listen",
        "127.0.0.1:0",
        "--no-metrics",
        "--cluster",
        "http://x",
    ]);
    assert!(!ok && err.contains("cluster"), "{err}");
}
