//! A transport decorator that injects faults: [`ChaosTransport`].
//!
//! It wraps any [`Transport`] and applies a [`ChaosSpec`] to every frame this rank sends: seeded
//! loss, corruption of one payload byte, duplication, reordering, a fixed extra delay, and route
//! down/up at given times (see [`rankweave_core::chaos`] for the `RANKWEAVE_CHAOS` syntax). It is
//! for testing the layers above against an unreliable transport.
//!
//! For every frame, in this order:
//!
//! 1. The generator draws the frame's fate (the same number of draws for every frame, so a
//!    frame's fate depends only on the seed and its position in the sequence of sends).
//! 2. If the route is down at this moment, the frame is dropped (`dropped_down`).
//! 3. With probability `loss` it is dropped (`dropped`).
//! 4. With probability `corrupt` one random byte of a *copy* of its payload is flipped
//!    (`corrupted`; frames with an empty payload are left alone).
//! 5. With probability `dup` it is sent twice, the copy right after the original (`duplicated`).
//! 6. With a `delay`, it is held until that much time has passed (`delayed`).
//! 7. With probability `reorder` it is held back until the next frame to the same peer has gone
//!    out, and goes right after it (`reordered`). If no such frame comes within
//!    [`REORDER_MAX_HOLD`] (after its delay), it goes out anyway, so nothing is lost.
//!
//! There are no timers: held frames whose time has come are released whenever
//! [`send`](Transport::send), [`drain`](Transport::drain) or
//! [`poll_arrival`](Transport::poll_arrival) is called; while frames are held, `poll_arrival`
//! asks to be polled again at once and `may_have_arrivals` says `true`, so a progress engine
//! keeps releasing them instead of parking. [`close`](Transport::close) (and
//! [`ChaosTransport::flush`]) send every held frame before anything else.

use std::collections::VecDeque;
use std::fmt;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use rankweave_core::frame::Frame;
use rankweave_core::rng::SplitMix64;
use rankweave_core::{Arrival, Capabilities, ChaosSpec, Transport, TransportError};

use crate::sync::atomic::{AtomicUsize, Ordering};
use crate::sync::{Mutex, MutexGuard};

/// How long a frame held back for reordering waits for a next frame to the same peer before it
/// goes out anyway (counted from when its delay, if any, has passed).
pub const REORDER_MAX_HOLD: Duration = Duration::from_millis(1);

/// What a [`ChaosTransport`] has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChaosStats {
    /// Frames handed to `send`.
    pub seen: u64,
    /// Frames dropped by random loss.
    pub dropped: u64,
    /// Frames whose payload had a byte flipped.
    pub corrupted: u64,
    /// Frames sent twice.
    pub duplicated: u64,
    /// Frames held back until after the next frame to the same peer.
    pub reordered: u64,
    /// Frames held for the extra delay.
    pub delayed: u64,
    /// Frames dropped because the route was down.
    pub dropped_down: u64,
    /// Held frames the inner transport refused when they were finally sent (the error could no
    /// longer be returned to the caller of `send`).
    pub release_errors: u64,
}

/// Wraps a transport and injects the faults of a [`ChaosSpec`] into what this rank sends.
///
/// Deterministic for a given seed and sequence of sends (delay, reorder time-outs and route
/// events also depend on the clock). Capabilities are the inner transport's, except that
/// `reliable` is `false` when the spec can lose, corrupt or duplicate frames (or take the route
/// down), and `ordered` is `false` when it can reorder, duplicate or delay them.
pub struct ChaosTransport<T: Transport> {
    inner: T,
    spec: ChaosSpec,
    start: Instant,
    /// Number of held frames, readable without the lock.
    held_len: AtomicUsize,
    state: Mutex<State>,
}

struct State {
    rng: SplitMix64,
    held: VecDeque<Held>,
    next_id: u64,
    stats: ChaosStats,
}

/// A frame waiting in the chaos queue.
struct Held {
    id: u64,
    to: u32,
    frame: Frame,
    /// Not before this instant (the extra delay).
    not_before: Instant,
    /// Waiting for the next frame to the same peer to go out first (reordering).
    behind_next: bool,
    /// When `behind_next` stops mattering.
    give_up_at: Instant,
}

impl Held {
    fn ready(&self, now: Instant) -> bool {
        now >= self.not_before && (!self.behind_next || now >= self.give_up_at)
    }
}

impl<T: Transport> ChaosTransport<T> {
    /// Wraps `inner`; route event times count from now.
    pub fn new(inner: T, spec: ChaosSpec) -> ChaosTransport<T> {
        ChaosTransport {
            inner,
            state: Mutex::new(State {
                rng: SplitMix64(spec.seed),
                held: VecDeque::new(),
                next_id: 0,
                stats: ChaosStats::default(),
            }),
            spec,
            start: Instant::now(),
            held_len: AtomicUsize::new(0),
        }
    }

    /// The faults being injected.
    pub fn spec(&self) -> &ChaosSpec {
        &self.spec
    }

    /// The wrapped transport.
    pub fn inner(&self) -> &T {
        &self.inner
    }

    /// What has been done so far.
    pub fn stats(&self) -> ChaosStats {
        self.lock().stats
    }

    /// Frames held for delay or reordering, not yet handed to the inner transport.
    pub fn held(&self) -> usize {
        self.held_len.load(Ordering::Relaxed)
    }

    /// Sends every held frame now, in queue order, ignoring delays and reordering.
    pub fn flush(&self) {
        let mut st = self.lock();
        while let Some(h) = st.held.pop_front() {
            if let Err(e) = self.inner.send(h.to, h.frame) {
                st.stats.release_errors += 1;
                tracing::debug!(to = h.to, error = %e, "chaos: flushed frame refused");
            }
        }
        self.held_len.store(0, Ordering::Relaxed);
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn send_at(&self, to: u32, mut frame: Frame, now: Instant) -> Result<(), TransportError> {
        let mut st = self.lock();
        let st = &mut *st;
        st.stats.seen += 1;
        // Always the same draws per frame, whatever happens to it.
        let lose = st.rng.chance(self.spec.loss);
        let corrupt = st.rng.chance(self.spec.corrupt);
        let duplicate = st.rng.chance(self.spec.duplicate);
        let reorder = st.rng.chance(self.spec.reorder);
        let position = st.rng.next_u64();
        let mask = (st.rng.next_u64() % 255) as u8 + 1; // never 0: the byte always changes

        if !self
            .spec
            .route_up_at(now.saturating_duration_since(self.start))
        {
            st.stats.dropped_down += 1;
            return self.release(st, now, None);
        }
        if lose {
            st.stats.dropped += 1;
            return self.release(st, now, None);
        }
        if corrupt && !frame.payload.is_empty() {
            let mut copy = BytesMut::from(&frame.payload[..]);
            let i = (position % copy.len() as u64) as usize;
            copy[i] ^= mask;
            frame.payload = copy.freeze();
            st.stats.corrupted += 1;
        }
        let not_before = now + self.spec.delay;
        if !self.spec.delay.is_zero() {
            st.stats.delayed += 1;
        }
        if reorder {
            st.stats.reordered += 1;
        }
        let copies = if duplicate {
            st.stats.duplicated += 1;
            2
        } else {
            1
        };
        let id = st.next_id;
        for _ in 0..copies {
            st.held.push_back(Held {
                id: st.next_id,
                to,
                frame: frame.clone(),
                not_before,
                behind_next: reorder,
                give_up_at: not_before + REORDER_MAX_HOLD,
            });
            st.next_id += 1;
        }
        self.release(st, now, Some(id))
    }

    /// Hands every held frame that may go at `now` to the inner transport. Returns the inner
    /// transport's error for the frame with id `current`, if that one went out and failed.
    fn release(
        &self,
        st: &mut State,
        now: Instant,
        current: Option<u64>,
    ) -> Result<(), TransportError> {
        let mut result = Ok(());
        while let Some(i) = st.held.iter().position(|h| h.ready(now)) {
            let Some(h) = st.held.remove(i) else { break };
            // Frames queued earlier to the same peer that waited for the next one: this is it,
            // so they go right after it.
            for earlier in st.held.iter_mut().take(i) {
                if earlier.to == h.to {
                    earlier.behind_next = false;
                }
            }
            if let Err(e) = self.inner.send(h.to, h.frame) {
                if Some(h.id) == current {
                    result = Err(e);
                } else {
                    st.stats.release_errors += 1;
                    tracing::debug!(to = h.to, error = %e, "chaos: held frame refused");
                }
            }
        }
        self.held_len.store(st.held.len(), Ordering::Relaxed);
        result
    }

    fn release_due(&self, now: Instant) {
        if self.held() > 0 {
            let mut st = self.lock();
            let _ = self.release(&mut st, now, None);
        }
    }

    fn drain_at(&self, out: &mut Vec<Arrival>, now: Instant) -> Result<usize, TransportError> {
        self.release_due(now);
        self.inner.drain(out)
    }
}

impl<T: Transport> Transport for ChaosTransport<T> {
    fn capabilities(&self) -> Capabilities {
        let inner = self.inner.capabilities();
        Capabilities {
            reliable: inner.reliable && !self.spec.breaks_reliability(),
            ordered: inner.ordered && !self.spec.breaks_order(),
            ..inner
        }
    }

    fn send(&self, to: u32, frame: Frame) -> Result<(), TransportError> {
        self.send_at(to, frame, Instant::now())
    }

    fn drain(&self, out: &mut Vec<Arrival>) -> Result<usize, TransportError> {
        self.drain_at(out, Instant::now())
    }

    fn poll_arrival(&self, cx: &mut Context<'_>) -> Poll<()> {
        self.release_due(Instant::now());
        if self.held() > 0 {
            // No timers: come back soon to release the rest.
            cx.waker().wake_by_ref();
        }
        self.inner.poll_arrival(cx)
    }

    fn may_have_arrivals(&self) -> bool {
        self.held() > 0 || self.inner.may_have_arrivals()
    }

    fn begin_busy_poll(&self) {
        self.inner.begin_busy_poll();
    }

    fn end_busy_poll(&self) {
        self.inner.end_busy_poll();
    }

    fn close(&self) {
        self.flush();
        self.inner.close();
    }
}

impl<T: Transport + fmt::Debug> fmt::Debug for ChaosTransport<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChaosTransport")
            .field("inner", &self.inner)
            .field("spec", &self.spec)
            .field("held", &self.held())
            .field("stats", &self.stats())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::task::Waker;

    use bytes::Bytes;
    use rankweave_core::frame::Header;

    use super::*;
    use crate::inproc::{InprocFabric, InprocTransport};

    /// Rank 0 sends through the chaos layer; rank 1 is a plain endpoint.
    fn pair(spec: &str) -> (ChaosTransport<InprocTransport>, InprocTransport) {
        let fabric: Arc<InprocFabric> = InprocFabric::new(2);
        let spec = ChaosSpec::parse(spec).unwrap();
        (
            ChaosTransport::new(fabric.endpoint(0).unwrap(), spec),
            fabric.endpoint(1).unwrap(),
        )
    }

    fn payload(i: u64) -> Bytes {
        (0..32u8)
            .map(|k| (i as u8).wrapping_mul(31).wrapping_add(k))
            .collect::<Vec<u8>>()
            .into()
    }

    fn frame(i: u64) -> Frame {
        Frame {
            header: Header::Data {
                recv_id: i,
                offset: 0,
            },
            payload: payload(i),
        }
    }

    /// Sends frames `0..n` all at the same instant, then lets everything held go out.
    fn run(spec: &str, n: u64) -> (Vec<Frame>, ChaosStats) {
        let (tx, rx) = pair(spec);
        for i in 0..n {
            tx.send_at(1, frame(i), tx.start).unwrap();
        }
        tx.flush();
        (received(&rx), tx.stats())
    }

    fn received(rx: &InprocTransport) -> Vec<Frame> {
        let mut out = Vec::new();
        rx.drain(&mut out).unwrap();
        out.into_iter()
            .map(|a| match a {
                Arrival::Frame { from: 0, frame } => frame,
                other => panic!("unexpected arrival {other:?}"),
            })
            .collect()
    }

    fn id(f: &Frame) -> u64 {
        match f.header {
            Header::Data { recv_id, .. } => recv_id,
            h => panic!("unexpected header {h:?}"),
        }
    }

    #[test]
    fn no_faults_passes_everything_in_order() {
        let (got, st) = run("seed=1", 1000);
        assert_eq!(
            got.iter().map(id).collect::<Vec<_>>(),
            (0..1000).collect::<Vec<_>>()
        );
        assert!(got.iter().all(|f| f.payload == payload(id(f))));
        assert_eq!(
            st,
            ChaosStats {
                seen: 1000,
                ..ChaosStats::default()
            }
        );
    }

    #[test]
    fn total_loss_delivers_nothing() {
        let (got, st) = run("seed=3,loss=1.0", 500);
        assert!(got.is_empty());
        assert_eq!(st.seen, 500);
        assert_eq!(st.dropped, 500);
        assert_eq!(st.dropped_down, 0);
    }

    #[test]
    fn thirty_percent_loss_over_ten_thousand_frames() {
        let (got, st) = run("seed=42,loss=0.3", 10_000);
        assert!((2800..=3200).contains(&st.dropped), "{st:?}");
        assert_eq!(got.len() as u64, 10_000 - st.dropped);
        // What arrives is intact and in order.
        let ids: Vec<u64> = got.iter().map(id).collect();
        assert!(ids.windows(2).all(|w| w[0] < w[1]));
        assert!(got.iter().all(|f| f.payload == payload(id(f))));
    }

    #[test]
    fn duplicates_arrive_twice() {
        let (got, st) = run("seed=5,dup=1", 200);
        assert_eq!(st.duplicated, 200);
        assert_eq!(got.len(), 400);
        for (k, f) in got.iter().enumerate() {
            assert_eq!(id(f), k as u64 / 2);
            assert_eq!(f.payload, payload(id(f)));
        }
        // Half the time: the extra arrivals are exactly the duplicated frames.
        let (got, st) = run("seed=5,dup=0.5", 2000);
        assert!(st.duplicated > 800 && st.duplicated < 1200, "{st:?}");
        assert_eq!(got.len() as u64, 2000 + st.duplicated);
    }

    #[test]
    fn corruption_changes_exactly_one_byte_of_a_copy() {
        let (tx, rx) = pair("seed=9,corrupt=1");
        let originals: Vec<Frame> = (0..300).map(frame).collect();
        for f in &originals {
            tx.send(1, f.clone()).unwrap();
        }
        // An empty payload has nothing to corrupt.
        tx.send(1, Frame::control(Header::Credit { bytes: 1 }))
            .unwrap();
        let got = received(&rx);
        assert_eq!(got.len(), 301);
        for (orig, f) in originals.iter().zip(&got) {
            assert_eq!(orig.header, f.header);
            assert_eq!(
                orig.payload,
                payload(id(orig)),
                "the sender's buffer is untouched"
            );
            let diff = orig
                .payload
                .iter()
                .zip(f.payload.iter())
                .filter(|(a, b)| a != b)
                .count();
            assert_eq!(diff, 1, "frame {}", id(orig));
            assert_eq!(orig.payload.len(), f.payload.len());
        }
        assert!(got[300].payload.is_empty());
        assert_eq!(tx.stats().corrupted, 300);
        assert_eq!(tx.stats().seen, 301);
    }

    #[test]
    fn reorder_changes_order_but_loses_nothing() {
        let (got, st) = run("seed=11,reorder=0.2", 1000);
        let ids: Vec<u64> = got.iter().map(id).collect();
        let mut sorted = ids.clone();
        sorted.sort_unstable();
        assert_eq!(
            sorted,
            (0..1000).collect::<Vec<_>>(),
            "every frame exactly once"
        );
        assert_ne!(ids, sorted, "some frames overtaken");
        assert!(st.reordered > 150 && st.reordered < 250, "{st:?}");
        assert!(got.iter().all(|f| f.payload == payload(id(f))));
    }

    #[test]
    fn a_held_back_frame_goes_right_after_the_next_one_to_its_peer() {
        // Three ranks: frames to rank 2 do not release a frame held for rank 1.
        let fabric = InprocFabric::new(3);
        let tx = ChaosTransport::new(
            fabric.endpoint(0).unwrap(),
            ChaosSpec::parse("reorder=1").unwrap(),
        );
        let rx1 = fabric.endpoint(1).unwrap();
        let t = tx.start;
        tx.send_at(1, frame(0), t).unwrap();
        assert_eq!(tx.held(), 1);
        tx.send_at(2, frame(1), t).unwrap(); // held too (reorder=1), and not for peer 1
        assert_eq!(tx.held(), 2);
        assert!(received(&rx1).is_empty());
        // Nothing comes for a while: they go out anyway.
        let mut out = Vec::new();
        tx.drain_at(&mut out, t + REORDER_MAX_HOLD).unwrap();
        assert_eq!(tx.held(), 0);
        assert_eq!(received(&rx1).iter().map(id).collect::<Vec<_>>(), vec![0]);

        // With reorder=0.5 and a fixed seed, check the rule on every frame to one peer.
        let (tx, rx) = pair("seed=2,reorder=0.5");
        for i in 0..20 {
            tx.send_at(1, frame(i), tx.start).unwrap();
        }
        tx.flush();
        let ids: Vec<u64> = received(&rx).iter().map(id).collect();
        assert_eq!(tx.stats().reordered, 12, "this seed holds back 12 of 20");
        let mut sorted = ids.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..20).collect::<Vec<_>>());
        // A frame that goes out (a new highest id) is followed by exactly the frames held back
        // before it that are still missing, oldest first.
        let mut seen = std::collections::BTreeSet::new();
        let mut k = 0;
        while k < ids.len() {
            let leader = ids[k];
            assert!(seen.iter().all(|&s| s < leader), "{ids:?}");
            seen.insert(leader);
            let missing: Vec<u64> = (0..leader).filter(|j| !seen.contains(j)).collect();
            assert_eq!(&ids[k + 1..k + 1 + missing.len()], &missing[..], "{ids:?}");
            seen.extend(missing.iter().copied());
            k += 1 + missing.len();
        }
    }

    #[test]
    fn route_down_window_drops_exactly_the_frames_sent_while_down() {
        let (tx, rx) = pair("seed=1,down@100ms,up@300ms");
        for k in 0..50u64 {
            let at = tx.start + Duration::from_millis(10 * k);
            tx.send_at(1, frame(k), at).unwrap();
        }
        let ids: Vec<u64> = received(&rx).iter().map(id).collect();
        let expected: Vec<u64> = (0..10).chain(30..50).collect();
        assert_eq!(ids, expected);
        let st = tx.stats();
        assert_eq!(st.dropped_down, 20);
        assert_eq!(st.dropped, 0);
        assert_eq!(st.seen, 50);
    }

    #[test]
    fn delay_holds_frames_until_their_time() {
        let (tx, rx) = pair("delay=2ms");
        let t = tx.start;
        tx.send_at(1, frame(0), t).unwrap();
        tx.send_at(1, frame(1), t + Duration::from_millis(1))
            .unwrap();
        assert!(received(&rx).is_empty());
        assert_eq!(tx.held(), 2);
        assert!(
            tx.may_have_arrivals(),
            "held frames keep busy pollers draining"
        );
        let mut out = Vec::new();
        tx.drain_at(&mut out, t + Duration::from_micros(2500))
            .unwrap();
        assert_eq!(received(&rx).iter().map(id).collect::<Vec<_>>(), vec![0]);
        tx.drain_at(&mut out, t + Duration::from_millis(3)).unwrap();
        assert_eq!(received(&rx).iter().map(id).collect::<Vec<_>>(), vec![1]);
        assert_eq!(tx.stats().delayed, 2);
        assert_eq!(tx.held(), 0);
    }

    #[test]
    fn delay_with_the_real_clock_releases_on_poll() {
        let (tx, rx) = pair("delay=1ms");
        tx.send(1, frame(7)).unwrap();
        assert!(received(&rx).is_empty());
        std::thread::sleep(Duration::from_millis(2));
        let mut cx = Context::from_waker(Waker::noop());
        let _ = tx.poll_arrival(&mut cx);
        assert_eq!(received(&rx).iter().map(id).collect::<Vec<_>>(), vec![7]);
    }

    #[test]
    fn close_sends_held_frames_before_the_peer_lost_notice() {
        let (tx, rx) = pair("delay=1s");
        tx.send(1, frame(0)).unwrap();
        tx.send(1, frame(1)).unwrap();
        tx.close();
        let mut out = Vec::new();
        rx.drain(&mut out).unwrap();
        assert_eq!(out.len(), 3);
        assert!(matches!(out[0], Arrival::Frame { from: 0, ref frame } if id(frame) == 0));
        assert!(matches!(out[1], Arrival::Frame { from: 0, ref frame } if id(frame) == 1));
        assert!(matches!(out[2], Arrival::PeerLost { rank: 0 }));
    }

    #[test]
    fn same_seed_same_outcome() {
        let spec = "loss=0.1,corrupt=0.1,dup=0.1,reorder=0.1";
        let a = run(&format!("seed=77,{spec}"), 3000);
        let b = run(&format!("seed=77,{spec}"), 3000);
        assert_eq!(a.1, b.1);
        assert_eq!(a.0, b.0);
        let c = run(&format!("seed=78,{spec}"), 3000);
        assert_ne!(a.0, c.0, "another seed, other faults");
        // Every kind of fault happened.
        let st = a.1;
        assert!(st.dropped > 0 && st.corrupted > 0 && st.duplicated > 0 && st.reordered > 0);
    }

    #[test]
    fn capabilities_reflect_the_faults() {
        let caps = |spec: &str| pair(spec).0.capabilities();
        let plain = pair("seed=1").1.capabilities();
        assert_eq!(caps("seed=1"), plain);
        let c = caps("loss=0.01");
        assert!(!c.reliable && c.ordered);
        assert_eq!(c.max_payload, plain.max_payload);
        assert_eq!(c.by_reference, plain.by_reference);
        let c = caps("corrupt=1%");
        assert!(!c.reliable && c.ordered);
        let c = caps("dup=0.5");
        assert!(!c.reliable && !c.ordered);
        let c = caps("reorder=0.1");
        assert!(c.reliable && !c.ordered);
        let c = caps("delay=10us");
        assert!(c.reliable && !c.ordered);
        let c = caps("down@1s,up@2s");
        assert!(!c.reliable && c.ordered);
        // Zero probabilities are no faults.
        assert_eq!(caps("loss=0,corrupt=0%,dup=0,reorder=0,delay=0s"), plain);
    }

    #[test]
    fn busy_poll_hooks_pass_through() {
        let (tx, rx) = pair("seed=1");
        tx.begin_busy_poll();
        tx.end_busy_poll();
        tx.send(1, frame(3)).unwrap();
        assert!(rx.may_have_arrivals());
        assert_eq!(received(&rx).len(), 1);
        assert!(!tx.may_have_arrivals());
        assert!(format!("{tx:?}").contains("ChaosTransport"));
    }
}
