//! Names of the tiers a block can live in (one id per tier of the stack, also the `tier` label of
//! every per-tier metric and the name `Stats` reports), the eviction priority a block carries, and
//! the key a block is stored under in every tier.

use crate::{BlockKey, NamespaceId};

/// A block's key as every tier stores it: scoped by its namespace.
pub type ScopedKey = (NamespaceId, BlockKey);

/// Eviction priority: low before normal before high (each level has its own queues).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Priority {
    Low = 0,
    #[default]
    Normal = 1,
    High = 2,
}

impl Priority {
    /// From the wire's `u32` (anything above 2 is high).
    ///
    /// ```
    /// use kvtier_proto::Priority;
    /// assert_eq!(Priority::from_u32(0), Priority::Low);
    /// assert_eq!(Priority::from_u32(7), Priority::High);
    /// ```
    pub fn from_u32(v: u32) -> Priority {
        match v {
            0 => Priority::Low,
            1 => Priority::Normal,
            _ => Priority::High,
        }
    }

    /// The metric label.
    pub const fn as_str(self) -> &'static str {
        match self {
            Priority::Low => "low",
            Priority::Normal => "normal",
            Priority::High => "high",
        }
    }
}

/// One tier of a node's stack, hottest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TierId {
    /// G1: the GPU agent's HBM page pool.
    Hbm,
    /// G2: host memory.
    Dram,
    /// Blocks evicted from DRAM on their way to disk (still served from memory).
    InTransit,
    /// G3: local NVMe segment files.
    Disk,
    /// G4: other nodes.
    Peer,
    /// A Redis (or Redis Cluster) deployment the fleet shares.
    Redis,
}

impl TierId {
    /// The metric label and `Stats` name.
    ///
    /// ```
    /// assert_eq!(kvtier_proto::TierId::Dram.as_str(), "dram");
    /// ```
    pub const fn as_str(self) -> &'static str {
        match self {
            TierId::Hbm => "hbm",
            TierId::Dram => "dram",
            TierId::InTransit => "in_transit",
            TierId::Disk => "disk",
            TierId::Peer => "peer",
            TierId::Redis => "redis",
        }
    }
}

impl std::fmt::Display for TierId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
