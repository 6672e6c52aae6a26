//! The cluster's shared vocabulary: what a member is ([`member`]) and which members own a block
//! or a session ([`placement`], pure rendezvous hashing whose seeds are part of the wire
//! contract). In `proto` so that servers and clients compute the same owners — a client with
//! the membership sends stores straight to them.

pub mod member;
pub mod placement;

pub use member::{Labels, Member, NodeId};
pub use placement::{Locality, Placement, Reader};
