//! Loom models of the in-process transport's `Mailbox` (transports/src/inproc/mailbox.rs).
//!
//! Run: `LOOM_MAX_PREEMPTIONS=3 cargo test -p loom-tests --release`. See README.md.

use std::future::poll_fn;
use std::task::Context;

use loom::sync::Arc;
use loom::thread;
use loom_tests::harness::{counting_waker, model};
use loom_tests::mailbox::Mailbox;

/// (1) No lost wake-up when the owner parks: the owner registers its waker and checks for items
/// while a pusher pushes. Either the owner's check saw the item, or its waker was woken.
#[test]
fn park_vs_push_no_lost_wakeup() {
    model(|| {
        let mb = Arc::new(Mailbox::new());
        let pusher = {
            let mb = mb.clone();
            thread::spawn(move || mb.push(1u32).unwrap())
        };
        let (waker, counter) = counting_waker();
        let ready = mb
            .poll_nonempty(&mut Context::from_waker(&waker))
            .is_ready();
        pusher.join().unwrap();
        assert!(
            ready || counter.wakes() >= 1,
            "owner parked with an item queued and nobody woke it"
        );
        let mut out = Vec::new();
        assert_eq!(mb.drain_into(&mut out), 1);
        assert_eq!(out, [1]);
    });
}

/// (1b) The same as a liveness property: the owner really blocks (loom's `block_on`) until
/// `poll_nonempty` is ready, then drains, until it has both pushers' items. A lost wake-up is
/// a deadlock, which loom reports. Also exercises take-and-re-register of the waker.
#[test]
fn park_until_items_arrive() {
    model(|| {
        let mb = Arc::new(Mailbox::new());
        let pushers: Vec<_> = (0..2u32)
            .map(|id| {
                let mb = mb.clone();
                thread::spawn(move || mb.push(id).unwrap())
            })
            .collect();
        let mut out = Vec::new();
        while out.len() < 2 {
            loom::future::block_on(poll_fn(|cx| mb.poll_nonempty(cx)));
            assert!(mb.drain_into(&mut out) > 0, "Ready but nothing to drain");
        }
        for p in pushers {
            p.join().unwrap();
        }
        out.sort_unstable();
        assert_eq!(out, [0, 1]);
        assert!(mb.is_empty());
    });
}

/// (2) Busy-poll handoff: the progress task is parked (waker registered); an owner future
/// busy-polls (begin, drain, end) while a pusher pushes. The item must be drained by the busy
/// poller or the parked waker must have been woken (the only wake sources are the push itself
/// and `end_busy_poll` seeing the item, so a wake here always comes after the push).
#[test]
fn busy_poll_handoff() {
    model(|| {
        let mb = Arc::new(Mailbox::new());
        let (waker, counter) = counting_waker();
        assert!(
            mb.poll_nonempty(&mut Context::from_waker(&waker))
                .is_pending()
        );
        let pusher = {
            let mb = mb.clone();
            thread::spawn(move || mb.push(7u32).unwrap())
        };
        mb.begin_busy_poll();
        let mut out = Vec::new();
        mb.drain_into(&mut out);
        mb.end_busy_poll();
        pusher.join().unwrap();
        assert!(
            out == [7] || counter.wakes() >= 1,
            "item left queued with the progress task asleep"
        );
        mb.drain_into(&mut out);
        assert_eq!(out, [7]);
    });
}

/// (2b) Two busy pollers on different threads (nesting across threads) and a pusher: only the
/// last poller to stop checks for leftovers; the item must still be drained or the parked waker
/// woken.
#[test]
fn busy_poll_handoff_two_pollers() {
    model(|| {
        let mb = Arc::new(Mailbox::new());
        let (waker, counter) = counting_waker();
        assert!(
            mb.poll_nonempty(&mut Context::from_waker(&waker))
                .is_pending()
        );
        let pusher = {
            let mb = mb.clone();
            thread::spawn(move || mb.push(7u32).unwrap())
        };
        let other_poller = {
            let mb = mb.clone();
            thread::spawn(move || {
                mb.begin_busy_poll();
                mb.end_busy_poll();
            })
        };
        mb.begin_busy_poll();
        let mut out = Vec::new();
        mb.drain_into(&mut out);
        mb.end_busy_poll();
        pusher.join().unwrap();
        other_poller.join().unwrap();
        assert!(
            out == [7] || counter.wakes() >= 1,
            "item left queued with the progress task asleep"
        );
    });
}

/// (2c) The hot path is wake-free: a push made entirely while a busy poller is active does not
/// wake the parked waker; the busy poller's `end_busy_poll` then hands the item over with
/// exactly one wake.
#[test]
fn busy_poll_suppresses_wakeups() {
    model(|| {
        let mb = Arc::new(Mailbox::new());
        let (waker, counter) = counting_waker();
        assert!(
            mb.poll_nonempty(&mut Context::from_waker(&waker))
                .is_pending()
        );
        mb.begin_busy_poll();
        let pusher = {
            let mb = mb.clone();
            thread::spawn(move || mb.push(1u32).unwrap())
        };
        pusher.join().unwrap();
        assert_eq!(
            counter.wakes(),
            0,
            "push woke the progress task during a busy poll"
        );
        mb.end_busy_poll();
        assert_eq!(
            counter.wakes(),
            1,
            "end_busy_poll did not hand the item over"
        );
    });
}

/// (3) Two pushers, two items each, while the owner drains concurrently: nothing lost, nothing
/// duplicated, FIFO per pusher.
#[test]
fn two_pushers_fifo() {
    model(|| {
        let mb = Arc::new(Mailbox::new());
        let pushers: Vec<_> = (0..2u32)
            .map(|id| {
                let mb = mb.clone();
                thread::spawn(move || {
                    mb.push((id, 0u32)).unwrap();
                    mb.push((id, 1u32)).unwrap();
                })
            })
            .collect();
        let mut out = Vec::new();
        mb.drain_into(&mut out);
        let mut second = Vec::new();
        mb.drain_into(&mut second); // maybe non-empty `out`: exercises the append path too
        out.append(&mut second);
        mb.drain_into(&mut out);
        for p in pushers {
            p.join().unwrap();
        }
        mb.drain_into(&mut out);
        assert!(mb.is_empty());
        assert_eq!(out.len(), 4, "lost or duplicated items: {out:?}");
        for id in 0..2 {
            let seqs: Vec<u32> = out
                .iter()
                .filter(|(p, _)| *p == id)
                .map(|&(_, s)| s)
                .collect();
            assert_eq!(seqs, [0, 1], "pusher {id} out of order: {out:?}");
        }
    });
}

/// (4) Close vs push: every item is either drained (exactly once) or handed back as `Err`;
/// once a push fails every later push fails; accepted items keep their order.
#[test]
fn close_vs_push() {
    model(|| {
        let mb = Arc::new(Mailbox::new());
        let pusher = {
            let mb = mb.clone();
            thread::spawn(move || (mb.push(1u32), mb.push(2u32)))
        };
        let mut out = Vec::new();
        mb.drain_into(&mut out);
        mb.close();
        let (r1, r2) = pusher.join().unwrap();
        assert!(mb.is_closed());
        assert_eq!(mb.push(3), Err(3));
        mb.drain_into(&mut out);
        match (r1, r2) {
            (Ok(()), Ok(())) => assert_eq!(out, [1, 2]),
            (Ok(()), Err(2)) => assert_eq!(out, [1]),
            (Err(1), Err(2)) => assert!(out.is_empty()),
            other => panic!("impossible outcome {other:?} with drained {out:?}"),
        }
    });
}

/// (4b) Close wakes a parked owner: an owner that gets `Pending` from `poll_nonempty` and then
/// sees the mailbox still open can sleep, because a concurrent `close` is guaranteed to wake it.
#[test]
fn close_wakes_parked_owner() {
    model(|| {
        let mb = Arc::new(Mailbox::<u32>::new());
        let closer = {
            let mb = mb.clone();
            thread::spawn(move || mb.close())
        };
        let (waker, counter) = counting_waker();
        let pending = mb
            .poll_nonempty(&mut Context::from_waker(&waker))
            .is_pending();
        let would_sleep = pending && !mb.is_closed();
        closer.join().unwrap();
        assert!(
            !would_sleep || counter.wakes() >= 1,
            "owner went to sleep on a mailbox that was closed without waking it"
        );
    });
}
