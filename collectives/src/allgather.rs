//! Allgather: every rank's block to every rank, in rank order.
//!
//! - **Recursive doubling** (power-of-two n): in round k a rank swaps everything it holds (the
//!   blocks of its aligned group of 2^k ranks) with the rank differing in bit k; log₂ n rounds.
//! - **Bruck** (any n): in round k a rank sends the first min(2^k, n − 2^k) blocks it holds
//!   (its own and those after it) to rank − 2^k and gets as many from rank + 2^k; ⌈log₂ n⌉
//!   rounds, then the blocks are rotated into rank order.
//! - **Ring**: n − 1 steps; in each, a rank passes the block it received in the step before to
//!   its successor. Every link carries each block once: best for large blocks.
//! - **Direct reads** (`all_gather`, ranks that can read each other's memory: one host, shared
//!   memory): each rank copies its block into its place in the result vector at the call and
//!   announces where its block is — there, or in the caller's bytes that `all_gather_bytes`
//!   holds ([`OwnBlock`]); then each reads every peer's block straight from the peer into its
//!   own result (`process_vm_readv`), and says when it is done ([`crate::exposure`]).
//!   Per rank that is its own block copied once and every other block read once, into place,
//!   as MPI libraries do with cross-memory attach — where the message algorithms copy the input
//!   into a message, receive each block into a buffer of the transport's and copy every block
//!   again into the result.
//!
//! Recursive doubling and Bruck frame their messages as blocks tagged with ranks
//! ([`encode_blocks`]); a ring message is one plain block whose rank is implied by the step.
//!
//! `all_gather` (equal counts) uses the `allgather` override if set (recursive doubling falls
//! back to Bruck when n is not a power of two), else direct reads from `allgather_direct` bytes
//! per rank where every rank can make them, else the ring from `allgather_large` bytes
//! gathered in all, else recursive doubling or Bruck. In `all_gatherv` counts differ, so ranks
//! could not agree on a size-based choice: the override if set, else Bruck. Every algorithm
//! moves the blocks whatever their lengths, so a rank passing a different count to
//! `all_gather` cannot stall the others: every rank finishes and reports the mismatch.

use bytes::Bytes;
use rankweave_core::Error;
use rankweave_core::tuning::AllgatherAlgorithm;

use crate::Element;
use crate::ctx::{Ctx, encode_blocks, to_vec};
use crate::ctx::{await_all, concat_equal_blocks, decode_expected_blocks, powers_of_two_below};
use crate::exposure::{self, Exposure};
use crate::filling::Filling;

pub(crate) async fn all_gather<T: Element>(
    cx: Ctx,
    own: Bytes,
    count: usize,
) -> Result<Vec<T>, Error> {
    let algorithm = choose_for_equal_counts(&cx, own.len());
    let blocks = gather_everywhere(&cx, algorithm, own).await?;
    concat_equal_blocks(&blocks, count)
}

pub(crate) async fn all_gatherv<T: Element>(cx: Ctx, data: Bytes) -> Result<Vec<Vec<T>>, Error> {
    let algorithm = match cx.comm.config().collectives.allgather {
        Some(AllgatherAlgorithm::Direct) | None => AllgatherAlgorithm::Bruck,
        Some(algorithm) => algorithm,
    };
    let blocks = gather_everywhere(&cx, algorithm, data).await?;
    blocks.iter().map(|block| to_vec(block)).collect()
}

/// Whether `all_gather` of `own_bytes` a rank uses a small-message algorithm (not the ring).
pub(crate) fn is_small(cx: &Ctx, own_bytes: usize) -> bool {
    choose_for_equal_counts(cx, own_bytes) != AllgatherAlgorithm::Ring
}

/// Whether `all_gather` of `own_bytes` a rank tries [`direct`] reads (every rank decides
/// alike: the counts are equal).
pub(crate) fn is_direct(cx: &Ctx, own_bytes: usize) -> bool {
    let tuning = &cx.comm.config().collectives;
    match tuning.allgather {
        Some(algorithm) => algorithm == AllgatherAlgorithm::Direct,
        None => tuning.allgather_direct > 0 && own_bytes >= tuning.allgather_direct,
    }
}

/// The algorithm that sends the blocks in messages, for `all_gather` of `own_bytes` a rank.
fn choose_for_equal_counts(cx: &Ctx, own_bytes: usize) -> AllgatherAlgorithm {
    let tuning = &cx.comm.config().collectives;
    if let Some(algorithm) = tuning
        .allgather
        .filter(|&a| a != AllgatherAlgorithm::Direct)
    {
        algorithm
    } else if cx.size.saturating_mul(own_bytes) >= tuning.allgather_large {
        AllgatherAlgorithm::Ring
    } else if cx.size.is_power_of_two() {
        AllgatherAlgorithm::RecursiveDoubling
    } else {
        AllgatherAlgorithm::Bruck
    }
}

/// Every rank's block, in rank order, by `algorithm`.
async fn gather_everywhere(
    cx: &Ctx,
    algorithm: AllgatherAlgorithm,
    own: Bytes,
) -> Result<Vec<Bytes>, Error> {
    if cx.size == 1 {
        return Ok(vec![own]);
    }
    match algorithm {
        AllgatherAlgorithm::RecursiveDoubling if cx.size.is_power_of_two() => {
            recursive_doubling(cx, own).await
        }
        AllgatherAlgorithm::RecursiveDoubling | AllgatherAlgorithm::Bruck => bruck(cx, own).await,
        AllgatherAlgorithm::Ring => ring(cx, own).await,
        // Not a message algorithm: `choose_for_equal_counts` and `all_gatherv` never pass it.
        AllgatherAlgorithm::Direct => bruck(cx, own).await,
    }
}

/// The result of an `all_gather` by [`direct`] reads: `size` blocks with this rank's `own` in
/// its place (copied at the call: the caller may change it once the call returns).
pub(crate) fn result_with_own<T: Element>(cx: &Ctx, own: &[T]) -> Filling<T> {
    let mut result = Filling::new(cx.size, own.len());
    result.copy_block(cx.rank, own);
    result
}

/// Where a rank's peers read its block in an `all_gather` by [`direct`] reads.
pub(crate) enum OwnBlock {
    /// In its place in the rank's result, where it was copied at the call (`all_gather`: the
    /// caller's slice is only borrowed for the call).
    InResult,
    /// In the caller's own bytes, which the collective holds until every peer has read them
    /// (`all_gather_bytes`): nothing is copied for the peers, and bytes the caller has not
    /// written since are read from clean cache lines rather than taken from this rank's cache
    /// line by line — twice as fast at 64 KiB here.
    Shared(Bytes),
}

/// `all_gather` by direct reads into `result` (from [`result_with_own`]): block q straight from
/// rank q (where `own` says it keeps it); or, where some rank cannot read the others' memory,
/// by messages.
pub(crate) async fn direct<T: Element>(
    cx: Ctx,
    mut result: Filling<T>,
    own: OwnBlock,
) -> Result<Vec<T>, Error> {
    let (me, count) = (cx.rank, result.count());
    // Zero-sized elements have no bytes to read; one rank has nobody to read from.
    if size_of::<T>() > 0 && cx.size > 1 {
        // Each rank announces where its own block starts.
        let mine = match &own {
            OwnBlock::InResult => result.address() + (me * count * size_of::<T>()) as u64,
            OwnBlock::Shared(bytes) => bytes.as_ptr() as u64,
        };
        let at = |_: usize, theirs: &Exposure| theirs.addr;
        if let Some(read) =
            exposure::read_blocks(&cx, Exposure::at(mine), count, &mut result, at).await
        {
            // Only now may the shared bytes go: every peer has read them.
            drop(own);
            return read.and_then(|()| result.finish());
        }
    }
    let own = match own {
        OwnBlock::Shared(bytes) => bytes,
        OwnBlock::InResult => Bytes::copy_from_slice(result.block(me).unwrap_or_default()),
    };
    let algorithm = choose_for_equal_counts(&cx, own.len());
    let blocks = gather_everywhere(&cx, algorithm, own).await?;
    concat_equal_blocks(&blocks, count)
}

async fn recursive_doubling(cx: &Ctx, own: Bytes) -> Result<Vec<Bytes>, Error> {
    let (n, me) = (cx.size, cx.rank);
    // Each round has its own partner, so every receive can be posted up front.
    let receives: Vec<_> = powers_of_two_below(n)
        .map(|bit| (bit, cx.comm.collective_recv(me ^ bit, cx.tag)))
        .collect();
    let mut blocks = vec![Bytes::new(); n];
    blocks[me] = own;
    let mut sends = Vec::new();
    for (bit, receive) in receives {
        let partner = me ^ bit;
        // Before the round for `bit`, a rank holds its aligned group of `bit` ranks.
        let mine = me & !(bit - 1);
        let theirs = partner & !(bit - 1);
        let message = encode_blocks((mine..mine + bit).map(|r| (r, &blocks[r][..])));
        sends.push(cx.send(partner, message));
        let message = receive.await?.into_data();
        let received = decode_expected_blocks(partner, message, theirs..theirs + bit)?;
        for (r, block) in (theirs..).zip(received) {
            blocks[r] = block;
        }
    }
    await_all(sends).await?;
    Ok(blocks)
}

async fn bruck(cx: &Ctx, own: Bytes) -> Result<Vec<Bytes>, Error> {
    let (n, me) = (cx.size, cx.rank);
    let receives: Vec<_> = powers_of_two_below(n)
        .map(|distance| {
            (
                distance,
                cx.comm.collective_recv((me + distance) % n, cx.tag),
            )
        })
        .collect();
    // held[i] is the block of rank me + i; before the round at distance d there are d of them.
    let mut held = vec![own];
    let mut sends = Vec::new();
    for (distance, receive) in receives {
        let count = distance.min(n - distance);
        let message = encode_blocks((0..count).map(|i| ((me + i) % n, &held[i][..])));
        sends.push(cx.send((me + n - distance) % n, message));
        let from = (me + distance) % n;
        let ranks = (0..count).map(|i| (from + i) % n);
        let message = receive.await?.into_data();
        held.extend(decode_expected_blocks(from, message, ranks)?);
    }
    await_all(sends).await?;
    held.rotate_right(me);
    Ok(held)
}

async fn ring(cx: &Ctx, own: Bytes) -> Result<Vec<Bytes>, Error> {
    let (n, me) = (cx.size, cx.rank);
    let successor = (me + 1) % n;
    let predecessor = (me + n - 1) % n;
    // Messages from one rank arrive in order, so every step's receive can be posted up front.
    let receives: Vec<_> = (1..n)
        .map(|_| cx.comm.collective_recv(predecessor, cx.tag))
        .collect();
    let mut blocks = vec![Bytes::new(); n];
    blocks[me] = own.clone();
    let mut sends = Vec::with_capacity(n - 1);
    let mut passing = own;
    for (step, receive) in (1..n).zip(receives) {
        sends.push(cx.send(successor, passing));
        // In step s the predecessor passes on the block of rank me − s.
        let block = receive.await?.into_data();
        blocks[(me + n - step) % n] = block.clone();
        passing = block;
    }
    await_all(sends).await?;
    Ok(blocks)
}
