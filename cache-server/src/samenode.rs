//! The same-node path: clients on this host register buffers of their own shared memory over a
//! Unix socket (protocol in `kvtier_proto::samenode`) and move blocks by offset into them (or
//! into several segments of them per block), one copy each way, with no payload on the socket.
//!
//! - A load looks the block up through the tier stack and copies it from its slot into the
//!   client's buffer with streaming stores (the client reads those bytes next, not us: see
//!   `kvtier_kernels::copy`), published before the answer; the answer carries the frame header.
//!   A DRAM block is checked against its frame checksum in the same pass, chunk by chunk while
//!   the bytes are in cache (the tier does not hash it first), so its bytes are read once; a
//!   block damaged in memory is reported and removed, never handed over as good. Blocks from
//!   other tiers were checked by the tier.
//! - A store reserves a DRAM lease, copies the payload from the client's buffer into it and
//!   verifies the checksum on *that copy* before committing: bytes the client can still change
//!   are never trusted, so a client racing its own store gets `ChecksumMismatch`, never a stored
//!   block that fails its checksum.
//! - A block may lie in several pieces of the buffer (`LOAD_SEGMENTS` / `STORE_SEGMENTS`: an
//!   engine page's K and V halves, or one piece per layer): it is copied piece by piece in order
//!   and checked across the pieces in the same pass, with every piece bounds-checked first.
//!
//! Safety of the client's memory:
//! - Memfds sealed with `F_SEAL_SHRINK` are mapped, and only when `fstat` shows at least the
//!   length the client claims; the mapping covers exactly that length. Seals can't be removed,
//!   so no page the server maps can disappear under it: a truncating client can't SIGBUS the node.
//! - Anything else must be a regular file on tmpfs opened `O_RDWR` without `O_APPEND` — an
//!   engine's own shared region, such as vLLM's `/dev/shm/vllm_offload_<engine_id>.mmap`, which
//!   its owner can't seal. It is never mapped: each copy is a `pread`/`pwrite` at its offset,
//!   checked against the file's `fstat` size first, so a truncated file is a request refused with
//!   a message (or, truncated mid-request, an item answered `OutOfRange`), never a fault, and the
//!   server never grows the file past the registered length.
//! - Every offset + length is bounds-checked against the registered length before a byte moves.
//! - Buffers are per connection, capped in number ([`MAX_BUFFERS_PER_CONNECTION`]) and mapped
//!   bytes ([`MAX_BUFFER_BYTES_PER_CONNECTION`]), and the bytes the node maps for all connections
//!   together are capped by `samenode_max_registered_bytes` (a file buffer maps nothing and
//!   counts for none). A memfd is mapped once for the node ([`Mappings`]), however many
//!   connections register it (a client registers a buffer on each pooled connection it uses).
//!   A connection lets go of its buffers when it ends (or on `UNREGISTER`) and never touches one
//!   after; a mapping is unmapped once no connection has it. A sparse memfd is mapped without
//!   populating it, so claiming a large buffer never makes the server allocate its pages.
//!   Requests are served one at a time per connection, so no copy outlives its request.
//! - A client that closes its end mid-request (its call timed out, or it died) has left: the
//!   server looks for that between blocks (every [`LEFT_CHECK_BYTES`] copied) and ends the
//!   connection there, so it stops writing a buffer its owner may already be reusing. The client
//!   waits for that close before its timed-out call returns.
//! - Copies run on the connection's runtime worker, so at the same points a long request also
//!   yields it: other connections on that worker wait for at most a MiB of copies, however large
//!   the blocks or the request.
//! - The server only ever copies blocks into a client's own buffer and reads from it; no client is
//!   given a mapping of the server's arena or of anything holding other namespaces' blocks.
//!
//! The client's memory is shared with a process that may write it at any time, so it is never
//! seen as a Rust slice: bytes move with raw-pointer copies, and only the server's own copy is
//! hashed.

use std::collections::{HashMap, VecDeque};
use std::io::IoSliceMut;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use kvtier_proto::dataplane::{HelloReply, ItemStatus, ResponseHeader, Status, FLAG_STOP_AT_MISS};
use kvtier_proto::samenode::{
    self as sn, decode_hello, LoadItem, Segment, SnOp, SnRequest, StoreItem, HELLO_LEN, MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION, REQUEST_LEN, SEGMENTS_SINCE_VERSION,
};
use kvtier_proto::{BlockKey, FrameHeader, NamespaceId};
use memmap2::{MmapOptions, MmapRaw};
use rustix::fs::SealFlags;
use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;

use crate::cluster::fetch::PeerFetch;
use crate::dram::SlotWriter;
use crate::error::ServerError;
use crate::listen::{ConnLimits, Peer};
use crate::metrics::{error, observe};
use crate::state::NodeState;
use crate::tenants::{Access, Principal};

/// Most buffers one connection may have registered at once.
pub const MAX_BUFFERS_PER_CONNECTION: usize = 64;
/// Most bytes of buffers one connection may have registered at once (address space the server
/// maps; the pages are the client's).
pub const MAX_BUFFER_BYTES_PER_CONNECTION: u64 = 64 << 30;
/// Most concurrent same-node connections; more wait in the accept backlog.
pub const MAX_CONNECTIONS: usize = 256;
/// File descriptors received but not yet claimed by a `REGISTER`; more end the connection.
const MAX_PENDING_FDS: usize = 4;
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
const READ_BUF: usize = 64 * 1024;
/// Calls that copied up to this many payload bytes are followed by polling for the next one.
const POLL_AFTER_BYTES: u64 = 256 << 10;

/// Copy-and-hash step: small enough that the bytes just copied are still in cache when hashed.
const CHUNK: usize = 64 * 1024;
/// `pread`/`pwrite` step for file buffers: hashed right after it moved, like [`CHUNK`], but
/// larger to spread the system call's cost.
const FILE_CHUNK: usize = 256 * 1024;
/// Bytes a request copies between two looks at whether its client closed its end (one
/// non-blocking `recv` each) and two yields of its worker to the other tasks there.
pub const LEFT_CHECK_BYTES: u64 = 1 << 20;

/// This host's identity: the kernel's boot id (`/proc/sys/kernel/random/boot_id`), which a client
/// compares with its own to know it is on the same host; empty where unknown.
pub fn host_id() -> &'static str {
    static ID: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    ID.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().to_string()).unwrap_or_default()
    })
}

/// Binds the same-node socket at `path` with mode 0600: bound under a temporary name, chmodded,
/// then renamed into place, so nobody can connect before the mode is set. A stale socket left by
/// a crashed node at `path` is replaced (the data directory's lock says no live node owns it).
pub fn bind(path: &Path) -> Result<UnixListener, ServerError> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let cfg = |m: String| ServerError::Config(format!("samenode_socket {}: {m}", path.display()));
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(cfg("exists and is not a socket".into()));
        }
        std::fs::remove_file(path).map_err(|e| cfg(format!("cannot remove the stale socket: {e}")))?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".{}.tmp", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let _ = std::fs::remove_file(&tmp);
    let listener = UnixListener::bind(&tmp).map_err(|e| cfg(format!("cannot listen: {e}")))?;
    let placed = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))
        .and_then(|_| std::fs::rename(&tmp, path));
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&tmp);
        return Err(cfg(format!("cannot set up the socket file: {e}")));
    }
    Ok(listener)
}

/// Accepts same-node connections (at most [`MAX_CONNECTIONS`] at once) until `stop` turns true;
/// then ends every connection (unmapping their buffers) and removes the socket file at `path`.
pub async fn serve(listener: UnixListener, path: PathBuf, state: Arc<NodeState>, stop: watch::Receiver<bool>) {
    let limits =
        ConnLimits { total: MAX_CONNECTIONS, per_peer: state.config().max_connections_per_peer.min(MAX_CONNECTIONS) };
    let mappings = Mappings::new(
        state.config().samenode_max_registered_bytes(),
        state.config().samenode_max_registered_bytes_per_tenant(),
    );
    if !mappings.by_open_file {
        tracing::warn!(
            "kcmp is refused here (a seccomp filter?): a same-node buffer is mapped once per client process (by its \
             device and inode), not once per open file"
        );
    }
    crate::listen::accept_bounded(
        "same-node",
        limits,
        stop,
        || async {
            let (sock, _) = listener.accept().await?;
            let who = sock.peer_cred().map_or(Peer::Unknown, |c| Peer::Uid(c.uid()));
            Ok((sock, who))
        },
        |sock, mut stop| {
            let state = state.clone();
            let mappings = mappings.clone();
            async move {
                tokio::select! {
                    _ = crate::stopped(&mut stop) => {}
                    res = Conn::new(sock, state, mappings).run() => {
                        if let Err(e) = res {
                            tracing::debug!("same-node connection closed: {e}");
                        }
                    }
                }
            }
        },
        |sock, why| {
            let (r, w) = sock.into_split();
            crate::listen::refuse_with_hello_reply(r, w, why)
        },
    )
    .await;
    drop(listener);
    let _ = std::fs::remove_file(&path);
}

/// Why a connection ended early.
#[derive(Debug, thiserror::Error)]
enum ConnError {
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Protocol(String),
    #[error("the client closed its end during a request")]
    ClientLeft,
}

/// A client's buffer for as long as it is registered: a sealed memfd mapped shared, or a file on
/// tmpfs that can shrink (an engine's own `/dev/shm` region), never mapped, moved with
/// `pread`/`pwrite`.
struct Registered {
    memory: Memory,
    len: u64,
}

/// How the server reaches a registered buffer's bytes.
enum Memory {
    /// A memfd sealed with `F_SEAL_SHRINK`: its pages can't go away, so it is mapped (once for
    /// the node, however many connections register it).
    Mapped(Arc<Mapping>),
    /// A tmpfs file the client can truncate at any time: mapping it would let a truncation SIGBUS
    /// the server, so every copy is a `pread`/`pwrite` after an `fstat` size check, and a short
    /// read or write is an error, never a fault.
    File(std::fs::File),
}

/// Where one item's bytes are in a registered buffer (bounds-checked).
#[derive(Clone, Copy)]
enum Place<'a> {
    Mapped(*mut u8),
    File(&'a std::fs::File, u64),
}

/// One piece of a block in a registered buffer: where, and how many of the block's bytes (a
/// block in one piece has one; a segmented request's block one per segment it fills).
struct Piece<'a> {
    place: Place<'a>,
    len: usize,
}

/// How a copy between a slot and a registered buffer ended.
#[derive(Debug, PartialEq, Eq)]
enum Copied {
    Ok,
    ChecksumMismatch,
    /// A file buffer ended before the item's last byte (the client truncated it), or its I/O
    /// failed: nothing usable was copied.
    Short,
}

/// `statfs` magic of tmpfs (`/dev/shm`, memfds): file buffers must live in memory.
const TMPFS_MAGIC: i64 = 0x0102_1994;

impl Registered {
    /// Checks `fd` and maps `claimed` bytes of it (`sealed`: a memfd sealed with
    /// `F_SEAL_SHRINK`, which seals can't undo), or keeps it for `pread`/`pwrite` (a tmpfs file
    /// that can shrink; also one sealed only after the caller looked).
    fn map(
        fd: OwnedFd,
        claimed: u64,
        sealed: bool,
        mappings: &Arc<Mappings>,
        peer: Option<u32>,
        tenant: Option<&str>,
    ) -> Result<Registered, Refusal> {
        if claimed == 0 {
            return Err(Refusal::Bad("a buffer of 0 bytes".into()));
        }
        let st = rustix::fs::fstat(&fd).map_err(|e| Refusal::Bad(format!("fstat: {e}")))?;
        if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
            return Err(Refusal::Bad("the descriptor is not a memfd or a tmpfs file".into()));
        }
        let size = u64::try_from(st.st_size).unwrap_or(0);
        if !sealed {
            return Self::file(fd, claimed, size).map_err(Refusal::Bad);
        }
        if size < claimed {
            return Err(Refusal::Bad(format!("the memfd is {size} bytes, smaller than the {claimed} claimed")));
        }
        let map = mappings.map(fd, &st, claimed, peer, tenant)?;
        Ok(Registered { memory: Memory::Mapped(map), len: claimed })
    }

    /// A buffer that can shrink: only a tmpfs file opened read-write without `O_APPEND` (an
    /// appending `pwrite` would write at the end, not at the offset asked).
    fn file(fd: OwnedFd, claimed: u64, size: u64) -> Result<Registered, String> {
        let fs = rustix::fs::fstatfs(&fd).map_err(|e| format!("fstatfs: {e}"))?;
        #[allow(clippy::unnecessary_cast)] // `f_type`'s width differs between targets
        if fs.f_type as i64 != TMPFS_MAGIC {
            return Err("the descriptor is neither a memfd sealed with F_SEAL_SHRINK nor a file on tmpfs (/dev/shm); \
                        seal a memfd before registering it"
                .into());
        }
        let flags = rustix::fs::fcntl_getfl(&fd).map_err(|e| format!("F_GETFL: {e}"))?;
        if flags & rustix::fs::OFlags::ACCMODE != rustix::fs::OFlags::RDWR {
            return Err("the file is not open for reading and writing (O_RDWR)".into());
        }
        if flags.contains(rustix::fs::OFlags::APPEND) {
            return Err("the file is open with O_APPEND".into());
        }
        if size < claimed {
            return Err(format!("the file is {size} bytes, smaller than the {claimed} claimed"));
        }
        Ok(Registered { memory: Memory::File(std::fs::File::from(fd)), len: claimed })
    }

    /// The bytes this buffer holds of the connection's and the node's caps: its length when
    /// mapped, nothing for a file (the server maps none of it).
    fn charged(&self) -> u64 {
        match self.memory {
            Memory::Mapped(_) => self.len,
            Memory::File(_) => 0,
        }
    }

    /// The pieces that `payload_len` bytes fill of `segments`, in order (a payload may end before
    /// the last segment does); `None` if a segment lies outside the buffer or the payload is
    /// longer than the segments together.
    fn pieces(&self, segments: &[Segment], payload_len: u64) -> Option<Vec<Piece<'_>>> {
        let mut left = payload_len;
        let mut out = Vec::with_capacity(segments.len());
        for s in segments {
            let place = self.place(s.offset, s.len)?;
            let len = left.min(s.len);
            if len > 0 {
                out.push(Piece { place, len: usize::try_from(len).ok()? });
            }
            left -= len;
        }
        (left == 0).then_some(out)
    }

    /// Where `offset .. offset + len` is, if it lies inside the buffer.
    fn place(&self, offset: u64, len: u64) -> Option<Place<'_>> {
        let end = offset.checked_add(len)?;
        if end > self.len {
            return None;
        }
        match &self.memory {
            // SAFETY: `offset + len <= self.len`, at most the mapped length (`Mappings::map` hands
            // out a mapping only as long as the claim, or longer), so the pointer stays inside (or
            // one past the end of) the mapping.
            Memory::Mapped(m) => Some(Place::Mapped(unsafe { m.map.as_mut_ptr().add(offset as usize) })),
            Memory::File(f) => Some(Place::File(f, offset)),
        }
    }

    /// Why a file buffer can't be used now (the client truncated it below the registered
    /// length); `None` for a mapped buffer or an intact file.
    fn truncated(&self) -> Option<String> {
        let Memory::File(f) = &self.memory else { return None };
        let size = match f.metadata() {
            Ok(m) => m.len(),
            Err(e) => return Some(format!("fstat of the registered file failed: {e}")),
        };
        (size < self.len).then(|| {
            format!(
                "the registered file is {size} bytes now, shorter than the {} registered: it was truncated; \
                 unregister it and register it again",
                self.len
            )
        })
    }
}

/// The bytes of buffers all same-node connections have registered, held against
/// `samenode_max_registered_bytes`, and each tenant's against
/// `samenode_max_registered_bytes_per_tenant` (reserved before a buffer is mapped, released
/// when it is unmapped).
pub(crate) struct RegisteredBudget {
    used: AtomicU64,
    cap: u64,
    per_tenant: u64,
    by_tenant: Mutex<HashMap<String, u64>>,
}

impl RegisteredBudget {
    pub(crate) fn new(cap: u64, per_tenant: u64) -> Self {
        RegisteredBudget { used: AtomicU64::new(0), cap, per_tenant, by_tenant: Mutex::new(HashMap::new()) }
    }

    fn tenants(&self) -> std::sync::MutexGuard<'_, HashMap<String, u64>> {
        // Whole counts only: one left by a panicking holder is still sound.
        self.by_tenant.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Reserves `n` bytes for `tenant` (`None`: the operator, held by the node's cap only).
    fn reserve(&self, n: u64, tenant: Option<&str>) -> Result<(), String> {
        let Some(t) = tenant else { return self.reserve_node(n) };
        let mut by = self.tenants();
        let mine = by.get(t).copied().unwrap_or(0);
        if mine.saturating_add(n) > self.per_tenant {
            return Err(format!(
                "{n} more bytes would pass tenant {t:?}'s share of {} bytes of buffers this node maps ({mine} \
                 registered; samenode_max_registered_bytes_per_tenant)",
                self.per_tenant
            ));
        }
        self.reserve_node(n)?;
        *by.entry(t.to_string()).or_default() += n;
        Ok(())
    }

    fn release(&self, n: u64, tenant: Option<&str>) {
        if let Some(t) = tenant {
            let mut by = self.tenants();
            if let Some(mine) = by.get_mut(t) {
                *mine = mine.saturating_sub(n);
                if *mine == 0 {
                    by.remove(t);
                }
            }
        }
        self.release_node(n);
    }

    fn reserve_node(&self, n: u64) -> Result<(), String> {
        let res = self.used.fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
            used.checked_add(n).filter(|&total| total <= self.cap)
        });
        match res {
            Ok(used) => {
                ::metrics::gauge!("kvtier_samenode_registered_bytes").set((used + n) as f64);
                Ok(())
            }
            Err(used) => Err(format!(
                "{n} more bytes would pass the {} bytes of buffers this node maps for all same-node clients ({used} \
                 registered; samenode_max_registered_bytes)",
                self.cap
            )),
        }
    }

    fn release_node(&self, n: u64) {
        let used = self.used.fetch_sub(n, Ordering::AcqRel) - n;
        ::metrics::gauge!("kvtier_samenode_registered_bytes").set(used as f64);
    }
}

/// The node's mappings of sealed memfds, one per file: a client registers a buffer on each of
/// its pooled connections, and every registration after the first uses the mapping the first
/// made — populated once, charged once against `samenode_max_registered_bytes`, one set of page
/// tables. A mapping lives while any connection has it registered.
///
/// A file is found by its device and inode numbers, and a registration uses the mapping found
/// only if its descriptor is the very open file that was mapped (`kcmp(KCMP_FILE)`: a client
/// passes one descriptor on each of its connections) and still lets the server write to it
/// (`O_RDWR`, no write seal since). Otherwise the file is mapped anew, which the kernel refuses as
/// it would have without the registry. The numbers alone would not do: a read-only descriptor of
/// a file mapped writable by another client, or a memfd sealed against writes after it was
/// mapped, would have its pages written; and inode numbers are reused while files live (a
/// hugetlbfs memfd's, and every memfd's before Linux 5.9, come from a wrapping 32-bit counter).
/// Where `kcmp` is refused (a seccomp filter), a mapping is shared only among the connections of
/// the client process that made it (its pid, from the socket's peer credentials), still only
/// through a descriptor that lets the server write: a process gets nothing it didn't have, and two
/// live files sharing an inode number could only mix buffers of that one process.
pub(crate) struct Mappings {
    budget: RegisteredBudget,
    by_file: Mutex<HashMap<FileId, Weak<Mapping>>>,
    /// Whether sharing is decided by the open file (`kcmp` works here), else by the client process.
    by_open_file: bool,
}

/// A file's device and inode numbers.
type FileId = (u64, u64);

/// One memfd mapped shared and writable, unmapped (its bytes back in the node's budget) when the
/// last connection that registered it lets go.
pub(crate) struct Mapping {
    map: MmapRaw,
    len: u64,
    file: FileId,
    /// The descriptor it was mapped through: a later registration shares the mapping only if its
    /// descriptor is this same open file.
    fd: OwnedFd,
    /// The pid of the client process that registered it first (`None`: unknown).
    peer: Option<u32>,
    /// The tenant charged for it (the first to register it; `None`: the operator).
    tenant: Option<String>,
    owner: Arc<Mappings>,
}

/// Whether `a` and `b`, descriptors of this process, are the same open file (one descriptor
/// passed again, or a `dup` of it); `None` where the kernel can't say (no `kcmp`, or a seccomp
/// filter refuses it, as Docker's default profile does without `CAP_SYS_PTRACE`).
fn same_open_file(a: impl AsFd, b: impl AsFd) -> Option<bool> {
    use std::os::fd::AsRawFd;
    const KCMP_FILE: libc::c_int = 0;
    let pid = std::process::id() as libc::pid_t;
    let (a, b) = (a.as_fd().as_raw_fd(), b.as_fd().as_raw_fd());
    // SAFETY: `kcmp` reads and writes none of this process's memory: it compares the kernel's
    // file objects behind two descriptor numbers of this process, both open (borrowed) for the
    // call's length.
    let r = unsafe { libc::syscall(libc::SYS_kcmp, pid, pid, KCMP_FILE, a, b) };
    (r >= 0).then_some(r == 0)
}

/// Whether this process can tell that a descriptor is an open file it already mapped (`kcmp`):
/// without it, mappings are shared by client process instead ([`Mappings`]). Checked once, at the
/// node's start.
pub fn registrations_share_mappings() -> bool {
    rustix::fs::memfd_create("kvtier-kcmp-probe", rustix::fs::MemfdFlags::CLOEXEC)
        .ok()
        .and_then(|fd| same_open_file(&fd, &fd))
        .unwrap_or(false)
}

/// Whether the server may write through `fd`: open read-write, and sealed against neither writes
/// nor future writes.
fn writable(fd: &OwnedFd) -> bool {
    let rw = rustix::fs::fcntl_getfl(fd).is_ok_and(|f| f & rustix::fs::OFlags::ACCMODE == rustix::fs::OFlags::RDWR);
    let sealed =
        rustix::fs::fcntl_get_seals(fd).map_or(true, |s| s.intersects(SealFlags::WRITE | SealFlags::FUTURE_WRITE));
    rw && !sealed
}

impl Mappings {
    pub(crate) fn new(cap: u64, per_tenant: u64) -> Arc<Self> {
        Self::with_identity(cap, per_tenant, registrations_share_mappings())
    }

    /// `by_open_file`: share by open file (`kcmp`), else by client process.
    fn with_identity(cap: u64, per_tenant: u64, by_open_file: bool) -> Arc<Self> {
        Arc::new(Mappings {
            budget: RegisteredBudget::new(cap, per_tenant),
            by_file: Mutex::new(HashMap::new()),
            by_open_file,
        })
    }

    /// Whether a registration of `fd` by the client process `peer` may use `m`, a mapping of the
    /// same device and inode: the same open file (or, without `kcmp`, the same client process),
    /// and a descriptor the server may still write through.
    fn shares(&self, m: &Mapping, fd: &OwnedFd, peer: Option<u32>) -> bool {
        let same =
            if self.by_open_file { same_open_file(&m.fd, fd) == Some(true) } else { peer.is_some() && m.peer == peer };
        same && writable(fd)
    }

    fn files(&self) -> std::sync::MutexGuard<'_, HashMap<FileId, Weak<Mapping>>> {
        // The map only ever holds whole entries: one left by a panicking holder is still sound.
        self.by_file.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The node's mapping of the sealed memfd `fd` (`st` its `fstat`), at least `claimed` bytes
    /// long, for the client process `peer`: the one already made if it is long enough and
    /// [`Mappings::shares`] it, else a new one of `claimed` bytes, charged against the node's
    /// budget first, and `tenant`'s share of it (nothing is mapped over it).
    fn map(
        self: &Arc<Self>,
        fd: OwnedFd,
        st: &rustix::fs::Stat,
        claimed: u64,
        peer: Option<u32>,
        tenant: Option<&str>,
    ) -> Result<Arc<Mapping>, Refusal> {
        #[allow(clippy::unnecessary_cast)] // `st_dev`'s and `st_ino`'s widths differ between targets
        let file: FileId = (st.st_dev as u64, st.st_ino as u64);
        // The lock is let go before `found` may be dropped: dropping the last holder of a
        // mapping takes it again.
        let found = self.files().get(&file).and_then(Weak::upgrade);
        if let Some(m) = found.filter(|m| m.len >= claimed && self.shares(m, &fd, peer)) {
            return Ok(m);
        }
        let len = usize::try_from(claimed).map_err(|_| Refusal::Bad("buffer too large for this host".into()))?;
        self.budget.reserve(claimed, tenant).map_err(Refusal::Cap)?;
        // Shared and writable: loads land where the client reads them. Populated now when the
        // client has already touched every page (they are charged to it), so the first copy into
        // it doesn't take a page fault per 4 KiB. A sparse memfd is not: populating it would make
        // the server allocate (and be charged for) memory the client only claimed.
        let allocated = u64::try_from(st.st_blocks).unwrap_or(0).saturating_mul(512);
        let mut options = MmapOptions::new();
        options.len(len);
        if allocated >= claimed {
            options.populate();
        }
        let map = match options.map_raw(&fd) {
            Ok(map) => map,
            Err(e) => {
                self.budget.release(claimed, tenant);
                return Err(Refusal::Bad(format!("mmap: {e}")));
            }
        };
        let tenant = tenant.map(str::to_string);
        let m = Arc::new(Mapping { map, len: claimed, file, fd, peer, tenant, owner: self.clone() });
        // Two connections that mapped the same file at once both keep theirs; later ones find
        // the last (a shorter mapping still held stays valid for those holding it).
        self.files().insert(file, Arc::downgrade(&m));
        Ok(m)
    }

    /// Bytes mapped for all connections now.
    #[cfg(test)]
    fn mapped_bytes(&self) -> u64 {
        self.budget.used.load(Ordering::Acquire)
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        self.owner.budget.release(self.len, self.tenant.as_deref());
        let mut files = self.owner.files();
        // Another mapping of the same file may have taken the entry meanwhile: that one stays.
        if files.get(&self.file).is_some_and(|w| w.strong_count() == 0) {
            files.remove(&self.file);
        }
    }
}

/// The buffers of one connection; a memfd's mapping is let go when the connection drops (and
/// unmapped once no other connection has it registered).
struct Buffers {
    by_id: HashMap<u32, Registered>,
    /// Bytes of memfds this connection has registered (each counted on every connection that
    /// registers it; the node's budget counts each file once).
    bytes: u64,
    next_id: u32,
    mappings: Arc<Mappings>,
    /// The client process's pid, from the socket's peer credentials (`None`: unknown).
    peer: Option<u32>,
}

impl Buffers {
    fn new(mappings: Arc<Mappings>, peer: Option<u32>) -> Self {
        Buffers { by_id: HashMap::new(), bytes: 0, next_id: 0, mappings, peer }
    }

    /// Checks `fd` against this connection's and the node's caps, then maps it: nothing is
    /// mapped (or populated) for a buffer over a cap.
    fn add(&mut self, fd: OwnedFd, claimed: u64, tenant: Option<&str>) -> Result<u32, Refusal> {
        if self.by_id.len() >= MAX_BUFFERS_PER_CONNECTION {
            return Err(Refusal::Cap(format!(
                "this connection already has {MAX_BUFFERS_PER_CONNECTION} buffers registered"
            )));
        }
        // The byte caps bound what the server maps: a file it only copies to and from costs it
        // no address space, and is not counted.
        let mapped = rustix::fs::fcntl_get_seals(&fd).is_ok_and(|s| s.contains(SealFlags::SHRINK));
        let charge = if mapped { claimed } else { 0 };
        if self.bytes.saturating_add(charge) > MAX_BUFFER_BYTES_PER_CONNECTION {
            return Err(Refusal::Cap(format!(
                "{claimed} more bytes would pass the {MAX_BUFFER_BYTES_PER_CONNECTION} bytes of buffers one connection \
                 may register"
            )));
        }
        let r = Registered::map(fd, claimed, mapped, &self.mappings, self.peer, tenant)?;
        self.next_id = self.next_id.wrapping_add(1).max(1);
        while self.by_id.contains_key(&self.next_id) {
            self.next_id = self.next_id.wrapping_add(1).max(1);
        }
        self.bytes += r.charged();
        self.by_id.insert(self.next_id, r);
        Ok(self.next_id)
    }

    fn remove(&mut self, id: u32) -> bool {
        match self.by_id.remove(&id) {
            Some(r) => {
                self.bytes -= r.charged();
                true
            }
            None => false,
        }
    }
}

/// Why a buffer was not registered.
enum Refusal {
    /// Over a cap: the client may retry after unregistering something.
    Cap(String),
    /// Not a buffer the server can use.
    Bad(String),
}

struct Conn {
    sock: UnixStream,
    state: Arc<NodeState>,
    rbuf: Vec<u8>,
    rpos: usize,
    rend: usize,
    /// Descriptors received with the bytes, in order, waiting for their `REGISTER`.
    fds: VecDeque<OwnedFd>,
    buffers: Buffers,
    /// Polling the socket for the next request after a small call (`dataplane_poll`).
    poller: crate::dataplane::spin::Poller,
    /// Payload bytes the last request copied.
    moved: u64,
    out: Vec<u8>,
    /// Who the hello's token authenticated (`None` until then).
    principal: Option<Principal>,
    /// The tenant's connection slot this connection holds (`max_connections_per_tenant`).
    _tenant_slot: Option<crate::tenants::TenantConnection>,
    /// The protocol version the client's hello said.
    version: u16,
}

impl Conn {
    fn new(sock: UnixStream, state: Arc<NodeState>, mappings: Arc<Mappings>) -> Self {
        // A client in a PID namespace the server can't see is reported as pid 0: unknown, so
        // no two such clients are taken for one process.
        let peer = sock.peer_cred().ok().and_then(|c| c.pid()).and_then(|p| u32::try_from(p).ok()).filter(|&p| p > 0);
        Conn {
            sock,
            state,
            rbuf: vec![0u8; READ_BUF],
            rpos: 0,
            rend: 0,
            fds: VecDeque::new(),
            buffers: Buffers::new(mappings, peer),
            poller: crate::dataplane::spin::Poller::new(&crate::dataplane::spin::NODE),
            moved: 0,
            out: Vec::new(),
            principal: None,
            _tenant_slot: None,
            version: PROTOCOL_VERSION,
        }
    }

    /// One `recvmsg` into the read buffer, keeping any descriptors that came with the bytes.
    /// Returns the number of bytes read (0 at end of stream).
    async fn fill(&mut self) -> Result<usize, ConnError> {
        if self.rpos == self.rend {
            self.rpos = 0;
            self.rend = 0;
        }
        loop {
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_PENDING_FDS))];
            let mut anc = RecvAncillaryBuffer::new(&mut space);
            let (sock, buf, end) = (&self.sock, &mut self.rbuf, self.rend);
            let mut recv = |anc: &mut RecvAncillaryBuffer<'_>| {
                let mut iov = [IoSliceMut::new(&mut buf[end..])];
                rustix::net::recvmsg(sock.as_fd(), &mut iov, anc, RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT)
                    .map_err(std::io::Error::from)
            };
            let got = if self.poller.armed() {
                // Polling for the next request (`crate::dataplane::spin`): straight from the
                // socket, whatever the runtime last saw of it.
                match recv(&mut anc) {
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        if self.poller.again() {
                            yield_once().await;
                        }
                        continue;
                    }
                    got => got,
                }
            } else {
                sock.readable().await?;
                sock.try_io(Interest::READABLE, || recv(&mut anc))
            };
            let msg = match got {
                Ok(m) => m,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e.into()),
            };
            for m in anc.drain() {
                if let RecvAncillaryMessage::ScmRights(fds) = m {
                    self.fds.extend(fds);
                }
            }
            if self.fds.len() > MAX_PENDING_FDS {
                error("samenode_fds");
                return Err(ConnError::Protocol("too many file descriptors sent without a REGISTER".into()));
            }
            self.rend += msg.bytes;
            return Ok(msg.bytes);
        }
    }

    /// Reads exactly `n` bytes into `out` (replacing its contents); `false` at a clean end of
    /// stream before the first byte.
    async fn read_exact(&mut self, n: usize, out: &mut Vec<u8>) -> Result<bool, ConnError> {
        out.clear();
        out.reserve(n);
        while out.len() < n {
            if self.rpos == self.rend {
                if self.fill().await? == 0 {
                    if out.is_empty() {
                        return Ok(false);
                    }
                    return Err(ConnError::Io(std::io::ErrorKind::UnexpectedEof.into()));
                }
                continue;
            }
            let k = (n - out.len()).min(self.rend - self.rpos);
            out.extend_from_slice(&self.rbuf[self.rpos..self.rpos + k]);
            self.rpos += k;
        }
        Ok(true)
    }

    async fn run(mut self) -> Result<(), ConnError> {
        match self.handshake().await? {
            Some(p) => self.principal = Some(p),
            None => return Ok(()),
        }
        let mut head = Vec::with_capacity(REQUEST_LEN);
        let mut body = Vec::new();
        let (idle, stall) = (self.state.config().idle_timeout.0, self.state.config().stall_timeout.0);
        let timed_out = |what: &'static str| {
            error(what);
            ConnError::Io(std::io::Error::new(std::io::ErrorKind::TimedOut, what))
        };
        let poll = self.state.config().dataplane_poll.0;
        loop {
            // A caller moving small blocks sends its next call soon after the answer: polled for,
            // as the data plane does (`crate::dataplane::spin`); after a large one it parks.
            self.poller.arm(if self.moved <= POLL_AFTER_BYTES { poll } else { Duration::ZERO });
            self.moved = 0;
            // The same budgets as the data plane: `idle_timeout` between requests, `stall_timeout`
            // for the rest of a request and its answer.
            let more = tokio::time::timeout(idle, self.read_exact(REQUEST_LEN, &mut head))
                .await
                .map_err(|_| timed_out("samenode_idle_timeout"))??;
            // Still armed: the request came by polling (a parked read disarms).
            let polled = self.poller.armed();
            self.poller.disarm();
            if !more {
                return Ok(());
            }
            if polled {
                crate::dataplane::spin::count_polled("samenode");
            }
            let _busy = crate::dataplane::spin::Busy::enter(self.poller.gate(), self.poller.id());
            let req = match <&[u8; REQUEST_LEN]>::try_from(head.as_slice()).map(SnRequest::decode) {
                Ok(Ok(r)) => r,
                Ok(Err(e)) => return self.fatal(head[0], Status::BadRequest, &e.to_string()).await,
                Err(_) => return self.fatal(head[0], Status::BadRequest, "short request header").await,
            };
            if req.op.is_segmented() && self.version < SEGMENTS_SINCE_VERSION {
                let msg = format!(
                    "{:?} needs same-node protocol {SEGMENTS_SINCE_VERSION}; this connection's hello said {}",
                    req.op, self.version
                );
                return self.fatal(req.op as u8, Status::BadRequest, &msg).await;
            }
            if req.flags & sn::FLAG_CHECKSUMS_AFTER != 0
                && (req.op.unsegmented() != SnOp::Store || self.version < sn::CHECKSUMS_AFTER_SINCE_VERSION)
            {
                let msg = format!(
                    "checksums after the request are for STORE on same-node protocol {}; this is {:?} on {}",
                    sn::CHECKSUMS_AFTER_SINCE_VERSION,
                    req.op,
                    self.version
                );
                return self.fatal(req.op as u8, Status::BadRequest, &msg).await;
            }
            let limit = self.state.config().max_blocks_per_request;
            if req.count > limit {
                let msg = format!("{} items in one request exceed max_blocks_per_request {limit}", req.count);
                return self.fatal(req.op as u8, Status::TooLarge, &msg).await;
            }
            let whole = tokio::time::timeout(stall, self.read_exact(req.op.body_len(req.count), &mut body))
                .await
                .map_err(|_| timed_out("samenode_stall_timeout"))??;
            if !whole && req.op.body_len(req.count) > 0 {
                return Err(ConnError::Io(std::io::ErrorKind::UnexpectedEof.into()));
            }
            // A segmented request's table follows its items; one whose items name too many
            // segments can't be read past, so it ends the connection.
            let (counts, table) = if req.op.is_segmented() {
                let (counts, table_len) = match sn::segment_counts(req.op, &body) {
                    Ok(x) => x,
                    Err(e) => return self.fatal(req.op as u8, Status::BadRequest, &e.to_string()).await,
                };
                let mut raw = Vec::new();
                let whole = tokio::time::timeout(stall, self.read_exact(table_len, &mut raw))
                    .await
                    .map_err(|_| timed_out("samenode_stall_timeout"))??;
                if !whole {
                    return Err(ConnError::Io(std::io::ErrorKind::UnexpectedEof.into()));
                }
                match Segment::decode_table(&raw) {
                    Ok(t) => (counts, t),
                    Err(e) => return self.fatal(req.op as u8, Status::BadRequest, &e.to_string()).await,
                }
            } else {
                (Vec::new(), Vec::new())
            };
            let segs = Segments { counts: &counts, table: &table };
            self.out.clear();
            match req.op {
                SnOp::Register => self.register(&req, &body),
                SnOp::Unregister => {
                    if self.buffers.remove(req.buffer) {
                        self.answer(sn::ok(SnOp::Unregister, req.request_id, 0));
                    } else {
                        self.refuse(&req, Status::BadRequest, &format!("no buffer {} is registered", req.buffer));
                    }
                }
                SnOp::Load | SnOp::LoadSegments => self.load(&req, &body, segs).await?,
                SnOp::Store | SnOp::StoreSegments => self.store(&req, &body, segs).await?,
            }
            tokio::time::timeout(stall, self.sock.write_all(&self.out))
                .await
                .map_err(|_| timed_out("samenode_stall_timeout"))??;
        }
    }

    /// Reads the hello; the principal its token stands for, `None` when the peer left first.
    async fn handshake(&mut self) -> Result<Option<Principal>, ConnError> {
        let deadline = tokio::time::Instant::now() + HELLO_TIMEOUT;
        let late = || {
            error("samenode_hello_timeout");
            ConnError::Protocol("no complete hello within 10 s".into())
        };
        let mut h = Vec::new();
        if !tokio::time::timeout_at(deadline, self.read_exact(HELLO_LEN, &mut h)).await.map_err(|_| late())?? {
            return Ok(None);
        }
        let fixed: &[u8; HELLO_LEN] = h.as_slice().try_into().map_err(|_| ConnError::Protocol("short hello".into()))?;
        let (version, token_len) = match decode_hello(fixed) {
            Ok(x) => x,
            Err(e) => return self.hello_fail(Status::BadRequest, &e.to_string()).await,
        };
        let mut token = Vec::new();
        tokio::time::timeout_at(deadline, self.read_exact(token_len as usize, &mut token))
            .await
            .map_err(|_| late())??;
        if !(MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&version) {
            let msg = format!(
                "same-node protocol {version} is not supported; this server speaks {MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION}"
            );
            return self.hello_fail(Status::UnsupportedVersion, &msg).await;
        }
        self.version = version;
        let presented = (!token.is_empty()).then_some(&token[..]);
        // A ticket from the control plane (`crate::tickets`: how certificate-only clients get
        // here) or a token.
        let tenants = self.state.tenants();
        let principal = match presented {
            Some(t) if t.starts_with(crate::tickets::TICKET_PREFIX.as_bytes()) && tenants.required() => {
                tenants.tickets().redeem(t)
            }
            _ => tenants.authenticate(presented),
        };
        let Some(principal) = principal else {
            error("unauthenticated");
            return self
                .hello_fail(Status::Unauthenticated, "bad, expired, used or missing auth token or ticket")
                .await;
        };
        let max = self.state.config().max_connections_per_tenant;
        self._tenant_slot = match crate::tenants::connection_slot(&principal, max, "same-node") {
            Ok(slot) => slot,
            Err(why) => {
                return self.hello_fail(Status::TooManyConnections, &format!("connection refused: {why}")).await
            }
        };
        self.sock.write_all(&HelloReply::encode(Status::Ok, concat!("kvtier ", env!("CARGO_PKG_VERSION")))).await?;
        Ok(Some(principal))
    }

    async fn hello_fail<T>(&mut self, status: Status, msg: &str) -> Result<T, ConnError> {
        error("samenode_bad_hello");
        self.sock.write_all(&HelloReply::encode(status, msg)).await?;
        Err(ConnError::Protocol(msg.to_string()))
    }

    /// Answers with a request-level error and ends the connection (its framing can't be trusted).
    async fn fatal(&mut self, op: u8, status: Status, msg: &str) -> Result<(), ConnError> {
        error("samenode_protocol");
        self.sock.write_all(&ResponseHeader::error(op, 0, status, msg)).await?;
        Err(ConnError::Protocol(msg.to_string()))
    }

    /// Whether `offset + len` lies inside registered buffer `id`.
    fn fits(&self, id: u32, offset: u64, len: u64) -> bool {
        self.buffers.by_id.get(&id).is_some_and(|b| b.place(offset, len).is_some())
    }

    /// Why buffer `id` (a file the client truncated) can't be used now; the error is counted.
    fn truncated(&self, id: u32) -> Option<String> {
        let why = self.buffers.by_id.get(&id)?.truncated()?;
        error("samenode_truncated");
        tracing::warn!(buffer = id, "same-node request refused: {why}");
        Some(why)
    }

    /// Whether the client has closed its end of the socket (its call gave up, or it died):
    /// bytes already waiting (a next request) are not a close, and neither is a busy socket.
    fn client_left(&self) -> bool {
        let mut probe = [MaybeUninit::<u8>::uninit(); 1];
        match rustix::net::recv(&self.sock, &mut probe[..], RecvFlags::PEEK | RecvFlags::DONTWAIT) {
            Ok((_, 0)) => true,
            Ok(_) => false,
            Err(e) => e != rustix::io::Errno::WOULDBLOCK && e != rustix::io::Errno::INTR,
        }
    }

    fn answer(&mut self, h: ResponseHeader) {
        self.out.extend_from_slice(&h.encode());
    }

    /// A request-level error; the connection goes on (the request's body was read whole).
    fn refuse(&mut self, req: &SnRequest, status: Status, msg: &str) {
        error("samenode_refused");
        tracing::debug!(op = ?req.op, "same-node request refused: {msg}");
        self.out.extend_from_slice(&ResponseHeader::error(req.op as u8, req.request_id, status, msg));
    }

    fn register(&mut self, req: &SnRequest, body: &[u8]) {
        let mut b = [0u8; 8];
        b.copy_from_slice(&body[..8]);
        let claimed = u64::from_le_bytes(b);
        // The descriptor came with the request's first byte, which has been read.
        let Some(fd) = self.fds.pop_front() else {
            return self.refuse(req, Status::BadRequest, "REGISTER carried no file descriptor (SCM_RIGHTS)");
        };
        let tenant = self.principal.as_ref().and_then(Principal::tenant).map(|t| t.name.clone());
        match self.buffers.add(fd, claimed, tenant.as_deref()) {
            Ok(id) => self.answer(sn::ok(SnOp::Register, req.request_id, id)),
            Err(Refusal::Cap(msg)) => self.refuse(req, Status::TooLarge, &format!("buffer refused: {msg}")),
            Err(Refusal::Bad(msg)) => self.refuse(req, Status::BadRequest, &format!("buffer refused: {msg}")),
        }
    }

    /// A `LOAD` or `LOAD_SEGMENTS`; `Err` only when the client left mid-request.
    async fn load(&mut self, req: &SnRequest, body: &[u8], segs: Segments<'_>) -> Result<(), ConnError> {
        let start = Instant::now();
        let ns: NamespaceId = req.namespace;
        let Some(principal) = self.principal.clone() else {
            self.refuse(req, Status::Unauthenticated, "no hello");
            return Ok(());
        };
        match self.state.check_namespace(&principal, &ns, Access::Read) {
            Ok(()) => {}
            Err(ItemStatus::Forbidden) => {
                let msg = format!("tenant {:?} may not read this namespace", principal.name());
                self.refuse(req, Status::Forbidden, &msg);
                return Ok(());
            }
            Err(_) => {
                error("unknown_namespace");
                self.refuse(req, Status::UnknownNamespace, &ServerError::UnknownNamespace(ns).to_string());
                return Ok(());
            }
        }
        if !self.buffers.by_id.contains_key(&req.buffer) {
            self.refuse(req, Status::BadRequest, &format!("no buffer {} is registered", req.buffer));
            return Ok(());
        }
        if let Some(msg) = self.truncated(req.buffer) {
            self.refuse(req, Status::BadRequest, &msg);
            return Ok(());
        }
        let stop_at_miss = req.flags & FLAG_STOP_AT_MISS != 0;
        let n = req.count as usize;
        // In a cluster: what no local tier holds, from its owners (within `peer_timeout`, in
        // chunks ahead of the copies), as the data plane's GET does.
        let spec = self.state.namespace(&ns).ok().filter(|_| self.state.tiers().has_remote());
        let keys: Vec<BlockKey> = match spec {
            Some(_) => body
                .chunks_exact(sn::LOAD_ITEM_LEN)
                .filter_map(|raw| LoadItem::decode(raw).ok())
                .map(|i| i.key)
                .collect(),
            None => Vec::new(),
        };
        let mut remote = PeerFetch::start(&self.state, spec, &keys);
        let mut statuses = Vec::with_capacity(n);
        let mut headers = Vec::new();
        let mut missed = false;
        let mut cursor = segs.cursor(req.op);
        let mut copied = 0u64;
        // A request read after its client gave up on it (this node was stopped, or swapping, past
        // the call's deadline) writes nothing into the client's memory, which it may have reused
        // since: looked at before the first copy, then once per LEFT_CHECK_BYTES.
        if self.client_left() {
            return Err(ConnError::ClientLeft);
        }
        for raw in body.chunks_exact(sn::LOAD_ITEM_LEN) {
            let item = LoadItem::decode(raw);
            // Where this item's block goes: its own (offset, room), or its run of the table.
            let one;
            let segments = match &item {
                Ok(i) if !req.op.is_segmented() => {
                    one = [Segment { offset: i.offset, len: i.room }];
                    &one[..]
                }
                _ => cursor.next(),
            };
            if missed && stop_at_miss {
                statuses.push(ItemStatus::Miss as u8);
                continue;
            }
            let status = match item {
                Ok(_) if !segments.iter().all(|s| self.fits(req.buffer, s.offset, s.len)) => ItemStatus::OutOfRange,
                Ok(item) => {
                    // A DRAM hit comes unchecked: `copy_out` checks it as it copies.
                    // A block planned from the peers is taken from the fetch first (counted there).
                    let fetched = match remote.planned(&item.key) {
                        true => remote.take_planned(&item.key).await,
                        false => None,
                    };
                    let (local, unchecked) = match fetched {
                        Some(b) => (crate::tiers::Load::Hit(b), false),
                        None => self.state.tiers().get_to_check(&ns, &item.key).await,
                    };
                    let found = match local.hit() {
                        Some(b) => Some(b),
                        None => remote.take(&item.key).await,
                    };
                    let next = found.as_ref().map_or(0, |b| b.payload.len() as u64);
                    self.moved += next;
                    if self.paced(&mut copied, next).await {
                        return Err(ConnError::ClientLeft);
                    }
                    match found {
                        Some(b) => match self
                            .buffers
                            .by_id
                            .get(&req.buffer)
                            .and_then(|r| r.pieces(segments, b.payload.len() as u64))
                        {
                            Some(dst) => match put(&b.payload, &dst, unchecked.then_some(b.header.checksum)) {
                                Copied::Ok => {
                                    headers.extend_from_slice(&b.header.encode());
                                    ItemStatus::Ok
                                }
                                Copied::ChecksumMismatch => {
                                    self.state.tiers().drop_corrupt(&ns, &item.key);
                                    ItemStatus::ChecksumMismatch
                                }
                                Copied::Short => ItemStatus::OutOfRange,
                            },
                            None => ItemStatus::OutOfRange,
                        },
                        None => ItemStatus::Miss,
                    }
                }
                Err(_) => ItemStatus::BadHeader,
            };
            if status != ItemStatus::Ok {
                missed = true;
                if status != ItemStatus::Miss {
                    error(kind(status));
                }
            }
            statuses.push(status as u8);
            // A long request shares its worker with other connections.
            tokio::task::coop::consume_budget().await;
        }
        self.answer(sn::ok(req.op, req.request_id, req.count));
        self.out.extend_from_slice(&statuses);
        self.out.extend_from_slice(&headers);
        observe("samenode_load", start);
        Ok(())
    }

    /// Once per [`LEFT_CHECK_BYTES`] of copies, between blocks: whether the client left, and if
    /// not, a yield of this worker to its other tasks (a request of large blocks may not use up
    /// tokio's per-task budget for hundreds of MiB). `pending` counts the bytes copied since the
    /// last look, `next` the copy about to start (if any).
    async fn paced(&self, pending: &mut u64, next: u64) -> bool {
        *pending = pending.saturating_add(next);
        if *pending < LEFT_CHECK_BYTES {
            return false;
        }
        *pending = 0;
        if self.client_left() {
            return true;
        }
        tokio::task::yield_now().await;
        false
    }

    /// A `STORE` or `STORE_SEGMENTS`; `Err` only when the client left mid-request.
    async fn store(&mut self, req: &SnRequest, body: &[u8], segs: Segments<'_>) -> Result<(), ConnError> {
        let start = Instant::now();
        let after = req.flags & sn::FLAG_CHECKSUMS_AFTER != 0;
        let refusal = if !self.buffers.by_id.contains_key(&req.buffer) {
            Some(format!("no buffer {} is registered", req.buffer))
        } else {
            self.truncated(req.buffer)
        };
        if let Some(msg) = refusal {
            // The checksums still follow the request: read past them.
            if after {
                self.checksums_after(req.count).await?;
            }
            self.refuse(req, Status::BadRequest, &msg);
            return Ok(());
        }
        let mut statuses = Vec::with_capacity(req.count as usize);
        let mut stored = Vec::new();
        // With checksums after: the items copied, waiting for their checksums (index, slot,
        // header, the hash of our copy).
        let mut copies: Vec<(usize, SlotWriter, FrameHeader, u64)> = Vec::new();
        let mut cursor = segs.cursor(req.op);
        let mut copied = 0u64;
        for (i, raw) in body.chunks_exact(sn::STORE_ITEM_LEN).enumerate() {
            let table = req.op.is_segmented().then(|| cursor.next());
            // Blocks already stored stay (each was checked); the rest are never read.
            if self.paced(&mut copied, 0).await {
                crate::dataplane::forward_to_peers(&self.state, stored);
                return Err(ConnError::ClientLeft);
            }
            let (status, header) = match self.store_one(req.buffer, raw, table, after).await {
                Stored::Done(status, header) => (status, header),
                Stored::Copied(slot, header, sum) => {
                    copied += header.payload_len;
                    self.moved += header.payload_len;
                    copies.push((i, slot, header, sum));
                    statuses.push(ItemStatus::Ok as u8);
                    tokio::task::coop::consume_budget().await;
                    continue;
                }
            };
            copied += header.map_or(0, |h| h.payload_len);
            self.moved += header.map_or(0, |h| h.payload_len);
            if !status.is_held() {
                error(kind(status));
            }
            if let (ItemStatus::Ok, Some(h)) = (status, header) {
                stored.push((h.namespace, h.key));
            }
            statuses.push(status as u8);
            tokio::task::coop::consume_budget().await;
        }
        if after {
            let sums = self.checksums_after(req.count).await?;
            for (i, slot, mut header, sum) in copies {
                let status = if sums.get(i) != Some(&sum) {
                    // `slot` drops here unpublished.
                    ItemStatus::ChecksumMismatch
                } else {
                    header.checksum = sum;
                    self.commit(slot, header)
                };
                if status == ItemStatus::Ok {
                    stored.push((header.namespace, header.key));
                } else {
                    error(kind(status));
                }
                statuses[i] = status as u8;
            }
        }
        // In a cluster, the blocks' other owners get them too (after the answer, like a PUT's).
        crate::dataplane::forward_to_peers(&self.state, stored);
        self.answer(sn::ok(req.op, req.request_id, req.count));
        self.out.extend_from_slice(&statuses);
        observe("samenode_store", start);
        Ok(())
    }

    /// Reads the `count` checksums that follow a [`sn::FLAG_CHECKSUMS_AFTER`] request, within
    /// the stall timeout.
    async fn checksums_after(&mut self, count: u32) -> Result<Vec<u64>, ConnError> {
        let stall = self.state.config().stall_timeout.0;
        let mut raw = Vec::new();
        let whole = tokio::time::timeout(stall, self.read_exact(count as usize * sn::CHECKSUM_LEN, &mut raw))
            .await
            .map_err(|_| timed_out("samenode_stall_timeout"))??;
        if !whole && count > 0 {
            return Err(ConnError::Io(std::io::ErrorKind::UnexpectedEof.into()));
        }
        sn::decode_checksums(&raw).map_err(|e| ConnError::Protocol(e.to_string()))
    }

    /// Stores one item (in one piece at its offset, or in `table`'s segments): its status and
    /// admitted frame header, or with `after` (its checksum comes later) its verified-to-be copy.
    async fn store_one(&self, buffer: u32, raw: &[u8], table: Option<&[Segment]>, after: bool) -> Stored {
        let Ok((h, offset)) = StoreItem::split(raw) else { return Stored::Done(ItemStatus::BadHeader, None) };
        let Ok(sent) = FrameHeader::decode(h) else { return Stored::Done(ItemStatus::BadHeader, None) };
        let Some(principal) = &self.principal else { return Stored::Done(ItemStatus::Forbidden, None) };
        let header = match self.state.admit_frame(principal, &sent) {
            Ok(h) => h,
            Err(status) => return Stored::Done(status, None),
        };
        let one = [Segment { offset, len: header.payload_len }];
        let (slot, sum) = match self.copy_admitted(buffer, table.unwrap_or(&one), header).await {
            Ok(copy) => copy,
            Err(status) => return Stored::Done(status, Some(header)),
        };
        if after {
            return Stored::Copied(slot, header, sum);
        }
        let status = if sum == header.checksum { self.commit(slot, header) } else { ItemStatus::ChecksumMismatch };
        Stored::Done(status, Some(header))
    }

    /// Copies an admitted item from the client's buffer into a slot of ours: the slot and the
    /// hash of the copy, or why not (`Present`: already held, nothing copied).
    async fn copy_admitted(
        &self,
        buffer: u32,
        segments: &[Segment],
        header: FrameHeader,
    ) -> Result<(SlotWriter, u64), ItemStatus> {
        if header.payload_len > self.state.config().max_frame_bytes.0 {
            return Err(ItemStatus::SizeMismatch);
        }
        // A stored block is exactly its segments.
        if segments.iter().try_fold(0u64, |t, s| t.checked_add(s.len)) != Some(header.payload_len) {
            return Err(ItemStatus::SizeMismatch);
        }
        if !segments.iter().all(|s| self.fits(buffer, s.offset, s.len)) {
            return Err(ItemStatus::OutOfRange);
        }
        if self.state.tiers().is_hot(&header.namespace, &header.key) {
            // Content-addressed: the same key is the same bytes. Skip the copy.
            return Err(ItemStatus::Present);
        }
        self.state.tiers().backpressure().await;
        let mut slot = match self.state.tiers().reserve(&header.namespace, header.payload_len as usize) {
            Ok(s) => s,
            Err(ServerError::Capacity(_) | ServerError::TooLarge { .. }) => return Err(ItemStatus::Capacity),
            Err(_) => return Err(ItemStatus::Internal),
        };
        // Looked up again after the await: the buffer map can't change meanwhile (this
        // connection serves one request at a time), but the borrow can't cross the await.
        let Some(src) = self.buffers.by_id.get(&buffer).and_then(|b| b.pieces(segments, header.payload_len)) else {
            return Err(ItemStatus::OutOfRange);
        };
        // `slot` drops unpublished on a short copy.
        take(&src, slot.buf_mut()).map(|sum| (slot, sum)).ok_or(ItemStatus::OutOfRange)
    }

    /// Publishes a verified copy.
    fn commit(&self, slot: SlotWriter, header: FrameHeader) -> ItemStatus {
        match self.state.tiers().commit(slot, header, self.state.store_priority(&header)) {
            Ok(_) => ItemStatus::Ok,
            Err(ServerError::Capacity(_) | ServerError::TooLarge { .. }) => ItemStatus::Capacity,
            Err(_) => ItemStatus::Internal,
        }
    }
}

/// A budget ran out (`what` names it, counted as an error).
fn timed_out(what: &'static str) -> ConnError {
    error(what);
    ConnError::Io(std::io::Error::new(std::io::ErrorKind::TimedOut, what))
}

/// What storing one item came to: its status (and admitted header), or a copy waiting for the
/// checksum that follows the request.
enum Stored {
    Done(ItemStatus, Option<FrameHeader>),
    Copied(SlotWriter, FrameHeader, u64),
}

/// The segments of a segmented request, per item (empty for a request in one piece each).
#[derive(Clone, Copy)]
struct Segments<'a> {
    counts: &'a [u32],
    table: &'a [Segment],
}

impl<'a> Segments<'a> {
    fn cursor(self, op: SnOp) -> SegmentCursor<'a> {
        SegmentCursor { segs: self, item: 0, at: 0, on: op.is_segmented() }
    }
}

/// Hands out each item's run of a segment table in turn (an empty run past the end, or for a
/// request in one piece each).
struct SegmentCursor<'a> {
    segs: Segments<'a>,
    item: usize,
    at: usize,
    on: bool,
}

impl<'a> SegmentCursor<'a> {
    fn next(&mut self) -> &'a [Segment] {
        if !self.on {
            return &[];
        }
        let n = self.segs.counts.get(self.item).copied().unwrap_or(0) as usize;
        self.item += 1;
        let run = self.segs.table.get(self.at..self.at + n).unwrap_or(&[]);
        self.at += n;
        run
    }
}

/// Copies a stored payload into a client's buffer, piece by piece in order (see [`copy_out`]);
/// into a file buffer with `pwrite`s after checking its size, so a truncated file is a short
/// copy, never a fault and never a file extended past the size the client left it at. With a
/// `checksum`, whether the source matched it (hashed as it is copied, across the pieces).
fn put(src: &[u8], dst: &[Piece<'_>], checksum: Option<u64>) -> Copied {
    let mut h = checksum.map(|_| kvtier_proto::Checksummer::new());
    let mut at = 0;
    for piece in dst {
        let Some(part) = src.get(at..at + piece.len) else { return Copied::Short };
        let whole = match piece.place {
            Place::Mapped(p) => {
                copy_out(part, p, h.as_mut());
                true
            }
            Place::File(f, o) => put_file(part, f, o, h.as_mut()),
        };
        if !whole {
            return Copied::Short;
        }
        at += piece.len;
    }
    match (h, checksum) {
        (Some(h), Some(c)) if h.digest() != c => Copied::ChecksumMismatch,
        _ => Copied::Ok,
    }
}

/// `pwrite`s `src` into a file buffer at `offset`, hashing it into `h` as it goes; false for a
/// short copy.
fn put_file(src: &[u8], file: &std::fs::File, offset: u64, mut h: Option<&mut kvtier_proto::Checksummer>) -> bool {
    let mut at = offset;
    for chunk in src.chunks(FILE_CHUNK) {
        // The size checked before each `pwrite`: one landing past the end would grow the file.
        // A truncation racing the check and the write can still regrow it, sparse and never past
        // the registered length; the next request then finds it truncated or intact, never a
        // fault. A short `pwrite` ends the copy.
        if !file_holds(file, at, chunk.len()) {
            return false;
        }
        match std::os::unix::fs::FileExt::write_at(file, chunk, at) {
            Ok(n) if n == chunk.len() => {}
            _ => return false,
        }
        if let Some(h) = h.as_deref_mut() {
            h.update(chunk);
        }
        at += chunk.len() as u64;
    }
    true
}

/// Copies a payload from a client's buffer, piece by piece in order, into `dst` (a reserved
/// slot) and hashes our copy (see [`copy_in`]); from a file buffer with `pread`s. The hash of
/// the copy, or `None` for a short copy (a file truncated meanwhile, or pieces that don't fill
/// `dst`).
fn take(src: &[Piece<'_>], dst: &mut [u8]) -> Option<u64> {
    let mut h = kvtier_proto::Checksummer::new();
    let mut at = 0;
    for piece in src {
        let part = dst.get_mut(at..at + piece.len)?;
        match piece.place {
            Place::Mapped(p) => copy_in(p, part, &mut h),
            Place::File(f, o) => {
                let mut off = o;
                for chunk in part.chunks_mut(FILE_CHUNK) {
                    std::os::unix::fs::FileExt::read_exact_at(f, chunk, off).ok()?;
                    h.update(chunk);
                    off += chunk.len() as u64;
                }
            }
        }
        at += piece.len;
    }
    (at == dst.len()).then(|| h.digest())
}

/// Whether `file` is at least `offset + len` bytes long now: a `pwrite` inside that never
/// extends it.
fn file_holds(file: &std::fs::File, offset: u64, len: usize) -> bool {
    let end = offset.saturating_add(len as u64);
    file.metadata().is_ok_and(|m| m.len() >= end)
}

/// Copies a stored payload to `dst` (a client's buffer) with streaming stores (the client reads
/// it next, not us: see [`kvtier_kernels::copy`]). With a hasher, chunk by chunk, hashing each
/// chunk of the *source* right after copying it (still in cache). The copy is published before
/// this returns: the request may go on (and answer) from another worker thread.
fn copy_out(src: &[u8], dst: *mut u8, h: Option<&mut kvtier_proto::Checksummer>) {
    let Some(h) = h else {
        // SAFETY: as below, for the whole payload at once.
        unsafe { kvtier_kernels::copy::copy_streaming(src, dst) };
        kvtier_kernels::copy::publish();
        return;
    };
    let mut at = 0;
    for chunk in src.chunks(CHUNK) {
        // SAFETY: the caller bounds-checked `dst .. dst + src.len()` against a live mapping of the
        // client's buffer, which is not our memory, so the ranges can't overlap. The client may
        // write those bytes concurrently; they are written through a raw pointer and never read.
        unsafe { kvtier_kernels::copy::copy_streaming(chunk, dst.add(at)) };
        h.update(chunk);
        at += chunk.len();
    }
    kvtier_kernels::copy::publish();
}

/// Copies a payload from `src` (a client's buffer) into `dst` (part of a reserved slot) chunk by
/// chunk, hashing each chunk of *our copy* into `h` right after it landed.
fn copy_in(src: *const u8, dst: &mut [u8], h: &mut kvtier_proto::Checksummer) {
    let mut at = 0;
    for chunk in dst.chunks_mut(CHUNK) {
        // SAFETY: the caller bounds-checked `src .. src + dst.len()` against a live mapping of the
        // client's buffer, which can't overlap our slot. The client may change those bytes while
        // we copy: only our copy is hashed and kept, so a torn copy fails the checksum.
        unsafe { std::ptr::copy_nonoverlapping(src.add(at), chunk.as_mut_ptr(), chunk.len()) };
        h.update(chunk);
        at += chunk.len();
    }
}

fn kind(s: ItemStatus) -> &'static str {
    match s {
        ItemStatus::OutOfRange => "samenode_out_of_range",
        ItemStatus::Forbidden => "forbidden",
        ItemStatus::ChecksumMismatch => "checksum_mismatch",
        ItemStatus::Capacity => "capacity",
        ItemStatus::UnknownNamespace => "unknown_namespace",
        ItemStatus::LayoutMismatch => "layout_mismatch",
        ItemStatus::LossyCodec => "lossy_codec",
        ItemStatus::SizeMismatch => "size_mismatch",
        ItemStatus::BadHeader => "bad_header",
        ItemStatus::Internal => "internal",
        ItemStatus::NoLease => "no_lease",
        ItemStatus::Elsewhere => "elsewhere",
        ItemStatus::Ok | ItemStatus::Present | ItemStatus::Miss => "ok",
    }
}

/// Lets the other tasks of this worker run once, then goes on (a poll's turn between reads).
async fn yield_once() {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if yielded {
            return std::task::Poll::Ready(());
        }
        yielded = true;
        cx.waker().wake_by_ref();
        std::task::Poll::Pending
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sealed memfd of `len` bytes, every page written (so it is mapped populated).
    fn sealed_memfd(len: u64) -> (OwnedFd, rustix::fs::Stat) {
        use rustix::fs::{MemfdFlags, SealFlags};
        let fd = rustix::fs::memfd_create("kvtier-test", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
        let mut f = std::fs::File::from(fd.try_clone().unwrap());
        std::io::Write::write_all(&mut f, &vec![7u8; len as usize]).unwrap();
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK).unwrap();
        let st = rustix::fs::fstat(&fd).unwrap();
        (fd, st)
    }

    /// Each tenant's registrations are held to its share of the node's budget, so one tenant
    /// can't take it all from the others (before, one sparse memfd of the host's RAM refused every
    /// other tenant); the operator is held by the node's cap only; an unmapped buffer's bytes go
    /// back to its tenant's share.
    #[test]
    fn a_tenant_registers_up_to_its_share_and_leaves_the_rest_to_others() {
        let mappings = Mappings::with_identity(4 << 20, 2 << 20, registrations_share_mappings());
        let map = |len, tenant| {
            let (fd, st) = sealed_memfd(len);
            mappings.map(fd, &st, len, Some(1), tenant)
        };
        let a1 = map(2 << 20, Some("a")).unwrap_or_else(|_| panic!("a's share"));
        assert!(matches!(
            map(4096, Some("a")),
            Err(Refusal::Cap(m)) if m.contains("tenant \"a\"") && m.contains("samenode_max_registered_bytes_per_tenant")
        ));
        let b = map(2 << 20, Some("b")).unwrap_or_else(|_| panic!("b still has its share"));
        assert_eq!(mappings.mapped_bytes(), 4 << 20);
        // The node's cap still holds over the shares.
        assert!(matches!(map(4096, None), Err(Refusal::Cap(m)) if m.contains("samenode_max_registered_bytes")));
        drop((a1, b));
        assert_eq!(mappings.mapped_bytes(), 0);
        let a2 = map(2 << 20, Some("a")).unwrap_or_else(|_| panic!("a's share came back"));
        drop(a2);
        // The operator may map past a tenant's share.
        let _op = map(2 << 20 | 4096, None).unwrap_or_else(|_| panic!("the operator"));
    }

    /// One mapping per file for the node: registrations of the same memfd (a client's pooled
    /// connections) share it and charge the budget once; a longer claim maps anew; the last
    /// holder's drop unmaps it and gives its bytes back; a new file over the cap is refused.
    #[test]
    fn a_memfd_registered_on_several_connections_is_mapped_and_charged_once() {
        // One client process (pid 1 here) passing its one descriptor (a dup of it) again: shared
        // by open file where `kcmp` works, by client process where it doesn't.
        for by_open_file in [registrations_share_mappings(), false] {
            let mappings = Mappings::with_identity(3 << 20, 3 << 20, by_open_file);
            let (fd, st) = sealed_memfd(2 << 20);
            let map = |claimed| mappings.map(fd.try_clone().unwrap(), &st, claimed, Some(1), None);
            let a = map(1 << 20).unwrap_or_else(|_| panic!("first mapping"));
            let b = map(1 << 20).unwrap_or_else(|_| panic!("second registration"));
            let shorter = map(4096).unwrap_or_else(|_| panic!("a shorter claim"));
            assert!(Arc::ptr_eq(&a, &b) && Arc::ptr_eq(&a, &shorter), "the file was mapped again");
            assert_eq!(mappings.mapped_bytes(), 1 << 20);
            // Both see the file's bytes through the one mapping.
            // SAFETY: the mapping is 1 MiB long and the memfd holds 2 MiB of 7s.
            assert_eq!(unsafe { *a.map.as_ptr().add((1 << 20) - 1) }, 7);
            // A claim longer than the mapping maps the file again; the shorter one stays valid.
            let longer = map(2 << 20).unwrap_or_else(|_| panic!("a longer claim"));
            assert!(!Arc::ptr_eq(&a, &longer));
            assert_eq!(mappings.mapped_bytes(), 3 << 20);
            // A second file past the cap (3 MiB mapped already) is refused, nothing mapped for it.
            let (other, ost) = sealed_memfd(4096);
            assert!(matches!(
                mappings.map(other.try_clone().unwrap(), &ost, 4096, Some(1), None),
                Err(Refusal::Cap(m)) if m.contains("samenode_max_registered_bytes")
            ));
            assert_eq!(mappings.mapped_bytes(), 3 << 20);
            // Registrations find the longest live mapping from now on.
            let again = map(1 << 20).unwrap_or_else(|_| panic!("again"));
            assert!(Arc::ptr_eq(&again, &longer));
            drop((a, b, shorter));
            assert_eq!(mappings.mapped_bytes(), 2 << 20, "the 1 MiB mapping's bytes came back");
            drop((longer, again));
            assert_eq!(mappings.mapped_bytes(), 0);
            assert!(mappings.files().is_empty(), "an unmapped file's entry was left behind");
            // The freed budget takes the other file now.
            assert!(mappings.map(other, &ost, 4096, Some(1), None).is_ok());
        }
    }

    /// Shared by open file (`kcmp`): a mapping goes only to the very open file it was made
    /// through — to another process too — and only while that file still lets the server write:
    /// a read-only descriptor of the same memfd, a second open of it, and the memfd once sealed
    /// against writes each map on their own, and the kernel refuses the read-only and the sealed
    /// one, as it did before mappings were shared.
    #[test]
    fn a_mapping_is_shared_only_with_the_same_open_file_still_writable() {
        use rustix::fs::{Mode, OFlags};
        let kcmp = registrations_share_mappings();
        let mappings = Mappings::with_identity(8 << 20, 8 << 20, true);
        let (fd, st) = sealed_memfd(1 << 20);
        let first =
            mappings.map(fd.try_clone().unwrap(), &st, 1 << 20, Some(1), None).unwrap_or_else(|_| panic!("first"));
        if kcmp {
            let other_process = mappings
                .map(fd.try_clone().unwrap(), &st, 1 << 20, Some(2), None)
                .unwrap_or_else(|_| panic!("passed on"));
            assert!(Arc::ptr_eq(&first, &other_process), "the same open file, passed to another process, shares");
        }
        let path = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&fd));
        // A read-only open of the same file: not the same open file, and mmap refuses it.
        let ro = rustix::fs::open(path.as_str(), OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty()).unwrap();
        assert!(matches!(mappings.map(ro, &st, 1 << 20, Some(1), None), Err(Refusal::Bad(m)) if m.contains("mmap")));
        // A second read-write open: the same file, another open file; mapped on its own.
        let rw = rustix::fs::open(path.as_str(), OFlags::RDWR | OFlags::CLOEXEC, Mode::empty()).unwrap();
        let second =
            mappings.map(rw, &st, 1 << 20, Some(1), None).unwrap_or_else(|_| panic!("a read-write reopen maps"));
        assert!(!Arc::ptr_eq(&first, &second));
        drop((first, second));
        assert_eq!(mappings.mapped_bytes(), 0);
        sealed_after_mapping_is_not_shared(&mappings, kcmp);
    }

    /// Shared by client process (no `kcmp`): a mapping goes to later registrations of the same
    /// file by the process that made it, through descriptors that let the server write — not to
    /// another process, not to an unknown one, not through a read-only or write-sealed descriptor.
    #[test]
    fn without_kcmp_a_mapping_is_shared_within_one_client_process_only() {
        use rustix::fs::{Mode, OFlags};
        let mappings = Mappings::with_identity(8 << 20, 8 << 20, false);
        let (fd, st) = sealed_memfd(1 << 20);
        let first =
            mappings.map(fd.try_clone().unwrap(), &st, 1 << 20, Some(1), None).unwrap_or_else(|_| panic!("first"));
        let path = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&fd));
        let reopen = |flags| rustix::fs::open(path.as_str(), flags | OFlags::CLOEXEC, Mode::empty()).unwrap();
        // The same process, another read-write open of the file: shared.
        let same = mappings.map(reopen(OFlags::RDWR), &st, 1 << 20, Some(1), None).unwrap_or_else(|_| panic!("same"));
        assert!(Arc::ptr_eq(&first, &same));
        // Another process, or one the socket did not name, with the same file: mapped on its own.
        for peer in [Some(2), None] {
            let m = mappings.map(reopen(OFlags::RDWR), &st, 1 << 20, peer, None).unwrap_or_else(|_| panic!("{peer:?}"));
            assert!(!Arc::ptr_eq(&first, &m), "{peer:?} was handed process 1's mapping");
        }
        // The same process through a read-only descriptor: not shared, and mmap refuses it.
        let ro = mappings.map(reopen(OFlags::RDONLY), &st, 1 << 20, Some(1), None);
        assert!(matches!(ro, Err(Refusal::Bad(m)) if m.contains("mmap")));
        drop((first, same));
        assert_eq!(mappings.mapped_bytes(), 0);
        sealed_after_mapping_is_not_shared(&mappings, true);
    }

    /// A memfd sealed against future writes after it was mapped: the same descriptor from the
    /// same process finds the mapping (shared until then, where `shares` is true) but no longer
    /// gets it, and mapping anew is refused; nothing is charged for the refusal.
    fn sealed_after_mapping_is_not_shared(mappings: &Arc<Mappings>, shares: bool) {
        let (fd, st) = sealed_memfd(1 << 20);
        let map = || mappings.map(fd.try_clone().unwrap(), &st, 1 << 20, Some(1), None);
        let first = map().unwrap_or_else(|_| panic!("first"));
        if shares {
            let again = map().unwrap_or_else(|_| panic!("again"));
            assert!(Arc::ptr_eq(&first, &again), "the same file, still writable, shares");
        }
        rustix::fs::fcntl_add_seals(&fd, SealFlags::FUTURE_WRITE).unwrap();
        assert!(matches!(map(), Err(Refusal::Bad(m)) if m.contains("mmap")));
        assert_eq!(mappings.mapped_bytes(), 1 << 20, "refused registrations charge nothing");
    }

    /// The checked copy lands every byte and says whether the *source* matched the checksum: a
    /// block damaged in memory (one bit) is reported, an intact one of any length passes.
    #[test]
    fn a_checked_copy_reports_a_damaged_source() {
        for len in [0usize, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 17] {
            let src: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let sum = kvtier_proto::checksum(&src);
            let mut dst = vec![0u8; len];
            let whole = |dst: &mut Vec<u8>| [Piece { place: Place::Mapped(dst.as_mut_ptr()), len }];
            assert_eq!(put(&src, &whole(&mut dst), Some(sum)), Copied::Ok, "intact, {len} bytes");
            assert_eq!(dst, src);
            assert_eq!(put(&src, &whole(&mut dst), None), Copied::Ok);
            if len > 0 {
                let mut damaged = src.clone();
                damaged[len / 2] ^= 0x01;
                assert_eq!(
                    put(&damaged, &whole(&mut dst), Some(sum)),
                    Copied::ChecksumMismatch,
                    "damaged, {len} bytes"
                );
            }
        }
    }

    /// A block split over segments lands piece by piece in order (the payload may end inside the
    /// last segment), checked across the pieces; taken back from the same pieces it is the same
    /// bytes, and one byte changed in a piece fails our copy's check.
    #[test]
    fn a_block_in_segments_is_copied_and_checked_across_them() {
        let src: Vec<u8> = (0..3 * CHUNK + 5).map(|i| (i * 7 % 253) as u8).collect();
        let sum = kvtier_proto::checksum(&src);
        let mut buf = vec![0u8; 8 * CHUNK];
        let segments = [
            Segment { offset: (5 * CHUNK) as u64, len: CHUNK as u64 + 3 },
            Segment { offset: 0, len: 1 },
            Segment { offset: (2 * CHUNK) as u64, len: 3 * CHUNK as u64 },
        ];
        let base = buf.as_mut_ptr();
        let pieces = |segs: &[Segment], payload: usize| -> Option<Vec<Piece<'static>>> {
            let mut left = payload;
            let mut out = Vec::new();
            for s in segs {
                let len = left.min(s.len as usize);
                // SAFETY: every segment lies inside `buf` (8 chunks).
                out.push(Piece { place: Place::Mapped(unsafe { base.add(s.offset as usize) }), len });
                left -= len;
            }
            (left == 0).then_some(out)
        };
        let dst = pieces(&segments, src.len()).expect("the segments hold the payload");
        assert_eq!(put(&src, &dst, Some(sum)), Copied::Ok);
        assert_eq!(&buf[5 * CHUNK..6 * CHUNK + 3], &src[..CHUNK + 3]);
        assert_eq!(buf[0], src[CHUNK + 3]);
        assert_eq!(&buf[2 * CHUNK..2 * CHUNK + 2 * CHUNK + 1], &src[CHUNK + 4..]);
        let src_pieces = pieces(&segments, src.len()).expect("same pieces");
        let mut slot = vec![0u8; src.len()];
        assert_eq!(take(&src_pieces, &mut slot), Some(sum), "the copy's hash is the source's");
        assert_eq!(slot, src);
        buf[0] ^= 0x80;
        assert_ne!(take(&src_pieces, &mut slot), Some(sum), "a changed source hashes otherwise");
        let mut longer = vec![0u8; src.len() + 1];
        assert_eq!(take(&src_pieces, &mut longer), None, "pieces that don't fill the slot");
    }
}
