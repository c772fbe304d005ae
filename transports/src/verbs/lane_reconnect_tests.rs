//! The lane fail-back exchange between two reconnectors over a simulated lossy, duplicating,
//! reordering datagram network, with simulated time and a model driver.

use std::time::{Duration, Instant};

use super::*;
use crate::verbs::connection_manager::CmDecodeError;

use crate::verbs::provider::{PortAddress, QpNum};
use crate::verbs::test_support::{LossyWire, XorShift};

const LANE: u8 = 1;

/// One rank's side: the reconnector and what a driver would hold for the lane.
struct Side {
    rank: u32,
    lanes: LaneReconnector,
    /// Queue pairs made so far (each new one gets the next number).
    made: u32,
    /// The lane's newest queue pair.
    local: Option<QpAddress>,
    /// What it is connected to.
    connected_to: Option<QpAddress>,
    live: bool,
    failures: u32,
    /// Whether the driver can make queue pairs (its port is up).
    port_up: bool,
}

impl Side {
    fn new(rank: u32) -> Side {
        Side {
            rank,
            lanes: LaneReconnector::new(rank, CmConfig::default()),
            made: 0,
            local: None,
            connected_to: None,
            live: false,
            failures: 0,
            port_up: true,
        }
    }

    /// A new queue pair for the lane (the old one is torn down).
    fn make_qp(&mut self) -> QpAddress {
        self.made += 1;
        let a = QpAddress {
            port: PortAddress {
                lid: self.rank as u16 + 1,
                gid: [self.rank as u8; 16],
            },
            qpn: QpNum(0x1000 * (self.rank + 1) + self.made),
        };
        self.local = Some(a);
        self.connected_to = None;
        self.live = false;
        a
    }

    /// The port came back: a new queue pair, and the request.
    fn port_back(&mut self, now: Instant) {
        let peer = 1 - self.rank;
        let local = self.make_qp();
        assert!(self.lanes.start(now, peer, LANE, local));
    }

    fn run_events(&mut self, now: Instant) {
        while let Some(e) = self.lanes.poll_event() {
            match e {
                LaneEvent::Open { peer, lane, remote } => {
                    if !self.port_up {
                        self.lanes.open_failed(peer, lane);
                        continue;
                    }
                    let local = self.make_qp();
                    self.connected_to = Some(remote);
                    self.lanes.accepted(now, peer, lane, local);
                }
                LaneEvent::Connect { remote, .. } => {
                    assert!(self.local.is_some(), "connect without a queue pair");
                    assert!(
                        self.connected_to.is_none() || self.connected_to == Some(remote),
                        "rank {}: a connected queue pair connected again",
                        self.rank
                    );
                    self.connected_to = Some(remote);
                }
                LaneEvent::Established { .. } => {
                    assert!(self.connected_to.is_some(), "established unconnected");
                    self.live = true;
                }
                LaneEvent::Failed { .. } => self.failures += 1,
            }
        }
    }
}

struct Net {
    sides: [Side; 2],
    now: Instant,
    wire: LossyWire<CmMessage>,
}

impl Net {
    fn new(seed: u64) -> Net {
        Net {
            sides: [Side::new(0), Side::new(1)],
            now: Instant::now(),
            wire: LossyWire::new(seed),
        }
    }

    fn collect(&mut self) {
        for r in 0..2u32 {
            let now = self.now;
            self.sides[r as usize].run_events(now);
            while let Some((to, m)) = self.sides[r as usize].lanes.poll_transmit() {
                let mut bytes = Vec::new();
                m.encode(&mut bytes);
                let decoded = CmMessage::decode(&bytes).expect("decodes");
                assert_eq!(decoded, m);
                self.wire.send(to, r, decoded);
            }
        }
    }

    /// Delivers what is in flight; `drop` decides per message whether it is lost, and each
    /// survivor is duplicated with `dup` percent, in random order when `shuffle`.
    fn deliver(&mut self, mut drop: impl FnMut(&CmMessage) -> bool, dup: u64, shuffle: bool) {
        self.collect();
        let lost = |m: &CmMessage, _: &mut XorShift| drop(m);
        for (to, from, m) in self.wire.arrivals(lost, dup, shuffle) {
            let now = self.now;
            self.sides[to as usize].lanes.handle_message(now, from, m);
        }
        self.collect();
    }

    fn tick(&mut self, by: Duration) {
        self.now += by;
        for s in &mut self.sides {
            s.lanes.handle_timeout(self.now);
        }
        self.collect();
    }

    fn settle(&mut self) {
        for _ in 0..200 {
            self.deliver(|_| false, 0, false);
            self.tick(Duration::from_millis(50));
        }
    }

    /// Both sides re-established the lane on each other's newest queue pairs.
    fn assert_reconnected(&self) {
        let [a, b] = &self.sides;
        assert!(a.live && b.live, "live: {} {}", a.live, b.live);
        assert_eq!(
            a.connected_to, b.local,
            "rank 0 connected to rank 1's newest"
        );
        assert_eq!(
            b.connected_to, a.local,
            "rank 1 connected to rank 0's newest"
        );
        assert!(!a.lanes.is_busy(1, LANE) && !b.lanes.is_busy(0, LANE));
    }
}

#[test]
fn the_side_whose_port_came_back_requests_and_the_other_answers_with_a_new_queue_pair() {
    let mut net = Net::new(1);
    net.sides[1].port_back(net.now);
    net.deliver(|_| false, 0, false);
    net.deliver(|_| false, 0, false);
    net.deliver(|_| false, 0, false);
    net.assert_reconnected();
    assert_eq!(net.sides[0].made, 1, "the responder made one queue pair");
    let (a, b) = (net.sides[0].lanes.counters(), net.sides[1].lanes.counters());
    assert_eq!(
        (b.requests_sent, a.replies_sent, b.confirms_sent),
        (1, 1, 1)
    );
    assert_eq!((a.established, b.established), (1, 1));
    assert!(net.sides[0].lanes.poll_timeout().is_none());
}

#[test]
fn each_lost_message_is_retransmitted_and_duplicates_change_nothing() {
    for victim in 0..3 {
        let mut net = Net::new(7);
        net.sides[0].port_back(net.now);
        let mut lost = false;
        for _ in 0..50 {
            net.deliver(
                |m| {
                    let kind = match m {
                        CmMessage::LaneRequest { .. } => 0,
                        CmMessage::LaneReply { .. } => 1,
                        _ => 2,
                    };
                    let drop = kind == victim && !lost;
                    lost |= drop;
                    drop
                },
                0,
                false,
            );
            net.tick(Duration::from_millis(30));
        }
        net.assert_reconnected();
        assert!(lost, "message kind {victim} was dropped");
        assert_eq!(net.sides[1].made, 1, "kind {victim}: one queue pair made");
        let retransmissions: u64 = net
            .sides
            .iter()
            .map(|s| s.lanes.counters().retransmissions)
            .sum();
        assert!(retransmissions >= 1, "kind {victim}");
    }
}

#[test]
fn simultaneous_requests_make_one_pair_of_queue_pairs_the_lower_rank_wins() {
    let mut net = Net::new(3);
    let now = net.now;
    net.sides[0].port_back(now);
    net.sides[1].port_back(now);
    net.settle();
    net.assert_reconnected();
    assert_eq!((net.sides[0].made, net.sides[1].made), (1, 1));
    assert_eq!(net.sides[0].lanes.counters().ties_won, 1);
    assert_eq!(net.sides[1].lanes.counters().ties_lost, 1);
}

#[test]
fn a_flapping_port_reopens_the_lane_again_on_new_queue_pairs() {
    let mut net = Net::new(5);
    net.sides[1].port_back(net.now);
    net.settle();
    net.assert_reconnected();
    let first = net.sides[0].local;
    // Rank 1's port flaps: its lane fails again and it requests with another queue pair.
    net.sides[1].port_back(net.now);
    net.settle();
    net.assert_reconnected();
    assert_ne!(
        net.sides[0].local, first,
        "the responder opened a new queue pair"
    );
    assert_eq!(net.sides[0].made, 2);
}

#[test]
fn a_responder_that_cannot_open_yet_answers_a_later_retransmission() {
    let mut net = Net::new(9);
    net.sides[0].port_up = false;
    net.sides[1].port_back(net.now);
    net.deliver(|_| false, 0, false);
    assert!(!net.sides[1].live);
    assert_eq!(net.sides[0].lanes.counters().failed, 1);
    net.sides[0].port_up = true;
    net.settle();
    net.assert_reconnected();
}

#[test]
fn an_unanswered_request_fails_after_the_configured_sends() {
    let mut net = Net::new(11);
    net.sides[1].port_back(net.now);
    for _ in 0..100 {
        net.deliver(|_| true, 0, false);
        net.tick(Duration::from_secs(1));
    }
    assert_eq!(net.sides[1].failures, 1);
    let c = net.sides[1].lanes.counters();
    assert_eq!(c.requests_sent, u64::from(CmConfig::default().attempts));
    assert!(!net.sides[1].lanes.is_busy(0, LANE));
    // A later attempt (the driver starts one again) succeeds.
    net.sides[1].port_back(net.now);
    net.settle();
    net.assert_reconnected();
}

#[test]
fn random_loss_duplication_and_reordering_never_leave_a_half_open_lane() {
    for seed in 1..=300u64 {
        let mut net = Net::new(seed);
        let both = seed % 3 == 0;
        let now = net.now;
        net.sides[(seed % 2) as usize].port_back(now);
        if both {
            net.sides[1 - (seed % 2) as usize].port_back(now);
        }
        for _ in 0..60 {
            let mut rng = XorShift(net.wire.rng.next());
            net.deliver(|_| rng.next() % 100 < 30, 20, true);
            net.tick(Duration::from_millis(25));
        }
        let failed = net.sides.iter().any(|s| s.failures > 0);
        if failed {
            // Ran out of sends: a side that went live did so on the pair of queue pairs the
            // other side made and connected too, never on a half-open one.
            let [a, b] = &net.sides;
            if a.live || b.live {
                assert_eq!(a.connected_to, b.local, "seed {seed}");
                assert_eq!(b.connected_to, a.local, "seed {seed}");
            }
            continue;
        }
        net.settle();
        let [a, b] = &net.sides;
        assert!(a.live && b.live, "seed {seed}: live {} {}", a.live, b.live);
        assert_eq!(a.connected_to, b.local, "seed {seed}");
        assert_eq!(b.connected_to, a.local, "seed {seed}");
    }
}

#[test]
fn lane_messages_round_trip_and_bad_ones_are_errors() {
    let qp = QpAddress {
        port: PortAddress {
            lid: 7,
            gid: [9; 16],
        },
        qpn: QpNum(0xabcdef),
    };
    for m in [
        CmMessage::LaneRequest {
            seq: 3,
            lane: 2,
            qp,
        },
        CmMessage::LaneReply {
            seq: u32::MAX,
            lane: 0,
            qp,
        },
        CmMessage::LaneConfirm { seq: 5, lane: 3 },
    ] {
        let mut bytes = Vec::new();
        m.encode(&mut bytes);
        assert!(m.is_lane_message());
        assert_eq!(CmMessage::decode(&bytes), Ok(m));
        for cut in 0..bytes.len() {
            assert!(
                CmMessage::decode(&bytes[..cut]).is_err(),
                "{m:?} cut at {cut}"
            );
        }
    }
    let mut bytes = Vec::new();
    CmMessage::LaneConfirm { seq: 1, lane: 0 }.encode(&mut bytes);
    bytes[8] = 4;
    assert_eq!(CmMessage::decode(&bytes), Err(CmDecodeError::BadLane(4)));
}
