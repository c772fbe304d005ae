//! The two-rank case of allgather and alltoall: each rank sends the other one block and gets
//! one back, and the result is the two blocks in rank order. The blocks go as they are (the
//! only block a message can carry is its sender's), the send is made at the call, and what is
//! left is one receive, made where the caller polls (see [`CollectiveOp::receiving`]).

use crate::ctx::{Ctx, concat_equal_blocks};
use crate::{CollectiveOp, Element};

/// Sends `theirs` to the other rank of a two-rank communicator and keeps `mine`; resolves to
/// the two ranks' blocks in rank order, each `count` elements (a block of another length is
/// reported after the exchange, as the other algorithms report it).
pub(crate) fn swap<T: Element>(
    cx: Ctx,
    mine: &[T],
    theirs: &[T],
    count: usize,
) -> CollectiveOp<Vec<T>> {
    let (me, other) = (cx.rank, 1 - cx.rank);
    // The send first (what the other rank waits for), then the receive.
    let sent = cx.send_parts(other, &[bytemuck::cast_slice(theirs)]);
    let recv = cx.comm.collective_recv(other, cx.tag);
    let mine = bytemuck::cast_slice::<T, u8>(mine).to_vec();
    CollectiveOp::receiving(me, Some(sent), recv, move |message| {
        let got = message.into_data();
        let blocks: [&[u8]; 2] = if me == 0 {
            [&mine, &got]
        } else {
            [&got, &mine]
        };
        concat_equal_blocks::<T>(&blocks, count)
    })
}
