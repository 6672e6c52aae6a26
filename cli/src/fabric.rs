//! `kvtier serve --rdma-device`: the node's DRAM arena registered with an RDMA device (the
//! agent's verbs wrapper behind the server's `Fabric` seam), so that peers lease its slots over
//! the data plane and move blocks one-sidedly. Needs the `rdma` feature; without it, or on a
//! machine with no verbs device, asking for one stops the start with a message saying why.

use anyhow::Result;
use kvtier_server::NodeState;

/// Registers `state`'s DRAM arena with the RDMA device `device` (`any`: the first one).
pub fn attach_rdma(state: &NodeState, device: &str) -> Result<()> {
    #[cfg(feature = "rdma")]
    {
        let name = (device != "any").then_some(device);
        let dev = kvtier_agent::mover::open_rdma(name)
            .map_err(|e| anyhow::anyhow!("--rdma-device {device}: {e} (start without it to serve over TCP only)"))?;
        state.attach_fabric(std::sync::Arc::new(verbs::RdmaFabric(dev)))?;
        Ok(())
    }
    #[cfg(not(feature = "rdma"))]
    {
        let _ = state;
        anyhow::bail!(
            "--rdma-device {device}: this kvtier was built without the `rdma` feature \
             (cargo build --release -p kvtier-cli --features rdma)"
        )
    }
}

#[cfg(feature = "rdma")]
mod verbs {
    use kvtier_agent::mover::rdma::{RdmaDevice, RdmaMemoryRegion};
    use kvtier_agent::mover::EndpointDescriptor;
    use kvtier_server::fabric::{Fabric, FabricEndpoint, FabricRegistration};

    /// An RDMA device as the server's fabric.
    pub(super) struct RdmaFabric(pub(super) RdmaDevice);

    struct Registration(RdmaMemoryRegion);

    impl FabricRegistration for Registration {
        fn rkey(&self) -> u32 {
            self.0.rkey()
        }
        fn remote_base(&self) -> u64 {
            self.0.iova()
        }
    }

    impl Fabric for RdmaFabric {
        fn name(&self) -> String {
            format!("rdma {}", self.0.name())
        }

        unsafe fn register(&self, base: *mut u8, len: usize) -> Result<Box<dyn FabricRegistration>, String> {
            // SAFETY: forwarded from our caller (the node keeps its arena mapped while registered).
            let region = unsafe { self.0.register_raw(base, len) }.map_err(|e| e.to_string())?;
            Ok(Box::new(Registration(region)))
        }

        /// A queue pair of its own for each peer's connection, connected to the peer's.
        fn connect(&self, peer: &[u8]) -> Result<(FabricEndpoint, Vec<u8>), String> {
            let remote = EndpointDescriptor::decode(peer).map_err(|e| e.to_string())?;
            let mover = self.0.mover().map_err(|e| e.to_string())?;
            mover.connect(&remote).map_err(|e| e.to_string())?;
            let ours = mover.endpoint().encode().to_vec();
            Ok((Box::new(mover), ours))
        }
    }
}
