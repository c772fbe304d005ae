//! [`PeerStream`]: the frames from one rank to one peer as one ordered stream over several
//! *lanes* (one RC queue pair per port), with striping of large frames across lanes and
//! failover without loss, duplication or reordering when a lane fails. Sans-IO.
//!
//! **Sender.** Every frame gets the next 64-bit sequence number. A frame of at least
//! [`StreamConfig::stripe_min`] payload bytes, while two or more lanes are up, is split into
//! one part per live lane (at most [`MAX_LANES`]); each part is a frame of its own (same
//! header, a slice of the payload, no copy) that its lane's channel sends by rendezvous. Other
//! frames go on the *primary* lane, the first one up, so eager traffic stays on one queue
//! pair. Every part stays in the **replay queue** until the lane that carried it reports it
//! delivered ([`PeerStream::on_delivered`]): for an eager frame, its send's successful
//! completion; for a rendezvous, the successful completion of its RDMA write with immediate
//! data, or for a read rendezvous the receiver's Fin (sent once its RDMA read completed). On
//! RC each means the peer holds the bytes (or its adapter has placed them and queued the
//! receive completion), so nothing acknowledged can be lost by a later port failure.
//! [`PeerStream::lane_failed`] takes a lane out and queues every part it had not delivered
//! again on the surviving lanes, ahead of newer frames.
//!
//! **Receiver.** Parts come in from every lane ([`PeerStream::on_part`]) in any order. A part
//! below the next sequence number to deliver, or one already held, is a duplicate (a replay of
//! something whose first copy arrived just before the lane failed) and is dropped and counted.
//! Frames leave ([`PeerStream::poll_frame`]) strictly in sequence order, a striped one once all
//! its parts are in (the parts are copied into one buffer).
//!
//! Why not explicit acknowledgements: RC already acknowledges every message in hardware and
//! reports it as a successful completion, so the replay queue is trimmed by what the driver
//! sees anyway, and the only cost of a port failure is re-sending what was in flight on it;
//! the receiver's duplicate suppression covers the window where a message arrived but its
//! acknowledgement was lost with the port.

use std::collections::{BTreeMap, VecDeque};

use bytes::{Bytes, BytesMut};
use rankweave_core::frame::Frame;

use super::message::StreamTag;

/// The most lanes (ports) a connection spans.
pub const MAX_LANES: usize = 4;

/// Settings of a [`PeerStream`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamConfig {
    /// Frames with at least this many payload bytes are striped across the live lanes.
    pub stripe_min: usize,
}

impl Default for StreamConfig {
    fn default() -> Self {
        StreamConfig {
            stripe_min: 1 << 20,
        }
    }
}

/// A peer sent parts that cannot belong to one stream.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StreamError {
    /// Two parts of one frame disagree on how many parts it has, or a frame has more parts
    /// than lanes exist.
    #[error("frame {seq}: part {part} of {parts} does not fit (expected {expected} parts)")]
    InconsistentParts {
        /// The frame's sequence number.
        seq: u64,
        /// The part.
        part: u16,
        /// Its number of parts.
        parts: u16,
        /// What the frame's other parts (or the lane limit) say.
        expected: u16,
    },
}

/// Counters of a [`PeerStream`] (lane-indexed arrays have [`MAX_LANES`] entries).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamCounters {
    /// Frames sent (striped or not).
    pub frames_sent: u64,
    /// Frames split across lanes.
    pub frames_striped: u64,
    /// Parts handed to each lane, replays included.
    pub parts_per_lane: [u64; MAX_LANES],
    /// Payload bytes handed to each lane, replays included.
    pub bytes_per_lane: [u64; MAX_LANES],
    /// Lanes that failed.
    pub lane_failures: u64,
    /// Lanes that came back after a failure ([`PeerStream::lane_restored`]).
    pub lane_restorations: u64,
    /// Parts queued again on another lane after their lane failed.
    pub replayed: u64,
    /// Parts received that were already received (dropped).
    pub duplicates: u64,
    /// Frames delivered in order.
    pub frames_delivered: u64,
}

#[derive(Debug)]
struct Unit {
    frame: Frame,
    lane: usize,
    /// Parts of its frame.
    parts: u16,
    /// Whether it sits in the outbox (waiting to be handed to its lane).
    queued: bool,
}

#[derive(Debug)]
struct Partial {
    parts: u16,
    got: Vec<Option<Frame>>,
    count: u16,
}

/// One direction-pair of one peer's connection (see the [module docs](self)).
#[derive(Debug)]
pub struct PeerStream {
    config: StreamConfig,
    up: Vec<bool>,
    next_seq: u64,
    unacked: BTreeMap<(u64, u16), Unit>,
    outbox: VecDeque<(u64, u16)>,
    next_deliver: u64,
    pending: BTreeMap<u64, Partial>,
    ready: VecDeque<Frame>,
    counters: StreamCounters,
}

impl PeerStream {
    /// A stream over `lanes` lanes (1 to [`MAX_LANES`]; clamped), all up.
    pub fn new(lanes: usize, config: StreamConfig) -> PeerStream {
        PeerStream {
            config,
            up: vec![true; lanes.clamp(1, MAX_LANES)],
            next_seq: 0,
            unacked: BTreeMap::new(),
            outbox: VecDeque::new(),
            next_deliver: 0,
            pending: BTreeMap::new(),
            ready: VecDeque::new(),
            counters: StreamCounters::default(),
        }
    }

    /// Number of lanes.
    pub fn lanes(&self) -> usize {
        self.up.len()
    }

    /// Whether lane `lane` is up.
    pub fn is_up(&self, lane: usize) -> bool {
        self.up.get(lane).copied().unwrap_or(false)
    }

    /// Whether any lane is up.
    pub fn any_up(&self) -> bool {
        self.up.iter().any(|&u| u)
    }

    fn live(&self) -> Vec<usize> {
        (0..self.up.len()).filter(|&l| self.up[l]).collect()
    }

    /// The sequence number the next frame will get (the end of the stream so far).
    pub fn end(&self) -> u64 {
        self.next_seq
    }

    /// Queues `frame`; returns its sequence number, or `None` (dropped) when no lane is up.
    pub fn send(&mut self, frame: Frame) -> Option<u64> {
        let live = self.live();
        let primary = *live.first()?;
        let seq = self.next_seq;
        self.next_seq += 1;
        self.counters.frames_sent += 1;
        let len = frame.payload.len();
        if live.len() < 2 || len < self.config.stripe_min || len < live.len() {
            self.queue(StreamTag::whole(seq), frame, primary);
            return Some(seq);
        }
        self.counters.frames_striped += 1;
        let parts = live.len();
        let chunk = len.div_ceil(parts);
        for (i, &lane) in live.iter().enumerate() {
            let start = (i * chunk).min(len);
            let end = ((i + 1) * chunk).min(len);
            let part = Frame {
                header: frame.header,
                payload: frame.payload.slice(start..end),
            };
            let tag = StreamTag {
                seq,
                part: i as u16,
                parts: parts as u16,
            };
            self.queue(tag, part, lane);
        }
        Some(seq)
    }

    fn queue(&mut self, tag: StreamTag, frame: Frame, lane: usize) {
        self.unacked.insert(
            (tag.seq, tag.part),
            Unit {
                frame,
                lane,
                parts: tag.parts,
                queued: true,
            },
        );
        self.outbox.push_back((tag.seq, tag.part));
    }

    /// The next part to hand to a lane's channel: `(lane, tag, frame)`.
    pub fn poll_transmit(&mut self) -> Option<(usize, StreamTag, Frame)> {
        while let Some((seq, part)) = self.outbox.pop_front() {
            let Some(u) = self.unacked.get_mut(&(seq, part)) else {
                continue;
            };
            u.queued = false;
            let lane = u.lane;
            self.counters.parts_per_lane[lane] += 1;
            self.counters.bytes_per_lane[lane] += u.frame.payload.len() as u64;
            let tag = StreamTag {
                seq,
                part,
                parts: u.parts,
            };
            return Some((lane, tag, u.frame.clone()));
        }
        None
    }

    /// The lane that carried `tag` reports it delivered: it leaves the replay queue.
    pub fn on_delivered(&mut self, tag: StreamTag) {
        self.unacked.remove(&(tag.seq, tag.part));
    }

    /// Lane `lane` failed: every part it had not delivered goes again on the lanes still up,
    /// ahead of newer frames. Returns whether any lane is left.
    pub fn lane_failed(&mut self, lane: usize) -> bool {
        if !self.is_up(lane) {
            return self.any_up();
        }
        self.up[lane] = false;
        self.counters.lane_failures += 1;
        let live = self.live();
        if live.is_empty() {
            self.outbox.clear();
            return false;
        }
        let mut again = Vec::new();
        for (&key, u) in self.unacked.iter_mut() {
            if u.lane != lane {
                continue;
            }
            // Whole frames go to the new primary lane; parts spread over the live lanes.
            u.lane = live[usize::from(key.1) % live.len()];
            if !u.queued {
                u.queued = true;
                again.push(key);
            }
        }
        self.counters.replayed += again.len() as u64;
        for key in again.into_iter().rev() {
            self.outbox.push_front(key);
        }
        true
    }

    /// Lane `lane` carries traffic again (a new queue pair replaced the failed one): later
    /// frames use it (it is the primary lane again if it is the first one up, and large frames
    /// are striped over it). Parts replayed elsewhere stay where they are. Returns whether the
    /// lane was down.
    pub fn lane_restored(&mut self, lane: usize) -> bool {
        match self.up.get_mut(lane) {
            Some(up) if !*up => {
                *up = true;
                self.counters.lane_restorations += 1;
                true
            }
            _ => false,
        }
    }

    /// Whether everything sent has been reported delivered.
    pub fn is_idle(&self) -> bool {
        self.unacked.is_empty()
    }

    /// Takes in a part received on some lane.
    pub fn on_part(&mut self, tag: StreamTag, frame: Frame) -> Result<(), StreamError> {
        let bad = |expected| StreamError::InconsistentParts {
            seq: tag.seq,
            part: tag.part,
            parts: tag.parts,
            expected,
        };
        if tag.parts == 0 || tag.part >= tag.parts || usize::from(tag.parts) > MAX_LANES {
            return Err(bad(MAX_LANES as u16));
        }
        if tag.seq < self.next_deliver {
            self.counters.duplicates += 1;
            return Ok(());
        }
        let p = self.pending.entry(tag.seq).or_insert_with(|| Partial {
            parts: tag.parts,
            got: (0..tag.parts).map(|_| None).collect(),
            count: 0,
        });
        if p.parts != tag.parts {
            return Err(bad(p.parts));
        }
        let slot = &mut p.got[usize::from(tag.part)];
        if slot.is_some() {
            self.counters.duplicates += 1;
            return Ok(());
        }
        *slot = Some(frame);
        p.count += 1;
        while self
            .pending
            .first_key_value()
            .is_some_and(|(&seq, p)| seq == self.next_deliver && p.count == p.parts)
        {
            let Some((_, p)) = self.pending.pop_first() else {
                break;
            };
            self.next_deliver += 1;
            self.counters.frames_delivered += 1;
            self.ready.push_back(assemble(p));
        }
        Ok(())
    }

    /// The next frame in the sender's order.
    pub fn poll_frame(&mut self) -> Option<Frame> {
        self.ready.pop_front()
    }

    /// Whether every frame below `end` has been delivered (or is ready to be taken).
    pub fn delivered_below(&self, end: u64) -> bool {
        self.next_deliver >= end
    }

    /// Its counters.
    pub fn counters(&self) -> StreamCounters {
        self.counters
    }
}

fn assemble(p: Partial) -> Frame {
    let mut parts = p.got.into_iter().flatten();
    let Some(first) = parts.next() else {
        return Frame::control(rankweave_core::frame::Header::Credit { bytes: 0 });
    };
    if p.parts == 1 {
        return first;
    }
    let rest: Vec<Frame> = parts.collect();
    let total = first.payload.len() + rest.iter().map(|f| f.payload.len()).sum::<usize>();
    let mut buf = BytesMut::with_capacity(total);
    buf.extend_from_slice(&first.payload);
    for f in &rest {
        buf.extend_from_slice(&f.payload);
    }
    Frame {
        header: first.header,
        payload: Bytes::from(buf),
    }
}

#[cfg(test)]
#[path = "stream_tests.rs"]
mod tests;
