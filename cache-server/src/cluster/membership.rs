//! Who is in the cluster: the [`Membership`] seam, a watchable [`Snapshot`] of the members, with
//! [`Embedded`] (one node, in process: a node without `--cluster`) and [`RedisMembership`] (each
//! node registers itself in Redis under a key with a TTL, refreshes it, and polls the member set).
//!
//! Redis layout (all keys share the hash tag `{prefix}`, so they live in one slot of a Redis
//! Cluster): `{prefix}:member:<id>` is a hash with the member's fields and a TTL;
//! `{prefix}:members` is the set of ids, pruned of ids whose hash has expired. Every tick runs one
//! Lua script that refreshes (or re-creates) this node's hash and reads every live member, so a
//! tick is one round trip and sees a consistent set.
//!
//! Failures: every Redis call has a timeout. When Redis can't be reached the last known members
//! are kept and marked stale (`kvtier_membership_stale` = 1, one warning); when it answers again
//! the node re-registers at once. For one TTL after that (or after Redis lost our key) members
//! missing from Redis are kept, so a restarted Redis does not make live members blink out while
//! they re-register. A member that leaves deletes its key; one that dies disappears when its TTL
//! runs out.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::future::BoxFuture;
use parking_lot::Mutex;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Script, Value};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::member::{Labels, Member, NodeId};
use crate::error::ServerError;

/// Most members a snapshot holds; more in Redis are ignored (and counted).
pub const MAX_MEMBERS: usize = 4096;

/// The members as one node sees them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    /// Sorted by id; always holds this node.
    pub members: Arc<[Member]>,
    /// True while the membership store can't be reached: `members` is the last known set.
    pub stale: bool,
    /// Bumped on every change of `members` (not of `stale`).
    pub generation: u64,
}

impl Snapshot {
    /// The member with this id.
    pub fn get(&self, id: &NodeId) -> Option<&Member> {
        self.members.binary_search_by(|m| m.id.cmp(id)).ok().map(|i| &self.members[i])
    }
}

/// The seam: where a node learns who its peers are. No method waits longer than the store's
/// timeout.
///
/// ```
/// use kvtier_server::cluster::{Embedded, Labels, Member, Membership, NodeId, Placement};
///
/// let me = Member {
///     id: NodeId::new("node-1").unwrap(),
///     grpc_addr: "127.0.0.1:7070".into(),
///     data_addr: "127.0.0.1:7071".into(),
///     labels: Labels::default(),
///     capacity: 1 << 30,
///     since_ms: 0,
/// };
/// let membership: Box<dyn Membership> = Box::new(Embedded::new(me).unwrap());
/// let snap = membership.watch().borrow().clone();
/// assert_eq!(snap.members.len(), 1);
/// let placement = Placement::new(&snap.members); // rebuilt whenever `watch()` reports a change
/// assert_eq!(placement.len(), 1);
/// ```
pub trait Membership: Send + Sync {
    /// This node, as it announces itself.
    fn local(&self) -> &Member;

    /// The current snapshot, and every change after it.
    fn watch(&self) -> watch::Receiver<Snapshot>;

    /// The current snapshot.
    fn snapshot(&self) -> Snapshot {
        self.watch().borrow().clone()
    }

    /// Leaves the cluster on a graceful stop: stops refreshing and removes this node at once
    /// (bounded by the store's timeout; if that fails the node disappears when its TTL runs out).
    fn leave(&self) -> BoxFuture<'_, Result<(), ServerError>>;

    /// Resolves, with the reason, when this node must stop because another live process answers
    /// for its member id (two nodes configured with one `node_id`). Never, by default.
    fn fenced(&self) -> BoxFuture<'static, String> {
        Box::pin(std::future::pending())
    }

    /// Claims `what` across the cluster for at most `ttl` (the create of one session id), so
    /// that one node at a time does it: a token to give it back with ([`Self::release`]) when
    /// claimed, `None` while another node holds it. Without a shared store there is one node:
    /// always claimed.
    fn claim(&self, _what: &str, _ttl: Duration) -> BoxFuture<'_, Result<Option<String>, ServerError>> {
        Box::pin(async { Ok(Some(String::new())) })
    }

    /// Gives back a claim `token` from [`Self::claim`] holds, if it still does (past its TTL it
    /// may be another node's).
    fn release(&self, _what: &str, _token: String) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }

    /// Makes the claim `token` holds last `ttl` from now: `false` when it no longer holds it
    /// (it ran out, and may be another node's now).
    fn renew(&self, _what: &str, _token: &str, _ttl: Duration) -> BoxFuture<'_, Result<bool, ServerError>> {
        Box::pin(async { Ok(true) })
    }
}

/// One node, no store: the snapshot is this node, forever.
pub struct Embedded {
    local: Member,
    tx: watch::Sender<Snapshot>,
}

impl Embedded {
    pub fn new(local: Member) -> Result<Self, ServerError> {
        local.validate()?;
        let snap = Snapshot { members: Arc::from([local.clone()]), stale: false, generation: 1 };
        Ok(Embedded { local, tx: watch::Sender::new(snap) })
    }
}

impl Membership for Embedded {
    fn local(&self) -> &Member {
        &self.local
    }
    fn watch(&self) -> watch::Receiver<Snapshot> {
        self.tx.subscribe()
    }
    fn leave(&self) -> BoxFuture<'_, Result<(), ServerError>> {
        Box::pin(async { Ok(()) })
    }
}

/// Settings of [`RedisMembership`]. Values are checked by [`RedisMembership::start`].
#[derive(Clone, Debug)]
pub struct RedisMembershipConfig {
    url: String,
    local: Member,
    ttl: Duration,
    poll: Duration,
    op_timeout: Duration,
    prefix: String,
    /// Settings every member must share (`name=value`, space-separated), published beside the
    /// member and compared with every other member's (see [`Self::with_shared_settings`]).
    settings: String,
}

impl RedisMembershipConfig {
    /// `url` as the redis crate takes it (`redis://[user:pass@]host:port[/db]`, `rediss://`,
    /// `redis+unix://`); `local` is this node as it announces itself.
    pub fn new(url: impl Into<String>, local: Member) -> Self {
        RedisMembershipConfig {
            url: url.into(),
            local,
            ttl: Duration::from_secs(10),
            poll: Duration::from_secs(1),
            op_timeout: Duration::from_secs(1),
            prefix: "kvtier".into(),
            settings: String::new(),
        }
    }

    /// Settings every member of the cluster must share, as `(name, value)` pairs (no secrets:
    /// every member and Redis see them). Each member publishes its own; a member whose differ
    /// is said at WARN once per difference (`kvtier_membership_mismatched_members`).
    pub fn with_shared_settings(mut self, settings: &[(&str, String)]) -> Self {
        self.settings = settings.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ");
        self
    }

    /// How long a member's registration lives without a refresh: a killed node disappears after
    /// this long. Refreshes run every `min(poll interval, ttl / 3)`. 300 ms to 1 hour.
    /// Default: 10 s.
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// How often the member set is read (and the registration refreshed). 10 ms to the TTL.
    /// Default: 1 s.
    pub fn with_poll_interval(mut self, poll: Duration) -> Self {
        self.poll = poll;
        self
    }

    /// The longest any Redis call may take (connecting included). 10 ms to half the TTL.
    /// Default: 1 s.
    pub fn with_op_timeout(mut self, t: Duration) -> Self {
        self.op_timeout = t;
        self
    }

    /// Prefix of the keys, so several clusters can share one Redis. Default: `kvtier`.
    pub fn with_key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The interval between ticks (refresh + read).
    fn tick(&self) -> Duration {
        self.poll.min(self.ttl / 3)
    }

    fn validate(&self) -> Result<(), ServerError> {
        self.local.validate()?;
        let bad = |m: String| Err(ServerError::Config(format!("cluster membership: {m}")));
        if !(Duration::from_millis(300)..=Duration::from_secs(3600)).contains(&self.ttl) {
            return bad(format!("TTL {:?} is outside 300 ms ..= 1 h", self.ttl));
        }
        if !(Duration::from_millis(10)..=self.ttl).contains(&self.poll) {
            return bad(format!("poll interval {:?} is outside 10 ms ..= the TTL", self.poll));
        }
        if !(Duration::from_millis(10)..=self.ttl / 2).contains(&self.op_timeout) {
            return bad(format!("Redis timeout {:?} is outside 10 ms ..= half the TTL", self.op_timeout));
        }
        let p = &self.prefix;
        if p.is_empty() || p.len() > 64 || !p.bytes().all(|b| b.is_ascii_graphic() && b != b'{' && b != b'}') {
            return bad(format!("key prefix {p:?}: 1 to 64 printable characters, no braces"));
        }
        Ok(())
    }
}

/// Registers this node in Redis, keeps the registration alive and watches the member set.
/// Dropping it without [`Membership::leave`] is like a crash: the heartbeat stops and the node
/// disappears from the others' snapshots when its TTL runs out.
pub struct RedisMembership {
    shared: Arc<Shared>,
    task: Mutex<Option<JoinHandle<()>>>,
}

/// What the heartbeat task and `leave` share.
struct Shared {
    cfg: RedisMembershipConfig,
    client: redis::Client,
    /// Replaced by the task after a failed call, so a broken connection never outlives a tick.
    con: Mutex<ConnectionManager>,
    /// Distinguishes this process from an earlier (or rival) one with the same id.
    incarnation: String,
    set_key: String,
    member_key: String,
    tx: watch::Sender<Snapshot>,
    /// Set, with the reason, once another live process holds this node's id.
    fenced: watch::Sender<Option<String>>,
}

impl RedisMembership {
    /// Registers this node and reads the members once (bounded by the Redis timeout), then keeps
    /// both up to date in a task. With Redis unreachable it starts stale, with itself as the only
    /// member, and registers when Redis answers.
    ///
    /// Fails on a bad configuration, and when another live process holds this node's id at
    /// other addresses (a duplicate `node_id`): a registration found under the id is watched for
    /// up to two of its refresh intervals and two Redis timeouts; if it is refreshed the holder is
    /// alive and this node does not start; if not, its process is gone and this one takes the id
    /// over. Redis not answering during the watch is waited out (two TTLs at most, then an error).
    pub async fn start(cfg: RedisMembershipConfig) -> Result<Self, ServerError> {
        cfg.validate()?;
        let client = redis::Client::open(cfg.url.as_str())
            .map_err(|e| ServerError::Config(format!("cluster membership: Redis URL {:?}: {e}", cfg.url)))?;
        let con = connection(&client, &cfg)?;
        let incarnation = incarnation();
        let prefix = &cfg.prefix;
        let set_key = format!("{{{prefix}}}:members");
        let member_key = format!("{{{prefix}}}:member:{}", cfg.local.id);
        let view = View::new(cfg.local.clone());
        let tx = watch::Sender::new(view.snapshot());
        let fenced = watch::Sender::new(None);
        let shared =
            Arc::new(Shared { cfg, client, con: Mutex::new(con), incarnation, set_key, member_key, tx, fenced });
        ::metrics::gauge!("kvtier_membership_stale").set(0.0);
        let mut driver = Driver {
            shared: shared.clone(),
            view,
            claimed: false,
            take: false,
            contest: None,
            since_ms: None,
            first_try_ms: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64),
            refreshed: None,
            mismatched: HashMap::new(),
            said: Vec::new(),
        };
        // Present from the start (this node alone), not only once the members change.
        ::metrics::gauge!("kvtier_membership_members").set(1.0);
        // With Redis unreachable this logs the one warning and starts stale, alone.
        driver.tick().await;
        // The id registered by another process: watched until it proves alive or dead, through
        // Redis errors too (a node that could not tell would serve as a twin until fenced), for at
        // most two TTLs past the watch.
        let started = Instant::now();
        while driver.contest.is_some() && shared.fenced.borrow().is_none() {
            if started.elapsed() > 2 * shared.cfg.ttl + shared.cfg.tick() * 2 + shared.cfg.op_timeout * 2 {
                let holder = driver.contest.as_ref().map(|c| c.holder.clone()).unwrap_or_default();
                return Err(ServerError::Config(format!(
                    "member id {} is registered by another process at {holder}, and Redis did not answer long \
                     enough to tell whether it is alive",
                    shared.cfg.local.id
                )));
            }
            tokio::time::sleep(shared.cfg.tick()).await;
            driver.tick().await;
        }
        if let Some(why) = shared.fenced.borrow().clone() {
            return Err(ServerError::Config(why));
        }
        let task = tokio::spawn(driver.run());
        Ok(RedisMembership { shared, task: Mutex::new(Some(task)) })
    }
}

impl Drop for RedisMembership {
    fn drop(&mut self) {
        if let Some(t) = self.task.lock().take() {
            t.abort();
        }
    }
}

impl Membership for RedisMembership {
    fn local(&self) -> &Member {
        &self.shared.cfg.local
    }

    fn watch(&self) -> watch::Receiver<Snapshot> {
        self.shared.tx.subscribe()
    }

    fn fenced(&self) -> BoxFuture<'static, String> {
        let mut rx = self.shared.fenced.subscribe();
        Box::pin(async move {
            let why = match rx.wait_for(Option::is_some).await {
                Ok(why) => why.clone(),
                Err(_) => None,
            };
            match why {
                Some(why) => why,
                None => std::future::pending().await,
            }
        })
    }

    fn claim(&self, what: &str, ttl: Duration) -> BoxFuture<'_, Result<Option<String>, ServerError>> {
        let s = &self.shared;
        let key = format!("{{{}}}:claim:{what}", s.cfg.prefix);
        let token = format!("{}/{}/{}", s.cfg.local.id, s.incarnation, incarnation());
        Box::pin(async move {
            let mut con = s.con.lock().clone();
            let mut set = redis::cmd("SET");
            set.arg(&key).arg(&token).arg("NX").arg("PX").arg(ttl.as_millis().max(1) as u64);
            match tokio::time::timeout(s.cfg.op_timeout, set.query_async::<Option<String>>(&mut con)).await {
                Ok(Ok(Some(_))) => Ok(Some(token)),
                Ok(Ok(None)) => Ok(None),
                Ok(Err(e)) => Err(redis_error("claim", &e)),
                Err(_) => Err(timed_out("claim", s.cfg.op_timeout)),
            }
        })
    }

    fn release(&self, what: &str, token: String) -> BoxFuture<'_, ()> {
        let s = &self.shared;
        let key = format!("{{{}}}:claim:{what}", s.cfg.prefix);
        Box::pin(async move {
            let mut con = s.con.lock().clone();
            let mut call = release_script().key(&key);
            call.arg(&token);
            match tokio::time::timeout(s.cfg.op_timeout, call.invoke_async::<i64>(&mut con)).await {
                Ok(Ok(_)) => {}
                // It goes at its TTL.
                Ok(Err(e)) => tracing::debug!("a cluster claim was not given back: {}", redis_error("release", &e)),
                Err(_) => tracing::debug!("a cluster claim was not given back within {:?}", s.cfg.op_timeout),
            }
        })
    }

    fn renew(&self, what: &str, token: &str, ttl: Duration) -> BoxFuture<'_, Result<bool, ServerError>> {
        let s = &self.shared;
        let key = format!("{{{}}}:claim:{what}", s.cfg.prefix);
        let mut call = renew_script().key(&key);
        call.arg(token).arg(ttl.as_millis().max(1) as u64);
        Box::pin(async move {
            let mut con = s.con.lock().clone();
            match tokio::time::timeout(s.cfg.op_timeout, call.invoke_async::<i64>(&mut con)).await {
                Ok(Ok(held)) => Ok(held == 1),
                Ok(Err(e)) => Err(redis_error("renew", &e)),
                Err(_) => Err(timed_out("renew", s.cfg.op_timeout)),
            }
        })
    }

    fn leave(&self) -> BoxFuture<'_, Result<(), ServerError>> {
        Box::pin(async move {
            if let Some(t) = self.task.lock().take() {
                t.abort();
            }
            let s = &self.shared;
            let mut con = s.con.lock().clone();
            let mut call = leave_script().key(&s.set_key);
            call.key(&s.member_key).arg(s.cfg.local.id.as_str()).arg(&s.incarnation);
            match tokio::time::timeout(s.cfg.op_timeout, call.invoke_async::<i64>(&mut con)).await {
                Ok(Ok(_)) => {
                    tracing::info!(member = %s.cfg.local.id, "left the cluster");
                    Ok(())
                }
                Ok(Err(e)) => Err(redis_error("leave", &e)),
                Err(_) => Err(timed_out("leave", s.cfg.op_timeout)),
            }
        })
    }
}

/// The heartbeat task's state.
struct Driver {
    shared: Arc<Shared>,
    view: View,
    /// Whether this process has registered once (its first registration takes the key from an
    /// earlier process of this node, or one proven gone; later ones only re-create a missing key).
    claimed: bool,
    /// Whether the next claim overwrites another process's registration (it was not refreshed
    /// while watched).
    take: bool,
    /// Another process's registration of this id, being watched.
    contest: Option<Contest>,
    /// When this process first registered (unix ms; published as `since` from then on): of two
    /// processes with one id, the one registered first keeps it when the other took it while
    /// this one could not reach Redis. Wall clocks of different hosts: skew between them counts.
    since_ms: Option<u64>,
    /// When this process first tried to register: what it publishes as `since` until a reply
    /// confirms a registration (a claim Redis made whose reply timed out must not publish a new
    /// time on every tick: other nodes read `since` to tell a restart).
    first_try_ms: u64,
    /// This process's last registration that Redis took.
    refreshed: Option<Instant>,
    /// Members whose shared settings differ from this node's, with theirs (each said once).
    mismatched: HashMap<NodeId, String>,
    /// The members last published, with when each registered (`since`), so that each one
    /// joining, leaving or restarting is said once.
    said: Vec<(NodeId, u64)>,
}

impl Driver {
    async fn run(mut self) {
        let mut every = tokio::time::interval(self.shared.cfg.tick());
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The first tick completes at once; `start` has just run one.
        every.tick().await;
        // A fenced node stops refreshing: the id is the other process's.
        while self.shared.fenced.borrow().is_none() {
            every.tick().await;
            self.tick().await;
        }
    }

    /// This node must stop: another live process answers for its id. Said once, at ERROR.
    fn fence(&mut self, why: String) {
        tracing::error!(member = %self.shared.cfg.local.id, "{why}");
        ::metrics::counter!("kvtier_membership_superseded_total").increment(1);
        self.shared.fenced.send_replace(Some(why));
    }

    /// Another process's registration of this id was found (`holder`, its `beat` and refresh
    /// interval): watched; alive if its beat moves, taken over if it doesn't for two intervals.
    fn contested(&mut self, now: Instant, holder: String, beat: String, tick: Option<Duration>) {
        let cfg = &self.shared.cfg;
        let id = &cfg.local.id;
        match &self.contest {
            None => {
                let watch = 2 * tick.unwrap_or(Duration::from_secs(1)) + 2 * cfg.op_timeout;
                tracing::warn!(
                    member = %id,
                    "member id {id} is registered by another process at {holder}; waiting up to {watch:?} to see \
                     whether it is alive (a restart at another address) or another node has this node_id"
                );
                self.contest = Some(Contest { holder, beat, until: now + watch });
            }
            Some(c) if c.holder != holder || c.beat != beat => {
                self.fence(format!(
                    "member id {id} is held by a live node at {holder} (its registration is being refreshed): \
                     two nodes have node_id {id:?}; give each node its own node_id (this one advertises {})",
                    cfg.local.grpc_addr
                ));
            }
            Some(c) if now >= c.until => {
                tracing::warn!(
                    member = %id,
                    "member id {id}: the registration at {} was not refreshed; its process is gone, taking the id over",
                    c.holder
                );
                self.take = true;
            }
            Some(_) => {}
        }
    }

    /// One round trip: refresh (or register) and read the members; publish what changed.
    async fn tick(&mut self) {
        let s = self.shared.clone();
        let cfg = &s.cfg;
        let mut con = s.con.lock().clone();
        let mode = match (self.claimed, self.take) {
            (true, _) => "refresh",
            (false, true) => "take",
            (false, false) => "claim",
        };
        let mut call = tick_script().prepare_invoke();
        call.key(&s.set_key)
            .key(&s.member_key)
            .arg(mode)
            .arg(cfg.local.id.as_str())
            .arg(&s.incarnation)
            .arg(cfg.ttl.as_millis() as u64)
            .arg(format!("{{{}}}:member:", cfg.prefix))
            .arg(MAX_MEMBERS)
            .arg(&cfg.local.grpc_addr)
            .arg(&cfg.local.data_addr);
        for (f, v) in encode(&cfg.local) {
            call.arg(f).arg(v);
        }
        call.arg("tick").arg(cfg.tick().as_millis() as u64);
        // Registered from its first try on, unless this process registered before: that time.
        let since = self.since_ms.unwrap_or(self.first_try_ms);
        call.arg("since").arg(since);
        if !cfg.settings.is_empty() {
            call.arg("settings").arg(&cfg.settings);
        }
        let reply = match tokio::time::timeout(cfg.op_timeout, call.invoke_async::<Value>(&mut con)).await {
            Ok(Ok(v)) => parse_reply(v),
            Ok(Err(e)) => Err(redis_error("tick", &e)),
            Err(_) => Err(timed_out("tick", cfg.op_timeout)),
        };
        let now = Instant::now();
        match reply {
            Ok(reply) => {
                let was_stale = self.view.stale;
                if reply.invalid > 0 {
                    ::metrics::counter!("kvtier_membership_invalid_total").increment(reply.invalid);
                }
                match &reply.status {
                    Status::Contested { holder, beat, tick } => {
                        self.contested(now, holder.clone(), beat.clone(), *tick);
                        return;
                    }
                    Status::Superseded { holder, since, data } => {
                        // This node's registration went without it stalling (Redis unreachable from
                        // here, or Redis lost its data while this node refreshed in time), and the
                        // holder registered after this node first did: the holder is the newcomer
                        // (a node given this node's id), and this node takes the id back; the
                        // holder stops when it sees that. Otherwise this node lapsed (stalled past
                        // its TTL) and the holder took its place: this one stops.
                        let cut_off = was_stale || self.refreshed.is_some_and(|t| now.duration_since(t) < cfg.ttl);
                        // At this node's own addresses: an earlier process of this node, brought
                        // back by Redis (a failover to a lagging replica, a restore): taken back.
                        let own = *holder == cfg.local.grpc_addr && *data == cfg.local.data_addr;
                        let senior = since.is_some_and(|h| self.since_ms.is_some_and(|mine| mine < h));
                        if own || (cut_off && senior) {
                            tracing::warn!(
                                member = %cfg.local.id,
                                "another process, at {holder}, registered member id {} while this node could not \
                                 reach Redis; this node has held the id longer and takes it back (two nodes have \
                                 this node_id: the other stops)",
                                cfg.local.id
                            );
                            (self.claimed, self.take) = (false, true);
                            return;
                        }
                        self.fence(format!(
                            "another process, at {holder}, registered member id {} while this node's \
                             registration lapsed: two nodes have this node_id; this one stops so that one \
                             node answers for it",
                            cfg.local.id
                        ));
                        return;
                    }
                    Status::Claimed | Status::Refreshed | Status::Recreated => {
                        self.claimed = true;
                        self.contest = None;
                        self.refreshed = Some(now);
                        self.since_ms.get_or_insert(since);
                    }
                }
                self.compare_settings(&reply.settings);
                let lost = matches!(reply.status, Status::Recreated);
                if self.view.polled(now, reply.members, lost, cfg.ttl) {
                    self.publish();
                }
                if was_stale {
                    ::metrics::gauge!("kvtier_membership_stale").set(0.0);
                    tracing::info!(
                        member = %cfg.local.id,
                        members = self.view.members.len(),
                        "cluster membership: Redis answers again; registered"
                    );
                } else if lost {
                    tracing::warn!(member = %cfg.local.id, "cluster membership: Redis had lost this node's key; registered again");
                }
            }
            Err(e) => {
                ::metrics::counter!("kvtier_membership_errors_total").increment(1);
                // A fresh connection for the next tick: nothing of a broken one carries over.
                if let Ok(c) = connection(&s.client, cfg) {
                    *s.con.lock() = c;
                }
                if self.view.failed() {
                    ::metrics::gauge!("kvtier_membership_stale").set(1.0);
                    tracing::warn!(
                        member = %cfg.local.id,
                        members = self.view.members.len(),
                        "cluster membership: Redis unreachable ({e}); keeping the last known members"
                    );
                    self.publish();
                } else {
                    tracing::debug!("cluster membership: Redis still unreachable: {e}");
                }
            }
        }
    }

    /// Says each member whose shared settings differ from this node's, once per difference.
    fn compare_settings(&mut self, theirs: &[(NodeId, String)]) {
        let ours = &self.shared.cfg.settings;
        if ours.is_empty() {
            return;
        }
        let mut now = HashMap::new();
        for (id, s) in theirs {
            // A member that publishes none runs an older build: nothing to compare.
            if s.is_empty() || s == ours || *id == self.shared.cfg.local.id {
                continue;
            }
            if self.mismatched.get(id) != Some(s) {
                tracing::warn!(
                    member = %id,
                    "member {id} runs with {} (this node: {}); every node of a cluster must share them",
                    differing(s, ours),
                    differing(ours, s)
                );
            }
            now.insert(id.clone(), s.clone());
        }
        ::metrics::gauge!("kvtier_membership_mismatched_members").set(now.len() as f64);
        self.mismatched = now;
    }

    fn publish(&mut self) {
        ::metrics::gauge!("kvtier_membership_members").set(self.view.members.len() as f64);
        let now: Vec<(NodeId, u64)> = self.view.members.values().map(|m| (m.id.clone(), m.since_ms)).collect();
        let first = self.said.is_empty();
        let said_since = |id: &NodeId| self.said.iter().find(|(s, _)| s == id).map(|(_, since)| *since);
        for (id, since) in now.iter().filter(|(id, _)| *id != self.shared.cfg.local.id) {
            match said_since(id) {
                None if first => tracing::info!(member = %id, "cluster membership: member {id} is in the cluster"),
                None => tracing::info!(member = %id, "cluster membership: member {id} joined"),
                // Registered again without leaving (killed and started within its TTL): its
                // memory is empty; the others hand it its blocks (`super::rebalance`).
                Some(was) if was != 0 && *since != 0 && was != *since => {
                    tracing::info!(member = %id, "cluster membership: member {id} restarted (registered again)")
                }
                Some(_) => {}
            }
        }
        for (id, _) in self.said.iter().filter(|(id, _)| !now.iter().any(|(n, _)| n == id)) {
            tracing::info!(member = %id, "cluster membership: member {id} left (stopped, or its TTL ran out)");
        }
        let ids = |v: &[(NodeId, u64)]| v.iter().map(|(id, _)| id.clone()).collect::<Vec<_>>();
        if ids(&now) != ids(&self.said) {
            tracing::info!(members = now.len(), "cluster membership: {} member(s)", now.len());
        }
        self.said = now;
        self.shared.tx.send_replace(self.view.snapshot());
    }
}

/// The `name=value` pairs of `a` that `b` does not have, space-separated.
fn differing(a: &str, b: &str) -> String {
    let b: Vec<&str> = b.split(' ').collect();
    a.split(' ').filter(|kv| !b.contains(kv)).collect::<Vec<_>>().join(" ")
}

/// What a tick's script says about this node's own key.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Status {
    /// First registration of this process (took the key from an earlier process of this node,
    /// or one proven gone).
    Claimed,
    Refreshed,
    /// The key was gone (expired while Redis was unreachable, or Redis lost its data).
    Recreated,
    /// Another process holds the key at other addresses (not touched): its gRPC address, its
    /// refresh counter and interval. No members come with it.
    Contested {
        holder: String,
        beat: String,
        tick: Option<Duration>,
    },
    /// Another process took the key over after this one had registered; not touched. `since`:
    /// when the holder first registered (unix ms), if it says.
    Superseded {
        holder: String,
        since: Option<u64>,
        /// The holder's data address.
        data: String,
    },
}

/// Another process's registration of this node's id, watched to tell whether it is alive.
#[derive(Debug)]
struct Contest {
    holder: String,
    beat: String,
    /// Taken over if its beat has not moved by then.
    until: Instant,
}

struct Reply {
    status: Status,
    members: Vec<Member>,
    /// Every member's shared settings (empty where it publishes none).
    settings: Vec<(NodeId, String)>,
    /// Entries that could not be read as members.
    invalid: u64,
}

impl Reply {
    fn empty() -> Self {
        Reply { status: Status::Claimed, members: Vec::new(), settings: Vec::new(), invalid: 0 }
    }
}

/// The member set as one node knows it: what Redis says, merged with what it knew. Pure: the
/// clock comes in as `now`.
#[derive(Debug)]
struct View {
    local: Member,
    members: BTreeMap<NodeId, Member>,
    stale: bool,
    /// Until then members missing from Redis are kept (Redis just came back or lost its data,
    /// and live members have not re-registered yet).
    grace_until: Option<Instant>,
    generation: u64,
}

impl View {
    fn new(local: Member) -> Self {
        let members = BTreeMap::from([(local.id.clone(), local.clone())]);
        View { local, members, stale: false, grace_until: None, generation: 1 }
    }

    /// Redis answered with `polled`; `lost` when it had lost this node's key. True if the
    /// snapshot changed.
    fn polled(&mut self, now: Instant, polled: Vec<Member>, lost: bool, grace: Duration) -> bool {
        let was_stale = std::mem::replace(&mut self.stale, false);
        if was_stale || lost {
            self.grace_until = Some(now + grace);
        }
        let mut next: BTreeMap<NodeId, Member> = polled.into_iter().map(|m| (m.id.clone(), m)).collect();
        // This node is always a member of its own view, as it announces itself.
        next.insert(self.local.id.clone(), self.local.clone());
        if self.grace_until.is_some_and(|t| now < t) {
            for (id, m) in &self.members {
                next.entry(id.clone()).or_insert_with(|| m.clone());
            }
        } else {
            self.grace_until = None;
        }
        let changed = next != self.members;
        if changed {
            self.members = next;
            self.generation += 1;
        }
        changed || was_stale
    }

    /// Redis could not be reached. True if this makes the view stale (it was not).
    fn failed(&mut self) -> bool {
        !std::mem::replace(&mut self.stale, true)
    }

    fn snapshot(&self) -> Snapshot {
        Snapshot { members: self.members.values().cloned().collect(), stale: self.stale, generation: self.generation }
    }
}

fn connection(client: &redis::Client, cfg: &RedisMembershipConfig) -> Result<ConnectionManager, ServerError> {
    let c = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(cfg.op_timeout))
        .set_response_timeout(Some(cfg.op_timeout))
        .set_number_of_retries(1)
        .set_min_delay(Duration::from_millis(10))
        .set_max_delay(cfg.op_timeout);
    ConnectionManager::new_lazy_with_config(client.clone(), c)
        .map_err(|e| ServerError::Config(format!("cluster membership: Redis client: {e}")))
}

/// Unique enough per process start: the wall clock in nanoseconds and the pid, hashed.
fn incarnation() -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let seed = format!("{nanos}/{}", std::process::id());
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(seed.as_bytes()))
}

fn redis_error(what: &str, e: &redis::RedisError) -> ServerError {
    ServerError::Io(std::io::Error::other(format!("cluster membership {what}: Redis: {e}")))
}

fn timed_out(what: &str, after: Duration) -> ServerError {
    ServerError::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("cluster membership {what}: Redis did not answer within {after:?}"),
    ))
}

/// Format version of a member's hash.
const FORMAT: &str = "1";

/// A member as the fields of its hash (`inc` is added by the script's caller).
fn encode(m: &Member) -> Vec<(&'static str, String)> {
    let l = |v: &Option<String>| v.clone().unwrap_or_default();
    vec![
        ("v", FORMAT.into()),
        ("grpc", m.grpc_addr.clone()),
        ("data", m.data_addr.clone()),
        ("node", l(&m.labels.node)),
        ("rack", l(&m.labels.rack)),
        ("zone", l(&m.labels.zone)),
        ("capacity", m.capacity.to_string()),
    ]
}

/// A member from its id and hash fields; `None` if the entry is not one this version can read.
fn decode(id: &str, fields: &HashMap<String, String>) -> Option<Member> {
    if fields.get("v").map(String::as_str) != Some(FORMAT) {
        return None;
    }
    let f = |k: &str| fields.get(k).map(String::as_str);
    let m = Member {
        id: NodeId::new(id).ok()?,
        grpc_addr: f("grpc")?.to_owned(),
        data_addr: f("data")?.to_owned(),
        labels: Labels::new(f("node"), f("rack"), f("zone")),
        capacity: f("capacity")?.parse().ok()?,
        // Absent from the hash of a build before it was published: unknown.
        since_ms: f("since").and_then(|t| t.parse().ok()).unwrap_or(0),
    };
    m.validate().ok().map(|()| m)
}

/// The tick script's answer: `[status, holder grpc, holder since, holder data, id1, [field,
/// value, ...], id2, [...], ...]` (the holder's fields empty unless superseded), or
/// `[contested, holder grpc, beat, tick]`.
fn parse_reply(v: Value) -> Result<Reply, ServerError> {
    let bad = |what: &str| {
        ServerError::Io(std::io::Error::other(format!("cluster membership: odd reply from Redis ({what})")))
    };
    let Value::Array(items) = v else {
        return Err(bad("not an array"));
    };
    let mut items = items.into_iter();
    let mut text = || items.next().and_then(|v| redis::from_redis_value::<String>(v).ok());
    let (Some(status), Some(detail)) = (text(), text()) else {
        return Err(bad("no status"));
    };
    // Every status but "contested" has a third and fourth element: the holder's `since` and data
    // address.
    let (since, data) = if status == "contested" { (None, None) } else { (text(), text()) };
    let status = match status.as_str() {
        "claimed" => Status::Claimed,
        "refreshed" => Status::Refreshed,
        "recreated" => Status::Recreated,
        "superseded" => Status::Superseded {
            holder: detail,
            since: since.and_then(|t| t.parse().ok()),
            data: data.unwrap_or_default(),
        },
        "contested" => {
            let (beat, tick) = (text().unwrap_or_default(), text().and_then(|t| t.parse().ok()));
            let tick = tick.map(Duration::from_millis);
            return Ok(Reply { status: Status::Contested { holder: detail, beat, tick }, ..Reply::empty() });
        }
        _ => return Err(bad("unknown status")),
    };
    let (mut members, mut settings, mut invalid) = (Vec::new(), Vec::new(), 0u64);
    while let (Some(id), Some(fields)) = (items.next(), items.next()) {
        let id = redis::from_redis_value::<String>(id).ok();
        let fields = redis::from_redis_value::<HashMap<String, String>>(fields).ok();
        match (id, fields) {
            (Some(id), Some(fields)) if members.len() < MAX_MEMBERS => match decode(&id, &fields) {
                Some(m) => {
                    settings.push((m.id.clone(), fields.get("settings").cloned().unwrap_or_default()));
                    members.push(m);
                }
                None => invalid += 1,
            },
            _ => invalid += 1,
        }
    }
    Ok(Reply { status, members, settings, invalid })
}

/// KEYS: set, own hash. ARGV: mode ("claim" | "take" | "refresh"), id, incarnation, ttl ms,
/// member-key prefix, max members, this member's gRPC address, its data address, then field/value
/// pairs of this member. Every registration that stands is refreshed with its `beat` counter
/// bumped, so another process can tell a live holder of an id from a dead one.
///
/// "claim" takes the key when it is free, held by this incarnation, or held by another at the
/// same addresses (this node restarted); held by another process at other addresses it answers
/// `{"contested", its gRPC address, its beat, its refresh interval ms}` and touches nothing.
/// "take" overwrites whatever holds it. Otherwise returns
/// `{status, detail, since, id, {field, value, ...}, ...}`
/// for every live member (up to max), pruning the set of expired ids, where `detail` and `since`
/// are the holder's gRPC address and first registration (unix ms) when the status is
/// "superseded" (else empty).
const TICK_LUA: &str = r#"
local set, me = KEYS[1], KEYS[2]
local mode, id, inc, ttl, kp, maxm = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local grpc, data = ARGV[7], ARGV[8]
local cur = redis.call('HGET', me, 'inc')
local status
if mode == 'claim' and cur and cur ~= inc then
  local h = redis.call('HMGET', me, 'grpc', 'data', 'beat', 'tick')
  if h[1] ~= grpc or h[2] ~= data then
    return {'contested', h[1] or '', h[3] or '', h[4] or ''}
  end
end
if mode ~= 'refresh' or not cur then
  if cur ~= inc then
    redis.call('DEL', me)
  end
  redis.call('HSET', me, 'inc', inc, unpack(ARGV, 9))
  if mode == 'refresh' then status = 'recreated' else status = 'claimed' end
elseif cur == inc then
  status = 'refreshed'
else
  status = 'superseded'
end
if status ~= 'superseded' then
  redis.call('HINCRBY', me, 'beat', 1)
  redis.call('PEXPIRE', me, ttl)
  redis.call('SADD', set, id)
end
local out = {status, '', '', ''}
if status == 'superseded' then
  local h = redis.call('HMGET', me, 'grpc', 'since', 'data')
  out[2] = h[1] or ''
  out[3] = h[2] or ''
  out[4] = h[3] or ''
end
local n = 0
for _, m in ipairs(redis.call('SMEMBERS', set)) do
  local h = redis.call('HGETALL', kp .. m)
  if #h == 0 then
    redis.call('SREM', set, m)
  elseif n < maxm then
    n = n + 1
    out[#out + 1] = m
    out[#out + 1] = h
  end
end
return out
"#;

/// KEYS: set, own hash. ARGV: id, incarnation. Removes this node if the key is still its own.
const LEAVE_LUA: &str = r#"
if redis.call('HGET', KEYS[2], 'inc') == ARGV[2] then
  redis.call('DEL', KEYS[2])
  redis.call('SREM', KEYS[1], ARGV[1])
  return 1
end
return 0
"#;

fn tick_script() -> &'static Script {
    static S: std::sync::OnceLock<Script> = std::sync::OnceLock::new();
    S.get_or_init(|| Script::new(TICK_LUA))
}

/// Deletes a claim if it still holds the token it was made with.
fn release_script() -> &'static Script {
    static S: std::sync::OnceLock<Script> = std::sync::OnceLock::new();
    S.get_or_init(|| {
        Script::new("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end")
    })
}

/// Extends a claim's TTL if it still holds the token it was made with.
fn renew_script() -> &'static Script {
    static S: std::sync::OnceLock<Script> = std::sync::OnceLock::new();
    S.get_or_init(|| {
        Script::new(
            "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) else return 0 end",
        )
    })
}

fn leave_script() -> &'static Script {
    static S: std::sync::OnceLock<Script> = std::sync::OnceLock::new();
    S.get_or_init(|| Script::new(LEAVE_LUA))
}

#[cfg(test)]
#[path = "membership_tests.rs"]
mod view_tests;
