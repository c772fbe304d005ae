//! Scatter: the root's block r to rank r, down a binomial tree rooted at the root (the
//! [`BinomialTree`] of the broadcast). Each message carries the blocks of the receiving rank's
//! whole subtree, tagged with their ranks ([`encode_blocks`]); the receiver keeps its own block
//! and passes each child the blocks of that child's subtree. ⌈log₂ n⌉ rounds; block lengths may
//! differ (`scatterv`), each rank learns its length from the message. `scatter` is `scatterv`
//! with equal blocks cut by the caller.
//!
//! Only the root can find its arguments wrong (a length that does not split into equal blocks,
//! a wrong number of blocks). It then sends its children, in place of their blocks, one block
//! of id [`REFUSED`] holding its error, which every rank passes down its own subtree before it
//! fails alike: nobody waits for blocks that will not come.

use bytes::Bytes;
use rankweave_core::{Error, SendOp};

use crate::Element;
use crate::ctx::await_all;
use crate::ctx::{Ctx, decode_blocks, encode_blocks, expected_blocks, to_vec};
use crate::tree::BinomialTree;

/// The id of the one block of a message that says the root refused its arguments (no rank has
/// this number); the block is the root's error, as text.
const REFUSED: usize = u32::MAX as usize;

/// Scatters `blocks` from `root`; a root whose caller's arguments were wrong passes the error
/// as `refusal` (and no blocks), and every rank fails with it.
pub(crate) async fn scatterv<T: Element>(
    cx: Ctx,
    root: usize,
    blocks: Vec<Vec<T>>,
    refusal: Option<Error>,
) -> Result<Vec<T>, Error> {
    let refusal = refusal.or_else(|| {
        (cx.rank == root && blocks.len() != cx.size).then(|| {
            Error::InvalidArgument(format!(
                "scatterv: the root passed {} blocks for {} ranks",
                blocks.len(),
                cx.size
            ))
        })
    });
    if cx.size == 1 {
        return match refusal {
            Some(e) => Err(e),
            None => Ok(blocks.into_iter().next().unwrap_or_default()),
        };
    }
    let tree = BinomialTree::new(&cx, root);
    match tree.parent() {
        None => {
            if let Some(e) = refusal {
                return refuse(&cx, &tree, e).await;
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
            let blocks = decode_blocks(parent, message)?;
            if let [(REFUSED, said)] = &blocks[..] {
                let said = String::from_utf8_lossy(said);
                let e = Error::InvalidArgument(format!("scatter: the root refused: {said}"));
                return refuse(&cx, &tree, e).await;
            }
            let ranks = tree.subtree().map(|r| tree.absolute(r));
            let subtree = expected_blocks(parent, blocks, ranks)?;
            let subtree: Vec<&[u8]> = subtree.iter().map(|b| &b[..]).collect();
            let sends = send_to_children(&cx, &tree, &subtree);
            let own = to_vec(subtree[0])?;
            await_all(sends).await?;
            Ok(own)
        }
    }
}

/// Tells each child the root refused its arguments (the root's error `e`), then fails with it.
async fn refuse<T>(cx: &Ctx, tree: &BinomialTree, e: Error) -> Result<T, Error> {
    let said = Bytes::from(e.to_string());
    let sends: Vec<SendOp> = tree
        .children()
        .map(|child| cx.send(child.rank, encode_blocks([(REFUSED, &said[..])])))
        .collect();
    await_all(sends).await?;
    Err(e)
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
