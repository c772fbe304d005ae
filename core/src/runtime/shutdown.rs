//! The shutdown handshake between a rank's last communicator and its progress task.
//!
//! When the last communicator of a rank is dropped (on any thread), it
//! [`request`](ShutdownSignal::request)s shutdown; the progress task, parked on the transport,
//! must notice. The task registers its waker and *then* checks the flag
//! ([`poll_requested`](ShutdownSignal::poll_requested)); the requester sets the flag and *then*
//! takes and wakes the registered waker. The waker slot's mutex orders the two: if the
//! requester locks the slot after the task, it finds the task's waker and wakes it; if it locks
//! it before, its flag store happens-before the task's check, which therefore sees it. Either
//! way the request is not missed.
//!
//! A request may also ask to [abort](ShutdownSignal::is_aborted): the abort flag is set before
//! the shutdown flag, so whoever sees the shutdown flag also sees the abort.
//!
//! This file is also compiled by the `loom-tests` crate against loom's primitives, so it must
//! take every synchronization primitive from `crate::sync` and nothing else from its crate.

use std::task::{Context, Poll, Waker};

use crate::sync::atomic::{AtomicBool, Ordering};
use crate::sync::{Mutex, MutexGuard};

/// A one-way "please shut down" flag (with an "at once" variant) that wakes one parked task.
///
/// Any thread may [`request`](Self::request); one task (the rank's progress task) polls it with
/// [`poll_requested`](Self::poll_requested). Requests are idempotent, and once requested (or
/// aborted) it stays so.
pub struct ShutdownSignal {
    /// Shutdown was requested.
    requested: AtomicBool,
    /// Shutdown was requested with `abort`: stop at once. Set before `requested`.
    aborted: AtomicBool,
    /// The waker of the task polling [`poll_requested`](Self::poll_requested), if any.
    waker: Mutex<Option<Waker>>,
}

impl ShutdownSignal {
    /// A signal with nothing requested and no waker registered.
    #[must_use]
    pub fn new() -> Self {
        Self {
            requested: AtomicBool::new(false),
            aborted: AtomicBool::new(false),
            waker: Mutex::new(None),
        }
    }

    /// Requests shutdown (at once if `abort`) and wakes the registered waker, if any.
    ///
    /// Idempotent; an abort is never undone by a later request without it.
    pub fn request(&self, abort: bool) {
        // `aborted` first: a reader that sees `requested` then sees the abort too.
        self.aborted.fetch_or(abort, Ordering::SeqCst);
        self.requested.store(true, Ordering::SeqCst);
        // Flag first, then the slot (see module docs). Taking the waker means each registration
        // is woken at most once; the task registers again the next time it polls.
        let waker = lock(&self.waker).take();
        // Woken outside the lock: `wake` may run arbitrary code.
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    /// Registers `cx`'s waker (replacing any earlier one), then returns `Ready` if shutdown has
    /// been requested and `Pending` otherwise.
    ///
    /// The waker is registered even when shutdown was already requested, and *before* the check,
    /// so a concurrent [`request`](Self::request) is either seen here or wakes the waker.
    pub fn poll_requested(&self, cx: &mut Context<'_>) -> Poll<()> {
        let old = {
            let mut slot = lock(&self.waker);
            match &*slot {
                Some(current) if current.will_wake(cx.waker()) => None,
                _ => slot.replace(cx.waker().clone()),
            }
        };
        // Dropped outside the lock: a waker's drop may run arbitrary code.
        drop(old);
        if self.is_requested() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    /// Returns `true` once shutdown has been requested.
    #[must_use]
    pub fn is_requested(&self) -> bool {
        self.requested.load(Ordering::SeqCst)
    }

    /// Returns `true` once shutdown has been requested with `abort`.
    #[must_use]
    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }
}

impl Default for ShutdownSignal {
    fn default() -> Self {
        Self::new()
    }
}

/// Locks `mutex`, ignoring poisoning: no critical section here leaves the slot inconsistent if it
/// unwinds.
fn lock<U>(mutex: &Mutex<U>) -> MutexGuard<'_, U> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
