//! The one error type of the agent. Every variant names something a caller can act on: retry on
//! another device, free memory, fix a handle, recompute. Errors are `Clone` because one failed
//! copy is reported to every waiter of the event that covers it.

use kvtier_kernels::CodecError;

/// What can go wrong moving pages. Nothing in this crate panics on a caller's input; a bad handle,
/// range or configuration comes back as one of these.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AgentError {
    /// No usable device: no CUDA driver library, no GPU at this ordinal, or the `cuda` feature is
    /// off. The agent falls back to the host backend or the engine recomputes.
    #[error("device unavailable: {0}")]
    DeviceUnavailable(String),
    /// A CUDA driver or NVRTC call failed.
    #[error("driver error in {op}: {detail}")]
    Driver { op: &'static str, detail: String },
    /// The device (or the pool) has fewer free bytes than asked for.
    #[error("out of device memory: {requested} bytes requested, {free} free")]
    OutOfMemory { requested: usize, free: usize },
    /// A range does not lie inside its buffer.
    #[error("{what} range {offset}+{len} is outside its buffer of {size} bytes")]
    OutOfBounds { what: &'static str, offset: usize, len: usize, size: usize },
    /// Source and destination of a copy differ in length.
    #[error("copy lengths differ: source {src} bytes, destination {dst} bytes")]
    LengthMismatch { src: usize, dst: usize },
    /// A device-to-device copy whose source and destination ranges overlap.
    #[error("copy source and destination overlap")]
    Overlap,
    /// An IPC handle that names no exported memory: garbage, from another machine, or its
    /// exporter freed the memory.
    #[error("bad IPC handle: {0}")]
    BadIpcHandle(String),
    /// The handle was freed earlier (use after free is refused, never undefined).
    #[error("device buffer {0} was freed")]
    FreedHandle(u64),
    /// The handle was never issued by this device.
    #[error("device buffer {0} is unknown to this device")]
    UnknownHandle(u64),
    /// A handle, stream or registration of one device was used with another.
    #[error("handle of device {found} used on device {expected}")]
    WrongDevice { expected: u32, found: u32 },
    /// Asynchronous copies need host memory registered (pinned) with the device first.
    #[error("host buffer {buffer} is not registered with device {device}")]
    NotRegistered { buffer: u64, device: u32 },
    /// The host buffer is already registered with that device.
    #[error("host buffer {buffer} is already registered with device {device}")]
    AlreadyRegistered { buffer: u64, device: u32 },
    /// A stream's worker is gone (the stream was dropped or its thread died).
    #[error("stream closed")]
    StreamClosed,
    /// A copy between `device` and `peer` where the node has no peer access between them (or
    /// the caller was not given the peer device: see [`crate::Transfer::Peer`]).
    #[error("no peer access from device {device} to device {peer}")]
    NoPeerAccess { device: u32, peer: u32 },
    /// A codec launch was refused (shape, dtype, buffer sizes) or a CPU codec call failed.
    #[error("codec: {0}")]
    Codec(String),
    /// A layer index past the end of a load or save.
    #[error("layer {layer} out of range: {layers} layers")]
    LayerOutOfRange { layer: usize, layers: usize },
    /// Every page of the pool is pinned: nothing can be evicted to make room.
    #[error("page pool exhausted: all {pages} pages pinned")]
    PoolExhausted { pages: usize },
    /// The pool holds no block under that key.
    #[error("block not in the page pool")]
    NotResident,
    /// The block is pinned by a live session and cannot be removed.
    #[error("block is pinned")]
    Pinned,
    /// Unpinning a block that holds no pin.
    #[error("block is not pinned")]
    NotPinned,
    /// A block's bytes do not match the pool's page size.
    #[error("block is {len} bytes, pool pages are {page} bytes")]
    PageSizeMismatch { len: usize, page: usize },
    /// The spill target refused or failed; the evicted block is dropped (it is a cache).
    #[error("spill failed: {0}")]
    Spill(String),
    /// A configuration value is out of range (see the setter's doc).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// No RDMA device can be used (the `rdma` feature is off, no verbs provider, or no device):
    /// bulk moves take the TCP/QUIC path instead.
    #[error("no RDMA device: {0}; use the TCP/QUIC path")]
    NoRdmaDevice(String),
    /// A verbs call failed (opening the device, registering memory, connecting, posting).
    #[error("RDMA error in {op}: {detail}")]
    Rdma { op: &'static str, detail: String },
    /// The peer refused a one-sided access: unknown rkey, or a range outside the memory it
    /// registered (the NIC's remote access error).
    #[error("remote access refused: {0}")]
    RemoteAccess(String),
    /// A one-sided move is outside the leased slot its descriptor names.
    #[error("move of {len} bytes at offset {offset} is outside the leased slot of {slot} bytes")]
    OutsideLease { offset: u64, len: u64, slot: u64 },
    /// A slot or endpoint descriptor from a peer does not decode.
    #[error("bad descriptor: {0}")]
    BadDescriptor(String),
    /// A bulk move did not complete in time. The mover is then broken (its queue pair flushed):
    /// reconnect or use the TCP/QUIC path.
    #[error("{op} did not complete within {waited_ms} ms")]
    Timeout { op: &'static str, waited_ms: u64 },
    /// The driver or hardware cannot do this (e.g. registering device pages through dma-buf).
    #[error("unsupported: {0}")]
    Unsupported(String),
}

impl From<CodecError> for AgentError {
    fn from(e: CodecError) -> Self {
        AgentError::Codec(e.to_string())
    }
}

/// The agent's result type.
pub type Result<T, E = AgentError> = std::result::Result<T, E>;
