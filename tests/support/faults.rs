//! A fault-injecting byte stream for tests: [`Faults::wrap`] puts any `AsyncRead + AsyncWrite`
//! stream (an in-memory duplex, a Unix or TCP socket) behind a shared [`Faults`] handle through
//! which a test, at any moment, delays each read and write, stalls the stream (no bytes move
//! until released or a deadline), cuts it after N more bytes in one direction, or flips one byte
//! at an offset in one direction.
//!
//! It lives in the test-support crate, not behind a feature of a shipped crate: only tests use
//! it, so no shipped crate carries it or a feature flag for it, and it needs nothing of kvtier's
//! (any stream, any protocol), so server, client and cluster tests all use this one.
//!
//! Directions are seen from the wrapped end: `Write` is what its owner sends, `Read` what it
//! receives. Offsets count the bytes that passed through every stream of one handle, in the order
//! they passed, from when the fault was set: a handle shared by several streams (a link the client
//! pool opens connections over) counts them together.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// Which way bytes move, seen from the wrapped end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    /// Bytes the wrapped end's owner receives.
    Read = 0,
    /// Bytes the wrapped end's owner sends.
    Write = 1,
}

#[derive(Default)]
struct Shared {
    delay: Option<Duration>,
    /// `Some(None)`: stalled until released; `Some(Some(t))`: until `t`.
    stall: Option<Option<Instant>>,
    /// Streams waiting for a stall's release (deduplicated; bounded by the streams of the handle).
    stalled: Vec<Waker>,
    /// Bytes moved per direction since the handle was made.
    moved: [u64; 2],
    /// Per direction, the `moved` count at which the direction ends.
    cut_at: [Option<u64>; 2],
    /// Per direction, the `moved` count of the byte to flip and the mask to flip it with.
    corrupt_at: [Option<(u64, u8)>; 2],
    /// Bytes flipped so far.
    corrupted: u64,
}

/// The shared handle of one link's faults. Cheap to clone; clones control the same faults.
#[derive(Clone, Default)]
pub struct Faults(Arc<Mutex<Shared>>);

impl Faults {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        // A panicking test thread can't leave `Shared` half-updated in a way that matters here.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Puts `stream` behind these faults.
    pub fn wrap<S>(&self, stream: S) -> FaultyStream<S> {
        FaultyStream {
            inner: stream,
            faults: self.clone(),
            delay: [None, None],
            delayed: [false; 2],
            stall_timer: None,
        }
    }

    /// Every read and every write waits `delay` first (`None`: no delay).
    pub fn set_delay(&self, delay: Option<Duration>) {
        self.lock().delay = delay;
    }

    /// No byte moves either way until [`Faults::release`] (or [`Faults::clear`]).
    pub fn stall(&self) {
        self.lock().stall = Some(None);
    }

    /// No byte moves either way for `d` (or until released).
    pub fn stall_for(&self, d: Duration) {
        self.lock().stall = Some(Some(Instant::now() + d));
    }

    /// Ends a stall; stalled streams resume.
    pub fn release(&self) {
        let wakers = {
            let mut s = self.lock();
            s.stall = None;
            std::mem::take(&mut s.stalled)
        };
        wakers.into_iter().for_each(Waker::wake);
    }

    /// After `n` more bytes in `dir`, that direction ends: reads see end of stream, writes fail
    /// with `BrokenPipe`. Stays until [`Faults::clear`]: streams opened later end at once.
    pub fn cut_after(&self, dir: Dir, n: u64) {
        let mut s = self.lock();
        s.cut_at[dir as usize] = Some(s.moved[dir as usize] + n);
    }

    /// Cuts both directions now.
    pub fn cut(&self) {
        self.cut_after(Dir::Read, 0);
        self.cut_after(Dir::Write, 0);
    }

    /// Flips (xor `mask`, non-zero) the byte `n` bytes from now in `dir`; once.
    pub fn corrupt_at(&self, dir: Dir, n: u64, mask: u8) {
        assert_ne!(mask, 0, "a zero mask flips nothing");
        let mut s = self.lock();
        s.corrupt_at[dir as usize] = Some((s.moved[dir as usize] + n, mask));
    }

    /// Turns every fault off and wakes stalled streams.
    pub fn clear(&self) {
        {
            let mut s = self.lock();
            s.delay = None;
            s.cut_at = [None, None];
            s.corrupt_at = [None, None];
        }
        self.release();
    }

    /// Bytes moved in `dir` through this handle's streams so far.
    pub fn moved(&self, dir: Dir) -> u64 {
        self.lock().moved[dir as usize]
    }

    /// Bytes flipped so far.
    pub fn corrupted(&self) -> u64 {
        self.lock().corrupted
    }
}

/// A stream behind a [`Faults`] handle.
pub struct FaultyStream<S> {
    inner: S,
    faults: Faults,
    /// The pending delay of each direction.
    delay: [Option<Pin<Box<Sleep>>>; 2],
    /// The delay of the operation in progress has elapsed (reset when the operation completes).
    delayed: [bool; 2],
    stall_timer: Option<Pin<Box<Sleep>>>,
}

/// What one operation may do, decided under the lock.
struct Allowance {
    /// Most bytes it may move (`None`: no limit).
    limit: Option<u64>,
    /// Offset of the byte to flip within this operation, if it falls in the limit, and its mask.
    flip: Option<(u64, u8)>,
}

impl<S> FaultyStream<S> {
    /// Waits out a stall or a delay; then says how much the operation may move.
    fn gate(&mut self, dir: Dir, cx: &mut Context<'_>) -> Poll<Allowance> {
        let d = dir as usize;
        let delay = {
            let mut s = self.faults.lock();
            if let Some(until) = s.stall {
                if until.is_some_and(|t| Instant::now() >= t) {
                    s.stall = None;
                    std::mem::take(&mut s.stalled).into_iter().for_each(Waker::wake);
                } else {
                    if !s.stalled.iter().any(|w| w.will_wake(cx.waker())) {
                        s.stalled.push(cx.waker().clone());
                    }
                    drop(s);
                    if let Some(t) = until {
                        let timer = self.stall_timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(t)));
                        timer.as_mut().reset(t);
                        if timer.as_mut().poll(cx).is_ready() {
                            cx.waker().wake_by_ref();
                        }
                    }
                    return Poll::Pending;
                }
            }
            s.delay
        };
        if let (Some(delay), false) = (delay, self.delayed[d]) {
            let sleep = self.delay[d].get_or_insert_with(|| Box::pin(tokio::time::sleep(delay)));
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            self.delay[d] = None;
            self.delayed[d] = true;
        }
        let s = self.faults.lock();
        let at = s.moved[d];
        let limit = s.cut_at[d].map(|c| c.saturating_sub(at));
        let flip = s.corrupt_at[d].filter(|(c, _)| *c >= at).map(|(c, m)| (c - at, m));
        Poll::Ready(Allowance { limit, flip })
    }

    /// Counts `n` bytes moved in `dir` (the operation is complete: the next one is delayed anew).
    fn moved(&mut self, dir: Dir, n: u64, flipped: bool) {
        self.delayed[dir as usize] = false;
        let mut s = self.faults.lock();
        s.moved[dir as usize] += n;
        if flipped {
            s.corrupt_at[dir as usize] = None;
            s.corrupted += 1;
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for FaultyStream<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let allow = match this.gate(Dir::Read, cx) {
            Poll::Ready(a) => a,
            Poll::Pending => return Poll::Pending,
        };
        let room = buf.remaining() as u64;
        let max = allow.limit.map_or(room, |l| l.min(room));
        if max == 0 && room > 0 {
            // Cut: the end of the stream.
            this.moved(Dir::Read, 0, false);
            return Poll::Ready(Ok(()));
        }
        let start = buf.filled().len();
        let n = if max < room {
            let window = buf.initialize_unfilled_to(max as usize);
            let mut sub = ReadBuf::new(window);
            match Pin::new(&mut this.inner).poll_read(cx, &mut sub) {
                Poll::Ready(Ok(())) => {}
                other => return other,
            }
            let n = sub.filled().len();
            buf.advance(n);
            n
        } else {
            match Pin::new(&mut this.inner).poll_read(cx, buf) {
                Poll::Ready(Ok(())) => {}
                other => return other,
            }
            buf.filled().len() - start
        };
        let mut flipped = false;
        if let Some((off, mask)) = allow.flip {
            if off < n as u64 {
                buf.filled_mut()[start + off as usize] ^= mask;
                flipped = true;
            }
        }
        this.moved(Dir::Read, n as u64, flipped);
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for FaultyStream<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let allow = match this.gate(Dir::Write, cx) {
            Poll::Ready(a) => a,
            Poll::Pending => return Poll::Pending,
        };
        let mut max = allow.limit.map_or(buf.len() as u64, |l| l.min(buf.len() as u64));
        if max == 0 && !buf.is_empty() {
            this.moved(Dir::Write, 0, false);
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::BrokenPipe, "link cut (fault injection)")));
        }
        if let Some((off, mask)) = allow.flip {
            if off == 0 && max > 0 {
                // The flipped byte goes out on its own.
                let byte = [buf[0] ^ mask];
                return match Pin::new(&mut this.inner).poll_write(cx, &byte) {
                    Poll::Ready(Ok(n)) => {
                        this.moved(Dir::Write, n as u64, n == 1);
                        Poll::Ready(Ok(n))
                    }
                    other => other,
                };
            }
            max = max.min(off);
        }
        match Pin::new(&mut this.inner).poll_write(cx, &buf[..max as usize]) {
            Poll::Ready(Ok(n)) => {
                this.moved(Dir::Write, n as u64, false);
                Poll::Ready(Ok(n))
            }
            other => other,
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn a_flipped_byte_lands_at_its_offset_in_either_direction() {
        let (a, mut b) = tokio::io::duplex(1 << 16);
        let f = Faults::new();
        let mut a = f.wrap(a);
        f.corrupt_at(Dir::Write, 1000, 0x01);
        a.write_all(&[0u8; 4096]).await.unwrap();
        let mut got = vec![0u8; 4096];
        b.read_exact(&mut got).await.unwrap();
        let flipped: Vec<usize> = got.iter().enumerate().filter(|(_, x)| **x != 0).map(|(i, _)| i).collect();
        assert_eq!(flipped, vec![1000]);

        f.corrupt_at(Dir::Read, 7, 0x80);
        b.write_all(&[0u8; 64]).await.unwrap();
        let mut got = [0u8; 64];
        a.read_exact(&mut got).await.unwrap();
        assert_eq!(got.iter().position(|x| *x == 0x80), Some(7));
        assert_eq!(f.corrupted(), 2);
    }

    #[tokio::test]
    async fn a_cut_ends_the_direction_after_n_bytes() {
        let (a, mut b) = tokio::io::duplex(1 << 16);
        let f = Faults::new();
        let mut a = f.wrap(a);
        f.cut_after(Dir::Write, 10);
        let err = a.write_all(&[7u8; 100]).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::BrokenPipe);
        f.cut_after(Dir::Read, 3);
        b.write_all(&[1u8; 20]).await.unwrap();
        let mut got = Vec::new();
        a.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, vec![1u8; 3]);
        let mut sent = [0u8; 10];
        b.read_exact(&mut sent).await.unwrap();
        assert_eq!(sent, [7u8; 10]);
    }

    #[tokio::test]
    async fn a_stall_holds_bytes_until_released_or_its_deadline() {
        let (a, mut b) = tokio::io::duplex(1 << 16);
        let f = Faults::new();
        let mut a = f.wrap(a);
        f.stall();
        let mut one = [0u8; 1];
        b.write_all(b"x").await.unwrap();
        assert!(tokio::time::timeout(Duration::from_millis(100), a.read_exact(&mut one)).await.is_err());
        let f2 = f.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            f2.release();
        });
        tokio::time::timeout(Duration::from_secs(5), a.read_exact(&mut one)).await.unwrap().unwrap();
        f.stall_for(Duration::from_millis(100));
        let t = std::time::Instant::now();
        b.write_all(b"y").await.unwrap();
        tokio::time::timeout(Duration::from_secs(5), a.read_exact(&mut one)).await.unwrap().unwrap();
        assert!(t.elapsed() >= Duration::from_millis(90), "{:?}", t.elapsed());
        assert_eq!(&one, b"y");
    }

    #[tokio::test]
    async fn a_delay_slows_each_operation() {
        let (a, mut b) = tokio::io::duplex(1 << 16);
        let f = Faults::new();
        let mut a = f.wrap(a);
        f.set_delay(Some(Duration::from_millis(30)));
        let t = std::time::Instant::now();
        for _ in 0..3 {
            a.write_all(b"abc").await.unwrap();
        }
        assert!(t.elapsed() >= Duration::from_millis(85), "{:?}", t.elapsed());
        let mut got = [0u8; 9];
        b.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"abcabcabc");
    }
}
