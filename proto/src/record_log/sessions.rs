//! The records of `sessions.log`: a parked session's manifest (a park or extend), a tombstone
//! (a drop or expiry), or a drop remembered against copies of the session coming back from nodes
//! that were away (with when it was made), numbered, as bodies of [`super`]'s keyed records; and
//! the replay of a whole file, as the server runs it at start (and the fuzz target on arbitrary
//! bytes).

use crate::{BlockKey, NamespaceId, Priority, ProtoError, KEY_LEN, NAMESPACE_ID_LEN};

use super::{read_log, LogContents, LogKind};

/// Records of the first format (no sequence number: file order is their order).
pub const PUT_V1: u8 = 1;
pub const DROP_V1: u8 = 2;
/// Numbered records.
pub const PUT: u8 = 3;
pub const DROP: u8 = 4;
/// A session's drop remembered as of `dropped_unix_ms` (it changes no session on replay; a build
/// before it counts the record as unreadable and goes on).
pub const DROPPED: u8 = 5;

/// A session as the log stores it (times as wall-clock milliseconds, so they survive restarts).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoggedSession {
    pub namespace: NamespaceId,
    pub id: String,
    pub keys: Vec<BlockKey>,
    pub tail: Option<BlockKey>,
    pub token_count: u64,
    pub ttl_ms: u64,
    pub expires_unix_ms: u64,
    pub priority: Priority,
    pub version: u64,
    /// For a [`DROPPED`] record, when the session was dropped; 0 in every other record.
    pub dropped_unix_ms: u64,
    /// For a [`PUT`], when the session was created; 0 where that is not known (a record written
    /// before the field, which is read without it, as a build before it reads one with it).
    pub created_unix_ms: u64,
}

impl LoggedSession {
    /// Namespace and id only: what a drop record carries, and where a decoded record starts.
    pub fn tombstone(namespace: NamespaceId, id: String) -> Self {
        LoggedSession {
            namespace,
            id,
            keys: Vec::new(),
            tail: None,
            token_count: 0,
            ttl_ms: 0,
            expires_unix_ms: 0,
            priority: Priority::Normal,
            version: 0,
            dropped_unix_ms: 0,
            created_unix_ms: 0,
        }
    }
}

/// A record's body: kind, sequence number, namespace, id, and for a park the manifest, for a
/// remembered drop its time.
pub fn encode_body(kind: u8, seq: u64, s: &LoggedSession) -> Vec<u8> {
    let mut b = Vec::with_capacity(72 + s.id.len() + s.keys.len() * KEY_LEN);
    b.push(kind);
    b.extend_from_slice(&seq.to_le_bytes());
    b.extend_from_slice(&s.namespace.0);
    b.extend_from_slice(&(s.id.len() as u32).to_le_bytes());
    b.extend_from_slice(s.id.as_bytes());
    if kind == PUT {
        for v in [s.version, s.token_count, s.ttl_ms, s.expires_unix_ms] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.push(s.priority as u8);
        b.extend_from_slice(&(s.keys.len() as u32).to_le_bytes());
        for k in &s.keys {
            b.extend_from_slice(&k.0);
        }
        match s.tail {
            Some(t) => {
                b.push(1);
                b.extend_from_slice(&t.0);
            }
            None => b.push(0),
        }
        // Last, so a build before it reads the record and leaves these bytes unread.
        b.extend_from_slice(&s.created_unix_ms.to_le_bytes());
    } else if kind == DROPPED {
        b.extend_from_slice(&s.dropped_unix_ms.to_le_bytes());
    }
    b
}

struct Cursor<'a>(&'a [u8]);

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8).map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4).map(|b| u32::from_le_bytes(b.try_into().unwrap_or([0; 4])))
    }
    fn key(&mut self) -> Option<BlockKey> {
        self.take(KEY_LEN).and_then(|b| BlockKey::try_from(b).ok())
    }
}

/// (kind, sequence number, session) of one record body; tombstones carry only namespace and id.
/// A first-format record has no number: `ordinal` (its place in the file) stands in.
pub fn decode_body(body: &[u8], ordinal: u64) -> Option<(u8, u64, LoggedSession)> {
    let mut c = Cursor(body);
    let kind = c.take(1)?[0];
    let seq = match kind {
        PUT | DROP | DROPPED => c.u64()?,
        PUT_V1 | DROP_V1 => ordinal,
        _ => return None,
    };
    let ns = NamespaceId::from_slice(c.take(NAMESPACE_ID_LEN)?).ok()?;
    let n = c.u32()? as usize;
    let id = String::from_utf8(c.take(n)?.to_vec()).ok()?;
    let mut s = LoggedSession::tombstone(ns, id);
    if kind == PUT || kind == PUT_V1 {
        s.version = c.u64()?;
        s.token_count = c.u64()?;
        s.ttl_ms = c.u64()?;
        s.expires_unix_ms = c.u64()?;
        s.priority = Priority::from_u32(u32::from(c.take(1)?[0]));
        let n = c.u32()? as usize;
        s.keys = (0..n).map(|_| c.key()).collect::<Option<Vec<_>>>()?;
        if c.take(1)?[0] == 1 {
            s.tail = Some(c.key()?);
        }
        // Absent from records written before it (and from every first-format one).
        if kind == PUT && !c.0.is_empty() {
            s.created_unix_ms = c.u64()?;
        }
    } else if kind == DROPPED {
        s.dropped_unix_ms = c.u64()?;
    }
    let kind = if kind == PUT_V1 {
        PUT
    } else if kind == DROP_V1 {
        DROP
    } else {
        kind
    };
    Some((kind, seq, s))
}

/// Largest record body replay believes (a manifest of 1M keys is ~32 MiB).
pub const MAX_RECORD: usize = 64 << 20;

/// One replayed record: kind ([`PUT`], [`DROP`] or [`DROPPED`]), sequence number, session.
pub type SessionRecord = (u8, u64, LoggedSession);
/// The records of a log in file order, and the damaged stretches skipped.
pub type SessionReplay = (Vec<SessionRecord>, u64);

/// The records of a current-format `sessions.log`, (kind, sequence number, session) in file
/// order, and the damaged stretches skipped; `None` for a file without a header (the first
/// format, which the server reads with its own legacy reader).
pub fn read_session_log(file: &[u8]) -> Result<Option<SessionReplay>, ProtoError> {
    let LogContents::Keyed { scan, .. } = read_log(LogKind::Sessions, file, MAX_RECORD)? else {
        return Ok(None);
    };
    let mut out = Vec::with_capacity(scan.records.len());
    let mut skipped = scan.skipped;
    for (_, body) in scan.records {
        // Every record is the server's own (its tag verified); one this build cannot decode is
        // counted, not trusted.
        match decode_body(body, 0) {
            Some((kind @ (PUT | DROP | DROPPED), seq, s)) if body.first() == Some(&kind) => out.push((kind, seq, s)),
            _ => skipped += 1,
        }
    }
    Ok(Some((out, skipped)))
}
