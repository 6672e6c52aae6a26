//! What a kvtier node needs of [`KvClient`] to reach its peers (the server's G4 peer tier):
//! loads, presence checks and stores flagged `FLAG_PEER`, so the peer answers from its own tiers
//! and never asks or forwards further. Engines don't call these.

use futures::future::try_join_all;
use kvtier_proto::dataplane::ItemStatus;
use kvtier_proto::{pb, BlockFrame, BlockKey};

use super::{KvClient, NamespaceHandle};
use crate::ClientError;

impl KvClient {
    /// Loads blocks by key from the server's own tiers (it asks no peer); `None` for a miss. One
    /// data-plane request per `max_blocks_per_request` keys the server announced. Every frame was
    /// verified end to end.
    pub async fn peer_load_keys(
        &self,
        ns: &NamespaceHandle,
        keys: &[BlockKey],
    ) -> Result<Vec<Option<BlockFrame>>, ClientError> {
        let max_frame = self.inner.info.max_frame_bytes;
        let per = (self.inner.info.max_blocks_per_request as usize).max(1);
        let id = ns.id;
        let results = self
            .timed(try_join_all(keys.chunks(per).map(|c| async move {
                let mut lease = self.inner.pool.lease().await?;
                let conn = lease.conn.as_mut().ok_or_else(|| ClientError::Io("no connection".into()))?;
                let got = conn.get_peer(id, c, max_frame).await?;
                lease.release();
                Ok::<_, ClientError>(got)
            })))
            .await?;
        Ok(results.into_iter().flatten().collect())
    }

    /// Which keys the server's own tiers hold (it asks no peer). One data-plane request per
    /// `max_blocks_per_request` keys.
    pub async fn peer_exists_keys(&self, ns: &NamespaceHandle, keys: &[BlockKey]) -> Result<Vec<bool>, ClientError> {
        let per = (self.inner.info.max_blocks_per_request as usize).max(1);
        let id = ns.id;
        let results = self
            .timed(try_join_all(keys.chunks(per).map(|c| async move {
                let mut lease = self.inner.pool.lease().await?;
                let conn = lease.conn.as_mut().ok_or_else(|| ClientError::Io("no connection".into()))?;
                let got = conn.exists_peer(id, c).await?;
                lease.release();
                Ok::<_, ClientError>(got)
            })))
            .await?;
        Ok(results.into_iter().flatten().collect())
    }

    /// Stores frames as they are, asking the server not to forward them to other nodes. One
    /// status per frame.
    pub async fn peer_store_frames(&self, frames: &[BlockFrame]) -> Result<Vec<ItemStatus>, ClientError> {
        let batches = self.batches(frames);
        let results = self
            .timed(try_join_all(batches.into_iter().map(|r| async move {
                let mut lease = self.inner.pool.lease().await?;
                let conn = lease.conn.as_mut().ok_or_else(|| ClientError::Io("no connection".into()))?;
                let st = conn.put_peer(&frames[r]).await?;
                lease.release();
                Ok::<_, ClientError>(st)
            })))
            .await?;
        Ok(results.into_iter().flatten().collect())
    }

    /// A `SessionReplica` call: reads, writes or drops the node's own copy of a parked session
    /// (how nodes replicate sessions; the node accepts it from its operator only).
    pub async fn session_replica(
        &self,
        req: pb::SessionReplicaRequest,
    ) -> Result<pb::SessionReplicaResponse, ClientError> {
        let mut g = self.grpc();
        self.timed(async move { Ok(g.session_replica(req).await?.into_inner()) }).await
    }
}
