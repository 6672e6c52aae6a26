//! The node's G1: one [`PagePool`] per device — its pages are that GPU's reserved share — and the
//! [`PeerPolicy`] over them, carried out by the pool itself.
//!
//! When a device's engine saves a new block and the device's own pool has no free page, the node
//! asks the policy (with `now` passed in):
//!
//! - [`Decision::Local`]: the own pool has room.
//! - [`Decision::Reclaim`]: the device lent pages of its share to peers; it evicts the least
//!   recently used of them (spilled like any eviction) and uses the page. A lender's share stays
//!   its own: lending never makes it give up its own blocks.
//! - [`Decision::Borrow`]: the page is reserved in the lender's pool for the requester; the
//!   engine's bytes go there over the link ([`crate::Transfer::Peer`]), and the fill counts against
//!   the link's budget.
//! - [`Decision::Decline`]: recompute instead of borrowing — the own pool evicts its least
//!   recently used block into the spill target (G2) as a one-device pool does. Counted by reason.
//!
//! A load of a block held in another device's pool (borrowed, or that device's own) is a peer
//! copy, counted against the link too ([`NodePool::pin_for_load`]). A borrowed page that leaves
//! the lender's pool (evicted, reclaimed, aborted) goes back to the lender's share.
//!
//! The policy is kept in step with the pools by [`NodePool::reconcile`]: each pool counts the
//! pages it holds per owner ([`PagePool::held_by`]), and every change since the last call is
//! released or committed. A one-device node never asks the policy (it has no peer) and behaves as
//! its one [`PagePool`].
//!
//! Limits: a block is held once per node (content-addressed keys), so two devices' engines share
//! it; a borrower's pages in a lender's pool leave only when the lender reclaims them (the
//! borrower's own pressure evicts from its own pool); a pair of devices without a declared link
//! still copies between them (through the host on CUDA) but that traffic is not monitored.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use kvtier_proto::{BlockKey, NamespaceId, ScopedKey};

use super::{PagePool, PendingSpill, PoolChange, PoolConfig, PoolStats, Spill};
use crate::device::{Device, DeviceOrdinal, DeviceRange};
use crate::error::{AgentError, Result};
use crate::policy::{BorrowConfig, Decision, DeclineReason, PeerPolicy};

/// Peer access between two devices of the node over a link of `bytes_per_sec` (NVLink, PCIe; a
/// modelled one on the host backend).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeLink {
    pub a: DeviceOrdinal,
    pub b: DeviceOrdinal,
    pub bytes_per_sec: u64,
}

/// What one device lent (monotonic unless said otherwise).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LenderStats {
    /// Pages of its pool holding peers' blocks now (a gauge).
    pub lent_pages: u64,
    /// Pages peers borrowed from it.
    pub borrows: u64,
    /// Bytes copied into those pages when they were borrowed.
    pub borrowed_bytes: u64,
}

/// Borrowing on the node: what was lent, what was declined and why, what crossed the links.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BorrowStats {
    /// By lender, every device of the node.
    pub lenders: BTreeMap<DeviceOrdinal, LenderStats>,
    /// Lent pages a lender took back for its own blocks.
    pub reclaims: u64,
    /// Borrows declined (the block evicted or recomputed instead), by reason.
    pub declined_link_budget: u64,
    pub declined_no_peer_capacity: u64,
    pub declined_no_peer_access: u64,
    /// Bytes the agent moved over each link (borrow fills, loads of blocks held on the other
    /// device), by (lower, higher) ordinal.
    pub link_bytes: BTreeMap<(DeviceOrdinal, DeviceOrdinal), u64>,
}

impl BorrowStats {
    /// Every borrow declined, whatever the reason.
    pub fn declines(&self) -> u64 {
        self.declined_link_budget + self.declined_no_peer_capacity + self.declined_no_peer_access
    }
}

fn link_key(a: DeviceOrdinal, b: DeviceOrdinal) -> (DeviceOrdinal, DeviceOrdinal) {
    (a.min(b), a.max(b))
}

/// The G1 pools of a node's devices, borrowing between them.
///
/// ```
/// use std::sync::Arc;
/// use std::time::Instant;
/// use kvtier_agent::pool::{Capacity, MemorySpill, NodeLink, NodePool, PoolConfig};
/// use kvtier_agent::policy::BorrowConfig;
/// use kvtier_agent::HostDevice;
/// use kvtier_proto::{BlockKey, NamespaceId};
///
/// let devs = vec![Arc::new(HostDevice::new(0, 1 << 20)), Arc::new(HostDevice::new(1, 1 << 20))];
/// let cfg = PoolConfig::new(256).with_capacity(Capacity::Bytes(256)); // one page each
/// let link = NodeLink { a: 0, b: 1, bytes_per_sec: 1 << 30 };
/// let mut node = NodePool::new(devs, MemorySpill::default(), cfg, BorrowConfig::default(), &[link]).unwrap();
/// let (ns, now) = (NamespaceId([1; 16]), Instant::now());
/// let own = node.reserve(0, &ns, &BlockKey([1; 32]), now).unwrap().unwrap();
/// assert_eq!(own.buf.device(), 0);
/// let lent = node.reserve(0, &ns, &BlockKey([2; 32]), now).unwrap().unwrap();
/// assert_eq!(lent.buf.device(), 1, "device 0 is full: the page is borrowed from device 1");
/// assert_eq!(node.borrow_stats().lenders[&1].lent_pages, 1);
/// ```
pub struct NodePool<D: Device, S: Spill> {
    pools: Vec<PagePool<D, S>>,
    ordinals: Vec<DeviceOrdinal>,
    policy: PeerPolicy,
    /// Whether any link was declared (else the policy is never asked).
    linked: bool,
    page_bytes: usize,
    /// Pages of (owner, pool) the policy was last told of.
    accounted: HashMap<(DeviceOrdinal, DeviceOrdinal), usize>,
    stats: BorrowStats,
}

impl<D: Device, S: Spill + Clone> NodePool<D, S> {
    /// A pool of `config` on every device (each the same size rule), and the policy over them:
    /// each device's share is exactly its pool, `links` are the pairs with peer access.
    pub fn new(
        devices: Vec<Arc<D>>,
        spill: S,
        config: PoolConfig,
        borrow: BorrowConfig,
        links: &[NodeLink],
    ) -> Result<Self> {
        if devices.is_empty() {
            return Err(AgentError::Config("a node needs at least one device".into()));
        }
        let ordinals: Vec<DeviceOrdinal> = devices.iter().map(|d| d.ordinal()).collect();
        let mut policy = PeerPolicy::new(borrow)?;
        let mut pools = Vec::with_capacity(devices.len());
        for d in devices {
            let pool = PagePool::new(d.clone(), spill.clone(), config.clone())?;
            policy.add_gpu_share(d.ordinal(), (pool.pages() * pool.page_bytes()) as u64)?;
            pools.push(pool);
        }
        for l in links {
            policy.add_link(l.a, l.b, l.bytes_per_sec)?;
        }
        let stats = BorrowStats {
            lenders: ordinals.iter().map(|o| (*o, LenderStats::default())).collect(),
            link_bytes: links.iter().map(|l| (link_key(l.a, l.b), 0)).collect(),
            ..BorrowStats::default()
        };
        Ok(NodePool {
            pools,
            ordinals,
            policy,
            linked: !links.is_empty(),
            page_bytes: config.page_bytes,
            accounted: HashMap::new(),
            stats,
        })
    }
}

impl<D: Device, S: Spill> NodePool<D, S> {
    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    /// The node's devices, in the order they were given.
    pub fn ordinals(&self) -> &[DeviceOrdinal] {
        &self.ordinals
    }

    /// One device's pool.
    pub fn pool(&self, device: DeviceOrdinal) -> Option<&PagePool<D, S>> {
        self.ordinals.iter().position(|o| *o == device).map(|i| &self.pools[i])
    }

    /// The policy as the pools last told it (shares, what was lent, links' use).
    pub fn policy(&self) -> &PeerPolicy {
        &self.policy
    }

    fn index(&self, device: DeviceOrdinal) -> Result<usize> {
        self.ordinals
            .iter()
            .position(|o| *o == device)
            .ok_or_else(|| AgentError::Config(format!("device {device} is not on this node")))
    }

    /// Whether a device's pool holds `k` already (committed, or a save filling it).
    pub fn holds(&self, k: &ScopedKey) -> bool {
        self.holder(k).is_some()
    }

    /// The pool holding a key (resident or filling).
    fn holder(&self, k: &ScopedKey) -> Option<usize> {
        self.pools.iter().position(|p| p.holds(k))
    }

    /// [`PagePool::reserve`] for a block of `requester`'s engine: the page comes from its own
    /// pool, a reclaimed lent page, or a peer's pool (borrowed), as the policy decides at `now`
    /// (module doc). `Ok(None)` when some pool of the node already holds the key.
    pub fn reserve(
        &mut self,
        requester: DeviceOrdinal,
        ns: &NamespaceId,
        key: &BlockKey,
        now: Instant,
    ) -> Result<Option<DeviceRange>> {
        let k = (*ns, *key);
        if let Some(p) = self.holder(&k) {
            return self.pools[p].reserve(ns, key);
        }
        let r = self.index(requester)?;
        let target = self.place(r, now)?;
        let got = self.pools[target].reserve_for(ns, key, requester);
        self.reconcile(now);
        got
    }

    /// Which pool a new page for device `r` comes from; reclaims a lent page first when the
    /// policy says so.
    fn place(&mut self, r: usize, now: Instant) -> Result<usize> {
        if self.pools[r].free_pages() > 0 || !self.linked {
            return Ok(r);
        }
        let me = self.ordinals[r];
        match self.policy.decide(me, self.page_bytes as u64, now)? {
            Decision::Local => Ok(r),
            Decision::Reclaim => {
                if self.pools[r].evict_lent()? {
                    self.stats.reclaims += 1;
                }
                Ok(r)
            }
            Decision::Borrow { from, .. } => {
                let l = self.index(from)?;
                if self.pools[l].free_pages() == 0 {
                    // The policy and the pools disagree (never expected): keep the lender's
                    // blocks, evict our own.
                    self.stats.declined_no_peer_capacity += 1;
                    return Ok(r);
                }
                if let Some(s) = self.stats.lenders.get_mut(&from) {
                    s.borrows += 1;
                }
                Ok(l)
            }
            Decision::Decline(why) => {
                match why {
                    DeclineReason::LinkBudget { .. } => self.stats.declined_link_budget += 1,
                    DeclineReason::NoPeerCapacity => self.stats.declined_no_peer_capacity += 1,
                    DeclineReason::NoPeerAccess => self.stats.declined_no_peer_access += 1,
                }
                Ok(r)
            }
        }
    }

    /// Tells the policy what the pools hold now: pages that left a pool are released (a
    /// borrowed one back to its lender's share), then pages taken are committed — a borrowed
    /// one's fill counted against the link at `now`. Called after every reservation.
    fn reconcile(&mut self, now: Instant) {
        self.release_freed();
        let pb = self.page_bytes as u64;
        let mut taken = Vec::new();
        for (p, pool) in self.pools.iter().enumerate() {
            let lender = self.ordinals[p];
            for &owner in &self.ordinals {
                let was = self.accounted.get(&(owner, lender)).copied().unwrap_or(0);
                if pool.held_by(owner) > was {
                    taken.push((owner, lender, pool.held_by(owner) - was));
                }
            }
        }
        for (owner, lender, pages) in taken {
            let bytes = pages as u64 * pb;
            let d = if owner == lender { Decision::Local } else { Decision::Borrow { from: lender, link_use: 0.0 } };
            if self.policy.commit(owner, bytes, &d, now).is_err() {
                continue; // retried on the next call
            }
            *self.accounted.entry((owner, lender)).or_default() += pages;
            if owner != lender {
                if let Some(s) = self.stats.lenders.get_mut(&lender) {
                    s.borrowed_bytes += bytes;
                }
                *self.stats.link_bytes.entry(link_key(owner, lender)).or_default() += bytes;
            }
        }
    }

    /// The first half of [`NodePool::reconcile`]: pages that left a pool go back to the policy.
    fn release_freed(&mut self) {
        let pb = self.page_bytes as u64;
        for (p, pool) in self.pools.iter().enumerate() {
            let lender = self.ordinals[p];
            for &owner in &self.ordinals {
                let was = self.accounted.get(&(owner, lender)).copied().unwrap_or(0);
                let held = pool.held_by(owner);
                if held < was && self.policy.release(owner, lender, (was - held) as u64 * pb).is_ok() {
                    self.accounted.insert((owner, lender), held);
                }
            }
        }
    }

    /// [`PagePool::commit`] in whichever pool holds the reservation.
    pub fn commit(&mut self, ns: &NamespaceId, key: &BlockKey) -> Result<()> {
        let p = self.holder(&(*ns, *key)).ok_or(AgentError::NotResident)?;
        self.pools[p].commit(ns, key)
    }

    /// [`PagePool::abort`]; a borrowed page goes back to its lender's share.
    pub fn abort(&mut self, ns: &NamespaceId, key: &BlockKey) -> Result<()> {
        let p = self.holder(&(*ns, *key)).ok_or(AgentError::NotResident)?;
        let r = self.pools[p].abort(ns, key);
        self.release_freed();
        r
    }

    /// [`PagePool::pin_for_load`] for `requester`'s engine, in whichever pool holds the block. A
    /// page on another device is copied over the link: its bytes count against the link at
    /// `now`.
    pub fn pin_for_load(
        &mut self,
        requester: DeviceOrdinal,
        ns: &NamespaceId,
        key: &BlockKey,
        now: Instant,
    ) -> Result<Option<DeviceRange>> {
        let k = (*ns, *key);
        let Some(p) = self.pools.iter().position(|pool| pool.contains(ns, key)) else {
            // Counted as the requester's miss.
            let r = self.index(requester)?;
            return self.pools[r].pin_for_load(ns, key);
        };
        let got = self.pools[p].pin_for_load(&k.0, &k.1)?;
        let holder = self.ordinals[p];
        if got.is_some() && holder != requester {
            let bytes = self.page_bytes as u64;
            if self.policy.record_link_traffic(requester, holder, now, bytes).is_ok() {
                *self.stats.link_bytes.entry(link_key(requester, holder)).or_default() += bytes;
            }
        }
        Ok(got)
    }

    /// [`PagePool::unpin`] in whichever pool holds the block.
    pub fn unpin(&mut self, ns: &NamespaceId, key: &BlockKey) -> Result<u32> {
        let p = self.holder(&(*ns, *key)).ok_or(AgentError::NotResident)?;
        self.pools[p].unpin(ns, key)
    }

    /// [`PagePool::copy_out`] from whichever pool holds the block.
    pub fn copy_out(&mut self, ns: &NamespaceId, key: &BlockKey) -> Result<Option<Vec<u8>>> {
        match self.holder(&(*ns, *key)) {
            Some(p) => self.pools[p].copy_out(ns, key),
            None => Ok(None),
        }
    }

    /// [`PagePool::mark_clean`] in whichever pool holds the block.
    pub fn mark_clean(&mut self, ns: &NamespaceId, key: &BlockKey) -> bool {
        self.pools.iter_mut().any(|p| p.mark_clean(ns, key))
    }

    /// Every key the node's pools hold.
    pub fn keys(&self) -> Vec<ScopedKey> {
        self.pools.iter().flat_map(|p| p.keys()).collect()
    }

    /// Every pool's changes since the last call, and whether some were lost.
    pub fn take_changes(&mut self) -> (Vec<PoolChange>, bool) {
        let mut all = Vec::new();
        let mut lost = false;
        for p in &mut self.pools {
            let (c, l) = p.take_changes();
            all.extend(c);
            lost |= l;
        }
        (all, lost)
    }

    /// Every pool's copied-out evictions (deferred spills).
    pub fn take_spills(&mut self) -> Vec<PendingSpill> {
        self.pools.iter_mut().flat_map(|p| p.take_spills()).collect()
    }

    /// [`PagePool::spill_finished`] on the pool that evicted it.
    pub fn spill_finished(&mut self, s: &PendingSpill, ok: bool) {
        if let Ok(p) = self.index(s.device) {
            self.pools[p].spill_finished(s, ok);
        }
    }

    /// The pools' counters, summed over the node.
    pub fn stats(&self) -> PoolStats {
        self.pools.iter().map(PagePool::stats).fold(PoolStats::default(), |a, b| PoolStats {
            pages: a.pages + b.pages,
            resident: a.resident + b.resident,
            pinned: a.pinned + b.pinned,
            hits: a.hits + b.hits,
            misses: a.misses + b.misses,
            inserts: a.inserts + b.inserts,
            evictions: a.evictions + b.evictions,
            spills: a.spills + b.spills,
            spilled_bytes: a.spilled_bytes + b.spilled_bytes,
            encoded_spills: a.encoded_spills + b.encoded_spills,
            raw_fallbacks: a.raw_fallbacks + b.raw_fallbacks,
            clean_drops: a.clean_drops + b.clean_drops,
            spill_errors: a.spill_errors + b.spill_errors,
        })
    }

    /// Each link's use at `now` as its monitor sees it (0.0 idle, 1.0 saturated; borrowing
    /// stops at the budget), by (lower, higher) ordinal.
    pub fn link_use(&self, now: Instant) -> BTreeMap<(DeviceOrdinal, DeviceOrdinal), f64> {
        self.stats.link_bytes.keys().filter_map(|&(a, b)| Some(((a, b), self.policy.link_use(a, b, now)?))).collect()
    }

    /// Borrowing so far, with each lender's lent pages now.
    pub fn borrow_stats(&self) -> BorrowStats {
        let mut s = self.stats.clone();
        for (p, pool) in self.pools.iter().enumerate() {
            let lender = self.ordinals[p];
            let lent: usize = self.ordinals.iter().filter(|o| **o != lender).map(|o| pool.held_by(*o)).sum();
            s.lenders.entry(lender).or_default().lent_pages = lent as u64;
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::pool::{Capacity, MemorySpill};
    use crate::HostDevice;

    const PAGE: usize = 256;

    fn node(pages: &[usize], bytes_per_sec: u64) -> NodePool<HostDevice, MemorySpill> {
        let devs = pages.iter().enumerate().map(|(i, p)| Arc::new(HostDevice::new(i as u32, p * PAGE))).collect();
        let n = pages.len() as u32;
        let links: Vec<NodeLink> =
            (0..n).flat_map(|a| (a + 1..n).map(move |b| NodeLink { a, b, bytes_per_sec })).collect();
        let cfg = PoolConfig::new(PAGE).with_capacity(Capacity::FractionOfFree(1.0));
        NodePool::new(devs, MemorySpill::default(), cfg, BorrowConfig::default(), &links).unwrap()
    }

    fn k(n: u8) -> BlockKey {
        BlockKey([n; 32])
    }

    /// Reserves and commits `key` for `dev`; the device its page is on.
    fn put(n: &mut NodePool<HostDevice, MemorySpill>, dev: u32, key: u8, now: Instant) -> u32 {
        let ns = NamespaceId([1; 16]);
        let page = n.reserve(dev, &ns, &k(key), now).unwrap().expect("a new key gets a page");
        n.commit(&ns, &k(key)).unwrap();
        page.buf.device()
    }

    #[test]
    fn declines_while_the_link_is_busy_and_borrows_again_once_the_window_passed() {
        // 1000 B/s, 1 s window: 300 bytes of borrowing, one 256-byte page.
        let mut n = node(&[1, 4], 1000);
        let t = Instant::now();
        assert_eq!(put(&mut n, 0, 1, t), 0);
        assert_eq!(put(&mut n, 0, 2, t), 1, "borrowed");
        assert_eq!(put(&mut n, 0, 3, t), 0, "declined: the own pool evicts block 1");
        let s = n.borrow_stats();
        assert_eq!((s.declined_link_budget, s.lenders[&1].borrows, n.stats().evictions), (1, 1, 1));
        let spilled = n.pool(0).unwrap().spill_target().received();
        assert_eq!(spilled.iter().map(|b| b.key.1).collect::<Vec<_>>(), [k(1)], "block 1 went to G2");
        let later = t + Duration::from_secs(1);
        assert_eq!(put(&mut n, 0, 4, later), 1, "the window slid: borrowing resumes");
        assert_eq!(n.policy().borrowed(0, 1), 2 * PAGE as u64);
        assert_eq!(n.borrow_stats().link_bytes[&(0, 1)], 2 * PAGE as u64);
        // A key any pool holds is not placed again.
        let ns = NamespaceId([1; 16]);
        assert_eq!(n.reserve(1, &ns, &k(2), later).unwrap(), None);
        assert!(n.reserve(7, &ns, &k(9), later).is_err(), "a device not on the node");
    }

    #[test]
    fn one_device_never_asks_the_policy() {
        let mut n = node(&[2], 1);
        let t = Instant::now();
        for key in 0..5 {
            assert_eq!(put(&mut n, 0, key, t), 0);
        }
        assert_eq!(n.stats().evictions, 3);
        let s = n.borrow_stats();
        assert_eq!((s.declines(), s.reclaims, s.lenders[&0]), (0, 0, LenderStats::default()));
        assert_eq!(n.policy().share(0).unwrap(), (2 * PAGE as u64, 0));
    }

    #[test]
    fn a_node_is_validated() {
        let cfg = PoolConfig::new(PAGE).with_capacity(Capacity::Bytes(PAGE));
        let none: Vec<Arc<HostDevice>> = Vec::new();
        assert!(NodePool::new(none, MemorySpill::default(), cfg.clone(), BorrowConfig::default(), &[]).is_err());
        let two = || vec![Arc::new(HostDevice::new(0, 4096)), Arc::new(HostDevice::new(0, 4096))];
        let e = NodePool::new(two(), MemorySpill::default(), cfg.clone(), BorrowConfig::default(), &[]).err();
        assert!(matches!(e, Some(AgentError::Config(_))), "one ordinal twice");
        let devs = vec![Arc::new(HostDevice::new(0, 4096)), Arc::new(HostDevice::new(1, 4096))];
        let bad = NodeLink { a: 0, b: 5, bytes_per_sec: 1 };
        assert!(NodePool::new(devs, MemorySpill::default(), cfg, BorrowConfig::default(), &[bad]).is_err());
    }
}
