//! Fragmentation: 50 sequential jobs of varying context length (1K to 128K tokens, with partial
//! tails of every size) through a small DRAM cap. Resident and allocated bytes stay within the cap
//! and the allocator's overhead (allocated / resident) stays bounded; the figures are printed.

use kvtier_client::ParkOptions;
use kvtier_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_jobs_through_a_small_cap() {
    const CAP: u64 = 32 << 20;
    let server = ServerProcess::start(&["--dram-capacity", "32MiB"]);
    let client = server.client().await;
    let mut layout = tiny_layout();
    layout.block_tokens = 64; // 4 KiB blocks; a 128K-token job is 8 MiB
    let ns = client.register(namespace("frag", b"", layout)).await.unwrap();

    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let mut worst_overhead: f64 = 1.0;
    let mut prev: Option<String> = None;
    for job in 0..50u32 {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let len = 1024 + (rng % (127 * 1024)) as usize;
        let t = tokens(10_000 + job, len);
        let blocks = session_payloads(&ns, &t);
        let id = format!("job-{job}");
        client.park(&ns, &id, &t, &blocks, &ParkOptions::default(), 0).await.unwrap();
        let r = client.resume(&ns, &id).await.unwrap();
        assert!(r.blocks == blocks, "job {job}: resumed bytes differ");
        // The previous job finishes; its blocks stay cached but unpinned.
        if let Some(p) = prev.replace(id) {
            assert!(client.drop_session(&ns, &p).await.unwrap());
        }
        let s = client.stats().await.unwrap().tiers[0].clone();
        assert!(s.allocated_bytes <= CAP, "job {job}: allocated {} > cap {CAP}", s.allocated_bytes);
        assert!(s.resident_bytes <= s.allocated_bytes, "job {job}: {s:?}");
        if s.resident_bytes > CAP / 2 {
            worst_overhead = worst_overhead.max(s.allocated_bytes as f64 / s.resident_bytes as f64);
        }
    }
    let s = client.stats().await.unwrap().tiers[0].clone();
    eprintln!(
        "fragmentation: resident {} allocated {} cap {CAP}; overhead now {:.4}, worst {:.4}; evictions {}",
        s.resident_bytes,
        s.allocated_bytes,
        s.allocated_bytes as f64 / s.resident_bytes as f64,
        worst_overhead,
        s.evictions
    );
    assert!(s.evictions > 0, "50 jobs of up to 8 MiB must cycle a 32 MiB tier");
    assert!(worst_overhead < 1.10, "allocator overhead {worst_overhead:.3} is too high");
}
