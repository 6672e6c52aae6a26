//! The seed's red-flag tests (fragmentation and the longest input + 10% are in `fragmentation.rs`
//! and `bad_input.rs`): a straggler — one client's link slowed — must not stall the others, and a
//! bandwidth-heavy neighbour on the same loopback must leave loads correct and bounded in time.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use kvtier_tests::harness::Cluster;
use kvtier_tests::*;

/// Loads `doc` `n` times through `client`, checking every byte; how long that took.
async fn load_rounds(
    client: &kvtier_client::KvClient,
    ns: &kvtier_client::NamespaceHandle,
    doc: &[u32],
    n: usize,
) -> Duration {
    let want = full_block_payloads(ns, doc);
    let t = Instant::now();
    for _ in 0..n {
        let got = client.load(ns, doc).await.unwrap();
        assert!(got == want, "a load returned other bytes");
    }
    t.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_straggler_does_not_stall_the_other_clients() {
    let cluster = Cluster::start(1).await;
    let fast = cluster.link(0).await;
    let slow = cluster.link(0).await;
    let ns = fast.client.register(namespace("straggler", b"", small_layout())).await.unwrap();
    let slow_ns = slow.client.register(namespace("straggler", b"", small_layout())).await.unwrap();
    let doc = tokens(1, 64 * 16); // 64 blocks of 32 KiB
    fast.client.store(&ns, &doc, &full_block_payloads(&ns, &doc)).await.unwrap().ok().unwrap();

    let alone = load_rounds(&fast.client, &ns, &doc, 10).await;
    // The straggler: every read and write on its link waits 2 ms, and it loads the same blocks
    // the whole time the fast client does.
    slow.faults.set_delay(Some(Duration::from_millis(2)));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let straggler = {
        let (client, stop, doc) = (slow.client.clone(), stop.clone(), doc.clone());
        tokio::spawn(async move {
            let mut rounds = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                load_rounds(&client, &slow_ns, &doc, 1).await;
                rounds += 1;
            }
            rounds
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let beside = load_rounds(&fast.client, &ns, &doc, 10).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let rounds = straggler.await.unwrap();
    eprintln!("straggler: fast client {alone:?} alone, {beside:?} beside it; the straggler did {rounds} rounds");
    assert!(rounds >= 1, "the straggler itself makes progress");
    // Two cores shared by both: up to 4x is contention, more would be waiting on the straggler.
    assert!(beside <= alone * 4 + Duration::from_millis(300), "stalled behind the straggler: {alone:?} -> {beside:?}");
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bandwidth_heavy_neighbour_leaves_loads_correct_and_bounded() {
    let server = ServerProcess::start(&["--dram-capacity", "256MiB"]);
    let client = server.client().await;
    let ns = client.register(namespace("latency", b"", small_layout())).await.unwrap();
    let doc = tokens(2, 16 * 16);
    client.store(&ns, &doc, &full_block_payloads(&ns, &doc)).await.unwrap().ok().unwrap();

    // Neighbour 1: a raw loopback flood, as fast as the kernel moves it.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let sink = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut buf = vec![0u8; 1 << 20];
        let mut total = 0u64;
        while let Ok(n) = s.read(&mut buf) {
            if n == 0 {
                break;
            }
            total += n as u64;
        }
        total
    });
    let flood = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            let buf = vec![7u8; 1 << 20];
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if s.write_all(&buf).is_err() {
                    break;
                }
            }
        })
    };
    // Neighbour 2: another tenant of the same server storing and loading 8 MiB batches.
    let heavy = {
        let (stop, grpc) = (stop.clone(), server.grpc_addr());
        tokio::spawn(async move {
            let c = kvtier_client::KvClient::connect(&grpc, kvtier_client::ClientConfig::default()).await.unwrap();
            let hns = c.register(namespace("heavy", b"", small_layout())).await.unwrap();
            let mut round = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let d = tokens(100 + round, 256 * 16);
                c.store(&hns, &d, &full_block_payloads(&hns, &d)).await.unwrap().ok().unwrap();
                assert_eq!(c.load(&hns, &d).await.unwrap().len(), 256);
                round += 1;
            }
            round
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;

    // The latency-sensitive client: lookup + load of a 16-block prefix, 30 times.
    let want = full_block_payloads(&ns, &doc);
    let mut times = Vec::new();
    for _ in 0..30 {
        let t = Instant::now();
        assert_eq!(client.lookup(&ns, &doc).await.unwrap(), doc.len());
        let got = client.load(&ns, &doc).await.unwrap();
        assert!(got == want, "a load under congestion returned other bytes");
        times.push(t.elapsed());
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let heavy_rounds = heavy.await.unwrap();
    flood.join().unwrap();
    let flooded = sink.join().unwrap();
    times.sort();
    let (p50, worst) = (times[times.len() / 2], times[times.len() - 1]);
    eprintln!(
        "congestion: lookup+load of 512 KiB p50 {p50:?}, worst {worst:?}; neighbours moved {} MiB raw and {heavy_rounds} x 8 MiB through kvtier",
        flooded >> 20
    );
    assert!(heavy_rounds >= 1 && flooded > 0, "the neighbours really ran");
    assert!(worst < Duration::from_secs(3), "a load waited {worst:?} behind its neighbours");
}
