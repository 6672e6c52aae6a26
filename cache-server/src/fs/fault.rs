//! [`FaultFs`]: an in-memory [`FileSystem`] that knows what a power cut would keep, for tests.
//!
//! Every file has the bytes a reader sees and the bytes that are durable; each write or `set_len`
//! since the file's last `sync_data` is pending. Every name (file or directory) is visible, and
//! durable only once its directory was synced after it was created, renamed or removed.
//! [`FaultFs::crash`] turns the world into what a machine finds after losing power: pending
//! changes dropped — or, torn, each kept whole, kept in part (some of its 4 KiB pages) or dropped,
//! independently, since disks reorder — and the names as their directories' last syncs left them
//! (an unsynced creation gone, an unsynced rename undone, an unsynced removal back). Handles from
//! before the crash fail from then on, like the dead process's.
//!
//! Faults: [`FaultFs::freeze_after`] (the machine dies after N more changes: each later change
//! fails and has no effect, so a workload can be cut at any point), [`FaultFs::enospc_from`]
//! (the Nth write and every one after fail with `StorageFull`, half of the buffer written),
//! [`FaultFs::fail_syncs`] (the next syncs fail with EIO and lose the writes they covered, as
//! Linux does: a later sync succeeds without them), [`FaultFs::fail_dir_syncs`].
//!
//! Paths are plain keys: everything lives under the root given to [`FaultFs::new`] (a real
//! temporary directory path, so the node's `LOCK` can still be taken there with `std::fs`).

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;

use super::{FileSystem, FsFile, OpenMode};

const PAGE: u64 = 4096;

#[derive(Debug, Clone)]
enum Op {
    Write(u64, Vec<u8>),
    SetLen(u64),
}

impl Op {
    fn apply(&self, data: &mut Vec<u8>) {
        match self {
            Op::Write(off, buf) => {
                let end = *off as usize + buf.len();
                if data.len() < end {
                    data.resize(end, 0);
                }
                data[*off as usize..end].copy_from_slice(buf);
            }
            Op::SetLen(len) => data.resize(*len as usize, 0),
        }
    }
}

#[derive(Debug, Default, Clone)]
struct FileState {
    data: Vec<u8>,
    durable: Vec<u8>,
    pending: Vec<Op>,
}

/// How a crash treats the changes that were never synced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrashMode {
    /// Every unsynced change lost.
    DropUnsynced,
    /// Each unsynced write kept whole, in part (a random subset of its pages) or lost, chosen
    /// from this seed.
    Torn(u64),
}

#[derive(Debug)]
struct World {
    root: PathBuf,
    generation: u64,
    files: Vec<FileState>,
    names: BTreeMap<PathBuf, usize>,
    durable_names: BTreeMap<PathBuf, usize>,
    dirs: BTreeSet<PathBuf>,
    durable_dirs: BTreeSet<PathBuf>,
    changes: u64,
    freeze_after: Option<u64>,
    writes: u64,
    enospc_from: Option<u64>,
    fail_syncs: u32,
    fail_dir_syncs: u32,
    /// Faults that fired (for tests that want to know a fault was reached).
    fired: u64,
}

fn eio(what: &str) -> io::Error {
    io::Error::other(format!("injected EIO: {what}"))
}

impl World {
    /// Counts a change; fails (with no effect) once the machine is frozen.
    fn change(&mut self) -> io::Result<()> {
        self.changes += 1;
        match self.freeze_after {
            Some(n) if self.changes > n => {
                self.fired += 1;
                Err(eio("the machine is down"))
            }
            _ => Ok(()),
        }
    }

    fn dir_exists(&self, dir: &Path) -> bool {
        self.dirs.contains(dir)
    }

    fn parent_exists(&self, path: &Path) -> io::Result<()> {
        match path.parent() {
            Some(p) if self.dir_exists(p) => Ok(()),
            _ => Err(io::Error::new(io::ErrorKind::NotFound, format!("no directory for {}", path.display()))),
        }
    }
}

/// See the module docs. Cloning shares the world.
#[derive(Debug, Clone)]
pub struct FaultFs {
    world: Arc<Mutex<World>>,
}

#[derive(Debug)]
struct FaultFile {
    world: Arc<Mutex<World>>,
    ino: usize,
    generation: u64,
}

impl FaultFile {
    fn with<T>(&self, f: impl FnOnce(&mut World, usize) -> io::Result<T>) -> io::Result<T> {
        let mut w = self.world.lock();
        if w.generation != self.generation {
            return Err(eio("a handle from before the crash"));
        }
        f(&mut w, self.ino)
    }
}

impl FsFile for FaultFile {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.with(|w, ino| {
            let data = &w.files[ino].data;
            let end = offset as usize + buf.len();
            if end > data.len() {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "read past the end"));
            }
            buf.copy_from_slice(&data[offset as usize..end]);
            Ok(())
        })
    }

    fn write_all_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.with(|w, ino| {
            w.change()?;
            w.writes += 1;
            if w.enospc_from.is_some_and(|n| w.writes >= n) {
                w.fired += 1;
                // A short write, then the disk is full.
                let op = Op::Write(offset, buf[..buf.len() / 2].to_vec());
                let f = &mut w.files[ino];
                op.apply(&mut f.data);
                f.pending.push(op);
                return Err(io::Error::new(io::ErrorKind::StorageFull, "injected ENOSPC"));
            }
            let op = Op::Write(offset, buf.to_vec());
            let f = &mut w.files[ino];
            op.apply(&mut f.data);
            f.pending.push(op);
            Ok(())
        })
    }

    fn size(&self) -> io::Result<u64> {
        self.with(|w, ino| Ok(w.files[ino].data.len() as u64))
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.with(|w, ino| {
            w.change()?;
            let op = Op::SetLen(len);
            let f = &mut w.files[ino];
            op.apply(&mut f.data);
            f.pending.push(op);
            Ok(())
        })
    }

    fn sync_data(&self) -> io::Result<()> {
        self.with(|w, ino| {
            w.change()?;
            if w.fail_syncs > 0 {
                w.fail_syncs -= 1;
                w.fired += 1;
                // The writeback failed and the pages were marked clean: these writes are lost to
                // the disk for good, though readers still see them until the cache drops them.
                w.files[ino].pending.clear();
                return Err(eio("fsync"));
            }
            let f = &mut w.files[ino];
            for op in std::mem::take(&mut f.pending) {
                op.apply(&mut f.durable);
            }
            Ok(())
        })
    }
}

/// splitmix64: enough randomness to choose what a crash keeps.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

impl FaultFs {
    /// An empty world whose only (durable) directory is `root`.
    pub fn new(root: &Path) -> Self {
        let root = root.to_path_buf();
        let dirs: BTreeSet<PathBuf> = [root.clone()].into();
        FaultFs {
            world: Arc::new(Mutex::new(World {
                root,
                generation: 0,
                files: Vec::new(),
                names: BTreeMap::new(),
                durable_names: BTreeMap::new(),
                durable_dirs: dirs.clone(),
                dirs,
                changes: 0,
                freeze_after: None,
                writes: 0,
                enospc_from: None,
                fail_syncs: 0,
                fail_dir_syncs: 0,
                fired: 0,
            })),
        }
    }

    /// The shared handle a tier or log opens with.
    pub fn shared(&self) -> Arc<dyn FileSystem> {
        Arc::new(self.clone())
    }

    /// Changes (writes, `set_len`s, syncs, creations, renames, removals) made so far.
    pub fn changes(&self) -> u64 {
        self.world.lock().changes
    }

    /// The machine dies after `n` more changes: every later one fails with EIO and has no effect.
    pub fn freeze_after(&self, n: u64) {
        let mut w = self.world.lock();
        w.freeze_after = Some(w.changes + n);
    }

    /// The `n`th write from now (1 = the next) and every later one fail with `StorageFull`
    /// after writing half their bytes; `None` ends it.
    pub fn enospc_from(&self, n: Option<u64>) {
        let mut w = self.world.lock();
        w.enospc_from = n.map(|n| w.writes + n);
    }

    /// The next `n` file syncs fail with EIO, losing the writes they would have made durable.
    pub fn fail_syncs(&self, n: u32) {
        self.world.lock().fail_syncs = n;
    }

    /// The next `n` directory syncs fail with EIO (the entries stay as durable as they were).
    pub fn fail_dir_syncs(&self, n: u32) {
        self.world.lock().fail_dir_syncs = n;
    }

    /// How many injected faults fired so far.
    pub fn fired(&self) -> u64 {
        self.world.lock().fired
    }

    /// Power loss: the world becomes what survives (see the module docs); faults are cleared.
    pub fn crash(&self, mode: CrashMode) {
        let mut w = self.world.lock();
        let mut rng = Rng(match mode {
            CrashMode::DropUnsynced => 0,
            CrashMode::Torn(seed) => seed,
        });
        for f in &mut w.files {
            let mut kept = std::mem::take(&mut f.durable);
            for op in std::mem::take(&mut f.pending) {
                if mode == CrashMode::DropUnsynced {
                    continue;
                }
                match (rng.below(4), &op) {
                    (0, _) => {}
                    (1, _) | (_, Op::SetLen(_)) => op.apply(&mut kept),
                    (choice, Op::Write(off, buf)) => {
                        // Page by page (pages of the file, not of the buffer).
                        let mut at = *off;
                        let end = off + buf.len() as u64;
                        let mut keep = true;
                        while at < end {
                            let next = ((at / PAGE + 1) * PAGE).min(end);
                            // 2: a prefix of the pages; 3: any of them.
                            keep = if choice == 2 { keep && rng.below(3) != 0 } else { rng.below(2) == 0 };
                            if keep {
                                let s = (at - off) as usize..(next - off) as usize;
                                Op::Write(at, buf[s].to_vec()).apply(&mut kept);
                            }
                            at = next;
                        }
                    }
                }
            }
            f.data = kept.clone();
            f.durable = kept;
        }
        // A name survives if it and every directory above it (up to the root) were synced in.
        let root = w.root.clone();
        let reachable = |dirs: &BTreeSet<PathBuf>, p: &Path| {
            p.ancestors().skip(1).take_while(|a| a.starts_with(&root)).all(|a| dirs.contains(a))
        };
        let durable_dirs: BTreeSet<PathBuf> =
            w.durable_dirs.iter().filter(|d| **d == root || reachable(&w.durable_dirs, d)).cloned().collect();
        let durable_names: BTreeMap<PathBuf, usize> =
            w.durable_names.iter().filter(|(p, _)| reachable(&durable_dirs, p)).map(|(p, i)| (p.clone(), *i)).collect();
        w.dirs = durable_dirs.clone();
        w.durable_dirs = durable_dirs;
        w.names = durable_names.clone();
        w.durable_names = durable_names;
        w.generation += 1;
        w.freeze_after = None;
        w.enospc_from = None;
        w.fail_syncs = 0;
        w.fail_dir_syncs = 0;
    }

    /// The bytes a reader sees in `path` now (`None`: no such file).
    pub fn contents(&self, path: &Path) -> Option<Vec<u8>> {
        let w = self.world.lock();
        w.names.get(path).map(|&i| w.files[i].data.clone())
    }

    /// Replaces the bytes of `path` (durably), as a test that damages a file would.
    pub fn set_contents(&self, path: &Path, data: Vec<u8>) {
        let mut w = self.world.lock();
        if let Some(&i) = w.names.get(path) {
            w.files[i] = FileState { durable: data.clone(), data, pending: Vec::new() };
        }
    }
}

impl FileSystem for FaultFs {
    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<Arc<dyn FsFile>> {
        let mut w = self.world.lock();
        let existing = w.names.get(path).copied();
        let ino = match (mode, existing) {
            (OpenMode::Existing, None) => {
                return Err(io::Error::new(io::ErrorKind::NotFound, format!("{} not found", path.display())))
            }
            (OpenMode::CreateNew, Some(_)) => {
                return Err(io::Error::new(io::ErrorKind::AlreadyExists, format!("{} exists", path.display())))
            }
            (OpenMode::Truncate, Some(i)) => {
                w.change()?;
                let f = &mut w.files[i];
                Op::SetLen(0).apply(&mut f.data);
                f.pending.push(Op::SetLen(0));
                i
            }
            (_, Some(i)) => i,
            (_, None) => {
                w.parent_exists(path)?;
                w.change()?;
                w.files.push(FileState::default());
                let i = w.files.len() - 1;
                w.names.insert(path.to_path_buf(), i);
                i
            }
        };
        Ok(Arc::new(FaultFile { world: self.world.clone(), ino, generation: w.generation }))
    }

    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        let mut w = self.world.lock();
        if !path.starts_with(&w.root) {
            return Err(io::Error::new(io::ErrorKind::PermissionDenied, "outside the fault file system's root"));
        }
        let missing: Vec<PathBuf> =
            path.ancestors().take_while(|a| !w.dirs.contains(*a)).map(Path::to_path_buf).collect();
        for d in missing.into_iter().rev() {
            w.change()?;
            w.dirs.insert(d);
        }
        Ok(())
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        let w = self.world.lock();
        if !w.dir_exists(dir) {
            return Err(io::Error::new(io::ErrorKind::NotFound, format!("{} not found", dir.display())));
        }
        let names = w.names.keys().chain(w.dirs.iter()).filter(|p| p.parent() == Some(dir));
        Ok(names.filter_map(|p| p.file_name()?.to_str().map(str::to_string)).collect())
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut w = self.world.lock();
        let Some(&i) = w.names.get(from) else {
            return Err(io::Error::new(io::ErrorKind::NotFound, format!("{} not found", from.display())));
        };
        w.parent_exists(to)?;
        w.change()?;
        w.names.remove(from);
        w.names.insert(to.to_path_buf(), i);
        Ok(())
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        let mut w = self.world.lock();
        if !w.names.contains_key(path) {
            return Err(io::Error::new(io::ErrorKind::NotFound, format!("{} not found", path.display())));
        }
        w.change()?;
        w.names.remove(path);
        Ok(())
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let mut w = self.world.lock();
        if w.root.starts_with(dir) && w.root != dir {
            // Above the root: outside this world, durable by definition.
            return Ok(());
        }
        if !w.dir_exists(dir) {
            return Err(io::Error::new(io::ErrorKind::NotFound, format!("{} not found", dir.display())));
        }
        w.change()?;
        if w.fail_dir_syncs > 0 {
            w.fail_dir_syncs -= 1;
            w.fired += 1;
            return Err(eio("directory fsync"));
        }
        let in_dir = |p: &PathBuf| p.parent() == Some(dir);
        w.durable_names.retain(|p, _| !in_dir(p));
        let now: Vec<(PathBuf, usize)> =
            w.names.iter().filter(|(p, _)| in_dir(p)).map(|(p, i)| (p.clone(), *i)).collect();
        w.durable_names.extend(now);
        w.durable_dirs.retain(|p| !in_dir(p));
        let now: Vec<PathBuf> = w.dirs.iter().filter(|p| in_dir(p)).cloned().collect();
        w.durable_dirs.extend(now);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_crash_keeps_what_was_synced_and_names_whose_directory_was() {
        let root = PathBuf::from("/fault-root");
        let fs = FaultFs::new(&root);
        let (a, b) = (root.join("a"), root.join("b"));
        let f = fs.open(&a, OpenMode::CreateNew).unwrap();
        f.write_all_at(b"durable", 0).unwrap();
        f.sync_data().unwrap();
        f.write_all_at(b"-lost", 7).unwrap();
        fs.sync_dir(&root).unwrap();
        let g = fs.open(&b, OpenMode::CreateNew).unwrap();
        g.write_all_at(b"no name", 0).unwrap();
        g.sync_data().unwrap();
        fs.crash(CrashMode::DropUnsynced);
        assert_eq!(fs.contents(&a).unwrap(), b"durable");
        assert!(fs.contents(&b).is_none(), "created, synced, but its directory never was");
        assert!(f.size().is_err(), "handles from before the crash are dead");
        // An unsynced rename is undone; a synced one holds.
        fs.rename(&a, &b).unwrap();
        fs.crash(CrashMode::DropUnsynced);
        assert!(fs.contents(&a).is_some() && fs.contents(&b).is_none());
        fs.rename(&a, &b).unwrap();
        fs.sync_dir(&root).unwrap();
        fs.crash(CrashMode::DropUnsynced);
        assert!(fs.contents(&a).is_none() && fs.contents(&b).is_some());
    }

    #[test]
    fn a_failed_sync_loses_its_writes_for_good() {
        let root = PathBuf::from("/fault-root");
        let fs = FaultFs::new(&root);
        let f = fs.open(&root.join("a"), OpenMode::CreateNew).unwrap();
        fs.sync_dir(&root).unwrap();
        f.write_all_at(b"abc", 0).unwrap();
        fs.fail_syncs(1);
        assert!(f.sync_data().is_err());
        f.sync_data().unwrap();
        fs.crash(CrashMode::DropUnsynced);
        assert_eq!(fs.contents(&root.join("a")).unwrap(), b"");
    }

    #[test]
    fn torn_crashes_keep_whole_pages_of_unsynced_writes() {
        let root = PathBuf::from("/fault-root");
        for seed in 0..50 {
            let fs = FaultFs::new(&root);
            let f = fs.open(&root.join("a"), OpenMode::CreateNew).unwrap();
            fs.sync_dir(&root).unwrap();
            f.write_all_at(&vec![7u8; 3 * PAGE as usize], 0).unwrap();
            fs.crash(CrashMode::Torn(seed));
            let data = fs.contents(&root.join("a")).unwrap();
            assert!((data.len() as u64).is_multiple_of(PAGE) && data.len() as u64 <= 3 * PAGE);
            assert!(data.chunks(PAGE as usize).all(|p| p.iter().all(|&b| b == p[0])), "seed {seed}");
        }
    }
}
