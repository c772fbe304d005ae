//! A multicast group decorator that injects faults: [`ChaosGroup`].
//!
//! It wraps any [`MulticastGroup`] and applies a [`ChaosSpec`] to the datagrams this rank
//! *receives* (a multicast datagram reaches many ranks, and on a real network each of them loses
//! it or not on its own). The generator is seeded with the spec's seed mixed with the rank, so
//! ranks see different faults, reproducibly. For every received datagram, in this order (the
//! same number of draws each time):
//!
//! 1. while route 0 is down (the spec's `down@`/`up@` and `down:0@`/`up:0@` events), dropped;
//! 2. with probability `loss`, dropped;
//! 3. with probability `corrupt`, one byte of a copy is XORed with a non-zero mask;
//! 4. with probability `dup`, delivered twice;
//! 5. with a `delay`, held that long;
//! 6. with probability `reorder`, held until the next datagram has been delivered (at most
//!    [`REORDER_MAX_HOLD`]).
//!
//! Held datagrams are released by later [`drain`](MulticastGroup::drain) calls;
//! [`poll_readable`](MulticastGroup::poll_readable) says `Ready` once one is due, and while any
//! is held it has the caller polled again soon (there is no timer).
//! Sends pass through untouched.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rankweave_core::multicast::MulticastCounters;
use rankweave_core::rng::SplitMix64;
use rankweave_core::{ChaosSpec, MulticastGroup, TransportError};

use crate::chaos::REORDER_MAX_HOLD;

/// A [`MulticastGroup`] with faults injected on receive (see the [module docs](self)).
#[derive(Debug)]
pub struct ChaosGroup<G> {
    inner: G,
    spec: ChaosSpec,
    start: Instant,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    rng: SplitMix64,
    /// Datagrams held back, with the time they may go and whether they wait for a successor.
    held: VecDeque<Held>,
    faults: u64,
}

#[derive(Debug)]
struct Held {
    datagram: Bytes,
    release_at: Instant,
    /// Released only after another datagram was delivered (or `REORDER_MAX_HOLD` passed).
    wait_for_next: bool,
}

impl<G: MulticastGroup> ChaosGroup<G> {
    /// Wraps `inner`, drawing faults from `spec`'s seed mixed with `salt` (the rank).
    pub fn new(inner: G, spec: &ChaosSpec, salt: u64) -> ChaosGroup<G> {
        let seed = spec.seed ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        ChaosGroup {
            inner,
            spec: spec.clone(),
            start: Instant::now(),
            state: Mutex::new(State {
                rng: SplitMix64(seed),
                held: VecDeque::new(),
                faults: 0,
            }),
        }
    }

    /// The wrapped group.
    pub fn inner(&self) -> &G {
        &self.inner
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Decides the fate of one received datagram; what may be delivered now goes to `out`.
    fn admit(&self, st: &mut State, datagram: Bytes, now: Instant, out: &mut Vec<Bytes>) {
        let lose = st.rng.chance(self.spec.loss);
        let corrupt = st.rng.chance(self.spec.corrupt);
        let duplicate = st.rng.chance(self.spec.duplicate);
        let reorder = st.rng.chance(self.spec.reorder);
        let position = st.rng.next_u64();
        let mask = (st.rng.next_u64() % 255) as u8 + 1;
        let up = self
            .spec
            .route_is_up(0, now.saturating_duration_since(self.start));
        if !up || lose {
            st.faults += 1;
            return;
        }
        let datagram = if corrupt && !datagram.is_empty() {
            let mut copy = datagram.to_vec();
            let at = (position % copy.len() as u64) as usize;
            copy[at] ^= mask;
            Bytes::from(copy)
        } else {
            datagram
        };
        let copies = if duplicate { 2 } else { 1 };
        let delayed = !self.spec.delay.is_zero();
        if corrupt || duplicate || reorder || delayed {
            st.faults += 1;
        }
        for _ in 0..copies {
            if reorder || delayed || !st.held.is_empty() {
                st.held.push_back(Held {
                    datagram: datagram.clone(),
                    release_at: now + self.spec.delay,
                    wait_for_next: reorder,
                });
            } else {
                out.push(datagram.clone());
            }
        }
    }

    /// Moves held datagrams whose time has come to `out`, in order; a reordered one goes once
    /// something after it was delivered (or it waited [`REORDER_MAX_HOLD`]).
    fn release(&self, st: &mut State, now: Instant, delivered_before: usize, out: &mut Vec<Bytes>) {
        let mut kept = VecDeque::new();
        let mut delivered = delivered_before;
        while let Some(h) = st.held.pop_front() {
            let due = h.release_at <= now;
            let waited_enough = h.release_at + REORDER_MAX_HOLD <= now;
            if due && (!h.wait_for_next || waited_enough) {
                out.push(h.datagram);
                delivered += 1;
            } else if due && h.wait_for_next && delivered > 0 {
                // Something went out before it: it now arrives late, out of order.
                out.push(h.datagram);
                delivered += 1;
            } else {
                kept.push_back(h);
            }
        }
        // A reordered datagram released after its successor must not overtake it again: the
        // ones still held keep their order.
        st.held = kept;
    }
}

impl<G: MulticastGroup> MulticastGroup for ChaosGroup<G> {
    fn send(&self, datagram: &[u8]) -> Result<(), TransportError> {
        self.inner.send(datagram)
    }

    fn drain(&self, out: &mut Vec<Bytes>, max: usize) -> Result<usize, TransportError> {
        let mut fresh = Vec::new();
        self.inner.drain(&mut fresh, max)?;
        let now = Instant::now();
        let before = out.len();
        let mut st = self.lock();
        let mut direct = Vec::new();
        for d in fresh {
            self.admit(&mut st, d, now, &mut direct);
        }
        let delivered = direct.len();
        out.extend(direct);
        self.release(&mut st, now, delivered, out);
        Ok(out.len() - before)
    }

    fn poll_readable(&self, cx: &mut Context<'_>) -> Poll<()> {
        let now = Instant::now();
        let st = self.lock();
        let due = |h: &Held| {
            let hold = if h.wait_for_next {
                REORDER_MAX_HOLD
            } else {
                Duration::ZERO
            };
            h.release_at + hold <= now
        };
        if st.held.iter().any(due) {
            return Poll::Ready(());
        }
        if !st.held.is_empty() {
            // No timer here: come back soon to release what is held.
            cx.waker().wake_by_ref();
        }
        drop(st);
        self.inner.poll_readable(cx)
    }

    fn max_datagram(&self) -> usize {
        self.inner.max_datagram()
    }

    fn stats(&self) -> MulticastCounters {
        MulticastCounters {
            faults_injected: self.lock().faults,
            ..self.inner.stats()
        }
    }
}
