//! The link packet: what the reliability layer puts on an unreliable transport, and its codec.
//!
//! Six kinds:
//!
//! * **DATA**: one sequence-numbered payload (normally an encoded
//!   [`Frame`](crate::frame::Frame)), plus a *piggybacked* acknowledgement of the reverse
//!   direction (the sender's cumulative ACK and receive-window end), so that traffic flowing both
//!   ways needs no standalone ACKs.
//! * **ACK**: what the receiver has: cumulative and selective acknowledgement, the end of its
//!   receive window, and optionally a NACK of one sequence number whose packet arrived corrupted
//!   or, instead, one whose packet arrived a second time (a duplicate report, TCP's D-SACK:
//!   the retransmission that made it was not needed).
//! * **RAW**: one payload *without* reliability: no sequence number, no acknowledgement, and the
//!   CRC covers the header only (the payload is left to the layer above, or trusted). It is what a
//!   transport sends when reliability is switched off (`RANKWEAVE_RELIABILITY=off`); a
//!   [`ReliableLink`](super::ReliableLink) never produces one and drops those it is handed.
//! * **PING** / **PONG**: a route probe and its answer, carrying a nonce. A link pings a route it
//!   marked down, and its primary route as a keepalive after a silence; the peer answers on the
//!   route the PING arrived on.
//! * **BYE**: the sender closed cleanly; it answers no more keepalives.
//!
//! Sequence numbers start at 1; `0` means "none".
//!
//! # Layout (link format version 3)
//!
//! All integers are little-endian and unaligned. The common header:
//!
//! | Offset | Size | Field         | Meaning                                                                  |
//! |--------|------|---------------|--------------------------------------------------------------------------|
//! | 0      | 2    | `magic`       | [`MAGIC`]: the bytes `R`, `L` (`0x52 0x4C`)                              |
//! | 2      | 1    | `version`     | [`VERSION`], `3` (2 had no ACK flags: the field was reserved)            |
//! | 3      | 1    | `kind`        | `1` DATA, `2` ACK, `3` RAW, `4` PING, `5` PONG, `6` BYE (others reserved) |
//! | 4      | 4    | `crc`         | `u32`: CRC32C of bytes `0..4` followed by bytes `8..end` (all but itself; RAW: `8..32`, the header only) |
//! | 8      | 8    | `job_key`     | `u64`: the job's random key; packets of other jobs are dropped           |
//! | 16     | 4    | `source`      | `u32`: rank that sent the packet                                         |
//! | 20     | 4    | `destination` | `u32`: rank the packet is for                                            |
//!
//! DATA (header [`DATA_HEADER_LEN`] = 56 bytes, then the payload, which starts 8-byte aligned
//! relative to the packet):
//!
//! | Offset | Size          | Field         | Meaning                                                             |
//! |--------|---------------|---------------|---------------------------------------------------------------------|
//! | 24     | 8             | `seq`         | `u64`: sequence number, ≥ 1                                         |
//! | 32     | 8             | `ack`         | `u64`: piggybacked cumulative ACK of the reverse direction (`0`: none yet) |
//! | 40     | 8             | `window_end`  | `u64`: piggybacked receive-window end of the sender                 |
//! | 48     | 4             | `payload_len` | `u32`: must equal the bytes after the header                        |
//! | 52     | 4             | reserved      | must be `0`                                                         |
//! | 56     | `payload_len` | payload       | the link's payload (an encoded frame)                               |
//!
//! ACK (length [`ACK_HEADER_LEN`] = 52 + 8 × `sack_words` bytes, no payload):
//!
//! | Offset | Size             | Field        | Meaning                                                                 |
//! |--------|------------------|--------------|-------------------------------------------------------------------------|
//! | 24     | 8                | `cumulative` | `u64`: highest sequence number received in order (`0`: none yet)      |
//! | 32     | 8                | `window_end` | `u64`: the receiver accepts sequence numbers below this                 |
//! | 40     | 8                | `nack`       | `u64`: sequence number that arrived corrupted (`0`: no NACK), or with flag `DUPLICATE` one that arrived again (never `0` then) |
//! | 48     | 2                | `sack_words` | `u16`: number of 64-bit words of selective bitmap, ≤ [`MAX_SACK_WORDS`] |
//! | 50     | 2                | `flags`      | `u16`: bit 0 `DUPLICATE` ([`ACK_FLAG_DUPLICATE`]); the other bits must be `0` |
//! | 52     | 8 × `sack_words` | bitmap       | `u64` words; bit `i` (word `i / 64`, bit `i % 64`) set = sequence number `cumulative + 2 + i` received |
//!
//! (`cumulative + 1` is missing by definition, so the bitmap starts one above it.)
//!
//! RAW (header [`RAW_HEADER_LEN`] = 32 bytes, then the payload; **the CRC covers the header
//! only**, bytes `0..4` and `8..32`):
//!
//! | Offset | Size          | Field         | Meaning                                          |
//! |--------|---------------|---------------|--------------------------------------------------|
//! | 24     | 4             | `payload_len` | `u32`: must equal the bytes after the header     |
//! | 28     | 4             | reserved      | must be `0`                                      |
//! | 32     | `payload_len` | payload       | not covered by the CRC                           |
//!
//! PING and PONG (length [`PROBE_LEN`] = 32 bytes, no payload):
//!
//! | Offset | Size | Field   | Meaning                                                            |
//! |--------|------|---------|--------------------------------------------------------------------|
//! | 24     | 8    | `nonce` | `u64`: chosen by the pinger; the PONG echoes the PING's nonce       |
//!
//! BYE (length [`PROBE_LEN`] = 32 bytes): bytes `24..32` are reserved and must be `0`.
//!
//! # Gather-friendly encoding
//!
//! [`Packet::write_header`] writes everything but the payload (for DATA, a CRC computed over
//! header *and* payload) into a reusable buffer, and [`Packet::payload`] is the payload that
//! follows it, so a transport sends `[header, payload]` as one datagram with an iovec and never
//! copies the payload. [`Packet::encode`] is the same bytes in one buffer.
//!
//! # What decoding checks
//!
//! [`Packet::decode`] checks, in this order: the common header present
//! ([`TooShort`](PacketError::TooShort)), magic ([`BadMagic`](PacketError::BadMagic)), version
//! ([`UnsupportedVersion`](PacketError::UnsupportedVersion)), kind
//! ([`UnknownKind`](PacketError::UnknownKind)), the kind's header present
//! ([`TooShort`](PacketError::TooShort)), lengths consistent with the buffer and reserved fields
//! zero ([`ImpossibleLength`](PacketError::ImpossibleLength)), the CRC
//! ([`CrcMismatch`](PacketError::CrcMismatch), carrying the DATA sequence number so the receiver
//! can NACK it), the job key ([`ForeignJob`](PacketError::ForeignJob)) and a DATA sequence number
//! ≥ 1 ([`InvalidSequence`](PacketError::InvalidSequence)). The CRC is checked before the job key,
//! so a corrupted key is reported as corruption. Decoding never panics and never copies the
//! payload: it is a [`Bytes::slice`] of the input. The encoding is canonical: a buffer that
//! decodes is exactly what [`Packet::encode`] produces for the decoded packet.

use bytes::Bytes;

use crate::wire::checksum_parts;

/// The two magic bytes at offset 0.
pub const MAGIC: [u8; 2] = *b"RL";
/// The link format version this build writes and reads.
pub const VERSION: u8 = 3;
/// Length of the header common to all packets.
pub const COMMON_HEADER_LEN: usize = 24;
/// Length of a DATA packet's header (the payload follows).
pub const DATA_HEADER_LEN: usize = 56;
/// Length of an ACK packet without selective bitmap words.
pub const ACK_HEADER_LEN: usize = 52;
/// Length of a RAW packet's header (the payload follows).
pub const RAW_HEADER_LEN: usize = 32;
/// Length of a PING or PONG packet.
pub const PROBE_LEN: usize = 32;
/// Largest number of selective-ACK bitmap words a packet may carry (65 536 sequence numbers).
pub const MAX_SACK_WORDS: usize = 1024;
/// ACK flag: the `nack` field reports a duplicate ([`AckInfo::duplicate`]), not corruption.
pub const ACK_FLAG_DUPLICATE: u16 = 1;

const KIND_DATA: u8 = 1;
const KIND_ACK: u8 = 2;
const KIND_RAW: u8 = 3;
const KIND_PING: u8 = 4;
const KIND_PONG: u8 = 5;
const KIND_BYE: u8 = 6;
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
    /// What the packet carries.
    pub body: PacketBody,
}

/// Longest head a [`PacketPayload`] keeps inline: room for any frame header
/// ([`wire::MAX_HEADER_LEN`](crate::wire::MAX_HEADER_LEN)).
pub const HEAD_CAPACITY: usize = 64;

/// The bytes a DATA or RAW packet carries after its header, as a head and a body: a frame's
/// encoded header and its payload travel in one gathered send without being joined (no copy of
/// the payload on the sending side). The head is kept inline (no allocation per packet: it is
/// short, and the retransmit queue holds a payload until its ACK). A decoded packet has it all
/// in the body. Two payloads are equal when their bytes are, however they are split.
#[derive(Clone)]
pub struct PacketPayload {
    head_len: u8,
    head: [u8; HEAD_CAPACITY],
    body: Bytes,
}

impl Default for PacketPayload {
    fn default() -> Self {
        PacketPayload::from(Bytes::new())
    }
}

impl std::fmt::Debug for PacketPayload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PacketPayload")
            .field("head", &self.head())
            .field("body", &self.body)
            .finish()
    }
}

impl PacketPayload {
    /// A payload of `head` followed by `body`. A head longer than [`HEAD_CAPACITY`] is joined
    /// with the body into one buffer (a copy) instead.
    pub fn new(head: &[u8], body: Bytes) -> Self {
        if head.len() > HEAD_CAPACITY {
            let mut joined = Vec::with_capacity(head.len() + body.len());
            joined.extend_from_slice(head);
            joined.extend_from_slice(&body);
            return PacketPayload::from(Bytes::from(joined));
        }
        let mut inline = [0u8; HEAD_CAPACITY];
        inline[..head.len()].copy_from_slice(head);
        PacketPayload {
            head_len: head.len() as u8,
            head: inline,
            body,
        }
    }

    /// The first bytes (typically a frame header; often empty).
    pub fn head(&self) -> &[u8] {
        &self.head[..usize::from(self.head_len)]
    }

    /// The rest.
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        usize::from(self.head_len) + self.body.len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The two parts, to send gathered.
    pub fn parts(&self) -> [&[u8]; 2] {
        [self.head(), &self.body]
    }

    /// The bytes as one buffer: the body itself when the head is empty (always so for a
    /// received packet), else a joined copy.
    pub fn into_bytes(self) -> Bytes {
        if self.head_len == 0 {
            return self.body;
        }
        let mut joined = Vec::with_capacity(self.len());
        joined.extend_from_slice(self.head());
        joined.extend_from_slice(&self.body);
        Bytes::from(joined)
    }
}

impl From<Bytes> for PacketPayload {
    fn from(body: Bytes) -> Self {
        PacketPayload {
            head_len: 0,
            head: [0; HEAD_CAPACITY],
            body,
        }
    }
}

impl PartialEq for PacketPayload {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len()
            && self
                .head()
                .iter()
                .chain(&self.body)
                .eq(other.head().iter().chain(&other.body))
    }
}

impl Eq for PacketPayload {}

/// What a packet carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PacketBody {
    /// A sequence-numbered payload with a piggybacked acknowledgement of the reverse direction.
    Data {
        /// Sequence number (≥ 1).
        seq: u64,
        /// Piggybacked cumulative ACK: the sender of this packet received every sequence number
        /// up to this one from the packet's destination (`0`: none yet).
        ack: u64,
        /// Piggybacked flow control: the sender of this packet accepts sequence numbers below
        /// this from the packet's destination.
        window_end: u64,
        /// The payload.
        payload: PacketPayload,
    },
    /// Acknowledgement information.
    Ack(AckInfo),
    /// A payload without reliability (no sequence number; the CRC covers the header only). For
    /// transports running with reliability off.
    Raw {
        /// The payload.
        payload: PacketPayload,
    },
    /// A route probe: the receiver answers with a [`Pong`](PacketBody::Pong) of the same nonce on
    /// the route it arrived on.
    Ping {
        /// Chosen by the sender.
        nonce: u64,
    },
    /// The answer to a [`Ping`](PacketBody::Ping).
    Pong {
        /// The PING's nonce.
        nonce: u64,
    },
    /// The sender closed cleanly and answers no more keepalives.
    Bye,
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
    /// A sequence number whose packet arrived again after it had been received: the sender's
    /// latest copy of it was not needed. Advisory, and only where there is no
    /// [`nack`](Self::nack) (an ACK carries one of the two; the codec drops this one if both
    /// are set).
    pub duplicate: Option<u64>,
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
        /// The DATA sequence number as read from the (possibly corrupt) header; `None` for the
        /// other kinds.
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
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut le = [0u8; 8];
    le.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(le)
}

impl Packet {
    /// The kind's header length for DATA packets: the room a transport must leave in a datagram
    /// beside the payload when reliability is on (ACK, PING and PONG packets carry no payload).
    pub const fn max_data_header_len() -> usize {
        DATA_HEADER_LEN
    }

    /// The header length of RAW packets: the room a transport must leave in a datagram beside the
    /// payload when reliability is off.
    pub const fn raw_header_len() -> usize {
        RAW_HEADER_LEN
    }

    /// A RAW packet (reliability off) carrying `payload` from `source` to `destination`.
    pub fn raw(
        job_key: u64,
        source: u32,
        destination: u32,
        payload: impl Into<PacketPayload>,
    ) -> Packet {
        Packet {
            job_key,
            source,
            destination,
            body: PacketBody::Raw {
                payload: payload.into(),
            },
        }
    }

    /// The payload that follows the header on the wire (DATA and RAW), else `None`.
    pub fn payload(&self) -> Option<&PacketPayload> {
        match &self.body {
            PacketBody::Data { payload, .. } | PacketBody::Raw { payload } => Some(payload),
            PacketBody::Ack(_)
            | PacketBody::Ping { .. }
            | PacketBody::Pong { .. }
            | PacketBody::Bye => None,
        }
    }

    /// Bytes [`write_header`](Self::write_header) produces: the header of DATA and RAW, the
    /// whole packet otherwise.
    pub fn header_len(&self) -> usize {
        match &self.body {
            PacketBody::Data { .. } => DATA_HEADER_LEN,
            PacketBody::Ack(ack) => ACK_HEADER_LEN + 8 * ack.selective.len().min(MAX_SACK_WORDS),
            PacketBody::Raw { .. } => RAW_HEADER_LEN,
            PacketBody::Ping { .. } | PacketBody::Pong { .. } | PacketBody::Bye => PROBE_LEN,
        }
    }

    /// Bytes [`encode`](Self::encode) produces for this packet.
    pub fn encoded_len(&self) -> usize {
        self.header_len() + self.payload().map_or(0, PacketPayload::len)
    }

    /// Writes the packet without its payload into `out` (cleared first): for DATA and RAW the
    /// header, whose CRC covers header and payload (DATA) or the header alone (RAW); for ACK,
    /// PING and PONG the whole packet. Sending `out` followed by [`payload`](Self::payload) as
    /// one datagram is sending [`encode`](Self::encode)`()`.
    ///
    /// An ACK with more than [`MAX_SACK_WORDS`] bitmap words is written with the first
    /// [`MAX_SACK_WORDS`] only (selective information is advisory; the link never builds such
    /// ACKs).
    ///
    /// # Panics
    ///
    /// If a DATA or RAW payload is longer than `u32::MAX` bytes (no datagram is that long).
    pub fn write_header(&self, out: &mut Vec<u8>) {
        out.clear();
        out.reserve(self.header_len());
        out.extend_from_slice(&MAGIC);
        out.push(VERSION);
        out.push(match self.body {
            PacketBody::Data { .. } => KIND_DATA,
            PacketBody::Ack(_) => KIND_ACK,
            PacketBody::Raw { .. } => KIND_RAW,
            PacketBody::Ping { .. } => KIND_PING,
            PacketBody::Pong { .. } => KIND_PONG,
            PacketBody::Bye => KIND_BYE,
        });
        out.extend_from_slice(&[0; 4]); // CRC, filled in below
        out.extend_from_slice(&self.job_key.to_le_bytes());
        out.extend_from_slice(&self.source.to_le_bytes());
        out.extend_from_slice(&self.destination.to_le_bytes());
        let payload_len =
            |p: &PacketPayload| u32::try_from(p.len()).expect("payload longer than u32::MAX");
        let mut crc_payload: [&[u8]; 2] = [&[], &[]];
        match &self.body {
            PacketBody::Data {
                seq,
                ack,
                window_end,
                payload,
            } => {
                out.extend_from_slice(&seq.to_le_bytes());
                out.extend_from_slice(&ack.to_le_bytes());
                out.extend_from_slice(&window_end.to_le_bytes());
                out.extend_from_slice(&payload_len(payload).to_le_bytes());
                out.extend_from_slice(&[0; 4]);
                crc_payload = payload.parts();
            }
            PacketBody::Ack(ack) => {
                let words = &ack.selective[..ack.selective.len().min(MAX_SACK_WORDS)];
                out.extend_from_slice(&ack.cumulative.to_le_bytes());
                out.extend_from_slice(&ack.window_end.to_le_bytes());
                let (reported, flags) = match (ack.nack, ack.duplicate) {
                    (Some(nack), _) => (nack, 0),
                    (None, Some(dup)) if dup != 0 => (dup, ACK_FLAG_DUPLICATE),
                    _ => (0, 0),
                };
                out.extend_from_slice(&reported.to_le_bytes());
                out.extend_from_slice(&(words.len() as u16).to_le_bytes());
                out.extend_from_slice(&flags.to_le_bytes());
                for word in words {
                    out.extend_from_slice(&word.to_le_bytes());
                }
            }
            PacketBody::Raw { payload } => {
                out.extend_from_slice(&payload_len(payload).to_le_bytes());
                out.extend_from_slice(&[0; 4]);
            }
            PacketBody::Ping { nonce } | PacketBody::Pong { nonce } => {
                out.extend_from_slice(&nonce.to_le_bytes());
            }
            PacketBody::Bye => out.extend_from_slice(&[0; 8]),
        }
        let crc = checksum_parts(&[
            &out[..CRC_RANGE.start],
            &out[CRC_RANGE.end..],
            crc_payload[0],
            crc_payload[1],
        ]);
        out[CRC_RANGE].copy_from_slice(&crc.to_le_bytes());
    }

    /// Encodes the packet, CRC included, into one buffer: [`write_header`](Self::write_header)
    /// followed by the [`payload`](Self::payload).
    ///
    /// # Panics
    ///
    /// As [`write_header`](Self::write_header).
    pub fn encode(&self) -> Bytes {
        let mut buf = Vec::with_capacity(self.encoded_len());
        self.write_header(&mut buf);
        if let Some(payload) = self.payload() {
            buf.extend_from_slice(payload.head());
            buf.extend_from_slice(payload.body());
        }
        Bytes::from(buf)
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
            KIND_RAW => RAW_HEADER_LEN,
            KIND_PING | KIND_PONG | KIND_BYE => PROBE_LEN,
            other => return Err(PacketError::UnknownKind(other)),
        };
        if b.len() < need {
            return Err(PacketError::TooShort {
                need,
                have: b.len(),
            });
        }
        let reserved_zero = |at: usize, len: usize| {
            let v = if len == 2 {
                u32::from(u16_at(b, at))
            } else {
                u32_at(b, at)
            };
            if v == 0 {
                Ok(())
            } else {
                Err(PacketError::ImpossibleLength(u64::from(v)))
            }
        };
        // How far the CRC reaches, and the sequence number a CRC error reports.
        let (crc_end, seq) = match kind {
            KIND_DATA => {
                let len = u32_at(b, 48) as usize;
                if len != b.len() - DATA_HEADER_LEN {
                    return Err(PacketError::ImpossibleLength(len as u64));
                }
                reserved_zero(52, 4)?;
                (b.len(), Some(u64_at(b, 24)))
            }
            KIND_ACK => {
                let words = u16_at(b, 48) as usize;
                if words > MAX_SACK_WORDS || ACK_HEADER_LEN + 8 * words != b.len() {
                    return Err(PacketError::ImpossibleLength(words as u64));
                }
                let flags = u16_at(b, 50);
                if flags & !ACK_FLAG_DUPLICATE != 0
                    || (flags & ACK_FLAG_DUPLICATE != 0 && u64_at(b, 40) == 0)
                {
                    return Err(PacketError::ImpossibleLength(u64::from(flags)));
                }
                (b.len(), None)
            }
            KIND_RAW => {
                let len = u32_at(b, 24) as usize;
                if len != b.len() - RAW_HEADER_LEN {
                    return Err(PacketError::ImpossibleLength(len as u64));
                }
                reserved_zero(28, 4)?;
                (RAW_HEADER_LEN, None)
            }
            _ => {
                if b.len() != PROBE_LEN {
                    return Err(PacketError::ImpossibleLength(b.len() as u64));
                }
                if kind == KIND_BYE {
                    reserved_zero(24, 4)?;
                    reserved_zero(28, 4)?;
                }
                (b.len(), None)
            }
        };
        let stored = u32_at(b, CRC_RANGE.start);
        let computed = checksum_parts(&[&b[..CRC_RANGE.start], &b[CRC_RANGE.end..crc_end]]);
        if stored != computed {
            return Err(PacketError::CrcMismatch {
                seq,
                sender: u32_at(b, 16),
                stored,
                computed,
            });
        }
        let key = u64_at(b, 8);
        if key != job_key {
            return Err(PacketError::ForeignJob { key });
        }
        let body = match kind {
            KIND_DATA => {
                let seq = u64_at(b, 24);
                if seq == 0 {
                    return Err(PacketError::InvalidSequence);
                }
                PacketBody::Data {
                    seq,
                    ack: u64_at(b, 32),
                    window_end: u64_at(b, 40),
                    payload: buf.slice(DATA_HEADER_LEN..).into(),
                }
            }
            KIND_ACK => {
                let words = u16_at(b, 48) as usize;
                let reported = u64_at(b, 40);
                let duplicate = u16_at(b, 50) & ACK_FLAG_DUPLICATE != 0;
                PacketBody::Ack(AckInfo {
                    cumulative: u64_at(b, 24),
                    window_end: u64_at(b, 32),
                    nack: (reported != 0 && !duplicate).then_some(reported),
                    duplicate: duplicate.then_some(reported),
                    selective: (0..words)
                        .map(|w| u64_at(b, ACK_HEADER_LEN + 8 * w))
                        .collect(),
                })
            }
            KIND_RAW => PacketBody::Raw {
                payload: buf.slice(RAW_HEADER_LEN..).into(),
            },
            KIND_PING => PacketBody::Ping {
                nonce: u64_at(b, 24),
            },
            KIND_BYE => PacketBody::Bye,
            _ => PacketBody::Pong {
                nonce: u64_at(b, 24),
            },
        };
        Ok(Packet {
            job_key: key,
            source: u32_at(b, 16),
            destination: u32_at(b, 20),
            body,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn packet(body: PacketBody) -> Packet {
        Packet {
            job_key: 7,
            source: 1,
            destination: 2,
            body,
        }
    }

    fn data(seq: u64, payload: &'static [u8]) -> Packet {
        packet(PacketBody::Data {
            seq,
            ack: 3,
            window_end: 260,
            payload: Bytes::from_static(payload).into(),
        })
    }

    /// `write_header` followed by the payload, as a transport sends it.
    fn gathered(p: &Packet) -> Vec<u8> {
        let mut out = vec![0xEE; 3]; // stale contents are cleared
        p.write_header(&mut out);
        assert_eq!(out.len(), p.header_len());
        if let Some(payload) = p.payload() {
            for part in payload.parts() {
                out.extend_from_slice(part);
            }
        }
        out
    }

    #[test]
    fn data_round_trip_is_zero_copy() {
        let p = data(5, b"hello");
        let buf = p.encode();
        assert_eq!(buf.len(), DATA_HEADER_LEN + 5);
        assert_eq!(gathered(&p), buf.to_vec());
        let q = Packet::decode(&buf, 7).unwrap();
        assert_eq!(q, p);
        let PacketBody::Data { payload, .. } = q.body else {
            unreachable!()
        };
        assert!(payload.head().is_empty());
        assert_eq!(payload.body().as_ptr(), buf[DATA_HEADER_LEN..].as_ptr());
    }

    #[test]
    fn a_split_payload_goes_out_as_if_joined() {
        let joined = data(5, b"headbody");
        let split = packet(PacketBody::Data {
            seq: 5,
            ack: 3,
            window_end: 260,
            payload: PacketPayload::new(b"head", Bytes::from_static(b"body")),
        });
        assert_eq!(split, joined, "equal bytes, however split");
        assert_eq!(split.encode(), joined.encode(), "same bytes, same CRC");
        assert_eq!(gathered(&split), joined.encode().to_vec());
        assert_eq!(Packet::decode(&split.encode(), 7).unwrap(), joined);
        let other = packet(PacketBody::Data {
            seq: 5,
            ack: 3,
            window_end: 260,
            payload: PacketPayload::new(b"head", Bytes::from_static(b"bodz")),
        });
        assert_ne!(other, joined);
        assert_eq!(
            PacketPayload::new(b"ab", Bytes::from_static(b"c")).into_bytes(),
            Bytes::from_static(b"abc")
        );
    }

    #[test]
    fn ack_round_trip_and_queries() {
        let ack = AckInfo {
            cumulative: 10,
            window_end: 300,
            selective: vec![0b101, 1 << 63],
            nack: Some(11),
            duplicate: None,
        };
        assert!(ack.acknowledges(3) && ack.acknowledges(10) && ack.acknowledges(12));
        assert!(!ack.acknowledges(11) && !ack.acknowledges(13) && ack.acknowledges(14));
        assert!(ack.acknowledges(12 + 127) && !ack.acknowledges(12 + 128));
        assert_eq!(ack.selective_seqs().collect::<Vec<_>>(), vec![12, 14, 139]);
        assert_eq!(ack.largest(), 139);
        let p = packet(PacketBody::Ack(ack));
        assert_eq!(p.payload(), None);
        assert_eq!(gathered(&p), p.encode().to_vec());
        assert_eq!(Packet::decode(&p.encode(), 7).unwrap(), p);
    }

    #[test]
    fn an_ack_reports_a_nack_or_a_duplicate_and_a_nack_wins() {
        let ack = |nack, duplicate| {
            packet(PacketBody::Ack(AckInfo {
                cumulative: 10,
                window_end: 300,
                selective: Vec::new(),
                nack,
                duplicate,
            }))
        };
        let dup = ack(None, Some(7));
        let buf = dup.encode();
        assert_eq!(u16::from_le_bytes([buf[50], buf[51]]), ACK_FLAG_DUPLICATE);
        assert_eq!(Packet::decode(&buf, 7).unwrap(), dup);
        // Both set: the NACK goes, the advisory duplicate report does not.
        let both = Packet::decode(&ack(Some(11), Some(7)).encode(), 7).unwrap();
        assert_eq!(both, ack(Some(11), None));
        // A duplicate flag without a sequence number, or an unknown flag, is malformed.
        for (reported, flags) in [(0u64, ACK_FLAG_DUPLICATE), (7, 2)] {
            let mut bad = buf.to_vec();
            bad[40..48].copy_from_slice(&reported.to_le_bytes());
            bad[50..52].copy_from_slice(&flags.to_le_bytes());
            let crc = checksum_parts(&[&bad[..4], &bad[8..]]);
            bad[4..8].copy_from_slice(&crc.to_le_bytes());
            assert_eq!(
                Packet::decode(&Bytes::from(bad), 7),
                Err(PacketError::ImpossibleLength(u64::from(flags)))
            );
        }
    }

    #[test]
    fn raw_ping_pong_round_trip() {
        let raw = Packet::raw(7, 1, 2, Bytes::from_static(b"unreliable"));
        let buf = raw.encode();
        assert_eq!(buf.len(), RAW_HEADER_LEN + 10);
        assert_eq!(gathered(&raw), buf.to_vec());
        assert_eq!(Packet::decode(&buf, 7).unwrap(), raw);
        // The RAW CRC covers the header only: a flipped payload byte goes unnoticed here...
        let mut flipped = buf.to_vec();
        *flipped.last_mut().unwrap() ^= 1;
        let q = Packet::decode(&Bytes::from(flipped), 7).unwrap();
        assert_eq!(q.payload().unwrap().body.as_ref(), b"unreliabld");
        // ...but a flipped header byte does not.
        let mut flipped = buf.to_vec();
        flipped[17] ^= 1;
        assert!(matches!(
            Packet::decode(&Bytes::from(flipped), 7),
            Err(PacketError::CrcMismatch { seq: None, .. })
        ));
        for body in [
            PacketBody::Ping { nonce: 0xDEAD_BEEF },
            PacketBody::Pong { nonce: u64::MAX },
            PacketBody::Bye,
        ] {
            let p = packet(body);
            let buf = p.encode();
            assert_eq!(buf.len(), PROBE_LEN);
            assert_eq!(gathered(&p), buf.to_vec());
            assert_eq!(Packet::decode(&buf, 7).unwrap(), p);
            let mut longer = buf.to_vec();
            longer.push(0);
            assert!(matches!(
                Packet::decode(&Bytes::from(longer), 7),
                Err(PacketError::ImpossibleLength(33))
            ));
        }
        assert_eq!(Packet::max_data_header_len(), DATA_HEADER_LEN);
        assert_eq!(Packet::raw_header_len(), RAW_HEADER_LEN);
    }

    #[test]
    fn oversized_sack_is_truncated_not_panicking() {
        let p = packet(PacketBody::Ack(AckInfo {
            cumulative: 1,
            window_end: 2,
            selective: vec![1; MAX_SACK_WORDS + 3],
            nack: None,
            duplicate: None,
        }));
        let q = Packet::decode(&p.encode(), 7).unwrap();
        let PacketBody::Ack(ack) = q.body else {
            unreachable!()
        };
        assert_eq!(ack.selective.len(), MAX_SACK_WORDS);
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
        bad[53] = 1; // reserved
        assert!(matches!(
            Packet::decode(&Bytes::from(bad), 7),
            Err(PacketError::ImpossibleLength(256))
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
            (
                any::<u64>(),
                any::<u64>(),
                any::<u64>(),
                proptest::collection::vec(any::<u8>(), 0..200)
            )
                .prop_map(|(seq, ack, window_end, p)| PacketBody::Data {
                    seq: seq.max(1),
                    ack,
                    window_end,
                    payload: Bytes::from(p).into(),
                }),
            (
                any::<u64>(),
                any::<u64>(),
                proptest::collection::vec(any::<u64>(), 0..5),
                proptest::option::of(1..u64::MAX),
                any::<bool>(),
            )
                .prop_map(|(cumulative, window_end, selective, reported, dup)| {
                    PacketBody::Ack(AckInfo {
                        cumulative,
                        window_end,
                        selective,
                        nack: reported.filter(|_| !dup),
                        duplicate: reported.filter(|_| dup),
                    })
                }),
            proptest::collection::vec(any::<u8>(), 0..200).prop_map(|p| PacketBody::Raw {
                payload: Bytes::from(p).into()
            }),
            any::<u64>().prop_map(|nonce| PacketBody::Ping { nonce }),
            any::<u64>().prop_map(|nonce| PacketBody::Pong { nonce }),
            Just(PacketBody::Bye),
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
            prop_assert_eq!(gathered(&p), buf.to_vec());
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
            // RAW payload bytes are not covered by the CRC (by design).
            prop_assume!(!matches!(p.body, PacketBody::Raw { .. }) || i < RAW_HEADER_LEN);
            bad[i] ^= flip;
            prop_assert!(Packet::decode(&Bytes::from(bad), p.job_key).is_err());
        }
    }
}
