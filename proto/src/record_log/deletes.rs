//! The records of `owed_deletes.log`: the namespace deletes (purges, unregistrations) a node
//! owes members it could not reach — the member's id, what, when it was asked (unix ms) and the
//! namespace's protobuf `NamespaceSpec` — as bodies of [`super`]'s keyed records. The server
//! rewrites the whole file, atomically, whenever what it owes changes (rarely, and at most a
//! thousand entries), so the file is never more than what is owed now.

use crate::ProtoError;

use super::{read_log, LogContents, LogKind};

/// A body's first byte: a purge is owed.
pub const PURGE: u8 = 0;
/// A body's first byte: an unregistration is owed.
pub const UNREGISTER: u8 = 1;
/// Largest record body replay believes (a member id is at most 256 bytes, a `NamespaceSpec` well
/// under a KiB).
pub const MAX_RECORD: usize = 64 << 10;

/// One delete owed to one member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwedDeleteRecord<'a> {
    /// The member's node id.
    pub member: &'a str,
    /// [`PURGE`] or [`UNREGISTER`].
    pub what: u8,
    /// When the delete was asked, in milliseconds since the Unix epoch.
    pub asked_unix_ms: u64,
    /// The namespace's protobuf `NamespaceSpec` (the server decodes it).
    pub spec: &'a [u8],
}

impl<'a> OwedDeleteRecord<'a> {
    /// The record's body: what (1 byte), asked (u64 LE), the member id's length (u16 LE), the id,
    /// the spec.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(11 + self.member.len() + self.spec.len());
        b.push(self.what);
        b.extend_from_slice(&self.asked_unix_ms.to_le_bytes());
        b.extend_from_slice(&(self.member.len() as u16).to_le_bytes());
        b.extend_from_slice(self.member.as_bytes());
        b.extend_from_slice(self.spec);
        b
    }

    /// A record from its body; `None` for a kind this build does not know, a length that does not
    /// add up or a member id that is not UTF-8.
    pub fn decode(body: &'a [u8]) -> Option<OwedDeleteRecord<'a>> {
        let (&what, rest) = body.split_first()?;
        if what != PURGE && what != UNREGISTER {
            return None;
        }
        let asked_unix_ms = u64::from_le_bytes(rest.get(..8)?.try_into().ok()?);
        let len = u16::from_le_bytes(rest.get(8..10)?.try_into().ok()?) as usize;
        let member = std::str::from_utf8(rest.get(10..10 + len)?).ok()?;
        Some(OwedDeleteRecord { member, what, asked_unix_ms, spec: &rest[10 + len..] })
    }
}

/// The records of `owed_deletes.log` and the damaged stretches skipped. An empty or missing file
/// owes nothing; a file without a header is refused (this log has only ever had the keyed format).
pub fn read_owed_deletes_log(file: &[u8]) -> Result<(Vec<OwedDeleteRecord<'_>>, u64), ProtoError> {
    if file.is_empty() {
        return Ok((Vec::new(), 0));
    }
    let LogContents::Keyed { scan, .. } = read_log(LogKind::OwedDeletes, file, MAX_RECORD)? else {
        return Err(ProtoError::LogHeader("no header: not an owed-deletes log".into()));
    };
    let mut out = Vec::with_capacity(scan.records.len());
    let mut skipped = scan.skipped;
    for (_, body) in scan.records {
        match OwedDeleteRecord::decode(body) {
            Some(r) => out.push(r),
            None => skipped += 1,
        }
    }
    Ok((out, skipped))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record_log::{encode_log_header, encode_record, LogKey};

    const KEY: LogKey = LogKey([3; 32]);

    fn record(member: &str) -> OwedDeleteRecord<'_> {
        OwedDeleteRecord { member, what: UNREGISTER, asked_unix_ms: 1_700_000_000_123, spec: b"spec bytes" }
    }

    #[test]
    fn records_round_trip_and_bodies_that_do_not_add_up_are_refused() {
        let r = record("node-a");
        assert_eq!(OwedDeleteRecord::decode(&r.encode()), Some(r.clone()));
        let empty = OwedDeleteRecord { member: "", what: PURGE, asked_unix_ms: 0, spec: b"" };
        assert_eq!(OwedDeleteRecord::decode(&empty.encode()), Some(empty));
        let body = r.encode();
        assert_eq!(OwedDeleteRecord::decode(&body[..10]), None, "cut inside the id's length");
        assert_eq!(OwedDeleteRecord::decode(&body[..14]), None, "cut inside the id");
        let mut unknown = body.clone();
        unknown[0] = 7;
        assert_eq!(OwedDeleteRecord::decode(&unknown), None, "a kind this build does not know");
        let mut not_utf8 = body;
        not_utf8[11] = 0xff;
        assert_eq!(OwedDeleteRecord::decode(&not_utf8), None);
    }

    #[test]
    fn a_file_reads_back_its_records_and_one_without_a_header_is_refused() {
        let mut f = encode_log_header(LogKind::OwedDeletes, &KEY);
        for m in ["a", "b"] {
            f.extend(encode_record(&KEY, &record(m).encode()));
        }
        f.extend(encode_record(&KEY, b"\x09not a record"));
        let (records, skipped) = read_owed_deletes_log(&f).unwrap();
        assert_eq!(records, [record("a"), record("b")]);
        assert_eq!(skipped, 1, "the body this build can't read");
        assert_eq!(read_owed_deletes_log(&[]).unwrap(), (Vec::new(), 0));
        assert!(read_owed_deletes_log(b"junk").is_err(), "no header");
        let other = encode_log_header(LogKind::Namespaces, &KEY);
        assert!(read_owed_deletes_log(&other).is_err(), "another log's file");
    }
}
