//! Slot storage: size classes, per-class free lists and the byte budget.
//!
//! A slot is a `Vec<u8>` whose length is exactly its size class. It is allocated once and reused
//! for many blocks: a freed slot goes back to its class's free list, and is only given back to the
//! system allocator when the budget is needed for another class. `allocated` counts every slot
//! the tier owns (indexed, free, or lent to a writer) and never exceeds `capacity`.

use std::collections::BTreeMap;
use std::sync::Arc;

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

/// Free lists and budget. Plain data; the tier keeps it under its state mutex.
#[derive(Debug)]
pub(super) struct Slab {
    capacity: u64,
    allocated: u64,
    free: BTreeMap<usize, Vec<Vec<u8>>>,
    free_bytes: u64,
    /// Buffers the tier has let go of, to be dropped after the state mutex is released.
    pub(super) trash: Vec<Vec<u8>>,
    pub(super) trash_shared: Vec<Arc<Vec<u8>>>,
}

impl Slab {
    pub(super) fn new(capacity: u64) -> Self {
        Slab {
            capacity,
            allocated: 0,
            free: BTreeMap::new(),
            free_bytes: 0,
            trash: Vec::new(),
            trash_shared: Vec::new(),
        }
    }

    pub(super) fn allocated(&self) -> u64 {
        self.allocated
    }

    #[cfg(test)]
    pub(super) fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    fn fits(&self, size: usize) -> bool {
        self.allocated.saturating_add(size as u64) <= self.capacity
    }

    /// A free slot of exactly `size` bytes, if one is cached.
    pub(super) fn take_free(&mut self, size: usize) -> Option<Vec<u8>> {
        let list = self.free.get_mut(&size)?;
        let buf = list.pop()?;
        if list.is_empty() {
            self.free.remove(&size);
        }
        self.free_bytes -= size as u64;
        Some(buf)
    }

    /// A new slot of `size` bytes if the budget allows it.
    pub(super) fn try_alloc(&mut self, size: usize) -> Option<Vec<u8>> {
        if !self.fits(size) {
            return None;
        }
        self.allocated += size as u64;
        // `vec![0; n]` is a calloc: large slots come as lazily zeroed pages.
        Some(vec![0u8; size])
    }

    /// Gives cached free slots (of any class) back to the system until `size` more bytes fit.
    pub(super) fn release_free_until_fits(&mut self, size: usize) {
        while !self.fits(size) {
            let Some(mut entry) = self.free.last_entry() else { return };
            let class = *entry.key();
            let list = entry.get_mut();
            if let Some(buf) = list.pop() {
                self.free_bytes -= class as u64;
                self.allocated -= class as u64;
                self.trash.push(buf);
            }
            if list.is_empty() {
                entry.remove();
            }
        }
    }

    /// Returns a slot the tier still owns to its free list.
    pub(super) fn put_free(&mut self, buf: Vec<u8>) {
        let size = buf.len();
        self.free_bytes += size as u64;
        self.free.entry(size).or_default().push(buf);
    }

    /// The tier stops owning a slot of `size` bytes (dropped, or now owned by a reader).
    pub(super) fn forget(&mut self, size: usize) {
        self.allocated = self.allocated.saturating_sub(size as u64);
    }

    /// A slot leaving the index: back to the free list if no reader holds it, otherwise the last
    /// reader frees it and the tier stops counting it.
    pub(super) fn recycle(&mut self, buf: Arc<Vec<u8>>) {
        match Arc::try_unwrap(buf) {
            Ok(v) => self.put_free(v),
            Err(shared) => {
                self.forget(shared.len());
                self.trash_shared.push(shared);
            }
        }
    }

    /// Takes the buffers to drop once the caller has released its lock.
    pub(super) fn take_trash(&mut self) -> (Vec<Vec<u8>>, Vec<Arc<Vec<u8>>>) {
        (std::mem::take(&mut self.trash), std::mem::take(&mut self.trash_shared))
    }
}

#[cfg(test)]
mod tests {
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
        let mut s = Slab::new(3 * 4096);
        let a = s.try_alloc(4096).unwrap();
        let b = s.try_alloc(8192).unwrap();
        assert!(s.try_alloc(4096).is_none());
        assert_eq!(s.allocated(), 12288);
        s.put_free(a);
        s.put_free(b);
        assert_eq!(s.free_bytes(), 12288);
        assert_eq!(s.take_free(4096).map(|v| v.len()), Some(4096));
        // Needs 8192 more for a class with no free slot: the cached 8192 slot is released.
        s.release_free_until_fits(8192);
        assert_eq!(s.allocated(), 4096);
        assert_eq!(s.free_bytes(), 0);
        assert_eq!(s.trash.len(), 1);
    }
}
