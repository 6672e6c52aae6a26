//! What one node holds while it runs: configuration, the DRAM tier, registered namespaces and
//! the session table. The control plane and the data plane share it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use dashmap::DashMap;
use kvtier_proto::{Namespace, NamespaceId};
use parking_lot::{Mutex, RwLock};

use crate::config::ServerConfig;
use crate::disk::{DiskConfig, DiskTier, RecoveryReport};
use crate::dram::{DramConfig, DramTier, IndexKey, StoredBlock};
use crate::error::ServerError;
use crate::session_log::{unix_ms, LoggedSession, SessionLog};
use crate::sessions::{PinTier, SessionLimits, SessionManifest, SessionTable};

/// Blocks waiting to be demoted from DRAM to disk; writers wait when it is full.
pub const DEMOTION_QUEUE: usize = 64;

/// Most namespaces one node accepts (each costs a map entry; tenants don't need thousands).
pub const MAX_NAMESPACES: usize = 4096;

/// The demotion queue's depth: counted by the eviction hook and the demotion thread, published
/// as `kvtier_disk_queue_depth`, and waited on by writers while the queue is full (woken when a
/// block leaves it, not by polling).
#[derive(Default)]
pub struct DemotionDepth {
    depth: AtomicUsize,
    room: tokio::sync::Notify,
    /// Keeps the hook and the writer from publishing out of order (which could leave the gauge
    /// showing a block that is gone).
    publish: Mutex<()>,
}

impl DemotionDepth {
    pub fn get(&self) -> usize {
        self.depth.load(Ordering::Relaxed)
    }

    /// One block in (`up`) or out; publishes the gauge and wakes writers waiting for room.
    pub fn step(&self, up: bool) {
        let _order = self.publish.lock();
        let d = if up {
            self.depth.fetch_add(1, Ordering::Relaxed).saturating_add(1)
        } else {
            self.depth.fetch_sub(1, Ordering::Relaxed).saturating_sub(1)
        };
        ::metrics::gauge!("kvtier_disk_queue_depth").set(d as f64);
        if !up {
            self.room.notify_waiters();
        }
    }

    /// Waits until the queue has room or `deadline` passes.
    pub async fn wait_for_room(&self, deadline: tokio::time::Instant) {
        loop {
            let woken = self.room.notified();
            tokio::pin!(woken);
            // Registered before the check, so a block leaving in between still wakes us.
            woken.as_mut().enable();
            if self.get() < DEMOTION_QUEUE {
                return;
            }
            if tokio::time::timeout_at(deadline, woken).await.is_err() {
                return;
            }
        }
    }
}

pub struct NodeState {
    pub config: ServerConfig,
    pub tier: DramTier,
    pub sessions: Mutex<SessionTable>,
    namespaces: RwLock<HashMap<NamespaceId, Namespace>>,
    pub started: Instant,
    pub data_addr: SocketAddr,
    /// G3, when `disk_capacity` is set.
    pub disk: Option<Arc<DiskTier>>,
    pub disk_recovery: Option<RecoveryReport>,
    pub session_log: Option<Mutex<SessionLog>>,
    /// Blocks in the demotion queue (for backpressure and the queue-depth gauge).
    pub demotion_depth: Arc<DemotionDepth>,
    /// Blocks evicted from DRAM and not yet on disk (at most the demotion queue's length): reads,
    /// lookups and parks find them here, so a block in transit is never a miss.
    pub in_transit: Arc<DashMap<IndexKey, StoredBlock>>,
    /// Disk hits per block since its last promotion check: a second hit promotes to DRAM.
    pub disk_hits: Mutex<HashMap<IndexKey, u8>>,
    /// With a disk tier: every registered namespace, so sessions restored after a restart know
    /// their layout before any client registers again.
    namespace_log: Option<Mutex<std::fs::File>>,
    _dir_lock: std::fs::File,
}

/// Reads `namespaces.log`: records of (length, xxh3, protobuf `NamespaceSpec`). A torn last record
/// is ignored (its registration was never acknowledged).
fn read_namespace_log(path: &std::path::Path) -> Vec<Namespace> {
    use prost::Message;
    let Ok(data) = std::fs::read(path) else { return Vec::new() };
    let mut out = Vec::new();
    let mut rest = &data[..];
    while rest.len() >= 12 {
        let len = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        let mut sum = [0u8; 8];
        sum.copy_from_slice(&rest[4..12]);
        let Some(body) = rest.get(12..12 + len) else { break };
        if xxhash_rust::xxh3::xxh3_64(body) != u64::from_le_bytes(sum) {
            break;
        }
        if let Some(ns) = kvtier_proto::pb::NamespaceSpec::decode(body).ok().and_then(|pb| Namespace::from_pb(&pb).ok())
        {
            out.push(ns);
        }
        rest = &rest[12 + len..];
    }
    out
}

/// Holds `<data_dir>/LOCK` so a second server on the same directory is refused.
fn lock_data_dir(dir: &std::path::Path) -> Result<std::fs::File, ServerError> {
    let path = dir.join("LOCK");
    let f =
        std::fs::OpenOptions::new().create(true).truncate(false).read(true).write(true).open(&path).map_err(|e| {
            ServerError::Config(format!("data_dir {}: cannot open {}: {e}", dir.display(), path.display()))
        })?;
    match f.try_lock() {
        Ok(()) => {
            let _ = f.set_len(0);
            let _ = std::io::Write::write_all(&mut &f, format!("pid {}", std::process::id()).as_bytes());
            Ok(f)
        }
        Err(std::fs::TryLockError::WouldBlock) => {
            let holder = std::fs::read_to_string(&path).unwrap_or_default();
            Err(ServerError::Config(format!(
                "data_dir {} is in use by another kvtier server ({})",
                dir.display(),
                holder.trim()
            )))
        }
        Err(std::fs::TryLockError::Error(e)) => {
            Err(ServerError::Config(format!("data_dir {}: cannot lock: {e}", dir.display())))
        }
    }
}

impl NodeState {
    /// Locks the data directory, opens the disk tier and replays the session log (if enabled).
    pub fn open(config: ServerConfig, data_addr: SocketAddr) -> Result<Self, ServerError> {
        let dir_lock = lock_data_dir(&config.data_dir)?;
        let tier = DramTier::new(DramConfig {
            capacity_bytes: config.dram_capacity.0,
            max_pinned_ratio: config.max_pinned_ratio,
        });
        let mut state = NodeState {
            tier,
            sessions: Mutex::new(SessionTable::default()),
            namespaces: RwLock::new(HashMap::new()),
            started: Instant::now(),
            data_addr,
            disk: None,
            disk_recovery: None,
            session_log: None,
            demotion_depth: Arc::new(DemotionDepth::default()),
            in_transit: Arc::new(DashMap::new()),
            disk_hits: Mutex::new(HashMap::new()),
            namespace_log: None,
            _dir_lock: dir_lock,
            config,
        };
        if state.config.disk_capacity.0 > 0 {
            let (disk, report) = DiskTier::open(DiskConfig {
                dir: state.config.data_dir.clone(),
                capacity_bytes: state.config.disk_capacity.0,
                segment_bytes: state.config.disk_segment_bytes.0,
                sync_writes: false,
            })?;
            tracing::info!(?report, "disk tier recovered");
            let sync = state.config.session_durability == "fsync";
            let (log, sessions, unreadable) =
                SessionLog::open(&state.config.data_dir, sync, unix_ms(SystemTime::now()))?;
            if unreadable > 0 {
                tracing::warn!(
                    unreadable,
                    "session log had unreadable (torn) records; their parks were never acknowledged"
                );
            }
            let ns_path = state.config.data_dir.join("namespaces.log");
            for ns in read_namespace_log(&ns_path) {
                state.namespaces.write().insert(ns.id(), ns);
            }
            let f = std::fs::OpenOptions::new().create(true).append(true).open(&ns_path)?;
            state.namespace_log = Some(Mutex::new(f));
            state.disk = Some(Arc::new(disk));
            state.disk_recovery = Some(report);
            state.session_log = Some(Mutex::new(log));
            state.restore_sessions(sessions);
        }
        Ok(state)
    }

    /// Where sessions pin their blocks.
    pub fn pins(&self) -> &dyn PinTier {
        match &self.disk {
            Some(d) => d.as_ref(),
            None => &self.tier,
        }
    }

    fn restore_sessions(&self, sessions: Vec<LoggedSession>) {
        let now = Instant::now();
        let now_ms = unix_ms(SystemTime::now());
        let mut table = self.sessions.lock();
        let (mut ok, mut lost) = (0u64, 0u64);
        for s in sessions {
            let per_token = self.namespaces.read().get(&s.namespace).map(|n| n.layout.bytes_per_token()).unwrap_or(0);
            let m = SessionManifest {
                namespace: s.namespace,
                id: s.id.clone(),
                bytes: s.token_count * per_token,
                keys: s.keys,
                tail: s.tail,
                token_count: s.token_count,
                ttl: Duration::from_millis(s.ttl_ms),
                expires_at: now + Duration::from_millis(s.expires_unix_ms.saturating_sub(now_ms)),
                priority: s.priority,
                version: s.version,
            };
            match table.restore(self.pins(), m) {
                Ok(()) => ok += 1,
                Err(e) => {
                    lost += 1;
                    tracing::error!(session = %s.id, "parked session lost its blocks on disk: {e}");
                    if let Some(log) = &self.session_log {
                        let _ = log.lock().delete(s.namespace, &s.id);
                    }
                }
            }
        }
        ::metrics::counter!("kvtier_sessions_recovered_total").increment(ok);
        ::metrics::counter!("kvtier_sessions_lost_total").increment(lost);
        ::metrics::gauge!("kvtier_sessions").set(table.len() as f64);
        tracing::info!(recovered = ok, lost, "sessions restored from the session log");
    }

    /// Registers a namespace (idempotent) and returns its id.
    pub fn register_namespace(&self, ns: Namespace) -> Result<NamespaceId, ServerError> {
        ns.validate()?;
        if ns.layout.block_bytes() > self.config.max_frame_bytes.0 {
            return Err(ServerError::InvalidRequest(format!(
                "a block of this layout is {} bytes, above max_frame_bytes {}",
                ns.layout.block_bytes(),
                self.config.max_frame_bytes
            )));
        }
        let id = ns.id();
        let mut map = self.namespaces.write();
        if !map.contains_key(&id) {
            if map.len() >= MAX_NAMESPACES {
                return Err(ServerError::Capacity(format!("this node already holds {MAX_NAMESPACES} namespaces")));
            }
            if let Some(log) = &self.namespace_log {
                use prost::Message;
                let body = ns.to_pb().encode_to_vec();
                let mut rec = Vec::with_capacity(body.len() + 12);
                rec.extend_from_slice(&(body.len() as u32).to_le_bytes());
                rec.extend_from_slice(&xxhash_rust::xxh3::xxh3_64(&body).to_le_bytes());
                rec.extend_from_slice(&body);
                let mut f = log.lock();
                std::io::Write::write_all(&mut *f, &rec)?;
                f.sync_data()?;
            }
            map.insert(id, ns);
            metrics::gauge!("kvtier_namespaces").set(map.len() as f64);
        }
        Ok(id)
    }

    /// Whether a namespace is registered (without copying it: the data plane asks per request).
    pub fn knows_namespace(&self, id: &NamespaceId) -> bool {
        self.namespaces.read().contains_key(id)
    }

    pub fn namespace(&self, id: &NamespaceId) -> Result<Namespace, ServerError> {
        self.namespaces.read().get(id).cloned().ok_or(ServerError::UnknownNamespace(*id))
    }

    pub fn namespace_count(&self) -> usize {
        self.namespaces.read().len()
    }

    pub fn session_limits(&self, ns: &Namespace) -> SessionLimits {
        SessionLimits {
            block_tokens: ns.layout.block_tokens,
            bytes_per_token: ns.layout.bytes_per_token(),
            max_context_tokens: self.config.max_context_tokens,
        }
    }

    /// Refuses a chain of `blocks` blocks longer than the configured maximum context.
    pub fn check_context(&self, ns: &Namespace, blocks: usize) -> Result<(), ServerError> {
        let tokens = blocks as u64 * u64::from(ns.layout.block_tokens);
        if tokens > self.config.max_context_tokens {
            return Err(ServerError::ContextTooLong { tokens, max: self.config.max_context_tokens });
        }
        Ok(())
    }
}
