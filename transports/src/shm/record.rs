//! What the records in a ring say: the kinds and their bodies.
//!
//! | Kind | Name          | Body                                                             |
//! |------|---------------|------------------------------------------------------------------|
//! | 1    | `FRAME`       | a whole frame in the wire encoding (`rankweave_core::wire`)      |
//! | 2    | `SINGLE_COPY` | token, address, length (`u64` each), then the frame's header; the payload is read from the sender's memory |
//! | 3    | `CHUNK_FIRST` | total length (`u64`), then the first piece of an encoded frame   |
//! | 4    | `CHUNK`       | the next piece of that frame                                     |
//! | 6    | `BYE`         | empty: the sender closed; nothing more will come from it         |
//! | 7    | `SHORT`       | an eager message: context (`u64`), tag (`u32`), sequence number (`u32`), then the payload |
//!
//! Integers are little-endian. Kind 0 is the ring's own filler and never reaches this module.
//!
//! `SHORT` says what a `FRAME` holding an eager frame says, in 16 bytes instead of the wire
//! header's 38 (no magic, kind or length fields: the record has its own; a sequence number
//! below 2³² — a stream's first four billion messages — in four bytes). Its point is the first
//! cache line: with the ring's 16-byte record header, a `FRAME` leaves room there for 10 bytes
//! of payload and a `SHORT` for 32, and a receiver waiting on the line its record arrives in
//! gets such a message in one cache-line transfer instead of two in a row (which cost some
//! 150 ns more when the two vCPUs sit far apart). Open MPI's fast boxes keep their header to
//! 8 bytes for the same reason.
//! Kind 5 is not used: the receiver acknowledges single-copy payloads out of band, in the
//! pair's information line (see `segment::PairInfo::tokens_read`), so that the acknowledgement
//! never waits behind the receiver's own traffic in the reverse ring.

use rankweave_core::ContextId;
use rankweave_core::frame::Envelope;

/// A whole encoded frame.
pub(crate) const FRAME: u8 = 1;
/// A frame whose payload stays in the sender's memory until the receiver has read it.
pub(crate) const SINGLE_COPY: u8 = 2;
/// The first piece of a frame too large for one record.
pub(crate) const CHUNK_FIRST: u8 = 3;
/// A further piece.
pub(crate) const CHUNK: u8 = 4;
/// Clean close.
pub(crate) const BYE: u8 = 6;
/// An eager message with a compact envelope.
pub(crate) const SHORT: u8 = 7;

/// Bytes before the payload in a `SHORT` body.
pub(crate) const SHORT_HEADER: usize = 16;

/// Bytes before the frame header in a `SINGLE_COPY` body.
pub(crate) const SINGLE_COPY_PREFIX: usize = 24;

/// A record's body, parsed.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Record<'a> {
    Frame(&'a [u8]),
    Short(Envelope, &'a [u8]),
    SingleCopy {
        token: u64,
        addr: u64,
        len: u64,
        header: &'a [u8],
    },
    ChunkFirst {
        total: u64,
        piece: &'a [u8],
    },
    Chunk(&'a [u8]),
    Bye,
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    b.get(at..at + 8)
        .and_then(|s| s.try_into().ok())
        .map(u64::from_le_bytes)
}

/// Parses a record of kind `kind`; `None` for an unknown kind or a body of the wrong shape.
pub(crate) fn parse(kind: u8, body: &[u8]) -> Option<Record<'_>> {
    Some(match kind {
        FRAME => Record::Frame(body),
        SHORT => {
            let (envelope, payload) = parse_short(body)?;
            Record::Short(envelope, payload)
        }
        SINGLE_COPY => Record::SingleCopy {
            token: u64_at(body, 0)?,
            addr: u64_at(body, 8)?,
            len: u64_at(body, 16)?,
            header: &body[SINGLE_COPY_PREFIX..],
        },
        CHUNK_FIRST => Record::ChunkFirst {
            total: u64_at(body, 0)?,
            piece: &body[8..],
        },
        CHUNK => Record::Chunk(body),
        BYE if body.is_empty() => Record::Bye,
        _ => return None,
    })
}

/// The envelope and payload of a `SHORT` body; `None` if it is shorter than its header.
#[inline]
pub(crate) fn parse_short(body: &[u8]) -> Option<(Envelope, &[u8])> {
    let (head, payload) = body.split_first_chunk::<SHORT_HEADER>()?;
    let [
        c0,
        c1,
        c2,
        c3,
        c4,
        c5,
        c6,
        c7,
        t0,
        t1,
        t2,
        t3,
        s0,
        s1,
        s2,
        s3,
    ] = *head;
    let envelope = Envelope {
        context: ContextId(u64::from_le_bytes([c0, c1, c2, c3, c4, c5, c6, c7])),
        tag: u32::from_le_bytes([t0, t1, t2, t3]),
        seq: u64::from(u32::from_le_bytes([s0, s1, s2, s3])),
        len: payload.len() as u64,
    };
    Some((envelope, payload))
}

/// The `SHORT` header of an eager message with `envelope` and a payload of `payload_len`
/// bytes, if it can have one: its sequence number below 2³², and its length that of its
/// payload (an eager frame's always is).
#[inline]
pub(crate) fn short_header(envelope: &Envelope, payload_len: usize) -> Option<[u8; SHORT_HEADER]> {
    let seq = u32::try_from(envelope.seq).ok()?;
    if envelope.len != payload_len as u64 {
        return None;
    }
    let mut h = [0u8; SHORT_HEADER];
    h[..8].copy_from_slice(&envelope.context.0.to_le_bytes());
    h[8..12].copy_from_slice(&envelope.tag.to_le_bytes());
    h[12..].copy_from_slice(&seq.to_le_bytes());
    Some(h)
}

/// The fixed part of a `SINGLE_COPY` body.
pub(crate) fn single_copy_prefix(token: u64, addr: u64, len: u64) -> [u8; SINGLE_COPY_PREFIX] {
    let mut b = [0u8; SINGLE_COPY_PREFIX];
    b[..8].copy_from_slice(&token.to_le_bytes());
    b[8..16].copy_from_slice(&addr.to_le_bytes());
    b[16..].copy_from_slice(&len.to_le_bytes());
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_bodies_round_trip_and_only_fitting_envelopes_get_one() {
        let envelope = Envelope {
            context: ContextId(0x0123_4567_89ab_cdef),
            tag: 0xfeed_beef,
            seq: u64::from(u32::MAX),
            len: 5,
        };
        let mut body = short_header(&envelope, 5).expect("fits").to_vec();
        body.extend_from_slice(b"hello");
        assert_eq!(
            parse(SHORT, &body),
            Some(Record::Short(envelope, &b"hello"[..]))
        );
        // An empty payload, and a body shorter than the header.
        let empty = Envelope { len: 0, ..envelope };
        let body = short_header(&empty, 0).expect("fits");
        assert_eq!(parse(SHORT, &body), Some(Record::Short(empty, &[][..])));
        assert_eq!(parse(SHORT, &body[..15]), None);
        // A sequence number past 32 bits, or a length that is not the payload's: no SHORT.
        let late = Envelope {
            seq: 1 << 32,
            ..envelope
        };
        assert_eq!(short_header(&late, 5), None);
        assert_eq!(short_header(&envelope, 4), None);
    }

    #[test]
    fn bodies_round_trip_and_bad_shapes_are_refused() {
        let mut b = single_copy_prefix(7, 0x1000, 99).to_vec();
        b.extend_from_slice(b"hdr");
        assert_eq!(
            parse(SINGLE_COPY, &b),
            Some(Record::SingleCopy {
                token: 7,
                addr: 0x1000,
                len: 99,
                header: b"hdr"
            })
        );
        assert_eq!(parse(5, &5u64.to_le_bytes()), None);
        assert_eq!(parse(SINGLE_COPY, &[0; 23]), None);
        assert_eq!(parse(CHUNK_FIRST, &[0; 7]), None);
        assert_eq!(parse(BYE, &[1]), None);
        assert_eq!(parse(99, &[]), None);
        assert_eq!(parse(BYE, &[]), Some(Record::Bye));
    }
}
