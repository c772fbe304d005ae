//! Single-copy payloads moved by both processes at once: while the receiver reads part of a
//! payload from the sender's memory (`process_vm_readv`), the sender writes the rest straight
//! into the receiver's buffer (`process_vm_writev`).
//!
//! Why: the kernel's cross-memory copy runs at some 8–11 GB/s on one core here, and while the
//! receiver copies, the sender — waiting for its send to complete — has nothing to do. With
//! two cores each copying part, a 1 MiB payload moves in ~70 µs instead of ~120 (see the book's
//! Shared memory chapter for the measurement).
//!
//! The protocol runs over one [`SplitSlot`] per ordered pair, in the receiver's segment beside
//! the pair's ring (the receiver owns it; the sender maps it with the ring):
//!
//! 1. **Offer.** The receiver, about to read a payload of `len` bytes (at least
//!    [`SPLIT_MIN`]) into its buffer at address `dst`, stores `dst` and `len`, clears `done` and
//!    `failed`, then publishes the *claim word* with `Release`: the payload's token tag, its
//!    chunk count (64 KiB chunks; two halves below 128 KiB) and the next chunk to take (0).
//! 2. **Claim.** Either side takes half the chunks still left (rounded up) by compare-and-swap
//!    on the claim word, and so a claim names the offer it belongs to: a helper that looked at
//!    an older offer fails the swap instead of writing the old payload into the new buffer.
//!    Halving (guided self-scheduling) makes few system calls — long copies run faster than
//!    short ones — yet ends with short claims, so neither side waits long for the other's
//!    last one (the sender's writes run slower than the receiver's reads here). Against four
//!    equal chunks it took one-way latency from 17.4 to 13.8 µs at 128 KiB and from 93 to 88
//!    µs at 1 MiB (5 interleaved rounds).
//! 3. **Copy.** The claimer copies its chunk and adds one to `done` (`Release`); a copy that
//!    failed sets `failed` first.
//! 4. **Finish.** The receiver claims chunks until none are left (once it has copied its first
//!    claim and the sender has taken none, it takes the rest in one claim: the sender is
//!    asleep or busy), then waits for `done` to
//!    reach the chunk count: a chunk the sender claimed is being written by one system call,
//!    and the receiver must not hand its buffer on while the sender may still write to it. If
//!    `failed` is set, the receiver reads the whole payload itself (the sender still holds it:
//!    its token is not counted read until the receiver is done).
//!
//! **Lending.** A payload of two chunks that another follows in the ring is offered as one
//! chunk instead ([`SplitSlot::lend`], up to [`LEND_MAX`]): the sender writes all of it while
//! the receiver reads the next payload alone, then the receiver claims it back if the sender
//! has not, and finishes as in step 4.
//!
//! The sender helps only with a payload it holds (it looks the tag up among them) of the
//! length the offer says, and only where the kernel lets it write the receiver's memory. Where
//! it never helps, the receiver reads every chunk itself, at about the speed of one read.
//!
//! This file is pure protocol on atomics (the copies are closures), compiled by the
//! `loom-tests` crate against loom's atomics as well.

use crate::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Payloads from this many bytes are offered for splitting (in two halves below 128 KiB):
/// below it, a share would be too short to be worth a second system call. At 64 KiB the split
/// raised bandwidth from 6.4 to 8.7 GB/s (7 interleaved rounds of `bench/ab 7 2 bw '-m
/// 65536:65536'`; Open MPI 6.9) and cost one-way latency about a microsecond (9.4 → 10.5 µs,
/// 9 rounds; Open MPI 11.3) when it came (session 27); in session 36 it saved it (4.93 against
/// 6.22 µs split off). Lowered from 64 to 32 KiB once medium payloads went by single copy
/// (session 36, 7 interleaved rounds of `bench/ab 7 2 latency '-m 16384:262144'`): 32 KiB
/// one-way 3.61 against 3.94 µs, faster in 6 of the 7 rounds (Open MPI 3.28).
pub(crate) const SPLIT_MIN: u64 = 32 * 1024;

/// Offers of payloads from this many bytes wake the sender if it sleeps (a wake-up takes some
/// 35 µs here; reading 512 KiB alone takes ~50). A sender waiting long for its sends — a
/// window of large messages — stops spinning and sleeps, and would otherwise help with none.
pub(crate) const WAKE_MIN: u64 = 512 * 1024;

/// Payloads of [`SPLIT_MIN`] up to this many bytes — two chunks — may be *lent* whole to the
/// sender when another such payload follows in the ring: the sender writes the first while
/// the receiver reads the second, one system call each instead of two per payload, with no
/// wait for each other in between (see `inbound::Stream`). Longer payloads have chunks enough
/// to keep both sides busy on one payload.
pub(crate) const LEND_MAX: u64 = 2 * CHUNK;

/// The chunk: the unit of claims (half the payload below twice this; longer where a payload
/// has more than `MAX_CHUNKS` of them).
const CHUNK: u64 = 64 * 1024;
/// Chunk lengths are multiples of a page, so each chunk keeps the whole payload's alignment.
const PAGE: u64 = 4096;

/// Bits of the claim word: the next chunk (low), the chunk count, the token tag (high).
const INDEX_BITS: u32 = 12;
const MAX_CHUNKS: u64 = (1 << INDEX_BITS) - 1;
const TAG_SHIFT: u32 = 2 * INDEX_BITS;
/// Tags run from 1 to `TAG_RANGE` (0 is "no offer").
const TAG_RANGE: u64 = (1 << (64 - TAG_SHIFT)) - 1;

/// The tag by which a payload's token appears in the claim word (never 0).
pub(crate) fn tag_of(token: u64) -> u64 {
    token % TAG_RANGE + 1
}

/// How many chunks a payload of `len` bytes is split into (claims take several at once); the
/// last may be short.
pub(crate) fn chunks_for(len: u64) -> u64 {
    if len < SPLIT_MIN {
        1
    } else {
        len.div_ceil(chunk_len(len))
    }
}

/// The length of a chunk of a payload of `len` bytes: [`CHUNK`], half the payload below twice
/// that, or more for a payload of more than `MAX_CHUNKS` of them.
fn chunk_len(len: u64) -> u64 {
    len.div_ceil(MAX_CHUNKS)
        .next_multiple_of(PAGE)
        .max(CHUNK.min((len / 2).next_multiple_of(PAGE)))
}

fn pack(tag: u64, chunks: u64, next: u64) -> u64 {
    (tag << TAG_SHIFT) | (chunks << INDEX_BITS) | next
}

/// `(tag, chunks, next)` of a claim word.
fn unpack(word: u64) -> (u64, u64, u64) {
    (
        word >> TAG_SHIFT,
        (word >> INDEX_BITS) & MAX_CHUNKS,
        word & MAX_CHUNKS,
    )
}

/// The shared state of one pair's split copies: one cache line in the receiver's segment.
#[repr(C, align(64))]
#[derive(Default)]
pub(crate) struct SplitSlot {
    /// Tag, chunk count and next chunk of the current offer; 0 before the first.
    claim: AtomicU64,
    /// Chunks copied (by either side) of the current offer.
    done: AtomicU32,
    /// Nonzero once a copy of the current offer failed.
    failed: AtomicU32,
    /// Where the payload goes in the receiver's memory.
    dst: AtomicU64,
    /// The payload's length.
    len: AtomicU64,
}

/// An offer the receiver made: what it waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Offer {
    pub(crate) tag: u64,
    pub(crate) chunks: u64,
}

/// What one claim took (one or more chunks, contiguous): copy bytes `[offset, offset + len)` of the payload to address
/// `dst + offset` of the receiver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Chunk {
    pub(crate) dst: u64,
    pub(crate) offset: u64,
    pub(crate) len: u64,
    /// The whole payload's length, as the receiver offered it.
    pub(crate) total: u64,
    /// Chunks this claim covers.
    pub(crate) count: u64,
}

impl SplitSlot {
    /// The receiver offers the payload with `token`, `len` bytes going to address `dst` of its
    /// memory. Only after the previous offer is [`finished`](Self::is_finished).
    pub(crate) fn offer(&self, token: u64, dst: u64, len: u64) -> Offer {
        self.publish(token, dst, len, chunks_for(len))
    }

    /// The receiver hands the payload with `token` to the sender whole, as one chunk, while
    /// it reads the next payload itself (see [`LEND_MAX`]); it takes the chunk back with
    /// [`read_chunks`](Self::read_chunks) if the sender has not claimed it by then. Only
    /// after the previous offer is [`finished`](Self::is_finished).
    pub(crate) fn lend(&self, token: u64, dst: u64, len: u64) -> Offer {
        self.publish(token, dst, len, 1)
    }

    fn publish(&self, token: u64, dst: u64, len: u64, chunks: u64) -> Offer {
        let offer = Offer {
            tag: tag_of(token),
            chunks,
        };
        self.dst.store(dst, Ordering::Relaxed);
        self.len.store(len, Ordering::Relaxed);
        self.done.store(0, Ordering::Relaxed);
        self.failed.store(0, Ordering::Relaxed);
        // Publishes the stores above to whoever claims a chunk of this offer.
        self.claim
            .store(pack(offer.tag, offer.chunks, 0), Ordering::Release);
        offer
    }

    /// The tag of the current offer if it has chunks left to claim (one load: what the sender
    /// looks at on each turn while it holds a payload).
    pub(crate) fn open_offer(&self) -> Option<u64> {
        let (tag, chunks, next) = unpack(self.claim.load(Ordering::Relaxed));
        (tag != 0 && next < chunks).then_some(tag)
    }

    /// Claims half the chunks left (rounded up) of the offer tagged `tag`, if that offer is
    /// current and has any left. The caller must copy them and then [`finish`](Self::finish)
    /// the claim.
    pub(crate) fn claim(&self, tag: u64) -> Option<Chunk> {
        self.claim_as(tag, None)
    }

    /// [`claim`](Self::claim), but by a claimer that has taken `mine` chunks and, if nobody
    /// else has taken any yet (and `mine > 0`), takes all that are left.
    fn claim_as(&self, tag: u64, alone_after: Option<u64>) -> Option<Chunk> {
        let mut word = self.claim.load(Ordering::Acquire);
        loop {
            let (t, chunks, next) = unpack(word);
            if t != tag || next >= chunks {
                return None;
            }
            let upto = match alone_after {
                Some(mine) if mine > 0 && next == mine => chunks,
                _ => next + (chunks - next).div_ceil(2),
            };
            match self.claim.compare_exchange_weak(
                word,
                word + (upto - next),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    // The offer cannot change before these chunks are finished, so these are
                    // its.
                    let total = self.len.load(Ordering::Relaxed);
                    let len = chunk_len(total);
                    let offset = (next * len).min(total);
                    let end = if upto == chunks { total } else { upto * len };
                    return Some(Chunk {
                        dst: self.dst.load(Ordering::Relaxed),
                        offset,
                        len: end.max(offset) - offset,
                        total,
                        count: upto - next,
                    });
                }
                Err(now) => word = now,
            }
        }
    }

    /// Reports a claim copied (`ok`) or not.
    pub(crate) fn finish(&self, chunk: Chunk, ok: bool) {
        if !ok {
            self.failed.store(1, Ordering::Relaxed);
        }
        // Publishes the copy (and `failed`) to the receiver.
        self.done.fetch_add(chunk.count as u32, Ordering::Release);
    }

    /// The sender's share: claims and copies chunks of the offer tagged `tag` until none are
    /// left, with `copy(chunk)` returning whether it copied. Returns the bytes copied.
    pub(crate) fn take_chunks(&self, tag: u64, copy: impl FnMut(Chunk) -> bool) -> u64 {
        self.take(tag, false, copy)
    }

    /// The receiver's share: as [`take_chunks`](Self::take_chunks), except that once it has
    /// copied its first claim and the sender has still taken none (it sleeps, or is busy), it
    /// takes the rest in one piece.
    pub(crate) fn read_chunks(&self, tag: u64, copy: impl FnMut(Chunk) -> bool) -> u64 {
        self.take(tag, true, copy)
    }

    fn take(&self, tag: u64, receiver: bool, mut copy: impl FnMut(Chunk) -> bool) -> u64 {
        let (mut copied, mut mine) = (0, 0);
        loop {
            let claimed = if receiver {
                self.claim_as(tag, Some(mine))
            } else {
                self.claim(tag)
            };
            let Some(chunk) = claimed else {
                return copied;
            };
            mine += chunk.count;
            let ok = copy(chunk);
            copied += if ok { chunk.len } else { 0 };
            self.finish(chunk, ok);
        }
    }

    /// Whether every chunk of `offer` has been copied or given up on (the receiver waits for
    /// this before it uses or releases its buffer).
    pub(crate) fn is_finished(&self, offer: Offer) -> bool {
        u64::from(self.done.load(Ordering::Acquire)) >= offer.chunks
    }

    /// Whether a copy of the current offer failed; meaningful once it
    /// [`is_finished`](Self::is_finished).
    pub(crate) fn failed(&self) -> bool {
        self.failed.load(Ordering::Relaxed) != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_counts_by_length() {
        assert_eq!(chunks_for(0), 1);
        assert_eq!(chunks_for(SPLIT_MIN - 1), 1);
        assert_eq!(chunks_for(SPLIT_MIN), 2);
        assert_eq!(chunk_len(SPLIT_MIN), SPLIT_MIN / 2);
        assert_eq!(chunks_for(100_000), 2);
        assert_eq!(chunks_for(2 * CHUNK), 2);
        assert_eq!(chunks_for(2 * CHUNK + 1), 3);
        assert_eq!(chunks_for(1 << 20), 16);
        assert_eq!(chunks_for((1 << 20) + 5), 17);
        assert_eq!(chunks_for(64 << 20), 1024);
        assert!(chunks_for(1 << 40) <= MAX_CHUNKS);
        assert_eq!(chunk_len(1 << 40) % PAGE, 0);
    }

    /// Marks the bytes of `c` in `covered`, failing on a byte marked before.
    fn mark(covered: &mut [bool], c: Chunk) {
        assert_eq!(c.offset % PAGE, 0);
        for b in &mut covered[c.offset as usize..(c.offset + c.len) as usize] {
            assert!(!*b, "byte copied twice");
            *b = true;
        }
    }

    /// Two claimers take every byte of an offer exactly once, in page-multiple chunks, and
    /// the offer is finished only when both have reported.
    #[test]
    fn two_sides_cover_the_payload_once() {
        for len in [SPLIT_MIN, SPLIT_MIN + 1, 300_001, 4 << 20, (9 << 20) + 5] {
            let slot = SplitSlot::default();
            let offer = slot.offer(41, 0x10_0000, len);
            assert_eq!(slot.open_offer(), Some(offer.tag));
            let mut covered = vec![false; len as usize];
            // The sender claims first (half the chunks) and has not finished yet.
            let held = slot.claim(offer.tag).unwrap();
            assert_eq!((held.dst, held.total), (0x10_0000, len));
            assert_eq!(held.count, offer.chunks.div_ceil(2));
            mark(&mut covered, held);
            let mut claims = Vec::new();
            let mine = slot.read_chunks(offer.tag, |c| {
                claims.push(c.count);
                mark(&mut covered, c);
                true
            });
            assert_eq!(mine, len - held.len);
            // Half of what is left each time, down to one chunk.
            let mut left = offer.chunks - held.count;
            for &count in &claims {
                assert_eq!(count, left.div_ceil(2));
                left -= count;
            }
            assert_eq!(left, 0);
            assert_eq!(slot.open_offer(), None);
            assert!(!slot.is_finished(offer), "the sender's chunk is still out");
            slot.finish(held, true);
            assert!(slot.is_finished(offer));
            assert!(!slot.failed());
            assert!(
                covered.iter().all(|&b| b),
                "len {len}: a byte was never copied"
            );
        }
    }

    /// A lent payload is one chunk: the sender takes it whole, or, when the sender has not
    /// come, the receiver takes it back whole.
    #[test]
    fn a_lent_payload_is_taken_whole_by_one_side() {
        let len = 70_000;
        assert!((SPLIT_MIN..=LEND_MAX).contains(&len));
        let slot = SplitSlot::default();
        let offer = slot.lend(5, 0x8000, len);
        assert_eq!(offer.chunks, 1);
        assert_eq!(slot.open_offer(), Some(offer.tag));
        let theirs = slot.claim(offer.tag).unwrap();
        assert_eq!((theirs.dst, theirs.offset, theirs.len), (0x8000, 0, len));
        assert_eq!(slot.read_chunks(offer.tag, |_| unreachable!()), 0);
        assert!(!slot.is_finished(offer), "the sender's copy is still out");
        slot.finish(theirs, true);
        assert!(slot.is_finished(offer));
        let offer = slot.lend(6, 0x8000, len);
        let mut mine = Vec::new();
        let read = slot.read_chunks(offer.tag, |c| {
            mine.push((c.offset, c.len));
            true
        });
        assert_eq!((read, mine), (len, vec![(0, len)]));
        assert!(slot.is_finished(offer));
        assert_eq!(slot.take_chunks(offer.tag, |_| unreachable!()), 0);
    }

    /// A receiver left alone takes half, then the rest in one claim; a sender that comes
    /// after that finds nothing to take.
    #[test]
    fn a_lone_receiver_takes_the_rest_at_once() {
        let len = (4 << 20) - 3;
        let slot = SplitSlot::default();
        let offer = slot.offer(7, 0x4000, len);
        assert_eq!(offer.chunks, 64);
        let mut covered = vec![false; len as usize];
        let mut claims = Vec::new();
        let mine = slot.read_chunks(offer.tag, |c| {
            claims.push(c.count);
            mark(&mut covered, c);
            true
        });
        assert_eq!((mine, claims), (len, vec![32, 32]));
        assert!(covered.iter().all(|&b| b));
        assert!(slot.is_finished(offer));
        assert_eq!(slot.take_chunks(offer.tag, |_| unreachable!()), 0);
    }

    /// A claim names its offer: a helper that saw an older offer's tag gets nothing of a newer
    /// one, and a failure is reported to the receiver.
    #[test]
    fn stale_tags_claim_nothing_and_failures_show() {
        let slot = SplitSlot::default();
        assert_eq!(slot.open_offer(), None);
        assert_eq!(slot.claim(tag_of(0)), None);
        let first = slot.offer(0, 0x1000, SPLIT_MIN);
        slot.read_chunks(first.tag, |_| true);
        assert!(slot.is_finished(first));
        let second = slot.offer(1, 0x2000, SPLIT_MIN);
        assert_ne!(first.tag, second.tag);
        assert_eq!(slot.claim(first.tag), None);
        assert!(!slot.failed());
        slot.take_chunks(second.tag, |c| c.offset == 0);
        assert!(slot.is_finished(second));
        assert!(slot.failed());
        assert_eq!(tag_of(TAG_RANGE - 1), TAG_RANGE);
        assert_eq!(tag_of(TAG_RANGE), 1);
    }
}
