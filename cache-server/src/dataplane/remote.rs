//! The remote-lease ops of a data-plane connection — `CONNECT`, `LEASE_PUT`, `COMMIT`,
//! `LEASE_GET`, `END_GET` (protocol in `kvtier_proto::dataplane`, "Remote leases"; the leases
//! themselves in `crate::fabric`). The bytes move one-sidedly, outside this connection; it only
//! connects the peer to the fabric, grants slots, checks and publishes what was written, and ends
//! leases.

use std::sync::Arc;
use std::time::Instant;

use kvtier_proto::dataplane::{
    ItemStatus, LeaseGrant, Op, RequestHeader, ResponseHeader, Status, FLAG_PEER, FLAG_STOP_AT_MISS, LEASE_ID_LEN,
};
use kvtier_proto::{BlockKey, FrameHeader, NamespaceId, FRAME_HEADER_LEN, KEY_LEN};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};

use super::{block_keys, forward_to_peers, item_kind, ConnError, Connection};
use crate::dram::Priority;
use crate::error::ServerError;
use crate::fabric::{ArenaAccess, WriteLease};
use crate::metrics::{error, observe};
use crate::tenants::Principal;

/// A write lease this close to its deadline (or a tenth of `lease_timeout`, if less) is not
/// committed: the DRAM tier could revoke it under the commit, and free its slot without the
/// quarantine.
const COMMIT_MARGIN: std::time::Duration = std::time::Duration::from_secs(1);

/// The refusal of every lease op on a node with no fabric.
const NO_FABRIC: &str = "this node's DRAM arena is registered with no one-sided fabric (RDMA); use PUT and GET";

impl<R: AsyncRead + Unpin + Send, W: AsyncWrite + Unpin + Send> Connection<R, W> {
    /// Answers a request-level `BadRequest` (the connection stays usable: its `body` bytes are
    /// drained first).
    async fn refuse(&mut self, req: &RequestHeader, body: u64, kind: &'static str, msg: &str) -> Result<(), ConnError> {
        self.refuse_with(req, body, Status::BadRequest, kind, msg).await
    }

    /// [`Self::refuse`] with another status.
    async fn refuse_with(
        &mut self,
        req: &RequestHeader,
        body: u64,
        status: Status,
        kind: &'static str,
        msg: &str,
    ) -> Result<(), ConnError> {
        self.drain(body).await?;
        error(kind);
        self.wr.write_all(&ResponseHeader::error(req.op as u8, req.request_id, status, msg)).await?;
        Ok(())
    }

    /// The node's arena access, when a fabric is attached and this connection's peer connected
    /// to it; otherwise the request (its `body` bytes drained) is refused, saying which is missing.
    async fn arena_or_refuse(&mut self, req: &RequestHeader, body: u64) -> Result<Option<Arc<ArenaAccess>>, ConnError> {
        let Some(arena) = self.state.arena_access().cloned() else {
            self.refuse(req, body, "remote_lease_no_fabric", NO_FABRIC).await?;
            return Ok(None);
        };
        if !self.remote.is_connected() {
            let msg = "connect to the node's fabric first (CONNECT with this peer's endpoint)";
            self.refuse(req, body, "remote_lease_not_connected", msg).await?;
            return Ok(None);
        }
        Ok(Some(arena))
    }

    /// `CONNECT`: this connection's endpoint on the fabric, connected to the peer's.
    pub(super) async fn connect_fabric(&mut self, req: RequestHeader) -> Result<(), ConnError> {
        let body = u64::from(req.count);
        let Some(arena) = self.state.arena_access().cloned() else {
            return self.refuse(&req, body, "remote_lease_no_fabric", NO_FABRIC).await;
        };
        if self.remote.is_connected() {
            return self
                .refuse(&req, body, "remote_lease_reconnect", "this connection is connected to the fabric already")
                .await;
        }
        // One registration covers the whole arena: a connected peer reaches every tenant's blocks.
        let principal = self.principal()?;
        if !matches!(principal, Principal::Operator) {
            let msg = format!(
                "tenant {:?} may not connect to the fabric: one-sided access reaches the whole DRAM arena, \
                 so only the operator (auth_token) may",
                principal.name()
            );
            return self.refuse_with(&req, body, Status::Forbidden, "remote_lease_forbidden", &msg).await;
        }
        let mut peer = vec![0u8; req.count as usize];
        self.rd.read_exact(&mut peer).await?;
        match arena.connect(&peer) {
            Ok((endpoint, ours)) => {
                self.remote.set_endpoint(endpoint);
                let h = ResponseHeader::ok(Op::Connect, req.request_id, ours.len() as u32);
                self.wr.write_all(&h.encode()).await?;
                self.wr.write_all(&ours).await?;
            }
            Err(e) => {
                let msg = format!("{} could not connect this peer's endpoint: {e}", arena.name());
                self.refuse(&req, 0, "remote_lease_bad_endpoint", &msg).await?;
            }
        }
        Ok(())
    }

    /// `LEASE_PUT`: a slot for each frame header, to be written one-sidedly and committed.
    pub(super) async fn lease_put(&mut self, req: RequestHeader) -> Result<(), ConnError> {
        let start = Instant::now();
        let body = req.count as u64 * FRAME_HEADER_LEN as u64;
        let Some(arena) = self.arena_or_refuse(&req, body).await? else { return Ok(()) };
        let principal = self.principal()?;
        // Once, before any grant: a wait per item would run down the deadlines of earlier grants.
        self.state.tiers().backpressure().await;
        let mut answer = Vec::with_capacity(req.count as usize * (1 + LeaseGrant::LEN));
        for _ in 0..req.count {
            let mut fh = [0u8; FRAME_HEADER_LEN];
            self.rd.read_exact(&mut fh).await?;
            // Headers are fixed-size here (no payload follows), so a bad one is refused alone.
            let granted = match FrameHeader::decode(&fh) {
                Ok(sent) => self.lease_one(&principal, &sent, &arena),
                Err(_) => Err(ItemStatus::BadHeader),
            };
            match granted {
                Ok(grant) => {
                    answer.push(ItemStatus::Ok as u8);
                    answer.extend_from_slice(&grant.encode());
                }
                Err(status) => {
                    if status != ItemStatus::Present {
                        error(item_kind(status));
                    }
                    answer.push(status as u8);
                }
            }
        }
        self.wr.write_all(&ResponseHeader::ok(Op::LeasePut, req.request_id, req.count).encode()).await?;
        self.wr.write_all(&answer).await?;
        observe("dataplane_lease_put", start);
        Ok(())
    }

    /// One frame of a `LEASE_PUT`: its grant, or why there is none (`Present`: already held).
    fn lease_one(
        &mut self,
        principal: &Principal,
        sent: &FrameHeader,
        arena: &Arc<ArenaAccess>,
    ) -> Result<LeaseGrant, ItemStatus> {
        // Its payload's size is its layout's (a registered layout fits `max_frame_bytes`).
        let header = self.state.admit_frame(principal, sent)?;
        if self.state.tiers().is_hot(&header.namespace, &header.key) {
            return Err(ItemStatus::Present);
        }
        if !self.remote.has_room() {
            error("remote_leases_per_connection");
            return Err(ItemStatus::Capacity);
        }
        // Peers' write leases, node-wide, hold at most their share of the DRAM lease budget (in
        // slot bytes, as the budget counts them); checked before the reserve, which may evict.
        let Some(charge) = arena.charge_write(crate::dram::slot_bytes(header.payload_len as usize)) else {
            error("remote_write_leased_bytes");
            return Err(ItemStatus::Capacity);
        };
        let mut slot =
            self.state.tiers().reserve(&header.namespace, header.payload_len as usize).map_err(|e| match e {
                ServerError::Capacity(_) | ServerError::TooLarge { .. } => ItemStatus::Capacity,
                _ => ItemStatus::Internal,
            })?;
        // Every slot is carved from the registered arena; a slot outside it would be a bug.
        let desc = arena.describe(slot.buf_mut()).ok_or(ItemStatus::Internal)?;
        let lease = self.remote.add_write(WriteLease { slot, header, charge });
        Ok(LeaseGrant { lease, slot: desc })
    }

    /// Reads the `count` lease ids of a `COMMIT` or `END_GET`.
    async fn read_lease_ids(&mut self, count: u32) -> Result<Vec<u64>, ConnError> {
        let mut raw = vec![0u8; count as usize * LEASE_ID_LEN];
        self.rd.read_exact(&mut raw).await?;
        Ok(raw
            .chunks_exact(LEASE_ID_LEN)
            .map(|c| {
                let mut id = [0u8; LEASE_ID_LEN];
                id.copy_from_slice(c);
                u64::from_le_bytes(id)
            })
            .collect())
    }

    /// `COMMIT`: checks each leased slot against its header's checksum and publishes it.
    pub(super) async fn commit_leases(&mut self, req: RequestHeader) -> Result<(), ConnError> {
        let start = Instant::now();
        let body = req.count as u64 * LEASE_ID_LEN as u64;
        if self.arena_or_refuse(&req, body).await?.is_none() {
            return Ok(());
        }
        let ids = self.read_lease_ids(req.count).await?;
        let mut statuses = Vec::with_capacity(ids.len());
        let mut stored: Vec<(NamespaceId, BlockKey)> = Vec::new();
        // As a `PUT`: a client's blocks in a cluster go on to their other owners, a peer's don't.
        let forward = req.flags & FLAG_PEER == 0 && self.state.tiers().has_remote();
        let margin = COMMIT_MARGIN.min(self.state.config().lease_timeout.0 / 10);
        for id in ids {
            let status = match self.remote.take_write(id) {
                None => ItemStatus::NoLease,
                // At (or about to reach) its deadline: ended, like one reaped already.
                Some(late) if late.slot.deadline() <= Instant::now() + margin => {
                    self.remote.abandon(late);
                    ItemStatus::NoLease
                }
                // Hashed where the peer wrote it. A (trusted) peer that writes again after its
                // commit changes a published block under its checksum: every kvtier reader checks
                // what it received against it, so that is a miss there, never wrong bytes.
                Some(WriteLease { mut slot, header, charge }) => {
                    if kvtier_proto::checksum(slot.buf_mut()) != header.checksum {
                        // The peer may still be writing (it committed early): the slot waits.
                        self.remote.abandon(WriteLease { slot, header, charge });
                        ItemStatus::ChecksumMismatch
                    } else {
                        let priority = if forward { self.state.store_priority(&header) } else { Priority::Normal };
                        match self.state.tiers().commit(slot, header, priority) {
                            Ok(_) => {
                                if forward {
                                    stored.push((header.namespace, header.key));
                                }
                                ItemStatus::Ok
                            }
                            // The tier shrank under it, or failed.
                            Err(ServerError::Capacity(_) | ServerError::TooLarge { .. }) => ItemStatus::Capacity,
                            Err(_) => ItemStatus::Internal,
                        }
                    }
                }
            };
            if status != ItemStatus::Ok {
                error(item_kind(status));
            }
            statuses.push(status as u8);
        }
        self.wr.write_all(&ResponseHeader::ok(Op::Commit, req.request_id, req.count).encode()).await?;
        self.wr.write_all(&statuses).await?;
        forward_to_peers(&self.state, stored);
        observe("dataplane_commit", start);
        Ok(())
    }

    /// `LEASE_GET`: for each key DRAM holds, its header and a read lease on its payload.
    pub(super) async fn lease_get(&mut self, req: RequestHeader) -> Result<(), ConnError> {
        let start = Instant::now();
        let body = req.count as u64 * KEY_LEN as u64;
        let Some(arena) = self.arena_or_refuse(&req, body).await? else { return Ok(()) };
        let Some(raw) = self.read_keys(&req).await? else { return Ok(()) };
        let ns = req.namespace;
        let stop_at_miss = req.flags & FLAG_STOP_AT_MISS != 0;
        self.wr.write_all(&ResponseHeader::ok(Op::LeaseGet, req.request_id, req.count).encode()).await?;
        let mut missed = false;
        for key in block_keys(&raw) {
            if missed && stop_at_miss {
                self.wr.write_all(&[ItemStatus::Miss as u8]).await?;
                continue;
            }
            let now = Instant::now();
            let status = match self.state.tiers().dram_block(&ns, &key) {
                Some(block) => match arena.describe(&block.payload) {
                    Some(_) if !self.remote.has_room() => {
                        error("remote_leases_per_connection");
                        ItemStatus::Capacity
                    }
                    Some(slot) => {
                        let header = block.header;
                        match self.remote.add_read(block, &arena, now) {
                            Some(lease) => {
                                self.wr.write_all(&[ItemStatus::Ok as u8]).await?;
                                self.wr.write_all(&header.encode()).await?;
                                self.wr.write_all(&LeaseGrant { lease, slot }.encode()).await?;
                                continue;
                            }
                            None => {
                                error("remote_read_leased_bytes");
                                ItemStatus::Capacity
                            }
                        }
                    }
                    None => ItemStatus::Elsewhere,
                },
                None if self.state.tiers().exists(&ns, &[key]).first() == Some(&true) => ItemStatus::Elsewhere,
                None => {
                    missed = true;
                    ItemStatus::Miss
                }
            };
            self.wr.write_all(&[status as u8]).await?;
        }
        observe("dataplane_lease_get", start);
        Ok(())
    }

    /// `END_GET`: ends read leases.
    pub(super) async fn end_get(&mut self, req: RequestHeader) -> Result<(), ConnError> {
        let ids = self.read_lease_ids(req.count).await?;
        let now = Instant::now();
        let statuses: Vec<u8> = ids
            .into_iter()
            .map(|id| if self.remote.end_read(id, now) { ItemStatus::Ok as u8 } else { ItemStatus::NoLease as u8 })
            .collect();
        self.wr.write_all(&ResponseHeader::ok(Op::EndGet, req.request_id, req.count).encode()).await?;
        self.wr.write_all(&statuses).await?;
        Ok(())
    }
}
