//! Barriers. Three algorithms, chosen by communicator size and by where the ranks run (see
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
//! - **Flags** ([`flags`]): the linear barrier (on two ranks, one exchange) through words in
//!   shared memory instead of messages, as MPICH's barrier on shared memory is: a hop is a
//!   cache line's trip. The world communicator of ranks that all share memory uses it on up to
//!   `flat_max` ranks.
//!
//! Two ranks without flags make one exchange of messages ([`pair`]): the dissemination barrier
//! of two, one hop, after which the rank that came last leaves first. Forced
//! (`RANKWEAVE_BARRIER=linear`), two ranks run the linear barrier instead: a hop more (0.77 µs
//! against 0.42 here), but rank 0 leaves first, so in `osu_bcast`'s loop of an 8-byte
//! broadcast from rank 0 and a barrier, rank 1 finds the next broadcast on its way when it
//! gets out: 0.28 µs per broadcast against 0.37 (`bench/ab 7 2 bcast '-m 8:8' new=
//! lin=RANKWEAVE_BARRIER:linear`; MPICH 0.32). The flag exchange of two has both: one hop, and
//! rank 1 spins on its flag while rank 0 raises its own and goes on.

use bytes::Bytes;
use rankweave_core::tuning::BarrierAlgorithm;
use rankweave_core::{Communicator, Error};

use crate::CollectiveOp;
use crate::ctx::Ctx;
use crate::flag_wait;
use crate::tree::modular_add;

/// The algorithm for `comm`: the one forced if it can run here, else on 2 to `flat_max` ranks
/// the flag barrier where it can run and the linear one where it cannot (on 2 ranks, one
/// exchange), and dissemination on more.
pub(crate) fn choose(comm: &Communicator) -> BarrierAlgorithm {
    let tuning = &comm.config().collectives;
    let n = comm.size();
    let few = n == 2 || n <= tuning.flat_max;
    let automatic = || {
        if few && flag_wait::usable(comm) {
            BarrierAlgorithm::Flags
        } else if few && n != 2 {
            BarrierAlgorithm::Linear
        } else {
            BarrierAlgorithm::Dissemination
        }
    };
    match tuning.barrier {
        Some(BarrierAlgorithm::Flags) if !flag_wait::usable(comm) => automatic(),
        Some(forced) => forced,
        None => automatic(),
    }
}

/// Set in a release flag in place of the barrier's number when a rank was found gone: the
/// low bits name it.
const FAILED: u64 = 1 << 63;

/// The barrier through flags in shared memory ([`BarrierAlgorithm::Flags`]). The barrier's
/// sequence number plus one is the value of its round; values only grow, so a flag left from
/// an earlier barrier is below the round's. Two ranks each raise their flag to the other and
/// wait for the other's: one trip of a cache line. More are linear: every other rank raises
/// its flag to rank 0, which raises its own to each of them once it saw them all, and so
/// leaves first (see the linear barrier). A rank found gone fails the round, and a rank that
/// fails raises `FAILED` and that rank's number instead of the round to those still waiting
/// for it, so they fail too rather than wait for a flag that would never come.
pub(crate) fn flags(comm: &Communicator) -> CollectiveOp<()> {
    let (me, n) = (comm.rank(), comm.size());
    let round = comm.next_collective_numbered().0 + 1;
    let comm = comm.clone();
    if n == 2 {
        let other = 1 - me;
        if let Err(e) = comm.raise_flag(other, round) {
            return CollectiveOp::failed(me, e);
        }
        // Nothing is left that the other rank waits for: the wait runs where polled.
        return CollectiveOp::here(me, async move {
            wait_for_flags(&comm, other..other + 1, round).await
        });
    }
    if me == 0 {
        return CollectiveOp::start(me, async move {
            let heard = wait_for_flags(&comm, 1..n, round).await;
            let release = failed_or(&heard, round);
            let mut result = heard;
            for r in 1..n {
                if let Err(e) = comm.raise_flag(r, release) {
                    result = result.and(Err(e));
                }
            }
            result
        });
    }
    // Rank 0 may be waiting already: the signal goes out at the call.
    if let Err(e) = comm.raise_flag(0, round) {
        return CollectiveOp::failed(me, e);
    }
    CollectiveOp::here(me, async move { wait_for_flags(&comm, 0..1, round).await })
}

/// The flag to raise after a wait that ended with `heard`: the round, or word of the rank
/// found gone.
fn failed_or(heard: &Result<(), Error>, round: u64) -> u64 {
    match heard {
        Ok(()) => round,
        Err(Error::PeerFailed { rank }) => FAILED | *rank as u64,
        // A wait fails only for a rank gone (or a bad rank, which cannot happen here).
        Err(_) => FAILED,
    }
}

/// Waits until the ranks `from` have raised their flags to this rank to at least `round` (see
/// [`Communicator::wait_on_flags`]).
async fn wait_for_flags(
    comm: &Communicator,
    from: std::ops::Range<usize>,
    round: u64,
) -> Result<(), Error> {
    comm.wait_on_flags(|| look_at_flags(comm, from.clone(), round))
        .await
}

/// `Some` once every flag from `from` reached `round`, or a rank that has not is gone, or one
/// reported a rank gone.
fn look_at_flags(
    comm: &Communicator,
    from: std::ops::Range<usize>,
    round: u64,
) -> Option<Result<(), Error>> {
    for r in from {
        let flag = match comm.flag_from(r) {
            Ok(flag) => flag,
            Err(e) => return Some(Err(e)),
        };
        if flag.value & FAILED != 0 {
            let rank = (flag.value & !FAILED) as usize;
            return Some(Err(Error::PeerFailed { rank }));
        }
        if flag.value < round {
            return flag.peer_gone.then_some(Err(Error::PeerFailed { rank: r }));
        }
    }
    Some(Ok(()))
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
