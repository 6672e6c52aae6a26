//! The file layer under everything the node keeps on disk: the disk tier's segments
//! ([`crate::disk`]), `sessions.log` ([`crate::session_log`]) and `namespaces.log`
//! ([`crate::state`]). It is the exact set of operations those make — open or create, positional
//! reads and writes, `set_len`, `fsync`, rename, remove, a directory's `fsync`, list — and no more,
//! so that a test can put a file system under them that loses what a power cut would lose
//! (`fault::FaultFs`, with the `fault-fs` feature or in this crate's tests).
//!
//! [`StdFs`] is the real one: each call is the `std::fs` call it names. The node holds it as an
//! `Arc<dyn FileSystem>` chosen when it opens, and each open file as an `Arc<dyn FsFile>`: one
//! indirect call beside a system call that moves 4 KiB or more (a `pwrite`, an `fsync`), so the
//! hot path costs the same, and nothing above the tier (the stack, the planes) becomes generic.
//!
//! Durability contract, as POSIX gives it and as `FaultFs` enforces it: bytes written are durable
//! after the file's [`FsFile::sync_data`] succeeds; a created, renamed or removed name is durable
//! after its directory's [`FileSystem::sync_dir`] succeeds. A failed `sync_data` may have lost the
//! writes it covered for good (Linux marks the pages clean): a later successful sync does not
//! bring them back.

#[cfg(any(test, feature = "fault-fs"))]
pub mod fault;

use std::fmt::Debug;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// How [`FileSystem::open`] opens a file (always for reading and writing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    /// The file must exist.
    Existing,
    /// Created empty if missing, kept as it is otherwise.
    Create,
    /// Created; an error if the name exists.
    CreateNew,
    /// Created, or cut to zero length if it exists.
    Truncate,
}

/// One open file. Positional I/O only: whoever appends keeps its own end offset.
pub trait FsFile: Send + Sync + Debug {
    /// Fills `buf` from `offset` (an error if the file ends first).
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Writes all of `buf` at `offset`, extending the file if needed. On an error a prefix may
    /// have been written.
    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// The file's size in bytes.
    fn size(&self) -> io::Result<u64>;
    fn set_len(&self, len: u64) -> io::Result<()>;
    /// Makes every write so far durable (`fdatasync`).
    fn sync_data(&self) -> io::Result<()>;
}

/// Names and directories.
pub trait FileSystem: Send + Sync + Debug {
    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<Arc<dyn FsFile>>;
    fn create_dir_all(&self, path: &Path) -> io::Result<()>;
    /// The names of the entries of `dir`.
    fn list(&self, dir: &Path) -> io::Result<Vec<String>>;
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    fn remove_file(&self, path: &Path) -> io::Result<()>;
    /// Makes the entries of `dir` (creations, renames, removals) durable.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;

    /// A whole file's bytes (`None` if it does not exist).
    fn read_all(&self, path: &Path) -> io::Result<Option<Vec<u8>>> {
        let f = match self.open(path, OpenMode::Existing) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let mut data = vec![0u8; f.size()? as usize];
        f.read_exact_at(&mut data, 0)?;
        Ok(Some(data))
    }

    /// Writes a whole new file at `path` through `path.tmp`, synced, renamed over `path`, the
    /// directory synced: after a crash the old file or the new one, never a mix or nothing.
    fn replace(&self, path: &Path, data: &[u8]) -> io::Result<()> {
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        let f = self.open(&tmp, OpenMode::Truncate)?;
        f.write_all_at(data, 0)?;
        f.sync_data()?;
        drop(f);
        self.rename(&tmp, path)?;
        self.sync_dir(path.parent().unwrap_or(Path::new(".")))
    }

    /// Creates `dir` (and its parents) and makes its name durable in its parent.
    fn create_dir_durable(&self, dir: &Path) -> io::Result<()> {
        self.create_dir_all(dir)?;
        match dir.parent() {
            Some(p) if p.as_os_str().is_empty() => self.sync_dir(Path::new(".")),
            Some(p) => self.sync_dir(p),
            None => Ok(()),
        }
    }
}

/// The real file system: `std::fs`.
#[derive(Debug, Default, Clone, Copy)]
pub struct StdFs;

impl StdFs {
    /// The shared handle the node opens with.
    pub fn shared() -> Arc<dyn FileSystem> {
        Arc::new(StdFs)
    }
}

#[derive(Debug)]
struct StdFile(std::fs::File);

impl FsFile for StdFile {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(&self.0, buf, offset)
    }
    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        std::os::unix::fs::FileExt::write_all_at(&self.0, buf, offset)
    }
    fn size(&self) -> io::Result<u64> {
        Ok(self.0.metadata()?.len())
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.0.set_len(len)
    }
    fn sync_data(&self) -> io::Result<()> {
        self.0.sync_data()
    }
}

impl FileSystem for StdFs {
    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<Arc<dyn FsFile>> {
        let mut o = std::fs::OpenOptions::new();
        o.read(true).write(true);
        match mode {
            OpenMode::Existing => {}
            OpenMode::Create => {
                o.create(true);
            }
            OpenMode::CreateNew => {
                o.create_new(true);
            }
            OpenMode::Truncate => {
                o.create(true).truncate(true);
            }
        }
        Ok(Arc::new(StdFile(o.open(path)?)))
    }
    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        std::fs::create_dir_all(path)
    }
    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(dir)? {
            if let Ok(name) = e?.file_name().into_string() {
                out.push(name);
            }
        }
        Ok(out)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        std::fs::File::open(dir)?.sync_all()
    }
}
