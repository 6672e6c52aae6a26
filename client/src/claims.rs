//! One [`SharedBuffer`] used by several calls at once, each on the byte ranges it claimed: an
//! engine's prefetch loads into some pages of its pool while its backup stores from others. A
//! load claims its blocks' places for writing, a store for reading; a claim waits while another
//! call's claim overlaps one of its ranges and either of them writes.

use std::ops::Range;
use std::sync::Mutex;

use tokio::sync::Notify;

use crate::{ClientError, SharedBuffer};

/// A [`SharedBuffer`] that loads and stores use at the same time, each on the places of its own
/// blocks (pass `&ConcurrentBuffer` where a call takes a buffer). Calls whose places don't
/// overlap run side by side; a load whose places overlap another call's (or a store's that
/// overlap a load's) waits for it. The whole buffer is reachable only with `&mut` (no claim can
/// be live then): [`ConcurrentBuffer::get_mut`].
pub struct ConcurrentBuffer {
    buf: SharedBuffer,
    claims: Mutex<Claims>,
    /// Woken whenever a claim ends.
    released: Notify,
}

#[derive(Default)]
struct Claims {
    next_id: u64,
    /// The live claims: id, whether it writes, its ranges (sorted, coalesced).
    live: Vec<(u64, bool, Vec<Range<usize>>)>,
    /// The claims waiting, in the same form; ids grow in arrival order.
    waiting: Vec<(u64, bool, Vec<Range<usize>>)>,
}

impl ConcurrentBuffer {
    pub fn new(buf: SharedBuffer) -> Self {
        ConcurrentBuffer { buf, claims: Mutex::new(Claims::default()), released: Notify::new() }
    }

    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// The address of the buffer's first byte (see [`SharedBuffer::as_ptr`]).
    pub fn as_ptr(&self) -> *const u8 {
        self.buf.as_ptr()
    }

    /// See [`SharedBuffer::file_offset`].
    pub fn file_offset(&self) -> u64 {
        self.buf.file_offset()
    }

    /// The whole buffer, with no call using it.
    pub fn get_mut(&mut self) -> &mut SharedBuffer {
        &mut self.buf
    }

    pub fn into_inner(self) -> SharedBuffer {
        self.buf
    }

    /// Claims `ranges` of the buffer, for writing (`write`) or reading, waiting while a live
    /// claim that conflicts holds any of them, or one that conflicts waits since before this one
    /// (in arrival order: a steady stream of stores can't hold a load off for ever). An
    /// `InvalidArgument` for a range outside the buffer, or for write ranges that overlap each
    /// other. A claim future dropped before it resolves leaves no trace.
    pub async fn claim(&self, ranges: &[Range<usize>], write: bool) -> Result<BufferClaim<'_>, ClientError> {
        let ranges = normalize(ranges, self.buf.len(), write)?;
        let id = {
            let mut claims = self.claims.lock().map_err(|_| poisoned())?;
            let id = claims.next_id;
            claims.next_id += 1;
            claims.waiting.push((id, write, ranges.clone()));
            id
        };
        let mut queued = Queued { owner: self, id, granted: false };
        loop {
            let released = self.released.notified();
            tokio::pin!(released);
            // Registered as a waiter before looking, so a release between the look and the wait
            // still wakes it.
            released.as_mut().enable();
            {
                let mut claims = self.claims.lock().map_err(|_| poisoned())?;
                let earlier = claims.waiting.iter().filter(|(other, ..)| *other < id);
                let conflict = claims
                    .live
                    .iter()
                    .chain(earlier)
                    .any(|(_, w, theirs)| (write || *w) && overlapping(&ranges, theirs));
                if !conflict {
                    claims.waiting.retain(|(other, ..)| *other != id);
                    claims.live.push((id, write, ranges.clone()));
                    queued.granted = true;
                    return Ok(BufferClaim { owner: self, id, write, ranges });
                }
            }
            released.await;
        }
    }

    /// [`ConcurrentBuffer::claim`] of a call's places: each block's ranges, in order.
    pub(crate) async fn claim_places(
        &self,
        places: &[Vec<Range<usize>>],
        write: bool,
    ) -> Result<BufferClaim<'_>, ClientError> {
        let flat: Vec<Range<usize>> = places.iter().flatten().cloned().collect();
        self.claim(&flat, write).await
    }

    /// The bytes at `r` as a raw slice. Dereferenced only by a claim that covers `r` (so `r` is
    /// inside the mapping), where no other claim that conflicts with it is live.
    fn raw(&self, r: Range<usize>) -> *mut [u8] {
        // The mapping's pointer comes from `mmap` (not from a reference), writable: the buffer is
        // mapped read-write.
        let start = self.buf.as_ptr().cast_mut().wrapping_add(r.start);
        std::ptr::slice_from_raw_parts_mut(start, r.len())
    }
}

/// A call's claim on ranges of a [`ConcurrentBuffer`]; ends when dropped.
pub struct BufferClaim<'a> {
    owner: &'a ConcurrentBuffer,
    id: u64,
    write: bool,
    /// Sorted and coalesced.
    ranges: Vec<Range<usize>>,
}

impl BufferClaim<'_> {
    /// The buffer this claim is on: its identity, descriptor and size (the same-node path
    /// registers it), never its bytes (a crate-internal promise: other claims may write them).
    pub(crate) fn buffer(&self) -> &SharedBuffer {
        &self.owner.buf
    }

    /// Whether `r` lies inside one of this claim's ranges.
    fn covers(&self, r: &Range<usize>) -> bool {
        r.is_empty() || self.ranges.iter().any(|c| c.start <= r.start && r.end <= c.end)
    }

    /// The bytes at `r`, if the claim covers them.
    pub fn bytes(&self, r: Range<usize>) -> Option<&[u8]> {
        if !self.covers(&r) {
            return None;
        }
        // SAFETY: covered by this live claim (so inside the mapping); no other write claim
        // overlaps it, and a `&mut` into this claim needs `&mut self`, which `&self` excludes.
        Some(unsafe { &*self.owner.raw(r) })
    }

    /// The bytes at `r` to write, if this is a write claim and covers them.
    pub fn bytes_mut(&mut self, r: Range<usize>) -> Option<&mut [u8]> {
        if !self.write || !self.covers(&r) {
            return None;
        }
        // SAFETY: as in `bytes`, and no other claim overlaps a write claim at all; `&mut self`
        // keeps this the only slice of the claim handed out.
        Some(unsafe { &mut *self.owner.raw(r) })
    }

    /// `ranges` (per block, in order; pairwise disjoint, each inside this write claim) as
    /// writable slices at once.
    pub fn pieces_mut(&mut self, ranges: &[Vec<Range<usize>>]) -> Result<Vec<Vec<&mut [u8]>>, ClientError> {
        let flat: Vec<Range<usize>> = ranges.iter().flatten().cloned().collect();
        if !self.write {
            return Err(ClientError::InvalidArgument("a read claim has no writable places".into()));
        }
        if let Some(r) = flat.iter().find(|r| !self.covers(r)) {
            return Err(ClientError::InvalidArgument(format!("bytes {r:?} are outside the claim")));
        }
        normalize(&flat, self.owner.buf.len(), true)?;
        // SAFETY: each range is covered by this write claim (no other claim overlaps it) and the
        // ranges are pairwise disjoint (checked by `normalize`), so the slices alias nothing;
        // `&mut self` keeps them the only ones of this claim.
        Ok(ranges.iter().map(|rs| rs.iter().map(|r| unsafe { &mut *self.owner.raw(r.clone()) }).collect()).collect())
    }
}

impl Drop for BufferClaim<'_> {
    fn drop(&mut self) {
        // A poisoned lock (a panic while it was held) still holds the list: take it regardless.
        let mut claims = self.owner.claims.lock().unwrap_or_else(|p| p.into_inner());
        claims.live.retain(|(id, ..)| *id != self.id);
        drop(claims);
        self.owner.released.notify_waiters();
    }
}

/// How a call reaches the bytes of its buffer: one it has to itself (a load) or only reads (a
/// store), or its claim on places of a [`ConcurrentBuffer`].
pub(crate) enum BufferAccess<'a, 'c> {
    Own(&'a mut SharedBuffer),
    Read(&'a SharedBuffer),
    Claim(&'a mut BufferClaim<'c>),
}

impl BufferAccess<'_, '_> {
    /// The buffer (for its identity, descriptor and size; the bytes only through this access).
    pub(crate) fn buffer(&self) -> &SharedBuffer {
        match self {
            BufferAccess::Own(b) => b,
            BufferAccess::Read(b) => b,
            BufferAccess::Claim(c) => c.buffer(),
        }
    }

    pub(crate) fn bytes(&self, r: Range<usize>) -> Option<&[u8]> {
        match self {
            BufferAccess::Own(b) => b.as_slice().get(r),
            BufferAccess::Read(b) => b.as_slice().get(r),
            BufferAccess::Claim(c) => c.bytes(r),
        }
    }

    pub(crate) fn bytes_mut(&mut self, r: Range<usize>) -> Option<&mut [u8]> {
        match self {
            BufferAccess::Own(b) => b.as_mut_slice().get_mut(r),
            BufferAccess::Read(_) => None,
            BufferAccess::Claim(c) => c.bytes_mut(r),
        }
    }

    /// Disjoint `ranges` (per block, in order) as writable slices at once.
    pub(crate) fn pieces_mut(&mut self, ranges: &[Vec<Range<usize>>]) -> Result<Vec<Vec<&mut [u8]>>, ClientError> {
        match self {
            BufferAccess::Own(b) => Ok(crate::near::dests(b.as_mut_slice(), ranges)),
            BufferAccess::Read(_) => Err(ClientError::InvalidArgument("a store writes nothing into its buffer".into())),
            BufferAccess::Claim(c) => c.pieces_mut(ranges),
        }
    }
}

/// The buffer a load lands in: one the call has to itself, or a [`ConcurrentBuffer`] it shares
/// with other calls (it claims its blocks' places there first, waiting while they are in use).
pub enum LoadBuffer<'a> {
    Own(&'a mut SharedBuffer),
    Shared(&'a ConcurrentBuffer),
}

/// The buffer a store reads from: [`LoadBuffer`]'s counterpart (a store's claim only reads).
pub enum StoreBuffer<'a> {
    Own(&'a SharedBuffer),
    Shared(&'a ConcurrentBuffer),
}

impl<'a> From<&'a mut SharedBuffer> for LoadBuffer<'a> {
    fn from(b: &'a mut SharedBuffer) -> Self {
        LoadBuffer::Own(b)
    }
}

impl<'a> From<&'a ConcurrentBuffer> for LoadBuffer<'a> {
    fn from(b: &'a ConcurrentBuffer) -> Self {
        LoadBuffer::Shared(b)
    }
}

impl<'a> From<&'a SharedBuffer> for StoreBuffer<'a> {
    fn from(b: &'a SharedBuffer) -> Self {
        StoreBuffer::Own(b)
    }
}

impl<'a> From<&'a ConcurrentBuffer> for StoreBuffer<'a> {
    fn from(b: &'a ConcurrentBuffer) -> Self {
        StoreBuffer::Shared(b)
    }
}

impl LoadBuffer<'_> {
    pub fn len(&self) -> usize {
        match self {
            LoadBuffer::Own(b) => b.len(),
            LoadBuffer::Shared(b) => b.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl StoreBuffer<'_> {
    pub fn len(&self) -> usize {
        match self {
            StoreBuffer::Own(b) => b.len(),
            StoreBuffer::Shared(b) => b.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A claim waiting in line; leaves the line when dropped ungranted (its future was dropped), and
/// wakes the claims behind it.
struct Queued<'a> {
    owner: &'a ConcurrentBuffer,
    id: u64,
    granted: bool,
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        if self.granted {
            return;
        }
        let mut claims = self.owner.claims.lock().unwrap_or_else(|p| p.into_inner());
        claims.waiting.retain(|(id, ..)| *id != self.id);
        drop(claims);
        self.owner.released.notify_waiters();
    }
}

fn poisoned() -> ClientError {
    ClientError::Io("a shared buffer's claim list was poisoned by a panic".into())
}

/// `ranges` sorted and coalesced, empty ones dropped; an error for one outside `len` bytes, or,
/// for `disjoint` ranges, two that overlap.
fn normalize(ranges: &[Range<usize>], len: usize, disjoint: bool) -> Result<Vec<Range<usize>>, ClientError> {
    let mut sorted: Vec<Range<usize>> = ranges.iter().filter(|r| !r.is_empty()).cloned().collect();
    if let Some(r) = sorted.iter().find(|r| r.end > len) {
        return Err(ClientError::InvalidArgument(format!("bytes {r:?} are outside the {len}-byte buffer")));
    }
    sorted.sort_by_key(|r| (r.start, r.end));
    let mut out: Vec<Range<usize>> = Vec::with_capacity(sorted.len());
    for r in sorted {
        match out.last_mut() {
            Some(last) if r.start < last.end && disjoint => {
                return Err(ClientError::InvalidArgument(format!("places at bytes {last:?} and {r:?} overlap")));
            }
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    Ok(out)
}

/// Whether two sorted, coalesced range lists share a byte.
fn overlapping(a: &[Range<usize>], b: &[Range<usize>]) -> bool {
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        if a[i].start < b[j].end && b[j].start < a[i].end {
            return true;
        }
        if a[i].end <= b[j].end {
            i += 1;
        } else {
            j += 1;
        }
    }
    false
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // a claim takes a list of ranges: often one here
mod tests {
    use super::*;
    use std::time::Duration;

    fn buffer(len: usize) -> ConcurrentBuffer {
        ConcurrentBuffer::new(SharedBuffer::new(len).unwrap())
    }

    /// Whether `fut` resolves within a moment.
    async fn resolves<F: std::future::Future>(fut: F) -> Option<F::Output> {
        tokio::time::timeout(Duration::from_millis(50), fut).await.ok()
    }

    #[tokio::test]
    async fn disjoint_claims_run_together_and_an_overlapping_write_waits_for_release() {
        let b = buffer(4096);
        let mut load = b.claim(&[0..1024, 2048..3072], true).await.unwrap();
        // Disjoint places, a load and a store: both at once.
        let other_load = resolves(b.claim(&[1024..2048], true)).await.expect("a disjoint load is not held up");
        let store = resolves(b.claim(&[3072..4096], false)).await.expect("a disjoint store is not held up");
        // Reads share: a second store of the same places.
        let store2 = resolves(b.claim(&[3072..3100], false)).await.expect("two stores of one place share it");
        // A load on a place a store reads waits, and a store on a place a load writes too.
        assert!(resolves(b.claim(&[3000..3080], true)).await.is_none(), "a load waits for the store it overlaps");
        assert!(resolves(b.claim(&[1000..1001], false)).await.is_none(), "a store waits for the load it overlaps");

        // The waiter gets in once the claim it overlaps ends (and not before).
        let waiter = b.claim(&[1000..1001], false);
        tokio::pin!(waiter);
        assert!(resolves(waiter.as_mut()).await.is_none());
        load.bytes_mut(1000..1001).unwrap()[0] = 7;
        drop(load);
        let read = resolves(waiter).await.expect("the store gets in after the load ended").unwrap();
        assert_eq!(read.bytes(1000..1001).unwrap(), &[7]);
        drop((other_load, store, store2));
    }

    #[tokio::test]
    async fn claims_refuse_bad_ranges_and_hand_out_only_their_own_bytes() {
        let b = buffer(100);
        assert!(matches!(b.claim(&[90..101], true).await, Err(ClientError::InvalidArgument(_))));
        assert!(matches!(b.claim(&[0..10, 5..20], true).await, Err(ClientError::InvalidArgument(_))));
        // Overlapping ranges of one read claim are merged, not refused.
        let r = b.claim(&[0..10, 5..20], false).await.unwrap();
        assert!(r.bytes(0..20).is_some());
        assert!(r.bytes(15..25).is_none(), "outside the claim");
        drop(r);

        let mut w = b.claim(&[10..20, 40..60], true).await.unwrap();
        assert!(w.bytes_mut(15..45).is_none(), "spans the gap between two ranges");
        assert!(w.pieces_mut(&[vec![10..20], vec![40..45, 45..60]]).is_ok());
        assert!(w.pieces_mut(&[vec![10..21]]).is_err(), "beyond the claim");
        assert!(w.pieces_mut(&[vec![10..15], vec![12..14]]).is_err(), "two pieces overlap");
        let mut pieces = w.pieces_mut(&[vec![10..12], vec![40..41]]).unwrap();
        pieces[0][0].copy_from_slice(&[1, 2]);
        pieces[1][0][0] = 3;
        drop(w);
        assert_eq!(b.into_inner().as_slice()[10..12], [1, 2]);

        let b = buffer(100);
        let mut r = b.claim(&[0..10], false).await.unwrap();
        assert!(r.bytes_mut(0..1).is_none() && r.pieces_mut(&[vec![0..1]]).is_err(), "a read claim writes nothing");
    }

    #[tokio::test]
    async fn claims_are_served_in_arrival_order_so_a_load_is_not_starved_by_stores() {
        let b = buffer(64);
        let store = b.claim(&[0..16], false).await.unwrap();
        let load = b.claim(&[8..24], true);
        tokio::pin!(load);
        assert!(resolves(load.as_mut()).await.is_none(), "the load waits for the store");
        // A later store of the same places queues behind the waiting load, though it could share
        // with the first store; one on other places goes ahead.
        let later = b.claim(&[0..16], false);
        tokio::pin!(later);
        assert!(resolves(later.as_mut()).await.is_none(), "the later store waits behind the load");
        assert!(resolves(b.claim(&[32..40], false)).await.is_some());
        drop(store);
        let load = resolves(load).await.expect("the load gets in once the store ended").unwrap();
        assert!(resolves(later.as_mut()).await.is_none(), "the later store waits for the load");
        drop(load);
        assert!(resolves(later).await.is_some(), "and then gets in");

        // A waiting load dropped leaves the line: the store behind it gets in at once.
        let store = b.claim(&[0..16], false).await.unwrap();
        {
            // Boxed, so dropping it drops the future itself.
            let mut load = Box::pin(b.claim(&[0..16], true));
            assert!(resolves(load.as_mut()).await.is_none());
            let later = b.claim(&[0..16], false);
            tokio::pin!(later);
            assert!(resolves(later.as_mut()).await.is_none(), "behind the load");
            drop(load);
            assert!(resolves(later).await.is_some(), "the load left the line");
        }
        drop(store);
        let claims = b.claims.lock().unwrap();
        assert!(claims.live.is_empty() && claims.waiting.is_empty());
    }

    #[tokio::test]
    async fn a_dropped_waiting_claim_leaves_nothing_behind() {
        let b = buffer(64);
        let held = b.claim(&[0..64], true).await.unwrap();
        assert!(resolves(b.claim(&[0..8], true)).await.is_none());
        drop(held);
        assert!(b.claims.lock().unwrap().live.is_empty());
        assert!(b.claims.lock().unwrap().waiting.is_empty());
        let again = resolves(b.claim(&[0..64], true)).await.expect("nothing is held once every claim ended");
        drop(again);
    }

    #[test]
    fn ranges_overlap_only_when_they_share_a_byte() {
        assert!(!overlapping(&[0..10, 20..30], &[10..20, 30..40]));
        assert!(overlapping(&[0..10, 20..30], &[29..31]));
        assert!(!overlapping(&[], &[0..1]));
        assert_eq!(normalize(&[5..6, 0..2, 2..3, 4..4], 10, false).unwrap(), vec![0..3, 5..6]);
    }
}
