//! The stream over lanes, sans-IO: order across lanes, striping, and lane failures at every
//! point with what was in flight on the lane delivered, lost, or delivered without its
//! acknowledgement.

use rankweave_core::frame::Frame;

use super::*;

fn frame(seq: u64, len: usize) -> Frame {
    let payload: Vec<u8> = (0..len).map(|i| (i as u64 ^ seq) as u8).collect();
    crate::test_frames::eager_frame(0, 0, seq, payload)
}

fn check(f: &Frame, seq: u64, len: usize) {
    assert_eq!(f, &frame(seq, len), "frame {seq} damaged");
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

const CONFIG: StreamConfig = StreamConfig { stripe_min: 1000 };

#[test]
fn large_frames_are_striped_over_the_live_lanes_small_ones_stay_on_the_primary() {
    let mut tx = PeerStream::new(3, CONFIG);
    let mut rx = PeerStream::new(3, CONFIG);
    tx.send(frame(0, 10));
    tx.send(frame(1, 3001));
    tx.send(frame(2, 999));
    let mut sent = Vec::new();
    while let Some(t) = tx.poll_transmit() {
        sent.push(t);
    }
    let lanes: Vec<(usize, u64, u16, u16)> = sent
        .iter()
        .map(|(l, t, _)| (*l, t.seq, t.part, t.parts))
        .collect();
    assert_eq!(
        lanes,
        [
            (0, 0, 0, 1),
            (0, 1, 0, 3),
            (1, 1, 1, 3),
            (2, 1, 2, 3),
            (0, 2, 0, 1)
        ]
    );
    let c = tx.counters();
    assert_eq!(c.frames_striped, 1);
    assert_eq!(c.bytes_per_lane, [10 + 1001 + 999, 1001, 999, 0]);
    // Delivered in reverse: nothing comes out before frame 0, then everything in order.
    for (_, tag, f) in sent.into_iter().rev() {
        rx.on_part(tag, f).unwrap();
        tx.on_delivered(tag);
    }
    assert!(tx.is_idle());
    check(&rx.poll_frame().unwrap(), 0, 10);
    check(&rx.poll_frame().unwrap(), 1, 3001);
    check(&rx.poll_frame().unwrap(), 2, 999);
    assert!(rx.poll_frame().is_none());
    assert!(rx.delivered_below(3));
}

#[test]
fn a_failed_lane_is_no_longer_used_and_the_last_one_ends_the_stream() {
    let mut tx = PeerStream::new(2, CONFIG);
    assert!(tx.lane_failed(0));
    tx.send(frame(0, 5000));
    let (lane, tag, _) = tx.poll_transmit().unwrap();
    assert_eq!((lane, tag.parts), (1, 1), "one lane left: no striping");
    assert!(!tx.lane_failed(1));
    assert!(!tx.any_up());
    assert_eq!(tx.send(frame(1, 1)), None);
}

#[test]
fn inconsistent_parts_are_errors() {
    let mut rx = PeerStream::new(2, CONFIG);
    let t = |part, parts| StreamTag {
        seq: 0,
        part,
        parts,
    };
    rx.on_part(t(0, 2), frame(0, 1)).unwrap();
    assert!(matches!(
        rx.on_part(t(1, 3), frame(0, 1)),
        Err(StreamError::InconsistentParts { expected: 2, .. })
    ));
    assert!(rx.on_part(t(9, 200), frame(0, 1)).is_err());
    assert!(rx.on_part(t(0, 0), frame(0, 1)).is_err());
}

/// One lane fails at a random moment of a random mix of frames: whatever it had in flight
/// was delivered and acknowledged, delivered without the acknowledgement reaching the
/// sender, or lost. The receiver must get every frame exactly once, in order, intact.
#[test]
fn lane_failure_at_any_point_loses_duplicates_and_reorders_nothing() {
    for seed in 1..400u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let lanes = 2 + rng.below(3) as usize;
        let mut tx = PeerStream::new(lanes, CONFIG);
        let mut rx = PeerStream::new(lanes, CONFIG);
        let n = 20 + rng.below(30);
        let lens: Vec<usize> = (0..n)
            .map(|_| {
                if rng.below(4) == 0 {
                    1000 + rng.below(5000) as usize
                } else {
                    rng.below(200) as usize
                }
            })
            .collect();
        // Per lane, in flight: (tag, frame), in order (RC).
        let mut wires: Vec<VecDeque<(StreamTag, Frame)>> = vec![VecDeque::new(); lanes];
        let fail_at = rng.below(n);
        let victim = rng.below(lanes as u64) as usize;
        let mut failed = false;
        let mut got = Vec::new();
        for (seq, &len) in lens.iter().enumerate() {
            tx.send(frame(seq as u64, len));
            while let Some((lane, tag, f)) = tx.poll_transmit() {
                assert!(tx.is_up(lane), "seed {seed}: part sent on a failed lane");
                wires[lane].push_back((tag, f));
            }
            // Each lane moves some of what it carries.
            for (lane, wire) in wires.iter_mut().enumerate() {
                if failed && lane == victim {
                    continue;
                }
                for _ in 0..rng.below(3) {
                    if let Some((tag, f)) = wire.pop_front() {
                        rx.on_part(tag, f).unwrap();
                        tx.on_delivered(tag);
                    }
                }
            }
            if seq as u64 == fail_at {
                failed = true;
                // What the failing lane carries: some arrives, some of that without its
                // acknowledgement, the rest is lost.
                let inflight: Vec<_> = wires[victim].drain(..).collect();
                for (tag, f) in inflight {
                    match rng.below(3) {
                        0 => {
                            rx.on_part(tag, f).unwrap();
                            tx.on_delivered(tag);
                        }
                        1 => rx.on_part(tag, f).unwrap(),
                        _ => {}
                    }
                }
                assert!(tx.lane_failed(victim));
            }
            while let Some(f) = rx.poll_frame() {
                got.push(f);
            }
        }
        // Drain the surviving lanes.
        loop {
            while let Some((lane, tag, f)) = tx.poll_transmit() {
                wires[lane].push_back((tag, f));
            }
            let mut moved = false;
            for (lane, wire) in wires.iter_mut().enumerate() {
                if lane == victim {
                    continue;
                }
                while let Some((tag, f)) = wire.pop_front() {
                    rx.on_part(tag, f).unwrap();
                    tx.on_delivered(tag);
                    moved = true;
                }
            }
            if !moved {
                break;
            }
        }
        while let Some(f) = rx.poll_frame() {
            got.push(f);
        }
        assert_eq!(got.len() as u64, n, "seed {seed}: frames missing");
        for (seq, (f, &len)) in got.iter().zip(&lens).enumerate() {
            check(f, seq as u64, len);
        }
        assert!(tx.is_idle(), "seed {seed}: replay queue not empty");
        assert!(rx.delivered_below(n));
        assert_eq!(tx.counters().lane_failures, 1);
    }
}

#[test]
fn duplicates_are_dropped_and_counted() {
    let mut rx = PeerStream::new(1, CONFIG);
    rx.on_part(StreamTag::whole(0), frame(0, 3)).unwrap();
    rx.on_part(StreamTag::whole(0), frame(0, 3)).unwrap();
    rx.on_part(StreamTag::whole(2), frame(2, 3)).unwrap();
    rx.on_part(StreamTag::whole(2), frame(2, 3)).unwrap();
    assert_eq!(rx.counters().duplicates, 2);
    check(&rx.poll_frame().unwrap(), 0, 3);
    assert!(rx.poll_frame().is_none(), "frame 1 is missing");
}

/// A failed lane that is restored carries new frames again (the primary's eager frames, and
/// its share of striped ones), while what was replayed elsewhere stays there; the receiver
/// gets everything once, in order.
#[test]
fn a_restored_lane_carries_new_frames_again() {
    let mut tx = PeerStream::new(2, CONFIG);
    let mut rx = PeerStream::new(2, CONFIG);
    tx.send(frame(0, 2000));
    assert!(tx.lane_failed(0));
    let mut sent = Vec::new();
    while let Some(t) = tx.poll_transmit() {
        sent.push(t);
    }
    // Both parts went to lane 1 (replayed or not).
    assert!(sent.iter().all(|(lane, _, _)| *lane == 1), "{sent:?}");
    assert!(!tx.lane_restored(1), "lane 1 was up");
    assert!(tx.lane_restored(0));
    assert!(!tx.lane_restored(0), "a repeat changes nothing");
    assert!(tx.is_up(0));
    tx.send(frame(1, 10));
    tx.send(frame(2, 3000));
    while let Some(t) = tx.poll_transmit() {
        sent.push(t);
    }
    let after: Vec<(usize, u64, u16)> = sent[2..]
        .iter()
        .map(|(lane, tag, _)| (*lane, tag.seq, tag.part))
        .collect();
    assert_eq!(after, [(0, 1, 0), (0, 2, 0), (1, 2, 1)]);
    let c = tx.counters();
    assert_eq!((c.lane_failures, c.lane_restorations), (1, 1));
    assert!(c.bytes_per_lane[0] >= 1500 + 10, "{c:?}");
    // Delivered in any lane order, the receiver restores the sender's order.
    for (_, tag, f) in sent.into_iter().rev() {
        tx.on_delivered(tag);
        rx.on_part(tag, f).unwrap();
    }
    check(&rx.poll_frame().unwrap(), 0, 2000);
    check(&rx.poll_frame().unwrap(), 1, 10);
    check(&rx.poll_frame().unwrap(), 2, 3000);
    assert!(rx.poll_frame().is_none());
    assert!(tx.is_idle());
}
