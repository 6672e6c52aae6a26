//! The durable record of parked sessions: an append-only log of manifest records (park/extend
//! writes the whole manifest; drop and expiry write a tombstone), each length-prefixed and
//! checksummed. A park is acknowledged only after its blocks are on disk and its record is
//! appended and `fsync`ed (unless `session_durability = "async"`). At start the log is replayed
//! (a torn last record is ignored) and rewritten with the live sessions only.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvtier_proto::{BlockKey, NamespaceId, KEY_LEN, NAMESPACE_ID_LEN};
use xxhash_rust::xxh3::xxh3_64;

use crate::dram::Priority;
use crate::error::ServerError;

const PUT: u8 = 1;
const DROP: u8 = 2;

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
}

impl LoggedSession {
    /// Namespace and id only: what a drop record carries, and where a decoded record starts.
    fn tombstone(namespace: NamespaceId, id: String) -> Self {
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
        }
    }
}

pub fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO).as_millis() as u64
}

pub struct SessionLog {
    path: PathBuf,
    file: File,
    sync: bool,
}

fn encode(kind: u8, s: &LoggedSession) -> Vec<u8> {
    let mut b = Vec::with_capacity(64 + s.id.len() + s.keys.len() * KEY_LEN);
    b.push(kind);
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
    }
    let mut rec = Vec::with_capacity(b.len() + 12);
    rec.extend_from_slice(&(b.len() as u32).to_le_bytes());
    rec.extend_from_slice(&xxh3_64(&b).to_le_bytes());
    rec.extend_from_slice(&b);
    rec
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

/// (kind, session) of one record body; tombstones carry only namespace and id.
fn decode(body: &[u8]) -> Option<(u8, LoggedSession)> {
    let mut c = Cursor(body);
    let kind = c.take(1)?[0];
    let ns = NamespaceId::from_slice(c.take(NAMESPACE_ID_LEN)?).ok()?;
    let n = c.u32()? as usize;
    let id = String::from_utf8(c.take(n)?.to_vec()).ok()?;
    let mut s = LoggedSession::tombstone(ns, id);
    if kind == PUT {
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
    }
    Some((kind, s))
}

impl SessionLog {
    /// Replays the log in `dir`, rewrites it with the sessions still alive at `now_ms`, and
    /// returns them with the number of records that could not be read.
    pub fn open(dir: &Path, sync: bool, now_ms: u64) -> Result<(SessionLog, Vec<LoggedSession>, u64), ServerError> {
        let path = dir.join("sessions.log");
        let mut live: HashMap<(NamespaceId, String), LoggedSession> = HashMap::new();
        let mut unreadable = 0u64;
        if let Ok(mut f) = File::open(&path) {
            let mut data = Vec::new();
            f.read_to_end(&mut data)?;
            let mut c = Cursor(&data);
            while !c.0.is_empty() {
                let (Some(len), Some(sum)) = (c.u32(), c.u64()) else {
                    unreadable += 1;
                    break;
                };
                let Some(body) = c.take(len as usize) else {
                    unreadable += 1; // torn last record: its park was never acknowledged
                    break;
                };
                match (xxh3_64(body) == sum).then(|| decode(body)).flatten() {
                    Some((PUT, s)) => {
                        live.insert((s.namespace, s.id.clone()), s);
                    }
                    Some((_, s)) => {
                        live.remove(&(s.namespace, s.id));
                    }
                    None => {
                        unreadable += 1;
                        break;
                    }
                }
            }
        }
        let mut sessions: Vec<LoggedSession> = live.into_values().filter(|s| s.expires_unix_ms > now_ms).collect();
        sessions.sort_by(|a, b| (a.namespace, &a.id).cmp(&(b.namespace, &b.id)));
        // Compact: write the live set to a new file, sync it, and move it into place.
        let tmp = dir.join("sessions.log.tmp");
        {
            let mut f = File::create(&tmp)?;
            for s in &sessions {
                f.write_all(&encode(PUT, s))?;
            }
            f.sync_all()?;
        }
        std::fs::rename(&tmp, &path)?;
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
        let file = std::fs::OpenOptions::new().append(true).open(&path)?;
        Ok((SessionLog { path, file, sync }, sessions, unreadable))
    }

    fn append(&mut self, rec: &[u8], sync: bool) -> Result<(), ServerError> {
        self.file.write_all(rec).map_err(|e| {
            ServerError::Io(std::io::Error::new(e.kind(), format!("appending to {}: {e}", self.path.display())))
        })?;
        if sync {
            self.file.sync_data()?;
        }
        Ok(())
    }

    /// Records a park or extend. Durable on return unless the log was opened without sync.
    pub fn put(&mut self, s: &LoggedSession) -> Result<(), ServerError> {
        let sync = self.sync;
        self.append(&encode(PUT, s), sync)
    }

    /// Records a drop or expiry (not synced: losing it only resurrects a session until its TTL).
    pub fn delete(&mut self, ns: NamespaceId, id: &str) -> Result<(), ServerError> {
        self.append(&encode(DROP, &LoggedSession::tombstone(ns, id.to_string())), false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(id: &str, v: u64, expires: u64) -> LoggedSession {
        LoggedSession {
            namespace: NamespaceId([7; 16]),
            id: id.into(),
            keys: vec![BlockKey([1; 32]), BlockKey([2; 32])],
            tail: Some(BlockKey([3; 32])),
            token_count: 40,
            ttl_ms: 1000,
            expires_unix_ms: expires,
            priority: Priority::High,
            version: v,
        }
    }

    #[test]
    fn replay_keeps_the_latest_live_version() {
        let dir = tempfile::tempdir().unwrap();
        {
            let (mut log, live, bad) = SessionLog::open(dir.path(), true, 0).unwrap();
            assert!(live.is_empty() && bad == 0);
            log.put(&s("a", 1, 5000)).unwrap();
            log.put(&s("b", 1, 5000)).unwrap();
            log.put(&s("a", 2, 6000)).unwrap();
            log.delete(NamespaceId([7; 16]), "b").unwrap();
            log.put(&s("old", 1, 10)).unwrap();
        }
        // A torn record at the end (a crash mid-append) is ignored.
        let mut f = std::fs::OpenOptions::new().append(true).open(dir.path().join("sessions.log")).unwrap();
        f.write_all(&encode(PUT, &s("torn", 1, 9000))[..30]).unwrap();
        let (_log, live, bad) = SessionLog::open(dir.path(), true, 100).unwrap();
        assert_eq!(live, vec![s("a", 2, 6000)]);
        assert_eq!(bad, 1);
        // Compacted: reopening finds the same without the torn tail.
        drop(_log);
        let (_log, live, bad) = SessionLog::open(dir.path(), true, 100).unwrap();
        assert_eq!((live.len(), bad), (1, 0));
    }
}
