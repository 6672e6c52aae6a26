//! [`GatherWriter`]: a write buffer for small pieces (headers, statuses) that sends a large piece
//! (a block's payload) together with what is buffered in one vectored write.
//!
//! tokio's `BufWriter` flushes its buffer before passing a large write through, so a served block
//! cost two sends: the status and frame header alone (a tiny TCP segment the peer wakes up for),
//! then the payload. Here the buffered bytes and the payload go out in one `writev`, and the peer
//! gets the header and the start of the payload in one segment. No payload byte is copied.

use std::io::{self, IoSlice};

use tokio::io::{AsyncWrite, AsyncWriteExt};

/// Buffers small writes up to its capacity; a write that would not fit is sent with the buffered
/// bytes in one vectored write (a small one after a flush of the buffer, a large one straight
/// from the caller's memory).
pub struct GatherWriter<W> {
    inner: W,
    buf: Vec<u8>,
    cap: usize,
}

impl<W: AsyncWrite + Unpin> GatherWriter<W> {
    pub fn with_capacity(cap: usize, inner: W) -> Self {
        GatherWriter { inner, buf: Vec::with_capacity(cap), cap }
    }

    /// Queues `data`, sending it (with what is buffered) at once when it doesn't fit the buffer.
    pub async fn write_all(&mut self, data: &[u8]) -> io::Result<()> {
        if self.buf.len() + data.len() <= self.cap {
            self.buf.extend_from_slice(data);
            return Ok(());
        }
        if data.len() < self.cap / 2 {
            // Small: one send of the full buffer, then keep buffering.
            self.send_buffered().await?;
            self.buf.extend_from_slice(data);
            return Ok(());
        }
        self.send_with(data).await
    }

    /// Sends everything buffered and flushes the stream.
    pub async fn flush(&mut self) -> io::Result<()> {
        self.send_buffered().await?;
        self.inner.flush().await
    }

    async fn send_buffered(&mut self) -> io::Result<()> {
        if !self.buf.is_empty() {
            self.inner.write_all(&self.buf).await?;
            self.buf.clear();
        }
        Ok(())
    }

    /// One vectored write of the buffer and `data` (repeated on partial writes), leaving the
    /// buffer empty.
    async fn send_with(&mut self, data: &[u8]) -> io::Result<()> {
        let (mut head, mut tail) = (0usize, 0usize);
        while head < self.buf.len() || tail < data.len() {
            let n = if head < self.buf.len() {
                let parts = [IoSlice::new(&self.buf[head..]), IoSlice::new(&data[tail..])];
                self.inner.write_vectored(&parts).await?
            } else {
                self.inner.write(&data[tail..]).await?
            };
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            let from_head = n.min(self.buf.len() - head);
            head += from_head;
            tail += n - from_head;
        }
        self.buf.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    /// A writer that takes at most `step` bytes per call and no vectored writes: every partial
    /// path of `send_with` runs.
    struct Trickle {
        out: Vec<u8>,
        step: usize,
    }

    impl AsyncWrite for Trickle {
        fn poll_write(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            data: &[u8],
        ) -> std::task::Poll<io::Result<usize>> {
            let n = data.len().min(self.step);
            self.out.extend_from_slice(&data[..n]);
            std::task::Poll::Ready(Ok(n))
        }
        fn poll_flush(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
        fn poll_shutdown(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn bytes_arrive_in_order_whatever_the_piece_sizes() {
        let pieces: Vec<Vec<u8>> = [1usize, 80, 5000, 3, 70_000, 1, 200, 64, 300_000, 7]
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n).map(|j| (i * 31 + j) as u8).collect())
            .collect();
        let want: Vec<u8> = pieces.concat();
        for step in [1usize, 7, 4096, 1 << 20] {
            let mut w = GatherWriter::with_capacity(4096, Trickle { out: Vec::new(), step });
            for p in &pieces {
                w.write_all(p).await.unwrap();
            }
            w.flush().await.unwrap();
            assert!(w.inner.out == want, "step {step}");
        }
    }

    #[tokio::test]
    async fn a_header_and_its_payload_leave_in_one_vectored_write() {
        let (a, mut b) = tokio::net::UnixStream::pair().unwrap();
        let mut w = GatherWriter::with_capacity(64 << 10, a);
        w.write_all(&[9u8; 90]).await.unwrap();
        assert_eq!(w.buf.len(), 90, "a small piece waits in the buffer");
        w.write_all(&[7u8; 100_000]).await.unwrap();
        assert!(w.buf.is_empty(), "a large piece goes out with the buffer");
        let mut got = vec![0u8; 100_090];
        b.read_exact(&mut got).await.unwrap();
        assert!(got[..90].iter().all(|&x| x == 9) && got[90..].iter().all(|&x| x == 7));
    }
}
