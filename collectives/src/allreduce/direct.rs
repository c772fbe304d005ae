//! Allreduce by direct reads, for ranks that can read each other's memory (shared memory with
//! cross-memory attach): no message carries data, and nothing is copied but by the reads.
//!
//! The vector is cut into n nearly equal blocks; rank r owns block r. Three rounds of small
//! messages, each rank to every other, order the reads:
//!
//! 1. **Announce** its vector (see [`crate::exposure`]): if some rank cannot read every other
//!    rank's memory, they all decline, having read nothing, and the caller runs another
//!    algorithm; if the lengths differ, they all fail.
//! 2. **Reduce, then ready.** Each rank reads block r of every other vector (in pieces of
//!    [`PIECE`] bytes, which stay in cache) and combines it into block r of its own, then tells
//!    everyone its block is final. Nobody else reads block r of this rank's vector, so it can
//!    change while the others read their blocks of it.
//! 3. **Gather, then done.** On hearing that rank q is ready, a rank reads q's finished block
//!    straight into block q of its own vector (q has read that block of ours by then: it said
//!    so by being ready), then tells everyone it is done reading. A rank returns its vector —
//!    to a caller who may change or free it — only once every other rank is done with it.
//!
//! Per rank that is (n − 1)/n of the vector read to reduce and as much read into place, against
//! Rabenseifner's messages, each copied into a send buffer first and out of the receive buffer
//! after. Only commutative operations use it: the blocks are combined in the order they are
//! read.
//!
//! A failure does not stop a rank's schedule: it records the error, skips its reads, and sends
//! fault notices in place of "ready" and "done" (the [reduction messages](crate::reduce) with no
//! elements), so every rank finishes, with the error, and none waits for a message that never
//! comes. A rank that is gone makes its peers' reads and receives fail at once.

use rankweave_core::{Error, byte_copy};

use crate::Element;
use crate::exposure::{self, Announced};
use crate::reduce::{Reduction, block, even_bounds};

/// Bytes read from a peer at a time while reducing: a piece is combined while it is in cache,
/// and the scratch buffer stays small.
pub(crate) const PIECE: usize = 256 * 1024;

/// How a direct allreduce ended.
pub(crate) enum Outcome<T> {
    /// It ran: the result, or the failure recorded in the reduction.
    Ran(Vec<T>),
    /// Some rank cannot read every other's memory, so nobody read anything: `data` is as it
    /// was, for another algorithm.
    Declined(Vec<T>),
}

/// The direct allreduce of `data` (see the [module docs](self)).
pub(crate) async fn direct<T: Element>(
    reduction: &mut Reduction<T>,
    mut data: Vec<T>,
) -> Result<Outcome<T>, Error> {
    let elem = size_of::<T>();
    if elem == 0 {
        // Nothing to read (and no byte view of zero-sized elements): every rank declines alike.
        return Ok(Outcome::Declined(data));
    }
    let cx = reduction.ctx().clone();
    let (n, me) = (cx.size, cx.rank);
    let peers = || exposure::peers(&cx);

    // 1. Announce.
    let addrs = match exposure::announce(&cx, data.as_ptr() as u64, data.len()).await {
        Announced::Declined => return Ok(Outcome::Declined(data)),
        Announced::Exposed(Ok(addrs)) => addrs,
        Announced::Exposed(Err(e)) => {
            reduction.fail(e);
            vec![0; n]
        }
    };

    // 2. Reduce this rank's block, then say it is ready.
    let bounds = even_bounds(data.len(), n);
    let own = block(&bounds, me);
    if !reduction.has_failed() && !own.is_empty() {
        let per_piece = (PIECE / elem).clamp(1, own.len());
        // Bytes, so that each read can start at its source's offset modulo 64 (the kernel's
        // copy is slow 1–63 bytes off; see `byte_copy`): that keeps the elements aligned too.
        // Left uninitialized: each read writes what is then used, and zeroing a piece's worth
        // on every call cost some 3% of a 1 MiB all-reduce.
        let mut scratch: Vec<u8> = Vec::with_capacity(per_piece * elem + byte_copy::LINE_UP);
        'peers: for q in peers() {
            for start in own.clone().step_by(per_piece) {
                let piece = start..(start + per_piece).min(own.end);
                // A bogus announced address is for the kernel to refuse, not a panic here.
                let at = addrs[q].wrapping_add((piece.start * elem) as u64);
                let skip = byte_copy::aligned_skip(scratch.as_ptr(), at as usize);
                let room = &mut scratch.spare_capacity_mut()[skip..skip + piece.len() * elem];
                if let Err(e) = cx.comm.read_memory_of_uninit(q, at, room) {
                    reduction.fail(e);
                    break 'peers;
                }
                // SAFETY: the read succeeded, so it wrote every byte of `room`: they are
                // initialized, and `u8` has the layout of `MaybeUninit<u8>`.
                let bytes: &[u8] =
                    unsafe { std::slice::from_raw_parts(room.as_ptr().cast::<u8>(), room.len()) };
                let Ok(theirs) = bytemuck::try_cast_slice::<u8, T>(bytes) else {
                    // Only an announced address misaligned for `T` lands here.
                    reduction.fail(Error::Protocol {
                        peer: q,
                        detail: format!(
                            "announced a vector at {at:#x}, misaligned for its elements"
                        ),
                    });
                    break 'peers;
                };
                reduction.combine_lower(theirs, &mut data[piece]);
            }
        }
    }
    let ready: Vec<_> = peers().map(|q| (q, reduction.post(q))).collect();
    let done: Vec<_> = peers().map(|q| reduction.post(q)).collect();
    let said_ready: Vec<_> = peers().map(|q| reduction.send(q, &[])).collect();

    // 3. Read each block as its owner says it is final, then say this rank is done.
    for (q, incoming) in ready {
        match reduction.receive(incoming, 0).await {
            Ok(Some(_)) => {
                let theirs = block(&bounds, q);
                let at = addrs[q].wrapping_add((theirs.start * elem) as u64);
                let into = bytemuck::cast_slice_mut(&mut data[theirs]);
                if let Err(e) = cx.comm.read_memory_of(q, at, into) {
                    reduction.fail(e);
                }
            }
            Ok(None) => {}
            Err(e) => reduction.fail(e),
        }
    }
    let said_done: Vec<_> = peers().map(|q| reduction.send(q, &[])).collect();
    for incoming in done {
        if let Err(e) = reduction.receive(incoming, 0).await {
            reduction.fail(e);
        }
    }
    for s in said_ready.into_iter().chain(said_done) {
        if let Err(e) = s.await {
            reduction.fail(e);
        }
    }
    Ok(Outcome::Ran(data))
}
