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

/// An announcement: the buffer's address (u64 LE), its length in elements (u64 LE), and 1 if
/// the sender can read every other rank's memory, else 0.
const ANNOUNCEMENT: usize = 17;

fn announcement(addr: u64, len: usize, able: bool) -> Bytes {
    let mut b = BytesMut::with_capacity(ANNOUNCEMENT);
    b.put_u64_le(addr);
    b.put_u64_le(len as u64);
    b.put_u8(u8::from(able));
    b.freeze()
}

/// An announcement from `from`: (address, length, able). Anything else is [`Error::Protocol`].
fn parse(from: usize, m: &[u8]) -> Result<(u64, usize, bool), Error> {
    let bad = || Error::Protocol {
        peer: from,
        detail: format!("malformed direct-read announcement ({} bytes)", m.len()),
    };
    if m.len() != ANNOUNCEMENT || m[16] > 1 {
        return Err(bad());
    }
    let word = |at: usize| u64::from_le_bytes(m[at..at + 8].try_into().unwrap_or_default());
    let len = usize::try_from(word(8)).map_err(|_| bad())?;
    Ok((word(0), len, m[16] == 1))
}

/// What the announcements said.
pub(crate) enum Announced {
    /// Some rank cannot read every other's memory: nobody reads, and nobody waits for "done".
    Declined,
    /// Every rank can: the address of each rank's buffer (this rank's own included), or the
    /// failure that stops this rank's reads (it still takes part in [`done`]).
    Exposed(Result<Vec<u64>, Error>),
}

/// The other ranks, from the next one on (so that not every rank reads from rank 0 first).
pub(crate) fn peers(cx: &Ctx) -> impl Iterator<Item = usize> + use<> {
    let (n, me) = (cx.size, cx.rank);
    (1..n).map(move |k| (me + k) % n)
}

/// Step 1 (see the [module docs](self)) for a buffer of `len` elements at `addr`.
pub(crate) async fn announce(cx: &Ctx, addr: u64, len: usize) -> Announced {
    let able = peers(cx).all(|q| cx.comm.can_read_memory_of(q));
    let mine = announcement(addr, len, able);
    let arriving: Vec<_> = peers(cx)
        .map(|q| (q, cx.comm.collective_recv(q, cx.tag)))
        .collect();
    let sent: Vec<_> = peers(cx).map(|q| cx.send(q, mine.clone())).collect();
    let mut addrs = vec![0u64; cx.size];
    addrs[cx.rank] = addr;
    let mut everyone_able = able;
    let mut failure = None;
    for (q, recv) in arriving {
        match recv.await.and_then(|m| parse(q, &m.into_data())) {
            Ok((_, theirs, _)) if theirs != len => {
                failure.get_or_insert(length_mismatch(q, len, theirs));
            }
            Ok((at, _, able)) => {
                addrs[q] = at;
                everyone_able &= able;
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
/// exposes `len` elements at `addr`, reads block q of `result` from `addr_q + offset(q)` in
/// rank q's memory, and says done. `None` if the ranks declined (nothing read, `result` as it
/// was); otherwise whether this rank's part succeeded, after every peer is done with `addr`.
pub(crate) async fn read_blocks<T: Element>(
    cx: &Ctx,
    addr: u64,
    len: usize,
    result: &mut Filling<T>,
    offset: impl Fn(usize) -> u64,
) -> Option<Result<(), Error>> {
    let Announced::Exposed(addrs) = announce(cx, addr, len).await else {
        return None;
    };
    let read = addrs.and_then(|addrs| {
        // A bogus announced address is for the kernel to refuse.
        peers(cx).try_for_each(|q| result.read_block(cx, q, addrs[q].wrapping_add(offset(q))))
    });
    Some(done(cx, read.err()).await)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn announcements_round_trip_and_bad_ones_are_protocol_errors() {
        let a = announcement(0xdead_beef, 12345, true);
        assert_eq!(parse(3, &a).unwrap(), (0xdead_beef, 12345, true));
        let b = announcement(8, 0, false);
        assert_eq!(parse(3, &b).unwrap(), (8, 0, false));
        for bad in [&a[..16], &[0u8; 18][..], &[2u8; 17][..]] {
            match parse(3, bad) {
                Err(Error::Protocol { peer: 3, .. }) => {}
                other => panic!("{other:?}"),
            }
        }
    }
}
