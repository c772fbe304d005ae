//! What the records in a ring say: the kinds and their bodies.
//!
//! | Kind | Name          | Body                                                             |
//! |------|---------------|------------------------------------------------------------------|
//! | 1    | `FRAME`       | a whole frame in the wire encoding (`rankweave_core::wire`)      |
//! | 2    | `SINGLE_COPY` | token, address, length (`u64` each), then the frame's header; the payload is read from the sender's memory |
//! | 3    | `CHUNK_FIRST` | total length (`u64`), then the first piece of an encoded frame   |
//! | 4    | `CHUNK`       | the next piece of that frame                                     |
//! | 6    | `BYE`         | empty: the sender closed; nothing more will come from it         |
//!
//! Integers are little-endian. Kind 0 is the ring's own filler and never reaches this module.
//! Kind 5 is not used: the receiver acknowledges single-copy payloads out of band, in the
//! pair's information line (see `segment::PairInfo::tokens_read`), so that the acknowledgement
//! never waits behind the receiver's own traffic in the reverse ring.

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

/// Bytes before the frame header in a `SINGLE_COPY` body.
pub(crate) const SINGLE_COPY_PREFIX: usize = 24;

/// A record's body, parsed.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Record<'a> {
    Frame(&'a [u8]),
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
