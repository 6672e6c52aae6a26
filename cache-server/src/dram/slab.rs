//! Slot storage: size classes, per-class free lists and the byte budget.
//!
//! A slot is an extent of the tier's [`Region`](super::region::Region) whose length is exactly
//! its size class. It is carved once and reused for many blocks: a freed slot goes back to its
//! class's free list, and is only given back to the arena (where freed neighbours coalesce) when
//! the budget is needed for another class. `allocated` counts every slot the tier owns (indexed,
//! free, or leased to a writer) and never exceeds `capacity`.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::region::{Arena, SharedSlot, SlotBuf};

/// The smallest slot. Payloads below it waste at most this many bytes each.
pub(super) const MIN_SLOT: usize = 4096;
/// Size classes per power of two: slot / payload < 1 + 1/CLASSES_PER_DOUBLING for payloads above
/// `MIN_SLOT`, and powers of two (the usual full-block sizes) are exact.
pub(super) const CLASSES_PER_DOUBLING: usize = 4;

/// The slot size (size class) for a payload of `len` bytes.
pub(super) fn slot_size(len: usize) -> usize {
    if len <= MIN_SLOT {
        return MIN_SLOT;
    }
    // 2^k < len <= 2^(k+1); classes in that range are multiples of 2^k / CLASSES_PER_DOUBLING.
    let k = usize::BITS - 1 - (len - 1).leading_zeros();
    let step = (1usize << k) / CLASSES_PER_DOUBLING;
    len.div_ceil(step).saturating_mul(step)
}

/// Free lists and budget over the tier's [`Arena`]. Plain data; the tier keeps it under its
/// state mutex.
#[derive(Debug)]
pub(super) struct Slab {
    arena: Arc<Arena>,
    capacity: u64,
    allocated: u64,
    free: BTreeMap<usize, Vec<SlotBuf>>,
    free_bytes: u64,
}

impl Slab {
    pub(super) fn new(arena: Arc<Arena>, capacity: u64) -> Self {
        Slab { arena, capacity, allocated: 0, free: BTreeMap::new(), free_bytes: 0 }
    }

    pub(super) fn allocated(&self) -> u64 {
        self.allocated
    }

    #[cfg(test)]
    pub(super) fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// Whether `size` more bytes fit the budget.
    pub(super) fn fits(&self, size: usize) -> bool {
        self.allocated.saturating_add(size as u64) <= self.capacity
    }

    /// A free slot of exactly `size` bytes, if one is cached.
    pub(super) fn take_free(&mut self, size: usize) -> Option<SlotBuf> {
        let list = self.free.get_mut(&size)?;
        let buf = list.pop()?;
        if list.is_empty() {
            self.free.remove(&size);
        }
        self.free_bytes -= size as u64;
        Some(buf)
    }

    /// A new slot of `size` bytes if the budget allows it and the region has an extent for it.
    pub(super) fn try_alloc(&mut self, size: usize) -> Option<SlotBuf> {
        if !self.fits(size) {
            return None;
        }
        let buf = self.arena.alloc(size)?;
        self.allocated += size as u64;
        Some(buf)
    }

    /// Gives cached free slots (largest classes first) back to the arena until `size` more bytes
    /// fit the budget.
    pub(super) fn release_free_until_fits(&mut self, size: usize) {
        while !self.fits(size) && self.release_one() {}
    }

    /// Gives every cached free slot back to the arena, so that freed neighbours coalesce.
    pub(super) fn release_all_free(&mut self) {
        while self.release_one() {}
    }

    fn release_one(&mut self) -> bool {
        let Some(mut entry) = self.free.last_entry() else { return false };
        let class = *entry.key();
        let list = entry.get_mut();
        if let Some(buf) = list.pop() {
            self.free_bytes -= class as u64;
            self.allocated -= class as u64;
            drop(buf);
        }
        if list.is_empty() {
            entry.remove();
        }
        true
    }

    /// Returns a slot the tier still owns to its free list.
    pub(super) fn put_free(&mut self, buf: SlotBuf) {
        let size = buf.size();
        self.free_bytes += size as u64;
        self.free.entry(size).or_default().push(buf);
    }

    /// The tier stops owning a slot of `size` bytes (freed, or now held by a reader or by the
    /// holder of a revoked lease, in which case its extent returns when they let go).
    pub(super) fn forget(&mut self, size: usize) {
        self.allocated = self.allocated.saturating_sub(size as u64);
    }

    /// A slot leaving the index: back to the free list if no reader holds it, otherwise the last
    /// reader frees it and the tier stops counting it.
    pub(super) fn recycle(&mut self, buf: SharedSlot) {
        match buf.try_unwrap() {
            Ok(v) => self.put_free(v),
            Err(shared) => self.forget(shared.size()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::region::RegionMode;
    use super::*;

    #[test]
    fn classes_are_exact_at_powers_of_two_and_bounded_elsewhere() {
        assert_eq!(slot_size(0), MIN_SLOT);
        assert_eq!(slot_size(1), MIN_SLOT);
        assert_eq!(slot_size(4096), 4096);
        assert_eq!(slot_size(4097), 5120);
        assert_eq!(slot_size(8192), 8192);
        assert_eq!(slot_size(8193), 10240);
        assert_eq!(slot_size(2 << 20), 2 << 20);
        assert_eq!(slot_size((2 << 20) + 1), (2 << 20) + (512 << 10));
        for len in (MIN_SLOT + 1..(1 << 22)).step_by(997) {
            let s = slot_size(len);
            assert!(s >= len);
            assert!((s as f64) < len as f64 * 1.25, "len {len} slot {s}");
            assert_eq!(slot_size(s), s, "a class maps to itself");
        }
    }

    #[test]
    fn budget_and_free_lists() {
        let arena = Arena::new(3 * 4096, 3 * 4096, RegionMode::Anonymous).unwrap();
        let mut s = Slab::new(Arc::clone(&arena), 3 * 4096);
        let a = s.try_alloc(4096).unwrap();
        let b = s.try_alloc(8192).unwrap();
        assert!(s.try_alloc(4096).is_none(), "the budget is spent even though the headroom is free");
        assert_eq!(s.allocated(), 12288);
        s.put_free(a);
        s.put_free(b);
        assert_eq!(s.free_bytes(), 12288);
        let c = s.take_free(4096).unwrap();
        assert_eq!(c.size(), 4096);
        // Needs 8192 more for a class with no free slot: the cached 8192 slot is released.
        s.release_free_until_fits(8192);
        assert_eq!(s.allocated(), 4096);
        assert_eq!(s.free_bytes(), 0);
        assert_eq!(arena.used_bytes(), 4096, "the released slot went back to the arena");
    }
}
