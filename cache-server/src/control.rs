//! The gRPC control plane: namespaces, lookup, sessions, stats and admin. Block payloads never
//! travel here; `Info` tells clients where the data plane listens.

use std::collections::HashSet;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use kvtier_proto::{codes, pb, BlockKey, Namespace, NamespaceId, TierId};
use tonic::{Request, Response, Status};

use tokio::sync::{broadcast, watch};

use crate::cluster::{deletes, replicas, HeldClaim, LocalHolding, Member, Membership, NamespaceDelete};
use crate::dram::Priority;
use crate::error::ServerError;
use crate::events::{EventKind, KvEvent, WatchSlot};
use crate::metrics::server_error;
use crate::sessions::{ParkSpec, SessionManifest, SUPERSEDE_MARGIN};
use crate::state::NodeState;
use crate::tenants::{Access, Principal};

pub struct ControlPlane {
    state: Arc<NodeState>,
    /// The cluster as this node sees it, once it joined (routing hints list its members).
    membership: Arc<OnceLock<Arc<dyn Membership>>>,
    /// Turns true when the node stops: open event streams end.
    stop: Option<watch::Receiver<bool>>,
}

impl ControlPlane {
    pub fn new(state: Arc<NodeState>) -> Self {
        ControlPlane { state, membership: Arc::new(OnceLock::new()), stop: None }
    }

    /// The control plane of a started node: routing hints read `membership` once it is set, and
    /// event streams end when `stop` turns true.
    pub fn with_node(
        state: Arc<NodeState>,
        membership: Arc<OnceLock<Arc<dyn Membership>>>,
        stop: watch::Receiver<bool>,
    ) -> Self {
        ControlPlane { state, membership, stop: Some(stop) }
    }
}

/// A session id as every session request must name one: 1..=256 bytes. (An empty one is also
/// the mark a namespace's unregistration is remembered under: it must never name a session.)
fn check_session_id(id: &str) -> Result<(), ServerError> {
    if id.is_empty() || id.len() > 256 {
        return Err(ServerError::InvalidRequest("session_id must be 1..=256 bytes".into()));
    }
    Ok(())
}

/// How long a create's claim on a session id lasts unrenewed (it is renewed while its park runs;
/// this bounds how long a node that died holding it keeps other creates waiting).
const CREATE_CLAIM_TTL: Duration = Duration::from_secs(10);
/// How long a tenant's create waits for one of its slots to ask the cluster
/// ([`crate::tenants::Tenant::create_check`]).
const CREATE_CHECK_WAIT: Duration = Duration::from_secs(5);
/// How long a create waits for another node's claim on the id: past its TTL.
const CREATE_CLAIM_WAIT: Duration = Duration::from_secs(11);
/// How soon a waiting create first asks again; then twice as long each time, up to
/// [`CREATE_CLAIM_POLL_MAX`].
const CREATE_CLAIM_POLL: Duration = Duration::from_millis(20);
const CREATE_CLAIM_POLL_MAX: Duration = Duration::from_millis(320);
/// Most creates one node lets wait for other nodes' claims at once (each asks Redis a few times
/// a second); more are refused `Unavailable` at once, so a flood of creates of ids being created
/// elsewhere can't flood the cluster's Redis.
const MAX_CREATES_WAITING: usize = 64;

/// The creates waiting for another node's claim on their id.
static CREATES_WAITING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(MAX_CREATES_WAITING);

/// A session created without an answer from `members`, and the instant before its park as of
/// which older copies count as superseded.
struct Unverified {
    at: Instant,
    members: Vec<crate::cluster::NodeId>,
}

/// A session found on no member that answered, while some gave no answer.
fn unanswered(id: &str, members: &[crate::cluster::NodeId]) -> ServerError {
    let names: Vec<&str> = members.iter().map(|m| m.as_str()).collect();
    ServerError::Peer {
        peer: names.join(", "),
        reason: format!(
            "session {id:?} is held by none of the members that answered, and {} did not answer (one may hold it): \
             try again when it does",
            if names.len() == 1 { "it" } else { "they" }
        ),
    }
}

/// Turns a server error into a gRPC status carrying the stable code in its message and metadata.
pub fn to_status(e: ServerError) -> Status {
    server_error(&e);
    let code = match &e {
        ServerError::Capacity(_) | ServerError::TooLarge { .. } => tonic::Code::ResourceExhausted,
        ServerError::MissingBlocks { .. } => tonic::Code::FailedPrecondition,
        ServerError::UnknownNamespace(_)
        | ServerError::SessionNotFound(_)
        | ServerError::SessionLost(_)
        | ServerError::SessionAway { .. }
        | ServerError::SessionExpired { .. } => tonic::Code::NotFound,
        ServerError::SessionExists(_) => tonic::Code::AlreadyExists,
        ServerError::VersionConflict { .. } | ServerError::ConcurrentWrite { .. } => tonic::Code::Aborted,
        ServerError::ContextTooLong { .. } => tonic::Code::OutOfRange,
        ServerError::Forbidden(_) => tonic::Code::PermissionDenied,
        ServerError::QuotaExceeded(_) => tonic::Code::ResourceExhausted,
        ServerError::InvalidRequest(_) | ServerError::Proto(_) => tonic::Code::InvalidArgument,
        ServerError::Io(e) if e.kind() == std::io::ErrorKind::StorageFull => tonic::Code::ResourceExhausted,
        ServerError::Config(_) | ServerError::Io(_) => tonic::Code::Internal,
        ServerError::Peer { .. } | ServerError::ShortOfCopies(_) => tonic::Code::Unavailable,
    };
    let mut status = Status::new(code, format!("{}: {e}", e.code()));
    if let Ok(v) = e.code().parse() {
        status.metadata_mut().insert(codes::METADATA_KEY, v);
    }
    status
}

/// The principal the interceptor authenticated for this call.
fn principal<T>(r: &Request<T>) -> Result<Principal, Status> {
    r.extensions()
        .get::<Principal>()
        .cloned()
        .ok_or_else(|| Status::unauthenticated(format!("{}: the call was not authenticated", codes::UNAUTHENTICATED)))
}

fn ns_id(b: &[u8]) -> Result<NamespaceId, ServerError> {
    Ok(NamespaceId::from_slice(b)?)
}

fn keys(list: &[bytes::Bytes]) -> Result<Vec<BlockKey>, ServerError> {
    list.iter().map(|k| BlockKey::try_from(&k[..]).map_err(ServerError::from)).collect()
}

fn opt_key(b: &[u8]) -> Result<Option<BlockKey>, ServerError> {
    if b.is_empty() {
        Ok(None)
    } else {
        Ok(Some(BlockKey::try_from(b)?))
    }
}

/// Most sessions one `ListSessions` page answers with (each a few hundred bytes at most).
const MAX_SESSIONS_PAGE: usize = 16_384;

fn session_info(m: &SessionManifest, now: Instant) -> pb::SessionInfo {
    m.info_pb(now)
}

fn park_response(r: Result<SessionManifest, ServerError>) -> Result<Response<pb::ParkResponse>, Status> {
    match r {
        Ok(m) => Ok(Response::new(pb::ParkResponse {
            parked: true,
            info: Some(session_info(&m, Instant::now())),
            ..Default::default()
        })),
        Err(ServerError::MissingBlocks { missing, missing_tail }) => {
            metrics::counter!("kvtier_errors_total", "kind" => "missing_blocks").increment(1);
            Ok(Response::new(pb::ParkResponse { parked: false, info: None, missing_blocks: missing, missing_tail }))
        }
        Err(e) => Err(to_status(e)),
    }
}

impl ControlPlane {
    fn ttl(&self, ms: u64) -> Result<Duration, ServerError> {
        let c = self.state.config();
        if ms == 0 {
            return Ok(c.session_ttl.0);
        }
        let d = Duration::from_millis(ms);
        if d > c.session_max_ttl.0 {
            return Err(ServerError::InvalidRequest(format!(
                "ttl {d:?} exceeds the server's session_max_ttl {}",
                c.session_max_ttl
            )));
        }
        Ok(d)
    }

    /// Runs a session-table change on the I/O pool (it may wait for the session log's fsync).
    async fn on_io<T: Send + 'static>(
        &self,
        job: impl FnOnce(&NodeState) -> Result<T, ServerError> + Send + 'static,
    ) -> Result<T, ServerError> {
        let state = self.state.clone();
        self.state.io().run(None, move || job(&state)).await?
    }

    async fn park(&self, p: &Principal, r: pb::ParkRequest) -> Result<SessionManifest, ServerError> {
        let ns_id = ns_id(&r.namespace_id)?;
        let ns = self.state.namespace_for(p, &ns_id, Access::Write)?;
        check_session_id(&r.session_id)?;
        let spec = ParkSpec {
            namespace: ns_id,
            id: r.session_id,
            keys: keys(&r.keys)?,
            tail: opt_key(&r.tail_key)?,
            token_count: r.token_count,
            ttl: self.ttl(r.ttl_ms)?,
            priority: Priority::from_u32(r.priority),
            expected_version: r.expected_version,
        };
        let limits = self.state.session_limits(&ns);
        // A copy recovered at this node's start is checked first: the checks below read it.
        self.settle_recovered_copy(&ns, &spec.id).await?;
        // Refused before anything is written (a refused park left its blocks on disk).
        self.state.sessions().check_park(&spec, &limits)?;
        // A create holds its claim on the id until its park is done here (or failed), so a create
        // of the same id through another node waits for it, then finds this one's copy. The park
        // job below owns it: a client giving up leaves that job running, and the claim with it.
        let (unverified, claim) = match spec.expected_version {
            0 => self.check_create(p, &ns, &spec.id).await?,
            _ => (None, None),
        };
        // The blocks go to disk before the table is touched, and without holding its lock.
        self.state.tiers().persist(&ns_id, &spec.keys, spec.tail).await?;
        // What the session was, put back if this write meets another node's of the same version:
        // the one this park replaces (none for a new one).
        let prev = match spec.expected_version {
            0 => None,
            v => self.state.sessions().peek(ns_id, &spec.id).filter(|p| p.version == v),
        };
        let m = self
            .on_io(move |s| {
                let made = s.sessions().park(s.tiers().session_pins(), spec, &limits);
                drop(claim);
                made
            })
            .await?;
        // In a cluster where the namespace keeps 2+ copies (`PeerTier::rf_for`: its own
        // `replicas`, else `cluster_rf`): acknowledged once that many nodes hold it.
        self.replicate_or_revert(&ns, &m, prev).await?;
        // Acknowledged: older copies on members that gave no answer are superseded.
        if let Some(u) = unverified {
            self.supersede_unverified(&ns, &m.id, u).await?;
        }
        Ok(m)
    }

    /// Replicates `m`, this node's write of a session (see [`replicas::replicate`]); a write that
    /// met another node's write of the same version is undone here (`prev` put back), so neither
    /// node keeps serving a turn nobody was told was stored.
    async fn replicate_or_revert(
        &self,
        ns: &Namespace,
        m: &SessionManifest,
        prev: Option<SessionManifest>,
    ) -> Result<(), ServerError> {
        let Err(e) = replicas::replicate(&self.state, ns, m).await else { return Ok(()) };
        if matches!(e, ServerError::ConcurrentWrite { .. }) {
            let made = m.clone();
            if let Err(undo) = self.on_io(move |s| s.sessions().revert(s.tiers().session_pins(), &made, prev)).await {
                tracing::warn!(session = %m.id, "a write that met another node's was not undone here: {undo}");
            }
        }
        Err(e)
    }

    /// A park that creates a session (`expected_version` 0) in a cluster: refused when another
    /// member holds a live copy of it (`SessionExists`, as this node refuses one it holds), so
    /// two nodes never each hold a session of that id parked separately. When some members give
    /// no answer (down, cut off) the park goes on; what to do once it is made is returned (see
    /// [`Self::supersede_unverified`]).
    ///
    /// Two creates of one id through two nodes at once would each find no copy elsewhere: so a
    /// create first claims the id across the cluster ([`Membership::claim`]) and holds the claim
    /// until its park is done; a create through another node meanwhile waits for it, then finds
    /// that copy. Without an answer from the cluster's store the create goes on unclaimed.
    async fn check_create(
        &self,
        p: &Principal,
        ns: &Namespace,
        id: &str,
    ) -> Result<(Option<Unverified>, Option<HeldClaim>), ServerError> {
        let Some(peers) = self.state.tiers().peers() else { return Ok((None, None)) };
        if self.state.sessions().touched(ns.id(), id).is_some() {
            return Ok((None, None));
        }
        // A tenant's creates ask the cluster a few at a time (the operator's are not limited).
        let _slot = match p {
            Principal::Tenant(t) => Some(t.create_check(CREATE_CHECK_WAIT).await?),
            Principal::Operator => None,
        };
        let claim = self.claim_create(ns, id).await?;
        if self.state.sessions().touched(ns.id(), id).is_some() {
            // Made here while this create waited: the park refuses it as it would any create
            // of a session this node holds.
            return Ok((None, None));
        }
        let asked = Instant::now();
        let found = replicas::newest_elsewhere(&self.state, peers, ns, id, peers.timeout()).await;
        if let Some((from, m)) = found.newest {
            tracing::debug!(session = id, peer = %from.id, version = m.version, "a park creating a session held elsewhere");
            return Err(ServerError::SessionExists(id.to_string()));
        }
        if found.unanswered.is_empty() {
            return Ok((None, claim));
        }
        let at = asked.checked_sub(SUPERSEDE_MARGIN).unwrap_or(asked);
        Ok((Some(Unverified { at, members: found.unanswered }), claim))
    }

    /// The cluster-wide claim on creating session `id` of `ns`, waited for up to
    /// [`CREATE_CLAIM_WAIT`] while another node holds it; `None` when the cluster's store gives
    /// no answer (counted in `kvtier_session_create_claims_failed_total`).
    async fn claim_create(&self, ns: &Namespace, id: &str) -> Result<Option<HeldClaim>, ServerError> {
        let Some(membership) = self.membership.get() else { return Ok(None) };
        let what = format!("create:{}:{id}", ns.id());
        let waited = Instant::now();
        let (mut poll, mut waiting) = (CREATE_CLAIM_POLL, None);
        loop {
            match HeldClaim::take(membership, what.clone(), CREATE_CLAIM_TTL).await {
                Ok(Some(held)) => {
                    if waiting.is_some() {
                        ::metrics::counter!("kvtier_session_create_claims_waited_total").increment(1);
                    }
                    return Ok(Some(held));
                }
                // Made here meanwhile: nothing left to wait for.
                Ok(None) if self.state.sessions().touched(ns.id(), id).is_some() => return Ok(None),
                Ok(None) if waited.elapsed() < CREATE_CLAIM_WAIT => {
                    if waiting.is_none() {
                        waiting = Some(CREATES_WAITING.try_acquire().map_err(|_| ServerError::Peer {
                            peer: "cluster".into(),
                            reason: format!(
                                "session {id:?} is being created through another node, and {MAX_CREATES_WAITING} \
                                 creates wait on this node already; retry"
                            ),
                        })?);
                    }
                    tokio::time::sleep(poll).await;
                    poll = (poll * 2).min(CREATE_CLAIM_POLL_MAX);
                }
                Ok(None) => {
                    return Err(ServerError::Peer {
                        peer: "cluster".into(),
                        reason: format!(
                            "session {id:?} is being created through another node, still after {CREATE_CLAIM_WAIT:?}; \
                             retry"
                        ),
                    })
                }
                Err(e) => {
                    ::metrics::counter!("kvtier_session_create_claims_failed_total").increment(1);
                    tracing::debug!(session = id, "a create goes on unclaimed: {e}");
                    return Ok(None);
                }
            }
        }
    }

    /// A session created without every member's answer, once made: a drop of the id is remembered
    /// as of just before the park (carried to every node that asks, kept in the session log), so
    /// a copy a member that gave no answer holds — last touched before — counts as superseded
    /// wherever it is met, and those members are told so once they answer.
    async fn supersede_unverified(&self, ns: &Namespace, id: &str, u: Unverified) -> Result<(), ServerError> {
        let Some(peers) = self.state.tiers().peers() else { return Ok(()) };
        ::metrics::counter!("kvtier_session_created_unverified_total").increment(1);
        let (ns_id, session, at) = (ns.id(), id.to_string(), u.at);
        self.on_io(move |s| {
            s.sessions().remember_drop_at(ns_id, &session, at);
            Ok(())
        })
        .await?;
        replicas::supersede_elsewhere(peers, ns.clone(), id.to_string(), u.at, u.members);
        Ok(())
    }

    /// Whether this node's copy of a session was recovered from its session log at its start
    /// and not touched since, where the namespace keeps one copy per session: while the node was
    /// away the session may have been parked anew elsewhere, so such a copy is checked against
    /// the other members before it is served or written over.
    fn recovered_copy(&self, ns: &Namespace, id: &str) -> bool {
        self.state.tiers().peers().is_some_and(|p| p.rf_for(ns) < 2)
            && self.state.sessions().touched(ns.id(), id).is_some_and(|t| t < self.state.started_at())
    }

    /// A copy this node recovered at its start is checked against the other members before a
    /// park or extend writes over it ([`Self::adopt_newer_copy`]); `Unavailable` while a member
    /// gives no answer.
    async fn settle_recovered_copy(&self, ns: &Namespace, id: &str) -> Result<(), ServerError> {
        if !self.recovered_copy(ns, id) {
            return Ok(());
        }
        match self.adopt_newer_copy(ns, id).await {
            Some(e @ ServerError::Peer { .. }) => Err(e),
            _ => Ok(()),
        }
    }

    /// A session no member up now holds: "not found", or, where members left the cluster lately
    /// (a graceful stop leaves at once, and with them their copies), that it may be on them.
    /// Said only where as many members left as the namespace keeps copies (fewer leave one up).
    fn maybe_away(&self, ns: &Namespace, id: &str) -> ServerError {
        let Some(peers) = self.state.tiers().peers() else { return ServerError::SessionNotFound(id.into()) };
        let left = peers.departed();
        if left.is_empty() || left.len() < peers.rf_for(ns) {
            return ServerError::SessionNotFound(id.into());
        }
        let mut left: Vec<_> = left.into_iter().map(|(n, ago)| (ago, n)).collect();
        left.sort();
        let mut names: Vec<String> =
            left.iter().take(3).map(|(ago, n)| format!("{} ({}s ago)", n.as_str(), ago.as_secs())).collect();
        if left.len() > 3 {
            names.push(format!("{} more", left.len() - 3));
        }
        let left = format!("member{} {}", if left.len() == 1 { "" } else { "s" }, names.join(", "));
        ServerError::SessionAway { id: id.into(), left }
    }

    /// In a cluster: if this node has no copy of the session, adopts the newest copy another
    /// member holds (with any factor: a session parked with rf = 1 moves to the node the agent
    /// resumes on); where the namespace keeps 2+ copies (`rf_for`), also when an owner holds a
    /// newer copy than this node's, so the resume answers with the newest version any reachable
    /// owner has. Waits at most `CHECK_WAIT` when this node has a copy, `peer_timeout` when it
    /// has none; a failure leaves this node's copy (or none) in place. Returns why a copy another
    /// member holds could not be taken when that is a tenant's limit here (its quota, no room),
    /// or that the session expired on the owners that answered, for a resume that has no copy of
    /// its own to say so rather than "not found".
    async fn adopt_newer_copy(&self, ns: &Namespace, id: &str) -> Option<ServerError> {
        let peers = self.state.tiers().peers()?;
        let local = self.state.sessions().peek(ns.id(), id).map_or(0, |m| m.version);
        // With one copy per session, this node's copy is the session, unless it was recovered
        // at this node's start (see `recovered_copy`): that one waits for every member's answer.
        let recovered = self.recovered_copy(ns, id);
        if local > 0 && peers.rf_for(ns) < 2 && !recovered {
            return None;
        }
        let wait = if local > 0 && !recovered { replicas::CHECK_WAIT.min(peers.timeout()) } else { peers.timeout() };
        let found = replicas::newest_elsewhere(&self.state, peers, ns, id, wait).await;
        // This node's copy was dropped elsewhere while it was away: it goes (a newer session
        // under the id, if an owner holds one, is adopted in its place).
        if let Some((mine, ago)) = &found.stale_here {
            replicas::drop_stale_copy(&self.state, mine, *ago).await;
        }
        let Some((from, m)) = found.newest else {
            if let Some(ago) = found.expired_ago {
                return Some(ServerError::SessionExpired { id: id.into(), ago_ms: ago.as_millis() as u64 });
            }
            // No copy here (or one recovered at the start, not yet checked) and none among the
            // answers: a member that gave none may hold a newer one.
            if (local == 0 || recovered) && found.stale_here.is_none() && !found.unanswered.is_empty() {
                return Some(unanswered(id, &found.unanswered));
            }
            return None;
        };
        let version = m.version;
        match replicas::adopt(&self.state, peers, &from, ns, m).await {
            // With one copy per session, the session moves: the old node's copy would go stale.
            Ok(()) if peers.rf_for(ns) < 2 => {
                replicas::drop_copy(peers, from, ns.clone(), id.to_string(), version);
                None
            }
            Ok(()) => None,
            Err(e) => {
                tracing::warn!(session = id, peer = %from.id, version, "could not adopt the session's newer copy: {e}");
                ::metrics::counter!("kvtier_session_adopt_failures_total").increment(1);
                match e {
                    ServerError::QuotaExceeded(m) => Some(ServerError::QuotaExceeded(format!(
                        "session {id:?} is held by node {} and can't be taken here: {m}",
                        from.id
                    ))),
                    ServerError::Capacity(m) => Some(ServerError::Capacity(format!(
                        "session {id:?} is held by node {} and can't be taken here: {m}",
                        from.id
                    ))),
                    _ => None,
                }
            }
        }
    }

    /// A peer's `SessionReplica` call (operator only): this node's own copy of a session.
    async fn replica_call(
        &self,
        p: &Principal,
        r: pb::SessionReplicaRequest,
    ) -> Result<pb::SessionReplicaResponse, ServerError> {
        if !matches!(p, Principal::Operator) {
            return Err(ServerError::Forbidden("session replicas are for the cluster's nodes (the operator)".into()));
        }
        let id = ns_id(&r.namespace_id)?;
        check_session_id(&r.session_id)?;
        let ns = self.state.namespace(&id)?;
        let dropped_at = self.state.sessions().dropped_at(id, &r.session_id);
        let held = |m: Option<SessionManifest>| {
            let now = Instant::now();
            let (manifest, ttl_ms) = m.as_ref().map(|m| replicas::manifest_to_pb(m, now)).unzip();
            let expired_ago = match m {
                Some(_) => None,
                None => self.state.sessions().expired_ago(id, &r.session_id),
            };
            pb::SessionReplicaResponse {
                held: manifest.is_some(),
                manifest,
                ttl_ms: ttl_ms.unwrap_or(0),
                dropped: dropped_at.is_some(),
                dropped_ago_ms: dropped_at.map_or(0, |at| now.duration_since(at).as_millis() as u64),
                expired: expired_ago.is_some(),
                expired_ago_ms: expired_ago.map_or(0, |d| d.as_millis() as u64),
                ..Default::default()
            }
        };
        match pb::session_replica_request::Op::try_from(r.op) {
            Ok(pb::session_replica_request::Op::Get) => Ok(held(self.state.sessions().peek(id, &r.session_id))),
            Ok(pb::session_replica_request::Op::Drop) => {
                let version = r.manifest.as_ref().and_then(|m| m.info.as_ref()).map_or(u64::MAX, |i| i.version);
                let session = r.session_id.clone();
                // The session's drop (passed on by the node that took it), not a copy moving
                // away: remembered, as of when it was made, against its copies coming back.
                let dropped_at =
                    r.dropped.then(|| Instant::now().checked_sub(Duration::from_millis(r.dropped_ago_ms))).flatten();
                let removed = self
                    .on_io(move |s| {
                        let removed = s.sessions().drop_replica(s.tiers().session_pins(), id, &session, version);
                        if let Some(at) = dropped_at {
                            s.sessions().remember_drop_at(id, &session, at);
                        }
                        removed
                    })
                    .await?;
                let held = held(self.state.sessions().peek(id, &r.session_id));
                Ok(pb::SessionReplicaResponse { removed, ..held })
            }
            Ok(pb::session_replica_request::Op::Put) => {
                let copy =
                    r.manifest.as_ref().ok_or_else(|| ServerError::InvalidRequest("PUT without a manifest".into()))?;
                let m = replicas::manifest_from_pb(id, copy, r.ttl_ms, Instant::now())?;
                if m.id != r.session_id {
                    return Err(ServerError::InvalidRequest("the manifest is another session's".into()));
                }
                // A copy from a node that was away while the session was dropped: not taken back.
                if self.state.sessions().is_dropped_copy(&m) {
                    ::metrics::counter!("kvtier_session_dropped_copies_refused_total").increment(1);
                    return Ok(held(None));
                }
                // Two sessions under one id, one created while the node holding the other was
                // away: the older one's copy is refused here, or gives way here to the newer,
                // whatever their versions (see `SessionManifest::supersedes`).
                if let Some(mine) = self.state.sessions().peek(id, &r.session_id) {
                    if let Some(before) = mine.supersedes_before().filter(|_| mine.supersedes(&m)) {
                        ::metrics::counter!("kvtier_session_dropped_copies_refused_total").increment(1);
                        return Ok(pb::SessionReplicaResponse {
                            dropped: true,
                            dropped_ago_ms: before.elapsed().as_millis() as u64,
                            ..Default::default()
                        });
                    }
                    if let Some(before) = m.supersedes_before().filter(|_| m.supersedes(&mine)) {
                        let ago = before.elapsed();
                        replicas::drop_stale_copy(&self.state, &mine, ago).await;
                    }
                }
                if m.ttl > self.state.config().session_max_ttl.0 {
                    return Err(ServerError::InvalidRequest(format!(
                        "ttl {:?} exceeds the server's session_max_ttl {}",
                        m.ttl,
                        self.state.config().session_max_ttl
                    )));
                }
                let limits = self.state.session_limits(&ns);
                // Refused before its blocks are made durable (a refused copy left them on disk).
                match self.state.sessions().check_put_replica(&m, &limits) {
                    Err(ServerError::VersionConflict { .. }) => {
                        return Ok(held(self.state.sessions().peek(id, &r.session_id)))
                    }
                    Err(e) => return Err(e),
                    Ok(()) => {}
                }
                if let Err(e) = self.state.tiers().persist(&id, &m.keys, m.tail).await {
                    return match e {
                        ServerError::MissingBlocks { missing, missing_tail } => Ok(pb::SessionReplicaResponse {
                            missing_blocks: missing,
                            missing_tail,
                            ..Default::default()
                        }),
                        e => Err(e),
                    };
                }
                let kept =
                    self.on_io(move |s| Ok(s.sessions().put_replica(s.tiers().session_pins(), m, &limits))).await?;
                match kept {
                    Ok(m) => Ok(held(Some(m))),
                    Err(ServerError::VersionConflict { .. }) => Ok(held(self.state.sessions().peek(id, &r.session_id))),
                    Err(ServerError::MissingBlocks { missing, missing_tail }) => {
                        Ok(pb::SessionReplicaResponse { missing_blocks: missing, missing_tail, ..Default::default() })
                    }
                    Err(e) => Err(e),
                }
            }
            Err(_) => Err(ServerError::InvalidRequest(format!("unknown session replica op {}", r.op))),
        }
    }

    async fn extend(&self, p: &Principal, r: pb::ExtendRequest) -> Result<SessionManifest, ServerError> {
        let ns_id = ns_id(&r.namespace_id)?;
        let ns = self.state.namespace_for(p, &ns_id, Access::Write)?;
        let limits = self.state.session_limits(&ns);
        let new_keys = keys(&r.new_keys)?;
        let tail = opt_key(&r.tail_key)?;
        let base_key = opt_key(&r.base_key)?;
        check_session_id(&r.session_id)?;
        self.settle_recovered_copy(&ns, &r.session_id).await?;
        // Refused before anything is made durable (and checked again as the change is made).
        self.state.sessions().check_extend(
            ns_id,
            &r.session_id,
            r.expected_version,
            r.base_blocks as usize,
            base_key,
            (new_keys.len(), tail.is_some(), r.token_count),
            &limits,
        )?;
        // The tail the context keeps (checked here once: the change's own version check, made
        // again under the lock, keeps the manifest it was checked against).
        if let Some(tail) = opt_key(&r.base_tail_key)? {
            self.state.sessions().check_extend_tail(
                ns_id,
                &r.session_id,
                r.expected_version,
                r.base_blocks as usize,
                tail,
                &limits,
            )?;
        }
        self.state.tiers().persist(&ns_id, &new_keys, tail).await?;
        // What the session was, put back if this write meets another node's of the same version.
        let prev = self.state.sessions().peek(ns_id, &r.session_id).filter(|p| p.version == r.expected_version);
        let m = self
            .on_io(move |s| {
                s.sessions().extend(
                    s.tiers().session_pins(),
                    ns_id,
                    &r.session_id,
                    r.expected_version,
                    r.base_blocks as usize,
                    base_key,
                    new_keys,
                    tail,
                    r.token_count,
                    &limits,
                )
            })
            .await?;
        self.replicate_or_revert(&ns, &m, prev).await?;
        Ok(m)
    }
}

/// An event stream as the gRPC service returns it.
pub type EventStream = Pin<Box<dyn futures::Stream<Item = Result<pb::KvEvent, Status>> + Send>>;

/// An agent's demand stream (`AgentDemands`).
pub type DemandStream = Pin<Box<dyn futures::Stream<Item = Result<pb::AgentDemand, Status>> + Send>>;

/// Keys per `AgentDemand` message at most (what is queued when one is sent).
const DEMAND_BATCH: usize = 64;

/// An open demand stream: its queue, its registration (dropping it drops the agent's G1 index
/// for the namespace) and the node's stop signal.
struct Demands {
    rx: tokio::sync::mpsc::Receiver<BlockKey>,
    _link: crate::tiers::agent::AgentLinkGuard,
    stop: Option<watch::Receiver<bool>>,
}

impl Demands {
    /// The next batch of keys; `None` when the link was replaced or the node stops.
    async fn next(&mut self) -> Option<pb::AgentDemand> {
        let first = match &mut self.stop {
            Some(stop) => tokio::select! {
                _ = crate::stopped(stop) => return None,
                k = self.rx.recv() => k?,
            },
            None => self.rx.recv().await?,
        };
        let mut keys = vec![bytes::Bytes::copy_from_slice(&first.0)];
        while keys.len() < DEMAND_BATCH {
            match self.rx.try_recv() {
                Ok(k) => keys.push(bytes::Bytes::copy_from_slice(&k.0)),
                Err(_) => break,
            }
        }
        Some(pb::AgentDemand { keys })
    }
}

fn event_pb(node: &str, e: &KvEvent) -> pb::KvEvent {
    let kind = match e.kind {
        EventKind::Stored => pb::KvEventKind::BlocksStored,
        EventKind::Evicted => pb::KvEventKind::BlocksEvicted,
        EventKind::Purged => pb::KvEventKind::BlocksPurged,
        EventKind::SessionParked => pb::KvEventKind::SessionParked,
        EventKind::SessionDropped => pb::KvEventKind::SessionDropped,
        EventKind::SessionExpired => pb::KvEventKind::SessionExpired,
    };
    pb::KvEvent {
        node_id: node.to_string(),
        seq: e.seq,
        kind: kind as i32,
        namespace_id: bytes::Bytes::copy_from_slice(&e.namespace.0),
        keys: e.keys.iter().map(|k| bytes::Bytes::copy_from_slice(&k.0)).collect(),
        tier: e.tier.map(|t| t.as_str().to_string()).unwrap_or_default(),
        to_tier: e.to_tier.map(|t| t.as_str().to_string()).unwrap_or_default(),
        session_id: e.session.clone().unwrap_or_default(),
        missed: 0,
        unix_ms: e.unix_ms,
    }
}

/// One watcher's stream: its receiver, its slot under the watcher limits, and what it may see.
struct Watch {
    rx: broadcast::Receiver<Arc<KvEvent>>,
    _slot: WatchSlot,
    state: Arc<NodeState>,
    principal: Principal,
    /// The namespaces asked for; `None`: every namespace the principal may read.
    only: Option<HashSet<NamespaceId>>,
    stop: Option<watch::Receiver<bool>>,
}

impl Watch {
    /// The next event this watcher may see; `None` when the node stops.
    async fn next(&mut self) -> Option<pb::KvEvent> {
        loop {
            let got = match &mut self.stop {
                Some(stop) => tokio::select! {
                    _ = crate::stopped(stop) => return None,
                    got = self.rx.recv() => got,
                },
                None => self.rx.recv().await,
            };
            let node = self.state.tiers().events().node();
            match got {
                Ok(e) => {
                    let visible = match &self.only {
                        Some(only) => only.contains(&e.namespace),
                        None => self.state.may_read(&self.principal, &e.namespace),
                    };
                    if visible {
                        return Some(event_pb(node, &e));
                    }
                }
                Err(broadcast::error::RecvError::Lagged(missed)) => {
                    ::metrics::counter!("kvtier_event_watchers_lagged_total").increment(1);
                    return Some(pb::KvEvent {
                        node_id: node.to_string(),
                        kind: pb::KvEventKind::Lagged as i32,
                        missed,
                        ..Default::default()
                    });
                }
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    }
}

impl ControlPlane {
    /// This node as a routing hint lists it, and the other members (none without a cluster).
    fn members(&self) -> (Option<Member>, Vec<Member>, bool) {
        let Some(m) = self.membership.get() else { return (None, Vec::new(), false) };
        let local = m.local().clone();
        let snap = m.snapshot();
        let others = snap.members.iter().filter(|x| x.id != local.id).cloned().collect();
        (Some(local), others, snap.stale)
    }

    /// After a purge or an unregistration done here: the same on every other member (unless the
    /// request came from one, `local_only`). `None` on a node without a cluster.
    async fn delete_elsewhere(
        &self,
        ns: &Namespace,
        local_only: bool,
        what: NamespaceDelete,
    ) -> Option<pb::ClusterDelete> {
        let peers = self.state.tiers().peers()?;
        if local_only {
            // Forwards this node queued before the delete would put the blocks back elsewhere.
            peers.mark_deleted(ns.id());
            return None;
        }
        let (_, others, _) = self.members();
        let d = deletes::delete_elsewhere(peers, &others, ns, what).await;
        if !d.failed.is_empty() {
            tracing::warn!(
                failed = d.failed.len(),
                "a namespace {} did not reach every member; they are asked again in the background",
                what.name()
            );
        }
        let members = |list: Vec<(crate::cluster::NodeId, String)>| {
            list.into_iter().map(|(id, reason)| pb::MemberFailure { node_id: id.to_string(), reason }).collect()
        };
        Some(pb::ClusterDelete {
            members_done: d.members_done,
            blocks_removed: d.blocks_removed,
            sessions_dropped: d.sessions_dropped,
            failed: members(d.failed),
            away: members(d.away),
        })
    }

    async fn route_hint_for(
        &self,
        p: &Principal,
        r: pb::RouteHintRequest,
    ) -> Result<pb::RouteHintResponse, ServerError> {
        let id = ns_id(&r.namespace_id)?;
        let ns = self.state.namespace_for(p, &id, Access::Read)?;
        if !r.tokens.is_empty() && !r.keys.is_empty() {
            return Err(ServerError::InvalidRequest("give tokens or keys, not both".into()));
        }
        if r.session_id.len() > 256 {
            return Err(ServerError::InvalidRequest("session_id must be at most 256 bytes".into()));
        }
        let block_tokens = u64::from(ns.layout.block_tokens);
        let chain = if r.tokens.is_empty() {
            keys(&r.keys)?
        } else {
            if r.tokens.len() as u64 > self.state.config().max_context_tokens {
                return Err(ServerError::ContextTooLong {
                    tokens: r.tokens.len() as u64,
                    max: self.state.config().max_context_tokens,
                });
            }
            // The same derivation as every client's (`kvtier_proto::KeyChain`).
            let mut chain = kvtier_proto::KeyChain::new(&ns);
            if !r.key_extra.is_empty() {
                chain = chain.with_extra(&r.key_extra);
            }
            chain.full_blocks(&r.tokens)
        };
        self.state.check_context(&ns, chain.len())?;
        let session = (!r.session_id.is_empty()).then_some(r.session_id.as_str());
        let here = LocalHolding {
            prefix_blocks: self.state.tiers().longest_prefix(&id, &chain) as u32,
            session_tokens: session.and_then(|s| self.state.sessions().tokens_of(id, s)),
        };
        let holding = |m: Option<&Member>, h: &LocalHolding, answering: bool| pb::NodeHolding {
            node_id: m.map(|m| m.id.to_string()).unwrap_or_default(),
            grpc_addr: m.map(|m| m.grpc_addr.clone()).unwrap_or_default(),
            data_addr: m.map(|m| m.data_addr.clone()).unwrap_or_default(),
            answering,
            reachable: true,
            prefix_blocks: h.prefix_blocks,
            prefix_tokens: u64::from(h.prefix_blocks) * block_tokens,
            holds_session: h.session_tokens.is_some(),
            session_tokens: h.session_tokens.unwrap_or(0),
            error: String::new(),
        };
        let (local, others, stale) = self.members();
        let mut nodes = vec![holding(local.as_ref(), &here, true)];
        if !r.local_only && !others.is_empty() {
            let answers = match self.state.tiers().peers() {
                Some(peers) => peers.route_hints(&others, &ns, &chain, session).await,
                None => others.iter().map(|_| Err("this node has no peer transport".to_string())).collect(),
            };
            for (m, a) in others.iter().zip(answers) {
                nodes.push(match a {
                    Ok(h) => holding(Some(m), &h, false),
                    Err(why) => pb::NodeHolding {
                        node_id: m.id.to_string(),
                        grpc_addr: m.grpc_addr.clone(),
                        data_addr: m.data_addr.clone(),
                        reachable: false,
                        error: why,
                        ..Default::default()
                    },
                });
            }
        }
        Ok(pb::RouteHintResponse {
            total_blocks: chain.len() as u32,
            block_tokens: ns.layout.block_tokens,
            nodes,
            membership_stale: stale,
        })
    }
}

#[tonic::async_trait]
impl pb::kv_tier_server::KvTier for ControlPlane {
    type WatchEventsStream = EventStream;

    async fn watch_events(
        &self,
        r: Request<pb::WatchEventsRequest>,
    ) -> Result<Response<Self::WatchEventsStream>, Status> {
        let p = principal(&r)?;
        let mut only = HashSet::new();
        for raw in &r.get_ref().namespace_ids {
            let id = ns_id(raw).map_err(to_status)?;
            self.state.namespace_for(&p, &id, Access::Read).map_err(to_status)?;
            only.insert(id);
        }
        let bus = self.state.tiers().events().clone();
        let slot = bus.admit(p.tenant().map(|t| t.name.as_str())).map_err(to_status)?;
        let w = Watch {
            rx: bus.subscribe(),
            _slot: slot,
            state: self.state.clone(),
            principal: p,
            only: (!only.is_empty()).then_some(only),
            stop: self.stop.clone(),
        };
        let stream = futures::stream::unfold(w, |mut w| async move { w.next().await.map(|e| (Ok(e), w)) });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn members(&self, r: Request<pb::MembersRequest>) -> Result<Response<pb::MembersResponse>, Status> {
        principal(&r)?;
        let Some(m) = self.membership.get() else { return Ok(Response::new(pb::MembersResponse::default())) };
        let snap = m.snapshot();
        let mut departed = self.state.tiers().peers().map(|p| p.departed()).unwrap_or_default();
        departed.sort_by_key(|(_, ago)| *ago);
        let departed = departed
            .into_iter()
            .map(|(id, ago)| pb::DepartedMember {
                node_id: id.as_str().to_string(),
                left_ms_ago: u64::try_from(ago.as_millis()).unwrap_or(u64::MAX),
            })
            .collect();
        Ok(Response::new(pb::MembersResponse {
            members: snap.members.iter().map(Member::to_pb).collect(),
            local_id: m.local().id.as_str().to_string(),
            cluster_rf: self.state.config().cluster_rf as u32,
            stale: snap.stale,
            departed,
        }))
    }

    async fn session_replica(
        &self,
        r: Request<pb::SessionReplicaRequest>,
    ) -> Result<Response<pb::SessionReplicaResponse>, Status> {
        let p = principal(&r)?;
        let out = self.replica_call(&p, r.into_inner()).await.map_err(to_status)?;
        Ok(Response::new(out))
    }

    async fn report_agent_blocks(
        &self,
        r: Request<pb::AgentBlocksReport>,
    ) -> Result<Response<pb::AgentBlocksAck>, Status> {
        let p = principal(&r)?;
        let r = r.into_inner();
        let res = (|| {
            let id = ns_id(&r.namespace_id)?;
            self.state.namespace_for(&p, &id, Access::Write)?;
            let n = r.stored.len() + r.evicted.len() + r.dropped.len() + r.unspilled.len();
            let max = self.state.config().max_blocks_per_request as usize;
            if n > max {
                return Err(ServerError::InvalidRequest(format!("{n} keys in one agent report; at most {max}")));
            }
            Ok::<_, ServerError>((id, keys(&r.stored)?, keys(&r.evicted)?, keys(&r.dropped)?, keys(&r.unspilled)?))
        })();
        let (id, stored, evicted, dropped, unspilled) = res.map_err(to_status)?;
        if !r.agent_id.is_empty() {
            let left: Vec<BlockKey> = evicted.iter().chain(&dropped).copied().collect();
            let agents = self.state.tiers().agents();
            agents.report(&id, &r.agent_id, &stored, &left);
            agents.unspilled(&id, &r.agent_id, &unspilled);
        }
        if r.resync {
            return Ok(Response::new(pb::AgentBlocksAck {}));
        }
        let events = self.state.tiers().events();
        if !stored.is_empty() {
            events.stored(&id, &stored, TierId::Hbm);
        }
        if !evicted.is_empty() {
            events.evicted(&id, &evicted, TierId::Hbm, Some(TierId::Dram));
        }
        if !dropped.is_empty() {
            events.evicted(&id, &dropped, TierId::Hbm, None);
        }
        Ok(Response::new(pb::AgentBlocksAck {}))
    }

    type AgentDemandsStream = DemandStream;

    async fn agent_demands(
        &self,
        r: Request<pb::AgentDemandsRequest>,
    ) -> Result<Response<Self::AgentDemandsStream>, Status> {
        let p = principal(&r)?;
        let r = r.into_inner();
        let res = (|| {
            let id = ns_id(&r.namespace_id)?;
            self.state.namespace_for(&p, &id, Access::Write)?;
            if r.agent_id.is_empty() || r.agent_id.len() > 128 {
                return Err(ServerError::InvalidRequest("agent_id must be 1..=128 bytes".into()));
            }
            Ok::<_, ServerError>(id)
        })();
        let id = res.map_err(to_status)?;
        let (rx, link) = self.state.tiers().agents().open(id, &r.agent_id).map_err(to_status)?;
        tracing::info!(agent = r.agent_id, principal = p.name(), "a GPU agent opened its demand stream");
        let d = Demands { rx, _link: link, stop: self.stop.clone() };
        let stream = futures::stream::unfold(d, |mut d| async move { d.next().await.map(|m| (Ok(m), d)) });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn route_hint(&self, r: Request<pb::RouteHintRequest>) -> Result<Response<pb::RouteHintResponse>, Status> {
        let p = principal(&r)?;
        let out = self.route_hint_for(&p, r.into_inner()).await.map_err(to_status)?;
        Ok(Response::new(out))
    }

    async fn same_node_ticket(
        &self,
        r: Request<pb::SameNodeTicketRequest>,
    ) -> Result<Response<pb::SameNodeTicketResponse>, Status> {
        let p = principal(&r)?;
        let ticket = self.state.tenants().tickets().issue(&p).map_err(to_status)?;
        let ttl_ms = crate::tickets::TICKET_TTL.as_millis() as u32;
        Ok(Response::new(pb::SameNodeTicketResponse { ticket, ttl_ms }))
    }

    async fn info(&self, r: Request<pb::InfoRequest>) -> Result<Response<pb::InfoResponse>, Status> {
        let tenant = principal(&r)?.tenant().map(|t| t.name.clone()).unwrap_or_default();
        let c = self.state.config();
        Ok(Response::new(pb::InfoResponse {
            version: env!("CARGO_PKG_VERSION").to_string(),
            data_addr: self.state.data_addr().to_string(),
            max_frame_bytes: c.max_frame_bytes.0,
            max_blocks_per_request: c.max_blocks_per_request,
            max_context_tokens: c.max_context_tokens,
            dram_capacity_bytes: c.dram_capacity.0,
            // `start` leaves the resolved absolute path here, or "off".
            samenode_socket: if c.samenode_socket == "off" { String::new() } else { c.samenode_socket.clone() },
            host_id: c.host_id.clone().unwrap_or_else(|| crate::samenode::host_id().to_string()),
            session_max_ttl_ms: u64::try_from(c.session_max_ttl.0.as_millis()).unwrap_or(u64::MAX),
            tenant,
        }))
    }

    async fn register_namespace(
        &self,
        r: Request<pb::NamespaceSpec>,
    ) -> Result<Response<pb::RegisterNamespaceResponse>, Status> {
        let p = principal(&r)?;
        let ns = Namespace::from_pb(r.get_ref()).map_err(|e| to_status(e.into()))?;
        let block_bytes = ns.layout.block_bytes();
        // It may append to (and sync) the namespace log.
        let state = self.state.clone();
        let registered = self.state.io().run(None, move || state.register_namespace(&p, ns)).await;
        let id = registered.map_err(|e| to_status(e.into()))?.map_err(to_status)?;
        Ok(Response::new(pb::RegisterNamespaceResponse {
            namespace_id: bytes::Bytes::copy_from_slice(&id.0),
            block_bytes,
        }))
    }

    async fn lookup(&self, r: Request<pb::LookupRequest>) -> Result<Response<pb::LookupResponse>, Status> {
        let p = principal(&r)?;
        let r = r.into_inner();
        let res = (|| {
            let id = ns_id(&r.namespace_id)?;
            let ns = self.state.namespace_for(&p, &id, Access::Read)?;
            self.state.check_context(&ns, r.keys.len())?;
            let keys = keys(&r.keys)?;
            Ok::<_, ServerError>((ns, keys))
        })();
        let (ns, keys) = res.map_err(to_status)?;
        // Local tiers first, then (in a cluster) the owners of the keys after the local prefix.
        let matched = self.state.tiers().longest_prefix_with_peers(&ns, &keys).await;
        Ok(Response::new(pb::LookupResponse { matched_blocks: matched as u32 }))
    }

    async fn park_session(&self, r: Request<pb::ParkRequest>) -> Result<Response<pb::ParkResponse>, Status> {
        let p = principal(&r)?;
        let parked = self.park(&p, r.into_inner()).await;
        if let Ok(m) = &parked {
            self.state.tiers().share_session(m).await; // Redis tier: manifest + blocks shared (no-op without one)
        }
        park_response(parked)
    }

    async fn extend_session(&self, r: Request<pb::ExtendRequest>) -> Result<Response<pb::ParkResponse>, Status> {
        let p = principal(&r)?;
        let extended = self.extend(&p, r.into_inner()).await;
        if let Ok(m) = &extended {
            self.state.tiers().share_session(m).await; // Redis tier: manifest + blocks shared (no-op without one)
        }
        park_response(extended)
    }

    async fn resume_session(&self, r: Request<pb::ResumeRequest>) -> Result<Response<pb::SessionManifest>, Status> {
        let p = principal(&r)?;
        let r = r.into_inner();
        let id = ns_id(&r.namespace_id).map_err(to_status)?;
        let ns = self.state.namespace_for(&p, &id, Access::Read).map_err(to_status)?;
        check_session_id(&r.session_id).map_err(to_status)?;
        let recovered = self.recovered_copy(&ns, &r.session_id);
        let refused = self.adopt_newer_copy(&ns, &r.session_id).await;
        // A copy recovered at this node's start is not served (nor touched) before every member
        // has answered: one that did not may hold the session parked anew.
        if recovered && matches!(refused, Some(ServerError::Peer { .. })) && self.recovered_copy(&ns, &r.session_id) {
            if let Some(e) = refused {
                return Err(to_status(e));
            }
        }
        let res = self.state.sessions().resume(self.state.tiers().session_pins(), id, &r.session_id);
        // Held elsewhere, refused here by a limit: said, not "not found".
        let res = match (res, refused) {
            (Err(ServerError::SessionNotFound(_)), Some(why)) => Err(why),
            (res, _) => res,
        };
        // Redis tier: a session this node doesn't hold, from its manifest there (no-op without one).
        let res = match res {
            Err(
                e @ (ServerError::SessionNotFound(_) | ServerError::SessionExpired { .. } | ServerError::Peer { .. }),
            ) => self.state.tiers().resume_shared(&id, &r.session_id).await.ok_or(e),
            other => other,
        };
        let res = match res {
            Err(ServerError::SessionNotFound(_)) => Err(self.maybe_away(&ns, &r.session_id)),
            other => other,
        };
        let m = res.map_err(to_status)?;
        Ok(Response::new(m.to_pb(Instant::now())))
    }

    async fn drop_session(
        &self,
        r: Request<pb::DropSessionRequest>,
    ) -> Result<Response<pb::DropSessionResponse>, Status> {
        let p = principal(&r)?;
        let r = r.into_inner();
        let id = ns_id(&r.namespace_id).map_err(to_status)?;
        self.state.namespace_for(&p, &id, Access::Write).map_err(to_status)?;
        check_session_id(&r.session_id).map_err(to_status)?;
        let session = r.session_id;
        let ns = self.state.namespace(&id).map_err(to_status)?;
        let dropped_at = Instant::now();
        let dropped = self
            .on_io({
                let session = session.clone();
                move |s| {
                    let dropped = s.sessions().drop_session(s.tiers().session_pins(), id, &session)?;
                    // Remembered against copies on nodes the drop does not reach now (away,
                    // restarting).
                    if dropped {
                        s.sessions().remember_drop_at(id, &session, dropped_at);
                    }
                    Ok(dropped)
                }
            })
            .await
            .map_err(to_status)?;
        // Redis tier: its manifest too (no-op without one), once the local drop is logged (a
        // drop refused here, on a full disk, leaves the shared copy too).
        self.state.tiers().drop_shared(&id, &session).await;
        let mut dropped = dropped;
        if let Some(peers) = replicas::replicating(&self.state, &ns) {
            let elsewhere = replicas::drop_elsewhere(peers, ns, session.clone(), dropped_at);
            // Not held here (parked through another node): whether an owner's copy went, if they
            // answer soon; the drop goes on in the background either way.
            if !dropped {
                let wait = replicas::CHECK_WAIT.min(peers.timeout());
                dropped = matches!(tokio::time::timeout(wait, elsewhere).await, Ok(Ok(true)));
                // An owner's copy went: this node took the drop, and remembers it as its holders
                // do (in its session log where it has one), against a copy on a node away now.
                if dropped {
                    let session = session.clone();
                    self.on_io(move |s| {
                        s.sessions().remember_drop_at(id, &session, dropped_at);
                        Ok(())
                    })
                    .await
                    .map_err(to_status)?;
                }
            }
        }
        Ok(Response::new(pb::DropSessionResponse { dropped }))
    }

    async fn list_sessions(
        &self,
        r: Request<pb::ListSessionsRequest>,
    ) -> Result<Response<pb::ListSessionsResponse>, Status> {
        let p = principal(&r)?;
        let r = r.into_inner();
        let ns = if r.namespace_id.is_empty() { None } else { Some(ns_id(&r.namespace_id).map_err(to_status)?) };
        if let Some(id) = &ns {
            self.state.namespace_for(&p, id, Access::Read).map_err(to_status)?;
        }
        let now = Instant::now();
        // A tenant sees the sessions of the namespaces it may read, and no others.
        let keep = |m: &SessionManifest| ns.is_some() || self.state.may_read(&p, &m.namespace);
        // Each with its namespace's tenant (`session ls --all` shows whose).
        let info = |m: &SessionManifest| pb::SessionInfo {
            tenant: self.state.namespace(&m.namespace).map(|n| n.tenant).unwrap_or_default(),
            ..session_info(m, now)
        };
        if r.limit == 0 {
            let sessions = self.state.sessions().list(ns).iter().filter(|m| keep(m)).map(info).collect();
            return Ok(Response::new(pb::ListSessionsResponse { sessions, more: false }));
        }
        let after = match r.after_namespace_id.is_empty() {
            true => None,
            false => Some((ns_id(&r.after_namespace_id).map_err(to_status)?, r.after_session_id.as_str())),
        };
        let limit = (r.limit as usize).min(MAX_SESSIONS_PAGE);
        let (page, more) = self.state.sessions().list_page(ns, after, limit, keep);
        let sessions = page.iter().map(info).collect();
        Ok(Response::new(pb::ListSessionsResponse { sessions, more }))
    }

    /// Node-wide tier figures for everyone; the session and namespace counts are the tenant's own
    /// when a tenant asks.
    async fn stats(&self, r: Request<pb::StatsRequest>) -> Result<Response<pb::StatsResponse>, Status> {
        let p = principal(&r)?;
        // A tenant sees its own bytes in the tiers; the node-wide figures are the operator's.
        let stats = match p.tenant() {
            None => self.state.tiers().stats(),
            Some(t) => self.state.tiers().account_stats(t.index),
        };
        let tier_pb = |stats: Vec<(TierId, crate::tiers::TierStats)>| -> Vec<pb::TierStats> {
            stats
                .into_iter()
                .map(|(id, s)| pb::TierStats {
                    tier: id.as_str().into(),
                    capacity_bytes: s.capacity_bytes,
                    resident_bytes: s.resident_bytes,
                    allocated_bytes: s.allocated_bytes,
                    pinned_bytes: s.pinned_bytes,
                    blocks: s.blocks,
                    hits: s.hits,
                    misses: s.misses,
                    evictions: s.evictions,
                    bytes_in: s.bytes_in,
                    bytes_out: s.bytes_out,
                    requests: s.requests,
                    errors: s.errors,
                })
                .collect()
        };
        // A tenant's namespaces and sessions, as its own Stats counts them.
        let owned = |t: &crate::tenants::Tenant| {
            let own = self.state.namespaces_of(&t.name);
            (self.state.sessions().count_in(&own).0, own.len() as u64)
        };
        let ((sessions, namespaces), tenants) = match p.tenant() {
            None => {
                let mut tenants: Vec<_> = self.state.tenants().all().collect();
                tenants.sort_by(|a, b| a.name.cmp(&b.name));
                let tenants = tenants
                    .into_iter()
                    .map(|t| {
                        let (sessions, namespaces) = owned(t);
                        let tiers = tier_pb(self.state.tiers().account_stats(t.index));
                        pb::TenantStats { tenant: t.name.clone(), namespaces, sessions, tiers }
                    })
                    .collect();
                ((self.state.sessions().len() as u64, self.state.namespace_count() as u64), tenants)
            }
            Some(t) => (owned(t), Vec::new()),
        };
        Ok(Response::new(pb::StatsResponse {
            tiers: tier_pb(stats),
            sessions,
            namespaces,
            uptime_ms: self.state.uptime().as_millis() as u64,
            tenants,
        }))
    }

    async fn unregister_namespace(
        &self,
        r: Request<pb::UnregisterNamespaceRequest>,
    ) -> Result<Response<pb::UnregisterNamespaceResponse>, Status> {
        let p = principal(&r)?;
        let id = ns_id(&r.get_ref().namespace_id).map_err(to_status)?;
        // A member reached late (`as_of_ago_ms`): sessions touched since the unregistration was
        // asked belong to the namespace registered again, and keep it.
        let as_of = match (r.get_ref().local_only, r.get_ref().as_of_ago_ms) {
            (true, ago) if ago > 0 => Some(Instant::now().checked_sub(Duration::from_millis(ago))),
            _ => None,
        };
        let ns = match self.state.namespace_for(&p, &id, Access::Write) {
            Ok(ns) => ns,
            Err(e) => {
                // Passed on by the member that took it, for a namespace this node does not know:
                // it holds none of the sessions, but remembers when they went, so that a copy
                // held by a node that was away is not adopted through here (the resume that
                // asks registers the namespace again). The answer is the same.
                let asked = as_of.unwrap_or_else(|| Some(Instant::now()));
                if let (ServerError::UnknownNamespace(_), Principal::Operator, Some(at)) = (&e, &p, asked) {
                    if r.get_ref().local_only {
                        let remembered = self
                            .on_io(move |s| {
                                s.sessions().remember_unregistered_at(id, at);
                                Ok(())
                            })
                            .await;
                        if let Err(err) = remembered {
                            tracing::warn!("an unregistration passed on was not remembered: {err}");
                        }
                    }
                }
                return Err(to_status(e));
            }
        };
        // It appends to (and syncs) the namespace and session logs.
        let (sessions_dropped, blocks_removed) =
            self.on_io(move |s| s.unregister_namespace_as_of(&p, &id, as_of)).await.map_err(to_status)?;
        let peers = self.delete_elsewhere(&ns, r.get_ref().local_only, NamespaceDelete::Unregister).await;
        Ok(Response::new(pb::UnregisterNamespaceResponse { sessions_dropped, blocks_removed, peers }))
    }

    async fn purge(&self, r: Request<pb::PurgeRequest>) -> Result<Response<pb::PurgeResponse>, Status> {
        let p = principal(&r)?;
        let id = ns_id(&r.get_ref().namespace_id).map_err(to_status)?;
        let ns = self.state.namespace_for(&p, &id, Access::Write).map_err(to_status)?;
        // It appends to (and syncs) the namespace log.
        let removed = self.on_io(move |s| s.purge_namespace(&p, &id)).await.map_err(to_status)?;
        let peers = self.delete_elsewhere(&ns, r.get_ref().local_only, NamespaceDelete::Purge).await;
        Ok(Response::new(pb::PurgeResponse { blocks_removed: removed, peers }))
    }
}
