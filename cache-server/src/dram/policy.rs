//! S3-FIFO eviction, one instance per priority level, plus a ghost queue shared by all levels.
//!
//! Plain data: the queues hold `(key, id, bytes)` items; the entries themselves (frequency, pin
//! count, where they are queued) live in the tier's index and are reached through [`Entries`].
//! An item whose entry is gone (removed, or replaced by a newer insert with another `id`) is
//! stale and skipped when popped; stale items are compacted away when they outnumber live ones.
//!
//! Per level (Yang et al., "FIFO queues are all you need for cache eviction", SOSP '23):
//! - new blocks enter the **small** FIFO (~10% of the level's bytes), unless their key is in the
//!   ghost queue (evicted recently), in which case they go straight to **main**;
//! - evicting from small: a block read at least once since it was inserted moves to main, one
//!   never read is evicted and its key goes to the ghost queue;
//! - evicting from main: a block with frequency > 0 is reinserted at the tail with frequency - 1
//!   (2-bit counter, so at most 3 reinsertions), otherwise evicted;
//! - a pinned block met by the eviction scan is taken out of the queues (`Place::Parked`) and put
//!   back into main when its pin count drops to 0, so pinned blocks are never rescanned.

use std::collections::{HashMap, VecDeque};

use super::IndexKey;

/// Number of priority levels (Low, Normal, High).
pub(super) const LEVELS: usize = 3;
/// A block read at least this often while in the small queue is promoted to main.
///
/// The paper uses "more than once" with the insert counted as the first access. For kvtier an
/// insert is the engine storing a block it has just computed, not a demand for it; one read back
/// is already proof that the prefix is shared (or the session resumed).
pub(super) const PROMOTE_FREQ: u8 = 1;
/// Frequency saturates here (2 bits).
pub(super) const MAX_FREQ: u8 = 3;

/// Where an entry is queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Place {
    Small,
    Main,
    /// Out of the queues because it was pinned when the eviction scan met it.
    Parked,
    /// Chosen as a victim; the caller is removing it.
    Out,
}

/// What the policy needs to know about a live entry.
#[derive(Debug, Clone, Copy)]
pub(super) struct View {
    pub pinned: bool,
    pub freq: u8,
}

/// Access to the entries behind queue items.
pub(super) trait Entries {
    /// The entry with this key if its id is `id`; None if the item is stale.
    fn view(&self, key: &IndexKey, id: u64) -> Option<View>;
    fn set_place(&mut self, key: &IndexKey, place: Place);
    fn set_freq(&mut self, key: &IndexKey, freq: u8);
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Item {
    pub key: IndexKey,
    pub id: u64,
    pub bytes: u64,
}

#[derive(Debug, Default)]
struct Level {
    small: VecDeque<Item>,
    main: VecDeque<Item>,
    small_bytes: u64,
    main_bytes: u64,
    small_live: usize,
    main_live: usize,
    parked: usize,
}

impl Level {
    fn live(&self) -> usize {
        self.small_live + self.main_live
    }
}

#[derive(Debug, Default)]
pub(super) struct Policy {
    levels: [Level; LEVELS],
    ghost: VecDeque<(IndexKey, u64)>,
    ghost_index: HashMap<IndexKey, u64>,
    ghost_seq: u64,
}

impl Policy {
    /// Live entries (queued or parked) across all levels.
    fn entries(&self) -> usize {
        self.levels.iter().map(|l| l.live() + l.parked).sum()
    }

    /// Queues a new entry; returns where it went.
    pub(super) fn insert(&mut self, level: usize, item: Item) -> Place {
        let l = &mut self.levels[level.min(LEVELS - 1)];
        if self.ghost_index.remove(&item.key).is_some() {
            l.main.push_back(item);
            l.main_bytes += item.bytes;
            l.main_live += 1;
            Place::Main
        } else {
            l.small.push_back(item);
            l.small_bytes += item.bytes;
            l.small_live += 1;
            Place::Small
        }
    }

    /// Counts an entry parked at `level` that came from another level (its priority raised).
    pub(super) fn park(&mut self, level: usize) {
        self.levels[level.min(LEVELS - 1)].parked += 1;
    }

    /// Puts a parked entry (its pin count just reached 0) back into main.
    pub(super) fn unpark(&mut self, level: usize, item: Item) {
        let l = &mut self.levels[level.min(LEVELS - 1)];
        l.parked = l.parked.saturating_sub(1);
        l.main.push_back(item);
        l.main_bytes += item.bytes;
        l.main_live += 1;
    }

    /// Accounts for an entry removed from the index (its queue item, if any, is now stale).
    pub(super) fn forget(&mut self, level: usize, place: Place, bytes: u64, entries: &impl Entries) {
        let l = &mut self.levels[level.min(LEVELS - 1)];
        match place {
            Place::Small => {
                l.small_bytes = l.small_bytes.saturating_sub(bytes);
                l.small_live = l.small_live.saturating_sub(1);
            }
            Place::Main => {
                l.main_bytes = l.main_bytes.saturating_sub(bytes);
                l.main_live = l.main_live.saturating_sub(1);
            }
            Place::Parked => l.parked = l.parked.saturating_sub(1),
            Place::Out => {}
        }
        // Amortized O(1): a compaction of n items happens only after ~n/2 removals.
        if l.small.len() > 2 * l.small_live + 64 {
            l.small.retain(|it| entries.view(&it.key, it.id).is_some());
        }
        if l.main.len() > 2 * l.main_live + 64 {
            l.main.retain(|it| entries.view(&it.key, it.id).is_some());
        }
    }

    /// Picks the next victim: lowest non-empty priority level first. The victim is out of the
    /// queues and its key in the ghost queue; the caller removes it from the index. None when
    /// every remaining entry is pinned.
    pub(super) fn evict(&mut self, entries: &mut impl Entries) -> Option<Item> {
        for level in 0..LEVELS {
            if let Some(victim) = self.evict_level(level, entries) {
                entries.set_place(&victim.key, Place::Out);
                self.remember(victim.key);
                return Some(victim);
            }
        }
        None
    }

    fn evict_level(&mut self, level: usize, entries: &mut impl Entries) -> Option<Item> {
        let l = &mut self.levels[level];
        loop {
            if l.live() == 0 {
                // Only stale items (if any) remain.
                l.small.clear();
                l.main.clear();
                return None;
            }
            let total = l.small_bytes + l.main_bytes;
            let from_small = l.small_live > 0 && (l.small_bytes.saturating_mul(10) >= total || l.main_live == 0);
            if from_small {
                let Some(it) = l.small.pop_front() else {
                    // Counters disagree with the queue; trust the queue.
                    l.small_live = 0;
                    l.small_bytes = 0;
                    continue;
                };
                let Some(v) = entries.view(&it.key, it.id) else { continue };
                l.small_bytes = l.small_bytes.saturating_sub(it.bytes);
                l.small_live -= 1;
                if v.pinned {
                    l.parked += 1;
                    entries.set_place(&it.key, Place::Parked);
                } else if v.freq >= PROMOTE_FREQ {
                    l.main.push_back(it);
                    l.main_bytes += it.bytes;
                    l.main_live += 1;
                    entries.set_place(&it.key, Place::Main);
                } else {
                    return Some(it);
                }
            } else {
                let Some(it) = l.main.pop_front() else {
                    l.main_live = 0;
                    l.main_bytes = 0;
                    continue;
                };
                let Some(v) = entries.view(&it.key, it.id) else { continue };
                if v.pinned {
                    l.main_bytes = l.main_bytes.saturating_sub(it.bytes);
                    l.main_live -= 1;
                    l.parked += 1;
                    entries.set_place(&it.key, Place::Parked);
                } else if v.freq > 0 {
                    entries.set_freq(&it.key, v.freq - 1);
                    l.main.push_back(it);
                } else {
                    l.main_bytes = l.main_bytes.saturating_sub(it.bytes);
                    l.main_live -= 1;
                    return Some(it);
                }
            }
        }
    }

    /// Records an evicted key in the ghost queue, bounded by the number of live entries (as in
    /// the paper, the ghost remembers about as many keys as the cache holds).
    fn remember(&mut self, key: IndexKey) {
        self.ghost_seq += 1;
        self.ghost_index.insert(key, self.ghost_seq);
        self.ghost.push_back((key, self.ghost_seq));
        let cap = self.entries().max(256);
        while self.ghost.len() > cap {
            if let Some((k, seq)) = self.ghost.pop_front() {
                if self.ghost_index.get(&k) == Some(&seq) {
                    self.ghost_index.remove(&k);
                }
            }
        }
    }

    #[cfg(test)]
    pub(super) fn in_ghost(&self, key: &IndexKey) -> bool {
        self.ghost_index.contains_key(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_proto::{BlockKey, NamespaceId};

    /// Entries as a plain map: key -> (id, pinned, freq, place).
    #[derive(Default)]
    struct Map(HashMap<IndexKey, (u64, bool, u8, Place)>);

    impl Entries for Map {
        fn view(&self, key: &IndexKey, id: u64) -> Option<View> {
            self.0.get(key).filter(|e| e.0 == id).map(|e| View { pinned: e.1, freq: e.2 })
        }
        fn set_place(&mut self, key: &IndexKey, place: Place) {
            if let Some(e) = self.0.get_mut(key) {
                e.3 = place;
            }
        }
        fn set_freq(&mut self, key: &IndexKey, freq: u8) {
            if let Some(e) = self.0.get_mut(key) {
                e.2 = freq;
            }
        }
    }

    fn k(i: u8) -> IndexKey {
        (NamespaceId([0; 16]), BlockKey([i; 32]))
    }

    fn add(p: &mut Policy, m: &mut Map, level: usize, i: u8) {
        let place = p.insert(level, Item { key: k(i), id: i as u64, bytes: 1 });
        m.0.insert(k(i), (i as u64, false, 0, place));
    }

    fn evict(p: &mut Policy, m: &mut Map) -> Option<u8> {
        let v = p.evict(m)?;
        m.0.remove(&v.key);
        Some(v.key.1 .0[0])
    }

    #[test]
    fn exact_eviction_order() {
        let (mut p, mut m) = (Policy::default(), Map::default());
        for i in 0..5 {
            add(&mut p, &mut m, 1, i);
        }
        m.0.get_mut(&k(1)).unwrap().2 = 1; // read once: promoted
        m.0.get_mut(&k(3)).unwrap().1 = true; // pinned: parked
        add(&mut p, &mut m, 0, 9); // Low goes first
        assert_eq!(evict(&mut p, &mut m), Some(9));
        assert_eq!(evict(&mut p, &mut m), Some(0));
        assert_eq!(evict(&mut p, &mut m), Some(2));
        assert_eq!(evict(&mut p, &mut m), Some(4));
        assert_eq!(m.0[&k(3)].3, Place::Parked);
        // Only 1 (main, freq 1 -> reinserted once) and the parked 3 are left.
        assert_eq!(evict(&mut p, &mut m), Some(1));
        assert_eq!(evict(&mut p, &mut m), None);
        assert!(p.in_ghost(&k(0)) && p.in_ghost(&k(9)));
        // A ghost key comes back straight into main.
        assert_eq!(p.insert(1, Item { key: k(0), id: 100, bytes: 1 }), Place::Main);
    }
}
