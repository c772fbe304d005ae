//! On-demand RC connection set-up over UD (Yu, ch. 3): the request / reply / confirm exchange
//! as a sans-IO state machine, [`ConnectionManager`].
//!
//! Every rank starts with one UD queue pair and no RC connection. When the driver decides a
//! peer deserves one (its traffic passed the threshold, or a frame too large for UD waits), it
//! creates the RC queue pair for that peer and calls [`ConnectionManager::start`]:
//!
//! ```text
//!  requester                                   responder
//!  Request { seq, requester's RC QP }  ───────▶  connect its QP to it (RTR/RTS)
//!           ◀───────  Reply { seq, responder's RC QP }
//!  connect its QP, may send on RC now
//!  Confirm { seq }                     ───────▶  may send on RC now
//! ```
//!
//! * **Retransmission**: the requester resends its Request, and the responder its Reply, after
//!   [`CmConfig::retransmit`] (doubling each time), up to [`CmConfig::attempts`] sends; then
//!   the attempt ends with [`CmEvent::Failed`].
//! * **Sequence numbers**: every attempt of a requester has a new `seq`; answers carry it.
//!   Duplicates are answered idempotently (a repeated Request gets the same Reply, a repeated
//!   Reply the same Confirm) and stale ones are ignored, so lost, duplicated or reordered UD
//!   control messages never make two connections or a half-open one.
//! * **Tie-break**: when both ranks request at once, the lower rank's request wins: the lower
//!   rank ignores the higher one's Request, the higher rank abandons its own attempt and
//!   answers as responder, reusing the RC queue pair it had made (one per peer).
//!
//! The machine never touches a queue pair or a clock: the driver passes the time and its RC
//! queue pair's address in, and performs the [`CmEvent`]s and sends the [`CmMessage`]s it
//! gets out (`poll_event`, `poll_transmit`, `poll_timeout`).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;

use super::control_retry::{
    ControlCounters, ExchangeState, Expiry, RetryTimer, earliest_due, expire_due, normalized,
};
use super::provider::QpAddress;
use super::rc::RcAddress;

/// Settings of the connection set-up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CmConfig {
    /// Wait before the first retransmission of a Request or Reply (doubled after each).
    pub retransmit: Duration,
    /// Sends of a Request (or Reply) before the attempt fails; at least 1.
    pub attempts: u32,
}

impl Default for CmConfig {
    fn default() -> Self {
        CmConfig {
            retransmit: Duration::from_millis(20),
            attempts: 8,
        }
    }
}

/// A connection-management message, carried in one UD datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CmMessage {
    /// "Connect your RC queue pair for me to this one."
    Request {
        /// The requester's attempt number.
        seq: u32,
        /// The requester's RC queue pair for the responder.
        qp: RcAddress,
    },
    /// "Done; connect yours to mine."
    Reply {
        /// The Request's `seq`.
        seq: u32,
        /// The responder's RC queue pair for the requester.
        qp: RcAddress,
    },
    /// "Connected: you may send on RC."
    Confirm {
        /// The Request's `seq`.
        seq: u32,
    },
    /// "My queue pair of lane `lane` failed; connect a new one of yours to this new one of
    /// mine" (lane fail-back, see [`super::lane_reconnect`]).
    LaneRequest {
        /// The requester's attempt number (per peer and lane).
        seq: u32,
        /// The lane.
        lane: u8,
        /// The requester's new queue pair of that lane.
        qp: QpAddress,
    },
    /// "Done; connect yours to my new one."
    LaneReply {
        /// The LaneRequest's `seq`.
        seq: u32,
        /// The lane.
        lane: u8,
        /// The responder's new queue pair of that lane.
        qp: QpAddress,
    },
    /// "Connected: the lane carries traffic again."
    LaneConfirm {
        /// The LaneRequest's `seq`.
        seq: u32,
        /// The lane.
        lane: u8,
    },
}

/// Why a connection-management message could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CmDecodeError {
    /// Fewer bytes than the message needs.
    #[error("connection message truncated: {len} bytes, {need} needed")]
    Truncated {
        /// Bytes received.
        len: usize,
        /// Bytes the message needs.
        need: usize,
    },
    /// Not a connection message of this protocol version.
    #[error("not a connection message (magic {0:02x?})")]
    BadMagic([u8; 3]),
    /// An unknown message kind.
    #[error("unknown connection message kind {0}")]
    UnknownKind(u8),
    /// A lane count of zero or beyond the most lanes a connection spans.
    #[error("connection message with {0} lanes")]
    BadLaneCount(u8),
    /// A lane message naming a lane beyond the most lanes a connection spans.
    #[error("lane message for lane {0}")]
    BadLane(u8),
}

const MAGIC: [u8; 3] = *b"CM1";
const KIND_REQUEST: u8 = 1;
const KIND_REPLY: u8 = 2;
const KIND_CONFIRM: u8 = 3;
const KIND_LANE_REQUEST: u8 = 4;
const KIND_LANE_REPLY: u8 = 5;
const KIND_LANE_CONFIRM: u8 = 6;
/// magic, kind, seq.
const HEADER_LEN: usize = 3 + 1 + 4;
/// A lane count, then per lane: lid, gid, qpn.
const ADDRESS_LEN: usize = RcAddress::MAX_ENCODED_LEN;

impl CmMessage {
    /// The longest encoding.
    pub const MAX_LEN: usize = HEADER_LEN + ADDRESS_LEN;

    /// Whether it is a lane message (fail-back of one lane), not a connection message.
    pub fn is_lane_message(&self) -> bool {
        matches!(
            self,
            CmMessage::LaneRequest { .. }
                | CmMessage::LaneReply { .. }
                | CmMessage::LaneConfirm { .. }
        )
    }

    /// Appends the message's bytes to `out`: magic, kind, `seq`, then for a connection
    /// Request or Reply its [`RcAddress`], for a lane message the lane (one byte) and, in a
    /// LaneRequest or LaneReply, the new queue pair's [`QpAddress`].
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&MAGIC);
        let (kind, seq) = match *self {
            CmMessage::Request { seq, .. } => (KIND_REQUEST, seq),
            CmMessage::Reply { seq, .. } => (KIND_REPLY, seq),
            CmMessage::Confirm { seq } => (KIND_CONFIRM, seq),
            CmMessage::LaneRequest { seq, .. } => (KIND_LANE_REQUEST, seq),
            CmMessage::LaneReply { seq, .. } => (KIND_LANE_REPLY, seq),
            CmMessage::LaneConfirm { seq, .. } => (KIND_LANE_CONFIRM, seq),
        };
        out.push(kind);
        out.extend_from_slice(&seq.to_le_bytes());
        match self {
            CmMessage::Request { qp, .. } | CmMessage::Reply { qp, .. } => qp.encode(out),
            CmMessage::Confirm { .. } => {}
            CmMessage::LaneRequest { lane, qp, .. } | CmMessage::LaneReply { lane, qp, .. } => {
                out.push(*lane);
                qp.encode(out);
            }
            CmMessage::LaneConfirm { lane, .. } => out.push(*lane),
        }
    }

    /// Decodes a message.
    pub fn decode(bytes: &[u8]) -> Result<CmMessage, CmDecodeError> {
        let truncated = |need| CmDecodeError::Truncated {
            len: bytes.len(),
            need,
        };
        if bytes.len() < HEADER_LEN {
            return Err(truncated(HEADER_LEN));
        }
        let magic = [bytes[0], bytes[1], bytes[2]];
        if magic != MAGIC {
            return Err(CmDecodeError::BadMagic(magic));
        }
        let kind = bytes[3];
        let seq = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
        let address = || {
            let count = *bytes
                .get(HEADER_LEN)
                .ok_or_else(|| truncated(HEADER_LEN + 1))?;
            if count == 0 || usize::from(count) > super::stream::MAX_LANES {
                return Err(CmDecodeError::BadLaneCount(count));
            }
            RcAddress::decode(&bytes[HEADER_LEN..])
                .map(|(a, _)| a)
                .ok_or_else(|| truncated(HEADER_LEN + 1 + 22 * usize::from(count)))
        };
        let lane = || {
            let lane = *bytes
                .get(HEADER_LEN)
                .ok_or_else(|| truncated(HEADER_LEN + 1))?;
            if usize::from(lane) >= super::stream::MAX_LANES {
                return Err(CmDecodeError::BadLane(lane));
            }
            Ok(lane)
        };
        let lane_address = || {
            let need = HEADER_LEN + 1 + QpAddress::ENCODED_LEN;
            bytes
                .get(HEADER_LEN + 1..need)
                .and_then(QpAddress::decode)
                .ok_or_else(|| truncated(need))
        };
        match kind {
            KIND_LANE_REQUEST => Ok(CmMessage::LaneRequest {
                seq,
                lane: lane()?,
                qp: lane_address()?,
            }),
            KIND_LANE_REPLY => Ok(CmMessage::LaneReply {
                seq,
                lane: lane()?,
                qp: lane_address()?,
            }),
            KIND_LANE_CONFIRM => Ok(CmMessage::LaneConfirm { seq, lane: lane()? }),
            KIND_REQUEST => Ok(CmMessage::Request {
                seq,
                qp: address()?,
            }),
            KIND_REPLY => Ok(CmMessage::Reply {
                seq,
                qp: address()?,
            }),
            KIND_CONFIRM => Ok(CmMessage::Confirm { seq }),
            k => Err(CmDecodeError::UnknownKind(k)),
        }
    }
}

/// What the driver must do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CmEvent {
    /// Connect this rank's RC queue pair for `peer` to `remote` (it must already exist; the
    /// driver ignores a repeat with the same `remote`).
    Connect {
        /// The peer.
        peer: u32,
        /// The peer's RC queue pair for this rank.
        remote: RcAddress,
    },
    /// Both queue pairs are connected: this rank may send to `peer` over RC.
    Established {
        /// The peer.
        peer: u32,
    },
    /// The attempt ran out of retransmissions: traffic to `peer` stays on UD.
    Failed {
        /// The peer.
        peer: u32,
    },
}

/// Counters of a [`ConnectionManager`].
pub type CmCounters = ControlCounters;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PeerState {
    /// No connection and no attempt.
    Idle,
    /// This rank sent a Request and waits for the Reply.
    Requesting {
        seq: u32,
        local: RcAddress,
        retry: RetryTimer,
    },
    /// This rank answered a Request and waits for the Confirm.
    Accepting {
        seq: u32,
        local: RcAddress,
        remote: RcAddress,
        retry: RetryTimer,
    },
    /// Connected (as requester or responder) by the attempt `seq`.
    Connected {
        seq: u32,
        local: RcAddress,
        remote: RcAddress,
    },
}

impl ExchangeState<u32> for PeerState {
    const IDLE: PeerState = PeerState::Idle;

    fn waiting(&mut self, _peer: u32) -> Option<(&mut RetryTimer, CmMessage)> {
        match *self {
            PeerState::Requesting {
                seq,
                local,
                ref mut retry,
            } => Some((retry, CmMessage::Request { seq, qp: local })),
            PeerState::Accepting {
                seq,
                local,
                ref mut retry,
                ..
            } => Some((retry, CmMessage::Reply { seq, qp: local })),
            _ => None,
        }
    }
}

/// The connection set-up of one rank with all its peers (see the [module docs](self)).
#[derive(Debug)]
pub struct ConnectionManager {
    rank: u32,
    config: CmConfig,
    peers: FxHashMap<u32, PeerState>,
    /// The next attempt number per peer (this rank as requester).
    next_seq: FxHashMap<u32, u32>,
    transmits: VecDeque<(u32, CmMessage)>,
    events: VecDeque<CmEvent>,
    counters: CmCounters,
}

impl ConnectionManager {
    /// The manager of world rank `rank`.
    pub fn new(rank: u32, config: CmConfig) -> ConnectionManager {
        ConnectionManager {
            rank,
            config: normalized(config),
            peers: FxHashMap::default(),
            next_seq: FxHashMap::default(),
            transmits: VecDeque::new(),
            events: VecDeque::new(),
            counters: CmCounters::default(),
        }
    }

    /// Its counters.
    pub fn counters(&self) -> CmCounters {
        self.counters
    }

    fn state(&self, peer: u32) -> PeerState {
        self.peers.get(&peer).copied().unwrap_or(PeerState::Idle)
    }

    /// Whether this rank is connected to `peer` (it may send over RC).
    pub fn is_connected(&self, peer: u32) -> bool {
        matches!(self.state(peer), PeerState::Connected { .. })
    }

    /// Whether an attempt with `peer` is under way (requesting or accepting).
    pub fn is_connecting(&self, peer: u32) -> bool {
        matches!(
            self.state(peer),
            PeerState::Requesting { .. } | PeerState::Accepting { .. }
        )
    }

    /// Starts connecting to `peer`, whose RC queue pair on this rank is `local`. Does nothing
    /// when connected or connecting already, or when `peer` is this rank.
    pub fn start(&mut self, now: Instant, peer: u32, local: RcAddress) {
        if peer == self.rank || !matches!(self.state(peer), PeerState::Idle) {
            return;
        }
        let next = self.next_seq.entry(peer).or_insert(1);
        let seq = *next;
        *next = next.wrapping_add(1).max(1);
        self.peers.insert(
            peer,
            PeerState::Requesting {
                seq,
                local,
                retry: RetryTimer::started(now, &self.config),
            },
        );
        self.send(peer, CmMessage::Request { seq, qp: local });
    }

    fn send(&mut self, peer: u32, m: CmMessage) {
        // Lane messages are the lane reconnector's; this manager makes none.
        self.counters.count_sent(&m);
        self.transmits.push_back((peer, m));
    }

    /// Takes in a message from `peer`; `local` is this rank's RC queue pair for `peer` (the
    /// driver creates it, if it did not exist, before passing a Request or Reply in). Lane
    /// messages belong to a [`LaneReconnector`](super::lane_reconnect::LaneReconnector) and
    /// are ignored here.
    pub fn handle_message(&mut self, now: Instant, peer: u32, local: RcAddress, m: CmMessage) {
        if peer == self.rank || m.is_lane_message() {
            return;
        }
        match (m, self.state(peer)) {
            (CmMessage::Request { seq, qp: remote }, state) => {
                self.on_request(now, peer, local, seq, remote, state)
            }
            (CmMessage::Reply { seq, qp: remote }, PeerState::Requesting { seq: mine, .. })
                if seq == mine =>
            {
                self.events.push_back(CmEvent::Connect { peer, remote });
                self.established(peer, seq, local, remote);
                self.send(peer, CmMessage::Confirm { seq });
            }
            (CmMessage::Reply { seq, .. }, PeerState::Connected { seq: mine, .. })
                if seq == mine =>
            {
                // Our Confirm was lost: the responder still waits for one.
                self.counters.duplicates += 1;
                self.send(peer, CmMessage::Confirm { seq });
            }
            (
                CmMessage::Confirm { seq },
                PeerState::Accepting {
                    seq: mine,
                    local,
                    remote,
                    ..
                },
            ) if seq == mine => self.established(peer, seq, local, remote),
            _ => self.counters.duplicates += 1,
        }
    }

    fn on_request(
        &mut self,
        now: Instant,
        peer: u32,
        local: RcAddress,
        seq: u32,
        remote: RcAddress,
        state: PeerState,
    ) {
        match state {
            PeerState::Requesting { .. } if self.rank < peer => {
                // Both asked at once: ours wins, the peer will answer it.
                self.counters.ties_won += 1;
                return;
            }
            PeerState::Requesting { .. } => self.counters.ties_lost += 1,
            PeerState::Accepting { seq: s, local, .. } if s == seq => {
                // Our Reply was lost or is late: answer again.
                self.counters.duplicates += 1;
                self.send(peer, CmMessage::Reply { seq, qp: local });
                return;
            }
            PeerState::Connected {
                local, remote: r, ..
            } if r == remote => {
                // A late duplicate, or the requester lost our Reply, gave up and asked again
                // with the same queue pair: the connection stands, answer again.
                self.counters.duplicates += 1;
                self.send(peer, CmMessage::Reply { seq, qp: local });
                if let Some(PeerState::Connected { seq: s, .. }) = self.peers.get_mut(&peer) {
                    *s = seq;
                }
                return;
            }
            _ => {}
        }
        self.events.push_back(CmEvent::Connect { peer, remote });
        self.peers.insert(
            peer,
            PeerState::Accepting {
                seq,
                local,
                remote,
                retry: RetryTimer::started(now, &self.config),
            },
        );
        self.send(peer, CmMessage::Reply { seq, qp: local });
    }

    fn established(&mut self, peer: u32, seq: u32, local: RcAddress, remote: RcAddress) {
        self.counters.established += 1;
        self.peers
            .insert(peer, PeerState::Connected { seq, local, remote });
        self.events.push_back(CmEvent::Established { peer });
    }

    /// The earliest retransmission deadline, if any attempt is under way.
    pub fn poll_timeout(&self) -> Option<Instant> {
        earliest_due(&self.peers)
    }

    /// Retransmits what is due, and fails attempts that ran out of sends.
    pub fn handle_timeout(&mut self, now: Instant) {
        for expiry in expire_due(&mut self.peers, now, &self.config, &mut self.counters) {
            match expiry {
                Expiry::Resend(peer, message) => self.send(peer, message),
                Expiry::GiveUp(peer) => self.events.push_back(CmEvent::Failed { peer }),
            }
        }
    }

    /// The next message to send, and to which peer.
    pub fn poll_transmit(&mut self) -> Option<(u32, CmMessage)> {
        self.transmits.pop_front()
    }

    /// The next thing the driver must do.
    pub fn poll_event(&mut self) -> Option<CmEvent> {
        self.events.pop_front()
    }
}

#[cfg(test)]
#[path = "connection_manager_tests.rs"]
mod tests;
