//! Borrowing HBM from peer GPUs, as a pure policy: plain data, `now` passed in, no I/O, no clock
//! (tested like quinn-proto). The agent asks [`PeerPolicy::decide`] and applies the answer with
//! [`PeerPolicy::commit`]; copies it makes over a link are reported with
//! [`PeerPolicy::record_link_traffic`].
//!
//! Rules:
//!
//! 1. Each GPU reserves a share of its HBM ([`BorrowConfig::with_reserved_fraction`], 20% by
//!    default, or exactly the pool the agent carved: [`PeerPolicy::add_gpu_share`]) as the node's
//!    shared page pool. A GPU's own pages come out of its own share first ([`Decision::Local`]).
//!    **Its share is its own:** when what it lent to peers is what it is short of, it takes lent
//!    pages back ([`Decision::Reclaim`]) before borrowing or giving up its own pages, so lending
//!    never starves the lender.
//! 2. When its share is full it borrows from a peer it has peer access to (a link): the peer
//!    with the most free share, then the least loaded link, then the lowest ordinal.
//! 3. A link's use is the bytes moved over it in a sliding window ([`LinkMonitor`]) divided by
//!    what the link can move in that window. **If borrowing would push that use over the budget
//!    (30% by default), the borrow is declined** — the engine recomputes instead — so borrowed
//!    capacity never starves the engine's own collective traffic on the link. Exactly at the
//!    budget is allowed.
//! 4. Nothing is overcommitted: a borrow needs the whole amount free in one peer's share.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use crate::device::DeviceOrdinal;
use crate::error::{AgentError, Result};

/// Settings of the policy, each validated by [`PeerPolicy::new`].
#[derive(Debug, Clone, PartialEq)]
pub struct BorrowConfig {
    reserved_fraction: f64,
    link_budget: f64,
    window: Duration,
}

impl Default for BorrowConfig {
    fn default() -> Self {
        BorrowConfig { reserved_fraction: 0.2, link_budget: 0.3, window: Duration::from_secs(1) }
    }
}

impl BorrowConfig {
    /// The fraction of each GPU's HBM reserved for the shared pool, in (0, 1]. Default: 0.2.
    pub fn with_reserved_fraction(mut self, f: f64) -> Self {
        self.reserved_fraction = f;
        self
    }

    /// The largest fraction of a link's bandwidth borrowing may bring it to, in (0, 1].
    /// Default: 0.3.
    pub fn with_link_budget(mut self, f: f64) -> Self {
        self.link_budget = f;
        self
    }

    /// The bandwidth monitor's sliding window, above zero. Default: 1 s.
    pub fn with_window(mut self, w: Duration) -> Self {
        self.window = w;
        self
    }

    fn validate(&self) -> Result<()> {
        let unit = |v: f64| v > 0.0 && v <= 1.0;
        if !unit(self.reserved_fraction) {
            return Err(AgentError::Config(format!("reserved fraction {} not in (0, 1]", self.reserved_fraction)));
        }
        if !unit(self.link_budget) {
            return Err(AgentError::Config(format!("link budget {} not in (0, 1]", self.link_budget)));
        }
        if self.window.is_zero() {
            return Err(AgentError::Config("bandwidth window must be above zero".into()));
        }
        Ok(())
    }
}

/// Bytes moved over one link in a sliding window.
#[derive(Debug, Clone)]
pub struct LinkMonitor {
    bytes_per_sec: u64,
    window: Duration,
    samples: VecDeque<(Instant, u64)>,
}

impl LinkMonitor {
    pub fn new(bytes_per_sec: u64, window: Duration) -> Self {
        LinkMonitor { bytes_per_sec, window, samples: VecDeque::new() }
    }

    /// Drops samples that left the window: a sample at `t` counts while `now - t < window`.
    fn expire(&mut self, now: Instant) {
        while let Some(&(t, _)) = self.samples.front() {
            if now.saturating_duration_since(t) >= self.window {
                self.samples.pop_front();
            } else {
                break;
            }
        }
    }

    /// Records `bytes` moved at `now` (times must not go backwards; an earlier `now` counts as
    /// the latest one seen).
    pub fn record(&mut self, now: Instant, bytes: u64) {
        let now = self.samples.back().map_or(now, |&(t, _)| now.max(t));
        self.expire(now);
        self.samples.push_back((now, bytes));
    }

    /// Bytes moved in the window ending at `now`.
    pub fn bytes_in_window(&self, now: Instant) -> u64 {
        self.samples.iter().filter(|(t, _)| now.saturating_duration_since(*t) < self.window).map(|(_, b)| b).sum()
    }

    /// What the link can move in one window.
    pub fn capacity_per_window(&self) -> f64 {
        self.bytes_per_sec as f64 * self.window.as_secs_f64()
    }

    /// Use of the link at `now` if `extra` more bytes moved: 0.0 idle, 1.0 saturated.
    pub fn utilization_with(&self, now: Instant, extra: u64) -> f64 {
        let cap = self.capacity_per_window();
        if cap <= 0.0 {
            return f64::INFINITY;
        }
        (self.bytes_in_window(now) + extra) as f64 / cap
    }
}

/// What to do with a request for `bytes` of pool space.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// From the requester's own share.
    Local,
    /// From the requester's own share once pages it lent are given back: the caller evicts
    /// pages peers borrowed from it ([`PeerPolicy::release`] as they leave) and asks again.
    /// [`PeerPolicy::commit`] of it changes nothing.
    Reclaim,
    /// From `from`'s share, over a link that will be at `link_use` of its bandwidth.
    Borrow { from: DeviceOrdinal, link_use: f64 },
    /// Don't: recompute instead.
    Decline(DeclineReason),
}

/// Why a borrow was declined.
#[derive(Debug, Clone, PartialEq)]
pub enum DeclineReason {
    /// The requester has no peer access to any GPU.
    NoPeerAccess,
    /// No reachable peer has that much free share.
    NoPeerCapacity,
    /// Peers have room, but every such link would go past the budget; `best` is the lowest use
    /// any of them would reach.
    LinkBudget { best: f64 },
}

#[derive(Debug, Clone)]
struct Gpu {
    share: u64,
    own_used: u64,
    lent: u64,
}

impl Gpu {
    fn free(&self) -> u64 {
        self.share - self.own_used - self.lent
    }
}

fn link_key(a: DeviceOrdinal, b: DeviceOrdinal) -> (DeviceOrdinal, DeviceOrdinal) {
    (a.min(b), a.max(b))
}

/// The node's GPUs, their shares, their links and who borrowed what.
///
/// ```
/// use std::time::Instant;
/// use kvtier_agent::policy::{BorrowConfig, Decision, DeclineReason, PeerPolicy};
/// const GIB: u64 = 1 << 30;
/// let now = Instant::now();
/// let mut p = PeerPolicy::new(BorrowConfig::default()).unwrap();
/// p.add_gpu(3, 100 * GIB).unwrap(); // 20 GiB shares
/// p.add_gpu(7, 100 * GIB).unwrap();
/// p.add_link(3, 7, 100 * GIB).unwrap(); // 100 GiB/s: 30 GiB per 1 s window allowed
/// let d = p.decide(3, 20 * GIB, now).unwrap();
/// assert_eq!(d, Decision::Local);
/// p.commit(3, 20 * GIB, &d, now).unwrap();
/// assert!(matches!(p.decide(3, 10 * GIB, now).unwrap(), Decision::Borrow { from: 7, .. }));
/// p.record_link_traffic(3, 7, now, 25 * GIB).unwrap(); // the engine's own peer traffic
/// assert!(matches!(p.decide(3, 10 * GIB, now).unwrap(), Decision::Decline(DeclineReason::LinkBudget { .. })));
/// ```
#[derive(Debug, Clone)]
pub struct PeerPolicy {
    config: BorrowConfig,
    gpus: HashMap<DeviceOrdinal, Gpu>,
    links: HashMap<(DeviceOrdinal, DeviceOrdinal), LinkMonitor>,
    /// (borrower, lender) → bytes.
    borrowed: HashMap<(DeviceOrdinal, DeviceOrdinal), u64>,
}

impl PeerPolicy {
    pub fn new(config: BorrowConfig) -> Result<Self> {
        config.validate()?;
        Ok(PeerPolicy { config, gpus: HashMap::new(), links: HashMap::new(), borrowed: HashMap::new() })
    }

    /// Adds a GPU with `hbm_bytes` of memory; its share is `floor(hbm × reserved fraction)`.
    pub fn add_gpu(&mut self, gpu: DeviceOrdinal, hbm_bytes: u64) -> Result<()> {
        if self.gpus.contains_key(&gpu) {
            return Err(AgentError::Config(format!("GPU {gpu} added twice")));
        }
        let share = (hbm_bytes as f64 * self.config.reserved_fraction).floor() as u64;
        self.gpus.insert(gpu, Gpu { share: share.min(hbm_bytes), own_used: 0, lent: 0 });
        Ok(())
    }

    /// Adds a GPU whose share is exactly `share` bytes (the page pool the agent carved on it,
    /// whole pages), whatever the reserved fraction says.
    pub fn add_gpu_share(&mut self, gpu: DeviceOrdinal, share: u64) -> Result<()> {
        if self.gpus.contains_key(&gpu) {
            return Err(AgentError::Config(format!("GPU {gpu} added twice")));
        }
        self.gpus.insert(gpu, Gpu { share, own_used: 0, lent: 0 });
        Ok(())
    }

    /// Bytes of `gpu`'s share its peers hold now.
    pub fn lent(&self, gpu: DeviceOrdinal) -> u64 {
        self.gpus.get(&gpu).map_or(0, |g| g.lent)
    }

    /// Declares peer access between `a` and `b` over a link of `bytes_per_sec`.
    pub fn add_link(&mut self, a: DeviceOrdinal, b: DeviceOrdinal, bytes_per_sec: u64) -> Result<()> {
        if a == b || !self.gpus.contains_key(&a) || !self.gpus.contains_key(&b) {
            return Err(AgentError::Config(format!("link {a}-{b} needs two distinct known GPUs")));
        }
        if bytes_per_sec == 0 {
            return Err(AgentError::Config(format!("link {a}-{b} has no bandwidth")));
        }
        self.links.insert(link_key(a, b), LinkMonitor::new(bytes_per_sec, self.config.window));
        Ok(())
    }

    fn gpu(&self, g: DeviceOrdinal) -> Result<&Gpu> {
        self.gpus.get(&g).ok_or_else(|| AgentError::Config(format!("unknown GPU {g}")))
    }

    /// A GPU's reserved share and what is free in it.
    pub fn share(&self, gpu: DeviceOrdinal) -> Result<(u64, u64)> {
        let g = self.gpu(gpu)?;
        Ok((g.share, g.free()))
    }

    /// Use of the `a`–`b` link at `now` (0.0 idle, 1.0 saturated); `None` without peer access.
    pub fn link_use(&self, a: DeviceOrdinal, b: DeviceOrdinal, now: Instant) -> Option<f64> {
        self.links.get(&link_key(a, b)).map(|l| l.utilization_with(now, 0))
    }

    /// Where `bytes` for `requester` should come from at `now`. Changes nothing.
    pub fn decide(&self, requester: DeviceOrdinal, bytes: u64, now: Instant) -> Result<Decision> {
        let own = self.gpu(requester)?;
        if own.free() >= bytes {
            return Ok(Decision::Local);
        }
        if own.lent > 0 && own.free() + own.lent >= bytes {
            return Ok(Decision::Reclaim);
        }
        let mut reachable = false;
        let mut best_over: Option<f64> = None;
        let mut best: Option<(DeviceOrdinal, u64, f64)> = None;
        let mut peers: Vec<_> = self.gpus.iter().filter(|(p, _)| **p != requester).collect();
        peers.sort_by_key(|(p, _)| **p);
        for (&peer, g) in peers {
            let Some(link) = self.links.get(&link_key(requester, peer)) else { continue };
            reachable = true;
            if g.free() < bytes {
                continue;
            }
            let link_use = link.utilization_with(now, bytes);
            if link_use > self.config.link_budget {
                best_over = Some(best_over.map_or(link_use, |b: f64| b.min(link_use)));
                continue;
            }
            let better = match best {
                None => true,
                Some((_, free, u)) => g.free() > free || (g.free() == free && link_use < u),
            };
            if better {
                best = Some((peer, g.free(), link_use));
            }
        }
        Ok(match (best, best_over) {
            (Some((from, _, link_use)), _) => Decision::Borrow { from, link_use },
            (None, Some(best)) => Decision::Decline(DeclineReason::LinkBudget { best }),
            (None, None) if reachable => Decision::Decline(DeclineReason::NoPeerCapacity),
            (None, None) => Decision::Decline(DeclineReason::NoPeerAccess),
        })
    }

    /// Applies a decision taken by [`PeerPolicy::decide`] for the same request: takes the space
    /// and, for a borrow, counts the bytes that fill the peer's pages against the link at `now`.
    /// A decline or a reclaim changes nothing.
    pub fn commit(&mut self, requester: DeviceOrdinal, bytes: u64, decision: &Decision, now: Instant) -> Result<()> {
        match decision {
            Decision::Local => {
                let g = self
                    .gpus
                    .get_mut(&requester)
                    .ok_or_else(|| AgentError::Config(format!("unknown GPU {requester}")))?;
                if g.free() < bytes {
                    return Err(AgentError::OutOfMemory { requested: bytes as usize, free: g.free() as usize });
                }
                g.own_used += bytes;
            }
            Decision::Borrow { from, .. } => {
                self.gpu(requester)?;
                let g = self.gpus.get_mut(from).ok_or_else(|| AgentError::Config(format!("unknown GPU {from}")))?;
                if g.free() < bytes {
                    return Err(AgentError::OutOfMemory { requested: bytes as usize, free: g.free() as usize });
                }
                g.lent += bytes;
                *self.borrowed.entry((requester, *from)).or_default() += bytes;
                self.record_link_traffic(requester, *from, now, bytes)?;
            }
            Decision::Reclaim | Decision::Decline(_) => {}
        }
        Ok(())
    }

    /// Gives back space: from the requester's own share (`from == requester`) or borrowed from
    /// `from`. More than is held is refused and changes nothing.
    pub fn release(&mut self, requester: DeviceOrdinal, from: DeviceOrdinal, bytes: u64) -> Result<()> {
        if requester == from {
            let g =
                self.gpus.get_mut(&requester).ok_or_else(|| AgentError::Config(format!("unknown GPU {requester}")))?;
            if g.own_used < bytes {
                return Err(AgentError::Config(format!(
                    "GPU {requester} releases {bytes} bytes but uses {}",
                    g.own_used
                )));
            }
            g.own_used -= bytes;
            return Ok(());
        }
        let held = self.borrowed.get(&(requester, from)).copied().unwrap_or(0);
        if held < bytes {
            return Err(AgentError::Config(format!(
                "GPU {requester} returns {bytes} bytes to {from} but borrowed {held}"
            )));
        }
        let g = self.gpus.get_mut(&from).ok_or_else(|| AgentError::Config(format!("unknown GPU {from}")))?;
        g.lent -= bytes;
        if held == bytes {
            self.borrowed.remove(&(requester, from));
        } else {
            self.borrowed.insert((requester, from), held - bytes);
        }
        Ok(())
    }

    /// Bytes `borrower` holds in `lender`'s share.
    pub fn borrowed(&self, borrower: DeviceOrdinal, lender: DeviceOrdinal) -> u64 {
        self.borrowed.get(&(borrower, lender)).copied().unwrap_or(0)
    }

    /// Counts bytes moved over the `a`–`b` link at `now` (borrow fills, reads of borrowed pages,
    /// the engine's own peer traffic when the agent sees it).
    pub fn record_link_traffic(&mut self, a: DeviceOrdinal, b: DeviceOrdinal, now: Instant, bytes: u64) -> Result<()> {
        let l = self.links.get_mut(&link_key(a, b)).ok_or_else(|| AgentError::Config(format!("no link {a}-{b}")))?;
        l.record(now, bytes);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    /// A link that moves 100 GiB in the 1 s window: the 30% budget is 30 GiB.
    const BW: u64 = 100 * GIB;

    fn node(gpus: &[DeviceOrdinal]) -> PeerPolicy {
        let mut p = PeerPolicy::new(BorrowConfig::default()).unwrap();
        for &g in gpus {
            p.add_gpu(g, 100 * GIB).unwrap();
        }
        p
    }

    fn take(p: &mut PeerPolicy, g: DeviceOrdinal, bytes: u64, now: Instant) -> Decision {
        let d = p.decide(g, bytes, now).unwrap();
        p.commit(g, bytes, &d, now).unwrap();
        d
    }

    #[test]
    fn each_gpu_reserves_its_fraction_of_hbm() {
        let mut p = node(&[0]);
        assert_eq!(p.share(0).unwrap(), (20 * GIB, 20 * GIB));
        p.add_gpu(1, 10).unwrap();
        assert_eq!(p.share(1).unwrap(), (2, 2));
        assert!(matches!(p.add_gpu(1, 10), Err(AgentError::Config(_))));
        assert!(p.share(9).is_err());
    }

    #[test]
    fn own_share_first_then_the_peer_with_most_room() {
        let t = Instant::now();
        let mut p = node(&[3, 5, 7]);
        p.add_link(3, 5, BW).unwrap();
        p.add_link(3, 7, BW).unwrap();
        assert_eq!(take(&mut p, 3, 20 * GIB, t), Decision::Local);
        assert_eq!(take(&mut p, 5, 2 * GIB, t), Decision::Local);
        // GPU 3 is full; 7 has 20 GiB free, 5 has 18.
        let d = take(&mut p, 3, GIB, t);
        assert!(matches!(d, Decision::Borrow { from: 7, .. }), "{d:?}");
        assert_eq!(p.borrowed(3, 7), GIB);
        assert_eq!(p.share(7).unwrap().1, 19 * GIB);
        // Zero bytes never borrow.
        assert_eq!(p.decide(3, 0, t).unwrap(), Decision::Local);
    }

    #[test]
    fn equal_room_goes_to_the_less_loaded_link_then_the_lower_ordinal() {
        let t = Instant::now();
        let mut p = node(&[0, 1, 2]);
        p.add_link(0, 1, BW).unwrap();
        p.add_link(0, 2, BW).unwrap();
        take(&mut p, 0, 20 * GIB, t);
        assert!(matches!(p.decide(0, GIB, t).unwrap(), Decision::Borrow { from: 1, .. }));
        p.record_link_traffic(0, 1, t, 5 * GIB).unwrap();
        assert!(matches!(p.decide(0, GIB, t).unwrap(), Decision::Borrow { from: 2, .. }));
    }

    #[test]
    fn a_borrow_that_would_pass_the_link_budget_is_declined() {
        let t = Instant::now();
        let mut p = node(&[0, 1]);
        p.add_link(0, 1, BW).unwrap();
        take(&mut p, 0, 20 * GIB, t);
        p.record_link_traffic(1, 0, t, 25 * GIB).unwrap();
        // 25 + 5 = 30 GiB: exactly the budget, allowed.
        let d = p.decide(0, 5 * GIB, t).unwrap();
        assert_eq!(d, Decision::Borrow { from: 1, link_use: 0.3 });
        // One byte more is over it.
        let d = p.decide(0, 5 * GIB + 1, t).unwrap();
        let Decision::Decline(DeclineReason::LinkBudget { best }) = d else { panic!("{d:?}") };
        assert!(best > 0.3 && best < 0.31);
        // Declining takes nothing.
        p.commit(0, 5 * GIB + 1, &d, t).unwrap();
        assert_eq!(p.share(1).unwrap().1, 20 * GIB);
        assert_eq!(p.link_use(0, 1, t), Some(0.25));
    }

    #[test]
    fn committed_borrows_count_against_the_link() {
        let t = Instant::now();
        let mut p = PeerPolicy::new(BorrowConfig::default()).unwrap();
        p.add_gpu(0, 100 * GIB).unwrap();
        p.add_gpu(1, 400 * GIB).unwrap(); // an 80 GiB share: room is not the limit here
        p.add_link(0, 1, BW).unwrap();
        take(&mut p, 0, 20 * GIB, t);
        assert!(matches!(take(&mut p, 0, 10 * GIB, t), Decision::Borrow { .. }));
        assert!(matches!(take(&mut p, 0, 10 * GIB, t), Decision::Borrow { .. }));
        assert_eq!(p.link_use(0, 1, t), Some(0.2));
        // 20 GiB moved already: another 10 GiB makes 30% (allowed), 11 GiB does not.
        assert!(matches!(p.decide(0, 10 * GIB, t).unwrap(), Decision::Borrow { from: 1, .. }));
        assert!(matches!(p.decide(0, 11 * GIB, t).unwrap(), Decision::Decline(DeclineReason::LinkBudget { .. })));
    }

    #[test]
    fn the_window_slides() {
        let t = Instant::now();
        let mut p = node(&[0, 1]);
        p.add_link(0, 1, BW).unwrap();
        take(&mut p, 0, 20 * GIB, t);
        p.record_link_traffic(0, 1, t, 30 * GIB).unwrap();
        assert!(matches!(p.decide(0, GIB, t).unwrap(), Decision::Decline(DeclineReason::LinkBudget { .. })));
        let almost = t + Duration::from_millis(999);
        assert!(matches!(p.decide(0, GIB, almost).unwrap(), Decision::Decline(_)));
        // At exactly one window later the old bytes have left it.
        let later = t + Duration::from_secs(1);
        assert_eq!(p.link_use(0, 1, later), Some(0.0));
        assert!(matches!(p.decide(0, GIB, later).unwrap(), Decision::Borrow { from: 1, .. }));
    }

    #[test]
    fn no_link_or_no_room_declines() {
        let t = Instant::now();
        let mut p = node(&[0, 1, 2]);
        take(&mut p, 0, 20 * GIB, t);
        assert_eq!(p.decide(0, 1, t).unwrap(), Decision::Decline(DeclineReason::NoPeerAccess));
        p.add_link(0, 1, BW).unwrap();
        // More than any one peer's share: never split across peers, never overcommitted.
        assert_eq!(p.decide(0, 20 * GIB + 1, t).unwrap(), Decision::Decline(DeclineReason::NoPeerCapacity));
        // A request larger than the link's budget is declined even with room.
        let mut big = PeerPolicy::new(BorrowConfig::default()).unwrap();
        big.add_gpu(0, 1000 * GIB).unwrap();
        big.add_gpu(1, 1000 * GIB).unwrap();
        big.add_link(0, 1, BW).unwrap();
        take(&mut big, 0, 200 * GIB, t);
        assert!(matches!(big.decide(0, 31 * GIB, t).unwrap(), Decision::Decline(DeclineReason::LinkBudget { .. })));
    }

    #[test]
    fn release_gives_space_back_and_refuses_more_than_held() {
        let t = Instant::now();
        let mut p = node(&[0, 1]);
        p.add_link(0, 1, BW).unwrap();
        take(&mut p, 0, 20 * GIB, t);
        take(&mut p, 0, 4 * GIB, t);
        assert!(p.release(0, 1, 5 * GIB).is_err());
        p.release(0, 1, 3 * GIB).unwrap();
        assert_eq!((p.borrowed(0, 1), p.share(1).unwrap().1), (GIB, 19 * GIB));
        p.release(0, 1, GIB).unwrap();
        assert_eq!(p.borrowed(0, 1), 0);
        p.release(0, 0, 20 * GIB).unwrap();
        assert!(p.release(0, 0, 1).is_err());
        assert_eq!(p.decide(0, 20 * GIB, t).unwrap(), Decision::Local);
    }

    #[test]
    fn a_lender_short_of_its_own_share_reclaims_before_it_borrows() {
        let t = Instant::now();
        let mut p = node(&[0, 1, 2]);
        p.add_link(0, 1, BW).unwrap();
        p.add_link(1, 2, BW).unwrap();
        take(&mut p, 0, 20 * GIB, t);
        assert!(matches!(take(&mut p, 0, 15 * GIB, t), Decision::Borrow { from: 1, .. }));
        assert_eq!(p.lent(1), 15 * GIB);
        // GPU 1 wants 10 GiB: 5 free, 15 lent. GPU 2 has room, but 1's share is its own.
        assert_eq!(take(&mut p, 1, 5 * GIB, t), Decision::Local);
        assert_eq!(take(&mut p, 1, GIB, t), Decision::Reclaim);
        assert_eq!(p.share(1).unwrap().1, 0, "a reclaim takes nothing by itself");
        // More than it lent plus what is free: not a reclaim, so it borrows.
        assert!(matches!(p.decide(1, 16 * GIB, t).unwrap(), Decision::Borrow { from: 2, .. }));
        p.release(0, 1, GIB).unwrap();
        assert_eq!(take(&mut p, 1, GIB, t), Decision::Local);
        // Exact shares for pools carved in whole pages.
        p.add_gpu_share(7, 3 * 4096).unwrap();
        assert_eq!(p.share(7).unwrap(), (3 * 4096, 3 * 4096));
        assert!(p.add_gpu_share(7, 1).is_err());
    }

    #[test]
    fn commit_refuses_a_stale_decision() {
        let t = Instant::now();
        let mut p = node(&[0, 1]);
        p.add_link(0, 1, BW).unwrap();
        take(&mut p, 0, 20 * GIB, t);
        let d = p.decide(0, 15 * GIB, t).unwrap();
        take(&mut p, 1, 10 * GIB, t);
        assert!(matches!(p.commit(0, 15 * GIB, &d, t), Err(AgentError::OutOfMemory { .. })));
        assert_eq!(p.borrowed(0, 1), 0);
    }

    #[test]
    fn configuration_is_validated() {
        for c in [
            BorrowConfig::default().with_reserved_fraction(0.0),
            BorrowConfig::default().with_reserved_fraction(1.5),
            BorrowConfig::default().with_link_budget(0.0),
            BorrowConfig::default().with_link_budget(f64::NAN),
            BorrowConfig::default().with_window(Duration::ZERO),
        ] {
            assert!(matches!(PeerPolicy::new(c), Err(AgentError::Config(_))));
        }
        let mut p = node(&[0, 1]);
        assert!(p.add_link(0, 0, BW).is_err());
        assert!(p.add_link(0, 9, BW).is_err());
        assert!(p.add_link(0, 1, 0).is_err());
        assert!(p.record_link_traffic(0, 1, Instant::now(), 1).is_err());
    }

    #[test]
    fn monitor_tolerates_time_going_backwards() {
        let t = Instant::now() + Duration::from_secs(10);
        let mut m = LinkMonitor::new(1000, Duration::from_secs(1));
        m.record(t, 100);
        m.record(t - Duration::from_secs(5), 50);
        assert_eq!(m.bytes_in_window(t), 150);
        assert_eq!(m.bytes_in_window(t + Duration::from_secs(1)), 0);
        assert_eq!(m.utilization_with(t, 50), 0.2);
    }
}
