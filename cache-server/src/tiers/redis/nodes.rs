//! How the Redis tier reaches Redis: [`Nodes`] sends one pipeline per Redis node for a batch of
//! single-key commands — to the one Redis, or, on a Redis Cluster, to the master that owns each
//! key's slot — and gives back one reply per command, `None` where its node failed, timed out or
//! answered an error. Every pipeline runs under the timeout; nothing here retries or waits longer.
//!
//! The cluster's slot map is read with `CLUSTER SLOTS` from any node that answers (the seeds
//! first, then the nodes it knew), at first use and again — at most once per
//! [`REFRESH_AFTER`] — after a node failed or answered `MOVED`, `ASK`, `TRYAGAIN` or
//! `CLUSTERDOWN`. The keys of a master that died are misses (its connection is refused at once);
//! the other masters' keys keep being served. This is done here rather than with the redis
//! crate's cluster client, whose slot refresh holds every request while it retries a dead master:
//! in a test with a 3-master cluster and no replicas, every load became a timeout from half a
//! second after one master was killed.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::Value;

use crate::error::ServerError;

/// Slots of a Redis Cluster.
pub const SLOTS: usize = 16384;
/// Shortest interval between two reads of a cluster's slot map.
pub const REFRESH_AFTER: Duration = Duration::from_millis(500);

/// The slot of a key (no hash tags: the tier's keys have no braces).
pub fn slot(key: &str) -> u16 {
    crc16::State::<crc16::XMODEM>::calculate(key.as_bytes()) % SLOTS as u16
}

/// One Redis node: a reconnecting connection.
struct Node {
    client: redis::Client,
    con: Mutex<ConnectionManager>,
}

fn manager(client: &redis::Client, timeout: Duration) -> Result<ConnectionManager, ServerError> {
    let c = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(Some(timeout))
        .set_number_of_retries(1)
        .set_min_delay(Duration::from_millis(10))
        .set_max_delay(timeout);
    ConnectionManager::new_lazy_with_config(client.clone(), c)
        .map_err(|e| ServerError::Config(format!("[redis_tier] Redis client: {e}")))
}

impl Node {
    fn open(url: &str, timeout: Duration) -> Result<Node, ServerError> {
        let client = redis::Client::open(url)
            .map_err(|e| ServerError::Config(format!("[redis_tier] Redis URL {url:?}: {e}")))?;
        let con = Mutex::new(manager(&client, timeout)?);
        Ok(Node { client, con })
    }

    /// Sends `pipe` (built with `ignore_errors`) within `timeout`: one reply per command.
    async fn send(&self, pipe: &redis::Pipeline, timeout: Duration) -> Result<Vec<Value>, String> {
        let mut con = self.con.lock().clone();
        match tokio::time::timeout(timeout, pipe.query_async::<Vec<Value>>(&mut con)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                self.reset(timeout);
                Err(e.to_string())
            }
            Err(_) => {
                self.reset(timeout);
                Err(format!("no answer within {timeout:?}"))
            }
        }
    }

    /// A fresh connection for the next call: nothing of a broken one carries over.
    fn reset(&self, timeout: Duration) {
        if let Ok(c) = manager(&self.client, timeout) {
            *self.con.lock() = c;
        }
    }
}

/// Which node serves each slot.
#[derive(Default)]
struct SlotMap {
    /// Per slot: an index into `nodes`, or `u16::MAX` when no node serves it.
    owner: Vec<u16>,
    nodes: Vec<(String, Arc<Node>)>,
}

/// The Redis nodes of the tier (see the module doc).
pub struct Nodes {
    timeout: Duration,
    kind: Kind,
}

enum Kind {
    Single(Node),
    Cluster {
        seeds: Vec<String>,
        map: RwLock<Arc<SlotMap>>,
        /// Held by the one request refreshing the map; the others use the map they have.
        refreshing: tokio::sync::Mutex<()>,
        last_refresh: Mutex<Option<Instant>>,
        stale: std::sync::atomic::AtomicBool,
    },
}

/// What one batch did: replies per command, and the failures to count (per node).
pub struct Replies {
    pub values: Vec<Option<Value>>,
    pub pipelines: u64,
    pub failures: Vec<String>,
}

impl Nodes {
    /// One Redis at `url`, or a Redis Cluster reached through `seeds` (`cluster`). Connects lazily.
    pub fn new(seeds: &[String], cluster: bool, timeout: Duration) -> Result<Nodes, ServerError> {
        let kind = if cluster {
            for s in seeds {
                redis::Client::open(s.as_str())
                    .map_err(|e| ServerError::Config(format!("[redis_tier] Redis URL {s:?}: {e}")))?;
            }
            Kind::Cluster {
                seeds: seeds.to_vec(),
                map: RwLock::new(Arc::new(SlotMap::default())),
                refreshing: tokio::sync::Mutex::new(()),
                last_refresh: Mutex::new(None),
                stale: std::sync::atomic::AtomicBool::new(true),
            }
        } else {
            let url = seeds.first().ok_or_else(|| ServerError::Config("[redis_tier] no Redis URL".into()))?;
            Kind::Single(Node::open(url, timeout)?)
        };
        Ok(Nodes { timeout, kind })
    }

    pub fn is_cluster(&self) -> bool {
        matches!(self.kind, Kind::Cluster { .. })
    }

    /// Sends `cmds` (one single-key command per `keys[i]`): one pipeline per node, all at once.
    pub async fn run(&self, keys: &[String], cmds: Vec<redis::Cmd>) -> Replies {
        let mut out = Replies { values: vec![None; cmds.len()], pipelines: 0, failures: Vec::new() };
        match &self.kind {
            Kind::Single(node) => {
                let mut pipe = redis::pipe();
                pipe.ignore_errors();
                for c in cmds {
                    pipe.add_command(c);
                }
                out.pipelines = 1;
                match node.send(&pipe, self.timeout).await {
                    Ok(v) if v.len() == out.values.len() => {
                        for (slot, v) in out.values.iter_mut().zip(v) {
                            *slot = usable(v, &mut out.failures, &mut false);
                        }
                    }
                    Ok(v) => out.failures.push(format!("{} replies to {} commands", v.len(), out.values.len())),
                    Err(e) => out.failures.push(e),
                }
            }
            Kind::Cluster { stale, .. } => {
                let map = self.slot_map().await;
                let mut by_node: HashMap<u16, (redis::Pipeline, Vec<usize>)> = HashMap::new();
                let mut moved = false;
                for (i, (k, c)) in keys.iter().zip(cmds).enumerate() {
                    let owner = map.owner.get(slot(k) as usize).copied().unwrap_or(u16::MAX);
                    if owner == u16::MAX {
                        // No node serves the slot (yet): a miss, and the map is read again.
                        moved = true;
                        continue;
                    }
                    let (pipe, idx) = by_node.entry(owner).or_insert_with(|| {
                        let mut p = redis::pipe();
                        p.ignore_errors();
                        (p, Vec::new())
                    });
                    pipe.add_command(c);
                    idx.push(i);
                }
                out.pipelines = by_node.len() as u64;
                let sends = by_node.iter().map(|(&owner, (pipe, idx))| {
                    let node = map.nodes[owner as usize].1.clone();
                    async move { (idx, node.send(pipe, self.timeout).await) }
                });
                for (idx, res) in futures::future::join_all(sends).await {
                    match res {
                        Ok(v) if v.len() == idx.len() => {
                            for (&i, v) in idx.iter().zip(v) {
                                out.values[i] = usable(v, &mut out.failures, &mut moved);
                            }
                        }
                        Ok(v) => out.failures.push(format!("{} replies to {} commands", v.len(), idx.len())),
                        Err(e) => {
                            out.failures.push(e);
                            moved = true;
                        }
                    }
                }
                if moved {
                    stale.store(true, std::sync::atomic::Ordering::Relaxed);
                }
            }
        }
        out
    }

    /// The cluster's slot map, read again first when it is stale (and not read in the last
    /// [`REFRESH_AFTER`]) by one caller at a time, within the timeout.
    async fn slot_map(&self) -> Arc<SlotMap> {
        let Kind::Cluster { seeds, map, refreshing, last_refresh, stale } = &self.kind else {
            return Arc::new(SlotMap::default());
        };
        let current = map.read().clone();
        if !stale.load(std::sync::atomic::Ordering::Relaxed) {
            return current;
        }
        let now = Instant::now();
        if last_refresh.lock().is_some_and(|t| now < t + REFRESH_AFTER) {
            return current;
        }
        let Ok(_guard) = refreshing.try_lock() else { return current };
        *last_refresh.lock() = Some(now);
        let mut urls: Vec<String> = seeds.clone();
        urls.extend(current.nodes.iter().map(|(u, _)| u.clone()).filter(|u| !seeds.contains(u)));
        let deadline = tokio::time::Instant::now() + self.timeout;
        for url in urls {
            let Ok(Ok(ranges)) = tokio::time::timeout_at(deadline, read_slots(&url, self.timeout)).await else {
                continue;
            };
            let next = Arc::new(build(&current, ranges, self.timeout));
            *map.write() = next.clone();
            stale.store(false, std::sync::atomic::Ordering::Relaxed);
            return next;
        }
        tracing::warn!("redis tier: no node of the Redis Cluster answered CLUSTER SLOTS within {:?}", self.timeout);
        current
    }
}

/// A reply as a usable value: `None` for an error reply (counted; `moved` set when it says the
/// slot map changed).
fn usable(v: Value, failures: &mut Vec<String>, moved: &mut bool) -> Option<Value> {
    match v {
        Value::ServerError(e) => {
            let code = e.code().to_string();
            if matches!(code.as_str(), "MOVED" | "ASK" | "TRYAGAIN" | "CLUSTERDOWN") {
                *moved = true;
            }
            failures.push(format!("Redis answered {code}"));
            None
        }
        v => Some(v),
    }
}

/// `(first slot, last slot, master url)` of every range `url` serves or knows.
async fn read_slots(url: &str, timeout: Duration) -> Result<Vec<(u16, u16, String)>, String> {
    let client = redis::Client::open(url).map_err(|e| e.to_string())?;
    let cfg =
        redis::AsyncConnectionConfig::new().set_connection_timeout(Some(timeout)).set_response_timeout(Some(timeout));
    let mut con = client.get_multiplexed_async_connection_with_config(&cfg).await.map_err(|e| e.to_string())?;
    let v: Value = redis::cmd("CLUSTER").arg("SLOTS").query_async(&mut con).await.map_err(|e| e.to_string())?;
    let Value::Array(ranges) = v else { return Err("CLUSTER SLOTS: not an array".into()) };
    let mut out = Vec::new();
    for r in ranges {
        let Value::Array(f) = r else { continue };
        let (Some(Value::Int(a)), Some(Value::Int(b)), Some(Value::Array(master))) = (f.first(), f.get(1), f.get(2))
        else {
            continue;
        };
        let host = match master.first() {
            Some(Value::BulkString(h)) => String::from_utf8_lossy(h).into_owned(),
            Some(Value::SimpleString(h)) => h.clone(),
            _ => continue,
        };
        let Some(Value::Int(port)) = master.get(1) else { continue };
        // A node that doesn't know its own address answers an empty host: the one asked.
        let host = if host.is_empty() || host == "?" {
            url.trim_start_matches("redis://").rsplit_once(':').map_or(host, |(h, _)| h.to_string())
        } else {
            host
        };
        if (0..SLOTS as i64).contains(a) && (*a..SLOTS as i64).contains(b) {
            out.push((*a as u16, *b as u16, format!("redis://{host}:{port}")));
        }
    }
    Ok(out)
}

/// The slot map of `ranges`, keeping the connections of nodes `old` already had.
fn build(old: &SlotMap, ranges: Vec<(u16, u16, String)>, timeout: Duration) -> SlotMap {
    let mut m = SlotMap { owner: vec![u16::MAX; SLOTS], nodes: Vec::new() };
    for (a, b, url) in ranges {
        let idx = match m.nodes.iter().position(|(u, _)| *u == url) {
            Some(i) => i,
            None => {
                let node = match old.nodes.iter().find(|(u, _)| *u == url) {
                    Some((_, n)) => n.clone(),
                    None => match Node::open(&url, timeout) {
                        Ok(n) => Arc::new(n),
                        Err(_) => continue,
                    },
                };
                m.nodes.push((url, node));
                m.nodes.len() - 1
            }
        };
        for s in a..=b {
            m.owner[s as usize] = idx as u16;
        }
    }
    m
}
