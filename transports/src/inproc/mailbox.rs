//! A rank's in-process mailbox: many producers push, the owning rank drains in batches.
//!
//! Every in-process rank owns one [`Mailbox`]. Other ranks' threads [`push`](Mailbox::push)
//! frames into it; the owner moves everything queued out in one
//! [`drain_into`](Mailbox::drain_into) (a vector swap under the lock).
//!
//! # Doorbell
//!
//! The owner's progress task parks on [`poll_nonempty`](Mailbox::poll_nonempty) and must be
//! woken when an item arrives. While at least one of the owner's futures busy-polls the mailbox
//! (between [`begin_busy_poll`](Mailbox::begin_busy_poll) and
//! [`end_busy_poll`](Mailbox::end_busy_poll)) pushes do not wake anybody: a wake-up is a
//! cross-thread syscall and the spinning future will see the item anyway. The last busy poller
//! to stop hands over: if items are queued when it stops, it wakes the registered waker.
//!
//! # Why no wake-up is lost
//!
//! Three handshakes, each between a pusher and someone who writes a flag and then looks for
//! items; both sides go through the queue's mutex, so the push costs no fence:
//!
//! | side        | does                                                     |
//! |-------------|----------------------------------------------------------|
//! | pusher      | locks, queues the item, unlocks; then reads `registered` and `busy` |
//! | last poller | writes `busy` (decrement to 0); then looks at the queue under the lock |
//! | parker      | writes `registered` (waker stored); then looks at the queue under the lock |
//! | closer      | sets `closed` under the lock; then reads `registered` (the parker reads `closed` after its look) |
//!
//! The two critical sections are ordered by the mutex. If the pusher's comes first, the
//! poller's / parker's look under the lock sees the item. If the other's comes first, its flag
//! write happens before its unlock, hence before the pusher's lock and the pusher's reads after
//! it: the pusher sees `busy == 0` and a registered waker and wakes it. The flags themselves are
//! accessed `Relaxed`; all the ordering comes from the lock. (Before, each side issued a
//! `fence(SeqCst)` between its write and its read; the pusher's fence, on every frame, was the
//! dearest instruction of the in-process send path. The owner's looks under the lock happen once
//! per park or per busy-poll burst.)
//!
//! The pusher reads `registered` first: while nobody is parked (a busy rank) it does not touch
//! `busy`'s cache line at all.
//!
//! A pusher that wakes *takes* the waker out of the slot, so each registration costs at most
//! one wake-up; the owner re-registers the next time it parks.
//!
//! This file is also compiled by the `loom-tests` crate against loom's primitives, so it must
//! take every synchronization primitive from `crate::sync` and nothing else from its crate.

use std::fmt;
use std::mem;
use std::task::{Context, Poll, Waker};

use crate::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use crate::sync::{Mutex, MutexGuard};

/// A multi-producer, single-consumer batch queue with a busy-poll-aware doorbell.
///
/// Any thread may [`push`](Self::push); only the owning rank should call
/// [`drain_into`](Self::drain_into), [`poll_nonempty`](Self::poll_nonempty) and the busy-poll
/// pair (the structure stays memory-safe and loses nothing if others do, but the wake-up
/// protocol assumes a single consumer).
// Aligned so that neighbouring mailboxes (ranks 0 and 1 write into each other's) never share a
// cache line.
#[repr(align(128))]
pub struct Mailbox<T> {
    /// Queued items, oldest first.
    queue: Mutex<Vec<T>>,
    /// Number of queued items. Written only while `queue` is locked (so it always equals the
    /// queue's length when the lock is free); read without the lock as an emptiness hint (the
    /// handshakes in the module docs look at the queue itself, under the lock).
    len: AtomicUsize,
    /// Set once by [`close`](Self::close), while `queue` is locked, so a push that holds the
    /// lock sees a consistent value.
    closed: AtomicBool,
    /// Number of busy pollers currently spinning on this mailbox. The owner writes it on every
    /// busy poll while pushers read it on pushes that find a waker registered: on a line of its
    /// own, so the owner's writes do not also steal the line the pushers lock and append
    /// through.
    busy: Padded<AtomicUsize>,
    /// The owner's parked waker, if any.
    waker: WakerSlot,
}

impl<T> Mailbox<T> {
    /// Creates an empty, open mailbox with no registered waker and no busy poller.
    #[must_use]
    pub fn new() -> Self {
        Self {
            queue: Mutex::new(Vec::new()),
            len: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
            busy: Padded(AtomicUsize::new(0)),
            waker: WakerSlot::new(),
        }
    }

    /// Enqueues `item` at the back of the queue.
    ///
    /// Returns `Err(item)` if the mailbox is closed. Otherwise, unless a busy poller is active,
    /// wakes the registered waker (if any). Without a wake-up this costs one lock, one vector
    /// push and one or two atomic loads: no fence, no syscall.
    ///
    /// # Errors
    ///
    /// `Err(item)`, giving the item back, if the mailbox has been [closed](Self::close).
    pub fn push(&self, item: T) -> Result<(), T> {
        {
            let mut queue = lock(&self.queue);
            if self.closed.load(Ordering::Relaxed) {
                return Err(item);
            }
            queue.push(item);
            self.len.store(queue.len(), Ordering::Relaxed);
        }
        // Handshake (see module docs): these loads come after our critical section, so they see
        // the flag of any parker or stopping poller whose look under the lock missed the item.
        if self.waker.registered.load(Ordering::Relaxed) && self.busy.load(Ordering::Relaxed) == 0 {
            self.waker.wake();
        }
        Ok(())
    }

    /// Moves every queued item to the end of `out`, oldest first, and returns how many.
    ///
    /// Swaps vectors under the lock, so the critical section is O(1). If `out` is empty, its
    /// allocation is handed to the mailbox for the next pushes (no reallocation in steady
    /// state). Returns 0 without locking if the mailbox looks empty.
    pub fn drain_into(&self, out: &mut Vec<T>) -> usize {
        if self.len.load(Ordering::Relaxed) == 0 {
            return 0;
        }
        let reuse = out.is_empty();
        let mut batch = if reuse { mem::take(out) } else { Vec::new() };
        {
            let mut queue = lock(&self.queue);
            mem::swap(&mut *queue, &mut batch);
            self.len.store(0, Ordering::Relaxed);
        }
        let n = batch.len();
        if reuse {
            *out = batch;
        } else {
            out.append(&mut batch);
        }
        n
    }

    /// Returns `true` if no item is queued (one atomic load, no lock).
    ///
    /// From a thread other than the owner's this is only a snapshot.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len.load(Ordering::Relaxed) == 0
    }

    /// Returns `Ready` if items are queued; otherwise registers `cx`'s waker (replacing any
    /// previously registered one) and returns `Pending`.
    ///
    /// The waker is registered *before* the final emptiness check, so an item pushed
    /// concurrently is either seen here or wakes the registered waker. If items are already
    /// queued on entry it returns `Ready` at once without touching the waker slot.
    ///
    /// Closing does not make this `Ready` (an empty closed mailbox stays `Pending`), but
    /// [`close`](Self::close) wakes the registered waker: an owner that must notice closure
    /// should check [`is_closed`](Self::is_closed) *after* getting `Pending` here, and then it
    /// cannot miss a concurrent close either.
    pub fn poll_nonempty(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.len.load(Ordering::Relaxed) != 0 {
            return Poll::Ready(());
        }
        self.waker.register(cx.waker());
        // Handshake (see module docs): look under the lock after registering, so a pusher or
        // closer either ran its critical section first (we see its item here, or its `closed`
        // in the caller's later `is_closed`) or sees our registration.
        if self.has_items_locked() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    /// Whether items are queued, looked at under the queue's lock (the owner's side of the
    /// handshakes in the module docs).
    fn has_items_locked(&self) -> bool {
        !lock(&self.queue).is_empty()
    }

    /// Marks the start of a busy poll: until the matching [`end_busy_poll`](Self::end_busy_poll),
    /// pushes do not wake the registered waker. Calls nest (it is a counter).
    pub fn begin_busy_poll(&self) {
        // Relaxed suffices: a pusher that reads a non-zero count is covered by the handshake of
        // whichever poller later brings the count back to zero.
        self.busy.fetch_add(1, Ordering::Relaxed);
    }

    /// Marks the end of a busy poll started by [`begin_busy_poll`](Self::begin_busy_poll).
    ///
    /// When the last busy poller stops and items are still queued, wakes the registered waker so
    /// nothing is left unprocessed (pushes during the busy poll did not wake it). Every call
    /// must match an earlier `begin_busy_poll`.
    pub fn end_busy_poll(&self) {
        let prev = self.busy.fetch_sub(1, Ordering::Relaxed);
        debug_assert!(prev != 0, "Mailbox::end_busy_poll without begin_busy_poll");
        if prev != 1 {
            // Another poller is still spinning: it will see the items, or hand over when it
            // stops (pushes that saw a non-zero count are covered by the last one's check).
            return;
        }
        // Handshake (see module docs): after the decrement, look under the lock, unless the
        // hint already shows items (if another of the owner's threads has just drained them,
        // that costs one spurious wake-up).
        if self.len.load(Ordering::Relaxed) != 0 || self.has_items_locked() {
            self.waker.wake();
        }
    }

    /// Closes the mailbox: later pushes fail with `Err(item)`; items already queued stay
    /// drainable. Wakes the registered waker so a parked owner notices. Idempotent.
    pub fn close(&self) {
        {
            let _queue = lock(&self.queue);
            self.closed.store(true, Ordering::Relaxed);
        }
        // Handshake with a parker that checks `is_closed` after `poll_nonempty` returned
        // Pending (see module docs): reading `registered` after our critical section.
        self.waker.wake();
    }

    /// Returns `true` once [`close`](Self::close) has been called.
    #[must_use]
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Relaxed)
    }
}

impl<T> Default for Mailbox<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> fmt::Debug for Mailbox<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mailbox")
            .field("len", &self.len.load(Ordering::Relaxed))
            .field("busy", &self.busy.load(Ordering::Relaxed))
            .field("closed", &self.closed.load(Ordering::Relaxed))
            .field("registered", &self.waker.registered.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// A waker slot registered by one owner and taken-and-woken by any thread.
///
/// `registered` mirrors `waker.is_some()` (written only with the lock held) so that wakers skip
/// the lock when nothing is registered.
/// A value alone on its cache lines (128 bytes: x86 fetches adjacent lines in pairs).
#[repr(align(128))]
struct Padded<T>(T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}

struct WakerSlot {
    waker: Mutex<Option<Waker>>,
    registered: AtomicBool,
}

impl WakerSlot {
    fn new() -> Self {
        Self {
            waker: Mutex::new(None),
            registered: AtomicBool::new(false),
        }
    }

    /// Stores a clone of `waker`, replacing the previous one. The caller must then check its
    /// wake-up condition under the queue's lock.
    fn register(&self, waker: &Waker) {
        let old = {
            let mut slot = lock(&self.waker);
            let old = match &*slot {
                Some(current) if current.will_wake(waker) => None,
                _ => slot.replace(waker.clone()),
            };
            self.registered.store(true, Ordering::Relaxed);
            old
        };
        // Dropped outside the lock: a waker's drop may run arbitrary code.
        drop(old);
    }

    /// Takes the registered waker, if any, and wakes it. The caller must have published the
    /// condition the waker waits for in a critical section of the queue's lock.
    fn wake(&self) {
        if !self.registered.load(Ordering::Relaxed) {
            return;
        }
        let waker = {
            let mut slot = lock(&self.waker);
            self.registered.store(false, Ordering::Relaxed);
            slot.take()
        };
        // Woken outside the lock: `wake` may run arbitrary code (even re-register).
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

/// Locks `mutex`, ignoring poisoning: no critical section here leaves the data inconsistent if
/// it unwinds.
fn lock<U>(mutex: &Mutex<U>) -> MutexGuard<'_, U> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
#[path = "mailbox_tests.rs"]
mod tests;
