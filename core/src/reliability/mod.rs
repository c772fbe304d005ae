//! End-to-end reliability over an unreliable transport, as a sans-IO state machine per peer
//! (LA-MPI's reliability layer; quinn-proto's style).
//!
//! A [`ReliableLink`] sits between the message protocol and a transport that may lose,
//! duplicate, reorder or corrupt packets (UDP). It never touches a socket or a clock: the caller
//! passes the time in (`now: Instant`) and moves the [`Packet`]s.
//!
//! * [`packet`]: the link packet (DATA with a 64-bit sequence number, ACK with cumulative and
//!   selective information and an optional NACK), CRC32C over header and payload, the codec.
//! * [`rtt`]: [`RttEstimator`], smoothed round-trip time and the retransmission timeout.
//! * [`retransmit`]: [`RetransmitQueue`], unacknowledged packets and the rules that send them
//!   again (NACK, loss detection from later ACKs, timeout with truncated exponential backoff).
//! * [`receive_window`]: [`ReceiveWindow`], duplicate suppression, reordering, in-order delivery.
//!
//! # Driving a link
//!
//! ```text
//! app:        link.send(now, payload)                 link.poll_deliver() -> payload
//! arrivals:   Packet::decode(bytes, key) -> Ok(p)  => link.handle_packet(now, p)
//!                                        -> Err(CrcMismatch { seq, .. }) => link.handle_corrupt(now, seq)
//! outgoing:   while let Some(p) = link.poll_transmit(now) { transport.send(p.encode()) }
//! timer:      at link.poll_timeout() => link.handle_timeout(now)
//! events:     link.poll_event() -> LinkEvent::PeerDead
//! ```
//!
//! After every `handle_*` and `send` call, drain [`poll_transmit`](ReliableLink::poll_transmit)
//! and re-arm the timer from [`poll_timeout`](ReliableLink::poll_timeout).
//!
//! # Rules
//!
//! * **Sender window.** At most [`LinkConfig::window`] DATA packets are unacknowledged, and only
//!   sequence numbers below the receiver's advertised window end are sent (the receiver counts
//!   packets its application has not taken yet): a slow receiver is not flooded. When the peer's
//!   window is closed and nothing is in flight, one packet goes out anyway as a window probe; it
//!   is retransmitted on the usual timer and the answering ACK reopens the window.
//! * **Acknowledgements.** The receiver acknowledges after every
//!   [`ack_frequency`](LinkConfig::ack_frequency) in-order DATA packets or
//!   [`ack_delay`](LinkConfig::ack_delay) after the first unacknowledged one, whichever comes
//!   first, and at once after an out-of-order packet, a duplicate, a packet beyond the window or
//!   a corrupted packet (which it NACKs). An ACK carries the highest in-order sequence number,
//!   a bitmap of those received beyond it, and the window end.
//! * **Retransmission**: see [`retransmit`]. The peer is declared dead
//!   ([`LinkEvent::PeerDead`]) when the oldest packet timed out
//!   [`retry_limit`](LinkConfig::retry_limit) times in a row without any ACK from the peer.

pub mod packet;
pub mod receive_window;
pub mod retransmit;
pub mod rtt;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::Bytes;

pub use packet::{AckInfo, Packet, PacketBody, PacketError};
pub use receive_window::{Arrival, ReceiveWindow};
pub use retransmit::{RetransmitQueue, TimeoutOutcome};
pub use rtt::RttEstimator;

/// Settings of a [`ReliableLink`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkConfig {
    /// Most unacknowledged DATA packets at the sender, and most packets a receiver holds (out of
    /// order or not yet taken by the application). Default 256; clamped to `1..=65536`.
    pub window: u32,
    /// Retransmission timeout before the first RTT sample. Default 10 ms.
    pub initial_rto: Duration,
    /// Smallest retransmission timeout. Default 2 ms. Keep it above
    /// [`ack_delay`](Self::ack_delay), or delayed ACKs cause spurious retransmissions.
    pub min_rto: Duration,
    /// Largest retransmission timeout (before backoff). Default 1 s.
    pub max_rto: Duration,
    /// Backoff exponent cap: a timer runs at most `RTO × 2^max_backoff`. Default 8 (×256).
    pub max_backoff: u32,
    /// Timeouts in a row, without any ACK from the peer, after which the peer is declared dead.
    /// Default 16: with the other defaults, about 5 s of silence at the 2 ms minimum RTO and
    /// about 26 s at the 10 ms initial RTO.
    pub retry_limit: u32,
    /// Send an ACK after this many in-order DATA packets. Default 2; 1 acknowledges every packet.
    pub ack_frequency: u32,
    /// Send an ACK at the latest this long after an unacknowledged DATA packet arrived.
    /// Default 500 µs.
    pub ack_delay: Duration,
}

impl Default for LinkConfig {
    fn default() -> Self {
        Self {
            window: 256,
            initial_rto: Duration::from_millis(10),
            min_rto: Duration::from_millis(2),
            max_rto: Duration::from_secs(1),
            max_backoff: 8,
            retry_limit: 16,
            ack_frequency: 2,
            ack_delay: Duration::from_micros(500),
        }
    }
}

/// What a link reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkEvent {
    /// The peer stopped answering: retry limit reached. The link sends no more DATA.
    PeerDead {
        /// The peer's rank.
        rank: u32,
    },
}

/// Counters of one link.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// DATA packets sent for the first time.
    pub sent: u64,
    /// DATA packets sent again (NACK, loss detection or timeout).
    pub retransmitted: u64,
    /// ACKs that showed a retransmission was not needed (the packet was only delayed); each
    /// one widens the link's reordering allowance.
    pub spurious_retransmissions: u64,
    /// Retransmission timer expiries.
    pub timeouts: u64,
    /// Payloads handed to the application.
    pub delivered: u64,
    /// Arriving DATA packets dropped as duplicates.
    pub duplicates_dropped: u64,
    /// Arriving DATA packets dropped because they were beyond the receive window.
    pub out_of_window_dropped: u64,
    /// Packets that failed the CRC check (reported with [`ReliableLink::handle_corrupt`]).
    pub crc_failures: u64,
    /// NACKs sent.
    pub nacks_sent: u64,
    /// NACKs received.
    pub nacks_received: u64,
    /// ACK packets sent.
    pub acks_sent: u64,
    /// ACK packets received.
    pub acks_received: u64,
    /// Packets dropped because their source or destination rank is not this link's.
    pub misaddressed_dropped: u64,
}

/// When to acknowledge.
#[derive(Clone, Debug)]
struct AckState {
    /// In-order DATA packets since the last ACK.
    pending: u32,
    /// Latest time for the next ACK, while `pending > 0`.
    deadline: Option<Instant>,
    /// Acknowledge at the next poll.
    immediate: bool,
    /// Sequence number to NACK in the next ACK.
    nack: Option<u64>,
    /// The window end in the last ACK sent.
    advertised_end: u64,
}

/// The reliable link from this rank to one peer (see the [module docs](self)).
#[derive(Debug)]
pub struct ReliableLink {
    config: LinkConfig,
    job_key: u64,
    local: u32,
    peer: u32,
    rtt: RttEstimator,
    sent: RetransmitQueue,
    received: ReceiveWindow,
    unsent: VecDeque<Bytes>,
    next_seq: u64,
    peer_window_end: u64,
    ack: AckState,
    events: VecDeque<LinkEvent>,
    stats: LinkStats,
    dead: bool,
    /// Reordering allowance, in quarters added to the loss delay; grows on each spurious
    /// retransmission (up to [`MAX_REORDER_QUARTERS`]).
    reorder_quarters: u32,
}

/// Cap of the reordering allowance: the loss delay grows to at most 4× its base.
pub const MAX_REORDER_QUARTERS: u32 = 12;

impl ReliableLink {
    /// The link from rank `local` to rank `peer` of the job `job_key`.
    pub fn new(config: LinkConfig, job_key: u64, local: u32, peer: u32) -> Self {
        let window = config.window.clamp(1, 65536);
        let config = LinkConfig { window, ..config };
        let received = ReceiveWindow::new(u64::from(window));
        let initial_end = received.window_end();
        Self {
            rtt: RttEstimator::new(config.initial_rto, config.min_rto, config.max_rto),
            sent: RetransmitQueue::new(),
            received,
            unsent: VecDeque::new(),
            next_seq: 1,
            peer_window_end: initial_end,
            ack: AckState {
                pending: 0,
                deadline: None,
                immediate: false,
                nack: None,
                advertised_end: initial_end,
            },
            events: VecDeque::new(),
            stats: LinkStats::default(),
            dead: false,
            reorder_quarters: 0,
            config,
            job_key,
            local,
            peer,
        }
    }

    /// The link's settings (window clamped).
    pub fn config(&self) -> &LinkConfig {
        &self.config
    }

    /// The peer's rank.
    pub fn peer(&self) -> u32 {
        self.peer
    }

    /// The link's counters.
    pub fn stats(&self) -> LinkStats {
        self.stats
    }

    /// The round-trip estimate.
    pub fn rtt(&self) -> &RttEstimator {
        &self.rtt
    }

    /// DATA packets sent and not yet acknowledged.
    pub fn in_flight(&self) -> usize {
        self.sent.len()
    }

    /// Payloads queued by [`send`](Self::send) and not yet sent.
    pub fn queued(&self) -> usize {
        self.unsent.len()
    }

    /// Packets the receiving side holds (out of order, or in order but not yet delivered).
    pub fn held(&self) -> usize {
        self.received.held()
    }

    /// Whether the peer was declared dead.
    pub fn is_dead(&self) -> bool {
        self.dead
    }

    /// Whether everything sent was acknowledged and nothing waits to be sent.
    pub fn is_idle(&self) -> bool {
        self.unsent.is_empty() && self.sent.is_empty()
    }

    /// Queues `payload` for reliable, in-order delivery to the peer. It goes out from
    /// [`poll_transmit`](Self::poll_transmit) when the window allows (never, once the peer is
    /// dead).
    pub fn send(&mut self, _now: Instant, payload: Bytes) {
        self.unsent.push_back(payload);
    }

    /// How long a packet sent before an acknowledged one may be out before it counts as lost:
    /// `max(9/8·max(SRTT, latest RTT), SRTT + 4·RTTVAR)`, stretched by a quarter for each
    /// spurious retransmission seen so far (up to 4×, as RACK's reordering window); the RTO
    /// before any sample.
    fn loss_delay(&self) -> Duration {
        match (self.rtt.smoothed(), self.rtt.latest()) {
            (Some(s), Some(l)) => {
                let base = (s.max(l) * 9 / 8).max(s + self.rtt.variation() * 4);
                base * (4 + self.reorder_quarters) / 4
            }
            _ => self.rtt.rto(),
        }
    }

    /// Handles a packet that decoded (CRC and job key checked).
    pub fn handle_packet(&mut self, now: Instant, packet: Packet) {
        if packet.source != self.peer || packet.destination != self.local {
            self.stats.misaddressed_dropped += 1;
            return;
        }
        match packet.body {
            PacketBody::Data { seq, payload } => self.on_data(now, seq, payload),
            PacketBody::Ack(ack) => self.on_ack(now, &ack),
        }
    }

    fn on_data(&mut self, now: Instant, seq: u64, payload: Bytes) {
        match self.received.on_data(seq, payload) {
            Arrival::InOrder => {
                self.ack.pending += 1;
                self.ack.deadline.get_or_insert(now + self.config.ack_delay);
            }
            Arrival::OutOfOrder => self.ack.immediate = true,
            Arrival::Duplicate => {
                self.stats.duplicates_dropped += 1;
                self.ack.immediate = true;
            }
            Arrival::OutOfWindow => {
                self.stats.out_of_window_dropped += 1;
                self.ack.immediate = true;
            }
        }
        if self.ack.nack.is_some_and(|n| self.received.has_received(n)) {
            self.ack.nack = None;
        }
    }

    fn on_ack(&mut self, now: Instant, ack: &AckInfo) {
        self.stats.acks_received += 1;
        self.peer_window_end = self.peer_window_end.max(ack.window_end);
        let outcome = self.sent.on_ack(ack, now, self.loss_delay());
        if let Some(sample) = outcome.rtt_sample {
            self.rtt.on_sample(sample);
        }
        let spurious = outcome
            .retransmission_acked_after
            .zip(self.rtt.min())
            .is_some_and(|(after, min)| after < min);
        if spurious {
            self.stats.spurious_retransmissions += 1;
            self.reorder_quarters = (self.reorder_quarters + 1).min(MAX_REORDER_QUARTERS);
        }
        if let Some(nack) = ack.nack {
            self.stats.nacks_received += 1;
            // A NACK answering a copy sent less than half a round trip ago is about an older copy.
            let guard = self.rtt.smoothed().unwrap_or(Duration::ZERO) / 2;
            self.sent.on_nack(nack, now, guard);
        }
    }

    /// Handles a packet that failed its CRC check: `seq` is the DATA sequence number its header
    /// claims (`None` if it was an ACK or the header did not parse). The packet is NACKed if that
    /// number is plausible (in the window, not yet received); it is always counted.
    pub fn handle_corrupt(&mut self, _now: Instant, seq: Option<u64>) {
        self.stats.crc_failures += 1;
        if let Some(seq) = seq {
            if !self.received.has_received(seq) && seq < self.received.window_end() {
                self.ack.nack = Some(seq);
                self.ack.immediate = true;
            }
        }
    }

    fn ack_due(&self, now: Instant) -> bool {
        self.ack.immediate
            || self.ack.pending >= self.config.ack_frequency.max(1)
            || self.ack.deadline.is_some_and(|d| d <= now)
    }

    fn packet(&self, body: PacketBody) -> Packet {
        Packet {
            job_key: self.job_key,
            source: self.local,
            destination: self.peer,
            body,
        }
    }

    /// The next packet to send now, if any: a due ACK first, then retransmissions, then new DATA
    /// within the window.
    pub fn poll_transmit(&mut self, now: Instant) -> Option<Packet> {
        if self.ack_due(now) {
            let nack = self.ack.nack.take();
            let info = self.received.ack_info(nack);
            self.ack = AckState {
                pending: 0,
                deadline: None,
                immediate: false,
                nack: None,
                advertised_end: info.window_end,
            };
            self.stats.acks_sent += 1;
            if nack.is_some() {
                self.stats.nacks_sent += 1;
            }
            return Some(self.packet(PacketBody::Ack(info)));
        }
        if self.dead {
            return None;
        }
        if let Some((seq, payload)) = self.sent.pop_due(now) {
            self.stats.retransmitted += 1;
            return Some(self.packet(PacketBody::Data { seq, payload }));
        }
        let window_open = self.sent.len() < self.config.window as usize
            && (self.next_seq < self.peer_window_end || self.sent.is_empty());
        if window_open {
            if let Some(payload) = self.unsent.pop_front() {
                let seq = self.next_seq;
                self.next_seq += 1;
                self.sent.on_sent(seq, payload.clone(), now);
                self.stats.sent += 1;
                return Some(self.packet(PacketBody::Data { seq, payload }));
            }
        }
        None
    }

    /// The next payload received in order, for the application.
    pub fn poll_deliver(&mut self) -> Option<Bytes> {
        let payload = self.received.pop()?;
        self.stats.delivered += 1;
        // Tell a sender that may be held back by our window that it opened again.
        let window = u64::from(self.config.window);
        let end = self.received.window_end();
        let room_left = self
            .ack
            .advertised_end
            .saturating_sub(self.received.next_expected());
        if room_left < window / 2 && end >= self.ack.advertised_end + (window / 4).max(1) {
            self.ack.immediate = true;
        }
        Some(payload)
    }

    /// When [`handle_timeout`](Self::handle_timeout) should be called next, if a timer runs: the
    /// delayed ACK, the loss timer or the retransmission timer.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let ack = self.ack.deadline.filter(|_| self.ack.pending > 0);
        let (retransmit, loss) = if self.dead {
            (None, None)
        } else {
            (
                self.sent
                    .next_timeout(self.rtt.rto(), self.config.max_backoff),
                self.sent.next_loss_time(self.loss_delay()),
            )
        };
        [ack, retransmit, loss].into_iter().flatten().min()
    }

    /// Handles expired timers (an early call does nothing).
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.dead {
            return;
        }
        self.sent.detect_lost(now, self.loss_delay());
        match self.sent.on_timeout(
            now,
            self.rtt.rto(),
            self.config.max_backoff,
            self.config.retry_limit,
        ) {
            TimeoutOutcome::None => {}
            TimeoutOutcome::Retransmit(_) => self.stats.timeouts += 1,
            TimeoutOutcome::Dead => {
                self.dead = true;
                self.events
                    .push_back(LinkEvent::PeerDead { rank: self.peer });
            }
        }
    }

    /// The next event, if any.
    pub fn poll_event(&mut self) -> Option<LinkEvent> {
        self.events.pop_front()
    }
}
