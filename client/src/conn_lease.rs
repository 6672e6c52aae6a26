//! Remote leases from the client's side: a [`LeaseSession`] is a data-plane connection of its
//! own on which a peer with a one-sided mover (RDMA) asks a node for slots of its DRAM arena,
//! moves the bytes outside the connection, and commits or ends the leases (protocol:
//! `kvtier_proto::dataplane`, "Remote leases"). Leases live as long as the session's connection,
//! so a session is never returned to the pool. Every call is bounded by the client's
//! `request_timeout`; one that times out or fails mid-answer breaks the session (its connection
//! may be out of step), and later calls say so: open another.

use kvtier_proto::dataplane::{
    ItemStatus, LeaseGrant, Op, RequestHeader, FLAG_STOP_AT_MISS, LEASE_GRANT_LEN, MAX_ENDPOINT_LEN,
};
use kvtier_proto::{BlockKey, FrameHeader, NamespaceId};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::DataConn;
use crate::ClientError;

/// What a `LEASE_PUT` gave one frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutGrant {
    /// Write exactly the header's `payload_len` bytes into the slot, then commit the lease.
    Granted(LeaseGrant),
    /// The node holds the block already: write nothing.
    Present,
    /// Refused, as a `PUT` of it would have been.
    Refused(ItemStatus),
}

/// What a `LEASE_GET` gave one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GetGrant {
    /// Read `header.payload_len` bytes from the slot, check them against `header`'s checksum
    /// (a mismatch is a miss, never data), then end the lease.
    Granted { header: FrameHeader, grant: LeaseGrant },
    /// Held where a one-sided read can't reach (disk, a peer, the agent): load it with `GET`.
    Elsewhere,
    /// Not held (or after the first miss, with `stop_at_miss`).
    Miss,
    /// Refused (this connection's lease limit).
    Refused(ItemStatus),
}

/// A data-plane connection for remote leases (see the module docs). Dropping it ends every lease
/// it holds; the node keeps the slots of uncommitted writes out of use a while longer.
pub struct LeaseSession {
    conn: DataConn,
    max_frame: u64,
    timeout: Duration,
    /// Why the session can't be used any more, once a call broke it.
    broken: Option<String>,
}

impl LeaseSession {
    pub(crate) fn new(conn: DataConn, max_frame: u64, timeout: Duration) -> Self {
        LeaseSession { conn, max_frame, timeout, broken: None }
    }

    /// Connects this session to the node's fabric: sends this peer's endpoint (an RDMA queue
    /// pair's, encoded as the peer's mover encodes it) and returns the node's, for the peer's
    /// mover to connect to. Once per session, before any lease.
    pub async fn connect(&mut self, endpoint: &[u8]) -> Result<Vec<u8>, ClientError> {
        self.call(async |c| c.connect_fabric(endpoint).await).await
    }

    /// A slot for each frame header (each header's checksum is that of the payload to come).
    pub async fn lease_put(&mut self, headers: &[FrameHeader]) -> Result<Vec<PutGrant>, ClientError> {
        self.call(async |c| c.lease_put(headers).await).await
    }

    /// Publishes written slots: per lease `Ok`, `ChecksumMismatch` (what the slot held did not
    /// match its header; nothing stored), `NoLease` (unknown, ended, or at the node's
    /// `lease_timeout`), or `Capacity` / `Internal` (the node's tier failed it).
    pub async fn commit(&mut self, leases: &[u64]) -> Result<Vec<ItemStatus>, ClientError> {
        self.call(async |c| c.lease_ids(Op::Commit, leases).await).await
    }

    /// Read leases on the payloads of `keys` in `ns` that the node holds in DRAM.
    pub async fn lease_get(
        &mut self,
        ns: NamespaceId,
        keys: &[BlockKey],
        stop_at_miss: bool,
    ) -> Result<Vec<GetGrant>, ClientError> {
        let max_frame = self.max_frame;
        self.call(async |c| c.lease_get(ns, keys, stop_at_miss, max_frame).await).await
    }

    /// Ends read leases: per lease `Ok`, or `NoLease` (unknown, ended, or past its deadline:
    /// a read that finished after it must not be trusted without its checksum).
    pub async fn end_get(&mut self, leases: &[u64]) -> Result<Vec<ItemStatus>, ClientError> {
        self.call(async |c| c.lease_ids(Op::EndGet, leases).await).await
    }

    /// Runs one call on the connection within the timeout; a timeout, or an error other than
    /// the node's refusal, breaks the session.
    async fn call<T>(
        &mut self,
        f: impl AsyncFnOnce(&mut DataConn) -> Result<T, ClientError>,
    ) -> Result<T, ClientError> {
        self.usable()?;
        let e = match tokio::time::timeout(self.timeout, f(&mut self.conn)).await {
            Ok(Ok(v)) => return Ok(v),
            Err(_) => ClientError::Timeout(self.timeout),
            Ok(Err(e)) => e,
        };
        // The node answered with a refusal and the connection is in step; anything else may not be.
        let refused = matches!(
            e,
            ClientError::Refused { .. }
                | ClientError::Forbidden(_)
                | ClientError::UnknownNamespace(_)
                | ClientError::InvalidArgument(_)
                | ClientError::Unauthenticated(_)
        );
        if !refused {
            self.broken = Some(e.to_string());
        }
        Err(e)
    }

    fn usable(&self) -> Result<(), ClientError> {
        match &self.broken {
            None => Ok(()),
            Some(why) => Err(ClientError::Io(format!("this lease session broke earlier ({why}); open another"))),
        }
    }
}

impl DataConn {
    async fn connect_fabric(&mut self, endpoint: &[u8]) -> Result<Vec<u8>, ClientError> {
        let id = self.take_id();
        let count = endpoint.len() as u32;
        let req = RequestHeader { op: Op::Connect, flags: 0, request_id: id, count, namespace: NamespaceId([0; 16]) };
        self.wr.write_all(&req.encode()).await?;
        self.wr.write_all(endpoint).await?;
        self.wr.flush().await?;
        let h = self.read_answer(Op::Connect, id).await?;
        if h.count as usize > MAX_ENDPOINT_LEN {
            return Err(kvtier_proto::ProtoError::Malformed(format!("the node's endpoint is {} bytes", h.count)).into());
        }
        let mut theirs = vec![0u8; h.count as usize];
        self.rd.read_exact(&mut theirs).await?;
        Ok(theirs)
    }

    async fn lease_put(&mut self, headers: &[FrameHeader]) -> Result<Vec<PutGrant>, ClientError> {
        let id = self.take_id();
        let count = headers.len() as u32;
        let ns = headers.first().map_or(NamespaceId([0; 16]), |h| h.namespace);
        let req = RequestHeader { op: Op::LeasePut, flags: 0, request_id: id, count, namespace: ns };
        self.wr.write_all(&req.encode()).await?;
        for h in headers {
            self.wr.write_all(&h.encode()).await?;
        }
        self.wr.flush().await?;
        self.read_response(Op::LeasePut, id, count).await?;
        let mut out = Vec::with_capacity(headers.len());
        for _ in headers {
            out.push(match ItemStatus::from_u8(self.rd.read_u8().await?)? {
                ItemStatus::Ok => PutGrant::Granted(self.read_grant().await?),
                ItemStatus::Present => PutGrant::Present,
                other => PutGrant::Refused(other),
            });
        }
        Ok(out)
    }

    async fn read_grant(&mut self) -> Result<LeaseGrant, ClientError> {
        let mut g = [0u8; LEASE_GRANT_LEN];
        self.rd.read_exact(&mut g).await?;
        Ok(LeaseGrant::decode(&g)?)
    }

    /// A `COMMIT` or `END_GET` of `leases`; one status per lease.
    async fn lease_ids(&mut self, op: Op, leases: &[u64]) -> Result<Vec<ItemStatus>, ClientError> {
        let id = self.take_id();
        let count = leases.len() as u32;
        let req = RequestHeader { op, flags: 0, request_id: id, count, namespace: NamespaceId([0; 16]) };
        self.wr.write_all(&req.encode()).await?;
        for l in leases {
            self.wr.write_all(&l.to_le_bytes()).await?;
        }
        self.wr.flush().await?;
        self.read_response(op, id, count).await?;
        let mut st = vec![0u8; leases.len()];
        self.rd.read_exact(&mut st).await?;
        st.into_iter().map(|b| ItemStatus::from_u8(b).map_err(ClientError::from)).collect()
    }

    async fn lease_get(
        &mut self,
        ns: NamespaceId,
        keys: &[BlockKey],
        stop_at_miss: bool,
        max_frame: u64,
    ) -> Result<Vec<GetGrant>, ClientError> {
        let flags = if stop_at_miss { FLAG_STOP_AT_MISS } else { 0 };
        self.keyed_request(Op::LeaseGet, flags, ns, keys).await?;
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            out.push(match ItemStatus::from_u8(self.rd.read_u8().await?)? {
                ItemStatus::Ok => {
                    let header = self.read_frame_header(ns, key, max_frame).await?;
                    let grant = self.read_grant().await?;
                    if grant.slot.len != header.payload_len {
                        return Err(kvtier_proto::ProtoError::Malformed(format!(
                            "a read lease of {} bytes for a payload of {}",
                            grant.slot.len, header.payload_len
                        ))
                        .into());
                    }
                    GetGrant::Granted { header, grant }
                }
                ItemStatus::Elsewhere => GetGrant::Elsewhere,
                ItemStatus::Miss => GetGrant::Miss,
                other => GetGrant::Refused(other),
            });
        }
        Ok(out)
    }
}
