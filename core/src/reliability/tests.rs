//! Two [`ReliableLink`]s over a simulated multi-route network with a seeded PRNG and a simulated
//! clock: loss, duplication, corruption, reordering, outages, per-route bandwidth and dead
//! routes.

use std::time::{Duration, Instant};

use bytes::Bytes;

use super::*;

const JOB: u64 = 0x05EE_D0F1_0B00_0001;
const US: Duration = Duration::from_micros(1);
const MS: Duration = Duration::from_millis(1);

/// The simulations' seeded generator.
type Rng = crate::rng::SplitMix64;

#[derive(Clone, Copy, Default)]
struct Faults {
    loss: f64,
    duplicate: f64,
    corrupt: f64,
    /// Extra random delay up to this, on top of the base one-way delay: reordering.
    jitter: Duration,
    /// Every packet sent in `[start, end)` (offsets from the start) is lost, on every route.
    outage: Option<(Duration, Duration)>,
}

#[derive(Default, Debug)]
struct Injected {
    lost: u64,
    duplicated: u64,
    corrupted: u64,
    /// Packets dropped because their route was down.
    route_dropped: u64,
}

/// One simulated route between the two endpoints.
#[derive(Clone, Debug)]
struct SimRoute {
    /// One-way propagation delay.
    delay: Duration,
    /// Bytes per second in each direction; `None`: unlimited.
    bandwidth: Option<f64>,
    /// When each sender's side of the wire is free again (index: sender).
    busy_until: [Option<Instant>; 2],
    /// While set, everything sent on the route is dropped, both ways.
    down: bool,
    /// DATA payload bytes and DATA packets each endpoint sent on this route.
    data_bytes: [u64; 2],
    data_packets: [u64; 2],
}

impl SimRoute {
    fn new(bandwidth: Option<f64>) -> Self {
        Self {
            delay: 20 * US,
            bandwidth,
            busy_until: [None; 2],
            down: false,
            data_bytes: [0; 2],
            data_packets: [0; 2],
        }
    }
}

struct Sim {
    start: Instant,
    now: Instant,
    links: [ReliableLink; 2],
    rng: Rng,
    faults: Faults,
    routes: Vec<SimRoute>,
    in_flight: Vec<(Instant, usize, usize, Bytes)>,
    injected: Injected,
    /// Whether endpoint `i` is alive (a dead one neither answers nor transmits).
    alive: [bool; 2],
    /// Whether endpoint `i`'s application takes delivered payloads.
    consuming: [bool; 2],
    /// Payloads endpoint `i` received (checked in order as they arrive).
    delivered: [usize; 2],
    /// Payloads endpoint `i` sends in all.
    to_send: [usize; 2],
    /// Payloads endpoint `i` handed to its link so far.
    queued: [usize; 2],
    /// Ping-pong: endpoint 0 sends message `k + 1` when reply `k` arrives; 1 answers each.
    ping_pong: bool,
    /// Payload length of message `k`.
    size: fn(usize) -> usize,
    events: [Vec<LinkEvent>; 2],
    header: Vec<u8>,
    other_errors: u64,
    steps: u64,
    /// Packets go to [`ReliableLink::receive`] (the acknowledgement they carry applied later,
    /// as the link transport does), even seeds; odd seeds use `handle_packet`.
    defer_acks: bool,
}

fn small(k: usize) -> usize {
    (k * 37) % 300
}

fn large(k: usize) -> usize {
    16 * 1024 + (k * 101) % 4096
}

fn payload(from: usize, k: usize, len: usize) -> Bytes {
    let mut v = Vec::with_capacity(len + 9);
    v.push(from as u8);
    v.extend_from_slice(&(k as u64).to_le_bytes());
    v.extend((0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(k as u8)));
    Bytes::from(v)
}

impl Sim {
    fn new(seed: u64, config: LinkConfig, faults: Faults, messages: [usize; 2]) -> Self {
        Self::with_routes(
            seed,
            config,
            faults,
            messages,
            vec![SimRoute::new(None)],
            small,
        )
    }

    fn with_routes(
        seed: u64,
        config: LinkConfig,
        faults: Faults,
        messages: [usize; 2],
        routes: Vec<SimRoute>,
        size: fn(usize) -> usize,
    ) -> Self {
        let start = Instant::now();
        let n = routes.len();
        let mut sim = Self {
            start,
            now: start,
            links: [
                ReliableLink::new(config.clone(), JOB, 0, 1, n),
                ReliableLink::new(config, JOB, 1, 0, n),
            ],
            rng: crate::rng::SplitMix64(seed),
            faults,
            routes,
            in_flight: Vec::new(),
            injected: Injected::default(),
            alive: [true; 2],
            consuming: [true; 2],
            delivered: [0; 2],
            to_send: messages,
            queued: [0; 2],
            ping_pong: false,
            size,
            events: [Vec::new(), Vec::new()],
            header: Vec::new(),
            other_errors: 0,
            steps: 0,
            defer_acks: seed % 2 == 0,
        };
        for (i, n) in messages.into_iter().enumerate() {
            sim.queue_up_to(i, n);
        }
        sim
    }

    /// A ping-pong of `n` round trips.
    fn ping_pong(seed: u64, config: LinkConfig, n: usize, routes: usize) -> Self {
        let routes = (0..routes).map(|_| SimRoute::new(None)).collect();
        let mut sim = Self::with_routes(seed, config, Faults::default(), [0, 0], routes, small);
        sim.to_send = [n, n];
        sim.ping_pong = true;
        sim.queue_up_to(0, 1);
        sim
    }

    /// Hands endpoint `i`'s messages up to number `n` (exclusive) to its link.
    fn queue_up_to(&mut self, i: usize, n: usize) {
        while self.queued[i] < n.min(self.to_send[i]) {
            let k = self.queued[i];
            self.links[i].send(self.now, payload(i, k, (self.size)(k)));
            self.queued[i] += 1;
        }
    }

    fn transmit(&mut self, from: usize, t: Transmit) {
        // What a transport does: the header into a reused buffer, the payload from its own.
        t.packet.write_header(&mut self.header);
        let mut wire = self.header.clone();
        if let Some(p) = t.packet.payload() {
            for part in p.parts() {
                wire.extend_from_slice(part);
            }
        }
        let bytes = Bytes::from(wire);
        assert_eq!(bytes, t.packet.encode(), "write_header + payload == encode");
        assert!(
            t.route < self.routes.len(),
            "route {} out of range",
            t.route
        );
        let route = &mut self.routes[t.route];
        if let PacketBody::Data { payload, .. } = &t.packet.body {
            route.data_bytes[from] += payload.len() as u64;
            route.data_packets[from] += 1;
        }
        if route.down {
            self.injected.route_dropped += 1;
            return;
        }
        let since = self.now - self.start;
        if self
            .faults
            .outage
            .is_some_and(|(a, b)| a <= since && since < b)
            || self.rng.chance(self.faults.loss)
        {
            self.injected.lost += 1;
            return;
        }
        // Serialization on the sender's side of the route, then propagation.
        let on_wire = match route.bandwidth {
            Some(bw) => {
                let begin = route.busy_until[from].map_or(self.now, |b| b.max(self.now));
                let end = begin + Duration::from_secs_f64(bytes.len() as f64 / bw);
                route.busy_until[from] = Some(end);
                end
            }
            None => self.now,
        };
        let arrival = on_wire + route.delay;
        let copies = if self.rng.chance(self.faults.duplicate) {
            self.injected.duplicated += 1;
            2
        } else {
            1
        };
        for _ in 0..copies {
            let mut bytes = bytes.clone();
            if self.rng.chance(self.faults.corrupt) {
                self.injected.corrupted += 1;
                let mut v = bytes.to_vec();
                let i = self.rng.below(v.len() as u64) as usize;
                v[i] ^= 1 << self.rng.below(8);
                bytes = Bytes::from(v);
            }
            let jitter = self.faults.jitter.as_nanos() as u64;
            let extra = Duration::from_nanos(self.rng.below(jitter + 1));
            self.in_flight
                .push((arrival + extra, 1 - from, t.route, bytes));
        }
    }

    /// Drains transmissions, deliveries and events of both endpoints until nothing moves,
    /// checking the invariants.
    fn drain(&mut self) {
        loop {
            let mut moved = false;
            for i in 0..2 {
                if !self.alive[i] {
                    continue;
                }
                while let Some(t) = self.links[i].poll_transmit(self.now) {
                    moved = true;
                    let window = self.links[i].config().window as usize;
                    assert!(self.links[i].in_flight() <= window, "window exceeded");
                    let capacity = self.links[i].receive_capacity();
                    assert!(self.links[i].held() <= capacity, "receive window exceeded");
                    self.transmit(i, t);
                }
                while let Some(e) = self.links[i].poll_event() {
                    self.events[i].push(e);
                }
                while self.consuming[i] {
                    let Some(data) = self.links[i].poll_deliver() else {
                        break;
                    };
                    moved = true;
                    let k = self.delivered[i];
                    assert_eq!(
                        data,
                        payload(1 - i, k, (self.size)(k)),
                        "payload {k} to {i} wrong or out of order"
                    );
                    self.delivered[i] += 1;
                    if self.ping_pong {
                        // 1 answers message k; 0 sends message k + 1 when answer k arrives.
                        let n = if i == 1 { k + 1 } else { k + 2 };
                        self.queue_up_to(i, n);
                    }
                }
            }
            if !moved {
                break;
            }
        }
    }

    fn done(&self) -> bool {
        (0..2).all(|i| {
            self.delivered[i] == self.to_send[1 - i] && (!self.alive[i] || self.links[i].is_idle())
        })
    }

    /// One step: drain, advance the clock to the next event, handle it. False when nothing is
    /// left to happen.
    fn step(&mut self) -> bool {
        self.steps += 1;
        assert!(self.steps < 3_000_000, "simulation does not converge");
        self.drain();
        let timers = (0..2)
            .filter(|&i| self.alive[i])
            .filter_map(|i| self.links[i].poll_timeout());
        let arrivals = self.in_flight.iter().map(|(t, _, _, _)| *t);
        let Some(next) = timers.chain(arrivals).min() else {
            return false;
        };
        self.now = self.now.max(next);
        let now = self.now;
        let (due, later): (Vec<_>, Vec<_>) =
            self.in_flight.drain(..).partition(|(t, _, _, _)| *t <= now);
        self.in_flight = later;
        for (_, to, route, bytes) in due {
            if !self.alive[to] {
                continue;
            }
            match Packet::decode(&bytes, JOB) {
                Ok(p) if self.defer_acks => self.links[to].receive(now, route, p),
                Ok(p) => self.links[to].handle_packet(now, route, p),
                Err(PacketError::CrcMismatch { seq, .. }) => {
                    self.links[to].handle_corrupt(now, route, seq)
                }
                Err(_) => self.other_errors += 1,
            }
        }
        if self.defer_acks {
            // What the arrivals made due goes out before the timers run (a deferred
            // acknowledgement is applied once nothing new is left to send). The link
            // transport runs due timers first; this order is the one that leaves an
            // acknowledgement deferred across a send.
            self.drain();
        }
        for i in 0..2 {
            if self.alive[i] {
                self.links[i].handle_timeout(now);
            }
        }
        self.drain();
        true
    }

    fn run(&mut self) {
        while !self.done() {
            assert!(self.step(), "stalled before everything was delivered");
        }
    }

    /// Steps until `until` (simulated), or until nothing is left to happen.
    fn run_until(&mut self, until: Instant) {
        while self.now < until && self.step() {}
    }

    fn elapsed(&self) -> Duration {
        self.now - self.start
    }

    fn faults_total(&self) -> u64 {
        self.injected.lost
            + self.injected.duplicated
            + self.injected.corrupted
            + self.injected.route_dropped
    }

    fn retransmitted(&self) -> u64 {
        self.links.iter().map(|l| l.stats().retransmitted).sum()
    }

    /// At most three retransmissions per injected fault (and a few for reordering): no storms.
    fn assert_no_storm(&self) {
        let bound = 3 * self.faults_total() + 10;
        assert!(
            self.retransmitted() <= bound,
            "{} retransmissions for {:?}",
            self.retransmitted(),
            self.injected
        );
    }

    fn assert_all_delivered_once(&self) {
        for i in 0..2 {
            assert_eq!(self.delivered[i], self.to_send[1 - i]);
            assert_eq!(
                self.links[i].stats().delivered as usize,
                self.to_send[1 - i]
            );
            assert!(self.links[i].poll_event_peek_none());
            assert!(!self.links[i].is_dead());
        }
    }

    /// Share of endpoint 0's DATA payload bytes that went on each route.
    fn data_shares(&self) -> Vec<f64> {
        let total: u64 = self.routes.iter().map(|r| r.data_bytes[0]).sum();
        self.routes
            .iter()
            .map(|r| r.data_bytes[0] as f64 / total.max(1) as f64)
            .collect()
    }
}

impl ReliableLink {
    fn poll_event_peek_none(&self) -> bool {
        self.events.is_empty()
    }
}

fn run_scenario(seed: u64, faults: Faults, messages: usize) -> Sim {
    let mut sim = Sim::new(
        seed,
        LinkConfig::default(),
        faults,
        [messages, messages / 2],
    );
    finish(&mut sim, seed);
    sim
}

/// Two equal unlimited routes, large (striped) payloads one way, small ones back.
fn run_striped_scenario(seed: u64, faults: Faults, messages: usize) -> Sim {
    let routes = vec![SimRoute::new(None), SimRoute::new(None)];
    let size: fn(usize) -> usize = |k| if k % 2 == 0 { large(k) } else { small(k) };
    let mut sim = Sim::with_routes(
        seed,
        LinkConfig::default(),
        faults,
        [messages, messages / 2],
        routes,
        size,
    );
    finish(&mut sim, seed);
    sim
}

fn finish(sim: &mut Sim, seed: u64) {
    sim.run();
    eprintln!(
        "seed {seed}: stats {:?} / {:?}\nroutes {:?} / {:?}\nrtt {:?}",
        sim.links[0].stats(),
        sim.links[1].stats(),
        sim.links[0].route_stats(),
        sim.links[1].route_stats(),
        sim.links[0].rtt()
    );
    sim.assert_all_delivered_once();
    sim.assert_no_storm();
    eprintln!(
        "seed {seed}: {:?}, retransmitted {}, spurious {}, route events {:?}, elapsed {:?}",
        sim.injected,
        sim.retransmitted(),
        sim.links[0].stats().spurious_retransmissions
            + sim.links[1].stats().spurious_retransmissions,
        sim.events,
        sim.elapsed()
    );
}

// ---------------------------------------------------------------------------------------------
// One route: the reliability rules.

#[test]
fn lossless() {
    let sim = run_scenario(1, Faults::default(), 2000);
    assert_eq!(sim.retransmitted(), 0);
    let s = sim.links[0].stats();
    assert_eq!(s.sent, 2000);
    assert_eq!(
        s.duplicates_dropped + s.out_of_window_dropped + s.crc_failures,
        0
    );
    // Delayed, coalesced ACKs (some piggybacked on the reverse traffic): at most one per
    // `ack_frequency` packets.
    let r = sim.links[1].stats();
    assert!(
        (1..=1000 + 10).contains(&(r.acks_sent + r.acks_piggybacked)),
        "{r:?}"
    );
    assert!(sim.links[0].rtt().smoothed().is_some());
    // One route: everything on route 0, counted.
    let rs = sim.links[0].route_stats();
    assert_eq!(rs.len(), 1);
    assert!(rs[0].up && rs[0].failovers == 0);
    assert_eq!(
        rs[0].packets_sent,
        s.sent + s.acks_sent + s.pongs_sent + s.pings_sent
    );
    assert_eq!(
        rs[0].packets_received,
        sim.links[1].route_stats()[0].packets_sent
    );
    assert_eq!(rs[0].in_flight_bytes, 0);
}

#[test]
fn loss_5_percent() {
    for seed in 0..4 {
        let sim = run_scenario(
            seed,
            Faults {
                loss: 0.05,
                jitter: 10 * US,
                ..Faults::default()
            },
            2000,
        );
        assert!(sim.injected.lost > 0 && sim.retransmitted() > 0);
    }
}

#[test]
fn loss_30_percent() {
    for seed in 10..13 {
        let sim = run_scenario(
            seed,
            Faults {
                loss: 0.30,
                jitter: 10 * US,
                ..Faults::default()
            },
            1000,
        );
        assert!(sim.injected.lost > 300);
    }
}

#[test]
fn duplication() {
    let sim = run_scenario(
        20,
        Faults {
            duplicate: 0.2,
            ..Faults::default()
        },
        2000,
    );
    assert!(sim.links[1].stats().duplicates_dropped > 100);
}

#[test]
fn reordering() {
    let sim = run_scenario(
        30,
        Faults {
            jitter: 200 * US,
            ..Faults::default()
        },
        2000,
    );
    // Heavy reordering, no loss: some spurious retransmissions at most, within the bound.
    assert!(sim.retransmitted() <= 2000 / 4, "{}", sim.retransmitted());
}

#[test]
fn corruption_is_nacked() {
    let sim = run_scenario(
        40,
        Faults {
            corrupt: 0.05,
            jitter: 5 * US,
            ..Faults::default()
        },
        2000,
    );
    let receiver = sim.links[1].stats();
    let sender = sim.links[0].stats();
    let crc = receiver.crc_failures + sender.crc_failures;
    // A flip in the magic, version, kind or a length is caught before the CRC.
    assert_eq!(crc + sim.other_errors, sim.injected.corrupted);
    assert!(crc > sim.other_errors);
    assert!(receiver.nacks_sent > 0 && sender.nacks_received > 0);
    let per_route: u64 = sim
        .links
        .iter()
        .map(|l| l.route_stats()[0].crc_failures)
        .sum();
    assert_eq!(per_route, crc);
}

#[test]
fn everything_at_once() {
    for seed in 50..53 {
        run_scenario(
            seed,
            Faults {
                loss: 0.05,
                duplicate: 0.02,
                corrupt: 0.01,
                jitter: 50 * US,
                ..Faults::default()
            },
            3000,
        );
    }
}

#[test]
fn long_outage_then_recovery() {
    let mut sim = Sim::new(
        60,
        LinkConfig::default(),
        Faults {
            loss: 0.01,
            outage: Some((100 * US, 100 * US + Duration::from_secs(1))),
            ..Faults::default()
        },
        [3000, 100],
    );
    sim.run();
    sim.assert_all_delivered_once();
    sim.assert_no_storm();
    assert!(sim.elapsed() > Duration::from_secs(1));
    // Probes back off during the outage: few timeouts for a one-second outage.
    let timeouts = sim.links[0].stats().timeouts;
    assert!(timeouts <= 20, "{timeouts} timeouts");
    // The only route went down during the outage and a probe brought it back.
    assert_eq!(
        sim.events[0],
        vec![
            LinkEvent::RouteDown { rank: 1, route: 0 },
            LinkEvent::RouteUp { rank: 1, route: 0 }
        ]
    );
    let rs = sim.links[0].route_stats()[0];
    assert!(rs.up && rs.failovers == 1 && rs.recoveries == 1 && rs.pings_sent >= 1);
    // One probe every 50 ms at most while down.
    assert!(rs.pings_sent <= 1000 / 50 + 1, "{} pings", rs.pings_sent);
}

#[test]
fn silent_peer_is_declared_dead() {
    let config = LinkConfig::default();
    let mut sim = Sim::new(70, config.clone(), Faults::default(), [10, 0]);
    sim.alive[1] = false;
    while sim.step() {}
    assert_eq!(
        sim.events[0],
        vec![
            LinkEvent::RouteDown { rank: 1, route: 0 },
            LinkEvent::PeerDead { rank: 1 }
        ]
    );
    let link = &mut sim.links[0];
    assert_eq!(link.poll_event(), None);
    assert!(link.is_dead());
    let s = link.stats();
    assert!(s.timeouts > 0 && s.retransmitted == s.timeouts);
    assert_eq!(s.sent, 10);
    assert!(s.pings_sent > 0);
    // Silence counts from the first send: dead exactly one peer timeout later.
    assert_eq!(sim.elapsed(), config.peer_timeout);
    assert!(sim.links[0].poll_transmit(sim.now).is_none());
    assert_eq!(sim.links[0].poll_timeout(), None);
}

/// With keepalive, a peer that dies while the link is idle (nothing of ours in flight: think of
/// a rank blocked in a receive) is declared dead one peer timeout after it was last heard.
#[test]
fn keepalive_finds_a_peer_that_died_while_the_link_was_idle() {
    let config = LinkConfig::default().with_peer_timeout(Duration::from_secs(1));
    let mut sim = Sim::new(71, config.clone(), Faults::default(), [3, 3]);
    sim.run();
    // Idle and both alive: keepalives flow both ways and nobody dies.
    let t = sim.now + Duration::from_secs(10);
    sim.run_until(t);
    assert!(sim.events[0].is_empty() && sim.events[1].is_empty());
    let pings = sim.links[0].stats().keepalives_sent;
    // At most one per silent interval (both sides ping in lockstep here: they heard each other
    // at the same simulated instants; each PING also shows the other side that this one lives).
    assert!(
        (25..=51).contains(&pings),
        "{pings} keepalives in 10 s at 200 ms"
    );
    assert!(sim.links[1].stats().pongs_sent >= pings - 1);
    // Endpoint 1 dies.
    sim.alive[1] = false;
    let died = sim.now;
    let last_heard = died - Duration::from_millis(200); // at most one keepalive interval ago
    while sim.events[0].is_empty() {
        assert!(sim.step());
    }
    assert_eq!(sim.events[0], vec![LinkEvent::PeerDead { rank: 1 }]);
    let noticed = sim.now - died;
    assert!(
        // (Its last packets were still on the wire when it died.)
        noticed <= config.peer_timeout + MS && sim.now >= last_heard + config.peer_timeout,
        "noticed {noticed:?} after the death"
    );
    assert!(sim.links[0].in_flight() == 0);
}

/// Closing flushes a delayed ACK, so the peer is not left retransmitting to a closed rank.
#[test]
fn close_sends_the_pending_ack_at_once() {
    let mut sim = Sim::new(73, LinkConfig::default(), Faults::default(), [1, 0]);
    // Deliver the one DATA packet, but stop before the delayed ACK is due.
    while sim.delivered[1] == 0 {
        assert!(sim.step());
    }
    assert_eq!(sim.links[1].stats().acks_sent, 0);
    sim.links[1].close();
    sim.drain();
    assert_eq!(sim.links[1].stats().acks_sent, 1);
    let t = sim.now + 100 * US;
    sim.run_until(t);
    assert!(sim.links[0].is_idle(), "the ACK arrived");
    assert_eq!(sim.links[0].stats().retransmitted, 0);
}

/// A peer that closed says BYE: it is no longer pinged and its silence is no failure.
#[test]
fn bye_ends_keepalive_without_a_failure() {
    let config = LinkConfig::default().with_peer_timeout(Duration::from_secs(1));
    let mut sim = Sim::new(72, config, Faults::default(), [5, 5]);
    sim.run();
    sim.links[1].close();
    sim.drain();
    sim.links[1].close(); // twice is once
    let t = sim.now + Duration::from_millis(50);
    sim.run_until(t);
    assert_eq!(sim.links[0].stats().byes_received, 1);
    assert!(sim.links[0].peer_closed());
    sim.alive[1] = false;
    let keepalives = sim.links[0].stats().keepalives_sent;
    let t = sim.now + Duration::from_secs(30);
    sim.run_until(t);
    assert!(sim.events[0].is_empty(), "{:?}", sim.events[0]);
    assert_eq!(sim.links[0].stats().keepalives_sent, keepalives);
    assert_eq!(sim.links[0].poll_timeout(), None);
    // Data sent to the closed peer is still awaited, and its silence then does count.
    sim.links[0].send(sim.now, Bytes::from_static(b"late"));
    while !sim.links[0].is_dead() {
        assert!(sim.step());
    }
    assert_eq!(sim.events[0].last(), Some(&LinkEvent::PeerDead { rank: 1 }));
}

#[test]
fn slow_receiver_is_not_flooded() {
    let config = LinkConfig {
        window: 16,
        receive_window: Some(16),
        ..LinkConfig::default()
    };
    let mut sim = Sim::new(80, config, Faults::default(), [500, 0]);
    sim.consuming[1] = false;
    let until = sim.start + Duration::from_millis(200);
    while sim.now < until {
        assert!(sim.step());
        assert!(sim.links[1].held() <= 16);
    }
    assert_eq!(sim.links[1].held(), 16);
    assert!(sim.links[0].queued() > 400);
    // Only window probes went beyond the window, not a flood.
    let dropped = sim.links[1].stats().out_of_window_dropped;
    assert!(
        (1..=120).contains(&dropped),
        "{dropped} dropped beyond the window"
    );
    sim.consuming[1] = true;
    sim.run();
    sim.assert_all_delivered_once();
}

fn pair(routes: usize) -> (ReliableLink, ReliableLink) {
    pair_with(LinkConfig::default(), routes)
}

fn pair_with(config: LinkConfig, routes: usize) -> (ReliableLink, ReliableLink) {
    (
        ReliableLink::new(config.clone(), JOB, 0, 1, routes),
        ReliableLink::new(config, JOB, 1, 0, routes),
    )
}

#[test]
fn the_sender_goes_on_past_a_lost_packet_up_to_the_receive_window() {
    let t0 = Instant::now();
    let config = LinkConfig {
        window: 4,
        ..LinkConfig::default()
    };
    let (mut a, mut b) = pair_with(config, 1);
    assert_eq!(b.receive_capacity(), 16, "four windows by default");
    for k in 0..40u8 {
        a.send(t0, Bytes::from(vec![k]));
    }
    // The first packet is lost; every later one arrives, and its selective ACK frees the
    // sender's window, until the receiver holds as much as it may past the hole.
    let mut sent = 0;
    let mut first = true;
    while let Some(t) = a.poll_transmit(t0) {
        sent += 1;
        if std::mem::take(&mut first) {
            continue;
        }
        b.handle_packet(t0, t.route, t.packet);
        while let Some(ack) = b.poll_transmit(t0) {
            a.handle_packet(t0, ack.route, ack.packet);
        }
    }
    assert_eq!(
        b.held(),
        15,
        "everything up to the window's end, past the hole"
    );
    assert_eq!(
        sent, 16,
        "sequence numbers 1 to 16: not stopped after one window"
    );
    assert_eq!(a.in_flight(), 1, "only the lost packet unacknowledged");
}

#[test]
fn misaddressed_misrouted_and_raw_packets_are_dropped() {
    let now = Instant::now();
    let (mut a, mut b) = pair(2);
    a.send(now, Bytes::from_static(b"x"));
    let t = a.poll_transmit(now).unwrap();
    let mut p = t.packet.clone();
    p.source = 5;
    b.handle_packet(now, 0, p);
    assert_eq!(b.stats().misaddressed_dropped, 1);
    b.handle_packet(now, 2, t.packet.clone());
    assert_eq!(b.stats().misrouted_dropped, 1);
    b.handle_corrupt(now, 9, None); // counted, no panic
    b.handle_packet(now, 0, Packet::raw(JOB, 0, 1, Bytes::from_static(b"raw")));
    assert_eq!(b.stats().raw_dropped, 1);
    assert_eq!(b.poll_deliver(), None);
    assert_eq!(b.route_stats()[0].packets_received, 1); // the raw one, counted then dropped
    // Routes clamp to at least one.
    assert_eq!(
        ReliableLink::new(LinkConfig::default(), JOB, 0, 1, 0).routes(),
        1
    );
}

#[test]
fn delayed_ack_fires_after_ack_delay() {
    let t0 = Instant::now();
    let config = LinkConfig::default();
    let (mut a, mut b) = pair(1);
    a.send(t0, Bytes::from_static(b"one"));
    let p = a.poll_transmit(t0).unwrap();
    assert_eq!(p.route, 0);
    assert!(a.poll_transmit(t0).is_none());
    b.handle_packet(t0, p.route, p.packet);
    assert!(b.poll_transmit(t0).is_none(), "one packet: ACK delayed");
    assert_eq!(b.poll_timeout(), Some(t0 + config.ack_delay));
    let later = t0 + config.ack_delay;
    b.handle_timeout(later);
    let ack = b.poll_transmit(later).unwrap();
    assert!(matches!(
        ack.packet.body,
        PacketBody::Ack(AckInfo { cumulative: 1, .. })
    ));
    a.handle_packet(later, ack.route, ack.packet);
    assert!(a.is_idle());
    assert_eq!(a.rtt().smoothed(), Some(config.ack_delay));
    // Two packets (ack frequency 2): the ACK is due after the short hold, not the delay.
    a.send(later, Bytes::from_static(b"two"));
    a.send(later, Bytes::from_static(b"three"));
    let p2 = a.poll_transmit(later).unwrap();
    let p3 = a.poll_transmit(later).unwrap();
    b.handle_packet(later, 0, p2.packet);
    assert!(b.poll_transmit(later).is_none());
    b.handle_packet(later, 0, p3.packet);
    assert!(
        b.poll_transmit(later).is_none(),
        "held for a reply to carry it"
    );
    let held = later + config.ack_hold;
    assert_eq!(b.poll_timeout(), Some(held));
    b.handle_timeout(held);
    assert!(matches!(
        b.poll_transmit(held).unwrap().packet.body,
        PacketBody::Ack(AckInfo { cumulative: 3, .. })
    ));
}

#[test]
fn a_reply_within_the_hold_carries_the_ack_that_two_packets_made_due() {
    let t0 = Instant::now();
    let (mut a, mut b) = pair(1);
    for p in [&b"request, part 1"[..], b"request, part 2"] {
        a.send(t0, Bytes::from_static(p));
    }
    for t in std::iter::from_fn(|| a.poll_transmit(t0)).collect::<Vec<_>>() {
        b.handle_packet(t0, t.route, t.packet);
    }
    while b.poll_deliver().is_some() {}
    // The application answers at once: its DATA packet acknowledges both, and no standalone
    // ACK goes out before it, then or later.
    let t1 = t0 + US;
    b.send(t1, Bytes::from_static(b"reply"));
    let reply = b.poll_transmit(t1).unwrap();
    assert!(matches!(reply.packet.body, PacketBody::Data { ack: 2, .. }));
    assert!(b.poll_transmit(t1).is_none());
    a.handle_packet(t1, reply.route, reply.packet);
    assert!(a.is_idle(), "both request packets acknowledged");
    let late = t1 + LinkConfig::default().ack_hold * 2;
    b.handle_timeout(late);
    assert!(b.poll_transmit(late).is_none(), "no ACK left to send");
    assert_eq!(b.stats().acks_sent, 0);
}

#[test]
fn a_received_acknowledgement_is_applied_after_the_next_packet_leaves() {
    let t0 = Instant::now();
    let (mut a, mut b) = pair(1);
    a.send(t0, Bytes::from_static(b"request"));
    let request = a.poll_transmit(t0).unwrap();
    b.handle_packet(t0, request.route, request.packet);
    assert!(b.poll_deliver().is_some());
    let t1 = t0 + 10 * US;
    b.send(t1, Bytes::from_static(b"reply"));
    let reply = b.poll_transmit(t1).unwrap();
    // The reply acknowledges the request; `receive` delivers it at once and keeps the
    // acknowledgement for later, reporting it due.
    let t2 = t1 + 10 * US;
    a.receive(t2, reply.route, reply.packet);
    assert_eq!(a.poll_deliver().as_deref(), Some(&b"reply"[..]));
    assert_eq!(a.in_flight(), 1, "not applied yet");
    assert!(a.is_idle(), "counted as applied");
    assert_eq!(a.poll_timeout(), Some(t2), "due at once");
    // The next request leaves first; the acknowledgement is applied after it.
    a.send(t2, Bytes::from_static(b"request 2"));
    let next = a.poll_transmit(t2).unwrap();
    assert!(matches!(next.packet.body, PacketBody::Data { seq: 2, .. }));
    assert_eq!(a.in_flight(), 2);
    assert!(a.poll_transmit(t2).is_none());
    assert_eq!(
        a.in_flight(),
        1,
        "the request acknowledged, its copy dropped"
    );
    assert_ne!(a.poll_timeout(), Some(t2), "nothing due any more");
    // The acknowledgement's RTT sample is dated when it arrived: 20 µs, not later.
    assert_eq!(a.rtt().smoothed(), Some(20 * US));
}

#[test]
fn a_lost_tail_packet_is_probed_after_two_round_trips_not_the_minimum_rto() {
    let t0 = Instant::now();
    let config = LinkConfig::default();
    let (mut a, mut b) = pair(1);
    for p in [&b"one"[..], b"two", b"three"] {
        a.send(t0, Bytes::from_static(p));
    }
    let sent: Vec<_> = std::iter::from_fn(|| a.poll_transmit(t0)).collect();
    assert_eq!(sent.len(), 3);
    // The first two arrive (their ACK goes after the short hold: ack frequency 2); the tail
    // is lost.
    let t1 = t0 + 20 * US;
    for t in &sent[..2] {
        b.handle_packet(t1, 0, t.packet.clone());
    }
    let held = t1 + config.ack_hold;
    b.handle_timeout(held);
    let ack = b.poll_transmit(held).expect("ACK of two packets");
    let t2 = held + 20 * US;
    a.handle_packet(t2, 0, ack.packet);
    let srtt = a.rtt().smoothed().expect("an RTT sample");
    // Nothing more comes: the probe is due two round trips plus the ACK delay later, well
    // before the retransmission timer.
    let probe_at = t2 + srtt * 2 + config.ack_delay;
    assert_eq!(a.poll_timeout(), Some(probe_at));
    assert!(probe_at < t2 + a.rtt().rto());
    a.handle_timeout(probe_at - US);
    assert!(
        a.poll_transmit(probe_at - US).is_none(),
        "not before its time"
    );
    a.handle_timeout(probe_at);
    let probe = a.poll_transmit(probe_at).expect("the tail probe");
    assert!(matches!(probe.packet.body, PacketBody::Data { seq: 3, .. }));
    assert_eq!((a.stats().tail_probes, a.stats().timeouts), (1, 0));
    // One probe per stall: next comes the retransmission timer.
    assert!(a.poll_timeout() >= Some(probe_at + a.rtt().rto()));
    b.handle_packet(probe_at, 0, probe.packet);
    let got: Vec<_> = std::iter::from_fn(|| b.poll_deliver()).collect();
    assert_eq!(got, [&b"one"[..], b"two", b"three"]);
}

#[test]
fn a_retransmission_reported_as_a_duplicate_widens_the_reordering_allowance() {
    let t0 = Instant::now();
    let (mut a, mut b) = pair(1);
    assert_eq!(a.reorder_allowance(), INITIAL_REORDER_QUARTERS);
    a.send(t0, Bytes::from_static(b"late"));
    let original = a.poll_transmit(t0).unwrap();
    // The original is only delayed: the timer sends it again, then both copies arrive.
    let timeout = a.poll_timeout().unwrap();
    a.handle_timeout(timeout);
    let copy = a.poll_transmit(timeout).unwrap();
    assert_eq!(a.stats().retransmitted, 1);
    b.handle_packet(timeout, 0, original.packet);
    b.handle_packet(timeout, 0, copy.packet);
    let ack = b.poll_transmit(timeout).expect("an immediate ACK");
    assert!(matches!(
        ack.packet.body,
        PacketBody::Ack(AckInfo {
            cumulative: 1,
            duplicate: Some(1),
            nack: None,
            ..
        })
    ));
    a.handle_packet(timeout + US, 0, ack.packet);
    assert_eq!(a.stats().spurious_retransmissions, 1);
    assert_eq!(a.reorder_allowance(), INITIAL_REORDER_QUARTERS + 1);
}

#[test]
fn a_packet_the_network_duplicated_is_no_spurious_retransmission() {
    let t0 = Instant::now();
    let (mut a, mut b) = pair(1);
    a.send(t0, Bytes::from_static(b"twice"));
    let t = a.poll_transmit(t0).unwrap();
    b.handle_packet(t0, 0, t.packet.clone());
    b.handle_packet(t0, 0, t.packet);
    let ack = b.poll_transmit(t0).expect("an immediate ACK");
    assert!(matches!(
        ack.packet.body,
        PacketBody::Ack(AckInfo {
            duplicate: Some(1),
            ..
        })
    ));
    a.handle_packet(t0 + US, 0, ack.packet);
    assert!(a.is_idle());
    assert_eq!(a.stats().spurious_retransmissions, 0);
    assert_eq!(a.reorder_allowance(), INITIAL_REORDER_QUARTERS);
}

#[test]
fn needed_retransmissions_take_the_reordering_allowance_back_to_zero() {
    let mut now = Instant::now();
    let (mut a, mut b) = pair(1);
    for k in 0..REORDER_PERSIST {
        assert_eq!(a.reorder_allowance(), INITIAL_REORDER_QUARTERS, "after {k}");
        a.send(now, Bytes::from(vec![k as u8]));
        let _lost = a.poll_transmit(now).unwrap();
        now = a.poll_timeout().unwrap();
        a.handle_timeout(now);
        let copy = a.poll_transmit(now).unwrap();
        b.handle_packet(now, 0, copy.packet);
        // The receiver answers with a DATA packet of its own, carrying the ACK.
        b.send(now, Bytes::from_static(b"ok"));
        let reply = b.poll_transmit(now).unwrap();
        now += 10 * US;
        a.handle_packet(now, 0, reply.packet);
        assert_eq!(a.in_flight(), 0);
    }
    assert_eq!(a.stats().retransmitted, u64::from(REORDER_PERSIST));
    assert_eq!(a.reorder_allowance(), 0);
}

#[test]
fn a_packet_that_fills_a_gap_is_acknowledged_at_once() {
    let t0 = Instant::now();
    let (mut a, mut b) = pair(1);
    for p in [&b"one"[..], b"two", b"three"] {
        a.send(t0, Bytes::from_static(p));
    }
    let sent: Vec<_> = std::iter::from_fn(|| a.poll_transmit(t0)).collect();
    b.handle_packet(t0, 0, sent[1].packet.clone());
    assert!(
        b.poll_transmit(t0).is_some(),
        "out of order: a selective ACK"
    );
    b.handle_packet(t0, 0, sent[0].packet.clone());
    // Neither the hold nor the delayed-ACK timer: the sender learns at once.
    let ack = b.poll_transmit(t0).expect("an ACK at once");
    assert!(matches!(
        ack.packet.body,
        PacketBody::Ack(AckInfo { cumulative: 2, .. })
    ));
    // In order again, the next one waits as usual.
    b.handle_packet(t0, 0, sent[2].packet.clone());
    assert!(b.poll_transmit(t0).is_none());
}

#[test]
fn nack_triggers_immediate_retransmission() {
    let t0 = Instant::now();
    let (mut a, mut b) = pair(1);
    a.send(t0, Bytes::from_static(b"payload"));
    let mut bytes = a.poll_transmit(t0).unwrap().packet.encode().to_vec();
    *bytes.last_mut().unwrap() ^= 0xFF;
    let Err(PacketError::CrcMismatch { seq, .. }) = Packet::decode(&Bytes::from(bytes), JOB) else {
        panic!("corruption not detected");
    };
    assert_eq!(seq, Some(1));
    let t1 = t0 + 30 * US;
    b.handle_corrupt(t1, 0, seq);
    let nack = b.poll_transmit(t1).unwrap();
    assert!(matches!(
        nack.packet.body,
        PacketBody::Ack(AckInfo { nack: Some(1), .. })
    ));
    let t2 = t1 + 30 * US;
    a.handle_packet(t2, 0, nack.packet);
    // Retransmitted at once, long before the 10 ms RTO.
    let again = a.poll_transmit(t2).unwrap();
    assert!(matches!(again.packet.body, PacketBody::Data { seq: 1, .. }));
    b.handle_packet(t2, 0, again.packet);
    assert_eq!(b.poll_deliver().as_deref(), Some(&b"payload"[..]));
    assert_eq!(a.stats().nacks_received, 1);
    assert_eq!(b.stats().nacks_sent, 1);
    assert_eq!(b.stats().crc_failures, 1);
    assert_eq!(b.route_stats()[0].crc_failures, 1);
}

// ---------------------------------------------------------------------------------------------
// Piggybacked acknowledgements.

#[test]
fn data_carries_the_pending_ack() {
    let t0 = Instant::now();
    let (mut a, mut b) = pair(1);
    a.send(t0, Bytes::from_static(b"ping"));
    let p = a.poll_transmit(t0).unwrap();
    b.handle_packet(t0, 0, p.packet);
    assert_eq!(b.poll_deliver().as_deref(), Some(&b"ping"[..]));
    b.send(t0, Bytes::from_static(b"pong"));
    let reply = b.poll_transmit(t0).unwrap();
    let PacketBody::Data {
        seq: 1,
        ack: 1,
        window_end,
        ..
    } = reply.packet.body
    else {
        panic!(
            "expected DATA with a piggybacked ACK, got {:?}",
            reply.packet
        );
    };
    assert_eq!(window_end, 2 + 4 * 256, "four windows by default");
    // The delayed ACK was satisfied: nothing else to send, no ACK timer.
    assert!(b.poll_transmit(t0 + MS).is_none());
    assert_eq!(b.stats().acks_sent, 0);
    assert_eq!(b.stats().acks_piggybacked, 1);
    a.handle_packet(t0 + 40 * US, 0, reply.packet);
    assert_eq!(a.in_flight(), 0, "the piggybacked ACK acknowledged ping");
    assert_eq!(a.rtt().smoothed(), Some(40 * US));
    // An out-of-order arrival still gets a standalone ACK with the selective bitmap, even
    // when DATA goes out too.
    b.send(t0, Bytes::from_static(b"x"));
    a.send(t0, Bytes::from_static(b"2"));
    a.send(t0, Bytes::from_static(b"3"));
    let _lost = a.poll_transmit(t0).unwrap();
    let three = a.poll_transmit(t0).unwrap();
    b.handle_packet(t0 + MS, 0, three.packet);
    let first = b.poll_transmit(t0 + MS).unwrap();
    assert!(
        matches!(&first.packet.body, PacketBody::Ack(ack) if ack.selective_seqs().eq([3])),
        "{first:?}"
    );
    assert!(matches!(
        b.poll_transmit(t0 + MS).unwrap().packet.body,
        PacketBody::Data { ack: 1, .. }
    ));
}

#[test]
fn ping_pong_needs_no_standalone_acks() {
    for routes in [1, 2] {
        let mut sim = Sim::ping_pong(90, LinkConfig::default(), 1000, routes);
        sim.run();
        sim.assert_all_delivered_once();
        let (a, b) = (sim.links[0].stats(), sim.links[1].stats());
        eprintln!("ping-pong over {routes} route(s): {a:?}\n{b:?}");
        assert_eq!(a.sent, 1000);
        assert_eq!(b.sent, 1000);
        // Only the very last message waits for a delayed ACK.
        assert!(
            a.acks_sent + b.acks_sent <= 1,
            "{} + {}",
            a.acks_sent,
            b.acks_sent
        );
        assert!(a.acks_piggybacked >= 999 && b.acks_piggybacked >= 999);
        assert_eq!(sim.retransmitted(), 0);
        // Small messages: everything on the primary route.
        assert_eq!(sim.routes[0].data_packets, [1000, 1000]);
    }
}

// ---------------------------------------------------------------------------------------------
// Routes: striping, failover, probing, fail-back.

#[test]
fn probes_are_answered_on_their_route() {
    let t0 = Instant::now();
    let (_, mut b) = pair(3);
    let ping = Packet {
        job_key: JOB,
        source: 0,
        destination: 1,
        body: PacketBody::Ping { nonce: 77 },
    };
    b.handle_packet(t0, 2, ping);
    let t = b.poll_transmit(t0).unwrap();
    assert_eq!(t.route, 2);
    assert_eq!(t.packet.body, PacketBody::Pong { nonce: 77 });
    assert_eq!(b.stats().pongs_sent, 1);
    assert!(b.poll_transmit(t0).is_none());
}

fn two_routes(bandwidth: [f64; 2]) -> Vec<SimRoute> {
    bandwidth
        .iter()
        .map(|&bw| SimRoute::new(Some(bw)))
        .collect()
}

#[test]
fn striping_splits_large_payloads_evenly_over_equal_routes() {
    let mut sim = Sim::with_routes(
        100,
        LinkConfig::default(),
        Faults::default(),
        [1500, 50],
        two_routes([1e9, 1e9]),
        large,
    );
    finish(&mut sim, 100);
    let shares = sim.data_shares();
    eprintln!("shares {shares:?}, stats {:?}", sim.links[0].route_stats());
    for share in &shares {
        assert!((0.35..=0.65).contains(share), "{shares:?}");
    }
    // The link's per-route counters agree with what the network saw.
    for (r, rs) in sim.links[0].route_stats().iter().enumerate() {
        assert!(rs.up && rs.failovers == 0);
        assert!(rs.packets_sent >= sim.routes[r].data_packets[0]);
        assert!(rs.bytes_sent > sim.routes[r].data_bytes[0]);
        assert!(rs.throughput > 0);
    }
    assert!(sim.retransmitted() <= 20, "{}", sim.retransmitted());
}

#[test]
fn striping_follows_route_throughput() {
    let mut sim = Sim::with_routes(
        101,
        LinkConfig::default(),
        Faults::default(),
        [1500, 0],
        two_routes([2e9, 1e9]),
        large,
    );
    finish(&mut sim, 101);
    let shares = sim.data_shares();
    let ratio = shares[0] / shares[1];
    let rs = sim.links[0].route_stats();
    eprintln!("shares {shares:?}, ratio {ratio}, stats {rs:?}");
    assert!((1.6..=2.5).contains(&ratio), "{shares:?}");
    let measured = rs[0].throughput as f64 / rs[1].throughput as f64;
    assert!((1.5..=2.7).contains(&measured), "measured {measured}");
    assert!(sim.retransmitted() <= 20, "{}", sim.retransmitted());
}

#[test]
fn small_payloads_stay_on_the_primary_route() {
    let mut sim = Sim::with_routes(
        102,
        LinkConfig::default(),
        Faults::default(),
        [500, 500],
        two_routes([1e9, 1e9]),
        small,
    );
    finish(&mut sim, 102);
    assert_eq!(sim.routes[1].data_packets, [0, 0]);
    assert_eq!(sim.links[0].route_stats()[1].packets_sent, 0);
}

/// Two equal routes, mostly large (striped) payloads from 0 to 1, some back.
fn dying_route_sim(seed: u64, messages: [usize; 2]) -> Sim {
    Sim::with_routes(
        seed,
        LinkConfig::default(),
        Faults::default(),
        messages,
        two_routes([1e9, 1e9]),
        |k| if k % 3 == 0 { small(k) } else { large(k) },
    )
}

#[test]
fn route_dying_mid_transfer_fails_over() {
    let mut sim = dying_route_sim(110, [3000, 300]);
    sim.run_until(sim.start + 5 * MS);
    let before = sim.delivered[1];
    assert!(before > 0 && before < 3000, "{before} delivered by 5 ms");
    let data_on_1 = sim.routes[1].data_packets[0];
    assert!(data_on_1 > 0);
    sim.routes[1].down = true;
    let died = sim.now;
    while sim.events[0].is_empty() {
        assert!(sim.step());
    }
    let failover = sim.now - died;
    let srtt = sim.links[0].rtt().smoothed().unwrap();
    eprintln!("failed over {failover:?} after the route died (SRTT {srtt:?})");
    // A few round trips: the loss delay, then strikes a round trip apart.
    assert!(
        failover <= srtt * 6,
        "failover took {failover:?}, SRTT {srtt:?}"
    );
    sim.run();
    let rs = sim.links[0].route_stats().to_vec();
    let s = sim.links[0].stats();
    eprintln!(
        "{:?}\n{s:?}\n{rs:?}\nevents {:?}, elapsed {:?}",
        sim.injected,
        sim.events,
        sim.elapsed()
    );
    sim.assert_all_delivered_once();
    sim.assert_no_storm();
    assert_eq!(
        sim.events[0],
        vec![LinkEvent::RouteDown { rank: 1, route: 1 }]
    );
    assert!(!rs[1].up && rs[1].failovers == 1 && rs[1].recoveries == 0);
    assert!(rs[0].up && rs[0].failovers == 0);
    // Failover was quick: few DATA packets went on the dead route after it died.
    let lost_data = sim.routes[1].data_packets[0] - data_on_1;
    assert!(
        lost_data <= 300,
        "{lost_data} DATA packets sent into the dead route"
    );
    // Every packet lost on the dead route was sent again about once: no storm.
    assert!(
        s.retransmitted <= sim.injected.route_dropped + 20,
        "{} retransmissions for {} dropped",
        s.retransmitted,
        sim.injected.route_dropped
    );
    assert!(rs[0].retransmitted >= lost_data.min(1));
    let after = sim.elapsed() - (died - sim.start);
    eprintln!("transfer finished {after:?} after the route died");
    // Later the dead route is probed every 50 ms, and nothing else goes on it.
    let data_on_1 = sim.routes[1].data_packets;
    sim.run_until(sim.now + 200 * MS);
    let rs = sim.links[0].route_stats();
    assert!(
        (3..=5).contains(&rs[1].pings_sent),
        "{} pings",
        rs[1].pings_sent
    );
    assert!(!rs[1].up);
    assert_eq!(sim.routes[1].data_packets, data_on_1);
}

#[test]
fn route_coming_back_carries_traffic_again() {
    let mut sim = dying_route_sim(111, [4000, 0]);
    for r in &mut sim.routes {
        r.bandwidth = Some(2e8); // slower, so that the transfer outlasts the outage
    }
    sim.run_until(sim.start + 3 * MS);
    sim.routes[1].down = true;
    // Wait for the failover.
    while !sim.events[0].contains(&LinkEvent::RouteDown { rank: 1, route: 1 }) {
        assert!(sim.step());
    }
    let down_at = sim.now;
    sim.run_until(down_at + 20 * MS);
    sim.routes[1].down = false;
    let revived = sim.now;
    while !sim.events[0].contains(&LinkEvent::RouteUp { rank: 1, route: 1 }) {
        assert!(sim.step());
        assert!(sim.now < revived + 200 * MS, "no fail-back");
    }
    let up_after = sim.now - revived;
    eprintln!(
        "down at {:?}, revived at {:?}, up {up_after:?} later, {} delivered",
        down_at - sim.start,
        revived - sim.start,
        sim.delivered[1]
    );
    // One probe interval (50 ms) at most, plus a round trip.
    assert!(up_after <= 51 * MS, "{up_after:?}");
    let on_1 = sim.routes[1].data_packets[0];
    sim.run();
    sim.assert_all_delivered_once();
    sim.assert_no_storm();
    let rs = sim.links[0].route_stats();
    eprintln!("{rs:?} events {:?}", sim.events);
    assert!(rs[1].up && rs[1].failovers == 1 && rs[1].recoveries == 1);
    assert_eq!(
        sim.events[0],
        vec![
            LinkEvent::RouteDown { rank: 1, route: 1 },
            LinkEvent::RouteUp { rank: 1, route: 1 }
        ]
    );
    // The revived route carried a fair part of what was left.
    let after_on_1 = sim.routes[1].data_packets[0] - on_1;
    assert!(
        after_on_1 > 100,
        "{after_on_1} packets on route 1 after it came back"
    );
}

#[test]
fn all_routes_dead_means_peer_dead() {
    let config = LinkConfig::default();
    let mut sim = dying_route_sim(120, [2000, 200]);
    sim.run_until(sim.start + 2 * MS);
    for r in &mut sim.routes {
        r.down = true;
    }
    let sent_before: Vec<u64> = sim.routes.iter().map(|r| r.data_packets[0]).collect();
    while sim.step() {}
    let events = &sim.events[0];
    eprintln!("{events:?} after {:?}", sim.elapsed());
    assert!(events.contains(&LinkEvent::RouteDown { rank: 1, route: 0 }));
    assert!(events.contains(&LinkEvent::RouteDown { rank: 1, route: 1 }));
    assert_eq!(events.last(), Some(&LinkEvent::PeerDead { rank: 1 }));
    assert_eq!(events.len(), 3);
    assert!(sim.links[0].is_dead());
    // With every route down, the link kept trying on both.
    for (r, route) in sim.routes.iter().enumerate() {
        assert!(
            route.data_packets[0] > sent_before[r],
            "route {r} not retried"
        );
    }
    // Bounded effort: the timer's probes, plus one rebinding of the window.
    let s = sim.links[0].stats();
    assert!(
        s.retransmitted <= s.timeouts + u64::from(config.window) + 10,
        "{s:?}"
    );
    assert!(sim.links[0].poll_transmit(sim.now).is_none());
}

#[test]
fn one_working_route_keeps_the_peer_alive() {
    // A ping-pong of small messages (all on the primary route 0) when route 0 dies for good.
    let mut sim = Sim::ping_pong(130, LinkConfig::default(), 1000, 2);
    sim.run_until(sim.start + 5 * MS);
    assert!(sim.delivered[0] > 10 && sim.delivered[0] < 1000);
    sim.routes[0].down = true;
    sim.run();
    sim.assert_all_delivered_once();
    for i in 0..2 {
        let peer = 1 - i as u32;
        assert_eq!(
            sim.events[i],
            vec![LinkEvent::RouteDown {
                rank: peer,
                route: 0
            }]
        );
        assert_eq!(sim.links[i].paths().primary(), Some(1));
    }
    // Failing over cost a few retransmission timeouts, not a storm (and a tail probe before
    // each stall's first timeout, on the dead route: at most one per stall).
    let timeouts: u64 = sim.links.iter().map(|l| l.stats().timeouts).sum();
    let probes: u64 = sim.links.iter().map(|l| l.stats().tail_probes).sum();
    assert!(timeouts <= 6, "{timeouts} timeouts");
    assert!(probes <= timeouts, "{probes} tail probes");
    assert!(
        sim.retransmitted() - probes <= 10,
        "{}",
        sim.retransmitted()
    );
}

/// An idle link (think of traffic that moved to another transport) whose primary route dies:
/// nothing is in flight, so no loss marks the route Down, and a keepalive on the primary alone
/// would go unanswered until the peer timeout declared a live peer dead. Keepalives go on every
/// Up route: the other route's answers keep the peer alive.
#[test]
fn an_idle_link_whose_primary_route_dies_keeps_the_peer_alive() {
    let config = LinkConfig::default().with_peer_timeout(Duration::from_secs(1));
    let mut sim = Sim::ping_pong(131, config, 20, 2);
    sim.run();
    sim.assert_all_delivered_once();
    sim.routes[0].down = true;
    let t = sim.now + Duration::from_secs(10);
    sim.run_until(t);
    assert!(
        sim.events[0].is_empty() && sim.events[1].is_empty(),
        "{:?}",
        sim.events
    );
    assert!(!sim.links[0].is_dead() && !sim.links[1].is_dead());
}

#[test]
fn striped_transfer_through_faults() {
    for seed in 140..143 {
        let sim = run_striped_scenario(
            seed,
            Faults {
                loss: 0.05,
                duplicate: 0.02,
                corrupt: 0.01,
                jitter: 50 * US,
                ..Faults::default()
            },
            1500,
        );
        let shares = sim.data_shares();
        assert!(shares.iter().all(|s| *s > 0.2), "{shares:?}");
    }
}

#[test]
fn striped_transfer_through_heavy_loss() {
    for seed in 150..152 {
        run_striped_scenario(
            seed,
            Faults {
                loss: 0.30,
                jitter: 10 * US,
                ..Faults::default()
            },
            600,
        );
    }
}
