//! Dissemination barrier (Hensgen, Finkel and Manber): in round k every rank signals the rank
//! 2^k ahead and waits for the one 2^k behind; after ⌈log₂ n⌉ rounds everyone has heard,
//! directly or not, from everyone. Works for any n, no power of two needed.

use bytes::Bytes;
use rankweave_core::{Communicator, Error};

use crate::CollectiveOp;
use crate::ctx::Ctx;

pub(crate) async fn dissemination(cx: Ctx) -> Result<(), Error> {
    let (n, me) = (cx.size, cx.rank);
    let mut step = 1;
    while step < n {
        // Each round hears from a different rank, so one tag serves every round.
        let from = (me + n - step) % n;
        let to = (me + step) % n;
        let recv = cx.comm.collective_recv(from, cx.tag);
        cx.send(to, Bytes::new()).await?;
        recv.await?;
        step *= 2;
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
