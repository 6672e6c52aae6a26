//! Limits on what a client can make the server hold, with a real `kvtier serve` process: a
//! data-plane connection that stops sending mid-frame, one that never reads its answer, and one
//! that sits idle are closed after their timeouts (their reserved slots released), while other
//! clients are served throughout; `/metrics` asks for its own token when one is set.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kvtier_proto::dataplane::{Hello, Op, RequestHeader, Status, PROTOCOL_VERSION};
use kvtier_proto::{BlockFrame, CodecId, NamespaceId};
use kvtier_tests::*;

const CONFIG: &str = "stall_timeout = \"700ms\"\nidle_timeout = \"2s\"\nmetrics_token = \"metrics-scrape-secret\"\n";

fn server(dir: &std::path::Path) -> ServerProcess {
    let cfg = dir.join("kvtier.toml");
    std::fs::write(&cfg, CONFIG).unwrap();
    let data = dir.join("data");
    std::fs::create_dir_all(&data).unwrap();
    ServerProcess::start_in(&data, &["--dram-capacity", "64MiB", "--config", cfg.to_str().unwrap()])
}

/// A connection past its hello, as a raw socket.
fn open(server: &ServerProcess) -> TcpStream {
    let mut s = TcpStream::connect(server.data).unwrap();
    s.write_all(&Hello::encode(PROTOCOL_VERSION, b"")).unwrap();
    let mut r = [0u8; 4];
    s.read_exact(&mut r).unwrap();
    let mut msg = vec![0u8; u16::from_le_bytes([r[2], r[3]]) as usize];
    s.read_exact(&mut msg).unwrap();
    assert_eq!(r[0], Status::Ok as u8);
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s
}

/// Waits until the server closes `s`; how long that took.
fn closed_after(s: &mut TcpStream) -> Duration {
    let t = Instant::now();
    let mut b = [0u8; 4096];
    loop {
        match s.read(&mut b) {
            Ok(0) | Err(_) => return t.elapsed(),
            Ok(_) => {}
        }
    }
}

fn scrape_with(server: &ServerProcess, auth: Option<&str>) -> String {
    let mut s = TcpStream::connect(server.metrics.unwrap()).unwrap();
    let auth = auth.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    s.write_all(format!("GET /metrics HTTP/1.1\r\nHost: x\r\n{auth}\r\n").as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_and_idle_connections_are_closed_and_others_are_served() {
    let tmp = tempfile::tempdir().unwrap();
    let server = server(tmp.path());
    let client = server.client().await;
    let ns = client.register(namespace("limits", b"", small_layout())).await.unwrap();
    let t = tokens(3, 64);
    let blocks = full_block_payloads(&ns, &t);

    // 1. A PUT that stops half-way through a payload: closed after the stall timeout, nothing
    //    of it visible.
    let key = ns.keys(&t)[0];
    let frame =
        BlockFrame::new(ns.id, key, ns.namespace.layout, CodecId::RAW, ns.block_tokens() as u32, blocks[0].clone());
    let mut stalled = open(&server);
    let req = RequestHeader { op: Op::Put, flags: 0, request_id: 1, count: 1, namespace: NamespaceId([0; 16]) };
    stalled.write_all(&req.encode()).unwrap();
    stalled.write_all(&frame.header.encode()).unwrap();
    stalled.write_all(&frame.payload[..frame.payload.len() / 2]).unwrap();
    let waited = closed_after(&mut stalled);
    assert!(waited >= Duration::from_millis(500) && waited < Duration::from_secs(10), "{waited:?}");
    assert_eq!(client.lookup(&ns, &t[..ns.block_tokens()]).await.unwrap(), 0, "the cut-off block is not visible");

    // 2. A client that asks for blocks and never reads them: closed after the stall timeout
    //    once its socket buffers are full (the blocks it pinned in flight are let go).
    client.store(&ns, &t, &blocks).await.unwrap().ok().unwrap();
    let keys = ns.keys(&t);
    let mut deaf = open(&server);
    deaf.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut raw = Vec::new();
    // Far more than the socket buffers hold.
    for _ in 0..2000 {
        let get = RequestHeader { op: Op::Get, flags: 0, request_id: 2, count: keys.len() as u32, namespace: ns.id };
        raw.extend_from_slice(&get.encode());
        for k in &keys {
            raw.extend_from_slice(&k.0);
        }
    }
    // Sent from another thread: the server stops reading requests once it can't send answers.
    let sender = std::thread::spawn(move || {
        let _ = deaf.write_all(&raw);
        deaf
    });
    std::thread::sleep(Duration::from_secs(3));
    // Meanwhile others are served.
    assert_eq!(client.lookup(&ns, &t).await.unwrap(), t.len(), "others are served meanwhile");
    // The deaf connection's stall timeout comes once its socket buffers are full and 700 ms more
    // have passed: polled for, not taken to be over after the 3 s above on a busy machine.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let m = scrape_with(&server, Some("metrics-scrape-secret"));
        if metric(&m, "kvtier_errors_total", &[("kind", "dataplane_stall_timeout")]) >= 2.0 {
            break;
        }
        assert!(Instant::now() < deadline, "{m}");
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(sender.join().unwrap());

    // 3. An idle connection: closed after the idle timeout, not the (shorter) stall one.
    let mut idle = open(&server);
    let waited = closed_after(&mut idle);
    assert!(waited >= Duration::from_millis(1800) && waited < Duration::from_secs(10), "{waited:?}");
    let m = scrape_with(&server, Some("metrics-scrape-secret"));
    assert!(metric(&m, "kvtier_errors_total", &[("kind", "dataplane_idle_timeout")]) >= 1.0, "{m}");

    // A pooled client idle through all of it still works when it recycles idle connections
    // before the server's idle timeout (this server's is 2 s; the default pair is 60 s / 5 min).
    let cfg = kvtier_client::ClientConfig { pool_idle: Duration::from_millis(1500), ..Default::default() };
    let recycling = kvtier_client::KvClient::connect(&server.grpc_addr(), cfg).await.unwrap();
    assert_eq!(recycling.load(&ns, &t).await.unwrap(), blocks);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(recycling.load(&ns, &t).await.unwrap(), blocks, "after a pause past the server's idle timeout");
}

/// A PUT whose payload trickles in (a byte every 300 ms, under the 700 ms stall timeout) ends
/// its connection once `lease_timeout` has passed since the frame began, with an answer saying
/// so; nothing of it is visible, and others are served. Before, such a connection was held open
/// for as long as the sender kept trickling (its lease revoked, the bytes still taken).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickled_payload_ends_its_connection_at_the_lease_timeout() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("kvtier.toml");
    std::fs::write(&cfg, "stall_timeout = \"700ms\"\nlease_timeout = \"2s\"\n").unwrap();
    let server = ServerProcess::start(&["--dram-capacity", "64MiB", "--config", cfg.to_str().unwrap()]);
    let client = server.client().await;
    let ns = client.register(namespace("limits", b"", small_layout())).await.unwrap();
    let t = tokens(4, 64);
    let blocks = full_block_payloads(&ns, &t);
    let key = ns.keys(&t)[0];
    let frame =
        BlockFrame::new(ns.id, key, ns.namespace.layout, CodecId::RAW, ns.block_tokens() as u32, blocks[0].clone());
    let mut slow = open(&server);
    let req = RequestHeader { op: Op::Put, flags: 0, request_id: 7, count: 1, namespace: NamespaceId([0; 16]) };
    slow.write_all(&req.encode()).unwrap();
    slow.write_all(&frame.header.encode()).unwrap();
    let mut writer = slow.try_clone().unwrap();
    let payload = frame.payload.clone();
    let trickle = std::thread::spawn(move || {
        for b in payload.iter() {
            if writer.write_all(&[*b]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    });
    let started = Instant::now();
    let mut answer = Vec::new();
    let _ = slow.read_to_end(&mut answer);
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(1800) && waited < Duration::from_secs(10), "{waited:?}");
    let text = String::from_utf8_lossy(&answer);
    assert!(text.contains("did not arrive within lease_timeout"), "{text:?}");
    trickle.join().unwrap();
    assert_eq!(client.lookup(&ns, &t[..ns.block_tokens()]).await.unwrap(), 0, "nothing of it is visible");
    client.store(&ns, &t, &blocks).await.unwrap().ok().unwrap();
    assert_eq!(client.load(&ns, &t).await.unwrap(), blocks, "others are served");
    let m = server.scrape();
    assert!(metric(&m, "kvtier_errors_total", &[("kind", "dataplane_frame_timeout")]) >= 1.0, "{m}");
}

/// Pin leases a `PUT` took are let go once the connection has taken no new one for
/// `idle_timeout`, even while other requests keep it alive. Before, one `EXISTS` every few
/// seconds held them for as long as the client liked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pin_leases_end_when_no_new_one_comes_for_the_idle_timeout() {
    use kvtier_proto::dataplane::{FLAG_PIN_LEASE, RESPONSE_HEADER_LEN};
    let tmp = tempfile::tempdir().unwrap();
    let server = server(tmp.path());
    let client = server.client().await;
    let ns = client.register(namespace("limits", b"pins", small_layout())).await.unwrap();
    let t = tokens(5, 16);
    let blocks = full_block_payloads(&ns, &t);
    let key = ns.keys(&t)[0];
    let frame =
        BlockFrame::new(ns.id, key, ns.namespace.layout, CodecId::RAW, ns.block_tokens() as u32, blocks[0].clone());
    let pinned = async || {
        let s = client.stats().await.unwrap();
        s.tiers.iter().find(|t| t.tier == "dram").map_or(0, |t| t.pinned_bytes)
    };
    let mut conn = open(&server);
    let put =
        RequestHeader { op: Op::Put, flags: FLAG_PIN_LEASE, request_id: 1, count: 1, namespace: NamespaceId([0; 16]) };
    conn.write_all(&put.encode()).unwrap();
    conn.write_all(&frame.header.encode()).unwrap();
    conn.write_all(&frame.payload).unwrap();
    let mut answer = [0u8; RESPONSE_HEADER_LEN + 1];
    conn.read_exact(&mut answer).unwrap();
    assert_eq!(answer[RESPONSE_HEADER_LEN], 0, "stored and pinned");
    assert!(pinned().await > 0);
    // Kept busy (an EXISTS every 600 ms, under the 2 s idle timeout) for 3.5 s.
    let start = Instant::now();
    let mut n = 10;
    while start.elapsed() < Duration::from_millis(3500) {
        let exists = RequestHeader { op: Op::Exists, flags: 0, request_id: n, count: 1, namespace: ns.id };
        conn.write_all(&exists.encode()).unwrap();
        conn.write_all(&key.0).unwrap();
        conn.read_exact(&mut answer).unwrap();
        n += 1;
        std::thread::sleep(Duration::from_millis(600));
    }
    assert_eq!(pinned().await, 0, "the lease pins outlived idle_timeout");
    let m = scrape_with(&server, Some("metrics-scrape-secret"));
    assert!(metric(&m, "kvtier_dataplane_pin_leases_expired_total", &[]) >= 1.0, "{m}");
    assert_eq!(client.load(&ns, &t).await.unwrap(), blocks, "the block itself stays");
}

/// Half a hello under a stall timeout shorter than the hello's own 10 s: closed at the stall
/// timeout and counted as a hello timeout (it was counted nowhere).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_hello_is_counted_as_a_hello_timeout() {
    let tmp = tempfile::tempdir().unwrap();
    let server = server(tmp.path());
    let mut s = TcpStream::connect(server.data).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let hello = Hello::encode(PROTOCOL_VERSION, b"");
    s.write_all(&hello[..hello.len() / 2]).unwrap();
    let waited = closed_after(&mut s);
    assert!(waited < Duration::from_secs(5), "closed at the stall timeout, took {waited:?}");
    let m = scrape_with(&server, Some("metrics-scrape-secret"));
    assert!(metric(&m, "kvtier_errors_total", &[("kind", "dataplane_hello_timeout")]) >= 1.0, "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_ask_for_their_token() {
    let tmp = tempfile::tempdir().unwrap();
    let server = server(tmp.path());
    let open = scrape_with(&server, None);
    assert!(open.starts_with("HTTP/1.1 401"), "{open}");
    assert!(!open.contains("kvtier_"), "no metric leaks without the token");
    let wrong = scrape_with(&server, Some("metrics-secreT"));
    assert!(wrong.starts_with("HTTP/1.1 401"), "{wrong}");
    let ok = scrape_with(&server, Some("metrics-scrape-secret"));
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
    assert!(ok.contains("kvtier_"), "{ok}");
}
