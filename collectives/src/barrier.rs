//! Barriers. Two algorithms, chosen by communicator size (see
//! [`BarrierAlgorithm`](rankweave_core::tuning::BarrierAlgorithm)):
//!
//! - **Dissemination** (Hensgen, Finkel and Manber): in round k every rank signals the rank 2^k
//!   ahead and waits for the one 2^k behind; after ⌈log₂ n⌉ rounds everyone has heard, directly
//!   or not, from everyone. Works for any n, no power of two needed.
//! - **Linear** (Open MPI's `basic_linear`, its choice for 4 to 7 ranks): every rank signals
//!   rank 0 and waits for its release; rank 0 releases everyone once it has heard from all. Two
//!   hops whatever n, and rank 0 leaves first: a broadcast it starts next is on its way before
//!   the others are out, which on a host with more ranks than cores saves each of them a turn
//!   of the scheduler. A rank other than 0 has one exchange with rank 0, so it needs no task.
//!
//! Two ranks make one exchange ([`pair`]): the dissemination barrier of two, one hop, after
//! which the rank that came last leaves first. Forced (`RANKWEAVE_BARRIER=linear`), two ranks
//! run the linear barrier instead: a hop more (0.77 µs against 0.42 here), but rank 0 leaves
//! first, so in `osu_bcast`'s loop of an 8-byte broadcast from rank 0 and a barrier, rank 1
//! finds the next broadcast on its way when it gets out: 0.28 µs per broadcast against 0.37
//! (`bench/ab 7 2 bcast '-m 8:8' new= lin=RANKWEAVE_BARRIER:linear`; MPICH, whose barrier
//! on shared memory is a gather and a release through flags, 0.32).

use bytes::Bytes;
use rankweave_core::tuning::BarrierAlgorithm;
use rankweave_core::{Communicator, Error};

use crate::CollectiveOp;
use crate::ctx::Ctx;
use crate::tree::modular_add;

/// The algorithm for `comm` (of more than 2 ranks).
pub(crate) fn choose(comm: &Communicator) -> BarrierAlgorithm {
    let tuning = &comm.config().collectives;
    tuning.barrier.unwrap_or(if comm.size() <= tuning.flat_max {
        BarrierAlgorithm::Linear
    } else {
        BarrierAlgorithm::Dissemination
    })
}

pub(crate) async fn dissemination(cx: Ctx) -> Result<(), Error> {
    let (n, me) = (cx.size, cx.rank);
    let mut step = 1;
    while step < n {
        // Each round hears from a different rank, so one tag serves every round.
        let from = modular_add(me, n - step, n);
        let to = modular_add(me, step, n);
        let recv = cx.comm.collective_recv(from, cx.tag);
        cx.send(to, Bytes::new()).await?;
        recv.await?;
        step *= 2;
    }
    Ok(())
}

/// A rank other than 0 in the linear barrier: its signal to rank 0 goes out at the call, and
/// what is left is rank 0's release (already here if rank 0 was waiting for this rank last).
pub(crate) fn linear_leaf(comm: &Communicator) -> CollectiveOp<()> {
    let (me, tag) = (comm.rank(), comm.next_collective());
    let (sent, released) = comm.collective_exchange(0, tag, &[], 0);
    CollectiveOp::exchanged(me, sent, released, |_| Ok(()))
}

/// Rank 0 in the linear barrier: hears from every other rank, then releases them all.
pub(crate) async fn linear_root(cx: Ctx) -> Result<(), Error> {
    // Every receive is posted before the first wait, so arrivals in any order match at once.
    let arrivals: Vec<_> = (1..cx.size)
        .map(|r| cx.comm.collective_recv(r, cx.tag))
        .collect();
    for arrival in arrivals {
        arrival.await?;
    }
    // Every release goes out before any is waited for: one slow rank does not hold up the
    // others' (an eager send of nothing is complete at once anyway).
    let releases: Vec<_> = (1..cx.size).map(|r| cx.send(r, Bytes::new())).collect();
    for release in releases {
        release.await?;
    }
    Ok(())
}

/// The barrier of two ranks: one exchange of empty messages, whose signal goes out at the
/// call; if the other rank's is already here, the barrier is over then, and otherwise what is
/// left is to hear from it (see [`CollectiveOp::exchanged`]).
pub(crate) fn pair(comm: &Communicator) -> CollectiveOp<()> {
    let (me, tag) = (comm.rank(), comm.next_collective());
    let other = 1 - me;
    let (sent, received) = comm.collective_exchange(other, tag, &[], other);
    CollectiveOp::exchanged(me, sent, received, |_| Ok(()))
}
