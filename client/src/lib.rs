//! `kvtier-client`: what inference engines link to reach a kvtier node.
//!
//! - [`KvClient`]: typed async API — `lookup`, `store`, `load`, session `park` / `extend` /
//!   `resume` / `drop_session` — over one gRPC channel (control) and a pool of data-plane
//!   connections (payloads), with batching and concurrent batches. Data-plane connections are TCP
//!   to the address the server announces, or come from a [`DataPlaneConnector`]
//!   ([`KvClient::connect_with`]: a Unix socket, an in-process stream).
//! - [`SameNode`] ([`KvClient::samenode`]): on the server's host, blocks loaded into and stored
//!   from this process's own [`SharedBuffer`]s by offset, one copy each way, no payload on a socket.
//!   [`near`]: the same, automatic — `KvClient`'s `*_buffer` calls go over the same-node socket
//!   when the server is on this host, and over TCP (counted, logged once) when it can't.
//! - [`OwnerRouter`]: in a cluster, stores and loads sent straight to each block's owner (the
//!   members from `Members`, placed as the nodes place them), one hop instead of two.
//! - [`EngineClient`]: the never-raise wrapper; every error or timeout becomes a [`Miss`].
//!
//! ```no_run
//! # async fn demo() -> Result<(), kvtier_client::ClientError> {
//! use bytes::Bytes;
//! use kvtier_client::{ClientConfig, KvClient};
//! use kvtier_proto::{DType, HashScheme, KvLayout, Namespace};
//! let client = KvClient::connect("127.0.0.1:7070", ClientConfig::default()).await?;
//! let layout = KvLayout::new(32, 8, 128, DType::Bf16, 16);
//! let ns = client.register(Namespace::new("acme", "llama-3-8b", layout, HashScheme::Blake3, b"secret")).await?;
//! let tokens: Vec<u32> = (0..4096).collect();
//! let blocks: Vec<Bytes> = (0..256).map(|_| Bytes::from(vec![0u8; layout.block_bytes() as usize])).collect();
//! client.store(&ns, &tokens, &blocks).await?.ok()?;
//! assert_eq!(client.lookup(&ns, &tokens).await?, 4096);
//! # Ok(()) }
//! ```

mod claims;
mod client;
mod conn;
mod connector;
mod engine;
mod error;
mod fork;
pub mod near;
mod polled;
mod quic;
mod samenode;
mod tls;
mod wait;

pub use claims::{BufferClaim, ConcurrentBuffer, LoadBuffer, StoreBuffer};
pub use client::{
    check_server_addr, ClusterMembers, Deleted, EventKind, EventWatch, KvEvent, NodeHolding, OwnerRouter, RouteHint,
};
pub use client::{
    decode_frame, decode_frame_into, BlockDest, ClientConfig, KvClient, NamespaceHandle, ParkOptions, ResumedSession,
    SessionInfo, SessionManifest, StoreReport, StoredAs,
};
pub use conn::lease::{GetGrant, LeaseSession, PutGrant};
#[cfg(unix)]
pub use connector::UnixConnector;
pub use connector::{BoxedStream, ConnectFuture, DataPlaneConnector, DataStream};
pub use engine::{EngineClient, Loaded, Miss};
pub use error::ClientError;
pub use kvtier_proto::dataplane::ItemStatus;
pub use kvtier_proto::samenode::Segment;
pub use near::{FallbackReason, SameNodeMode, SameNodeStats};
pub use polled::on_caller_thread;
pub use quic::QuicConnector;
pub use samenode::{BufferId, SameNode, SharedBuffer};
pub use tls::ClientTls;
