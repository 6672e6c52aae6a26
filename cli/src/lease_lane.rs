//! The agent's spills as one-sided writes (`kvtier agent --rdma-device`): a [`LeaseLane`] is a
//! lease session with the node's server (`KvClient::lease_session`, connected to the server's
//! fabric) and a [`OneSided`] writer on the same fabric. A spilled block is leased, written into
//! its slot of the server's DRAM from the writer's registered staging buffer (an RDMA WRITE),
//! and committed; the server's CPU never copies it. A fetch takes read leases on the blocks the
//! server holds in DRAM and reads them one-sidedly, checking each against its checksum. The store
//! falls back to the same-node path for whatever the lane can't place or find (a refusal, a block
//! on disk or in G1, a broken writer), so nothing is lost to it.

use std::time::Duration;

use kvtier_agent::AgentError;
use kvtier_client::{GetGrant, ItemStatus, KvClient, LeaseSession, NamespaceHandle, PutGrant};
use kvtier_proto::dataplane::SlotDescriptor;
use kvtier_proto::{BlockKey, CodecId, FrameHeader};

/// How long one one-sided move may take before the writer counts as broken.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))] // the RDMA writer's; a build without it has none
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// A writer on the server's fabric: its endpoint, its connection to the server's endpoint, and
/// one-sided writes from its own registered memory into a leased slot.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))] // built without `rdma`, only the tests' writer
pub trait OneSided: Send {
    /// This side's endpoint, encoded for the server.
    fn endpoint(&self) -> Vec<u8>;
    /// Connects to the server's endpoint (as `CONNECT` answered it).
    fn connect(&mut self, server: &[u8]) -> kvtier_agent::Result<()>;
    /// Writes `bytes` into `slot`, waiting for the completion.
    fn write(&mut self, bytes: &[u8], slot: &SlotDescriptor) -> kvtier_agent::Result<()>;
    /// Reads `slot` into `out` (exactly its length), waiting for the completion.
    fn read(&mut self, slot: &SlotDescriptor, out: &mut [u8]) -> kvtier_agent::Result<()>;
}

/// A lease session and its writer.
pub struct LeaseLane {
    session: LeaseSession,
    writer: Box<dyn OneSided>,
}

impl LeaseLane {
    /// Opens a lease session with `client`'s server and connects `writer` to its fabric.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))] // as `OneSided`
    pub async fn connect(client: &KvClient, mut writer: Box<dyn OneSided>) -> anyhow::Result<Self> {
        let mut session = client.lease_session().await?;
        let server = session.connect(&writer.endpoint()).await?;
        writer.connect(&server)?;
        Ok(LeaseLane { session, writer })
    }

    /// Places one raw block of `h` through the lane: `Ok(true)` when the server holds it now
    /// (committed, or held already), `Ok(false)` when the lane refused it (the caller stores it
    /// the other way).
    pub async fn spill(&mut self, h: &NamespaceHandle, key: &BlockKey, payload: &[u8]) -> Result<bool, AgentError> {
        // The header of the raw block (no copy of it is made: it is written from `payload`).
        let header = FrameHeader {
            codec: CodecId::RAW,
            tokens: h.block_tokens() as u32,
            flags: 0,
            namespace: h.id,
            key: *key,
            layout: h.namespace.layout,
            payload_len: payload.len() as u64,
            checksum: kvtier_proto::checksum(payload),
        };
        let lane = |e: kvtier_client::ClientError| AgentError::Spill(format!("lease lane: {e}"));
        Ok(match self.session.lease_put(&[header]).await.map_err(lane)?.first() {
            Some(PutGrant::Granted(g)) => {
                self.writer.write(payload, &g.slot)?;
                let st = self.session.commit(&[g.lease]).await.map_err(lane)?;
                st.first() == Some(&ItemStatus::Ok)
            }
            Some(PutGrant::Present) => true,
            _ => false,
        })
    }

    /// Reads the blocks of `keys` the server holds in DRAM into `out` (block `i` at
    /// `i * block_bytes`), each checked against its checksum where it landed; true where block
    /// `i` landed. The rest is the caller's to fetch another way.
    pub async fn fetch(
        &mut self,
        h: &NamespaceHandle,
        keys: &[BlockKey],
        block_bytes: usize,
        out: &mut [u8],
    ) -> Result<Vec<bool>, AgentError> {
        let lane = |e: kvtier_client::ClientError| AgentError::Spill(format!("lease lane: {e}"));
        let grants = self.session.lease_get(h.id, keys, false).await.map_err(lane)?;
        let mut landed = vec![false; keys.len()];
        let mut leases = Vec::new();
        let mut failed = None;
        for (i, g) in grants.iter().enumerate() {
            let GetGrant::Granted { header, grant } = g else { continue };
            leases.push(grant.lease);
            if header.payload_len != block_bytes as u64 || header.codec != CodecId::RAW || failed.is_some() {
                continue;
            }
            let dst = &mut out[i * block_bytes..(i + 1) * block_bytes];
            match self.writer.read(&grant.slot, dst) {
                // A lease that ended under the read is a mismatch here, never data.
                Ok(()) => landed[i] = header.verify_payload(dst).is_ok(),
                Err(e) => failed = Some(e),
            }
        }
        if !leases.is_empty() {
            self.session.end_get(&leases).await.map_err(lane)?;
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(landed),
        }
    }
}

/// The RDMA writer: a queue pair on the device and a registered staging buffer of one block.
#[cfg(feature = "rdma")]
pub mod rdma {
    use kvtier_agent::mover::rdma::{RdmaMover, RdmaRegion};
    use kvtier_agent::mover::{BulkMover, EndpointDescriptor, MoverRegion};
    use kvtier_agent::{AgentError, HostBuffer};
    use kvtier_proto::dataplane::SlotDescriptor;

    use super::{OneSided, WRITE_TIMEOUT};

    pub struct RdmaWriter {
        mover: RdmaMover,
        staging: RdmaRegion,
    }

    impl RdmaWriter {
        /// A writer on `device` (`any`: the first) staging blocks of up to `block_bytes`.
        pub fn open(device: &str, block_bytes: usize) -> kvtier_agent::Result<Self> {
            let dev = kvtier_agent::mover::open_rdma((device != "any").then_some(device))?;
            let mover = dev.mover()?;
            let staging = mover.register(&HostBuffer::new(block_bytes))?;
            Ok(RdmaWriter { mover, staging })
        }
    }

    impl OneSided for RdmaWriter {
        fn endpoint(&self) -> Vec<u8> {
            self.mover.endpoint().encode().to_vec()
        }

        fn connect(&mut self, server: &[u8]) -> kvtier_agent::Result<()> {
            self.mover.connect(&EndpointDescriptor::decode(server)?)
        }

        fn write(&mut self, bytes: &[u8], slot: &SlotDescriptor) -> kvtier_agent::Result<()> {
            if bytes.len() > self.staging.buffer().len() {
                return Err(AgentError::Spill(format!(
                    "a {}-byte block; staging holds {}",
                    bytes.len(),
                    self.staging.buffer().len()
                )));
            }
            self.staging.buffer().write(0, bytes)?;
            self.mover.write(&self.staging, 0, slot, 0, bytes.len(), WRITE_TIMEOUT)
        }

        fn read(&mut self, slot: &SlotDescriptor, out: &mut [u8]) -> kvtier_agent::Result<()> {
            if out.len() > self.staging.buffer().len() || slot.len != out.len() as u64 {
                return Err(AgentError::Spill(format!(
                    "a {}-byte slot into {} bytes; staging holds {}",
                    slot.len,
                    out.len(),
                    self.staging.buffer().len()
                )));
            }
            self.mover.read(slot, 0, &self.staging, 0, out.len(), WRITE_TIMEOUT)?;
            self.staging.buffer().read(0, out)
        }
    }
}
