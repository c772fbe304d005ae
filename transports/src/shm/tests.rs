use std::time::{Duration, Instant};

use bytes::Bytes;
use rankweave_core::ContextId;
use rankweave_core::frame::{Envelope, Header};

use super::*;

/// Settings where, with `single_copy`, every frame beyond the inline limit goes by single copy
/// (no pipeline limit).
fn settings(ring_bytes: usize, single_copy: bool) -> ShmConfig {
    ShmConfig {
        ring_bytes,
        inline_max: 16 * 1024,
        pipeline_max: 0,
        single_copy,
        ..ShmConfig::default()
    }
}

/// `n` transports of one job in this process.
fn job(n: u32, s: ShmConfig) -> Vec<ShmTransport> {
    let dir = Arc::new(LocalSegments::default());
    (0..n)
        .map(|r| {
            let t = ShmTransport::new(r, n, s, Duration::from_secs(1), dir.clone()).unwrap();
            dir.publish(r, t.address());
            t
        })
        .collect()
}

fn eager(seq: u64, payload: Vec<u8>) -> Frame {
    crate::test_frames::eager_frame(2, 9, seq, payload)
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64).wrapping_mul(31).wrapping_add(seed) as u8)
        .collect()
}

/// Drains `t` (and lets `others` flush and answer) until `n` arrivals came or 10 s passed.
fn collect(t: &ShmTransport, others: &[&ShmTransport], n: usize) -> Vec<Arrival> {
    let mut out = Vec::new();
    let until = Instant::now() + Duration::from_secs(10);
    while out.len() < n && Instant::now() < until {
        t.drain(&mut out).unwrap();
        for o in others {
            let mut ignored = Vec::new();
            o.drain(&mut ignored).unwrap();
            assert!(ignored.is_empty(), "unexpected arrivals at a sender");
        }
    }
    out
}

fn payloads(arrivals: Vec<Arrival>, from: u32) -> Vec<(u64, Bytes)> {
    arrivals
        .into_iter()
        .map(|a| match a {
            Arrival::Frame { from: f, frame } => {
                assert_eq!(f, from);
                let Header::Eager(env) = frame.header else {
                    panic!("not the frame sent: {:?}", frame.header)
                };
                assert_eq!(env.len as usize, frame.payload.len());
                (env.seq, frame.payload)
            }
            other => panic!("unexpected {other:?}"),
        })
        .collect()
}

/// Rank 0 sends one frame of each size to rank 1, which must get them whole and in order.
fn send_and_check(t: &[ShmTransport], sizes: &[usize]) {
    for (i, &len) in sizes.iter().enumerate() {
        t[0].send(1, eager(i as u64, pattern(len, i as u64)))
            .unwrap();
    }
    let got = payloads(collect(&t[1], &[&t[0]], sizes.len()), 0);
    assert_eq!(got.len(), sizes.len());
    for (i, (seq, p)) in got.iter().enumerate() {
        assert_eq!(*seq, i as u64, "order kept");
        assert_eq!(
            &p[..],
            &pattern(sizes[i], i as u64)[..],
            "content of {} bytes",
            sizes[i]
        );
    }
}

/// With the default settings, a 32 KiB payload and a byte of framing go inline, as one record
/// (the ring's headroom past a quarter of its capacity); a few hundred bytes more do not.
#[tokio::test]
async fn a_32_kib_payload_with_its_framing_goes_inline() {
    let t = job(2, ShmConfig::default());
    t[0].send(1, eager(0, pattern(32 * 1024 + 1, 0))).unwrap();
    let got = payloads(collect(&t[1], &[&t[0]], 1), 0);
    assert_eq!(got, vec![(0, Bytes::from(pattern(32 * 1024 + 1, 0)))]);
    let c = t[0].counters();
    assert_eq!(
        (c.frames_sent, c.single_copy_sent, c.pipelined_sent),
        (1, 0, 0)
    );
    t[0].send(1, eager(1, pattern(32 * 1024 + 300, 1))).unwrap();
    assert_eq!(collect(&t[1], &[&t[0]], 1).len(), 1);
    assert_eq!(t[0].counters().pipelined_sent, 1);
}

/// A payload short enough to go inline goes by single copy to a receiver that has read what
/// came before (and is asked for by `reads_in_place`, so the driver hands it over as a frame);
/// to one that lags, while a payload is held, when too short, or with the setting off, it goes
/// inline. Every byte arrives, in order, either way.
#[tokio::test]
async fn a_medium_payload_goes_by_single_copy_only_to_a_receiver_that_keeps_up() {
    let medium = 20 * 1024;
    let t = job(2, ShmConfig::default());
    let sent = |t: &ShmTransport| {
        let c = t.counters();
        (c.single_copy_sent, c.frames_sent)
    };
    // Before the receiver says it can read this rank's memory: inline.
    assert!(!t[0].reads_in_place(1, medium));
    t[0].send(1, eager(0, pattern(medium, 0))).unwrap();
    assert_eq!(payloads(collect(&t[1], &[&t[0]], 1), 0).len(), 1);
    assert_eq!(sent(&t[0]), (0, 1));
    // The first read (of an inline frame) made the receiver say so; nothing unread now.
    assert!(t[0].reads_in_place(1, medium));
    assert!(
        !t[0].reads_in_place(1, 16 * 1024 - 1),
        "shorter than the setting"
    );
    assert!(!t[0].reads_in_place(0, medium), "to itself");
    // A short record just ahead (a collective's header) still counts as keeping up.
    t[0].send(1, eager(1, pattern(40, 1))).unwrap();
    assert!(t[0].reads_in_place(1, medium));
    // A burst: the first goes in place, the next two inline (one is held, and the receiver
    // has 20 KiB unread), as does a medium payload behind an unread medium record.
    for seq in 2..5 {
        t[0].send(1, eager(seq, pattern(medium, seq))).unwrap();
    }
    assert_eq!(sent(&t[0]), (1, 5));
    assert!(!t[0].reads_in_place(1, medium));
    let got = payloads(collect(&t[1], &[&t[0]], 4), 0);
    let want: Vec<(u64, Bytes)> = std::iter::once((1, Bytes::from(pattern(40, 1))))
        .chain((2..5).map(|s| (s, Bytes::from(pattern(medium, s)))))
        .collect();
    assert_eq!(got, want);
    // Read and acknowledged: in place again.
    let until = Instant::now() + Duration::from_secs(5);
    while !t[0].reads_in_place(1, medium) && Instant::now() < until {
        t[0].drain(&mut Vec::new()).unwrap();
    }
    assert!(t[0].reads_in_place(1, medium));
    // With the setting off, never.
    let off = job(
        2,
        ShmConfig {
            idle_single_copy: 0,
            ..ShmConfig::default()
        },
    );
    off[0].send(1, eager(0, pattern(10, 0))).unwrap();
    assert_eq!(collect(&off[1], &[&off[0]], 1).len(), 1);
    assert!(!off[0].reads_in_place(1, medium));
    off[0].send(1, eager(1, pattern(medium, 1))).unwrap();
    let got = payloads(collect(&off[1], &[&off[0]], 1), 0);
    assert_eq!(got, vec![(1, Bytes::from(pattern(medium, 1)))]);
    assert_eq!(sent(&off[0]), (0, 2));
}

fn round_trip_sizes(single_copy: bool) {
    let t = job(2, settings(128 * 1024, single_copy));
    // Until the receiver has mapped the sender (on its first read), it has not said whether it
    // can read the sender's memory, and large frames go in pieces.
    t[0].send(1, eager(99, pattern(100_000, 0))).unwrap();
    assert_eq!(collect(&t[1], &[&t[0]], 1).len(), 1);
    assert_eq!(t[0].counters().pipelined_sent, 1);
    let sizes = [
        0usize,
        1,
        100,
        16 * 1024 - 38,
        16 * 1024,
        70_000,
        1 << 20,
        5 << 20,
    ];
    send_and_check(&t, &sizes);
    let c = t[0].counters();
    assert_eq!(c.frames_sent, sizes.len() as u64 + 1);
    if single_copy {
        assert_eq!(
            c.single_copy_sent, 4,
            "16 KiB, 70 000 B, 1 MiB and 5 MiB by single copy"
        );
        assert_eq!(c.pipelined_sent, 1);
    } else {
        assert_eq!((c.single_copy_sent, c.pipelined_sent), (0, 5));
    }
    // Every single-copy payload was acknowledged: nothing held.
    let until = Instant::now() + Duration::from_secs(5);
    while !t[0].peer(1).unwrap().out.lock().is_idle() && Instant::now() < until {
        let mut v = Vec::new();
        t[0].drain(&mut v).unwrap();
        t[1].drain(&mut v).unwrap();
    }
    assert!(t[0].peer(1).unwrap().out.lock().is_idle());
}

/// A drain reads at most one single-copy payload (the next is read when asked for: see
/// `Inbound::read`), while the inline frames before it all come.
#[tokio::test]
async fn a_drain_stops_after_one_single_copy_read() {
    let t = job(2, settings(128 * 1024, true));
    // The first large frame goes in pieces while the receiver has not said it can read.
    t[0].send(1, eager(0, pattern(100_000, 0))).unwrap();
    assert_eq!(collect(&t[1], &[&t[0]], 1).len(), 1);
    t[0].send(1, eager(1, pattern(10, 1))).unwrap();
    t[0].send(1, eager(2, pattern(10, 2))).unwrap();
    // Too long to be lent to the sender (see the next test).
    t[0].send(1, eager(3, pattern(200_000, 3))).unwrap();
    t[0].send(1, eager(4, pattern(200_000, 4))).unwrap();
    t[0].send(1, eager(5, pattern(10, 5))).unwrap();
    assert_eq!(t[0].counters().single_copy_sent, 2);
    let mut out = Vec::new();
    t[1].drain(&mut out).unwrap();
    let seqs =
        |out: Vec<Arrival>| -> Vec<u64> { payloads(out, 0).into_iter().map(|(s, _)| s).collect() };
    assert_eq!(
        seqs(std::mem::take(&mut out)),
        [1, 2, 3],
        "up to the first single copy"
    );
    t[1].drain(&mut out).unwrap();
    assert_eq!(seqs(std::mem::take(&mut out)), [4]);
    t[1].drain(&mut out).unwrap();
    let got = payloads(out, 0);
    assert_eq!(got.len(), 1);
    assert_eq!((got[0].0, &got[0].1[..]), (5, &pattern(10, 5)[..]));
}

/// Two medium single-copy payloads in a row are read in one drain: the first is lent whole to
/// the sender to write while the receiver reads the second, and arrives first. A sender that
/// never looks (no progress runs on it here) leaves the lent one to the receiver, which
/// reads it after the second. A medium payload before anything else, or last, is read by
/// itself.
#[tokio::test]
async fn two_medium_payloads_in_a_row_are_read_in_one_drain_the_first_lent() {
    let t = job(2, settings(128 * 1024, true));
    connect_both_ways(&t);
    let len = 70_000;
    for seq in 1..=3 {
        t[0].send(1, eager(seq, pattern(len, seq))).unwrap();
    }
    t[0].send(1, eager(4, pattern(10, 4))).unwrap();
    t[0].send(1, eager(5, pattern(len, 5))).unwrap();
    let mut out = Vec::new();
    let mut drains = Vec::new();
    while drains.iter().map(Vec::len).sum::<usize>() < 5 {
        t[1].drain(&mut out).unwrap();
        let got = payloads(std::mem::take(&mut out), 0);
        for (seq, p) in &got {
            let n = if *seq == 4 { 10 } else { len };
            assert!(p[..] == pattern(n, *seq)[..], "content of {seq}");
        }
        drains.push(got.into_iter().map(|(s, _)| s).collect::<Vec<_>>());
        assert!(drains.len() <= 4, "{drains:?}");
    }
    assert_eq!(drains, [vec![1, 2], vec![3], vec![4, 5]]);
    assert_eq!(t[1].counters().payloads_lent, 1);
    assert_eq!(
        t[0].counters().split_bytes_written,
        0,
        "the sender never ran"
    );
}

/// Connects `t[0]` and `t[1]` both ways: each then knows the other may write its memory.
fn connect_both_ways(t: &[ShmTransport]) {
    t[1].send(0, eager(0, vec![1])).unwrap();
    assert_eq!(collect(&t[0], &[], 1).len(), 1);
    t[0].send(1, eager(0, vec![1])).unwrap();
    assert_eq!(collect(&t[1], &[], 1).len(), 1);
}

/// A window of medium payloads, with the sender's progress running: the sender writes some
/// of them (lent whole, or shares), and all arrive whole and in order.
#[tokio::test]
async fn a_sender_writes_medium_payloads_lent_to_it() {
    let t = job(2, settings(1 << 20, true));
    connect_both_ways(&t);
    rounds_until_the_sender_writes(&t, 16, 64 * 1024);
    assert!(t[1].counters().payloads_lent > 0);
}

#[tokio::test]
async fn frames_of_every_size_arrive_whole_and_in_order_with_single_copy() {
    round_trip_sizes(true);
}

#[tokio::test]
async fn frames_of_every_size_arrive_whole_and_in_order_pipelined() {
    round_trip_sizes(false);
}

#[tokio::test]
async fn payloads_up_to_the_pipeline_limit_go_in_pieces_longer_ones_by_single_copy() {
    let limit = 200_000;
    let t = job(
        2,
        ShmConfig {
            pipeline_max: limit,
            adaptive: false,
            ..settings(128 * 1024, true)
        },
    );
    // Connect: the receiver maps the sender and says it can read its memory.
    t[0].send(1, eager(99, vec![])).unwrap();
    assert_eq!(collect(&t[1], &[&t[0]], 1).len(), 1);
    let sizes = [70_000, limit, limit + 1, 1 << 20];
    send_and_check(&t, &sizes);
    let c = t[0].counters();
    assert_eq!(
        (c.pipelined_sent, c.single_copy_sent),
        (2, 2),
        "70 000 B and the limit itself in pieces, beyond it by single copy"
    );
}

/// Below the pipeline limit the chooser tries both paths, then keeps to the faster and now and
/// then tries the other: sent one at a time (each alone, so each is timed), messages go both
/// ways, arrive whole and in order, every timing ends and every single-copy payload is let go
/// (nothing left to observe), though the receiver writes nothing back into the ring.
#[tokio::test]
async fn adaptive_sends_take_both_paths_and_time_each_to_its_end() {
    let t = job(
        2,
        ShmConfig {
            pipeline_max: 64 << 20,
            adaptive: true,
            ..settings(128 * 1024, true)
        },
    );
    t[0].send(1, eager(0, vec![])).unwrap();
    assert_eq!(collect(&t[1], &[&t[0]], 1).len(), 1);
    let n = 2 + 2 * super::copy_path::EXPLORE_EVERY as u64;
    for i in 1..=n {
        let len = 100_000 + i as usize;
        t[0].send(1, eager(i, pattern(len, i))).unwrap();
        let got = payloads(collect(&t[1], &[&t[0]], 1), 0);
        assert_eq!(got.len(), 1, "message {i} arrived");
        assert_eq!((got[0].0, &got[0].1[..]), (i, &pattern(len, i)[..]));
        // The sender sees the receiver was done (its count of payloads read, or the ring's
        // tail) on a drain.
        let until = Instant::now() + Duration::from_secs(5);
        while t[0].peer(1).unwrap().out.lock().is_watching() && Instant::now() < until {
            let mut v = Vec::new();
            t[1].drain(&mut v).unwrap();
            t[0].drain(&mut v).unwrap();
        }
        assert!(
            !t[0].peer(1).unwrap().out.lock().is_watching(),
            "timing {i} ended, payload let go"
        );
    }
    assert_eq!(t[0].rank.watching_peers.load(Ordering::Acquire), 0);
    let c = t[0].counters();
    assert_eq!(c.single_copy_sent + c.pipelined_sent, n);
    assert!(
        c.single_copy_sent >= 2 && c.pipelined_sent >= 2,
        "both paths taken, each at least once as the slower one: {c:?}"
    );
}

#[tokio::test]
async fn large_payloads_are_read_in_bounded_batches_and_acknowledged_without_a_signal() {
    let t = job(2, settings(128 * 1024, true));
    // Connect (the first large frame goes in pieces, until the receiver has said it can read).
    t[0].send(1, eager(99, vec![])).unwrap();
    assert_eq!(collect(&t[1], &[&t[0]], 1).len(), 1);
    let len = 300_000;
    for i in 0..3u64 {
        t[0].send(1, eager(i, pattern(len, i))).unwrap();
    }
    assert_eq!(t[0].counters().single_copy_sent, 3);
    // Nothing came for rank 0, but a busy poller there drains (and so observes the receiver)
    // on every turn while it holds payloads.
    assert!(t[0].may_have_arrivals());
    // Rank 0 parks: its doorbell is armed, so anything that must wake it signals.
    t[0].rank.own.doorbell().arm();
    let signals = t[1].counters().signals_sent;
    // Each payload is over the batch bound: one read per drain, the rest still reported.
    let mut got = Vec::new();
    for i in 0..3u64 {
        assert!(t[1].may_have_arrivals(), "payload {i} is still waiting");
        let mut out = Vec::new();
        assert_eq!(t[1].drain(&mut out).unwrap(), 1, "one payload per drain");
        got.extend(payloads(out, 0));
    }
    let mut out = Vec::new();
    assert_eq!(t[1].drain(&mut out).unwrap(), 0);
    for (i, (seq, p)) in got.iter().enumerate() {
        assert_eq!(*seq, i as u64);
        assert_eq!(&p[..], &pattern(len, i as u64)[..]);
    }
    assert_eq!(
        t[1].counters().signals_sent,
        signals,
        "acknowledging the three reads did not ring the parked sender's doorbell"
    );
    // The count of reads is there all the same: the sender's next drain lets the payloads go.
    let held = |t: &ShmTransport| !t.peer(1).unwrap().out.lock().is_idle();
    assert!(held(&t[0]));
    t[0].drain(&mut out).unwrap();
    assert!(!held(&t[0]), "every payload was released");
    assert!(
        !t[0].may_have_arrivals(),
        "nothing held, nothing to look at"
    );
}

#[tokio::test]
async fn a_full_ring_holds_senders_back_and_loses_nothing() {
    // 4 KiB rings: a few hundred frames fill it many times over before anyone reads.
    let t = job(3, settings(4096, true));
    for i in 0..500u64 {
        t[0].send(2, eager(i, pattern(200, i))).unwrap();
        t[1].send(2, eager(i, pattern(300, i))).unwrap();
    }
    assert!(t[0].counters().ring_full > 0, "the ring filled");
    let got = collect(&t[2], &[&t[0], &t[1]], 1000);
    assert_eq!(got.len(), 1000);
    let (from0, from1): (Vec<_>, Vec<_>) = got
        .into_iter()
        .partition(|a| matches!(a, Arrival::Frame { from: 0, .. }));
    for (from, list, len) in [(0, from0, 200), (1, from1, 300)] {
        let list = payloads(list, from);
        assert_eq!(list.len(), 500);
        for (i, (seq, p)) in list.iter().enumerate() {
            assert_eq!(*seq, i as u64);
            assert_eq!(&p[..], &pattern(len, i as u64)[..]);
        }
    }
}

/// A sender waiting to push the next piece of a pipelined frame has work only once the ring
/// has room for that piece: less room (freed by a small record) must not have the progress
/// engine flush, fail and look again in a loop.
#[tokio::test]
async fn a_waiting_piece_needs_room_for_itself_not_for_any_record() {
    // 4 KiB rings: pieces of 1 008 bytes (a quarter of the ring, less the header).
    let t = job(2, settings(4096, false));
    t[0].send(1, eager(99, vec![])).unwrap();
    assert_eq!(collect(&t[1], &[&t[0]], 1).len(), 1);
    t[0].send(1, eager(0, pattern(100, 0))).unwrap();
    t[0].send(1, eager(1, pattern(20_000, 1))).unwrap();
    assert!(
        t[0].counters().ring_full > 0,
        "the frame's pieces filled the ring"
    );
    // The receiver takes the small frame alone: 192 bytes come free, too few for a piece.
    let want = EagerWant {
        from: 0,
        context: ContextId(2),
        tag: Some(9),
        seq: 0,
        max_len: usize::MAX,
    };
    assert!(t[1].take_eager(&want, None).is_some());
    assert!(!t[0].rank.can_flush(), "no room for the next piece yet");
    assert!(!t[0].rank.has_work());
    // Once the receiver reads on, the rest goes out and arrives whole.
    let got = payloads(collect(&t[1], &[&t[0]], 1), 0);
    assert_eq!(got.len(), 1);
    assert_eq!((got[0].0, &got[0].1[..]), (1, &pattern(20_000, 1)[..]));
}

#[tokio::test]
async fn an_eager_frame_is_written_in_place_only_when_it_can_go_out_at_once() {
    // 4 KiB rings, a quarter of which is the largest record: small frames fill one quickly.
    let t = job(2, settings(4096, true));
    let envelope = |seq: u64, len: usize| Envelope {
        context: ContextId(2),
        tag: 9,
        seq,
        len: len as u64,
    };
    // Not connected yet, or to itself: declined, for the usual path to handle.
    assert_eq!(t[0].send_eager(1, &envelope(0, 3), &[b"abc"]), Ok(false));
    assert_eq!(t[0].send_eager(0, &envelope(0, 3), &[b"abc"]), Ok(false));
    t[0].send(1, eager(0, pattern(5, 0))).unwrap();
    // Written in place, in pieces, behind the frame sent the usual way; then more until the
    // ring is full, which declines (nothing written), as does anything while frames wait.
    let mut seq = 1;
    while t[0].send_eager(1, &envelope(seq, 7), &[b"ab", b"", b"cdefg"]) == Ok(true) {
        seq += 1;
    }
    assert!(seq > 10, "{seq} frames fit");
    t[0].send(1, eager(seq, pattern(5, seq))).unwrap();
    assert!(
        t[0].counters().ring_full > 0,
        "the frame sent the usual way waits for space"
    );
    assert_eq!(
        t[0].send_eager(1, &envelope(seq + 1, 1), &[b"z"]),
        Ok(false)
    );
    // Too many pieces, or too large for one record: declined.
    let got = collect(&t[1], &[&t[0]], (seq + 1) as usize);
    assert_eq!(
        t[0].send_eager(1, &envelope(seq + 1, 4), &[b"a", b"b", b"c", b"d"]),
        Ok(false)
    );
    let big = vec![0u8; 20 * 1024];
    assert_eq!(
        t[0].send_eager(1, &envelope(seq + 1, big.len()), &[&big]),
        Ok(false)
    );
    // Everything arrived in order, each as the frame its envelope and pieces make.
    let list = payloads(got, 0);
    assert_eq!(list.len(), (seq + 1) as usize);
    for (i, (s, p)) in list.iter().enumerate() {
        assert_eq!(*s, i as u64);
        if i == 0 || i as u64 == seq {
            assert_eq!(&p[..], &pattern(5, i as u64)[..]);
        } else {
            assert_eq!(&p[..], b"abcdefg");
        }
    }
}

#[tokio::test]
async fn closing_says_goodbye_and_peers_learn_of_it_after_the_data() {
    let t = job(2, settings(64 * 1024, true));
    t[0].send(1, eager(0, pattern(10, 0))).unwrap();
    t[0].close();
    assert!(matches!(
        t[0].send(1, eager(1, vec![])),
        Err(TransportError::Closed)
    ));
    let got = collect(&t[1], &[], 2);
    assert!(matches!(got[0], Arrival::Frame { from: 0, .. }));
    assert!(matches!(got[1], Arrival::PeerLost { rank: 0 }));
    assert!(t[0].is_drained());
    // A frame to a rank that said goodbye is dropped: its loss has already been reported.
    assert!(matches!(t[1].send(0, eager(0, vec![1])), Ok(())));
    let mut nothing = Vec::new();
    assert_eq!(t[1].drain(&mut nothing).unwrap(), 0, "{nothing:?}");
}

#[tokio::test]
async fn bad_destinations_are_errors() {
    let t = job(2, settings(64 * 1024, true));
    assert!(matches!(
        t[0].send(7, eager(0, vec![])),
        Err(TransportError::PeerUnreachable(7))
    ));
    // To self: delivered by the loopback queue.
    t[0].send(0, eager(0, vec![5])).unwrap();
    let got = collect(&t[0], &[], 1);
    assert!(matches!(got[0], Arrival::Frame { from: 0, .. }));
}

#[tokio::test]
async fn malformed_records_are_dropped_and_counted_and_a_corrupt_ring_is_given_up() {
    let t = job(2, settings(4096, true));
    // Rank 0 sends one good frame so the rings are set up, then we forge records as rank 0.
    t[0].send(1, eager(0, vec![1, 2, 3])).unwrap();
    let peer = t[0].peer(1).unwrap();
    {
        let mut out = peer.out.lock();
        out.send_control(&peer.segment, 0, 99, b"unknown kind");
        out.send_control(&peer.segment, 0, record::FRAME, b"not a frame");
        out.send_control(&peer.segment, 0, record::SHORT, b"under 16 bytes");
        out.send_control(&peer.segment, 0, record::BYE, b"not empty");
    }
    t[0].send(1, eager(1, vec![4])).unwrap();
    let got = payloads(collect(&t[1], &[], 2), 0);
    assert_eq!(got.iter().map(|(s, _)| *s).collect::<Vec<_>>(), [0, 1]);
    assert_eq!(t[1].counters().malformed_dropped, 4);
    // Now break the ring itself: a record running past the end of the data area.
    let (_, data) = peer.segment.ring(0).unwrap();
    peer.out.lock().producer_mut().push_corrupt(&data);
    let got = collect(&t[1], &[], 1);
    assert!(
        matches!(got[..], [Arrival::PeerLost { rank: 0 }]),
        "{got:?}"
    );
    // The given-up ring no longer looks unread: the progress engine can sleep.
    assert!(!t[1].has_work());
}

#[tokio::test]
async fn a_parked_rank_is_woken_by_a_send() {
    let t = job(2, settings(64 * 1024, true));
    // Connect first (rank 1 maps rank 0 when it first reads from it).
    t[0].send(1, eager(0, vec![])).unwrap();
    assert_eq!(collect(&t[1], &[], 1).len(), 1);
    let t = Arc::new(t);
    let t2 = Arc::clone(&t);
    let sender = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(50)).await;
        t2[0].send(1, eager(1, vec![7])).unwrap();
    });
    let woke = tokio::time::timeout(
        Duration::from_secs(5),
        std::future::poll_fn(|cx| t[1].poll_arrival(cx)),
    )
    .await;
    assert!(woke.is_ok(), "the parked rank was not woken");
    sender.await.unwrap();
    assert!(
        t[0].counters().signals_sent >= 1,
        "the sender saw the armed doorbell"
    );
    assert_eq!(collect(&t[1], &[], 1).len(), 1);
}

#[test]
fn segment_addresses_round_trip_and_junk_is_refused() {
    let a = SegmentAddress {
        host: "00ff".into(),
        pid: 42,
        fd: 7,
        nonce: 0xdead_beef,
    };
    assert_eq!(SegmentAddress::decode(&a.encode()), Some(a));
    for junk in ["", "h:1", "h:x:1:0", "h:1:2:3:4", ":1:2:3", "h:1:2:zz"] {
        assert_eq!(SegmentAddress::decode(junk), None, "{junk:?}");
    }
}

/// A "progress task" for rank `rank` of `t`: sleeps in `poll_arrival`, drains when woken and
/// reports what arrived on the returned channel.
fn progress_task(
    t: &Arc<Vec<ShmTransport>>,
    rank: usize,
) -> (
    tokio::task::JoinHandle<()>,
    tokio::sync::mpsc::UnboundedReceiver<Arrival>,
) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let t = Arc::clone(t);
    let task = tokio::spawn(async move {
        loop {
            std::future::poll_fn(|cx| t[rank].poll_arrival(cx)).await;
            let mut out = Vec::new();
            t[rank].drain(&mut out).unwrap();
            for a in out {
                let _ = tx.send(a);
            }
        }
    });
    (task, rx)
}

/// A future that busy-polls for a while and then finishes without parking (so nobody calls
/// `waiter_parked`) must not leave the sleeping progress engine deaf: a later frame still wakes
/// it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_poller_that_finishes_without_parking_leaves_the_rank_wakeable() {
    let t = Arc::new(job(2, settings(64 * 1024, true)));
    t[0].send(1, eager(0, vec![])).unwrap();
    assert_eq!(collect(&t[1], &[], 1).len(), 1);
    let (progress, mut rx) = progress_task(&t, 1);
    tokio::time::sleep(Duration::from_millis(20)).await;
    // A future spins for a moment and completes.
    t[1].begin_busy_poll();
    tokio::time::sleep(Duration::from_millis(5)).await;
    t[1].end_busy_poll();
    tokio::time::sleep(Duration::from_millis(20)).await;
    t[0].send(1, eager(1, vec![9])).unwrap();
    let got = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await;
    progress.abort();
    assert!(
        matches!(got, Ok(Some(Arrival::Frame { from: 0, .. }))),
        "the frame sent after the busy poller left was not noticed: {got:?}"
    );
    // Noticed by the protocol (a signal or the recheck), not by the look-anyway timer.
    assert_eq!(t[1].counters().wakeups_missed, 0);
}

/// A record published without its signal (as a lost wake-up would leave it) is still found,
/// by the sleeping rank's look-anyway timer, and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_wake_up_costs_a_look_not_the_job_and_is_counted() {
    let t = Arc::new(job(2, settings(64 * 1024, true)));
    t[0].send(1, eager(0, vec![])).unwrap();
    assert_eq!(collect(&t[1], &[], 1).len(), 1);
    let (progress, mut rx) = progress_task(&t, 1);
    // Asleep on the armed doorbell.
    let until = Instant::now() + Duration::from_secs(5);
    while !t[1].rank.own.doorbell().is_armed() && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(t[1].rank.own.doorbell().is_armed());
    // Published straight through the peer's sending side: no look at its doorbell, no signal.
    let peer = t[0].peer(1).unwrap();
    assert!(peer.out.lock().send(&peer.segment, 0, eager(1, vec![7])));
    let got = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await;
    progress.abort();
    assert!(
        matches!(got, Ok(Some(Arrival::Frame { from: 0, .. }))),
        "the unannounced frame was never noticed: {got:?}"
    );
    assert_eq!(t[1].counters().wakeups_missed, 1);
    assert_eq!(t[0].counters().signals_sent, 0);
}

#[tokio::test]
async fn eager_frames_go_as_short_records_unless_their_sequence_number_is_past_32_bits() {
    let t = job(2, settings(64 * 1024, true));
    let late = 1u64 << 32;
    let sent = [
        eager(0, pattern(20, 0)),
        eager(late, pattern(20, 1)),
        eager(u64::from(u32::MAX), pattern(32, 2)),
        eager(late + 1, Vec::new()),
    ];
    for frame in &sent[..3] {
        t[0].send(1, frame.clone()).unwrap();
    }
    // Either way the same frames arrive: envelope (sequence number and length included) and
    // payload.
    let got = collect(&t[1], &[], 3);
    let frames: Vec<_> = got
        .into_iter()
        .map(|a| match a {
            Arrival::Frame { from: 0, frame } => frame,
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(frames, sent[..3]);
    t[0].send(1, sent[3].clone()).unwrap();
    // The kind byte of each record (12 bytes into its header; records start on 64-byte
    // units): a 20-byte payload after a SHORT header fits one unit, after a wire header two.
    let peer = t[0].peer(1).unwrap();
    let (_, data) = peer.segment.ring(0).unwrap();
    let kind_at = |at: usize| {
        // SAFETY: within the data area; only this thread writes the ring, and not meanwhile.
        unsafe { data.with_slice(at + 12, 1, |b| b[0]) }
    };
    let kinds = [kind_at(0), kind_at(64), kind_at(192), kind_at(256)];
    assert_eq!(
        kinds,
        [record::SHORT, record::FRAME, record::SHORT, record::FRAME]
    );
    // A late one is also taken by a receive waiting for it.
    let want = EagerWant {
        from: 0,
        context: ContextId(2),
        tag: Some(9),
        seq: late + 1,
        max_len: 0,
    };
    assert_eq!(
        t[1].take_eager(&want, None),
        Some(EagerTaken {
            tag: 9,
            len: 0,
            data: Bytes::new(),
        })
    );
}

#[tokio::test]
async fn an_eager_frame_is_taken_in_place_only_if_wanted_and_the_rest_left_for_drain_in_order() {
    let t = job(3, settings(64 * 1024, true));
    let want = |seq: u64| EagerWant {
        from: 0,
        context: ContextId(2),
        tag: Some(9),
        seq,
        max_len: usize::MAX,
    };
    // Nothing there yet (and no ring from that sender known).
    assert_eq!(t[1].take_eager(&want(0), None), None);
    for seq in 0..10u64 {
        t[0].send(1, eager(seq, pattern(100, seq))).unwrap();
        t[2].send(1, eager(seq, pattern(10, seq))).unwrap();
    }
    assert_eq!(
        t[1].take_eager(&want(0), None),
        Some(EagerTaken {
            tag: 9,
            len: 100,
            data: pattern(100, 0).into(),
        })
    );
    // Frames that are not the wanted message stay first in line: another sequence number,
    // context or tag, a payload longer than the receive takes.
    assert_eq!(t[1].take_eager(&want(2), None), None);
    let other_context = EagerWant {
        context: ContextId(3),
        ..want(1)
    };
    assert_eq!(t[1].take_eager(&other_context, None), None);
    let other_tag = EagerWant {
        tag: Some(8),
        ..want(1)
    };
    assert_eq!(t[1].take_eager(&other_tag, None), None);
    let too_short = EagerWant {
        max_len: 99,
        ..want(1)
    };
    assert_eq!(t[1].take_eager(&too_short, None), None);
    // Into the receive's own buffer: copied there, nothing allocated for it.
    let exact = EagerWant {
        max_len: 100,
        ..want(1)
    };
    let mut buf = vec![0u8; 100];
    assert_eq!(
        t[1].take_eager(&exact, Some(&mut buf)),
        Some(EagerTaken {
            tag: 9,
            len: 100,
            data: Bytes::new(),
        })
    );
    assert_eq!(buf, pattern(100, 1));
    assert_eq!(t[1].counters().frames_received, 2);
    // Drain delivers the rest of both senders' frames, each sender's in order, the declined one
    // first.
    let out = collect(&t[1], &[&t[0], &t[2]], 18);
    let seqs = |from: u32| -> Vec<u64> {
        out.iter()
            .filter_map(|a| match a {
                Arrival::Frame { from: f, frame } if *f == from => match frame.header {
                    Header::Eager(e) => Some(e.seq),
                    _ => None,
                },
                _ => None,
            })
            .collect()
    };
    assert_eq!(seqs(0), (2..10).collect::<Vec<_>>());
    assert_eq!(seqs(2), (0..10).collect::<Vec<_>>());
    assert_eq!(t[1].counters().frames_received, 20);
    assert_eq!(t[1].take_eager(&want(10), None), None);
}

/// Bytes of the mapping at `addr` that this process has mapped in (its `Rss` in
/// `/proc/self/smaps`).
fn mapped_in(addr: usize) -> usize {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut inside = false;
    for line in smaps.lines() {
        if let Some((range, _)) = line.split_once(' ') {
            if let Some((lo, hi)) = range.split_once('-') {
                if let (Ok(lo), Ok(hi)) =
                    (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
                {
                    inside = (lo..hi).contains(&addr);
                    continue;
                }
            }
        }
        if let (true, Some(kb)) = (inside, line.strip_prefix("Rss:")) {
            return kb
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<usize>()
                .unwrap()
                * 1024;
        }
    }
    panic!("no mapping at {addr:#x}");
}

#[tokio::test]
async fn rings_are_mapped_in_as_pairs_connect_while_the_budget_lasts() {
    let pair = |t: &ShmTransport| t.rank.own.pair_bytes();
    // Budget for one pair: rank 0's first peer gets its ring mapped in, the second does not;
    // the receivers map in the rings from rank 0 in their own segments.
    let one_pair = job(3, settings(128 * 1024, false));
    let budget = pair(&one_pair[0]);
    drop(one_pair);
    let t = job(
        3,
        ShmConfig {
            prefault_bytes: budget,
            ..settings(128 * 1024, false)
        },
    );
    for to in [1, 2] {
        t[0].send(to, eager(0, vec![1])).unwrap();
        assert_eq!(collect(&t[to as usize], &[&t[0]], 1).len(), 1);
    }
    let peer_mapping = |to: u32| mapped_in(t[0].rank.peer(to).unwrap().segment.base_addr());
    assert!(peer_mapping(1) >= budget, "{} < {budget}", peer_mapping(1));
    assert!(peer_mapping(2) < budget, "{} >= {budget}", peer_mapping(2));
    for r in [1, 2] {
        let own = mapped_in(t[r].rank.own.base_addr());
        assert!(own >= budget, "rank {r}: {own} < {budget}");
    }
    // Switched off: a message maps in only the pages it touches.
    let t = job(
        2,
        ShmConfig {
            prefault_bytes: 0,
            ..settings(128 * 1024, false)
        },
    );
    t[0].send(1, eager(0, vec![1])).unwrap();
    assert_eq!(collect(&t[1], &[&t[0]], 1).len(), 1);
    assert!(mapped_in(t[1].rank.own.base_addr()) < budget);
    assert!(mapped_in(t[0].rank.peer(1).unwrap().segment.base_addr()) < budget);
}

/// A two-rank exchange (`Communicator::collective_exchange`) whose message is already first in
/// its ring is finished at the call: the later rank takes it in place, with no receive future.
/// The earlier rank's receive waits and then gets the later one's message; bad ranks fail both
/// halves at once.
#[tokio::test]
async fn an_exchange_takes_a_message_already_in_the_ring_at_the_call() {
    use rankweave_core::ExchangeRecv;
    let comms = world(2, &Config::default()).unwrap();
    let (sent1, early) = comms[1].collective_exchange(0, 5, &[b"from 1"], 0);
    let ExchangeRecv::Waiting(early) = early else {
        panic!("rank 0 has sent nothing yet: {early:?}");
    };
    let (sent0, late) = comms[0].collective_exchange(1, 5, &[b"from ", b"0"], 1);
    assert!(sent0.is_complete() && sent1.is_complete());
    match late {
        ExchangeRecv::Ready(Ok(m)) => assert_eq!((m.source(), &m.data()[..]), (1, &b"from 1"[..])),
        other => panic!("rank 1's message was in the ring: {other:?}"),
    }
    let m = early.await.unwrap();
    assert_eq!((m.source(), &m.data()[..]), (0, &b"from 0"[..]));
    let (sent, bad) = comms[0].collective_exchange(2, 6, &[], 1);
    assert!(matches!(
        bad,
        ExchangeRecv::Ready(Err(Error::InvalidRank { rank: 2, size: 2 }))
    ));
    assert!(matches!(
        sent.await,
        Err(Error::InvalidRank { rank: 2, size: 2 })
    ));
}

/// `recv_into` over shared memory: a small message is copied from the ring straight into the
/// caller's buffer — whether the receive waited for it or it was already in the ring — or, if
/// it went through matching first (taken in by another receive's pump), from its buffer; a
/// message longer than the buffer is refused (`Truncated`) and stays first in line.
#[tokio::test]
async fn a_receive_into_a_buffer_gets_its_message_from_the_ring() {
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Waker};
    let comms = world(2, &Config::default()).unwrap();
    let mut buf = [0u8; 100];
    // Waiting first: the receive is posted and polled before the message is sent.
    {
        let mut waiting = pin!(comms[1].recv_into(0, 7, &mut buf));
        let mut cx = Context::from_waker(Waker::noop());
        assert!(waiting.as_mut().poll(&mut cx).is_pending());
        comms[0].send(1, 7, pattern(100, 1)).await.unwrap();
        let status = waiting.await.unwrap();
        assert_eq!((status.source, status.tag, status.len), (0, 7, 100));
    }
    assert_eq!(buf.to_vec(), pattern(100, 1));
    // Already in the ring when posted.
    comms[0].send(1, 7, pattern(60, 2)).await.unwrap();
    assert_eq!(comms[1].recv_into(0, 7, &mut buf).await.unwrap().len, 60);
    assert_eq!(buf[..60].to_vec(), pattern(60, 2));
    // Taken in by the pump of a receive for another tag, then matched.
    comms[0].send(1, 7, pattern(30, 3)).await.unwrap();
    comms[0].send(1, 8, pattern(1, 4)).await.unwrap();
    assert_eq!(comms[1].recv(0, 8).await.unwrap().data()[..], pattern(1, 4));
    assert_eq!(comms[1].recv_into(0, 7, &mut buf).await.unwrap().len, 30);
    assert_eq!(buf[..30].to_vec(), pattern(30, 3));
    // Waiting beside another receive (so not taken straight from the ring): matched by the
    // pump, then copied from its buffer.
    {
        let mut cx = Context::from_waker(Waker::noop());
        let mut waiting = pin!(comms[1].recv_into(0, 7, &mut buf));
        let mut other = pin!(comms[1].recv(0, 9));
        assert!(waiting.as_mut().poll(&mut cx).is_pending());
        assert!(other.as_mut().poll(&mut cx).is_pending());
        comms[0].send(1, 7, pattern(40, 6)).await.unwrap();
        assert_eq!(waiting.await.unwrap().len, 40);
    }
    assert_eq!(buf[..40].to_vec(), pattern(40, 6));
    // Too long for the buffer: refused, and still there for a receive that takes it.
    comms[0].send(1, 7, pattern(100, 5)).await.unwrap();
    let mut short = [0u8; 50];
    assert!(matches!(
        comms[1].recv_into(0, 7, &mut short).await,
        Err(Error::Truncated {
            len: 100,
            capacity: 50,
            ..
        })
    ));
    assert_eq!(
        comms[1].recv(0, 7).await.unwrap().data()[..],
        pattern(100, 5)
    );
}

/// A large message received into a buffer is read from the sender's memory straight there —
/// an eager one past the inline limit, and a rendezvous one's data once its request to send
/// was matched (the copy shared with the sender from 64 KiB) — waiting first or already
/// announced, with no buffer of the transport's and no second copy. A buffer lying where the kernel's copy would crawl
/// (1–63 bytes past the source modulo a page, on AMD) is read lined up and copied, as a `recv` is; a
/// message longer than the buffer is refused and kept. (On one thread, so the progress task
/// does not take the messages in before the receive looks.)
#[tokio::test]
async fn a_large_message_received_into_a_buffer_is_read_straight_there() {
    use std::future::Future;
    use std::pin::{Pin, pin};
    use std::task::{Context, Poll, Waker};
    let config = Config {
        shm: ShmConfig {
            pipeline_max: 0,
            adaptive: false,
            ..ShmConfig::default()
        },
        ..Config::default()
    };
    let comms = world(2, &config).unwrap();
    // Connected both ways, so the receiver may read the sender's memory.
    comms[0].send(1, 1, vec![0u8]).await.unwrap();
    comms[1].recv(0, 1).await.unwrap();
    comms[1].send(0, 1, vec![0u8]).await.unwrap();
    comms[0].recv(1, 1).await.unwrap();
    let direct = || comms[1].stats().transport.shm.read_into_receive;
    // A slice of `room` whose address is `distance` bytes past `src`'s modulo a page.
    fn placed(room: &mut [u8], src: &[u8], distance: usize, len: usize) -> std::ops::Range<usize> {
        let base = room.as_ptr() as usize;
        let at = (src.as_ptr() as usize + distance).wrapping_sub(base) % 4096;
        at..at + len
    }
    // Polls the receive, then the send (whose polls take in the receiver's clear-to-send and
    // publish a rendezvous message's data), by hand until the receive has its message: no
    // task of the runtime runs in between, so nothing else takes the data in first.
    fn received(
        mut recv: Pin<&mut rankweave_core::RecvIntoOp<'_>>,
        mut send: Pin<&mut rankweave_core::SendOp>,
    ) -> usize {
        let mut cx = Context::from_waker(Waker::noop());
        let until = Instant::now() + Duration::from_secs(10);
        let mut sent = false;
        loop {
            if let Poll::Ready(r) = recv.as_mut().poll(&mut cx) {
                return r.unwrap().len;
            }
            if !sent {
                sent = send.as_mut().poll(&mut cx).map(Result::unwrap).is_ready();
            }
            assert!(Instant::now() < until, "the message never came");
        }
    }
    let mut room = vec![0u8; (1 << 20) + 8192];
    // Eager past the inline limit, eager and shared with the sender, rendezvous.
    for (i, len) in [40_000usize, 65_536, 1 << 20].into_iter().enumerate() {
        let data = Bytes::from(pattern(len, i as u64));
        let before = direct();
        let range = placed(&mut room, &data, 0, len);
        // Waiting first.
        {
            let mut waiting = pin!(comms[1].recv_into(0, 7, &mut room[range.clone()]));
            let mut cx = Context::from_waker(Waker::noop());
            assert!(waiting.as_mut().poll(&mut cx).is_pending());
            let send = pin!(comms[0].send(1, 7, data.clone()));
            assert_eq!(received(waiting, send), len);
        }
        assert!(room[range.clone()] == data[..], "{len} B, waiting first");
        assert_eq!(
            direct(),
            before + 1,
            "{len} B read straight into the buffer"
        );
        // Announced before the receive is posted.
        room.fill(0);
        {
            let send = pin!(comms[0].send(1, 7, data.clone()));
            let recv = pin!(comms[1].recv_into(0, 7, &mut room[range.clone()]));
            assert_eq!(received(recv, send), len);
        }
        assert!(room[range.clone()] == data[..], "{len} B, announced first");
        assert_eq!(direct(), before + 2);
        // Where the kernel's copy would crawl: the usual way.
        room.fill(0);
        let slow = placed(&mut room, &data, 8, len);
        {
            let send = pin!(comms[0].send(1, 7, data.clone()));
            let recv = pin!(comms[1].recv_into(0, 7, &mut room[slow.clone()]));
            assert_eq!(received(recv, send), len);
        }
        assert!(room[slow] == data[..], "{len} B, lined up elsewhere");
        // Only a processor whose copy crawls there (AMD's) needs the detour.
        let straight = u64::from(!rankweave_core::byte_copy::rep_movsb_has_trap());
        assert_eq!(
            direct(),
            before + 2 + straight,
            "not read into a crawling destination"
        );
        // Too long for the buffer: refused, and still there.
        let send = comms[0].send(1, 7, data.clone());
        assert!(matches!(
            comms[1].recv_into(0, 7, &mut room[..len - 1]).await,
            Err(Error::Truncated { .. })
        ));
        assert!(comms[1].recv(0, 7).await.unwrap().data()[..] == data[..]);
        send.await.unwrap();
    }
}

/// Parked receives of a window of large messages (rendezvous, then single copy), published
/// while the receiving rank was off its runtime: each arrives whole and in order, and the first
/// receive's future runs as soon as its payload is in — with the requests to send and that one
/// payload taken in, not the payloads behind it. (The driver's `pump_tests` pin down the
/// pump's part of this: a pump stops once it finished a parked operation.)
#[test]
fn a_woken_receive_runs_before_the_progress_task_reads_on() {
    use rankweave_core::{Communicator, Config, ProgressPolicy};
    use std::sync::mpsc;

    const MESSAGES: usize = 8;
    const LEN: usize = 256 * 1024;
    let mut config = Config {
        progress: ProgressPolicy::Park,
        ..Config::default()
    };
    config.shm = settings(1 << 20, true);
    // Each rank's transport is made on the runtime that drives it (its signal socket is
    // registered there), in a thread of its own as if in a process of its own.
    let dir = Arc::new(LocalSegments::default());
    let published = Arc::new(std::sync::Barrier::new(2));
    let rank = move |r: u32, config: &Config| -> Communicator {
        let t = ShmTransport::new(r, 2, config.shm, Duration::from_secs(1), dir.clone()).unwrap();
        dir.publish(r, t.address());
        let t: Arc<dyn Transport> = Arc::new(t);
        Communicator::world(r as usize, 2, t, config.clone()).unwrap()
    };
    let runtime = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    };
    let (parked_tx, parked_rx) = mpsc::channel::<()>();
    let (sent_tx, sent_rx) = mpsc::channel::<()>();
    let (sender_config, sender_rank, sender_published) =
        (config.clone(), rank.clone(), published.clone());
    let sender = std::thread::spawn(move || {
        runtime().block_on(async move {
            let comm = sender_rank(0, &sender_config);
            sender_published.wait();
            // Connects the pair: large payloads go by single copy from here on.
            comm.send(1, 0, vec![0u8]).await.unwrap();
            parked_rx.recv().unwrap();
            // Posted at once (a large send finishes when the receiver has read it).
            let sends: Vec<_> = (0..MESSAGES)
                .map(|i| comm.send(1, 1, pattern(LEN, i as u64)))
                .collect();
            sent_tx.send(()).unwrap();
            for s in sends {
                s.await.unwrap();
            }
            comm.recv(1, 2).await.unwrap();
        })
    });
    runtime().block_on(async move {
        let comm = rank(1, &config);
        published.wait();
        comm.recv(0, 0).await.unwrap();
        let receiver = tokio::spawn({
            let comm = comm.clone();
            async move {
                let mut receives: Vec<_> = (0..MESSAGES).map(|_| comm.recv(0, 1)).collect();
                let mut seen_at_first = None;
                for (i, r) in receives.drain(..).enumerate() {
                    let m = r.await.unwrap();
                    assert_eq!(m.data(), &pattern(LEN, i as u64)[..]);
                    seen_at_first.get_or_insert(comm.stats().transport.shm.frames_received);
                }
                seen_at_first.unwrap()
            }
        });
        // Let the receives park, then keep this thread off the runtime while every request
        // to send is published: the progress task finds them all when it next runs, answers
        // them, and the sender's payloads come back one after another.
        tokio::time::sleep(Duration::from_millis(50)).await;
        parked_tx.send(()).unwrap();
        sent_rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(
            receiver.await.unwrap(),
            1 + MESSAGES as u64 + 1,
            "when the first receive ran: the connecting message, the requests to send and the \
             first payload, not those behind it"
        );
        comm.send(0, 2, vec![0u8]).await.unwrap();
    });
    sender.join().unwrap();
}

/// Sends `count` single-copy frames of `len` bytes from `t[0]` to `t[1]` while `helper` runs
/// on another thread until they are all received; checks them whole and in order.
fn split_round(t: &[ShmTransport], count: usize, len: usize, seed: u64, helper: impl Fn() + Sync) {
    for i in 0..count {
        t[0].send(1, eager(i as u64, pattern(len, seed + i as u64)))
            .unwrap();
    }
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Acquire) {
                helper();
            }
        });
        let got = payloads(collect(&t[1], &[], count), 0);
        stop.store(true, Ordering::Release);
        assert_eq!(got.len(), count);
        for (i, (seq, p)) in got.iter().enumerate() {
            assert_eq!(*seq, i as u64, "order kept");
            assert!(
                p[..] == pattern(len, seed + i as u64)[..],
                "content of frame {i}"
            );
        }
    });
}

/// Runs [`split_round`]s of `count` payloads of `len` bytes, the sender's progress running
/// on another thread, until the sender has written some bytes into the receiver's buffers
/// (at most 50 rounds: whether it gets to a payload first depends on the threads' timing).
fn rounds_until_the_sender_writes(t: &[ShmTransport], count: usize, len: usize) {
    let mut rounds = 0;
    while t[0].counters().split_bytes_written == 0 {
        rounds += 1;
        assert!(
            rounds <= 50,
            "the sender never wrote into the receiver's buffer"
        );
        split_round(t, count, len, rounds, || {
            t[0].drain(&mut Vec::new()).unwrap();
        });
    }
}

/// A sender whose progress runs while the receiver reads writes a share of each long payload
/// into the receiver's buffer (`split_bytes_written`), and the payloads arrive whole. Whether
/// the sender gets to a payload before the receiver has taken all of it depends on the
/// threads' timing, so rounds go on until it has (at most 50).
#[tokio::test]
async fn a_sender_writes_its_share_of_long_payloads() {
    let t = job(2, settings(1 << 20, true));
    connect_both_ways(&t);
    rounds_until_the_sender_writes(&t, 4, 4 << 20);
    let c = t[0].counters();
    assert!(c.split_bytes_written < c.bytes_sent);
    // Payloads shorter than `SPLIT_MIN` are never offered.
    let before = c.split_bytes_written;
    split_round(&t, 8, 30_000, 99, || {
        t[0].drain(&mut Vec::new()).unwrap();
    });
    assert_eq!(t[0].counters().split_bytes_written, before);
}

/// A share the sender claimed but could not write (here: scribbled over and reported failed)
/// is read again by the receiver: the payload still arrives whole.
#[tokio::test]
async fn a_failed_share_is_read_again_by_the_receiver() {
    let t = job(
        2,
        ShmConfig {
            split_copy: true,
            ..settings(1 << 20, true)
        },
    );
    connect_both_ways(&t);
    let slot = t[1].rank.own.split_slot(0).unwrap();
    let failed = AtomicU64::new(0);
    let mut rounds = 0;
    while failed.load(Ordering::Acquire) == 0 {
        rounds += 1;
        assert!(rounds <= 50, "the stand-in sender never got a chunk");
        split_round(&t, 4, 4 << 20, rounds, || {
            if let Some(tag) = slot.open_offer() {
                slot.take_chunks(tag, |c| {
                    let junk = vec![0xEEu8; c.len as usize];
                    cma::write_slice(std::process::id(), c.dst + c.offset, &junk).unwrap();
                    failed.fetch_add(1, Ordering::Release);
                    false
                });
            }
        });
    }
}

/// A rank's arena: one lease at a time, given back on drop; what the owner writes there its
/// peers read through their own mappings, and nothing past its end; none when sized 0; and a
/// rank whose arena size differs cannot be connected to (its segment has another layout).
#[tokio::test]
async fn an_arena_is_leased_once_at_a_time_and_read_by_peers() {
    let t = job(3, ShmConfig::default());
    let mut lease = t[0].lease_arena().expect("an arena");
    assert_eq!(lease.len(), ShmConfig::default().arena_bytes);
    assert!(
        t[0].lease_arena().is_none(),
        "a second lease while the first lives"
    );
    let data = pattern(100_000, 5);
    lease.bytes_mut()[..data.len()].copy_from_slice(&data);
    for peer in [&t[1], &t[2]] {
        let view = peer.peer_arena(0).expect("rank 0's arena, mapped");
        assert_eq!(view.len(), lease.len());
        // SAFETY: rank 0 wrote these bytes above and writes nothing while they are read.
        assert_eq!(unsafe { view.bytes(0..data.len()) }, Some(&data[..]));
        // SAFETY: as above (nothing is read: the range is out of bounds).
        assert_eq!(unsafe { view.bytes(0..view.len() + 1) }, None);
    }
    drop(lease);
    assert!(t[0].lease_arena().is_some(), "given back on drop");
    assert!(t[0].peer_arena(0).is_none(), "a rank is not its own peer");

    let off = ShmConfig {
        arena_bytes: 0,
        ..ShmConfig::default()
    };
    let none = job(2, off);
    assert!(none[0].lease_arena().is_none());
    assert!(none[1].peer_arena(0).is_none());

    let dir = Arc::new(LocalSegments::default());
    let sizes = [1 << 20, 4 << 20];
    let mixed: Vec<ShmTransport> = (0..2)
        .map(|r| {
            let s = ShmConfig {
                arena_bytes: sizes[r as usize],
                ..ShmConfig::default()
            };
            let t = ShmTransport::new(r, 2, s, Duration::from_secs(1), dir.clone()).unwrap();
            dir.publish(r, t.address());
            t
        })
        .collect();
    assert!(mixed[1].peer_arena(0).is_none());
    assert!(mixed[1].send(0, eager(0, vec![1])).is_err());
}
