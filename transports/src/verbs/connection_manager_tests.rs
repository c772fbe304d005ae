//! The connection set-up between two managers over a simulated lossy, duplicating,
//! reordering datagram network, with simulated time.

use std::time::{Duration, Instant};

use super::*;

use crate::verbs::provider::{PortAddress, QpAddress, QpNum};
use crate::verbs::test_support::{LossyWire, XorShift};

/// Rank `rank`'s queue pairs: two lanes for odd ranks, one for even ones.
fn qp(rank: u32) -> RcAddress {
    let lane = |l: u32| QpAddress {
        port: PortAddress {
            lid: (rank * 2 + l) as u16 + 1,
            gid: [rank as u8; 16],
        },
        qpn: QpNum(0x100 + rank * 2 + l),
    };
    let lanes: Vec<QpAddress> = (0..1 + rank % 2).map(lane).collect();
    RcAddress::new(&lanes).unwrap()
}

/// Two managers (ranks 0 and 1) and the datagrams between them.
struct Pair {
    cm: [ConnectionManager; 2],
    now: Instant,
    wire: LossyWire<CmMessage>,
    events: [Vec<CmEvent>; 2],
}

impl Pair {
    fn new(seed: u64) -> Pair {
        Pair {
            cm: [
                ConnectionManager::new(0, CmConfig::default()),
                ConnectionManager::new(1, CmConfig::default()),
            ],
            now: Instant::now(),
            wire: LossyWire::new(seed),
            events: [Vec::new(), Vec::new()],
        }
    }

    fn collect(&mut self) {
        for r in 0..2u32 {
            while let Some((to, m)) = self.cm[r as usize].poll_transmit() {
                // The encoding is part of the path.
                let mut bytes = Vec::new();
                m.encode(&mut bytes);
                self.wire
                    .send(to, r, CmMessage::decode(&bytes).expect("decodes"));
            }
            while let Some(e) = self.cm[r as usize].poll_event() {
                self.events[r as usize].push(e);
            }
        }
    }

    /// Delivers everything in flight, losing each with `loss` percent, duplicating with `dup`
    /// percent, in random order when `shuffle`.
    fn deliver(&mut self, loss: u64, dup: u64, shuffle: bool) {
        self.collect();
        let lost = |_: &CmMessage, rng: &mut XorShift| rng.next() % 100 < loss;
        for (to, from, m) in self.wire.arrivals(lost, dup, shuffle) {
            self.cm[to as usize].handle_message(self.now, from, qp(to), m);
        }
        self.collect();
    }

    fn drop_all(&mut self) {
        self.collect();
        self.wire.clear();
    }

    fn advance(&mut self, d: Duration) {
        self.now += d;
        for cm in &mut self.cm {
            if cm.poll_timeout().is_some_and(|t| t <= self.now) {
                cm.handle_timeout(self.now);
            }
        }
        self.collect();
    }

    fn established(&self, r: usize) -> usize {
        self.events[r]
            .iter()
            .filter(|e| matches!(e, CmEvent::Established { .. }))
            .count()
    }

    /// Checks each side connected its queue pair to the other's, once, before it was told
    /// it may send.
    fn assert_connected_once(&self) {
        for r in 0..2usize {
            let other = 1 - r as u32;
            assert_eq!(self.established(r), 1, "rank {r}: {:?}", self.events[r]);
            assert!(self.cm[r].is_connected(other));
            let connect = self.events[r]
                .iter()
                .position(|e| matches!(e, CmEvent::Connect { .. }))
                .expect("connected its queue pair");
            let est = self.events[r]
                .iter()
                .position(|e| matches!(e, CmEvent::Established { .. }))
                .expect("established");
            assert!(connect < est, "rank {r}: {:?}", self.events[r]);
            for e in &self.events[r] {
                if let CmEvent::Connect { peer, remote } = e {
                    assert_eq!((*peer, *remote), (other, qp(other)));
                }
            }
        }
    }
}

#[test]
fn request_reply_confirm_connects_both_sides() {
    let mut p = Pair::new(1);
    p.cm[0].start(p.now, 1, qp(0));
    assert!(p.cm[0].is_connecting(1));
    p.deliver(0, 0, false); // Request → rank 1 connects, replies
    assert!(p.cm[1].is_connecting(1 - 1));
    assert_eq!(p.established(1), 0, "the responder waits for the Confirm");
    p.deliver(0, 0, false); // Reply → rank 0 connects, established, confirms
    assert_eq!(p.established(0), 1);
    p.deliver(0, 0, false); // Confirm
    p.assert_connected_once();
    assert_eq!(p.cm[0].poll_timeout(), None);
    assert_eq!(p.cm[1].poll_timeout(), None);
    // Starting again once connected does nothing.
    p.cm[0].start(p.now, 1, qp(0));
    p.collect();
    assert!(p.wire.is_empty());
}

#[test]
fn simultaneous_requests_make_one_connection_the_lower_rank_requesting() {
    let mut p = Pair::new(2);
    p.cm[0].start(p.now, 1, qp(0));
    p.cm[1].start(p.now, 0, qp(1));
    for _ in 0..4 {
        p.deliver(0, 0, false);
    }
    p.assert_connected_once();
    assert_eq!(p.cm[0].counters().ties_won, 1);
    assert_eq!(p.cm[1].counters().ties_lost, 1);
    assert_eq!(p.cm[1].counters().replies_sent, 1);
    assert_eq!(p.cm[0].counters().replies_sent, 0);
}

#[test]
fn a_lost_request_reply_or_confirm_is_retransmitted() {
    for lose in 0..3 {
        let mut p = Pair::new(3);
        p.cm[0].start(p.now, 1, qp(0));
        for step in 0..3 {
            if step == lose {
                p.drop_all();
                p.advance(Duration::from_millis(25));
            }
            p.deliver(0, 0, false);
        }
        p.deliver(0, 0, false);
        p.assert_connected_once();
        let retransmitted = p.cm[0].counters().retransmissions + p.cm[1].counters().retransmissions;
        assert!(retransmitted >= 1, "lost message {lose}");
    }
}

#[test]
fn duplicates_change_nothing() {
    let mut p = Pair::new(4);
    p.cm[0].start(p.now, 1, qp(0));
    for _ in 0..3 {
        p.deliver(0, 100, false);
    }
    p.assert_connected_once();
    let dups = p.cm[0].counters().duplicates + p.cm[1].counters().duplicates;
    assert!(dups >= 2, "{dups}");
    // A stale Request (an old attempt's) after the connection is answered, not reconnected.
    p.cm[1].handle_message(p.now, 0, qp(1), CmMessage::Request { seq: 1, qp: qp(0) });
    p.deliver(0, 0, false);
    p.assert_connected_once();
}

#[test]
fn silence_fails_the_attempt_after_the_configured_sends() {
    let mut p = Pair::new(5);
    p.cm[0].start(p.now, 1, qp(0));
    for _ in 0..20 {
        p.drop_all();
        p.advance(Duration::from_secs(10));
    }
    assert_eq!(p.events[0], vec![CmEvent::Failed { peer: 1 }]);
    assert_eq!(p.cm[0].counters().requests_sent, 8);
    assert!(!p.cm[0].is_connecting(1) && !p.cm[0].is_connected(1));
    // A later attempt uses a new sequence number and can still succeed.
    p.cm[0].start(p.now, 1, qp(0));
    for _ in 0..3 {
        p.deliver(0, 0, false);
    }
    assert!(p.cm[0].is_connected(1) && p.cm[1].is_connected(0));
}

#[test]
fn random_loss_duplication_and_reordering_never_make_two_connections() {
    for seed in 1..300u64 {
        let mut p = Pair::new(seed);
        let both = seed % 3 == 0;
        p.cm[0].start(p.now, 1, qp(0));
        if both {
            p.cm[1].start(p.now, 0, qp(1));
        }
        for _ in 0..40 {
            p.deliver(30, 20, true);
            p.advance(Duration::from_millis(30));
            if p.cm[0].is_connected(1) && p.cm[1].is_connected(0) {
                break;
            }
        }
        // Whatever happened, nobody established twice, and a side that was told it may send
        // has its peer's queue pair connected to its own.
        for r in 0..2 {
            assert!(p.established(r) <= 1, "seed {seed}: {:?}", p.events[r]);
        }
        if p.established(0) == 1 && p.established(1) == 1 {
            p.assert_connected_once();
        }
        for r in 0..2usize {
            if p.established(r) == 1 {
                assert!(
                    p.events[1 - r]
                        .iter()
                        .any(|e| matches!(e, CmEvent::Connect { .. })),
                    "seed {seed}: rank {r} may send but its peer never connected"
                );
            }
        }
    }
}

#[test]
fn messages_round_trip_and_bad_bytes_are_typed_errors() {
    for m in [
        CmMessage::Request { seq: 7, qp: qp(3) },
        CmMessage::Reply {
            seq: u32::MAX,
            qp: qp(9),
        },
        CmMessage::Confirm { seq: 0 },
    ] {
        let mut b = Vec::new();
        m.encode(&mut b);
        assert!(b.len() <= CmMessage::MAX_LEN);
        assert_eq!(CmMessage::decode(&b), Ok(m));
        for cut in 0..b.len() {
            assert!(matches!(
                CmMessage::decode(&b[..cut]),
                Err(CmDecodeError::Truncated { .. })
            ));
        }
    }
    assert_eq!(
        CmMessage::decode(b"XYZ\x01\0\0\0\0"),
        Err(CmDecodeError::BadMagic(*b"XYZ"))
    );
    assert_eq!(
        CmMessage::decode(b"CM1\x09\0\0\0\0"),
        Err(CmDecodeError::UnknownKind(9))
    );
    for lanes in [0u8, 5, 255] {
        let mut b = b"CM1\x01\0\0\0\0".to_vec();
        b.push(lanes);
        b.extend_from_slice(&[0; 200]);
        assert_eq!(
            CmMessage::decode(&b),
            Err(CmDecodeError::BadLaneCount(lanes))
        );
    }
}
