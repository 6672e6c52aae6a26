//! Data-plane requests one node sends another on a client's behalf (the server's G4 peer tier):
//! a `GET`, an `EXISTS` and a `PUT` flagged [`FLAG_PEER`], so the peer serves them from its own
//! tiers and never asks or forwards further. A child of `conn` so that it reuses the connection's framing.

use kvtier_proto::dataplane::{ItemStatus, Op, FLAG_PEER};
use kvtier_proto::{BlockFrame, BlockKey, NamespaceId};
use tokio::io::AsyncReadExt;

use super::DataConn;
use crate::ClientError;

impl DataConn {
    /// A `GET` flagged [`FLAG_PEER`]: every key looked up on its own (no stop at a miss); `None`
    /// for a miss. Every returned frame was verified against its checksum and checked to be the
    /// key and namespace asked for.
    pub(crate) async fn get_peer(
        &mut self,
        ns: NamespaceId,
        keys: &[BlockKey],
        max_frame: u64,
    ) -> Result<Vec<Option<BlockFrame>>, ClientError> {
        self.keyed_request(Op::Get, FLAG_PEER, ns, keys).await?;
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            if ItemStatus::from_u8(self.rd.read_u8().await?)? != ItemStatus::Ok {
                out.push(None);
                continue;
            }
            let header = self.read_frame_header(ns, key, max_frame).await?;
            let (payload, sum) = self.read_payload_hashed(header.payload_len as usize).await?;
            out.push(super::verified(BlockFrame { header, payload }, sum));
        }
        Ok(out)
    }

    /// An `EXISTS` flagged [`FLAG_PEER`]: which keys the peer's own tiers hold.
    pub(crate) async fn exists_peer(&mut self, ns: NamespaceId, keys: &[BlockKey]) -> Result<Vec<bool>, ClientError> {
        self.keyed_request(Op::Exists, FLAG_PEER, ns, keys).await?;
        let mut st = vec![0u8; keys.len()];
        self.rd.read_exact(&mut st).await?;
        st.into_iter().map(|b| Ok(ItemStatus::from_u8(b)? == ItemStatus::Ok)).collect()
    }

    /// A `PUT` flagged [`FLAG_PEER`]; one status per frame.
    pub(crate) async fn put_peer(&mut self, frames: &[BlockFrame]) -> Result<Vec<ItemStatus>, ClientError> {
        self.put_frames(frames, FLAG_PEER).await
    }
}
