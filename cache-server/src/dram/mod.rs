//! G2, the DRAM tier of one node: verified blocks in reusable slab slots under a hard byte cap,
//! a concurrent index, S3-FIFO eviction per priority level, and pins.
//!
//! # Storage ([`region`], [`slab`])
//! Every block lives in a slot: an extent of its size class in the tier's one [`Region`] (an
//! anonymous mapping or a memfd, see [`region`] for the carving), carved once and reused for
//! later blocks. Classes start at 4 KiB with 4 classes per power of two, so the usual full-block sizes
//! (powers of two) fit exactly and any other payload wastes < 25% of itself (< 4 KiB below
//! 4 KiB). `allocated_bytes` (slots the tier owns: indexed, free, or lent to a writer) never
//! exceeds `capacity_bytes`: it only changes under the state mutex, after a budget check. When a
//! slot of class C is needed: a free slot of C, else fresh budget, else free slots of other
//! classes are given back, else blocks are evicted (a victim of class C donates its slot).
//!
//! # Readers and writers
//! A writer fills a slot it owns exclusively through a [`Lease`] (nobody else can reach those
//! bytes); [`DramTier::commit`] freezes it into a shared, read-only slot in the index, so a
//! reader never sees a half-written block. A reader gets a `Bytes` that holds a clone of that
//! shared slot. A slot leaving the index is reused only if no reader holds it; otherwise the
//! tier stops counting it and the last reader hands its extent back to the arena, so a held
//! `StoredBlock` never changes.
//!
//! # Leases (Mooncake's PutStart / PutEnd)
//! [`DramTier::reserve`] is PutStart: it returns a [`Lease`] on a slot of the block's size,
//! which the holder fills (from a socket, or later one-sidedly by a mover that addresses the
//! region), verifies, and [`DramTier::commit`]s (PutEnd). The lease dies with its holder: a
//! connection that ends drops it and the slot returns to its free list. Every lease has a
//! deadline ([`DramOptions::lease_ttl`]); past it the tier revokes it (at the next reserve, or
//! [`DramTier::reap_leases`]): its bytes leave the budget and the lease quota at once, its later
//! commit fails with `Capacity`, and its extent returns to the arena when the holder finally
//! drops it (the holder may still be writing into it, so it can't be reused before). Leased
//! bytes are capped ([`DramOptions::max_leased_bytes`]) so writers can't take the whole cache;
//! one lease is always granted when none is outstanding, so any block that fits can be written.
//!
//! # Eviction ([`policy`]): S3-FIFO per priority level
//! KV prefix traffic is dominated by one-off prompts that are stored and never read again, mixed
//! with a small set of hot prefixes (system prompts, shared documents) and parked sessions.
//! LRU lets every one-off scan flush the hot set and needs a list update under a lock on each
//! hit. S3-FIFO filters one-hit wonders in a small FIFO (10% of bytes) before they reach the main
//! FIFO, and a hit is only a saturating 2-bit atomic increment (no lock, no list move), so `get`
//! scales with readers. Its ghost queue readmits a recently evicted key straight into main.
//! One S3-FIFO per priority: Low is drained before Normal before High. Pinned blocks met by the
//! eviction scan are taken out of the queues and re-enter main when unpinned, so eviction stays
//! O(1) amortized however much is pinned.
//!
//! # Locks
//! Lock order: the state mutex (`Shared::state`) first, then DashMap shard locks, one at a time
//! and never held across another index call. `get`, `contains` and `longest_prefix` take shard
//! read locks only, never the state mutex. The eviction hook lock is never held with either.
//! The arena's extent lock comes after the state mutex and is held only for a few map
//! operations (a dropped view or lease takes it alone).
//!
//! # Accounts (tenants' quotas)
//! Each namespace may be assigned an account ([`DramTier::assign_account`]; 0, the default, has
//! no quota), and an account a byte quota ([`DramTier::set_account_quota`]). Every block counts
//! against its namespace's account. A reservation for a namespace whose account would pass its
//! quota first evicts that account's own blocks, oldest first (pinned ones are skipped), so a
//! tenant at its quota makes room out of its own blocks instead of everybody's; if its pinned
//! blocks fill the quota the reservation fails with `Capacity`.
//!
//! The accounts without a quota (tenants without `dram_bytes`, the operator's namespaces:
//! account 0) share what the quotas leave: while quotas reserve part of the capacity (less than
//! all of it), those accounts together are held to the rest — the *shared pool* — as one quota'd
//! account is to its quota: past it, their own oldest blocks go first; their pins take at most
//! `max_pinned_ratio` of the pool, and their writes in flight at most the lease budget's share of
//! it. So blocks of a tenant under its quota are only ever evicted by the node-wide policy when
//! the whole tier is full, which quotas summing to less than the capacity prevent — counted in
//! payload bytes, while a slot rounds its block up to a size class (up to a quarter more for
//! sizes between classes), so quotas and pool of such blocks need that much headroom. With no
//! quota set, the pool is the whole tier and the node-wide policy alone decides. Set quotas
//! before blocks arrive (the node does, at start): blocks stored while no pool existed are not
//! in its order, and the pool can't evict them.
//!
//! # Demotion hook
//! [`DramTier::set_eviction_hook`] is where the NVMe tier (G3) receives demoted blocks: the hook
//! is called with each evicted block while the state mutex is still held, so the receiver can make
//! the block findable before any reader misses it here; the block's bytes are then owned by
//! whoever holds the `StoredBlock` (they no longer count against this tier). The hook must not
//! block nor call into this tier: hand the block to a bounded queue and drop it when it is full.

mod policy;
mod region;
mod slab;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dashmap::DashMap;
use kvtier_proto::{BlockKey, FrameHeader, NamespaceId, TierId};
use parking_lot::{Mutex, RwLock};

use policy::{Entries, Item, Place, Policy, View, MAX_FREQ};
use region::{Arena, SharedSlot, SlotBuf};
use slab::{slot_size, Slab};

pub use region::{Region, RegionMode};

pub use crate::error::ServerError;

/// A block's key in the index (its namespace and key).
pub type IndexKey = kvtier_proto::ScopedKey;

pub use kvtier_proto::Priority;

#[derive(Debug, Clone)]
pub struct DramConfig {
    pub capacity_bytes: u64,
    /// Pinned bytes may not exceed this fraction of capacity (sessions can't starve the prefix
    /// cache). Clamped to 0..=1. Default: 0.9.
    pub max_pinned_ratio: f64,
}

impl DramConfig {
    /// A tier of `capacity_bytes` with the default pin ratio.
    pub fn new(capacity_bytes: u64) -> Self {
        DramConfig { capacity_bytes, max_pinned_ratio: 0.9 }
    }
}

/// How the tier's memory is provided and how writers' leases are bounded. Kept apart from
/// [`DramConfig`] so existing `DramConfig { .. }` literals keep compiling.
#[derive(Debug, Clone)]
pub struct DramOptions {
    /// What backs the region. Default: [`RegionMode::Anonymous`].
    pub region: RegionMode,
    /// Address space beyond the capacity for slots the budget no longer counts but readers or
    /// revoked leases still hold, and for fragmentation (see [`region`]); only touched when used.
    /// Default (`None`): an eighth of the capacity, at least twice min(capacity, 64 MiB).
    pub headroom_bytes: Option<u64>,
    /// How long a lease may stay open before it is revoked. Default: 30 s.
    pub lease_ttl: Duration,
    /// Most bytes of slots leased at once (one lease is always granted when none is
    /// outstanding). Default (`None`): half the capacity.
    pub max_leased_bytes: Option<u64>,
    /// Fault in the capacity's pages in the background at start (see [`Arena::prefault`]).
    /// Default: false.
    pub prefault: bool,
}

impl DramOptions {
    /// The default headroom of a tier of `capacity` bytes: an eighth of it, at least twice
    /// min(capacity, 64 MiB).
    pub fn default_headroom(capacity: u64) -> u64 {
        (capacity / 8).max(2 * capacity.min(64 << 20))
    }
}

impl Default for DramOptions {
    fn default() -> Self {
        DramOptions {
            region: RegionMode::Anonymous,
            headroom_bytes: None,
            lease_ttl: Duration::from_secs(30),
            max_leased_bytes: None,
            prefault: false,
        }
    }
}

/// A stored block: its verified frame header and a zero-copy view of its payload in the slab.
#[derive(Debug, Clone)]
pub struct StoredBlock {
    pub header: FrameHeader,
    pub payload: Bytes,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InsertOutcome {
    Inserted,
    AlreadyPresent,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct DramStats {
    pub capacity_bytes: u64,
    /// Sum of payload_len of indexed blocks.
    pub resident_bytes: u64,
    /// Bytes of slab slots the tier owns (in use + free + lent to writers); always <= capacity.
    pub allocated_bytes: u64,
    /// Sum of slot bytes of blocks with pin count > 0.
    pub pinned_bytes: u64,
    pub blocks: u64,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    pub inserts: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    /// Leases outstanding (reserved, not yet committed, dropped nor revoked).
    pub leases: u64,
    /// Slot bytes of outstanding leases (part of `allocated_bytes`).
    pub leased_bytes: u64,
    /// Leases revoked at their deadline, since start.
    pub leases_expired: u64,
    /// Bytes mapped for the region (capacity + headroom).
    pub region_bytes: u64,
    /// Bytes of the region in slots: `allocated_bytes` plus slots held by readers of evicted
    /// blocks and by holders of revoked leases.
    pub region_used_bytes: u64,
}

/// Called with each block evicted from DRAM (see the module doc, "Demotion hook"), with the
/// tier's lock held: it must not block, nor call back into the tier.
pub type EvictionHook = Arc<dyn Fn(IndexKey, StoredBlock) + Send + Sync>;

/// Called with the keys one reservation evicted from DRAM (under the tier's lock: keep it short
/// and non-blocking). Unlike [`EvictionHook`] it holds no block, so it never delays a slot's reuse.
pub type EvictionObserver = Arc<dyn Fn(&[IndexKey]) + Send + Sync>;

fn view_of(buf: &SharedSlot, len: u64) -> Bytes {
    buf.view(len as usize)
}

/// An index entry. `pins` and `place` change only under the state mutex.
struct Entry {
    id: u64,
    header: FrameHeader,
    buf: SharedSlot,
    level: usize,
    freq: AtomicU8,
    pins: u32,
    place: Place,
    /// The account its bytes count against (see the module doc, "Accounts").
    account: u32,
}

/// What an outstanding lease holds: its slot's size against the lease budget, its payload
/// bytes against its account's quota.
struct OpenLease {
    size: usize,
    account: u32,
    len: u64,
}

/// The least of the shared pool's share of the lease budget: one same-node store request's
/// bytes (the client sends at most 8 MiB with its checksums after), so a small pool still takes
/// a whole request.
const POOL_MIN_LEASE_SHARE: u64 = 8 << 20;

/// What [`Shared::evict_oldest_of`] met at the front of an account's order.
enum Evicted {
    Block,
    Pinned,
    /// Removed or replaced since it was queued (or nothing queued).
    Stale,
}

/// One account's bytes, and with a quota (or in the shared pool while quotas are set), its
/// blocks oldest first (stale items are skipped).
#[derive(Default)]
struct Account {
    resident: u64,
    /// Payload bytes of its open leases (writes in flight): they count against its quota as
    /// resident bytes do, so concurrent writers cannot carry it past its quota between
    /// their reservations and their commits.
    in_flight: u64,
    blocks: u64,
    /// Slot bytes of its pinned blocks: with a quota, at most `max_pinned_ratio` of it (as the
    /// node's pins are of the capacity), so its pins leave it room to write.
    pinned: u64,
    quota: Option<u64>,
    order: VecDeque<(IndexKey, u64)>,
}

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    evictions: AtomicU64,
    inserts: AtomicU64,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
    // Mirrors of the state, published under the state mutex.
    resident: AtomicU64,
    allocated: AtomicU64,
    pinned: AtomicU64,
    blocks: AtomicU64,
    leases: AtomicU64,
    leased: AtomicU64,
    leases_expired: AtomicU64,
}

struct State {
    slab: Slab,
    policy: Policy,
    resident: u64,
    pinned: u64,
    blocks: u64,
    next_id: u64,
    /// Outstanding leases by (deadline, id).
    leases: BTreeMap<(Instant, u64), OpenLease>,
    leased: u64,
    accounts: HashMap<u32, Account>,
    /// Bytes the accounts' quotas reserve (their sum).
    reserved: u64,
    /// Keys evicted by the reservation under way, for the eviction observer.
    evicted: Vec<IndexKey>,
}

struct Shared {
    arena: Arc<Arena>,
    capacity: u64,
    max_pinned: u64,
    /// `max_pinned_ratio`: also the share of a tenant's `dram_bytes` quota it may pin.
    pinned_ratio: f64,
    lease_ttl: Duration,
    max_leased: u64,
    index: DashMap<IndexKey, Entry>,
    state: Mutex<State>,
    counters: Counters,
    hook: RwLock<Option<EvictionHook>>,
    /// Told the keys each reservation evicted (KV events), after the demotion hook.
    observer: RwLock<Option<EvictionObserver>>,
    /// The account of each namespace that has one.
    ns_accounts: RwLock<HashMap<NamespaceId, u32>>,
}

/// The index as the policy sees it.
struct IndexAccess<'a>(&'a DashMap<IndexKey, Entry>);

impl Entries for IndexAccess<'_> {
    fn view(&self, key: &IndexKey, id: u64) -> Option<View> {
        let e = self.0.get(key)?;
        (e.id == id).then(|| View { pinned: e.pins > 0, freq: e.freq.load(Ordering::Relaxed) })
    }
    fn set_place(&mut self, key: &IndexKey, place: Place) {
        if let Some(mut e) = self.0.get_mut(key) {
            e.place = place;
        }
    }
    fn set_freq(&mut self, key: &IndexKey, freq: u8) {
        if let Some(e) = self.0.get(key) {
            e.freq.store(freq, Ordering::Relaxed);
        }
    }
}

/// PutStart..PutEnd: an exclusively owned, not-yet-visible slot of exactly `len` bytes (the
/// slot itself may be a larger size class), valid until its deadline. Dropping it without commit
/// returns the slot to the tier (see the module doc, "Leases").
pub struct Lease {
    shared: Arc<Shared>,
    buf: Option<SlotBuf>,
    len: usize,
    /// Its key in `State::leases`.
    key: (Instant, u64),
}

/// The bytes of the slot (its size class) a payload of `len` bytes takes: what a lease of it
/// counts against the tier's lease budget.
pub fn slot_bytes(len: usize) -> u64 {
    slab::slot_size(len) as u64
}

/// The former name of [`Lease`].
pub type SlotWriter = Lease;

impl Lease {
    /// Exactly `len` bytes.
    pub fn buf_mut(&mut self) -> &mut [u8] {
        match self.buf.as_mut() {
            Some(b) => &mut b.as_mut_slice()[..self.len],
            None => &mut [],
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// After this the lease is revoked and its commit fails.
    pub fn deadline(&self) -> Instant {
        self.key.0
    }

    /// Where the slot lies in [`DramTier::region`] (for a one-sided mover that writes it).
    pub fn offset(&self) -> Option<usize> {
        self.buf.as_ref().map(SlotBuf::offset)
    }
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("len", &self.len)
            .field("slot", &self.buf.as_ref().map(SlotBuf::size))
            .field("deadline", &self.key.0)
            .finish()
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            let mut st = self.shared.state.lock();
            if self.shared.end_lease(&mut st, self.key) {
                st.slab.put_free(buf);
            } else {
                // Revoked: the budget already let go of it; the extent goes back to the arena.
                drop(buf);
            }
            self.shared.publish(&st);
        }
    }
}

/// The DRAM tier. `Send + Sync`; share it behind an `Arc` or by reference.
pub struct DramTier {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for DramTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DramTier").field("stats", &self.stats()).finish()
    }
}

impl Shared {
    /// Mirrors the state into the atomics and gauges. Call with the state mutex held.
    fn publish(&self, st: &State) {
        let c = &self.counters;
        c.resident.store(st.resident, Ordering::Relaxed);
        c.allocated.store(st.slab.allocated(), Ordering::Relaxed);
        c.pinned.store(st.pinned, Ordering::Relaxed);
        c.blocks.store(st.blocks, Ordering::Relaxed);
        c.leases.store(st.leases.len() as u64, Ordering::Relaxed);
        c.leased.store(st.leased, Ordering::Relaxed);
        ::metrics::gauge!("kvtier_tier_resident_bytes", "tier" => TierId::Dram.as_str()).set(st.resident as f64);
        ::metrics::gauge!("kvtier_tier_allocated_bytes", "tier" => TierId::Dram.as_str())
            .set(st.slab.allocated() as f64);
        ::metrics::gauge!("kvtier_tier_pinned_bytes", "tier" => TierId::Dram.as_str()).set(st.pinned as f64);
        ::metrics::gauge!("kvtier_tier_blocks", "tier" => TierId::Dram.as_str()).set(st.blocks as f64);
        ::metrics::gauge!("kvtier_dram_leases").set(st.leases.len() as f64);
        ::metrics::gauge!("kvtier_dram_leased_bytes").set(st.leased as f64);
    }

    /// Ends an outstanding lease (commit or drop); false if it was revoked.
    fn end_lease(&self, st: &mut State, key: (Instant, u64)) -> bool {
        match st.leases.remove(&key) {
            Some(open) => {
                st.leased = st.leased.saturating_sub(open.size as u64);
                Self::release_in_flight(st, &open);
                true
            }
            None => false,
        }
    }

    fn release_in_flight(st: &mut State, open: &OpenLease) {
        if let Some(a) = st.accounts.get_mut(&open.account) {
            a.in_flight = a.in_flight.saturating_sub(open.len);
        }
    }

    /// Revokes every lease whose deadline is before `now`: its bytes leave the budget and the
    /// lease quota (its holder still owns the slot until it drops the lease).
    fn reap(&self, st: &mut State, now: Instant) -> usize {
        let mut n = 0;
        while let Some(entry) = st.leases.first_entry() {
            if entry.key().0 >= now {
                break;
            }
            let open = entry.remove();
            st.leased = st.leased.saturating_sub(open.size as u64);
            Self::release_in_flight(st, &open);
            st.slab.forget(open.size);
            n += 1;
        }
        if n > 0 {
            self.counters.leases_expired.fetch_add(n as u64, Ordering::Relaxed);
            ::metrics::counter!("kvtier_dram_leases_expired_total").increment(n as u64);
        }
        n
    }

    /// Takes `key` out of the index and the policy. Returns its buffer and header.
    fn unindex(&self, st: &mut State, key: &IndexKey) -> Option<(SharedSlot, FrameHeader)> {
        let (_, e) = self.index.remove(key)?;
        st.policy.forget(e.level, e.place, e.buf.size() as u64, &IndexAccess(&self.index));
        st.resident = st.resident.saturating_sub(e.header.payload_len);
        if let Some(a) = st.accounts.get_mut(&e.account) {
            a.resident = a.resident.saturating_sub(e.header.payload_len);
            a.blocks = a.blocks.saturating_sub(1);
        }
        st.blocks = st.blocks.saturating_sub(1);
        if e.pins > 0 {
            st.pinned = st.pinned.saturating_sub(e.buf.size() as u64);
            if let Some(a) = st.accounts.get_mut(&e.account) {
                a.pinned = a.pinned.saturating_sub(e.buf.size() as u64);
            }
        }
        Some((e.buf, e.header))
    }

    /// A slot of exactly `size` bytes within the budget, evicting as needed. Evicted blocks go
    /// to `demoted` when a hook is set.
    fn obtain(
        &self,
        st: &mut State,
        size: usize,
        hook: bool,
        demoted: &mut Vec<(IndexKey, StoredBlock)>,
    ) -> Result<SlotBuf, ServerError> {
        if let Some(b) = st.slab.take_free(size) {
            return Ok(b);
        }
        st.slab.release_free_until_fits(size);
        if let Some(b) = Self::alloc_or_defragment(st, size) {
            return Ok(b);
        }
        loop {
            let Some(victim) = st.policy.evict(&mut IndexAccess(&self.index)) else {
                let why = if st.slab.fits(size) {
                    "no free extent of the region is large enough (fragmented, or held by readers of evicted blocks)"
                } else {
                    "no evictable block frees them"
                };
                return Err(ServerError::Capacity(format!(
                    "dram tier: no slot of {size} bytes: {why} ({} of {} bytes pinned)",
                    st.pinned, self.capacity
                )));
            };
            let Some((buf, header)) = self.unindex(st, &victim.key) else { continue };
            self.counters.evictions.fetch_add(1, Ordering::Relaxed);
            ::metrics::counter!("kvtier_tier_evictions_total", "tier" => TierId::Dram.as_str()).increment(1);
            st.evicted.push(victim.key);
            if hook {
                demoted.push((victim.key, StoredBlock { header, payload: view_of(&buf, header.payload_len) }));
            }
            match buf.try_unwrap() {
                Ok(v) if v.size() == size => return Ok(v),
                Ok(v) => {
                    st.slab.forget(v.size());
                    drop(v);
                }
                Err(shared) => st.slab.forget(shared.size()),
            }
            if let Some(b) = Self::alloc_or_defragment(st, size) {
                return Ok(b);
            }
        }
    }

    /// The shared pool's bytes (see the module doc, "Accounts"): the capacity the quotas leave,
    /// while they reserve some of it and less than all; `None` otherwise (no pool rule).
    fn pool_limit(&self, st: &State) -> Option<u64> {
        (st.reserved > 0 && st.reserved < self.capacity).then(|| self.capacity - st.reserved)
    }

    /// Whether `account` has no quota, so shares the pool.
    fn pooled(st: &State, account: u32) -> bool {
        st.accounts.get(&account).is_none_or(|a| a.quota.is_none())
    }

    /// `what` of every account in the pool, summed.
    fn pool_usage(st: &State, what: impl Fn(&Account) -> u64) -> u64 {
        st.accounts.values().filter(|a| a.quota.is_none()).map(what).sum()
    }

    /// For an `account` in the shared pool: brings the pool to `size` bytes below its limit,
    /// counting its writes in flight, by evicting its accounts' blocks, oldest first (pinned ones
    /// stay). Its writes in flight may take at most the lease budget's share of the pool.
    fn make_room_in_pool(
        &self,
        st: &mut State,
        account: u32,
        size: u64,
        hook: bool,
        demoted: &mut Vec<(IndexKey, StoredBlock)>,
    ) -> Result<(), ServerError> {
        let Some(pool) = self.pool_limit(st) else { return Ok(()) };
        if !Self::pooled(st, account) {
            return Ok(());
        }
        let what = "the DRAM the tenants without a dram_bytes quota share (the capacity less the quotas)";
        if size > pool {
            return Err(ServerError::Capacity(format!(
                "dram tier: a block of {size} bytes is larger than {what}: {pool}"
            )));
        }
        let in_flight = Self::pool_usage(st, |a| a.in_flight);
        // The pool's share of the lease budget, and at least one same-node store request's worth
        // (a client's batch, held uncommitted until its checksums come) where the pool holds it.
        let lease_share = ((self.max_leased as u128 * pool as u128 / self.capacity.max(1) as u128) as u64)
            .max(POOL_MIN_LEASE_SHARE.min(pool));
        if in_flight > 0 && in_flight + size > lease_share {
            return Err(ServerError::Capacity(format!(
                "dram tier: writes in flight ({in_flight} bytes) leave no room for another {size} in the share of \
                 the lease budget of {what} ({lease_share} of {pool} bytes)"
            )));
        }
        // Per account, its blocks met pinned in this call: one whose every queued block was met
        // pinned is passed over (its pinned blocks keep their old ids, so it would otherwise
        // be picked again and again while another account's blocks could go).
        let mut pinned_in: HashMap<u32, usize> = HashMap::new();
        loop {
            let used = Self::pool_usage(st, |a| a.resident + a.in_flight);
            if used + size <= pool {
                return Ok(());
            }
            // The pooled account whose oldest block is the oldest (ids grow with each commit).
            let oldest = st
                .accounts
                .iter()
                .filter(|(n, a)| a.quota.is_none() && pinned_in.get(n).copied().unwrap_or(0) < a.order.len())
                .filter_map(|(n, a)| a.order.front().map(|(_, id)| (*id, *n)))
                .min();
            let Some((_, victim_account)) = oldest else {
                return Err(ServerError::Capacity(format!(
                    "dram tier: {what} ({pool} bytes) is held by pinned blocks ({} bytes) and writes in flight \
                     ({in_flight} bytes); another {size} would pass it",
                    Self::pool_usage(st, |a| a.pinned)
                )));
            };
            match self.evict_oldest_of(st, victim_account, hook, demoted) {
                Evicted::Pinned => *pinned_in.entry(victim_account).or_default() += 1,
                Evicted::Block | Evicted::Stale => {}
            }
        }
    }

    /// Evicts `account`'s oldest block unless it is pinned (then moved to the back of the
    /// account's order) or gone already.
    fn evict_oldest_of(
        &self,
        st: &mut State,
        account: u32,
        hook: bool,
        demoted: &mut Vec<(IndexKey, StoredBlock)>,
    ) -> Evicted {
        let Some((key, id)) = st.accounts.get_mut(&account).and_then(|a| a.order.pop_front()) else {
            return Evicted::Stale;
        };
        let pinned = match self.index.get(&key) {
            Some(e) if e.id == id => e.pins > 0,
            _ => return Evicted::Stale, // removed or replaced since
        };
        if pinned {
            if let Some(a) = st.accounts.get_mut(&account) {
                a.order.push_back((key, id));
            }
            return Evicted::Pinned;
        }
        let Some((buf, header)) = self.unindex(st, &key) else { return Evicted::Stale };
        self.counters.evictions.fetch_add(1, Ordering::Relaxed);
        ::metrics::counter!("kvtier_tier_evictions_total", "tier" => TierId::Dram.as_str()).increment(1);
        ::metrics::counter!("kvtier_quota_evictions_total").increment(1);
        st.evicted.push(key);
        if hook {
            demoted.push((key, StoredBlock { header, payload: view_of(&buf, header.payload_len) }));
        }
        match buf.try_unwrap() {
            Ok(v) => st.slab.put_free(v),
            Err(shared) => st.slab.forget(shared.size()),
        }
        Evicted::Block
    }

    /// Brings `account` to `size` bytes below its quota, counting its writes in flight, by
    /// evicting its own blocks, oldest first (pinned ones stay). Evicted blocks go to `demoted`
    /// when a hook is set.
    fn make_room_in_account(
        &self,
        st: &mut State,
        account: u32,
        size: u64,
        hook: bool,
        demoted: &mut Vec<(IndexKey, StoredBlock)>,
    ) -> Result<(), ServerError> {
        let Some(quota) = st.accounts.get(&account).and_then(|a| a.quota) else { return Ok(()) };
        if size > quota {
            return Err(ServerError::Capacity(format!(
                "dram tier: a block of {size} bytes is larger than the tenant's dram_bytes quota of {quota}"
            )));
        }
        // Writes in flight alone leave no room: refused before any of its blocks is evicted.
        let in_flight = st.accounts.get(&account).map_or(0, |a| a.in_flight);
        if in_flight + size > quota {
            return Err(ServerError::Capacity(format!(
                "dram tier: the tenant's writes in flight ({in_flight} bytes) leave no room for another {size} under \
                 its dram_bytes quota of {quota}"
            )));
        }
        let mut pinned_seen = 0usize;
        loop {
            let Some(a) = st.accounts.get_mut(&account) else { return Ok(()) };
            if a.resident + a.in_flight + size <= quota {
                return Ok(());
            }
            // Every block left was met pinned: the quota is held by pins and writes in flight.
            if pinned_seen >= a.order.len() {
                return Err(ServerError::Capacity(format!(
                    "dram tier: the tenant's dram_bytes quota of {quota} is held by its pinned blocks ({} bytes) \
                     and its writes in flight ({} bytes); another {size} would pass it",
                    a.pinned, a.in_flight
                )));
            }
            match self.evict_oldest_of(st, account, hook, demoted) {
                Evicted::Block => pinned_seen = 0,
                Evicted::Pinned => pinned_seen += 1,
                Evicted::Stale => {}
            }
        }
    }

    /// A fresh slot if the budget allows: first as things are, then with every cached free slot
    /// handed back so that neighbouring extents coalesce.
    fn alloc_or_defragment(st: &mut State, size: usize) -> Option<SlotBuf> {
        if !st.slab.fits(size) {
            return None;
        }
        st.slab.try_alloc(size).or_else(|| {
            st.slab.release_all_free();
            st.slab.try_alloc(size)
        })
    }
}

impl DramTier {
    /// A tier over an anonymous region with the default [`DramOptions`].
    ///
    /// # Panics
    /// If the region's address space cannot be mapped; [`DramTier::with_options`] returns that
    /// as an error instead.
    pub fn new(cfg: DramConfig) -> DramTier {
        match Self::with_options(cfg, DramOptions::default()) {
            Ok(t) => t,
            Err(e) => panic!("{e}"),
        }
    }

    /// A tier whose region is `capacity + headroom` bytes of `opts.region` memory, touched only
    /// as slots are written. `Config` if the region cannot be mapped.
    pub fn with_options(cfg: DramConfig, opts: DramOptions) -> Result<DramTier, ServerError> {
        let ratio = if cfg.max_pinned_ratio.is_nan() { 0.9 } else { cfg.max_pinned_ratio.clamp(0.0, 1.0) };
        let capacity = cfg.capacity_bytes;
        let headroom = opts.headroom_bytes.unwrap_or_else(|| DramOptions::default_headroom(capacity));
        let as_usize = |v: u64| {
            usize::try_from(v).map_err(|_| ServerError::Config(format!("dram: {v} bytes do not fit the address space")))
        };
        let arena = Arena::new(as_usize(capacity)?, as_usize(headroom)?, opts.region)?;
        if opts.prefault {
            Arena::prefault(&arena);
        }
        let shared = Shared {
            arena: Arc::clone(&arena),
            capacity,
            max_pinned: (capacity as f64 * ratio) as u64,
            pinned_ratio: ratio,
            lease_ttl: opts.lease_ttl,
            max_leased: opts.max_leased_bytes.unwrap_or(capacity / 2),
            index: DashMap::new(),
            state: Mutex::new(State {
                slab: Slab::new(arena, capacity),
                policy: Policy::default(),
                resident: 0,
                pinned: 0,
                blocks: 0,
                next_id: 0,
                leases: BTreeMap::new(),
                leased: 0,
                // Account 0 (namespaces without a tenant's account) is counted like the others.
                accounts: HashMap::from([(0, Account::default())]),
                reserved: 0,
                evicted: Vec::new(),
            }),
            counters: Counters::default(),
            hook: RwLock::new(None),
            observer: RwLock::new(None),
            ns_accounts: RwLock::new(HashMap::new()),
        };
        Ok(DramTier { shared: Arc::new(shared) })
    }

    /// The one region every slot is carved from: register it once ([`Region::as_ptr`],
    /// [`Region::len`]) or share it ([`Region::fd`]).
    pub fn region(&self) -> &Region {
        self.shared.arena.region()
    }

    /// The most slot bytes open leases may hold at once ([`DramOptions::max_leased_bytes`]).
    pub fn lease_budget(&self) -> u64 {
        self.shared.max_leased
    }

    /// Gives `account` (not 0) a quota of `bytes` resident (see the module doc, "Accounts").
    /// Set quotas before blocks arrive: blocks already held are counted, not queued for it.
    pub fn set_account_quota(&self, account: u32, bytes: u64) {
        let mut st = self.shared.state.lock();
        st.accounts.entry(account).or_default().quota = (account != 0).then_some(bytes);
        st.reserved = st.accounts.values().filter_map(|a| a.quota).sum();
    }

    /// Counts the blocks of `ns` stored from now on against `account` (0: none).
    pub fn assign_account(&self, ns: NamespaceId, account: u32) {
        if account != 0 {
            self.shared.state.lock().accounts.entry(account).or_default();
            self.shared.ns_accounts.write().insert(ns, account);
        }
    }

    /// Payload bytes resident for `account`.
    pub fn account_resident(&self, account: u32) -> u64 {
        self.shared.state.lock().accounts.get(&account).map_or(0, |a| a.resident)
    }

    /// `account`'s share of the tier as a tenant sees it: its quota as the capacity (the tier's
    /// without one), its resident bytes, blocks and pinned bytes.
    pub fn account_stats(&self, account: u32) -> crate::tiers::TierStats {
        let capacity = self.stats().capacity_bytes;
        let st = self.shared.state.lock();
        let a = st.accounts.get(&account);
        crate::tiers::TierStats {
            capacity_bytes: a.and_then(|a| a.quota).unwrap_or(capacity),
            resident_bytes: a.map_or(0, |a| a.resident),
            blocks: a.map_or(0, |a| a.blocks),
            pinned_bytes: a.map_or(0, |a| a.pinned),
            ..Default::default()
        }
    }

    /// Sets (or clears) the observer told the keys of evicted blocks (see [`EvictionObserver`]).
    pub fn set_eviction_observer(&self, observer: Option<EvictionObserver>) {
        *self.shared.observer.write() = observer;
    }

    /// Sets (or clears) the hook that receives evicted blocks: the NVMe demotion point.
    pub fn set_eviction_hook(&self, hook: Option<EvictionHook>) {
        *self.shared.hook.write() = hook;
    }

    /// PutStart: leases a slot for a payload of `len` bytes, evicting unpinned blocks as needed.
    /// `TooLarge` if the slot for `len` bytes (its size class) exceeds the capacity; `Capacity`
    /// if nothing evictable frees enough or the leased bytes would pass their limit. Revokes
    /// leases past their deadline first.
    pub fn reserve(&self, len: usize) -> Result<Lease, ServerError> {
        self.reserve_at(len, Instant::now())
    }

    /// [`DramTier::reserve`] for a block of namespace `ns`: if its account would pass its quota,
    /// its own oldest blocks make room first (see the module doc, "Accounts").
    pub fn reserve_for(&self, ns: &NamespaceId, len: usize) -> Result<Lease, ServerError> {
        let account = self.shared.ns_accounts.read().get(ns).copied().unwrap_or(0);
        self.reserve_in(account, len, Instant::now())
    }

    /// [`DramTier::reserve`] at `now` (the lease's deadline is `now + lease_ttl`).
    pub fn reserve_at(&self, len: usize, now: Instant) -> Result<Lease, ServerError> {
        self.reserve_in(0, len, now)
    }

    fn reserve_in(&self, account: u32, len: usize, now: Instant) -> Result<Lease, ServerError> {
        let size = slot_size(len);
        if size as u64 > self.shared.capacity {
            return Err(ServerError::TooLarge { len: len as u64, capacity: self.shared.capacity });
        }
        let hook = self.shared.hook.read().clone();
        let mut demoted = Vec::new();
        let mut st = self.shared.state.lock();
        self.shared.reap(&mut st, now);
        if st.leased > 0 && st.leased + size as u64 > self.shared.max_leased {
            let e = ServerError::Capacity(format!(
                "dram tier: {} bytes in {} open leases; another {size} would pass the limit of {}",
                st.leased,
                st.leases.len(),
                self.shared.max_leased
            ));
            self.shared.publish(&st);
            return Err(e);
        }
        let res = self
            .shared
            .make_room_in_account(&mut st, account, len as u64, hook.is_some(), &mut demoted)
            .and_then(|()| self.shared.make_room_in_pool(&mut st, account, len as u64, hook.is_some(), &mut demoted))
            .and_then(|()| self.shared.obtain(&mut st, size, hook.is_some(), &mut demoted));
        let lease = res.map(|buf| {
            st.next_id += 1;
            let key = (now + self.shared.lease_ttl, st.next_id);
            st.leases.insert(key, OpenLease { size, account, len: len as u64 });
            if let Some(a) = st.accounts.get_mut(&account) {
                a.in_flight += len as u64;
            }
            st.leased += size as u64;
            Lease { shared: Arc::clone(&self.shared), buf: Some(buf), len, key }
        });
        self.shared.publish(&st);
        // Under the lock, so no reader sees an evicted block in neither place.
        if let Some(hook) = &hook {
            for (key, block) in demoted.drain(..) {
                hook(key, block);
            }
        }
        if !st.evicted.is_empty() {
            if let Some(observe) = self.shared.observer.read().as_ref() {
                observe(&st.evicted);
            }
            st.evicted.clear();
        }
        drop(st);
        lease
    }

    /// Revokes the leases whose deadline is before `now` (see the module doc, "Leases");
    /// returns how many. [`DramTier::reserve`] does this too.
    pub fn reap_leases(&self, now: Instant) -> usize {
        let mut st = self.shared.state.lock();
        let n = self.shared.reap(&mut st, now);
        self.shared.publish(&st);
        n
    }

    /// PutEnd: makes a filled slot visible under `(header.namespace, header.key)`. The caller
    /// has verified the payload checksum. If the key is already present, keeps the existing
    /// block, recycles the slot and returns `AlreadyPresent`. `Capacity` if the lease passed its
    /// deadline (nothing is published).
    pub fn commit(&self, slot: Lease, header: FrameHeader, priority: Priority) -> Result<InsertOutcome, ServerError> {
        self.commit_at(slot, header, priority, Instant::now())
    }

    /// [`DramTier::commit`] at `now`.
    pub fn commit_at(
        &self,
        mut slot: Lease,
        header: FrameHeader,
        priority: Priority,
        now: Instant,
    ) -> Result<InsertOutcome, ServerError> {
        let len = slot.len;
        let lease = slot.key;
        let Some(buf) = slot.buf.take() else {
            return Err(ServerError::InvalidRequest("slot already committed".into()));
        };
        drop(slot);
        let key = (header.namespace, header.key);
        let mut st = self.shared.state.lock();
        if lease.0 < now {
            self.shared.reap(&mut st, now);
        }
        if !self.shared.end_lease(&mut st, lease) {
            self.shared.publish(&st);
            drop(st);
            drop(buf);
            return Err(ServerError::Capacity(format!(
                "dram tier: the lease on {len} bytes expired before its commit; nothing stored"
            )));
        }
        if header.payload_len != len as u64 || self.shared.index.contains_key(&key) {
            st.slab.put_free(buf);
            self.shared.publish(&st);
            if header.payload_len != len as u64 {
                return Err(ServerError::InvalidRequest(format!(
                    "header says {} payload bytes, slot holds {len}",
                    header.payload_len
                )));
            }
            return Ok(InsertOutcome::AlreadyPresent);
        }
        st.next_id += 1;
        let id = st.next_id;
        let level = priority as usize;
        let place = st.policy.insert(level, Item { key, id, bytes: buf.size() as u64 });
        let account = self.shared.ns_accounts.read().get(&header.namespace).copied().unwrap_or(0);
        let pooled = self.shared.pool_limit(&st).is_some();
        if let Some(a) = st.accounts.get_mut(&account) {
            a.resident += header.payload_len;
            a.blocks += 1;
            // In age order where something may evict it by account: its quota, or the pool's.
            if a.quota.is_some() || pooled {
                // Items of blocks gone another way (evicted by the node, purged, removed) are
                // dropped once they outnumber the live ones (before this block is indexed).
                if a.order.len() as u64 > 2 * a.blocks + 1024 {
                    let index = &self.shared.index;
                    a.order.retain(|(k, i)| index.get(k).is_some_and(|e| e.id == *i));
                }
                a.order.push_back((key, id));
            }
        }
        let entry =
            Entry { id, header, buf: SharedSlot::freeze(buf), level, freq: AtomicU8::new(0), pins: 0, place, account };
        self.shared.index.insert(key, entry);
        st.resident += header.payload_len;
        st.blocks += 1;
        self.shared.publish(&st);
        drop(st);
        let c = &self.shared.counters;
        c.inserts.fetch_add(1, Ordering::Relaxed);
        c.bytes_in.fetch_add(header.payload_len, Ordering::Relaxed);
        ::metrics::counter!("kvtier_tier_bytes_in_total", "tier" => TierId::Dram.as_str())
            .increment(header.payload_len);
        Ok(InsertOutcome::Inserted)
    }

    /// reserve (for the block's namespace: its account's quota, or the shared pool) + copy +
    /// commit. A key already present is not reserved for again.
    pub fn insert(
        &self,
        header: FrameHeader,
        payload: &[u8],
        priority: Priority,
    ) -> Result<InsertOutcome, ServerError> {
        if payload.len() as u64 != header.payload_len {
            return Err(ServerError::InvalidRequest(format!(
                "header says {} payload bytes, got {}",
                header.payload_len,
                payload.len()
            )));
        }
        if self.contains(&header.namespace, &header.key) {
            return Ok(InsertOutcome::AlreadyPresent);
        }
        let mut slot = self.reserve_for(&header.namespace, payload.len())?;
        slot.buf_mut().copy_from_slice(payload);
        self.commit(slot, header, priority)
    }

    /// A hit returns a zero-copy view of the slot and bumps the block's frequency.
    pub fn get(&self, ns: &NamespaceId, key: &BlockKey) -> Option<StoredBlock> {
        let c = &self.shared.counters;
        let found = self.shared.index.get(&(*ns, *key)).map(|e| {
            let _ = e.freq.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |f| (f < MAX_FREQ).then_some(f + 1));
            StoredBlock { header: e.header, payload: view_of(&e.buf, e.header.payload_len) }
        });
        match &found {
            Some(b) => {
                c.hits.fetch_add(1, Ordering::Relaxed);
                c.bytes_out.fetch_add(b.payload.len() as u64, Ordering::Relaxed);
                ::metrics::counter!("kvtier_tier_hits_total", "tier" => TierId::Dram.as_str()).increment(1);
                ::metrics::counter!("kvtier_tier_bytes_out_total", "tier" => TierId::Dram.as_str())
                    .increment(b.payload.len() as u64);
            }
            None => self.count_miss(),
        }
        found
    }

    /// A read that found nothing here, asked by a caller that checked the index first (so
    /// [`Self::get`] never ran to count it).
    pub fn count_miss(&self) {
        self.shared.counters.misses.fetch_add(1, Ordering::Relaxed);
        ::metrics::counter!("kvtier_tier_misses_total", "tier" => TierId::Dram.as_str()).increment(1);
    }

    /// The block for the node's own use (made durable for a park, forwarded to a peer, handed
    /// off): a zero-copy view as [`Self::get`] gives, counted nowhere and leaving its eviction
    /// state alone — a tier's hits are what it served.
    pub fn get_for_node(&self, ns: &NamespaceId, key: &BlockKey) -> Option<StoredBlock> {
        let e = self.shared.index.get(&(*ns, *key))?;
        Some(StoredBlock { header: e.header, payload: view_of(&e.buf, e.header.payload_len) })
    }

    /// Presence without counting a hit or changing eviction state.
    pub fn contains(&self, ns: &NamespaceId, key: &BlockKey) -> bool {
        self.shared.index.contains_key(&(*ns, *key))
    }

    /// Raises a held block to `priority` where it sits lower (a copy this node cached or relayed,
    /// of a key it has come to own): queued again at that level as if just inserted, in its
    /// account's order too. A pinned block out of the queues keeps its place until unpinned (it
    /// goes back at its new level). True if it was raised.
    pub fn raise_priority(&self, ns: &NamespaceId, key: &BlockKey, priority: Priority) -> bool {
        let k = (*ns, *key);
        let level = priority as usize;
        let mut st = self.shared.state.lock();
        let Some((old_level, place, size, account)) =
            self.shared.index.get(&k).map(|e| (e.level, e.place, e.buf.size() as u64, e.account))
        else {
            return false;
        };
        if old_level >= level || place == Place::Out {
            return false;
        }
        st.next_id += 1;
        let id = st.next_id;
        // The old queue item turns stale once the entry's id changes; a parked (pinned) entry has
        // no queue item and is put back into main at its level when unpinned.
        if let Some(mut e) = self.shared.index.get_mut(&k) {
            e.id = id;
            e.level = level;
        }
        let parked = place == Place::Parked;
        st.policy.forget(old_level, place, size, &IndexAccess(&self.shared.index));
        let new_place = if parked {
            st.policy.park(level);
            Place::Parked
        } else {
            st.policy.insert(level, Item { key: k, id, bytes: size })
        };
        if let Some(mut e) = self.shared.index.get_mut(&k) {
            e.place = new_place;
        }
        let pooled = self.shared.pool_limit(&st).is_some();
        if let Some(a) = st.accounts.get_mut(&account) {
            if a.quota.is_some() || pooled {
                a.order.push_back((k, id));
            }
        }
        true
    }

    /// Every block held, by namespace and key (a snapshot; blocks come and go meanwhile).
    pub fn keys(&self) -> Vec<(NamespaceId, BlockKey)> {
        self.shared.index.iter().map(|e| *e.key()).collect()
    }

    /// [`DramTier::contains`] as a closure that doesn't keep the tier alive (false once it is
    /// gone): for another tier's observers.
    pub fn weak_contains(&self) -> impl Fn(&NamespaceId, &BlockKey) -> bool + Send + Sync + 'static {
        let shared = Arc::downgrade(&self.shared);
        move |ns, key| shared.upgrade().is_some_and(|s| s.index.contains_key(&(*ns, *key)))
    }

    /// A block's header without counting a hit or changing eviction state.
    pub fn header(&self, ns: &NamespaceId, key: &BlockKey) -> Option<FrameHeader> {
        self.shared.index.get(&(*ns, *key)).map(|e| e.header)
    }

    /// Number of leading keys present (stops at the first absent one). No counters, no
    /// frequency bump.
    pub fn longest_prefix(&self, ns: &NamespaceId, keys: &[BlockKey]) -> usize {
        keys.iter().take_while(|k| self.contains(ns, k)).count()
    }

    /// All or nothing: increments the pin count of every key (a key listed twice is pinned
    /// twice). `MissingBlocks` if any is absent, `Capacity` if the newly pinned bytes would pass
    /// the pinned limit; nothing is pinned on error.
    pub fn pin(&self, ns: &NamespaceId, keys: &[BlockKey]) -> Result<(), ServerError> {
        let index = &self.shared.index;
        let mut st = self.shared.state.lock();
        let mut missing = Vec::new();
        let mut newly = 0u64;
        // Per account (a namespace's blocks all have its namespace's).
        let mut newly_of: HashMap<u32, u64> = HashMap::new();
        let mut seen = HashSet::new();
        for (i, k) in keys.iter().enumerate() {
            match index.get(&(*ns, *k)) {
                None => missing.push(i as u32),
                Some(e) => {
                    if e.pins == 0 && seen.insert(*k) {
                        newly += e.buf.size() as u64;
                        *newly_of.entry(e.account).or_default() += e.buf.size() as u64;
                    }
                }
            }
        }
        if !missing.is_empty() {
            return Err(ServerError::MissingBlocks { missing, missing_tail: false });
        }
        if st.pinned + newly > self.shared.max_pinned {
            return Err(ServerError::Capacity(format!(
                "pinning {newly} more bytes would pass the pinned limit ({} of {} bytes pinned, limit {})",
                st.pinned, self.shared.capacity, self.shared.max_pinned
            )));
        }
        if let Some(pool) = self.shared.pool_limit(&st) {
            let more: u64 = newly_of.iter().filter(|(a, _)| Shared::pooled(&st, **a)).map(|(_, b)| b).sum();
            let pinned = Shared::pool_usage(&st, |a| a.pinned);
            let limit = (pool as f64 * self.shared.pinned_ratio) as u64;
            if more > 0 && pinned + more > limit {
                return Err(ServerError::Capacity(format!(
                    "pinning {more} more bytes would pass the pinned share of the DRAM the tenants without a \
                     dram_bytes quota share ({pinned} of {pool} bytes pinned, limit {limit})"
                )));
            }
        }
        for (account, more) in &newly_of {
            let Some(a) = st.accounts.get(account) else { continue };
            let Some(quota) = a.quota else { continue };
            let limit = (quota as f64 * self.shared.pinned_ratio) as u64;
            if a.pinned + more > limit {
                return Err(ServerError::Capacity(format!(
                    "pinning {more} more bytes would pass the tenant's pinned share of its dram_bytes quota \
                     ({} of {quota} bytes pinned, limit {limit})",
                    a.pinned
                )));
            }
        }
        for k in keys {
            if let Some(mut e) = index.get_mut(&(*ns, *k)) {
                if e.pins == 0 {
                    st.pinned += e.buf.size() as u64;
                    if let Some(a) = st.accounts.get_mut(&e.account) {
                        a.pinned += e.buf.size() as u64;
                    }
                }
                e.pins = e.pins.saturating_add(1);
            }
        }
        self.shared.publish(&st);
        Ok(())
    }

    /// Decrements pin counts (saturating; absent keys ignored). A block whose count reaches 0
    /// becomes evictable again.
    pub fn unpin(&self, ns: &NamespaceId, keys: &[BlockKey]) {
        let mut st = self.shared.state.lock();
        for k in keys {
            let key = (*ns, *k);
            let Some(mut e) = self.shared.index.get_mut(&key) else { continue };
            if e.pins == 0 {
                continue;
            }
            e.pins -= 1;
            if e.pins == 0 {
                st.pinned = st.pinned.saturating_sub(e.buf.size() as u64);
                if let Some(a) = st.accounts.get_mut(&e.account) {
                    a.pinned = a.pinned.saturating_sub(e.buf.size() as u64);
                }
                if e.place == Place::Parked {
                    // The policy does not touch the index here, so holding `e` is fine.
                    st.policy.unpark(e.level, Item { key, id: e.id, bytes: e.buf.size() as u64 });
                    e.place = Place::Main;
                }
            }
        }
        self.shared.publish(&st);
    }

    /// Removes an unpinned block; false if absent or pinned.
    pub fn remove(&self, ns: &NamespaceId, key: &BlockKey) -> bool {
        let mut st = self.shared.state.lock();
        if !self.remove_locked(&mut st, &(*ns, *key)) {
            return false;
        }
        self.shared.publish(&st);
        true
    }

    fn remove_locked(&self, st: &mut State, key: &IndexKey) -> bool {
        let pinned = match self.shared.index.get(key) {
            None => return false,
            Some(e) => e.pins > 0,
        };
        if pinned {
            return false;
        }
        match self.shared.unindex(st, key) {
            Some((buf, _)) => {
                st.slab.recycle(buf);
                true
            }
            None => false,
        }
    }

    /// Removes every unpinned block of a namespace; returns their keys.
    pub fn purge_namespace(&self, ns: &NamespaceId) -> Vec<BlockKey> {
        let mut st = self.shared.state.lock();
        let keys: Vec<IndexKey> =
            self.shared.index.iter().filter(|e| e.key().0 == *ns && e.pins == 0).map(|e| *e.key()).collect();
        let removed: Vec<BlockKey> =
            keys.iter().filter(|k| self.remove_locked(&mut st, k)).map(|(_, key)| *key).collect();
        self.shared.publish(&st);
        removed
    }

    /// Removes every block of a namespace that is gone (unregistered), pinned ones too: a pin
    /// a data-plane lease holds on one would otherwise keep it indexed after the namespace went,
    /// to be served again if the namespace is registered anew and demoted to disk once evicted.
    /// The lease's later let-go finds nothing to unpin. Returns their keys.
    pub fn forget_namespace(&self, ns: &NamespaceId) -> Vec<BlockKey> {
        let mut st = self.shared.state.lock();
        let keys: Vec<IndexKey> = self.shared.index.iter().filter(|e| e.key().0 == *ns).map(|e| *e.key()).collect();
        let mut removed = Vec::with_capacity(keys.len());
        for k in &keys {
            if let Some((buf, _)) = self.shared.unindex(&mut st, k) {
                st.slab.recycle(buf);
                removed.push(k.1);
            }
        }
        self.shared.publish(&st);
        removed
    }

    pub fn stats(&self) -> DramStats {
        let c = &self.shared.counters;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DramStats {
            capacity_bytes: self.shared.capacity,
            resident_bytes: r(&c.resident),
            allocated_bytes: r(&c.allocated),
            pinned_bytes: r(&c.pinned),
            blocks: r(&c.blocks),
            hits: r(&c.hits),
            misses: r(&c.misses),
            evictions: r(&c.evictions),
            inserts: r(&c.inserts),
            bytes_in: r(&c.bytes_in),
            bytes_out: r(&c.bytes_out),
            leases: r(&c.leases),
            leased_bytes: r(&c.leased),
            leases_expired: r(&c.leases_expired),
            region_bytes: self.shared.arena.region().len() as u64,
            region_used_bytes: self.shared.arena.used_bytes(),
        }
    }
}

#[cfg(test)]
mod tests;
