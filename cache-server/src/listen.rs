//! The accept loop every listener shares (data plane, same-node socket, gRPC): connections are
//! bounded in total and per peer (an IP address, or a local user on a Unix socket), a peer over
//! its share is refused at once and counted, and told why in its protocol's terms (the data
//! plane's and the same-node socket's hello answer, an HTTP/2 GOAWAY on gRPC), a failed accept (out of descriptors) backs off instead
//! of spinning, and every connection ends when the node stops. TLS handshakes run inside a
//! connection's own task, never in the accept loop, and so does the wait for a gRPC client's
//! HTTP/2 preface: a connection that sends none within [`PREFACE_TIMEOUT`] is closed, so silent
//! sockets can't hold the listener's slots (tonic would wait for a preface forever).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::watch;

use crate::stopped;
use crate::tenants::CertIdentity;

/// Who a connection comes from, for the per-peer limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Peer {
    Ip(IpAddr),
    /// A local user (a Unix socket's peer credentials).
    Uid(u32),
    /// Not known (a stream handed in by an embedder): limited by the total only.
    Unknown,
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Peer::Ip(ip) => write!(f, "{ip}"),
            Peer::Uid(uid) => write!(f, "local user {uid}"),
            Peer::Unknown => f.write_str("an unknown peer"),
        }
    }
}

/// One connection served, counted in `kvtier_connections_open{listener}` for as long as it lives
/// (however its task ends: finished, or aborted when the node stops).
struct OpenConnection(&'static str);

impl OpenConnection {
    fn new(listener: &'static str) -> Self {
        metrics::gauge!("kvtier_connections_open", "listener" => listener).increment(1.0);
        OpenConnection(listener)
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        metrics::gauge!("kvtier_connections_open", "listener" => self.0).decrement(1.0);
    }
}

/// How often refused connections are said in the log (with their count since).
const REFUSALS_SAID_EVERY: Duration = Duration::from_secs(10);

/// Refused connections being told why at once, at most; past that they are closed unanswered.
const MAX_REFUSING: usize = 32;

/// How long a refused connection has to take its answer (and again to close).
pub(crate) const REFUSE_WAIT: Duration = Duration::from_secs(1);

/// A refusal for the protocols that open with a hello answered by a
/// [`HelloReply`](kvtier_proto::dataplane::HelloReply) (the data plane, the same-node socket):
/// the answer `TooManyConnections` with `why`, sent without waiting for the hello, then the
/// client's bytes read and dropped until it closes (closing on unread bytes would reset the
/// connection, and the reset could take the answer with it), each within [`REFUSE_WAIT`].
pub(crate) async fn refuse_with_hello_reply<R, W>(mut r: R, mut w: W, why: String)
where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    use kvtier_proto::dataplane::{HelloReply, Status};
    use tokio::io::AsyncWriteExt;
    let answer = HelloReply::encode(Status::TooManyConnections, &format!("connection refused: {why}"));
    let told = async {
        w.write_all(&answer).await?;
        w.shutdown().await
    };
    if matches!(tokio::time::timeout(REFUSE_WAIT, told).await, Ok(Ok(()))) {
        drain_until_closed(&mut r).await;
    }
}

/// Reads and drops what a refused client still sends until it closes (closing on unread bytes
/// would reset the connection, and the reset could take the answer with it): at most 64 KiB,
/// within [`REFUSE_WAIT`].
async fn drain_until_closed<R: tokio::io::AsyncRead + Unpin + ?Sized>(r: &mut R) {
    use tokio::io::AsyncReadExt;
    let drained = async {
        let (mut buf, mut left) = ([0u8; 4096], 64usize << 10);
        while left > 0 {
            match r.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    };
    let _ = tokio::time::timeout(REFUSE_WAIT, drained).await;
}

/// Reads the client's HTTP/2 frames up to its first request's HEADERS (at most 64 KiB of them):
/// a GOAWAY that reaches an HTTP/2 client before it sent its request finds that request still
/// queued, and the client reports a connection closed under it, not the refusal. A client that
/// sends no request (or closes) ends the wait.
async fn read_until_first_request<R: tokio::io::AsyncRead + Unpin + ?Sized>(r: &mut R) -> std::io::Result<()> {
    use tokio::io::AsyncReadExt;
    const HEADERS: u8 = 0x1;
    let mut left = 64usize << 10;
    loop {
        let mut head = [0u8; 9];
        r.read_exact(&mut head).await?;
        if head[3] == HEADERS {
            return Ok(());
        }
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        left = left.checked_sub(9 + len).ok_or(std::io::ErrorKind::InvalidData)?;
        let skipped = tokio::io::copy(&mut (&mut *r).take(len as u64), &mut tokio::io::sink()).await?;
        if skipped < len as u64 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
}

/// How many connections one listener serves at once.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// In total; more wait in the kernel's backlog.
    pub total: usize,
    /// From one peer; more are closed on arrival (`kvtier_connections_refused_total`).
    pub per_peer: usize,
}

/// Live connections per peer.
#[derive(Default)]
struct PeerCounts(Mutex<HashMap<Peer, usize>>);

impl PeerCounts {
    /// Counts one more connection from `peer`; false (nothing counted) when it has `max`.
    fn admit(&self, peer: Peer, max: usize) -> bool {
        if peer == Peer::Unknown {
            return true;
        }
        let mut m = self.0.lock();
        let n = m.entry(peer).or_default();
        if *n >= max {
            return false;
        }
        *n += 1;
        true
    }

    fn release(&self, peer: Peer) {
        let mut m = self.0.lock();
        if let Some(n) = m.get_mut(&peer) {
            *n -= 1;
            if *n == 0 {
                m.remove(&peer);
            }
        }
    }
}

/// Takes connections from `accept` within `limits` and runs `serve` on each until `stop` turns
/// true; then ends every connection before returning. A connection over its peer's share is
/// handed to `refuse` with the reason (in a task of its own, [`MAX_REFUSING`] at once).
pub(crate) async fn accept_bounded<C, A, F, S, G, R, H>(
    what: &'static str,
    limits: ConnLimits,
    mut stop: watch::Receiver<bool>,
    mut accept: A,
    serve: S,
    refuse: R,
) where
    A: FnMut() -> F,
    F: std::future::Future<Output = std::io::Result<(C, Peer)>>,
    S: Fn(C, watch::Receiver<bool>) -> G,
    G: std::future::Future<Output = ()> + Send + 'static,
    R: Fn(C, String) -> H,
    H: std::future::Future<Output = ()> + Send + 'static,
{
    let permits = Arc::new(tokio::sync::Semaphore::new(limits.total.max(1)));
    let peers = Arc::new(PeerCounts::default());
    let refusing = Arc::new(tokio::sync::Semaphore::new(MAX_REFUSING));
    let mut refusals = tokio::task::JoinSet::new();
    // Refusals are said at WARN, at most once per REFUSALS_SAID_EVERY, with how many.
    let said = crate::metrics::LogThrottle::new(REFUSALS_SAID_EVERY);
    let mut conns = tokio::task::JoinSet::new();
    let mut permit = None;
    loop {
        let held = match permit.take() {
            Some(p) => p,
            None => tokio::select! {
                _ = stopped(&mut stop) => break,
                p = permits.clone().acquire_owned() => match p {
                    Ok(p) => p,
                    Err(_) => break,
                },
            },
        };
        let accepted = tokio::select! {
            _ = stopped(&mut stop) => break,
            a = accept() => a,
        };
        let (conn, peer) = match accepted {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("{what} accept: {e}");
                permit = Some(held);
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        if !peers.admit(peer, limits.per_peer) {
            // Closed on arrival: the slot goes to the next connection.
            metrics::counter!("kvtier_connections_refused_total", "listener" => what, "reason" => "per_peer")
                .increment(1);
            if let Some(held_back) = said.allow() {
                tracing::warn!(
                    %peer,
                    "{what}: refused {} connection(s) over max_connections_per_peer ({}) since this was last \
                     said; the last from {peer}",
                    held_back + 1,
                    limits.per_peer
                );
            }
            match refusing.clone().try_acquire_owned() {
                Ok(p) => {
                    let why = format!(
                        "{peer} has {} connections to this {what} listener already (max_connections_per_peer)",
                        limits.per_peer
                    );
                    let told = refuse(conn, why);
                    refusals.spawn(async move {
                        told.await;
                        drop(p);
                    });
                }
                Err(_) => drop(conn),
            }
            while refusals.try_join_next().is_some() {}
            permit = Some(held);
            continue;
        }
        let task = serve(conn, stop.clone());
        let peers = peers.clone();
        let open = OpenConnection::new(what);
        conns.spawn(async move {
            task.await;
            peers.release(peer);
            drop(held);
            drop(open);
        });
        while conns.try_join_next().is_some() {}
    }
    refusals.shutdown().await;
    conns.shutdown().await;
}

/// How long a gRPC connection has to send the HTTP/2 preface once accepted (once its TLS
/// handshake is done, under TLS): as long as a data-plane client has for its hello. And then, as
/// long again to make its first call with a credential the node takes.
pub const PREFACE_TIMEOUT: Duration = Duration::from_secs(10);

/// What every HTTP/2 client sends first (RFC 9113, 3.4).
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// A gRPC connection handed to tonic (plain TCP or TLS): it holds its slot (total and per peer)
/// until tonic drops it. Its HTTP/2 preface was read (and checked) before; its first reads give
/// it back to tonic.
pub struct GrpcConn {
    inner: GrpcStream,
    info: GrpcPeer,
    /// How much of [`H2_PREFACE`] tonic has read back.
    preface_read: usize,
    /// Until a call of the connection is authenticated: when it is closed without one (a
    /// connection that only answers the server's pings held a slot until its hour was up,
    /// credential or not).
    first_call_by: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    /// Closed once it has had no call in flight for this long (`idle_timeout`), looked at when
    /// `idle_check` fires: first told so by a GOAWAY of the listener's own (see
    /// [`GrpcConn::idle_out`]), then closed [`GOAWAY_GRACE`] later with no call in flight.
    idle_timeout: Duration,
    idle_check: std::pin::Pin<Box<tokio::time::Sleep>>,
    /// Whether tonic's last write-side call was a flush that completed, with no write since: h2
    /// flushes only once all it buffered is written, so a frame of our own fits in here.
    between_frames: bool,
    /// The idle GOAWAY, and how much of it is written.
    own_frame: Option<([u8; 17], usize)>,
    /// When the idle GOAWAY was written whole.
    goaway_at: Option<std::time::Instant>,
    _slot: tokio::sync::oneshot::Sender<()>,
}

impl GrpcStream {
    /// Reads the client's first 24 bytes within `within`: `Ok` if they are the HTTP/2 preface;
    /// otherwise why the connection is closed (also the `kvtier_errors_total` kind).
    async fn read_preface(&mut self, within: Duration) -> Result<(), (&'static str, String)> {
        use tokio::io::AsyncReadExt;
        let mut got = [0u8; H2_PREFACE.len()];
        match tokio::time::timeout(within, self.io().read_exact(&mut got)).await {
            Err(_) => Err(("grpc_preface_timeout", format!("no HTTP/2 preface within {within:?}"))),
            Ok(Err(e)) => Err(("grpc_preface_io", format!("closed before its HTTP/2 preface: {e}"))),
            Ok(Ok(_)) if &got != H2_PREFACE => {
                Err(("grpc_not_http2", "its first bytes are not an HTTP/2 preface (not a gRPC client)".into()))
            }
            Ok(Ok(_)) => Ok(()),
        }
    }
}

enum GrpcStream {
    Plain(tokio::net::TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<tokio::net::TcpStream>>),
}

/// HTTP/2 `ENHANCE_YOUR_CALM` (RFC 9113, 7): what a refused gRPC connection's GOAWAY says.
pub const H2_ENHANCE_YOUR_CALM: u32 = 0xb;

impl GrpcStream {
    /// Refuses the connection in HTTP/2's terms: once the client's preface is read, the server's
    /// (empty) SETTINGS; once the client sent its first request (see
    /// [`read_until_first_request`]), a GOAWAY with `ENHANCE_YOUR_CALM` and `why` as its debug
    /// data (last stream 0: the request was not taken); then the client's bytes drained until it
    /// closes. Each step within [`REFUSE_WAIT`], the wait for the request within
    /// [`PREFACE_TIMEOUT`].
    async fn refuse(mut self, why: String) {
        use tokio::io::AsyncWriteExt;
        if self.read_preface(REFUSE_WAIT).await.is_err() {
            return;
        }
        let frame = |kind: u8, payload: &[u8]| {
            let mut f = Vec::with_capacity(9 + payload.len());
            f.extend_from_slice(&(payload.len() as u32).to_be_bytes()[1..]);
            f.extend_from_slice(&[kind, 0, 0, 0, 0, 0]);
            f.extend_from_slice(payload);
            f
        };
        let debug = format!("{}: connection refused: {why}", kvtier_proto::codes::TOO_MANY_CONNECTIONS);
        let debug = &debug.as_bytes()[..debug.len().min(1024)];
        let mut goaway = Vec::with_capacity(8 + debug.len());
        goaway.extend_from_slice(&0u32.to_be_bytes()); // last stream id: none was taken
        goaway.extend_from_slice(&H2_ENHANCE_YOUR_CALM.to_be_bytes());
        goaway.extend_from_slice(debug);
        let io = self.io();
        let settings = async {
            io.write_all(&frame(0x4, &[])).await?;
            io.flush().await
        };
        if !matches!(tokio::time::timeout(REFUSE_WAIT, settings).await, Ok(Ok(()))) {
            return;
        }
        // As long as a client has for its preface: a client stalled past a second (a loaded
        // host) would otherwise get the GOAWAY ahead of its request again.
        let _ = tokio::time::timeout(PREFACE_TIMEOUT, read_until_first_request(io)).await;
        let told = async {
            io.write_all(&frame(0x7, &goaway)).await?;
            io.shutdown().await
        };
        if matches!(tokio::time::timeout(REFUSE_WAIT, told).await, Ok(Ok(()))) {
            drain_until_closed(io).await;
        }
    }

    /// The connection's bytes, under TLS or not.
    fn io(&mut self) -> &mut (dyn GrpcIo + '_) {
        match self {
            GrpcStream::Plain(s) => s,
            GrpcStream::Tls(s) => s.as_mut(),
        }
    }
}

/// What a gRPC connection's byte stream is (plain TCP or TLS over it).
trait GrpcIo: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> GrpcIo for T {}

/// What every gRPC call of a connection finds in its request's extensions.
#[derive(Debug, Clone)]
pub struct GrpcPeer {
    pub remote: std::net::SocketAddr,
    /// Whom the connection's verified TLS client certificate stands for.
    pub cert: CertIdentity,
    /// Its calls: admitted by the credential check, counted while in flight.
    pub calls: Arc<crate::grpc_calls::ConnCalls>,
}

/// The gRPC listener's connections, within `limits` (over TLS with `tls`, the handshake in the
/// connection's own task), as the stream tonic serves: a connection keeps its slot until tonic
/// drops it. `cert_principal` maps a client certificate's names to whom they stand for.
pub(crate) fn grpc_incoming(
    listener: tokio::net::TcpListener,
    limits: ConnLimits,
    idle_timeout: Duration,
    stop: watch::Receiver<bool>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    cert_principal: impl Fn(&[String]) -> CertIdentity + Send + Sync + 'static,
) -> (tokio_stream::wrappers::ReceiverStream<std::io::Result<GrpcConn>>, tokio::task::JoinHandle<()>) {
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let cert_principal = Arc::new(cert_principal);
    let task = tokio::spawn(async move {
        accept_bounded(
            "grpc",
            limits,
            stop,
            || async {
                let (sock, peer) = listener.accept().await?;
                // tonic does not apply its own `tcp_nodelay` to sockets given through
                // `serve_with_incoming`: without this, small answers (a lookup, a resume
                // manifest) wait ~40 ms for Nagle + delayed ACK.
                let _ = sock.set_nodelay(true);
                Ok(((sock, peer), Peer::Ip(peer.ip())))
            },
            |(sock, remote), _stop| {
                let (tx, tls, cert_principal) = (tx.clone(), tls.clone(), cert_principal.clone());
                async move {
                    let (mut inner, cert) = match tls {
                        None => (GrpcStream::Plain(sock), Default::default()),
                        Some(acceptor) => match crate::tls::accept(&acceptor, sock).await {
                            Ok((stream, names)) => (GrpcStream::Tls(Box::new(stream)), cert_principal(&names)),
                            Err(e) => {
                                tracing::debug!(%remote, "gRPC TLS handshake failed: {e}");
                                return;
                            }
                        },
                    };
                    if let Err((kind, why)) = inner.read_preface(PREFACE_TIMEOUT).await {
                        crate::metrics::error(kind);
                        tracing::debug!(%remote, "gRPC connection closed: {why}");
                        return;
                    }
                    let (slot, freed) = tokio::sync::oneshot::channel();
                    let conn = GrpcConn {
                        inner,
                        info: GrpcPeer { remote, cert, calls: Arc::default() },
                        preface_read: 0,
                        first_call_by: Some(Box::pin(tokio::time::sleep(PREFACE_TIMEOUT))),
                        idle_timeout,
                        idle_check: Box::pin(tokio::time::sleep(idle_timeout)),
                        between_frames: true,
                        own_frame: None,
                        goaway_at: None,
                        _slot: slot,
                    };
                    if tx.send(Ok(conn)).await.is_ok() {
                        // Resolves (with an error) when tonic drops the connection.
                        let _ = freed.await;
                    }
                }
            },
            // Told why in HTTP/2's own terms: after the client's preface, a GOAWAY.
            |(sock, _remote), why| {
                let tls = tls.clone();
                async move {
                    let stream = match tls {
                        None => GrpcStream::Plain(sock),
                        Some(acceptor) => {
                            match tokio::time::timeout(REFUSE_WAIT, crate::tls::accept(&acceptor, sock)).await {
                                Ok(Ok((stream, _))) => GrpcStream::Tls(Box::new(stream)),
                                _ => return,
                            }
                        }
                    };
                    stream.refuse(why).await;
                }
            },
        )
        .await
    });
    (tokio_stream::wrappers::ReceiverStream::new(rx), task)
}

impl tokio::io::AsyncRead for GrpcConn {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if self.preface_read < H2_PREFACE.len() {
            let this = self.get_mut();
            let n = (H2_PREFACE.len() - this.preface_read).min(buf.remaining());
            buf.put_slice(&H2_PREFACE[this.preface_read..this.preface_read + n]);
            this.preface_read += n;
            return std::task::Poll::Ready(Ok(()));
        }
        let this = self.as_mut().get_mut();
        if let Some(by) = &mut this.first_call_by {
            if this.info.calls.authenticated() {
                this.first_call_by = None;
            } else if std::future::Future::poll(by.as_mut(), cx).is_ready() {
                crate::metrics::error("grpc_no_call");
                tracing::debug!(remote = %this.info.remote, "gRPC connection closed: no authenticated call");
                return std::task::Poll::Ready(Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no call with a credential this node takes within {PREFACE_TIMEOUT:?}"),
                )));
            }
        }
        let read = std::pin::Pin::new(this.inner.io()).poll_read(cx, buf);
        if read.is_pending() && this.idle_out(cx) {
            // Read as the client's end of the stream: HTTP/2 ends a connection with no stream
            // open quietly, and the client, told GOAWAY, opens its next call on a new one.
            return std::task::Poll::Ready(Ok(()));
        }
        read
    }
}

/// How long an idle connection told GOAWAY has to take it in before it is closed: the calls it
/// opened before it read the GOAWAY are answered first.
pub const GOAWAY_GRACE: Duration = Duration::from_secs(2);

/// HTTP/2 GOAWAY (RFC 9113, 6.8) as a server opens a graceful close: last stream 2^31-1 (every
/// stream the client opened so far will be served), NO_ERROR.
const IDLE_GOAWAY: [u8; 17] = [0, 0, 8, 0x7, 0, 0, 0, 0, 0, 0x7f, 0xff, 0xff, 0xff, 0, 0, 0, 0];

impl GrpcConn {
    /// Whether the connection, with nothing to read now, is to be closed for being idle. Once it
    /// has had no call in flight for `idle_timeout`, it is told GOAWAY, so its client opens no
    /// new call on it (a call sent as the connection closed would be lost, and tonic's channels
    /// retry none); closed once [`GOAWAY_GRACE`] has passed with no call in flight. The checks
    /// are set for when the next could change something.
    fn idle_out(&mut self, cx: &mut std::task::Context<'_>) -> bool {
        self.write_own(cx);
        while std::future::Future::poll(self.idle_check.as_mut(), cx).is_ready() {
            let next = match (self.info.calls.idle_for(), self.goaway_at) {
                (None, _) => self.idle_timeout.min(GOAWAY_GRACE),
                (Some(idle), None) if idle < self.idle_timeout => self.idle_timeout - idle,
                (Some(idle), None) => {
                    if self.own_frame.is_none() && self.between_frames {
                        crate::metrics::error("grpc_idle_timeout");
                        tracing::debug!(remote = %self.info.remote, "gRPC connection told GOAWAY: idle for {idle:?}");
                        self.own_frame = Some((IDLE_GOAWAY, 0));
                        self.write_own(cx);
                    }
                    // Written, or waiting for tonic's writes to end a frame.
                    Duration::from_millis(100)
                }
                // Closed between frames, with nothing of the last call's answer left in h2 and
                // no call opened in the last moment (its task may not have begun).
                (Some(idle), Some(at))
                    if at.elapsed() >= GOAWAY_GRACE
                        && idle >= GOAWAY_GRACE
                        && self.between_frames
                        && self.own_frame.is_none() =>
                {
                    // A client that takes GOAWAY in closes on its own once it has no call open.
                    crate::metrics::error("grpc_goaway_ignored");
                    tracing::debug!(remote = %self.info.remote, "gRPC connection closed: idle, GOAWAY not taken in");
                    return true;
                }
                (Some(idle), Some(at)) => {
                    GOAWAY_GRACE.saturating_sub(at.elapsed().min(idle)).max(Duration::from_millis(100))
                }
            };
            self.idle_check.as_mut().reset(tokio::time::Instant::now() + next);
        }
        false
    }

    /// Writes what is left of the listener's own frame, if any, as far as the socket takes it
    /// now (a write that would block is taken up again by the next call on the connection).
    /// Whether nothing of it is left.
    fn write_own(&mut self, cx: &mut std::task::Context<'_>) -> bool {
        while let Some((frame, written)) = &mut self.own_frame {
            let wrote = std::pin::Pin::new(self.inner.io()).poll_write(cx, &frame[*written..]);
            match wrote {
                std::task::Poll::Ready(Ok(n)) if n > 0 => {
                    *written += n;
                    if *written == frame.len() {
                        self.own_frame = None;
                        self.goaway_at = Some(std::time::Instant::now());
                        // Under TLS the record goes out on a flush.
                        let _ = std::pin::Pin::new(self.inner.io()).poll_flush(cx);
                    }
                }
                std::task::Poll::Pending => return false,
                // The socket is gone or closed: tonic's own next write finds out.
                _ => {
                    self.own_frame = None;
                    self.goaway_at = Some(std::time::Instant::now());
                }
            }
        }
        true
    }
}

impl tokio::io::AsyncWrite for GrpcConn {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        if !self.as_mut().get_mut().write_own(cx) {
            return std::task::Poll::Pending;
        }
        self.between_frames = false;
        std::pin::Pin::new(self.get_mut().inner.io()).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        if !self.as_mut().get_mut().write_own(cx) {
            return std::task::Poll::Pending;
        }
        self.between_frames = false;
        std::pin::Pin::new(self.get_mut().inner.io()).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        match &self.inner {
            GrpcStream::Plain(s) => s.is_write_vectored(),
            GrpcStream::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if !self.as_mut().get_mut().write_own(cx) {
            return std::task::Poll::Pending;
        }
        let this = self.get_mut();
        let flushed = std::pin::Pin::new(this.inner.io()).poll_flush(cx);
        if matches!(flushed, std::task::Poll::Ready(Ok(()))) {
            this.between_frames = true;
        }
        flushed
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(self.get_mut().inner.io()).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for GrpcConn {
    type ConnectInfo = GrpcPeer;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.info.clone()
    }
}

/// Raises this process's soft limit on open descriptors to its hard limit (every connection is
/// one; the default soft limit of 1024 would cap the node below `max_connections`). Returns the
/// limit in force.
pub fn raise_fd_limit() -> Option<u64> {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let cur = getrlimit(Resource::Nofile);
    if cur.current < cur.maximum {
        let raised = Rlimit { current: cur.maximum, maximum: cur.maximum };
        if setrlimit(Resource::Nofile, raised).is_ok() {
            return cur.maximum;
        }
    }
    cur.current
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_are_counted_apart_and_released() {
        let p = PeerCounts::default();
        let (a, b) = (Peer::Ip([127, 0, 0, 2].into()), Peer::Uid(1000));
        assert!(p.admit(a, 2) && p.admit(a, 2));
        assert!(!p.admit(a, 2), "a third from the same peer");
        assert!(p.admit(b, 2), "another peer is not affected");
        p.release(a);
        assert!(p.admit(a, 2), "a released slot is reused");
        for _ in 0..10 {
            assert!(p.admit(Peer::Unknown, 2), "unknown peers are limited by the total only");
        }
        p.release(b);
        assert!(!p.0.lock().contains_key(&b), "no entry is kept for a peer with no connection");
    }
}
