//! Scale and volume: a 1024-rank ring, 10 000 outstanding receives, 16 MiB messages (also
//! fragmented), and the unexpected-memory bound holding a sender back.

mod common;

use std::time::{Duration, Instant};

use common::{assert_pattern, pattern, within};
use rankweave::{Config, ProgressPolicy, SendOp, Source, Tag};

const LAPS: u64 = 3;

fn token_check(lap: u64, hops: u64) -> u64 {
    (lap << 40) ^ hops.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// A token goes around 1024 in-process ranks three times; every hop checks its payload
/// (lap, hop count, a checksum of both) and the sender.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ring_of_1024_ranks() {
    within(async {
        let n = 1024usize;
        let started = Instant::now();
        let hops = rankweave::local(n, move |comm| async move {
            let (me, n) = (comm.rank(), comm.size());
            let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
            let mut received = 0u64;
            for lap in 0..LAPS {
                let tag = lap as u32;
                let hops = if me == 0 {
                    lap * n as u64
                } else {
                    let m = comm.recv(prev, tag).await.unwrap();
                    assert_eq!(m.source(), prev);
                    let v: Vec<u64> = m.to_vec().unwrap();
                    let want = lap * n as u64 + me as u64 - 1;
                    assert_eq!(v, [lap, want, token_check(lap, want)], "rank {me}");
                    received += 1;
                    want + 1
                };
                comm.send(next, tag, &[lap, hops, token_check(lap, hops)])
                    .await
                    .unwrap();
                if me == 0 {
                    let m = comm.recv(prev, tag).await.unwrap();
                    let v: Vec<u64> = m.to_vec().unwrap();
                    let want = lap * n as u64 + n as u64 - 1;
                    assert_eq!(v, [lap, want, token_check(lap, want)]);
                    received += 1;
                }
            }
            received
        })
        .await
        .unwrap();
        assert_eq!(hops, vec![LAPS; n]);
        eprintln!("1024-rank ring, {LAPS} laps: {:?}", started.elapsed());
    })
    .await
}

/// One rank posts 10 000 receives with distinct tags; the other sends 10 000 messages in a
/// scrambled tag order; every receive gets the message with its tag and payload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_outstanding_receives() {
    within(async {
        const N: u32 = 10_000;
        rankweave::local(2, |comm| async move {
            let payload = |tag: u32| [tag, tag.wrapping_mul(2_654_435_761), !tag];
            if comm.rank() == 0 {
                comm.recv(1, N).await.unwrap();
                let mut ops = Vec::new();
                for i in 0..N {
                    // 7919 is prime and coprime to 10 000: a permutation of the tags.
                    let tag = (i * 7919 + 13) % N;
                    ops.push(comm.send(1, tag, &payload(tag)));
                }
                for op in ops {
                    op.await.unwrap();
                }
                return;
            }
            let recvs: Vec<_> = (0..N).map(|tag| comm.recv(0, tag)).collect();
            assert_eq!(comm.stats().posted_receives, u64::from(N));
            comm.send(0, N, "ready").await.unwrap();
            for (tag, op) in (0..N).zip(recvs) {
                let m = op.await.unwrap();
                assert_eq!((m.source(), m.tag()), (0, tag));
                assert_eq!(m.to_vec::<u32>().unwrap(), payload(tag));
            }
            let st = comm.stats();
            assert_eq!((st.posted_receives, st.unexpected_messages), (0, 0));
        })
        .await
        .unwrap();
    })
    .await
}

/// Two ranks exchange 16 MiB rendezvous messages in both directions at once; content is
/// compared byte for byte.
async fn exchange_16mib(config: Config) -> [rankweave::Stats; 2] {
    const LEN: usize = 16 << 20;
    let stats = rankweave::local_with(config, 2, |comm| async move {
        let me = comm.rank() as u64;
        let peer = 1 - comm.rank();
        let send = comm.send(peer, 16, pattern(100 + me, LEN));
        let recv = comm.recv(peer, 16);
        let (s, r) = tokio::join!(send, recv);
        s.unwrap();
        let m = r.unwrap();
        assert_eq!((m.source(), m.tag()), (peer, 16));
        assert_pattern(m.data(), 100 + peer as u64, LEN);
        comm.stats()
    })
    .await
    .unwrap();
    for st in &stats {
        assert_eq!(st.rendezvous_messages_sent, 1);
        assert_eq!(st.bytes_sent, LEN as u64);
    }
    [stats[0].clone(), stats[1].clone()]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_mib_both_directions() {
    within(async {
        let stats = exchange_16mib(Config::default()).await;
        // In process the data travels by reference with the RTS: RTS and CTS each way.
        for st in stats {
            assert_eq!(st.frames_sent, 2, "{st:?}");
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_mib_both_directions_fragmented() {
    within(async {
        let config = Config {
            max_frame: Some(64 * 1024),
            ..Config::default()
        };
        let stats = exchange_16mib(config).await;
        // RTS, CTS and 256 data fragments of 64 KiB each way.
        for st in stats {
            assert_eq!(st.frames_sent, 2 + 256, "{st:?}");
            assert_eq!(st.frames_received, 2 + 256, "{st:?}");
        }
    })
    .await
}

/// With a 1 MiB unexpected limit, a sender of many 32 KiB messages to a rank that does not
/// receive yet is held back: its later sends stay pending and the receiver's unexpected bytes
/// stay under the limit; once the receiver receives, everything arrives in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unexpected_limit_holds_sender_back() {
    // The sender checks its pending sends with short timeouts and then leaves them unpolled;
    // under spin-then-park that trips the lost-wake-up bug (see
    // cancel.rs::pending_future_left_unpolled_does_not_block_wakeups), so this test parks.
    within(unexpected_limit(ProgressPolicy::Park)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unexpected_limit_holds_sender_back_spin_then_park() {
    within(unexpected_limit(ProgressPolicy::SpinThenPark)).await
}

async fn unexpected_limit(policy: ProgressPolicy) {
    {
        const COUNT: u64 = 64;
        const LEN: usize = 32 << 10;
        const LIMIT: usize = 1 << 20;
        let config = Config {
            unexpected_limit: LIMIT,
            eager_limit: 64 << 10,
            progress: policy,
            ..Config::default()
        };
        rankweave::local_with(config, 2, |comm| async move {
            if comm.rank() == 0 {
                let mut ops: Vec<Option<SendOp>> = (0..COUNT)
                    .map(|i| Some(comm.send(1, 1, pattern(i, LEN))))
                    .collect();
                tokio::time::sleep(Duration::from_millis(100)).await;
                let mut pending = Vec::new();
                for (i, slot) in ops.iter_mut().enumerate() {
                    let op = slot.as_mut().unwrap();
                    match tokio::time::timeout(Duration::from_millis(1), op).await {
                        Ok(r) => {
                            r.unwrap();
                            *slot = None;
                        }
                        Err(_) => pending.push(i as u64),
                    }
                }
                // The first `eager` sends went out eagerly (complete at once, within this
                // sender's share of the receiver's limit, at LEN + 64 bytes of credit each);
                // all later ones wait for the receiver.
                let st = comm.stats();
                let eager = st.eager_messages_sent;
                assert!((1..COUNT).contains(&eager), "{st:?}");
                assert!(eager * (LEN as u64 + 64) <= LIMIT as u64, "{st:?}");
                assert_eq!(st.rendezvous_messages_sent, COUNT - eager);
                assert_eq!(pending, (eager..COUNT).collect::<Vec<_>>());
                comm.send(1, 2, &[eager]).await.unwrap();
                for op in ops.into_iter().flatten() {
                    op.await.unwrap();
                }
                return;
            }
            let eager = comm.recv(0, 2).await.unwrap().to_vec::<u64>().unwrap()[0];
            let st = comm.stats();
            assert!(st.unexpected_bytes <= LIMIT as u64, "{st:?}");
            assert_eq!(st.unexpected_bytes, eager * LEN as u64, "{st:?}");
            assert_eq!(st.unexpected_messages, COUNT, "{st:?}");
            for i in 0..COUNT {
                let m = comm.recv(Source::Any, Tag::Any).await.unwrap();
                assert_eq!((m.source(), m.tag()), (0, 1));
                assert_pattern(m.data(), i, LEN);
                assert!(comm.stats().unexpected_bytes <= LIMIT as u64);
            }
            let st = comm.stats();
            assert_eq!((st.unexpected_messages, st.unexpected_bytes), (0, 0));
        })
        .await
        .unwrap();
    }
}
