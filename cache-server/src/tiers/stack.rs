//! [`TierStack`]: the node's tiers hottest first — DRAM, blocks on their way to disk, disk — and
//! the one API the control and data planes use on them: presence, longest prefix, a verified read
//! (promoting a block read twice from disk), zero-copy ingest, persist, pins, purge and stats.
//! Handlers never reach past it, so a new tier is one more entry in [`TierStack::tiers`].
//!
//! With a cluster, the peer tier (G4, [`crate::cluster::PeerTier`]) sits under the local ones:
//! it is asynchronous and batched (one request per peer per client request), so instead of a
//! [`Tier`] entry it has two calls of its own — [`TierStack::fetch_from_peers`] for the keys
//! every local tier missed, [`TierStack::forward_to_peers`] for blocks just stored.
//!
//! The shared Redis tier ([`RedisTier`], when `[redis_tier]` is set) sits under the peers in the
//! same way: [`TierStack::fetch_remote`] asks the peers, then Redis, for what no local tier holds;
//! the lookups (`*_with_peers`) count what Redis holds; [`TierStack::forward_to_peers`] also
//! queues the blocks for Redis; and parked sessions' manifests go there too
//! ([`TierStack::share_session`], [`TierStack::resume_shared`]).
//!
//! Disk writes and namespace marks: every block record the stack writes (a demotion, a persist)
//! holds the disk tier's write gate's read side for its liveness check, the write and its
//! indexing; a purge or an unregistration holds its write side ([`TierStack::invalidate`]) while
//! it takes its mark, logs it and invalidates the namespace. So no record of a namespace lands
//! after its mark unless it was written after the namespace was gone in memory, and a writer
//! checks that first: recovery, which drops the records before a mark, finds nothing of an
//! earlier incarnation after it (see [`crate::disk`], "Writes and namespace marks").
//!
//! G1 ([`AgentTier`]: the HBM pages of this node's GPU agents) sits under the local tiers: the
//! presence queries (`holds`, `exists`, `longest_prefix`) count what agents reported, and
//! [`TierStack::get`] of a block only G1 holds asks its agent to spill it and waits (bounded)
//! for it to land in DRAM.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use kvtier_proto::{BlockKey, CodecId, FrameHeader, Namespace, NamespaceId, TierId};
use parking_lot::Mutex;

use super::agent::{AgentTier, AgentTierConfig};
use super::demotion::{self, DemotionDepth};
use super::redis::RedisTier;
use super::{InTransitTier, IoPool, Load, PinTier, Tier, TierStats};
use crate::cluster::PeerTier;
use crate::disk::{DiskTier, WritesHeld};
use crate::dram::{DramTier, IndexKey, InsertOutcome, Priority, SlotWriter, StoredBlock};
use crate::error::ServerError;
use crate::events::EventBus;

/// How long a disk read waits for an I/O slot before it is answered `Busy` (a miss the engine
/// recomputes beats a load that waits behind a saturated disk).
const DISK_READ_WAIT: Duration = Duration::from_secs(2);

/// Keys of one batched read whose G1 demands are sent ahead ([`TierStack::demand_ahead`]).
const DEMAND_AHEAD: usize = 256;

/// How long a writer waits for room in a full demotion queue before it writes anyway.
const BACKPRESSURE_WAIT: Duration = Duration::from_secs(5);

pub struct TierStack {
    dram: DramTier,
    in_transit: InTransitTier,
    disk: Option<Arc<DiskTier>>,
    /// Disk hits per block since its last promotion check: a second hit promotes to DRAM.
    disk_hits: Mutex<HashMap<IndexKey, u8>>,
    depth: Arc<DemotionDepth>,
    io: IoPool,
    demotion: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Parks `fsync` the disk before they are acknowledged.
    sync_parks: bool,
    /// Bytes read from disk that connections still hold (a reader that stops reading keeps its
    /// block), in KiB: a quarter of the DRAM cap, at least 64 MiB. A read that can't get its bytes
    /// within the disk read wait is `Busy`.
    disk_read_budget: Arc<tokio::sync::Semaphore>,
    disk_read_budget_kib: usize,
    /// The peer tier, once the node joined a cluster.
    peers: OnceLock<Peers>,
    /// The shared Redis tier, when `[redis_tier]` is set.
    redis: OnceLock<Arc<RedisTier>>,
    /// Where block events go (see [`crate::events`]).
    events: Arc<EventBus>,
    /// G1: what this node's GPU agents hold, and how to ask them for it.
    agents: Arc<AgentTier>,
    /// Leases a disk tier stands in for: how many leases hold each block without a DRAM pin
    /// (past the DRAM pinned limit, see [`TierStack::pin_lease`]).
    unpinned_leases: Arc<Mutex<HashMap<IndexKey, u32>>>,
    /// Reads of just-stored blocks that left DRAM before they were forwarded (a tenant's quota
    /// or the node's capacity evicting them within the store): at most [`FORWARD_READS`] at once.
    forward_reads: Arc<tokio::sync::Semaphore>,
    /// Persists in flight, per namespace ([`PersistTicket`]).
    persisting: Persisting,
}

/// Per namespace with persists in flight: how many, and how many times it was unregistered since
/// the oldest of them began (entries go with their last persist, so the map stays as small as
/// the persists in flight).
type Persisting = Arc<Mutex<HashMap<NamespaceId, (u32, u64)>>>;

/// A persist's claim on its namespace: [`PersistTicket::live`] turns false once the namespace is
/// unregistered (even if registered again since: the blocks the persist gathered were the earlier
/// incarnation's).
struct PersistTicket {
    persisting: Persisting,
    ns: NamespaceId,
    began: u64,
}

impl PersistTicket {
    fn new(persisting: &Persisting, ns: NamespaceId) -> Self {
        let mut map = persisting.lock();
        let e = map.entry(ns).or_default();
        e.0 += 1;
        PersistTicket { persisting: persisting.clone(), ns, began: e.1 }
    }

    /// Whether the namespace was not unregistered since the ticket was taken. Under the disk's
    /// write gate ([`DiskTier::writes`]) it stays so until the gate is let go.
    fn live(&self) -> bool {
        self.persisting.lock().get(&self.ns).is_some_and(|e| e.1 == self.began)
    }
}

impl Drop for PersistTicket {
    fn drop(&mut self) {
        let mut map = self.persisting.lock();
        if let Some(e) = map.get_mut(&self.ns) {
            e.0 -= 1;
            if e.0 == 0 {
                map.remove(&self.ns);
            }
        }
    }
}

/// A namespace's invalidation in progress ([`TierStack::invalidate`]): no block is written to
/// disk while it is held.
pub struct Invalidation<'a> {
    stack: &'a TierStack,
    writes: Option<WritesHeld<'a>>,
}

impl Invalidation<'_> {
    /// The disk tier's write position, `(0, 0)` without one: every block record written before
    /// this invalidation lies before it, every one written after it at or after it (see
    /// [`WritesHeld::mark`]).
    pub fn mark(&self) -> (u64, u64) {
        self.writes.as_ref().map_or((0, 0), |w| w.mark())
    }

    /// [`TierStack::purge`], under this invalidation. A persist in flight goes on: what it writes
    /// from now on is stored after the purge, in memory as after a restart.
    pub fn purge(&self, ns: &NamespaceId) -> u64 {
        self.stack.purge_with(ns, Vec::new())
    }

    /// [`TierStack::forget_namespace`], under this invalidation: a persist of the namespace in
    /// flight writes nothing more, and fails (the namespace is unknown).
    pub fn forget_namespace(&self, ns: &NamespaceId) -> u64 {
        if let Some(e) = self.stack.persisting.lock().get_mut(ns) {
            e.1 += 1;
        }
        self.stack.purge_with(ns, self.stack.dram.forget_namespace(ns))
    }
}

/// Most stores whose evicted blocks are read back (from disk) for forwarding at once; past it
/// such blocks are not forwarded (counted as dropped forwards).
const FORWARD_READS: usize = 4;

/// The peer tier and whether blocks loaded from it are kept in DRAM.
struct Peers {
    tier: Arc<PeerTier>,
    cache_locally: bool,
}

/// A disk block's bytes, holding their share of the disk read budget until the last view of
/// them is dropped.
struct Budgeted {
    bytes: bytes::Bytes,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl AsRef<[u8]> for Budgeted {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

/// The disk read budget's size, in KiB, for a DRAM tier of `dram_capacity` bytes.
fn disk_read_budget_kib(dram_capacity: u64) -> usize {
    ((dram_capacity / 4).max(64 << 20) >> 10) as usize
}

impl TierStack {
    pub fn new(dram: DramTier, disk: Option<Arc<DiskTier>>, sync_parks: bool) -> Self {
        let budget = disk_read_budget_kib(dram.stats().capacity_bytes);
        TierStack {
            disk_read_budget: Arc::new(tokio::sync::Semaphore::new(budget)),
            disk_read_budget_kib: budget,
            dram,
            in_transit: InTransitTier::default(),
            disk,
            disk_hits: Mutex::new(HashMap::new()),
            depth: Arc::new(DemotionDepth::default()),
            io: IoPool::default(),
            demotion: Mutex::new(None),
            sync_parks,
            peers: OnceLock::new(),
            redis: OnceLock::new(),
            events: Arc::new(EventBus::default()),
            agents: Arc::new(AgentTier::default()),
            unpinned_leases: Arc::new(Mutex::new(HashMap::new())),
            forward_reads: Arc::new(tokio::sync::Semaphore::new(FORWARD_READS)),
            persisting: Arc::default(),
        }
        .with_event_buffer(4096)
    }

    /// The same stack publishing its block events through a bus that keeps `buffer` events for
    /// watchers that fall behind (`events_buffer`).
    pub fn with_event_buffer(mut self, buffer: usize) -> Self {
        self.events = Arc::new(EventBus::new(buffer));
        self.wire_agent_events();
        // DRAM evictions: to disk when the node has one (the demotion queue takes them), else gone.
        let bus = Arc::downgrade(&self.events);
        let to = self.disk.is_some().then_some(TierId::Disk);
        self.dram.set_eviction_observer(Some(Arc::new(move |keys: &[IndexKey]| {
            let Some(bus) = bus.upgrade() else { return };
            if !bus.is_watched() {
                return;
            }
            for (ns, key) in keys {
                bus.evicted(ns, std::slice::from_ref(key), TierId::Dram, to);
            }
        })));
        // Disk evictions (a segment recycled): gone, unless DRAM holds a copy (promoted).
        if let Some(disk) = &self.disk {
            let bus = Arc::downgrade(&self.events);
            let in_dram = self.dram.weak_contains();
            disk.set_eviction_observer(Some(Arc::new(move |keys: &[IndexKey]| {
                let Some(bus) = bus.upgrade() else { return };
                if !bus.is_watched() {
                    return;
                }
                for (ns, key) in keys {
                    let to = in_dram(ns, key).then_some(TierId::Dram);
                    bus.evicted(ns, std::slice::from_ref(key), TierId::Disk, to);
                }
            })));
        }
        self
    }

    /// The same stack with G1 settings (`agent_demand_wait`, `agent_index_max_keys`).
    pub fn with_agent_tier(mut self, config: AgentTierConfig) -> Self {
        self.agents = Arc::new(AgentTier::new(config));
        self.wire_agent_events();
        self
    }

    /// When an agent's link closes, its keys are published as evicted from `hbm`: to `dram` or
    /// `disk` when a local tier still holds them, else gone.
    fn wire_agent_events(&self) {
        let bus = Arc::downgrade(&self.events);
        let in_dram = self.dram.weak_contains();
        let disk = self.disk.clone();
        self.agents.set_gone_hook(Arc::new(move |ns: &NamespaceId, keys: &[BlockKey]| {
            let Some(bus) = bus.upgrade() else { return };
            if !bus.is_watched() {
                return;
            }
            for key in keys {
                let to = if in_dram(ns, key) {
                    Some(TierId::Dram)
                } else {
                    disk.as_ref().filter(|d| d.contains(ns, key)).map(|_| TierId::Disk)
                };
                bus.evicted(ns, std::slice::from_ref(key), TierId::Hbm, to);
            }
        }));
    }

    /// G1: the index of what this node's GPU agents hold, and their demand links.
    pub fn agents(&self) -> &Arc<AgentTier> {
        &self.agents
    }

    /// The node's event bus: block events come from here, session events from the session store.
    pub fn events(&self) -> &Arc<EventBus> {
        &self.events
    }

    /// The disk tier, when the node has one.
    pub fn disk(&self) -> Option<&DiskTier> {
        self.disk.as_deref()
    }

    /// Every tier, hottest first.
    pub fn tiers(&self) -> impl Iterator<Item = &dyn Tier> {
        let memory: [&dyn Tier; 2] = [&self.dram, &self.in_transit];
        memory.into_iter().chain(self.disk.as_deref().map(|d| d as &dyn Tier))
    }

    /// Whether any tier holds the block (G1 included).
    pub fn holds(&self, ns: &NamespaceId, key: &BlockKey) -> bool {
        self.tiers().any(|t| t.contains(ns, key)) || self.agents.contains(ns, key)
    }

    /// Raises a DRAM block to `priority` where it sits lower (see `DramTier::raise_priority`).
    pub fn raise_dram_priority(&self, ns: &NamespaceId, key: &BlockKey, priority: Priority) -> bool {
        self.dram.raise_priority(ns, key, priority)
    }

    /// Every block this node's DRAM and disk hold (not G1's), once each: a snapshot.
    pub fn held_keys(&self) -> Vec<(NamespaceId, BlockKey)> {
        let mut keys = self.dram.keys();
        if let Some(disk) = &self.disk {
            keys.extend(disk.keys());
            keys.sort_unstable();
            keys.dedup();
        }
        keys
    }

    /// Per key: whether any tier holds it (one pass per tier, G1 included).
    pub fn exists(&self, ns: &NamespaceId, keys: &[BlockKey]) -> Vec<bool> {
        let mut held = vec![false; keys.len()];
        for t in self.tiers() {
            t.mark_held(ns, keys, &mut held);
        }
        self.agents.mark_held(ns, keys, &mut held);
        held
    }

    /// The codec of the copy some tier holds, hottest first; a metadata query: no hit is
    /// counted, no block read.
    pub fn held_codec(&self, ns: &NamespaceId, key: &BlockKey) -> Option<CodecId> {
        self.tiers().find_map(|t| t.header(ns, key)).map(|h| h.codec)
    }

    /// The payload bytes of `keys` as this node's tiers hold them, hottest copy first (a block
    /// held nowhere counts nothing); a metadata query: no hit is counted, no block read.
    pub fn stored_bytes(&self, ns: &NamespaceId, keys: &[BlockKey]) -> u64 {
        keys.iter().filter_map(|k| self.tiers().find_map(|t| t.header(ns, k))).map(|h| h.payload_len).sum()
    }

    /// How many leading `keys` some tier holds.
    pub fn longest_prefix(&self, ns: &NamespaceId, keys: &[BlockKey]) -> usize {
        let mut n = self.dram.longest_prefix(ns, keys);
        while n < keys.len() && self.holds(ns, &keys[n]) {
            n += 1;
        }
        n
    }

    /// A verified block from the hottest tier that has it. A disk read runs on the I/O pool
    /// (`Busy` when no slot frees in time); a block's second disk hit promotes it to DRAM, so a
    /// one-off read doesn't push hot blocks out.
    pub async fn get(&self, ns: &NamespaceId, key: &BlockKey) -> Load {
        for t in self.tiers().filter(|t| !t.does_io()) {
            if let Load::Hit(b) = t.get(ns, key) {
                return Load::Hit(b);
            }
        }
        self.get_from_disk(ns, key).await
    }

    /// [`TierStack::get`] for the node's own use (see [`Tier::get_for_node`]): counted nowhere,
    /// promoting nothing, and from this node's own DRAM and disk only (no GPU agent is asked to
    /// spill for it). `Busy` when the disk's read budget frees no room in time.
    pub async fn get_for_node(&self, ns: &NamespaceId, key: &BlockKey) -> Load {
        for t in self.tiers().filter(|t| !t.does_io()) {
            if let Load::Hit(b) = t.get_for_node(ns, key) {
                return Load::Hit(b);
            }
        }
        let Some(disk) = self.disk.clone() else { return Load::Miss };
        let Some(header) = disk.header(ns, key) else { return Load::Miss };
        let Some(permit) = self.disk_read_permit(&header).await else { return Load::Busy };
        let (n, k) = (*ns, *key);
        match self.io.run(Some(DISK_READ_WAIT), move || Tier::get_for_node(&*disk, &n, &k)).await {
            Ok(Load::Hit(mut b)) => {
                b.payload = bytes::Bytes::from_owner(Budgeted { bytes: b.payload, _permit: permit });
                Load::Hit(b)
            }
            Ok(other) => other,
            Err(super::io::IoRefused::Busy) => {
                ::metrics::counter!("kvtier_tier_busy_total", "tier" => TierId::Disk.as_str()).increment(1);
                Load::Busy
            }
            Err(super::io::IoRefused::Failed(why)) => {
                tracing::error!("disk read: {why}");
                Load::Miss
            }
        }
    }

    /// The disk read budget's share for a block of `header`'s size, waited for at most
    /// [`DISK_READ_WAIT`] (`None`: counted busy).
    async fn disk_read_permit(&self, header: &FrameHeader) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let kib = (header.payload_len.div_ceil(1024) as usize).min(self.disk_read_budget_kib) as u32;
        match tokio::time::timeout(DISK_READ_WAIT, self.disk_read_budget.clone().acquire_many_owned(kib)).await {
            Ok(Ok(p)) => Some(p),
            _ => {
                ::metrics::counter!("kvtier_tier_busy_total", "tier" => TierId::Disk.as_str()).increment(1);
                None
            }
        }
    }

    /// As [`TierStack::get`], except that a DRAM hit comes back *unchecked* (the second field
    /// is true then): for a caller that hashes the bytes anyway as it moves them (the same-node
    /// copy), so they are read once, not twice. Such a caller must check the block against its
    /// header's checksum before anyone sees it, and hand a mismatch to
    /// [`TierStack::drop_corrupt`]. Other tiers' hits are checked as `get` checks them.
    pub async fn get_to_check(&self, ns: &NamespaceId, key: &BlockKey) -> (Load, bool) {
        if let Some(b) = self.dram.get(ns, key) {
            return (Load::Hit(b), true);
        }
        if let Load::Hit(b) = Tier::get(&self.in_transit, ns, key) {
            return (Load::Hit(b), false);
        }
        (self.get_from_disk(ns, key).await, false)
    }

    /// A block a request was served from a peer (or Redis) because no local tier held it when the
    /// request was planned ([`crate::cluster::fetch::PeerFetch`]): a miss of DRAM and of the
    /// disk, as a read of them would have counted (the fetch, not the request, cached it in DRAM
    /// meanwhile: that is no hit).
    pub fn count_local_miss(&self) {
        self.dram.count_miss();
        if let Some(disk) = &self.disk {
            disk.count_miss();
        }
    }

    /// A DRAM block a [`TierStack::get_to_check`] caller found corrupt: counted, logged and
    /// removed (the next load of it is a miss), as `get` does with one it checks itself.
    pub fn drop_corrupt(&self, ns: &NamespaceId, key: &BlockKey) {
        super::drop_corrupt_dram(&self.dram, ns, key);
    }

    async fn get_from_disk(&self, ns: &NamespaceId, key: &BlockKey) -> Load {
        let Some(disk) = self.disk.clone() else { return self.get_from_agent(ns, key).await };
        let Some(header) = disk.header(ns, key) else {
            // Asked, and not held: a miss of this tier (its index said so without a read).
            disk.count_miss();
            return self.get_from_agent(ns, key).await;
        };
        // The block's bytes count against the read budget until every view of them is gone.
        let Some(permit) = self.disk_read_permit(&header).await else { return Load::Busy };
        let (n, k) = (*ns, *key);
        let load = match self.io.run(Some(DISK_READ_WAIT), move || Tier::get(&*disk, &n, &k)).await {
            Ok(load) => load,
            Err(super::io::IoRefused::Busy) => {
                ::metrics::counter!("kvtier_tier_busy_total", "tier" => TierId::Disk.as_str()).increment(1);
                return Load::Busy;
            }
            Err(super::io::IoRefused::Failed(why)) => {
                tracing::error!("disk read: {why}");
                return Load::Miss;
            }
        };
        let Load::Hit(mut b) = load else { return load };
        if self.second_disk_hit(ns, key) && Tier::put(&self.dram, b.header, &b.payload, Priority::Normal).is_ok() {
            ::metrics::counter!("kvtier_disk_promotions_total").increment(1);
            self.events.stored(ns, std::slice::from_ref(key), TierId::Dram);
        }
        b.payload = bytes::Bytes::from_owner(Budgeted { bytes: b.payload, _permit: permit });
        Load::Hit(b)
    }

    /// Sends the demands for the keys (`raw`: 32 bytes each) that only G1 holds, at most
    /// [`DEMAND_AHEAD`] of them, before a batched read walks them one by one: the agents spill
    /// them together instead of one round trip per key. Keep the result until the reads are
    /// done (each read joins its key's demand instead of sending another).
    pub fn demand_ahead(&self, ns: &NamespaceId, raw: &[u8]) -> Vec<super::agent::Waiter<'_>> {
        if !self.agents.has_links(ns) {
            return Vec::new();
        }
        let keys: Vec<BlockKey> = raw
            .chunks_exact(kvtier_proto::KEY_LEN)
            .filter_map(|c| BlockKey::try_from(c).ok())
            .filter(|k| self.agents.contains(ns, k) && !self.tiers().any(|t| t.contains(ns, k)))
            .take(DEMAND_AHEAD)
            .collect();
        keys.iter().filter_map(|k| self.agents.demand(ns, k)).collect()
    }

    /// A block only G1 holds: asks its agent to spill it into DRAM (the same-node store) and
    /// waits for it, at most `agent_demand_wait`; then it is read from DRAM. A wait that runs
    /// out, or an agent that says it can't spill the key, is a demand miss. A key no agent
    /// reported holding (every plain miss on a node without agents) is a plain miss: nothing is
    /// demanded, and no demand miss is counted.
    async fn get_from_agent(&self, ns: &NamespaceId, key: &BlockKey) -> Load {
        if !self.agents.contains(ns, key) {
            return Load::Miss;
        }
        let Some(waiter) = self.agents.demand(ns, key) else { return Load::Miss };
        let deadline = tokio::time::Instant::now() + self.agents.config().demand_wait;
        loop {
            let landed = waiter.landed.notified();
            // Checked after registering: a block that landed in between is not waited for.
            if let Load::Hit(b) = Tier::get(&self.dram, ns, key) {
                return Load::Hit(b);
            }
            if waiter.unspilled() {
                self.agents.missed("unspilled");
                return Load::Miss;
            }
            // Woken by a commit of the key; the short slice also catches a store answered
            // `Present` (it was in DRAM already: nothing committed).
            let slice = (tokio::time::Instant::now() + Duration::from_millis(20)).min(deadline);
            if tokio::time::timeout_at(slice, landed).await.is_err() && tokio::time::Instant::now() >= deadline {
                if let Load::Hit(b) = Tier::get(&self.dram, ns, key) {
                    return Load::Hit(b);
                }
                self.agents.missed("timeout");
                return Load::Miss;
            }
        }
    }

    fn second_disk_hit(&self, ns: &NamespaceId, key: &BlockKey) -> bool {
        let mut hits = self.disk_hits.lock();
        if hits.len() > 65_536 {
            hits.clear();
        }
        let n = hits.entry((*ns, *key)).or_insert(0);
        *n += 1;
        let again = *n >= 2;
        if again {
            hits.remove(&(*ns, *key));
        }
        again
    }

    /// Puts the peer tier under the local ones (once; later calls are ignored). With
    /// `cache_locally`, a block loaded from a peer is kept in DRAM like any other block.
    pub fn attach_peers(&self, tier: Arc<PeerTier>, cache_locally: bool) {
        let _ = self.peers.set(Peers { tier, cache_locally });
    }

    /// The peer tier, when the node is part of a cluster.
    pub fn peers(&self) -> Option<&Arc<PeerTier>> {
        self.peers.get().map(|p| &p.tier)
    }

    /// The blocks among `keys` (distinct; one chunk of a request, planned and capped by
    /// `crate::cluster::fetch`) that no local tier holds by now, loaded from their owners (one
    /// request per peer), verified, and cached in DRAM when the node is set to. Empty without a
    /// peer tier; a failure is a miss.
    pub async fn fetch_from_peers(&self, ns: &Namespace, keys: &[BlockKey]) -> HashMap<BlockKey, StoredBlock> {
        let Some(peers) = self.peers.get() else { return HashMap::new() };
        let id = ns.id();
        let held = self.exists(&id, keys);
        let missing: Vec<BlockKey> = keys.iter().zip(held).filter(|(_, h)| !h).map(|(k, _)| *k).collect();
        if missing.is_empty() {
            return HashMap::new();
        }
        let got = peers.tier.fetch(ns, &missing).await;
        let mut out = HashMap::with_capacity(got.len());
        let found: Vec<BlockKey> = missing.iter().zip(&got).filter(|(_, b)| b.is_some()).map(|(k, _)| *k).collect();
        let mut owned = peers.tier.owned_here(ns, &found).into_iter();
        for (k, b) in missing.into_iter().zip(got) {
            let Some(b) = b else { continue };
            let owned_here = owned.next().unwrap_or(false);
            // A block this node owns (it joined or restarted lately, or evicted it) is its copy
            // that counts: kept as a store is (read repair). Another's is kept at low priority,
            // if at all: it goes first under pressure, so a node's memory isn't taken by copies
            // of others' blocks.
            let keep = match owned_here {
                true => Some(Priority::Normal),
                false => peers.cache_locally.then_some(Priority::Low),
            };
            if let Some(priority) = keep {
                if Tier::put(&self.dram, b.header, &b.payload, priority).is_ok() {
                    let kind = if priority == Priority::Normal {
                        "kvtier_peer_repaired_here_total"
                    } else {
                        "kvtier_peer_cached_total"
                    };
                    ::metrics::counter!(kind).increment(1);
                    self.events.stored(&id, std::slice::from_ref(&k), TierId::Dram);
                }
            }
            out.insert(k, b);
        }
        out
    }

    /// Keeps a block fetched (and checked) from a peer in DRAM, announcing it like a store.
    pub fn put_fetched(&self, b: &StoredBlock, priority: Priority) -> Result<(), ServerError> {
        Tier::put(&self.dram, b.header, &b.payload, priority)?;
        self.events.stored(&b.header.namespace, std::slice::from_ref(&b.header.key), TierId::Dram);
        Ok(())
    }

    /// Puts the shared Redis tier under the local ones (and the peers'), once; later calls are
    /// ignored.
    pub fn attach_redis(&self, tier: Arc<RedisTier>) {
        let _ = self.redis.set(tier);
    }

    /// The shared Redis tier, when `[redis_tier]` is set.
    pub fn redis(&self) -> Option<&Arc<RedisTier>> {
        self.redis.get()
    }

    /// Whether blocks may be found beyond this node's own tiers (peers, Redis).
    pub fn has_remote(&self) -> bool {
        self.peers.get().is_some() || self.redis.get().is_some()
    }

    /// [`TierStack::fetch_from_peers`], then — with a Redis tier — the keys still missing from
    /// Redis (one batched request), verified and kept in DRAM. Empty without either.
    pub async fn fetch_remote(&self, ns: &Namespace, keys: &[BlockKey]) -> HashMap<BlockKey, StoredBlock> {
        let mut out = self.fetch_from_peers(ns, keys).await;
        let Some(redis) = self.redis.get() else { return out };
        let id = ns.id();
        let held = self.exists(&id, keys);
        let missing: Vec<BlockKey> =
            keys.iter().zip(held).filter(|(k, h)| !h && !out.contains_key(k)).map(|(k, _)| *k).collect();
        if missing.is_empty() {
            return out;
        }
        for (k, b) in missing.iter().zip(redis.fetch(ns, &missing).await) {
            let Some(b) = b else { continue };
            if Tier::put(&self.dram, b.header, &b.payload, Priority::Normal).is_ok() {
                self.events.stored(&id, std::slice::from_ref(k), TierId::Dram);
            }
            out.insert(*k, b);
        }
        out
    }

    /// Which of `keys` (none held locally) the peers (one request per peer) or Redis (one
    /// batched request for what no peer holds) hold; a failure holds nothing.
    async fn remote_held(&self, ns: &Namespace, keys: &[BlockKey]) -> Vec<bool> {
        let mut held = match self.peers.get() {
            Some(p) if !keys.is_empty() => p.tier.held(ns, keys).await,
            _ => vec![false; keys.len()],
        };
        if let Some(redis) = self.redis.get() {
            let missing: Vec<usize> = (0..keys.len()).filter(|&i| !held[i]).collect();
            let ask: Vec<BlockKey> = missing.iter().map(|&i| keys[i]).collect();
            for (i, there) in missing.into_iter().zip(redis.held(&ns.id(), &ask).await) {
                held[i] = there;
            }
        }
        held
    }

    /// [`TierStack::longest_prefix`], continued — with a peer or Redis tier — by what the owners
    /// of the keys after it (or Redis) hold; a failed peer holds nothing.
    pub async fn longest_prefix_with_peers(&self, ns: &Namespace, keys: &[BlockKey]) -> usize {
        let id = ns.id();
        let n = self.longest_prefix(&id, keys);
        if !self.has_remote() || n == keys.len() {
            return n;
        }
        let local = self.exists(&id, &keys[n..]);
        let ask: Vec<BlockKey> = keys[n..].iter().zip(&local).filter(|(_, h)| !**h).map(|(k, _)| *k).collect();
        let mut remote = self.remote_held(ns, &ask).await.into_iter();
        n + local.into_iter().take_while(|&here| here || remote.next().unwrap_or(false)).count()
    }

    /// [`TierStack::exists`], completed — with a peer or Redis tier — by what the owners of the
    /// keys no local tier holds (or Redis) hold; a failed peer holds nothing.
    pub async fn exists_with_peers(&self, ns: &Namespace, keys: &[BlockKey]) -> Vec<bool> {
        let id = ns.id();
        let mut held = self.exists(&id, keys);
        if !self.has_remote() {
            return held;
        }
        let missing: Vec<usize> = (0..keys.len()).filter(|&i| !held[i]).collect();
        if missing.is_empty() {
            return held;
        }
        let ask: Vec<BlockKey> = missing.iter().map(|&i| keys[i]).collect();
        for (i, there) in missing.into_iter().zip(self.remote_held(ns, &ask).await) {
            held[i] = there;
        }
        held
    }

    /// With a Redis tier: writes a parked (or extended) session's manifest — and those of its
    /// blocks Redis may not hold as long — to Redis, so any node sharing it can resume the
    /// session. Bounded by the Redis timeout; a failure is counted and the park stands.
    pub async fn share_session(&self, m: &crate::sessions::SessionManifest) {
        let Some(redis) = self.redis.get() else { return };
        let ns = m.namespace;
        redis.park(m, |k| async move { self.get_for_node(&ns, &k).await.hit() }).await;
    }

    /// With a Redis tier: a session this node does not hold, from its manifest in Redis (its
    /// blocks then load through the Redis tier); `None` without one.
    pub async fn resume_shared(&self, ns: &NamespaceId, id: &str) -> Option<crate::sessions::SessionManifest> {
        self.redis.get()?.resume(ns, id).await
    }

    /// With a Redis tier: removes a dropped session's manifest from Redis.
    pub async fn drop_shared(&self, ns: &NamespaceId, id: &str) {
        if let Some(redis) = self.redis.get() {
            redis.drop_session(ns, id).await;
        }
    }

    /// Queues blocks this node just stored for their other owners, and for Redis with a Redis
    /// tier; nothing without either. See [`PeerTier::forward`] and [`RedisTier::store`]. Returns
    /// the keys that already left memory (evicted within the store: a tenant's quota, a full
    /// DRAM), for the caller to read back ([`TierStack::forward_read_permit`]) and pass to
    /// [`TierStack::forward_blocks`], or count ([`TierStack::forward_dropped`]).
    pub fn forward_to_peers(&self, ns: Namespace, keys: &[BlockKey]) -> Vec<BlockKey> {
        if !self.has_remote() {
            return Vec::new();
        }
        let id = ns.id();
        let in_memory = |k: &BlockKey| {
            self.tiers().filter(|t| !t.does_io()).find_map(|t| match t.get_for_node(&id, k) {
                Load::Hit(b) => Some(b),
                _ => None,
            })
        };
        let (mut blocks, mut gone) = (Vec::with_capacity(keys.len()), Vec::new());
        for k in keys {
            match in_memory(k) {
                Some(b) => blocks.push(b),
                None => gone.push(*k),
            }
        }
        self.forward_blocks(ns, blocks, std::time::Instant::now());
        gone
    }

    /// A permit to read back evicted blocks for forwarding (at most [`FORWARD_READS`] stores at
    /// once), on a node with a disk tier (without one they are gone).
    pub fn forward_read_permit(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.disk.as_ref()?;
        self.forward_reads.clone().try_acquire_owned().ok()
    }

    /// Forwards blocks stored at `stored_at` (see [`PeerTier::forward_stored_at`]), and stores
    /// them in Redis with a Redis tier.
    pub fn forward_blocks(&self, ns: Namespace, blocks: Vec<StoredBlock>, stored_at: std::time::Instant) {
        if blocks.is_empty() {
            return;
        }
        if let Some(redis) = self.redis.get() {
            redis.store(blocks.clone());
        }
        if let Some(peers) = self.peers.get() {
            peers.tier.forward_stored_at(ns, blocks, stored_at);
        }
    }

    /// Counts `n` just-stored blocks that could not be forwarded.
    pub fn forward_dropped(&self, n: u64) {
        if let (Some(peers), true) = (self.peers.get(), n > 0) {
            peers.tier.count_forward_dropped(n);
        }
    }

    /// Whether the hottest tier (DRAM) holds the block: a write of it can be skipped.
    pub fn is_hot(&self, ns: &NamespaceId, key: &BlockKey) -> bool {
        self.dram.contains(ns, key)
    }

    /// The DRAM arena every slot is carved from (what a one-sided fabric registers once).
    pub fn dram_region(&self) -> &crate::dram::Region {
        self.dram.region()
    }

    /// The DRAM tier's budget of leased slot bytes (every open `PUT` and write lease).
    pub fn dram_lease_budget(&self) -> u64 {
        self.dram.lease_budget()
    }

    /// The block as DRAM holds it, unchecked (a remote read lease's: the reader checks it), or
    /// `None` when DRAM doesn't hold it.
    pub fn dram_block(&self, ns: &NamespaceId, key: &BlockKey) -> Option<crate::dram::StoredBlock> {
        self.dram.get(ns, key)
    }

    /// Zero-copy ingest, step one: an unpublished DRAM slot of `len` bytes to receive into.
    pub fn reserve(&self, ns: &NamespaceId, len: usize) -> Result<SlotWriter, ServerError> {
        self.dram.reserve_for(ns, len)
    }

    /// Gives `account` its quotas before any of its namespaces is registered, so the share the
    /// DRAM quotas leave the others (the DRAM tier's shared pool) holds from the start.
    pub fn reserve_quotas(&self, account: u32, dram: Option<u64>, disk: Option<u64>) {
        if let Some(q) = dram {
            self.dram.set_account_quota(account, q);
        }
        if let (Some(d), Some(q)) = (&self.disk, disk) {
            d.set_account_quota(account, q);
        }
    }

    /// Counts `ns`'s bytes against `account`: in DRAM, under a quota its own blocks make room
    /// under (see `crate::dram`, "Accounts"); on disk, under a quota past which its evicted
    /// blocks are not demoted (see [`DiskTier::assign_account`]).
    pub fn assign_account(&self, ns: NamespaceId, account: u32, dram_quota: Option<u64>, disk_quota: Option<u64>) {
        if let Some(q) = dram_quota {
            self.dram.set_account_quota(account, q);
        }
        self.dram.assign_account(ns, account);
        if let Some(d) = &self.disk {
            d.assign_account(ns, account, disk_quota);
        }
    }

    /// DRAM bytes resident for an account.
    pub fn account_resident(&self, account: u32) -> u64 {
        self.dram.account_resident(account)
    }

    /// Zero-copy ingest, step two: publishes a slot whose bytes the caller verified.
    pub fn commit(
        &self,
        slot: SlotWriter,
        header: FrameHeader,
        priority: Priority,
    ) -> Result<InsertOutcome, ServerError> {
        let out = self.dram.commit(slot, header, priority)?;
        if out == InsertOutcome::Inserted {
            self.events.stored(&header.namespace, std::slice::from_ref(&header.key), TierId::Dram);
        }
        self.agents.landed(&header.namespace, &header.key);
        Ok(out)
    }

    /// Revokes reserved DRAM slots held past their deadline; returns how many.
    pub fn reap_leases(&self) -> usize {
        self.dram.reap_leases(std::time::Instant::now())
    }

    /// Leases one DRAM block for a connection (between a session's upload and its park, or a
    /// replica's adoption): pinned, so nothing evicts it before the manifest pins it. Refused for
    /// a block DRAM does not hold.
    ///
    /// Past the DRAM pinned limit (`max_pinned_ratio`), a node with a disk tier leases the block
    /// without a pin instead of refusing: a parked session's manifest pins its blocks on disk, so
    /// a session need not fit in DRAM. Such a block, evicted before the park, goes to disk with
    /// the demotion queue as it was sent (never re-encoded with `disk_codec`), where the park
    /// finds it; one whose demotion was dropped (a full queue,
    /// the tenant's disk quota) is reported missing and the client sends it again. Without a disk
    /// tier sessions pin DRAM, and the limit refuses the lease.
    ///
    /// Every lease granted is let go with one [`TierStack::unpin_lease`].
    pub fn pin_lease(&self, ns: &NamespaceId, key: &BlockKey) -> Result<(), ServerError> {
        match self.dram.pin(ns, std::slice::from_ref(key)) {
            Err(ServerError::Capacity(_)) if self.disk.is_some() => {
                *self.unpinned_leases.lock().entry((*ns, *key)).or_insert(0) += 1;
                ::metrics::counter!("kvtier_dram_leases_unpinned_total").increment(1);
                Ok(())
            }
            other => other,
        }
    }

    /// Lets go of one lease [`TierStack::pin_lease`] granted. A block's leases are counted, not
    /// owned: any of them lets go of an unpinned one first, then of a DRAM pin.
    pub fn unpin_lease(&self, ns: &NamespaceId, key: &BlockKey) {
        {
            let mut unpinned = self.unpinned_leases.lock();
            if let Some(n) = unpinned.get_mut(&(*ns, *key)) {
                *n -= 1;
                if *n == 0 {
                    unpinned.remove(&(*ns, *key));
                }
                return;
            }
        }
        self.dram.unpin(ns, std::slice::from_ref(key))
    }

    /// Where parked sessions pin their blocks: disk when the node has one (parks are durable),
    /// otherwise DRAM.
    pub fn session_pins(&self) -> &dyn PinTier {
        match &self.disk {
            Some(d) => d.as_ref(),
            None => &self.dram,
        }
    }

    /// Whether parks are written to disk before they are acknowledged.
    pub fn is_durable(&self) -> bool {
        self.disk.is_some()
    }

    /// Makes a manifest's blocks durable (with a disk tier): writes every block not on disk yet
    /// (from DRAM or the demotion queue) and syncs, on the I/O pool. Blocks no tier holds are
    /// reported missing for the client to re-send. A namespace unregistered meanwhile is
    /// [`ServerError::UnknownNamespace`], and nothing more of it is written (each block is
    /// checked and written under the disk's write gate, see the module docs).
    pub async fn persist(
        &self,
        ns: &NamespaceId,
        keys: &[BlockKey],
        tail: Option<BlockKey>,
    ) -> Result<(), ServerError> {
        let Some(disk) = self.disk.clone() else { return Ok(()) };
        // Taken before the blocks are gathered: an unregistration after it is seen by the writes.
        let ticket = PersistTicket::new(&self.persisting, *ns);
        let mut blocks = Vec::new();
        let mut missing = Vec::new();
        for (i, k) in keys.iter().chain(tail.iter()).enumerate() {
            if disk.contains(ns, k) {
                continue;
            }
            let in_memory = self.tiers().filter(|t| !t.does_io()).find_map(|t| match t.get_for_node(ns, k) {
                Load::Hit(b) => Some(b),
                _ => None,
            });
            match in_memory {
                Some(b) => blocks.push(b),
                // It reached disk between the two checks.
                None if disk.contains(ns, k) => {}
                None => missing.push(i as u32),
            }
        }
        if !missing.is_empty() {
            if !ticket.live() {
                // Missing because the namespace went with them.
                return Err(ServerError::UnknownNamespace(*ns));
            }
            let n = keys.len() as u32;
            let missing_tail = missing.contains(&n);
            missing.retain(|&i| i < n);
            return Err(ServerError::MissingBlocks { missing, missing_tail });
        }
        let sync = self.sync_parks;
        let written: Vec<BlockKey> = blocks.iter().map(|b| b.header.key).collect();
        let id = *ns;
        self.io
            .run(None, move || {
                for b in &blocks {
                    // Checked and written with no namespace mark taken in between.
                    let writes = disk.writes();
                    if !ticket.live() {
                        return Err(ServerError::UnknownNamespace(id));
                    }
                    writes.write(&b.header, &b.payload)?;
                }
                if sync {
                    disk.sync()?;
                }
                Ok::<_, ServerError>(())
            })
            .await??;
        self.events.stored(ns, &written, TierId::Disk);
        Ok(())
    }

    /// Removes every unpinned block of a namespace from every tier (a block queued for disk is
    /// not written). Returns how many distinct blocks went. A purge that logs a mark takes it
    /// with [`Self::invalidate`] and purges under it.
    pub fn purge(&self, ns: &NamespaceId) -> u64 {
        self.invalidate().purge(ns)
    }

    /// [`Self::purge`] of a namespace that is gone (unregistered): its DRAM blocks pinned by
    /// data-plane leases go too ([`DramTier::forget_namespace`]); its sessions' pins were let go
    /// before; a persist of it in flight fails.
    pub fn forget_namespace(&self, ns: &NamespaceId) -> u64 {
        self.invalidate().forget_namespace(ns)
    }

    /// Starts invalidating a namespace: waits for the disk writes in flight (one demotion, one
    /// block of each persist) and holds off every other until the [`Invalidation`] is dropped. An
    /// unregistration or a purge takes its mark ([`Invalidation::mark`]), logs it and invalidates
    /// the namespace ([`Invalidation::forget_namespace`], [`Invalidation::purge`]) holding it,
    /// so no record written before the invalidation lies after the mark. Blocking, and not to be
    /// held across an await: writers (the demotion thread, persists on the I/O pool) wait
    /// meanwhile, and the DRAM eviction hook does not (it only queues).
    pub fn invalidate(&self) -> Invalidation<'_> {
        Invalidation { stack: self, writes: self.disk.as_deref().map(DiskTier::hold_writes) }
    }

    fn purge_with(&self, ns: &NamespaceId, gone: Vec<BlockKey>) -> u64 {
        let mut gone: std::collections::HashSet<BlockKey> = gone.into_iter().collect();
        for t in self.tiers() {
            gone.extend(t.purge(ns));
        }
        self.agents.purge(ns);
        if self.events.is_watched() {
            let keys: Vec<BlockKey> = gone.iter().copied().collect();
            self.events.purged(ns, &keys);
        }
        gone.len() as u64
    }

    /// Counters of the tiers that hold capacity of their own (DRAM, disk), hottest first.
    /// What a tenant's `Stats` shows of the tiers: on DRAM and disk, its quota as the capacity
    /// (the tier's without one) and the bytes `account` (the tenant's) holds there, with its
    /// blocks and pinned bytes in DRAM. Every other figure (hits, bytes moved, the peer and Redis
    /// tiers) counts other tenants' traffic too, and is the operator's.
    pub fn account_stats(&self, account: u32) -> Vec<(TierId, TierStats)> {
        let dram = self.dram.account_stats(account);
        let disk = self.disk.as_ref().map(|d| {
            let (blocks, pinned_bytes) = d.account_blocks_and_pinned(account);
            let s = TierStats {
                capacity_bytes: d.account_quota(account).unwrap_or_else(|| d.capacity()),
                resident_bytes: d.account_live(account),
                blocks,
                pinned_bytes,
                ..TierStats::default()
            };
            (TierId::Disk, s)
        });
        std::iter::once((TierId::Dram, dram)).chain(disk).collect()
    }

    pub fn stats(&self) -> Vec<(TierId, TierStats)> {
        let local = self.tiers().filter(|t| t.id() != TierId::InTransit).map(|t| (t.id(), t.stats()));
        local
            .chain(self.peers.get().map(|p| (TierId::Peer, p.tier.stats())))
            .chain(self.redis.get().map(|r| (TierId::Redis, r.stats())))
            .collect()
    }

    /// Waits while the demotion queue is full, so writers slow down to the disk's pace instead
    /// of evicting blocks that can't be demoted (bounded: past the wait the write proceeds).
    pub async fn backpressure(&self) {
        if self.disk.is_none() {
            return;
        }
        self.depth.wait_for_room(tokio::time::Instant::now() + BACKPRESSURE_WAIT).await;
    }

    /// Blocks queued for disk now.
    pub fn demotion_depth(&self) -> usize {
        self.depth.get()
    }

    /// Starts demoting DRAM evictions to disk (with a disk tier), re-encoding lossless blocks
    /// with `codec` when set.
    pub fn start_demotion(&self, codec: Option<CodecId>) {
        let Some(disk) = self.disk.clone() else { return };
        // A block leased without a DRAM pin belongs to a park in progress: evicted, it goes to
        // disk as sent (a parked session's blocks are never re-encoded).
        let leased = self.unpinned_leases.clone();
        let keep_as_sent: demotion::KeepAsSent = Arc::new(move |ns, key| leased.lock().contains_key(&(*ns, *key)));
        let thread = demotion::start(&self.dram, &self.in_transit, disk, self.depth.clone(), codec, keep_as_sent);
        *self.demotion.lock() = thread;
    }

    /// Closes the demotion queue, waits until what was queued is on disk, and syncs the disk.
    /// Blocking: call it from a blocking context.
    pub fn stop_demotion(&self) -> Result<(), ServerError> {
        // Dropping the eviction hook closes the queue: the thread writes what is queued and ends.
        self.dram.set_eviction_hook(None);
        if let Some(thread) = self.demotion.lock().take() {
            thread.join().map_err(|_| ServerError::Config("the demotion thread panicked".into()))?;
        }
        if let Some(disk) = &self.disk {
            disk.sync()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use kvtier_proto::{BlockFrame, DType, KvLayout};

    use super::*;
    use crate::disk::DiskConfig;
    use crate::dram::{DramConfig, DramOptions};

    fn frame(ns: NamespaceId, i: u32) -> BlockFrame {
        let layout = KvLayout::new(4, 8, 128, DType::Fp16, 32); // 256 KiB blocks
        let key = BlockKey(*blake3::hash(&i.to_le_bytes()).as_bytes());
        let payload: Vec<u8> =
            (0..layout.block_bytes()).map(|j| (j as u32).wrapping_mul(7).wrapping_add(i) as u8).collect();
        BlockFrame::new(ns, key, layout, CodecId::RAW, 32, Bytes::from(payload))
    }

    fn stack(dir: &std::path::Path, dram_bytes: u64) -> TierStack {
        // As the node builds it: room in the region for a full demotion queue.
        let opts = DramOptions {
            headroom_bytes: Some(
                DramOptions::default_headroom(dram_bytes) + super::demotion::queue_headroom(dram_bytes, 1 << 20),
            ),
            ..DramOptions::default()
        };
        let dram = DramTier::with_options(DramConfig::new(dram_bytes), opts).unwrap();
        let (disk, _) = DiskTier::open(DiskConfig {
            dir: dir.to_path_buf(),
            capacity_bytes: 64 << 20,
            segment_bytes: 4 << 20,
            sync_writes: false,
        })
        .unwrap();
        TierStack::new(dram, Some(Arc::new(disk)), false)
    }

    /// Writes `f` as a data-plane PUT does: waits for room in the demotion queue, reserves a slot,
    /// fills it, commits it.
    async fn ingest(s: &TierStack, f: &BlockFrame) {
        s.backpressure().await;
        let mut slot = s.reserve(&f.header.namespace, f.payload.len()).unwrap();
        slot.buf_mut().copy_from_slice(&f.payload);
        s.commit(slot, f.header, Priority::Normal).unwrap();
    }

    /// Blocks written through the stack's ingest end up spread over DRAM and disk; every one is
    /// found, read back exactly, and gone from every tier after a purge.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_block_anywhere_in_the_stack_is_found_read_and_purged() {
        let dir = tempfile::tempdir().unwrap();
        let s = stack(dir.path(), 1 << 20);
        s.start_demotion(None);
        let (ns, other) = (NamespaceId([1; 16]), NamespaceId([2; 16]));
        let frames: Vec<BlockFrame> = (0..16).map(|i| frame(ns, i)).collect();
        for f in frames.iter().chain([frame(other, 99)].iter()) {
            ingest(&s, f).await;
        }
        while s.demotion_depth() > 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let keys: Vec<BlockKey> = frames.iter().map(|f| f.header.key).collect();
        assert_eq!(s.exists(&ns, &keys), vec![true; 16]);
        assert_eq!(s.longest_prefix(&ns, &keys), 16);
        let stats = s.stats();
        assert_eq!(stats.iter().map(|(id, _)| *id).collect::<Vec<_>>(), vec![TierId::Dram, TierId::Disk]);
        assert!(stats[1].1.blocks > 0, "1 MiB of DRAM can't hold 4 MiB: some blocks are on disk");
        for f in &frames {
            match s.get(&ns, &f.header.key).await {
                Load::Hit(b) => assert_eq!((b.header.key, &b.payload), (f.header.key, &f.payload)),
                other => panic!("block {} not read: {other:?}", f.header.key),
            }
        }
        assert_eq!(s.purge(&ns), 16);
        assert_eq!(s.exists(&ns, &keys), vec![false; 16]);
        assert!(matches!(s.get(&ns, &keys[0]).await, Load::Miss));
        assert!(s.holds(&other, &frame(other, 99).header.key), "another namespace is untouched");
        tokio::task::spawn_blocking(move || s.stop_demotion()).await.unwrap().unwrap();
    }

    /// A DRAM hit comes back from `get_to_check` unchecked, for a caller that hashes it as it
    /// copies it; a block that caller finds damaged is dropped (the next load is a miss), and
    /// `get` still refuses a damaged block by itself.
    #[tokio::test]
    async fn a_damaged_dram_block_goes_to_the_checking_caller_and_is_dropped_after() {
        let dir = tempfile::tempdir().unwrap();
        let s = stack(dir.path(), 4 << 20);
        let ns = NamespaceId([3; 16]);
        let (good, bad, bad2) = (frame(ns, 1), frame(ns, 2), frame(ns, 3));
        for (f, damage) in [(&good, false), (&bad, true), (&bad2, true)] {
            let mut slot = s.reserve(&ns, f.payload.len()).unwrap();
            slot.buf_mut().copy_from_slice(&f.payload);
            if damage {
                slot.buf_mut()[1000] ^= 0x40; // memory gone bad after the block was checked in
            }
            s.commit(slot, f.header, Priority::Normal).unwrap();
        }
        let (load, unchecked) = s.get_to_check(&ns, &good.header.key).await;
        let b = load.hit().expect("the good block is held");
        assert!(unchecked, "a DRAM hit is left to the caller to check");
        assert_eq!(b.payload, good.payload);

        let (load, unchecked) = s.get_to_check(&ns, &bad.header.key).await;
        let b = load.hit().expect("handed over unchecked");
        assert!(unchecked && b.header.verify_payload(&b.payload).is_err());
        s.drop_corrupt(&ns, &bad.header.key);
        assert!(!s.holds(&ns, &bad.header.key), "dropped once found damaged");
        assert!(matches!(s.get_to_check(&ns, &bad.header.key).await.0, Load::Miss));

        assert!(matches!(s.get(&ns, &bad2.header.key).await, Load::Miss), "get checks for itself");
        assert!(!s.holds(&ns, &bad2.header.key));
        assert!(s.holds(&ns, &good.header.key), "the good block is untouched");
    }

    /// A miss of a key no GPU agent reported is a plain miss — on a node with no agent, or with
    /// one that holds other keys — and counts no demand miss; a key an agent holds whose demand
    /// can't be queued still counts one.
    #[tokio::test]
    async fn a_plain_miss_counts_no_demand_miss_and_an_unqueued_demand_does() {
        let dir = tempfile::tempdir().unwrap();
        let s = stack(dir.path(), 4 << 20);
        let ns = NamespaceId([5; 16]);
        let (missing, held) = (frame(ns, 7).header.key, frame(ns, 8).header.key);
        assert!(matches!(s.get(&ns, &missing).await, Load::Miss));
        assert_eq!((s.agents().stats().demands, s.agents().stats().misses), (0, 0), "no agent: no demand miss");

        let (rx, link) = s.agents().open(ns, "agent-0").unwrap();
        assert!(s.agents().report(&ns, "agent-0", &[held], &[]));
        assert!(matches!(s.get(&ns, &missing).await, Load::Miss));
        assert_eq!((s.agents().stats().demands, s.agents().stats().misses), (0, 0), "a key no agent holds");

        drop(rx); // the agent's stream is gone while its link still stands: the demand can't be sent
        assert!(matches!(s.get(&ns, &held).await, Load::Miss));
        assert_eq!((s.agents().stats().demands, s.agents().stats().misses), (0, 1), "an unqueued demand");
        drop(link);
    }

    /// A namespace that is gone takes its DRAM blocks with it, one a data-plane lease pins too
    /// (a purge, which leaves the namespace, spares it); the lease's let-go afterwards finds
    /// nothing, and nothing stays pinned. Before, the leased block stayed indexed: served again
    /// once the namespace was registered anew, demoted to disk once evicted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_gone_namespace_s_leased_blocks_go_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let s = stack(dir.path(), 4 << 20);
        let ns = NamespaceId([8; 16]);
        let (leased, other) = (frame(ns, 1), frame(ns, 2));
        ingest(&s, &leased).await;
        ingest(&s, &other).await;
        s.pin_lease(&ns, &leased.header.key).unwrap();
        assert_eq!(s.purge(&ns), 1);
        assert!(matches!(s.get(&ns, &leased.header.key).await, Load::Hit(_)), "a purge spares a leased block");
        assert_eq!(s.forget_namespace(&ns), 1);
        assert!(matches!(s.get(&ns, &leased.header.key).await, Load::Miss), "a gone namespace's leased block");
        assert_eq!(s.dram.stats().pinned_bytes, 0);
        s.unpin_lease(&ns, &leased.header.key);
        let st = s.dram.stats();
        assert_eq!((st.pinned_bytes, st.blocks, st.resident_bytes), (0, 0, 0));
        ingest(&s, &leased).await;
        assert!(matches!(s.get(&ns, &leased.header.key).await, Load::Hit(b) if b.payload == leased.payload));
    }

    /// With a disk tier a session larger than DRAM's pinned share is leased whole (the blocks
    /// past the limit without a DRAM pin), persisted to disk and let go, leaving nothing pinned in
    /// DRAM; without one the limit still refuses the lease.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn leases_past_the_dram_pinned_limit_stand_on_the_disk_tier() {
        let dir = tempfile::tempdir().unwrap();
        let s = stack(dir.path(), 4 << 20); // under 16 blocks of 256 KiB, 90% of it pinnable
        s.start_demotion(None);
        let ns = NamespaceId([6; 16]);
        let frames: Vec<BlockFrame> = (0..20).map(|i| frame(ns, i)).collect();
        for f in &frames {
            ingest(&s, f).await;
            s.pin_lease(&ns, &f.header.key).expect("leased: the disk stands in past the limit");
        }
        let pinned = s.dram.stats().pinned_bytes;
        assert!(pinned > 0 && pinned <= (4 << 20) * 9 / 10, "DRAM pins stay under the limit: {pinned}");
        let keys: Vec<BlockKey> = frames.iter().map(|f| f.header.key).collect();
        s.persist(&ns, &keys, None).await.expect("every block in DRAM, on its way to disk or on disk");
        let disk = s.disk.clone().unwrap();
        assert!(keys.iter().all(|k| disk.contains(&ns, k)));
        // The same block leased twice, once pinned and once not: two let-gos release both.
        s.pin_lease(&ns, &keys[0]).unwrap();
        for k in keys.iter().chain([&keys[0]]) {
            s.unpin_lease(&ns, k);
        }
        assert_eq!(s.dram.stats().pinned_bytes, 0, "every lease let go");
        assert!(s.unpinned_leases.lock().is_empty());
        for f in &frames {
            match s.get(&ns, &f.header.key).await {
                Load::Hit(b) => assert_eq!(b.payload, f.payload),
                other => panic!("block {} not read: {other:?}", f.header.key),
            }
        }
        tokio::task::spawn_blocking(move || s.stop_demotion()).await.unwrap().unwrap();

        let memory_only = TierStack::new(DramTier::new(DramConfig::new(4 << 20)), None, false);
        let refused = frames.iter().position(|f| {
            Tier::put(&memory_only.dram, f.header, &f.payload, Priority::Normal).unwrap();
            memory_only.pin_lease(&ns, &f.header.key).is_err()
        });
        assert!(refused.is_some_and(|n| n < 16), "no disk tier: the pinned limit refuses a lease: {refused:?}");
    }

    /// A block a park leased past the DRAM pinned limit and that DRAM then evicts reaches the
    /// disk as it was sent (a parked session's blocks are never re-encoded), while a block
    /// nobody leased, evicted beside it, is re-encoded with the disk codec as usual.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_leased_block_evicted_past_the_pinned_limit_reaches_disk_as_sent() {
        // fp16 values in [1, 2): every block is one the lossy disk codec takes.
        let finite = |ns: NamespaceId, i: u32| {
            let layout = KvLayout::new(4, 8, 128, DType::Fp16, 32);
            let key = BlockKey(*blake3::hash(&[&i.to_le_bytes()[..], &ns.0].concat()).as_bytes());
            let payload: Vec<u8> = (0..layout.block_bytes() / 2)
                .flat_map(|j| (0x3C00u16 | ((j as u32).wrapping_mul(7).wrapping_add(i) & 0x3FF) as u16).to_le_bytes())
                .collect();
            BlockFrame::new(ns, key, layout, CodecId::RAW, 32, Bytes::from(payload))
        };
        let dir = tempfile::tempdir().unwrap();
        let s = stack(dir.path(), 4 << 20);
        s.start_demotion(Some(CodecId::from_name("fp8").unwrap()));
        let (parked, cached) = (NamespaceId([7; 16]), NamespaceId([8; 16]));
        let leased: Vec<BlockFrame> = (0..20).map(|i| finite(parked, i)).collect();
        for f in &leased {
            ingest(&s, f).await;
            s.pin_lease(&parked, &f.header.key).unwrap();
        }
        // Blocks nobody leases push the unpinned leased ones out of DRAM, and then themselves.
        let others: Vec<BlockFrame> = (0..40).map(|i| finite(cached, i)).collect();
        for f in &others {
            ingest(&s, f).await;
        }
        let keys: Vec<BlockKey> = leased.iter().map(|f| f.header.key).collect();
        s.persist(&parked, &keys, None).await.unwrap();
        let stack = Arc::new(s);
        let stopping = stack.clone();
        tokio::task::spawn_blocking(move || stopping.stop_demotion()).await.unwrap().unwrap();
        let disk = stack.disk.clone().unwrap();
        let mut demoted_leased = 0;
        for f in &leased {
            let (h, payload) = disk.read(&parked, &f.header.key).expect("on disk: persisted or demoted");
            assert!(h.codec == CodecId::RAW && payload == f.payload, "a leased block not as sent: {:?}", h.codec);
            demoted_leased += usize::from(!stack.dram.contains(&parked, &f.header.key));
        }
        assert!(demoted_leased > 0, "some leased blocks left DRAM before the park persisted them");
        let recoded =
            others.iter().filter_map(|f| disk.header(&cached, &f.header.key)).filter(|h| h.codec != CodecId::RAW);
        assert!(recoded.count() > 0, "blocks nobody leased are re-encoded: the codec does take these blocks");
        for k in &keys {
            stack.unpin_lease(&parked, k);
        }
    }

    /// `persist` writes blocks held only in memory to disk; blocks no tier holds are reported by
    /// index (the tail apart) for the client to re-send.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn persist_writes_memory_blocks_and_reports_the_missing() {
        let dir = tempfile::tempdir().unwrap();
        let s = stack(dir.path(), 8 << 20);
        let ns = NamespaceId([3; 16]);
        let (a, b, ghost, tail) = (frame(ns, 1), frame(ns, 2), frame(ns, 3), frame(ns, 4));
        for f in [&a, &b, &tail] {
            Tier::put(&s.dram, f.header, &f.payload, Priority::Normal).unwrap();
        }
        s.persist(&ns, &[a.header.key, b.header.key], Some(tail.header.key)).await.unwrap();
        let disk = s.disk.as_ref().unwrap();
        assert!([&a, &b, &tail].iter().all(|f| disk.contains(&ns, &f.header.key)));
        match s.persist(&ns, &[a.header.key, ghost.header.key], Some(ghost.header.key)).await {
            Err(ServerError::MissingBlocks { missing, missing_tail }) => {
                assert_eq!((missing, missing_tail), (vec![1], true))
            }
            other => panic!("{other:?}"),
        }
    }
}
