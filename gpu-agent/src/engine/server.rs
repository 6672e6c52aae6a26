//! The engine socket: a Unix listener, one thread per engine connection (at most
//! `max_connections`), each reading requests ([`super::proto`]) with the descriptors that come
//! with them (`SCM_RIGHTS`, at most [`MAX_PENDING_FDS`] waiting) and handing them to its
//! [`Session`]. A descriptor belongs to the request whose bytes it came with: a memfd
//! `REGISTER` takes the first of its own, and every other one (sent with any other request, a
//! refused one, or in excess) is closed once its request is done, so a stray descriptor can
//! never be taken for a later registration's memory. A connection idle past `idle_timeout`, or that stalls mid-request or mid-answer
//! past `io_timeout`, is closed, and its session gives back what it held. A request larger than
//! [`MAX_BODY`] is refused and the connection closed (its body is never read).

use std::collections::VecDeque;
use std::io::{IoSliceMut, Write};
use std::mem::MaybeUninit;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use std::os::fd::OwnedFd;

use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};

use super::proto::{
    decode_request, encode_refusal, BufferSource, Header, Op, Refusal, Request, Status, HEADER_LEN, MAX_BODY,
};
use super::{Agent, BackingStore, Session};
use crate::device::Device;

/// Descriptors received and not yet claimed by a REGISTER; more closes the connection.
pub const MAX_PENDING_FDS: usize = 4;

/// A connection's read buffer; a longer body (up to [`MAX_BODY`]) grows it while it is read.
const READ_BUF: usize = 64 << 10;

/// A running engine socket. Dropping it stops accepting (open connections run until they end)
/// and removes its socket file, if that is still its own.
pub struct EngineServer {
    path: PathBuf,
    /// The socket file's (device, inode) as bound: another agent's file there later is not ours
    /// to remove.
    file_id: (u64, u64),
    /// The listener, to shut down when dropped (wakes the accept loop even with the file gone).
    listener: UnixListener,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

impl EngineServer {
    /// Listens at `path` (a stale socket file there is replaced; one another process listens on
    /// is refused, `AddrInUse`; mode 0600) and serves `agent`.
    pub fn bind<D: Device, B: BackingStore>(agent: Arc<Agent<D, B>>, path: &Path) -> std::io::Result<Self> {
        let first = agent.device().ordinal();
        Self::bind_device(agent, first, path)
    }

    /// Listens at `path` for engines on device `device` of the agent's node (one socket per
    /// device); an ordinal not on the node is refused.
    pub fn bind_device<D: Device, B: BackingStore>(
        agent: Arc<Agent<D, B>>,
        device: crate::DeviceOrdinal,
        path: &Path,
    ) -> std::io::Result<Self> {
        if !agent.devices().iter().any(|d| d.ordinal() == device) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("device {device} is not on the agent's node"),
            ));
        }
        if path.exists() {
            if UnixStream::connect(path).is_ok() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::AddrInUse,
                    format!(
                        "{} is in use: another agent listens there (give this one its own --socket)",
                        path.display()
                    ),
                ));
            }
            std::fs::remove_file(path)?;
        }
        let listener = UnixListener::bind(path)?;
        std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
        let file_id = {
            let m = std::fs::metadata(path)?;
            (std::os::unix::fs::MetadataExt::dev(&m), std::os::unix::fs::MetadataExt::ino(&m))
        };
        let kept = listener.try_clone()?;
        let stop = Arc::new(AtomicBool::new(false));
        let active = Arc::new(AtomicUsize::new(0));
        let flag = stop.clone();
        let accept = std::thread::Builder::new().name("kvtier-agent-accept".into()).spawn(move || {
            for conn in listener.incoming() {
                if flag.load(Ordering::Acquire) {
                    break;
                }
                let Ok(mut sock) = conn else {
                    if flag.load(Ordering::Acquire) {
                        break;
                    }
                    // Out of descriptors or similar: back off instead of spinning.
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                };
                let max = agent.config().max_connections;
                if active.fetch_add(1, Ordering::AcqRel) >= max {
                    active.fetch_sub(1, Ordering::AcqRel);
                    let r = Refusal::new(Status::Busy, format!("the agent serves at most {max} engine connections"));
                    let _ = sock.set_write_timeout(Some(Duration::from_secs(1)));
                    let _ = sock.write_all(&encode_refusal(Op::Open, 0, &r));
                    continue;
                }
                let (agent, active) = (agent.clone(), active.clone());
                let spawned = std::thread::Builder::new().name("kvtier-agent-engine".into()).spawn(move || {
                    serve_connection(agent, device, sock);
                    active.fetch_sub(1, Ordering::AcqRel);
                });
                if spawned.is_err() {
                    // The closure (and its counter decrement) was dropped with the error.
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        })?;
        Ok(EngineServer { path: path.to_path_buf(), file_id, listener: kept, stop, accept: Some(accept) })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for EngineServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wakes the accept loop so it sees the flag: a listener shut down fails its `accept`
        // (and a connection wakes it too, where the file is still there).
        let _ = rustix::net::shutdown(&self.listener, rustix::net::Shutdown::Both);
        let _ = UnixStream::connect(&self.path);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        let ours = std::fs::metadata(&self.path).is_ok_and(|m| {
            (std::os::unix::fs::MetadataExt::dev(&m), std::os::unix::fs::MetadataExt::ino(&m)) == self.file_id
        });
        if ours {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Reads a connection's bytes and the descriptors that come with them.
struct Conn {
    sock: UnixStream,
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// Bytes received and consumed since the connection opened (stream offsets).
    received: u64,
    consumed: u64,
    /// Descriptors received, each with the stream offset of the first byte that came with it.
    fds: VecDeque<(u64, OwnedFd)>,
}

#[derive(Debug)]
enum ReadError {
    Closed,
    Io,
    /// Nothing arrived within the socket's read timeout.
    TimedOut,
    TooManyFds,
}

impl Conn {
    /// One `recvmsg`; 0 bytes is the end of the stream.
    fn fill(&mut self) -> Result<(), ReadError> {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        if self.end == self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_PENDING_FDS))];
        let mut anc = RecvAncillaryBuffer::new(&mut space);
        let end = self.end;
        let mut iov = [IoSliceMut::new(&mut self.buf[end..])];
        let msg = rustix::net::recvmsg(&self.sock, &mut iov, &mut anc, RecvFlags::CMSG_CLOEXEC).map_err(|e| {
            if e == rustix::io::Errno::AGAIN {
                ReadError::TimedOut
            } else {
                ReadError::Io
            }
        })?;
        // A stream read stops after the segment that carried descriptors (earlier segments
        // without any may come in the same read): the descriptors belong to the message whose
        // bytes include this read's last byte (a REGISTER is sent in one `sendmsg`).
        let at = self.received + msg.bytes.saturating_sub(1) as u64;
        for m in anc.drain() {
            if let RecvAncillaryMessage::ScmRights(fds) = m {
                self.fds.extend(fds.map(|fd| (at, fd)));
            }
        }
        if self.fds.len() > MAX_PENDING_FDS {
            return Err(ReadError::TooManyFds);
        }
        if msg.bytes == 0 {
            return Err(ReadError::Closed);
        }
        self.end += msg.bytes;
        self.received += msg.bytes as u64;
        Ok(())
    }

    /// Takes the first descriptor that came with the bytes from stream offset `from` on (the
    /// request being handled), closing every one that came before it.
    fn take_fd_from(&mut self, from: u64) -> Option<OwnedFd> {
        self.close_fds_before(from);
        // One that came with a later request's bytes stays for that request.
        if self.fds.front().is_some_and(|(at, _)| *at < self.consumed) {
            return self.fds.pop_front().map(|(_, fd)| fd);
        }
        None
    }

    /// Closes the descriptors that came with bytes before stream offset `offset`.
    fn close_fds_before(&mut self, offset: u64) {
        while self.fds.front().is_some_and(|(at, _)| *at < offset) {
            self.fds.pop_front();
        }
    }

    fn read_exact(&mut self, n: usize) -> Result<Vec<u8>, ReadError> {
        // A body longer than the buffer (at most `MAX_BODY`, checked by the caller) grows it:
        // otherwise `fill` would be left no room and read the full buffer as the end of stream.
        if n > self.buf.len() {
            self.buf.resize(n, 0);
        }
        while self.end - self.start < n {
            self.fill()?;
        }
        let out = self.buf[self.start..self.start + n].to_vec();
        self.start += n;
        self.consumed += n as u64;
        // Grown for a big body and drained: back to the usual size, so an idle connection holds
        // no more than that.
        if self.buf.len() > READ_BUF && self.start == self.end {
            self.buf = vec![0u8; READ_BUF];
            (self.start, self.end) = (0, 0);
        }
        Ok(out)
    }
}

fn serve_connection<D: Device, B: BackingStore>(
    agent: Arc<Agent<D, B>>,
    device: crate::DeviceOrdinal,
    sock: UnixStream,
) {
    let (idle, io) = (agent.config().idle_timeout, agent.config().io_timeout);
    let Ok(mut session) = Session::on_device(agent, device) else { return };
    let Ok(writer) = sock.try_clone() else { return };
    if writer.set_write_timeout(Some(io)).is_err() {
        return;
    }
    let mut writer = writer;
    let mut conn =
        Conn { sock, buf: vec![0u8; READ_BUF], start: 0, end: 0, received: 0, consumed: 0, fds: VecDeque::new() };
    loop {
        // Descriptors that came with the requests handled so far and were not theirs to keep.
        conn.close_fds_before(conn.consumed);
        // Between requests the idle timeout, waking meanwhile to give up saves whose next layer
        // is overdue; inside one the I/O timeout.
        let idle_until = std::time::Instant::now() + idle;
        while conn.start == conn.end {
            let now = std::time::Instant::now();
            let wake = session.next_save_deadline().map_or(idle_until, |d| d.min(idle_until));
            let wait = wake.saturating_duration_since(now).max(Duration::from_millis(1));
            if conn.sock.set_read_timeout(Some(wait)).is_err() {
                return;
            }
            match conn.fill() {
                Ok(()) => {}
                Err(ReadError::TimedOut) if std::time::Instant::now() < idle_until => {
                    session.expire_saves(std::time::Instant::now());
                }
                Err(_) => return,
            }
        }
        if conn.sock.set_read_timeout(Some(io)).is_err() {
            return;
        }
        session.expire_saves(std::time::Instant::now());
        let request_at = conn.consumed;
        let Ok(head) = conn.read_exact(HEADER_LEN) else { return };
        let Ok(head) = <[u8; HEADER_LEN]>::try_from(head.as_slice()) else { return };
        let h = Header::decode(&head);
        let op = Op::from_u8(h.op).unwrap_or(Op::Open);
        if h.body_len as usize > MAX_BODY {
            let r = Refusal::new(Status::BadRequest, format!("a {}-byte request; at most {MAX_BODY}", h.body_len));
            let _ = writer.write_all(&encode_refusal(op, h.request_id, &r));
            return;
        }
        let Ok(body) = conn.read_exact(h.body_len as usize) else { return };
        let req = match decode_request(h.op, &body) {
            Ok(r) => r,
            Err(r) => {
                if writer.write_all(&encode_refusal(op, h.request_id, &r)).is_err() {
                    return;
                }
                continue;
            }
        };
        let fd = match req {
            Request::Register { source: BufferSource::Memfd, .. } => conn.take_fd_from(request_at),
            _ => None,
        };
        let mut send = |msg: Vec<u8>| writer.write_all(&msg);
        if session.handle(h.request_id, req, fd, &mut send).is_err() {
            return;
        }
    }
}
