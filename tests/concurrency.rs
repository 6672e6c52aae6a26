//! Sixteen clients storing and loading overlapping prefixes at once: no lost or corrupt block.

use kvtier_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_clients_overlapping_prefixes() {
    let server = ServerProcess::start(&["--dram-capacity", "512MiB"]);
    let layout = small_layout();
    // Four shared system prompts of 512 tokens; each client appends its own 256-token suffix.
    let prompts: Vec<Vec<u32>> = (0..4).map(|p| tokens(10 + p, 512)).collect();
    let mut tasks = Vec::new();
    for c in 0..16u32 {
        let addr = server.grpc_addr();
        let prompts = prompts.clone();
        tasks.push(tokio::spawn(async move {
            let client = kvtier_client::KvClient::connect(&addr, Default::default()).await.unwrap();
            let ns = client.register(namespace("fleet", b"k", layout)).await.unwrap();
            for round in 0..4u32 {
                let mut t = prompts[((c + round) % 4) as usize].clone();
                t.extend(tokens(1000 + c * 16 + round, 256));
                let blocks = full_block_payloads(&ns, &t);
                client.store(&ns, &t, &blocks).await.unwrap().ok().unwrap();
                // Load a prefix another client may be writing right now.
                let other = &prompts[((c + round + 1) % 4) as usize];
                let got = client.load(&ns, other).await.unwrap();
                let want = full_block_payloads(&ns, other);
                assert_eq!(got[..], want[..got.len()], "client {c} round {round}: corrupt block");
                let mine = client.load(&ns, &t).await.unwrap();
                assert_eq!(mine, blocks, "client {c} round {round}: lost block");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let client = server.client().await;
    let s = client.stats().await.unwrap().tiers[0].clone();
    // 4 prompts x 32 blocks + 64 suffixes x 16 blocks, each stored once however often it was sent.
    assert_eq!(s.blocks, 4 * 32 + 64 * 16);
    assert_eq!(s.evictions, 0);
}
