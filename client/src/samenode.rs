//! The same-node path: a [`SharedBuffer`] is this process's own shared memory (a sealed memfd),
//! registered with a server on the same host over its Unix socket (the descriptor passed with
//! `SCM_RIGHTS`); [`SameNode`] then loads blocks straight into it and stores blocks straight from
//! it by offset. No payload crosses the socket: the server copies each block once, between its
//! slot and this buffer, verifying the bytes on its side (protocol: `kvtier_proto::samenode`).
//!
//! ```no_run
//! # async fn demo(client: kvtier_client::KvClient, ns: kvtier_client::NamespaceHandle,
//! #               keys: Vec<kvtier_proto::BlockKey>) -> Result<(), kvtier_client::ClientError> {
//! use kvtier_client::SharedBuffer;
//! let bb = ns.block_bytes();
//! let mut buf = SharedBuffer::new((keys.len() as u64 * bb) as usize)?;
//! let mut near = client.samenode().await?; // an error when the server is on another host
//! near.register(&buf).await?;
//! let offsets: Vec<u64> = (0..keys.len() as u64).map(|i| i * bb).collect();
//! // ... the engine writes its blocks into buf.as_mut_slice() ...
//! near.store_from_buffer(&ns, &keys, &buf, &offsets).await?;
//! let landed = near.load_into_buffer(&ns, &keys, &mut buf, &offsets, true).await?;
//! # Ok(()) }
//! ```
//!
//! Contracts: a buffer is registered per connection and stays mapped by the server until
//! [`SameNode::unregister`] or until the connection closes (dropping the [`SameNode`]); the server
//! writes into it only while a `load_into_buffer` call that borrows it mutably runs, and reads it
//! only while a `store_from_buffer` call borrows it (or, for a buffer that several calls share,
//! only in the places a call has claimed: see `ConcurrentBuffer`). A call that times out leaves the connection
//! unusable (every later call says so): open a new one.

use std::collections::HashMap;
use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvtier_proto::dataplane::{HelloReply, ItemStatus, ResponseHeader, Status};
use kvtier_proto::samenode::{
    encode_checksums, encode_hello_version, LoadItem, Segment, SnOp, SnRequest, StoreItem,
    CHECKSUMS_AFTER_SINCE_VERSION, FLAG_CHECKSUMS_AFTER, FLAG_STOP_AT_MISS, MAX_SEGMENTS_PER_ITEM,
    MAX_SEGMENTS_PER_REQUEST, PROTOCOL_VERSION, RESPONSE_HEADER_LEN,
};
use kvtier_proto::{
    codes, BlockFrame, BlockKey, CodecId, FrameHeader, NamespaceId, FRAME_FLAG_KEEP_LOSSLESS, FRAME_HEADER_LEN,
};
use memmap2::{MmapMut, MmapOptions};
use rayon::prelude::*;
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::UnixStream;

use crate::claims::BufferAccess;
use crate::client::{decode_frame_into, NamespaceHandle};
use crate::near::FallbackReason;
use crate::polled::{poll_budget, PolledSocket};
use crate::ClientError;

/// How long a timed-out load or store waits for the server to stop touching its buffer.
const LEAVE_WAIT: Duration = Duration::from_secs(5);

static NEXT_BUFFER: AtomicU64 = AtomicU64::new(1);

/// This process's shared memory for the same-node path: a memfd of fixed size, sealed against
/// shrinking and growing (so a server that maps it can never fault on a missing page), mapped
/// shared and touched once at creation (its pages belong to this process) — or, from
/// [`SharedBuffer::from_file`], a region of a file on tmpfs that someone else made and can't seal
/// (an engine's own shared memory, such as vLLM's `/dev/shm/vllm_offload_<engine_id>.mmap`),
/// which the server reaches with `pread`/`pwrite` instead of mapping it.
pub struct SharedBuffer {
    map: MmapMut,
    fd: OwnedFd,
    /// Where byte 0 of this buffer is in the file (0 for a memfd of our own).
    file_base: u64,
    /// Whether the file can shrink (a region from `from_file`): checked before each use.
    shrinkable: bool,
    uid: u64,
    /// Connections that registered this buffer hold a `Weak` of it: once the buffer is dropped
    /// they unregister it (before their next registration or pooled use), so the server unmaps
    /// it and its pages are freed.
    alive: Arc<()>,
}

impl SharedBuffer {
    /// A zeroed buffer of `len` bytes.
    pub fn new(len: usize) -> Result<Self, ClientError> {
        if len == 0 {
            return Err(ClientError::InvalidArgument("a shared buffer of 0 bytes".into()));
        }
        // Local memory, no connection: the caller's request (its size) is what can't be met.
        let io = |what: &str, e: rustix::io::Errno| {
            ClientError::InvalidArgument(format!("cannot allocate a shared buffer of {len} bytes: {what}: {e}"))
        };
        let fd = rustix::fs::memfd_create("kvtier-buffer", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .map_err(|e| io("memfd_create", e))?;
        rustix::fs::ftruncate(&fd, len as u64).map_err(|e| io("ftruncate", e))?;
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW).map_err(|e| io("seal", e))?;
        // SAFETY: the memfd is this process's own, `len` bytes long and sealed so it can't shrink:
        // the mapping stays backed for its life. Other processes (the server) write it only while
        // a load borrows this buffer mutably, or in the places a load claimed in a
        // `ConcurrentBuffer` of it, so no Rust reference observes a concurrent write.
        let map = unsafe { MmapOptions::new().len(len).populate().map_mut(&fd) }.map_err(|e| {
            ClientError::InvalidArgument(format!("cannot allocate a shared buffer of {len} bytes: mmap: {e}"))
        })?;
        Ok(SharedBuffer {
            map,
            fd,
            file_base: 0,
            shrinkable: false,
            uid: NEXT_BUFFER.fetch_add(1, Ordering::Relaxed),
            alive: Arc::new(()),
        })
    }

    /// `len` bytes of `file` from `offset` on: a region of a file on tmpfs (`/dev/shm`) that this
    /// process shares with others, opened read-write, that no seal protects (an engine's own
    /// shared memory). Mapped shared here (the same pages every other mapping of the file sees),
    /// not populated. The server never maps it: it copies with `pread`/`pwrite`, so a file
    /// truncated meanwhile is an error for the call, never a crash of the server. This process
    /// touches the region only after checking the file's size ([`SharedBuffer::check_intact`]);
    /// a truncation racing a call can still fault here, as it can in any process that maps it.
    pub fn from_file(file: std::fs::File, offset: u64, len: usize) -> Result<Self, ClientError> {
        if len == 0 {
            return Err(ClientError::InvalidArgument("a file region of 0 bytes".into()));
        }
        let end = offset
            .checked_add(len as u64)
            .ok_or_else(|| ClientError::InvalidArgument("the region's end overflows".into()))?;
        let size = file.metadata().map_err(|e| ClientError::Io(format!("file region: fstat: {e}")))?.len();
        if size < end {
            return Err(ClientError::InvalidArgument(format!(
                "the file is {size} bytes; a region of {len} bytes from offset {offset} needs {end}"
            )));
        }
        // SAFETY: a shared mapping of `len` bytes the file holds now. Another process may shrink
        // the file; every use of the mapping checks the size first (`check_intact`), and the rest
        // of the risk is the one every process mapping this file takes.
        let map = unsafe { MmapOptions::new().offset(offset).len(len).map_mut(&file) }
            .map_err(|e| ClientError::Io(format!("file region: mmap: {e}")))?;
        Ok(SharedBuffer {
            map,
            fd: OwnedFd::from(file),
            file_base: offset,
            shrinkable: true,
            uid: NEXT_BUFFER.fetch_add(1, Ordering::Relaxed),
            alive: Arc::new(()),
        })
    }

    /// The file region this process already has mapped shared at `addr .. addr + len` (an
    /// engine's own shared memory, e.g. the memory behind vLLM's CPU-tier view), found in
    /// `/proc/self/maps`, as a [`SharedBuffer::from_file`] of the same file and offset: a second
    /// mapping of the same pages, so what a load puts in it shows at `addr`. The file is opened
    /// by its path, or through an open descriptor of this process when it was unlinked. An error
    /// when the range is not wholly inside shared mappings of one file, contiguous in the file.
    pub fn from_mapping(addr: usize, len: usize) -> Result<Self, ClientError> {
        let maps = std::fs::read_to_string("/proc/self/maps")
            .map_err(|e| ClientError::Io(format!("reading /proc/self/maps: {e}")))?;
        let found = find_mapping(&maps, addr, len)?;
        let file = open_mapped_file(&found)?;
        Self::from_file(file, found.offset, len)
    }

    /// Where byte 0 of this buffer lies in its file (0 for a buffer from [`SharedBuffer::new`]).
    pub fn file_offset(&self) -> u64 {
        self.file_base
    }

    /// Whether this is a region of a file that can shrink ([`SharedBuffer::from_file`]).
    pub fn is_file_region(&self) -> bool {
        self.shrinkable
    }

    /// An error if the file was truncated below this region (someone else's file, from
    /// [`SharedBuffer::from_file`]); always `Ok` for a sealed buffer of our own.
    pub fn check_intact(&self) -> Result<(), ClientError> {
        if !self.shrinkable {
            return Ok(());
        }
        let end = self.file_base + self.map.len() as u64;
        let size = rustix::fs::fstat(&self.fd).map(|st| u64::try_from(st.st_size).unwrap_or(0)).unwrap_or(0);
        if size < end {
            return Err(ClientError::InvalidArgument(format!(
                "the registered file was truncated: it is {size} bytes, the region ends at {end}"
            )));
        }
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.map
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.map
    }

    /// The memfd (to register it yourself with [`SameNode::register_fd`], or to share it).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The address of the first byte of the mapping (fixed for the buffer's life): lets a binding
    /// tell whether a caller's array lives inside this buffer.
    pub fn as_ptr(&self) -> *const u8 {
        self.map.as_ptr()
    }
}

/// The file behind a range of this process's memory (from `/proc/self/maps`).
#[derive(Debug, PartialEq, Eq)]
struct MappedFile {
    /// The file's device as `major:minor` (hex, as the kernel writes it) and its inode.
    dev: String,
    inode: u64,
    /// The path the kernel shows (may end in ` (deleted)`).
    path: String,
    /// The file offset of the range's first byte.
    offset: u64,
}

/// The file that the mappings in `maps` (the text of `/proc/<pid>/maps`) covering
/// `addr .. addr + len` map, shared and contiguously.
fn find_mapping(maps: &str, addr: usize, len: usize) -> Result<MappedFile, ClientError> {
    let bad = |m: String| ClientError::InvalidArgument(format!("memory at {addr:#x} (+{len}): {m}"));
    let end = addr.checked_add(len).filter(|_| len > 0).ok_or_else(|| bad("an empty or overflowing range".into()))?;
    let mut found: Option<MappedFile> = None;
    // The address up to which the range is covered so far, and the file offset there.
    let mut at = addr;
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms), Some(off), Some(dev), Some(inode)) =
            (f.next(), f.next(), f.next(), f.next(), f.next())
        else {
            continue;
        };
        let path = f.collect::<Vec<_>>().join(" ");
        let Some((lo, hi)) = range.split_once('-') else { continue };
        let (Ok(lo), Ok(hi), Ok(off)) =
            (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16), u64::from_str_radix(off, 16))
        else {
            continue;
        };
        if hi <= at || lo > at {
            continue;
        }
        if !perms.starts_with("rw") || perms.as_bytes().get(3) != Some(&b's') {
            return Err(bad(format!("mapped {perms}, not shared read-write")));
        }
        let inode: u64 = inode.parse().unwrap_or(0);
        if inode == 0 {
            return Err(bad("not a mapping of a file".into()));
        }
        let here = off + (at - lo) as u64;
        match &found {
            None => found = Some(MappedFile { dev: dev.to_string(), inode, path, offset: here }),
            Some(m) => {
                let want = m.offset + (at - addr) as u64;
                if m.dev != dev || m.inode != inode || here != want {
                    return Err(bad("spans mappings of different files or places in a file".into()));
                }
            }
        }
        at = hi;
        if at >= end {
            return found.ok_or_else(|| bad("no mapping".into()));
        }
    }
    Err(bad("not (wholly) inside a mapping".into()))
}

/// Opens the file of `m` read-write: by its path when it still names that file, else through one
/// of this process's open descriptors of it (`/proc/self/fd/N` reopens an unlinked file).
fn open_mapped_file(m: &MappedFile) -> Result<std::fs::File, ClientError> {
    use std::os::unix::fs::MetadataExt;
    let same = |meta: &std::fs::Metadata| {
        let dev = meta.dev();
        meta.ino() == m.inode && format!("{:02x}:{:02x}", rustix::fs::major(dev), rustix::fs::minor(dev)) == m.dev
    };
    let open = |p: &Path| std::fs::OpenOptions::new().read(true).write(true).open(p);
    if !m.path.is_empty() && !m.path.ends_with(" (deleted)") {
        if let Ok(f) = open(Path::new(&m.path)) {
            if f.metadata().is_ok_and(|meta| same(&meta)) {
                return Ok(f);
            }
        }
    }
    let fds = std::fs::read_dir("/proc/self/fd").map_err(|e| ClientError::Io(format!("/proc/self/fd: {e}")))?;
    for e in fds.flatten() {
        let p = e.path();
        if std::fs::metadata(&p).is_ok_and(|meta| same(&meta)) {
            if let Ok(f) = open(&p) {
                return Ok(f);
            }
        }
    }
    Err(ClientError::InvalidArgument(format!(
        "the file mapped there ({}) can't be opened read-write by this process",
        if m.path.is_empty() { "no path" } else { &m.path }
    )))
}

/// A buffer's id on one same-node connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BufferId(pub u32);

/// One connection to a server's same-node socket (see the module docs). Requests on it run one
/// at a time (`&mut self`); open one per concurrent stream of work.
pub struct SameNode {
    sock: PolledSocket,
    path: PathBuf,
    timeout: Duration,
    max_items: usize,
    next_request: u32,
    /// `SharedBuffer` uid → its id on this connection, and whether the buffer still lives.
    registered: HashMap<u64, (BufferId, Weak<()>)>,
    broken: Option<String>,
    /// The protocol version the server took in the hello.
    version: u16,
    /// The longest a call polls for its answer (see [`crate::polled`]).
    poll: Duration,
}

impl SameNode {
    /// Connects to the socket at `path` and says hello. `max_items` bounds the items of one
    /// request (the server's `max_blocks_per_request`).
    pub async fn connect(
        path: &Path,
        token: Option<&str>,
        connect_timeout: Duration,
        request_timeout: Duration,
        max_items: usize,
    ) -> Result<Self, ClientError> {
        Self::open(path, token, connect_timeout, request_timeout, max_items).await.map_err(|(_, e)| e)
    }

    /// [`SameNode::connect`], saying beside the error why the path can't be used here (for the
    /// automatic path's fallback counter).
    pub(crate) async fn open(
        path: &Path,
        token: Option<&str>,
        connect_timeout: Duration,
        request_timeout: Duration,
        max_items: usize,
    ) -> Result<Self, (FallbackReason, ClientError)> {
        let cerr = |reason: String| ClientError::Connect { addr: path.display().to_string(), reason };
        let hello = async |version: u16| {
            let mut sock = UnixStream::connect(path)
                .await
                .map_err(|e| (FallbackReason::from_connect_error(&e), cerr(e.to_string())))?;
            let io = |e: std::io::Error| (FallbackReason::ConnectFailed, ClientError::from(e));
            sock.write_all(&encode_hello_version(version, token.unwrap_or("").as_bytes())).await.map_err(io)?;
            let mut r = [0u8; 4];
            sock.read_exact(&mut r).await.map_err(io)?;
            let (status, msg_len) =
                HelloReply::decode(&r).map_err(|e| (FallbackReason::ConnectFailed, ClientError::from(e)))?;
            let mut msg = vec![0u8; msg_len as usize];
            sock.read_exact(&mut msg).await.map_err(io)?;
            let msg = String::from_utf8_lossy(&msg).into_owned();
            match status {
                Status::Ok => Ok(Ok(sock)),
                Status::UnsupportedVersion => Ok(Err(msg)),
                Status::Unauthenticated => Err((FallbackReason::Unauthenticated, ClientError::Unauthenticated(msg))),
                Status::TooManyConnections => Err((FallbackReason::ConnectFailed, refusal(status, msg))),
                _ => Err((FallbackReason::ConnectFailed, cerr(msg))),
            }
        };
        // A server older than this client (in a rolling upgrade) is asked again in the newest
        // protocol it may speak without the stores' checksums after the request.
        let hellos = async {
            match hello(PROTOCOL_VERSION).await? {
                Ok(sock) => Ok((sock, PROTOCOL_VERSION)),
                Err(_) => match hello(CHECKSUMS_AFTER_SINCE_VERSION - 1).await? {
                    Ok(sock) => Ok((sock, CHECKSUMS_AFTER_SINCE_VERSION - 1)),
                    Err(msg) => Err((FallbackReason::ConnectFailed, cerr(msg))),
                },
            }
        };
        let (sock, version) = tokio::time::timeout(connect_timeout, hellos)
            .await
            .map_err(|_| (FallbackReason::ConnectFailed, ClientError::Timeout(connect_timeout)))??;
        Ok(SameNode {
            sock: PolledSocket::new(sock),
            path: path.to_path_buf(),
            timeout: request_timeout,
            max_items: max_items.max(1),
            next_request: 0,
            registered: HashMap::new(),
            broken: None,
            version,
            poll: crate::polled::MAX_POLL,
        })
    }

    /// The longest a call waits for its answer polling the socket from its own thread before it
    /// parks (each call polls about as long as its copies should take, at most this; see
    /// [`crate::ClientConfig::samenode_poll`]). `Duration::ZERO` never polls. Default: 2.5 ms.
    pub fn set_answer_poll(&mut self, max: Duration) {
        self.poll = max;
    }

    /// The same-node protocol version this connection speaks (the newest both ends know).
    pub fn protocol_version(&self) -> u16 {
        self.version
    }

    /// Sets how long each later request may take (the connection's `request_timeout`).
    pub fn set_request_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// False once a request failed on the transport or timed out: every later call fails.
    pub fn is_usable(&self) -> bool {
        self.broken.is_none()
    }

    /// Whether a buffer this connection registered has been dropped since (see
    /// [`SameNode::sweep`]).
    pub(crate) fn holds_dropped(&self) -> bool {
        self.registered.values().any(|(_, alive)| alive.strong_count() == 0)
    }

    /// Unregisters every buffer this connection registered that has been dropped since, so the
    /// server unmaps it (its pages are freed only then). Runs before every new registration.
    pub async fn sweep(&mut self) -> Result<(), ClientError> {
        let dead: Vec<u64> =
            self.registered.iter().filter(|(_, (_, alive))| alive.strong_count() == 0).map(|(uid, _)| *uid).collect();
        for uid in dead {
            if let Some((id, _)) = self.registered.remove(&uid) {
                self.unregister_id(id).await?;
            }
        }
        Ok(())
    }

    /// The socket this connection goes to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Registers `buf` on this connection (idempotent: a buffer registered already keeps its id).
    pub async fn register(&mut self, buf: &SharedBuffer) -> Result<BufferId, ClientError> {
        if let Some((id, _)) = self.registered.get(&buf.uid) {
            return Ok(*id);
        }
        self.sweep().await?;
        // A file region is registered from the file's start: its items' offsets are file offsets.
        let id = self.register_fd(buf.fd(), buf.file_base + buf.len() as u64).await?;
        self.registered.insert(buf.uid, (id, Arc::downgrade(&buf.alive)));
        Ok(id)
    }

    /// Registers any memfd, claiming `len` bytes of it. The server refuses a descriptor that is
    /// not a memfd sealed with `F_SEAL_SHRINK`, one smaller than `len`, and more buffers than
    /// its per-connection caps allow.
    pub async fn register_fd(&mut self, fd: BorrowedFd<'_>, len: u64) -> Result<BufferId, ClientError> {
        let req = self.request(SnOp::Register, 0, 0, 0, NamespaceId([0; 16]));
        let mut msg = req.encode().to_vec();
        msg.extend_from_slice(&len.to_le_bytes());
        let h = guard(&mut self.broken, self.timeout, do_register(&mut self.sock, &msg, fd, req.request_id)).await??;
        Ok(BufferId(h.count))
    }

    /// Unregisters `buf`: the server unmaps it.
    pub async fn unregister(&mut self, buf: &SharedBuffer) -> Result<(), ClientError> {
        let Some((id, _)) = self.registered.remove(&buf.uid) else {
            return Err(ClientError::InvalidArgument("the buffer is not registered on this connection".into()));
        };
        self.unregister_id(id).await
    }

    async fn unregister_id(&mut self, id: BufferId) -> Result<(), ClientError> {
        let req = self.request(SnOp::Unregister, 0, 0, id.0, NamespaceId([0; 16]));
        let msg = req.encode();
        guard(&mut self.broken, self.timeout, do_simple(&mut self.sock, &msg, SnOp::Unregister, req.request_id))
            .await??;
        Ok(())
    }

    /// Loads blocks by key straight into `buf`: block `i` lands at `offsets[i]` in the layout's
    /// dtype (a block stored encoded is decoded in place). True where block `i` landed and was
    /// verified by the server; false for a miss, an offset outside the buffer (the server says
    /// `OutOfRange`), or a block that failed its checksum. With `stop_at_miss`, keys after the
    /// first miss are reported false without being looked up.
    pub async fn load_into_buffer(
        &mut self,
        ns: &NamespaceHandle,
        keys: &[BlockKey],
        buf: &mut SharedBuffer,
        offsets: &[u64],
        stop_at_miss: bool,
    ) -> Result<Vec<bool>, ClientError> {
        self.load_at(ns, keys, &mut BufferAccess::Own(buf), offsets, stop_at_miss).await
    }

    /// [`SameNode::load_into_buffer`] through any access to the buffer (a claim on its places).
    pub(crate) async fn load_at(
        &mut self,
        ns: &NamespaceHandle,
        keys: &[BlockKey],
        buf: &mut BufferAccess<'_, '_>,
        offsets: &[u64],
        stop_at_miss: bool,
    ) -> Result<Vec<bool>, ClientError> {
        if keys.len() != offsets.len() {
            return Err(ClientError::InvalidArgument(format!("{} keys but {} offsets", keys.len(), offsets.len())));
        }
        buf.buffer().check_intact()?;
        let id = self.register(buf.buffer()).await?;
        let bb = ns.block_bytes();
        let base = buf.buffer().file_base;
        let items: Vec<LoadItem> = keys
            .iter()
            .zip(offsets)
            .map(|(k, o)| LoadItem { key: *k, offset: o.saturating_add(base), room: bb })
            .collect();
        let got = self.load_items(ns.id, id, &items, stop_at_miss).await?;
        let mut ok = Vec::with_capacity(got.len());
        for (r, o) in got.into_iter().zip(offsets) {
            ok.push(match r {
                Ok(h) if h.codec == CodecId::RAW => true,
                // Stored encoded: decoded in place (the encoded bytes are copied out first).
                Ok(h) => {
                    buf.buffer().check_intact().is_ok()
                        && block_range(*o, bb)
                            .and_then(|r| buf.bytes_mut(r))
                            .is_some_and(|block| decode_in_place(block, h).is_ok())
                }
                Err(_) => false,
            });
        }
        Ok(ok)
    }

    /// The protocol's `LOAD`: per item, the frame header of the block now at its offset in
    /// buffer `buffer` (its payload as stored, possibly encoded), or why not. The server checked
    /// every block it reports `Ok` against its checksum (a DRAM block as it copied it).
    pub async fn load_items(
        &mut self,
        ns: NamespaceId,
        buffer: BufferId,
        items: &[LoadItem],
        stop_at_miss: bool,
    ) -> Result<Vec<Result<FrameHeader, ItemStatus>>, ClientError> {
        let mut out = Vec::with_capacity(items.len());
        for batch in items.chunks(self.max_items) {
            self.load_batch(SnOp::Load, ns, buffer, batch, &[], stop_at_miss, &mut out).await?;
        }
        Ok(out)
    }

    /// Loads blocks by key straight into `buf`, each into its own segments: block `i` fills
    /// `segments[i]` in order (an engine page's K and V halves, or its per-layer pieces), in the
    /// layout's dtype (a block stored encoded is decoded into them). True where block `i` landed
    /// and was verified by the server; false for a miss, a segment outside the buffer, segments
    /// that can't hold the block, or a block that failed its checksum.
    pub async fn load_into_buffer_segments(
        &mut self,
        ns: &NamespaceHandle,
        keys: &[BlockKey],
        buf: &mut SharedBuffer,
        segments: &[Vec<Segment>],
        stop_at_miss: bool,
    ) -> Result<Vec<bool>, ClientError> {
        self.load_segments_at(ns, keys, &mut BufferAccess::Own(buf), segments, stop_at_miss).await
    }

    /// [`SameNode::load_into_buffer_segments`] through any access to the buffer.
    pub(crate) async fn load_segments_at(
        &mut self,
        ns: &NamespaceHandle,
        keys: &[BlockKey],
        buf: &mut BufferAccess<'_, '_>,
        segments: &[Vec<Segment>],
        stop_at_miss: bool,
    ) -> Result<Vec<bool>, ClientError> {
        if keys.len() != segments.len() {
            return Err(ClientError::InvalidArgument(format!(
                "{} keys but {} segment lists",
                keys.len(),
                segments.len()
            )));
        }
        buf.buffer().check_intact()?;
        let id = self.register(buf.buffer()).await?;
        let base = buf.buffer().file_base;
        let placed: Vec<Vec<Segment>> = segments
            .iter()
            .map(|v| v.iter().map(|s| Segment { offset: s.offset.saturating_add(base), len: s.len }).collect())
            .collect();
        let got = self.load_segment_items(ns.id, id, keys, &placed, stop_at_miss).await?;
        let bb = ns.block_bytes();
        let mut ok = Vec::with_capacity(got.len());
        for (r, segs) in got.into_iter().zip(segments) {
            ok.push(match r {
                Ok(h) if h.codec == CodecId::RAW => true,
                // Stored encoded: gathered from the segments, decoded, and put back in them.
                Ok(h) => buf.buffer().check_intact().is_ok() && decode_in_segments(buf, segs, bb, h).is_ok(),
                Err(_) => false,
            });
        }
        Ok(ok)
    }

    /// The protocol's `LOAD_SEGMENTS`: per key, the frame header of the block now in its
    /// `segments` (offsets in buffer `buffer`, filled in order; its payload as stored), or why
    /// not. Sent in requests within the protocol's segment caps.
    pub async fn load_segment_items(
        &mut self,
        ns: NamespaceId,
        buffer: BufferId,
        keys: &[BlockKey],
        segments: &[Vec<Segment>],
        stop_at_miss: bool,
    ) -> Result<Vec<Result<FrameHeader, ItemStatus>>, ClientError> {
        if keys.len() != segments.len() {
            return Err(ClientError::InvalidArgument(format!(
                "{} keys but {} segment lists",
                keys.len(),
                segments.len()
            )));
        }
        let mut out = Vec::with_capacity(keys.len());
        for range in segment_batches(segments, self.max_items, None)? {
            let items: Vec<LoadItem> = keys[range.clone()]
                .iter()
                .zip(&segments[range.clone()])
                .map(|(k, s)| LoadItem { key: *k, offset: s.len() as u64, room: 0 })
                .collect();
            let table: Vec<Segment> = segments[range].iter().flatten().copied().collect();
            self.load_batch(SnOp::LoadSegments, ns, buffer, &items, &table, stop_at_miss, &mut out).await?;
        }
        Ok(out)
    }

    /// One `LOAD` or `LOAD_SEGMENTS` request, its answers appended to `out` (all `Miss` without
    /// asking when `stop_at_miss` and `out` already has a miss).
    #[allow(clippy::too_many_arguments)]
    async fn load_batch(
        &mut self,
        op: SnOp,
        ns: NamespaceId,
        buffer: BufferId,
        items: &[LoadItem],
        table: &[Segment],
        stop_at_miss: bool,
        out: &mut Vec<Result<FrameHeader, ItemStatus>>,
    ) -> Result<(), ClientError> {
        if stop_at_miss && out.iter().any(|r| r.is_err()) {
            out.extend(items.iter().map(|_| Err(ItemStatus::Miss)));
            return Ok(());
        }
        let flags = if stop_at_miss { FLAG_STOP_AT_MISS } else { 0 };
        let req = self.request(op, flags, items.len() as u32, buffer.0, ns);
        let msg = message(&req, items, LoadItem::encode_into, table);
        let bytes = answer_bytes(items.iter().map(|i| i.room), table);
        let poll = poll_budget(bytes).min(self.poll);
        let io = self.sock.exchange(async |s| do_load(s, &msg, (op, items.len(), req.request_id), poll).await);
        let res = guard(&mut self.broken, self.timeout, io).await;
        out.extend(self.settled(res).await??);
        Ok(())
    }

    /// Stores full raw blocks from `buf`: block `i` is the namespace's block size at
    /// `offsets[i]`, stored under `keys[i]`. One status per block: `Ok`, `Present` (already
    /// held; nothing was copied), `OutOfRange`, `ChecksumMismatch` (the bytes changed while the
    /// server copied them), or why else it was refused.
    pub async fn store_from_buffer(
        &mut self,
        ns: &NamespaceHandle,
        keys: &[BlockKey],
        buf: &SharedBuffer,
        offsets: &[u64],
    ) -> Result<Vec<ItemStatus>, ClientError> {
        self.store_from_buffer_at(ns, keys, None, &BufferAccess::Read(buf), offsets).await
    }

    /// [`SameNode::store_from_buffer`] of blocks `first_index..` of a context: those among the
    /// namespace's lossless sink blocks are flagged [`FRAME_FLAG_KEEP_LOSSLESS`], as
    /// `KvClient::store_from` flags them.
    pub(crate) async fn store_from_buffer_at(
        &mut self,
        ns: &NamespaceHandle,
        keys: &[BlockKey],
        first_index: Option<usize>,
        buf: &BufferAccess<'_, '_>,
        offsets: &[u64],
    ) -> Result<Vec<ItemStatus>, ClientError> {
        if keys.len() != offsets.len() {
            return Err(ClientError::InvalidArgument(format!("{} keys but {} offsets", keys.len(), offsets.len())));
        }
        let id = self.register_for_raw_store(ns, buf.buffer()).await?;
        let base = buf.buffer().file_base;
        let layout = ns.namespace.layout;
        let bb = ns.block_bytes();
        let lossless = ns.namespace.is_lossless();
        let sinks = ns.lossless_sink_blocks();
        // An item outside the buffer goes with no checksum: the server answers OutOfRange.
        let sum_of =
            |i: usize| block_range(offsets[i], bb).and_then(|r| buf.bytes(r)).map_or(0, kvtier_proto::checksum);
        let after = self.checksums_after();
        let item = |(i, (k, o)): (usize, (&BlockKey, &u64))| {
            let sink = first_index.is_some_and(|f| f + i < sinks);
            let flags = if lossless || sink { FRAME_FLAG_KEEP_LOSSLESS } else { 0 };
            let header = FrameHeader {
                codec: CodecId::RAW,
                tokens: layout.block_tokens,
                flags,
                namespace: ns.id,
                key: *k,
                layout,
                payload_len: bb,
                checksum: if after { 0 } else { sum_of(i) },
            };
            StoreItem { header, offset: o.saturating_add(base) }
        };
        let items: Vec<StoreItem> = if keys.len() > 1 && !after {
            kvtier_kernels::par::run(|| keys.par_iter().zip(offsets.par_iter()).enumerate().map(item).collect())
        } else {
            keys.iter().zip(offsets).enumerate().map(item).collect()
        };
        self.store_in_batches(id, &items, after.then_some(&sum_of)).await
    }

    /// `buf`'s id on this connection for a store of raw blocks under `ns` (registered if it isn't
    /// yet); an error for a handle that encodes, or a file region that was truncated.
    async fn register_for_raw_store(
        &mut self,
        ns: &NamespaceHandle,
        buf: &SharedBuffer,
    ) -> Result<BufferId, ClientError> {
        if ns.codec() != CodecId::RAW {
            return Err(ClientError::InvalidArgument(format!(
                "the same-node store sends raw blocks; this handle encodes with {} (use store_keys)",
                ns.codec().name()
            )));
        }
        buf.check_intact()?;
        self.register(buf).await
    }

    /// The protocol's `STORE`: each item's payload is read by the server at its offset in buffer
    /// `buffer` and checked against its header's checksum after the copy.
    pub async fn store_items(&mut self, buffer: BufferId, items: &[StoreItem]) -> Result<Vec<ItemStatus>, ClientError> {
        self.store_in_batches(buffer, items, None).await
    }

    /// `STORE`s of `items` in requests of at most `max_items`; with `sum_of`, each item's
    /// checksum (by its index in `items`) computed and sent after its request.
    async fn store_in_batches(
        &mut self,
        buffer: BufferId,
        items: &[StoreItem],
        sum_of: Option<&(dyn Fn(usize) -> u64 + Sync)>,
    ) -> Result<Vec<ItemStatus>, ClientError> {
        let mut out = Vec::with_capacity(items.len());
        let max_bytes = sum_of.is_some().then_some(AFTER_BATCH_BYTES);
        for range in byte_batches(items.iter().map(|i| i.header.payload_len), self.max_items, max_bytes) {
            let sums = sum_of.map(|of| Sums { first: range.start, of });
            out.extend(self.store_batch(SnOp::Store, buffer, &items[range], &[], sums).await?);
        }
        Ok(out)
    }

    /// The protocol's `STORE` with its items' checksums sent after the request
    /// ([`FLAG_CHECKSUMS_AFTER`]; the items' header checksums are ignored): `sums[i]` for item
    /// `i`. An item is stored only if the server's copy hashes to its checksum. Needs a server
    /// of protocol 3 ([`SameNode::protocol_version`]).
    pub async fn store_items_checksums_after(
        &mut self,
        buffer: BufferId,
        items: &[StoreItem],
        sums: &[u64],
    ) -> Result<Vec<ItemStatus>, ClientError> {
        if items.len() != sums.len() {
            return Err(ClientError::InvalidArgument(format!("{} items but {} checksums", items.len(), sums.len())));
        }
        if !self.checksums_after() {
            return Err(ClientError::InvalidArgument(format!(
                "checksums after the request need same-node protocol {CHECKSUMS_AFTER_SINCE_VERSION}; this connection speaks {}",
                self.version
            )));
        }
        self.store_in_batches(buffer, items, Some(&|i: usize| sums[i])).await
    }

    /// Stores full raw blocks from `buf`, each from its own segments: block `i` is `segments[i]`
    /// taken in order (together the namespace's block size), stored under `keys[i]`. Statuses as
    /// [`SameNode::store_from_buffer`]'s.
    pub async fn store_from_buffer_segments(
        &mut self,
        ns: &NamespaceHandle,
        keys: &[BlockKey],
        buf: &SharedBuffer,
        segments: &[Vec<Segment>],
    ) -> Result<Vec<ItemStatus>, ClientError> {
        self.store_segments_at(ns, keys, &BufferAccess::Read(buf), segments).await
    }

    /// [`SameNode::store_from_buffer_segments`] through any access to the buffer.
    pub(crate) async fn store_segments_at(
        &mut self,
        ns: &NamespaceHandle,
        keys: &[BlockKey],
        buf: &BufferAccess<'_, '_>,
        segments: &[Vec<Segment>],
    ) -> Result<Vec<ItemStatus>, ClientError> {
        if keys.len() != segments.len() {
            return Err(ClientError::InvalidArgument(format!(
                "{} keys but {} segment lists",
                keys.len(),
                segments.len()
            )));
        }
        let id = self.register_for_raw_store(ns, buf.buffer()).await?;
        let base = buf.buffer().file_base;
        let layout = ns.namespace.layout;
        let bb = ns.block_bytes();
        let flags = if ns.namespace.is_lossless() { FRAME_FLAG_KEEP_LOSSLESS } else { 0 };
        // Segments outside the buffer or not making one block go with no checksum: the server
        // answers OutOfRange or SizeMismatch.
        let sum_of = |i: usize| {
            let mut h = kvtier_proto::Checksummer::new();
            for s in &segments[i] {
                if let Some(p) = block_range(s.offset, s.len).and_then(|r| buf.bytes(r)) {
                    h.update(p);
                }
            }
            h.digest()
        };
        let after = self.checksums_after();
        let item = |(i, k): (usize, &BlockKey)| {
            let header = FrameHeader {
                codec: CodecId::RAW,
                tokens: layout.block_tokens,
                flags,
                namespace: ns.id,
                key: *k,
                layout,
                payload_len: bb,
                checksum: if after { 0 } else { sum_of(i) },
            };
            StoreItem { header, offset: segments[i].len() as u64 }
        };
        let items: Vec<StoreItem> = if keys.len() > 1 && !after {
            kvtier_kernels::par::run(|| keys.par_iter().enumerate().map(item).collect())
        } else {
            keys.iter().enumerate().map(item).collect()
        };
        let mut out = Vec::with_capacity(keys.len());
        for range in segment_batches(segments, self.max_items, after.then_some(AFTER_BATCH_BYTES))? {
            let table: Vec<Segment> = segments[range.clone()]
                .iter()
                .flatten()
                .map(|s| Segment { offset: s.offset.saturating_add(base), len: s.len })
                .collect();
            let sums = after.then_some(Sums { first: range.start, of: &sum_of });
            out.extend(self.store_batch(SnOp::StoreSegments, id, &items[range], &table, sums).await?);
        }
        Ok(out)
    }

    /// Whether this connection's stores send their checksums after the request (the server
    /// speaks protocol 3), hashing the blocks while the server copies them.
    fn checksums_after(&self) -> bool {
        self.version >= CHECKSUMS_AFTER_SINCE_VERSION
    }

    /// One `STORE` or `STORE_SEGMENTS` request; with `sums`, its items' checksums computed and
    /// sent after it ([`FLAG_CHECKSUMS_AFTER`]).
    async fn store_batch(
        &mut self,
        op: SnOp,
        buffer: BufferId,
        items: &[StoreItem],
        table: &[Segment],
        sums: Option<Sums<'_>>,
    ) -> Result<Vec<ItemStatus>, ClientError> {
        let flags = if sums.is_some() { FLAG_CHECKSUMS_AFTER } else { 0 };
        let req = self.request(op, flags, items.len() as u32, buffer.0, NamespaceId([0; 16]));
        let msg = message(&req, items, StoreItem::encode_into, table);
        let bytes = answer_bytes(items.iter().map(|i| i.header.payload_len), table);
        let poll = poll_budget(bytes).min(self.poll);
        let sums = sums.map(|s| (s, items.len()));
        let io = self.sock.exchange(async |s| do_store(s, &msg, sums, (op, items.len(), req.request_id), poll).await);
        let res = guard(&mut self.broken, self.timeout, io).await;
        self.settled(res).await?
    }

    /// `res` of a load or store, once it is safe to return: after a timeout the server may still
    /// be copying into (or out of) the caller's buffer, so this end is closed and the server's
    /// close awaited (it stops within 1 MiB of copies once it sees ours), at most
    /// [`LEAVE_WAIT`]. Any other failure ended the exchange already.
    async fn settled<T>(&mut self, res: Answer<T>) -> Answer<T> {
        if matches!(res, Err(ClientError::Timeout(_))) {
            let _ = self.sock.inner().shutdown().await;
            let mut sink = vec![0u8; 64 * 1024];
            let drained = tokio::time::timeout(LEAVE_WAIT, async {
                while let Ok(n) = self.sock.read(&mut sink).await {
                    if n == 0 {
                        break;
                    }
                }
            })
            .await;
            if drained.is_err() {
                tracing::warn!(
                    "the same-node server had not closed {LEAVE_WAIT:?} after a timed-out request; it may still copy into that request's buffer"
                );
            }
        }
        res
    }

    fn request(&mut self, op: SnOp, flags: u16, count: u32, buffer: u32, namespace: NamespaceId) -> SnRequest {
        self.next_request = self.next_request.wrapping_add(1);
        SnRequest { op, flags, request_id: self.next_request, count, buffer, namespace }
    }
}

/// A request's bytes: its header, its items, then its segment table (empty but for the
/// segmented ops).
fn message<T>(req: &SnRequest, items: &[T], encode: impl Fn(&T, &mut Vec<u8>), table: &[Segment]) -> Vec<u8> {
    let mut msg = req.encode().to_vec();
    for it in items {
        encode(it, &mut msg);
    }
    for s in table {
        s.encode_into(&mut msg);
    }
    msg
}

/// The bytes a request moves: its segment table's, or (unsegmented) its items'.
fn answer_bytes(items: impl Iterator<Item = u64>, table: &[Segment]) -> u64 {
    if table.is_empty() {
        items.fold(0u64, u64::saturating_add)
    } else {
        table.iter().map(|s| s.len).fold(0u64, u64::saturating_add)
    }
}

/// One answer, or a request-level refusal (the connection still in step).
type Answer<T> = Result<Result<T, ClientError>, ClientError>;

/// Runs one request/answer exchange under the request timeout. An I/O or framing failure or a
/// timeout breaks the connection for good (its stream position is unknown); a request-level
/// refusal (the inner `Err`) leaves it usable.
async fn guard<T>(
    broken: &mut Option<String>,
    t: Duration,
    io: impl std::future::Future<Output = Answer<T>>,
) -> Answer<T> {
    if let Some(why) = broken {
        return Err(ClientError::Io(format!("same-node connection unusable after an earlier failure ({why})")));
    }
    let res = match tokio::time::timeout(t, io).await {
        Ok(r) => r,
        Err(_) => Err(ClientError::Timeout(t)),
    };
    if let Err(e) = &res {
        *broken = Some(e.to_string());
    }
    res
}

async fn do_register(s: &mut PolledSocket, msg: &[u8], fd: BorrowedFd<'_>, id: u32) -> Answer<ResponseHeader> {
    send_with_fd(s.inner(), msg, fd).await?;
    read_header(s, SnOp::Register, id).await
}

async fn do_simple(s: &mut PolledSocket, msg: &[u8], op: SnOp, id: u32) -> Answer<ResponseHeader> {
    s.write_all(msg).await?;
    read_header(s, op, id).await
}

/// A load's request and answer; run inside [`PolledSocket::exchange`].
async fn do_load(
    s: &mut PolledSocket,
    msg: &[u8],
    (op, n, id): (SnOp, usize, u32),
    poll: Duration,
) -> Answer<Vec<Result<FrameHeader, ItemStatus>>> {
    let (poll, wait) = s.choose_wait(poll);
    s.write_all(msg).await?;
    s.poll_for_answer(poll).await;
    let h = match read_header(s, op, id).await? {
        Ok(h) => h,
        Err(e) => return Ok(Err(e)),
    };
    // The blocks are in the buffer once the answer's header is here.
    if let Some(ticket) = wait {
        ticket.answered();
    }
    check_count(&h, n)?;
    let mut statuses = vec![0u8; n];
    s.read_exact(&mut statuses).await?;
    let mut res = Vec::with_capacity(n);
    let mut fh = [0u8; FRAME_HEADER_LEN];
    for st in statuses {
        res.push(match ItemStatus::from_u8(st)? {
            ItemStatus::Ok => {
                s.read_exact(&mut fh).await?;
                let h = FrameHeader::decode(&fh)?;
                // A size its own layout, tokens and codec rule out is not a block.
                h.check_size()?;
                Ok(h)
            }
            other => Err(other),
        });
    }
    Ok(Ok(res))
}

/// The checksums of a store's items, computed after the request was sent: `of(first + i)` for
/// the request's item `i`.
#[derive(Clone, Copy)]
struct Sums<'a> {
    first: usize,
    of: &'a (dyn Fn(usize) -> u64 + Sync),
}

/// A store's request and answer; run inside [`PolledSocket::exchange`].
async fn do_store(
    s: &mut PolledSocket,
    msg: &[u8],
    sums: Option<(Sums<'_>, usize)>,
    (op, n, id): (SnOp, usize, u32),
    poll: Duration,
) -> Answer<Vec<ItemStatus>> {
    let (poll, wait) = s.choose_wait(poll);
    let sent = Instant::now();
    s.write_all(msg).await?;
    if let Some((sums, count)) = sums {
        // Hashed while the server copies the same blocks, in the same order.
        let all: Vec<u64> = (sums.first..sums.first + count).map(sums.of).collect();
        s.write_all(&encode_checksums(&all)).await?;
    }
    s.poll_for_answer(poll.saturating_sub(sent.elapsed())).await;
    let h = match read_header(s, op, id).await? {
        Ok(h) => h,
        Err(e) => return Ok(Err(e)),
    };
    if let Some(ticket) = wait {
        ticket.answered();
    }
    check_count(&h, n)?;
    let mut statuses = vec![0u8; n];
    s.read_exact(&mut statuses).await?;
    Ok(Ok(statuses.into_iter().map(ItemStatus::from_u8).collect::<Result<Vec<_>, _>>()?))
}

/// Sends `bytes` with `fd` attached to the first of them (`SCM_RIGHTS`).
async fn send_with_fd(s: &mut UnixStream, bytes: &[u8], fd: BorrowedFd<'_>) -> Result<(), ClientError> {
    let sent = loop {
        s.writable().await?;
        let fds = [fd];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut anc = SendAncillaryBuffer::new(&mut space);
        if !anc.push(SendAncillaryMessage::ScmRights(&fds)) {
            return Err(ClientError::Io("no room for the descriptor in the control message".into()));
        }
        let sock = &*s;
        let r = sock.try_io(Interest::WRITABLE, || {
            rustix::net::sendmsg(
                sock.as_fd(),
                &[IoSlice::new(bytes)],
                &mut anc,
                SendFlags::DONTWAIT | SendFlags::NOSIGNAL,
            )
            .map_err(std::io::Error::from)
        });
        match r {
            Ok(n) => break n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e.into()),
        }
    };
    s.write_all(&bytes[sent..]).await?;
    Ok(())
}

/// Reads an answer's header: `Ok(Err(..))` for a request-level refusal (its message read, the
/// connection still in step).
async fn read_header(s: &mut PolledSocket, op: SnOp, id: u32) -> Answer<ResponseHeader> {
    let mut b = [0u8; RESPONSE_HEADER_LEN];
    s.read_exact(&mut b).await?;
    let h = ResponseHeader::decode(&b)?;
    if h.status != Status::Ok {
        let mut msg = vec![0u8; h.msg_len as usize];
        s.read_exact(&mut msg).await?;
        let message = String::from_utf8_lossy(&msg).into_owned();
        // Request id 0: the server could not read the request and closed the connection.
        if h.request_id == 0 {
            return Err(ClientError::Refused { code: codes::INVALID_REQUEST.into(), message });
        }
        return Ok(Err(refusal(h.status, message)));
    }
    if h.op != op as u8 || h.request_id != id {
        return Err(ClientError::Io(format!("answer to {}/{} for request {:?}/{id}", h.op, h.request_id, op)));
    }
    Ok(Ok(h))
}

fn check_count(h: &ResponseHeader, n: usize) -> Result<(), ClientError> {
    if h.count as usize != n {
        return Err(ClientError::Io(format!("answer of {} items to a request of {n}", h.count)));
    }
    Ok(())
}

fn refusal(status: Status, message: String) -> ClientError {
    match status {
        Status::Unauthenticated => ClientError::Unauthenticated(message),
        Status::Forbidden => ClientError::Forbidden(message),
        Status::UnknownNamespace => ClientError::UnknownNamespace(message),
        Status::TooLarge => ClientError::Refused { code: codes::CAPACITY.into(), message },
        Status::TooManyConnections => ClientError::Refused { code: codes::TOO_MANY_CONNECTIONS.into(), message },
        Status::BadRequest | Status::UnsupportedVersion => {
            ClientError::Refused { code: codes::INVALID_REQUEST.into(), message }
        }
        Status::Ok | Status::Internal => ClientError::Refused { code: codes::INTERNAL.into(), message },
    }
}

/// Bytes `offset .. offset + len` as a range of a buffer, if they fit in a `usize`.
fn block_range(offset: u64, len: u64) -> Option<std::ops::Range<usize>> {
    let start = usize::try_from(offset).ok()?;
    Some(start..start.checked_add(usize::try_from(len).ok()?)?)
}

/// Decodes an encoded block that landed at the start of `block` into the whole of `block`.
fn decode_in_place(block: &mut [u8], h: FrameHeader) -> Result<(), ClientError> {
    let encoded = usize::try_from(h.payload_len)
        .ok()
        .and_then(|n| block.get(..n))
        .ok_or_else(|| ClientError::InvalidArgument("an encoded block larger than its place".into()))?;
    let encoded = Bytes::copy_from_slice(encoded);
    decode_frame_into(&BlockFrame { header: h, payload: encoded }, block)
}

/// Runs of consecutive blocks that one segmented request can carry: at most `max_items` blocks
/// and [`MAX_SEGMENTS_PER_REQUEST`] segments. An error for a block with no segment or more than
/// [`MAX_SEGMENTS_PER_ITEM`].
fn segment_batches(
    segments: &[Vec<Segment>],
    max_items: usize,
    max_bytes: Option<u64>,
) -> Result<Vec<std::ops::Range<usize>>, ClientError> {
    let mut out = Vec::new();
    let (mut start, mut in_batch, mut bytes) = (0, 0usize, 0u64);
    for (i, s) in segments.iter().enumerate() {
        if s.is_empty() || s.len() as u64 > MAX_SEGMENTS_PER_ITEM {
            return Err(ClientError::InvalidArgument(format!(
                "block {i} has {} segments; a block has 1 to {MAX_SEGMENTS_PER_ITEM}",
                s.len()
            )));
        }
        let len = s.iter().fold(0u64, |t, s| t.saturating_add(s.len));
        let over_bytes = max_bytes.is_some_and(|m| bytes.saturating_add(len) > m);
        if i > start && (i - start == max_items.max(1) || in_batch + s.len() > MAX_SEGMENTS_PER_REQUEST || over_bytes) {
            out.push(start..i);
            (start, in_batch, bytes) = (i, 0, 0);
        }
        in_batch += s.len();
        bytes = bytes.saturating_add(len);
    }
    if start < segments.len() {
        out.push(start..segments.len());
    }
    Ok(out)
}

/// With checksums sent after a store request, the server holds every item's copy uncommitted
/// (a lease on a DRAM slot) until they arrive: a request carries at most this many bytes (or one
/// block), so a batch never needs more of the server's lease budget (half its DRAM tier, shared)
/// than a few plain stores. Larger batches were refused past that budget (`Capacity`).
const AFTER_BATCH_BYTES: u64 = 8 << 20;

/// Consecutive ranges of items of `lens` bytes, each of at most `max_items` items and (with
/// `max_bytes`) at most that many bytes, or one item.
fn byte_batches(
    lens: impl Iterator<Item = u64>,
    max_items: usize,
    max_bytes: Option<u64>,
) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut bytes, mut end) = (0usize, 0u64, 0usize);
    for (i, len) in lens.enumerate() {
        if i > start && (i - start == max_items.max(1) || max_bytes.is_some_and(|m| bytes.saturating_add(len) > m)) {
            out.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes = bytes.saturating_add(len);
        end = i + 1;
    }
    if start < end {
        out.push(start..end);
    }
    out
}

/// Decodes an encoded block that landed in `segments` (in order) into `block_bytes` bytes put
/// back into the same segments.
fn decode_in_segments(
    buf: &mut BufferAccess<'_, '_>,
    segments: &[Segment],
    block_bytes: u64,
    h: FrameHeader,
) -> Result<(), ClientError> {
    let bad = || ClientError::InvalidArgument("segments outside the buffer or too small for the block".into());
    let ranges: Vec<_> =
        segments.iter().map(|s| block_range(s.offset, s.len)).collect::<Option<_>>().ok_or_else(bad)?;
    // The encoded bytes landed in these segments: a larger length can't be right, and is not
    // allocated for.
    if h.payload_len > ranges.iter().map(|r| r.len() as u64).sum::<u64>() {
        return Err(bad());
    }
    let mut encoded = Vec::with_capacity(h.payload_len as usize);
    for r in &ranges {
        let want = (h.payload_len as usize - encoded.len()).min(r.len());
        encoded.extend_from_slice(buf.bytes(r.start..r.start + want).ok_or_else(bad)?);
    }
    if encoded.len() as u64 != h.payload_len {
        return Err(bad());
    }
    let mut decoded = vec![0u8; usize::try_from(block_bytes).map_err(|_| bad())?];
    decode_frame_into(&BlockFrame { header: h, payload: Bytes::from(encoded) }, &mut decoded)?;
    let mut at = 0;
    for r in ranges {
        let n = (decoded.len() - at).min(r.len());
        buf.bytes_mut(r.start..r.start + n).ok_or_else(bad)?.copy_from_slice(&decoded[at..at + n]);
        at += n;
    }
    if at != decoded.len() {
        return Err(bad());
    }
    Ok(())
}

/// This host's boot id (`/proc/sys/kernel/random/boot_id`), empty where unknown.
pub(crate) fn host_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().to_string()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_buffer_is_a_sealed_memfd_of_its_size() {
        let mut b = SharedBuffer::new(3 * 4096 + 5).unwrap();
        assert_eq!(b.len(), 3 * 4096 + 5);
        b.as_mut_slice()[12_000] = 7;
        assert_eq!(b.as_slice()[12_000], 7);
        let seals = rustix::fs::fcntl_get_seals(b.fd()).unwrap();
        assert!(seals.contains(SealFlags::SHRINK | SealFlags::GROW));
        assert!(rustix::fs::ftruncate(b.fd(), 10).is_err(), "a sealed buffer can't shrink");
        assert!(SharedBuffer::new(0).is_err());
        assert_ne!(SharedBuffer::new(1).unwrap().uid, b.uid);
    }

    const MAPS: &str = "\
7f0000000000-7f0000002000 rw-s 00001000 00:1a 42 /dev/shm/vllm_offload_e.mmap
7f0000002000-7f0000003000 rw-s 00003000 00:1a 42 /dev/shm/vllm_offload_e.mmap
7f0000003000-7f0000004000 rw-s 00000000 00:1a 43 /dev/shm/other
7f0000004000-7f0000005000 rw-p 00000000 00:00 0
7f0000005000-7f0000006000 r--s 00000000 00:1a 44 /dev/shm/ro (deleted)
";

    #[test]
    fn a_range_is_found_in_the_maps_only_when_one_file_covers_it_shared_and_contiguous() {
        let at = |a: usize, l: usize| find_mapping(MAPS, a, l);
        let m = at(0x7f00_0000_0100, 0x2000).unwrap();
        assert_eq!((m.dev.as_str(), m.inode, m.offset), ("00:1a", 42, 0x1100));
        assert_eq!(m.path, "/dev/shm/vllm_offload_e.mmap");
        assert!(at(0x7f00_0000_2f00, 0x200).is_err(), "into another file");
        assert!(at(0x7f00_0000_4000, 16).is_err(), "anonymous private memory");
        assert!(at(0x7f00_0000_5000, 16).is_err(), "read-only");
        assert!(at(0x7f00_0000_5800, 0x1000).is_err(), "past the last mapping");
        assert!(at(0x1000, 16).is_err(), "nothing mapped");
        assert!(at(0x7f00_0000_0000, 0).is_err());
    }

    #[test]
    fn a_shared_mapping_of_a_shm_file_is_found_and_mapped_again() {
        use std::os::unix::fs::FileExt;
        let path = format!("/dev/shm/kvtier_unit_{}.mmap", std::process::id());
        let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        file.set_len(3 * 4096).unwrap();
        // SAFETY: this test's own file, not truncated while mapped.
        let mut theirs = unsafe { memmap2::MmapMut::map_mut(&file) }.unwrap();
        std::fs::remove_file(&path).unwrap(); // unlinked, as vLLM does once its workers joined
        theirs[4096 + 10] = 9;
        let mine = SharedBuffer::from_mapping(theirs.as_ptr() as usize + 4096 + 3, 100).unwrap();
        assert!(mine.is_file_region());
        assert_eq!((mine.file_offset(), mine.len()), (4096 + 3, 100));
        assert_eq!(mine.as_slice()[7], 9, "the same pages");
        file.write_all_at(&[5], 4096 + 3).unwrap();
        assert_eq!(mine.as_slice()[0], 5);
        assert_eq!(theirs[4096 + 3], 5);
        let private = vec![0u8; 4096];
        assert!(SharedBuffer::from_mapping(private.as_ptr() as usize, 100).is_err());
        file.set_len(4096).unwrap();
        assert!(mine.check_intact().is_err(), "truncated under the region");
    }
}
