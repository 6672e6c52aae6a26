//! `kvtier-server`: the per-node kvtier service.
//!
//! - [`tiers`]: the tier seam — the `Tier` trait and the `TierStack` the planes use, demotion to
//!   disk, the disk I/O pool, and an existing Redis deployment as a shared tier.
//! - [`dram`]: the G2 DRAM tier — slab storage by size class, a concurrent index, S3-FIFO
//!   eviction with pins and priorities, a hard byte cap.
//! - [`disk`]: the G3 disk tier — append-only segment files, recovery by scan, pins.
//! - [`fs`]: the file layer under the segments and the logs (`std::fs`, or a fault-injecting
//!   one for power-loss tests).
//! - [`sessions`]: parked agent sessions (manifests, TTLs, compare-and-set versions);
//!   [`session_store`] keeps them with their [`session_log`] written outside the table's lock.
//! - [`control`]: the gRPC control plane (lookup, sessions, stats, admin).
//! - [`dataplane`]: the framed TCP data plane that moves block payloads ([`gather`]: a served
//!   block's header and payload leave in one vectored write).
//! - [`fabric`]: one-sided access to the DRAM arena — the `Fabric` seam an RDMA NIC plugs in
//!   through, and the remote leases (`LEASE_PUT` / `COMMIT` / `LEASE_GET` / `END_GET`) a
//!   data-plane connection grants on it.
//! - [`samenode`]: the same-node path: client buffers registered over a Unix socket, blocks
//!   copied into and out of them by offset.
//! - [`tenants`]: credentials, tenants, grants and quotas — who may touch which namespace.
//! - [`listen`]: the accept loop every listener shares (connection limits in total and per peer).
//! - [`tls`]: TLS on the gRPC and data-plane listeners; client certificates as credentials.
//! - [`cluster`]: many nodes — rendezvous placement with replicas and topology, membership
//!   (embedded, or in Redis), the G4 peer tier (loads from and stores to a block's owners).
//! - [`config`]: TOML + env + flags, validated at start; [`affinity`]: the CPUs the node runs on.
//! - [`metrics`]: Prometheus `/metrics`; [`grpc_metrics`]: every gRPC call counted by method and status.
//!
//! [`start`] binds every listener, spawns the node and returns the bound addresses; the `kvtier`
//! binary wraps it with a CLI.

pub mod affinity;
pub mod cluster;
pub mod config;
pub mod control;
#[cfg(test)]
mod crash_tests;
pub mod dataplane;
pub mod deadline;
pub mod disk;
pub mod dram;
pub mod error;
pub mod events;
pub mod fabric;
pub mod fs;
pub mod gather;
pub mod grpc_budget;
pub mod grpc_calls;
pub mod grpc_metrics;
pub mod listen;
pub mod metric_catalog;
pub mod metrics;
pub mod quic;
pub mod remembered;
pub mod samenode;
pub mod session_log;
pub mod session_store;
pub mod sessions;
pub mod state;
pub mod tenants;
#[cfg(test)]
mod test_redis;
pub mod tickets;
pub mod tiers;
pub mod tls;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvtier_proto::{pb::kv_tier_server::KvTierServer, TierId};
use tokio::net::TcpListener;
use tokio::sync::watch;

pub use config::ServerConfig;
pub use error::ServerError;
pub use state::NodeState;

/// Largest gRPC message accepted (a 1M-token session manifest is ~2 MiB of keys).
const MAX_GRPC_MESSAGE: usize = 64 << 20;

/// A gRPC call's credential as the body budget's layer resolved it, left in the call's extensions
/// for the credential check.
#[derive(Clone)]
struct ResolvedCredential(Result<tenants::Principal, tenants::Refused>);

/// A started node. [`RunningServer::stop`] ends every task it started.
pub struct RunningServer {
    pub grpc_addr: SocketAddr,
    pub data_addr: SocketAddr,
    pub metrics_addr: Option<SocketAddr>,
    /// The same-node socket (`crate::samenode`), when the node has one; removed by `stop`.
    pub samenode_path: Option<std::path::PathBuf>,
    pub state: Arc<NodeState>,
    /// The cluster's members as this node sees them (just itself without `cluster`).
    pub membership: Arc<dyn cluster::Membership>,
    /// Set to true once: every task of the node watches it.
    stop: watch::Sender<bool>,
    grpc: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// Resolves once `stop` turns true (or its sender is gone).
pub(crate) async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// The address peers and clients dial for a listener bound at `bound`: `advertise_host` with its
/// port; else the bound address, unless it is unspecified (`0.0.0.0`, `::`), then the machine's
/// `hostname` with its port.
fn advertised(advertise_host: Option<&str>, hostname: &str, bound: SocketAddr) -> String {
    let port = bound.port();
    let host = match advertise_host {
        Some(h) => h.to_string(),
        None if !bound.ip().is_unspecified() => return bound.to_string(),
        None if !hostname.is_empty() => hostname.to_string(),
        None => return bound.to_string(),
    };
    // An IPv6 literal needs brackets before its port.
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// This node as a cluster member, registered in the configured store (or alone).
async fn join_cluster(
    state: &NodeState,
    grpc_addr: SocketAddr,
    data_addr: SocketAddr,
) -> Result<Arc<dyn cluster::Membership>, ServerError> {
    let c = state.config();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_default();
    let id = match &c.node_id {
        Some(id) => id.clone(),
        None => format!("{}:{}", if host.is_empty() { "kvtier" } else { &host }, grpc_addr.port()),
    };
    let local = cluster::Member {
        id: cluster::NodeId::new(id)?,
        grpc_addr: advertised(c.advertise_host.as_deref(), &host, grpc_addr),
        data_addr: advertised(c.advertise_host.as_deref(), &host, data_addr),
        labels: cluster::Labels::new(Some(&host), c.rack.as_deref(), c.zone.as_deref()),
        capacity: c.dram_capacity.0 + c.disk_capacity.0,
        since_ms: 0,
    };
    let Some(url) = &c.cluster else { return Ok(Arc::new(cluster::Embedded::new(local)?)) };
    let cfg = cluster::RedisMembershipConfig::new(url.clone(), local)
        .with_ttl(c.cluster_ttl.0)
        .with_shared_settings(&shared_settings(c));
    let m = cluster::RedisMembership::start(cfg).await?;
    use cluster::Membership as _;
    tracing::info!(members = m.snapshot().members.len(), "joined the cluster");
    Ok(Arc::new(m))
}

/// What every node of a cluster must share, as each publishes it (no secrets): `cluster_rf`,
/// whether `auth_token` is set, and a digest of the `[[tenants]]` (names, grants, quotas and
/// certificate names; not their tokens).
fn shared_settings(c: &config::ServerConfig) -> Vec<(&'static str, String)> {
    let mut tenants: Vec<String> = c
        .tenants
        .iter()
        .map(|t| {
            let mut grants = (t.read.clone(), t.write.clone(), t.cert_names.clone());
            grants.0.sort();
            grants.1.sort();
            grants.2.sort();
            format!(
                "{}|{:?}|{:?}|{:?}|{:?}|{:?}|{:?}",
                t.name,
                grants,
                t.max_namespaces,
                t.max_sessions,
                t.max_session_bytes.map(|b| b.0),
                t.dram_bytes.map(|b| b.0),
                t.disk_bytes.map(|b| b.0),
            )
        })
        .collect();
    tenants.sort();
    let digest = if tenants.is_empty() {
        "none".to_string()
    } else {
        blake3::hash(tenants.join("\n").as_bytes()).to_hex()[..12].to_string()
    };
    vec![
        ("cluster_rf", c.cluster_rf.to_string()),
        ("auth", if c.auth_token.is_some() { "on" } else { "off" }.to_string()),
        ("tenants", digest),
    ]
}

impl RunningServer {
    /// Puts the G4 peer tier under this node's own tiers (see [`cluster::peer`]), reaching the
    /// other members through `transport`; does nothing for a node without `cluster`. The
    /// `kvtier` binary calls it right after [`start`] with a transport over `kvtier-client`.
    pub fn attach_peers(&mut self, transport: Arc<dyn cluster::PeerTransport>) {
        let c = self.state.config();
        if c.cluster.is_none() {
            return;
        }
        if c.auth_token.is_none() && !c.tenants.is_empty() {
            tracing::warn!(
                "tenants without auth_token: this node can't authenticate to its peers (they must share auth_token)"
            );
        }
        let cfg = cluster::PeerConfig {
            rf: c.cluster_rf,
            timeout: c.peer_timeout.0,
            max_inflight: c.peer_max_inflight,
            // Checked by `ServerConfig::validate` before the node started.
            hedge: c.peer_hedge().unwrap_or(cluster::Hedge::Auto),
        };
        let local = self.membership.local();
        let (tier, task) = cluster::PeerTier::start(
            local.id.clone(),
            local.labels.clone(),
            self.membership.watch(),
            transport,
            cfg,
            self.stop.subscribe(),
        );
        // Deletes this node owed members that were away when it stopped: asked again.
        match cluster::deletes::OwedLog::open(&c.data_dir, crate::fs::StdFs::shared()) {
            Ok((log, owed)) => cluster::deletes::restore(&tier, log, owed),
            Err(e) => tracing::error!(
                "{}: {e}; deletes owed to members that are away are kept in memory only",
                cluster::deletes::OwedLog::FILE
            ),
        }
        self.state.tiers().attach_peers(tier, c.peer_cache);
        self.tasks.push(task);
        // With `cluster_rf` >= 2: parked sessions' missing copies re-made after membership changes.
        self.tasks.push(tokio::spawn(cluster::replicas::repair_loop(self.state.clone(), self.stop.subscribe())));
        // After a membership change, the blocks this node holds handed to their new owners.
        if let (Ok(Some(quiet)), Ok(departed)) = (c.peer_rebalance(), c.peer_rebalance_departed()) {
            let schedule = cluster::rebalance::Schedule { quiet, departed, backups: &cluster::rebalance::BACKUP_AFTER };
            self.tasks.push(tokio::spawn(cluster::rebalance::rebalance_loop(
                self.state.clone(),
                schedule,
                self.stop.subscribe(),
            )));
        }
        // Blocks forwards could not give an owner that was down: handed to it when it answers.
        self.tasks.push(tokio::spawn(cluster::handoff::handoff_loop(self.state.clone(), self.stop.subscribe())));
    }

    /// Runs until the gRPC server stops.
    pub async fn wait(&mut self) -> Result<(), ServerError> {
        match (&mut self.grpc).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(ServerError::Config(format!("gRPC server: {e}"))),
            Err(e) => Err(ServerError::Config(format!("gRPC task: {e}"))),
        }
    }

    /// Stops the node: the gRPC server (in-flight calls get `grace` to finish), the data plane
    /// and its connections (their pin leases released), the session sweeper, and demotion (the
    /// queue written out to disk first); then syncs the disk tier. When it returns no task of this
    /// node runs, and once the caller drops its clones of `state` the data directory's `LOCK` is
    /// released, so a node can start again on it in the same process.
    pub async fn stop(mut self, grace: Duration) -> Result<(), ServerError> {
        // Peers stop counting on this node at once (bounded: else its TTL runs out).
        if let Ok(Err(e)) = tokio::time::timeout(Duration::from_secs(2), self.membership.leave()).await {
            tracing::warn!("leaving the cluster: {e}");
        }
        let _ = self.stop.send(true);
        if tokio::time::timeout(grace, &mut self.grpc).await.is_err() {
            self.grpc.abort();
            let _ = (&mut self.grpc).await;
        }
        for t in self.tasks.drain(..) {
            let _ = t.await;
        }
        // Without a disk tier nothing of a parked session outlives the process: said, once.
        let held = self.state.sessions().len();
        if held > 0 && self.state.tiers().disk().is_none() {
            tracing::warn!(
                sessions = held,
                "stopping with {held} parked session(s) held in DRAM only (no disk tier): they go with this \
                 process, except where another node of a cluster holds a copy"
            );
        }
        // The demotion queue written out to disk, and the disk synced.
        let state = self.state.clone();
        tokio::task::spawn_blocking(move || state.tiers().stop_demotion())
            .await
            .map_err(|e| ServerError::Config(format!("stopping demotion: {e}")))??;
        Ok(())
    }
}

async fn bind(name: &str, addr: SocketAddr) -> Result<(TcpListener, SocketAddr), ServerError> {
    let l =
        TcpListener::bind(addr).await.map_err(|e| ServerError::Config(format!("{name} {addr}: cannot listen: {e}")))?;
    let a = l.local_addr()?;
    Ok((l, a))
}

/// Validates `config`, binds every listener and starts the node. `metrics` is the Prometheus
/// handle to serve (the recorder is process-global, so the binary installs it once).
pub async fn start(
    mut config: ServerConfig,
    metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
) -> Result<RunningServer, ServerError> {
    config.validate()?;
    config.normalize();
    config.prepare_data_dir()?;
    // Certificates and keys are read once, before anything is bound or opened.
    let tls = match &config.tls {
        Some(t) => Some(tls::TlsAcceptors::load(t)?),
        None => None,
    };
    let (grpc_listener, grpc_addr) = bind("listen", config.listen).await?;
    let (data_listener, data_addr) = bind("data_listen", config.data_listen).await?;
    // QUIC between nodes: UDP on the data plane's own address and port.
    let quic = match (config.peer_transport.as_str(), tls.as_ref().and_then(|t| t.quic.clone())) {
        ("quic", Some(q)) => Some(quic::bind(data_addr, q)?),
        _ => None,
    };
    let samenode_path = match config.samenode_path() {
        Some(path) => Some(path),
        None if config.samenode_socket == "auto" => {
            tracing::warn!(
                "the same-node socket is off: {} is too long for a socket path; set samenode_socket",
                config.data_dir.join("kvtier.sock").display()
            );
            None
        }
        None if config.samenode_socket == "off" => None,
        None => {
            return Err(ServerError::Config(format!(
                "samenode_socket {}: too long for a socket path",
                config.samenode_socket
            )))
        }
    };
    // What `Info` advertises: the resolved path, or "off".
    config.samenode_socket = match &samenode_path {
        Some(p) => p.display().to_string(),
        None => "off".into(),
    };
    let (stop, stop_rx) = watch::channel(false);
    let mut tasks = Vec::new();
    let mut metrics_addr = None;
    if let (Some(addr), Some(handle)) = (config.metrics_listen, metrics) {
        let (l, a) = crate::metrics::bind(addr).await?;
        metrics_addr = Some(a);
        let mut s = stop_rx.clone();
        let metrics_token = config.metrics_token.clone();
        tasks.push(tokio::spawn(async move {
            tokio::select! {
                _ = stopped(&mut s) => {}
                _ = crate::metrics::serve(l, handle, metrics_token) => {}
            }
        }));
    }
    let fds = listen::raise_fd_limit();
    let wanted = 2 * config.max_connections as u64 + 256;
    if fds.is_some_and(|n| n < wanted) {
        tracing::warn!(limit = fds, wanted, "the open-descriptor limit is below what max_connections needs");
    }
    let state = Arc::new(NodeState::open(config, data_addr)?);
    // Bound only now that the data directory's lock is held: a stale socket there is ours to replace.
    let samenode = match &samenode_path {
        Some(p) => Some((samenode::bind(p)?, p.clone())),
        None => None,
    };
    state.tiers().start_demotion(state.config().disk_codec_id());
    if let Some(shared) = state.config().redis_tier.clone() {
        let (tier, task) = tiers::RedisTier::start(shared, stop_rx.clone())?;
        state.tiers().attach_redis(tier);
        tasks.push(task);
    }
    ::metrics::gauge!("kvtier_tier_capacity_bytes", "tier" => TierId::Dram.as_str())
        .set(state.config().dram_capacity.0 as f64);
    // The node joins (its id checked against live members) before any listener serves: a node
    // refused for another's id never took a request. Connections meanwhile wait in the backlog.
    let membership = join_cluster(&state, grpc_addr, data_addr).await?;
    // Each listener's open connections, present from the start (before its task first runs).
    let listeners = ["grpc", "data plane"].into_iter().chain(samenode.as_ref().map(|_| "same-node"));
    for what in listeners.chain(quic.as_ref().map(|_| "quic")) {
        ::metrics::gauge!("kvtier_connections_open", "listener" => what).increment(0.0);
    }

    tasks.push(tokio::spawn(dataplane::serve(
        data_listener,
        state.clone(),
        stop_rx.clone(),
        tls.as_ref().map(|t| t.data.clone()),
    )));
    if let Some(endpoint) = quic {
        tasks.push(tokio::spawn(quic::serve(endpoint, state.clone(), stop_rx.clone())));
    }
    if let Some((listener, path)) = samenode {
        tasks.push(tokio::spawn(samenode::serve(listener, path, state.clone(), stop_rx.clone())));
    }

    // Sweeper: expired sessions release their pins, and slots reserved past their lease timeout
    // are revoked, within a second.
    let sweeper = Arc::downgrade(&state);
    let mut sweeper_stop = stop_rx.clone();
    tasks.push(tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            tokio::select! {
                _ = stopped(&mut sweeper_stop) => return,
                _ = tick.tick() => {}
            }
            let Some(state) = sweeper.upgrade() else { return };
            let revoked = state.tiers().reap_leases();
            if revoked > 0 {
                tracing::warn!(revoked, "DRAM slots reserved past lease_timeout were revoked");
            }
            // Expiry appends tombstones to the session log: on the I/O pool.
            let job = state.clone();
            let _ = state.io().run(None, move || job.sessions().expire(job.tiers().session_pins())).await;
        }
    }));

    // Events: session events through the tier stack's bus, published every few milliseconds.
    let events = state.tiers().events().clone();
    events.set_limits(events::WatchLimits {
        max_watchers: state.config().events_max_watchers,
        max_per_tenant: state.config().events_max_watchers_per_tenant,
    });
    state.sessions().attach_events(events.clone());
    tasks.push(tokio::spawn(events::flusher(events.clone(), stop_rx.clone())));
    let membership_cell = Arc::new(std::sync::OnceLock::new());
    let service =
        KvTierServer::new(control::ControlPlane::with_node(state.clone(), membership_cell.clone(), stop_rx.clone()))
            .max_decoding_message_size(MAX_GRPC_MESSAGE)
            .max_encoding_message_size(MAX_GRPC_MESSAGE);
    // Every call is authenticated here; the handlers authorize it against the principal this
    // leaves in the request's extensions.
    let auth_state = state.clone();
    let max_per_tenant = state.config().max_connections_per_tenant;
    let check_auth = move |mut req: tonic::Request<()>| -> Result<tonic::Request<()>, tonic::Status> {
        // Resolved once, by the body budget's layer, which needed the tenant first.
        let resolved = match req.extensions_mut().remove::<ResolvedCredential>() {
            Some(ResolvedCredential(r)) => r,
            None => {
                let presented = req.metadata().get("authorization").and_then(|v| v.to_str().ok());
                let token = presented.and_then(|v| v.strip_prefix("Bearer ")).map(str::as_bytes);
                let absent = tenants::CertIdentity::Absent;
                let cert = req.extensions().get::<listen::GrpcPeer>().map_or(&absent, |p| &p.cert);
                auth_state.tenants().resolve(cert, token)
            }
        };
        match resolved {
            Ok(principal) => {
                // The connection made a call it may make: it keeps its listener slot, and takes
                // one of its tenant's with its first.
                if let Some(p) = req.extensions().get::<listen::GrpcPeer>() {
                    if let Err(why) = p.calls.admit(&principal, max_per_tenant) {
                        let mut status = tonic::Status::resource_exhausted(format!(
                            "{}: connection refused: {why}",
                            kvtier_proto::codes::TOO_MANY_CONNECTIONS
                        ));
                        if let Ok(v) = kvtier_proto::codes::TOO_MANY_CONNECTIONS.parse() {
                            status.metadata_mut().insert(kvtier_proto::codes::METADATA_KEY, v);
                        }
                        return Err(status);
                    }
                }
                req.extensions_mut().insert(principal);
                Ok(req)
            }
            Err(why) => {
                crate::metrics::error("unauthenticated");
                Err(tonic::Status::unauthenticated(format!("{}: {why}", kvtier_proto::codes::UNAUTHENTICATED)))
            }
        }
    };
    // Whose a request's body is, for its tenant's share of the body budget (the credential
    // check proper is `check_auth`'s).
    let who_state = state.clone();
    let who: grpc_budget::WhoAsks =
        Arc::new(move |headers: &tonic::codegen::http::HeaderMap, ext: &mut tonic::codegen::http::Extensions| {
            let token =
                headers.get("authorization").and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
            let absent = tenants::CertIdentity::Absent;
            let cert = ext.get::<listen::GrpcPeer>().map_or(&absent, |p| &p.cert);
            let resolved = who_state.tenants().resolve(cert, token.map(str::as_bytes));
            let tenant = match &resolved {
                Ok(tenants::Principal::Tenant(t)) => Some(t.name.clone()),
                _ => None,
            };
            // For the credential check: resolving again would count a bad token twice.
            ext.insert(ResolvedCredential(resolved));
            tenant
        });
    let (body_budget, body_share) = state.config().grpc_body_budget();
    let cert_state = state.clone();
    let (incoming, accepting) = listen::grpc_incoming(
        grpc_listener,
        state.config().conn_limits(),
        state.config().idle_timeout.0,
        stop_rx.clone(),
        tls.map(|t| t.grpc),
        move |names| cert_state.tenants().authenticate_cert(names),
    );
    tasks.push(accepting);
    let mut grpc_stop = stop_rx;
    let grpc = tokio::spawn(
        tonic::transport::Server::builder()
            // Peers that vanished without a FIN are found and their connections closed; no
            // connection lives forever (clients reconnect on the GOAWAY); requests are bounded.
            .http2_keepalive_interval(Some(Duration::from_secs(30)))
            .http2_keepalive_timeout(Some(Duration::from_secs(20)))
            .max_connection_age(Duration::from_secs(3600))
            .max_connection_age_grace(Duration::from_secs(30))
            .max_concurrent_streams(256)
            // Calls in flight counted per connection, so an idle one is closed.
            .layer(grpc_calls::GrpcCallsLayer)
            // Every call counted by method, failures by status (the credential check's too).
            .layer(grpc_metrics::GrpcMetricsLayer)
            // What requests still arriving may make the node hold, and for how long.
            .layer(
                grpc_budget::GrpcBodyBudgetLayer::new(
                    body_budget,
                    state.config().stall_timeout.0,
                    grpc_budget::BODY_DEADLINE,
                )
                .with_tenant_shares(body_share, who),
            )
            .add_service(tonic::service::interceptor::InterceptedService::new(service, check_auth))
            .serve_with_incoming_shutdown(incoming, async move { stopped(&mut grpc_stop).await }),
    );
    events.set_node(membership.local().id.as_str());
    let _ = membership_cell.set(membership.clone());
    Ok(RunningServer { grpc_addr, data_addr, metrics_addr, samenode_path, state, membership, stop, grpc, tasks })
}

#[cfg(test)]
mod advertised_tests {
    use super::advertised;

    #[test]
    fn the_advertised_address_keeps_the_port_and_names_a_dialable_host() {
        let bound = |s: &str| s.parse().unwrap();
        assert_eq!(advertised(None, "box", bound("10.0.0.5:7070")), "10.0.0.5:7070");
        assert_eq!(advertised(None, "box", bound("0.0.0.0:7070")), "box:7070");
        assert_eq!(advertised(None, "", bound("0.0.0.0:7070")), "0.0.0.0:7070");
        assert_eq!(advertised(Some("kv-3.internal"), "box", bound("0.0.0.0:7071")), "kv-3.internal:7071");
        assert_eq!(advertised(Some("fd00::5"), "box", bound("[::]:7071")), "[fd00::5]:7071");
    }
}
