//! A data-plane connection's receive half that polls its socket for a bounded time before
//! parking: for the caller's next request after answering a load of small blocks
//! (`dataplane_poll`, default 50 µs), and for the rest of a `PUT`'s payload while its pieces keep
//! coming ([`Poller::arm_streaming`]). A parked task is woken through the scheduler — on a VM an
//! interrupt through the hypervisor, tens of µs per wake — and a caller that sends its loads
//! back to back (an engine loading 64 KiB blocks one call at a time) paid one such wake per
//! request.
//!
//! Polling costs a core while it lasts, so a connection polls only while it has the node to
//! itself ([`Gate`]): no other connection is serving a request, or started one within
//! [`RECENT`]; and it stops as soon as another one starts. With several callers at once the
//! server has work for every core and a poller would only take a core from the others' copies
//! (measured: 64 KiB loads and stores at concurrency 4 lost 10–20% to polling that ignored them).
//! At most one connection polls at a time.

use std::os::fd::{BorrowedFd, RawFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, ReadBuf};

/// Another connection's request started this recently: callers run side by side, no poll.
pub(crate) const RECENT: Duration = Duration::from_micros(500);

/// What the connections of a node know of each other for polling: which are serving a request,
/// which started one last and when, and whether one polls now.
pub(crate) struct Gate {
    epoch: OnceLock<Instant>,
    busy: AtomicUsize,
    polling: AtomicBool,
    next_conn: AtomicU64,
    /// The connection that started a request last, and when (µs since `epoch`); and when the
    /// last one before it that was another connection started one.
    last_conn: AtomicU64,
    last_at_us: AtomicU64,
    other_at_us: AtomicU64,
}

/// The process's gate: the data plane's connections (TCP and Unix socket) share it.
pub(crate) static NODE: Gate = Gate::new();

impl Gate {
    pub(crate) const fn new() -> Gate {
        Gate {
            epoch: OnceLock::new(),
            busy: AtomicUsize::new(0),
            polling: AtomicBool::new(false),
            next_conn: AtomicU64::new(1),
            last_conn: AtomicU64::new(0),
            last_at_us: AtomicU64::new(0),
            other_at_us: AtomicU64::new(0),
        }
    }

    fn now_us(&self) -> u64 {
        u64::try_from(self.epoch.get_or_init(Instant::now).elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// Whether connection `conn` has the node to itself: no other connection is serving a
    /// request (`own`: whether `conn` is itself), and none started one within [`RECENT`].
    fn alone(&self, conn: u64, own: usize) -> bool {
        if self.busy.load(Ordering::Acquire) > own {
            return false;
        }
        let other = if self.last_conn.load(Ordering::Acquire) == conn { &self.other_at_us } else { &self.last_at_us };
        let at = other.load(Ordering::Acquire);
        at == 0 || self.now_us().saturating_sub(at) > RECENT.as_micros() as u64
    }
}

/// A connection serving a request, counted by its gate until dropped.
pub(crate) struct Busy(&'static Gate);

impl Busy {
    /// Connection `conn` ([`SpinRead::id`]) starts a request.
    pub(crate) fn enter(gate: &'static Gate, conn: u64) -> Busy {
        gate.busy.fetch_add(1, Ordering::AcqRel);
        let now = gate.now_us().max(1);
        if gate.last_conn.swap(conn, Ordering::AcqRel) != conn {
            gate.other_at_us.store(gate.last_at_us.load(Ordering::Acquire), Ordering::Release);
        }
        gate.last_at_us.store(now, Ordering::Release);
        Busy(gate)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One connection's polling: when it may poll for its next request, and for how long.
pub(crate) struct Poller {
    gate: &'static Gate,
    id: u64,
    /// Polling until then; holds the gate's one polling place while `Some`.
    until: Option<Instant>,
    /// Requests of this connection's own in progress while it polls: 0 between requests, 1
    /// while it polls for the rest of a request ([`Poller::arm_streaming`]).
    own: usize,
    /// While polling for a request's payload: each read that takes bytes extends the poll by
    /// this much from then ([`Poller::arm_streaming`]).
    gap: Option<Duration>,
}

impl Poller {
    pub(crate) fn new(gate: &'static Gate) -> Self {
        Poller { gate, id: gate.next_conn.fetch_add(1, Ordering::Relaxed), until: None, own: 0, gap: None }
    }

    /// This connection, as [`Busy::enter`] takes it.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// The connection's gate (for [`Busy::enter`]).
    pub(crate) fn gate(&self) -> &'static Gate {
        self.gate
    }

    /// Whether this connection, serving a request, has the node to itself: no other connection
    /// is serving one, and none started one within [`RECENT`].
    pub(crate) fn alone_serving(&self) -> bool {
        self.gate.alone(self.id, 1)
    }

    /// Polls for up to `budget` from now, if the connection has the node to itself (between
    /// requests) and no other connection polls; else its reads park as usual.
    pub(crate) fn arm(&mut self, budget: Duration) {
        self.arm_as(budget, 0, None)
    }

    /// Polls for the rest of the request this connection is serving (a `PUT`'s payload, which
    /// its client sends in pieces) for up to `gap` after each read that takes bytes, if no
    /// other connection is serving one or started one recently. A parked read costs a wake-up
    /// per piece (measured on a 2-vCPU VM: a 1 MiB store, one block per round trip, moves 1.6×
    /// faster with its receiver polling than parking).
    pub(crate) fn arm_streaming(&mut self, gap: Duration) {
        self.arm_as(gap, 1, Some(gap))
    }

    fn arm_as(&mut self, budget: Duration, own: usize, gap: Option<Duration>) {
        if budget.is_zero() || !self.gate.alone(self.id, own) {
            return self.disarm();
        }
        if self.until.is_none() && self.gate.polling.swap(true, Ordering::AcqRel) {
            return;
        }
        self.own = own;
        self.gap = gap;
        self.until = Some(Instant::now() + budget);
    }

    /// A polled read took bytes: a streaming poll goes on for its gap from now.
    fn took_bytes(&mut self) {
        if let (Some(gap), Some(_)) = (self.gap, self.until) {
            self.until = Some(Instant::now() + gap);
        }
    }

    /// Stops polling: reads park from now on.
    pub(crate) fn disarm(&mut self) {
        if self.until.take().is_some() {
            self.gate.polling.store(false, Ordering::Release);
        }
    }

    pub(crate) fn armed(&self) -> bool {
        self.until.is_some()
    }

    /// After a read found nothing: whether to poll again (armed, still alone, within the
    /// budget); when not, polling stops.
    pub(crate) fn again(&mut self) -> bool {
        match self.until {
            Some(until) if self.gate.alone(self.id, self.own) && Instant::now() < until => true,
            _ => {
                self.disarm();
                false
            }
        }
    }
}

impl Drop for Poller {
    fn drop(&mut self) {
        self.disarm();
    }
}

/// Counts a request whose first bytes arrived while its connection polled for them, on `plane`
/// (`dataplane` or `samenode`): `kvtier_requests_polled_total`, what an operator reads to see
/// the polling take (and `dataplane_poll` pay) or not.
pub(crate) fn count_polled(plane: &'static str) {
    ::metrics::counter!("kvtier_requests_polled_total", "plane" => plane).increment(1);
}

/// A receive half read by polling its socket while armed ([`SpinRead::arm`]), else as `inner`.
pub(crate) struct SpinRead<R> {
    inner: R,
    /// The socket `inner` reads (`None`: a stream that is no socket of its own, never polled).
    fd: Option<RawFd>,
    poller: Poller,
}

impl<R> SpinRead<R> {
    /// `fd`: the socket `inner` reads, which must stay open as long as `inner` lives.
    pub(crate) fn new(inner: R, fd: Option<RawFd>, gate: &'static Gate) -> Self {
        SpinRead { inner, fd, poller: Poller::new(gate) }
    }

    /// This connection's polling.
    pub(crate) fn poller(&mut self) -> &mut Poller {
        &mut self.poller
    }

    /// [`Poller::arm`], for a stream that is a socket of its own.
    pub(crate) fn arm(&mut self, budget: Duration) {
        if self.fd.is_none() {
            return self.poller.disarm();
        }
        self.poller.arm(budget)
    }

    /// [`Poller::arm_streaming`], for a stream that is a socket of its own.
    pub(crate) fn arm_streaming(&mut self, gap: Duration) {
        if self.fd.is_none() {
            return self.poller.disarm();
        }
        self.poller.arm_streaming(gap)
    }

    #[cfg(test)]
    fn armed(&self) -> bool {
        self.poller.armed()
    }

    #[cfg(test)]
    fn id(&self) -> u64 {
        self.poller.id()
    }

    #[cfg(test)]
    fn disarm(&mut self) {
        self.poller.disarm()
    }
}

/// One non-blocking `recv` into `buf`: `Pending` when nothing is there.
pub(crate) fn try_recv(fd: BorrowedFd<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
    loop {
        // SAFETY: `recv` only writes into the slice, never de-initializing a byte of it, and
        // `init` is the part it wrote, which is what `assume_init` and `advance` are told.
        let unfilled = unsafe { buf.unfilled_mut() };
        match rustix::net::recv(fd, unfilled, rustix::net::RecvFlags::DONTWAIT) {
            Ok(((init, _), _)) => {
                let n = init.len();
                // SAFETY: `recv` initialized these `n` bytes of the unfilled part (above).
                unsafe { buf.assume_init(n) };
                buf.advance(n);
                return Poll::Ready(Ok(()));
            }
            Err(rustix::io::Errno::AGAIN) => return Poll::Pending,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Poll::Ready(Err(e.into())),
        }
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for SpinRead<R> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if let (Some(fd), true) = (this.fd, this.poller.armed()) {
            if buf.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            // SAFETY: `fd` is the socket `inner` reads, open while `inner` lives (`new`).
            if let Poll::Ready(done) = try_recv(unsafe { BorrowedFd::borrow_raw(fd) }, buf) {
                this.poller.took_bytes();
                return Poll::Ready(done);
            }
            if this.poller.again() {
                // Polled again at once unless other tasks of this worker are ready.
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A gate of the test's own (the node's is shared by every in-process server of the tests).
    fn gate() -> &'static Gate {
        Box::leak(Box::new(Gate::new()))
    }

    async fn pair(gate: &'static Gate) -> (SpinRead<tokio::net::tcp::OwnedReadHalf>, tokio::net::TcpStream) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let peer = tokio::net::TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (sock, _) = l.accept().await.unwrap();
        let fd = sock.as_raw_fd();
        let (r, w) = sock.into_split();
        // The write half lives as long as the test: leaked, so the socket stays open.
        Box::leak(Box::new(w));
        (SpinRead::new(r, Some(fd), gate), peer)
    }

    #[tokio::test]
    async fn bytes_polled_for_and_bytes_after_the_poll_both_arrive_whole() {
        let g = gate();
        let (mut rd, mut peer) = pair(g).await;
        rd.arm(Duration::from_millis(50));
        assert!(rd.armed());
        let sender = tokio::spawn(async move {
            peer.write_all(b"polled").await.unwrap();
            tokio::time::sleep(Duration::from_millis(80)).await;
            peer.write_all(b"parked").await.unwrap();
            peer
        });
        let mut got = [0u8; 12];
        rd.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"polledparked");
        assert!(!rd.armed(), "the poll ran out and gave its place back");
        assert!(!g.polling.load(Ordering::Acquire));
        drop(sender.await.unwrap());
        let mut rest = Vec::new();
        rd.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty(), "the peer's close reads as the end");
    }

    #[tokio::test]
    async fn one_connection_polls_at_a_time_and_only_with_the_node_to_itself() {
        let g = gate();
        let (mut a, _pa) = pair(g).await;
        let (mut b, _pb) = pair(g).await;
        a.arm(Duration::from_millis(10));
        b.arm(Duration::from_millis(10));
        assert!(a.armed() && !b.armed(), "a second poller at once");
        a.disarm();
        b.arm(Duration::from_millis(10));
        assert!(b.armed(), "the place came back");
        drop(b);
        assert!(!g.polling.load(Ordering::Acquire), "a dropped poller gives its place back");

        // Another connection serving a request: no poll.
        let (mut c, _pc) = pair(g).await;
        let busy = Busy::enter(g, 999);
        c.arm(Duration::from_millis(10));
        assert!(!c.armed());
        drop(busy);
        // It started one just now: still no poll, callers run side by side. "Just now" is within
        // RECENT (500 µs): a test thread preempted longer than that between the two tries again.
        loop {
            let started = std::time::Instant::now();
            drop(Busy::enter(g, 999));
            c.arm(Duration::from_millis(10));
            let armed = c.armed();
            if started.elapsed() < RECENT {
                assert!(!armed, "a request started {:?} ago", started.elapsed());
                break;
            }
            c.disarm();
        }
        std::thread::sleep(RECENT + Duration::from_millis(1));
        c.arm(Duration::from_millis(10));
        assert!(c.armed(), "the other connection went quiet");
        // Its own requests don't count against it.
        c.disarm();
        drop(Busy::enter(g, c.id()));
        c.arm(Duration::from_millis(10));
        assert!(c.armed());
        // Nothing to poll, or a zero budget: no poll.
        let mut plain = SpinRead::new(tokio::io::empty(), None, g);
        c.disarm();
        plain.arm(Duration::from_millis(10));
        assert!(!plain.armed());
        plain.arm_streaming(Duration::from_millis(10));
        assert!(!plain.armed());
        c.arm(Duration::ZERO);
        assert!(!c.armed());
    }

    #[tokio::test]
    async fn a_payload_is_polled_for_while_its_pieces_keep_coming_and_parks_after_a_gap() {
        let g = gate();
        let (mut rd, mut peer) = pair(g).await;
        // Serving a request of its own: a poll for the next request may not start, one for the
        // rest of this request may.
        let busy = Busy::enter(g, rd.id());
        rd.arm(Duration::from_millis(200));
        assert!(!rd.armed(), "polled for a next request in the middle of one");
        rd.arm_streaming(Duration::from_millis(300));
        assert!(rd.armed());
        // Pieces 80 ms apart, longer in all than the gap: each one extends the poll.
        let sender = tokio::spawn(async move {
            for piece in [b"aa", b"bb", b"cc", b"dd", b"ee"] {
                tokio::time::sleep(Duration::from_millis(80)).await;
                peer.write_all(piece).await.unwrap();
            }
            tokio::time::sleep(Duration::from_millis(800)).await;
            peer.write_all(b"ff").await.unwrap();
            peer
        });
        let mut got = [0u8; 10];
        rd.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"aabbccddee");
        assert!(rd.armed(), "the poll ran out while pieces kept coming within its gap");
        let mut last = [0u8; 2];
        rd.read_exact(&mut last).await.unwrap();
        assert_eq!(&last, b"ff", "bytes after the gap arrive by a parked read");
        assert!(!rd.armed() && !g.polling.load(Ordering::Acquire), "a gap longer than the poll's ends it");
        drop(busy);
        drop(sender.await.unwrap());

        // Another connection serving a request: the payload's reads park.
        let (mut rd, _peer) = pair(g).await;
        let own = Busy::enter(g, rd.id());
        let other = Busy::enter(g, 4242);
        rd.arm_streaming(Duration::from_millis(200));
        assert!(!rd.armed(), "polled beside another connection's request");
        drop((own, other));
    }

    #[tokio::test]
    async fn a_poll_stops_when_another_connection_starts_a_request() {
        let g = gate();
        let (mut rd, mut peer) = pair(g).await;
        rd.arm(Duration::from_secs(30));
        assert!(rd.armed());
        let other = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let busy = Busy::enter(g, 12345);
            tokio::time::sleep(Duration::from_millis(20)).await;
            drop(busy);
            tokio::time::sleep(Duration::from_millis(20)).await;
            peer.write_all(b"x").await.unwrap();
            peer
        });
        let mut b = [0u8; 1];
        rd.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"x");
        assert!(!rd.armed(), "polling went on beside another connection's request");
        drop(other.await.unwrap());
    }
}
