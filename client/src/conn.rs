//! Data-plane connections: a bounded pool of TCP connections to the server's data port, each
//! speaking the framed protocol of `kvtier_proto::dataplane`. Frames are written header + payload
//! straight from the caller's `Bytes`; loaded payloads are read once from the socket into their own
//! buffer and verified there.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use kvtier_proto::dataplane::{
    Hello, HelloReply, ItemStatus, Op, RequestHeader, ResponseHeader, Status, FLAG_PIN_LEASE, PROTOCOL_VERSION,
    RESPONSE_HEADER_LEN,
};
use kvtier_proto::{BlockFrame, BlockKey, FrameHeader, NamespaceId, ProtoError, FRAME_HEADER_LEN};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{Mutex, OwnedSemaphorePermit, Semaphore};

use crate::ClientError;

const IO_BUF: usize = 64 * 1024;

pub(crate) struct DataConn {
    rd: BufReader<OwnedReadHalf>,
    wr: BufWriter<OwnedWriteHalf>,
    next_id: u32,
}

fn request_error(h: &ResponseHeader, msg: String) -> ClientError {
    match h.status {
        Status::UnknownNamespace => ClientError::UnknownNamespace(msg),
        Status::Unauthenticated => ClientError::Unauthenticated(msg),
        Status::TooLarge => ClientError::InvalidArgument(msg),
        other => ClientError::Refused { code: format!("dataplane:{other:?}"), message: msg },
    }
}

impl DataConn {
    pub(crate) async fn connect(addr: SocketAddr, token: Option<&str>) -> Result<Self, ClientError> {
        let sock = TcpStream::connect(addr)
            .await
            .map_err(|e| ClientError::Connect { addr: addr.to_string(), reason: e.to_string() })?;
        let _ = sock.set_nodelay(true);
        let (r, w) = sock.into_split();
        let mut c =
            DataConn { rd: BufReader::with_capacity(IO_BUF, r), wr: BufWriter::with_capacity(IO_BUF, w), next_id: 1 };
        c.wr.write_all(&Hello::encode(PROTOCOL_VERSION, token.unwrap_or("").as_bytes())).await?;
        c.wr.flush().await?;
        let mut reply = [0u8; 4];
        c.rd.read_exact(&mut reply).await?;
        let (status, len) = HelloReply::decode(&reply)?;
        let mut msg = vec![0u8; len as usize];
        c.rd.read_exact(&mut msg).await?;
        let msg = String::from_utf8_lossy(&msg).into_owned();
        match status {
            Status::Ok => Ok(c),
            Status::Unauthenticated => Err(ClientError::Unauthenticated(msg)),
            other => Err(ClientError::Refused { code: format!("dataplane:{other:?}"), message: msg }),
        }
    }

    fn take_id(&mut self) -> u32 {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        id
    }

    async fn read_response(&mut self, op: Op, id: u32, count: u32) -> Result<(), ClientError> {
        let mut rh = [0u8; RESPONSE_HEADER_LEN];
        self.rd.read_exact(&mut rh).await?;
        let h = ResponseHeader::decode(&rh)?;
        if h.status != Status::Ok {
            let mut msg = vec![0u8; h.msg_len as usize];
            self.rd.read_exact(&mut msg).await?;
            return Err(request_error(&h, String::from_utf8_lossy(&msg).into_owned()));
        }
        if h.op != op as u8 || h.request_id != id || h.count != count {
            return Err(ProtoError::Malformed(format!("response {h:?} does not answer request {id}")).into());
        }
        Ok(())
    }

    /// Stores frames; one status per frame. With `lease`, the server keeps them pinned until
    /// [`DataConn::release`] or the end of this connection.
    pub(crate) async fn put(&mut self, frames: &[BlockFrame], lease: bool) -> Result<Vec<ItemStatus>, ClientError> {
        let id = self.take_id();
        let count = frames.len() as u32;
        let flags = if lease { FLAG_PIN_LEASE } else { 0 };
        let req = RequestHeader { op: Op::Put, flags, request_id: id, count, namespace: NamespaceId([0; 16]) };
        self.wr.write_all(&req.encode()).await?;
        for f in frames {
            self.wr.write_all(&f.header.encode()).await?;
            self.wr.write_all(&f.payload).await?;
        }
        self.wr.flush().await?;
        self.read_response(Op::Put, id, count).await?;
        let mut st = vec![0u8; frames.len()];
        self.rd.read_exact(&mut st).await?;
        st.into_iter().map(|b| ItemStatus::from_u8(b).map_err(ClientError::from)).collect()
    }

    /// Drops the pins this connection's leased `PUT`s took.
    pub(crate) async fn release(&mut self) -> Result<(), ClientError> {
        let id = self.take_id();
        let req =
            RequestHeader { op: Op::Release, flags: 0, request_id: id, count: 0, namespace: NamespaceId([0; 16]) };
        self.wr.write_all(&req.encode()).await?;
        self.wr.flush().await?;
        self.read_response(Op::Release, id, 0).await
    }

    /// Loads blocks; `None` for a miss. Every returned frame has been verified against its
    /// checksum and checked to be the key and namespace asked for.
    pub(crate) async fn get(
        &mut self,
        ns: NamespaceId,
        keys: &[BlockKey],
        max_frame: u64,
    ) -> Result<Vec<Option<BlockFrame>>, ClientError> {
        let id = self.take_id();
        let count = keys.len() as u32;
        let req = RequestHeader { op: Op::Get, flags: 0, request_id: id, count, namespace: ns };
        self.wr.write_all(&req.encode()).await?;
        for k in keys {
            self.wr.write_all(&k.0).await?;
        }
        self.wr.flush().await?;
        self.read_response(Op::Get, id, count).await?;
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            let st = ItemStatus::from_u8(self.rd.read_u8().await?)?;
            if st != ItemStatus::Ok {
                out.push(None);
                continue;
            }
            let mut fh = [0u8; FRAME_HEADER_LEN];
            self.rd.read_exact(&mut fh).await?;
            let header = FrameHeader::decode(&fh)?;
            if header.payload_len > max_frame {
                return Err(ProtoError::PayloadTooLarge { actual: header.payload_len, limit: max_frame }.into());
            }
            let mut payload = BytesMut::zeroed(header.payload_len as usize);
            self.rd.read_exact(&mut payload).await?;
            let payload: Bytes = payload.freeze();
            header.verify_payload(&payload)?;
            if header.key != *key || header.namespace != ns {
                return Err(ProtoError::Malformed(format!("asked for {key:?}, got {:?}", header.key)).into());
            }
            out.push(Some(BlockFrame { header, payload }));
        }
        Ok(out)
    }
}

/// A bounded pool of data-plane connections. A connection that failed mid-request is dropped,
/// never reused.
pub(crate) struct DataPool {
    addr: SocketAddr,
    token: Option<String>,
    idle: Mutex<Vec<DataConn>>,
    permits: Arc<Semaphore>,
    connect_timeout: Duration,
}

pub(crate) struct Lease<'a> {
    pool: &'a DataPool,
    pub(crate) conn: Option<DataConn>,
    _permit: OwnedSemaphorePermit,
}

impl Lease<'_> {
    /// Returns the connection to the pool (only after a request completed cleanly).
    pub(crate) async fn release(mut self) {
        if let Some(c) = self.conn.take() {
            self.pool.idle.lock().await.push(c);
        }
    }
}

impl DataPool {
    pub(crate) fn new(addr: SocketAddr, token: Option<String>, size: usize, connect_timeout: Duration) -> Self {
        DataPool {
            addr,
            token,
            idle: Mutex::new(Vec::new()),
            permits: Arc::new(Semaphore::new(size.max(1))),
            connect_timeout,
        }
    }

    pub(crate) async fn lease(&self) -> Result<Lease<'_>, ClientError> {
        let permit = self.permits.clone().acquire_owned().await.map_err(|e| ClientError::Io(e.to_string()))?;
        let idle = self.idle.lock().await.pop();
        let conn = match idle {
            Some(c) => c,
            None => tokio::time::timeout(self.connect_timeout, DataConn::connect(self.addr, self.token.as_deref()))
                .await
                .map_err(|_| ClientError::Timeout(self.connect_timeout))??,
        };
        Ok(Lease { pool: self, conn: Some(conn), _permit: permit })
    }
}
