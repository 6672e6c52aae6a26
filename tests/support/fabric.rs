//! The agent's loopback fabric behind the server's `Fabric` seam: what an RDMA NIC is to
//! `kvtier serve --rdma-device`, for tests that run a node and its one-sided peers in one process
//! on a machine without a NIC. Moves are copies with the verbs mover's checks and completions.

use std::sync::Arc;

use kvtier_agent::mover::loopback::{LoopbackFabric, LoopbackMover, LoopbackRawRegistration};
use kvtier_agent::mover::EndpointDescriptor;
use kvtier_server::fabric::{Fabric, FabricEndpoint, FabricRegistration};

/// The node's side of a [`LoopbackFabric`]; peers move through `LoopbackMover`s on the same one.
pub struct ArenaOnLoopback(pub Arc<LoopbackFabric>);

struct ArenaRegistration {
    reg: LoopbackRawRegistration,
    base: u64,
}

impl FabricRegistration for ArenaRegistration {
    fn rkey(&self) -> u32 {
        self.reg.rkey()
    }
    fn remote_base(&self) -> u64 {
        self.base
    }
}

impl Fabric for ArenaOnLoopback {
    fn name(&self) -> String {
        "loopback".into()
    }

    unsafe fn register(&self, base: *mut u8, len: usize) -> Result<Box<dyn FabricRegistration>, String> {
        // SAFETY: forwarded from our caller (the node keeps its arena mapped while registered).
        let reg = unsafe { self.0.register_raw(base, len) };
        Ok(Box::new(ArenaRegistration { reg, base: base as u64 }))
    }

    /// A link of the loopback fabric stands for the queue pair: the peer's endpoint is checked
    /// as the verbs fabric would check it, and the node's names the link (its "queue pair
    /// number"), which the peer's mover connects to ([`connect_peer`]). The connection holds the
    /// link; when it ends, the peer's moves stop reaching the arena.
    fn connect(&self, peer: &[u8]) -> Result<(FabricEndpoint, Vec<u8>), String> {
        EndpointDescriptor::decode(peer).map_err(|e| e.to_string())?;
        let link = self.0.open_link();
        let ours = EndpointDescriptor { qpn: link.id(), psn: 7, lid: 1, gid: [0; 16] };
        Ok((Box::new(link), ours.encode().to_vec()))
    }
}

/// A peer's endpoint as its mover would describe it (queue pair 0x42).
pub fn peer_endpoint() -> [u8; 32] {
    EndpointDescriptor { qpn: 0x42, psn: 9, lid: 1, gid: [0; 16] }.encode()
}

/// Connects a peer's mover to the node's end, as `CONNECT` answered it.
pub fn connect_peer(mover: &LoopbackMover, node: &[u8]) -> kvtier_agent::Result<()> {
    mover.connect_link(EndpointDescriptor::decode(node)?.qpn);
    Ok(())
}
