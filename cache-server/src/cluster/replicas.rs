//! Replicated sessions: with `rf` >= 2 (the namespace's `replicas`, else `cluster_rf`), a parked session — its manifest and its blocks —
//! is on `rf` nodes before the park is acknowledged; a resume on any node finds the newest copy
//! among the session's owners and adopts it (the blocks fetched from the node that holds them);
//! after a membership change each holder re-makes the copies that are missing, in the
//! background, bounded.
//!
//! A session's owners are the rendezvous owners of a key derived from its id (the same
//! placement as blocks, so they spread over racks and zones): the node a park reaches keeps its
//! copy and sends one to the first `rf - 1` other owners that take it, going down the order past
//! nodes that fail. Copies carry the session's version; a node never replaces a copy with an
//! older one, and a resume adopts a newer copy than its own, so a node that was away (restarted,
//! partitioned) can't serve a stale manifest once its peers answer. Every call is bounded by
//! `peer_timeout`; a resume with a copy of its own waits at most [`CHECK_WAIT`] for the owners.
//!
//! Drops: every node that takes or is told of a session's drop remembers it for an hour, as of
//! when it was made (`SessionStore::remember_drop_at`; carried as an age between nodes; in the
//! session log where the node has one, so across its restarts), and
//! says so in its `SessionReplica` answers; a copy last touched before a drop anyone remembers
//! is a dropped one — never adopted, refused as a copy, and dropped by the node that holds it
//! (one that was away during the drop) — while a session parked again under the id is not.
//! Re-replication also runs when a park or extend was left short of copies.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kvtier_proto::{pb, BlockKey, Namespace, NamespaceId};
use tokio::sync::watch;

use super::member::{Member, NodeId};
use super::peer::{PeerTier, ReplicaPut};
use super::placement::{Placement, MAX_RF};
use crate::dram::{Priority, StoredBlock};
use crate::error::ServerError;
use crate::session_store::SessionStore;
use crate::sessions::SessionManifest;
use crate::state::NodeState;
use crate::tiers::Load;

/// Payload bytes sent to a peer per request when copying a session's blocks.
const COPY_CHUNK_BYTES: usize = 16 << 20;
/// Keys asked of a peer per request when adopting its copy of a session.
const ADOPT_CHUNK_KEYS: usize = 32;
/// How long a resume that has a copy of its own waits for the owners' versions.
pub const CHECK_WAIT: Duration = Duration::from_millis(250);
/// Sessions one re-replication pass looks at.
const REPAIR_BATCH: usize = 4096;
/// Sessions re-replication copies at once.
const REPAIR_CONCURRENCY: usize = 4;
/// How soon a re-replication pass that left copies missing runs again.
const REPAIR_RETRY: Duration = Duration::from_secs(5);
/// How long re-replication leaves a member alone after it had no room for a session's copy (the
/// first time; doubled on each refusal after, up to [`ROOM_BACKOFF_MAX`]), so a node too small
/// for a session isn't sent its blocks on every pass, churning its DRAM. Forgotten when the
/// membership changes.
const ROOM_BACKOFF: Duration = Duration::from_secs(60);
const ROOM_BACKOFF_MAX: Duration = Duration::from_secs(15 * 60);

/// The placement key of a session: a domain-separated hash of its id.
pub fn session_key(id: &str) -> BlockKey {
    let mut h = blake3::Hasher::new();
    h.update(b"kvtier session\0");
    h.update(id.as_bytes());
    BlockKey(*h.finalize().as_bytes())
}

/// The members that own session `id` (up to [`MAX_RF`]), best first, without this node and
/// the peers known to be down.
fn owners(peers: &PeerTier, p: &Placement, ns: &NamespaceId, id: &str) -> Vec<usize> {
    let now = Instant::now();
    let n = p.members().len().min(MAX_RF);
    let mut out = p.owners(ns, &session_key(id), n);
    out.retain(|&i| {
        let m = &p.members()[i];
        m.id != *peers.local() && !peers.is_down(&m.id, now)
    });
    out
}

/// The peer tier, when this node is in a cluster and sessions of `ns` have `rf` >= 2 copies.
pub fn replicating<'a>(state: &'a NodeState, ns: &Namespace) -> Option<&'a Arc<PeerTier>> {
    state.tiers().peers().filter(|p| p.rf_for(ns) >= 2)
}

/// Makes sure `m` (just parked or extended here) is held by `rf` nodes, this one included:
/// sends the blocks the next owners lack and the manifest. Returns how many nodes hold it; an
/// error names the nodes that failed when fewer than `rf` do (this node's copy stays).
pub async fn replicate(state: &NodeState, ns: &Namespace, m: &SessionManifest) -> Result<usize, ServerError> {
    let Some(peers) = replicating(state, ns) else { return Ok(1) };
    let rf = peers.rf_for(ns);
    let p = peers.placement();
    let order = owners(peers, &p, &ns.id(), &m.id);
    let (mut held, mut next) = (1, 0);
    let mut failures = Vec::new();
    // A refusal a peer answered with (a tenant's quota there, no room) is said as what it is.
    let mut refusal = None;
    while held < rf && next < order.len() {
        let take = (rf - held).min(order.len() - next);
        let batch = &order[next..next + take];
        next += take;
        let copies = batch.iter().map(|&i| copy_to(state, peers, &p.members()[i], ns, m));
        for (&i, r) in batch.iter().zip(futures::future::join_all(copies).await) {
            match r {
                Ok(()) => held += 1,
                // Another node wrote this version at the same time: this write is not
                // acknowledged, however many other owners would take it (that would acknowledge
                // two contexts at one version).
                Err(e @ ServerError::ConcurrentWrite { .. }) => return Err(e),
                Err(e) => {
                    peers.failed(&p.members()[i], "session", &e);
                    failures.push(format!("{}: {e}", p.members()[i].id));
                    if !matches!(e, ServerError::Peer { .. }) {
                        refusal.get_or_insert(e);
                    }
                }
            }
        }
    }
    ::metrics::counter!("kvtier_session_copies_total").increment(held as u64 - 1);
    if held < rf {
        ::metrics::counter!("kvtier_session_underreplicated_total").increment(1);
        // Made up for by re-replication once the peers answer (every 5 s until then).
        peers.want_repair();
        let why = if failures.is_empty() {
            format!(
                "no other member to hold a copy (members that failed within the last {:?} are skipped)",
                super::peer::DOWN_FOR
            )
        } else {
            failures.join("; ")
        };
        let reason = format!(
            "session {:?} version {} is held by {held} of {rf} nodes (kept here at that version: park again with it to retry): {why}",
            m.id, m.version
        );
        return Err(match refusal {
            Some(ServerError::QuotaExceeded(_)) => ServerError::QuotaExceeded(reason),
            Some(ServerError::Capacity(_)) => ServerError::Capacity(reason),
            _ => ServerError::ShortOfCopies(reason),
        });
    }
    Ok(held)
}

/// Gives `member` a copy of `m`: the blocks it lacks, then the manifest.
async fn copy_to(
    state: &NodeState,
    peers: &PeerTier,
    member: &Member,
    ns: &Namespace,
    m: &SessionManifest,
) -> Result<(), ServerError> {
    let bad = |reason: String| ServerError::Peer { peer: member.id.to_string(), reason };
    let mut keys = m.keys.clone();
    keys.extend(m.tail);
    // Larger than all it can hold (DRAM and disk together): nothing is sent. Its size as this
    // node stores it (an FP8/NVFP4/LZ4 session is 2-4x smaller than the raw KV its manifest
    // counts); a block not held here counts nothing (the member may hold it already).
    let stored = state.tiers().stored_bytes(&ns.id(), &keys);
    if stored > member.capacity {
        return Err(ServerError::Capacity(format!(
            "node {} holds at most {} bytes, and session {:?} is {stored} bytes as stored ({} bytes of raw KV)",
            member.id, member.capacity, m.id, m.bytes
        )));
    }
    // Twice at most: blocks it had may be evicted between the check and the manifest.
    for attempt in 0..2 {
        let have = peers.bounded(member, peers.transport().exists(member, ns, &keys)).await?;
        if have.len() != keys.len() {
            return Err(bad(format!("{} answers for {} keys", have.len(), keys.len())));
        }
        let missing: Vec<BlockKey> = keys.iter().zip(have).filter(|(_, h)| !h).map(|(k, _)| *k).collect();
        send_blocks(state, peers, member, ns, &missing).await?;
        match peers.bounded(member, peers.transport().session_put(member, ns, m)).await? {
            ReplicaPut::Held(v) if v >= m.version => return Ok(()),
            ReplicaPut::Held(v) => return Err(bad(format!("kept version {v}, not {}", m.version))),
            ReplicaPut::Missing { .. } if attempt == 0 => continue,
            // It answered, twice, having lost blocks it was just sent: no room for the session
            // there (its DRAM smaller than the session, or full of pins, and no disk tier to
            // take the rest), not a node that is down.
            ReplicaPut::Missing { blocks, tail } => {
                let tail = if tail { " and its tail" } else { "" };
                return Err(ServerError::Capacity(format!(
                    "node {} has no room for session {:?}: it evicted {} of its blocks{tail} before the manifest \
                     could pin them, twice",
                    member.id,
                    m.id,
                    blocks.len()
                )));
            }
            ReplicaPut::Dropped => return Err(dropped_there(member, &m.id)),
            ReplicaPut::Conflict(version) => {
                ::metrics::counter!("kvtier_session_concurrent_writes_total").increment(1);
                return Err(ServerError::ConcurrentWrite { id: m.id.clone(), version, node: member.id.to_string() });
            }
        }
    }
    Err(bad("blocks kept going missing".into()))
}

/// `member` dropped session `id` after this node's copy was last touched.
fn dropped_there(member: &Member, id: &str) -> ServerError {
    ServerError::SessionNotFound(format!(
        "{id}: dropped on node {} after this copy was last touched (a node away during the drop)",
        member.id
    ))
}

/// Drops this node's copy `m` of a session dropped elsewhere `dropped_ago` ago, while this node
/// was away (and remembers the drop as of then, against copies other nodes may still send).
pub async fn drop_stale_copy(state: &Arc<NodeState>, m: &SessionManifest, dropped_ago: Duration) {
    let (st, ns, id, version) = (state.clone(), m.namespace, m.id.clone(), m.version);
    let gone = state
        .io()
        .run(None, move || {
            if let Some(at) = Instant::now().checked_sub(dropped_ago) {
                st.sessions().remember_drop_at(ns, &id, at);
            }
            st.sessions().drop_replica(st.tiers().session_pins(), ns, &id, version)
        })
        .await;
    match gone {
        Ok(Ok(true)) => {
            ::metrics::counter!("kvtier_session_stale_copies_dropped_total").increment(1);
            tracing::info!(session = %m.id, "dropped a copy of a session dropped elsewhere while this node was away");
        }
        Ok(Ok(false)) => {}
        Ok(Err(e)) => tracing::warn!(session = %m.id, "a stale session copy was not dropped: {e}"),
        Err(e) => tracing::warn!(session = %m.id, "a stale session copy was not dropped: {e:?}"),
    }
}

/// Sends `keys` (read from this node's tiers) to `member`, in requests of about
/// [`COPY_CHUNK_BYTES`].
async fn send_blocks(
    state: &NodeState,
    peers: &PeerTier,
    member: &Member,
    ns: &Namespace,
    keys: &[BlockKey],
) -> Result<(), ServerError> {
    let id = ns.id();
    let mut chunk: Vec<StoredBlock> = Vec::new();
    let mut bytes = 0usize;
    for (i, k) in keys.iter().enumerate() {
        match state.tiers().get_for_node(&id, k).await {
            Load::Hit(b) => {
                bytes += b.payload.len();
                chunk.push(b);
            }
            Load::Busy | Load::Miss => {
                return Err(ServerError::MissingBlocks { missing: vec![i as u32], missing_tail: false })
            }
        }
        if bytes >= COPY_CHUNK_BYTES || i + 1 == keys.len() {
            let held = peers.bounded(member, peers.transport().put(member, ns, &chunk)).await?;
            if held < chunk.len() {
                return Err(ServerError::Peer {
                    peer: member.id.to_string(),
                    reason: format!("kept {held} of {} blocks", chunk.len()),
                });
            }
            chunk.clear();
            bytes = 0;
        }
    }
    Ok(())
}

/// What the owners hold of a session: the newest copy newer than this node's, and the latest
/// drop any of them (or this node) remembers.
#[derive(Default)]
pub struct Elsewhere {
    pub newest: Option<(Member, SessionManifest)>,
    /// This node's copy, when it is a dropped one (last touched before that drop), and how
    /// long ago the drop was: the caller drops it ([`drop_stale_copy`]).
    pub stale_here: Option<(SessionManifest, Duration)>,
    /// How long ago the session expired on an owner that holds no live copy (the youngest), when
    /// no owner dropped it: a resume that finds none says "expired", as the holder would.
    pub expired_ago: Option<Duration>,
    /// The members asked (or skipped as down) that gave no answer: one of them may hold a copy.
    pub unanswered: Vec<NodeId>,
}

/// The newest copy of session `id` the owners hold, if newer than this node's (none, or a
/// dropped one, count as version 0) and not a dropped one itself (last touched before a drop
/// any owner or this node remembers):
/// the first `rf + 1` owners are asked at once — every member (up to [`MAX_RF`]) when
/// this node has no copy, since with `rf` = 1 a session stays on the node that parked it —
/// each given at most `wait`; a peer that fails is skipped for a while, one that is merely
/// slower than `wait` is not.
pub async fn newest_elsewhere(
    state: &NodeState,
    peers: &PeerTier,
    ns: &Namespace,
    id: &str,
    wait: Duration,
) -> Elsewhere {
    let local = state.sessions().peek(ns.id(), id);
    let p = peers.placement();
    let rf = peers.rf_for(ns);
    // With one copy per session it stays on whichever node parked it: every member is asked.
    // With more, the first owners (every one up to MAX_RF when this node has no copy).
    let candidates: Vec<&Member> = match rf {
        0 | 1 => p.members().iter().filter(|m| m.id != *peers.local()).collect(),
        _ => {
            let n = if local.is_none() { MAX_RF } else { rf + 1 };
            p.owners(&ns.id(), &session_key(id), p.members().len().min(MAX_RF))
                .into_iter()
                .map(|i| &p.members()[i])
                .filter(|m| m.id != *peers.local())
                .take(n)
                .collect()
        }
    };
    // Members skipped as down (they failed lately) answer nothing either.
    let now = Instant::now();
    let (ask, down): (Vec<&Member>, Vec<&Member>) = candidates.into_iter().partition(|m| !peers.is_down(&m.id, now));
    let mut unanswered: Vec<NodeId> = down.into_iter().map(|m| m.id.clone()).collect();
    let calls = ask.iter().map(|&member| async move {
        let call = peers.bounded(member, peers.transport().session_get(member, ns, id));
        match tokio::time::timeout(wait, call).await {
            Ok(Ok(found)) => Ok(Some((member.clone(), found))),
            // It answered with a refusal of its own (it can't take the namespace: a tenant's
            // quota there): it holds no copy.
            Ok(Err(e)) if !matches!(e, ServerError::Peer { .. }) => Ok(None),
            Ok(Err(e)) => {
                peers.failed(member, "session", &e);
                Err(member.id.clone())
            }
            Err(_) => Err(member.id.clone()),
        }
    });
    let mut answers = Vec::with_capacity(ask.len());
    for answer in futures::future::join_all(calls).await {
        match answer {
            Ok(Some(a)) => answers.push(a),
            Ok(None) => {}
            Err(id) => unanswered.push(id),
        }
    }
    // The latest drop anyone remembers, as an age (the youngest).
    let now = Instant::now();
    let dropped_ago = answers
        .iter()
        .filter_map(|(_, a)| a.dropped_ago_at(now))
        .chain(state.sessions().dropped_at(ns.id(), id).map(|at| now.saturating_duration_since(at)))
        .min();
    // A session created anew supersedes the copies of an older one under its id, last touched
    // before its creation, whatever their versions: the youngest creation among the copies (this
    // node's and the answers'), as the same kind of age, and the youngest of the two that counts.
    let created_ago = answers
        .iter()
        .filter_map(|(_, a)| a.copy.as_ref())
        .chain(local.as_ref())
        .filter(|m| m.namespace == ns.id() && m.id == id)
        .filter_map(SessionManifest::supersedes_before)
        .map(|at| now.saturating_duration_since(at))
        .min();
    let stale_ago = dropped_ago.into_iter().chain(created_ago).min();
    let dropped = |m: &SessionManifest| stale_ago.is_some_and(|ago| SessionStore::touched_before_ago(m, ago, now));
    let stale_here = local.filter(|m| dropped(m)).zip(stale_ago);
    let local_version = match (&stale_here, state.sessions().peek(ns.id(), id)) {
        (None, Some(m)) => m.version,
        _ => 0,
    };
    let expired_ago = match dropped_ago {
        Some(_) => None,
        None => answers.iter().filter_map(|(_, a)| a.expired_ago_at(now)).min(),
    };
    let newest = answers
        .into_iter()
        .filter_map(|(member, a)| Some((member, a.copy?)))
        .filter(|(_, m)| m.version > local_version && m.namespace == ns.id() && m.id == id)
        .filter(|(_, m)| !dropped(m))
        .max_by_key(|(_, m)| m.version);
    Elsewhere { newest, stale_here, expired_ago, unanswered }
}

/// Makes `from`'s copy of a session this node's own: fetches the blocks this node lacks from
/// `from` (each checked), makes them durable with the disk tier, and keeps the manifest (unless
/// a newer version got here meanwhile).
pub async fn adopt(
    state: &Arc<NodeState>,
    peers: &PeerTier,
    from: &Member,
    ns: &Namespace,
    m: SessionManifest,
) -> Result<(), ServerError> {
    let id = ns.id();
    let mut keys = m.keys.clone();
    keys.extend(m.tail);
    // Every block in DRAM is held there from the moment it is here until the manifest pins it
    // (pinned; past DRAM's pinned share, on a node with a disk tier, leased without a pin: such a
    // block may go to disk, as sent, where `persist` finds it). Blocks only on disk stay there
    // (the manifest pins them on disk); only blocks no local tier has are fetched.
    let mut hold = DramHold { state, ns: id, keys: Vec::with_capacity(keys.len()) };
    let mut missing = Vec::new();
    for k in &keys {
        if !hold.add(k) && !state.tiers().holds(&id, k) {
            missing.push(*k);
        }
    }
    for chunk in missing.chunks(ADOPT_CHUNK_KEYS) {
        let got = peers.bounded(from, peers.transport().get(from, ns, chunk)).await?;
        if got.len() != chunk.len() {
            return Err(ServerError::Peer {
                peer: from.id.to_string(),
                reason: format!("{} answers for {} keys", got.len(), chunk.len()),
            });
        }
        for (k, b) in chunk.iter().zip(got) {
            let b = match b {
                Some(b) if peers.check(ns, k, &b) => b,
                _ => {
                    return Err(ServerError::Peer {
                        peer: from.id.to_string(),
                        reason: "a block of its session copy is missing or fails its checks".into(),
                    })
                }
            };
            peers.received(b.payload.len() as u64);
            // As a data-plane PUT does: a burst of fetched blocks must not overflow the
            // demotion queue (an overflowing eviction is dropped, and the adoption would fail).
            state.tiers().backpressure().await;
            state.tiers().put_fetched(&b, m.priority)?;
            if !hold.add(k) {
                return Err(ServerError::Capacity(format!(
                    "no room to hold session {:?}'s blocks while it is adopted",
                    m.id
                )));
            }
        }
    }
    state.tiers().persist(&id, &m.keys, m.tail).await?;
    let limits = state.session_limits(ns);
    let st = state.clone();
    let kept = state.io().run(None, move || st.sessions().put_replica(st.tiers().session_pins(), m, &limits)).await?;
    match kept {
        Ok(_) | Err(ServerError::VersionConflict { .. }) => {
            ::metrics::counter!("kvtier_session_adopted_total").increment(1);
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// Blocks held in DRAM (lease pins) while a session copy is adopted; let go when dropped.
struct DramHold<'a> {
    state: &'a NodeState,
    ns: NamespaceId,
    keys: Vec<BlockKey>,
}

impl DramHold<'_> {
    /// Holds `key` if DRAM has it; false if it does not (or can't pin more).
    fn add(&mut self, key: &BlockKey) -> bool {
        let ok = self.state.tiers().pin_lease(&self.ns, key).is_ok();
        if ok {
            self.keys.push(*key);
        }
        ok
    }
}

impl Drop for DramHold<'_> {
    fn drop(&mut self) {
        for k in &self.keys {
            self.state.tiers().unpin_lease(&self.ns, k);
        }
    }
}

/// Drops the owners' copies of a session, in the background (best effort: a copy on a node
/// away now is met by the drop the others remember, or expires with its TTL). The task's
/// answer: whether any owner's copy went.
pub fn drop_elsewhere(
    peers: &Arc<PeerTier>,
    ns: Namespace,
    id: String,
    dropped_at: Instant,
) -> tokio::task::JoinHandle<bool> {
    let peers = peers.clone();
    tokio::spawn(async move {
        let p = peers.placement();
        let calls = owners(&peers, &p, &ns.id(), &id).into_iter().take(peers.rf_for(&ns) + 1).map(|i| {
            let member = &p.members()[i];
            let (peers, ns, id) = (&peers, &ns, &id);
            async move {
                let drop = peers.transport().session_drop(member, ns, id, u64::MAX, Some(dropped_at));
                match peers.bounded(member, drop).await {
                    Ok(removed) => removed,
                    Err(e) => {
                        peers.failed(member, "session", &e);
                        false
                    }
                }
            }
        });
        futures::future::join_all(calls).await.into_iter().any(|removed| removed)
    })
}

/// Most [`supersede_elsewhere`] tasks at once; past it a create's older copies are met only by
/// the drop its node remembers (and by a holder's check of a copy it recovered at its start).
const MAX_SUPERSEDING: usize = 64;
static SUPERSEDING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// After a park created session `id` here without an answer from `members` (down, cut off):
/// tells each of them, once it answers, that its copy of the session last touched before `at`
/// is superseded — it drops it (that version only: one it took since stays) and remembers the
/// drop — so a holder that was only cut off, not restarted, stops serving the old context. Asked
/// again every few seconds (up to a minute apart) while a member stays in the membership, for at
/// most [`crate::session_store::DROP_REMEMBERED`].
pub fn supersede_elsewhere(peers: &Arc<PeerTier>, ns: Namespace, id: String, at: Instant, members: Vec<NodeId>) {
    use std::sync::atomic::Ordering;
    if SUPERSEDING.fetch_add(1, Ordering::Relaxed) >= MAX_SUPERSEDING {
        SUPERSEDING.fetch_sub(1, Ordering::Relaxed);
        ::metrics::counter!("kvtier_session_supersede_skipped_total").increment(1);
        return;
    }
    let peers = peers.clone();
    tokio::spawn(async move {
        let mut left = members;
        let mut wait = Duration::from_secs(1);
        while !left.is_empty() && at.elapsed() < crate::session_store::DROP_REMEMBERED {
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(Duration::from_secs(60));
            let p = peers.placement();
            let mut still = Vec::new();
            for member_id in left {
                // Gone from the membership: a copy it recovers when back is checked on its first use.
                let Some(member) = p.members().iter().find(|m| m.id == member_id) else { continue };
                // Skipped while it is known to be down (its calls would take a timeout each).
                if peers.is_down(&member.id, Instant::now()) {
                    still.push(member_id);
                    continue;
                }
                let theirs = match peers.bounded(member, peers.transport().session_get(member, &ns, &id)).await {
                    Ok(theirs) => theirs,
                    Err(e) => {
                        peers.failed(member, "session", &e);
                        still.push(member_id);
                        continue;
                    }
                };
                let now = Instant::now();
                let ago = now.saturating_duration_since(at);
                let Some(old) = theirs.copy.filter(|m| SessionStore::touched_before_ago(m, ago, now)) else { continue };
                let drop = peers.transport().session_drop(member, &ns, &id, old.version, Some(at));
                match peers.bounded(member, drop).await {
                    Ok(removed) => {
                        if removed {
                            ::metrics::counter!("kvtier_session_superseded_copies_dropped_total").increment(1);
                        }
                    }
                    Err(e) => {
                        peers.failed(member, "session", &e);
                        still.push(member_id);
                    }
                }
            }
            left = still;
        }
        SUPERSEDING.fetch_sub(1, Ordering::Relaxed);
    });
}

/// Drops `member`'s copy of a session up to `version`, in the background (a session adopted
/// with `cluster_rf` = 1 moves rather than being copied).
pub fn drop_copy(peers: &Arc<PeerTier>, member: Member, ns: Namespace, id: String, version: u64) {
    let peers = peers.clone();
    tokio::spawn(async move {
        if let Err(e) = peers.bounded(&member, peers.transport().session_drop(&member, &ns, &id, version, None)).await {
            peers.failed(&member, "session", &e);
        }
    });
}

/// Re-replication: [`REPAIR_RETRY`] after the node starts, after every membership change, after
/// a park or extend left a session short of copies, and again every [`REPAIR_RETRY`] while copies
/// are missing, each
/// session this node holds is checked against its first `rf` live owners, and the copies they
/// lack are made; a newer copy found there is adopted. Ends when `stop` turns true.
pub async fn repair_loop(state: Arc<NodeState>, mut stop: watch::Receiver<bool>) {
    let Some(peers) = state.tiers().peers().cloned() else { return };
    let mut members = peers.members();
    // A first pass soon after start, as after a change: a node back from a restart holds copies
    // the others may have dropped (or not hold) meanwhile, and its membership may never change.
    let mut incomplete = true;
    let mut last_pass = Instant::now();
    let backoff = RoomBackoff::default();
    let mut generation = members.borrow().generation;
    loop {
        tokio::select! {
            _ = crate::stopped(&mut stop) => return,
            changed = members.changed() => {
                if changed.is_err() {
                    return;
                }
                // A member joined, left or came back (perhaps larger): asked again. Not when
                // only the snapshot's staleness changed (Redis slow for a tick).
                let now = members.borrow().generation;
                if now != generation {
                    generation = now;
                    backoff.clear();
                }
            },
            // A park short of copies: a pass, at most one per `REPAIR_RETRY` (parks refused
            // copies on and on by a peer, a tenant's quota there, don't each set off a pass).
            _ = peers.repair_wanted() => tokio::select! {
                _ = crate::stopped(&mut stop) => return,
                _ = tokio::time::sleep_until((last_pass + REPAIR_RETRY).into()) => {}
            },
            _ = tokio::time::sleep(REPAIR_RETRY), if incomplete => {}
        }
        // Let a burst of changes (a node leaving and coming back) settle into one pass.
        tokio::time::sleep(Duration::from_millis(200)).await;
        members.borrow_and_update();
        incomplete = !repair_pass(&state, &peers, &backoff).await;
        last_pass = Instant::now();
    }
}

/// Members that had no room for a session's copy, left alone for a while ([`ROOM_BACKOFF`]).
#[derive(Default)]
struct RoomBackoff(parking_lot::Mutex<std::collections::HashMap<SessionAt, (Instant, u32)>>);

/// A session's copy on one member: namespace, session id, member.
type SessionAt = (NamespaceId, String, NodeId);

impl RoomBackoff {
    /// Most (session, member) pairs remembered; past it the ones whose wait is over go, and if
    /// that is not enough, all (they are asked again on the next pass).
    const MAX: usize = 65536;

    fn waiting(&self, m: &SessionManifest, member: &NodeId, now: Instant) -> bool {
        let key = (m.namespace, m.id.clone(), member.clone());
        self.0.lock().get(&key).is_some_and(|(until, _)| now < *until)
    }

    fn refused(&self, m: &SessionManifest, member: &NodeId, now: Instant) {
        let mut map = self.0.lock();
        if map.len() >= Self::MAX {
            map.retain(|_, (until, _)| now < *until);
            if map.len() >= Self::MAX {
                map.clear();
            }
        }
        let e = map.entry((m.namespace, m.id.clone(), member.clone())).or_insert((now, 0));
        let wait = ROOM_BACKOFF.saturating_mul(1 << e.1.min(8)).min(ROOM_BACKOFF_MAX);
        *e = (now + wait, e.1.saturating_add(1));
    }

    fn clear(&self) {
        self.0.lock().clear();
    }
}

/// One pass over (up to [`REPAIR_BATCH`]) sessions held here; true if every copy is in place.
async fn repair_pass(state: &Arc<NodeState>, peers: &Arc<PeerTier>, backoff: &RoomBackoff) -> bool {
    let sessions: Vec<SessionManifest> = state.sessions().list(None).into_iter().take(REPAIR_BATCH).collect();
    let results: Vec<bool> = futures::stream::iter(sessions)
        .map(|m| repair_one(state, peers, m, backoff))
        .buffer_unordered(REPAIR_CONCURRENCY)
        .collect()
        .await;
    results.into_iter().all(|ok| ok)
}

/// Checks one session held here against its owners, in placement order, until `rf - 1` others
/// (`rf` when this node is not an owner) hold it: copies the ones that lack it, adopts a newer
/// copy found. An owner with no room for it is passed over for the next (and left alone for a
/// while); true if enough copies are in place.
async fn repair_one(state: &Arc<NodeState>, peers: &Arc<PeerTier>, m: SessionManifest, backoff: &RoomBackoff) -> bool {
    let Ok(ns) = state.namespace(&m.namespace) else { return true };
    let rf = peers.rf_for(&ns);
    if rf < 2 {
        return true;
    }
    let p = peers.placement();
    // The first `rf` live owners, less this node.
    let all = owners(peers, &p, &m.namespace, &m.id);
    let mine = p.owners(&m.namespace, &session_key(&m.id), rf);
    let here = mine.iter().any(|&i| p.members()[i].id == *peers.local());
    let want = rf - usize::from(here);
    // Too few owners to ask because some failed lately (skipped for a while): not complete, so
    // the next pass (in `REPAIR_RETRY`) asks them again.
    let now = Instant::now();
    let skipped = p
        .owners(&m.namespace, &session_key(&m.id), p.members().len().min(MAX_RF))
        .into_iter()
        .filter(|&i| p.members()[i].id != *peers.local() && peers.is_down(&p.members()[i].id, now))
        .count();
    let mut held = 0;
    let (mut short, mut refused) = (false, false);
    for &i in &all {
        if held >= want {
            break;
        }
        let member = &p.members()[i];
        if backoff.waiting(&m, &member.id, now) {
            refused = true;
            continue;
        }
        let theirs = match peers.bounded(member, peers.transport().session_get(member, &ns, &m.id)).await {
            Ok(t) => t,
            Err(e) => {
                peers.failed(member, "session", &e);
                short = true;
                continue;
            }
        };
        // Dropped there while this node was away, or created anew there since this copy was
        // last touched (an older session's): this copy goes, and is not re-made anywhere.
        let now = Instant::now();
        let dropped_ago = theirs.dropped_ago_at(now);
        let created_ago = theirs
            .copy
            .as_ref()
            .filter(|t| t.namespace == m.namespace && t.id == m.id)
            .and_then(SessionManifest::supersedes_before)
            .map(|at| now.saturating_duration_since(at));
        let stale_ago = dropped_ago.into_iter().chain(created_ago).min();
        if let Some(ago) = stale_ago.filter(|ago| SessionStore::touched_before_ago(&m, *ago, now)) {
            drop_stale_copy(state, &m, ago).await;
            return true;
        }
        // Their copy is a dropped one (this node or they remember the drop), or an older
        // session's than this one: never adopted; this one is copied over it (a copy an older
        // session's is replaced there), or it goes when that node meets the drop.
        let theirs = theirs.copy.filter(|t| {
            !state.sessions().is_dropped_copy(t)
                && !m.supersedes(t)
                && dropped_ago.is_none_or(|ago| !SessionStore::touched_before_ago(t, ago, now))
        });
        match theirs {
            Some(t) if t.version == m.version => {
                if !t.same_context(&m) {
                    // Two writes at once left two contexts at one version (neither acknowledged):
                    // said, not settled here — the session's next write settles it.
                    ::metrics::counter!("kvtier_session_conflicting_copies_total").increment(1);
                    tracing::warn!(
                        session = %m.id, peer = %member.id, version = m.version,
                        "another context at the same version there (two writes at once); the next write settles it"
                    );
                }
                held += 1;
            }
            Some(t) if t.version > m.version => {
                if let Err(e) = adopt(state, peers, member, &ns, t).await {
                    tracing::warn!(session = %m.id, peer = %member.id, "could not adopt a newer copy: {e}");
                    return false;
                }
                return !short;
            }
            _ => match copy_to(state, peers, member, &ns, &m).await {
                Ok(()) => {
                    ::metrics::counter!("kvtier_session_recopied_total").increment(1);
                    held += 1;
                }
                // The owner refused it as a dropped copy: this node meets the drop through the
                // owners' answers (above) on the next pass; nothing is dropped on a guess here.
                Err(ServerError::SessionNotFound(e)) => {
                    tracing::debug!(session = %m.id, "an owner refused this copy as dropped: {e}");
                    short = true;
                }
                // No room there (or a tenant's quota): the next owner is asked instead, and this
                // one left alone for a while rather than sent the blocks again on every pass.
                Err(e @ (ServerError::Capacity(_) | ServerError::QuotaExceeded(_))) => {
                    peers.failed(member, "session", &e);
                    ::metrics::counter!("kvtier_session_copies_refused_total").increment(1);
                    tracing::warn!(
                        session = %m.id, peer = %member.id,
                        "session copy refused there, asking the next owner (and not this one for a while): {e}"
                    );
                    backoff.refused(&m, &member.id, Instant::now());
                    refused = true;
                }
                Err(e) => {
                    peers.failed(member, "session", &e);
                    tracing::warn!(session = %m.id, peer = %member.id, "session copy not re-made: {e}");
                    short = true;
                }
            },
        }
    }
    // Short of copies: asked again on the next pass (every REPAIR_RETRY while any session is
    // short), which skips the members left alone for want of room until their wait is over.
    // Short only because there are not enough members (none failed or was skipped as down):
    // a membership change asks again.
    held >= want || (!short && skipped == 0 && !refused)
}

/// A session as a `SessionReplica` call carries it, and its TTL in ms.
pub fn manifest_to_pb(m: &SessionManifest, now: Instant) -> (pb::SessionManifest, u64) {
    (m.to_pb(now), m.ttl.as_millis() as u64)
}

/// The session a `SessionReplica` call carries (its size in bytes is recomputed by the node
/// that keeps it).
pub fn manifest_from_pb(
    ns: NamespaceId,
    m: &pb::SessionManifest,
    ttl_ms: u64,
    now: Instant,
) -> Result<SessionManifest, ServerError> {
    let info = m.info.as_ref().ok_or_else(|| ServerError::InvalidRequest("a session copy without info".into()))?;
    let key = |b: &[u8]| BlockKey::try_from(b).map_err(ServerError::from);
    let keys = m.keys.iter().map(|k| key(k)).collect::<Result<Vec<_>, _>>()?;
    let tail = if m.tail_key.is_empty() { None } else { Some(key(&m.tail_key)?) };
    if info.session_id.is_empty() || info.session_id.len() > 256 {
        return Err(ServerError::InvalidRequest("session_id must be 1..=256 bytes".into()));
    }
    let ttl = Duration::from_millis(ttl_ms);
    Ok(SessionManifest {
        namespace: ns,
        id: info.session_id.clone(),
        keys,
        tail,
        token_count: info.token_count,
        ttl,
        expires_at: now + Duration::from_millis(info.expires_in_ms).min(ttl),
        priority: Priority::from_u32(info.priority),
        version: info.version,
        bytes: info.bytes,
        created: info.created_ago_ms.and_then(|ago| now.checked_sub(Duration::from_millis(ago))),
    })
}
