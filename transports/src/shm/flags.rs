//! [`FlagWatch`]: how a rank notices flags raised to it while it sleeps.
//!
//! A flag is one word per ordered pair of local ranks, in the receiver's segment (see
//! [`Transport::raise_flag`](rankweave_core::Transport::raise_flag)); a rank waiting on one
//! looks at it itself, busy-polling, as long as its spin window lasts. To sleep after that it
//! needs what a ring record gets: a raise that finds the doorbell armed signals the rank, and
//! the rank, having armed its doorbell, looks at its flags once more before it sleeps — the
//! same Dekker handshake as for records (see `doorbell.rs`), with the flag's store in place of
//! the record's stamp. So the progress task counts a flag that changed as work
//! ([`FlagWatch::changed`], part of `has_work_or_flags`), and when it next drains it notes the new
//! values and wakes the futures parked on flags ([`FlagWatch::observe`]). Noting the values
//! keeps a flag nobody waits for yet from counting as work again and again.
//!
//! It takes the flag words as `(sender rank, word)` pairs (the segment's registered senders),
//! so that the loom models in `loom-tests/tests/shm_flags.rs` can compile it with the doorbell.

use std::task::Waker;

use crate::sync::Mutex;
use crate::sync::atomic::{AtomicU64, Ordering};

/// The flags of a rank's segment as its progress task last saw them, and the futures waiting
/// for one to change.
pub(crate) struct FlagWatch {
    /// By sender rank: the value last seen.
    seen: Box<[AtomicU64]>,
    waiters: Mutex<Vec<Waker>>,
}

impl FlagWatch {
    /// For a job of `world` ranks.
    pub(crate) fn new(world: u32) -> FlagWatch {
        FlagWatch {
            seen: (0..world).map(|_| AtomicU64::new(0)).collect(),
            waiters: Mutex::new(Vec::new()),
        }
    }

    /// The value of `word`, the flag from `rank`, if it differs from the one last seen.
    fn news(&self, rank: u32, word: &AtomicU64) -> Option<(usize, u64)> {
        let value = word.load(Ordering::Acquire);
        let seen = self.seen.get(rank as usize)?;
        (value != seen.load(Ordering::Relaxed)).then_some((rank as usize, value))
    }

    /// Whether one of `flags` (a rank's flag words by sender) changed since
    /// [`observe`](Self::observe) last looked.
    pub(crate) fn changed<'a>(
        &self,
        flags: impl IntoIterator<Item = (u32, &'a AtomicU64)>,
    ) -> bool {
        flags
            .into_iter()
            .any(|(rank, word)| self.news(rank, word).is_some())
    }

    /// Notes `flags` as seen and, if any changed (or `anyway`: a peer is gone), wakes every
    /// parked waiter, which looks at its flags itself.
    pub(crate) fn observe<'a>(
        &self,
        flags: impl IntoIterator<Item = (u32, &'a AtomicU64)>,
        anyway: bool,
    ) {
        let mut changed = anyway;
        for (rank, value) in flags.into_iter().filter_map(|(r, w)| self.news(r, w)) {
            self.seen[rank].store(value, Ordering::Relaxed);
            changed = true;
        }
        if changed {
            let waiters =
                std::mem::take(&mut *self.waiters.lock().unwrap_or_else(|p| p.into_inner()));
            for w in waiters {
                w.wake();
            }
        }
    }

    /// Registers `waker` to be woken when a flag changes. The caller looks at its flags once
    /// more afterwards, before it sleeps.
    pub(crate) fn park(&self, waker: &Waker) {
        let mut waiters = self.waiters.lock().unwrap_or_else(|p| p.into_inner());
        if !waiters.iter().any(|w| w.will_wake(waker)) {
            waiters.push(waker.clone());
        }
    }
}
