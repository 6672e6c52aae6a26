//! Cluster: who the members are and which of them own a block.
//!
//! - [`member`]: a member's id, addresses, topology labels (node, rack, zone) and capacity.
//! - [`placement`]: pure rendezvous placement of a block over the members, with replicas spread
//!   across racks and zones and a reader's preference order.
//! - [`membership`]: the [`Membership`] seam — a watchable snapshot of the members, kept in
//!   process for a single node ([`Embedded`]) or in Redis with a TTL heartbeat ([`RedisMembership`]).

pub mod member;
pub mod membership;
pub mod placement;

pub use member::{Labels, Member, NodeId};
pub use membership::{Embedded, Membership, RedisMembership, RedisMembershipConfig, Snapshot};
pub use placement::{Locality, Placement, Reader};

#[cfg(test)]
mod tests;
