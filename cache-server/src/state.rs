//! What one node holds while it runs: its configuration, the tier stack, registered namespaces
//! and parked sessions. The control plane and the data plane share it, and reach the tiers only
//! through [`NodeState::tiers`].

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use kvtier_proto::dataplane::ItemStatus;
use kvtier_proto::{FrameHeader, Namespace, NamespaceId, ProtoError, FRAME_FLAG_KEEP_LOSSLESS};
use parking_lot::{Mutex, RwLock};

use crate::config::ServerConfig;
use crate::disk::{DiskConfig, DiskTier, RecoveryReport};
use crate::dram::{DramConfig, DramOptions, DramTier, Priority, RegionMode};
use crate::error::ServerError;
use crate::fabric::{ArenaAccess, Fabric, LeaseCaps};
use crate::fs::{FileSystem, FsFile, OpenMode, StdFs};
use crate::session_log::{fresh_log_key, unix_ms, Replayed, SessionLog};
use crate::session_store::SessionStore;
use crate::sessions::{SessionLimits, SessionQuota};
use crate::tenants::{Access, Principal, Tenants};
use crate::tiers::demotion::queue_headroom;
use crate::tiers::{AgentTierConfig, IoPool, TierStack};
use kvtier_proto::record_log::namespaces::{read_namespace_log as read_namespace_records, NamespaceRecord};
use kvtier_proto::record_log::{encode_log_header, encode_record, read_log_header, LogHeader, LogKey, LogKind};

/// Most namespaces one node accepts (each costs a map entry; tenants don't need thousands).
pub const MAX_NAMESPACES: usize = 4096;

pub struct NodeState {
    config: ServerConfig,
    tenants: Tenants,
    /// The DRAM arena's registration with a one-sided fabric, when one was attached. Declared
    /// before `tiers`, so it is dropped (deregistered) before the arena is unmapped.
    arena_access: OnceLock<Arc<ArenaAccess>>,
    tiers: TierStack,
    sessions: SessionStore,
    namespaces: RwLock<HashMap<NamespaceId, Namespace>>,
    /// The tenant of each namespace in `namespaces` (whose remembered session ids make room
    /// first: [`crate::remembered::RememberedIds`]).
    owners: crate::remembered::NamespaceOwners,
    started: Instant,
    data_addr: SocketAddr,
    disk_recovery: Option<RecoveryReport>,
    /// Disk work of the control plane (parks, session log appends) runs here.
    io: IoPool,
    /// With a disk tier: every registered namespace, so sessions restored after a restart know
    /// their layout before any client registers again.
    namespace_log: Option<NamespaceLog>,
    /// Held while a namespace is created: its quota checks, its log record and its insertion are
    /// one step, so racing creations can't each pass a check only one of them fits.
    creating: Mutex<()>,
    _dir_lock: std::fs::File,
}

/// `namespaces.log`, open for appending: the lock serializes appends (syncs run outside it) and
/// a compaction, which swaps the file.
struct NamespaceLog {
    file: Mutex<Arc<dyn FsFile>>,
    /// The file's secret: what its records' tags are keyed with (kept by a compaction while the
    /// node runs: records are framed before they are appended).
    key: LogKey,
    fs: Arc<dyn FileSystem>,
    path: std::path::PathBuf,
    /// Compacted when the file passes twice this plus `slack` ([`NAMESPACE_LOG_SLACK`]).
    compacted_to: std::sync::atomic::AtomicU64,
    slack: u64,
    /// False while a compaction's rename is not known durable: the next append syncs the
    /// directory too.
    renamed_durably: std::sync::atomic::AtomicBool,
}

/// How far past twice its last compacted size `namespaces.log` grows before it is compacted
/// while the node runs (a namespace registered and unregistered over and over appends a record
/// each time: 500 cycles wrote 211 KB).
const NAMESPACE_LOG_SLACK: u64 = 1 << 20;

/// The label-less counters a node puts in at 0 once its state is open: its own and those of the
/// client it calls its peers with (the agent's are not the node's).
const NODE_COUNTERS: &[crate::metric_catalog::RecordedBy] =
    &[crate::metric_catalog::RecordedBy::Node, crate::metric_catalog::RecordedBy::Client];

/// One `namespaces.log` record, framed by `kvtier_proto::record_log` and keyed with the file's
/// secret: a namespace spec is a tenant's bytes, and no bytes in it can pass for a record.
/// The G1 tier's settings from the node's.
fn agent_tier(config: &ServerConfig) -> AgentTierConfig {
    AgentTierConfig { demand_wait: config.agent_demand_wait.0, max_keys_per_namespace: config.agent_index_max_keys }
}

fn namespace_record(key: &LogKey, record: &NamespaceRecord<'_>) -> Vec<u8> {
    encode_record(key, &record.encode())
}

/// What `namespaces.log` holds at its end.
#[derive(Debug, Default)]
pub(crate) struct NamespaceLogContents {
    /// The namespaces registered.
    pub live: HashMap<NamespaceId, Namespace>,
    /// Namespaces unregistered, with the disk tier's write position then (their blocks may still
    /// be in disk segments).
    pub unregistered: HashMap<NamespaceId, (u64, u64)>,
    /// Namespaces purged, with the disk tier's write position at the latest purge.
    pub purged: HashMap<NamespaceId, (u64, u64)>,
}

/// How `namespaces.log` was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NamespaceLogFormat {
    Missing,
    /// The first format: no header, an xxh3 checksum per record (rewritten at open).
    Legacy,
    Keyed,
}

/// Registrations and unregistrations, in file order, applied.
fn apply_namespace_records<'a>(records: impl IntoIterator<Item = NamespaceRecord<'a>>) -> NamespaceLogContents {
    use prost::Message;
    let mut c = NamespaceLogContents::default();
    for record in records {
        match record {
            NamespaceRecord::Unregister { id, mark: at } => {
                c.live.remove(&id);
                let mark = c.unregistered.entry(id).or_default();
                *mark = (*mark).max(at);
            }
            NamespaceRecord::Purge { id, mark: at } => {
                let mark = c.purged.entry(id).or_default();
                *mark = (*mark).max(at);
            }
            NamespaceRecord::Register(spec) => {
                if let Some(ns) =
                    kvtier_proto::pb::NamespaceSpec::decode(spec).ok().and_then(|pb| Namespace::from_pb(&pb).ok())
                {
                    c.live.insert(ns.id(), ns);
                }
            }
        }
    }
    c
}

/// Reads `namespaces.log`: registrations and unregistrations, in order, and the records skipped.
/// A torn or damaged record is skipped: replay goes on at the next whole one, so a refused or
/// torn append hides no later registration. A current-format file's records verify against its
/// secret (the key, returned); a first-format one is read once with its old checksums.
pub(crate) fn read_namespace_log(
    fs: &dyn FileSystem,
    path: &std::path::Path,
) -> Result<(NamespaceLogContents, NamespaceLogFormat, Option<LogKey>, u64), ServerError> {
    let Some(data) = fs.read_all(path)? else {
        return Ok((NamespaceLogContents::default(), NamespaceLogFormat::Missing, None, 0));
    };
    let what = |e: kvtier_proto::ProtoError| ServerError::Config(format!("{}: {e}", path.display()));
    let (contents, format, key, skipped) = match read_namespace_records(&data).map_err(what)? {
        Some((records, skipped)) => {
            let key = match read_log_header(LogKind::Namespaces, &data).map_err(what)? {
                LogHeader::Keyed(key) => Some(key),
                LogHeader::Legacy => None,
            };
            (apply_namespace_records(records), NamespaceLogFormat::Keyed, key, skipped)
        }
        None => {
            let (records, skipped) = legacy_namespace_records(&data);
            (apply_namespace_records(records), NamespaceLogFormat::Legacy, None, skipped)
        }
    };
    Ok((contents, format, key, skipped))
}

/// Marks a first-format `namespaces.log` record as an unregistration (in its length word).
const LEGACY_NS_TOMBSTONE: u32 = 1 << 31;

/// The records of a first-format `namespaces.log` (each a length word with the tombstone flag, the
/// xxh3 of the body, the body), as (kind, body), and the damaged stretches skipped.
fn legacy_namespace_records(data: &[u8]) -> (Vec<NamespaceRecord<'_>>, u64) {
    let mut out = Vec::new();
    let mut skipped = 0;
    let mut at = 0;
    while at < data.len() {
        let Some((word, body)) = legacy_namespace_record_at(data, at) else {
            skipped += 1;
            // Torn or damaged: the next whole, verified record (one bad record hides no other).
            match (at + 1..data.len()).find(|&i| legacy_namespace_record_at(data, i).is_some()) {
                Some(i) => {
                    at = i;
                    continue;
                }
                None => break,
            }
        };
        at += 12 + body.len();
        if word & LEGACY_NS_TOMBSTONE == 0 {
            out.push(NamespaceRecord::Register(body));
        } else if let Some(r) = body.get(..32).and_then(NamespaceRecord::unregistration) {
            out.push(r);
        }
    }
    (out, skipped)
}

/// The verified first-format `namespaces.log` record at `at`: (length word, body).
fn legacy_namespace_record_at(data: &[u8], at: usize) -> Option<(u32, &[u8])> {
    let head = data.get(at..at + 12)?;
    let word = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
    let mut sum = [0u8; 8];
    sum.copy_from_slice(&head[4..12]);
    let len = (word & !LEGACY_NS_TOMBSTONE) as usize;
    let body = data.get(at + 12..at + 12 + len)?;
    (xxhash_rust::xxh3::xxh3_64(body) == u64::from_le_bytes(sum)).then_some((word, body))
}

/// Forgets, at start, the unregistration and purge marks that can drop nothing more at recovery,
/// so a tenant registering and unregistering namespace after namespace doesn't grow the log for
/// good: one whose namespace has no record left in a segment the mark covers (at or before the
/// mark's segment; any segment for a namespace unregistered and not registered again, whose every
/// copy goes). A block forgotten at an unregistration stays in its segment until the segment is
/// evicted or compacted away, and its namespace's mark with it.
fn prune_marks(contents: &mut NamespaceLogContents, disk: &DiskTier) {
    let oldest = disk.oldest_segment_of();
    let covers = |ns: &NamespaceId, last_segment: u64| oldest.get(ns).is_some_and(|&seg| seg <= last_segment);
    let before = contents.unregistered.len() + contents.purged.len();
    let live = &contents.live;
    contents.unregistered.retain(|ns, mark| covers(ns, if live.contains_key(ns) { mark.0 } else { u64::MAX }));
    contents.purged.retain(|ns, mark| covers(ns, mark.0));
    let pruned = before - contents.unregistered.len() - contents.purged.len();
    if pruned > 0 {
        ::metrics::counter!("kvtier_namespace_log_marks_pruned_total").increment(pruned as u64);
    }
}

/// Rewrites `namespaces.log` under a new secret `key` — its header, one registration per live
/// namespace, one unregistration per namespace unregistered and one purge per namespace purged
/// (kept while their blocks may still sit in disk segments, which recovery scans:
/// [`prune_marks`]) — atomically: a new file synced, renamed over it, the
/// directory synced. Also how the file is created (header first, durable before any record).
fn compact_namespace_log(
    fs: &dyn FileSystem,
    path: &std::path::Path,
    key: &LogKey,
    contents: &NamespaceLogContents,
) -> std::io::Result<()> {
    use prost::Message;
    let tmp = path.with_extension("log.tmp");
    let mut data = encode_log_header(LogKind::Namespaces, key);
    for (id, mark) in &contents.unregistered {
        data.extend_from_slice(&namespace_record(key, &NamespaceRecord::Unregister { id: *id, mark: *mark }));
    }
    for (id, mark) in &contents.purged {
        data.extend_from_slice(&namespace_record(key, &NamespaceRecord::Purge { id: *id, mark: *mark }));
    }
    for ns in contents.live.values() {
        data.extend_from_slice(&namespace_record(key, &NamespaceRecord::Register(&ns.to_pb().encode_to_vec())));
    }
    let f = fs.open(&tmp, OpenMode::Truncate)?;
    f.write_all_at(&data, 0)?;
    f.sync_data()?;
    drop(f);
    fs.rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        fs.sync_dir(dir)?;
    }
    Ok(())
}

/// Appends a record to `namespaces.log` and syncs it; the file lock covers the write only, so
/// concurrent registrations share the sync. The append that takes the file past its bound
/// compacts it first ([`NamespaceLog::compact`]).
fn append_synced(log: &NamespaceLog, rec: &[u8]) -> std::io::Result<()> {
    use std::sync::atomic::Ordering;
    let file = {
        let mut file = log.file.lock();
        let end = file.size()?;
        if let Err(e) = file.write_all_at(rec, end) {
            // A refused append (a full disk) leaves no torn record behind.
            let _ = file.set_len(end);
            return Err(e);
        }
        let end = end + rec.len() as u64;
        if end > log.compacted_to.load(Ordering::Relaxed).saturating_mul(2).saturating_add(log.slack) {
            log.compact(&mut file, end);
        }
        file.clone()
    };
    file.sync_data()?;
    if !log.renamed_durably.load(Ordering::Acquire) {
        if let Some(dir) = log.path.parent() {
            log.fs.sync_dir(dir)?;
        }
        log.renamed_durably.store(true, Ordering::Release);
    }
    Ok(())
}

impl NamespaceLog {
    /// Rewrites the file as the start does (its records applied: each namespace registered once,
    /// the unregistrations and purges), under the same secret, and appends go on in the new
    /// file. On a failure the log is kept as it is (compacted again once it grows by another
    /// [`NAMESPACE_LOG_SLACK`]); whichever file the path names afterwards is the one appended to.
    fn compact(&self, file: &mut Arc<dyn FsFile>, end: u64) {
        use std::sync::atomic::Ordering;
        let done = read_namespace_log(&*self.fs, &self.path)
            .map_err(|e| std::io::Error::other(e.to_string()))
            .and_then(|(contents, ..)| compact_namespace_log(&*self.fs, &self.path, &self.key, &contents));
        if let Err(e) = &done {
            ::metrics::counter!("kvtier_namespace_log_compactions_failed_total").increment(1);
            tracing::warn!("{} not compacted ({e}): appending to it as it is", self.path.display());
            // Renamed or not: the next append syncs the directory.
            self.renamed_durably.store(false, Ordering::Release);
        }
        match self.fs.open(&self.path, OpenMode::Existing) {
            Ok(now) => *file = now,
            Err(e) => tracing::error!("{} not reopened after compaction: {e}", self.path.display()),
        }
        let size = file.size().unwrap_or(end);
        if done.is_ok() {
            ::metrics::counter!("kvtier_namespace_log_compactions_total").increment(1);
            tracing::info!("{}: compacted from {end} to {size} bytes", self.path.display());
            self.compacted_to.store(size, Ordering::Relaxed);
        } else {
            self.compacted_to.store(size / 2, Ordering::Relaxed);
        }
    }
}

/// How long [`lock_data_dir`] waits for a `LOCK` held by someone else before it refuses: a lock
/// lives as long as any copy of its descriptor, and a child process another thread is starting
/// (the fork before its `exec`), or a server process on its way out, holds one for a moment.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Holds `<data_dir>/LOCK` so a second server on the same directory is refused.
fn lock_data_dir(dir: &std::path::Path) -> Result<std::fs::File, ServerError> {
    let path = dir.join("LOCK");
    let f =
        std::fs::OpenOptions::new().create(true).truncate(false).read(true).write(true).open(&path).map_err(|e| {
            ServerError::Config(format!("data_dir {}: cannot open {}: {e}", dir.display(), path.display()))
        })?;
    let start = std::time::Instant::now();
    loop {
        match f.try_lock() {
            Ok(()) => {
                let _ = f.set_len(0);
                let _ = std::io::Write::write_all(&mut &f, format!("pid {}", std::process::id()).as_bytes());
                return Ok(f);
            }
            Err(std::fs::TryLockError::WouldBlock) if start.elapsed() < LOCK_WAIT => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                let holder = std::fs::read_to_string(&path).unwrap_or_default();
                return Err(ServerError::Config(format!(
                    "data_dir {} is in use by another kvtier server ({})",
                    dir.display(),
                    holder.trim()
                )));
            }
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(ServerError::Config(format!("data_dir {}: cannot lock: {e}", dir.display())));
            }
        }
    }
}

impl NodeState {
    /// Locks the data directory, opens the disk tier and replays the session log (if enabled).
    pub fn open(config: ServerConfig, data_addr: SocketAddr) -> Result<Self, ServerError> {
        Self::open_with(config, data_addr, StdFs::shared())
    }

    /// [`Self::open`] keeping the disk tier, `sessions.log` and `namespaces.log` on `fs` (the
    /// `LOCK` file is always a real one).
    pub fn open_with(
        config: ServerConfig,
        data_addr: SocketAddr,
        fs: Arc<dyn FileSystem>,
    ) -> Result<Self, ServerError> {
        let tenants = Tenants::from_config(&config)?;
        let dir_lock = lock_data_dir(&config.data_dir)?;
        let dram = DramTier::with_options(
            DramConfig { capacity_bytes: config.dram_capacity.0, max_pinned_ratio: config.max_pinned_ratio },
            DramOptions {
                region: if config.dram_region == "memfd" { RegionMode::Memfd } else { RegionMode::Anonymous },
                prefault: config.dram_prefault,
                lease_ttl: config.lease_timeout.0,
                // Readers' views of evicted blocks (the default), plus a full demotion queue.
                headroom_bytes: (config.disk_capacity.0 > 0).then(|| {
                    let cap = config.dram_capacity.0;
                    DramOptions::default_headroom(cap) + queue_headroom(cap, config.max_frame_bytes.0)
                }),
                ..DramOptions::default()
            },
        )
        .map_err(|e| ServerError::Config(format!("the DRAM tier's region: {e}")))?;
        let fsync = config.session_durability == "fsync";
        if config.disk_capacity.0 == 0 {
            let state = NodeState {
                tiers: TierStack::new(dram, None, fsync)
                    .with_event_buffer(config.events_buffer)
                    .with_agent_tier(agent_tier(&config)),
                sessions: SessionStore::new(None),
                namespaces: RwLock::new(HashMap::new()),
                owners: Default::default(),
                started: Instant::now(),
                data_addr,
                disk_recovery: None,
                io: IoPool::default(),
                namespace_log: None,
                creating: Mutex::new(()),
                _dir_lock: dir_lock,
                arena_access: OnceLock::new(),
                tenants,
                config,
            };
            state.reserve_quotas();
            state.sessions.set_namespace_owners(state.owners.clone());
            // Every gauge present from the start, not only once it first changes.
            metrics::gauge!("kvtier_namespaces").set(0.0);
            metrics::gauge!("kvtier_sessions").set(0.0);
            crate::metric_catalog::register_zeros(NODE_COUNTERS);
            return Ok(state);
        }
        // The data directory's own name durable (it may have just been created), or everything
        // in it could vanish with it.
        fs.create_dir_durable(&config.data_dir)?;
        let (disk, mut report) = DiskTier::open_with(
            DiskConfig {
                dir: config.data_dir.clone(),
                capacity_bytes: config.disk_capacity.0,
                segment_bytes: config.disk_segment_bytes.0,
                sync_writes: false,
            },
            fs.clone(),
        )?;
        tracing::info!(?report, "disk tier recovered");
        let disk = Arc::new(disk);
        let (log, Replayed { sessions: logged, drops, expired, unreadable }) =
            SessionLog::open_with(&fs, &config.data_dir, fsync, unix_ms(SystemTime::now()))?;
        if unreadable > 0 {
            tracing::warn!(
                unreadable,
                "session log had unreadable records, skipped: a torn tail is a park that was never acknowledged; \
                 a damaged record elsewhere (a disk fault) may have been a session's newest version, and that \
                 session is back at an older one or gone"
            );
        }
        let ns_path = config.data_dir.join("namespaces.log");
        let (mut ns_log, ns_format, ns_key, ns_skipped) = read_namespace_log(&*fs, &ns_path)?;
        let (namespaces, unregistered) = (&ns_log.live, &ns_log.unregistered);
        if ns_skipped > 0 {
            tracing::warn!(skipped = ns_skipped, "namespace log had unreadable (torn or damaged) records");
        }
        // Copies of an unregistered namespace's blocks written before it was unregistered are
        // still in their segments, before its mark: forgotten again (their bytes go with their
        // segments), even if the namespace was registered anew since. What lies after the mark is
        // the new incarnation's: no block write overlaps a mark, and a demotion or a park's
        // persist that waited for the unregistration skips the namespace (`crate::disk`, "Writes
        // and namespace marks"). Only explicitly unregistered ones: a namespace missing from a
        // damaged log keeps its blocks.
        for (gone, mark) in unregistered {
            // Not registered again: every copy goes, also any that landed after the mark (a
            // store racing the unregistration into DRAM, demoted later).
            let before = if namespaces.contains_key(gone) { *mark } else { (u64::MAX, u64::MAX) };
            let n = disk.purge_namespace_before(gone, before);
            if n > 0 {
                tracing::info!(blocks = n, "blocks of an unregistered namespace dropped at recovery");
                report.deleted += n as u64;
            }
        }
        let marks = ns_log.unregistered.len() + ns_log.purged.len();
        // Marks no segment needs any more go, at start only: nothing of an unregistered namespace
        // is on its way to disk now (while the node runs, a leased DRAM block a purge spared, or a
        // store racing an unregistration into DRAM, may still be demoted after its mark). The
        // segment files found are made durable as found first: a segment deleted before a power
        // loss must not come back once its namespace's mark is gone.
        match fs.sync_dir(&config.data_dir.join("segments")) {
            Ok(()) => prune_marks(&mut ns_log, &disk),
            Err(e) => tracing::warn!("disk tier's segment directory not synced ({e}): namespaces.log keeps every mark"),
        }
        // Rewritten under a new secret when it is new (its header durable before any record), of
        // the first format (migrated), or holds unregistrations (compacted); the rename and its
        // directory synced, so no registration is acknowledged into a file a power loss would
        // take back.
        let ns_key = match ns_key {
            Some(key) if ns_format == NamespaceLogFormat::Keyed && marks == 0 => key,
            _ => {
                let key = fresh_log_key()?;
                compact_namespace_log(&*fs, &ns_path, &key, &ns_log)?;
                key
            }
        };
        let f = fs.open(&ns_path, OpenMode::Existing)?;
        let ns_size = f.size()?;
        let mut state = NodeState {
            tiers: TierStack::new(dram, Some(disk.clone()), fsync)
                .with_event_buffer(config.events_buffer)
                .with_agent_tier(agent_tier(&config)),
            sessions: SessionStore::new(Some(log)),
            namespaces: RwLock::new(ns_log.live.clone()),
            owners: Default::default(),
            started: Instant::now(),
            data_addr,
            disk_recovery: Some(report),
            io: IoPool::default(),
            namespace_log: Some(NamespaceLog {
                file: Mutex::new(f),
                key: ns_key,
                fs: fs.clone(),
                path: ns_path,
                compacted_to: ns_size.into(),
                slack: NAMESPACE_LOG_SLACK,
                renamed_durably: true.into(),
            }),
            creating: Mutex::new(()),
            _dir_lock: dir_lock,
            arena_access: OnceLock::new(),
            tenants,
            config,
        };
        state.reserve_quotas();
        state
            .owners
            .write()
            .extend(state.namespaces.read().iter().map(|(id, ns)| (*id, crate::remembered::owner_key(&ns.tenant))));
        state.sessions.set_namespace_owners(state.owners.clone());
        // Every gauge present from the start (the namespaces recovered), not only once it first
        // changes: after a restart it was absent until a namespace was registered.
        metrics::gauge!("kvtier_namespaces").set(state.namespaces.read().len() as f64);
        // Sessions of a namespace unregistered since they were parked went with it (its
        // unregistration is logged, their tombstones are not): not restored, nor counted lost.
        let (mut with_layout, mut unregistered) = (Vec::new(), Vec::new());
        {
            let map = state.namespaces.read();
            for s in logged {
                match map.get(&s.namespace) {
                    Some(n) => with_layout.push((s, n.layout.bytes_per_token())),
                    None => unregistered.push(s),
                }
            }
        }
        if !unregistered.is_empty() {
            tracing::info!(
                sessions = unregistered.len(),
                "sessions of unregistered namespaces dropped from the session log"
            );
            state.sessions.forget_logged(&unregistered);
        }
        for ns in state.namespaces.read().values() {
            state.account(ns);
        }
        let (ok, lost) = state.sessions.restore(state.tiers.session_pins(), with_layout);
        ::metrics::counter!("kvtier_sessions_recovered_total").increment(ok);
        ::metrics::counter!("kvtier_sessions_lost_total").increment(lost);
        tracing::info!(recovered = ok, lost, "sessions restored from the session log");
        // Drops made within the hour stay remembered against copies coming back from nodes that
        // were away (a restart here between the drop and their return no longer forgets them).
        state.sessions.restore_drops(drops);
        state.sessions.restore_expired(expired);
        // Copies of a purged namespace's blocks written before the purge are still in their
        // segments, before its mark (no block write overlaps a mark): forgotten again, now that
        // the restored sessions pin theirs (a purge spares the blocks a parked session pins).
        if let Some(disk) = state.tiers.disk() {
            for (ns, mark) in &ns_log.purged {
                let n = disk.purge_namespace_before(ns, *mark);
                if n > 0 {
                    tracing::info!(blocks = n, "blocks of a purged namespace dropped at recovery");
                    if let Some(r) = state.disk_recovery.as_mut() {
                        r.deleted += n as u64;
                    }
                }
            }
        }
        // What the scan found and kept: blocks of deleted namespaces are not recovered ones.
        if let Some(r) = &state.disk_recovery {
            metrics::counter!("kvtier_disk_recovered_blocks_total").increment(r.blocks.saturating_sub(r.deleted));
        }
        metrics::gauge!("kvtier_sessions").set(state.sessions.len() as f64);
        crate::metric_catalog::register_zeros(NODE_COUNTERS);
        Ok(state)
    }

    /// Sets the tenants' DRAM and disk quotas before any block arrives: what they reserve in
    /// DRAM is kept from the tenants without one and the operator from the start, and a
    /// tenant's `Stats` shows its disk quota before its first namespace (it showed the tier's).
    fn reserve_quotas(&self) {
        for t in self.tenants.all() {
            self.tiers.reserve_quotas(t.index, t.quotas.dram_bytes, t.quotas.disk_bytes);
        }
    }

    /// Counts a namespace's DRAM bytes against its tenant's account (and quota), if the tenant
    /// is configured.
    fn account(&self, ns: &Namespace) {
        if let Some(t) = self.tenants.tenant(&ns.tenant) {
            self.tiers.assign_account(ns.id(), t.index, t.quotas.dram_bytes, t.quotas.disk_bytes);
        }
    }

    pub fn config(&self) -> &ServerConfig {
        &self.config
    }

    /// Credentials, tenants and their grants and quotas.
    pub fn tenants(&self) -> &Tenants {
        &self.tenants
    }

    /// Registers the DRAM arena with `fabric`, so that data-plane connections may lease its slots
    /// to peers that read and write them one-sidedly (see `crate::fabric`). Once per node.
    pub fn attach_fabric(&self, fabric: Arc<dyn Fabric>) -> Result<(), ServerError> {
        let attached = || ServerError::Config("a fabric is already attached to this node's DRAM arena".into());
        if self.arena_access.get().is_some() {
            return Err(attached());
        }
        let region = self.tiers.dram_region();
        // Read leases keep evicted blocks' slots in the headroom past the capacity: half of it.
        let read_cap = (region.len() as u64).saturating_sub(self.config.dram_capacity.0) / 2;
        // Write leases take slots from the DRAM tier's lease budget, which plain `PUT`s share:
        // peers get half of it, so they can't starve the node's own clients.
        let write_cap = self.tiers.dram_lease_budget() / 2;
        // SAFETY: the region lives in `self.tiers`, and `arena_access` is declared before it, so
        // the registration is dropped before the region is unmapped.
        let access = unsafe {
            ArenaAccess::register(
                fabric,
                region.as_ptr() as *mut u8,
                region.len(),
                LeaseCaps { read: read_cap, write: write_cap },
            )?
        };
        tracing::info!(fabric = access.name(), bytes = region.len(), "DRAM arena registered for one-sided access");
        self.arena_access.set(Arc::new(access)).map_err(|_| attached())
    }

    /// The DRAM arena's one-sided registration, when a fabric is attached.
    pub fn arena_access(&self) -> Option<&Arc<ArenaAccess>> {
        self.arena_access.get()
    }

    /// The tier stack: the only way to the blocks.
    pub fn tiers(&self) -> &TierStack {
        &self.tiers
    }

    /// Parked sessions (their calls may block on the session log: run them on [`NodeState::io`]).
    pub fn sessions(&self) -> &SessionStore {
        &self.sessions
    }

    /// The pool for the control plane's disk work.
    pub fn io(&self) -> &IoPool {
        &self.io
    }

    pub fn data_addr(&self) -> SocketAddr {
        self.data_addr
    }

    pub fn uptime(&self) -> Duration {
        self.started.elapsed()
    }

    /// When this process opened the node's state (sessions last touched before it were
    /// recovered from its session log).
    pub fn started_at(&self) -> Instant {
        self.started
    }

    /// What opening the disk tier found, when the node has one.
    pub fn disk_recovery(&self) -> Option<&RecoveryReport> {
        self.disk_recovery.as_ref()
    }

    /// Registers a namespace (idempotent) for `by` and returns its id. A tenant creates only
    /// namespaces that name it as their tenant, up to its `max_namespaces`. A tenant another
    /// granted access to (a `read` or `write` grant) may register one of that tenant's namespaces
    /// that already exists — how every client gets the id before reading it — which creates
    /// nothing and counts against nothing; creating it stays the owner's (or the operator's).
    pub fn register_namespace(&self, by: &Principal, ns: Namespace) -> Result<NamespaceId, ServerError> {
        ns.validate()?;
        if let Principal::Tenant(t) = by {
            if ns.tenant != t.name {
                return self.register_granted(by, &ns);
            }
        }
        if ns.layout.block_bytes() > self.config.max_frame_bytes.0 {
            return Err(ServerError::InvalidRequest(format!(
                "a block of this layout is {} bytes, above max_frame_bytes {}",
                ns.layout.block_bytes(),
                self.config.max_frame_bytes
            )));
        }
        let id = ns.id();
        if self.namespaces.read().contains_key(&id) {
            return Ok(id);
        }
        // Creations one at a time (they are rare; registering a known namespace does not wait):
        // two racing ones each passed the checks below with one slot left, and both were made.
        let _creating = self.creating.lock();
        // The owner's quota, whoever registers it: a peer forwarding the tenant's blocks (as the
        // operator) counts against it as the tenant itself would.
        if let Some(max) = self.tenants.tenant(&ns.tenant).and_then(|t| t.quotas.max_namespaces) {
            let map = self.namespaces.read();
            let held = map.values().filter(|n| n.tenant == ns.tenant).count() as u64;
            if !map.contains_key(&id) && held >= max {
                return Err(crate::tenants::quota_refused(
                    &ns.tenant,
                    "max_namespaces",
                    format!(
                        "tenant {:?} holds {held} namespaces on this node, its max_namespaces is {max} (unregister one first)",
                        ns.tenant
                    ),
                ));
            }
        }
        self.check_shared_namespace_slots(&ns)?;
        if self.namespaces.read().contains_key(&id) {
            return Ok(id);
        }
        if self.namespace_count() >= MAX_NAMESPACES {
            return Err(ServerError::Capacity(format!("this node already holds {MAX_NAMESPACES} namespaces")));
        }
        // Logged (and synced) before it is visible, and outside the map's lock, which every
        // data-plane request reads.
        if let Some(log) = &self.namespace_log {
            use prost::Message;
            let rec = namespace_record(&log.key, &NamespaceRecord::Register(&ns.to_pb().encode_to_vec()));
            append_synced(log, &rec)?;
        }
        self.account(&ns);
        let mut map = self.namespaces.write();
        if !map.contains_key(&id) {
            if map.len() >= MAX_NAMESPACES {
                return Err(ServerError::Capacity(format!("this node already holds {MAX_NAMESPACES} namespaces")));
            }
            self.owners.write().insert(id, crate::remembered::owner_key(&ns.tenant));
            map.insert(id, ns);
            metrics::gauge!("kvtier_namespaces").set(map.len() as f64);
        }
        Ok(id)
    }

    /// The namespaces of owners without a `max_namespaces` (tenants without one, the operator's)
    /// share the node's slots the quotas leave ([`MAX_NAMESPACES`] less their sum, while that
    /// sum is below it), so they can't take the slots a quota promised.
    fn check_shared_namespace_slots(&self, ns: &Namespace) -> Result<(), ServerError> {
        let limit_of = |tenant: &str| self.tenants.tenant(tenant).and_then(|t| t.quotas.max_namespaces);
        if limit_of(&ns.tenant).is_some() {
            return Ok(());
        }
        let reserved = self.tenants.all().filter_map(|t| t.quotas.max_namespaces).fold(0u64, u64::saturating_add);
        if reserved == 0 || reserved >= MAX_NAMESPACES as u64 {
            return Ok(());
        }
        let shared = MAX_NAMESPACES as u64 - reserved;
        let map = self.namespaces.read();
        if map.contains_key(&ns.id()) {
            return Ok(());
        }
        let held = map.values().filter(|n| limit_of(&n.tenant).is_none()).count() as u64;
        if held >= shared {
            return Err(ServerError::Capacity(format!(
                "the namespaces of tenants without a max_namespaces (and the operator's) share {shared} of this \
                 node's {MAX_NAMESPACES} slots (the rest is reserved by tenants' max_namespaces), and hold {held}: \
                 unregister one first"
            )));
        }
        Ok(())
    }

    /// [`Self::register_namespace`] of another tenant's namespace by `by`: its id when it is
    /// registered and `by` may read it (a grant); refused otherwise, saying which.
    fn register_granted(&self, by: &Principal, ns: &Namespace) -> Result<NamespaceId, ServerError> {
        if !by.may(Access::Read, &ns.tenant) {
            // Every call registers first, a store's as a lookup's: counted as a read refused (the
            // least access), and said as no access at all, naming no namespace.
            let _counted = by.refusal(Access::Read, &format!("namespaces of tenant {:?}", ns.tenant));
            return Err(ServerError::Forbidden(format!(
                "tenant {:?} may not use namespaces of tenant {:?}, which granted it neither read nor write",
                by.name(),
                ns.tenant
            )));
        }
        let id = ns.id();
        if self.namespaces.read().contains_key(&id) {
            return Ok(id);
        }
        // Granted: telling it the namespace does not exist (yet) confirms nothing it may not know.
        // Not an authentication failure (its own counter, not kvtier_auth_denied_total).
        metrics::counter!("kvtier_namespace_not_registered_total").increment(1);
        tracing::debug!(principal = by.name(), owner = ns.tenant, "a grantee asked for a namespace not registered");
        Err(ServerError::Forbidden(format!(
            "namespace not registered: tenant {owner:?} has not registered it; tenant {me:?} may use it but not \
             create it (tenant {owner:?} must register it first, with the same model, layout, hash scheme and salt)",
            owner = ns.tenant,
            me = by.name(),
        )))
    }

    /// Unregisters a namespace `by` may write: it stops being known (logged, synced, before
    /// anything else), then its sessions are dropped and its blocks removed. Returns (sessions
    /// dropped, blocks removed). Blocks still pinned by another connection's lease stay until
    /// evicted.
    pub fn unregister_namespace(&self, by: &Principal, id: &NamespaceId) -> Result<(u64, u64), ServerError> {
        self.unregister_namespace_at(by, id, Some(Instant::now()))
    }

    /// [`Self::unregister_namespace`], remembering that the namespace's sessions were dropped
    /// `at` (`None`: before this machine's clock began, nothing to remember).
    fn unregister_namespace_at(
        &self,
        by: &Principal,
        id: &NamespaceId,
        at: Option<Instant>,
    ) -> Result<(u64, u64), ServerError> {
        self.namespace_for(by, id, Access::Write)?;
        // Held from the mark until the namespace is forgotten in every tier: no block record is
        // written in between (a demotion or a park's persist in flight is waited for first, and
        // skips the namespace after), so none of this incarnation lands after the mark, where
        // recovery would keep it for the namespace registered anew. Its sessions are let go under
        // it too, so a disk compaction can't copy their blocks past the mark either.
        let invalidation = self.tiers.invalidate();
        if let Some(log) = &self.namespace_log {
            let mark = invalidation.mark();
            let rec = namespace_record(&log.key, &NamespaceRecord::Unregister { id: *id, mark });
            append_synced(log, &rec)?;
        }
        {
            let mut map = self.namespaces.write();
            map.remove(id);
            metrics::gauge!("kvtier_namespaces").set(map.len() as f64);
        }
        if let Some(at) = at {
            self.sessions.remember_unregistered_at(*id, at);
        }
        // After the mark above is remembered as the tenant's.
        self.owners.write().remove(id);
        let mut dropped = 0;
        for m in self.sessions.list(Some(*id)) {
            // The unregistration logged above drops them at replay too.
            dropped += u64::from(self.sessions.forget_session(self.tiers.session_pins(), *id, &m.id));
        }
        let removed = invalidation.forget_namespace(id);
        drop(invalidation);
        tracing::info!(principal = by.name(), dropped, removed, "namespace unregistered");
        Ok((dropped, removed))
    }

    /// [`Self::unregister_namespace`] as of `as_of` (`Some`: asked then by a member that could
    /// not reach this node sooner; `Some(None)`: before this machine's clock began). Sessions
    /// touched since belong to the namespace registered again: if there are any, they stay, and
    /// the namespace with them; the older sessions are dropped and the unpinned blocks removed.
    pub fn unregister_namespace_as_of(
        &self,
        by: &Principal,
        id: &NamespaceId,
        as_of: Option<Option<Instant>>,
    ) -> Result<(u64, u64), ServerError> {
        let Some(at) = as_of else { return self.unregister_namespace(by, id) };
        self.namespace_for(by, id, Access::Write)?;
        let older = |m: &crate::sessions::SessionManifest| match at {
            Some(at) => crate::session_store::SessionStore::touched_before(m, at),
            None => m.expires_at.checked_sub(m.ttl).is_none(),
        };
        let (old, newer): (Vec<_>, Vec<_>) = self.sessions.list(Some(*id)).into_iter().partition(|m| older(m));
        if newer.is_empty() {
            return self.unregister_namespace_at(by, id, at);
        }
        if let Some(at) = at {
            self.sessions.remember_unregistered_at(*id, at);
        }
        let mut dropped = 0;
        for m in old {
            dropped += u64::from(self.sessions.drop_replica(self.tiers.session_pins(), *id, &m.id, m.version)?);
        }
        let removed = self.purge_namespace(by, id)?;
        tracing::info!(
            principal = by.name(),
            dropped,
            removed,
            kept = newer.len(),
            "a late unregistration kept the sessions touched since"
        );
        Ok((dropped, removed))
    }

    /// Removes every block of a namespace `by` may write from every tier, except those a parked
    /// session pins; returns how many distinct blocks went. Logged (and synced) first with the
    /// disk tier's write position, so copies on disk before it stay gone after a restart.
    pub fn purge_namespace(&self, by: &Principal, id: &NamespaceId) -> Result<u64, ServerError> {
        self.namespace_for(by, id, Access::Write)?;
        // As for an unregistration: no block record written between the mark and the purge.
        let invalidation = self.tiers.invalidate();
        if let Some(log) = &self.namespace_log {
            let mark = invalidation.mark();
            append_synced(log, &namespace_record(&log.key, &NamespaceRecord::Purge { id: *id, mark }))?;
        }
        Ok(invalidation.purge(id))
    }

    /// Whether `p` may `access` a registered namespace (without copying it: the data plane asks
    /// per request). See [`Self::namespace_for`] for what a refusal says.
    pub fn check_namespace(&self, p: &Principal, id: &NamespaceId, access: Access) -> Result<(), ItemStatus> {
        let map = self.namespaces.read();
        let ns = map.get(id).ok_or(ItemStatus::UnknownNamespace)?;
        if p.may(access, &ns.tenant) {
            return Ok(());
        }
        let visible = p.may(Access::Read, &ns.tenant);
        drop(map);
        p.refusal(access, "another tenant's namespace");
        Err(if visible { ItemStatus::Forbidden } else { ItemStatus::UnknownNamespace })
    }

    /// The namespace, when it is registered and `p` may `access` it. A tenant refused a namespace
    /// it may read (a write under a read grant) is told it is forbidden; one with no grant on it
    /// at all gets the answer an unregistered namespace gets, so that probing ids tells a tenant
    /// nothing about which namespaces (models, layouts) other tenants use. The refusal is counted
    /// and logged as one (`kvtier_auth_denied_total`) either way.
    pub fn namespace_for(&self, p: &Principal, id: &NamespaceId, access: Access) -> Result<Namespace, ServerError> {
        let ns = self.namespace(id)?;
        if !p.may(access, &ns.tenant) {
            let refusal = p.refusal(access, "another tenant's namespace");
            return Err(if p.may(Access::Read, &ns.tenant) { refusal } else { ServerError::UnknownNamespace(*id) });
        }
        Ok(ns)
    }

    /// Whether `p` may read the namespace `id` (false for unknown ones).
    pub fn may_read(&self, p: &Principal, id: &NamespaceId) -> bool {
        self.namespaces.read().get(id).is_some_and(|ns| p.may(Access::Read, &ns.tenant))
    }

    /// The ids of the namespaces a tenant registered.
    pub fn namespaces_of(&self, tenant: &str) -> Vec<NamespaceId> {
        self.namespaces.read().iter().filter(|(_, ns)| ns.tenant == tenant).map(|(id, _)| *id).collect()
    }

    /// The priority a client's fresh block is kept at in DRAM: `Low` on a node of a cluster
    /// that is not one of the block's owners — it relays the block to them and keeps a copy that
    /// goes first under pressure, so the cluster's memory holds the owners' copies — `Normal`
    /// otherwise.
    pub fn store_priority(&self, h: &FrameHeader) -> Priority {
        let Some(peers) = self.tiers().peers() else { return Priority::Normal };
        match self.namespace(&h.namespace) {
            Ok(ns) if !peers.owns(&ns, &h.key) => Priority::Low,
            _ => Priority::Normal,
        }
    }

    pub fn namespace(&self, id: &NamespaceId) -> Result<Namespace, ServerError> {
        self.namespaces.read().get(id).cloned().ok_or(ServerError::UnknownNamespace(*id))
    }

    /// Checks a frame header against its namespace before any payload byte is stored; the header
    /// to store (a lossless namespace's blocks are flagged so that no tier quantizes them later).
    /// Both ingest paths (the data plane's `PUT`, the same-node store) use it, per frame, without
    /// copying the namespace.
    pub fn admit_frame(&self, by: &Principal, h: &FrameHeader) -> Result<FrameHeader, ItemStatus> {
        let (layout, lossless, allowed, visible) = {
            let map = self.namespaces.read();
            let ns = map.get(&h.namespace).ok_or(ItemStatus::UnknownNamespace)?;
            (ns.layout, ns.is_lossless(), by.may(Access::Write, &ns.tenant), by.may(Access::Read, &ns.tenant))
        };
        if !allowed {
            // As `namespace_for`: without any grant, the answer an unregistered namespace gets.
            by.refusal(Access::Write, "another tenant's namespace");
            return Err(if visible { ItemStatus::Forbidden } else { ItemStatus::UnknownNamespace });
        }
        if layout != h.layout {
            return Err(ItemStatus::LayoutMismatch);
        }
        if lossless && !kvtier_kernels::is_lossless(h.codec) {
            return Err(ItemStatus::LossyCodec);
        }
        h.check_size().map_err(|e| match e {
            ProtoError::LossyCodec { .. } => ItemStatus::LossyCodec,
            _ => ItemStatus::SizeMismatch,
        })?;
        let mut stored = *h;
        if lossless {
            stored.flags |= FRAME_FLAG_KEEP_LOSSLESS;
        }
        Ok(stored)
    }

    pub fn namespace_count(&self) -> usize {
        self.namespaces.read().len()
    }

    pub fn session_limits(&self, ns: &Namespace) -> SessionLimits {
        // The owner's quotas, whoever parks (a tenant granted write counts against the owner).
        let quota = self.tenants.tenant(&ns.tenant).and_then(|t| {
            let q = t.quotas;
            (q.max_sessions.is_some() || q.max_session_bytes.is_some()).then(|| SessionQuota {
                tenant: t.name.clone(),
                namespaces: self.namespaces_of(&t.name),
                max_sessions: q.max_sessions,
                max_bytes: q.max_session_bytes,
            })
        });
        SessionLimits {
            block_tokens: ns.layout.block_tokens,
            bytes_per_token: ns.layout.bytes_per_token(),
            max_context_tokens: self.config.max_context_tokens,
            quota,
            max_manifest_keys: self.config.max_session_keys(),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A node on `dir` with 8 MiB of DRAM and an 8 MiB disk tier of 1 MiB segments.
    fn disk_node(dir: &std::path::Path) -> ServerConfig {
        use crate::config::ByteSize;
        ServerConfig {
            data_dir: dir.to_path_buf(),
            dram_capacity: ByteSize(8 << 20),
            disk_capacity: ByteSize(8 << 20),
            disk_segment_bytes: ByteSize(1 << 20),
            metrics_listen: None,
            ..ServerConfig::default()
        }
    }

    /// A `LOCK` held for a moment (a descriptor copy a starting child process holds until its
    /// `exec`) is waited for; one held for good is refused, naming its holder.
    #[test]
    fn a_briefly_held_lock_is_waited_for_and_a_held_one_refused() {
        let dir = tempfile::tempdir().unwrap();
        let held = lock_data_dir(dir.path()).unwrap();
        let release = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(200));
            drop(held);
        });
        let second = lock_data_dir(dir.path()).expect("a lock released within the wait is taken");
        release.join().unwrap();

        let start = std::time::Instant::now();
        let err = lock_data_dir(dir.path()).unwrap_err().to_string();
        assert!(start.elapsed() >= LOCK_WAIT, "refused after {:?}", start.elapsed());
        assert!(
            err.contains("in use by another kvtier server") && err.contains(&format!("pid {}", std::process::id())),
            "{err}"
        );
        drop(second);
        assert!(lock_data_dir(dir.path()).is_ok());
    }

    /// Racing creations by a tenant one namespace below its `max_namespaces` make one namespace,
    /// not one each: the checks, the logged record and the insertion are one step. (With a disk
    /// tier each creation waits for `namespaces.log`'s sync between its check and its insertion:
    /// before, all 8 passed the check and the tenant held 8 of 2.)
    #[test]
    fn racing_creations_stay_within_max_namespaces_and_the_log_holds_only_those_made() {
        use crate::config::TenantConfig;
        use kvtier_proto::{DType, HashScheme, KvLayout};
        let dir = tempfile::tempdir().unwrap();
        let tenant = TenantConfig {
            name: "q".into(),
            tokens: vec!["token-of-tenant-q-0123".into()],
            max_namespaces: Some(2),
            ..Default::default()
        };
        let config = ServerConfig { tenants: vec![tenant], ..disk_node(dir.path()) };
        let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let state = Arc::new(NodeState::open(config.clone(), addr).unwrap());
        let q = state.tenants().authenticate(Some(b"token-of-tenant-q-0123")).unwrap();
        let ns = |i: u8| {
            let layout = KvLayout::new(1, 1, 8, DType::Fp16, 16);
            Namespace::new("q", "m", layout, HashScheme::Blake3, &[i])
        };
        state.register_namespace(&q, ns(0)).unwrap();
        let start = Arc::new(std::sync::Barrier::new(8));
        let racers: Vec<_> = (1..=8u8)
            .map(|i| {
                let (state, q, start) = (state.clone(), q.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    state.register_namespace(&q, ns(i))
                })
            })
            .collect();
        let results: Vec<_> = racers.into_iter().map(|t| t.join().unwrap()).collect();
        let made = results.iter().filter(|r| r.is_ok()).count();
        assert_eq!(made, 1, "{results:?}");
        assert!(results.iter().all(|r| matches!(r, Ok(_) | Err(ServerError::QuotaExceeded(_)))), "{results:?}");
        assert_eq!(state.namespaces_of("q").len(), 2);
        // Registering one it holds still works at its quota, without waiting on creations.
        assert_eq!(state.register_namespace(&q, ns(0)).unwrap(), ns(0).id());
        drop(q);
        drop(state);
        // Started again: the log made no more of them than were made.
        let again = NodeState::open(config, addr).unwrap();
        assert_eq!(again.namespaces_of("q").len(), 2);
    }

    /// A disk node on `dir` whose `namespaces.log` is compacted past 4 KiB of slack (not 1 MiB),
    /// with its config and address to open it again.
    fn disk_node_compacting_often(dir: &std::path::Path) -> (ServerConfig, SocketAddr, NodeState) {
        let config = disk_node(dir);
        let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let mut state = NodeState::open(config.clone(), addr).unwrap();
        if let Some(log) = state.namespace_log.as_mut() {
            log.slack = 4096;
        }
        (config, addr, state)
    }

    /// A namespace registered and unregistered over and over grows `namespaces.log` only to about
    /// twice its live size plus the slack: the append past it compacts the file while the node
    /// runs, and what a restart reads back is what was registered last. Before, 500 cycles wrote
    /// 211 KB, compacted only at the next start.
    #[test]
    fn a_namespace_registered_over_and_over_keeps_its_log_bounded() {
        use kvtier_proto::{DType, HashScheme, KvLayout};
        let dir = tempfile::tempdir().unwrap();
        let (config, addr, state) = disk_node_compacting_often(dir.path());
        let ns = |i: u8| Namespace::new("t", "m", KvLayout::new(1, 1, 8, DType::Fp16, 16), HashScheme::Blake3, &[i]);
        let op = Principal::Operator;
        state.register_namespace(&op, ns(1)).unwrap();
        let path = dir.path().join("namespaces.log");
        let mut largest = 0;
        for _ in 0..200 {
            state.register_namespace(&op, ns(0)).unwrap();
            state.unregister_namespace(&op, &ns(0).id()).unwrap();
            largest = largest.max(std::fs::metadata(&path).unwrap().len());
        }
        assert!(largest < 16 << 10, "namespaces.log reached {largest} bytes");
        state.register_namespace(&op, ns(2)).unwrap();
        drop(state);
        let again = NodeState::open(config, addr).unwrap();
        let mut live: Vec<NamespaceId> = again.namespaces_of("t").to_vec();
        live.sort();
        let mut want = vec![ns(1).id(), ns(2).id()];
        want.sort();
        assert_eq!(live, want);
    }

    /// Namespaces registered and unregistered one after another, each a new one, leave
    /// `namespaces.log` small again at the next start: an unregistration's mark goes once no
    /// segment holds a record of its namespace. The mark of one whose block is still in a segment
    /// stays, so the restart still forgets that block (and the next one too). Before, every mark
    /// was kept for good (400 namespaces: 24 KB, read at every start).
    #[test]
    fn namespaces_unregistered_one_after_another_leave_the_log_small_at_the_next_start() {
        use kvtier_proto::{BlockFrame, BlockKey, CodecId, DType, HashScheme, KvLayout};
        let dir = tempfile::tempdir().unwrap();
        let (config, addr, state) = disk_node_compacting_often(dir.path());
        let layout = KvLayout::new(1, 1, 8, DType::Fp16, 16);
        let ns = |i: u32| Namespace::new("t", "m", layout, HashScheme::Blake3, &i.to_le_bytes());
        let op = Principal::Operator;
        let with_block = ns(u32::MAX);
        state.register_namespace(&op, with_block.clone()).unwrap();
        let key = BlockKey([7; 32]);
        let f = BlockFrame::new(
            with_block.id(),
            key,
            layout,
            CodecId::RAW,
            16,
            vec![3u8; layout.block_bytes() as usize].into(),
        );
        let disk = state.tiers().disk().unwrap();
        disk.write(&f.header, &f.payload).unwrap();
        assert!(disk.contains(&with_block.id(), &key));
        state.unregister_namespace(&op, &with_block.id()).unwrap();
        let path = dir.path().join("namespaces.log");
        for i in 0..400 {
            state.register_namespace(&op, ns(i)).unwrap();
            state.unregister_namespace(&op, &ns(i).id()).unwrap();
        }
        let (contents, ..) = read_namespace_log(&StdFs, &path).unwrap();
        assert_eq!(contents.unregistered.len(), 401, "while the node runs, every mark is kept");
        drop(state);
        for _ in 0..2 {
            let again = NodeState::open(config.clone(), addr).unwrap();
            let size = std::fs::metadata(&path).unwrap().len();
            assert!(size < 1024, "namespaces.log is {size} bytes after a start");
            let (contents, ..) = read_namespace_log(&StdFs, &path).unwrap();
            assert_eq!(
                contents.unregistered.keys().collect::<Vec<_>>(),
                [&with_block.id()],
                "the mark still covering a block"
            );
            let disk = again.tiers().disk().unwrap();
            assert!(!disk.contains(&with_block.id(), &key), "an unregistered namespace's block came back");
        }
    }

    /// `StdFs`, except that once armed ([`HeldWrites::arm`]) the next write of a record of one
    /// namespace to a disk segment waits until the test lets it go: a block write in flight.
    #[derive(Debug, Default)]
    struct HeldWrites {
        armed: Arc<Mutex<Option<Armed>>>,
    }

    #[derive(Debug)]
    struct Armed {
        ns: NamespaceId,
        entered: std::sync::mpsc::Sender<()>,
        release: std::sync::mpsc::Receiver<()>,
    }

    #[derive(Debug)]
    struct HeldFile {
        file: Arc<dyn FsFile>,
        armed: Arc<Mutex<Option<Armed>>>,
    }

    impl HeldWrites {
        /// Holds the next segment write of a record of `ns`: (told when it is held, lets it go).
        fn arm(&self, ns: NamespaceId) -> (std::sync::mpsc::Receiver<()>, std::sync::mpsc::Sender<()>) {
            let (entered, held) = std::sync::mpsc::channel();
            let (release, released) = std::sync::mpsc::channel();
            *self.armed.lock() = Some(Armed { ns, entered, release: released });
            (held, release)
        }
    }

    impl FsFile for HeldFile {
        fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
            self.file.read_exact_at(buf, offset)
        }
        fn write_all_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
            let held = {
                let mut armed = self.armed.lock();
                let ours = armed.as_ref().is_some_and(|a| FrameHeader::decode(buf).is_ok_and(|h| h.namespace == a.ns));
                if ours {
                    armed.take()
                } else {
                    None
                }
            };
            if let Some(a) = held {
                let _ = a.entered.send(());
                let _ = a.release.recv();
            }
            self.file.write_all_at(buf, offset)
        }
        fn size(&self) -> std::io::Result<u64> {
            self.file.size()
        }
        fn set_len(&self, len: u64) -> std::io::Result<()> {
            self.file.set_len(len)
        }
        fn sync_data(&self) -> std::io::Result<()> {
            self.file.sync_data()
        }
    }

    impl FileSystem for HeldWrites {
        fn open(&self, path: &std::path::Path, mode: OpenMode) -> std::io::Result<Arc<dyn FsFile>> {
            let file = StdFs.open(path, mode)?;
            if path.extension().is_some_and(|e| e == "kvs") {
                return Ok(Arc::new(HeldFile { file, armed: self.armed.clone() }));
            }
            Ok(file)
        }
        fn create_dir_all(&self, path: &std::path::Path) -> std::io::Result<()> {
            StdFs.create_dir_all(path)
        }
        fn list(&self, dir: &std::path::Path) -> std::io::Result<Vec<String>> {
            StdFs.list(dir)
        }
        fn rename(&self, from: &std::path::Path, to: &std::path::Path) -> std::io::Result<()> {
            StdFs.rename(from, to)
        }
        fn remove_file(&self, path: &std::path::Path) -> std::io::Result<()> {
            StdFs.remove_file(path)
        }
        fn sync_dir(&self, dir: &std::path::Path) -> std::io::Result<()> {
            StdFs.sync_dir(dir)
        }
    }

    /// A node with 2 MiB of DRAM over a 32 MiB disk tier (nothing evicted from disk here) whose
    /// segment writes can be held, namespaces `a` and `b` of 64 KiB blocks registered.
    struct Race {
        dir: tempfile::TempDir,
        fs: Arc<HeldWrites>,
        rt: tokio::runtime::Runtime,
        state: Arc<NodeState>,
        a: Namespace,
        b: Namespace,
    }

    impl Race {
        fn new() -> Self {
            use kvtier_proto::{DType, HashScheme, KvLayout};
            let dir = tempfile::tempdir().unwrap();
            let fs = Arc::new(HeldWrites::default());
            let state = Arc::new(NodeState::open_with(Self::config(dir.path()), Self::addr(), fs.clone()).unwrap());
            let layout = KvLayout::new(4, 8, 128, DType::Fp16, 4);
            assert_eq!(layout.block_bytes(), 64 << 10);
            let a = Namespace::new("t", "a", layout, HashScheme::Blake3, b"");
            let b = Namespace::new("t", "b", layout, HashScheme::Blake3, b"");
            for ns in [&a, &b] {
                state.register_namespace(&Principal::Operator, ns.clone()).unwrap();
            }
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
            Race { dir, fs, rt, state, a, b }
        }

        fn config(dir: &std::path::Path) -> ServerConfig {
            use crate::config::ByteSize;
            ServerConfig {
                data_dir: dir.to_path_buf(),
                dram_capacity: ByteSize(2 << 20),
                disk_capacity: ByteSize(32 << 20),
                disk_segment_bytes: ByteSize(4 << 20),
                max_frame_bytes: ByteSize(1 << 20),
                metrics_listen: None,
                ..ServerConfig::default()
            }
        }

        fn addr() -> SocketAddr {
            "127.0.0.1:0".parse().unwrap()
        }

        fn block(ns: &Namespace, i: u32) -> crate::dram::StoredBlock {
            let key = kvtier_proto::BlockKey(*blake3::hash(&[&ns.id().0[..], &i.to_le_bytes()].concat()).as_bytes());
            let payload: Vec<u8> = (0..64u32 << 10).map(|j| j.wrapping_mul(31).wrapping_add(i) as u8).collect();
            let f =
                kvtier_proto::BlockFrame::new(ns.id(), key, ns.layout, kvtier_proto::CodecId::RAW, 4, payload.into());
            crate::dram::StoredBlock { header: f.header, payload: f.payload }
        }

        /// A block stored in DRAM (as a fetched block is).
        fn store(&self, b: &crate::dram::StoredBlock) {
            self.rt.block_on(self.state.tiers().backpressure());
            self.state.tiers().put_fetched(b, Priority::Normal).unwrap();
        }

        /// Runs `invalidate` (an unregistration, a purge) on its own thread while the write armed
        /// by `arm` is held, lets the write go once it is done — or once it has waited 1 s for the
        /// write (as it does with the write gate) — and waits for it.
        fn while_held(
            &self,
            release: std::sync::mpsc::Sender<()>,
            invalidate: impl FnOnce(&NodeState) + Send + 'static,
        ) {
            let (done, finished) = std::sync::mpsc::channel();
            let state = self.state.clone();
            let racer = std::thread::spawn(move || {
                invalidate(&state);
                let _ = done.send(());
            });
            let _ = finished.recv_timeout(Duration::from_secs(1));
            release.send(()).unwrap();
            racer.join().unwrap();
        }

        fn unregister_and_register_again(&self) -> impl FnOnce(&NodeState) + Send + 'static {
            let a = self.a.clone();
            move |state: &NodeState| {
                state.unregister_namespace(&Principal::Operator, &a.id()).unwrap();
                state.register_namespace(&Principal::Operator, a).unwrap();
            }
        }

        /// Closes the demotion queue (what it holds written), drops the node and opens it again
        /// on the same directory.
        fn restart(self) -> (tempfile::TempDir, NodeState) {
            let Race { dir, state, rt, .. } = self;
            state.tiers().stop_demotion().unwrap();
            drop(rt);
            drop(Arc::into_inner(state).expect("nothing else holds the node"));
            let again = NodeState::open(Self::config(dir.path()), Self::addr()).unwrap();
            (dir, again)
        }

        /// Evicts `old` (of `a`) from DRAM, its demotion held in its disk write: DRAM is filled
        /// with blocks of `b` until the demotion thread is in that write.
        fn demotion_held(&self, old: &crate::dram::StoredBlock) -> std::sync::mpsc::Sender<()> {
            self.state.tiers().start_demotion(None);
            self.store(old);
            let (held, release) = self.fs.arm(self.a.id());
            for i in 0..256 {
                if held.try_recv().is_ok() {
                    return release;
                }
                self.store(&Self::block(&self.b, i));
            }
            held.recv_timeout(Duration::from_secs(10)).expect("the old block's demotion reached the disk");
            release
        }

        fn wait_for_demotions(&self) {
            let start = Instant::now();
            while self.state.tiers().demotion_depth() > 0 {
                assert!(start.elapsed() < Duration::from_secs(10), "the demotion queue drains");
                std::thread::sleep(Duration::from_millis(5));
            }
        }

        fn on_disk(state: &NodeState, b: &crate::dram::StoredBlock) -> bool {
            state.tiers().disk().unwrap().contains(&b.header.namespace, &b.header.key)
        }
    }

    /// A block of a namespace being demoted (its disk write in flight) when the namespace is
    /// unregistered and registered again does not come back under the new incarnation after a
    /// restart, while a block stored after the new registration does. Before, the write landed
    /// after the unregistration's mark, and recovery kept what lies after it.
    #[test]
    fn a_demotion_in_flight_at_an_unregistration_stays_gone_under_the_namespace_registered_again() {
        let race = Race::new();
        let (old, new) = (Race::block(&race.a, 1), Race::block(&race.a, 2));
        let release = race.demotion_held(&old);
        race.while_held(release, race.unregister_and_register_again());
        race.wait_for_demotions();
        race.store(&new);
        race.rt.block_on(race.state.tiers().persist(&race.a.id(), &[new.header.key], None)).unwrap();
        assert!(!Race::on_disk(&race.state, &old), "the old incarnation's block, in memory");
        assert!(Race::on_disk(&race.state, &new));
        let (_dir, again) = race.restart();
        assert!(!Race::on_disk(&again, &old), "the old incarnation's block came back after a restart");
        assert!(Race::on_disk(&again, &new), "the new incarnation's block is kept");
    }

    /// The same with a purge: the block being demoted is gone in memory, and stays gone after a
    /// restart (before, it came back: written after the purge's mark).
    #[test]
    fn a_demotion_in_flight_at_a_purge_stays_gone_after_a_restart() {
        let race = Race::new();
        let (old, new) = (Race::block(&race.a, 1), Race::block(&race.a, 2));
        let release = race.demotion_held(&old);
        let a = race.a.id();
        race.while_held(release, move |state| {
            state.purge_namespace(&Principal::Operator, &a).unwrap();
        });
        race.wait_for_demotions();
        race.store(&new);
        race.rt.block_on(race.state.tiers().persist(&a, &[new.header.key], None)).unwrap();
        assert!(!Race::on_disk(&race.state, &old), "a purged block, in memory");
        let (_dir, again) = race.restart();
        assert!(!Race::on_disk(&again, &old), "a purged block came back after a restart");
        assert!(Race::on_disk(&again, &new), "a block stored after the purge is kept");
    }

    /// A park's persist with a block write in flight when its namespace is unregistered and
    /// registered again fails (the namespace it gathered the blocks of is gone) and writes
    /// nothing more; none of its blocks is on disk, in memory or after a restart, while a block
    /// the new incarnation persists is. Before, the persist succeeded and both blocks came back
    /// under the new incarnation after a restart.
    #[test]
    fn a_persist_in_flight_at_an_unregistration_fails_and_leaves_nothing_behind() {
        let race = Race::new();
        let (first, second, new) = (Race::block(&race.a, 1), Race::block(&race.a, 2), Race::block(&race.a, 3));
        race.store(&first);
        race.store(&second);
        let (held, release) = race.fs.arm(race.a.id());
        let persist = {
            let (state, a) = (race.state.clone(), race.a.id());
            let keys = [first.header.key, second.header.key];
            race.rt.spawn(async move { state.tiers().persist(&a, &keys, None).await })
        };
        held.recv_timeout(Duration::from_secs(10)).expect("the persist's first write reached the disk");
        race.while_held(release, race.unregister_and_register_again());
        let res = race.rt.block_on(persist).unwrap();
        assert!(matches!(res, Err(ServerError::UnknownNamespace(id)) if id == race.a.id()), "{res:?}");
        race.store(&new);
        race.rt.block_on(race.state.tiers().persist(&race.a.id(), &[new.header.key], None)).unwrap();
        for b in [&first, &second] {
            assert!(!Race::on_disk(&race.state, b), "the old incarnation's block, in memory");
        }
        let (_dir, again) = race.restart();
        for b in [&first, &second] {
            assert!(!Race::on_disk(&again, b), "the old incarnation's block came back after a restart");
        }
        assert!(Race::on_disk(&again, &new), "the new incarnation's block is kept");
    }
}
