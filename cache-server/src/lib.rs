//! `kvtier-server`: the per-node kvtier service.
//!
//! - [`dram`]: the G2 DRAM tier — slab storage by size class, a concurrent index, S3-FIFO
//!   eviction with pins and priorities, a hard byte cap.
//! - [`sessions`]: parked agent sessions (manifests, TTLs, compare-and-set versions).
//! - [`control`]: the gRPC control plane (lookup, sessions, stats, admin).
//! - [`dataplane`]: the framed TCP data plane that moves block payloads.
//! - [`config`]: TOML + env + flags, validated at start.
//! - [`metrics`]: Prometheus `/metrics`.
//!
//! [`start`] binds every listener, spawns the node and returns the bound addresses; the `kvtier`
//! binary wraps it with a CLI.

pub mod config;
pub mod control;
pub mod dataplane;
pub mod disk;
pub mod dram;
pub mod error;
pub mod metrics;
pub mod session_log;
pub mod sessions;
pub mod state;
pub mod tiers;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_proto::{pb::kv_tier_server::KvTierServer, TierId};
use tokio::net::TcpListener;
use tokio::sync::watch;

pub use config::ServerConfig;
pub use error::ServerError;
pub use state::NodeState;

/// Largest gRPC message accepted (a 1M-token session manifest is ~2 MiB of keys).
const MAX_GRPC_MESSAGE: usize = 64 << 20;

/// A started node. [`RunningServer::stop`] ends every task it started.
pub struct RunningServer {
    pub grpc_addr: SocketAddr,
    pub data_addr: SocketAddr,
    pub metrics_addr: Option<SocketAddr>,
    pub state: Arc<NodeState>,
    /// Set to true once: every task of the node watches it.
    stop: watch::Sender<bool>,
    grpc: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    demotion: Option<std::thread::JoinHandle<()>>,
}

/// Resolves once `stop` turns true (or its sender is gone).
pub(crate) async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

impl RunningServer {
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
        let _ = self.stop.send(true);
        if tokio::time::timeout(grace, &mut self.grpc).await.is_err() {
            self.grpc.abort();
            let _ = (&mut self.grpc).await;
        }
        for t in self.tasks.drain(..) {
            let _ = t.await;
        }
        // Dropping the eviction hook closes the demotion queue: the thread writes what is queued
        // and ends.
        self.state.tier.set_eviction_hook(None);
        if let Some(thread) = self.demotion.take() {
            tokio::task::spawn_blocking(move || thread.join())
                .await
                .map_err(|e| ServerError::Config(format!("demotion thread: {e}")))?
                .map_err(|_| ServerError::Config("the demotion thread panicked".into()))?;
        }
        if let Some(disk) = &self.state.disk {
            disk.sync()?;
        }
        Ok(())
    }
}

/// Wires DRAM evictions to the disk tier: the eviction hook hands blocks to a bounded queue
/// (dropping, and counting, what doesn't fit — data-plane writers wait while it is full, so that
/// is rare) and one thread writes them out ([`write_demoted`]). A queued block stays findable in
/// `NodeState::in_transit` until it is on disk.
fn start_demotion(state: &Arc<NodeState>, disk: Arc<disk::DiskTier>) -> Option<std::thread::JoinHandle<()>> {
    let codec = state.config.disk_codec_id();
    let (tx, rx) = std::sync::mpsc::sync_channel::<dram::StoredBlock>(state::DEMOTION_QUEUE);
    let depth = state.demotion_depth.clone();
    let hook_depth = depth.clone();
    let probe = disk.clone();
    let (hook_transit, transit) = (state.in_transit.clone(), state.in_transit.clone());
    // Runs under the DRAM tier's lock (one call at a time), so the block is findable here before
    // DRAM forgets it.
    let hook: dram::EvictionHook = Arc::new(move |_key, block| {
        let key = (block.header.namespace, block.header.key);
        // On disk already (a parked session's block), or an earlier copy of the same key is
        // queued: nothing more to write.
        if probe.contains(&key.0, &key.1) || hook_transit.contains_key(&key) {
            return;
        }
        // Counted (and findable) before the send, so the writer's removal can never run first.
        hook_depth.step(true);
        hook_transit.insert(key, block.clone());
        if tx.try_send(block).is_err() {
            hook_transit.remove(&key);
            hook_depth.step(false);
            ::metrics::counter!("kvtier_disk_demotions_dropped_total").increment(1)
        }
    });
    state.tier.set_eviction_hook(Some(hook));
    std::thread::Builder::new()
        .name("kvtier-demote".into())
        .spawn(move || {
            // A full or failing disk fails every write: say so once per 10 s, count them all.
            let mut last_warning: Option<Instant> = None;
            let mut failed_since_warning = 0u64;
            for block in rx {
                let key = (block.header.namespace, block.header.key);
                let mine = |queued: &dram::StoredBlock| queued.payload.as_ptr() == block.payload.as_ptr();
                if !transit.get(&key).is_some_and(|q| mine(&q)) {
                    // Purged while queued: not written.
                    depth.step(false);
                    continue;
                }
                // Re-encoding costs CPU; when the queue backs up, blocks go out as they came
                // rather than be dropped for want of room.
                let busy = depth.get() > state::DEMOTION_QUEUE / 2;
                match write_demoted(&disk, codec, busy, &block) {
                    Ok(()) => ::metrics::counter!("kvtier_disk_demotions_total").increment(1),
                    Err(e) => {
                        ::metrics::counter!("kvtier_disk_demotions_failed_total").increment(1);
                        failed_since_warning += 1;
                        if last_warning.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                            tracing::warn!(
                                "demotion to disk failed ({failed_since_warning} since the last warning): {e}"
                            );
                            last_warning = Some(Instant::now());
                            failed_since_warning = 0;
                        }
                    }
                }
                // On disk now (or lost with the write); only this copy's entry goes. If a purge
                // took the entry while the write ran, the written copy goes too.
                if transit.remove_if(&key, |_, queued| mine(queued)).is_none() {
                    disk.remove(&key.0, &key.1);
                }
                depth.step(false);
            }
        })
        .map_err(|e| tracing::error!("cannot start the demotion thread: {e}"))
        .ok()
}

/// Writes one block evicted from DRAM to disk. It is verified first: a block damaged in memory is
/// dropped (and counted), never given a fresh checksum by re-encoding. A lossless block is
/// re-encoded with the disk codec when one is set and the queue is not `busy`.
fn write_demoted(
    disk: &disk::DiskTier,
    codec: Option<kvtier_proto::CodecId>,
    busy: bool,
    block: &dram::StoredBlock,
) -> Result<(), ServerError> {
    use disk::recode::{recode, Recoded};
    let h = &block.header;
    if h.verify_payload(&block.payload).is_err() {
        ::metrics::counter!("kvtier_disk_demotions_corrupt_total").increment(1);
        tracing::error!(key = %h.key, "a block evicted from DRAM failed its checksum; not demoted");
        return Ok(());
    }
    if disk.contains(&h.namespace, &h.key) {
        return Ok(());
    }
    let eligible = codec.filter(|c| kvtier_kernels::is_lossless(h.codec) && h.codec != *c);
    if eligible.is_some() && busy {
        ::metrics::counter!("kvtier_disk_recode_skipped_busy_total").increment(1);
    }
    let recoded = eligible.filter(|_| !busy).map(|c| {
        // A codec bug must not stop the demotion thread (every writer would then wait on it).
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| recode(c, h, &block.payload)))
            .unwrap_or_else(|_| Recoded::Refused("the codec panicked".into()))
    });
    match recoded {
        Some(Recoded::Encoded(nh, p)) => {
            disk.write(&nh, &p)?;
            ::metrics::counter!("kvtier_disk_recoded_total").increment(1);
            ::metrics::counter!("kvtier_disk_recode_saved_bytes_total")
                .increment(h.payload_len.saturating_sub(nh.payload_len));
            Ok(())
        }
        Some(Recoded::Refused(why)) => {
            ::metrics::counter!("kvtier_disk_recode_refused_total").increment(1);
            tracing::debug!(key = %h.key, "disk codec refused a block, written as it came: {why}");
            disk.write(h, &block.payload)
        }
        Some(Recoded::Kept) | None => disk.write(h, &block.payload),
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
    let (grpc_listener, grpc_addr) = bind("listen", config.listen).await?;
    let (data_listener, data_addr) = bind("data_listen", config.data_listen).await?;
    let (stop, stop_rx) = watch::channel(false);
    let mut tasks = Vec::new();
    let mut metrics_addr = None;
    if let (Some(addr), Some(handle)) = (config.metrics_listen, metrics) {
        let (l, a) = crate::metrics::bind(addr).await?;
        metrics_addr = Some(a);
        let mut s = stop_rx.clone();
        tasks.push(tokio::spawn(async move {
            tokio::select! {
                _ = stopped(&mut s) => {}
                _ = crate::metrics::serve(l, handle) => {}
            }
        }));
    }
    let auth = config.auth_token.clone();
    let state = Arc::new(NodeState::open(config, data_addr)?);
    let demotion = match state.disk.clone() {
        Some(disk) => start_demotion(&state, disk),
        None => None,
    };
    ::metrics::gauge!("kvtier_tier_capacity_bytes", "tier" => TierId::Dram.as_str())
        .set(state.config.dram_capacity.0 as f64);

    tasks.push(tokio::spawn(dataplane::serve(data_listener, state.clone(), stop_rx.clone())));

    // TTL sweeper: expired sessions release their pins within a second.
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
            let mut table = state.sessions.lock();
            let dead = table.expire(state.pins(), Instant::now());
            if !dead.is_empty() {
                ::metrics::counter!("kvtier_sessions_expired_total").increment(dead.len() as u64);
                ::metrics::gauge!("kvtier_sessions").set(table.len() as f64);
                if let Some(log) = &state.session_log {
                    let mut log = log.lock();
                    for (ns, id) in dead {
                        let _ = log.delete(ns, &id);
                    }
                }
            }
        }
    }));

    let service = KvTierServer::new(control::ControlPlane::new(state.clone()))
        .max_decoding_message_size(MAX_GRPC_MESSAGE)
        .max_encoding_message_size(MAX_GRPC_MESSAGE);
    let check_auth = move |req: tonic::Request<()>| -> Result<tonic::Request<()>, tonic::Status> {
        let Some(token) = &auth else { return Ok(req) };
        let presented = req.metadata().get("authorization").and_then(|v| v.to_str().ok());
        match presented.and_then(|v| v.strip_prefix("Bearer ")) {
            Some(t) if t == token => Ok(req),
            _ => {
                crate::metrics::error("unauthenticated");
                Err(tonic::Status::unauthenticated(format!(
                    "{}: missing or bad bearer token",
                    kvtier_proto::codes::UNAUTHENTICATED
                )))
            }
        }
    };
    let mut grpc_stop = stop_rx;
    // tonic does not apply its own `tcp_nodelay` to sockets given through `serve_with_incoming`:
    // without this, small answers (a lookup, a resume manifest) wait ~40 ms for Nagle + delayed ACK.
    let incoming = tokio_stream::StreamExt::map(tokio_stream::wrappers::TcpListenerStream::new(grpc_listener), |s| {
        s.inspect(|sock| {
            let _ = sock.set_nodelay(true);
        })
    });
    let grpc = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(tonic::service::interceptor::InterceptedService::new(service, check_auth))
            .serve_with_incoming_shutdown(incoming, async move { stopped(&mut grpc_stop).await }),
    );
    Ok(RunningServer { grpc_addr, data_addr, metrics_addr, state, stop, grpc, tasks, demotion })
}
