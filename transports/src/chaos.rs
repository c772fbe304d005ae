//! A carrier decorator that injects faults: [`ChaosCarrier`].
//!
//! It wraps any [`Carrier`] and applies a [`ChaosSpec`] to the datagrams of this rank: seeded
//! loss, corruption of one byte, duplication, reordering, a fixed extra delay, and route down/up
//! at given times or from code (see [`rankweave_core::chaos`] for the `RANKWEAVE_CHAOS` syntax).
//! It sits *beneath* the reliability layer, on bytes: a corrupted datagram was changed after its
//! CRC was computed, as a real wire would do it, so the layers above are tested against what they
//! will meet.
//!
//! For every datagram handed to [`send`](Carrier::send), in this order:
//!
//! 0. A datagram the inner carrier could never take (a route outside `0..routes()`, more than
//!    `max_datagram()` bytes) or a send after [`close`](Carrier::close) fails at once, without
//!    drawing anything or counting it.
//! 1. The generator draws the datagram's fate (the same number of draws for every datagram, so
//!    its fate depends only on the seed and its position in the sequence of sends).
//! 2. If its route is down at this moment, it is dropped (`dropped_down`).
//! 3. With probability `loss` it is dropped (`dropped`).
//! 4. With probability `corrupt` one random byte anywhere in a *copy* of the whole datagram
//!    (header included) is XORed with a random non-zero mask, so between one and eight of its
//!    bits flip (`corrupted`; empty datagrams are left alone). The sender's buffers are never
//!    touched.
//! 5. With probability `dup` it is sent twice, the copy right after the original (`duplicated`).
//! 6. With a `delay`, it is held until that much time has passed (`delayed`).
//! 7. With probability `reorder` it is held back until the next datagram to the same peer over
//!    the same route has gone out, and goes right after it (`reordered`). If no such datagram
//!    comes within [`REORDER_MAX_HOLD`] (after its delay), it goes out anyway, so nothing is lost.
//!
//! A held datagram whose route is down when its time comes is dropped then (`dropped_down`), like
//! a datagram in flight when the cable is pulled. On the receiving side only route state applies:
//! [`recv`](Carrier::recv) drops (and counts in `dropped_down`) every datagram that arrived on a
//! route that is down at that moment. A route's state comes from the spec's route events and from
//! [`ChaosCarrier::set_route_up`]: the latest of them decides.
//!
//! There are no timers: held datagrams whose time has come are released whenever
//! [`send`](Carrier::send), [`recv`](Carrier::recv) or
//! [`poll_recv_ready`](Carrier::poll_recv_ready) is called; while datagrams are held,
//! `poll_recv_ready` asks to be polled again at once, so a progress engine keeps releasing them
//! instead of parking. [`close`](Carrier::close) (and [`ChaosCarrier::flush`]) send every held
//! datagram first.

use std::collections::VecDeque;
use std::fmt;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use rankweave_core::rng::SplitMix64;
use rankweave_core::{Carrier, ChaosSpec, Datagram, TransportError};

use crate::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use crate::sync::{Mutex, MutexGuard};

/// How long a datagram held back for reordering waits for a next datagram to the same peer over
/// the same route before it goes out anyway (counted from when its delay, if any, has passed).
pub const REORDER_MAX_HOLD: Duration = Duration::from_millis(1);

/// What a [`ChaosCarrier`] has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChaosStats {
    /// Datagrams handed to `send` (not counting those refused before their fate was drawn).
    pub seen: u64,
    /// Datagrams dropped by random loss.
    pub dropped: u64,
    /// Datagrams that had a byte changed.
    pub corrupted: u64,
    /// Datagrams sent twice.
    pub duplicated: u64,
    /// Datagrams held back until after the next datagram to the same peer over the same route.
    pub reordered: u64,
    /// Datagrams held for the extra delay.
    pub delayed: u64,
    /// Datagrams dropped because their route was down: sent while it was down, held and due
    /// while it was down, or received while it was down.
    pub dropped_down: u64,
    /// Held datagrams the inner carrier refused when they were finally sent (the error could no
    /// longer be returned to the caller of `send`), and second copies of duplicated datagrams it
    /// refused.
    pub release_errors: u64,
}

/// Wraps a carrier and injects the faults of a [`ChaosSpec`] into the datagrams of this rank.
/// See the [module documentation](self) for what happens to each datagram.
///
/// Deterministic for a given seed and sequence of sends (delay, reorder time-outs and route
/// events also depend on the clock). [`routes`](Carrier::routes) and
/// [`max_datagram`](Carrier::max_datagram) are the inner carrier's.
pub struct ChaosCarrier<C: Carrier> {
    inner: C,
    spec: ChaosSpec,
    start: Instant,
    /// Number of held datagrams, readable without the lock.
    held_len: AtomicUsize,
    /// Whether a route can be down at all (the spec has a `down` event or a route was set down
    /// from code): when not, `recv` skips the route check.
    may_be_down: AtomicBool,
    /// Set by `close`: later sends fail.
    closed: AtomicBool,
    state: Mutex<State>,
}

struct State {
    rng: SplitMix64,
    held: VecDeque<Held>,
    next_id: u64,
    stats: ChaosStats,
    /// Per route, the last [`ChaosCarrier::set_route_up`].
    overrides: Vec<Option<Override>>,
}

/// A route state set from code.
#[derive(Clone, Copy)]
struct Override {
    /// When, measured from the carrier's creation.
    since: Duration,
    up: bool,
}

/// A datagram waiting in the chaos queue.
struct Held {
    id: u64,
    route: usize,
    to: u32,
    bytes: Bytes,
    /// Not before this instant (the extra delay).
    not_before: Instant,
    /// Waiting for the next datagram on the same route to the same peer to go out first.
    behind_next: bool,
    /// When `behind_next` stops mattering.
    give_up_at: Instant,
}

impl Held {
    fn ready(&self, now: Instant) -> bool {
        now >= self.not_before && (!self.behind_next || now >= self.give_up_at)
    }
}

impl<C: Carrier> ChaosCarrier<C> {
    /// Wraps `inner`; route event times count from now.
    pub fn new(inner: C, spec: ChaosSpec) -> ChaosCarrier<C> {
        let routes = inner.routes();
        ChaosCarrier {
            state: Mutex::new(State {
                rng: SplitMix64(spec.seed),
                held: VecDeque::new(),
                next_id: 0,
                stats: ChaosStats::default(),
                overrides: vec![None; routes],
            }),
            may_be_down: AtomicBool::new(spec.routes.iter().any(|e| !e.up)),
            closed: AtomicBool::new(false),
            inner,
            spec,
            start: Instant::now(),
            held_len: AtomicUsize::new(0),
        }
    }

    /// The faults being injected.
    pub fn spec(&self) -> &ChaosSpec {
        &self.spec
    }

    /// The wrapped carrier.
    pub fn inner(&self) -> &C {
        &self.inner
    }

    /// What has been done so far.
    pub fn stats(&self) -> ChaosStats {
        self.lock().stats
    }

    /// Datagrams held for delay or reordering, not yet handed to the inner carrier.
    pub fn held(&self) -> usize {
        self.held_len.load(Ordering::Relaxed)
    }

    /// Takes route `route` down (`up == false`) or brings it back (`up == true`) now, as if its
    /// cable were pulled or plugged back in. This stays in force until a route event of the spec
    /// that applies to the route and is timed after this moment. Routes outside
    /// `0..routes()` are ignored.
    pub fn set_route_up(&self, route: usize, up: bool) {
        self.set_route_up_at(route, up, Instant::now());
    }

    /// Whether route `route` is up now (`false` for a route outside `0..routes()`).
    pub fn is_route_up(&self, route: usize) -> bool {
        self.route_up_now(route, Instant::now())
    }

    /// Sends every held datagram now, in queue order, ignoring delays and reordering (datagrams
    /// on a route that is down are dropped).
    pub fn flush(&self) {
        let now = Instant::now();
        let elapsed = now.saturating_duration_since(self.start);
        let mut st = self.lock();
        let st = &mut *st;
        while let Some(h) = st.held.pop_front() {
            let (route, to) = (h.route, h.to);
            if let Err(e) = self.forward(st, h, elapsed) {
                st.stats.release_errors += 1;
                tracing::debug!(route, to, error = %e, "chaos: flushed datagram refused");
            }
        }
        self.held_len.store(0, Ordering::Relaxed);
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set_route_up_at(&self, route: usize, up: bool, now: Instant) {
        let since = now.saturating_duration_since(self.start);
        let mut st = self.lock();
        if let Some(slot) = st.overrides.get_mut(route) {
            *slot = Some(Override { since, up });
            if !up {
                self.may_be_down.store(true, Ordering::Relaxed);
            }
        }
    }

    fn route_up_now(&self, route: usize, now: Instant) -> bool {
        if route >= self.inner.routes() {
            return false;
        }
        let st = self.lock();
        self.route_up(
            &st.overrides,
            route,
            now.saturating_duration_since(self.start),
        )
    }

    /// Whether `route` is up `elapsed` after creation: the later of the override and the spec's
    /// last applicable event decides (the override wins a tie).
    fn route_up(&self, overrides: &[Option<Override>], route: usize, elapsed: Duration) -> bool {
        match overrides.get(route).copied().flatten() {
            None => self.spec.route_is_up(route, elapsed),
            Some(o) => self
                .spec
                .routes
                .iter()
                .take_while(|e| e.at <= elapsed)
                .filter(|e| e.at > o.since && e.applies_to(route))
                .last()
                .map_or(o.up, |e| e.up),
        }
    }

    /// Hands a datagram whose time has come to the inner carrier, unless its route is down
    /// (then it is dropped and counted). Returns the inner carrier's error, if any; the caller
    /// counts it.
    fn forward(&self, st: &mut State, h: Held, elapsed: Duration) -> Result<(), TransportError> {
        if !self.route_up(&st.overrides, h.route, elapsed) {
            st.stats.dropped_down += 1;
            return Ok(());
        }
        self.inner.send(h.route, h.to, &[&h.bytes])
    }

    fn send_at(
        &self,
        route: usize,
        to: u32,
        parts: &[&[u8]],
        held: Option<&[u8]>,
        now: Instant,
    ) -> Result<(), TransportError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(TransportError::Closed);
        }
        if route >= self.inner.routes() {
            return Err(TransportError::PeerUnreachable(to as usize));
        }
        let len = parts
            .iter()
            .chain(&held)
            .fold(0usize, |n, p| n.saturating_add(p.len()));
        let max = self.inner.max_datagram();
        if len > max {
            return Err(TransportError::Io {
                op: "chaos carrier send",
                message: format!("a {len}-byte datagram exceeds the {max}-byte limit"),
            });
        }
        let mut st = self.lock();
        let st = &mut *st;
        st.stats.seen += 1;
        // Always the same draws per datagram, whatever happens to it.
        let lose = st.rng.chance(self.spec.loss);
        let corrupt = st.rng.chance(self.spec.corrupt);
        let duplicate = st.rng.chance(self.spec.duplicate);
        let reorder = st.rng.chance(self.spec.reorder);
        let position = st.rng.next_u64();
        let mask = (st.rng.next_u64() % 255) as u8 + 1; // never 0: the byte always changes

        let elapsed = now.saturating_duration_since(self.start);
        if !self.route_up(&st.overrides, route, elapsed) {
            st.stats.dropped_down += 1;
            return self.release(st, now, None);
        }
        if lose {
            st.stats.dropped += 1;
            return self.release(st, now, None);
        }
        let corrupt = corrupt && len > 0;
        let delay = !self.spec.delay.is_zero();
        if delay {
            st.stats.delayed += 1;
        }
        if reorder {
            st.stats.reordered += 1;
        }
        if duplicate {
            st.stats.duplicated += 1;
        }
        if !corrupt && !delay && !reorder && st.held.is_empty() {
            // Nothing to change, hold or keep order with: straight through, without a copy.
            let send = || match held {
                Some(held) => self.inner.send_held(route, to, parts, held),
                None => self.inner.send(route, to, parts),
            };
            let result = send();
            if duplicate {
                if let Err(e) = send() {
                    st.stats.release_errors += 1;
                    tracing::debug!(route, to, error = %e, "chaos: duplicate refused");
                }
            }
            return result;
        }
        let mut copy = BytesMut::with_capacity(len);
        for part in parts.iter().chain(&held) {
            copy.extend_from_slice(part);
        }
        if corrupt {
            let i = (position % len as u64) as usize;
            copy[i] ^= mask;
            st.stats.corrupted += 1;
        }
        let bytes = copy.freeze();
        let not_before = later(now, self.spec.delay);
        let id = st.next_id;
        for _ in 0..if duplicate { 2 } else { 1 } {
            st.held.push_back(Held {
                id: st.next_id,
                route,
                to,
                bytes: bytes.clone(),
                not_before,
                behind_next: reorder,
                give_up_at: later(not_before, REORDER_MAX_HOLD),
            });
            st.next_id += 1;
        }
        self.release(st, now, Some(id))
    }

    /// Hands every held datagram that may go at `now` to the inner carrier. Returns the inner
    /// carrier's error for the datagram with id `current`, if that one went out and failed.
    fn release(
        &self,
        st: &mut State,
        now: Instant,
        current: Option<u64>,
    ) -> Result<(), TransportError> {
        let elapsed = now.saturating_duration_since(self.start);
        let mut result = Ok(());
        while let Some(i) = st.held.iter().position(|h| h.ready(now)) {
            let Some(h) = st.held.remove(i) else { break };
            // Datagrams queued earlier on the same route to the same peer that waited for the
            // next one: this is it, so they go right after it.
            for earlier in st.held.iter_mut().take(i) {
                if earlier.route == h.route && earlier.to == h.to {
                    earlier.behind_next = false;
                }
            }
            let (id, route, to) = (h.id, h.route, h.to);
            if let Err(e) = self.forward(st, h, elapsed) {
                if Some(id) == current {
                    result = Err(e);
                } else {
                    st.stats.release_errors += 1;
                    tracing::debug!(route, to, error = %e, "chaos: held datagram refused");
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

    fn recv_at(&self, out: &mut Vec<Datagram>, now: Instant) -> Result<usize, TransportError> {
        self.release_due(now);
        let start = out.len();
        self.inner.recv(out)?;
        if !self.may_be_down.load(Ordering::Relaxed) || out.len() == start {
            return Ok(out.len() - start);
        }
        let elapsed = now.saturating_duration_since(self.start);
        let mut st = self.lock();
        let st = &mut *st;
        // Keep, in order, the datagrams whose route is up.
        let mut kept = start;
        for i in start..out.len() {
            if self.route_up(&st.overrides, out[i].route, elapsed) {
                out.swap(kept, i);
                kept += 1;
            } else {
                st.stats.dropped_down += 1;
            }
        }
        out.truncate(kept);
        Ok(kept - start)
    }
}

impl<C: Carrier> Carrier for ChaosCarrier<C> {
    fn routes(&self) -> usize {
        self.inner.routes()
    }

    fn max_datagram(&self) -> usize {
        self.inner.max_datagram()
    }

    fn send(&self, route: usize, to: u32, parts: &[&[u8]]) -> Result<(), TransportError> {
        self.send_at(route, to, parts, None, Instant::now())
    }

    fn send_held(
        &self,
        route: usize,
        to: u32,
        parts: &[&[u8]],
        held: &[u8],
    ) -> Result<(), TransportError> {
        self.send_at(route, to, parts, Some(held), Instant::now())
    }

    fn recv(&self, out: &mut Vec<Datagram>) -> Result<usize, TransportError> {
        self.recv_at(out, Instant::now())
    }

    fn poll_recv_ready(&self, cx: &mut Context<'_>) -> Poll<()> {
        self.release_due(Instant::now());
        if self.held() > 0 {
            // No timers: come back soon to release the rest.
            cx.waker().wake_by_ref();
        }
        self.inner.poll_recv_ready(cx)
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.flush();
        self.inner.close();
    }
}

impl<C: Carrier + fmt::Debug> fmt::Debug for ChaosCarrier<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChaosCarrier")
            .field("inner", &self.inner)
            .field("spec", &self.spec)
            .field("held", &self.held())
            .field("stats", &self.stats())
            .finish()
    }
}

/// `at + d`, or as far as an `Instant` goes (never panics, even for an absurd delay).
fn later(at: Instant, d: Duration) -> Instant {
    at.checked_add(d)
        .or_else(|| at.checked_add(Duration::from_secs(1 << 32)))
        .unwrap_or(at)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::sync::Arc;

    use super::*;
    use crate::inproc::{InprocCarrier, InprocCarrierFabric};
    use crate::test_waker::CountingWaker;

    const MAX: usize = 1024;

    /// Rank 0 sends through the chaos layer; rank 1 is a plain carrier. Two routes.
    fn pair(spec: &str) -> (ChaosCarrier<InprocCarrier>, InprocCarrier) {
        let fabric = InprocCarrierFabric::new(2, 2, MAX);
        let spec = ChaosSpec::parse(spec).unwrap();
        (
            ChaosCarrier::new(fabric.carrier(0).unwrap(), spec),
            fabric.carrier(1).unwrap(),
        )
    }

    /// Datagram `i`: an 8-byte header (its number) and a 32-byte payload.
    fn header(i: u64) -> [u8; 8] {
        i.to_le_bytes()
    }

    fn payload(i: u64) -> Vec<u8> {
        (0..32u8)
            .map(|k| (i as u8).wrapping_mul(31).wrapping_add(k))
            .collect()
    }

    fn whole(i: u64) -> Vec<u8> {
        let mut v = header(i).to_vec();
        v.extend(payload(i));
        v
    }

    fn send_i(tx: &ChaosCarrier<InprocCarrier>, route: usize, to: u32, i: u64, at: Instant) {
        tx.send_at(route, to, &[&header(i), &payload(i)], None, at)
            .unwrap();
    }

    /// Sends datagrams `0..n` on route 0, all at the same instant, then lets everything held go.
    fn run(spec: &str, n: u64) -> (Vec<Datagram>, ChaosStats) {
        let (tx, rx) = pair(spec);
        for i in 0..n {
            send_i(&tx, 0, 1, i, tx.start);
        }
        tx.flush();
        assert_eq!(tx.held(), 0);
        (received(&rx), tx.stats())
    }

    fn received(rx: &InprocCarrier) -> Vec<Datagram> {
        let mut out = Vec::new();
        rx.recv(&mut out).unwrap();
        for d in &out {
            assert_eq!(d.from, Some(0), "{d:?}");
        }
        out
    }

    /// The number in a datagram's header.
    fn id(d: &Datagram) -> u64 {
        u64::from_le_bytes(d.bytes[..8].try_into().unwrap())
    }

    fn intact(d: &Datagram) -> bool {
        d.bytes[..] == whole(id(d))[..]
    }

    fn ids(ds: &[Datagram]) -> Vec<u64> {
        ds.iter().map(id).collect()
    }

    #[test]
    fn no_faults_passes_everything_in_order() {
        let (got, st) = run("seed=1", 1000);
        assert_eq!(ids(&got), (0..1000).collect::<Vec<_>>());
        assert!(got.iter().all(|d| intact(d) && d.route == 0));
        assert_eq!(
            st,
            ChaosStats {
                seen: 1000,
                ..ChaosStats::default()
            }
        );
        // Routes are kept.
        let (tx, rx) = pair("seed=1");
        send_i(&tx, 1, 1, 5, tx.start);
        send_i(&tx, 0, 1, 6, tx.start);
        let got = received(&rx);
        assert_eq!(
            got.iter().map(|d| (d.route, id(d))).collect::<Vec<_>>(),
            vec![(1, 5), (0, 6)]
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
    fn thirty_percent_loss_over_ten_thousand_datagrams() {
        let (got, st) = run("seed=42,loss=0.3", 10_000);
        assert!((2800..=3200).contains(&st.dropped), "{st:?}");
        assert_eq!(got.len() as u64, 10_000 - st.dropped);
        // What arrives is intact and in order.
        let ids = ids(&got);
        assert!(ids.windows(2).all(|w| w[0] < w[1]));
        assert!(got.iter().all(intact));
    }

    #[test]
    fn duplicates_arrive_twice() {
        let (got, st) = run("seed=5,dup=1", 200);
        assert_eq!(st.duplicated, 200);
        assert_eq!(got.len(), 400);
        for (k, d) in got.iter().enumerate() {
            assert_eq!(id(d), k as u64 / 2);
            assert!(intact(d));
        }
        // Half the time: the extra arrivals are exactly the duplicated datagrams.
        let (got, st) = run("seed=5,dup=0.5", 2000);
        assert!(st.duplicated > 800 && st.duplicated < 1200, "{st:?}");
        assert_eq!(got.len() as u64, 2000 + st.duplicated);
        // Duplicates also go through the held path (with a delay) in order.
        let (got, st) = run("seed=5,dup=1,delay=1s", 50);
        assert_eq!((st.duplicated, st.delayed), (50, 50));
        assert_eq!(ids(&got), (0..50).flat_map(|i| [i, i]).collect::<Vec<_>>());
    }

    #[test]
    fn corruption_changes_exactly_one_byte_of_a_copy_header_included() {
        let (tx, rx) = pair("seed=9,corrupt=1");
        let n = 300u64;
        let headers: Vec<[u8; 8]> = (0..n).map(header).collect();
        let payloads: Vec<Vec<u8>> = (0..n).map(payload).collect();
        for i in 0..n as usize {
            tx.send(0, 1, &[&headers[i], &payloads[i]]).unwrap();
        }
        // An empty datagram has nothing to corrupt.
        tx.send(0, 1, &[]).unwrap();
        tx.send(0, 1, &[b"", b""]).unwrap();
        let got = received(&rx);
        assert_eq!(got.len(), n as usize + 2);
        let mut positions = BTreeSet::new();
        for (i, d) in got.iter().take(n as usize).enumerate() {
            let orig = whole(i as u64);
            assert_eq!(d.bytes.len(), orig.len());
            let diff: Vec<usize> = (0..orig.len()).filter(|&k| d.bytes[k] != orig[k]).collect();
            assert_eq!(diff.len(), 1, "datagram {i}");
            positions.insert(diff[0]);
            // The sender's buffers are untouched.
            assert_eq!(headers[i], header(i as u64));
            assert_eq!(payloads[i], payload(i as u64));
        }
        // Anywhere in the datagram: every byte position was hit, header and payload.
        assert_eq!(positions, (0..40).collect::<BTreeSet<_>>());
        assert!(got[n as usize].bytes.is_empty() && got[n as usize + 1].bytes.is_empty());
        let st = tx.stats();
        assert_eq!(st.corrupted, n);
        assert_eq!(st.seen, n + 2);
        // Corruption through the held path (with a delay) too.
        let (got, st) = run("seed=9,corrupt=0.5,delay=1ms", 400);
        assert!(st.corrupted > 150 && st.corrupted < 250, "{st:?}");
        let bad = got
            .iter()
            .enumerate()
            .filter(|(i, d)| d.bytes[..] != whole(*i as u64)[..])
            .count();
        assert_eq!(bad as u64, st.corrupted);
    }

    #[test]
    fn reorder_changes_order_but_loses_nothing() {
        let (got, st) = run("seed=11,reorder=0.2", 1000);
        let ids = ids(&got);
        let mut sorted = ids.clone();
        sorted.sort_unstable();
        assert_eq!(
            sorted,
            (0..1000).collect::<Vec<_>>(),
            "every datagram exactly once"
        );
        assert_ne!(ids, sorted, "some datagrams overtaken");
        assert!(st.reordered > 150 && st.reordered < 250, "{st:?}");
        assert!(got.iter().all(intact));
    }

    #[test]
    fn a_held_back_datagram_waits_for_its_own_route_and_peer() {
        // Three ranks, two routes: datagrams on another route or to another peer do not release a
        // datagram held for (route 0, rank 1).
        let fabric = InprocCarrierFabric::new(3, 2, MAX);
        let tx = ChaosCarrier::new(
            fabric.carrier(0).unwrap(),
            ChaosSpec::parse("reorder=1").unwrap(),
        );
        let (rx1, rx2) = (fabric.carrier(1).unwrap(), fabric.carrier(2).unwrap());
        let t = tx.start;
        send_i(&tx, 0, 1, 0, t);
        send_i(&tx, 1, 1, 1, t); // held too (reorder=1), and not on route 0
        send_i(&tx, 0, 2, 2, t); // held too, and not to rank 1
        assert_eq!(tx.held(), 3);
        assert!(received(&rx1).is_empty());
        let mut out = Vec::new();
        tx.recv_at(&mut out, t + REORDER_MAX_HOLD - Duration::from_nanos(1))
            .unwrap();
        assert_eq!(tx.held(), 3);
        // Nothing comes for a while: they go out anyway.
        tx.recv_at(&mut out, t + REORDER_MAX_HOLD).unwrap();
        assert_eq!(tx.held(), 0);
        let got = received(&rx1);
        assert_eq!(
            got.iter().map(|d| (d.route, id(d))).collect::<Vec<_>>(),
            vec![(0, 0), (1, 1)]
        );
        assert_eq!(ids(&received(&rx2)), vec![2]);
        assert_eq!(tx.stats().reordered, 3);
    }

    /// Checks the reordering rule on a received sequence of one (route, peer): a datagram that
    /// goes out (a new highest number) is followed by exactly the datagrams held back before it
    /// that are still missing, oldest first.
    fn check_rule(ids: &[u64]) {
        let mut seen = BTreeSet::new();
        let mut k = 0;
        while k < ids.len() {
            let leader = ids[k];
            assert!(seen.iter().all(|&s| s < leader), "{ids:?}");
            seen.insert(leader);
            let all_before: Vec<u64> = ids.iter().copied().filter(|&j| j < leader).collect();
            let missing: Vec<u64> = all_before
                .into_iter()
                .filter(|j| !seen.contains(j))
                .collect();
            assert_eq!(&ids[k + 1..k + 1 + missing.len()], &missing[..], "{ids:?}");
            seen.extend(missing.iter().copied());
            k += 1 + missing.len();
        }
    }

    #[test]
    fn a_held_back_datagram_goes_right_after_the_next_one_on_its_route_to_its_peer() {
        // With reorder=0.5 and a fixed seed, check the rule on every datagram to one peer.
        let (tx, rx) = pair("seed=2,reorder=0.5");
        for i in 0..20 {
            send_i(&tx, 0, 1, i, tx.start);
        }
        tx.flush();
        let ids = ids(&received(&rx));
        assert_eq!(tx.stats().reordered, 12, "this seed holds back 12 of 20");
        let mut sorted = ids.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..20).collect::<Vec<_>>());
        check_rule(&ids);

        // Four (route, peer) streams interleaved: the rule holds per stream, and a released
        // group is contiguous in the global order too (all at one instant, nothing else is due).
        let fabric = InprocCarrierFabric::new(3, 2, MAX);
        let tx = ChaosCarrier::new(
            fabric.carrier(0).unwrap(),
            ChaosSpec::parse("seed=4,reorder=0.4").unwrap(),
        );
        let key = |i: u64| ((i % 2) as usize, 1 + ((i / 2) % 2) as u32);
        for i in 0..400 {
            let (route, to) = key(i);
            send_i(&tx, route, to, i, tx.start);
        }
        tx.flush();
        let mut streams = std::collections::BTreeMap::<(usize, u32), Vec<u64>>::new();
        for (rank, rx) in [
            (1, fabric.carrier(1).unwrap()),
            (2, fabric.carrier(2).unwrap()),
        ] {
            for d in received(&rx) {
                assert_eq!(key(id(&d)), (d.route, rank));
                assert!(intact(&d));
                streams.entry((d.route, rank)).or_default().push(id(&d));
            }
        }
        assert_eq!(streams.len(), 4);
        let mut total = 0;
        for (k, s) in &streams {
            let mut sorted = s.clone();
            sorted.sort_unstable();
            assert_eq!(
                sorted,
                (0..400).filter(|&i| key(i) == *k).collect::<Vec<_>>()
            );
            assert!(s.windows(2).any(|w| w[0] > w[1]), "{k:?} reordered");
            check_rule(s);
            total += s.len();
        }
        assert_eq!(total, 400);
        let st = tx.stats();
        assert!(st.reordered > 120 && st.reordered < 200, "{st:?}");
    }

    #[test]
    fn route_down_window_drops_exactly_the_datagrams_sent_while_down() {
        let (tx, rx) = pair("seed=1,down@100ms,up@300ms");
        for k in 0..50u64 {
            let at = tx.start + Duration::from_millis(10 * k);
            send_i(&tx, (k % 2) as usize, 1, k, at);
        }
        let expected: Vec<u64> = (0..10).chain(30..50).collect();
        assert_eq!(ids(&received(&rx)), expected);
        let st = tx.stats();
        assert_eq!(st.dropped_down, 20);
        assert_eq!(st.dropped, 0);
        assert_eq!(st.seen, 50);
    }

    #[test]
    fn a_per_route_window_drops_only_that_route() {
        let (tx, rx) = pair("seed=1,down:1@100ms,up:1@300ms");
        for k in 0..50u64 {
            let at = tx.start + Duration::from_millis(10 * k);
            send_i(&tx, 0, 1, 2 * k, at);
            send_i(&tx, 1, 1, 2 * k + 1, at);
        }
        let got = received(&rx);
        let route0: Vec<u64> = got.iter().filter(|d| d.route == 0).map(id).collect();
        let route1: Vec<u64> = got.iter().filter(|d| d.route == 1).map(id).collect();
        assert_eq!(route0, (0..50).map(|k| 2 * k).collect::<Vec<_>>());
        assert_eq!(
            route1,
            (0..10).chain(30..50).map(|k| 2 * k + 1).collect::<Vec<_>>()
        );
        assert_eq!(tx.stats().dropped_down, 20);
        assert_eq!(tx.stats().seen, 100);
    }

    #[test]
    fn datagrams_received_on_a_down_route_are_dropped() {
        // Rank 1 receives through the chaos layer; route 1 is down between 100 and 300 ms.
        let fabric = InprocCarrierFabric::new(2, 2, MAX);
        let tx = fabric.carrier(0).unwrap();
        let rx = ChaosCarrier::new(
            fabric.carrier(1).unwrap(),
            ChaosSpec::parse("down:1@100ms,up:1@300ms").unwrap(),
        );
        let t = rx.start;
        let batch = |base: u64| {
            for i in 0..6 {
                let i = base + i;
                tx.send((i % 2) as usize, 1, &[&header(i), &payload(i)])
                    .unwrap();
            }
        };
        let mut out = Vec::new();
        batch(0);
        assert_eq!(rx.recv_at(&mut out, t).unwrap(), 6);
        batch(10);
        let mut down = Vec::new();
        assert_eq!(
            rx.recv_at(&mut down, t + Duration::from_millis(200))
                .unwrap(),
            3
        );
        assert_eq!(ids(&down), vec![10, 12, 14], "route 0 only, in order");
        batch(20);
        assert_eq!(
            rx.recv_at(&mut out, t + Duration::from_millis(300))
                .unwrap(),
            6
        );
        assert_eq!(ids(&out), vec![0, 1, 2, 3, 4, 5, 20, 21, 22, 23, 24, 25]);
        let st = rx.stats();
        assert_eq!(st.dropped_down, 3);
        assert_eq!(st.seen, 0, "nothing was sent through the chaos layer");
    }

    #[test]
    fn set_route_up_flips_a_route_from_code() {
        let (tx, rx) = pair("seed=1");
        assert!(tx.is_route_up(0) && tx.is_route_up(1));
        assert!(!tx.is_route_up(2), "no such route");
        tx.set_route_up(1, false);
        tx.set_route_up(7, false); // ignored
        assert!(tx.is_route_up(0) && !tx.is_route_up(1));
        tx.send(0, 1, &[&header(0)]).unwrap();
        tx.send(1, 1, &[&header(1)]).unwrap();
        assert_eq!(ids(&received(&rx)), vec![0]);
        assert_eq!(tx.stats().dropped_down, 1);
        tx.set_route_up(1, true);
        assert!(tx.is_route_up(1));
        tx.send(1, 1, &[&header(2)]).unwrap();
        assert_eq!(ids(&received(&rx)), vec![2]);

        // A later spec event overrides the code's setting; an earlier one does not.
        let (tx, rx) = pair("down:0@10ms,up:0@100ms");
        let t = tx.start;
        let ms = Duration::from_millis;
        tx.set_route_up_at(0, true, t + ms(20)); // brings route 0 back early
        tx.set_route_up_at(1, false, t + ms(50));
        assert!(tx.route_up_now(0, t + ms(30)));
        assert!(!tx.route_up_now(1, t + ms(60)));
        assert!(
            !tx.route_up_now(1, t + ms(150)),
            "no spec event for route 1"
        );
        tx.set_route_up_at(0, false, t + ms(50));
        assert!(!tx.route_up_now(0, t + ms(99)));
        assert!(tx.route_up_now(0, t + ms(100)), "up:0@100ms came later");
        send_i(&tx, 0, 1, 0, t + ms(60));
        send_i(&tx, 0, 1, 1, t + ms(100));
        assert_eq!(ids(&received(&rx)), vec![1]);
        // The receiving side of a route set down from code drops too.
        let fabric = InprocCarrierFabric::new(2, 2, MAX);
        let rx = ChaosCarrier::new(fabric.carrier(1).unwrap(), ChaosSpec::seeded(0));
        let tx = fabric.carrier(0).unwrap();
        rx.set_route_up(0, false);
        tx.send(0, 1, &[b"a"]).unwrap();
        tx.send(1, 1, &[b"b"]).unwrap();
        let mut out = Vec::new();
        assert_eq!(rx.recv(&mut out).unwrap(), 1);
        assert_eq!((out[0].route, &out[0].bytes[..]), (1, &b"b"[..]));
        assert_eq!(rx.stats().dropped_down, 1);
    }

    #[test]
    fn a_held_datagram_due_while_its_route_is_down_is_dropped() {
        let (tx, rx) = pair("delay=2ms");
        let t = tx.start;
        send_i(&tx, 0, 1, 0, t);
        send_i(&tx, 1, 1, 1, t);
        tx.set_route_up_at(0, false, t + Duration::from_millis(1));
        let mut out = Vec::new();
        tx.recv_at(&mut out, t + Duration::from_millis(3)).unwrap();
        assert_eq!(ids(&received(&rx)), vec![1]);
        let st = tx.stats();
        assert_eq!((st.dropped_down, st.delayed, st.release_errors), (1, 2, 0));
        assert_eq!(tx.held(), 0);
    }

    #[test]
    fn delay_holds_datagrams_until_their_time() {
        let (tx, rx) = pair("delay=2ms");
        let t = tx.start;
        send_i(&tx, 0, 1, 0, t);
        send_i(&tx, 0, 1, 1, t + Duration::from_millis(1));
        assert!(received(&rx).is_empty());
        assert_eq!(tx.held(), 2);
        let mut out = Vec::new();
        tx.recv_at(&mut out, t + Duration::from_micros(2500))
            .unwrap();
        assert_eq!(ids(&received(&rx)), vec![0]);
        // A send releases what is due too.
        send_i(&tx, 0, 1, 2, t + Duration::from_millis(3));
        assert_eq!(ids(&received(&rx)), vec![1]);
        tx.recv_at(&mut out, t + Duration::from_millis(5)).unwrap();
        assert_eq!(ids(&received(&rx)), vec![2]);
        assert!(out.is_empty(), "nothing was sent to rank 0");
        assert_eq!(tx.stats().delayed, 3);
        assert_eq!(tx.held(), 0);
    }

    #[test]
    fn delay_with_the_real_clock_releases_on_poll_which_asks_to_be_polled_again() {
        let (tx, rx) = pair("delay=1ms");
        tx.send(0, 1, &[&header(7)]).unwrap();
        assert!(received(&rx).is_empty());
        let (counter, waker) = CountingWaker::new();
        let mut cx = Context::from_waker(&waker);
        // Held: the poll wakes its own task so it comes back.
        assert_eq!(tx.poll_recv_ready(&mut cx), Poll::Pending);
        assert!(counter.count() >= 1);
        std::thread::sleep(Duration::from_millis(2));
        let _ = tx.poll_recv_ready(&mut cx);
        assert_eq!(ids(&received(&rx)), vec![7]);
        assert_eq!(tx.held(), 0);
        // Nothing held: a poll parks without waking itself, and a datagram to rank 0 wakes it.
        let before = counter.count();
        assert_eq!(tx.poll_recv_ready(&mut cx), Poll::Pending);
        assert_eq!(counter.count(), before);
        rx.send(0, 0, &[b"x"]).unwrap();
        assert_eq!(counter.count(), before + 1);
        assert_eq!(tx.poll_recv_ready(&mut cx), Poll::Ready(()));
        let mut out = Vec::new();
        assert_eq!(tx.recv(&mut out).unwrap(), 1);
        assert_eq!(out[0].from, Some(1));
    }

    #[test]
    fn close_sends_held_datagrams_first_then_refuses() {
        let (tx, rx) = pair("delay=1s");
        tx.send(0, 1, &[&header(0)]).unwrap();
        tx.send(1, 1, &[&header(1)]).unwrap();
        assert_eq!(tx.held(), 2);
        tx.close();
        assert_eq!(tx.held(), 0);
        assert_eq!(ids(&received(&rx)), vec![0, 1]);
        assert_eq!(tx.send(0, 1, &[b"x"]), Err(TransportError::Closed));
        assert_eq!(tx.recv(&mut Vec::new()), Err(TransportError::Closed));
        assert_eq!(tx.stats().seen, 2, "the refused send drew nothing");
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
    fn impossible_sends_fail_before_drawing_and_later_refusals_are_counted() {
        let spec = "seed=13,loss=0.2,corrupt=0.2,dup=0.2";
        let (clean, clean_st) = run(spec, 200);
        let (tx, rx) = pair(spec);
        let big = vec![0u8; MAX + 1];
        for i in 0..200 {
            assert_eq!(
                tx.send_at(2, 1, &[b"x"], None, tx.start),
                Err(TransportError::PeerUnreachable(1))
            );
            match tx.send_at(0, 1, &[&big[..MAX], b"y"], None, tx.start) {
                Err(TransportError::Io { op, message }) => {
                    assert_eq!(op, "chaos carrier send");
                    assert!(message.contains("1025-byte"), "{message}");
                }
                other => panic!("expected an Io error, got {other:?}"),
            }
            send_i(&tx, 0, 1, i, tx.start);
        }
        assert_eq!(
            received(&rx),
            clean,
            "the refused sends did not change any fate"
        );
        assert_eq!(tx.stats(), clean_st);
        // Exactly the limit passes.
        tx.send(0, 1, &[&big[..MAX]]).unwrap();

        // An unknown peer: the inner error comes back when the datagram goes at once, and is
        // counted when it was held.
        let (tx, _rx) = pair("seed=1");
        assert_eq!(
            tx.send(0, 9, &[b"x"]),
            Err(TransportError::PeerUnreachable(9))
        );
        assert_eq!(tx.stats().release_errors, 0);
        let (tx, _rx) = pair("seed=1,delay=1ms,dup=1");
        tx.send_at(0, 9, &[b"x"], None, tx.start).unwrap();
        assert_eq!(tx.held(), 2);
        tx.flush();
        assert_eq!(tx.stats().release_errors, 2);
        let (tx, _rx) = pair("seed=1,dup=1");
        assert_eq!(
            tx.send(0, 9, &[b"x"]),
            Err(TransportError::PeerUnreachable(9))
        );
        assert_eq!(tx.stats().release_errors, 1, "the duplicate's refusal");
    }

    #[test]
    fn routes_limits_and_debug_pass_through() {
        let (tx, _rx) = pair("seed=1");
        assert_eq!(tx.routes(), 2);
        assert_eq!(tx.max_datagram(), MAX);
        assert_eq!(tx.spec(), &ChaosSpec::seeded(1));
        assert_eq!(tx.inner().rank(), 0);
        let text = format!("{tx:?}");
        assert!(
            text.contains("ChaosCarrier") && text.contains("InprocCarrier"),
            "{text}"
        );
        // An absurd delay does not overflow.
        let (tx, rx) = pair("delay=18446744073s");
        tx.send(0, 1, &[b"x"]).unwrap();
        assert_eq!(tx.held(), 1);
        tx.flush();
        assert_eq!(received(&rx).len(), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_parked_receiver_gets_everything_through_chaos_with_delay_and_reorder() {
        let fabric = InprocCarrierFabric::new(2, 2, MAX);
        let tx = Arc::new(ChaosCarrier::new(
            fabric.carrier(0).unwrap(),
            ChaosSpec::parse("seed=3,reorder=0.3,delay=100us").unwrap(),
        ));
        let rx = fabric.carrier(1).unwrap();
        let receiver = tokio::spawn(async move {
            let mut got = Vec::new();
            while got.len() < 200 {
                std::future::poll_fn(|cx| rx.poll_recv_ready(cx)).await;
                rx.recv(&mut got).unwrap();
            }
            got
        });
        for i in 0..200u64 {
            tx.send((i % 2) as usize, 1, &[&header(i), &payload(i)])
                .unwrap();
        }
        // The sender's own progress task parks on `poll_recv_ready` (rank 0 receives nothing):
        // only the chaos layer's own wake-ups while something is held bring it back.
        let pump = Arc::clone(&tx);
        tokio::time::timeout(Duration::from_secs(10), async move {
            std::future::poll_fn(|cx| {
                let p = pump.poll_recv_ready(cx);
                if pump.held() == 0 { Poll::Ready(()) } else { p }
            })
            .await;
        })
        .await
        .expect("held datagrams are released by polling");
        let got = tokio::time::timeout(Duration::from_secs(10), receiver)
            .await
            .expect("everything arrives")
            .unwrap();
        let mut sorted = ids(&got);
        sorted.sort_unstable();
        assert_eq!(sorted, (0..200).collect::<Vec<_>>());
        assert!(got.iter().all(intact));
    }
}
