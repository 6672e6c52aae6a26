//! Parked agent sessions: manifests of ordered block keys (shared with the prefix cache), an
//! optional partial tail block, a token count, a TTL and a version for compare-and-set.
//!
//! Parking pins the session's blocks (in the tier `TierStack::session_pins` names); dropping or
//! expiry unpins them. The table
//! is plain data driven with an explicit `now`, so tests control time; the server calls
//! [`SessionTable::expire`] from a timer. Pins and the manifest change under one lock, so a
//! session is never visible with blocks that are not pinned.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvtier_proto::{BlockKey, NamespaceId};

use crate::dram::Priority;
use crate::error::ServerError;
use crate::remembered::RememberedIds;
pub use crate::tiers::PinTier;

/// How many expired session ids are remembered so a late resume gets "expired", not "not found"
/// (past it, the oldest of the namespace remembering the most are forgotten: [`RememberedIds`]).
const EXPIRED_MEMORY: usize = 16_384;

type SessionId = (NamespaceId, String);

/// A parked session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionManifest {
    pub namespace: NamespaceId,
    pub id: String,
    /// Full blocks, in token order.
    pub keys: Vec<BlockKey>,
    /// The partial last block, if the tokens don't fill whole blocks.
    pub tail: Option<BlockKey>,
    pub token_count: u64,
    pub ttl: Duration,
    pub expires_at: Instant,
    pub priority: Priority,
    pub version: u64,
    /// Raw KV bytes the session stands for (token_count × bytes per token).
    pub bytes: u64,
    /// When the session was created (the park with `expected_version` 0 that made version 1;
    /// every later version keeps it), if known: a copy from an older node or log has none. See
    /// [`SessionManifest::supersedes`].
    pub created: Option<Instant>,
}

/// How much earlier than a session's creation another copy under its id must have been touched
/// last to count as an older session's (see [`SessionManifest::supersedes`]), and how far before
/// a create without every member's answer its drop of older copies is remembered: nodes compare
/// times by ages rounded down to milliseconds, and an age passed on from node to node gains each
/// hop's transit time, so the new copy must never count as older itself. A copy touched within
/// it is compared by version.
pub const SUPERSEDE_MARGIN: Duration = Duration::from_secs(1);

impl SessionManifest {
    /// When the copy was last touched (parked, extended or resumed).
    pub fn touched_at(&self) -> Option<Instant> {
        self.expires_at.checked_sub(self.ttl)
    }

    /// The point before which a copy under this session's id was last touched only if it is an
    /// older session's: this one's creation less [`SUPERSEDE_MARGIN`].
    pub fn supersedes_before(&self) -> Option<Instant> {
        self.created?.checked_sub(SUPERSEDE_MARGIN)
    }

    /// Whether `other`, a copy under the same id, belongs to an older session this one replaced:
    /// it was last touched before this one was created (less [`SUPERSEDE_MARGIN`]). A session is
    /// created only once every member that answered held no live copy of it, so such a copy sat
    /// on a node that was away (cut off, restarting, out of the membership) and is stale however
    /// high its version: versions count the writes of one session, not across two. Copies of one
    /// session are all touched at or after its creation, so none supersedes another.
    pub fn supersedes(&self, other: &SessionManifest) -> bool {
        match (self.supersedes_before(), other.touched_at()) {
            (Some(before), Some(touched)) => touched < before,
            _ => false,
        }
    }

    /// Whether `other` stands for the same context: the same blocks, tail and token count (two
    /// copies at one version that differ here were written by two nodes at once).
    pub fn same_context(&self, other: &SessionManifest) -> bool {
        self.keys == other.keys && self.tail == other.tail && self.token_count == other.token_count
    }

    /// What the control plane reports of the session.
    pub fn info_pb(&self, now: Instant) -> kvtier_proto::pb::SessionInfo {
        kvtier_proto::pb::SessionInfo {
            session_id: self.id.clone(),
            namespace_id: bytes::Bytes::copy_from_slice(&self.namespace.0),
            version: self.version,
            token_count: self.token_count,
            blocks: self.keys.len() as u32,
            has_tail: self.tail.is_some(),
            bytes: self.bytes,
            expires_in_ms: self.expires_at.saturating_duration_since(now).as_millis() as u64,
            priority: self.priority as u32,
            created_ago_ms: self.created.map(|c| now.saturating_duration_since(c).as_millis() as u64),
            tenant: String::new(),
        }
    }

    /// The manifest as `ResumeSession` returns it.
    pub fn to_pb(&self, now: Instant) -> kvtier_proto::pb::SessionManifest {
        kvtier_proto::pb::SessionManifest {
            info: Some(self.info_pb(now)),
            keys: self.keys.iter().map(|k| bytes::Bytes::copy_from_slice(&k.0)).collect(),
            tail_key: self.tail.map(|k| bytes::Bytes::copy_from_slice(&k.0)).unwrap_or_default(),
        }
    }

    fn pinned_keys(&self) -> Vec<BlockKey> {
        let mut k = self.keys.clone();
        k.extend(self.tail);
        k
    }
}

/// What a park or extend asks for.
#[derive(Debug, Clone)]
pub struct ParkSpec {
    pub namespace: NamespaceId,
    pub id: String,
    pub keys: Vec<BlockKey>,
    pub tail: Option<BlockKey>,
    pub token_count: u64,
    pub ttl: Duration,
    pub priority: Priority,
    /// 0: create; otherwise the version being replaced.
    pub expected_version: u64,
}

/// Limits the table enforces.
#[derive(Debug, Clone)]
pub struct SessionLimits {
    pub block_tokens: u32,
    pub bytes_per_token: u64,
    pub max_context_tokens: u64,
    /// The quotas of the tenant that owns the namespace, if it has any.
    pub quota: Option<SessionQuota>,
    /// Most keys all parked manifests together may name (their memory: 32 bytes each).
    pub max_manifest_keys: u64,
}

/// A tenant's session quotas, over all of its namespaces.
#[derive(Debug, Clone)]
pub struct SessionQuota {
    pub tenant: String,
    pub namespaces: Vec<NamespaceId>,
    pub max_sessions: Option<u64>,
    /// Most KV bytes (token count × bytes per token) its sessions may stand for.
    pub max_bytes: Option<u64>,
}

/// What a session's own memory (its id, its entries in the table) counts against
/// `max_session_keys`, in keys (32 bytes each): about 1 KiB, so many sessions of few keys can't
/// hold memory the key count does not see.
pub const MANIFEST_OVERHEAD_KEYS: u64 = 32;

/// What a manifest of `keys` block keys (and a tail) counts against `max_session_keys`.
fn manifest_cost(keys: usize, tail: bool) -> u64 {
    keys as u64 + u64::from(tail) + MANIFEST_OVERHEAD_KEYS
}

pub struct SessionTable {
    sessions: HashMap<SessionId, SessionManifest>,
    expired: RememberedIds,
    /// Sessions lost when the node last started (see [`SessionTable::mark_lost`]).
    lost: std::collections::HashSet<SessionId>,
    /// Per namespace: live sessions and the bytes they stand for (for the tenants' quotas).
    usage: HashMap<NamespaceId, (u64, u64)>,
    /// Keys named by every manifest (tails included).
    manifest_keys: u64,
}

impl SessionTable {
    /// See [`crate::session_store::SessionStore::set_namespace_owners`].
    pub fn set_namespace_owners(&mut self, owners: crate::remembered::NamespaceOwners) {
        self.expired.set_owners(owners);
    }
}

impl Default for SessionTable {
    fn default() -> Self {
        SessionTable {
            sessions: HashMap::new(),
            expired: RememberedIds::new(EXPIRED_MEMORY),
            lost: Default::default(),
            usage: HashMap::new(),
            manifest_keys: 0,
        }
    }
}

fn check_shape(keys: usize, has_tail: bool, token_count: u64, limits: &SessionLimits) -> Result<(), ServerError> {
    if token_count > limits.max_context_tokens {
        return Err(ServerError::ContextTooLong { tokens: token_count, max: limits.max_context_tokens });
    }
    let bt = u64::from(limits.block_tokens);
    let full = token_count / bt;
    let tail = !token_count.is_multiple_of(bt);
    if full != keys as u64 || tail != has_tail {
        return Err(ServerError::InvalidRequest(format!(
            "{token_count} tokens in blocks of {bt} make {full} full block(s){}, but the manifest has {keys}{}",
            if tail { " and a tail" } else { "" },
            if has_tail { " and a tail" } else { " and no tail" },
        )));
    }
    if token_count == 0 {
        return Err(ServerError::InvalidRequest("a session needs at least one token".into()));
    }
    Ok(())
}

fn pin_or_report(
    tier: &dyn PinTier,
    ns: &NamespaceId,
    keys: &[BlockKey],
    tail: Option<BlockKey>,
) -> Result<(), ServerError> {
    let mut all = keys.to_vec();
    all.extend(tail);
    match tier.pin(ns, &all) {
        Err(ServerError::MissingBlocks { missing, .. }) => {
            let n = keys.len() as u32;
            let missing_tail = missing.contains(&n);
            Err(ServerError::MissingBlocks { missing: missing.into_iter().filter(|&i| i < n).collect(), missing_tail })
        }
        other => other,
    }
}

impl SessionTable {
    pub fn len(&self) -> usize {
        self.sessions.len()
    }

    /// Sessions and the bytes they stand for, over `namespaces`.
    pub fn count_in(&self, namespaces: &[NamespaceId]) -> (u64, u64) {
        namespaces.iter().filter_map(|n| self.usage.get(n)).fold((0, 0), |(s, b), u| (s + u.0, b + u.1))
    }

    /// Counts a manifest in (`sign` +1) or out (-1) of its namespace's usage.
    fn track(&mut self, m: &SessionManifest, added: bool) {
        let keys = manifest_cost(m.keys.len(), m.tail.is_some());
        if added {
            self.manifest_keys += keys;
        } else {
            self.manifest_keys = self.manifest_keys.saturating_sub(keys);
        }
        let u = self.usage.entry(m.namespace).or_default();
        if added {
            u.0 += 1;
            u.1 += m.bytes;
        } else {
            u.0 = u.0.saturating_sub(1);
            u.1 = u.1.saturating_sub(m.bytes);
            if u.0 == 0 {
                self.usage.remove(&m.namespace);
            }
        }
    }

    fn insert(&mut self, sid: SessionId, m: SessionManifest) {
        self.lost.remove(&sid);
        self.track(&m, true);
        if let Some(old) = self.sessions.insert(sid, m) {
            self.track(&old, false);
        }
    }

    fn remove(&mut self, sid: &SessionId) -> Option<SessionManifest> {
        let m = self.sessions.remove(sid)?;
        self.track(&m, false);
        Some(m)
    }

    /// Refuses a change that would take the owning tenant past a quota: `replaced` is the
    /// session's current (bytes), `None` for a new session; `bytes` what it will stand for.
    fn check_quota(&self, limits: &SessionLimits, replaced: Option<u64>, bytes: u64) -> Result<(), ServerError> {
        let Some(q) = &limits.quota else { return Ok(()) };
        self.check_tenant_quota(q, replaced, bytes)
    }

    /// Refuses manifests that would name more keys than the node holds for all of them:
    /// `replaced` keys go, `added` come.
    fn check_manifest_keys(&self, limits: &SessionLimits, replaced: u64, added: u64) -> Result<(), ServerError> {
        let after = self.manifest_keys.saturating_sub(replaced) + added;
        if after > limits.max_manifest_keys {
            return Err(ServerError::Capacity(format!(
                "parked sessions would take {after} keys' worth of memory (each block key they name, and \
                 {MANIFEST_OVERHEAD_KEYS} per session for its own), past the node's max_session_keys {}",
                limits.max_manifest_keys
            )));
        }
        Ok(())
    }

    fn check_tenant_quota(&self, q: &SessionQuota, replaced: Option<u64>, bytes: u64) -> Result<(), ServerError> {
        let (sessions, held) = self.count_in(&q.namespaces);
        if let Some(max) = q.max_sessions {
            if replaced.is_none() && sessions >= max {
                return Err(crate::tenants::quota_refused(
                    &q.tenant,
                    "max_sessions",
                    format!(
                        "tenant {:?} holds {sessions} sessions on this node, its max_sessions is {max} (drop one first)",
                        q.tenant
                    ),
                ));
            }
        }
        if let Some(max) = q.max_bytes {
            let after = held - replaced.unwrap_or(0).min(held) + bytes;
            if after > max {
                return Err(crate::tenants::quota_refused(
                    &q.tenant,
                    "max_session_bytes",
                    format!(
                        "tenant {:?}'s sessions would stand for {after} bytes, past its max_session_bytes {max}",
                        q.tenant
                    ),
                ));
            }
        }
        Ok(())
    }

    pub fn is_empty(&self) -> bool {
        self.sessions.is_empty()
    }

    /// Remembers that session `id` expired at `at` (asking for it then says so).
    pub fn remember_expired(&mut self, id: SessionId, at: Instant) {
        self.expired.insert(id.0, &id.1, at);
    }

    /// Removes `id` if it has expired by `now`, unpinning its blocks.
    fn reap_if_expired(&mut self, tier: &dyn PinTier, id: &SessionId, now: Instant) {
        let expired = self.sessions.get(id).is_some_and(|m| m.expires_at <= now);
        if expired {
            if let Some(m) = self.remove(id) {
                tier.unpin(&m.namespace, &m.pinned_keys());
                self.remember_expired(id.clone(), m.expires_at);
            }
        }
    }

    /// Creates a session, or replaces version `expected_version` of it. All of its blocks must be
    /// resident: they are pinned together with the manifest, or nothing changes.
    pub fn park(
        &mut self,
        tier: &dyn PinTier,
        spec: ParkSpec,
        limits: &SessionLimits,
        now: Instant,
    ) -> Result<SessionManifest, ServerError> {
        let sid = (spec.namespace, spec.id.clone());
        self.reap_if_expired(tier, &sid, now);
        self.check_park(&spec, limits, now)?;
        let current = self.sessions.get(&sid).map(|m| m.version).unwrap_or(0);
        // A replace keeps the session's creation; a create (nothing held) is one.
        let created = match self.sessions.get(&sid) {
            Some(m) => m.created,
            None => Some(now),
        };
        pin_or_report(tier, &spec.namespace, &spec.keys, spec.tail)?;
        if let Some(old) = self.sessions.get(&sid) {
            tier.unpin(&old.namespace, &old.pinned_keys());
        }
        let manifest = SessionManifest {
            namespace: spec.namespace,
            id: spec.id,
            keys: spec.keys,
            tail: spec.tail,
            token_count: spec.token_count,
            ttl: spec.ttl,
            expires_at: now + spec.ttl,
            priority: spec.priority,
            version: current + 1,
            bytes: spec.token_count * limits.bytes_per_token,
            created,
        };
        self.expired.remove(sid.0, &sid.1);
        self.insert(sid, manifest.clone());
        Ok(manifest)
    }

    /// The checks a park makes (its shape, the version it replaces, the tenant's quota, the
    /// manifest keys) without changing anything: made first, before the blocks are made durable
    /// — a refused park wrote its blocks to disk, where they stayed past the tenant's quota —
    /// and again under the change. A session expired by `now` counts as gone.
    pub fn check_park(&self, spec: &ParkSpec, limits: &SessionLimits, now: Instant) -> Result<(), ServerError> {
        check_shape(spec.keys.len(), spec.tail.is_some(), spec.token_count, limits)?;
        let cur = self.sessions.get(&(spec.namespace, spec.id.clone())).filter(|m| m.expires_at > now);
        let current = cur.map_or(0, |m| m.version);
        if spec.expected_version == 0 && current != 0 {
            return Err(ServerError::SessionExists(spec.id.clone()));
        }
        if spec.expected_version != current {
            return Err(ServerError::VersionConflict {
                id: spec.id.clone(),
                expected: spec.expected_version,
                actual: current,
            });
        }
        self.check_replacing(cur, (spec.keys.len(), spec.tail.is_some(), spec.token_count), limits)
    }

    /// The room a session of `(blocks, has_tail, token_count)` replacing `cur` (`None`: a new
    /// one) needs: the tenant's quota and the manifest keys.
    fn check_replacing(
        &self,
        cur: Option<&SessionManifest>,
        (blocks, has_tail, token_count): (usize, bool, u64),
        limits: &SessionLimits,
    ) -> Result<(), ServerError> {
        self.check_quota(limits, cur.map(|m| m.bytes), token_count * limits.bytes_per_token)?;
        let old_keys = cur.map_or(0, |m| manifest_cost(m.keys.len(), m.tail.is_some()));
        self.check_manifest_keys(limits, old_keys, manifest_cost(blocks, has_tail))
    }

    /// The checks an extend makes of the session as it is (it exists, `expected_version` is
    /// its version, the kept blocks end in `base_key`) and of the extended one (its shape, the
    /// tenant's quota, the manifest keys), without changing anything: made first, before the new
    /// blocks are made durable, and again under the change.
    #[allow(clippy::too_many_arguments)]
    pub fn check_extend(
        &self,
        ns: NamespaceId,
        id: &str,
        expected_version: u64,
        base_blocks: usize,
        base_key: Option<BlockKey>,
        (new_blocks, has_tail, token_count): (usize, bool, u64),
        limits: &SessionLimits,
        now: Instant,
    ) -> Result<(), ServerError> {
        let sid = (ns, id.to_string());
        let Some(cur) = self.sessions.get(&sid) else {
            return Err(self.absent_error(&sid, now));
        };
        if cur.expires_at <= now {
            let ago_ms = now.saturating_duration_since(cur.expires_at).as_millis() as u64;
            return Err(ServerError::SessionExpired { id: id.into(), ago_ms });
        }
        if cur.version != expected_version {
            return Err(ServerError::VersionConflict {
                id: id.into(),
                expected: expected_version,
                actual: cur.version,
            });
        }
        if base_blocks > cur.keys.len() {
            return Err(ServerError::InvalidRequest(format!(
                "base_blocks {base_blocks} is past the session's {} blocks",
                cur.keys.len()
            )));
        }
        if let Some(key) = base_key {
            let Some(held) = base_blocks.checked_sub(1).and_then(|i| cur.keys.get(i)) else {
                return Err(ServerError::InvalidRequest(
                    "base_key given with base_blocks 0: send it empty when extending from the first block".into(),
                ));
            };
            if *held != key {
                return Err(ServerError::InvalidRequest(format!(
                    "the new context does not continue session {id:?}: its first {} tokens differ from the \
                     parked ones; park it anew (drop it first, or replace it by its version) instead of extending",
                    base_blocks as u64 * u64::from(limits.block_tokens)
                )));
            }
        }
        check_shape(base_blocks + new_blocks, has_tail, token_count, limits)?;
        self.check_quota(limits, Some(cur.bytes), token_count * limits.bytes_per_token)?;
        let dropped = (cur.keys.len() - base_blocks) as u64 + u64::from(cur.tail.is_some());
        self.check_manifest_keys(limits, dropped, new_blocks as u64 + u64::from(has_tail))?;
        Ok(())
    }

    /// Refuses an extend after every full block of version `expected_version` of a session with a
    /// partial tail whose context does not keep that tail's tokens (`tail`: the caller's key of
    /// them, which differs from the manifest's). Other extends (from an earlier block, of another
    /// version, a session without a tail) are left to [`Self::check_extend`].
    pub fn check_extend_tail(
        &self,
        ns: NamespaceId,
        id: &str,
        expected_version: u64,
        base_blocks: usize,
        tail: BlockKey,
        limits: &SessionLimits,
    ) -> Result<(), ServerError> {
        let Some(cur) = self.sessions.get(&(ns, id.to_string())) else { return Ok(()) };
        if cur.version != expected_version || base_blocks != cur.keys.len() {
            return Ok(());
        }
        match cur.tail {
            Some(held) if held != tail => {
                let from = base_blocks as u64 * u64::from(limits.block_tokens);
                Err(ServerError::InvalidRequest(format!(
                    "the new context does not continue session {id:?}: its tokens {from}..{} differ from the \
                     session's last (partial-block) ones; park it anew (drop it first, or replace it by its \
                     version) instead of extending",
                    cur.token_count
                )))
            }
            _ => Ok(()),
        }
    }

    /// Appends blocks after the first `base_blocks` full blocks of version `expected_version`,
    /// replacing the tail. Only the new blocks need to have been sent. `base_key` is the caller's
    /// key of block `base_blocks - 1`: keys chain over every token before them, so a key that
    /// differs from the manifest's there means the new context does not start with the session's
    /// tokens, and the extend is refused (`None`, from a client that sends none: not checked).
    #[allow(clippy::too_many_arguments)]
    pub fn extend(
        &mut self,
        tier: &dyn PinTier,
        ns: NamespaceId,
        id: &str,
        expected_version: u64,
        base_blocks: usize,
        base_key: Option<BlockKey>,
        new_keys: Vec<BlockKey>,
        tail: Option<BlockKey>,
        token_count: u64,
        limits: &SessionLimits,
        now: Instant,
    ) -> Result<SessionManifest, ServerError> {
        let sid = (ns, id.to_string());
        self.reap_if_expired(tier, &sid, now);
        let shape = (new_keys.len(), tail.is_some(), token_count);
        self.check_extend(ns, id, expected_version, base_blocks, base_key, shape, limits, now)?;
        pin_or_report(tier, &ns, &new_keys, tail)?;
        let Some(mut cur) = self.remove(&sid) else {
            return Err(ServerError::SessionNotFound(id.into()));
        };
        let mut released: Vec<BlockKey> = cur.keys.split_off(base_blocks);
        released.extend(cur.tail.take());
        tier.unpin(&ns, &released);
        cur.keys.extend(new_keys);
        cur.tail = tail;
        cur.token_count = token_count;
        cur.bytes = token_count * limits.bytes_per_token;
        cur.version += 1;
        cur.expires_at = now + cur.ttl;
        self.insert(sid, cur.clone());
        Ok(cur)
    }

    fn absent_error(&self, sid: &SessionId, now: Instant) -> ServerError {
        match self.expired.get(sid.0, &sid.1) {
            Some(at) => ServerError::SessionExpired {
                id: sid.1.clone(),
                ago_ms: now.saturating_duration_since(at).as_millis() as u64,
            },
            None if self.lost.contains(sid) => ServerError::SessionLost(sid.1.clone()),
            None => ServerError::SessionNotFound(sid.1.clone()),
        }
    }

    /// Returns the manifest and restarts its TTL (an agent that resumes is alive).
    /// A live session's token count, without touching its TTL (for routing hints).
    pub fn tokens_of(&self, ns: NamespaceId, id: &str, now: Instant) -> Option<u64> {
        self.sessions.get(&(ns, id.to_string())).filter(|m| m.expires_at > now).map(|m| m.token_count)
    }

    pub fn resume(
        &mut self,
        tier: &dyn PinTier,
        ns: NamespaceId,
        id: &str,
        now: Instant,
    ) -> Result<SessionManifest, ServerError> {
        let sid = (ns, id.to_string());
        self.reap_if_expired(tier, &sid, now);
        match self.sessions.get_mut(&sid) {
            Some(m) => {
                m.expires_at = now + m.ttl;
                Ok(m.clone())
            }
            None => Err(self.absent_error(&sid, now)),
        }
    }

    /// A live session's manifest, its TTL untouched (what a peer asking for this node's copy
    /// gets).
    pub fn peek(&self, ns: NamespaceId, id: &str, now: Instant) -> Option<SessionManifest> {
        self.sessions.get(&(ns, id.to_string())).filter(|m| m.expires_at > now).cloned()
    }

    /// When a live session was last parked, extended or resumed (its manifest not copied).
    pub fn touched(&self, ns: NamespaceId, id: &str, now: Instant) -> Option<Instant> {
        let m = self.sessions.get(&(ns, id.to_string())).filter(|m| m.expires_at > now)?;
        Some(m.expires_at.checked_sub(m.ttl).unwrap_or(m.expires_at))
    }

    /// Keeps another node's copy of a session, version and expiry as they are, unless this node
    /// holds that version or a newer one (`VersionConflict`, `actual` = the version held). Its
    /// blocks must be resident here (`MissingBlocks` otherwise); the shape, manifest-key and
    /// quota limits apply as to a park.
    pub fn put_replica(
        &mut self,
        tier: &dyn PinTier,
        m: SessionManifest,
        limits: &SessionLimits,
        now: Instant,
    ) -> Result<SessionManifest, ServerError> {
        let sid = (m.namespace, m.id.clone());
        self.reap_if_expired(tier, &sid, now);
        self.check_put_replica(&m, limits, now)?;
        pin_or_report(tier, &m.namespace, &m.keys, m.tail)?;
        if let Some(old) = self.sessions.get(&sid) {
            tier.unpin(&old.namespace, &old.pinned_keys());
        }
        let m = SessionManifest { bytes: m.token_count * limits.bytes_per_token, ..m };
        self.expired.remove(sid.0, &sid.1);
        self.insert(sid, m.clone());
        Ok(m)
    }

    /// The checks [`Self::put_replica`] makes of a copy (its shape and version, the tenant's
    /// quota, the manifest keys) without changing anything: made first, before its blocks are
    /// made durable (a refused copy left them on disk), and again under the change. A session
    /// expired by `now` counts as gone.
    pub fn check_put_replica(
        &self,
        m: &SessionManifest,
        limits: &SessionLimits,
        now: Instant,
    ) -> Result<(), ServerError> {
        check_shape(m.keys.len(), m.tail.is_some(), m.token_count, limits)?;
        if m.version == 0 {
            return Err(ServerError::InvalidRequest("a session replica needs a version above 0".into()));
        }
        let cur = self.sessions.get(&(m.namespace, m.id.clone())).filter(|c| c.expires_at > now);
        let current = cur.map_or(0, |c| c.version);
        if current >= m.version {
            return Err(ServerError::VersionConflict { id: m.id.clone(), expected: m.version, actual: current });
        }
        self.check_replacing(cur, (m.keys.len(), m.tail.is_some(), m.token_count), limits)
    }

    /// Drops this node's copy of a session if its version is at most `version`; true if it went.
    pub fn drop_replica(&mut self, tier: &dyn PinTier, ns: NamespaceId, id: &str, version: u64) -> bool {
        let sid = (ns, id.to_string());
        if self.sessions.get(&sid).is_some_and(|m| m.version <= version) {
            return self.drop_session(tier, ns, id);
        }
        false
    }

    /// How long ago session `id` expired by `now`, if it did and was not parked again since (held
    /// and past its TTL, or remembered as expired).
    pub fn expired_ago(&self, ns: NamespaceId, id: &str, now: Instant) -> Option<Duration> {
        let sid = (ns, id.to_string());
        match self.sessions.get(&sid) {
            Some(m) if m.expires_at > now => None,
            Some(m) => Some(now.saturating_duration_since(m.expires_at)),
            None => self.expired.get(ns, id).map(|at| now.saturating_duration_since(at)),
        }
    }

    /// The version of the session held, live or expired and not yet reaped.
    pub fn version_of(&self, ns: NamespaceId, id: &str) -> Option<u64> {
        self.sessions.get(&(ns, id.to_string())).map(|m| m.version)
    }

    /// Drops a session and unpins its blocks; false if there was none.
    pub fn drop_session(&mut self, tier: &dyn PinTier, ns: NamespaceId, id: &str) -> bool {
        match self.remove(&(ns, id.to_string())) {
            Some(m) => {
                tier.unpin(&m.namespace, &m.pinned_keys());
                true
            }
            None => false,
        }
    }

    /// Puts `prev` back where `made` — this node's write, refused as one made at the same time as
    /// another node's — still stands: `prev`'s blocks pinned again, `made`'s released. A
    /// `VersionConflict` (nothing changed) when the session moved on since, and the pin error
    /// when a block of `prev` is gone.
    pub fn revert(
        &mut self,
        tier: &dyn PinTier,
        made: &SessionManifest,
        prev: SessionManifest,
    ) -> Result<SessionManifest, ServerError> {
        let sid = (made.namespace, made.id.clone());
        let Some(cur) = self.sessions.get(&sid).filter(|c| c.version == made.version && c.same_context(made)) else {
            let actual = self.sessions.get(&sid).map_or(0, |c| c.version);
            return Err(ServerError::VersionConflict { id: made.id.clone(), expected: made.version, actual });
        };
        let released = cur.pinned_keys();
        pin_or_report(tier, &prev.namespace, &prev.keys, prev.tail)?;
        tier.unpin(&made.namespace, &released);
        self.insert(sid, prev.clone());
        Ok(prev)
    }

    /// Drops the session if it is still at `version` (a change that could not be logged is taken
    /// back, unless another change replaced it meanwhile); true if it went.
    pub fn undo(&mut self, tier: &dyn PinTier, ns: NamespaceId, id: &str, version: u64) -> bool {
        let sid = (ns, id.to_string());
        if self.sessions.get(&sid).is_some_and(|m| m.version == version) {
            return self.drop_session(tier, ns, id);
        }
        false
    }

    /// Live sessions in (namespace, id) order that `keep` accepts, after `after` (exclusive), at
    /// most `limit`; and whether more follow. Only the page is cloned.
    pub fn list_page(
        &self,
        ns: Option<NamespaceId>,
        after: Option<(NamespaceId, &str)>,
        limit: usize,
        keep: impl Fn(&SessionManifest) -> bool,
        now: Instant,
    ) -> (Vec<SessionManifest>, bool) {
        let mut v: Vec<&SessionManifest> = self
            .sessions
            .values()
            .filter(|m| m.expires_at > now && ns.is_none_or(|n| n == m.namespace))
            .filter(|m| after.is_none_or(|(a_ns, a_id)| (m.namespace, m.id.as_str()) > (a_ns, a_id)))
            .filter(|m| keep(m))
            .collect();
        let more = v.len() > limit;
        if more {
            v.select_nth_unstable_by(limit, |a, b| (a.namespace, &a.id).cmp(&(b.namespace, &b.id)));
            v.truncate(limit);
        }
        v.sort_by(|a, b| (a.namespace, &a.id).cmp(&(b.namespace, &b.id)));
        (v.into_iter().cloned().collect(), more)
    }

    /// Live sessions, optionally of one namespace, sorted by (namespace, id).
    pub fn list(&self, ns: Option<NamespaceId>, now: Instant) -> Vec<SessionManifest> {
        let mut v: Vec<_> = self
            .sessions
            .values()
            .filter(|m| m.expires_at > now && ns.is_none_or(|n| n == m.namespace))
            .cloned()
            .collect();
        v.sort_by(|a, b| (a.namespace, &a.id).cmp(&(b.namespace, &b.id)));
        v
    }

    /// Removes every session expired by `now`, unpinning its blocks. Returns their ids.
    pub fn expire(&mut self, tier: &dyn PinTier, now: Instant) -> Vec<(NamespaceId, String)> {
        let dead: Vec<SessionId> =
            self.sessions.iter().filter(|(_, m)| m.expires_at <= now).map(|(k, _)| k.clone()).collect();
        for sid in &dead {
            self.reap_if_expired(tier, sid, now);
        }
        dead
    }

    /// Remembers that a logged session could not be restored (its blocks on disk are damaged
    /// or gone), so that asking for it says so; as many as expired ids are remembered.
    pub fn mark_lost(&mut self, ns: NamespaceId, id: &str) {
        if self.lost.len() < EXPIRED_MEMORY {
            self.lost.insert((ns, id.to_string()));
        }
    }

    /// Puts back a session recovered from the session log, pinning its blocks.
    pub fn restore(&mut self, tier: &dyn PinTier, m: SessionManifest) -> Result<(), ServerError> {
        tier.pin(&m.namespace, &m.pinned_keys())?;
        let sid = (m.namespace, m.id.clone());
        if let Some(old) = self.remove(&sid) {
            tier.unpin(&old.namespace, &old.pinned_keys());
        }
        self.insert(sid, m);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dram::{DramConfig, DramTier};
    use kvtier_proto::{CodecId, DType, FrameHeader, KvLayout};

    const BT: u32 = 4;

    fn layout() -> KvLayout {
        KvLayout::new(1, 1, 8, DType::Fp16, BT) // 32 bytes per token, 128 per block
    }

    fn limits() -> SessionLimits {
        SessionLimits {
            block_tokens: BT,
            bytes_per_token: layout().bytes_per_token(),
            max_context_tokens: 64,
            quota: None,
            max_manifest_keys: 1 << 20,
        }
    }

    fn put(tier: &DramTier, ns: NamespaceId, k: u8, tokens: u32) -> BlockKey {
        let key = BlockKey([k; 32]);
        let payload = vec![k; layout().bytes_for_tokens(tokens) as usize];
        let header = FrameHeader {
            codec: CodecId::RAW,
            flags: 0,
            tokens,
            namespace: ns,
            key,
            layout: layout(),
            payload_len: payload.len() as u64,
            checksum: xxh(&payload),
        };
        tier.insert(header, &payload, Priority::Normal).unwrap();
        key
    }

    fn xxh(b: &[u8]) -> u64 {
        // The tier trusts callers to verify checksums; the value is irrelevant here.
        b.len() as u64
    }

    fn spec(ns: NamespaceId, keys: Vec<BlockKey>, tail: Option<BlockKey>, tokens: u64, v: u64) -> ParkSpec {
        ParkSpec {
            namespace: ns,
            id: "agent-1".into(),
            keys,
            tail,
            token_count: tokens,
            ttl: Duration::from_secs(10),
            priority: Priority::Normal,
            expected_version: v,
        }
    }

    #[test]
    fn tenant_quotas_count_sessions_and_bytes_over_all_its_namespaces() {
        let tier = DramTier::new(DramConfig { capacity_bytes: 1 << 20, max_pinned_ratio: 0.9 });
        let (ns1, ns2, other) = (NamespaceId([1; 16]), NamespaceId([2; 16]), NamespaceId([3; 16]));
        let bpt = layout().bytes_per_token();
        let quota = |sessions, bytes| SessionLimits {
            quota: Some(SessionQuota {
                tenant: "t".into(),
                namespaces: vec![ns1, ns2],
                max_sessions: sessions,
                max_bytes: bytes,
            }),
            ..limits()
        };
        let mut t = SessionTable::default();
        let now = Instant::now();
        let k1 = put(&tier, ns1, 1, BT);
        let k2 = put(&tier, ns2, 2, BT);
        let k3 = put(&tier, other, 3, BT);
        let named = |ns, k, id: &str| ParkSpec { id: id.into(), ..spec(ns, vec![k], None, u64::from(BT), 0) };
        t.park(&tier, named(ns1, k1, "a"), &quota(Some(2), None), now).unwrap();
        t.park(&tier, named(ns2, k2, "b"), &quota(Some(2), None), now).unwrap();
        // Another tenant's namespace doesn't count, and isn't limited by this quota.
        t.park(&tier, named(other, k3, "c"), &limits(), now).unwrap();
        assert_eq!(t.count_in(&[ns1, ns2]), (2, 2 * u64::from(BT) * bpt));
        let third = t.park(&tier, named(ns1, k1, "d"), &quota(Some(2), None), now);
        assert!(matches!(third, Err(ServerError::QuotaExceeded(ref m)) if m.contains("max_sessions")), "{third:?}");
        // Replacing a session is not a new one.
        t.park(&tier, ParkSpec { expected_version: 1, ..named(ns1, k1, "a") }, &quota(Some(2), None), now).unwrap();
        // Bytes: two blocks' worth are held; a third block's worth is past a 2-block quota.
        let cap = Some(2 * u64::from(BT) * bpt);
        let k4 = put(&tier, ns1, 4, BT);
        let grow = t.extend(&tier, ns1, "a", 2, 1, None, vec![k4], None, 2 * u64::from(BT), &quota(None, cap), now);
        assert!(matches!(grow, Err(ServerError::QuotaExceeded(ref m)) if m.contains("max_session_bytes")), "{grow:?}");
        // Dropping frees the room, and the counts follow every way out.
        assert!(t.drop_session(&tier, ns2, "b"));
        assert_eq!(t.count_in(&[ns1, ns2]).0, 1);
        t.extend(&tier, ns1, "a", 2, 1, None, vec![k4], None, 2 * u64::from(BT), &quota(None, cap), now).unwrap();
        assert_eq!(t.count_in(&[ns1, ns2]), (1, 2 * u64::from(BT) * bpt));
        t.expire(&tier, now + Duration::from_secs(60));
        assert_eq!(t.count_in(&[ns1, ns2, other]), (0, 0));
    }

    #[test]
    fn manifests_together_name_at_most_max_manifest_keys() {
        let tier = DramTier::new(DramConfig { capacity_bytes: 1 << 20, max_pinned_ratio: 0.9 });
        let ns = NamespaceId([4; 16]);
        // Five keys, and the two sessions' own memory.
        let lim = SessionLimits { max_manifest_keys: 5 + 2 * MANIFEST_OVERHEAD_KEYS, ..limits() };
        let mut t = SessionTable::default();
        let now = Instant::now();
        // One block named many times over: the manifests, not the blocks, are what costs here.
        let k = put(&tier, ns, 1, BT);
        let named = |id: &str, n: usize| ParkSpec {
            id: id.into(),
            ..spec(ns, vec![k; n], None, (n as u64) * u64::from(BT), 0)
        };
        t.park(&tier, named("a", 3), &lim, now).unwrap();
        let e = t.park(&tier, named("b", 3), &lim, now).unwrap_err();
        assert!(matches!(e, ServerError::Capacity(ref m) if m.contains("max_session_keys")), "{e}");
        t.park(&tier, named("b", 2), &lim, now).unwrap();
        // Replacing a manifest counts only the difference; extending too.
        t.park(&tier, ParkSpec { expected_version: 1, ..named("a", 1) }, &lim, now).unwrap();
        t.extend(&tier, ns, "b", 1, 2, None, vec![k, k], None, 4 * u64::from(BT), &lim, now).unwrap();
        assert!(t.extend(&tier, ns, "b", 2, 4, None, vec![k], None, 5 * u64::from(BT), &lim, now).is_err());
        assert!(t.drop_session(&tier, ns, "b"));
        t.park(&tier, named("c", 4), &lim, now).unwrap();
    }

    /// Pages of the listing: in (namespace, id) order, each after the last one's end, only what
    /// `keep` accepts, `more` until the last.
    #[test]
    fn sessions_are_listed_a_page_at_a_time() {
        let tier = DramTier::new(DramConfig { capacity_bytes: 1 << 20, max_pinned_ratio: 0.9 });
        let (a, b) = (NamespaceId([1; 16]), NamespaceId([2; 16]));
        let mut t = SessionTable::default();
        let now = Instant::now();
        for ns in [b, a] {
            let k = put(&tier, ns, 1, BT);
            for i in (0..7).rev() {
                let spec = ParkSpec { id: format!("s{i}"), ..spec(ns, vec![k], None, u64::from(BT), 0) };
                t.park(&tier, spec, &limits(), now).unwrap();
            }
        }
        let mut seen = Vec::new();
        let mut after: Option<(NamespaceId, String)> = None;
        loop {
            let cursor = after.as_ref().map(|(n, id)| (*n, id.as_str()));
            let (page, more) = t.list_page(None, cursor, 3, |m| m.id != "s5", now);
            assert!(page.len() <= 3);
            seen.extend(page.iter().map(|m| (m.namespace, m.id.clone())));
            after = page.last().map(|m| (m.namespace, m.id.clone()));
            if !more {
                break;
            }
        }
        let mut want: Vec<(NamespaceId, String)> =
            [a, b].iter().flat_map(|n| (0..7).filter(|i| *i != 5).map(|i| (*n, format!("s{i}")))).collect();
        want.sort();
        assert_eq!(seen, want);
        let (only_b, more) = t.list_page(Some(b), None, 100, |_| true, now);
        assert!(!more && only_b.len() == 7 && only_b.iter().all(|m| m.namespace == b));
    }

    #[test]
    fn park_extend_resume_drop() {
        let tier = DramTier::new(DramConfig { capacity_bytes: 1 << 20, max_pinned_ratio: 0.9 });
        let ns = NamespaceId([1; 16]);
        let mut t = SessionTable::default();
        let now = Instant::now();
        let k: Vec<_> = (1..=3).map(|i| put(&tier, ns, i, BT)).collect();
        let tail1 = put(&tier, ns, 10, 2);
        let m = t.park(&tier, spec(ns, k[..2].to_vec(), Some(tail1), 10, 0), &limits(), now).unwrap();
        assert_eq!(m.version, 1);
        assert!(!tier.remove(&ns, &tail1), "a parked tail is pinned");
        // Parking the same id again without its version is refused.
        assert!(matches!(
            t.park(&tier, spec(ns, k[..2].to_vec(), Some(tail1), 10, 0), &limits(), now),
            Err(ServerError::SessionExists(_))
        ));
        // Extend: block 3 is new, the old tail is released.
        let m = t.extend(&tier, ns, "agent-1", 1, 2, Some(k[1]), vec![k[2]], None, 12, &limits(), now).unwrap();
        assert_eq!((m.version, m.keys.len(), m.tail), (2, 3, None));
        assert!(tier.remove(&ns, &tail1), "the replaced tail was unpinned");
        // A stale version is a conflict and changes nothing.
        assert!(matches!(
            t.extend(&tier, ns, "agent-1", 1, 3, None, vec![], None, 12, &limits(), now),
            Err(ServerError::VersionConflict { actual: 2, .. })
        ));
        let r = t.resume(&tier, ns, "agent-1", now).unwrap();
        assert_eq!(r.keys, k);
        assert!(!tier.remove(&ns, &k[0]));
        assert!(t.drop_session(&tier, ns, "agent-1"));
        assert!(tier.remove(&ns, &k[0]), "drop unpins");
        assert!(matches!(t.resume(&tier, ns, "agent-1", now), Err(ServerError::SessionNotFound(_))));
    }

    /// A session's creation is kept by every later version (park over it, extend) and made anew
    /// only by a create after it is gone; a copy last touched before another's creation (less the
    /// margin) is an older session's, whatever the versions, and copies of one session never
    /// supersede each other.
    #[test]
    fn a_session_keeps_its_creation_and_supersedes_only_copies_touched_before_it() {
        let tier = DramTier::new(DramConfig { capacity_bytes: 1 << 20, max_pinned_ratio: 0.9 });
        let ns = NamespaceId([1; 16]);
        let mut t = SessionTable::default();
        let t0 = Instant::now();
        let k: Vec<_> = (1..=3).map(|i| put(&tier, ns, i, BT)).collect();
        let v1 = t.park(&tier, spec(ns, k[..1].to_vec(), None, 4, 0), &limits(), t0).unwrap();
        assert_eq!(v1.created, Some(t0));
        let later = t0 + Duration::from_secs(5);
        let v2 = t.park(&tier, spec(ns, k[..2].to_vec(), None, 8, 1), &limits(), later).unwrap();
        let v3 = t.extend(&tier, ns, "agent-1", 2, 2, Some(k[1]), vec![k[2]], None, 12, &limits(), later).unwrap();
        assert_eq!((v2.created, v3.created), (Some(t0), Some(t0)), "later versions keep the creation");
        for (a, b) in [(&v1, &v3), (&v3, &v1), (&v2, &v3)] {
            assert!(!a.supersedes(b), "copies of one session: v{} over v{}", a.version, b.version);
        }

        // Dropped, then created anew 10 s on: version 1 again, and it supersedes the old
        // session's version 3 (touched 5 s after the first creation), never the reverse.
        assert!(t.drop_session(&tier, ns, "agent-1"));
        let anew_at = t0 + Duration::from_secs(15);
        let anew = t.park(&tier, spec(ns, k[..1].to_vec(), None, 4, 0), &limits(), anew_at).unwrap();
        assert_eq!((anew.version, anew.created), (1, Some(anew_at)));
        assert!(anew.supersedes(&v3) && !v3.supersedes(&anew));
        // Touched within the margin before the creation: compared by version, not superseded.
        let close = SessionManifest { expires_at: anew_at - SUPERSEDE_MARGIN / 2 + v3.ttl, ..v3.clone() };
        assert!(!anew.supersedes(&close));
        // A copy whose creation is not known (an older node's) supersedes nothing.
        assert!(!SessionManifest { created: None, ..anew.clone() }.supersedes(&v3));
    }

    /// Keys chain over every token before them: an extend whose key of the last kept block is
    /// not the manifest's comes from a context that doesn't start with the session's tokens,
    /// and is refused with the session, its pins and its version as they were.
    #[test]
    fn an_extend_of_another_context_is_refused_and_changes_nothing() {
        let tier = DramTier::new(DramConfig { capacity_bytes: 1 << 20, max_pinned_ratio: 0.9 });
        let ns = NamespaceId([5; 16]);
        let mut t = SessionTable::default();
        let now = Instant::now();
        let k: Vec<_> = (1..=3).map(|i| put(&tier, ns, i, BT)).collect();
        let tail = put(&tier, ns, 10, 2);
        let parked = t.park(&tier, spec(ns, k[..2].to_vec(), Some(tail), 10, 0), &limits(), now).unwrap();
        let other = put(&tier, ns, 20, BT);
        let e = t.extend(&tier, ns, "agent-1", 1, 2, Some(other), vec![k[2]], None, 12, &limits(), now).unwrap_err();
        assert!(
            matches!(e, ServerError::InvalidRequest(ref m)
                if m.contains("does not continue session \"agent-1\"") && m.contains("first 8 tokens differ")),
            "{e}"
        );
        // A key given where no block is kept is a malformed request, not a match.
        let e = t.extend(&tier, ns, "agent-1", 1, 0, Some(k[0]), k.clone(), None, 12, &limits(), now).unwrap_err();
        assert!(matches!(e, ServerError::InvalidRequest(ref m) if m.contains("base_blocks 0")), "{e}");
        assert_eq!(t.resume(&tier, ns, "agent-1", now).unwrap(), parked, "a refused extend changed the session");
        assert!(!tier.remove(&ns, &tail), "the tail stays pinned");
        assert!(tier.remove(&ns, &k[2]), "the refused extend pinned nothing");
        // The key of the block before the new ones is the manifest's: extended.
        let k2 = put(&tier, ns, 3, BT);
        let m = t.extend(&tier, ns, "agent-1", 1, 2, Some(k[1]), vec![k2], None, 12, &limits(), now).unwrap();
        assert_eq!((m.version, m.keys.len()), (2, 3));
    }

    #[test]
    fn missing_blocks_and_bad_shapes_change_nothing() {
        let tier = DramTier::new(DramConfig { capacity_bytes: 1 << 20, max_pinned_ratio: 0.9 });
        let ns = NamespaceId([2; 16]);
        let mut t = SessionTable::default();
        let now = Instant::now();
        let a = put(&tier, ns, 1, BT);
        let ghost = BlockKey([99; 32]);
        match t.park(&tier, spec(ns, vec![a, ghost], Some(BlockKey([98; 32])), 9, 0), &limits(), now) {
            Err(ServerError::MissingBlocks { missing, missing_tail }) => {
                assert_eq!(missing, vec![1]);
                assert!(missing_tail);
            }
            other => panic!("{other:?}"),
        }
        assert!(tier.remove(&ns, &a), "nothing stays pinned after a failed park");
        let a = put(&tier, ns, 1, BT);
        assert!(matches!(
            t.park(&tier, spec(ns, vec![a], None, 5, 0), &limits(), now),
            Err(ServerError::InvalidRequest(_))
        ));
        let keys: Vec<_> = (0..17).map(|_| a).collect();
        assert!(matches!(
            t.park(&tier, spec(ns, keys, None, 68, 0), &limits(), now),
            Err(ServerError::ContextTooLong { tokens: 68, max: 64 })
        ));
        assert!(t.is_empty());
    }

    #[test]
    fn ttl_expiry_unpins_and_reports_expired() {
        let tier = DramTier::new(DramConfig { capacity_bytes: 1 << 20, max_pinned_ratio: 0.9 });
        let ns = NamespaceId([3; 16]);
        let mut t = SessionTable::default();
        let now = Instant::now();
        let a = put(&tier, ns, 1, BT);
        t.park(&tier, spec(ns, vec![a], None, 4, 0), &limits(), now).unwrap();
        assert_eq!(t.expire(&tier, now + Duration::from_secs(9)).len(), 0);
        // Resuming restarts the TTL.
        t.resume(&tier, ns, "agent-1", now + Duration::from_secs(9)).unwrap();
        assert_eq!(t.expire(&tier, now + Duration::from_secs(18)).len(), 0);
        assert_eq!(t.list(None, now + Duration::from_secs(18)).len(), 1);
        assert_eq!(t.expire(&tier, now + Duration::from_secs(19)).len(), 1);
        assert!(tier.remove(&ns, &a), "expiry unpins");
        match t.resume(&tier, ns, "agent-1", now + Duration::from_secs(21)) {
            Err(ServerError::SessionExpired { ago_ms, .. }) => assert_eq!(ago_ms, 2000),
            other => panic!("{other:?}"),
        }
        // Lazy expiry: no sweep needed for a resume to see it.
        let b = put(&tier, ns, 2, BT);
        let mut s = spec(ns, vec![b], None, 4, 0);
        s.id = "agent-2".into();
        t.park(&tier, s, &limits(), now).unwrap();
        assert!(matches!(
            t.resume(&tier, ns, "agent-2", now + Duration::from_secs(11)),
            Err(ServerError::SessionExpired { .. })
        ));
    }

    /// One namespace's flood of expiries past [`EXPIRED_MEMORY`] forgets its own oldest, so another
    /// namespace's late resume is still told its session expired (and how long ago), not that it
    /// was never there. Before, one first-in-first-out list forgot the oldest of every namespace.
    #[test]
    fn a_flood_of_expiries_in_one_namespace_does_not_forget_another_s() {
        let mut t = SessionTable::default();
        let (victim, flood) = (NamespaceId([1; 16]), NamespaceId([2; 16]));
        let now = Instant::now();
        t.remember_expired((victim, "s".into()), now);
        for i in 0..EXPIRED_MEMORY + 1_000 {
            t.remember_expired((flood, format!("f{i}")), now);
        }
        let later = now + Duration::from_secs(3);
        assert_eq!(t.expired_ago(victim, "s", later), Some(Duration::from_secs(3)));
        assert!(t.expired_ago(flood, &format!("f{}", EXPIRED_MEMORY + 999), later).is_some());
        assert!(t.expired.len() <= EXPIRED_MEMORY);
    }
}
