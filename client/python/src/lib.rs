//! `kvtier._native`: the Rust client exposed to Python. The pure-Python package `kvtier` re-exports
//! these classes and adds the engine adapters (`kvtier.transformers`).
//!
//! Every call releases the GIL while it runs on one shared tokio runtime. KV crosses the boundary
//! as any C-contiguous buffer (NumPy arrays, `memoryview`s, `bytearray`s; CPU torch tensors, bf16
//! included, through `kvtier.as_bytes`): stores send a raw buffer without copying it (or encode
//! straight from it); `load_into` decodes straight into the caller's buffer, `resume_into` copies
//! the decoded blocks into it, `load`/`resume` return a new `bytearray`.
//!
//! `Client.alloc_buffer` hands out a [`SharedBuffer`]: this process's shared memory (a sealed
//! memfd) that NumPy and torch view without a copy. A call whose KV lives inside one goes over the
//! server's same-node socket when the server is on this host (the server copies each block once,
//! straight into or out of it), and over TCP otherwise (`kvtier_client::near`).

use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::Bytes;
use kvtier_client::{
    BlockDest, ClientConfig, EngineClient, ItemStatus, Miss, ParkOptions, SameNodeMode, Segment, SessionInfo, StoredAs,
};
use kvtier_proto::{CodecId, DType, HashScheme, KvLayout, MemoryOrder, Namespace as NsSpec};
use pyo3::buffer::PyBuffer;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict};

create_exception!(kvtier, KvtierError, PyException, "Base class of every kvtier error.");
create_exception!(
    kvtier,
    UnavailableError,
    KvtierError,
    "The server, or members of its cluster it needed, could not be reached in time. A park or extend short of its copies was kept on the node at its new version: write again with that version."
);
create_exception!(kvtier, CapacityError, KvtierError, "The server has no room (everything resident is pinned).");
create_exception!(kvtier, SessionNotFoundError, KvtierError, "No such session (never parked, dropped or expired).");
create_exception!(kvtier, VersionConflictError, KvtierError, "A session changed since the version given.");
create_exception!(kvtier, InvalidRequestError, KvtierError, "The request does not fit the namespace or the server.");
create_exception!(kvtier, BlockMissingError, KvtierError, "A block the request needs is gone from the server.");
create_exception!(
    kvtier,
    ForbiddenError,
    KvtierError,
    "The namespace belongs to another tenant, which granted this one no such access (a read grant allows reads only)."
);
create_exception!(kvtier, QuotaExceededError, CapacityError, "The tenant is at one of its quotas.");
create_exception!(
    kvtier,
    UnauthenticatedError,
    KvtierError,
    "The server did not accept the credential: no auth token where one is required, a wrong one, or no \
     accepted client certificate. Retrying does not help."
);

/// How long a call blocks before it looks for Ctrl-C (and other signals Python handles).
const SIGNAL_SLICE: Duration = Duration::from_millis(100);

/// The one runtime every client of this process shares.
///
/// One per process: a child forked from a process that used kvtier (`multiprocessing`'s default
/// start method on Linux) gets a runtime of its own on its first call. The one it inherited is
/// never touched there: its threads did not survive the fork, and its epoll instance is the
/// parent's — a socket the child registered in it woke the parent's I/O driver with the child's
/// pointers (the parent crashed) while the child waited forever.
///
/// Its lock is taken only with the GIL held, which a thread calling `os.fork` holds: no other
/// thread holds it at a fork, and the child finds it free.
fn runtime() -> PyResult<&'static tokio::runtime::Runtime> {
    static RT: Mutex<Option<(u32, &'static tokio::runtime::Runtime)>> = Mutex::new(None);
    let pid = std::process::id();
    let mut rt = RT.lock().map_err(|_| KvtierError::new_err("the client runtime's lock is poisoned"))?;
    if let Some((owner, rt)) = *rt {
        if owner == pid {
            return Ok(rt);
        }
    }
    let fresh = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("kvtier-client")
        .enable_all()
        .build()
        .map_err(|e| KvtierError::new_err(format!("cannot start the client runtime: {e}")))?;
    // Leaked, as the inherited one is: a runtime lives as long as its process.
    let fresh: &'static tokio::runtime::Runtime = Box::leak(Box::new(fresh));
    *rt = Some((pid, fresh));
    Ok(fresh)
}

/// Refuses an object made in another process (before a fork): its connections are the parent's
/// sockets, and bytes the child sent on them would interleave with the parent's.
fn same_process(made_in: u32, what: &str) -> PyResult<()> {
    if made_in == std::process::id() {
        return Ok(());
    }
    Err(KvtierError::new_err(format!(
        "this {what} was made in process {made_in}, before a fork; its connections belong to that process: make \
         a new {what} in this one (process {})",
        std::process::id()
    )))
}

fn miss_to_err(m: &Miss) -> PyErr {
    // A server's refusal starts with its stable code (`KV:Auth:Forbidden: forbidden: …`), which
    // the class and the words after it say already: the reason is not put before it again.
    // A generic refusal's detail reads `server refused: KV:…`: from the code on, likewise.
    // Nor is the reason put before a detail that starts with its words (`invalid argument: …`,
    // `codec: …`).
    let msg = match m.detail.find("KV:") {
        Some(i) => m.detail[i..].to_string(),
        None if m.detail.starts_with(&m.reason.replace('_', " ")) => m.detail.clone(),
        None => format!("{}: {}", m.reason, m.detail),
    };
    match m.reason {
        "unauthenticated" => UnauthenticatedError::new_err(msg),
        "connect" | "io" | "timeout" | "protocol" | "unavailable" => UnavailableError::new_err(msg),
        // Nothing was done, and the client registers the namespace again on its next call: a
        // retry works (the node restarted on an empty data dir, or someone unregistered it).
        "unknown_namespace" => UnavailableError::new_err(format!(
            "{msg} (the node does not know it now: it restarted without its data, or the namespace was \
             unregistered; this client registers it again on its next call, so retry)"
        )),
        "capacity" => CapacityError::new_err(msg),
        "quota" => QuotaExceededError::new_err(msg),
        "forbidden" => ForbiddenError::new_err(msg),
        "missing" => BlockMissingError::new_err(msg),
        "session_not_found" | "session_expired" => SessionNotFoundError::new_err(msg),
        "version_conflict" | "session_exists" => VersionConflictError::new_err(msg),
        _ => InvalidRequestError::new_err(msg),
    }
}

/// A KV namespace: tenant, model fingerprint, KV layout, key hashing and salt, and the codec this
/// client stores with. Blocks are `[layer][k|v][token][head][dim]` (layer-first) or
/// `[token][layer][k|v][head][dim]` (block-first), in `dtype`.
#[pyclass(module = "kvtier._native", frozen)]
#[derive(Clone)]
struct Namespace {
    spec: NsSpec,
    codec: CodecId,
    lossless_sink_blocks: usize,
}

#[pymethods]
impl Namespace {
    #[new]
    #[pyo3(signature = (tenant, model, *, layers, kv_heads, head_dim, dtype="bf16", block_tokens=16, salt=&b""[..],
        hashing="blake3", tp_rank=0, tp_world=1, order="layer_first", codec="raw", lossless_sink_blocks=0,
        lossless=false, replicas=0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        tenant: &str,
        model: &str,
        layers: u16,
        kv_heads: u16,
        head_dim: u16,
        dtype: &str,
        block_tokens: u32,
        salt: &[u8],
        hashing: &str,
        tp_rank: u16,
        tp_world: u16,
        order: &str,
        codec: &str,
        lossless_sink_blocks: usize,
        lossless: bool,
        replicas: u8,
    ) -> PyResult<Self> {
        let bad = |m: String| PyValueError::new_err(m);
        let dtype = DType::parse(dtype).map_err(|e| bad(e.to_string()))?;
        let order = match order.to_ascii_lowercase().replace('-', "_").as_str() {
            "layer_first" => MemoryOrder::LayerFirst,
            "block_first" => MemoryOrder::BlockFirst,
            other => return Err(bad(format!("unknown order {other:?}: layer_first or block_first"))),
        };
        let hashing = match hashing.to_ascii_lowercase().as_str() {
            "blake3" => HashScheme::Blake3,
            "sha256" => HashScheme::Sha256,
            other => return Err(bad(format!("unknown hashing {other:?}: blake3 or sha256"))),
        };
        let codec_id = CodecId::from_name(codec).ok_or_else(|| bad(format!("unknown codec {codec:?}")))?;
        let layout = KvLayout {
            layers,
            kv_heads,
            head_dim,
            dtype,
            block_tokens,
            tp_rank,
            tp_world,
            order,
            opaque_block_bytes: 0,
        };
        let spec = NsSpec::new(tenant, model, layout, hashing, salt).with_lossless(lossless).with_replicas(replicas);
        spec.validate().map_err(|e| bad(e.to_string()))?;
        check_codec(&spec, codec_id)?;
        Ok(Namespace { spec, codec: codec_id, lossless_sink_blocks })
    }

    /// A namespace for an engine that hashes its blocks itself and hands kvtier its own bytes: a
    /// block is `block_bytes` bytes in an order only the engine knows (a vLLM offload chunk, an
    /// LMCache chunk, an SGLang host page), stored raw. Keys are the engine's hashes (see
    /// `Client.exists_keys`). Every argument is part of the namespace's identity, so two
    /// engines, models, layouts, TP/PP ranks, KV dtypes, page sizes or hash algorithms never
    /// share a block; `salt` keeps tenants' keys apart.
    #[staticmethod]
    #[pyo3(signature = (tenant, model, *, block_bytes, engine="vllm", engine_layout="", kv_dtype="bf16",
        page_tokens=16, tp_rank=0, tp_world=1, pp_rank=0, pp_world=1, hash_algo="sha256", salt=&b""[..],
        codec="raw"))]
    #[allow(clippy::too_many_arguments)]
    fn opaque(
        tenant: &str,
        model: &str,
        block_bytes: u64,
        engine: &str,
        engine_layout: &str,
        kv_dtype: &str,
        page_tokens: u32,
        tp_rank: u16,
        tp_world: u16,
        pp_rank: u32,
        pp_world: u32,
        hash_algo: &str,
        salt: &[u8],
        codec: &str,
    ) -> PyResult<Self> {
        let bad = |m: String| PyValueError::new_err(m);
        if pp_world == 0 || pp_rank >= pp_world {
            return Err(bad(format!("pp_rank {pp_rank} must be below pp_world {pp_world}")));
        }
        for (name, v) in
            [("engine", engine), ("engine_layout", engine_layout), ("kv_dtype", kv_dtype), ("hash_algo", hash_algo)]
        {
            if v.contains([';', '=']) {
                return Err(bad(format!("{name} {v:?} must not contain ';' or '='")));
            }
        }
        let codec_id = CodecId::from_name(codec).ok_or_else(|| bad(format!("unknown codec {codec:?}")))?;
        // The layout's dtype is informational for an opaque block; the engine's own spelling of
        // it (fp8_e5m2, float16...) is in the identity string.
        let mut layout = KvLayout::opaque(block_bytes, DType::parse(kv_dtype).unwrap_or(DType::Bf16), page_tokens);
        layout.tp_rank = tp_rank;
        layout.tp_world = tp_world;
        let identity = format!(
            "engine={engine};layout={engine_layout};kv_dtype={kv_dtype};pp={pp_rank}/{pp_world};hash={hash_algo}"
        );
        let spec =
            NsSpec::new(tenant, model, layout, HashScheme::Sha256, salt).with_engine(identity).with_lossless(true);
        spec.validate().map_err(|e| bad(e.to_string()))?;
        check_codec(&spec, codec_id)?;
        Ok(Namespace { spec, codec: codec_id, lossless_sink_blocks: 0 })
    }

    /// True for a namespace whose blocks are never quantized (opaque, or made `lossless`).
    #[getter]
    fn lossless(&self) -> bool {
        self.spec.is_lossless()
    }

    /// True for an engine's own bytes (`Namespace.opaque`).
    #[getter]
    fn is_opaque(&self) -> bool {
        self.spec.layout.is_opaque()
    }

    /// The same namespace storing with another codec (loads decode any codec), and optionally
    /// another number of lossless first blocks.
    #[pyo3(signature = (codec, *, lossless_sink_blocks=None))]
    fn with_codec(&self, codec: &str, lossless_sink_blocks: Option<usize>) -> PyResult<Namespace> {
        let codec =
            CodecId::from_name(codec).ok_or_else(|| PyValueError::new_err(format!("unknown codec {codec:?}")))?;
        let lossless_sink_blocks = lossless_sink_blocks.unwrap_or(self.lossless_sink_blocks);
        check_codec(&self.spec, codec)?;
        Ok(Namespace { spec: self.spec.clone(), codec, lossless_sink_blocks })
    }

    /// The first blocks of every context stored raw whatever the codec (attention sinks).
    #[getter]
    fn lossless_sink_blocks(&self) -> usize {
        self.lossless_sink_blocks
    }

    #[getter]
    fn codec(&self) -> &'static str {
        self.codec.name()
    }
    #[getter]
    fn block_tokens(&self) -> usize {
        self.spec.layout.block_tokens as usize
    }
    /// Bytes of one full block in the layout's dtype.
    #[getter]
    fn block_bytes(&self) -> u64 {
        self.spec.layout.block_bytes()
    }
    /// Bytes of one token's KV (all layers, K and V, this rank's heads).
    #[getter]
    fn token_bytes(&self) -> u64 {
        self.spec.layout.bytes_per_token()
    }
    #[getter]
    fn id(&self) -> String {
        self.spec.id().to_hex()
    }

    /// Equal when every argument is (the same blocks, stored the same way).
    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other.cast::<Namespace>().is_ok_and(|o| {
            let o = o.get();
            (o.spec == self.spec) && o.codec == self.codec && o.lossless_sink_blocks == self.lossless_sink_blocks
        })
    }

    fn __hash__(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (self.spec.id().0, self.codec.name(), self.lossless_sink_blocks).hash(&mut h);
        h.finish()
    }

    /// Pickled as its spec (as sent to a server), codec and sink blocks: a namespace goes to
    /// `spawn`ed workers and through queues.
    fn __reduce__<'py>(&self, py: Python<'py>) -> PyResult<Reduced<'py>> {
        use prost::Message;
        let rebuild = py.import("kvtier._native")?.getattr("_namespace_from_state")?;
        let spec = PyBytes::new(py, &self.spec.to_pb().encode_to_vec());
        Ok((rebuild, (spec, self.codec.name().to_string(), self.lossless_sink_blocks)))
    }

    fn __repr__(&self) -> String {
        let l = &self.spec.layout;
        if l.is_opaque() {
            return format!(
                "Namespace.opaque(tenant={:?}, model={:?}, block_bytes={}, page_tokens={}, tp={}/{}, {:?})",
                self.spec.tenant,
                self.spec.model,
                l.opaque_block_bytes,
                l.block_tokens,
                l.tp_rank,
                l.tp_world,
                self.spec.engine
            );
        }
        format!(
            "Namespace(tenant={:?}, model={:?}, layers={}, kv_heads={}, head_dim={}, dtype={:?}, block_tokens={}, codec={:?}, lossless_sink_blocks={})",
            self.spec.tenant,
            self.spec.model,
            l.layers,
            l.kv_heads,
            l.head_dim,
            l.dtype.name(),
            l.block_tokens,
            self.codec.name(),
            self.lossless_sink_blocks
        )
    }
}

/// A caller's buffer held for the length of a call.
///
/// Invariant for the `unsafe` slices below: a `PyBuffer` keeps the exporter's memory alive and
/// fixed in place until it is released (when this is dropped), and `open` checked it is
/// C-contiguous, so `buf_ptr .. buf_ptr + len_bytes` is one valid allocation for as long as `self`
/// lives. Every `Bytes` made from it (`split_blocks`) lives inside the call: the futures run on
/// the calling thread under `block_on` and spawn nothing, so the buffer is released (which takes
/// the GIL) after the call, on the caller's thread.
///
/// The caller's side of the contract (stated in `Client`'s docs): a buffer handed to a call is
/// not resized, freed or written by other Python threads, nor handed to another call, until the
/// call returns — as with any C extension that releases the GIL. Torch tensors are seen through
/// `kvtier.as_bytes`, whose NumPy view does not stop torch from moving the storage (`resize_`,
/// `set_`): the same rule covers them.
struct HeldBuffer(PyBuffer<u8>);

impl HeldBuffer {
    fn open(obj: &Bound<'_, PyAny>, writable: bool) -> PyResult<Self> {
        // NumPy arrays of other dtypes and torch tensors go through `kvtier.as_bytes` (a flat byte
        // view of the same memory).
        let buf = PyBuffer::<u8>::get(obj).or_else(|_| {
            let flat = obj.py().import("kvtier")?.getattr("as_bytes")?.call1((obj,))?;
            PyBuffer::<u8>::get(&flat)
        });
        let buf = buf.map_err(|e| {
            PyValueError::new_err(format!(
                "KV must be a C-contiguous byte buffer (e.g. `memoryview(array).cast('B')`): {e}"
            ))
        })?;
        if !buf.is_c_contiguous() {
            return Err(PyValueError::new_err("KV buffer is not C-contiguous"));
        }
        if writable && buf.readonly() {
            return Err(PyValueError::new_err("the output buffer is read-only"));
        }
        Ok(HeldBuffer(buf))
    }

    fn len(&self) -> usize {
        self.0.len_bytes()
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        if self.len() == 0 {
            return &mut [];
        }
        // SAFETY: see the type's invariant; `open(.., writable = true)` checked it is writable, and
        // `&mut self` keeps this the only slice we hand out.
        unsafe { std::slice::from_raw_parts_mut(self.0.buf_ptr() as *mut u8, self.len()) }
    }
}

impl AsRef<[u8]> for HeldBuffer {
    fn as_ref(&self) -> &[u8] {
        if self.len() == 0 {
            return &[];
        }
        // SAFETY: see the type's invariant.
        unsafe { std::slice::from_raw_parts(self.0.buf_ptr() as *const u8, self.len()) }
    }
}

/// The memory of one `SharedBuffer`: the Rust buffer (each call claims its blocks' places in it:
/// loads to write them, stores to read them) and where it is mapped, fixed for its life.
struct BufferCell {
    buf: kvtier_client::ConcurrentBuffer,
    addr: usize,
    len: usize,
    /// Another mapping of the same memory, someone else's (`Client.register_region`: an engine's
    /// own view of its shared file): arrays there are served as if they lay at `addr`.
    alias: Option<usize>,
}

impl BufferCell {
    /// Offset of `addr .. addr + len` in this buffer, if it lies inside the buffer's mapping or
    /// its alias.
    fn offset_of(&self, addr: usize, len: usize) -> Option<u64> {
        let end = addr.checked_add(len)?;
        [Some(self.addr), self.alias]
            .into_iter()
            .flatten()
            .find(|base| addr >= *base && end <= base + self.len)
            .map(|base| (addr - base) as u64)
    }
}

/// Every live `SharedBuffer` of this process, so a call can tell whether a caller's array lies in
/// one (by address range). Locked only with the GIL held, so never held across a fork (as
/// [`runtime`]'s).
static BUFFERS: Mutex<Vec<Weak<BufferCell>>> = Mutex::new(Vec::new());

/// The shared buffer `held` lies in, and its offset there.
fn shared_range(held: &HeldBuffer) -> Option<(Arc<BufferCell>, u64)> {
    cell_of(held.0.buf_ptr() as usize, held.len())
}

/// The shared buffer the memory at `addr .. addr + len` lies in, and its offset there.
fn cell_of(addr: usize, len: usize) -> Option<(Arc<BufferCell>, u64)> {
    if len == 0 {
        return None;
    }
    let mut all = BUFFERS.lock().ok()?;
    all.retain(|w| w.strong_count() > 0);
    all.iter().filter_map(Weak::upgrade).find_map(|c| c.offset_of(addr, len).map(|off| (c, off)))
}

/// The one shared buffer every segment of every block lies in, and the segments as places in it;
/// `None` if any lies elsewhere (the call then goes the usual way).
fn shared_segments(blocks: &[Vec<RawSegment>]) -> Option<(Arc<BufferCell>, Vec<Vec<Segment>>)> {
    let mut cell: Option<Arc<BufferCell>> = None;
    let mut out = Vec::with_capacity(blocks.len());
    for segs in blocks {
        let mut placed = Vec::with_capacity(segs.len());
        for s in segs {
            let (c, offset) = match &cell {
                // The common case: the same buffer as the segment before.
                Some(first) => (first.clone(), first.offset_of(s.addr, s.len)?),
                None => cell_of(s.addr, s.len)?,
            };
            cell.get_or_insert(c);
            placed.push(Segment { offset, len: s.len as u64 });
        }
        out.push(placed);
    }
    cell.map(|c| (c, out))
}

/// Where a call's blocks lie in a shared buffer: at offsets, one piece each, or each in its own
/// segments.
enum Places {
    Offsets(Vec<u64>),
    Segments(Vec<Vec<Segment>>),
}

impl Places {
    /// Its blocks' count against the keys': a mismatch is the caller's argument (`ValueError`
    /// in both modes, as on the heap path), not a server refusal.
    fn check(&self, keys: usize, what: &str) -> PyResult<()> {
        let n = match self {
            Places::Offsets(o) => o.len(),
            Places::Segments(s) => s.len(),
        };
        if n != keys {
            return Err(PyValueError::new_err(format!("{keys} keys but {n} {what}")));
        }
        Ok(())
    }
}

/// The one shared buffer every one of `held` lies in, and their offsets there; `None` if any lies
/// elsewhere (the call then goes the usual way).
fn shared_ranges(held: &[HeldBuffer]) -> Option<(Arc<BufferCell>, Vec<u64>)> {
    let mut cell: Option<Arc<BufferCell>> = None;
    let mut offsets = Vec::with_capacity(held.len());
    for h in held {
        let (c, off) = shared_range(h)?;
        match &cell {
            Some(first) if !Arc::ptr_eq(first, &c) => return None,
            Some(_) => {}
            None => cell = Some(c),
        }
        offsets.push(off);
    }
    cell.map(|c| (c, offsets))
}

/// Shared memory for kvtier's same-node path, from `Client.alloc_buffer(nbytes)`: a writable
/// buffer (`memoryview(buf)`, `np.frombuffer(buf, dtype)`, `torch.frombuffer(buf, dtype=...)`
/// view it without a copy). `load_into`, `load_keys_into`, `store` and `store_keys` whose KV lies
/// inside one move it through the server's same-node socket when the server runs on this host:
/// the server copies each block straight into (or out of) this memory, no payload on a socket.
///
/// The memory lives as long as this object or any view of it (a view holds a reference); a
/// client closing (or being collected) closes its same-node connections, after which the server
/// no longer maps the buffer: it stays valid here and works with any other client. A buffer
/// dropped while a client is connected stays mapped by the server until that connection's next
/// call, then is unregistered. Calls into the same buffer run side by side when their blocks lie
/// in different places (a prefetch loading some pages while a backup stores others); a load
/// whose places overlap another running call's, or a store whose places overlap a running
/// load's, waits for it. Don't write a place from Python while a call that reads or writes it
/// runs.
#[pyclass(module = "kvtier._native", name = "SharedBuffer", frozen)]
struct PySharedBuffer {
    cell: Arc<BufferCell>,
}

impl PySharedBuffer {
    /// Wraps `buf` and lists it (with `alias`, another mapping of the same memory) for the calls'
    /// address-range check.
    fn of(buf: kvtier_client::SharedBuffer, alias: Option<usize>) -> Self {
        let (addr, len) = (buf.as_ptr() as usize, buf.len());
        let cell = Arc::new(BufferCell { buf: kvtier_client::ConcurrentBuffer::new(buf), addr, len, alias });
        if let Ok(mut all) = BUFFERS.lock() {
            all.retain(|w| w.strong_count() > 0);
            all.push(Arc::downgrade(&cell));
        }
        PySharedBuffer { cell }
    }
}

#[pymethods]
impl PySharedBuffer {
    /// A writable, one-dimensional buffer of unsigned bytes over the whole mapping.
    ///
    /// # Safety
    /// Called by Python with a valid `view`; the view keeps a reference to this object, so the
    /// mapping (owned by `cell`, fixed in place, sealed against shrinking) outlives it.
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        let (addr, len) = (slf.get().cell.addr, slf.get().cell.len);
        let len = ffi::Py_ssize_t::try_from(len).map_err(|_| PyValueError::new_err("buffer too large"))?;
        // SAFETY: `view` comes from Python; the memory is this object's mapping (see above).
        let rc = unsafe { ffi::PyBuffer_FillInfo(view, slf.as_ptr(), addr as *mut c_void, len, 0, flags) };
        if rc != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    fn __len__(&self) -> usize {
        self.cell.len
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.cell.len
    }

    /// Where the buffer is mapped in this process.
    #[getter]
    fn address(&self) -> usize {
        self.cell.addr
    }

    /// For a registered file region (`register_file`, `register_region`): where it starts in
    /// its file; 0 for a buffer from `alloc_buffer`.
    #[getter]
    fn file_offset(&self) -> u64 {
        self.cell.buf.file_offset()
    }

    /// For `register_region`: the address of the caller's own mapping it stands for.
    #[getter]
    fn alias(&self) -> Option<usize> {
        self.cell.alias
    }

    fn __repr__(&self) -> String {
        match self.cell.alias {
            Some(a) => format!("SharedBuffer(nbytes={}, address={:#x}, alias={a:#x})", self.cell.len, self.cell.addr),
            None => format!("SharedBuffer(nbytes={}, address={:#x})", self.cell.len, self.cell.addr),
        }
    }
}

/// Token ids as a call takes them: a one-dimensional integer array (NumPy of any integer dtype,
/// `array.array`, any buffer of 16-, 32- or 64-bit integers), read in one pass without making a
/// Python object per token, or any sequence of `int`s. Each id must lie in `0..2**32`.
struct TokenIds(Vec<u32>);

impl<'a, 'py> FromPyObject<'a, 'py> for TokenIds {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let obj: &Bound<'py, PyAny> = &obj;
        if let Some(ids) = ids_from_buffer::<i64>(obj)
            .or_else(|| ids_from_buffer::<i32>(obj))
            .or_else(|| ids_from_buffer::<u32>(obj))
            .or_else(|| ids_from_buffer::<u64>(obj))
            .or_else(|| ids_from_buffer::<i16>(obj))
            .or_else(|| ids_from_buffer::<u16>(obj))
        {
            return ids.map(TokenIds);
        }
        obj.extract::<Vec<u32>>().map(TokenIds).map_err(|e| {
            PyValueError::new_err(format!("tokens must be a 1-D integer array or a sequence of ints in 0..2**32: {e}"))
        })
    }
}

/// `None` when `obj` is no buffer of `T`; else its ids, or why they are not token ids.
fn ids_from_buffer<T>(obj: &Bound<'_, PyAny>) -> Option<PyResult<Vec<u32>>>
where
    T: pyo3::buffer::Element + Copy + TryInto<u32> + std::fmt::Display,
{
    let buf = PyBuffer::<T>::get(obj).ok()?;
    // pyo3 takes a big-endian format ('>' or '!') for a native one on a little-endian host: such
    // ids (`np.array(ids, '>u4')`) are read by the sequence path instead, as the ints they are.
    let foreign = if cfg!(target_endian = "little") { [b'>', b'!'] } else { [b'<', b'<'] };
    if buf.format().to_bytes().first().is_some_and(|c| foreign.contains(c)) {
        return None;
    }
    if buf.dimensions() != 1 {
        return Some(Err(PyValueError::new_err(format!(
            "tokens must be one-dimensional; this array has shape {:?}",
            buf.shape()
        ))));
    }
    Some(buf.to_vec(obj.py()).and_then(|v| {
        v.into_iter()
            .enumerate()
            .map(|(i, id)| {
                id.try_into().map_err(|_| PyValueError::new_err(format!("token {i} is {id}, not in 0..2**32")))
            })
            .collect()
    }))
}

/// Splits `kv` (held without copying) into block payloads: full blocks of `block_bytes`, then a
/// shorter tail if `tail_bytes > 0`.
fn split_blocks(kv: HeldBuffer, full: usize, block_bytes: usize, tail_bytes: usize) -> PyResult<Vec<Bytes>> {
    let want = full
        .checked_mul(block_bytes)
        .and_then(|w| w.checked_add(tail_bytes))
        .ok_or_else(|| too_large(full, block_bytes))?;
    if kv.len() != want {
        return Err(PyValueError::new_err(format!(
            "KV buffer is {} bytes; {full} full blocks of {block_bytes} bytes{} make {want}",
            kv.len(),
            if tail_bytes > 0 { format!(" and a tail of {tail_bytes}") } else { String::new() }
        )));
    }
    let all = Bytes::from_owner(kv);
    let mut out: Vec<Bytes> = (0..full).map(|i| all.slice(i * block_bytes..(i + 1) * block_bytes)).collect();
    if tail_bytes > 0 {
        out.push(all.slice(full * block_bytes..));
    }
    Ok(out)
}

fn info_dict<'py>(py: Python<'py>, i: &SessionInfo) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("id", &i.id)?;
    d.set_item("version", i.version)?;
    d.set_item("token_count", i.token_count)?;
    d.set_item("blocks", i.blocks)?;
    d.set_item("has_tail", i.has_tail)?;
    d.set_item("bytes", i.bytes)?;
    d.set_item("expires_in_s", i.expires_in.as_secs_f64())?;
    d.set_item("priority", i.priority)?;
    Ok(d)
}

/// A connection to one kvtier server.
///
/// `never_raise=True` (what engines want): every failure of the service — server down, timeout,
/// eviction, a refused request — comes back as a miss (`0`, `None`, an empty result) and is
/// recorded in `last_miss` and `misses`; the engine recomputes. `never_raise=False`: those raise a
/// `KvtierError` subclass whose message starts with the server's stable code (`KV:…`) where the
/// server refused, else with the reason. In both modes a call whose own
/// arguments are wrong (a buffer of the wrong size, read-only or not contiguous, a bad TTL) raises
/// `ValueError` before anything is sent: that is a bug in the caller, not a miss.
///
/// `tokens` are a list of ints or a 1-D integer array (NumPy, `array.array`; read in one pass).
///
/// A buffer given to a call must not be resized, freed or written by another thread, nor given
/// to another call, until the call returns (the GIL is released while it runs).
///
/// KV that lies inside a buffer from `alloc_buffer` (a `SharedBuffer`, or NumPy/torch views of
/// it) moves through the server's same-node socket when the server runs on this host: the server
/// copies it straight into or out of that memory. Anything else, or a server elsewhere, goes over
/// TCP; `samenode_stats()` says which and why.
#[pyclass(module = "kvtier._native")]
struct Client {
    /// Dropped only in the process it was made in (see the `Drop` impl).
    engine: std::mem::ManuallyDrop<EngineClient>,
    budget: Duration,
    never_raise: bool,
    misses: Mutex<Misses>,
    /// The process it was made in (see [`same_process`]).
    pid: u32,
}

impl Drop for Client {
    /// In a forked child a client made by the parent is leaked, not dropped: dropping its sockets
    /// would deregister them from the epoll instance the child shares with the parent, whose
    /// connections would then never be woken again.
    fn drop(&mut self) {
        if self.pid == std::process::id() {
            // SAFETY: `engine` is dropped here once, and never used after (this is the drop).
            unsafe { std::mem::ManuallyDrop::drop(&mut self.engine) };
        }
    }
}

/// The last miss (reason, detail) and the count of misses by reason.
#[derive(Default)]
struct Misses {
    last: Option<(String, String)>,
    by_reason: BTreeMap<String, u64>,
}

impl Client {
    /// Forgets `ns`'s registration on this client: its next call registers it again.
    fn forget(&self, py: Python<'_>, ns: &Namespace) -> PyResult<()> {
        let rt = self.rt()?;
        py.detach(|| rt.block_on(self.engine.forget(&ns.spec)));
        Ok(())
    }

    /// The runtime its calls run on, in the process it was made in (refused in any other).
    fn rt(&self) -> PyResult<&'static tokio::runtime::Runtime> {
        same_process(self.pid, "Client")?;
        runtime()
    }

    /// Runs `op` (GIL released); in never-raise mode a miss becomes `fallback`.
    fn run<T: Send>(
        &self,
        py: Python<'_>,
        name: &'static str,
        ns: &Namespace,
        fallback: impl FnOnce() -> T,
        op: impl AsyncFnOnce(
                kvtier_client::KvClient,
                kvtier_client::NamespaceHandle,
            ) -> Result<T, kvtier_client::ClientError>
            + Send,
    ) -> PyResult<T> {
        self.run_within(py, name, ns, None, fallback, op)
    }

    /// [`Client::run`] within `budget` (the client's own when `None`).
    fn run_within<T: Send>(
        &self,
        py: Python<'_>,
        name: &'static str,
        ns: &Namespace,
        budget: Option<Duration>,
        fallback: impl FnOnce() -> T,
        op: impl AsyncFnOnce(
                kvtier_client::KvClient,
                kvtier_client::NamespaceHandle,
            ) -> Result<T, kvtier_client::ClientError>
            + Send,
    ) -> PyResult<T> {
        let rt = self.rt()?;
        let engine = &self.engine;
        let (spec, codec, sink) = (&ns.spec, ns.codec, ns.lossless_sink_blocks);
        let budget = budget.unwrap_or(self.budget);
        // This thread blocks on the call and runs nothing else: its answers wake it directly. It
        // takes the GIL back every `SIGNAL_SLICE` to look for Ctrl-C (which cancels the call, as
        // its deadline would): a call to a stalled server held KeyboardInterrupt back for its
        // whole budget.
        let res = py.detach(|| {
            let call = engine.call_within(name, spec, budget, |c, h| async move {
                let h = h.with_codec(codec)?.with_lossless_sink_blocks(sink);
                op(c, h).await
            });
            let mut call = std::pin::pin!(call);
            // One caller-thread section for the whole call (its reads' bookkeeping spans the
            // slices); the signal check runs no client code.
            kvtier_client::on_caller_thread(|| loop {
                // The timer made inside the runtime (it needs its time driver).
                let step = rt.block_on(async { tokio::time::timeout(SIGNAL_SLICE, call.as_mut()).await });
                match step {
                    Ok(res) => break Ok::<_, PyErr>(res),
                    Err(_) => Python::attach(|py| py.check_signals())?,
                }
            })
        })?;
        match res {
            Ok(v) => Ok(v),
            Err(m) => self.on_miss(&m).map(|()| fallback()),
        }
    }

    /// The common end of `store_keys*`.
    fn store_blocks<'py>(
        &self,
        py: Python<'py>,
        ns: &Namespace,
        hashes: Vec<Vec<u8>>,
        blocks: Vec<Vec<Bytes>>,
        timeout_s: Option<f64>,
        report: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let n = hashes.len();
        if blocks.len() != n {
            return Err(PyValueError::new_err(format!("{n} keys but {} blocks", blocks.len())));
        }
        let budget = timeout_s.map(|t| positive_duration("timeout_s", t)).transpose()?;
        let st = self.run_within(
            py,
            "store",
            ns,
            budget,
            || None,
            async |c, h| {
                let keys: Vec<_> = hashes.iter().map(|k| h.engine_key(k)).collect();
                c.store_keys_report(&h, &keys, &blocks).await.map(Some)
            },
        )?;
        drop(blocks);
        if let Some(st) = &st {
            if st.iter().any(|r| r.status == ItemStatus::UnknownNamespace) {
                self.forget(py, ns)?;
            }
            if let Some((index, r)) = st.iter().enumerate().find(|(_, r)| !r.status.is_held()) {
                let e = kvtier_client::ClientError::Rejected { index, status: r.status };
                self.on_miss(&Miss { reason: e.reason(), detail: e.to_string() })?;
            }
        }
        if report {
            let words: Vec<String> = match &st {
                Some(st) => st.iter().map(store_word).collect(),
                None => vec!["miss".to_string(); n],
            };
            Ok(words.into_pyobject(py)?.into_any())
        } else {
            let held: Vec<bool> =
                st.map(|v| v.iter().map(|r| r.status.is_held()).collect()).unwrap_or_else(|| vec![false; n]);
            Ok(held.into_pyobject(py)?.into_any())
        }
    }

    /// The common end of `load_keys_into*`.
    fn load_blocks(
        &self,
        py: Python<'_>,
        ns: &Namespace,
        hashes: Vec<Vec<u8>>,
        dests: &mut [BlockDest<'_>],
        timeout_s: Option<f64>,
    ) -> PyResult<Vec<bool>> {
        let n = hashes.len();
        if dests.len() != n {
            return Err(PyValueError::new_err(format!("{n} keys but {} destinations", dests.len())));
        }
        let budget = timeout_s.map(|t| positive_duration("timeout_s", t)).transpose()?;
        self.run_within(
            py,
            "load",
            ns,
            budget,
            || vec![false; n],
            async |c, h| {
                let keys: Vec<_> = hashes.iter().map(|k| h.engine_key(k)).collect();
                c.load_keys_into(&h, &keys, dests, false).await
            },
        )
    }

    /// `load_keys_into` whose destinations lie in one shared buffer, at `places`.
    fn load_shared(
        &self,
        py: Python<'_>,
        ns: &Namespace,
        hashes: Vec<Vec<u8>>,
        cell: Arc<BufferCell>,
        places: Places,
        timeout_s: Option<f64>,
    ) -> PyResult<Vec<bool>> {
        let n = hashes.len();
        places.check(n, "destinations")?;
        let budget = timeout_s.map(|t| positive_duration("timeout_s", t)).transpose()?;
        self.run_within(
            py,
            "load",
            ns,
            budget,
            || vec![false; n],
            async |c, h| {
                let keys: Vec<_> = hashes.iter().map(|k| h.engine_key(k)).collect();
                match &places {
                    Places::Offsets(o) => c.load_keys_into_buffer(&h, &keys, &cell.buf, o, false).await,
                    Places::Segments(s) => c.load_keys_into_buffer_segments(&h, &keys, &cell.buf, s, false).await,
                }
            },
        )
    }

    /// `store_keys` whose blocks lie in one shared buffer, at `places`: True where the server
    /// holds the block now.
    fn store_shared<'py>(
        &self,
        py: Python<'py>,
        ns: &Namespace,
        hashes: Vec<Vec<u8>>,
        cell: Arc<BufferCell>,
        places: Places,
        timeout_s: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let n = hashes.len();
        places.check(n, "blocks")?;
        let budget = timeout_s.map(|t| positive_duration("timeout_s", t)).transpose()?;
        let st = self.run_within(
            py,
            "store",
            ns,
            budget,
            || None,
            async |c, h| {
                let keys: Vec<_> = hashes.iter().map(|k| h.engine_key(k)).collect();
                match &places {
                    Places::Offsets(o) => c.store_keys_from_buffer(&h, &keys, &cell.buf, o).await.map(Some),
                    Places::Segments(s) => c.store_keys_from_buffer_segments(&h, &keys, &cell.buf, s).await.map(Some),
                }
            },
        )?;
        if let Some(st) = &st {
            if let Some((index, status)) = st.iter().enumerate().find(|(_, s)| !s.is_held()) {
                let e = kvtier_client::ClientError::Rejected { index, status: *status };
                self.on_miss(&Miss { reason: e.reason(), detail: e.to_string() })?;
            }
        }
        let held: Vec<bool> = st.map(|v| v.iter().map(|s| s.is_held()).collect()).unwrap_or_else(|| vec![false; n]);
        Ok(held.into_pyobject(py)?.into_any())
    }

    /// Records a miss; an error to raise unless in never-raise mode.
    fn on_miss(&self, m: &Miss) -> PyResult<()> {
        if let Ok(mut g) = self.misses.lock() {
            *g.by_reason.entry(m.reason.to_string()).or_default() += 1;
            g.last = Some((m.reason.to_string(), m.detail.clone()));
        }
        if self.never_raise {
            Ok(())
        } else {
            Err(miss_to_err(m))
        }
    }
}

/// A `RuntimeWarning` naming the members of the cluster a purge or an unregistration did not
/// reach.
fn warn_missed(py: Python<'_>, what: &str, d: &kvtier_client::Deleted) -> PyResult<()> {
    if d.missed().is_empty() {
        return Ok(());
    }
    let who: Vec<String> = d.missed().iter().map(|m| format!("{} ({})", m.node_id, m.reason)).collect();
    let msg = format!(
        "{what} did not reach {} member(s) of the cluster: {}; they may still hold the namespace's \
         blocks until the node reaches them (it retries in the background)",
        who.len(),
        who.join(", ")
    );
    let msg = std::ffi::CString::new(msg).unwrap_or_default();
    PyErr::warn(py, &py.get_type::<pyo3::exceptions::PyRuntimeWarning>(), &msg, 1)
}

#[pymethods]
impl Client {
    /// `addr`: the server's gRPC address (`host:port`). `timeout_s` bounds every call end to end.
    #[new]
    /// `samenode`: `"auto"` (calls whose KV lies in a buffer from `alloc_buffer` use the server's
    /// same-node socket when the server runs on this host) or `"off"` (everything over TCP).
    /// `samenode_poll_us`: the longest a same-node call polls for its answer before it sleeps
    /// (about as long as its copies take, at most this; calls moving over 4 MiB don't, nor calls
    /// while others of this process are in flight, nor while parked calls are answered sooner, as
    /// on a busy machine); 0 never polls, leaving every core to the server. `dataplane_poll_us`: the same for a call over a plain TCP connection, whose reads
    /// take the answer's blocks as they stream in without sleeping.
    /// `tls_ca`: the PEM file of the CA a node that runs TLS has its certificate from (TLS on
    /// both planes); `tls_cert` / `tls_key`: this client's certificate and key, for nodes that take
    /// client certificates (the certificate's name is the tenant); `tls_server_name`: the name the
    /// node's certificate must carry (default: the host of `addr`).
    #[pyo3(signature = (addr, *, never_raise=true, timeout_s=30.0, connections=4, auth_token=None, samenode="auto",
                        samenode_poll_us=2500, dataplane_poll_us=2500, tls_ca=None, tls_cert=None, tls_key=None, tls_server_name=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        addr: &str,
        never_raise: bool,
        timeout_s: f64,
        connections: usize,
        auth_token: Option<String>,
        samenode: &str,
        samenode_poll_us: u64,
        dataplane_poll_us: u64,
        tls_ca: Option<std::path::PathBuf>,
        tls_cert: Option<std::path::PathBuf>,
        tls_key: Option<std::path::PathBuf>,
        tls_server_name: Option<String>,
    ) -> PyResult<Self> {
        kvtier_client::check_server_addr(addr).map_err(PyValueError::new_err)?;
        if !(1..=MAX_CONNECTIONS).contains(&connections) {
            return Err(PyValueError::new_err(format!(
                "connections must be 1 to {MAX_CONNECTIONS}, got {connections}"
            )));
        }
        let tls = match (tls_ca, tls_cert, tls_key) {
            (None, None, None) => None,
            (Some(ca), cert, key) => {
                let ident = match (&cert, &key) {
                    (Some(c), Some(k)) => Some((c.as_path(), k.as_path())),
                    (None, None) => None,
                    _ => return Err(PyValueError::new_err("tls_cert and tls_key go together")),
                };
                let mut t = kvtier_client::ClientTls::from_files(&ca, ident)
                    .map_err(|e| PyValueError::new_err(e.to_string()))?;
                t.server_name = tls_server_name;
                Some(t)
            }
            (None, _, _) => return Err(PyValueError::new_err("tls_cert needs tls_ca (the node's CA)")),
        };
        let budget = positive_duration("timeout_s", timeout_s)?;
        let samenode = match samenode {
            "auto" => SameNodeMode::Auto,
            "off" => SameNodeMode::Off,
            other => return Err(PyValueError::new_err(format!("samenode must be \"auto\" or \"off\", got {other:?}"))),
        };
        let cfg = ClientConfig {
            request_timeout: budget,
            connect_timeout: budget.min(Duration::from_secs(5)),
            data_connections: connections,
            auth_token,
            samenode,
            samenode_poll: Duration::from_micros(samenode_poll_us),
            dataplane_poll: Duration::from_micros(dataplane_poll_us),
            tls,
            ..ClientConfig::default()
        };
        Ok(Client {
            engine: std::mem::ManuallyDrop::new(EngineClient::new(addr, cfg, budget)),
            budget,
            never_raise,
            misses: Mutex::new(Misses::default()),
            pid: std::process::id(),
        })
    }

    /// A new zeroed `SharedBuffer` of `nbytes` bytes: shared memory this client's loads land in
    /// and stores read from directly, over the server's same-node socket when the server runs on
    /// this host (see `SharedBuffer`). View it with `np.frombuffer(buf, dtype=...)` or
    /// `torch.frombuffer(buf, dtype=...)` and pass those views (or slices of them) to
    /// `load_into`, `load_keys_into`, `store` and `store_keys`.
    fn alloc_buffer(&self, py: Python<'_>, nbytes: usize) -> PyResult<PySharedBuffer> {
        // Faulting in a large buffer takes a while: other Python threads run meanwhile. Listed
        // with the GIL held (see `BUFFERS`).
        let buf = py.detach(|| kvtier_client::SharedBuffer::new(nbytes));
        Ok(PySharedBuffer::of(buf.map_err(|e| PyValueError::new_err(e.to_string()))?, None))
    }

    /// Registers `length` bytes from `offset` of an existing file on tmpfs (`/dev/shm`) that
    /// others share and may truncate (it can't be sealed, unlike `alloc_buffer`'s memory):
    /// `file` is a path or an open descriptor (an `int` or an object with `fileno()`, opened
    /// read-write; it is duplicated). Returns a `SharedBuffer` over this process's own mapping
    /// of that region (`length` defaults to the rest of the file). Calls whose KV lies in it go
    /// over the same-node socket, where the server copies with `pread`/`pwrite` and never maps the
    /// file: a truncated file is an error for the call, never a crash of the server.
    #[pyo3(signature = (file, offset=0, length=None))]
    fn register_file(&self, file: &Bound<'_, PyAny>, offset: u64, length: Option<usize>) -> PyResult<PySharedBuffer> {
        use std::os::fd::BorrowedFd;
        let f = if let Ok(path) = file.extract::<std::path::PathBuf>() {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(|e| PyValueError::new_err(format!("{}: {e}", path.display())))?
        } else {
            let fd: c_int = match file.extract() {
                Ok(fd) => fd,
                Err(_) => file.call_method0("fileno")?.extract()?,
            };
            if fd < 0 {
                return Err(PyValueError::new_err("a negative file descriptor"));
            }
            // SAFETY: `fd` is the caller's open descriptor, only borrowed to duplicate it.
            let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
            let owned = borrowed.try_clone_to_owned().map_err(|e| PyValueError::new_err(format!("dup: {e}")))?;
            std::fs::File::from(owned)
        };
        let size = f.metadata().map_err(|e| PyValueError::new_err(format!("fstat: {e}")))?.len();
        let len = match length {
            Some(l) => l,
            None => {
                usize::try_from(size.saturating_sub(offset)).map_err(|_| PyValueError::new_err("file too large"))?
            }
        };
        let buf =
            kvtier_client::SharedBuffer::from_file(f, offset, len).map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(PySharedBuffer::of(buf, None))
    }

    /// Registers memory this process already has mapped shared from a tmpfs file — an engine's
    /// own shared region, e.g. the view vLLM hands its CPU tier over
    /// `/dev/shm/vllm_offload_<engine_id>.mmap` — found through `/proc/self/maps` (an unlinked
    /// file through this process's open descriptor of it). `region` is any writable buffer over
    /// that memory (a `memoryview`, a NumPy array). From then on calls whose KV lies inside
    /// `region` go over the same-node socket, the server copying each block straight into (or
    /// out of) the file's pages with `pread`/`pwrite`: one copy, no staging buffer. Keep the
    /// returned `SharedBuffer` as long as `region` is mapped and drop it before unmapping it
    /// (until then an array at those addresses is taken for that file). A `ValueError` when the
    /// memory is not a shared read-write mapping of one file.
    fn register_region(&self, region: &Bound<'_, PyAny>) -> PyResult<PySharedBuffer> {
        let held = HeldBuffer::open(region, true)?;
        let (addr, len) = (held.0.buf_ptr() as usize, held.len());
        let buf =
            kvtier_client::SharedBuffer::from_mapping(addr, len).map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(PySharedBuffer::of(buf, Some(addr)))
    }

    /// Closes this client's connections to the server (a call still running keeps its own
    /// until it returns). The client stays usable: its next call connects again. Also the end
    /// of a `with kvtier.Client(...) as c:` block.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let rt = self.rt()?;
        py.detach(|| rt.block_on(self.engine.close()));
        Ok(())
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    /// What the same-node path did on the current connection: a dict with `active` (a same-node
    /// connection is open), `loads` and `stores` (calls it served), `fallbacks` (calls whose KV
    /// lay in a shared buffer but went over TCP, by reason: `not_advertised`, `other_host`,
    /// `socket_missing`, `permission_denied`, `encoded`, ...) and `last_fallback` (`(reason,
    /// detail)` or `None`).
    fn samenode_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let rt = self.rt()?;
        let engine = &self.engine;
        let st = py.detach(|| rt.block_on(engine.samenode_stats()));
        let d = PyDict::new(py);
        d.set_item("active", st.active)?;
        d.set_item("loads", st.loads)?;
        d.set_item("stores", st.stores)?;
        let by: BTreeMap<&str, u64> = st.fallbacks.iter().map(|(r, n)| (r.label(), *n)).collect();
        d.set_item("fallbacks", by)?;
        d.set_item("last_fallback", st.last_fallback.map(|(r, why)| (r.label(), why)))?;
        Ok(d)
    }

    /// `(reason, detail)` of the last failed call, or `None`.
    #[getter]
    fn last_miss(&self) -> Option<(String, String)> {
        self.misses.lock().ok().and_then(|g| g.last.clone())
    }

    /// Failed calls so far, by reason.
    #[getter]
    fn misses(&self) -> BTreeMap<String, u64> {
        self.misses.lock().map(|g| g.by_reason.clone()).unwrap_or_default()
    }

    /// How many leading tokens of `tokens` the server holds (a multiple of the block size).
    fn lookup(&self, py: Python<'_>, ns: &Namespace, tokens: TokenIds) -> PyResult<usize> {
        let tokens = tokens.0;
        self.run(py, "lookup", ns, || 0, async |c, h| c.lookup(&h, &tokens).await)
    }

    /// Stores `len(kv) / block_bytes` full blocks of `tokens` from block `first_block` on; `kv`
    /// holds them back to back. Returns the number of blocks stored (a block the server refuses
    /// is a miss; the others are still stored). With a quantizing codec the blocks are encoded
    /// here first: one that can't be (a non-finite value) fails the whole call, nothing sent.
    #[pyo3(signature = (ns, tokens, kv, *, first_block=0))]
    fn store(
        &self,
        py: Python<'_>,
        ns: &Namespace,
        tokens: TokenIds,
        kv: &Bound<'_, PyAny>,
        first_block: usize,
    ) -> PyResult<usize> {
        let tokens = tokens.0;
        let bb = ns.block_bytes() as usize;
        let kv = HeldBuffer::open(kv, false)?;
        if bb == 0 || kv.len() % bb != 0 {
            return Err(PyValueError::new_err(format!(
                "KV buffer is {} bytes, not a whole number of {bb}-byte blocks",
                kv.len()
            )));
        }
        let full = kv.len() / bb;
        let bt = ns.spec.layout.block_tokens as usize;
        if bt > 0 && first_block.checked_add(full).is_none_or(|end| end > tokens.len() / bt) {
            return Err(PyValueError::new_err(format!(
                "KV buffer holds {full} blocks from block {first_block}; the {} tokens make {} full blocks of {bt}",
                tokens.len(),
                tokens.len() / bt
            )));
        }
        let report = if let Some((cell, off)) = shared_range(&kv) {
            // In a shared buffer: the server reads the blocks straight from it (same node).
            self.run(
                py,
                "store",
                ns,
                || None,
                async |c, h| c.store_prefix_from_buffer(&h, &tokens, first_block, &cell.buf, off, full).await.map(Some),
            )?
        } else {
            let blocks = split_blocks(kv, full, bb, 0)?;
            self.run(
                py,
                "store",
                ns,
                || None,
                async |c, h| c.store_from(&h, &tokens, first_block, &blocks).await.map(Some),
            )?
        };
        let Some(report) = report else { return Ok(0) };
        if report.rejected.iter().any(|(_, s)| *s == ItemStatus::UnknownNamespace) {
            self.forget(py, ns)?;
        }
        // Some blocks refused (e.g. no room): the others are stored; the refusal is a miss.
        if let Err(e) = report.ok() {
            self.on_miss(&Miss { reason: e.reason(), detail: e.to_string() })?;
        }
        Ok(report.stored)
    }

    /// Loads the longest stored prefix of `tokens` into `out` (full blocks back to back, in the
    /// layout's dtype; decoded if stored with a codec). Returns the number of tokens loaded: the
    /// prefix, up to the first block missing. `out` must have room for the whole prefix asked
    /// for, or the load stops where it is full (`ValueError` when it has room for no block of a
    /// prefix of one or more). A long load runs as several requests side by
    /// side, each stopping at its own first miss: past the returned prefix, `out` may hold more
    /// blocks (the right KV for those positions, not counted) or be left as it was.
    fn load_into(&self, py: Python<'_>, ns: &Namespace, tokens: TokenIds, out: &Bound<'_, PyAny>) -> PyResult<usize> {
        let tokens = tokens.0;
        let bb = ns.block_bytes() as usize;
        let bt = ns.block_tokens();
        let mut out = HeldBuffer::open(out, true)?;
        let room = out.len().checked_div(bb).unwrap_or(0);
        // A buffer with room for none of a prefix of one or more blocks is a caller's mistake:
        // returning 0 read as a miss.
        if room == 0 && tokens.len() >= bt {
            return Err(PyValueError::new_err(format!(
                "out holds {} bytes: no room for one {bb}-byte block of the {} asked for",
                out.len(),
                tokens.len() / bt.max(1)
            )));
        }
        let usable = tokens.len().min(room * bt);
        if let Some((cell, off)) = shared_range(&out) {
            // In a shared buffer: the server copies the blocks straight into it (same node).
            // `out`, a view of the buffer, is held until the call returns.
            return self.run(
                py,
                "load",
                ns,
                || 0,
                async |c, h| Ok(c.load_prefix_into_buffer(&h, &tokens[..usable], &cell.buf, off, room).await? * bt),
            );
        }
        let dst = out.as_mut_slice();
        // Lookup and load in one request; raw blocks land in `out` straight from the socket.
        self.run(py, "load", ns, || 0, async |c, h| Ok(c.load_prefix_into(&h, &tokens[..usable], dst).await? * bt))
    }

    /// Which of `keys` (the engine's block hashes, `bytes` of any length, salted into `ns`) the
    /// server holds, each key on its own (engines store chunks out of order): a list of bools, all
    /// False on a miss. `timeout_s` bounds this call (default: the client's `timeout_s`).
    #[pyo3(signature = (ns, keys, *, timeout_s=None))]
    fn exists_keys(
        &self,
        py: Python<'_>,
        ns: &Namespace,
        keys: &Bound<'_, PyAny>,
        timeout_s: Option<f64>,
    ) -> PyResult<Vec<bool>> {
        let hashes = engine_hashes(keys)?;
        let n = hashes.len();
        let budget = timeout_s.map(|t| positive_duration("timeout_s", t)).transpose()?;
        self.run_within(
            py,
            "exists",
            ns,
            budget,
            || vec![false; n],
            async |c, h| {
                let keys: Vec<_> = hashes.iter().map(|k| h.engine_key(k)).collect();
                c.exists_keys(&h, &keys).await
            },
        )
    }

    /// Stores full blocks under the engine's `keys`: `kv` is one buffer holding them back to
    /// back, or a list of one buffer per key (rows of an engine's pool, sent from where they
    /// are). A list of bools: True where the server holds the block now (stored, or already
    /// there); all False on a miss. With `report=True`, a list of words instead: `"stored"`,
    /// `"present:<codec>"` (already held, in that codec: in a lossless namespace always a lossless
    /// one) or why it was refused.
    #[pyo3(signature = (ns, keys, kv, *, timeout_s=None, report=false))]
    fn store_keys<'py>(
        &self,
        py: Python<'py>,
        ns: &Namespace,
        keys: &Bound<'_, PyAny>,
        kv: &Bound<'_, PyAny>,
        timeout_s: Option<f64>,
        report: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let hashes = engine_hashes(keys)?;
        let bb = ns.block_bytes() as usize;
        let listed = kv.is_instance_of::<pyo3::types::PyList>() || kv.is_instance_of::<pyo3::types::PyTuple>();
        let mut held = Vec::new();
        if listed {
            for (i, item) in kv.try_iter()?.enumerate() {
                let h = HeldBuffer::open(&item?, false)?;
                if h.len() != bb {
                    return Err(PyValueError::new_err(format!("buffer {i} is {} bytes; a block is {bb}", h.len())));
                }
                held.push(h);
            }
        } else {
            let h = HeldBuffer::open(kv, false)?;
            let want = hashes.len().checked_mul(bb).ok_or_else(|| too_large(hashes.len(), bb))?;
            if h.len() != want {
                return Err(PyValueError::new_err(format!(
                    "KV buffer is {} bytes; {} full blocks of {bb} bytes make {want}",
                    h.len(),
                    hashes.len()
                )));
            }
            held.push(h);
        }
        // In a shared buffer: the server reads the blocks straight from it (same node). A report
        // names the codec of each copy held, which only the data plane's answer carries.
        if !report {
            if let Some((cell, mut offsets)) = shared_ranges(&held) {
                if !listed {
                    let base = offsets[0];
                    offsets = (0..hashes.len() as u64).map(|i| base + i * bb as u64).collect();
                }
                return self.store_shared(py, ns, hashes, cell, Places::Offsets(offsets), timeout_s);
            }
        }
        let blocks: Vec<Vec<Bytes>> = if listed {
            held.into_iter().map(|h| vec![Bytes::from_owner(h)]).collect()
        } else {
            let one = held.pop().ok_or_else(|| PyValueError::new_err("no KV buffer"))?;
            split_blocks(one, hashes.len(), bb, 0)?.into_iter().map(|b| vec![b]).collect()
        };
        self.store_blocks(py, ns, hashes, blocks, timeout_s, report)
    }

    /// `store_keys` from `(address, length)` segments per key (e.g. SGLang's host-pool page
    /// buffers, a page's K and V planes per layer), gathered into each block as it is sent: no
    /// staging copy. Each key's segments must hold one block's bytes; the memory must stay valid
    /// and unchanged until the call returns.
    #[pyo3(signature = (ns, keys, segments, *, timeout_s=None, report=false))]
    fn store_keys_segments<'py>(
        &self,
        py: Python<'py>,
        ns: &Namespace,
        keys: &Bound<'_, PyAny>,
        segments: Vec<Vec<(usize, usize)>>,
        timeout_s: Option<f64>,
        report: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let hashes = engine_hashes(keys)?;
        let segs = self::segments(segments, ns.block_bytes() as usize, false)?;
        if let Some((cell, places)) = shared_segments(&segs) {
            if !report {
                // The memory is read in place by the server over the same-node socket.
                return self.store_shared(py, ns, hashes, cell, Places::Segments(places), timeout_s);
            }
        }
        let blocks = segs.into_iter().map(|v| v.into_iter().map(Bytes::from_owner).collect()).collect();
        self.store_blocks(py, ns, hashes, blocks, timeout_s, report)
    }

    /// Loads the blocks of the engine's `keys` into `out`: one writable buffer for all of them
    /// back to back, or a list of one writable buffer per key. A raw block is received from the
    /// socket straight into its place and verified there. A list of bools: True where block `i`
    /// landed and verified; False for a miss or a block that failed its checksum, whose place
    /// then holds unspecified bytes (never report them as data). All False on a miss.
    #[pyo3(signature = (ns, keys, out, *, timeout_s=None))]
    fn load_keys_into(
        &self,
        py: Python<'_>,
        ns: &Namespace,
        keys: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        timeout_s: Option<f64>,
    ) -> PyResult<Vec<bool>> {
        let hashes = engine_hashes(keys)?;
        let n = hashes.len();
        let bb = ns.block_bytes() as usize;
        let mut held = Vec::new();
        let listed = out.is_instance_of::<pyo3::types::PyList>() || out.is_instance_of::<pyo3::types::PyTuple>();
        if listed {
            for (i, item) in out.try_iter()?.enumerate() {
                let h = HeldBuffer::open(&item?, true)?;
                if h.len() != bb {
                    return Err(PyValueError::new_err(format!("buffer {i} is {} bytes; a block is {bb}", h.len())));
                }
                held.push(h);
            }
            if held.len() != n {
                return Err(PyValueError::new_err(format!("{n} keys but {} buffers", held.len())));
            }
            check_disjoint(held.iter().map(|h| (h.0.buf_ptr() as usize, h.len())).collect())?;
        } else {
            let h = HeldBuffer::open(out, true)?;
            if n.checked_mul(bb) != Some(h.len()) {
                return Err(PyValueError::new_err(format!(
                    "output buffer is {} bytes; {n} blocks of {bb} bytes make {}",
                    h.len(),
                    n as u128 * bb as u128
                )));
            }
            held.push(h);
        }
        if let Some((cell, mut offsets)) = shared_ranges(&held) {
            if !listed {
                let base = offsets[0];
                offsets = (0..n as u64).map(|i| base + i * bb as u64).collect();
            }
            // `held`, views of the buffer, is kept until the call returns.
            return self.load_shared(py, ns, hashes, cell, Places::Offsets(offsets), timeout_s);
        }
        let mut dests: Vec<BlockDest<'_>> = if listed {
            held.iter_mut().map(|h| vec![h.as_mut_slice()]).collect()
        } else {
            held[0].as_mut_slice().chunks_exact_mut(bb.max(1)).take(n).map(|c| vec![c]).collect()
        };
        self.load_blocks(py, ns, hashes, &mut dests, timeout_s)
    }

    /// `load_keys_into` into `(address, length)` segments per key (e.g. SGLang's host-pool page
    /// buffers), filled in order: raw blocks are received from the socket straight into them.
    /// Each key's segments must hold one block's bytes and no two may overlap; the memory must
    /// stay valid and untouched by others until the call returns.
    #[pyo3(signature = (ns, keys, segments, *, timeout_s=None))]
    fn load_keys_into_segments(
        &self,
        py: Python<'_>,
        ns: &Namespace,
        keys: &Bound<'_, PyAny>,
        segments: Vec<Vec<(usize, usize)>>,
        timeout_s: Option<f64>,
    ) -> PyResult<Vec<bool>> {
        let hashes = engine_hashes(keys)?;
        let segs = self::segments(segments, ns.block_bytes() as usize, true)?;
        if let Some((cell, places)) = shared_segments(&segs) {
            return self.load_shared(py, ns, hashes, cell, Places::Segments(places), timeout_s);
        }
        let mut dests: Vec<BlockDest<'_>> = segs
            .into_iter()
            .map(|v| {
                v.into_iter()
                    // SAFETY: see `RawSegment`'s invariant: valid memory of the caller, checked
                    // non-null and pairwise disjoint (`segments(.., writes = true)`), used only
                    // inside this call.
                    .map(|s| unsafe { std::slice::from_raw_parts_mut(s.addr as *mut u8, s.len) })
                    .collect()
            })
            .collect();
        self.load_blocks(py, ns, hashes, &mut dests, timeout_s)
    }

    /// Loads the longest stored prefix of `tokens` into a new `bytearray` (full blocks back to
    /// back, in the layout's dtype).
    fn load<'py>(&self, py: Python<'py>, ns: &Namespace, tokens: TokenIds) -> PyResult<Bound<'py, PyByteArray>> {
        let tokens = tokens.0;
        let blocks = self.run(py, "load", ns, Vec::new, async |c, h| c.load(&h, &tokens).await)?;
        concat(py, &blocks)
    }

    /// Parks a session: `kv` holds the KV of every token of `tokens` (full blocks, then the
    /// partial tail). Blocks the server already has are not sent again. Returns the session's
    /// info (a dict), or `None` on a miss.
    #[pyo3(signature = (ns, session_id, tokens, kv, *, ttl_s=None, priority=None, expected_version=0))]
    #[allow(clippy::too_many_arguments)]
    fn park<'py>(
        &self,
        py: Python<'py>,
        ns: &Namespace,
        session_id: &str,
        tokens: TokenIds,
        kv: &Bound<'_, PyAny>,
        ttl_s: Option<f64>,
        priority: Option<i64>,
        expected_version: u64,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let tokens = tokens.0;
        // 0 low, 1 normal, 2 high: anything else was clamped (5 became 2) or an OverflowError.
        let priority = match priority {
            None => None,
            Some(p @ 0..=2) => Some(p as u32),
            Some(p) => {
                return Err(PyValueError::new_err(format!("priority must be 0 (low), 1 (normal) or 2 (high), got {p}")))
            }
        };
        let opts = ParkOptions { ttl: ttl(ttl_s)?, priority };
        let blocks = session_blocks(ns, &tokens, 0, HeldBuffer::open(kv, false)?)?;
        let info = self.run(
            py,
            "park",
            ns,
            || None,
            async |c, h| c.park(&h, session_id, &tokens, &blocks, &opts, expected_version).await.map(Some),
        )?;
        info.map(|i| info_dict(py, &i)).transpose()
    }

    /// Extends a parked session after a new turn: `tokens` is the whole context now,
    /// `prev_token_count` what the session held at `expected_version`, and `kv` the KV from the
    /// start of the block holding token `prev_token_count` to the end.
    #[allow(clippy::too_many_arguments)]
    fn extend<'py>(
        &self,
        py: Python<'py>,
        ns: &Namespace,
        session_id: &str,
        expected_version: u64,
        prev_token_count: usize,
        tokens: TokenIds,
        kv: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let tokens = tokens.0;
        if prev_token_count > tokens.len() {
            return Err(PyValueError::new_err("prev_token_count is past the tokens given"));
        }
        let base = prev_token_count / ns.block_tokens();
        let blocks = session_blocks(ns, &tokens, base, HeldBuffer::open(kv, false)?)?;
        let info = self.run(
            py,
            "extend",
            ns,
            || None,
            async |c, h| c.extend(&h, session_id, expected_version, prev_token_count, &tokens, &blocks).await.map(Some),
        )?;
        info.map(|i| info_dict(py, &i)).transpose()
    }

    /// Resumes a session: `(info, kv)` with `kv` a `bytearray` of every token's KV (full blocks
    /// then the tail), or `None` on a miss. The TTL restarts.
    fn resume<'py>(
        &self,
        py: Python<'py>,
        ns: &Namespace,
        session_id: &str,
    ) -> PyResult<Option<(Bound<'py, PyDict>, Bound<'py, PyByteArray>)>> {
        let r = self.run(py, "resume", ns, || None, async |c, h| c.resume(&h, session_id).await.map(Some))?;
        let Some(r) = r else { return Ok(None) };
        Ok(Some((info_dict(py, &r.info)?, concat(py, &r.blocks)?)))
    }

    /// Resumes a session into `out` (every token's KV, full blocks then the tail, in the layout's
    /// dtype): its info, or `None` on a miss. `out` must hold `token_count * token_bytes` bytes at
    /// least; a session that does not fit is an `InvalidRequestError` (a miss in never-raise mode).
    fn resume_into<'py>(
        &self,
        py: Python<'py>,
        ns: &Namespace,
        session_id: &str,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let mut out = HeldBuffer::open(out, true)?;
        let dst = out.as_mut_slice();
        let info = self.run(
            py,
            "resume",
            ns,
            || None,
            async |c, h| {
                let r = c.resume(&h, session_id).await?;
                let total: usize = r.blocks.iter().map(|b| b.len()).sum();
                if total > dst.len() {
                    return Err(kvtier_client::ClientError::InvalidArgument(format!(
                        "session {session_id:?} holds {total} bytes of KV; the buffer has {}",
                        dst.len()
                    )));
                }
                concat_into(&r.blocks, dst);
                Ok(Some(r.info))
            },
        )?;
        info.map(|i| info_dict(py, &i)).transpose()
    }

    /// Drops a session, unpinning its blocks. False if there was none (or on a miss).
    fn drop_session(&self, py: Python<'_>, ns: &Namespace, session_id: &str) -> PyResult<bool> {
        self.run(py, "drop", ns, || false, async |c, h| c.drop_session(&h, session_id).await)
    }

    /// Removes `ns` from the server: its sessions are dropped, its blocks removed and its slot
    /// freed, on the node and on every other member of its cluster. Returns `(sessions_dropped,
    /// blocks_removed)` over every member that did it (`(0, 0)` on a miss); a member that could
    /// not be reached is named in a `RuntimeWarning` (the node retries it in the background).
    fn unregister(&self, py: Python<'_>, ns: &Namespace) -> PyResult<(u64, u64)> {
        let gone = self.run(py, "unregister", ns, || None, async |c, h| c.unregister(&h).await.map(Some));
        // Registered again by the next call that names it.
        self.forget(py, ns)?;
        Ok(match gone? {
            Some(d) => {
                warn_missed(py, "unregister", &d)?;
                (d.total_sessions(), d.total_blocks())
            }
            None => (0, 0),
        })
    }

    /// Removes every unpinned block of `ns`, on the node and on every other member of its
    /// cluster. Returns how many blocks went over every member that did it (0 on a miss); a
    /// member that could not be reached is named in a `RuntimeWarning` (the node retries it in
    /// the background).
    fn purge(&self, py: Python<'_>, ns: &Namespace) -> PyResult<u64> {
        let gone = self.run(py, "purge", ns, || None, async |c, h| c.purge(&h).await.map(Some))?;
        Ok(match gone {
            Some(d) => {
                warn_missed(py, "purge", &d)?;
                d.total_blocks()
            }
            None => 0,
        })
    }

    /// Live sessions of `ns`, as dicts.
    fn list_sessions<'py>(&self, py: Python<'py>, ns: &Namespace) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let list = self.run(py, "list", ns, Vec::new, async |c, h| c.list_sessions(Some(&h)).await)?;
        list.iter().map(|i| info_dict(py, i)).collect()
    }

    /// Which nodes hold how long a prefix of `tokens`, and which hold `session`: a dict with
    /// `total_blocks`, `block_tokens`, `membership_stale`, `best` (the node id to send the request
    /// to: the session's node, else the longest prefix; `None` if no node answered) and `nodes`, a
    /// list of dicts (`node_id`, `grpc_addr`, `data_addr`, `answering`, `reachable`,
    /// `prefix_blocks`, `prefix_tokens`, `holds_session`, `session_tokens`, `error`). A node that
    /// did not answer within the server's peer timeout is listed with `reachable=False`. `None` on
    /// a miss (in never-raise mode).
    #[pyo3(signature = (ns, tokens, *, session=None))]
    fn route_hint<'py>(
        &self,
        py: Python<'py>,
        ns: &Namespace,
        tokens: TokenIds,
        session: Option<String>,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let tokens = tokens.0;
        let hint = self.run(
            py,
            "route_hint",
            ns,
            || None,
            async |c, h| c.route_hint(&h, &tokens, session.as_deref()).await.map(Some),
        )?;
        let Some(hint) = hint else { return Ok(None) };
        let d = PyDict::new(py);
        d.set_item("total_blocks", hint.total_blocks)?;
        d.set_item("block_tokens", hint.block_tokens)?;
        d.set_item("membership_stale", hint.membership_stale)?;
        d.set_item("best", hint.best().map(|n| n.node_id.clone()))?;
        let nodes = hint
            .nodes
            .iter()
            .map(|n| {
                let nd = PyDict::new(py);
                nd.set_item("node_id", &n.node_id)?;
                nd.set_item("grpc_addr", &n.grpc_addr)?;
                nd.set_item("data_addr", &n.data_addr)?;
                nd.set_item("answering", n.answering)?;
                nd.set_item("reachable", n.reachable)?;
                nd.set_item("prefix_blocks", n.prefix_blocks)?;
                nd.set_item("prefix_tokens", n.prefix_tokens)?;
                nd.set_item("holds_session", n.holds_session)?;
                nd.set_item("session_tokens", n.session_tokens)?;
                nd.set_item("error", n.error.clone())?;
                Ok(nd)
            })
            .collect::<PyResult<Vec<_>>>()?;
        d.set_item("nodes", nodes)?;
        Ok(Some(d))
    }

    /// The server's KV events for `ns` (or, with `all=True`, every namespace this client may
    /// read), as an iterator of dicts (`node_id`, `seq`, `kind` — `stored`, `evicted`, `purged`,
    /// `session_parked`, `session_dropped`, `session_expired`, `lagged` — `namespace` (hex),
    /// `keys` (list of bytes), `tier`, `to_tier`, `session_id`, `missed`, `unix_ms`). Iterating
    /// waits for the next event with the GIL released; `next_event(timeout_s)` waits at most that
    /// long. `lagged` means events were lost: resync with `lookup` / `route_hint`. Raises (in
    /// either mode) when the watch can't be opened: another tenant's namespace, too many watchers.
    #[pyo3(signature = (ns, *, all=false))]
    fn watch_events(&self, py: Python<'_>, ns: &Namespace, all: bool) -> PyResult<EventStream> {
        let rt = self.rt()?;
        let engine = &self.engine;
        let budget = self.budget;
        let res = py.detach(|| {
            rt.block_on(engine.call_within("watch_events", &ns.spec, budget, |c, h| async move {
                if all {
                    c.watch_events(&[]).await
                } else {
                    c.watch_events(&[&h]).await
                }
            }))
        });
        match res {
            Ok(w) => Ok(EventStream { watch: Mutex::new(Some(w)), pid: std::process::id() }),
            Err(m) => {
                self.on_miss(&m)?;
                Err(miss_to_err(&m))
            }
        }
    }

    /// Server statistics: one dict per tier, plus sessions and namespaces.
    fn stats<'py>(&self, py: Python<'py>, ns: &Namespace) -> PyResult<Bound<'py, PyDict>> {
        let s = self.run(py, "stats", ns, || None, async |c, _| c.stats().await.map(Some))?;
        let d = PyDict::new(py);
        let Some(s) = s else { return Ok(d) };
        d.set_item("sessions", s.sessions)?;
        d.set_item("namespaces", s.namespaces)?;
        d.set_item("uptime_s", s.uptime_ms as f64 / 1000.0)?;
        let tiers = PyDict::new(py);
        for t in &s.tiers {
            let td = PyDict::new(py);
            td.set_item("capacity_bytes", t.capacity_bytes)?;
            td.set_item("resident_bytes", t.resident_bytes)?;
            td.set_item("allocated_bytes", t.allocated_bytes)?;
            td.set_item("pinned_bytes", t.pinned_bytes)?;
            td.set_item("blocks", t.blocks)?;
            td.set_item("hits", t.hits)?;
            td.set_item("misses", t.misses)?;
            td.set_item("evictions", t.evictions)?;
            td.set_item("bytes_in", t.bytes_in)?;
            td.set_item("bytes_out", t.bytes_out)?;
            tiers.set_item(&t.tier, td)?;
        }
        d.set_item("tiers", tiers)?;
        Ok(d)
    }
}

fn ttl(ttl_s: Option<f64>) -> PyResult<Option<Duration>> {
    ttl_s.map(|s| positive_duration("ttl_s", s)).transpose()
}

/// Seconds as a `Duration`: positive, finite and representable, or a `ValueError`.
fn positive_duration(name: &str, seconds: f64) -> PyResult<Duration> {
    match Duration::try_from_secs_f64(seconds) {
        Ok(d) if !d.is_zero() => Ok(d),
        _ => Err(PyValueError::new_err(format!("{name} must be a positive number of seconds, got {seconds}"))),
    }
}

/// Copies blocks back to back into `dst` (at least their total size).
fn concat_into(blocks: &[Bytes], dst: &mut [u8]) {
    let mut at = 0;
    for b in blocks {
        dst[at..at + b.len()].copy_from_slice(b);
        at += b.len();
    }
}

/// A new `bytearray` holding `blocks` back to back.
fn concat<'py>(py: Python<'py>, blocks: &[Bytes]) -> PyResult<Bound<'py, PyByteArray>> {
    let total: usize = blocks.iter().map(|b| b.len()).sum();
    PyByteArray::new_with(py, total, |buf| {
        concat_into(blocks, buf);
        Ok(())
    })
}

/// A session's blocks from block `base` on: full blocks, then the tail if the tokens don't fill
/// whole blocks.
fn session_blocks(ns: &Namespace, tokens: &[u32], base: usize, kv: HeldBuffer) -> PyResult<Vec<Bytes>> {
    let bt = ns.block_tokens();
    let full = (tokens.len() / bt).saturating_sub(base);
    let tail = ns.spec.layout.bytes_for_tokens((tokens.len() % bt) as u32) as usize;
    split_blocks(kv, full, ns.block_bytes() as usize, tail)
}

/// A codec this namespace may store with: no quantizing codec in a lossless namespace, raw only
/// for an opaque layout (the codecs need the KV's shape).
fn check_codec(spec: &NsSpec, codec: CodecId) -> PyResult<()> {
    if spec.is_lossless() && !matches!(codec, CodecId::RAW | CodecId::RAW_LZ4) {
        return Err(PyValueError::new_err(format!(
            "codec {:?} quantizes; this namespace is lossless (opaque or lossless=True): use raw or raw+lz4",
            codec.name()
        )));
    }
    if spec.layout.is_opaque() && codec != CodecId::RAW {
        return Err(PyValueError::new_err(format!(
            "an opaque namespace stores the engine's bytes raw; codec {:?} needs the KV's shape",
            codec.name()
        )));
    }
    // As the codecs refuse it at the first store (every store failed, as a server refusal).
    let quantizes = !matches!(codec, CodecId::RAW | CodecId::RAW_LZ4);
    if quantizes && !spec.layout.is_opaque() && !matches!(spec.layout.dtype, DType::Bf16 | DType::Fp16 | DType::Fp32) {
        return Err(PyValueError::new_err(format!(
            "codec {:?} quantizes bf16, fp16 or fp32 KV; this namespace's dtype is {:?}: use raw or raw+lz4",
            codec.name(),
            spec.layout.dtype
        )));
    }
    Ok(())
}

/// Engine hashes (`bytes`, any length) from a Python sequence.
fn engine_hashes(keys: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<u8>>> {
    let mut out = Vec::new();
    for k in keys.try_iter()? {
        let k = k?;
        let b =
            k.cast::<PyBytes>().map_err(|_| PyValueError::new_err("keys must be bytes (the engine's block hashes)"))?;
        if b.as_bytes().is_empty() {
            return Err(PyValueError::new_err("an engine hash must not be empty"));
        }
        out.push(b.as_bytes().to_vec());
    }
    Ok(out)
}

/// Memory a caller named by address: `(address, length)` segments of its own buffers (an engine's
/// host KV pool pages), as Python integers.
///
/// Invariant for the `unsafe` slices made from it: the caller promises (the `*_segments` methods'
/// documented contract, as with Mooncake's and SGLang's pointer APIs) that every segment is
/// memory of its process, valid, not freed, resized or touched by another thread until the call
/// returns; `segments` checks they are non-null and, for writes, that no two overlap, so the
/// `&mut` slices are disjoint.
#[derive(Clone, Copy)]
struct RawSegment {
    addr: usize,
    len: usize,
}

// SAFETY: a `RawSegment` is an address and a length; the memory it names is only read or written
// inside the call that received it (see the type's invariant), whatever thread runs the I/O.
unsafe impl Send for RawSegment {}

impl AsRef<[u8]> for RawSegment {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: see the type's invariant; `len > 0` and `addr != 0` were checked.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }
}

/// Per-key segment lists, each summing to `block_bytes`; for writes, no two segments overlap.
fn segments(raw: Vec<Vec<(usize, usize)>>, block_bytes: usize, writes: bool) -> PyResult<Vec<Vec<RawSegment>>> {
    let mut all = Vec::new();
    let mut out = Vec::with_capacity(raw.len());
    for (i, segs) in raw.into_iter().enumerate() {
        let mut total = 0usize;
        let mut v = Vec::with_capacity(segs.len());
        for (addr, len) in segs {
            if addr == 0 || len == 0 || addr.checked_add(len).is_none() {
                return Err(PyValueError::new_err(format!(
                    "key {i}: segment ({addr:#x}, {len}) is empty or not memory"
                )));
            }
            total = total.checked_add(len).ok_or_else(|| {
                PyValueError::new_err(format!("key {i}: segments hold more than 2^64 bytes; a block is {block_bytes}"))
            })?;
            v.push(RawSegment { addr, len });
            all.push((addr, len));
        }
        if total != block_bytes {
            return Err(PyValueError::new_err(format!(
                "key {i}: segments hold {total} bytes; a block is {block_bytes}"
            )));
        }
        out.push(v);
    }
    if writes {
        check_disjoint(all)?;
    }
    Ok(out)
}

/// Refuses overlapping destination ranges (two keys loaded into the same bytes).
/// The most data-plane connections a `Client` keeps (each a socket and its buffers on both ends).
const MAX_CONNECTIONS: usize = 1024;

/// The error for `n` blocks of `block_bytes` that no buffer of this machine can hold.
fn too_large(n: usize, block_bytes: usize) -> PyErr {
    PyValueError::new_err(format!("{n} blocks of {block_bytes} bytes pass the address space"))
}

fn check_disjoint(mut ranges: Vec<(usize, usize)>) -> PyResult<()> {
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        if w[0].0 + w[0].1 > w[1].0 {
            return Err(PyValueError::new_err(format!(
                "destinations overlap: ({:#x}, {}) and ({:#x}, {})",
                w[0].0, w[0].1, w[1].0, w[1].1
            )));
        }
    }
    Ok(())
}

/// What a store did to one block, as `store_keys(..., report=True)` says it: `stored`,
/// `present:<codec of the copy held>` or why it was refused.
fn store_word(r: &StoredAs) -> String {
    match (r.status, r.codec) {
        (ItemStatus::Ok, _) => "stored".into(),
        (ItemStatus::Present, Some(c)) => format!("present:{}", c.name()),
        (ItemStatus::Present, None) => "present".into(),
        (other, _) => other.describe().into(),
    }
}

/// An open event stream (`Client.watch_events`); iterate it, or call `next_event(timeout_s)`.
/// `close()` (or dropping it) ends the watch on the server.
#[pyclass(module = "kvtier._native", frozen)]
struct EventStream {
    watch: Mutex<Option<kvtier_client::EventWatch>>,
    /// The process it was opened in (see [`same_process`]).
    pid: u32,
}

fn event_dict<'py>(py: Python<'py>, e: &kvtier_client::KvEvent) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("node_id", &e.node_id)?;
    d.set_item("seq", e.seq)?;
    d.set_item("kind", e.kind.as_str())?;
    d.set_item("namespace", e.namespace.map(|n| n.to_hex()))?;
    let keys: Vec<Bound<'py, PyBytes>> = e.keys.iter().map(|k| PyBytes::new(py, &k.0)).collect();
    d.set_item("keys", keys)?;
    d.set_item("tier", &e.tier)?;
    d.set_item("to_tier", &e.to_tier)?;
    d.set_item("session_id", &e.session_id)?;
    d.set_item("missed", e.missed)?;
    d.set_item("unix_ms", e.unix_ms)?;
    Ok(d)
}

/// What one wait for an event gave.
enum Waited {
    Event(kvtier_client::KvEvent),
    Ended,
    TimedOut,
}

impl EventStream {
    /// Waits up to `slice` for the next event, the GIL released.
    fn wait(&self, py: Python<'_>, slice: Duration) -> PyResult<Waited> {
        same_process(self.pid, "event stream")?;
        let rt = runtime()?;
        let watch = &self.watch;
        let got = py.detach(|| {
            let mut g = watch.lock().map_err(|_| "the event stream's lock is poisoned".to_string())?;
            let Some(w) = g.as_mut() else { return Ok(Waited::Ended) };
            match rt.block_on(async { tokio::time::timeout(slice, w.next()).await }) {
                Err(_) => Ok(Waited::TimedOut),
                Ok(Ok(Some(e))) => Ok(Waited::Event(e)),
                Ok(Ok(None)) => {
                    *g = None;
                    Ok(Waited::Ended)
                }
                Ok(Err(e)) => {
                    *g = None;
                    Err(e.to_string())
                }
            }
        });
        got.map_err(|e| UnavailableError::new_err(format!("io: the event stream failed: {e}")))
    }

    /// The next event within `timeout` (forever when `None`), checking for Ctrl-C between waits.
    fn next_within<'py>(&self, py: Python<'py>, timeout: Option<Duration>) -> PyResult<Option<Waited>> {
        // A timeout past what the clock can add is no deadline at all.
        let deadline = timeout.and_then(|t| std::time::Instant::now().checked_add(t));
        loop {
            let slice = match deadline {
                Some(d) => d.saturating_duration_since(std::time::Instant::now()).min(Duration::from_millis(200)),
                None => Duration::from_millis(200),
            };
            match self.wait(py, slice)? {
                Waited::TimedOut => {
                    py.check_signals()?;
                    if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                        return Ok(None);
                    }
                }
                other => return Ok(Some(other)),
            }
        }
    }
}

#[pymethods]
impl EventStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        match self.next_within(py, None)? {
            Some(Waited::Event(e)) => event_dict(py, &e).map(Some),
            // The stream ended: StopIteration.
            _ => Ok(None),
        }
    }

    /// The next event, or `None` when none came within `timeout_s` or the stream ended;
    /// `timeout_s=0` takes one already arrived, without waiting.
    #[pyo3(signature = (timeout_s=None))]
    fn next_event<'py>(&self, py: Python<'py>, timeout_s: Option<f64>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let timeout = timeout_s
            .map(|t| match Duration::try_from_secs_f64(t) {
                Ok(d) => Ok(d),
                Err(_) => Err(PyValueError::new_err(format!("timeout_s must be 0 or more seconds, got {t}"))),
            })
            .transpose()?;
        match self.next_within(py, timeout)? {
            Some(Waited::Event(e)) => event_dict(py, &e).map(Some),
            _ => Ok(None),
        }
    }

    /// Ends the watch.
    fn close(&self) {
        if let Ok(mut g) = self.watch.lock() {
            let watch = g.take();
            if self.pid != std::process::id() {
                // Another process's (before a fork): leaked, as a `Client` is (see its `Drop`).
                std::mem::forget(watch);
            }
        }
    }
}

impl Drop for EventStream {
    fn drop(&mut self) {
        if self.pid != std::process::id() {
            if let Ok(mut g) = self.watch.lock() {
                std::mem::forget(g.take());
            }
        }
    }
}

/// What `Namespace.__reduce__` returns: the function that rebuilds it, and its arguments.
type Reduced<'py> = (Bound<'py, PyAny>, (Bound<'py, PyBytes>, String, usize));

/// A pickled [`Namespace`] (see `Namespace.__reduce__`).
#[pyfunction]
fn _namespace_from_state(spec: &[u8], codec: &str, lossless_sink_blocks: usize) -> PyResult<Namespace> {
    use prost::Message;
    let bad = |e: String| PyValueError::new_err(format!("not a pickled kvtier Namespace: {e}"));
    let pb = kvtier_proto::pb::NamespaceSpec::decode(spec).map_err(|e| bad(e.to_string()))?;
    let spec = NsSpec::from_pb(&pb).map_err(|e| bad(e.to_string()))?;
    let codec = CodecId::from_name(codec).ok_or_else(|| bad(format!("unknown codec {codec:?}")))?;
    check_codec(&spec, codec)?;
    Ok(Namespace { spec, codec, lossless_sink_blocks })
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Namespace>()?;
    m.add_function(wrap_pyfunction!(_namespace_from_state, m)?)?;
    m.add_class::<Client>()?;
    m.add_class::<EventStream>()?;
    m.add_class::<PySharedBuffer>()?;
    let py = m.py();
    m.add("KvtierError", py.get_type::<KvtierError>())?;
    m.add("UnavailableError", py.get_type::<UnavailableError>())?;
    m.add("CapacityError", py.get_type::<CapacityError>())?;
    m.add("SessionNotFoundError", py.get_type::<SessionNotFoundError>())?;
    m.add("VersionConflictError", py.get_type::<VersionConflictError>())?;
    m.add("InvalidRequestError", py.get_type::<InvalidRequestError>())?;
    m.add("BlockMissingError", py.get_type::<BlockMissingError>())?;
    m.add("ForbiddenError", py.get_type::<ForbiddenError>())?;
    m.add("QuotaExceededError", py.get_type::<QuotaExceededError>())?;
    m.add("UnauthenticatedError", py.get_type::<UnauthenticatedError>())?;
    Ok(())
}
