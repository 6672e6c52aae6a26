//! Shared memory as "device memory" for the host backend: the stand-in for CUDA IPC between an
//! engine process and the agent. An engine on the host backend keeps its KV pages in a sealed
//! memfd and names it by an [`IpcHandle`] of the shared-memory kind (the owning process id and
//! its descriptor number, [`IpcHandle::host_shared_memory`]); [`super::Device::import_ipc`] on a
//! [`crate::HostDevice`] maps it (`/proc/<pid>/fd/<fd>`), so the agent's copies read and write the
//! engine's own pages, as `cuIpcOpenMemHandle` gives it the engine's HBM.
//!
//! The same rules as the server's same-node buffers: only a memfd sealed against shrinking
//! (`F_SEAL_SHRINK`) and at least as long as the handle says is mapped, so the engine can never
//! truncate pages out from under the agent (a SIGBUS); the mapping covers exactly the handle's
//! length.

use std::fs::OpenOptions;
use std::ops::{Deref, DerefMut};

use memmap2::{MmapMut, MmapOptions};
use rustix::fs::SealFlags;

use super::IpcHandle;
use crate::error::{AgentError, Result};

/// Magic of a shared-memory handle (bytes 0..8); then the process id (u32 LE) and the descriptor
/// number in that process (i32 LE).
const SHM_MAGIC: &[u8; 8] = b"KVHOSTFD";

/// The bytes behind a host-backend allocation or host buffer: the heap, or a mapping of another
/// process's memfd.
pub(crate) enum Storage {
    Heap(Box<[u8]>),
    Mapped(MmapMut),
}

impl Deref for Storage {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Storage::Heap(b) => b,
            Storage::Mapped(m) => m,
        }
    }
}

impl DerefMut for Storage {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            Storage::Heap(b) => b,
            Storage::Mapped(m) => m,
        }
    }
}

impl IpcHandle {
    /// The host backend's handle for `len` bytes of the memfd that process `pid` holds open as
    /// descriptor `fd` (the agent itself, once it has received the descriptor over its socket).
    pub fn host_shared_memory(pid: u32, fd: i32, len: usize) -> IpcHandle {
        let mut bytes = [0u8; 64];
        bytes[..8].copy_from_slice(SHM_MAGIC);
        bytes[8..12].copy_from_slice(&pid.to_le_bytes());
        bytes[12..16].copy_from_slice(&fd.to_le_bytes());
        IpcHandle::from_bytes(bytes, len)
    }

    /// `(pid, fd)` of a shared-memory handle; `None` for any other kind.
    pub fn shared_memory_source(&self) -> Option<(u32, i32)> {
        if self.bytes[..8] != SHM_MAGIC[..] {
            return None;
        }
        let pid = u32::from_le_bytes(self.bytes[8..12].try_into().ok()?);
        let fd = i32::from_le_bytes(self.bytes[12..16].try_into().ok()?);
        Some((pid, fd))
    }
}

/// Maps the memfd a shared-memory handle names; `Ok(None)` when the handle is of another kind.
pub(crate) fn import_shared(handle: &IpcHandle) -> Result<Option<Storage>> {
    let Some((pid, fd)) = handle.shared_memory_source() else { return Ok(None) };
    let bad = |why: String| AgentError::BadIpcHandle(why);
    if handle.is_empty() {
        return Err(bad("a shared-memory handle of 0 bytes".into()));
    }
    let path = format!("/proc/{pid}/fd/{fd}");
    let file = OpenOptions::new().read(true).write(true).open(&path).map_err(|e| bad(format!("open {path}: {e}")))?;
    let st = rustix::fs::fstat(&file).map_err(|e| bad(format!("fstat {path}: {e}")))?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
        return Err(bad(format!("{path} is not a memfd")));
    }
    let seals = rustix::fs::fcntl_get_seals(&file)
        .map_err(|e| bad(format!("{path} is not a sealable memfd (F_GET_SEALS: {e})")))?;
    if !seals.contains(SealFlags::SHRINK) {
        return Err(bad(
            "the memfd is not sealed with F_SEAL_SHRINK (pages that can vanish would crash the agent)".into()
        ));
    }
    let size = u64::try_from(st.st_size).unwrap_or(0);
    if size < handle.len() as u64 {
        return Err(bad(format!("the memfd is {size} bytes, smaller than the {} the handle claims", handle.len())));
    }
    // SAFETY: the file is a memfd sealed against shrinking and at least `len` bytes long, so every
    // page of the mapping stays backed for its life. The engine writes its pages only between its
    // requests to the agent (the engine socket's contract); the agent's copies of a page run inside
    // the request that names it.
    let map = unsafe { MmapOptions::new().len(handle.len()).map_mut(&file) }.map_err(|e| bad(format!("mmap: {e}")))?;
    Ok(Some(Storage::Mapped(map)))
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use rustix::fs::MemfdFlags;

    use super::*;
    use crate::{Device, HostBuffer, HostDevice};

    fn memfd(len: u64, seal: bool) -> std::os::fd::OwnedFd {
        let fd = rustix::fs::memfd_create("kvtier-test", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
        rustix::fs::ftruncate(&fd, len).unwrap();
        if seal {
            rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW).unwrap();
        }
        fd
    }

    #[test]
    fn an_imported_memfd_is_the_engines_memory() {
        let fd = memfd(4096, true);
        let engine_view = std::fs::File::from(fd.try_clone().unwrap());
        let dev = HostDevice::new(0, 1 << 20);
        let h = IpcHandle::host_shared_memory(std::process::id(), fd.as_raw_fd(), 4096);
        assert_eq!(h.shared_memory_source(), Some((std::process::id(), fd.as_raw_fd())));
        let buf = dev.import_ipc(&h).unwrap();
        assert_eq!(dev.mem_info().unwrap().free, 1 << 20, "imports use the engine's memory");
        let s = dev.new_stream().unwrap();
        let host = HostBuffer::from_vec((0..=255u8).collect());
        let _r = dev.register_host(&host).unwrap();
        dev.copy_h2d(&s, &host.range(0, 256), buf.range(1000, 256)).unwrap();
        dev.wait(&dev.record(&s).unwrap()).unwrap();
        let mut seen = vec![0u8; 256];
        rustix::io::pread(&engine_view, &mut seen, 1000).unwrap();
        assert_eq!(seen, (0..=255u8).collect::<Vec<_>>(), "the engine sees the agent's write");
        rustix::io::pwrite(&engine_view, &[9; 16], 0).unwrap();
        assert_eq!(dev.read_sync(buf.range(0, 16)).unwrap(), [9; 16], "the agent sees the engine's write");
        assert!(matches!(
            dev.copy_h2d(&s, &host.range(0, 256), buf.range(4000, 256)),
            Err(AgentError::OutOfBounds { .. })
        ));
        assert!(matches!(dev.export_ipc(buf), Err(AgentError::BadIpcHandle(_))));
        dev.free(buf).unwrap();
    }

    #[test]
    fn unsealed_short_or_missing_memfds_are_refused() {
        let dev = HostDevice::new(0, 1 << 20);
        let pid = std::process::id();
        let loose = memfd(4096, false);
        let err = dev.import_ipc(&IpcHandle::host_shared_memory(pid, loose.as_raw_fd(), 4096)).unwrap_err();
        assert!(matches!(&err, AgentError::BadIpcHandle(m) if m.contains("F_SEAL_SHRINK")), "{err}");
        let short = memfd(4096, true);
        let err = dev.import_ipc(&IpcHandle::host_shared_memory(pid, short.as_raw_fd(), 8192)).unwrap_err();
        assert!(matches!(&err, AgentError::BadIpcHandle(m) if m.contains("smaller")), "{err}");
        let err = dev.import_ipc(&IpcHandle::host_shared_memory(pid, 987_654, 4096)).unwrap_err();
        assert!(matches!(err, AgentError::BadIpcHandle(_)));
        let err = dev.import_ipc(&IpcHandle::host_shared_memory(pid, short.as_raw_fd(), 0)).unwrap_err();
        assert!(matches!(err, AgentError::BadIpcHandle(_)));
    }
}
