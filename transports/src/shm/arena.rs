//! [`ArenaGate`]: who holds a rank's arena (see `rankweave_core::arena`) — one lease at a
//! time, taken without waiting. A collective that finds the arena taken does without it, so
//! nothing ever waits here; what the gate must get right is the hand-over: everything the last
//! holder did to the arena happens before anything the next one does.

use crate::sync::atomic::{AtomicBool, Ordering};

/// Whether a lease on the arena exists (see the [module docs](self)).
#[derive(Debug, Default)]
pub(crate) struct ArenaGate {
    held: AtomicBool,
}

impl ArenaGate {
    /// A gate with the arena free.
    pub(crate) fn new() -> ArenaGate {
        ArenaGate {
            held: AtomicBool::new(false),
        }
    }

    /// Takes the arena if nobody holds it. Acquire: the last holder's accesses, which it
    /// released by [`give_back`](Self::give_back), happen before this holder's.
    pub(crate) fn try_take(&self) -> bool {
        self.held
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }

    /// Gives the arena back (its holder is done with it). Release: see
    /// [`try_take`](Self::try_take).
    pub(crate) fn give_back(&self) {
        self.held.store(false, Ordering::Release);
    }
}
