//! The engine-key API (what vLLM, SGLang and LMCache adapters call) against a real server: engine
//! hashes as opaque keys in opaque-layout namespaces, per-key existence, stores that say what was
//! already there, loads straight into the caller's buffers and segments, the fused prefix load,
//! and lossless namespaces that never hold quantized bytes.

use std::time::{Duration, Instant};

use bytes::Bytes;
use kvtier_client::{BlockDest, ClientError, ItemStatus};
use kvtier_proto::{BlockFrame, CodecId, DType, HashScheme, KvLayout, Namespace};
use kvtier_tests::*;

fn opaque_ns(tenant: &str, block_bytes: u64, engine: &str) -> Namespace {
    Namespace::new(tenant, "llama-3-8b@main", KvLayout::opaque(block_bytes, DType::Bf16, 256), HashScheme::Sha256, b"s")
        .with_engine(engine)
}

fn hash(i: u32) -> Vec<u8> {
    blake3::hash(&i.to_le_bytes()).as_bytes().to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_keys_store_exist_and_load_into_buffers() {
    let server = ServerProcess::start(&["--dram-capacity", "256MiB"]);
    let client = server.client().await;
    // 3 MiB + 4 KiB: not a power of two, larger than one socket buffer, striped on load.
    let bb = (3 << 20) + 4096;
    let ns = client.register(opaque_ns("acme", bb, "engine=vllm;hash=sha256")).await.unwrap();
    let keys: Vec<_> = (0..6).map(|i| ns.engine_key(&hash(i))).collect();
    let blocks: Vec<Bytes> = keys.iter().map(|k| payload_for(k, bb)).collect();

    // Chunks stored out of order, with a hole: existence is per key, not a prefix.
    let stored: Vec<usize> = vec![4, 0, 1, 3];
    let st = client
        .store_keys(
            &ns,
            &stored.iter().map(|&i| keys[i]).collect::<Vec<_>>(),
            &stored.iter().map(|&i| vec![blocks[i].clone()]).collect::<Vec<_>>(),
        )
        .await
        .unwrap();
    assert_eq!(st, vec![ItemStatus::Ok; 4]);
    assert_eq!(client.exists_keys(&ns, &keys).await.unwrap(), vec![true, true, false, true, true, false]);

    // Storing again says the blocks were already there (nothing sent was kept).
    let again = client
        .store_keys(&ns, &keys[..3], &blocks[..3].iter().map(|b| vec![b.clone()]).collect::<Vec<_>>())
        .await
        .unwrap();
    assert_eq!(again, vec![ItemStatus::Present, ItemStatus::Present, ItemStatus::Ok]);

    // Loads land in the caller's memory; a miss leaves `false` and is never mistaken for data.
    let mut out = vec![0u8; 6 * bb as usize];
    let mut dests: Vec<BlockDest<'_>> = out.chunks_exact_mut(bb as usize).map(|c| vec![c]).collect();
    let landed = client.load_keys_into(&ns, &keys, &mut dests, false).await.unwrap();
    assert_eq!(landed, vec![true, true, true, true, true, false]);
    for i in 0..5 {
        assert!(out[i * bb as usize..(i + 1) * bb as usize] == blocks[i][..], "block {i}");
    }

    // The longest stored prefix in one request: keys after the first miss are not loaded.
    let mut out = vec![0u8; 6 * bb as usize];
    let order = [keys[0], keys[1], keys[5], keys[3]];
    let mut dests: Vec<BlockDest<'_>> = out.chunks_exact_mut(bb as usize).take(4).map(|c| vec![c]).collect();
    let landed = client.load_keys_into(&ns, &order, &mut dests, true).await.unwrap();
    assert_eq!(landed, vec![true, true, false, false], "stops at the first miss");

    // Scatter/gather: a block stored from 3 segments and loaded into 2 of other sizes.
    let parts = vec![blocks[5].slice(..1000), blocks[5].slice(1000..(1 << 20)), blocks[5].slice((1 << 20)..)];
    assert_eq!(client.store_keys(&ns, &keys[5..], &[parts]).await.unwrap(), vec![ItemStatus::Ok]);
    let (mut a, mut b) = (vec![0u8; 12345], vec![0u8; bb as usize - 12345]);
    let landed = client.load_keys_into(&ns, &keys[5..], &mut [vec![&mut a[..], &mut b[..]]], false).await.unwrap();
    assert_eq!(landed, vec![true]);
    assert!(a[..] == blocks[5][..12345] && b[..] == blocks[5][12345..]);

    // Wrong sizes are the caller's bug: refused before anything is sent.
    let err = client.store_keys(&ns, &keys[..1], &[vec![blocks[0].slice(1..)]]).await.unwrap_err();
    assert!(matches!(err, ClientError::InvalidArgument(_)), "{err}");

    // A namespace another server knows is unknown here: a clear error, and the connection goes on.
    let other = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    let elsewhere = other.client().await;
    let err = elsewhere.exists_keys(&ns, &keys).await.unwrap_err();
    assert!(matches!(err, ClientError::UnknownNamespace(_)), "{err}");
    let mut out = vec![0u8; bb as usize];
    let err = elsewhere.load_keys_into(&ns, &keys[..1], &mut [vec![&mut out[..]]], false).await.unwrap_err();
    assert!(matches!(err, ClientError::UnknownNamespace(_)), "{err}");
    let fresh = elsewhere.register(ns.namespace.clone()).await.unwrap();
    assert_eq!(elsewhere.exists_keys(&fresh, &keys).await.unwrap(), vec![false; 6]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_identity_keeps_namespaces_apart() {
    let server = ServerProcess::start(&["--dram-capacity", "64MiB"]);
    let client = server.client().await;
    let a = client.register(opaque_ns("acme", 4096, "engine=vllm;layout=NHD;pp=0/1;hash=sha256")).await.unwrap();
    let variants = [
        opaque_ns("acme", 4096, "engine=vllm;layout=HND;pp=0/1;hash=sha256"),
        opaque_ns("acme", 4096, "engine=vllm;layout=NHD;pp=1/2;hash=sha256"),
        opaque_ns("acme", 8192, "engine=vllm;layout=NHD;pp=0/1;hash=sha256"),
        opaque_ns("other", 4096, "engine=vllm;layout=NHD;pp=0/1;hash=sha256"),
    ];
    let key = a.engine_key(b"same engine hash");
    client.store_keys(&a, &[key], &[vec![payload_for(&key, 4096)]]).await.unwrap();
    assert_eq!(client.exists_keys(&a, &[key]).await.unwrap(), vec![true]);
    for v in variants {
        let h = client.register(v.clone()).await.unwrap();
        assert_ne!(h.id, a.id, "{v:?}");
        let k = h.engine_key(b"same engine hash");
        assert_ne!(k, key);
        assert_eq!(client.exists_keys(&h, &[k]).await.unwrap(), vec![false], "{v:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lossless_namespaces_never_hold_quantized_bytes() {
    let server = ServerProcess::start(&[
        "--dram-capacity",
        "8MiB",
        "--disk-capacity",
        "128MiB",
        "--disk-codec",
        "nvfp4+had+lz4",
    ]);
    let client = server.client().await;
    let layout = small_layout();
    let elements = layout.block_bytes() as usize / 2;
    let kv = |seed: usize| -> Bytes {
        Bytes::from(
            (0..elements)
                .flat_map(|i| {
                    half::f16::from_f32(((i * 7 + seed * 13) % 101) as f32 / 50.0 - 1.0).to_bits().to_le_bytes()
                })
                .collect::<Vec<u8>>(),
        )
    };
    let lossy = client.register(namespace("acme", b"q", layout)).await.unwrap();
    let exact = client.register(namespace("acme", b"q", layout).with_lossless(true)).await.unwrap();
    assert_ne!(lossy.id, exact.id, "a lossless namespace shares no block with a lossy one");

    // A quantizing codec is refused in a lossless namespace: by the client...
    assert!(matches!(exact.clone().with_codec(CodecId::NVFP4), Err(ClientError::InvalidArgument(_))));
    // ...and by the server, for a client that sends one anyway.
    let key = exact.engine_key(b"k");
    let raw = kv(1);
    let fp8 = lossy.clone().with_codec(CodecId::FP8_E4M3).unwrap().frame(key, 16, raw.clone()).unwrap();
    let sneaked = BlockFrame::new(exact.id, key, layout, CodecId::FP8_E4M3, 16, fp8.payload);
    assert_eq!(client.store_frames(&[sneaked]).await.unwrap(), vec![ItemStatus::LossyCodec]);
    assert_eq!(client.exists_keys(&exact, &[key]).await.unwrap(), vec![false]);

    // In a namespace that mixes codecs, a raw writer learns that the copy already held is lossy.
    let shared = lossy.engine_key(b"shared");
    let fp8_writer = lossy.clone().with_codec(CodecId::FP8_E4M3).unwrap();
    let st = client.store_keys_report(&fp8_writer, &[shared], &[vec![raw.clone()]]).await.unwrap();
    assert_eq!((st[0].status, st[0].codec), (ItemStatus::Ok, Some(CodecId::FP8_E4M3)));
    let st = client.store_keys_report(&lossy, &[shared], &[vec![raw.clone()]]).await.unwrap();
    assert_eq!((st[0].status, st[0].codec), (ItemStatus::Present, Some(CodecId::FP8_E4M3)));
    // The lossless namespace holds its own, raw copy of the same engine hash.
    let own = exact.engine_key(b"shared");
    let st = client.store_keys_report(&exact, &[own], &[vec![raw.clone()]]).await.unwrap();
    assert_eq!((st[0].status, st[0].codec), (ItemStatus::Ok, Some(CodecId::RAW)));
    let st = client.store_keys_report(&exact, &[own], &[vec![raw.clone()]]).await.unwrap();
    assert_eq!((st[0].status, st[0].codec), (ItemStatus::Present, Some(CodecId::RAW)));

    // Opaque layouts take raw bytes only.
    let opaque = client.register(opaque_ns("acme", 4096, "engine=x")).await.unwrap();
    assert!(
        opaque.clone().with_codec(CodecId::RAW_LZ4).is_err() && opaque.clone().with_codec(CodecId::FP8_E4M3).is_err()
    );

    // 16 MiB through an 8 MiB DRAM tier with a quantizing disk codec: the lossless namespace's
    // blocks come back bit-exact from disk; the plain namespace's were quantized there.
    let keys: Vec<_> = (0..512u32).map(|i| exact.engine_key(&i.to_le_bytes())).collect();
    let blocks: Vec<Bytes> = (0..512).map(kv).collect();
    for (k, b) in keys.chunks(16).zip(blocks.chunks(16)) {
        let st = client.store_keys(&exact, k, &b.iter().map(|b| vec![b.clone()]).collect::<Vec<_>>()).await.unwrap();
        assert!(st.iter().all(|s| *s == ItemStatus::Ok), "{st:?}");
        let deadline = Instant::now() + Duration::from_secs(30);
        while metric(&server.scrape(), "kvtier_disk_queue_depth", &[]) > 0.0 {
            assert!(Instant::now() < deadline, "demotion queue never drained");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    let m = server.scrape();
    assert!(metric(&m, "kvtier_disk_demotions_total", &[]) > 200.0, "most blocks went to disk: {m}");
    let frames = client.load_keys(&exact, &keys).await.unwrap();
    for (i, (f, want)) in frames.iter().zip(&blocks).enumerate() {
        let f = f.as_ref().unwrap_or_else(|| panic!("block {i} lost"));
        assert_eq!(f.header.codec, CodecId::RAW, "block {i}");
        assert_eq!(&f.payload, want, "block {i}");
    }
}

/// `Purge` removes a namespace's blocks from DRAM, the demotion queue and disk: none is found
/// afterwards, none comes back when the queue drains, and other namespaces keep theirs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_reaches_every_tier() {
    let server = ServerProcess::start(&[
        "--dram-capacity",
        "8MiB",
        "--disk-capacity",
        "128MiB",
        "--disk-codec",
        "nvfp4+had+lz4",
    ]);
    let client = server.client().await;
    let layout = small_layout();
    let gone = client.register(namespace("purged", b"p", layout)).await.unwrap();
    let kept = client.register(namespace("kept", b"k", layout)).await.unwrap();
    let doc = tokens(77, 16 * 640); // 640 blocks of 32 KiB: 20 MiB through an 8 MiB DRAM tier
    let kept_doc = tokens(78, 16 * 64);
    client.store(&kept, &kept_doc, &full_block_payloads(&kept, &kept_doc)).await.unwrap().ok().unwrap();
    client.store(&gone, &doc, &full_block_payloads(&gone, &doc)).await.unwrap().ok().unwrap();
    let queued = metric(&server.scrape(), "kvtier_disk_queue_depth", &[]);
    let removed = client.purge(&gone).await.unwrap().blocks_removed;
    eprintln!("purge: {removed} blocks removed, {queued} queued for disk at the time");
    let s = client.stats().await.unwrap();
    assert!(s.tiers[1].blocks > 0 || removed > 0, "{s:?}");
    assert!(removed >= 600, "{removed} of 640 blocks removed (queue held {queued} at the purge)");
    let keys = gone.keys(&doc);
    assert_eq!(client.exists_keys(&gone, &keys).await.unwrap(), vec![false; keys.len()]);
    // Blocks that were on their way to disk at the purge don't come back once written.
    let deadline = Instant::now() + Duration::from_secs(30);
    while metric(&server.scrape(), "kvtier_disk_queue_depth", &[]) > 0.0 {
        assert!(Instant::now() < deadline, "demotion queue never drained");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(client.lookup(&gone, &doc).await.unwrap(), 0);
    assert!(client.load_keys(&gone, &keys).await.unwrap().iter().all(|f| f.is_none()));
    // The other namespace's blocks (in DRAM and on disk) are all still there.
    assert_eq!(client.lookup(&kept, &kept_doc).await.unwrap(), kept_doc.len());
}
