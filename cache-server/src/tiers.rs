//! The one walk over a node's tiers — DRAM, then blocks on their way to disk, then disk — that the
//! control and data planes share: presence, longest prefix, a verified read (promoting a block
//! read twice from disk), and purge. Handlers call these instead of fanning out themselves, so a
//! new tier is one more step here. (The `Tier` trait and `TierStack` of the target design grow
//! out of this.)

use std::collections::HashSet;

use bytes::Bytes;
use kvtier_proto::{BlockKey, FrameHeader, NamespaceId};

use crate::dram::Priority;
use crate::metrics::error;
use crate::state::NodeState;

/// Where a verified block was found.
pub enum Found {
    /// In memory (DRAM or the demotion queue): a zero-copy view.
    Memory(FrameHeader, Bytes),
    /// Not in memory, but the disk tier has it (read it with [`NodeState::read_disk`]).
    OnDisk,
    Absent,
}

impl NodeState {
    /// Whether any tier holds the block.
    pub fn holds(&self, ns: &NamespaceId, key: &BlockKey) -> bool {
        self.tier.contains(ns, key)
            || self.in_transit.contains_key(&(*ns, *key))
            || self.disk.as_ref().is_some_and(|d| d.contains(ns, key))
    }

    /// The codec of the copy some tier holds, hottest first (DRAM, the demotion queue, disk);
    /// a metadata query: no hit is counted, no block read.
    pub fn held_codec(&self, ns: &NamespaceId, key: &BlockKey) -> Option<kvtier_proto::CodecId> {
        if let Some(h) = self.tier.header(ns, key) {
            return Some(h.codec);
        }
        if let Some(b) = self.in_transit.get(&(*ns, *key)) {
            return Some(b.header.codec);
        }
        self.disk.as_ref().and_then(|d| d.header(ns, key)).map(|h| h.codec)
    }

    /// How many leading `keys` some tier holds.
    pub fn longest_prefix(&self, ns: &NamespaceId, keys: &[BlockKey]) -> usize {
        let mut n = self.tier.longest_prefix(ns, keys);
        while n < keys.len() && self.holds(ns, &keys[n]) {
            n += 1;
        }
        n
    }

    /// A block from memory, verified; a DRAM block that fails its checksum is removed (and
    /// counted) and reads as absent, never as wrong bytes.
    pub fn find(&self, ns: &NamespaceId, key: &BlockKey) -> Found {
        match self.tier.get(ns, key) {
            Some(b) if b.header.verify_payload(&b.payload).is_ok() => return Found::Memory(b.header, b.payload),
            Some(_) => {
                error("dram_checksum");
                tracing::error!(?key, "DRAM block failed its checksum; removed");
                self.tier.remove(ns, key);
                return Found::Absent;
            }
            None => {}
        }
        let moving = self.in_transit.get(&(*ns, *key)).map(|b| b.clone());
        if let Some(b) = moving {
            if b.header.verify_payload(&b.payload).is_ok() {
                return Found::Memory(b.header, b.payload);
            }
        }
        if self.disk.as_ref().is_some_and(|d| d.contains(ns, key)) {
            Found::OnDisk
        } else {
            Found::Absent
        }
    }

    /// A block from disk (verified there; blocking I/O). A block's second disk hit promotes it
    /// back to DRAM, so a one-off read doesn't push hot blocks out.
    pub fn read_disk(&self, ns: &NamespaceId, key: &BlockKey) -> Option<(FrameHeader, Bytes)> {
        let disk = self.disk.as_ref()?;
        let (header, payload) = disk.read(ns, key)?;
        let promote = {
            let mut hits = self.disk_hits.lock();
            if hits.len() > 65_536 {
                hits.clear();
            }
            let n = hits.entry((*ns, *key)).or_insert(0);
            *n += 1;
            let again = *n >= 2;
            if again {
                hits.remove(&(*ns, *key));
            }
            again
        };
        if promote && self.tier.insert(header, &payload, Priority::Normal).is_ok() {
            metrics::counter!("kvtier_disk_promotions_total").increment(1);
        }
        Some((header, payload))
    }

    /// Removes every unpinned block of a namespace from every tier: DRAM, the demotion queue (a
    /// queued block is not written, or is forgotten again once written) and disk. Returns how many
    /// distinct blocks went.
    pub fn purge_namespace(&self, id: &NamespaceId) -> u64 {
        let mut gone: HashSet<BlockKey> = self.tier.purge_namespace(id).into_iter().collect();
        self.in_transit.retain(|(ns, key), _| {
            if ns == id {
                gone.insert(*key);
            }
            ns != id
        });
        if let Some(disk) = &self.disk {
            gone.extend(disk.purge_namespace(id));
        }
        gone.len() as u64
    }
}
