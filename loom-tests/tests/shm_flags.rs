//! Loom models of how a rank waiting on shared-memory flags sleeps and is woken
//! (transports/src/shm/flags.rs with the doorbell of transports/src/shm/doorbell.rs). Three
//! parties: a peer raises a flag (a `Release` store into the rank's segment) and then asks the
//! doorbell `should_signal`; the rank's progress task arms its doorbell, looks whether a flag
//! changed (`FlagWatch::changed`, part of `has_work`), sleeps until signalled if none did, and
//! then drains (`FlagWatch::observe`, which wakes the parked waiters); a future waiting for the
//! flag looks at it, parks its waker (`FlagWatch::park`) and looks once more before it sleeps.
//!
//! Run: `LOOM_MAX_PREEMPTIONS=3 cargo test -p loom-tests --release`. See README.md.

//!
//! Both sleeps block for real (the progress task on a `loom::sync::Notify`, the future in
//! `loom::future::block_on`), so a lost wake-up is a deadlock, which loom reports.

use std::task::Poll;

use loom::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use loom::sync::{Arc, Notify};
use loom::thread;
use loom_tests::doorbell_api::Doorbell;
use loom_tests::flags_api::FlagWatch;
use loom_tests::harness::model;

/// One rank's doorbell, flag watch and the flag words its peers raise (by sender rank), and
/// the signals sent to it (the transport's datagrams, which stay pending until read: a
/// `Notify`'s permit), counted.
struct Rank {
    bell: Doorbell,
    watch: FlagWatch,
    flags: Vec<AtomicU64>,
    signal: Notify,
    signals: AtomicUsize,
}

impl Rank {
    fn new(senders: usize) -> Arc<Rank> {
        Arc::new(Rank {
            bell: Doorbell::new(),
            watch: FlagWatch::new(senders as u32),
            flags: (0..senders).map(|_| AtomicU64::new(0)).collect(),
            signal: Notify::new(),
            signals: AtomicUsize::new(0),
        })
    }

    /// The flag words by sender, as the segment hands them to the watch.
    fn words(&self) -> impl Iterator<Item = (u32, &AtomicU64)> {
        self.flags.iter().enumerate().map(|(r, w)| (r as u32, w))
    }

    /// Sender `k` raises its flag to `value` (`ShmRank::raise_flag`: store, then nudge).
    fn raise(&self, k: usize, value: u64) {
        self.flags[k].store(value, Ordering::Release);
        if self.bell.should_signal() {
            self.signals.fetch_add(1, Ordering::Relaxed);
            self.signal.notify();
        }
    }

    /// The waiting future's look: every flag at least `round`.
    fn all_raised(&self, round: u64) -> bool {
        self.flags
            .iter()
            .all(|f| f.load(Ordering::Acquire) >= round)
    }

    /// The progress task until it has drained with every flag at `round`: arm, look, sleep
    /// until signalled (or spuriously) if nothing changed, disarm, drain.
    fn progress(&self, round: u64) {
        loop {
            self.bell.arm();
            if !self.watch.changed(self.words()) {
                self.signal.wait();
            }
            self.bell.disarm();
            self.watch.observe(self.words(), false);
            // Done once a drain has noted every flag at `round` (and so woken the waiter). A
            // flag raised after the drain counts as changed, and the task goes round again.
            if self.all_raised(round) && !self.watch.changed(self.words()) {
                return;
            }
        }
    }

    /// The waiting future (`wait_for_flags` once its spin window is over): look, park, look
    /// again, else sleep until woken; until every flag is at `round`.
    fn wait(&self, round: u64) {
        loom::future::block_on(std::future::poll_fn(|cx| {
            if self.all_raised(round) {
                return Poll::Ready(());
            }
            self.watch.park(cx.waker());
            if self.all_raised(round) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        }))
    }
}

/// Runs `raise` on one thread and the progress task on another while this thread waits for
/// every flag of `rank` to reach `round`; returns once all three are done.
fn raise_and_wait(rank: Arc<Rank>, round: u64, raise: impl FnOnce(&Rank) + Send + 'static) {
    let raiser = {
        let rank = rank.clone();
        thread::spawn(move || raise(&rank))
    };
    let progress = {
        let rank = rank.clone();
        thread::spawn(move || rank.progress(round))
    };
    rank.wait(round);
    raiser.join().unwrap();
    progress.join().unwrap();
}

/// A rank waits for one peer's flag (a two-rank barrier, a leaf waiting for the release):
/// whatever the interleaving of the raise, the progress task's arm-look-sleep and the
/// future's look-park-look, the future finishes, and nobody sleeps through the raise.
#[test]
fn one_flag_raised_wakes_its_waiter() {
    model(|| {
        let rank = Rank::new(1);
        raise_and_wait(rank.clone(), 1, |rank| rank.raise(0, 1));
        // One arm at a time, one raise: at most one signal.
        assert!(rank.signals.load(Ordering::Relaxed) <= 1);
    });
}

/// Rank 0 of the linear flag barrier waits for two peers' flags, raised apart (here by one
/// thread, one after the other, to keep the model small): the progress task may drain between
/// them and the future park in between; it still finishes.
#[test]
fn two_flags_raised_apart_wake_their_waiter() {
    model(|| {
        raise_and_wait(Rank::new(2), 1, |rank| {
            rank.raise(0, 1);
            rank.raise(1, 1);
        });
    });
}

/// A flag already seen by an earlier drain (raised for the last barrier) does not count as
/// work again, and a later raise of the same flag still wakes the waiter of the next round.
#[test]
fn a_flag_seen_before_is_no_work_and_a_new_round_wakes() {
    model(|| {
        let rank = Rank::new(1);
        rank.flags[0].store(1, Ordering::Relaxed);
        rank.watch.observe(rank.words(), false);
        assert!(
            !rank.watch.changed(rank.words()),
            "a seen flag counted as work"
        );
        raise_and_wait(rank, 2, |rank| rank.raise(0, 2));
    });
}
