//! The durable record of parked sessions: an append-only log of manifest records (park/extend
//! writes the whole manifest; drop and expiry write a tombstone), each numbered and framed by
//! `kvtier_proto::record_log` (a tag keyed with the file's secret, so no bytes a tenant puts in a
//! manifest or session id can pass for a record). A park is acknowledged only after its blocks
//! are on disk and its record is appended and `fsync`ed (unless `session_durability = "async"`).
//! At start the log is replayed (a torn or damaged record costs itself only) and rewritten, with
//! a new secret, holding the live sessions only; a log of the first format (no header, an xxh3
//! checksum per record) is read by [`legacy_records`] and so migrated.
//!
//! Drops remembered against copies coming back from nodes that were away (`SessionStore`'s
//! `remember_drop_at`) are records too ([`SessionLog::remember_drop`]): replay returns those made
//! within the last `DROP_REMEMBERED`, and compaction keeps them, so a node that restarts still
//! knows a session it saw dropped was dropped.
//!
//! Records are appended outside the session table's lock, so two changes to one session can
//! reach the file out of order; each carries the sequence number it was given under that lock,
//! and replay keeps, per session, the record with the highest. Appends from many parks share one
//! `fsync` where they overlap (the file lock covers the write only).
//!
//! Every park writes its whole manifest, so a session parked again and again grows the file by
//! its manifest each time: once the file is twice what it was last compacted to, and 16 MiB more,
//! the append that passed it compacts it in place (the same replay, under the file lock, keeping
//! the tombstones a change numbered but not yet appended could otherwise undo). Before, one
//! tenant re-parking a 20,000-block session wrote 270 MB in 28 s, inside every quota.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

pub use kvtier_proto::record_log::sessions::LoggedSession;
use kvtier_proto::record_log::sessions::{
    decode_body, encode_body, read_session_log, SessionReplay, DROP, DROPPED, MAX_RECORD, PUT,
};
use kvtier_proto::record_log::{encode_log_header, encode_record, read_log_header, LogHeader, LogKey, LogKind};
use kvtier_proto::NamespaceId;
use xxhash_rust::xxh3::xxh3_64;

use crate::error::ServerError;
use crate::fs::{FileSystem, FsFile, OpenMode, StdFs};
use crate::session_store::DROP_REMEMBERED;

/// What a log's replay found: the sessions alive, the drops still remembered, and the damaged
/// stretches skipped.
#[derive(Debug, Default)]
pub struct Replayed {
    pub sessions: Vec<LoggedSession>,
    /// (namespace, session id, when it was dropped in wall-clock ms), made within
    /// [`DROP_REMEMBERED`] of the start.
    pub drops: Vec<(NamespaceId, String, u64)>,
    /// (namespace, session id, when it expired in wall-clock ms) of sessions that expired while
    /// the node was down, the latest [`EXPIRED_AT_START`] at most.
    pub expired: Vec<(NamespaceId, String, u64)>,
    /// Damaged stretches skipped (each a torn or corrupt record, or several in a row).
    pub unreadable: u64,
}

/// A logged session and its record's sequence number.
type Numbered = (u64, LoggedSession);

/// What a log's records come to at `now_ms`: per session its newest record, and the drops
/// still remembered.
struct Live {
    /// Parked and not expired, in (namespace, id) order.
    sessions: Vec<Numbered>,
    /// Parked, expired by `now_ms`.
    expired: Vec<Numbered>,
    /// Remembered drops made within [`DROP_REMEMBERED`], in number order.
    drops: Vec<Numbered>,
    /// Sessions whose newest record is a drop or expiry.
    tombstones: Vec<Numbered>,
    max_seq: u64,
}

impl Live {
    fn of(records: Vec<kvtier_proto::record_log::sessions::SessionRecord>, now_ms: u64) -> Live {
        // Per session, the newest record seen (a tombstone is `None`).
        let mut newest: HashMap<(NamespaceId, String), (u64, Option<LoggedSession>)> = HashMap::new();
        // Per session, its latest remembered drop (time, the record's number).
        let mut drops: HashMap<(NamespaceId, String), (u64, u64)> = HashMap::new();
        let mut max_seq = 0u64;
        for (kind, seq, s) in records {
            max_seq = max_seq.max(seq);
            let id = (s.namespace, s.id.clone());
            if kind == DROPPED {
                // Changes no session: remembered beside them.
                let e = drops.entry(id).or_insert((s.dropped_unix_ms, seq));
                *e = (*e).max((s.dropped_unix_ms, seq));
                continue;
            }
            let record = (seq, (kind == PUT).then_some(s));
            match newest.get(&id) {
                Some((have, _)) if *have > seq => {}
                _ => {
                    newest.insert(id, record);
                }
            }
        }
        let mut tombstones = Vec::new();
        let (mut sessions, expired): (Vec<Numbered>, Vec<Numbered>) = newest
            .into_iter()
            .filter_map(|((ns, id), (seq, s))| match s {
                Some(s) => Some((seq, s)),
                None => {
                    tombstones.push((seq, LoggedSession::tombstone(ns, id)));
                    None
                }
            })
            .partition(|(_, s)| s.expires_unix_ms > now_ms);
        sessions.sort_by(|a, b| (a.1.namespace, &a.1.id).cmp(&(b.1.namespace, &b.1.id)));
        let remembered = DROP_REMEMBERED.as_millis() as u64;
        let mut drops: Vec<Numbered> = drops
            .into_iter()
            .filter(|(_, (at, _))| now_ms.saturating_sub(*at) < remembered)
            .map(|((ns, id), (at, seq))| {
                (seq, LoggedSession { dropped_unix_ms: at, ..LoggedSession::tombstone(ns, id) })
            })
            .collect();
        drops.sort_by_key(|d| d.0);
        Live { sessions, expired, drops, tombstones, max_seq }
    }
}

/// Most sessions found expired at start that are remembered as expired.
pub const EXPIRED_AT_START: usize = 16_384;

pub fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO).as_millis() as u64
}

/// The log file: appends serialize on `tail` (the file and where the next record goes; a
/// compaction swaps both); `fsync`s run outside that lock.
pub struct SessionLog {
    fs: Arc<dyn FileSystem>,
    dir: PathBuf,
    path: PathBuf,
    tail: Mutex<Tail>,
    sync: bool,
    /// The next record's sequence number.
    next_seq: AtomicU64,
    /// Numbers given out and not yet appended, with when (see [`SessionLog::next_seq`]).
    unwritten: Mutex<std::collections::BTreeMap<u64, std::time::Instant>>,
    /// The file's secret: what records' tags are keyed with (kept by a compaction at run time:
    /// records are framed before they are appended).
    key: LogKey,
    /// Compacted when the file passes twice this plus [`COMPACT_SLACK`].
    compacted_to: AtomicU64,
    slack: u64,
    /// False while the rename of a compaction is not known durable (its directory sync
    /// failed): a synced append syncs the directory first, and fails while it can't.
    renamed_durably: std::sync::atomic::AtomicBool,
}

/// The file and its end.
struct Tail {
    file: Arc<dyn FsFile>,
    end: u64,
}

/// How far past twice its last compacted size the file grows before it is compacted again.
pub const COMPACT_SLACK: u64 = 16 << 20;

/// A number given out but not appended after this long is taken for one that never will be
/// (a compaction then stops keeping tombstones for it).
const UNWRITTEN_FOR_AT_MOST: Duration = Duration::from_secs(60);

/// A fresh secret for a log file, from the OS's random source.
pub(crate) fn fresh_log_key() -> Result<LogKey, ServerError> {
    let mut key = [0u8; 32];
    getrandom::fill(&mut key)
        .map_err(|e| ServerError::Io(std::io::Error::other(format!("no OS randomness for a log secret: {e}"))))?;
    Ok(LogKey(key))
}

/// A log the node rewrites whole (owed deletes, peer hints), opened: what `read` makes of its
/// bytes (`read` returns it with how many damaged records it skipped, said at WARN) and the
/// secret to write it again with. A file `read` refuses — its header does not verify, so no
/// record in it can be trusted — is moved aside (`.damaged`) and said at ERROR with `lost`, what
/// the node goes without; a fresh secret is drawn then, and for a file that had none.
pub(crate) fn open_rewritten_log<T: Default>(
    dir: &Path,
    file: &str,
    kind: kvtier_proto::record_log::LogKind,
    fs: &dyn crate::fs::FileSystem,
    lost: &str,
    read: impl FnOnce(&[u8]) -> Result<(T, u64), kvtier_proto::ProtoError>,
) -> Result<(PathBuf, LogKey, T), ServerError> {
    let path = dir.join(file);
    let data = fs.read_all(&path)?.unwrap_or_default();
    match read(&data) {
        Ok((found, skipped)) => {
            if skipped > 0 {
                tracing::warn!("{}: {skipped} damaged record(s) skipped", path.display());
            }
            let key = match kvtier_proto::record_log::read_log_header(kind, &data) {
                Ok(kvtier_proto::record_log::LogHeader::Keyed(key)) => key,
                _ => fresh_log_key()?,
            };
            Ok((path, key, found))
        }
        Err(e) => {
            let aside = dir.join(format!("{file}.damaged"));
            fs.rename(&path, &aside)?;
            tracing::error!("{}: {e}; moved to {} — {lost}", path.display(), aside.display());
            Ok((path, fresh_log_key()?, T::default()))
        }
    }
}

/// The verified first-format record starting at `at`: (where the next one starts, kind, sequence
/// number, session); `None` when the bytes there are not a whole record with a matching checksum.
fn legacy_record_at(data: &[u8], at: usize, ordinal: u64) -> Option<(usize, u8, u64, LoggedSession)> {
    let head = data.get(at..at.checked_add(12)?)?;
    let len = u32::from_le_bytes(head[..4].try_into().ok()?) as usize;
    let sum = u64::from_le_bytes(head[4..].try_into().ok()?);
    if len > MAX_RECORD {
        return None;
    }
    let body = data.get(at + 12..at + 12 + len)?;
    if xxh3_64(body) != sum {
        return None;
    }
    let (kind, seq, s) = decode_body(body, ordinal)?;
    Some((at + 12 + len, kind, seq, s))
}

/// The records of a first-format log (each a u32 length, the xxh3 of the body, the body): replay
/// goes on after a damaged record at the next offset where a whole, verified one starts.
pub fn legacy_records(data: &[u8]) -> SessionReplay {
    let mut out = Vec::new();
    let mut unreadable = 0u64;
    let mut at = 0usize;
    let mut ordinal = 0u64;
    while at < data.len() {
        let Some((next, kind, seq, s)) = legacy_record_at(data, at, ordinal + 1) else {
            unreadable += 1;
            match (at + 1..data.len()).find(|&i| legacy_record_at(data, i, ordinal + 1).is_some()) {
                Some(i) => {
                    at = i;
                    continue;
                }
                None => break,
            }
        };
        at = next;
        ordinal += 1;
        out.push((kind, seq, s));
    }
    (out, unreadable)
}

/// Every record of a log file in file order, (kind, sequence number, session), and the damaged
/// stretches skipped. A current-format file's records verify against its secret
/// ([`read_session_log`]); a first-format file (no header) is read with its xxh3 checksums, once,
/// before it is rewritten.
pub fn replay_records(data: &[u8]) -> Result<SessionReplay, ServerError> {
    match read_session_log(data).map_err(|e| ServerError::Config(format!("sessions.log: {e}")))? {
        Some(read) => Ok(read),
        None => Ok(legacy_records(data)),
    }
}

impl SessionLog {
    /// Replays the log in `dir`, rewrites it with the sessions still alive at `now_ms` and the
    /// drops still remembered, and returns them with the number of damaged stretches skipped
    /// (replay continues at the next whole record).
    pub fn open(dir: &Path, sync: bool, now_ms: u64) -> Result<(SessionLog, Replayed), ServerError> {
        Self::open_with(&StdFs::shared(), dir, sync, now_ms)
    }

    /// [`Self::open`] on the file system `fs`.
    pub fn open_with(
        fs: &Arc<dyn FileSystem>,
        dir: &Path,
        sync: bool,
        now_ms: u64,
    ) -> Result<(SessionLog, Replayed), ServerError> {
        let path = dir.join("sessions.log");
        let mut unreadable = 0u64;
        let existing = fs.read_all(&path)?;
        let records = match &existing {
            Some(data) => {
                let (records, bad) = replay_records(data)?;
                unreadable = bad;
                records
            }
            None => Vec::new(),
        };
        let Live { sessions, mut expired, drops, max_seq, .. } = Live::of(records, now_ms);
        // Sessions whose newest record expired while the node was down: not restored, but said
        // to have expired (as they would have been had the node run), the latest first.
        expired.sort_by_key(|(_, s)| std::cmp::Reverse(s.expires_unix_ms));
        expired.truncate(EXPIRED_AT_START);
        let tmp = dir.join("sessions.log.tmp");
        let key = match fresh_log_key().and_then(|key| Self::write_compacted(fs, &tmp, key, &sessions, &drops, &[])) {
            Ok(key) => {
                fs.rename(&tmp, &path).map_err(|e| {
                    ServerError::Io(std::io::Error::new(e.kind(), format!("renaming {}: {e}", tmp.display())))
                })?;
                // Until the rename is durable a power loss takes the old file back, and with it
                // every park acknowledged into the new one: no start without it.
                fs.sync_dir(dir)?;
                key
            }
            // A full disk before the compacted file replaced the log: the log stays as it is and
            // is appended to under its own key (a node that stopped on a full disk must start
            // again); compacted at the next start with room.
            Err(ServerError::Io(e)) if e.kind() == std::io::ErrorKind::StorageFull => {
                let _ = fs.remove_file(&tmp);
                let kept = existing.as_deref().map(|d| read_log_header(LogKind::Sessions, d));
                let Some(Ok(LogHeader::Keyed(key))) = kept else {
                    let why = if existing.is_none() {
                        "there is none to append to"
                    } else {
                        "its older format can't be appended to"
                    };
                    return Err(ServerError::Io(std::io::Error::new(
                        e.kind(),
                        format!("writing {} on a full disk ({why}): {e}", path.display()),
                    )));
                };
                tracing::warn!("{} not compacted ({e}): appending to it as it is", path.display());
                key
            }
            Err(e) => return Err(e),
        };
        let file = fs.open(&path, OpenMode::Existing)?;
        let end = file.size()?;
        let log = SessionLog {
            fs: fs.clone(),
            dir: dir.to_path_buf(),
            path,
            tail: Mutex::new(Tail { file, end }),
            sync,
            next_seq: AtomicU64::new(max_seq + 1),
            unwritten: Mutex::new(std::collections::BTreeMap::new()),
            key,
            compacted_to: AtomicU64::new(end),
            slack: COMPACT_SLACK,
            renamed_durably: std::sync::atomic::AtomicBool::new(true),
        };
        let replayed = Replayed {
            sessions: sessions.into_iter().map(|(_, s)| s).collect(),
            drops: drops.into_iter().map(|(_, d)| (d.namespace, d.id, d.dropped_unix_ms)).collect(),
            expired: expired.into_iter().map(|(_, s)| (s.namespace, s.id, s.expires_unix_ms)).collect(),
            unreadable,
        };
        Ok((log, replayed))
    }

    /// Writes the live set, the remembered drops and `tombstones` to `tmp` under `key` (its
    /// header first) and syncs it; `key`. The caller moves it into place. An error names the
    /// file and step.
    fn write_compacted(
        fs: &Arc<dyn FileSystem>,
        tmp: &Path,
        key: LogKey,
        sessions: &[(u64, LoggedSession)],
        drops: &[(u64, LoggedSession)],
        tombstones: &[(u64, LoggedSession)],
    ) -> Result<LogKey, ServerError> {
        let mut data = encode_log_header(LogKind::Sessions, &key);
        for (seq, s) in sessions {
            data.extend_from_slice(&encode_record(&key, &encode_body(PUT, *seq, s)));
        }
        for (seq, d) in drops {
            data.extend_from_slice(&encode_record(&key, &encode_body(DROPPED, *seq, d)));
        }
        for (seq, t) in tombstones {
            data.extend_from_slice(&encode_record(&key, &encode_body(DROP, *seq, t)));
        }
        let at = |what: &str, e: std::io::Error| {
            ServerError::Io(std::io::Error::new(e.kind(), format!("{what} {}: {e}", tmp.display())))
        };
        let f = fs.open(tmp, OpenMode::Truncate).map_err(|e| at("creating", e))?;
        f.write_all_at(&data, 0).map_err(|e| at("writing", e))?;
        f.sync_data().map_err(|e| at("syncing", e))?;
        Ok(key)
    }

    /// A sequence number for the next change; take it while holding the lock that orders changes
    /// to the session (the session table's), append it after releasing it (every number given
    /// out is appended: a compaction meanwhile keeps the tombstones it could undo).
    pub fn next_seq(&self) -> u64 {
        let mut unwritten = self.unwritten.lock();
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        unwritten.insert(seq, std::time::Instant::now());
        seq
    }

    /// Appends record `seq` (framed); compacts the file when it has grown past its bound.
    fn append(&self, seq: u64, rec: &[u8], sync: bool) -> Result<(), ServerError> {
        let io = |e: std::io::Error| {
            ServerError::Io(std::io::Error::new(e.kind(), format!("appending to {}: {e}", self.path.display())))
        };
        let file = {
            let mut tail = self.tail.lock();
            let written = tail.file.write_all_at(rec, tail.end);
            self.unwritten.lock().remove(&seq);
            if let Err(e) = written {
                // A refused append (a full disk) leaves no torn record behind: cut it off.
                let _ = tail.file.set_len(tail.end);
                return Err(io(e));
            }
            tail.end += rec.len() as u64;
            if tail.end > self.compacted_to.load(Ordering::Relaxed).saturating_mul(2).saturating_add(self.slack) {
                // Synced by the compaction (this record in it) when it is made.
                if self.compact(&mut tail) {
                    return Ok(());
                }
            }
            tail.file.clone()
        };
        if sync {
            // Outside the file lock: appends that land meanwhile are covered by this sync or
            // their own.
            file.sync_data().map_err(io)?;
            // Until a compaction's rename is durable, a power loss takes the old file back
            // without this record.
            if !self.renamed_durably.load(Ordering::Acquire) {
                self.fs.sync_dir(&self.dir).map_err(io)?;
                self.renamed_durably.store(true, Ordering::Release);
            }
        }
        Ok(())
    }

    /// Rewrites the file as the start does (the newest record of each session that is still
    /// parked, the remembered drops), keeping the same secret, and also the tombstones numbered
    /// after a change still unwritten (appended later, it must not bring back what they
    /// removed). True if the file was replaced (and synced, with every record appended so far).
    /// On a failure (a full disk) the file is kept and appended to, and compacted again once it
    /// grows by another [`COMPACT_SLACK`].
    fn compact(&self, tail: &mut Tail) -> bool {
        let started = std::time::Instant::now();
        let before = tail.end;
        let oldest_unwritten = {
            let mut unwritten = self.unwritten.lock();
            unwritten.retain(|_, at| at.elapsed() < UNWRITTEN_FOR_AT_MOST);
            unwritten.keys().next().copied()
        };
        let tmp = self.dir.join("sessions.log.tmp");
        let done = (|| -> Result<Arc<dyn FsFile>, ServerError> {
            let data = self.fs.read_all(&self.path)?.unwrap_or_default();
            let (records, _) = replay_records(&data)?;
            let mut live = Live::of(records, unix_ms(SystemTime::now()));
            // Expired ones too: the next start says they expired (the table drops them itself).
            live.sessions.append(&mut live.expired);
            let tombstones: Vec<Numbered> = live
                .tombstones
                .into_iter()
                .filter(|(seq, _)| oldest_unwritten.is_some_and(|oldest| *seq > oldest))
                .collect();
            Self::write_compacted(&self.fs, &tmp, self.key.clone(), &live.sessions, &live.drops, &tombstones)?;
            self.fs.rename(&tmp, &self.path)?;
            // Renamed: from here on the compacted file is the log, whatever else fails.
            let file = self.fs.open(&self.path, OpenMode::Existing);
            if let Err(e) = self.fs.sync_dir(&self.dir) {
                tracing::warn!(
                    "{}: compacted, but its directory not synced ({e}); synced parks retry it",
                    self.path.display()
                );
                self.renamed_durably.store(false, Ordering::Release);
            }
            Ok(file?)
        })();
        match done.and_then(|file| Ok((file.size()?, file))) {
            Ok((end, file)) => {
                *tail = Tail { file, end };
                self.compacted_to.store(end, Ordering::Relaxed);
                ::metrics::counter!("kvtier_session_log_compactions_total").increment(1);
                tracing::info!(
                    "{}: compacted from {before} to {end} bytes in {:?}",
                    self.path.display(),
                    started.elapsed()
                );
                true
            }
            Err(e) => {
                let _ = self.fs.remove_file(&tmp);
                self.compacted_to.store(before / 2, Ordering::Relaxed);
                ::metrics::counter!("kvtier_session_log_compactions_failed_total").increment(1);
                tracing::warn!("{} not compacted ({e}): appending to it as it is", self.path.display());
                false
            }
        }
    }

    /// Records a park or extend as change `seq`. Durable on return unless the log was opened
    /// without sync.
    pub fn put(&self, seq: u64, s: &LoggedSession) -> Result<(), ServerError> {
        self.append(seq, &encode_record(&self.key, &encode_body(PUT, seq, s)), self.sync)
    }

    /// Records a drop or expiry as change `seq` (not synced: losing it only resurrects a session
    /// until its TTL).
    pub fn delete(&self, seq: u64, ns: NamespaceId, id: &str) -> Result<(), ServerError> {
        let body = encode_body(DROP, seq, &LoggedSession::tombstone(ns, id.to_string()));
        self.append(seq, &encode_record(&self.key, &body), false)
    }

    /// Records that session `id` was dropped at `at_unix_ms` (remembered against its copies
    /// coming back), as change `seq`; not synced, as a drop's tombstone.
    pub fn remember_drop(&self, seq: u64, ns: NamespaceId, id: &str, at_unix_ms: u64) -> Result<(), ServerError> {
        let d = LoggedSession { dropped_unix_ms: at_unix_ms, ..LoggedSession::tombstone(ns, id.to_string()) };
        self.append(seq, &encode_record(&self.key, &encode_body(DROPPED, seq, &d)), false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_proto::record_log::sessions::{DROP_V1, PUT_V1};
    use kvtier_proto::record_log::{read_log_header, LogHeader, LOG_HEADER_LEN};
    use kvtier_proto::{BlockKey, Priority, KEY_LEN};
    use std::io::Write;

    /// The secret of the test files written without the log.
    const TEST_KEY: LogKey = LogKey([9; 32]);

    /// A record framed with [`TEST_KEY`].
    fn encode(kind: u8, seq: u64, s: &LoggedSession) -> Vec<u8> {
        encode_record(&TEST_KEY, &encode_body(kind, seq, s))
    }

    /// A log file keyed with [`TEST_KEY`] holding `records`.
    fn keyed_file(records: &[u8]) -> Vec<u8> {
        let mut f = encode_log_header(LogKind::Sessions, &TEST_KEY);
        f.extend_from_slice(records);
        f
    }

    /// A record as the first format framed it (u32 length, xxh3 of the body, body).
    fn legacy_encode(kind: u8, seq: u64, s: &LoggedSession) -> Vec<u8> {
        legacy_frame(&encode_body(kind, seq, s))
    }

    fn legacy_frame(body: &[u8]) -> Vec<u8> {
        let mut rec = (body.len() as u32).to_le_bytes().to_vec();
        rec.extend_from_slice(&xxh3_64(body).to_le_bytes());
        rec.extend_from_slice(body);
        rec
    }

    fn file_key(path: &Path) -> LogKey {
        match read_log_header(LogKind::Sessions, &std::fs::read(path).unwrap()).unwrap() {
            LogHeader::Keyed(k) => k,
            LogHeader::Legacy => panic!("{} has no header", path.display()),
        }
    }

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
            dropped_unix_ms: 0,
            created_unix_ms: 0,
        }
    }

    /// Remembered drops come back from replay (the latest per session) and through compaction,
    /// until an hour after they were made; they change no session (one parked again under the
    /// id after its drop replays as parked).
    #[test]
    fn remembered_drops_outlive_a_restart_for_an_hour() {
        let dir = tempfile::tempdir().unwrap();
        let hour = DROP_REMEMBERED.as_millis() as u64;
        let now = 10 * hour;
        let ns = NamespaceId([7; 16]);
        {
            let (log, _) = SessionLog::open(dir.path(), true, now).unwrap();
            log.remember_drop(log.next_seq(), ns, "a", now - 5_000).unwrap();
            log.remember_drop(log.next_seq(), ns, "a", now - 1_000).unwrap();
            log.remember_drop(log.next_seq(), ns, "old", now - hour - 1).unwrap();
            // Dropped, then parked again: the new session is live, its drop still remembered.
            log.remember_drop(log.next_seq(), ns, "again", now - 2_000).unwrap();
            log.put(log.next_seq(), &s("again", 1, now + hour)).unwrap();
        }
        let expected = |r: &Replayed| {
            let mut d = r.drops.clone();
            d.sort();
            assert_eq!(d, vec![(ns, "a".to_string(), now - 1_000), (ns, "again".to_string(), now - 2_000)]);
            assert_eq!(r.sessions.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(), ["again"]);
            assert_eq!(r.unreadable, 0);
        };
        let (log, replayed) = SessionLog::open(dir.path(), true, now).unwrap();
        expected(&replayed);
        drop(log);
        // Compacted by that start: the next replays the same, and an hour on forgets them.
        let (_log, replayed) = SessionLog::open(dir.path(), true, now).unwrap();
        expected(&replayed);
        let (_log, replayed) = SessionLog::open(dir.path(), true, now + hour).unwrap();
        assert!(replayed.drops.is_empty(), "{:?}", replayed.drops);
    }

    /// A session's creation time comes back from replay; a record written before the field (no
    /// trailing bytes) reads with none, and one with it reads the same to a decoder that stops
    /// after the tail (a build before it).
    #[test]
    fn a_session_s_creation_survives_replay_and_older_records_read_without_it() {
        let dir = tempfile::tempdir().unwrap();
        let created = LoggedSession { created_unix_ms: 4_000, ..s("new", 3, 9000) };
        {
            let (log, _) = SessionLog::open(dir.path(), true, 100).unwrap();
            log.put(log.next_seq(), &created).unwrap();
        }
        let (_log, replayed) = SessionLog::open(dir.path(), true, 100).unwrap();
        assert_eq!(replayed.sessions, vec![created.clone()]);

        let body = encode_body(PUT, 7, &created);
        let older = &body[..body.len() - 8];
        let (kind, seq, read) = decode_body(older, 0).unwrap();
        assert_eq!((kind, seq, read.created_unix_ms), (PUT, 7, 0));
        assert_eq!(read, LoggedSession { created_unix_ms: 0, ..created });
    }

    /// A session parked again and again (each park writes its whole manifest) grows the file
    /// only to about twice its live size plus the slack: the append past it compacts the file in
    /// place, under the same secret, and replay finds the latest version. Before, 400 parks of
    /// a 20,000-block session wrote 270 MB.
    #[test]
    fn a_session_parked_again_and_again_keeps_the_log_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let (mut log, _) = SessionLog::open(dir.path(), false, 100).unwrap();
        log.slack = 64 << 10;
        let keys: Vec<BlockKey> = (0..1000u32).map(|i| BlockKey([(i % 251) as u8; 32])).collect();
        let record = encode(PUT, 1, &LoggedSession { keys: keys.clone(), ..s("big", 1, 9000) }).len() as u64;
        let path = dir.path().join("sessions.log");
        let key = file_key(&path);
        let mut largest = 0;
        for v in 1..=300 {
            log.put(log.next_seq(), &LoggedSession { keys: keys.clone(), ..s("big", v, 9000) }).unwrap();
            log.put(log.next_seq(), &s("small", v, 9000)).unwrap();
            largest = largest.max(std::fs::metadata(&path).unwrap().len());
        }
        assert!(largest < 3 * record + (64 << 10) + 4096, "the log reached {largest} bytes ({record} per park)");
        assert_eq!(file_key(&path), key, "records framed before a compaction still verify after it");
        drop(log);
        let (_log, replayed) = SessionLog::open(dir.path(), false, 100).unwrap();
        let mut live: Vec<(String, u64)> = replayed.sessions.iter().map(|s| (s.id.clone(), s.version)).collect();
        live.sort();
        assert_eq!(live, [("big".to_string(), 300), ("small".to_string(), 300)]);
        assert_eq!(replayed.unreadable, 0);
    }

    /// A compaction while a change is numbered but not yet appended keeps the tombstones
    /// numbered after it: the park appended late can't bring back a session dropped after it.
    /// With nothing unwritten, tombstones go.
    #[test]
    fn a_compaction_keeps_the_tombstones_an_unwritten_change_could_undo() {
        let dir = tempfile::tempdir().unwrap();
        let (log, _) = SessionLog::open(dir.path(), false, 100).unwrap();
        let ns = NamespaceId([7; 16]);
        log.put(log.next_seq(), &s("a", 1, 9000)).unwrap();
        let late = log.next_seq();
        log.delete(log.next_seq(), ns, "a").unwrap();
        log.put(log.next_seq(), &s("b", 1, 9000)).unwrap();
        log.delete(log.next_seq(), ns, "b").unwrap();
        assert!(log.compact(&mut log.tail.lock()));
        // "a"'s park numbered before its drop reaches the file only now.
        log.put(late, &s("a", 1, 9000)).unwrap();
        drop(log);
        let (log, replayed) = SessionLog::open(dir.path(), false, 100).unwrap();
        assert!(replayed.sessions.is_empty(), "brought back: {:?}", replayed.sessions);

        // Nothing unwritten: a compaction keeps no tombstone.
        log.put(log.next_seq(), &s("c", 1, 9000)).unwrap();
        log.delete(log.next_seq(), ns, "c").unwrap();
        assert!(log.compact(&mut log.tail.lock()));
        let data = std::fs::read(dir.path().join("sessions.log")).unwrap();
        let (records, _) = replay_records(&data).unwrap();
        assert!(records.iter().all(|(kind, _, _)| *kind != DROP), "{records:?}");
    }

    /// A compaction a full disk refuses keeps the log as it was, appended to as before; one whose
    /// directory sync fails leaves the compacted file in use, and the next synced append syncs
    /// the directory before it is acknowledged (and fails while it can't).
    #[test]
    fn a_compaction_that_fails_loses_nothing() {
        use crate::fs::fault::FaultFs;
        let dir = tempfile::tempdir().unwrap();
        let fault = FaultFs::new(dir.path());
        let fs = fault.shared();
        let (log, _) = SessionLog::open_with(&fs, dir.path(), true, 100).unwrap();
        for v in 1..=3 {
            log.put(log.next_seq(), &s("a", v, 9000)).unwrap();
        }
        fault.enospc_from(Some(1));
        assert!(!log.compact(&mut log.tail.lock()), "a full disk refused it");
        fault.enospc_from(None);
        log.put(log.next_seq(), &s("b", 1, 9000)).unwrap();

        fault.fail_dir_syncs(2);
        assert!(log.compact(&mut log.tail.lock()), "renamed: in use though not synced");
        let err = log.put(log.next_seq(), &s("c", 1, 9000)).unwrap_err();
        assert!(err.to_string().contains("sessions.log"), "{err}");
        log.put(log.next_seq(), &s("d", 1, 9000)).unwrap();
        drop(log);
        let (_log, replayed) = SessionLog::open_with(&fs, dir.path(), true, 100).unwrap();
        let mut live: Vec<(String, u64)> = replayed.sessions.iter().map(|s| (s.id.clone(), s.version)).collect();
        live.sort();
        // "c" reached the file, but its park was not acknowledged (the directory not synced).
        assert_eq!(live, [("a".into(), 3), ("b".into(), 1), ("c".into(), 1), ("d".into(), 1)]);
    }

    #[test]
    fn replay_keeps_the_latest_live_version() {
        let dir = tempfile::tempdir().unwrap();
        {
            let (log, Replayed { sessions: live, unreadable: bad, .. }) =
                SessionLog::open(dir.path(), true, 0).unwrap();
            assert!(live.is_empty() && bad == 0);
            log.put(log.next_seq(), &s("a", 1, 5000)).unwrap();
            log.put(log.next_seq(), &s("b", 1, 5000)).unwrap();
            log.put(log.next_seq(), &s("a", 2, 6000)).unwrap();
            log.delete(log.next_seq(), NamespaceId([7; 16]), "b").unwrap();
            log.put(log.next_seq(), &s("old", 1, 10)).unwrap();
        }
        // A torn record at the end (a crash mid-append) is ignored.
        let path = dir.path().join("sessions.log");
        let key = file_key(&path);
        let mut f = std::fs::OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(&encode_record(&key, &encode_body(PUT, 99, &s("torn", 1, 9000)))[..30]).unwrap();
        let (_log, Replayed { sessions: live, unreadable: bad, .. }) = SessionLog::open(dir.path(), true, 100).unwrap();
        assert_eq!(live, vec![s("a", 2, 6000)]);
        assert_eq!(bad, 1);
        // Compacted: reopening finds the same without the torn tail.
        drop(_log);
        let (_log, Replayed { sessions: live, unreadable: bad, .. }) = SessionLog::open(dir.path(), true, 100).unwrap();
        assert_eq!((live.len(), bad), (1, 0));
    }

    #[test]
    fn replay_orders_by_sequence_not_by_file_position() {
        let dir = tempfile::tempdir().unwrap();
        {
            let (log, _) = SessionLog::open(dir.path(), true, 0).unwrap();
            let (s1, s2, s3, s4) = (log.next_seq(), log.next_seq(), log.next_seq(), log.next_seq());
            // Two parks of "a" whose appends raced: version 2 (seq s2) reached the file first.
            log.put(s2, &s("a", 2, 6000)).unwrap();
            log.put(s1, &s("a", 1, 5000)).unwrap();
            // "b" was dropped (s4) and its earlier park (s3) landed after the tombstone.
            log.delete(s4, NamespaceId([7; 16]), "b").unwrap();
            log.put(s3, &s("b", 1, 5000)).unwrap();
        }
        let (log, Replayed { sessions: live, unreadable: bad, .. }) = SessionLog::open(dir.path(), true, 100).unwrap();
        assert_eq!((live, bad), (vec![s("a", 2, 6000)], 0));
        // Numbers keep rising across restarts, so a change made now outranks every old record.
        let next = log.next_seq();
        assert!(next > 4, "{next}");
    }

    /// One flipped byte costs one record; a torn record in the middle (an append refused half
    /// way) hides nothing after it.
    #[test]
    fn a_bad_record_costs_only_itself() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sessions.log");
        let recs: Vec<Vec<u8>> =
            ["a", "b", "c", "d"].iter().zip(1..).map(|(id, seq)| encode(PUT, seq, &s(id, 1, 5000))).collect();
        // "b" damaged in its body, then half of a record that was never finished before "c".
        let mut data = recs[0].clone();
        let mut b = recs[1].clone();
        b[40] ^= 0x10;
        data.extend(b);
        data.extend(&encode(PUT, 9, &s("torn", 1, 5000))[..50]);
        data.extend(&recs[2]);
        data.extend(&recs[3]);
        std::fs::write(&path, keyed_file(&data)).unwrap();
        let (_log, Replayed { sessions: live, unreadable, .. }) = SessionLog::open(dir.path(), true, 100).unwrap();
        let ids: Vec<&str> = live.iter().map(|s| s.id.as_str()).collect();
        assert_eq!(ids, ["a", "c", "d"]);
        assert_eq!(unreadable, 1, "one damaged stretch: the bad record and the torn one after it");
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config { cases: 96, ..Default::default() })]
        /// Fuzz: any byte of a log flipped to any value (its header included: one damaged copy
        /// costs nothing), or the log cut anywhere after its header (written whole, renamed into
        /// place), costs at most the records it touched; every other record replays.
        #[test]
        fn any_damage_costs_only_the_records_it_touches(at in 0usize..10_000, mask in 1u8..=255, cut in proptest::bool::ANY) {
            let dir = tempfile::tempdir().unwrap();
            let ids: Vec<String> = (0..12).map(|i| format!("s{i}")).collect();
            let recs: Vec<Vec<u8>> = ids.iter().zip(1..).map(|(id, seq)| encode(PUT, seq, &s(id, 1, 5000))).collect();
            let mut data: Vec<u8> = keyed_file(&recs.concat());
            let at = if cut { LOG_HEADER_LEN + at % (data.len() - LOG_HEADER_LEN) } else { at % data.len() };
            if cut { data.truncate(at) } else { data[at] ^= mask }
            std::fs::write(dir.path().join("sessions.log"), &data).unwrap();
            let (_log, Replayed { sessions: live, unreadable: _bad, .. }) = SessionLog::open(dir.path(), true, 100).unwrap();
            // The record holding byte `at`, and only it (or, cut, it and those after), may be lost;
            // a byte of the header costs none.
            let mut start = LOG_HEADER_LEN;
            let mut hit = usize::MAX;
            for (i, r) in recs.iter().enumerate() {
                if at >= start && at < start + r.len() { hit = i; }
                start += r.len();
            }
            let expected: Vec<&str> = ids.iter().enumerate()
                .filter(|(i, _)| if cut { *i < hit } else { *i != hit })
                .map(|(_, id)| id.as_str()).collect();
            let mut got: Vec<&str> = live.iter().map(|s| s.id.as_str()).collect();
            got.sort_by_key(|id| id[1..].parse::<u32>().unwrap_or(0));
            let missing: Vec<&&str> = expected.iter().filter(|id| !got.contains(id)).collect();
            proptest::prop_assert!(missing.is_empty(), "lost {:?} for damage at byte {} (record {})", missing, at, hit);
            for m in &live {
                proptest::prop_assert_eq!(m, &s(&m.id, 1, 5000), "a replayed record differs");
            }
        }
    }

    /// An append the file refuses (a full disk, half the record written) leaves nothing behind:
    /// later appends and a replay see only whole records.
    #[test]
    fn a_refused_append_leaves_no_torn_record() {
        let dir = tempfile::tempdir().unwrap();
        let fault = crate::fs::fault::FaultFs::new(dir.path());
        let fs = fault.shared();
        let path = dir.path().join("sessions.log");
        let (log, _) = SessionLog::open_with(&fs, dir.path(), true, 0).unwrap();
        log.put(log.next_seq(), &s("a", 1, 5000)).unwrap();
        let len = fault.contents(&path).unwrap().len();
        fault.enospc_from(Some(1));
        assert!(log.put(log.next_seq(), &s("b", 1, 5000)).is_err());
        assert_eq!(fault.contents(&path).unwrap().len(), len);
        fault.enospc_from(None);
        log.put(log.next_seq(), &s("c", 1, 5000)).unwrap();
        drop(log);
        let (_log, Replayed { sessions: live, unreadable, .. }) =
            SessionLog::open_with(&fs, dir.path(), true, 100).unwrap();
        let ids: Vec<&str> = live.iter().map(|s| s.id.as_str()).collect();
        assert_eq!((ids, unreadable), (vec!["a", "c"], 0));
    }

    /// On a full disk the log opens without its compaction: appended to as it is, every
    /// session kept, compacted at the next open with room.
    #[test]
    fn a_full_disk_opens_the_log_uncompacted() {
        let dir = tempfile::tempdir().unwrap();
        let fault = crate::fs::fault::FaultFs::new(dir.path());
        let fs = fault.shared();
        let path = dir.path().join("sessions.log");
        let (log, _) = SessionLog::open_with(&fs, dir.path(), true, 0).unwrap();
        log.put(log.next_seq(), &s("a", 1, 5000)).unwrap();
        log.put(log.next_seq(), &s("a", 2, 5000)).unwrap();
        drop(log);
        let before = fault.contents(&path).unwrap();
        fault.enospc_from(Some(1));
        let (log, Replayed { sessions: live, unreadable: bad, .. }) =
            SessionLog::open_with(&fs, dir.path(), true, 100).unwrap();
        assert_eq!((live, bad), (vec![s("a", 2, 5000)], 0));
        assert_eq!(fault.contents(&path).unwrap(), before, "not compacted");
        assert!(fault.contents(&dir.path().join("sessions.log.tmp")).is_none(), "no temporary file left");
        fault.enospc_from(None);
        log.put(log.next_seq(), &s("b", 1, 5000)).unwrap();
        drop(log);
        let (_log, Replayed { sessions: live, unreadable: bad, .. }) =
            SessionLog::open_with(&fs, dir.path(), true, 100).unwrap();
        let ids: Vec<(&str, u64)> = live.iter().map(|s| (s.id.as_str(), s.version)).collect();
        assert_eq!((ids, bad), (vec![("a", 2), ("b", 1)], 0));
        assert!(fault.contents(&path).unwrap().len() < before.len() + 200, "compacted once there was room");
    }

    #[test]
    fn first_format_records_replay_in_file_order() {
        let dir = tempfile::tempdir().unwrap();
        let v1 = |kind: u8, s: &LoggedSession| {
            // The first format: no sequence number after the kind byte.
            let mut body = vec![kind];
            body.extend_from_slice(&encode_body(kind + 2, 0, s)[9..]);
            legacy_frame(&body)
        };
        let mut data = Vec::new();
        data.extend(v1(PUT_V1, &s("a", 1, 5000)));
        data.extend(v1(PUT_V1, &s("a", 2, 6000)));
        data.extend(v1(PUT_V1, &s("b", 1, 5000)));
        data.extend(v1(DROP_V1, &LoggedSession::tombstone(NamespaceId([7; 16]), "b".into())));
        std::fs::write(dir.path().join("sessions.log"), data).unwrap();
        let (_log, Replayed { sessions: live, unreadable: bad, .. }) = SessionLog::open(dir.path(), true, 100).unwrap();
        assert_eq!((live, bad), (vec![s("a", 2, 6000)], 0));
    }

    /// A log written by the first format (no header, xxh3 per record) opens with every session
    /// intact, is rewritten in the current one, and a restart after that keeps everything.
    #[test]
    fn a_first_format_log_migrates_to_the_keyed_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sessions.log");
        let mut data = Vec::new();
        data.extend(legacy_encode(PUT, 1, &s("a", 1, 5000)));
        data.extend(legacy_encode(PUT, 2, &s("b", 1, 5000)));
        data.extend(legacy_encode(PUT, 3, &s("a", 2, 6000)));
        data.extend(legacy_encode(DROP, 4, &LoggedSession::tombstone(NamespaceId([7; 16]), "b".into())));
        data.extend(legacy_encode(PUT, 5, &s("c", 1, 5000)));
        std::fs::write(&path, data).unwrap();
        let expected = vec![s("a", 2, 6000), s("c", 1, 5000)];
        {
            let (log, Replayed { sessions: live, unreadable: bad, .. }) =
                SessionLog::open(dir.path(), true, 100).unwrap();
            assert_eq!((&live, bad), (&expected, 0));
            let _ = file_key(&path); // now has a header
            assert!(log.next_seq() > 5, "numbers go on from the migrated ones");
            log.put(log.next_seq(), &s("d", 1, 5000)).unwrap();
        }
        let (_log, Replayed { sessions: live, unreadable: bad, .. }) = SessionLog::open(dir.path(), true, 100).unwrap();
        let ids: Vec<&str> = live.iter().map(|s| s.id.as_str()).collect();
        assert_eq!((ids, bad), (vec!["a", "c", "d"], 0));
    }

    /// Tenant A parks a session whose manifest (block keys are the client's bytes) embeds a whole
    /// record dropping tenant B's session — in the first format, and keyed with secrets an
    /// attacker might guess; then A's record's header is damaged, so replay resynchronizes inside
    /// its body. B's session survives, A's planted record is not applied, the stretch is counted.
    #[test]
    fn a_record_planted_in_a_manifest_is_never_replayed() {
        let (ns_a, ns_b) = (NamespaceId([0xa; 16]), NamespaceId([0xb; 16]));
        let drop_b = encode_body(DROP, u64::MAX / 2, &LoggedSession::tombstone(ns_b, "b".into()));
        let plants =
            [legacy_frame(&drop_b), encode_record(&LogKey([0; 32]), &drop_b), encode_record(&TEST_KEY, &drop_b)];
        for (i, plant) in plants.iter().enumerate() {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("sessions.log");
            let victim = LoggedSession { namespace: ns_b, ..s("b", 1, 5000) };
            let before_a;
            {
                let (log, _) = SessionLog::open(dir.path(), true, 0).unwrap();
                log.put(log.next_seq(), &victim).unwrap();
                before_a = std::fs::metadata(&path).unwrap().len() as usize;
                let mut bytes = vec![0u8; 7]; // lands the plant mid-key, as any offset would do
                bytes.extend_from_slice(plant);
                bytes.resize(bytes.len().div_ceil(KEY_LEN) * KEY_LEN, 0);
                let keys = bytes.chunks(KEY_LEN).map(|c| BlockKey::try_from(c).unwrap()).collect();
                log.put(log.next_seq(), &LoggedSession { namespace: ns_a, keys, ..s("a", 1, 5000) }).unwrap();
                log.put(log.next_seq(), &LoggedSession { namespace: ns_a, ..s("after", 1, 5000) }).unwrap();
            }
            // A's record damaged in its length (a torn write, a flipped bit).
            let mut data = std::fs::read(&path).unwrap();
            data[before_a + 5] ^= 0x01;
            std::fs::write(&path, data).unwrap();
            let (_log, Replayed { sessions: live, unreadable, .. }) = SessionLog::open(dir.path(), true, 100).unwrap();
            let ids: Vec<(NamespaceId, &str)> = live.iter().map(|s| (s.namespace, s.id.as_str())).collect();
            assert_eq!(ids, vec![(ns_a, "after"), (ns_b, "b")], "plant {i}: B's session must survive");
            assert_eq!(unreadable, 1, "plant {i}: A's damaged record (and the plant in it) skipped");
        }
    }
}
