//! The sending side of one pair: what happens to a frame this rank sends to a local peer.
//!
//! A frame goes into the ring in the peer's segment in one of three ways, by its encoded size:
//!
//! 1. **Inline** (up to the inline limit): one record, header and payload copied into the ring
//!    once; the receiver copies them out. An eager message goes as a `SHORT` record (its
//!    envelope in 16 bytes, see `record`), anything else as a `FRAME`.
//! 2. **Pipelined** (larger, or any size without single copy): the encoded frame in
//!    `CHUNK_FIRST`/`CHUNK` records of at most a ring record each; the receiver copies each
//!    piece out while this side writes the next, and reassembles them.
//! 3. **Single copy** (when the receiver said it can read this process's memory): a
//!    `SINGLE_COPY` record with the frame's header and the payload's address and length. The
//!    payload (a reference-counted `Bytes`) is *held* here until the receiver's count of
//!    payloads read (in the pair's information line) says it has read it with
//!    `process_vm_readv`.
//!
//! Payloads beyond the pipeline limit always go by single copy where it is permitted. Below it,
//! the [`PathChooser`] picks one of the two by how long each took lately (the faster one
//! depends on where the two processes run; see [`super::copy_path`]): a large send made while
//! nothing else is in flight to the peer is timed from here until the first look after the
//! receiver was done with it — its count of payloads read passing the send's token, or the
//! ring's tail passing the last piece.
//!
//! When the ring is full, records wait in order in a queue here and go out as the receiver
//! frees space ([`Outbound::flush`], called on every drain and whenever the receiver signals).
//! `send` itself never blocks.

use std::collections::VecDeque;
use std::time::Instant;

use bytes::Bytes;
use rankweave_core::config::ShmConfig;
use rankweave_core::frame::{Envelope, Frame, Header};
use rankweave_core::wire;
use std::sync::atomic::Ordering;

use super::cache_distance::CacheDistance;
use super::copy_path::{CopyPath, PathChooser};
use super::record;
use super::ring::{Pushed, RingControl, RingProducer};
use super::segment::{SINGLE_COPY_YES, Segment};
use super::split_copy;

/// A record that did not fit yet.
#[derive(Debug)]
enum Queued {
    /// A record built in full (inline frame, single-copy descriptor, `BYE`).
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

/// Unread bytes in the ring that still count as a receiver keeping up (see
/// [`Outbound::reads_in_place`]): a few short records, never a medium payload.
const IDLE_UNREAD_MAX: u64 = 512;

/// A large send being timed for the [`PathChooser`].
#[derive(Debug)]
struct Timed {
    path: CopyPath,
    len: usize,
    started: Instant,
    done_when: DoneWhen,
}

#[derive(Debug, PartialEq, Eq)]
enum DoneWhen {
    /// A single copy: when the receiver's count of payloads read passes this token.
    Read(u64),
    /// Pipelined, pieces still queued here.
    Pushed,
    /// Pipelined, every piece in the ring: when the consumer's tail reaches this position.
    Consumed(u64),
}

/// The producer side of the ring to one peer, with its queue and held payloads.
#[derive(Debug)]
pub(crate) struct Outbound {
    producer: RingProducer,
    queue: VecDeque<Queued>,
    /// Single-copy payloads the receiver has not read yet, in token order.
    held: VecDeque<(u64, Bytes)>,
    next_token: u64,
    inline_max: usize,
    /// Owned payloads from this long up to the inline limit go by single copy to a receiver
    /// that keeps up (see [`reads_in_place`](Self::reads_in_place)); 0: never.
    idle_single_copy: usize,
    /// Longer payloads go by single copy when the peer can read this rank's memory.
    pipeline_max: usize,
    /// Whether the receiver's cache is near, which decides the ring's hot window; `None`
    /// without a hot window.
    distance: Option<CacheDistance>,
    /// Picks the path of shorter large payloads; `None`: always pipelined.
    chooser: Option<PathChooser>,
    /// The large send being timed, if any.
    timed: Option<Timed>,
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
            producer: RingProducer::new(control, geometry, peer.ring_key(me))
                .with_hot_window(settings.hot_window),
            queue: VecDeque::new(),
            held: VecDeque::new(),
            next_token: 0,
            inline_max: settings.inline_max.min(geometry.max_body()),
            idle_single_copy: settings.idle_single_copy,
            pipeline_max: settings.pipeline_max,
            distance: (settings.hot_window != 0).then(CacheDistance::default),
            chooser: settings.adaptive.then(PathChooser::default),
            timed: None,
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

    /// How many records wait for space.
    pub(crate) fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Whether the ring was last found full.
    pub(crate) fn is_blocked(&self) -> bool {
        self.blocked
    }

    /// Whether anything is still owed to the peer: queued records or unread payloads.
    pub(crate) fn is_idle(&self) -> bool {
        self.queue.is_empty() && self.held.is_empty()
    }

    /// Whether single-copy payloads wait for the receiver to read them.
    pub(crate) fn holds_payloads(&self) -> bool {
        !self.held.is_empty()
    }

    /// Whether the transport must [`observe`](Self::observe) the receiver on each drain: a
    /// payload is held for it or a send is timed.
    pub(crate) fn is_watching(&self) -> bool {
        self.timed.is_some() || !self.held.is_empty()
    }

    /// The held payload whose token has split-copy tag `tag` (see `split_copy`), if any: the
    /// receiver offered it for the sender to write a share of.
    pub(crate) fn held_payload(&self, tag: u64) -> Option<Bytes> {
        self.held
            .iter()
            .find(|(token, _)| split_copy::tag_of(*token) == tag)
            .map(|(_, payload)| payload.clone())
    }

    /// Lets go of the payloads the receiver has read, and ends the timing of a send the
    /// receiver has finished taking.
    pub(crate) fn observe(&mut self, peer: &Segment, me: u32) {
        if !self.held.is_empty() {
            let read = peer
                .pair_info(me)
                .map_or(0, |p| p.tokens_read.load(Ordering::Acquire));
            while self.held.front().is_some_and(|&(token, _)| token < read) {
                self.held.pop_front();
            }
            if let Some(Timed {
                done_when: DoneWhen::Read(token),
                ..
            }) = self.timed
            {
                if token < read {
                    self.finish_timing();
                }
            }
        }
        if let Some(Timed {
            done_when: DoneWhen::Consumed(end),
            ..
        }) = self.timed
        {
            if peer
                .ring(me)
                .is_some_and(|(control, _)| self.producer.consumed_to(control, end))
            {
                self.finish_timing();
            }
        }
    }

    fn finish_timing(&mut self) {
        if let (Some(t), Some(chooser)) = (self.timed.take(), &mut self.chooser) {
            chooser.record(t.path, t.len, t.started.elapsed());
        }
    }

    /// The peer is gone: nothing will be read or acknowledged any more.
    pub(crate) fn abandon(&mut self) {
        self.queue.clear();
        self.held.clear();
        self.timed = None;
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
        let single_copy = if total <= self.inline_max {
            self.reads_in_place(peer, me, frame.payload.len())
        } else {
            self.large_path(peer, me, frame.payload.len()) == CopyPath::SingleCopy
        };
        let queued = if total <= self.inline_max && !single_copy {
            // Inline or not is decided by the wire header's length, whichever header the
            // record then carries: so a size goes the same way with either.
            let short = match &frame.header {
                Header::Eager(envelope) => record::short_header(envelope, frame.payload.len()),
                _ => None,
            };
            let (kind, header) = match &short {
                Some(short) => (record::SHORT, &short[..]),
                None => (record::FRAME, header),
            };
            // The common case, without an allocation: straight into the ring.
            if self.push_now(peer, me, kind, &[header, &frame.payload[..]]) {
                return true;
            }
            Queued::Record {
                kind,
                body: [header, &frame.payload].concat(),
            }
        } else if single_copy {
            self.counts.single_copy += 1;
            let token = self.next_token;
            self.next_token += 1;
            let prefix = record::single_copy_prefix(
                token,
                frame.payload.as_ptr() as u64,
                frame.payload.len() as u64,
            );
            // Only the chooser's sizes are timed (not a short payload sent in place).
            if total > self.inline_max {
                self.start_timing(
                    CopyPath::SingleCopy,
                    frame.payload.len(),
                    DoneWhen::Read(token),
                );
            }
            self.held.push_back((token, frame.payload));
            // As an inline frame: straight into the ring, without an allocation.
            if self.push_now(peer, me, record::SINGLE_COPY, &[&prefix[..], header]) {
                return true;
            }
            Queued::Record {
                kind: record::SINGLE_COPY,
                body: [&prefix[..], header].concat(),
            }
        } else {
            self.counts.pipelined += 1;
            self.start_timing(CopyPath::Pipelined, frame.payload.len(), DoneWhen::Pushed);
            Queued::Pieces {
                header: header.to_vec(),
                payload: frame.payload,
                sent: 0,
            }
        };
        self.queue.push_back(queued);
        self.flush(peer, me)
    }

    /// Pushes a record made of `parts` straight into the peer's ring if nothing is queued
    /// ahead of it and it fits now; whether it did.
    fn push_now(&mut self, peer: &Segment, me: u32, kind: u8, parts: &[&[u8]]) -> bool {
        if !self.queue.is_empty() {
            return false;
        }
        let Some((control, data)) = peer.ring(me) else {
            return false;
        };
        self.about_to_push(control);
        self.producer.try_push(control, &data, kind, parts) == Pushed::Done
    }

    /// Before a record goes straight into the ring: now and then, times a look at the
    /// consumer's `tail` and turns the hot window on or off by the verdict (see
    /// `cache_distance`). Before, not after: the push itself may load `tail`, and a look
    /// right behind it would find the line in this cache.
    #[inline]
    fn about_to_push(&mut self, control: &RingControl) {
        let Some(distance) = &mut self.distance else {
            return;
        };
        if distance.look_due() {
            let producer = &mut self.producer;
            distance.time(|| producer.look_at_tail(control));
            producer.set_early_wraps(distance.is_near());
        }
    }

    /// Whether an owned payload of `len` bytes, short enough to go inline, goes by single copy
    /// instead: it is long enough (`RANKWEAVE_SHM_IDLE_SINGLE_COPY`), the peer may read this
    /// rank's memory, and the receiver has read what was sent to it before (all but a few
    /// short records, such as the header a collective sends just ahead of its data) — it
    /// keeps up, so it is likely waiting for this one, and one copy by the kernel straight into its
    /// buffer beats two through the ring. A receiver that lags gets it inline, so that a burst
    /// of sends runs ahead of it as before. (Open MPI sends everything beyond its 4 KiB eager
    /// limit by single copy, so a stream of such messages waits on each read.)
    pub(crate) fn reads_in_place(&self, peer: &Segment, me: u32, len: usize) -> bool {
        self.idle_single_copy != 0
            && len >= self.idle_single_copy
            && self.is_idle()
            && single_copy_permitted(peer, me)
            && peer
                .ring(me)
                .is_some_and(|(control, _)| self.producer.unread(control) <= IDLE_UNREAD_MAX)
    }

    /// The path of a payload of `len` bytes, too long to go inline.
    fn large_path(&mut self, peer: &Segment, me: u32, len: usize) -> CopyPath {
        let permitted = single_copy_permitted(peer, me);
        let timed = self.will_time(len);
        match &mut self.chooser {
            _ if !permitted => CopyPath::Pipelined,
            _ if len > self.pipeline_max => CopyPath::SingleCopy,
            Some(chooser) => chooser.choose(len, timed),
            None => CopyPath::Pipelined,
        }
    }

    /// Whether a large send of `len` bytes made now is timed: the chooser decides its size and
    /// it is alone (nothing queued, held or timed: otherwise its time would include others').
    fn will_time(&self, len: usize) -> bool {
        self.chooser.is_some() && len <= self.pipeline_max && self.is_idle() && self.timed.is_none()
    }

    /// Times a large send by `path` if [`will_time`](Self::will_time) says so.
    fn start_timing(&mut self, path: CopyPath, len: usize, done_when: DoneWhen) {
        if self.will_time(len) {
            self.timed = Some(Timed {
                path,
                len,
                started: Instant::now(),
                done_when,
            });
        }
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
        let short = record::short_header(envelope, len);
        let wire_header;
        let (kind, header): (u8, &[u8]) = match &short {
            Some(short) => (record::SHORT, short),
            None => {
                wire_header = wire::encode_eager_header(envelope, len);
                (record::FRAME, &wire_header)
            }
        };
        let parts: [&[u8]; 4] = match *payload {
            [] => [header, &[], &[], &[]],
            [a] => [header, a, &[], &[]],
            [a, b] => [header, a, b, &[]],
            [a, b, c] => [header, a, b, c],
            _ => return false,
        };
        let Some((control, data)) = peer.ring(me) else {
            return false;
        };
        self.about_to_push(control);
        if self.producer.try_push(control, &data, kind, &parts) != Pushed::Done {
            return false;
        }
        self.counts.frames += 1;
        self.counts.bytes += len as u64;
        true
    }

    /// Queues a control record (`BYE`) and tries to send it.
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
                    // The timed pipelined send is the first to finish after it started (it
                    // started alone): now the receiver has to take its last piece.
                    if let Some(t) = &mut self.timed {
                        if t.done_when == DoneWhen::Pushed {
                            t.done_when = DoneWhen::Consumed(self.producer.position());
                        }
                    }
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

    /// The body of the next record the queue's front item would push: the next piece of a
    /// pipelined frame is as large as the ring takes (a smaller size here would have the
    /// progress engine flush, fail and look again while the ring has room for less).
    fn front_body(&self) -> usize {
        match self.queue.front() {
            Some(Queued::Record { body, .. }) => body.len(),
            Some(Queued::Pieces {
                header,
                payload,
                sent,
            }) => {
                let prefix = if *sent == 0 { 8 } else { 0 };
                (prefix + header.len() + payload.len() - sent).min(self.producer.max_body())
            }
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

/// Whether the receiver whose segment is `peer` may read `me`'s memory (it found out when the
/// pair connected).
fn single_copy_permitted(peer: &Segment, me: u32) -> bool {
    peer.pair_info(me)
        .is_some_and(|p| p.single_copy.load(Ordering::Acquire) == SINGLE_COPY_YES)
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
