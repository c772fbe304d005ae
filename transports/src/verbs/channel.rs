//! One RC connection's protocol, as a sans-IO state machine: eager messages under credits
//! and rendezvous by RDMA write with immediate data.
//!
//! The driver feeds it what the completion queue reports ([`RcChannel::on_message`],
//! [`RcChannel::on_write_done`]) and frames to send ([`RcChannel::send`]); it drains what the
//! channel wants done: [`RcChannel::poll_transmit`] (a message for a send buffer, or an RDMA
//! write), [`RcChannel::poll_allocation`] (register a buffer for an incoming transfer, then
//! [`RcChannel::buffer_ready`]) and [`RcChannel::poll_frame`] (frames that are complete). It
//! never touches the provider.
//!
//! A frame whose message does not fit a receive buffer goes by rendezvous. Below
//! [`ChannelConfig::read_min`] payload bytes it is *sender-driven* (RDMA write): an Rts goes in
//! its place, the receiver answers with a Cts naming a registered buffer, and the sender writes
//! the payload there with immediate data (the transfer id). From `read_min` on it is
//! *receiver-driven* (RDMA read): the driver registers the payload ([`RcChannel::poll_source`],
//! [`RcChannel::source_ready`]), a ReadRts naming it (address, length, remote key) goes in the
//! frame's place, the receiver registers a buffer, reads the payload into it
//! ([`Transmit::Read`], [`RcChannel::on_read_done`]) and answers with a Fin, on which the
//! sender releases the payload ([`RcChannel::poll_read_finished`]).
//!
//! One channel is one *lane* of a peer's connection (one queue pair on one port). Every frame
//! carries its [`StreamTag`]; the channel hands frames out as soon as they are complete (a
//! rendezvous frame may come out after eager frames sent behind it) and the peer's
//! [`PeerStream`](super::stream::PeerStream) puts the frames of all lanes back in order. It
//! also tells the driver which transmission completes which frame (`delivers`), because the
//! stream keeps every frame until the lane that carried it reports it delivered.

use std::collections::VecDeque;

use bytes::Bytes;
use rankweave_core::frame::{Frame, Header};
use rustc_hash::{FxHashMap, FxHashSet};

use super::credits::Credits;
use super::message::{HEADER_LEN, Message, MessageError, StreamTag};
use super::provider::{MemoryRegion, MrId, RemoteSlice};

/// Settings of a channel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChannelConfig {
    /// Receive buffers each side posts for the other (the credit window).
    pub window: u32,
    /// Bytes of one receive buffer: messages up to this size go eagerly.
    pub buffer_len: usize,
    /// The largest payload a peer may announce for a rendezvous transfer.
    pub max_transfer: u64,
    /// Rendezvous frames with at least this many payload bytes go by RDMA read instead of
    /// RDMA write (`usize::MAX`: never).
    pub read_min: usize,
}

/// Something the channel wants sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transmit {
    /// A message for a send buffer (already carrying the credits returned).
    Message {
        /// The encoded message.
        bytes: Vec<u8>,
        /// The frame that is delivered once this send completes successfully (an eager
        /// frame); `None` for control messages and Rts.
        delivers: Option<StreamTag>,
    },
    /// An RDMA write of `payload` to `remote` with immediate data `transfer`; once it completes
    /// successfully, the frame `tag` is delivered.
    Write {
        /// The frame the payload belongs to.
        tag: StreamTag,
        /// The transfer id (the immediate data).
        transfer: u32,
        /// The bytes to write.
        payload: Bytes,
        /// Where.
        remote: RemoteSlice,
    },
    /// An RDMA read of `len` bytes from the peer's `remote` into the registered region
    /// `region` (from its start); once it completes successfully, the driver calls
    /// [`RcChannel::on_read_done`]. Needs neither a credit nor a send buffer.
    Read {
        /// The transfer id.
        transfer: u32,
        /// The local buffer registered for the transfer.
        region: MrId,
        /// Bytes to read.
        len: u64,
        /// Where to read from.
        remote: RemoteSlice,
    },
}

/// A peer broke the protocol.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChannelError {
    /// A message that does not decode.
    #[error("malformed message: {0}")]
    Malformed(#[from] MessageError),
    /// A Cts, write, read or Fin for a transfer that is not waiting for one.
    #[error("unknown rendezvous transfer {0}")]
    UnknownTransfer(u32),
    /// An Rts announcing more than the receiver accepts.
    #[error("rendezvous of {len} bytes exceeds the limit of {max}")]
    TransferTooLarge {
        /// Announced length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A write longer than the announced payload.
    #[error("transfer {transfer}: {got} bytes written, {expected} announced")]
    WrongLength {
        /// The transfer.
        transfer: u32,
        /// Bytes written.
        got: usize,
        /// Bytes announced.
        expected: u64,
    },
    /// The peer sent more messages than it had credits for.
    #[error("the peer sent more messages than it had credits for")]
    CreditOverrun,
}

#[derive(Debug)]
struct Incoming {
    tag: StreamTag,
    header: Header,
    len: u64,
    /// The registered buffer, once the driver made it.
    region: Option<MrId>,
    /// Read rendezvous: the sender's payload.
    source: Option<RemoteSlice>,
}

/// Outgoing work that waits for credits.
#[derive(Debug)]
enum Pending {
    Cts {
        transfer: u32,
        addr: u64,
        rkey: u32,
    },
    LaneDown {
        lane: u32,
        qpn: u32,
    },
    Fin(u32),
    Write {
        tag: StreamTag,
        transfer: u32,
        payload: Bytes,
        remote: RemoteSlice,
    },
}

/// Counters of one channel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChannelCounters {
    /// Frames sent eagerly.
    pub eager_sent: u64,
    /// Frames sent by rendezvous (either kind).
    pub rendezvous_sent: u64,
    /// Of those, frames sent by RDMA-read rendezvous (the receiver read them).
    pub read_rendezvous_sent: u64,
    /// Payload bytes this side read by RDMA (read rendezvous as the receiver).
    pub rdma_bytes_read: u64,
    /// Payload bytes written by RDMA.
    pub rdma_bytes_sent: u64,
    /// Credit-only messages sent.
    pub credit_updates_sent: u64,
    /// Times a message waited because no credit was left.
    pub credit_stalls: u64,
    /// Frames delivered.
    pub frames_delivered: u64,
}

/// The state machine of one RC connection (see the [module docs](self)).
#[derive(Debug)]
pub struct RcChannel {
    config: ChannelConfig,
    credits: Credits,
    /// Frames to send, in order.
    frames: VecDeque<(StreamTag, Frame)>,
    /// Responses (Cts, writes) to send before frames.
    control: VecDeque<Pending>,
    /// Rendezvous sends waiting for their Cts, by transfer id.
    awaiting_cts: FxHashMap<u32, (StreamTag, Bytes)>,
    /// Read rendezvous payloads the driver must register: `(transfer, payload)`.
    sources: VecDeque<(u32, Bytes)>,
    /// Read rendezvous sends whose payload is not registered yet: their tag and header.
    awaiting_source: FxHashMap<u32, (StreamTag, Header, u64)>,
    /// ReadRts messages ready to go (sent under the same credit rules as frames).
    announce: VecDeque<Message>,
    /// Read rendezvous sends announced, waiting for the Fin: their tag and registered payload.
    awaiting_fin: FxHashMap<u32, (StreamTag, MrId)>,
    /// Read rendezvous sends the peer finished: their tag and payload region, for the driver.
    read_finished: VecDeque<(StreamTag, MrId)>,
    /// RDMA reads to post (receiver side of a read rendezvous).
    reads: VecDeque<Transmit>,
    /// Read rendezvous sends given up when the lane failed: a Fin for them that was already
    /// on its way is ignored.
    abandoned: FxHashSet<u32>,
    next_transfer: u32,
    /// Transfers to this side, by id.
    incoming: FxHashMap<u32, Incoming>,
    /// Lanes the peer reported failed, not taken yet.
    lanes_down: VecDeque<(u32, u32)>,
    /// Transfers whose buffer the driver must register.
    allocations: VecDeque<(u32, u64)>,
    /// Complete frames, in the order they completed.
    delivery: VecDeque<(StreamTag, Frame)>,
    /// Messages received from the peer (each consumed one of our receive buffers).
    received_total: u64,
    /// Credits returned to the peer in messages sent so far.
    returned_total: u64,
    /// The end of this side's stream, once it closes.
    bye_queued: Option<u64>,
    bye_sent: bool,
    /// The end of the peer's stream, once it said BYE.
    peer_closed: Option<u64>,
    stalled: bool,
    counters: ChannelCounters,
}

impl RcChannel {
    /// A channel whose peer has posted `config.window` buffers for it.
    pub fn new(config: ChannelConfig) -> RcChannel {
        RcChannel {
            config,
            credits: Credits::new(config.window),
            frames: VecDeque::new(),
            control: VecDeque::new(),
            awaiting_cts: FxHashMap::default(),
            sources: VecDeque::new(),
            awaiting_source: FxHashMap::default(),
            announce: VecDeque::new(),
            awaiting_fin: FxHashMap::default(),
            read_finished: VecDeque::new(),
            reads: VecDeque::new(),
            abandoned: FxHashSet::default(),
            next_transfer: 0,
            incoming: FxHashMap::default(),
            allocations: VecDeque::new(),
            lanes_down: VecDeque::new(),
            delivery: VecDeque::new(),
            received_total: 0,
            returned_total: 0,
            bye_queued: None,
            bye_sent: false,
            peer_closed: None,
            stalled: false,
            counters: ChannelCounters::default(),
        }
    }

    /// Queues `frame`, whose place in the stream is `tag`, for the peer. A frame for a read
    /// rendezvous first waits for the driver to register its payload
    /// ([`poll_source`](Self::poll_source)).
    pub fn send(&mut self, tag: StreamTag, frame: Frame) {
        if Message::frame_len(&frame) > self.config.buffer_len
            && frame.payload.len() >= self.config.read_min
        {
            let transfer = self.next_transfer;
            self.next_transfer = self.next_transfer.wrapping_add(1);
            let len = frame.payload.len() as u64;
            self.awaiting_source
                .insert(transfer, (tag, frame.header, len));
            self.sources.push_back((transfer, frame.payload));
            return;
        }
        self.frames.push_back((tag, frame));
    }

    /// The next read rendezvous payload the driver must register for the peer to read:
    /// `(transfer, payload)`; then [`source_ready`](Self::source_ready).
    pub fn poll_source(&mut self) -> Option<(u32, Bytes)> {
        self.sources.pop_front()
    }

    /// The driver registered `region` (readable by the peer) for the payload of `transfer`:
    /// the ReadRts goes out. The region stays in use until the peer's Fin
    /// ([`poll_read_finished`](Self::poll_read_finished)).
    pub fn source_ready(&mut self, transfer: u32, region: &MemoryRegion) {
        let Some((tag, header, len)) = self.awaiting_source.remove(&transfer) else {
            return;
        };
        self.awaiting_fin.insert(transfer, (tag, region.id));
        self.counters.rendezvous_sent += 1;
        self.counters.read_rendezvous_sent += 1;
        self.announce.push_back(Message::ReadRts {
            tag,
            transfer,
            header,
            len,
            addr: region.addr,
            rkey: region.rkey,
        });
    }

    /// The next read rendezvous send the peer finished (its Fin came): the frame is delivered,
    /// and the driver releases the payload's region.
    pub fn poll_read_finished(&mut self) -> Option<(StreamTag, MrId)> {
        self.read_finished.pop_front()
    }

    /// Takes every payload region of read rendezvous sends still waiting for a Fin (and drops
    /// the sends not announced yet): for the driver to release when this lane has failed
    /// (the stream sends those frames again on another lane).
    pub fn take_read_sources(&mut self) -> Vec<MrId> {
        self.sources.clear();
        self.awaiting_source.clear();
        self.announce.clear();
        let mut regions = Vec::with_capacity(self.awaiting_fin.len());
        for (transfer, (_, mr)) in self.awaiting_fin.drain() {
            self.abandoned.insert(transfer);
            regions.push(mr);
        }
        regions
    }

    /// The RDMA read of read rendezvous `transfer` failed (the lane fails with it): forgets
    /// the transfer and returns its buffer, for the driver to deregister.
    pub fn abandon_read(&mut self, transfer: u32) -> Option<MrId> {
        match self.incoming.get(&transfer) {
            Some(t) if t.source.is_some() => self.incoming.remove(&transfer)?.region,
            _ => None,
        }
    }

    /// Queues the BYE that tells the peer this side is closing and that its stream ends
    /// before `end` (sent after every frame queued before it).
    pub fn close(&mut self, end: u64) {
        self.bye_queued.get_or_insert(end);
    }

    /// The next thing to send, if credits allow; `send_buffer_free` says whether a send
    /// buffer is available for a [`Transmit::Message`] (writes need none).
    pub fn poll_transmit(&mut self, send_buffer_free: bool) -> Option<Transmit> {
        if let Some(read) = self.reads.pop_front() {
            return Some(read);
        }
        if !self.control.is_empty() || !self.frames.is_empty() || !self.announce.is_empty() {
            if !self.credits.can_send_data() {
                if !self.stalled {
                    self.stalled = true;
                    self.counters.credit_stalls += 1;
                }
                return self.credit_update(send_buffer_free);
            }
            self.stalled = false;
        }
        let next_is_write = matches!(self.control.front(), Some(Pending::Write { .. }));
        if next_is_write {
            if let Some(Pending::Write {
                tag,
                transfer,
                payload,
                remote,
            }) = self.control.pop_front()
            {
                // Write with immediate data carries no credit field: what is owed waits.
                self.credits.spend_without_return();
                self.counters.rdma_bytes_sent += payload.len() as u64;
                return Some(Transmit::Write {
                    tag,
                    transfer,
                    payload,
                    remote,
                });
            }
        }
        if !send_buffer_free {
            return None;
        }
        if let Some(&Pending::LaneDown { lane, qpn }) = self.control.front() {
            self.control.pop_front();
            return Some(self.encode(&Message::LaneDown { lane, qpn }, None));
        }
        if let Some(Pending::Cts {
            transfer,
            addr,
            rkey,
        }) = self.control.front()
        {
            let m = Message::Cts {
                transfer: *transfer,
                addr: *addr,
                rkey: *rkey,
            };
            self.control.pop_front();
            return Some(self.encode(&m, None));
        }
        if let Some(&Pending::Fin(transfer)) = self.control.front() {
            self.control.pop_front();
            return Some(self.encode(&Message::Fin { transfer }, None));
        }
        if let Some(m) = self.announce.pop_front() {
            return Some(self.encode(&m, None));
        }
        if let Some((tag, frame)) = self.frames.pop_front() {
            if Message::frame_len(&frame) <= self.config.buffer_len {
                self.counters.eager_sent += 1;
                return Some(self.encode(&Message::Frame { tag, frame }, Some(tag)));
            }
            let transfer = self.next_transfer;
            self.next_transfer = self.next_transfer.wrapping_add(1);
            let m = Message::Rts {
                tag,
                transfer,
                header: frame.header,
                len: frame.payload.len() as u64,
            };
            self.awaiting_cts.insert(transfer, (tag, frame.payload));
            self.counters.rendezvous_sent += 1;
            return Some(self.encode(&m, None));
        }
        if let Some(end) = self.bye_queued
            && !self.bye_sent
            && self.sources.is_empty()
            && self.credits.can_send_control()
        {
            self.bye_sent = true;
            return Some(self.encode(&Message::Bye { end }, None));
        }
        self.credit_update(send_buffer_free)
    }

    fn credit_update(&mut self, send_buffer_free: bool) -> Option<Transmit> {
        (send_buffer_free && self.credits.update_due() && self.credits.can_send_control()).then(
            || {
                self.counters.credit_updates_sent += 1;
                self.encode(&Message::Credit, None)
            },
        )
    }

    fn encode(&mut self, m: &Message, delivers: Option<StreamTag>) -> Transmit {
        let give = self.credits.spend();
        self.returned_total += u64::from(give);
        let mut out = Vec::with_capacity(HEADER_LEN + 64);
        m.encode(give, &mut out);
        Transmit::Message {
            bytes: out,
            delivers,
        }
    }

    /// Takes in a message from a receive buffer; its buffer was reposted.
    pub fn on_message(&mut self, bytes: Bytes) -> Result<(), ChannelError> {
        self.count_received()?;
        let (message, credits) = Message::decode(bytes)?;
        self.credits.returned(credits);
        match message {
            Message::Frame { tag, frame } => self.delivery.push_back((tag, frame)),
            Message::Credit => {}
            Message::LaneDown { lane, qpn } => self.lanes_down.push_back((lane, qpn)),
            Message::Bye { end } => {
                self.peer_closed.get_or_insert(end);
            }
            Message::Rts {
                tag,
                transfer,
                header,
                len,
            } => self.announce(transfer, tag, header, len, None)?,
            Message::ReadRts {
                tag,
                transfer,
                header,
                len,
                addr,
                rkey,
            } => self.announce(transfer, tag, header, len, Some(RemoteSlice { addr, rkey }))?,
            Message::Fin { transfer } => match self.awaiting_fin.remove(&transfer) {
                Some(done) => self.read_finished.push_back(done),
                None if self.abandoned.remove(&transfer) => {}
                None => return Err(ChannelError::UnknownTransfer(transfer)),
            },
            Message::Cts {
                transfer,
                addr,
                rkey,
            } => {
                let (tag, payload) = self
                    .awaiting_cts
                    .remove(&transfer)
                    .ok_or(ChannelError::UnknownTransfer(transfer))?;
                self.control.push_back(Pending::Write {
                    tag,
                    transfer,
                    payload,
                    remote: RemoteSlice { addr, rkey },
                });
            }
        }
        Ok(())
    }

    /// A receive buffer was consumed and reposted: one more credit is owed.
    /// A rendezvous announced (`Rts`, or `ReadRts` with the sender's payload as `source`): ask
    /// the driver for a buffer of `len` bytes.
    fn announce(
        &mut self,
        transfer: u32,
        tag: StreamTag,
        header: Header,
        len: u64,
        source: Option<RemoteSlice>,
    ) -> Result<(), ChannelError> {
        if len > self.config.max_transfer {
            return Err(ChannelError::TransferTooLarge {
                len,
                max: self.config.max_transfer,
            });
        }
        self.incoming.insert(
            transfer,
            Incoming {
                tag,
                header,
                len,
                region: None,
                source,
            },
        );
        self.allocations.push_back((transfer, len));
        Ok(())
    }

    fn count_received(&mut self) -> Result<(), ChannelError> {
        self.received_total += 1;
        // The peer may send the window plus what was returned to it, never more.
        if self.received_total > u64::from(self.config.window) + self.returned_total {
            return Err(ChannelError::CreditOverrun);
        }
        self.credits.reposted();
        Ok(())
    }

    /// Tells the peer that lane `lane` of this connection (another queue pair), whose queue
    /// pair here was `qpn`, failed here, ahead of frames not sent yet.
    pub fn report_lane_down(&mut self, lane: u32, qpn: u32) {
        self.control.push_front(Pending::LaneDown { lane, qpn });
    }

    /// The next lane the peer reported failed: `(lane, the peer's queue pair number of it)`.
    pub fn poll_lane_down(&mut self) -> Option<(u32, u32)> {
        self.lanes_down.pop_front()
    }

    /// The next transfer whose receive buffer the driver must register: `(transfer, len)`.
    pub fn poll_allocation(&mut self) -> Option<(u32, u64)> {
        self.allocations.pop_front()
    }

    /// The driver registered `region` for `transfer`: the Cts goes out (write rendezvous), or
    /// the RDMA read is to be posted (read rendezvous).
    pub fn buffer_ready(&mut self, transfer: u32, region: &MemoryRegion) {
        if let Some(t) = self.incoming.get_mut(&transfer) {
            t.region = Some(region.id);
            match t.source {
                Some(remote) => {
                    self.counters.rdma_bytes_read += t.len;
                    self.reads.push_back(Transmit::Read {
                        transfer,
                        region: region.id,
                        len: t.len,
                        remote,
                    });
                }
                None => self.control.push_back(Pending::Cts {
                    transfer,
                    addr: region.addr,
                    rkey: region.rkey,
                }),
            }
        }
    }

    /// The RDMA read (the last piece) of read rendezvous `transfer` completed successfully:
    /// queues the Fin and returns the region holding the payload, for the driver to
    /// deregister and hand back with [`deliver_transfer`](Self::deliver_transfer).
    pub fn on_read_done(&mut self, transfer: u32) -> Result<MrId, ChannelError> {
        let region = self
            .incoming
            .get(&transfer)
            .filter(|t| t.source.is_some())
            .and_then(|t| t.region)
            .ok_or(ChannelError::UnknownTransfer(transfer))?;
        self.control.push_back(Pending::Fin(transfer));
        Ok(region)
    }

    /// An RDMA write with immediate data `transfer` whose last piece was `len` bytes arrived (its receive
    /// buffer was reposted): returns the region holding the payload, for the driver to
    /// deregister and hand back with [`deliver_transfer`](Self::deliver_transfer).
    pub fn on_write_done(&mut self, transfer: u32, len: usize) -> Result<MrId, ChannelError> {
        self.count_received()?;
        let t = self
            .incoming
            .get(&transfer)
            .filter(|t| t.region.is_some() && t.source.is_none())
            .ok_or(ChannelError::UnknownTransfer(transfer))?;
        // The completion reports the last write's bytes: the payload may have gone in pieces.
        if len as u64 > t.len {
            return Err(ChannelError::WrongLength {
                transfer,
                got: len,
                expected: t.len,
            });
        }
        t.region.ok_or(ChannelError::UnknownTransfer(transfer))
    }

    /// The payload of `transfer`, taken out of its deregistered buffer.
    pub fn deliver_transfer(&mut self, transfer: u32, payload: Bytes) {
        let Some(t) = self.incoming.remove(&transfer) else {
            return;
        };
        let frame = Frame {
            header: t.header,
            payload,
        };
        self.delivery.push_back((t.tag, frame));
    }

    /// The next complete frame and its place in the stream (frames come out as they complete,
    /// not necessarily in the sender's order).
    pub fn poll_frame(&mut self) -> Option<(StreamTag, Frame)> {
        let f = self.delivery.pop_front()?;
        self.counters.frames_delivered += 1;
        Some(f)
    }

    /// The end of the peer's stream, once it said BYE and everything it sent on this lane
    /// before has been taken ([`poll_frame`](Self::poll_frame)).
    pub fn peer_end(&self) -> Option<u64> {
        self.peer_closed
            .filter(|_| self.delivery.is_empty() && self.incoming.is_empty())
    }

    /// This side has nothing left to send (frames, responses, rendezvous payloads, BYE).
    pub fn is_idle(&self) -> bool {
        self.frames.is_empty()
            && self.control.is_empty()
            && self.awaiting_cts.is_empty()
            && self.sources.is_empty()
            && self.announce.is_empty()
            && self.awaiting_fin.is_empty()
            && self.reads.is_empty()
            && (self.bye_queued.is_none() || self.bye_sent)
    }

    /// Whether it has something it could send once credits or a send buffer allow.
    pub fn has_pending(&self) -> bool {
        !self.frames.is_empty()
            || !self.control.is_empty()
            || !self.announce.is_empty()
            || !self.reads.is_empty()
            || (self.bye_queued.is_some() && !self.bye_sent)
            || self.credits.update_due()
    }

    /// Forgets the write rendezvous transfers to this side that have not completed and
    /// returns their registered buffers: for the driver to deregister when this lane has
    /// failed (no write can land in them any more; the peer sends those frames again on
    /// another lane). Read rendezvous buffers are not taken: a read posted into one completes
    /// (flushed) first, and [`abandon_read`](Self::abandon_read) returns it then.
    pub fn take_incoming_writes(&mut self) -> Vec<MrId> {
        self.take_incoming(false)
    }

    /// Forgets the read rendezvous transfers to this side that have not completed and
    /// returns their registered buffers: for the driver to deregister when it tears the
    /// failed lane down (its queue pair is destroyed, so no read can still land in them).
    pub fn take_incoming_reads(&mut self) -> Vec<MrId> {
        self.take_incoming(true)
    }

    /// Forgets the incoming transfers by RDMA read (`reads`) or by RDMA write and returns
    /// their registered buffers.
    fn take_incoming(&mut self, reads: bool) -> Vec<MrId> {
        let taken: Vec<u32> = self
            .incoming
            .iter()
            .filter(|(_, t)| t.source.is_some() == reads)
            .map(|(&transfer, _)| transfer)
            .collect();
        taken
            .into_iter()
            .filter_map(|transfer| self.incoming.remove(&transfer)?.region)
            .collect()
    }

    /// Its credit state.
    pub fn credits(&self) -> Credits {
        self.credits
    }

    /// Its counters.
    pub fn counters(&self) -> ChannelCounters {
        self.counters
    }
}

#[cfg(test)]
#[path = "channel_tests.rs"]
mod tests;
