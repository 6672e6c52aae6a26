//! The disk tier under DRAM, against real server processes: three times the DRAM cap all loads
//! back, parked sessions survive `kill -9` and a restart, a corrupted byte on disk is a miss and
//! never wrong bytes, and a second server on the same directory is refused.

use std::process::Command;
use std::time::Duration;

use kvtier_client::ParkOptions;
use kvtier_tests::*;

const DRAM: &str = "16MiB";
const DISK: &str = "256MiB";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_times_the_dram_cap_all_loads_back() {
    let server = ServerProcess::start(&["--dram-capacity", DRAM, "--disk-capacity", DISK]);
    let client = server.client().await;
    let ns = client.register(namespace("disk", b"", small_layout())).await.unwrap();
    let docs: Vec<Vec<u32>> = (0..24).map(|d| tokens(500 + d, 1024)).collect(); // 24 x 2 MiB = 48 MiB
    for d in &docs {
        client.store(&ns, d, &full_block_payloads(&ns, d)).await.unwrap().ok().unwrap();
    }
    for (i, d) in docs.iter().enumerate() {
        assert_eq!(client.lookup(&ns, d).await.unwrap(), 1024, "doc {i} is in neither tier");
        let got = client.load(&ns, d).await.unwrap();
        assert!(got == full_block_payloads(&ns, d), "doc {i} came back different");
    }
    let s = client.stats().await.unwrap();
    let (dram, disk) = (&s.tiers[0], &s.tiers[1]);
    assert!(dram.allocated_bytes <= 16 << 20);
    assert!(disk.allocated_bytes <= 256 << 20);
    assert!(disk.hits > 0, "some loads came from disk: {disk:?}");
    let m = server.scrape();
    assert!(metric(&m, "kvtier_disk_demotions_total", &[]) > 0.0, "{m}");
    assert_eq!(metric(&m, "kvtier_disk_demotions_dropped_total", &[]), 0.0, "backpressure, not drops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_sessions_survive_kill_9_and_restart() {
    let dir = tempfile::tempdir().unwrap();
    let args = ["--dram-capacity", DRAM, "--disk-capacity", DISK];
    let mut server = ServerProcess::start_in(dir.path(), &args);
    let client = server.client().await;
    let ns = client.register(namespace("durable", b"s", small_layout())).await.unwrap();

    // A writer keeps storing prefix blocks while sessions are parked, up to the kill.
    let writer = {
        let client = client.clone();
        let ns = ns.clone();
        tokio::spawn(async move {
            for d in 0u32.. {
                let t = tokens(9000 + d, 512);
                if client.store(&ns, &t, &full_block_payloads(&ns, &t)).await.is_err() {
                    return d;
                }
            }
            unreachable!()
        })
    };
    let mut acked = Vec::new();
    for i in 0..6u32 {
        let t = tokens(100 + i, 700 + 37 * i as usize);
        let blocks = session_payloads(&ns, &t);
        let opts = ParkOptions { ttl: Some(Duration::from_secs(3600)), priority: None };
        client.park(&ns, &format!("agent-{i}"), &t, &blocks, &opts, 0).await.unwrap();
        acked.push((format!("agent-{i}"), blocks));
    }
    // Extend one of them: the extension must be durable too.
    let mut t5 = tokens(105, 700 + 37 * 5);
    let prev = t5.len();
    t5.extend(tokens(77, 300));
    let all5 = session_payloads(&ns, &t5);
    let base = prev / 16;
    client.extend(&ns, "agent-5", 1, prev, &t5, &all5[base..]).await.unwrap();
    acked[5].1 = all5;

    server.child.kill().unwrap(); // SIGKILL, mid-write-load
    server.child.wait().unwrap();
    let stored_before_kill = writer.await.unwrap();
    assert!(stored_before_kill > 0);
    drop(server);

    let server = ServerProcess::start_in(dir.path(), &args);
    assert!(server.stdout.last().unwrap().contains("6 sessions"), "{:?}", server.stdout);
    let client = server.client().await;
    // Namespaces are durable too: the restored sessions know their layout before anyone registers.
    assert_eq!(client.stats().await.unwrap().namespaces, 1);
    let listed = client.list_sessions(None).await.unwrap();
    assert_eq!(listed.len(), 6);
    assert!(listed.iter().all(|s| s.bytes == s.token_count * small_layout().bytes_per_token()), "{listed:?}");
    let ns = client.register(namespace("durable", b"s", small_layout())).await.unwrap();
    for (id, blocks) in &acked {
        let r = client.resume(&ns, id).await.unwrap_or_else(|e| panic!("{id}: {e}"));
        assert!(&r.blocks == blocks, "{id} resumed different bytes");
    }
    // Every other read is correct or a miss.
    for d in 0..stored_before_kill {
        let t = tokens(9000 + d, 512);
        let got = client.load(&ns, &t).await.unwrap();
        assert!(got[..] == full_block_payloads(&ns, &t)[..got.len()], "doc {d}: wrong bytes after restart");
    }
    let s = client.stats().await.unwrap();
    assert!(s.tiers[0].allocated_bytes <= 16 << 20 && s.tiers[1].allocated_bytes <= 256 << 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_byte_on_disk_is_a_miss_never_wrong_bytes() {
    let server = ServerProcess::start(&["--dram-capacity", DRAM, "--disk-capacity", DISK]);
    let client = server.client().await;
    let ns = client.register(namespace("rot", b"", small_layout())).await.unwrap();
    let docs: Vec<Vec<u32>> = (0..16).map(|d| tokens(700 + d, 1024)).collect();
    for d in &docs {
        client.store(&ns, d, &full_block_payloads(&ns, d)).await.unwrap().ok().unwrap();
    }
    // The demotions the stores set off are written by a thread of their own: the segment files
    // are read (and written back) only once nothing more is queued for them.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while metric(&server.scrape(), "kvtier_disk_queue_depth", &[]) > 0.0 {
        assert!(std::time::Instant::now() < deadline, "the demotion queue never drained");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Flip one payload byte in the first records of every segment (the oldest, DRAM-evicted blocks).
    let segs = server.dir.join("segments");
    let mut flipped = 0;
    for e in std::fs::read_dir(&segs).unwrap() {
        let p = e.unwrap().path();
        let mut b = std::fs::read(&p).unwrap();
        let mut off = 0;
        while off + 4096 < b.len() && flipped < 40 {
            b[off + 128 + 1000] ^= 0x5A;
            flipped += 1;
            off += 36864; // 32 KiB payload + header, aligned: every record
        }
        std::fs::write(&p, &b).unwrap();
    }
    assert!(flipped > 0);
    let mut short = 0;
    for d in &docs {
        let got = client.load(&ns, d).await.unwrap();
        let want = full_block_payloads(&ns, d);
        assert!(got[..] == want[..got.len()], "wrong bytes served");
        if got.len() < want.len() {
            short += 1;
        }
    }
    assert!(short > 0, "corrupted blocks should be misses");
    let m = server.scrape();
    assert!(metric(&m, "kvtier_errors_total", &[("kind", "disk_checksum")]) > 0.0, "{m}");
}

#[test]
fn a_second_server_on_the_same_directory_is_refused() {
    let server = ServerProcess::start(&["--disk-capacity", DISK]);
    let out = Command::new(kvtier_bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--data-listen", "127.0.0.1:0", "--no-metrics", "--data-dir"])
        .arg(&server.dir)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("in use by another kvtier server"), "{err}");
}

/// A small tmpfs mounted for one test and unmounted after it (needs root, as CI runs).
struct SmallFs(std::path::PathBuf);

impl SmallFs {
    fn mount(size: &str) -> SmallFs {
        static MOUNTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = MOUNTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("kvtier-enospc-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "this test mounts a {size} tmpfs to fill a real filesystem and needs root: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        SmallFs(dir)
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_leaves_dram_serving_and_says_so() {
    let fs = SmallFs::mount("24m");
    let server = ServerProcess::start_in(&fs.0, &["--dram-capacity", DRAM, "--disk-capacity", DISK]);
    let client = server.client().await;
    let ns = client.register(namespace("full-disk", b"", small_layout())).await.unwrap();
    let docs: Vec<Vec<u32>> = (0..24).map(|d| tokens(1500 + d, 1024)).collect(); // 48 MiB > 24 MiB fs
    for d in &docs {
        client.store(&ns, d, &full_block_payloads(&ns, d)).await.unwrap().ok().unwrap();
    }
    // DRAM keeps serving the recent documents, byte for byte; older ones are hits or misses.
    let last = docs.last().unwrap();
    assert!(client.load(&ns, last).await.unwrap() == full_block_payloads(&ns, last));
    for d in &docs {
        let got = client.load(&ns, d).await.unwrap();
        assert!(got[..] == full_block_payloads(&ns, d)[..got.len()]);
    }
    // A park can't be made durable on a full disk: a clear error, not a false acknowledgement.
    let t = tokens(42, 2048);
    let e = client.park(&ns, "no-room", &t, &session_payloads(&ns, &t), &ParkOptions::default(), 0).await.unwrap_err();
    assert!(e.to_string().contains("KV:Disk:Full") && e.to_string().contains("No space left"), "{e}");
    let m = server.scrape();
    assert!(metric(&m, "kvtier_errors_total", &[("kind", "disk_write")]) > 0.0, "{m}");
    // And the server is still up and answering.
    assert!(client.stats().await.unwrap().tiers.len() == 2);
    drop(server);
}

/// A disk tier whose file system fills before its capacity (its `disk_capacity` is above what
/// the file system holds) makes room out of its own oldest unpinned segments, as at its capacity:
/// demotions go on and a park is durable. Before, every demotion and park failed with the disk
/// full while the tier held megabytes of evictable blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_system_full_before_the_tiers_capacity_is_made_room_in() {
    let fs = SmallFs::mount("24m");
    let cfg = fs.0.join("segments.toml");
    std::fs::write(&cfg, "disk_segment_bytes = \"4MiB\"\n").unwrap();
    let data = fs.0.join("data");
    let args = ["--config", cfg.to_str().unwrap(), "--dram-capacity", DRAM, "--disk-capacity", "64MiB"];
    let server = ServerProcess::start_in(&data, &args);
    let client = server.client().await;
    let ns = client.register(namespace("fs-full", b"", small_layout())).await.unwrap();
    let docs: Vec<Vec<u32>> = (0..24).map(|d| tokens(2500 + d, 1024)).collect(); // 48 MiB > 24 MiB fs
    for d in &docs {
        client.store(&ns, d, &full_block_payloads(&ns, d)).await.unwrap().ok().unwrap();
    }
    let t = tokens(43, 2048);
    let opts = ParkOptions { ttl: Some(Duration::from_secs(3600)), priority: None };
    client
        .park(&ns, "made-room", &t, &session_payloads(&ns, &t), &opts, 0)
        .await
        .expect("a park on a full file system");
    assert!(client.resume(&ns, "made-room").await.unwrap().blocks == session_payloads(&ns, &t));
    for d in &docs {
        let got = client.load(&ns, d).await.unwrap();
        assert!(got[..] == full_block_payloads(&ns, d)[..got.len()], "a prefix, byte for byte");
    }
    let m = server.scrape();
    assert!(metric(&m, "kvtier_disk_full_evictions_total", &[]) > 0.0, "{m}");
    // Room made once the file system is full: the few demotions that met it before are all that failed.
    assert!(metric(&m, "kvtier_disk_demotions_failed_total", &[]) < 8.0, "{m}");
}

/// Fills `dir`'s file system to the last byte (a file of zeros, written until it is refused).
fn fill(dir: &std::path::Path) -> std::path::PathBuf {
    use std::io::Write;
    let path = dir.join("filler");
    let mut f = std::fs::File::create(&path).unwrap();
    let chunk = vec![0u8; 4096];
    while f.write_all(&chunk).is_ok() {}
    let _ = f.sync_all();
    path
}

/// A node killed on a full disk starts again on it (it refused to: "invalid configuration:
/// data_dir not writable", then a bare I/O error compacting sessions.log): its parked sessions
/// resume byte for byte, a park says the disk is full, and once room is made parks work again
/// without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_stopped_on_a_full_disk_starts_again_and_resumes_its_sessions() {
    let fs = SmallFs::mount("24m");
    let data = fs.0.join("data");
    let args = ["--dram-capacity", DRAM, "--disk-capacity", "16MiB"];
    let mut server = ServerProcess::start_in(&data, &args);
    let client = server.client().await;
    let ns = client.register(namespace("full-restart", b"", small_layout())).await.unwrap();
    let opts = ParkOptions { ttl: Some(Duration::from_secs(3600)), priority: None };
    let docs: Vec<Vec<u32>> = (0..3).map(|i| tokens(700 + i, 256)).collect();
    for (i, d) in docs.iter().enumerate() {
        client.park(&ns, &format!("s{i}"), d, &session_payloads(&ns, d), &opts, 0).await.unwrap();
    }
    let filler = fill(&fs.0);
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    drop(server);

    let server = ServerProcess::start_in(&data, &args);
    let client = server.client().await;
    let ns = client.register(namespace("full-restart", b"", small_layout())).await.unwrap();
    for (i, d) in docs.iter().enumerate() {
        let r = client.resume(&ns, &format!("s{i}")).await.unwrap();
        assert!(r.blocks == session_payloads(&ns, d), "session s{i} came back byte for byte");
    }
    let t = tokens(42, 1024);
    let e = client.park(&ns, "no-room", &t, &session_payloads(&ns, &t), &opts, 0).await.unwrap_err();
    assert!(e.to_string().contains("KV:Disk:Full"), "{e}");
    std::fs::remove_file(filler).unwrap();
    client.park(&ns, "room-again", &t, &session_payloads(&ns, &t), &opts, 0).await.unwrap();
    assert!(client.resume(&ns, "room-again").await.unwrap().blocks == session_payloads(&ns, &t));
    drop(server);
}

/// A purge holds across a restart of the real server (`kill -9`): the purged blocks stay gone
/// from the disk tier's segments, a parked session's blocks (which a purge spares) come back.
/// Without the purge record in `namespaces.log`, the dropped session's blocks loaded again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_holds_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let args = ["--dram-capacity", DRAM, "--disk-capacity", DISK];
    let mut server = ServerProcess::start_in(dir.path(), &args);
    let client = server.client().await;
    let ns = client.register(namespace("purged", b"s", small_layout())).await.unwrap();
    let opts = ParkOptions { ttl: Some(Duration::from_secs(3600)), priority: None };
    let (kept, gone) = (tokens(1, 640), tokens(2, 640));
    let kept_blocks = session_payloads(&ns, &kept);
    // Both parked (so their blocks are on disk and synced); one dropped, then the purge.
    client.park(&ns, "kept", &kept, &kept_blocks, &opts, 0).await.unwrap();
    client.park(&ns, "gone", &gone, &session_payloads(&ns, &gone), &opts, 0).await.unwrap();
    assert!(client.drop_session(&ns, "gone").await.unwrap());
    assert!(client.purge(&ns).await.unwrap().blocks_removed > 0);
    assert!(client.load(&ns, &gone).await.unwrap().is_empty(), "purged");
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    drop(server);

    let server = ServerProcess::start_in(dir.path(), &args);
    let client = server.client().await;
    let ns = client.register(namespace("purged", b"s", small_layout())).await.unwrap();
    assert_eq!(client.load(&ns, &gone).await.unwrap().len(), 0, "purged blocks came back after a restart");
    let r = client.resume(&ns, "kept").await.unwrap();
    assert!(r.blocks == kept_blocks, "the parked session's blocks");
}

/// A tier's hits and misses count what it served: a park making its blocks durable reads them
/// for the node's own use, and counts no DRAM hit (each park counted one per block, so a node
/// that served no load showed dozens of hits); the disk, asked for a block it does not hold,
/// counts a miss (it never did: its index answered before a read could count one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hits_and_misses_count_what_each_tier_served() {
    let server = ServerProcess::start(&["--dram-capacity", DRAM, "--disk-capacity", DISK]);
    let client = server.client().await;
    let ns = client.register(namespace("disk", b"counts", small_layout())).await.unwrap();
    let doc = tokens(77, 8 * 16);
    client.store(&ns, &doc, &full_block_payloads(&ns, &doc)).await.unwrap().ok().unwrap();
    let tier = |m: &str, what: &str, tier: &str| metric(m, &format!("kvtier_tier_{what}_total"), &[("tier", tier)]);
    let before = server.scrape();
    client.park(&ns, "s", &doc, &session_payloads(&ns, &doc), &ParkOptions::default(), 0).await.unwrap();
    let parked = server.scrape();
    assert_eq!(tier(&parked, "hits", "dram"), tier(&before, "hits", "dram"), "the park counted DRAM hits");
    assert_eq!(tier(&parked, "bytes_out", "dram"), tier(&before, "bytes_out", "dram"));
    assert!(tier(&parked, "bytes_in", "disk") > tier(&before, "bytes_in", "disk"), "the park wrote its blocks");

    assert_eq!(client.load(&ns, &doc).await.unwrap().len(), 8);
    let loaded = server.scrape();
    assert_eq!(tier(&loaded, "hits", "dram") - tier(&parked, "hits", "dram"), 8.0, "{loaded}");
    // Blocks no tier holds: DRAM and the disk were both asked.
    let absent = tokens(78, 4 * 16);
    assert_eq!(client.load(&ns, &absent).await.unwrap().len(), 0);
    let missed = server.scrape();
    assert!(tier(&missed, "misses", "dram") > tier(&loaded, "misses", "dram"), "{missed}");
    assert!(tier(&missed, "misses", "disk") > tier(&loaded, "misses", "disk"), "{missed}");
}
