//! The point-to-point message protocol of one rank, as a sans-IO state machine.
//!
//! [`Endpoint`] owns the rank's matching queues and every send and receive in flight. It never
//! touches a socket, a clock or a task: the driver feeds it application requests
//! ([`post_send`](Endpoint::post_send), [`post_recv`](Endpoint::post_recv), …) and arrivals
//! ([`handle`](Endpoint::handle)), then drains frames to transmit
//! ([`poll_transmit`](Endpoint::poll_transmit)) and operations that finished
//! ([`poll_event`](Endpoint::poll_event)). One short cut: an eager send with nothing queued
//! ahead of it comes straight back to the caller to transmit
//! ([`start_eager`](Endpoint::start_eager)), and a receive started while nothing else
//! waits is kept apart from the matcher until something could change what it matches
//! (`lone.rs`). Tests drive it directly.
//!
//! What happens to a message:
//!
//! * **Eager** (length ≤ eager limit and the sender holds enough of the receiver's eager credit):
//!   one `Eager` frame carries envelope and data. The send is complete at once.
//! * **Rendezvous** (otherwise): an `Rts` frame carries the envelope; the data waits at the
//!   sender. When a receive matches, the receiver answers `Cts`; the sender then sends the data
//!   as `Data` fragments of at most the transport's payload size, and its send completes; the
//!   receiver's [`Reassembler`] puts them together.
//! * **Credit**: an eager message costs `len + EAGER_OVERHEAD` bytes of the receiver's credit.
//!   The receiver gives credit back (`Credit` frames, batched) when the application takes the
//!   data. This bounds the memory that unexpected messages can occupy at a receiver: a sender
//!   out of credit falls back to rendezvous, so its data stays with it until the receiver asks.

mod lone;
mod op_table;
mod reassembly;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::Bytes;

use crate::buffer_pool::BufferPool;
use crate::error::Error;
use crate::frame::{Envelope, Frame, Header};
use crate::matching::{
    ArriveOutcome, MatchKey, Matcher, PostOutcome, PostedKey, Selector, Unexpected,
};
use crate::stats::Stats;
use crate::transport::{Arrival, DataWant, EagerTaken, EagerWant};
use crate::types::ContextId;

use lone::{LoneIds, LoneRecv};

fn unexpected_cost(msg: &Incoming) -> usize {
    match msg {
        Incoming::Data { data, .. } => data.len(),
        Incoming::Rts { .. } | Incoming::InFlight { .. } => 0,
    }
}

pub use op_table::OpTable;
pub use reassembly::{FragmentError, Reassembler};

/// Credit charged per eager message on top of its payload, so that even empty messages use up
/// credit (the queue entry itself costs memory).
pub const EAGER_OVERHEAD: u64 = 64;

/// Identifies a receive operation of an [`Endpoint`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RecvId(pub u64);

/// Identifies a rendezvous send operation of an [`Endpoint`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SendId(pub u64);

/// What the endpoint reports to its driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// The receive finished (successfully or not); [`Endpoint::take_recv`] has its result.
    RecvDone(RecvId),
    /// The send finished; [`Endpoint::take_send`] has its result.
    SendDone(SendId),
    /// A message was added to the unexpected queue (probes may now succeed).
    Unexpected,
}

/// How a send started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendStart {
    /// The data went out eagerly: the send is already complete.
    Complete,
    /// Rendezvous: the send completes when its [`Event::SendDone`] comes.
    Pending(SendId),
}

/// A message handed to the application by a completed receive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Received {
    /// The sender's world rank.
    pub source: u32,
    /// The tag.
    pub tag: u32,
    /// The payload.
    pub data: Bytes,
}

/// A message taken by a receive, with what it takes to put it back in line
/// ([`Endpoint::give_back`]).
#[derive(Debug)]
pub struct Matched {
    /// The message.
    pub received: Received,
    seq: u64,
    key: MatchKey,
}

/// How a receive started ([`Endpoint::start_recv`]).
#[derive(Debug)]
pub enum RecvStart {
    /// A message was already there and is taken.
    Matched(Matched),
    /// The receive failed at once (truncation, lost peer).
    Failed(Error),
    /// The receive is posted; [`Event::RecvDone`] tells when it finished.
    Pending(RecvId),
}

/// The static parameters of an endpoint.
#[derive(Clone, Copy, Debug)]
pub struct EndpointConfig {
    /// This rank (world numbering).
    pub rank: u32,
    /// Number of ranks in the world.
    pub size: u32,
    /// Largest message sent eagerly.
    pub eager_limit: usize,
    /// Bytes of unexpected eager data this rank accepts from all senders together.
    pub unexpected_limit: usize,
    /// Largest payload of one frame.
    pub max_payload: usize,
    /// Attach a rendezvous message's data to its RTS (see [`Capabilities::by_reference`]).
    ///
    /// [`Capabilities::by_reference`]: crate::transport::Capabilities::by_reference
    pub rts_with_data: bool,
}

/// A receive that may take its sender's next eager message straight from the transport
/// ([`Endpoint::direct_want`]), and where it is kept.
#[derive(Clone, Copy, Debug)]
pub struct DirectRecv {
    /// What the transport must find.
    pub want: EagerWant,
    place: DirectPlace,
}

#[derive(Clone, Copy, Debug)]
enum DirectPlace {
    /// Posted alone (`lone.rs`).
    Lone,
    /// The one receive in the op table and the matcher.
    Queued(RecvId, PostedKey),
}

/// A message the matcher holds until a receive takes it.
#[derive(Debug)]
enum Incoming {
    /// The data is here. `cost` is the eager credit to give back once the application takes it.
    Data { data: Bytes, cost: u64 },
    /// Only the envelope is here; the data waits at the sender under `send_id` — or came
    /// along (`attached`), held by reference; the sender still waits for the match.
    Rts {
        send_id: u64,
        len: usize,
        attached: Option<Bytes>,
    },
    /// The data is arriving for receive `recv`, whose future was dropped after it matched: this
    /// entry keeps the message's place in line, and the receive that takes it adopts the
    /// transfer.
    InFlight { recv: RecvId, len: usize },
}

impl Incoming {
    fn len(&self) -> usize {
        match self {
            Incoming::Data { data, .. } => data.len(),
            Incoming::Rts { len, .. } | Incoming::InFlight { len, .. } => *len,
        }
    }
}

#[derive(Debug)]
enum RecvState {
    /// Just created: `post` gives it its real state before anyone can observe it (a
    /// placeholder with nothing to drop).
    Unposted,
    /// Waiting in the posted-receive queue.
    Posted(PostedKey),
    /// Matched an RTS; fragments are arriving.
    Receiving {
        key: MatchKey,
        seq: u64,
        data: Reassembler,
    },
    /// Took over the transfer of orphaned receive `orphan` (see [`Incoming::InFlight`]).
    Adopting {
        orphan: RecvId,
        key: MatchKey,
        seq: u64,
    },
    /// Matched a message whose data is all here.
    Done {
        key: MatchKey,
        seq: u64,
        data: Bytes,
        cost: u64,
    },
    /// Finished with an error.
    Failed(Error),
}

#[derive(Debug)]
struct RecvOp {
    sel: Selector,
    max_len: Option<usize>,
    state: RecvState,
    /// The application dropped this receive after it matched; an [`Incoming::InFlight`] entry
    /// holds the message's place in the unexpected queue while its data keeps arriving here.
    orphaned: bool,
    /// The receive that took over this orphan's transfer.
    adopted_by: Option<RecvId>,
}

#[derive(Debug)]
enum SendState {
    AwaitingCts,
    Done(Result<(), Error>),
}

#[derive(Debug)]
struct SendOp {
    to: u32,
    data: Bytes,
    /// The data went with the RTS: the CTS completes the send, no data frames follow.
    attached: bool,
    state: SendState,
    /// The application dropped the send's future: discard the result when it finishes.
    forgotten: bool,
}

/// Per-peer protocol state, created on first contact (so a 1024-rank job does not hold a
/// million of them).
#[derive(Debug)]
struct Peer {
    /// Sequence number of the next message this rank sends to the peer.
    next_send_seq: u64,
    /// Sequence number expected on the next message from the peer.
    next_recv_seq: u64,
    /// Eager credit this rank may still spend at the peer.
    credit: u64,
    /// Credit this rank owes the peer (eager data the application has taken).
    owed: u64,
    /// The peer failed or exited.
    lost: bool,
}

impl Peer {
    /// The envelope of the next message to this peer (its sequence number taken).
    fn next_envelope(&mut self, context: ContextId, tag: u32, len: usize) -> Envelope {
        let seq = self.next_send_seq;
        self.next_send_seq += 1;
        Envelope {
            context,
            tag,
            seq,
            len: len as u64,
        }
    }

    /// Whether a message of `len` bytes goes eagerly (within `eager_limit` and the credit it
    /// costs); if so, the credit is spent.
    fn spend_eager_credit(&mut self, len: usize, eager_limit: usize) -> bool {
        let cost = len as u64 + EAGER_OVERHEAD;
        let eager = len <= eager_limit && cost <= self.credit;
        if eager {
            self.credit -= cost;
        }
        eager
    }

    /// Adds `cost` to the credit owed; returns what to give back now, if the debt reached
    /// `threshold` (and the peer is there to hear it).
    fn owe(&mut self, cost: u64, threshold: u64) -> Option<u64> {
        self.owed += cost;
        (self.owed >= threshold && !self.lost).then(|| std::mem::take(&mut self.owed))
    }
}

/// The protocol state machine of one rank.
#[derive(Debug)]
pub struct Endpoint {
    cfg: EndpointConfig,
    credit_per_peer: u64,
    matcher: Matcher<RecvId, Incoming>,
    recvs: OpTable<RecvOp>,
    /// A receive posted alone, kept out of `recvs` and `matcher` (see [`lone`]).
    lone: Option<LoneRecv>,
    lone_ids: LoneIds,
    sends: OpTable<SendOp>,
    /// Indexed by world rank; boxed and created on first contact, so an idle pair costs one
    /// pointer.
    peers: Vec<Option<Box<Peer>>>,
    transmit: VecDeque<(u32, Frame)>,
    loopback: VecDeque<Frame>,
    events: VecDeque<Event>,
    unexpected_bytes: usize,
    stats: Stats,
    /// Where reassembled rendezvous messages get their buffers (reused once the application
    /// drops them): the process's pool.
    buffers: Arc<BufferPool>,
}

impl Endpoint {
    /// A fresh endpoint.
    pub fn new(cfg: EndpointConfig) -> Self {
        // Every rank, this one included (self-sends), gets an equal share of the limit.
        Endpoint {
            credit_per_peer: cfg.unexpected_limit as u64 / u64::from(cfg.size.max(1)),
            cfg,
            matcher: Matcher::new(),
            recvs: OpTable::default(),
            lone: None,
            lone_ids: LoneIds::default(),
            sends: OpTable::default(),
            peers: Vec::new(),
            transmit: VecDeque::new(),
            loopback: VecDeque::new(),
            events: VecDeque::new(),
            unexpected_bytes: 0,
            stats: Stats::default(),
            buffers: Arc::clone(BufferPool::shared()),
        }
    }

    /// This endpoint's parameters.
    pub fn config(&self) -> &EndpointConfig {
        &self.cfg
    }

    /// Counters.
    pub fn stats(&self) -> Stats {
        let mut s = self.stats.clone();
        s.unexpected_messages = self.matcher.unexpected_len() as u64;
        s.unexpected_bytes = self.unexpected_bytes as u64;
        s.posted_receives = (self.matcher.posted_len() + usize::from(self.lone.is_some())) as u64;
        s.pending_sends = self.sends.len() as u64;
        s
    }

    /// The state of peer `rank`: a load when it exists (every message after the first).
    #[inline]
    fn peer(&mut self, rank: u32) -> &mut Peer {
        let i = rank as usize;
        if !matches!(self.peers.get(i), Some(Some(_))) {
            self.first_contact(rank);
        }
        match self.peers.get_mut(i) {
            Some(Some(p)) => p,
            // first_contact created it.
            _ => unreachable!("peer state of rank {rank} missing after first contact"),
        }
    }

    /// [`peer`](Self::peer) on first contact: creates its state.
    #[cold]
    #[inline(never)]
    fn first_contact(&mut self, rank: u32) {
        let i = rank as usize;
        if i >= self.peers.len() {
            self.peers.resize_with(i + 1, || None);
        }
        let credit = self.credit_per_peer;
        self.peers[i].get_or_insert_with(|| {
            Box::new(Peer {
                next_send_seq: 0,
                next_recv_seq: 0,
                credit,
                owed: 0,
                lost: false,
            })
        });
    }

    /// The state of peer `to`, if a message may be sent to it: a rank of the job, not lost.
    fn peer_to_send_to(&mut self, to: u32) -> Result<&mut Peer, Error> {
        if to >= self.cfg.size {
            return Err(Error::InvalidRank {
                rank: to as usize,
                size: self.cfg.size as usize,
            });
        }
        let peer = self.peer(to);
        if peer.lost {
            return Err(Error::PeerFailed { rank: to as usize });
        }
        Ok(peer)
    }

    fn is_lost(&self, rank: u32) -> bool {
        matches!(self.peers.get(rank as usize), Some(Some(p)) if p.lost)
    }

    /// Starts the common small send: an eager message of `len` bytes to another rank, with
    /// nothing queued ahead of it. If that is what it is, the message is complete as far as the
    /// application is concerned and counted as sent, and its envelope is returned: the caller
    /// hands it and its payload to the transport now (or reports the peer unreachable, as for
    /// a queued frame) — without the payload ever reaching the endpoint, so a payload made of
    /// borrowed pieces needs no buffer of its own. `Ok(None)`: not this case, nothing changed;
    /// start the send with [`post_send`](Self::post_send).
    #[inline(always)]
    pub fn start_eager(
        &mut self,
        to: u32,
        context: ContextId,
        tag: u32,
        len: usize,
    ) -> Result<Option<Envelope>, Error> {
        let (eager_limit, queued) = (self.cfg.eager_limit, !self.transmit.is_empty());
        let own = to == self.cfg.rank;
        let peer = self.peer_to_send_to(to)?;
        if own || queued || !peer.spend_eager_credit(len, eager_limit) {
            return Ok(None);
        }
        let envelope = peer.next_envelope(context, tag, len);
        self.stats.eager_messages_sent += 1;
        self.stats.frames_sent += 1;
        self.stats.bytes_sent += len as u64;
        Ok(Some(envelope))
    }

    /// Starts sending `data` to world rank `to` on `context` with `tag`.
    pub fn post_send(
        &mut self,
        to: u32,
        context: ContextId,
        tag: u32,
        data: Bytes,
    ) -> Result<SendStart, Error> {
        let eager_limit = self.cfg.eager_limit;
        let peer = self.peer_to_send_to(to)?;
        let envelope = peer.next_envelope(context, tag, data.len());
        if peer.spend_eager_credit(data.len(), eager_limit) {
            self.stats.eager_messages_sent += 1;
            let frame = Frame {
                header: Header::Eager(envelope),
                payload: data,
            };
            self.queue(to, frame);
            self.run_loopback();
            return Ok(SendStart::Complete);
        }
        self.stats.rendezvous_messages_sent += 1;
        // Attach the data to the request when that is free and it fits one frame.
        let attached = self.cfg.rts_with_data && data.len() <= self.cfg.max_payload;
        let send_id = self.sends.insert(SendOp {
            to,
            attached,
            data,
            state: SendState::AwaitingCts,
            forgotten: false,
        });
        let payload = match self.sends.get(send_id) {
            Some(op) if attached => op.data.clone(),
            _ => Bytes::new(),
        };
        let header = Header::Rts {
            envelope,
            send_id,
            attached,
        };
        self.queue(to, Frame { header, payload });
        self.run_loopback();
        Ok(SendStart::Pending(SendId(send_id)))
    }

    /// The result of a finished rendezvous send (removing it), or `None` while it runs.
    pub fn take_send(&mut self, id: SendId) -> Option<Result<(), Error>> {
        match self.sends.get(id.0)?.state {
            SendState::AwaitingCts => None,
            SendState::Done(_) => match self.sends.remove(id.0)?.state {
                SendState::Done(r) => Some(r),
                SendState::AwaitingCts => None,
            },
        }
    }

    /// The application no longer waits for this send. It still completes; its result is dropped.
    pub fn forget_send(&mut self, id: SendId) {
        if let Some(op) = self.sends.get_mut(id.0) {
            match op.state {
                SendState::AwaitingCts => op.forgotten = true,
                SendState::Done(_) => {
                    self.sends.remove(id.0);
                }
            }
        }
    }

    /// Whether rendezvous sends are still waiting for their receivers.
    pub fn has_pending_sends(&self) -> bool {
        !self.sends.is_empty()
    }

    /// Posts a receive for messages matching `sel`. With `max_len`, a longer message fails the
    /// receive with [`Error::Truncated`] and stays queued for the next receive.
    pub fn post_recv(&mut self, sel: Selector, max_len: Option<usize>) -> RecvId {
        // Posted after the lone receive: it must be in line first.
        self.join_lone();
        let id = RecvId(self.recvs.insert(RecvOp {
            sel,
            max_len,
            state: RecvState::Unposted,
            orphaned: false,
            adopted_by: None,
        }));
        self.post(id, sel);
        self.run_loopback();
        id
    }

    /// Matches receive `id` against the unexpected queue, or queues it.
    fn post(&mut self, id: RecvId, sel: Selector) {
        if let Some(source) = sel.source {
            if self.is_lost(source) && self.probe(&sel).is_none() {
                let rank = source as usize;
                return self.finish_recv(id, RecvState::Failed(Error::PeerFailed { rank }));
            }
        }
        match self.matcher.post(sel, id) {
            PostOutcome::Queued(key) => {
                if let Some(op) = self.recvs.get_mut(id.0) {
                    op.state = RecvState::Posted(key);
                }
            }
            PostOutcome::Matched { recv, unexpected } => {
                self.unexpected_bytes -= unexpected_cost(&unexpected.msg);
                self.deliver(recv, unexpected);
            }
        }
    }

    /// Posts a receive like [`post_recv`](Self::post_recv), and if a message is already there,
    /// takes it at once: no operation is left behind to poll.
    #[inline(always)]
    pub fn start_recv(&mut self, sel: Selector, max_len: Option<usize>) -> RecvStart {
        if self.may_post_lone(&sel) {
            let id = self.lone_ids.fresh();
            self.lone = Some(LoneRecv { id, sel, max_len });
            return RecvStart::Pending(id);
        }
        // The common case of a receiver that is behind: the earliest matching message is here
        // with all its data and fits. Take it without creating an operation (what `post_recv`
        // and `take_matched` would do, minus the bookkeeping of a receive that ends at once).
        let fits = |u: &Unexpected<Incoming>| matches!(&u.msg, Incoming::Data { data, .. } if max_len.is_none_or(|c| data.len() <= c));
        if let Some(u) = self.matcher.take_if(&sel, fits) {
            if let Incoming::Data { data, cost } = u.msg {
                self.unexpected_bytes -= data.len();
                self.give_credit(u.key.source, cost);
                self.run_loopback();
                let received = Received {
                    source: u.key.source,
                    tag: u.key.tag,
                    data,
                };
                return RecvStart::Matched(Matched {
                    received,
                    seq: u.seq,
                    key: u.key,
                });
            }
            // `fits` only accepts data messages; put anything else back where it was.
            self.requeue(u);
        }
        let id = self.post_recv(sel, max_len);
        match self.take_matched(id) {
            Some(Ok(m)) => RecvStart::Matched(m),
            Some(Err(e)) => RecvStart::Failed(e),
            None => RecvStart::Pending(id),
        }
    }

    /// Whether a receive for `sel` can be posted alone (see [`lone`]): it names its sender
    /// (another rank, not lost), and no other receive waits and no message is queued, so
    /// nothing can overtake it and nothing here can match it.
    fn may_post_lone(&self, sel: &Selector) -> bool {
        self.lone.is_none()
            && self.matcher.posted_len() == 0
            && self.matcher.unexpected_len() == 0
            && self.loopback.is_empty()
            && sel
                .source
                .is_some_and(|s| s != self.cfg.rank && s < self.cfg.size && !self.is_lost(s))
    }

    /// Enters the lone receive, if there is one, in the op table and the matcher (see
    /// [`lone`]): before anything that could change what it matches.
    fn join_lone(&mut self) {
        let Some(lone) = self.lone.take() else {
            return;
        };
        let id = RecvId(self.recvs.insert(RecvOp {
            sel: lone.sel,
            max_len: lone.max_len,
            state: RecvState::Unposted,
            orphaned: false,
            adopted_by: None,
        }));
        self.lone_ids.joined(lone.id, id);
        self.post(id, lone.sel);
    }

    /// The result of a finished receive (removing it), or `None` while it is still pending.
    pub fn take_recv(&mut self, id: RecvId) -> Option<Result<Received, Error>> {
        self.take_matched(id).map(|r| r.map(|m| m.received))
    }

    /// Like [`take_recv`](Self::take_recv), keeping what [`give_back`](Self::give_back) needs.
    pub fn take_matched(&mut self, public: RecvId) -> Option<Result<Matched, Error>> {
        if self.lone.is_some_and(|l| l.id == public) {
            return None;
        }
        let id = self.lone_ids.op_id(public);
        let op = self.recvs.get(id.0)?;
        // An orphan's outcome belongs to whoever takes its in-flight entry, not to its old id.
        if op.orphaned || !matches!(op.state, RecvState::Done { .. } | RecvState::Failed(_)) {
            return None;
        }
        let state = self.recvs.remove(id.0)?.state;
        self.lone_ids.forget(public);
        match state {
            RecvState::Done {
                key,
                seq,
                data,
                cost,
            } => {
                self.give_credit(key.source, cost);
                self.run_loopback();
                let received = Received {
                    source: key.source,
                    tag: key.tag,
                    data,
                };
                Some(Ok(Matched { received, seq, key }))
            }
            RecvState::Failed(e) => Some(Err(e)),
            RecvState::Unposted
            | RecvState::Posted(_)
            | RecvState::Receiving { .. }
            | RecvState::Adopting { .. } => None,
        }
    }

    /// What receive `id` may take straight from the transport ([`take_direct`](Self::take_direct)):
    /// the next eager message of its one sender, if the receive is waiting, names that sender
    /// (not lost), and is the only receive queued — so no earlier receive has a claim on that
    /// sender's next message and no queued message matches it.
    pub fn direct_want(&self, id: RecvId) -> Option<DirectRecv> {
        let (sel, max_len, place) = match self.lone {
            Some(lone) if lone.id == id => (lone.sel, lone.max_len, DirectPlace::Lone),
            Some(_) => return None,
            None => {
                if self.matcher.posted_len() != 1 {
                    return None;
                }
                let op_id = self.lone_ids.op_id(id);
                let op = self.recvs.get(op_id.0)?;
                let RecvState::Posted(posted) = op.state else {
                    return None;
                };
                if op.orphaned {
                    return None;
                }
                (op.sel, op.max_len, DirectPlace::Queued(op_id, posted))
            }
        };
        let from = sel.source?;
        // Frames to self never wait in a transport.
        if from == self.cfg.rank || from >= self.cfg.size {
            return None;
        }
        let seq = match self.peers.get(from as usize).and_then(Option::as_deref) {
            Some(peer) if peer.lost => return None,
            Some(peer) => peer.next_recv_seq,
            None => 0,
        };
        let want = EagerWant {
            from,
            context: sel.context,
            tag: sel.tag,
            seq,
            max_len: max_len.unwrap_or(usize::MAX),
        };
        Some(DirectRecv { want, place })
    }

    /// Receive `public` took `taken`, the message [`direct_want`](Self::direct_want) described
    /// as `direct`, straight from the transport: it is finished, exactly as if the frame had
    /// gone through [`handle`](Self::handle) and [`take_matched`](Self::take_matched). Nothing
    /// may have changed the endpoint between the two calls (the driver holds its lock).
    pub fn take_direct(
        &mut self,
        public: RecvId,
        direct: &DirectRecv,
        taken: EagerTaken,
    ) -> Matched {
        let from = direct.want.from;
        let key = MatchKey {
            context: direct.want.context,
            source: from,
            tag: taken.tag,
        };
        let seq = match direct.place {
            DirectPlace::Lone => {
                self.lone = None;
                self.matcher.next_arrival()
            }
            DirectPlace::Queued(id, posted) => {
                let seq = self
                    .matcher
                    .arrive_for(posted)
                    .map_or_else(|| self.matcher.next_arrival(), |(_, seq)| seq);
                self.recvs.remove(id.0);
                self.lone_ids.forget(public);
                seq
            }
        };
        let len = taken.len as u64;
        // One look-up for both: this is every small message's path.
        let threshold = self.credit_threshold();
        let peer = self.peer(from);
        peer.next_recv_seq += 1;
        if let Some(bytes) = peer.owe(len + EAGER_OVERHEAD, threshold) {
            self.send_credit(from, bytes);
        }
        self.stats.frames_received += 1;
        self.stats.bytes_received += len;
        let received = Received {
            source: from,
            tag: taken.tag,
            data: taken.data,
        };
        Matched { received, seq, key }
    }

    /// What receive `public` may take straight from the transport once it matched a request to
    /// send and none of its data has come: all of it, in one data frame from its sender (see
    /// [`Transport::take_data`](crate::transport::Transport::take_data)).
    pub fn data_want(&self, public: RecvId) -> Option<DataWant> {
        if self.lone.is_some_and(|l| l.id == public) {
            return None;
        }
        let id = self.lone_ids.op_id(public);
        let op = self.recvs.get(id.0)?;
        match &op.state {
            RecvState::Receiving { key, data, .. }
                if !op.orphaned && data.received() == 0 && !data.is_empty() =>
            {
                Some(DataWant {
                    from: key.source,
                    recv_id: id.0,
                    len: data.len(),
                })
            }
            _ => None,
        }
    }

    /// Receive `public` took all its data, as [`data_want`](Self::data_want) described it as
    /// `want`, straight from the transport into its caller's buffer: it is finished, as if the
    /// data frame had gone through [`handle`](Self::handle) and
    /// [`take_matched`](Self::take_matched). Returns its sender, tag and length. Nothing may
    /// have changed the endpoint between the two calls (the driver holds its lock).
    pub fn take_data_direct(
        &mut self,
        public: RecvId,
        want: &DataWant,
    ) -> Option<(u32, u32, usize)> {
        let id = self.lone_ids.op_id(public);
        let RecvState::Receiving { key, .. } = self.recvs.get(id.0)?.state else {
            return None;
        };
        self.recvs.remove(id.0);
        self.lone_ids.forget(public);
        self.stats.frames_received += 1;
        self.stats.bytes_received += want.len as u64;
        Some((key.source, key.tag, want.len))
    }

    /// [`direct_want`](Self::direct_want) and [`take_direct`](Self::take_direct) for a frame
    /// held decoded: receive `public` takes the frame from world rank `from` if it is the eager
    /// message it wants (its payload copied), or declines it (`None`, nothing changed).
    pub fn accept_direct(
        &mut self,
        public: RecvId,
        from: u32,
        header: &Header,
        payload: &[u8],
    ) -> Option<Matched> {
        let Header::Eager(envelope) = *header else {
            return None;
        };
        let direct = self.direct_want(public)?;
        if direct.want.from != from || !direct.want.accepts(&envelope, payload.len()) {
            return None;
        }
        let taken = EagerTaken {
            tag: envelope.tag,
            len: payload.len(),
            // An allocation of its own: making and dropping it touches no reference count (a
            // slice of a shared chunk costs two atomic operations, more than the allocation).
            data: crate::byte_copy::bytes_from(payload),
        };
        Some(self.take_direct(public, &direct, taken))
    }

    /// The application dropped a message it had taken but not read: it goes back to the
    /// unexpected queue at its original place, so nothing is lost. (Its eager credit was
    /// already given back when it was taken.)
    pub fn give_back(&mut self, m: Matched) {
        self.join_lone();
        self.requeue(Unexpected {
            seq: m.seq,
            key: m.key,
            msg: Incoming::Data {
                data: m.received.data,
                cost: 0,
            },
        });
        self.run_loopback();
    }

    /// The application dropped this receive. Not yet matched: it is withdrawn. Matched: the
    /// message goes back to the unexpected queue in its original place (once all its data is
    /// here), so nothing is lost.
    pub fn cancel_recv(&mut self, public: RecvId) {
        if self.lone.is_some_and(|l| l.id == public) {
            self.lone = None;
            return;
        }
        // What this one gives back could be the lone receive's to match.
        self.join_lone();
        let id = self.lone_ids.op_id(public);
        self.lone_ids.forget(public);
        let Some(op) = self.recvs.get_mut(id.0) else {
            return;
        };
        match op.state {
            RecvState::Receiving { key, seq, ref data } => {
                // Keep the message's place in line; its data keeps arriving into this op.
                let len = data.len();
                op.orphaned = true;
                self.requeue(Unexpected {
                    seq,
                    key,
                    msg: Incoming::InFlight { recv: id, len },
                });
            }
            RecvState::Adopting { orphan, key, seq } => {
                self.recvs.remove(id.0);
                let len = self.recvs.get_mut(orphan.0).map_or(0, |o| {
                    o.adopted_by = None;
                    match &o.state {
                        RecvState::Receiving { data, .. } => data.len(),
                        _ => 0,
                    }
                });
                self.requeue(Unexpected {
                    seq,
                    key,
                    msg: Incoming::InFlight { recv: orphan, len },
                });
            }
            RecvState::Posted(key) => {
                self.matcher.cancel(key);
                self.recvs.remove(id.0);
            }
            RecvState::Unposted => {
                self.recvs.remove(id.0);
            }
            RecvState::Done { .. } | RecvState::Failed(_) => {
                if let Some(RecvOp {
                    state:
                        RecvState::Done {
                            key,
                            seq,
                            data,
                            cost,
                        },
                    ..
                }) = self.recvs.remove(id.0)
                {
                    self.requeue(Unexpected {
                        seq,
                        key,
                        msg: Incoming::Data { data, cost },
                    });
                }
            }
        }
        self.run_loopback();
    }

    /// The first unexpected message matching `sel`: (world source, tag, length).
    ///
    /// `&mut self` only because the matcher may index messages while it looks
    /// ([`Matcher::probe`]); nothing is taken.
    pub fn probe(&mut self, sel: &Selector) -> Option<(u32, u32, usize)> {
        self.matcher
            .probe(sel)
            .map(|u| (u.key.source, u.key.tag, u.msg.len()))
    }

    /// Feeds something the transport received.
    pub fn handle(&mut self, arrival: Arrival) {
        self.join_lone();
        match arrival {
            Arrival::Frame { from, frame } => {
                self.stats.frames_received += 1;
                self.stats.bytes_received += frame.payload.len() as u64;
                self.handle_frame(from, frame);
            }
            Arrival::PeerLost { rank } => self.peer_lost(rank),
        }
        self.run_loopback();
    }

    /// The next frame to hand to the transport: (destination world rank, frame).
    pub fn poll_transmit(&mut self) -> Option<(u32, Frame)> {
        self.transmit.pop_front()
    }

    /// The next event for the driver.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// Whether frames wait in [`poll_transmit`](Self::poll_transmit) or events in
    /// [`poll_event`](Self::poll_event).
    pub fn has_output(&self) -> bool {
        !self.transmit.is_empty() || !self.events.is_empty()
    }

    /// Drops the events not polled yet (a driver with nobody waiting for them).
    pub fn discard_events(&mut self) {
        self.events.clear();
    }

    /// The transport could not reach world rank `rank`: treat it as lost.
    pub fn peer_unreachable(&mut self, rank: u32) {
        self.join_lone();
        self.peer_lost(rank);
        self.run_loopback();
    }

    /// Queues `frame` for world rank `to` (counted as sent now: it leaves through
    /// [`poll_transmit`](Self::poll_transmit) before anyone can look at the counters).
    fn queue(&mut self, to: u32, frame: Frame) {
        if to == self.cfg.rank {
            self.loopback.push_back(frame);
        } else {
            self.count_sent(&frame);
            self.transmit.push_back((to, frame));
        }
    }

    fn count_sent(&mut self, frame: &Frame) {
        self.stats.frames_sent += 1;
        self.stats.bytes_sent += frame.payload.len() as u64;
    }

    /// Frames a rank sends to itself never reach a transport: they are handled here, in order.
    fn run_loopback(&mut self) {
        if self.loopback.is_empty() {
            return;
        }
        self.join_lone();
        while let Some(frame) = self.loopback.pop_front() {
            self.handle_frame(self.cfg.rank, frame);
        }
    }

    fn protocol_error(&mut self, from: u32, detail: &str) {
        self.stats.protocol_errors += 1;
        tracing::warn!(
            peer = from,
            detail,
            "dropped a frame that breaks the protocol"
        );
    }

    fn handle_frame(&mut self, from: u32, frame: Frame) {
        if from >= self.cfg.size {
            return self.protocol_error(from, "frame from a rank outside the job");
        }
        match frame.header {
            Header::Eager(env) => {
                if env.len != frame.payload.len() as u64 {
                    return self.protocol_error(from, "eager length disagrees with payload");
                }
                if !self.check_seq(from, env.seq) {
                    return;
                }
                let cost = frame.payload.len() as u64 + EAGER_OVERHEAD;
                self.arrive(
                    from,
                    env,
                    Incoming::Data {
                        data: frame.payload,
                        cost,
                    },
                );
            }
            Header::Rts {
                envelope,
                send_id,
                attached,
            } => {
                let len = match usize::try_from(envelope.len) {
                    Ok(len) if len <= isize::MAX as usize => len,
                    _ => return self.protocol_error(from, "impossible message length"),
                };
                if !self.check_seq(from, envelope.seq) {
                    return;
                }
                let attached = match attached {
                    true if frame.payload.len() == len => Some(frame.payload),
                    false if frame.payload.is_empty() => None,
                    _ => return self.protocol_error(from, "request-to-send payload mismatch"),
                };
                self.arrive(
                    from,
                    envelope,
                    Incoming::Rts {
                        send_id,
                        len,
                        attached,
                    },
                );
            }
            Header::Cts { send_id, recv_id } => self.handle_cts(from, send_id, recv_id),
            Header::Data { recv_id, offset } => {
                self.handle_data(from, recv_id, offset, frame.payload)
            }
            Header::Credit { bytes } => {
                let peer = self.peer(from);
                peer.credit = peer.credit.saturating_add(bytes);
            }
        }
    }

    /// Messages from one peer must arrive in the order sent (the transport or the reliability
    /// layer guarantees it); anything else is a protocol error and is dropped.
    fn check_seq(&mut self, from: u32, seq: u64) -> bool {
        let peer = self.peer(from);
        if seq != peer.next_recv_seq {
            self.protocol_error(from, "message out of sequence");
            return false;
        }
        peer.next_recv_seq += 1;
        true
    }

    fn arrive(&mut self, from: u32, env: Envelope, msg: Incoming) {
        let key = MatchKey {
            context: env.context,
            source: from,
            tag: env.tag,
        };
        let cost = unexpected_cost(&msg);
        match self.matcher.arrive(key, msg) {
            ArriveOutcome::Matched { recv, unexpected } => self.deliver(recv, unexpected),
            ArriveOutcome::Queued => {
                self.unexpected_bytes += cost;
                self.events.push_back(Event::Unexpected);
            }
        }
    }

    /// Puts a matched message back: the earliest matching posted receive takes it, or it waits
    /// in the unexpected queue at its original position.
    fn requeue(&mut self, u: Unexpected<Incoming>) {
        let cost = unexpected_cost(&u.msg);
        match self.matcher.requeue(u) {
            ArriveOutcome::Matched { recv, unexpected } => self.deliver(recv, unexpected),
            ArriveOutcome::Queued => {
                self.unexpected_bytes += cost;
                self.events.push_back(Event::Unexpected);
            }
        }
    }

    /// Hands a matched message to a receive.
    fn deliver(&mut self, id: RecvId, mut u: Unexpected<Incoming>) {
        // A requeue can be taken by another posted receive, which may itself be too small, so
        // this loops instead of recursing.
        let mut id = id;
        loop {
            let Some(op) = self.recvs.get(id.0) else {
                // The receive vanished (cannot happen: matched receives are live); keep the
                // message rather than lose it.
                debug_assert!(false, "matched a receive that is not in the table");
                return self.requeue(u);
            };
            let len = u.msg.len();
            if let Some(capacity) = op.max_len.filter(|&c| len > c) {
                let err = Error::Truncated {
                    len,
                    capacity,
                    from: u.key.source as usize,
                    tag: u.key.tag,
                };
                self.finish_recv(id, RecvState::Failed(err));
                let cost = unexpected_cost(&u.msg);
                match self.matcher.requeue(u) {
                    ArriveOutcome::Matched { recv, unexpected } => {
                        id = recv;
                        u = unexpected;
                        continue;
                    }
                    ArriveOutcome::Queued => {
                        self.unexpected_bytes += cost;
                        self.events.push_back(Event::Unexpected);
                        return;
                    }
                }
            }
            match u.msg {
                Incoming::Data { data, cost } => self.finish_recv(
                    id,
                    RecvState::Done {
                        key: u.key,
                        seq: u.seq,
                        data,
                        cost,
                    },
                ),
                Incoming::InFlight { recv: orphan, .. } => self.adopt(id, orphan, u.key, u.seq),
                Incoming::Rts {
                    send_id,
                    attached: Some(data),
                    ..
                } => {
                    // The data came with the request: done here; the CTS only tells the sender
                    // (if it is still there to hear it) that the message was received.
                    if !self.is_lost(u.key.source) {
                        let cts = Header::Cts {
                            send_id,
                            recv_id: id.0,
                        };
                        self.queue(u.key.source, Frame::control(cts));
                    }
                    let state = RecvState::Done {
                        key: u.key,
                        seq: u.seq,
                        data,
                        cost: 0,
                    };
                    self.finish_recv(id, state);
                }
                Incoming::Rts {
                    send_id,
                    len,
                    attached: None,
                } => {
                    if self.is_lost(u.key.source) {
                        // The data can never come: drop the RTS and match the receive anew.
                        if let Some(sel) = self.recvs.get(id.0).map(|op| op.sel) {
                            self.post(id, sel);
                        }
                        return;
                    }
                    if let Some(op) = self.recvs.get_mut(id.0) {
                        op.state = RecvState::Receiving {
                            key: u.key,
                            seq: u.seq,
                            data: Reassembler::new(len, Arc::clone(&self.buffers)),
                        };
                    }
                    self.queue(
                        u.key.source,
                        Frame::control(Header::Cts {
                            send_id,
                            recv_id: id.0,
                        }),
                    );
                }
            }
            return;
        }
    }

    /// Receive `id` takes over the transfer of orphaned receive `orphan`.
    fn adopt(&mut self, id: RecvId, orphan: RecvId, key: MatchKey, seq: u64) {
        let Some(o) = self.recvs.get_mut(orphan.0) else {
            debug_assert!(false, "in-flight entry for a receive that is gone");
            return;
        };
        if matches!(o.state, RecvState::Receiving { .. }) {
            o.adopted_by = Some(id);
            if let Some(op) = self.recvs.get_mut(id.0) {
                op.state = RecvState::Adopting { orphan, key, seq };
            }
            return;
        }
        // The transfer already ended while nobody wanted it: hand over its outcome.
        let state = match self.recvs.remove(orphan.0).map(|o| o.state) {
            Some(RecvState::Done { data, .. }) => RecvState::Done {
                key,
                seq,
                data,
                cost: 0,
            },
            Some(RecvState::Failed(e)) => RecvState::Failed(e),
            _ => RecvState::Failed(Error::PeerFailed {
                rank: key.source as usize,
            }),
        };
        self.finish_recv(id, state);
    }

    /// Ends orphaned receive `orphan` with `state`: its adopter gets the outcome; without one,
    /// the orphan keeps it (silently) until a receive takes its in-flight entry.
    fn finish_orphan(&mut self, orphan: RecvId, state: RecvState) {
        let adopter = self.recvs.get(orphan.0).and_then(|o| o.adopted_by);
        match adopter {
            Some(adopter) => {
                self.recvs.remove(orphan.0);
                self.finish_recv(adopter, state);
            }
            None => {
                if let Some(o) = self.recvs.get_mut(orphan.0) {
                    o.state = state;
                }
            }
        }
    }

    fn finish_recv(&mut self, id: RecvId, state: RecvState) {
        if let Some(op) = self.recvs.get_mut(id.0) {
            op.state = state;
            self.events
                .push_back(Event::RecvDone(self.lone_ids.public_id(id)));
        }
    }

    fn handle_cts(&mut self, from: u32, send_id: u64, recv_id: u64) {
        let max = self.cfg.max_payload.max(1);
        let Some(op) = self.sends.get_mut(send_id) else {
            return self.protocol_error(from, "clear-to-send for an unknown send");
        };
        if op.to != from || !matches!(op.state, SendState::AwaitingCts) {
            return self.protocol_error(from, "clear-to-send from the wrong peer or twice");
        }
        let data = std::mem::take(&mut op.data);
        let forgotten = op.forgotten;
        let attached = op.attached;
        if forgotten {
            self.sends.remove(send_id);
        } else {
            op.state = SendState::Done(Ok(()));
            self.events.push_back(Event::SendDone(SendId(send_id)));
        }
        if attached {
            // The receiver already has the data (it came with the RTS).
            return;
        }
        // Always at least one fragment, so an empty rendezvous message completes too.
        let mut offset = 0;
        loop {
            let end = (offset + max).min(data.len());
            let header = Header::Data {
                recv_id,
                offset: offset as u64,
            };
            self.queue(
                from,
                Frame {
                    header,
                    payload: data.slice(offset..end),
                },
            );
            offset = end;
            if offset >= data.len() {
                break;
            }
        }
    }

    fn handle_data(&mut self, from: u32, recv_id: u64, offset: u64, payload: Bytes) {
        let Some(op) = self.recvs.get_mut(recv_id) else {
            return self.protocol_error(from, "data for an unknown receive");
        };
        let RecvState::Receiving { key, data, .. } = &mut op.state else {
            return self.protocol_error(from, "data for a receive that is not receiving");
        };
        if key.source != from {
            return self.protocol_error(from, "data from the wrong peer");
        }
        let Ok(offset) = usize::try_from(offset) else {
            return self.protocol_error(from, "impossible data offset");
        };
        let orphaned = op.orphaned;
        match data.insert(offset, payload) {
            Ok(()) => {}
            Err(FragmentError::NoMemory) => {
                // Nothing else can be done for this message: fail the receive, keep the rank.
                let detail = format!("cannot allocate {} bytes for a message", data.len());
                self.protocol_error(from, &detail);
                let state = RecvState::Failed(Error::Protocol {
                    peer: from as usize,
                    detail,
                });
                return if orphaned {
                    self.finish_orphan(RecvId(recv_id), state)
                } else {
                    self.finish_recv(RecvId(recv_id), state)
                };
            }
            Err(_) => {
                return self.protocol_error(from, "data fragment out of bounds or overlapping");
            }
        }
        if !data.is_complete() {
            return;
        }
        let orphaned = op.orphaned;
        let RecvState::Receiving { key, seq, data } =
            std::mem::replace(&mut op.state, RecvState::Failed(Error::Shutdown))
        else {
            return;
        };
        let data = data.finish();
        let state = RecvState::Done {
            key,
            seq,
            data,
            cost: 0,
        };
        if orphaned {
            self.finish_orphan(RecvId(recv_id), state);
        } else {
            self.finish_recv(RecvId(recv_id), state);
        }
    }

    /// Gives eager credit back to `peer` once enough has accumulated to be worth a frame.
    fn give_credit(&mut self, peer: u32, cost: u64) {
        if cost == 0 {
            return;
        }
        let threshold = self.credit_threshold();
        if let Some(bytes) = self.peer(peer).owe(cost, threshold) {
            self.send_credit(peer, bytes);
        }
    }

    /// Credit owed to a peer is given back in frames of at least this much.
    fn credit_threshold(&self) -> u64 {
        (self.credit_per_peer / 4).max(1)
    }

    fn send_credit(&mut self, peer: u32, bytes: u64) {
        self.queue(peer, Frame::control(Header::Credit { bytes }));
    }

    fn peer_lost(&mut self, rank: u32) {
        let peer = self.peer(rank);
        if peer.lost {
            return;
        }
        peer.lost = true;
        let err = || Error::PeerFailed {
            rank: rank as usize,
        };
        for id in self.matcher.take_posted_from(rank) {
            self.finish_recv(id, RecvState::Failed(err()));
        }
        let mut failed_recvs = Vec::new();
        for (id, op) in self.recvs.iter_mut() {
            if let RecvState::Receiving { key, .. } = &op.state {
                if key.source == rank {
                    failed_recvs.push(RecvId(id));
                }
            }
        }
        for id in failed_recvs {
            let orphaned = self.recvs.get(id.0).is_some_and(|op| op.orphaned);
            if orphaned {
                self.finish_orphan(id, RecvState::Failed(err()));
            } else {
                self.finish_recv(id, RecvState::Failed(err()));
            }
        }
        let mut failed_sends = Vec::new();
        for (id, op) in self.sends.iter_mut() {
            if op.to == rank && matches!(op.state, SendState::AwaitingCts) {
                failed_sends.push((id, op.forgotten));
            }
        }
        for (id, forgotten) in failed_sends {
            if forgotten {
                self.sends.remove(id);
            } else if let Some(op) = self.sends.get_mut(id) {
                op.state = SendState::Done(Err(err()));
                op.data = Bytes::new();
                self.events.push_back(Event::SendDone(SendId(id)));
            }
        }
    }
}
