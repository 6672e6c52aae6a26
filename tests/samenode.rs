//! The same-node path against real in-process nodes (`kvtier_server::start` on a temp dir, its
//! same-node socket at `<data_dir>/kvtier.sock`): round trips through registered buffers, and
//! every kind of bad input — offsets out of range, unsealed or short memfds, too many buffers, a
//! client that dies mid-request, bytes changed under a store — answered clearly while the node
//! keeps serving.

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use kvtier_client::{ClientError, ItemStatus, KvClient, NamespaceHandle, SameNode, Segment, SharedBuffer};
use kvtier_proto::codes;
use kvtier_proto::dataplane::Status;
use kvtier_proto::samenode::{encode_hello, LoadItem, SnOp, SnRequest, StoreItem};
use kvtier_proto::{BlockKey, CodecId, FrameHeader};
use kvtier_server::samenode::MAX_BUFFERS_PER_CONNECTION;
use kvtier_tests::harness::{client_config, Cluster, Transport};
use kvtier_tests::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn setup() -> (Cluster, KvClient, NamespaceHandle) {
    let cluster = Cluster::start_with(1, Transport::Duplex, |_, _| {}).await;
    let client = cluster.link(0).await.client;
    let h = client.register(namespace("near", b"n", small_layout())).await.expect("register");
    (cluster, client, h)
}

/// `n` blocks of the namespace written into a new buffer back to back; their keys and offsets.
fn filled(h: &NamespaceHandle, seed: u32, n: usize) -> (SharedBuffer, Vec<BlockKey>, Vec<u64>) {
    let bb = h.block_bytes();
    let keys = h.keys(&tokens(seed, n * h.block_tokens()));
    let mut buf = SharedBuffer::new(n * bb as usize).unwrap();
    for (i, k) in keys.iter().enumerate() {
        buf.as_mut_slice()[i * bb as usize..(i + 1) * bb as usize].copy_from_slice(&payload_for(k, bb));
    }
    let offsets = (0..n as u64).map(|i| i * bb).collect();
    (buf, keys, offsets)
}

fn is_refusal(e: &ClientError, code: &str, words: &str) -> bool {
    matches!(e, ClientError::Refused { code: c, message } if c == code && message.contains(words))
}

/// How many mappings of a kvtier shared buffer this process holds (the client's and, the
/// server being in process, the server's).
/// Mappings in this process of these buffers' memfds (by inode, so buffers other tests create
/// and drop meanwhile don't count).
fn mappings_of(bufs: &[SharedBuffer]) -> usize {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;
    let inodes: std::collections::HashSet<String> = bufs
        .iter()
        .map(|b| std::fs::metadata(format!("/proc/self/fd/{}", b.fd().as_raw_fd())).unwrap().ino().to_string())
        .collect();
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| {
            l.contains("memfd:kvtier-buffer") && l.split_whitespace().nth(4).is_some_and(|i| inodes.contains(i))
        })
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_from_a_buffer_and_loaded_into_another_the_bytes_are_equal() {
    let (cluster, client, h) = setup().await;
    let path = cluster.node(0).server.samenode_path.clone().expect("the node has a same-node socket");
    assert_eq!(client.server_info().samenode_socket, path.display().to_string());
    assert!(!client.server_info().host_id.is_empty());
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);

    let mut near = client.samenode().await.expect("same host: the same-node path opens");
    let (src, keys, offsets) = filled(&h, 1, 4);
    let st = near.store_from_buffer(&h, &keys, &src, &offsets).await.unwrap();
    assert_eq!(st, vec![ItemStatus::Ok; 4]);
    assert_eq!(near.store_from_buffer(&h, &keys, &src, &offsets).await.unwrap(), vec![ItemStatus::Present; 4]);

    // Loaded into another buffer, in reverse order and shifted by 100 bytes.
    let bb = h.block_bytes();
    let mut dst = SharedBuffer::new(5 * bb as usize).unwrap();
    let at: Vec<u64> = (0..4u64).map(|i| 100 + (3 - i) * bb).collect();
    assert_eq!(near.load_into_buffer(&h, &keys, &mut dst, &at, false).await.unwrap(), vec![true; 4]);
    for (k, o) in keys.iter().zip(&at) {
        assert_eq!(&dst.as_slice()[*o as usize..(*o + bb) as usize], &payload_for(k, bb)[..]);
    }
    // The data plane sees the same blocks.
    let over_tcp = client.load_keys(&h, &keys).await.unwrap();
    assert_eq!(over_tcp.len(), 4);
    cluster.stop().await;
    assert!(!path.exists(), "the socket file is removed when the node stops");
}

/// Answers read while polling, parked, and partly each (a poll that gives up before the answer)
/// are the same answers: byte-exact loads, the same statuses, the connection in step after each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_are_the_same_polled_for_parked_or_both() {
    let (cluster, client, h) = setup().await;
    let mut near = client.samenode().await.unwrap();
    let bb = h.block_bytes();
    let (src, keys, offsets) = filled(&h, 9, 32);
    for (round, poll) in [Duration::ZERO, Duration::from_micros(1), Duration::from_millis(2)].into_iter().enumerate() {
        near.set_answer_poll(poll);
        let mut dst = SharedBuffer::new(src.len()).unwrap();
        let want = if round == 0 { ItemStatus::Ok } else { ItemStatus::Present };
        assert_eq!(near.store_from_buffer(&h, &keys, &src, &offsets).await.unwrap(), vec![want; 32], "poll {poll:?}");
        // One block a call, then all of them in one call, then a miss among them.
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(near.load_into_buffer(&h, &[*k], &mut dst, &[offsets[i]], false).await.unwrap(), [true]);
        }
        assert_eq!(dst.as_slice(), src.as_slice(), "poll {poll:?}: one block a call");
        dst.as_mut_slice().fill(0);
        assert_eq!(near.load_into_buffer(&h, &keys, &mut dst, &offsets, false).await.unwrap(), vec![true; 32]);
        assert_eq!(dst.as_slice(), src.as_slice(), "poll {poll:?}: one call");
        let missing = h.keys(&tokens(1000 + round as u32, h.block_tokens()))[0];
        let got = near.load_into_buffer(&h, &[keys[0], missing, keys[1]], &mut dst, &[0, bb, 2 * bb], false).await;
        assert_eq!(got.unwrap(), [true, false, true], "poll {poll:?}");
    }
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misses_are_reported_and_stop_at_miss_ends_the_prefix() {
    let (cluster, client, h) = setup().await;
    let mut near = client.samenode().await.unwrap();
    let (src, keys, offsets) = filled(&h, 2, 3);
    // Blocks 0 and 2 stored, 1 not.
    let st = near.store_from_buffer(&h, &[keys[0], keys[2]], &src, &[offsets[0], offsets[2]]).await.unwrap();
    assert_eq!(st, vec![ItemStatus::Ok; 2]);
    let mut dst = SharedBuffer::new(src.len()).unwrap();
    assert_eq!(near.load_into_buffer(&h, &keys, &mut dst, &offsets, false).await.unwrap(), vec![true, false, true]);
    assert_eq!(near.load_into_buffer(&h, &keys, &mut dst, &offsets, true).await.unwrap(), vec![true, false, false]);
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offsets_out_of_range_are_refused_per_item_and_the_connection_goes_on() {
    let (cluster, client, h) = setup().await;
    let mut near = client.samenode().await.unwrap();
    let bb = h.block_bytes();
    let (src, keys, offsets) = filled(&h, 3, 2);
    let id = near.register(&src).await.unwrap();
    // Store: the second item's block would end one byte past the buffer; an offset near u64::MAX
    // must not wrap around.
    let header = |i: usize| FrameHeader {
        codec: CodecId::RAW,
        tokens: h.namespace.layout.block_tokens,
        flags: 0,
        namespace: h.id,
        key: keys[i],
        layout: h.namespace.layout,
        payload_len: bb,
        checksum: xxhash_rust::xxh3::xxh3_64(&src.as_slice()[offsets[i] as usize..(offsets[i] + bb) as usize]),
    };
    let items = [
        StoreItem { header: header(0), offset: 0 },
        StoreItem { header: header(1), offset: bb + 1 },
        StoreItem { header: header(1), offset: u64::MAX - 10 },
    ];
    assert_eq!(
        near.store_items(id, &items).await.unwrap(),
        vec![ItemStatus::Ok, ItemStatus::OutOfRange, ItemStatus::OutOfRange]
    );
    // Load: outside the buffer, a room smaller than the block, and a good one after them.
    let loads = [
        LoadItem { key: keys[0], offset: 2 * bb - 10, room: bb },
        LoadItem { key: keys[0], offset: 0, room: bb - 1 },
        LoadItem { key: keys[0], offset: bb, room: bb },
    ];
    let got = near.load_items(h.id, id, &loads, false).await.unwrap();
    assert_eq!(got[0], Err(ItemStatus::OutOfRange));
    assert_eq!(got[1], Err(ItemStatus::OutOfRange));
    assert_eq!(got[2].as_ref().map(|fh| fh.key), Ok(keys[0]));
    // The high-level call answers false for a bad offset and still serves the good one.
    let mut dst = SharedBuffer::new(2 * bb as usize).unwrap();
    let landed = near.load_into_buffer(&h, &[keys[0], keys[0]], &mut dst, &[bb + 1, 0], false).await.unwrap();
    assert_eq!(landed, vec![false, true]);
    assert_eq!(&dst.as_slice()[..bb as usize], &payload_for(&keys[0], bb)[..]);
    // An unknown buffer id is a request-level refusal; the connection still serves.
    let e = near.load_items(h.id, kvtier_client::BufferId(999), &loads[2..], false).await.unwrap_err();
    assert!(is_refusal(&e, codes::INVALID_REQUEST, "no buffer 999"), "{e}");
    assert!(near.load_items(h.id, id, &loads[2..], false).await.unwrap()[0].is_ok());
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_and_non_tmpfs_descriptors_are_refused_and_unsealed_ones_are_copied_not_mapped() {
    use rustix::fs::{MemfdFlags, SealFlags};
    let (cluster, client, h) = setup().await;
    let mut near = client.samenode().await.unwrap();

    // An unsealed memfd, or one sealed against growing only, can shrink: accepted as a file the
    // server copies with pread/pwrite (never mapped: see the truncation tests below).
    let unsealed = rustix::fs::memfd_create("t", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&unsealed, 1 << 20).unwrap();
    near.register_fd(unsealed.as_fd(), 1 << 20).await.expect("an unsealed memfd is a tmpfs file");
    rustix::fs::fcntl_add_seals(&unsealed, SealFlags::GROW).unwrap();
    near.register_fd(unsealed.as_fd(), 1 << 20).await.expect("sealed against growing only");
    let e = near.register_fd(unsealed.as_fd(), 2 << 20).await.unwrap_err();
    assert!(is_refusal(&e, codes::INVALID_REQUEST, "smaller than the 2097152 claimed"), "{e}");

    let short = SharedBuffer::new(4096).unwrap();
    let e = near.register_fd(short.fd(), 8192).await.unwrap_err();
    assert!(is_refusal(&e, codes::INVALID_REQUEST, "smaller than the 8192 claimed"), "{e}");

    // A file on disk (the test's temp dir is not tmpfs here; checked so the test means it).
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let on_disk = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(dir.path().join("f"))
        .unwrap();
    on_disk.set_len(4096).unwrap();
    if rustix::fs::fstatfs(&on_disk).unwrap().f_type as i64 != 0x0102_1994 {
        let e = near.register_fd(on_disk.as_fd(), 4096).await.unwrap_err();
        assert!(is_refusal(&e, codes::INVALID_REQUEST, "tmpfs"), "{e}");
    }
    // A /dev/shm file opened read-only, or for appending, is refused.
    let shm = ShmFile::new(4096);
    let read_only = std::fs::File::open(&shm.path).unwrap();
    let e = near.register_fd(read_only.as_fd(), 4096).await.unwrap_err();
    assert!(is_refusal(&e, codes::INVALID_REQUEST, "O_RDWR"), "{e}");
    let appending = std::fs::OpenOptions::new().read(true).append(true).open(&shm.path).unwrap();
    let e = near.register_fd(appending.as_fd(), 4096).await.unwrap_err();
    assert!(is_refusal(&e, codes::INVALID_REQUEST, "O_APPEND"), "{e}");

    // The same connection registers a good buffer and moves blocks after all that.
    let (src, keys, offsets) = filled(&h, 4, 1);
    assert_eq!(near.store_from_buffer(&h, &keys, &src, &offsets).await.unwrap(), vec![ItemStatus::Ok]);
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_buffers_than_the_cap_are_refused_and_they_die_with_the_connection() {
    let (cluster, client, _h) = setup().await;
    let mut near = client.samenode().await.unwrap();
    let bufs: Vec<SharedBuffer> = (0..=MAX_BUFFERS_PER_CONNECTION).map(|_| SharedBuffer::new(4096).unwrap()).collect();
    for b in &bufs[..MAX_BUFFERS_PER_CONNECTION] {
        near.register(b).await.unwrap();
    }
    let e = near.register(&bufs[MAX_BUFFERS_PER_CONNECTION]).await.unwrap_err();
    assert!(is_refusal(&e, codes::CAPACITY, "already has 64 buffers"), "{e}");
    // One unregistered makes room for one more.
    near.unregister(&bufs[0]).await.unwrap();
    near.register(&bufs[MAX_BUFFERS_PER_CONNECTION]).await.unwrap();
    // Each buffer is mapped twice in this process: by its owner and by the in-process server.
    assert_eq!(mappings_of(&bufs), 2 * bufs.len() - 1);
    drop(near);
    let deadline = Instant::now() + Duration::from_secs(5);
    while mappings_of(&bufs) != bufs.len() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(mappings_of(&bufs), bufs.len(), "the server unmapped every buffer of the closed connection");
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_dies_mid_request_costs_nobody_else() {
    let (cluster, client, h) = setup().await;
    let path = cluster.node(0).server.samenode_path.clone().unwrap();
    let (src, keys, offsets) = filled(&h, 5, 2);
    let mut other = client.samenode().await.unwrap();
    assert_eq!(other.store_from_buffer(&h, &keys, &src, &offsets).await.unwrap(), vec![ItemStatus::Ok; 2]);

    // A raw client: hello, then half a LOAD request, then gone.
    for cut in [1usize, 20, 40] {
        let mut s = tokio::net::UnixStream::connect(&path).await.unwrap();
        s.write_all(&encode_hello(b"")).await.unwrap();
        let mut reply = [0u8; 4];
        s.read_exact(&mut reply).await.unwrap();
        assert_eq!(reply[0], 0, "hello accepted");
        let req = SnRequest { op: SnOp::Load, flags: 0, request_id: 1, count: 2, buffer: 1, namespace: h.id };
        let mut msg = req.encode().to_vec();
        LoadItem { key: keys[0], offset: 0, room: 1 }.encode_into(&mut msg);
        s.write_all(&msg[..cut.min(msg.len())]).await.unwrap();
        drop(s);
    }
    // A SameNode dropped while its store is in flight.
    let (src2, keys2, offsets2) = filled(&h, 6, 8);
    let mut doomed = client.samenode().await.unwrap();
    let h2 = h.clone();
    let task = tokio::spawn(async move { doomed.store_from_buffer(&h2, &keys2, &src2, &offsets2).await });
    tokio::time::sleep(Duration::from_millis(1)).await;
    task.abort();
    let _ = task.await;

    // Everyone else is served as before, on old and new connections.
    let mut dst = SharedBuffer::new(src.len()).unwrap();
    assert_eq!(other.load_into_buffer(&h, &keys, &mut dst, &offsets, true).await.unwrap(), vec![true; 2]);
    assert_eq!(dst.as_slice(), src.as_slice());
    let mut fresh = client.samenode().await.unwrap();
    assert_eq!(fresh.load_into_buffer(&h, &keys, &mut dst, &offsets, true).await.unwrap(), vec![true; 2]);
    cluster.stop().await;
}

/// A hello of protocol 1 (before the segmented ops) is still served, but a segmented op on it
/// ends that connection with a message; a version the server doesn't know is refused at hello.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_1_clients_are_served_without_segments_and_unknown_versions_are_refused() {
    let (cluster, client, h) = setup().await;
    let path = cluster.node(0).server.samenode_path.clone().unwrap();
    let hello = |version: u16| {
        let mut v = b"KVSN".to_vec();
        v.extend_from_slice(&version.to_le_bytes());
        v.extend_from_slice(&0u16.to_le_bytes());
        v
    };
    async fn reply(s: &mut tokio::net::UnixStream, head: usize) -> (Vec<u8>, String) {
        let mut fixed = vec![0u8; head];
        s.read_exact(&mut fixed).await.unwrap();
        let mut msg = vec![0u8; u16::from_le_bytes([fixed[2], fixed[3]]) as usize];
        s.read_exact(&mut msg).await.unwrap();
        (fixed, String::from_utf8_lossy(&msg).into_owned())
    }
    let mut future = tokio::net::UnixStream::connect(&path).await.unwrap();
    future.write_all(&hello(9)).await.unwrap();
    let (fixed, msg) = reply(&mut future, 4).await;
    assert_eq!(fixed[0], Status::UnsupportedVersion as u8, "{msg}");
    assert!(msg.contains("protocol 9 is not supported"), "{msg}");

    let mut old = tokio::net::UnixStream::connect(&path).await.unwrap();
    old.write_all(&hello(1)).await.unwrap();
    let (fixed, msg) = reply(&mut old, 4).await;
    assert_eq!(fixed[0], 0, "a protocol-1 hello is accepted: {msg}");
    let (_, keys, _) = filled(&h, 10, 1);
    // An UNREGISTER of nothing: a plain op, answered, the connection going on.
    let req = SnRequest { op: SnOp::Unregister, flags: 0, request_id: 1, count: 0, buffer: 7, namespace: h.id };
    old.write_all(&req.encode()).await.unwrap();
    let (fixed, msg) = reply(&mut old, 16).await;
    assert_eq!(fixed[1], Status::BadRequest as u8, "{msg}");
    assert!(msg.contains("no buffer 7"), "{msg}");
    let req = SnRequest { op: SnOp::LoadSegments, flags: 0, request_id: 2, count: 1, buffer: 1, namespace: h.id };
    let mut msg = req.encode().to_vec();
    LoadItem { key: keys[0], offset: 1, room: 0 }.encode_into(&mut msg);
    Segment { offset: 0, len: h.block_bytes() }.encode_into(&mut msg);
    old.write_all(&msg).await.unwrap();
    let (fixed, msg) = reply(&mut old, 16).await;
    assert_eq!(fixed[1], Status::BadRequest as u8, "{msg}");
    assert!(msg.contains("needs same-node protocol 2"), "{msg}");
    let mut rest = Vec::new();
    assert_eq!(old.read_to_end(&mut rest).await.unwrap(), 0, "the connection ended");

    // The current client is unaffected.
    let mut near = client.samenode().await.unwrap();
    let (src, keys, offsets) = filled(&h, 11, 2);
    assert_eq!(near.store_from_buffer(&h, &keys, &src, &offsets).await.unwrap(), vec![ItemStatus::Ok; 2]);
    cluster.stop().await;
}

/// A load that times out returns only once the server has stopped copying into its buffer (the
/// client closes its end and waits for the server's close, which comes within 1 MiB of copies),
/// so a caller that reuses the buffer at once never has it written behind its back. The node
/// serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_load_has_stopped_writing_the_buffer_when_it_returns() {
    let (cluster, client, _) = setup().await;
    let path = cluster.node(0).server.samenode_path.clone().unwrap();
    // 1 MiB blocks: a few items keep the server copying for tens of milliseconds.
    let layout = kvtier_proto::KvLayout::new(16, 8, 128, kvtier_proto::DType::Fp16, 16);
    let h = client.register(namespace("near-big", b"b", layout)).await.expect("register");
    assert_eq!(h.block_bytes(), 1 << 20);
    let (src, keys, offsets) = filled(&h, 9, 16);
    let mut near = client.samenode().await.unwrap();
    assert_eq!(near.store_from_buffer(&h, &keys, &src, &offsets).await.unwrap(), vec![ItemStatus::Ok; 16]);

    // 256 copies of those blocks (256 MiB, ~0.1 s of copies) asked for with a 40 ms timeout
    // (after the buffer's registration, which maps it populated).
    let bb = h.block_bytes();
    let n = 256usize;
    let many: Vec<BlockKey> = (0..n).map(|i| keys[i % keys.len()]).collect();
    let at: Vec<u64> = (0..n as u64).map(|i| i * bb).collect();
    let mut dst = SharedBuffer::new(n * bb as usize).unwrap();
    // The client on a runtime of its own, as in its own process: its timer fires on time
    // however busy the server's workers are.
    let (h2, path2) = (h.clone(), path.clone());
    let (hasty, err, dst) = tokio::task::spawn_blocking(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let mut hasty = SameNode::connect(&path2, None, Duration::from_secs(5), Duration::from_secs(5), n)
                .await
                .expect("connect");
            hasty.register(&dst).await.expect("register");
            hasty.set_request_timeout(Duration::from_millis(40));
            let err = hasty.load_into_buffer(&h2, &many, &mut dst, &at, false).await.unwrap_err();
            (hasty, err, dst)
        })
    })
    .await
    .unwrap();
    assert!(matches!(err, ClientError::Timeout(_)), "{err}");
    assert!(!hasty.is_usable(), "a timed-out connection is not reused");
    let seen = dst.as_slice().to_vec();
    assert!(seen[..bb as usize].iter().any(|b| *b != 0), "the load had started");
    assert!(seen[(n - 1) * bb as usize..].iter().all(|b| *b == 0), "the load was cut short, not finished");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(dst.as_slice() == seen.as_slice(), "the server wrote into the buffer after the timed-out load returned");
    drop(hasty);

    // Everyone else is served as before.
    let mut back = SharedBuffer::new(src.len()).unwrap();
    assert_eq!(near.load_into_buffer(&h, &keys, &mut back, &offsets, true).await.unwrap(), vec![true; 16]);
    assert_eq!(back.as_slice(), src.as_slice());
    cluster.stop().await;
}

/// A long load does not hold the server's worker: on a node whose runtime has one thread, a
/// second client connects, registers its buffer and loads a block while a 384 MiB load is under
/// way, long before that load ends (before, the worker was yielded every 128 blocks only).
#[tokio::test(flavor = "current_thread")]
async fn a_long_load_leaves_the_worker_to_other_connections() {
    let (cluster, client, _) = setup().await;
    let path = cluster.node(0).server.samenode_path.clone().unwrap();
    let layout = kvtier_proto::KvLayout::new(16, 8, 128, kvtier_proto::DType::Fp16, 16);
    let h = client.register(namespace("near-long", b"l", layout)).await.expect("register");
    let bb = h.block_bytes() as usize;
    assert_eq!(bb, 1 << 20);
    let (src, keys, offsets) = filled(&h, 13, 16);
    let mut near = client.samenode().await.unwrap();
    assert_eq!(near.store_from_buffer(&h, &keys, &src, &offsets).await.unwrap(), vec![ItemStatus::Ok; 16]);

    let n = 384usize;
    let many: Vec<BlockKey> = (0..n).map(|i| keys[i % keys.len()]).collect();
    let at: Vec<u64> = (0..n as u64).map(|i| i * bb as u64).collect();
    // Block i has landed once its last 64 bytes are the block's (copies go front to back); read
    // through the memfd, which shares its pages with the server's mapping.
    let tails: Vec<Vec<u8>> = many.iter().map(|k| payload_for(k, bb as u64)[bb - 64..].to_vec()).collect();
    let mut dst = SharedBuffer::new(n * bb).unwrap();
    let watch = std::fs::File::from(dst.fd().try_clone_to_owned().unwrap());
    let landed = move |i: usize| {
        use std::os::unix::fs::FileExt;
        let mut tail = [0u8; 64];
        watch.read_exact_at(&mut tail, (i * bb + bb - 64) as u64).unwrap();
        tail[..] == tails[i][..]
    };

    // Both clients on threads and runtimes of their own, as in their own processes: the node's
    // one thread is this test's.
    let (h1, p1, many1) = (h.clone(), path.clone(), many.clone());
    let long = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let mut c =
                SameNode::connect(&p1, None, Duration::from_secs(20), Duration::from_secs(60), n).await.unwrap();
            let got = c.load_into_buffer(&h1, &many1, &mut dst, &at, false).await.unwrap();
            (got, dst)
        })
    });
    let (h2, p2, first) = (h.clone(), path.clone(), keys[0]);
    let probe = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !landed(0) {
            assert!(Instant::now() < deadline, "the long load never started");
            std::thread::sleep(Duration::from_micros(200));
        }
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let (got, buf) = rt.block_on(async move {
            let mut c =
                SameNode::connect(&p2, None, Duration::from_secs(20), Duration::from_secs(60), 1).await.unwrap();
            let mut buf = SharedBuffer::new(bb).unwrap();
            let got = c.load_into_buffer(&h2, &[first], &mut buf, &[0], false).await.unwrap();
            (got, buf)
        });
        let done = (0..n).filter(|&i| landed(i)).count();
        (got, buf.as_slice().to_vec(), done)
    });
    let ((probed, probe_bytes, done_then), (long_got, dst)) =
        tokio::task::spawn_blocking(move || (probe.join().unwrap(), long.join().unwrap())).await.unwrap();

    assert_eq!(probed, vec![true]);
    assert_eq!(probe_bytes, src.as_slice()[..bb]);
    assert!(done_then < n / 2, "the second client waited for {done_then} of the long load's {n} blocks");
    assert_eq!(long_got, vec![true; n]);
    for (i, k) in many.iter().enumerate() {
        assert!(dst.as_slice()[i * bb..(i + 1) * bb] == payload_for(k, bb as u64)[..], "block {i}");
    }
    cluster.stop().await;
}

/// Bytes the client changes after it computed the checksum never become a stored block: the
/// server verifies its own copy. A writer racing the copies can't produce a stored block that
/// fails its checksum either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_changed_under_a_store_never_make_a_bad_block() {
    let (cluster, client, h) = setup().await;
    let mut near = client.samenode().await.unwrap();
    let bb = h.block_bytes();
    let (mut src, keys, _) = filled(&h, 7, 1);
    let id = near.register(&src).await.unwrap();
    let header = FrameHeader {
        codec: CodecId::RAW,
        tokens: h.namespace.layout.block_tokens,
        flags: 0,
        namespace: h.id,
        key: keys[0],
        layout: h.namespace.layout,
        payload_len: bb,
        checksum: xxhash_rust::xxh3::xxh3_64(src.as_slice()),
    };
    src.as_mut_slice()[1000] ^= 0x40;
    assert_eq!(
        near.store_items(id, &[StoreItem { header, offset: 0 }]).await.unwrap(),
        vec![ItemStatus::ChecksumMismatch]
    );
    assert_eq!(client.exists_keys(&h, &keys).await.unwrap(), vec![false], "nothing of it was kept");
    src.as_mut_slice()[1000] ^= 0x40;
    assert_eq!(near.store_items(id, &[StoreItem { header, offset: 0 }]).await.unwrap(), vec![ItemStatus::Ok]);

    // A second mapping of the buffer, written by a thread while blocks are stored from it.
    let (src, keys, offsets) = filled(&h, 8, 16);
    // SAFETY: a second view of this test's own memfd; only the racing thread writes through it,
    // and the test reads the buffer only through the server's answers.
    let mut racer = unsafe { memmap2::MmapOptions::new().len(src.len()).map_mut(&src.fd()) }.unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s2 = stop.clone();
    let writer = std::thread::spawn(move || {
        let mut i = 0usize;
        while !s2.load(std::sync::atomic::Ordering::Relaxed) {
            let n = racer.len();
            racer[(i * 4099) % n] ^= 1;
            i += 1;
        }
    });
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.extend(near.store_from_buffer(&h, &keys, &src, &offsets).await.unwrap());
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.join().unwrap();
    assert!(statuses.iter().all(|s| matches!(s, ItemStatus::Ok | ItemStatus::Present | ItemStatus::ChecksumMismatch)));
    // Whatever was stored loads back whole: its bytes hash to its header's checksum.
    let dst = SharedBuffer::new(src.len()).unwrap();
    let dst_id = near.register(&dst).await.unwrap();
    let items: Vec<LoadItem> =
        keys.iter().zip(&offsets).map(|(k, o)| LoadItem { key: *k, offset: *o, room: bb }).collect();
    let got = near.load_items(h.id, dst_id, &items, false).await.unwrap();
    for (i, (r, o)) in got.iter().zip(&offsets).enumerate() {
        let held = statuses.iter().skip(i).step_by(keys.len()).any(|s| s.is_held());
        assert_eq!(r.is_ok(), held, "block {i}: loadable exactly when a store of it was acknowledged");
        if let Ok(fh) = r {
            let bytes = &dst.as_slice()[*o as usize..(*o + bb) as usize];
            assert_eq!(xxhash_rust::xxh3::xxh3_64(bytes), fh.checksum, "a stored block matches its checksum");
        }
    }
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_a_socket_says_so() {
    let cluster = Cluster::start_with(1, Transport::Duplex, |_, c| c.samenode_socket = "off".into()).await;
    let client = cluster.link(0).await.client;
    assert!(cluster.node(0).server.samenode_path.is_none());
    assert_eq!(client.server_info().samenode_socket, "");
    match client.samenode().await {
        Err(ClientError::NotSameNode(why)) => assert!(why.contains("no same-node socket"), "{why}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a node without a socket opened a same-node connection"),
    }
    cluster.stop().await;
}

/// A socket that can't be reached on the server's own host (gone with a stopped server) is said
/// to be that, not "not on the server's host" (the host is checked first, and is the server's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_same_node_socket_gone_on_the_servers_host_says_the_server_may_be_stopped() {
    let cluster = Cluster::start_with(1, Transport::Duplex, |_, _| {}).await;
    let client = cluster.link(0).await.client;
    let path = cluster.node(0).server.samenode_path.clone().expect("a same-node socket");
    std::fs::remove_file(&path).unwrap();
    match client.samenode().await {
        Err(e @ ClientError::NotSameNode(_)) => {
            let why = e.to_string();
            assert!(why.starts_with("same-node path unavailable: cannot reach the same-node socket"), "{why}");
            assert!(why.contains("the server runs on this host: is it stopped or restarting?"), "{why}");
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a same-node connection through a removed socket"),
    }
    cluster.stop().await;
}

/// `RssShmem` of this process in bytes: shared memory it has pages of (the in-process server's
/// mappings of client buffers included).
fn rss_shmem() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("RssShmem:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sparse_buffer_does_not_make_the_server_allocate_its_pages() {
    use rustix::fs::{MemfdFlags, SealFlags};
    let (cluster, client, h) = setup().await;
    let mut near = client.samenode().await.unwrap();
    // 2 GiB claimed, not one page touched: registering it must not fill it (the server used to
    // map it populated, which allocated, and charged to the server, every page).
    let sparse = rustix::fs::memfd_create("sparse", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&sparse, 2 << 30).unwrap();
    rustix::fs::fcntl_add_seals(&sparse, SealFlags::SHRINK).unwrap();
    let before = rss_shmem();
    near.register_fd(sparse.as_fd(), 2 << 30).await.unwrap();
    let grown = rss_shmem().saturating_sub(before);
    assert!(grown < 256 << 20, "registering a sparse 2 GiB buffer made this process hold {grown} more bytes");
    // A touched buffer still loads, and the connection serves as before.
    let (src, keys, offsets) = filled(&h, 9, 2);
    assert_eq!(near.store_from_buffer(&h, &keys, &src, &offsets).await.unwrap(), vec![ItemStatus::Ok; 2]);
    let mut dst = SharedBuffer::new(src.len()).unwrap();
    assert_eq!(near.load_into_buffer(&h, &keys, &mut dst, &offsets, false).await.unwrap(), vec![true; 2]);
    assert_eq!(dst.as_slice(), src.as_slice());
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_wide_cap_on_registered_bytes_holds_across_connections() {
    let cluster = Cluster::start_with(1, Transport::Duplex, |_, c| {
        c.samenode_max_registered_bytes = kvtier_server::config::ByteSize(1 << 20);
    })
    .await;
    let first = cluster.link(0).await.client;
    let second = cluster.link(0).await.client;
    let mut near1 = first.samenode().await.unwrap();
    let mut near2 = second.samenode().await.unwrap();
    let big = SharedBuffer::new(768 << 10).unwrap();
    let other = SharedBuffer::new(512 << 10).unwrap();
    near1.register(&big).await.unwrap();
    // Together they'd pass 1 MiB: refused before anything is mapped, the first connection's
    // buffer untouched.
    let e = near2.register(&other).await.unwrap_err();
    assert!(is_refusal(&e, codes::CAPACITY, "samenode_max_registered_bytes"), "{e}");
    assert_eq!(mappings_of(std::slice::from_ref(&other)), 1, "a refused buffer was mapped by the server");
    // A /dev/shm file is not mapped by the server, so it holds none of the cap: 4 MiB of one
    // registers beside the full budget.
    let shm = ShmFile::new(4 << 20);
    near2.register_fd(shm.file.as_fd(), 4 << 20).await.expect("a file costs the server no mapping");
    assert_eq!(mappings_of(std::slice::from_ref(&other)), 1);
    // The first connection gone, its bytes return to the node and the second registers.
    drop(near1);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match near2.register(&other).await {
            Ok(_) => break,
            Err(e) if Instant::now() < deadline && is_refusal(&e, codes::CAPACITY, "samenode") => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            Err(e) => panic!("the closed connection's bytes were not given back: {e}"),
        }
    }
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_buffer_on_many_connections_is_mapped_once_and_counts_once_against_the_cap() {
    // A client registers a buffer on every pooled connection that serves it. Each connection
    // used to map it again (populating it again), and count it again against the node's cap:
    // here, three registrations of 768 KiB under a 1 MiB cap.
    let cluster = Cluster::start_with(1, Transport::Duplex, |_, c| {
        c.samenode_max_registered_bytes = kvtier_server::config::ByteSize(1 << 20);
    })
    .await;
    let client = cluster.link(0).await.client;
    let h = client.register(namespace("near", b"n", small_layout())).await.expect("register");
    let bb = h.block_bytes() as usize;
    let (src, keys, offsets) = filled(&h, 21, 2);
    let mut dst = SharedBuffer::new((768 << 10).max(2 * bb)).unwrap();
    let mut conns = Vec::new();
    for _ in 0..3 {
        let mut near = client.samenode().await.unwrap();
        near.register(&dst).await.expect("the same buffer again: already mapped, nothing more to charge");
        conns.push(near);
    }
    assert_eq!(mappings_of(std::slice::from_ref(&dst)), 2, "the client's mapping and the server's one");
    // Every connection loads into it through the one mapping.
    assert_eq!(conns[0].store_from_buffer(&h, &keys, &src, &offsets).await.unwrap(), vec![ItemStatus::Ok; 2]);
    for near in &mut conns {
        dst.as_mut_slice().fill(0);
        assert_eq!(near.load_into_buffer(&h, &keys, &mut dst, &offsets, false).await.unwrap(), vec![true; 2]);
        assert_eq!(&dst.as_slice()[..2 * bb], &src.as_slice()[..2 * bb]);
    }
    // Two connections let go (one unregisters, one closes): the third still loads through it.
    conns[0].unregister(&dst).await.unwrap();
    drop(conns.remove(1));
    dst.as_mut_slice().fill(0);
    assert_eq!(conns[1].load_into_buffer(&h, &keys, &mut dst, &offsets, false).await.unwrap(), vec![true; 2]);
    assert_eq!(&dst.as_slice()[..2 * bb], &src.as_slice()[..2 * bb]);
    // Another buffer doesn't fit beside it; once the last connection lets go, it does.
    let other = SharedBuffer::new(512 << 10).unwrap();
    let e = conns[0].register(&other).await.unwrap_err();
    assert!(is_refusal(&e, codes::CAPACITY, "samenode_max_registered_bytes"), "{e}");
    conns[1].unregister(&dst).await.unwrap();
    assert_eq!(mappings_of(std::slice::from_ref(&dst)), 1, "the server still maps an unregistered buffer");
    conns[0].register(&other).await.expect("the unmapped buffer's bytes came back to the node");
    cluster.stop().await;
}

/// A file under `/dev/shm` (tmpfs), as vLLM makes its CPU tier's region, removed on drop.
struct ShmFile {
    path: std::path::PathBuf,
    file: std::fs::File,
}

impl ShmFile {
    fn new(len: u64) -> Self {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::path::PathBuf::from(format!("/dev/shm/kvtier_test_{}_{n}.mmap", std::process::id()));
        let file = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path).unwrap();
        file.set_len(len).unwrap();
        ShmFile { path, file }
    }

    fn reopen(&self) -> std::fs::File {
        std::fs::OpenOptions::new().read(true).write(true).open(&self.path).unwrap()
    }
}

impl Drop for ShmFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Raw store items for `keys`' payloads at `offsets` of a buffer (checksums of the payloads the
/// test wrote there), so a test can store from a file without this process touching a mapping.
fn store_items(h: &NamespaceHandle, keys: &[BlockKey], offsets: &[u64]) -> Vec<StoreItem> {
    let bb = h.block_bytes();
    keys.iter()
        .zip(offsets)
        .map(|(k, o)| StoreItem {
            header: FrameHeader {
                codec: CodecId::RAW,
                tokens: h.block_tokens() as u32,
                flags: 0,
                namespace: h.id,
                key: *k,
                layout: h.namespace.layout,
                payload_len: bb,
                checksum: kvtier_proto::checksum(&payload_for(k, bb)),
            },
            offset: *o,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dev_shm_region_stores_and_loads_byte_exact_at_offsets_over_the_socket() {
    use std::os::unix::fs::FileExt;
    let (cluster, client, h) = setup().await;
    let bb = h.block_bytes();
    let shm = ShmFile::new(16 * bb + 8192);
    // The engine's rows: 4 blocks written at odd offsets of the file by "the engine" (pwrite,
    // another handle of the file).
    let keys = h.keys(&tokens(21, 4 * h.block_tokens()));
    let base = 4096 + 100; // the region starts inside the file, not page-aligned
    let rows: Vec<u64> = (0..4u64).map(|i| (3 - i) * bb + 7).collect();
    for (k, r) in keys.iter().zip(&rows) {
        shm.file.write_all_at(&payload_for(k, bb), base + r).unwrap();
    }
    let mut region = SharedBuffer::from_file(shm.reopen(), base, (8 * bb) as usize).unwrap();
    assert!(region.is_file_region());
    let st = client.store_keys_from_buffer(&h, &keys, &region, &rows).await.unwrap();
    assert_eq!(st, vec![ItemStatus::Ok; 4]);
    let stats = client.samenode_stats();
    assert_eq!((stats.stores, stats.fallback_total()), (1, 0), "{stats:?}");

    // Loaded back into other rows of the same region: the bytes land in the file.
    let back: Vec<u64> = (0..4u64).map(|i| 4 * bb + i * bb).collect();
    assert_eq!(client.load_keys_into_buffer(&h, &keys, &mut region, &back, false).await.unwrap(), vec![true; 4]);
    assert_eq!(client.samenode_stats().loads, 1);
    for (k, o) in keys.iter().zip(&back) {
        let mut got = vec![0u8; bb as usize];
        shm.file.read_exact_at(&mut got, base + o).unwrap();
        assert_eq!(got, payload_for(k, bb), "read through another handle of the file");
        assert_eq!(&region.as_slice()[*o as usize..(*o + bb) as usize], &got[..], "and through the mapping");
    }
    // Nothing was written outside the rows asked for, and the file did not grow.
    let mut before = vec![0u8; base as usize];
    shm.file.read_exact_at(&mut before, 0).unwrap();
    assert!(before.iter().all(|b| *b == 0));
    assert_eq!(shm.file.metadata().unwrap().len(), 16 * bb + 8192);
    // An offset past the region is refused by the client, before anything moves.
    let past = [8 * bb];
    assert!(client.load_keys_into_buffer(&h, &keys[..1], &mut region, &past, false).await.is_err());
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_truncated_by_its_client_is_a_clear_error_and_the_server_goes_on() {
    let (cluster, client, h) = setup().await;
    let bb = h.block_bytes();
    let shm = ShmFile::new(8 * bb);
    let keys = h.keys(&tokens(22, 4 * h.block_tokens()));
    let offsets: Vec<u64> = (0..4u64).map(|i| i * bb).collect();
    {
        use std::os::unix::fs::FileExt;
        for (k, o) in keys.iter().zip(&offsets) {
            shm.file.write_all_at(&payload_for(k, bb), *o).unwrap();
        }
    }
    let mut near = client.samenode().await.unwrap();
    let id = near.register_fd(shm.file.as_fd(), 8 * bb).await.unwrap();
    assert_eq!(near.store_items(id, &store_items(&h, &keys, &offsets)).await.unwrap(), vec![ItemStatus::Ok; 4]);

    // Truncated under the registration: loads and stores are refused with a message saying so,
    // and the file is not grown back.
    shm.file.set_len(bb).unwrap();
    let items: Vec<LoadItem> =
        keys.iter().enumerate().map(|(i, k)| LoadItem { key: *k, offset: (4 + i as u64) * bb, room: bb }).collect();
    let e = near.load_items(h.id, id, &items, false).await.unwrap_err();
    assert!(is_refusal(&e, codes::INVALID_REQUEST, "truncated"), "{e}");
    let e = near.store_items(id, &store_items(&h, &keys, &offsets)).await.unwrap_err();
    assert!(is_refusal(&e, codes::INVALID_REQUEST, "truncated"), "{e}");
    assert_eq!(shm.file.metadata().unwrap().len(), bb, "the server never extends the file");
    // The client side refuses a truncated region before touching its mapping.
    let mut region = SharedBuffer::from_file(shm.reopen(), 0, bb as usize).unwrap();
    shm.file.set_len(bb / 2).unwrap();
    let e = client.load_keys_into_buffer(&h, &keys[..1], &mut region, &[0], false).await.unwrap_err();
    assert!(e.to_string().contains("truncated"), "{e}");

    // Truncated and restored over and over while loads and stores run: every answer is an
    // answer (the server, in this process, would die of SIGBUS had it mapped the file).
    shm.file.set_len(8 * bb).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let racer = {
        let (stop, f) = (stop.clone(), shm.reopen());
        std::thread::spawn(move || {
            let mut flips = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                f.set_len(bb / 3).unwrap();
                std::thread::yield_now();
                f.set_len(8 * bb).unwrap();
                flips += 1;
            }
            flips
        })
    };
    let (mut answered, mut refused) = (0, 0);
    let deadline = Instant::now() + Duration::from_millis(1500);
    while Instant::now() < deadline {
        for r in [
            near.load_items(h.id, id, &items, false).await.map(|v| v.len()),
            near.store_items(id, &store_items(&h, &keys, &offsets)).await.map(|v| v.len()),
        ] {
            match r {
                Ok(n) => {
                    assert_eq!(n, 4);
                    answered += 1;
                }
                Err(e) => {
                    assert!(is_refusal(&e, codes::INVALID_REQUEST, "truncated"), "{e}");
                    refused += 1;
                }
            }
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let flips = racer.join().unwrap();
    assert!(flips > 10 && answered + refused > 10, "{flips} truncations, {answered} answers, {refused} refusals");
    assert!(near.is_usable());
    assert!(shm.file.metadata().unwrap().len() <= 8 * bb, "never grown past the registered length");

    // Other clients were served all along, and are still.
    let other = cluster.link(0).await.client;
    let (src, k2, o2) = filled(&h, 23, 2);
    assert_eq!(other.store_keys_from_buffer(&h, &k2, &src, &o2).await.unwrap(), vec![ItemStatus::Ok; 2]);
    assert_eq!(other.samenode_stats().stores, 1);
    cluster.stop().await;
}

/// Block `i` of `n` as an engine page split in K and V halves (SGLang's host pool): its first half
/// in the first half of a buffer of `n` blocks, its second half `v_offset` further on.
fn kv_halves(bb: u64, n: usize, shift: u64) -> Vec<Vec<Segment>> {
    let half = bb / 2;
    let v_offset = n as u64 * half;
    (0..n as u64)
        .map(|i| {
            let k = shift + i * half;
            vec![Segment { offset: k, len: half }, Segment { offset: k + v_offset, len: bb - half }]
        })
        .collect()
}

/// Blocks in several pieces each (an engine page's K and V halves) are stored from their pieces
/// and loaded into pieces laid out differently, byte-exact, over the socket and over TCP when the
/// path is off; pieces outside the buffer or not making one block are refused per item, and a
/// request naming too many segments ends only its own connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_in_segments_store_and_load_byte_exact_and_bad_segments_are_refused() {
    let (cluster, client, h) = setup().await;
    let bb = h.block_bytes();
    let n = 4;
    let keys = h.keys(&tokens(21, n * h.block_tokens()));
    let mut src = SharedBuffer::new(n * bb as usize + 64).unwrap();
    let src_segs = kv_halves(bb, n, 64);
    for (k, segs) in keys.iter().zip(&src_segs) {
        let p = payload_for(k, bb);
        let (a, b) = (segs[0], segs[1]);
        src.as_mut_slice()[a.offset as usize..(a.offset + a.len) as usize].copy_from_slice(&p[..a.len as usize]);
        src.as_mut_slice()[b.offset as usize..(b.offset + b.len) as usize].copy_from_slice(&p[a.len as usize..]);
    }
    let mut near = client.samenode().await.unwrap();
    assert_eq!(near.store_from_buffer_segments(&h, &keys, &src, &src_segs).await.unwrap(), vec![ItemStatus::Ok; n]);
    assert_eq!(
        near.store_from_buffer_segments(&h, &keys, &src, &src_segs).await.unwrap(),
        vec![ItemStatus::Present; n]
    );
    // The data plane sees the blocks whole.
    let whole = client.load_keys(&h, &keys).await.unwrap();
    assert_eq!(whole.len(), n);
    for (k, b) in keys.iter().zip(&whole) {
        assert_eq!(&b.as_ref().expect("held").payload[..], &payload_for(k, bb)[..]);
    }

    // Loaded into three pieces each, in another order, through the connection and through the
    // client's automatic path.
    let third = bb / 3;
    let dst_segs: Vec<Vec<Segment>> = (0..n as u64)
        .map(|i| {
            let at = (n as u64 - 1 - i) * bb;
            vec![
                Segment { offset: at + bb - third, len: third },
                Segment { offset: at, len: third },
                Segment { offset: at + third, len: bb - 2 * third },
            ]
        })
        .collect();
    let gather = |buf: &SharedBuffer, segs: &[Segment]| -> Vec<u8> {
        segs.iter().flat_map(|s| buf.as_slice()[s.offset as usize..(s.offset + s.len) as usize].to_vec()).collect()
    };
    let mut dst = SharedBuffer::new(n * bb as usize).unwrap();
    assert_eq!(near.load_into_buffer_segments(&h, &keys, &mut dst, &dst_segs, false).await.unwrap(), vec![true; n]);
    for (k, segs) in keys.iter().zip(&dst_segs) {
        assert_eq!(gather(&dst, segs), payload_for(k, bb));
    }
    let mut auto = SharedBuffer::new(n * bb as usize).unwrap();
    let served = client.samenode_stats().loads;
    assert_eq!(
        client.load_keys_into_buffer_segments(&h, &keys, &mut auto, &dst_segs, true).await.unwrap(),
        vec![true; n]
    );
    assert_eq!(client.samenode_stats().loads, served + 1, "the automatic path took the socket");
    assert_eq!(auto.as_slice(), dst.as_slice());

    // Over TCP (the path off), into the same pieces: the same bytes.
    let cfg = kvtier_client::ClientConfig { samenode: kvtier_client::SameNodeMode::Off, ..client_config() };
    let tcp = cluster.link_with(0, cfg).await.client;
    let th = tcp.register(namespace("near", b"n", small_layout())).await.unwrap();
    let mut over_tcp = SharedBuffer::new(n * bb as usize).unwrap();
    assert_eq!(
        tcp.load_keys_into_buffer_segments(&th, &keys, &mut over_tcp, &dst_segs, true).await.unwrap(),
        vec![true; n]
    );
    assert_eq!(over_tcp.as_slice(), dst.as_slice());
    let moved = tcp.store_keys_from_buffer_segments(&th, &keys, &src, &src_segs).await.unwrap();
    assert!(moved.iter().all(|s| s.is_held()), "{moved:?}");

    // Bad pieces, per item: one past the buffer's end, pieces smaller than the block; the good
    // item after them lands.
    let len = dst.len() as u64;
    let bad = vec![
        vec![Segment { offset: 0, len: bb / 2 }, Segment { offset: len - bb / 2 + 1, len: bb / 2 }],
        vec![Segment { offset: 0, len: bb - 1 }],
        dst_segs[0].clone(),
    ];
    let id = near.register(&dst).await.unwrap();
    let got = near.load_segment_items(h.id, id, &[keys[0]; 3], &bad, false).await.unwrap();
    assert_eq!(got[0], Err(ItemStatus::OutOfRange));
    assert_eq!(got[1], Err(ItemStatus::OutOfRange));
    assert_eq!(got[2].as_ref().map(|fh| fh.key), Ok(keys[0]));
    // A store whose pieces don't make its block: refused, nothing stored.
    let other = h.keys(&tokens(22, h.block_tokens()));
    let short = vec![vec![Segment { offset: 64, len: bb - 1 }]];
    assert_eq!(
        near.store_from_buffer_segments(&h, &other, &src, &short).await.unwrap(),
        vec![ItemStatus::SizeMismatch]
    );
    let mut one = SharedBuffer::new(bb as usize).unwrap();
    assert_eq!(near.load_into_buffer(&h, &other, &mut one, &[0], false).await.unwrap(), vec![false]);
    // The client refuses a block of no piece before sending anything.
    assert!(matches!(
        near.load_into_buffer_segments(&h, &keys[..1], &mut dst, &[vec![]], false).await,
        Err(ClientError::InvalidArgument(_))
    ));

    // A raw request naming more segments than allowed ends its connection with a clear answer.
    let path = cluster.node(0).server.samenode_path.clone().unwrap();
    let mut s = tokio::net::UnixStream::connect(&path).await.unwrap();
    s.write_all(&encode_hello(b"")).await.unwrap();
    let mut reply = [0u8; 4];
    s.read_exact(&mut reply).await.unwrap();
    assert_eq!(reply[0], 0, "hello accepted");
    let mut rest = vec![0u8; u16::from_le_bytes([reply[2], reply[3]]) as usize];
    s.read_exact(&mut rest).await.unwrap();
    let req = SnRequest { op: SnOp::LoadSegments, flags: 0, request_id: 1, count: 1, buffer: 1, namespace: h.id };
    let mut msg = req.encode().to_vec();
    LoadItem { key: keys[0], offset: 1 << 20, room: 0 }.encode_into(&mut msg);
    s.write_all(&msg).await.unwrap();
    let mut answer = Vec::new();
    s.read_to_end(&mut answer).await.unwrap();
    let text = String::from_utf8_lossy(&answer);
    assert!(text.contains("segments"), "{text}");
    // Everyone else is served as before.
    assert_eq!(near.load_into_buffer_segments(&h, &keys, &mut dst, &dst_segs, true).await.unwrap(), vec![true; n]);
    cluster.stop().await;
}

/// Stores whose checksums follow the request (protocol 3, what the client sends by default: it
/// hashes its blocks while the server copies them): an item whose checksum doesn't match the
/// server's copy is `ChecksumMismatch` and not stored, the others are; the connection goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checksums_after_a_store_publish_only_the_items_they_match() {
    let (cluster, client, h) = setup().await;
    let mut near = client.samenode().await.unwrap();
    assert_eq!(near.protocol_version(), kvtier_proto::samenode::PROTOCOL_VERSION);
    let bb = h.block_bytes();
    let (src, keys, offsets) = filled(&h, 30, 3);
    let id = near.register(&src).await.unwrap();
    // Their header checksums are right, and ignored: only the checksums after the request count.
    let items = store_items(&h, &keys, &offsets);
    let sum = |i: usize| xxhash_rust::xxh3::xxh3_64(&payload_for(&keys[i], bb));
    let sums = [sum(0), sum(1) ^ 1, sum(2)];
    let st = near.store_items_checksums_after(id, &items, &sums).await.unwrap();
    assert_eq!(st, vec![ItemStatus::Ok, ItemStatus::ChecksumMismatch, ItemStatus::Ok]);
    assert_eq!(client.exists_keys(&h, &keys).await.unwrap(), vec![true, false, true]);
    let got = client.load_keys(&h, &[keys[0], keys[2]]).await.unwrap();
    assert_eq!(got[0].as_ref().map(|f| f.payload.clone()), Some(payload_for(&keys[0], bb)));
    assert_eq!(got[1].as_ref().map(|f| f.payload.clone()), Some(payload_for(&keys[2], bb)));
    assert!(near.store_items_checksums_after(id, &items, &sums[..2]).await.is_err(), "a checksum per item");

    // The usual call sends its checksums after the request too, and the refused block gets in.
    assert_eq!(
        near.store_from_buffer(&h, &keys, &src, &offsets).await.unwrap(),
        vec![ItemStatus::Present, ItemStatus::Ok, ItemStatus::Present]
    );
    assert_eq!(client.exists_keys(&h, &keys).await.unwrap(), vec![true; 3]);
    cluster.stop().await;
}

/// A raw protocol-3 client that sends a store with checksums to follow and leaves before they
/// do: nothing it sent is stored, and the node serves on. The flag on a load, or on a connection
/// whose hello said protocol 2, ends that connection with a message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_whose_checksums_never_come_stores_nothing() {
    use kvtier_proto::samenode::{FLAG_CHECKSUMS_AFTER, PROTOCOL_VERSION};
    let (cluster, client, h) = setup().await;
    let path = cluster.node(0).server.samenode_path.clone().unwrap();
    let bb = h.block_bytes();
    let (src, keys, offsets) = filled(&h, 31, 2);
    async fn open(path: &std::path::Path, version: u16) -> tokio::net::UnixStream {
        let mut s = tokio::net::UnixStream::connect(path).await.unwrap();
        s.write_all(&kvtier_proto::samenode::encode_hello_version(version, b"")).await.unwrap();
        let mut r = [0u8; 4];
        s.read_exact(&mut r).await.unwrap();
        let mut msg = vec![0u8; u16::from_le_bytes([r[2], r[3]]) as usize];
        s.read_exact(&mut msg).await.unwrap();
        assert_eq!(r[0], 0, "hello of protocol {version} accepted: {}", String::from_utf8_lossy(&msg));
        s
    }
    async fn answer(s: &mut tokio::net::UnixStream) -> (Vec<u8>, String) {
        let mut fixed = vec![0u8; 16];
        s.read_exact(&mut fixed).await.unwrap();
        let mut msg = vec![0u8; u16::from_le_bytes([fixed[2], fixed[3]]) as usize];
        s.read_exact(&mut msg).await.unwrap();
        (fixed, String::from_utf8_lossy(&msg).into_owned())
    }
    let store_req = |buffer: u32| {
        let req = SnRequest {
            op: SnOp::Store,
            flags: FLAG_CHECKSUMS_AFTER,
            request_id: 2,
            count: 2,
            buffer,
            namespace: h.id,
        };
        let mut msg = req.encode().to_vec();
        // Right header checksums, ignored under the flag: only the checksums after it count.
        for item in store_items(&h, &keys, &offsets) {
            item.encode_into(&mut msg);
        }
        msg
    };

    // Register the buffer by hand (the descriptor rides on the request's first byte).
    let mut raw = open(&path, PROTOCOL_VERSION).await;
    {
        use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
        let req = SnRequest { op: SnOp::Register, flags: 0, request_id: 1, count: 0, buffer: 0, namespace: h.id };
        let mut msg = req.encode().to_vec();
        msg.extend_from_slice(&(src.len() as u64).to_le_bytes());
        let fds = [src.fd()];
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut anc = SendAncillaryBuffer::new(&mut space);
        assert!(anc.push(SendAncillaryMessage::ScmRights(&fds)));
        let n =
            rustix::net::sendmsg(raw.as_fd(), &[std::io::IoSlice::new(&msg)], &mut anc, SendFlags::NOSIGNAL).unwrap();
        raw.write_all(&msg[n..]).await.unwrap();
    }
    let (fixed, msg) = answer(&mut raw).await;
    assert_eq!(fixed[1], 0, "registered: {msg}");
    let buffer = u32::from_le_bytes(fixed[8..12].try_into().unwrap());
    // The store, then gone before its checksums.
    raw.write_all(&store_req(buffer)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(raw);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(client.exists_keys(&h, &keys).await.unwrap(), vec![false; 2], "nothing unverified was stored");

    // The flag where it means nothing, or on protocol 2: the connection ends, saying why.
    let mut load = open(&path, PROTOCOL_VERSION).await;
    let req =
        SnRequest { op: SnOp::Load, flags: FLAG_CHECKSUMS_AFTER, request_id: 1, count: 0, buffer: 1, namespace: h.id };
    load.write_all(&req.encode()).await.unwrap();
    let (fixed, msg) = answer(&mut load).await;
    assert_eq!(fixed[1], Status::BadRequest as u8, "{msg}");
    assert!(msg.contains("checksums after"), "{msg}");
    let mut old = open(&path, 2).await;
    old.write_all(&store_req(1)).await.unwrap();
    let (fixed, msg) = answer(&mut old).await;
    assert_eq!(fixed[1], Status::BadRequest as u8, "{msg}");
    assert!(msg.contains("protocol 3"), "{msg}");
    let mut rest = Vec::new();
    assert_eq!(old.read_to_end(&mut rest).await.unwrap(), 0, "the connection ended");

    // The node serves on: the same blocks stored whole by the usual client.
    let mut near = client.samenode().await.unwrap();
    assert_eq!(near.store_from_buffer(&h, &keys, &src, &offsets).await.unwrap(), vec![ItemStatus::Ok; 2]);
    let got = client.load_keys(&h, &keys).await.unwrap();
    for (f, k) in got.iter().zip(&keys) {
        assert_eq!(f.as_ref().map(|f| f.payload.clone()), Some(payload_for(k, bb)));
    }
    cluster.stop().await;
}

/// A node stopped (SIGSTOP: frozen, swapping) past a load's deadline, then continued, writes
/// nothing into the buffer the call returned from: the request it reads after waking finds its
/// client gone before the first copy. Before, the buffered request ran on waking and overwrote
/// memory an engine had reused since (its job reported failed): silently wrong KV.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_the_client_gave_up_on_while_the_node_was_stopped_writes_nothing() {
    let server = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    let client = server.client().await;
    let h = client.register(namespace("frozen", b"f", small_layout())).await.unwrap();
    let (src, keys, offsets) = filled(&h, 21, 4);
    let path = server.dir.join("kvtier.sock");
    let mut near = SameNode::connect(&path, None, Duration::from_secs(5), Duration::from_secs(5), 4).await.unwrap();
    near.register(&src).await.unwrap();
    assert_eq!(near.store_from_buffer(&h, &keys, &src, &offsets).await.unwrap(), vec![ItemStatus::Ok; 4]);

    let mut dst = SharedBuffer::new(src.len()).unwrap();
    near.register(&dst).await.unwrap();
    near.set_request_timeout(Duration::from_millis(300));
    stop_process(server.child.id());
    let err = near.load_into_buffer(&h, &keys, &mut dst, &offsets, false).await.unwrap_err();
    assert!(matches!(err, ClientError::Timeout(_)), "{err}");
    // The engine reuses its rows for something else, then the node wakes up.
    dst.as_mut_slice().fill(0x5A);
    continue_process(server.child.id());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(dst.as_slice().iter().all(|&b| b == 0x5A), "the woken node wrote into memory the call had given back");
    // It serves on.
    assert_eq!(client.load(&h, &tokens(21, 4 * h.block_tokens())).await.unwrap().len(), 4);
}

/// A same-node store larger than the server's lease budget (half its DRAM tier) in one call is
/// stored whole: with checksums sent after the request, the client bounds each request's bytes,
/// since the server holds every item uncommitted until they arrive. Before, the items past the
/// budget were refused as `Capacity` ("full of pinned blocks", with nothing pinned).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_larger_than_the_lease_budget_is_stored_whole() {
    let cluster = Cluster::start_with(1, Transport::Duplex, |_, c| {
        c.dram_capacity = kvtier_server::config::ByteSize(32 << 20);
    })
    .await;
    let client = cluster.link(0).await.client;
    let h = client.register(namespace("near", b"big", small_layout())).await.unwrap();
    let mut near = client.samenode().await.unwrap();
    // 768 blocks of 32 KiB: 24 MiB, over the 16 MiB lease budget, under the tier.
    let (src, keys, offsets) = filled(&h, 7, 768);
    let st = near.store_from_buffer(&h, &keys, &src, &offsets).await.unwrap();
    let refused: Vec<usize> = (0..st.len()).filter(|&i| st[i] != ItemStatus::Ok).collect();
    assert!(refused.is_empty(), "{} of 768 refused, the first {:?}", refused.len(), st[refused[0]]);
    let bb = h.block_bytes();
    let mut dst = SharedBuffer::new(768 * bb as usize).unwrap();
    let got = near.load_into_buffer(&h, &keys, &mut dst, &offsets, false).await.unwrap();
    assert_eq!(got.iter().filter(|g| **g).count(), 768);
    assert!(dst.as_slice() == src.as_slice(), "the bytes loaded back");
    cluster.stop().await;
}
