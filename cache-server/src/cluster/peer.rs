//! G4, the peer tier: blocks held by the other members of the cluster.
//!
//! A load that misses every local tier asks the block's owners (rendezvous placement over the
//! live membership, `cluster_rf` replicas): the missing keys of one client request are grouped by
//! owner and each owner gets **one** request (a `GET` flagged `FLAG_PEER`, which the owner serves
//! from its own tiers and never forwards: a request travels at most one hop). Each key goes to its
//! best replica first (this node's machine, then its rack, zone, the rest; see
//! [`Placement::read_order`]); keys whose owner failed (refused, cut, timed out) are asked of
//! their next replica in one more round. Every block that comes back is checked — namespace, key,
//! layout, size, checksum — and anything wrong is a miss, never wrong bytes.
//!
//! A store accepted by a node is forwarded to the block's other owners through a bounded queue
//! (a `PUT` flagged `FLAG_PEER`), so every owner holds it without the client knowing the
//! membership; see [`PeerTier::forward`] for why it is written locally first and forwarded after
//! the acknowledgement.
//!
//! Bounds: every peer call runs under `peer_timeout`; at most `peer_max_inflight` calls run at
//! once (a call that can't start within the timeout is a miss); a peer that failed is skipped
//! for [`DOWN_FOR`] (its keys go to the next replica or miss at once), so a dead node costs one
//! timeout, not one per request; the forward queue holds at most [`FORWARD_QUEUE`] requests and
//! `FORWARD_BYTES` bytes, past which forwards are dropped and counted.
//!
//! The network is behind [`PeerTransport`]: the `kvtier` binary plugs in one over
//! `kvtier-client`'s pooled data-plane connections (TCP today, QUIC later); tests plug in fakes.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_proto::{BlockKey, Namespace, NamespaceId};
use parking_lot::Mutex;
use tokio::sync::{mpsc, watch, Semaphore};

use super::member::{Labels, Member, NodeId};
use super::membership::Snapshot;
use super::placement::{Placement, Reader};
use crate::dram::StoredBlock;
use crate::error::ServerError;
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
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// A store waiting to be forwarded, with its share of the forward byte budget.
struct ForwardJob {
    ns: Namespace,
    blocks: Vec<StoredBlock>,
    _bytes: tokio::sync::OwnedSemaphorePermit,
}

/// The peer tier of one node. Cheap to share (`Arc`).
pub struct PeerTier {
    local: NodeId,
    labels: Labels,
    members: watch::Receiver<Snapshot>,
    /// Placement over the members, rebuilt when the snapshot's generation changes.
    placement: Mutex<(u64, Arc<Placement>)>,
    transport: Arc<dyn PeerTransport>,
    cfg: PeerConfig,
    inflight: Arc<Semaphore>,
    /// Peers that failed, and until when they are skipped.
    down: Mutex<HashMap<NodeId, Instant>>,
    counters: Counters,
    forward_tx: mpsc::Sender<ForwardJob>,
    forward_bytes: Arc<Semaphore>,
}

/// Keys of one request, grouped by the peer asked for them: (member index, key indices).
type Plan = Vec<(usize, Vec<usize>)>;

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
        let placement = {
            let snap = members.borrow();
            (snap.generation, Arc::new(Placement::new(&snap.members)))
        };
        let tier = Arc::new(PeerTier {
            local,
            labels,
            members,
            placement: Mutex::new(placement),
            transport,
            inflight: Arc::new(Semaphore::new(cfg.max_inflight.max(1))),
            cfg,
            down: Mutex::new(HashMap::new()),
            counters: Counters::default(),
            forward_tx: tx,
            forward_bytes: Arc::new(Semaphore::new(FORWARD_BYTES)),
        });
        let task = tokio::spawn(forward_loop(Arc::downgrade(&tier), rx, stop));
        (tier, task)
    }

    /// The current placement (rebuilt after a membership change).
    fn placement(&self) -> Arc<Placement> {
        let (generation, members) = {
            let snap = self.members.borrow();
            (snap.generation, snap.members.clone())
        };
        let mut p = self.placement.lock();
        if p.0 != generation {
            *p = (generation, Arc::new(Placement::new(&members)));
        }
        p.1.clone()
    }

    fn is_down(&self, id: &NodeId, now: Instant) -> bool {
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

    fn failed(&self, peer: &Member, what: &'static str, e: &ServerError) {
        bump(&self.counters.errors, 1);
        ::metrics::counter!("kvtier_peer_errors_total", "op" => what).increment(1);
        let mut down = self.down.lock();
        if down.len() > 4096 {
            down.clear();
        }
        if down.insert(peer.id.clone(), Instant::now() + DOWN_FOR).is_none() {
            tracing::warn!(peer = %peer.id, "peer {what} failed: {e}; skipping it for {DOWN_FOR:?}");
        }
    }

    /// The other owners of `key`, best replica first for this node.
    fn other_owners(&self, p: &Placement, ns: &NamespaceId, key: &BlockKey, out: &mut Vec<usize>) {
        p.owners_into(ns, key, self.cfg.rf, out);
        p.read_order(Reader { id: Some(&self.local), labels: &self.labels }, out);
        out.retain(|&i| p.members().get(i).is_some_and(|m| m.id != self.local));
    }

    /// Loads `keys` (which every local tier missed) from their owners: one entry per key, a
    /// verified block or `None`. Never waits much longer than two `peer_timeout`s (a first
    /// round, and one for the keys of failed peers); never errs: a failure is a miss, counted.
    pub async fn fetch(&self, ns: &Namespace, keys: &[BlockKey]) -> Vec<Option<StoredBlock>> {
        let mut out: Vec<Option<StoredBlock>> = vec![None; keys.len()];
        let p = self.placement();
        let candidates = self.candidates(&p, &ns.id(), keys);
        let mut pending: Vec<usize> = (0..keys.len()).collect();
        for round in 0..2 {
            let mut plan: HashMap<usize, Vec<usize>> = HashMap::new();
            for &k in &pending {
                if let Some(&peer) = candidates[k].get(round) {
                    plan.entry(peer).or_default().push(k);
                }
            }
            if plan.is_empty() {
                break;
            }
            let plan: Plan = plan.into_iter().collect();
            let failed = self.run_round(&p, ns, keys, plan, &mut out).await;
            // Only keys whose peer failed are worth asking of their next replica: an owner that
            // answered "miss" was asked for a block the cluster doesn't hold.
            pending = failed;
        }
        let hits = out.iter().filter(|b| b.is_some()).count() as u64;
        let misses = keys.len() as u64 - hits;
        bump(&self.counters.hits, hits);
        bump(&self.counters.misses, misses);
        ::metrics::counter!("kvtier_tier_hits_total", "tier" => "peer").increment(hits);
        ::metrics::counter!("kvtier_tier_misses_total", "tier" => "peer").increment(misses);
        out
    }

    /// Per key: its other owners, best first for this node, without the peers known to be down.
    fn candidates(&self, p: &Placement, id: &NamespaceId, keys: &[BlockKey]) -> Vec<Vec<usize>> {
        let now = Instant::now();
        let mut owners = Vec::new();
        keys.iter()
            .map(|key| {
                self.other_owners(p, id, key, &mut owners);
                owners.retain(|&i| !self.is_down(&p.members()[i].id, now));
                owners.clone()
            })
            .collect()
    }

    /// Which of `keys` (which no local tier holds) their best live owner holds: one request per
    /// peer, within `peer_timeout`; a failure reads as "not held". For lookups, which may
    /// under-report (a load then misses, which is allowed) but never over-report for long.
    pub async fn held(&self, ns: &Namespace, keys: &[BlockKey]) -> Vec<bool> {
        let mut out = vec![false; keys.len()];
        let p = self.placement();
        let mut plan: HashMap<usize, Vec<usize>> = HashMap::new();
        for (k, c) in self.candidates(&p, &ns.id(), keys).into_iter().enumerate() {
            if let Some(&peer) = c.first() {
                plan.entry(peer).or_default().push(k);
            }
        }
        let calls = plan.iter().map(|(&peer, idx)| {
            let member = &p.members()[peer];
            let asked: Vec<BlockKey> = idx.iter().map(|&i| keys[i]).collect();
            async move {
                let res = self.bounded(self.transport.exists(member, ns, &asked)).await;
                (member, idx, res)
            }
        });
        for (member, idx, res) in futures::future::join_all(calls).await {
            match res {
                Ok(held) if held.len() == idx.len() => {
                    for (&i, h) in idx.iter().zip(held) {
                        out[i] = h;
                    }
                }
                Ok(held) => {
                    let reason = format!("{} answers for {} keys", held.len(), idx.len());
                    self.failed(member, "exists", &ServerError::Peer { peer: member.id.to_string(), reason });
                }
                Err(e) => self.failed(member, "exists", &e),
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
            match self.bounded(self.transport.route_local(member, ns, keys, session)).await {
                Ok(h) => Ok(h),
                Err(e) => {
                    self.failed(member, "route", &e);
                    Err(e.to_string())
                }
            }
        });
        futures::future::join_all(calls).await
    }

    /// One request per planned peer, concurrently; fills `out` with the verified blocks and
    /// returns the key indices whose peer failed.
    async fn run_round(
        &self,
        p: &Placement,
        ns: &Namespace,
        keys: &[BlockKey],
        plan: Plan,
        out: &mut [Option<StoredBlock>],
    ) -> Vec<usize> {
        let calls = plan.iter().map(|(peer, idx)| {
            let member = &p.members()[*peer];
            let asked: Vec<BlockKey> = idx.iter().map(|&i| keys[i]).collect();
            async move {
                let res = self.bounded(self.transport.get(member, ns, &asked)).await;
                (member, asked, res)
            }
        });
        let answers = futures::future::join_all(calls).await;
        let mut failed = Vec::new();
        for ((member, asked, res), (_, idx)) in answers.into_iter().zip(&plan) {
            match res {
                Ok(blocks) if blocks.len() == asked.len() => {
                    for ((&i, key), got) in idx.iter().zip(&asked).zip(blocks) {
                        if let Some(b) = got {
                            if self.check(ns, key, &b) {
                                bump(&self.counters.bytes_in, b.payload.len() as u64);
                                ::metrics::counter!("kvtier_tier_bytes_in_total", "tier" => "peer")
                                    .increment(b.payload.len() as u64);
                                out[i] = Some(b);
                            } else {
                                bump(&self.counters.errors, 1);
                                ::metrics::counter!("kvtier_peer_errors_total", "op" => "bad_block").increment(1);
                                tracing::warn!(peer = %member.id, "a peer sent a block that fails its checks; a miss");
                            }
                        }
                    }
                }
                Ok(blocks) => {
                    let e = ServerError::Peer {
                        peer: member.id.to_string(),
                        reason: format!("{} answers for {} keys", blocks.len(), asked.len()),
                    };
                    self.failed(member, "get", &e);
                    failed.extend_from_slice(idx);
                }
                Err(e) => {
                    self.failed(member, "get", &e);
                    failed.extend_from_slice(idx);
                }
            }
        }
        failed
    }

    /// Runs one peer call within `peer_timeout`, its start included (a permit of
    /// `peer_max_inflight`); counted in `kvtier_peer_requests_total`.
    async fn bounded<T>(&self, call: PeerFuture<'_, T>) -> Result<T, ServerError> {
        let t = self.cfg.timeout;
        let late = || ServerError::Peer { peer: String::new(), reason: format!("no answer within {t:?}") };
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
    fn check(&self, ns: &Namespace, key: &BlockKey, b: &StoredBlock) -> bool {
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
        if blocks.is_empty() {
            return;
        }
        let bytes: usize = blocks.iter().map(|b| b.payload.len()).sum();
        let n = blocks.len() as u64;
        let dropped = || {
            bump(&self.counters.forward_dropped, n);
            ::metrics::counter!("kvtier_peer_forward_dropped_total").increment(n);
        };
        let Ok(permit) = self.forward_bytes.clone().try_acquire_many_owned(bytes.min(FORWARD_BYTES) as u32) else {
            return dropped();
        };
        if self.forward_tx.try_send(ForwardJob { ns, blocks, _bytes: permit }).is_err() {
            dropped();
        }
    }

    /// Sends one accepted store to the blocks' other owners: one request per owner.
    async fn forward_now(&self, job: ForwardJob) {
        let p = self.placement();
        let id = job.ns.id();
        let now = Instant::now();
        let mut by_peer: HashMap<usize, Vec<StoredBlock>> = HashMap::new();
        let mut owners = Vec::new();
        for b in &job.blocks {
            self.other_owners(&p, &id, &b.header.key, &mut owners);
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
                    Some(self.bounded(self.transport.put(member, ns, blocks)).await)
                };
                (member, blocks, res)
            }
        });
        for (member, blocks, res) in futures::future::join_all(calls).await {
            match res {
                Some(Ok(held)) => {
                    bump(&self.counters.forwarded, held as u64);
                    ::metrics::counter!("kvtier_peer_forwarded_blocks_total").increment(held as u64);
                    let sent: u64 = blocks.iter().map(|b| b.payload.len() as u64).sum();
                    bump(&self.counters.bytes_out, sent);
                    ::metrics::counter!("kvtier_tier_bytes_out_total", "tier" => "peer").increment(sent);
                }
                failed => {
                    let n = blocks.len() as u64;
                    bump(&self.counters.forward_dropped, n);
                    ::metrics::counter!("kvtier_peer_forward_dropped_total").increment(n);
                    if let Some(Err(e)) = failed {
                        self.failed(member, "put", &e);
                    }
                }
            }
        }
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
    }
}

#[cfg(test)]
#[path = "peer_tests.rs"]
mod tests;
