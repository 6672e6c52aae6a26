//! Fuzzing of every wire decoder with proptest (bounded cases, run by `cargo test`): arbitrary
//! bytes and single-byte damage to valid encodings. A decoder must never panic, a damaged frame
//! header or frame must never decode (every byte is covered by a checksum), and whatever a
//! header decoder accepts must encode back to a value that decodes to itself.

use bytes::Bytes;
use kvtier_proto::dataplane::{self, Hello, RequestHeader, ResponseHeader};
use kvtier_proto::samenode::{self, LoadItem, SnRequest, StoreItem};
use kvtier_proto::{BlockFrame, BlockKey, CodecId, DType, FrameHeader, KvLayout, NamespaceId, FRAME_HEADER_LEN};
use proptest::prelude::*;

fn frame(seed: u8, len: usize) -> BlockFrame {
    let layout = KvLayout::opaque(len as u64, DType::Fp16, 16);
    let payload: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
    BlockFrame::new(NamespaceId([seed; 16]), BlockKey([seed ^ 0x5A; 32]), layout, CodecId::RAW, 1, Bytes::from(payload))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    #[test]
    fn a_frame_header_with_any_byte_changed_never_decodes(seed: u8, at in 0usize..FRAME_HEADER_LEN, mask in 1u8..=255) {
        let mut h = frame(seed, 4096).header.encode();
        prop_assert!(FrameHeader::decode(&h).is_ok());
        h[at] ^= mask;
        prop_assert!(FrameHeader::decode(&h).is_err(), "byte {} changed and the header still decoded", at);
    }

    #[test]
    fn a_frame_with_any_byte_changed_or_cut_never_decodes(seed: u8, at in 0usize..(FRAME_HEADER_LEN + 512), mask in 1u8..=255, cut: bool) {
        let mut raw = frame(seed, 512).to_bytes().to_vec();
        if cut { raw.truncate(at) } else { raw[at] ^= mask }
        prop_assert!(BlockFrame::decode(Bytes::from(raw)).is_err());
    }

    #[test]
    fn arbitrary_bytes_are_refused_or_decode_to_a_stable_header(raw in proptest::collection::vec(any::<u8>(), 0..300)) {
        if let Ok(h) = FrameHeader::decode(&raw) {
            prop_assert_eq!(FrameHeader::decode(&h.encode()).ok(), Some(h));
        }
        let _ = BlockFrame::decode(Bytes::from(raw));
    }

    #[test]
    fn data_plane_headers_decode_to_values_that_round_trip(raw in proptest::array::uniform32(any::<u8>()), resp in proptest::array::uniform16(any::<u8>()), hello in proptest::array::uniform8(any::<u8>())) {
        if let Ok(r) = RequestHeader::decode(&raw) {
            prop_assert_eq!(RequestHeader::decode(&r.encode()).ok(), Some(r));
        }
        if let Ok(r) = ResponseHeader::decode(&resp) {
            prop_assert_eq!(ResponseHeader::decode(&r.encode()).ok(), Some(r));
        }
        if let Ok(h) = Hello::decode(&hello) {
            let token = vec![b'x'; h.token_len as usize];
            let enc = Hello::encode(h.version, &token);
            let fixed: [u8; dataplane::HELLO_LEN] = enc[..dataplane::HELLO_LEN].try_into().unwrap();
            prop_assert_eq!(Hello::decode(&fixed).ok(), Some(h));
        }
        let short: [u8; 4] = resp[..4].try_into().unwrap();
        let _ = dataplane::HelloReply::decode(&short);
    }

    #[test]
    fn same_node_messages_decode_to_values_that_round_trip(raw in proptest::array::uniform32(any::<u8>()), body in proptest::collection::vec(any::<u8>(), 0..200)) {
        if let Ok(r) = SnRequest::decode(&raw) {
            prop_assert_eq!(SnRequest::decode(&r.encode()).ok(), Some(r));
        }
        let hello: [u8; samenode::HELLO_LEN] = raw[..samenode::HELLO_LEN].try_into().unwrap();
        let _ = samenode::decode_hello(&hello);
        if let Ok(item) = LoadItem::decode(&body) {
            let mut enc = Vec::new();
            item.encode_into(&mut enc);
            prop_assert_eq!(LoadItem::decode(&enc).ok(), Some(item));
        }
        if let Ok((h, _offset)) = StoreItem::split(&body) {
            prop_assert_eq!(h.len(), FRAME_HEADER_LEN);
        }
    }
}

#[test]
fn the_fuzzed_frames_are_valid_to_begin_with() {
    // The properties above damage valid frames: make sure they are.
    for seed in [0u8, 7, 255] {
        let f = frame(seed, 512);
        assert_eq!(BlockFrame::decode(f.to_bytes()).unwrap(), f);
    }
    assert!(KvLayout::new(1, 1, 16, DType::Fp16, 16).validate().is_ok());
}
