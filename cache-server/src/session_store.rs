//! Parked sessions as the node keeps them: the in-memory [`SessionTable`] behind one short lock,
//! and the [`SessionLog`] written outside it. A change is made (and its pins taken) under the
//! lock, given a sequence number there, and appended and synced after the lock is released, so a
//! slow disk delays only the park that waits for it, never another session's resume. A park whose
//! record can't be written is undone (if nothing changed the session since) and reported.
//!
//! Every call that changes a session may block on the log: run it on the I/O pool, not on an
//! async worker. The remembered drops (`remember_drop_at`, `dropped_at`) are logged too where the
//! node has a log, and restored from it at start ([`SessionStore::restore_drops`]).

use std::time::{Duration, Instant, SystemTime};

use kvtier_proto::{BlockKey, NamespaceId};
use parking_lot::Mutex;

use crate::error::ServerError;
use crate::events::{EventBus, EventKind};
use crate::remembered::RememberedIds;
use crate::session_log::{unix_ms, LoggedSession, SessionLog};
use crate::sessions::{ParkSpec, SessionLimits, SessionManifest, SessionTable};
use crate::tiers::PinTier;

pub struct SessionStore {
    table: Mutex<SessionTable>,
    log: Option<SessionLog>,
    /// Where session events go (parked, dropped, expired), once the node attached its bus.
    events: std::sync::OnceLock<std::sync::Arc<EventBus>>,
    /// Sessions dropped here lately (a client's drop, or one passed on by the node that took
    /// it), and when: a copy last touched before is a dropped one, not to be taken back from a
    /// node that was away during the drop. Logged where there is a log (so a restart keeps them).
    /// At most [`MAX_DROPS_REMEMBERED`]; past it, the oldest of the namespace remembering the
    /// most are forgotten, so one tenant's flood of drops can't forget another's.
    drops: Mutex<RememberedIds>,
}

/// How long a drop is remembered against copies of the session coming back.
pub const DROP_REMEMBERED: Duration = Duration::from_secs(3600);

/// The session id a namespace's unregistration is remembered under, as a drop of every session
/// it had (no session has an empty id: parks refuse one).
const WHOLE_NAMESPACE: &str = "";

/// Most drops remembered at once (past it, see [`RememberedIds`]).
const MAX_DROPS_REMEMBERED: usize = 65_536;

/// A change that is made in memory and still has to reach the log.
struct Pending {
    seq: u64,
    record: LoggedSession,
}

fn logged(m: &SessionManifest, now: Instant) -> LoggedSession {
    let expires = SystemTime::now() + m.expires_at.saturating_duration_since(now);
    LoggedSession {
        namespace: m.namespace,
        id: m.id.clone(),
        keys: m.keys.clone(),
        tail: m.tail,
        token_count: m.token_count,
        ttl_ms: m.ttl.as_millis() as u64,
        expires_unix_ms: unix_ms(expires),
        priority: m.priority,
        version: m.version,
        dropped_unix_ms: 0,
        created_unix_ms: m.created.map_or(0, |c| {
            unix_ms(SystemTime::now()).saturating_sub(now.saturating_duration_since(c).as_millis() as u64)
        }),
    }
}

impl SessionStore {
    /// Makes room among remembered ids (drops, expiries) by tenant, as `owners` says whose each
    /// namespace is.
    pub fn set_namespace_owners(&self, owners: crate::remembered::NamespaceOwners) {
        self.table.lock().set_namespace_owners(owners.clone());
        self.drops.lock().set_owners(owners);
    }

    pub fn new(log: Option<SessionLog>) -> Self {
        SessionStore {
            table: Mutex::new(SessionTable::default()),
            log,
            events: std::sync::OnceLock::new(),
            drops: Mutex::new(RememberedIds::new(MAX_DROPS_REMEMBERED)),
        }
    }

    /// Remembers that session `id` was dropped (everywhere) at `at` (now, or learned from the
    /// node that took the drop): a later drop already remembered stays (a time never moves back,
    /// nor past the drop). With a log, a drop remembered anew is appended to it (not synced: a
    /// power loss may forget it, a killed process does not), so this may block on the log.
    pub fn remember_drop_at(&self, ns: NamespaceId, id: &str, at: Instant) {
        // No session has an empty id (requests are refused one): a drop of one is nothing to
        // remember, and must not pass for the namespace's unregistration.
        if id.is_empty() {
            return;
        }
        self.remember_dropped(ns, id, at);
    }

    /// [`Self::remember_drop_at`] of a session, or of a whole namespace (under
    /// [`WHOLE_NAMESPACE`]).
    fn remember_dropped(&self, ns: NamespaceId, id: &str, at: Instant) {
        let Some(log) = &self.log else {
            self.remember(ns, id, at);
            return;
        };
        // Numbered under the lock that orders the changes to the map, appended outside it.
        let seq = {
            let mut drops = self.drops.lock();
            if drops.get(ns, id).is_some_and(|had| had >= at) {
                return;
            }
            Self::insert_drop(&mut drops, ns, id, at);
            log.next_seq()
        };
        let ago = Instant::now().saturating_duration_since(at);
        let at_ms = unix_ms(SystemTime::now()).saturating_sub(ago.as_millis() as u64);
        if let Err(e) = log.remember_drop(seq, ns, id, at_ms) {
            // Remembered in memory all the same; only a restart before the hour is out forgets it.
            tracing::warn!(session = id, "a dropped session's tombstone was not logged: {e}");
        }
    }

    /// Remembers the sessions a log's replay found expired (when, as wall-clock ms), so asking for
    /// one says it expired, as it would have had the node been running.
    pub fn restore_expired(&self, expired: Vec<(NamespaceId, String, u64)>) {
        let (now, now_ms) = (Instant::now(), unix_ms(SystemTime::now()));
        let mut table = self.table.lock();
        for (ns, id, at_ms) in expired {
            let at = now.checked_sub(Duration::from_millis(now_ms.saturating_sub(at_ms))).unwrap_or(now);
            table.remember_expired((ns, id), at);
        }
    }

    /// Puts back the drops a log's replay found (within [`DROP_REMEMBERED`], as wall-clock ms).
    pub fn restore_drops(&self, drops: Vec<(NamespaceId, String, u64)>) {
        let (now, now_ms) = (Instant::now(), unix_ms(SystemTime::now()));
        for (ns, id, at_ms) in drops {
            let ago = Duration::from_millis(now_ms.saturating_sub(at_ms));
            if let Some(at) = now.checked_sub(ago) {
                self.remember(ns, &id, at);
            }
        }
    }

    /// Remembers a drop in memory only.
    fn remember(&self, ns: NamespaceId, id: &str, at: Instant) {
        Self::insert_drop(&mut self.drops.lock(), ns, id, at);
    }

    fn insert_drop(drops: &mut RememberedIds, ns: NamespaceId, id: &str, at: Instant) {
        let now = Instant::now();
        drops.insert_latest(ns, id, at, |at| now.duration_since(*at) < DROP_REMEMBERED);
    }

    /// When session `id` was dropped here, if within [`DROP_REMEMBERED`]: its own drop, or its
    /// namespace's unregistration ([`Self::remember_unregistered_at`]), whichever came later.
    pub fn dropped_at(&self, ns: NamespaceId, id: &str) -> Option<Instant> {
        let drops = self.drops.lock();
        let own = drops.get(ns, id);
        let all = drops.get(ns, WHOLE_NAMESPACE);
        own.max(all).filter(|at| at.elapsed() < DROP_REMEMBERED)
    }

    /// Remembers that namespace `ns` was unregistered at `at`, which dropped every session it had
    /// then: a copy of one of them, last touched before, is not taken back from a node that was
    /// away (a resume through a node that took the unregistration re-registers the namespace, and
    /// adopted the away node's copy). Logged, restored and forgotten after [`DROP_REMEMBERED`] as
    /// a session's drop is.
    pub fn remember_unregistered_at(&self, ns: NamespaceId, at: Instant) {
        self.remember_dropped(ns, WHOLE_NAMESPACE, at);
    }

    /// Whether `m` is a copy of a session dropped at `dropped` (or after it was last touched:
    /// parked, extended or resumed, which restart its TTL).
    pub fn touched_before(m: &SessionManifest, dropped: Instant) -> bool {
        m.expires_at.checked_sub(m.ttl).is_none_or(|touched| touched < dropped)
    }

    /// [`Self::touched_before`] of a drop `dropped_ago` before `now`, by ages (a drop learned
    /// from another node may be older than this machine's clock).
    pub fn touched_before_ago(m: &SessionManifest, dropped_ago: Duration, now: Instant) -> bool {
        let touched_ago = m.expires_at.checked_sub(m.ttl).map_or(Duration::MAX, |t| now.saturating_duration_since(t));
        touched_ago > dropped_ago
    }

    /// Whether `m` is a copy of a session this node dropped since it was last touched.
    pub fn is_dropped_copy(&self, m: &SessionManifest) -> bool {
        self.dropped_at(m.namespace, &m.id).is_some_and(|at| Self::touched_before(m, at))
    }

    /// Publishes session events through `bus` from now on (once).
    pub fn attach_events(&self, bus: std::sync::Arc<EventBus>) {
        let _ = self.events.set(bus);
    }

    fn emit(&self, kind: EventKind, ns: &NamespaceId, id: &str) {
        if let Some(bus) = self.events.get() {
            bus.session(kind, ns, id);
        }
    }

    pub fn len(&self) -> usize {
        self.table.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn publish(&self, n: usize) {
        ::metrics::gauge!("kvtier_sessions").set(n as f64);
    }

    /// Applies `change` under the table lock; with a log, numbers the manifest it returns and
    /// appends it after the lock is released, undoing the change if the append fails.
    fn change(
        &self,
        pins: &dyn PinTier,
        (ns, id): (NamespaceId, &str),
        change: impl FnOnce(&mut SessionTable, Instant) -> Result<SessionManifest, ServerError>,
    ) -> Result<SessionManifest, ServerError> {
        let now = Instant::now();
        let (m, prev, pending) = {
            let mut table = self.table.lock();
            // What the change replaces, put back if it can't be logged.
            let prev = self.log.as_ref().and_then(|_| table.peek(ns, id, now));
            let m = change(&mut table, now)?;
            self.publish(table.len());
            let pending = self.log.as_ref().map(|log| Pending { seq: log.next_seq(), record: logged(&m, now) });
            (m, prev, pending)
        };
        let (Some(log), Some(p)) = (&self.log, pending) else {
            self.emit(EventKind::SessionParked, &m.namespace, &m.id);
            return Ok(m);
        };
        if let Err(e) = log.put(p.seq, &p.record) {
            // Taken back: the session as it was (its blocks pinned again), or none if it was new.
            // Before, a replace that could not be logged (a full disk) dropped the session whole,
            // unpinning the version the log still held.
            let mut table = self.table.lock();
            let put_back = prev.map(|prev| table.revert(pins, &m, prev));
            if !matches!(put_back, Some(Ok(_))) {
                if let Some(Err(why)) = &put_back {
                    tracing::error!(session = %m.id, "a change that could not be logged left the session dropped here: {why}");
                }
                table.undo(pins, m.namespace, &m.id, m.version);
            }
            self.publish(table.len());
            return Err(e);
        }
        self.emit(EventKind::SessionParked, &m.namespace, &m.id);
        Ok(m)
    }

    /// Creates or replaces a session (see [`SessionTable::park`]); durable on return when the
    /// node logs sessions.
    pub fn park(
        &self,
        pins: &dyn PinTier,
        spec: ParkSpec,
        limits: &SessionLimits,
    ) -> Result<SessionManifest, ServerError> {
        let (ns, id) = (spec.namespace, spec.id.clone());
        self.change(pins, (ns, &id), |t, now| t.park(pins, spec, limits, now))
    }

    /// Whether a replica's copy would pass its checks now (see
    /// [`SessionTable::check_put_replica`]): asked before its blocks are made durable.
    pub fn check_put_replica(&self, m: &SessionManifest, limits: &SessionLimits) -> Result<(), ServerError> {
        self.table.lock().check_put_replica(m, limits, Instant::now())
    }

    /// Whether a park would pass its checks now (see [`SessionTable::check_park`]): asked before
    /// its blocks are made durable, so a refused park writes nothing.
    pub fn check_park(&self, spec: &ParkSpec, limits: &SessionLimits) -> Result<(), ServerError> {
        self.table.lock().check_park(spec, limits, Instant::now())
    }

    /// Whether an extend of the session as it is now would pass its checks (see
    /// [`SessionTable::check_extend`]): asked before the new blocks are made durable, so a
    /// refused extend writes nothing.
    #[allow(clippy::too_many_arguments)]
    pub fn check_extend(
        &self,
        ns: NamespaceId,
        id: &str,
        expected_version: u64,
        base_blocks: usize,
        base_key: Option<kvtier_proto::BlockKey>,
        shape: (usize, bool, u64),
        limits: &SessionLimits,
    ) -> Result<(), ServerError> {
        let table = self.table.lock();
        table.check_extend(ns, id, expected_version, base_blocks, base_key, shape, limits, Instant::now())
    }

    /// Appends blocks to a session (see [`SessionTable::extend`]).
    #[allow(clippy::too_many_arguments)]
    pub fn extend(
        &self,
        pins: &dyn PinTier,
        ns: NamespaceId,
        id: &str,
        expected_version: u64,
        base_blocks: usize,
        base_key: Option<kvtier_proto::BlockKey>,
        new_keys: Vec<kvtier_proto::BlockKey>,
        tail: Option<kvtier_proto::BlockKey>,
        token_count: u64,
        limits: &SessionLimits,
    ) -> Result<SessionManifest, ServerError> {
        self.change(pins, (ns, id), |t, now| {
            t.extend(pins, ns, id, expected_version, base_blocks, base_key, new_keys, tail, token_count, limits, now)
        })
    }

    /// The manifest, its TTL restarted. (The new expiry is not logged: after a restart a session
    /// expires by its last park's clock at the latest, never earlier than its TTL from that park.)
    pub fn resume(&self, pins: &dyn PinTier, ns: NamespaceId, id: &str) -> Result<SessionManifest, ServerError> {
        let mut table = self.table.lock();
        let out = table.resume(pins, ns, id, Instant::now());
        self.publish(table.len());
        out
    }

    /// Keeps another node's copy of a session (see [`SessionTable::put_replica`]); durable on
    /// return when the node logs sessions.
    pub fn put_replica(
        &self,
        pins: &dyn PinTier,
        m: SessionManifest,
        limits: &SessionLimits,
    ) -> Result<SessionManifest, ServerError> {
        let (ns, id) = (m.namespace, m.id.clone());
        self.change(pins, (ns, &id), |t, now| t.put_replica(pins, m, limits, now))
    }

    /// Undoes this node's write `made` of a session, refused as one made at the same time as
    /// another node's: `prev` (the session before it) put back, or with none the session taken
    /// out; logged like any change. Nothing changes when the session moved on since.
    pub fn revert(
        &self,
        pins: &dyn PinTier,
        made: &SessionManifest,
        prev: Option<SessionManifest>,
    ) -> Result<(), ServerError> {
        let Some(prev) = prev else {
            return self.drop_replica(pins, made.namespace, &made.id, made.version).map(|_| ());
        };
        let now = Instant::now();
        let (back, pending) = {
            let mut table = self.table.lock();
            let back = table.revert(pins, made, prev)?;
            self.publish(table.len());
            let pending = self.log.as_ref().map(|log| Pending { seq: log.next_seq(), record: logged(&back, now) });
            (back, pending)
        };
        if let (Some(log), Some(p)) = (&self.log, pending) {
            if let Err(e) = log.put(p.seq, &p.record) {
                // Not logged: `made` (the log's last word) stands again, rather than nothing.
                let mut table = self.table.lock();
                let _ = table.revert(pins, &back, made.clone());
                self.publish(table.len());
                return Err(e);
            }
        }
        self.emit(EventKind::SessionParked, &back.namespace, &back.id);
        Ok(())
    }

    /// How long ago session `id` expired here, if it did and was not parked again since.
    pub fn expired_ago(&self, ns: NamespaceId, id: &str) -> Option<Duration> {
        self.table.lock().expired_ago(ns, id, Instant::now())
    }

    /// This node's copy of a live session, its TTL untouched.
    pub fn peek(&self, ns: NamespaceId, id: &str) -> Option<SessionManifest> {
        self.table.lock().peek(ns, id, Instant::now())
    }

    /// When a live session was last parked, extended or resumed.
    pub fn touched(&self, ns: NamespaceId, id: &str) -> Option<Instant> {
        self.table.lock().touched(ns, id, Instant::now())
    }

    /// Drops a session; false if there was none. With a log, the drop is logged first: one that
    /// can't be (a full disk) changes nothing and is the caller's error, so a drop that was
    /// answered never comes back after a restart.
    pub fn drop_session(&self, pins: &dyn PinTier, ns: NamespaceId, id: &str) -> Result<bool, ServerError> {
        self.drop_if(pins, ns, id, u64::MAX)
    }

    /// Drops this node's copy of a session if its version is at most `version` (logged first, as
    /// [`Self::drop_session`]).
    pub fn drop_replica(
        &self,
        pins: &dyn PinTier,
        ns: NamespaceId,
        id: &str,
        version: u64,
    ) -> Result<bool, ServerError> {
        self.drop_if(pins, ns, id, version)
    }

    /// Drops a session from memory only, for a caller that logged its going another way (its
    /// namespace's unregistration, which replay applies to its sessions).
    pub fn forget_session(&self, pins: &dyn PinTier, ns: NamespaceId, id: &str) -> bool {
        self.take_out(ns, id, |t| t.drop_session(pins, ns, id))
    }

    /// Runs `remove` on the table (true if it took the session out), then publishes the count
    /// and, if it went, the event.
    fn take_out(&self, ns: NamespaceId, id: &str, remove: impl FnOnce(&mut SessionTable) -> bool) -> bool {
        let mut table = self.table.lock();
        let dropped = remove(&mut table);
        self.publish(table.len());
        drop(table);
        if dropped {
            self.emit(EventKind::SessionDropped, &ns, id);
        }
        dropped
    }

    fn drop_if(&self, pins: &dyn PinTier, ns: NamespaceId, id: &str, version: u64) -> Result<bool, ServerError> {
        let Some(log) = &self.log else {
            return Ok(self.take_out(ns, id, |t| t.drop_replica(pins, ns, id, version)));
        };
        // The version seen and the tombstone's number, under the lock; the tombstone appended
        // outside it (as `change` appends); then the session taken out if nothing replaced it
        // meanwhile. A park that did replace it holds a later number, so replay keeps it too.
        let (seen, seq) = {
            let table = self.table.lock();
            match table.version_of(ns, id) {
                Some(v) if v <= version => (v, log.next_seq()),
                _ => return Ok(false),
            }
        };
        log.delete(seq, ns, id).map_err(|e| {
            tracing::warn!(session = id, "drop refused: it could not be logged: {e}");
            e
        })?;
        // False when another call took it out meanwhile, or a park replaced it (that park holds
        // a later number than the tombstone, so replay keeps it too).
        Ok(self.take_out(ns, id, |t| t.undo(pins, ns, id, seen)))
    }

    /// See `SessionTable::check_extend_tail`.
    pub fn check_extend_tail(
        &self,
        ns: NamespaceId,
        id: &str,
        expected_version: u64,
        base_blocks: usize,
        tail: BlockKey,
        limits: &SessionLimits,
    ) -> Result<(), ServerError> {
        self.table.lock().check_extend_tail(ns, id, expected_version, base_blocks, tail, limits)
    }

    /// A live session's token count, its TTL untouched; `None` when there is none.
    pub fn tokens_of(&self, ns: NamespaceId, id: &str) -> Option<u64> {
        self.table.lock().tokens_of(ns, id, Instant::now())
    }

    /// Sessions and the bytes they stand for, over `namespaces`.
    pub fn count_in(&self, namespaces: &[NamespaceId]) -> (u64, u64) {
        self.table.lock().count_in(namespaces)
    }

    /// A page of the live sessions (see `SessionTable::list_page`).
    pub fn list_page(
        &self,
        ns: Option<NamespaceId>,
        after: Option<(NamespaceId, &str)>,
        limit: usize,
        keep: impl Fn(&SessionManifest) -> bool,
    ) -> (Vec<SessionManifest>, bool) {
        self.table.lock().list_page(ns, after, limit, keep, Instant::now())
    }

    pub fn list(&self, ns: Option<NamespaceId>) -> Vec<SessionManifest> {
        self.table.lock().list(ns, Instant::now())
    }

    /// Removes every session expired by now, unpinning its blocks; returns how many went.
    pub fn expire(&self, pins: &dyn PinTier) -> usize {
        let (dead, seqs) = {
            let mut table = self.table.lock();
            let dead = table.expire(pins, Instant::now());
            if dead.is_empty() {
                return 0;
            }
            self.publish(table.len());
            let seqs: Vec<u64> = match &self.log {
                Some(log) => dead.iter().map(|_| log.next_seq()).collect(),
                None => Vec::new(),
            };
            (dead, seqs)
        };
        ::metrics::counter!("kvtier_sessions_expired_total").increment(dead.len() as u64);
        for (ns, id) in &dead {
            self.emit(EventKind::SessionExpired, ns, id);
        }
        if let Some(log) = &self.log {
            // An expiry that can't be logged needs none: its record's expiry is in the log, and
            // a restart drops it by that.
            for ((ns, id), seq) in dead.iter().zip(seqs) {
                let _ = log.delete(seq, *ns, id);
            }
        }
        dead.len()
    }

    /// Writes tombstones for logged sessions that are not restored (their namespace is gone), so
    /// the next start does not meet them again; best effort: if one can't be written, that start
    /// drops it the same way.
    pub fn forget_logged(&self, sessions: &[LoggedSession]) {
        if let Some(log) = &self.log {
            for s in sessions {
                let _ = log.delete(log.next_seq(), s.namespace, &s.id);
            }
        }
    }

    /// Puts back sessions recovered from the log, pinning their blocks; a session whose blocks
    /// are gone is dropped from the log. Returns (restored, lost).
    pub fn restore(&self, pins: &dyn PinTier, sessions: Vec<(LoggedSession, u64)>) -> (u64, u64) {
        let now = Instant::now();
        let now_ms = unix_ms(SystemTime::now());
        let mut table = self.table.lock();
        let (mut ok, mut lost) = (0u64, 0u64);
        for (s, per_token) in sessions {
            // A record whose size overflows is a damaged one: the session is lost, as one whose
            // blocks are gone.
            let Some(bytes) = s.token_count.checked_mul(per_token) else {
                lost += 1;
                table.mark_lost(s.namespace, &s.id);
                tracing::error!(session = %s.id, tokens = s.token_count, "parked session's record is damaged (its size overflows)");
                if let Some(log) = &self.log {
                    let _ = log.delete(log.next_seq(), s.namespace, &s.id);
                }
                continue;
            };
            let m = SessionManifest {
                namespace: s.namespace,
                bytes,
                keys: s.keys,
                tail: s.tail,
                token_count: s.token_count,
                ttl: Duration::from_millis(s.ttl_ms),
                expires_at: now + Duration::from_millis(s.expires_unix_ms.saturating_sub(now_ms)),
                priority: s.priority,
                version: s.version,
                id: s.id,
                created: match s.created_unix_ms {
                    0 => None,
                    at => now.checked_sub(Duration::from_millis(now_ms.saturating_sub(at))),
                },
            };
            let (ns, id) = (m.namespace, m.id.clone());
            match table.restore(pins, m) {
                Ok(()) => ok += 1,
                Err(e) => {
                    lost += 1;
                    table.mark_lost(ns, &id);
                    tracing::error!(session = %id, "parked session lost its blocks on disk: {e}");
                    if let Some(log) = &self.log {
                        let _ = log.delete(log.next_seq(), ns, &id);
                    }
                }
            }
        }
        self.publish(table.len());
        (ok, lost)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kvtier_proto::{CodecId, DType, FrameHeader, KvLayout};

    use super::*;
    use crate::dram::{DramConfig, DramTier, Priority};
    use crate::session_log::Replayed;

    const BT: u32 = 4;

    fn layout() -> KvLayout {
        KvLayout::new(1, 1, 8, DType::Fp16, BT)
    }

    fn limits() -> SessionLimits {
        SessionLimits {
            block_tokens: BT,
            bytes_per_token: layout().bytes_per_token(),
            max_context_tokens: 1 << 20,
            quota: None,
            max_manifest_keys: 1 << 24,
        }
    }

    fn block(tier: &DramTier, ns: NamespaceId, k: u16) -> BlockKey {
        let mut key = [0u8; 32];
        key[..2].copy_from_slice(&k.to_le_bytes());
        let key = BlockKey(key);
        let payload = vec![k as u8; layout().block_bytes() as usize];
        let header = FrameHeader {
            codec: CodecId::RAW,
            flags: 0,
            tokens: BT,
            namespace: ns,
            key,
            layout: layout(),
            payload_len: payload.len() as u64,
            checksum: kvtier_proto::checksum(&payload),
        };
        tier.insert(header, &payload, Priority::Normal).unwrap();
        key
    }

    fn spec(ns: NamespaceId, id: &str, keys: Vec<BlockKey>, expected_version: u64) -> ParkSpec {
        ParkSpec {
            namespace: ns,
            id: id.into(),
            token_count: keys.len() as u64 * u64::from(BT),
            keys,
            tail: None,
            ttl: Duration::from_secs(600),
            priority: Priority::Normal,
            expected_version,
        }
    }

    /// Many threads change the same sessions at once; their log appends race (each is made
    /// outside the table lock). Whatever order they reached the file in, replay finds every
    /// session at the version the table ended with.
    #[test]
    fn racing_appends_replay_to_the_final_versions() {
        let dir = tempfile::tempdir().unwrap();
        let tier = Arc::new(DramTier::new(DramConfig::new(64 << 20)));
        let ns = NamespaceId([5; 16]);
        let keys: Vec<BlockKey> = (0..64).map(|i| block(&tier, ns, i)).collect();
        let (log, _) = SessionLog::open(dir.path(), true, 0).unwrap();
        let store = Arc::new(SessionStore::new(Some(log)));
        let sessions = ["a", "b", "c"];
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let (store, tier, keys) = (store.clone(), tier.clone(), keys.clone());
                std::thread::spawn(move || {
                    let mut done = 0;
                    for round in 0..60usize {
                        let id = sessions[(round + t) % sessions.len()];
                        // Read the current version, then replace it (conflicts are expected).
                        let current = store.list(Some(ns)).into_iter().find(|m| m.id == id).map_or(0, |m| m.version);
                        let n = 1 + (round * 7 + t) % 60;
                        let r = store.park(tier.as_ref(), spec(ns, id, keys[..n].to_vec(), current), &limits());
                        match r {
                            Ok(_) => done += 1,
                            Err(ServerError::VersionConflict { .. } | ServerError::SessionExists(_)) => {}
                            Err(e) => panic!("{e}"),
                        }
                        if round % 17 == 5 {
                            store.drop_session(tier.as_ref(), ns, id).unwrap();
                        }
                    }
                    done
                })
            })
            .collect();
        let parks: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
        assert!(parks > 20, "the threads made progress ({parks} parks)");
        let mut expected: Vec<(String, u64, usize)> =
            store.list(Some(ns)).into_iter().map(|m| (m.id, m.version, m.keys.len())).collect();
        expected.sort();
        drop(store);
        let (_log, Replayed { sessions: live, unreadable, .. }) = SessionLog::open(dir.path(), true, 0).unwrap();
        let mut replayed: Vec<(String, u64, usize)> =
            live.into_iter().map(|s| (s.id, s.version, s.keys.len())).collect();
        replayed.sort();
        assert_eq!(unreadable, 0);
        assert_eq!(replayed, expected);
    }

    /// A store on the synced session log in `dir`, opened now, and what its replay found.
    fn synced_store(dir: &std::path::Path) -> (SessionStore, Replayed) {
        let (log, replayed) = SessionLog::open(dir, true, unix_ms(SystemTime::now())).unwrap();
        (SessionStore::new(Some(log)), replayed)
    }

    /// A drop remembered with a log is back after a restart, as of when it was made (not when
    /// the node started again), so a copy touched before it is still a dropped copy and a session
    /// parked after it is not; remembering the same drop again writes nothing.
    #[test]
    fn a_remembered_drop_comes_back_with_its_time() {
        let dir = tempfile::tempdir().unwrap();
        let tier = DramTier::new(DramConfig::new(1 << 20));
        let ns = NamespaceId([6; 16]);
        let keys: Vec<BlockKey> = (0..2).map(|i| block(&tier, ns, i)).collect();
        let (store, _) = synced_store(dir.path());
        let old = store.park(&tier, spec(ns, "s", keys.clone(), 0), &limits()).unwrap();
        // The log keeps milliseconds: the drop well after the park, the next park well after it.
        std::thread::sleep(Duration::from_millis(20));
        let at = Instant::now();
        store.drop_session(&tier, ns, "s").unwrap();
        store.remember_drop_at(ns, "s", at);
        let size = std::fs::metadata(dir.path().join("sessions.log")).unwrap().len();
        store.remember_drop_at(ns, "s", at - Duration::from_millis(10));
        store.remember_drop_at(ns, "s", at);
        assert_eq!(std::fs::metadata(dir.path().join("sessions.log")).unwrap().len(), size, "logged twice");
        std::thread::sleep(Duration::from_millis(20));
        let new = store.park(&tier, spec(ns, "s", keys, 0), &limits()).unwrap();
        drop(store);

        let (store, replayed) = synced_store(dir.path());
        store.restore_drops(replayed.drops);
        let back = store.dropped_at(ns, "s").expect("the drop is remembered");
        let off = if back > at { back - at } else { at - back };
        assert!(off < Duration::from_millis(5), "remembered {off:?} away from when it was made");
        assert!(store.is_dropped_copy(&old), "a copy touched before the drop");
        assert!(!store.is_dropped_copy(&new), "the session parked after the drop");

        // The namespace unregistered later: every session of it counts as dropped then, and
        // that is logged and comes back too; another namespace's sessions are untouched. Well
        // after the park (the log keeps milliseconds: within one, the restored time can fall
        // before it).
        std::thread::sleep(Duration::from_millis(20));
        let gone = Instant::now();
        store.remember_unregistered_at(ns, gone);
        drop(store);
        let (store, replayed) = synced_store(dir.path());
        store.restore_drops(replayed.drops);
        for id in ["s", "never-parked"] {
            let at = store.dropped_at(ns, id).expect("the unregistration is remembered");
            let off = if at > gone { at - gone } else { gone - at };
            assert!(off < Duration::from_millis(5), "{id}: remembered {off:?} away");
        }
        assert!(store.is_dropped_copy(&new), "parked before the unregistration");
        assert_eq!(store.dropped_at(NamespaceId([9; 16]), "s"), None);
    }

    /// One namespace's flood of drops past [`MAX_DROPS_REMEMBERED`] forgets its own oldest, not
    /// another namespace's (another tenant's) drop, which still keeps its copies from coming back.
    /// Before, the node-wide map forgot the older half of every namespace's drops.
    #[test]
    fn a_flood_of_drops_in_one_namespace_does_not_forget_another_s() {
        let store = SessionStore::new(None);
        let (victim, flood) = (NamespaceId([1; 16]), NamespaceId([2; 16]));
        let at = Instant::now();
        store.remember_drop_at(victim, "s", at);
        for i in 0..MAX_DROPS_REMEMBERED + 10_000 {
            store.remember_drop_at(flood, &format!("f{i}"), Instant::now());
        }
        assert_eq!(store.dropped_at(victim, "s"), Some(at), "another namespace's drop was forgotten");
        assert!(store.dropped_at(flood, &format!("f{}", MAX_DROPS_REMEMBERED + 9_999)).is_some());
        assert!(store.dropped_at(flood, "f0").is_none(), "the flood's oldest make the room");
        assert!(store.drops.lock().len() <= MAX_DROPS_REMEMBERED);
    }

    /// A session restored at start keeps when it was created (in the log as wall-clock ms), so
    /// after a restart it still supersedes an older session's copies under its id.
    #[test]
    fn a_restored_session_keeps_its_creation() {
        let dir = tempfile::tempdir().unwrap();
        let tier = DramTier::new(DramConfig::new(1 << 20));
        let ns = NamespaceId([6; 16]);
        let keys: Vec<BlockKey> = (0..2).map(|i| block(&tier, ns, i)).collect();
        let (store, _) = synced_store(dir.path());
        let v1 = store.park(&tier, spec(ns, "s", keys.clone(), 0), &limits()).unwrap();
        std::thread::sleep(Duration::from_millis(30));
        let v2 = store.park(&tier, spec(ns, "s", keys, 1), &limits()).unwrap();
        assert_eq!(v2.created, v1.created, "a replace keeps the creation");
        drop(store);

        let (store, replayed) = synced_store(dir.path());
        let per_token = limits().bytes_per_token;
        assert_eq!(store.restore(&tier, replayed.sessions.into_iter().map(|s| (s, per_token)).collect()), (1, 0));
        let back = store.peek(ns, "s").expect("restored");
        let (was, is) = (v1.created.unwrap(), back.created.expect("its creation came back"));
        let off = if is > was { is - was } else { was - is };
        assert!(off < Duration::from_millis(5), "restored {off:?} away from when it was created");
    }

    /// A park whose record can't be appended is taken back: not visible, its pins released.
    #[test]
    fn a_park_that_cannot_be_logged_is_undone() {
        let dir = tempfile::tempdir().unwrap();
        let tier = DramTier::new(DramConfig::new(1 << 20));
        let ns = NamespaceId([6; 16]);
        let keys: Vec<BlockKey> = (0..2).map(|i| block(&tier, ns, i)).collect();
        let fault = crate::fs::fault::FaultFs::new(dir.path());
        let (log, _) = SessionLog::open_with(&fault.shared(), dir.path(), true, 0).unwrap();
        // The disk full from now on: every append fails.
        fault.enospc_from(Some(1));
        let store = SessionStore::new(Some(log));
        let err = store.park(&tier, spec(ns, "s", keys.clone(), 0), &limits()).unwrap_err();
        assert!(matches!(err, ServerError::Io(_)), "{err}");
        assert!(store.is_empty());
        assert!(tier.remove(&ns, &keys[0]), "the undone park released its pins");
    }

    /// A logged session whose blocks are gone at restore is lost, and asking for it says so
    /// (it was a bare "not found"); parking it again makes it an ordinary session.
    #[test]
    fn a_session_lost_at_restore_says_so_until_parked_again() {
        let tier = DramTier::new(DramConfig::new(1 << 20));
        let ns = NamespaceId([6; 16]);
        let kept: Vec<BlockKey> = (0..2).map(|i| block(&tier, ns, i)).collect();
        let store = SessionStore::new(None);
        let logged = |id: &str, keys: Vec<BlockKey>| LoggedSession {
            namespace: ns,
            id: id.into(),
            token_count: keys.len() as u64 * u64::from(BT),
            keys,
            tail: None,
            ttl_ms: 600_000,
            expires_unix_ms: unix_ms(SystemTime::now()) + 600_000,
            priority: Priority::Normal,
            version: 1,
            dropped_unix_ms: 0,
            created_unix_ms: 0,
        };
        let per_token = layout().bytes_per_token();
        let gone = vec![BlockKey([0xAB; 32])];
        // A record whose size overflows (damaged, its checksum right) is lost too, never a panic.
        let mut huge = logged("huge", kept.clone());
        huge.token_count = u64::MAX / 2;
        let restored = store.restore(
            &tier,
            vec![(logged("ok", kept.clone()), per_token), (logged("lost", gone), per_token), (huge, per_token)],
        );
        assert_eq!(restored, (1, 2));
        assert!(matches!(store.resume(&tier, ns, "huge"), Err(ServerError::SessionLost(_))));
        let err = store.resume(&tier, ns, "lost").unwrap_err();
        assert!(matches!(err, ServerError::SessionLost(_)), "{err}");
        assert_eq!(err.code(), kvtier_proto::codes::SESSION_NOT_FOUND);
        assert!(err.to_string().contains("lost when the node last started"), "{err}");
        assert!(matches!(store.resume(&tier, ns, "never"), Err(ServerError::SessionNotFound(_))));
        store.park(&tier, spec(ns, "lost", kept, 0), &limits()).unwrap();
        assert!(store.resume(&tier, ns, "lost").is_ok());
    }

    /// A drop whose tombstone can't be appended changes nothing and says so: the session stays
    /// (in memory as in the log, so it can't come back after a restart from a drop that was
    /// answered). Before, the drop was answered and the session reappeared after a restart.
    #[test]
    fn a_drop_that_cannot_be_logged_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let tier = DramTier::new(DramConfig::new(1 << 20));
        let ns = NamespaceId([6; 16]);
        let keys: Vec<BlockKey> = (0..2).map(|i| block(&tier, ns, i)).collect();
        let fault = crate::fs::fault::FaultFs::new(dir.path());
        let fs = fault.shared();
        let (log, _) = SessionLog::open_with(&fs, dir.path(), true, 0).unwrap();
        let store = SessionStore::new(Some(log));
        store.park(&tier, spec(ns, "s", keys.clone(), 0), &limits()).unwrap();
        fault.enospc_from(Some(1));
        let err = store.drop_session(&tier, ns, "s").unwrap_err();
        assert!(matches!(err, ServerError::Io(_)), "{err}");
        assert_eq!(store.peek(ns, "s").map(|m| m.keys), Some(keys.clone()), "still parked");
        assert!(!tier.remove(&ns, &keys[0]), "still pinned");
        // With room again, and after a restart: still parked; now the drop is logged and done.
        fault.enospc_from(None);
        drop(store);
        let (log, Replayed { sessions: live, .. }) = SessionLog::open_with(&fs, dir.path(), true, 0).unwrap();
        assert_eq!(live.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(), ["s"], "still in the log");
        let store = SessionStore::new(Some(log));
        let per_token = layout().bytes_per_token();
        assert_eq!(store.restore(&tier, live.into_iter().map(|s| (s, per_token)).collect()), (1, 0));
        assert!(store.drop_session(&tier, ns, "s").unwrap());
        assert!(!store.drop_session(&tier, ns, "s").unwrap(), "an unknown session is a plain false");
        assert!(store.is_empty());
        drop(store);
        let (_, Replayed { sessions: live, .. }) = SessionLog::open_with(&fs, dir.path(), true, 0).unwrap();
        assert!(live.is_empty(), "the drop holds across a restart");
    }
}
