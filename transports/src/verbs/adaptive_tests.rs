//! Adaptive connection management over the simulated fabric: traffic over UD until the
//! threshold, RC connections made on demand (also from both sides at once, and with UD
//! control messages lost or duplicated), and UD routes failing over between ports.

use std::sync::Arc;
use std::time::Duration;

use rankweave_core::frame::{Frame, Header};
use rankweave_core::{Arrival, Config, Source, Tag, Transport};

use super::adaptive::{AdaptiveSettings, AdaptiveTransport};
use super::connection_manager::{CmConfig, CmMessage};
use super::test_support::{frame, pattern};
use super::*;

fn settings(connect_after: Option<u64>) -> AdaptiveSettings {
    AdaptiveSettings {
        connect_after,
        cm: CmConfig {
            retransmit: Duration::from_millis(5),
            attempts: 6,
        },
        ..AdaptiveSettings::default()
    }
}

/// Whether a sent UD datagram is a connection message of `kind` (1 Request, 2 Reply,
/// 3 Confirm; lane fail-back: 4 LaneRequest, 5 LaneReply, 6 LaneConfirm): the carrier's kind byte `C` and the sender's rank, then the message's magic
/// and kind.
fn is_control(bytes: &[u8], kind: u8) -> bool {
    bytes.len() > 8 && bytes[0] == b'C' && &bytes[5..8] == b"CM1" && bytes[8] == kind
}

type Ranks = Vec<Arc<AdaptiveTransport<SimProvider>>>;

/// Drains every rank until `want[r]` frames came to rank `r`; fails after 10 s.
async fn pump(ranks: &Ranks, want: &[usize]) -> Vec<Vec<(u32, Frame)>> {
    let mut got: Vec<Vec<(u32, Frame)>> = vec![Vec::new(); ranks.len()];
    let mut out = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        for (r, t) in ranks.iter().enumerate() {
            t.drain(&mut out).unwrap();
            for a in out.drain(..) {
                match a {
                    Arrival::Frame { from, frame } => got[r].push((from, frame)),
                    Arrival::PeerLost { rank } => panic!("rank {r} lost rank {rank}"),
                }
            }
        }
        if got.iter().zip(want).all(|(g, &w)| g.len() >= w) {
            return got;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "frames arrived: {:?} of {want:?}",
            got.iter().map(Vec::len).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Drains every rank (keeping the frames) until `done` holds; fails after 10 s.
async fn pump_until(ranks: &Ranks, into: &mut [Vec<(u32, Frame)>], done: impl Fn(&Ranks) -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !done(ranks) {
        assert!(std::time::Instant::now() < deadline, "condition never held");
        for (r, got) in pump(ranks, &vec![0; ranks.len()])
            .await
            .into_iter()
            .enumerate()
        {
            into[r].extend(got);
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Checks that `got` holds frames 0..n from `from`, in order and intact (seed = from·10⁶ +
/// seq).
fn assert_in_order(got: &[(u32, Frame)], from: u32, n: usize, len: impl Fn(u64) -> usize) {
    let mine: Vec<&Frame> = got
        .iter()
        .filter(|(f, _)| *f == from)
        .map(|(_, fr)| fr)
        .collect();
    assert_eq!(mine.len(), n, "frames from rank {from}");
    for (i, f) in mine.iter().enumerate() {
        let Header::Eager(e) = f.header else {
            panic!("not an eager frame")
        };
        assert_eq!(e.seq, i as u64, "frame order from rank {from}");
        let seed = u64::from(from) * 1_000_000 + e.seq;
        assert_eq!(
            &f.payload[..],
            &pattern(seed, len(e.seq))[..],
            "frame {i} from {from}"
        );
    }
}

#[tokio::test]
async fn traffic_goes_over_ud_until_the_threshold_then_over_an_rc_connection() {
    let SimulatedTransports {
        fabric: _fabric,
        transports: ranks,
        ..
    } = simulated_adaptive_transports(2, 1, Duration::from_secs(10), settings(Some(10))).unwrap();
    let len = |seq: u64| (seq as usize * 53) % 3000;
    for seq in 0..10u64 {
        ranks[0]
            .send(1, frame(seq, pattern(seq, len(seq))))
            .unwrap();
    }
    let got = pump(&ranks, &[0, 10]).await;
    assert!(
        !ranks[0].is_over_rc(1),
        "10 frames do not pass the threshold"
    );
    assert_eq!(ranks[0].counters().cm.requests_sent, 0);
    assert_eq!(ranks[0].counters().frames_over_ud, 10);
    assert_in_order(&got[1], 0, 10, len);

    let mut all = got[1].clone();
    for seq in 10..400u64 {
        ranks[0]
            .send(1, frame(seq, pattern(seq, len(seq))))
            .unwrap();
        if seq % 20 == 0 {
            all.extend(pump(&ranks, &[0, 0]).await.swap_remove(1));
        }
    }
    let rest = 400 - all.len();
    all.extend(pump(&ranks, &[0, rest]).await.swap_remove(1));
    assert_in_order(&all, 0, 400, len);
    let c0 = ranks[0].counters();
    let c1 = ranks[1].counters();
    assert!(ranks[0].is_over_rc(1), "{c0:?}");
    assert_eq!((c0.cm.established, c1.cm.established), (1, 1));
    assert_eq!((c0.cm.requests_sent, c1.cm.replies_sent), (1, 1));
    assert!(c0.frames_over_ud > 10 && c0.frames_over_rc > 0, "{c0:?}");
    assert_eq!(c0.frames_over_ud + c0.frames_over_rc, 400);
    assert_eq!(
        ranks[0].rc().counters().channels.eager_sent,
        c0.frames_over_rc
    );
    // The responder moves to RC for its own traffic, without a request of its own.
    for seq in 0..5u64 {
        ranks[1]
            .send(0, frame(seq, pattern(1_000_000 + seq, 100)))
            .unwrap();
    }
    let back = pump(&ranks, &[5, 0]).await;
    assert_in_order(&back[0], 1, 5, |_| 100);
    assert!(ranks[1].is_over_rc(0));
    assert_eq!(ranks[1].counters().cm.requests_sent, 0);
}

#[tokio::test]
async fn simultaneous_requests_from_both_sides_make_one_connection() {
    let mut slow = settings(Some(3));
    slow.cm.retransmit = Duration::from_secs(2);
    let SimulatedTransports {
        fabric: _fabric,
        transports: ranks,
        ..
    } = simulated_adaptive_transports(2, 1, Duration::from_secs(10), slow).unwrap();
    // Both pass the threshold before either hears from the other.
    for seq in 0..50u64 {
        for (me, peer) in [(0u32, 1u32), (1, 0)] {
            let seed = u64::from(me) * 1_000_000 + seq;
            ranks[me as usize]
                .send(peer, frame(seq, pattern(seed, 200)))
                .unwrap();
        }
    }
    let mut got = pump(&ranks, &[50, 50]).await;
    pump_until(&ranks, &mut got, |r| {
        r[0].counters().cm.established + r[1].counters().cm.established == 2
    })
    .await;
    assert_in_order(&got[0], 1, 50, |_| 200);
    assert_in_order(&got[1], 0, 50, |_| 200);
    let (c0, c1) = (ranks[0].counters(), ranks[1].counters());
    assert_eq!(c0.cm.requests_sent + c1.cm.requests_sent, 2, "both asked");
    assert_eq!((c0.cm.ties_won, c1.cm.ties_lost), (1, 1), "{c0:?} {c1:?}");
    assert_eq!((c0.cm.replies_sent, c1.cm.replies_sent), (0, 1));
    assert_eq!((c0.cm.established, c1.cm.established), (1, 1));
    // Traffic after the switch uses the one connection in both directions.
    for seq in 50..60u64 {
        for (me, peer) in [(0u32, 1u32), (1, 0)] {
            let seed = u64::from(me) * 1_000_000 + seq;
            ranks[me as usize]
                .send(peer, frame(seq, pattern(seed, 200)))
                .unwrap();
        }
    }
    let more = pump(&ranks, &[10, 10]).await;
    assert!(ranks[0].is_over_rc(1) && ranks[1].is_over_rc(0));
    assert_eq!(more[0].len(), 10);
    assert!(ranks[0].rc().is_connected(1) && ranks[1].rc().is_connected(0));
}

#[tokio::test]
async fn lost_control_messages_are_retransmitted() {
    let SimulatedTransports {
        fabric,
        transports: ranks,
        ..
    } = simulated_adaptive_transports(2, 1, Duration::from_secs(10), settings(Some(2))).unwrap();
    for kind in 1..=3u8 {
        fabric.drop_datagrams_matching(2, move |b| is_control(b, kind));
    }
    for seq in 0..100u64 {
        ranks[0].send(1, frame(seq, pattern(seq, 64))).unwrap();
    }
    let mut all = pump(&ranks, &[0, 100]).await.swap_remove(1);
    assert_in_order(&all, 0, 100, |_| 64);
    // Wait for the connection (Confirm lost twice: the responder resends its Reply).
    for seq in 100..200u64 {
        ranks[0].send(1, frame(seq, pattern(seq, 64))).unwrap();
        tokio::time::sleep(Duration::from_millis(1)).await;
        all.extend(pump(&ranks, &[0, 0]).await.swap_remove(1));
    }
    let rest = 200 - all.len();
    all.extend(pump(&ranks, &[0, rest]).await.swap_remove(1));
    assert_in_order(&all, 0, 200, |_| 64);
    let (c0, c1) = (ranks[0].counters(), ranks[1].counters());
    assert!(ranks[0].is_over_rc(1), "{c0:?} {c1:?}");
    assert!(c0.cm.requests_sent >= 3, "two Requests lost: {c0:?}");
    assert!(c1.cm.replies_sent >= 3, "two Replies lost: {c1:?}");
    assert!(c0.cm.confirms_sent >= 3, "two Confirms lost: {c0:?}");
    assert_eq!((c0.cm.established, c1.cm.established), (1, 1));
    assert_eq!(fabric.counters().datagrams_dropped_fault, 6);
}

/// An exchange that runs out of sends while a frame too large for UD waits (the peer's
/// answers were late, say on a loaded machine) starts again: the frame was accepted, and is
/// delivered once a later exchange succeeds, instead of the peer being reported lost on this
/// side alone (the peer, alive, would wait for the frame for ever).
#[tokio::test]
async fn a_failed_exchange_with_a_large_frame_waiting_is_tried_again() {
    let SimulatedTransports {
        fabric,
        transports: ranks,
        ..
    } = simulated_adaptive_transports(2, 1, Duration::from_secs(10), settings(Some(8))).unwrap();
    let dropping = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let flag = dropping.clone();
    fabric.drop_datagrams_matching(u32::MAX, move |b| {
        flag.load(std::sync::atomic::Ordering::Relaxed) && is_control(b, 2)
    });
    let len = 16 * 1024;
    ranks[0].send(1, frame(0, pattern(0, len))).unwrap();
    let mut got = vec![Vec::new(), Vec::new()];
    pump_until(&ranks, &mut got, |r| r[0].counters().cm.failed > 0).await;
    dropping.store(false, std::sync::atomic::Ordering::Relaxed);
    let rest = 1 - got[1].len();
    got[1].extend(pump(&ranks, &[0, rest]).await.swap_remove(1));
    assert_in_order(&got[1], 0, 1, |_| len);
    let c0 = ranks[0].counters();
    assert!(c0.cm.failed >= 1 && c0.cm.established == 1, "{c0:?}");
    assert!(ranks[0].is_over_rc(1), "{c0:?}");
}

/// A large frame for a peer that closed first (a message it no longer needed) can never be
/// connected for: the peer answers no exchange, and UD never reports a peer that said BYE.
/// The closing rank drops it once its linger is up and drains, instead of trying forever.
#[tokio::test]
async fn a_large_frame_for_a_peer_that_closed_is_dropped_after_the_linger() {
    let mut s = settings(Some(8));
    s.rc.linger = Duration::from_millis(300);
    let SimulatedTransports {
        transports: ranks, ..
    } = simulated_adaptive_transports(2, 1, Duration::from_secs(10), s).unwrap();
    // Some UD traffic first, so that rank 1's link says BYE when it closes.
    ranks[0].send(1, frame(0, pattern(0, 100))).unwrap();
    assert_in_order(&pump(&ranks, &[0, 1]).await[1], 0, 1, |_| 100);
    ranks[1].close();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !ranks[1].is_drained() {
        assert!(std::time::Instant::now() < deadline, "rank 1 never drained");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // The exchange for this frame fails (6 Requests over 315 ms) and starts again, unanswered.
    ranks[0].send(1, frame(1, pattern(1, 16 * 1024))).unwrap();
    ranks[0].close();
    let closed = std::time::Instant::now();
    while !ranks[0].is_drained() {
        assert!(
            closed.elapsed() < Duration::from_secs(5),
            "rank 0 never drained: {:?}",
            ranks[0].counters()
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(closed.elapsed() >= Duration::from_millis(300), "the linger");
    let c0 = ranks[0].counters();
    assert_eq!(c0.dropped_on_close, 1, "{c0:?}");
    assert_eq!(c0.cm.established, 0, "{c0:?}");
}

/// The responder's queue pair is connected before its Reply leaves (and the requester's before
/// its Confirm): the peer that gets either may write at once. Checked where the fabric carries
/// each of them.
#[tokio::test]
async fn a_queue_pair_is_connected_before_the_message_that_lets_the_peer_write() {
    let SimulatedTransports {
        fabric,
        transports: ranks,
        ..
    } = simulated_adaptive_transports(2, 1, Duration::from_secs(10), settings(Some(2))).unwrap();
    let seen: Arc<std::sync::Mutex<Vec<(u8, bool)>>> = Arc::default();
    let (log, responder, requester) = (seen.clone(), ranks[1].clone(), ranks[0].clone());
    // A rule that never drops: it only looks (it runs for every datagram).
    fabric.drop_datagrams_matching(u32::MAX, move |b| {
        if is_control(b, 2) {
            log.lock()
                .unwrap()
                .push((2, responder.rc().is_connected(0)));
        }
        if is_control(b, 3) {
            log.lock()
                .unwrap()
                .push((3, requester.rc().is_connected(1)));
        }
        false
    });
    for seq in 0..6 {
        ranks[0].send(1, frame(seq, pattern(seq, 100))).unwrap();
    }
    let mut got = vec![Vec::new(), Vec::new()];
    pump_until(&ranks, &mut got, |r| {
        r[0].counters().cm.established > 0 && r[1].counters().cm.established > 0
    })
    .await;
    let rest = 6 - got[1].len();
    got[1].extend(pump(&ranks, &[0, rest]).await.swap_remove(1));
    assert_in_order(&got[1], 0, 6, |_| 100);
    let seen = seen.lock().unwrap().clone();
    assert!(
        seen.contains(&(2, true)) && seen.contains(&(3, true)),
        "{seen:?}"
    );
    assert!(seen.iter().all(|&(_, connected)| connected), "{seen:?}");
}

#[tokio::test]
async fn duplicated_control_messages_change_nothing() {
    let SimulatedTransports {
        fabric: _fabric,
        transports: ranks,
        ..
    } = simulated_adaptive_transports(2, 1, Duration::from_secs(10), settings(Some(1))).unwrap();
    for seq in 0..40u64 {
        ranks[0].send(1, frame(seq, pattern(seq, 64))).unwrap();
    }
    let mut all = pump(&ranks, &[0, 40]).await.swap_remove(1);
    let mut got = vec![Vec::new(), Vec::new()];
    pump_until(&ranks, &mut got, |r| {
        r[0].is_over_rc(1) || r[0].counters().cm.established > 0
    })
    .await;
    for seq in 40..60u64 {
        ranks[0].send(1, frame(seq, pattern(seq, 64))).unwrap();
    }
    pump_until(&ranks, &mut got, |r| r[0].is_over_rc(1)).await;
    all.extend(got.swap_remove(1));
    let rest = 60 - all.len();
    all.extend(pump(&ranks, &[0, rest]).await.swap_remove(1));
    // Replay every message of the exchange from the right sender, twice, with the queue pair
    // addresses of the real one.
    let qp0 = ranks[0].rc().open_peer(1).unwrap();
    let qp1 = ranks[1].rc().open_peer(0).unwrap();
    let replays = [
        (1usize, 0u32, CmMessage::Request { seq: 1, qp: qp1 }),
        (0, 1, CmMessage::Request { seq: 1, qp: qp0 }),
        (1, 0, CmMessage::Reply { seq: 1, qp: qp1 }),
        (0, 1, CmMessage::Confirm { seq: 1 }),
    ];
    for _ in 0..2 {
        for (from, to, m) in replays {
            let mut b = Vec::new();
            m.encode(&mut b);
            ranks[from].ud().carrier().send_control(to, &b).unwrap();
        }
    }
    for seq in 60..100u64 {
        ranks[0].send(1, frame(seq, pattern(seq, 64))).unwrap();
    }
    all.extend(pump(&ranks, &[0, 40]).await.swap_remove(1));
    assert_in_order(&all, 0, 100, |_| 64);
    let (c0, c1) = (ranks[0].counters(), ranks[1].counters());
    assert_eq!((c0.cm.established, c1.cm.established), (1, 1));
    assert!(c0.cm.duplicates + c1.cm.duplicates >= 4, "{c0:?} {c1:?}");
    assert_eq!(c0.connect_errors + c1.connect_errors, 0);
    assert!(ranks[0].is_over_rc(1) && ranks[0].rc().is_connected(1));
}

#[tokio::test]
async fn an_unanswered_exchange_leaves_traffic_on_ud() {
    let SimulatedTransports {
        fabric,
        transports: ranks,
        ..
    } = simulated_adaptive_transports(2, 1, Duration::from_secs(10), settings(Some(5))).unwrap();
    fabric.drop_datagrams_matching(u32::MAX, |b| b.first() == Some(&b'C'));
    let mut all = Vec::new();
    for seq in 0..300u64 {
        ranks[0].send(1, frame(seq, pattern(seq, 500))).unwrap();
        if seq % 10 == 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
            all.extend(pump(&ranks, &[0, 0]).await.swap_remove(1));
        }
    }
    let mut got = vec![Vec::new(), Vec::new()];
    pump_until(&ranks, &mut got, |r| r[0].counters().cm.failed > 0).await;
    all.extend(got.swap_remove(1));
    let rest = 300 - all.len();
    all.extend(pump(&ranks, &[0, rest]).await.swap_remove(1));
    assert_in_order(&all, 0, 300, |_| 500);
    let c0 = ranks[0].counters();
    assert!(!ranks[0].is_over_rc(1));
    assert!(c0.cm.failed >= 1, "{c0:?}");
    assert_eq!(c0.frames_over_ud, 300);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn communicators_over_adaptive_connections_move_every_size() {
    let config = Config {
        peer_timeout: Duration::from_secs(20),
        ..Config::default()
    };
    let job = simulated_adaptive_world(3, 1, &config, settings(Some(8))).unwrap();
    let sizes = [0usize, 1, 100, 3000, 8 * 1024, 64 * 1024, 1 << 20, 9 << 20];
    let mut tasks = tokio::task::JoinSet::new();
    for comm in job.comms {
        tasks.spawn(async move {
            let me = comm.rank();
            let n = comm.size();
            let next = (me + 1) % n;
            let prev = (me + n - 1) % n;
            for round in 0..3 {
                for (i, &len) in sizes.iter().enumerate() {
                    let tag = (round * 100 + i) as u32;
                    let seed = (me * 1000 + tag as usize) as u64;
                    let send = comm.send(next, tag, pattern(seed, len));
                    let msg = comm
                        .recv(Source::Rank(prev), Tag::Value(tag))
                        .await
                        .unwrap();
                    send.await.unwrap();
                    let want = pattern((prev * 1000 + tag as usize) as u64, len);
                    assert_eq!(msg.data(), &want[..]);
                }
            }
            comm.shutdown().await;
        });
    }
    let all = async {
        while let Some(r) = tasks.join_next().await {
            r.unwrap();
        }
    };
    if tokio::time::timeout(Duration::from_secs(60), all)
        .await
        .is_err()
    {
        panic!("hung; the transports:\n{}", describe(&job.transports));
    }
    for t in &job.transports {
        let c = t.counters();
        assert!(c.frames_over_ud > 0 && c.frames_over_rc > 0, "{c:?}");
        assert!(t.rc().counters().channels.rendezvous_sent > 0 || c.cm.established > 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_port_moves_ud_traffic_to_the_other_route() {
    let config = Config {
        peer_timeout: Duration::from_secs(30),
        ..Config::default()
    };
    let job = simulated_adaptive_world(2, 2, &config, settings(None)).unwrap();
    let fabric = job.fabric.clone();
    let victim = job.ports[1][0].port().lid;
    let mut comms = job.comms.into_iter();
    let (a, b) = (comms.next().unwrap(), comms.next().unwrap());
    let len = 6 << 20;
    let sender = tokio::spawn(async move {
        for i in 0..4u32 {
            a.send(1, i, pattern(u64::from(i), len)).await.unwrap();
        }
        a.recv(Source::Rank(1), Tag::Value(99)).await.unwrap();
        a.shutdown().await;
    });
    let receiver = tokio::spawn(async move {
        for i in 0..4u32 {
            let m = b.recv(Source::Rank(0), Tag::Value(i)).await.unwrap();
            assert_eq!(m.data(), &pattern(u64::from(i), len)[..], "message {i}");
            if i == 0 {
                // Mid-transfer: rank 1's first port goes down.
                fabric.fail_port(victim);
            }
        }
        b.send(0, 99, Vec::<u8>::new()).await.unwrap();
        b.shutdown().await;
    });
    tokio::time::timeout(Duration::from_secs(60), async {
        sender.await.unwrap();
        receiver.await.unwrap();
    })
    .await
    .expect("the transfer completed over the other port");
    let stats = job.transports[0].stats();
    assert!(stats.route_failovers >= 1, "{stats:?}");
    assert_eq!(stats.routes.len(), 2);
    assert!(
        stats.routes[1].frames_sent > stats.routes[0].frames_sent,
        "{stats:?}"
    );
    assert_eq!(job.transports[0].counters().frames_over_rc, 0);
}

/// Both ranks RC-connected over two ports (one lane each) exchange a stream of eager
/// messages around large ones (striped across the lanes); mid-way, rank 1's first port goes
/// down. Every message arrives intact and in order over the other lane; both sides saw the
/// lane fail and kept the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_port_moves_rc_traffic_to_the_other_lane() {
    let config = Config {
        peer_timeout: Duration::from_secs(30),
        ..Config::default()
    };
    let job = simulated_adaptive_world(2, 2, &config, settings(Some(2))).unwrap();
    let fabric = job.fabric.clone();
    let victim = job.ports[1][0].port().lid;
    let count = 60u32;
    let big = |i: u32| i % 20 == 15;
    let len = move |i: u32| {
        if big(i) {
            12 << 20
        } else {
            (i as usize * 97) % 5000
        }
    };
    let mut tasks = tokio::task::JoinSet::new();
    for (comm, transport) in job.comms.into_iter().zip(job.transports.clone()) {
        let fabric = fabric.clone();
        tasks.spawn(async move {
            let me = comm.rank();
            let other = 1 - me;
            let sends: Vec<_> = (0..count)
                .map(|i| comm.send(other, i, pattern(u64::from(i) + 1000 * me as u64, len(i))))
                .collect();
            for i in 0..count {
                let m = comm.recv(Source::Rank(other), Tag::Value(i)).await.unwrap();
                assert_eq!(
                    m.data(),
                    &pattern(u64::from(i) + 1000 * other as u64, len(i))[..],
                    "message {i} to rank {me}"
                );
                if me == 1 && i == 20 {
                    // Rank 1's own large frame 15 may still be waiting for UD to be
                    // acknowledged (a slow machine): fail the lane once it went out striped.
                    while transport.rc().counters().stream.frames_striped == 0 {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                    fabric.fail_port(victim);
                }
            }
            for s in sends {
                s.await.unwrap();
            }
            // Both sides are done before either closes.
            let done = comm.send(other, 999, Vec::<u8>::new());
            comm.recv(Source::Rank(other), Tag::Value(999))
                .await
                .unwrap();
            done.await.unwrap();
            comm.shutdown().await;
        });
    }
    tokio::time::timeout(Duration::from_secs(120), async {
        while let Some(r) = tasks.join_next().await {
            r.unwrap();
        }
    })
    .await
    .expect("the transfer completed over the other lane");
    for (me, t) in job.transports.iter().enumerate() {
        let other = 1 - me as u32;
        assert!(t.is_over_rc(other), "rank {me} is on RC");
        let rc = t.rc().counters();
        assert!(rc.stream.frames_striped >= 1, "rank {me}: {rc:?}");
        assert!(rc.stream.bytes_per_lane[1] > 0, "rank {me}: {rc:?}");
        assert_eq!(rc.stream.lane_failures, 1, "rank {me}: {rc:?}");
        assert!(
            !t.rc().lane_up(other, 0),
            "rank {me} still uses the failed lane"
        );
        assert!(t.rc().lane_up(other, 1), "rank {me} lost the other lane");
    }
}

/// Each rank's counters and UD links, for the message of a test that timed out.
fn describe(transports: &[Arc<AdaptiveTransport<SimProvider>>]) -> String {
    let mut out = String::new();
    for (rank, t) in transports.iter().enumerate() {
        out.push_str(&format!(
            "rank {rank}: {:?}\n  rc {:?}\n{}",
            t.counters(),
            t.rc().counters(),
            t.ud().describe_links()
        ));
    }
    out
}

/// Drains every rank for `ms` milliseconds (completions and Fins are taken in).
async fn settle(ranks: &Ranks, ms: u64) {
    let until = std::time::Instant::now() + Duration::from_millis(ms);
    let mut out = Vec::new();
    while std::time::Instant::now() < until {
        for t in ranks {
            t.drain(&mut out).unwrap();
        }
        assert!(out.is_empty());
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Two ranks with two ports each, RC-connected (both lanes live), idle registration caches
/// (every released payload registration is deregistered at once, so registration counts
/// are exact).
async fn connected_pair() -> (SimulatedTransports, Ranks) {
    let mut s = settings(Some(2));
    s.rc.mr_cache_bytes = 0;
    let job = simulated_adaptive_transports(2, 2, Duration::from_secs(30), s).unwrap();
    let ranks: Ranks = job.transports.clone();
    for seq in 0..4 {
        ranks[0].send(1, frame(seq, pattern(seq, 100))).unwrap();
        ranks[1].send(0, frame(seq, pattern(seq, 100))).unwrap();
    }
    pump(&ranks, &[4, 4]).await;
    wait_until(&ranks, |r| r[0].is_over_rc(1) && r[1].is_over_rc(0)).await;
    (job, ranks)
}

/// Drains every rank until `done` holds; fails after 10 s. Frames must not arrive.
async fn wait_until(ranks: &Ranks, done: impl Fn(&Ranks) -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut out = Vec::new();
    while !done(ranks) {
        for (r, t) in ranks.iter().enumerate() {
            t.drain(&mut out).unwrap();
            assert!(out.is_empty(), "rank {r} got {} arrivals", out.len());
        }
        assert!(
            std::time::Instant::now() < deadline,
            "condition not reached"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Sends `frames` large frames (`len` bytes, seeds from `seed`) each way, then pumps until
/// they are all in and checks them byte for byte.
async fn exchange_large(ranks: &Ranks, seed: u64, frames: u64, len: usize) {
    for i in 0..frames {
        for (me, t) in ranks.iter().enumerate() {
            let s = seed + i + 1000 * me as u64;
            t.send(1 - me as u32, frame(s, pattern(s, len))).unwrap();
        }
    }
    let want = frames as usize;
    let got = pump(ranks, &[want, want]).await;
    for (me, frames) in got.iter().enumerate() {
        let other = 1 - me as u64;
        for (i, (from, f)) in frames.iter().enumerate() {
            let s = seed + i as u64 + 1000 * other;
            assert_eq!(u64::from(*from), other);
            assert!(f.payload == pattern(s, len), "rank {me}: frame {i} damaged");
        }
    }
}

fn lanes_up(ranks: &Ranks, lane: usize) -> bool {
    ranks[0].rc().lane_up(1, lane) && ranks[1].rc().lane_up(0, lane)
}

/// Waits until every rank's port registrations are back at `counts` (released payloads are
/// deregistered once the peer's Fin or the write's completion is taken in).
async fn wait_for_registrations(ranks: &Ranks, fabric: &SimFabric, lids: &[u16], counts: &[usize]) {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let now: Vec<usize> = lids.iter().map(|&l| fabric.registered_regions(l)).collect();
        if now == counts {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "registrations per port {now:?}, steady {counts:?}"
        );
        let mut out = Vec::new();
        for t in ranks {
            t.drain(&mut out).unwrap();
        }
        assert!(out.is_empty());
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Rank 1's first port fails while a 32 MiB frame from rank 0 is under way: it arrives over
/// the other lane. The port comes back: rank 1 (whose port it was) re-establishes lane 0
/// with rank 0 over UD (rank 0's own port never failed), and later 24 MiB frames in both
/// directions are striped over both lanes again (per-lane byte counters of both lanes grow,
/// the restored port moves RDMA bytes), intact; every port's registrations return to their
/// steady count (the old lane's queue pair and buffers are gone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_port_brings_its_rc_lane_back_and_striping_resumes() {
    let (job, ranks) = connected_pair().await;
    let fabric = job.fabric.clone();
    let lids: Vec<u16> = job.ports.iter().flatten().map(|p| p.port().lid).collect();
    let victim = job.ports[1][0].port().lid;
    exchange_large(&ranks, 10, 1, 16 << 20).await;
    settle(&ranks, 50).await;
    let steady: Vec<usize> = lids.iter().map(|&l| fabric.registered_regions(l)).collect();

    let len = 32 << 20;
    ranks[0].send(1, frame(77, pattern(77, len))).unwrap();
    fabric.fail_port(victim);
    let got = pump(&ranks, &[0, 1]).await;
    assert!(
        got[1][0].1.payload == pattern(77, len),
        "the 32 MiB frame is intact"
    );
    wait_until(&ranks, |r| {
        !r[0].rc().lane_up(1, 0) && !r[1].rc().lane_up(0, 0)
    })
    .await;
    assert!(lanes_up(&ranks, 1));

    fabric.restore_port(victim);
    wait_until(&ranks, |r| lanes_up(r, 0) && lanes_up(r, 1)).await;
    let before: Vec<_> = ranks.iter().map(|t| t.rc().counters().stream).collect();
    let port_bytes = fabric.port_rdma_bytes(victim);
    exchange_large(&ranks, 100, 3, 24 << 20).await;
    for (me, t) in ranks.iter().enumerate() {
        let after = t.rc().counters();
        for lane in 0..2 {
            assert!(
                after.stream.bytes_per_lane[lane] >= before[me].bytes_per_lane[lane] + (24 << 20),
                "rank {me} lane {lane}: {:?} -> {:?}",
                before[me].bytes_per_lane,
                after.stream.bytes_per_lane
            );
        }
        assert_eq!(after.stream.lane_failures, 1, "rank {me}");
        assert_eq!(after.stream.lane_restorations, 1, "rank {me}");
        assert_eq!(after.lanes_reopened, 1, "rank {me}");
    }
    assert!(
        fabric.port_rdma_bytes(victim) > port_bytes,
        "the restored port moves data"
    );
    let c = (ranks[0].counters().lanes, ranks[1].counters().lanes);
    assert!(
        c.1.requests_sent >= 1 && c.0.replies_sent >= 1,
        "rank 1 asked: {c:?}"
    );
    assert_eq!(
        c.0.requests_sent, 0,
        "rank 0's port never failed: it only answers"
    );
    assert_eq!((c.0.established, c.1.established), (1, 1));
    wait_for_registrations(&ranks, &fabric, &lids, &steady).await;
}

/// The lane exchange's messages are lost (two LaneRequests, the first LaneReply and the
/// first LaneConfirm): retransmission still brings the lane back, and frames keep arriving
/// intact and in order meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_lane_messages_are_retransmitted_and_the_lane_still_comes_back() {
    let (job, ranks) = connected_pair().await;
    let fabric = job.fabric.clone();
    let victim = job.ports[0][1].port().lid;
    fabric.fail_port(victim);
    exchange_large(&ranks, 10, 2, 6 << 20).await;
    fabric.drop_datagrams_matching(2, |b| is_control(b, 4));
    fabric.drop_datagrams_matching(1, |b| is_control(b, 5));
    fabric.drop_datagrams_matching(1, |b| is_control(b, 6));
    fabric.restore_port(victim);
    wait_until(&ranks, |r| lanes_up(r, 0) && lanes_up(r, 1)).await;
    let c = (ranks[0].counters().lanes, ranks[1].counters().lanes);
    assert!(c.0.requests_sent >= 3, "rank 0 asked again: {c:?}");
    assert!(c.1.replies_sent >= 2, "rank 1 answered again: {c:?}");
    assert!(c.0.retransmissions + c.1.retransmissions >= 2, "{c:?}");
    assert_eq!((c.0.established, c.1.established), (1, 1), "{c:?}");
    exchange_large(&ranks, 50, 2, 6 << 20).await;
    let rc = ranks[0].rc().counters();
    assert_eq!(rc.lanes_reopened, 1, "{rc:?}");
}

/// A port flaps (down, up, down) while frames flow, on rank 1 during rank 0's sends, then
/// comes back: every frame arrives intact and in order, and in the end both lanes are up.
/// Then both ranks' second ports fail, come back at different times (rank 1's first),
/// and the lane returns once more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flapping_port_never_breaks_delivery_and_the_lane_returns() {
    let (job, ranks) = connected_pair().await;
    let fabric = job.fabric.clone();
    let victim = job.ports[1][0].port().lid;
    let mut seed = 1000;
    for step in 0..6 {
        match step {
            0 | 2 | 4 => fabric.fail_port(victim),
            _ => fabric.restore_port(victim),
        }
        // Some frames each way while the port is in this state (the exchange may be under
        // way, or its queue pairs fail again).
        exchange_large(&ranks, seed, 2, 3 << 20).await;
        for s in 0..20u64 {
            ranks[0]
                .send(1, frame(seed + s, pattern(seed + s, 300)))
                .unwrap();
        }
        let got = pump(&ranks, &[0, 20]).await;
        for (i, (_, f)) in got[1].iter().enumerate() {
            assert!(
                f.payload == pattern(seed + i as u64, 300),
                "step {step}: frame {i}"
            );
        }
        seed += 100;
    }
    fabric.restore_port(victim);
    wait_until(&ranks, |r| lanes_up(r, 0) && lanes_up(r, 1)).await;
    exchange_large(&ranks, seed, 2, 8 << 20).await;

    let (a, b) = (job.ports[0][1].port().lid, job.ports[1][1].port().lid);
    fabric.fail_port(a);
    fabric.fail_port(b);
    exchange_large(&ranks, seed + 100, 1, 4 << 20).await;
    fabric.restore_port(b);
    exchange_large(&ranks, seed + 200, 1, 4 << 20).await;
    fabric.restore_port(a);
    wait_until(&ranks, |r| lanes_up(r, 0) && lanes_up(r, 1)).await;
    let before = ranks[0].rc().counters().stream.bytes_per_lane;
    exchange_large(&ranks, seed + 300, 2, 8 << 20).await;
    let after = ranks[0].rc().counters().stream.bytes_per_lane;
    assert!(
        after[0] > before[0] && after[1] > before[1],
        "{before:?} -> {after:?}"
    );
}
