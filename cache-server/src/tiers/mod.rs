//! The tier seam: one [`Tier`] trait that every place a block can live implements — DRAM, the
//! blocks on their way to disk, disk today; the GPU agent's HBM pages and peer nodes next — and
//! the [`TierStack`] over them, the only tier API the control and data planes see.
//!
//! - [`stack`]: [`TierStack`] — lookup, verified get with promotion, zero-copy ingest (reserve →
//!   commit), persist (make durable), pins, purge and stats, walking the tiers hottest first.
//! - [`agent`]: [`AgentTier`] — G1, the GPU agents' HBM pages: an index of what they reported,
//!   and demands that make an agent spill a block a read wants into DRAM.
//! - [`in_transit`]: [`InTransitTier`] — blocks evicted from DRAM and not yet on disk.
//! - [`demotion`]: the eviction hook, the bounded demotion queue and the thread that writes it out.
//! - [`io`]: [`IoPool`] — the bounded pool disk reads and writes run on, off the async workers.
//! - [`redis`]: [`RedisTier`] — an existing Redis / Redis Cluster deployment as a tier the fleet
//!   shares (blocks and session manifests, checksums verified, a byte budget of its own).

pub mod agent;
pub mod demotion;
pub mod in_transit;
pub mod io;
pub mod redis;
pub mod stack;

use bytes::Bytes;
use kvtier_proto::{BlockKey, FrameHeader, NamespaceId, TierId};

use crate::disk::DiskTier;
use crate::dram::{DramTier, Priority, StoredBlock};
use crate::error::ServerError;
use crate::metrics::error;

pub use agent::{AgentTier, AgentTierConfig};
pub use demotion::DemotionDepth;
pub use in_transit::InTransitTier;
pub use io::IoPool;
pub use redis::RedisTier;
pub use stack::TierStack;

/// What a tier answers to a read (after foyer's engine `Load`): being busy is a normal answer,
/// not an error; the caller treats it as a miss it may retry.
#[derive(Debug, Clone)]
pub enum Load {
    /// The block, verified against its checksum.
    Hit(StoredBlock),
    /// The tier may hold the block but can't serve it now (its I/O pool is saturated).
    Busy,
    Miss,
}

impl Load {
    /// The block, if this was a hit.
    pub fn hit(self) -> Option<StoredBlock> {
        match self {
            Load::Hit(b) => Some(b),
            Load::Busy | Load::Miss => None,
        }
    }
}

/// One tier's counters, in the shape `Stats` reports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TierStats {
    pub capacity_bytes: u64,
    pub resident_bytes: u64,
    pub allocated_bytes: u64,
    pub pinned_bytes: u64,
    pub blocks: u64,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    /// Requests sent to other nodes (the peer tier; 0 for the others).
    pub requests: u64,
    /// Requests that failed or came back wrong (the peer tier; 0 for the others).
    pub errors: u64,
}

/// A tier that can pin blocks for parked sessions and leases.
pub trait PinTier {
    /// All or nothing; `MissingBlocks` lists the indices of absent keys.
    fn pin(&self, ns: &NamespaceId, keys: &[BlockKey]) -> Result<(), ServerError>;
    fn unpin(&self, ns: &NamespaceId, keys: &[BlockKey]);
}

/// One tier of a node's stack.
pub trait Tier: Send + Sync {
    /// Which tier this is (also its metrics label).
    fn id(&self) -> TierId;

    /// Whether the tier holds the block (metadata only: no hit counted, no I/O).
    fn contains(&self, ns: &NamespaceId, key: &BlockKey) -> bool;

    /// Batched [`Tier::contains`]: sets `held[i]` for every `keys[i]` this tier holds, leaving the
    /// others as they are, so one buffer can be marked by each tier in turn.
    fn mark_held(&self, ns: &NamespaceId, keys: &[BlockKey], held: &mut [bool]) {
        for (k, h) in keys.iter().zip(held.iter_mut()) {
            if !*h && self.contains(ns, k) {
                *h = true;
            }
        }
    }

    /// The header of the held copy (metadata only).
    fn header(&self, ns: &NamespaceId, key: &BlockKey) -> Option<FrameHeader>;

    /// The block, verified. A copy that fails its checksum is dropped from the tier (and
    /// counted) and reads as a miss, never as wrong bytes. May block on I/O when
    /// [`Tier::does_io`]: callers then run it on the [`IoPool`].
    fn get(&self, ns: &NamespaceId, key: &BlockKey) -> Load;

    /// [`Tier::get`] for the node's own use — a park's blocks made durable, blocks forwarded to
    /// their owners or handed off, a session's blocks sent to a replica — counted nowhere (no
    /// hit, no bytes out) and leaving the block's eviction state alone: a tier's hits are what
    /// it served to clients and peers. The same checks as `get`.
    fn get_for_node(&self, ns: &NamespaceId, key: &BlockKey) -> Load {
        self.get(ns, key)
    }

    /// Stores a block whose payload the caller verified.
    fn put(&self, header: FrameHeader, payload: &Bytes, priority: Priority) -> Result<(), ServerError>;

    /// Forgets one block unless it is pinned; true if it was there and is gone.
    fn remove(&self, ns: &NamespaceId, key: &BlockKey) -> bool;

    /// Forgets every unpinned block of a namespace; returns their keys.
    fn purge(&self, ns: &NamespaceId) -> Vec<BlockKey>;

    /// The tier's pins, if it can hold any.
    fn pins(&self) -> Option<&dyn PinTier> {
        None
    }

    fn stats(&self) -> TierStats;

    /// Whether `get`/`put` do blocking I/O.
    fn does_io(&self) -> bool {
        false
    }
}

impl PinTier for DramTier {
    fn pin(&self, ns: &NamespaceId, keys: &[BlockKey]) -> Result<(), ServerError> {
        DramTier::pin(self, ns, keys)
    }
    fn unpin(&self, ns: &NamespaceId, keys: &[BlockKey]) {
        DramTier::unpin(self, ns, keys)
    }
}

impl PinTier for DiskTier {
    fn pin(&self, ns: &NamespaceId, keys: &[BlockKey]) -> Result<(), ServerError> {
        DiskTier::pin(self, ns, keys)
    }
    fn unpin(&self, ns: &NamespaceId, keys: &[BlockKey]) {
        DiskTier::unpin(self, ns, keys)
    }
}

/// A DRAM read's answer, checked: a copy that fails its checksum is dropped (a miss).
fn checked_dram(dram: &DramTier, ns: &NamespaceId, key: &BlockKey, found: Option<StoredBlock>) -> Load {
    match found {
        Some(b) if b.header.verify_payload(&b.payload).is_ok() => Load::Hit(b),
        Some(_) => {
            drop_corrupt_dram(dram, ns, key);
            Load::Miss
        }
        None => Load::Miss,
    }
}

/// A DRAM block that failed its checksum: counted, logged and removed (its next load is a miss).
pub(crate) fn drop_corrupt_dram(dram: &DramTier, ns: &NamespaceId, key: &BlockKey) {
    error("dram_checksum");
    tracing::error!(?key, "DRAM block failed its checksum; removed");
    DramTier::remove(dram, ns, key);
}

impl Tier for DramTier {
    fn id(&self) -> TierId {
        TierId::Dram
    }
    fn contains(&self, ns: &NamespaceId, key: &BlockKey) -> bool {
        DramTier::contains(self, ns, key)
    }
    fn header(&self, ns: &NamespaceId, key: &BlockKey) -> Option<FrameHeader> {
        DramTier::header(self, ns, key)
    }
    fn get(&self, ns: &NamespaceId, key: &BlockKey) -> Load {
        checked_dram(self, ns, key, DramTier::get(self, ns, key))
    }
    fn get_for_node(&self, ns: &NamespaceId, key: &BlockKey) -> Load {
        checked_dram(self, ns, key, DramTier::get_for_node(self, ns, key))
    }
    fn put(&self, header: FrameHeader, payload: &Bytes, priority: Priority) -> Result<(), ServerError> {
        self.insert(header, payload, priority).map(|_| ())
    }
    fn remove(&self, ns: &NamespaceId, key: &BlockKey) -> bool {
        DramTier::remove(self, ns, key)
    }
    fn purge(&self, ns: &NamespaceId) -> Vec<BlockKey> {
        self.purge_namespace(ns)
    }
    fn pins(&self) -> Option<&dyn PinTier> {
        Some(self)
    }
    fn stats(&self) -> TierStats {
        let s = DramTier::stats(self);
        TierStats {
            capacity_bytes: s.capacity_bytes,
            resident_bytes: s.resident_bytes,
            allocated_bytes: s.allocated_bytes,
            pinned_bytes: s.pinned_bytes,
            blocks: s.blocks,
            hits: s.hits,
            misses: s.misses,
            evictions: s.evictions,
            bytes_in: s.bytes_in,
            bytes_out: s.bytes_out,
            ..TierStats::default()
        }
    }
}

impl Tier for DiskTier {
    fn id(&self) -> TierId {
        TierId::Disk
    }
    fn contains(&self, ns: &NamespaceId, key: &BlockKey) -> bool {
        DiskTier::contains(self, ns, key)
    }
    fn mark_held(&self, ns: &NamespaceId, keys: &[BlockKey], held: &mut [bool]) {
        self.mark_indexed(ns, keys, held)
    }
    fn header(&self, ns: &NamespaceId, key: &BlockKey) -> Option<FrameHeader> {
        DiskTier::header(self, ns, key)
    }
    fn get(&self, ns: &NamespaceId, key: &BlockKey) -> Load {
        // `read` verifies, and drops a copy that fails.
        match self.read(ns, key) {
            Some((header, payload)) => Load::Hit(StoredBlock { header, payload }),
            None => Load::Miss,
        }
    }
    fn get_for_node(&self, ns: &NamespaceId, key: &BlockKey) -> Load {
        match self.read_for_node(ns, key) {
            Some((header, payload)) => Load::Hit(StoredBlock { header, payload }),
            None => Load::Miss,
        }
    }
    fn put(&self, header: FrameHeader, payload: &Bytes, _priority: Priority) -> Result<(), ServerError> {
        self.write(&header, payload)
    }
    fn remove(&self, ns: &NamespaceId, key: &BlockKey) -> bool {
        DiskTier::remove(self, ns, key)
    }
    fn purge(&self, ns: &NamespaceId) -> Vec<BlockKey> {
        self.purge_namespace(ns)
    }
    fn pins(&self) -> Option<&dyn PinTier> {
        Some(self)
    }
    fn stats(&self) -> TierStats {
        let d = DiskTier::stats(self);
        TierStats {
            capacity_bytes: d.capacity_bytes,
            resident_bytes: d.resident_bytes,
            allocated_bytes: d.used_bytes,
            pinned_bytes: d.pinned_bytes,
            blocks: d.blocks,
            hits: d.hits,
            misses: d.misses,
            evictions: d.evicted_blocks,
            bytes_in: d.bytes_in,
            bytes_out: d.bytes_out,
            ..TierStats::default()
        }
    }
    fn does_io(&self) -> bool {
        true
    }
}
