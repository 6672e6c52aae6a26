//! A same-node connection's socket, whose answers are awaited by polling it for a bounded time
//! before parking. An answer is due as soon as the server has copied the request's blocks (a few
//! hundred µs for a MiB); a thread that parks for that long is woken through the scheduler — on a
//! VM an interrupt through the hypervisor, tens of µs per hop, and a tokio call from outside the
//! runtime (Python's) takes two hops: the I/O driver's thread, then the caller. Polling keeps the
//! caller on its core and reads the answer the moment it lands.
//!
//! Polling is a non-blocking `recv` between yields of the task, so other futures on the same
//! thread go on meanwhile. It costs a core for the wait, so it is bounded: by a budget the caller
//! sizes from the bytes it asked to move, and to a call that is this process's only same-node
//! call in flight. With several in flight the server is busy with all of them, an answer is
//! rarely far, and a poller would only take a core from the server's copies (measured: 64 KiB
//! loads at concurrency 4 lost a third of their throughput to polling on 2 cores), so they park.
//!
//! A TCP data-plane connection's receive half ([`PolledRead`]) waits the same way: while a call
//! has armed it, its reads `recv` straight from the socket (the answer's header, then the blocks
//! as they stream in, into the caller's destination) and yield when nothing is there yet, so a
//! load never parks between the request and the last byte of its answer — each park there was
//! one or two wake-ups of tens of µs, several per MiB as a block arrives in pieces.
//!
//! Whether a call that may poll does is [`crate::wait`]'s choice: polling pays only while the
//! machine has a core to spare, and the process learns from its calls' times whether it has.
//!
//! A call run on a caller's own thread ([`on_caller_thread`]: Python's, a `block_on` that runs
//! nothing else) waits for an answer it does not poll for in the kernel instead — `poll(2)` on
//! its socket, TCP or same-node — so the arriving bytes wake that thread directly, rather than
//! the I/O driver's thread first and the caller through it, while the process has few calls in
//! flight ([`kernel_wait_limit`]).

use std::cell::Cell;
use std::os::fd::AsFd;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, ReadBuf};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::UnixStream;

use crate::wait::{WaitTicket, Waits, SAMENODE_WAITS, TCP_STORE_WAITS, TCP_WAITS};

/// Room for answers' fixed parts read while polling (header, statuses, frame headers); what does
/// not fit is read by the ordinary path.
const RX_BYTES: usize = 16 * 1024;
/// The default cap on one answer's poll ([`crate::ClientConfig::samenode_poll`]).
pub(crate) const MAX_POLL: Duration = Duration::from_micros(2500);
/// The fixed part of an answer's expected wait: the two system calls and the server's lookup.
const POLL_BASE: Duration = Duration::from_micros(50);
/// The copy speed a poll's budget assumes (about half what the server copies at): a slower server
/// is waited for parked.
const POLL_BYTES_PER_SEC: u64 = 2_000_000_000;
/// Requests that move more than this are not polled for: their wait (a millisecond and more) is
/// long beside a wake-up, and polling it would only burn the core.
const MAX_POLLED_BYTES: u64 = 4 << 20;

/// How long after taking its last bytes a polled TCP answer's reads poll on before they park.
const STREAM_GAP: Duration = Duration::from_micros(100);

/// The first byte's poll of a TCP answer of `bytes`: as [`poll_budget`], for any length (a long
/// answer streams in, and its reads poll on while its bytes keep coming: [`STREAM_GAP`]).
fn stream_budget(bytes: u64) -> Duration {
    poll_budget(bytes.min(MAX_POLLED_BYTES))
}

/// Calls of this process between their request and their answer: same-node calls, and TCP
/// data-plane calls on connections that poll ([`PolledRead`]).
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);

/// In a forked child ([`crate::fork`]): the calls counted in flight were the parent's other
/// threads', which the child does not have.
pub(crate) fn forget_calls_in_flight() {
    IN_FLIGHT.store(0, Ordering::Release);
}

/// How long to poll for the answer to a request that moves `bytes`: the expected copy time plus
/// the fixed part; zero (don't poll) past [`MAX_POLLED_BYTES`].
pub(crate) fn poll_budget(bytes: u64) -> Duration {
    if bytes > MAX_POLLED_BYTES {
        return Duration::ZERO;
    }
    expected_wait(bytes)
}

/// The time an answer of `bytes` is expected to take: the fixed part plus its copy at
/// [`POLL_BYTES_PER_SEC`].
fn expected_wait(bytes: u64) -> Duration {
    let copy = u128::from(bytes) * 1_000_000_000 / u128::from(POLL_BYTES_PER_SEC);
    POLL_BASE + Duration::from_nanos(u64::try_from(copy).unwrap_or(u64::MAX))
}

/// For a call counted in `flights` that may poll for `budget`: the budget it polls for (zero when
/// it parks: another call is in flight, or `waits` finds parking faster now), and the ticket to
/// report its time with once answered (none beside other calls: nothing is chosen or learned).
fn choose_wait(flights: &AtomicUsize, waits: &'static Waits, budget: Duration) -> (Duration, Option<WaitTicket>) {
    let alone = flights.load(Ordering::Acquire) <= 1;
    let ticket = if alone { waits.start(budget) } else { None };
    let budget = if ticket.as_ref().is_some_and(WaitTicket::polls) { budget } else { Duration::ZERO };
    (budget, ticket)
}

/// Longest a caller thread's wait sleeps in `poll(2)` at a time; then the call's future is
/// polled again, so its deadline is seen (a call's budget is far longer than this).
const CALLER_WAIT_SLICE: Duration = Duration::from_millis(5);

/// The calling thread's state while [`on_caller_thread`] runs.
#[derive(Clone, Copy, Default)]
struct CallerThread {
    /// Inside [`on_caller_thread`].
    on: bool,
    /// This thread's calls awaiting an answer (armed TCP reads, [`PolledRead::arm`], and
    /// same-node exchanges, [`PolledSocket::exchange`]): one may wait in the kernel; several (a
    /// load striped over connections, joined on this thread) wait through the driver, which
    /// wakes whichever answers first.
    armed: usize,
}

thread_local! {
    static CALLER_THREAD: Cell<CallerThread> = const { Cell::new(CallerThread { on: false, armed: 0 }) };
}

/// Runs `f` — the `block_on` of one client call, on a thread that runs nothing else meanwhile
/// (a Python caller's) — letting that call wait for its answers in the kernel: a read with
/// nothing to take sleeps in `poll(2)` on its socket, at most [`CALLER_WAIT_SLICE`] at a time,
/// instead of parking the thread until the runtime's I/O driver (another thread) wakes it. One
/// wake-up per answer instead of two.
///
/// Only for a thread that blocks on the call's future and nothing else: a runtime's worker
/// thread must never run calls inside it (their sleeps would stall the worker's other tasks).
pub fn on_caller_thread<T>(f: impl FnOnce() -> T) -> T {
    struct Restore(CallerThread);
    impl Drop for Restore {
        fn drop(&mut self) {
            CALLER_THREAD.with(|t| t.set(self.0));
        }
    }
    let _restore = Restore(CALLER_THREAD.with(|t| t.replace(CallerThread { on: true, armed: 0 })));
    f()
}

/// A call between its request and its answer, counted among the calls in flight.
pub(crate) struct InFlight {
    flights: &'static AtomicUsize,
    /// Counted in its thread's [`CallerThread::armed`] too.
    on_caller_thread: bool,
}

impl InFlight {
    /// Counts one more call in `flights` until the guard drops.
    fn enter(flights: &'static AtomicUsize) -> Self {
        flights.fetch_add(1, Ordering::AcqRel);
        InFlight { flights, on_caller_thread: false }
    }

    /// [`InFlight::enter`], and, on a caller's thread, one more of its armed reads.
    fn enter_armed(flights: &'static AtomicUsize) -> Self {
        let mut flight = InFlight::enter(flights);
        flight.on_caller_thread = CALLER_THREAD.with(|t| {
            let mut c = t.get();
            if c.on {
                c.armed += 1;
                t.set(c);
            }
            c.on
        });
        flight
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.flights.fetch_sub(1, Ordering::AcqRel);
        if self.on_caller_thread {
            // A caller thread's call is polled only there (`block_on`), so this runs on the
            // thread that counted it.
            CALLER_THREAD.with(|t| {
                let mut c = t.get();
                c.armed = c.armed.saturating_sub(1);
                t.set(c);
            });
        }
    }
}

/// Whether a read of an armed call on this thread may sleep in the kernel for its bytes: the
/// thread is a caller's, this is its only armed read, and the process has no more calls in
/// `flights` than [`kernel_wait_limit`].
fn may_wait_in_kernel(flights: &AtomicUsize) -> bool {
    let mine = CALLER_THREAD.with(|t| {
        let c = t.get();
        c.on && c.armed == 1
    });
    mine && flights.load(Ordering::Acquire) <= kernel_wait_limit()
}

/// Most calls in flight at once for which caller threads wait in the kernel: twice the cores.
/// Beyond that the I/O driver's wake-ups, a batch per turn, cost the server less than each
/// caller woken the moment its bytes land, preempting the server's copies. Measured on 2 cores,
/// Python threads loading 64 KiB blocks (GB/s, against waits through the driver): over TCP ×1
/// 1.11–1.26 → 1.43–1.49, ×4 1.85 → 1.90–1.96, ×16 1.90–1.92 → 1.67–1.93; same node ×4
/// 2.25–2.37 → 2.63–2.80, ×16 2.58–2.70 → 2.45–2.50.
fn kernel_wait_limit() -> usize {
    static LIMIT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| 2 * std::thread::available_parallelism().map_or(1, usize::from))
}

/// A same-node connection's socket with the bytes polled ahead of its reads.
pub(crate) struct PolledSocket {
    sock: UnixStream,
    /// The calls in flight this connection's calls count among ([`IN_FLIGHT`]).
    flights: &'static AtomicUsize,
    /// Whether its calls poll or park ([`SAMENODE_WAITS`]).
    waits: &'static Waits,
    /// Bytes received while polling and not yet read: `rx[start..end]`.
    rx: Box<[u8]>,
    start: usize,
    end: usize,
    /// A call's exchange is running ([`PolledSocket::exchange`]).
    armed: bool,
    /// Waits in the kernel that ended with bytes to read.
    kernel_waits: u64,
}

impl PolledSocket {
    pub(crate) fn new(sock: UnixStream) -> Self {
        Self::counted_in(sock, &IN_FLIGHT, &SAMENODE_WAITS)
    }

    fn counted_in(sock: UnixStream, flights: &'static AtomicUsize, waits: &'static Waits) -> Self {
        PolledSocket {
            sock,
            flights,
            waits,
            rx: vec![0u8; RX_BYTES].into_boxed_slice(),
            start: 0,
            end: 0,
            armed: false,
            kernel_waits: 0,
        }
    }

    /// Counts a call in flight on this connection until the guard drops (after its answer).
    #[cfg(test)]
    fn in_flight(&self) -> InFlight {
        InFlight::enter(self.flights)
    }

    /// Runs `call`, one request and its answer, counted in flight throughout; on a caller's
    /// thread ([`on_caller_thread`]) its reads may wait for the answer in the kernel. A call cut
    /// short (its timeout) leaves `armed` set, harmlessly: its connection is broken for good and
    /// only drained (`read`) before it is closed.
    pub(crate) async fn exchange<T>(&mut self, call: impl AsyncFnOnce(&mut PolledSocket) -> T) -> T {
        let _flight = InFlight::enter_armed(self.flights);
        self.armed = true;
        let out = call(self).await;
        self.armed = false;
        out
    }

    /// For a call in flight that may poll for `budget`: the budget it polls for (zero when it
    /// parks: another call is in flight, or parking is faster now), and the ticket to report its
    /// time with once answered.
    pub(crate) fn choose_wait(&self, budget: Duration) -> (Duration, Option<WaitTicket>) {
        choose_wait(self.flights, self.waits, budget)
    }

    /// Whether the caller's call (counted in flight) is the only one.
    fn alone(&self) -> bool {
        self.flights.load(Ordering::Acquire) <= 1
    }

    /// The socket itself, for what bypasses the polled reads (sending a descriptor, closing).
    /// Any bytes polled ahead are still read first by [`PolledSocket::read_exact`].
    pub(crate) fn inner(&mut self) -> &mut UnixStream {
        &mut self.sock
    }

    pub(crate) async fn write_all(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.sock.write_all(bytes).await
    }

    /// Polls the socket for up to `budget`, without parking, until some bytes of the answer
    /// have arrived; false when none did (or none were there at once, or another call went in
    /// flight meanwhile): the reads that follow then park as usual. End of stream and errors are
    /// left to those reads.
    pub(crate) async fn poll_for_answer(&mut self, budget: Duration) -> bool {
        if self.start < self.end {
            return true;
        }
        let deadline = Instant::now() + budget;
        loop {
            match rustix::net::recv(self.sock.as_fd(), &mut self.rx[..], rustix::net::RecvFlags::DONTWAIT) {
                Ok((0, _)) => return false,
                Ok((n, _)) => {
                    self.start = 0;
                    self.end = n;
                    return true;
                }
                Err(rustix::io::Errno::AGAIN) => {
                    if !self.alone() || Instant::now() >= deadline {
                        return false;
                    }
                    // Other futures on this thread (a join of calls) go on meanwhile; with none,
                    // the task is polled again at once, without parking.
                    tokio::task::yield_now().await;
                }
                Err(rustix::io::Errno::INTR) => {}
                Err(_) => return false,
            }
        }
    }

    /// Fills `out`: first from the bytes polled ahead, then from the socket.
    pub(crate) async fn read_exact(&mut self, out: &mut [u8]) -> std::io::Result<()> {
        let mut n = out.len().min(self.end - self.start);
        out[..n].copy_from_slice(&self.rx[self.start..self.start + n]);
        self.start += n;
        if n < out.len() && self.armed && may_wait_in_kernel(self.flights) {
            let mut held = KernelWaits::default();
            while n < out.len() {
                match rustix::net::recv(self.sock.as_fd(), &mut out[n..], rustix::net::RecvFlags::DONTWAIT) {
                    Ok((0, _)) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                    Ok((got, _)) => n += got,
                    Err(rustix::io::Errno::AGAIN) => {
                        // Past a slice of sleeps, or a slice without bytes: the call's deadline
                        // is looked at, then back here.
                        if held.must_let_go() {
                            tokio::task::yield_now().await;
                        } else if sleep_until_readable(self.sock.as_fd())? {
                            self.kernel_waits += 1;
                        } else {
                            held = KernelWaits::default();
                            tokio::task::yield_now().await;
                        }
                    }
                    Err(rustix::io::Errno::INTR) => {}
                    Err(e) => return Err(e.into()),
                }
            }
            return Ok(());
        }
        if n < out.len() {
            self.sock.read_exact(&mut out[n..]).await?;
        }
        Ok(())
    }

    /// Reads whatever comes next (the bytes polled ahead first); 0 at the end of the stream.
    pub(crate) async fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        if self.start < self.end {
            let n = out.len().min(self.end - self.start);
            out[..n].copy_from_slice(&self.rx[self.start..self.start + n]);
            self.start += n;
            return Ok(n);
        }
        self.sock.read(out).await
    }
}

/// A TCP data-plane connection's receive half, whose reads poll the socket while a call has armed
/// it ([`PolledRead::arm`]) and is this process's only call in flight: a non-blocking `recv`
/// straight into the reader's buffer, and when nothing is there yet the task wakes itself and
/// yields (other futures on the thread go on) instead of waiting for the I/O driver. Past the
/// deadline, or once another call is in flight, reads wait parked as any tokio read does, for
/// the rest of the call. Disarmed, it is the plain half.
pub(crate) struct PolledRead {
    half: OwnedReadHalf,
    flights: &'static AtomicUsize,
    /// Whether its calls poll or park ([`TCP_WAITS`]).
    waits: &'static Waits,
    /// The armed call's choice, reported when it is answered.
    ticket: Option<WaitTicket>,
    /// A call is armed (between [`PolledRead::arm`] and [`PolledRead::disarm`]).
    armed: bool,
    until: Option<Instant>,
    /// How far each byte polled in moves `until` on (a streaming answer polls while it streams).
    gap: Duration,
    /// Bytes taken by non-blocking `recv`s: polling, or after a wait in the kernel (the rest
    /// came through tokio's parked reads).
    polled: u64,
    /// Waits in the kernel ([`PolledRead::wait_in_kernel`]) that ended with bytes to read.
    kernel_waits: u64,
    /// When this read first slept in the kernel since its task last let go ([`KernelWaits`]).
    held: KernelWaits,
}

impl PolledRead {
    pub(crate) fn new(half: OwnedReadHalf) -> Self {
        Self::counted_in(half, &IN_FLIGHT, &TCP_WAITS)
    }

    fn counted_in(half: OwnedReadHalf, flights: &'static AtomicUsize, waits: &'static Waits) -> Self {
        PolledRead {
            half,
            flights,
            waits,
            ticket: None,
            armed: false,
            until: None,
            gap: Duration::ZERO,
            polled: 0,
            kernel_waits: 0,
            held: KernelWaits::default(),
        }
    }

    /// Starts a call that expects an answer of `bytes` (its payloads): counted in flight until
    /// the guard drops, and, when it is the only call in flight and polling is the faster way
    /// now ([`crate::wait`]), its reads poll for up to [`poll_budget`] of it, at most `cap`
    /// (`Duration::ZERO`: never).
    pub(crate) fn arm(&mut self, bytes: u64, cap: Duration) -> InFlight {
        self.arm_in(bytes, cap, self.waits)
    }

    /// [`PolledRead::arm`] for a store's answer, which comes once the server has taken in the
    /// `bytes` sent: timed apart from loads ([`TCP_STORE_WAITS`]), whose answers carry the bytes.
    pub(crate) fn arm_store(&mut self, bytes: u64, cap: Duration) -> InFlight {
        self.arm_in(bytes, cap, &TCP_STORE_WAITS)
    }

    fn arm_in(&mut self, bytes: u64, cap: Duration, waits: &'static Waits) -> InFlight {
        let flight = InFlight::enter_armed(self.flights);
        self.armed = true;
        self.held = KernelWaits::default();
        let first = stream_budget(bytes).min(cap);
        // The chooser sizes its classes by the whole answer's expected wait, so that calls of
        // 8 MiB and of 64 MiB are timed apart, though both poll the same for their first bytes.
        let (polls, ticket) = if first.is_zero() {
            (false, None)
        } else {
            let (budget, ticket) = choose_wait(self.flights, waits, expected_wait(bytes));
            (!budget.is_zero(), ticket)
        };
        self.gap = cap.min(STREAM_GAP);
        self.ticket = ticket;
        self.until = polls.then(|| Instant::now() + first);
        flight
    }

    /// Ends a call's polling: its answer is read (its time is reported), or it failed.
    pub(crate) fn disarm(&mut self) {
        self.armed = false;
        self.until = None;
        if let Some(ticket) = self.ticket.take() {
            ticket.answered();
        }
    }

    /// One non-blocking `recv` into `buf`'s unfilled part: `Ready` with what came (nothing at the
    /// end of the stream) or an error, `Pending` when nothing is there yet.
    fn try_recv(&mut self, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        loop {
            // SAFETY: `recv` only writes into the slice, never de-initializing a byte of it, and
            // `init` is the part it wrote, which is what `assume_init` and `advance` are told.
            let unfilled = unsafe { buf.unfilled_mut() };
            match rustix::net::recv(self.half.as_ref().as_fd(), unfilled, rustix::net::RecvFlags::DONTWAIT) {
                Ok(((init, _), _)) => {
                    let n = init.len();
                    // SAFETY: `recv` initialized these `n` bytes of the unfilled part (above).
                    unsafe { buf.assume_init(n) };
                    buf.advance(n);
                    self.polled += n as u64;
                    return Poll::Ready(Ok(()));
                }
                Err(rustix::io::Errno::AGAIN) => return Poll::Pending,
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Poll::Ready(Err(e.into())),
            }
        }
    }
}

impl AsyncRead for PolledRead {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if let Some(until) = this.until {
            if buf.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            if let Poll::Ready(done) = this.try_recv(buf) {
                // Bytes are coming: keep polling while they do, however long the answer.
                let more = Instant::now() + this.gap;
                if more > until {
                    this.until = Some(more);
                }
                return Poll::Ready(done);
            }
            if this.flights.load(Ordering::Acquire) <= 1 && Instant::now() < until {
                // Polled again at once unless other futures of this thread are ready.
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            this.until = None;
        }
        if this.armed && buf.remaining() > 0 && may_wait_in_kernel(this.flights) {
            return this.wait_in_kernel(cx, buf);
        }
        Pin::new(&mut this.half).poll_read(cx, buf)
    }
}

impl PolledRead {
    /// A read on a caller's thread ([`on_caller_thread`]): takes what is there, else sleeps in
    /// `poll(2)` until bytes come, at most [`CALLER_WAIT_SLICE`]; past that the task is woken
    /// and polled again (its deadline checked) before it sleeps again.
    fn wait_in_kernel(&mut self, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        loop {
            if let Poll::Ready(done) = self.try_recv(buf) {
                return Poll::Ready(done);
            }
            if self.held.must_let_go() {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            match sleep_until_readable(self.half.as_ref().as_fd()) {
                // Readable, hung up or failed: the `recv` above says which.
                Ok(true) => self.kernel_waits += 1,
                // Nothing yet: polled again at once (the thread runs nothing else).
                Ok(false) => {
                    self.held = KernelWaits::default();
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

/// How long one read's kernel waits have held its task since it last let go. A read that
/// sleeps and wakes with a few bytes, again and again (a peer trickling its answer), never
/// returns `Pending` by itself, so the call's deadline would go unseen: once it has held the task
/// for [`CALLER_WAIT_SLICE`] it lets go before it sleeps again.
#[derive(Default)]
struct KernelWaits(Option<Instant>);

impl KernelWaits {
    /// Whether the task must be let go (polled again, its deadline checked) before the next
    /// sleep; if so, the count starts over.
    fn must_let_go(&mut self) -> bool {
        let now = Instant::now();
        match self.0 {
            Some(since) if now.duration_since(since) >= CALLER_WAIT_SLICE => {
                self.0 = None;
                true
            }
            Some(_) => false,
            None => {
                self.0 = Some(now);
                false
            }
        }
    }
}

/// Sleeps in `poll(2)` until `fd` is readable (or hung up, or failed: the next `recv` says
/// which), at most [`CALLER_WAIT_SLICE`]: false when the slice ended first.
fn sleep_until_readable(fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<bool> {
    const SLICE: rustix::event::Timespec = rustix::event::Timespec {
        tv_sec: CALLER_WAIT_SLICE.as_secs() as _,
        tv_nsec: CALLER_WAIT_SLICE.subsec_nanos() as _,
    };
    let mut fds = [rustix::event::PollFd::new(&fd, rustix::event::PollFlags::IN)];
    match rustix::event::poll(&mut fds, Some(&SLICE)) {
        Ok(n) => Ok(n > 0),
        Err(rustix::io::Errno::INTR) => Ok(true),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wait::Wait;

    /// Calls that always poll: tests of what polling does.
    static ALWAYS_POLL: Waits = Waits::fixed(Wait::Poll);

    #[test]
    fn a_poll_lasts_about_the_copy_and_a_long_wait_is_not_polled() {
        assert_eq!(poll_budget(0), POLL_BASE);
        let mib = Duration::from_nanos((1u64 << 20) * 1_000_000_000 / POLL_BYTES_PER_SEC);
        assert_eq!(poll_budget(1 << 20), POLL_BASE + mib);
        assert!(poll_budget(4 << 20) <= MAX_POLL && !poll_budget(4 << 20).is_zero(), "a 4 MiB block is polled for");
        assert_eq!(poll_budget((4 << 20) + 1), Duration::ZERO, "a longer wait is not");
        assert_eq!(poll_budget(64 << 20), Duration::ZERO);
        assert_eq!(poll_budget(u64::MAX), Duration::ZERO);
    }

    #[tokio::test]
    async fn a_call_polls_only_while_it_is_the_only_one_in_flight() {
        static FLIGHTS: AtomicUsize = AtomicUsize::new(0);
        let (ours, _theirs) = UnixStream::pair().unwrap();
        let mut s = PolledSocket::counted_in(ours, &FLIGHTS, &ALWAYS_POLL);
        let mine = s.in_flight();
        let other = s.in_flight();
        let t = Instant::now();
        assert!(!s.poll_for_answer(Duration::from_secs(5)).await);
        assert!(t.elapsed() < Duration::from_secs(1), "with another call in flight it gave up at once");
        drop(other);
        let t = Instant::now();
        assert!(!s.poll_for_answer(Duration::from_millis(20)).await);
        assert!(t.elapsed() >= Duration::from_millis(20), "alone, it polled its budget");
        drop(mine);
        assert_eq!(FLIGHTS.load(Ordering::Acquire), 0);
    }

    #[tokio::test]
    async fn bytes_polled_ahead_are_read_first_and_the_rest_from_the_socket() {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let mut s = PolledSocket::new(ours);
        theirs.write_all(b"0123456789").await.unwrap();
        assert!(s.poll_for_answer(Duration::from_secs(5)).await, "bytes already there are found");
        theirs.write_all(b"abcde").await.unwrap();
        let mut first = [0u8; 12];
        s.read_exact(&mut first).await.unwrap();
        assert_eq!(&first, b"0123456789ab");
        let mut rest = [0u8; 3];
        s.read_exact(&mut rest).await.unwrap();
        assert_eq!(&rest, b"cde");
        // Polled bytes not yet read are what a plain read returns first.
        theirs.write_all(b"xyz").await.unwrap();
        assert!(s.poll_for_answer(Duration::from_secs(5)).await);
        let mut one = [0u8; 2];
        assert_eq!(s.read(&mut one).await.unwrap(), 2);
        assert_eq!(&one, b"xy");
        assert_eq!(s.read(&mut one).await.unwrap(), 1);
        assert_eq!(one[0], b'z');
    }

    /// Both ends of a loopback TCP connection: our receive half polled (counted in `flights`,
    /// choosing by `waits`), and the peer's stream.
    async fn tcp_pair(flights: &'static AtomicUsize, waits: &'static Waits) -> (PolledRead, tokio::net::TcpStream) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let ours = tokio::net::TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (theirs, _) = l.accept().await.unwrap();
        let (r, w) = ours.into_split();
        std::mem::forget(w); // the send half stays open for the test's length
        (PolledRead::counted_in(r, flights, waits), theirs)
    }

    /// An armed call alone in flight takes its whole answer by polling `recv`s, also what comes
    /// late and in pieces, and sees the end of the stream; the same bytes a parked read gets.
    #[tokio::test]
    async fn an_armed_tcp_read_alone_takes_its_answer_by_polling() {
        static FLIGHTS: AtomicUsize = AtomicUsize::new(0);
        let (mut r, mut theirs) = tcp_pair(&FLIGHTS, &ALWAYS_POLL).await;
        let want: Vec<u8> = (0..300_000u32).map(|i| (i * 7 + i / 13) as u8).collect();
        let sent = want.clone();
        let writer = tokio::spawn(async move {
            for piece in sent.chunks(70_000) {
                tokio::time::sleep(Duration::from_millis(2)).await;
                theirs.write_all(piece).await.unwrap();
            }
            theirs
        });
        let flight = r.arm(want.len() as u64, Duration::from_secs(5));
        // A deadline far off, so that the pieces' pacing (and a busy machine) can't outlast it.
        r.until = Some(Instant::now() + Duration::from_secs(5));
        let mut got = vec![0u8; want.len()];
        r.read_exact(&mut got).await.unwrap();
        assert!(got == want, "the bytes came in order");
        assert_eq!(r.polled, want.len() as u64, "every byte came by polling");
        drop(writer.await.unwrap());
        let mut one = [0u8; 1];
        assert_eq!(r.read(&mut one).await.unwrap(), 0, "the peer's close is the end of the stream");
        r.disarm();
        drop(flight);
        assert_eq!(FLIGHTS.load(Ordering::Acquire), 0);
    }

    /// An answer that keeps streaming in is polled past its first deadline: each piece polled in
    /// moves the deadline on by the gap, so a long load never parks while its bytes keep coming;
    /// with no gap the same pacing parks once the first deadline passes.
    #[tokio::test]
    async fn a_streaming_answer_is_polled_while_its_bytes_keep_coming() {
        static FLIGHTS: AtomicUsize = AtomicUsize::new(0);
        let (mut r, mut theirs) = tcp_pair(&FLIGHTS, &ALWAYS_POLL).await;
        let want: Vec<u8> = (0..400_000u32).map(|i| (i * 13 + i / 7) as u8).collect();
        for gap in [Duration::from_secs(2), Duration::ZERO] {
            let sent = want.clone();
            let writer = tokio::spawn(async move {
                for piece in sent.chunks(50_000) {
                    tokio::time::sleep(Duration::from_millis(150)).await;
                    theirs.write_all(piece).await.unwrap();
                }
                theirs
            });
            let before = r.polled;
            let flight = r.arm(want.len() as u64, Duration::from_secs(5));
            // The first of 8 pieces is due in 150 ms, the last in 1.2 s or later: a first
            // deadline of 600 ms is outlasted by the answer, which only the gap's extensions
            // carry through (a busy machine has 450 ms to take the first piece in).
            r.until = Some(Instant::now() + Duration::from_millis(600));
            r.gap = gap;
            let mut got = vec![0u8; want.len()];
            r.read_exact(&mut got).await.unwrap();
            assert!(got == want, "gap {gap:?}: the bytes came in order");
            let polled = r.polled - before;
            if gap.is_zero() {
                assert!(polled < want.len() as u64, "no gap: the last pieces came parked ({polled} polled)");
            } else {
                assert_eq!(polled, want.len() as u64, "every byte came by polling");
            }
            r.disarm();
            drop(flight);
            theirs = writer.await.unwrap();
        }
        assert_eq!(FLIGHTS.load(Ordering::Acquire), 0);
    }

    /// Beside another call in flight, past its deadline, with a zero cap or disarmed, a read
    /// waits parked (through tokio) and still gets every byte.
    #[tokio::test]
    async fn a_tcp_read_parks_beside_other_calls_past_its_deadline_or_disarmed() {
        static FLIGHTS: AtomicUsize = AtomicUsize::new(0);
        let (mut r, mut theirs) = tcp_pair(&FLIGHTS, &ALWAYS_POLL).await;
        let mut got = [0u8; 4];
        for case in ["another call", "deadline", "zero cap", "disarmed"] {
            let before = r.polled;
            let (flight, other) = match case {
                "another call" => {
                    let other = FLIGHTS.fetch_add(1, Ordering::AcqRel);
                    (Some(r.arm(4, Duration::from_secs(5))), Some(other))
                }
                "deadline" => (Some(r.arm(4, Duration::from_millis(5))), None),
                "zero cap" => (Some(r.arm(4, Duration::ZERO)), None),
                _ => (None, None),
            };
            let t = Instant::now();
            let late = async {
                tokio::time::sleep(Duration::from_millis(40)).await;
                theirs.write_all(b"late").await.unwrap();
            };
            let (read, ()) = tokio::join!(r.read_exact(&mut got), late);
            read.unwrap();
            assert_eq!(&got, b"late", "{case}");
            assert!(t.elapsed() >= Duration::from_millis(40), "{case}");
            assert_eq!(r.polled, before, "{case}: the bytes came through a parked read");
            if other.is_some() {
                FLIGHTS.fetch_sub(1, Ordering::AcqRel);
            }
            r.disarm();
            drop(flight);
        }
        assert_eq!(FLIGHTS.load(Ordering::Acquire), 0);
    }

    /// A call the process chose to park for (parking is faster now) waits parked, on TCP and
    /// same-node, and still gets every byte.
    #[tokio::test]
    async fn a_call_chosen_to_park_reads_parked() {
        static FLIGHTS: AtomicUsize = AtomicUsize::new(0);
        static PARK: Waits = Waits::fixed(Wait::Park);
        let (mut r, mut theirs) = tcp_pair(&FLIGHTS, &PARK).await;
        let flight = r.arm(4, Duration::from_secs(5));
        assert!(r.until.is_none(), "the call does not poll");
        let late = async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            theirs.write_all(b"late").await.unwrap();
        };
        let mut got = [0u8; 4];
        let (read, ()) = tokio::join!(r.read_exact(&mut got), late);
        read.unwrap();
        assert_eq!(&got, b"late");
        assert_eq!(r.polled, 0, "the bytes came through a parked read");
        r.disarm();
        drop(flight);

        let (ours, _theirs) = UnixStream::pair().unwrap();
        let s = PolledSocket::counted_in(ours, &FLIGHTS, &PARK);
        let flight = s.in_flight();
        let (budget, ticket) = s.choose_wait(Duration::from_secs(5));
        assert_eq!(budget, Duration::ZERO, "a same-node call chosen to park polls for nothing");
        assert!(ticket.is_some_and(|t| !t.polls()));
        let other = s.in_flight();
        let (budget, ticket) = s.choose_wait(Duration::from_secs(5));
        assert!(budget.is_zero() && ticket.is_none(), "beside another call nothing is chosen or learned");
        drop((flight, other));
        assert_eq!(FLIGHTS.load(Ordering::Acquire), 0);
    }

    /// A runtime as the Python client has one: its own worker threads, and calls run by a
    /// caller's thread in `block_on`.
    fn caller_runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap()
    }

    /// A peer that trickles its answer on `rt`: a byte every 2 ms, 1,000 bytes (2 s), until the
    /// reader goes away.
    fn trickle<W: AsyncWriteExt + Unpin + Send + 'static>(
        rt: &tokio::runtime::Runtime,
        mut peer: W,
    ) -> tokio::task::JoinHandle<()> {
        rt.spawn(async move {
            for _ in 0..1000 {
                if peer.write_all(b"x").await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
    }

    /// A peer on `rt` that sends half an answer and closes 40 ms later.
    fn dies_mid_answer<W: AsyncWriteExt + Unpin + Send + 'static>(
        rt: &tokio::runtime::Runtime,
        mut peer: W,
    ) -> tokio::task::JoinHandle<()> {
        rt.spawn(async move {
            peer.write_all(b"half").await.unwrap();
            tokio::time::sleep(Duration::from_millis(40)).await;
        })
    }

    /// An armed call's read of `N` bytes on a caller's thread, within `deadline`; how long it took.
    fn caller_read<const N: usize>(
        rt: &tokio::runtime::Runtime,
        r: &mut PolledRead,
        deadline: Duration,
    ) -> (Result<std::io::Result<()>, tokio::time::error::Elapsed>, Duration) {
        let t = Instant::now();
        let res = on_caller_thread(|| {
            rt.block_on(async {
                let _flight = r.arm(N as u64, Duration::from_secs(5));
                let mut got = [0u8; N];
                tokio::time::timeout(deadline, r.read_exact(&mut got)).await.map(|r| r.map(|_| ()))
            })
        });
        (res, t.elapsed())
    }

    /// [`caller_read`] of a same-node exchange.
    fn caller_exchange<const N: usize>(
        rt: &tokio::runtime::Runtime,
        s: &mut PolledSocket,
        deadline: Duration,
    ) -> (Result<std::io::Result<()>, tokio::time::error::Elapsed>, Duration) {
        let t = Instant::now();
        let res = on_caller_thread(|| {
            rt.block_on(s.exchange(async |s| {
                let mut got = [0u8; N];
                tokio::time::timeout(deadline, s.read_exact(&mut got)).await
            }))
        });
        (res, t.elapsed())
    }

    /// On a caller's thread an armed read with nothing to take sleeps in the kernel and wakes
    /// with its bytes; two armed reads joined on that thread (a striped load), any read off a
    /// caller's thread, and one beside many calls in flight wait through the driver instead.
    /// Every byte arrives either way, and the thread's count of armed reads is back to none
    /// after each call.
    #[test]
    fn on_a_caller_thread_an_armed_read_sleeps_in_the_kernel_alone_and_through_the_driver_beside_another() {
        static FLIGHTS: AtomicUsize = AtomicUsize::new(0);
        static PARK: Waits = Waits::fixed(Wait::Park);
        let rt = caller_runtime();
        let (mut r, theirs) = rt.block_on(tcp_pair(&FLIGHTS, &PARK));
        let (mut r2, theirs2) = rt.block_on(tcp_pair(&FLIGHTS, &PARK));
        let late = |mut peer: tokio::net::TcpStream, what: &'static [u8]| {
            rt.spawn(async move {
                tokio::time::sleep(Duration::from_millis(40)).await;
                peer.write_all(what).await.unwrap();
                peer
            })
        };
        let alone = |r: &mut PolledRead| {
            let flight = r.arm(4, Duration::from_secs(5));
            let mut got = [0u8; 4];
            rt.block_on(r.read_exact(&mut got)).unwrap();
            r.disarm();
            drop(flight);
            got
        };

        let writer = late(theirs, b"late");
        let t = Instant::now();
        let got = on_caller_thread(|| alone(&mut r));
        assert_eq!(&got, b"late");
        assert!(t.elapsed() >= Duration::from_millis(40));
        assert_eq!(r.kernel_waits, 1, "the bytes woke the thread's own wait");
        assert_eq!(CALLER_THREAD.with(Cell::get).armed, 0);
        assert!(!CALLER_THREAD.with(Cell::get).on, "the thread is an ordinary one again");

        let theirs = rt.block_on(writer).unwrap();
        let (w1, w2) = (late(theirs, b"str1"), late(theirs2, b"str2"));
        let (got1, got2) = on_caller_thread(|| {
            rt.block_on(async {
                let (f1, f2) = (r.arm(4, Duration::from_secs(5)), r2.arm(4, Duration::from_secs(5)));
                let (mut g1, mut g2) = ([0u8; 4], [0u8; 4]);
                let (a, b) = tokio::join!(r.read_exact(&mut g1), r2.read_exact(&mut g2));
                a.unwrap();
                b.unwrap();
                r.disarm();
                r2.disarm();
                drop((f1, f2));
                (g1, g2)
            })
        });
        assert_eq!((&got1, &got2), (b"str1", b"str2"));
        assert_eq!((r.kernel_waits, r2.kernel_waits), (1, 0), "joined reads waited through the driver");

        let writer = late(rt.block_on(w1).unwrap(), b"off!");
        assert_eq!(&alone(&mut r), b"off!");
        assert_eq!(r.kernel_waits, 1, "off a caller's thread the read parked as any tokio read");

        // Many calls in flight in the process (other threads'): the driver wakes this one too.
        let many = kernel_wait_limit();
        FLIGHTS.fetch_add(many, Ordering::AcqRel);
        let writer = late(rt.block_on(writer).unwrap(), b"many");
        assert_eq!(&on_caller_thread(|| alone(&mut r)), b"many");
        assert_eq!(r.kernel_waits, 1, "beside {many} other calls in flight the read waited through the driver");
        FLIGHTS.fetch_sub(many, Ordering::AcqRel);
        drop((rt.block_on(writer), rt.block_on(w2)));
        assert_eq!(FLIGHTS.load(Ordering::Acquire), 0);
    }

    /// A caller thread's read sleeping in the kernel wakes within its slice to let the call's
    /// deadline cut it: a silent peer is a timeout about when it is due, not a hang.
    #[test]
    fn a_caller_thread_s_wait_in_the_kernel_still_ends_at_the_call_s_deadline() {
        static FLIGHTS: AtomicUsize = AtomicUsize::new(0);
        static PARK: Waits = Waits::fixed(Wait::Park);
        let rt = caller_runtime();
        let (mut r, _silent) = rt.block_on(tcp_pair(&FLIGHTS, &PARK));
        let (res, took) = caller_read::<4>(&rt, &mut r, Duration::from_millis(100));
        assert!(res.is_err(), "nothing came, so the deadline ended the read: {res:?}");
        assert!(took >= Duration::from_millis(100) && took < Duration::from_secs(2), "cut after {took:?}");
        assert_eq!(r.kernel_waits, 0);
        assert_eq!(FLIGHTS.load(Ordering::Acquire), 0);
        assert_eq!(CALLER_THREAD.with(Cell::get).armed, 0);

        // A peer trickling its answer, a byte every 2 ms (1,000 bytes: 2 s): each sleep ends
        // with bytes, and the read still lets its task go often enough for the deadline to cut it.
        let (mut r, peer) = rt.block_on(tcp_pair(&FLIGHTS, &PARK));
        let trickling = trickle(&rt, peer);
        let (res, took) = caller_read::<1000>(&rt, &mut r, Duration::from_millis(100));
        assert!(res.is_err(), "the trickle outlasted the deadline: {res:?}");
        assert!(took < Duration::from_secs(1), "a trickling peer held the call {took:?} past a 100 ms deadline");
        assert!(r.kernel_waits > 0, "its bytes woke kernel waits");
        drop(r);
        let _ = rt.block_on(trickling);

        // A peer that dies mid-answer: the sleeping read wakes and says the stream ended.
        let (mut r, peer) = rt.block_on(tcp_pair(&FLIGHTS, &PARK));
        let dies = dies_mid_answer(&rt, peer);
        let (res, _) = caller_read::<8>(&rt, &mut r, Duration::from_secs(5));
        let err = res.expect("the end of the stream, not the deadline").unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof, "{err}");
        assert!(r.kernel_waits > 0, "the close woke the read's own wait");
        rt.block_on(dies).unwrap();
    }

    /// A same-node exchange on a caller's thread waits for its answer in the kernel and gets
    /// every byte, the ones polled ahead first; a silent server is still cut by the deadline;
    /// off a caller's thread, or outside an exchange, reads wait through the driver.
    #[test]
    fn a_same_node_exchange_on_a_caller_thread_waits_in_the_kernel_until_its_deadline() {
        static FLIGHTS: AtomicUsize = AtomicUsize::new(0);
        let rt = caller_runtime();
        let (ours, theirs) = rt.block_on(async { UnixStream::pair() }).unwrap();
        let mut s = PolledSocket::counted_in(ours, &FLIGHTS, &SAMENODE_WAITS);
        let late = |mut peer: UnixStream, what: &'static [u8]| {
            rt.spawn(async move {
                peer.write_all(&what[..2]).await.unwrap();
                tokio::time::sleep(Duration::from_millis(40)).await;
                peer.write_all(&what[2..]).await.unwrap();
                peer
            })
        };
        let writer = late(theirs, b"answer");
        let got = on_caller_thread(|| {
            rt.block_on(s.exchange(async |s| {
                while !s.poll_for_answer(Duration::from_secs(1)).await {}
                let mut got = [0u8; 6];
                s.read_exact(&mut got).await.map(|()| got)
            }))
        })
        .unwrap();
        assert_eq!(&got, b"answer");
        assert_eq!(s.kernel_waits, 1, "the late bytes woke the thread's own wait");
        assert!(!s.armed && FLIGHTS.load(Ordering::Acquire) == 0);

        let (cut, took) = caller_exchange::<4>(&rt, &mut s, Duration::from_millis(100));
        assert!(cut.is_err(), "nothing came: {cut:?}");
        assert!(took >= Duration::from_millis(100) && took < Duration::from_secs(2), "cut after {took:?}");

        // A byte every 2 ms (1,000 bytes: 2 s) is cut by the deadline too.
        let (ours, peer) = rt.block_on(async { UnixStream::pair() }).unwrap();
        let mut trickled = PolledSocket::counted_in(ours, &FLIGHTS, &SAMENODE_WAITS);
        let trickling = trickle(&rt, peer);
        let (cut, took) = caller_exchange::<1000>(&rt, &mut trickled, Duration::from_millis(100));
        assert!(cut.is_err(), "the trickle outlasted the deadline: {cut:?}");
        assert!(took < Duration::from_secs(1), "a trickling peer held the call {took:?} past a 100 ms deadline");
        assert!(trickled.kernel_waits > 0);
        drop(trickled);
        let _ = rt.block_on(trickling);

        // A server that dies mid-answer: the sleeping read wakes and says the stream ended.
        let (ours, peer) = rt.block_on(async { UnixStream::pair() }).unwrap();
        let mut orphan = PolledSocket::counted_in(ours, &FLIGHTS, &SAMENODE_WAITS);
        let dies = dies_mid_answer(&rt, peer);
        let (res, _) = caller_exchange::<8>(&rt, &mut orphan, Duration::from_secs(5));
        let err = res.expect("the end of the stream, not the deadline").unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof, "{err}");
        assert!(orphan.kernel_waits > 0, "the close woke the read's own wait");
        rt.block_on(dies).unwrap();

        let writer = late(rt.block_on(writer).unwrap(), b"plain!");
        let mut got = [0u8; 6];
        on_caller_thread(|| rt.block_on(s.read_exact(&mut got))).unwrap();
        assert_eq!(&got, b"plain!");
        assert_eq!(s.kernel_waits, 1, "outside an exchange the read parked as any tokio read");
        drop(rt.block_on(writer));
    }

    #[tokio::test]
    async fn a_poll_with_nothing_to_read_gives_up_after_its_budget_and_the_read_then_waits() {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let mut s = PolledSocket::new(ours);
        let t = Instant::now();
        assert!(!s.poll_for_answer(Duration::from_millis(20)).await, "nothing was sent");
        let took = t.elapsed();
        assert!(
            took >= Duration::from_millis(20) && took < Duration::from_secs(2),
            "polled {took:?} for a 20 ms budget"
        );
        assert!(!s.poll_for_answer(Duration::ZERO).await, "a zero budget does not poll");
        let writer = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(30)).await;
            theirs.write_all(b"late").await.unwrap();
            theirs
        });
        let mut got = [0u8; 4];
        s.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"late");
        // The peer's close: a poll finds nothing, and the read reports the end.
        drop(writer.await.unwrap());
        assert!(!s.poll_for_answer(Duration::from_millis(20)).await);
        let err = s.read_exact(&mut got).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof);
    }
}
