//! Gather: every rank's block to the root, up a binomial tree rooted at the root (the
//! [`BinomialTree`] of the broadcast). Each rank receives the blocks of its children's subtrees,
//! adds its own and sends them all to its parent as one message of blocks tagged with their
//! ranks ([`encode_blocks`]); ⌈log₂ n⌉ rounds. Every received set is checked: exactly the ranks
//! of the sender's subtree, in order. `gather` (equal counts) is `gatherv` plus a check of the
//! counts at the root. Also home of the block helpers the other data-movement collectives share.

use bytes::Bytes;
use rankweave_core::Error;

use crate::Element;
use crate::ctx::{Ctx, concat_equal_blocks, decode_expected_blocks, encode_blocks, to_vec};
use crate::tree::BinomialTree;

pub(crate) async fn gather<T: Element>(
    cx: Ctx,
    root: usize,
    data: Bytes,
    count: usize,
) -> Result<Option<Vec<T>>, Error> {
    match gather_blocks(&cx, root, data).await? {
        Some(blocks) => concat_equal_blocks(&blocks, count).map(Some),
        None => Ok(None),
    }
}

pub(crate) async fn gatherv<T: Element>(
    cx: Ctx,
    root: usize,
    data: Bytes,
) -> Result<Option<Vec<Vec<T>>>, Error> {
    match gather_blocks(&cx, root, data).await? {
        Some(blocks) => blocks
            .iter()
            .map(|block| to_vec(block))
            .collect::<Result<_, _>>()
            .map(Some),
        None => Ok(None),
    }
}

/// The binomial gather of byte blocks: the root gets every rank's block in rank order.
async fn gather_blocks(cx: &Ctx, root: usize, own: Bytes) -> Result<Option<Vec<Bytes>>, Error> {
    if cx.size == 1 {
        return Ok(Some(vec![own]));
    }
    let tree = BinomialTree::new(cx, root);
    let children = tree.children();
    let receives: Vec<_> = children
        .clone()
        .map(|child| cx.comm.collective_recv(child.rank, cx.tag))
        .collect();
    // The subtree's blocks in relative-rank order: this rank's, then each child's subtree.
    let mut subtree = vec![own];
    for (child, receive) in children.zip(receives) {
        let message = receive.await?.into_data();
        let ranks = child.relative.clone().map(|r| tree.absolute(r));
        subtree.extend(decode_expected_blocks(child.rank, message, ranks)?);
    }
    match tree.parent() {
        Some(parent) => {
            let ranks = tree.subtree().map(|r| tree.absolute(r));
            let message = encode_blocks(ranks.zip(subtree.iter().map(|b| &b[..])));
            cx.send(parent, message).await?;
            Ok(None)
        }
        None => {
            // Relative rank i is rank root + i: rotate into rank order.
            subtree.rotate_right(root);
            Ok(Some(subtree))
        }
    }
}
