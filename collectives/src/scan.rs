//! Scan and exscan: rank r gets `x₀ ∘ … ∘ xᵣ` (inclusive) or `x₀ ∘ … ∘ xᵣ₋₁` (exclusive,
//! nothing on rank 0).
//!
//! One algorithm for both: Hillis–Steele recursive doubling (MPICH's `MPIR_Scan_generic` runs the
//! same scheme with partners `me ^ d`). Before the round at distance d = 1, 2, 4, … < n, a rank's
//! partial covers the ranks `(me − d, me]` (clipped at 0). It sends that partial to `me + d` and
//! receives the one of `(me − 2d, me − d]` from `me − d`, which it combines on the left:
//! ⌈log₂ n⌉ rounds of the whole vector, and received partials always come from lower ranks, so
//! the order is kept for non-commutative operations. The exclusive result is a second accumulator that takes the same
//! received partials, without the rank's own contribution.

use rankweave_core::Error;

use crate::ctx::Ctx;
use crate::reduce::Reduction;
use crate::{Element, ReduceOp};

pub(crate) async fn inclusive<T: Element>(
    cx: Ctx,
    data: Vec<T>,
    op: ReduceOp<T>,
) -> Result<Vec<T>, Error> {
    let mut reduction = Reduction::new(cx, op);
    let prefixes = recursive_doubling(&mut reduction, data, false).await?;
    reduction.finish(prefixes.inclusive)
}

pub(crate) async fn exclusive<T: Element>(
    cx: Ctx,
    data: Vec<T>,
    op: ReduceOp<T>,
) -> Result<Option<Vec<T>>, Error> {
    let mut reduction = Reduction::new(cx, op);
    let prefixes = recursive_doubling(&mut reduction, data, true).await?;
    reduction.finish(prefixes.exclusive)
}

struct Prefixes<T> {
    /// `x₀ ∘ … ∘ x_me`.
    inclusive: Vec<T>,
    /// `x₀ ∘ … ∘ x_{me−1}`, `None` on rank 0 or when not asked for.
    exclusive: Option<Vec<T>>,
}

async fn recursive_doubling<T: Element>(
    reduction: &mut Reduction<T>,
    data: Vec<T>,
    with_exclusive: bool,
) -> Result<Prefixes<T>, Error> {
    let (n, me, len) = (reduction.size(), reduction.rank(), data.len());
    let mut partial = data;
    let mut exclusive: Option<Vec<T>> = None;
    let mut distance = 1;
    while distance < n {
        let incoming = me.checked_sub(distance).map(|lower| reduction.post(lower));
        // Sends the partial as it was before this round (the message is a copy).
        let sent = (me + distance < n).then(|| reduction.send(me + distance, &partial));
        if let Some(incoming) = incoming {
            if let Some(lower) = reduction.receive(incoming, len).await? {
                reduction.combine_lower(&lower, &mut partial);
                if with_exclusive {
                    match exclusive.as_mut() {
                        Some(acc) => reduction.combine_lower(&lower, acc),
                        None => exclusive = Some(lower.into_vec()),
                    }
                }
            }
        }
        if let Some(sent) = sent {
            sent.await?;
        }
        distance *= 2;
    }
    Ok(Prefixes {
        inclusive: partial,
        exclusive,
    })
}
