//! KV events: what this node stored, evicted, purged, and which sessions were parked, dropped or
//! expired — the stream a KV-aware router (Dynamo, llm-d, SGLang's router) watches to know which
//! node holds which prefix (`WatchEvents`).
//!
//! Events are emitted from the one place each happens (the tier stack for blocks, the session
//! store for sessions) into an [`EventBus`]. Emitting never blocks and costs one atomic load when
//! nobody watches. Block events are batched: consecutive events of the same kind, namespace and
//! tiers are merged into one (at most [`MAX_KEYS_PER_EVENT`] keys), and the batch is published
//! every [`FLUSH_EVERY`] (or as soon as it holds [`MAX_PENDING_KEYS`] keys), in the order things
//! happened. Publishing goes through a bounded `tokio::sync::broadcast` of `events_buffer`
//! entries: a watcher that falls that far behind loses the oldest events and is told so with one
//! `LAGGED{missed}` event (it then resyncs with `Lookup` / `RouteHint`); nothing is buffered per
//! watcher beyond that, and a slow watcher never slows the data path.
//!
//! Watchers are counted against `events_max_watchers` (node) and `events_max_watchers_per_tenant`
//! ([`EventBus::admit`]); the count is the gauge `kvtier_event_watchers`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use kvtier_proto::{BlockKey, NamespaceId, TierId};
use parking_lot::Mutex;
use tokio::sync::broadcast;

use crate::error::ServerError;

/// How often pending block events are published.
pub const FLUSH_EVERY: Duration = Duration::from_millis(20);
/// Most keys one event carries.
pub const MAX_KEYS_PER_EVENT: usize = 512;
/// Pending keys past which the batch is published at once.
pub const MAX_PENDING_KEYS: usize = 4096;

/// What happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    Stored,
    Evicted,
    Purged,
    SessionParked,
    SessionDropped,
    SessionExpired,
}

/// One published event.
#[derive(Clone, Debug)]
pub struct KvEvent {
    pub seq: u64,
    pub kind: EventKind,
    pub namespace: NamespaceId,
    pub keys: Vec<BlockKey>,
    /// Stored: where; evicted: from where.
    pub tier: Option<TierId>,
    /// Evicted: where to (`None`: gone).
    pub to_tier: Option<TierId>,
    pub session: Option<String>,
    pub unix_ms: u64,
}

/// Not yet published.
struct Draft {
    kind: EventKind,
    namespace: NamespaceId,
    keys: Vec<BlockKey>,
    tier: Option<TierId>,
    to_tier: Option<TierId>,
    session: Option<String>,
}

#[derive(Default)]
struct Pending {
    drafts: Vec<Draft>,
    keys: usize,
}

/// Watcher limits (from `ServerConfig`).
#[derive(Clone, Copy, Debug)]
pub struct WatchLimits {
    pub max_watchers: usize,
    pub max_per_tenant: usize,
}

/// The node's event bus. Cheap to share (`Arc`).
pub struct EventBus {
    tx: broadcast::Sender<Arc<KvEvent>>,
    pending: Mutex<Pending>,
    seq: AtomicU64,
    node: OnceLock<String>,
    limits: OnceLock<WatchLimits>,
    /// Watchers now: in total and per tenant ("" is the operator).
    watchers: Mutex<(usize, HashMap<String, usize>)>,
}

/// A watcher's place under the limits; given back when dropped.
pub struct WatchSlot {
    bus: Arc<EventBus>,
    tenant: String,
}

impl Drop for WatchSlot {
    fn drop(&mut self) {
        let mut w = self.bus.watchers.lock();
        w.0 = w.0.saturating_sub(1);
        if let Some(n) = w.1.get_mut(&self.tenant) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                w.1.remove(&self.tenant);
            }
        }
        ::metrics::gauge!("kvtier_event_watchers").set(w.0 as f64);
    }
}

impl Default for EventBus {
    fn default() -> Self {
        EventBus::new(4096)
    }
}

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

impl EventBus {
    /// A bus keeping the last `buffer` events for watchers that fall behind.
    pub fn new(buffer: usize) -> Self {
        let (tx, _) = broadcast::channel(buffer.max(1));
        EventBus {
            tx,
            pending: Mutex::new(Pending::default()),
            seq: AtomicU64::new(0),
            node: OnceLock::new(),
            limits: OnceLock::new(),
            watchers: Mutex::new((0, HashMap::new())),
        }
    }

    /// Sets the watcher limits (once).
    pub fn set_limits(&self, limits: WatchLimits) {
        let _ = self.limits.set(limits);
    }

    /// Names this node in events (once; its cluster member id).
    pub fn set_node(&self, id: &str) {
        let _ = self.node.set(id.to_string());
    }

    pub fn node(&self) -> &str {
        self.node.get().map(String::as_str).unwrap_or("")
    }

    /// Whether anybody watches: emitters skip their work when not.
    pub fn is_watched(&self) -> bool {
        self.tx.receiver_count() > 0
    }

    /// A watcher's slot, or `QuotaExceeded` past the node's or the tenant's limit.
    pub fn admit(self: &Arc<Self>, tenant: Option<&str>) -> Result<WatchSlot, ServerError> {
        let limits = self.limits.get().copied().unwrap_or(WatchLimits { max_watchers: 64, max_per_tenant: 8 });
        let tenant = tenant.unwrap_or("").to_string();
        let mut w = self.watchers.lock();
        if w.0 >= limits.max_watchers {
            ::metrics::counter!("kvtier_event_watchers_refused_total", "limit" => "node").increment(1);
            return Err(ServerError::QuotaExceeded(format!(
                "{} event watchers already; events_max_watchers is {}",
                w.0, limits.max_watchers
            )));
        }
        let mine = w.1.get(&tenant).copied().unwrap_or(0);
        if !tenant.is_empty() && mine >= limits.max_per_tenant {
            ::metrics::counter!("kvtier_event_watchers_refused_total", "limit" => "tenant").increment(1);
            return Err(crate::tenants::quota_refused(
                &tenant,
                "events_max_watchers_per_tenant",
                format!(
                    "tenant {tenant} has {mine} event watchers already; events_max_watchers_per_tenant is {}",
                    limits.max_per_tenant
                ),
            ));
        }
        w.0 += 1;
        *w.1.entry(tenant.clone()).or_insert(0) += 1;
        ::metrics::gauge!("kvtier_event_watchers").set(w.0 as f64);
        Ok(WatchSlot { bus: self.clone(), tenant })
    }

    /// A receiver of every event published from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<KvEvent>> {
        self.tx.subscribe()
    }

    /// Blocks now held in `tier`.
    pub fn stored(&self, ns: &NamespaceId, keys: &[BlockKey], tier: TierId) {
        self.blocks(EventKind::Stored, ns, keys, Some(tier), None);
    }

    /// Blocks that left `from`, for `to` (`None`: gone).
    pub fn evicted(&self, ns: &NamespaceId, keys: &[BlockKey], from: TierId, to: Option<TierId>) {
        self.blocks(EventKind::Evicted, ns, keys, Some(from), to);
    }

    /// Blocks removed from every tier.
    pub fn purged(&self, ns: &NamespaceId, keys: &[BlockKey]) {
        self.blocks(EventKind::Purged, ns, keys, None, None);
    }

    /// A session event (parked, dropped, expired).
    pub fn session(&self, kind: EventKind, ns: &NamespaceId, id: &str) {
        if !self.is_watched() {
            return;
        }
        let mut p = self.pending.lock();
        p.drafts.push(Draft {
            kind,
            namespace: *ns,
            keys: Vec::new(),
            tier: None,
            to_tier: None,
            session: Some(id.to_string()),
        });
        if p.drafts.len() >= MAX_PENDING_KEYS {
            self.publish(&mut p);
        }
    }

    fn blocks(&self, kind: EventKind, ns: &NamespaceId, keys: &[BlockKey], tier: Option<TierId>, to: Option<TierId>) {
        if keys.is_empty() || !self.is_watched() {
            return;
        }
        let mut p = self.pending.lock();
        for k in keys {
            let merge = p.drafts.last().is_some_and(|d| {
                d.kind == kind
                    && d.namespace == *ns
                    && d.tier == tier
                    && d.to_tier == to
                    && d.session.is_none()
                    && d.keys.len() < MAX_KEYS_PER_EVENT
            });
            if !merge {
                p.drafts.push(Draft { kind, namespace: *ns, keys: Vec::new(), tier, to_tier: to, session: None });
            }
            if let Some(d) = p.drafts.last_mut() {
                d.keys.push(*k);
            }
            p.keys += 1;
        }
        if p.keys >= MAX_PENDING_KEYS {
            self.publish(&mut p);
        }
    }

    /// Publishes what is pending (the flusher calls it every [`FLUSH_EVERY`]).
    pub fn flush(&self) {
        let mut p = self.pending.lock();
        self.publish(&mut p);
    }

    fn publish(&self, p: &mut Pending) {
        if p.drafts.is_empty() {
            return;
        }
        let now = unix_ms();
        let n = p.drafts.len() as u64;
        for d in p.drafts.drain(..) {
            let e = KvEvent {
                seq: self.seq.fetch_add(1, Ordering::Relaxed) + 1,
                kind: d.kind,
                namespace: d.namespace,
                keys: d.keys,
                tier: d.tier,
                to_tier: d.to_tier,
                session: d.session,
                unix_ms: now,
            };
            // No receiver: nothing to do (an error only says so).
            let _ = self.tx.send(Arc::new(e));
        }
        p.keys = 0;
        ::metrics::counter!("kvtier_events_published_total").increment(n);
    }
}

/// Publishes pending events every [`FLUSH_EVERY`] until `stop` turns true.
pub async fn flusher(bus: Arc<EventBus>, mut stop: tokio::sync::watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(FLUSH_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = crate::stopped(&mut stop) => { bus.flush(); return }
            _ = tick.tick() => bus.flush(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u32) -> BlockKey {
        BlockKey(*blake3::hash(&i.to_le_bytes()).as_bytes())
    }

    /// Consecutive block events of one kind merge; a different kind starts a new event, so the
    /// order of what happened is kept; nothing is kept when nobody watches.
    #[test]
    fn events_merge_in_order_and_cost_nothing_unwatched() {
        let bus = EventBus::new(16);
        let ns = NamespaceId([1; 16]);
        bus.stored(&ns, &[key(0)], TierId::Dram);
        assert!(bus.pending.lock().drafts.is_empty(), "nobody watches: nothing pending");
        let mut rx = bus.subscribe();
        bus.stored(&ns, &[key(1), key(2)], TierId::Dram);
        bus.stored(&ns, &[key(3)], TierId::Dram);
        bus.evicted(&ns, &[key(1)], TierId::Dram, None);
        bus.session(EventKind::SessionParked, &ns, "s");
        bus.flush();
        let a = rx.try_recv().unwrap();
        assert_eq!((a.kind, a.keys.clone()), (EventKind::Stored, vec![key(1), key(2), key(3)]));
        let b = rx.try_recv().unwrap();
        assert_eq!((b.kind, b.keys.clone(), b.to_tier), (EventKind::Evicted, vec![key(1)], None));
        let c = rx.try_recv().unwrap();
        assert_eq!((c.kind, c.session.as_deref()), (EventKind::SessionParked, Some("s")));
        assert!(a.seq < b.seq && b.seq < c.seq);
    }

    /// A receiver that falls behind the buffer is told how many events it missed.
    #[test]
    fn a_slow_receiver_lags_and_the_buffer_stays_bounded() {
        let bus = EventBus::new(4);
        let ns = NamespaceId([1; 16]);
        let mut rx = bus.subscribe();
        for i in 0..10 {
            bus.session(EventKind::SessionDropped, &ns, &format!("s{i}"));
            bus.flush();
        }
        match rx.try_recv() {
            Err(broadcast::error::TryRecvError::Lagged(n)) => assert_eq!(n, 6),
            other => panic!("{other:?}"),
        }
        assert_eq!(rx.try_recv().unwrap().session.as_deref(), Some("s6"));
    }

    /// Past the node's or a tenant's limit a watcher is refused; a dropped slot frees its place.
    #[test]
    fn watchers_are_bounded_per_node_and_tenant() {
        let bus = Arc::new(EventBus::new(4));
        bus.set_limits(WatchLimits { max_watchers: 3, max_per_tenant: 2 });
        let a1 = bus.admit(Some("a")).unwrap();
        let _a2 = bus.admit(Some("a")).unwrap();
        assert!(matches!(bus.admit(Some("a")), Err(ServerError::QuotaExceeded(_))));
        let _op = bus.admit(None).unwrap();
        assert!(matches!(bus.admit(Some("b")), Err(ServerError::QuotaExceeded(_))), "node limit");
        drop(a1);
        assert!(bus.admit(Some("b")).is_ok());
    }
}
