//! Loom models of the driver's shutdown handshake, `ShutdownSignal`
//! (core/src/runtime/shutdown.rs): the last communicator of a rank requests shutdown from any
//! thread while the rank's progress task polls the signal.
//!
//! Run: `LOOM_MAX_PREEMPTIONS=3 cargo test -p loom-tests --release`. See README.md.

use std::future::poll_fn;
use std::task::Context;

use loom::sync::Arc;
use loom::thread;
use loom_tests::harness::{counting_waker, model};
use loom_tests::shutdown::ShutdownSignal;

/// Spawns a thread that requests shutdown (with `abort`) on `sig`.
fn spawn_request(sig: &Arc<ShutdownSignal>, abort: bool) -> thread::JoinHandle<()> {
    let sig = sig.clone();
    thread::spawn(move || sig.request(abort))
}

/// (1) No lost request: the progress task registers its waker and checks the flag
/// (`poll_requested`) while another thread requests shutdown. Either the task saw the request,
/// or its waker was woken; and it is woken at most once (the requester takes the waker).
#[test]
fn request_vs_poll_no_lost_wakeup() {
    model(|| {
        let sig = Arc::new(ShutdownSignal::new());
        let requester = spawn_request(&sig, false);
        let (waker, counter) = counting_waker();
        let ready = sig
            .poll_requested(&mut Context::from_waker(&waker))
            .is_ready();
        requester.join().unwrap();
        assert!(
            ready || counter.wakes() == 1,
            "task parked without seeing the request and nobody woke it"
        );
        assert!(counter.wakes() <= 1, "one registration woken twice");
        assert!(sig.is_requested());
        assert!(!sig.is_aborted());
    });
}

/// (1, re-registration) The task polls twice with different wakers, as the progress loop does
/// each time round, while a request races both polls. The *latest* registration counts: the
/// second poll sees the request or the second waker is woken (a request between the polls takes
/// the first waker, and then the second poll sees the flag).
#[test]
fn request_vs_repoll_wakes_latest_waker() {
    model(|| {
        let sig = Arc::new(ShutdownSignal::new());
        let requester = spawn_request(&sig, false);
        let (first, first_counter) = counting_waker();
        let (second, second_counter) = counting_waker();
        let _ = sig.poll_requested(&mut Context::from_waker(&first));
        let ready = sig
            .poll_requested(&mut Context::from_waker(&second))
            .is_ready();
        requester.join().unwrap();
        assert!(
            ready || second_counter.wakes() == 1,
            "task parked on its latest waker without seeing the request and nobody woke it"
        );
        assert!(first_counter.wakes() + second_counter.wakes() <= 1);
    });
}

/// (1, liveness) The task really blocks (loom's `block_on`) until `poll_requested` is ready
/// while another thread requests shutdown: a lost request would be a deadlock, which loom
/// reports.
#[test]
fn task_blocks_until_requested() {
    model(|| {
        let sig = Arc::new(ShutdownSignal::new());
        let requester = spawn_request(&sig, false);
        loom::future::block_on(poll_fn(|cx| sig.poll_requested(cx)));
        assert!(sig.is_requested());
        requester.join().unwrap();
    });
}

/// (2) An abort is set together with the shutdown request: a task that sees the request, by
/// `poll_requested` or by `is_requested`, concurrently with `request(true)`, also sees the abort
/// (it stops at once instead of draining pending sends). Also woken by the abort if it missed it.
#[test]
fn abort_observed_with_request() {
    model(|| {
        let sig = Arc::new(ShutdownSignal::new());
        let requester = spawn_request(&sig, true);
        let (waker, counter) = counting_waker();
        let ready = sig
            .poll_requested(&mut Context::from_waker(&waker))
            .is_ready();
        if ready {
            assert!(
                sig.is_aborted(),
                "poll_requested saw the request but not its abort"
            );
        }
        if sig.is_requested() {
            assert!(
                sig.is_aborted(),
                "is_requested saw the request but not its abort"
            );
        }
        requester.join().unwrap();
        assert!(ready || counter.wakes() == 1, "abort request lost");
        assert!(sig.is_requested() && sig.is_aborted());
    });
}

/// (2, negative) Without `abort`, nobody ever sees an abort.
#[test]
fn plain_request_never_aborts() {
    model(|| {
        let sig = Arc::new(ShutdownSignal::new());
        let requester = spawn_request(&sig, false);
        let (waker, _counter) = counting_waker();
        let _ = sig.poll_requested(&mut Context::from_waker(&waker));
        assert!(!sig.is_aborted());
        requester.join().unwrap();
        assert!(sig.is_requested() && !sig.is_aborted());
    });
}

/// (3) Repeated requests are idempotent: two threads request shutdown while the task blocks on
/// the signal; the task wakes up (no deadlock), one registration is woken at most once, and the
/// signal stays requested (a fresh poll is ready at once). One of the two requests aborts: the
/// abort is never undone by the other, whatever their order.
#[test]
fn repeated_requests_idempotent() {
    model(|| {
        let sig = Arc::new(ShutdownSignal::new());
        let requesters = [spawn_request(&sig, false), spawn_request(&sig, true)];
        loom::future::block_on(poll_fn(|cx| sig.poll_requested(cx)));
        for r in requesters {
            r.join().unwrap();
        }
        assert!(sig.is_requested());
        assert!(sig.is_aborted(), "a later plain request undid the abort");
        let (waker, counter) = counting_waker();
        assert!(
            sig.poll_requested(&mut Context::from_waker(&waker))
                .is_ready()
        );
        assert_eq!(counter.wakes(), 0);
    });
}

/// (3, same thread) Requesting again after the task registered: the first request takes and
/// wakes the waker once, the second finds the slot empty; the task, polling concurrently, sees
/// the request or is woken exactly once.
#[test]
fn repeated_requests_wake_once() {
    model(|| {
        let sig = Arc::new(ShutdownSignal::new());
        let requester = {
            let sig = sig.clone();
            thread::spawn(move || {
                sig.request(false);
                sig.request(false);
            })
        };
        let (waker, counter) = counting_waker();
        let ready = sig
            .poll_requested(&mut Context::from_waker(&waker))
            .is_ready();
        requester.join().unwrap();
        assert!(ready || counter.wakes() == 1);
        assert!(counter.wakes() <= 1, "one registration woken twice");
        assert!(sig.is_requested() && !sig.is_aborted());
    });
}
