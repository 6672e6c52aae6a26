//! Block frames from arbitrary bytes: a header the decoder accepts encodes back to itself, and a
//! frame that decodes verifies against its own checksum.
#![no_main]

use bytes::Bytes;
use kvtier_proto::{BlockFrame, FrameHeader};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = FrameHeader::decode(data) {
        assert_eq!(FrameHeader::decode(&h.encode()).ok(), Some(h), "a header that decodes must round-trip");
    }
    if let Ok(f) = BlockFrame::decode(Bytes::copy_from_slice(data)) {
        assert!(f.header.verify_payload(&f.payload).is_ok(), "a decoded frame must verify");
    }
});
