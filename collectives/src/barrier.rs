//! Dissemination barrier (Hensgen, Finkel and Manber): in round k every rank signals the rank
//! 2^k ahead and waits for the one 2^k behind; after ⌈log₂ n⌉ rounds everyone has heard,
//! directly or not, from everyone. Works for any n, no power of two needed.

use bytes::Bytes;
use rankweave_core::Error;

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

/// The barrier of two ranks: one round, whose signal goes out at the call; what is left is to
/// hear from the other rank (see [`CollectiveOp::receiving`]).
pub(crate) fn pair(cx: Ctx) -> CollectiveOp<()> {
    let other = 1 - cx.rank;
    // The send first: it is what the other rank waits for, and the receive posted a moment
    // later still finds the signal (in the ring, or taken in and queued).
    let sent = cx.send(other, Bytes::new());
    let recv = cx.comm.collective_recv(other, cx.tag);
    CollectiveOp::receiving(cx.rank, Some(sent), recv, |_| Ok(()))
}
