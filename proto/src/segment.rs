//! The disk tier's segment format and its recovery scan, over any positional reader (the server's
//! files; a byte slice in the fuzz targets and tests). A segment is a sequence of block frames
//! (header + payload, as [`crate::BlockFrame`] encodes them), each starting on a 4 KiB boundary;
//! the space between a record's end and the next boundary is zeros.

use std::io;

use crate::{FrameHeader, FRAME_HEADER_LEN, FRAME_MAGIC};

/// Every record starts on a 4 KiB boundary (the page and NVMe sector size class).
pub const RECORD_ALIGN: u64 = 4096;

/// `n` rounded up to a record boundary.
pub fn align_up(n: u64) -> u64 {
    n.div_ceil(RECORD_ALIGN) * RECORD_ALIGN
}

/// One record as a segment holds it: the frame header, the payload, zeros up to the next
/// boundary.
pub fn encode_record(header: &FrameHeader, payload: &[u8]) -> Vec<u8> {
    let len = align_up(FRAME_HEADER_LEN as u64 + payload.len() as u64) as usize;
    let mut buf = Vec::with_capacity(len);
    buf.extend_from_slice(&header.encode());
    buf.extend_from_slice(payload);
    buf.resize(len, 0);
    buf
}

/// The offset of the first record header hidden in `payload`: a block frame header that decodes,
/// at a place a record could start (a 4 KiB boundary of the segment, the record itself starting on
/// one). The recovery scan, after a damaged header, looks for the next record at those boundaries;
/// a payload carrying a valid frame there — a tenant's bytes crafted to look like another
/// namespace's block — could then be taken for a record. Such payloads are refused at write: real
/// KV bytes decode as a header (magic, version, flags and a 64-bit checksum) with probability
/// about 2^-96. Costs one 4-byte compare per 4 KiB of payload.
pub fn hidden_header(payload: &[u8]) -> Option<usize> {
    let first = RECORD_ALIGN as usize - FRAME_HEADER_LEN;
    (first..payload.len()).step_by(RECORD_ALIGN as usize).filter(|&at| payload.len() - at >= FRAME_HEADER_LEN).find(
        |&at| payload[at..at + 4] == FRAME_MAGIC && FrameHeader::decode(&payload[at..at + FRAME_HEADER_LEN]).is_ok(),
    )
}

/// What the scan reads a segment through.
pub trait SegmentBytes {
    /// The segment's length in bytes.
    fn size(&self) -> io::Result<u64>;
    /// Fills `buf` from `offset` (an error if the segment ends first).
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
}

impl SegmentBytes for [u8] {
    fn size(&self) -> io::Result<u64> {
        Ok(self.len() as u64)
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let start = usize::try_from(offset).map_err(|_| io::ErrorKind::UnexpectedEof)?;
        let src =
            start.checked_add(buf.len()).and_then(|end| self.get(start..end)).ok_or(io::ErrorKind::UnexpectedEof)?;
        buf.copy_from_slice(src);
        Ok(())
    }
}

/// What the recovery scan of one segment found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct SegmentScan {
    /// Offset and header of every verified record, in file order.
    pub records: Vec<(u64, FrameHeader)>,
    /// Length after the last complete record: the caller truncates the file to it.
    pub valid_len: u64,
    /// Records dropped: torn (cut short) or failing their checksums; a run of unreadable
    /// boundaries counts once.
    pub discarded: u64,
}

/// Reads a segment front to back, verifying every record.
///
/// A record that fails its checks costs only itself: a damaged header (the header carries its own
/// checksum) means the record's length can't be trusted, so the scan moves to the next 4 KiB
/// boundary and looks for a valid header there, and so on; a damaged payload is skipped by the
/// length its valid header gives. Zeros are unwritten space. A run of unreadable boundaries is
/// counted once.
pub fn scan_segment<R: SegmentBytes + ?Sized>(file: &R) -> io::Result<SegmentScan> {
    let file_len = file.size()?;
    let mut out = SegmentScan::default();
    let mut offset = 0u64;
    let mut header = [0u8; FRAME_HEADER_LEN];
    let mut payload = Vec::new();
    // Inside a stretch of boundaries that hold no valid header (counted when it starts).
    let mut lost = false;
    while offset + FRAME_HEADER_LEN as u64 <= file_len {
        file.read_exact_at(&mut header, offset)?;
        let Ok(h) = FrameHeader::decode(&header) else {
            if !lost && header.iter().any(|&b| b != 0) {
                out.discarded += 1;
                lost = true;
            }
            offset += RECORD_ALIGN;
            continue;
        };
        let end = (offset + FRAME_HEADER_LEN as u64).saturating_add(h.payload_len);
        if end > file_len {
            // Cut short by a crash mid-write (the caller truncates the tail).
            if !lost {
                out.discarded += 1;
            }
            break;
        }
        lost = false;
        payload.resize(h.payload_len as usize, 0);
        file.read_exact_at(&mut payload, offset + FRAME_HEADER_LEN as u64)?;
        if h.verify_payload(&payload).is_ok() {
            out.records.push((offset, h));
        } else {
            out.discarded += 1;
        }
        let next = align_up(end);
        out.valid_len = next.min(file_len.max(end));
        offset = next;
    }
    Ok(out)
}
