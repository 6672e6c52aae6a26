//! Segment files: naming, and the recovery scan run on a real file. The format itself (record
//! alignment, the scan, the hidden-header guard) is `kvtier_proto::segment`, shared with the fuzz
//! target that feeds it arbitrary bytes.

use std::path::{Path, PathBuf};

use kvtier_proto::segment::SegmentBytes;
pub(super) use kvtier_proto::segment::{align_up, hidden_header, RECORD_ALIGN};
use kvtier_proto::FrameHeader;

use crate::fs::FsFile;

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

/// An open segment file as the scan reads it.
struct FileBytes<'a>(&'a dyn FsFile);

impl SegmentBytes for FileBytes<'_> {
    fn size(&self) -> std::io::Result<u64> {
        self.0.size()
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.0.read_exact_at(buf, offset)
    }
}

/// Scans a segment ([`kvtier_proto::segment::scan_segment`]) and truncates a torn tail.
pub(super) fn scan_segment(file: &dyn FsFile) -> std::io::Result<Scanned> {
    let file_len = file.size()?;
    let scan = kvtier_proto::segment::scan_segment(&FileBytes(file))?;
    let mut out =
        Scanned { records: scan.records, valid_len: scan.valid_len, discarded: scan.discarded, truncated: false };
    if out.valid_len < file_len {
        file.set_len(out.valid_len)?;
        out.truncated = true;
    }
    Ok(out)
}
