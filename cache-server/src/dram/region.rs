//! The DRAM tier's memory: one [`Region`] (a single mapping, anonymous or a memfd) carved into
//! slots by an [`Arena`], and the two slot handles the tier moves between its states.
//!
//! # Why one region
//! A later RDMA memory registration, CUDA host registration or same-node `mmap` of a memfd
//! registers or shares *one* range once ([`Region::as_ptr`], [`Region::len`], [`Region::fd`]),
//! instead of one registration per slot. Pages are touched lazily: an anonymous mapping (or a
//! sparse memfd) costs nothing until a slot is first written.
//!
//! # Carving: best-fit extents with coalescing, in two parts
//! Slot sizes are the slab's size classes (4 KiB and up, 4 classes per doubling, multiples of
//! 1 KiB), so slots are variable-sized and a buddy allocator (powers of two) would waste up to
//! 2x. Per-class chunks would strand a chunk per class per size in use. Instead the free space is
//! a set of extents kept twice (by offset, for coalescing with both neighbours when an extent is
//! freed, and by `(size, offset)`, for best fit in `O(log n)`). Best fit with immediate
//! coalescing is the policy with the lowest fragmentation in allocator studies (Wilson et al.
//! 1995), and the tier's per-class free lists ([`super::slab`]) recycle same-class slots without
//! touching the extents at all, which is the common case (full KV blocks have one size).
//!
//! The region is `capacity + headroom` bytes, split at `capacity` into a *main* part and a
//! *headroom* part whose extents never coalesce across the split:
//! - The tier's byte budget (`allocated <= capacity`, in [`super::slab`]) is unchanged. Slots
//!   come from the main part first.
//! - Headroom holds what the budget no longer counts but memory still holds: a slot evicted or
//!   removed while a reader's `Bytes` view still refers to it, a lease revoked at its deadline
//!   while its holder still owns the buffer, and slots that did not fit the main part because it
//!   is fragmented. Those bytes cannot be reused until the last holder lets go, so they need
//!   address space beyond the budget; the headroom bounds them (a reserve that finds no extent
//!   evicts more, then fails with `Capacity`), where `Vec` slots were unbounded.
//! - A headroom extent is handed back to the OS (`MADV_DONTNEED`, or `MADV_REMOVE` for a memfd)
//!   when it is freed, so resident memory stays near `capacity` plus what readers hold.
//!
//! # Ownership (the safety argument)
//! Every byte of the region belongs to exactly one of: a free extent of the arena, one
//! [`SlotBuf`] (exclusive: the only handle that can write it), or one [`SharedSlot`] (an `Arc`
//! of a `SlotBuf`: read-only while shared, writable again only after `try_unwrap` proves it is
//! the last handle). Extents handed out are disjoint and inside the mapping; a handle returns its
//! extent to the arena when dropped. That is exactly the ownership of a `Vec<u8>`, so the
//! borrow rules on the handles are the borrow rules on the bytes. No reference to the whole
//! mapping is ever made, only to one slot.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use memmap2::{Advice, MmapOptions, MmapRaw, UncheckedAdvice};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::error::ServerError;

/// What backs the region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RegionMode {
    /// A private anonymous mapping (zero pages until written).
    #[default]
    Anonymous,
    /// A shared mapping of a sealed-size memfd: another process on this node can map the same
    /// bytes through [`Region::fd`].
    Memfd,
}

const PAGE: usize = 4096;

/// One contiguous mapping. `Send + Sync`; what lives where inside it is the [`Arena`]'s business.
pub struct Region {
    map: MmapRaw,
    file: Option<File>,
    mode: RegionMode,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region").field("mode", &self.mode).field("len", &self.len()).finish()
    }
}

impl Region {
    /// Maps `len` bytes (rounded up to whole pages, at least one) without touching them.
    pub fn new(len: usize, mode: RegionMode) -> Result<Region, ServerError> {
        let len = len.max(1).div_ceil(PAGE).saturating_mul(PAGE);
        let fail = |what: &str, e: std::io::Error| {
            ServerError::Config(format!("dram region: cannot {what} {len} bytes ({mode:?}): {e}"))
        };
        match mode {
            RegionMode::Anonymous => {
                // MAP_NORESERVE: the budget, not the kernel's swap accounting, bounds what is
                // touched; the headroom is address space until used.
                let map = MmapOptions::new().len(len).no_reserve_swap().map_anon().map_err(|e| fail("map", e))?;
                Ok(Region { map: MmapRaw::from(map), file: None, mode })
            }
            RegionMode::Memfd => {
                use rustix::fs::{MemfdFlags, SealFlags};
                let fd = rustix::fs::memfd_create("kvtier-dram", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
                    .map_err(|e| fail("create a memfd of", e.into()))?;
                let file = File::from(fd);
                // Sparse: no page exists until written.
                file.set_len(len as u64).map_err(|e| fail("size a memfd to", e))?;
                // A process the fd is shared with can't truncate it under our mapping (SIGBUS).
                rustix::fs::fcntl_add_seals(&file, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
                    .map_err(|e| fail("seal a memfd of", e.into()))?;
                let map = MmapOptions::new().len(len).map_raw(&file).map_err(|e| fail("map", e))?;
                Ok(Region { map, file: Some(file), mode })
            }
        }
    }

    /// The first byte, for a one-time registration (RDMA, CUDA host registration). Writing
    /// through it is only sound for bytes the caller owns as a [`SlotBuf`].
    pub fn as_ptr(&self) -> *const u8 {
        self.map.as_ptr()
    }

    /// Bytes mapped, headroom included.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    pub fn mode(&self) -> RegionMode {
        self.mode
    }

    /// The memfd behind the region (`None` when anonymous): `mmap(fd, MAP_SHARED)` by another
    /// process on this node shows the same bytes. Whoever receives it sees every block, so it is
    /// only ever handed to a process trusted with all tenants.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.file.as_ref().map(|f| f.as_fd())
    }

    /// Faults in the pages of `[off, off + len)` writable without writing them
    /// (`MADV_POPULATE_WRITE`): bytes already there are untouched.
    fn populate(&self, off: usize, len: usize) -> std::io::Result<()> {
        self.map.advise_range(Advice::PopulateWrite, off, len.min(self.len().saturating_sub(off)))
    }

    /// Gives the whole pages inside `[off, off + len)` back to the OS.
    fn release(&self, off: usize, len: usize) {
        let start = off.div_ceil(PAGE) * PAGE;
        let end = (off + len) / PAGE * PAGE;
        if end <= start || end > self.len() {
            return;
        }
        let advice = match self.mode {
            RegionMode::Anonymous => UncheckedAdvice::DontNeed,
            RegionMode::Memfd => UncheckedAdvice::Remove,
        };
        // SAFETY: `[start, end)` lies inside the mapping and inside one free extent that is not
        // yet back in the arena (the caller owns it; no `SlotBuf`, `SharedSlot` or view refers
        // to it), so no live reference sees its bytes change to zero.
        let _ = unsafe { self.map.unchecked_advise_range(advice, start, end - start) };
    }
}

/// Free extents of one part of the region: `[start, end)`.
#[derive(Debug)]
struct Extents {
    by_off: BTreeMap<usize, usize>,
    by_size: BTreeSet<(usize, usize)>,
    free: usize,
}

impl Extents {
    fn new(start: usize, end: usize) -> Self {
        let mut e = Extents { by_off: BTreeMap::new(), by_size: BTreeSet::new(), free: 0 };
        if end > start {
            e.insert(start, end - start);
        }
        e
    }

    fn insert(&mut self, off: usize, len: usize) {
        self.by_off.insert(off, len);
        self.by_size.insert((len, off));
        self.free += len;
    }

    fn take(&mut self, off: usize, len: usize) {
        self.by_off.remove(&off);
        self.by_size.remove(&(len, off));
        self.free -= len;
    }

    /// Best fit: the smallest extent of at least `size` bytes (lowest offset among equals).
    fn alloc(&mut self, size: usize) -> Option<usize> {
        let &(len, off) = self.by_size.range((size, 0)..).next()?;
        self.take(off, len);
        if len > size {
            self.insert(off + size, len - size);
        }
        Some(off)
    }

    /// Returns `[off, off + len)`, merged with free neighbours.
    fn free(&mut self, mut off: usize, mut len: usize) {
        if let Some((&p_off, &p_len)) = self.by_off.range(..off).next_back() {
            if p_off + p_len == off {
                self.take(p_off, p_len);
                off = p_off;
                len += p_len;
            }
        }
        if let Some(&n_len) = self.by_off.get(&(off + len)) {
            self.take(off + len, n_len);
            len += n_len;
        }
        self.insert(off, len);
    }
}

/// The region and its free extents. Lock order: the tier's state mutex, then `parts`.
pub struct Arena {
    region: Region,
    /// End of the main part (the tier's capacity); the headroom follows.
    split: usize,
    /// `[main, headroom]`.
    parts: Mutex<[Extents; 2]>,
    /// Bytes of extents handed out (budgeted slots plus what readers and revoked leases hold).
    used: AtomicU64,
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena").field("region", &self.region).field("split", &self.split).finish()
    }
}

impl Arena {
    /// A region of `main + headroom` bytes.
    pub fn new(main: usize, headroom: usize, mode: RegionMode) -> Result<Arc<Arena>, ServerError> {
        let region = Region::new(main.saturating_add(headroom), mode)?;
        let split = main.min(region.len());
        let parts = [Extents::new(0, split), Extents::new(split, region.len())];
        Ok(Arc::new(Arena { region, split, parts: Mutex::new(parts), used: AtomicU64::new(0) }))
    }

    pub fn region(&self) -> &Region {
        &self.region
    }

    /// Faults in the main part (the capacity) on a background thread, 32 MiB at a time, so the
    /// first fill of the cache doesn't page-fault in the store path. Slots may be written
    /// meanwhile: populating never changes a byte. Stops when the arena is dropped; a kernel
    /// without `MADV_POPULATE_WRITE` (before 5.14) or a memory limit ends it with a warning.
    pub fn prefault(arena: &Arc<Arena>) {
        const STEP: usize = 32 << 20;
        let weak = Arc::downgrade(arena);
        let end = arena.split;
        let spawned = std::thread::Builder::new().name("kvtier-dram-prefault".into()).spawn(move || {
            let started = std::time::Instant::now();
            let mut off = 0;
            while off < end {
                let Some(arena) = weak.upgrade() else { return };
                if let Err(e) = arena.region.populate(off, STEP.min(end - off)) {
                    tracing::warn!("dram prefault stopped after {off} bytes: {e}");
                    return;
                }
                off += STEP;
                ::metrics::gauge!("kvtier_dram_prefaulted_bytes").set(off.min(end) as f64);
            }
            tracing::info!("dram prefault: {end} bytes in {:.1} s", started.elapsed().as_secs_f64());
        });
        if let Err(e) = spawned {
            tracing::warn!("dram prefault not started: {e}");
        }
    }

    /// Bytes handed out as slots, held or budgeted.
    pub fn used_bytes(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// An exclusive slot of exactly `size` bytes: from the main part, else from the headroom;
    /// `None` when no free extent is large enough. Its bytes are whatever the last owner left.
    pub fn alloc(self: &Arc<Self>, size: usize) -> Option<SlotBuf> {
        let off = {
            let mut parts = self.parts.lock();
            let [main, head] = &mut *parts;
            main.alloc(size).or_else(|| head.alloc(size))?
        };
        self.used.fetch_add(size as u64, Ordering::Relaxed);
        Some(SlotBuf { arena: Arc::clone(self), off, size })
    }

    fn free(&self, off: usize, size: usize) {
        let head = off >= self.split;
        if head {
            self.region.release(off, size);
        }
        self.parts.lock()[head as usize].free(off, size);
        self.used.fetch_sub(size as u64, Ordering::Relaxed);
    }

    /// Checks the free extents: inside their part, sorted, disjoint, never adjacent (coalesced),
    /// both maps agree, and free + used = the region. Returns the free extents.
    #[cfg(test)]
    pub fn check(&self) -> Vec<(usize, usize)> {
        let parts = self.parts.lock();
        let mut all = Vec::new();
        let mut free = 0;
        for (i, p) in parts.iter().enumerate() {
            let (lo, hi) = if i == 0 { (0, self.split) } else { (self.split, self.region.len()) };
            assert_eq!(p.by_off.len(), p.by_size.len());
            let mut prev_end = None;
            for (&off, &len) in &p.by_off {
                assert!(len > 0 && off >= lo && off + len <= hi, "extent {off}+{len} outside {lo}..{hi}");
                assert!(p.by_size.contains(&(len, off)));
                if let Some(end) = prev_end {
                    assert!(off > end, "extents at {off} not coalesced or overlapping (previous ends {end})");
                }
                prev_end = Some(off + len);
                all.push((off, len));
            }
            assert_eq!(p.free, p.by_off.values().sum::<usize>());
            free += p.free;
        }
        assert_eq!(free as u64 + self.used_bytes(), self.region.len() as u64);
        all
    }
}

/// An exclusively owned slot: `size` bytes of the region that only this handle can reach.
/// Dropping it returns the extent to the arena.
pub struct SlotBuf {
    arena: Arc<Arena>,
    off: usize,
    size: usize,
}

impl std::fmt::Debug for SlotBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotBuf").field("off", &self.off).field("size", &self.size).finish()
    }
}

impl SlotBuf {
    pub fn size(&self) -> usize {
        self.size
    }

    /// Offset in the region (for a one-sided mover that addresses the registered region).
    pub fn offset(&self) -> usize {
        self.off
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `[off, off + size)` is inside the mapping (handed out by `Arena::alloc` from
        // an extent of the region) and owned by this handle alone (module doc, "Ownership"); a
        // shared borrow of the handle makes a shared borrow of its bytes.
        unsafe { std::slice::from_raw_parts(self.arena.region.map.as_ptr().add(self.off), self.size) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` is the only way to reach these bytes, so the
        // mutable borrow is unique.
        unsafe { std::slice::from_raw_parts_mut(self.arena.region.map.as_mut_ptr().add(self.off), self.size) }
    }
}

impl Drop for SlotBuf {
    fn drop(&mut self) {
        self.arena.free(self.off, self.size);
    }
}

/// A published slot: read-only, shared by the index and readers' views. The extent is reused
/// only after the last handle is gone.
#[derive(Debug, Clone)]
pub struct SharedSlot(Arc<SlotBuf>);

impl SharedSlot {
    /// Publishes an exclusive slot: nobody can write it any more.
    pub fn freeze(buf: SlotBuf) -> Self {
        SharedSlot(Arc::new(buf))
    }

    /// The exclusive slot back, if this is the only handle (no reader holds a view).
    pub fn try_unwrap(self) -> Result<SlotBuf, SharedSlot> {
        Arc::try_unwrap(self.0).map_err(SharedSlot)
    }

    pub fn size(&self) -> usize {
        self.0.size
    }

    /// A zero-copy view of the first `len` bytes that keeps the slot from being reused while it
    /// lives.
    pub fn view(&self, len: usize) -> Bytes {
        Bytes::from_owner(View { slot: Arc::clone(&self.0), len: len.min(self.0.size) })
    }

    #[cfg(test)]
    pub fn offset(&self) -> usize {
        self.0.off
    }
}

/// The owner behind a reader's `Bytes`.
struct View {
    slot: Arc<SlotBuf>,
    len: usize,
}

impl AsRef<[u8]> for View {
    fn as_ref(&self) -> &[u8] {
        &self.slot.as_slice()[..self.len]
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Seek, SeekFrom};

    use super::*;

    #[test]
    fn extents_best_fit_and_coalesce() {
        let mut e = Extents::new(0, 100);
        assert_eq!(e.alloc(10), Some(0));
        assert_eq!(e.alloc(20), Some(10));
        assert_eq!(e.alloc(30), Some(30));
        e.free(10, 20); // hole of 20 between two slots
        assert_eq!(e.alloc(15), Some(10), "best fit takes the 20-byte hole, not the 40-byte tail");
        e.free(10, 15);
        e.free(0, 10);
        e.free(30, 30);
        assert_eq!(e.by_off.len(), 1, "{e:?}");
        assert_eq!((e.free, e.by_off.get(&0)), (100, Some(&100)));
        assert_eq!(e.alloc(101), None);
    }

    #[test]
    fn slots_are_disjoint_and_headroom_is_used_last() {
        let a = Arena::new(8192, 8192, RegionMode::Anonymous).unwrap();
        let mut s1 = a.alloc(4096).unwrap();
        let mut s2 = a.alloc(4096).unwrap();
        let mut s3 = a.alloc(4096).unwrap();
        assert!(s1.offset() < 8192 && s2.offset() < 8192 && s3.offset() >= 8192);
        assert!(a.alloc(8192).is_none());
        s1.as_mut_slice().fill(1);
        s2.as_mut_slice().fill(2);
        s3.as_mut_slice().fill(3);
        assert!(s1.as_slice().iter().all(|&b| b == 1) && s2.as_slice().iter().all(|&b| b == 2));
        a.check();
        let off3 = s3.offset();
        drop(s3);
        // Freed headroom is given back: the next owner sees zero pages.
        let s3 = a.alloc(4096).unwrap();
        assert_eq!(s3.offset(), off3);
        assert!(s3.as_slice().iter().all(|&b| b == 0));
        drop((s1, s2, s3));
        assert_eq!(a.used_bytes(), 0);
        assert_eq!(a.check(), vec![(0, 8192), (8192, 8192)]);
    }

    /// Prefaulting allocates exactly the capacity's pages (seen on the memfd behind the region),
    /// not the headroom's, and changes no byte of a slot written before.
    #[test]
    fn prefault_allocates_the_capacity_and_changes_no_byte() {
        let (main, headroom) = (64usize << 20, 8usize << 20);
        let a = Arena::new(main, headroom, RegionMode::Memfd).unwrap();
        let mut s = a.alloc(1 << 20).unwrap();
        s.as_mut_slice().fill(9);
        let allocated = || rustix::fs::fstat(a.region().fd().unwrap()).unwrap().st_blocks as usize * 512;
        assert_eq!(allocated(), 1 << 20, "a sparse region: only the written slot");
        Arena::prefault(&a);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while allocated() < main {
            assert!(std::time::Instant::now() < deadline, "only {} of {main} bytes faulted in", allocated());
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(allocated(), main, "the headroom stays untouched");
        assert!(s.as_slice().iter().all(|&b| b == 9), "a slot's bytes are left as they were");
    }

    #[test]
    fn a_view_keeps_its_slot() {
        let a = Arena::new(4096, 0, RegionMode::Anonymous).unwrap();
        let mut s = a.alloc(4096).unwrap();
        s.as_mut_slice().fill(7);
        let shared = SharedSlot::freeze(s);
        let view = shared.view(100);
        let shared = shared.try_unwrap().unwrap_err();
        drop(shared);
        assert!(a.alloc(4096).is_none(), "the view still owns the slot");
        assert_eq!(&view[..], &[7u8; 100][..]);
        drop(view);
        assert!(a.alloc(4096).is_some());
    }

    #[test]
    fn memfd_region_is_the_same_bytes_through_its_fd() {
        let a = Arena::new(1 << 20, 0, RegionMode::Memfd).unwrap();
        let fd = a.region().fd().unwrap();
        let _pad = a.alloc(12288).unwrap();
        let mut s = a.alloc(5000).unwrap();
        s.as_mut_slice().copy_from_slice(&(0..5000).map(|i| (i % 251) as u8).collect::<Vec<_>>());
        let off = s.offset();
        // A second, independent mapping of the same fd (what a same-node process would do).
        let file = File::from(fd.try_clone_to_owned().unwrap());
        let other = unsafe_free_map(&file);
        assert_eq!(&other[off..off + 5000], s.as_slice());
        // And through plain reads of the file.
        let mut f = &file;
        f.seek(SeekFrom::Start(off as u64)).unwrap();
        let mut back = vec![0u8; 5000];
        f.read_exact(&mut back).unwrap();
        assert_eq!(&back[..], s.as_slice());
        assert!(file.set_len(4096).is_err(), "the size is sealed");
        assert!(Region::new(4096, RegionMode::Anonymous).unwrap().fd().is_none());
    }

    /// A read-only copy of the whole memfd via a fresh `MAP_SHARED` mapping.
    fn unsafe_free_map(file: &File) -> Vec<u8> {
        let m = MmapOptions::new().map_raw_read_only(file).unwrap();
        // SAFETY: the mapping is alive for this block and `len` is its length; the test's
        // writer finished before the copy and nobody writes meanwhile.
        unsafe { std::slice::from_raw_parts(m.as_ptr(), m.len()) }.to_vec()
    }
}
