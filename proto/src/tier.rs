//! Names of the tiers a block can live in: one id per tier of the stack, also the `tier` label of
//! every per-tier metric and the name `Stats` reports.

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
        }
    }
}

impl std::fmt::Display for TierId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
