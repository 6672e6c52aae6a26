//! The agent's engine-facing side: what a same-node engine asks of the agent, and the G1 pool
//! behind it.
//!
//! - [`proto`]: the wire format of the engine socket, without I/O.
//! - [`Agent`] (this file): the node's devices — one, or several with peer links
//!   ([`Agent::node`]) — their G1 pools as one [`NodePool`] that borrows pages between devices
//!   by the [`crate::policy`] (a full device's new block goes to a peer's share over the link, or
//!   the borrow is declined and the device evicts into G2 as a one-device agent does), the
//!   [`BackingStore`] below (G2 through the same-node path: evictions spill into it, pool misses
//!   load back from it), and counters for `/metrics`. [`Session`] is one engine connection's
//!   state, on one device ([`Session::on_device`]) — its namespace, its
//!   registered KV buffers (imported by IPC handle: a CUDA handle, or a sealed memfd on the host
//!   backend), the saves it has under way — and turns requests into device copies: SAVE copies a
//!   layer of engine pages into reserved G1 pages; LOAD pins the G1 hits, fetches the rest from
//!   the store into a registered staging buffer and copies every layer into the engine's pages
//!   with [`LayerPipeline`], answering as each layer lands. A G1 page on another device (a
//!   borrowed one) is copied over the link ([`Transfer::Peer`]) both ways.
//! - **Promotion** ([`AgentConfig::promote_loads`], on by default): a block a LOAD fetched from
//!   the store gets a G1 page reserved through the node pool like a save's (its own pool, a
//!   reclaimed or borrowed page, or its least recently used unpinned block evicted — never a
//!   pinned one); each layer, once in the engine's pages, is copied on into it device to device
//!   (over the link for a borrowed page) on the same load stream, and the layer is answered
//!   after that copy too, so the engine never reuses its pages under it. When every copy landed
//!   the block is committed clean (a tier holds it: an eviction drops it without a spill) and
//!   reported as a G1 change ([`Agent::take_g1_changes`]); the next load of it is a G1 hit. A
//!   block that finds no page, whose own eviction is still on its way to the store, or whose
//!   copies failed is not promoted — counted ([`AgentStats::promotions_skipped`]), never an
//!   error for the load, which the staging buffer serves either way.
//! - Spills run outside the pool's lock: an eviction copies the page out under it, the copy
//!   waits in the agent's in-flight map (loads read it from there) and a bounded queue hands it
//!   to the agent's spill thread, which stores it below. A stalled store stalls the spill thread
//!   (and, once the queue is full, the saves that need room), never G1 loads.
//! - [`server`]: the Unix socket: threads, descriptors, limits and timeouts.
//!
//! The store is a trait so that this crate needs no network client: the `kvtier agent` command
//! (cli/) implements it with kvtier-client's same-node path; tests use [`MemorySpill`].

pub mod proto;
pub mod server;

pub use server::EngineServer;

#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_proto::{BlockKey, Namespace, NamespaceId};
use parking_lot::Mutex;

use self::proto::{
    counts, encode_answer, encode_refusal, open_answer, BufferSource, Item, Op, Refusal, Request, Status,
};
use crate::device::{Device, DeviceBuf, DeviceRange, HostBuffer, IpcHandle, Registration, Transfer};
use crate::error::{AgentError, Result};
use crate::pipeline::{LayerPipeline, LayerSource};
use crate::policy::BorrowConfig;
use crate::pool::{BorrowStats, Capacity, MemorySpill, NodeLink, NodePool, PendingSpill, PoolConfig, PoolStats, Spill};

/// The tier below G1 (G2 on this node, through the same-node path): takes evicted blocks
/// ([`Spill`]) and gives them back.
pub trait BackingStore: Spill + Clone + 'static {
    /// Makes a namespace known below (registers it with the server) before blocks of it move.
    fn open_namespace(&self, ns: &Namespace) -> Result<()>;

    /// Reads raw blocks by key into `out` (block `i` at `i * block_bytes`); true where block `i`
    /// landed.
    fn fetch(&self, ns: &NamespaceId, keys: &[BlockKey], block_bytes: usize, out: &mut [u8]) -> Result<Vec<bool>>;
}

impl BackingStore for MemorySpill {
    fn open_namespace(&self, _ns: &Namespace) -> Result<()> {
        Ok(())
    }

    fn fetch(&self, ns: &NamespaceId, keys: &[BlockKey], block_bytes: usize, out: &mut [u8]) -> Result<Vec<bool>> {
        Ok(keys
            .iter()
            .enumerate()
            .map(|(i, k)| match self.get(ns, k) {
                Some(b) if b.len() == block_bytes => {
                    out[i * block_bytes..(i + 1) * block_bytes].copy_from_slice(&b);
                    true
                }
                _ => false,
            })
            .collect())
    }
}

/// Agent settings.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Bytes of one block (one G1 page): every engine's namespace must have this block size.
    pub page_bytes: usize,
    /// G1 capacity. Default: 20% of the device's free memory.
    pub capacity: Capacity,
    /// Engine connections at once. Default: 64.
    pub max_connections: usize,
    /// KV buffers one connection may register. Default: 8.
    pub max_buffers_per_connection: usize,
    /// Keys one connection may have between the SAVE of layer 0 and that of the last layer
    /// (each holds a pinned G1 page). Default: 1024.
    pub max_open_saves_per_connection: usize,
    /// Bytes one LOAD may take from the store: each connection's staging buffer (allocated on its
    /// first load that misses G1), rounded down to whole blocks, at least one; keys past it are
    /// misses. Default: 64 MiB (so 64 connections stage at most 4 GiB).
    pub max_store_bytes_per_load: usize,
    /// How long a connection may sit between requests. Default: 10 minutes.
    pub idle_timeout: Duration,
    /// How long a save may wait for its next layer: past it the save is given up and its G1 page
    /// given back (an engine that never sends its last layer can't hold the pool). Default: 60 s.
    pub save_timeout: Duration,
    /// How long reading the rest of a request, or writing an answer, may take. Default: 10 s.
    pub io_timeout: Duration,
    /// Borrowing between the node's devices (the link budget and the monitor's window; each
    /// device's share is its pool, `capacity`). Default: [`BorrowConfig::default`] (30%, 1 s).
    pub borrow: BorrowConfig,
    /// Promote blocks a load fetched from the store into G1 (clean: an eviction drops them), so
    /// a hot prefix becomes G1-resident again after an eviction. Default: on.
    pub promote_loads: bool,
}

impl AgentConfig {
    /// Blocks of a connection's staging buffer.
    fn store_blocks_per_load(&self) -> usize {
        (self.max_store_bytes_per_load / self.page_bytes.max(1)).max(1)
    }

    pub fn new(page_bytes: usize) -> Self {
        AgentConfig {
            page_bytes,
            capacity: Capacity::FractionOfFree(0.2),
            max_connections: 64,
            max_buffers_per_connection: 8,
            max_open_saves_per_connection: 1024,
            max_store_bytes_per_load: 64 << 20,
            idle_timeout: Duration::from_secs(600),
            save_timeout: Duration::from_secs(60),
            io_timeout: Duration::from_secs(10),
            borrow: BorrowConfig::default(),
            promote_loads: true,
        }
    }
}

/// Counters of an agent (monotonic unless said otherwise).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AgentStats {
    /// The G1 pools, summed over the node's devices.
    pub pool: PoolStats,
    /// Borrowing between the node's devices (nothing on a one-device node).
    pub borrow: BorrowStats,
    /// Each link's use now as the borrowing policy's monitor sees it (a gauge: 0.0 idle, 1.0
    /// saturated), by (lower, higher) ordinal.
    pub link_use: std::collections::BTreeMap<(crate::DeviceOrdinal, crate::DeviceOrdinal), f64>,
    /// Engine connections now open (a gauge).
    pub connections: u64,
    pub requests: u64,
    /// Requests answered with an error status.
    pub refused: u64,
    pub saved_layers: u64,
    /// Blocks whose last layer was saved (committed to G1).
    pub saved_blocks: u64,
    /// Saves given up because their next layer did not come within `save_timeout`.
    pub saves_expired: u64,
    pub loads: u64,
    pub loaded_from_g1: u64,
    pub loaded_from_g2: u64,
    /// Keys of loads that were in neither G1 nor G2 (the engine recomputes them).
    pub load_misses: u64,
    /// Fetches from the store that failed (their keys became misses).
    pub store_errors: u64,
    /// Blocks a load fetched from the store that were promoted into G1 ([`AgentConfig::promote_loads`]).
    pub promotions: u64,
    /// Blocks a load fetched from the store that were not promoted: no page to take (every one
    /// pinned, or the borrow declined into a full pool), the block's own eviction still on its way
    /// to the store, or a promotion copy or the engine's layer failing. The load itself is served
    /// either way.
    pub promotions_skipped: u64,
    /// Bytes moved by engine copies (saves and loads), and the wall time from enqueueing them to
    /// their completion: `copy_bytes / copy_seconds` is the copies' throughput.
    pub copy_bytes: u64,
    pub copy_seconds: f64,
}

#[derive(Default)]
struct Counters {
    connections: AtomicU64,
    requests: AtomicU64,
    refused: AtomicU64,
    saved_layers: AtomicU64,
    saved_blocks: AtomicU64,
    saves_expired: AtomicU64,
    loads: AtomicU64,
    loaded_from_g1: AtomicU64,
    loaded_from_g2: AtomicU64,
    load_misses: AtomicU64,
    store_errors: AtomicU64,
    promotions: AtomicU64,
    promotions_skipped: AtomicU64,
    copy_bytes: AtomicU64,
    copy_nanos: AtomicU64,
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// Evicted blocks queued for the spill thread at most; a save that needs room past it waits.
pub const SPILL_QUEUE: usize = 64;

/// Blocks evicted from G1 and not yet stored below, by key: loads read them from here.
type InFlight = Arc<Mutex<HashMap<kvtier_proto::ScopedKey, Arc<PendingSpill>>>>;

/// A node's agent: the G1 pools of its devices over a backing store. Shared by every engine
/// connection.
pub struct Agent<D: Device, B: BackingStore> {
    devices: Vec<Arc<D>>,
    store: B,
    pool: Arc<Mutex<NodePool<D, B>>>,
    config: AgentConfig,
    counters: Counters,
    in_flight: InFlight,
    /// To the spill thread; it ends when the agent (this sender) goes.
    spills: std::sync::mpsc::SyncSender<Arc<PendingSpill>>,
}

impl<D: Device, B: BackingStore> Agent<D, B> {
    /// Builds the pool on `device` (failing on a capacity that holds no page) and starts the
    /// spill thread. It never borrows.
    pub fn new(device: Arc<D>, store: B, config: AgentConfig) -> Result<Self> {
        Self::node(vec![device], &[], store, config)
    }

    /// Builds a pool of `config.capacity` on every device of the node, with peer access over
    /// `links` (borrowing: [`NodePool`]), and starts the spill thread.
    pub fn node(devices: Vec<Arc<D>>, links: &[NodeLink], store: B, config: AgentConfig) -> Result<Self> {
        let pool = NodePool::new(
            devices.clone(),
            store.clone(),
            PoolConfig::new(config.page_bytes).with_capacity(config.capacity).with_deferred_spills(),
            config.borrow.clone(),
            links,
        )?;
        let pool = Arc::new(Mutex::new(pool));
        let in_flight: InFlight = Arc::default();
        let (tx, rx) = std::sync::mpsc::sync_channel::<Arc<PendingSpill>>(SPILL_QUEUE);
        let (p, f, st) = (pool.clone(), in_flight.clone(), store.clone());
        std::thread::Builder::new()
            .name("kvtier-agent-spill".into())
            .spawn(move || {
                for job in rx {
                    let ok = st.spill(&job.key.0, &job.key.1, job.codec, &job.payload).is_ok();
                    // Counted first, then out of the in-flight map once below (or given up): no
                    // window where a load finds it nowhere, and counts are final when the map
                    // is empty.
                    p.lock().spill_finished(&job, ok);
                    f.lock().remove(&job.key);
                }
            })
            .map_err(|e| AgentError::Config(format!("starting the spill thread: {e}")))?;
        Ok(Agent { devices, store, pool, config, counters: Counters::default(), in_flight, spills: tx })
    }

    /// Hands the pool's copied-out evictions to the spill thread: into the in-flight map under
    /// the pool's lock (`pool`), queued after it is released (waiting while the queue is full).
    fn queue_spills(&self, mut pool: parking_lot::MutexGuard<'_, NodePool<D, B>>) {
        let pending = pool.take_spills();
        if pending.is_empty() {
            return;
        }
        let jobs: Vec<Arc<PendingSpill>> = pending.into_iter().map(Arc::new).collect();
        {
            let mut f = self.in_flight.lock();
            for j in &jobs {
                f.insert(j.key, j.clone());
            }
        }
        drop(pool);
        for j in jobs {
            if let Err(e) = self.spills.send(j) {
                // The spill thread is gone (it never panics; only at teardown): given up.
                let job = e.0;
                self.pool.lock().spill_finished(&job, false);
                self.in_flight.lock().remove(&job.key);
            }
        }
    }

    /// Waits (at most `timeout`) until every eviction so far has been stored below or given up;
    /// whether it came to that.
    pub fn wait_for_spills(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while !self.in_flight.lock().is_empty() {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    /// Raw blocks evicted from G1 whose spill is still under way, into `out` (block `i` at
    /// `i * block_bytes`); true where block `i` was there.
    fn read_in_flight(&self, ns: &NamespaceId, keys: &[BlockKey], block_bytes: usize, out: &mut [u8]) -> Vec<bool> {
        let f = self.in_flight.lock();
        keys.iter()
            .enumerate()
            .map(|(i, k)| match f.get(&(*ns, *k)) {
                Some(j) if j.codec == kvtier_proto::CodecId::RAW && j.payload.len() == block_bytes => {
                    out[i * block_bytes..][..block_bytes].copy_from_slice(&j.payload);
                    true
                }
                _ => false,
            })
            .collect()
    }

    pub fn config(&self) -> &AgentConfig {
        &self.config
    }

    /// The node's first device (the only one of [`Agent::new`]).
    pub fn device(&self) -> &Arc<D> {
        &self.devices[0]
    }

    /// The node's devices.
    pub fn devices(&self) -> &[Arc<D>] {
        &self.devices
    }

    pub fn store(&self) -> &B {
        &self.store
    }

    /// Every key G1 holds now (for reporting to the server).
    pub fn resident_keys(&self) -> Vec<kvtier_proto::ScopedKey> {
        self.pool.lock().keys()
    }

    /// What G1 took in and gave up since the last call (for KV events), and whether some
    /// changes were lost (then resync from [`Agent::resident_keys`]).
    pub fn take_g1_changes(&self) -> (Vec<crate::pool::PoolChange>, bool) {
        self.pool.lock().take_changes()
    }

    /// Copies a resident block out of G1 (raw) for a spill the server asked for; `None` when G1
    /// no longer holds it. Spill it to the store without holding the pool, then
    /// [`Agent::mark_spilled`].
    pub fn copy_out(&self, ns: &NamespaceId, key: &BlockKey) -> Result<Option<Vec<u8>>> {
        self.pool.lock().copy_out(ns, key)
    }

    /// Notes that the store now holds a block G1 holds (an eviction then drops it).
    pub fn mark_spilled(&self, ns: &NamespaceId, key: &BlockKey) {
        self.pool.lock().mark_clean(ns, key);
    }

    pub fn stats(&self) -> AgentStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let (pool, borrow, link_use) = {
            let p = self.pool.lock();
            (p.stats(), p.borrow_stats(), p.link_use(Instant::now()))
        };
        AgentStats {
            pool,
            borrow,
            link_use,
            connections: get(&c.connections),
            requests: get(&c.requests),
            refused: get(&c.refused),
            saved_layers: get(&c.saved_layers),
            saved_blocks: get(&c.saved_blocks),
            saves_expired: get(&c.saves_expired),
            loads: get(&c.loads),
            loaded_from_g1: get(&c.loaded_from_g1),
            loaded_from_g2: get(&c.loaded_from_g2),
            load_misses: get(&c.load_misses),
            store_errors: get(&c.store_errors),
            promotions: get(&c.promotions),
            promotions_skipped: get(&c.promotions_skipped),
            copy_bytes: get(&c.copy_bytes),
            copy_seconds: get(&c.copy_nanos) as f64 / 1e9,
        }
    }

    fn record_copies(&self, bytes: usize, since: Instant) {
        add(&self.counters.copy_bytes, bytes as u64);
        add(&self.counters.copy_nanos, since.elapsed().as_nanos() as u64);
    }
}

/// The namespace a connection opened.
struct OpenNs {
    id: NamespaceId,
    /// Its spec: what an engine's own block hashes are salted with into keys.
    spec: Namespace,
    layers: usize,
    layer_bytes: usize,
}

/// A registered engine KV buffer: `[layer][page][layer_bytes]`.
struct EngineBuffer {
    buf: DeviceBuf,
    pages: u32,
}

/// A key between the SAVE of its layer 0 and of its last layer.
struct OpenSave {
    /// Its reserved G1 page; `None` when G1 already held the key (nothing to copy).
    page: Option<DeviceRange>,
    next_layer: usize,
    /// When its last layer so far came (its next is due `save_timeout` after).
    since: Instant,
}

/// Where one loaded block comes from.
enum LoadSource {
    /// A G1 page, pinned for the load.
    G1(DeviceRange),
    /// Block `slot` of the staging buffer (fetched from the store); `promote_to`: the G1 page
    /// reserved for it (promotion), filled from the engine's pages once they landed.
    Staged { slot: usize, promote_to: Option<DeviceRange> },
}

/// A load, planned: the engine buffer, its namespace's shape, and each leading key's source.
struct LoadPlan {
    engine: DeviceBuf,
    pages: u32,
    nsid: NamespaceId,
    layers: usize,
    layer_bytes: usize,
    sources: Vec<LoadSource>,
}

/// One engine connection's state. Dropping it gives back what it held: reserved G1 pages of
/// unfinished saves, imported buffers.
pub struct Session<D: Device, B: BackingStore> {
    agent: Arc<Agent<D, B>>,
    /// The device of this engine (its buffers, its own G1 pool, its staging).
    device: Arc<D>,
    ns: Option<OpenNs>,
    buffers: HashMap<u32, EngineBuffer>,
    next_buffer: u32,
    saves: HashMap<BlockKey, OpenSave>,
    pipe: LayerPipeline<D>,
    /// Blocks fetched from the store for a load, registered with the device.
    staging: Option<(HostBuffer, Registration)>,
}

type Answer = std::result::Result<Vec<u8>, Refusal>;

fn refusal(e: AgentError) -> Refusal {
    let status = match &e {
        AgentError::PoolExhausted { .. } | AgentError::OutOfMemory { .. } => Status::Busy,
        AgentError::OutOfBounds { .. } | AgentError::LayerOutOfRange { .. } => Status::OutOfRange,
        AgentError::BadIpcHandle(_) | AgentError::Config(_) => Status::BadRequest,
        AgentError::PageSizeMismatch { .. } | AgentError::LengthMismatch { .. } => Status::SizeMismatch,
        _ => Status::Internal,
    };
    Refusal::new(status, e.to_string())
}

impl<D: Device, B: BackingStore> Session<D, B> {
    /// A session on the node's first device.
    pub fn new(agent: Arc<Agent<D, B>>) -> Result<Self> {
        let first = agent.device().ordinal();
        Self::on_device(agent, first)
    }

    /// A session of an engine on device `ordinal` of the node.
    pub fn on_device(agent: Arc<Agent<D, B>>, ordinal: crate::DeviceOrdinal) -> Result<Self> {
        let device = agent
            .devices
            .iter()
            .find(|d| d.ordinal() == ordinal)
            .cloned()
            .ok_or_else(|| AgentError::Config(format!("device {ordinal} is not on this node")))?;
        let pipe = LayerPipeline::new(device.clone())?.with_peers(agent.devices.iter().cloned());
        add(&agent.counters.connections, 1);
        Ok(Session {
            agent,
            device,
            ns: None,
            buffers: HashMap::new(),
            next_buffer: 1,
            saves: HashMap::new(),
            pipe,
            staging: None,
        })
    }

    /// Handles one request; `send` gets every answer (one, or for a LOAD, one plus one per
    /// layer as it lands). `fd` is the descriptor that came with the request, if any. An `Err`
    /// from `send` (the engine went away) stops the request and is returned.
    pub fn handle(
        &mut self,
        request_id: u32,
        req: Request,
        fd: Option<OwnedFd>,
        send: &mut dyn FnMut(Vec<u8>) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        let c = &self.agent.counters;
        add(&c.requests, 1);
        let op = req.op();
        let answer = match req {
            Request::Open(ns) => self.open(ns),
            Request::Register { source, len, pages } => self.register(source, fd, len, pages),
            Request::Save { buffer, layer, items } => self.save(buffer, layer as usize, &self.keyed(items)),
            Request::Load { buffer, items } => {
                let items = self.keyed(items);
                return self.load(request_id, buffer, &items, send);
            }
            Request::Unregister { buffer } => self.unregister(buffer),
        };
        match answer {
            Ok(body) => send(encode_answer(op, Status::Ok, 0, request_id, &body)),
            Err(r) => {
                add(&self.agent.counters.refused, 1);
                send(encode_refusal(op, request_id, &r))
            }
        }
    }

    fn open(&mut self, ns: Namespace) -> Answer {
        if self.ns.is_some() {
            return Err(Refusal::new(Status::BadRequest, "a namespace is already open on this connection"));
        }
        let bb = ns.layout.block_bytes();
        let layers = usize::from(ns.layout.layers);
        if bb != self.agent.config.page_bytes as u64 {
            return Err(Refusal::new(
                Status::SizeMismatch,
                format!(
                    "blocks of this layout are {bb} bytes; this agent's G1 pages are {}",
                    self.agent.config.page_bytes
                ),
            ));
        }
        if !bb.is_multiple_of(layers as u64) {
            return Err(Refusal::new(
                Status::SizeMismatch,
                format!("{bb}-byte blocks don't split into {layers} layers"),
            ));
        }
        self.agent.store.open_namespace(&ns).map_err(refusal)?;
        let id = ns.id();
        let body = open_answer(bb, layers as u32, &id);
        self.ns = Some(OpenNs { id, spec: ns, layers, layer_bytes: bb as usize / layers });
        Ok(body)
    }

    /// The items with the engine's block hashes salted into the open namespace's keys, as the
    /// client salts them (`BlockKey::opaque`): a block an engine saves through the agent is the
    /// one it finds through the client (or the server) under the same hash, and back.
    fn keyed(&self, items: Vec<Item>) -> Vec<Item> {
        let Some(ns) = &self.ns else { return items };
        items.into_iter().map(|it| Item { key: BlockKey::opaque(&ns.spec, &it.key.0), ..it }).collect()
    }

    fn opened(&self) -> std::result::Result<&OpenNs, Refusal> {
        self.ns.as_ref().ok_or_else(|| Refusal::new(Status::BadRequest, "OPEN a namespace first"))
    }

    fn register(&mut self, source: BufferSource, fd: Option<OwnedFd>, len: u64, pages: u32) -> Answer {
        let ns = self.opened()?;
        if self.buffers.len() >= self.agent.config.max_buffers_per_connection {
            return Err(Refusal::new(
                Status::Busy,
                format!("{} buffers already registered on this connection", self.buffers.len()),
            ));
        }
        let need = (ns.layers as u64).checked_mul(u64::from(pages)).and_then(|n| n.checked_mul(ns.layer_bytes as u64));
        let len_usize = usize::try_from(len).ok();
        match (need, len_usize) {
            (Some(n), Some(_)) if pages > 0 && n <= len => {}
            _ => {
                return Err(Refusal::new(
                    Status::SizeMismatch,
                    format!(
                        "a buffer of {pages} pages × {} layers × {} bytes does not fit in {len} bytes",
                        ns.layers, ns.layer_bytes
                    ),
                ))
            }
        }
        let len = len_usize.unwrap_or(0);
        let handle = match (source, &fd) {
            (BufferSource::Memfd, Some(fd)) => IpcHandle::host_shared_memory(std::process::id(), fd.as_raw_fd(), len),
            (BufferSource::Memfd, None) => {
                return Err(Refusal::new(
                    Status::BadRequest,
                    "a memfd buffer needs its descriptor attached (SCM_RIGHTS)",
                ))
            }
            (BufferSource::CudaIpc(bytes), _) => IpcHandle::from_bytes(bytes, len),
        };
        let buf = self.device.import_ipc(&handle).map_err(refusal)?;
        drop(fd); // the mapping (or CUDA's import) outlives the descriptor
        let id = self.next_buffer;
        self.next_buffer += 1;
        self.buffers.insert(id, EngineBuffer { buf, pages });
        Ok(id.to_le_bytes().to_vec())
    }

    fn unregister(&mut self, buffer: u32) -> Answer {
        let b = self
            .buffers
            .remove(&buffer)
            .ok_or_else(|| Refusal::new(Status::UnknownBuffer, format!("no buffer {buffer} on this connection")))?;
        self.device.free(b.buf).map_err(refusal)?;
        Ok(Vec::new())
    }

    /// The engine buffer and a check that every item's page is in it.
    fn buffer_for(&self, buffer: u32, items: &[Item]) -> std::result::Result<(DeviceBuf, u32), Refusal> {
        let b = self
            .buffers
            .get(&buffer)
            .ok_or_else(|| Refusal::new(Status::UnknownBuffer, format!("no buffer {buffer} on this connection")))?;
        if let Some(it) = items.iter().find(|it| it.page >= b.pages) {
            return Err(Refusal::new(
                Status::OutOfRange,
                format!("page {} is past the end of buffer {buffer} ({} pages)", it.page, b.pages),
            ));
        }
        Ok((b.buf, b.pages))
    }

    fn save(&mut self, buffer: u32, layer: usize, items: &[Item]) -> Answer {
        let (layers, lb, nsid) = {
            let ns = self.opened()?;
            (ns.layers, ns.layer_bytes, ns.id)
        };
        let (engine, pages) = self.buffer_for(buffer, items)?;
        if layer >= layers {
            return Err(Refusal::new(Status::OutOfRange, format!("layer {layer} of a {layers}-layer namespace")));
        }
        let mut seen = HashSet::new();
        let items: Vec<Item> = items.iter().filter(|it| seen.insert(it.key)).copied().collect();
        if layer == 0 {
            self.open_saves(&nsid, &items)?;
        } else if let Some(it) = items.iter().find(|it| self.saves.get(&it.key).is_none_or(|s| s.next_layer != layer)) {
            let why = match self.saves.get(&it.key) {
                None => "its layer 0 was not saved on this connection".to_string(),
                Some(s) => format!("layer {} comes next", s.next_layer),
            };
            return Err(Refusal::new(
                Status::UnknownKey,
                format!("SAVE of layer {layer} for key {}: {why}", hex(&it.key)),
            ));
        }
        let transfers: Vec<Transfer> = items
            .iter()
            .filter_map(|it| {
                let page = self.saves.get(&it.key)?.page?;
                let src = engine.range((layer * pages as usize + it.page as usize) * lb, lb);
                Some(device_copy(src, page.buf.range(page.offset + layer * lb, lb)))
            })
            .collect();
        let started = Instant::now();
        self.pipe.save_kv_layer(layer, &transfers, None);
        let report = self.pipe.wait_for_save();
        if let Some((_, e)) = report.failed().into_iter().next() {
            self.abort_saves(&nsid, items.iter().map(|it| it.key));
            return Err(refusal(e));
        }
        self.agent.record_copies(transfers.len() * lb, started);
        add(&self.agent.counters.saved_layers, 1);
        let mut committed = 0u32;
        let mut pool = self.agent.pool.lock();
        for it in &items {
            let last = layer + 1 == layers;
            let Some(s) = self.saves.get_mut(&it.key) else { continue };
            s.next_layer += 1;
            s.since = Instant::now();
            if last {
                let had_page = s.page.is_some();
                self.saves.remove(&it.key);
                if had_page && pool.commit(&nsid, &it.key).is_ok() {
                    committed += 1;
                }
            }
        }
        drop(pool);
        add(&self.agent.counters.saved_blocks, u64::from(committed));
        Ok(counts(&[transfers.len() as u32, committed]))
    }

    /// Layer 0 of a save: reserves a G1 page per new key. All or nothing: on a refusal the pages
    /// this call reserved are given back.
    fn open_saves(&mut self, nsid: &NamespaceId, items: &[Item]) -> std::result::Result<(), Refusal> {
        let fresh: Vec<&Item> = items.iter().filter(|it| !self.saves.contains_key(&it.key)).collect();
        let max = self.agent.config.max_open_saves_per_connection;
        if self.saves.len() + fresh.len() > max {
            return Err(Refusal::new(
                Status::Busy,
                format!(
                    "{} saves open on this connection; at most {max} (finish their last layer first)",
                    self.saves.len()
                ),
            ));
        }
        if let Some(it) = items.iter().find(|it| self.saves.get(&it.key).is_some_and(|s| s.next_layer != 0)) {
            return Err(Refusal::new(
                Status::BadRequest,
                format!(
                    "key {} is already being saved (layer {} comes next)",
                    hex(&it.key),
                    self.saves[&it.key].next_layer
                ),
            ));
        }
        let mut pool = self.agent.pool.lock();
        // More new blocks than the node's unpinned pages can never fit: refused before any block
        // is evicted for them (the reservations below would evict the whole pool first).
        let stats = pool.stats();
        let room = stats.pages.saturating_sub(stats.pinned);
        // Keys G1 holds already (or another save is filling) take no page.
        let needed = fresh.iter().filter(|it| !pool.holds(&(*nsid, it.key))).count();
        if needed > room {
            return Err(Refusal::new(
                Status::Busy,
                format!(
                    "a save of {needed} new blocks needs as many G1 pages; the pool has {} of which {} are pinned",
                    stats.pages, stats.pinned
                ),
            ));
        }
        let mut reserved = Vec::new();
        let (me, now) = (self.device.ordinal(), Instant::now());
        for it in fresh {
            match pool.reserve(me, nsid, &it.key, now) {
                Ok(page) => {
                    self.saves.insert(it.key, OpenSave { page, next_layer: 0, since: now });
                    reserved.push(it.key);
                }
                Err(e) => {
                    for k in &reserved {
                        if let Some(OpenSave { page: Some(_), .. }) = self.saves.remove(k) {
                            let _ = pool.abort(nsid, k);
                        }
                    }
                    self.agent.queue_spills(pool);
                    return Err(refusal(e));
                }
            }
        }
        self.agent.queue_spills(pool);
        Ok(())
    }

    /// When the oldest open save is due to be given up ([`AgentConfig::save_timeout`]).
    pub fn next_save_deadline(&self) -> Option<Instant> {
        self.saves.values().map(|s| s.since).min().map(|t| t + self.agent.config.save_timeout)
    }

    /// Gives up the saves whose next layer is overdue at `now`, their G1 pages given back; how
    /// many.
    pub fn expire_saves(&mut self, now: Instant) -> usize {
        let timeout = self.agent.config.save_timeout;
        let overdue: Vec<BlockKey> =
            self.saves.iter().filter(|(_, s)| s.since + timeout <= now).map(|(k, _)| *k).collect();
        if let (Some(ns), false) = (self.ns.as_ref().map(|n| n.id), overdue.is_empty()) {
            self.abort_saves(&ns, overdue.iter().copied());
            add(&self.agent.counters.saves_expired, overdue.len() as u64);
        }
        overdue.len()
    }

    fn abort_saves(&mut self, nsid: &NamespaceId, keys: impl Iterator<Item = BlockKey>) {
        let mut pool = self.agent.pool.lock();
        for k in keys {
            if let Some(OpenSave { page: Some(_), .. }) = self.saves.remove(&k) {
                let _ = pool.abort(nsid, &k);
            }
        }
    }

    fn load(
        &mut self,
        request_id: u32,
        buffer: u32,
        items: &[Item],
        send: &mut dyn FnMut(Vec<u8>) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        let plan = match self.plan_load(buffer, items) {
            Ok(p) => p,
            Err(r) => {
                add(&self.agent.counters.refused, 1);
                return send(encode_refusal(Op::Load, request_id, &r));
            }
        };
        let LoadPlan { engine, pages, layers, layer_bytes: lb, ref sources, .. } = plan;
        let bb = lb * layers;
        let c = &self.agent.counters;
        add(&c.loads, 1);
        let g1 = sources.iter().filter(|s| matches!(s, LoadSource::G1(_))).count();
        let found = sources.len();
        add(&c.loaded_from_g1, g1 as u64);
        add(&c.loaded_from_g2, (found - g1) as u64);
        add(&c.load_misses, (items.len() - found) as u64);
        let started_answer = send(encode_answer(
            Op::Load,
            Status::Ok,
            0,
            request_id,
            &counts(&[found as u32, g1 as u32, (found - g1) as u32]),
        ));
        if let Err(e) = started_answer {
            // The engine went away: nothing was enqueued, give the pins and reservations back.
            self.finish_load(&plan, items, false);
            return Err(e);
        }
        let staging = self.staging.as_ref().map(|(h, _)| h.clone());
        let engine_range = |l: usize, it: &Item| engine.range((l * pages as usize + it.page as usize) * lb, lb);
        let layer_source = |l: usize| {
            let transfers = sources
                .iter()
                .zip(items)
                .filter_map(|(src, it)| {
                    let dst = engine_range(l, it);
                    Some(match src {
                        LoadSource::G1(page) => device_copy(page.buf.range(page.offset + l * lb, lb), dst),
                        LoadSource::Staged { slot, .. } => {
                            Transfer::HostToDevice { src: staging.as_ref()?.range(slot * bb + l * lb, lb), dst }
                        }
                    })
                })
                .collect();
            LayerSource::new(transfers)
        };
        // Promotions: the layer just landed in the engine's pages, copied on into the reserved G1
        // pages (device to device, or over the link to a borrowed one). Their own entry of the
        // layer's handle, so that a failing promotion copy never fails the engine's layer.
        let promotion_source = |l: usize| {
            let transfers: Vec<Transfer> = sources
                .iter()
                .zip(items)
                .filter_map(|(src, it)| match src {
                    LoadSource::Staged { promote_to: Some(page), .. } => {
                        Some(device_copy(engine_range(l, it), page.buf.range(page.offset + l * lb, lb)))
                    }
                    _ => None,
                })
                .collect();
            (!transfers.is_empty()).then(|| LayerSource::new(transfers))
        };
        let started = Instant::now();
        // Layer by layer on the load stream (so in order), answering every layer that has landed
        // between enqueues: layer 0's answer does not wait for the later layers' enqueueing. A
        // layer is answered once its promotion copies have run too, so the engine never reuses
        // its pages under them.
        let mut handles = Vec::with_capacity(layers);
        let mut answered = 0;
        let mut sent = Ok(());
        let answer = |l: usize, r: Result<()>| match r {
            Ok(()) => encode_answer(Op::Layer, Status::Ok, l as u16, request_id, &[]),
            Err(e) => encode_refusal(Op::Layer, request_id, &refusal(e)),
        };
        // The engine's layer (entry 0 of its handle), once it and its promotion (entry 1) are done.
        let landed = |h: &crate::pipeline::LoadHandle<D>| -> Option<Result<()>> {
            if h.layers() > 1 && matches!(h.is_layer_ready(1), Ok(false)) {
                return None;
            }
            match h.is_layer_ready(0) {
                Ok(false) => None,
                r => Some(r.map(|_| ())),
            }
        };
        for l in 0..layers {
            let mut layer = vec![layer_source(l)];
            layer.extend(promotion_source(l));
            handles.push(self.pipe.start_load_kv(layer));
            while answered < handles.len() && sent.is_ok() {
                let Some(r) = landed(&handles[answered]) else { break };
                sent = send(answer(answered, r));
                answered += 1;
            }
        }
        for (l, h) in handles.iter().enumerate().skip(answered) {
            // Its promotion copies first (their outcome is the promotion's, not the engine's).
            let _ = (1..h.layers()).try_for_each(|p| h.wait_for_layer_load(p));
            let r = h.wait_for_layer_load(0);
            if sent.is_ok() {
                sent = send(answer(l, r));
            }
        }
        // Every layer and promotion copy has completed (or failed) before the G1 pages are
        // unpinned and the promoted ones committed: all of them only if every copy landed.
        let all_landed = handles.iter().all(|h| h.wait_all().iter().all(Result::is_ok));
        self.agent.record_copies(found * bb, started);
        self.finish_load(&plan, items, all_landed);
        sent
    }

    /// The end of a load: unpins its G1 hits, and commits its promoted blocks as clean G1 blocks
    /// (`promoted`: their copies landed) or gives their reserved pages back (counted as skipped).
    fn finish_load(&self, plan: &LoadPlan, items: &[Item], promoted: bool) {
        let nsid = &plan.nsid;
        let (mut done, mut skipped) = (0, 0);
        let mut pool = self.agent.pool.lock();
        for (src, it) in plan.sources.iter().zip(items) {
            match src {
                LoadSource::G1(_) => {
                    let _ = pool.unpin(nsid, &it.key);
                }
                LoadSource::Staged { promote_to: Some(_), .. } => {
                    // It came from the store: an eviction drops it (no spill), reported as
                    // still below.
                    if promoted && pool.commit(nsid, &it.key).is_ok() && pool.mark_clean(nsid, &it.key) {
                        done += 1;
                    } else {
                        let _ = pool.abort(nsid, &it.key);
                        skipped += 1;
                    }
                }
                LoadSource::Staged { promote_to: None, .. } => {}
            }
        }
        drop(pool);
        add(&self.agent.counters.promotions, done);
        add(&self.agent.counters.promotions_skipped, skipped);
    }

    /// Which leading keys can be loaded and from where: G1 hits pinned, the rest fetched from the
    /// store into the staging buffer (and, with promotion on, a G1 page reserved for each).
    fn plan_load(&mut self, buffer: u32, items: &[Item]) -> std::result::Result<LoadPlan, Refusal> {
        let (layers, lb, nsid) = {
            let ns = self.opened()?;
            (ns.layers, ns.layer_bytes, ns.id)
        };
        let bb = layers * lb;
        let (engine, pages) = self.buffer_for(buffer, items)?;
        let mut in_g1: Vec<Option<DeviceRange>> = {
            let mut pool = self.agent.pool.lock();
            let (me, now) = (self.device.ordinal(), Instant::now());
            items.iter().map(|it| pool.pin_for_load(me, &nsid, &it.key, now).ok().flatten()).collect()
        };
        let unpin = |agent: &Agent<D, B>, ranges: &[(usize, BlockKey)]| {
            let mut pool = agent.pool.lock();
            for (_, k) in ranges {
                let _ = pool.unpin(&nsid, k);
            }
        };
        let pinned: Vec<(usize, BlockKey)> = in_g1
            .iter()
            .zip(items)
            .enumerate()
            .filter(|(_, (r, _))| r.is_some())
            .map(|(i, (_, it))| (i, it.key))
            .collect();
        // The rest, from the store, as far as the staging buffer reaches.
        let cap = self.agent.config.store_blocks_per_load();
        let wanted: Vec<usize> = (0..items.len()).filter(|i| in_g1[*i].is_none()).take(cap).collect();
        let mut fetched = vec![false; items.len()];
        let mut slot = vec![0usize; items.len()];
        if !wanted.is_empty() {
            let got = (|| -> Result<Vec<bool>> {
                let staging = self.staging_buffer()?;
                let keys: Vec<BlockKey> = wanted.iter().map(|i| items[*i].key).collect();
                let mut out = vec![0u8; keys.len() * bb];
                // Blocks on their way below are read where they are; the rest from the store.
                let mut got = self.agent.read_in_flight(&nsid, &keys, bb, &mut out);
                let ask: Vec<usize> = (0..keys.len()).filter(|&j| !got[j]).collect();
                if !ask.is_empty() {
                    let ask_keys: Vec<BlockKey> = ask.iter().map(|&j| keys[j]).collect();
                    let mut fetched = vec![0u8; ask.len() * bb];
                    match self.agent.store.fetch(&nsid, &ask_keys, bb, &mut fetched) {
                        Ok(landed) => {
                            for (n, (&j, hit)) in ask.iter().zip(landed).enumerate() {
                                if hit {
                                    out[j * bb..][..bb].copy_from_slice(&fetched[n * bb..][..bb]);
                                    got[j] = true;
                                }
                            }
                        }
                        // The store failing is a miss, never an error for the engine; counted.
                        Err(_) => add(&self.agent.counters.store_errors, 1),
                    }
                }
                staging.write(0, &out)?;
                Ok(got)
            })();
            match got {
                Ok(got) => {
                    for (j, (i, hit)) in wanted.iter().zip(got).enumerate() {
                        fetched[*i] = hit;
                        slot[*i] = j;
                    }
                }
                // The store failing is a miss, never an error for the engine; counted.
                Err(_) => add(&self.agent.counters.store_errors, 1),
            }
        }
        let mut sources = Vec::new();
        for i in 0..items.len() {
            match in_g1[i].take() {
                Some(r) => sources.push(LoadSource::G1(r)),
                None if fetched[i] => sources.push(LoadSource::Staged { slot: slot[i], promote_to: None }),
                None => break,
            }
        }
        let found = sources.len();
        let beyond: Vec<(usize, BlockKey)> = pinned.into_iter().filter(|(i, _)| *i >= found).collect();
        unpin(&self.agent, &beyond);
        if self.agent.config.promote_loads {
            self.reserve_promotions(&nsid, items, &mut sources);
        }
        Ok(LoadPlan { engine, pages, nsid, layers, layer_bytes: lb, sources })
    }

    /// Reserves a G1 page for each block of `sources` fetched from the store, through the node
    /// pool like any save (its own pool, a reclaimed or borrowed page, or its own LRU block
    /// evicted; never a pinned one). A block that finds no page, or whose eviction from G1 is
    /// still on its way to the store (its leaving is yet to be reported), is not promoted:
    /// counted, and the load goes on from the staging buffer.
    fn reserve_promotions(&self, nsid: &NamespaceId, items: &[Item], sources: &mut [LoadSource]) {
        if !sources.iter().any(|s| matches!(s, LoadSource::Staged { .. })) {
            return;
        }
        let mut skipped = 0;
        let mut pool = self.agent.pool.lock();
        let (me, now) = (self.device.ordinal(), Instant::now());
        for (src, it) in sources.iter_mut().zip(items) {
            let LoadSource::Staged { promote_to, .. } = src else { continue };
            // Under the pool's lock: a spill leaves the in-flight map only after the pool
            // counted it (and reported the eviction).
            if self.agent.in_flight.lock().contains_key(&(*nsid, it.key)) {
                skipped += 1;
                continue;
            }
            match pool.reserve(me, nsid, &it.key, now) {
                Ok(page) => *promote_to = page, // None: G1 holds it already (or a save fills it)
                Err(_) => skipped += 1,
            }
        }
        self.agent.queue_spills(pool);
        add(&self.agent.counters.promotions_skipped, skipped);
    }

    fn staging_buffer(&mut self) -> Result<HostBuffer> {
        if let Some((h, _)) = &self.staging {
            return Ok(h.clone());
        }
        let bb = self.agent.config.page_bytes;
        let h = HostBuffer::new(bb * self.agent.config.store_blocks_per_load());
        let reg = self.device.register_host(&h)?;
        self.staging = Some((h.clone(), reg));
        Ok(h)
    }
}

impl<D: Device, B: BackingStore> Drop for Session<D, B> {
    fn drop(&mut self) {
        add_neg(&self.agent.counters.connections);
        if let Some(ns) = &self.ns {
            let id = ns.id;
            let keys: Vec<BlockKey> = self.saves.keys().copied().collect();
            self.abort_saves(&id, keys.into_iter());
        }
        for (_, b) in self.buffers.drain() {
            let _ = self.device.free(b.buf);
        }
    }
}

/// A copy between device pages: on one device, or over the link to a peer's (a borrowed page).
fn device_copy(src: DeviceRange, dst: DeviceRange) -> Transfer {
    if src.buf.device() == dst.buf.device() {
        Transfer::DeviceToDevice { src, dst }
    } else {
        Transfer::Peer { src, dst }
    }
}

fn add_neg(c: &AtomicU64) {
    c.fetch_sub(1, Ordering::Relaxed);
}

fn hex(k: &BlockKey) -> String {
    k.0[..8].iter().map(|b| format!("{b:02x}")).collect::<String>() + "…"
}
