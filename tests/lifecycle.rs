//! A node is a library value with a lifecycle: started in this process, stopped (every task
//! ended, the demotion queue flushed, the data directory's lock released), and started again on
//! the same directory with its parked sessions still there.

use std::time::Duration;

use kvtier_client::{ClientConfig, KvClient, ParkOptions};
use kvtier_server::config::ByteSize;
use kvtier_server::ServerConfig;
use kvtier_tests::*;

fn config(dir: &std::path::Path) -> ServerConfig {
    ServerConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        data_listen: "127.0.0.1:0".parse().unwrap(),
        metrics_listen: None,
        data_dir: dir.to_path_buf(),
        dram_capacity: ByteSize(8 << 20),
        disk_capacity: ByteSize(128 << 20),
        ..ServerConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_then_start_again_in_the_same_process_and_directory() {
    let dir = tempfile::tempdir().unwrap();
    let ns = namespace("life", b"l", small_layout());
    let turn = tokens(5, 16 * 40 + 3);
    let doc = tokens(6, 16 * 400); // 12.5 MiB through an 8 MiB DRAM tier: demotion is busy at the stop
    let (mut parked, mut doc_blocks) = (Vec::new(), Vec::new());
    for round in 0..3 {
        let server = kvtier_server::start(config(dir.path()), None).await.expect("start");
        // A second node on the same directory is refused while this one runs.
        let err = kvtier_server::start(config(dir.path()), None).await.err().expect("second node refused");
        assert!(err.to_string().contains("in use"), "{err}");
        let client = KvClient::connect(&server.grpc_addr.to_string(), ClientConfig::default()).await.unwrap();
        let h = client.register(ns.clone()).await.unwrap();
        if round == 0 {
            parked = session_payloads(&h, &turn);
            doc_blocks = full_block_payloads(&h, &doc);
            client.park(&h, "agent", &turn, &parked, &ParkOptions::default(), 0).await.unwrap();
            client.store(&h, &doc, &doc_blocks).await.unwrap().ok().unwrap();
        } else {
            let back = client.resume(&h, "agent").await.unwrap();
            assert_eq!(back.blocks, parked, "round {round}: the parked session survived the stop");
            // Every block demoted before or during the stop is on disk: nothing queued was lost.
            let frames = client.load_keys(&h, &h.keys(&doc)).await.unwrap();
            let held = frames.iter().filter(|f| f.is_some()).count();
            assert!(held >= 400 - 256 - 1, "round {round}: {held} of 400 blocks came back");
            for (f, want) in frames.iter().zip(&doc_blocks) {
                if let Some(f) = f {
                    assert_eq!(&f.payload, want);
                }
            }
        }
        drop(client);
        let state = std::sync::Arc::downgrade(&server.state);
        tokio::time::timeout(Duration::from_secs(20), server.stop(Duration::from_secs(5)))
            .await
            .expect("stop returns")
            .expect("stop");
        // Every task that held the node is gone (so its LOCK is released).
        assert!(state.upgrade().is_none(), "round {round}: something still holds the node");
    }
}
