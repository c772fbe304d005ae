//! What travels in a receive buffer of an RC connection: the connection's own messages.
//!
//! Every message starts with an 8-byte header; all integers are little-endian:
//!
//! | Offset | Size | Field      | Meaning                                                     |
//! |--------|------|------------|-------------------------------------------------------------|
//! | 0      | 1    | `magic`    | `0xB7`                                                      |
//! | 1      | 1    | `kind`     | `1` Frame, `2` Credit, `3` Rts, `4` Cts, `5` Bye, `6` LaneDown, `7` ReadRts, `8` Fin |
//! | 2      | 2    | `credits`  | `u16`: receive buffers the sender reposted for the receiver |
//! | 4      | 4    | `transfer` | `u32`: rendezvous transfer id (Rts, Cts, ReadRts, Fin), lane (LaneDown); else 0 |
//!
//! and then, by kind:
//!
//! * **Frame**: the [`StreamTag`] (12 bytes: `u64` sequence number, `u16` part, `u16` parts),
//!   then a whole frame in the wire format of `rankweave_core::wire`.
//! * **Credit**, **LaneDown**: nothing (LaneDown names the lane, another lane of the same
//!   connection that failed at the sender, in the `transfer` field).
//! * **Bye**: `u64`, the sequence number the sender's stream ends at (every frame below it
//!   was sent before, on some lane).
//! * **Rts** (a frame too large for a receive buffer): the [`StreamTag`], `u64` payload length,
//!   then the frame's header in the wire format (declaring that payload length). The receiver
//!   registers a buffer of that length and answers with a Cts.
//! * **Cts**: `u64` address and `u32` remote key of the receiver's buffer. The sender writes
//!   the payload there with an RDMA write whose immediate data is the transfer id: the
//!   receiver learns from that write's receive completion that the payload is in place (no
//!   FIN message).
//! * **ReadRts** (a frame sent by RDMA-read rendezvous): the [`StreamTag`], `u64` payload
//!   length, `u64` address and `u32` remote key of the sender's registered payload, then the
//!   frame's header in the wire format. The receiver registers a buffer, reads the payload
//!   into it with RDMA reads, and answers with a Fin.
//! * **Fin**: nothing (the transfer id names the ReadRts): the receiver has read the payload;
//!   the sender may release its registration, and the frame counts as delivered.

use bytes::Bytes;
use rankweave_core::frame::{Frame, Header};
use rankweave_core::wire::{self, DecodeError};

/// The first byte of every message.
pub const MAGIC: u8 = 0xB7;

/// Bytes of the header every message starts with.
pub const HEADER_LEN: usize = 8;

mod kind {
    pub(super) const FRAME: u8 = 1;
    pub(super) const CREDIT: u8 = 2;
    pub(super) const RTS: u8 = 3;
    pub(super) const CTS: u8 = 4;
    pub(super) const BYE: u8 = 5;
    pub(super) const LANE_DOWN: u8 = 6;
    pub(super) const READ_RTS: u8 = 7;
    pub(super) const FIN: u8 = 8;
}

/// Where a frame (or one part of a striped frame) belongs in the stream of all frames from
/// one rank to another, across every lane (see [`super::stream`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamTag {
    /// The frame's sequence number in the stream (from 0).
    pub seq: u64,
    /// Which part of the frame this is (0 when it is not striped).
    pub part: u16,
    /// How many parts the frame was split into (1 when it is not striped).
    pub parts: u16,
}

impl StreamTag {
    /// Bytes of its encoding.
    pub const LEN: usize = 12;

    /// The tag of a whole (unstriped) frame.
    pub fn whole(seq: u64) -> StreamTag {
        StreamTag {
            seq,
            part: 0,
            parts: 1,
        }
    }

    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.seq.to_le_bytes());
        out.extend_from_slice(&self.part.to_le_bytes());
        out.extend_from_slice(&self.parts.to_le_bytes());
    }

    fn decode(b: &[u8]) -> Result<StreamTag, MessageError> {
        let b: &[u8; 12] = b
            .get(..Self::LEN)
            .and_then(|b| b.try_into().ok())
            .ok_or(MessageError::TooShort(b.len() + HEADER_LEN))?;
        let tag = StreamTag {
            seq: u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]),
            part: u16::from_le_bytes([b[8], b[9]]),
            parts: u16::from_le_bytes([b[10], b[11]]),
        };
        if tag.parts == 0 || tag.part >= tag.parts {
            return Err(MessageError::BadTag {
                part: tag.part,
                parts: tag.parts,
            });
        }
        Ok(tag)
    }
}

/// A decoded message (see the [module docs](self)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// A whole frame (or part of a striped one).
    Frame {
        /// Its place in the stream.
        tag: StreamTag,
        /// The frame.
        frame: Frame,
    },
    /// Only credits.
    Credit,
    /// A frame whose payload follows by RDMA write.
    Rts {
        /// Its place in the stream.
        tag: StreamTag,
        /// The transfer id.
        transfer: u32,
        /// The frame's header.
        header: Header,
        /// The payload's length.
        len: u64,
    },
    /// The receiver's buffer for a transfer.
    Cts {
        /// The transfer id.
        transfer: u32,
        /// The buffer's address.
        addr: u64,
        /// The buffer's remote key.
        rkey: u32,
    },
    /// A frame whose payload the receiver reads by RDMA read from the sender's registered
    /// memory.
    ReadRts {
        /// Its place in the stream.
        tag: StreamTag,
        /// The transfer id.
        transfer: u32,
        /// The frame's header.
        header: Header,
        /// The payload's length.
        len: u64,
        /// The address of the payload's first byte in the sender's registered region.
        addr: u64,
        /// The region's remote key (read access).
        rkey: u32,
    },
    /// The receiver has read the payload of a [`Message::ReadRts`].
    Fin {
        /// The transfer id.
        transfer: u32,
    },
    /// Lane `lane` of this connection failed at the sender: the receiver stops using it too.
    LaneDown {
        /// The lane.
        lane: u32,
    },
    /// The sender is closing: its stream ends before sequence number `end`.
    Bye {
        /// The first sequence number the sender did not use.
        end: u64,
    },
}

/// Why a received buffer is not a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MessageError {
    /// Shorter than its header.
    #[error("message too short: {0} bytes")]
    TooShort(usize),
    /// Not this protocol's magic.
    #[error("bad magic byte {0:#04x}")]
    BadMagic(u8),
    /// An unknown kind.
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    /// A stream tag whose part is not below its number of parts.
    #[error("bad stream tag: part {part} of {parts}")]
    BadTag {
        /// The part.
        part: u16,
        /// The number of parts.
        parts: u16,
    },
    /// The frame inside does not decode.
    #[error("bad frame: {0}")]
    Frame(#[from] DecodeError),
    /// An Rts whose frame header does not declare the Rts's length.
    #[error("rendezvous length {rts} but frame header says {header}")]
    LengthMismatch {
        /// The Rts's length.
        rts: u64,
        /// The header's payload length.
        header: u64,
    },
}

fn put_header(out: &mut Vec<u8>, kind: u8, credits: u16, transfer: u32) {
    out.push(MAGIC);
    out.push(kind);
    out.extend_from_slice(&credits.to_le_bytes());
    out.extend_from_slice(&transfer.to_le_bytes());
}

impl Message {
    /// Appends this message, carrying `credits`, to `out`.
    pub fn encode(&self, credits: u16, out: &mut Vec<u8>) {
        match self {
            Message::Frame { tag, frame } => {
                put_header(out, kind::FRAME, credits, 0);
                tag.encode(out);
                wire::encode_header(&frame.header, frame.payload.len(), out);
                out.extend_from_slice(&frame.payload);
            }
            Message::Credit => put_header(out, kind::CREDIT, credits, 0),
            Message::LaneDown { lane } => put_header(out, kind::LANE_DOWN, credits, *lane),
            Message::Bye { end } => {
                put_header(out, kind::BYE, credits, 0);
                out.extend_from_slice(&end.to_le_bytes());
            }
            Message::Rts {
                tag,
                transfer,
                header,
                len,
            } => {
                put_header(out, kind::RTS, credits, *transfer);
                tag.encode(out);
                out.extend_from_slice(&len.to_le_bytes());
                wire::encode_header(header, *len as usize, out);
            }
            Message::ReadRts {
                tag,
                transfer,
                header,
                len,
                addr,
                rkey,
            } => {
                put_header(out, kind::READ_RTS, credits, *transfer);
                tag.encode(out);
                out.extend_from_slice(&len.to_le_bytes());
                out.extend_from_slice(&addr.to_le_bytes());
                out.extend_from_slice(&rkey.to_le_bytes());
                wire::encode_header(header, *len as usize, out);
            }
            Message::Fin { transfer } => put_header(out, kind::FIN, credits, *transfer),
            Message::Cts {
                transfer,
                addr,
                rkey,
            } => {
                put_header(out, kind::CTS, credits, *transfer);
                out.extend_from_slice(&addr.to_le_bytes());
                out.extend_from_slice(&rkey.to_le_bytes());
            }
        }
    }

    /// Encoded length of a Frame message carrying `frame`.
    pub fn frame_len(frame: &Frame) -> usize {
        HEADER_LEN + StreamTag::LEN + wire::encoded_len(&frame.header) + frame.payload.len()
    }

    /// Decodes a received message; returns it and the credits it carries. A frame's payload is a
    /// slice of `bytes` (no copy). Never panics.
    pub fn decode(bytes: Bytes) -> Result<(Message, u16), MessageError> {
        let buf = &bytes[..];
        if buf.len() < HEADER_LEN {
            return Err(MessageError::TooShort(buf.len()));
        }
        if buf[0] != MAGIC {
            return Err(MessageError::BadMagic(buf[0]));
        }
        let credits = u16::from_le_bytes([buf[2], buf[3]]);
        let transfer = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]);
        let body = &buf[HEADER_LEN..];
        let message = match buf[1] {
            kind::FRAME => Message::Frame {
                tag: StreamTag::decode(body)?,
                frame: wire::decode(bytes.slice(HEADER_LEN + StreamTag::LEN..))?,
            },
            kind::CREDIT => Message::Credit,
            kind::LANE_DOWN => Message::LaneDown { lane: transfer },
            kind::BYE => Message::Bye {
                end: u64::from_le_bytes(
                    body.get(..8)
                        .and_then(|b| b.try_into().ok())
                        .ok_or(MessageError::TooShort(buf.len()))?,
                ),
            },
            kind::RTS => {
                let tag = StreamTag::decode(body)?;
                let body = &body[StreamTag::LEN..];
                let len = u64::from_le_bytes(
                    body.get(..8)
                        .and_then(|b| b.try_into().ok())
                        .ok_or(MessageError::TooShort(buf.len()))?,
                );
                let (header, declared, _) = wire::decode_header(&body[8..])?;
                if declared != len {
                    return Err(MessageError::LengthMismatch {
                        rts: len,
                        header: declared,
                    });
                }
                Message::Rts {
                    tag,
                    transfer,
                    header,
                    len,
                }
            }
            kind::READ_RTS => {
                let tag = StreamTag::decode(body)?;
                let body = &body[StreamTag::LEN..];
                let fields: [u8; 20] = body
                    .get(..20)
                    .and_then(|b| b.try_into().ok())
                    .ok_or(MessageError::TooShort(buf.len()))?;
                let len = u64::from_le_bytes(fields[..8].try_into().unwrap_or_default());
                let addr = u64::from_le_bytes(fields[8..16].try_into().unwrap_or_default());
                let rkey = u32::from_le_bytes(fields[16..].try_into().unwrap_or_default());
                let (header, declared, _) = wire::decode_header(&body[20..])?;
                if declared != len {
                    return Err(MessageError::LengthMismatch {
                        rts: len,
                        header: declared,
                    });
                }
                Message::ReadRts {
                    tag,
                    transfer,
                    header,
                    len,
                    addr,
                    rkey,
                }
            }
            kind::FIN => Message::Fin { transfer },
            kind::CTS => {
                let fields: [u8; 12] = body
                    .get(..12)
                    .and_then(|b| b.try_into().ok())
                    .ok_or(MessageError::TooShort(buf.len()))?;
                let addr = u64::from_le_bytes(fields[..8].try_into().unwrap_or_default());
                let rkey = u32::from_le_bytes(fields[8..].try_into().unwrap_or_default());
                Message::Cts {
                    transfer,
                    addr,
                    rkey,
                }
            }
            other => return Err(MessageError::UnknownKind(other)),
        };
        Ok((message, credits))
    }
}

#[cfg(test)]
mod tests {
    use rankweave_core::ContextId;
    use rankweave_core::frame::Envelope;

    use super::*;

    fn envelope(len: u64) -> Envelope {
        Envelope {
            context: ContextId(3),
            tag: 9,
            seq: 4,
            len,
        }
    }

    #[test]
    fn every_kind_round_trips_with_its_credits() {
        let messages = [
            Message::Frame {
                tag: StreamTag {
                    seq: u64::MAX - 3,
                    part: 2,
                    parts: 3,
                },
                frame: Frame {
                    header: Header::Eager(envelope(5)),
                    payload: Bytes::from_static(b"hello"),
                },
            },
            Message::Credit,
            Message::LaneDown { lane: 3 },
            Message::Bye { end: 1 << 40 },
            Message::Rts {
                tag: StreamTag::whole(9),
                transfer: 77,
                header: Header::Data {
                    recv_id: 5,
                    offset: 0,
                },
                len: 1 << 26,
            },
            Message::Cts {
                transfer: 77,
                addr: 0xdead_beef_0000,
                rkey: 0x1234,
            },
            Message::ReadRts {
                tag: StreamTag {
                    seq: 12,
                    part: 1,
                    parts: 2,
                },
                transfer: 78,
                header: Header::Eager(envelope(1 << 25)),
                len: 1 << 25,
                addr: 0x7f00_1234_5000,
                rkey: 0xabcd,
            },
            Message::Fin { transfer: 78 },
        ];
        for (i, m) in messages.iter().enumerate() {
            let mut buf = Vec::new();
            m.encode(i as u16 * 100, &mut buf);
            if let Message::Frame { frame: f, .. } = m {
                assert_eq!(buf.len(), Message::frame_len(f));
            }
            assert_eq!(
                Message::decode(Bytes::from(buf)),
                Ok((m.clone(), i as u16 * 100))
            );
        }
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert_eq!(
            Message::decode(Bytes::from_static(&[MAGIC, 1])),
            Err(MessageError::TooShort(2))
        );
        assert_eq!(
            Message::decode(Bytes::from_static(&[0, 1, 0, 0, 0, 0, 0, 0])),
            Err(MessageError::BadMagic(0))
        );
        assert_eq!(
            Message::decode(Bytes::from_static(&[MAGIC, 9, 0, 0, 0, 0, 0, 0])),
            Err(MessageError::UnknownKind(9))
        );
        let mut rts = Vec::new();
        Message::Rts {
            tag: StreamTag::whole(0),
            transfer: 1,
            header: Header::Eager(envelope(100)),
            len: 100,
        }
        .encode(0, &mut rts);
        // Every truncation of a valid message is rejected.
        for cut in 0..rts.len() {
            assert!(
                Message::decode(Bytes::copy_from_slice(&rts[..cut])).is_err(),
                "cut at {cut}"
            );
        }
        // A length that disagrees with the frame header.
        rts[HEADER_LEN + StreamTag::LEN] ^= 1;
        let mut bad = rts.clone();
        // Part 0 of 0 parts.
        bad[HEADER_LEN + 10] = 0;
        assert_eq!(
            Message::decode(Bytes::from(bad)),
            Err(MessageError::BadTag { part: 0, parts: 0 })
        );
        assert!(matches!(
            Message::decode(Bytes::from(rts)),
            Err(MessageError::LengthMismatch { .. })
        ));
        let mut read = Vec::new();
        Message::ReadRts {
            tag: StreamTag::whole(0),
            transfer: 1,
            header: Header::Eager(envelope(100)),
            len: 100,
            addr: 1 << 40,
            rkey: 9,
        }
        .encode(0, &mut read);
        for cut in 0..read.len() {
            assert!(
                Message::decode(Bytes::copy_from_slice(&read[..cut])).is_err(),
                "cut at {cut}"
            );
        }
        read[HEADER_LEN + StreamTag::LEN] ^= 1;
        assert!(matches!(
            Message::decode(Bytes::from(read)),
            Err(MessageError::LengthMismatch { .. })
        ));
    }
}
