//! Segment files: naming, record alignment and the recovery scan.

use std::path::{Path, PathBuf};

use kvtier_proto::{FrameHeader, FRAME_HEADER_LEN};

use crate::fs::FsFile;

/// Every record starts on a 4 KiB boundary (the page and NVMe sector size class).
pub(super) const RECORD_ALIGN: u64 = 4096;

pub(super) fn align_up(n: u64) -> u64 {
    n.div_ceil(RECORD_ALIGN) * RECORD_ALIGN
}

/// The offset of the first record header hidden in `payload`: a block frame header that decodes,
/// at a place a record could start (a 4 KiB boundary of the segment, the record itself starting on
/// one). The recovery scan, after a damaged header, looks for the next record at those boundaries;
/// a payload carrying a valid frame there — a tenant's bytes crafted to look like another
/// namespace's block — could then be taken for a record. Such payloads are refused at write: real
/// KV bytes decode as a header (magic, version, flags and a 64-bit checksum) with probability
/// about 2^-96. Costs one 4-byte compare per 4 KiB of payload.
pub(super) fn hidden_header(payload: &[u8]) -> Option<usize> {
    let first = RECORD_ALIGN as usize - FRAME_HEADER_LEN;
    (first..payload.len()).step_by(RECORD_ALIGN as usize).filter(|&at| payload.len() - at >= FRAME_HEADER_LEN).find(
        |&at| {
            payload[at..at + 4] == kvtier_proto::FRAME_MAGIC
                && FrameHeader::decode(&payload[at..at + FRAME_HEADER_LEN]).is_ok()
        },
    )
}

pub(super) fn segment_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("seg-{id:010}.kvs"))
}

pub(super) struct Scanned {
    /// Offset and header of every verified record.
    pub records: Vec<(u64, FrameHeader)>,
    /// Length after the last complete record; the file is truncated to it.
    pub valid_len: u64,
    /// Records dropped: torn (cut short) or failing their checksums.
    pub discarded: u64,
    /// The file was cut to `valid_len` (not synced yet).
    pub truncated: bool,
}

/// Reads a segment front to back, verifying every record, and truncates a torn tail.
///
/// A record that fails its checks costs only itself: a damaged header (the header carries its own
/// checksum) means the record's length can't be trusted, so the scan moves to the next 4 KiB
/// boundary and looks for a valid header there, and so on; a damaged payload is skipped by the
/// length its valid header gives. Zeros are unwritten space. A run of unreadable boundaries is
/// counted once.
pub(super) fn scan_segment(file: &dyn FsFile) -> std::io::Result<Scanned> {
    let file_len = file.size()?;
    let mut out = Scanned { records: Vec::new(), valid_len: 0, discarded: 0, truncated: false };
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
        let end = offset + FRAME_HEADER_LEN as u64 + h.payload_len;
        if end > file_len {
            // Cut short by a crash mid-write (the tail is truncated below).
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
    if out.valid_len < file_len {
        file.set_len(out.valid_len)?;
        out.truncated = true;
    }
    Ok(out)
}
