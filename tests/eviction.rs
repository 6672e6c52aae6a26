//! Eviction under the DRAM cap: pinned sessions survive a flood of prefix blocks three times the
//! cap, resident and allocated bytes never pass the cap, and a park that would need more pinned
//! bytes than the tier may hold gets a clear capacity error instead of evicting anyone's session.

use kvtier_client::{ClientError, ItemStatus, ParkOptions};
use kvtier_tests::*;

const CAP: u64 = 16 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pinned_session_survives_a_flood_three_times_the_cap() {
    let server = ServerProcess::start(&["--dram-capacity", "16MiB"]);
    let client = server.client().await;
    let ns = client.register(namespace("evict", b"", small_layout())).await.unwrap();
    let bb = ns.block_bytes();

    let agent = tokens(1, 2000); // 125 blocks + a tail: ~4 MiB pinned
    let agent_blocks = session_payloads(&ns, &agent);
    client.park(&ns, "pinned-agent", &agent, &agent_blocks, &ParkOptions::default(), 0).await.unwrap();

    let mut stored_docs = Vec::new();
    let mut total = 0u64;
    let mut doc = 100;
    while total < 3 * CAP {
        let t = tokens(doc, 1024); // 64 blocks = 2 MiB per document
        let report = client.store(&ns, &t, &full_block_payloads(&ns, &t)).await.unwrap();
        assert_eq!(report.stored, 64, "{report:?}");
        total += 64 * bb;
        stored_docs.push(t);
        doc += 1;
        let s = client.stats().await.unwrap().tiers[0].clone();
        assert!(s.allocated_bytes <= CAP, "allocated {} > cap", s.allocated_bytes);
        assert!(s.resident_bytes <= s.allocated_bytes);
    }
    let s = client.stats().await.unwrap().tiers[0].clone();
    assert!(s.evictions > 0, "a flood of 3x the cap must evict");

    // The pinned session is intact, byte for byte.
    let r = client.resume(&ns, "pinned-agent").await.unwrap();
    assert_eq!(r.blocks, agent_blocks);

    // Recent documents are (at least partly) still there, and whatever loads is correct.
    let last = stored_docs.last().unwrap();
    let loaded = client.load(&ns, last).await.unwrap();
    let want = full_block_payloads(&ns, last);
    assert_eq!(loaded[..], want[..loaded.len()]);
    for d in &stored_docs {
        let got = client.load(&ns, d).await.unwrap();
        let want = full_block_payloads(&ns, d);
        assert_eq!(got[..], want[..got.len()], "a loaded block differs from what was stored");
    }

    let m = server.scrape();
    assert!(metric(&m, "kvtier_tier_evictions_total", &[("tier", "dram")]) > 0.0, "{m}");
    assert!(metric(&m, "kvtier_tier_allocated_bytes", &[("tier", "dram")]) <= CAP as f64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn park_when_everything_is_pinned_is_a_capacity_error() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("kvtier.toml");
    std::fs::write(&cfg, "dram_capacity = \"8MiB\"\nmax_pinned_ratio = 1.0\n").unwrap();
    let server = ServerProcess::start(&["--config", cfg.to_str().unwrap()]);
    let client = server.client().await;
    let ns = client.register(namespace("full", b"", small_layout())).await.unwrap();

    // 32 KiB blocks, 8 MiB: 256 slots. Park 2 MiB sessions until the server says no.
    let mut parked = Vec::new();
    let mut refusal = None;
    for i in 0..8u32 {
        let t = tokens(1000 + i, 1024);
        match client.park(&ns, &format!("s{i}"), &t, &session_payloads(&ns, &t), &ParkOptions::default(), 0).await {
            Ok(_) => parked.push((format!("s{i}"), t)),
            Err(e) => {
                refusal = Some(e);
                break;
            }
        }
    }
    let err = refusal.expect("an 8 MiB tier can't pin eight 2 MiB sessions");
    assert_eq!(parked.len(), 4, "exactly four 2 MiB sessions fit 8 MiB");
    match &err {
        ClientError::Rejected { status: ItemStatus::Capacity, .. } | ClientError::Capacity(_) => {}
        other => panic!("expected a capacity error, got {other}"),
    }

    // A plain store now gets a per-block capacity status, not an eviction of a pinned session.
    let t = tokens(5000, 64);
    let report = client.store(&ns, &t, &full_block_payloads(&ns, &t)).await.unwrap();
    assert_eq!(report.stored, 0);
    assert!(report.rejected.iter().all(|(_, s)| *s == ItemStatus::Capacity), "{report:?}");

    // Every parked session is intact and the server keeps serving.
    for (id, t) in &parked {
        let r = client.resume(&ns, id).await.unwrap();
        assert_eq!(r.blocks, session_payloads(&ns, t), "{id}");
    }
    // Dropping one frees room for new work.
    assert!(client.drop_session(&ns, &parked[0].0).await.unwrap());
    let report = client.store(&ns, &t, &full_block_payloads(&ns, &t)).await.unwrap();
    assert_eq!(report.stored, 4);
    let m = server.scrape();
    assert!(metric(&m, "kvtier_errors_total", &[("kind", "capacity")]) > 0.0, "{m}");
}
