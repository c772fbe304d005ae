//! Cancel safety: dropping receive futures (unmatched, matched, mid-transfer, under
//! `tokio::time::timeout`) loses nothing and keeps order; dropping send futures does not
//! cancel the send.

mod common;

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use common::{Lcg, assert_pattern, pattern, within};
use rankweave::{Config, Source, Tag};

/// Polls `fut` once; `Some(output)` if it finished.
async fn poll_once<F: Future + Unpin>(fut: &mut F) -> Option<F::Output> {
    std::future::poll_fn(|cx| {
        Poll::Ready(match Pin::new(&mut *fut).poll(cx) {
            Poll::Ready(v) => Some(v),
            Poll::Pending => None,
        })
    })
    .await
}

/// (a) A receive that times out before anything was sent is withdrawn: the message sent later
/// goes to the next receive, and is not swallowed by the dropped one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timed_out_recv_is_withdrawn() {
    within(async {
        rankweave::local(2, |comm| async move {
            if comm.rank() == 0 {
                comm.recv(1, 9).await.unwrap();
                comm.send(1, 1, "m1").await.unwrap();
                comm.send(1, 1, "m2").await.unwrap();
                comm.send(1, 2, "m3").await.unwrap();
                return;
            }
            let t = Duration::from_millis(30);
            assert!(tokio::time::timeout(t, comm.recv(0, 1)).await.is_err());
            assert!(
                tokio::time::timeout(t, comm.recv(Source::Any, Tag::Any))
                    .await
                    .is_err()
            );
            assert!(tokio::time::timeout(t, comm.recv(0, 2)).await.is_err());
            assert_eq!(comm.stats().posted_receives, 0);
            comm.send(0, 9, "go").await.unwrap();
            let m1 = comm.recv(0, 1).await.unwrap();
            let m2 = comm.recv(Source::Any, Tag::Any).await.unwrap();
            let m3 = comm.recv(0, 2).await.unwrap();
            assert_eq!(&m1.data()[..], b"m1");
            assert_eq!(&m2.data()[..], b"m2");
            assert_eq!(&m3.data()[..], b"m3");
            assert_eq!(comm.iprobe(Source::Any, Tag::Any).unwrap(), None);
        })
        .await
        .unwrap();
    })
    .await
}

/// (b) A receive that matched but whose future is dropped unpolled gives its message back at
/// its original place: the next two receives get m1 then m2.
async fn matched_then_dropped(len: usize) {
    let config = Config::default();
    rankweave::local_with(config, 2, move |comm| async move {
        if comm.rank() == 0 {
            comm.recv(1, 9).await.unwrap();
            let s1 = comm.send(1, 1, pattern(1, len));
            let s2 = comm.send(1, 1, pattern(2, len));
            comm.send(1, 2, "sent").await.unwrap();
            s1.await.unwrap();
            s2.await.unwrap();
            return;
        }
        let a = comm.recv(0, 1);
        comm.send(0, 9, "go").await.unwrap();
        // Same source, so m1 and m2 arrived before this.
        comm.recv(0, 2).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let st = comm.stats();
        assert_eq!(
            (st.posted_receives, st.unexpected_messages),
            (0, 1),
            "{st:?}"
        );
        drop(a);
        assert_eq!(comm.stats().unexpected_messages, 2);
        let m1 = comm.recv(0, 1).await.unwrap();
        let m2 = comm.recv(Source::Any, Tag::Any).await.unwrap();
        assert_pattern(m1.data(), 1, len);
        assert_pattern(m2.data(), 2, len);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn matched_then_dropped_recv_requeues_in_order_eager() {
    within(matched_then_dropped(1000)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn matched_then_dropped_recv_requeues_in_order_rendezvous() {
    within(matched_then_dropped(256 * 1024)).await
}

/// A matched message given back by a dropped receive goes to a receive posted after it (which
/// was waiting because the message had been taken).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_match_goes_to_waiting_receive() {
    within(async {
        rankweave::local(2, |comm| async move {
            if comm.rank() == 0 {
                comm.recv(1, 9).await.unwrap();
                comm.send(1, 1, "m1").await.unwrap();
                comm.send(1, 2, "sync").await.unwrap();
                comm.recv(1, 9).await.unwrap();
                comm.send(1, 1, "m2").await.unwrap();
                return;
            }
            let a = comm.recv(0, 1);
            comm.send(0, 9, "go").await.unwrap();
            comm.recv(0, 2).await.unwrap();
            let mut b = comm.recv(Source::Any, 1);
            assert!(poll_once(&mut b).await.is_none(), "b found a message");
            drop(a);
            comm.send(0, 9, "go").await.unwrap();
            let c = comm.recv(0, 1);
            assert_eq!(&b.await.unwrap().data()[..], b"m1");
            assert_eq!(&c.await.unwrap().data()[..], b"m2");
        })
        .await
        .unwrap();
    })
    .await
}

/// A receive that matched a rendezvous message and is dropped while the data is still on its
/// way: a receive posted right after must still get that message first (per-source order).
///
/// Deterministic: all ranks are driven from one task of a current-thread runtime, so no
/// progress task runs (and no data moves) between the calls.
#[tokio::test(flavor = "current_thread")]
async fn dropped_mid_rendezvous_keeps_order() {
    within(async {
        let config = Config::default();
        let comms = rankweave::transports::inproc::world(2, &config).unwrap();
        let (r0, r1) = (&comms[0], &comms[1]);
        let len = 1 << 20;
        let a = r1.recv(0, 1);
        let s1 = r0.send(1, 1, pattern(1, len)); // rendezvous: RTS now, data after CTS
        let s2 = r0.send(1, 1, "m2"); // eager
        // Rank 1 handles the RTS (A matches, CTS goes out) and queues m2.
        assert_eq!(
            r1.iprobe(0, 1).unwrap().map(|s| s.len),
            Some(2),
            "m2 waits, m1 is taken by A"
        );
        drop(a);
        let b = r1.recv(0, 1);
        let c = r1.recv(0, 1);
        let (m1, m2) = (b.await.unwrap(), c.await.unwrap());
        assert_pattern(m1.data(), 1, len);
        assert_eq!(&m2.data()[..], b"m2");
        s1.await.unwrap();
        s2.await.unwrap();
    })
    .await
}

/// Receives raced against short timeouts, zero timeouts and poll-then-drop, with eager and
/// rendezvous messages: every message is received exactly once, in order, intact.
async fn racing(n: u64, size_of: fn(u64) -> usize, seed: u64) {
    rankweave::local(2, move |comm| async move {
        if comm.rank() == 0 {
            let mut rng = Lcg(seed);
            let mut ops = Vec::new();
            for i in 0..n {
                ops.push(comm.send(1, 1, pattern(i, size_of(i))));
                match rng.below(10) {
                    0 => tokio::time::sleep(Duration::from_micros(200)).await,
                    1..=4 => tokio::task::yield_now().await,
                    _ => {}
                }
            }
            for op in ops {
                op.await.unwrap();
            }
            return (0, 0);
        }
        let mut rng = Lcg(seed ^ 0xFFFF);
        let (mut next, mut dropped) = (0u64, 0u64);
        while next < n {
            let got = match rng.below(4) {
                0 => tokio::time::timeout(Duration::ZERO, comm.recv(0, 1))
                    .await
                    .ok(),
                1 => tokio::time::timeout(Duration::from_micros(300), comm.recv(0, 1))
                    .await
                    .ok(),
                2 => {
                    let mut op = comm.recv(Source::Any, Tag::Any);
                    let mut out = None;
                    for _ in 0..1 + rng.below(4) {
                        out = poll_once(&mut op).await;
                        if out.is_some() {
                            break;
                        }
                        tokio::task::yield_now().await;
                    }
                    out
                }
                _ => Some(comm.recv(0, 1).await),
            };
            match got {
                Some(m) => {
                    let m = m.unwrap();
                    assert_pattern(m.data(), next, size_of(next));
                    next += 1;
                }
                None => dropped += 1,
            }
        }
        assert_eq!(comm.iprobe(Source::Any, Tag::Any).unwrap(), None);
        (next, dropped)
    })
    .await
    .map(|v| v[1])
    .map(|(got, dropped)| {
        assert_eq!(got, n);
        assert!(dropped > 0, "no receive was ever dropped");
    })
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_racing_loses_nothing_eager() {
    within(racing(2000, |i| 8 + (i as usize % 300), 7)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_racing_loses_nothing_with_rendezvous() {
    within(racing(
        600,
        |i| {
            if i % 5 == 4 {
                100_000 + i as usize
            } else {
                8 + i as usize
            }
        },
        11,
    ))
    .await
}

/// Dropping a rendezvous-sized send future right away does not cancel it, even if the sending
/// rank's task then ends at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_send_still_delivers() {
    within(async {
        let len = 1 << 20;
        rankweave::local(2, move |comm| async move {
            if comm.rank() == 0 {
                drop(comm.send(1, 1, pattern(11, len)));
                drop(comm.send(1, 1, pattern(12, len)));
                drop(comm.send(1, 1, pattern(13, 10)));
                assert_eq!(comm.stats().rendezvous_messages_sent, 2);
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            let a = comm.recv(0, 1);
            let b = comm.recv(0, 1);
            let c = comm.recv(0, 1);
            assert_pattern(a.await.unwrap().data(), 11, len);
            assert_pattern(b.await.unwrap().data(), 12, len);
            assert_pattern(c.await.unwrap().data(), 13, 10);
        })
        .await
        .unwrap();
    })
    .await
}

/// A dropped send completes while its rank waits for something else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_send_progresses_while_rank_waits() {
    within(async {
        let len = 1 << 20;
        rankweave::local(2, move |comm| async move {
            if comm.rank() == 0 {
                drop(comm.send(1, 1, pattern(21, len)));
                let ack = comm.recv(1, 2).await.unwrap();
                assert_eq!(&ack.data()[..], b"ack");
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert_pattern(comm.recv(0, 1).await.unwrap().data(), 21, len);
            comm.send(0, 2, "ack").await.unwrap();
        })
        .await
        .unwrap();
    })
    .await
}

/// A receive future that was polled once (so it started busy-polling) and is then kept but not
/// polled again must not stop the rank from being woken for other operations.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_future_left_unpolled_does_not_block_wakeups() {
    within(async {
        rankweave::local(2, |comm| async move {
            if comm.rank() == 0 {
                tokio::time::sleep(Duration::from_millis(50)).await;
                comm.send(1, 2, "wake up").await.unwrap();
                comm.send(1, 1, "late").await.unwrap();
                return;
            }
            let mut idle = comm.recv(0, 1);
            assert!(poll_once(&mut idle).await.is_none());
            // (A timeout's expiry re-polls the receive, which then finds the message; so
            // measure how long the wake-up took instead of relying on the timeout.)
            let started = std::time::Instant::now();
            let r = tokio::time::timeout(Duration::from_secs(3), comm.recv(0, 2)).await;
            let took = started.elapsed();
            assert_eq!(&r.unwrap().unwrap().data()[..], b"wake up");
            assert!(
                took < Duration::from_secs(1),
                "the parked receive was not woken when its message arrived (took {took:?})"
            );
            assert_eq!(&idle.await.unwrap().data()[..], b"late");
        })
        .await
        .unwrap();
    })
    .await
}
