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
//! * **Credit**: nothing.
//! * **LaneDown**: `u32`, the sender's queue pair number of the lane that failed; the lane
//!   (another lane of the same connection) is named in the `transfer` field. The receiver acts
//!   on it only while its lane is connected to that queue pair.
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

    fn from_bytes(b: [u8; 12]) -> Result<StreamTag, MessageError> {
        let [s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, n0, n1] = b;
        let tag = StreamTag {
            seq: u64::from_le_bytes([s0, s1, s2, s3, s4, s5, s6, s7]),
            part: u16::from_le_bytes([p0, p1]),
            parts: u16::from_le_bytes([n0, n1]),
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
    /// Lane `lane` of this connection failed at the sender: the receiver stops using it too,
    /// if its lane is still connected to the sender's queue pair `qpn` (a report that comes
    /// after the lane was re-established on new queue pairs is stale and ignored).
    LaneDown {
        /// The lane.
        lane: u32,
        /// The sender's queue pair of that lane that failed.
        qpn: u32,
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

/// Appends what an Rts and a ReadRts carry after the message header: the stream tag, the
/// payload length, `fields` (the ReadRts's address and key), then the frame's header
/// declaring that length.
fn put_announcement(
    out: &mut Vec<u8>,
    tag: &StreamTag,
    len: u64,
    fields: &[&[u8]],
    header: &Header,
) {
    tag.encode(out);
    out.extend_from_slice(&len.to_le_bytes());
    for f in fields {
        out.extend_from_slice(f);
    }
    wire::encode_header(header, len as usize, out);
}

/// Reads a message body's fields in order; running out of bytes is
/// [`MessageError::TooShort`] with the whole message's length.
struct Fields<'a> {
    rest: &'a [u8],
    message_len: usize,
}

impl Fields<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], MessageError> {
        let (head, rest) = self
            .rest
            .split_first_chunk::<N>()
            .ok_or(MessageError::TooShort(self.message_len))?;
        self.rest = rest;
        Ok(*head)
    }

    fn u32(&mut self) -> Result<u32, MessageError> {
        self.take().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, MessageError> {
        self.take().map(u64::from_le_bytes)
    }

    fn tag(&mut self) -> Result<StreamTag, MessageError> {
        self.take().and_then(StreamTag::from_bytes)
    }

    /// The frame header that ends an Rts or ReadRts, which must declare `len` payload bytes.
    fn header_declaring(&mut self, len: u64) -> Result<Header, MessageError> {
        let (header, declared, _) = wire::decode_header(self.rest)?;
        if declared != len {
            return Err(MessageError::LengthMismatch {
                rts: len,
                header: declared,
            });
        }
        Ok(header)
    }
}

impl Message {
    /// The kind byte and the header's `transfer` field.
    fn kind_and_transfer(&self) -> (u8, u32) {
        match *self {
            Message::Frame { .. } => (kind::FRAME, 0),
            Message::Credit => (kind::CREDIT, 0),
            Message::Rts { transfer, .. } => (kind::RTS, transfer),
            Message::Cts { transfer, .. } => (kind::CTS, transfer),
            Message::Bye { .. } => (kind::BYE, 0),
            Message::LaneDown { lane, .. } => (kind::LANE_DOWN, lane),
            Message::ReadRts { transfer, .. } => (kind::READ_RTS, transfer),
            Message::Fin { transfer } => (kind::FIN, transfer),
        }
    }

    /// Appends this message, carrying `credits`, to `out`.
    pub fn encode(&self, credits: u16, out: &mut Vec<u8>) {
        let (kind, transfer) = self.kind_and_transfer();
        put_header(out, kind, credits, transfer);
        match self {
            Message::Frame { tag, frame } => {
                tag.encode(out);
                wire::encode_header(&frame.header, frame.payload.len(), out);
                out.extend_from_slice(&frame.payload);
            }
            Message::Credit | Message::Fin { .. } => {}
            Message::LaneDown { qpn, .. } => out.extend_from_slice(&qpn.to_le_bytes()),
            Message::Bye { end } => out.extend_from_slice(&end.to_le_bytes()),
            Message::Rts {
                tag, header, len, ..
            } => put_announcement(out, tag, *len, &[], header),
            Message::ReadRts {
                tag,
                header,
                len,
                addr,
                rkey,
                ..
            } => put_announcement(
                out,
                tag,
                *len,
                &[&addr.to_le_bytes(), &rkey.to_le_bytes()],
                header,
            ),
            Message::Cts { addr, rkey, .. } => {
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
        let Some((header, body)) = buf.split_first_chunk::<HEADER_LEN>() else {
            return Err(MessageError::TooShort(buf.len()));
        };
        let [magic, kind, c0, c1, t0, t1, t2, t3] = *header;
        if magic != MAGIC {
            return Err(MessageError::BadMagic(magic));
        }
        let credits = u16::from_le_bytes([c0, c1]);
        let transfer = u32::from_le_bytes([t0, t1, t2, t3]);
        let mut f = Fields {
            rest: body,
            message_len: buf.len(),
        };
        let message = match kind {
            kind::FRAME => Message::Frame {
                tag: f.tag()?,
                frame: wire::decode(bytes.slice(HEADER_LEN + StreamTag::LEN..))?,
            },
            kind::CREDIT => Message::Credit,
            kind::LANE_DOWN => Message::LaneDown {
                lane: transfer,
                qpn: f.u32()?,
            },
            kind::BYE => Message::Bye { end: f.u64()? },
            kind::RTS => {
                let tag = f.tag()?;
                let len = f.u64()?;
                Message::Rts {
                    tag,
                    transfer,
                    header: f.header_declaring(len)?,
                    len,
                }
            }
            kind::READ_RTS => {
                let tag = f.tag()?;
                let len = f.u64()?;
                let addr = f.u64()?;
                let rkey = f.u32()?;
                Message::ReadRts {
                    tag,
                    transfer,
                    header: f.header_declaring(len)?,
                    len,
                    addr,
                    rkey,
                }
            }
            kind::FIN => Message::Fin { transfer },
            kind::CTS => Message::Cts {
                transfer,
                addr: f.u64()?,
                rkey: f.u32()?,
            },
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
            Message::LaneDown {
                lane: 3,
                qpn: 0x00ab_cdef,
            },
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

    /// Every truncation of `m`'s encoding is rejected, and so is a length field (right after
    /// the stream tag) that disagrees with the frame header; returns the encoding.
    fn rejects_truncation_and_a_wrong_length(m: &Message) -> Vec<u8> {
        let mut bytes = Vec::new();
        m.encode(0, &mut bytes);
        for cut in 0..bytes.len() {
            assert!(
                Message::decode(Bytes::copy_from_slice(&bytes[..cut])).is_err(),
                "{m:?} cut at {cut}"
            );
        }
        bytes[HEADER_LEN + StreamTag::LEN] ^= 1;
        assert!(matches!(
            Message::decode(Bytes::from(bytes.clone())),
            Err(MessageError::LengthMismatch { .. })
        ));
        bytes
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
        // A LaneDown without its queue pair number.
        assert_eq!(
            Message::decode(Bytes::from_static(&[MAGIC, 6, 0, 0, 1, 0, 0, 0, 7])),
            Err(MessageError::TooShort(9))
        );
        let mut bad = rejects_truncation_and_a_wrong_length(&Message::Rts {
            tag: StreamTag::whole(0),
            transfer: 1,
            header: Header::Eager(envelope(100)),
            len: 100,
        });
        // Part 0 of 0 parts is caught before the length.
        bad[HEADER_LEN + 10] = 0;
        assert_eq!(
            Message::decode(Bytes::from(bad)),
            Err(MessageError::BadTag { part: 0, parts: 0 })
        );
        rejects_truncation_and_a_wrong_length(&Message::ReadRts {
            tag: StreamTag::whole(0),
            transfer: 1,
            header: Header::Eager(envelope(100)),
            len: 100,
            addr: 1 << 40,
            rkey: 9,
        });
    }
}
