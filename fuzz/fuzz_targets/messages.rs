//! Data-plane and same-node messages from arbitrary bytes: every decoder refuses or returns a value
//! that encodes back to itself; none panics.
#![no_main]

use kvtier_proto::dataplane::{self, Hello, HelloReply, LeaseGrant, RequestHeader, ResponseHeader, SlotDescriptor};
use kvtier_proto::samenode::{self, LoadItem, Segment, SnOp, SnRequest, StoreItem};
use libfuzzer_sys::fuzz_target;

fn fixed<const N: usize>(data: &[u8]) -> Option<[u8; N]> {
    data.get(..N).and_then(|s| s.try_into().ok())
}

fuzz_target!(|data: &[u8]| {
    if let Some(raw) = fixed::<{ dataplane::REQUEST_HEADER_LEN }>(data) {
        if let Ok(r) = RequestHeader::decode(&raw) {
            assert_eq!(RequestHeader::decode(&r.encode()).ok(), Some(r));
        }
    }
    if let Some(raw) = fixed::<{ dataplane::RESPONSE_HEADER_LEN }>(data) {
        if let Ok(r) = ResponseHeader::decode(&raw) {
            assert_eq!(ResponseHeader::decode(&r.encode()).ok(), Some(r));
        }
    }
    if let Some(raw) = fixed::<{ dataplane::HELLO_LEN }>(data) {
        if let Ok(h) = Hello::decode(&raw) {
            let enc = Hello::encode(h.version, &vec![b'x'; h.token_len as usize]);
            let again: [u8; dataplane::HELLO_LEN] = enc[..dataplane::HELLO_LEN].try_into().unwrap();
            assert_eq!(Hello::decode(&again).ok(), Some(h));
        }
    }
    if let Some(raw) = fixed::<4>(data) {
        let _ = HelloReply::decode(&raw);
    }
    // A remote lease's grant: a slot that round-trips, whose range never wraps.
    if let Some(raw) = fixed::<{ dataplane::LEASE_GRANT_LEN }>(data) {
        if let Ok(g) = LeaseGrant::decode(&raw) {
            assert_eq!(LeaseGrant::decode(&g.encode()).ok(), Some(g));
            assert!(g.slot.addr.checked_add(g.slot.len).is_some());
        }
    }
    if let Ok(slot) = SlotDescriptor::decode(data) {
        assert_eq!(&slot.encode()[..], data);
    }
    if let Some(raw) = fixed::<{ samenode::REQUEST_LEN }>(data) {
        if let Ok(r) = SnRequest::decode(&raw) {
            assert_eq!(SnRequest::decode(&r.encode()).ok(), Some(r));
        }
    }
    if let Some(raw) = fixed::<{ samenode::HELLO_LEN }>(data) {
        let _ = samenode::decode_hello(&raw);
    }
    if let Ok(item) = LoadItem::decode(data) {
        let mut enc = Vec::new();
        item.encode_into(&mut enc);
        assert_eq!(LoadItem::decode(&enc).ok(), Some(item));
    }
    if let Ok((h, _)) = StoreItem::split(data) {
        assert_eq!(h.len(), kvtier_proto::FRAME_HEADER_LEN);
    }
    // A segmented request's items and table: counts within the caps, a table that round-trips.
    for op in [SnOp::LoadSegments, SnOp::StoreSegments] {
        if let Ok((counts, table_len)) = samenode::segment_counts(op, data) {
            assert!(counts.iter().all(|&n| n >= 1 && u64::from(n) <= samenode::MAX_SEGMENTS_PER_ITEM));
            assert_eq!(table_len, counts.iter().map(|&n| n as usize).sum::<usize>() * samenode::SEGMENT_LEN);
            assert!(table_len <= samenode::MAX_SEGMENTS_PER_REQUEST * samenode::SEGMENT_LEN);
        }
    }
    if let Ok(table) = Segment::decode_table(data) {
        let mut enc = Vec::new();
        table.iter().for_each(|s| s.encode_into(&mut enc));
        assert_eq!(enc, data);
    }
});
