//! The never-raise engine client: every error or timeout becomes a miss with a reason, against a
//! live server, a dead one, and one that accepts connections but never answers.

use std::time::Duration;

use kvtier_client::{ClientConfig, EngineClient};
use kvtier_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_then_dead_server() {
    let mut server = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    let engine = EngineClient::new(server.grpc_addr(), ClientConfig::default(), Duration::from_secs(5))
        .with_retry_after(Duration::from_millis(10));
    let ns = namespace("engine", b"e", small_layout());
    // Blocks are computed from keys, which need the namespace's chain: a typed client gives them.
    let typed = server.client().await;
    let handle = typed.register(ns.clone()).await.unwrap();
    let t = tokens(4, 320);
    let blocks = full_block_payloads(&handle, &t);
    assert_eq!(engine.store(&ns, &t, &blocks).await, 20);
    assert_eq!(engine.lookup(&ns, &t).await, 320);
    let loaded = engine.load(&ns, &t).await;
    assert!(loaded.miss.is_none(), "{:?}", loaded.miss);
    assert_eq!(loaded.blocks, blocks);

    // The server dies: calls come back as misses with a reason, not errors or hangs.
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    let loaded = engine.load(&ns, &t).await;
    assert!(loaded.blocks.is_empty());
    let miss = loaded.miss.expect("a miss");
    assert!(["io", "connect", "timeout", "protocol"].contains(&miss.reason), "{miss:?}");
    assert_eq!(engine.lookup(&ns, &t).await, 0);
    assert_eq!(engine.store(&ns, &t, &blocks).await, 0);
    assert!(engine.resume(&ns, "nobody").await.is_err());
}

/// A server restarted where it was is reached again soon after it listens: a refused connection
/// fails in microseconds, so the client waits 50 ms before dialling again, not its 1 s ceiling
/// (before, every call in the second after the last refused attempt was a miss).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_is_reached_again_within_a_moment() {
    let mut server = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    let engine = EngineClient::new(server.grpc_addr(), ClientConfig::default(), Duration::from_secs(5));
    let ns = namespace("engine", b"r", small_layout());
    let t = tokens(7, 64);
    assert_eq!(engine.lookup(&ns, &t).await, 0, "connected: nothing stored yet");
    assert_eq!(
        engine
            .store(&ns, &t, &full_block_payloads(&server.client().await.register(ns.clone()).await.unwrap(), &t))
            .await,
        4
    );
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    // The first call finds its connection broken, the next one is refused while connecting.
    for _ in 0..2 {
        let missed = engine.load(&ns, &t).await;
        assert!(missed.blocks.is_empty(), "{:?}", missed.miss);
    }
    let refused_at = std::time::Instant::now();
    let _restarted = server.restart_in_place(&["--dram-capacity", "64MiB"]);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let since = refused_at.elapsed();
    // The restarted node starts empty (no disk tier): a lookup that answers 0 without a miss
    // reached it, one that was refused or backed off counts a miss.
    let reached = engine
        .call("lookup", &ns, |c, h| {
            let t = t.clone();
            async move { c.lookup(&h, &t).await }
        })
        .await;
    assert!(
        reached.is_ok(),
        "{since:?} after the refused attempt, and the server listening again: {:?}",
        reached.err()
    );
}

/// A listener that accepts TCP connections and then says nothing, forever; its address.
async fn silent_listener() -> String {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = silent.accept().await {
            held.push(s);
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_never_answers_costs_one_budget() {
    let addr = silent_listener().await;
    let cfg = ClientConfig {
        connect_timeout: Duration::from_secs(30),
        request_timeout: Duration::from_secs(30),
        ..Default::default()
    };
    let engine = EngineClient::new(addr, cfg, Duration::from_millis(300));
    let ns = namespace("engine", b"", small_layout());
    let t = tokens(1, 64);
    // Without the budget this would wait for the 30 s timeouts; the test harness would notice.
    let loaded =
        tokio::time::timeout(Duration::from_secs(20), engine.load(&ns, &t)).await.expect("load honoured its budget");
    assert_eq!(loaded.miss.map(|m| m.reason), Some("timeout"));
    let n = tokio::time::timeout(Duration::from_secs(20), engine.lookup(&ns, &t))
        .await
        .expect("lookup honoured its budget");
    assert_eq!(n, 0);
}

/// A call's budget holds while another call of the same client is connecting (holding the
/// connection's lock for up to its connect timeout): the short call returns at its budget. Before,
/// it waited for the connecting call (4.8 s past a 0.5 s budget), its miss saying "timed out
/// after 500ms".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_s_budget_holds_while_another_call_is_connecting() {
    let addr = silent_listener().await;
    let cfg = ClientConfig { connect_timeout: Duration::from_secs(5), ..Default::default() };
    let engine = EngineClient::new(addr, cfg, Duration::from_secs(5));
    let ns = namespace("engine", b"", small_layout());
    let slow = {
        let (engine, ns) = (engine.clone(), ns.clone());
        tokio::spawn(async move { engine.exists_keys(&ns, &[b"a"], Duration::from_secs(5)).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let t = std::time::Instant::now();
    let held = engine.exists_keys(&ns, &[b"b"], Duration::from_millis(500)).await;
    let took = t.elapsed();
    assert_eq!(held, vec![false]);
    assert!(took < Duration::from_millis(1500), "a 500 ms call took {took:?} behind a connecting one");
    assert_eq!(slow.await.unwrap(), vec![false]);
}

/// The engine-key calls never raise either: a live server answers per key (within a 500 ms
/// budget, once connected), a dead one gives all false within the caller's deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_keys_never_raise() {
    use kvtier_proto::{DType, HashScheme, KvLayout, Namespace};
    let mut server = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    let engine = EngineClient::new(server.grpc_addr(), ClientConfig::default(), Duration::from_secs(5))
        .with_retry_after(Duration::from_millis(10));
    let ns = Namespace::new("acme", "m@1", KvLayout::opaque(8192, DType::Bf16, 16), HashScheme::Sha256, b"")
        .with_engine("engine=test");
    let hashes: Vec<&[u8]> = vec![b"chunk-0", b"chunk-1", b"chunk-2"];
    let blocks: Vec<Vec<bytes::Bytes>> =
        (0..2u8).map(|i| vec![bytes::Bytes::from(vec![i; 4096]), bytes::Bytes::from(vec![i ^ 0xff; 4096])]).collect();
    // The first call connects and registers the namespace: done once, unbudgeted, so the 500 ms
    // budgets below are the calls' own.
    let first = hashes[0];
    let warm = engine
        .call_within("exists", &ns, Duration::from_secs(10), |c, h| async move {
            c.exists_keys(&h, &[h.engine_key(first)]).await
        })
        .await;
    assert_eq!(warm.expect("connects, registers and answers"), vec![false], "nothing stored yet");
    let budget = Duration::from_millis(500);
    assert_eq!(engine.store_keys(&ns, &hashes[..2], &blocks, budget).await, vec![true, true]);
    assert_eq!(engine.exists_keys(&ns, &hashes, budget).await, vec![true, true, false]);
    let mut out = vec![0u8; 8192];
    let got = engine.load_keys_into(&ns, &hashes[1..2], &mut [vec![&mut out[..]]], budget).await;
    assert_eq!(got, vec![true]);
    assert!(out[..4096].iter().all(|b| *b == 1) && out[4096..].iter().all(|b| *b == 0xfe));

    server.child.kill().unwrap();
    server.child.wait().unwrap();
    let t = std::time::Instant::now();
    assert_eq!(engine.exists_keys(&ns, &hashes, budget).await, vec![false; 3]);
    assert_eq!(engine.store_keys(&ns, &hashes[..2], &blocks, budget).await, vec![false; 2]);
    assert_eq!(engine.load_keys_into(&ns, &hashes[1..2], &mut [vec![&mut out[..]]], budget).await, vec![false]);
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}

/// A same-node load past the call's budget is not cut while the server may still copy into the
/// caller's buffer: the call ends once the exchange has closed and the server has let go. Here
/// the server is stopped (SIGSTOP) mid-call and resumed 1.5 s later; the call, budgeted 300 ms,
/// returns its timeout only after that, and nothing lands in the buffer afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_same_node_call_past_its_budget_waits_until_the_server_lets_go_of_the_buffer() {
    use kvtier_client::SharedBuffer;

    let server = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    let ns = namespace("engine", b"sn", small_layout());
    let typed = server.client().await;
    let handle = typed.register(ns.clone()).await.unwrap();
    let t = tokens(6, 64 * handle.block_tokens());
    let keys = handle.keys(&t);
    assert_eq!(typed.store(&handle, &t, &full_block_payloads(&handle, &t)).await.unwrap().stored, keys.len());
    let bb = handle.block_bytes();
    let offsets: Vec<u64> = (0..keys.len() as u64).map(|i| i * bb).collect();
    let mut buf = SharedBuffer::new(keys.len() * bb as usize).unwrap();
    let engine = EngineClient::new(server.grpc_addr(), ClientConfig::default(), Duration::from_millis(300));
    // Connected, namespace known, same-node path in use: a first load lands.
    let first = engine
        .call("load", &ns, |c, h| {
            let (keys, offsets, buf) = (&keys, &offsets, &mut buf);
            async move { c.load_keys_into_buffer(&h, keys, buf, offsets, false).await }
        })
        .await
        .unwrap();
    assert_eq!(first, vec![true; keys.len()]);
    assert_eq!(typed.samenode_stats().fallbacks.len(), 0);
    buf.as_mut_slice().fill(0);

    let pid = server.child.id();
    let start = std::time::Instant::now();
    stop_process(pid);
    let resume = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(1500).saturating_sub(start.elapsed()));
        continue_process(pid);
    });
    let late = engine
        .call("load", &ns, |c, h| {
            let (keys, offsets, buf) = (&keys, &offsets, &mut buf);
            async move { c.load_keys_into_buffer(&h, keys, buf, offsets, false).await }
        })
        .await;
    let took = start.elapsed();
    resume.join().unwrap();
    assert_eq!(late.unwrap_err().reason, "timeout");
    assert!(took >= Duration::from_millis(1400), "returned after {took:?}, while the server was stopped");
    // The server let go: nothing lands in the buffer after the call returned.
    let snapshot = buf.as_slice().to_vec();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(buf.as_slice(), &snapshot[..]);
}
