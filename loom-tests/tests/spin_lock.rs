//! Loom models of `SpinLock` (core/src/spin_lock.rs), the lock of the driver and of the
//! shared-memory transport: taken with an `Acquire` compare-exchange and given up with a plain
//! `Release` store.
//!
//! The guarded values are plain integers in the lock's cell, which loom checks: two holders at
//! once, or a holder that does not see the previous holder's writes, fail the model.
//!
//! The threads take the lock with `try_lock`, once each: loom cannot explore a thread that
//! waits without bound (`SpinLock::lock` is `try_lock`'s compare-exchange, repeated until it
//! succeeds), and every interleaving of single attempts covers what a wait can meet: a free
//! lock, a held one, one just released.
//!
//! Run: `LOOM_MAX_PREEMPTIONS=3 cargo test -p loom-tests --release`. See README.md.

use loom::sync::Arc;
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::thread;
use loom_tests::harness::model;
use loom_tests::spin_lock_api::SpinLock;

/// (1) Mutual exclusion and visibility: threads that get the lock add to the guarded counter
/// in two steps (read, then write). No update is lost: each holder saw the previous one's.
#[test]
fn holders_exclude_each_other_and_see_earlier_writes() {
    model(|| {
        let lock = Arc::new(SpinLock::new(0u32));
        let acquired = Arc::new(AtomicUsize::new(0));
        let attempt = |lock: &SpinLock<u32>, acquired: &AtomicUsize| {
            let got = lock.with_try_lock(|n| {
                let seen = *n;
                *n = seen + 1;
            });
            if got.is_some() {
                acquired.fetch_add(1, Ordering::Relaxed);
            }
        };
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let (lock, acquired) = (lock.clone(), acquired.clone());
                thread::spawn(move || attempt(&lock, &acquired))
            })
            .collect();
        attempt(&lock, &acquired);
        for t in threads {
            t.join().unwrap();
        }
        let n = acquired.load(Ordering::Relaxed);
        assert!(n >= 1, "the first attempt finds the lock free");
        assert_eq!(lock.with_lock(|v| *v), n as u32);
    });
}

/// (2) A try fails only while another thread holds the lock: after the holder released it
/// (joined), a try succeeds and sees the holder's write.
#[test]
fn released_lock_is_free_and_carries_the_write() {
    model(|| {
        let lock = Arc::new(SpinLock::new(0u32));
        let holder = {
            let lock = lock.clone();
            thread::spawn(move || lock.with_try_lock(|n| *n = 7).is_some())
        };
        let mine = lock.with_try_lock(|n| *n);
        let theirs = holder.join().unwrap();
        // One of the two found it free (the first to take it), perhaps both (one after the other).
        assert!(mine.is_some() || theirs);
        // Before the holder's write, or after it: never anything else.
        assert!(matches!(mine, None | Some(0) | Some(7)), "{mine:?}");
        let expected = if theirs { 7 } else { 0 };
        assert_eq!(lock.with_try_lock(|n| *n), Some(expected));
    });
}
