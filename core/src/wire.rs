//! The byte encoding of [`Frame`]s, for transports that move bytes rather than Rust values
//! (UDP, cross-process shared memory), and the CRC32C checksum their integrity checks use.
//!
//! [`encode`] turns a frame into one contiguous buffer (header, then payload); [`decode`] turns
//! such a buffer back into the frame, taking the payload as a [`Bytes::slice`] of the input, so
//! decoding never copies payload bytes. A transport that wants to send the payload from its own
//! buffer (scatter-gather) writes only the header with [`encode_header`], whose length is
//! [`encoded_len`], and puts the payload right after it.
//!
//! # Layout (format version 1)
//!
//! All integers are little-endian and unaligned; there is no padding. A frame is a two-byte
//! prefix, the fields of its kind, the payload length, and the payload:
//!
//! | Offset     | Size          | Field           | Meaning                                                                     |
//! |------------|---------------|-----------------|-----------------------------------------------------------------------------|
//! | 0          | 1             | `magic_version` | High nibble: magic `0xA`; low nibble: format version, `1`. Always `0xA1`.   |
//! | 1          | 1             | `kind`          | `1` Eager, `2` Rts, `3` Cts, `4` Data, `5` Credit (`0`, `6..=255` reserved) |
//! | 2          | F             | fields          | The header's fields, by kind (table below); F is 28, 37, 16, 16 or 8.      |
//! | 2 + F      | 8             | `payload_len`   | `u64`: payload length in bytes; must equal the bytes that follow.           |
//! | 10 + F     | `payload_len` | payload         | The frame's payload (empty for control frames).                             |
//!
//! The fields of each kind, with offsets from the start of the frame:
//!
//! | Kind         | Offset | Size | Field         | Meaning                                                  |
//! |--------------|--------|------|---------------|----------------------------------------------------------|
//! | `1` Eager    | 2      | 8    | `context`     | `u64`: [`Envelope::context`], the communication context  |
//! |              | 10     | 4    | `tag`         | `u32`: [`Envelope::tag`]                                 |
//! |              | 14     | 8    | `seq`         | `u64`: [`Envelope::seq`], place in the sender's stream   |
//! |              | 22     | 8    | `len`         | `u64`: [`Envelope::len`], message length in bytes        |
//! |              | 30     | 8    | `payload_len` | header ends at 38                                        |
//! | `2` Rts      | 2      | 28   | envelope      | `context`, `tag`, `seq`, `len` as for Eager (2, 10, 14, 22) |
//! |              | 30     | 8    | `send_id`     | `u64`: the sender's handle for the message               |
//! |              | 38     | 1    | `attached`    | `0` = data waits at the sender, `1` = payload is the data |
//! |              | 39     | 8    | `payload_len` | header ends at 47                                        |
//! | `3` Cts      | 2      | 8    | `send_id`     | `u64`: the sender's handle from the RTS                  |
//! |              | 10     | 8    | `recv_id`     | `u64`: the receiver's handle                             |
//! |              | 18     | 8    | `payload_len` | header ends at 26                                        |
//! | `4` Data     | 2      | 8    | `recv_id`     | `u64`: the receiver's handle from the CTS                |
//! |              | 10     | 8    | `offset`      | `u64`: byte offset of this fragment within the message   |
//! |              | 18     | 8    | `payload_len` | header ends at 26                                        |
//! | `5` Credit   | 2      | 8    | `bytes`       | `u64`: eager credit given back, in bytes                 |
//! |              | 10     | 8    | `payload_len` | header ends at 18                                        |
//!
//! The longest header is an Rts's, [`MAX_HEADER_LEN`] = 47 bytes. The encoding is canonical: a
//! buffer that [`decode`] accepts is exactly what [`encode`] produces for the decoded frame.
//!
//! # What decoding checks
//!
//! [`decode`] checks, in this order, and reports the first failure as a [`DecodeError`]: at least
//! the two prefix bytes ([`TooShort`](DecodeError::TooShort)), the magic
//! ([`BadMagic`](DecodeError::BadMagic)), the version
//! ([`UnsupportedVersion`](DecodeError::UnsupportedVersion)), the kind
//! ([`UnknownKind`](DecodeError::UnknownKind)), the whole header present
//! ([`TooShort`](DecodeError::TooShort)), the `attached` flag being `0` or `1`
//! ([`BadFlag`](DecodeError::BadFlag)), an envelope `len` that fits `usize`
//! ([`ImpossibleLength`](DecodeError::ImpossibleLength)), `payload_len` not beyond the buffer
//! ([`ImpossibleLength`](DecodeError::ImpossibleLength)) and not short of it either: trailing
//! bytes are a [`LengthMismatch`](DecodeError::LengthMismatch). It never panics, whatever the
//! input.
//!
//! It does not check the protocol's rules across fields (an Eager envelope's `len` equal to the
//! payload length, an attached Rts carrying the whole message, sequence numbers): the protocol
//! [`Endpoint`](crate::protocol::Endpoint) checks those for every transport, and reports a
//! breach as a protocol error.
//!
//! # Checksums
//!
//! Frames carry no checksum of their own: a byte transport's reliability layer computes
//! [`checksum_parts`]`(&[header, payload])` (CRC32C, hardware-accelerated where the CPU has
//! SSE4.2 or the ARMv8 CRC instructions) over what it sends and checks it on arrival, before
//! [`decode`].

use bytes::{BufMut, Bytes, BytesMut};

use crate::frame::{Envelope, Frame, Header};
use crate::types::ContextId;

/// The magic, in the high nibble of byte 0.
pub const MAGIC: u8 = 0xA0;
/// The format version this module writes and reads, in the low nibble of byte 0.
pub const VERSION: u8 = 1;
/// Byte 0 of every frame this module writes: [`MAGIC`] | [`VERSION`].
pub const MAGIC_VERSION: u8 = MAGIC | VERSION;
/// The longest encoded header (an Rts frame's): what a transport reserves in front of the
/// payload.
pub const MAX_HEADER_LEN: usize = PREFIX_LEN + RTS_FIELDS + LEN_FIELD;

const MAGIC_MASK: u8 = 0xF0;
const VERSION_MASK: u8 = 0x0F;

const PREFIX_LEN: usize = 2;
const LEN_FIELD: usize = 8;
const ENVELOPE_FIELDS: usize = 8 + 4 + 8 + 8;
const RTS_FIELDS: usize = ENVELOPE_FIELDS + 8 + 1;

/// Kind bytes (byte 1).
mod kind {
    pub(super) const EAGER: u8 = 1;
    pub(super) const RTS: u8 = 2;
    pub(super) const CTS: u8 = 3;
    pub(super) const DATA: u8 = 4;
    pub(super) const CREDIT: u8 = 5;
}

/// Why a buffer is not a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The buffer ends before the header does.
    #[error("frame too short: need at least {need} bytes, have {have}")]
    TooShort {
        /// Bytes needed to read on (the prefix, or the whole header of the frame's kind).
        need: usize,
        /// Bytes in the buffer.
        have: usize,
    },
    /// Byte 0 does not carry the wire-format magic (high nibble `0xA`): not a rankweave frame.
    #[error("bad magic byte {0:#04x}: not a rankweave frame")]
    BadMagic(u8),
    /// The frame is of a format version this build cannot read.
    #[error("unsupported wire format version {0} (this build reads version {VERSION})")]
    UnsupportedVersion(u8),
    /// Byte 1 names no known kind of frame.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// The declared payload length is shorter than the bytes after the header (trailing bytes).
    #[error("payload length {declared} declared, but {actual} bytes follow the header")]
    LengthMismatch {
        /// The frame's `payload_len` field.
        declared: u64,
        /// Bytes after the header.
        actual: u64,
    },
    /// A length no buffer here can hold: a payload length beyond the end of the buffer, or an
    /// envelope length that does not fit `usize`.
    #[error("impossible length {0}")]
    ImpossibleLength(u64),
    /// The Rts `attached` flag is neither `0` nor `1`.
    #[error("bad flag byte {0:#04x}: expected 0 or 1")]
    BadFlag(u8),
}

/// Bytes of a kind's fields (between the prefix and the payload length), or `None` for an
/// unknown kind.
fn fields_len(kind: u8) -> Option<usize> {
    match kind {
        kind::EAGER => Some(ENVELOPE_FIELDS),
        kind::RTS => Some(RTS_FIELDS),
        kind::CTS | kind::DATA => Some(16),
        kind::CREDIT => Some(8),
        _ => None,
    }
}

fn kind_of(header: &Header) -> u8 {
    match header {
        Header::Eager(_) => kind::EAGER,
        Header::Rts { .. } => kind::RTS,
        Header::Cts { .. } => kind::CTS,
        Header::Data { .. } => kind::DATA,
        Header::Credit { .. } => kind::CREDIT,
    }
}

/// Encoded length of `header`: the prefix, its fields and the payload length field, i.e. the
/// offset at which the payload starts. A whole frame is `encoded_len(&frame.header) +
/// frame.payload.len()` bytes; never more than [`MAX_HEADER_LEN`] plus the payload.
pub fn encoded_len(header: &Header) -> usize {
    let fields = match header {
        Header::Eager(_) => ENVELOPE_FIELDS,
        Header::Rts { .. } => RTS_FIELDS,
        Header::Cts { .. } | Header::Data { .. } => 16,
        Header::Credit { .. } => 8,
    };
    PREFIX_LEN + fields + LEN_FIELD
}

fn put_envelope(env: &Envelope, out: &mut impl BufMut) {
    out.put_u64_le(env.context.0);
    out.put_u32_le(env.tag);
    out.put_u64_le(env.seq);
    out.put_u64_le(env.len);
}

/// Writes `header` and the payload length (exactly [`encoded_len`]`(header)` bytes) to `out`;
/// the caller sends `payload_len` bytes of payload right after it.
///
/// # Panics
///
/// Like every [`BufMut`] write, if `out` has less room than [`encoded_len`]`(header)` bytes and
/// cannot grow (a `BytesMut` or `Vec<u8>` grows; a `&mut [u8]` does not).
pub fn encode_header(header: &Header, payload_len: usize, out: &mut impl BufMut) {
    if let Header::Eager(env) = header {
        // The commonest header, built in place and written at once (one bounds check).
        out.put_slice(&encode_eager_header(env, payload_len));
        return;
    }
    out.put_u8(MAGIC_VERSION);
    out.put_u8(kind_of(header));
    match header {
        Header::Eager(env) => put_envelope(env, out),
        Header::Rts {
            envelope,
            send_id,
            attached,
        } => {
            put_envelope(envelope, out);
            out.put_u64_le(*send_id);
            out.put_u8(u8::from(*attached));
        }
        Header::Cts { send_id, recv_id } => {
            out.put_u64_le(*send_id);
            out.put_u64_le(*recv_id);
        }
        Header::Data { recv_id, offset } => {
            out.put_u64_le(*recv_id);
            out.put_u64_le(*offset);
        }
        Header::Credit { bytes } => out.put_u64_le(*bytes),
    }
    // usize is at most 64 bits on every target Rust supports today; saturate rather than panic
    // should that ever change (such a payload could not be sent anyway).
    out.put_u64_le(u64::try_from(payload_len).unwrap_or(u64::MAX));
}

/// The header of an Eager frame for `envelope` with a payload of `payload_len` bytes: what
/// [`encode_header`] writes for it, as an array (a transport writing the frame in place puts it
/// in front of the payload's pieces).
#[inline]
pub fn encode_eager_header(envelope: &Envelope, payload_len: usize) -> [u8; EAGER_HEADER_LEN] {
    let mut h = [0u8; EAGER_HEADER_LEN];
    h[0] = MAGIC_VERSION;
    h[1] = kind::EAGER;
    h[2..10].copy_from_slice(&envelope.context.0.to_le_bytes());
    h[10..14].copy_from_slice(&envelope.tag.to_le_bytes());
    h[14..22].copy_from_slice(&envelope.seq.to_le_bytes());
    h[22..30].copy_from_slice(&envelope.len.to_le_bytes());
    // usize is at most 64 bits on every target Rust supports today; saturate as below.
    h[30..38].copy_from_slice(&u64::try_from(payload_len).unwrap_or(u64::MAX).to_le_bytes());
    h
}

/// Encodes a frame's header (for a payload of the frame's length) into an array: sent gathered
/// with the payload, it makes the same bytes as [`encode`] without copying the payload, and
/// without an allocation. Returns the array and how many of its bytes the header took.
pub fn encode_head(frame: &Frame) -> ([u8; MAX_HEADER_LEN], usize) {
    let mut head = [0u8; MAX_HEADER_LEN];
    let mut rest = &mut head[..];
    encode_header(&frame.header, frame.payload.len(), &mut rest);
    let len = MAX_HEADER_LEN - rest.len();
    (head, len)
}

/// Encodes a whole frame, header then payload, into one buffer (one copy of the payload).
pub fn encode(frame: &Frame) -> Bytes {
    let mut out = BytesMut::with_capacity(encoded_len(&frame.header) + frame.payload.len());
    encode_header(&frame.header, frame.payload.len(), &mut out);
    out.put_slice(&frame.payload);
    out.freeze()
}

/// Reads fixed-width little-endian fields off the front of a buffer, with bounds checks that
/// report [`DecodeError::TooShort`] instead of panicking.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    #[inline]
    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        // The error is built only on failure: this runs for every field of every frame.
        match self.buf.get(self.pos..).and_then(|r| r.first_chunk::<N>()) {
            Some(bytes) => {
                self.pos += N;
                Ok(*bytes)
            }
            None => Err(DecodeError::TooShort {
                need: self.pos.saturating_add(N),
                have: self.buf.len(),
            }),
        }
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        self.array::<1>().map(|[b]| b)
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, DecodeError> {
        self.array().map(u64::from_le_bytes)
    }

    fn envelope(&mut self) -> Result<Envelope, DecodeError> {
        let context = ContextId(self.u64()?);
        let tag = self.u32()?;
        let seq = self.u64()?;
        let len = self.u64()?;
        if usize::try_from(len).is_err() {
            return Err(DecodeError::ImpossibleLength(len));
        }
        Ok(Envelope {
            context,
            tag,
            seq,
            len,
        })
    }
}

/// Decodes the header at the front of `buf`, for a transport whose payloads travel apart
/// from their headers: returns the header, the payload length it declares and the header's
/// encoded length (where the payload would start). Makes every check [`decode`] makes except
/// those on the payload's presence. Never panics.
pub fn decode_header(buf: &[u8]) -> Result<(Header, u64, usize), DecodeError> {
    if let Some(r) = decode_eager_header(buf) {
        return r;
    }
    let have = buf.len();
    let mut r = Reader { buf, pos: 0 };
    let [magic_version, kind] = r.array::<PREFIX_LEN>()?;
    if magic_version & MAGIC_MASK != MAGIC {
        return Err(DecodeError::BadMagic(magic_version));
    }
    if magic_version & VERSION_MASK != VERSION {
        return Err(DecodeError::UnsupportedVersion(
            magic_version & VERSION_MASK,
        ));
    }
    let header_len = match fields_len(kind) {
        Some(fields) => PREFIX_LEN + fields + LEN_FIELD,
        None => return Err(DecodeError::UnknownKind(kind)),
    };
    if have < header_len {
        return Err(DecodeError::TooShort {
            need: header_len,
            have,
        });
    }
    let header = match kind {
        kind::EAGER => Header::Eager(r.envelope()?),
        kind::RTS => {
            let envelope = r.envelope()?;
            let send_id = r.u64()?;
            let attached = match r.u8()? {
                0 => false,
                1 => true,
                flag => return Err(DecodeError::BadFlag(flag)),
            };
            Header::Rts {
                envelope,
                send_id,
                attached,
            }
        }
        kind::CTS => Header::Cts {
            send_id: r.u64()?,
            recv_id: r.u64()?,
        },
        kind::DATA => Header::Data {
            recv_id: r.u64()?,
            offset: r.u64()?,
        },
        kind::CREDIT => Header::Credit { bytes: r.u64()? },
        other => return Err(DecodeError::UnknownKind(other)),
    };
    let declared = r.u64()?;
    if usize::try_from(declared).is_err() {
        return Err(DecodeError::ImpossibleLength(declared));
    }
    Ok((header, declared, r.pos))
}

/// Bytes of an Eager frame's header.
pub const EAGER_HEADER_LEN: usize = PREFIX_LEN + ENVELOPE_FIELDS + LEN_FIELD;

/// [`decode_header`] for the commonest frame, a well-formed Eager header of this version:
/// fixed offsets in one bounds-checked array instead of a checked read per field. `None`
/// for anything else (the general path then decides, errors included).
#[inline]
fn decode_eager_header(buf: &[u8]) -> Option<Result<(Header, u64, usize), DecodeError>> {
    let h = buf.first_chunk::<EAGER_HEADER_LEN>()?;
    if h[0] != MAGIC_VERSION || h[1] != kind::EAGER {
        return None;
    }
    let u64_at = |at: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&h[at..at + 8]);
        u64::from_le_bytes(b)
    };
    let mut tag = [0u8; 4];
    tag.copy_from_slice(&h[10..14]);
    let (context, seq, len, declared) = (u64_at(2), u64_at(14), u64_at(22), u64_at(30));
    if usize::try_from(len).is_err() || usize::try_from(declared).is_err() {
        return None;
    }
    let envelope = Envelope {
        context: ContextId(context),
        tag: u32::from_le_bytes(tag),
        seq,
        len,
    };
    Some(Ok((Header::Eager(envelope), declared, EAGER_HEADER_LEN)))
}

/// The envelope and payload of `frame`, an encoded frame, if it is a well-formed Eager frame of
/// this version whose payload is exactly the bytes after its header; `None` for anything else.
/// The short path of a transport that looks at eager frames where they lie (see
/// [`Transport::take_eager`](crate::transport::Transport::take_eager)); the same checks as
/// [`decode`].
#[inline]
pub fn decode_eager(frame: &[u8]) -> Option<(Envelope, &[u8])> {
    let (header, payload) = frame.split_first_chunk::<EAGER_HEADER_LEN>()?;
    match decode_eager_header(header)? {
        Ok((Header::Eager(envelope), declared, _)) if declared == payload.len() as u64 => {
            Some((envelope, payload))
        }
        _ => None,
    }
}

/// Decodes one frame that fills `bytes` exactly. The payload is a slice of `bytes` (no copy).
///
/// See the [module docs](self) for the layout and the order of the checks. Never panics.
pub fn decode(bytes: Bytes) -> Result<Frame, DecodeError> {
    let (header, declared, start) = decode_header(&bytes)?;
    let have = bytes.len();
    let actual = have
        .checked_sub(start)
        .ok_or(DecodeError::TooShort { need: start, have })?;
    match usize::try_from(declared) {
        Ok(len) if len == actual => {}
        Ok(len) if len < actual => {
            return Err(DecodeError::LengthMismatch {
                declared,
                actual: actual as u64,
            });
        }
        _ => return Err(DecodeError::ImpossibleLength(declared)),
    }
    let payload = bytes.slice(start..);
    Ok(Frame { header, payload })
}

/// CRC32C (Castagnoli) of `data`, hardware-accelerated where the CPU allows.
pub fn checksum(data: &[u8]) -> u32 {
    checksum_parts(&[data])
}

/// CRC32C of the concatenation of `parts`, without concatenating them: `checksum_parts(&[a, b])
/// == checksum(&[a, b].concat())`. For a header and a payload held in separate buffers.
///
/// Two implementations, by total length: the CRC32 instruction (`crc32c`) for short inputs,
/// where its start-up is cheapest, and carry-less multiplication folding (`crc-fast`) from
/// 512 bytes (`FOLD_FROM`), which on this project's machines checksums a 64 KiB packet about
/// twice as fast (57 against 26 GB/s) — per packet on both sides of every large transfer.
pub fn checksum_parts(parts: &[&[u8]]) -> u32 {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    if len <= GATHER_UP_TO && parts.len() > 1 {
        // A small packet's header and payload come in several short parts: each CRC call has
        // a start-up cost larger than copying them into one run.
        let mut joined = [0u8; GATHER_UP_TO];
        let mut at = 0;
        for part in parts {
            joined[at..at + part.len()].copy_from_slice(part);
            at += part.len();
        }
        return crc32c::crc32c(&joined[..at]);
    }
    if len < FOLD_FROM {
        return parts
            .iter()
            .fold(0, |crc, part| crc32c::crc32c_append(crc, part));
    }
    let mut digest = crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi);
    for part in parts {
        digest.update(part);
    }
    // CRC-32/ISCSI is CRC32C; the 64-bit result holds the 32-bit checksum.
    digest.finalize() as u32
}

/// Inputs from this many bytes are checksummed by folding (see [`checksum_parts`]).
const FOLD_FROM: usize = 512;

/// Inputs in several parts up to this many bytes are copied together and checksummed in one
/// call (see [`checksum_parts`]).
const GATHER_UP_TO: usize = 256;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn env(context: u64, tag: u32, seq: u64, len: u64) -> Envelope {
        Envelope {
            context: ContextId(context),
            tag,
            seq,
            len,
        }
    }

    fn frame(header: Header, payload: impl Into<Bytes>) -> Frame {
        Frame {
            header,
            payload: payload.into(),
        }
    }

    /// Encodes, checks the length and the bytes against `encode_header`, decodes, checks the
    /// result and that the payload was sliced out of the encoded buffer rather than copied.
    fn round_trip(f: &Frame) {
        let encoded = encode(f);
        let hlen = encoded_len(&f.header);
        assert!(hlen <= MAX_HEADER_LEN);
        assert_eq!(encoded.len(), hlen + f.payload.len());
        let mut header_only = Vec::new();
        encode_header(&f.header, f.payload.len(), &mut header_only);
        assert_eq!(header_only.len(), hlen);
        assert_eq!(&encoded[..hlen], &header_only[..]);
        assert_eq!(&encoded[hlen..], &f.payload[..]);

        let decoded = decode(encoded.clone()).expect("a valid encoding decodes");
        assert_eq!(&decoded, f);
        if !f.payload.is_empty() {
            assert_eq!(
                decoded.payload.as_ptr(),
                encoded[hlen..].as_ptr(),
                "the payload is a slice of the input, not a copy"
            );
        }
    }

    fn all_variants(e: Envelope, n: u64, attached: bool) -> [Header; 5] {
        [
            Header::Eager(e),
            Header::Rts {
                envelope: e,
                send_id: n,
                attached,
            },
            Header::Cts {
                send_id: n,
                recv_id: n ^ 0x5555,
            },
            Header::Data {
                recv_id: n,
                offset: n.rotate_left(7),
            },
            Header::Credit { bytes: n },
        ]
    }

    #[test]
    fn eager_fast_paths_keep_the_documented_layout() {
        // Byte 0 magic|version, byte 1 kind, then context u64, tag u32, seq u64, len u64 and
        // the payload length u64, all little-endian: what the general field-by-field path reads.
        let e = env(0x0102_0304_0506_0708, 0x1122_3344, 0x99, 5);
        let mut expected = vec![MAGIC_VERSION, kind::EAGER];
        expected.extend_from_slice(&e.context.0.to_le_bytes());
        expected.extend_from_slice(&e.tag.to_le_bytes());
        expected.extend_from_slice(&e.seq.to_le_bytes());
        expected.extend_from_slice(&e.len.to_le_bytes());
        expected.extend_from_slice(&5u64.to_le_bytes());
        let mut out = Vec::new();
        encode_header(&Header::Eager(e), 5, &mut out);
        assert_eq!(out, expected);
        assert_eq!(out.len(), encoded_len(&Header::Eager(e)));
        assert_eq!(
            decode_header(&out),
            Ok((Header::Eager(e), 5, EAGER_HEADER_LEN))
        );
        // A header the fast path declines (another version) still gets the general path's error.
        let mut other = out.clone();
        other[0] = MAGIC | 2;
        assert_eq!(
            decode_header(&other),
            Err(DecodeError::UnsupportedVersion(2))
        );
    }

    #[test]
    fn every_variant_round_trips_with_empty_small_and_large_payloads() {
        let large: Bytes = (0..(1 << 20) + 3).map(|i: u32| (i * 31) as u8).collect();
        for payload in [Bytes::new(), Bytes::from_static(b"x"), large] {
            for attached in [false, true] {
                for h in all_variants(env(2, 7, 3, payload.len() as u64), 42, attached) {
                    round_trip(&frame(h, payload.clone()));
                }
            }
        }
    }

    #[test]
    fn max_and_min_field_values_round_trip() {
        let max_len = usize::MAX as u64; // u64::MAX on 64-bit targets
        for attached in [false, true] {
            for h in all_variants(
                env(u64::MAX, u32::MAX, u64::MAX, max_len),
                u64::MAX,
                attached,
            ) {
                round_trip(&frame(h, Bytes::from_static(b"\xff\x00")));
            }
            for h in all_variants(env(0, 0, 0, 0), 0, attached) {
                round_trip(&Frame::control(h));
            }
        }
    }

    /// Pins the layout documented in the module docs, byte for byte.
    #[test]
    fn golden_bytes_match_the_documented_layout() {
        let rts = frame(
            Header::Rts {
                envelope: env(0x0807_0605_0403_0201, 0x0D0C_0B0A, 0x11, 3),
                send_id: 0x22,
                attached: true,
            },
            &b"abc"[..],
        );
        let mut expected = vec![0xA1, 2];
        expected.extend_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]); // context @2
        expected.extend_from_slice(&[0x0A, 0x0B, 0x0C, 0x0D]); // tag @10
        expected.extend_from_slice(&[0x11, 0, 0, 0, 0, 0, 0, 0]); // seq @14
        expected.extend_from_slice(&[3, 0, 0, 0, 0, 0, 0, 0]); // len @22
        expected.extend_from_slice(&[0x22, 0, 0, 0, 0, 0, 0, 0]); // send_id @30
        expected.push(1); // attached @38
        expected.extend_from_slice(&[3, 0, 0, 0, 0, 0, 0, 0]); // payload_len @39
        expected.extend_from_slice(b"abc"); // payload @47
        assert_eq!(&encode(&rts)[..], &expected[..]);

        let credit = Frame::control(Header::Credit { bytes: 0x0102 });
        assert_eq!(
            &encode(&credit)[..],
            &[0xA1, 5, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
        );
        let cts = Frame::control(Header::Cts {
            send_id: 1,
            recv_id: 2,
        });
        let data = frame(
            Header::Data {
                recv_id: 1,
                offset: 2,
            },
            &b"z"[..],
        );
        let eager = frame(Header::Eager(env(1, 2, 3, 1)), &b"z"[..]);
        assert_eq!(&encode(&cts)[..2], &[0xA1, 3]);
        assert_eq!(&encode(&data)[..2], &[0xA1, 4]);
        assert_eq!(&encode(&eager)[..2], &[0xA1, 1]);
        // Header lengths as documented: 38, 47, 26, 26, 18.
        let lens = all_variants(env(0, 0, 0, 0), 0, false).map(|h| encoded_len(&h));
        assert_eq!(lens, [38, 47, 26, 26, 18]);
        assert_eq!(MAX_HEADER_LEN, 47);
    }

    #[test]
    fn encode_header_writes_payload_lengths_beyond_u32() {
        let big = 5usize << 30;
        let mut out = Vec::new();
        encode_header(&Header::Credit { bytes: 1 }, big, &mut out);
        assert_eq!(&out[10..18], &(big as u64).to_le_bytes());
        // Without those 5 GiB behind it the header alone does not decode.
        assert_eq!(
            decode(Bytes::from(out)),
            Err(DecodeError::ImpossibleLength(big as u64))
        );
    }

    fn valid_credit() -> Vec<u8> {
        encode(&Frame::control(Header::Credit { bytes: 9 })).to_vec()
    }

    #[test]
    fn too_short_for_the_prefix() {
        assert_eq!(
            decode(Bytes::new()),
            Err(DecodeError::TooShort { need: 2, have: 0 })
        );
        assert_eq!(
            decode(Bytes::from_static(&[0xA1])),
            Err(DecodeError::TooShort { need: 2, have: 1 })
        );
    }

    #[test]
    fn too_short_for_the_header_of_each_kind() {
        for h in all_variants(env(1, 2, 3, 4), 5, true) {
            let encoded = encode(&frame(h, &b"pay"[..]));
            let hlen = encoded_len(&h);
            for cut in 2..hlen {
                assert_eq!(
                    decode(encoded.slice(..cut)),
                    Err(DecodeError::TooShort {
                        need: hlen,
                        have: cut
                    }),
                    "{h:?} cut at {cut}"
                );
            }
            // Cut inside the payload: the declared length runs past the end.
            assert_eq!(
                decode(encoded.slice(..hlen + 1)),
                Err(DecodeError::ImpossibleLength(3))
            );
        }
    }

    #[test]
    fn bad_magic() {
        let mut b = valid_credit();
        b[0] = 0x51;
        assert_eq!(decode(Bytes::from(b)), Err(DecodeError::BadMagic(0x51)));
        assert_eq!(
            decode(Bytes::from_static(&[0x00, 0x00])),
            Err(DecodeError::BadMagic(0))
        );
    }

    #[test]
    fn unsupported_version() {
        let mut b = valid_credit();
        b[0] = 0xA2;
        assert_eq!(
            decode(Bytes::from(b)),
            Err(DecodeError::UnsupportedVersion(2))
        );
        assert_eq!(
            decode(Bytes::from_static(&[0xA0, 5])),
            Err(DecodeError::UnsupportedVersion(0))
        );
    }

    #[test]
    fn unknown_kind() {
        for k in [0u8, 6, 0x7F, 0xFF] {
            let mut b = valid_credit();
            b[1] = k;
            assert_eq!(decode(Bytes::from(b)), Err(DecodeError::UnknownKind(k)));
        }
    }

    #[test]
    fn length_mismatch_on_trailing_bytes() {
        let mut b = encode(&frame(Header::Credit { bytes: 1 }, &b"ab"[..])).to_vec();
        b.push(0);
        assert_eq!(
            decode(Bytes::from(b)),
            Err(DecodeError::LengthMismatch {
                declared: 2,
                actual: 3
            })
        );
    }

    #[test]
    fn impossible_payload_length() {
        let mut b = valid_credit();
        b[10..18].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(
            decode(Bytes::from(b)),
            Err(DecodeError::ImpossibleLength(u64::MAX))
        );
        let mut b = valid_credit();
        b[10] = 1; // one byte declared, none present
        assert_eq!(
            decode(Bytes::from(b)),
            Err(DecodeError::ImpossibleLength(1))
        );
    }

    #[cfg(target_pointer_width = "32")]
    #[test]
    fn impossible_envelope_length() {
        let e = env(0, 0, 0, u64::from(u32::MAX) + 1);
        let b = encode(&Frame::control(Header::Eager(e)));
        assert_eq!(
            decode(b),
            Err(DecodeError::ImpossibleLength(u64::from(u32::MAX) + 1))
        );
    }

    #[test]
    fn bad_attached_flag() {
        let rts = Header::Rts {
            envelope: env(1, 2, 3, 0),
            send_id: 4,
            attached: false,
        };
        for flag in [2u8, 0x80, 0xFF] {
            let mut b = encode(&Frame::control(rts)).to_vec();
            b[38] = flag;
            assert_eq!(decode(Bytes::from(b)), Err(DecodeError::BadFlag(flag)));
        }
    }

    #[test]
    fn errors_display_their_context() {
        let cases = [
            (
                DecodeError::TooShort { need: 18, have: 3 },
                "need at least 18 bytes, have 3",
            ),
            (DecodeError::BadMagic(0x51), "0x51"),
            (DecodeError::UnsupportedVersion(2), "version 2"),
            (DecodeError::UnknownKind(9), "kind 9"),
            (
                DecodeError::LengthMismatch {
                    declared: 2,
                    actual: 3,
                },
                "2 declared, but 3 bytes",
            ),
            (DecodeError::ImpossibleLength(7), "impossible length 7"),
            (DecodeError::BadFlag(2), "0x02"),
        ];
        for (err, needle) in cases {
            let text = err.to_string();
            assert!(text.contains(needle), "{text:?} lacks {needle:?}");
        }
    }

    #[test]
    fn crc32c_known_answer() {
        assert_eq!(checksum(b"123456789"), 0xE306_9283);
        assert_eq!(checksum(b""), 0);
        assert_eq!(checksum_parts(&[]), 0);
        assert_eq!(checksum_parts(&[b"1234", b"", b"56789"]), 0xE306_9283);
        // Both implementations, either side of the threshold, against the bitwise reference.
        let data: Vec<u8> = (0..70_000u32).map(|i| (i * 131 % 251) as u8).collect();
        for len in [FOLD_FROM - 1, FOLD_FROM, FOLD_FROM + 1, 65_536, 70_000] {
            let want = crc32c_reference(&data[..len]);
            assert_eq!(checksum(&data[..len]), want, "{len} bytes");
            let (head, body) = data[..len].split_at(56);
            assert_eq!(
                checksum_parts(&[head, body]),
                want,
                "{len} bytes in two parts"
            );
        }
    }

    /// Bitwise CRC32C, to check the accelerated one against.
    fn crc32c_reference(data: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &b in data {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = if crc & 1 == 1 {
                    (crc >> 1) ^ 0x82F6_3B78
                } else {
                    crc >> 1
                };
            }
        }
        !crc
    }

    fn arb_envelope() -> impl Strategy<Value = Envelope> {
        (
            any::<u64>(),
            any::<u32>(),
            any::<u64>(),
            0..=usize::MAX as u64,
        )
            .prop_map(|(c, t, s, l)| env(c, t, s, l))
    }

    fn arb_header() -> impl Strategy<Value = Header> {
        prop_oneof![
            arb_envelope().prop_map(Header::Eager),
            (arb_envelope(), any::<u64>(), any::<bool>()).prop_map(
                |(envelope, send_id, attached)| {
                    Header::Rts {
                        envelope,
                        send_id,
                        attached,
                    }
                }
            ),
            (any::<u64>(), any::<u64>())
                .prop_map(|(send_id, recv_id)| Header::Cts { send_id, recv_id }),
            (any::<u64>(), any::<u64>())
                .prop_map(|(recv_id, offset)| Header::Data { recv_id, offset }),
            any::<u64>().prop_map(|bytes| Header::Credit { bytes }),
        ]
    }

    fn arb_frame() -> impl Strategy<Value = Frame> {
        (arb_header(), proptest::collection::vec(any::<u8>(), 0..600))
            .prop_map(|(header, payload)| frame(header, payload))
    }

    /// Whatever `decode` accepts, `encode` gives back byte for byte (the encoding is canonical).
    fn decode_never_panics_and_is_canonical(input: Vec<u8>) -> Result<(), TestCaseError> {
        let input = Bytes::from(input);
        if let Ok(f) = decode(input.clone()) {
            prop_assert_eq!(&encode(&f), &input);
        }
        Ok(())
    }

    proptest! {
        #[test]
        fn prop_round_trip(f in arb_frame()) {
            round_trip(&f);
        }

        #[test]
        fn prop_decode_arbitrary_bytes(input in proptest::collection::vec(any::<u8>(), 0..128)) {
            decode_never_panics_and_is_canonical(input)?;
        }

        /// Noise behind a valid prefix, so decoding gets past the magic and kind checks.
        #[test]
        fn prop_decode_noise_after_a_valid_prefix(
            kind in 0u8..7,
            tail in proptest::collection::vec(any::<u8>(), 0..80),
        ) {
            let mut input = vec![MAGIC_VERSION, kind];
            input.extend(tail);
            decode_never_panics_and_is_canonical(input)?;
        }

        /// Valid frames, truncated or with one byte changed.
        #[test]
        fn prop_decode_damaged_frames(
            f in arb_frame(),
            cut in any::<prop::sample::Index>(),
            at in any::<prop::sample::Index>(),
            xor in 1u8..,
        ) {
            let encoded = encode(&f).to_vec();
            let truncated = encoded[..cut.index(encoded.len() + 1)].to_vec();
            decode_never_panics_and_is_canonical(truncated)?;
            let mut flipped = encoded;
            let i = at.index(flipped.len());
            flipped[i] ^= xor;
            decode_never_panics_and_is_canonical(flipped)?;
        }

        #[test]
        fn prop_checksum_parts_equals_whole(
            data in proptest::collection::vec(any::<u8>(), 0..4096),
            a in any::<prop::sample::Index>(),
            b in any::<prop::sample::Index>(),
        ) {
            let (mut i, mut j) = (a.index(data.len() + 1), b.index(data.len() + 1));
            if i > j {
                std::mem::swap(&mut i, &mut j);
            }
            let whole = checksum(&data);
            prop_assert_eq!(whole, crc32c_reference(&data));
            prop_assert_eq!(checksum_parts(&[&data]), whole);
            prop_assert_eq!(checksum_parts(&[&data[..i], &data[i..j], &data[j..]]), whole);
        }
    }
}
