//! The data-movement collectives — broadcast, gather(v), scatter(v), all_gather(v) and
//! all_to_all(v) — over in-process ranks, checked against sequential references. Every algorithm
//! is forced through the configuration and run on power-of-two and other sizes, with every root,
//! tiny pipeline segments and a small eager limit (so rendezvous sends are exercised too).

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rankweave_collectives::{CollectiveOp, Collectives, Element};
use rankweave_core::tuning::{
    AllgatherAlgorithm, AlltoallAlgorithm, BcastAlgorithm, CollectiveTuning,
};
use rankweave_core::{Communicator, Config, Error};

mod common;
use common::{job_with as job, job_within};

/// Communicator sizes every algorithm runs on: every size up to 17 (powers of two and not) and
/// 64.
fn sizes() -> impl Iterator<Item = usize> {
    (1..=17).chain([64])
}

/// A configuration with a small eager limit (rendezvous from 200 bytes) and tuning edited by
/// `edit`.
fn tuned(edit: impl FnOnce(&mut CollectiveTuning)) -> Config {
    let mut config = Config {
        eager_limit: 200,
        ..Config::default()
    };
    edit(&mut config.collectives);
    config
}

/// Element types the tests use, with a deterministic value per (index, seed).
trait Sample: Element + PartialEq + Debug {
    fn sample(i: usize, seed: usize) -> Self;
}

impl Sample for u8 {
    fn sample(i: usize, seed: usize) -> u8 {
        (i.wrapping_mul(31) ^ seed.wrapping_mul(97)) as u8
    }
}

impl Sample for u32 {
    fn sample(i: usize, seed: usize) -> u32 {
        (i as u32).wrapping_mul(2_654_435_761) ^ (seed as u32).wrapping_mul(40_503)
    }
}

impl Sample for f64 {
    fn sample(i: usize, seed: usize) -> f64 {
        i as f64 * 0.25 - seed as f64 * 1000.5
    }
}

fn values<T: Sample>(count: usize, seed: usize) -> Vec<T> {
    (0..count).map(|i| T::sample(i, seed)).collect()
}

fn pattern(len: usize, seed: usize) -> Bytes {
    values::<u8>(len, seed).into()
}

/// A seed naming one contribution: case `case`, from rank `from`, for rank `to`.
fn seed(case: usize, from: usize, to: usize) -> usize {
    case * 10_007 + from * 101 + to
}

// ---------------------------------------------------------------------------------------------
// Broadcast

/// Broadcasts, on one `n`-rank job, a message of every length in `lens` from every root in
/// `roots` (one after the other), and checks every rank got the root's bytes.
/// Broadcasts every (root, length) pair of `roots` × `lens` on `n` ranks and checks every
/// rank's bytes. Rank `late`, if any, starts each broadcast 5 ms after the others.
async fn check_broadcast(
    n: usize,
    config: &Config,
    roots: Vec<usize>,
    lens: &[usize],
    late: Option<usize>,
) {
    let cases: Vec<(usize, usize)> = roots
        .iter()
        .flat_map(|&root| lens.iter().map(move |&len| (root, len)))
        .collect();
    let shared = Arc::new(cases.clone());
    let got = job(n, config, move |comm| {
        let cases = Arc::clone(&shared);
        async move {
            let mut out = Vec::new();
            for &(root, len) in cases.iter() {
                if Some(comm.rank()) == late {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                // Non-roots pass junk: it must be ignored.
                let data = if comm.rank() == root {
                    pattern(len, root)
                } else {
                    Bytes::from_static(b"ignored")
                };
                out.push(comm.broadcast(root, data).await?);
            }
            Ok::<_, Error>(out)
        }
    })
    .await;
    for (rank, got) in got.into_iter().enumerate() {
        let got = got.unwrap_or_else(|e| panic!("n={n} rank={rank}: {e}"));
        for (&(root, len), data) in cases.iter().zip(got) {
            assert!(
                data == pattern(len, root),
                "broadcast n={n} root={root} len={len} rank={rank}: wrong data"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broadcast_by_every_algorithm_from_every_root() {
    let algorithms = [
        Some(BcastAlgorithm::Binomial),
        Some(BcastAlgorithm::ScatterAllgather),
        Some(BcastAlgorithm::Chain),
        None,
    ];
    for algorithm in algorithms {
        // With tiny thresholds the automatic choice takes all three algorithms over `lens`.
        let config = tuned(|t| {
            t.bcast = algorithm;
            t.segment = 64;
            t.bcast_large = 40;
            t.bcast_min_ranks = 3;
            t.bcast_chain = 500;
        });
        for n in sizes() {
            let lens: &[usize] = if n > 17 {
                &[0, 1, 300, 1001]
            } else {
                &[0, 1, 5, 63, 64, 300, 1001]
            };
            check_broadcast(n, &config, (0..n).collect(), lens, None).await;
        }
    }
}

/// The two fan-outs of a broadcast's first message — from the root to everyone (flat) and down
/// the binomial tree — at every size, with data after the header, apart down the tree and
/// apart straight from the root (`FLAT_BODY_BELOW`), eager and rendezvous.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broadcast_fans_out_flat_or_down_the_tree() {
    use rankweave_collectives::{FLAT_BODY_BELOW, SEPARATE_FROM};
    for flat_max in [0, 64] {
        let config = tuned(|t| t.flat_max = flat_max);
        for n in (1..=9).chain([17]) {
            let lens = [
                0,
                1,
                300,
                SEPARATE_FROM,
                FLAT_BODY_BELOW - 1,
                FLAT_BODY_BELOW + 3,
            ];
            check_broadcast(n, &config, vec![0, n / 2, n - 1], &lens, None).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broadcast_of_a_megabyte() {
    let mib = 1 << 20;
    let configs = [
        tuned(|t| t.bcast = Some(BcastAlgorithm::Binomial)),
        tuned(|t| t.bcast = Some(BcastAlgorithm::ScatterAllgather)),
        tuned(|t| {
            t.bcast = Some(BcastAlgorithm::Chain);
            t.segment = 1000;
        }),
        // Default eager limit and segment (rendezvous segments of 128 KiB).
        {
            let mut c = Config::default();
            c.collectives.bcast = Some(BcastAlgorithm::Chain);
            c
        },
        Config::default(),
    ];
    for config in &configs {
        for n in [2, 3, 5, 8] {
            check_broadcast(n, config, vec![0, n - 1], &[mib, mib + 3], None).await;
        }
    }
}

/// Every broadcast algorithm (the automatic choice, scatter + allgather, chain) over in-process
/// hand-off and shared memory, with 4 KiB chain segments.
fn every_bcast_config() -> Vec<Config> {
    use rankweave_core::TransportKind;
    let algorithms = [
        None,
        Some(BcastAlgorithm::ScatterAllgather),
        Some(BcastAlgorithm::Chain),
    ];
    [TransportKind::Inproc, TransportKind::Shm]
        .into_iter()
        .flat_map(|transport| {
            algorithms.into_iter().map(move |algorithm| {
                let mut config = tuned(|t| {
                    t.bcast = algorithm;
                    t.segment = 4096;
                });
                config.transport = transport;
                config
            })
        })
        .collect()
}

/// Two ranks take their own path (the root sends at the call; the other rank takes a message
/// already there at the call, or leaves it to a task): every size and algorithm, the root
/// first or the other rank first, over in-process hand-off and shared memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_rank_broadcasts_whichever_rank_comes_first() {
    use rankweave_collectives::SEPARATE_FROM;
    let lens = [
        0,
        1,
        8,
        SEPARATE_FROM - 2,
        SEPARATE_FROM - 1,
        SEPARATE_FROM,
        300_000,
    ];
    for config in every_bcast_config() {
        for late in [0, 1] {
            check_broadcast(2, &config, vec![0, 1], &lens, Some(late)).await;
        }
    }
}

/// On up to `flat_max` ranks every non-root takes its first message straight from the root, as
/// the other rank of two does (at the call when it is there, else in a task): 3, 4 and 7 ranks,
/// every root, every algorithm, with the root or another rank late, over in-process hand-off
/// and shared memory; and 8 ranks (a tree) alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flat_broadcasts_whichever_rank_comes_first() {
    use rankweave_collectives::SEPARATE_FROM;
    let lens = [0, 8, SEPARATE_FROM - 2, SEPARATE_FROM, 300_000];
    for config in every_bcast_config() {
        for n in [3, 4, 7, 8] {
            for late in [None, Some(0), Some(n - 1)] {
                check_broadcast(n, &config, (0..n).collect(), &lens, late).await;
            }
        }
    }
}

/// The non-root of a two-rank broadcast that starts it before the data is there and then does
/// not poll it for a long time: its part still runs (the root, sending a message past the eager
/// limit, finishes long before), and the data is there when it looks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_polling_leaf_of_two_does_not_hold_up_the_root() {
    let late = Duration::from_millis(1500);
    let config = tuned(|_| {});
    let times = job(2, &config, move |comm| async move {
        let t0 = std::time::Instant::now();
        let data = pattern(100_000, 0);
        if comm.rank() == 0 {
            // The other rank's broadcast is started (and not polled) by now.
            tokio::time::sleep(Duration::from_millis(50)).await;
            comm.broadcast(0, data).await?;
        } else {
            let op = comm.broadcast(0, Bytes::new());
            tokio::time::sleep(late).await;
            assert!(op.await? == data);
        }
        Ok::<_, Error>(t0.elapsed())
    })
    .await;
    let times: Vec<Duration> = times.into_iter().map(Result::unwrap).collect();
    assert!(times[1] >= late);
    assert!(
        times[0] < late / 3,
        "the root waited {:?} for the other rank to look",
        times[0]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broadcast_rejects_an_invalid_root() {
    let got = job(4, &Config::default(), |comm| async move {
        comm.broadcast(4, Bytes::from_static(b"x")).await
    })
    .await;
    for g in got {
        assert_eq!(g, Err(Error::InvalidRank { rank: 4, size: 4 }));
    }
}

// ---------------------------------------------------------------------------------------------
// Gather and scatter

/// Count of rank `rank`'s block in v-variant case `case` (zero for some ranks).
fn v_count(case: usize, rank: usize, other: usize) -> usize {
    (rank * 3 + other * 7 + case) % 5
}

async fn check_gathers<T: Sample>(n: usize, counts: &[usize]) {
    let counts = Arc::new(counts.to_vec());
    let shared = Arc::clone(&counts);
    let got = job(n, &tuned(|_| {}), move |comm| {
        let counts = Arc::clone(&shared);
        async move {
            let me = comm.rank();
            let mut plain = Vec::new();
            let mut varied = Vec::new();
            for root in 0..comm.size() {
                for (case, &count) in counts.iter().enumerate() {
                    let data: Vec<T> = values(count, seed(case, me, root));
                    plain.push(comm.gather(root, &data).await?);
                    let data: Vec<T> = values(v_count(case, me, root), seed(case, me, root));
                    varied.push(comm.gatherv(root, &data).await?);
                }
            }
            Ok::<_, Error>((plain, varied))
        }
    })
    .await;
    for (rank, got) in got.into_iter().enumerate() {
        let (plain, varied) = got.unwrap_or_else(|e| panic!("n={n} rank={rank}: {e}"));
        let mut plain = plain.into_iter();
        let mut varied = varied.into_iter();
        for root in 0..n {
            for (case, &count) in counts.iter().enumerate() {
                let (p, v) = (plain.next().unwrap(), varied.next().unwrap());
                if rank != root {
                    assert!(p.is_none() && v.is_none(), "n={n} root={root} rank={rank}");
                    continue;
                }
                let want: Vec<T> = (0..n)
                    .flat_map(|r| values::<T>(count, seed(case, r, root)))
                    .collect();
                assert_eq!(p.unwrap(), want, "gather n={n} root={root} count={count}");
                let want: Vec<Vec<T>> = (0..n)
                    .map(|r| values(v_count(case, r, root), seed(case, r, root)))
                    .collect();
                assert_eq!(v.unwrap(), want, "gatherv n={n} root={root} case={case}");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gather_and_gatherv_at_every_root() {
    for n in sizes() {
        check_gathers::<u8>(n, &[0, 1, 7]).await;
        check_gathers::<f64>(n, &[3, 300]).await;
    }
}

async fn check_scatters<T: Sample>(n: usize, counts: &[usize]) {
    let counts = Arc::new(counts.to_vec());
    let shared = Arc::clone(&counts);
    let got = job(n, &tuned(|_| {}), move |comm| {
        let counts = Arc::clone(&shared);
        async move {
            let (me, n) = (comm.rank(), comm.size());
            let mut out = Vec::new();
            for root in 0..n {
                for (case, &count) in counts.iter().enumerate() {
                    let (data, blocks): (Vec<T>, Vec<Vec<T>>) = if me == root {
                        (
                            (0..n)
                                .flat_map(|r| values::<T>(count, seed(case, root, r)))
                                .collect(),
                            (0..n)
                                .map(|r| values(v_count(case, r, root), seed(case, root, r)))
                                .collect(),
                        )
                    } else {
                        (Vec::new(), Vec::new())
                    };
                    out.push(comm.scatter(root, &data).await?);
                    out.push(comm.scatterv(root, blocks).await?);
                }
            }
            Ok::<_, Error>(out)
        }
    })
    .await;
    for (rank, got) in got.into_iter().enumerate() {
        let mut got = got
            .unwrap_or_else(|e| panic!("n={n} rank={rank}: {e}"))
            .into_iter();
        for root in 0..n {
            for (case, &count) in counts.iter().enumerate() {
                let want: Vec<T> = values(count, seed(case, root, rank));
                assert_eq!(
                    got.next().unwrap(),
                    want,
                    "scatter n={n} root={root} rank={rank}"
                );
                let want: Vec<T> = values(v_count(case, rank, root), seed(case, root, rank));
                assert_eq!(
                    got.next().unwrap(),
                    want,
                    "scatterv n={n} root={root} rank={rank}"
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scatter_and_scatterv_from_every_root() {
    for n in sizes() {
        check_scatters::<u8>(n, &[0, 1, 7]).await;
        check_scatters::<u32>(n, &[3, 300]).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gather_with_differing_counts_fails_at_the_root() {
    for n in [2, 3, 5, 8] {
        for root in [0, n - 1] {
            let got = job_within(
                n,
                &Config::default(),
                Duration::from_secs(10),
                move |comm| {
                    let count = if comm.rank() == 1 { 4 } else { 3 };
                    async move { comm.gather(root, &vec![7u32; count]).await }
                },
            )
            .await;
            for (rank, g) in got.into_iter().enumerate() {
                if rank == root {
                    assert!(
                        matches!(g, Err(Error::InvalidArgument(_))),
                        "n={n} root={root}: {g:?}"
                    );
                } else {
                    assert_eq!(g, Ok(None), "n={n} root={root} rank={rank}");
                }
            }
        }
    }
}

/// A root whose data does not split into equal blocks (`scatter`), or who passes the wrong
/// number of blocks (`scatterv`), fails — and so does every other rank, rather than wait for a
/// block that will not come; the ranks stay in step for the next collective.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scatter_the_root_refuses_fails_everywhere() {
    for n in [2, 3, 5, 8] {
        for root in [0, n - 1] {
            let got = job_within(
                n,
                &Config::default(),
                Duration::from_secs(10),
                move |comm| async move {
                    let me = comm.rank();
                    let uneven = comm.scatter(root, &vec![1u32; 2 * n + 1]).await;
                    let short = comm.scatterv(root, vec![vec![1u32]; n - 1]).await;
                    let next = comm.gather(0, &[me as u8]).await;
                    (uneven, short, next)
                },
            )
            .await;
            for (rank, (uneven, short, next)) in got.into_iter().enumerate() {
                let what = format!("n={n} root={root} rank={rank}");
                assert!(
                    matches!(uneven, Err(Error::InvalidArgument(_))),
                    "{what}: {uneven:?}"
                );
                assert!(
                    matches!(short, Err(Error::InvalidArgument(_))),
                    "{what}: {short:?}"
                );
                let all = (rank == 0).then(|| (0..n as u8).collect::<Vec<_>>());
                assert_eq!(next, Ok(all), "{what}: the next collective");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rooted_collectives_reject_an_invalid_root() {
    let got = job(3, &Config::default(), |comm| async move {
        let bad = Error::InvalidRank { rank: 3, size: 3 };
        assert_eq!(comm.gather(3, &[1u8]).await, Err(bad.clone()));
        assert_eq!(comm.gatherv(3, &[1u8]).await, Err(bad.clone()));
        assert_eq!(comm.scatter(3, &[1u8, 2, 3]).await, Err(bad.clone()));
        assert_eq!(comm.scatterv(3, vec![vec![1u8]; 3]).await, Err(bad.clone()));
        assert_eq!(
            comm.broadcast(7, Bytes::new()).await,
            Err(Error::InvalidRank { rank: 7, size: 3 })
        );
        // The rejected calls kept the ranks in step: the next collective still works.
        comm.gather(0, &[comm.rank() as u8]).await
    })
    .await;
    assert_eq!(got[0], Ok(Some(vec![0, 1, 2])));
}

// ---------------------------------------------------------------------------------------------
// Allgather

/// The bytes variant of a collective on `data` (`bytes`, given the data as `Bytes`), twice:
/// on every rank, then on odd ranks only while even ones call the typed variant (`typed`) in
/// the same collective. Both results as bytes.
async fn bytes_variants<T: Sample>(
    comm: &Communicator,
    data: &[T],
    typed: impl Fn(&Communicator, &[T]) -> CollectiveOp<Vec<T>>,
    bytes: impl Fn(&Communicator, Bytes) -> CollectiveOp<Vec<u8>>,
) -> Result<[Vec<u8>; 2], Error> {
    let given = Bytes::copy_from_slice(bytemuck::cast_slice(data));
    let alone = bytes(comm, given.clone()).await?;
    let mixed = if comm.rank() % 2 == 0 {
        bytemuck::cast_slice(&typed(comm, data).await?).to_vec()
    } else {
        bytes(comm, given).await?
    };
    Ok([alone, mixed])
}

async fn check_allgathers<T: Sample>(n: usize, config: &Config, counts: &[usize]) {
    let counts = Arc::new(counts.to_vec());
    let shared = Arc::clone(&counts);
    let got = job(n, config, move |comm| {
        let counts = Arc::clone(&shared);
        async move {
            let me = comm.rank();
            let mut plain = Vec::new();
            let mut raw = Vec::new();
            let mut varied = Vec::new();
            for (case, &count) in counts.iter().enumerate() {
                let data: Vec<T> = values(count, seed(case, me, 0));
                plain.push(comm.all_gather(&data).await?);
                raw.push(
                    bytes_variants(
                        &comm,
                        &data,
                        |c, d| c.all_gather(d),
                        |c, b| c.all_gather_bytes(b),
                    )
                    .await?,
                );
                let data: Vec<T> = values(v_count(case, me, 0), seed(case, me, 1));
                varied.push(comm.all_gatherv(&data).await?);
            }
            Ok::<_, Error>((plain, raw, varied))
        }
    })
    .await;
    for (rank, got) in got.into_iter().enumerate() {
        let (plain, raw, varied) = got.unwrap_or_else(|e| panic!("n={n} rank={rank}: {e}"));
        for (case, &count) in counts.iter().enumerate() {
            let want: Vec<T> = (0..n)
                .flat_map(|r| values::<T>(count, seed(case, r, 0)))
                .collect();
            assert_eq!(
                plain[case], want,
                "all_gather n={n} count={count} rank={rank}"
            );
            let want_bytes: &[u8] = bytemuck::cast_slice(&want);
            assert_eq!(
                raw[case],
                [want_bytes, want_bytes],
                "all_gather_bytes, alone and mixed, n={n} count={count} rank={rank}"
            );
            let want: Vec<Vec<T>> = (0..n)
                .map(|r| values(v_count(case, r, 0), seed(case, r, 1)))
                .collect();
            assert_eq!(
                varied[case], want,
                "all_gatherv n={n} case={case} rank={rank}"
            );
        }
    }
}

fn allgather_configs() -> Vec<Config> {
    [
        Some(AllgatherAlgorithm::RecursiveDoubling),
        Some(AllgatherAlgorithm::Bruck),
        Some(AllgatherAlgorithm::Ring),
        // In-process ranks cannot read each other's memory: every rank declines the direct
        // reads alike and the automatic message algorithm runs (the direct reads themselves are
        // checked between processes, tests/collectives_jobs.rs).
        Some(AllgatherAlgorithm::Direct),
        None,
    ]
    .into_iter()
    .map(|algorithm| {
        tuned(|t| {
            t.allgather = algorithm;
            t.allgather_large = 2000;
        })
    })
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_gather_by_every_algorithm() {
    for config in &allgather_configs() {
        for n in sizes() {
            check_allgathers::<u32>(n, config, &[0, 1, 3, 101]).await;
            check_allgathers::<u8>(n, config, &[1, 7]).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_gather_of_large_blocks() {
    let mut configs = allgather_configs();
    configs.push(Config::default());
    for config in &configs {
        for n in [3, 4, 6] {
            check_allgathers::<f64>(n, config, &[25_000]).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_gather_with_differing_counts_fails_everywhere() {
    for config in &allgather_configs() {
        for (n, calls) in [2, 3, 4, 5, 8]
            .into_iter()
            .flat_map(|n| CALLS.map(|c| (n, c)))
        {
            let got = job_within(n, config, Duration::from_secs(10), move |comm| {
                let data = vec![1u32; if comm.rank() == 1 { 5 } else { 4 }];
                async move {
                    let typed = |c: &Communicator, d: &[u32]| c.all_gather(d);
                    calls
                        .call(&comm, &data, typed, |c, b| c.all_gather_bytes(b))
                        .await
                }
            })
            .await;
            for (rank, g) in got.into_iter().enumerate() {
                assert!(
                    matches!(g, Err(Error::InvalidArgument(_))),
                    "n={n} rank={rank} {calls:?} {:?}: {g:?}",
                    config.collectives.allgather
                );
            }
        }
    }
}

/// Which ranks make the bytes call of a collective, the others the typed one.
#[derive(Clone, Copy, Debug)]
enum Calls {
    Typed,
    Bytes,
    Mixed,
}

const CALLS: [Calls; 3] = [Calls::Typed, Calls::Bytes, Calls::Mixed];

impl Calls {
    fn bytes_on(self, rank: usize) -> bool {
        match self {
            Calls::Typed => false,
            Calls::Bytes => true,
            Calls::Mixed => rank % 2 == 1,
        }
    }

    /// The typed call on `data`, or the bytes call on its bytes where this rank makes that one;
    /// whether it worked.
    async fn call(
        self,
        comm: &Communicator,
        data: &[u32],
        typed: impl Fn(&Communicator, &[u32]) -> CollectiveOp<Vec<u32>>,
        bytes: impl Fn(&Communicator, Vec<u8>) -> CollectiveOp<Vec<u8>>,
    ) -> Result<(), Error> {
        if self.bytes_on(comm.rank()) {
            let given = bytemuck::cast_slice::<u32, u8>(data).to_vec();
            bytes(comm, given).await.map(drop)
        } else {
            typed(comm, data).await.map(drop)
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Alltoall

/// Length of the block rank `from` sends rank `to` in all_to_allv case `case`.
fn v_len(case: usize, from: usize, to: usize) -> usize {
    (from * 7 + to * 3 + case) % 5
}

async fn check_alltoalls<T: Sample>(n: usize, config: &Config, counts: &[usize]) {
    let counts = Arc::new(counts.to_vec());
    let shared = Arc::clone(&counts);
    let got = job(n, config, move |comm| {
        let counts = Arc::clone(&shared);
        async move {
            let (me, n) = (comm.rank(), comm.size());
            let mut plain = Vec::new();
            let mut raw = Vec::new();
            let mut varied = Vec::new();
            for (case, &count) in counts.iter().enumerate() {
                let data: Vec<T> = (0..n)
                    .flat_map(|to| values::<T>(count, seed(case, me, to)))
                    .collect();
                plain.push(comm.all_to_all(&data).await?);
                raw.push(
                    bytes_variants(
                        &comm,
                        &data,
                        |c, d| c.all_to_all(d),
                        |c, b| c.all_to_all_bytes(b),
                    )
                    .await?,
                );
                let blocks: Vec<Vec<T>> = (0..n)
                    .map(|to| values(v_len(case, me, to), seed(case, me, to)))
                    .collect();
                varied.push(comm.all_to_allv(blocks).await?);
            }
            Ok::<_, Error>((plain, raw, varied))
        }
    })
    .await;
    for (rank, got) in got.into_iter().enumerate() {
        let (plain, raw, varied) = got.unwrap_or_else(|e| panic!("n={n} rank={rank}: {e}"));
        for (case, &count) in counts.iter().enumerate() {
            let want: Vec<T> = (0..n)
                .flat_map(|from| values::<T>(count, seed(case, from, rank)))
                .collect();
            assert_eq!(
                plain[case], want,
                "all_to_all n={n} count={count} rank={rank}"
            );
            let want_bytes: &[u8] = bytemuck::cast_slice(&want);
            assert_eq!(
                raw[case],
                [want_bytes, want_bytes],
                "all_to_all_bytes, alone and mixed, n={n} count={count} rank={rank}"
            );
            let want: Vec<Vec<T>> = (0..n)
                .map(|from| values(v_len(case, from, rank), seed(case, from, rank)))
                .collect();
            assert_eq!(
                varied[case], want,
                "all_to_allv n={n} case={case} rank={rank}"
            );
        }
    }
}

fn alltoall_configs() -> Vec<Config> {
    [
        Some(AlltoallAlgorithm::Bruck),
        Some(AlltoallAlgorithm::Pairwise),
        Some(AlltoallAlgorithm::Linear),
        // Declined alike by in-process ranks, as the direct all-gather (above).
        Some(AlltoallAlgorithm::Direct),
        None,
    ]
    .into_iter()
    .map(|algorithm| tuned(|t| t.alltoall = algorithm))
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_to_all_by_every_algorithm() {
    for config in &alltoall_configs() {
        for n in sizes() {
            // 100 u32s are 400 bytes per block: pairwise under the automatic choice.
            check_alltoalls::<u32>(n, config, &[0, 1, 3, 100]).await;
            check_alltoalls::<f64>(n, config, &[2]).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_to_all_of_large_blocks() {
    let mut configs = alltoall_configs();
    configs.push(Config::default());
    for config in &configs {
        for n in [3, 4, 5] {
            check_alltoalls::<u8>(n, config, &[70_001]).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_to_all_with_differing_counts_fails_everywhere() {
    for config in &alltoall_configs() {
        for (n, calls) in [2, 3, 4, 5, 8]
            .into_iter()
            .flat_map(|n| CALLS.map(|c| (n, c)))
        {
            let got = job_within(n, config, Duration::from_secs(10), move |comm| {
                let per_block = if comm.rank() == 1 { 2 } else { 1 };
                let data = vec![1u32; per_block * comm.size()];
                async move {
                    let typed = |c: &Communicator, d: &[u32]| c.all_to_all(d);
                    calls
                        .call(&comm, &data, typed, |c, b| c.all_to_all_bytes(b))
                        .await
                }
            })
            .await;
            for (rank, g) in got.into_iter().enumerate() {
                assert!(
                    matches!(g, Err(Error::InvalidArgument(_))),
                    "n={n} rank={rank} {calls:?} {:?}: {g:?}",
                    config.collectives.alltoall
                );
            }
        }
    }
}

/// A rank whose vector does not split into equal blocks fails, but takes part with the whole
/// blocks it has, so the others finish (here with those blocks: theirs are as long) instead of
/// waiting for its blocks — with the typed and the bytes calls, alone and mixed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_to_all_of_a_vector_that_does_not_split_fails_only_there() {
    for config in &alltoall_configs() {
        for (n, calls) in [2, 3, 4, 5, 8]
            .into_iter()
            .flat_map(|n| CALLS.map(|c| (n, c)))
        {
            let got = job_within(n, config, Duration::from_secs(10), move |comm| {
                let me = comm.rank();
                // Rank 1 passes one element (one byte, for the bytes call) too many.
                let extra = usize::from(me == 1);
                let data: Vec<u32> = (0..n + extra).map(|to| (me * 100 + to) as u32).collect();
                async move {
                    if calls.bytes_on(me) {
                        let mut bytes = bytemuck::cast_slice::<u32, u8>(&data[..n]).to_vec();
                        bytes.extend(std::iter::repeat_n(7, extra));
                        let got = comm.all_to_all_bytes(bytes).await?;
                        Ok(got
                            .chunks_exact(4)
                            .map(|c| u32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
                            .collect())
                    } else {
                        comm.all_to_all(&data).await
                    }
                }
            })
            .await;
            for (rank, g) in got.into_iter().enumerate() {
                let what = format!(
                    "n={n} rank={rank} {calls:?} {:?}",
                    config.collectives.alltoall
                );
                if rank == 1 {
                    assert!(matches!(g, Err(Error::InvalidArgument(_))), "{what}: {g:?}");
                } else {
                    let want: Vec<u32> = (0..n).map(|from| (from * 100 + rank) as u32).collect();
                    assert_eq!(g, Ok(want), "{what}");
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Several at once

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collectives_started_back_to_back_complete() {
    let configs = [
        Config::default(),
        tuned(|t| {
            t.bcast = Some(BcastAlgorithm::Chain);
            t.segment = 1000;
            t.allgather = Some(AllgatherAlgorithm::Ring);
            t.alltoall = Some(AlltoallAlgorithm::Bruck);
        }),
    ];
    for config in &configs {
        for n in [5, 8] {
            let got = job(n, config, |comm| async move {
                let (me, n) = (comm.rank(), comm.size());
                let big = if me == 2 {
                    pattern(300_000, 2)
                } else {
                    Bytes::new()
                };
                let small = if me == n - 1 {
                    pattern(100, 9)
                } else {
                    Bytes::new()
                };
                // Everything is started before anything is awaited, then awaited in reverse.
                let first = comm.broadcast(2, big);
                let second = comm.broadcast(n - 1, small);
                let gathered = comm.all_gather(&values::<u32>(20_000, me));
                let exchanged = comm.all_to_all(&values::<u8>(n * 1000, me));
                let collected = comm.gatherv(0, &values::<f64>(me, me));
                let scattered = comm.scatter(1, &values::<u32>(n * 3, 1));
                let scattered = scattered.await?;
                let collected = collected.await?;
                let exchanged = exchanged.await?;
                let gathered = gathered.await?;
                let second = second.await?;
                let first = first.await?;
                Ok::<_, Error>((first, second, gathered, exchanged, collected, scattered))
            })
            .await;
            for (rank, g) in got.into_iter().enumerate() {
                let (first, second, gathered, exchanged, collected, scattered) =
                    g.unwrap_or_else(|e| panic!("n={n} rank={rank}: {e}"));
                assert!(first == pattern(300_000, 2), "n={n} rank={rank}");
                assert_eq!(second, pattern(100, 9));
                let want: Vec<u32> = (0..n).flat_map(|r| values::<u32>(20_000, r)).collect();
                assert!(gathered == want, "all_gather n={n} rank={rank}");
                let want: Vec<u8> = (0..n)
                    .flat_map(|from| values::<u8>(n * 1000, from)[rank * 1000..][..1000].to_vec())
                    .collect();
                assert!(exchanged == want, "all_to_all n={n} rank={rank}");
                let want = (rank == 0).then(|| (0..n).map(|r| values::<f64>(r, r)).collect());
                assert_eq!(collected, want);
                assert_eq!(scattered, values::<u32>(n * 3, 1)[rank * 3..][..3].to_vec());
            }
        }
    }
}

/// 8 MiB, the top of the size range: broadcast from two roots (the chain algorithm at this
/// size), all_gather of 2 MiB blocks (ring) and all_to_all of 2 MiB blocks (pairwise), with
/// every byte checked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_megabytes_through_broadcast_all_gather_and_all_to_all() {
    let eight = 8 << 20;
    for n in [2usize, 3, 4] {
        check_broadcast(n, &Config::default(), vec![0, n - 1], &[eight], None).await;
    }
    let n = 4;
    let block = eight / n / 4; // u32 elements: 2 MiB per rank
    let got = job(n, &Config::default(), move |comm| async move {
        let me = comm.rank();
        let mine: Vec<u32> = (0..block).map(|i| (me * block + i) as u32).collect();
        let gathered = comm.all_gather(&mine).await?;
        let to_all: Vec<u32> = (0..n * block / n)
            .flat_map(|i| (0..n).map(move |_| i))
            .map(|i| (me * 1_000_000 + i) as u32)
            .collect();
        let swapped = comm.all_to_all(&to_all).await?;
        Ok::<_, Error>((gathered, swapped))
    })
    .await;
    for (rank, r) in got.into_iter().enumerate() {
        let (gathered, swapped) = r.unwrap();
        assert_eq!(gathered.len(), n * block);
        assert!(
            gathered.iter().enumerate().all(|(i, &v)| v == i as u32),
            "all_gather of 8 MiB at rank {rank}"
        );
        // Rank r receives block r of every sender s: elements r*block..(r+1)*block of s's input.
        let per = block; // elements per destination block
        for from in 0..n {
            let got = &swapped[from * per..(from + 1) * per];
            let want: Vec<u32> = (rank * per..(rank + 1) * per)
                .map(|j| (from * 1_000_000 + j / n) as u32)
                .collect();
            assert_eq!(
                got,
                &want[..],
                "all_to_all block from {from} at rank {rank}"
            );
        }
    }
}

/// Rank 0 of a 5-rank job plays a faulty root: it sends `messages` to every other rank on the
/// first collective's tag while the others broadcast from it. Every other rank must fail with
/// a protocol error whose text contains `expected` — the ranks below rank 0's children too,
/// which hear only what their parents forward — and none may hang.
async fn faulty_root_fails_everyone(messages: Vec<Vec<u8>>, expected: &'static str) {
    let got = job_within(
        5,
        &Config::default(),
        Duration::from_secs(20),
        move |comm| {
            let messages = messages.clone();
            async move {
                if comm.rank() != 0 {
                    return Some(comm.broadcast(0, Bytes::new()).await);
                }
                let tag = comm.next_collective();
                for child in 1..comm.size() {
                    for m in &messages {
                        comm.collective_send(child, tag, m.clone()).await.unwrap();
                    }
                }
                None
            }
        },
    )
    .await;
    for (rank, r) in got.into_iter().enumerate().skip(1) {
        match r {
            Some(Err(Error::Protocol { detail, .. })) => {
                assert!(detail.contains(expected), "rank {rank}: {detail}")
            }
            other => panic!("rank {rank}: expected a protocol error, got {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_separate_body_fails_every_rank_without_a_hang() {
    // A binomial broadcast of 20 000 bytes announced as sent apart (flag 1), then 100 bytes.
    let mut header = vec![0u8; 16];
    header[1] = 1;
    header[8..].copy_from_slice(&20_000u64.to_le_bytes());
    faulty_root_fails_everyone(vec![header, vec![7u8; 100]], "100 bytes").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_header_fails_every_rank_without_a_hang() {
    let mut header = vec![0u8; 16];
    header[0] = 9; // no such algorithm
    faulty_root_fails_everyone(vec![header], "unknown algorithm").await;
    let mut empty_apart = vec![0u8; 16];
    empty_apart[1] = 1;
    faulty_root_fails_everyone(vec![empty_apart], "empty broadcast").await;
}
