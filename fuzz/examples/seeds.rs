//! Writes a seed corpus for each fuzz target into `fuzz/corpus/<target>/`: valid encodings the
//! fuzzer mutates from (a frame past its checksum, every request header, a payload of every codec),
//! so that it starts beyond the magic numbers and checksums. `bash scripts/test fuzz` runs it first.

use std::path::Path;

use bytes::Bytes;
use kvtier_kernels::{encode, BlockSpec, KvBlockView};
use kvtier_proto::dataplane::{Hello, Op, RequestHeader};
use kvtier_proto::{BlockFrame, BlockKey, CodecId, DType, KvLayout, NamespaceId};

fn write(target: &str, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus").join(target);
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join(name), bytes)
}

fn main() -> std::io::Result<()> {
    for len in [0usize, 16, 4096] {
        let payload: Vec<u8> = (0..len).map(|i| (i * 31) as u8).collect();
        let layout = KvLayout::opaque(len.max(1) as u64, DType::Fp16, 16);
        let f = BlockFrame::new(NamespaceId([7; 16]), BlockKey([9; 32]), layout, CodecId::RAW, 1, Bytes::from(payload));
        write("frame", &format!("frame-{len}"), &f.to_bytes())?;
    }
    for (i, op) in [Op::Put, Op::Get, Op::Exists, Op::Release].into_iter().enumerate() {
        let h = RequestHeader { op, flags: 0, request_id: 1, count: 3, namespace: NamespaceId([1; 16]) };
        write("messages", &format!("request-{i}"), &h.encode())?;
    }
    write("messages", "hello", &Hello::encode(1, b"a-token-of-sixteen-bytes"))?;
    for (di, dtype) in [DType::Fp16, DType::Bf16, DType::Fp32].into_iter().enumerate() {
        let spec = BlockSpec::new(2, 16, 2, 64, dtype);
        let raw: Vec<u8> = match dtype {
            DType::Fp32 => (0..spec.elements()).flat_map(|i| ((i % 97) as f32 * 0.01 - 0.4).to_le_bytes()).collect(),
            _ => (0..spec.elements()).flat_map(|i| (0x3800u16 + (i % 509) as u16).to_le_bytes()).collect(),
        };
        let view = KvBlockView::new(spec, &raw).map_err(std::io::Error::other)?;
        for codec in (0u16..).map(CodecId).take_while(|c| c.is_known()) {
            if let Ok(p) = encode(codec, &view) {
                // The target's first two bytes pick the dtype and head_dim (64 is index 1).
                let mut seed = vec![di as u8, 1];
                seed.extend_from_slice(&p);
                write("codec_payload", &format!("{}-{di}", codec.0), &seed)?;
            }
        }
    }
    Ok(())
}
