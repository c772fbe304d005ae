//! Two [`ReliableLink`]s over a simulated network with a seeded PRNG and a simulated clock.

use std::time::{Duration, Instant};

use bytes::Bytes;

use super::*;

const JOB: u64 = 0x05EE_D0F1_0B00_0001;
const US: Duration = Duration::from_micros(1);

/// The simulations' seeded generator.
type Rng = crate::rng::SplitMix64;

#[derive(Clone, Copy, Default)]
struct Faults {
    loss: f64,
    duplicate: f64,
    corrupt: f64,
    /// Extra random delay up to this, on top of the base one-way delay: reordering.
    jitter: Duration,
    /// Every packet sent in `[start, end)` (offsets from the start) is lost.
    outage: Option<(Duration, Duration)>,
}

#[derive(Default, Debug)]
struct Injected {
    lost: u64,
    duplicated: u64,
    corrupted: u64,
}

struct Sim {
    start: Instant,
    now: Instant,
    links: [ReliableLink; 2],
    rng: Rng,
    faults: Faults,
    delay: Duration,
    in_flight: Vec<(Instant, usize, Bytes)>,
    injected: Injected,
    /// Whether endpoint `i` is alive (a dead one neither answers nor transmits).
    alive: [bool; 2],
    /// Whether endpoint `i`'s application takes delivered payloads.
    consuming: [bool; 2],
    delivered: [Vec<Bytes>; 2],
    to_send: [usize; 2],
    other_errors: u64,
    steps: u64,
}

fn payload(from: usize, k: usize) -> Bytes {
    let len = (k * 37) % 300;
    let mut v = Vec::with_capacity(len + 9);
    v.push(from as u8);
    v.extend_from_slice(&(k as u64).to_le_bytes());
    v.extend((0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(k as u8)));
    Bytes::from(v)
}

impl Sim {
    fn new(seed: u64, config: LinkConfig, faults: Faults, messages: [usize; 2]) -> Self {
        let start = Instant::now();
        let mut links = [
            ReliableLink::new(config.clone(), JOB, 0, 1),
            ReliableLink::new(config, JOB, 1, 0),
        ];
        for (i, link) in links.iter_mut().enumerate() {
            for k in 0..messages[i] {
                link.send(start, payload(i, k));
            }
        }
        Self {
            start,
            now: start,
            links,
            rng: crate::rng::SplitMix64(seed),
            faults,
            delay: 20 * US,
            in_flight: Vec::new(),
            injected: Injected::default(),
            alive: [true; 2],
            consuming: [true; 2],
            delivered: [Vec::new(), Vec::new()],
            to_send: messages,
            other_errors: 0,
            steps: 0,
        }
    }

    fn transmit(&mut self, to: usize, bytes: Bytes) {
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
                .push((self.now + self.delay + extra, to, bytes));
        }
    }

    /// Drains transmissions and deliveries of both endpoints, checking the invariants.
    fn drain(&mut self) {
        for i in 0..2 {
            if !self.alive[i] {
                continue;
            }
            while let Some(p) = self.links[i].poll_transmit(self.now) {
                let window = self.links[i].config().window as usize;
                assert!(self.links[i].in_flight() <= window, "window exceeded");
                assert!(self.links[i].held() <= window, "receive window exceeded");
                self.transmit(1 - i, p.encode());
            }
            while self.consuming[i] {
                let Some(data) = self.links[i].poll_deliver() else {
                    break;
                };
                let k = self.delivered[i].len();
                assert_eq!(
                    data,
                    payload(1 - i, k),
                    "payload {k} to {i} wrong or out of order"
                );
                self.delivered[i].push(data);
            }
        }
    }

    fn done(&self) -> bool {
        (0..2).all(|i| {
            self.delivered[i].len() == self.to_send[1 - i]
                && (!self.alive[i] || self.links[i].is_idle())
        })
    }

    /// One step: drain, advance the clock to the next event, handle it. False when nothing is
    /// left to happen.
    fn step(&mut self) -> bool {
        self.steps += 1;
        assert!(self.steps < 2_000_000, "simulation does not converge");
        self.drain();
        let timers = (0..2)
            .filter(|&i| self.alive[i])
            .filter_map(|i| self.links[i].poll_timeout());
        let arrivals = self.in_flight.iter().map(|(t, _, _)| *t);
        let Some(next) = timers.chain(arrivals).min() else {
            return false;
        };
        self.now = self.now.max(next);
        let now = self.now;
        let (due, later): (Vec<_>, Vec<_>) =
            self.in_flight.drain(..).partition(|(t, _, _)| *t <= now);
        self.in_flight = later;
        for (_, to, bytes) in due {
            if !self.alive[to] {
                continue;
            }
            match Packet::decode(&bytes, JOB) {
                Ok(p) => self.links[to].handle_packet(now, p),
                Err(PacketError::CrcMismatch { seq, .. }) => {
                    self.links[to].handle_corrupt(now, seq)
                }
                Err(_) => self.other_errors += 1,
            }
        }
        for i in 0..2 {
            if self.alive[i] {
                self.links[i].handle_timeout(now);
            }
        }
        true
    }

    fn run(&mut self) {
        while !self.done() {
            assert!(self.step(), "stalled before everything was delivered");
        }
    }

    fn elapsed(&self) -> Duration {
        self.now - self.start
    }

    fn faults_total(&self) -> u64 {
        self.injected.lost + self.injected.duplicated + self.injected.corrupted
    }

    fn retransmitted(&self) -> u64 {
        self.links.iter().map(|l| l.stats().retransmitted).sum()
    }

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
            assert_eq!(self.delivered[i].len(), self.to_send[1 - i]);
            assert_eq!(
                self.links[i].stats().delivered as usize,
                self.to_send[1 - i]
            );
            assert!(self.links[i].poll_event_peek_none());
        }
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
    sim.run();
    sim.assert_all_delivered_once();
    sim.assert_no_storm();
    eprintln!(
        "seed {seed}: {:?}, retransmitted {}, spurious {}, elapsed {:?}",
        sim.injected,
        sim.retransmitted(),
        sim.links[0].stats().spurious_retransmissions
            + sim.links[1].stats().spurious_retransmissions,
        sim.elapsed()
    );
    sim
}

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
    // Delayed, coalesced ACKs: at most one per `ack_frequency` packets.
    let acks = sim.links[1].stats().acks_sent;
    assert!(
        (1..=1000 + 10).contains(&acks),
        "{acks} acks for 2000 packets"
    );
    assert!(sim.links[0].rtt().smoothed().is_some());
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
}

#[test]
fn silent_peer_is_declared_dead() {
    let config = LinkConfig::default();
    let mut sim = Sim::new(70, config.clone(), Faults::default(), [10, 0]);
    sim.alive[1] = false;
    while sim.step() {}
    let link = &mut sim.links[0];
    assert_eq!(link.poll_event(), Some(LinkEvent::PeerDead { rank: 1 }));
    assert_eq!(link.poll_event(), None);
    assert!(link.is_dead());
    let s = link.stats();
    assert_eq!(s.timeouts, u64::from(config.retry_limit));
    assert_eq!(s.retransmitted, u64::from(config.retry_limit));
    assert_eq!(s.sent, 10);
    // RTO stays at the initial 10 ms (no sample); backoff doubles up to ×2^8, then stays.
    let mut expected = Duration::ZERO;
    for r in 0..=config.retry_limit {
        expected += retransmit::backoff(config.initial_rto, r, config.max_backoff);
    }
    assert_eq!(sim.elapsed(), expected);
    assert!(sim.links[0].poll_transmit(sim.now).is_none());
}

#[test]
fn slow_receiver_is_not_flooded() {
    let config = LinkConfig {
        window: 16,
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

#[test]
fn misaddressed_packets_are_dropped() {
    let now = Instant::now();
    let mut a = ReliableLink::new(LinkConfig::default(), JOB, 0, 1);
    let mut b = ReliableLink::new(LinkConfig::default(), JOB, 1, 0);
    a.send(now, Bytes::from_static(b"x"));
    let mut p = a.poll_transmit(now).unwrap();
    p.source = 5;
    b.handle_packet(now, p);
    assert_eq!(b.stats().misaddressed_dropped, 1);
    assert_eq!(b.poll_deliver(), None);
}

#[test]
fn delayed_ack_fires_after_ack_delay() {
    let t0 = Instant::now();
    let config = LinkConfig::default();
    let mut a = ReliableLink::new(config.clone(), JOB, 0, 1);
    let mut b = ReliableLink::new(config.clone(), JOB, 1, 0);
    a.send(t0, Bytes::from_static(b"one"));
    let p = a.poll_transmit(t0).unwrap();
    assert!(a.poll_transmit(t0).is_none());
    b.handle_packet(t0, p);
    assert!(b.poll_transmit(t0).is_none(), "one packet: ACK delayed");
    assert_eq!(b.poll_timeout(), Some(t0 + config.ack_delay));
    let later = t0 + config.ack_delay;
    b.handle_timeout(later);
    let ack = b.poll_transmit(later).unwrap();
    assert!(matches!(
        ack.body,
        PacketBody::Ack(AckInfo { cumulative: 1, .. })
    ));
    a.handle_packet(later, ack);
    assert!(a.is_idle());
    assert_eq!(a.rtt().smoothed(), Some(config.ack_delay));
    // Two packets: ACK at once (ack frequency 2).
    a.send(later, Bytes::from_static(b"two"));
    a.send(later, Bytes::from_static(b"three"));
    let p2 = a.poll_transmit(later).unwrap();
    let p3 = a.poll_transmit(later).unwrap();
    b.handle_packet(later, p2);
    assert!(b.poll_transmit(later).is_none());
    b.handle_packet(later, p3);
    assert!(b.poll_transmit(later).is_some());
}

#[test]
fn nack_triggers_immediate_retransmission() {
    let t0 = Instant::now();
    let mut a = ReliableLink::new(LinkConfig::default(), JOB, 0, 1);
    let mut b = ReliableLink::new(LinkConfig::default(), JOB, 1, 0);
    a.send(t0, Bytes::from_static(b"payload"));
    let mut bytes = a.poll_transmit(t0).unwrap().encode().to_vec();
    *bytes.last_mut().unwrap() ^= 0xFF;
    let Err(PacketError::CrcMismatch { seq, .. }) = Packet::decode(&Bytes::from(bytes), JOB) else {
        panic!("corruption not detected");
    };
    assert_eq!(seq, Some(1));
    let t1 = t0 + 30 * US;
    b.handle_corrupt(t1, seq);
    let nack = b.poll_transmit(t1).unwrap();
    assert!(matches!(
        nack.body,
        PacketBody::Ack(AckInfo { nack: Some(1), .. })
    ));
    let t2 = t1 + 30 * US;
    a.handle_packet(t2, nack);
    // Retransmitted at once, long before the 10 ms RTO.
    let again = a.poll_transmit(t2).unwrap();
    assert!(matches!(again.body, PacketBody::Data { seq: 1, .. }));
    b.handle_packet(t2, again);
    assert_eq!(b.poll_deliver().as_deref(), Some(&b"payload"[..]));
    assert_eq!(a.stats().nacks_received, 1);
    assert_eq!(b.stats().nacks_sent, 1);
    assert_eq!(b.stats().crc_failures, 1);
}
