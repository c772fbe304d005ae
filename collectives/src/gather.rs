//! Gather: every rank's block to the root, up a binomial tree rooted at the root (the
//! [`BinomialTree`] of the broadcast). Each rank receives the blocks of its children's subtrees,
//! adds its own and sends them all to its parent as one message of blocks tagged with their
//! ranks ([`encode_blocks`]); ⌈log₂ n⌉ rounds. Every received set is checked: exactly the ranks
//! of the sender's subtree, in order. `gather` (equal counts) is `gatherv` plus a check of the
//! counts at the root. Also home of the block helpers the other data-movement collectives share.

use bytes::Bytes;
use rankweave_core::{Error, SendOp};

use crate::Element;
use crate::broadcast::BinomialTree;
use crate::ctx::{Ctx, decode_blocks, encode_blocks, length_mismatch, to_bytes, to_vec};

pub(crate) async fn gather<T: Element>(
    cx: Ctx,
    root: usize,
    data: Vec<T>,
) -> Result<Option<Vec<T>>, Error> {
    let count = data.len();
    match gather_blocks(&cx, root, to_bytes(&data)).await? {
        Some(blocks) => concat_equal_blocks(&blocks, count).map(Some),
        None => Ok(None),
    }
}

pub(crate) async fn gatherv<T: Element>(
    cx: Ctx,
    root: usize,
    data: Vec<T>,
) -> Result<Option<Vec<Vec<T>>>, Error> {
    match gather_blocks(&cx, root, to_bytes(&data)).await? {
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
        .iter()
        .map(|child| cx.comm.collective_recv(child.rank, cx.tag))
        .collect();
    // The subtree's blocks in relative-rank order: this rank's, then each child's subtree.
    let mut subtree = vec![own];
    for (child, receive) in children.iter().zip(receives) {
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

/// Decodes a block set from `from` that must hold exactly the blocks of `ranks`, in that order
/// (so each in range and present once); anything else is [`Error::Protocol`].
pub(crate) fn decode_expected_blocks(
    from: usize,
    message: Bytes,
    ranks: impl ExactSizeIterator<Item = usize>,
) -> Result<Vec<Bytes>, Error> {
    let blocks = decode_blocks(from, message)?;
    let bad = |detail: String| Error::Protocol { peer: from, detail };
    if blocks.len() != ranks.len() {
        return Err(bad(format!(
            "{} blocks where {} were expected",
            blocks.len(),
            ranks.len()
        )));
    }
    blocks
        .into_iter()
        .zip(ranks)
        .map(|((id, block), expected)| {
            if id == expected {
                Ok(block)
            } else {
                Err(bad(format!(
                    "block {id} where block {expected} was expected"
                )))
            }
        })
        .collect()
}

/// Concatenates blocks that must each hold `count` elements (the block of rank i at index i);
/// another count means the ranks disagree about the collective's arguments.
pub(crate) fn concat_equal_blocks<T: Element>(
    blocks: &[Bytes],
    count: usize,
) -> Result<Vec<T>, Error> {
    let elem = std::mem::size_of::<T>();
    let block_bytes = count * elem;
    if let Some((rank, block)) = blocks
        .iter()
        .enumerate()
        .find(|(_, b)| b.len() != block_bytes)
    {
        if elem != 0 && block.len() % elem != 0 {
            return Err(Error::Misaligned {
                len: block.len(),
                elem,
            });
        }
        return Err(length_mismatch(rank, count, block.len() / elem.max(1)));
    }
    let mut out = vec![T::zeroed(); count * blocks.len()];
    let out_bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut out);
    for (i, block) in blocks.iter().enumerate() {
        out_bytes[i * block_bytes..(i + 1) * block_bytes].copy_from_slice(block);
    }
    Ok(out)
}

/// Waits for sends started earlier.
pub(crate) async fn await_all(sends: Vec<SendOp>) -> Result<(), Error> {
    for send in sends {
        send.await?;
    }
    Ok(())
}

/// The powers of two below `n`: the distances (or bits) of the logarithmic algorithms' rounds.
pub(crate) fn powers_of_two_below(n: usize) -> impl Iterator<Item = usize> {
    std::iter::successors(Some(1usize), |d| d.checked_mul(2)).take_while(move |&d| d < n)
}
