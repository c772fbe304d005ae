//! Alltoall: rank i's block j goes to rank j, which returns the blocks it got in source-rank
//! order. A rank's block to itself is copied locally.
//!
//! - **Bruck** (small blocks): slot i of a rank starts with its block for rank + i; in round k
//!   (⌈log₂ n⌉ rounds) every slot whose index has bit k set goes to rank + 2^k, framed as blocks
//!   tagged with their slot ([`encode_blocks`]), and the same slots come back from rank − 2^k.
//!   A block travels i in total, so slot i ends holding the block from rank − i; a final
//!   inverse rotation puts them in source order. Few messages, each block sent ~log₂ n / 2 times.
//! - **Pairwise exchange** (large blocks): n − 1 steps, in step s a rank sends its block to
//!   rank + s and receives from rank − s (with a power-of-two n, both with rank XOR s, so pairs
//!   swap). Every block travels once, one partner at a time.
//! - **Linear** (few ranks): every block sent and every receive posted at once
//!   ([`linear_at_once`]).
//!
//! - **Direct reads** (`all_to_all`, ranks that can read each other's memory: one host, shared
//!   memory): at the call each rank copies its blocks for the others into a pooled buffer (the
//!   caller may change its input once the call returns) and its own block into its result; it
//!   announces the copy's address, reads its block of every peer's copy straight into its
//!   result (`process_vm_readv`) and says when it is done ([`crate::exposure`]). Every block is
//!   copied twice, where the message algorithms also receive it into a buffer of the
//!   transport's and copy it again into the result; MPI libraries, which may read the caller's
//!   own buffer for as long as the call lasts, copy it once. So does `all_to_all_bytes`: the
//!   caller's bytes are shared with the collective until every peer has read its block of
//!   them ([`DirectInput::Whole`]), and bytes not written since the last call are read from
//!   clean cache lines (twice as fast at 64 KiB here as the fresh copy).
//!
//! `all_to_all` uses the `alltoall` override if set, else direct reads from `alltoall_direct`
//! bytes per block where every rank can make them, else linear on 3 to `flat_max` ranks, else
//! pairwise from `alltoall_large` bytes per block, else Bruck. `all_to_allv` (lengths differ,
//! so ranks could not agree on a size-based choice) uses the override if set, else pairwise. Both move blocks whatever their
//! lengths, so a rank passing a different count to `all_to_all` cannot stall the others: every
//! rank finishes and the ranks that got a wrong-sized block report it.

use bytes::Bytes;
use rankweave_core::buffer_pool::BufferPool;
use rankweave_core::tuning::AlltoallAlgorithm;
use rankweave_core::{Error, RecvOp, SendOp};

use crate::ctx::{Ctx, encode_blocks, to_bytes, to_vec};
use crate::ctx::{await_all, concat_equal_blocks, decode_expected_blocks, powers_of_two_below};
use crate::exposure::{self, Exposure};
use crate::filling::Filling;
use crate::{CollectiveOp, Element};

pub(crate) async fn all_to_all<T: Element>(
    cx: Ctx,
    bytes: Bytes,
    len: usize,
) -> Result<Vec<T>, Error> {
    let n = cx.size;
    if len % n != 0 {
        return Err(Error::InvalidArgument(format!(
            "all_to_all: {len} elements do not split into {n} equal blocks"
        )));
    }
    let count = len / n;
    let block_bytes = count * std::mem::size_of::<T>();
    let blocks = (0..n)
        .map(|r| bytes.slice(r * block_bytes..(r + 1) * block_bytes))
        .collect();
    let received = exchange(&cx, choose(&cx, block_bytes), blocks).await?;
    concat_equal_blocks(&received, count)
}

/// Whether `all_to_all` with blocks of `block_bytes` tries [`direct`] reads (every rank decides
/// alike: the counts are equal).
pub(crate) fn is_direct(cx: &Ctx, block_bytes: usize) -> bool {
    let tuning = &cx.comm.config().collectives;
    match tuning.alltoall {
        Some(algorithm) => algorithm == AlltoallAlgorithm::Direct,
        None => tuning.alltoall_direct > 0 && block_bytes >= tuning.alltoall_direct,
    }
}

/// The algorithm that sends the blocks in messages, for `all_to_all` with blocks of
/// `block_bytes`: linear on 3 to `flat_max` ranks, else pairwise from `alltoall_large` and
/// Bruck below.
pub(crate) fn choose(cx: &Ctx, block_bytes: usize) -> AlltoallAlgorithm {
    let tuning = &cx.comm.config().collectives;
    let automatic = if (3..=tuning.flat_max).contains(&cx.size) {
        AlltoallAlgorithm::Linear
    } else if block_bytes >= tuning.alltoall_large {
        AlltoallAlgorithm::Pairwise
    } else {
        AlltoallAlgorithm::Bruck
    };
    tuning
        .alltoall
        .filter(|&a| a != AlltoallAlgorithm::Direct)
        .unwrap_or(automatic)
}

/// `all_to_all` of `count` elements per block by [`AlltoallAlgorithm::Linear`], started at the
/// call: every block goes out and every receive is posted there. What is left — receiving —
/// runs where the future is polled, as a barrier leaf's wait does, once the sends are out (a
/// small block's at once): nothing the other ranks wait for is left to this rank then, and a
/// task would cost a hand-off per call. A send still pending needs the task.
pub(crate) fn linear_at_once<T: Element>(
    cx: Ctx,
    bytes: Bytes,
    count: usize,
) -> CollectiveOp<Vec<T>> {
    let me = cx.rank;
    let block_bytes = count * size_of::<T>();
    let block = |r: usize| bytes.slice(r * block_bytes..(r + 1) * block_bytes);
    let (receives, mut sends) = start_linear(&cx, block);
    sends.retain(|s| !s.is_complete());
    let all_out = sends.is_empty();
    let (n, own) = (cx.size, block(me));
    let rest = async move {
        let received = finish_linear(n, me, own, receives, sends).await?;
        concat_equal_blocks(&received, count)
    };
    if all_out {
        CollectiveOp::here(me, rest)
    } else {
        CollectiveOp::start(me, rest)
    }
}

/// The start of a linear all-to-all: every receive posted, every peer sent its `block`. The
/// peers in the order after this rank, so that not every rank sends to rank 0 first.
fn start_linear(cx: &Ctx, block: impl Fn(usize) -> Bytes) -> (Vec<(usize, RecvOp)>, Vec<SendOp>) {
    let receives = exposure::peers(cx)
        .map(|q| (q, cx.comm.collective_recv(q, cx.tag)))
        .collect();
    let sends = exposure::peers(cx).map(|q| cx.send(q, block(q))).collect();
    (receives, sends)
}

/// The rest of a linear all-to-all on `n` ranks started by [`start_linear`]: every rank's
/// block in rank order, this rank's (`me`) `own` among them.
async fn finish_linear(
    n: usize,
    me: usize,
    own: Bytes,
    receives: Vec<(usize, RecvOp)>,
    sends: Vec<SendOp>,
) -> Result<Vec<Bytes>, Error> {
    let mut received = vec![Bytes::new(); n];
    received[me] = own;
    for (q, receive) in receives {
        received[q] = receive.await?.into_data();
    }
    await_all(sends).await?;
    Ok(received)
}

pub(crate) async fn all_to_allv<T: Element>(
    cx: Ctx,
    blocks: Vec<Vec<T>>,
) -> Result<Vec<Vec<T>>, Error> {
    if blocks.len() != cx.size {
        return Err(Error::InvalidArgument(format!(
            "all_to_allv: {} blocks for {} ranks",
            blocks.len(),
            cx.size
        )));
    }
    let blocks = blocks.iter().map(|block| to_bytes(block)).collect();
    let algorithm = match cx.comm.config().collectives.alltoall {
        Some(AlltoallAlgorithm::Direct) | None => AlltoallAlgorithm::Pairwise,
        Some(algorithm) => algorithm,
    };
    let received = exchange(&cx, algorithm, blocks).await?;
    received.iter().map(|block| to_vec(block)).collect()
}

/// Sends `blocks[r]` to rank r by `algorithm`; returns the block from each rank in rank order.
async fn exchange(
    cx: &Ctx,
    algorithm: AlltoallAlgorithm,
    blocks: Vec<Bytes>,
) -> Result<Vec<Bytes>, Error> {
    if cx.size == 1 {
        return Ok(blocks);
    }
    match algorithm {
        AlltoallAlgorithm::Bruck => bruck(cx, blocks).await,
        AlltoallAlgorithm::Linear => linear(cx, blocks).await,
        // Not a message algorithm: `choose` and `all_to_allv` never pass it.
        AlltoallAlgorithm::Pairwise | AlltoallAlgorithm::Direct => pairwise(cx, blocks).await,
    }
}

/// Every receive posted and every block sent at once, then all awaited: no round waits for
/// another (see [`AlltoallAlgorithm::Linear`]).
async fn linear(cx: &Ctx, blocks: Vec<Bytes>) -> Result<Vec<Bytes>, Error> {
    let (receives, sends) = start_linear(cx, |q| blocks[q].clone());
    finish_linear(cx.size, cx.rank, blocks[cx.rank].clone(), receives, sends).await
}

/// The result of an `all_to_all` by [`direct`] reads, from the caller's `data` (`size` blocks
/// of `count`): its own block in place (copied at the call).
pub(crate) fn direct_result<T: Element>(cx: &Ctx, data: &[T]) -> Filling<T> {
    let count = data.len() / cx.size;
    let mut result = Filling::new(cx.size, count);
    result.copy_block(cx.rank, &data[cx.rank * count..][..count]);
    result
}

/// What an `all_to_all` by [`direct`] reads keeps of the caller's input, in a pooled buffer
/// (its lines are warm; a fresh vector each call ran 5–10× slower).
pub(crate) enum DirectInput {
    /// Only the blocks for the other ranks, in rank order (this rank's own is in the result):
    /// what the peers read from, made where this rank can read every other's memory.
    ForPeers(Bytes),
    /// Every block: the caller's own bytes (`all_to_all_bytes`), which the peers read in
    /// place; or a copy, where this rank cannot read some peer's memory, so the direct reads
    /// will be declined and the blocks go in messages.
    Whole(Bytes),
}

impl DirectInput {
    /// The copy of `data` (`size` blocks) that an `all_to_all` by direct reads keeps.
    pub(crate) fn new<T: Element>(cx: &Ctx, data: &[T]) -> DirectInput {
        let able = exposure::peers(cx).all(|q| cx.comm.can_read_memory_of(q));
        if !able {
            return DirectInput::Whole(to_bytes(data));
        }
        let count = data.len() / cx.size;
        let (before, rest) = data.split_at(cx.rank * count);
        let after = &rest[count.min(rest.len())..];
        let parts: [&[u8]; 2] = [bytemuck::cast_slice(before), bytemuck::cast_slice(after)];
        DirectInput::ForPeers(BufferPool::shared().concat(&parts))
    }
}

/// Where block `to` sits in rank `from`'s [`DirectInput::ForPeers`]: the blocks for the other
/// ranks in rank order, `from`'s own left out.
fn index_for(from: usize, to: usize) -> usize {
    if to < from { to } else { to - 1 }
}

/// `all_to_all` by direct reads: `input` from [`DirectInput::new`], `result` from
/// [`direct_result`]; block q of the result comes straight from rank q's copy. Where some rank
/// cannot read the others' memory, by messages.
pub(crate) async fn direct<T: Element>(
    cx: Ctx,
    input: DirectInput,
    mut result: Filling<T>,
) -> Result<Vec<T>, Error> {
    let (n, me, count) = (cx.size, cx.rank, result.count());
    let block_bytes = count * size_of::<T>();
    let exposed = match &input {
        DirectInput::ForPeers(bytes) => Exposure {
            without_own: true,
            ..Exposure::at(bytes.as_ptr() as u64)
        },
        DirectInput::Whole(bytes) => Exposure::at(bytes.as_ptr() as u64),
    };
    // Zero-sized elements have no bytes to read; one rank has nobody to read from.
    if size_of::<T>() > 0 && n > 1 {
        // Each rank says whether it kept its own block beside its peers'.
        let at = |q: usize, theirs: &Exposure| theirs.block_at(q, me, block_bytes as u64);
        if let Some(read) = exposure::read_blocks(&cx, exposed, count, &mut result, at).await {
            // Only now may the input go: every peer has read its block of it.
            drop(input);
            return read.and_then(|()| result.finish());
        }
    }
    let blocks = match input {
        DirectInput::Whole(bytes) => (0..n)
            .map(|r| bytes.slice(r * block_bytes..(r + 1) * block_bytes))
            .collect(),
        DirectInput::ForPeers(bytes) => (0..n)
            .map(|r| {
                if r == me {
                    Bytes::copy_from_slice(result.block(me).unwrap_or_default())
                } else {
                    let at = index_for(me, r) * block_bytes;
                    bytes.slice(at..at + block_bytes)
                }
            })
            .collect(),
    };
    let received = exchange(&cx, choose(&cx, block_bytes), blocks).await?;
    concat_equal_blocks(&received, count)
}

async fn pairwise(cx: &Ctx, blocks: Vec<Bytes>) -> Result<Vec<Bytes>, Error> {
    let (n, me) = (cx.size, cx.rank);
    let mut received = vec![Bytes::new(); n];
    received[me] = blocks[me].clone();
    for step in 1..n {
        let (to, from) = if n.is_power_of_two() {
            (me ^ step, me ^ step)
        } else {
            ((me + step) % n, (me + n - step) % n)
        };
        let receive = cx.comm.collective_recv(from, cx.tag);
        let send = cx.send(to, blocks[to].clone());
        let (sent, got) = tokio::join!(send, receive);
        sent?;
        received[from] = got?.into_data();
    }
    Ok(received)
}

async fn bruck(cx: &Ctx, blocks: Vec<Bytes>) -> Result<Vec<Bytes>, Error> {
    let (n, me) = (cx.size, cx.rank);
    // Each round has its own source, so every receive can be posted up front.
    let receives: Vec<_> = powers_of_two_below(n)
        .map(|bit| (bit, cx.comm.collective_recv((me + n - bit) % n, cx.tag)))
        .collect();
    // Local rotation: slot i holds the block for rank me + i.
    let mut slots: Vec<Bytes> = (0..n).map(|i| blocks[(me + i) % n].clone()).collect();
    let mut sends = Vec::new();
    for (bit, receive) in receives {
        let moving: Vec<usize> = (0..n).filter(|i| i & bit != 0).collect();
        let message = encode_blocks(moving.iter().map(|&i| (i, &slots[i][..])));
        sends.push(cx.send((me + bit) % n, message));
        let from = (me + n - bit) % n;
        let message = receive.await?.into_data();
        let arrived = decode_expected_blocks(from, message, moving.iter().copied())?;
        for (&i, block) in moving.iter().zip(arrived) {
            slots[i] = block;
        }
    }
    await_all(sends).await?;
    // Inverse rotation: slot i now holds the block from rank me − i.
    Ok((0..n)
        .map(|src| slots[(me + n - src) % n].clone())
        .collect())
}
