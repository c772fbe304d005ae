//! The two-rank case of allgather and alltoall: each rank sends the other one block and gets
//! one back, and the result is the two blocks in rank order. The blocks go as they are (the
//! only block a message can carry is its sender's), send and receive start together at the
//! call, and what is left, if the other block was not here yet, is that receive, made where
//! the caller polls (see [`CollectiveOp::exchanged`]).

use rankweave_core::byte_copy;

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
    let (sent, received) =
        cx.comm
            .collective_exchange(other, cx.tag, &[bytemuck::cast_slice(theirs)], other);
    let mine = byte_copy::vec_from(bytemuck::cast_slice::<T, u8>(mine));
    CollectiveOp::exchanged(me, sent, received, move |message| {
        let got = message.into_data();
        let blocks: [&[u8]; 2] = if me == 0 {
            [&mine, &got]
        } else {
            [&got, &mine]
        };
        concat_equal_blocks::<T>(&blocks, count)
    })
}
