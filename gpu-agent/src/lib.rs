//! The agent beside each GPU: an HBM page pool and the movement of pages between an engine's KV
//! buffers and kvtier's tiers, encoding on the way out and decoding on the way in (DESIGN.md,
//! "gpu-agent").
//!
//! Components, one per module:
//!
//! - [`device`]: the [`Device`] seam — device pages, streams, events, batched and peer copies,
//!   registered host memory, import of an engine's buffers by IPC handle, codec kernel launches —
//!   with a host backend ([`HostDevice`], ordinary RAM, a worker thread per stream) that CI runs
//!   on, and a CUDA backend through cudarc behind the `cuda` feature.
//! - [`pipeline`]: layer-pipelined load and save shaped like vLLM's connector
//!   (`start_load_kv` / `wait_for_layer_load` / `save_kv_layer` / `wait_for_save`), so an engine
//!   computes layer 0 while later layers are still being copied.
//! - [`pool`]: the G1 page pool — a capped set of device pages keyed by block, LRU eviction into a
//!   [`Spill`] target, pins for live sessions, loads into engine pages as device-to-device copies —
//!   and [`NodePool`], one such pool per device of a node with the borrowing policy carried out:
//!   a full device's new block goes into a peer's share over the link ([`Transfer::Peer`]), or the
//!   borrow is declined and the device evicts into G2; a lender takes lent pages back first.
//!   [`pool::find_links`] finds the node's links: peer access turned on between each pair of
//!   devices, each link rated by timed peer copies (or a configured rate).
//! - [`policy`]: pure policy (time passed in, no I/O): borrowing HBM from peer GPUs and the rule
//!   that declines a borrow that would push a link past its bandwidth budget.
//! - [`codec`]: FP8 E4M3, NVFP4 and their rotated (`+had`) forms as CUDA C for NVRTC, written to
//!   be byte-identical to `kvtier_kernels`: their arithmetic is compiled as C and matched byte for
//!   byte in every test run; the kernels themselves are checked on a GPU by the ignored tests and
//!   `scripts/gpu-check` (not yet run on a GPU).
//! - [`engine`]: the engine-facing side — an [`engine::Agent`] (the node's G1 pools, one device
//!   or several with links, over a [`engine::BackingStore`], G2 below it) and the engine socket: an engine registers its KV
//!   buffer by IPC handle (a sealed memfd on the host backend), saves pages layer by layer under
//!   block keys and loads keys into pages with a completion per layer. The store's same-node
//!   implementation and the `kvtier agent` command live in cli/ (this crate has no network
//!   client).
//! - [`mover`]: one-sided bulk movers ([`mover::BulkMover`]) into a peer's leased slot, by its
//!   `(addr, rkey, len)` descriptor: an in-process loopback fabric, and RDMA verbs behind the
//!   `rdma` feature (no device at run time: [`AgentError::NoRdmaDevice`], use TCP/QUIC).
//! - [`AgentError`]: the crate's one error type.
//!
//! Not here yet: borrowing between real GPUs has not run (no GPU was lent; on the host backend the
//! link is modelled by the policy's monitor, not by slower copies), the engine's own peer traffic
//! is not fed to the link monitor (only the agent's copies are). The server's remote leases (its
//! `fabric` module, [`mover::SlotDescriptor`]s over the data plane) carry the agent's spills and
//! fetches when `kvtier agent --rdma-device` runs them through the verbs mover (cli's
//! `lease_lane`), staged through host memory: G1 pages are not registered through dma-buf yet.

pub mod codec;
pub mod device;
pub mod engine;
mod error;
pub mod mover;
pub mod pipeline;
pub mod policy;
pub mod pool;

pub use device::host::{EventTrigger, HostDevice, HostEvent, HostStream};
pub use device::{
    fp8_body_len, CodecOp, Device, DeviceBuf, DeviceOrdinal, DeviceRange, HostBuffer, HostRange, IpcHandle, MemInfo,
    Registration, Transfer,
};
pub use error::{AgentError, Result};

#[cfg(feature = "cuda")]
pub use device::cuda::{gpu_report, CudaDevice, CudaEventHandle, CudaStreamHandle};
pub use pipeline::{LayerPipeline, LoadHandle, SaveReport};
pub use pool::{
    BorrowStats, Capacity, LenderStats, MemorySpill, NodeLink, NodePool, PagePool, PoolChange, PoolConfig, PoolStats,
    Spill, SpilledBlock,
};
