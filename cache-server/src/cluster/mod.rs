//! Cluster: who the members are and which of them own a block.
//!
//! - [`member`], [`placement`] (from `kvtier_proto::cluster`, shared with clients): a member's id,
//!   addresses, labels and capacity; pure rendezvous placement of a block over the members, with
//!   replicas spread across racks and zones and a reader's preference order.
//! - [`peer`]: the G4 peer tier — a local miss asks the block's owners (one request per peer),
//!   stores are forwarded to them; the network behind the [`PeerTransport`] seam.
//! - [`replicas`]: replicated sessions — parks held by `rf` nodes, resumes that find the newest
//!   copy on any node, copies re-made after a membership change.
//! - [`settle`]: after a membership change, a key's former owners asked after its new ones, and
//!   what they find sent to the owners that missed it (read repair).
//! - [`rebalance`]: after a membership change, the blocks this node holds handed to their new
//!   owners ahead of reads (through the handoff's hints).
//! - [`handoff`]: blocks a forward could not give an owner that was down, handed to it when it
//!   answers again.
//! - [`deletes`]: a purge or an unregistration done on every member, and retried on one that
//!   could not be reached (what is owed kept on disk across restarts).
//! - [`claim`]: a claim across the cluster held while the work it guards runs (renewed, given
//!   back when dropped): one node at a time creates a session id.
//! - [`membership`]: the [`Membership`] seam — a watchable snapshot of the members, kept in
//!   process for a single node ([`Embedded`]) or in Redis with a TTL heartbeat ([`RedisMembership`]).

pub mod claim;
pub mod deletes;
pub mod fetch;
pub mod handoff;
pub use kvtier_proto::cluster::{member, placement};
pub mod membership;
pub mod peer;
pub mod rebalance;
pub mod replicas;
pub mod settle;

pub use claim::HeldClaim;
pub use deletes::{ClusterDelete, NamespaceDelete};
pub use member::{Labels, Member, NodeId};
pub use membership::{Embedded, Membership, RedisMembership, RedisMembershipConfig, Snapshot};
pub use peer::{Hedge, LocalHolding, PeerConfig, PeerFuture, PeerTier, PeerTransport, ReplicaCopy, ReplicaPut};
pub use placement::{Locality, Placement, Reader};

#[cfg(test)]
mod tests;

/// A member for unit tests: id `id`, registered at `since_ms`, no labels, 1 GiB.
#[cfg(test)]
pub(crate) fn test_member(id: &str, since_ms: u64) -> Member {
    Member {
        id: NodeId::new(id).expect("a test member's id"),
        grpc_addr: format!("{id}:1"),
        data_addr: format!("{id}:2"),
        labels: Labels::default(),
        capacity: 1 << 30,
        since_ms,
    }
}
