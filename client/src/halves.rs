//! A data connection's socket as two halves on descriptors of their own, each registered with
//! the runtime only for what it waits on: the send half ([`SendHalf`]) for write readiness, the
//! receive half ([`RecvHalf`]) for read readiness only while a read waits through the I/O driver.
//!
//! tokio registers a `TcpStream` or `UnixStream` for both directions for its whole life, and an
//! edge-triggered epoll wakes the driver's thread (asleep in `epoll_wait`) for every arrival on a
//! registered socket, waited on or not. A caller thread that takes its answers by `poll(2)` on
//! the socket itself ([`crate::polled::on_caller_thread`]) would then wake two threads per answer,
//! itself and the driver; with these halves, only itself.

use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};

/// Splits a connected socket (in non-blocking mode, as tokio leaves one) into its receive and
/// send halves: the socket itself sends, a duplicate of its descriptor receives (the duplicate
/// shares the non-blocking flag, a file status flag).
pub(crate) fn split<S>(
    sock: S,
    dup: impl FnOnce(&S) -> std::io::Result<S>,
) -> std::io::Result<(RecvHalf<S>, SendHalf<S>)>
where
    S: AsRawFd + AsFd,
    for<'a> &'a S: Write,
{
    let recv = dup(&sock)?;
    Ok((RecvHalf::new(recv), SendHalf::new(sock)?))
}

/// A TCP stream's halves ([`split`]).
pub(crate) fn split_tcp(
    sock: tokio::net::TcpStream,
) -> std::io::Result<(RecvHalf<std::net::TcpStream>, SendHalf<std::net::TcpStream>)> {
    split(sock.into_std()?, std::net::TcpStream::try_clone)
}

/// A Unix stream's halves ([`split`]).
pub(crate) fn split_unix(
    sock: tokio::net::UnixStream,
) -> std::io::Result<(RecvHalf<std::os::unix::net::UnixStream>, SendHalf<std::os::unix::net::UnixStream>)> {
    split(sock.into_std()?, std::os::unix::net::UnixStream::try_clone)
}

/// A socket's send half, registered with the runtime for write readiness only: bytes arriving
/// on the socket never wake the I/O driver for it.
pub(crate) struct SendHalf<S: AsRawFd>(AsyncFd<S>);

impl<S> SendHalf<S>
where
    S: AsRawFd + AsFd,
    for<'a> &'a S: Write,
{
    fn new(sock: S) -> std::io::Result<Self> {
        // SAFETY: the `AsyncFd` owns `sock`, whose descriptor stays open and the same until the
        // `AsyncFd` drops (it deregisters first, then closes it).
        Ok(SendHalf(unsafe { AsyncFd::register_with_interest(sock, Interest::WRITABLE) }?))
    }

    /// The socket, for what bypasses the byte stream (a message with a descriptor attached).
    pub(crate) fn socket(&self) -> &AsyncFd<S> {
        &self.0
    }

    /// Writes with `op` once the socket has room, waiting through the driver while it has none.
    fn poll_send(
        &self,
        cx: &mut Context<'_>,
        mut op: impl FnMut(&S) -> std::io::Result<usize>,
    ) -> Poll<std::io::Result<usize>> {
        loop {
            let mut ready = std::task::ready!(self.0.poll_write_ready(cx))?;
            if let Ok(done) = ready.try_io(|s| op(s.get_ref())) {
                return Poll::Ready(done);
            }
        }
    }
}

impl<S> AsyncWrite for SendHalf<S>
where
    S: AsRawFd + AsFd + Unpin,
    for<'a> &'a S: Write,
{
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        self.poll_send(cx, |mut s| s.write(buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        self.poll_send(cx, |mut s| s.write_vectored(bufs))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        // Nothing is buffered here: a write is in the socket when it returns.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(rustix::net::shutdown(self.0.get_ref(), rustix::net::Shutdown::Write).map_err(Into::into))
    }
}

/// A socket's receive half: non-blocking `recv`s straight from the socket, and reads that wait
/// through the I/O driver ([`AsyncRead`]), for which it registers for read readiness — until
/// [`RecvHalf::unregister`], called by a read that waits in the kernel instead.
pub(crate) struct RecvHalf<S: AsRawFd> {
    /// The registration, while reads wait through the driver. Declared before `sock`, so that it
    /// is dropped (deregistered) while the descriptor is still open.
    driver: Option<AsyncFd<RawFd>>,
    sock: S,
}

impl<S: AsRawFd + AsFd> RecvHalf<S> {
    fn new(sock: S) -> Self {
        RecvHalf { driver: None, sock }
    }

    /// The socket's descriptor (to wait on it in the kernel).
    pub(crate) fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.sock.as_fd()
    }

    /// One non-blocking `recv` into `buf`'s unfilled part: how many bytes came (0 at the end of
    /// the stream), `WouldBlock` when none are there yet.
    pub(crate) fn recv(&self, buf: &mut ReadBuf<'_>) -> std::io::Result<usize> {
        recv_from(&self.sock, buf)
    }

    /// [`RecvHalf::recv`] into a byte slice.
    pub(crate) fn recv_slice(&self, out: &mut [u8]) -> std::io::Result<usize> {
        self.recv(&mut ReadBuf::new(out))
    }

    /// Drops the registration for read readiness, if a read made one: arrivals no longer wake
    /// the driver. The next read through the driver registers again.
    pub(crate) fn unregister(&mut self) {
        self.driver = None;
    }

    /// Whether the socket is registered for read readiness now.
    #[cfg(test)]
    pub(crate) fn registered(&self) -> bool {
        self.driver.is_some()
    }
}

impl<S: AsRawFd + AsFd + Unpin> AsyncRead for RecvHalf<S> {
    /// A read that waits through the I/O driver, registering the socket for read readiness first
    /// if it is not.
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        let driver = match this.driver.take() {
            Some(driver) => driver,
            None => {
                let fd = this.sock.as_raw_fd();
                // SAFETY: `fd` is `this.sock`'s, open until `this` drops; the registration lives
                // in `this.driver`, which is dropped before `this.sock` (the fields' order) and
                // otherwise only ever emptied, so it never outlives the descriptor.
                unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }?
            }
        };
        let driver = this.driver.insert(driver);
        loop {
            let mut ready = std::task::ready!(driver.poll_read_ready(cx))?;
            // `RecvHalf::recv`'s, on the field (`this.driver` is borrowed).
            if let Ok(done) = ready.try_io(|_| recv_from(&this.sock, buf)) {
                return Poll::Ready(done.map(|_| ()));
            }
        }
    }
}

/// One non-blocking `recv` from `sock` into `buf`'s unfilled part ([`RecvHalf::recv`]).
fn recv_from(sock: &impl AsFd, buf: &mut ReadBuf<'_>) -> std::io::Result<usize> {
    loop {
        // SAFETY: `recv` only writes into the slice, never de-initializing a byte of it, and
        // `init` is the part it wrote, which is what `assume_init` and `advance` are told.
        let unfilled = unsafe { buf.unfilled_mut() };
        match rustix::net::recv(sock.as_fd(), unfilled, rustix::net::RecvFlags::DONTWAIT) {
            Ok(((init, _), _)) => {
                let n = init.len();
                // SAFETY: `recv` initialized these `n` bytes of the unfilled part (above).
                unsafe { buf.assume_init(n) };
                buf.advance(n);
                return Ok(n);
            }
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
}
