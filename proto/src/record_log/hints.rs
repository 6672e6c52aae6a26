//! The records of `peer_hints.log`: blocks a node owes their owners (hinted handoff: a forward
//! that found the owner down), so that a restart of the node — whose disk tier still holds the
//! blocks — does not forget them. One record per member and namespace (at most
//! [`MAX_HINTS_PER_RECORD`] hints each): the member's id, the namespace id, then each block's key
//! and when it was stored here (unix ms), as bodies of [`super`]'s keyed records. The server
//! rewrites the whole file, atomically, every few seconds while what it owes changes.

use crate::{BlockKey, NamespaceId, ProtoError, KEY_LEN, NAMESPACE_ID_LEN};

use super::{read_log, LogContents, LogKind};

/// Most hints one record carries (a member with more takes several records).
pub const MAX_HINTS_PER_RECORD: usize = 4096;
/// Bytes of one hint in a body: the key and the stored time.
const HINT_LEN: usize = KEY_LEN + 8;
/// Largest record body replay believes: an id of at most 256 bytes, the namespace, the count and
/// [`MAX_HINTS_PER_RECORD`] hints.
pub const MAX_RECORD: usize = 2 + 256 + NAMESPACE_ID_LEN + 4 + MAX_HINTS_PER_RECORD * HINT_LEN;

/// Blocks of one namespace owed to one member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerHintsRecord<'a> {
    /// The member's node id.
    pub member: &'a str,
    pub namespace: NamespaceId,
    /// Each block's key and when it was stored here, in milliseconds since the Unix epoch.
    pub hints: Vec<(BlockKey, u64)>,
}

impl<'a> PeerHintsRecord<'a> {
    /// The record's body: the member id's length (u16 LE), the id, the namespace id, the number
    /// of hints (u32 LE), then each hint's key and stored time (u64 LE). At most
    /// [`MAX_HINTS_PER_RECORD`] hints (the caller splits).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(2 + self.member.len() + NAMESPACE_ID_LEN + 4 + self.hints.len() * HINT_LEN);
        b.extend_from_slice(&(self.member.len() as u16).to_le_bytes());
        b.extend_from_slice(self.member.as_bytes());
        b.extend_from_slice(&self.namespace.0);
        b.extend_from_slice(&(self.hints.len() as u32).to_le_bytes());
        for (key, stored) in &self.hints {
            b.extend_from_slice(&key.0);
            b.extend_from_slice(&stored.to_le_bytes());
        }
        b
    }

    /// A record from its body; `None` when its lengths do not add up or the id is not UTF-8.
    pub fn decode(body: &'a [u8]) -> Option<PeerHintsRecord<'a>> {
        let len = u16::from_le_bytes(body.get(..2)?.try_into().ok()?) as usize;
        let member = std::str::from_utf8(body.get(2..2 + len)?).ok()?;
        let rest = body.get(2 + len..)?;
        let namespace = NamespaceId(rest.get(..NAMESPACE_ID_LEN)?.try_into().ok()?);
        let rest = &rest[NAMESPACE_ID_LEN..];
        let n = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
        let rest = &rest[4..];
        if n > MAX_HINTS_PER_RECORD || rest.len() != n.checked_mul(HINT_LEN)? {
            return None;
        }
        let hints = rest
            .chunks_exact(HINT_LEN)
            .map(|h| {
                let key = BlockKey(h[..KEY_LEN].try_into().unwrap_or([0; KEY_LEN]));
                let stored = u64::from_le_bytes(h[KEY_LEN..].try_into().unwrap_or([0; 8]));
                (key, stored)
            })
            .collect();
        Some(PeerHintsRecord { member, namespace, hints })
    }
}

/// The records of `peer_hints.log` and the damaged stretches skipped. An empty or missing file
/// owes nothing; a file without a header is refused.
pub fn read_peer_hints_log(file: &[u8]) -> Result<(Vec<PeerHintsRecord<'_>>, u64), ProtoError> {
    if file.is_empty() {
        return Ok((Vec::new(), 0));
    }
    let LogContents::Keyed { scan, .. } = read_log(LogKind::PeerHints, file, MAX_RECORD)? else {
        return Err(ProtoError::LogHeader("no header: not a peer-hints log".into()));
    };
    let mut out = Vec::with_capacity(scan.records.len());
    let mut skipped = scan.skipped;
    for (_, body) in scan.records {
        match PeerHintsRecord::decode(body) {
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

    const KEY: LogKey = LogKey([5; 32]);

    fn record(member: &str, n: usize) -> PeerHintsRecord<'_> {
        let hints = (0..n).map(|i| (BlockKey([i as u8; 32]), 1_700_000_000_000 + i as u64)).collect();
        PeerHintsRecord { member, namespace: NamespaceId([7; 16]), hints }
    }

    #[test]
    fn records_round_trip_and_bodies_that_do_not_add_up_are_refused() {
        let r = record("node-b", 3);
        assert_eq!(PeerHintsRecord::decode(&r.encode()), Some(r.clone()));
        let body = r.encode();
        assert_eq!(PeerHintsRecord::decode(&body[..body.len() - 1]), None, "a hint cut short");
        assert_eq!(PeerHintsRecord::decode(&body[..5]), None, "cut inside the id");
        let mut more = body.clone();
        more.extend_from_slice(&[0; HINT_LEN]);
        assert_eq!(PeerHintsRecord::decode(&more), None, "more hints than it says");
        let mut huge = record("n", 0).encode();
        let at = 2 + 1 + NAMESPACE_ID_LEN;
        huge[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(PeerHintsRecord::decode(&huge), None, "a count past the limit");
    }

    #[test]
    fn a_log_reads_back_its_records_and_refuses_another_kind() {
        let mut f = encode_log_header(LogKind::PeerHints, &KEY);
        f.extend(encode_record(&KEY, &record("a", 2).encode()));
        f.extend(encode_record(&KEY, &record("b", 1).encode()));
        let (got, skipped) = read_peer_hints_log(&f).unwrap();
        assert_eq!((got, skipped), (vec![record("a", 2), record("b", 1)], 0));
        assert_eq!(read_peer_hints_log(&[]).unwrap(), (Vec::new(), 0));
        let other = encode_log_header(LogKind::OwedDeletes, &KEY);
        assert!(read_peer_hints_log(&other).is_err());
        // A torn last record is skipped, the others kept.
        let torn = &f[..f.len() - 3];
        let (got, _) = read_peer_hints_log(torn).unwrap();
        assert_eq!(got, vec![record("a", 2)]);
    }
}
