//! KV events (`WatchEvents`) and routing hints on one real `kvtier serve`: stores, evictions,
//! purges and session parks and drops arrive with the right keys; a tenant can't watch another
//! tenant's namespace and sees only its own events; watchers past the limits are refused with a
//! clear error; a stalled watcher gets `LAGGED` while the node keeps serving with bounded memory;
//! without a cluster the routing hint lists this node alone.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use kvtier_client::{ClientConfig, ClientError, EventKind, EventWatch, KvClient, KvEvent, ParkOptions};
use kvtier_proto::{pb, BlockKey};
use kvtier_tests::*;

const OPERATOR: &str = "operator-secret-0000";
const TOKEN_A: &str = "tenant-a-secret-0001";
const TOKEN_B: &str = "tenant-b-secret-0002";

/// Events until `done` says the collection is complete, or panics after 10 s.
async fn collect(w: &mut EventWatch, mut done: impl FnMut(&[KvEvent]) -> bool) -> Vec<KvEvent> {
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done(&got) {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, w.next()).await {
            Ok(Ok(Some(e))) => got.push(e),
            Ok(other) => panic!("the stream ended: {other:?}; got {got:?}"),
            Err(_) => panic!("events did not arrive within 10 s; got {got:?}"),
        }
    }
    got
}

fn keys_of(events: &[KvEvent], kind: EventKind) -> HashSet<BlockKey> {
    events.iter().filter(|e| e.kind == kind).flat_map(|e| e.keys.iter().copied()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_evictions_purges_and_sessions_arrive_with_their_keys() {
    // 4 MiB of DRAM holds ~100 blocks of 32 KiB: a flood of 300 evicts.
    let server = ServerProcess::start(&["--dram-capacity", "4MiB", "--node-id", "solo"]);
    let client = server.client().await;
    let ns = client.register(namespace("ev", b"", small_layout())).await.unwrap();
    let mut w = client.watch_events(&[&ns]).await.unwrap();

    let doc = tokens(1, 8 * 16);
    client.store(&ns, &doc, &full_block_payloads(&ns, &doc)).await.unwrap().ok().unwrap();
    let want: HashSet<BlockKey> = ns.keys(&doc).into_iter().collect();
    let got = collect(&mut w, |g| keys_of(g, EventKind::Stored).len() >= 8).await;
    assert_eq!(keys_of(&got, EventKind::Stored), want, "the stored keys, exactly");
    let e = &got[0];
    assert_eq!((e.node_id.as_str(), e.tier.as_str(), e.namespace), ("solo", "dram", Some(ns.id)));
    assert!(got.len() < 8, "batched: {} events for 8 keys", got.len());

    // A session over those blocks: parked, then dropped.
    client.park(&ns, "agent-1", &doc, &full_block_payloads(&ns, &doc), &ParkOptions::default(), 0).await.unwrap();
    assert!(client.drop_session(&ns, "agent-1").await.unwrap());
    let got = collect(&mut w, |g| g.iter().any(|e| e.kind == EventKind::SessionDropped)).await;
    let sessions: Vec<(EventKind, &str)> =
        got.iter().filter(|e| e.kind != EventKind::Stored).map(|e| (e.kind, e.session_id.as_str())).collect();
    assert_eq!(sessions, vec![(EventKind::SessionParked, "agent-1"), (EventKind::SessionDropped, "agent-1")]);

    // A flood three times the cap: evictions name keys the node no longer holds.
    let flood = tokens(2, 300 * 16);
    // Each chunk is its own sequence (its own key chain).
    let flood_keys: Vec<BlockKey> = flood.chunks(30 * 16).flat_map(|c| ns.keys(c)).collect();
    for (chunk, toks) in flood.chunks(30 * 16).enumerate() {
        let r = client.store(&ns, toks, &full_block_payloads(&ns, toks)).await.unwrap();
        assert!(r.stored > 0, "chunk {chunk} stored nothing");
    }
    let got = collect(&mut w, |g| keys_of(g, EventKind::Evicted).len() >= 100).await;
    let evicted = keys_of(&got, EventKind::Evicted);
    let gone: Vec<BlockKey> = evicted.iter().copied().collect();
    let held = client.exists_keys(&ns, &gone).await.unwrap();
    let still = held.iter().filter(|h| **h).count();
    // Every key of the flood is distinct, and the first document's were not stored again.
    assert_eq!(still, 0, "{still} of {} evicted keys are still held", gone.len());
    assert!(got.iter().filter(|e| e.kind == EventKind::Evicted).all(|e| e.tier == "dram" && e.to_tier.is_empty()));
    let known: HashSet<BlockKey> = flood_keys.iter().chain(want.iter()).copied().collect();
    assert!(keys_of(&got, EventKind::Stored).is_subset(&known));

    // A purge names exactly the keys that were held.
    let all: Vec<BlockKey> = want.iter().copied().chain(flood_keys.iter().copied()).collect();
    let held_now: HashSet<BlockKey> =
        all.iter().zip(client.exists_keys(&ns, &all).await.unwrap()).filter(|(_, h)| *h).map(|(k, _)| *k).collect();
    let removed = client.purge(&ns).await.unwrap().blocks_removed;
    assert_eq!(removed as usize, held_now.len());
    let got = collect(&mut w, |g| keys_of(g, EventKind::Purged).len() >= held_now.len()).await;
    assert_eq!(keys_of(&got, EventKind::Purged), held_now);

    // Without a cluster, the routing hint lists this node alone, with the prefix it holds.
    client.store(&ns, &doc, &full_block_payloads(&ns, &doc)).await.unwrap().ok().unwrap();
    let hint = client.route_hint(&ns, &tokens(1, 10 * 16 + 3), Some("nobody")).await.unwrap();
    assert_eq!((hint.total_blocks, hint.block_tokens, hint.nodes.len()), (10, 16, 1));
    let n = &hint.nodes[0];
    assert_eq!((n.node_id.as_str(), n.answering, n.reachable), ("solo", true, true));
    assert_eq!((n.prefix_blocks, n.prefix_tokens, n.holds_session), (8, 128, false));
    assert_eq!(n.grpc_addr, server.grpc_addr());
}

fn tenants_config(dir: &std::path::Path, extra: &str) -> std::path::PathBuf {
    let path = dir.join("tenants.toml");
    std::fs::write(
        &path,
        format!(
            r#"
auth_token = "{OPERATOR}"
{extra}

[[tenants]]
name = "a"
tokens = ["{TOKEN_A}"]

[[tenants]]
name = "b"
tokens = ["{TOKEN_B}"]
"#
        ),
    )
    .unwrap();
    path
}

async fn client_as(server: &ServerProcess, token: &str) -> KvClient {
    let cfg = ClientConfig { auth_token: Some(token.to_string()), ..ClientConfig::default() };
    KvClient::connect(&server.grpc_addr(), cfg).await.expect("connect")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_watches_only_its_own_namespaces_and_watchers_are_capped() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tenants_config(dir.path(), "events_max_watchers = 5\nevents_max_watchers_per_tenant = 2");
    let server = ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"]);
    let (a, b, op) =
        (client_as(&server, TOKEN_A).await, client_as(&server, TOKEN_B).await, client_as(&server, OPERATOR).await);
    let ns_a = a.register(namespace("a", b"a", small_layout())).await.unwrap();
    let ns_b = b.register(namespace("b", b"b", small_layout())).await.unwrap();

    // b names a's namespace: refused like any other call on it (as if it were not registered).
    match b.watch_events(&[&ns_a]).await {
        Err(ClientError::UnknownNamespace(m)) => assert!(!m.is_empty()),
        Err(e) => panic!("expected UnknownNamespace, got {e}"),
        Ok(_) => panic!("b may watch a's namespace"),
    }
    // b watching "everything it may read" sees its own stores, never a's.
    let mut wb = b.watch_events(&[]).await.unwrap();
    let mut wop = op.watch_events(&[]).await.unwrap();
    let (da, db) = (tokens(1, 4 * 16), tokens(2, 4 * 16));
    a.store(&ns_a, &da, &full_block_payloads(&ns_a, &da)).await.unwrap().ok().unwrap();
    b.store(&ns_b, &db, &full_block_payloads(&ns_b, &db)).await.unwrap().ok().unwrap();
    let got = collect(&mut wb, |g| keys_of(g, EventKind::Stored).len() >= 4).await;
    assert!(got.iter().all(|e| e.namespace == Some(ns_b.id)), "b saw another namespace: {got:?}");
    assert_eq!(keys_of(&got, EventKind::Stored), ns_b.keys(&db).into_iter().collect());
    // The operator sees both.
    let got = collect(&mut wop, |g| keys_of(g, EventKind::Stored).len() >= 8).await;
    let seen: HashSet<_> = got.iter().filter_map(|e| e.namespace).collect();
    assert_eq!(seen, [ns_a.id, ns_b.id].into_iter().collect());

    // Per tenant: a's third watcher is refused.
    let wa1 = a.watch_events(&[&ns_a]).await.unwrap();
    let _wa2 = a.watch_events(&[&ns_a]).await.unwrap();
    match a.watch_events(&[&ns_a]).await {
        Err(ClientError::QuotaExceeded(m)) => assert!(m.contains("events_max_watchers_per_tenant"), "{m}"),
        Err(e) => panic!("expected QuotaExceeded, got {e}"),
        Ok(_) => panic!("a third watcher of tenant a was admitted"),
    }
    // The operator has no tenant limit, only the node's: a fifth watcher, not a sixth.
    let _op2 = op.watch_events(&[]).await.unwrap();
    match op.watch_events(&[]).await {
        Err(ClientError::QuotaExceeded(m)) => assert!(m.contains("events_max_watchers is 5"), "{m}"),
        Err(e) => panic!("expected QuotaExceeded, got {e}"),
        Ok(_) => panic!("a sixth watcher on the node was admitted"),
    }
    assert_eq!(metric(&server.scrape(), "kvtier_event_watchers", &[]), 5.0);
    // A watcher that goes away frees its place.
    drop(wa1);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match a.watch_events(&[&ns_a]).await {
            Ok(_) => break,
            Err(ClientError::QuotaExceeded(_)) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("the freed place was not given back: {e}"),
        }
    }
}

fn rss_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_watcher_gets_lagged_while_the_node_keeps_serving_in_bounded_memory() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("events.toml");
    std::fs::write(&cfg, "events_buffer = 16\n").unwrap();
    let server = ServerProcess::start(&["--config", cfg.to_str().unwrap(), "--dram-capacity", "64MiB"]);
    let client = server.client().await;
    let ns = client.register(namespace("lag", b"", small_layout())).await.unwrap();
    let doc = tokens(1, 4 * 16);
    let blocks = full_block_payloads(&ns, &doc);
    client.store(&ns, &doc, &blocks).await.unwrap().ok().unwrap();

    // 200 park + drop cycles: the time of each of 5 rounds, sorted.
    let rounds = |tag: &'static str| {
        let (client, ns, doc, blocks) = (&client, &ns, &doc, &blocks);
        async move {
            let mut times = Vec::new();
            for r in 0..5 {
                let t = Instant::now();
                for i in 0..200 {
                    let id = format!("{tag}{r}-{i}");
                    client.park(ns, &id, doc, blocks, &ParkOptions::default(), 0).await.unwrap();
                    assert!(client.drop_session(ns, &id).await.unwrap());
                }
                times.push(t.elapsed());
            }
            times.sort();
            times
        }
    };
    // Baseline, same run: nobody watches.
    let unwatched = rounds("u").await;

    // A watcher whose HTTP/2 windows hold 4 KiB and that reads nothing: the node can't send it
    // more than that, so its events pile up in the node's bounded buffer, not anywhere else.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", server.grpc_addr()))
        .unwrap()
        .initial_stream_window_size(Some(4096))
        .initial_connection_window_size(Some(4096))
        .connect()
        .await
        .unwrap();
    let mut raw = pb::kv_tier_client::KvTierClient::new(channel);
    let req = pb::WatchEventsRequest { namespace_ids: vec![bytes::Bytes::copy_from_slice(&ns.id.0)] };
    let mut stalled = raw.watch_events(req).await.unwrap().into_inner();

    let rss_before = rss_kib(server.child.id());
    // 2000 session events, far past 16 + what 4 KiB of window holds; every call is served.
    let started = Instant::now();
    let watched = rounds("s").await;
    let took = started.elapsed();
    let rss_after = rss_kib(server.child.id());
    eprintln!(
        "stalled watcher: 2000 session calls in {took:?}; median round of 400 calls {:?} vs {:?} unwatched \
         ({:.2}x); node RSS {rss_before} -> {rss_after} KiB",
        watched[2],
        unwatched[2],
        watched[2].as_secs_f64() / unwatched[2].as_secs_f64()
    );
    assert!(took < Duration::from_secs(60), "2000 session calls took {took:?} beside a stalled watcher");
    assert!(
        rss_after < rss_before + 32 * 1024,
        "the node grew from {rss_before} KiB to {rss_after} KiB with a stalled watcher"
    );

    // The node still answers; then the watcher reads again: what fit in its window and the
    // node's buffer, and LAGGED events counting what it missed, up to a fresh event.
    assert_eq!(client.lookup(&ns, &doc).await.unwrap(), doc.len());
    client.park(&ns, "after", &doc, &blocks, &ParkOptions::default(), 0).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let (mut seen, mut missed, mut lags) = (0u64, 0u64, 0u64);
    loop {
        let e = tokio::time::timeout(deadline.saturating_duration_since(Instant::now()), stalled.message())
            .await
            .expect("the watcher did not catch up")
            .unwrap()
            .expect("the stream ended");
        if e.kind == pb::KvEventKind::Lagged as i32 {
            lags += 1;
            missed += e.missed;
            continue;
        }
        seen += 1;
        if e.session_id == "after" {
            break;
        }
    }
    assert!(lags > 0 && missed > 1000, "missed {missed} in {lags} LAGGED events, saw {seen}");
    assert_eq!(seen + missed, 2001, "every event was either received or counted as missed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_prints_one_line_per_event_and_the_route() {
    let server = ServerProcess::start(&["--dram-capacity", "64MiB", "--node-id", "cli-node"]);
    let addr = server.grpc_addr();
    /// The CLI's process, killed if the test ends before it does.
    struct Cli(std::process::Child);
    impl Drop for Cli {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut events = Cli(std::process::Command::new(kvtier_bin())
        .args(["events", "--server", &addr, "--count", "2"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap());
    // Its lines as they come (a thread reads them), so that the test waits with a deadline.
    let (tx, lines) = std::sync::mpsc::channel();
    let stdout = events.0.stdout.take().unwrap();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    // The CLI's default namespace; wait until its watch is open.
    let deadline = Instant::now() + Duration::from_secs(20);
    while metric(&server.scrape(), "kvtier_event_watchers", &[]) < 1.0 {
        assert!(Instant::now() < deadline, "the CLI did not start watching");
        std::thread::sleep(Duration::from_millis(20));
    }
    let seq = |r: std::ops::Range<u32>| r.map(|i| i.to_string()).collect::<Vec<_>>().join(",");
    // The second put after the first one's line: two events, however slow the server's batching.
    let mut seen = Vec::new();
    for tokens in [seq(0..16), seq(100..116)] {
        let (ok, _, err) = cli(&["put", "--server", &addr, "--tokens", &tokens]);
        assert!(ok, "{err}");
        seen.push(lines.recv_timeout(Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e}; so far {seen:?}")));
    }
    for l in &seen {
        assert!(l.starts_with("cli-node ") && l.contains(" stored ") && l.contains("tier=dram keys=1 "), "{seen:?}");
    }
    // `--count 2`: it exits after its second line, printing nothing more.
    let deadline = Instant::now() + Duration::from_secs(10);
    while events.0.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "the CLI did not exit after {seen:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(lines.recv_timeout(Duration::from_secs(5)).is_err(), "nothing past the count");

    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), (0..40).map(|i| i.to_string()).collect::<Vec<_>>().join(" ")).unwrap();
    let (ok, out, err) = cli(&["route", "--server", &addr, "--tokens-file", file.path().to_str().unwrap()]);
    assert!(ok, "{err}");
    assert!(out.contains("node cli-node") && out.contains("prefix=1 blocks (16 tokens)"), "{out}");
    assert!(out.contains("best cli-node"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_disk_tier_evictions_say_where_the_blocks_went() {
    // 2 MiB of DRAM over 16 MiB of disk in 1 MiB segments: a flood of 38 MiB demotes blocks to
    // disk, and recycles the disk's oldest segments.
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("disk.toml");
    std::fs::write(&cfg, "disk_segment_bytes = \"1MiB\"\n").unwrap();
    let server = ServerProcess::start(&[
        "--config",
        cfg.to_str().unwrap(),
        "--dram-capacity",
        "2MiB",
        "--disk-capacity",
        "16MiB",
    ]);
    let client = server.client().await;
    let ns = client.register(namespace("disk-ev", b"", small_layout())).await.unwrap();
    let mut w = client.watch_events(&[&ns]).await.unwrap();
    let flood = tokens(3, 1200 * 16);
    for toks in flood.chunks(30 * 16) {
        client.store(&ns, toks, &full_block_payloads(&ns, toks)).await.unwrap();
    }
    let from_disk = |g: &[KvEvent]| g.iter().filter(|e| e.kind == EventKind::Evicted && e.tier == "disk").count();
    let got = collect(&mut w, |g| from_disk(g) > 0).await;
    let demoted = got.iter().filter(|e| e.kind == EventKind::Evicted && e.tier == "dram");
    assert!(demoted.clone().count() > 0 && demoted.clone().all(|e| e.to_tier == "disk"), "{got:?}");
    // Blocks a recycled segment held, with no copy in DRAM: gone from the node.
    let gone: Vec<BlockKey> = got
        .iter()
        .filter(|e| e.kind == EventKind::Evicted && e.tier == "disk" && e.to_tier.is_empty())
        .flat_map(|e| e.keys.iter().copied())
        .collect();
    assert!(!gone.is_empty());
    let held = client.exists_keys(&ns, &gone).await.unwrap();
    assert!(
        held.iter().all(|h| !h),
        "{} of {} keys evicted from disk are still held",
        held.iter().filter(|h| **h).count(),
        gone.len()
    );
}

/// `kvtier events` says how its stream ended, on stderr: a node that stops (SIGTERM) closes it
/// (exit 0, "closed the event stream"); a node killed mid-stream breaks it (exit 1, "broke").
#[test]
fn the_events_cli_says_how_its_stream_ended() {
    for (signal, ok, says) in [
        (rustix::process::Signal::TERM, true, "the node closed the event stream (it is stopping) after 0 event(s)"),
        (rustix::process::Signal::KILL, false, "the event stream broke after 0 event(s)"),
    ] {
        let mut server = ServerProcess::start(&["--dram-capacity", "16MiB"]);
        let mut events = std::process::Command::new(kvtier_bin())
            .args(["events", "--server", &server.grpc_addr()])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while metric(&server.scrape(), "kvtier_event_watchers", &[]) < 1.0 {
            assert!(Instant::now() < deadline, "the CLI did not start watching");
            std::thread::sleep(Duration::from_millis(20));
        }
        let pid = rustix::process::Pid::from_child(&server.child);
        rustix::process::kill_process(pid, signal).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while events.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = events.kill();
                panic!("{signal:?}: the CLI kept waiting on a stream whose node is gone");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let out = events.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.success(), ok, "{signal:?}: {stderr}");
        assert!(stderr.contains(says), "{signal:?}: {stderr}");
        // What it watched, said when the watch opened (a quiet namespace is not a hung CLI).
        assert!(stderr.starts_with("watching ns=") && stderr.contains("model \"demo-model\""), "{stderr}");
        assert!(out.stdout.is_empty(), "nothing on stdout but events");
        let _ = server.child.wait();
    }
}
