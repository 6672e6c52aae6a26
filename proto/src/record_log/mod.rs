//! The on-disk framing of kvtier's metadata logs (`sessions.log`, `namespaces.log`, appended to;
//! `owed_deletes.log`, `peer_hints.log`, rewritten whole) and their recovery scan, as pure functions over bytes (the server reads and writes the files;
//! the fuzz targets feed these functions arbitrary bytes).
//!
//! A log file starts with a header: two identical copies of (magic, format version, which log,
//! a 32-byte secret drawn from the OS when the file was written, a checksum of the copy). One
//! damaged copy costs nothing. Then records, each `RECORD_MAGIC`, the body's length (u32 LE), a
//! 16-byte tag — `blake3::keyed_hash(secret, magic ‖ length ‖ body)` truncated — and the body.
//!
//! Why a keyed tag: bodies hold tenant-controlled bytes (namespace specs, session ids,
//! manifests). After a torn or damaged record the scan resynchronizes by looking for the next
//! magic whose record verifies; with a plain checksum, a tenant could plant a whole valid record
//! (another tenant's namespace unregistered, a session dropped) inside its own record's body, and
//! the scan would land in it. The secret never leaves the server, so no planted record verifies
//! (a forgery succeeds with probability 2^-128 per try).

use crate::ProtoError;

pub mod deletes;
pub mod hints;
pub mod namespaces;
pub mod sessions;

/// The current format (the first one, with no header and an xxh3 checksum per record, is read
/// by the server's migration only).
pub const LOG_FORMAT_VERSION: u16 = 2;
/// Begins each copy of a log file's header.
pub const LOG_HEADER_MAGIC: [u8; 8] = *b"kvtlog\0\0";
/// One copy: magic, version (u16 LE), kind (u16 LE), secret, first 8 bytes of BLAKE3 of the rest.
const HEADER_COPY_LEN: usize = 8 + 2 + 2 + 32 + 8;
/// Bytes before the first record.
pub const LOG_HEADER_LEN: usize = 2 * HEADER_COPY_LEN;
/// Begins every record.
pub const RECORD_MAGIC: [u8; 4] = *b"KVLR";
/// Bytes of a record's tag (the keyed BLAKE3, truncated).
pub const RECORD_TAG_LEN: usize = 16;
/// Magic, body length, tag.
pub const RECORD_HEADER_LEN: usize = 4 + 4 + RECORD_TAG_LEN;

/// Which log a file is (a file of one kind is never read as the other).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum LogKind {
    Sessions = 1,
    Namespaces = 2,
    OwedDeletes = 3,
    PeerHints = 4,
}

/// A log file's secret: what its records' tags are keyed with.
#[derive(Clone, PartialEq, Eq)]
pub struct LogKey(pub [u8; 32]);

impl std::fmt::Debug for LogKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LogKey(..)")
    }
}

/// A file header with the secret `key`.
pub fn encode_log_header(kind: LogKind, key: &LogKey) -> Vec<u8> {
    let mut copy = Vec::with_capacity(HEADER_COPY_LEN);
    copy.extend_from_slice(&LOG_HEADER_MAGIC);
    copy.extend_from_slice(&LOG_FORMAT_VERSION.to_le_bytes());
    copy.extend_from_slice(&(kind as u16).to_le_bytes());
    copy.extend_from_slice(&key.0);
    let sum = blake3::hash(&copy);
    copy.extend_from_slice(&sum.as_bytes()[..8]);
    let mut out = copy.clone();
    out.extend_from_slice(&copy);
    out
}

/// What a log file's first bytes say.
#[derive(Debug, PartialEq, Eq)]
pub enum LogHeader {
    /// A current-format file: its secret.
    Keyed(LogKey),
    /// No header: empty, or written by the first format.
    Legacy,
}

/// Reads the header of a file of `kind`. An error when a header is there but no copy verifies
/// (the secret is lost: no record can be trusted), or it names another version or log.
pub fn read_log_header(kind: LogKind, file: &[u8]) -> Result<LogHeader, ProtoError> {
    let copies = [file.get(..HEADER_COPY_LEN), file.get(HEADER_COPY_LEN..LOG_HEADER_LEN)];
    let mut seen = false;
    for copy in copies.into_iter().flatten() {
        if copy[..8] != LOG_HEADER_MAGIC {
            continue;
        }
        seen = true;
        let body = &copy[..HEADER_COPY_LEN - 8];
        if blake3::hash(body).as_bytes()[..8] != copy[HEADER_COPY_LEN - 8..] {
            continue;
        }
        let version = u16::from_le_bytes([copy[8], copy[9]]);
        if version != LOG_FORMAT_VERSION {
            return Err(ProtoError::LogHeader(format!(
                "format version {version}, this build reads {LOG_FORMAT_VERSION}"
            )));
        }
        let got = u16::from_le_bytes([copy[10], copy[11]]);
        if got != kind as u16 {
            return Err(ProtoError::LogHeader(format!("a log of kind {got}, expected {}", kind as u16)));
        }
        let mut key = [0u8; 32];
        key.copy_from_slice(&copy[12..44]);
        return Ok(LogHeader::Keyed(LogKey(key)));
    }
    // A header cut short (never written so: headers are written whole, synced and renamed into
    // place) is damaged too. A first-format file never starts with the magic: its first word
    // would be a record length above 1 GiB.
    if seen || file.starts_with(&LOG_HEADER_MAGIC) {
        return Err(ProtoError::LogHeader("damaged header: no copy verifies".into()));
    }
    Ok(LogHeader::Legacy)
}

fn tag(key: &LogKey, len: u32, body: &[u8]) -> [u8; RECORD_TAG_LEN] {
    let mut h = blake3::Hasher::new_keyed(&key.0);
    h.update(&RECORD_MAGIC);
    h.update(&len.to_le_bytes());
    h.update(body);
    let mut t = [0u8; RECORD_TAG_LEN];
    t.copy_from_slice(&h.finalize().as_bytes()[..RECORD_TAG_LEN]);
    t
}

/// One framed record (`body` must be under 4 GiB; the logs' bodies are far smaller).
pub fn encode_record(key: &LogKey, body: &[u8]) -> Vec<u8> {
    let len = body.len() as u32;
    let mut rec = Vec::with_capacity(RECORD_HEADER_LEN + body.len());
    rec.extend_from_slice(&RECORD_MAGIC);
    rec.extend_from_slice(&len.to_le_bytes());
    rec.extend_from_slice(&tag(key, len, body));
    rec.extend_from_slice(body);
    rec
}

/// The body of the whole, verified record at `at` and where the next one starts.
pub fn record_at<'a>(data: &'a [u8], at: usize, key: &LogKey, max_body: usize) -> Option<(&'a [u8], usize)> {
    let head = data.get(at..at.checked_add(RECORD_HEADER_LEN)?)?;
    if head[..4] != RECORD_MAGIC {
        return None;
    }
    let len = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
    if len as usize > max_body {
        return None;
    }
    let start = at + RECORD_HEADER_LEN;
    let end = start.checked_add(len as usize)?;
    let body = data.get(start..end)?;
    (tag(key, len, body)[..] == head[8..]).then_some((body, end))
}

/// What a scan of a log's records found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct LogScan<'a> {
    /// (offset in the scanned bytes, body) of every verified record, in file order.
    pub records: Vec<(usize, &'a [u8])>,
    /// Damaged stretches skipped: torn or corrupt records, several in a row counted once.
    pub skipped: u64,
}

/// Scans `data` (the bytes after the header) for records keyed with `key`. A record that does not
/// verify costs itself only: the scan goes on at the next magic that starts a verified record.
pub fn scan_records<'a>(data: &'a [u8], key: &LogKey, max_body: usize) -> LogScan<'a> {
    let mut out = LogScan::default();
    let mut at = 0usize;
    let mut damaged = false;
    while at < data.len() {
        if let Some((body, next)) = record_at(data, at, key, max_body) {
            out.records.push((at, body));
            at = next;
            damaged = false;
            continue;
        }
        if !damaged {
            out.skipped += 1;
            damaged = true;
        }
        match find_magic(data, at + 1) {
            Some(i) => at = i,
            None => break,
        }
    }
    out
}

fn find_magic(data: &[u8], from: usize) -> Option<usize> {
    data.get(from..)?.windows(RECORD_MAGIC.len()).position(|w| w == RECORD_MAGIC).map(|i| from + i)
}

/// A whole log file read: its secret and records, or `Legacy` (no header) for the caller's
/// first-format reader.
#[derive(Debug, PartialEq, Eq)]
pub enum LogContents<'a> {
    Keyed { key: LogKey, scan: LogScan<'a> },
    Legacy,
}

/// Reads a log file of `kind`: the header, then every verified record (offsets are from the start
/// of the file).
pub fn read_log(kind: LogKind, file: &[u8], max_body: usize) -> Result<LogContents<'_>, ProtoError> {
    match read_log_header(kind, file)? {
        LogHeader::Legacy => Ok(LogContents::Legacy),
        LogHeader::Keyed(key) => {
            let data = file.get(LOG_HEADER_LEN..).unwrap_or_default();
            let mut scan = scan_records(data, &key, max_body);
            for r in &mut scan.records {
                r.0 += LOG_HEADER_LEN;
            }
            Ok(LogContents::Keyed { key, scan })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: LogKey = LogKey([5; 32]);

    fn file(bodies: &[&[u8]]) -> Vec<u8> {
        let mut f = encode_log_header(LogKind::Sessions, &KEY);
        for b in bodies {
            f.extend(encode_record(&KEY, b));
        }
        f
    }

    fn bodies(c: &LogContents<'_>) -> Vec<Vec<u8>> {
        match c {
            LogContents::Keyed { scan, .. } => scan.records.iter().map(|r| r.1.to_vec()).collect(),
            LogContents::Legacy => panic!("legacy"),
        }
    }

    #[test]
    fn records_round_trip_and_a_damaged_one_costs_itself() {
        let f = file(&[b"one", b"two", b"three"]);
        let c = read_log(LogKind::Sessions, &f, 1 << 20).unwrap();
        assert_eq!(bodies(&c), [b"one".to_vec(), b"two".to_vec(), b"three".to_vec()]);
        let mut bad = f.clone();
        bad[LOG_HEADER_LEN + RECORD_HEADER_LEN + 3 + RECORD_HEADER_LEN] ^= 1; // "two"'s body
        let c = read_log(LogKind::Sessions, &bad, 1 << 20).unwrap();
        assert_eq!(bodies(&c), [b"one".to_vec(), b"three".to_vec()]);
        let LogContents::Keyed { scan, .. } = c else { unreachable!() };
        assert_eq!(scan.skipped, 1);
    }

    #[test]
    fn a_record_keyed_with_another_secret_never_verifies() {
        let planted = encode_record(&LogKey([6; 32]), b"drop B");
        let mut body = b"A's bytes ".to_vec();
        body.extend(&planted);
        let mut f = file(&[b"before"]);
        let torn = encode_record(&KEY, &body);
        // The record holding the planted one torn at its tag: the scan resynchronizes inside it.
        let mut t = torn.clone();
        t[10] ^= 0xff;
        f.extend(t);
        let c = read_log(LogKind::Sessions, &f, 1 << 20).unwrap();
        assert_eq!(bodies(&c), [b"before".to_vec()]);
    }

    #[test]
    fn one_damaged_header_copy_costs_nothing_both_refuse_the_file() {
        let mut f = file(&[b"x"]);
        f[20] ^= 1;
        assert_eq!(bodies(&read_log(LogKind::Sessions, &f, 64).unwrap()), [b"x".to_vec()]);
        f[HEADER_COPY_LEN + 20] ^= 1;
        assert!(matches!(read_log(LogKind::Sessions, &f, 64), Err(ProtoError::LogHeader(_))));
        assert!(read_log(LogKind::Namespaces, &file(&[]), 64).is_err(), "the other log's file");
        assert_eq!(read_log(LogKind::Sessions, &[], 64).unwrap(), LogContents::Legacy);
        assert_eq!(read_log(LogKind::Sessions, &[1, 0, 0, 0, 9, 9], 64).unwrap(), LogContents::Legacy);
    }

    /// Found by the `logs` fuzz target: a file ending inside the header's second copy (the first
    /// verifies) reads as keyed, with no records and nothing skipped.
    #[test]
    fn a_file_ending_in_the_second_header_copy_has_no_records() {
        let f = file(&[b"x"]);
        for len in [HEADER_COPY_LEN, HEADER_COPY_LEN + 1, LOG_HEADER_LEN - 1] {
            let c = read_log(LogKind::Sessions, &f[..len], 64).unwrap();
            assert_eq!(c, LogContents::Keyed { key: KEY, scan: LogScan::default() });
        }
    }
}
