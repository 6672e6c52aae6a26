//! Hinted handoff: blocks a forward could not give one of their owners — the owner was skipped
//! as down, or the call failed — are remembered by key, per owner ([`Hints`], bounded), and sent
//! to it again from this node's own tiers once it answers. Without it an owner that was away a
//! moment never got them: with one copy per block, every other node missed those blocks (they
//! were held only by the node that stored them, and a store again found them present there).
//!
//! A hint is given up after [`HINT_FOR`], and when the block is no longer held here (evicted,
//! purged), its namespace is gone or was deleted since, or the member no longer owns the key
//! (the membership changed). A refusal the owner answered with (no room, a tenant's quota) is
//! not a miss: nothing is remembered for it.
//!
//! On a node with a disk tier (whose blocks outlive a restart) the hints are kept in
//! `peer_hints.log` in the data directory ([`HintsLog`]): rewritten whole every
//! [`SAVE_EVERY`] while they change and when the node stops, read back at start. A node killed
//! loses at most the hints of its last few seconds.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvtier_proto::record_log::hints::{read_peer_hints_log, PeerHintsRecord, MAX_HINTS_PER_RECORD};
use kvtier_proto::record_log::{encode_log_header, encode_record, LogKey, LogKind};
use kvtier_proto::{BlockKey, NamespaceId};
use tokio::sync::watch;

use super::member::NodeId;
use super::peer::PeerTier;
use crate::dram::StoredBlock;
use crate::error::ServerError;
use crate::fs::FileSystem;
use crate::state::NodeState;
use crate::tiers::Load;

/// Most keys remembered for all members together; past it a missed block is dropped (counted in
/// `kvtier_peer_forward_dropped_total`, as before hints).
pub const MAX_HINTS: usize = 65_536;
/// How long a hint is kept.
pub const HINT_FOR: Duration = Duration::from_secs(1800);
/// How often the hints are looked at (when there are any).
const PASS_EVERY: Duration = Duration::from_secs(1);
/// Keys one pass takes per member.
const PASS_KEYS: usize = 4096;
/// Payload bytes per request to the member.
const CHUNK_BYTES: usize = 16 << 20;
/// How often changed hints are written to [`HintsLog`].
const SAVE_EVERY: Duration = Duration::from_secs(2);

/// One block owed to an owner: its namespace, its key and when it was stored here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hint {
    pub ns: NamespaceId,
    pub key: BlockKey,
    pub stored: Instant,
}

/// The hints of every member, oldest first per member, at most [`MAX_HINTS`] in all.
#[derive(Debug, Default)]
pub struct Hints {
    by_member: HashMap<NodeId, VecDeque<Hint>>,
    total: usize,
    /// Bumped by every change (for [`HintsLog`]: written again when it moved).
    changes: u64,
}

impl Hints {
    /// Remembers `keys` of `ns` (stored at `stored`) for `member`; returns how many did not fit.
    pub fn add(&mut self, member: &NodeId, ns: NamespaceId, keys: &[BlockKey], stored: Instant) -> usize {
        let room = MAX_HINTS - self.total;
        let take = keys.len().min(room);
        if take > 0 {
            self.changes += 1;
            let q = self.by_member.entry(member.clone()).or_default();
            q.extend(keys[..take].iter().map(|&key| Hint { ns, key, stored }));
            self.total += take;
        }
        keys.len() - take
    }

    /// Up to `n` of `member`'s hints, oldest first.
    pub fn take(&mut self, member: &NodeId, n: usize) -> Vec<Hint> {
        let Some(q) = self.by_member.get_mut(member) else { return Vec::new() };
        // Not a change by itself: a pass gives back what it did not send ([`Self::put_back`]),
        // and says what it sent or gave up ([`Self::mark_changed`]).
        let out: Vec<Hint> = q.drain(..n.min(q.len())).collect();
        if q.is_empty() {
            self.by_member.remove(member);
        }
        self.total -= out.len();
        out
    }

    /// Gives back hints taken and not sent (the member failed again), ahead of the rest; what no
    /// longer fits is dropped and counted in the return value.
    pub fn put_back(&mut self, member: &NodeId, hints: Vec<Hint>) -> usize {
        let room = MAX_HINTS - self.total;
        let keep = hints.len().min(room);
        let q = self.by_member.entry(member.clone()).or_default();
        for h in hints[..keep].iter().rev() {
            q.push_front(*h);
        }
        if q.is_empty() {
            self.by_member.remove(member);
        }
        self.total += keep;
        hints.len() - keep
    }

    /// Forgets every hint of namespace `ns` (it was purged or unregistered); how many.
    pub fn forget_namespace(&mut self, ns: &NamespaceId) -> usize {
        let before = self.total;
        for q in self.by_member.values_mut() {
            q.retain(|h| h.ns != *ns);
        }
        self.by_member.retain(|_, q| !q.is_empty());
        self.total = self.by_member.values().map(VecDeque::len).sum();
        self.changes += u64::from(before != self.total);
        before - self.total
    }

    /// Forgets hints stored before `before`; how many.
    pub fn expire(&mut self, before: Instant) -> usize {
        let was = self.total;
        for q in self.by_member.values_mut() {
            while q.front().is_some_and(|h| h.stored < before) {
                q.pop_front();
            }
        }
        self.by_member.retain(|_, q| !q.is_empty());
        self.total = self.by_member.values().map(VecDeque::len).sum();
        self.changes += u64::from(was != self.total);
        was - self.total
    }

    /// How many of `member`'s hints are waiting.
    pub fn pending_for(&self, member: &NodeId) -> usize {
        self.by_member.get(member).map_or(0, VecDeque::len)
    }

    /// The keys (with their namespaces) waiting for `member`.
    pub fn pending_keys(&self, member: &NodeId) -> std::collections::HashSet<(NamespaceId, BlockKey)> {
        self.by_member.get(member).map(|q| q.iter().map(|h| (h.ns, h.key)).collect()).unwrap_or_default()
    }

    pub fn members(&self) -> Vec<NodeId> {
        self.by_member.keys().cloned().collect()
    }

    pub fn len(&self) -> usize {
        self.total
    }

    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// How many changes were made so far (hints added, sent, given up or forgotten).
    pub fn changes(&self) -> u64 {
        self.changes
    }

    /// Notes a change made through [`Self::take`] (hints sent or given up).
    pub fn mark_changed(&mut self) {
        self.changes += 1;
    }

    /// Every member's hints, oldest first.
    pub fn snapshot(&self) -> Vec<(NodeId, Vec<Hint>)> {
        self.by_member.iter().map(|(m, q)| (m.clone(), q.iter().copied().collect())).collect()
    }
}

/// The hints of a node with a disk tier, kept in `peer_hints.log` (see the module doc).
pub struct HintsLog {
    path: PathBuf,
    fs: Arc<dyn FileSystem>,
    /// The file's secret: what its records' tags are keyed with.
    key: LogKey,
}

/// A hint read back from [`HintsLog`]: the member, the namespace, the key and when the block
/// was stored (wall-clock time: it outlived the process).
pub type SavedHint = (NodeId, NamespaceId, BlockKey, SystemTime);

impl HintsLog {
    pub const FILE: &'static str = "peer_hints.log";

    /// Opens the log in `dir` and reads back its hints (those younger than [`HINT_FOR`]). A file
    /// whose header no longer verifies is moved aside (`.damaged`, said in the log), not read.
    pub fn open(dir: &Path, fs: Arc<dyn FileSystem>) -> Result<(HintsLog, Vec<SavedHint>), ServerError> {
        let lost = "blocks owed to owners that were down are not handed to them";
        let (path, key, saved) =
            crate::session_log::open_rewritten_log(dir, Self::FILE, LogKind::PeerHints, &*fs, lost, |data| {
                let (records, mut skipped) = read_peer_hints_log(data)?;
                let mut saved = Vec::new();
                for r in records {
                    let Ok(member) = NodeId::new(r.member) else {
                        skipped += 1;
                        continue;
                    };
                    for (key, stored_ms) in r.hints {
                        let stored = UNIX_EPOCH + Duration::from_millis(stored_ms);
                        if stored.elapsed().unwrap_or_default() < HINT_FOR {
                            saved.push((member.clone(), r.namespace, key, stored));
                        }
                    }
                }
                Ok((saved, skipped))
            })?;
        Ok((HintsLog { path, fs, key }, saved))
    }

    /// Writes `hints` (as of `now`, this process's clock and the wall clock) as the whole log.
    pub fn write(&self, hints: &[(NodeId, Vec<Hint>)], now: (Instant, SystemTime)) -> std::io::Result<()> {
        let mut data = encode_log_header(LogKind::PeerHints, &self.key);
        let unix_ms = |stored: Instant| {
            let wall = now.1.checked_sub(now.0.saturating_duration_since(stored)).unwrap_or(now.1);
            wall.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64
        };
        for (member, list) in hints {
            let mut by_ns: HashMap<NamespaceId, Vec<(BlockKey, u64)>> = HashMap::new();
            for h in list {
                by_ns.entry(h.ns).or_default().push((h.key, unix_ms(h.stored)));
            }
            for (namespace, all) in by_ns {
                for part in all.chunks(MAX_HINTS_PER_RECORD) {
                    let r = PeerHintsRecord { member: member.as_str(), namespace, hints: part.to_vec() };
                    data.extend(encode_record(&self.key, &r.encode()));
                }
            }
        }
        self.fs.replace(&self.path, &data)
    }
}

/// Sends the hints of members that answer again, every [`PASS_EVERY`] while there are any, until
/// `stop` turns true. On a node with a disk tier, the hints saved before a restart are taken
/// back first, and the hints are saved as they change and at the stop.
pub async fn handoff_loop(state: Arc<NodeState>, mut stop: watch::Receiver<bool>) {
    let Some(peers) = state.tiers().peers().cloned() else { return };
    let log = match state.tiers().disk() {
        Some(_) => open_log(&state, &peers),
        None => None,
    };
    let mut saved = peers.hints().lock().changes();
    let mut last_save = Instant::now();
    loop {
        let stopping = tokio::select! {
            _ = crate::stopped(&mut stop) => true,
            _ = tokio::time::sleep(PASS_EVERY) => false,
        };
        if !stopping && !peers.hints().lock().is_empty() {
            handoff_pass(&state, &peers).await;
        }
        if let Some(log) = &log {
            let changes = peers.hints().lock().changes();
            if changes != saved && (stopping || last_save.elapsed() >= SAVE_EVERY) {
                save(log, &peers).await;
                (saved, last_save) = (changes, Instant::now());
            }
        }
        if stopping {
            return;
        }
    }
}

/// Opens the node's [`HintsLog`] and takes its hints back (a log that can't be opened is said,
/// and the hints are kept in memory only).
fn open_log(state: &NodeState, peers: &PeerTier) -> Option<Arc<HintsLog>> {
    let dir = &state.config().data_dir;
    match HintsLog::open(dir, crate::fs::StdFs::shared()) {
        Ok((log, saved)) => {
            if !saved.is_empty() {
                let (now, wall) = (Instant::now(), SystemTime::now());
                let mut hints = peers.hints().lock();
                let mut dropped = 0;
                for (member, ns, key, stored) in &saved {
                    let age = wall.duration_since(*stored).unwrap_or_default();
                    let at = now.checked_sub(age).unwrap_or(now);
                    dropped += hints.add(member, *ns, std::slice::from_ref(key), at);
                }
                drop(hints);
                if dropped > 0 {
                    peers.count_forward_dropped(dropped as u64);
                }
                ::metrics::gauge!("kvtier_peer_handoff_pending").set(peers.hints().lock().len() as f64);
                tracing::info!(
                    blocks = saved.len(),
                    "blocks owed to owners that were down, from before the restart: handed to them when they answer"
                );
            }
            Some(Arc::new(log))
        }
        Err(e) => {
            tracing::error!("{}: {e}; hints of blocks owed to owners are kept in memory only", HintsLog::FILE);
            None
        }
    }
}

/// Writes the hints to `log`, off the async workers; a failure is logged and counted
/// (`kvtier_peer_hints_unsaved_total`), and the next change writes them all again.
async fn save(log: &Arc<HintsLog>, peers: &Arc<PeerTier>) {
    let snapshot = peers.hints().lock().snapshot();
    let log = log.clone();
    let done = tokio::task::spawn_blocking(move || log.write(&snapshot, (Instant::now(), SystemTime::now()))).await;
    let err = match done {
        Ok(Ok(())) => return,
        Ok(Err(e)) => e.to_string(),
        Err(e) => e.to_string(),
    };
    ::metrics::counter!("kvtier_peer_hints_unsaved_total").increment(1);
    tracing::error!("{}: cannot write the hints of blocks owed to owners: {err}", HintsLog::FILE);
}

/// What one pass did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Handoff {
    /// Blocks the members took.
    pub sent: u64,
    /// Hints given up: aged out, the block gone from here, the namespace gone or deleted since,
    /// the member no longer an owner, or no room to keep them after a failure.
    pub given_up: u64,
}

/// One pass: every member with hints that is in the membership and not known to be down gets
/// (up to [`PASS_KEYS`] of) its blocks.
pub async fn handoff_pass(state: &NodeState, peers: &Arc<PeerTier>) -> Handoff {
    let now = Instant::now();
    let mut out = Handoff::default();
    let members = {
        let mut hints = peers.hints().lock();
        out.given_up += now.checked_sub(HINT_FOR).map_or(0, |t| hints.expire(t)) as u64;
        hints.members()
    };
    let p = peers.placement();
    for id in members {
        let Some(at) = p.members().iter().position(|m| m.id == id) else { continue };
        let member = &p.members()[at];
        if peers.is_down(&member.id, now) {
            continue;
        }
        let (sent_before, given_up_before) = (out.sent, out.given_up);
        let taken = peers.hints().lock().take(&id, PASS_KEYS);
        let mut by_ns: HashMap<NamespaceId, Vec<Hint>> = HashMap::new();
        for h in taken {
            by_ns.entry(h.ns).or_default().push(h);
        }
        let mut unsent = Vec::new();
        let mut failed = false;
        // The first request of a pass carries one block: a member still unreachable (a partition)
        // costs one block read per pass, not a chunk's.
        let mut probed = false;
        for (ns_id, hints) in by_ns {
            if failed {
                unsent.extend(hints);
                continue;
            }
            let Ok(ns) = state.namespace(&ns_id) else {
                out.given_up += hints.len() as u64;
                continue;
            };
            let rf = peers.rf_for(&ns);
            let mut chunk: Vec<StoredBlock> = Vec::new();
            let mut in_chunk: Vec<Hint> = Vec::new();
            let mut bytes = 0usize;
            let last = hints.len();
            for (i, h) in hints.into_iter().enumerate() {
                if failed {
                    unsent.push(h);
                    continue;
                }
                let owner = p.owners(&ns_id, &h.key, rf).contains(&at);
                // This node's own DRAM and disk only (G1 is not asked to spill for a hint).
                let held = state.tiers().tiers().any(|t| t.contains(&ns_id, &h.key));
                if !owner || !held || peers.deleted_since(&ns_id, h.stored) {
                    out.given_up += 1;
                } else {
                    match state.tiers().get_for_node(&ns_id, &h.key).await {
                        Load::Hit(b) => {
                            bytes += b.payload.len();
                            chunk.push(b);
                            in_chunk.push(h);
                        }
                        // The disk's read budget taken by loads now: the next pass.
                        Load::Busy => unsent.push(h),
                        Load::Miss => out.given_up += 1,
                    }
                }
                if !chunk.is_empty() && (!probed || bytes >= CHUNK_BYTES || i + 1 == last) {
                    probed = true;
                    match peers.bounded(member, peers.transport().put(member, &ns, &chunk)).await {
                        Ok(held) => {
                            out.sent += held as u64;
                            // Refused there (no room, a quota): not a miss to remember.
                            out.given_up += chunk.len().saturating_sub(held) as u64;
                            peers.count_forwarded(held as u64, chunk.iter().map(|b| b.payload.len() as u64).sum());
                        }
                        Err(e) => {
                            failed = matches!(e, ServerError::Peer { .. });
                            peers.failed(member, "put", &e);
                            if failed {
                                unsent.append(&mut in_chunk);
                            } else {
                                out.given_up += chunk.len() as u64;
                            }
                        }
                    }
                    chunk.clear();
                    in_chunk.clear();
                    bytes = 0;
                }
            }
        }
        let mut hints = peers.hints().lock();
        if !unsent.is_empty() {
            out.given_up += hints.put_back(&id, unsent) as u64;
        }
        // What was taken and given back unchanged (the member still unreachable) is no change.
        if out.sent > sent_before || out.given_up > given_up_before {
            hints.mark_changed();
        }
    }
    ::metrics::counter!("kvtier_peer_handoff_sent_total").increment(out.sent);
    ::metrics::counter!("kvtier_peer_handoff_given_up_total").increment(out.given_up);
    ::metrics::gauge!("kvtier_peer_handoff_pending").set(peers.hints().lock().len() as f64);
    if out.sent > 0 {
        tracing::info!(
            sent = out.sent,
            "blocks owed to their owners were handed to them (missed while they were down, or moved to them)"
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u32) -> BlockKey {
        let mut k = [0u8; 32];
        k[..4].copy_from_slice(&i.to_le_bytes());
        BlockKey(k)
    }

    #[test]
    fn hints_are_bounded_taken_oldest_first_and_given_back_ahead() {
        let (a, b) = (NodeId::new("a").unwrap(), NodeId::new("b").unwrap());
        let (ns1, ns2) = (NamespaceId([1; 16]), NamespaceId([2; 16]));
        let t0 = Instant::now();
        let mut h = Hints::default();
        let keys: Vec<BlockKey> = (0..10).map(key).collect();
        assert_eq!(h.add(&a, ns1, &keys, t0), 0);
        assert_eq!(h.add(&b, ns2, &keys[..4], t0 + Duration::from_secs(5)), 0);
        assert_eq!(h.len(), 14);
        let first = h.take(&a, 3);
        assert_eq!(first.iter().map(|x| x.key).collect::<Vec<_>>(), keys[..3]);
        // Taken and given back is no change to save; an expiry that removes nothing neither.
        let changes = h.changes();
        assert_eq!(h.put_back(&a, first[1..].to_vec()), 0);
        assert_eq!(h.expire(t0), 0);
        assert_eq!(h.changes(), changes, "nothing changed to save");
        assert_eq!(h.take(&a, 2).iter().map(|x| x.key).collect::<Vec<_>>(), keys[1..3], "given back ahead");
        assert_eq!(h.len(), 11);
        // Expired: a's (stored at t0), not b's.
        assert_eq!(h.expire(t0 + Duration::from_secs(1)), 7);
        assert!(h.changes() > changes, "an expiry that removed hints is a change");
        assert_eq!(h.members(), std::slice::from_ref(&b));
        assert_eq!(h.forget_namespace(&ns2), 4);
        assert!(h.is_empty() && h.members().is_empty());

        // Bounded: what does not fit is said, on add and on giving back.
        let many: Vec<BlockKey> = (0..MAX_HINTS as u32 + 5).map(key).collect();
        assert_eq!(h.add(&a, ns1, &many, t0), 5);
        assert_eq!(h.len(), MAX_HINTS);
        let taken = h.take(&a, 10);
        assert_eq!(h.add(&b, ns1, &many[..4], t0), 0);
        assert_eq!(h.put_back(&a, taken), 4, "the room was taken meanwhile");
        assert_eq!(h.len(), MAX_HINTS);
    }
}
