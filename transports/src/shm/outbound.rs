//! The sending side of one pair: what happens to a frame this rank sends to a local peer.
//!
//! A frame goes into the ring in the peer's segment in one of three ways, by its encoded size:
//!
//! 1. **Inline** (up to the inline limit): one `FRAME` record, header and payload copied into
//!    the ring once; the receiver copies them out.
//! 2. **Pipelined** (larger, up to the pipeline limit, or any size without single copy): the
//!    encoded frame in `CHUNK_FIRST`/`CHUNK` records of at most a ring record each; the
//!    receiver copies each piece out while this side writes the next, and reassembles them.
//! 3. **Single copy** (payloads beyond the pipeline limit, when the receiver said it can read
//!    this process's memory): a `SINGLE_COPY` record with the frame's header and the payload's
//!    address and length. The payload (a reference-counted `Bytes`) is *held* here until the
//!    receiver's `DONE` record says it has read it with `process_vm_readv`.
//!
//! When the ring is full, records wait in order in a queue here and go out as the receiver
//! frees space ([`Outbound::flush`], called on every drain and whenever the receiver signals).
//! `send` itself never blocks.

use std::collections::VecDeque;

use bytes::Bytes;
use rankweave_core::config::ShmConfig;
use rankweave_core::frame::{Envelope, Frame};
use rankweave_core::wire;
use rustc_hash::FxHashMap;

use super::record;
use super::ring::{Pushed, RingControl, RingProducer};
use super::segment::{SINGLE_COPY_YES, Segment};

/// A record that did not fit yet.
#[derive(Debug)]
enum Queued {
    /// A record built in full (inline frame, single-copy descriptor, `DONE`, `BYE`).
    Record { kind: u8, body: Vec<u8> },
    /// A frame going out in pieces: its encoded header, its payload, and how many bytes of
    /// the two (concatenated) have been sent.
    Pieces {
        header: Vec<u8>,
        payload: Bytes,
        sent: usize,
    },
}

/// Frames sent to the peer, for the transport's counters (plain integers: the transport holds
/// this side's lock whenever it sends).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct SendCounts {
    pub(crate) frames: u64,
    pub(crate) bytes: u64,
    pub(crate) single_copy: u64,
    pub(crate) pipelined: u64,
}

/// The producer side of the ring to one peer, with its queue and held payloads.
#[derive(Debug)]
pub(crate) struct Outbound {
    producer: RingProducer,
    queue: VecDeque<Queued>,
    /// Single-copy payloads the receiver has not read yet, by token.
    held: FxHashMap<u64, Bytes>,
    next_token: u64,
    inline_max: usize,
    /// Longer payloads go by single copy when the peer can read this rank's memory.
    pipeline_max: usize,
    /// Times a record found the ring full and had to wait.
    pub(crate) full_events: u64,
    /// What was sent.
    pub(crate) counts: SendCounts,
    /// Waiting for the receiver to free space (counted once per wait).
    blocked: bool,
}

impl Outbound {
    /// The sending side of the ring from `me` in `peer`'s segment.
    pub(crate) fn new(peer: &Segment, me: u32, settings: &ShmConfig) -> Option<Outbound> {
        let (control, _) = peer.ring(me)?;
        let geometry = peer.geometry();
        Some(Outbound {
            producer: RingProducer::new(control, geometry, peer.ring_key(me)),
            queue: VecDeque::new(),
            held: FxHashMap::default(),
            next_token: 0,
            inline_max: settings.inline_max.min(geometry.max_body()),
            pipeline_max: settings.pipeline_max,
            full_events: 0,
            counts: SendCounts::default(),
            blocked: false,
        })
    }

    /// The ring's producer, for tests that break the ring's rules.
    #[cfg(test)]
    pub(crate) fn producer_mut(&mut self) -> &mut RingProducer {
        &mut self.producer
    }

    /// Whether records wait for space.
    pub(crate) fn has_queued(&self) -> bool {
        !self.queue.is_empty()
    }

    /// Whether anything is still owed to the peer: queued records or unread payloads.
    pub(crate) fn is_idle(&self) -> bool {
        self.queue.is_empty() && self.held.is_empty()
    }

    /// The peer read the single-copy payload `token`.
    pub(crate) fn done(&mut self, token: u64) -> bool {
        self.held.remove(&token).is_some()
    }

    /// The peer is gone: nothing will be read or acknowledged any more.
    pub(crate) fn abandon(&mut self) {
        self.queue.clear();
        self.held.clear();
    }

    /// Sends `frame` to the peer whose segment is `peer`; `me` is this rank. Returns whether a
    /// record was published (the peer may need a signal).
    pub(crate) fn send(&mut self, peer: &Segment, me: u32, frame: Frame) -> bool {
        self.counts.frames += 1;
        self.counts.bytes += frame.payload.len() as u64;
        let mut header = [0u8; wire::MAX_HEADER_LEN];
        let hlen = wire::encoded_len(&frame.header);
        wire::encode_header(&frame.header, frame.payload.len(), &mut &mut header[..]);
        let header = &header[..hlen];
        let total = hlen + frame.payload.len();
        let queued = if total <= self.inline_max {
            // The common case, without an allocation: straight into the ring.
            if self.queue.is_empty() {
                if let Some((control, data)) = peer.ring(me) {
                    let parts = [header, &frame.payload[..]];
                    if self
                        .producer
                        .try_push(control, &data, record::FRAME, &parts)
                        == Pushed::Done
                    {
                        return true;
                    }
                }
            }
            Queued::Record {
                kind: record::FRAME,
                body: [header, &frame.payload].concat(),
            }
        } else if frame.payload.len() > self.pipeline_max
            && peer.pair_info(me).is_some_and(|p| {
                p.single_copy.load(std::sync::atomic::Ordering::Acquire) == SINGLE_COPY_YES
            })
        {
            self.counts.single_copy += 1;
            let token = self.next_token;
            self.next_token += 1;
            let prefix = record::single_copy_prefix(
                token,
                frame.payload.as_ptr() as u64,
                frame.payload.len() as u64,
            );
            self.held.insert(token, frame.payload);
            Queued::Record {
                kind: record::SINGLE_COPY,
                body: [&prefix[..], header].concat(),
            }
        } else {
            self.counts.pipelined += 1;
            Queued::Pieces {
                header: header.to_vec(),
                payload: frame.payload,
                sent: 0,
            }
        };
        self.queue.push_back(queued);
        self.flush(peer, me)
    }

    /// Writes an eager frame (the header for `envelope`, then the concatenation of `payload`,
    /// at most three pieces) straight into the ring, if nothing is queued ahead of it and it
    /// fits in one record now. Returns whether it was published; if not, nothing was done
    /// (the caller sends the frame the usual way, which queues it).
    pub(crate) fn send_eager(
        &mut self,
        peer: &Segment,
        me: u32,
        envelope: &Envelope,
        payload: &[&[u8]],
    ) -> bool {
        let len: usize = payload.iter().map(|p| p.len()).sum();
        if !self.queue.is_empty() || wire::EAGER_HEADER_LEN + len > self.inline_max {
            return false;
        }
        let header = wire::encode_eager_header(envelope, len);
        let parts: [&[u8]; 4] = match *payload {
            [] => [&header, &[], &[], &[]],
            [a] => [&header, a, &[], &[]],
            [a, b] => [&header, a, b, &[]],
            [a, b, c] => [&header, a, b, c],
            _ => return false,
        };
        let Some((control, data)) = peer.ring(me) else {
            return false;
        };
        if self
            .producer
            .try_push(control, &data, record::FRAME, &parts)
            != Pushed::Done
        {
            return false;
        }
        self.counts.frames += 1;
        self.counts.bytes += len as u64;
        true
    }

    /// Queues a control record (`DONE`, `BYE`) and tries to send it.
    pub(crate) fn send_control(&mut self, peer: &Segment, me: u32, kind: u8, body: &[u8]) -> bool {
        self.queue.push_back(Queued::Record {
            kind,
            body: body.to_vec(),
        });
        self.flush(peer, me)
    }

    /// Pushes queued records into the ring, in order, until it is full. Returns whether
    /// anything was published. When the ring fills, asks the receiver to signal when it frees
    /// space (and tries once more if it already has).
    pub(crate) fn flush(&mut self, peer: &Segment, me: u32) -> bool {
        let Some((control, data)) = peer.ring(me) else {
            return false;
        };
        let mut published = false;
        while let Some(front) = self.queue.front_mut() {
            let needed = match push_one(&mut self.producer, control, &data, front) {
                Step::Finished => {
                    self.queue.pop_front();
                    published = true;
                    continue;
                }
                Step::Progress => {
                    published = true;
                    continue;
                }
                Step::Full(needed) => needed,
            };
            if !self.producer.request_space(control, needed) {
                self.full_events += u64::from(!self.blocked);
                self.blocked = true;
                return published;
            }
        }
        self.blocked = false;
        published
    }

    /// Whether queued records could go out now: the receiver freed space since the ring was
    /// found full (one load), or nothing has been tried yet.
    pub(crate) fn can_flush(&mut self, peer: &Segment, me: u32) -> bool {
        if self.queue.is_empty() {
            return false;
        }
        if !self.blocked {
            return true;
        }
        peer.ring(me)
            .is_some_and(|(control, _)| self.producer.has_room_now(control, self.front_body()))
    }

    fn front_body(&self) -> usize {
        match self.queue.front() {
            Some(Queued::Record { body, .. }) => body.len(),
            // At least a small piece must fit for progress.
            Some(Queued::Pieces { .. }) => 64,
            None => 0,
        }
    }
}

enum Step {
    /// The queued item went out entirely.
    Finished,
    /// A piece went out; more remain.
    Progress,
    /// No room for a body of this many bytes.
    Full(usize),
}

fn push_one(
    producer: &mut RingProducer,
    control: &RingControl,
    data: &crate::sync::SharedBytes,
    item: &mut Queued,
) -> Step {
    match item {
        Queued::Record { kind, body } => match producer.try_push(control, data, *kind, &[body]) {
            Pushed::Done => Step::Finished,
            // Bodies are at most the inline limit or a descriptor, both below max_body; a
            // TooLarge here would be a bug, and dropping the record is the only way on.
            Pushed::TooLarge => Step::Finished,
            Pushed::Full => Step::Full(body.len()),
        },
        Queued::Pieces {
            header,
            payload,
            sent,
        } => {
            let total = header.len() + payload.len();
            let first = *sent == 0;
            let room = producer.max_body() - if first { 8 } else { 0 };
            let end = total.min(*sent + room);
            let (h, p) = slice_concat(header, payload, *sent, end);
            let total_le = (total as u64).to_le_bytes();
            let parts: [&[u8]; 3] = if first {
                [&total_le, h, p]
            } else {
                [&[], h, p]
            };
            let kind = if first {
                record::CHUNK_FIRST
            } else {
                record::CHUNK
            };
            match producer.try_push(control, data, kind, &parts) {
                Pushed::Done => {
                    *sent = end;
                    if end == total {
                        Step::Finished
                    } else {
                        Step::Progress
                    }
                }
                Pushed::TooLarge => Step::Finished,
                Pushed::Full => Step::Full(parts.iter().map(|p| p.len()).sum()),
            }
        }
    }
}

/// The bytes `[from, to)` of `header ++ payload`, as a slice of each.
fn slice_concat<'a>(
    header: &'a [u8],
    payload: &'a [u8],
    from: usize,
    to: usize,
) -> (&'a [u8], &'a [u8]) {
    let h = &header[from.min(header.len())..to.min(header.len())];
    let p = &payload[from.saturating_sub(header.len())..to.saturating_sub(header.len())];
    (h, p)
}

#[cfg(test)]
mod tests {
    use super::slice_concat;

    #[test]
    fn concatenated_slices_cover_exactly_the_range() {
        let (h, p) = slice_concat(b"abc", b"defgh", 0, 8);
        assert_eq!((h, p), (&b"abc"[..], &b"defgh"[..]));
        let (h, p) = slice_concat(b"abc", b"defgh", 2, 5);
        assert_eq!((h, p), (&b"c"[..], &b"de"[..]));
        let (h, p) = slice_concat(b"abc", b"defgh", 4, 6);
        assert_eq!((h, p), (&b""[..], &b"ef"[..]));
    }
}
