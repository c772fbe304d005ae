//! [`SpinLock`]: a lock for short critical sections on the message path, rarely contended.
//!
//! A rank's engine state (the driver's), a shared-memory pair's sending side and a rank's set of
//! receiving rings sit behind one each, and every small message takes several of them. A
//! `std::sync::Mutex` pays an atomic read-modify-write to lock *and* another to unlock (it must
//! learn whether a thread sleeps on it), about 12 cycles each here; here unlocking is a plain
//! `Release` store, which halves what the locks cost a message.
//!
//! A thread that finds the lock held spins a little and then yields to the scheduler until it
//! is free: the holders' critical sections are short (a ring write or read, a batch of frames
//! handed to the protocol engine), so nobody sleeps, and nothing needs waking. A panic while
//! the lock is held releases it (the guard's drop); there is no poisoning, as in `parking_lot`.
//!
//! The loom model in `loom-tests/tests/spin_lock.rs` compiles this file against loom's atomics
//! and cells.

use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};

use crate::sync::atomic::{AtomicBool, Ordering};
use crate::sync::cell::{MutPtr, UnsafeCell};
use crate::sync::{hint, thread};

/// Polls of a held lock before each yield to the scheduler.
const SPINS_BEFORE_YIELD: u32 = 64;

/// Mutual exclusion with a plain store to unlock.
pub struct SpinLock<T> {
    locked: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the lock hands out access to `value` to one thread at a time (the `Acquire`
// compare-exchange that takes it synchronizes with the `Release` store that gave it up), so
// sharing the lock shares `T` only by moving exclusive access between threads: `T: Send`
// suffices, as for `Mutex`.
unsafe impl<T: Send> Sync for SpinLock<T> {}
// SAFETY: owning the lock is owning the `T`.
unsafe impl<T: Send> Send for SpinLock<T> {}

impl<T> SpinLock<T> {
    /// An unlocked lock around `value`.
    pub fn new(value: T) -> SpinLock<T> {
        SpinLock {
            locked: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    /// Takes the lock if it is free.
    pub fn try_lock(&self) -> Option<SpinLockGuard<'_, T>> {
        if !self.acquire() {
            return None;
        }
        Some(self.guard())
    }

    /// Takes the lock, spinning and then yielding while another thread holds it.
    pub fn lock(&self) -> SpinLockGuard<'_, T> {
        let mut spins = 0;
        // Read-modify-writes, not loads, while waiting: waiting is rare, and one always sees
        // the latest value (loom explores loads that keep seeing a stale one).
        while !self.acquire() {
            spins += 1;
            if spins % SPINS_BEFORE_YIELD == 0 {
                thread::yield_now();
            } else {
                hint::spin_loop();
            }
        }
        self.guard()
    }

    /// One attempt to take the lock: a `compare_exchange`, which costs a `swap`'s price and
    /// writes nothing when it fails. (With a `swap`, loom 0.7 lets a failed attempt's write of
    /// `true` land after the holder's release, leaving the lock held by nobody in the model;
    /// see `loom-tests/README.md` on read-modify-writes.)
    fn acquire(&self) -> bool {
        self.locked
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }

    fn guard(&self) -> SpinLockGuard<'_, T> {
        SpinLockGuard {
            lock: self,
            value: ManuallyDrop::new(self.value.get_mut()),
        }
    }
}

impl<T: Default> Default for SpinLock<T> {
    fn default() -> Self {
        SpinLock::new(T::default())
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for SpinLock<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.try_lock() {
            Some(guard) => f.debug_tuple("SpinLock").field(&*guard).finish(),
            None => f.write_str("SpinLock(<locked>)"),
        }
    }
}

/// Access to a [`SpinLock`]'s value; unlocks when dropped.
pub struct SpinLockGuard<'a, T> {
    lock: &'a SpinLock<T>,
    /// Dropped before the lock is released (the loom build tracks the access it stands for).
    value: ManuallyDrop<MutPtr<T>>,
}

impl<T> Deref for SpinLockGuard<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        // SAFETY: the guard holds the lock, so no other thread touches the value while it
        // lives, and the pointer came from the lock's cell, which outlives the guard.
        unsafe { MutPtr::deref(&self.value) }
    }
}

impl<T> DerefMut for SpinLockGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`; `&mut self` makes this the only reference the guard gives out.
        unsafe { MutPtr::deref(&self.value) }
    }
}

impl<T> Drop for SpinLockGuard<'_, T> {
    fn drop(&mut self) {
        // SAFETY: dropped once, here, and not used again: the guard is going away.
        unsafe { ManuallyDrop::drop(&mut self.value) };
        // Publishes the guard's writes to the next holder (its `Acquire` compare-exchange).
        self.lock.locked.store(false, Ordering::Release);
    }
}
