//! G4, the peer tier: blocks held by the other members of the cluster.
//!
//! A load that misses every local tier asks the block's owners (rendezvous placement over the
//! live membership, `cluster_rf` replicas): the missing keys of one client request are grouped by
//! owner and each owner gets **one** request (a `GET` flagged `FLAG_PEER`, which the owner serves
//! from its own tiers and never forwards: a request travels at most one hop). Each key goes to its
//! best replica first (this node's machine, then its rack, zone, the rest; see
//! [`Placement::read_order`]); keys whose owner failed (refused, cut, timed out) are asked of
//! their next replica in one more round; keys whose replica is late are hedged: asked of their
//! next replica too, the first answer used ([`Hedge`]). Every block that comes back is checked —
//! namespace, key, layout, size, checksum — and anything wrong is a miss, never wrong bytes.
//!
//! A store accepted by a node is forwarded to the block's other owners through a bounded queue
//! (a `PUT` flagged `FLAG_PEER`), so every owner holds it without the client knowing the
//! membership; see [`PeerTier::forward`] for why it is written locally first and forwarded after
//! the acknowledgement.
//!
//! Bounds: every peer call runs under `peer_timeout`; at most `peer_max_inflight` calls run at
//! once (a call that can't start within the timeout is a miss); a peer that failed (no answer
//! in time, a cut connection, a wrong answer — not a refusal such as a tenant's quota there) is
//! skipped for [`DOWN_FOR`] (its keys go to the next replica or miss at once), so a dead node
//! costs one timeout, not one per request; the forward queue holds at most [`FORWARD_QUEUE`] requests and
//! `FORWARD_BYTES` bytes, past which forwards are dropped and counted.
//!
//! The network is behind [`PeerTransport`]: the `kvtier` binary plugs in one over
//! `kvtier-client`'s pooled data-plane connections (TCP today, QUIC later); tests plug in fakes.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use kvtier_proto::{BlockKey, Namespace, NamespaceId};
use parking_lot::Mutex;
use tokio::sync::{mpsc, watch, Semaphore};

use super::deletes::{NamespaceDelete, Owed, OwedLog};
use super::handoff::Hints;
use super::member::{Labels, Member, NodeId};
use super::membership::Snapshot;
use super::placement::{Placement, Reader};
use super::settle::{Candidate, Settling};
use crate::dram::StoredBlock;
use crate::error::ServerError;
use crate::sessions::SessionManifest;
use crate::tiers::TierStats;

/// How long a peer that failed is skipped.
pub const DOWN_FOR: Duration = Duration::from_secs(2);
/// Most store requests waiting to be forwarded.
pub const FORWARD_QUEUE: usize = 256;
/// Most payload bytes waiting to be forwarded.
const FORWARD_BYTES: usize = 256 << 20;

/// What a [`PeerTransport`] call returns.
pub type PeerFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, ServerError>> + Send + 'a>>;

/// How a node talks to its peers. Implementations authenticate as the operator (the peers share
/// `auth_token`) and make sure the peer knows the namespace (registering it there when needed:
/// a namespace's id is derived from its spec, so the same spec is the same namespace on every
/// node). Calls need not bound their own time: [`PeerTier`] does.
pub trait PeerTransport: Send + Sync + 'static {
    /// Loads `keys` from `peer`'s own tiers, in one request: one entry per key, `None` for a miss.
    fn get<'a>(
        &'a self,
        peer: &'a Member,
        ns: &'a Namespace,
        keys: &'a [BlockKey],
    ) -> PeerFuture<'a, Vec<Option<StoredBlock>>>;

    /// Stores `blocks` (all of namespace `ns`) on `peer`, which keeps them and forwards nothing;
    /// returns how many it holds now.
    fn put<'a>(&'a self, peer: &'a Member, ns: &'a Namespace, blocks: &'a [StoredBlock]) -> PeerFuture<'a, usize>;

    /// Which of `keys` `peer`'s own tiers hold, in one request.
    fn exists<'a>(&'a self, peer: &'a Member, ns: &'a Namespace, keys: &'a [BlockKey]) -> PeerFuture<'a, Vec<bool>>;

    /// Does `what` to namespace `ns` on `peer` alone (which passes it on to nobody), as asked at
    /// `asked` (an unregistration keeps sessions touched since): (sessions dropped, blocks
    /// removed) there. A peer that does not know the namespace holds nothing of it: `(0, 0)`,
    /// not an error.
    fn delete<'a>(
        &'a self,
        peer: &'a Member,
        ns: &'a Namespace,
        what: NamespaceDelete,
        asked: SystemTime,
    ) -> PeerFuture<'a, (u64, u64)>;

    /// How long a prefix of `keys` `peer`'s own tiers hold, and whether it holds `session`, in
    /// one request (a `RouteHint` with `local_only`, authorized like any other call). A transport
    /// that can't ask says so (the peer is then reported unknown).
    fn route_local<'a>(
        &'a self,
        peer: &'a Member,
        ns: &'a Namespace,
        keys: &'a [BlockKey],
        session: Option<&'a str>,
    ) -> PeerFuture<'a, LocalHolding> {
        let _ = (ns, keys, session);
        Box::pin(async move {
            Err(ServerError::Peer { peer: peer.id.to_string(), reason: "this transport has no route hints".into() })
        })
    }

    /// `peer`'s own copy of a parked session, if it holds one (its TTL untouched), and when it
    /// dropped the session, if it did lately.
    fn session_get<'a>(&'a self, peer: &'a Member, ns: &'a Namespace, id: &'a str) -> PeerFuture<'a, ReplicaCopy> {
        let _ = (ns, id);
        Box::pin(async move { Err(no_sessions(peer)) })
    }

    /// Makes `peer` keep a copy of a session (its blocks sent before), unless it holds a newer
    /// version; durable there on return when `peer` logs sessions.
    fn session_put<'a>(
        &'a self,
        peer: &'a Member,
        ns: &'a Namespace,
        m: &'a SessionManifest,
    ) -> PeerFuture<'a, ReplicaPut> {
        let _ = (ns, m);
        Box::pin(async move { Err(no_sessions(peer)) })
    }

    /// Drops `peer`'s copy of a session if its version is at most `version`; whether this call
    /// removed one. `dropped_at`: the session itself was dropped then (not a copy moving away),
    /// which the peer remembers against copies last touched before.
    fn session_drop<'a>(
        &'a self,
        peer: &'a Member,
        ns: &'a Namespace,
        id: &'a str,
        version: u64,
        dropped_at: Option<Instant>,
    ) -> PeerFuture<'a, bool> {
        let _ = (ns, id, version, dropped_at);
        Box::pin(async move { Err(no_sessions(peer)) })
    }
}

fn no_sessions(peer: &Member) -> ServerError {
    ServerError::Peer { peer: peer.id.to_string(), reason: "this transport does not replicate sessions".into() }
}

/// A peer's answer to [`PeerTransport::session_put`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplicaPut {
    /// The peer holds the session now, at this version (the one sent, or a newer one it had).
    Held(u64),
    /// The peer lacks these blocks of the manifest (indices into its keys; and the tail).
    Missing { blocks: Vec<u32>, tail: bool },
    /// The peer dropped the session after this copy was last touched: it is not kept there,
    /// and the sender's copy is a dropped one too.
    Dropped,
    /// The peer holds another context at the same version (another node took a write of the
    /// session at the same time): nothing was replaced there.
    Conflict(u64),
}

/// A peer's answer to [`PeerTransport::session_get`].
#[derive(Clone, Debug)]
pub struct ReplicaCopy {
    /// Its copy, if it holds one.
    pub copy: Option<SessionManifest>,
    /// How long before `answered` it dropped the session, if it did within the last hour: a
    /// copy last touched before is a dropped one, wherever it is. An age, not an instant: the
    /// drop may be older than this machine's clock.
    pub dropped_ago: Option<Duration>,
    /// How long before `answered` the session expired there, when the peer holds no live copy
    /// because of that (a resume elsewhere says "expired", not "not found").
    pub expired_ago: Option<Duration>,
    /// When the answer came (this node's clock).
    pub answered: Instant,
}

impl ReplicaCopy {
    /// How long before `now` the peer dropped the session, if it did.
    pub fn dropped_ago_at(&self, now: Instant) -> Option<Duration> {
        self.dropped_ago.map(|ago| ago + now.saturating_duration_since(self.answered))
    }

    /// How long before `now` the session expired on the peer, if that is why it holds none.
    pub fn expired_ago_at(&self, now: Instant) -> Option<Duration> {
        self.expired_ago.map(|ago| ago + now.saturating_duration_since(self.answered))
    }
}

/// What one node holds of a routing hint's request.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LocalHolding {
    /// Leading keys its own tiers hold.
    pub prefix_blocks: u32,
    /// The session's token count, when it holds the session.
    pub session_tokens: Option<u64>,
}

/// Settings of the peer tier (from `ServerConfig`).
#[derive(Clone, Debug)]
pub struct PeerConfig {
    /// Owners of each block (`cluster_rf`); every node of a cluster must use the same.
    pub rf: usize,
    /// Bound of one peer call, connecting included (`peer_timeout`).
    pub timeout: Duration,
    /// Peer calls running at once, over all requests (`peer_max_inflight`).
    pub max_inflight: usize,
    /// When a load from a replica is also asked of the next one (`peer_hedge`).
    pub hedge: Hedge,
}

/// When a load from a peer is hedged: the keys a replica has not answered for by then are also
/// asked of their next replica, and each key is taken from the first answer that holds it (so
/// one slow or stalling node doesn't set the cluster's tail latency). Only keys with another
/// replica (`rf` >= 2) are hedged; hedges take `peer_max_inflight` permits like any call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hedge {
    Off,
    /// After the 95th percentile of the last [`LATENCY_WINDOW`] peer loads; until
    /// [`MIN_LATENCY_SAMPLES`] have been seen, after a quarter of `peer_timeout`.
    Auto,
    After(Duration),
}

/// Peer load latencies [`Hedge::Auto`] keeps.
pub const LATENCY_WINDOW: usize = 128;
/// Peer loads [`Hedge::Auto`] waits for before it trusts its percentile.
pub const MIN_LATENCY_SAMPLES: usize = 16;
/// The shortest hedge delay `auto` picks (below it, a hedge costs more than it saves).
const MIN_HEDGE_DELAY: Duration = Duration::from_micros(500);

/// How long to wait for a replica before hedging, given recent latencies (pure; `None`: never).
pub fn hedge_delay(hedge: Hedge, recent: &[Duration], timeout: Duration) -> Option<Duration> {
    match hedge {
        Hedge::Off => None,
        Hedge::After(d) => Some(d),
        Hedge::Auto if recent.len() < MIN_LATENCY_SAMPLES => Some(timeout / 4),
        Hedge::Auto => {
            let mut sorted = recent.to_vec();
            sorted.sort_unstable();
            let p95 = sorted[(sorted.len() * 95).div_ceil(100).saturating_sub(1)];
            Some(p95.max(MIN_HEDGE_DELAY))
        }
    }
}

/// The last [`LATENCY_WINDOW`] peer load latencies, oldest overwritten first.
#[derive(Default)]
struct LatencyWindow {
    samples: Vec<Duration>,
    next: usize,
}

impl LatencyWindow {
    fn push(&mut self, d: Duration) {
        if self.samples.len() < LATENCY_WINDOW {
            self.samples.push(d);
        } else {
            self.samples[self.next] = d;
        }
        self.next = (self.next + 1) % LATENCY_WINDOW;
    }
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    errors: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
    forwarded: AtomicU64,
    forward_dropped: AtomicU64,
    hedges: AtomicU64,
    hedge_wins: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// A store waiting to be forwarded, with its share of the forward byte budget.
struct ForwardJob {
    ns: Namespace,
    blocks: Vec<StoredBlock>,
    queued: Instant,
    /// Only to this owner (a read repair), not to every other owner.
    to: Option<NodeId>,
    _bytes: tokio::sync::OwnedSemaphorePermit,
}

/// The peer tier of one node. Cheap to share (`Arc`).
pub struct PeerTier {
    local: NodeId,
    labels: Labels,
    members: watch::Receiver<Snapshot>,
    /// Placement over the members, rebuilt when the snapshot's generation changes.
    placement: Mutex<(u64, Arc<Placement>)>,
    /// The placements it replaced lately, and the members that restarted (see `super::settle`).
    settling: Mutex<Settling>,
    /// Blocks sent to an owner that missed them lately (owner, namespace, key), and when.
    repaired_lately: Mutex<HashMap<(NodeId, NamespaceId, BlockKey), Instant>>,
    transport: Arc<dyn PeerTransport>,
    cfg: PeerConfig,
    inflight: Arc<Semaphore>,
    /// Peers that failed, and until when they are skipped.
    down: Mutex<HashMap<NodeId, Instant>>,
    /// Recent peer load latencies, for [`Hedge::Auto`].
    latencies: Mutex<LatencyWindow>,
    counters: Counters,
    forward_tx: mpsc::Sender<ForwardJob>,
    forward_bytes: Arc<Semaphore>,
    /// Namespaces purged or unregistered lately, and when: forwards queued before are dropped.
    deleted: Mutex<HashMap<NamespaceId, Instant>>,
    /// Deletes owed to members that could not be reached, one per member and namespace, with the
    /// namespace (see `super::deletes`).
    owed_deletes: Mutex<OwedDeletes>,
    /// Where they are kept across restarts (set once, by `super::deletes::restore`).
    owed_log: OnceLock<Arc<OwedLog>>,
    /// Blocks forwards could not give an owner that was down, by owner (see `super::handoff`).
    hints: Mutex<Hints>,
    /// Members of an earlier placement gone from the current one (killed, stopped), and since
    /// when: a node that comes back under its id is owed the deletes made while it was away.
    departed: Mutex<HashMap<NodeId, Instant>>,
    /// Set when a session could not be given all its copies: the re-replication loop runs
    /// without waiting for a membership change (the peers that failed may be members all along).
    repair: tokio::sync::Notify,
}

/// Deletes owed, by member and namespace: what and when, and the namespace.
pub(crate) type OwedDeletes = HashMap<(NodeId, NamespaceId), (Owed, Namespace)>;

/// How long a delete cancels forwards queued before it (the queue drains in far less).
const DELETED_FOR: Duration = Duration::from_secs(60);

/// The blocks of one answer to the keys `idx`, with their key indices.
fn hits(idx: &[usize], answer: Result<Vec<Option<StoredBlock>>, ()>) -> Vec<(usize, StoredBlock)> {
    match answer {
        Ok(blocks) => idx.iter().zip(blocks).filter_map(|(&k, b)| Some((k, b?))).collect(),
        Err(()) => Vec::new(),
    }
}

/// What one peer's share of a fetch round came to (key indices).
#[derive(Default)]
struct Asked {
    got: Vec<(usize, StoredBlock)>,
    /// The call to the key's candidate failed (and no hedge asked its next one).
    failed: Vec<usize>,
    /// The candidate answered "not held" (and no hedge asked the next one).
    missed: Vec<usize>,
}

/// One unhedged answer to the keys `idx`.
fn settle(idx: &[usize], answer: Result<Vec<Option<StoredBlock>>, ()>) -> Asked {
    match answer {
        Ok(blocks) => {
            let mut a = Asked::default();
            for (&k, b) in idx.iter().zip(blocks) {
                match b {
                    Some(b) => a.got.push((k, b)),
                    None => a.missed.push(k),
                }
            }
            a
        }
        Err(()) => Asked { failed: idx.to_vec(), ..Asked::default() },
    }
}

/// Records in `settling`, for a node whose view held only itself until it saw `members`, the
/// membership as it was before this node joined: `members` without it (a node that joined, or
/// restarted with empty memory, holds nothing yet of what it owns).
fn before_joining(settling: &mut Settling, local: &NodeId, members: &[Member], now: Instant) {
    let others: Vec<Member> = members.iter().filter(|m| &m.id != local).cloned().collect();
    if !others.is_empty() {
        settling.replaced(Arc::new(Placement::new(&others)), now);
    }
}

/// How long a block sent to an owner that missed it is not sent to it again.
const REPAIRED_FOR: Duration = Duration::from_secs(10);
/// Most (owner, block) repairs remembered; past it, no more repairs until they age out.
const MAX_REPAIRED_LATELY: usize = 65_536;

/// Most rounds of one fetch: a key's first candidate, and the next ones after a failure or a
/// miss that is not final (see `super::settle`).
const FETCH_ROUNDS: usize = 3;

/// One round's requests: the `pending` keys grouped by their candidate at `cursor` (member index
/// to key indices); keys with no candidate left are not asked.
fn plan_round(pending: &[usize], candidates: &[Vec<Candidate>], cursor: &[usize]) -> HashMap<usize, Vec<usize>> {
    let mut plan: HashMap<usize, Vec<usize>> = HashMap::new();
    for &k in pending {
        if let Some(c) = candidates[k].get(cursor[k]) {
            plan.entry(c.member).or_default().push(k);
        }
    }
    plan
}

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

impl PeerTier {
    /// The peer tier of member `local` (labels `labels`) over the members `members` reports.
    /// Spawns the forwarding task, which ends when `stop` turns true or the tier is dropped.
    pub fn start(
        local: NodeId,
        labels: Labels,
        members: watch::Receiver<Snapshot>,
        transport: Arc<dyn PeerTransport>,
        cfg: PeerConfig,
        stop: watch::Receiver<bool>,
    ) -> (Arc<PeerTier>, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::channel(FORWARD_QUEUE);
        let (placement, settling) = {
            let snap = members.borrow();
            let (mut settling, now) = (Settling::default(), Instant::now());
            before_joining(&mut settling, &local, &snap.members, now);
            settling.at_start(&snap.members, &local, now, unix_ms());
            ((snap.generation, Arc::new(Placement::new(&snap.members))), settling)
        };
        let tier = Arc::new(PeerTier {
            local,
            labels,
            members,
            placement: Mutex::new(placement),
            settling: Mutex::new(settling),
            repaired_lately: Mutex::new(HashMap::new()),
            transport,
            inflight: Arc::new(Semaphore::new(cfg.max_inflight.max(1))),
            cfg,
            down: Mutex::new(HashMap::new()),
            latencies: Mutex::new(LatencyWindow::default()),
            counters: Counters::default(),
            forward_tx: tx,
            forward_bytes: Arc::new(Semaphore::new(FORWARD_BYTES)),
            deleted: Mutex::new(HashMap::new()),
            owed_deletes: Mutex::new(HashMap::new()),
            owed_log: OnceLock::new(),
            hints: Mutex::new(Hints::default()),
            departed: Mutex::new(HashMap::new()),
            repair: tokio::sync::Notify::new(),
        });
        let task = tokio::spawn(forward_loop(Arc::downgrade(&tier), rx, stop));
        (tier, task)
    }

    /// The current placement (rebuilt after a membership change).
    pub(crate) fn placement(&self) -> Arc<Placement> {
        let (generation, members) = {
            let snap = self.members.borrow();
            (snap.generation, snap.members.clone())
        };
        let mut p = self.placement.lock();
        if p.0 != generation {
            let present = |id: &NodeId| members.binary_search_by(|m| m.id.cmp(id)).is_ok();
            let now = Instant::now();
            let mut departed = self.departed.lock();
            departed.retain(|id, at| now.duration_since(*at) < super::deletes::OWED_FOR && !present(id));
            for m in p.1.members() {
                if m.id != self.local && !present(&m.id) && departed.len() < super::membership::MAX_MEMBERS {
                    departed.entry(m.id.clone()).or_insert(now);
                }
            }
            drop(departed);
            let old = std::mem::replace(&mut *p, (generation, Arc::new(Placement::new(&members)))).1;
            // A member that registered again (it restarted) is asked again at once, not skipped
            // for the rest of a failure's `DOWN_FOR`.
            let restarted = super::rebalance::restarted(old.members(), &members);
            if !restarted.is_empty() {
                let mut down = self.down.lock();
                for id in &restarted {
                    down.remove(id);
                }
            }
            let mut settling = self.settling.lock();
            settling.restarts(old.members(), &members, now);
            if old.members().iter().all(|m| m.id == self.local) {
                before_joining(&mut settling, &self.local, &members, now);
            } else {
                settling.replaced(old, now);
            }
        }
        p.1.clone()
    }

    /// Forgets the placements replaced lately: as in a cluster that has settled.
    #[cfg(test)]
    pub(crate) fn forget_settling(&self) {
        *self.settling.lock() = Settling::default();
    }

    /// Members that left the membership within the last [`super::deletes::OWED_FOR`] and have
    /// not come back, with how long ago they were first seen gone.
    pub(crate) fn departed(&self) -> Vec<(NodeId, Duration)> {
        self.placement();
        let now = Instant::now();
        // Pruned only when the membership changes: one that stays the same for longer than
        // OWED_FOR after a member left still holds it, past the promise above.
        self.departed
            .lock()
            .iter()
            .map(|(id, at)| (id.clone(), now.duration_since(*at)))
            .filter(|(_, ago)| *ago < super::deletes::OWED_FOR)
            .collect()
    }

    pub(crate) fn is_down(&self, id: &NodeId, now: Instant) -> bool {
        let mut down = self.down.lock();
        match down.get(id) {
            Some(until) if *until > now => true,
            Some(_) => {
                down.remove(id);
                false
            }
            None => false,
        }
    }

    /// Counts a failed call to `peer`; one that did not answer (or answered wrongly) is skipped
    /// for [`DOWN_FOR`]. A refusal it answered with (a tenant's quota, no room) is not a sign it
    /// is down: skipping it would turn every tenant's blocks on it into misses.
    pub(crate) fn failed(&self, peer: &Member, what: &'static str, e: &ServerError) {
        bump(&self.counters.errors, 1);
        ::metrics::counter!("kvtier_peer_errors_total", "op" => what).increment(1);
        if !matches!(e, ServerError::Peer { .. }) {
            tracing::debug!(peer = %peer.id, "peer {what} refused: {e}");
            return;
        }
        let mut down = self.down.lock();
        if down.len() > 4096 {
            down.clear();
        }
        if down.insert(peer.id.clone(), Instant::now() + DOWN_FOR).is_none() {
            tracing::warn!(peer = %peer.id, "peer {what} failed: {e}; skipping it for {DOWN_FOR:?}");
        }
    }

    /// The other owners of `key`, best replica first for this node.
    fn other_owners(&self, p: &Placement, ns: &NamespaceId, rf: usize, key: &BlockKey, out: &mut Vec<usize>) {
        p.owners_into(ns, key, rf, out);
        p.read_order(Reader { id: Some(&self.local), labels: &self.labels }, out);
        out.retain(|&i| p.members().get(i).is_some_and(|m| m.id != self.local));
    }

    /// Loads `keys` (which every local tier missed) from their owners: one entry per key, a
    /// verified block or `None`. At most [`FETCH_ROUNDS`] rounds: a first one, then per key one
    /// retry of a failed call on its next candidate, and the next candidate after a miss that is
    /// not final (see `super::settle`), so a fetch waits about two `peer_timeout`s at most; never
    /// errs: a failure is a miss, counted. A replica that is late is hedged (see [`Hedge`]). A
    /// block found after an owner missed it is sent to that owner (read repair).
    pub async fn fetch(&self, ns: &Namespace, keys: &[BlockKey]) -> Vec<Option<StoredBlock>> {
        let started = Instant::now();
        let mut out: Vec<Option<StoredBlock>> = vec![None; keys.len()];
        let p = self.placement();
        let candidates = self.candidates(&p, ns, keys);
        let mut cursor = vec![0usize; keys.len()];
        // Per key: whether a failed call was retried already (once per key, as in a settled
        // cluster: a fetch waits about two `peer_timeout`s at most).
        let mut retried = vec![false; keys.len()];
        // Per key: the owners that answered "not held" before a later candidate was asked.
        let mut missed_by: HashMap<usize, Vec<usize>> = HashMap::new();
        let mut pending: Vec<usize> = (0..keys.len()).collect();
        for _ in 0..FETCH_ROUNDS {
            let plan = plan_round(&pending, &candidates, &cursor);
            if plan.is_empty() {
                break;
            }
            let calls = plan.iter().map(|(&peer, idx)| self.ask_hedged(&p, ns, keys, peer, idx, &candidates, &cursor));
            pending = Vec::new();
            let mut moved_on = 0u64;
            for asked in futures::future::join_all(calls).await {
                for (i, b) in asked.got {
                    out[i] = Some(b);
                }
                // An owner that answered "miss" was asked for a block the cluster doesn't hold,
                // unless it is new to the key: then the next candidate is asked too.
                for k in asked.missed {
                    let c = candidates[k][cursor[k]];
                    if c.miss_moves_on && cursor[k] + 1 < candidates[k].len() {
                        if c.owner {
                            missed_by.entry(k).or_default().push(c.member);
                        }
                        moved_on += 1;
                        cursor[k] += 1;
                        pending.push(k);
                    }
                }
                for k in asked.failed {
                    if !std::mem::replace(&mut retried[k], true) {
                        cursor[k] += 1;
                        pending.push(k);
                    }
                }
            }
            if moved_on > 0 {
                ::metrics::counter!("kvtier_peer_moved_on_keys_total").increment(moved_on);
            }
        }
        self.repair_missed(ns, &p, &out, missed_by, started);
        let hits = out.iter().filter(|b| b.is_some()).count() as u64;
        let misses = keys.len() as u64 - hits;
        bump(&self.counters.hits, hits);
        bump(&self.counters.misses, misses);
        ::metrics::counter!("kvtier_tier_hits_total", "tier" => "peer").increment(hits);
        ::metrics::counter!("kvtier_tier_misses_total", "tier" => "peer").increment(misses);
        out
    }

    /// Read repair: the blocks of `got` that owners answered "not held" for (`missed_by`, key
    /// index to member indices of `p`) are queued for those owners through the forward queue, as
    /// of `asked` (a delete of the namespace since cancels them). Repairs take at most half the
    /// queue (stores' forwards come first), and a block repaired to an owner lately is not queued
    /// again for it (concurrent loads of one prefix would each send it); what is not sent now is
    /// repaired by a later read.
    fn repair_missed(
        &self,
        ns: &Namespace,
        p: &Placement,
        got: &[Option<StoredBlock>],
        missed_by: HashMap<usize, Vec<usize>>,
        asked: Instant,
    ) {
        if missed_by.is_empty() {
            return;
        }
        let now = Instant::now();
        let id = ns.id();
        let mut by_owner: HashMap<usize, Vec<StoredBlock>> = HashMap::new();
        {
            let mut lately = self.repaired_lately.lock();
            lately.retain(|_, at| now.duration_since(*at) < REPAIRED_FOR);
            for (k, owners) in missed_by {
                let Some(b) = &got[k] else { continue };
                for o in owners {
                    let to = &p.members()[o].id;
                    if lately.len() >= MAX_REPAIRED_LATELY {
                        break;
                    }
                    if lately.insert((to.clone(), id, b.header.key), now).is_none() {
                        by_owner.entry(o).or_default().push(b.clone());
                    }
                }
            }
        }
        for (o, blocks) in by_owner {
            let n = blocks.len() as u64;
            let bytes: usize = blocks.iter().map(|b| b.payload.len()).sum();
            let room = self.forward_bytes.available_permits() >= FORWARD_BYTES / 2 + bytes
                && self.forward_tx.capacity() > FORWARD_QUEUE / 2;
            if room && self.enqueue_forward(ns.clone(), blocks, asked, Some(p.members()[o].id.clone())) {
                ::metrics::counter!("kvtier_peer_read_repairs_total").increment(n);
            } else if !room {
                ::metrics::counter!("kvtier_peer_read_repairs_dropped_total").increment(n);
            }
        }
    }

    /// One peer's share of a round: asks member `peer` for the keys `idx` (each key's candidate
    /// at `cursor`). When hedging is on and `peer` has not answered within the hedge delay, the
    /// keys that have a next candidate are asked of it too, one request per member, and each key
    /// is taken from the first answer that holds it; a hedged key that neither brought is final.
    #[allow(clippy::too_many_arguments)]
    async fn ask_hedged(
        &self,
        p: &Placement,
        ns: &Namespace,
        keys: &[BlockKey],
        peer: usize,
        idx: &[usize],
        candidates: &[Vec<Candidate>],
        cursor: &[usize],
    ) -> Asked {
        let primary = self.ask(&p.members()[peer], ns, keys, idx);
        tokio::pin!(primary);
        let mut alts: HashMap<usize, Vec<usize>> = HashMap::new();
        let delay = hedge_delay(self.cfg.hedge, &self.latencies.lock().samples, self.cfg.timeout);
        if let Some(delay) = delay {
            // Only keys whose misses are final here and there: a hedge that missed ends its key,
            // which would cut short a key still settling (see `super::settle`).
            for &k in idx {
                let (this, next) = (&candidates[k][cursor[k]], candidates[k].get(cursor[k] + 1));
                if let Some(alt) = next.filter(|alt| !this.miss_moves_on && !alt.miss_moves_on) {
                    alts.entry(alt.member).or_default().push(k);
                }
            }
            if !alts.is_empty() {
                if let Ok(answer) = tokio::time::timeout(delay, &mut primary).await {
                    return settle(idx, answer);
                }
            }
        }
        if alts.is_empty() {
            return settle(idx, primary.await);
        }
        let hedged = alts.values().map(Vec::len).sum::<usize>() as u64;
        bump(&self.counters.hedges, hedged);
        ::metrics::counter!("kvtier_peer_hedged_keys_total").increment(hedged);
        let hedge = futures::future::join_all(
            alts.iter().map(|(&alt, sub)| async move { (sub, self.ask(&p.members()[alt], ns, keys, sub).await) }),
        );
        tokio::pin!(hedge);
        let asked_again = |k: &usize| alts.values().any(|sub| sub.contains(k));
        // What neither the primary nor a hedge brought: failed or missed at the primary, and not
        // asked again (a hedged key's next candidate has answered for it).
        let rest = |got: &[(usize, StoredBlock)], primary_answered: bool| {
            let mut a = Asked::default();
            for &k in idx {
                if asked_again(&k) || got.iter().any(|(i, _)| *i == k) {
                    continue;
                }
                match primary_answered {
                    true => a.missed.push(k),
                    false => a.failed.push(k),
                }
            }
            a
        };
        tokio::select! {
            answer = &mut primary => match answer {
                // The first replica answered first: its answer stands (the hedge is dropped).
                Ok(blocks) => settle(idx, Ok(blocks)),
                // It failed: the hedge's answers are all there is.
                Err(()) => {
                    let mut got = Vec::new();
                    for (sub, answer) in hedge.await {
                        got.extend(hits(sub, answer));
                    }
                    bump(&self.counters.hedge_wins, got.len() as u64);
                    ::metrics::counter!("kvtier_peer_hedge_wins_total").increment(got.len() as u64);
                    Asked { got, ..rest(&[], false) }
                }
            },
            answers = &mut hedge => {
                let mut got: Vec<(usize, StoredBlock)> = Vec::new();
                for (sub, answer) in answers {
                    got.extend(hits(sub, answer));
                }
                bump(&self.counters.hedge_wins, got.len() as u64);
                ::metrics::counter!("kvtier_peer_hedge_wins_total").increment(got.len() as u64);
                // Keys the hedge didn't bring wait for the first replica (still bounded by
                // `peer_timeout`).
                if got.len() == idx.len() {
                    return Asked { got, ..Asked::default() };
                }
                match primary.await {
                    Ok(blocks) => {
                        for (&k, b) in idx.iter().zip(blocks) {
                            if let Some(b) = b {
                                if !got.iter().any(|(i, _)| *i == k) {
                                    got.push((k, b));
                                }
                            }
                        }
                        let rest = rest(&got, true);
                        Asked { got, ..rest }
                    }
                    Err(()) => {
                        let rest = rest(&got, false);
                        Asked { got, ..rest }
                    }
                }
            }
        }
    }

    /// Asks `member` for the keys `idx` (indices into `keys`) in one request: per key asked, a
    /// verified block or `None` (a miss, or a block that failed its checks, counted); `Err` when
    /// the call failed (counted, and the peer skipped for [`DOWN_FOR`]).
    async fn ask(
        &self,
        member: &Member,
        ns: &Namespace,
        keys: &[BlockKey],
        idx: &[usize],
    ) -> Result<Vec<Option<StoredBlock>>, ()> {
        let asked: Vec<BlockKey> = idx.iter().map(|&i| keys[i]).collect();
        let start = Instant::now();
        match self.bounded(member, self.transport.get(member, ns, &asked)).await {
            Ok(blocks) if blocks.len() == asked.len() => {
                self.latencies.lock().push(start.elapsed());
                Ok(blocks
                    .into_iter()
                    .zip(&asked)
                    .map(|(got, key)| got.filter(|b| self.accept(member, ns, key, b)))
                    .collect())
            }
            Ok(blocks) => {
                let e = ServerError::Peer {
                    peer: member.id.to_string(),
                    reason: format!("{} answers for {} keys", blocks.len(), asked.len()),
                };
                self.failed(member, "get", &e);
                Err(())
            }
            Err(e) => {
                self.failed(member, "get", &e);
                Err(())
            }
        }
    }

    /// Whether a block `member` sent for `key` may be used (counted either way).
    fn accept(&self, member: &Member, ns: &Namespace, key: &BlockKey, b: &StoredBlock) -> bool {
        if self.check(ns, key, b) {
            bump(&self.counters.bytes_in, b.payload.len() as u64);
            ::metrics::counter!("kvtier_tier_bytes_in_total", "tier" => "peer").increment(b.payload.len() as u64);
            true
        } else {
            bump(&self.counters.errors, 1);
            ::metrics::counter!("kvtier_peer_errors_total", "op" => "bad_block").increment(1);
            tracing::warn!(peer = %member.id, "a peer sent a block that fails its checks; a miss");
            false
        }
    }

    /// Per key: the members to ask, in order — its other owners, best first for this node, then
    /// (while ownership settles after a membership change) its former owners — without the peers
    /// known to be down.
    pub(crate) fn candidates(&self, p: &Placement, ns: &Namespace, keys: &[BlockKey]) -> Vec<Vec<Candidate>> {
        let (id, rf) = (ns.id(), self.rf_for(ns));
        let now = Instant::now();
        let settling = self.settling.lock().clone();
        let active = settling.active(now);
        let (mut owners, mut c) = (Vec::new(), Vec::new());
        keys.iter()
            .map(|key| {
                self.other_owners(p, &id, rf, key, &mut owners);
                if active {
                    settling.candidates(p, &id, rf, key, &owners, &self.local, now, &mut c);
                } else {
                    c.clear();
                    c.extend(owners.iter().map(|&member| Candidate { member, owner: true, miss_moves_on: false }));
                }
                c.retain(|c| !self.is_down(&p.members()[c.member].id, now));
                c.clone()
            })
            .collect()
    }

    /// Which of `keys` (which no local tier holds) their best live owner holds — or, where that
    /// owner is new to the key (see `super::settle`), the next candidate: one request per peer
    /// and round, each within `peer_timeout`; a failure reads as "not held". For lookups, which
    /// may under-report (a load then misses, which is allowed) but never over-report for long.
    pub async fn held(&self, ns: &Namespace, keys: &[BlockKey]) -> Vec<bool> {
        let mut out = vec![false; keys.len()];
        let p = self.placement();
        let candidates = self.candidates(&p, ns, keys);
        let mut cursor = vec![0usize; keys.len()];
        let mut pending: Vec<usize> = (0..keys.len()).collect();
        for _ in 0..FETCH_ROUNDS {
            let plan = plan_round(&pending, &candidates, &cursor);
            if plan.is_empty() {
                break;
            }
            let calls = plan.iter().map(|(&peer, idx)| {
                let member = &p.members()[peer];
                let asked: Vec<BlockKey> = idx.iter().map(|&i| keys[i]).collect();
                async move {
                    let res = self.bounded(member, self.transport.exists(member, ns, &asked)).await;
                    (member, idx, res)
                }
            });
            pending = Vec::new();
            for (member, idx, res) in futures::future::join_all(calls).await {
                match res {
                    Ok(held) if held.len() == idx.len() => {
                        for (&i, h) in idx.iter().zip(held) {
                            out[i] = h;
                            let c = candidates[i][cursor[i]];
                            if !h && c.miss_moves_on && cursor[i] + 1 < candidates[i].len() {
                                cursor[i] += 1;
                                pending.push(i);
                            }
                        }
                    }
                    Ok(held) => {
                        let reason = format!("{} answers for {} keys", held.len(), idx.len());
                        self.failed(member, "exists", &ServerError::Peer { peer: member.id.to_string(), reason });
                    }
                    Err(e) => self.failed(member, "exists", &e),
                }
            }
        }
        out
    }

    /// Asks each of `members` (other nodes) what it holds of `keys` and `session`, concurrently,
    /// one request each, every one within `peer_timeout`. A peer known to be down is not asked;
    /// a peer that fails is reported as the reason why (unknown), never waited on longer.
    pub async fn route_hints(
        &self,
        members: &[Member],
        ns: &Namespace,
        keys: &[BlockKey],
        session: Option<&str>,
    ) -> Vec<Result<LocalHolding, String>> {
        let now = Instant::now();
        let calls = members.iter().map(|member| async move {
            if self.is_down(&member.id, now) {
                return Err(format!("down (failed within the last {DOWN_FOR:?})"));
            }
            match self.bounded(member, self.transport.route_local(member, ns, keys, session)).await {
                Ok(h) => Ok(h),
                Err(e) => {
                    self.failed(member, "route", &e);
                    Err(e.to_string())
                }
            }
        });
        futures::future::join_all(calls).await
    }

    /// Runs one peer call within `peer_timeout`, its start included (a permit of
    /// `peer_max_inflight`); counted in `kvtier_peer_requests_total`.
    pub(crate) async fn bounded<T>(&self, peer: &Member, call: PeerFuture<'_, T>) -> Result<T, ServerError> {
        let t = self.cfg.timeout;
        let late = || ServerError::Peer { peer: peer.id.to_string(), reason: format!("no answer within {t:?}") };
        tokio::time::timeout(t, async {
            let _permit = self.inflight.acquire().await.map_err(|_| late())?;
            bump(&self.counters.requests, 1);
            ::metrics::counter!("kvtier_peer_requests_total").increment(1);
            call.await
        })
        .await
        .map_err(|_| late())?
    }

    /// Whether a block a peer sent is the one asked for and intact.
    pub(crate) fn check(&self, ns: &Namespace, key: &BlockKey, b: &StoredBlock) -> bool {
        let h = &b.header;
        h.namespace == ns.id()
            && h.key == *key
            && h.layout == ns.layout
            && h.payload_len == b.payload.len() as u64
            && h.check_size().is_ok()
            && h.verify_payload(&b.payload).is_ok()
    }

    /// Queues blocks this node accepted for their other owners. Written locally first and
    /// forwarded after the client's acknowledgement: a store never waits for (or fails with)
    /// a slow or dead peer, and the node that took it can serve it at once; the cost is a window
    /// in which another node's load misses it (a miss is always allowed) and, when the queue
    /// is full, a block held only here (counted in `kvtier_peer_forward_dropped_total`).
    pub fn forward(&self, ns: Namespace, blocks: Vec<StoredBlock>) {
        self.forward_stored_at(ns, blocks, Instant::now());
    }

    /// [`Self::forward`] of blocks stored at `stored_at` (read back since: a delete of their
    /// namespace after that time cancels them).
    pub fn forward_stored_at(&self, ns: Namespace, blocks: Vec<StoredBlock>, stored_at: Instant) {
        if !blocks.is_empty() {
            self.enqueue_forward(ns, blocks, stored_at, None);
        }
    }

    /// Queues `blocks` for their other owners (or, with `to`, for that owner only); false when
    /// the queue had no room (the blocks are counted as dropped).
    fn enqueue_forward(&self, ns: Namespace, blocks: Vec<StoredBlock>, queued: Instant, to: Option<NodeId>) -> bool {
        let bytes: usize = blocks.iter().map(|b| b.payload.len()).sum();
        let n = blocks.len() as u64;
        let repair = to.is_some();
        let sent = match self.forward_bytes.clone().try_acquire_many_owned(bytes.min(FORWARD_BYTES) as u32) {
            Ok(permit) => self.forward_tx.try_send(ForwardJob { ns, blocks, queued, to, _bytes: permit }).is_ok(),
            Err(_) => false,
        };
        if !sent {
            self.count_dropped(repair, n);
        }
        self.publish_forward_queue();
        sent
    }

    /// Counts `n` blocks a forward did not give an owner: a store's (held only where it was
    /// stored) or a read repair's (the next read repairs it).
    fn count_dropped(&self, repair: bool, n: u64) {
        match repair {
            true => ::metrics::counter!("kvtier_peer_read_repairs_dropped_total").increment(n),
            false => self.count_forward_dropped(n),
        }
    }

    /// `kvtier_peer_forward_queue_bytes`: payload bytes of stores waiting to be forwarded.
    fn publish_forward_queue(&self) {
        let queued = FORWARD_BYTES.saturating_sub(self.forward_bytes.available_permits());
        ::metrics::gauge!("kvtier_peer_forward_queue_bytes").set(queued as f64);
    }

    /// Asks the re-replication loop for a pass (a session is short of copies).
    pub(crate) fn want_repair(&self) {
        self.repair.notify_one();
    }

    /// Returns when a pass was asked for since the last call.
    pub(crate) async fn repair_wanted(&self) {
        self.repair.notified().await;
    }

    /// Counts `n` blocks that were not forwarded to their other owners (held only here).
    pub(crate) fn count_forward_dropped(&self, n: u64) {
        bump(&self.counters.forward_dropped, n);
        ::metrics::counter!("kvtier_peer_forward_dropped_total").increment(n);
    }

    /// Notes that namespace `id` was just purged or unregistered here: stores of it queued for
    /// forwarding until now are not forwarded (they would put its blocks back on the owners).
    pub fn mark_deleted(&self, id: NamespaceId) {
        let now = Instant::now();
        {
            let mut deleted = self.deleted.lock();
            deleted.retain(|_, at| now.duration_since(*at) < DELETED_FOR);
            deleted.insert(id, now);
        }
        // Nor handed to owners that missed them.
        let mut hints = self.hints.lock();
        hints.forget_namespace(&id);
        ::metrics::gauge!("kvtier_peer_handoff_pending").set(hints.len() as f64);
    }

    /// Whether a store of `id` queued at `queued` was deleted since.
    pub(crate) fn deleted_since(&self, id: &NamespaceId, queued: Instant) -> bool {
        self.deleted.lock().get(id).is_some_and(|at| *at >= queued)
    }

    pub(crate) fn owed_deletes(&self) -> &Mutex<OwedDeletes> {
        &self.owed_deletes
    }

    pub(crate) fn hints(&self) -> &Mutex<Hints> {
        &self.hints
    }

    /// Counts `blocks` (`bytes` of payload) an owner took from this node.
    pub(crate) fn count_forwarded(&self, blocks: u64, bytes: u64) {
        bump(&self.counters.forwarded, blocks);
        ::metrics::counter!("kvtier_peer_forwarded_blocks_total").increment(blocks);
        bump(&self.counters.bytes_out, bytes);
        ::metrics::counter!("kvtier_tier_bytes_out_total", "tier" => "peer").increment(bytes);
    }

    pub(crate) fn owed_log(&self) -> Option<&Arc<OwedLog>> {
        self.owed_log.get()
    }

    /// Keeps what is owed in `log` from now on; an error if a log was set already.
    pub(crate) fn set_owed_log(&self, log: OwedLog) -> Result<(), ()> {
        self.owed_log.set(Arc::new(log)).map_err(|_| ())
    }

    /// Sends one accepted store to the blocks' other owners: one request per owner.
    async fn forward_now(&self, job: ForwardJob) {
        let (id, rf) = (job.ns.id(), self.rf_for(&job.ns));
        if self.deleted_since(&id, job.queued) {
            tracing::debug!(blocks = job.blocks.len(), "forward of a namespace deleted since not sent");
            return;
        }
        let p = self.placement();
        let now = Instant::now();
        let mut by_peer: HashMap<usize, Vec<StoredBlock>> = HashMap::new();
        let mut owners = Vec::new();
        for b in &job.blocks {
            self.other_owners(&p, &id, rf, &b.header.key, &mut owners);
            // A read repair goes to the owner that missed the block (if it still owns it).
            if let Some(to) = &job.to {
                owners.retain(|&o| &p.members()[o].id == to);
            }
            for &o in &owners {
                by_peer.entry(o).or_default().push(b.clone());
            }
        }
        let calls = by_peer.iter().map(|(&peer, blocks)| {
            let member = &p.members()[peer];
            let ns = &job.ns;
            async move {
                // A peer known to be down is not tried (`None`): its copies are dropped.
                let res = if self.is_down(&member.id, now) {
                    None
                } else {
                    Some(self.bounded(member, self.transport.put(member, ns, blocks)).await)
                };
                (member, blocks, res)
            }
        });
        for (member, blocks, res) in futures::future::join_all(calls).await {
            match res {
                Some(Ok(held)) => {
                    // Blocks the peer refused (no room, a namespace it does not know) are held
                    // only here.
                    let refused = blocks.len().saturating_sub(held) as u64;
                    if refused > 0 {
                        self.count_dropped(job.to.is_some(), refused);
                    }
                    self.count_forwarded(held as u64, blocks.iter().map(|b| b.payload.len() as u64).sum());
                }
                failed => {
                    // Down (not tried) or no answer: remembered, and handed to it when it answers
                    // again (`super::handoff`). A refusal it answered with is not remembered.
                    // A read repair is not: the next read repairs it (and this node, which
                    // fetched the block, may not hold it to hand over).
                    let missed = job.to.is_none() && matches!(failed, None | Some(Err(ServerError::Peer { .. })));
                    if let Some(Err(e)) = &failed {
                        self.failed(member, "put", e);
                    }
                    let dropped = if missed {
                        let keys: Vec<BlockKey> = blocks.iter().map(|b| b.header.key).collect();
                        let mut hints = self.hints.lock();
                        let lost = hints.add(&member.id, job.ns.id(), &keys, job.queued);
                        ::metrics::gauge!("kvtier_peer_handoff_pending").set(hints.len() as f64);
                        lost
                    } else {
                        blocks.len()
                    };
                    if dropped > 0 {
                        self.count_dropped(job.to.is_some(), dropped as u64);
                    }
                }
            }
        }
    }

    /// This node's id in the cluster.
    pub fn local(&self) -> &NodeId {
        &self.local
    }

    /// How many nodes hold each block and each parked session by default (`cluster_rf`).
    pub fn rf(&self) -> usize {
        self.cfg.rf
    }

    /// How many nodes hold each block and parked session of `ns`: its own `replicas`, else
    /// `cluster_rf`.
    pub fn rf_for(&self, ns: &Namespace) -> usize {
        match ns.replicas {
            0 => self.cfg.rf,
            n => usize::from(n).min(super::placement::MAX_RF),
        }
    }

    /// The bound of one peer call (`peer_timeout`).
    pub fn timeout(&self) -> Duration {
        self.cfg.timeout
    }

    /// Counts `bytes` of blocks received from a peer outside [`PeerTier::fetch`] (a session
    /// copy adopted), as the tier's bytes in.
    pub(crate) fn received(&self, bytes: u64) {
        bump(&self.counters.bytes_in, bytes);
        ::metrics::counter!("kvtier_tier_bytes_in_total", "tier" => "peer").increment(bytes);
    }

    /// Per key of `keys` (of namespace `ns`): whether this node is one of its owners.
    pub fn owned_here(&self, ns: &Namespace, keys: &[BlockKey]) -> Vec<bool> {
        let p = self.placement();
        let (id, rf) = (ns.id(), self.rf_for(ns));
        let mut owners = Vec::with_capacity(super::placement::MAX_RF);
        keys.iter()
            .map(|key| {
                p.owners_into(&id, key, rf, &mut owners);
                owners.iter().any(|&i| p.members()[i].id == self.local)
            })
            .collect()
    }

    /// Whether this node is one of the owners of `key` (of namespace `ns`).
    pub fn owns(&self, ns: &Namespace, key: &BlockKey) -> bool {
        self.owned_here(ns, std::slice::from_ref(key)).first().copied().unwrap_or(false)
    }

    /// The network to the peers.
    pub(crate) fn transport(&self) -> &dyn PeerTransport {
        self.transport.as_ref()
    }

    /// The membership this tier follows (re-replication watches it).
    pub(crate) fn members(&self) -> watch::Receiver<Snapshot> {
        self.members.clone()
    }

    /// The tier's counters: hits and misses of loads, bytes received and forwarded, peer
    /// requests and errors.
    pub fn stats(&self) -> TierStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        TierStats {
            hits: get(&c.hits),
            misses: get(&c.misses),
            bytes_in: get(&c.bytes_in),
            bytes_out: get(&c.bytes_out),
            requests: get(&c.requests),
            errors: get(&c.errors),
            ..TierStats::default()
        }
    }

    /// Keys asked of a second replica because the first was late, and keys the hedge served.
    pub fn hedge_counts(&self) -> (u64, u64) {
        (self.counters.hedges.load(Ordering::Relaxed), self.counters.hedge_wins.load(Ordering::Relaxed))
    }

    /// Blocks forwarded to other owners, and blocks that could not be (queue full, peer failed).
    pub fn forward_counts(&self) -> (u64, u64) {
        (self.counters.forwarded.load(Ordering::Relaxed), self.counters.forward_dropped.load(Ordering::Relaxed))
    }
}

/// Forwards queued stores one after the other until `stop` turns true or the tier is gone.
async fn forward_loop(
    tier: std::sync::Weak<PeerTier>,
    mut rx: mpsc::Receiver<ForwardJob>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let job = tokio::select! {
            _ = crate::stopped(&mut stop) => return,
            job = rx.recv() => job,
        };
        let (Some(job), Some(tier)) = (job, tier.upgrade()) else { return };
        tier.forward_now(job).await;
        tier.publish_forward_queue();
    }
}

#[cfg(test)]
#[path = "peer_tests.rs"]
mod tests;
