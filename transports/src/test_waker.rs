//! A waker for the transports' tests that counts its wake-ups.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Wake, Waker};

/// Counts the wake-ups of the wakers made from it ([`CountingWaker::waker`]).
#[derive(Default)]
pub(crate) struct CountingWaker(AtomicUsize);

impl CountingWaker {
    /// A fresh counter and a waker that counts into it.
    pub(crate) fn new() -> (Arc<CountingWaker>, Waker) {
        let counter = Arc::new(CountingWaker::default());
        let waker = Waker::from(Arc::clone(&counter));
        (counter, waker)
    }

    /// Wake-ups so far.
    pub(crate) fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

impl Wake for CountingWaker {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}
