//! Agent sessions against a real server: park after turn 1, extend after turn 2 sending only new
//! blocks, resume with identical bytes, drop frees the pins, TTL expiry.

use std::time::Duration;

use kvtier_client::{ClientError, ParkOptions};
use kvtier_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn park_extend_resume_drop() {
    let server = ServerProcess::start(&["--dram-capacity", "128MiB"]);
    let client = server.client().await;
    let ns = client.register(namespace("agents", b"s", small_layout())).await.unwrap();
    let bb = ns.block_bytes();

    // Turn 1: 1000 tokens = 62 full blocks + a tail of 8.
    let turn1 = tokens(7, 1000);
    let blocks1 = session_payloads(&ns, &turn1);
    assert_eq!(blocks1.len(), 63);
    let info = client.park(&ns, "agent-7", &turn1, &blocks1, &ParkOptions::default(), 0).await.unwrap();
    assert_eq!((info.version, info.token_count, info.blocks, info.has_tail), (1, 1000, 62, true));

    // Turn 2: 600 more tokens. Only blocks from index 62 (old tail + new tokens) on are sent.
    let mut turn2 = turn1.clone();
    turn2.extend(tokens(8, 600));
    let all2 = session_payloads(&ns, &turn2);
    let new_blocks = &all2[62..];
    let before = client.stats().await.unwrap().tiers[0].bytes_in;
    let info = client.extend(&ns, "agent-7", 1, 1000, &turn2, new_blocks).await.unwrap();
    assert_eq!((info.version, info.token_count, info.blocks, info.has_tail), (2, 1600, 100, false));
    let after = client.stats().await.unwrap().tiers[0].bytes_in;
    assert_eq!(after - before, 38 * bb, "only the 38 new blocks travel");

    // Extending against a stale version changes nothing.
    let err = client.extend(&ns, "agent-7", 1, 1600, &turn2, &[]).await.unwrap_err();
    assert!(matches!(err, ClientError::VersionConflict(_)), "{err}");

    // Resume (from another connection) returns exactly the KV of the 1600 tokens.
    let other = server.client().await;
    let ns2 = other.register(namespace("agents", b"s", small_layout())).await.unwrap();
    let r = other.resume(&ns2, "agent-7").await.unwrap();
    assert_eq!(r.info.version, 2);
    assert_eq!(r.blocks, all2);

    // The session's blocks are also prefix-cache hits for anyone with the same tokens.
    assert_eq!(other.lookup(&ns2, &turn2).await.unwrap(), 1600);

    let pinned = client.stats().await.unwrap().tiers[0].pinned_bytes;
    assert!(pinned >= 100 * bb, "pinned {pinned}");
    assert_eq!(client.list_sessions(Some(&ns)).await.unwrap().len(), 1);
    assert!(client.drop_session(&ns, "agent-7").await.unwrap());
    assert_eq!(client.stats().await.unwrap().tiers[0].pinned_bytes, 0);
    assert!(!client.drop_session(&ns, "agent-7").await.unwrap());
    let err = client.resume(&ns, "agent-7").await.unwrap_err();
    assert!(matches!(err, ClientError::SessionNotFound(_)), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_expiry_unpins_and_resume_says_expired() {
    let server = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    let client = server.client().await;
    let ns = client.register(namespace("agents", b"ttl", small_layout())).await.unwrap();
    let t = tokens(3, 100);
    let opts = ParkOptions { ttl: Some(Duration::from_millis(600)), priority: None };
    client.park(&ns, "short-lived", &t, &session_payloads(&ns, &t), &opts, 0).await.unwrap();
    assert!(client.stats().await.unwrap().tiers[0].pinned_bytes > 0);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // The sweeper has run: the pins are gone even before anyone asks.
    assert_eq!(client.stats().await.unwrap().tiers[0].pinned_bytes, 0);
    assert_eq!(client.stats().await.unwrap().sessions, 0);
    let err = client.resume(&ns, "short-lived").await.unwrap_err();
    assert!(matches!(err, ClientError::SessionExpired(_)), "{err}");
    assert!(err.to_string().contains("KV:Session:Expired"), "{err}");
    // The id can be parked again afresh.
    let info =
        client.park(&ns, "short-lived", &t, &session_payloads(&ns, &t), &ParkOptions::default(), 0).await.unwrap();
    assert_eq!(info.version, 1);
}
