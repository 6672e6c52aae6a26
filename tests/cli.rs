//! The `kvtier` binary by hand: serve on flags, round-trip a block with the CLI, sessions, stats,
//! `/metrics`, and configuration errors that name the setting at fault.

use std::process::Command;

use kvtier_client::ItemStatus;
use kvtier_tests::*;

#[test]
fn cli_round_trip_sessions_stats_and_metrics() {
    let server = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    assert!(server.stdout[0].contains("dram=64MiB"), "{:?}", server.stdout);
    let addr = server.grpc_addr();
    let text = "The quick brown fox jumps over the lazy dog while the KV cache waits in DRAM.";
    let dir = tempfile::tempdir().unwrap();

    // put with a real payload file: 4 full blocks of 16 tokens in the CLI's default demo layout
    // (4 layers x 2 KV heads x 64 x fp16 = 2 KiB per token, 32 KiB per block).
    let block = 2 * 4 * 2 * 64 * 2 * 16;
    let payload: Vec<u8> = (0..4 * block).map(|i| (i * 31 % 251) as u8).collect();
    let file = dir.path().join("kv.bin");
    std::fs::write(&file, &payload).unwrap();
    let (ok, out, err) = cli(&["put", "--server", &addr, "--text", text, "--file", file.to_str().unwrap()]);
    assert!(ok, "{err}");
    assert!(out.contains("stored 4 of 4 block(s)"), "{out}");

    let back = dir.path().join("back.bin");
    let (ok, out, err) = cli(&["get", "--server", &addr, "--text", text, "--out", back.to_str().unwrap()]);
    assert!(ok, "{err}");
    assert!(out.contains("loaded 4 block(s) = 64 tokens"), "{out}");
    assert_eq!(std::fs::read(&back).unwrap(), payload, "get returned other bytes than put stored");

    let (ok, out, _) = cli(&["lookup", "--server", &addr, "--text", text]);
    assert!(ok && out.contains("64 of 77 tokens are stored"), "{out}");
    // A different salt is a different namespace: nothing.
    let (ok, out, _) = cli(&["lookup", "--server", &addr, "--text", text, "--salt", "other"]);
    assert!(ok && out.contains("0 of 77 tokens"), "{out}");

    // A wrong-sized payload file is refused before anything is sent.
    std::fs::write(&file, [0u8; 10]).unwrap();
    let (ok, _, err) = cli(&["put", "--server", &addr, "--text", text, "--file", file.to_str().unwrap()]);
    assert!(!ok && err.contains("need exactly"), "{err}");

    // Sessions: park (synthetic payload), extend, resume, ls, drop.
    let (ok, out, err) =
        cli(&["session", "park", "--server", &addr, "--id", "agent-1", "--text", text, "--ttl", "10m"]);
    assert!(ok, "{err}");
    assert!(out.contains("v1: 77 tokens, 4 blocks + tail"), "{out}");
    let longer = format!("{text} And then the agent thought for a while before its next turn.");
    let (ok, out, err) = cli(&["session", "extend", "--server", &addr, "--id", "agent-1", "--text", &longer]);
    assert!(ok, "{err}");
    assert!(out.contains("to v2"), "{out}");
    let (ok, out, err) = cli(&["session", "resume", "--server", &addr, "--id", "agent-1"]);
    assert!(ok, "{err}");
    assert!(out.contains(&format!("{} tokens in 9 block(s)", longer.len())), "{out}");
    // The same blocks as the resume counts: 8 full ones and the tail (it said "8 blocks").
    let (ok, out, _) = cli(&["session", "ls", "--server", &addr]);
    assert!(ok && out.contains("1 session(s)") && out.contains("agent-1") && out.contains("8 + tail blocks"), "{out}");
    let (ok, out, _) = cli(&["session", "drop", "--server", &addr, "--id", "agent-1"]);
    assert!(ok && out.contains("dropped"), "{out}");
    let (ok, _, err) = cli(&["session", "resume", "--server", &addr, "--id", "agent-1"]);
    assert!(!ok && err.contains("KV:Session:NotFound"), "{err}");
    // Dropping it again: nothing to drop is a failure, as the resume is (it exited 0).
    let (ok, _, err) = cli(&["session", "drop", "--server", &addr, "--id", "agent-1"]);
    assert!(!ok && err.contains("KV:Session:NotFound: no session \"agent-1\""), "{err}");

    let (ok, out, _) = cli(&["stats", "--server", &addr]);
    assert!(ok && out.contains("dram:") && out.contains("hits"), "{out}");

    let m = server.scrape();
    assert!(m.starts_with("HTTP/1.1 200"), "{m}");
    assert!(metric(&m, "kvtier_tier_hits_total", &[("tier", "dram")]) >= 4.0, "{m}");
    assert!(metric(&m, "kvtier_tier_resident_bytes", &[("tier", "dram")]) > 0.0, "{m}");
    assert!(m.contains("kvtier_request_seconds_bucket"), "latency histograms: {m}");
    // Every family says what it is (`# HELP`, from cache-server/src/metric_catalog.rs), and a
    // label-less counter is there at 0 before its first event.
    let typed: Vec<&str> =
        m.lines().filter_map(|l| l.strip_prefix("# TYPE kvtier_")).filter_map(|l| l.split(' ').next()).collect();
    assert!(typed.len() > 50, "{m}");
    let undescribed: Vec<&&str> = typed.iter().filter(|n| !m.contains(&format!("\n# HELP kvtier_{n} "))).collect();
    assert!(undescribed.is_empty(), "kvtier_ families without a # HELP line: {undescribed:?}\n{m}");
    assert!(m.lines().any(|l| l == "kvtier_membership_superseded_total 0"), "{m}");

    // A client pointed at nothing fails fast with a clear message.
    let (ok, _, err) = cli(&["stats", "--server", "127.0.0.1:1"]);
    assert!(!ok && err.contains("127.0.0.1:1"), "{err}");
}

fn serve_fails(args: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(kvtier_bin());
    cmd.arg("serve").arg("--no-metrics");
    // Ephemeral defaults for whatever the case doesn't set itself.
    for flag in ["--listen", "--data-listen"] {
        if !args.contains(&flag) {
            cmd.args([flag, "127.0.0.1:0"]);
        }
    }
    if !args.contains(&"--data-dir") {
        cmd.arg("--data-dir").arg(dir.path());
    }
    let out = cmd.args(args).env("KVTIER_LOG", "warn").output().unwrap();
    assert!(!out.status.success(), "serve {args:?} should fail");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn bad_configuration_is_refused_at_start_with_the_setting_named() {
    let err = serve_fails(&["--dram-capacity", "12parsecs"]);
    assert!(err.contains("parsecs"), "{err}");
    let err = serve_fails(&["--dram-capacity", "100KiB"]);
    assert!(err.contains("dram_capacity"), "{err}");
    let err = serve_fails(&["--listen", "0.0.0.0:0"]);
    assert!(err.contains("auth_token"), "{err}");
    let err = serve_fails(&["--disk-capacity", "64MiB", "--disk-codec", "zstd"]);
    assert!(err.contains("disk_codec \"zstd\"") && err.contains("nvfp4+had+lz4"), "{err}");
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("bad.toml");
    std::fs::write(&cfg, "dram_capacty = \"1GiB\"\n").unwrap();
    let err = serve_fails(&["--config", cfg.to_str().unwrap()]);
    assert!(err.contains("dram_capacty"), "{err}");
    let err = serve_fails(&["--config", "/nonexistent/kvtier.toml"]);
    assert!(err.contains("/nonexistent/kvtier.toml"), "{err}");
    // A data directory that is a file.
    let file = dir.path().join("not-a-dir");
    std::fs::write(&file, b"x").unwrap();
    let err = serve_fails(&["--data-dir", file.to_str().unwrap()]);
    assert!(err.contains("data_dir"), "{err}");
    // A port already taken.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let err = serve_fails(&["--data-listen", &addr]);
    assert!(err.contains("data_listen") && err.contains(&addr), "{err}");
    // One-sided leases asked for where they can't be had (no `rdma` feature in this build, or
    // no verbs device on this machine): the start stops and says which.
    let err = serve_fails(&["--rdma-device", "mlx5_0"]);
    assert!(err.contains("--rdma-device mlx5_0") && err.contains("rdma"), "{err}");
    // CPUs: a list that doesn't parse, and one the kernel refuses (no such CPU online).
    let err = serve_fails(&["--cpus", "3-1"]);
    assert!(err.contains("cpus = \"3-1\"") && err.contains("backwards"), "{err}");
    let err = serve_fails(&["--cpus", "1000"]);
    assert!(err.contains("cpus [1000]") && err.contains("refused") && err.contains("may use"), "{err}");
}

/// `--cpus` confines every thread of the node to the CPUs named, and the node serves.
#[test]
fn a_node_on_one_cpu_runs_every_thread_there_and_serves() {
    let allowed = kvtier_server::affinity::allowed().unwrap();
    let cpu = allowed.last().unwrap().to_string();
    let server = ServerProcess::start(&["--dram-capacity", "64MiB", "--cpus", &cpu]);
    let tasks: Vec<_> = std::fs::read_dir(format!("/proc/{}/task", server.child.id())).unwrap().flatten().collect();
    assert!(tasks.len() > 1, "a node runs several threads");
    for task in tasks {
        let status = std::fs::read_to_string(task.path().join("status")).unwrap();
        let list = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).unwrap().trim();
        assert_eq!(list, cpu, "thread {:?} of the node", task.file_name());
    }
    let (ok, out, err) = cli(&["put", "--server", &server.grpc_addr(), "--text", "one CPU is enough"]);
    assert!(ok && out.contains("stored"), "{out} {err}");
}

#[test]
fn auth_token_is_enforced_on_both_planes() {
    let token = "a-long-enough-shared-secret";
    let server = ServerProcess::start(&["--auth-token", token]);
    let addr = server.grpc_addr();
    let (ok, _, err) = cli(&["stats", "--server", &addr]);
    assert!(!ok && err.contains("unauthenticated"), "{err}");
    let (ok, out, err) = cli(&[
        "put",
        "--server",
        &addr,
        "--auth-token",
        token,
        "--tokens",
        &(0..32).map(|i| i.to_string()).collect::<Vec<_>>().join(","),
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("stored 2 of 2"), "{out}");
}

#[test]
fn kvtier_plan_runs_the_capacity_planner() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().to_str().unwrap();
    let (ok, out, err) = cli(&["plan", "--model", "llama-3-8b", "--codec", "fp8", "--out", out_dir]);
    assert!(ok, "{err}");
    assert!(dir.path().join("results.json").exists(), "the planner writes its JSON where --out says");
    // Llama-3-8B in fp8: 2 x 32 layers x 8 heads x 128 = 65536 elements per token, plus scales.
    assert!(out.contains("KV per token"), "{out}");
    assert!(out.contains("Llama-3-8B"), "{out}");
}

/// `KVTIER_SAME_HOST_CONGESTION` in the server's environment: a same-host client's data-plane
/// connection takes the congestion control it names (counted by name), a name the kernel lacks
/// is counted as refused and changes nothing else, and unset, nothing is set or counted; blocks
/// come back whole every way; and an answer says its connection was alone (`ANSWER_ALONE`) only
/// where the server switches per request (unset: `auto`).
#[tokio::test]
async fn same_host_connections_take_the_congestion_control_asked_for_and_a_bad_name_only_counts() {
    for (env, counted) in [
        (Some("reno"), Some("reno")),
        (Some("no-such-cc,also-none"), Some("refused")),
        (Some("system"), None),
        (None, None),
    ] {
        let vars: Vec<(&str, &str)> = env.map(|v| (kvtier_proto::tcp::CONGESTION_ENV, v)).into_iter().collect();
        let server = ServerProcess::start_env(&["--dram-capacity", "64MiB"], &vars);
        let client = server.client().await;
        let h = client.register(namespace("congestion", b"c", small_layout())).await.unwrap();
        let bb = h.block_bytes() as usize;
        let keys = h.keys(&tokens(3, 32));
        let blocks: Vec<Vec<u8>> =
            (0..keys.len()).map(|k| (0..bb).map(|i| ((i + 7 * k) % 251) as u8).collect()).collect();
        let parts: Vec<Vec<bytes::Bytes>> = blocks.iter().map(|b| vec![bytes::Bytes::from(b.clone())]).collect();
        let st = client.store_keys(&h, &keys, &parts).await.unwrap();
        assert!(st.iter().all(|s| *s == ItemStatus::Ok), "{env:?}: {st:?}");
        let mut dst = vec![0u8; bb * keys.len()];
        let mut dests: Vec<kvtier_client::BlockDest<'_>> = dst.chunks_mut(bb).map(|c| vec![c]).collect();
        let ok = client.load_keys_into(&h, &keys, &mut dests, true).await.unwrap();
        assert_eq!(ok, vec![true; keys.len()], "{env:?}");
        assert_eq!(dst, blocks.concat(), "{env:?}: a load came back wrong");
        let m = server.scrape();
        let total = metric(&m, "kvtier_dataplane_congestion_total", &[]);
        match counted {
            Some(cc) => {
                let n = metric(&m, "kvtier_dataplane_congestion_total", &[("cc", cc)]);
                assert!(n >= 1.0 && n == total, "{env:?}: {n} connections counted as {cc:?} of {total}");
            }
            None => assert_eq!(total, 0.0, "no choice, yet a congestion control was set"),
        }
        // An answer says the connection was alone only where the server switches (`auto`, the
        // default, on a system whose control paces): a raw connection's, well after the others'.
        std::thread::sleep(std::time::Duration::from_millis(5));
        let mut raw = kvtier_tests::raw::Raw::open(server.data);
        raw.put_header(0);
        let h = raw.response().expect("an empty PUT is answered");
        let system = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control").unwrap();
        let switches = env.is_none() && kvtier_proto::tcp::paces(system.trim());
        assert_eq!(h.flags & kvtier_proto::dataplane::ANSWER_ALONE != 0, switches, "{env:?}, {system}: {h:?}");
    }
}

/// By default (`auto`), a same-host connection that loads with the node to itself runs unpaced
/// (CUBIC, else Reno), and goes back to the system's congestion control as soon as another
/// connection's requests run beside it; each switch is counted in
/// `kvtier_dataplane_congestion_switches_total{cc}`, and blocks come back whole throughout. On a
/// system whose default control does not pace there is nothing to switch: nothing is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_alone_runs_unpaced_and_returns_to_the_system_s_control_beside_others() {
    const LOADS: usize = 200;
    let system = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control").unwrap();
    let system = system.trim();
    let paces = kvtier_proto::tcp::paces(system);
    let server = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    let (a, b) = (server.client().await, server.client().await);
    let h = a.register(namespace("switched", b"s", small_layout())).await.unwrap();
    let bb = h.block_bytes() as usize;
    let keys = h.keys(&tokens(5, 16));
    let block: Vec<u8> = (0..bb).map(|i| (i % 253) as u8).collect();
    let st = a.store_keys(&h, &keys, &[vec![bytes::Bytes::from(block.clone())]]).await.unwrap();
    assert_eq!(st, vec![ItemStatus::Ok]);
    async fn loads(
        c: &kvtier_client::KvClient,
        h: &kvtier_client::NamespaceHandle,
        keys: &[kvtier_proto::BlockKey],
        block: &[u8],
    ) {
        let mut dst = vec![0u8; block.len()];
        for _ in 0..LOADS {
            dst.fill(0);
            let ok = c.load_keys_into(h, keys, &mut [vec![&mut dst[..]]], true).await.unwrap();
            assert!(ok == [true] && dst == block, "a load came back wrong");
        }
    }
    // Alone.
    loads(&a, &h, &keys, &block).await;
    let m = server.scrape();
    let switched = |m: &str, cc: &str| metric(m, "kvtier_dataplane_congestion_switches_total", &[("cc", cc)]);
    let unpaced: f64 = kvtier_proto::tcp::UNPACED.iter().map(|cc| switched(&m, cc)).sum();
    if !paces {
        eprintln!("this system's default congestion control ({system}) does not pace: nothing to switch");
    }
    assert_eq!(unpaced >= 1.0, paces, "{system}: {unpaced} switches to an unpaced control while alone");
    assert_eq!(switched(&m, system), 0.0, "alone, yet switched back to {system}");
    // Side by side with another connection: back to the system's.
    let hb = b.register(namespace("switched", b"s", small_layout())).await.unwrap();
    tokio::join!(loads(&a, &h, &keys, &block), loads(&b, &hb, &keys, &block));
    let m = server.scrape();
    let back = switched(&m, system);
    assert_eq!(back >= 1.0, paces, "{system}: switched back {back} times with another connection loading beside");
    if !paces {
        assert_eq!(metric(&m, "kvtier_dataplane_congestion_switches_total", &[]), 0.0);
    }
}

/// A caller loading small blocks back to back has its next request taken by the server's
/// polling (`dataplane_poll`), on the TCP data plane and on the same-node socket, and `/metrics`
/// says how often (`kvtier_requests_polled_total{plane}`); with `dataplane_poll = "0"` never.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_loads_back_to_back_are_taken_by_polling_and_counted() {
    const LOADS: usize = 200;
    for (poll, polls) in [("10ms", true), ("0", false)] {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("kvtier.toml");
        std::fs::write(&cfg, format!("dataplane_poll = \"{poll}\"\n")).unwrap();
        let server = ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"]);
        let client = server.client().await;
        let h = client.register(namespace("polled", b"p", small_layout())).await.unwrap();
        let bb = h.block_bytes() as usize;
        let keys = h.keys(&tokens(7, 16));
        let block: Vec<u8> = (0..bb).map(|i| (i % 251) as u8).collect();
        let st = client.store_keys(&h, &keys, &[vec![bytes::Bytes::from(block.clone())]]).await.unwrap();
        assert_eq!(st, vec![ItemStatus::Ok]);
        let mut dst = vec![0u8; bb];
        for _ in 0..LOADS {
            let ok = client.load_keys_into(&h, &keys, &mut [vec![&mut dst[..]]], true).await.unwrap();
            assert!(ok == [true] && dst == block, "a load came back wrong");
        }
        // The same over the same-node socket: the block loaded into a registered buffer.
        let mut near = client.samenode().await.expect("a same-node connection");
        let mut buf = kvtier_client::SharedBuffer::new(bb).unwrap();
        near.register(&buf).await.unwrap();
        for _ in 0..LOADS {
            buf.as_mut_slice().fill(0);
            let ok = near.load_into_buffer(&h, &keys, &mut buf, &[0], false).await.unwrap();
            assert!(ok == [true] && buf.as_slice() == &block[..], "a same-node load came back wrong");
        }
        let m = server.scrape();
        for plane in ["dataplane", "samenode"] {
            let polled = metric(&m, "kvtier_requests_polled_total", &[("plane", plane)]);
            if polls {
                // Each load after the first may be taken by polling; a busy machine that keeps
                // the client off its core for 10 ms makes a few park.
                assert!(polled >= (LOADS / 2) as f64, "{plane}: {polled} of {LOADS} loads were taken by polling");
            } else {
                assert_eq!(polled, 0.0, "{plane}: dataplane_poll = \"0\" polled");
            }
        }
    }
}

/// The `block i: N bytes xxh3=…` lines of a `get` or `session resume`: the bytes, in order.
fn block_lines(out: &str) -> Vec<&str> {
    out.lines().filter(|l| l.trim_start().starts_with("block ")).collect()
}

/// `session extend` with a context that doesn't start with the session's tokens (the
/// walkthrough's case: 82 tokens parked, 87 other ones given) is refused, and the session keeps
/// its version and its bytes. A context that does continue it is extended, reading only the
/// manifest first: no parked block leaves the node (before, the CLI resumed the whole session).
#[test]
fn session_extend_refuses_another_context_and_moves_only_the_new_blocks() {
    let server = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    let addr = server.grpc_addr();
    let text = "The quick brown fox jumps over the lazy dog while the KV cache waits in DRAM again";
    assert_eq!(text.len(), 82);
    let (ok, out, err) = cli(&["session", "park", "--server", &addr, "--id", "agent-1", "--text", text]);
    assert!(ok && out.contains("v1: 82 tokens, 5 blocks + tail"), "{out} {err}");
    let (ok, parked, err) = cli(&["session", "resume", "--server", &addr, "--id", "agent-1"]);
    assert!(ok && block_lines(&parked).len() == 6, "{parked} {err}");

    let other = "Different text entirely, longer than the original one for sure, definitely yes indeed!!";
    let (ok, out, err) = cli(&["session", "extend", "--server", &addr, "--id", "agent-1", "--text", other]);
    assert!(!ok, "extended with another context: {out}");
    assert!(
        err.contains("KV:Request:Invalid")
            && err.contains("does not continue session \"agent-1\"")
            && err.contains("first 80 tokens differ"),
        "{err}"
    );
    let (ok, after, err) = cli(&["session", "resume", "--server", &addr, "--id", "agent-1"]);
    assert!(ok && after.contains("v1: 82 tokens in 6 block(s)"), "{after} {err}");
    assert_eq!(block_lines(&after), block_lines(&parked), "a refused extend changed the session's bytes");

    // A context that continues it: the manifest is read, the new blocks sent, nothing loaded.
    let dram_out = || metric(&server.scrape(), "kvtier_tier_bytes_out_total", &[("tier", "dram")]);
    let before = dram_out();
    let longer = format!("{text}, and then the agent thought for a while before its next turn came round.");
    let (ok, out, err) = cli(&["session", "extend", "--server", &addr, "--id", "agent-1", "--text", &longer]);
    assert!(ok && out.contains(&format!("to v2: {} tokens", longer.len())), "{out} {err}");
    let moved = dram_out() - before;
    assert!(moved < 32768.0, "an extend read {moved} bytes of parked blocks out of DRAM");
    let (ok, out, err) = cli(&["session", "resume", "--server", &addr, "--id", "agent-1"]);
    assert!(ok, "{err}");
    assert_eq!(block_lines(&out)[..5], block_lines(&parked)[..5], "the kept blocks changed");
}

/// A TTL of 0 would park a session that is already expired: the CLI refuses it.
#[test]
fn session_park_refuses_a_ttl_of_zero() {
    let server = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    let addr = server.grpc_addr();
    let text = "a session that would be dead on arrival, were it parked";
    let (ok, out, err) = cli(&["session", "park", "--server", &addr, "--id", "z", "--text", text, "--ttl", "0"]);
    assert!(!ok && err.contains("--ttl") && err.contains("already expired"), "{out} {err}");
    let (ok, out, _) = cli(&["session", "ls", "--server", &addr]);
    assert!(ok && out.contains("0 session(s)"), "{out}");
}

/// `events --all` registers no namespace: a tenant's token watches its own namespaces without
/// naming its tenant (the default `cli` tenant's namespace is not its to register).
#[test]
fn events_all_works_for_a_tenant_token() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("tenants.toml");
    let token = "tenant-a-secret-0001";
    std::fs::write(
        &cfg,
        format!("auth_token = \"operator-secret-0000\"\n\n[[tenants]]\nname = \"a\"\ntokens = [\"{token}\"]\n"),
    )
    .unwrap();
    let server = ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"]);
    let addr = server.grpc_addr();
    let mut watch = Command::new(kvtier_bin())
        .args(["events", "--all", "--count", "1", "--server", &addr, "--auth-token", token])
        .env_remove("KVTIER_SERVER")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Stores until the watcher sees one (it may subscribe after the first).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut n = 0;
    let status = loop {
        if let Some(st) = watch.try_wait().unwrap() {
            break st;
        }
        if std::time::Instant::now() > deadline {
            let _ = watch.kill();
            panic!("events --all saw no event in 20 s");
        }
        n += 1;
        // New from its first block on: a put of blocks already held changes nothing, and says so
        // to no watcher.
        let text = format!("{n:04}: tenant a stores a document of its own, a new one each time");
        let (ok, out, err) = cli(&["put", "--server", &addr, "--auth-token", token, "--tenant", "a", "--text", &text]);
        assert!(ok, "{out} {err}");
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    let out = watch.wait_with_output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(status.success(), "{stdout} {stderr}");
    assert!(stdout.contains("ns="), "{stdout}");
}

/// `serve`'s log written to a pipe (or a file) carries no terminal colour codes.
#[test]
fn serve_logs_to_a_pipe_without_colour_codes() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let mut serve = Command::new(kvtier_bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--data-listen", "127.0.0.1:0", "--metrics", "127.0.0.1:0"])
        .args(["--dram-capacity", "64MiB", "--disk-capacity", "16MiB", "--log", "info", "--data-dir"])
        .arg(dir.path())
        .env_remove("KVTIER_CONFIG")
        .env_remove("KVTIER_LOG")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Kept open until it exits (it may print as it stops).
    let mut stdout = std::io::BufReader::new(serve.stdout.take().unwrap()).lines();
    let ready = stdout.by_ref().map_while(Result::ok).any(|l| l.contains("listening"));
    assert!(ready, "serve never said it was listening");
    let _ = Command::new("kill").arg(serve.id().to_string()).status();
    let out = serve.wait_with_output().unwrap();
    drop(stdout);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains("INFO"), "{log}");
    assert!(!log.contains('\x1b'), "escape codes in a piped log: {log:?}");
}

/// Runs the CLI with `args`, its standard output a pipe whose reader goes away at once, long
/// before the command has an answer to print.
fn into_closed_pipe(args: &[&str]) -> std::process::Output {
    let mut child = Command::new(kvtier_bin())
        .args(args)
        .env_remove("KVTIER_SERVER")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    child.wait_with_output().unwrap()
}

/// Output into a pipe its reader closed (`kvtier stats | true`) ends the command quietly: no
/// panic, the exit status a shell gives a command that SIGPIPE ended.
#[test]
fn output_into_a_closed_pipe_ends_the_command_quietly() {
    let server = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    let addr = server.grpc_addr();
    let (ok, _, err) = cli(&["session", "park", "--server", &addr, "--id", "s", "--text", &"x".repeat(800)]);
    assert!(ok, "{err}");
    for args in [vec!["stats", "--server", &addr], vec!["session", "resume", "--server", &addr, "--id", "s"]] {
        let out = into_closed_pipe(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked") && err.is_empty(), "{args:?}: {err}");
        assert_eq!(out.status.code(), Some(141), "{args:?}: {err}");
    }
    // `--out` is written all the same (it was skipped: the file came after the printed lines),
    // the bytes a run into an open pipe writes.
    let dir = tempfile::tempdir().unwrap();
    let text = "x".repeat(800);
    let runs = [
        vec!["session", "resume", "--server", &addr, "--id", "s", "--out"],
        vec!["get", "--server", &addr, "--text", &text, "--out"],
    ];
    for (i, args) in runs.iter().enumerate() {
        let (whole, piped) = (dir.path().join(format!("{i}-whole")), dir.path().join(format!("{i}-piped")));
        let (ok, _, err) = cli(&[&args[..], &[whole.to_str().unwrap()]].concat());
        assert!(ok, "{err}");
        let out = into_closed_pipe(&[&args[..], &[piped.to_str().unwrap()]].concat());
        assert_eq!(out.status.code(), Some(141), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        let expected = std::fs::read(&whole).unwrap();
        assert!(!expected.is_empty());
        assert!(std::fs::read(&piped).ok() == Some(expected), "{args:?}: --out not written whole");
    }
}

/// A user's error is one line (`Error: …`, each cause once), without a backtrace even under
/// RUST_BACKTRACE=1; errors say their code or kind once.
#[test]
fn user_errors_are_one_line_without_backtrace_or_repeats() {
    let server = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    let addr = server.grpc_addr();
    let run = |args: &[&str]| {
        let out = Command::new(kvtier_bin())
            .args(args)
            .env_remove("KVTIER_SERVER")
            .env_remove("RUST_LIB_BACKTRACE")
            .env("RUST_BACKTRACE", "1")
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} should fail");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = run(&["put", "--server", &addr, "--text", "abc"]);
    assert_eq!(err.trim_end(), "Error: 3 tokens make no full block of 16 tokens", "{err}");
    // A local check of the namespace flags: said once, naming them, and not a "protocol error".
    let err = run(&["put", "--server", &addr, "--text", "abc", "--layers", "0"]);
    assert_eq!(err.matches("invalid KV layout").count(), 1, "{err}");
    assert!(err.contains("--layers") && !err.contains("protocol error") && !err.contains("Caused by"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    // A server's refusal: its code once.
    let err = run(&["session", "resume", "--server", &addr, "--id", "nobody"]);
    assert_eq!(err.matches("KV:Session:NotFound").count(), 1, "{err}");
    assert!(err.contains("\"nobody\" not found") && !err.contains("stack backtrace"), "{err}");
    let (ok, _, err) = cli(&["session", "park", "--server", &addr, "--id", "p", "--text", &"y".repeat(40)]);
    assert!(ok, "{err}");
    let err = run(&["session", "park", "--server", &addr, "--id", "p", "--text", &"y".repeat(40)]);
    assert_eq!(err.matches("KV:Session:Exists").count(), 1, "{err}");
    assert!(err.contains("--replace"), "the hint names what the CLI can do: {err}");
}

/// The smaller things a first user trips on: `route --text`, `--out` naming a directory, one
/// token count for lookup and put past `max_context_tokens`, `--replace` for a session id in
/// use, and help that lists only what a command takes.
#[test]
fn client_commands_take_text_name_paths_and_list_only_their_flags() {
    let server = ServerProcess::start(&["--dram-capacity", "64MiB", "--max-context-tokens", "64"]);
    let addr = server.grpc_addr();
    let text = "a context of forty-eight bytes, three blocks ok";
    assert_eq!(text.len(), 47);
    let (ok, out, err) = cli(&["put", "--server", &addr, "--text", text]);
    assert!(ok, "{out} {err}");
    let (ok, out, err) = cli(&["route", "--server", &addr, "--text", text]);
    assert!(ok && out.contains("47 tokens: 2 full blocks") && out.contains("prefix=2 blocks"), "{out} {err}");
    // A read: a namespace the node does not know (a typo in a flag) is said, not registered.
    let before = metric(&server.scrape(), "kvtier_namespaces", &[]);
    let (ok, out, err) = cli(&["route", "--server", &addr, "--text", text, "--model", "typo"]);
    assert!(ok && out.contains("the node holds no such namespace"), "{out} {err}");
    assert_eq!(metric(&server.scrape(), "kvtier_namespaces", &[]), before, "route registered a namespace");

    let (ok, _, err) = cli(&["session", "park", "--server", &addr, "--id", "s", "--text", text]);
    assert!(ok, "{err}");
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let (ok, _, err) = cli(&["session", "resume", "--server", &addr, "--id", "s", "--out", d]);
    assert!(!ok && err.contains(d), "the error names the path: {err}");
    // --replace parks over the session (a new version), where a plain park is refused.
    let (ok, out, err) = cli(&["session", "park", "--server", &addr, "--id", "s", "--text", "other", "--replace"]);
    assert!(ok && out.contains("v2: 5 tokens"), "{out} {err}");

    // Past max_context_tokens, lookup and put count the same tokens (the tail too).
    let long = "x".repeat(82);
    let (ok, _, lookup_err) = cli(&["lookup", "--server", &addr, "--text", &long]);
    let (ok2, _, put_err) = cli(&["put", "--server", &addr, "--text", &long]);
    assert!(!ok && !ok2, "{lookup_err} {put_err}");
    assert!(lookup_err.contains("82 tokens") && put_err.contains("82 tokens"), "{lookup_err} {put_err}");

    let (ok, out, _) = cli(&["stats", "--help"]);
    assert!(ok && out.contains("--server") && !out.contains("--tenant") && !out.contains("--layers"), "{out}");
    let (ok, out, _) = cli(&["plan", "--help"]);
    assert!(ok && out.contains("kvtier plan") && out.contains("--codec"), "{out}");
    assert!(!out.contains("kvtier-bench [OPTIONS]") && !out.contains("--redis-bin"), "{out}");
    let (ok, _, err) = cli(&["plan", "limits"]);
    assert!(!ok && err.contains("limits"), "{err}");
}

/// A plain client at a TLS node, or at a node's data-plane port, is told what to check, in the
/// CLI's flags; a TLS client without the certificate an mTLS node requires too.
#[test]
fn connection_errors_hint_at_tls_and_the_port_in_the_cli_s_flags() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    for args in
        [vec!["cert", "ca", "--dir", d], vec!["cert", "node", "--dir", d, "--name", "n1", "--host", "127.0.0.1"]]
    {
        let (ok, out, err) = cli(&args);
        assert!(ok, "{out} {err}");
    }
    // A validity past what a certificate can hold is refused with the range (it panicked).
    let (ok, _, err) = cli(&["cert", "client", "--dir", d, "--name", "c1", "--days", "99999999"]);
    assert!(!ok && err.contains("1..=36500") && !err.contains("panicked"), "{err}");
    let cfg = dir.path().join("mtls.toml");
    std::fs::write(&cfg, format!("[tls]\ncert = \"{d}/n1.pem\"\nkey = \"{d}/n1.key\"\nclient_ca = \"{d}/ca.pem\"\n"))
        .unwrap();
    let mtls = ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"]);
    let (ok, _, err) = cli(&["stats", "--server", &mtls.grpc_addr()]);
    assert!(!ok && err.contains("runs TLS") && err.contains("--tls-ca"), "{err}");
    let ca = format!("{d}/ca.pem");
    let (ok, _, err) = cli(&["stats", "--server", &mtls.grpc_addr(), "--tls-ca", &ca]);
    assert!(!ok && err.contains("client certificate") && err.contains("--tls-cert"), "{err}");
    assert!(!err.contains("ClientConfig"), "the CLI's flags, not the Rust API: {err}");

    let plain = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    let (ok, _, err) = cli(&["stats", "--server", &plain.data.to_string()]);
    assert!(!ok && err.contains("gRPC port"), "{err}");
}

/// A `put` larger than the node keeps evicts its own first blocks, so a lookup of it finds
/// nothing: `put` says so beside "stored", and says nothing when the prefix is held.
#[test]
fn put_says_when_what_it_stored_is_no_longer_held() {
    let server = ServerProcess::start(&["--dram-capacity", "1MiB"]);
    let addr = server.grpc_addr();
    let many: Vec<String> = (1..=6400u32).map(|t| t.to_string()).collect();
    let (ok, out, err) = cli(&["put", "--server", &addr, "--tokens", &many.join(",")]);
    assert!(ok, "{err}");
    assert!(out.contains("stored 400 of 400 block(s)"), "{out}");
    assert!(out.contains("note: only 0 of those 6400 tokens are held"), "{out}");
    let (ok, out, err) = cli(&["put", "--server", &addr, "--tokens", "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16"]);
    assert!(ok && out.contains("stored 1 of 1 block(s)"), "{out} {err}");
    assert!(!out.contains("note:"), "the block is held: {out}");
}

/// `kvtier purge` and `kvtier unregister` remove a namespace's blocks (and sessions) and say how
/// many; a node without a cluster names no other member.
#[test]
fn purge_and_unregister_remove_what_they_say() {
    let server = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    let addr = server.grpc_addr();
    let text = "a prefix that a tenant wants gone from the cache, every block of it, right now";
    let (ok, out, err) = cli(&["put", "--server", &addr, "--text", text]);
    assert!(ok, "{out} {err}");
    let (ok, out, err) = cli(&["purge", "--server", &addr]);
    assert!(ok && out.trim() == "purged: 4 block(s)", "{out} {err}");
    let (ok, out, err) = cli(&["lookup", "--server", &addr, "--text", text]);
    assert!(ok && out.starts_with("0 of"), "{out} {err}");

    let (ok, out, err) = cli(&["session", "park", "--server", &addr, "--id", "s", "--text", text]);
    assert!(ok, "{out} {err}");
    let (ok, out, err) = cli(&["unregister", "--server", &addr]);
    assert!(ok && out.trim() == "unregistered: 1 session(s) and 5 block(s)", "{out} {err}");
    let (ok, out, err) = cli(&["session", "ls", "--server", &addr]);
    assert!(ok && out.contains("0 session(s)"), "{out} {err}");
}

/// Every gRPC call is counted and timed by method, and a failed one by its status code, whoever
/// answered it: before, only the calls a handler answered with success were (a resume of a
/// missing session, a refused credential, `Stats`, `Purge` and six more methods never showed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_grpc_call_is_counted_and_failures_by_their_code() {
    const TOKEN: &str = "operator-secret-0123456789";
    let server = ServerProcess::start(&["--dram-capacity", "64MiB", "--auth-token", TOKEN]);
    let cfg = |t: &str| kvtier_client::ClientConfig { auth_token: Some(t.into()), ..Default::default() };
    let client = kvtier_client::KvClient::connect(&server.grpc_addr(), cfg(TOKEN)).await.unwrap();
    let ns = client.register(namespace("acme", b"count", small_layout())).await.unwrap();
    for _ in 0..3 {
        assert!(client.resume(&ns, "never-parked").await.is_err());
    }
    client.stats().await.unwrap();
    client.purge(&ns).await.unwrap();
    // A connect asks the node's `Info` first: refused for the credential.
    let stranger = kvtier_client::KvClient::connect(&server.grpc_addr(), cfg("not-the-token-0123456789")).await;
    assert!(stranger.is_err());
    let m = server.scrape();
    let count = |op: &str| metric(&m, "kvtier_requests_total", &[("op", op)]);
    let failed = |op: &str, code: &str| metric(&m, "kvtier_request_errors_total", &[("op", op), ("code", code)]);
    assert_eq!(count("resume"), 3.0, "{m}");
    assert_eq!(failed("resume", "not_found"), 3.0, "{m}");
    assert!(count("stats") == 1.0 && count("purge") == 1.0 && count("register_namespace") == 1.0, "{m}");
    assert!(failed("info", "unauthenticated") >= 1.0, "{m}");
    assert_eq!(failed("purge", "not_found"), 0.0, "{m}");
    assert!(metric(&m, "kvtier_request_seconds_count", &[("op", "stats")]) == 1.0, "{m}");
}

/// `--timeout` bounds a command against a node that accepts connections but does not answer (a
/// stopped process: the kernel still completes the handshake), and the error says what may be
/// wrong. Before, the CLI had no such flag and waited its 30 s request timeout.
#[test]
fn a_command_against_a_stopped_node_gives_up_after_its_timeout() {
    let server = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    let addr = server.grpc_addr();
    stop_process(server.child.id());
    let t = std::time::Instant::now();
    let (ok, _, err) = cli(&["stats", "--server", &addr, "--timeout", "1s"]);
    let took = t.elapsed();
    continue_process(server.child.id());
    assert!(!ok && err.contains("stopped or overloaded"), "{err}");
    assert!(took < std::time::Duration::from_secs(5), "gave up after {took:?}");
    let (ok, _, err) = cli(&["stats", "--server", &addr, "--timeout", "0s"]);
    assert!(!ok && err.contains("--timeout must be positive"), "{err}");
    let (ok, out, err) = cli(&["stats", "--server", &addr, "--timeout", "5s"]);
    assert!(ok && out.contains("uptime"), "{out} {err}");
}

/// `session ls --all` lists the sessions of every namespace, each with its namespace's id and
/// tenant; the namespace flags alone list one namespace's.
#[test]
fn session_ls_all_lists_every_namespace_s_sessions() {
    let server = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    let addr = server.grpc_addr();
    let text = "an agent's context, parked between turns in one of two models' namespaces";
    for (model, id) in [("model-a", "agent-a"), ("model-b", "agent-b")] {
        let (ok, out, err) = cli(&["session", "park", "--server", &addr, "--model", model, "--id", id, "--text", text]);
        assert!(ok, "{out} {err}");
    }
    let (ok, out, err) = cli(&["session", "ls", "--server", &addr, "--model", "model-a"]);
    assert!(ok && out.contains("1 session(s)") && out.contains("agent-a") && !out.contains("agent-b"), "{out} {err}");
    let (ok, out, err) = cli(&["session", "ls", "--server", &addr, "--all"]);
    assert!(ok && out.contains("2 session(s)"), "{out} {err}");
    let lines: Vec<&str> = out.lines().filter(|l| l.contains("agent-")).collect();
    assert_eq!(lines.len(), 2, "{out}");
    let ns_of = |l: &str| l.split_whitespace().nth(1).map(str::to_string);
    assert!(lines.iter().all(|l| l.trim_start().starts_with("ns ")), "{out}");
    // And whose: the CLI's own tenant here (no tenants configured).
    assert!(lines.iter().all(|l| l.contains(" tenant cli ")), "{out}");
    // Time left to the second, not a Duration's debug form.
    assert!(lines.iter().all(|l| l.contains("expires in 9m5") || l.contains("expires in 10m00s")), "{out}");
    assert_ne!(ns_of(lines[0]), ns_of(lines[1]), "each with its own namespace: {out}");
}

/// A session larger than the room a node has for it (4 MiB of DRAM, a 16 MiB disk, a 20 MiB
/// session) is refused with the capacity code and why: the server lost blocks before the park
/// could pin them. It said "blocks kept being evicted before the session could pin them", with no
/// code and no hint of which room was short.
#[test]
fn a_session_larger_than_the_node_s_room_is_refused_with_a_code_and_why() {
    let server = ServerProcess::start(&["--dram-capacity", "4MiB", "--disk-capacity", "16MiB"]);
    let addr = server.grpc_addr();
    // 40 blocks of 512 KiB (8 layers x 8 KV heads x 128 x bf16 x 16 tokens).
    let text: String = (0..640u32).map(|i| char::from(b'a' + ((i * 7 + i / 3) % 26) as u8)).collect();
    let layout = ["--layers", "8", "--kv-heads", "8", "--head-dim", "128"];
    let mut args = vec!["session", "park", "--server", &addr, "--id", "big", "--text", &text];
    args.extend(layout);
    let (ok, out, err) = cli(&args);
    assert!(!ok, "{out} {err}");
    assert!(
        err.contains(
            "KV:Capacity:Exhausted: the server lost some of the session's blocks before its park could pin them"
        ) && err.contains("kvtier_disk_demotions_failed_total"),
        "{err}"
    );
    // The node serves on: a small session parks.
    let mut args = vec!["session", "park", "--server", &addr, "--id", "small", "--text", &text[..40]];
    args.extend(layout);
    let (ok, out, err) = cli(&args);
    assert!(ok && out.starts_with("parked \"small\" v1"), "{out} {err}");
}
