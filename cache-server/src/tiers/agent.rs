//! [`AgentTier`]: G1, the HBM pages of this node's GPU agents, as a tier of the server's stack.
//!
//! The server holds no G1 bytes. It keeps an index of the keys each agent reported stored
//! (`ReportAgentBlocks`), so lookups count them, and a demand channel per agent and namespace
//! (the `AgentDemands` stream the agent keeps open): a read of a key that only G1 holds sends the
//! key down that channel and waits — at most `agent_demand_wait` — for the agent to spill the
//! page into DRAM through the same-node socket, then reads it from DRAM like any other block. A
//! wait that runs out is a miss, never wrong bytes: what is served is what DRAM verified. An
//! agent that can't spill a demanded key (it left G1 meanwhile, or the copy or store failed)
//! says so (`AgentBlocksReport.unspilled`), and the reads waiting on it miss at once instead of
//! waiting the rest of `agent_demand_wait`.
//!
//! - **Liveness**: an agent's index lives exactly as long as its demand stream. When the stream
//!   goes away (the agent closed it, crashed or was killed: the connection drops and tonic drops
//!   the stream) its keys stop counting at once. Reports from an agent without an open stream
//!   for the namespace are not indexed (they still go out as KV events).
//! - **Bounds**: at most `agent_index_max_keys` keys per namespace (over every agent; past it a
//!   stored key is not indexed and `kvtier_agent_index_full_total` counts it), a demand queue of
//!   [`DEMAND_QUEUE`] keys per stream (a full queue is a miss), and at most [`MAX_WAITERS`] keys
//!   waited on at once (past it, a miss).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kvtier_proto::{BlockKey, NamespaceId};
use parking_lot::Mutex;
use tokio::sync::{mpsc, Notify};

use crate::error::ServerError;

/// Keys queued for one demand stream; past it a demand is dropped (its read is a miss).
pub const DEMAND_QUEUE: usize = 1024;

/// Keys waited on at once, over every reader.
pub const MAX_WAITERS: usize = 4096;

/// Agents with a demand link open per namespace.
pub const MAX_LINKS_PER_NAMESPACE: usize = 64;

/// Called with the keys that left G1 when an agent's link closed.
pub type GoneHook = Arc<dyn Fn(&NamespaceId, &[BlockKey]) + Send + Sync>;

/// Settings of the G1 tier (`agent_demand_wait`, `agent_index_max_keys`).
#[derive(Debug, Clone, Copy)]
pub struct AgentTierConfig {
    /// How long a read waits for an agent to spill a G1-only block. Default: 200 ms.
    pub demand_wait: Duration,
    /// Keys indexed per namespace, over every agent. Default: 1 Mi.
    pub max_keys_per_namespace: usize,
}

impl Default for AgentTierConfig {
    fn default() -> Self {
        AgentTierConfig { demand_wait: Duration::from_millis(200), max_keys_per_namespace: 1 << 20 }
    }
}

/// One agent's demand stream for one namespace, and the keys it reported stored.
struct AgentLink {
    /// Tells this link from a later one of the same agent id (a reconnect).
    generation: u64,
    demands: mpsc::Sender<BlockKey>,
    keys: HashSet<BlockKey>,
}

#[derive(Default)]
struct NamespaceIndex {
    agents: HashMap<String, AgentLink>,
    /// Per key: how many links hold it.
    holders: HashMap<BlockKey, u32>,
}

impl NamespaceIndex {
    fn forget(&mut self, key: &BlockKey) {
        if let Some(n) = self.holders.get_mut(key) {
            *n -= 1;
            if *n == 0 {
                self.holders.remove(key);
            }
        }
    }
}

/// A key someone waits to see land in DRAM.
struct Waiting {
    landed: Arc<Notify>,
    /// Set when the agent asked said it could not spill the key.
    unspilled: Arc<AtomicBool>,
    /// The agent the demand went to.
    asked: String,
    readers: usize,
    /// Its block landed in DRAM (counted once as a demand hit).
    landed_once: bool,
}

/// Counters of the G1 tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AgentTierStats {
    /// Keys indexed now, over every namespace (a gauge).
    pub keys: u64,
    /// Demand streams open now (a gauge).
    pub links: u64,
    pub demands: u64,
    /// Reads served after an agent spilled the block.
    pub hits: u64,
    /// Reads whose wait ran out, or whose demand could not be queued.
    pub misses: u64,
    /// Stored keys not indexed because the namespace's index was full.
    pub index_full: u64,
}

/// The index of what this node's GPU agents hold, and their demand channels.
pub struct AgentTier {
    config: AgentTierConfig,
    /// Told the keys only a closed link held (the stack publishes them as leaving `hbm`).
    on_gone: Mutex<Option<GoneHook>>,
    index: Mutex<HashMap<NamespaceId, NamespaceIndex>>,
    waiting: Mutex<HashMap<(NamespaceId, BlockKey), Waiting>>,
    /// `waiting.len()`, readable without the lock (a store checks it on every commit).
    waiting_count: AtomicUsize,
    next_generation: AtomicU64,
    demands: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    index_full: AtomicU64,
}

/// An open demand stream's registration: dropping it (the stream went away) drops the agent's
/// index for the namespace.
pub struct AgentLinkGuard {
    tier: std::sync::Weak<AgentTier>,
    ns: NamespaceId,
    agent: String,
    generation: u64,
}

impl Drop for AgentLinkGuard {
    fn drop(&mut self) {
        if let Some(tier) = self.tier.upgrade() {
            tier.close(&self.ns, &self.agent, self.generation);
        }
    }
}

/// A reader's interest in a key landing; dropping it gives up the interest.
pub struct Waiter<'a> {
    tier: &'a AgentTier,
    key: (NamespaceId, BlockKey),
    pub landed: Arc<Notify>,
    unspilled: Arc<AtomicBool>,
}

impl Waiter<'_> {
    /// Whether the agent asked for the key said it could not spill it (the wait is over: a
    /// miss, unless the block is in DRAM after all).
    pub fn unspilled(&self) -> bool {
        self.unspilled.load(Ordering::Acquire)
    }
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        let mut w = self.tier.waiting.lock();
        if let Some(e) = w.get_mut(&self.key) {
            e.readers -= 1;
            if e.readers == 0 {
                w.remove(&self.key);
                self.tier.waiting_count.store(w.len(), Ordering::Release);
            }
        }
    }
}

impl Default for AgentTier {
    fn default() -> Self {
        AgentTier::new(AgentTierConfig::default())
    }
}

impl AgentTier {
    pub fn new(config: AgentTierConfig) -> Self {
        AgentTier {
            config,
            on_gone: Mutex::new(None),
            index: Mutex::new(HashMap::new()),
            waiting: Mutex::new(HashMap::new()),
            waiting_count: AtomicUsize::new(0),
            next_generation: AtomicU64::new(1),
            demands: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            index_full: AtomicU64::new(0),
        }
    }

    pub fn config(&self) -> AgentTierConfig {
        self.config
    }

    /// What to tell when a link closes: the keys only it held (so routers stop counting them).
    pub fn set_gone_hook(&self, hook: GoneHook) {
        *self.on_gone.lock() = Some(hook);
    }

    /// Opens (or replaces: a reconnect) `agent`'s demand link for `ns`; the receiver is what the
    /// stream sends, the guard closes the link when dropped. Refused past
    /// [`MAX_LINKS_PER_NAMESPACE`] agents.
    pub fn open(
        self: &Arc<Self>,
        ns: NamespaceId,
        agent: &str,
    ) -> Result<(mpsc::Receiver<BlockKey>, AgentLinkGuard), ServerError> {
        let (tx, rx) = mpsc::channel(DEMAND_QUEUE);
        let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
        let mut index = self.index.lock();
        let nsx = index.entry(ns).or_default();
        if nsx.agents.len() >= MAX_LINKS_PER_NAMESPACE && !nsx.agents.contains_key(agent) {
            return Err(ServerError::Capacity(format!(
                "{MAX_LINKS_PER_NAMESPACE} GPU agents already have a demand stream open for this namespace"
            )));
        }
        let old = nsx.agents.insert(agent.to_string(), AgentLink { generation, demands: tx, keys: HashSet::new() });
        if let Some(old) = old {
            for k in &old.keys {
                nsx.forget(k);
            }
        }
        self.publish_gauges(&index);
        Ok((rx, AgentLinkGuard { tier: Arc::downgrade(self), ns, agent: agent.to_string(), generation }))
    }

    /// Drops a link's index (if it is still that generation); the keys it alone held.
    fn close(&self, ns: &NamespaceId, agent: &str, generation: u64) -> Vec<BlockKey> {
        let mut index = self.index.lock();
        let Some(nsx) = index.get_mut(ns) else { return Vec::new() };
        if nsx.agents.get(agent).is_none_or(|l| l.generation != generation) {
            return Vec::new();
        }
        let mut gone = Vec::new();
        if let Some(link) = nsx.agents.remove(agent) {
            for k in &link.keys {
                nsx.forget(k);
                if !nsx.holders.contains_key(k) {
                    gone.push(*k);
                }
            }
        }
        if nsx.agents.is_empty() {
            index.remove(ns);
        }
        self.publish_gauges(&index);
        drop(index);
        tracing::info!(agent, keys = gone.len(), "a GPU agent's demand stream closed: its G1 keys no longer count");
        let hook = self.on_gone.lock().clone();
        if let Some(hook) = hook.filter(|_| !gone.is_empty()) {
            hook(ns, &gone);
        }
        gone
    }

    /// Applies an agent's report: `stored` keys join its index (those past the namespace's cap
    /// are counted and left out), `left` keys leave it. False when the agent has no open link
    /// for `ns` (nothing indexed).
    pub fn report(&self, ns: &NamespaceId, agent: &str, stored: &[BlockKey], left: &[BlockKey]) -> bool {
        let mut index = self.index.lock();
        let Some(nsx) = index.get_mut(ns) else { return false };
        let Some(mut link) = nsx.agents.remove(agent) else { return false };
        for k in left {
            if link.keys.remove(k) {
                nsx.forget(k);
            }
        }
        let mut full = 0;
        for k in stored {
            if link.keys.contains(k) {
                continue;
            }
            if !nsx.holders.contains_key(k) && nsx.holders.len() >= self.config.max_keys_per_namespace {
                full += 1;
                continue;
            }
            link.keys.insert(*k);
            *nsx.holders.entry(*k).or_insert(0) += 1;
        }
        nsx.agents.insert(agent.to_string(), link);
        if full > 0 {
            self.index_full.fetch_add(full, Ordering::Relaxed);
            ::metrics::counter!("kvtier_agent_index_full_total").increment(full);
        }
        self.publish_gauges(&index);
        true
    }

    fn publish_gauges(&self, index: &HashMap<NamespaceId, NamespaceIndex>) {
        let keys: usize = index.values().map(|n| n.holders.len()).sum();
        let links: usize = index.values().map(|n| n.agents.len()).sum();
        ::metrics::gauge!("kvtier_agent_index_keys").set(keys as f64);
        ::metrics::gauge!("kvtier_agent_links").set(links as f64);
    }

    /// Whether any agent has a demand link open for `ns` (a cheap check before per-key work).
    pub fn has_links(&self, ns: &NamespaceId) -> bool {
        self.index.lock().contains_key(ns)
    }

    /// Whether some agent's G1 holds the key.
    pub fn contains(&self, ns: &NamespaceId, key: &BlockKey) -> bool {
        self.index.lock().get(ns).is_some_and(|n| n.holders.contains_key(key))
    }

    /// Batched [`AgentTier::contains`], in the shape of `Tier::mark_held`.
    pub fn mark_held(&self, ns: &NamespaceId, keys: &[BlockKey], held: &mut [bool]) {
        let index = self.index.lock();
        let Some(nsx) = index.get(ns) else { return };
        for (k, h) in keys.iter().zip(held.iter_mut()) {
            if !*h && nsx.holders.contains_key(k) {
                *h = true;
            }
        }
    }

    /// Asks an agent holding the key to spill it (unless a demand for it is already out) and
    /// returns the reader's interest in it landing; `None` (a miss, counted) when no agent holds
    /// it, its queue is full, or too many keys are waited on.
    pub fn demand(&self, ns: &NamespaceId, key: &BlockKey) -> Option<Waiter<'_>> {
        let k = (*ns, *key);
        let mut waiting = self.waiting.lock();
        if let Some(w) = waiting.get_mut(&k) {
            w.readers += 1;
            let (landed, unspilled) = (w.landed.clone(), w.unspilled.clone());
            return Some(Waiter { tier: self, key: k, landed, unspilled });
        }
        if waiting.len() >= MAX_WAITERS {
            drop(waiting);
            self.missed("waiters_full");
            return None;
        }
        let asked = {
            let index = self.index.lock();
            index.get(ns).and_then(|nsx| {
                nsx.agents
                    .iter()
                    .filter(|(_, l)| l.keys.contains(key))
                    .find_map(|(name, l)| l.demands.try_send(*key).ok().map(|()| name.clone()))
            })
        };
        let Some(asked) = asked else {
            drop(waiting);
            self.missed("not_queued");
            return None;
        };
        self.demands.fetch_add(1, Ordering::Relaxed);
        ::metrics::counter!("kvtier_agent_demands_total").increment(1);
        let (landed, unspilled) = (Arc::new(Notify::new()), Arc::new(AtomicBool::new(false)));
        waiting.insert(
            k,
            Waiting { landed: landed.clone(), unspilled: unspilled.clone(), asked, readers: 1, landed_once: false },
        );
        self.waiting_count.store(waiting.len(), Ordering::Release);
        Some(Waiter { tier: self, key: k, landed, unspilled })
    }

    /// Agent `agent` could not spill these keys of `ns` it was asked for: the reads waiting on
    /// them give up now. Keys demanded of another agent, or not waited on, are left alone. How
    /// many waits ended.
    pub fn unspilled(&self, ns: &NamespaceId, agent: &str, keys: &[BlockKey]) -> usize {
        if self.waiting_count.load(Ordering::Acquire) == 0 {
            return 0;
        }
        let waiting = self.waiting.lock();
        let mut ended = 0;
        for key in keys {
            if let Some(w) = waiting.get(&(*ns, *key)).filter(|w| w.asked == agent) {
                w.unspilled.store(true, Ordering::Release);
                w.landed.notify_waiters();
                ended += 1;
            }
        }
        ended
    }

    /// Wakes the readers waiting for a key that just landed in DRAM.
    pub fn landed(&self, ns: &NamespaceId, key: &BlockKey) {
        if self.waiting_count.load(Ordering::Acquire) == 0 {
            return;
        }
        if let Some(w) = self.waiting.lock().get_mut(&(*ns, *key)) {
            // A demanded block landing is the demand's hit, however its reader then finds it
            // (waiting for it, or in DRAM already when its turn comes in a batch that demanded
            // ahead): counted here, once.
            if !w.landed_once {
                w.landed_once = true;
                self.hit();
            }
            w.landed.notify_waiters();
        }
    }

    /// Counts a demand whose G1 block landed in DRAM for its readers.
    fn hit(&self) {
        self.hits.fetch_add(1, Ordering::Relaxed);
        ::metrics::counter!("kvtier_agent_demand_hits_total").increment(1);
    }

    /// Counts a read of a G1-only block that became a miss, and why.
    pub fn missed(&self, why: &'static str) {
        self.misses.fetch_add(1, Ordering::Relaxed);
        ::metrics::counter!("kvtier_agent_demand_misses_total", "reason" => why).increment(1);
    }

    /// Forgets every key of a namespace (purged or unregistered); the links stay open.
    pub fn purge(&self, ns: &NamespaceId) {
        let mut index = self.index.lock();
        if let Some(nsx) = index.get_mut(ns) {
            nsx.holders.clear();
            for l in nsx.agents.values_mut() {
                l.keys.clear();
            }
        }
        self.publish_gauges(&index);
    }

    pub fn stats(&self) -> AgentTierStats {
        let index = self.index.lock();
        AgentTierStats {
            keys: index.values().map(|n| n.holders.len() as u64).sum(),
            links: index.values().map(|n| n.agents.len() as u64).sum(),
            demands: self.demands.load(Ordering::Relaxed),
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            index_full: self.index_full.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u8) -> BlockKey {
        BlockKey([i; 32])
    }

    #[tokio::test]
    async fn reported_keys_count_while_the_link_is_open_and_demands_reach_their_agent() {
        let tier = Arc::new(AgentTier::new(AgentTierConfig { max_keys_per_namespace: 2, ..Default::default() }));
        let ns = NamespaceId([1; 16]);
        assert!(!tier.report(&ns, "a", &[key(1)], &[]), "no link: not indexed");
        assert!(!tier.contains(&ns, &key(1)));
        let (mut rx, guard) = tier.open(ns, "a").unwrap();
        assert!(tier.report(&ns, "a", &[key(1), key(2), key(3)], &[]));
        assert!(tier.contains(&ns, &key(1)) && tier.contains(&ns, &key(2)));
        assert!(!tier.contains(&ns, &key(3)), "past the cap");
        assert_eq!(tier.stats().index_full, 1);
        let mut held = vec![false; 3];
        tier.mark_held(&ns, &[key(1), key(3), key(2)], &mut held);
        assert_eq!(held, [true, false, true]);

        let w = tier.demand(&ns, &key(2)).expect("queued");
        let again = tier.demand(&ns, &key(2)).expect("joined");
        assert_eq!(rx.try_recv().ok(), Some(key(2)));
        assert!(rx.try_recv().is_err(), "one demand per key in flight");
        let notified = w.landed.notified();
        tier.landed(&ns, &key(2));
        tokio::time::timeout(Duration::from_secs(1), notified).await.expect("woken");
        drop((w, again));
        assert_eq!(tier.waiting_count.load(Ordering::Acquire), 0);

        // An agent that can't spill a key ends the waits it was asked for, and only those.
        let w = tier.demand(&ns, &key(1)).expect("queued");
        assert_eq!(rx.try_recv().ok(), Some(key(1)));
        assert_eq!(tier.unspilled(&ns, "b", &[key(1)]), 0, "not the agent asked");
        assert_eq!(tier.unspilled(&ns, "a", &[key(2)]), 0, "nobody waits on it");
        assert!(!w.unspilled());
        let notified = w.landed.notified();
        assert_eq!(tier.unspilled(&ns, "a", &[key(1)]), 1);
        tokio::time::timeout(Duration::from_secs(1), notified).await.expect("woken");
        assert!(w.unspilled());
        drop(w);

        assert!(tier.report(&ns, "a", &[], &[key(1)]));
        assert!(!tier.contains(&ns, &key(1)));
        assert!(tier.demand(&ns, &key(1)).is_none(), "no agent holds it");
        drop(guard);
        assert!(!tier.contains(&ns, &key(2)), "the link closed: its keys are gone");
        assert_eq!(tier.stats().links, 0);
    }

    #[test]
    fn a_reconnect_replaces_the_old_link_and_the_old_guard_leaves_it_alone() {
        let tier = Arc::new(AgentTier::default());
        let ns = NamespaceId([2; 16]);
        let (_rx1, old) = tier.open(ns, "a").unwrap();
        tier.report(&ns, "a", &[key(1)], &[]);
        let (_rx2, _new) = tier.open(ns, "a").unwrap();
        assert!(!tier.contains(&ns, &key(1)), "a new link starts empty (the agent resyncs)");
        tier.report(&ns, "a", &[key(2)], &[]);
        drop(old);
        assert!(tier.contains(&ns, &key(2)), "the old stream's end does not close the new link");
    }
}
