//! `kvtier._native`: the Rust client exposed to Python. The pure-Python package `kvtier` re-exports
//! these classes and adds the engine adapters (`kvtier.transformers`).
//!
//! Every call releases the GIL while it runs on one shared tokio runtime. KV crosses the boundary
//! as any C-contiguous buffer (NumPy arrays, `memoryview`s, `bytearray`s; CPU torch tensors, bf16
//! included, through `kvtier.as_bytes`): stores send a raw buffer without copying it (or encode
//! straight from it); `load_into` decodes straight into the caller's buffer, `resume_into` copies
//! the decoded blocks into it, `load`/`resume` return a new `bytearray`.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use kvtier_client::{decode_frame_into, ClientConfig, EngineClient, Miss, ParkOptions, SessionInfo};
use kvtier_proto::{CodecId, DType, HashScheme, KvLayout, MemoryOrder, Namespace as NsSpec};
use pyo3::buffer::PyBuffer;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyDict};
use rayon::prelude::*;

create_exception!(kvtier, KvtierError, PyException, "Base class of every kvtier error.");
create_exception!(kvtier, UnavailableError, KvtierError, "The server could not be reached in time.");
create_exception!(kvtier, CapacityError, KvtierError, "The server has no room (everything resident is pinned).");
create_exception!(kvtier, SessionNotFoundError, KvtierError, "No such session (never parked, dropped or expired).");
create_exception!(kvtier, VersionConflictError, KvtierError, "A session changed since the version given.");
create_exception!(kvtier, InvalidRequestError, KvtierError, "The request does not fit the namespace or the server.");
create_exception!(kvtier, BlockMissingError, KvtierError, "A block the request needs is gone from the server.");

/// The one runtime every client of this process shares.
fn runtime() -> PyResult<&'static tokio::runtime::Runtime> {
    static RT: OnceLock<Result<tokio::runtime::Runtime, String>> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kvtier-client")
            .enable_all()
            .build()
            .map_err(|e| e.to_string())
    })
    .as_ref()
    .map_err(|e| KvtierError::new_err(format!("cannot start the client runtime: {e}")))
}

fn miss_to_err(m: &Miss) -> PyErr {
    let msg = format!("{}: {}", m.reason, m.detail);
    match m.reason {
        "connect" | "io" | "timeout" | "protocol" | "unauthenticated" => UnavailableError::new_err(msg),
        "capacity" => CapacityError::new_err(msg),
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
        hashing="blake3", tp_rank=0, tp_world=1, order="layer_first", codec="raw", lossless_sink_blocks=0))]
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
        let layout = KvLayout { layers, kv_heads, head_dim, dtype, block_tokens, tp_rank, tp_world, order };
        let spec = NsSpec::new(tenant, model, layout, hashing, salt);
        spec.validate().map_err(|e| bad(e.to_string()))?;
        Ok(Namespace { spec, codec: codec_id, lossless_sink_blocks })
    }

    /// The same namespace storing with another codec (loads decode any codec), and optionally
    /// another number of lossless first blocks.
    #[pyo3(signature = (codec, *, lossless_sink_blocks=None))]
    fn with_codec(&self, codec: &str, lossless_sink_blocks: Option<usize>) -> PyResult<Namespace> {
        let codec =
            CodecId::from_name(codec).ok_or_else(|| PyValueError::new_err(format!("unknown codec {codec:?}")))?;
        let lossless_sink_blocks = lossless_sink_blocks.unwrap_or(self.lossless_sink_blocks);
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

    fn __repr__(&self) -> String {
        let l = &self.spec.layout;
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
    let want = full * block_bytes + tail_bytes;
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
/// `KvtierError` subclass whose message starts with the reason. In both modes a call whose own
/// arguments are wrong (a buffer of the wrong size, read-only or not contiguous, a bad TTL) raises
/// `ValueError` before anything is sent: that is a bug in the caller, not a miss.
///
/// `tokens` are a list of ints or a 1-D integer array (NumPy, `array.array`; read in one pass).
///
/// A buffer given to a call must not be resized, freed or written by another thread, nor given
/// to another call, until the call returns (the GIL is released while it runs).
#[pyclass(module = "kvtier._native")]
struct Client {
    engine: EngineClient,
    never_raise: bool,
    misses: Mutex<Misses>,
}

/// The last miss (reason, detail) and the count of misses by reason.
#[derive(Default)]
struct Misses {
    last: Option<(String, String)>,
    by_reason: BTreeMap<String, u64>,
}

impl Client {
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
        let rt = runtime()?;
        let engine = &self.engine;
        let (spec, codec, sink) = (&ns.spec, ns.codec, ns.lossless_sink_blocks);
        let res = py.detach(|| {
            rt.block_on(engine.call(name, spec, |c, h| async move {
                let h = h.with_codec(codec)?.with_lossless_sink_blocks(sink);
                op(c, h).await
            }))
        });
        match res {
            Ok(v) => Ok(v),
            Err(m) => self.on_miss(&m).map(|()| fallback()),
        }
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

#[pymethods]
impl Client {
    /// `addr`: the server's gRPC address (`host:port`). `timeout_s` bounds every call end to end.
    #[new]
    #[pyo3(signature = (addr, *, never_raise=true, timeout_s=30.0, connections=4, auth_token=None))]
    fn new(
        addr: &str,
        never_raise: bool,
        timeout_s: f64,
        connections: usize,
        auth_token: Option<String>,
    ) -> PyResult<Self> {
        let budget = positive_duration("timeout_s", timeout_s)?;
        let cfg = ClientConfig {
            request_timeout: budget,
            connect_timeout: budget.min(Duration::from_secs(5)),
            data_connections: connections.max(1),
            auth_token,
            ..ClientConfig::default()
        };
        Ok(Client { engine: EngineClient::new(addr, cfg, budget), never_raise, misses: Mutex::new(Misses::default()) })
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
    /// is a miss; the others are still stored).
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
        let blocks = split_blocks(kv, full, bb, 0)?;
        let report = self.run(
            py,
            "store",
            ns,
            || None,
            async |c, h| c.store_from(&h, &tokens, first_block, &blocks).await.map(Some),
        )?;
        let Some(report) = report else { return Ok(0) };
        // Some blocks refused (e.g. no room): the others are stored; the refusal is a miss.
        if let Err(e) = report.ok() {
            self.on_miss(&Miss { reason: e.reason(), detail: e.to_string() })?;
        }
        Ok(report.stored)
    }

    /// Loads the longest stored prefix of `tokens` into `out` (full blocks back to back, in the
    /// layout's dtype; decoded if stored with a codec). Returns the number of tokens written;
    /// `out` must have room for the whole prefix asked for, or the load stops where it is full.
    fn load_into(&self, py: Python<'_>, ns: &Namespace, tokens: TokenIds, out: &Bound<'_, PyAny>) -> PyResult<usize> {
        let tokens = tokens.0;
        let bb = ns.block_bytes() as usize;
        let bt = ns.block_tokens();
        let mut out = HeldBuffer::open(out, true)?;
        let room = out.len().checked_div(bb).unwrap_or(0);
        let usable = tokens.len().min(room * bt);
        let dst = out.as_mut_slice();
        self.run(
            py,
            "load",
            ns,
            || 0,
            async |c, h| {
                let frames = c.load_prefix_frames(&h, &tokens[..usable]).await?;
                dst[..frames.len() * bb]
                    .par_chunks_mut(bb)
                    .zip(frames.par_iter())
                    .try_for_each(|(chunk, f)| decode_frame_into(f, chunk))?;
                Ok(frames.len() * bt)
            },
        )
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
        priority: Option<u32>,
        expected_version: u64,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let tokens = tokens.0;
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

    /// Live sessions of `ns`, as dicts.
    fn list_sessions<'py>(&self, py: Python<'py>, ns: &Namespace) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let list = self.run(py, "list", ns, Vec::new, async |c, h| c.list_sessions(Some(&h)).await)?;
        list.iter().map(|i| info_dict(py, i)).collect()
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

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Namespace>()?;
    m.add_class::<Client>()?;
    let py = m.py();
    m.add("KvtierError", py.get_type::<KvtierError>())?;
    m.add("UnavailableError", py.get_type::<UnavailableError>())?;
    m.add("CapacityError", py.get_type::<CapacityError>())?;
    m.add("SessionNotFoundError", py.get_type::<SessionNotFoundError>())?;
    m.add("VersionConflictError", py.get_type::<VersionConflictError>())?;
    m.add("InvalidRequestError", py.get_type::<InvalidRequestError>())?;
    m.add("BlockMissingError", py.get_type::<BlockMissingError>())?;
    Ok(())
}
