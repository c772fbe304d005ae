//! How collectives run, rather than what they compute: progress without the caller polling
//! (skew tolerance), several collectives in flight on several communicators, dropped futures,
//! and every collective on 256 in-process ranks.

use std::time::{Duration, Instant};

use bytes::Bytes;
use rankweave_collectives::{Collectives, Op, UserOp};
use rankweave_core::tuning::{BarrierAlgorithm, BcastAlgorithm};
use rankweave_core::{Communicator, Config, Error};

mod common;
use common::{job_with, job_within};

/// Yu's skew tolerance: rank 2 is rank 3's parent in the binomial tree from root 0. It starts
/// the broadcast, then does something else for a long time before it looks at the result. Rank
/// 3 must not wait for that: the collective forwards without being polled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_poller_does_not_hold_up_its_subtree() {
    let mut config = Config::default();
    config.collectives.bcast = Some(BcastAlgorithm::Binomial);
    // A tree, not the flat fan-out 4 ranks would get by default (where nobody forwards).
    config.collectives.flat_max = 0;
    let late = Duration::from_millis(1500);
    let times = job_with(4, &config, move |comm| async move {
        let t0 = Instant::now();
        let data = if comm.rank() == 0 {
            vec![7u8; 1000]
        } else {
            Vec::new()
        };
        let op = comm.broadcast(0, data);
        if comm.rank() == 2 {
            tokio::time::sleep(late).await; // not polling `op`
        }
        let got = op.await?;
        assert_eq!(&got[..], &[7u8; 1000][..]);
        Ok::<_, Error>(t0.elapsed())
    })
    .await;
    let times: Vec<Duration> = times.into_iter().map(Result::unwrap).collect();
    assert!(times[2] >= late);
    assert!(
        times[3] < late / 3,
        "rank 3 waited {:?} for its late parent",
        times[3]
    );
}

/// The same for the linear barrier's rank 0, which releases the others: it enters the barrier
/// and then does something else for a long time. The others must leave as soon as they have
/// all arrived, not when rank 0 next looks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_polling_barrier_root_still_releases_the_others() {
    let mut config = Config::default();
    config.collectives.barrier = Some(BarrierAlgorithm::Linear);
    let late = Duration::from_millis(1500);
    let times = job_with(5, &config, move |comm| async move {
        let t0 = Instant::now();
        let op = comm.barrier();
        if comm.rank() == 0 {
            tokio::time::sleep(late).await; // not polling `op`
        }
        op.await?;
        Ok::<_, Error>(t0.elapsed())
    })
    .await;
    let times: Vec<Duration> = times.into_iter().map(Result::unwrap).collect();
    assert!(times[0] >= late);
    for (rank, t) in times.iter().enumerate().skip(1) {
        assert!(*t < late / 3, "rank {rank} waited {t:?} for rank 0 to look");
    }
}

/// Several collectives started before any is awaited, on the world, a duplicate of it and a
/// split of it, all complete with the right results.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collectives_in_flight_on_several_communicators() {
    for n in [2, 5, 8] {
        let results = job_with(n, &Config::default(), move |world| async move {
            let me = world.rank();
            let twin = world.dup().await?;
            let half = world
                .split(Some((me % 2) as u32), me as i32)
                .await?
                .expect("every rank has a color");
            // Started in this order on every rank; awaited in another order.
            let sum = world.all_reduce(&[me as u64, 1], Op::Sum);
            let bcast = twin.broadcast(n - 1, vec![me as u8; 3]);
            let gathered = half.all_gather(&[me as u32]);
            let barrier = twin.barrier();
            let max = half.all_reduce(&[me as i32], Op::Max);
            let scanned = world.scan(&[1u64], Op::Sum);
            let max = max.await?;
            barrier.await?;
            let gathered = gathered.await?;
            let bcast = bcast.await?;
            let sum = sum.await?;
            let scanned = scanned.await?;
            Ok::<_, Error>((sum, bcast, gathered, max, scanned))
        })
        .await;
        let total: u64 = (0..n as u64).sum();
        for (me, r) in results.into_iter().enumerate() {
            let (sum, bcast, gathered, max, scanned) = r.unwrap();
            assert_eq!(sum, [total, n as u64]);
            assert_eq!(&bcast[..], &[(n - 1) as u8; 3][..]);
            let same_half: Vec<u32> = (0..n as u32).filter(|r| r % 2 == me as u32 % 2).collect();
            assert_eq!(gathered, same_half);
            assert_eq!(max, [*same_half.last().unwrap() as i32]);
            assert_eq!(scanned, [me as u64 + 1]);
        }
    }
}

/// A dropped collective future does not withdraw the rank's part: the others still finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_collective_future_does_not_cancel_it() {
    let results = job_with(6, &Config::default(), |comm| async move {
        let data = if comm.rank() == 0 {
            b"still delivered".to_vec()
        } else {
            Vec::new()
        };
        let op = comm.broadcast(0, data);
        if comm.rank() == 1 {
            // Rank 1 forwards to ranks 3 and 5 in the binomial tree; it loses interest.
            drop(op);
            comm.barrier().await?;
            return Ok(None);
        }
        let got = op.await?;
        comm.barrier().await?;
        Ok::<_, Error>(Some(got))
    })
    .await;
    for (r, got) in results.into_iter().enumerate() {
        match got.unwrap() {
            Some(b) => assert_eq!(&b[..], b"still delivered", "rank {r}"),
            None => assert_eq!(r, 1),
        }
    }
}

/// Every collective on 256 ranks, checked against what it must compute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_collective_on_256_ranks() {
    let n = 256;
    let results = job_with(n, &Config::default(), move |comm| async move {
        let me = comm.rank();
        let root = 97;
        comm.barrier().await?;
        let b = comm.broadcast(root, vec![me as u8; 300]).await?;
        assert_eq!(&b[..], &[root as u8; 300][..]);
        let r = comm.reduce(root, &[me as u64, 1], Op::Sum).await?;
        assert_eq!(r.is_some(), me == root);
        let a = comm.all_reduce(&[me as u32], Op::Max).await?;
        assert_eq!(a, [n as u32 - 1]);
        let g = comm.gather(root, &[me as u16]).await?;
        if let Some(g) = &g {
            assert_eq!(*g, (0..n as u16).collect::<Vec<_>>());
        }
        let s = comm
            .scatter(root, &(0..2 * n as u32).collect::<Vec<_>>())
            .await?;
        assert_eq!(s, [2 * me as u32, 2 * me as u32 + 1]);
        let ag = comm.all_gather(&[me as u32]).await?;
        assert_eq!(ag, (0..n as u32).collect::<Vec<_>>());
        let sendbuf: Vec<u32> = (0..n as u32).map(|d| (me as u32) * 1000 + d).collect();
        let at = comm.all_to_all(&sendbuf).await?;
        let expect: Vec<u32> = (0..n as u32).map(|s| s * 1000 + me as u32).collect();
        assert_eq!(at, expect);
        let rs = comm.reduce_scatter(&vec![1u32; 2 * n], Op::Sum).await?;
        assert_eq!(rs, [n as u32, n as u32]);
        // Affine maps x ↦ a·x + b composed in rank order: not commutative.
        let compose = UserOp::non_commutative(|lower: &[u64], inout: &mut [u64]| {
            for (l, o) in lower.chunks_exact(2).zip(inout.chunks_exact_mut(2)) {
                let (a, b, c, d) = (l[0], l[1], o[0], o[1]);
                o[0] = a.wrapping_mul(c);
                o[1] = a.wrapping_mul(d).wrapping_add(b);
            }
        });
        let mine = [me as u64 % 3 + 1, me as u64];
        let sc = comm.scan(&mine, compose.clone()).await?;
        let ex = comm.exscan(&mine, compose).await?;
        Ok::<_, Error>((r, sc, ex))
    })
    .await;
    // Sequential reference of the affine composition.
    let fold = |upto: usize| {
        (0..upto).fold((1u64, 0u64), |(a, b), r| {
            let (c, d) = (r as u64 % 3 + 1, r as u64);
            (a.wrapping_mul(c), a.wrapping_mul(d).wrapping_add(b))
        })
    };
    for (me, res) in results.into_iter().enumerate() {
        let (r, sc, ex) = res.unwrap();
        if let Some(r) = r {
            assert_eq!(r, [(0..n as u64).sum::<u64>(), n as u64]);
        }
        let (a, b) = fold(me + 1);
        assert_eq!(sc, [a, b], "scan at rank {me}");
        match ex {
            None => assert_eq!(me, 0),
            Some(ex) => {
                let (a, b) = fold(me);
                assert_eq!(ex, [a, b], "exscan at rank {me}");
            }
        }
    }
}

/// A collective whose inputs are already there finishes at the call, without a task: alone in
/// its communicator, or the second rank of a barrier whose peer's message has arrived. One
/// whose part comes down to a receive (a two-rank barrier) waits for it where it is polled;
/// one with rounds to forward runs as a task. All complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collective_with_its_inputs_here_finishes_at_the_call() {
    let comms = rankweave_transports::inproc::world(1, &Config::default()).expect("world");
    let op = comms[0].all_reduce(&[5u32], Op::Sum);
    assert!(format!("{op:?}").contains("ready"), "{op:?}");
    assert_eq!(op.await.expect("all_reduce"), vec![5]);

    let comms = rankweave_transports::inproc::world(2, &Config::default()).expect("world");
    let early = comms[0].barrier();
    assert!(format!("{early:?}").contains("receiving"), "{early:?}");
    // Rank 0's call sent its barrier message into rank 1's mailbox (in-process sends are
    // synchronous), so rank 1's barrier has all it needs at the call.
    let late = comms[1].barrier();
    assert!(format!("{late:?}").contains("ready"), "{late:?}");
    late.await.expect("barrier");
    early.await.expect("barrier");

    // A small broadcast on 4 ranks (a flat fan-out): the root's sends went at its call, so
    // every other rank's broadcast takes its data at the call.
    let comms = rankweave_transports::inproc::world(4, &Config::default()).expect("world");
    let root = comms[2].broadcast(2, Bytes::from_static(b"flat"));
    assert!(format!("{root:?}").contains("ready"), "{root:?}");
    for r in [0, 1, 3] {
        let leaf = comms[r].broadcast(2, Bytes::new());
        assert!(format!("{leaf:?}").contains("ready"), "rank {r}: {leaf:?}");
        assert_eq!(leaf.await.expect("broadcast"), Bytes::from_static(b"flat"));
    }
    root.await.expect("broadcast");

    let comms = rankweave_transports::inproc::world(3, &Config::default()).expect("world");
    let first = comms[0].barrier();
    assert!(format!("{first:?}").contains("running"), "{first:?}");
    let rest = [comms[1].barrier(), comms[2].barrier()];
    first.await.expect("barrier");
    for op in rest {
        op.await.expect("barrier");
    }
}

/// Dropping a collective whose part was down to one receive (a two-rank barrier and
/// all-reduce) before its message came does not leave that message behind: it is still taken,
/// so nothing is left unexpected or posted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_receiving_collective_still_takes_its_message() {
    let results = job_with(2, &Config::default(), |comm| async move {
        let dropping = comm.rank() == 0;
        if !dropping {
            // Rank 0's calls come first: they wait for these messages.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let barrier = comm.barrier();
        let sum = comm.all_reduce(&[1u32], Op::Sum);
        if dropping {
            assert!(format!("{barrier:?}").contains("receiving"), "{barrier:?}");
            assert!(format!("{sum:?}").contains("receiving"), "{sum:?}");
            drop((barrier, sum));
        } else {
            barrier.await?;
            assert_eq!(sum.await?, [2]);
        }
        // Sent after the three above, so they have all arrived once this is done.
        left_behind(&comm).await
    })
    .await;
    assert_nothing_left_behind(results);
}

/// After a barrier (which every earlier message has arrived before): the messages left
/// unexpected and the receives left posted.
async fn left_behind(comm: &Communicator) -> Result<(u64, u64), Error> {
    comm.barrier().await?;
    let stats = comm.stats();
    Ok((stats.unexpected_messages, stats.posted_receives))
}

fn assert_nothing_left_behind(results: Vec<Result<(u64, u64), Error>>) {
    for (rank, r) in results.into_iter().enumerate() {
        assert_eq!(
            r.unwrap(),
            (0, 0),
            "rank {rank}: messages left unexpected or posted"
        );
    }
}

/// The same for a linear all-to-all (4 ranks, small blocks), whose receives are left to run
/// where its future is polled: dropped before its messages came, it still takes them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_linear_all_to_all_still_takes_its_messages() {
    let results = job_with(4, &Config::default(), |comm| async move {
        let dropping = comm.rank() == 0;
        if !dropping {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let blocks: Vec<u32> = (0..4).map(|to| (comm.rank() * 10 + to) as u32).collect();
        let swapped = comm.all_to_all(&blocks);
        if dropping {
            assert!(format!("{swapped:?}").contains("inline"), "{swapped:?}");
            drop(swapped);
        } else {
            let want: Vec<u32> = (0..4)
                .map(|from| (from * 10 + comm.rank()) as u32)
                .collect();
            let mut swapped = swapped;
            assert_eq!((&mut swapped).await?, want);
            // Finished: dropping it leaves nothing to run on (its `async` block is done).
            assert!(format!("{swapped:?}").contains("ready"), "{swapped:?}");
        }
        left_behind(&comm).await
    })
    .await;
    assert_nothing_left_behind(results);
}

/// A small broadcast's root does its whole part where it is called (its sends go out eagerly):
/// the future it returns is finished before it is polled. With the sends forced to rendezvous
/// (no eager data at all) the root waits for its children as any send does (finished at once
/// only if they happened to answer during its first look). Either way every rank gets the
/// data, on 2, 4 and 5 ranks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_broadcast_root_finishes_where_it_is_called() {
    for eager in [true, false] {
        let mut config = Config::default();
        if !eager {
            config.eager_limit = 0;
        }
        for n in [2, 4, 5] {
            let results = job_with(n, &config, move |comm| async move {
                let root = n - 1;
                let data = if comm.rank() == root {
                    b"eight by".to_vec()
                } else {
                    Vec::new()
                };
                let op = comm.broadcast(root, data);
                let at_once = format!("{op:?}").contains("\"ready\"");
                let got = op.await?;
                assert_eq!(&got[..], b"eight by");
                Ok::<_, Error>((comm.rank() == root, at_once))
            })
            .await;
            for r in results {
                let (is_root, at_once) = r.unwrap();
                if is_root && eager {
                    assert!(at_once, "{n} ranks: the root's future was not finished");
                }
            }
        }
    }
}

/// A two-rank collective whose part is one receive fails with `PeerFailed` when the other rank
/// is gone, instead of waiting for a message that cannot come: posted before the other rank
/// left or after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiving_collective_fails_when_its_peer_is_gone() {
    let results = job_within(
        2,
        &Config::default(),
        Duration::from_secs(20),
        |comm| async move {
            if comm.rank() == 1 {
                // Leaves at once: its communicator is dropped and its transport closed.
                tokio::time::sleep(Duration::from_millis(50)).await;
                return Vec::new();
            }
            let early = comm.barrier();
            tokio::time::sleep(Duration::from_millis(200)).await;
            let gone = |r: Result<(), Error>| r == Err(Error::PeerFailed { rank: 1 });
            vec![
                gone(early.await),
                gone(comm.barrier().await),
                gone(comm.all_reduce(&[1u32], Op::Sum).await.map(drop)),
                gone(comm.reduce(0, &[1u32], Op::Sum).await.map(drop)),
                gone(comm.all_gather(&[1u32]).await.map(drop)),
                gone(comm.all_to_all(&[1u32, 2]).await.map(drop)),
            ]
        },
    )
    .await;
    assert_eq!(
        results[0], [true; 6],
        "barrier (posted before), barrier, all_reduce, reduce, all_gather, all_to_all"
    );
}
