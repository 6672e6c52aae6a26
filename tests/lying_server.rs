//! The client against a data plane that lies (a buggy server, or someone in the middle of a
//! plaintext connection): the control plane is a real in-process node, the data-plane streams go
//! through a connector to a hand-written fake that answers every `GET` with a frame of the
//! requested key whose size does not match its layout, with a checksum that matches its bytes.
//! The client must say what went wrong — an error or a miss — and never panic or hand the
//! caller bytes that are not the block.

use std::time::Duration;

use kvtier_client::{BlockDest, BoxedStream, ClientConfig, ClientError, KvClient};
use kvtier_proto::dataplane::{
    Hello, HelloReply, ItemStatus, Op, RequestHeader, ResponseHeader, Status, HELLO_LEN, REQUEST_HEADER_LEN,
};
use kvtier_proto::{BlockKey, CodecId, FrameHeader, KvLayout, NamespaceId, ProtoError, KEY_LEN};
use kvtier_server::config::ByteSize;
use kvtier_server::ServerConfig;
use kvtier_tests::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

/// How the fake's frame lies about its size.
#[derive(Clone, Copy)]
enum Lie {
    /// A raw frame one byte short of the layout's block.
    ShortRaw,
    /// A raw frame four times the layout's block.
    HugeRaw,
}

/// Serves one data-plane stream: the hello, then every `GET` answered with `lie`.
async fn fake_data_plane(mut s: DuplexStream, ns: NamespaceId, layout: KvLayout, lie: Lie) -> std::io::Result<()> {
    let mut h = [0u8; HELLO_LEN];
    s.read_exact(&mut h).await?;
    let hello = Hello::decode(&h).unwrap();
    let mut token = vec![0u8; hello.token_len as usize];
    s.read_exact(&mut token).await?;
    s.write_all(&HelloReply::encode(Status::Ok, "a fake")).await?;
    loop {
        let mut rh = [0u8; REQUEST_HEADER_LEN];
        s.read_exact(&mut rh).await?;
        let req = RequestHeader::decode(&rh).unwrap();
        assert_eq!(req.op, Op::Get, "the fake only answers GET");
        let mut keys = vec![0u8; req.count as usize * KEY_LEN];
        s.read_exact(&mut keys).await?;
        s.write_all(&ResponseHeader::ok(Op::Get, req.request_id, req.count).encode()).await?;
        for k in keys.chunks_exact(KEY_LEN) {
            let block = layout.block_bytes();
            let len = match lie {
                Lie::ShortRaw => block - 1,
                Lie::HugeRaw => block * 4,
            };
            let payload = vec![7u8; len as usize];
            let header = FrameHeader {
                codec: CodecId::RAW,
                tokens: layout.block_tokens,
                flags: 0,
                namespace: ns,
                key: BlockKey(k.try_into().unwrap()),
                layout,
                payload_len: len,
                checksum: kvtier_proto::checksum(&payload),
            };
            s.write_all(&[ItemStatus::Ok as u8]).await?;
            s.write_all(&header.encode()).await?;
            s.write_all(&payload).await?;
        }
    }
}

async fn lying_client(lie: Lie) -> (kvtier_server::RunningServer, KvClient, kvtier_client::NamespaceHandle) {
    let dir = tempfile::tempdir().unwrap();
    let config = ServerConfig { dram_capacity: ByteSize(16 << 20), ..kvtier_tests::harness::node_config(&dir.keep()) };
    let server = kvtier_server::start(config, None).await.unwrap();
    let layout = small_layout();
    let ns_id = namespace("liar", b"l", layout).id();
    let connector = move || async move {
        let (ours, theirs) = tokio::io::duplex(1 << 20);
        tokio::spawn(fake_data_plane(theirs, ns_id, layout, lie));
        Ok::<BoxedStream, std::io::Error>(Box::new(ours))
    };
    let cfg = ClientConfig { request_timeout: Duration::from_secs(5), ..ClientConfig::default() };
    let client = KvClient::connect_with(&server.grpc_addr.to_string(), cfg, connector).await.unwrap();
    let ns = client.register(namespace("liar", b"l", layout)).await.unwrap();
    assert_eq!(ns.id, ns_id);
    (server, client, ns)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_whose_size_does_not_match_its_layout_is_an_error_not_a_panic() {
    for lie in [Lie::ShortRaw, Lie::HugeRaw] {
        let (server, client, ns) = lying_client(lie).await;
        let keys = ns.keys(&tokens(3, ns.block_tokens() * 2));
        let bb = ns.block_bytes() as usize;
        // Into the caller's buffer (the engine path), one call and striped.
        let mut room = vec![0u8; bb * keys.len()];
        let mut dests: Vec<BlockDest<'_>> = room.chunks_exact_mut(bb).map(|c| vec![c]).collect();
        let err = client.load_keys_into(&ns, &keys, &mut dests, true).await.unwrap_err();
        assert!(is_size_mismatch(&err), "{err:?}");
        // Into buffers of the client's own.
        let err = client.load_keys(&ns, &keys).await.unwrap_err();
        assert!(is_size_mismatch(&err), "{err:?}");
        // The decoding helper an engine calls on a frame it holds.
        let bad = kvtier_proto::BlockFrame {
            header: FrameHeader {
                codec: CodecId::RAW,
                tokens: ns.block_tokens() as u32,
                flags: 0,
                namespace: ns.id,
                key: keys[0],
                layout: small_layout(),
                payload_len: bb as u64 - 1,
                checksum: 0,
            },
            payload: bytes::Bytes::from(vec![1u8; bb - 1]),
        };
        let mut out = vec![0u8; bb];
        let err = kvtier_client::decode_frame_into(&bad, &mut out).unwrap_err();
        assert!(is_size_mismatch(&err), "{err:?}");
        server.stop(Duration::from_secs(5)).await.unwrap();
    }
}

/// The error a frame whose size its layout rules out gets (not a hang-up, a timeout or a panic).
fn is_size_mismatch(e: &ClientError) -> bool {
    matches!(e, ClientError::Protocol(ProtoError::SizeMismatch { .. }))
}
