//! The `Device` seam: device pages, streams, events, copies (single, batched, between peer
//! devices), registered host memory, an engine's buffers imported by IPC handle and codec kernel
//! launches, with one contract for every backend.
//!
//! - [`host::HostDevice`]: "device" memory in ordinary RAM, each stream a worker thread, so events
//!   complete asynchronously exactly as on a GPU. CI and machines without a GPU run on it.
//! - `cuda::CudaDevice` (cargo feature `cuda`): the same contract through cudarc's driver API,
//!   loaded at run time.
//!
//! # Contract (both backends)
//!
//! - Device memory is named by [`DeviceBuf`] handles (an id, never a raw pointer). Every copy is
//!   checked when it is enqueued: a range outside its buffer is [`AgentError::OutOfBounds`], a freed
//!   handle [`AgentError::FreedHandle`], another device's handle [`AgentError::WrongDevice`], a host
//!   buffer not registered with this device [`AgentError::NotRegistered`]. A refused copy enqueues
//!   nothing.
//! - Work on one stream runs in order; work on different streams may overlap. [`Device::record`]
//!   returns an event that completes when everything enqueued on the stream before it has run; it
//!   completes with an error if any of that work failed while running (errors are reported to the
//!   first event recorded after the failure, not to later ones).
//! - Freeing a buffer invalidates its handle at once; copies already enqueued on it still finish
//!   (the memory outlives them; on CUDA `free` waits for them, peers' copies included). Freeing an
//!   imported buffer unmaps it; the exporter's memory stays.
//! - Host memory is [`HostBuffer`]: the agent owns it, so an in-flight copy can keep it alive.
//!   While a copy into or out of a host buffer is in flight, its bytes in that range are
//!   unspecified to the CPU: wait on the event first (as with `cudaMemcpyAsync`).
//! - A wait does not cancel anything; keep buffers alive until their events complete (dropping a
//!   handle early is safe, the memory stays until the copy is done).

pub mod host;
pub mod shm;

#[cfg(test)]
pub(crate) mod conformance;

#[cfg(feature = "cuda")]
pub mod cuda;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kvtier_kernels::BlockSpec;
use kvtier_proto::CodecId;
use parking_lot::{Mutex, RwLock};

use crate::error::{AgentError, Result};

/// A device's index on its node (CUDA ordinal; any distinct number for host devices).
pub type DeviceOrdinal = u32;

/// A device allocation exported for another process (CUDA: `cuIpcGetMemHandle`'s 64 opaque
/// bytes) with its length: what an engine hands the agent so that the agent reads and writes the
/// engine's own KV buffers ([`Device::import_ipc`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcHandle {
    bytes: [u8; 64],
    len: usize,
}

impl IpcHandle {
    /// A handle received from another process (e.g. over the same-node socket).
    pub fn from_bytes(bytes: [u8; 64], len: usize) -> Self {
        IpcHandle { bytes, len }
    }

    pub fn bytes(&self) -> &[u8; 64] {
        &self.bytes
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Free and total bytes of a device's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemInfo {
    pub free: usize,
    pub total: usize,
}

/// A device allocation: the device it lives on, an id unique on that device, and its length.
/// A plain value (copying it does not copy memory); [`Device::free`] ends its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeviceBuf {
    device: DeviceOrdinal,
    id: u64,
    len: usize,
}

impl DeviceBuf {
    pub(crate) fn new(device: DeviceOrdinal, id: u64, len: usize) -> Self {
        DeviceBuf { device, id, len }
    }

    pub fn device(&self) -> DeviceOrdinal {
        self.device
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `len` bytes from `offset` (checked when used, not here).
    pub fn range(&self, offset: usize, len: usize) -> DeviceRange {
        DeviceRange { buf: *self, offset, len }
    }

    /// The whole buffer.
    pub fn all(&self) -> DeviceRange {
        self.range(0, self.len)
    }
}

/// A byte range of a device buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeviceRange {
    pub buf: DeviceBuf,
    pub offset: usize,
    pub len: usize,
}

impl DeviceRange {
    /// Checks the range lies inside its buffer's recorded length.
    pub(crate) fn check(&self, what: &'static str) -> Result<()> {
        check_bounds(what, self.offset, self.len, self.buf.len)
    }
}

pub(crate) fn check_bounds(what: &'static str, offset: usize, len: usize, size: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(AgentError::OutOfBounds { what, offset, len, size }),
    }
}

static NEXT_HOST_BUFFER: AtomicU64 = AtomicU64::new(1);

/// Host memory owned by the agent: the staging buffers and the same-node path's registered
/// buffers. Cloning shares the memory. Copies to and from a device need it registered with that
/// device first ([`Device::register_host`]).
///
/// ```
/// use kvtier_agent::HostBuffer;
/// let b = HostBuffer::new(8);
/// b.write(2, &[1, 2, 3]).unwrap();
/// assert_eq!(b.to_vec(), [0, 0, 1, 2, 3, 0, 0, 0]);
/// assert!(b.write(7, &[1, 2]).is_err());
/// ```
#[derive(Clone)]
pub struct HostBuffer {
    inner: Arc<HostMem>,
}

pub(crate) struct HostMem {
    id: u64,
    /// CPU access and the host backend's copies take this lock; its heap block never moves, so
    /// `addr` stays valid for a DMA engine while the `Arc` lives.
    pub(crate) data: RwLock<shm::Storage>,
    addr: usize,
    len: usize,
    registered: Mutex<Vec<DeviceOrdinal>>,
}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostBuffer(id {}, {} bytes)", self.inner.id, self.inner.len)
    }
}

impl HostBuffer {
    /// `len` zeroed bytes.
    pub fn new(len: usize) -> Self {
        Self::from_vec(vec![0u8; len])
    }

    /// Takes ownership of `bytes`.
    pub fn from_vec(bytes: Vec<u8>) -> Self {
        let mut data = shm::Storage::Heap(bytes.into_boxed_slice());
        let addr = data.as_mut_ptr() as usize;
        let len = data.len();
        HostBuffer {
            inner: Arc::new(HostMem {
                id: NEXT_HOST_BUFFER.fetch_add(1, Ordering::Relaxed),
                data: RwLock::new(data),
                addr,
                len,
                registered: Mutex::new(Vec::new()),
            }),
        }
    }

    pub fn id(&self) -> u64 {
        self.inner.id
    }

    pub fn len(&self) -> usize {
        self.inner.len
    }

    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// Copies `bytes` in at `offset`.
    pub fn write(&self, offset: usize, bytes: &[u8]) -> Result<()> {
        check_bounds("host", offset, bytes.len(), self.len())?;
        self.inner.data.write()[offset..offset + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }

    /// Copies `out.len()` bytes out from `offset`.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        check_bounds("host", offset, out.len(), self.len())?;
        out.copy_from_slice(&self.inner.data.read()[offset..offset + out.len()]);
        Ok(())
    }

    /// A copy of the whole buffer.
    pub fn to_vec(&self) -> Vec<u8> {
        self.inner.data.read().to_vec()
    }

    /// `len` bytes from `offset`, as a copy source or destination.
    pub fn range(&self, offset: usize, len: usize) -> HostRange {
        HostRange { buf: self.clone(), offset, len }
    }

    /// Whether the buffer is registered with `device`.
    pub fn is_registered(&self, device: DeviceOrdinal) -> bool {
        self.inner.registered.lock().contains(&device)
    }

    pub(crate) fn mem(&self) -> &Arc<HostMem> {
        &self.inner
    }

    /// The start of the memory, for a DMA engine (the CUDA backend, an RDMA NIC) and the
    /// address a bulk mover's slot descriptor names.
    pub(crate) fn addr(&self) -> usize {
        self.inner.addr
    }

    /// Marks the buffer registered with `device`; the [`Registration`] runs `on_drop` when it
    /// is dropped. If the buffer is already registered there, `on_drop` runs now and the answer is
    /// [`AgentError::AlreadyRegistered`] (so a backend that pinned the memory first unpins it).
    pub(crate) fn register(
        &self,
        device: DeviceOrdinal,
        on_drop: Option<Box<dyn FnOnce() + Send + Sync>>,
    ) -> Result<Registration> {
        let mut reg = self.inner.registered.lock();
        if reg.contains(&device) {
            drop(reg);
            if let Some(f) = on_drop {
                f();
            }
            return Err(AgentError::AlreadyRegistered { buffer: self.id(), device });
        }
        reg.push(device);
        Ok(Registration { buf: self.clone(), device, on_drop })
    }

    pub(crate) fn require_registered(&self, device: DeviceOrdinal) -> Result<()> {
        if self.is_registered(device) {
            Ok(())
        } else {
            Err(AgentError::NotRegistered { buffer: self.id(), device })
        }
    }
}

/// A byte range of a host buffer.
#[derive(Debug, Clone)]
pub struct HostRange {
    pub buf: HostBuffer,
    pub offset: usize,
    pub len: usize,
}

impl HostRange {
    pub(crate) fn check(&self) -> Result<()> {
        check_bounds("host", self.offset, self.len, self.buf.len())
    }
}

/// A host buffer's registration with one device (pinned for DMA on CUDA). Dropping it
/// unregisters; later copies with that buffer are [`AgentError::NotRegistered`]. Copies already
/// enqueued keep the memory alive until they finish.
pub struct Registration {
    buf: HostBuffer,
    device: DeviceOrdinal,
    on_drop: Option<Box<dyn FnOnce() + Send + Sync>>,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Registration({:?} on device {})", self.buf, self.device)
    }
}

impl Registration {
    pub fn device(&self) -> DeviceOrdinal {
        self.device
    }

    pub fn buffer(&self) -> &HostBuffer {
        &self.buf
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.buf.inner.registered.lock().retain(|d| *d != self.device);
        if let Some(f) = self.on_drop.take() {
            f();
        }
    }
}

/// A codec kernel launch. `Fp8Encode`/`Fp8Decode`: FP8 E4M3 with one scale per row (per (token,
/// head)), the body of `kvtier_kernels`' `fp8-e4m3` payload (f32 scales, one per row, then one code
/// byte per element; see `kvtier_kernels::payload`). `Encode`/`Decode`: any codec with a kernel,
/// picked by id ([`crate::codec::device_codec`]: FP8, NVFP4 and their `+had` forms), the body of
/// `kvtier_kernels::Codec::new(codec).with_rotation_seed(rotation_seed)`'s payload. Either way the
/// body is byte-identical to the CPU codec's payload after its 32-byte header
/// ([`crate::codec::payload_header`]).
///
/// `status` is 4 bytes the kernel sets to a non-zero `u32` when a row could not be coded (NaN or
/// Inf in the input, or beyond 2^100 for a rotated codec; a NaN code or a bad scale in a body): the
/// output is then unusable. It is written by the launch's own stream work, so read it after the
/// event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CodecOp {
    /// `src` (a block of `spec`, bf16/fp16/fp32) → `body` ([`fp8_body_len`] bytes).
    Fp8Encode { spec: BlockSpec, src: DeviceRange, body: DeviceRange, status: DeviceRange },
    /// `body` → `out` (a block of `spec` in `spec.dtype`).
    Fp8Decode { spec: BlockSpec, body: DeviceRange, out: DeviceRange, status: DeviceRange },
    /// `src` → `body` ([`crate::codec::device_body_len`] bytes) with `codec`; `rotation_seed` is
    /// used by the `+had` codecs.
    Encode {
        codec: CodecId,
        rotation_seed: u16,
        spec: BlockSpec,
        src: DeviceRange,
        body: DeviceRange,
        status: DeviceRange,
    },
    /// `body` → `out` with `codec` and the rotation seed its payload header records.
    Decode {
        codec: CodecId,
        rotation_seed: u16,
        spec: BlockSpec,
        body: DeviceRange,
        out: DeviceRange,
        status: DeviceRange,
    },
}

/// Bytes of an FP8 per-row body for `spec`: 4 per row, 1 per element.
pub fn fp8_body_len(spec: &BlockSpec) -> usize {
    4 * spec.rows() + spec.elements()
}

impl CodecOp {
    /// The codec, rotation seed, shape, block (input of an encode, output of a decode), body and
    /// status of the launch.
    pub(crate) fn parts(&self) -> (CodecId, u16, BlockSpec, DeviceRange, DeviceRange, DeviceRange) {
        match *self {
            CodecOp::Fp8Encode { spec, src, body, status } => (CodecId::FP8_E4M3, 0, spec, src, body, status),
            CodecOp::Fp8Decode { spec, body, out, status } => (CodecId::FP8_E4M3, 0, spec, out, body, status),
            CodecOp::Encode { codec, rotation_seed, spec, src, body, status } => {
                (codec, rotation_seed, spec, src, body, status)
            }
            CodecOp::Decode { codec, rotation_seed, spec, body, out, status } => {
                (codec, rotation_seed, spec, out, body, status)
            }
        }
    }

    /// Whether the launch encodes (else it decodes).
    pub(crate) fn is_encode(&self) -> bool {
        matches!(self, CodecOp::Fp8Encode { .. } | CodecOp::Encode { .. })
    }

    /// Checks codec, shapes and lengths (the same checks on every backend). Returns the row count
    /// and head dim.
    pub(crate) fn validate(&self) -> Result<(usize, usize)> {
        let (codec, _, spec, block, body, status) = self.parts();
        let spec = &spec;
        spec.validate()?;
        if !crate::codec::device_codec(codec) {
            return Err(AgentError::Codec(format!("no device kernel for codec {}", codec.name())));
        }
        if !matches!(spec.dtype, kvtier_proto::DType::Bf16 | kvtier_proto::DType::Fp16 | kvtier_proto::DType::Fp32) {
            return Err(AgentError::Codec(format!(
                "the codec kernels take bf16, fp16 or fp32 blocks, not {:?}",
                spec.dtype
            )));
        }
        if codec != CodecId::FP8_E4M3 && spec.row_len() > crate::codec::MAX_DEVICE_HEAD_DIM {
            return Err(AgentError::Codec(format!(
                "{} kernels take head_dim up to {}, not {}",
                codec.name(),
                crate::codec::MAX_DEVICE_HEAD_DIM,
                spec.row_len()
            )));
        }
        for (r, what) in [(&block, "codec block"), (&body, "codec body"), (&status, "codec status")] {
            r.check(what)?;
            if r.offset % crate::codec::CODEC_ALIGN != 0 {
                return Err(AgentError::Codec(format!(
                    "{what} offset {} is not a multiple of {}",
                    r.offset,
                    crate::codec::CODEC_ALIGN
                )));
            }
        }
        let body_len = crate::codec::device_body_len(codec, spec).unwrap_or(usize::MAX);
        let want = [(block.len, spec.byte_len(), "block"), (body.len, body_len, "body"), (status.len, 4, "status")];
        for (got, want, what) in want {
            if got != want {
                return Err(AgentError::Codec(format!("{what} range is {got} bytes, {want} needed")));
            }
        }
        for (x, y) in [(block, body), (block, status), (body, status)] {
            check_no_overlap(x, y)?;
        }
        let rows = spec.rows();
        if rows > u32::MAX as usize || spec.elements() > isize::MAX as usize {
            return Err(AgentError::Codec(format!("block of {rows} rows is too large for one launch")));
        }
        Ok((rows, spec.row_len()))
    }

    /// The device buffers the launch touches, inputs first: (input, output, status).
    pub(crate) fn buffers(&self) -> [DeviceRange; 3] {
        let (_, _, _, block, body, status) = self.parts();
        if self.is_encode() {
            [block, body, status]
        } else {
            [body, block, status]
        }
    }
}

/// One copy between host and device memory or within a device: the unit of a layer's load or
/// save ([`crate::pipeline`]) and of [`Device::copy_batch`].
#[derive(Debug, Clone)]
pub enum Transfer {
    /// From host bytes (staged from G2 through the same-node path) into device pages.
    HostToDevice { src: HostRange, dst: DeviceRange },
    /// From device pages (G1, or another engine buffer) into device pages.
    DeviceToDevice { src: DeviceRange, dst: DeviceRange },
    /// From device pages out to host bytes (saving).
    DeviceToHost { src: DeviceRange, dst: HostRange },
    /// Between two devices of the node over their link (a page borrowed from a peer GPU): `src`
    /// and `dst` name their own devices. It needs both device objects, so only a
    /// [`crate::pipeline::LayerPipeline`] built [`with_peers`](crate::pipeline::LayerPipeline::with_peers)
    /// enqueues it ([`Device::copy_peer`]); [`Transfer::enqueue`] and [`Device::copy_batch`]
    /// refuse it ([`AgentError::NoPeerAccess`]).
    Peer { src: DeviceRange, dst: DeviceRange },
}

impl Transfer {
    /// Bytes this transfer moves.
    pub fn len(&self) -> usize {
        match self {
            Transfer::HostToDevice { dst, .. } | Transfer::DeviceToDevice { dst, .. } | Transfer::Peer { dst, .. } => {
                dst.len
            }
            Transfer::DeviceToHost { src, .. } => src.len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Enqueues this one copy.
    pub fn enqueue<D: Device + ?Sized>(&self, dev: &D, stream: &D::Stream) -> Result<()> {
        match self {
            Transfer::HostToDevice { src, dst } => dev.copy_h2d(stream, src, *dst),
            Transfer::DeviceToDevice { src, dst } => dev.copy_d2d(stream, *src, *dst),
            Transfer::DeviceToHost { src, dst } => dev.copy_d2h(stream, *src, dst),
            Transfer::Peer { src, dst } => Err(self::peer_refused(dev.ordinal(), src, dst)),
        }
    }
}

/// What moves pages: one GPU (or a host stand-in). See the module doc for the contract.
///
/// Streams and events are the backend's own types; device memory is a [`DeviceBuf`] handle so that
/// misuse (a freed or foreign handle, a range past the end) is an error, never undefined behaviour.
pub trait Device: Send + Sync + 'static {
    /// An in-order queue of work.
    type Stream: Send + Sync;
    /// A point in a stream's work; cloning shares it.
    type Event: Clone + Send + Sync;

    fn ordinal(&self) -> DeviceOrdinal;

    /// Free and total device memory.
    fn mem_info(&self) -> Result<MemInfo>;

    /// Allocates `len` bytes of device memory (contents unspecified; the host backend zeroes).
    fn alloc(&self, len: usize) -> Result<DeviceBuf>;

    /// Frees a buffer. Its handle is invalid afterwards; work already enqueued on it finishes.
    fn free(&self, buf: DeviceBuf) -> Result<()>;

    /// Exports an allocation this device made, for another process to import (the engine's side;
    /// the agent exports nothing in production, tests use it to stand in for an engine). The
    /// exporter must keep the memory until every importer has freed its handle.
    fn export_ipc(&self, buf: DeviceBuf) -> Result<IpcHandle>;

    /// Maps memory another process exported into this device's handle table: the returned
    /// handle works with every copy and codec launch, and [`Device::free`] unmaps it (the
    /// exporter's memory stays). It does not count against this device's free memory. CUDA
    /// refuses to import memory the same process exported; the host backend's handles, in turn,
    /// work only inside one process (its stand-in for an engine is another `HostDevice`).
    fn import_ipc(&self, handle: &IpcHandle) -> Result<DeviceBuf>;

    /// Registers (pins) a host buffer for asynchronous copies with this device until the
    /// returned value is dropped.
    fn register_host(&self, buf: &HostBuffer) -> Result<Registration>;

    fn new_stream(&self) -> Result<Self::Stream>;

    /// Enqueues a host → device copy (`src.len == dst.len`).
    fn copy_h2d(&self, stream: &Self::Stream, src: &HostRange, dst: DeviceRange) -> Result<()>;

    /// Enqueues a device → host copy.
    fn copy_d2h(&self, stream: &Self::Stream, src: DeviceRange, dst: &HostRange) -> Result<()>;

    /// Enqueues a device → device copy on this device (the ranges may be in one buffer; they must
    /// not overlap).
    fn copy_d2d(&self, stream: &Self::Stream, src: DeviceRange, dst: DeviceRange) -> Result<()>;

    /// Turns on direct access from this device to `peer`'s memory and says whether it is on:
    /// CUDA calls `cuCtxEnablePeerAccess` where `cuDeviceCanAccessPeer` allows it, so peer copies
    /// take NVLink or PCIe peer-to-peer instead of bouncing through the host. Turning it on twice
    /// is fine; a device reaches itself. False where the pair has no direct path (another PCIe
    /// root, no P2P, the driver's peer limit): copies between them still work, through the host,
    /// and the node declares no link between them ([`crate::pool::find_links`]), so neither
    /// borrows from the other. The host backend: true, unless either device was built
    /// [`without_peer_access`](host::HostDevice::without_peer_access).
    fn enable_peer_access(&self, peer: &Self) -> Result<bool>;

    /// Turns direct access from this device to `peer`'s memory off again (CUDA:
    /// `cuCtxDisablePeerAccess`; a no-op where it was not on): for a pair that turned out to have
    /// a path one way only, which the node does not use. The host backend: nothing to do.
    fn disable_peer_access(&self, _peer: &Self) -> Result<()> {
        Ok(())
    }

    /// Enqueues a copy between two devices of this backend (peer GPUs over NVLink or PCIe) on a
    /// stream of this device: `src` lives on `src_dev`, `dst` on `dst_dev`, either of which may be
    /// this device. Handles are checked against their own device's table.
    fn copy_peer(
        &self,
        stream: &Self::Stream,
        src_dev: &Self,
        src: DeviceRange,
        dst_dev: &Self,
        dst: DeviceRange,
    ) -> Result<()>;

    /// Enqueues several copies, in order. The host backend checks them all first and enqueues
    /// them as one entry of the stream's queue (nothing is enqueued if one is refused); the
    /// default, which the CUDA backend uses, enqueues them one by one, so a refused copy may
    /// leave the ones before it enqueued. Either way an error means the batch failed.
    fn copy_batch(&self, stream: &Self::Stream, transfers: &[Transfer]) -> Result<()> {
        transfers.iter().try_for_each(|t| t.enqueue(self, stream))
    }

    /// Enqueues a codec kernel.
    fn launch_codec(&self, stream: &Self::Stream, op: &CodecOp) -> Result<()>;

    /// Records an event after everything enqueued on `stream` so far.
    fn record(&self, stream: &Self::Stream) -> Result<Self::Event>;

    /// Makes later work on `stream` wait for `event` (no host blocking).
    fn stream_wait(&self, stream: &Self::Stream, event: &Self::Event) -> Result<()>;

    /// Blocks until `event` completes; its error if the work it covers failed.
    fn wait(&self, event: &Self::Event) -> Result<()>;

    /// Whether `event` has completed (`Err` if it completed with an error).
    fn query(&self, event: &Self::Event) -> Result<bool>;

    /// Reads device bytes synchronously (control path and tests: waits for nothing else to
    /// finish, so order it after the writers' events).
    fn read_sync(&self, src: DeviceRange) -> Result<Vec<u8>>;

    /// Writes device bytes synchronously (control path and tests).
    fn write_sync(&self, dst: DeviceRange, bytes: &[u8]) -> Result<()>;
}

/// The error for a [`Transfer::Peer`] enqueued where only one device is known.
pub(crate) fn peer_refused(device: DeviceOrdinal, src: &DeviceRange, dst: &DeviceRange) -> AgentError {
    let peer = if src.buf.device() == device { dst.buf.device() } else { src.buf.device() };
    AgentError::NoPeerAccess { device, peer }
}

/// Checks a copy's endpoints have the same length.
pub(crate) fn check_lengths(src: usize, dst: usize) -> Result<()> {
    if src == dst {
        Ok(())
    } else {
        Err(AgentError::LengthMismatch { src, dst })
    }
}

/// Checks two ranges of the same buffer do not overlap.
pub(crate) fn check_no_overlap(src: DeviceRange, dst: DeviceRange) -> Result<()> {
    if src.buf.id == dst.buf.id && src.offset < dst.offset + dst.len && dst.offset < src.offset + src.len {
        return Err(AgentError::Overlap);
    }
    Ok(())
}
