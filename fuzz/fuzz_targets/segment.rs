//! The disk tier's recovery scan of a segment (`kvtier_proto::segment::scan_segment`, exactly what
//! the server runs on every segment file at start) over arbitrary bytes. Beyond not panicking:
//! every record it returns starts on a boundary, lies inside the file, decodes to the header it
//! reports and verifies against its checksum; records never overlap; records plus discarded
//! stretches never outnumber the boundaries; the file cut to `valid_len` scans to the same records.
#![no_main]

use kvtier_proto::segment::{align_up, scan_segment, RECORD_ALIGN};
use kvtier_proto::{FrameHeader, FRAME_HEADER_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let scan = scan_segment(data).expect("reading a byte slice in bounds never fails");
    let len = data.len() as u64;
    assert!(scan.valid_len <= len, "valid_len {} past the end {len}", scan.valid_len);
    assert!(
        scan.records.len() as u64 + scan.discarded <= len.div_ceil(RECORD_ALIGN),
        "{} records and {} discarded in {} boundaries",
        scan.records.len(),
        scan.discarded,
        len.div_ceil(RECORD_ALIGN)
    );
    let mut free_from = 0u64;
    for (offset, h) in &scan.records {
        assert_eq!(offset % RECORD_ALIGN, 0, "a record off a boundary");
        assert!(*offset >= free_from, "records overlap");
        let start = (offset + FRAME_HEADER_LEN as u64) as usize;
        let end = start as u64 + h.payload_len;
        assert!(end <= len && end <= scan.valid_len, "a record past the end");
        let at = &data[*offset as usize..start];
        assert_eq!(FrameHeader::decode(at).ok().as_ref(), Some(h), "the header is not the file's");
        assert_eq!(FrameHeader::decode(&h.encode()).ok().as_ref(), Some(h), "the header does not round-trip");
        assert!(h.verify_payload(&data[start..end as usize]).is_ok(), "a returned record does not verify");
        free_from = align_up(end);
    }
    let again = scan_segment(&data[..scan.valid_len as usize]).expect("in bounds");
    assert_eq!(again.records, scan.records, "truncating to valid_len changed the records");
});
