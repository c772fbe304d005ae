//! Reduce, allreduce, reduce-scatter, scan and exscan over in-process ranks, checked against a
//! sequential reference: `x₀ ∘ x₁ ∘ … ∘ xₙ₋₁` folded in rank order on one thread.
//!
//! Floating-point data are sums and products of ±½, ±1, ±2, which are exact in any order, so
//! every comparison is exact. Rank order is checked with a non-commutative operation: the
//! composition of affine maps `x ↦ a·x + b` over wrapping `u64`.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use rankweave_collectives::{Collectives, Element, Op, ReduceOp, UserOp};
use rankweave_core::tuning::AllreduceAlgorithm;
use rankweave_core::{Config, Error, TransportKind};

mod common;
use common::{job, job_with, job_within};

fn config_with(allreduce: Option<AllreduceAlgorithm>) -> Config {
    let mut config = Config::default();
    config.collectives.allreduce = allreduce;
    config
}

/// The sizes most tests run on: every n up to 17 (powers of two and not) and 64.
fn sizes() -> impl Iterator<Item = usize> {
    (1..=17).chain([64])
}

/// SplitMix64: deterministic test data.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Element types of the tests, made from random bits.
trait Value: Element + PartialEq + Debug {
    fn from_bits(bits: u64) -> Self;
}

impl Value for u32 {
    fn from_bits(bits: u64) -> Self {
        // A zero now and then, so logical operations see both truth values.
        if bits % 4 == 0 { 0 } else { (bits >> 8) as u32 }
    }
}

impl Value for i64 {
    fn from_bits(bits: u64) -> Self {
        if bits % 4 == 0 { 0 } else { (bits >> 2) as i64 }
    }
}

impl Value for f64 {
    fn from_bits(bits: u64) -> Self {
        [-2.0, -1.0, -0.5, 0.5, 1.0, 2.0][(bits % 6) as usize]
    }
}

/// An affine map `x ↦ a·x + b`.
type Affine = [u64; 2];

impl Value for Affine {
    fn from_bits(bits: u64) -> Self {
        [mix(bits) | 1, bits]
    }
}

/// Composition of affine maps, `(f ∘ g)(x) = f(g(x))`: associative, not commutative.
fn compose() -> ReduceOp<Affine> {
    UserOp::non_commutative(|lower: &[Affine], inout: &mut [Affine]| {
        for (f, g) in lower.iter().zip(inout.iter_mut()) {
            *g = [
                f[0].wrapping_mul(g[0]),
                f[0].wrapping_mul(g[1]).wrapping_add(f[1]),
            ];
        }
    })
    .into()
}

/// Rank `rank`'s contribution of `len` elements to case `case`.
fn input<T: Value>(case: usize, rank: usize, len: usize) -> Vec<T> {
    let seed = mix(((case as u64) << 32) ^ rank as u64);
    (0..len as u64)
        .map(|i| T::from_bits(mix(seed ^ i)))
        .collect()
}

/// `x₀ ∘ … ∘ x_{k−1}` for every k in `1..=n`, folded in rank order.
fn prefixes<T: Value>(op: &ReduceOp<T>, case: usize, n: usize, len: usize) -> Vec<Vec<T>> {
    let mut out: Vec<Vec<T>> = Vec::with_capacity(n);
    for rank in 0..n {
        let mut next = input(case, rank, len);
        if let Some(acc) = out.last() {
            op.combine(acc, &mut next).unwrap();
        }
        out.push(next);
    }
    out
}

fn reference<T: Value>(op: &ReduceOp<T>, case: usize, n: usize, len: usize) -> Vec<T> {
    prefixes(op, case, n, len).pop().unwrap()
}

/// One collective call of a test: its length, operation and root.
struct Case<T> {
    len: usize,
    op: ReduceOp<T>,
    root: usize,
}

/// Which collective [`run_cases`] calls.
#[derive(Clone, Copy, Debug)]
enum Collective {
    Reduce,
    AllReduce,
    /// `len` is the block length: every rank passes n blocks.
    ReduceScatter,
    Scan,
    Exscan,
}

/// Runs every case, in order, on one `n`-rank job with `config` and checks every rank's result
/// against the reference.
async fn run_cases<T: Value>(
    collective: Collective,
    n: usize,
    config: &Config,
    cases: Vec<Case<T>>,
) {
    let cases = Arc::new(cases);
    let shared = Arc::clone(&cases);
    let results = job_with(n, config, move |comm| {
        let cases = Arc::clone(&shared);
        async move {
            let mut out = Vec::new();
            for (i, case) in cases.iter().enumerate() {
                let op = case.op.clone();
                let result = match collective {
                    Collective::Reduce => {
                        let data = input::<T>(i, comm.rank(), case.len);
                        comm.reduce(case.root, &data, op).await
                    }
                    Collective::AllReduce => {
                        let data = input::<T>(i, comm.rank(), case.len);
                        comm.all_reduce(&data, op).await.map(Some)
                    }
                    Collective::ReduceScatter => {
                        let data = input::<T>(i, comm.rank(), case.len * comm.size());
                        comm.reduce_scatter(&data, op).await.map(Some)
                    }
                    Collective::Scan => {
                        let data = input::<T>(i, comm.rank(), case.len);
                        comm.scan(&data, op).await.map(Some)
                    }
                    Collective::Exscan => {
                        let data = input::<T>(i, comm.rank(), case.len);
                        comm.exscan(&data, op).await
                    }
                };
                out.push(result);
            }
            out
        }
    })
    .await;
    for (i, case) in cases.iter().enumerate() {
        let expected = expected(collective, n, i, case);
        for (rank, got) in results.iter().enumerate() {
            let got = got[i].as_ref().unwrap_or_else(|e| {
                panic!(
                    "{collective:?} n={n} case {i} (len {}) rank {rank}: {e}",
                    case.len
                )
            });
            assert!(
                *got == expected[rank],
                "{collective:?} n={n} case {i} (len {}, {:?}, root {}) rank {rank} differs from \
                 the reference",
                case.len,
                case.op,
                case.root,
            );
        }
    }
}

/// What every rank must get from case number `i`.
fn expected<T: Value>(
    collective: Collective,
    n: usize,
    i: usize,
    case: &Case<T>,
) -> Vec<Option<Vec<T>>> {
    let op = &case.op;
    match collective {
        Collective::Reduce => {
            let result = reference(op, i, n, case.len);
            (0..n)
                .map(|rank| (rank == case.root).then(|| result.clone()))
                .collect()
        }
        Collective::AllReduce => vec![Some(reference(op, i, n, case.len)); n],
        Collective::ReduceScatter => {
            let k = case.len;
            let result = reference(op, i, n, k * n);
            (0..n)
                .map(|rank| Some(result[rank * k..(rank + 1) * k].to_vec()))
                .collect()
        }
        Collective::Scan => prefixes(op, i, n, case.len).into_iter().map(Some).collect(),
        Collective::Exscan => {
            let mut all = prefixes(op, i, n, case.len);
            all.pop();
            std::iter::once(None)
                .chain(all.into_iter().map(Some))
                .collect()
        }
    }
}

/// The small lengths every collective is tried with: empty, one element, a few, fewer than the
/// ranks, and a few hundred (not a multiple of most n).
fn small_lengths(n: usize) -> Vec<usize> {
    let mut lens = vec![0, 1, 7, n.saturating_sub(1), 301];
    lens.dedup();
    lens
}

/// Cycles through `ops` over `lengths`, adding `root(k)` to the k-th case.
fn cases<T>(lengths: &[usize], ops: &[ReduceOp<T>], root: impl Fn(usize) -> usize) -> Vec<Case<T>>
where
    ReduceOp<T>: Clone,
{
    lengths
        .iter()
        .enumerate()
        .map(|(k, &len)| Case {
            len,
            op: ops[k % ops.len()].clone(),
            root: root(k),
        })
        .collect()
}

fn int_ops<T: rankweave_collectives::Reducible>() -> Vec<ReduceOp<T>> {
    [Op::Sum, Op::Max, Op::BitXor, Op::LogicalOr, Op::Product]
        .into_iter()
        .map(ReduceOp::from)
        .collect()
}

fn float_ops() -> Vec<ReduceOp<f64>> {
    [Op::Sum, Op::Product, Op::Max, Op::Min]
        .into_iter()
        .map(ReduceOp::from)
        .collect()
}

/// Every length with every root (the same lengths for every root).
fn every_root<T>(n: usize, lengths: &[usize], ops: &[ReduceOp<T>]) -> Vec<Case<T>>
where
    ReduceOp<T>: Clone,
{
    (0..n)
        .flat_map(|root| {
            let rotated: Vec<ReduceOp<T>> = (0..ops.len())
                .map(|k| ops[(k + root) % ops.len()].clone())
                .collect();
            cases(lengths, &rotated, |_| root)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reduce_to_every_root_matches_the_reference() {
    let config = Config::default();
    for n in sizes() {
        let lengths = small_lengths(n);
        let reduce = Collective::Reduce;
        run_cases(
            reduce,
            n,
            &config,
            every_root(n, &lengths, &int_ops::<u32>()),
        )
        .await;
        run_cases(
            reduce,
            n,
            &config,
            every_root(n, &lengths, &int_ops::<i64>()),
        )
        .await;
        run_cases(reduce, n, &config, every_root(n, &lengths, &float_ops())).await;
        run_cases(reduce, n, &config, every_root(n, &lengths, &[compose()])).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reduce_of_large_vectors() {
    let config = Config::default();
    for n in [2, 3, 5, 8] {
        let roots = [0, n - 1, n / 2];
        let large = |op: ReduceOp<u32>| -> Vec<Case<u32>> {
            roots
                .iter()
                .map(|&root| Case {
                    len: 1 << 17,
                    op: op.clone(),
                    root,
                })
                .collect()
        };
        run_cases(Collective::Reduce, n, &config, large(Op::Sum.into())).await;
        let ordered = roots
            .iter()
            .map(|&root| Case {
                len: 1 << 15,
                op: compose(),
                root,
            })
            .collect();
        run_cases(Collective::Reduce, n, &config, ordered).await;
    }
}

/// Vectors from 16 KiB (to just under 256 KiB on two ranks, to 1 MiB in the tree) go from
/// rank to rank in 8 KiB pieces, which the receiver combines as they come: lengths on both
/// sides of the thresholds and of a piece's boundary, every root of 2 to 5 ranks (the two-rank
/// path and the tree), operations that commute and one that does not (`compose`'s 16-byte
/// elements make a piece 512 of them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reduce_in_pieces_matches_the_reference() {
    let config = Config::default();
    // u32: 16 KiB is 4 096 elements, 256 KiB 65 536, a piece 2 048.
    let words = [4095, 4096, 4097, 6143, 6144, 2048 * 7 + 1, 65535, 65536];
    let affine = [1023, 1024, 1025, 1536, 512 * 9 + 7, 16383, 16384];
    for n in 2..=5 {
        for root in 0..n {
            let ops = [Op::Sum.into(), wrapping_u32_sum(), Op::Max.into()];
            let sums = cases(&words, &ops, |_| root);
            run_cases(Collective::Reduce, n, &config, sums).await;
            let ordered = cases(&affine, &[compose()], |_| root);
            run_cases(Collective::Reduce, n, &config, ordered).await;
        }
    }
    // The tree's upper bound, 1 MiB: in pieces at it, one message just above.
    for root in [0, 2] {
        let edge: Vec<Case<u32>> = cases(&[1 << 18, (1 << 18) + 1], &[Op::Sum.into()], |_| root);
        run_cases(Collective::Reduce, 3, &config, edge).await;
    }
}

/// Ranks that pass different counts, one or both long enough to go in pieces: the root gets an
/// `InvalidArgument` saying so, nobody hangs, and (on two ranks) the next collective pairs up
/// as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reduce_in_pieces_reports_other_lengths() {
    // (root's count, the other rank's count) in u32 elements; 4 096 and up go in pieces.
    let pairs = [
        (4, 8000),
        (8000, 4),
        (8000, 9000),
        (9000, 8000),
        (8192, 8191),
    ];
    for root in [0, 1] {
        for (at_root, other) in pairs {
            let results = job(2, move |comm| async move {
                let len = if comm.rank() == root { at_root } else { other };
                let data = vec![1u32; len];
                let reduced = comm.reduce(root, &data, Op::Sum).await;
                let after = comm.all_reduce(&[comm.rank() as u32 + 1], Op::Sum).await;
                (reduced.map(|r| r.map(|v| v.len())), after)
            })
            .await;
            for (rank, (reduced, after)) in results.into_iter().enumerate() {
                let case = format!("root {root}, counts {at_root}/{other}, rank {rank}");
                if rank == root {
                    assert!(
                        matches!(reduced, Err(Error::InvalidArgument(_))),
                        "{case}: {reduced:?}"
                    );
                } else {
                    assert_eq!(reduced.unwrap(), None, "{case}");
                }
                assert_eq!(after.unwrap(), [3], "{case}");
            }
        }
    }
    // Through the tree: rank 3 of 4 passes another count, long enough to go in pieces either
    // way; the root (1) fails, and every rank finishes.
    for (odd, rest) in [(9000, 8000), (8000, 9000), (4, 8000)] {
        let results = job(4, move |comm| async move {
            let len = if comm.rank() == 3 { odd } else { rest };
            comm.reduce(1, &vec![1u32; len], Op::Sum).await.map(drop)
        })
        .await;
        assert!(
            matches!(results[1], Err(Error::InvalidArgument(_))),
            "counts {odd}/{rest}: {results:?}"
        );
    }
}

/// Every algorithm, forced or chosen: the automatic choice takes recursive doubling below 64 KiB
/// and Rabenseifner from there (on two ranks, recursive doubling but where only the halves go
/// inline through a shared-memory ring; see `two_ranks_halve_only_where_the_halves_go_inline`). Direct reads
/// decline between in-process ranks, which cannot read each other's memory through the
/// transport, so that choice tests the fallback.
const ALLREDUCE_CHOICES: [Option<AllreduceAlgorithm>; 5] = [
    None,
    Some(AllreduceAlgorithm::RecursiveDoubling),
    Some(AllreduceAlgorithm::Rabenseifner),
    Some(AllreduceAlgorithm::Ring),
    Some(AllreduceAlgorithm::Direct),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allreduce_with_every_algorithm_matches_the_reference() {
    for algorithm in ALLREDUCE_CHOICES {
        let config = config_with(algorithm);
        for n in sizes() {
            let lengths = small_lengths(n);
            let all = Collective::AllReduce;
            run_cases(all, n, &config, cases(&lengths, &int_ops::<u32>(), |_| 0)).await;
            run_cases(all, n, &config, cases(&lengths, &int_ops::<i64>(), |_| 0)).await;
            run_cases(all, n, &config, cases(&lengths, &float_ops(), |_| 0)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allreduce_of_large_vectors_with_every_algorithm() {
    for algorithm in ALLREDUCE_CHOICES {
        let config = config_with(algorithm);
        for n in [1, 2, 3, 4, 6, 7, 8, 12] {
            // 512 KiB of u32, and a length no n divides.
            let lengths = [1 << 17, (1 << 15) + 3];
            let ops: [ReduceOp<u32>; 2] = [Op::Sum.into(), Op::BitXor.into()];
            run_cases(
                Collective::AllReduce,
                n,
                &config,
                cases(&lengths, &ops, |_| 0),
            )
            .await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allreduce_keeps_rank_order_with_every_algorithm() {
    // A forced ring falls back to the automatic choice for a non-commutative operation.
    for algorithm in ALLREDUCE_CHOICES {
        let config = config_with(algorithm);
        for n in sizes() {
            let mut lengths = small_lengths(n);
            if n <= 12 {
                // 128 KiB: Rabenseifner when chosen automatically.
                lengths.push(1 << 13);
            }
            let ordered = cases(&lengths, &[compose()], |_| 0);
            run_cases(Collective::AllReduce, n, &config, ordered).await;
        }
    }
}

/// Direct reads over shared memory (ranks of this process read each other's vectors with
/// `process_vm_readv`, as processes do): forced, so that empty vectors, vectors shorter than the
/// ranks and uneven blocks go that way too, with every commutative operation; a
/// non-commutative one falls back to the automatic choice. With single copy off no rank may
/// read another's memory, so all decline and the data go in messages. Which way a large
/// all-reduce went shows in the bytes each rank sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allreduce_by_direct_reads_over_shared_memory() {
    for single_copy in [true, false] {
        let mut config = config_with(Some(AllreduceAlgorithm::Direct));
        config.transport = TransportKind::Shm;
        config.shm.single_copy = single_copy;
        for n in [1, 2, 3, 4, 5, 8] {
            let lengths = [0, 1, 7, 301, (1 << 15) + 3];
            let all = Collective::AllReduce;
            run_cases(all, n, &config, cases(&lengths, &int_ops::<u32>(), |_| 0)).await;
            run_cases(all, n, &config, cases(&lengths, &float_ops(), |_| 0)).await;
            run_cases(all, n, &config, cases(&lengths, &[compose()], |_| 0)).await;
        }
        let len = 1 << 17;
        let got = job_with(4, &config, move |comm| async move {
            let mine = vec![comm.rank() as u32 + 1; len];
            let before = comm.stats().bytes_sent;
            let sum = comm.all_reduce(&mine, Op::Sum).await?;
            Ok::<_, Error>((sum, comm.stats().bytes_sent - before))
        })
        .await;
        for (rank, r) in got.into_iter().enumerate() {
            let (sum, sent) = r.unwrap();
            assert!(sum.iter().all(|&v| v == 10), "rank {rank}: wrong sum");
            if single_copy {
                assert!(
                    sent < 4096,
                    "rank {rank} sent {sent} bytes: not by direct reads"
                );
            } else {
                assert!(
                    sent >= (len * 4 / 2) as u64,
                    "rank {rank} sent only {sent} bytes"
                );
            }
        }
    }
}

/// A direct all-reduce copies its input into the rank's shared-memory arena, from which the
/// peers read it with loads, and holds the arena until every peer is done: the arena is taken
/// right after the call and free again once the result is in. A rank whose arena is taken
/// (held here by the test, or by a second all-reduce in flight) copies into a vector of its
/// own and is read with `process_vm_readv` — mixed with peers read by loads, the results are
/// the same. So are they with arenas off and with vectors too large for the arena.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_allreduces_read_peers_arenas_and_give_them_back() {
    // 128 KiB of u32: direct reads through arenas on 2 ranks (from 64 KiB) and on more (from
    // 128 KiB) by default.
    let len = 1 << 15;
    let value = |rank: usize, i: usize| (rank as u32 + 1).wrapping_mul(i as u32 ^ 0x9e37);
    let expected = move |n: usize| -> Vec<u32> {
        (0..len)
            .map(|i| (0..n).fold(0u32, |acc, r| acc.wrapping_add(value(r, i))))
            .collect()
    };
    for (arena, n) in [
        (4 << 20, 2),
        (4 << 20, 3),
        (4 << 20, 4),
        (0, 3),
        (64 << 10, 2),
    ] {
        let mut config = Config {
            transport: TransportKind::Shm,
            ..Config::default()
        };
        config.shm.arena_bytes = arena;
        let uses_arena = arena >= len * 4;
        let got = job_with(n, &config, move |comm| async move {
            let r = comm.rank();
            let mine: Vec<u32> = (0..len).map(|i| value(r, i)).collect();
            // Alone: every rank's input in its arena. The last rank comes late, so the
            // others' all-reduces are still waiting (and holding their arenas) when they look.
            let last = r + 1 == comm.size();
            if last {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let op = comm.all_reduce(&mine, Op::Sum);
            let held_during = last || comm.lease_arena().is_none();
            let alone = op.await?;
            let free_after = comm.lease_arena().is_some();
            // Rank 1's arena taken: its peers read it the old way.
            let taken = (r == 1).then(|| comm.lease_arena()).flatten();
            let mixed = comm.all_reduce(&mine, Op::Sum).await?;
            drop(taken);
            // Two in flight: the second finds the arena taken by the first.
            let first = comm.all_reduce(&mine, Op::Sum);
            let second = comm.all_reduce(&mine, Op::Max);
            let (first, second) = (first.await?, second.await?);
            let free_at_end = comm.lease_arena().is_some();
            Ok::<_, Error>((
                [alone, mixed, first],
                second,
                held_during,
                free_after && free_at_end,
            ))
        })
        .await;
        let sums = expected(n);
        let maxima: Vec<u32> = (0..len)
            .map(|i| (0..n).map(|r| value(r, i)).max().unwrap())
            .collect();
        for (rank, r) in got.into_iter().enumerate() {
            let (results, max, held_during, freed) = r.unwrap();
            for (k, sum) in results.iter().enumerate() {
                assert!(
                    sum == &sums,
                    "arena {arena}, n {n}, rank {rank}: sum {k} wrong"
                );
            }
            assert!(
                max == maxima,
                "arena {arena}, n {n}, rank {rank}: max wrong"
            );
            assert_eq!(
                held_during,
                // (Without an arena there is never one to lease.)
                uses_arena || rank + 1 == n || arena == 0,
                "arena {arena}, n {n}, rank {rank}: arena held while waiting"
            );
            assert!(
                freed || arena == 0,
                "arena {arena}, n {n}, rank {rank}: arena not given back"
            );
        }
    }
}

/// On two ranks the automatic choice exchanges the whole vector once, except where only its
/// halves go inline through a shared-memory ring (from 32 KiB to 64 KiB of data with the
/// default settings): then Rabenseifner, two exchanges of halves. Both give the reference
/// result, in rank order too; which ran shows in the messages each rank sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_ranks_halve_only_where_the_halves_go_inline() {
    let mut config = Config {
        transport: TransportKind::Shm,
        ..Config::default()
    };
    // Without arenas: with them, direct reads take over from 64 KiB on two ranks.
    config.shm.arena_bytes = 0;
    // u32 elements: 16 000, 36 000, 65 536 and 80 000 bytes.
    let lengths = [4000, 9000, 1 << 14, 20_000];
    let all = Collective::AllReduce;
    run_cases(all, 2, &config, cases(&lengths, &int_ops::<u32>(), |_| 0)).await;
    run_cases(all, 2, &config, cases(&lengths, &[compose()], |_| 0)).await;
    for (len, messages) in lengths.into_iter().zip([1, 2, 2, 1]) {
        let got = job_with(2, &config, move |comm| async move {
            let mine = vec![comm.rank() as u32 + 1; len];
            let sent = |comm: &rankweave_core::Communicator| {
                let s = comm.stats();
                s.eager_messages_sent + s.rendezvous_messages_sent
            };
            let before = sent(&comm);
            let sum = comm.all_reduce(&mine, Op::Sum).await?;
            Ok::<_, Error>((sum, sent(&comm) - before))
        })
        .await;
        for (rank, r) in got.into_iter().enumerate() {
            let (sum, sent) = r.unwrap();
            assert!(sum.iter().all(|&v| v == 3), "rank {rank}: wrong sum");
            assert_eq!(sent, messages, "{len} elements: messages rank {rank} sent");
        }
    }
}

/// A direct all-reduce whose third rank is gone fails on the other two with `PeerFailed`, and
/// neither waits for a message that cannot come: each records the failure, skips its reads and
/// sends the other fault notices in place of "ready" and "done".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_allreduce_fails_without_hanging_when_a_rank_is_gone() {
    let mut config = config_with(Some(AllreduceAlgorithm::Direct));
    config.transport = TransportKind::Shm;
    let results = job_within(3, &config, Duration::from_secs(20), |comm| async move {
        if comm.rank() == 2 {
            // Leaves at once: its communicator is dropped and its transport closed.
            return None;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        Some(comm.all_reduce(&vec![1u32; 1000], Op::Sum).await)
    })
    .await;
    for (rank, r) in results.into_iter().take(2).enumerate() {
        assert_eq!(
            r.expect("ranks 0 and 1 run the all-reduce"),
            Err(Error::PeerFailed { rank: 2 }),
            "rank {rank}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allreduce_threshold_picks_rabenseifner_for_small_vectors_too() {
    // With the threshold at zero, every vector, even empty or shorter than the ranks, goes
    // through Rabenseifner's uneven blocks (on three ranks and more: two always exchange once).
    let mut config = Config::default();
    config.collectives.allreduce_large = 0;
    for n in sizes() {
        let lengths = small_lengths(n);
        run_cases(
            Collective::AllReduce,
            n,
            &config,
            cases(&lengths, &int_ops::<u32>(), |_| 0),
        )
        .await;
        run_cases(
            Collective::AllReduce,
            n,
            &config,
            cases(&lengths, &[compose()], |_| 0),
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reduce_scatter_matches_the_reference() {
    let config = Config::default();
    for n in sizes() {
        // Block lengths; every rank passes n blocks.
        let blocks = [0, 1, 3, 67];
        let scatter = Collective::ReduceScatter;
        run_cases(
            scatter,
            n,
            &config,
            cases(&blocks, &int_ops::<u32>(), |_| 0),
        )
        .await;
        run_cases(
            scatter,
            n,
            &config,
            cases(&blocks, &int_ops::<i64>(), |_| 0),
        )
        .await;
        run_cases(scatter, n, &config, cases(&blocks, &float_ops(), |_| 0)).await;
        run_cases(scatter, n, &config, cases(&blocks, &[compose()], |_| 0)).await;
    }
    for n in [2, 3, 4, 7, 8] {
        let large = [(1 << 17) / n];
        let scatter = Collective::ReduceScatter;
        run_cases(
            scatter,
            n,
            &config,
            cases(&large, &[ReduceOp::<u32>::from(Op::Sum)], |_| 0),
        )
        .await;
        run_cases(scatter, n, &config, cases(&large, &[compose()], |_| 0)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scan_and_exscan_match_the_prefixes() {
    let config = Config::default();
    for n in sizes() {
        let lengths = small_lengths(n);
        for collective in [Collective::Scan, Collective::Exscan] {
            run_cases(
                collective,
                n,
                &config,
                cases(&lengths, &int_ops::<u32>(), |_| 0),
            )
            .await;
            run_cases(
                collective,
                n,
                &config,
                cases(&lengths, &int_ops::<i64>(), |_| 0),
            )
            .await;
            run_cases(collective, n, &config, cases(&lengths, &float_ops(), |_| 0)).await;
            run_cases(collective, n, &config, cases(&lengths, &[compose()], |_| 0)).await;
        }
    }
    for n in [3, 8] {
        for collective in [Collective::Scan, Collective::Exscan] {
            let large = [1 << 17];
            run_cases(
                collective,
                n,
                &config,
                cases(&large, &[ReduceOp::<u32>::from(Op::Sum)], |_| 0),
            )
            .await;
        }
    }
}

/// Runs `collective` with rank `odd` contributing one element more than the others, and
/// returns which ranks failed (every rank must finish: a failure is reported, not a hang).
async fn failing_ranks(
    collective: Collective,
    n: usize,
    odd: usize,
    config: &Config,
    op: ReduceOp<u32>,
) -> Vec<usize> {
    let results = job_with(n, config, move |comm| {
        let op = op.clone();
        async move {
            let extra = usize::from(comm.rank() == odd);
            let len = match collective {
                Collective::ReduceScatter => (4 + extra) * comm.size(),
                _ => 4 + extra,
            };
            let data = input::<u32>(0, comm.rank(), len);
            match collective {
                Collective::Reduce => comm.reduce(1, &data, op).await.map(drop),
                Collective::AllReduce => comm.all_reduce(&data, op).await.map(drop),
                Collective::ReduceScatter => comm.reduce_scatter(&data, op).await.map(drop),
                Collective::Scan => comm.scan(&data, op).await.map(drop),
                Collective::Exscan => comm.exscan(&data, op).await.map(drop),
            }
        }
    })
    .await;
    results
        .iter()
        .enumerate()
        .filter_map(|(rank, r)| match r {
            Ok(()) => None,
            Err(Error::InvalidArgument(_)) => Some(rank),
            Err(e) => panic!("{collective:?}: rank {rank} failed with an unexpected error: {e}"),
        })
        .collect()
}

fn wrapping_u32_sum() -> ReduceOp<u32> {
    UserOp::non_commutative(|lower: &[u32], inout: &mut [u32]| {
        for (l, o) in lower.iter().zip(inout.iter_mut()) {
            *o = l.wrapping_add(*o);
        }
    })
    .into()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_length_mismatch_fails_the_ranks_that_depend_on_it_without_hanging() {
    // The rank that sees a wrong length tells the ranks it would have sent data to, so every rank
    // whose result involves the odd contribution fails; none waits forever.
    let (n, odd) = (6, 3);
    let all: Vec<usize> = (0..n).collect();
    for op in [Op::Sum.into(), wrapping_u32_sum()] {
        for algorithm in ALLREDUCE_CHOICES {
            let config = config_with(algorithm);
            let failed = failing_ranks(Collective::AllReduce, n, odd, &config, op.clone()).await;
            assert_eq!(failed, all, "allreduce with {algorithm:?}");
        }
        let config = Config::default();
        // Reduce to rank 1: the root fails; the ranks whose tree path saw the bad data may too.
        let failed = failing_ranks(Collective::Reduce, n, odd, &config, op.clone()).await;
        assert!(failed.contains(&1), "reduce: {failed:?}");
        // Every block of a reduce-scatter involves every contribution.
        let failed = failing_ranks(Collective::ReduceScatter, n, odd, &config, op.clone()).await;
        assert_eq!(failed, all, "reduce_scatter");
        // Prefixes below the odd rank do not involve it.
        let failed = failing_ranks(Collective::Scan, n, odd, &config, op.clone()).await;
        assert_eq!(failed, (odd..n).collect::<Vec<_>>(), "scan");
        // The odd rank's own exclusive prefix does not include its data, but it still sees
        // the lower ranks' partials differ in length from its own.
        let failed = failing_ranks(Collective::Exscan, n, odd, &config, op.clone()).await;
        assert_eq!(failed, (odd..n).collect::<Vec<_>>(), "exscan");
    }
    // The communicator stays usable: later collectives pair up as before.
    let sums = job(n, |comm| async move {
        let bad = vec![1u32; 2 + comm.rank() % 2];
        let failed = comm.all_reduce(&bad, Op::Sum).await.is_err();
        let good = comm.all_reduce(&[comm.rank() as u32], Op::Sum).await;
        (failed, good)
    })
    .await;
    for (failed, good) in sums {
        assert!(failed);
        assert_eq!(good.unwrap(), [15]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bitwise_ops_on_floats_are_rejected_before_anything_is_sent() {
    let results = job(4, |comm| async move {
        let data = [1.0f64, 2.0, 3.0, 4.0];
        let before = comm.stats();
        let rejected = [
            comm.all_reduce(&data, Op::BitXor).await.map(drop),
            comm.reduce(0, &data, Op::BitXor).await.map(drop),
            comm.reduce_scatter(&data, Op::BitAnd).await.map(drop),
            comm.scan(&data, Op::LogicalOr).await.map(drop),
            comm.exscan(&data, Op::BitOr).await.map(drop),
        ];
        let after = comm.stats();
        let sent = |s: &rankweave_core::Stats| s.eager_messages_sent + s.rendezvous_messages_sent;
        let nothing_sent = sent(&before) == sent(&after);
        // The rejected calls kept the ranks in step.
        let sum = comm.all_reduce(&data, Op::Sum).await;
        (rejected, nothing_sent, sum)
    })
    .await;
    for (rank, (rejected, nothing_sent, sum)) in results.into_iter().enumerate() {
        for r in rejected {
            assert!(
                matches!(r, Err(Error::InvalidArgument(_))),
                "rank {rank}: {r:?}"
            );
        }
        assert!(
            nothing_sent,
            "rank {rank} sent messages for a rejected reduction"
        );
        assert_eq!(sum.unwrap(), [4.0, 8.0, 12.0, 16.0]);
    }
}

/// 8 MiB of `u64` (a million elements) summed by every allreduce algorithm, and reduced to a
/// root, on 3 and 4 ranks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_megabytes_reduced_by_every_algorithm() {
    let len = (8 << 20) / 8;
    for algorithm in ALLREDUCE_CHOICES {
        for n in [3usize, 4] {
            let got = job_with(n, &config_with(algorithm), move |comm| async move {
                let mine: Vec<u64> = (0..len as u64).map(|i| i ^ comm.rank() as u64).collect();
                let all = comm.all_reduce(&mine, Op::Sum).await?;
                let root = comm.reduce(n - 1, &mine, Op::Max).await?;
                Ok::<_, Error>((all, root))
            })
            .await;
            for (rank, r) in got.into_iter().enumerate() {
                let (all, root) = r.unwrap();
                let ok = all
                    .iter()
                    .enumerate()
                    .all(|(i, &v)| v == (0..n as u64).map(|r| i as u64 ^ r).sum::<u64>());
                assert!(ok, "{algorithm:?} n={n} rank={rank}: wrong sum");
                match root {
                    Some(m) => {
                        assert_eq!(rank, n - 1);
                        let ok = m.iter().enumerate().all(|(i, &v)| {
                            v == (0..n as u64).map(|r| i as u64 ^ r).max().unwrap_or(0)
                        });
                        assert!(ok, "{algorithm:?} n={n}: wrong max at the root");
                    }
                    None => assert_ne!(rank, n - 1),
                }
            }
        }
    }
}

/// A rank whose vector does not split into equal blocks fails, but takes part with the whole
/// blocks it has: the others finish rather than wait for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reduce_scatter_of_a_vector_that_does_not_split_fails_only_there() {
    for n in [2, 3, 4, 7] {
        let got = job_within(
            n,
            &Config::default(),
            Duration::from_secs(10),
            move |comm| {
                let extra = usize::from(comm.rank() == 1);
                async move {
                    comm.reduce_scatter(&vec![1u64; 2 * n + extra], Op::Sum)
                        .await
                }
            },
        )
        .await;
        for (rank, g) in got.into_iter().enumerate() {
            if rank == 1 {
                assert!(matches!(g, Err(Error::InvalidArgument(_))), "n={n}: {g:?}");
            } else {
                assert_eq!(g, Ok(vec![n as u64; 2]), "n={n} rank={rank}");
            }
        }
    }
}
