//! The G1 page pool: a capped set of device pages holding hot prefix blocks and live sessions'
//! blocks, keyed by (namespace, block key).
//!
//! - **Capacity** is fixed when the pool is built ([`Capacity`]: bytes, or a fraction of the
//!   device's free memory), carved as one device allocation of equal pages. Nothing grows later.
//! - **Eviction** is LRU over unpinned blocks. An evicted block that exists only here (it came
//!   from an engine's pages) is copied out and handed to the [`Spill`] target — G2 through the
//!   same-node path in the agent; a block that came from a tier is dropped (the tier still holds
//!   it). A failing spill is counted and the block dropped: G1 is a cache.
//! - **Encoding on the way out** ([`PoolConfig::with_fp8_spill`]): the device's FP8 kernel
//!   encodes the evicted page before it is copied out, so the copy moves about half the bytes of
//!   a bf16 block, and the spill target gets exactly the payload `kvtier_kernels::encode` writes
//!   for `CodecId::FP8_E4M3`. A block the codec refuses (NaN, Inf) is spilled raw. On the way
//!   in, [`PagePool::insert_fp8_from_host`] copies such a payload's body to the device and
//!   decodes it there into the page.
//! - **Pins** keep a live session's blocks resident; when every page is pinned an insert is
//!   [`AgentError::PoolExhausted`] (the caller recomputes or spills elsewhere).
//! - **Loads** into an engine's pages are device-to-device copies on the pool's stream, which
//!   orders them after the insert that filled the page and before any eviction that reuses it.
//!
//! The pool is a plain `&mut self` structure (the agent owns it on one task). A spill runs inside
//! [`PagePool::insert_from_device`] when room must be made: it waits for the page's copy-out and
//! calls the spill target, which for the same-node path is a memcpy into a registered buffer.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use kvtier_kernels::BlockSpec;
use kvtier_proto::{BlockKey, CodecId, DType, NamespaceId, ScopedKey};
use parking_lot::Mutex;

use crate::codec::{fp8_payload_header, CODEC_ALIGN};
use crate::device::{fp8_body_len, CodecOp, Device, DeviceBuf, DeviceRange, HostBuffer, HostRange, Registration};
use crate::error::{AgentError, Result};

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
    fp8_spill: Option<BlockSpec>,
}

impl PoolConfig {
    /// Pages of `page_bytes` (one block of the namespace's layout and codec).
    pub fn new(page_bytes: usize) -> Self {
        PoolConfig { page_bytes, capacity: Capacity::FractionOfFree(0.2), fp8_spill: None }
    }

    /// Encode evicted blocks as FP8 E4M3 (per-row scales) on the device before copying them
    /// out; every page holds one block of `spec` (bf16, fp16 or fp32, `spec.byte_len()` equal to
    /// the page size). Default: off (blocks are spilled raw).
    pub fn with_fp8_spill(mut self, spec: BlockSpec) -> Self {
        self.fp8_spill = Some(spec);
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
        if let Some(spec) = &self.fp8_spill {
            spec.validate().map_err(|e| AgentError::Config(format!("FP8 spill block: {e}")))?;
            if !matches!(spec.dtype, DType::Bf16 | DType::Fp16 | DType::Fp32) || spec.byte_len() != self.page_bytes {
                return Err(AgentError::Config(format!(
                    "FP8 spill needs a bf16/fp16/fp32 block of the page size ({} bytes), got {spec:?}",
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
}

/// Device scratch for coding a page on its way out or in: the body at 0, the status word at
/// `status_at`.
struct Encoder {
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
            if let Some(spec) = config.fp8_spill {
                let body_len = fp8_body_len(&spec);
                let status_at = body_len.next_multiple_of(CODEC_ALIGN);
                let scratch = device.alloc(status_at + CODEC_ALIGN)?;
                encoder = Some(Encoder { spec, scratch, body_len, status_at });
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
            resident: self.index.len(),
            pinned: self.index.values().filter(|e| e.pins > 0).count(),
            ..self.stats
        }
    }

    pub fn spill_target(&self) -> &S {
        &self.spill
    }

    pub fn contains(&self, ns: &NamespaceId, key: &BlockKey) -> bool {
        self.index.contains_key(&(*ns, *key))
    }

    /// Every resident key (what the agent reports to the server).
    pub fn keys(&self) -> Vec<ScopedKey> {
        self.index.keys().copied().collect()
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
        let entry = self.index.remove(&victim).ok_or(AgentError::NotResident)?;
        self.stats.evictions += 1;
        if entry.clean {
            self.stats.clean_drops += 1;
        } else {
            self.spill_page(&victim, entry.page);
        }
        Ok(entry.page)
    }

    /// Copies a page out (encoded on the device when configured) and hands it to the spill
    /// target; failures are counted, not returned (the block is dropped either way).
    fn spill_page(&mut self, key: &ScopedKey, page: usize) {
        let staged = self.stage_encoded(page).transpose().unwrap_or_else(|| self.stage_raw(page));
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
            }
            Err(_) => self.stats.spill_errors += 1,
        }
    }

    fn stage_raw(&self, page: usize) -> Result<(CodecId, Vec<u8>)> {
        self.device.copy_d2h(&self.stream, self.page_range(page), &self.staging.range(0, self.page_bytes))?;
        self.device.wait(&self.device.record(&self.stream)?)?;
        let mut out = vec![0u8; self.page_bytes];
        self.staging.read(0, &mut out)?;
        Ok((CodecId::RAW, out))
    }

    /// The page as an FP8 payload, encoded on the device; `Ok(None)` when not configured or when
    /// the codec refused the block (counted; the caller spills it raw).
    fn stage_encoded(&mut self, page: usize) -> Result<Option<(CodecId, Vec<u8>)>> {
        let Some(enc) = &self.encoder else { return Ok(None) };
        let (body, status) = (enc.scratch.range(0, enc.body_len), enc.scratch.range(enc.status_at, 4));
        let op = CodecOp::Fp8Encode { spec: enc.spec, src: self.page_range(page), body, status };
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
        let mut payload = fp8_payload_header(&enc.spec);
        let header = payload.len();
        payload.resize(header + enc.body_len, 0);
        self.staging.read(0, &mut payload[header..])?;
        Ok(Some((CodecId::FP8_E4M3, payload)))
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
        self.index.insert(k, Entry { page, pins: 0, tick, clean });
        self.lru.insert(tick, k);
        self.stats.inserts += 1;
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

    /// Keeps a block that a tier holds as an FP8 payload (`kvtier_kernels::encode` with
    /// `CodecId::FP8_E4M3`, staged in host memory): its body is copied to the device and decoded
    /// there into the page, so the copy moves the smaller bytes. Needs
    /// [`PoolConfig::with_fp8_spill`] and a payload of exactly that block shape. Waits for the
    /// decode: a payload the device refuses (a NaN code, a bad scale) is an error and leaves no
    /// entry.
    pub fn insert_fp8_from_host(&mut self, ns: &NamespaceId, key: &BlockKey, payload: &HostRange) -> Result<()> {
        let Some(enc) = &self.encoder else {
            return Err(AgentError::Config("the pool was built without an FP8 block shape (with_fp8_spill)".into()));
        };
        let (spec, body_len, status_at, scratch) = (enc.spec, enc.body_len, enc.status_at, enc.scratch);
        let header = fp8_payload_header(&spec);
        if payload.len != header.len() + body_len {
            return Err(AgentError::Codec(format!("FP8 payload is {} bytes, {} expected", payload.len, header.len() + body_len)));
        }
        let mut got = vec![0u8; header.len()];
        payload.buf.read(payload.offset, &mut got)?;
        if got != header {
            return Err(AgentError::Codec("payload is not an FP8 per-row payload of the pool's block shape".into()));
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
            let op = CodecOp::Fp8Decode { spec, body, out: self.page_range(page), status };
            self.device.launch_codec(&self.stream, &op)?;
            self.device.copy_d2h(&self.stream, status, &self.staging.range(status_at, 4))?;
            self.device.wait(&self.device.record(&self.stream)?)?;
            let mut word = [0u8; 4];
            self.staging.read(status_at, &mut word)?;
            if word != [0; 4] {
                return Err(AgentError::Codec("the device refused the FP8 body (NaN code or bad scale)".into()));
            }
            Ok(())
        })();
        if let Err(e) = decoded {
            self.free.push(page);
            return Err(e);
        }
        let tick = self.next_tick();
        self.index.insert(k, Entry { page, pins: 0, tick, clean: true });
        self.lru.insert(tick, k);
        self.stats.inserts += 1;
        Ok(())
    }

    /// Copies a resident block into an engine's page (device to device); `None` on a miss.
    pub fn load_into(&mut self, ns: &NamespaceId, key: &BlockKey, dst: DeviceRange) -> Result<Option<D::Event>> {
        if dst.len != self.page_bytes {
            return Err(AgentError::PageSizeMismatch { len: dst.len, page: self.page_bytes });
        }
        let k = (*ns, *key);
        let Some(page) = self.index.get(&k).map(|e| e.page) else {
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
        let Some(page) = self.index.get(&(*ns, *key)).map(|e| e.page) else {
            self.stats.misses += 1;
            return Ok(None);
        };
        self.pin(ns, key)?;
        self.stats.hits += 1;
        Ok(Some(self.page_range(page)))
    }

    /// Pins a resident block (a live session's); returns its pin count.
    pub fn pin(&mut self, ns: &NamespaceId, key: &BlockKey) -> Result<u32> {
        let e = self.index.get_mut(&(*ns, *key)).ok_or(AgentError::NotResident)?;
        if e.pins == 0 {
            self.lru.remove(&e.tick);
        }
        e.pins += 1;
        Ok(e.pins)
    }

    /// Drops one pin; at zero the block is evictable again (as most recently used).
    pub fn unpin(&mut self, ns: &NamespaceId, key: &BlockKey) -> Result<u32> {
        let k = (*ns, *key);
        let e = self.index.get_mut(&k).ok_or(AgentError::NotResident)?;
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

    /// Forgets a block without spilling it (e.g. its namespace was purged). Pinned blocks stay.
    pub fn remove(&mut self, ns: &NamespaceId, key: &BlockKey) -> Result<()> {
        let k = (*ns, *key);
        let e = self.index.get(&k).copied().ok_or(AgentError::NotResident)?;
        if e.pins > 0 {
            return Err(AgentError::Pinned);
        }
        self.index.remove(&k);
        self.lru.remove(&e.tick);
        self.free.push(e.page);
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
mod tests {
    use super::*;
    use crate::{HostDevice, MemInfo};

    const PAGE: usize = 1024;

    fn ns(n: u8) -> NamespaceId {
        NamespaceId([n; kvtier_proto::NAMESPACE_ID_LEN])
    }

    fn key(n: u8) -> BlockKey {
        BlockKey([n; kvtier_proto::KEY_LEN])
    }

    struct Fix {
        dev: Arc<HostDevice>,
        engine: DeviceBuf,
        pool: PagePool<HostDevice, MemorySpill>,
    }

    /// A pool of `pages` pages and an engine buffer of 8 pages, page i filled with i + 1.
    fn fix(pages: usize) -> Fix {
        let dev = Arc::new(HostDevice::new(0, 1 << 20));
        let engine = dev.alloc(8 * PAGE).unwrap();
        for i in 0..8 {
            dev.write_sync(engine.range(i * PAGE, PAGE), &[i as u8 + 1; PAGE]).unwrap();
        }
        let cfg = PoolConfig::new(PAGE).with_capacity(Capacity::Bytes(pages * PAGE + PAGE / 2));
        let pool = PagePool::new(dev.clone(), MemorySpill::default(), cfg).unwrap();
        Fix { dev, engine, pool }
    }

    impl Fix {
        fn put(&mut self, k: u8, engine_page: usize) {
            let ev = self.pool.insert_from_device(&ns(1), &key(k), self.engine.range(engine_page * PAGE, PAGE)).unwrap();
            self.dev.wait(&ev).unwrap();
        }

        /// Loads `k` into engine page 7 and returns its first byte (None on a miss).
        fn get(&mut self, k: u8) -> Option<u8> {
            let ev = self.pool.load_into(&ns(1), &key(k), self.engine.range(7 * PAGE, PAGE)).unwrap()?;
            self.dev.wait(&ev).unwrap();
            let bytes = self.dev.read_sync(self.engine.range(7 * PAGE, PAGE)).unwrap();
            assert!(bytes.iter().all(|b| *b == bytes[0]));
            Some(bytes[0])
        }
    }

    #[test]
    fn capacity_is_a_fraction_of_free_memory_or_bytes() {
        let dev = Arc::new(HostDevice::new(0, 1 << 20));
        let _used = dev.alloc(1 << 19).unwrap();
        let p = PagePool::new(dev.clone(), MemorySpill::default(), PoolConfig::new(4096)).unwrap();
        // 20% of the 512 KiB free, in whole 4 KiB pages.
        assert_eq!(p.pages(), (((1 << 19) as f64 * 0.2) as usize) / 4096);
        assert_eq!(dev.mem_info().unwrap().free, (1 << 19) - p.pages() * 4096);
        drop(p);
        assert_eq!(dev.mem_info().unwrap(), MemInfo { free: 1 << 19, total: 1 << 20 });
        let p = PagePool::new(dev.clone(), MemorySpill::default(), PoolConfig::new(4096).with_capacity(Capacity::Bytes(10_000))).unwrap();
        assert_eq!((p.pages(), p.stats().pages), (2, 2));
        for bad in [Capacity::FractionOfFree(0.0), Capacity::FractionOfFree(1.5), Capacity::FractionOfFree(f64::NAN), Capacity::Bytes(100)] {
            let r = PagePool::new(dev.clone(), MemorySpill::default(), PoolConfig::new(4096).with_capacity(bad));
            assert!(matches!(r, Err(AgentError::Config(_))), "{bad:?}");
        }
        assert!(matches!(PagePool::new(dev.clone(), MemorySpill::default(), PoolConfig::new(0)), Err(AgentError::Config(_))));
        let too_big = PoolConfig::new(4096).with_capacity(Capacity::Bytes(1 << 20));
        assert!(matches!(PagePool::new(dev, MemorySpill::default(), too_big), Err(AgentError::OutOfMemory { .. })));
    }

    #[test]
    fn hits_are_device_to_device_copies_of_the_exact_bytes() {
        let mut f = fix(4);
        f.put(10, 2);
        assert!(f.pool.contains(&ns(1), &key(10)));
        assert!(!f.pool.contains(&ns(2), &key(10)), "namespaces never share keys");
        // Overwrite the engine's source page: the pool kept its own copy.
        f.dev.write_sync(f.engine.range(2 * PAGE, PAGE), &[0xEE; PAGE]).unwrap();
        assert_eq!(f.get(10), Some(3));
        assert_eq!(f.get(11), None);
        let s = f.pool.stats();
        assert_eq!((s.hits, s.misses, s.inserts, s.resident), (1, 1, 1, 1));
        assert!(matches!(
            f.pool.load_into(&ns(1), &key(10), f.engine.range(0, PAGE - 1)),
            Err(AgentError::PageSizeMismatch { len, page: PAGE }) if len == PAGE - 1
        ));
        assert!(matches!(
            f.pool.insert_from_device(&ns(1), &key(12), f.engine.range(0, 2 * PAGE)),
            Err(AgentError::PageSizeMismatch { .. })
        ));
    }

    #[test]
    fn the_least_recently_used_block_is_spilled_with_its_bytes() {
        let mut f = fix(3);
        f.put(1, 0);
        f.put(2, 1);
        f.put(3, 2);
        assert_eq!(f.get(1), Some(1)); // 1 is now the most recent; 2 the least
        f.put(4, 3);
        let spilled = f.pool.spill_target().received();
        assert_eq!(spilled.len(), 1);
        assert_eq!(spilled[0].key, (ns(1), key(2)));
        assert_eq!((spilled[0].codec, &spilled[0].payload), (CodecId::RAW, &vec![2u8; PAGE]));
        assert_eq!(f.get(2), None);
        assert_eq!((f.get(1), f.get(3), f.get(4)), (Some(1), Some(3), Some(4)));
        let s = f.pool.stats();
        assert_eq!((s.evictions, s.spills, s.spilled_bytes, s.resident), (1, 1, PAGE as u64, 3));
        // Re-inserting a resident key takes no page and evicts nothing.
        f.put(4, 5);
        assert_eq!(f.pool.stats().evictions, 1);
        assert_eq!(f.get(4), Some(4));
    }

    #[test]
    fn pinned_blocks_stay_and_a_fully_pinned_pool_refuses() {
        let mut f = fix(2);
        f.put(1, 0);
        f.put(2, 1);
        assert_eq!(f.pool.pin(&ns(1), &key(1)), Ok(1));
        assert_eq!(f.pool.pin(&ns(1), &key(1)), Ok(2));
        f.pool.pin(&ns(1), &key(2)).unwrap();
        assert_eq!(f.pool.stats().pinned, 2);
        let r = f.pool.insert_from_device(&ns(1), &key(3), f.engine.range(2 * PAGE, PAGE));
        assert!(matches!(r, Err(AgentError::PoolExhausted { pages: 2 })));
        assert_eq!(f.pool.remove(&ns(1), &key(2)), Err(AgentError::Pinned));
        assert_eq!(f.pool.unpin(&ns(1), &key(2)), Ok(0));
        assert_eq!(f.pool.unpin(&ns(1), &key(2)), Err(AgentError::NotPinned));
        // Block 1 is older but pinned (twice): block 2 goes.
        f.put(3, 2);
        assert_eq!(f.pool.spill_target().received()[0].key, (ns(1), key(2)));
        assert_eq!(f.pool.unpin(&ns(1), &key(1)), Ok(1));
        assert_eq!(f.pool.pin(&ns(1), &key(9)), Err(AgentError::NotResident));
        assert_eq!(f.get(1), Some(1));
    }

    #[test]
    fn unpinned_blocks_rejoin_the_lru_as_most_recent() {
        let mut f = fix(2);
        f.put(1, 0);
        f.put(2, 1);
        f.pool.pin(&ns(1), &key(1)).unwrap();
        f.pool.unpin(&ns(1), &key(1)).unwrap();
        f.put(3, 2);
        assert_eq!(f.pool.spill_target().received()[0].key, (ns(1), key(2)));
    }

    #[test]
    fn blocks_from_a_tier_are_dropped_not_spilled() {
        let mut f = fix(1);
        let staged = HostBuffer::from_vec(vec![9u8; PAGE]);
        let _reg = f.dev.register_host(&staged).unwrap();
        let ev = f.pool.insert_from_host(&ns(1), &key(1), &staged.range(0, PAGE)).unwrap();
        f.dev.wait(&ev).unwrap();
        assert_eq!(f.get(1), Some(9));
        f.put(2, 1);
        let s = f.pool.stats();
        assert_eq!((s.evictions, s.clean_drops, s.spills), (1, 1, 0));
        assert!(f.pool.spill_target().received().is_empty());
    }

    #[test]
    fn a_layer_pipelined_load_reads_pinned_pages_on_another_stream() {
        use crate::pipeline::{LayerPipeline, LayerSource, Transfer};
        // Each block (page) holds 4 layers of PAGE / 4 bytes, layer-first.
        let mut f = fix(2);
        f.put(1, 0);
        f.put(2, 1);
        let pipe = LayerPipeline::new(f.dev.clone()).unwrap();
        let pages: Vec<_> = [1u8, 2].iter().map(|k| f.pool.pin_for_load(&ns(1), &key(*k)).unwrap().unwrap()).collect();
        assert_eq!(f.pool.pin_for_load(&ns(1), &key(9)), Ok(None));
        let dst = f.dev.alloc(2 * PAGE).unwrap();
        let lb = PAGE / 4;
        let layers = (0..4)
            .map(|l| {
                LayerSource::new(
                    pages
                        .iter()
                        .enumerate()
                        .map(|(b, p)| Transfer::DeviceToDevice {
                            src: p.buf.range(p.offset + l * lb, lb),
                            dst: dst.range(l * 2 * lb + b * lb, lb),
                        })
                        .collect(),
                )
            })
            .collect();
        let h = pipe.start_load_kv(layers);
        // Pinned: a new block cannot take their pages while the load runs.
        assert!(matches!(
            f.pool.insert_from_device(&ns(1), &key(3), f.engine.range(2 * PAGE, PAGE)),
            Err(AgentError::PoolExhausted { .. })
        ));
        assert!(h.wait_all().iter().all(Result::is_ok));
        let got = f.dev.read_sync(dst.all()).unwrap();
        for l in 0..4 {
            assert_eq!(&got[l * 2 * lb..l * 2 * lb + lb], &vec![1u8; lb][..], "layer {l} block 1");
            assert_eq!(&got[l * 2 * lb + lb..(l + 1) * 2 * lb], &vec![2u8; lb][..], "layer {l} block 2");
        }
        for k in [1u8, 2] {
            assert_eq!(f.pool.unpin(&ns(1), &key(k)), Ok(0));
        }
        assert_eq!(f.pool.stats().hits, 2);
        f.put(3, 2);
        assert_eq!(f.pool.stats().evictions, 1);
    }

    #[test]
    fn spills_can_be_encoded_on_the_device_exactly_as_the_cpu_codec() {
        use kvtier_kernels::KvBlockView;
        let spec = BlockSpec::new(2, 4, 2, 64, DType::Bf16);
        let page = spec.byte_len();
        let dev = Arc::new(HostDevice::new(0, 1 << 20));
        let engine = dev.alloc(3 * page).unwrap();
        let block: Vec<u8> = (0..spec.elements())
            .flat_map(|i| half::bf16::from_f32(((i * 37 % 101) as f32 - 50.0) * 0.37).to_bits().to_le_bytes())
            .collect();
        let mut nan_block = block.clone();
        nan_block[6..8].copy_from_slice(&half::bf16::NAN.to_bits().to_le_bytes());
        dev.write_sync(engine.range(0, page), &block).unwrap();
        dev.write_sync(engine.range(page, page), &nan_block).unwrap();
        let cfg = PoolConfig::new(page).with_capacity(Capacity::Bytes(page)).with_fp8_spill(spec);
        let mut pool = PagePool::new(dev.clone(), MemorySpill::default(), cfg).unwrap();
        pool.insert_from_device(&ns(1), &key(1), engine.range(0, page)).unwrap();
        pool.insert_from_device(&ns(1), &key(2), engine.range(page, page)).unwrap();
        pool.insert_from_device(&ns(1), &key(3), engine.range(2 * page, page)).unwrap();
        let got = pool.spill_target().received();
        let want = kvtier_kernels::encode(CodecId::FP8_E4M3, &KvBlockView::new(spec, &block).unwrap()).unwrap();
        assert_eq!(got[0], SpilledBlock { key: (ns(1), key(1)), codec: CodecId::FP8_E4M3, payload: want.clone() });
        assert!(want.len() < page * 3 / 5, "{} of {page}", want.len());
        // The NaN block cannot be quantized: it goes out as the engine's bytes.
        assert_eq!(got[1], SpilledBlock { key: (ns(1), key(2)), codec: CodecId::RAW, payload: nan_block });
        let s = pool.stats();
        assert_eq!((s.spills, s.encoded_spills, s.raw_fallbacks), (2, 1, 1));
        assert_eq!(s.spilled_bytes, (want.len() + page) as u64);
        for bad in [spec.with_dtype(DType::Fp8E4m3), BlockSpec::new(2, 4, 2, 128, DType::Bf16)] {
            let cfg = PoolConfig::new(page).with_capacity(Capacity::Bytes(page)).with_fp8_spill(bad);
            assert!(matches!(PagePool::new(dev.clone(), MemorySpill::default(), cfg), Err(AgentError::Config(_))));
        }
    }

    #[test]
    fn fp8_payloads_are_decoded_on_the_device_on_the_way_in() {
        use kvtier_kernels::KvBlockView;
        let spec = BlockSpec::new(2, 4, 2, 64, DType::Fp16);
        let page = spec.byte_len();
        let block: Vec<u8> = (0..spec.elements())
            .flat_map(|i| half::f16::from_f32(((i * 53 % 97) as f32 - 48.0) * 0.11).to_bits().to_le_bytes())
            .collect();
        let payload = kvtier_kernels::encode(CodecId::FP8_E4M3, &KvBlockView::new(spec, &block).unwrap()).unwrap();
        let want = kvtier_kernels::decode(CodecId::FP8_E4M3, &payload, &spec).unwrap();
        let dev = Arc::new(HostDevice::new(0, 1 << 20));
        let engine = dev.alloc(page).unwrap();
        let staged = HostBuffer::from_vec(payload.clone());
        let _reg = dev.register_host(&staged).unwrap();
        let cfg = PoolConfig::new(page).with_capacity(Capacity::Bytes(2 * page)).with_fp8_spill(spec);
        let mut pool = PagePool::new(dev.clone(), MemorySpill::default(), cfg).unwrap();
        pool.insert_fp8_from_host(&ns(1), &key(1), &staged.range(0, payload.len())).unwrap();
        let ev = pool.load_into(&ns(1), &key(1), engine.all()).unwrap().unwrap();
        dev.wait(&ev).unwrap();
        assert_eq!(dev.read_sync(engine.all()).unwrap(), want);
        // A NaN code in the body: refused, nothing kept.
        let mut bad = payload.clone();
        let codes_at = 32 + 4 * spec.rows();
        bad[codes_at + 3] = 0x7F;
        let bad_buf = HostBuffer::from_vec(bad);
        let _reg2 = dev.register_host(&bad_buf).unwrap();
        let r = pool.insert_fp8_from_host(&ns(1), &key(2), &bad_buf.range(0, payload.len()));
        assert!(matches!(r, Err(AgentError::Codec(_))), "{r:?}");
        assert!(!pool.contains(&ns(1), &key(2)));
        // Wrong shape or length: refused before any copy.
        assert!(matches!(pool.insert_fp8_from_host(&ns(1), &key(3), &staged.range(0, payload.len() - 1)), Err(AgentError::Codec(_))));
        staged.write(6, &[DType::Bf16 as u8]).unwrap();
        assert!(matches!(pool.insert_fp8_from_host(&ns(1), &key(3), &staged.range(0, payload.len())), Err(AgentError::Codec(_))));
        // Both pages are still usable: the refused inserts gave theirs back.
        assert_eq!(pool.stats().resident, 1);
        pool.insert_from_device(&ns(1), &key(4), engine.all()).unwrap();
        assert_eq!((pool.stats().resident, pool.stats().evictions), (2, 0));
        let plain = PagePool::new(dev.clone(), MemorySpill::default(), PoolConfig::new(page).with_capacity(Capacity::Bytes(page)));
        assert!(matches!(plain.unwrap().insert_fp8_from_host(&ns(1), &key(1), &staged.range(0, payload.len())), Err(AgentError::Config(_))));
    }

    struct FailingSpill;

    impl Spill for FailingSpill {
        fn spill(&self, _: &NamespaceId, _: &BlockKey, _: CodecId, _: &[u8]) -> Result<()> {
            Err(AgentError::Spill("G2 full".into()))
        }
    }

    #[test]
    fn a_failed_spill_is_counted_and_the_insert_still_succeeds() {
        let dev = Arc::new(HostDevice::new(0, 1 << 20));
        let engine = dev.alloc(2 * PAGE).unwrap();
        let cfg = PoolConfig::new(PAGE).with_capacity(Capacity::Bytes(PAGE));
        let mut pool = PagePool::new(dev.clone(), FailingSpill, cfg).unwrap();
        pool.insert_from_device(&ns(1), &key(1), engine.range(0, PAGE)).unwrap();
        pool.insert_from_device(&ns(1), &key(2), engine.range(PAGE, PAGE)).unwrap();
        let s = pool.stats();
        assert_eq!((s.evictions, s.spill_errors, s.spills, s.resident), (1, 1, 0, 1));
        assert!(pool.contains(&ns(1), &key(2)) && !pool.contains(&ns(1), &key(1)));
    }

    #[test]
    fn a_refused_copy_gives_its_page_back() {
        let mut f = fix(1);
        f.dev.free(f.engine).unwrap();
        let r = f.pool.insert_from_device(&ns(1), &key(1), f.engine.range(0, PAGE));
        assert_eq!(r.err(), Some(AgentError::FreedHandle(f.engine.id())));
        assert_eq!(f.pool.stats().resident, 0);
        let other = f.dev.alloc(PAGE).unwrap();
        f.dev.wait(&f.pool.insert_from_device(&ns(1), &key(2), other.all()).unwrap()).unwrap();
        assert_eq!(f.pool.keys(), vec![(ns(1), key(2))]);
        f.pool.remove(&ns(1), &key(2)).unwrap();
        assert_eq!(f.pool.remove(&ns(1), &key(2)), Err(AgentError::NotResident));
        assert_eq!(f.pool.stats().evictions, 0);
    }
}

/// The pool against a model: a list in LRU order, pins and the bytes each key holds. Any sequence
/// of inserts, loads, pins, unpins and removes leaves the same resident set, spills the same
/// blocks in the same order with the same bytes, and loads the bytes the key was inserted with.
#[cfg(test)]
mod model_tests {
    use proptest::prelude::*;

    use super::*;
    use crate::HostDevice;

    const PAGE: usize = 64;
    const PAGES: usize = 4;

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u8),
        Load(u8),
        Pin(u8),
        Unpin(u8),
        Remove(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        let k = 0u8..8;
        prop_oneof![
            3 => k.clone().prop_map(Op::Insert),
            3 => k.clone().prop_map(Op::Load),
            1 => k.clone().prop_map(Op::Pin),
            1 => k.clone().prop_map(Op::Unpin),
            1 => k.prop_map(Op::Remove),
        ]
    }

    #[derive(Default)]
    struct Model {
        /// Least recently used first: (key, pins).
        order: Vec<(u8, u32)>,
        spilled: Vec<u8>,
    }

    impl Model {
        fn pos(&self, k: u8) -> Option<usize> {
            self.order.iter().position(|(x, _)| *x == k)
        }

        fn touch(&mut self, k: u8) {
            if let Some(i) = self.pos(k) {
                let e = self.order.remove(i);
                self.order.push(e);
            }
        }

        /// Ok(true) inserted, Ok(false) already there, Err: every page pinned.
        fn insert(&mut self, k: u8) -> Result<bool, ()> {
            if self.pos(k).is_some() {
                self.touch(k);
                return Ok(false);
            }
            if self.order.len() == PAGES {
                let i = self.order.iter().position(|(_, p)| *p == 0).ok_or(())?;
                let (victim, _) = self.order.remove(i);
                self.spilled.push(victim);
            }
            self.order.push((k, 0));
            Ok(true)
        }
    }

    fn key(k: u8) -> BlockKey {
        BlockKey([k; kvtier_proto::KEY_LEN])
    }

    proptest! {
        #[test]
        fn pool_matches_the_lru_model(ops in proptest::collection::vec(op(), 1..80)) {
            let ns = NamespaceId([1; kvtier_proto::NAMESPACE_ID_LEN]);
            let dev = Arc::new(HostDevice::new(0, 1 << 20));
            let engine = dev.alloc(9 * PAGE).unwrap();
            for k in 0..8u8 {
                dev.write_sync(engine.range(k as usize * PAGE, PAGE), &[k + 100; PAGE]).unwrap();
            }
            let out = engine.range(8 * PAGE, PAGE);
            let cfg = PoolConfig::new(PAGE).with_capacity(Capacity::Bytes(PAGES * PAGE));
            let mut pool = PagePool::new(dev.clone(), MemorySpill::default(), cfg).unwrap();
            let mut model = Model::default();
            for op in ops {
                match op {
                    Op::Insert(k) => {
                        let got = pool.insert_from_device(&ns, &key(k), engine.range(k as usize * PAGE, PAGE));
                        match model.insert(k) {
                            Ok(_) => { dev.wait(&got.unwrap()).unwrap(); }
                            Err(()) => prop_assert_eq!(got.err(), Some(AgentError::PoolExhausted { pages: PAGES })),
                        }
                    }
                    Op::Load(k) => {
                        let got = pool.load_into(&ns, &key(k), out).unwrap();
                        prop_assert_eq!(got.is_some(), model.pos(k).is_some());
                        if let Some(ev) = got {
                            dev.wait(&ev).unwrap();
                            prop_assert_eq!(dev.read_sync(out).unwrap(), vec![k + 100; PAGE]);
                            model.touch(k);
                        }
                    }
                    Op::Pin(k) => {
                        let got = pool.pin(&ns, &key(k));
                        match model.pos(k) {
                            Some(i) => { model.order[i].1 += 1; prop_assert_eq!(got, Ok(model.order[i].1)); }
                            None => prop_assert_eq!(got, Err(AgentError::NotResident)),
                        }
                    }
                    Op::Unpin(k) => {
                        let got = pool.unpin(&ns, &key(k));
                        match model.pos(k) {
                            Some(i) if model.order[i].1 > 0 => {
                                model.order[i].1 -= 1;
                                prop_assert_eq!(got, Ok(model.order[i].1));
                                if model.order[i].1 == 0 { model.touch(k); }
                            }
                            Some(_) => prop_assert_eq!(got, Err(AgentError::NotPinned)),
                            None => prop_assert_eq!(got, Err(AgentError::NotResident)),
                        }
                    }
                    Op::Remove(k) => {
                        let got = pool.remove(&ns, &key(k));
                        match model.pos(k) {
                            Some(i) if model.order[i].1 > 0 => prop_assert_eq!(got, Err(AgentError::Pinned)),
                            Some(i) => { model.order.remove(i); prop_assert_eq!(got, Ok(())); }
                            None => prop_assert_eq!(got, Err(AgentError::NotResident)),
                        }
                    }
                }
                let mut resident: Vec<u8> = pool.keys().iter().map(|(_, k)| k.0[0]).collect();
                resident.sort();
                let mut want: Vec<u8> = model.order.iter().map(|(k, _)| *k).collect();
                want.sort();
                prop_assert_eq!(resident, want);
            }
            let spilled = pool.spill_target().received();
            prop_assert_eq!(spilled.iter().map(|b| b.key.1 .0[0]).collect::<Vec<_>>(), model.spilled.clone());
            for b in spilled {
                prop_assert_eq!(b.payload, vec![b.key.1 .0[0] + 100; PAGE]);
            }
            let s = pool.stats();
            prop_assert_eq!(s.spills as usize, model.spilled.len());
            prop_assert_eq!(s.pinned, model.order.iter().filter(|(_, p)| *p > 0).count());
        }
    }
}
