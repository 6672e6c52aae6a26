//! kvtier-bench: every performance figure of kvtier printed beside a baseline measured in the same
//! run — the machine's limits (memcpy, loopback TCP, Unix sockets, the disk), a real Redis, and the
//! prefill a hit saves — plus a workload trace generator and a capacity planner.
//!
//! Pure parts (tested): [`stats`], [`model`] (KV bytes, prefill FLOPs, GPUs, links, planner),
//! [`trace`] (deterministic Zipf workload). Measuring parts: [`limits`], [`blocks`], [`replay`],
//! [`contention`] (tail latency while sessions park), [`cpu`] (server and client CPU per GB), [`samenode`] (registered buffers beside
//! memcpy and TCP), [`tls`] (the data plane over TLS beside plain TCP), [`cluster`] (1–3 nodes:
//! cross-node loads, the trace over a cluster),
//! with real server processes from [`servers`] (on CPUs of their own with `--pin`: [`placement`])
//! and the Python side from [`pydriver`]; output
//! through [`report`] and [`plot`].

pub mod blocks;
pub mod cluster;
pub mod contention;
pub mod cpu;
pub mod limits;
pub mod model;
pub mod placement;
pub mod plot;
pub mod pydriver;
pub mod replay;
pub mod report;
pub mod samenode;
pub mod servers;
pub mod stats;
pub mod tls;
pub mod trace;

pub use stats::{gbps, median, percentile};
