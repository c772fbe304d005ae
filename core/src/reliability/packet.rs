//! The link packet: what the reliability layer puts on an unreliable transport, and its codec.
//!
//! A packet is either **DATA** (one sequence-numbered payload, normally an encoded
//! [`Frame`](crate::frame::Frame)) or an **ACK** (what the receiver has: cumulative and selective
//! acknowledgement, the end of its receive window, and optionally a NACK of one sequence number
//! whose packet arrived corrupted). Sequence numbers start at 1; `0` means "none".
//!
//! # Layout (link format version 1)
//!
//! All integers are little-endian and unaligned; there is no padding. The common header:
//!
//! | Offset | Size | Field         | Meaning                                                                  |
//! |--------|------|---------------|--------------------------------------------------------------------------|
//! | 0      | 2    | `magic`       | [`MAGIC`]: the bytes `R`, `L` (`0x52 0x4C`)                              |
//! | 2      | 1    | `version`     | [`VERSION`], `1`                                                         |
//! | 3      | 1    | `kind`        | `1` DATA, `2` ACK (others reserved)                                      |
//! | 4      | 4    | `crc`         | `u32`: CRC32C of bytes `0..4` followed by bytes `8..end` (all but itself) |
//! | 8      | 8    | `job_key`     | `u64`: the job's random key; packets of other jobs are dropped           |
//! | 16     | 4    | `source`      | `u32`: rank that sent the packet                                         |
//! | 20     | 4    | `destination` | `u32`: rank the packet is for                                            |
//!
//! DATA (header [`DATA_HEADER_LEN`] = 36 bytes, then the payload):
//!
//! | Offset | Size          | Field         | Meaning                                          |
//! |--------|---------------|---------------|--------------------------------------------------|
//! | 24     | 8             | `seq`         | `u64`: sequence number, ≥ 1                      |
//! | 32     | 4             | `payload_len` | `u32`: must equal the bytes after the header     |
//! | 36     | `payload_len` | payload       | the link's payload (an encoded frame)            |
//!
//! ACK (length [`ACK_HEADER_LEN`] = 52 + 8 × `sack_words` bytes, no payload):
//!
//! | Offset | Size             | Field        | Meaning                                                                 |
//! |--------|------------------|--------------|-------------------------------------------------------------------------|
//! | 24     | 8                | `cumulative` | `u64`: highest sequence number received in order (`0`: none yet)      |
//! | 32     | 8                | `window_end` | `u64`: the receiver accepts sequence numbers below this                 |
//! | 40     | 8                | `nack`       | `u64`: sequence number that arrived corrupted (`0`: no NACK)            |
//! | 48     | 2                | `sack_words` | `u16`: number of 64-bit words of selective bitmap, ≤ [`MAX_SACK_WORDS`] |
//! | 50     | 2                | reserved     | must be `0`                                                             |
//! | 52     | 8 × `sack_words` | bitmap       | `u64` words; bit `i` (word `i / 64`, bit `i % 64`) set = sequence number `cumulative + 2 + i` received |
//!
//! (`cumulative + 1` is missing by definition, so the bitmap starts one above it.)
//!
//! # What decoding checks
//!
//! [`Packet::decode`] checks, in this order: the common header present
//! ([`TooShort`](PacketError::TooShort)), magic ([`BadMagic`](PacketError::BadMagic)), version
//! ([`UnsupportedVersion`](PacketError::UnsupportedVersion)), kind
//! ([`UnknownKind`](PacketError::UnknownKind)), the kind's header present
//! ([`TooShort`](PacketError::TooShort)), lengths consistent with the buffer and the reserved
//! field zero ([`ImpossibleLength`](PacketError::ImpossibleLength)), the CRC
//! ([`CrcMismatch`](PacketError::CrcMismatch), carrying the DATA sequence number so the receiver
//! can NACK it), the job key ([`ForeignJob`](PacketError::ForeignJob)) and a DATA sequence number
//! ≥ 1 ([`InvalidSequence`](PacketError::InvalidSequence)). The CRC is checked before the job key,
//! so a corrupted key is reported as corruption. Decoding never panics and never copies the
//! payload: it is a [`Bytes::slice`] of the input.

use bytes::{BufMut, Bytes, BytesMut};

use crate::wire::checksum_parts;

/// The two magic bytes at offset 0.
pub const MAGIC: [u8; 2] = *b"RL";
/// The link format version this build writes and reads.
pub const VERSION: u8 = 1;
/// Length of the header common to all packets.
pub const COMMON_HEADER_LEN: usize = 24;
/// Length of a DATA packet's header (the payload follows).
pub const DATA_HEADER_LEN: usize = 36;
/// Length of an ACK packet without selective bitmap words.
pub const ACK_HEADER_LEN: usize = 52;
/// Largest number of selective-ACK bitmap words a packet may carry (65 536 sequence numbers).
pub const MAX_SACK_WORDS: usize = 1024;

const KIND_DATA: u8 = 1;
const KIND_ACK: u8 = 2;
const CRC_RANGE: std::ops::Range<usize> = 4..8;

/// One link packet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Packet {
    /// The job's key.
    pub job_key: u64,
    /// Rank that sent the packet.
    pub source: u32,
    /// Rank the packet is for.
    pub destination: u32,
    /// DATA or ACK.
    pub body: PacketBody,
}

/// What a packet carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PacketBody {
    /// A sequence-numbered payload.
    Data {
        /// Sequence number (≥ 1).
        seq: u64,
        /// The payload.
        payload: Bytes,
    },
    /// Acknowledgement information.
    Ack(AckInfo),
}

/// What a receiver tells the sender.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AckInfo {
    /// Highest sequence number received in order (every one up to it was received); `0`: none.
    pub cumulative: u64,
    /// The receiver accepts sequence numbers below this (flow control).
    pub window_end: u64,
    /// Selective bitmap: bit `i` set means `cumulative + 2 + i` was received.
    pub selective: Vec<u64>,
    /// A sequence number whose packet arrived corrupted and should be sent again at once.
    pub nack: Option<u64>,
}

impl AckInfo {
    /// Whether this ACK says `seq` was received (cumulatively or selectively).
    pub fn acknowledges(&self, seq: u64) -> bool {
        if seq <= self.cumulative {
            return true;
        }
        let Some(i) = seq.checked_sub(self.cumulative + 2) else {
            return false;
        };
        let (word, bit) = ((i / 64) as usize, i % 64);
        self.selective
            .get(word)
            .is_some_and(|w| w & (1u64 << bit) != 0)
    }

    /// The selectively acknowledged sequence numbers, ascending.
    pub fn selective_seqs(&self) -> impl Iterator<Item = u64> + '_ {
        let base = self.cumulative.saturating_add(2);
        self.selective
            .iter()
            .enumerate()
            .flat_map(move |(w, &word)| {
                (0..64u64)
                    .filter(move |b| word & (1u64 << b) != 0)
                    .map(move |b| base.saturating_add(w as u64 * 64 + b))
            })
    }

    /// Highest sequence number this ACK acknowledges.
    pub fn largest(&self) -> u64 {
        self.selective_seqs().last().unwrap_or(self.cumulative)
    }
}

/// Why a buffer is not a packet of this job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PacketError {
    /// The buffer ends before the header does.
    #[error("packet too short: need at least {need} bytes, have {have}")]
    TooShort {
        /// Bytes needed.
        need: usize,
        /// Bytes in the buffer.
        have: usize,
    },
    /// Not the link magic: not a rankweave link packet.
    #[error("bad link packet magic {0:#06x}")]
    BadMagic(u16),
    /// A link format version this build cannot read.
    #[error("unsupported link packet version {0} (this build reads version {VERSION})")]
    UnsupportedVersion(u8),
    /// No known packet kind.
    #[error("unknown link packet kind {0}")]
    UnknownKind(u8),
    /// A length field inconsistent with the buffer (or a nonzero reserved field).
    #[error("impossible length {0} in link packet")]
    ImpossibleLength(u64),
    /// The CRC does not match: the packet was corrupted on the way.
    #[error("CRC mismatch (stored {stored:#010x}, computed {computed:#010x}, seq {seq:?})")]
    CrcMismatch {
        /// The DATA sequence number as read from the (possibly corrupt) header; `None` for ACKs.
        seq: Option<u64>,
        /// The source rank as read from the (possibly corrupt) header (named `sender`: thiserror
        /// reserves `source`).
        sender: u32,
        /// CRC stored in the packet.
        stored: u32,
        /// CRC computed over the received bytes.
        computed: u32,
    },
    /// The packet belongs to another job.
    #[error("packet of a foreign job (key {key:#018x})")]
    ForeignJob {
        /// The job key the packet carries.
        key: u64,
    },
    /// A DATA packet with sequence number 0.
    #[error("invalid sequence number 0")]
    InvalidSequence,
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

impl Packet {
    /// Bytes [`encode`](Self::encode) produces for this packet.
    pub fn encoded_len(&self) -> usize {
        match &self.body {
            PacketBody::Data { payload, .. } => DATA_HEADER_LEN + payload.len(),
            PacketBody::Ack(ack) => ACK_HEADER_LEN + 8 * ack.selective.len(),
        }
    }

    /// Encodes the packet, CRC included, into one buffer.
    ///
    /// # Panics
    ///
    /// If a DATA payload is longer than `u32::MAX` bytes or an ACK carries more than
    /// [`MAX_SACK_WORDS`] bitmap words (the link never builds such packets).
    pub fn encode(&self) -> Bytes {
        let mut buf = BytesMut::with_capacity(self.encoded_len());
        buf.put_slice(&MAGIC);
        buf.put_u8(VERSION);
        buf.put_u8(match self.body {
            PacketBody::Data { .. } => KIND_DATA,
            PacketBody::Ack(_) => KIND_ACK,
        });
        buf.put_u32_le(0); // CRC, filled in below
        buf.put_u64_le(self.job_key);
        buf.put_u32_le(self.source);
        buf.put_u32_le(self.destination);
        match &self.body {
            PacketBody::Data { seq, payload } => {
                buf.put_u64_le(*seq);
                let len = u32::try_from(payload.len()).expect("payload longer than u32::MAX");
                buf.put_u32_le(len);
                buf.put_slice(payload);
            }
            PacketBody::Ack(ack) => {
                assert!(ack.selective.len() <= MAX_SACK_WORDS, "too many SACK words");
                buf.put_u64_le(ack.cumulative);
                buf.put_u64_le(ack.window_end);
                buf.put_u64_le(ack.nack.unwrap_or(0));
                buf.put_u16_le(ack.selective.len() as u16);
                buf.put_u16_le(0);
                for &word in &ack.selective {
                    buf.put_u64_le(word);
                }
            }
        }
        let crc = checksum_parts(&[&buf[..CRC_RANGE.start], &buf[CRC_RANGE.end..]]);
        buf[CRC_RANGE].copy_from_slice(&crc.to_le_bytes());
        buf.freeze()
    }

    /// Decodes a packet of the job `job_key` (see the [module docs](self) for what is checked).
    pub fn decode(buf: &Bytes, job_key: u64) -> Result<Packet, PacketError> {
        let b = &buf[..];
        if b.len() < COMMON_HEADER_LEN {
            return Err(PacketError::TooShort {
                need: COMMON_HEADER_LEN,
                have: b.len(),
            });
        }
        if b[..2] != MAGIC {
            return Err(PacketError::BadMagic(u16::from_be_bytes([b[0], b[1]])));
        }
        if b[2] != VERSION {
            return Err(PacketError::UnsupportedVersion(b[2]));
        }
        let kind = b[3];
        let need = match kind {
            KIND_DATA => DATA_HEADER_LEN,
            KIND_ACK => ACK_HEADER_LEN,
            other => return Err(PacketError::UnknownKind(other)),
        };
        if b.len() < need {
            return Err(PacketError::TooShort {
                need,
                have: b.len(),
            });
        }
        let source = u32_at(b, 16);
        let seq = match kind {
            KIND_DATA => {
                let len = u32_at(b, 32) as usize;
                if len != b.len() - DATA_HEADER_LEN {
                    return Err(PacketError::ImpossibleLength(len as u64));
                }
                Some(u64_at(b, 24))
            }
            _ => {
                let words = u16_at(b, 48) as usize;
                if words > MAX_SACK_WORDS || ACK_HEADER_LEN + 8 * words != b.len() {
                    return Err(PacketError::ImpossibleLength(words as u64));
                }
                if u16_at(b, 50) != 0 {
                    return Err(PacketError::ImpossibleLength(u64::from(u16_at(b, 50))));
                }
                None
            }
        };
        let stored = u32_at(b, CRC_RANGE.start);
        let computed = checksum_parts(&[&b[..CRC_RANGE.start], &b[CRC_RANGE.end..]]);
        if stored != computed {
            return Err(PacketError::CrcMismatch {
                seq,
                sender: source,
                stored,
                computed,
            });
        }
        let key = u64_at(b, 8);
        if key != job_key {
            return Err(PacketError::ForeignJob { key });
        }
        let body = match seq {
            Some(0) => return Err(PacketError::InvalidSequence),
            Some(seq) => PacketBody::Data {
                seq,
                payload: buf.slice(DATA_HEADER_LEN..),
            },
            None => {
                let words = u16_at(b, 48) as usize;
                let nack = u64_at(b, 40);
                PacketBody::Ack(AckInfo {
                    cumulative: u64_at(b, 24),
                    window_end: u64_at(b, 32),
                    nack: (nack != 0).then_some(nack),
                    selective: (0..words)
                        .map(|w| u64_at(b, ACK_HEADER_LEN + 8 * w))
                        .collect(),
                })
            }
        };
        Ok(Packet {
            job_key: key,
            source,
            destination: u32_at(b, 20),
            body,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn data(seq: u64, payload: &'static [u8]) -> Packet {
        Packet {
            job_key: 7,
            source: 1,
            destination: 2,
            body: PacketBody::Data {
                seq,
                payload: Bytes::from_static(payload),
            },
        }
    }

    #[test]
    fn data_round_trip_is_zero_copy() {
        let p = data(5, b"hello");
        let buf = p.encode();
        assert_eq!(buf.len(), DATA_HEADER_LEN + 5);
        let q = Packet::decode(&buf, 7).unwrap();
        assert_eq!(q, p);
        let PacketBody::Data { payload, .. } = q.body else {
            unreachable!()
        };
        assert_eq!(payload.as_ptr(), buf[DATA_HEADER_LEN..].as_ptr());
    }

    #[test]
    fn ack_round_trip_and_queries() {
        let ack = AckInfo {
            cumulative: 10,
            window_end: 300,
            selective: vec![0b101, 1 << 63],
            nack: Some(11),
        };
        assert!(ack.acknowledges(3) && ack.acknowledges(10) && ack.acknowledges(12));
        assert!(!ack.acknowledges(11) && !ack.acknowledges(13) && ack.acknowledges(14));
        assert!(ack.acknowledges(12 + 127) && !ack.acknowledges(12 + 128));
        assert_eq!(ack.selective_seqs().collect::<Vec<_>>(), vec![12, 14, 139]);
        assert_eq!(ack.largest(), 139);
        let p = Packet {
            job_key: 1,
            source: 0,
            destination: 3,
            body: PacketBody::Ack(ack),
        };
        assert_eq!(Packet::decode(&p.encode(), 1).unwrap(), p);
    }

    #[test]
    fn errors() {
        let buf = data(9, b"abc").encode();
        assert!(matches!(
            Packet::decode(&buf.slice(..10), 7),
            Err(PacketError::TooShort { .. })
        ));
        assert_eq!(
            Packet::decode(&buf, 8),
            Err(PacketError::ForeignJob { key: 7 })
        );
        let mut bad = buf.to_vec();
        bad[0] = b'X';
        assert!(matches!(
            Packet::decode(&Bytes::from(bad), 7),
            Err(PacketError::BadMagic(_))
        ));
        let mut bad = buf.to_vec();
        bad[2] = 9;
        assert_eq!(
            Packet::decode(&Bytes::from(bad), 7),
            Err(PacketError::UnsupportedVersion(9))
        );
        let mut bad = buf.to_vec();
        bad[3] = 9;
        assert_eq!(
            Packet::decode(&Bytes::from(bad), 7),
            Err(PacketError::UnknownKind(9))
        );
        let mut bad = buf.to_vec();
        bad.push(0);
        assert!(matches!(
            Packet::decode(&Bytes::from(bad), 7),
            Err(PacketError::ImpossibleLength(3))
        ));
        let mut bad = buf.to_vec();
        *bad.last_mut().unwrap() ^= 0x40;
        assert!(matches!(
            Packet::decode(&Bytes::from(bad), 7),
            Err(PacketError::CrcMismatch {
                seq: Some(9),
                sender: 1,
                ..
            })
        ));
        assert_eq!(
            Packet::decode(&data(0, b"").encode(), 7),
            Err(PacketError::InvalidSequence)
        );
    }

    fn arb_packet() -> impl Strategy<Value = Packet> {
        let body = prop_oneof![
            (any::<u64>(), proptest::collection::vec(any::<u8>(), 0..200)).prop_map(|(seq, p)| {
                PacketBody::Data {
                    seq: seq.max(1),
                    payload: Bytes::from(p),
                }
            }),
            (
                any::<u64>(),
                any::<u64>(),
                proptest::collection::vec(any::<u64>(), 0..5),
                proptest::option::of(1..u64::MAX)
            )
                .prop_map(|(cumulative, window_end, selective, nack)| {
                    PacketBody::Ack(AckInfo {
                        cumulative,
                        window_end,
                        selective,
                        nack,
                    })
                }),
        ];
        (any::<u64>(), any::<u32>(), any::<u32>(), body).prop_map(
            |(job_key, source, destination, body)| Packet {
                job_key,
                source,
                destination,
                body,
            },
        )
    }

    proptest! {
        #[test]
        fn round_trip(p in arb_packet()) {
            let buf = p.encode();
            prop_assert_eq!(buf.len(), p.encoded_len());
            prop_assert_eq!(Packet::decode(&buf, p.job_key), Ok(p));
        }

        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300), key in any::<u64>()) {
            let _ = Packet::decode(&Bytes::from(bytes), key);
        }

        #[test]
        fn any_single_byte_flip_is_detected(p in arb_packet(), at in any::<prop::sample::Index>(), flip in 1..=255u8) {
            let mut bad = p.encode().to_vec();
            let i = at.index(bad.len());
            bad[i] ^= flip;
            prop_assert!(Packet::decode(&Bytes::from(bad), p.job_key).is_err());
        }
    }
}
