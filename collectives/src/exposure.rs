//! Buffers exposed to direct reads: what the collectives that read their peers' memory
//! (`process_vm_readv`, ranks of one host over shared memory) say to each other around the
//! reads.
//!
//! 1. **Announce.** Each rank sends every other the address and length of the buffer it
//!    exposes, and whether it can read every other rank's memory. All ranks then know the same
//!    things: if one cannot, they all decline alike, having read nothing, and run another
//!    algorithm; if the lengths differ, they all fail alike.
//! 2. The algorithm's reads, ordered by its own messages if it needs more than these.
//! 3. **Done.** Each rank tells every other it has finished reading, and waits to hear the same
//!    from all of them before it hands its buffer back to a caller who may change or free it.
//!
//! A rank that fails part-way still says it is done, so no peer waits for a message that never
//! comes; a rank that is gone makes its peers' reads and receives fail at once.

use bytes::{BufMut, Bytes, BytesMut};
use rankweave_core::Error;

use crate::Element;
use crate::ctx::{Ctx, length_mismatch};
use crate::filling::Filling;

/// An announcement: the buffer's address (u64 LE), its length in bytes (u64 LE: ranks that
/// pass the same bytes typed differently agree), and a byte of [`ABLE`], [`IN_ARENA`] and
/// [`WITHOUT_OWN`].
const ANNOUNCEMENT: usize = 17;
/// The sender can read every other rank's memory.
const ABLE: u8 = 1;
/// The buffer is at the start of the sender's [arena](rankweave_core::arena): a rank that has
/// it mapped reads it with loads.
const IN_ARENA: u8 = 2;
/// The buffer holds one block per rank but the sender's own (see [`Exposure::block_at`]).
const WITHOUT_OWN: u8 = 4;

/// Where a rank's buffer is, as it announced it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Exposure {
    /// Its address in the rank's process.
    pub addr: u64,
    /// It is at the start of the rank's arena.
    pub in_arena: bool,
    /// Of a buffer of one block per rank, in rank order: the exposing rank's own block is left
    /// out (it keeps that one elsewhere), so the blocks after it sit one place earlier.
    pub without_own: bool,
}

impl Exposure {
    /// A buffer at `addr`, not in an arena, with every block it is read for.
    pub(crate) fn at(addr: u64) -> Exposure {
        Exposure {
            addr,
            in_arena: false,
            without_own: false,
        }
    }

    /// Where the block for rank `reader` starts, in a buffer of blocks of `block_bytes` that
    /// rank `exposer` exposed: a rank may pass the collective its whole input (every block) or
    /// a copy without its own block, and its peers read either alike.
    pub(crate) fn block_at(&self, exposer: usize, reader: usize, block_bytes: u64) -> u64 {
        let index = if self.without_own && reader > exposer {
            reader - 1
        } else {
            reader
        };
        self.addr.wrapping_add(index as u64 * block_bytes)
    }
}

/// What a rank says of its buffer and of itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Announcement {
    exposure: Exposure,
    /// In bytes.
    len: usize,
    able: bool,
}

fn announcement(a: Announcement) -> Bytes {
    let mut b = BytesMut::with_capacity(ANNOUNCEMENT);
    b.put_u64_le(a.exposure.addr);
    b.put_u64_le(a.len as u64);
    let in_arena = if a.exposure.in_arena { IN_ARENA } else { 0 };
    let without_own = if a.exposure.without_own {
        WITHOUT_OWN
    } else {
        0
    };
    b.put_u8(if a.able { ABLE } else { 0 } | in_arena | without_own);
    b.freeze()
}

/// An announcement from `from`. Anything else is [`Error::Protocol`].
fn parse(from: usize, m: &[u8]) -> Result<Announcement, Error> {
    let bad = || Error::Protocol {
        peer: from,
        detail: format!("malformed direct-read announcement ({} bytes)", m.len()),
    };
    if m.len() != ANNOUNCEMENT || m[16] & !(ABLE | IN_ARENA | WITHOUT_OWN) != 0 {
        return Err(bad());
    }
    let word = |at: usize| u64::from_le_bytes(m[at..at + 8].try_into().unwrap_or_default());
    let len = usize::try_from(word(8)).map_err(|_| bad())?;
    Ok(Announcement {
        exposure: Exposure {
            addr: word(0),
            in_arena: m[16] & IN_ARENA != 0,
            without_own: m[16] & WITHOUT_OWN != 0,
        },
        len,
        able: m[16] & ABLE != 0,
    })
}

/// What the announcements said.
pub(crate) enum Announced {
    /// Some rank cannot read every other's memory: nobody reads, and nobody waits for "done".
    Declined,
    /// Every rank can: where each rank's buffer is (this rank's own included), or the failure
    /// that stops this rank's reads (it still takes part in [`done`]).
    Exposed(Result<Vec<Exposure>, Error>),
}

/// The other ranks, from the next one on (so that not every rank reads from rank 0 first).
pub(crate) fn peers(cx: &Ctx) -> impl Iterator<Item = usize> + use<> {
    let (n, me) = (cx.size, cx.rank);
    (1..n).map(move |k| (me + k) % n)
}

/// Step 1 (see the [module docs](self)) for a buffer of `len` elements of `elem` bytes (not
/// zero) at `mine`.
pub(crate) async fn announce(cx: &Ctx, mine: Exposure, len: usize, elem: usize) -> Announced {
    let (elements, len) = (len, len * elem);
    let able = peers(cx).all(|q| cx.comm.can_read_memory_of(q));
    let said = announcement(Announcement {
        exposure: mine,
        len,
        able,
    });
    let arriving: Vec<_> = peers(cx)
        .map(|q| (q, cx.comm.collective_recv(q, cx.tag)))
        .collect();
    let sent: Vec<_> = peers(cx).map(|q| cx.send(q, said.clone())).collect();
    let mut addrs = vec![mine; cx.size];
    let mut everyone_able = able;
    let mut failure = None;
    for (q, recv) in arriving {
        match recv.await.and_then(|m| parse(q, &m.into_data())) {
            Ok(theirs) if theirs.len != len => {
                failure.get_or_insert(length_mismatch(q, elements, theirs.len / elem));
            }
            Ok(theirs) => {
                addrs[q] = theirs.exposure;
                everyone_able &= theirs.able;
            }
            Err(e) => {
                failure.get_or_insert(e);
            }
        }
    }
    for s in sent {
        if let Err(e) = s.await {
            failure.get_or_insert(e);
        }
    }
    match failure {
        Some(e) => Announced::Exposed(Err(e)),
        None if !everyone_able => Announced::Declined,
        None => Announced::Exposed(Ok(addrs)),
    }
}

/// Step 3 (see the [module docs](self)): says this rank is done reading and waits until every
/// other rank is. The first failure, `failure` first.
pub(crate) async fn done(cx: &Ctx, failure: Option<Error>) -> Result<(), Error> {
    let heard: Vec<_> = peers(cx)
        .map(|q| cx.comm.collective_recv(q, cx.tag))
        .collect();
    let said: Vec<_> = peers(cx).map(|q| cx.send(q, Bytes::new())).collect();
    let mut failure = failure;
    for recv in heard {
        if let Err(e) = recv.await {
            failure.get_or_insert(e);
        }
    }
    for s in said {
        if let Err(e) = s.await {
            failure.get_or_insert(e);
        }
    }
    failure.map_or(Ok(()), Err)
}

/// Steps 1–3 for the algorithms whose reads are one block from each peer into `result`:
/// exposes `mine` (of `len` elements), reads block q of `result` from `source(q, exposure_q)`
/// in rank q's memory, and says done. `None` if the ranks declined (nothing read, `result` as
/// it was); otherwise whether this rank's part succeeded, after every peer is done with
/// `mine`.
pub(crate) async fn read_blocks<T: Element>(
    cx: &Ctx,
    mine: Exposure,
    len: usize,
    result: &mut Filling<T>,
    source: impl Fn(usize, &Exposure) -> u64,
) -> Option<Result<(), Error>> {
    let Announced::Exposed(exposures) = announce(cx, mine, len, size_of::<T>()).await else {
        return None;
    };
    let read = exposures.and_then(|exposures| {
        // A bogus announced address is for the kernel to refuse.
        peers(cx).try_for_each(|q| result.read_block(cx, q, source(q, &exposures[q])))
    });
    Some(done(cx, read.err()).await)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn announcements_round_trip_and_bad_ones_are_protocol_errors() {
        let said = |addr, in_arena, without_own, len, able| Announcement {
            exposure: Exposure {
                addr,
                in_arena,
                without_own,
            },
            len,
            able,
        };
        for a in [
            said(0xdead_beef, false, false, 12345, true),
            said(8, false, true, 0, false),
            said(4096, true, false, 7, true),
            said(4096, true, true, 7, false),
        ] {
            assert_eq!(parse(3, &announcement(a)).unwrap(), a);
        }
        let a = announcement(said(1, false, false, 1, true));
        for bad in [&a[..16], &[0u8; 18][..], &[8u8; 17][..]] {
            match parse(3, bad) {
                Err(Error::Protocol { peer: 3, .. }) => {}
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn a_readers_block_sits_one_place_earlier_after_an_exposer_without_its_own() {
        let whole = Exposure::at(1000);
        let without = Exposure {
            without_own: true,
            ..whole
        };
        // Rank 2 exposes blocks of 10 bytes; readers 0, 1, 3 and 4.
        let at = |e: Exposure| [0, 1, 3, 4].map(|r| e.block_at(2, r, 10));
        assert_eq!(at(whole), [1000, 1010, 1030, 1040]);
        assert_eq!(at(without), [1000, 1010, 1020, 1030]);
    }
}
