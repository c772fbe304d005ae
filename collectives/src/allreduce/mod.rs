//! Allreduce: every rank gets `x₀ ∘ x₁ ∘ … ∘ xₙ₋₁`.
//!
//! # Choice
//!
//! The `allreduce` override of [`CollectiveTuning`](rankweave_core::CollectiveTuning) if set;
//! otherwise, for a commutative operation from `allreduce_direct` bytes on (twice that on
//! two ranks; from a half of it, a quarter on two ranks, for vectors that fit the ranks'
//! shared-memory arenas, which peers read with loads: see [`direct_from`]), [direct
//! reads](direct) where every rank can read the others' memory; else
//! recursive doubling below `allreduce_large` bytes and Rabenseifner from there — except on two
//! ranks, which exchange their whole vectors once (recursive doubling): there Rabenseifner's
//! halving saves half of the combining but costs a second exchange, and measured 1.05–1.45×
//! slower from 32 KiB to 1 MiB over shared memory — unless its halves go inline through a
//! shared-memory ring (`RANKWEAVE_SHM_INLINE`) and the whole vector does not (from 32 KiB to
//! 64 KiB by default), where two exchanges of inline halves take 0.55–0.6× the time of one
//! exchange of the whole.
//! Recursive doubling and Rabenseifner keep rank order, so they serve every operation. The ring
//! does not (a block's partial result travels around the ring, wrapping from rank n − 1 to 0), so
//! a forced ring with a non-commutative operation falls back to the automatic choice.
//!
//! # Algorithms
//!
//! - **Recursive doubling**: in round k, virtual ranks `v` and `v ^ 2ᵏ` exchange their whole
//!   partial results and combine them: log₂ p rounds of the whole vector. Best when latency
//!   dominates.
//! - **Rabenseifner**: a reduce-scatter by recursive halving (partners `v ^ 1`, `v ^ 2`, …, each
//!   round exchanging half of the blocks still held, so every rank ends with one of p nearly equal
//!   blocks fully reduced), then an allgather by recursive doubling that retraces those rounds in
//!   reverse: about 2× the vector per rank whatever n. Best for large vectors. Any length works:
//!   blocks differ by at most one element, and may be empty.
//! - **Ring**: n − 1 steps of reduce-scatter around the ring (each rank passes one block, of n, to
//!   its right neighbour and combines the one from its left), then n − 1 steps of allgather the
//!   same way. Any n, no folding; bandwidth-optimal, but 2(n − 1) steps of latency.
//!
//! # Non-power-of-two sizes and order
//!
//! Recursive doubling and Rabenseifner run on p ranks, p the largest power of two ≤ n (MPICH's
//! scheme, [`Fold`]): of the first 2·(n − p) ranks, each even rank hands its vector to the odd
//! rank above, which combines `lower ∘ higher` and stands for both; the p remaining ranks get
//! virtual ranks `0..p` in rank order, so each stands for a contiguous range of ranks. In round k a
//! virtual rank's partial covers the aligned group of 2ᵏ virtual ranks around it and its partner's
//! the adjacent group, so combining the lower group's partial on the left keeps rank order. At the
//! end the odd ranks send the result to their even partners.

use rankweave_core::tuning::AllreduceAlgorithm;
use rankweave_core::{Error, byte_copy, wire};

mod direct;
mod input;

use crate::ctx::{Ctx, powers_of_two_below};
use crate::reduce::{KIND_LEN, Reduction, Side, Theirs, block, even_bounds};
use crate::{CollectiveOp, Element, ReduceOp};
use direct::Outcome;
pub(crate) use input::Input;

/// Runs the all-reduce of `input` by `algorithm` (from [`choose`], made at the call: it also
/// decides where [`Input`] keeps the copy).
pub(crate) async fn run<T: Element>(
    cx: Ctx,
    input: Input<T>,
    op: ReduceOp<T>,
    algorithm: AllreduceAlgorithm,
) -> Result<Vec<T>, Error> {
    let mut reduction = Reduction::new(cx, op);
    let result = match algorithm {
        AllreduceAlgorithm::RecursiveDoubling => {
            recursive_doubling(&mut reduction, input.into_vec()).await?
        }
        // Boxed, as the large broadcasts are: the small-message future stays small.
        AllreduceAlgorithm::Rabenseifner => {
            Box::pin(rabenseifner(&mut reduction, input.into_vec())).await?
        }
        AllreduceAlgorithm::Ring => Box::pin(ring(&mut reduction, input.into_vec())).await?,
        AllreduceAlgorithm::Direct => Box::pin(direct_or_messages(&mut reduction, input)).await?,
    };
    reduction.finish(result)
}

/// Direct reads where every rank can make them, else the automatic choice among the others.
async fn direct_or_messages<T: Element>(
    reduction: &mut Reduction<T>,
    input: Input<T>,
) -> Result<Vec<T>, Error> {
    match direct::direct(reduction, input).await? {
        Outcome::Ran(result) => Ok(result),
        Outcome::Declined(input) => {
            let data = input.into_vec();
            let choice = by_messages(reduction.ctx(), data.len(), size_of::<T>());
            if choice == AllreduceAlgorithm::RecursiveDoubling {
                recursive_doubling(reduction, data).await
            } else {
                rabenseifner(reduction, data).await
            }
        }
    }
}

/// Where direct reads start, for `bytes` of vector on the ranks of `cx` (see [`choose`]).
///
/// Read with `process_vm_readv`, on two ranks from twice `allreduce_direct`: there the one
/// exchange of the whole vector, which may take the pipelined copy through the ring, kept up
/// with the reads to 256 KiB (from 512 KiB: 9 interleaved rounds there, 115 µs against 137
/// by the exchange). Read with loads from the peers' arenas (a vector that fits the arena,
/// `RANKWEAVE_SHM_ARENA`), from a quarter of `allreduce_direct` on two ranks and half of it on
/// more: 7 interleaved rounds, 2 ranks pinned, 64 KiB in 15.9 µs against 17.7 by
/// Rabenseifner's inline halves, 128 KiB 24.5 against 37.2; 4 ranks on 2 cores, 128 KiB 87
/// against 120 (64 KiB 55 against 47: not there). Which way the peers read does not change
/// the algorithm, so every rank decides from the settings and the length alone: a rank whose
/// arena is taken at the call is read with `process_vm_readv` all the same.
fn direct_from(cx: &Ctx, bytes: usize) -> usize {
    let config = cx.comm.config();
    let direct = config.collectives.allreduce_direct;
    match (config.shm.arena_bytes >= bytes, cx.size) {
        (true, 2) => direct / 4,
        (true, _) => direct / 2,
        (false, 2) => direct.saturating_mul(2),
        (false, _) => direct,
    }
}

/// The algorithm for `len` elements (see the [module docs](self)).
pub(crate) fn choose<T: Element>(cx: &Ctx, op: &ReduceOp<T>, len: usize) -> AllreduceAlgorithm {
    let tuning = &cx.comm.config().collectives;
    let bytes = len * size_of::<T>();
    let from = direct_from(cx, bytes);
    let direct = tuning.allreduce_direct > 0 && bytes >= from;
    let automatic = if direct && op.is_commutative() {
        AllreduceAlgorithm::Direct
    } else {
        by_messages(cx, len, size_of::<T>())
    };
    match tuning.allreduce {
        Some(AllreduceAlgorithm::Ring | AllreduceAlgorithm::Direct) if !op.is_commutative() => {
            automatic
        }
        Some(forced) => forced,
        None => automatic,
    }
}

/// The automatic choice among the algorithms that send the data in messages, for `len`
/// elements of `elem` bytes.
fn by_messages(cx: &Ctx, len: usize, elem: usize) -> AllreduceAlgorithm {
    if cx.size == 2 {
        // One exchange of the whole vector: Rabenseifner's halving saves half of the combining
        // but adds a second exchange, and measured slower at every size up to 1 MiB — except
        // where its halves go inline through a shared-memory ring and the whole vector does
        // not (2 ranks pinned, 5 interleaved rounds: 36, 48 and 64 KiB in 9.6, 12.0 and
        // 16.7 µs against 16.6, 20.7 and 29.1 by one exchange).
        return if only_halves_inline(cx, len, elem) {
            AllreduceAlgorithm::Rabenseifner
        } else {
            AllreduceAlgorithm::RecursiveDoubling
        };
    }
    if len * elem < cx.comm.config().collectives.allreduce_large {
        AllreduceAlgorithm::RecursiveDoubling
    } else {
        AllreduceAlgorithm::Rabenseifner
    }
}

/// Whether, on two ranks, a reduction message of half of `len` elements goes inline through
/// a shared-memory ring (`RANKWEAVE_SHM_INLINE`, frame header and kind byte included) and one
/// of all of them does not. Decided from the settings alone, so both ranks agree.
fn only_halves_inline(cx: &Ctx, len: usize, elem: usize) -> bool {
    let inline = cx.comm.config().shm.inline_max;
    let message = |elements: usize| wire::EAGER_HEADER_LEN + elements * elem + KIND_LEN;
    message(len) > inline && message(len.div_ceil(2)) <= inline
}

/// The all-reduce of two ranks by recursive doubling: one exchange, started at the call; what
/// is left is to combine the partner's vector, at once if it was already here, where the
/// caller polls otherwise (see [`CollectiveOp::exchanged`]).
pub(crate) fn pair<T: Element>(cx: Ctx, mut data: Vec<T>, op: ReduceOp<T>) -> CollectiveOp<Vec<T>> {
    let (rank, partner) = (cx.rank, 1 - cx.rank);
    let mut reduction = Reduction::new(cx, op);
    let (sent, received) = reduction.start_exchange(partner, &data);
    CollectiveOp::exchanged(rank, sent, received, move |message| {
        reduction.combine_message(partner, message.into_data(), &mut data);
        reduction.finish(data)
    })
}

async fn recursive_doubling<T: Element>(
    reduction: &mut Reduction<T>,
    data: Vec<T>,
) -> Result<Vec<T>, Error> {
    let fold = Fold::new(reduction.size());
    let len = data.len();
    let (vrank, mut data) = match fold_in(reduction, &fold, data).await? {
        Folded::Out { partner } => return receive_result(reduction, partner, len).await,
        Folded::In { vrank, data } => (vrank, data),
    };
    // The masks of `doubling_masks` without collecting them: no vector for the small
    // messages this serves.
    for mask in powers_of_two_below(fold.pof2) {
        let partner = vrank ^ mask;
        if let Some(theirs) = reduction.exchange(fold.rank(partner), &data, len).await? {
            reduction.combine(&mut data, theirs, Side::of(partner, vrank));
        }
    }
    fold_out(reduction, &fold, &data).await?;
    Ok(data)
}

async fn rabenseifner<T: Element>(
    reduction: &mut Reduction<T>,
    data: Vec<T>,
) -> Result<Vec<T>, Error> {
    let fold = Fold::new(reduction.size());
    let len = data.len();
    let (vrank, mut data) = match fold_in(reduction, &fold, data).await? {
        Folded::Out { partner } => return receive_result(reduction, partner, len).await,
        Folded::In { vrank, data } => (vrank, data),
    };
    let bounds = even_bounds(len, fold.pof2);
    let masks = fold.doubling_masks();
    let held = halving_reduce_scatter(reduction, &fold, vrank, &mut data, &bounds, &masks).await?;
    doubling_allgather(reduction, &fold, vrank, &mut data, &bounds, &masks, held).await?;
    fold_out(reduction, &fold, &data).await?;
    Ok(data)
}

/// The ring over all n ranks (commutative operations only; see the [module docs](self)).
async fn ring<T: Element>(reduction: &mut Reduction<T>, mut data: Vec<T>) -> Result<Vec<T>, Error> {
    let (n, me) = (reduction.size(), reduction.rank());
    let bounds = even_bounds(data.len(), n);
    let (left, right) = ((me + n - 1) % n, (me + 1) % n);
    // Block b starts at rank b + 1 and travels right, each rank adding its part, until it ends,
    // complete, at rank b. In step s, rank `me` passes on block me − 1 − s and adds to me − 2 − s.
    for step in 0..n - 1 {
        let (passed, added) = ((me + 2 * n - 1 - step) % n, (me + 2 * n - 2 - step) % n);
        let incoming = reduction.post(left);
        let sent = reduction.send(right, &data[block(&bounds, passed)]);
        let arriving = block(&bounds, added);
        if let Some(theirs) = reduction.receive(incoming, arriving.len()).await? {
            // Only commutative operations get here, so the side does not matter.
            reduction.combine(&mut data[arriving], theirs, Side::Lower);
        }
        sent.await?;
    }
    // Now rank `me` holds block me complete; in step s it passes on block me − s.
    for step in 0..n - 1 {
        let (passed, copied) = ((me + n - step) % n, (me + 2 * n - 1 - step) % n);
        let incoming = reduction.post(left);
        let sent = reduction.send(right, &data[block(&bounds, passed)]);
        let arriving = block(&bounds, copied);
        if let Some(theirs) = reduction.receive(incoming, arriving.len()).await? {
            byte_copy::copy_slice(&mut data[arriving], &theirs);
        }
        sent.await?;
    }
    Ok(data)
}

/// MPICH's reduction of n ranks to p, the largest power of two ≤ n (see the
/// [module docs](self)): of the first 2·rem ranks (rem = n − p) the even ones hand their data to
/// the odd ones, which get virtual ranks `0..rem`; ranks from 2·rem on get virtual ranks
/// `rem..p`.
pub(crate) struct Fold {
    pub pof2: usize,
    pub rem: usize,
}

/// Where a rank stands after [`fold_in`].
pub(crate) enum Folded<T> {
    /// An even rank below 2·rem: it handed its data to `partner` and waits for what it sends
    /// back.
    Out { partner: usize },
    /// A rank among the p that go on, with its virtual rank and (partial) data.
    In { vrank: usize, data: Vec<T> },
}

impl Fold {
    pub fn new(n: usize) -> Fold {
        let pof2 = if n.is_power_of_two() {
            n
        } else {
            n.next_power_of_two() / 2
        };
        Fold {
            pof2,
            rem: n - pof2,
        }
    }

    /// The rank that virtual rank `vrank` stands for (the odd one of a pair).
    pub fn rank(&self, vrank: usize) -> usize {
        if vrank < self.rem {
            2 * vrank + 1
        } else {
            vrank + self.rem
        }
    }

    /// The first of the ranks that virtual rank `vrank` stands for; `vrank = p` gives n.
    pub fn first_rank(&self, vrank: usize) -> usize {
        if vrank < self.rem {
            2 * vrank
        } else {
            vrank + self.rem
        }
    }

    /// Partner distances 1, 2, 4, …, p/2.
    pub fn doubling_masks(&self) -> Vec<usize> {
        powers_of_two_below(self.pof2).collect()
    }
}

/// Folds the first 2·rem ranks pairwise (see [`Fold`]).
pub(crate) async fn fold_in<T: Element>(
    reduction: &mut Reduction<T>,
    fold: &Fold,
    data: Vec<T>,
) -> Result<Folded<T>, Error> {
    let me = reduction.rank();
    if me >= 2 * fold.rem {
        return Ok(Folded::In {
            vrank: me - fold.rem,
            data,
        });
    }
    if me % 2 == 0 {
        reduction.send(me + 1, &data).await?;
        return Ok(Folded::Out { partner: me + 1 });
    }
    let mut data = data;
    let incoming = reduction.post(me - 1);
    if let Some(lower) = reduction.receive(incoming, data.len()).await? {
        reduction.combine(&mut data, lower, Side::Lower);
    }
    Ok(Folded::In {
        vrank: me / 2,
        data,
    })
}

/// Gives the result back to the ranks that folded out: odd ranks below 2·rem send to the even
/// rank below them.
async fn fold_out<T: Element>(
    reduction: &Reduction<T>,
    fold: &Fold,
    result: &[T],
) -> Result<(), Error> {
    let me = reduction.rank();
    if me < 2 * fold.rem && me % 2 == 1 {
        reduction.send(me - 1, result).await?;
    }
    Ok(())
}

/// What a folded-out rank gets back from its `partner`.
async fn receive_result<T: Element>(
    reduction: &mut Reduction<T>,
    partner: usize,
    len: usize,
) -> Result<Vec<T>, Error> {
    let incoming = reduction.post(partner);
    Ok(reduction
        .receive(incoming, len)
        .await?
        .map(Theirs::into_vec)
        .unwrap_or_default())
}

/// Blocks `lo..hi` of a partition of the vector into p blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Blocks {
    lo: usize,
    hi: usize,
}

impl Blocks {
    /// The elements these blocks cover.
    fn elements(self, bounds: &[usize]) -> std::ops::Range<usize> {
        bounds[self.lo]..bounds[self.hi]
    }
}

/// Reduce-scatter by recursive halving among the p virtual ranks. `bounds` cuts the vector into
/// p blocks; in each round (partner `vrank ^ mask`, masks in the given order) the two partners
/// split the blocks they both hold in halves, the lower virtual rank keeping the lower half, and
/// each sends the other half and combines the half it keeps. Returns the block this rank ends
/// with: `vrank` when the masks decrease (p/2, …, 1), its bit reversal when they increase.
///
/// With increasing masks a partial always covers an aligned group of virtual ranks, so combining
/// by [`Side`] keeps rank order; with decreasing masks it does not, which is fine for the
/// commutative operations that use them.
pub(crate) async fn halving_reduce_scatter<T: Element>(
    reduction: &mut Reduction<T>,
    fold: &Fold,
    vrank: usize,
    data: &mut [T],
    bounds: &[usize],
    masks: &[usize],
) -> Result<Blocks, Error> {
    let mut held = Blocks {
        lo: 0,
        hi: fold.pof2,
    };
    for &mask in masks {
        let partner = vrank ^ mask;
        let mid = (held.lo + held.hi) / 2;
        let lower = Blocks {
            lo: held.lo,
            hi: mid,
        };
        let upper = Blocks {
            lo: mid,
            hi: held.hi,
        };
        let (keep, give) = if vrank < partner {
            (lower, upper)
        } else {
            (upper, lower)
        };
        let kept = keep.elements(bounds);
        let received = reduction
            .exchange(fold.rank(partner), &data[give.elements(bounds)], kept.len())
            .await?;
        if let Some(theirs) = received {
            reduction.combine(&mut data[kept], theirs, Side::of(partner, vrank));
        }
        held = keep;
    }
    Ok(held)
}

/// Allgather by recursive doubling, retracing [`halving_reduce_scatter`] with the same `masks`
/// in reverse: in each round the partners swap the blocks they hold, which are adjacent.
async fn doubling_allgather<T: Element>(
    reduction: &mut Reduction<T>,
    fold: &Fold,
    vrank: usize,
    data: &mut [T],
    bounds: &[usize],
    masks: &[usize],
    mut held: Blocks,
) -> Result<(), Error> {
    for &mask in masks.iter().rev() {
        let partner = vrank ^ mask;
        let width = held.hi - held.lo;
        let theirs = if vrank < partner {
            Blocks {
                lo: held.hi,
                hi: held.hi + width,
            }
        } else {
            Blocks {
                lo: held.lo - width,
                hi: held.lo,
            }
        };
        let arriving = theirs.elements(bounds);
        let received = reduction
            .exchange(
                fold.rank(partner),
                &data[held.elements(bounds)],
                arriving.len(),
            )
            .await?;
        if let Some(blocks) = received {
            byte_copy::copy_slice(&mut data[arriving], &blocks);
        }
        held = Blocks {
            lo: held.lo.min(theirs.lo),
            hi: held.hi.max(theirs.hi),
        };
    }
    Ok(())
}
