//! The thread pool parallel work runs on, in a process and in its forked children.
//!
//! rayon's global pool is made once per address space: a child forked after its parent used it
//! inherits the pool's queues but none of its threads, and the first parallel job it hands that
//! pool waits forever (a Python engine's `multiprocessing` workers, forked after the parent stored
//! an FP8 block, blocked in their first store past any timeout). Every parallel section of this
//! workspace's client-side code runs through [`run`]: in the process that first ran one it is the
//! global pool, unchanged; in a forked child, a pool of the child's own, made on first use.

use std::sync::atomic::{AtomicPtr, AtomicU32, Ordering};

/// The process whose parallel work first ran here: rayon's global pool is its (0: none yet).
static GLOBAL_POOL_PROCESS: AtomicU32 = AtomicU32::new(0);

/// A forked child's own pool and the process it was made in (null: none made yet).
static CHILD_POOL: AtomicPtr<(u32, rayon::ThreadPool)> = AtomicPtr::new(std::ptr::null_mut());

/// Runs `f`, whose parallel iterators and joins then use a pool whose threads exist in this
/// process: the global pool in the process that first used it, a pool of its own in a child
/// forked after that. Inside a pool's worker thread `f` runs in place (on that pool).
pub fn run<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        return f();
    }
    let pid = std::process::id();
    if global_pool_is_ours(pid) {
        return f();
    }
    match child_pool(pid) {
        Some(pool) => pool.install(f),
        None => match in_place_pool() {
            Some(pool) => pool.install(f),
            // Not reached: a pool of the calling thread alone starts no thread, and this thread
            // is in no pool (checked above).
            None => f(),
        },
    }
}

/// How many threads parallel work would run on here, as [`run`] picks the pool: asking rayon's
/// global pool directly would start it without this process claiming it (a child forked after
/// that would take the parent's thread-less pool for its own).
pub fn current_num_threads() -> usize {
    if rayon::current_thread_index().is_some() {
        return rayon::current_num_threads();
    }
    let pid = std::process::id();
    if global_pool_is_ours(pid) {
        return rayon::current_num_threads();
    }
    child_pool(pid).map_or(1, rayon::ThreadPool::current_num_threads)
}

/// Whether rayon's global pool is this process's (claiming it when no process has yet).
fn global_pool_is_ours(pid: u32) -> bool {
    match GLOBAL_POOL_PROCESS.compare_exchange(0, pid, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => true,
        Err(owner) => owner == pid,
    }
}

/// When this process cannot start threads: a pool of the calling thread alone, in which the
/// work runs in order on it (the thread stays in that pool; later parallel work on it runs in
/// place, above). Leaked with the thread's membership.
fn in_place_pool() -> Option<&'static rayon::ThreadPool> {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).use_current_thread().build().ok()?;
    Some(Box::leak(Box::new(pool)))
}

/// This (forked) process's own pool, made on first use; `None` if it cannot start threads.
fn child_pool(pid: u32) -> Option<&'static rayon::ThreadPool> {
    let current = CHILD_POOL.load(Ordering::Acquire);
    // SAFETY: a non-null pointer came from `Box::into_raw` below and is never freed (a pool lives
    // as long as its process; one inherited from a parent is leaked with it).
    if let Some((made_in, pool)) = unsafe { current.as_ref() } {
        if *made_in == pid {
            return Some(pool);
        }
    }
    let threads = std::thread::available_parallelism().map_or(1, usize::from);
    let pool =
        rayon::ThreadPoolBuilder::new().num_threads(threads).thread_name(|i| format!("kvtier-par-{i}")).build().ok()?;
    let fresh = Box::into_raw(Box::new((pid, pool)));
    match CHILD_POOL.compare_exchange(current, fresh, Ordering::AcqRel, Ordering::Acquire) {
        // SAFETY: as above; `fresh` is now the process's pool and is never freed.
        Ok(_) => Some(unsafe { &(*fresh).1 }),
        Err(other) => {
            // Another thread of this process made one first: that one is used, ours dropped.
            // SAFETY: `fresh` was never shared.
            drop(unsafe { Box::from_raw(fresh) });
            // SAFETY: as above.
            unsafe { other.as_ref() }.filter(|(made_in, _)| *made_in == pid).map(|(_, pool)| pool)
        }
    }
}
