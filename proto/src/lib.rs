//! The language every kvtier part speaks, with no I/O.
//!
//! - [`KvLayout`] and [`DType`]: the shape of an engine's KV cache, which fixes a block's byte size.
//! - [`Namespace`] and [`NamespaceId`]: tenant + model + layout + hashing scheme + salt. Keys in
//!   different namespaces never match.
//! - [`BlockKey`]: the 256-bit chained prefix hash of a block of tokens (BLAKE3 or SHA-256,
//!   salted per namespace), or an engine's own hash handed in as an opaque key.
//! - [`BlockFrame`]: a checksummed header + payload; the same bytes travel over the wire, into
//!   DRAM and onto disk, and every reader verifies them.
//! - [`dataplane`]: the framed TCP protocol that moves block payloads.
//! - [`samenode`]: the same-node protocol: buffers registered over a Unix socket, blocks copied
//!   into and out of them by offset, no payload on the socket.
//! - [`pb`]: the gRPC control-plane messages and service generated from `proto/kvtier.proto`.
//! - [`record_log`]: the framing of the node's metadata logs (keyed record tags) and their
//!   recovery scan; [`segment`]: the disk tier's segment records and their recovery scan.
//! - [`codes`]: stable error codes shown at the service boundary.

mod checksum;
pub mod cluster;
pub mod codes;
pub mod dataplane;
mod error;
mod frame;
mod key;
mod layout;
mod namespace;
pub mod record_log;
pub mod samenode;
pub mod segment;
pub mod tcp;
mod tier;

pub use checksum::{checksum, Checksummer};
pub use error::ProtoError;
pub use frame::{
    BlockFrame, CodecId, FrameHeader, FRAME_FLAGS_KNOWN, FRAME_FLAG_KEEP_LOSSLESS, FRAME_HEADER_LEN, FRAME_MAGIC,
    FRAME_VERSION,
};
pub use key::{BlockKey, KeyChain, KEY_LEN};
pub use layout::{DType, KvLayout, MemoryOrder};
pub use namespace::{HashScheme, Namespace, NamespaceId, NAMESPACE_ID_LEN};
pub use tier::{Priority, ScopedKey, TierId};

/// Generated gRPC messages and service (package `kvtier.v1`).
#[allow(clippy::all, missing_docs)]
#[cfg(feature = "grpc")]
pub mod pb {
    tonic::include_proto!("kvtier.v1");
}
