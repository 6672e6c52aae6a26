//! Segment files: naming, record alignment and the recovery scan.

use std::io::Read;
use std::path::{Path, PathBuf};

use kvtier_proto::{FrameHeader, FRAME_HEADER_LEN};

/// Every record starts on a 4 KiB boundary (the page and NVMe sector size class).
pub(super) const RECORD_ALIGN: u64 = 4096;

pub(super) fn align_up(n: u64) -> u64 {
    n.div_ceil(RECORD_ALIGN) * RECORD_ALIGN
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
}

/// Reads a segment front to back, verifying every record, and truncates a torn tail.
pub(super) fn scan_segment(path: &Path) -> std::io::Result<Scanned> {
    let file = std::fs::OpenOptions::new().read(true).write(true).open(path)?;
    let file_len = file.metadata()?.len();
    let mut rd = std::io::BufReader::with_capacity(4 << 20, &file);
    let mut out = Scanned { records: Vec::new(), valid_len: 0, discarded: 0 };
    let mut offset = 0u64;
    let mut header = [0u8; FRAME_HEADER_LEN];
    let mut payload = Vec::new();
    while offset + FRAME_HEADER_LEN as u64 <= file_len {
        rd.read_exact(&mut header)?;
        let h = match FrameHeader::decode(&header) {
            Ok(h) => h,
            Err(_) => {
                // Zeros are unwritten space; anything else is a torn or corrupt header, after
                // which record boundaries can't be trusted.
                if header.iter().any(|&b| b != 0) {
                    out.discarded += 1;
                }
                break;
            }
        };
        let end = offset + FRAME_HEADER_LEN as u64 + h.payload_len;
        if end > file_len {
            out.discarded += 1; // cut short by a crash mid-write
            break;
        }
        payload.resize(h.payload_len as usize, 0);
        rd.read_exact(&mut payload)?;
        if h.verify_payload(&payload).is_ok() {
            out.records.push((offset, h));
        } else {
            out.discarded += 1;
        }
        let next = super::align_up(end);
        out.valid_len = next.min(file_len.max(end));
        // Skip the padding.
        let pad = next.saturating_sub(end).min(file_len.saturating_sub(end));
        std::io::copy(&mut (&mut rd).take(pad), &mut std::io::sink())?;
        offset = next;
    }
    drop(rd);
    if out.valid_len < file_len {
        file.set_len(out.valid_len)?;
    }
    Ok(out)
}
