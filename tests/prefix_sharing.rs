//! Prefix sharing between replicas: one client stores a 4K-token prefix, another connection and
//! another process find it and load byte-identical blocks; other namespaces and salts find nothing.

use kvtier_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_b_reuses_replica_a_prefix() {
    let server = ServerProcess::start(&["--dram-capacity", "256MiB"]);
    let layout = small_layout();
    let doc = tokens(1, 4096);

    // Replica A computes and stores the prefix.
    let a = server.client().await;
    let ns_a = a.register(namespace("acme", b"acme-salt", layout)).await.unwrap();
    let blocks = full_block_payloads(&ns_a, &doc);
    assert_eq!(blocks.len(), 256);
    a.store(&ns_a, &doc, &blocks).await.unwrap().ok().unwrap();

    // Replica B: its own connections; a longer prompt that starts with the same 4K tokens.
    let b = server.client().await;
    let ns_b = b.register(namespace("acme", b"acme-salt", layout)).await.unwrap();
    let mut prompt = doc.clone();
    prompt.extend(tokens(99, 1000));
    assert_eq!(b.lookup(&ns_b, &prompt).await.unwrap(), 4096);
    let loaded = b.load(&ns_b, &prompt).await.unwrap();
    assert_eq!(loaded.len(), 256);
    for (i, (got, want)) in loaded.iter().zip(&blocks).enumerate() {
        assert_eq!(got, want, "block {i} differs");
    }

    // A prompt that diverges at token 1000 shares only the blocks before it.
    let mut diverging = doc.clone();
    diverging[1000] ^= 1;
    assert_eq!(b.lookup(&ns_b, &diverging).await.unwrap(), 1000 / 16 * 16);

    // Another tenant, another salt, another layout: nothing.
    let other_tenant = b.register(namespace("globex", b"acme-salt", layout)).await.unwrap();
    assert_eq!(b.lookup(&other_tenant, &doc).await.unwrap(), 0);
    let other_salt = b.register(namespace("acme", b"other-salt", layout)).await.unwrap();
    assert_eq!(b.lookup(&other_salt, &doc).await.unwrap(), 0);
    assert!(b.load(&other_salt, &doc).await.unwrap().is_empty());
    let mut tp2 = layout;
    tp2.tp_world = 2;
    let other_layout = b.register(namespace("acme", b"acme-salt", tp2)).await.unwrap();
    assert_eq!(b.lookup(&other_layout, &doc).await.unwrap(), 0);

    // A third replica in another process (the CLI) sees it too, through the same namespace flags.
    let text: Vec<String> = doc.iter().map(|t| t.to_string()).collect();
    let (ok, out, err) = cli(&[
        "lookup",
        "--server",
        &server.grpc_addr(),
        "--tenant",
        "acme",
        "--model",
        "test-model@1",
        "--salt",
        "acme-salt",
        "--layers",
        "4",
        "--kv-heads",
        "2",
        "--head-dim",
        "64",
        "--dtype",
        "fp16",
        "--block-tokens",
        "16",
        "--tokens",
        &text.join(","),
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("4096 of 4096 tokens are stored"), "{out}");

    // The operator sees the hits.
    let m = server.scrape();
    assert!(metric(&m, "kvtier_tier_hits_total", &[("tier", "dram")]) >= 256.0, "{m}");
    assert!(metric(&m, "kvtier_request_seconds_count", &[("op", "lookup")]) >= 5.0, "{m}");
}
