//! Loom models of the gate of a rank's shared-memory arena (transports/src/shm/arena.rs): one
//! lease at a time, taken without waiting, and handed over so that everything the last holder
//! did to the arena happens before anything the next holder does. The arena is a
//! `loom::cell::UnsafeCell`, so an access not ordered after the previous holder's fails the
//! model with a causality violation.
//!
//! Run: `LOOM_MAX_PREEMPTIONS=3 cargo test -p loom-tests --release`. See README.md.

use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::thread;
use loom_tests::arena_api::ArenaGate;
use loom_tests::harness::model;

/// A rank's arena and its gate; `holders` counts leases that exist, to check there is never
/// more than one.
struct Arena {
    gate: ArenaGate,
    bytes: UnsafeCell<u64>,
    holders: AtomicUsize,
}

/// What one user does with the arena if it gets it: writes its mark over what the last holder
/// left. Returns whether it got the arena.
fn use_once(arena: &Arena, mark: u64) -> bool {
    if !arena.gate.try_take() {
        return false;
    }
    assert_eq!(
        arena.holders.fetch_add(1, Ordering::Relaxed),
        0,
        "two leases"
    );
    // SAFETY (loom-checked): the gate orders this after the previous holder's accesses.
    arena.bytes.with_mut(|b| unsafe {
        assert!(*b == 0 || *b == 1 || *b == 2, "torn arena");
        *b = mark;
    });
    arena.holders.fetch_sub(1, Ordering::Relaxed);
    arena.gate.give_back();
    true
}

/// Two collectives of one rank (two tasks, on two threads) try to lease the arena at once,
/// then once more: at most one holds it at any time, each one's accesses are ordered after the
/// last holder's, and the arena is free again at the end.
#[test]
fn one_lease_at_a_time_and_each_after_the_last() {
    model(|| {
        let arena = Arc::new(Arena {
            gate: ArenaGate::new(),
            bytes: UnsafeCell::new(0),
            holders: AtomicUsize::new(0),
        });
        let other = arena.clone();
        let t = thread::spawn(move || {
            let first = use_once(&other, 1);
            let second = use_once(&other, 1);
            (first, second)
        });
        use_once(&arena, 2);
        use_once(&arena, 2);
        t.join().unwrap();
        assert!(arena.gate.try_take(), "the arena is free at the end");
    });
}
