//! Blocks stored with a codec: one client quantizes (FP8, NVFP4) on its way to the server, another
//! loads and gets the layout's dtype back, within the format's error; the server holds fewer bytes.

use bytes::Bytes;
use half::f16;
use kvtier_client::ClientError;
use kvtier_proto::CodecId;
use kvtier_tests::*;

/// A block of smooth fp16 values with a per-block offset, so blocks differ.
fn kv_block(elements: usize, seed: usize) -> Bytes {
    (0..elements)
        .flat_map(|i| f16::from_f32(((i * 7 + seed * 13) as f32 * 0.011).sin() * 3.0).to_bits().to_le_bytes())
        .collect::<Vec<u8>>()
        .into()
}

fn values(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(2).map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()).collect()
}

/// Largest error relative to the block's largest magnitude.
fn rel_error(got: &[u8], want: &[u8]) -> f32 {
    let (g, w) = (values(got), values(want));
    assert_eq!(g.len(), w.len());
    let amax = w.iter().fold(0f32, |m, v| m.max(v.abs()));
    g.iter().zip(&w).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / amax
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quantized_blocks_come_back_in_the_engines_dtype() {
    let server = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    let layout = small_layout();
    let elements = layout.block_bytes() as usize / 2;
    for (seed, codec, bound) in [(1, CodecId::FP8_E4M3, 0.07), (2, CodecId::NVFP4, 0.2), (3, CodecId::RAW_LZ4, 0.0)] {
        let doc = tokens(seed, 64);
        let writer = server.client().await;
        let ns_w = writer.register(namespace("acme", b"s", layout)).await.unwrap().with_codec(codec).unwrap();
        let blocks: Vec<Bytes> = (0..4).map(|b| kv_block(elements, b + 10 * seed as usize)).collect();
        let resident = || async { writer.stats().await.unwrap().tiers.iter().map(|t| t.resident_bytes).sum::<u64>() };
        let before = resident().await;
        writer.store(&ns_w, &doc, &blocks).await.unwrap().ok().unwrap();
        let stored = resident().await - before;
        if codec != CodecId::RAW_LZ4 {
            assert!(stored < 4 * layout.block_bytes() * 3 / 5, "{codec:?}: {stored} bytes held");
        }

        // Another client, which stores raw itself, reads them back decoded.
        let reader = server.client().await;
        let ns_r = reader.register(namespace("acme", b"s", layout)).await.unwrap();
        let loaded = reader.load(&ns_r, &doc).await.unwrap();
        assert_eq!(loaded.len(), 4, "{codec:?}");
        for (i, (got, want)) in loaded.iter().zip(&blocks).enumerate() {
            assert_eq!(got.len(), want.len(), "{codec:?} block {i}");
            let e = rel_error(got, want);
            assert!(e <= bound, "{codec:?} block {i}: error {e} over {bound}");
            if codec == CodecId::RAW_LZ4 {
                assert_eq!(got, want);
            } else {
                assert_ne!(got, want, "{codec:?} block {i} was not quantized");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quantized_session_resumes_with_its_tail() {
    let server = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    let layout = small_layout();
    let client = server.client().await;
    let ns = client.register(namespace("acme", b"s", layout)).await.unwrap().with_codec(CodecId::NVFP4).unwrap();
    let turn = tokens(7, 40); // 2 full blocks and a tail of 8 tokens
    let per_token = layout.bytes_for_tokens(1) as usize / 2;
    let blocks = vec![kv_block(16 * per_token, 1), kv_block(16 * per_token, 2), kv_block(8 * per_token, 3)];
    client.park(&ns, "agent-1", &turn, &blocks, &Default::default(), 0).await.unwrap();
    let back = client.resume(&ns, "agent-1").await.unwrap();
    assert_eq!(back.blocks.len(), 3);
    for (got, want) in back.blocks.iter().zip(&blocks) {
        assert_eq!(got.len(), want.len());
        assert!(rel_error(got, want) <= 0.2);
        assert_ne!(got, want, "the session was stored quantized");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_finite_kv_is_refused_before_anything_is_sent() {
    let server = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    let layout = small_layout();
    let client = server.client().await;
    let ns = client.register(namespace("acme", b"s", layout)).await.unwrap().with_codec(CodecId::FP8_E4M3).unwrap();
    let doc = tokens(9, 32);
    let good = kv_block(layout.block_bytes() as usize / 2, 0);
    let mut bad = good.to_vec();
    bad[100..102].copy_from_slice(&f16::NAN.to_bits().to_le_bytes());
    let err = client.store(&ns, &doc, &[good, Bytes::from(bad)]).await.unwrap_err();
    assert!(matches!(err, ClientError::Codec(ref m) if m.contains("non-finite")), "{err}");
    assert_eq!(client.lookup(&ns, &doc).await.unwrap(), 0, "nothing of a refused store is kept");
    // An unknown codec id is refused when the namespace is configured.
    let raw = client.register(namespace("acme", b"s", layout)).await.unwrap();
    assert!(matches!(raw.with_codec(CodecId(99)), Err(ClientError::Codec(_))));
}
