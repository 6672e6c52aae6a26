//! G3, the local disk (NVMe) tier: checksummed block frames appended to segment files under a
//! hard byte cap, an in-memory index rebuilt by scanning the segments at start, FIFO eviction by
//! whole segment, and pins for parked sessions.
//!
//! # Layout on disk
//! `<data_dir>/segments/seg-<id>.kvs`: records back to back, each a 128-byte frame header, the
//! payload, and zero padding up to a 4 KiB boundary (one aligned `pwrite` per record). A segment
//! grows to `segment_bytes`, is then sealed and a new one opened. The server holds
//! `<data_dir>/LOCK` (`flock`) for its life, so a second server on the same directory is refused.
//!
//! # Cap and eviction
//! The sum of segment file sizes never exceeds `capacity_bytes`: before a new segment is started,
//! the oldest sealed segments holding no pinned block are deleted (their blocks become misses)
//! until a whole segment, plus half a segment kept for compaction, fits. Pinned blocks (parked
//! sessions) keep their segment; when only such segments remain, the one pins hold least of (at
//! most half of it) is compacted: its pinned blocks are copied into the new segment, synced, and
//! only then is it deleted, so a few small sessions can't freeze the tier. When every segment is
//! mostly pinned the write fails with a capacity error. FIFO by segment wastes no space on
//! fragmentation and needs no tombstones.
//!
//! # Reads, corruption and recovery
//! A read is one `pread` of header + payload, verified (header checksum, key, payload checksum);
//! a mismatch removes the block from the index and is a miss, never wrong bytes. At start every
//! segment is scanned and every payload verified: a torn record (header valid, payload short or
//! not matching its checksum) is dropped and counted, and a segment is truncated after its last
//! whole record.
//!
//! # Writes and namespace marks
//! Nothing is deleted on disk: a namespace purged or unregistered is logged with a mark, the
//! write position then, and recovery drops its records before the mark (`crate::state`). So that
//! no record straddles a mark, a gate orders them: every block write holds its read side
//! ([`DiskTier::writes`]) — the caller's check that the block is still wanted, the write and its
//! indexing — and a mark is only taken holding its write side ([`DiskTier::hold_writes`]), kept
//! until the namespace is invalidated in memory. Every record of the namespace is then before the
//! mark, or was written by a writer that saw the invalidation (and skipped it).
//!
//! # Durability
//! All file work goes through [`crate::fs`]. The `segments` directory and every new segment's
//! name are synced when created. Each segment knows how far a sync covered it; [`DiskTier::sync`]
//! syncs every segment written past that. A failed sync forgets the segment's blocks past it and
//! seals the segment: the kernel may have dropped those writes, and a retried sync would report
//! success without them. Power loss is tested in `crate::crash_tests` on `fs::fault::FaultFs`.

pub mod recode;
mod segment;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use kvtier_proto::{BlockKey, FrameHeader, NamespaceId, TierId, FRAME_HEADER_LEN};
use parking_lot::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::dram::IndexKey;
use crate::error::ServerError;
use crate::fs::{FileSystem, FsFile, OpenMode, StdFs};
use segment::{align_up, hidden_header, scan_segment, segment_path, RECORD_ALIGN};

/// Disk tier settings.
#[derive(Debug, Clone)]
pub struct DiskConfig {
    pub dir: PathBuf,
    pub capacity_bytes: u64,
    /// Size at which a segment is sealed. Normalized to at most a quarter of the capacity.
    pub segment_bytes: u64,
    /// `fsync` each record before it counts as written (sessions always sync; see the server).
    pub sync_writes: bool,
}

/// Where a block lives.
#[derive(Debug, Clone, Copy)]
struct Loc {
    seg: u64,
    offset: u64,
    header: FrameHeader,
}

struct Segment {
    file: Arc<dyn FsFile>,
    /// Bytes written (records incl. padding); the file's size.
    len: u64,
    /// Bytes known durable: a sync covered them.
    synced: u64,
    /// A sync of it failed: no more records go into it (what it lost can't be made durable by
    /// syncing again).
    failed: bool,
    /// The key of every record in it, live or not (compaction's work list, and which namespaces
    /// still have copies here: [`DiskTier::oldest_segment_of`]).
    keys: Vec<IndexKey>,
}

struct Inner {
    index: HashMap<IndexKey, Loc>,
    segments: BTreeMap<u64, Segment>,
    active: u64,
    /// Bytes of the segment files (records, their headers and padding, dead ones until compacted).
    total_bytes: u64,
    /// Payload bytes of the blocks indexed.
    live: u64,
    pins: HashMap<IndexKey, u32>,
    pinned_bytes: u64,
    /// Segments holding records no sync covered yet: [`DiskTier::sync`] syncs them.
    dirty: BTreeSet<u64>,
    /// The account of each namespace that has one, and each account's live bytes and quota
    /// (see [`DiskTier::assign_account`]).
    ns_accounts: HashMap<NamespaceId, u32>,
    accounts: HashMap<u32, DiskAccount>,
}

/// One account's payload bytes indexed on disk, the bytes of its blocks queued to be written here
/// ([`DiskTier::reserve_demotion`]), and its quota.
#[derive(Debug, Default, Clone, Copy)]
struct DiskAccount {
    live: u64,
    /// Blocks indexed, and the payload bytes of those pinned (a tenant's `Stats`).
    blocks: u64,
    pinned: u64,
    queued: u64,
    quota: Option<u64>,
}

impl Inner {
    /// Whether segment `id` holds the current copy of a pinned block.
    fn holds_pins(&self, id: u64) -> bool {
        self.segments.get(&id).is_some_and(|seg| {
            seg.keys.iter().any(|k| self.pins.contains_key(k) && self.index.get(k).is_some_and(|l| l.seg == id))
        })
    }

    fn account_of(&self, ns: &NamespaceId) -> Option<u32> {
        self.ns_accounts.get(ns).copied()
    }

    /// Indexes a block not indexed before, counting it against its namespace's account.
    /// A key still pinned (a park's, whose copy went and came back) counts as pinned again, as
    /// [`Self::unindex`] uncounted it.
    fn index_new(&mut self, k: IndexKey, loc: Loc) {
        let len = loc.header.payload_len;
        let replaced = self.index.insert(k, loc).map(|o| o.header.payload_len);
        let old = replaced.unwrap_or(0);
        let pinned = self.pins.contains_key(&k);
        self.live = self.live.saturating_sub(old) + len;
        if pinned {
            self.pinned_bytes = self.pinned_bytes.saturating_sub(old) + len;
        }
        if let Some(a) = self.account_of(&k.0).and_then(|a| self.accounts.get_mut(&a)) {
            a.live = a.live.saturating_sub(old) + len;
            a.blocks += u64::from(replaced.is_none());
            if pinned {
                a.pinned = a.pinned.saturating_sub(old) + len;
            }
        }
    }

    /// Forgets a block, uncounting it.
    fn unindex(&mut self, k: &IndexKey) -> Option<Loc> {
        let loc = self.index.remove(k)?;
        // A pinned key's bytes leave the pinned counts with it (its pin stays, and counts again
        // if the key is written back; an unpin of it then takes nothing more).
        let pinned = self.pins.contains_key(k);
        if let Some(a) = self.account_of(&k.0).and_then(|a| self.accounts.get_mut(&a)) {
            a.live = a.live.saturating_sub(loc.header.payload_len);
            a.blocks = a.blocks.saturating_sub(1);
            if pinned {
                a.pinned = a.pinned.saturating_sub(loc.header.payload_len);
            }
        }
        if pinned {
            self.pinned_bytes = self.pinned_bytes.saturating_sub(loc.header.payload_len);
        }
        self.live = self.live.saturating_sub(loc.header.payload_len);
        Some(loc)
    }
}

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    writes: AtomicU64,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
    evicted_blocks: AtomicU64,
    evicted_segments: AtomicU64,
    corrupt: AtomicU64,
    write_errors: AtomicU64,
}

/// What recovery found at start.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    pub segments: u64,
    /// Blocks found, [`Self::deleted`] among them.
    pub blocks: u64,
    /// Blocks found that belonged to a namespace purged or unregistered before they were
    /// written over, forgotten again at start (the node's state counts them, not the scan).
    pub deleted: u64,
    pub bytes: u64,
    pub discarded: u64,
    pub millis: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DiskStats {
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub resident_bytes: u64,
    pub pinned_bytes: u64,
    pub blocks: u64,
    pub segments: u64,
    pub hits: u64,
    pub misses: u64,
    pub writes: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    pub evicted_blocks: u64,
    pub evicted_segments: u64,
    pub corrupt: u64,
    pub write_errors: u64,
}

pub struct DiskTier {
    cfg: DiskConfig,
    fs: Arc<dyn FileSystem>,
    seg_dir: PathBuf,
    inner: Mutex<Inner>,
    /// One writer at a time: appends are sequential within the active segment.
    write_lock: Mutex<()>,
    /// Orders block writes (read side, [`Self::writes`]) against namespace marks (write side,
    /// [`Self::hold_writes`]): see the module docs. Taken before `write_lock`.
    gate: RwLock<()>,
    counters: Counters,
    /// Told the keys of each segment evicted (KV events), under the tier's lock.
    observer: parking_lot::RwLock<Option<crate::dram::EvictionObserver>>,
}

impl std::fmt::Debug for DiskTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskTier").field("dir", &self.cfg.dir).finish()
    }
}

fn io_err(what: &str, path: &Path, e: std::io::Error) -> ServerError {
    ServerError::Io(std::io::Error::new(e.kind(), format!("{what} {}: {e}", path.display())))
}

impl DiskTier {
    /// Opens (or creates) the tier in `cfg.dir` and recovers its contents. The caller holds the
    /// directory's lock.
    pub fn open(cfg: DiskConfig) -> Result<(DiskTier, RecoveryReport), ServerError> {
        Self::open_with(cfg, StdFs::shared())
    }

    /// [`Self::open`] on the file system `fs`.
    pub fn open_with(mut cfg: DiskConfig, fs: Arc<dyn FileSystem>) -> Result<(DiskTier, RecoveryReport), ServerError> {
        if cfg.capacity_bytes < 4 * RECORD_ALIGN {
            return Err(ServerError::Config(format!("disk_capacity {} is too small", cfg.capacity_bytes)));
        }
        cfg.segment_bytes = cfg.segment_bytes.clamp(RECORD_ALIGN, (cfg.capacity_bytes / 4).max(RECORD_ALIGN));
        let seg_dir = cfg.dir.join("segments");
        // The directory's own name made durable too, or every segment in it could vanish with it.
        fs.create_dir_durable(&seg_dir)
            .map_err(|e| ServerError::Config(format!("disk tier directory {}: {e}", seg_dir.display())))?;
        let start = Instant::now();
        let mut ids: Vec<u64> = fs
            .list(&seg_dir)
            .map_err(|e| io_err("reading", &seg_dir, e))?
            .into_iter()
            .filter_map(|name| name.strip_prefix("seg-")?.strip_suffix(".kvs")?.parse().ok())
            .collect();
        ids.sort_unstable();
        let mut inner = Inner {
            index: HashMap::new(),
            segments: BTreeMap::new(),
            active: 0,
            total_bytes: 0,
            live: 0,
            pins: HashMap::new(),
            pinned_bytes: 0,
            dirty: BTreeSet::new(),
            ns_accounts: HashMap::new(),
            accounts: HashMap::new(),
        };
        let mut report = RecoveryReport::default();
        for id in ids {
            let path = segment_path(&seg_dir, id);
            let file = fs.open(&path, OpenMode::Existing).map_err(|e| io_err("opening", &path, e))?;
            let scanned = scan_segment(&*file).map_err(|e| io_err("scanning", &path, e))?;
            report.discarded += scanned.discarded;
            let mut keys = Vec::with_capacity(scanned.records.len());
            for (offset, header) in scanned.records {
                let k = (header.namespace, header.key);
                // A later copy of the same key (content-addressed: same bytes) wins.
                inner.live += header.payload_len;
                if let Some(old) = inner.index.insert(k, Loc { seg: id, offset, header }) {
                    inner.live = inner.live.saturating_sub(old.header.payload_len);
                }
                keys.push(k);
            }
            report.segments += 1;
            report.bytes += scanned.valid_len;
            inner.total_bytes += scanned.valid_len;
            // A truncated tail is made durable with the next sync (until then a power loss may
            // bring the torn bytes back, which the next scan drops again).
            if scanned.truncated {
                inner.dirty.insert(id);
            }
            let seg = Segment { file, len: scanned.valid_len, synced: scanned.valid_len, failed: false, keys };
            inner.segments.insert(id, seg);
            inner.active = id;
        }
        report.blocks = inner.index.len() as u64;
        report.millis = start.elapsed().as_millis() as u64;
        let tier = DiskTier {
            cfg,
            fs,
            seg_dir,
            inner: Mutex::new(inner),
            write_lock: Mutex::new(()),
            gate: RwLock::new(()),
            counters: Counters::default(),
            observer: parking_lot::RwLock::new(None),
        };
        tier.publish_gauges();
        ::metrics::counter!("kvtier_disk_discarded_blocks_total").increment(report.discarded);
        Ok((tier, report))
    }

    pub fn capacity(&self) -> u64 {
        self.cfg.capacity_bytes
    }

    /// The header of a block on disk, from the index (no I/O).
    pub fn header(&self, ns: &NamespaceId, key: &BlockKey) -> Option<FrameHeader> {
        self.inner.lock().index.get(&(*ns, *key)).map(|l| l.header)
    }

    pub fn contains(&self, ns: &NamespaceId, key: &BlockKey) -> bool {
        self.inner.lock().index.contains_key(&(*ns, *key))
    }

    /// Every block indexed, by namespace and key (a snapshot, taken under the index's lock).
    pub fn keys(&self) -> Vec<(NamespaceId, BlockKey)> {
        self.inner.lock().index.keys().copied().collect()
    }

    /// Sets `held[i]` for every `keys[i]` on disk (one lock for the batch).
    pub fn mark_indexed(&self, ns: &NamespaceId, keys: &[BlockKey], held: &mut [bool]) {
        let st = self.inner.lock();
        for (k, h) in keys.iter().zip(held.iter_mut()) {
            if !*h && st.index.contains_key(&(*ns, *k)) {
                *h = true;
            }
        }
    }

    fn publish_gauges(&self) {
        let st = self.inner.lock();
        ::metrics::gauge!("kvtier_tier_resident_bytes", "tier" => TierId::Disk.as_str()).set(st.live as f64);
        ::metrics::gauge!("kvtier_tier_allocated_bytes", "tier" => TierId::Disk.as_str()).set(st.total_bytes as f64);
        ::metrics::gauge!("kvtier_tier_capacity_bytes", "tier" => TierId::Disk.as_str())
            .set(self.cfg.capacity_bytes as f64);
        ::metrics::gauge!("kvtier_tier_blocks", "tier" => TierId::Disk.as_str()).set(st.index.len() as f64);
        ::metrics::gauge!("kvtier_tier_pinned_bytes", "tier" => TierId::Disk.as_str()).set(st.pinned_bytes as f64);
    }

    /// Creates the file of segment `id` (no lock held: creating a file can wait on the disk).
    fn create_segment(&self, id: u64) -> Result<Segment, ServerError> {
        let path = segment_path(&self.seg_dir, id);
        let file = self.fs.open(&path, OpenMode::CreateNew).map_err(|e| io_err("creating", &path, e))?;
        // The new name made durable, so a synced record in it can't vanish with its directory
        // entry after a power loss. If that fails the file goes again (the next roll creates it
        // anew and finds no stale name in its way).
        if let Err(e) = self.fs.sync_dir(&self.seg_dir) {
            let _ = self.fs.remove_file(&path);
            return Err(io_err("syncing", &self.seg_dir, e));
        }
        Ok(Segment { file, len: 0, synced: 0, failed: false, keys: Vec::new() })
    }

    /// Forgets the oldest sealed segment without pinned blocks and returns its id (the caller
    /// deletes its file after releasing the lock). `None` if there is none.
    fn evict_one(&self, st: &mut Inner) -> Option<u64> {
        let victim = st.segments.keys().copied().find(|&id| id != st.active && !st.holds_pins(id))?;
        self.evict(st, victim)
    }

    /// Forgets the segment being written if it holds no pinned block (the caller then starts a new
    /// one): the last resort where every sealed segment holds pinned blocks and none can be
    /// compacted. A tier of few segments (a small `disk_capacity`) would otherwise refuse every
    /// write with much of it unpinned. The caller holds the write lock, so nothing is being
    /// appended to it.
    fn evict_active(&self, st: &mut Inner) -> Option<u64> {
        let id = st.active;
        (st.segments.contains_key(&id) && !st.holds_pins(id)).then_some(())?;
        self.evict(st, id)
    }

    /// Forgets segment `id` and the blocks it held (the caller deletes its file).
    fn evict(&self, st: &mut Inner, id: u64) -> Option<u64> {
        let seg = st.segments.remove(&id)?;
        st.dirty.remove(&id);
        let mut gone = Vec::new();
        for k in &seg.keys {
            if st.index.get(k).is_some_and(|l| l.seg == id) {
                st.unindex(k);
                gone.push(*k);
            }
        }
        st.total_bytes -= seg.len;
        self.counted_evictions(&gone);
        Some(id)
    }

    /// One segment gone with `gone`, the blocks it still held: counted (`evicted_blocks`,
    /// `kvtier_tier_evictions_total{tier="disk"}`) and told to the eviction observer (KV events).
    fn counted_evictions(&self, gone: &[IndexKey]) {
        if !gone.is_empty() {
            if let Some(observe) = self.observer.read().clone() {
                observe(gone);
            }
        }
        let n = gone.len() as u64;
        self.counters.evicted_blocks.fetch_add(n, Ordering::Relaxed);
        self.counters.evicted_segments.fetch_add(1, Ordering::Relaxed);
        ::metrics::counter!("kvtier_tier_evictions_total", "tier" => TierId::Disk.as_str()).increment(n);
    }

    /// Sets (or clears) the observer told the keys of the blocks each evicted segment held.
    pub fn set_eviction_observer(&self, observer: Option<crate::dram::EvictionObserver>) {
        *self.observer.write() = observer;
    }

    /// Appends a block (no-op if present). The payload must match `header` (the caller verified it).
    /// A write whose block may have been purged or unregistered meanwhile checks that under
    /// [`Self::writes`] instead.
    pub fn write(&self, header: &FrameHeader, payload: &[u8]) -> Result<(), ServerError> {
        self.writes().write(header, payload)
    }

    /// The write gate's read side, for a writer to check that its block is still wanted (not
    /// purged, its namespace not unregistered) and write it with no mark taken in between: a
    /// namespace's mark waits until it is dropped. Costs an uncontended read lock per write (the
    /// write side is taken only by purges and unregistrations). Hold one at a time, and wait for
    /// nothing else while holding it.
    pub fn writes(&self) -> Writes<'_> {
        Writes { tier: self, _gate: self.gate.read() }
    }

    /// The write gate's write side: waits for the block writes in flight, then holds off every
    /// other until dropped. A namespace's mark ([`WritesHeld::mark`]) is taken holding it, and it
    /// is kept until the namespace is invalidated in memory (its blocks unindexed, what is queued
    /// for it dropped). No disk write may be waited for while it is held.
    pub fn hold_writes(&self) -> WritesHeld<'_> {
        WritesHeld { tier: self, _gate: self.gate.write() }
    }

    fn append(&self, header: &FrameHeader, payload: &[u8]) -> Result<(), ServerError> {
        let key = (header.namespace, header.key);
        let _w = self.write_lock.lock();
        let record = align_up(FRAME_HEADER_LEN as u64 + header.payload_len);
        if record > self.cfg.segment_bytes {
            return Err(ServerError::TooLarge { len: record, capacity: self.cfg.segment_bytes });
        }
        if let Some(at) = hidden_header(payload) {
            ::metrics::counter!("kvtier_disk_refused_hidden_frames_total").increment(1);
            tracing::warn!(at, "a block whose payload hides a frame header was not written to disk");
            return Err(ServerError::InvalidRequest(format!(
                "the block's payload holds a kvtier frame header at byte {at}: not written to disk"
            )));
        }
        let mut compacted = false;
        loop {
            // Under the index lock only bookkeeping: segment files are created and deleted with
            // just the write lock held, so readers and the DRAM eviction hook never wait on the disk.
            let roll = {
                let mut st = self.inner.lock();
                if st.index.contains_key(&key) {
                    return Ok(());
                }
                let full =
                    st.segments.get(&st.active).is_none_or(|s| s.failed || s.len + record > self.cfg.segment_bytes);
                full.then(|| {
                    // Room for a whole new segment first, so the cap holds however the segment fills,
                    // and for compaction's copies.
                    let mut doomed = Vec::new();
                    while st.total_bytes + self.cfg.segment_bytes + self.compaction_reserve() > self.cfg.capacity_bytes
                    {
                        match self.evict_one(&mut st) {
                            Some(id) => doomed.push(id),
                            None => return (doomed, false),
                        }
                    }
                    (doomed, true)
                })
            };
            let Some((doomed, room)) = roll else { break };
            for id in doomed {
                let _ = self.fs.remove_file(&segment_path(&self.seg_dir, id));
            }
            if !room {
                // Every sealed segment holds a pinned block: free the one pins hold least of.
                if !compacted && self.compact()? {
                    compacted = true;
                    continue;
                }
                // Or, where none can be, the full segment being written if nothing in it is pinned.
                let active = {
                    let mut st = self.inner.lock();
                    let len = st.segments.get(&st.active).map_or(0, |s| s.len);
                    let fits = st.total_bytes - len + self.cfg.segment_bytes + self.compaction_reserve()
                        <= self.cfg.capacity_bytes;
                    if fits {
                        self.evict_active(&mut st)
                    } else {
                        None
                    }
                };
                if let Some(id) = active {
                    let _ = self.fs.remove_file(&segment_path(&self.seg_dir, id));
                    self.roll_to_new_segment()?;
                    break;
                }
                let (pinned, used) = {
                    let st = self.inner.lock();
                    (st.pinned_bytes, st.total_bytes)
                };
                return Err(ServerError::Capacity(format!(
                    "the disk tier has no segment to evict: every segment holds blocks of parked sessions ({pinned} \
                     of its {used} bytes are pinned; a segment is compacted only while pins hold at most half of \
                     it): drop sessions or give the disk tier more room"
                )));
            }
            self.roll_to_new_segment()?;
            break;
        }
        let (file, offset, seg) = {
            let st = self.inner.lock();
            let active = st.active;
            let seg = st.segments.get(&active).ok_or_else(|| ServerError::Config("active segment vanished".into()))?;
            (seg.file.clone(), seg.len, active)
        };
        let buf = kvtier_proto::segment::encode_record(header, payload);
        let t = Instant::now();
        let write = || {
            file.write_all_at(&buf, offset).and_then(|_| if self.cfg.sync_writes { file.sync_data() } else { Ok(()) })
        };
        let mut res = write();
        if res.as_ref().is_err_and(|e| e.kind() == std::io::ErrorKind::StorageFull) {
            // The file system filled before the tier reached its capacity (other files on it, or a
            // capacity above its size): room is made out of the tier's own oldest unpinned
            // segment, as at its capacity, and the record written once more.
            let doomed = self.evict_one(&mut self.inner.lock());
            if let Some(id) = doomed {
                let _ = self.fs.remove_file(&segment_path(&self.seg_dir, id));
                ::metrics::counter!("kvtier_disk_full_evictions_total").increment(1);
                tracing::warn!("the disk tier's file system is full: evicted its oldest unpinned segment to write");
                res = write();
            }
        }
        ::metrics::histogram!("kvtier_disk_write_seconds").record(t.elapsed().as_secs_f64());
        if let Err(e) = res {
            self.counters.write_errors.fetch_add(1, Ordering::Relaxed);
            ::metrics::counter!("kvtier_errors_total", "kind" => "disk_write").increment(1);
            // Nothing was published; the next record overwrites whatever part of this one landed.
            return Err(ServerError::Io(e));
        }
        let mut st = self.inner.lock();
        if let Some(s) = st.segments.get_mut(&seg) {
            s.len = offset + record;
            if self.cfg.sync_writes {
                s.synced = s.len;
            }
            s.keys.push(key);
            if s.synced < s.len {
                st.dirty.insert(seg);
            }
            st.total_bytes += record;
            st.index_new(key, Loc { seg, offset, header: *header });
        }
        drop(st);
        self.counters.writes.fetch_add(1, Ordering::Relaxed);
        self.counters.bytes_in.fetch_add(header.payload_len, Ordering::Relaxed);
        ::metrics::counter!("kvtier_tier_bytes_in_total", "tier" => TierId::Disk.as_str())
            .increment(header.payload_len);
        self.publish_gauges();
        Ok(())
    }

    /// Room kept free for [`DiskTier::compact`]'s copies: half a segment (it only compacts segments
    /// pins hold at most half of).
    fn compaction_reserve(&self) -> u64 {
        align_up(self.cfg.segment_bytes / 2)
    }

    /// Seals the active segment and starts a new one (the caller holds the write lock).
    fn roll_to_new_segment(&self) -> Result<u64, ServerError> {
        let id = self.inner.lock().active + 1;
        let segment = self.create_segment(id)?;
        let mut st = self.inner.lock();
        // The sealed segment stays in `dirty` until a sync covers it.
        st.segments.insert(id, segment);
        st.active = id;
        Ok(id)
    }

    /// Frees the sealed segment whose pinned blocks are fewest in bytes (at most half of it):
    /// its pinned blocks are copied into a new segment, which is synced before the old one is
    /// deleted, so a pinned block is on disk, durably, at every moment. The cap holds throughout.
    /// False when no segment can be freed this way. The caller holds the write lock.
    fn compact(&self) -> Result<bool, ServerError> {
        let record_of = |l: &Loc| align_up(FRAME_HEADER_LEN as u64 + l.header.payload_len);
        let (victim, blocks, source) = {
            let st = self.inner.lock();
            // (segment, pinned record bytes, its pinned blocks)
            type Candidate = (u64, u64, Vec<(IndexKey, Loc)>);
            let mut best: Option<Candidate> = None;
            for (&id, seg) in &st.segments {
                if id == st.active {
                    continue;
                }
                let pinned: Vec<(IndexKey, Loc)> = seg
                    .keys
                    .iter()
                    .filter(|k| st.pins.contains_key(*k))
                    .filter_map(|k| st.index.get(k).filter(|l| l.seg == id).map(|l| (*k, *l)))
                    .collect();
                let bytes: u64 = pinned.iter().map(|(_, l)| record_of(l)).sum();
                if best.as_ref().is_none_or(|b| bytes < b.1) {
                    best = Some((id, bytes, pinned));
                }
            }
            let Some((id, bytes, pinned)) = best else { return Ok(false) };
            let seg_len = st.segments.get(&id).map_or(0, |s| s.len);
            let cap = self.cfg.capacity_bytes;
            // Worth it (half the segment or more comes free), within the cap while both copies
            // exist, and leaving room for the new segment to fill.
            if bytes * 2 > seg_len
                || st.total_bytes + bytes > cap
                || st.total_bytes - seg_len + self.cfg.segment_bytes + self.compaction_reserve() > cap
            {
                return Ok(false);
            }
            let source = st.segments.get(&id).map(|s| s.file.clone());
            (id, pinned, source)
        };
        let Some(source) = source else { return Ok(false) };
        let target = self.roll_to_new_segment()?;
        let file = {
            let st = self.inner.lock();
            st.segments.get(&target).map(|s| s.file.clone())
        };
        let Some(file) = file else { return Ok(false) };
        let mut moved = Vec::with_capacity(blocks.len());
        let mut offset = 0u64;
        for (k, loc) in &blocks {
            let len = record_of(loc);
            let mut buf = vec![0u8; len as usize];
            let read = source.read_exact_at(&mut buf, loc.offset);
            let end = FRAME_HEADER_LEN + loc.header.payload_len as usize;
            let sound = read.is_ok()
                && FrameHeader::decode(&buf).is_ok_and(|h| h == loc.header)
                && loc.header.verify_payload(&buf[FRAME_HEADER_LEN..end]).is_ok();
            if !sound {
                // Lost already: a read would have found it corrupt too.
                self.counters.corrupt.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            file.write_all_at(&buf, offset)?;
            moved.push((*k, Loc { seg: target, offset, header: loc.header }));
            offset += len;
        }
        file.sync_data()?;
        let doomed = {
            let mut st = self.inner.lock();
            for (k, new) in &moved {
                if st.index.get(k).is_some_and(|l| l.seg == victim) {
                    st.index.insert(*k, *new);
                }
            }
            if let Some(s) = st.segments.get_mut(&target) {
                s.len = offset;
                s.synced = offset;
                s.keys.extend(moved.iter().map(|(k, _)| *k));
            }
            st.total_bytes += offset;
            // A block of the victim pinned while it was being copied keeps the victim.
            let still_pinned = st.segments.get(&victim).is_some_and(|s| {
                s.keys.iter().any(|k| st.pins.contains_key(k) && st.index.get(k).is_some_and(|l| l.seg == victim))
            });
            if still_pinned {
                None
            } else {
                // Its unpinned blocks go with it: evictions, counted and told as a segment's are.
                let mut evicted = Vec::new();
                let seg = st.segments.remove(&victim);
                if let Some(seg) = &seg {
                    for k in &seg.keys {
                        if st.index.get(k).is_some_and(|l| l.seg == victim) {
                            st.unindex(k);
                            evicted.push(*k);
                        }
                    }
                    st.total_bytes -= seg.len;
                }
                seg.map(|_| (victim, evicted))
            }
        };
        let Some((victim, evicted)) = doomed else { return Ok(false) };
        let _ = self.fs.remove_file(&segment_path(&self.seg_dir, victim));
        self.counted_evictions(&evicted);
        ::metrics::counter!("kvtier_disk_compactions_total").increment(1);
        tracing::info!(
            segment = victim,
            relocated = moved.len(),
            evicted = evicted.len(),
            "disk segment compacted: its pinned blocks moved to a new segment, the others evicted"
        );
        self.publish_gauges();
        Ok(true)
    }

    /// Makes every write so far durable: syncs every segment holding records no sync covered yet.
    ///
    /// Safe to call concurrently: each call syncs every segment not known durable up to the length
    /// it saw, and a segment counts as durable only after a sync of it returned. A failed sync may
    /// have lost its writes for good (Linux reports a writeback error once, marks the pages clean,
    /// and a second fsync succeeds without them), so its segment's blocks past the last good sync
    /// are forgotten (a park writes them again from memory; otherwise they are misses) and the
    /// segment takes no more records.
    pub fn sync(&self) -> Result<(), ServerError> {
        let todo: Vec<(u64, Arc<dyn FsFile>, u64)> = {
            let st = self.inner.lock();
            st.dirty.iter().filter_map(|id| st.segments.get(id).map(|s| (*id, s.file.clone(), s.len))).collect()
        };
        for (id, file, len) in todo {
            let res = file.sync_data();
            let mut st = self.inner.lock();
            let st = &mut *st;
            let Some(seg) = st.segments.get_mut(&id) else {
                st.dirty.remove(&id);
                continue;
            };
            if let Err(e) = res {
                seg.failed = true;
                let synced = seg.synced;
                let doubtful: Vec<IndexKey> = seg
                    .keys
                    .iter()
                    .filter(|k| st.index.get(*k).is_some_and(|l| l.seg == id && l.offset >= synced))
                    .copied()
                    .collect();
                for k in &doubtful {
                    st.unindex(k);
                }
                st.dirty.remove(&id);
                self.counters.write_errors.fetch_add(1, Ordering::Relaxed);
                ::metrics::counter!("kvtier_errors_total", "kind" => "disk_sync").increment(1);
                tracing::error!(segment = id, forgotten = doubtful.len(), "disk segment fsync failed: {e}");
                return Err(io_err("syncing", &segment_path(&self.seg_dir, id), e));
            }
            // A segment another call's sync failed on stays doubtful, whatever this sync says.
            if !seg.failed {
                seg.synced = seg.synced.max(len);
            }
            if seg.failed || seg.synced >= seg.len {
                st.dirty.remove(&id);
            }
        }
        Ok(())
    }

    /// Reads and verifies a block. `None` is a miss (absent, or corrupt and now removed).
    pub fn read(&self, ns: &NamespaceId, key: &BlockKey) -> Option<(FrameHeader, Bytes)> {
        self.read_counted(ns, key, true)
    }

    /// [`Self::read`] for the node's own use (forwarded to a peer, handed off): no hit or miss
    /// counted — a tier's hits are what it served.
    pub fn read_for_node(&self, ns: &NamespaceId, key: &BlockKey) -> Option<(FrameHeader, Bytes)> {
        self.read_counted(ns, key, false)
    }

    /// A read that found nothing here, asked by a caller that checked the index first (so
    /// [`Self::read`] never ran to count it).
    pub fn count_miss(&self) {
        self.counters.misses.fetch_add(1, Ordering::Relaxed);
        ::metrics::counter!("kvtier_tier_misses_total", "tier" => TierId::Disk.as_str()).increment(1);
    }

    fn read_counted(&self, ns: &NamespaceId, key: &BlockKey, counted: bool) -> Option<(FrameHeader, Bytes)> {
        let k = (*ns, *key);
        let found = {
            let st = self.inner.lock();
            st.index.get(&k).and_then(|l| st.segments.get(&l.seg).map(|s| (*l, s.file.clone())))
        };
        let Some((loc, file)) = found else {
            if counted {
                self.count_miss();
            }
            return None;
        };
        let t = Instant::now();
        let len = FRAME_HEADER_LEN + loc.header.payload_len as usize;
        let mut buf = vec![0u8; len];
        let res = file.read_exact_at(&mut buf, loc.offset);
        ::metrics::histogram!("kvtier_disk_read_seconds").record(t.elapsed().as_secs_f64());
        let ok = res.is_ok()
            && FrameHeader::decode(&buf).is_ok_and(|h| h == loc.header)
            && loc.header.verify_payload(&buf[FRAME_HEADER_LEN..]).is_ok();
        if !ok {
            self.counters.corrupt.fetch_add(1, Ordering::Relaxed);
            ::metrics::counter!("kvtier_errors_total", "kind" => "disk_checksum").increment(1);
            tracing::error!(?key, seg = loc.seg, offset = loc.offset, "disk block failed verification; removed");
            let mut st = self.inner.lock();
            if st.index.get(&k).is_some_and(|l| l.seg == loc.seg && l.offset == loc.offset) {
                st.unindex(&k);
            }
            return None;
        }
        if counted {
            self.counters.hits.fetch_add(1, Ordering::Relaxed);
            self.counters.bytes_out.fetch_add(loc.header.payload_len, Ordering::Relaxed);
            ::metrics::counter!("kvtier_tier_hits_total", "tier" => TierId::Disk.as_str()).increment(1);
            ::metrics::counter!("kvtier_tier_bytes_out_total", "tier" => TierId::Disk.as_str())
                .increment(loc.header.payload_len);
        }
        let payload = Bytes::from(buf).slice(FRAME_HEADER_LEN..);
        Some((loc.header, payload))
    }

    /// Counts the blocks of `ns` (those held now, and every one written from now on) against
    /// `account`, whose quota of payload bytes is `quota` (none: no quota). A tenant at its quota
    /// gets no more of its evicted blocks demoted here ([`Self::over_quota`]), so it can't push
    /// other tenants' blocks off the disk.
    pub fn assign_account(&self, ns: NamespaceId, account: u32, quota: Option<u64>) {
        if let Some(q) = quota {
            self.set_account_quota(account, q);
        }
        let mut st = self.inner.lock();
        if st.ns_accounts.insert(ns, account).is_none() {
            let (mut held, mut blocks, mut pinned) = (0, 0, 0);
            for (k, l) in st.index.iter().filter(|(k, _)| k.0 == ns) {
                held += l.header.payload_len;
                blocks += 1;
                if st.pins.contains_key(k) {
                    pinned += l.header.payload_len;
                }
            }
            let a = st.accounts.entry(account).or_default();
            a.live += held;
            a.blocks += blocks;
            a.pinned += pinned;
        }
    }

    /// Whether the account of `ns` holds its quota or more here, counting its blocks queued to be
    /// written ([`Self::reserve_demotion`]).
    pub fn over_quota(&self, ns: &NamespaceId) -> bool {
        let st = self.inner.lock();
        st.account_of(ns)
            .and_then(|a| st.accounts.get(&a))
            .is_some_and(|a| a.quota.is_some_and(|q| a.live.saturating_add(a.queued) >= q))
    }

    /// Counts a block of `ns` of `bytes` queued to be written here against its account until
    /// [`Self::release_demotion`], unless that account holds its quota already with what it has
    /// here and queued (`false`: the block is not to be written). Without it, a burst of one
    /// tenant's evictions all passed the check before any was written, and the tenant ended a
    /// queue's worth of blocks past its quota.
    pub fn reserve_demotion(&self, ns: &NamespaceId, bytes: u64) -> bool {
        let mut st = self.inner.lock();
        let Some(a) = st.account_of(ns) else { return true };
        let acct = st.accounts.entry(a).or_default();
        if acct.quota.is_some_and(|q| acct.live.saturating_add(acct.queued) >= q) {
            return false;
        }
        acct.queued = acct.queued.saturating_add(bytes);
        true
    }

    /// A block [`Self::reserve_demotion`] counted is written (and counted as held) or dropped.
    pub fn release_demotion(&self, ns: &NamespaceId, bytes: u64) {
        let mut st = self.inner.lock();
        if let Some(a) = st.account_of(ns) {
            let acct = st.accounts.entry(a).or_default();
            acct.queued = acct.queued.saturating_sub(bytes);
        }
    }

    /// Payload bytes indexed here for `account`.
    pub fn account_live(&self, account: u32) -> u64 {
        self.inner.lock().accounts.get(&account).map_or(0, |a| a.live)
    }

    /// `account`'s (blocks indexed here, payload bytes of those pinned).
    pub fn account_blocks_and_pinned(&self, account: u32) -> (u64, u64) {
        self.inner.lock().accounts.get(&account).map_or((0, 0), |a| (a.blocks, a.pinned))
    }

    /// Sets `account`'s quota on this tier (`disk_bytes`).
    pub fn set_account_quota(&self, account: u32, bytes: u64) {
        self.inner.lock().accounts.entry(account).or_default().quota = Some(bytes);
    }

    /// `account`'s quota on this tier (`disk_bytes`), if it has one.
    pub fn account_quota(&self, account: u32) -> Option<u64> {
        self.inner.lock().accounts.get(&account).and_then(|a| a.quota)
    }

    /// Where the next record goes (segment, offset): every block written from now on lies at or
    /// after it. A mark is taken with [`WritesHeld::mark`].
    fn write_position(&self) -> (u64, u64) {
        let st = self.inner.lock();
        (st.active, st.segments.get(&st.active).map_or(0, |s| s.len))
    }

    /// The oldest segment holding a record of each namespace, indexed or not (a block forgotten
    /// at an unregistration stays in its segment, and recovery would find it again, until the
    /// segment goes). One pass over every record's key: it is asked once, at start.
    pub fn oldest_segment_of(&self) -> HashMap<NamespaceId, u64> {
        let st = self.inner.lock();
        let mut oldest = HashMap::new();
        for (&id, seg) in &st.segments {
            for key in &seg.keys {
                oldest.entry(key.0).or_insert(id);
            }
        }
        oldest
    }

    /// Forgets every unpinned block of `ns` whose copy lies before `mark` (a [`Self::write_position`]:
    /// copies written before a namespace was unregistered); returns how many.
    pub fn purge_namespace_before(&self, ns: &NamespaceId, mark: (u64, u64)) -> usize {
        let mut st = self.inner.lock();
        let gone: Vec<IndexKey> = st
            .index
            .iter()
            .filter(|(k, l)| k.0 == *ns && (l.seg, l.offset) < mark && !st.pins.contains_key(*k))
            .map(|(k, _)| *k)
            .collect();
        for k in &gone {
            st.unindex(k);
        }
        drop(st);
        self.publish_gauges();
        gone.len()
    }

    /// Forgets every unpinned block of a namespace (their bytes go with their segments); returns
    /// their keys.
    pub fn purge_namespace(&self, ns: &NamespaceId) -> Vec<BlockKey> {
        let mut st = self.inner.lock();
        let gone: Vec<IndexKey> =
            st.index.keys().filter(|k| k.0 == *ns && !st.pins.contains_key(*k)).copied().collect();
        for k in &gone {
            st.unindex(k);
        }
        drop(st);
        self.publish_gauges();
        gone.into_iter().map(|(_, k)| k).collect()
    }

    /// Forgets one block unless it is pinned; true if it was there and is gone.
    pub fn remove(&self, ns: &NamespaceId, key: &BlockKey) -> bool {
        let k = (*ns, *key);
        let mut st = self.inner.lock();
        if st.pins.contains_key(&k) {
            return false;
        }
        let removed = st.unindex(&k).is_some();
        drop(st);
        self.publish_gauges();
        removed
    }

    /// Pins blocks (all or nothing): pinned blocks keep their segment through eviction.
    pub fn pin(&self, ns: &NamespaceId, keys: &[BlockKey]) -> Result<(), ServerError> {
        let mut st = self.inner.lock();
        let missing: Vec<u32> = keys
            .iter()
            .enumerate()
            .filter(|(_, k)| !st.index.contains_key(&(*ns, **k)))
            .map(|(i, _)| i as u32)
            .collect();
        if !missing.is_empty() {
            return Err(ServerError::MissingBlocks { missing, missing_tail: false });
        }
        let mut seen = HashSet::new();
        for k in keys {
            let ik = (*ns, *k);
            let count = st.pins.entry(ik).or_insert(0);
            *count += 1;
            if *count == 1 && seen.insert(ik) {
                let len = st.index.get(&ik).map(|l| l.header.payload_len).unwrap_or(0);
                st.pinned_bytes += len;
                if let Some(a) = st.account_of(ns).and_then(|a| st.accounts.get_mut(&a)) {
                    a.pinned += len;
                }
            }
        }
        ::metrics::gauge!("kvtier_tier_pinned_bytes", "tier" => TierId::Disk.as_str()).set(st.pinned_bytes as f64);
        Ok(())
    }

    pub fn unpin(&self, ns: &NamespaceId, keys: &[BlockKey]) {
        let mut st = self.inner.lock();
        for k in keys {
            let ik = (*ns, *k);
            let gone = match st.pins.get_mut(&ik) {
                Some(c) => {
                    *c -= 1;
                    *c == 0
                }
                None => false,
            };
            if gone {
                st.pins.remove(&ik);
                let len = st.index.get(&ik).map(|l| l.header.payload_len).unwrap_or(0);
                st.pinned_bytes = st.pinned_bytes.saturating_sub(len);
                if let Some(a) = st.account_of(ns).and_then(|a| st.accounts.get_mut(&a)) {
                    a.pinned = a.pinned.saturating_sub(len);
                }
            }
        }
        ::metrics::gauge!("kvtier_tier_pinned_bytes", "tier" => TierId::Disk.as_str()).set(st.pinned_bytes as f64);
    }

    pub fn stats(&self) -> DiskStats {
        let st = self.inner.lock();
        let c = &self.counters;
        DiskStats {
            capacity_bytes: self.cfg.capacity_bytes,
            used_bytes: st.total_bytes,
            resident_bytes: st.live,
            pinned_bytes: st.pinned_bytes,
            blocks: st.index.len() as u64,
            segments: st.segments.len() as u64,
            hits: c.hits.load(Ordering::Relaxed),
            misses: c.misses.load(Ordering::Relaxed),
            writes: c.writes.load(Ordering::Relaxed),
            bytes_in: c.bytes_in.load(Ordering::Relaxed),
            bytes_out: c.bytes_out.load(Ordering::Relaxed),
            evicted_blocks: c.evicted_blocks.load(Ordering::Relaxed),
            evicted_segments: c.evicted_segments.load(Ordering::Relaxed),
            corrupt: c.corrupt.load(Ordering::Relaxed),
            write_errors: c.write_errors.load(Ordering::Relaxed),
        }
    }
}

/// A block writer's hold on the write gate's read side ([`DiskTier::writes`]).
pub struct Writes<'a> {
    tier: &'a DiskTier,
    _gate: RwLockReadGuard<'a, ()>,
}

impl Writes<'_> {
    /// [`DiskTier::write`], under this hold.
    pub fn write(&self, header: &FrameHeader, payload: &[u8]) -> Result<(), ServerError> {
        self.tier.append(header, payload)
    }
}

/// The write gate's write side ([`DiskTier::hold_writes`]): no block is written while it is held.
pub struct WritesHeld<'a> {
    tier: &'a DiskTier,
    _gate: RwLockWriteGuard<'a, ()>,
}

impl WritesHeld<'_> {
    /// Where the next record goes (segment, offset): every block written once this hold is
    /// dropped lies at or after it, and every one written before it lies before it.
    pub fn mark(&self) -> (u64, u64) {
        self.tier.write_position()
    }
}

#[cfg(test)]
mod tests;
