//! One-sided access to the node's DRAM arena (DESIGN.md, "One arena, leases, one-sided movers"):
//! the [`Fabric`] seam a one-sided mover plugs in through (RDMA verbs in `kvtier serve`, the
//! agent's loopback fabric in tests), the arena's one registration with it ([`ArenaAccess`]),
//! and the remote leases a data-plane connection holds on it ([`RemoteLeases`]).
//!
//! A connection first connects its peer to the fabric (`CONNECT`: the two endpoints, an
//! RDMA reliable-connected queue pair on each side, exchanged), and holds its endpoint for as long
//! as it lives: a peer's one-sided moves can't reach the node once its connection is gone.
//!
//! Trust: the arena is registered once, under one key, so a connected peer's NIC can reach every
//! byte of it, whatever the leases say — every tenant's blocks. Only the operator (the holder of
//! `auth_token`, or anyone on a node without tenants) may connect: the GPU agent and the
//! cluster's nodes, which are trusted with every tenant anyway. Leases keep a trusted peer's
//! moves where they belong; they are not a security boundary. (Per-lease memory windows bound to
//! the peer's queue pair would make them one.)
//!
//! A write lease is a DRAM [`Lease`] (PutStart) whose slot a peer fills one-sidedly; `COMMIT`
//! hashes the slot and publishes the block (PutEnd). A read lease holds the stored block's view,
//! so its slot is not reused while the peer reads it. The protocol is in
//! `kvtier_proto::dataplane` ("Remote leases").
//!
//! Limits: at most [`MAX_REMOTE_LEASES`] leases per connection; node-wide, write leases hold at
//! most half the DRAM tier's lease budget in slot bytes (which plain `PUT`s share, so peers can't
//! starve the node's own clients; quarantined slots count until they are returned), and read
//! leases half the arena's headroom in payload bytes (where a block evicted under its read lease
//! waits). Every lease ends at its deadline
//! (`lease_timeout`; the connection wakes for it even when its peer sends nothing), and all of
//! them with the connection. A write lease that ends uncommitted keeps its slot out of use for
//! [`WRITE_QUARANTINE`] more: a peer's write may still be on the wire, and it must not land in a
//! slot that holds another block by then.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_proto::dataplane::SlotDescriptor;
use kvtier_proto::FrameHeader;

use crate::dram::{Lease, StoredBlock};
use crate::error::ServerError;

/// Most remote leases (write and read together) one connection may hold.
pub const MAX_REMOTE_LEASES: usize = 4096;
/// How long the slot of a write lease that ended uncommitted stays out of use.
pub const WRITE_QUARANTINE: Duration = Duration::from_secs(5);

/// A one-sided fabric: registers memory so that peers holding a descriptor of part of it can
/// read and write those bytes without this node's CPU (an RDMA NIC's memory registration).
pub trait Fabric: Send + Sync {
    /// What it is, for logs and errors ("rdma mlx5_0", "loopback").
    fn name(&self) -> String;

    /// Registers `len` bytes at `base` for remote reads and writes.
    ///
    /// # Safety
    /// `base..base + len` must stay mapped for as long as the returned registration lives.
    unsafe fn register(&self, base: *mut u8, len: usize) -> Result<Box<dyn FabricRegistration>, String>;

    /// An endpoint of this node for one peer (an RDMA queue pair) connected to the peer's
    /// endpoint `peer` (encoded as the peer's fabric encodes it), and this node's endpoint encoded
    /// for the peer. A malformed or unreachable `peer` is an error the peer is told.
    fn connect(&self, peer: &[u8]) -> Result<(FabricEndpoint, Vec<u8>), String>;
}

/// A connected endpoint, held by its data-plane connection and dropped with it.
pub type FabricEndpoint = Box<dyn std::any::Any + Send + Sync>;

/// A registration made by a [`Fabric`]; dropping it deregisters.
pub trait FabricRegistration: Send + Sync {
    /// The key peers name the registration by.
    fn rkey(&self) -> u32;
    /// The address peers name the registration's first byte by (its virtual address, or an I/O
    /// virtual address).
    fn remote_base(&self) -> u64;
}

/// The DRAM arena registered once with a fabric.
pub struct ArenaAccess {
    fabric: Arc<dyn Fabric>,
    name: String,
    registration: Box<dyn FabricRegistration>,
    base: usize,
    len: usize,
    /// Payload bytes under read leases, node-wide.
    reads: Arc<LeasedBytes>,
    /// Slot bytes under write leases (quarantined ones included), node-wide.
    writes: Arc<LeasedBytes>,
}

/// The most bytes remote leases may hold at once, node-wide.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LeaseCaps {
    /// Payload bytes under read leases (they keep evicted blocks' slots in the arena's headroom).
    pub(crate) read: u64,
    /// Slot bytes under write leases (taken from the DRAM tier's lease budget, which `PUT`s
    /// share).
    pub(crate) write: u64,
}

/// Bytes held under one kind of lease, node-wide, against a cap; published as a gauge. Kept
/// apart from [`ArenaAccess`] so that a charge (which may outlive the node, in a quarantine)
/// never keeps the registration alive past the arena's mapping.
struct LeasedBytes {
    now: AtomicU64,
    cap: u64,
    gauge: &'static str,
}

impl LeasedBytes {
    fn new(cap: u64, gauge: &'static str) -> Arc<Self> {
        Arc::new(LeasedBytes { now: AtomicU64::new(0), cap, gauge })
    }

    /// A charge of `bytes` more, given back when it drops; `None` past the cap (nothing counted).
    fn charge(self: &Arc<Self>, bytes: u64) -> Option<Charge> {
        let mut now = self.now.load(Ordering::Relaxed);
        loop {
            if now.saturating_add(bytes) > self.cap {
                return None;
            }
            match self.now.compare_exchange_weak(now, now + bytes, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => {
                    ::metrics::gauge!(self.gauge).set((now + bytes) as f64);
                    return Some(Charge { to: Arc::clone(self), bytes });
                }
                Err(seen) => now = seen,
            }
        }
    }
}

/// Bytes counted under a lease until dropped.
pub(crate) struct Charge {
    to: Arc<LeasedBytes>,
    bytes: u64,
}

impl Drop for Charge {
    fn drop(&mut self) {
        let left = self.to.now.fetch_sub(self.bytes, Ordering::Relaxed) - self.bytes;
        ::metrics::gauge!(self.to.gauge).set(left as f64);
    }
}

impl ArenaAccess {
    /// Registers the arena `base..base + len` with `fabric`; `caps`: the most bytes read and
    /// write leases may hold at once, node-wide.
    ///
    /// # Safety
    /// The arena must stay mapped while the returned value lives (the node keeps it beside its
    /// tiers and drops it first).
    pub(crate) unsafe fn register(
        fabric: Arc<dyn Fabric>,
        base: *mut u8,
        len: usize,
        caps: LeaseCaps,
    ) -> Result<Self, ServerError> {
        // SAFETY: forwarded from our caller.
        let registration = unsafe { fabric.register(base, len) }
            .map_err(|e| ServerError::Config(format!("registering the DRAM arena with {}: {e}", fabric.name())))?;
        Ok(ArenaAccess {
            name: fabric.name(),
            fabric,
            registration,
            base: base as usize,
            len,
            reads: LeasedBytes::new(caps.read, "kvtier_remote_read_leased_bytes"),
            writes: LeasedBytes::new(caps.write, "kvtier_remote_write_leased_bytes"),
        })
    }

    /// Payload bytes under read leases now, node-wide.
    pub fn read_leased_bytes(&self) -> u64 {
        self.reads.now.load(Ordering::Relaxed)
    }

    /// Slot bytes under write leases now, node-wide (quarantined ones included).
    pub fn write_leased_bytes(&self) -> u64 {
        self.writes.now.load(Ordering::Relaxed)
    }

    /// A charge of a write lease's slot of `slot_bytes`, given back when it drops; `None` past
    /// the cap (nothing counted).
    pub(crate) fn charge_write(&self, slot_bytes: u64) -> Option<Charge> {
        self.writes.charge(slot_bytes)
    }

    /// Connects a peer's endpoint (see [`Fabric::connect`]).
    pub(crate) fn connect(&self, peer: &[u8]) -> Result<(FabricEndpoint, Vec<u8>), String> {
        self.fabric.connect(peer)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The descriptor of `bytes` when they lie inside the arena (a slot's or a stored block's).
    pub fn describe(&self, bytes: &[u8]) -> Option<SlotDescriptor> {
        let at = (bytes.as_ptr() as usize).checked_sub(self.base)?;
        if at.checked_add(bytes.len())? > self.len {
            return None;
        }
        Some(SlotDescriptor {
            addr: self.registration.remote_base() + at as u64,
            rkey: self.registration.rkey(),
            len: bytes.len() as u64,
        })
    }
}

/// A slot a peer is writing: the DRAM lease, the header its bytes must match, and the slot's
/// charge against the node-wide cap (given back when the lease is committed or its quarantine
/// ends).
pub(crate) struct WriteLease {
    pub(crate) slot: Lease,
    pub(crate) header: FrameHeader,
    pub(crate) charge: Charge,
}

/// A block a peer is reading; held until `END_GET`, the deadline or the connection's end.
struct ReadLease {
    _block: StoredBlock,
    deadline: Instant,
    _charge: Charge,
}

/// The remote leases of one data-plane connection.
pub(crate) struct RemoteLeases {
    /// The connection's endpoint on the fabric, once its peer connected.
    endpoint: Option<FabricEndpoint>,
    next: u64,
    writes: HashMap<u64, WriteLease>,
    reads: HashMap<u64, ReadLease>,
    read_ttl: Duration,
}

impl RemoteLeases {
    pub(crate) fn new(read_ttl: Duration) -> Self {
        RemoteLeases { endpoint: None, next: 0, writes: HashMap::new(), reads: HashMap::new(), read_ttl }
    }

    pub(crate) fn is_connected(&self) -> bool {
        self.endpoint.is_some()
    }

    pub(crate) fn set_endpoint(&mut self, endpoint: FabricEndpoint) {
        self.endpoint = Some(endpoint);
    }

    /// Leases held now.
    pub(crate) fn len(&self) -> usize {
        self.writes.len() + self.reads.len()
    }

    /// Ends what passed its deadline: read leases at once; write leases (revoked by the DRAM
    /// tier by now, their commit would fail) into quarantine, since their peer may still be
    /// writing. Called before every request and when the earliest deadline passes.
    pub(crate) fn reap(&mut self, now: Instant) {
        if self.is_empty() {
            return;
        }
        self.reads.retain(|_, r| r.deadline > now);
        let late: Vec<u64> = self.writes.iter().filter(|(_, w)| w.slot.deadline() <= now).map(|(id, _)| *id).collect();
        quarantine(late.into_iter().filter_map(|id| self.writes.remove(&id)).collect());
    }

    fn is_empty(&self) -> bool {
        self.writes.is_empty() && self.reads.is_empty()
    }

    /// The earliest deadline of a lease held, if any.
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        let reads = self.reads.values().map(|r| r.deadline);
        reads.chain(self.writes.values().map(|w| w.slot.deadline())).min()
    }

    /// Whether another lease fits under [`MAX_REMOTE_LEASES`].
    pub(crate) fn has_room(&self) -> bool {
        self.len() < MAX_REMOTE_LEASES
    }

    fn id(&mut self) -> u64 {
        self.next += 1;
        self.next
    }

    pub(crate) fn add_write(&mut self, lease: WriteLease) -> u64 {
        let id = self.id();
        self.writes.insert(id, lease);
        id
    }

    pub(crate) fn take_write(&mut self, id: u64) -> Option<WriteLease> {
        self.writes.remove(&id)
    }

    /// Ends a write lease whose bytes were refused: its slot is quarantined like an abandoned one.
    pub(crate) fn abandon(&self, lease: WriteLease) {
        quarantine(vec![lease]);
    }

    /// A read lease on `block`, counted against `arena`'s node-wide cap; `None` past it.
    pub(crate) fn add_read(&mut self, block: StoredBlock, arena: &Arc<ArenaAccess>, now: Instant) -> Option<u64> {
        let charge = arena.reads.charge(block.payload.len() as u64)?;
        let id = self.id();
        self.reads.insert(id, ReadLease { _block: block, deadline: now + self.read_ttl, _charge: charge });
        Some(id)
    }

    /// Ends a read lease; false when there is none by that id (or it passed its deadline).
    pub(crate) fn end_read(&mut self, id: u64, now: Instant) -> bool {
        self.reads.remove(&id).is_some_and(|r| r.deadline > now)
    }
}

impl Drop for RemoteLeases {
    fn drop(&mut self) {
        // The endpoint first: once it is gone, no move of the peer's reaches the arena any more
        // (an RDMA queue pair destroyed); what was already on the wire lands within the quarantine.
        self.endpoint = None;
        quarantine(self.writes.drain().map(|(_, w)| w).collect());
    }
}

/// Keeps write leases' slots out of use for [`WRITE_QUARANTINE`] (a peer's write may still be
/// on its way into them), then returns them. Outside a runtime they are returned at once.
fn quarantine(leases: Vec<WriteLease>) {
    if leases.is_empty() {
        return;
    }
    ::metrics::counter!("kvtier_remote_leases_abandoned_total").increment(leases.len() as u64);
    if let Ok(rt) = tokio::runtime::Handle::try_current() {
        rt.spawn(async move {
            tokio::time::sleep(WRITE_QUARANTINE).await;
            drop(leases);
        });
    }
}

/// The node's arena access, shared by its connections.
pub type SharedArenaAccess = Arc<ArenaAccess>;
