//! What every model needs: a loom runner with a default preemption bound and a waker that
//! counts its wake-ups.

use std::sync::Arc as StdArc;
use std::task::{Wake, Waker};

use loom::sync::atomic::{AtomicUsize, Ordering};

/// Default preemption bound when `LOOM_MAX_PREEMPTIONS` is not set: an unbounded run of some
/// models takes many minutes, and 3 is enough to find the bugs they are written for.
pub const DEFAULT_PREEMPTION_BOUND: usize = 3;

/// Runs `f` under loom with the preemption bound from `LOOM_MAX_PREEMPTIONS`, or
/// [`DEFAULT_PREEMPTION_BOUND`] if unset.
pub fn model<F>(f: F)
where
    F: Fn() + Sync + Send + 'static,
{
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(DEFAULT_PREEMPTION_BOUND);
    }
    builder.check(f);
}

/// A waker that counts its wake-ups in a loom atomic (so loom tracks the happens-before edge
/// from the waking thread to whoever reads the count after joining it).
pub struct CountingWaker {
    wakes: AtomicUsize,
}

impl Wake for CountingWaker {
    fn wake(self: StdArc<Self>) {
        self.wakes.fetch_add(1, Ordering::Release);
    }
}

impl CountingWaker {
    /// Wake-ups so far.
    pub fn wakes(&self) -> usize {
        self.wakes.load(Ordering::Acquire)
    }
}

/// A fresh counting waker and its counter.
pub fn counting_waker() -> (Waker, StdArc<CountingWaker>) {
    let counter = StdArc::new(CountingWaker {
        wakes: AtomicUsize::new(0),
    });
    (Waker::from(counter.clone()), counter)
}
