//! RC lane fail-back: the per-lane request / reply / confirm exchange over UD that replaces a
//! failed lane's queue pairs on both sides, as a sans-IO state machine, [`LaneReconnector`].
//!
//! A lane (one RC queue pair per side on one port) whose queue pair failed stays in the error
//! state for good; when the port comes back ([`PortChange::Up`](super::device_event::PortChange)),
//! the rank whose port was down makes a new queue pair for the lane (receive buffers posted,
//! fresh channel state and credits) and asks the peer to do the same:
//!
//! ```text
//!  requester (its port came back)                  responder
//!  LaneRequest { seq, lane, new QP }   ───────▶  Open: replaces its queue pair of the lane by
//!                                                a new one connected to the requester's
//!           ◀───────  LaneReply { seq, lane, its new QP }
//!  Connect + Established: the lane
//!  carries traffic again
//!  LaneConfirm { seq, lane }           ───────▶  Established: it sends on the lane again
//! ```
//!
//! The messages are [`CmMessage`] lane variants, carried like the connection messages (UD
//! datagrams on the carrier's side channel). As in [`super::connection_manager`]:
//!
//! * **Retransmission**: LaneRequest and LaneReply are sent again after
//!   [`CmConfig::retransmit`] (doubling), up to [`CmConfig::attempts`] sends, then
//!   [`LaneEvent::Failed`].
//! * **Duplicates**: a repeated LaneRequest from the same new queue pair gets the same
//!   LaneReply, a repeated LaneReply the same LaneConfirm; stale messages are ignored. A
//!   LaneRequest from a queue pair other than the one the lane is connected to means the peer
//!   replaced its queue pair again (its port flapped), so the lane is opened again.
//! * **Tie-break**: when both sides request for the same lane at once (both ports came back),
//!   the lower rank's request wins; the higher rank answers it with the new queue pair it had
//!   made for its own request.
//!
//! The driver (the adaptive transport) performs the [`LaneEvent`]s on its RC transport
//! (`RcTransport::reopen_lane`, `connect_lane`, `lane_established`), and calls
//! [`LaneReconnector::accepted`] with the new queue pair's address after an
//! [`LaneEvent::Open`].

use std::collections::VecDeque;
use std::time::Instant;

use rustc_hash::FxHashMap;

use super::connection_manager::{CmConfig, CmMessage};
use super::control_retry::{
    ControlCounters, ExchangeState, Expiry, RetryTimer, earliest_due, expire_due, normalized,
};
use super::provider::QpAddress;

/// What the driver must do for one lane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaneEvent {
    /// Replace this rank's queue pair of `lane` for `peer` by a new one (failing the old lane
    /// first if it still carries traffic) connected to `remote`, then call
    /// [`LaneReconnector::accepted`] with its address (or
    /// [`LaneReconnector::open_failed`]).
    Open {
        /// The peer.
        peer: u32,
        /// The lane.
        lane: u8,
        /// The peer's new queue pair of the lane.
        remote: QpAddress,
    },
    /// Connect this rank's new queue pair of `lane` (the one it requested with) to `remote`.
    Connect {
        /// The peer.
        peer: u32,
        /// The lane.
        lane: u8,
        /// The peer's new queue pair of the lane.
        remote: QpAddress,
    },
    /// Both new queue pairs are connected: this rank may send on the lane again.
    Established {
        /// The peer.
        peer: u32,
        /// The lane.
        lane: u8,
    },
    /// The attempt ran out of sends: the lane stays down.
    Failed {
        /// The peer.
        peer: u32,
        /// The lane.
        lane: u8,
    },
}

/// Counters of a [`LaneReconnector`].
pub type LaneCounters = ControlCounters;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// No exchange under way, and none completed since the lane last failed.
    Idle,
    /// This rank sent a LaneRequest with its new queue pair `local`.
    Requesting {
        seq: u32,
        local: QpAddress,
        retry: RetryTimer,
    },
    /// A LaneRequest came: the driver is making the new queue pair ([`LaneEvent::Open`]).
    Opening { seq: u32, remote: QpAddress },
    /// This rank answered with `local` and waits for the LaneConfirm.
    Accepting {
        seq: u32,
        local: QpAddress,
        remote: QpAddress,
        retry: RetryTimer,
    },
    /// Re-established by the attempt `seq`.
    Connected {
        seq: u32,
        local: QpAddress,
        remote: QpAddress,
    },
}

impl ExchangeState<(u32, u8)> for State {
    const IDLE: State = State::Idle;

    fn waiting(&mut self, (_, lane): (u32, u8)) -> Option<(&mut RetryTimer, CmMessage)> {
        match *self {
            State::Requesting {
                seq,
                local,
                ref mut retry,
            } => Some((
                retry,
                CmMessage::LaneRequest {
                    seq,
                    lane,
                    qp: local,
                },
            )),
            State::Accepting {
                seq,
                local,
                ref mut retry,
                ..
            } => Some((
                retry,
                CmMessage::LaneReply {
                    seq,
                    lane,
                    qp: local,
                },
            )),
            _ => None,
        }
    }
}

/// The lane fail-back exchanges of one rank with all its peers (see the
/// [module docs](self)).
#[derive(Debug)]
pub struct LaneReconnector {
    rank: u32,
    config: CmConfig,
    lanes: FxHashMap<(u32, u8), State>,
    next_seq: FxHashMap<(u32, u8), u32>,
    transmits: VecDeque<(u32, CmMessage)>,
    events: VecDeque<LaneEvent>,
    counters: LaneCounters,
}

impl LaneReconnector {
    /// The reconnector of world rank `rank`.
    pub fn new(rank: u32, config: CmConfig) -> LaneReconnector {
        LaneReconnector {
            rank,
            config: normalized(config),
            lanes: FxHashMap::default(),
            next_seq: FxHashMap::default(),
            transmits: VecDeque::new(),
            events: VecDeque::new(),
            counters: LaneCounters::default(),
        }
    }

    /// Its counters.
    pub fn counters(&self) -> LaneCounters {
        self.counters
    }

    fn state(&self, peer: u32, lane: u8) -> State {
        self.lanes
            .get(&(peer, lane))
            .copied()
            .unwrap_or(State::Idle)
    }

    /// Whether an exchange for `lane` with `peer` is under way.
    pub fn is_busy(&self, peer: u32, lane: u8) -> bool {
        matches!(
            self.state(peer, lane),
            State::Requesting { .. } | State::Opening { .. } | State::Accepting { .. }
        )
    }

    fn send(&mut self, peer: u32, m: CmMessage) {
        self.counters.count_sent(&m);
        self.transmits.push_back((peer, m));
    }

    /// Starts re-establishing `lane` with `peer`, whose new queue pair on this rank is
    /// `local` (made by the driver, receive buffers posted, not connected). Does nothing while
    /// an exchange for the lane is under way, or for this rank itself; returns whether it
    /// started.
    pub fn start(&mut self, now: Instant, peer: u32, lane: u8, local: QpAddress) -> bool {
        if peer == self.rank || self.is_busy(peer, lane) {
            return false;
        }
        let next = self.next_seq.entry((peer, lane)).or_insert(1);
        let seq = *next;
        *next = next.wrapping_add(1).max(1);
        self.lanes.insert(
            (peer, lane),
            State::Requesting {
                seq,
                local,
                retry: RetryTimer::started(now, &self.config),
            },
        );
        self.send(
            peer,
            CmMessage::LaneRequest {
                seq,
                lane,
                qp: local,
            },
        );
        true
    }

    /// Takes in a message from `peer` (connection messages are ignored).
    pub fn handle_message(&mut self, now: Instant, peer: u32, m: CmMessage) {
        if peer == self.rank {
            return;
        }
        match m {
            CmMessage::LaneRequest { seq, lane, qp } => self.on_request(now, peer, lane, seq, qp),
            CmMessage::LaneReply { seq, lane, qp } => self.on_reply(peer, lane, seq, qp),
            CmMessage::LaneConfirm { seq, lane } => match self.state(peer, lane) {
                State::Accepting {
                    seq: mine,
                    local,
                    remote,
                    ..
                } if seq == mine => self.established(peer, lane, seq, local, remote),
                _ => self.counters.duplicates += 1,
            },
            _ => {}
        }
    }

    fn on_request(&mut self, now: Instant, peer: u32, lane: u8, seq: u32, remote: QpAddress) {
        let reply = |local| CmMessage::LaneReply {
            seq,
            lane,
            qp: local,
        };
        match self.state(peer, lane) {
            State::Requesting { .. } if self.rank < peer => {
                // Both asked at once: ours wins, the peer will answer it.
                self.counters.ties_won += 1;
            }
            State::Requesting { local, .. } => {
                // The peer's request wins: answer it with the queue pair made for ours.
                self.counters.ties_lost += 1;
                self.events
                    .push_back(LaneEvent::Connect { peer, lane, remote });
                self.accepting(now, peer, lane, seq, local, remote);
            }
            State::Opening { remote: r, .. } if r == remote => {
                // The driver is still making the queue pair; the answer follows.
                self.counters.duplicates += 1;
            }
            State::Accepting {
                local, remote: r, ..
            }
            | State::Connected {
                local, remote: r, ..
            } if r == remote => {
                // Our LaneReply was lost or is late, or the requester gave up and asked again
                // with the same queue pair: answer again (under its newest attempt number).
                self.counters.duplicates += 1;
                self.send(peer, reply(local));
                if let Some(State::Accepting { seq: s, .. } | State::Connected { seq: s, .. }) =
                    self.lanes.get_mut(&(peer, lane))
                {
                    *s = seq;
                }
            }
            _ => {
                // A new queue pair of the peer: this side needs a new one too.
                self.lanes
                    .insert((peer, lane), State::Opening { seq, remote });
                self.events
                    .push_back(LaneEvent::Open { peer, lane, remote });
            }
        }
    }

    fn on_reply(&mut self, peer: u32, lane: u8, seq: u32, remote: QpAddress) {
        match self.state(peer, lane) {
            State::Requesting {
                seq: mine, local, ..
            } if seq == mine => {
                self.events
                    .push_back(LaneEvent::Connect { peer, lane, remote });
                self.established(peer, lane, seq, local, remote);
                self.send(peer, CmMessage::LaneConfirm { seq, lane });
            }
            State::Connected {
                seq: mine,
                remote: r,
                ..
            } if seq == mine && r == remote => {
                // Our LaneConfirm was lost: the responder still waits for one.
                self.counters.duplicates += 1;
                self.send(peer, CmMessage::LaneConfirm { seq, lane });
            }
            _ => self.counters.duplicates += 1,
        }
    }

    /// The driver made the new queue pair `local` of `lane` for `peer` after
    /// [`LaneEvent::Open`], connected to the peer's: answer the request.
    pub fn accepted(&mut self, now: Instant, peer: u32, lane: u8, local: QpAddress) {
        if let State::Opening { seq, remote } = self.state(peer, lane) {
            self.accepting(now, peer, lane, seq, local, remote);
        }
    }

    /// The driver could not make the queue pair after [`LaneEvent::Open`] (its port is still
    /// down, say): the request goes unanswered; the peer retransmits it.
    pub fn open_failed(&mut self, peer: u32, lane: u8) {
        if matches!(self.state(peer, lane), State::Opening { .. }) {
            self.counters.failed += 1;
            self.lanes.insert((peer, lane), State::Idle);
        }
    }

    fn accepting(
        &mut self,
        now: Instant,
        peer: u32,
        lane: u8,
        seq: u32,
        local: QpAddress,
        remote: QpAddress,
    ) {
        self.lanes.insert(
            (peer, lane),
            State::Accepting {
                seq,
                local,
                remote,
                retry: RetryTimer::started(now, &self.config),
            },
        );
        self.send(
            peer,
            CmMessage::LaneReply {
                seq,
                lane,
                qp: local,
            },
        );
    }

    fn established(&mut self, peer: u32, lane: u8, seq: u32, local: QpAddress, remote: QpAddress) {
        self.counters.established += 1;
        self.lanes
            .insert((peer, lane), State::Connected { seq, local, remote });
        self.events.push_back(LaneEvent::Established { peer, lane });
    }

    /// The earliest retransmission deadline, if any exchange is under way.
    pub fn poll_timeout(&self) -> Option<Instant> {
        earliest_due(&self.lanes)
    }

    /// Retransmits what is due, and fails exchanges that ran out of sends.
    pub fn handle_timeout(&mut self, now: Instant) {
        for expiry in expire_due(&mut self.lanes, now, &self.config, &mut self.counters) {
            match expiry {
                Expiry::Resend((peer, _), message) => self.send(peer, message),
                Expiry::GiveUp((peer, lane)) => {
                    self.events.push_back(LaneEvent::Failed { peer, lane });
                }
            }
        }
    }

    /// The next message to send, and to which peer.
    pub fn poll_transmit(&mut self) -> Option<(u32, CmMessage)> {
        self.transmits.pop_front()
    }

    /// The next thing the driver must do.
    pub fn poll_event(&mut self) -> Option<LaneEvent> {
        self.events.pop_front()
    }
}

#[cfg(test)]
#[path = "lane_reconnect_tests.rs"]
mod tests;
