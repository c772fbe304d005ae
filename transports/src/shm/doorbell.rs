//! The park/notify handshake between a rank and the local ranks that write to it.
//!
//! A rank that is busy (a future busy-polling, or its progress task running) reads its rings
//! without being told; producers then pay nothing beyond their ring writes. Only a rank with
//! nothing to do *parks*: it sets its [`Doorbell`] to `PARKED`, looks at its rings once more,
//! and sleeps until signalled. A producer that publishes a record checks the doorbell and, if it
//! is `PARKED`, flips it back to `AWAKE` and sends the one signal that wakes the rank (the
//! transport uses a datagram on the rank's signal socket; see `signal.rs`).
//!
//! The handshake is Dekker's: the parker stores `PARKED`, issues a `SeqCst` fence and loads the
//! words at its rings' read positions; the producer stores a record's stamp there, issues a
//! `SeqCst` fence and loads the doorbell. The fences are totally ordered, so either the parker sees the record (and does not sleep) or
//! the producer sees `PARKED` (and signals). The `compare_exchange` from `PARKED` to `AWAKE`
//! makes exactly one of several producers send the signal for one park.
//!
//! The doorbell lives in the rank's shared segment, in a cache line of its own. The loom model
//! in `loom-tests/tests/shm_doorbell.rs` compiles this file against loom's atomics.

use crate::sync::atomic::{AtomicU32, Ordering, fence};

const AWAKE: u32 = 0;
const PARKED: u32 = 1;

/// One rank's doorbell (a cache line in its segment; all zeros is `AWAKE`).
#[repr(C, align(64))]
pub(crate) struct Doorbell {
    state: AtomicU32,
}

impl Doorbell {
    /// An `AWAKE` doorbell.
    pub(crate) fn new() -> Doorbell {
        Doorbell {
            state: AtomicU32::new(AWAKE),
        }
    }

    /// The owner is about to sleep: from now on, producers signal. The caller must look at its
    /// rings *after* this returns, and not sleep if anything is there.
    pub(crate) fn arm(&self) {
        self.state.store(PARKED, Ordering::Relaxed);
        // Orders the store before the caller's ring checks, against the producer's
        // stamp store and doorbell load.
        fence(Ordering::SeqCst);
    }

    /// The owner is busy again (it found work, or a busy poller took over): producers stop
    /// signalling. Returns whether it was armed.
    pub(crate) fn disarm(&self) -> bool {
        // Written only when it changes: producers read this line on every send, and a store
        // would take it from them each time a busy poller starts a burst.
        if self.state.load(Ordering::Relaxed) == AWAKE {
            return false;
        }
        self.state.store(AWAKE, Ordering::Relaxed);
        true
    }

    /// Whether it is armed now (a snapshot for diagnostics; decides nothing).
    pub(crate) fn is_armed(&self) -> bool {
        self.state.load(Ordering::Relaxed) == PARKED
    }

    /// A producer has published a record in one of the owner's rings: returns whether it must
    /// signal the owner (which happens at most once per [`arm`](Self::arm)).
    pub(crate) fn should_signal(&self) -> bool {
        // Orders the caller's stamp store before the state load, against the owner's arm.
        fence(Ordering::SeqCst);
        self.state.load(Ordering::Relaxed) == PARKED
            && self
                .state
                .compare_exchange(PARKED, AWAKE, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }
}

impl Default for Doorbell {
    fn default() -> Self {
        Doorbell::new()
    }
}
