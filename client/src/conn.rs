//! Data-plane connections: a bounded pool of connections to the server's data plane (TCP to its
//! data port by default, or streams from a [`DataPlaneConnector`]), each speaking the framed
//! protocol of `kvtier_proto::dataplane`. A connection's stream halves are boxed once when it is
//! made; a request costs one dynamic call per read or write, never a copy or an allocation. Frames are written header + payload
//! straight from the caller's `Bytes` (or from several segments of the caller's memory, gathered
//! by the socket writes, never staged); loaded payloads are read once from the socket, either into
//! their own buffer ([`DataConn::get`]) or straight into the caller's destination segments
//! ([`DataConn::get_into`]), and verified where they landed.

use std::net::SocketAddr;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use kvtier_proto::dataplane::{
    Hello, HelloReply, ItemStatus, Op, RequestHeader, ResponseHeader, Status, ANSWER_ALONE,
    CHECKSUM_AFTER_SINCE_VERSION, FLAG_CHECKSUM_AFTER, FLAG_PIN_LEASE, FLAG_REPORT_PRESENT, FLAG_STOP_AT_MISS,
    MIN_PROTOCOL_VERSION, NO_CODEC, PROTOCOL_VERSION, RESPONSE_HEADER_LEN,
};
use kvtier_proto::tcp::PaceSwitch;
use kvtier_proto::{BlockFrame, BlockKey, CodecId, FrameHeader, NamespaceId, ProtoError, FRAME_HEADER_LEN};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::connector::{BoxedStream, DataPlaneConnector};
use crate::polled::{InFlight, PolledRead};
use crate::ClientError;

/// A connection's receive half, other than plain TCP's (one half of a split [`BoxedStream`], or
/// of a TLS stream).
type BoxRead = Box<dyn AsyncRead + Unpin + Send>;
/// A connection's send half.
type BoxWrite = Box<dyn AsyncWrite + Unpin + Send>;

const IO_BUF: usize = 64 * 1024;
/// The receive buffer: headers and statuses are read through it; a payload read finds at most
/// this much of itself there (copied out once) and takes the rest from the socket straight into
/// its destination. Smaller than a block, so most of a block's bytes are never copied in user space.
const READ_BUF: usize = 4 * 1024;

/// A frame to send: its header and its payload as one or more parts, sent back to back.
pub(crate) trait OutFrame {
    /// The header; its checksum counts only where [`OutFrame::summed`] says it is known.
    fn header(&self) -> &FrameHeader;
    fn parts(&self) -> &[Bytes];
    /// Whether the header's checksum is the payload's already (else it is hashed on the way out).
    fn summed(&self) -> bool {
        true
    }
}

impl OutFrame for BlockFrame {
    fn header(&self) -> &FrameHeader {
        &self.header
    }
    fn parts(&self) -> &[Bytes] {
        std::slice::from_ref(&self.payload)
    }
}

/// A raw payload gathered from several segments (an engine page's K and V planes, one per layer),
/// not hashed yet: [`DataConn::put_frames`] hashes it as it sends it (or before, on a
/// protocol-1 connection).
pub(crate) struct GatherFrame {
    pub(crate) header: FrameHeader,
    pub(crate) parts: Vec<Bytes>,
    /// Whether `header.checksum` is the parts' (an encoded frame's, hashed when it was encoded).
    pub(crate) summed: bool,
}

impl OutFrame for GatherFrame {
    fn header(&self) -> &FrameHeader {
        &self.header
    }
    fn parts(&self) -> &[Bytes] {
        &self.parts
    }
    fn summed(&self) -> bool {
        self.summed
    }
}

/// The xxh3-64 of segments taken back to back (the frame checksum of a gathered payload).
pub(crate) fn checksum_of(parts: &[impl AsRef<[u8]>]) -> u64 {
    if let [one] = parts {
        return kvtier_proto::checksum(one.as_ref());
    }
    let mut h = kvtier_proto::Checksummer::new();
    for p in parts {
        h.update(p.as_ref());
    }
    h.digest()
}

/// Most slices handed to one vectored write (Linux takes up to 1024).
const MAX_IOV: usize = 256;
/// A payload sent with its checksum after it is hashed this much at a time, each piece right
/// after it has been written (still in cache) while the server receives it.
const HASH_STEP: usize = 256 * 1024;

/// What one `PUT` writes next: small bytes of its own (request and frame headers, checksums)
/// and the callers' payload pieces, in order, gathered into one write when it is sent.
#[derive(Default)]
struct PutPieces<'a> {
    small: Vec<u8>,
    order: Vec<Piece<'a>>,
}

enum Piece<'a> {
    /// A range of [`PutPieces::small`].
    Small(std::ops::Range<usize>),
    Payload(&'a [u8]),
}

impl<'a> PutPieces<'a> {
    fn small(&mut self, b: &[u8]) {
        let at = self.small.len();
        self.small.extend_from_slice(b);
        match self.order.last_mut() {
            Some(Piece::Small(r)) if r.end == at => r.end += b.len(),
            _ => self.order.push(Piece::Small(at..at + b.len())),
        }
    }

    fn payload(&mut self, b: &'a [u8]) {
        self.order.push(Piece::Payload(b));
    }

    fn extend_payload(&mut self, parts: &'a [Bytes]) {
        self.order.extend(parts.iter().filter(|p| !p.is_empty()).map(|p| Piece::Payload(&p[..])));
    }

    fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Writes everything queued (one gathered write where the stream takes them) and empties it.
    async fn send(&mut self, wr: &mut BufWriter<BoxWrite>) -> std::io::Result<()> {
        let pieces: Vec<&[u8]> = self
            .order
            .iter()
            .map(|p| match p {
                Piece::Small(r) => &self.small[r.clone()],
                Piece::Payload(b) => *b,
            })
            .collect();
        if wr.get_ref().is_write_vectored() {
            // Requests leave the buffer empty (each ends with a flush), so nothing buffered is
            // overtaken by writing to the stream underneath.
            debug_assert!(wr.buffer().is_empty());
            write_gathered(wr.get_mut(), &pieces).await?;
        } else {
            // A connector's stream that writes one slice per call: the buffer gathers the small
            // pieces (large ones pass through it).
            for p in &pieces {
                wr.write_all(p).await?;
            }
            wr.flush().await?;
        }
        self.order.clear();
        self.small.clear();
        Ok(())
    }
}

/// Writes `pieces` back to back with vectored writes, repeated on partial writes, never copying
/// a byte. Empty pieces are skipped. Correct on any stream; one that is not
/// `is_write_vectored` sends one piece per call (tokio's default `poll_write_vectored`).
pub(crate) async fn write_gathered<W: AsyncWrite + Unpin + ?Sized>(w: &mut W, pieces: &[&[u8]]) -> std::io::Result<()> {
    let pieces: Vec<&[u8]> = pieces.iter().copied().filter(|p| !p.is_empty()).collect();
    // The piece being written and how far into it.
    let (mut at, mut off) = (0usize, 0usize);
    while at < pieces.len() {
        let end = (at + MAX_IOV).min(pieces.len());
        let mut iov = Vec::with_capacity(end - at);
        iov.push(std::io::IoSlice::new(&pieces[at][off..]));
        iov.extend(pieces[at + 1..end].iter().map(|p| std::io::IoSlice::new(p)));
        let mut n = w.write_vectored(&iov).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        while n > 0 {
            let left = pieces[at].len() - off;
            if n < left {
                off += n;
                break;
            }
            n -= left;
            at += 1;
            off = 0;
        }
    }
    Ok(())
}

/// Decodes an encoded frame into a block's destination segments.
pub(crate) type DecodeInto = dyn Fn(&BlockFrame, &mut [&mut [u8]]) -> Result<(), ClientError> + Sync;

/// Where one loaded block goes: the caller's memory, one or more segments filled in order.
pub(crate) type Dest<'a> = Vec<&'a mut [u8]>;

/// How one block of a [`DataConn::get_into`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Landed {
    /// The block's bytes are in its destination, verified there (decoded first if it was encoded).
    Ok,
    /// Not stored (or not served).
    Miss,
    /// Stored, but its bytes didn't verify or didn't fit the destination: a miss whose destination
    /// holds unspecified bytes.
    Bad,
}

pub(crate) struct DataConn {
    rd: BufReader<RxHalf>,
    wr: BufWriter<BoxWrite>,
    /// The data-plane protocol version the server took in the hello.
    version: u16,
    next_id: u32,
    /// The longest a call on this connection polls for its answer (TCP only; see
    /// [`crate::polled::PolledRead`]).
    poll: Duration,
    /// A same-host TCP socket (plain or under TLS) whose congestion control follows the server's
    /// answers: unpaced while they say the connection had the node to itself (`ANSWER_ALONE`),
    /// the system's otherwise ([`PaceSwitch`]); with its descriptor, open while `rd` and `wr`
    /// (which own the socket) live.
    pace: Option<(RawFd, PaceSwitch)>,
}

/// A connection's receive half: plain TCP's, whose reads can poll for an answer, or any other.
enum RxHalf {
    Tcp(PolledRead),
    Other(BoxRead),
}

impl AsyncRead for RxHalf {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            RxHalf::Tcp(r) => std::pin::Pin::new(r).poll_read(cx, buf),
            RxHalf::Other(r) => std::pin::Pin::new(r).poll_read(cx, buf),
        }
    }
}

fn request_error(h: &ResponseHeader, msg: String) -> ClientError {
    match h.status {
        Status::UnknownNamespace => ClientError::UnknownNamespace(msg),
        Status::Unauthenticated => ClientError::Unauthenticated(msg),
        Status::Forbidden => ClientError::Forbidden(msg),
        Status::TooLarge => ClientError::InvalidArgument(msg),
        other => ClientError::Refused { code: format!("dataplane:{other:?}"), message: msg },
    }
}

/// A hello's outcome short of an error: the connection, or the server's word that it does not
/// speak the version asked (it has closed the connection).
type Greeted = Result<DataConn, String>;

impl DataConn {
    /// Connects over TCP saying the newest protocol, or the oldest when the server is older.
    #[cfg(test)]
    pub(crate) async fn connect(addr: SocketAddr, token: Option<&str>) -> Result<Self, ClientError> {
        Dial::Tcp(addr).connect(token).await
    }

    async fn connect_version(addr: SocketAddr, token: Option<&str>, version: u16) -> Result<Greeted, ClientError> {
        let sock = TcpStream::connect(addr)
            .await
            .map_err(|e| ClientError::Connect { addr: addr.to_string(), reason: e.to_string() })?;
        let _ = sock.set_nodelay(true);
        // A node on this host: the congestion control `KVTIER_SAME_HOST_CONGESTION` asks for the
        // connection's life, if it does (`kvtier_proto::tcp`; by default the server switches its
        // own end per request, and this end keeps the system's); the connection works whatever
        // the kernel says.
        let _ = kvtier_proto::tcp::tune_data_socket(&sock, addr.ip());
        let pace = PaceSwitch::for_socket(&sock, addr.ip()).map(|p| (sock.as_raw_fd(), p));
        // TCP's owned halves: no lock between the reader and the writer.
        let (r, w) = sock.into_split();
        Self::hello(RxHalf::Tcp(PolledRead::new(r)), Box::new(w), token, version, pace).await
    }

    /// Connects over TLS (`dial`: the rustls configuration and the name the node's certificate
    /// must carry), then says hello.
    async fn connect_tls(
        addr: SocketAddr,
        dial: &crate::tls::TlsDial,
        token: Option<&str>,
        version: u16,
    ) -> Result<Greeted, ClientError> {
        let failed = |reason: String| ClientError::Connect { addr: addr.to_string(), reason };
        let sock = TcpStream::connect(addr).await.map_err(|e| failed(e.to_string()))?;
        let _ = sock.set_nodelay(true);
        let _ = kvtier_proto::tcp::tune_data_socket(&sock, addr.ip());
        let pace = PaceSwitch::for_socket(&sock, addr.ip()).map(|p| (sock.as_raw_fd(), p));
        let stream =
            dial.connector.connect(dial.name.clone(), sock).await.map_err(|e| failed(format!("TLS handshake: {e}")))?;
        let (r, w) = tokio::io::split(stream);
        Self::hello(RxHalf::Other(Box::new(r)), Box::new(w), token, version, pace).await
    }

    /// Says hello over a stream from a [`DataPlaneConnector`].
    async fn over(stream: BoxedStream, token: Option<&str>, version: u16) -> Result<Greeted, ClientError> {
        let (r, w) = tokio::io::split(stream);
        Self::hello(RxHalf::Other(Box::new(r)), Box::new(w), token, version, None).await
    }

    /// `pace`: the switch of the socket under `r` and `w`, if it has one ([`DataConn::pace`]).
    async fn hello(
        r: RxHalf,
        w: BoxWrite,
        token: Option<&str>,
        version: u16,
        pace: Option<(RawFd, PaceSwitch)>,
    ) -> Result<Greeted, ClientError> {
        let mut c = DataConn {
            rd: BufReader::with_capacity(READ_BUF, r),
            wr: BufWriter::with_capacity(IO_BUF, w),
            version,
            next_id: 1,
            poll: Duration::ZERO,
            pace,
        };
        c.wr.write_all(&Hello::encode(version, token.unwrap_or("").as_bytes())).await?;
        c.wr.flush().await?;
        let mut reply = [0u8; 4];
        c.rd.read_exact(&mut reply).await?;
        let (status, len) = HelloReply::decode(&reply)?;
        let mut msg = vec![0u8; len as usize];
        c.rd.read_exact(&mut msg).await?;
        let msg = String::from_utf8_lossy(&msg).into_owned();
        match status {
            Status::Ok => Ok(Ok(c)),
            Status::UnsupportedVersion => Ok(Err(msg)),
            Status::Unauthenticated => Err(ClientError::Unauthenticated(msg)),
            Status::TooManyConnections => {
                Err(ClientError::Refused { code: kvtier_proto::codes::TOO_MANY_CONNECTIONS.into(), message: msg })
            }
            other => Err(ClientError::Refused { code: format!("dataplane:{other:?}"), message: msg }),
        }
    }

    /// Whether the server closed this idle connection (a restart, its `idle_timeout`), broke it,
    /// or sent something nobody asked for: looked at without waiting or taking a byte, before a
    /// pooled connection is reused, so that a request is not sent on a socket already dead.
    fn closed_while_idle(&mut self) -> bool {
        use tokio::io::AsyncBufRead;
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        // Idle, nothing is armed: this is the socket's own non-blocking read, buffered.
        match std::pin::Pin::new(&mut self.rd).poll_fill_buf(&mut cx) {
            std::task::Poll::Pending => false,
            // Empty: the end of the stream; bytes: out of step with any request.
            std::task::Poll::Ready(Ok(_)) | std::task::Poll::Ready(Err(_)) => true,
        }
    }

    /// How long a call on this connection may poll for its answer (a TCP connection's only):
    /// about the time its bytes take, at most `max`; `Duration::ZERO` never polls.
    pub(crate) fn set_answer_poll(&mut self, max: Duration) {
        self.poll = max;
    }

    /// Starts a call whose answer carries about `bytes`: counted in flight and, on TCP, its reads
    /// poll for the answer (see [`PolledRead`]) until [`DataConn::answered`].
    fn arm(&mut self, bytes: u64) -> Option<InFlight> {
        match self.rd.get_mut() {
            RxHalf::Tcp(r) => Some(r.arm(bytes, self.poll)),
            RxHalf::Other(_) => None,
        }
    }

    /// [`DataConn::arm`] for a store that sent `bytes`.
    fn arm_store(&mut self, bytes: u64) -> Option<InFlight> {
        match self.rd.get_mut() {
            RxHalf::Tcp(r) => Some(r.arm_store(bytes, self.poll)),
            RxHalf::Other(_) => None,
        }
    }

    /// A call's answer is read: later reads park again.
    fn answered(&mut self) {
        if let RxHalf::Tcp(r) = self.rd.get_mut() {
            r.disarm();
        }
    }

    fn take_id(&mut self) -> u32 {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        id
    }

    async fn read_response(&mut self, op: Op, id: u32, count: u32) -> Result<(), ClientError> {
        let h = self.read_answer(op, id).await?;
        if h.count != count {
            return Err(ProtoError::Malformed(format!("response {h:?} does not answer request {id}")).into());
        }
        Ok(())
    }

    /// Runs this end of a same-host connection unpaced while the server's answers say it had
    /// the node to itself (`alone`), and on the system's congestion control otherwise: the
    /// next requests' bytes (a store's) leave as the server sends its own.
    fn fit_pace(&mut self, alone: bool) {
        let Some((fd, pace)) = &mut self.pace else { return };
        // SAFETY: `fd` is the socket `self.rd` and `self.wr` own: open while `self` lives.
        let _ = pace.fit(unsafe { BorrowedFd::borrow_raw(*fd) }, alone);
    }

    /// The answer header of request `id` (a request-level error as the error it names).
    async fn read_answer(&mut self, op: Op, id: u32) -> Result<ResponseHeader, ClientError> {
        let mut rh = [0u8; RESPONSE_HEADER_LEN];
        self.rd.read_exact(&mut rh).await?;
        let h = ResponseHeader::decode(&rh)?;
        self.fit_pace(h.flags & ANSWER_ALONE != 0);
        if h.status != Status::Ok {
            let mut msg = vec![0u8; h.msg_len as usize];
            self.rd.read_exact(&mut msg).await?;
            return Err(request_error(&h, String::from_utf8_lossy(&msg).into_owned()));
        }
        if h.op != op as u8 || h.request_id != id {
            return Err(ProtoError::Malformed(format!("response {h:?} does not answer request {id}")).into());
        }
        Ok(h)
    }

    /// Stores frames; one status per frame. With `lease`, the server keeps them pinned until
    /// [`DataConn::release`] or the end of this connection.
    pub(crate) async fn put(&mut self, frames: &[BlockFrame], lease: bool) -> Result<Vec<ItemStatus>, ClientError> {
        self.put_frames(frames, if lease { FLAG_PIN_LEASE } else { 0 }).await
    }

    /// Stores frames given as parts; [`ItemStatus::Present`] for blocks the server already held,
    /// and beside each status the codec of the copy the server holds now (`None`: refused).
    pub(crate) async fn put_reporting<F: OutFrame>(
        &mut self,
        frames: &[F],
    ) -> Result<Vec<(ItemStatus, Option<CodecId>)>, ClientError> {
        let st = self.put_frames(frames, FLAG_REPORT_PRESENT).await?;
        let mut codecs = vec![0u8; 2 * st.len()];
        self.rd.read_exact(&mut codecs).await?;
        Ok(st
            .into_iter()
            .zip(codecs.chunks_exact(2))
            .map(|(s, c)| {
                let c = u16::from_le_bytes([c[0], c[1]]);
                (s, (c != NO_CODEC).then_some(CodecId(c)))
            })
            .collect())
    }

    /// Sends a `PUT` of `frames` — request header, then each frame's header and payload parts —
    /// as gathered writes straight from the callers' memory (nothing is copied into a buffer),
    /// then reads the statuses.
    ///
    /// On protocol 2 each payload's checksum follows it ([`FLAG_CHECKSUM_AFTER`]): a frame not
    /// hashed yet, of [`HASH_STEP`] bytes or more, is hashed that much at a time, each piece right
    /// after it is written, so the hash runs while the server receives (one write per piece);
    /// other frames are hashed first if they must be and go out together in one write. On
    /// protocol 1 every unhashed frame is hashed before anything is sent and the whole request is
    /// one write.
    async fn put_frames<F: OutFrame>(&mut self, frames: &[F], flags: u16) -> Result<Vec<ItemStatus>, ClientError> {
        let id = self.take_id();
        let count = frames.len() as u32;
        let after = self.version >= CHECKSUM_AFTER_SINCE_VERSION;
        let flags = if after { flags | FLAG_CHECKSUM_AFTER } else { flags };
        let req = RequestHeader { op: Op::Put, flags, request_id: id, count, namespace: NamespaceId([0; 16]) };
        let mut out = PutPieces::default();
        out.small(&req.encode());
        for f in frames {
            let mut header = *f.header();
            // Hashed while it is sent: a payload of several pieces. A smaller one is hashed here
            // and goes out with the rest in one write (a write per block cost 64 KiB stores more
            // than the hash).
            let streamed = after && !f.summed() && header.payload_len >= HASH_STEP as u64;
            if !f.summed() && !streamed {
                header.checksum = checksum_of(f.parts());
            }
            out.small(&header.encode());
            if !streamed {
                out.extend_payload(f.parts());
                if after {
                    out.small(&header.checksum.to_le_bytes());
                }
                continue;
            }
            let mut sum = kvtier_proto::Checksummer::new();
            for part in f.parts() {
                for piece in part.chunks(HASH_STEP) {
                    out.payload(piece);
                    out.send(&mut self.wr).await?;
                    sum.update(piece);
                }
            }
            out.small(&sum.digest().to_le_bytes());
        }
        if !out.is_empty() {
            out.send(&mut self.wr).await?;
        }
        self.wr.flush().await?;
        // The answer comes once the server has taken the payload in: polled for about as long
        // as those bytes take (the server polls for the payload's pieces meanwhile). Measured
        // together, one block per call: 1 MiB stores 2.25 → 2.85 GB/s, 64 KiB 0.74 → 0.92
        // (either side polling alone gained little or nothing).
        let sent: u64 = frames.iter().map(|f| f.header().payload_len).sum();
        let _flight = self.arm_store(sent);
        self.read_response(Op::Put, id, count).await?;
        let mut st = vec![0u8; frames.len()];
        self.rd.read_exact(&mut st).await?;
        self.answered();
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

    /// Sends a request naming `keys` in `ns` and reads the response header.
    async fn keyed_request(
        &mut self,
        op: Op,
        flags: u16,
        ns: NamespaceId,
        keys: &[BlockKey],
    ) -> Result<(), ClientError> {
        let id = self.take_id();
        let count = keys.len() as u32;
        let req = RequestHeader { op, flags, request_id: id, count, namespace: ns };
        self.wr.write_all(&req.encode()).await?;
        for k in keys {
            self.wr.write_all(&k.0).await?;
        }
        self.wr.flush().await?;
        self.read_response(op, id, count).await
    }

    /// Which of `keys` the server holds, each on its own.
    pub(crate) async fn exists(&mut self, ns: NamespaceId, keys: &[BlockKey]) -> Result<Vec<bool>, ClientError> {
        self.keyed_request(Op::Exists, 0, ns, keys).await?;
        let mut st = vec![0u8; keys.len()];
        self.rd.read_exact(&mut st).await?;
        st.into_iter().map(|b| Ok(ItemStatus::from_u8(b)? == ItemStatus::Ok)).collect()
    }

    /// Reads one served frame's header (after its `Ok` status byte) and checks it answers `key`.
    async fn read_frame_header(
        &mut self,
        ns: NamespaceId,
        key: &BlockKey,
        max_frame: u64,
    ) -> Result<FrameHeader, ClientError> {
        let mut fh = [0u8; FRAME_HEADER_LEN];
        self.rd.read_exact(&mut fh).await?;
        let header = FrameHeader::decode(&fh)?;
        if header.payload_len > max_frame {
            return Err(ProtoError::PayloadTooLarge { actual: header.payload_len, limit: max_frame }.into());
        }
        if header.key != *key || header.namespace != ns {
            return Err(ProtoError::Malformed(format!("asked for {key:?}, got {:?}", header.key)).into());
        }
        // A payload whose size its own layout, tokens and codec rule out is not read at all.
        header.check_size()?;
        Ok(header)
    }

    /// Reads a payload of `n` bytes into a buffer of its own, never zeroed first (the socket
    /// writes every byte of it: zeroing was one more pass over each block), hashing each piece as
    /// it lands (still in cache, while the rest is on its way): the payload and its checksum.
    pub(crate) async fn read_payload_hashed(&mut self, n: usize) -> Result<(Bytes, u64), ClientError> {
        let mut payload = BytesMut::with_capacity(n);
        let mut sum = kvtier_proto::Checksummer::new();
        while payload.len() < n {
            let at = payload.len();
            let want = (n - at) as u64;
            if (&mut self.rd).take(want).read_buf(&mut payload).await? == 0 {
                return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
            }
            sum.update(&payload[at..]);
        }
        Ok((payload.freeze(), sum.digest()))
    }

    /// Fills `dest`'s segments in order from the stream, hashing each piece as it lands (still in
    /// cache, and while the rest is on its way); the checksum of what was read.
    async fn read_hashed(&mut self, dest: &mut [&mut [u8]]) -> Result<u64, ClientError> {
        let mut sum = kvtier_proto::Checksummer::new();
        for seg in dest.iter_mut() {
            let mut at = 0;
            while at < seg.len() {
                let n = self.rd.read(&mut seg[at..]).await?;
                if n == 0 {
                    return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
                }
                sum.update(&seg[at..at + n]);
                at += n;
            }
        }
        Ok(sum.digest())
    }

    /// Loads blocks straight into `dests` (one per key): a raw payload the size of its
    /// destination is read from the socket into it and verified there, any other is read once
    /// into a buffer and handed to `decode` with its destination. With `stop_at_miss`, the server
    /// stops at the first miss (the longest stored prefix, in one round trip).
    pub(crate) async fn get_into(
        &mut self,
        ns: NamespaceId,
        keys: &[BlockKey],
        dests: &mut [Dest<'_>],
        stop_at_miss: bool,
        max_frame: u64,
        decode: &DecodeInto,
    ) -> Result<Vec<Landed>, ClientError> {
        debug_assert_eq!(keys.len(), dests.len());
        let flags = if stop_at_miss { FLAG_STOP_AT_MISS } else { 0 };
        let _flight = self.arm(dests.iter().flatten().map(|s| s.len() as u64).sum());
        self.keyed_request(Op::Get, flags, ns, keys).await?;
        let mut out = Vec::with_capacity(keys.len());
        // Encoded blocks, read whole and verified, waiting to be decoded together.
        let mut encoded: Vec<(usize, BlockFrame)> = Vec::new();
        let mut encoded_bytes = 0;
        for (i, key) in keys.iter().enumerate() {
            let st = ItemStatus::from_u8(self.rd.read_u8().await?)?;
            if st != ItemStatus::Ok {
                out.push(Landed::Miss);
                continue;
            }
            let header = self.read_frame_header(ns, key, max_frame).await?;
            let dest = &mut dests[i];
            let room: u64 = dest.iter().map(|s| s.len() as u64).sum();
            if header.codec == kvtier_proto::CodecId::RAW && header.payload_len == room {
                let sum = self.read_hashed(dest).await?;
                out.push(if sum == header.checksum { Landed::Ok } else { Landed::Bad });
                continue;
            }
            let (payload, sum) = self.read_payload_hashed(header.payload_len as usize).await?;
            if sum != header.checksum {
                out.push(Landed::Bad);
                continue;
            }
            let frame = BlockFrame { header, payload };
            // Ok once decoded; `decode_batch` marks a block that does not decode.
            out.push(Landed::Ok);
            encoded_bytes += frame.payload.len();
            encoded.push((i, frame));
            if encoded_bytes >= DECODE_BATCH_BYTES {
                decode_batch(&mut encoded, dests, &mut out, decode);
                encoded_bytes = 0;
            }
        }
        decode_batch(&mut encoded, dests, &mut out, decode);
        self.answered();
        Ok(out)
    }

    /// Loads blocks; `None` for a miss (and, with `stop_at_miss`, for every key after the first
    /// miss). Every returned frame has been verified against its
    /// checksum and checked to be the key and namespace asked for. `expect`: about how many
    /// payload bytes the answer carries (what its reads poll for).
    pub(crate) async fn get(
        &mut self,
        ns: NamespaceId,
        keys: &[BlockKey],
        stop_at_miss: bool,
        max_frame: u64,
        expect: u64,
    ) -> Result<Vec<Option<BlockFrame>>, ClientError> {
        let flags = if stop_at_miss { FLAG_STOP_AT_MISS } else { 0 };
        let _flight = self.arm(expect);
        self.keyed_request(Op::Get, flags, ns, keys).await?;
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            let st = ItemStatus::from_u8(self.rd.read_u8().await?)?;
            if st != ItemStatus::Ok {
                out.push(None);
                continue;
            }
            let header = self.read_frame_header(ns, key, max_frame).await?;
            let (payload, sum) = self.read_payload_hashed(header.payload_len as usize).await?;
            out.push(verified(BlockFrame { header, payload }, sum));
        }
        self.answered();
        Ok(out)
    }
}

/// Encoded bytes a load holds before decoding them: one block's decode then runs beside the next
/// ones on every core, while the kernel's socket buffer keeps taking what the server sends; and
/// what a load buffers beyond its destinations stays bounded.
const DECODE_BATCH_BYTES: usize = 4 << 20;

/// Decoded bytes a batch must reach before its blocks are decoded on the rayon pool: below it the
/// hand-off costs more than the second core buys (measured: 8 × 64 KiB blocks at concurrency 4
/// loaded slower handed off than decoded in turn).
const PARALLEL_DECODE_BYTES: usize = 2 << 20;

/// Decodes `batch` (verified encoded frames, by ascending index into `dests`) into their
/// destinations, on the rayon pool when there are several and they are large enough; a block that
/// does not decode is marked `Landed::Bad` in `out`. Empties `batch`.
fn decode_batch(batch: &mut Vec<(usize, BlockFrame)>, dests: &mut [Dest<'_>], out: &mut [Landed], decode: &DecodeInto) {
    if batch.is_empty() {
        return;
    }
    let mut frames = batch.drain(..).peekable();
    let mut jobs = Vec::new();
    for (i, dest) in dests.iter_mut().enumerate() {
        if frames.peek().is_some_and(|(j, _)| *j == i) {
            if let Some((_, frame)) = frames.next() {
                jobs.push((i, frame, dest));
            }
        }
    }
    let decoded: usize = jobs.iter().map(|(_, _, d)| d.iter().map(|s| s.len()).sum::<usize>()).sum();
    let failed: Vec<usize> = if jobs.len() == 1 || decoded < PARALLEL_DECODE_BYTES {
        jobs.into_iter().filter_map(|(i, f, d)| decode(&f, d).is_err().then_some(i)).collect()
    } else {
        use rayon::prelude::*;
        kvtier_kernels::par::run(|| {
            jobs.into_par_iter().filter_map(|(i, f, d)| decode(&f, d).is_err().then_some(i)).collect()
        })
    };
    for i in failed {
        out[i] = Landed::Bad;
    }
}

/// A served frame whose payload was read whole (so the stream is still in step), if `sum`, the
/// checksum of the payload as it was read, is its header's; one that doesn't match (damaged on the
/// wire, or in the serving node's DRAM, which checks a block only after sending it) is a miss,
/// counted and logged.
fn verified(frame: BlockFrame, sum: u64) -> Option<BlockFrame> {
    if sum == frame.header.checksum {
        return Some(frame);
    }
    metrics::counter!("kvtier_client_bad_blocks_total").increment(1);
    tracing::warn!(key = ?frame.header.key, "a loaded block failed its checksum; reported as a miss");
    None
}

/// Where a pool's connections come from.
pub(crate) enum Dial {
    /// TCP to the server's announced data address (the default).
    Tcp(SocketAddr),
    /// TLS over TCP to it (the node runs TLS, `ClientConfig::tls`).
    Tls(SocketAddr, crate::tls::TlsDial),
    /// Streams from a caller's connector.
    Custom(Arc<dyn DataPlaneConnector>),
}

impl Dial {
    /// A connection saying the newest protocol; a server that answers it does not speak that one
    /// (an older node, mid rolling upgrade) is dialled again saying the oldest.
    async fn connect(&self, token: Option<&str>) -> Result<DataConn, ClientError> {
        let mut refusal = String::new();
        for version in [PROTOCOL_VERSION, MIN_PROTOCOL_VERSION] {
            match self.connect_version(token, version).await? {
                Ok(conn) => return Ok(conn),
                Err(msg) => {
                    tracing::debug!(version, "data plane does not speak this protocol version: {msg}");
                    refusal = msg;
                }
            }
        }
        Err(ClientError::Refused { code: "dataplane:UnsupportedVersion".into(), message: refusal })
    }

    async fn connect_version(&self, token: Option<&str>, version: u16) -> Result<Greeted, ClientError> {
        match self {
            Dial::Tcp(addr) => DataConn::connect_version(*addr, token, version).await,
            Dial::Tls(addr, dial) => DataConn::connect_tls(*addr, dial, token, version).await,
            Dial::Custom(connector) => {
                let stream = connector
                    .connect()
                    .await
                    .map_err(|e| ClientError::Connect { addr: "data-plane connector".into(), reason: e.to_string() })?;
                DataConn::over(stream, token, version).await
            }
        }
    }
}

/// A bounded pool of data-plane connections. A connection that failed mid-request is dropped,
/// never reused.
pub(crate) struct DataPool {
    dial: Dial,
    token: Option<String>,
    /// Connections back from a clean request, with when they came back. A plain mutex: nothing
    /// is awaited while it is held, and a caller thread that finds it taken spins briefly instead
    /// of queueing behind every other thread (an async mutex hands itself to the next waiter in
    /// turn, so with many Python threads each lease waited for a sleeping thread to be woken).
    idle: std::sync::Mutex<Vec<(DataConn, std::time::Instant)>>,
    permits: Arc<Semaphore>,
    connect_timeout: Duration,
    /// A pooled connection idle longer than this is closed rather than reused: the server closes
    /// connections idle past its `idle_timeout`, and a request sent on one it just closed would
    /// fail.
    max_idle: Duration,
    /// How long a call on one of its TCP connections may poll for the answer.
    answer_poll: Duration,
}

pub(crate) struct Lease<'a> {
    pool: &'a DataPool,
    pub(crate) conn: Option<DataConn>,
    _permit: OwnedSemaphorePermit,
}

impl Lease<'_> {
    /// Returns the connection to the pool (only after a request completed cleanly).
    pub(crate) fn release(mut self) {
        if let Some(c) = self.conn.take() {
            // A poisoned list (a panic elsewhere while it was held) takes no more connections:
            // this one is closed instead.
            if let Ok(mut idle) = self.pool.idle.lock() {
                idle.push((c, std::time::Instant::now()));
            }
        }
    }
}

impl DataPool {
    pub(crate) fn new(
        dial: Dial,
        token: Option<String>,
        size: usize,
        connect_timeout: Duration,
        max_idle: Duration,
        answer_poll: Duration,
    ) -> Self {
        DataPool {
            dial,
            token,
            idle: std::sync::Mutex::new(Vec::new()),
            permits: Arc::new(Semaphore::new(size.max(1))),
            connect_timeout,
            max_idle,
            answer_poll,
        }
    }

    /// A connection of its own, outside the pool's count (a [`lease::LeaseSession`]'s: its
    /// leases live as long as it does, so it never comes back to the pool).
    pub(crate) async fn dedicated(&self) -> Result<DataConn, ClientError> {
        tokio::time::timeout(self.connect_timeout, self.dial.connect(self.token.as_deref()))
            .await
            .map_err(|_| ClientError::Timeout(self.connect_timeout))?
    }

    pub(crate) async fn lease(&self) -> Result<Lease<'_>, ClientError> {
        let permit = self.permits.clone().acquire_owned().await.map_err(|e| ClientError::Io(e.to_string()))?;
        let (mut idle, stale) = match self.idle.lock() {
            Ok(mut idle) => {
                // The most recently used is last; anything idle too long is closed (below, once
                // the list is let go).
                let fresh = idle.iter().position(|(_, since)| since.elapsed() < self.max_idle).unwrap_or(idle.len());
                let stale: Vec<_> = idle.drain(..fresh).collect();
                (idle.pop(), stale)
            }
            Err(_) => (None, Vec::new()),
        };
        drop(stale);
        // One the server closed meanwhile (it restarted: every pooled connection is dead) is
        // dropped, and the next idle one looked at, then a fresh one dialled.
        while idle.as_mut().is_some_and(|(c, _)| c.closed_while_idle()) {
            metrics::counter!("kvtier_client_pooled_connections_closed_total").increment(1);
            idle = self.idle.lock().ok().and_then(|mut idle| idle.pop());
        }
        let conn = match idle {
            Some((c, _)) => c,
            None => {
                let mut c = tokio::time::timeout(self.connect_timeout, self.dial.connect(self.token.as_deref()))
                    .await
                    .map_err(|_| ClientError::Timeout(self.connect_timeout))??;
                c.set_answer_poll(self.answer_poll);
                c
            }
        };
        Ok(Lease { pool: self, conn: Some(conn), _permit: permit })
    }
}

/// Requests a node sends its peers on a client's behalf.
#[path = "conn_peer.rs"]
mod peer;

/// Remote leases: slots of a node's DRAM arena for one-sided movers.
#[path = "conn_lease.rs"]
pub(crate) mod lease;

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_proto::dataplane::{HELLO_LEN, REQUEST_HEADER_LEN};
    use kvtier_proto::{CodecId, DType, KvLayout, KEY_LEN};
    use tokio::net::TcpListener;

    /// A data-plane peer that answers one `GET` of two keys with the frames given (their headers
    /// as given, then their payloads as given: a test can make them disagree).
    async fn one_get_server(answers: Vec<(FrameHeader, Vec<u8>)>) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut hello = [0u8; HELLO_LEN];
            s.read_exact(&mut hello).await.unwrap();
            s.write_all(&HelloReply::encode(Status::Ok, "")).await.unwrap();
            let mut rh = [0u8; REQUEST_HEADER_LEN];
            s.read_exact(&mut rh).await.unwrap();
            let req = RequestHeader::decode(&rh).unwrap();
            let mut keys = vec![0u8; req.count as usize * KEY_LEN];
            s.read_exact(&mut keys).await.unwrap();
            let h = ResponseHeader {
                op: Op::Get as u8,
                status: Status::Ok,
                msg_len: 0,
                request_id: req.request_id,
                count: req.count,
                flags: 0,
            };
            s.write_all(&h.encode()).await.unwrap();
            for (header, payload) in answers {
                s.write_all(&[ItemStatus::Ok as u8]).await.unwrap();
                s.write_all(&header.encode()).await.unwrap();
                s.write_all(&payload).await.unwrap();
            }
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest).await;
        });
        addr
    }

    /// A pooled connection the server closed while it sat idle (the node restarted) is not
    /// handed out: the lease dials a fresh one. Before, the next request went out on the dead
    /// socket and failed ("early eof"): a cluster node's first forward to a restarted peer.
    #[tokio::test]
    async fn a_pooled_connection_the_server_closed_is_not_reused() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (closed_tx, closed_rx) = tokio::sync::oneshot::channel();
        let (second_tx, second_rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            // The first connection: greeted, then closed by the server.
            let (mut s, _) = l.accept().await.unwrap();
            let mut hello = [0u8; HELLO_LEN];
            s.read_exact(&mut hello).await.unwrap();
            s.write_all(&HelloReply::encode(Status::Ok, "")).await.unwrap();
            drop(s);
            let _ = closed_tx.send(());
            // The second: greeted and kept.
            let (mut s, _) = l.accept().await.unwrap();
            s.read_exact(&mut hello).await.unwrap();
            s.write_all(&HelloReply::encode(Status::Ok, "")).await.unwrap();
            let _ = second_tx.send(());
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest).await;
        });
        let pool =
            DataPool::new(Dial::Tcp(addr), None, 2, Duration::from_secs(5), Duration::from_secs(60), Duration::ZERO);
        pool.lease().await.unwrap().release();
        closed_rx.await.unwrap();
        // The FIN has to reach this end's socket; on loopback it does at once, give it a moment.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut second = pool.lease().await.unwrap();
        let conn = second.conn.as_mut().unwrap();
        assert!(!conn.closed_while_idle(), "the lease handed out a live connection");
        tokio::time::timeout(Duration::from_secs(5), second_rx).await.expect("a fresh connection was dialled").unwrap();
    }

    /// A data-plane peer speaking protocols up to `newest` (an older node, as a rolling upgrade
    /// meets it): a hello for a newer one is refused and closed; then one `PUT` of one frame is
    /// read, and what the peer saw comes back: the version, the flags, the header's checksum,
    /// the payload and the checksum after it (if the flag said one follows).
    async fn put_server(
        newest: u16,
    ) -> (SocketAddr, tokio::sync::oneshot::Receiver<(u16, u16, u64, Vec<u8>, Option<u64>)>) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = l.accept().await.unwrap();
                let mut hello = [0u8; HELLO_LEN];
                s.read_exact(&mut hello).await.unwrap();
                let version = Hello::decode(&hello).unwrap().version;
                if version > newest {
                    s.write_all(&HelloReply::encode(Status::UnsupportedVersion, "too new")).await.unwrap();
                    continue;
                }
                s.write_all(&HelloReply::encode(Status::Ok, "")).await.unwrap();
                let mut rh = [0u8; REQUEST_HEADER_LEN];
                s.read_exact(&mut rh).await.unwrap();
                let req = RequestHeader::decode(&rh).unwrap();
                let mut fh = [0u8; FRAME_HEADER_LEN];
                s.read_exact(&mut fh).await.unwrap();
                let header = FrameHeader::decode(&fh).unwrap();
                let mut payload = vec![0u8; header.payload_len as usize];
                s.read_exact(&mut payload).await.unwrap();
                let after = if req.flags & FLAG_CHECKSUM_AFTER != 0 {
                    let mut t = [0u8; 8];
                    s.read_exact(&mut t).await.unwrap();
                    Some(u64::from_le_bytes(t))
                } else {
                    None
                };
                let h = ResponseHeader {
                    op: Op::Put as u8,
                    status: Status::Ok,
                    msg_len: 0,
                    request_id: req.request_id,
                    count: 1,
                    flags: 0,
                };
                s.write_all(&h.encode()).await.unwrap();
                s.write_all(&[ItemStatus::Ok as u8]).await.unwrap();
                let _ = tx.send((version, req.flags, header.checksum, payload, after));
                let mut rest = Vec::new();
                let _ = s.read_to_end(&mut rest).await;
                return;
            }
        });
        (addr, rx)
    }

    /// A same-host connection's end follows the server's answers: unpaced after one that says
    /// the connection had the node to itself, on the system's congestion control after one that
    /// does not (an error answer included), where the system's control paces.
    #[tokio::test]
    async fn this_end_runs_unpaced_while_the_server_s_answers_say_the_connection_was_alone() {
        use kvtier_proto::tcp::{congestion, paces, same_host_congestion, SameHostCongestion, UNPACED};
        let script =
            [(ANSWER_ALONE, Status::Ok), (ANSWER_ALONE, Status::Ok), (0, Status::Ok), (ANSWER_ALONE, Status::Ok)];
        let script = [&script[..], &[(ANSWER_ALONE, Status::Ok), (0, Status::BadRequest)]].concat();
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let answers = script.clone();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut hello = [0u8; HELLO_LEN];
            s.read_exact(&mut hello).await.unwrap();
            s.write_all(&HelloReply::encode(Status::Ok, "")).await.unwrap();
            for (flags, status) in answers {
                let mut rh = [0u8; REQUEST_HEADER_LEN];
                s.read_exact(&mut rh).await.unwrap();
                let req = RequestHeader::decode(&rh).unwrap();
                let mut keys = vec![0u8; req.count as usize * KEY_LEN];
                s.read_exact(&mut keys).await.unwrap();
                let (count, msg) = if status == Status::Ok { (req.count, 0) } else { (0, 2) };
                let h =
                    ResponseHeader { op: req.op as u8, status, msg_len: msg, request_id: req.request_id, count, flags };
                s.write_all(&h.encode()).await.unwrap();
                s.write_all(&if status == Status::Ok {
                    vec![ItemStatus::Miss as u8; count as usize]
                } else {
                    b"no".to_vec()
                })
                .await
                .unwrap();
            }
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest).await;
        });
        let mut c = DataConn::connect(addr, None).await.unwrap();
        let system = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control").unwrap();
        let system = system.trim();
        if *same_host_congestion() != SameHostCongestion::WhileAlone || !paces(system) {
            assert!(c.pace.is_none(), "{system}: nothing to switch, yet a switch");
            eprintln!("{system}, {:?}: this end is not switched here", same_host_congestion());
            return;
        }
        let fd = c.pace.as_ref().map(|(fd, _)| *fd).expect("a same-host connection on a pacing control");
        // SAFETY: `fd` is `c`'s socket, open while `c` lives (it outlives every use below).
        let cc = || congestion(unsafe { BorrowedFd::borrow_raw(fd) }).unwrap();
        assert_eq!(cc(), system);
        for (i, (flags, status)) in script.into_iter().enumerate() {
            let res = c.exists(NamespaceId([1; 16]), &[BlockKey([i as u8; 32])]).await;
            assert_eq!(res.is_ok(), status == Status::Ok, "answer {i}: {res:?}");
            if flags & ANSWER_ALONE != 0 {
                assert!(UNPACED.contains(&cc().as_str()), "answer {i} said alone: {}", cc());
            } else {
                assert_eq!(cc(), system, "answer {i} did not say alone");
            }
        }
    }

    /// A raw block in two parts, not hashed yet (what `store_keys` sends).
    fn unhashed(len: usize) -> (GatherFrame, Vec<u8>) {
        let f = frame(3, len);
        let mut header = f.header;
        header.checksum = 0;
        let cut = len / 3;
        let parts = vec![f.payload.slice(..cut), f.payload.slice(cut..)];
        (GatherFrame { header, parts, summed: false }, f.payload.to_vec())
    }

    #[tokio::test]
    async fn a_block_is_hashed_as_it_is_sent_and_its_checksum_follows_it() {
        let (addr, seen) = put_server(PROTOCOL_VERSION).await;
        let mut conn = DataConn::connect(addr, None).await.unwrap();
        assert_eq!(conn.version, PROTOCOL_VERSION);
        // Several hash steps, the last one short, across the parts' boundary.
        let (f, bytes) = unhashed(2 * HASH_STEP + 12_345);
        assert_eq!(conn.put_frames(std::slice::from_ref(&f), 0).await.unwrap(), vec![ItemStatus::Ok]);
        let (version, flags, in_header, payload, after) = seen.await.unwrap();
        assert_eq!(version, PROTOCOL_VERSION);
        assert_ne!(flags & FLAG_CHECKSUM_AFTER, 0);
        assert_eq!(in_header, 0, "the header's checksum is not filled in");
        assert_eq!(payload, bytes);
        assert_eq!(after, Some(kvtier_proto::checksum(&bytes)));
    }

    #[tokio::test]
    async fn an_older_server_is_spoken_to_in_its_protocol_with_checksums_in_the_headers() {
        let (addr, seen) = put_server(MIN_PROTOCOL_VERSION).await;
        let mut conn = DataConn::connect(addr, None).await.unwrap();
        assert_eq!(conn.version, MIN_PROTOCOL_VERSION, "connected again, saying the oldest");
        let (f, bytes) = unhashed(HASH_STEP + 1);
        assert_eq!(conn.put_frames(std::slice::from_ref(&f), 0).await.unwrap(), vec![ItemStatus::Ok]);
        let (version, flags, in_header, payload, after) = seen.await.unwrap();
        assert_eq!((version, flags & FLAG_CHECKSUM_AFTER, after), (MIN_PROTOCOL_VERSION, 0, None));
        assert_eq!(payload, bytes);
        assert_eq!(in_header, kvtier_proto::checksum(&bytes), "hashed before it was sent, into its header");
    }

    #[tokio::test]
    async fn a_server_that_speaks_no_version_of_ours_is_a_clear_refusal() {
        let (addr, _seen) = put_server(0).await;
        let Err(err) = DataConn::connect(addr, None).await else {
            panic!("connected to a server that speaks no version of ours")
        };
        assert!(
            matches!(&err, ClientError::Refused { code, message } if code == "dataplane:UnsupportedVersion" && message == "too new"),
            "{err:?}"
        );
    }

    fn frame(key: u8, len: usize) -> BlockFrame {
        let layout = KvLayout::opaque(len as u64, DType::Bf16, 16);
        let payload: Vec<u8> = (0..len).map(|i| (i * 31 + key as usize) as u8).collect();
        BlockFrame::new(NamespaceId([1; 16]), BlockKey([key; 32]), layout, CodecId::RAW, 16, Bytes::from(payload))
    }

    fn no_decode(_: &BlockFrame, _: &mut [&mut [u8]]) -> Result<(), ClientError> {
        Err(ClientError::InvalidArgument("not expected".into()))
    }

    #[tokio::test]
    async fn bytes_damaged_on_the_wire_land_as_bad_never_as_data() {
        let (good, bad) = (frame(1, 200_000), frame(2, 200_000));
        let mut damaged = bad.payload.to_vec();
        damaged[123_456] ^= 0x40;
        let addr = one_get_server(vec![(bad.header, damaged), (good.header, good.payload.to_vec())]).await;
        let mut conn = DataConn::connect(addr, None).await.unwrap();
        let (mut a, mut b) = (vec![0u8; 200_000], vec![0u8; 200_000]);
        // The good block lands in two segments; the damaged one in one.
        let (b1, b2) = b.split_at_mut(70_000);
        let mut dests: Vec<Dest<'_>> = vec![vec![&mut a[..]], vec![b1, b2]];
        let keys = [bad.header.key, good.header.key];
        let landed = conn.get_into(NamespaceId([1; 16]), &keys, &mut dests, false, 1 << 30, &no_decode).await.unwrap();
        assert_eq!(landed, vec![Landed::Bad, Landed::Ok]);
        assert!(b[..] == good.payload[..]);
    }

    #[tokio::test]
    async fn a_payload_read_whole_is_checked_as_it_lands_and_a_damaged_one_never_decoded_or_returned() {
        let (good, bad) = (frame(1, 300_000), frame(2, 300_000));
        let mut damaged = bad.payload.to_vec();
        damaged[299_999] ^= 0x01;
        let answers = vec![(bad.header, damaged), (good.header, good.payload.to_vec())];
        let keys = [bad.header.key, good.header.key];
        let ns = NamespaceId([1; 16]);

        // Destinations of another size than the payloads: both are read whole and handed to the
        // decoder, which must see the good block only, byte for byte.
        let mut conn = DataConn::connect(one_get_server(answers.clone()).await, None).await.unwrap();
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = std::sync::Arc::clone(&seen);
        let record = move |f: &BlockFrame, _: &mut [&mut [u8]]| -> Result<(), ClientError> {
            sink.lock().unwrap().push(f.payload.clone());
            Ok(())
        };
        let (mut a, mut b) = (vec![0u8; 1000], vec![0u8; 1000]);
        let mut dests: Vec<Dest<'_>> = vec![vec![&mut a[..]], vec![&mut b[..]]];
        let landed = conn.get_into(ns, &keys, &mut dests, false, 1 << 30, &record).await.unwrap();
        assert_eq!(landed, vec![Landed::Bad, Landed::Ok]);
        assert_eq!(*seen.lock().unwrap(), vec![good.payload.clone()]);

        // A plain `GET` (the server's peer reads too): the damaged block is a miss.
        let mut conn = DataConn::connect(one_get_server(answers).await, None).await.unwrap();
        let got = conn.get(ns, &keys, false, 1 << 30, 600_000).await.unwrap();
        assert!(got[0].is_none(), "a damaged block is never returned");
        assert_eq!(got[1].as_ref().map(|f| &f.payload), Some(&good.payload));
    }

    #[tokio::test]
    async fn a_frame_for_another_key_is_a_protocol_error() {
        let other = frame(9, 1000);
        let addr = one_get_server(vec![(other.header, other.payload.to_vec())]).await;
        let mut conn = DataConn::connect(addr, None).await.unwrap();
        let mut out = vec![0u8; 1000];
        let mut dests: Vec<Dest<'_>> = vec![vec![&mut out[..]]];
        let err = conn
            .get_into(NamespaceId([1; 16]), &[BlockKey([3; 32])], &mut dests, false, 1 << 30, &no_decode)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("asked for"), "{err}");
    }

    /// A stream that takes at most `step` bytes per call, across slices when `vectored`.
    struct Trickle {
        out: Vec<u8>,
        step: usize,
        vectored: bool,
        calls: usize,
    }

    impl AsyncWrite for Trickle {
        fn poll_write(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            data: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            let n = data.len().min(self.step);
            self.out.extend_from_slice(&data[..n]);
            self.calls += 1;
            std::task::Poll::Ready(Ok(n))
        }
        fn poll_write_vectored(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            bufs: &[std::io::IoSlice<'_>],
        ) -> std::task::Poll<std::io::Result<usize>> {
            if !self.vectored {
                let first = bufs.iter().find(|b| !b.is_empty()).map_or(&[][..], |b| &b[..]);
                return self.poll_write(cx, first);
            }
            self.calls += 1;
            let mut left = self.step;
            for b in bufs {
                let n = b.len().min(left);
                self.out.extend_from_slice(&b[..n]);
                left -= n;
                if left == 0 {
                    break;
                }
            }
            std::task::Poll::Ready(Ok(self.step - left))
        }
        fn is_write_vectored(&self) -> bool {
            self.vectored
        }
        fn poll_flush(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
        fn poll_shutdown(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
    }

    /// Every byte of every piece arrives once and in order, whatever the stream takes per call
    /// (one byte, a piece's middle, several pieces, more than there is), with empty pieces
    /// among them and more pieces than one vectored write carries.
    #[tokio::test]
    async fn gathered_writes_send_every_piece_in_order() {
        let owned: Vec<Vec<u8>> =
            (0..600usize).map(|i| (0..(i * 37) % 300).map(|j| (i * 7 + j) as u8).collect()).collect();
        let pieces: Vec<&[u8]> = owned.iter().map(|p| &p[..]).collect();
        let whole = owned.concat();
        for vectored in [true, false] {
            for step in [1usize, 7, 100, 4096, 1 << 30] {
                let mut w = Trickle { out: Vec::new(), step, vectored, calls: 0 };
                write_gathered(&mut w, &pieces).await.unwrap();
                assert!(w.out == whole, "vectored {vectored} step {step}");
                if vectored && step == 1 << 30 {
                    // Nothing partial: one call per MAX_IOV non-empty pieces.
                    let non_empty = pieces.iter().filter(|p| !p.is_empty()).count();
                    assert_eq!(w.calls, non_empty.div_ceil(MAX_IOV));
                }
            }
        }
    }

    #[test]
    fn gathered_checksum_is_the_checksum_of_the_concatenation() {
        let whole: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
        let parts = [&whole[..1], &whole[1..4096], &whole[4096..]];
        assert_eq!(checksum_of(&parts), xxhash_rust::xxh3::xxh3_64(&whole));
        assert_eq!(checksum_of(&[&whole[..]]), xxhash_rust::xxh3::xxh3_64(&whole));
    }
}
