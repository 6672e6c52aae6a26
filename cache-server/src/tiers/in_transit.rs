//! Blocks evicted from DRAM and not yet on disk (at most the demotion queue's length): reads,
//! lookups and parks find them here, so a block on its way down is never a miss.

use std::sync::Arc;

use bytes::Bytes;
use dashmap::DashMap;
use kvtier_proto::{BlockKey, FrameHeader, NamespaceId, TierId};

use super::{Load, Tier, TierStats};
use crate::dram::{IndexKey, Priority, StoredBlock};
use crate::error::ServerError;

/// A shared map from key to the queued copy; the eviction hook adds, the demotion thread removes.
#[derive(Clone, Default)]
pub struct InTransitTier {
    blocks: Arc<DashMap<IndexKey, StoredBlock>>,
}

impl InTransitTier {
    /// Queues `block` unless a copy of its key is already queued; false if one was.
    pub fn admit(&self, block: &StoredBlock) -> bool {
        let key = (block.header.namespace, block.header.key);
        match self.blocks.entry(key) {
            dashmap::Entry::Occupied(_) => false,
            dashmap::Entry::Vacant(v) => {
                v.insert(block.clone());
                true
            }
        }
    }

    /// Whether `block` (this very copy, not just its key) is still queued: a purge or a newer
    /// copy makes it stale.
    pub fn is_current(&self, block: &StoredBlock) -> bool {
        let key = (block.header.namespace, block.header.key);
        self.blocks.get(&key).is_some_and(|q| same_copy(&q, block))
    }

    /// Forgets `block` if it is still the queued copy; false if it was already gone.
    pub fn finish(&self, block: &StoredBlock) -> bool {
        let key = (block.header.namespace, block.header.key);
        self.blocks.remove_if(&key, |_, q| same_copy(q, block)).is_some()
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

fn same_copy(a: &StoredBlock, b: &StoredBlock) -> bool {
    a.payload.as_ptr() == b.payload.as_ptr()
}

impl Tier for InTransitTier {
    fn id(&self) -> TierId {
        TierId::InTransit
    }
    fn contains(&self, ns: &NamespaceId, key: &BlockKey) -> bool {
        self.blocks.contains_key(&(*ns, *key))
    }
    fn header(&self, ns: &NamespaceId, key: &BlockKey) -> Option<FrameHeader> {
        self.blocks.get(&(*ns, *key)).map(|b| b.header)
    }
    fn get(&self, ns: &NamespaceId, key: &BlockKey) -> Load {
        let load = self.get_for_node(ns, key);
        if matches!(load, Load::Hit(_)) {
            // Served from the queue: a hit of this tier (DRAM counted its miss).
            ::metrics::counter!("kvtier_tier_hits_total", "tier" => TierId::InTransit.as_str()).increment(1);
        }
        load
    }
    fn get_for_node(&self, ns: &NamespaceId, key: &BlockKey) -> Load {
        let queued = self.blocks.get(&(*ns, *key)).map(|b| b.clone());
        match queued {
            Some(b) if b.header.verify_payload(&b.payload).is_ok() => Load::Hit(b),
            // A damaged copy is left for the demotion thread, which drops it unwritten.
            _ => Load::Miss,
        }
    }
    fn put(&self, header: FrameHeader, payload: &Bytes, _priority: Priority) -> Result<(), ServerError> {
        self.admit(&StoredBlock { header, payload: payload.clone() });
        Ok(())
    }
    fn remove(&self, ns: &NamespaceId, key: &BlockKey) -> bool {
        self.blocks.remove(&(*ns, *key)).is_some()
    }
    fn purge(&self, ns: &NamespaceId) -> Vec<BlockKey> {
        let mut gone = Vec::new();
        self.blocks.retain(|(n, key), _| {
            if n == ns {
                gone.push(*key);
            }
            n != ns
        });
        gone
    }
    fn stats(&self) -> TierStats {
        let mut s = TierStats::default();
        for b in self.blocks.iter() {
            s.blocks += 1;
            s.resident_bytes += b.header.payload_len;
        }
        s.allocated_bytes = s.resident_bytes;
        s
    }
}
