//! The G1 page pool: a capped set of device pages holding hot prefix blocks and live sessions'
//! blocks, keyed by (namespace, block key).
//!
//! - **Capacity** is fixed when the pool is built ([`Capacity`]: bytes, or a fraction of the
//!   device's free memory), carved as one device allocation of equal pages. Nothing grows later.
//! - **Eviction** is LRU over unpinned blocks. An evicted block that exists only here (it came
//!   from an engine's pages) is copied out and handed to the [`Spill`] target — G2 through the
//!   same-node path in the agent; a block that came from a tier is dropped (the tier still holds
//!   it): one inserted from the host ([`PagePool::insert_from_host`]), or one the agent promoted
//!   from a load and marked clean ([`PagePool::mark_clean`]). A failing spill is counted and the
//!   block dropped: G1 is a cache.
//! - **Encoding on the way out** ([`PoolConfig::with_spill_codec`], any codec with a device
//!   kernel: FP8, NVFP4 and their `+had` forms; [`PoolConfig::with_fp8_spill`] for FP8): the
//!   device kernel encodes the evicted page before it is copied out (the generic
//!   [`CodecOp::Encode`]), so the copy moves about half (FP8) or a quarter (NVFP4) of the bytes of
//!   a bf16 block, and the spill target gets exactly the payload `kvtier_kernels::encode` writes
//!   for that codec. A block the codec refuses (NaN, Inf) is spilled raw. On the way in,
//!   [`PagePool::insert_encoded_from_host`] copies such a payload's body to the device and
//!   decodes it there into the page ([`CodecOp::Decode`]).
//! - **Pins** keep a live session's blocks resident; when every page is pinned an insert is
//!   [`AgentError::PoolExhausted`] (the caller recomputes or spills elsewhere).
//! - **Loads** into an engine's pages are device-to-device copies on the pool's stream, which
//!   orders them after the insert that filled the page and before any eviction that reuses it.
//!
//! The pool is a plain `&mut self` structure (the agent owns it on one task). A spill runs inside
//! [`PagePool::insert_from_device`] when room must be made: it waits for the page's copy-out and
//! calls the spill target, which for the same-node path is a memcpy into a registered buffer.
//! With [`PoolConfig::with_deferred_spills`] the page is only copied out there: the copy waits
//! in [`PagePool::take_spills`] for the owner to hand to the spill target without holding the
//! pool (one slow spill then stalls nobody else's loads), and [`PagePool::spill_finished`] counts
//! it and reports the eviction.
//!
//! [`NodePool`] (`node.rs`) is one such pool per device of a node with the borrowing policy
//! carried out between them; each entry records its owner (the device whose engine the block came
//! from: [`PagePool::reserve_for`]) so a lender knows which of its pages are lent
//! ([`PagePool::held_by`], [`PagePool::evict_lent`]). Which pairs of devices are linked, and how
//! fast, [`find_links`] (`links.rs`) finds out: peer access turned on, and timed peer copies.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use kvtier_kernels::BlockSpec;
use kvtier_proto::{BlockKey, CodecId, DType, NamespaceId, ScopedKey};
use parking_lot::Mutex;

use crate::codec::{device_body_len, device_codec, payload_header, CODEC_ALIGN};
use crate::device::{CodecOp, Device, DeviceBuf, DeviceOrdinal, DeviceRange, HostBuffer, HostRange, Registration};
use crate::error::{AgentError, Result};

mod links;
mod node;
pub use links::{find_links, FoundLinks, LinkRate, Unlinked};
pub use node::{BorrowStats, LenderStats, NodeLink, NodePool};

/// Where evicted blocks go (G2 through the same-node client in the agent).
pub trait Spill: Send + Sync {
    /// Takes a copy of an evicted block: its payload under `codec` (`CodecId::RAW`: the engine's
    /// bytes exactly; otherwise a `kvtier_kernels` payload).
    fn spill(&self, ns: &NamespaceId, key: &BlockKey, codec: CodecId, payload: &[u8]) -> Result<()>;
}

/// An in-memory spill target: keeps every block it receives, in order. The trait's stand-in for
/// the server in tests and on a node without one.
#[derive(Debug, Default, Clone)]
pub struct MemorySpill {
    blocks: Arc<Mutex<Vec<SpilledBlock>>>,
}

/// A block a [`MemorySpill`] received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpilledBlock {
    pub key: ScopedKey,
    pub codec: CodecId,
    pub payload: Vec<u8>,
}

/// An evicted block copied out of its page, waiting to be handed to the spill target
/// ([`PoolConfig::with_deferred_spills`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingSpill {
    pub key: ScopedKey,
    /// The device whose pool evicted it.
    pub device: DeviceOrdinal,
    pub codec: CodecId,
    pub payload: Vec<u8>,
}

impl MemorySpill {
    /// Every block received so far, oldest first.
    pub fn received(&self) -> Vec<SpilledBlock> {
        self.blocks.lock().clone()
    }

    /// The latest payload received for a key.
    pub fn get(&self, ns: &NamespaceId, key: &BlockKey) -> Option<Vec<u8>> {
        self.blocks.lock().iter().rev().find(|b| b.key == (*ns, *key)).map(|b| b.payload.clone())
    }
}

impl Spill for MemorySpill {
    fn spill(&self, ns: &NamespaceId, key: &BlockKey, codec: CodecId, payload: &[u8]) -> Result<()> {
        self.blocks.lock().push(SpilledBlock { key: (*ns, *key), codec, payload: payload.to_vec() });
        Ok(())
    }
}

/// A change in what the pool holds, for the agent to report to the server (KV events).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolChange {
    /// The pool now holds this block.
    Stored(ScopedKey),
    /// The block left the pool; `below`: a tier under it still holds the bytes (it was loaded
    /// from one, or its spill succeeded), else they are gone.
    Evicted { key: ScopedKey, below: bool },
}

/// Changes kept for [`PagePool::take_changes`]; past this the oldest are dropped and the taker
/// is told to resync from [`PagePool::keys`].
pub const MAX_PENDING_CHANGES: usize = 1 << 16;

/// How big the pool is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Capacity {
    /// At most this many bytes (rounded down to whole pages).
    Bytes(usize),
    /// This fraction, in (0, 1], of the device's free memory when the pool is built.
    FractionOfFree(f64),
}

/// Pool settings.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolConfig {
    page_bytes: usize,
    capacity: Capacity,
    spill_codec: Option<SpillCodec>,
    deferred_spills: bool,
}

/// How evicted pages are encoded on the device ([`PoolConfig::with_spill_codec`]).
#[derive(Debug, Clone, Copy, PartialEq)]
struct SpillCodec {
    codec: CodecId,
    rotation_seed: u16,
    spec: BlockSpec,
}

impl PoolConfig {
    /// Pages of `page_bytes` (one block of the namespace's layout and codec).
    pub fn new(page_bytes: usize) -> Self {
        PoolConfig { page_bytes, capacity: Capacity::FractionOfFree(0.2), spill_codec: None, deferred_spills: false }
    }

    /// Evictions copy the page out and leave the spill to the owner ([`PagePool::take_spills`],
    /// then [`PagePool::spill_finished`]) instead of calling the spill target under `&mut self`.
    /// Default: off.
    pub fn with_deferred_spills(mut self) -> Self {
        self.deferred_spills = true;
        self
    }

    /// Encode evicted blocks as FP8 E4M3 (per-row scales) on the device before copying them
    /// out; every page holds one block of `spec` (bf16, fp16 or fp32, `spec.byte_len()` equal to
    /// the page size). Default: off (blocks are spilled raw).
    pub fn with_fp8_spill(self, spec: BlockSpec) -> Self {
        self.with_spill_codec(CodecId::FP8_E4M3, 0, spec)
    }

    /// Encode evicted blocks with `codec` (one with a device kernel: FP8, NVFP4 and their `+had`
    /// forms, `rotation_seed` used by the latter) on the device before copying them out; every
    /// page holds one block of `spec` (bf16, fp16 or fp32, `spec.byte_len()` equal to the page
    /// size). Default: off (blocks are spilled raw).
    pub fn with_spill_codec(mut self, codec: CodecId, rotation_seed: u16, spec: BlockSpec) -> Self {
        self.spill_codec = Some(SpillCodec { codec, rotation_seed, spec });
        self
    }

    /// Default: `Capacity::FractionOfFree(0.2)`.
    pub fn with_capacity(mut self, c: Capacity) -> Self {
        self.capacity = c;
        self
    }

    /// The number of pages for a device with `free` bytes free.
    fn pages(&self, free: usize) -> Result<usize> {
        if self.page_bytes == 0 {
            return Err(AgentError::Config("page size must be above zero".into()));
        }
        if let Some(SpillCodec { codec, spec, .. }) = &self.spill_codec {
            let name = codec.name();
            if !device_codec(*codec) {
                return Err(AgentError::Config(format!("no device kernel encodes {name} spills")));
            }
            spec.validate().map_err(|e| AgentError::Config(format!("{name} spill block: {e}")))?;
            if !matches!(spec.dtype, DType::Bf16 | DType::Fp16 | DType::Fp32) || spec.byte_len() != self.page_bytes {
                return Err(AgentError::Config(format!(
                    "{name} spill needs a bf16/fp16/fp32 block of the page size ({} bytes), got {spec:?}",
                    self.page_bytes
                )));
            }
        }
        let bytes = match self.capacity {
            Capacity::Bytes(b) => b,
            Capacity::FractionOfFree(f) if f > 0.0 && f <= 1.0 => (free as f64 * f) as usize,
            Capacity::FractionOfFree(f) => {
                return Err(AgentError::Config(format!("pool fraction {f} not in (0, 1]")));
            }
        };
        match bytes / self.page_bytes {
            0 => Err(AgentError::Config(format!("pool capacity {bytes} bytes holds no {}-byte page", self.page_bytes))),
            n => Ok(n),
        }
    }
}

/// Counters of a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolStats {
    pub pages: usize,
    pub resident: usize,
    pub pinned: usize,
    pub hits: u64,
    pub misses: u64,
    pub inserts: u64,
    pub evictions: u64,
    /// Evicted blocks handed to the spill target.
    pub spills: u64,
    /// Payload bytes handed to the spill target.
    pub spilled_bytes: u64,
    /// Spills encoded on the device.
    pub encoded_spills: u64,
    /// Blocks the device codec refused (NaN, Inf), spilled raw instead.
    pub raw_fallbacks: u64,
    /// Evicted blocks dropped because a tier already holds them.
    pub clean_drops: u64,
    pub spill_errors: u64,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    page: usize,
    pins: u32,
    tick: u64,
    /// A tier already holds these bytes (the block was loaded from one).
    clean: bool,
    /// Reserved for a save still being written layer by layer ([`PagePool::reserve`]): pinned,
    /// and invisible to loads until [`PagePool::commit`].
    filling: bool,
    /// The device whose engine the block came from: this pool's device, or a peer that borrowed
    /// the page ([`PagePool::reserve_for`]).
    owner: DeviceOrdinal,
}

/// The G1 page pool on one device.
///
/// ```
/// use std::sync::Arc;
/// use kvtier_agent::pool::{Capacity, MemorySpill, PagePool, PoolConfig};
/// use kvtier_agent::{Device, HostDevice};
/// use kvtier_proto::{BlockKey, NamespaceId};
///
/// let dev = Arc::new(HostDevice::new(0, 1 << 20));
/// let engine = dev.alloc(2 * 256).unwrap();
/// dev.write_sync(engine.range(0, 256), &[7; 256]).unwrap();
/// let cfg = PoolConfig::new(256).with_capacity(Capacity::Bytes(256)); // one page
/// let mut pool = PagePool::new(dev.clone(), MemorySpill::default(), cfg).unwrap();
/// let (ns, a, b) = (NamespaceId([1; 16]), BlockKey([1; 32]), BlockKey([2; 32]));
/// pool.insert_from_device(&ns, &a, engine.range(0, 256)).unwrap();
/// pool.insert_from_device(&ns, &b, engine.range(256, 256)).unwrap(); // evicts and spills `a`
/// assert_eq!(pool.spill_target().get(&ns, &a), Some(vec![7; 256]));
/// assert!(pool.load_into(&ns, &a, engine.range(256, 256)).unwrap().is_none());
/// ```
pub struct PagePool<D: Device, S: Spill> {
    device: Arc<D>,
    spill: S,
    slab: DeviceBuf,
    page_bytes: usize,
    pages: usize,
    free: Vec<usize>,
    index: HashMap<ScopedKey, Entry>,
    /// Unpinned blocks by last use (a pinned block leaves this map until its last unpin).
    lru: BTreeMap<u64, ScopedKey>,
    tick: u64,
    stream: D::Stream,
    staging: HostBuffer,
    _staging_reg: Registration,
    encoder: Option<Encoder>,
    stats: PoolStats,
    changes: VecDeque<PoolChange>,
    changes_lost: bool,
    deferred_spills: bool,
    /// Copied-out evictions waiting for [`PagePool::take_spills`] (deferred spills only).
    outbox: Vec<PendingSpill>,
    /// Pages held (resident or filling) per owner.
    held: HashMap<DeviceOrdinal, usize>,
}

/// Device scratch for coding a page on its way out or in: the body at 0, the status word at
/// `status_at`; and the codec's payload header.
struct Encoder {
    codec: CodecId,
    rotation_seed: u16,
    header: Vec<u8>,
    spec: BlockSpec,
    scratch: DeviceBuf,
    body_len: usize,
    status_at: usize,
}

impl<D: Device, S: Spill> PagePool<D, S> {
    /// Carves the pool out of `device` (one allocation) and a one-page registered staging buffer
    /// for spills.
    pub fn new(device: Arc<D>, spill: S, config: PoolConfig) -> Result<Self> {
        let pages = config.pages(device.mem_info()?.free)?;
        let bytes = pages
            .checked_mul(config.page_bytes)
            .ok_or_else(|| AgentError::Config(format!("{pages} pages of {} bytes overflow", config.page_bytes)))?;
        let slab = device.alloc(bytes)?;
        let mut encoder = None;
        let built = (|| {
            let mut staging_len = config.page_bytes;
            if let Some(SpillCodec { codec, rotation_seed, spec }) = config.spill_codec {
                let unknown = || AgentError::Config(format!("no device kernel for {}", codec.name()));
                let body_len = device_body_len(codec, &spec).ok_or_else(unknown)?;
                let header = payload_header(codec, &spec, rotation_seed).ok_or_else(unknown)?;
                let status_at = body_len.next_multiple_of(CODEC_ALIGN);
                let scratch = device.alloc(status_at + CODEC_ALIGN)?;
                encoder = Some(Encoder { codec, rotation_seed, header, spec, scratch, body_len, status_at });
                staging_len = staging_len.max(status_at + 4);
            }
            let stream = device.new_stream()?;
            let staging = HostBuffer::new(staging_len);
            let reg = device.register_host(&staging)?;
            Ok((stream, staging, reg))
        })();
        let (stream, staging, reg) = match built {
            Ok(v) => v,
            Err(e) => {
                let _ = device.free(slab);
                if let Some(enc) = encoder {
                    let _ = device.free(enc.scratch);
                }
                return Err(e);
            }
        };
        Ok(PagePool {
            device,
            spill,
            slab,
            page_bytes: config.page_bytes,
            pages,
            free: (0..pages).rev().collect(),
            index: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            stream,
            staging,
            _staging_reg: reg,
            encoder,
            stats: PoolStats { pages, ..PoolStats::default() },
            changes: VecDeque::new(),
            changes_lost: false,
            deferred_spills: config.deferred_spills,
            outbox: Vec::new(),
            held: HashMap::new(),
        })
    }

    pub fn page_bytes(&self) -> usize {
        self.page_bytes
    }

    pub fn pages(&self) -> usize {
        self.pages
    }

    pub fn stats(&self) -> PoolStats {
        PoolStats {
            resident: self.index.values().filter(|e| !e.filling).count(),
            pinned: self.index.values().filter(|e| e.pins > 0).count(),
            ..self.stats
        }
    }

    pub fn spill_target(&self) -> &S {
        &self.spill
    }

    pub fn contains(&self, ns: &NamespaceId, key: &BlockKey) -> bool {
        self.index.get(&(*ns, *key)).is_some_and(|e| !e.filling)
    }

    /// Whether the pool holds the key, resident or still filling.
    pub fn holds(&self, key: &ScopedKey) -> bool {
        self.index.contains_key(key)
    }

    /// Pages that hold nothing.
    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    /// Pages (resident or filling) holding blocks of `owner`'s engines: this pool's device's
    /// own, or a peer's that borrowed them.
    pub fn held_by(&self, owner: DeviceOrdinal) -> usize {
        self.held.get(&owner).copied().unwrap_or(0)
    }

    /// The owner of a block the pool holds.
    pub fn owner(&self, key: &ScopedKey) -> Option<DeviceOrdinal> {
        self.index.get(key).map(|e| e.owner)
    }

    fn put(&mut self, k: ScopedKey, e: Entry) {
        *self.held.entry(e.owner).or_default() += 1;
        if let Some(old) = self.index.insert(k, e) {
            self.unhold(old.owner);
        }
    }

    fn take(&mut self, k: &ScopedKey) -> Option<Entry> {
        let e = self.index.remove(k)?;
        self.unhold(e.owner);
        Some(e)
    }

    fn unhold(&mut self, owner: DeviceOrdinal) {
        if let Some(n) = self.held.get_mut(&owner) {
            *n -= 1;
            if *n == 0 {
                self.held.remove(&owner);
            }
        }
    }

    /// Every resident key (what the agent reports to the server).
    pub fn keys(&self) -> Vec<ScopedKey> {
        self.index.iter().filter(|(_, e)| !e.filling).map(|(k, _)| *k).collect()
    }

    fn note(&mut self, c: PoolChange) {
        if self.changes.len() >= MAX_PENDING_CHANGES {
            self.changes.pop_front();
            self.changes_lost = true;
        }
        self.changes.push_back(c);
    }

    /// The changes since the last call, oldest first, and whether some were dropped (more than
    /// [`MAX_PENDING_CHANGES`] piled up): then resync from [`PagePool::keys`].
    pub fn take_changes(&mut self) -> (Vec<PoolChange>, bool) {
        let lost = std::mem::take(&mut self.changes_lost);
        (self.changes.drain(..).collect(), lost)
    }

    /// Reserves a page for a block that an engine saves layer by layer (copies into slices of
    /// the page on the caller's own stream): the page is pinned and the block invisible to loads
    /// until [`PagePool::commit`]; [`PagePool::abort`] gives the page back. `Ok(None)` when the
    /// pool already holds the key, or another save is filling it (content-addressed: the same
    /// key is the same bytes, so nothing needs copying). May evict (and spill) to make room;
    /// [`AgentError::PoolExhausted`] when every page is pinned.
    pub fn reserve(&mut self, ns: &NamespaceId, key: &BlockKey) -> Result<Option<DeviceRange>> {
        self.reserve_for(ns, key, self.device.ordinal())
    }

    /// [`PagePool::reserve`] for a block of `owner`'s engine (a peer GPU borrowing the page when
    /// `owner` is not this pool's device).
    pub fn reserve_for(
        &mut self,
        ns: &NamespaceId,
        key: &BlockKey,
        owner: DeviceOrdinal,
    ) -> Result<Option<DeviceRange>> {
        let k = (*ns, *key);
        if self.index.contains_key(&k) {
            self.touch(k);
            return Ok(None);
        }
        let page = self.take_page()?;
        let tick = self.next_tick();
        self.put(k, Entry { page, pins: 1, tick, clean: false, filling: true, owner });
        Ok(Some(self.page_range(page)))
    }

    /// Makes a reserved block a resident one: visible to loads, evictable (most recently used),
    /// spilled when evicted. Call once every copy into its page has completed.
    pub fn commit(&mut self, ns: &NamespaceId, key: &BlockKey) -> Result<()> {
        let k = (*ns, *key);
        let e = self.index.get_mut(&k).filter(|e| e.filling).ok_or(AgentError::NotResident)?;
        e.filling = false;
        e.pins -= 1;
        let evictable = e.pins == 0;
        self.stats.inserts += 1;
        self.note(PoolChange::Stored(k));
        if evictable {
            let t = self.next_tick();
            if let Some(e) = self.index.get_mut(&k) {
                e.tick = t;
            }
            self.lru.insert(t, k);
        }
        Ok(())
    }

    /// Gives a reserved page back (the save failed or its engine went away). Wait for the copies
    /// into the page first, or let them land in a free page no one reads.
    pub fn abort(&mut self, ns: &NamespaceId, key: &BlockKey) -> Result<()> {
        let k = (*ns, *key);
        let e = self.index.get(&k).copied().filter(|e| e.filling).ok_or(AgentError::NotResident)?;
        self.take(&k);
        self.free.push(e.page);
        Ok(())
    }

    fn page_range(&self, page: usize) -> DeviceRange {
        self.slab.range(page * self.page_bytes, self.page_bytes)
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    fn touch(&mut self, k: ScopedKey) {
        let t = self.next_tick();
        if let Some(e) = self.index.get_mut(&k) {
            if e.pins == 0 {
                self.lru.remove(&e.tick);
                self.lru.insert(t, k);
            }
            e.tick = t;
        }
    }

    /// A free page, evicting the least recently used unpinned block if there is none.
    fn take_page(&mut self) -> Result<usize> {
        if let Some(p) = self.free.pop() {
            return Ok(p);
        }
        let (_, victim) = self.lru.pop_first().ok_or(AgentError::PoolExhausted { pages: self.pages })?;
        self.evict(victim)
    }

    /// Evicts the least recently used unpinned block a peer borrowed its page for (spilled like
    /// any eviction), leaving a free page: the lender taking its share back. False when no such
    /// block can be evicted.
    pub fn evict_lent(&mut self) -> Result<bool> {
        let own = self.device.ordinal();
        let found = self.lru.iter().find(|(_, k)| self.index.get(*k).is_some_and(|e| e.owner != own));
        let Some((&tick, &victim)) = found else { return Ok(false) };
        self.lru.remove(&tick);
        let page = self.evict(victim)?;
        self.free.push(page);
        Ok(true)
    }

    /// Takes an unpinned block (already out of the LRU) out of the pool, spilling it or queueing
    /// its spill; returns its page.
    fn evict(&mut self, victim: ScopedKey) -> Result<usize> {
        let entry = self.take(&victim).ok_or(AgentError::NotResident)?;
        self.stats.evictions += 1;
        let below = if entry.clean {
            self.stats.clean_drops += 1;
            true
        } else if self.deferred_spills {
            match self.stage(entry.page) {
                Ok((codec, payload)) => {
                    // Reported once the owner's spill finished.
                    let device = self.device.ordinal();
                    self.outbox.push(PendingSpill { key: victim, device, codec, payload });
                    return Ok(entry.page);
                }
                Err(_) => {
                    self.stats.spill_errors += 1;
                    false
                }
            }
        } else {
            self.spill_page(&victim, entry.page)
        };
        self.note(PoolChange::Evicted { key: victim, below });
        Ok(entry.page)
    }

    /// The evictions copied out since the last call, for the owner to spill without holding the
    /// pool (deferred spills; empty otherwise).
    pub fn take_spills(&mut self) -> Vec<PendingSpill> {
        std::mem::take(&mut self.outbox)
    }

    /// Counts a deferred spill the owner made (`ok`: the target took it) and reports the
    /// eviction.
    pub fn spill_finished(&mut self, s: &PendingSpill, ok: bool) {
        if ok {
            self.stats.spills += 1;
            self.stats.spilled_bytes += s.payload.len() as u64;
            if s.codec != CodecId::RAW {
                self.stats.encoded_spills += 1;
            }
        } else {
            self.stats.spill_errors += 1;
        }
        self.note(PoolChange::Evicted { key: s.key, below: ok });
    }

    /// A page's bytes on their way out: encoded on the device when configured (and the codec
    /// takes them), else raw.
    fn stage(&mut self, page: usize) -> Result<(CodecId, Vec<u8>)> {
        self.stage_encoded(page).transpose().unwrap_or_else(|| self.stage_raw(page))
    }

    /// Copies a page out (encoded on the device when configured) and hands it to the spill
    /// target; failures are counted, not returned (the block is dropped either way). Whether the
    /// spill target took it.
    fn spill_page(&mut self, key: &ScopedKey, page: usize) -> bool {
        let staged = self.stage(page);
        let sent = staged.and_then(|(codec, payload)| {
            self.spill.spill(&key.0, &key.1, codec, &payload).map(|()| (codec, payload.len()))
        });
        match sent {
            Ok((codec, n)) => {
                self.stats.spills += 1;
                self.stats.spilled_bytes += n as u64;
                if codec != CodecId::RAW {
                    self.stats.encoded_spills += 1;
                }
                true
            }
            Err(_) => {
                self.stats.spill_errors += 1;
                false
            }
        }
    }

    fn stage_raw(&self, page: usize) -> Result<(CodecId, Vec<u8>)> {
        self.device.copy_d2h(&self.stream, self.page_range(page), &self.staging.range(0, self.page_bytes))?;
        self.device.wait(&self.device.record(&self.stream)?)?;
        let mut out = vec![0u8; self.page_bytes];
        self.staging.read(0, &mut out)?;
        Ok((CodecId::RAW, out))
    }

    /// The page as a payload of the spill codec, encoded on the device; `Ok(None)` when not
    /// configured or when the codec refused the block (counted; the caller spills it raw).
    fn stage_encoded(&mut self, page: usize) -> Result<Option<(CodecId, Vec<u8>)>> {
        let Some(enc) = &self.encoder else { return Ok(None) };
        let (body, status) = (enc.scratch.range(0, enc.body_len), enc.scratch.range(enc.status_at, 4));
        let op = CodecOp::Encode {
            codec: enc.codec,
            rotation_seed: enc.rotation_seed,
            spec: enc.spec,
            src: self.page_range(page),
            body,
            status,
        };
        self.device.launch_codec(&self.stream, &op)?;
        self.device.copy_d2h(&self.stream, body, &self.staging.range(0, enc.body_len))?;
        self.device.copy_d2h(&self.stream, status, &self.staging.range(enc.status_at, 4))?;
        self.device.wait(&self.device.record(&self.stream)?)?;
        let mut word = [0u8; 4];
        self.staging.read(enc.status_at, &mut word)?;
        if word != [0; 4] {
            self.stats.raw_fallbacks += 1;
            return Ok(None);
        }
        let codec = enc.codec;
        let mut payload = enc.header.clone();
        let header = payload.len();
        payload.resize(header + enc.body_len, 0);
        self.staging.read(0, &mut payload[header..])?;
        Ok(Some((codec, payload)))
    }

    fn insert_with(
        &mut self,
        ns: &NamespaceId,
        key: &BlockKey,
        len: usize,
        clean: bool,
        copy: impl FnOnce(&D, &D::Stream, DeviceRange) -> Result<()>,
    ) -> Result<D::Event> {
        if len != self.page_bytes {
            return Err(AgentError::PageSizeMismatch { len, page: self.page_bytes });
        }
        let k = (*ns, *key);
        if self.index.contains_key(&k) {
            // Content-addressed: the same key holds the same bytes.
            self.touch(k);
            return self.device.record(&self.stream);
        }
        let page = self.take_page()?;
        if let Err(e) = copy(&self.device, &self.stream, self.page_range(page)) {
            self.free.push(page);
            return Err(e);
        }
        let tick = self.next_tick();
        let owner = self.device.ordinal();
        self.put(k, Entry { page, pins: 0, tick, clean, filling: false, owner });
        self.lru.insert(tick, k);
        self.stats.inserts += 1;
        self.note(PoolChange::Stored(k));
        self.device.record(&self.stream)
    }

    /// Keeps a copy of an engine's page (a block only the engine has: spilled when evicted).
    /// Returns the event of the copy.
    pub fn insert_from_device(&mut self, ns: &NamespaceId, key: &BlockKey, src: DeviceRange) -> Result<D::Event> {
        self.insert_with(ns, key, src.len, false, |d, s, dst| d.copy_d2d(s, src, dst))
    }

    /// Keeps a block loaded from a tier (staged in host memory): dropped, not spilled, when
    /// evicted.
    pub fn insert_from_host(&mut self, ns: &NamespaceId, key: &BlockKey, src: &HostRange) -> Result<D::Event> {
        self.insert_with(ns, key, src.len, true, |d, s, dst| d.copy_h2d(s, src, dst))
    }

    /// Keeps a block that a tier holds as a payload of the pool's spill codec
    /// (`kvtier_kernels::encode` with that codec and rotation seed, staged in host memory): its
    /// body is copied to the device and decoded there into the page, so the copy moves the
    /// smaller bytes. Needs [`PoolConfig::with_spill_codec`] (or `with_fp8_spill`) and a payload
    /// of exactly that block shape. Waits for the decode: a payload the device refuses (a NaN
    /// code, a bad scale) is an error and leaves no entry.
    pub fn insert_encoded_from_host(&mut self, ns: &NamespaceId, key: &BlockKey, payload: &HostRange) -> Result<()> {
        let Some(enc) = &self.encoder else {
            return Err(AgentError::Config("the pool was built without a spill codec (with_spill_codec)".into()));
        };
        let (codec, rotation_seed, spec) = (enc.codec, enc.rotation_seed, enc.spec);
        let (body_len, status_at, scratch, header) = (enc.body_len, enc.status_at, enc.scratch, enc.header.clone());
        let name = codec.name();
        if payload.len != header.len() + body_len {
            return Err(AgentError::Codec(format!(
                "{name} payload is {} bytes, {} expected",
                payload.len,
                header.len() + body_len
            )));
        }
        let mut got = vec![0u8; header.len()];
        payload.buf.read(payload.offset, &mut got)?;
        if got != header {
            return Err(AgentError::Codec(format!("payload is not a {name} payload of the pool's block shape")));
        }
        let k = (*ns, *key);
        if self.index.contains_key(&k) {
            self.touch(k);
            return Ok(());
        }
        let page = self.take_page()?;
        let (body, status) = (scratch.range(0, body_len), scratch.range(status_at, 4));
        let decoded = (|| {
            self.device.copy_h2d(&self.stream, &payload.buf.range(payload.offset + header.len(), body_len), body)?;
            let op = CodecOp::Decode { codec, rotation_seed, spec, body, out: self.page_range(page), status };
            self.device.launch_codec(&self.stream, &op)?;
            self.device.copy_d2h(&self.stream, status, &self.staging.range(status_at, 4))?;
            self.device.wait(&self.device.record(&self.stream)?)?;
            let mut word = [0u8; 4];
            self.staging.read(status_at, &mut word)?;
            if word != [0; 4] {
                return Err(AgentError::Codec(format!("the device refused the {name} body (NaN code or bad scale)")));
            }
            Ok(())
        })();
        if let Err(e) = decoded {
            self.free.push(page);
            return Err(e);
        }
        let tick = self.next_tick();
        let owner = self.device.ordinal();
        self.put(k, Entry { page, pins: 0, tick, clean: true, filling: false, owner });
        self.lru.insert(tick, k);
        self.stats.inserts += 1;
        self.note(PoolChange::Stored(k));
        Ok(())
    }

    /// Copies a resident block into an engine's page (device to device); `None` on a miss.
    pub fn load_into(&mut self, ns: &NamespaceId, key: &BlockKey, dst: DeviceRange) -> Result<Option<D::Event>> {
        if dst.len != self.page_bytes {
            return Err(AgentError::PageSizeMismatch { len: dst.len, page: self.page_bytes });
        }
        let k = (*ns, *key);
        let Some(page) = self.index.get(&k).filter(|e| !e.filling).map(|e| e.page) else {
            self.stats.misses += 1;
            return Ok(None);
        };
        self.device.copy_d2d(&self.stream, self.page_range(page), dst)?;
        let ev = self.device.record(&self.stream)?;
        self.stats.hits += 1;
        self.touch(k);
        Ok(Some(ev))
    }

    /// Pins a resident block and returns its page, for a layer-pipelined load that copies
    /// slices of it on another stream (the [`crate::pipeline`]'s `DeviceToDevice` transfers). The
    /// pin keeps the page from being evicted and reused under the copy: [`PagePool::unpin`] it
    /// once the load's events have completed. Counts as a hit; a miss is `Ok(None)`.
    pub fn pin_for_load(&mut self, ns: &NamespaceId, key: &BlockKey) -> Result<Option<DeviceRange>> {
        let Some(page) = self.index.get(&(*ns, *key)).filter(|e| !e.filling).map(|e| e.page) else {
            self.stats.misses += 1;
            return Ok(None);
        };
        self.pin(ns, key)?;
        self.stats.hits += 1;
        Ok(Some(self.page_range(page)))
    }

    /// Pins a resident block (a live session's); returns its pin count.
    pub fn pin(&mut self, ns: &NamespaceId, key: &BlockKey) -> Result<u32> {
        let e = self.index.get_mut(&(*ns, *key)).filter(|e| !e.filling).ok_or(AgentError::NotResident)?;
        if e.pins == 0 {
            self.lru.remove(&e.tick);
        }
        e.pins += 1;
        Ok(e.pins)
    }

    /// Drops one pin; at zero the block is evictable again (as most recently used).
    pub fn unpin(&mut self, ns: &NamespaceId, key: &BlockKey) -> Result<u32> {
        let k = (*ns, *key);
        let e = self.index.get_mut(&k).filter(|e| !e.filling).ok_or(AgentError::NotResident)?;
        if e.pins == 0 {
            return Err(AgentError::NotPinned);
        }
        e.pins -= 1;
        let left = e.pins;
        if left == 0 {
            let t = self.next_tick();
            if let Some(e) = self.index.get_mut(&k) {
                e.tick = t;
            }
            self.lru.insert(t, k);
        }
        Ok(left)
    }

    /// A resident block's bytes as they are (raw), copied out to the host — for a spill asked
    /// for by the server (a read wants a block only G1 holds). `Ok(None)` when not resident.
    pub fn copy_out(&mut self, ns: &NamespaceId, key: &BlockKey) -> Result<Option<Vec<u8>>> {
        let Some(page) = self.index.get(&(*ns, *key)).filter(|e| !e.filling).map(|e| e.page) else {
            return Ok(None);
        };
        self.stage_raw(page).map(|(_, bytes)| Some(bytes))
    }

    /// Notes that a tier below now holds a resident block's bytes (it was spilled on demand): an
    /// eviction drops it instead of spilling it again. False when it is not resident.
    pub fn mark_clean(&mut self, ns: &NamespaceId, key: &BlockKey) -> bool {
        match self.index.get_mut(&(*ns, *key)) {
            Some(e) => {
                e.clean = true;
                true
            }
            None => false,
        }
    }

    /// Forgets a block without spilling it (e.g. its namespace was purged). Pinned blocks stay.
    pub fn remove(&mut self, ns: &NamespaceId, key: &BlockKey) -> Result<()> {
        let k = (*ns, *key);
        let e = self.index.get(&k).copied().ok_or(AgentError::NotResident)?;
        if e.pins > 0 {
            return Err(AgentError::Pinned);
        }
        self.take(&k);
        self.lru.remove(&e.tick);
        self.free.push(e.page);
        self.note(PoolChange::Evicted { key: k, below: false });
        Ok(())
    }
}

impl<D: Device, S: Spill> Drop for PagePool<D, S> {
    fn drop(&mut self) {
        // Never panics: a failed free is the device's to report, not ours.
        let _ = self.device.free(self.slab);
        if let Some(enc) = &self.encoder {
            let _ = self.device.free(enc.scratch);
        }
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod model_tests;
