//! The same-node path used automatically: a [`KvClient`] whose server runs on this host (the
//! boot id in the server's `Info` equals ours; an address of 127.0.0.1 proves nothing, a
//! forwarded port or another network namespace can hide another host) moves the blocks of
//! **calls whose memory is a [`SharedBuffer`]** over the server's same-node socket, with no
//! configuration; everything else goes over the data plane (TCP) as before.
//!
//! Which calls: only the ones that name a `SharedBuffer` — [`KvClient::load_keys_into_buffer`],
//! [`KvClient::load_prefix_into_buffer`], [`KvClient::store_keys_from_buffer`] and
//! [`KvClient::store_prefix_from_buffer`]. The same-node path can only put bytes into, and take
//! them from, memory the server has mapped, and the server maps nothing but registered memfds; a
//! `Vec`, a `Bytes` or an engine's tensor has no descriptor to pass, and copying it into a shared
//! buffer first would cost the copy the path exists to save. So the API makes the caller's choice
//! explicit: allocate the engine's host buffers as `SharedBuffer`s and their calls go same-node.
//!
//! When the path can't be used the call goes over TCP, with the same results, and the client
//! counts it by reason ([`FallbackReason`]): in [`KvClient::samenode_stats`], in the metric
//! `kvtier_client_samenode_fallback_total{reason}`, and in one log line (`tracing`, target
//! `kvtier_client::near`) the first time each reason occurs. Reasons that follow from what the
//! server said about itself (no socket advertised, another host) hold for the client's life;
//! after a failed connection (socket missing, permission denied, refused hello) or a request that
//! failed on its connection, the socket is tried again after [`RETRY_AFTER`].
//! [`ClientConfig::samenode`](crate::ClientConfig) `= SameNodeMode::Off` turns the path off
//! (nothing is counted then).
//!
//! Connections to the socket are pooled (at most `data_connections`, like the data plane's);
//! a buffer is registered on each connection the first time that connection serves it, and
//! unregistered once the buffer is dropped (see [`SharedBuffer`]).

use std::collections::{BTreeMap, HashSet};
use std::ops::Range;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvtier_proto::dataplane::ItemStatus;
use kvtier_proto::{pb, BlockKey, CodecId};
use tokio::sync::{Semaphore, SemaphorePermit};

use crate::claims::{BufferAccess, LoadBuffer, StoreBuffer};
use crate::client::{BlockDest, ClientConfig, KvClient, NamespaceHandle, StoreReport};
use crate::{ClientError, SameNode, Segment};
use kvtier_proto::samenode::MAX_SEGMENTS_PER_ITEM;

/// How long a client keeps off a same-node socket it failed to open before trying again.
pub const RETRY_AFTER: Duration = Duration::from_secs(10);

/// Whether a client uses the same-node path on its own. Default: `Auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SameNodeMode {
    /// Calls into or from a [`SharedBuffer`] go over the server's same-node socket when the server
    /// is on this host and the socket opens; otherwise over TCP, counted.
    #[default]
    Auto,
    /// Every call goes over TCP.
    Off,
}

/// Why a call that names a [`SharedBuffer`] went over TCP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FallbackReason {
    /// The server advertises no same-node socket (`samenode_socket = "off"`, or its path too long).
    NotAdvertised,
    /// This host's boot id can't be read, so "same host" can't be shown.
    UnknownHost,
    /// The server's boot id is not ours: it runs on another host (or in another VM).
    OtherHost,
    /// The advertised socket does not exist here (a container without the server's data
    /// directory, a removed socket file).
    SocketMissing,
    /// The socket exists but this process may not open it (its mode, its directory's mode).
    PermissionDenied,
    /// The socket refused this client's token or ticket, or (a client with a certificate and no
    /// token) no same-node ticket could be had from the control plane.
    Unauthenticated,
    /// Connecting or saying hello failed otherwise (refused, timed out).
    ConnectFailed,
    /// A same-node request failed on its connection (closed, timed out); the call was redone
    /// over TCP.
    Io,
    /// The server refused the request (e.g. more registered buffers than a connection may hold).
    Refused,
    /// A store with a codec: the same-node path stores raw blocks only.
    Encoded,
}

impl FallbackReason {
    /// The metrics label.
    pub fn label(self) -> &'static str {
        match self {
            FallbackReason::NotAdvertised => "not_advertised",
            FallbackReason::UnknownHost => "unknown_host",
            FallbackReason::OtherHost => "other_host",
            FallbackReason::SocketMissing => "socket_missing",
            FallbackReason::PermissionDenied => "permission_denied",
            FallbackReason::Unauthenticated => "unauthenticated",
            FallbackReason::ConnectFailed => "connect_failed",
            FallbackReason::Io => "io",
            FallbackReason::Refused => "refused",
            FallbackReason::Encoded => "encoded",
        }
    }

    /// Why connecting to a Unix socket failed, as a reason.
    pub(crate) fn from_connect_error(e: &std::io::Error) -> Self {
        use std::io::ErrorKind;
        match e.kind() {
            ErrorKind::NotFound | ErrorKind::NotADirectory => FallbackReason::SocketMissing,
            ErrorKind::PermissionDenied => FallbackReason::PermissionDenied,
            _ => FallbackReason::ConnectFailed,
        }
    }
}

impl std::fmt::Display for FallbackReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

/// What a client makes of the server's `Info`, before trying the socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// Turned off by configuration.
    Off,
    /// Same host: try this socket.
    Use(PathBuf),
    /// Never, for this server: why.
    Never(FallbackReason),
}

/// The decision, as a pure function of the mode, what the server advertised (its socket path, its
/// boot id) and this host's boot id.
pub fn plan(mode: SameNodeMode, socket: &str, server_host: &str, local_host: &str) -> Plan {
    if mode == SameNodeMode::Off {
        return Plan::Off;
    }
    if socket.is_empty() {
        return Plan::Never(FallbackReason::NotAdvertised);
    }
    if local_host.is_empty() {
        return Plan::Never(FallbackReason::UnknownHost);
    }
    if server_host != local_host {
        return Plan::Never(FallbackReason::OtherHost);
    }
    Plan::Use(PathBuf::from(socket))
}

/// What the automatic same-node path did so far (one client and its clones).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SameNodeStats {
    /// A same-node connection is open or was opened since the last failure.
    pub active: bool,
    /// Calls served over the same-node path.
    pub loads: u64,
    pub stores: u64,
    /// Calls naming a `SharedBuffer` that went over TCP, by reason.
    pub fallbacks: BTreeMap<FallbackReason, u64>,
    /// The last fallback: why, and the error behind it.
    pub last_fallback: Option<(FallbackReason, String)>,
}

impl SameNodeStats {
    /// Fallbacks of every reason.
    pub fn fallback_total(&self) -> u64 {
        self.fallbacks.values().sum()
    }
}

/// What a call does after a same-node request.
enum Step<T> {
    Done(T),
    Retry,
    Tcp,
}

/// Why no same-node connection was leased.
enum NoNear {
    Off,
    Fallback(FallbackReason, String),
}

#[derive(Default)]
struct Counters {
    stats: SameNodeStats,
    logged: HashSet<FallbackReason>,
    /// The last failure to open a connection, and when (for [`RETRY_AFTER`]).
    down: Option<(FallbackReason, String, Instant)>,
}

/// The automatic path's state: the plan, a pool of same-node connections, the counters.
pub(crate) struct AutoNear {
    plan: Plan,
    /// What made the plan `Never`, for the fallback's detail.
    never_why: String,
    token: Option<String>,
    /// Where a certificate-only client gets a same-node ticket (see [`fetch_ticket`]).
    tickets: Option<crate::client::Grpc>,
    connect_timeout: Duration,
    request_timeout: Duration,
    /// [`crate::ClientConfig::samenode_poll`].
    answer_poll: Duration,
    max_items: usize,
    idle_for: Duration,
    permits: Semaphore,
    idle: Mutex<Vec<(SameNode, Instant)>>,
    counters: Mutex<Counters>,
}

/// A call with a budget ([`crate::EngineClient`]'s): its deadline, and its same-node exchanges in
/// flight. While one is, the budget must not cancel the call: the server may be copying into (or
/// out of) the caller's memory, and only the exchange's own timeout — bounded by the deadline —
/// ends that safely (closing, then waiting for the server to let go). The call is cut once none
/// is in flight.
#[derive(Clone)]
pub(crate) struct CallScope {
    pub(crate) deadline: Instant,
    pub(crate) exchanges: Arc<Exchanges>,
}

/// Same-node exchanges in flight in one call, and a wake-up when one ends.
#[derive(Default)]
pub(crate) struct Exchanges {
    live: std::sync::atomic::AtomicUsize,
    ended: tokio::sync::Notify,
}

impl Exchanges {
    /// Returns once no exchange of the call is in flight.
    pub(crate) async fn none_in_flight(&self) {
        loop {
            let ended = self.ended.notified();
            if self.live.load(std::sync::atomic::Ordering::Acquire) == 0 {
                return;
            }
            ended.await;
        }
    }
}

tokio::task_local! {
    /// The budgeted call this task runs, if any.
    pub(crate) static CALL_SCOPE: CallScope;
}

/// One exchange counted in its call's [`Exchanges`] until dropped.
struct InFlight(Arc<Exchanges>);

impl InFlight {
    fn enter(ex: &Arc<Exchanges>) -> Self {
        ex.live.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        InFlight(Arc::clone(ex))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.live.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        self.0.ended.notify_waiters();
    }
}

/// A pooled connection for one call; back to the pool with [`NearLease::finish`], closed if
/// dropped (a call that failed or was cancelled mid-request).
struct NearLease<'a> {
    pool: &'a AutoNear,
    conn: SameNode,
    /// Taken from the pool (the server may have closed it meanwhile), not opened for this call.
    reused: bool,
    _permit: SemaphorePermit<'a>,
    /// Counted among its call's exchanges in flight (a budgeted call's), until it ends.
    _in_flight: Option<InFlight>,
}

impl NearLease<'_> {
    fn finish(self) {
        if self.conn.is_usable() {
            if let Ok(mut idle) = self.pool.idle.lock() {
                idle.push((self.conn, Instant::now()));
            }
        }
    }
}

impl AutoNear {
    /// `tickets`: for a client with a certificate and no token, the control plane to ask for a
    /// same-node ticket before each new connection.
    pub(crate) fn new(cfg: &ClientConfig, info: &pb::InfoResponse, tickets: Option<crate::client::Grpc>) -> Self {
        let ours = crate::samenode::host_id();
        let plan = plan(cfg.samenode, &info.samenode_socket, &info.host_id, &ours);
        let never_why = match plan {
            Plan::Never(FallbackReason::NotAdvertised) => "the server advertises no same-node socket".to_string(),
            Plan::Never(FallbackReason::UnknownHost) => "this host's boot id is unknown".to_string(),
            Plan::Never(_) => format!("the server's boot id {:?} is not ours ({ours:?})", info.host_id),
            _ => String::new(),
        };
        AutoNear {
            plan,
            never_why,
            token: cfg.auth_token.clone(),
            tickets,
            connect_timeout: cfg.connect_timeout,
            request_timeout: cfg.request_timeout,
            answer_poll: cfg.samenode_poll,
            max_items: info.max_blocks_per_request as usize,
            idle_for: cfg.pool_idle,
            permits: Semaphore::new(cfg.data_connections.max(1)),
            idle: Mutex::new(Vec::new()),
            counters: Mutex::new(Counters::default()),
        }
    }

    fn is_off(&self) -> bool {
        self.plan == Plan::Off
    }

    /// A connection for one call: a pooled one unless `fresh`, else a new one.
    async fn lease(&self, fresh: bool) -> Result<NearLease<'_>, NoNear> {
        let path = match &self.plan {
            Plan::Off => return Err(NoNear::Off),
            Plan::Never(r) => return Err(NoNear::Fallback(*r, self.never_why.clone())),
            Plan::Use(p) => p,
        };
        if let Ok(c) = self.counters.lock() {
            if let Some((r, why, at)) = &c.down {
                if at.elapsed() < RETRY_AFTER {
                    return Err(NoNear::Fallback(*r, why.clone()));
                }
            }
        }
        let permit = self.permits.acquire().await.map_err(|_| NoNear::Fallback(FallbackReason::Io, "closed".into()))?;
        let pooled = if fresh {
            None
        } else {
            self.idle.lock().ok().and_then(|mut idle| {
                // Connections idle past `pool_idle` may have been closed by the server's idle
                // timeout.
                idle.retain(|(_, at)| at.elapsed() < self.idle_for);
                idle.pop()
            })
        };
        // A pooled connection whose sweep fails is dropped; a fresh one has nothing to sweep.
        let pooled = match pooled {
            Some((mut conn, _)) if conn.holds_dropped() => conn.sweep().await.is_ok().then_some(conn),
            Some((conn, _)) => Some(conn),
            None => None,
        };
        let reused = pooled.is_some();
        let conn = match pooled {
            Some(conn) => conn,
            None => {
                let ticket = match &self.tickets {
                    Some(g) => match fetch_ticket(g, self.connect_timeout).await {
                        Ok(t) => Some(t),
                        Err(e) => return Err(self.went_down(FallbackReason::Unauthenticated, e.to_string())),
                    },
                    None => None,
                };
                let opened = SameNode::open(
                    path,
                    ticket.as_deref().or(self.token.as_deref()),
                    self.connect_timeout,
                    self.request_timeout,
                    self.max_items,
                )
                .await;
                match opened {
                    Ok(mut conn) => {
                        conn.set_answer_poll(self.answer_poll);
                        if let Ok(mut c) = self.counters.lock() {
                            c.down = None;
                            c.stats.active = true;
                        }
                        conn
                    }
                    Err((reason, e)) => {
                        let why = e.to_string();
                        if let Ok(mut c) = self.counters.lock() {
                            c.down = Some((reason, why.clone(), Instant::now()));
                            c.stats.active = false;
                        }
                        return Err(NoNear::Fallback(reason, why));
                    }
                }
            }
        };
        // Inside a budgeted call, each request may take what is left of the budget at most (and
        // the call waits for it: see `CallScope`).
        let scope = CALL_SCOPE.try_with(|s| s.clone()).ok();
        let mut conn = conn;
        let timeout = match &scope {
            Some(s) => self.request_timeout.min(s.deadline.saturating_duration_since(Instant::now())),
            None => self.request_timeout,
        };
        conn.set_request_timeout(timeout.max(Duration::from_millis(1)));
        let _in_flight = scope.map(|s| InFlight::enter(&s.exchanges));
        Ok(NearLease { pool: self, conn, reused, _permit: permit, _in_flight })
    }

    /// Records that no connection could be opened (tried again after [`RETRY_AFTER`]).
    fn went_down(&self, reason: FallbackReason, why: String) -> NoNear {
        if let Ok(mut c) = self.counters.lock() {
            c.down = Some((reason, why.clone(), Instant::now()));
            c.stats.active = false;
        }
        NoNear::Fallback(reason, why)
    }

    /// Counts a call that went over TCP; logs the first of each reason.
    fn fell_back(&self, reason: FallbackReason, why: &str) {
        metrics::counter!("kvtier_client_samenode_fallback_total", "reason" => reason.label()).increment(1);
        let Ok(mut c) = self.counters.lock() else { return };
        *c.stats.fallbacks.entry(reason).or_default() += 1;
        c.stats.last_fallback = Some((reason, why.to_string()));
        if matches!(reason, FallbackReason::Io) {
            // A connection failed mid-request (the server stalled or went away): keep off the
            // socket for a while rather than pay a timeout on every call.
            c.stats.active = false;
            c.down = Some((reason, why.to_string(), Instant::now()));
        }
        if c.logged.insert(reason) {
            match reason {
                FallbackReason::Encoded => tracing::info!(
                    reason = reason.label(),
                    "kvtier: stores with a codec go over TCP (the same-node path stores raw blocks)"
                ),
                _ => tracing::warn!(
                    reason = reason.label(),
                    "kvtier: the same-node path is not usable, shared-buffer calls go over TCP: {why}"
                ),
            }
        }
    }

    fn served(&self, load: bool) {
        metrics::counter!("kvtier_client_samenode_calls_total", "op" => if load { "load" } else { "store" })
            .increment(1);
        if let Ok(mut c) = self.counters.lock() {
            if load {
                c.stats.loads += 1;
            } else {
                c.stats.stores += 1;
            }
        }
    }

    fn stats(&self) -> SameNodeStats {
        self.counters.lock().unwrap_or_else(|p| p.into_inner()).stats.clone()
    }

    /// A same-node error's fate: `Ok(reason)` to redo the call over TCP, or the error to return
    /// (one TCP would give too: an unknown namespace, a bad argument).
    fn after_error(&self, e: ClientError) -> Result<FallbackReason, ClientError> {
        match e {
            ClientError::Io(_) | ClientError::Timeout(_) | ClientError::Protocol(_) | ClientError::Connect { .. } => {
                Ok(FallbackReason::Io)
            }
            ClientError::Refused { .. } | ClientError::Capacity(_) => Ok(FallbackReason::Refused),
            other => Err(other),
        }
    }
}

/// Where a call's blocks lie in its [`SharedBuffer`]: each at an offset, in one piece, or each in
/// its own segments, filled in order.
#[derive(Clone, Copy)]
enum Places<'a> {
    Offsets(&'a [u64]),
    Segments(&'a [Vec<Segment>]),
}

impl Places<'_> {
    fn len(&self) -> usize {
        match self {
            Places::Offsets(o) => o.len(),
            Places::Segments(s) => s.len(),
        }
    }

    /// The byte ranges of each block of `block_bytes` in a buffer of `len` bytes; an error for
    /// one outside it, for segments that don't make one block, or, with `disjoint`, for two
    /// ranges that overlap (two blocks loaded into the same bytes).
    fn ranges(&self, len: usize, block_bytes: u64, disjoint: bool) -> Result<Vec<Vec<Range<usize>>>, ClientError> {
        let range = |i: usize, o: u64, n: u64| {
            usize::try_from(o)
                .ok()
                .and_then(|s| Some(s..s.checked_add(usize::try_from(n).ok()?)?))
                .filter(|r| r.end <= len)
                .ok_or_else(|| {
                    ClientError::InvalidArgument(format!(
                        "block {i}: {n} bytes at offset {o} are outside the {len}-byte buffer"
                    ))
                })
        };
        let out: Vec<Vec<Range<usize>>> = match self {
            Places::Offsets(offsets) => offsets
                .iter()
                .enumerate()
                .map(|(i, &o)| range(i, o, block_bytes).map(|r| vec![r]))
                .collect::<Result<_, _>>()?,
            Places::Segments(segments) => segments
                .iter()
                .enumerate()
                .map(|(i, segs)| {
                    // The same-node protocol's cap, held on both paths so a call's fate doesn't
                    // depend on where the server runs.
                    if segs.is_empty() || segs.len() as u64 > MAX_SEGMENTS_PER_ITEM {
                        return Err(ClientError::InvalidArgument(format!(
                            "block {i} has {} segments; a block has 1 to {MAX_SEGMENTS_PER_ITEM}",
                            segs.len()
                        )));
                    }
                    let total = segs.iter().try_fold(0u64, |t, s| t.checked_add(s.len));
                    if total != Some(block_bytes) {
                        return Err(ClientError::InvalidArgument(format!(
                            "block {i}: its segments hold {total:?} bytes; a block is {block_bytes}"
                        )));
                    }
                    segs.iter().map(|s| range(i, s.offset, s.len)).collect()
                })
                .collect::<Result<_, _>>()?,
        };
        if disjoint {
            let mut sorted: Vec<&Range<usize>> = out.iter().flatten().filter(|r| !r.is_empty()).collect();
            sorted.sort_by_key(|r| (r.start, r.end));
            if let Some(w) = sorted.windows(2).find(|w| w[0].end > w[1].start) {
                return Err(ClientError::InvalidArgument(format!(
                    "destinations at offsets {} and {} overlap",
                    w[0].start, w[1].start
                )));
            }
        }
        Ok(out)
    }
}

/// Disjoint `ranges` of `buf` (per block, in order) as destinations, in the order given. An empty
/// range (a zero-length segment, which may lie anywhere, inside another range too) is an empty
/// destination.
pub(crate) fn dests<'a>(buf: &'a mut [u8], ranges: &[Vec<Range<usize>>]) -> Vec<BlockDest<'a>> {
    let mut order: Vec<(usize, usize)> =
        ranges.iter().enumerate().flat_map(|(b, rs)| (0..rs.len()).map(move |j| (b, j))).collect();
    order.sort_by_key(|&(b, j)| ranges[b][j].start);
    let mut out: Vec<Vec<Option<&'a mut [u8]>>> = ranges.iter().map(|rs| rs.iter().map(|_| None).collect()).collect();
    let (mut rest, mut base) = (buf, 0usize);
    for (b, j) in order {
        let r = &ranges[b][j];
        if r.is_empty() {
            continue;
        }
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(r.start - base);
        let (mine, tail) = tail.split_at_mut(r.len());
        out[b][j] = Some(mine);
        rest = tail;
        base = r.end;
    }
    out.into_iter().map(|v| v.into_iter().map(|s| s.unwrap_or_default()).collect()).collect()
}

/// A same-node ticket from the control plane (`SameNodeTicket`), which authenticates this call
/// with the client's certificate: what a client with no token presents in the socket's hello.
pub(crate) async fn fetch_ticket(g: &crate::client::Grpc, within: Duration) -> Result<String, ClientError> {
    let mut g = g.clone();
    match tokio::time::timeout(within, g.same_node_ticket(pb::SameNodeTicketRequest {})).await {
        Ok(Ok(r)) => Ok(r.into_inner().ticket),
        Ok(Err(s)) => Err(s.into()),
        Err(_) => Err(ClientError::Timeout(within)),
    }
}

impl KvClient {
    /// A same-node connection for a call, or `None` when the call is to go over TCP (off, or a
    /// fallback, counted). `fresh`: not from the pool (a retry).
    async fn near_lease(&self, fresh: bool) -> Option<NearLease<'_>> {
        let near = self.near();
        match near.lease(fresh).await {
            Ok(lease) => Some(lease),
            Err(NoNear::Off) => None,
            Err(NoNear::Fallback(r, why)) => {
                near.fell_back(r, &why);
                None
            }
        }
    }

    /// What follows a same-node request: its answer, a retry on a fresh connection (a transport
    /// failure on a pooled connection, which the server may have closed; loads and stores are
    /// idempotent), or TCP (counted). An error TCP would give too (an unknown namespace) is
    /// returned as it is.
    fn near_outcome<T>(
        &self,
        lease: NearLease<'_>,
        load: bool,
        fresh: &mut bool,
        r: Result<T, ClientError>,
    ) -> Result<Step<T>, ClientError> {
        let near = self.near();
        let reused = lease.reused;
        // A broken connection is closed here; one that refused a request is kept.
        lease.finish();
        match r {
            Ok(v) => {
                near.served(load);
                Ok(Step::Done(v))
            }
            Err(e) => {
                let why = e.to_string();
                let reason = near.after_error(e)?;
                if reason == FallbackReason::Io && reused && !*fresh {
                    *fresh = true;
                    return Ok(Step::Retry);
                }
                near.fell_back(reason, &why);
                Ok(Step::Tcp)
            }
        }
    }

    /// Loads blocks by key into `buf`: block `i` lands at `offsets[i]`, in the layout's dtype.
    /// Over the same-node socket when the server is on this host (one copy, by the server, no
    /// payload on a socket), else over TCP into the same places (see the module docs). True where
    /// block `i` landed and verified; false for a miss or a block that failed its checksum. With
    /// `stop_at_miss`, keys after the first miss are reported false. An offset whose block does
    /// not fit in the buffer, or two blocks that overlap, are an `InvalidArgument`.
    pub async fn load_keys_into_buffer<'b>(
        &self,
        ns: &NamespaceHandle,
        keys: &[BlockKey],
        buf: impl Into<LoadBuffer<'b>>,
        offsets: &[u64],
        stop_at_miss: bool,
    ) -> Result<Vec<bool>, ClientError> {
        self.load_buffer(ns, keys, buf.into(), Places::Offsets(offsets), stop_at_miss).await
    }

    /// [`KvClient::load_keys_into_buffer`] for blocks each in its own segments of `buf`: block
    /// `i` fills `segments[i]` in order (together one block's bytes; an engine page's K and V
    /// halves, say). No two segments may overlap.
    pub async fn load_keys_into_buffer_segments<'b>(
        &self,
        ns: &NamespaceHandle,
        keys: &[BlockKey],
        buf: impl Into<LoadBuffer<'b>>,
        segments: &[Vec<Segment>],
        stop_at_miss: bool,
    ) -> Result<Vec<bool>, ClientError> {
        self.load_buffer(ns, keys, buf.into(), Places::Segments(segments), stop_at_miss).await
    }

    async fn load_buffer(
        &self,
        ns: &NamespaceHandle,
        keys: &[BlockKey],
        buf: LoadBuffer<'_>,
        places: Places<'_>,
        stop_at_miss: bool,
    ) -> Result<Vec<bool>, ClientError> {
        if keys.len() != places.len() {
            return Err(ClientError::InvalidArgument(format!("{} keys but {} places", keys.len(), places.len())));
        }
        let ranges = places.ranges(buf.len(), ns.block_bytes(), true)?;
        // A buffer shared with other calls: this call's places are its own from here on.
        let mut claim = None;
        let mut buf = match buf {
            LoadBuffer::Own(b) => BufferAccess::Own(b),
            LoadBuffer::Shared(b) => BufferAccess::Claim(claim.insert(b.claim_places(&ranges, true).await?)),
        };
        let mut fresh = false;
        while let Some(mut lease) = self.near_lease(fresh).await {
            let r = match places {
                Places::Offsets(o) => lease.conn.load_at(ns, keys, &mut buf, o, stop_at_miss).await,
                Places::Segments(s) => lease.conn.load_segments_at(ns, keys, &mut buf, s, stop_at_miss).await,
            };
            match self.near_outcome(lease, true, &mut fresh, r)? {
                Step::Done(landed) => return Ok(landed),
                Step::Retry => continue,
                Step::Tcp => break,
            }
        }
        buf.buffer().check_intact()?;
        let mut dests = buf.pieces_mut(&ranges)?;
        self.load_keys_into(ns, keys, &mut dests, stop_at_miss).await
    }

    /// Loads the longest stored prefix of `tokens` into `buf` from `offset` on (full blocks back
    /// to back, at most `max_blocks`), as [`KvClient::load_keys_into_buffer`] does. Returns the
    /// number of blocks written.
    pub async fn load_prefix_into_buffer<'b>(
        &self,
        ns: &NamespaceHandle,
        tokens: &[u32],
        buf: impl Into<LoadBuffer<'b>>,
        offset: u64,
        max_blocks: usize,
    ) -> Result<usize, ClientError> {
        self.check_context(tokens.len())?;
        let bb = ns.block_bytes();
        let mut keys = ns.keys(tokens);
        keys.truncate(max_blocks);
        let offsets: Vec<u64> = (0..keys.len() as u64).map(|i| offset + i * bb).collect();
        let landed = self.load_keys_into_buffer(ns, &keys, buf, &offsets, true).await?;
        Ok(landed.iter().take_while(|ok| **ok).count())
    }

    /// Stores full raw blocks from `buf` under `keys`: block `i` is the namespace's block size at
    /// `offsets[i]`. Over the same-node socket when the server is on this host and the handle
    /// stores raw, else over TCP (see the module docs). One status per block: `Ok`, `Present`
    /// (already held), or why it was refused.
    pub async fn store_keys_from_buffer<'b>(
        &self,
        ns: &NamespaceHandle,
        keys: &[BlockKey],
        buf: impl Into<StoreBuffer<'b>>,
        offsets: &[u64],
    ) -> Result<Vec<ItemStatus>, ClientError> {
        self.store_buffer(ns, keys, None, buf.into(), Places::Offsets(offsets)).await
    }

    /// [`KvClient::store_keys_from_buffer`] for blocks each in its own segments of `buf`: block
    /// `i` is `segments[i]` taken in order (together one block's bytes).
    pub async fn store_keys_from_buffer_segments<'b>(
        &self,
        ns: &NamespaceHandle,
        keys: &[BlockKey],
        buf: impl Into<StoreBuffer<'b>>,
        segments: &[Vec<Segment>],
    ) -> Result<Vec<ItemStatus>, ClientError> {
        self.store_buffer(ns, keys, None, buf.into(), Places::Segments(segments)).await
    }

    /// Stores `blocks` full blocks of `tokens` from block `first_block` on, held back to back in
    /// `buf` from `offset` (as [`KvClient::store_from`] does, lossless sink blocks flagged),
    /// over the same-node socket when it can (see [`KvClient::store_keys_from_buffer`]). Blocks
    /// already held count as stored.
    pub async fn store_prefix_from_buffer<'b>(
        &self,
        ns: &NamespaceHandle,
        tokens: &[u32],
        first_block: usize,
        buf: impl Into<StoreBuffer<'b>>,
        offset: u64,
        blocks: usize,
    ) -> Result<StoreReport, ClientError> {
        self.check_context(tokens.len())?;
        let keys = ns.keys(tokens);
        if first_block.checked_add(blocks).is_none_or(|end| end > keys.len()) {
            return Err(ClientError::InvalidArgument(format!(
                "{blocks} blocks from block {first_block} given for {} tokens, which make only {} full blocks",
                tokens.len(),
                keys.len()
            )));
        }
        let bb = ns.block_bytes();
        let offsets: Vec<u64> = (0..blocks as u64)
            .map(|i| i.checked_mul(bb).and_then(|at| offset.checked_add(at)))
            .collect::<Option<_>>()
            .ok_or_else(|| ClientError::InvalidArgument(format!("{blocks} blocks from offset {offset} pass 2^64")))?;
        let keys = &keys[first_block..first_block + blocks];
        let st = self.store_buffer(ns, keys, Some(first_block), buf.into(), Places::Offsets(&offsets)).await?;
        let rejected: Vec<(usize, ItemStatus)> =
            st.iter().enumerate().filter(|(_, s)| !s.is_held()).map(|(i, s)| (i, *s)).collect();
        Ok(StoreReport { stored: st.len() - rejected.len(), rejected })
    }

    /// What the automatic same-node path did so far (see the module docs).
    pub fn samenode_stats(&self) -> SameNodeStats {
        self.near().stats()
    }

    /// The plan this client made from the server's `Info` (see [`plan`]).
    pub fn samenode_plan(&self) -> &Plan {
        &self.near().plan
    }

    async fn store_buffer(
        &self,
        ns: &NamespaceHandle,
        keys: &[BlockKey],
        first_index: Option<usize>,
        buf: StoreBuffer<'_>,
        places: Places<'_>,
    ) -> Result<Vec<ItemStatus>, ClientError> {
        if keys.len() != places.len() {
            return Err(ClientError::InvalidArgument(format!("{} keys but {} places", keys.len(), places.len())));
        }
        let ranges = places.ranges(buf.len(), ns.block_bytes(), false)?;
        // A buffer shared with other calls: no load writes this call's places until it returns.
        let mut claim = None;
        let buf = match buf {
            StoreBuffer::Own(b) => BufferAccess::Read(b),
            StoreBuffer::Shared(b) => BufferAccess::Claim(claim.insert(b.claim_places(&ranges, false).await?)),
        };
        let near = self.near();
        if near.is_off() {
        } else if ns.codec() != CodecId::RAW {
            near.fell_back(FallbackReason::Encoded, &format!("the handle encodes with {}", ns.codec().name()));
        } else {
            let mut fresh = false;
            while let Some(mut lease) = self.near_lease(fresh).await {
                let r = match places {
                    Places::Offsets(o) => lease.conn.store_from_buffer_at(ns, keys, first_index, &buf, o).await,
                    Places::Segments(s) => lease.conn.store_segments_at(ns, keys, &buf, s).await,
                };
                match self.near_outcome(lease, false, &mut fresh, r)? {
                    Step::Done(st) => return Ok(st),
                    Step::Retry => continue,
                    Step::Tcp => break,
                }
            }
        }
        // Over TCP the payloads are copied out of the buffer once (a `Bytes` must own its memory;
        // the buffer is only borrowed for this call).
        buf.buffer().check_intact()?;
        let outside = || ClientError::InvalidArgument("a block outside its buffer".into());
        let blocks: Vec<Bytes> = ranges
            .iter()
            .map(|rs| match &rs[..] {
                [r] => buf.bytes(r.clone()).map(Bytes::copy_from_slice).ok_or_else(outside),
                many => {
                    let mut block = Vec::with_capacity(many.iter().map(|r| r.len()).sum());
                    for r in many {
                        block.extend_from_slice(buf.bytes(r.clone()).ok_or_else(outside)?);
                    }
                    Ok(Bytes::from(block))
                }
            })
            .collect::<Result<_, ClientError>>()?;
        match first_index {
            None => {
                let parts: Vec<Vec<Bytes>> = blocks.into_iter().map(|b| vec![b]).collect();
                self.store_keys(ns, keys, &parts).await
            }
            Some(first) => {
                let bt = ns.namespace.layout.block_tokens;
                let frames = ns.frames(first, keys.iter().zip(blocks).map(|(k, b)| (*k, bt, b)).collect())?;
                self.store_frames(&frames).await
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ConcurrentBuffer, SharedBuffer};

    /// Compiles only if the shared-buffer calls' futures are `Send` (so they can be spawned).
    #[allow(dead_code)]
    fn buffer_calls_are_send(c: &KvClient, h: &NamespaceHandle, buf: &mut SharedBuffer, shared: &ConcurrentBuffer) {
        fn send<T: Send>(_: T) {}
        send(c.load_keys_into_buffer(h, &[], &mut *buf, &[], false));
        send(c.load_prefix_into_buffer(h, &[], &mut *buf, 0, 0));
        send(c.store_keys_from_buffer(h, &[], &*buf, &[]));
        send(c.store_prefix_from_buffer(h, &[], 0, &*buf, 0, 0));
        send(c.load_keys_into_buffer_segments(h, &[], shared, &[], false));
        send(c.store_keys_from_buffer_segments(h, &[], shared, &[]));
    }

    #[test]
    fn the_plan_needs_a_socket_and_the_same_boot_id() {
        let boot = "6c1b0f1e-0000-4000-8000-000000000001";
        assert_eq!(plan(SameNodeMode::Auto, "/d/kvtier.sock", boot, boot), Plan::Use("/d/kvtier.sock".into()));
        assert_eq!(plan(SameNodeMode::Off, "/d/kvtier.sock", boot, boot), Plan::Off);
        assert_eq!(plan(SameNodeMode::Auto, "", boot, boot), Plan::Never(FallbackReason::NotAdvertised));
        assert_eq!(
            plan(SameNodeMode::Auto, "/d/kvtier.sock", "6c1b0f1e-0000-4000-8000-000000000002", boot),
            Plan::Never(FallbackReason::OtherHost)
        );
        // An old server that sends no boot id is not taken for this host.
        assert_eq!(plan(SameNodeMode::Auto, "/d/kvtier.sock", "", boot), Plan::Never(FallbackReason::OtherHost));
        assert_eq!(plan(SameNodeMode::Auto, "/d/kvtier.sock", "", ""), Plan::Never(FallbackReason::UnknownHost));
    }

    #[test]
    fn connect_errors_name_their_reason() {
        use std::io::{Error, ErrorKind};
        assert_eq!(
            FallbackReason::from_connect_error(&Error::from(ErrorKind::NotFound)),
            FallbackReason::SocketMissing
        );
        assert_eq!(
            FallbackReason::from_connect_error(&Error::from(ErrorKind::PermissionDenied)),
            FallbackReason::PermissionDenied
        );
        assert_eq!(
            FallbackReason::from_connect_error(&Error::from(ErrorKind::ConnectionRefused)),
            FallbackReason::ConnectFailed
        );
    }

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // per block, a list of ranges: here often one
    fn places_refuse_blocks_outside_or_overlapping() {
        let ranges = |o: &[u64], disjoint| Places::Offsets(o).ranges(100, 50, disjoint);
        assert_eq!(ranges(&[0, 50], true).unwrap(), vec![vec![0..50], vec![50..100]]);
        assert!(ranges(&[51], true).is_err());
        assert!(ranges(&[u64::MAX - 1], true).is_err());
        assert!(ranges(&[0, 49], true).is_err());
        assert_eq!(ranges(&[0, 49], false).unwrap().len(), 2, "stores may read overlapping bytes");
        let seg = |offset, len| Segment { offset, len };
        let split = vec![vec![seg(60, 20), seg(0, 30)], vec![seg(30, 25), seg(80, 20), seg(55, 5)]];
        assert_eq!(
            Places::Segments(&split).ranges(100, 50, true).unwrap(),
            vec![vec![60..80, 0..30], vec![30..55, 80..100, 55..60]]
        );
        let short = vec![vec![seg(0, 30), seg(40, 10), seg(60, 5)]];
        assert!(Places::Segments(&short).ranges(100, 50, true).is_err(), "65 bytes of segments for a 50-byte block");
        let overlapping = vec![vec![seg(0, 25), seg(20, 25)]];
        assert!(Places::Segments(&overlapping).ranges(100, 50, true).is_err());
        assert!(Places::Segments(&overlapping).ranges(100, 50, false).is_ok());
        let outside = vec![vec![seg(0, 25), seg(90, 25)]];
        assert!(Places::Segments(&outside).ranges(100, 50, false).is_err());
    }

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // per block, a list of ranges: here often one
    fn dests_split_the_buffer_in_the_order_given() {
        let mut buf: Vec<u8> = (0..10).collect();
        let d = dests(&mut buf, &[vec![6..8, 1..2], vec![0..1], vec![3..5, 9..10]]);
        let got: Vec<Vec<Vec<u8>>> = d.iter().map(|v| v.iter().map(|s| s.to_vec()).collect()).collect();
        assert_eq!(got, vec![vec![vec![6, 7], vec![1]], vec![vec![0]], vec![vec![3, 4], vec![9]]]);
        // Zero-length segments, at the start of a range and inside one: empty destinations.
        let d = dests(&mut buf, &[vec![0..4], vec![0..0, 4..6, 2..2]]);
        let got: Vec<Vec<Vec<u8>>> = d.iter().map(|v| v.iter().map(|s| s.to_vec()).collect()).collect();
        assert_eq!(got, vec![vec![vec![0, 1, 2, 3]], vec![vec![], vec![4, 5], vec![]]]);
    }
}
