//! The bulk data plane: a framed listener (protocol in `kvtier_proto::dataplane`) that moves
//! block payloads with as few copies as the kernel allows.
//!
//! The connection is generic over its byte stream: TCP ([`serve`]), a Unix socket
//! ([`serve_unix`]), or any `AsyncRead + AsyncWrite` stream accepted elsewhere ([`serve_stream`]:
//! an in-memory duplex in the in-process test harness; QUIC streams between nodes, `crate::quic`). TCP and Unix sockets
//! are split into owned halves (no lock between reader and writer); any other stream is split
//! with `tokio::io::split`. The framing itself is I/O-free and lives in `kvtier_proto`.
//!
//! Copies per block: a `PUT` payload is read from the stream straight into its DRAM slab slot
//! (no intermediate buffer), verified there, then published; a `GET` payload is written from the
//! slab slot straight to the stream (a zero-copy `Bytes` view; the slot stays alive while it is
//! being sent even if the block is evicted meanwhile).
//!
//! Bad input never poisons the node: a per-block problem (unknown namespace, wrong size, layout
//! mismatch, checksum mismatch, no capacity) is answered with an item status and the stream
//! continues; a problem that loses the framing (bad frame header, oversized frame, too many
//! blocks, truncated stream) is answered with a request-level error when possible and only that
//! connection is closed. A block that was not completely received is never visible.
//!
//! In a cluster (see `crate::cluster::peer`), a `GET`'s keys that no local tier holds are loaded
//! from their owners before the answer starts, an `EXISTS` asks the owners of the keys no local
//! tier holds, and blocks a `PUT` stored are queued for their other owners; requests flagged
//! `FLAG_PEER` (from another node) do none of these.

mod remote;
pub(crate) mod spin;

use std::future::Future;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_proto::dataplane::{
    Hello, HelloReply, ItemStatus, Op, RequestHeader, ResponseHeader, Status, CHECKSUM_AFTER_SINCE_VERSION,
    CHECKSUM_LEN, FLAG_CHECKSUM_AFTER, FLAG_PEER, FLAG_PIN_LEASE, FLAG_REPORT_PRESENT, FLAG_STOP_AT_MISS, HELLO_LEN,
    MAX_ENDPOINT_LEN, MIN_PROTOCOL_VERSION, NO_CODEC, PROTOCOL_VERSION, REQUEST_HEADER_LEN,
};
use kvtier_proto::tcp::{PaceSwitch, Switched, Tuned};
use kvtier_proto::{BlockKey, FrameHeader, NamespaceId, ProtoError, FRAME_HEADER_LEN, KEY_LEN};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, BufReader};
use tokio::net::TcpListener;
#[cfg(unix)]
use tokio::net::UnixListener;
use tokio::sync::watch;

use crate::deadline::Deadlined;
use crate::dram::Priority;
use crate::error::ServerError;
use crate::fabric::RemoteLeases;
use crate::gather::GatherWriter;
use crate::listen::Peer;
use crate::metrics::{error, observe};
use crate::state::NodeState;
use crate::tenants::{Access, Principal};
use crate::tiers::Load;

const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// A read of the hello: a hello not complete within [`HELLO_TIMEOUT`], or stalled past the
/// connection's stall timeout (shorter, where it is set so) first, is a hello timeout.
fn hello_in_time<T>(read: Result<std::io::Result<T>, tokio::time::error::Elapsed>) -> Result<T, ConnError> {
    match read {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) if e.kind() != std::io::ErrorKind::TimedOut => Err(e.into()),
        _ => {
            error("dataplane_hello_timeout");
            Err(ConnError::Protocol("no complete hello in time".into()))
        }
    }
}
const IO_BUF: usize = 64 * 1024;
/// The read side's buffer: requests' headers and keys are read through it, while payloads longer
/// than it go from the socket straight into their slots (tokio's `BufReader` bypasses its buffer
/// for a read at least its size when it is empty). Small, so that a header read pulls little of
/// the payload behind it into the buffer, to be copied a second time: with 64 KiB, a 64 KiB
/// `PUT`'s whole payload went through it.
const READ_BUF: usize = 4 * 1024;

/// Accepts TCP data-plane connections (with `TCP_NODELAY`; over TLS with `tls`) until `stop`
/// turns true; then ends every connection (their pin leases are released as they drop) before
/// returning.
pub async fn serve(
    listener: TcpListener,
    state: Arc<NodeState>,
    stop: watch::Receiver<bool>,
    tls: Option<tokio_rustls::TlsAcceptor>,
) {
    let Some(tls) = tls else { return accept_loop(listener, state, stop).await };
    crate::listen::accept_bounded(
        "data plane",
        state.config().conn_limits(),
        stop,
        || async {
            let (sock, peer) = listener.accept().await?;
            let _ = sock.set_nodelay(true);
            let pace = tune_congestion(&sock, peer);
            Ok(((sock, peer, pace), Peer::Ip(peer.ip())))
        },
        |(sock, peer, pace), stop| {
            let (state, tls) = (state.clone(), tls.clone());
            async move {
                // In the connection's own task: a slow handshake holds only its own slot.
                match crate::tls::accept(&tls, sock).await {
                    Ok((stream, names)) => {
                        let cert = state.tenants().authenticate_cert(&names);
                        let (r, w) = tokio::io::split(stream);
                        // The TLS stream owns the socket `pace` switches until the connection ends.
                        let own = OwnSocket { read_fd: None, pace };
                        serve_halves(r, w, state, stop, peer.to_string(), cert, own).await
                    }
                    Err(e) => tracing::debug!(%peer, "data plane TLS handshake failed: {e}"),
                }
            }
        },
        // Told why over TLS, the handshake bounded as the answer is.
        |(sock, _peer, _pace), why| {
            let tls = tls.clone();
            async move {
                let accepted = tokio::time::timeout(crate::listen::REFUSE_WAIT, crate::tls::accept(&tls, sock)).await;
                if let Ok(Ok((stream, _))) = accepted {
                    let (r, w) = tokio::io::split(stream);
                    crate::listen::refuse_with_hello_reply(r, w, why).await;
                }
            }
        },
    )
    .await
}

/// Accepts data-plane connections on a Unix socket until `stop` turns true, like [`serve`].
#[cfg(unix)]
pub async fn serve_unix(listener: UnixListener, state: Arc<NodeState>, stop: watch::Receiver<bool>) {
    accept_loop(listener, state, stop).await
}

/// Serves one already-accepted data-plane stream (an in-memory duplex, a socket accepted by the
/// caller) until the peer closes it, it fails, or `stop` turns true. Its pin leases are released
/// when it ends. Not counted against `max_connections`: a caller that accepts streams itself
/// bounds them itself.
pub async fn serve_stream<S>(stream: S, state: Arc<NodeState>, stop: watch::Receiver<bool>)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (r, w) = tokio::io::split(stream);
    serve_split(r, w, state, stop).await
}

/// [`serve_stream`] for a stream that comes as separate receive and send halves (a QUIC
/// bidirectional stream).
pub async fn serve_split<R, W>(r: R, w: W, state: Arc<NodeState>, stop: watch::Receiver<bool>)
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    serve_halves(r, w, state, stop, "stream".to_string(), Default::default(), OwnSocket::default()).await
}

/// Runs one connection over a read half and a write half until it ends or `stop` turns true;
/// `cert`: whom its verified TLS client certificate names (a TLS connection's, or a QUIC
/// connection's for each of its streams, see `crate::quic`); `own`: what it knows of the socket
/// under it, when it has one of its own.
pub(crate) async fn serve_halves<R, W>(
    r: R,
    w: W,
    state: Arc<NodeState>,
    mut stop: watch::Receiver<bool>,
    peer: String,
    cert: crate::tenants::CertIdentity,
    own: OwnSocket,
) where
    R: AsyncRead + Unpin + Send,
    W: AsyncWrite + Unpin + Send,
{
    tokio::select! {
        _ = crate::stopped(&mut stop) => {}
        res = Connection::new(r, w, state, cert, own).run() => {
            if let Err(e) = res {
                tracing::debug!(%peer, "data plane connection closed: {e}");
            }
        }
    }
}

/// What a connection knows of the socket under it, when it has one of its own. Its descriptors
/// stay open as long as the connection's read and write halves live (they own the socket).
#[derive(Debug, Default)]
pub(crate) struct OwnSocket {
    /// The socket the read half reads as it is (not through TLS): polled for the next request
    /// ([`spin`]).
    pub(crate) read_fd: Option<RawFd>,
    /// A same-host TCP socket whose congestion control is switched per request, unpaced while
    /// the connection has the node to itself ([`PaceSwitch`]), and its descriptor.
    pub(crate) pace: Option<(RawFd, PaceSwitch)>,
}

/// An accepted connection as owned read and write halves (no lock between them), a peer name
/// for logs, and what it knows of its socket.
type Accepted<R, W> = ((R, W, String, OwnSocket), Peer);

/// A listener the data plane accepts from.
trait Accept: Send + 'static {
    type Read: AsyncRead + Unpin + Send + 'static;
    type Write: AsyncWrite + Unpin + Send + 'static;
    fn accept_split(&self) -> impl Future<Output = std::io::Result<Accepted<Self::Read, Self::Write>>> + Send;
}

/// An accepted data-plane socket from a client on this host takes the congestion control
/// `KVTIER_SAME_HOST_CONGESTION` asks for ([`kvtier_proto::tcp`]): for its life (counted in
/// `kvtier_dataplane_congestion_total{cc}`), or switched per request by the connection (`auto`,
/// the default: the switch returned, with the socket's descriptor).
fn tune_congestion(sock: &tokio::net::TcpStream, peer: std::net::SocketAddr) -> Option<(RawFd, PaceSwitch)> {
    match kvtier_proto::tcp::tune_data_socket(sock, peer.ip()) {
        Tuned::System => {}
        Tuned::Set(cc) => ::metrics::counter!("kvtier_dataplane_congestion_total", "cc" => cc).increment(1),
        Tuned::Refused => congestion_refused(),
    }
    PaceSwitch::for_socket(sock, peer.ip()).map(|p| (sock.as_raw_fd(), p))
}

/// The kernel let the server take none of the congestion controls asked for: counted as
/// `kvtier_dataplane_congestion_total{cc="refused"}` and warned once; the connection keeps the
/// system's and works.
fn congestion_refused() {
    ::metrics::counter!("kvtier_dataplane_congestion_total", "cc" => "refused").increment(1);
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| {
        tracing::warn!(
            asked = ?kvtier_proto::tcp::same_host_congestion(),
            "{} names no congestion control this kernel lets the server take; same-host \
             connections keep the system's",
            kvtier_proto::tcp::CONGESTION_ENV
        )
    });
}

impl Accept for TcpListener {
    type Read = tokio::net::tcp::OwnedReadHalf;
    type Write = tokio::net::tcp::OwnedWriteHalf;
    async fn accept_split(&self) -> std::io::Result<Accepted<Self::Read, Self::Write>> {
        let (sock, peer) = self.accept().await?;
        let _ = sock.set_nodelay(true);
        let pace = tune_congestion(&sock, peer);
        let own = OwnSocket { read_fd: Some(sock.as_raw_fd()), pace };
        let (r, w) = sock.into_split();
        Ok(((r, w, peer.to_string(), own), Peer::Ip(peer.ip())))
    }
}

#[cfg(unix)]
impl Accept for UnixListener {
    type Read = tokio::net::unix::OwnedReadHalf;
    type Write = tokio::net::unix::OwnedWriteHalf;
    async fn accept_split(&self) -> std::io::Result<Accepted<Self::Read, Self::Write>> {
        let (sock, peer) = self.accept().await?;
        let who = sock.peer_cred().map_or(Peer::Unknown, |c| Peer::Uid(c.uid()));
        let own = OwnSocket { read_fd: Some(sock.as_raw_fd()), pace: None };
        let (r, w) = sock.into_split();
        Ok(((r, w, format!("{peer:?}"), own), who))
    }
}

/// Accepts connections (within `max_connections` and `max_connections_per_peer`) until `stop`
/// turns true; then ends every connection before returning.
async fn accept_loop<L: Accept>(listener: L, state: Arc<NodeState>, stop: watch::Receiver<bool>) {
    crate::listen::accept_bounded(
        "data plane",
        state.config().conn_limits(),
        stop,
        || listener.accept_split(),
        |(r, w, peer, own), stop| serve_halves(r, w, state.clone(), stop, peer, Default::default(), own),
        |(r, w, _, _), why| crate::listen::refuse_with_hello_reply(r, w, why),
    )
    .await
}

/// Why a connection ended early.
#[derive(Debug, thiserror::Error)]
enum ConnError {
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Protocol(String),
    /// A `PUT` frame's payload did not all arrive within `lease_timeout` (the duration).
    #[error("a payload did not arrive within {0:?}")]
    PayloadLate(Duration),
}

struct Connection<R, W> {
    rd: BufReader<Deadlined<spin::SpinRead<R>>>,
    /// Headers and statuses are buffered; a payload leaves with them in one vectored write.
    wr: GatherWriter<Deadlined<W>>,
    /// No byte for this long inside a request (or while the peer doesn't read its answer) ends
    /// the connection.
    stall: Duration,
    /// How long the connection may wait for its next request.
    idle: Duration,
    state: Arc<NodeState>,
    scratch: Vec<u8>,
    leases: PinLeases,
    /// Slots of the DRAM arena this connection leased to its peer for one-sided moves.
    remote: RemoteLeases,
    /// Who the hello's token authenticated (`None` until then).
    principal: Option<Principal>,
    /// The tenant's connection slot this connection holds (`max_connections_per_tenant`).
    _tenant_slot: Option<crate::tenants::TenantConnection>,
    /// Whom the connection's verified TLS client certificate names, if anyone.
    cert: crate::tenants::CertIdentity,
    /// The protocol version the hello said (what the client may send).
    version: u16,
    /// Payload bytes the last `GET` answered (`u64::MAX` after a `PUT`).
    moved: u64,
    /// How long to poll the socket for the next request after a small load (`dataplane_poll`).
    poll: Duration,
    /// The socket's congestion control, switched as each request starts ([`OwnSocket::pace`]).
    pace: Option<(RawFd, PaceSwitch)>,
    /// The request being served started with the connection alone, on a socket switched
    /// ([`Connection::pace`]): its answer says so (`ANSWER_ALONE`), for the client's end.
    alone: bool,
}

/// Most blocks one connection may hold pin leases on (a 1M-token context in blocks of 16).
pub const MAX_LEASED_PINS: usize = 1 << 16;

/// Pins held for a client between a session's upload and its park; released by `RELEASE`, when
/// the connection ends, however it ends, or once it has taken no new one for `idle_timeout` (a
/// connection kept alive by other requests can't hold them indefinitely). One pin per block
/// however often it is re-put, and at most [`MAX_LEASED_PINS`] blocks.
struct PinLeases {
    state: Arc<NodeState>,
    pins: std::collections::HashSet<(NamespaceId, BlockKey)>,
    /// When the last pin was taken.
    last: Instant,
}

impl PinLeases {
    /// Pins a block for this connection (once); false when it can't be pinned (over the pinned
    /// limit, evicted meanwhile, or this connection's lease count).
    fn pin(&mut self, ns: NamespaceId, key: BlockKey) -> bool {
        if self.pins.contains(&(ns, key)) {
            return true;
        }
        if self.pins.len() >= MAX_LEASED_PINS {
            error("lease_pins_per_connection");
            return false;
        }
        if self.state.tiers().pin_lease(&ns, &key).is_err() {
            return false;
        }
        self.pins.insert((ns, key));
        self.last = Instant::now();
        true
    }

    /// Releases every pin if none was taken for `hold`: the upload they were for is over.
    fn release_if_stale(&mut self, hold: Duration) {
        if !self.pins.is_empty() && self.last.elapsed() >= hold {
            ::metrics::counter!("kvtier_dataplane_pin_leases_expired_total").increment(self.pins.len() as u64);
            self.release();
        }
    }

    fn release(&mut self) {
        for (ns, key) in self.pins.drain() {
            self.state.tiers().unpin_lease(&ns, &key);
        }
    }
}

impl Drop for PinLeases {
    fn drop(&mut self) {
        self.release();
    }
}

impl<R: AsyncRead + Unpin + Send, W: AsyncWrite + Unpin + Send> Connection<R, W> {
    fn new(r: R, w: W, state: Arc<NodeState>, cert: crate::tenants::CertIdentity, own: OwnSocket) -> Self {
        let (stall, idle, poll) =
            (state.config().stall_timeout.0, state.config().idle_timeout.0, state.config().dataplane_poll.0);
        Connection {
            rd: BufReader::with_capacity(
                READ_BUF,
                Deadlined::new(spin::SpinRead::new(r, own.read_fd, &spin::NODE), stall),
            ),
            wr: GatherWriter::with_capacity(IO_BUF, Deadlined::new(w, stall)),
            stall,
            idle,
            leases: PinLeases { state: state.clone(), pins: Default::default(), last: Instant::now() },
            remote: RemoteLeases::new(state.config().lease_timeout.0),
            state,
            scratch: Vec::new(),
            principal: None,
            _tenant_slot: None,
            cert,
            version: MIN_PROTOCOL_VERSION,
            moved: 0,
            poll,
            pace: own.pace,
            alone: false,
        }
    }

    async fn run(mut self) -> Result<(), ConnError> {
        self.principal = Some(self.handshake().await?);
        loop {
            let mut hdr = [0u8; REQUEST_HEADER_LEN];
            // Between requests the idle budget applies; from the first byte of one, the stall one.
            self.rd.get_mut().set_budget(self.idle);
            // A caller loading small blocks sends its next request soon after the answer: worth
            // polling for (`spin`). After a large block it takes the answer in first, and
            // polling for that long only takes the core its client needs; after a store the
            // next request came no sooner polled for (measured: 64 KiB stores 5% slower). Those
            // waits park. (A store's payload itself is polled for: `put_one`.)
            let poll = if self.moved <= POLL_AFTER_BYTES { self.poll } else { Duration::ZERO };
            self.rd.get_mut().get_mut().arm(poll);
            self.moved = 0;
            let first = loop {
                // Remote leases end at their deadlines even while the peer sends nothing (the
                // idle clock runs on: it lives in the reader, not in this read).
                let Some(due) = self.remote.next_deadline() else { break self.rd.read_u8().await };
                match tokio::time::timeout_at(due.into(), self.rd.read_u8()).await {
                    Ok(r) => break r,
                    Err(_) => self.remote.reap(Instant::now()),
                }
            };
            self.rd.get_mut().set_budget(self.stall);
            self.remote.reap(Instant::now());
            self.leases.release_if_stale(self.idle);
            match first {
                Ok(b) => hdr[0] = b,
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                    error("dataplane_idle_timeout");
                    return Err(e.into());
                }
                Err(e) => return Err(e.into()),
            }
            let poller = self.rd.get_mut().get_mut().poller();
            // Still armed: the request's first byte came by polling (a parked read disarms).
            if poller.armed() {
                spin::count_polled("dataplane");
            }
            poller.disarm();
            let busy = spin::Busy::enter(poller.gate(), poller.id());
            self.alone = self.pace.is_some() && poller.alone_serving();
            self.fit_pace(self.alone);
            let done = self.request(hdr).await;
            drop(busy);
            match done {
                Err(ConnError::Io(e)) if e.kind() == std::io::ErrorKind::TimedOut => {
                    // A frame cut off mid-way, or an answer the peer stopped reading.
                    error("dataplane_stall_timeout");
                    return Err(e.into());
                }
                Err(e) => return Err(e),
                Ok(()) => {}
            }
        }
    }

    /// Switches the socket's congestion control for the request starting now: unpaced if the
    /// connection has the node to itself (`alone`), the system's if not ([`PaceSwitch`]).
    fn fit_pace(&mut self, alone: bool) {
        let Some((fd, pace)) = &mut self.pace else { return };
        // SAFETY: `fd` is the socket under this connection's halves (`OwnSocket`), which
        // `self.rd` and `self.wr` own: open while `self` lives.
        let sock = unsafe { BorrowedFd::borrow_raw(*fd) };
        match pace.fit(sock, alone) {
            Switched::Unchanged => {}
            Switched::To(cc) => {
                ::metrics::counter!("kvtier_dataplane_congestion_switches_total", "cc" => cc.to_string()).increment(1)
            }
            Switched::Refused => congestion_refused(),
        }
    }

    /// Serves one request whose first header byte is in `hdr`.
    async fn request(&mut self, mut hdr: [u8; REQUEST_HEADER_LEN]) -> Result<(), ConnError> {
        self.rd.read_exact(&mut hdr[1..]).await?;
        let req = match RequestHeader::decode(&hdr) {
            Ok(r) => r,
            Err(e) => return self.fatal(hdr[0], 0, Status::BadRequest, &e.to_string()).await,
        };
        let limit = self.state.config().max_blocks_per_request;
        // A `CONNECT`'s count is its endpoint's bytes, bounded on their own.
        if req.op == Op::Connect && req.count as usize > MAX_ENDPOINT_LEN {
            let msg = format!("an endpoint of {} bytes; at most {MAX_ENDPOINT_LEN}", req.count);
            return self.fatal(req.op as u8, req.request_id, Status::TooLarge, &msg).await;
        }
        if req.count > limit && req.op != Op::Connect {
            let msg = format!("{} blocks in one request exceed max_blocks_per_request {limit}", req.count);
            return self.fatal(req.op as u8, req.request_id, Status::TooLarge, &msg).await;
        }
        if req.flags & FLAG_CHECKSUM_AFTER != 0 && (req.op != Op::Put || self.version < CHECKSUM_AFTER_SINCE_VERSION) {
            let msg = format!(
                "checksums after the payloads are for PUT on data-plane protocol {CHECKSUM_AFTER_SINCE_VERSION}; \
                 this is {:?} on protocol {}",
                req.op, self.version
            );
            return self.fatal(req.op as u8, req.request_id, Status::BadRequest, &msg).await;
        }
        match req.op {
            Op::Put => self.put(req).await?,
            Op::Get => self.get(req).await?,
            Op::Exists => self.exists(req).await?,
            Op::LeasePut => self.lease_put(req).await?,
            Op::Commit => self.commit_leases(req).await?,
            Op::LeaseGet => self.lease_get(req).await?,
            Op::EndGet => self.end_get(req).await?,
            Op::Connect => self.connect_fabric(req).await?,
            Op::Release => {
                self.leases.release();
                let h = ResponseHeader::ok(Op::Release, req.request_id, 0);
                self.wr.write_all(&h.encode()).await?;
            }
        }
        self.wr.flush().await?;
        Ok(())
    }

    /// Who the connection acts for (set by the hello, before any request is read).
    fn principal(&self) -> Result<Principal, ConnError> {
        self.principal.clone().ok_or_else(|| ConnError::Protocol("request before hello".into()))
    }

    async fn handshake(&mut self) -> Result<Principal, ConnError> {
        // The whole hello, token included, within one deadline: a client that announces a token
        // and never sends it holds a connection slot for at most this long.
        let deadline = tokio::time::Instant::now() + HELLO_TIMEOUT;
        let mut h = [0u8; HELLO_LEN];
        hello_in_time(tokio::time::timeout_at(deadline, self.rd.read_exact(&mut h)).await)?;
        let hello = match Hello::decode(&h) {
            Ok(h) => h,
            Err(e) => {
                error("dataplane_bad_hello");
                self.wr.write_all(&HelloReply::encode(Status::BadRequest, &e.to_string())).await?;
                self.wr.flush().await?;
                return Err(ConnError::Protocol(e.to_string()));
            }
        };
        let mut token = vec![0u8; hello.token_len as usize];
        hello_in_time(tokio::time::timeout_at(deadline, self.rd.read_exact(&mut token)).await)?;
        if !(MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&hello.version) {
            let msg = format!(
                "data-plane protocol {} is not supported; this server speaks {MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION}",
                hello.version
            );
            self.wr.write_all(&HelloReply::encode(Status::UnsupportedVersion, &msg)).await?;
            self.wr.flush().await?;
            return Err(ConnError::Protocol(msg));
        }
        let presented = (!token.is_empty()).then_some(&token[..]);
        let principal = match self.state.tenants().resolve(&self.cert, presented) {
            Ok(p) => p,
            Err(why) => {
                error("unauthenticated");
                self.wr.write_all(&HelloReply::encode(Status::Unauthenticated, &why.to_string())).await?;
                self.wr.flush().await?;
                return Err(ConnError::Protocol("unauthenticated".into()));
            }
        };
        let max = self.state.config().max_connections_per_tenant;
        self._tenant_slot = match crate::tenants::connection_slot(&principal, max, "data plane") {
            Ok(slot) => slot,
            Err(why) => {
                tracing::debug!("data-plane connection refused: {why}");
                let answer = HelloReply::encode(Status::TooManyConnections, &format!("connection refused: {why}"));
                self.wr.write_all(&answer).await?;
                self.wr.flush().await?;
                return Err(ConnError::Protocol(why));
            }
        };
        self.wr.write_all(&HelloReply::encode(Status::Ok, concat!("kvtier ", env!("CARGO_PKG_VERSION")))).await?;
        self.wr.flush().await?;
        self.version = hello.version;
        Ok(principal)
    }

    /// Answers with a request-level error and ends the connection (its framing can't be trusted).
    async fn fatal(&mut self, op: u8, request_id: u32, status: Status, msg: &str) -> Result<(), ConnError> {
        error("dataplane_protocol");
        self.wr.write_all(&ResponseHeader::error(op, request_id, status, msg)).await?;
        self.wr.flush().await?;
        Err(ConnError::Protocol(msg.to_string()))
    }

    /// Reads and discards `n` payload bytes so the stream stays in step.
    async fn drain(&mut self, mut n: u64) -> Result<(), ConnError> {
        if self.scratch.is_empty() {
            self.scratch = vec![0u8; IO_BUF];
        }
        while n > 0 {
            let k = n.min(self.scratch.len() as u64) as usize;
            self.rd.read_exact(&mut self.scratch[..k]).await?;
            n -= k as u64;
        }
        Ok(())
    }

    async fn put(&mut self, req: RequestHeader) -> Result<(), ConnError> {
        let start = Instant::now();
        let mut statuses = Vec::with_capacity(req.count as usize);
        let report = req.flags & FLAG_REPORT_PRESENT != 0;
        let mut codecs = Vec::with_capacity(if report { 2 * req.count as usize } else { 0 });
        // In a cluster, a client's fresh blocks go on to their other owners; elsewhere nothing is kept.
        let forward = req.flags & FLAG_PEER == 0 && self.state.tiers().has_remote();
        let after = req.flags & FLAG_CHECKSUM_AFTER != 0;
        let mut stored: Vec<(NamespaceId, BlockKey)> = Vec::new();
        for i in 0..req.count {
            let mut fh = [0u8; FRAME_HEADER_LEN];
            self.rd.read_exact(&mut fh).await.inspect_err(|_| error("dataplane_truncated"))?;
            let header = match FrameHeader::decode(&fh) {
                Ok(h) => h,
                Err(e) => {
                    let msg = format!("frame {i}: {e}; the stream can't be resynchronised");
                    return self.fatal(Op::Put as u8, req.request_id, Status::BadRequest, &msg).await;
                }
            };
            let max = self.state.config().max_frame_bytes.0;
            if header.payload_len > max {
                let msg = ProtoError::PayloadTooLarge { actual: header.payload_len, limit: max }.to_string();
                return self.fatal(Op::Put as u8, req.request_id, Status::TooLarge, &format!("frame {i}: {msg}")).await;
            }
            self.moved = u64::MAX;
            let mut status = match self.put_one(&header, forward, after).await {
                Err(ConnError::PayloadLate(deadline)) => {
                    error("dataplane_frame_timeout");
                    let msg = format!(
                        "frame {i}: its {} payload bytes did not arrive within lease_timeout ({deadline:?})",
                        header.payload_len
                    );
                    return self.fatal(Op::Put as u8, req.request_id, Status::BadRequest, &msg).await;
                }
                status => status?,
            };
            let fresh = status == ItemStatus::Ok;
            if status == ItemStatus::Present && req.flags & FLAG_REPORT_PRESENT == 0 {
                status = ItemStatus::Ok;
            }
            // Over the pinned limit, evicted in the instant since it was stored, or past the
            // connection's lease count.
            if status.is_held() && req.flags & FLAG_PIN_LEASE != 0 && !self.leases.pin(header.namespace, header.key) {
                status = ItemStatus::Capacity;
            }
            if !status.is_held() {
                error(item_kind(status));
            } else if fresh && forward {
                stored.push((header.namespace, header.key));
            }
            if report {
                let codec = match status {
                    ItemStatus::Ok => Some(header.codec),
                    ItemStatus::Present => self.state.tiers().held_codec(&header.namespace, &header.key),
                    _ => None,
                };
                codecs.extend_from_slice(&codec.map_or(NO_CODEC, |c| c.0).to_le_bytes());
            }
            statuses.push(status as u8);
        }
        let h = ResponseHeader::ok(Op::Put, req.request_id, req.count).alone(self.alone);
        self.wr.write_all(&h.encode()).await?;
        self.wr.write_all(&statuses).await?;
        self.wr.write_all(&codecs).await?;
        if forward {
            forward_to_peers(&self.state, stored);
        }
        observe("dataplane_put", start);
        Ok(())
    }

    /// One frame of a `PUT`; `relayed`: a client's store in a cluster (kept at
    /// [`NodeState::store_priority`]), else a peer's (kept at normal priority); `after`: its
    /// checksum follows the payload ([`FLAG_CHECKSUM_AFTER`]) instead of being in `sent`.
    async fn put_one(&mut self, sent: &FrameHeader, relayed: bool, after: bool) -> Result<ItemStatus, ConnError> {
        let principal = self.principal()?;
        // What follows the frame header: the payload, then its checksum when it comes after.
        // It arrives within `lease_timeout` (a slot's lease ends then), or the connection ends:
        // a payload trickled in under the stall timeout would hold a connection slot, and a
        // lease, for as long as the sender liked. The server's own waits don't count.
        let body = sent.payload_len + if after { CHECKSUM_LEN as u64 } else { 0 };
        let late = self.state.config().lease_timeout.0;
        let mut header = match self.state.admit_frame(&principal, sent) {
            Ok(h) => h,
            Err(status) => {
                tokio::time::timeout(late, self.drain(body)).await.map_err(|_| ConnError::PayloadLate(late))??;
                return Ok(status);
            }
        };
        if self.state.tiers().is_hot(&header.namespace, &header.key) {
            // Content-addressed: the same key is the same bytes. Skip the copy.
            tokio::time::timeout(late, self.drain(body)).await.map_err(|_| ConnError::PayloadLate(late))??;
            return Ok(ItemStatus::Present);
        }
        self.state.tiers().backpressure().await;
        let tier = self.state.tiers();
        let mut slot = match tier.reserve(&header.namespace, header.payload_len as usize) {
            Ok(s) => s,
            Err(e) => {
                tokio::time::timeout(late, self.drain(body)).await.map_err(|_| ConnError::PayloadLate(late))??;
                return Ok(match e {
                    ServerError::Capacity(_) | ServerError::TooLarge { .. } => ItemStatus::Capacity,
                    _ => ItemStatus::Internal,
                });
            }
        };
        // The payload comes in pieces; polled for while this connection has the node to itself.
        self.rd.get_mut().get_mut().arm_streaming(if self.poll.is_zero() { Duration::ZERO } else { PAYLOAD_GAP });
        // A stream that ends here drops `slot`, which returns it unpublished.
        let rd = &mut self.rd;
        let payload = async {
            let sum = read_hashed(rd, slot.buf_mut()).await.inspect_err(|_| error("dataplane_truncated"));
            match sum {
                Ok(sum) if after => {
                    let mut trailer = [0u8; CHECKSUM_LEN];
                    let read = rd.read_exact(&mut trailer).await.inspect_err(|_| error("dataplane_truncated"));
                    read.map(|_| (sum, Some(u64::from_le_bytes(trailer))))
                }
                other => other.map(|sum| (sum, None)),
            }
        };
        let read = tokio::time::timeout(late, payload).await;
        self.rd.get_mut().get_mut().poller().disarm();
        let (sum, trailer) = read.map_err(|_| ConnError::PayloadLate(late))??;
        if let Some(t) = trailer {
            header.checksum = t;
        }
        if sum != header.checksum {
            return Ok(ItemStatus::ChecksumMismatch);
        }
        let priority = if relayed { self.state.store_priority(&header) } else { Priority::Normal };
        Ok(match tier.commit(slot, header, priority) {
            Ok(_) => ItemStatus::Ok,
            Err(ServerError::Capacity(_) | ServerError::TooLarge { .. }) => ItemStatus::Capacity,
            Err(_) => ItemStatus::Internal,
        })
    }

    /// Reads the keys of a `GET` or `EXISTS`; `None` (answered already) when the namespace is
    /// unknown or not the connection's tenant's to read.
    async fn read_keys(&mut self, req: &RequestHeader) -> Result<Option<Vec<u8>>, ConnError> {
        let mut raw = vec![0u8; req.count as usize * KEY_LEN];
        self.rd.read_exact(&mut raw).await?;
        let principal = self.principal()?;
        let refusal = match self.state.check_namespace(&principal, &req.namespace, Access::Read) {
            Ok(()) => return Ok(Some(raw)),
            Err(ItemStatus::Forbidden) => {
                (Status::Forbidden, format!("tenant {:?} may not read this namespace", principal.name()))
            }
            Err(_) => {
                error("unknown_namespace");
                (Status::UnknownNamespace, ServerError::UnknownNamespace(req.namespace).to_string())
            }
        };
        let answer = ResponseHeader::error(req.op as u8, req.request_id, refusal.0, &refusal.1);
        self.wr.write_all(&answer).await?;
        Ok(None)
    }

    async fn get(&mut self, req: RequestHeader) -> Result<(), ConnError> {
        let start = Instant::now();
        let Some(raw) = self.read_keys(&req).await? else { return Ok(()) };
        let ns: NamespaceId = req.namespace;
        // In a cluster: what no local tier holds, from its owners (bounded by `peer_timeout`),
        // in chunks running ahead of this answer.
        let mut remote = peer_fetch(&self.state, &req, &raw);
        // Blocks only a GPU agent's G1 holds: asked for all at once, so their spills overlap;
        // each key's read below joins its demand. Released when the answer is done.
        let state = self.state.clone();
        let _from_g1 = state.tiers().demand_ahead(&ns, &raw);
        let h = ResponseHeader::ok(Op::Get, req.request_id, req.count).alone(self.alone);
        self.wr.write_all(&h.encode()).await?;
        let stop_at_miss = req.flags & FLAG_STOP_AT_MISS != 0;
        let mut missed = false;
        for key in block_keys(&raw) {
            if missed && stop_at_miss {
                self.wr.write_all(&[ItemStatus::Miss as u8]).await?;
                continue;
            }
            // A disk read runs on the I/O pool; a saturated pool (`Busy`) answers a miss. A DRAM
            // hit comes unchecked and is checked once it has been sent (see below).
            // A block planned from the peers is taken from the fetch first (counted there).
            let fetched = match remote.planned(&key) {
                true => remote.take_planned(&key).await,
                false => None,
            };
            let (load, unchecked) = match fetched {
                Some(b) => (Load::Hit(b), false),
                None => match self.state.tiers().get_to_check(&ns, &key).await {
                    (Load::Hit(b), unchecked) => (Load::Hit(b), unchecked),
                    (other, _) => (remote.take(&key).await.map_or(other, Load::Hit), false),
                },
            };
            match load {
                Load::Hit(b) => {
                    self.wr.write_all(&[ItemStatus::Ok as u8]).await?;
                    self.wr.write_all(&b.header.encode()).await?;
                    self.wr.write_all(&b.payload).await?;
                    self.moved += b.payload.len() as u64;
                    // Checked after it left, while the client receives it: the client verifies
                    // every block against the header's checksum (a mismatch is a miss there,
                    // never data), so the check here only finds a block damaged in DRAM and
                    // drops it, and it need not delay the bytes.
                    if unchecked && b.header.verify_payload(&b.payload).is_err() {
                        self.state.tiers().drop_corrupt(&ns, &key);
                    }
                }
                Load::Busy | Load::Miss => {
                    self.wr.write_all(&[ItemStatus::Miss as u8]).await?;
                    missed = true;
                }
            }
        }
        observe("dataplane_get", start);
        Ok(())
    }

    /// Per-key presence in any tier, without reading a payload.
    async fn exists(&mut self, req: RequestHeader) -> Result<(), ConnError> {
        let start = Instant::now();
        let Some(raw) = self.read_keys(&req).await? else { return Ok(()) };
        let ns: NamespaceId = req.namespace;
        let keys: Vec<BlockKey> = block_keys(&raw).collect();
        // A client's question in a cluster is answered for the cluster (the owners of what no
        // local tier holds are asked); a peer's, for this node.
        let held = match self.state.namespace(&ns) {
            Ok(spec) if req.flags & FLAG_PEER == 0 && self.state.tiers().has_remote() => {
                self.state.tiers().exists_with_peers(&spec, &keys).await
            }
            _ => self.state.tiers().exists(&ns, &keys),
        };
        let statuses: Vec<u8> =
            held.into_iter().map(|held| if held { ItemStatus::Ok as u8 } else { ItemStatus::Miss as u8 }).collect();
        let h = ResponseHeader::ok(Op::Exists, req.request_id, req.count).alone(self.alone);
        self.wr.write_all(&h.encode()).await?;
        self.wr.write_all(&statuses).await?;
        observe("dataplane_exists", start);
        Ok(())
    }
}

/// For a `GET` from a client (not from a peer): the requested blocks no local tier holds,
/// loaded from their owners ahead of the answer (see `crate::cluster::fetch`). Nothing outside a
/// cluster.
fn peer_fetch(state: &Arc<NodeState>, req: &RequestHeader, raw: &[u8]) -> crate::cluster::fetch::PeerFetch {
    let ns = (req.flags & FLAG_PEER == 0).then(|| state.namespace(&req.namespace).ok()).flatten();
    let keys: Vec<BlockKey> = if ns.is_some() { block_keys(raw).collect() } else { Vec::new() };
    crate::cluster::fetch::PeerFetch::start(state, ns, &keys)
}

/// The keys of a `GET`, `EXISTS` or `LEASE_GET`, as they came (`KEY_LEN` bytes each).
fn block_keys(raw: &[u8]) -> impl Iterator<Item = BlockKey> + '_ {
    raw.chunks_exact(KEY_LEN).map(|chunk| {
        let mut k = [0u8; KEY_LEN];
        k.copy_from_slice(chunk);
        BlockKey(k)
    })
}

/// Queues the blocks a client's `PUT` (or a same-node store) just stored for their other owners
/// (per namespace); nothing outside a cluster. Blocks evicted within the store (a tenant's
/// quota, a full DRAM) are read back from disk in the background and forwarded then.
pub(crate) fn forward_to_peers(state: &Arc<NodeState>, mut stored: Vec<(NamespaceId, BlockKey)>) {
    if stored.is_empty() || !state.tiers().has_remote() {
        return;
    }
    let stored_at = std::time::Instant::now();
    stored.sort_unstable_by_key(|(ns, _)| ns.0);
    for group in stored.chunk_by(|a, b| a.0 == b.0) {
        let Ok(ns) = state.namespace(&group[0].0) else { continue };
        let keys: Vec<BlockKey> = group.iter().map(|(_, k)| *k).collect();
        let gone = state.tiers().forward_to_peers(ns.clone(), &keys);
        if gone.is_empty() {
            continue;
        }
        let Some(permit) = state.tiers().forward_read_permit() else {
            state.tiers().forward_dropped(gone.len() as u64);
            continue;
        };
        let state = state.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let id = ns.id();
            let mut read = Vec::with_capacity(gone.len());
            for k in &gone {
                if let crate::tiers::Load::Hit(b) = state.tiers().get_for_node(&id, k).await {
                    read.push(b);
                }
            }
            state.tiers().forward_dropped((gone.len() - read.len()) as u64);
            state.tiers().forward_blocks(ns, read, stored_at);
        });
    }
}

fn item_kind(s: ItemStatus) -> &'static str {
    match s {
        ItemStatus::Ok => "ok",
        ItemStatus::Miss => "miss",
        ItemStatus::ChecksumMismatch => "checksum_mismatch",
        ItemStatus::SizeMismatch => "size_mismatch",
        ItemStatus::UnknownNamespace => "unknown_namespace",
        ItemStatus::Capacity => "capacity",
        ItemStatus::LayoutMismatch => "layout_mismatch",
        ItemStatus::BadHeader => "bad_header",
        ItemStatus::Internal => "internal",
        ItemStatus::LossyCodec => "lossy_codec",
        ItemStatus::Present => "present",
        ItemStatus::OutOfRange => "out_of_range",
        ItemStatus::Forbidden => "forbidden",
        ItemStatus::NoLease => "no_lease",
        ItemStatus::Elsewhere => "elsewhere",
    }
}

/// Fills `buf` from the stream, hashing each piece as it lands (still in cache, while the
/// rest is on its way), and returns the checksum of the whole. Hashing after the last byte
/// put a pass over the block between the receive and the answer.
async fn read_hashed<R: AsyncRead + Unpin>(rd: &mut R, buf: &mut [u8]) -> std::io::Result<u64> {
    let mut sum = kvtier_proto::Checksummer::new();
    let mut at = 0;
    while at < buf.len() {
        let n = rd.read(&mut buf[at..]).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        sum.update(&buf[at..at + n]);
        at += n;
    }
    Ok(sum.digest())
}

/// How long a `PUT`'s payload is polled for after each piece of it arrives (while the
/// connection has the node to itself, `dataplane_poll` not `"0"`); a longer gap parks.
const PAYLOAD_GAP: Duration = Duration::from_micros(100);

/// Loads that answered up to this many payload bytes are followed by polling for the next
/// request (`dataplane_poll`, [`spin`]).
const POLL_AFTER_BYTES: u64 = 256 << 10;
