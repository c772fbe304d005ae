//! Unit tests for `Mailbox` on std primitives (the loom models are in `loom-tests/`).
//!
//! Kept out of `mailbox.rs` itself so they never get compiled into the loom crate.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, Wake, Waker};
use std::thread;

use super::Mailbox;

struct CountingWaker(AtomicUsize);

impl Wake for CountingWaker {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn counting_waker() -> (Waker, Arc<CountingWaker>) {
    let counter = Arc::new(CountingWaker(AtomicUsize::new(0)));
    (Waker::from(counter.clone()), counter)
}

fn wakes(counter: &CountingWaker) -> usize {
    counter.0.load(Ordering::SeqCst)
}

fn poll<T>(mb: &Mailbox<T>, waker: &Waker) -> Poll<()> {
    mb.poll_nonempty(&mut Context::from_waker(waker))
}

#[test]
fn push_then_drain_is_fifo() {
    let mb = Mailbox::new();
    assert!(mb.is_empty());
    for i in 0..5 {
        mb.push(i).unwrap();
    }
    assert!(!mb.is_empty());
    let mut out = Vec::new();
    assert_eq!(mb.drain_into(&mut out), 5);
    assert_eq!(out, [0, 1, 2, 3, 4]);
    assert!(mb.is_empty());
    assert_eq!(mb.drain_into(&mut out), 0);
    assert_eq!(out.len(), 5);
}

#[test]
fn drain_appends_to_non_empty_out() {
    let mb = Mailbox::new();
    mb.push(3).unwrap();
    mb.push(4).unwrap();
    let mut out = vec![1, 2];
    assert_eq!(mb.drain_into(&mut out), 2);
    assert_eq!(out, [1, 2, 3, 4]);
}

#[test]
fn drain_recycles_the_callers_buffer() {
    let mb = Mailbox::new();
    let mut out: Vec<u64> = Vec::with_capacity(64);
    mb.push(1).unwrap();
    mb.drain_into(&mut out);
    out.clear();
    // The mailbox now holds `out`'s old allocation; this one came from the first push.
    mb.push(2).unwrap();
    mb.drain_into(&mut out);
    assert!(
        out.capacity() >= 64,
        "the 64-slot buffer should come back to the owner"
    );
    assert_eq!(out, [2]);
}

#[test]
fn close_rejects_later_pushes_but_keeps_queued_items() {
    let mb = Mailbox::new();
    mb.push("a").unwrap();
    assert!(!mb.is_closed());
    mb.close();
    assert!(mb.is_closed());
    assert_eq!(mb.push("b"), Err("b"));
    let mut out = Vec::new();
    assert_eq!(mb.drain_into(&mut out), 1);
    assert_eq!(out, ["a"]);
    mb.close(); // idempotent
    assert_eq!(mb.push("c"), Err("c"));
}

#[test]
fn parked_owner_is_woken_once_per_registration() {
    let mb = Mailbox::new();
    let (waker, counter) = counting_waker();
    assert_eq!(poll(&mb, &waker), Poll::Pending);
    mb.push(1).unwrap();
    assert_eq!(wakes(&counter), 1);
    mb.push(2).unwrap(); // waker was taken by the first wake: no second syscall
    assert_eq!(wakes(&counter), 1);
    assert_eq!(poll(&mb, &waker), Poll::Ready(()));
    let mut out = Vec::new();
    mb.drain_into(&mut out);
    assert_eq!(poll(&mb, &waker), Poll::Pending); // re-registers
    mb.push(3).unwrap();
    assert_eq!(wakes(&counter), 2);
}

#[test]
fn registration_replaces_previous_waker() {
    let mb = Mailbox::new();
    let (first, first_count) = counting_waker();
    let (second, second_count) = counting_waker();
    assert_eq!(poll(&mb, &first), Poll::Pending);
    assert_eq!(poll(&mb, &second), Poll::Pending);
    mb.push(()).unwrap();
    assert_eq!(wakes(&first_count), 0);
    assert_eq!(wakes(&second_count), 1);
}

#[test]
fn push_without_waker_does_not_panic() {
    let mb = Mailbox::new();
    mb.push(1).unwrap();
    mb.begin_busy_poll();
    mb.end_busy_poll();
    assert!(!mb.is_empty());
}

#[test]
fn busy_poll_suppresses_wakes_and_hands_over_on_end() {
    let mb = Mailbox::new();
    let (waker, counter) = counting_waker();
    assert_eq!(poll(&mb, &waker), Poll::Pending);
    mb.begin_busy_poll();
    mb.push(1).unwrap();
    mb.push(2).unwrap();
    assert_eq!(wakes(&counter), 0);
    mb.end_busy_poll();
    assert_eq!(wakes(&counter), 1);
}

#[test]
fn busy_poll_end_after_draining_does_not_wake() {
    let mb = Mailbox::new();
    let (waker, counter) = counting_waker();
    assert_eq!(poll(&mb, &waker), Poll::Pending);
    mb.begin_busy_poll();
    mb.push(1).unwrap();
    let mut out = Vec::new();
    mb.drain_into(&mut out);
    mb.end_busy_poll();
    assert_eq!(wakes(&counter), 0);
    assert_eq!(out, [1]);
}

#[test]
fn nested_busy_polls_only_last_end_hands_over() {
    let mb = Mailbox::new();
    let (waker, counter) = counting_waker();
    assert_eq!(poll(&mb, &waker), Poll::Pending);
    mb.begin_busy_poll();
    mb.begin_busy_poll();
    mb.push(1).unwrap();
    mb.end_busy_poll();
    assert_eq!(wakes(&counter), 0, "a poller is still spinning");
    mb.push(2).unwrap();
    assert_eq!(wakes(&counter), 0);
    mb.end_busy_poll();
    assert_eq!(wakes(&counter), 1);
    // No busy poller any more: pushes wake again (after re-registration).
    let mut out = Vec::new();
    mb.drain_into(&mut out);
    assert_eq!(poll(&mb, &waker), Poll::Pending);
    mb.push(3).unwrap();
    assert_eq!(wakes(&counter), 2);
}

#[test]
fn close_wakes_parked_owner() {
    let mb = Mailbox::<u8>::new();
    let (waker, counter) = counting_waker();
    assert_eq!(poll(&mb, &waker), Poll::Pending);
    mb.close();
    assert_eq!(wakes(&counter), 1);
    assert_eq!(
        poll(&mb, &waker),
        Poll::Pending,
        "closed but empty stays Pending"
    );
}

/// Real threads: several producers, one owner that parks on a thread-unparking waker between
/// batches and busy-polls some of the time. Everything arrives, once, FIFO per producer.
#[test]
fn threaded_producers_single_owner() {
    struct Unpark(thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }

    const PRODUCERS: usize = 4;
    const PER_PRODUCER: usize = 20_000;

    fn take(
        mb: &Mailbox<(usize, usize)>,
        batch: &mut Vec<(usize, usize)>,
        next: &mut [usize; PRODUCERS],
    ) -> usize {
        let n = mb.drain_into(batch);
        for (p, i) in batch.drain(..) {
            assert_eq!(i, next[p], "producer {p} out of order");
            next[p] += 1;
        }
        n
    }

    let mb = Arc::new(Mailbox::new());
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|p| {
            let mb = mb.clone();
            thread::spawn(move || {
                for i in 0..PER_PRODUCER {
                    mb.push((p, i)).unwrap();
                }
            })
        })
        .collect();

    let waker = Waker::from(Arc::new(Unpark(thread::current())));
    let mut next = [0usize; PRODUCERS];
    let mut received = 0;
    let mut batch = Vec::new();
    let mut round = 0u32;
    while received < PRODUCERS * PER_PRODUCER {
        round = round.wrapping_add(1);
        if round % 2 == 0 {
            // Busy poll for a little while.
            mb.begin_busy_poll();
            for _ in 0..100 {
                received += take(&mb, &mut batch, &mut next);
            }
            mb.end_busy_poll();
        } else if poll(&mb, &waker).is_pending() {
            thread::park();
        }
        received += take(&mb, &mut batch, &mut next);
    }
    for p in producers {
        p.join().unwrap();
    }
    assert!(mb.is_empty());
    assert_eq!(next, [PER_PRODUCER; PRODUCERS]);
}
