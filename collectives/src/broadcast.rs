//! Binomial-tree broadcast: ⌈log₂ n⌉ rounds; in each, every rank that has the data sends it to
//! one that has not. Ranks are numbered relative to the root so any root works.

use bytes::Bytes;
use rankweave_core::{Communicator, Error};

pub(crate) async fn binomial(
    comm: Communicator,
    tag: u32,
    root: usize,
    data: Bytes,
) -> Result<Bytes, Error> {
    let n = comm.size();
    if root >= n {
        return Err(Error::InvalidRank {
            rank: root,
            size: n,
        });
    }
    let me = comm.rank();
    let relative = (me + n - root) % n;
    // Receive from the parent: the rank that differs in our lowest set bit.
    let mut data = data;
    let mut mask = 1;
    while mask < n {
        if relative & mask != 0 {
            let parent = (relative - mask + root) % n;
            data = comm.collective_recv(parent, tag).await?.into_data();
            break;
        }
        mask <<= 1;
    }
    // Send to children: ranks that differ in a lower bit than the one we received on.
    let mut sends = Vec::new();
    mask >>= 1;
    while mask > 0 {
        if relative + mask < n {
            let child = (relative + mask + root) % n;
            sends.push(comm.collective_send(child, tag, data.clone()));
        }
        mask >>= 1;
    }
    for s in sends {
        s.await?;
    }
    Ok(data)
}
