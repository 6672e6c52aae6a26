//! What a `fork(2)` leaves a child of a process that used the client. Only the forking thread
//! goes on in the child: a lock another thread held at that instant stays held there for good,
//! and the calls that other threads had in flight never end. So around a fork the forking thread
//! takes the process-wide locks of the calls' bookkeeping (the wait choices, [`crate::wait`]) —
//! no other thread holds one at the fork — and lets them go after, in the parent and in the
//! child, and the child starts with no call in flight. Registered once, by the first client made.
//!
//! The rest is elsewhere: a child makes its own runtime and connections (the Python client), and
//! parallel work runs on a pool of the child's own (`kvtier_kernels::par`).

use std::cell::RefCell;
use std::sync::{MutexGuard, Once};

use crate::wait::WaitChooser;

thread_local! {
    /// The locks the forking thread holds from `prepare` to `parent` / `child`.
    static HELD: RefCell<Vec<MutexGuard<'static, WaitChooser>>> = const { RefCell::new(Vec::new()) };
}

/// Registers the fork handlers, once per process (a child inherits them).
pub(crate) fn hold_locks_over_fork() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: the handlers are functions of this library, which is never unloaded while its
        // clients exist (a Python extension module stays loaded); they take and drop locks only.
        let rc = unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) };
        if rc != 0 {
            tracing::warn!(
                rc,
                "cannot register the client's fork handlers; a forked child's first call may wait forever"
            );
        }
    });
}

extern "C" fn prepare() {
    let guards = crate::wait::lock_all();
    HELD.with(|h| *h.borrow_mut() = guards);
}

extern "C" fn parent() {
    HELD.with(|h| h.borrow_mut().clear());
}

extern "C" fn child() {
    // The calls in flight were other threads', which the child does not have.
    crate::polled::forget_calls_in_flight();
    HELD.with(|h| h.borrow_mut().clear());
}
