//! Codec payloads from arbitrary bytes, as a disk segment or a peer could hand them over: the
//! payload header is inspected and every codec's decoder is run against a small block spec; a bad
//! payload is an error, never a panic or an out-of-bounds access, and a decoded block has the
//! spec's size.
#![no_main]

use kvtier_kernels::{decode, inspect, BlockSpec};
use kvtier_proto::{CodecId, DType};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = inspect(data);
    if data.len() < 2 {
        return;
    }
    // The first bytes pick the spec; the rest is the payload.
    let dtype = [DType::Fp16, DType::Bf16, DType::Fp32][data[0] as usize % 3];
    let head_dim = [16u16, 64, 128][data[1] as usize % 3];
    let spec = BlockSpec::new(2, 16, 2, head_dim, dtype);
    let payload = &data[2..];
    for codec in (0u16..).map(CodecId).take_while(|c| c.is_known()) {
        if let Ok(out) = decode(codec, payload, &spec) {
            assert_eq!(out.len(), spec.byte_len(), "{codec:?} decoded to the wrong size");
        }
    }
});
