//! Barrier and broadcast over in-process ranks, checked against what they must do.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use rankweave_collectives::Collectives;
use rankweave_core::tuning::BarrierAlgorithm;
use rankweave_core::{Config, Error};

mod common;
use common::{job, job_with};

fn pattern(len: usize, seed: u8) -> Bytes {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect::<Vec<u8>>()
        .into()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn barrier_holds_every_rank_until_all_arrive() {
    for n in [1, 2, 3, 5, 8, 13, 17] {
        let arrived = Arc::new(AtomicUsize::new(0));
        let seen = job(n, move |comm| {
            let arrived = Arc::clone(&arrived);
            async move {
                // Ranks arrive at different times; nobody may leave before the last arrives.
                tokio::time::sleep(Duration::from_millis(comm.rank() as u64 % 3)).await;
                arrived.fetch_add(1, Ordering::SeqCst);
                comm.barrier().await?;
                Ok::<_, Error>(arrived.load(Ordering::SeqCst))
            }
        })
        .await;
        for (rank, s) in seen.into_iter().enumerate() {
            assert_eq!(s.unwrap(), n, "rank {rank} of {n} left the barrier early");
        }
    }
}

/// Both barrier algorithms at every size they may see: linear (the default up to 7 ranks)
/// and dissemination (the default above), each forced over the other's range too, and on two
/// ranks, where the default is one exchange; rounds
/// after rounds, so that a rank released early by a stale message would show.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn barrier_by_either_algorithm_holds_every_rank() {
    for algorithm in [BarrierAlgorithm::Linear, BarrierAlgorithm::Dissemination] {
        let mut config = Config::default();
        config.collectives.barrier = Some(algorithm);
        for n in [2, 3, 4, 7, 8, 13] {
            let arrived = Arc::new(AtomicUsize::new(0));
            let seen = job_with(n, &config, move |comm| {
                let arrived = Arc::clone(&arrived);
                async move {
                    let mut seen = Vec::new();
                    for round in 1..=5 {
                        // A different rank is late in each round.
                        if comm.rank() == round % comm.size() {
                            tokio::time::sleep(Duration::from_millis(2)).await;
                        }
                        arrived.fetch_add(1, Ordering::SeqCst);
                        comm.barrier().await?;
                        seen.push(arrived.load(Ordering::SeqCst) >= round * comm.size());
                        // Nobody may enter the next round before everyone has looked.
                        comm.barrier().await?;
                    }
                    Ok::<_, Error>(seen)
                }
            })
            .await;
            for (rank, s) in seen.into_iter().enumerate() {
                assert!(
                    s.unwrap().into_iter().all(|ok| ok),
                    "{algorithm:?}: rank {rank} of {n} left a barrier early"
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broadcast_from_every_root_and_size() {
    for n in [1, 2, 3, 4, 7, 8, 17] {
        for root in 0..n {
            for len in [0usize, 1, 1000, 200_000] {
                let expected = pattern(len, root as u8);
                let want = expected.clone();
                let got = job(n, move |comm| {
                    let data = if comm.rank() == root {
                        want.clone()
                    } else {
                        Bytes::new()
                    };
                    async move { comm.broadcast(root, data).await }
                })
                .await;
                for (rank, g) in got.into_iter().enumerate() {
                    assert_eq!(
                        g.unwrap(),
                        expected,
                        "n={n} root={root} len={len} rank={rank}"
                    );
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collectives_in_flight_on_two_communicators_do_not_mix() {
    let got = job(6, |comm| async move {
        let twin = comm.dup().await?;
        // Start both broadcasts before awaiting either: they run concurrently, told apart by
        // their communicators' contexts; the barriers interleave too.
        let a = comm.broadcast(0, pattern(5000, 1));
        let b = twin.broadcast(5, pattern(300, 2));
        let (x, y) = tokio::join!(comm.barrier(), twin.barrier());
        x?;
        y?;
        Ok::<_, Error>((a.await?, b.await?))
    })
    .await;
    for g in got {
        let (a, b) = g.unwrap();
        assert_eq!(a, pattern(5000, 1));
        assert_eq!(b, pattern(300, 2));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collectives_ignore_user_point_to_point_traffic() {
    let got = job(4, |comm| async move {
        // User messages with every tag in flight: a wildcard user receive must not see
        // collective traffic, and collectives must not consume user messages.
        let next = (comm.rank() + 1) % comm.size();
        let user = comm.send(next, 0, vec![comm.rank() as u8]);
        let data = comm.broadcast(2, pattern(64, 9)).await?;
        comm.barrier().await?;
        let msg = comm
            .recv(rankweave_core::Source::Any, rankweave_core::Tag::Any)
            .await?;
        user.await?;
        Ok::<_, Error>((data, msg.source(), msg.data().clone()))
    })
    .await;
    for (rank, g) in got.into_iter().enumerate() {
        let (data, source, payload) = g.unwrap();
        let prev = (rank + 3) % 4;
        assert_eq!(data, pattern(64, 9));
        assert_eq!(source, prev);
        assert_eq!(&payload[..], &[prev as u8]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broadcast_rejects_an_invalid_root() {
    let got = job(
        3,
        |comm| async move { comm.broadcast(3, Bytes::new()).await },
    )
    .await;
    for g in got {
        assert_eq!(g, Err(Error::InvalidRank { rank: 3, size: 3 }));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_communicators_run_their_own_collectives() {
    let got = job(7, |comm| async move {
        let half = comm
            .split(Some((comm.rank() % 2) as u32), 0)
            .await?
            .expect("every rank has a color");
        let root_data = pattern(100, half.size() as u8);
        let data = half
            .broadcast(
                0,
                if half.rank() == 0 {
                    root_data
                } else {
                    Bytes::new()
                },
            )
            .await?;
        half.barrier().await?;
        Ok::<_, Error>((half.size(), data))
    })
    .await;
    for (rank, g) in got.into_iter().enumerate() {
        let (size, data) = g.unwrap();
        let expected_size = if rank % 2 == 0 { 4 } else { 3 };
        assert_eq!(size, expected_size);
        assert_eq!(data, pattern(100, expected_size as u8));
    }
}

/// The barrier through shared-memory flags holds every rank, on 1 to 7 ranks (one exchange
/// of flags on 2, linear through rank 0 on more), with a different rank late each round —
/// long enough that the others stop spinning and park until the flag wakes them — and
/// with several barriers in a row, so that a flag left from an earlier round would show. It is
/// the automatic choice there (a world of shared-memory ranks, up to `flat_max`) as well as
/// forced, and sends no message either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_flag_barrier_holds_every_rank() {
    for forced in [None, Some(BarrierAlgorithm::Flags)] {
        let mut config = Config {
            transport: rankweave_core::TransportKind::Shm,
            ..Default::default()
        };
        config.collectives.barrier = forced;
        // Parking soon, so that waiting for the late rank sleeps on the doorbell.
        config.spin = Some(Duration::from_micros(50));
        for n in [1, 2, 3, 4, 7] {
            let arrived = Arc::new(AtomicUsize::new(0));
            let seen = job_with(n, &config, move |comm| {
                let arrived = Arc::clone(&arrived);
                async move {
                    let mut seen = Vec::new();
                    let sent = comm.stats().frames_sent;
                    for round in 1..=6 {
                        if comm.rank() == round % comm.size() {
                            tokio::time::sleep(Duration::from_millis(3)).await;
                        }
                        arrived.fetch_add(1, Ordering::SeqCst);
                        comm.barrier().await?;
                        seen.push(arrived.load(Ordering::SeqCst) >= round * comm.size());
                        comm.barrier().await?;
                    }
                    Ok::<_, Error>((seen, comm.stats().frames_sent - sent))
                }
            })
            .await;
            for (rank, s) in seen.into_iter().enumerate() {
                let (seen, frames) = s.unwrap();
                assert!(
                    seen.into_iter().all(|ok| ok),
                    "rank {rank} of {n} left a flag barrier early ({forced:?})"
                );
                assert_eq!(frames, 0, "rank {rank} of {n} sent messages ({forced:?})");
            }
        }
    }
}

/// A forced flag barrier where it cannot run — a communicator other than the world, or no
/// shared memory — runs the automatic one instead, on every rank alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_flag_barrier_stands_aside_where_it_cannot_run() {
    for transport in [
        rankweave_core::TransportKind::Shm,
        rankweave_core::TransportKind::Inproc,
    ] {
        let mut config = Config {
            transport,
            ..Default::default()
        };
        config.collectives.barrier = Some(BarrierAlgorithm::Flags);
        let results = job_with(4, &config, |comm| async move {
            comm.barrier().await?;
            // Halves, then a duplicate of the world: not the world's context.
            let half = comm
                .split(Some((comm.rank() % 2) as u32), 0)
                .await?
                .expect("member");
            for _ in 0..3 {
                half.barrier().await?;
            }
            let dup = comm
                .split(Some(0), comm.rank() as i32)
                .await?
                .expect("member");
            dup.barrier().await?;
            comm.barrier().await
        })
        .await;
        for r in results {
            r.unwrap();
        }
    }
}

/// The collectives over shared-memory segments (ranks of this process talking exactly as
/// processes would): broadcast from every root, all-reduce, all-to-all and barrier, sizes that
/// go inline, by single copy and across ring wrap-arounds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collectives_over_shared_memory_match_the_reference() {
    use rankweave_collectives::Op;
    let config = rankweave_core::Config {
        transport: rankweave_core::TransportKind::Shm,
        ..Default::default()
    };
    for n in [1usize, 2, 3, 5, 8] {
        for len in [0usize, 3, 5000, 300_000] {
            let got = common::job_with(n, &config, move |comm| async move {
                let me = comm.rank();
                let mut bcasts = Vec::new();
                for root in 0..comm.size() {
                    let data = if me == root {
                        pattern(len, root as u8)
                    } else {
                        Bytes::new()
                    };
                    bcasts.push(comm.broadcast(root, data).await?);
                }
                let mine: Vec<u64> = (0..len as u64).map(|i| i * 7 + me as u64).collect();
                let sum = comm.all_reduce(&mine, Op::Sum).await?;
                let blocks: Vec<u32> = (0..comm.size() * 4)
                    .map(|i| (me * 1000 + i) as u32)
                    .collect();
                let swapped = comm.all_to_all(&blocks).await?;
                comm.barrier().await?;
                Ok::<_, Error>((bcasts, sum, swapped))
            })
            .await;
            for (rank, r) in got.into_iter().enumerate() {
                let (bcasts, sum, swapped) = r.unwrap();
                for (root, b) in bcasts.iter().enumerate() {
                    assert_eq!(b, &pattern(len, root as u8), "n={n} len={len} root={root}");
                }
                let want: Vec<u64> = (0..len as u64)
                    .map(|i| i * 7 * n as u64 + (0..n as u64).sum::<u64>())
                    .collect();
                assert_eq!(sum, want, "all_reduce n={n} len={len} rank={rank}");
                let want: Vec<u32> = (0..n)
                    .flat_map(|from| (0..4).map(move |k| (from * 1000 + rank * 4 + k) as u32))
                    .collect();
                assert_eq!(swapped, want, "all_to_all n={n} rank={rank}");
            }
        }
    }
}
