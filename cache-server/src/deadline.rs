//! Progress deadlines for a client's byte stream: a read or a write that moves no byte for longer
//! than the current budget fails with `TimedOut`, so a client that stops sending mid-frame, or
//! stops reading what it asked for, can't hold a connection, its reserved slot or the blocks being
//! sent to it. The budget is switched between a long one while the connection waits for its next
//! request (idle) and a short one inside a request (stalled).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// A stream half with a progress deadline in each direction.
pub struct Deadlined<S> {
    inner: S,
    budget: Duration,
    /// Armed while an operation waits; re-armed after each byte moved.
    timer: Pin<Box<Sleep>>,
    armed: bool,
}

impl<S> Deadlined<S> {
    pub fn new(inner: S, budget: Duration) -> Self {
        Deadlined { inner, budget, timer: Box::pin(tokio::time::sleep(budget)), armed: false }
    }

    /// The stream inside.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Sets the budget for the operations that follow (and restarts the clock).
    pub fn set_budget(&mut self, budget: Duration) {
        self.budget = budget;
        self.armed = false;
    }

    /// While `poll` is pending: fails once the budget is spent with no progress.
    fn check(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        if !self.armed {
            let at = Instant::now() + self.budget;
            self.timer.as_mut().reset(at);
            self.armed = true;
        }
        match self.timer.as_mut().poll(cx) {
            Poll::Ready(()) => {
                Poll::Ready(io::Error::new(io::ErrorKind::TimedOut, format!("no progress for {:?}", self.budget)))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Deadlined<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(r) => {
                this.armed = false;
                Poll::Ready(r)
            }
            Poll::Pending => this.check(cx).map(Err),
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Deadlined<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_write(cx, data) {
            Poll::Ready(r) => {
                this.armed = false;
                Poll::Ready(r)
            }
            Poll::Pending => this.check(cx).map(Err),
        }
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_write_vectored(cx, bufs) {
            Poll::Ready(r) => {
                this.armed = false;
                Poll::Ready(r)
            }
            Poll::Pending => this.check(cx).map(Err),
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_flush(cx) {
            Poll::Ready(r) => {
                this.armed = false;
                Poll::Ready(r)
            }
            Poll::Pending => this.check(cx).map(Err),
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[tokio::test]
    async fn a_stalled_read_times_out_and_progress_resets_the_clock() {
        let (mut peer, mine) = tokio::io::duplex(64);
        // A budget four times the writer's pauses: a loaded machine stretching a 100 ms sleep
        // to 150 ms (it did) must not fail the read.
        let mut d = Deadlined::new(mine, Duration::from_millis(400));
        // Bytes every 100 ms: each read makes progress within the budget, 800 ms in all.
        let writer = tokio::spawn(async move {
            for i in 0..8u8 {
                tokio::time::sleep(Duration::from_millis(100)).await;
                peer.write_all(&[i]).await.unwrap();
            }
            peer
        });
        let mut got = [0u8; 8];
        d.read_exact(&mut got).await.unwrap();
        assert_eq!(got, [0, 1, 2, 3, 4, 5, 6, 7]);
        let _peer = writer.await.unwrap();
        // Then nothing: the next read fails after the budget, not before.
        let t = Instant::now();
        let e = d.read_u8().await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(t.elapsed() >= Duration::from_millis(390), "{:?}", t.elapsed());
        // A longer budget (idle between requests) waits longer.
        d.set_budget(Duration::from_millis(800));
        let t = Instant::now();
        assert!(d.read_u8().await.is_err());
        assert!(t.elapsed() >= Duration::from_millis(790), "{:?}", t.elapsed());
    }

    #[tokio::test]
    async fn a_peer_that_stops_reading_fails_the_writer() {
        let (_peer, mine) = tokio::io::duplex(1024);
        let mut d = Deadlined::new(mine, Duration::from_millis(100));
        let e = d.write_all(&[7u8; 64 * 1024]).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
    }
}
