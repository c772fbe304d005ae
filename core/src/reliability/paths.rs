//! The routes of one link: which are up, which carries the next packet, what each delivers and
//! loses, and the probing that brings a dead route back (LA-MPI's path scheduler, per peer).
//!
//! A [`PathScheduler`] knows nothing of sequence numbers or payloads. The
//! [`ReliableLink`](super::ReliableLink) asks it where to send (new DATA, retransmissions,
//! ACKs), and tells it what happened: packets sent and received per route, packets acknowledged
//! and lost (from the [`RetransmitQueue`](super::RetransmitQueue)'s
//! [`QueueEvent`](super::retransmit::QueueEvent)s), retransmission timer expiries, PONGs.
//!
//! # Rules
//!
//! * **Up or Down.** Every route starts Up. The *primary* route is the lowest-numbered Up route.
//! * **Choosing a route for new DATA.** A payload of at most
//!   [`stripe_threshold`](PathScheduler::new) bytes goes on the primary route, so small messages
//!   stay in order on one path and see one latency. A larger one is *striped*: it goes on the Up
//!   route with the earliest expected completion, `(bytes in flight on r + len) / rate(r)`, where
//!   `rate(r)` is the measured throughput of `r` (an EWMA of bytes acknowledged per unit time
//!   while `r` had packets in flight; a route not measured yet counts as fast as the fastest
//!   measured one, and all count equal at start). A window-limited transfer thus keeps every
//!   route busy and splits its bytes in proportion to the routes' throughput.
//! * **Retransmissions** go on an Up route other than the one the packet was last sent on when
//!   there is one (the loss is evidence against that route), chosen as for new DATA among those.
//! * **Strikes.** A *loss event* on route `r` is a strike against it: the retransmission timer
//!   expiring for a packet last sent on `r`, or loss detection finding a packet last sent on `r`
//!   lost when nothing sent on `r` at or after it has been acknowledged (a loss followed by
//!   later deliveries on the same route is random loss, not a dead route). At most one strike
//!   per route counts per detection pass (one ACK, or one timer expiry), and strikes against a
//!   route count at least one smoothed round trip apart, so a burst, or one late batch seen by
//!   several ACKs, counts once. An ACK of a packet sent only on `r` (never retransmitted
//!   elsewhere) resets `r`'s strikes.
//! * **Loss delay per route.** Packets striped over routes of different speeds arrive out of
//!   order by design, so loss detection judges a packet by the round trips of the route it was
//!   last sent on ([`loss_delay`](PathScheduler::loss_delay)), not by the link's blended RTT.
//! * **Failover.** At `route_strikes` consecutive strikes `r` goes Down
//!   ([`RouteChange::Down`]; [`RouteStats::failovers`] counts it) and the link retransmits at
//!   once, on the remaining Up routes, every unacknowledged packet last sent on `r`
//!   (rebinding).
//! * **All Down.** When no route is Up, packets go on all routes in turn (new DATA round-robin,
//!   a retransmission on the route after its previous one): while any route delivers, messages
//!   get through, and the link's retry limit alone decides when the peer is dead.
//! * **Probing and fail-back.** A Down route is probed with a PING every `probe_interval`; each
//!   PING carries a fresh nonce naming the route. A PONG arriving *on that route* with a nonce
//!   sent on it since it went down brings it Up again ([`RouteChange::Up`];
//!   [`RouteStats::recoveries`]), with no strikes and its throughput to be measured afresh; it
//!   carries traffic at once.
//! * **ACK route.** Standalone ACKs go on the route the latest DATA arrived on if that route is
//!   Up (the reverse of a working path), else on the primary.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::retransmit::SentPacket;
use super::rtt::RttEstimator;

/// Shortest interval over which a route's throughput is sampled.
pub const MIN_RATE_INTERVAL: Duration = Duration::from_micros(500);

/// Counters and state of one route of one link.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RouteStats {
    /// Packets sent on this route (all kinds).
    pub packets_sent: u64,
    /// Bytes sent on this route (whole packets, headers included).
    pub bytes_sent: u64,
    /// Valid packets of this link received on this route (all kinds).
    pub packets_received: u64,
    /// Bytes of those packets.
    pub bytes_received: u64,
    /// DATA retransmissions sent on this route.
    pub retransmitted: u64,
    /// Times the route was marked Down.
    pub failovers: u64,
    /// Times a probe brought the route back Up.
    pub recoveries: u64,
    /// Whether the route is Up (carries traffic) now.
    pub up: bool,
    /// Consecutive strikes against the route now (see the [module docs](self)).
    pub strikes: u32,
    /// Payload bytes of unacknowledged DATA packets whose latest transmission went on this route.
    pub in_flight_bytes: u64,
    /// Estimated throughput in bytes per second (acknowledged payload bytes); `0` until
    /// measured.
    pub throughput: u64,
    /// Smoothed round-trip time of DATA on this route (queueing included); zero until
    /// measured.
    pub srtt: Duration,
    /// Packets that arrived on this route with a bad CRC.
    pub crc_failures: u64,
    /// PINGs sent on this route while it was Down.
    pub pings_sent: u64,
}

/// A change of a route's state, for the link to report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouteChange {
    /// The route went Down (the link rebinds its packets and reports it).
    Down(usize),
    /// A probe brought the route back Up.
    Up(usize),
}

/// Per-route state beyond the counters.
#[derive(Clone, Debug)]
struct RouteState {
    /// Round trips of DATA sent (only) on this route: its loss delay.
    rtt: RttEstimator,
    /// `(order, last_sent)` of the latest-sent, never retransmitted packet acknowledged in the
    /// current pass: the route's RTT sample.
    pass_sample: Option<(u64, Instant)>,
    /// Measured throughput, bytes per second.
    rate: Option<f64>,
    /// Start of the current throughput sample: the first ACK after the route was idle.
    interval_start: Option<Instant>,
    /// Payload bytes acknowledged since `interval_start`.
    interval_bytes: u64,
    /// Latest (last) send time of a packet sent only on this route and acknowledged.
    latest_acked_sent: Option<Instant>,
    /// A strike was counted in the current detection pass.
    struck_in_pass: bool,
    /// When the latest strike counted.
    last_strike: Option<Instant>,
    /// While Down: when to send the next PING.
    next_probe: Option<Instant>,
    /// A PING is due (taken by [`PathScheduler::take_probe`]).
    probe_due: bool,
    /// Nonces sent on this route: the first of the current Down period, and the next one.
    first_nonce: u64,
    next_nonce: u64,
}

impl RouteState {
    /// A fresh route whose PING nonces start at `first_nonce`.
    fn new(first_nonce: u64) -> Self {
        Self {
            rtt: RttEstimator::new(Duration::ZERO, Duration::ZERO, Duration::MAX),
            pass_sample: None,
            rate: None,
            interval_start: None,
            interval_bytes: 0,
            latest_acked_sent: None,
            struck_in_pass: false,
            last_strike: None,
            next_probe: None,
            probe_due: false,
            first_nonce,
            next_nonce: first_nonce,
        }
    }
}

/// The routes of one link (see the [module docs](self)).
#[derive(Clone, Debug)]
pub struct PathScheduler {
    stats: Vec<RouteStats>,
    state: Vec<RouteState>,
    stripe_threshold: usize,
    route_strikes: u32,
    probe_interval: Duration,
    /// Next route for new DATA when every route is Down.
    round_robin: usize,
    changes: VecDeque<RouteChange>,
}

/// Bits of a nonce left for the per-route counter (the route number is above them).
const NONCE_COUNTER_BITS: u32 = 48;

impl PathScheduler {
    /// `routes` routes (at least 1), all Up. Payloads of at most `stripe_threshold` bytes go on
    /// the primary route; a route goes Down after `route_strikes` strikes (at least 1); a Down
    /// route is pinged every `probe_interval`.
    pub fn new(
        routes: usize,
        stripe_threshold: usize,
        route_strikes: u32,
        probe_interval: Duration,
    ) -> Self {
        let routes = routes.max(1);
        let state = (0..routes)
            .map(|r| RouteState::new((r as u64) << NONCE_COUNTER_BITS))
            .collect();
        Self {
            stats: vec![
                RouteStats {
                    up: true,
                    ..RouteStats::default()
                };
                routes
            ],
            state,
            stripe_threshold,
            route_strikes: route_strikes.max(1),
            probe_interval,
            round_robin: 0,
            changes: VecDeque::new(),
        }
    }

    /// Number of routes.
    pub fn len(&self) -> usize {
        self.stats.len()
    }

    /// Always `false`: a scheduler has at least one route.
    pub fn is_empty(&self) -> bool {
        self.stats.is_empty()
    }

    /// Counters and state, one entry per route.
    pub fn stats(&self) -> &[RouteStats] {
        &self.stats
    }

    /// Whether `route` exists and is Up.
    pub fn is_up(&self, route: usize) -> bool {
        self.stats.get(route).is_some_and(|s| s.up)
    }

    /// Routes Up now.
    pub fn up_count(&self) -> usize {
        self.stats.iter().filter(|s| s.up).count()
    }

    /// The primary route: the lowest-numbered Up route (`None` when all are Down).
    pub fn primary(&self) -> Option<usize> {
        self.stats.iter().position(|s| s.up)
    }

    /// The throughput used for scheduling: measured, else the fastest measured Up route's, else 1.
    fn effective_rate(&self, route: usize) -> f64 {
        self.state[route].rate.unwrap_or_else(|| {
            self.state
                .iter()
                .zip(&self.stats)
                .filter(|(_, s)| s.up)
                .filter_map(|(st, _)| st.rate)
                .fold(1.0, f64::max)
        })
    }

    /// The candidate with the earliest expected completion of `len` more bytes (lowest number on
    /// a tie); `None` if there is no candidate.
    fn earliest_completion(
        &self,
        len: usize,
        candidates: impl Iterator<Item = usize>,
    ) -> Option<usize> {
        let mut best: Option<(f64, usize)> = None;
        for r in candidates {
            let cost = (self.stats[r].in_flight_bytes as f64 + len as f64) / self.effective_rate(r);
            if best.is_none_or(|(c, _)| cost < c) {
                best = Some((cost, r));
            }
        }
        best.map(|(_, r)| r)
    }

    /// The route for a new DATA packet with a payload of `len` bytes.
    pub fn pick_new(&mut self, len: usize) -> usize {
        if self.up_count() == 0 {
            let r = self.round_robin % self.len();
            self.round_robin = (r + 1) % self.len();
            return r;
        }
        if len <= self.stripe_threshold {
            return self.primary().unwrap_or(0);
        }
        let up = (0..self.len()).filter(|&r| self.stats[r].up);
        self.earliest_completion(len, up).unwrap_or(0)
    }

    /// The route for the retransmission of a packet of `len` payload bytes last sent on
    /// `previous`.
    pub fn pick_retransmit(&self, len: usize, previous: usize) -> usize {
        let n = self.len();
        let up = self.up_count();
        if up == 0 {
            return (previous + 1) % n;
        }
        let avoid_previous = up > 1 || !self.is_up(previous);
        let candidates = (0..n).filter(|&r| self.stats[r].up && !(avoid_previous && r == previous));
        if len <= self.stripe_threshold {
            let mut candidates = candidates;
            return candidates.next().unwrap_or(0);
        }
        self.earliest_completion(len, candidates).unwrap_or(0)
    }

    /// The route for a standalone ACK, given the route the latest DATA arrived on.
    pub fn ack_route(&self, last_data_route: Option<usize>) -> usize {
        last_data_route
            .filter(|&r| self.is_up(r))
            .or(self.primary())
            .or(last_data_route.filter(|&r| r < self.len()))
            .unwrap_or(0)
    }

    /// A packet of `wire_len` bytes (whole packet) goes out on `route`.
    pub fn on_transmit(&mut self, route: usize, wire_len: usize) {
        if let Some(s) = self.stats.get_mut(route) {
            s.packets_sent += 1;
            s.bytes_sent += wire_len as u64;
        }
    }

    /// A DATA packet with `len` payload bytes is sent for the first time on `route`.
    pub fn on_data_sent(&mut self, route: usize, len: usize) {
        let Some(s) = self.stats.get_mut(route) else {
            return;
        };
        if s.in_flight_bytes == 0 {
            // The route was idle: the idle time is no measure of its throughput. The next sample
            // starts at the first ACK (measuring from the send would count the round trip).
            self.state[route].interval_start = None;
            self.state[route].interval_bytes = 0;
        }
        s.in_flight_bytes += len as u64;
    }

    /// A DATA packet with `len` payload bytes, last sent on `previous`, is sent again on `route`.
    pub fn on_resent(&mut self, previous: usize, route: usize, len: usize) {
        if let Some(s) = self.stats.get_mut(previous) {
            s.in_flight_bytes = s.in_flight_bytes.saturating_sub(len as u64);
        }
        self.on_data_sent(route, len);
        if let Some(s) = self.stats.get_mut(route) {
            s.retransmitted += 1;
        }
    }

    /// A valid packet of `wire_len` bytes arrived on `route`.
    pub fn on_received(&mut self, route: usize, wire_len: usize) {
        if let Some(s) = self.stats.get_mut(route) {
            s.packets_received += 1;
            s.bytes_received += wire_len as u64;
        }
    }

    /// A packet with a bad CRC arrived on `route`.
    pub fn on_corrupt(&mut self, route: usize) {
        if let Some(s) = self.stats.get_mut(route) {
            s.crc_failures += 1;
        }
    }

    /// The packet `p` was acknowledged (at `now`); `rate_interval` is the shortest throughput
    /// sample (the link passes its smoothed RTT; at least [`MIN_RATE_INTERVAL`] is used).
    pub fn on_acked(&mut self, p: &SentPacket, now: Instant, rate_interval: Duration) {
        let r = p.route;
        let (Some(s), Some(st)) = (self.stats.get_mut(r), self.state.get_mut(r)) else {
            return;
        };
        let len = p.payload.len() as u64;
        s.in_flight_bytes = s.in_flight_bytes.saturating_sub(len);
        if !p.retransmitted {
            let sample = Some((p.order, p.last_sent));
            st.pass_sample = st.pass_sample.max(sample);
        }
        if p.single_route {
            s.strikes = 0;
            st.latest_acked_sent = Some(
                st.latest_acked_sent
                    .map_or(p.last_sent, |t| t.max(p.last_sent)),
            );
        }
        let Some(start) = st.interval_start else {
            // The first ACK since the route was idle starts a sample (its bytes were delivered
            // before the sample began).
            st.interval_start = (s.in_flight_bytes > 0).then_some(now);
            return;
        };
        {
            st.interval_bytes += len;
            let elapsed = now.saturating_duration_since(start);
            if elapsed >= rate_interval.max(MIN_RATE_INTERVAL) {
                let sample = st.interval_bytes as f64 / elapsed.as_secs_f64();
                let rate = st.rate.map_or(sample, |old| 0.75 * old + 0.25 * sample);
                st.rate = Some(rate);
                s.throughput = rate as u64;
                st.interval_start = Some(now);
                st.interval_bytes = 0;
            }
        }
        if s.in_flight_bytes == 0 {
            st.interval_start = None;
        }
    }

    /// Loss detection found `p` lost: a strike against its route unless something sent on that
    /// route at or after it was acknowledged. Applied by [`end_pass`](Self::end_pass).
    pub fn on_lost(&mut self, p: &SentPacket) {
        if let Some(st) = self.state.get_mut(p.route) {
            if st.latest_acked_sent.is_none_or(|t| p.last_sent > t) {
                st.struck_in_pass = true;
            }
        }
    }

    /// The retransmission timer expired for a packet last sent on `route`: a strike. Applied by
    /// [`end_pass`](Self::end_pass).
    pub fn on_timer_expired(&mut self, route: usize) {
        if let Some(st) = self.state.get_mut(route) {
            st.struck_in_pass = true;
        }
    }

    /// Ends a detection pass: counts one strike per route struck in it, unless that route's
    /// previous strike was less than `spacing` ago (the link passes its smoothed RTT: strikes
    /// are losses a round trip apart, not one reordering seen by several ACKs), and marks Down
    /// each Up route that reached the strike limit (reported by
    /// [`poll_change`](Self::poll_change)).
    ///
    /// Also takes each route's RTT sample of the pass.
    pub fn end_pass(&mut self, now: Instant, spacing: Duration) {
        for r in 0..self.len() {
            let st = &mut self.state[r];
            if let Some((_, sent)) = st.pass_sample.take() {
                st.rtt.on_sample(now.saturating_duration_since(sent));
                self.stats[r].srtt = st.rtt.smoothed().unwrap_or_default();
            }
            if !std::mem::take(&mut st.struck_in_pass) || !self.stats[r].up {
                continue;
            }
            if st
                .last_strike
                .is_some_and(|t| now.saturating_duration_since(t) < spacing)
                && self.stats[r].strikes > 0
            {
                continue;
            }
            st.last_strike = Some(now);
            self.stats[r].strikes += 1;
            if self.stats[r].strikes >= self.route_strikes {
                self.mark_down(r, now);
            }
        }
    }

    /// Marks `route` Down now (as the strike limit does) and starts probing it. Does nothing if
    /// it is Down already.
    pub fn mark_down(&mut self, route: usize, now: Instant) {
        if !self.is_up(route) {
            return;
        }
        let (s, st) = (&mut self.stats[route], &mut self.state[route]);
        s.up = false;
        s.strikes = 0;
        s.failovers += 1;
        st.next_probe = Some(now + self.probe_interval);
        st.probe_due = false;
        st.first_nonce = st.next_nonce;
        self.changes.push_back(RouteChange::Down(route));
    }

    /// The loss delay of packets last sent on `route` (see
    /// [`RttEstimator::loss_delay`]), from that route's own round trips: striped packets are
    /// reordered across routes by design, so a packet is judged by its route's delay. `None`
    /// until the route has a sample.
    pub fn loss_delay(&self, route: usize, stretch_quarters: u32) -> Option<Duration> {
        self.state.get(route)?.rtt.loss_delay(stretch_quarters)
    }

    /// The next state change to report.
    pub fn poll_change(&mut self) -> Option<RouteChange> {
        self.changes.pop_front()
    }

    /// When the next PING is due, if a route is Down.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.state.iter().filter_map(|st| st.next_probe).min()
    }

    /// Marks PINGs due for the Down routes whose probe time has come, and schedules the next.
    pub fn on_timeout(&mut self, now: Instant) {
        for st in &mut self.state {
            if st.next_probe.is_some_and(|t| t <= now) {
                st.probe_due = true;
                st.next_probe = Some(now + self.probe_interval);
            }
        }
    }

    /// A due PING: the route to send it on and its nonce.
    pub fn take_probe(&mut self) -> Option<(usize, u64)> {
        let r = self.state.iter().position(|st| st.probe_due)?;
        let (s, st) = (&mut self.stats[r], &mut self.state[r]);
        st.probe_due = false;
        let nonce = st.next_nonce;
        let counter_mask = (1u64 << NONCE_COUNTER_BITS) - 1;
        st.next_nonce = (nonce & !counter_mask) | (nonce.wrapping_add(1) & counter_mask);
        s.pings_sent += 1;
        Some((r, nonce))
    }

    /// A PONG with `nonce` arrived on `route`: brings the route Up if it is Down and the nonce
    /// is one of the PINGs sent on it since it went down. Returns whether it did.
    pub fn on_pong(&mut self, route: usize, nonce: u64) -> bool {
        let Some(st) = self.state.get_mut(route) else {
            return false;
        };
        let s = &mut self.stats[route];
        let counter_mask = (1u64 << NONCE_COUNTER_BITS) - 1;
        let sent_since_down = nonce & !counter_mask == st.first_nonce & !counter_mask
            && (nonce.wrapping_sub(st.first_nonce) & counter_mask)
                < (st.next_nonce.wrapping_sub(st.first_nonce) & counter_mask);
        if s.up || !sent_since_down {
            return false;
        }
        s.up = true;
        s.strikes = 0;
        s.recoveries += 1;
        s.throughput = 0;
        *st = RouteState::new(st.next_nonce);
        s.srtt = Duration::ZERO;
        self.changes.push_back(RouteChange::Up(route));
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    const MS: Duration = Duration::from_millis(1);

    fn sent(route: usize, len: usize, at: Instant, single_route: bool) -> SentPacket {
        SentPacket {
            payload: Bytes::from(vec![0; len]).into(),
            first_sent: at,
            last_sent: at,
            retries: 0,
            retransmitted: !single_route,
            route,
            single_route,
            order: 0,
            seq: 1,
        }
    }

    #[test]
    fn small_on_primary_large_striped_by_completion() {
        let mut p = PathScheduler::new(3, 100, 3, 50 * MS);
        assert_eq!(p.pick_new(100), 0);
        // Equal (unmeasured) rates: the least loaded route.
        for expected in [0, 1, 2, 0, 1, 2] {
            let r = p.pick_new(1000);
            assert_eq!(r, expected);
            p.on_data_sent(r, 1000);
        }
        assert_eq!(p.pick_new(1), 0);
    }

    #[test]
    fn throughput_is_measured_and_steers_striping() {
        let t0 = Instant::now();
        let mut p = PathScheduler::new(2, 0, 3, 50 * MS);
        p.on_data_sent(0, 6000);
        p.on_data_sent(1, 6000);
        // Route 0 delivers 2000 bytes per ms, route 1 1000; the first ACK starts the sample.
        for k in 0..=1 {
            p.on_acked(&sent(0, 2000, t0, true), t0 + k * MS, MS);
        }
        for k in 0..=3 {
            p.on_acked(&sent(1, 1000, t0, true), t0 + k * MS, MS);
        }
        assert_eq!(p.stats()[0].throughput, 2_000_000);
        assert_eq!(p.stats()[1].throughput, 1_000_000);
        for _ in 0..300 {
            let r = p.pick_new(1000);
            p.on_data_sent(r, 1000);
        }
        // Bytes in flight end up in proportion to the throughput (within one packet).
        let (a, b) = (p.stats()[0].in_flight_bytes, p.stats()[1].in_flight_bytes);
        assert_eq!(a + b, 4000 + 300_000);
        assert!(a.abs_diff(2 * b) <= 2000, "{a} vs {b}");
    }

    #[test]
    fn strikes_failover_probe_and_fail_back() {
        let t0 = Instant::now();
        let mut p = PathScheduler::new(2, 0, 3, 50 * MS);
        p.on_data_sent(1, 10);
        // A loss followed by a delivery on the same route is not a strike.
        p.on_acked(&sent(1, 10, t0 + MS, true), t0 + 2 * MS, MS);
        p.on_lost(&sent(1, 10, t0, true));
        p.end_pass(t0 + 2 * MS, MS);
        assert_eq!(p.stats()[1].strikes, 0);
        // Three passes with newer losses: Down. Several losses in one pass count once.
        for k in 0..3 {
            p.on_lost(&sent(1, 10, t0 + 5 * MS, true));
            p.on_lost(&sent(1, 10, t0 + 6 * MS, true));
            p.end_pass(t0 + (10 + k) * MS, MS);
        }
        assert_eq!(p.poll_change(), Some(RouteChange::Down(1)));
        assert_eq!(p.poll_change(), None);
        assert!(!p.is_up(1) && p.stats()[1].failovers == 1);
        assert_eq!(p.pick_new(1000), 0);
        assert_eq!(p.pick_retransmit(1000, 1), 0);
        assert_eq!(p.ack_route(Some(1)), 0);
        // Probing.
        assert_eq!(p.poll_timeout(), Some(t0 + 62 * MS));
        p.on_timeout(t0 + 61 * MS);
        assert_eq!(p.take_probe(), None);
        p.on_timeout(t0 + 62 * MS);
        let (route, nonce) = p.take_probe().unwrap();
        assert_eq!(route, 1);
        assert_eq!(p.take_probe(), None);
        assert_eq!(p.poll_timeout(), Some(t0 + 112 * MS));
        // A PONG on the wrong route, or with a nonce never sent, does nothing.
        assert!(!p.on_pong(0, nonce));
        assert!(!p.on_pong(1, nonce + 1));
        assert!(!p.on_pong(7, nonce));
        assert!(p.on_pong(1, nonce));
        assert_eq!(p.poll_change(), Some(RouteChange::Up(1)));
        assert!(p.is_up(1) && p.stats()[1].recoveries == 1);
        assert_eq!(p.poll_timeout(), None);
        // A late PONG of the same nonce after the route went down again does not count.
        p.mark_down(1, t0 + 200 * MS);
        assert!(!p.on_pong(1, nonce));
    }

    #[test]
    fn all_down_uses_every_route() {
        let t0 = Instant::now();
        let mut p = PathScheduler::new(2, 100, 1, 50 * MS);
        p.mark_down(0, t0);
        assert_eq!(p.primary(), Some(1));
        assert_eq!(p.pick_new(1), 1);
        assert_eq!(p.pick_retransmit(1, 1), 1); // the only Up route, even if it lost it
        p.on_timer_expired(1);
        p.end_pass(t0, MS);
        assert_eq!(p.up_count(), 0);
        let picks: Vec<usize> = (0..4).map(|_| p.pick_new(1)).collect();
        assert_eq!(picks, vec![0, 1, 0, 1]);
        assert_eq!(p.pick_retransmit(1, 0), 1);
        assert_eq!(p.pick_retransmit(1, 1), 0);
        assert_eq!(p.ack_route(Some(1)), 1);
    }
}
