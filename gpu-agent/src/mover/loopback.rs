//! An in-process stand-in for an RDMA fabric: [`LoopbackFabric`] is the network (a table of
//! registered regions by rkey, like the NICs' translation tables), and each [`LoopbackMover`] on
//! it is one node's mover. Moves are memory copies that go through the same steps as the verbs
//! mover — bounds checks against the lease, a posted request, a completion found by polling with a
//! deadline — and fail the same ways: an unknown rkey or a range outside the registration is a
//! remote access error in the completion, a missing completion is a timeout that breaks the mover.
//! A test can stall a mover (completions never arrive) to exercise that path.
//!
//! Besides this crate's [`HostBuffer`]s, memory another component owns can be registered by
//! address ([`LoopbackFabric::register_raw`]): the server's DRAM arena, leased to peers slot by
//! slot, in tests that run a node and its one-sided clients in one process. Such memory is
//! reached only by a mover connected through a live [`LoopbackLink`] (what the pair of connected
//! queue pairs is): the owner opens one per peer and cuts it by dropping it, after which the
//! peer's moves fail as they would against a destroyed queue pair.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::{check_move, wait_completion, BulkMover, Completion, CompletionQueue, MoverRegion, SlotDescriptor};
use crate::device::HostBuffer;
use crate::error::{AgentError, Result};

/// The shared "network": every region registered by any mover on it, by rkey.
#[derive(Default)]
pub struct LoopbackFabric {
    regions: Mutex<HashMap<u32, Target>>,
    next_rkey: AtomicU32,
    /// Links open now, by id.
    links: Mutex<HashSet<u32>>,
    next_link: AtomicU32,
}

/// A connection between memory registered by address and one peer's mover; cut when dropped.
pub struct LoopbackLink {
    id: u32,
    fabric: Arc<LoopbackFabric>,
}

impl LoopbackLink {
    /// What the peer's mover connects to ([`LoopbackMover::connect_link`]).
    pub fn id(&self) -> u32 {
        self.id
    }
}

impl Drop for LoopbackLink {
    fn drop(&mut self) {
        self.fabric.links.lock().remove(&self.id);
    }
}

/// What an rkey names.
enum Target {
    /// A buffer of this crate.
    Buffer(HostBuffer),
    /// Memory registered by address ([`LoopbackFabric::register_raw`]).
    Raw { base: usize, len: usize },
}

impl Target {
    fn addr(&self) -> usize {
        match self {
            Target::Buffer(b) => b.addr(),
            Target::Raw { base, .. } => *base,
        }
    }

    fn len(&self) -> usize {
        match self {
            Target::Buffer(b) => b.len(),
            Target::Raw { len, .. } => *len,
        }
    }

    /// Writes `bytes` at `at` (inside the target: [`LoopbackFabric::resolve`] checked it).
    fn write(&self, at: usize, bytes: &[u8]) -> Result<()> {
        match self {
            Target::Buffer(b) => b.write(at, bytes),
            Target::Raw { base, len } => {
                crate::device::check_bounds("raw region", at, bytes.len(), *len)?;
                // SAFETY: `register_raw`'s caller keeps `base..base + len` mapped while it is
                // registered, and it is: we run under the fabric's lock (`with_target`), which
                // deregistration takes first. The range is in bounds (checked above).
                // Like a NIC's DMA, the write does not synchronise with the owner's accesses:
                // the lease protocol decides who touches a slot when.
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), (*base + at) as *mut u8, bytes.len()) };
                Ok(())
            }
        }
    }

    /// Reads `out.len()` bytes from `at`.
    fn read(&self, at: usize, out: &mut [u8]) -> Result<()> {
        match self {
            Target::Buffer(b) => b.read(at, out),
            Target::Raw { base, len } => {
                crate::device::check_bounds("raw region", at, out.len(), *len)?;
                // SAFETY: as in `write`.
                unsafe { std::ptr::copy_nonoverlapping((*base + at) as *const u8, out.as_mut_ptr(), out.len()) };
                Ok(())
            }
        }
    }
}

/// Memory registered by address on a [`LoopbackFabric`]; deregistered on drop.
pub struct LoopbackRawRegistration {
    rkey: u32,
    fabric: Arc<LoopbackFabric>,
}

impl LoopbackRawRegistration {
    pub fn rkey(&self) -> u32 {
        self.rkey
    }
}

impl Drop for LoopbackRawRegistration {
    fn drop(&mut self) {
        self.fabric.regions.lock().remove(&self.rkey);
    }
}

impl LoopbackFabric {
    pub fn new() -> Arc<Self> {
        Arc::new(LoopbackFabric {
            regions: Mutex::new(HashMap::new()),
            next_rkey: AtomicU32::new(0x100),
            links: Mutex::new(HashSet::new()),
            next_link: AtomicU32::new(1),
        })
    }

    /// Regions registered now (tests check deregistration).
    pub fn registered(&self) -> usize {
        self.regions.lock().len()
    }

    /// Registers `len` bytes at `base` (memory this crate does not own) for moves by any mover
    /// on the fabric; its slot descriptors name it by address, as for a buffer.
    ///
    /// # Safety
    /// `base..base + len` must stay mapped until the returned registration is dropped.
    pub unsafe fn register_raw(self: &Arc<Self>, base: *mut u8, len: usize) -> LoopbackRawRegistration {
        let rkey = self.next_rkey.fetch_add(1, Ordering::Relaxed);
        self.regions.lock().insert(rkey, Target::Raw { base: base as usize, len });
        LoopbackRawRegistration { rkey, fabric: self.clone() }
    }

    /// Opens a link for one peer's mover to reach memory registered by address.
    pub fn open_link(self: &Arc<Self>) -> LoopbackLink {
        let id = self.next_link.fetch_add(1, Ordering::Relaxed);
        self.links.lock().insert(id);
        LoopbackLink { id, fabric: self.clone() }
    }

    /// Runs `access` on the registered memory holding `window` entirely (as a NIC would resolve
    /// it) and the window's offset in it, under the fabric's lock: a registration can't be
    /// dropped, and its memory unmapped, while a move into it is under way. Memory registered by
    /// address is reached only over a live `link`.
    fn with_target(
        &self,
        window: &SlotDescriptor,
        link: Option<u32>,
        access: impl FnOnce(&Target, usize) -> Result<()>,
    ) -> Result<()> {
        let regions = self.regions.lock();
        let buf = regions
            .get(&window.rkey)
            .ok_or_else(|| AgentError::RemoteAccess(format!("unknown rkey {:#x}", window.rkey)))?;
        if matches!(buf, Target::Raw { .. }) && !link.is_some_and(|l| self.links.lock().contains(&l)) {
            return Err(AgentError::RemoteAccess(
                "no live connection to the memory's owner (never connected, or its connection ended)".into(),
            ));
        }
        let base = buf.addr() as u64;
        let inside = window.addr >= base
            && window.addr.checked_add(window.len).is_some_and(|end| end <= base + buf.len() as u64);
        if !inside {
            return Err(AgentError::RemoteAccess(format!(
                "{:#x}+{} is outside the region of rkey {:#x}",
                window.addr, window.len, window.rkey
            )));
        }
        access(buf, (window.addr - base) as usize)
    }
}

/// Memory registered on a [`LoopbackFabric`]; deregistered on drop.
pub struct LoopbackRegion {
    buf: HostBuffer,
    rkey: u32,
    fabric: Arc<LoopbackFabric>,
}

impl MoverRegion for LoopbackRegion {
    fn buffer(&self) -> &HostBuffer {
        &self.buf
    }
}

impl LoopbackRegion {
    pub fn rkey(&self) -> u32 {
        self.rkey
    }
}

impl Drop for LoopbackRegion {
    fn drop(&mut self) {
        self.fabric.regions.lock().remove(&self.rkey);
    }
}

/// One node's mover on a [`LoopbackFabric`].
pub struct LoopbackMover {
    fabric: Arc<LoopbackFabric>,
    /// The link it moves over into memory registered by address (0: none).
    link: AtomicU32,
    completions: Mutex<Vec<Completion>>,
    next_wr: AtomicU64,
    stalled: AtomicBool,
    broken: AtomicBool,
}

impl LoopbackMover {
    pub fn new(fabric: &Arc<LoopbackFabric>) -> Self {
        LoopbackMover {
            fabric: fabric.clone(),
            link: AtomicU32::new(0),
            completions: Mutex::new(Vec::new()),
            next_wr: AtomicU64::new(1),
            stalled: AtomicBool::new(false),
            broken: AtomicBool::new(false),
        }
    }

    /// From now on requests are carried out but their completions never arrive (a peer that
    /// stopped answering, a cut link): every wait times out.
    pub fn stall(&self) {
        self.stalled.store(true, Ordering::Relaxed);
    }

    /// Connects the mover to the owner's end of a link ([`LoopbackFabric::open_link`]).
    pub fn connect_link(&self, link: u32) {
        self.link.store(link, Ordering::Relaxed);
    }

    fn link(&self) -> Option<u32> {
        Some(self.link.load(Ordering::Relaxed)).filter(|&l| l != 0)
    }

    /// Whether an earlier timeout broke this mover.
    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Relaxed)
    }

    /// Posts one request (`copy` runs it), then waits for its completion.
    fn post_and_wait(&self, op: &'static str, timeout: Duration, copy: impl FnOnce() -> Result<()>) -> Result<()> {
        if self.is_broken() {
            return Err(AgentError::Rdma { op, detail: "mover broken by an earlier timeout; reconnect".into() });
        }
        let wr_id = self.next_wr.fetch_add(1, Ordering::Relaxed);
        let result = copy();
        if !self.stalled.load(Ordering::Relaxed) {
            self.completions.lock().push(Completion { wr_id, result });
        }
        let r = wait_completion(self, wr_id, op, timeout);
        if matches!(r, Err(AgentError::Timeout { .. })) {
            self.broken.store(true, Ordering::Relaxed);
        }
        r
    }
}

impl CompletionQueue for LoopbackMover {
    fn poll(&self) -> Result<Vec<Completion>> {
        Ok(std::mem::take(&mut *self.completions.lock()))
    }
}

impl BulkMover for LoopbackMover {
    type Region = LoopbackRegion;

    fn register(&self, buf: &HostBuffer) -> Result<LoopbackRegion> {
        let rkey = self.fabric.next_rkey.fetch_add(1, Ordering::Relaxed);
        self.fabric.regions.lock().insert(rkey, Target::Buffer(buf.clone()));
        Ok(LoopbackRegion { buf: buf.clone(), rkey, fabric: self.fabric.clone() })
    }

    fn describe(&self, region: &LoopbackRegion, offset: usize, len: usize) -> Result<SlotDescriptor> {
        crate::device::check_bounds("mover region", offset, len, region.buf.len())?;
        Ok(SlotDescriptor { addr: (region.buf.addr() + offset) as u64, rkey: region.rkey, len: len as u64 })
    }

    fn write(
        &self,
        local: &LoopbackRegion,
        local_offset: usize,
        slot: &SlotDescriptor,
        slot_offset: u64,
        len: usize,
        timeout: Duration,
    ) -> Result<()> {
        let window = check_move(&local.buf, local_offset, slot, slot_offset, len)?;
        self.post_and_wait("RDMA WRITE", timeout, || {
            let mut bytes = vec![0u8; len];
            local.buf.read(local_offset, &mut bytes)?;
            self.fabric.with_target(&window, self.link(), |remote, at| remote.write(at, &bytes))
        })
    }

    fn read(
        &self,
        slot: &SlotDescriptor,
        slot_offset: u64,
        local: &LoopbackRegion,
        local_offset: usize,
        len: usize,
        timeout: Duration,
    ) -> Result<()> {
        let window = check_move(&local.buf, local_offset, slot, slot_offset, len)?;
        self.post_and_wait("RDMA READ", timeout, || {
            let mut bytes = vec![0u8; len];
            self.fabric.with_target(&window, self.link(), |remote, at| remote.read(at, &mut bytes))?;
            local.buf.write(local_offset, &bytes)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    const T: Duration = Duration::from_secs(5);

    /// A lessor with a 64 KiB arena and one leased 4 KiB slot at 8 KiB; a client with a staging
    /// buffer of pattern bytes.
    fn setup() -> (Arc<LoopbackFabric>, LoopbackMover, LoopbackRegion, SlotDescriptor, LoopbackMover, LoopbackRegion) {
        let fabric = LoopbackFabric::new();
        let lessor = LoopbackMover::new(&fabric);
        let arena = lessor.register(&HostBuffer::new(64 << 10)).unwrap();
        let slot = crate::mover::decode_slot(&lessor.describe(&arena, 8 << 10, 4096).unwrap().encode()).unwrap();
        let client = LoopbackMover::new(&fabric);
        let staging =
            client.register(&HostBuffer::from_vec((0..8192u32).map(|i| (i * 7 + 3) as u8).collect())).unwrap();
        (fabric, lessor, arena, slot, client, staging)
    }

    #[test]
    fn writes_and_reads_a_leased_slot_through_its_descriptor() {
        let (_fabric, _lessor, arena, slot, client, staging) = setup();
        client.write(&staging, 100, &slot, 0, 4096, T).unwrap();
        let arena_bytes = arena.buffer().to_vec();
        let staged = staging.buffer().to_vec();
        assert_eq!(&arena_bytes[8192..8192 + 4096], &staged[100..100 + 4096]);
        assert!(arena_bytes[..8192].iter().chain(&arena_bytes[8192 + 4096..]).all(|b| *b == 0), "outside the slot");
        // Read part of it back into another place of the staging buffer.
        client.read(&slot, 1000, &staging, 5000, 500, T).unwrap();
        assert_eq!(&staging.buffer().to_vec()[5000..5500], &staged[1100..1600]);
    }

    /// Memory this crate doesn't own, registered by address: moves over a live link land in it
    /// and come out of it like a buffer's, bounded by the registration; they end with the link,
    /// and with the registration.
    #[test]
    fn memory_registered_by_address_is_moved_into_and_out_of_until_deregistered() {
        let fabric = LoopbackFabric::new();
        let mut arena = vec![0u8; 16 << 10];
        let base = arena.as_mut_ptr();
        // SAFETY: `arena` outlives the registration (dropped below, before `arena`).
        let reg = unsafe { fabric.register_raw(base, arena.len()) };
        let slot = SlotDescriptor { addr: base as u64 + 4096, rkey: reg.rkey(), len: 100 };
        let peer = LoopbackMover::new(&fabric);
        let staging = peer.register(&HostBuffer::from_vec((0..200u8).collect())).unwrap();
        // Not connected to the owner: refused, nothing written.
        let refused = peer.write(&staging, 10, &slot, 0, 100, T);
        assert!(matches!(refused, Err(AgentError::RemoteAccess(m)) if m.contains("connection")));
        let link = fabric.open_link();
        peer.connect_link(link.id());
        peer.write(&staging, 10, &slot, 0, 100, T).unwrap();
        peer.read(&slot, 50, &staging, 150, 50, T).unwrap();
        // Past the registration's end: refused by the "NIC", nothing written.
        let past = SlotDescriptor { addr: base as u64 + (16 << 10) - 10, rkey: reg.rkey(), len: 20 };
        assert!(matches!(peer.write(&staging, 0, &past, 0, 20, T), Err(AgentError::RemoteAccess(_))));
        // The owner cuts the link: the peer's moves stop reaching the memory.
        drop(link);
        let cut = peer.read(&slot, 0, &staging, 0, 10, T);
        assert!(matches!(cut, Err(AgentError::RemoteAccess(m)) if m.contains("connection")));
        drop(reg);
        assert!(
            matches!(peer.write(&staging, 0, &slot, 0, 10, T), Err(AgentError::RemoteAccess(m)) if m.contains("rkey"))
        );
        assert_eq!(fabric.registered(), 1, "only the staging buffer is left");
        let mut back = [0u8; 50];
        staging.buffer().read(150, &mut back).unwrap();
        assert_eq!(&back[..], &(60..110u8).collect::<Vec<_>>()[..], "read back out of the registered memory");
        drop(staging);
        assert_eq!(&arena[4096..4196], &(10..110u8).collect::<Vec<_>>()[..]);
        assert!(arena[..4096].iter().chain(&arena[4196..]).all(|&b| b == 0), "nothing outside the slot");
    }

    #[test]
    fn moves_outside_the_lease_are_refused_before_posting() {
        let (_fabric, _lessor, arena, slot, client, staging) = setup();
        let err = client.write(&staging, 0, &slot, 4000, 200, T).unwrap_err();
        assert_eq!(err, AgentError::OutsideLease { offset: 4000, len: 200, slot: 4096 });
        assert!(matches!(client.read(&slot, 0, &staging, 8000, 500, T), Err(AgentError::OutOfBounds { .. })));
        assert!(arena.buffer().to_vec().iter().all(|b| *b == 0), "nothing was written");
        assert!(!client.is_broken());
    }

    #[test]
    fn the_fabric_refuses_forged_descriptors() {
        let (fabric, _lessor, arena, slot, client, staging) = setup();
        // A descriptor claiming more than the lessor registered: the lease check passes (the
        // claim is the descriptor's own), the "NIC" refuses it.
        let forged = SlotDescriptor { len: 1 << 20, ..slot };
        let err = client.write(&staging, 0, &forged, 60 << 10, 8192, T).unwrap_err();
        assert!(matches!(&err, AgentError::RemoteAccess(m) if m.contains("outside the region")), "{err:?}");
        let wrong_key = SlotDescriptor { rkey: slot.rkey + 1000, ..slot };
        let err = client.read(&wrong_key, 0, &staging, 0, 16, T).unwrap_err();
        assert!(matches!(&err, AgentError::RemoteAccess(m) if m.contains("unknown rkey")), "{err:?}");
        // Deregistered memory cannot be reached any more.
        drop(arena);
        assert_eq!(fabric.registered(), 1);
        assert!(matches!(client.write(&staging, 0, &slot, 0, 16, T), Err(AgentError::RemoteAccess(_))));
        assert!(!client.is_broken(), "a refused access is the request's error, not the mover's");
    }

    #[test]
    fn a_missing_completion_times_out_and_breaks_the_mover() {
        let (_fabric, _lessor, _arena, slot, client, staging) = setup();
        client.stall();
        let t = Instant::now();
        let err = client.write(&staging, 0, &slot, 0, 64, Duration::from_millis(40)).unwrap_err();
        assert!(matches!(err, AgentError::Timeout { op: "RDMA WRITE", .. }), "{err:?}");
        assert!(t.elapsed() >= Duration::from_millis(40) && t.elapsed() < Duration::from_secs(2));
        assert!(client.is_broken());
        let err = client.read(&slot, 0, &staging, 0, 64, T).unwrap_err();
        assert!(matches!(&err, AgentError::Rdma { detail, .. } if detail.contains("reconnect")), "{err:?}");
    }

    /// The trait is what callers use: a put and a get written once against `BulkMover`.
    #[test]
    fn a_put_and_get_generic_over_the_trait() {
        fn put_get<M: BulkMover>(m: &M, local: &M::Region, slot: &SlotDescriptor, n: usize) -> Result<Vec<u8>> {
            m.write(local, 0, slot, 0, n, T)?;
            m.read(slot, 0, local, n, n, T)?;
            let all = local.buffer().to_vec();
            Ok(all[n..2 * n].to_vec())
        }
        let (_fabric, _lessor, _arena, slot, client, staging) = setup();
        let back = put_get(&client, &staging, &slot, 2048).unwrap();
        assert_eq!(back, staging.buffer().to_vec()[..2048]);
    }
}
