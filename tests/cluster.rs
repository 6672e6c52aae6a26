//! `kvtier serve --cluster redis://...` against a real redis-server: nodes register themselves and
//! see each other; a node that stops gracefully leaves at once, one that is killed is gone after
//! its TTL; Redis killed and restarted leaves the membership stale but whole, then rebuilt; a node
//! without `--cluster` is one node, as before.

use std::time::{Duration, Instant};

use kvtier_tests::redis::{redis_cli, Redis};
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
    node_with(redis, dir, id, "cluster_ttl = \"2s\"\n")
}

/// A DRAM-only member with `extra` settings (which must set `cluster_ttl`).
fn node_with(redis: &Redis, dir: &std::path::Path, id: &str, extra: &str) -> ServerProcess {
    let cfg = dir.join(format!("{id}.toml"));
    std::fs::write(
        &cfg,
        format!(
            "cluster = \"redis://127.0.0.1:{}\"\nnode_id = \"{id}\"\npeer_rebalance = \"off\"\n{extra}",
            redis.port
        ),
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
    until_members(&n1, 2.0, Duration::from_secs(20));
    until_members(&n2, 2.0, Duration::from_secs(20));

    // A graceful stop (SIGTERM): gone well before the 2 s TTL would expire it.
    let pid = rustix::process::Pid::from_raw(n2.child.id() as i32).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let _ = n2.child.wait();
    let left = until_members(&n1, 1.0, Duration::from_secs(5));
    assert!(left < Duration::from_millis(1500), "a graceful leave took {left:?}");

    // Killed (SIGKILL): gone once its TTL runs out, not before. Measured from what its
    // registration had left to live just before the kill (its last refresh may have come late on
    // a busy machine; one still under way at the kill only pushes the expiry further out).
    let mut n3 = node(&redis, dir.path(), "n3");
    until_members(&n1, 2.0, Duration::from_secs(20));
    let read_at = Instant::now();
    let to_live: i64 = redis_cli(redis.port, &["PTTL", "{kvtier}:member:n3"]).trim().parse().unwrap();
    assert!(to_live > 0 && to_live <= 2000, "n3's key has {to_live} ms left of its 2 s TTL");
    let to_live = Duration::from_millis(to_live as u64);
    let _ = n3.child.kill();
    let _ = n3.child.wait();
    until_members(&n1, 1.0, Duration::from_secs(20));
    let gone = read_at.elapsed();
    // 5 ms for Redis's clock (milliseconds, wall time) against this one.
    assert!(
        gone + Duration::from_millis(5) >= to_live,
        "a killed node vanished after {gone:?}, before its TTL ({to_live:?} left)"
    );
    assert!(n1.alive());
}

/// Nodes that don't share `cluster_rf`, auth or `[[tenants]]` say so (each publishes those
/// settings beside its membership, and compares every member's with its own); nodes that share
/// them say nothing. Before, a node with another `cluster_rf` joined silently, and every park
/// through it failed ("held by 3 of 5 nodes") while its sessions were stored.
#[test]
fn members_whose_shared_settings_differ_are_said() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let start = |id: &str, extra: &str| {
        let cfg = dir.path().join(format!("{id}.toml"));
        let text = format!(
            "cluster = \"redis://127.0.0.1:{}\"\nnode_id = \"{id}\"\ncluster_ttl = \"2s\"\npeer_rebalance = \"off\"\n{extra}",
            redis.port
        );
        std::fs::write(&cfg, text).unwrap();
        ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"])
    };
    let mismatched = |s: &ServerProcess| metric(&s.scrape(), "kvtier_membership_mismatched_members", &[]);
    let n1 = start("n1", "cluster_rf = 2\n");
    let n2 = start("n2", "cluster_rf = 2\n");
    until_members(&n1, 2.0, Duration::from_secs(20));
    until_members(&n2, 2.0, Duration::from_secs(20));
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!((mismatched(&n1), mismatched(&n2)), (0.0, 0.0), "the same settings");
    let n3 = start("n3", "cluster_rf = 3\n");
    until_members(&n1, 3.0, Duration::from_secs(20));
    let t = Instant::now();
    while mismatched(&n1) != 1.0 || mismatched(&n2) != 1.0 || mismatched(&n3) != 2.0 {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "n1, n2 see {}, {} members with other settings, n3 {}",
            mismatched(&n1),
            mismatched(&n2),
            mismatched(&n3)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
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

/// Two nodes configured with one `node_id`: the second does not start while the first is alive
/// (exit 1, naming the first's address and the setting), and the first keeps its place. Before,
/// the second took the id over and the first went on taking parks outside the membership. A node
/// killed and started again on other ports takes its id over without waiting for its TTL.
#[test]
fn a_second_node_with_a_live_nodes_id_is_refused_and_a_restart_elsewhere_is_not() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let mut n1 = node(&redis, dir.path(), "n1");
    let n2 = node(&redis, dir.path(), "n2");
    until_members(&n2, 2.0, Duration::from_secs(20));
    let cfg = dir.path().join("n1.toml");
    let twin_dir = tempfile::tempdir().unwrap();
    let (ok, out, err) = cli(&[
        "serve",
        "--config",
        cfg.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--data-listen",
        "127.0.0.1:0",
        "--no-metrics",
        "--data-dir",
        twin_dir.path().to_str().unwrap(),
    ]);
    assert!(!ok, "a twin of n1 started: {out}");
    assert!(err.contains(&n1.grpc.to_string()) && err.contains("node_id"), "{err}");
    assert!(n1.alive(), "n1 stopped");
    // While the twin watches n1's registration it serves nothing: a store sent to it in that time
    // is never acknowledged (it was, and was lost when the twin exited).
    let free = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (grpc, data) = (free(), free());
    let mut twin = std::process::Command::new(kvtier_bin())
        .args(["serve", "--config", cfg.to_str().unwrap(), "--no-metrics"])
        .args(["--listen", &format!("127.0.0.1:{grpc}"), "--data-listen", &format!("127.0.0.1:{data}")])
        .arg("--data-dir")
        .arg(twin_dir.path())
        .env("KVTIER_LOG", "error")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let addr = format!("127.0.0.1:{grpc}");
    let (stored, out, _) = cli(&["put", "--server", &addr, "--timeout", "1s", "--text", "a store nobody keeps"]);
    // The twin exits on its own within its watch; one that doesn't is killed here, not left behind.
    let deadline = Instant::now() + Duration::from_secs(15);
    let exited = loop {
        match twin.try_wait().unwrap() {
            Some(status) => break Some(status),
            None if Instant::now() >= deadline => break None,
            None => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    if exited.is_none() {
        let _ = twin.kill();
        let _ = twin.wait();
    }
    assert!(!stored, "the twin acknowledged a store before its id was checked: {out}");
    assert!(exited.is_some_and(|s| !s.success()), "the twin started: {exited:?}");
    std::thread::sleep(Duration::from_millis(500));
    let advertised = redis_cli(redis.port, &["HGET", "{kvtier}:member:n1", "grpc"]);
    assert_eq!(advertised.trim(), n1.grpc.to_string(), "n1 lost its registration");
    // n1 killed: its registration lives 2 s more; started again on new ports, it takes the id over
    // once the old one goes unrefreshed (about 2 s of refresh intervals, not the TTL to the end).
    let _ = n1.child.kill();
    let _ = n1.child.wait();
    let t = Instant::now();
    let n1b = node(&redis, dir.path(), "n1");
    assert!(t.elapsed() < Duration::from_secs(20), "the restart took {:?}", t.elapsed());
    until_members(&n1b, 2.0, Duration::from_secs(20));
    let advertised = redis_cli(redis.port, &["HGET", "{kvtier}:member:n1", "grpc"]);
    assert_eq!(advertised.trim(), n1b.grpc.to_string());
}

/// Redis killed (its data lost) and started again on the same port: the nodes keep their last
/// membership meanwhile (marked stale, no member dropped even past the TTL), a load across nodes
/// neither hangs nor fails, and when Redis is back the nodes register again — the member set in
/// Redis is whole without a restart of any node, and a node that joins afterwards sees them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_and_restarted_keeps_then_rebuilds_the_membership() {
    let mut redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let mut n1 = node(&redis, dir.path(), "n1");
    let mut n2 = node(&redis, dir.path(), "n2");
    until_members(&n1, 2.0, Duration::from_secs(20));
    until_members(&n2, 2.0, Duration::from_secs(20));
    let (c1, c2) = (n1.client().await, n2.client().await);
    let spec = namespace("acme", b"redis-down", small_layout());
    let ns1 = c1.register(spec.clone()).await.unwrap();
    let ns2 = c2.register(spec).await.unwrap();
    let toks = tokens(7, 16 * 16);
    let payloads = full_block_payloads(&ns1, &toks);
    c1.store(&ns1, &toks, &payloads).await.unwrap().ok().unwrap();

    redis.kill();
    let stale = |n: &ServerProcess| metric(&n.scrape(), "kvtier_membership_stale", &[]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while stale(&n1) != 1.0 || stale(&n2) != 1.0 {
        assert!(Instant::now() < deadline, "the nodes never noticed Redis was gone");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Well past the 2 s TTL: nobody is dropped for Redis's sake.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(members(&n1), 2.0);
    assert_eq!(members(&n2), 2.0);
    // n1's blocks (forwarded to n2 where n2 owns them, loaded from n1 otherwise) still come
    // through n2, promptly.
    let t = Instant::now();
    let loaded = c2.load(&ns2, &toks).await.unwrap();
    assert!(t.elapsed() < Duration::from_secs(3), "a load with Redis down took {:?}", t.elapsed());
    assert!(loaded == payloads, "every block, exact bytes, with Redis down");

    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(15);
    while stale(&n1) != 0.0 || stale(&n2) != 0.0 {
        assert!(Instant::now() < deadline, "the nodes did not notice Redis was back");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The fresh Redis learned both nodes again: a newcomer sees three members.
    let n3 = node(&redis, dir.path(), "n3");
    until_members(&n3, 3.0, Duration::from_secs(20));
    until_members(&n1, 3.0, Duration::from_secs(20));
    assert!(n1.alive() && n2.alive());
}

/// `advertise_host`: the nodes announce the host they are to be dialled at (here `localhost`,
/// with their listeners' ports), and peers and clients dial that: a block stored through one
/// node loads through the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_announce_and_dial_the_advertised_host() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let start = |id: &str| {
        let cfg = dir.path().join(format!("{id}.toml"));
        std::fs::write(
            &cfg,
            format!(
                "cluster = \"{}\"\nnode_id = \"{id}\"\ncluster_ttl = \"2s\"\npeer_rebalance = \"off\"\nadvertise_host = \"localhost\"\npeer_cache = false\n",
                redis.url()
            ),
        )
        .unwrap();
        ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"])
    };
    let (n1, n2) = (start("n1"), start("n2"));
    until_members(&n1, 2.0, Duration::from_secs(20));
    until_members(&n2, 2.0, Duration::from_secs(20));
    let c1 = n1.client().await;
    let members = c1.members().await.unwrap();
    let me = members.members.iter().find(|m| m.id.as_str() == "n1").unwrap();
    assert_eq!(me.grpc_addr, format!("localhost:{}", n1.grpc.port()));
    assert_eq!(me.data_addr, format!("localhost:{}", n1.data.port()));
    let c2 = n2.client().await;
    let spec = namespace("acme", b"advertise", small_layout());
    let (ns1, ns2) = (c1.register(spec.clone()).await.unwrap(), c2.register(spec).await.unwrap());
    let toks = tokens(5, 16 * 16);
    let payloads = full_block_payloads(&ns1, &toks);
    c1.store(&ns1, &toks, &payloads).await.unwrap().ok().unwrap();
    // Forwarding to n2 runs after the acknowledgement: wait until every block loads through n2.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let got = c2.load(&ns2, &toks).await.unwrap();
        if got == payloads {
            break;
        }
        let peer = c2.stats().await.unwrap().tiers.into_iter().find(|t| t.tier == "peer").unwrap();
        assert!(Instant::now() < deadline, "not every block loaded through n2: {peer:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let peer = c2.stats().await.unwrap().tiers.into_iter().find(|t| t.tier == "peer").unwrap();
    assert!(peer.hits > 0, "some blocks came from n1");

    let (ok, _, err) = cli(&["serve", "--no-metrics", "--advertise-host", "box:7070"]);
    assert!(!ok && err.contains("advertise_host"), "{err}");
}

/// A peer killed and started again where it was (same addresses, same data dir) takes the very
/// next blocks forwarded to it: the forwarding node's pooled connections to the old process are
/// found closed and dialled afresh, and the namespace (which a node without a disk tier does not
/// keep over a restart) is registered there again. Before, the first forward went out on a dead
/// socket ("early eof"), its blocks were dropped and the peer skipped for 2 s; and every later
/// forward was refused block by block ("unknown namespace"), for good, counted nowhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_restarted_in_place_takes_the_next_forward() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let cfg = |id: &str| {
        let cfg = dir.path().join(format!("{id}.toml"));
        let text = format!(
            "cluster = \"{}\"\nnode_id = \"{id}\"\ncluster_ttl = \"2s\"\npeer_rebalance = \"off\"\n",
            redis.url()
        );
        std::fs::write(&cfg, text).unwrap();
        cfg.to_str().unwrap().to_string()
    };
    let (cfg1, cfg2) = (cfg("n1"), cfg("n2"));
    let args = |cfg: &str| vec!["--config".to_string(), cfg.to_string(), "--dram-capacity".into(), "64MiB".into()];
    let n1 = ServerProcess::start(&args(&cfg1).iter().map(String::as_str).collect::<Vec<_>>());
    let mut n2 = ServerProcess::start(&args(&cfg2).iter().map(String::as_str).collect::<Vec<_>>());
    until_members(&n1, 2.0, Duration::from_secs(20));
    let c1 = n1.client().await;
    let ns = c1.register(namespace("acme", b"restart", small_layout())).await.unwrap();
    let forwarded = |s: &ServerProcess| metric(&s.scrape(), "kvtier_peer_forwarded_blocks_total", &[]);
    let dropped = |s: &ServerProcess| metric(&s.scrape(), "kvtier_peer_forward_dropped_total", &[]);
    let wait_forwarded = |above: f64| {
        let deadline = Instant::now() + Duration::from_secs(20);
        while forwarded(&n1) <= above {
            assert!(
                Instant::now() < deadline,
                "n1 forwarded nothing more than {above} to n2 in 20 s: {}",
                n1.scrape()
                    .lines()
                    .filter(|l| l.contains("peer") || l.contains("member"))
                    .collect::<Vec<_>>()
                    .join("\n")
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let doc = tokens(11, 32 * 16);
    c1.store(&ns, &doc, &full_block_payloads(&ns, &doc)).await.unwrap().ok().unwrap();
    wait_forwarded(0.0);
    let doc = tokens(13, 32 * 16);
    let b = forwarded(&n1);
    c1.store(&ns, &doc, &full_block_payloads(&ns, &doc)).await.unwrap().ok().unwrap();
    wait_forwarded(b);

    n2.child.kill().unwrap();
    n2.child.wait().unwrap();
    let n2_again = n2.restart_in_place(&args(&cfg2).iter().map(String::as_str).collect::<Vec<_>>());
    until_members(&n1, 2.0, Duration::from_secs(20));
    let (before, dropped_before) = (forwarded(&n1), dropped(&n1));
    let doc = tokens(12, 32 * 16);
    c1.store(&ns, &doc, &full_block_payloads(&ns, &doc)).await.unwrap().ok().unwrap();
    wait_forwarded(before);
    assert_eq!(dropped(&n1), dropped_before, "forwards to the restarted peer were dropped");
    let m = n1.scrape();
    assert!(metric(&m, "kvtier_client_pooled_connections_closed_total", &[]) >= 1.0, "{m}");
    assert!(n2_again.scrape().contains("kvtier_"), "the restarted peer serves");
}

/// In a cluster, a read through the CLI of a namespace no member knows (a typo in `--model`)
/// registers it nowhere, so it takes no slot of a tenant's `max_namespaces`, and says so as on
/// one node; one that another member knows is registered on the node asked and read through it
/// (its blocks come from their owner). Before, every such read registered the namespace for good.
#[test]
fn a_cli_read_of_a_namespace_no_member_knows_registers_nothing() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let (n1, n2) = (node(&redis, dir.path(), "n1"), node(&redis, dir.path(), "n2"));
    until_members(&n1, 2.0, Duration::from_secs(20));
    until_members(&n2, 2.0, Duration::from_secs(20));
    let (a1, a2) = (n1.grpc_addr(), n2.grpc_addr());
    let text = "a prefix stored through the first node, read through the second";
    for cmd in ["lookup", "get", "route"] {
        let (ok, out, err) = cli(&[cmd, "--server", &a2, "--text", text, "--model", "typo"]);
        assert!(ok && out.contains("the node holds no such namespace"), "{cmd}: {out} {err}");
    }
    let (ok, out, err) = cli(&["session", "ls", "--server", &a2, "--model", "typo"]);
    assert!(ok, "{out} {err}");
    for n in [&n1, &n2] {
        assert_eq!(metric(&n.scrape(), "kvtier_namespaces", &[]), 0.0, "a read registered a namespace");
    }
    let (ok, out, err) = cli(&["put", "--server", &a1, "--text", text, "--model", "real"]);
    assert!(ok, "{out} {err}");
    let (ok, out, err) = cli(&["lookup", "--server", &a2, "--text", text, "--model", "real"]);
    assert!(ok && out.starts_with(&format!("{} of", text.len() / 16 * 16)), "read through n2: {out} {err}");
    assert_eq!(metric(&n2.scrape(), "kvtier_namespaces", &[]), 1.0);
}

/// In a cluster, `kvtier session ls` asks every member and lists each session once, with the
/// members holding a copy; `--here` lists the node asked's copies alone; a member that does not
/// answer is said, and the others' copies are still listed. Before, only the node asked's were.
#[test]
fn a_cli_session_list_in_a_cluster_asks_every_member() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    // Two copies of each session; a killed member stays listed for 30 s.
    let extra = "cluster_rf = 2\ncluster_ttl = \"30s\"\n";
    let (mut n1, n2) = (node_with(&redis, dir.path(), "n1", extra), node_with(&redis, dir.path(), "n2", extra));
    until_members(&n1, 2.0, Duration::from_secs(20));
    until_members(&n2, 2.0, Duration::from_secs(20));
    let (a1, a2) = (n1.grpc_addr(), n2.grpc_addr());
    let text = "a session parked through the first node, listed through the second";
    let (ok, out, err) = cli(&["session", "park", "--server", &a1, "--id", "s1", "--text", text]);
    assert!(ok, "{out} {err}");
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (ok, out, err) = cli(&["session", "ls", "--server", &a2]);
        assert!(ok, "{out} {err}");
        if out.starts_with("1 session(s)") && out.contains(" s1 ") && out.trim_end().ends_with("on n1, n2") {
            break;
        }
        assert!(Instant::now() < deadline, "not listed once with both holders: {out}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let (ok, out, err) = cli(&["session", "ls", "--server", &a2, "--here"]);
    assert!(ok && out.starts_with("1 session(s) on n2 alone\n"), "{out} {err}");
    assert!(out.contains(" s1 ") && !out.contains("  on "), "{out} {err}");

    // A member that hangs (stopped) holds the listing up a few seconds, not the whole --timeout,
    // and so does the check that some member knows the namespace; then one that is gone.
    let pid = rustix::process::Pid::from_child(&n1.child);
    stop_process(n1.child.id());
    let t = Instant::now();
    let (ok, out, err) = cli(&["session", "ls", "--server", &a2]);
    let took = t.elapsed();
    rustix::process::kill_process(pid, rustix::process::Signal::CONT).unwrap();
    assert!(ok && took < Duration::from_secs(20), "{took:?}: {out} {err}");
    assert!(err.contains("note: member n1 did not answer"), "{err}");
    assert!(out.starts_with("1 session(s)") && out.trim_end().ends_with("on n2"), "{out}");
    let _ = n1.child.kill();
    let _ = n1.child.wait();
    let (ok, out, err) = cli(&["session", "ls", "--server", &a2, "--all"]);
    assert!(ok, "{out} {err}");
    assert!(err.contains("note: member n1 did not answer"), "{err}");
    assert!(out.starts_with("1 session(s)") && out.trim_end().ends_with("on n2"), "{out}");
}

/// After the only holder of a session left the cluster (a graceful stop leaves at once, and its
/// copies with it), `session ls` through the other member lists nothing and says on stderr which
/// member left and that what only it held is not listed. Before, it said "0 session(s)" alone.
#[test]
fn a_cli_session_list_names_the_members_that_left() {
    let redis = Redis::start();
    let dir = tempfile::tempdir().unwrap();
    let (n1, mut n2) = (node_with(&redis, dir.path(), "n1", ""), node_with(&redis, dir.path(), "n2", ""));
    until_members(&n1, 2.0, Duration::from_secs(20));
    until_members(&n2, 2.0, Duration::from_secs(20));
    let (a1, a2) = (n1.grpc_addr(), n2.grpc_addr());
    let (ok, out, err) = cli(&["session", "park", "--server", &a2, "--id", "s1", "--text", "held by n2 alone"]);
    assert!(ok, "{out} {err}");
    let (ok, out, err) = cli(&["session", "ls", "--server", &a1]);
    assert!(ok && out.starts_with("1 session(s)") && !err.contains("left the cluster"), "{out} {err}");

    let pid = rustix::process::Pid::from_child(&n2.child);
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    let _ = n2.child.wait();
    until_members(&n1, 1.0, Duration::from_secs(20));
    let (ok, out, err) = cli(&["session", "ls", "--server", &a1]);
    assert!(ok && out.starts_with("0 session(s)"), "{out} {err}");
    assert!(
        err.contains("note: member n2 (") && err.contains("left the cluster: the sessions only it held are not listed"),
        "{err}"
    );
}
