//! The RC transport over the simulated fabric: eager traffic, credits, rendezvous, failures,
//! and communicators on top.

use bytes::Bytes;
use rankweave_core::frame::{Frame, Header};
use rankweave_core::{Arrival, Source, Tag, Transport};

use super::test_support::{frame, pattern};
use super::*;

fn job(n: usize, settings: RcSettings) -> (SimFabric, Vec<RcTransport<SimProvider>>) {
    let fabric = SimFabric::default();
    let providers = (0..n).map(|_| fabric.open_port()).collect();
    (fabric, connect_job(providers, settings).unwrap())
}

/// Drains `t` until `want` frames came (and progresses the other ranks meanwhile); panics
/// after many rounds without them.
fn collect_frames(ranks: &[RcTransport<SimProvider>], at: usize, want: usize) -> Vec<(u32, Frame)> {
    let mut got = Vec::new();
    let mut out = Vec::new();
    for _ in 0..10_000 {
        for (i, r) in ranks.iter().enumerate() {
            if i != at {
                r.progress().unwrap();
            }
        }
        ranks[at].drain(&mut out).unwrap();
        for a in out.drain(..) {
            match a {
                Arrival::Frame { from, frame } => got.push((from, frame)),
                Arrival::PeerLost { rank } => panic!("rank {rank} lost"),
            }
        }
        if got.len() >= want {
            return got;
        }
    }
    panic!("only {} of {want} frames arrived", got.len());
}

#[test]
fn eager_frames_arrive_in_order_and_intact() {
    let (fabric, ranks) = job(3, RcSettings::default());
    for seq in 0..500u64 {
        let len = (seq as usize * 37) % 4000;
        ranks[0]
            .send(2, frame(seq, Bytes::from(pattern(seq, len))))
            .unwrap();
        ranks[1]
            .send(2, frame(seq, Bytes::from(pattern(seq + 1000, 10))))
            .unwrap();
    }
    let got = collect_frames(&ranks, 2, 1000);
    for from in [0u32, 1] {
        let seqs: Vec<u64> = got
            .iter()
            .filter(|(f, _)| *f == from)
            .map(|(_, fr)| match fr.header {
                Header::Eager(e) => e.seq,
                _ => u64::MAX,
            })
            .collect();
        assert_eq!(seqs, (0..500).collect::<Vec<_>>(), "order from rank {from}");
    }
    for (from, fr) in &got {
        let Header::Eager(e) = fr.header else {
            panic!("not eager")
        };
        let (seed, len) = if *from == 0 {
            (e.seq, (e.seq as usize * 37) % 4000)
        } else {
            (e.seq + 1000, 10)
        };
        assert_eq!(&fr.payload[..], &pattern(seed, len)[..]);
    }
    let c = ranks[0].counters();
    assert_eq!(c.channels.eager_sent, 500);
    assert_eq!(c.channels.rendezvous_sent, 0);
    assert_eq!(
        fabric.counters().rnr_naks,
        0,
        "credits kept every send covered"
    );
}

/// A receiver that does not look at its completion queue reposts nothing: the sender runs
/// out of credits (keeping the last one in reserve), queues instead of overrunning the
/// receiver (no RNR), and everything flows once the receiver takes its messages in.
#[test]
fn credit_exhaustion_stalls_the_sender_without_rnr_and_recovers() {
    let settings = RcSettings {
        window: 4,
        ..RcSettings::default()
    };
    let (fabric, ranks) = job(2, settings);
    for seq in 0..40 {
        ranks[0]
            .send(1, frame(seq, Bytes::from(vec![seq as u8; 100])))
            .unwrap();
        ranks[0].progress().unwrap();
    }
    assert_eq!(
        ranks[0].credits_for(1),
        Some(1),
        "one credit kept in reserve"
    );
    let before = ranks[0].counters();
    assert_eq!(before.channels.eager_sent, 3, "window 4 minus the reserve");
    assert!(before.channels.credit_stalls >= 1);
    assert_eq!(fabric.counters().rnr_naks, 0);

    let got = collect_frames(&ranks, 1, 40);
    let seqs: Vec<u8> = got.iter().map(|(_, f)| f.payload[0]).collect();
    assert_eq!(seqs, (0..40).collect::<Vec<u8>>());
    assert_eq!(fabric.counters().rnr_naks, 0);
    // Rank 1 sends nothing: it returned credits in credit-only messages.
    assert!(ranks[1].counters().channels.credit_updates_sent >= 1);
    // And the sender ends with its window back, minus what rank 1 still owes (below the
    // update threshold).
    ranks[0].progress().unwrap();
    assert!(ranks[0].credits_for(1).unwrap() >= 2);
}

/// Both ranks flood each other with tiny windows: neither may deadlock.
#[test]
fn both_directions_at_once_with_a_tiny_window_do_not_deadlock() {
    let settings = RcSettings {
        window: 4,
        send_buffers: 2,
        ..RcSettings::default()
    };
    let (fabric, ranks) = job(2, settings);
    for seq in 0..200 {
        ranks[0]
            .send(1, frame(seq, Bytes::from(vec![1; 50])))
            .unwrap();
        ranks[1]
            .send(0, frame(seq, Bytes::from(vec![2; 50])))
            .unwrap();
    }
    let mut got = [0usize; 2];
    let mut out = Vec::new();
    for _ in 0..10_000 {
        for (i, r) in ranks.iter().enumerate() {
            r.drain(&mut out).unwrap();
            got[i] += out
                .drain(..)
                .filter(|a| matches!(a, Arrival::Frame { .. }))
                .count();
        }
        if got == [200, 200] {
            break;
        }
    }
    assert_eq!(got, [200, 200]);
    assert_eq!(fabric.counters().rnr_naks, 0);
}

/// Rank 0 sends an eager frame, a 64 MiB frame of `pattern(seed)` and another eager frame;
/// rank 1 gets all three intact and in order.
fn send_64_mib_between_eager_frames(ranks: &[RcTransport<SimProvider>], seed: u64) {
    let big = Bytes::from(pattern(seed, 64 << 20));
    ranks[0]
        .send(1, frame(0, Bytes::from_static(b"before")))
        .unwrap();
    ranks[0].send(1, frame(1, big.clone())).unwrap();
    ranks[0]
        .send(1, frame(2, Bytes::from_static(b"after")))
        .unwrap();
    let got = collect_frames(ranks, 1, 3);
    assert_eq!(&got[0].1.payload[..], b"before");
    assert_eq!(got[1].1.payload.len(), 64 << 20);
    assert!(got[1].1.payload == big, "64 MiB differ");
    assert_eq!(&got[2].1.payload[..], b"after");
}

/// A 64 MiB frame goes by rendezvous (RDMA write with immediate data: reads are turned off)
/// between eager frames and arrives intact and in its place.
#[test]
fn a_64_mib_rendezvous_arrives_intact_and_in_order() {
    let settings = RcSettings {
        read_min: usize::MAX,
        ..RcSettings::default()
    };
    let (fabric, ranks) = job(2, settings);
    send_64_mib_between_eager_frames(&ranks, 42);
    let c = ranks[0].counters();
    assert_eq!(c.channels.rendezvous_sent, 1);
    assert_eq!(c.channels.rdma_bytes_sent, 64 << 20);
    assert_eq!(fabric.counters().rdma_bytes, 64 << 20);
}

/// Large payloads are written in pieces of at most `max_write` bytes; only the last carries
/// the immediate data, and the receiver sees the whole payload.
#[test]
fn a_payload_larger_than_one_write_goes_in_pieces() {
    let settings = RcSettings {
        max_write: 1000,
        ..RcSettings::default()
    };
    let (_, ranks) = job(2, settings);
    let big = Bytes::from(pattern(7, 10_500));
    ranks[0].send(1, frame(0, big.clone())).unwrap();
    let got = collect_frames(&ranks, 1, 1);
    assert_eq!(got[0].1.payload, big);
}

/// Sending the same payload twice reuses its registration.
#[test]
fn the_registration_cache_serves_a_repeated_payload() {
    let (_, ranks) = job(2, RcSettings::default());
    let big = Bytes::from(pattern(1, 1 << 20));
    ranks[0].send(1, frame(0, big.clone())).unwrap();
    collect_frames(&ranks, 1, 1);
    ranks[0].send(1, frame(1, big.clone())).unwrap();
    collect_frames(&ranks, 1, 1);
    let c = ranks[0].counters().mr_cache;
    assert_eq!((c.misses, c.hits), (1, 1));
}

/// A peer whose port fails is reported lost once a send to it fails.
#[test]
fn a_failed_port_makes_the_peer_lost() {
    let (fabric, ranks) = job(2, RcSettings::default());
    fabric.fail_port(2);
    ranks[0]
        .send(1, frame(0, Bytes::from_static(b"x")))
        .unwrap();
    let mut out = Vec::new();
    ranks[0].drain(&mut out).unwrap();
    assert!(
        out.iter()
            .any(|a| matches!(a, Arrival::PeerLost { rank: 1 })),
        "{out:?}"
    );
    assert!(ranks[0].counters().failed_completions >= 1);
    // Later frames to it are dropped without an error.
    assert_eq!(ranks[0].send(1, frame(1, Bytes::new())), Ok(()));
}

/// A closing rank's frames arrive before its loss is reported; it drains.
#[test]
fn close_delivers_everything_then_reports_the_peer_lost() {
    let (_, ranks) = job(2, RcSettings::default());
    for seq in 0..10 {
        ranks[0]
            .send(1, frame(seq, Bytes::from(vec![seq as u8; 20_000])))
            .unwrap();
    }
    ranks[0].close();
    let mut arrivals = Vec::new();
    for _ in 0..1000 {
        ranks[1].drain(&mut arrivals).unwrap();
        ranks[0].progress().unwrap();
        if arrivals
            .iter()
            .any(|a| matches!(a, Arrival::PeerLost { .. }))
        {
            break;
        }
    }
    assert_eq!(arrivals.len(), 11, "{arrivals:?}");
    for (i, a) in arrivals[..10].iter().enumerate() {
        let Arrival::Frame { frame, .. } = a else {
            panic!("{a:?}")
        };
        assert_eq!(frame.payload[0], i as u8);
    }
    assert!(matches!(arrivals[10], Arrival::PeerLost { rank: 0 }));
    assert!(ranks[0].is_drained());
    assert_eq!(
        ranks[0].send(1, frame(0, Bytes::new())),
        Err(rankweave_core::TransportError::Closed)
    );
}

#[test]
fn bad_settings_and_ranks_are_errors() {
    let fabric = SimFabric::default();
    let bad = RcSettings {
        window: 2,
        ..RcSettings::default()
    };
    assert!(matches!(
        rc::PreparedRc::new(vec![fabric.open_port()], 0, 2, bad),
        Err(VerbsError::InvalidSetting(_))
    ));
    let (_, ranks) = job(2, RcSettings::default());
    assert_eq!(
        ranks[0].send(5, frame(0, Bytes::new())),
        Err(rankweave_core::TransportError::PeerUnreachable(5))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn communicators_exchange_messages_of_every_size() {
    let comms = simulated_world(3, &Config::default()).unwrap();
    let sizes = [0usize, 1, 100, 8 * 1024, 64 * 1024, 1 << 20, 9 << 20];
    let mut tasks = tokio::task::JoinSet::new();
    for comm in comms {
        tasks.spawn(async move {
            let me = comm.rank();
            let n = comm.size();
            let next = (me + 1) % n;
            let prev = (me + n - 1) % n;
            for (i, &len) in sizes.iter().enumerate() {
                let send = comm.send(next, i as u32, pattern((me * 100 + i) as u64, len));
                let msg = comm
                    .recv(Source::Rank(prev), Tag::Value(i as u32))
                    .await
                    .unwrap();
                send.await.unwrap();
                assert_eq!(msg.data(), &pattern((prev * 100 + i) as u64, len)[..]);
            }
            comm.shutdown().await;
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
}

/// `n` ranks with `ports` ports each, all connected lane by lane; also each rank's port LIDs.
fn multi_port_job(
    n: usize,
    ports: usize,
    settings: RcSettings,
) -> (SimFabric, Vec<RcTransport<SimProvider>>, Vec<Vec<u16>>) {
    let fabric = SimFabric::default();
    let providers: Vec<Vec<SimProvider>> = (0..n)
        .map(|_| (0..ports).map(|_| fabric.open_port()).collect())
        .collect();
    let lids = providers
        .iter()
        .map(|ps| ps.iter().map(|p| p.port().lid).collect())
        .collect();
    let ranks = connect_job_ports(providers, settings).unwrap();
    (fabric, ranks, lids)
}

/// The frames of a transfer: eager frames of varied sizes with one large frame at `big_at`.
fn transfer_frame(seq: u64, big_at: u64, big_len: usize) -> Frame {
    let len = if seq == big_at {
        big_len
    } else {
        (seq as usize * 53) % 3000
    };
    frame(seq, Bytes::from(pattern(seq, len)))
}

fn check_transfer(got: &[(u32, Frame)], from: u32, n: u64, big_at: u64, big_len: usize) {
    let mine: Vec<&Frame> = got
        .iter()
        .filter(|(f, _)| *f == from)
        .map(|(_, f)| f)
        .collect();
    assert_eq!(mine.len() as u64, n, "frames from rank {from}");
    for (seq, f) in mine.into_iter().enumerate() {
        let want = transfer_frame(seq as u64, big_at, big_len);
        assert!(
            f == &want,
            "frame {seq} from rank {from} out of order or damaged"
        );
    }
}

/// A large frame is split across both ports (each port's queue pairs write their part), and
/// eager frames stay on the first.
#[test]
fn striping_moves_a_large_frame_over_both_ports() {
    let settings = RcSettings {
        read_min: usize::MAX,
        ..RcSettings::default()
    };
    let (fabric, ranks, lids) = multi_port_job(2, 2, settings);
    for seq in 0..20 {
        ranks[0].send(1, transfer_frame(seq, 10, 8 << 20)).unwrap();
    }
    let got = collect_frames(&ranks, 1, 20);
    check_transfer(&got, 0, 20, 10, 8 << 20);
    let c = ranks[0].counters().stream;
    assert_eq!(c.frames_striped, 1);
    assert_eq!(c.parts_per_lane[0], 20, "19 eager frames and one part");
    assert_eq!(c.parts_per_lane[1], 1, "the other part");
    assert_eq!(c.bytes_per_lane[1], 4 << 20);
    // The fabric saw each port of rank 0 write half of the large frame.
    assert_eq!(fabric.port_rdma_bytes(lids[0][0]), 4 << 20);
    assert_eq!(fabric.port_rdma_bytes(lids[0][1]), 4 << 20);
}

/// Both ranks send a stream of eager frames around a large striped frame to each other; one
/// port (each of the four in turn, at several moments) fails mid-way. Everything arrives once,
/// in order and intact, over the surviving port; the failure is seen by both sides.
#[test]
fn a_port_failing_mid_transfer_loses_duplicates_and_reorders_nothing() {
    let n = 120u64;
    let big_at = 40;
    for victim in 0..4usize {
        for fail_after in [0usize, 2, 6] {
            let big_len = if victim == 0 && fail_after == 2 {
                64 << 20
            } else {
                3 << 20
            };
            let settings = RcSettings {
                window: 8,
                stripe_min: 1 << 20,
                ..RcSettings::default()
            };
            let (fabric, ranks, lids) = multi_port_job(2, 2, settings);
            let lid = lids[victim / 2][victim % 2];
            for seq in 0..n {
                for (me, t) in ranks.iter().enumerate() {
                    t.send(1 - me as u32, transfer_frame(seq, big_at, big_len))
                        .unwrap();
                }
            }
            let mut got: [Vec<(u32, Frame)>; 2] = [Vec::new(), Vec::new()];
            let mut out = Vec::new();
            for round in 0..20_000 {
                if round == fail_after {
                    fabric.fail_port(lid);
                }
                for (me, t) in ranks.iter().enumerate() {
                    t.drain(&mut out).unwrap();
                    for a in out.drain(..) {
                        match a {
                            Arrival::Frame { from, frame } => got[me].push((from, frame)),
                            Arrival::PeerLost { rank } => {
                                panic!("victim {victim}, fail after {fail_after}: rank {rank} lost")
                            }
                        }
                    }
                }
                if got.iter().all(|g| g.len() as u64 >= n) && round > fail_after {
                    break;
                }
            }
            for me in 0..2 {
                check_transfer(&got[me], 1 - me as u32, n, big_at, big_len);
                assert!(
                    ranks[me].is_connected(1 - me as u32),
                    "the other lane carries on"
                );
                assert!(
                    !ranks[me].lane_up(1 - me as u32, victim % 2),
                    "victim {victim}, fail after {fail_after}: rank {me} still uses the failed lane"
                );
                assert_eq!(ranks[me].counters().stream.lane_failures, 1);
            }
            // Before the first round, each lane holds frames (eager ones waiting for credits,
            // rendezvous parts waiting for their Cts): the failure must replay some.
            let replayed: u64 = ranks.iter().map(|r| r.counters().stream.replayed).sum();
            assert!(
                fail_after > 0 || replayed > 0,
                "victim {victim}: nothing was replayed"
            );
        }
    }
}

/// When every port of a peer fails, the peer is lost after the frames already complete.
#[test]
fn losing_every_port_makes_the_peer_lost() {
    let (fabric, ranks, lids) = multi_port_job(2, 2, RcSettings::default());
    ranks[0]
        .send(1, frame(0, Bytes::from_static(b"a")))
        .unwrap();
    fabric.fail_port(lids[1][0]);
    ranks[0]
        .send(1, frame(1, Bytes::from_static(b"b")))
        .unwrap();
    fabric.fail_port(lids[1][1]);
    ranks[0]
        .send(1, frame(2, Bytes::from_static(b"c")))
        .unwrap();
    let mut out = Vec::new();
    for _ in 0..100 {
        ranks[0].drain(&mut out).unwrap();
        if out
            .iter()
            .any(|a| matches!(a, Arrival::PeerLost { rank: 1 }))
        {
            break;
        }
    }
    assert!(
        out.iter()
            .any(|a| matches!(a, Arrival::PeerLost { rank: 1 })),
        "{out:?}"
    );
    assert_eq!(ranks[0].counters().stream.lane_failures, 2);
}

/// A 64 MiB frame goes by RDMA-read rendezvous (the default threshold): the receiver reads it
/// (its port starts the RDMA, the sender's moves none), it arrives byte for byte between eager
/// frames, and the Fin releases the sender's registration so the sender drains.
#[test]
fn a_64_mib_frame_by_rdma_read_arrives_intact_and_in_order() {
    let (fabric, ranks) = job(2, RcSettings::default());
    send_64_mib_between_eager_frames(&ranks, 43);
    let (sender, receiver) = (ranks[0].counters(), ranks[1].counters());
    assert_eq!(sender.channels.rendezvous_sent, 1);
    assert_eq!(sender.channels.read_rendezvous_sent, 1);
    assert_eq!(sender.channels.rdma_bytes_sent, 0, "nothing written");
    assert_eq!(receiver.channels.rdma_bytes_read, 64 << 20);
    // Ports 1 and 2 are the ranks' ports: the reader's port moved the bytes.
    assert_eq!(fabric.port_rdma_bytes(1), 0);
    assert_eq!(fabric.port_rdma_bytes(2), 64 << 20);
    // The Fin came back: nothing of the sender's is outstanding.
    for _ in 0..10 {
        ranks[1].progress().unwrap();
        if ranks[0].is_drained() {
            break;
        }
    }
    assert!(ranks[0].is_drained(), "the sender still waits for the Fin");
}

/// A read larger than `max_write` goes in pieces; the last one completes the transfer.
#[test]
fn a_read_larger_than_one_request_goes_in_pieces() {
    let settings = RcSettings {
        max_write: 1000,
        read_min: 9000,
        ..RcSettings::default()
    };
    let (_, ranks) = job(2, settings);
    let big = Bytes::from(pattern(8, 10_500));
    ranks[0].send(1, frame(0, big.clone())).unwrap();
    let got = collect_frames(&ranks, 1, 1);
    assert_eq!(got[0].1.payload, big);
    assert_eq!(ranks[0].counters().channels.read_rendezvous_sent, 1);
}

/// `read_min` picks the protocol: rendezvous frames below it are written, from it on read;
/// `usize::MAX` turns reads off. All arrive intact and in order either way.
#[test]
fn the_read_threshold_picks_the_rendezvous_protocol() {
    let sizes = [32 << 10, (64 << 10) - 1, 64 << 10, 1 << 20, 100];
    for (read_min, reads, read_bytes) in [
        (64 << 10, 2, (64 << 10) + (1 << 20)),
        (usize::MAX, 0, 0),
        (0, 4, (32 << 10) + (64 << 10) - 1 + (64 << 10) + (1 << 20)),
    ] {
        let settings = RcSettings {
            read_min,
            ..RcSettings::default()
        };
        let (_, ranks) = job(2, settings);
        let payloads: Vec<Bytes> = sizes
            .iter()
            .zip(0..)
            .map(|(&len, seed)| Bytes::from(pattern(seed, len)))
            .collect();
        for (seq, p) in payloads.iter().enumerate() {
            ranks[0].send(1, frame(seq as u64, p.clone())).unwrap();
        }
        let got = collect_frames(&ranks, 1, sizes.len());
        for (g, p) in got.iter().zip(&payloads) {
            assert!(g.1.payload == *p, "read_min {read_min}: a frame differs");
        }
        let c = ranks[0].counters().channels;
        assert_eq!(c.eager_sent, 1, "the 100-byte frame is eager");
        assert_eq!(c.rendezvous_sent, 4);
        assert_eq!(c.read_rendezvous_sent, reads, "read_min {read_min}");
        let total: u64 = sizes[..4].iter().map(|&n| n as u64).sum();
        assert_eq!(c.rdma_bytes_sent, total - read_bytes as u64);
        assert_eq!(
            ranks[1].counters().channels.rdma_bytes_read,
            read_bytes as u64
        );
    }
}

/// A port fails while an 8 MiB frame goes by RDMA read on the first of two lanes (no
/// striping):
///
/// * the sender's port, after its ReadRts went out: the read request fails;
/// * the reader's port at the same moment: the read cannot be carried out;
/// * the sender's port after the read completed while the reader's Fin waits for a credit
///   (the reader used up its credits on eager frames first): the data arrived but the sender
///   never hears so, replays the frame, and the reader drops the copy;
/// * the sender's port after the Fin reached its completion queue: the frame counts as
///   delivered and is not sent again.
///
/// Every time each frame arrives once, in order and intact, both ranks stop using the lane,
/// and nothing of the sender's stays outstanding.
#[test]
fn a_port_failing_mid_read_still_delivers_exactly_once_in_order() {
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum When {
        SenderPortBeforeRead,
        ReaderPortBeforeRead,
        SenderPortWhileFinWaits,
        SenderPortAfterFin,
    }
    for when in [
        When::SenderPortBeforeRead,
        When::ReaderPortBeforeRead,
        When::SenderPortWhileFinWaits,
        When::SenderPortAfterFin,
    ] {
        let settings = RcSettings {
            window: 4,
            read_min: 64 << 10,
            stripe_min: usize::MAX,
            ..RcSettings::default()
        };
        let (fabric, ranks, lids) = multi_port_job(2, 2, settings);
        let back: Vec<Frame> = (0..3)
            .map(|seq| frame(seq, Bytes::from(pattern(seq + 10, 100))))
            .collect();
        if when == When::SenderPortWhileFinWaits {
            // Rank 1 spends its data credits on lane 0 (rank 0 does not progress, so none
            // come back): its Fin will have to wait.
            for f in &back {
                ranks[1].send(0, f.clone()).unwrap();
            }
        }
        let big = Bytes::from(pattern(99, 8 << 20));
        let frames = [
            frame(0, Bytes::from_static(b"a")),
            frame(1, big.clone()),
            frame(2, Bytes::from_static(b"b")),
        ];
        for f in &frames {
            ranks[0].send(1, f.clone()).unwrap();
        }
        match when {
            When::SenderPortBeforeRead => fabric.fail_port(lids[0][0]),
            When::ReaderPortBeforeRead => fabric.fail_port(lids[1][0]),
            When::SenderPortWhileFinWaits | When::SenderPortAfterFin => {
                // The reader reads and delivers; its Fin waits for a credit or goes out...
                ranks[1].progress().unwrap();
                assert_eq!(ranks[1].counters().channels.rdma_bytes_read, 8 << 20);
                // ...and the sender's port fails before the sender looked.
                fabric.fail_port(lids[0][0]);
            }
        }
        let want_back = if when == When::SenderPortWhileFinWaits {
            3
        } else {
            0
        };
        let mut got: [Vec<Frame>; 2] = [Vec::new(), Vec::new()];
        let mut out = Vec::new();
        for _ in 0..1000 {
            for (me, t) in ranks.iter().enumerate() {
                t.drain(&mut out).unwrap();
                for a in out.drain(..) {
                    match a {
                        Arrival::Frame { from, frame } if from == 1 - me as u32 => {
                            got[me].push(frame)
                        }
                        other => panic!("{when:?}: rank {me} got {other:?}"),
                    }
                }
            }
            if got[1].len() >= 3 && got[0].len() >= want_back && ranks[0].is_drained() {
                break;
            }
        }
        assert_eq!(got[1].len(), 3, "{when:?}: frames lost or duplicated");
        for (g, want) in got[1].iter().zip(&frames) {
            assert!(g == want, "{when:?}: out of order or damaged");
        }
        assert_eq!(got[0], back[..want_back], "{when:?}: rank 1's frames");
        assert!(ranks[0].is_drained(), "{when:?}: the sender still waits");
        for (me, t) in ranks.iter().enumerate() {
            assert!(
                !t.lane_up(1 - me as u32, 0),
                "{when:?}: rank {me} uses lane 0"
            );
            assert!(
                t.lane_up(1 - me as u32, 1),
                "{when:?}: rank {me} lost lane 1"
            );
        }
        let (sender, reader) = (ranks[0].counters(), ranks[1].counters());
        let first_read = fabric.port_rdma_bytes(lids[1][0]);
        let second_read = fabric.port_rdma_bytes(lids[1][1]);
        match when {
            When::SenderPortBeforeRead | When::ReaderPortBeforeRead => {
                // The first read moved nothing; the replay was read over the other port.
                assert_eq!((first_read, second_read), (0, 8 << 20), "{when:?}");
                assert_eq!(sender.channels.read_rendezvous_sent, 2, "{when:?}");
            }
            When::SenderPortWhileFinWaits => {
                // Read twice; the second copy was dropped.
                assert_eq!((first_read, second_read), (8 << 20, 8 << 20));
                assert_eq!(sender.channels.read_rendezvous_sent, 2);
                assert!(
                    reader.stream.duplicates >= 1,
                    "the replayed copy is dropped"
                );
            }
            When::SenderPortAfterFin => {
                // The Fin came in: nothing read twice.
                assert_eq!((first_read, second_read), (8 << 20, 0));
                assert_eq!(sender.channels.read_rendezvous_sent, 1);
            }
        }
    }
}

/// A lane that fails while a write rendezvous waits for its data deregisters the receive
/// buffer it had registered for it: the port's registrations return to what they were, and
/// the frame arrives once over the other lane.
#[test]
fn a_failed_lane_deregisters_its_pending_write_rendezvous_buffers() {
    let settings = RcSettings {
        read_min: usize::MAX,
        ..RcSettings::default()
    };
    let (fabric, ranks, lids) = multi_port_job(2, 2, settings);
    let receiver_port = lids[1][0];
    let before = fabric.registered_regions(receiver_port);
    // 256 KiB: a write rendezvous (not striped) on the first lane.
    let sent = frame(0, Bytes::from(pattern(0, 256 << 10)));
    ranks[0].send(1, sent.clone()).unwrap();
    // The receiver takes the Rts, registers a buffer and answers with a Cts; the sender does
    // not run, so nothing is written into the buffer.
    ranks[1].progress().unwrap();
    assert_eq!(
        fabric.registered_regions(receiver_port),
        before + 1,
        "the transfer's buffer is registered"
    );
    fabric.fail_port(receiver_port);
    let got = collect_frames(&ranks, 1, 1);
    assert_eq!(got.len(), 1);
    assert!(got[0].1 == sent, "the frame, intact");
    assert!(!ranks[1].lane_up(0, 0));
    assert_eq!(
        fabric.registered_regions(receiver_port),
        before,
        "the failed lane's transfer buffer is deregistered"
    );
    assert!(ranks[1].counters().stream.lane_failures >= 1);
}
