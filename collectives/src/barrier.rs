//! Dissemination barrier (Hensgen, Finkel and Manber): in round k every rank signals the rank
//! 2^k ahead and waits for the one 2^k behind; after ⌈log₂ n⌉ rounds everyone has heard,
//! directly or not, from everyone. Works for any n, no power of two needed.

use rankweave_core::{Communicator, Error};

pub(crate) async fn dissemination(comm: Communicator, tag: u32) -> Result<(), Error> {
    let n = comm.size();
    let me = comm.rank();
    let mut step = 1;
    while step < n {
        // Each round hears from a different rank, so one tag serves every round.
        let from = (me + n - step) % n;
        let to = (me + step) % n;
        let recv = comm.collective_recv(from, tag);
        comm.collective_send(to, tag, bytes::Bytes::new()).await?;
        recv.await?;
        step *= 2;
    }
    Ok(())
}
