//! The [`Transport`] trait: what the message layer needs from something that moves frames.
//!
//! A transport moves [`Frame`]s between the ranks of a job and says what it guarantees
//! ([`Capabilities`]); the message layer adds only what is missing (UCX's split between UCT and
//! UCP). One `Transport` value serves one rank.

use std::mem::MaybeUninit;
use std::task::{Context, Poll};

use bytes::Bytes;

use crate::arena::{ArenaLease, PeerArena};
use crate::error::TransportError;
use crate::frame::{Envelope, Frame};
use crate::stats::TransportStats;
use crate::types::ContextId;

/// What a transport guarantees and can do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// Frames are never lost, corrupted or duplicated.
    pub reliable: bool,
    /// Frames from one sender arrive in the order they were sent.
    pub ordered: bool,
    /// The largest payload one frame may carry (`usize::MAX` when unlimited).
    pub max_payload: usize,
    /// The transport can deliver one frame to many ranks at once.
    pub multicast: bool,
    /// The transport can read or write remote memory directly.
    pub rdma: bool,
    /// Payloads are handed over by reference, not copied (in-process): a rendezvous request
    /// can carry the data at no cost, saving the CTS → data round trip while the sender still
    /// waits for the receiver to match.
    pub by_reference: bool,
}

/// Something a transport received for its rank.
#[derive(Debug)]
pub enum Arrival {
    /// A frame from world rank `from`.
    Frame {
        /// The sender's world rank.
        from: u32,
        /// The frame.
        frame: Frame,
    },
    /// World rank `rank` has failed or exited: nothing more will come from it. Every frame it
    /// sent before arrives before this.
    PeerLost {
        /// The lost rank.
        rank: u32,
    },
}

/// The eager message a receive waiting for one sender would take straight from the transport
/// (see [`Transport::take_eager`]): the next frame from `from`, if it is an eager message of
/// this description.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EagerWant {
    /// The sender's world rank.
    pub from: u32,
    /// The context the message must be on.
    pub context: ContextId,
    /// The tag it must carry, or `None` for any.
    pub tag: Option<u32>,
    /// Its sequence number: the next one expected from `from`.
    pub seq: u64,
    /// The longest payload the receive takes.
    pub max_len: usize,
}

impl EagerWant {
    /// Whether an eager frame with envelope `envelope` and a payload of `payload_len` bytes is
    /// the wanted message.
    #[inline]
    pub fn accepts(&self, envelope: &Envelope, payload_len: usize) -> bool {
        envelope.context == self.context
            && envelope.seq == self.seq
            && envelope.len == payload_len as u64
            && payload_len <= self.max_len
            && self.tag.is_none_or(|tag| tag == envelope.tag)
    }
}

/// The data a rendezvous receive waits for once its sender's request was matched, which a
/// transport may read straight into the receive's buffer (see [`Transport::take_data`]): all
/// of it, in the next frame from `from`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataWant {
    /// The sender's world rank.
    pub from: u32,
    /// The receive the data is for, as the data frames name it (`Header::Data::recv_id`).
    pub recv_id: u64,
    /// The message's length in bytes.
    pub len: usize,
}

/// An eager message a transport handed over in place (see [`Transport::take_eager`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EagerTaken {
    /// Its tag.
    pub tag: u32,
    /// Its payload's length in bytes.
    pub len: usize,
    /// Its payload, copied out of the transport's buffer; empty when the payload was copied
    /// into the receive's own buffer instead (`into` of [`Transport::take_eager`]).
    pub data: Bytes,
}

/// Moves frames for one rank.
///
/// Implementations must never block: `send` queues or hands off, `drain` takes what is there.
pub trait Transport: Send + Sync + 'static {
    /// What this transport guarantees.
    fn capabilities(&self) -> Capabilities;

    /// Hands a frame to the transport for delivery to world rank `to`.
    ///
    /// A frame to a peer known to be leaving or gone is dropped with `Ok`, as a network drops
    /// datagrams to a host that is down: its loss is learnt from [`Arrival::PeerLost`], which
    /// comes after every frame it sent. An error here makes the engine declare the peer lost at
    /// once, while frames it sent may still wait to be drained. `PeerUnreachable` is for ranks
    /// that never were reachable (out of range, no route, connection refused).
    fn send(&self, to: u32, frame: Frame) -> Result<(), TransportError>;

    /// Writes an eager frame — the header for `envelope`, then the concatenation of `payload`
    /// — straight into the transport's buffer for world rank `to`, if it can go out at once
    /// that way (for shared memory: nothing queued for `to` and room in the ring). Returns
    /// `Ok(false)` otherwise, having done nothing: the caller then builds the frame and
    /// [`send`](Self::send)s it, which is always correct. `Err` as for `send`.
    ///
    /// This is the send side's short cut: a small message made of borrowed pieces (a
    /// collective's elements and its trailer byte) is copied once, into the ring, without a
    /// buffer of its own or a [`Frame`]. The default declines.
    fn send_eager(
        &self,
        to: u32,
        envelope: &Envelope,
        payload: &[&[u8]],
    ) -> Result<bool, TransportError> {
        let _ = (to, envelope, payload);
        Ok(false)
    }

    /// Whether an owned payload of `len` bytes for world rank `to` is better handed over as a
    /// [`Frame`] than written with [`send_eager`](Self::send_eager): the transport would let
    /// the receiver read it where it lies (shared memory's single copy to a receiver that is
    /// keeping up). A hint: either way is correct. The default says no.
    fn reads_in_place(&self, to: u32, len: usize) -> bool {
        let _ = (to, len);
        false
    }

    /// Moves what has arrived into `out`; returns how many were added. A transport may stop
    /// after a bounded batch as long as [`may_have_arrivals`](Self::may_have_arrivals) and
    /// [`poll_arrival`](Self::poll_arrival) still report the rest.
    fn drain(&self, out: &mut Vec<Arrival>) -> Result<usize, TransportError>;

    /// Registers the task to be woken when something may have arrived; `Ready` if something
    /// already has. Used by the progress engine before it parks.
    fn poll_arrival(&self, cx: &mut Context<'_>) -> Poll<()>;

    /// A cheap hint for busy pollers: `false` only if nothing can have arrived since the last
    /// [`drain`](Self::drain) — or, for a transport that needs a system call to know (UDP),
    /// once right after a drain that found nothing more: the poller's next look, or the
    /// progress task's readiness wake-up, then finds what came meanwhile. The default (always
    /// `true`) is correct for any transport.
    fn may_have_arrivals(&self) -> bool {
        true
    }

    /// Takes the next frame from world rank `want.from` where the transport holds it if it is
    /// the eager message `want` describes ([`EagerWant::accepts`]), without draining anything
    /// else; its payload is copied out and the frame consumed. Anything else is left where it
    /// is, and `None` returned.
    ///
    /// This is the receive side's short cut: a receive waiting for one sender copies its eager
    /// message straight out of the transport's buffer instead of the frame travelling through
    /// [`drain`](Self::drain), the arrival queue and matching. The frame looked at must be the
    /// one `drain` would deliver next from that sender, so per-sender order holds. A frame
    /// that cannot be looked at in place (one still arriving in pieces, a control record) is
    /// left for `drain`. The default takes nothing.
    ///
    /// With `into` (a receive into the caller's buffer, at least `want.max_len` bytes long) the
    /// payload is copied there, at its start, and [`EagerTaken::data`] stays empty: the message
    /// is copied once, from the transport to where the application wants it, with no buffer
    /// allocated for it on the way; a transport that holds a large eager message by reference
    /// to the sender's memory reads it straight there (shared memory's single copy).
    fn take_eager(&self, want: &EagerWant, into: Option<&mut [u8]>) -> Option<EagerTaken> {
        let _ = (want, into);
        None
    }

    /// Takes the next frame from `want.from` if it is all of receive `want.recv_id`'s data (one
    /// data frame at offset 0, `want.len` bytes) and this transport can put its payload
    /// straight into `into` (at least `want.len` bytes long) — shared memory reading it from
    /// the sender's memory — and returns whether it did. Anything else is left for
    /// [`drain`](Self::drain), as with [`take_eager`](Self::take_eager). The rendezvous
    /// counterpart of `take_eager`'s `into`: a large message received into the caller's buffer
    /// is copied once, not into a buffer of the transport's first. The default takes nothing.
    fn take_data(&self, want: &DataWant, into: &mut [u8]) -> bool {
        let _ = (want, into);
        false
    }

    /// A poller has started busy-polling this rank: the transport may skip waking the parked
    /// progress engine while at least one is active. Calls nest.
    fn begin_busy_poll(&self) {}

    /// A busy poller stopped (it ends every short burst; it may start again at once). The
    /// transport must make sure nothing that arrived meanwhile is left without someone to
    /// process it: wake the parked progress engine if anything is waiting, or (a transport
    /// whose wake-ups are costly for its peers) have it look again within a short bound.
    fn end_busy_poll(&self) {}

    /// A waiting future stopped busy-polling and parked: from now on only the progress engine
    /// will notice arrivals for it, so they must wake it promptly. Transports that keep their
    /// wake-up path switched off between busy-poll bursts switch it on here.
    fn waiter_parked(&self) {}

    /// This rank is shutting down: peers should learn it is gone (after everything it sent).
    fn close(&self) {}

    /// After [`close`](Self::close): whether the transport has finished delivering what it was
    /// given (everything acknowledged, the peers gone, or its linger time up). A process must
    /// not exit before, or its last messages may never arrive. The default (always `true`)
    /// fits transports that deliver synchronously.
    fn is_drained(&self) -> bool {
        true
    }

    /// A count that grows whenever data moves for this rank (for shared memory: records read
    /// from its rings, and queued records written as a peer frees ring space). A busy poller
    /// that sees it grow restarts its spin window, so a transfer longer than the window — a
    /// long frame going through in pieces — keeps both ranks polling instead of waking each
    /// other once per ring of pieces. The default (always 0) never restarts a window.
    fn traffic(&self) -> u64 {
        0
    }

    /// The transport's counters (reliability, routes, dropped datagrams). The default has none.
    fn stats(&self) -> TransportStats {
        TransportStats::default()
    }

    /// Whether this rank may read world rank `peer`'s memory with
    /// [`read_peer_memory`](Self::read_peer_memory): a peer on this host that the kernel lets
    /// this process inspect (shared memory with cross-memory attach). May connect to the peer
    /// to find out. The default says no.
    fn can_read_peer_memory(&self, peer: u32) -> bool {
        let _ = peer;
        false
    }

    /// Copies `dst.len()` bytes at address `addr` of world rank `peer`'s process into `dst`,
    /// without the peer taking part (one-sided, as an RDMA read). The caller arranges with the
    /// peer, by messages, that the bytes are there and stay unchanged until it is done. Only
    /// where [`can_read_peer_memory`](Self::can_read_peer_memory) says so; the default fails.
    ///
    /// `dst` may be uninitialized (a vector's spare capacity): on success every byte of it has
    /// been written; on failure any of them may or may not have been.
    fn read_peer_memory(
        &self,
        peer: u32,
        addr: u64,
        dst: &mut [MaybeUninit<u8>],
    ) -> Result<(), TransportError> {
        let _ = (peer, addr, dst);
        Err(TransportError::Unavailable {
            transport: "peer memory",
            reason: "this transport cannot read a peer's memory".into(),
        })
    }

    /// Whether this rank and world rank `peer` share [flags](Self::raise_flag): a peer on this
    /// host over shared memory. The default says no.
    fn has_flags_with(&self, peer: u32) -> bool {
        let _ = peer;
        false
    }

    /// Sets the flag this rank raises to world rank `peer` to `value`: one word per ordered
    /// pair of local ranks, in shared memory, that the peer reads with
    /// [`read_flag`](Self::read_flag) — a cache line's trip, where a message takes the whole
    /// send and receive path. Nothing wakes the peer: it looks. There is one flag per pair,
    /// not per communicator, so only one user may own it (the world communicator's barrier).
    /// Only where [`has_flags_with`](Self::has_flags_with) says so; the default fails.
    fn raise_flag(&self, peer: u32, value: u64) -> Result<(), TransportError> {
        let _ = (peer, value);
        Err(TransportError::Unavailable {
            transport: "flags",
            reason: "this transport has no flags".into(),
        })
    }

    /// The flag world rank `peer` raised to this rank (0 until it raises one), and whether
    /// `peer` is gone — looked at after the value, so a value raised before the peer went is
    /// still seen. Only where [`has_flags_with`](Self::has_flags_with) says so; the default
    /// fails.
    fn read_flag(&self, peer: u32) -> Result<PeerFlag, TransportError> {
        let _ = peer;
        Err(TransportError::Unavailable {
            transport: "flags",
            reason: "this transport has no flags".into(),
        })
    }

    /// This rank's [arena](crate::arena), if the transport has one and nobody holds it: shared
    /// memory the other local ranks can map and read with plain loads
    /// ([`peer_arena`](Self::peer_arena)). The default has none.
    fn lease_arena(&self) -> Option<ArenaLease> {
        None
    }

    /// World rank `peer`'s [arena](crate::arena) as mapped in this process, if the transport
    /// reaches it through shared memory and the peer is not gone. May connect to the peer. The
    /// default has none.
    fn peer_arena(&self, peer: u32) -> Option<PeerArena> {
        let _ = peer;
        None
    }

    /// Wakes `waker` once a flag raised to this rank changes (or a peer is found gone). The
    /// caller then calls [`waiter_parked`](Self::waiter_parked) and looks at its flags once
    /// more before it sleeps: a flag raised meanwhile is seen then. The default wakes it at
    /// once, so a waiter on a transport without flags polls instead of sleeping for good.
    fn park_on_flags(&self, waker: &std::task::Waker) {
        waker.wake_by_ref();
    }
}

/// What [`Transport::read_flag`] saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerFlag {
    /// The last value the peer raised (0: none yet).
    pub value: u64,
    /// The peer is gone: nothing more will be raised.
    pub peer_gone: bool,
}
