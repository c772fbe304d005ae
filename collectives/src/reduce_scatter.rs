//! Reduce-scatter (`MPI_Reduce_scatter_block`): every rank passes n blocks of k elements, and
//! rank r gets block r of the elementwise reduction.
//!
//! - **Commutative operations: recursive halving** (MPICH's). After the [`Fold`] of a
//!   non-power-of-two n down to p ranks, virtual rank v is responsible for the blocks of the
//!   ranks it stands for (two blocks for a folded pair, one otherwise). In round k it exchanges
//!   with `v ^ p/2ᵏ⁺¹`: the two split the blocks they both still hold in halves, each sends the
//!   half the other keeps and combines the half it keeps. After log₂ p rounds every virtual rank
//!   holds its own blocks, fully reduced, and the odd rank of a folded pair sends its even partner
//!   that rank's block. About the whole vector per rank in log₂ p rounds (plus one whole-vector
//!   message for folded pairs). The rounds pair ranks that do not stand for adjacent ranges, so
//!   only commutative operations may use it.
//! - **Non-commutative operations: reduce, then scatter.** The order-preserving binomial
//!   [reduce](crate::reduce) to rank 0, which then sends each rank its block.

use rankweave_core::{Error, SendOp, byte_copy};

use crate::allreduce::{Fold, Folded, fold_in, halving_reduce_scatter};
use crate::ctx::Ctx;
use crate::reduce::{Reduction, Theirs, block, reduce_to};
use crate::{Element, ReduceOp};

pub(crate) async fn run<T: Element>(
    cx: Ctx,
    data: Vec<T>,
    op: ReduceOp<T>,
) -> Result<Vec<T>, Error> {
    let mut reduction = Reduction::new(cx, op);
    let mine = if reduction.op.is_commutative() {
        recursive_halving(&mut reduction, data).await?
    } else {
        reduce_then_scatter(&mut reduction, data).await?
    };
    reduction.finish(mine)
}

async fn recursive_halving<T: Element>(
    reduction: &mut Reduction<T>,
    data: Vec<T>,
) -> Result<Vec<T>, Error> {
    let (n, me) = (reduction.size(), reduction.rank());
    let per_rank = data.len() / n;
    let fold = Fold::new(n);
    let (vrank, mut data) = match fold_in(reduction, &fold, data).await? {
        Folded::Out { partner } => {
            let incoming = reduction.post(partner);
            return Ok(reduction
                .receive(incoming, per_rank)
                .await?
                .map(Theirs::into_vec)
                .unwrap_or_default());
        }
        Folded::In { vrank, data } => (vrank, data),
    };
    // Virtual rank v's block: the blocks of the ranks it stands for.
    let bounds: Vec<usize> = (0..=fold.pof2)
        .map(|v| fold.first_rank(v) * per_rank)
        .collect();
    // Decreasing partner distances leave virtual rank v with block v.
    let masks: Vec<usize> = fold.doubling_masks().into_iter().rev().collect();
    halving_reduce_scatter(reduction, &fold, vrank, &mut data, &bounds, &masks).await?;
    let mine = block(&bounds, vrank);
    if me >= 2 * fold.rem {
        return Ok(byte_copy::vec_from(&data[mine]));
    }
    // An odd rank of a folded pair: the first half is its even partner's block.
    let split = mine.start + per_rank;
    reduction.send(me - 1, &data[mine.start..split]).await?;
    Ok(byte_copy::vec_from(&data[split..mine.end]))
}

async fn reduce_then_scatter<T: Element>(
    reduction: &mut Reduction<T>,
    data: Vec<T>,
) -> Result<Vec<T>, Error> {
    let n = reduction.size();
    let per_rank = data.len() / n;
    let block_of = |rank: usize| rank * per_rank..(rank + 1) * per_rank;
    match reduce_to(reduction, 0, data).await? {
        Some(mut result) => {
            let sends: Vec<SendOp> = (1..n)
                .map(|rank| reduction.send(rank, &result[block_of(rank)]))
                .collect();
            for sent in sends {
                sent.await?;
            }
            result.truncate(per_rank);
            Ok(result)
        }
        None => {
            let incoming = reduction.post(0);
            Ok(reduction
                .receive(incoming, per_rank)
                .await?
                .map(Theirs::into_vec)
                .unwrap_or_default())
        }
    }
}
