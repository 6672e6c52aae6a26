//! The network under the server's G4 peer tier (`kvtier_server::cluster::PeerTransport`): one
//! pooled [`KvClient`] per peer (data plane over TCP, or over one QUIC connection per peer with
//! `peer_transport = "quic"`), authenticated with this node's
//! `auth_token` — the operator's token, which every node of a cluster must share. Before a
//! peer first sees a namespace it is registered there: a namespace's id is a hash of its spec, so
//! the same spec registers the same namespace on every node, and the operator may register any
//! tenant's (within the tenant's `max_namespaces` there). A call that failed — no answer, a cut
//! connection — drops the peer's client and registrations, so the next call starts over; a
//! refusal the peer answered with (a quota, no room, a namespace it no longer knows) keeps its
//! kind and the connection, and is no sign the peer is down.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvtier_client::{ClientConfig, ClientError, KvClient, NamespaceHandle, QuicConnector, SameNodeMode};
use kvtier_proto::dataplane::ItemStatus;
use kvtier_proto::pb::session_replica_request::Op;
use kvtier_proto::{pb, BlockFrame, BlockKey, Namespace, NamespaceId};
use kvtier_server::cluster::{
    replicas, LocalHolding, Member, NamespaceDelete, NodeId, PeerFuture, PeerTransport, ReplicaCopy, ReplicaPut,
};
use kvtier_server::dram::StoredBlock;
use kvtier_server::sessions::SessionManifest;
use kvtier_server::ServerError;

/// A client for one peer and the namespaces registered there.
struct Peer {
    addr: String,
    client: KvClient,
    namespaces: Mutex<HashMap<NamespaceId, NamespaceHandle>>,
}

/// [`PeerTransport`] over `kvtier-client`.
pub struct ClientTransport {
    cfg: ClientConfig,
    /// Whether peers' data planes are reached over QUIC (their UDP listener on the data port).
    quic: bool,
    peers: Mutex<HashMap<NodeId, Arc<Peer>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl ClientTransport {
    /// Calls bounded by `timeout`, authenticated with `auth_token` (and over TLS with `tls`, the
    /// node's own certificate presented to its peers); data over QUIC with `quic` (which needs
    /// `tls`).
    pub fn new(
        auth_token: Option<String>,
        timeout: Duration,
        tls: Option<kvtier_client::ClientTls>,
        quic: bool,
    ) -> Self {
        let cfg = ClientConfig {
            connect_timeout: timeout,
            request_timeout: timeout,
            data_connections: 4,
            max_batch_blocks: usize::MAX,
            auth_token,
            samenode: SameNodeMode::Off,
            // A node's cores are its clients': it waits for its peers parked.
            dataplane_poll: std::time::Duration::ZERO,
            tls,
            ..ClientConfig::default()
        };
        ClientTransport { cfg, quic, peers: Mutex::new(HashMap::new()) }
    }

    fn err(peer: &Member, e: impl std::fmt::Display) -> ServerError {
        ServerError::Peer { peer: peer.id.to_string(), reason: e.to_string() }
    }

    /// The peer's client (connecting once).
    async fn peer(&self, peer: &Member) -> Result<Arc<Peer>, ServerError> {
        let known = lock(&self.peers).get(&peer.id).filter(|p| p.addr == peer.grpc_addr).cloned();
        Ok(match known {
            Some(p) => p,
            None => {
                let client = match (&self.cfg.tls, self.quic) {
                    (Some(tls), true) => {
                        let quic = QuicConnector::new(&peer.data_addr, tls).map_err(|e| Self::err(peer, e))?;
                        KvClient::connect_with(&peer.grpc_addr, self.cfg.clone(), quic).await
                    }
                    _ => KvClient::connect(&peer.grpc_addr, self.cfg.clone()).await,
                }
                .map_err(|e| match e {
                    ClientError::Unauthenticated(m) => Self::refused_credential(peer, m),
                    e => Self::err(peer, e),
                })?;
                let p = Arc::new(Peer { addr: peer.grpc_addr.clone(), client, namespaces: Mutex::new(HashMap::new()) });
                lock(&self.peers).insert(peer.id.clone(), p.clone());
                p
            }
        })
    }

    /// The peer's client (connecting once), and its handle for `ns` (registering it once).
    async fn handle(&self, peer: &Member, ns: &Namespace) -> Result<(Arc<Peer>, NamespaceHandle), ServerError> {
        let p = self.peer(peer).await?;
        let id = ns.id();
        let known = lock(&p.namespaces).get(&id).cloned();
        let h = match known {
            Some(h) => h,
            None => {
                let h = p.client.register(ns.clone()).await.map_err(|e| self.failure(peer, ns, e))?;
                lock(&p.namespaces).insert(id, h.clone());
                h
            }
        };
        Ok((p, h))
    }

    /// A failed call's error. A refusal the peer answered with (a tenant's quota, no room, a
    /// tenant's access, a namespace it does not know) keeps its kind, and the connection is kept: the peer is up, and treating
    /// it as down would skip it for every tenant. Anything else (the connection, a timeout, a
    /// wrong answer) drops the peer's client, so the next call starts over.
    /// A namespace the peer no longer knows (unregistered there) is forgotten here too, so the
    /// next call registers it again; it is no sign the peer is down either.
    fn failure(&self, peer: &Member, ns: &Namespace, e: ClientError) -> ServerError {
        let on = |m: String| format!("on node {}: {m}", peer.id);
        match e {
            ClientError::QuotaExceeded(m) => ServerError::QuotaExceeded(on(m)),
            ClientError::Capacity(m) => ServerError::Capacity(on(m)),
            ClientError::Forbidden(m) => ServerError::Forbidden(on(m)),
            ClientError::UnknownNamespace(_) => {
                if let Some(p) = lock(&self.peers).get(&peer.id) {
                    lock(&p.namespaces).remove(&ns.id());
                }
                ServerError::UnknownNamespace(ns.id())
            }
            // The operator's credential refused there: the nodes don't share auth_token (or a
            // node's TLS identity isn't among its peers' operator_names).
            ClientError::Unauthenticated(m) => {
                self.forget(peer);
                Self::refused_credential(peer, m)
            }
            e => {
                self.forget(peer);
                Self::err(peer, e)
            }
        }
    }

    /// `peer` refused this node's credential: a refusal, not a node down (nothing is retried
    /// against it as if it were away, no hint is kept for it). A misconfigured cluster, so said
    /// at WARN (once per 10 s, with how many were held back) and counted in
    /// `kvtier_peer_credential_refused_total`: a node whose `auth_token` differs joins, and its
    /// misses, lost forwards and unreplicated parks would otherwise show only at DEBUG.
    fn refused_credential(peer: &Member, m: String) -> ServerError {
        static SAID: kvtier_server::metrics::LogThrottle =
            kvtier_server::metrics::LogThrottle::new(Duration::from_secs(10));
        let e = ServerError::Forbidden(format!(
            "on node {}: it refused this node's credential ({m}): every node of a cluster must share auth_token \
             (and, with mTLS, take each other's certificates as the operator)",
            peer.id
        ));
        ::metrics::counter!("kvtier_peer_credential_refused_total").increment(1);
        if let Some(held_back) = SAID.allow() {
            tracing::warn!(peer = %peer.id, held_back, "{e}");
        }
        e
    }

    fn forget(&self, peer: &Member) {
        lock(&self.peers).remove(&peer.id);
    }
}

impl PeerTransport for ClientTransport {
    fn get<'a>(
        &'a self,
        peer: &'a Member,
        ns: &'a Namespace,
        keys: &'a [BlockKey],
    ) -> PeerFuture<'a, Vec<Option<StoredBlock>>> {
        Box::pin(async move {
            let (p, h) = self.handle(peer, ns).await?;
            match p.client.peer_load_keys(&h, keys).await {
                Ok(frames) => Ok(frames
                    .into_iter()
                    .map(|f| f.map(|BlockFrame { header, payload }| StoredBlock { header, payload }))
                    .collect()),
                Err(e) => Err(self.failure(peer, ns, e)),
            }
        })
    }

    fn exists<'a>(&'a self, peer: &'a Member, ns: &'a Namespace, keys: &'a [BlockKey]) -> PeerFuture<'a, Vec<bool>> {
        Box::pin(async move {
            let (p, h) = self.handle(peer, ns).await?;
            // Flagged as a peer's: answered from the peer's own tiers, never passed on.
            p.client.peer_exists_keys(&h, keys).await.map_err(|e| self.failure(peer, ns, e))
        })
    }

    fn delete<'a>(
        &'a self,
        peer: &'a Member,
        ns: &'a Namespace,
        what: NamespaceDelete,
        asked: std::time::SystemTime,
    ) -> PeerFuture<'a, (u64, u64)> {
        Box::pin(async move {
            // Not registered there first: a peer that does not know the namespace holds nothing.
            let p = self.peer(peer).await?;
            let namespace_id = bytes::Bytes::copy_from_slice(&ns.id().0);
            let mut g = p.client.raw_grpc();
            let answer = match what {
                NamespaceDelete::Purge => g
                    .purge(pb::PurgeRequest { namespace_id, local_only: true })
                    .await
                    .map(|r| (0, r.into_inner().blocks_removed)),
                NamespaceDelete::Unregister => g
                    .unregister_namespace(pb::UnregisterNamespaceRequest {
                        namespace_id,
                        local_only: true,
                        // At least 1: 0 says "now" (a call made at once is made as of now).
                        as_of_ago_ms: (asked.elapsed().unwrap_or_default().as_millis() as u64).max(1),
                    })
                    .await
                    .map(|r| r.into_inner())
                    .map(|r| (r.sessions_dropped, r.blocks_removed)),
            };
            // Registered again by the next call that needs it (the tenant registered it anew).
            lock(&p.namespaces).remove(&ns.id());
            match answer {
                Ok(done) => Ok(done),
                Err(s) if s.code() == tonic::Code::NotFound => Ok((0, 0)),
                Err(s) => {
                    self.forget(peer);
                    Err(Self::err(peer, format!("{}: {}", s.code(), s.message())))
                }
            }
        })
    }

    fn route_local<'a>(
        &'a self,
        peer: &'a Member,
        ns: &'a Namespace,
        keys: &'a [BlockKey],
        session: Option<&'a str>,
    ) -> PeerFuture<'a, LocalHolding> {
        Box::pin(async move {
            let (p, h) = self.handle(peer, ns).await?;
            // A `RouteHint` with `local_only`: the peer answers from its own tiers and sessions.
            match p.client.route_hint_local(&h, keys, session).await {
                Ok((prefix, session_tokens)) => Ok(LocalHolding { prefix_blocks: prefix as u32, session_tokens }),
                Err(e) => Err(self.failure(peer, ns, e)),
            }
        })
    }

    fn put<'a>(&'a self, peer: &'a Member, ns: &'a Namespace, blocks: &'a [StoredBlock]) -> PeerFuture<'a, usize> {
        Box::pin(async move {
            let _ = self.handle(peer, ns).await?;
            let Some(p) = lock(&self.peers).get(&peer.id).cloned() else {
                return Err(Self::err(peer, "no client"));
            };
            let frames: Vec<BlockFrame> =
                blocks.iter().map(|b| BlockFrame { header: b.header, payload: b.payload.clone() }).collect();
            let mut st = match p.client.peer_store_frames(&frames).await {
                Ok(st) => st,
                Err(e) => return Err(self.failure(peer, ns, e)),
            };
            // The peer no longer knows the namespace (it restarted without a disk tier, or it was
            // unregistered there): registered again, and the blocks sent once more. Before, every
            // later forward to it was refused block by block, for good, and counted nowhere.
            if st.contains(&ItemStatus::UnknownNamespace) {
                lock(&p.namespaces).remove(&ns.id());
                let _ = self.handle(peer, ns).await?;
                st = p.client.peer_store_frames(&frames).await.map_err(|e| self.failure(peer, ns, e))?;
            }
            Ok(st.iter().filter(|s| s.is_held()).count())
        })
    }

    fn session_get<'a>(&'a self, peer: &'a Member, ns: &'a Namespace, id: &'a str) -> PeerFuture<'a, ReplicaCopy> {
        Box::pin(async move {
            let r = self.replica_call(peer, ns, id, Op::Get, None, None).await?;
            let now = Instant::now();
            let dropped_ago = r.dropped.then(|| Duration::from_millis(r.dropped_ago_ms));
            let expired_ago = r.expired.then(|| Duration::from_millis(r.expired_ago_ms));
            let copy = match (r.held, r.manifest) {
                (true, Some(m)) => {
                    Some(replicas::manifest_from_pb(ns.id(), &m, r.ttl_ms, now).map_err(|e| Self::err(peer, e))?)
                }
                _ => None,
            };
            Ok(ReplicaCopy { copy, dropped_ago, expired_ago, answered: now })
        })
    }

    fn session_put<'a>(
        &'a self,
        peer: &'a Member,
        ns: &'a Namespace,
        m: &'a SessionManifest,
    ) -> PeerFuture<'a, ReplicaPut> {
        Box::pin(async move {
            let r = self
                .replica_call(peer, ns, &m.id, Op::Put, Some(replicas::manifest_to_pb(m, Instant::now())), None)
                .await?;
            if r.dropped && !r.held {
                return Ok(ReplicaPut::Dropped);
            }
            if !r.missing_blocks.is_empty() || r.missing_tail {
                return Ok(ReplicaPut::Missing { blocks: r.missing_blocks, tail: r.missing_tail });
            }
            let theirs = match r.manifest {
                Some(held) if r.held => replicas::manifest_from_pb(ns.id(), &held, r.ttl_ms, Instant::now())
                    .map_err(|e| Self::err(peer, e))?,
                _ => return Err(Self::err(peer, "the session copy was not kept")),
            };
            if theirs.version == m.version && !theirs.same_context(m) {
                return Ok(ReplicaPut::Conflict(theirs.version));
            }
            Ok(ReplicaPut::Held(theirs.version))
        })
    }

    fn session_drop<'a>(
        &'a self,
        peer: &'a Member,
        ns: &'a Namespace,
        id: &'a str,
        version: u64,
        dropped_at: Option<Instant>,
    ) -> PeerFuture<'a, bool> {
        Box::pin(async move {
            let upto = pb::SessionManifest {
                info: Some(pb::SessionInfo { version, ..Default::default() }),
                ..Default::default()
            };
            let r = self.replica_call(peer, ns, id, Op::Drop, Some((upto, 0)), dropped_at).await?;
            Ok(r.removed)
        })
    }
}

impl ClientTransport {
    /// One `SessionReplica` call to `peer` (with the manifest of a PUT, or the version up to
    /// which a DROP removes the copy).
    async fn replica_call(
        &self,
        peer: &Member,
        ns: &Namespace,
        id: &str,
        op: Op,
        manifest: Option<(pb::SessionManifest, u64)>,
        dropped_at: Option<Instant>,
    ) -> Result<pb::SessionReplicaResponse, ServerError> {
        let (p, _) = self.handle(peer, ns).await?;
        let (manifest, ttl_ms) = manifest.unzip();
        let req = pb::SessionReplicaRequest {
            namespace_id: bytes::Bytes::copy_from_slice(&ns.id().0),
            session_id: id.to_string(),
            op: op as i32,
            manifest,
            ttl_ms: ttl_ms.unwrap_or(0),
            dropped: dropped_at.is_some(),
            dropped_ago_ms: dropped_at.map_or(0, |at| at.elapsed().as_millis() as u64),
        };
        p.client.session_replica(req).await.map_err(|e| self.failure(peer, ns, e))
    }
}
