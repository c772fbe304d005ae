//! Scatter: the root's block r to rank r, down a binomial tree rooted at the root (the
//! [`BinomialTree`] of the broadcast). Each message carries the blocks of the receiving rank's
//! whole subtree, tagged with their ranks ([`encode_blocks`]); the receiver keeps its own block
//! and passes each child the blocks of that child's subtree. ⌈log₂ n⌉ rounds; block lengths may
//! differ (`scatterv`), each rank learns its length from the message. `scatter` is `scatterv`
//! with equal blocks cut by the caller.

use rankweave_core::{Error, SendOp};

use crate::Element;
use crate::ctx::{Ctx, encode_blocks, to_vec};
use crate::ctx::{await_all, decode_expected_blocks};
use crate::tree::BinomialTree;

pub(crate) async fn scatterv<T: Element>(
    cx: Ctx,
    root: usize,
    blocks: Vec<Vec<T>>,
) -> Result<Vec<T>, Error> {
    if cx.size == 1 {
        return Ok(blocks.into_iter().next().unwrap_or_default());
    }
    let tree = BinomialTree::new(&cx, root);
    match tree.parent() {
        None => {
            if blocks.len() != cx.size {
                return Err(Error::InvalidArgument(format!(
                    "scatterv: the root passed {} blocks for {} ranks",
                    blocks.len(),
                    cx.size
                )));
            }
            // The root's subtree is every rank, in relative order from the root itself.
            let sends = {
                let subtree: Vec<&[u8]> = (0..cx.size)
                    .map(|r| bytemuck::cast_slice(&blocks[tree.absolute(r)][..]))
                    .collect();
                send_to_children(&cx, &tree, &subtree)
            };
            let own = blocks.into_iter().nth(root).unwrap_or_default();
            await_all(sends).await?;
            Ok(own)
        }
        Some(parent) => {
            let message = cx.recv(parent).await?;
            let ranks = tree.subtree().map(|r| tree.absolute(r));
            let subtree = decode_expected_blocks(parent, message, ranks)?;
            let subtree: Vec<&[u8]> = subtree.iter().map(|b| &b[..]).collect();
            let sends = send_to_children(&cx, &tree, &subtree);
            let own = to_vec(subtree[0])?;
            await_all(sends).await?;
            Ok(own)
        }
    }
}

/// Starts sending each child the blocks of its subtree; `subtree` holds this rank's subtree's
/// blocks in relative-rank order, starting with its own.
fn send_to_children(cx: &Ctx, tree: &BinomialTree, subtree: &[&[u8]]) -> Vec<SendOp> {
    tree.children()
        .map(|child| {
            let blocks = child
                .relative
                .map(|r| (tree.absolute(r), subtree[r - tree.relative]));
            cx.send(child.rank, encode_blocks(blocks))
        })
        .collect()
}
