//! The same-node path chosen automatically, against real `kvtier serve` processes on loopback: a
//! client that connected over TCP to a server on this host moves its shared-buffer calls over the
//! server's Unix socket with no configuration, and falls back to TCP — same bytes, counted by
//! reason — when the server advertises no socket, when the socket is gone, or when this process
//! may not open it. The server's own request counters show which path carried each call.

use std::path::{Path, PathBuf};

use kvtier_client::near::Plan;
use kvtier_client::{ClientConfig, FallbackReason, ItemStatus, KvClient, NamespaceHandle, SameNodeMode, SharedBuffer};
use kvtier_proto::BlockKey;
use kvtier_tests::*;

/// `n` blocks of the namespace written into a new buffer back to back; their keys and offsets.
fn filled(h: &NamespaceHandle, toks: &[u32]) -> (SharedBuffer, Vec<BlockKey>, Vec<u64>) {
    let bb = h.block_bytes();
    let keys = h.keys(toks);
    let mut buf = SharedBuffer::new(keys.len() * bb as usize).expect("shared buffer");
    for (i, k) in keys.iter().enumerate() {
        buf.as_mut_slice()[i * bb as usize..(i + 1) * bb as usize].copy_from_slice(&payload_for(k, bb));
    }
    let offsets = (0..keys.len() as u64).map(|i| i * bb).collect();
    (buf, keys, offsets)
}

/// Same-node requests the server served, by op.
fn served(server: &ServerProcess, op: &str) -> f64 {
    metric(&server.scrape(), "kvtier_requests_total", &[("op", op)])
}

async fn connect(server: &ServerProcess, samenode: SameNodeMode) -> (KvClient, NamespaceHandle) {
    let cfg = ClientConfig { samenode, ..ClientConfig::default() };
    let client = KvClient::connect(&server.grpc_addr(), cfg).await.expect("connect");
    let h = client.register(namespace("auto", b"s", small_layout())).await.expect("register");
    (client, h)
}

/// Stores 4 blocks from a shared buffer, loads them into another one (shifted, in reverse
/// order) and by prefix, and checks every byte; the data plane sees the same blocks.
async fn round_trip(client: &KvClient, h: &NamespaceHandle, seed: u32) {
    let bb = h.block_bytes();
    let toks = tokens(seed, 4 * h.block_tokens());
    let (src, keys, offsets) = filled(h, &toks);
    let st = client.store_keys_from_buffer(h, &keys, &src, &offsets).await.expect("store");
    assert_eq!(st, vec![ItemStatus::Ok; 4]);

    let mut dst = SharedBuffer::new(5 * bb as usize).expect("buffer");
    let at: Vec<u64> = (0..4u64).map(|i| 100 + (3 - i) * bb).collect();
    assert_eq!(client.load_keys_into_buffer(h, &keys, &mut dst, &at, false).await.unwrap(), vec![true; 4]);
    for (k, o) in keys.iter().zip(&at) {
        assert_eq!(&dst.as_slice()[*o as usize..(*o + bb) as usize], &payload_for(k, bb)[..]);
    }
    let mut pre = SharedBuffer::new(4 * bb as usize).expect("buffer");
    assert_eq!(client.load_prefix_into_buffer(h, &toks, &mut pre, 0, 4).await.unwrap(), 4);
    assert_eq!(pre.as_slice(), src.as_slice());
    let over_tcp = client.load_keys(h, &keys).await.unwrap();
    for (f, k) in over_tcp.iter().zip(&keys) {
        assert_eq!(f.as_ref().map(|f| f.payload.clone()), Some(payload_for(k, bb)));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_on_the_servers_host_uses_the_socket_without_configuration() {
    let server = ServerProcess::start(&[]);
    let (client, h) = connect(&server, SameNodeMode::Auto).await;
    let sock = server.dir.join("kvtier.sock");
    assert_eq!(client.samenode_plan(), &Plan::Use(sock.clone()), "same boot id, socket advertised");

    round_trip(&client, &h, 1).await;
    let stats = client.samenode_stats();
    assert_eq!((stats.stores, stats.loads), (1, 2), "{stats:?}");
    assert_eq!(stats.fallback_total(), 0, "{stats:?}");
    assert!(stats.active);
    assert_eq!(served(&server, "samenode_store"), 1.0);
    assert_eq!(served(&server, "samenode_load"), 2.0);

    // Prefix stores from a buffer: blocks 0..2 already held, 2..4 new; a store with a codec goes
    // over TCP, counted as `encoded`.
    let toks = tokens(2, 4 * h.block_tokens());
    let (src, keys, offsets) = filled(&h, &toks);
    client.store_keys_from_buffer(&h, &keys[..2], &src, &offsets[..2]).await.unwrap();
    let report = client.store_prefix_from_buffer(&h, &toks, 2, &src, offsets[2], 2).await.unwrap();
    assert_eq!((report.stored, report.rejected.len()), (2, 0));
    assert_eq!(client.lookup(&h, &toks).await.unwrap(), toks.len());
    let lz4 = h.clone().with_codec(kvtier_proto::CodecId::from_name("raw+lz4").expect("raw+lz4")).unwrap();
    let toks3 = tokens(3, 2 * h.block_tokens());
    let (src3, keys3, offsets3) = filled(&h, &toks3);
    assert_eq!(client.store_keys_from_buffer(&lz4, &keys3, &src3, &offsets3).await.unwrap(), vec![ItemStatus::Ok; 2]);
    assert_eq!(client.samenode_stats().fallbacks.get(&FallbackReason::Encoded), Some(&1));
    assert_eq!(served(&server, "samenode_store"), 3.0, "the encoded store did not use the socket");

    // Bad offsets are the caller's error on either path, before anything moves.
    let mut small = SharedBuffer::new(h.block_bytes() as usize).unwrap();
    let e = client.load_keys_into_buffer(&h, &keys[..1], &mut small, &[1], false).await.unwrap_err();
    assert_eq!(e.reason(), "invalid_argument", "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turned_off_in_the_config_every_call_goes_over_tcp_uncounted() {
    let server = ServerProcess::start(&[]);
    let (client, h) = connect(&server, SameNodeMode::Off).await;
    assert_eq!(client.samenode_plan(), &Plan::Off);
    round_trip(&client, &h, 4).await;
    let stats = client.samenode_stats();
    assert_eq!((stats.loads, stats.stores, stats.fallback_total()), (0, 0, 0), "{stats:?}");
    assert_eq!(served(&server, "samenode_load") + served(&server, "samenode_store"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_a_socket_is_reached_over_tcp_counted_not_advertised() {
    let cfg_dir = tempfile::tempdir().unwrap();
    let cfg = cfg_dir.path().join("kvtier.toml");
    std::fs::write(&cfg, "samenode_socket = \"off\"\n").unwrap();
    let server = ServerProcess::start(&["--config", cfg.to_str().unwrap()]);
    let (client, h) = connect(&server, SameNodeMode::Auto).await;
    assert_eq!(client.samenode_plan(), &Plan::Never(FallbackReason::NotAdvertised));
    round_trip(&client, &h, 5).await;
    let stats = client.samenode_stats();
    assert_eq!(stats.fallbacks.get(&FallbackReason::NotAdvertised), Some(&3), "{stats:?}");
    let (_, why) = stats.last_fallback.clone().expect("a last fallback");
    assert!(why.contains("advertises no same-node socket"), "{why}");
    assert_eq!(stats.loads + stats.stores, 0);
    assert!(!stats.active);
}

/// A server that says it runs on another host (`host_id` set, as for a container whose socket is
/// not shared) is reached over TCP: counted `other_host`, whatever its socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_on_another_host_is_reached_over_tcp_counted_other_host() {
    let cfg_dir = tempfile::tempdir().unwrap();
    let cfg = cfg_dir.path().join("kvtier.toml");
    std::fs::write(&cfg, "host_id = \"some-other-machine\"\n").unwrap();
    let server = ServerProcess::start(&["--config", cfg.to_str().unwrap()]);
    let (client, h) = connect(&server, SameNodeMode::Auto).await;
    assert_eq!(client.samenode_plan(), &Plan::Never(FallbackReason::OtherHost));
    round_trip(&client, &h, 7).await;
    let stats = client.samenode_stats();
    assert_eq!(stats.fallbacks.get(&FallbackReason::OtherHost), Some(&3), "{stats:?}");
    assert_eq!(served(&server, "samenode_load") + served(&server, "samenode_store"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_socket_means_tcp_counted_socket_missing() {
    let server = ServerProcess::start(&[]);
    let sock = server.dir.join("kvtier.sock");
    std::fs::remove_file(&sock).expect("remove the socket file");
    let (client, h) = connect(&server, SameNodeMode::Auto).await;
    assert_eq!(client.samenode_plan(), &Plan::Use(sock), "the plan is made from Info alone");
    round_trip(&client, &h, 6).await;
    let stats = client.samenode_stats();
    assert_eq!(stats.fallbacks.get(&FallbackReason::SocketMissing), Some(&3), "{stats:?}");
    let (reason, why) = stats.last_fallback.clone().expect("a last fallback");
    assert_eq!(reason, FallbackReason::SocketMissing);
    assert!(why.contains("kvtier.sock"), "the error names the socket: {why}");
    assert_eq!(served(&server, "samenode_load") + served(&server, "samenode_store"), 0.0);
}

/// While alive, this thread runs without `CAP_DAC_OVERRIDE` and `CAP_DAC_READ_SEARCH` (Linux
/// capabilities are per thread), so a root test process meets file modes as any user does.
struct NoDacOverride(Option<rustix::thread::CapabilitySets>);

impl NoDacOverride {
    fn drop_here() -> Self {
        use rustix::thread::{capabilities, set_capabilities, CapabilitySet};
        let Ok(before) = capabilities(None) else { return NoDacOverride(None) };
        let mut less = before;
        less.effective -= CapabilitySet::DAC_OVERRIDE | CapabilitySet::DAC_READ_SEARCH;
        set_capabilities(None, less).expect("lower this thread's effective capabilities");
        NoDacOverride(Some(before))
    }
}

impl Drop for NoDacOverride {
    fn drop(&mut self) {
        if let Some(before) = self.0 {
            let _ = rustix::thread::set_capabilities(None, before);
        }
    }
}

fn chmod(p: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

/// The data directory made unreadable (mode 000): the socket inside can't be reached. The client
/// runs on a thread of its own with a current-thread runtime, so the socket's `connect` runs on
/// the thread whose capabilities were lowered.
#[test]
fn a_socket_this_process_may_not_open_means_tcp_counted_permission_denied() {
    let server = ServerProcess::start(&[]);
    let dir: PathBuf = server.dir.clone();
    chmod(&dir, 0o000);
    let grpc = server.grpc_addr();
    let outcome = std::thread::spawn(move || {
        let _caps = NoDacOverride::drop_here();
        assert!(
            std::fs::read_dir(&dir).is_err(),
            "this thread can still read a mode-000 directory: the test can't make a permission error"
        );
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        rt.block_on(async {
            let client = KvClient::connect(&grpc, ClientConfig::default()).await.expect("connect");
            let h = client.register(namespace("auto", b"p", small_layout())).await.expect("register");
            round_trip(&client, &h, 7).await;
            client.samenode_stats()
        })
    })
    .join();
    chmod(&server.dir, 0o700);
    let stats = outcome.expect("the client thread");
    assert_eq!(stats.fallbacks.get(&FallbackReason::PermissionDenied), Some(&3), "{stats:?}");
    assert_eq!(stats.loads + stats.stores, 0);
    assert_eq!(served(&server, "samenode_load") + served(&server, "samenode_store"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_buffers_are_unregistered_so_the_per_connection_cap_never_fills() {
    let server = ServerProcess::start(&[]);
    let (client, h) = connect(&server, SameNodeMode::Auto).await;
    let toks = tokens(8, h.block_tokens());
    let (src, keys, offsets) = filled(&h, &toks);
    client.store_keys_from_buffer(&h, &keys, &src, &offsets).await.unwrap();
    // Far more short-lived buffers than one connection may register (64): each is dropped
    // after its load, and unregistered before the next registration.
    for _ in 0..3 * kvtier_server::samenode::MAX_BUFFERS_PER_CONNECTION {
        let mut dst = SharedBuffer::new(src.len()).unwrap();
        assert_eq!(client.load_keys_into_buffer(&h, &keys, &mut dst, &offsets, true).await.unwrap(), vec![true]);
        assert_eq!(dst.as_slice(), src.as_slice());
    }
    let stats = client.samenode_stats();
    assert_eq!(stats.fallback_total(), 0, "{stats:?}");
    assert_eq!(stats.loads, 3 * kvtier_server::samenode::MAX_BUFFERS_PER_CONNECTION as u64);
}

/// One buffer used by several calls at once (an engine's prefetch and backup on one pool), on
/// the same-node path and over TCP alike: a load and a store on places no other call holds go
/// ahead while another call holds some places of the buffer; a load onto a held place waits
/// until it is released, then lands; every byte is where it belongs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[allow(clippy::single_range_in_vec_init)] // a claim takes a list of ranges: here one
async fn calls_share_a_buffer_on_disjoint_places_and_wait_on_overlapping_ones() {
    use kvtier_client::ConcurrentBuffer;
    use std::time::Duration;
    let server = ServerProcess::start(&[]);
    for (seed, mode) in [(40, SameNodeMode::Auto), (50, SameNodeMode::Off)] {
        let (client, h) = connect(&server, mode).await;
        let bb = h.block_bytes();
        let b = bb as usize;
        let toks = tokens(seed, 8 * h.block_tokens());
        let (src, keys, offsets) = filled(&h, &toks);
        assert_eq!(client.store_keys_from_buffer(&h, &keys, &src, &offsets).await.unwrap(), vec![ItemStatus::Ok; 8]);

        let shared = ConcurrentBuffer::new(SharedBuffer::new(8 * b).unwrap());
        // Another call holds places 0 and 1 (and writes block 1 there itself).
        let mut held = shared.claim(&[0..2 * b], true).await.unwrap();
        held.bytes_mut(b..2 * b).unwrap().copy_from_slice(&payload_for(&keys[1], bb));

        let within = Duration::from_secs(20);
        let landed =
            tokio::time::timeout(within, client.load_keys_into_buffer(&h, &keys[2..], &shared, &offsets[2..], false))
                .await
                .expect("a load on free places is not held up")
                .unwrap();
        assert_eq!(landed, vec![true; 6], "{mode:?}");
        // A store from places 2 and 3 under new keys: what it sends is what lies there.
        let keys2 = h.keys(&tokens(seed + 1, 2 * h.block_tokens()));
        let stored = tokio::time::timeout(within, client.store_keys_from_buffer(&h, &keys2, &shared, &offsets[2..4]))
            .await
            .expect("a store on free places is not held up")
            .unwrap();
        assert_eq!(stored, vec![ItemStatus::Ok; 2], "{mode:?}");
        for (f, k) in client.load_keys(&h, &keys2).await.unwrap().iter().zip(&keys[2..4]) {
            assert_eq!(f.as_ref().map(|f| f.payload.clone()), Some(payload_for(k, bb)), "{mode:?}");
        }

        // A load onto place 0 waits for the holder, then lands.
        {
            let onto_held = client.load_keys_into_buffer(&h, &keys[..1], &shared, &offsets[..1], false);
            tokio::pin!(onto_held);
            assert!(
                tokio::time::timeout(Duration::from_millis(300), &mut onto_held).await.is_err(),
                "{mode:?}: a load onto a held place went ahead"
            );
            drop(held);
            let landed = tokio::time::timeout(within, onto_held).await.expect("released").unwrap();
            assert_eq!(landed, vec![true], "{mode:?}");
        }

        let mut shared = shared;
        assert_eq!(shared.get_mut().as_slice(), src.as_slice(), "{mode:?}: every block in its place");
    }
    assert!(served(&server, "samenode_load") >= 2.0, "the automatic client's loads used the socket");
    assert!(served(&server, "samenode_store") >= 1.0);
}
