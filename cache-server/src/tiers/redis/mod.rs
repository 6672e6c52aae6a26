//! The shared Redis tier: blocks and parked sessions' manifests kept in a Redis (or Redis
//! Cluster, or Valkey) deployment the operator already runs, so a fleet of nodes shares KV through
//! the replication and failover Redis gives, without kvtier's own replica set.
//!
//! It sits under the local tiers like the peer tier: a load that every local tier missed asks
//! Redis ([`RedisTier::fetch`]: per chunk of a request, one pipeline of `GET`s per Redis node —
//! on a cluster, per master owning some of the keys, all sent at once, so a dead master only
//! takes its own keys; see [`nodes`]), bounded by `timeout`; an error or a timeout is a miss,
//! counted, never a hang. A store is
//! written through in the background ([`RedisTier::store`]: a bounded queue, dropped and counted
//! when full), so a store never waits for Redis.
//!
//! Values are block frames (header + payload), so the checksum travels with the bytes: every read
//! decodes the frame, verifies the checksum and checks namespace, key and layout; anything wrong
//! (a value overwritten by someone else, a torn write) is a miss, counted in
//! `kvtier_redis_bad_values_total`.
//!
//! Keys: `<prefix>:<namespace hex>:b:<key hex>` for blocks and `<prefix>:<namespace hex>:s:<session
//! id hex>` for manifests. No hash tag: each key hashes to its own slot, so a Redis Cluster
//! spreads blocks over all its masters (a tag per namespace would put a whole model's KV on one
//! master); every command names one key, so no command ever crosses slots.
//!
//! The byte budget is this node's own: a [`Ledger`] of the keys it wrote (value, key and an
//! estimate of Redis's per-key overhead), each with its expiry. A write that would pass the budget
//! first deletes this node's oldest keys (FIFO) — the newest blocks are the likeliest to be read
//! again, so refusing new writes would keep the wrong ones. The ledger never under-counts: a key
//! whose delete failed stays counted, a write that timed out is counted as written, and a key two
//! nodes wrote is counted by both. So this node's keys in Redis stay within `budget`, and a fleet
//! of N nodes within N × `budget`. What a restarted node wrote before is forgotten by its ledger
//! and leaves Redis through its TTL (`block_ttl`).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvtier_proto::{BlockFrame, BlockKey, Namespace, NamespaceId, FRAME_HEADER_LEN};
use parking_lot::Mutex;
use tokio::sync::{mpsc, watch, Semaphore};

use super::TierStats;
use crate::config::RedisTierConfig;
use crate::dram::{Priority, StoredBlock};
use crate::error::ServerError;
use crate::sessions::SessionManifest;
use nodes::Nodes;

pub mod nodes;

/// What Redis keeps per key beyond its name and value (dict entry, object headers), roughly;
/// counted against the budget with every key.
pub const KEY_OVERHEAD: u64 = 96;
/// Most write jobs waiting (each a store request's blocks).
const WRITE_QUEUE: usize = 1024;
/// Most value bytes one write sends (so one call within the timeout moves a bounded amount, as a
/// load's chunks do).
const WRITE_BATCH_BYTES: usize = 16 << 20;

/// This node's account of what it keeps in Redis (see the module doc). Plain data: time comes in
/// as `now`.
#[derive(Debug)]
pub struct Ledger {
    budget: u64,
    used: u64,
    next_seq: u64,
    entries: HashMap<String, Entry>,
    /// Keys in write order (with the sequence number of that write: a key written again leaves a
    /// stale entry behind, skipped).
    order: VecDeque<(u64, String)>,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    bytes: u64,
    expires: Instant,
    seq: u64,
    /// Redis acknowledged the write (an unacknowledged one is counted, but written again).
    confirmed: bool,
}

/// A key the ledger let go to make room, to be deleted from Redis.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evicted {
    pub key: String,
    pub bytes: u64,
    pub expires: Instant,
}

impl Ledger {
    pub fn new(budget: u64) -> Self {
        Ledger { budget, used: 0, next_seq: 0, entries: HashMap::new(), order: VecDeque::new() }
    }

    /// Bytes counted now.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Keys counted now.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether this node wrote `key`, Redis acknowledged it, and it lives until at least `until`.
    pub fn holds_until(&self, key: &str, until: Instant) -> bool {
        self.entries.get(key).is_some_and(|e| e.confirmed && e.expires >= until)
    }

    /// Marks a write of `key` acknowledged by Redis.
    pub fn confirm(&mut self, key: &str) {
        if let Some(e) = self.entries.get_mut(key) {
            e.confirmed = true;
        }
    }

    /// Forgets keys whose TTL ran out by `now` (Redis dropped them itself).
    fn drop_expired(&mut self, now: Instant) {
        self.entries.retain(|_, e| {
            let live = e.expires > now;
            if !live {
                self.used -= e.bytes;
            }
            live
        });
        let entries = &self.entries;
        self.order.retain(|(seq, k)| entries.get(k).is_some_and(|e| e.seq == *seq));
    }

    /// Counts a write of `bytes` under `key` (living until `expires`), first letting go of this
    /// node's oldest keys until it fits; returns those, to be deleted. `None` (nothing changed)
    /// when the write alone is larger than the budget.
    pub fn admit(&mut self, key: &str, bytes: u64, expires: Instant, now: Instant) -> Option<Vec<Evicted>> {
        if bytes > self.budget {
            return None;
        }
        if let Some(old) = self.entries.remove(key) {
            self.used -= old.bytes;
        }
        let mut evicted = Vec::new();
        if self.used + bytes > self.budget {
            self.drop_expired(now);
        }
        while self.used + bytes > self.budget {
            let Some((seq, k)) = self.order.pop_front() else { break };
            match self.entries.get(&k) {
                Some(e) if e.seq == seq => {
                    let e = *e;
                    self.entries.remove(&k);
                    self.used -= e.bytes;
                    evicted.push(Evicted { key: k, bytes: e.bytes, expires: e.expires });
                }
                _ => {}
            }
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.entries.insert(key.to_string(), Entry { bytes, expires, seq, confirmed: false });
        self.order.push_back((seq, key.to_string()));
        self.used += bytes;
        Some(evicted)
    }

    /// Counts again keys whose delete failed (they may still be in Redis), as the oldest.
    pub fn restore(&mut self, evicted: Vec<Evicted>) {
        for e in evicted.into_iter().rev() {
            if self.entries.contains_key(&e.key) {
                continue;
            }
            let seq = self.next_seq;
            self.next_seq += 1;
            self.entries.insert(e.key.clone(), Entry { bytes: e.bytes, expires: e.expires, seq, confirmed: false });
            self.order.push_front((seq, e.key));
            self.used += e.bytes;
        }
    }

    /// Forgets a key this node deleted itself.
    pub fn forget(&mut self, key: &str) {
        if let Some(e) = self.entries.remove(key) {
            self.used -= e.bytes;
        }
    }
}

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
    requests: AtomicU64,
    errors: AtomicU64,
    bad_values: AtomicU64,
    evictions: AtomicU64,
    written: AtomicU64,
    write_dropped: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// A store waiting to be written, with its share of the write queue's bytes.
struct WriteJob {
    blocks: Vec<StoredBlock>,
    _bytes: tokio::sync::OwnedSemaphorePermit,
}

/// One key to write: its name, its value and its TTL.
struct Put {
    key: String,
    value: Bytes,
    ttl: Duration,
}

/// The Redis tier of one node. Cheap to share (`Arc`).
pub struct RedisTier {
    cfg: RedisTierConfig,
    nodes: Nodes,
    ledger: Mutex<Ledger>,
    counters: Counters,
    write_tx: mpsc::Sender<WriteJob>,
    write_bytes: Arc<Semaphore>,
    write_queue_bytes: usize,
}

/// `CMD key`.
fn one_key(cmd: &str, key: &str) -> redis::Cmd {
    let mut c = redis::cmd(cmd);
    c.arg(key);
    c
}

/// `<prefix>:<namespace hex>:b:<key hex>`.
pub fn block_key(prefix: &str, ns: &NamespaceId, key: &BlockKey) -> String {
    format!("{prefix}:{}:b:{}", hex(&ns.0), hex(&key.0))
}

/// `<prefix>:<namespace hex>:s:<session id hex>` (hex: an id may hold any bytes, braces too).
pub fn session_key(prefix: &str, ns: &NamespaceId, id: &str) -> String {
    format!("{prefix}:{}:s:{}", hex(&ns.0), hex(id.as_bytes()))
}

fn hex(b: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(2 * b.len());
    for x in b {
        let _ = write!(s, "{x:02x}");
    }
    s
}

/// A block as its Redis value: the frame (header + payload).
fn frame_value(b: &StoredBlock) -> Bytes {
    let mut v = Vec::with_capacity(FRAME_HEADER_LEN + b.payload.len());
    v.extend_from_slice(&b.header.encode());
    v.extend_from_slice(&b.payload);
    Bytes::from(v)
}

impl RedisTier {
    /// The tier over the Redis `cfg` names (validated), and its writer task, which ends when
    /// `stop` turns true or the tier is dropped. Connects lazily: an unreachable Redis makes
    /// misses and dropped writes until it answers.
    pub fn start(
        cfg: RedisTierConfig,
        stop: watch::Receiver<bool>,
    ) -> Result<(Arc<RedisTier>, tokio::task::JoinHandle<()>), ServerError> {
        cfg.validate()?;
        let nodes = Nodes::new(&cfg.seeds(), cfg.cluster, cfg.timeout.0)?;
        let (tx, rx) = mpsc::channel(WRITE_QUEUE);
        let queue = cfg.write_queue_bytes.0 as usize;
        let tier = Arc::new(RedisTier {
            ledger: Mutex::new(Ledger::new(cfg.budget.0)),
            cfg,
            nodes,
            counters: Counters::default(),
            write_tx: tx,
            write_bytes: Arc::new(Semaphore::new(queue)),
            write_queue_bytes: queue,
        });
        ::metrics::gauge!("kvtier_tier_capacity_bytes", "tier" => "redis").set(tier.cfg.budget.0 as f64);
        let task = tokio::spawn(write_loop(Arc::downgrade(&tier), rx, stop));
        Ok((tier, task))
    }

    /// Sends one single-key command per key (see [`Nodes::run`]); failures counted under `op`.
    async fn run(&self, op: &'static str, keys: &[String], cmds: Vec<redis::Cmd>) -> Vec<Option<redis::Value>> {
        let r = self.nodes.run(keys, cmds).await;
        bump(&self.counters.requests, r.pipelines);
        ::metrics::counter!("kvtier_redis_requests_total", "op" => op).increment(r.pipelines);
        if !r.failures.is_empty() {
            let n = r.failures.len() as u64;
            bump(&self.counters.errors, n);
            ::metrics::counter!("kvtier_redis_errors_total", "op" => op).increment(n);
            tracing::debug!("redis tier {op}: {}", r.failures.join("; "));
        }
        r.values
    }

    /// Loads `keys` (which every local tier missed): one entry per key, a verified block or
    /// `None`. One pipeline of `GET`s per Redis node (on a cluster, per master that owns some of
    /// the keys), all at once, each within the timeout; never errs: a failure is a miss, counted.
    pub async fn fetch(&self, ns: &Namespace, keys: &[BlockKey]) -> Vec<Option<StoredBlock>> {
        if keys.is_empty() {
            return Vec::new();
        }
        let id = ns.id();
        let names: Vec<String> = keys.iter().map(|k| block_key(&self.cfg.key_prefix, &id, k)).collect();
        let cmds = names.iter().map(|n| one_key("GET", n)).collect();
        let values = self.run("get", &names, cmds).await;
        let out: Vec<Option<StoredBlock>> = keys
            .iter()
            .zip(values)
            .map(|(k, v)| match v {
                Some(redis::Value::BulkString(b)) => self.accept(ns, k, Bytes::from(b)),
                _ => None,
            })
            .collect();
        let hits = out.iter().filter(|b| b.is_some()).count() as u64;
        let misses = keys.len() as u64 - hits;
        bump(&self.counters.hits, hits);
        bump(&self.counters.misses, misses);
        ::metrics::counter!("kvtier_tier_hits_total", "tier" => "redis").increment(hits);
        ::metrics::counter!("kvtier_tier_misses_total", "tier" => "redis").increment(misses);
        out
    }

    /// A value read for `key` as a block, if it is that block and intact (counted either way).
    fn accept(&self, ns: &Namespace, key: &BlockKey, value: Bytes) -> Option<StoredBlock> {
        let ok = BlockFrame::decode(value).ok().filter(|f| {
            let h = &f.header;
            h.namespace == ns.id() && h.key == *key && h.layout == ns.layout && h.check_size().is_ok()
        });
        match ok {
            Some(f) => {
                bump(&self.counters.bytes_in, f.payload.len() as u64);
                ::metrics::counter!("kvtier_tier_bytes_in_total", "tier" => "redis").increment(f.payload.len() as u64);
                Some(StoredBlock { header: f.header, payload: f.payload })
            }
            None => {
                bump(&self.counters.bad_values, 1);
                bump(&self.counters.errors, 1);
                ::metrics::counter!("kvtier_redis_bad_values_total").increment(1);
                tracing::warn!(%key, "a Redis value fails its checks (not the block, or damaged); a miss");
                None
            }
        }
    }

    /// Which of `keys` Redis holds (one pipeline of `EXISTS` per node). A failure reads as "not
    /// held": a lookup may under-report.
    pub async fn held(&self, ns: &NamespaceId, keys: &[BlockKey]) -> Vec<bool> {
        if keys.is_empty() {
            return Vec::new();
        }
        let names: Vec<String> = keys.iter().map(|k| block_key(&self.cfg.key_prefix, ns, k)).collect();
        let cmds = names.iter().map(|n| one_key("EXISTS", n)).collect();
        self.run("exists", &names, cmds).await.into_iter().map(|v| matches!(v, Some(redis::Value::Int(1)))).collect()
    }

    /// Queues blocks this node just stored to be written to Redis (with `block_ttl`), after the
    /// client's acknowledgement: a store never waits for (or fails with) Redis. Past the write
    /// queue's bytes the blocks are not shared (counted in `kvtier_redis_write_dropped_total`).
    pub fn store(&self, blocks: Vec<StoredBlock>) {
        let now = Instant::now();
        let blocks: Vec<StoredBlock> = {
            let ledger = self.ledger.lock();
            let until = now + self.cfg.block_ttl.0 / 2;
            blocks
                .into_iter()
                .filter(|b| {
                    // Written by this node not long ago: still there (or deleted by its budget).
                    !ledger.holds_until(&block_key(&self.cfg.key_prefix, &b.header.namespace, &b.header.key), until)
                })
                .collect()
        };
        if blocks.is_empty() {
            return;
        }
        let n = blocks.len() as u64;
        let bytes: usize = blocks.iter().map(|b| b.payload.len() + FRAME_HEADER_LEN).sum();
        let dropped = || {
            bump(&self.counters.write_dropped, n);
            ::metrics::counter!("kvtier_redis_write_dropped_total").increment(n);
        };
        let Ok(permit) = self.write_bytes.clone().try_acquire_many_owned(bytes.min(self.write_queue_bytes) as u32)
        else {
            return dropped();
        };
        if self.write_tx.try_send(WriteJob { blocks, _bytes: permit }).is_err() {
            dropped();
        }
    }

    /// [`RedisTier::write`] in batches of at most [`WRITE_BATCH_BYTES`] (each within the timeout);
    /// returns how many were written.
    async fn write_batched(&self, puts: Vec<Put>) -> usize {
        let mut written = 0;
        let mut batch = Vec::new();
        let mut bytes = 0;
        for p in puts {
            if !batch.is_empty() && bytes + p.value.len() > WRITE_BATCH_BYTES {
                written += self.write(std::mem::take(&mut batch)).await;
                bytes = 0;
            }
            bytes += p.value.len();
            batch.push(p);
        }
        if !batch.is_empty() {
            written += self.write(batch).await;
        }
        written
    }

    /// Writes `puts` (after making room for them in the budget: one pipeline of `DEL`s and `SET`s
    /// per node), within the timeout; returns how many were written (writes that failed stay
    /// counted: they may have landed).
    async fn write(&self, puts: Vec<Put>) -> usize {
        let now = Instant::now();
        let mut admitted = Vec::with_capacity(puts.len());
        let mut evicted = Vec::new();
        {
            let mut ledger = self.ledger.lock();
            for p in puts {
                let bytes = p.value.len() as u64 + p.key.len() as u64 + KEY_OVERHEAD;
                match ledger.admit(&p.key, bytes, now + p.ttl, now) {
                    Some(gone) => {
                        evicted.extend(gone);
                        admitted.push(p);
                    }
                    None => {
                        ::metrics::counter!("kvtier_redis_budget_refused_total").increment(1);
                    }
                }
            }
            ::metrics::gauge!("kvtier_redis_budget_used_bytes").set(ledger.used() as f64);
        }
        // A key evicted and written again in the same batch is not deleted.
        evicted.retain(|e| !admitted.iter().any(|p| p.key == e.key));
        if admitted.is_empty() && evicted.is_empty() {
            return 0;
        }
        let n = admitted.len();
        let sent: u64 = admitted.iter().map(|p| p.value.len() as u64).sum();
        let mut names: Vec<String> = evicted.iter().map(|e| e.key.clone()).collect();
        let mut cmds: Vec<redis::Cmd> = names.iter().map(|k| one_key("DEL", k)).collect();
        for p in &admitted {
            let mut set = redis::cmd("SET");
            set.arg(&p.key).arg(p.value.as_ref()).arg("PX").arg(p.ttl.as_millis() as u64);
            cmds.push(set);
            names.push(p.key.clone());
        }
        let replies = self.run("set", &names, cmds).await;
        let (dels, sets) = replies.split_at(evicted.len());
        // A key whose delete failed may still be in Redis: it counts again.
        let not_deleted: Vec<Evicted> =
            evicted.iter().zip(dels).filter(|(_, r)| r.is_none()).map(|(e, _)| e.clone()).collect();
        let written = sets.iter().filter(|r| r.is_some()).count();
        if !evicted.is_empty() {
            let k = evicted.len() as u64;
            bump(&self.counters.evictions, k);
            ::metrics::counter!("kvtier_redis_budget_evictions_total").increment(k);
        }
        {
            let mut ledger = self.ledger.lock();
            ledger.restore(not_deleted);
            for (p, r) in admitted.iter().zip(sets) {
                if r.is_some() {
                    ledger.confirm(&p.key);
                }
            }
        }
        bump(&self.counters.written, written as u64);
        ::metrics::counter!("kvtier_redis_written_keys_total").increment(written as u64);
        if written == n {
            bump(&self.counters.bytes_out, sent);
            ::metrics::counter!("kvtier_tier_bytes_out_total", "tier" => "redis").increment(sent);
        }
        written
    }

    /// Writes a parked session to Redis: its blocks not known to live there as long as the
    /// session (read from this node's tiers through `load`), then its manifest, each with the
    /// session's TTL plus `session_ttl_slack`. Bounded by the timeout; a failure is logged and
    /// counted, and the park stands (it is held on this node).
    pub async fn park<F, Fut>(&self, m: &SessionManifest, load: F) -> bool
    where
        F: Fn(BlockKey) -> Fut,
        Fut: std::future::Future<Output = Option<StoredBlock>>,
    {
        let ttl = m.ttl + self.cfg.session_ttl_slack.0;
        let until = Instant::now() + ttl;
        let prefix = &self.cfg.key_prefix;
        let mut puts = Vec::new();
        for k in m.keys.iter().chain(m.tail.iter()) {
            let name = block_key(prefix, &m.namespace, k);
            if self.ledger.lock().holds_until(&name, until) {
                continue;
            }
            let Some(b) = load(*k).await else { continue };
            puts.push(Put { key: name, value: frame_value(&b), ttl: ttl.max(self.cfg.block_ttl.0) });
        }
        let blocks = puts.len();
        if blocks > 0 && self.write_batched(puts).await < blocks {
            tracing::warn!(session = %m.id, "redis tier: the session's blocks could not all be written; not shared");
            ::metrics::counter!("kvtier_redis_session_errors_total", "op" => "park").increment(1);
            return false;
        }
        let put = Put { key: session_key(prefix, &m.namespace, &m.id), value: encode_manifest(m), ttl };
        if self.write(vec![put]).await == 1 {
            true
        } else {
            ::metrics::counter!("kvtier_redis_session_errors_total", "op" => "park").increment(1);
            false
        }
    }

    /// A session parked (on any node) from its manifest in Redis, its TTL restarted there (a
    /// resume restarts it, as on the node that holds it); `None` when Redis has none (or a bad one,
    /// counted), or can't be reached in time.
    pub async fn resume(&self, ns: &NamespaceId, id: &str) -> Option<SessionManifest> {
        let name = session_key(&self.cfg.key_prefix, ns, id);
        let keys = [name.clone()];
        let value = match self.run("session_get", &keys, vec![one_key("GET", &name)]).await.pop().flatten()? {
            redis::Value::BulkString(b) => b,
            _ => return None,
        };
        let now = Instant::now();
        let Some(m) = decode_manifest(&value, now).filter(|m| m.namespace == *ns && m.id == id) else {
            bump(&self.counters.bad_values, 1);
            ::metrics::counter!("kvtier_redis_bad_values_total").increment(1);
            tracing::warn!(session = id, "a session manifest in Redis fails its checks; not resumed");
            return None;
        };
        let ttl = m.ttl + self.cfg.session_ttl_slack.0;
        let mut touch = one_key("PEXPIRE", &name);
        touch.arg(ttl.as_millis() as u64);
        self.run("session_touch", &keys, vec![touch]).await;
        ::metrics::counter!("kvtier_redis_session_resumes_total").increment(1);
        Some(m)
    }

    /// Removes a dropped session's manifest from Redis (its blocks leave with their TTLs or the
    /// budget: other sessions and the prefix cache may share them).
    pub async fn drop_session(&self, ns: &NamespaceId, id: &str) {
        let name = session_key(&self.cfg.key_prefix, ns, id);
        let keys = [name.clone()];
        if self.run("session_del", &keys, vec![one_key("DEL", &name)]).await[0].is_some() {
            self.ledger.lock().forget(&name);
        }
    }

    /// The tier's counters: the budget as its capacity, what the ledger counts as resident.
    pub fn stats(&self) -> TierStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let (used, keys) = {
            let l = self.ledger.lock();
            (l.used(), l.len() as u64)
        };
        TierStats {
            capacity_bytes: self.cfg.budget.0,
            resident_bytes: used,
            allocated_bytes: used,
            blocks: keys,
            hits: get(&c.hits),
            misses: get(&c.misses),
            evictions: get(&c.evictions),
            bytes_in: get(&c.bytes_in),
            bytes_out: get(&c.bytes_out),
            requests: get(&c.requests),
            errors: get(&c.errors),
            ..TierStats::default()
        }
    }

    /// Values that failed their checks, blocks written, and blocks not written (queue full).
    pub fn value_counts(&self) -> (u64, u64, u64) {
        let c = &self.counters;
        (
            c.bad_values.load(Ordering::Relaxed),
            c.written.load(Ordering::Relaxed),
            c.write_dropped.load(Ordering::Relaxed),
        )
    }

    /// Whether Redis is a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.nodes.is_cluster()
    }

    /// The configured key prefix.
    pub fn key_prefix(&self) -> &str {
        &self.cfg.key_prefix
    }

    /// Waits until every queued write has been sent (true), or `within` passed (false).
    pub async fn flush(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while self.write_bytes.available_permits() < self.write_queue_bytes {
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        true
    }
}

/// Writes queued stores one job after the other until `stop` turns true or the tier is gone.
async fn write_loop(
    tier: std::sync::Weak<RedisTier>,
    mut rx: mpsc::Receiver<WriteJob>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let job = tokio::select! {
            _ = crate::stopped(&mut stop) => return,
            job = rx.recv() => job,
        };
        let (Some(job), Some(tier)) = (job, tier.upgrade()) else { return };
        let ttl = tier.cfg.block_ttl.0;
        let puts: Vec<Put> = job
            .blocks
            .iter()
            .map(|b| Put {
                key: block_key(&tier.cfg.key_prefix, &b.header.namespace, &b.header.key),
                value: frame_value(b),
                ttl,
            })
            .collect();
        let n = puts.len();
        let lost = (n - tier.write_batched(puts).await.min(n)) as u64;
        if lost > 0 {
            bump(&tier.counters.write_dropped, lost);
            ::metrics::counter!("kvtier_redis_write_dropped_total").increment(lost);
        }
        drop(job);
    }
}

/// Format of a manifest value: magic, version, then the fields, then an xxh3 of all before it.
const MANIFEST_MAGIC: &[u8; 4] = b"KVSM";
const MANIFEST_VERSION: u8 = 1;

fn encode_manifest(m: &SessionManifest) -> Bytes {
    let mut v = Vec::with_capacity(64 + m.id.len() + 32 * (m.keys.len() + 1));
    v.extend_from_slice(MANIFEST_MAGIC);
    v.push(MANIFEST_VERSION);
    v.extend_from_slice(&m.namespace.0);
    v.extend_from_slice(&(m.id.len() as u16).to_le_bytes());
    v.extend_from_slice(m.id.as_bytes());
    v.extend_from_slice(&m.token_count.to_le_bytes());
    v.extend_from_slice(&(m.ttl.as_millis() as u64).to_le_bytes());
    v.push(m.priority as u8);
    v.extend_from_slice(&m.version.to_le_bytes());
    v.extend_from_slice(&m.bytes.to_le_bytes());
    v.extend_from_slice(&(m.keys.len() as u32).to_le_bytes());
    for k in &m.keys {
        v.extend_from_slice(&k.0);
    }
    match &m.tail {
        Some(t) => {
            v.push(1);
            v.extend_from_slice(&t.0);
        }
        None => v.push(0),
    }
    let sum = xxhash_rust::xxh3::xxh3_64(&v);
    v.extend_from_slice(&sum.to_le_bytes());
    Bytes::from(v)
}

/// A manifest from its value (its TTL restarting at `now`); `None` if it is not one.
fn decode_manifest(b: &[u8], now: Instant) -> Option<SessionManifest> {
    let (body, sum) = b.split_at_checked(b.len().checked_sub(8)?)?;
    if xxhash_rust::xxh3::xxh3_64(body) != u64::from_le_bytes(sum.try_into().ok()?) {
        return None;
    }
    let mut r = Reader(body);
    if r.take(4)? != MANIFEST_MAGIC || r.take(1)?[0] != MANIFEST_VERSION {
        return None;
    }
    let namespace = NamespaceId(r.take(16)?.try_into().ok()?);
    let id_len = u16::from_le_bytes(r.take(2)?.try_into().ok()?) as usize;
    let id = String::from_utf8(r.take(id_len)?.to_vec()).ok()?;
    let token_count = r.u64()?;
    let ttl = Duration::from_millis(r.u64()?);
    let priority = Priority::from_u32(u32::from(r.take(1)?[0]));
    let version = r.u64()?;
    let bytes = r.u64()?;
    let n = u32::from_le_bytes(r.take(4)?.try_into().ok()?) as usize;
    if n > r.0.len() / 32 {
        return None;
    }
    let keys: Vec<BlockKey> =
        (0..n).map(|_| r.take(32).and_then(|k| k.try_into().ok()).map(BlockKey)).collect::<Option<_>>()?;
    let tail = match r.take(1)?[0] {
        0 => None,
        1 => Some(BlockKey(r.take(32)?.try_into().ok()?)),
        _ => return None,
    };
    if !r.0.is_empty() {
        return None;
    }
    Some(SessionManifest {
        namespace,
        id,
        keys,
        tail,
        token_count,
        ttl,
        expires_at: now + ttl,
        priority,
        version,
        bytes,
        // Redis keeps the one copy: nothing to tell sessions apart from.
        created: None,
    })
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (a, b) = self.0.split_at_checked(n)?;
        self.0 = b;
        Some(a)
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
}

#[cfg(test)]
mod tests;
