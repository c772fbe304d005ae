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
//! # Reads by loads
//!
//! A rank whose copy of its input is in its [arena](rankweave_core::arena) (see [`Input`])
//! says so in its announcement. Its peers, which have that arena mapped, then combine its
//! block straight from there and copy its finished block out of it with loads: no
//! `process_vm_readv`, no scratch copy before the combine. Such a rank reduces its own block
//! in the arena and builds its result in a vector of its own, since the arena cannot be handed
//! to the caller. Either way a peer that cannot map the arena reads the same bytes with
//! `process_vm_readv` at the announced address.
//!
//! A failure does not stop a rank's schedule: it records the error, skips its reads, and sends
//! fault notices in place of "ready" and "done" (the [reduction messages](crate::reduce) with no
//! elements), so every rank finishes, with the error, and none waits for a message that never
//! comes. A rank that is gone makes its peers' reads and receives fail at once.

use std::ops::Range;

use rankweave_core::{Error, PeerArena, byte_copy};

use super::Input;
use crate::Element;
use crate::ctx::Ctx;
use crate::exposure::{self, Announced, Exposure};
use crate::filling::Filling;
use crate::reduce::{Reduction, block, even_bounds};

/// Bytes read from a peer at a time while reducing with `process_vm_readv`: a piece is
/// combined while it is in cache, and the scratch buffer stays small.
pub(crate) const PIECE: usize = 256 * 1024;

/// How a direct allreduce ended.
pub(crate) enum Outcome<T> {
    /// It ran: the result, or the failure recorded in the reduction.
    Ran(Vec<T>),
    /// Some rank cannot read every other's memory, so nobody read anything: the input is as it
    /// was, for another algorithm.
    Declined(Input<T>),
}

/// How this rank reads one peer's vector.
enum Source {
    /// With loads, from the peer's arena mapped here.
    Arena(PeerArena),
    /// With `process_vm_readv`, at this address in the peer's process.
    Kernel(u64),
}

impl Source {
    /// How to read rank `q`'s vector, `exposed` there; this rank's own is never read.
    fn of(cx: &Ctx, q: usize, exposed: Exposure) -> Source {
        let peer = q != cx.rank && exposed.in_arena;
        let mapped = peer.then(|| cx.comm.peer_arena(q)).flatten();
        mapped.map_or(Source::Kernel(exposed.addr), Source::Arena)
    }
}

/// The bytes of elements `range` of peer `q`'s vector in its arena: `Error::Protocol` if the
/// announced vector does not fit there.
///
/// # Safety
///
/// The peer must not change those bytes while the slice lives, and must have written them
/// before a message this rank received said so.
unsafe fn arena_bytes<T: Element>(
    arena: &PeerArena,
    q: usize,
    range: Range<usize>,
) -> Result<&[T], Error> {
    let elem = size_of::<T>();
    // SAFETY: the caller's promise.
    unsafe { arena.bytes(range.start * elem..range.end * elem) }
        .and_then(|b| bytemuck::try_cast_slice(b).ok())
        .ok_or_else(|| Error::Protocol {
            peer: q,
            detail: format!(
                "announced a vector in its arena that does not fit there ({} bytes)",
                arena.len()
            ),
        })
}

/// The direct allreduce of `input` (see the [module docs](self)).
pub(crate) async fn direct<T: Element>(
    reduction: &mut Reduction<T>,
    mut input: Input<T>,
) -> Result<Outcome<T>, Error> {
    let elem = size_of::<T>();
    if elem == 0 {
        // Nothing to read (and no byte view of zero-sized elements): every rank declines alike.
        return Ok(Outcome::Declined(input));
    }
    let cx = reduction.ctx().clone();
    let (n, me, len) = (cx.size, cx.rank, input.len());
    let peers = || exposure::peers(&cx);

    // 1. Announce.
    let sources: Vec<Source> = match exposure::announce(&cx, input.exposure(), len, elem).await {
        Announced::Declined => return Ok(Outcome::Declined(input)),
        Announced::Exposed(Ok(exposed)) => (0..n).map(|q| Source::of(&cx, q, exposed[q])).collect(),
        Announced::Exposed(Err(e)) => {
            reduction.fail(e);
            (0..n).map(|_| Source::Kernel(0)).collect()
        }
    };

    // 2. Reduce this rank's block, then say it is ready.
    let bounds = even_bounds(len, n);
    let own = block(&bounds, me);
    if !reduction.has_failed() && !own.is_empty() {
        let mut scratch: Vec<u8> = Vec::new();
        for q in peers() {
            let mine = input.block_mut(own.clone());
            let combined = match &sources[q] {
                // SAFETY: `q` copied its vector into its arena before it announced it, and
                // changes no block but its own until this rank says it is done.
                Source::Arena(arena) => unsafe { arena_bytes::<T>(arena, q, own.clone()) }
                    .map(|theirs| reduction.combine_lower(theirs, mine)),
                &Source::Kernel(addr) => {
                    let at = addr.wrapping_add((own.start * elem) as u64);
                    combine_read(reduction, q, at, mine, &mut scratch)
                }
            };
            if let Err(e) = combined {
                reduction.fail(e);
                break;
            }
        }
    }
    let ready: Vec<_> = peers().map(|q| (q, reduction.post(q))).collect();
    let done: Vec<_> = peers().map(|q| reduction.post(q)).collect();
    let said_ready: Vec<_> = peers().map(|q| reduction.send(q, &[])).collect();

    // 3. Read each block as its owner says it is final, then say this rank is done. A rank
    // whose vector is in its arena fills a vector of its own.
    let mut result = match &input {
        Input::Owned(_) => None,
        Input::Arena { .. } => {
            let mut result = Filling::with_bounds(bounds.clone());
            result.copy_block(me, &input.as_slice()[own.clone()]);
            Some(result)
        }
    };
    for (q, incoming) in ready {
        match reduction.receive(incoming, 0).await {
            Ok(Some(_)) => {
                let theirs = block(&bounds, q);
                let into = match &mut result {
                    Some(result) => Target::Filling(result),
                    None => Target::InPlace(input.block_mut(theirs.clone())),
                };
                let read = read_final(&cx, q, &sources[q], theirs, into);
                if let Err(e) = read {
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
    // Every peer is done with the input: the arena may go back.
    let vector = match (input, result) {
        (Input::Owned(v), _) => v,
        (Input::Arena { .. }, Some(result)) if !reduction.has_failed() => {
            result.finish().unwrap_or_else(|e| {
                reduction.fail(e);
                Vec::new()
            })
        }
        // Failed: the reduction gives its error, not this.
        (Input::Arena { .. }, _) => Vec::new(),
    };
    Ok(Outcome::Ran(vector))
}

/// Where a rank puts the finished blocks it reads.
enum Target<'a, T> {
    /// Over the peer's block of its own input vector (this slice), which the peer is done
    /// with once its block is final.
    InPlace(&'a mut [T]),
    /// Into a result of its own (its input is in its arena).
    Filling(&'a mut Filling<T>),
}

/// Reads `q`'s finished block, elements `theirs` of its vector, from `source` `into` place.
fn read_final<T: Element>(
    cx: &Ctx,
    q: usize,
    source: &Source,
    theirs: Range<usize>,
    into: Target<'_, T>,
) -> Result<(), Error> {
    match source {
        Source::Arena(arena) => {
            // SAFETY: `q` said its block is final: it wrote it before, and changes nothing of
            // its vector until this rank says it is done.
            let block = unsafe { arena_bytes::<T>(arena, q, theirs.clone()) }?;
            match into {
                Target::InPlace(place) => byte_copy::copy_slice(place, block),
                Target::Filling(result) => result.copy_block(q, block),
            }
            Ok(())
        }
        &Source::Kernel(addr) => {
            let at = addr.wrapping_add((theirs.start * size_of::<T>()) as u64);
            match into {
                Target::InPlace(place) => {
                    cx.comm
                        .read_memory_of(q, at, bytemuck::cast_slice_mut(place))
                }
                Target::Filling(result) => result.read_block(cx, q, at),
            }
        }
    }
}

/// Reads block-sized `mine.len()` elements at `at` in rank `q`'s memory with
/// `process_vm_readv`, in pieces of [`PIECE`] bytes through `scratch`, combining each into
/// `mine`.
fn combine_read<T: Element>(
    reduction: &mut Reduction<T>,
    q: usize,
    at: u64,
    mine: &mut [T],
    scratch: &mut Vec<u8>,
) -> Result<(), Error> {
    let elem = size_of::<T>();
    let per_piece = (PIECE / elem).clamp(1, mine.len().max(1));
    if scratch.capacity() == 0 {
        // Left uninitialized: each read writes what is then used, and zeroing a piece's worth
        // on every call cost some 3% of a 1 MiB all-reduce.
        scratch.reserve(per_piece * elem + byte_copy::LINE_UP);
    }
    for (k, piece) in mine.chunks_mut(per_piece).enumerate() {
        // A bogus announced address is for the kernel to refuse, not a panic here.
        let from = at.wrapping_add((k * per_piece * elem) as u64);
        // Bytes, so that each read can start at its source's offset modulo 64 (the kernel's
        // copy is slow 1–63 bytes off; see `byte_copy`): that keeps the elements aligned too.
        let skip = byte_copy::aligned_skip(scratch.as_ptr(), from as usize);
        let room = &mut scratch.spare_capacity_mut()[skip..skip + size_of_val(piece)];
        reduction.ctx().comm.read_memory_of_uninit(q, from, room)?;
        // SAFETY: the read succeeded, so it wrote every byte of `room`: they are initialized,
        // and `u8` has the layout of `MaybeUninit<u8>`.
        let bytes: &[u8] =
            unsafe { std::slice::from_raw_parts(room.as_ptr().cast::<u8>(), room.len()) };
        let Ok(theirs) = bytemuck::try_cast_slice::<u8, T>(bytes) else {
            // Only an announced address misaligned for `T` lands here.
            return Err(Error::Protocol {
                peer: q,
                detail: format!("announced a vector at {at:#x}, misaligned for its elements"),
            });
        };
        reduction.combine_lower(theirs, piece);
    }
    Ok(())
}
