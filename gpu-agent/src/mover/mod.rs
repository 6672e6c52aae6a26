//! One-sided bulk movers (DESIGN.md, "One arena, leases, one-sided movers"): a [`BulkMover`]
//! writes or reads a peer's leased slot without the peer's CPU touching the bytes.
//!
//! The lessor (the node that owns the arena) registers its memory with a mover once and hands out
//! a [`SlotDescriptor`] — `(addr, rkey, len)`, 24 bytes on the wire — for each leased slot; the
//! other side posts one-sided WRITEs into it (a put) or READs from it (a get) and waits for the
//! completion with a timeout. Every move is checked against the slot's bounds before it is posted
//! ([`AgentError::OutsideLease`]), and the lessor's registration bounds it again (a NIC refuses an
//! access outside the registered region: [`AgentError::RemoteAccess`]).
//!
//! Implementations:
//!
//! - [`loopback`]: an in-process fabric that copies memory, with the same checks, completions and
//!   timeouts as the verbs one. Tests run the mover logic through it on any machine.
//! - `rdma` (feature `rdma`, rdma-sys): RDMA verbs — device, protection domain, an RC queue pair
//!   per peer, memory regions (host memory, and device pages through dma-buf where the driver
//!   allows), one-sided READ/WRITE, completion polling with a deadline. With no device at run
//!   time opening it is [`AgentError::NoRdmaDevice`], and callers use the TCP/QUIC path;
//!   [`open_rdma`] says the same in a build without the feature.
//!
//! A move that times out breaks its mover ([`AgentError::Timeout`], then every later move is
//! refused): the request may still be in flight, so the verbs mover flushes its queue pair before
//! anything else can reuse the memory, and the caller reconnects or falls back.

pub mod loopback;
#[cfg(feature = "rdma")]
pub mod rdma;

use std::time::{Duration, Instant};

use crate::device::HostBuffer;
use crate::error::{AgentError, Result};

pub use kvtier_proto::dataplane::SlotDescriptor;
pub use kvtier_proto::dataplane::SLOT_DESCRIPTOR_LEN;

/// Decodes a peer's slot descriptor (see [`SlotDescriptor::decode`]) as this crate's error.
pub fn decode_slot(bytes: &[u8]) -> Result<SlotDescriptor> {
    SlotDescriptor::decode(bytes).map_err(|e| AgentError::BadDescriptor(e.to_string()))
}

/// The part `offset..offset + len` of `slot`, refused when it leaves the slot.
pub fn window(slot: &SlotDescriptor, offset: u64, len: u64) -> Result<SlotDescriptor> {
    slot.window(offset, len).ok_or(AgentError::OutsideLease { offset, len, slot: slot.len })
}

/// Magic of an encoded [`EndpointDescriptor`].
const ENDPOINT_MAGIC: [u8; 4] = *b"KVQP";
/// Bytes of an encoded [`EndpointDescriptor`].
pub const ENDPOINT_DESCRIPTOR_LEN: usize = 32;

/// One side of a reliable connection between two verbs movers, exchanged over the control plane
/// before any one-sided move: queue pair number, first packet sequence number, port LID
/// (InfiniBand) and GID (RoCE; all zero on InfiniBand without routing).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EndpointDescriptor {
    pub qpn: u32,
    pub psn: u32,
    pub lid: u16,
    pub gid: [u8; 16],
}

impl EndpointDescriptor {
    /// Little-endian: magic `KVQP`, qpn (u32, 24 bits used), psn (u32, 24 bits used), lid (u16),
    /// two zero bytes, gid (16 bytes as the NIC gives them).
    pub fn encode(&self) -> [u8; ENDPOINT_DESCRIPTOR_LEN] {
        let mut b = [0u8; ENDPOINT_DESCRIPTOR_LEN];
        b[0..4].copy_from_slice(&ENDPOINT_MAGIC);
        b[4..8].copy_from_slice(&self.qpn.to_le_bytes());
        b[8..12].copy_from_slice(&self.psn.to_le_bytes());
        b[12..14].copy_from_slice(&self.lid.to_le_bytes());
        b[16..32].copy_from_slice(&self.gid);
        b
    }

    /// Decodes and checks a peer's endpoint: length, magic, 24-bit qpn and psn, zero padding.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        if bytes.len() != ENDPOINT_DESCRIPTOR_LEN {
            return Err(AgentError::BadDescriptor(format!(
                "endpoint descriptor is {} bytes, {ENDPOINT_DESCRIPTOR_LEN} expected",
                bytes.len()
            )));
        }
        if bytes[0..4] != ENDPOINT_MAGIC {
            return Err(AgentError::BadDescriptor(format!("bad endpoint descriptor magic {:02x?}", &bytes[0..4])));
        }
        let u32_at = |o: usize| u32::from_le_bytes([bytes[o], bytes[o + 1], bytes[o + 2], bytes[o + 3]]);
        let (qpn, psn) = (u32_at(4), u32_at(8));
        if qpn >= 1 << 24 || psn >= 1 << 24 || bytes[14..16] != [0, 0] {
            return Err(AgentError::BadDescriptor(format!(
                "endpoint qpn {qpn:#x} / psn {psn:#x} / padding out of range"
            )));
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&bytes[16..32]);
        Ok(EndpointDescriptor { qpn, psn, lid: u16::from_le_bytes([bytes[12], bytes[13]]), gid })
    }
}

/// Local memory registered with a mover (the arena on the lessor's side, a staging buffer on the
/// mover's). Dropping it deregisters.
pub trait MoverRegion: Send + Sync {
    /// The registered bytes.
    fn buffer(&self) -> &HostBuffer;
}

/// Moves bytes one-sidedly between registered local memory and peers' leased slots.
pub trait BulkMover: Send + Sync {
    type Region: MoverRegion;

    /// Registers `buf` for local use and remote access (read and write) by peers holding one of
    /// its slot descriptors.
    fn register(&self, buf: &HostBuffer) -> Result<Self::Region>;

    /// The descriptor of `len` bytes at `offset` of a registered region: what the lessor sends a
    /// peer for a lease.
    fn describe(&self, region: &Self::Region, offset: usize, len: usize) -> Result<SlotDescriptor>;

    /// Writes `len` bytes from `local` at `local_offset` into `slot` at `slot_offset`, and waits
    /// at most `timeout` for the completion.
    fn write(
        &self,
        local: &Self::Region,
        local_offset: usize,
        slot: &SlotDescriptor,
        slot_offset: u64,
        len: usize,
        timeout: Duration,
    ) -> Result<()>;

    /// Reads `len` bytes of `slot` at `slot_offset` into `local` at `local_offset`, and waits at
    /// most `timeout` for the completion.
    fn read(
        &self,
        slot: &SlotDescriptor,
        slot_offset: u64,
        local: &Self::Region,
        local_offset: usize,
        len: usize,
        timeout: Duration,
    ) -> Result<()>;
}

/// The checks every mover makes before posting: the local range inside its region, the remote
/// window inside its slot. Returns the remote window.
pub(crate) fn check_move(
    local: &HostBuffer,
    local_offset: usize,
    slot: &SlotDescriptor,
    slot_offset: u64,
    len: usize,
) -> Result<SlotDescriptor> {
    crate::device::check_bounds("mover local", local_offset, len, local.len())?;
    window(slot, slot_offset, len as u64)
}

/// One finished request of a mover's completion queue.
#[derive(Debug)]
pub(crate) struct Completion {
    pub(crate) wr_id: u64,
    pub(crate) result: Result<()>,
}

/// Where a mover's completions come from (the verbs completion queue, the loopback's list).
pub(crate) trait CompletionQueue {
    /// The completions available now (none is fine); an error when the queue itself failed.
    fn poll(&self) -> Result<Vec<Completion>>;
}

/// Polls `cq` until the completion of request `wr_id` arrives (its result) or `timeout` passes
/// ([`AgentError::Timeout`]). Completions of other requests (ones abandoned by an earlier timeout)
/// are dropped. Spins briefly, then sleeps in short steps, so a long wait does not burn a core.
pub(crate) fn wait_completion<Q: CompletionQueue + ?Sized>(
    cq: &Q,
    wr_id: u64,
    op: &'static str,
    timeout: Duration,
) -> Result<()> {
    let start = Instant::now();
    let mut polls = 0u32;
    loop {
        for c in cq.poll()? {
            if c.wr_id == wr_id {
                return c.result;
            }
        }
        let waited = start.elapsed();
        if waited >= timeout {
            return Err(AgentError::Timeout { op, waited_ms: waited.as_millis() as u64 });
        }
        polls += 1;
        if polls < 64 {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(Duration::from_micros(50).min(timeout - waited));
        }
    }
}

/// Opens the RDMA mover's device (`name`, or the first one), or says why not: without the `rdma`
/// feature, or on a machine with no verbs device, [`AgentError::NoRdmaDevice`] — the caller then
/// moves the bytes over TCP/QUIC.
#[cfg(feature = "rdma")]
pub fn open_rdma(name: Option<&str>) -> Result<rdma::RdmaDevice> {
    rdma::RdmaDevice::open(name)
}

/// Opens the RDMA mover's device, or says why not: this build has no `rdma` feature, so always
/// [`AgentError::NoRdmaDevice`] (the caller moves the bytes over TCP/QUIC).
#[cfg(not(feature = "rdma"))]
pub fn open_rdma(_name: Option<&str>) -> Result<std::convert::Infallible> {
    Err(AgentError::NoRdmaDevice("this build has no `rdma` feature".into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::collections::VecDeque;

    #[test]
    fn peers_descriptors_decode_as_this_crates_errors() {
        let d = SlotDescriptor { addr: 0x7fff_dead_b000, rkey: u32::MAX, len: 1 << 30 };
        assert_eq!(decode_slot(&d.encode()).unwrap(), d);
        let mut magic = d.encode();
        magic[0] = b'X';
        assert!(matches!(decode_slot(&magic), Err(AgentError::BadDescriptor(m)) if m.contains("magic")));
        assert!(matches!(decode_slot(&magic[..23]), Err(AgentError::BadDescriptor(_))));
    }

    #[test]
    fn endpoints_round_trip_and_refuse_garbage() {
        let e = EndpointDescriptor { qpn: 0x12_3456, psn: 0xab_cdef, lid: 17, gid: [0xfe; 16] };
        let b = e.encode();
        assert_eq!(EndpointDescriptor::decode(&b).unwrap(), e);
        assert!(matches!(EndpointDescriptor::decode(&b[..31]), Err(AgentError::BadDescriptor(_))));
        for (at, v) in [(0usize, b'x'), (7, 1), (11, 1), (14, 1)] {
            let mut bad = b;
            bad[at] = v;
            assert!(matches!(EndpointDescriptor::decode(&bad), Err(AgentError::BadDescriptor(_))), "byte {at}");
        }
        // A slot descriptor is not an endpoint.
        assert!(EndpointDescriptor::decode(
            &[SlotDescriptor { addr: 1, rkey: 2, len: 3 }.encode(), [0; 24]].concat()[..32]
        )
        .is_err());
    }

    #[test]
    fn windows_stay_inside_the_slot() {
        let s = SlotDescriptor { addr: 1000, rkey: 3, len: 100 };
        assert_eq!(window(&s, 0, 100).unwrap(), s);
        assert_eq!(window(&s, 40, 60).unwrap(), SlotDescriptor { addr: 1040, rkey: 3, len: 60 });
        assert_eq!(window(&s, 100, 0).unwrap().len, 0);
        for (off, len) in [(0, 101), (1, 100), (101, 0), (u64::MAX, 2), (50, u64::MAX)] {
            assert_eq!(
                window(&s, off, len),
                Err(AgentError::OutsideLease { offset: off, len, slot: 100 }),
                "{off}+{len}"
            );
        }
        let local = HostBuffer::new(10);
        assert!(matches!(check_move(&local, 5, &s, 0, 6), Err(AgentError::OutOfBounds { .. })));
        assert!(matches!(check_move(&local, 0, &s, 95, 6), Err(AgentError::OutsideLease { .. })));
        assert_eq!(check_move(&local, 4, &s, 94, 6).unwrap(), SlotDescriptor { addr: 1094, rkey: 3, len: 6 });
    }

    /// A scripted completion queue: each poll hands out the next batch.
    struct Scripted(RefCell<VecDeque<Vec<Completion>>>);

    impl CompletionQueue for Scripted {
        fn poll(&self) -> Result<Vec<Completion>> {
            Ok(self.0.borrow_mut().pop_front().unwrap_or_default())
        }
    }

    #[test]
    fn waiting_skips_stale_completions_and_returns_the_result() {
        let q = Scripted(RefCell::new(VecDeque::from([
            vec![],
            vec![Completion { wr_id: 1, result: Err(AgentError::RemoteAccess("stale".into())) }],
            vec![Completion { wr_id: 2, result: Ok(()) }],
        ])));
        wait_completion(&q, 2, "test", Duration::from_secs(5)).unwrap();
        let q = Scripted(RefCell::new(VecDeque::from([vec![Completion {
            wr_id: 5,
            result: Err(AgentError::RemoteAccess("bad rkey".into())),
        }]])));
        assert_eq!(
            wait_completion(&q, 5, "test", Duration::from_secs(5)),
            Err(AgentError::RemoteAccess("bad rkey".into()))
        );
    }

    #[test]
    fn waiting_times_out() {
        let q = Scripted(RefCell::new(VecDeque::new()));
        let t = Instant::now();
        let err = wait_completion(&q, 1, "RDMA WRITE", Duration::from_millis(30)).unwrap_err();
        let took = t.elapsed();
        assert!(matches!(err, AgentError::Timeout { op: "RDMA WRITE", waited_ms } if waited_ms >= 30), "{err:?}");
        assert!(took >= Duration::from_millis(30) && took < Duration::from_secs(2), "{took:?}");
    }

    #[cfg(not(feature = "rdma"))]
    #[test]
    fn without_the_feature_rdma_is_unavailable() {
        let err = open_rdma(None).unwrap_err();
        assert!(matches!(&err, AgentError::NoRdmaDevice(m) if m.contains("feature")), "{err:?}");
        assert!(err.to_string().contains("TCP/QUIC"));
    }
}
