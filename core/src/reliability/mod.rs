//! End-to-end reliability over an unreliable transport with one or more routes, as a sans-IO
//! state machine per peer (LA-MPI's reliability layer and path scheduler; quinn-proto's style).
//!
//! A [`ReliableLink`] sits between the message protocol and a transport that may lose,
//! duplicate, reorder or corrupt packets (UDP), over one or more *routes* (say, one socket per
//! network adapter; route `r` of this rank talks to route `r` of the peer). It never touches a
//! socket or a clock: the caller passes the time in (`now: Instant`) and moves the [`Packet`]s,
//! each on the route the link names.
//!
//! * [`packet`]: the link packet (DATA with a 64-bit sequence number and a piggybacked ACK, ACK
//!   with cumulative and selective information and an optional NACK, RAW for reliability off,
//!   PING/PONG route probes), CRC32C, the codec and the gather-friendly header writer.
//! * [`rtt`]: [`RttEstimator`], smoothed round-trip time and the retransmission timeout.
//! * [`retransmit`]: [`RetransmitQueue`], unacknowledged packets (with the route each was last
//!   sent on) and the rules that send them again (NACK, loss detection from later ACKs, timeout
//!   with truncated exponential backoff, rebinding off a dead route).
//! * [`receive_window`]: [`ReceiveWindow`], duplicate suppression, reordering, in-order delivery.
//! * [`paths`]: [`PathScheduler`], the routes: which are Up, which carries each packet
//!   (striping), strikes, failover, probing and fail-back, per-route counters.
//! * [`liveness`]: [`Liveness`], when silence means the peer is dead; keepalive PINGs; BYE.
//!
//! # Driving a link
//!
//! ```text
//! app:        link.send(now, payload)                       link.poll_deliver() -> payload
//! arrivals:   Packet::decode(bytes, key) -> Ok(p)         => link.handle_packet(now, route, p)
//!                                        -> Err(CrcMismatch { seq, .. }) => link.handle_corrupt(now, route, seq)
//! outgoing:   while let Some(t) = link.poll_transmit(now) {
//!                 t.packet.write_header(&mut header);        // reused buffer
//!                 carrier.send(t.route, peer, &[&header, t.packet.payload().map_or(&[], |p| p)])
//!             }
//! timer:      at link.poll_timeout() => link.handle_timeout(now)
//! events:     link.poll_event() -> LinkEvent::{PeerDead, RouteDown, RouteUp}
//! ```
//!
//! After every `handle_*` and `send` call, drain [`poll_transmit`](ReliableLink::poll_transmit)
//! and re-arm the timer from [`poll_timeout`](ReliableLink::poll_timeout). The payload is never
//! copied: [`Packet::write_header`] writes the header (its CRC covering the payload) and the
//! payload follows it from its own buffer.
//!
//! # Rules
//!
//! * **Sender window.** At most [`LinkConfig::window`] DATA packets are unacknowledged, and only
//!   sequence numbers below the receiver's advertised window end are sent (the receiver counts
//!   packets its application has not taken yet): a slow receiver is not flooded. When the peer's
//!   window is closed and nothing is in flight, one packet goes out anyway as a window probe; it
//!   is retransmitted on the usual timer and the answering ACK reopens the window.
//! * **Acknowledgements.** The receiver acknowledges
//!   [`ack_hold`](LinkConfig::ack_hold) (20 µs) after every
//!   [`ack_frequency`](LinkConfig::ack_frequency) in-order DATA packets or
//!   [`ack_delay`](LinkConfig::ack_delay) after the first unacknowledged one, whichever comes
//!   first, and at once after an out-of-order packet, a duplicate, a packet beyond the window or
//!   a corrupted packet (which it NACKs). The hold lets a reply carry the ACK (below): without
//!   it a request of two packets or more was answered by a standalone ACK first, one more
//!   datagram on the critical path of every such exchange. An ACK carries the highest in-order sequence number,
//!   a bitmap of those received beyond it, and the window end.
//! * **Piggybacking.** Every DATA packet carries the sender's current cumulative ACK and window
//!   end for the reverse direction, and the receiver processes them as a cumulative ACK. A DATA
//!   packet going out therefore satisfies a pending *delayed* ACK (and a window update): in a
//!   ping-pong, or any traffic flowing both ways, no standalone ACKs are sent. An *immediate*
//!   ACK (after an out-of-order packet, a duplicate, a packet beyond the window, or carrying a
//!   NACK) still goes as a standalone ACK, since only it carries the selective bitmap and the
//!   NACK.
//! * **Retransmission**: see [`retransmit`]. Retransmissions go on an Up route, preferring one
//!   other than the route that lost the packet.
//! * **Liveness** (details in [`liveness`]). The peer is declared dead
//!   ([`LinkEvent::PeerDead`]) when nothing was heard from it for
//!   [`peer_timeout`](LinkConfig::peer_timeout) while data of ours is unacknowledged, or, with
//!   [`keepalive`](LinkConfig::keepalive) on, at all: a link that has heard nothing for the
//!   keepalive interval sends a PING on every Up route, which a live peer answers (one route
//!   that died while the link was idle is never marked Down, having lost nothing: a PING on
//!   the primary alone would go unanswered, and a live peer be declared dead). A link
//!   that [closes](ReliableLink::close) sends BYE; a peer that said BYE is no longer pinged.
//! * **Routes** (details in [`paths`]). Each route is Up or Down; the lowest Up route is the
//!   *primary*.
//!   * *Striping.* A payload of at most [`stripe_threshold`](LinkConfig::stripe_threshold)
//!     bytes goes on the primary route; a larger one goes on the Up route with the earliest
//!     expected completion, `(bytes in flight on r + len) / throughput(r)`, the throughput being
//!     measured from the bytes acknowledged on each route. Large transfers are thus spread over
//!     all Up routes in proportion to their speed; the receiver reorders as usual.
//!   * *Failover.* A loss on a route (the retransmission timer expiring for a packet last sent
//!     on it, or loss detection finding a packet lost with nothing sent later on that route
//!     acknowledged) is a strike against it; an ACK of a packet sent only on that route clears
//!     its strikes. At [`route_strikes`](LinkConfig::route_strikes) strikes the route goes Down
//!     ([`LinkEvent::RouteDown`]) and every unacknowledged packet last sent on it is sent again
//!     at once on the remaining Up routes (rebinding). If every route is Down, the link keeps
//!     sending on all of them in turn: while any route delivers, every message arrives, and the
//!     peer is declared dead only when all are silent.
//!   * *Probing and fail-back.* A Down route is probed with a PING every
//!     [`probe_interval`](LinkConfig::probe_interval); the peer answers each PING with a PONG on
//!     the route it arrived on. A PONG of a nonce sent on that route, arriving on that route,
//!     brings it Up again ([`LinkEvent::RouteUp`]) and it carries traffic at once. Probing goes
//!     on while the link is idle, and stops when the peer is declared dead.
//!   * *ACK route.* Standalone ACKs go on the route the latest DATA arrived on if that route is
//!     Up, else on the primary. PONGs go on the route of their PING.
//! * **Raw packets.** [`PacketBody::Raw`] is for transports with reliability off; a link drops
//!   and counts any it is handed ([`LinkStats::raw_dropped`]).

pub mod liveness;
pub mod packet;
pub mod paths;
pub mod receive_window;
pub mod retransmit;
pub mod rtt;
mod seq_slots;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use bytes::Bytes;

pub use liveness::Liveness;
pub use packet::{AckInfo, Packet, PacketBody, PacketError, PacketPayload};
pub use paths::{PathScheduler, RouteChange, RouteStats};
pub use receive_window::{Arrival, ReceiveWindow};
pub use retransmit::{QueueEvent, RetransmitQueue};
pub use rtt::RttEstimator;

/// Settings of a [`ReliableLink`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkConfig {
    /// Most unacknowledged DATA packets at the sender (packets acknowledged selectively, past
    /// a missing one, do not count). Default 256; clamped to `1..=65536`.
    pub window: u32,
    /// Most packets a receiver holds (out of order, or not yet taken by the application),
    /// counted from the first one the application has not taken; the sender sends nothing
    /// beyond. Default `None`: four times [`window`](Self::window), so that while a lost
    /// packet is repaired (about two round trips) the sender goes on sending past it instead
    /// of stalling once a window beyond it (measured over UDP under 1% loss: 1 MiB messages
    /// at 41% of the lossless bandwidth with `window`, 55% with four times it, the reordering
    /// allowance below aside). Clamped to `1..=65536`.
    pub receive_window: Option<u32>,
    /// Retransmission timeout before the first RTT sample. Default 10 ms.
    pub initial_rto: Duration,
    /// Smallest retransmission timeout. Default 2 ms. Keep it above
    /// [`ack_delay`](Self::ack_delay), or delayed ACKs cause spurious retransmissions.
    pub min_rto: Duration,
    /// Largest retransmission timeout (before backoff). Default 1 s.
    pub max_rto: Duration,
    /// Backoff exponent cap: a timer runs at most `RTO × 2^max_backoff`. Default 8 (×256).
    pub max_backoff: u32,
    /// Silence after which the peer is declared dead: nothing heard from it for this long while
    /// data of ours is unacknowledged (or at all, with [`keepalive`](Self::keepalive) on).
    /// Default 5 s.
    pub peer_timeout: Duration,
    /// Send a keepalive PING after this much silence from the peer, so that a dead peer is
    /// noticed even with nothing in flight. Default `None` (off); transports turn it on with
    /// [`with_peer_timeout`](Self::with_peer_timeout).
    pub keepalive: Option<Duration>,
    /// Send an ACK after this many in-order DATA packets (at most
    /// [`ack_hold`](Self::ack_hold) later). Default 2; 1 acknowledges every packet.
    pub ack_frequency: u32,
    /// How long an ACK that [`ack_frequency`](Self::ack_frequency) made due waits for a DATA
    /// packet going the other way to carry it. In a request and its reply (a ping-pong of
    /// messages of several packets, a rendezvous) the reply then carries the ACK instead of a
    /// standalone ACK going out first, on the critical path; a stream in one direction gets
    /// its ACKs this much later. Default 20 µs; zero sends the ACK at once.
    pub ack_hold: Duration,
    /// Send an ACK at the latest this long after an unacknowledged DATA packet arrived.
    /// Default 500 µs.
    pub ack_delay: Duration,
    /// Payloads of at most this many bytes go on the primary route only; larger ones are striped
    /// across all Up routes. Default 8 KiB.
    pub stripe_threshold: usize,
    /// Consecutive strikes (losses) against a route after which it is marked Down. Default 3;
    /// at least 1.
    pub route_strikes: u32,
    /// How often a Down route is probed with a PING. Default 50 ms; at least
    /// [`MIN_PROBE_INTERVAL`].
    pub probe_interval: Duration,
}

impl LinkConfig {
    /// These settings with peer timeout `timeout` and keepalive on, a PING after a fifth of it:
    /// a live peer answers four or five PINGs before the timeout would declare it dead.
    pub fn with_peer_timeout(self, timeout: Duration) -> Self {
        LinkConfig {
            peer_timeout: timeout,
            keepalive: Some(timeout / 5),
            ..self
        }
    }
}

/// Shortest [`LinkConfig::probe_interval`] a link uses.
pub const MIN_PROBE_INTERVAL: Duration = Duration::from_micros(100);

impl Default for LinkConfig {
    fn default() -> Self {
        Self {
            window: 256,
            receive_window: None,
            initial_rto: Duration::from_millis(10),
            min_rto: Duration::from_millis(2),
            max_rto: Duration::from_secs(1),
            max_backoff: 8,
            peer_timeout: Duration::from_secs(5),
            keepalive: None,
            ack_frequency: 2,
            ack_hold: Duration::from_micros(20),
            ack_delay: Duration::from_micros(500),
            stripe_threshold: 8 * 1024,
            route_strikes: 3,
            probe_interval: Duration::from_millis(50),
        }
    }
}

/// A packet to send, and the route to send it on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transmit {
    /// The route (`0..routes`).
    pub route: usize,
    /// The packet: send [`Packet::write_header`] followed by [`Packet::payload`].
    pub packet: Packet,
}

/// What a link reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkEvent {
    /// The peer stopped answering on every route for the peer timeout. The link sends no more
    /// DATA and no more probes.
    PeerDead {
        /// The peer's rank.
        rank: u32,
    },
    /// A route to the peer was marked Down (its packets were moved to the other routes, and it
    /// is probed).
    RouteDown {
        /// The peer's rank.
        rank: u32,
        /// The route.
        route: usize,
    },
    /// A probe brought a Down route back Up; it carries traffic again.
    RouteUp {
        /// The peer's rank.
        rank: u32,
        /// The route.
        route: usize,
    },
}

/// Counters of one link (per-route ones: [`ReliableLink::route_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// DATA packets sent for the first time.
    pub sent: u64,
    /// DATA packets sent again (NACK, loss detection, timeout or rebinding).
    pub retransmitted: u64,
    /// Retransmissions the peer reported as duplicates (the packet was only delayed, not
    /// lost); each one widens the link's reordering allowance.
    pub spurious_retransmissions: u64,
    /// Retransmission timer expiries.
    pub timeouts: u64,
    /// Tail probes sent (the newest packet again after a stall shorter than the timer; see
    /// [`retransmit`]).
    pub tail_probes: u64,
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
    /// Standalone ACK packets sent.
    pub acks_sent: u64,
    /// Standalone ACK packets received.
    pub acks_received: u64,
    /// DATA packets sent that carried a pending delayed ACK (or window update), saving a
    /// standalone ACK.
    pub acks_piggybacked: u64,
    /// Packets dropped because their source or destination rank is not this link's.
    pub misaddressed_dropped: u64,
    /// Packets dropped because they were reported on a route the link does not have.
    pub misrouted_dropped: u64,
    /// RAW packets dropped (the peer runs with reliability off).
    pub raw_dropped: u64,
    /// PINGs sent (probes of Down routes).
    pub pings_sent: u64,
    /// Keepalive PINGs sent (after a silent keepalive interval).
    pub keepalives_sent: u64,
    /// BYE packets received (the peer closed).
    pub byes_received: u64,
    /// PONGs sent (answers to the peer's PINGs).
    pub pongs_sent: u64,
    /// PONGs received.
    pub pongs_received: u64,
}

/// When to acknowledge.
#[derive(Clone, Debug)]
struct AckState {
    /// In-order DATA packets since the last ACK.
    pending: u32,
    /// Latest time for the next ACK, while `pending > 0`.
    deadline: Option<Instant>,
    /// A standalone ACK (selective information or NACK) is needed at the next poll.
    immediate: bool,
    /// The window reopened: tell the sender at the next poll (a DATA packet does too).
    window_update: bool,
    /// Sequence number to NACK in the next ACK.
    nack: Option<u64>,
    /// Sequence number of a DATA packet that arrived again, to report in the next ACK.
    duplicate: Option<u64>,
    /// The window end in the last ACK (standalone or piggybacked) sent.
    advertised_end: u64,
}

impl AckState {
    fn new(advertised_end: u64) -> Self {
        Self {
            pending: 0,
            deadline: None,
            immediate: false,
            window_update: false,
            nack: None,
            duplicate: None,
            advertised_end,
        }
    }
}

/// Most PONGs waiting to be sent; PINGs beyond it are not answered (the peer pings again).
pub const MAX_PENDING_PONGS: usize = 64;

/// The nonce of keepalive PINGs (route probes never use it: their nonces count up from a random
/// start, and a PONG of this nonce is only a sign of life).
pub const KEEPALIVE_NONCE: u64 = u64::MAX;

/// The reliable link from this rank to one peer, over one or more routes (see the
/// [module docs](self)).
#[derive(Debug)]
pub struct ReliableLink {
    config: LinkConfig,
    job_key: u64,
    local: u32,
    peer: u32,
    rtt: RttEstimator,
    sent: RetransmitQueue,
    received: ReceiveWindow,
    paths: PathScheduler,
    unsent: VecDeque<PacketPayload>,
    next_seq: u64,
    peer_window_end: u64,
    ack: AckState,
    /// The route the latest DATA arrived on.
    last_data_route: Option<usize>,
    /// PONGs to send: route and nonce.
    pongs: VecDeque<(usize, u64)>,
    events: VecDeque<LinkEvent>,
    stats: LinkStats,
    dead: bool,
    liveness: Liveness,
    /// A BYE is due (the link was closed and has not said it yet).
    bye_due: bool,
    /// Routes the due keepalive PING has still to go out on: every Up route, so that a dead
    /// primary (which an idle link never finds out about: no data, no losses, no strikes) does
    /// not silence a live peer.
    keepalive_routes: Vec<usize>,
    /// Reordering allowance, in quarters added to the loss delay: starts at
    /// [`INITIAL_REORDER_QUARTERS`], grows on each spurious retransmission (up to
    /// [`MAX_REORDER_QUARTERS`]) and goes back to zero after [`REORDER_PERSIST`] ACKs of
    /// retransmitted packets without a spurious one (as RACK's `reo_wnd_persist`).
    reorder_quarters: u32,
    /// ACKs of retransmitted packets still to come before the allowance goes back to zero.
    reorder_persist: u32,
    /// Sequence numbers of the latest acknowledged packets that had been retransmitted (at
    /// most [`RESENT_MEMORY`]), to tell a duplicate report about one of them from one about a
    /// packet the network duplicated.
    resent_acked: VecDeque<u64>,
    /// Loss delay per route (scratch, refreshed before each use).
    loss_delays: Vec<Duration>,
    /// The acknowledgement a DATA packet carried, received by [`receive`](Self::receive) at
    /// the instant given and not applied yet.
    deferred_ack: Option<(Instant, AckInfo)>,
}

/// Cap of the reordering allowance: the loss delay grows to at most 4× its base.
pub const MAX_REORDER_QUARTERS: u32 = 12;

/// ACKs of retransmitted packets, without a retransmission reported spurious in between,
/// after which the reordering allowance goes back to zero. An allowance that only grew made
/// every later loss wait longer to be repaired, for good.
///
/// Retransmissions count as spurious only when the peer reports their packet arrived twice
/// ([`AckInfo::duplicate`], TCP's D-SACK). Before, an ACK that came sooner than the minimum
/// RTT after the retransmission was taken for the answer to an earlier copy; but the minimum
/// RTT includes the receiver's ACK hold, and a retransmission that fills a gap is
/// acknowledged at once: under 1% loss over UDP needed retransmissions were taken for spurious
/// on every few losses, and 1 MiB messages went at 42–68% of the lossless bandwidth.
/// Real reordering keeps the allowance up: its retransmissions are reported as duplicates.
pub const REORDER_PERSIST: u32 = 16;

/// The reordering allowance a link starts with (loss delay × 2.5). Until the RTT estimate has
/// settled and the peer has reported spurious retransmissions, a reordering network makes a
/// link without one take whole runs of delayed packets for lost at once (in the deterministic
/// reordering test, 250 spurious retransmissions in the first 300 packets with a receive
/// window of four send windows; 6 with this allowance). Where nothing is reordered it is gone
/// after [`REORDER_PERSIST`] repaired losses.
pub const INITIAL_REORDER_QUARTERS: u32 = 6;

/// How many acknowledged retransmitted packets a link remembers, for matching duplicate
/// reports against them.
pub const RESENT_MEMORY: usize = 64;

impl ReliableLink {
    /// The link from rank `local` to rank `peer` of the job `job_key`, over `routes` routes
    /// (at least 1; numbered `0..routes`).
    pub fn new(config: LinkConfig, job_key: u64, local: u32, peer: u32, routes: usize) -> Self {
        let config = LinkConfig {
            window: config.window.clamp(1, 65536),
            route_strikes: config.route_strikes.max(1),
            probe_interval: config.probe_interval.max(MIN_PROBE_INTERVAL),
            ..config
        };
        let received = ReceiveWindow::new(u64::from(
            config
                .receive_window
                .unwrap_or(config.window.saturating_mul(4)),
        ));
        let initial_end = received.window_end();
        Self {
            rtt: RttEstimator::new(config.initial_rto, config.min_rto, config.max_rto)
                .with_max_ack_delay(config.ack_delay),
            sent: RetransmitQueue::new(),
            received,
            paths: PathScheduler::new(
                routes,
                config.stripe_threshold,
                config.route_strikes,
                config.probe_interval,
            ),
            unsent: VecDeque::new(),
            next_seq: 1,
            peer_window_end: initial_end,
            ack: AckState::new(initial_end),
            last_data_route: None,
            pongs: VecDeque::new(),
            events: VecDeque::new(),
            stats: LinkStats::default(),
            dead: false,
            liveness: Liveness::new(config.peer_timeout, config.keepalive),
            bye_due: false,
            keepalive_routes: Vec::new(),
            reorder_quarters: INITIAL_REORDER_QUARTERS,
            reorder_persist: REORDER_PERSIST,
            resent_acked: VecDeque::new(),
            loss_delays: Vec::new(),
            deferred_ack: None,
            config,
            job_key,
            local,
            peer,
        }
    }

    /// The link's settings (window, strikes and probe interval clamped).
    pub fn config(&self) -> &LinkConfig {
        &self.config
    }

    /// The peer's rank.
    pub fn peer(&self) -> u32 {
        self.peer
    }

    /// Number of routes.
    pub fn routes(&self) -> usize {
        self.paths.len()
    }

    /// The link's counters.
    pub fn stats(&self) -> LinkStats {
        self.stats
    }

    /// Counters and state of each route, indexed by route.
    pub fn route_stats(&self) -> &[RouteStats] {
        self.paths.stats()
    }

    /// The route scheduler (which routes are Up, the primary, ...).
    pub fn paths(&self) -> &PathScheduler {
        &self.paths
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

    /// The reordering allowance, in quarters of the loss delay.
    #[cfg(test)]
    pub(crate) fn reorder_allowance(&self) -> u32 {
        self.reorder_quarters
    }

    /// Most packets this side holds ([`LinkConfig::receive_window`], resolved).
    pub fn receive_capacity(&self) -> usize {
        self.received.capacity() as usize
    }

    /// Whether the peer was declared dead.
    pub fn is_dead(&self) -> bool {
        self.dead
    }

    /// Whether everything sent was acknowledged and nothing waits to be sent.
    pub fn is_idle(&self) -> bool {
        self.unsent.is_empty()
            && (self.sent.is_empty()
                || self
                    .deferred_ack
                    .as_ref()
                    .is_some_and(|(_, ack)| self.sent.acknowledges_all(ack)))
    }

    /// Queues `payload` for reliable, in-order delivery to the peer. It goes out from
    /// [`poll_transmit`](Self::poll_transmit) when the window allows (never, once the peer is
    /// dead).
    pub fn send(&mut self, now: Instant, payload: impl Into<PacketPayload>) {
        if self.is_idle() {
            self.liveness.on_await_start(now);
        }
        self.unsent.push_back(payload.into());
    }

    /// This side is closing: say BYE to the peer (at the next [`poll_transmit`](Self::poll_transmit))
    /// and send no more keepalives. Unacknowledged data is still retransmitted.
    pub fn close(&mut self) {
        if !self.dead && !self.liveness.local_closed() {
            self.bye_due = true;
            // A delayed ACK would never go out: the peer would retransmit to a closed rank
            // until its own linger ran out.
            if self.ack.pending > 0 || self.ack.window_update {
                self.ack.immediate = true;
            }
        }
        self.liveness.on_local_close();
        self.keepalive_routes.clear();
    }

    /// Whether the peer said BYE (it closed cleanly).
    pub fn peer_closed(&self) -> bool {
        self.liveness.peer_closed()
    }

    /// Whether data of ours waits for the peer: sent and unacknowledged, or queued.
    /// The tail probe's timeout: two smoothed round trips plus the time the peer may hold
    /// back the ACK of a lone packet (RFC 8985's PTO); none before the first RTT sample.
    fn tail_probe_timeout(&self) -> Option<Duration> {
        Some(self.rtt.smoothed()? * 2 + self.config.ack_delay)
    }

    fn awaiting(&self) -> bool {
        !self.is_idle()
    }

    /// How long a packet sent before an acknowledged one may be out before it counts as lost,
    /// from the link's blended RTT: [`RttEstimator::loss_delay`] stretched by a quarter for each
    /// spurious retransmission seen so far (up to 4×, as RACK's reordering window); the RTO
    /// before any sample. Packets on a route with round-trip samples of its own use that route's
    /// delay instead ([`PathScheduler::loss_delay`]).
    fn loss_delay(&self) -> Duration {
        self.rtt
            .loss_delay(self.reorder_quarters)
            .unwrap_or(self.rtt.rto())
    }

    /// The loss delay of each route, into `self.loss_delays`.
    fn update_loss_delays(&mut self) {
        let fallback = self.loss_delay();
        self.loss_delays.clear();
        for r in 0..self.paths.len() {
            let delay = self.paths.loss_delay(r, self.reorder_quarters);
            self.loss_delays.push(delay.unwrap_or(fallback));
        }
    }

    /// How far apart strikes against one route count: the smoothed RTT (the RTO before any
    /// sample).
    fn strike_spacing(&self) -> Duration {
        self.rtt.smoothed().unwrap_or(self.rtt.rto())
    }

    /// Handles a packet that decoded (CRC and job key checked) and arrived on `route`.
    pub fn handle_packet(&mut self, now: Instant, route: usize, packet: Packet) {
        self.handle(now, route, packet, false);
    }

    /// [`handle_packet`](Self::handle_packet) for a caller that hands what the packet delivers
    /// to the application before anything else: the acknowledgement a DATA packet carries is
    /// applied later, by the next [`poll_transmit`](Self::poll_transmit) once it has nothing
    /// new to send (or before a retransmission), by [`handle_timeout`](Self::handle_timeout),
    /// or by the next packet. In a ping-pong this takes the acknowledgement's bookkeeping (a
    /// thousand-odd instructions: removing the packet, RTT samples, route accounting, loss
    /// detection) off the critical path: it runs after the reply left.
    /// [`poll_timeout`](Self::poll_timeout) reports a deferred acknowledgement as due, and
    /// [`is_idle`](Self::is_idle) counts it as applied.
    pub fn receive(&mut self, now: Instant, route: usize, packet: Packet) {
        self.handle(now, route, packet, true);
    }

    /// Applies the deferred acknowledgement, if any.
    fn settle_ack(&mut self) {
        if let Some((at, ack)) = self.deferred_ack.take() {
            self.on_ack(at, &ack);
        }
    }

    fn handle(&mut self, now: Instant, route: usize, packet: Packet, defer_ack: bool) {
        self.settle_ack();
        if route >= self.paths.len() {
            self.stats.misrouted_dropped += 1;
            return;
        }
        if packet.source != self.peer || packet.destination != self.local {
            self.stats.misaddressed_dropped += 1;
            return;
        }
        self.paths.on_received(route, packet.encoded_len());
        self.liveness.on_heard(now);
        match packet.body {
            PacketBody::Data {
                seq,
                ack,
                window_end,
                payload,
            } => {
                self.last_data_route = Some(route);
                self.on_data(now, seq, payload.into_bytes());
                let piggybacked = AckInfo {
                    cumulative: ack,
                    window_end,
                    selective: Vec::new(),
                    nack: None,
                    duplicate: None,
                };
                if defer_ack {
                    self.deferred_ack = Some((now, piggybacked));
                } else {
                    self.on_ack(now, &piggybacked);
                }
            }
            PacketBody::Ack(ack) => {
                self.stats.acks_received += 1;
                self.on_ack(now, &ack);
            }
            PacketBody::Raw { .. } => self.stats.raw_dropped += 1,
            PacketBody::Ping { nonce } => {
                if self.pongs.len() < MAX_PENDING_PONGS {
                    self.pongs.push_back((route, nonce));
                }
            }
            PacketBody::Bye => {
                self.stats.byes_received += 1;
                self.liveness.on_bye();
            }
            PacketBody::Pong { nonce } => {
                self.stats.pongs_received += 1;
                if !self.dead && nonce != KEEPALIVE_NONCE {
                    self.paths.on_pong(route, nonce);
                    self.take_route_changes();
                }
            }
        }
    }

    fn on_data(&mut self, now: Instant, seq: u64, payload: Bytes) {
        let gap = self.received.has_gap();
        match self.received.on_data(seq, payload) {
            // It filled (part of) a gap: the sender is waiting to learn it arrived, or it
            // would soon take the packets still missing, or this one, for lost (RFC 5681
            // §4.2: acknowledge at once).
            Arrival::InOrder if gap => self.ack.immediate = true,
            Arrival::InOrder => {
                self.ack.pending += 1;
                let mut deadline = self.ack.deadline.unwrap_or(now + self.config.ack_delay);
                if self.ack.pending >= self.config.ack_frequency.max(1) {
                    deadline = deadline.min(now + self.config.ack_hold);
                }
                self.ack.deadline = Some(deadline);
            }
            Arrival::OutOfOrder => self.ack.immediate = true,
            Arrival::Duplicate => {
                self.stats.duplicates_dropped += 1;
                self.ack.immediate = true;
                self.ack.duplicate = Some(seq);
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

    /// The shortest time after which an ACK can answer a copy of a packet: the minimum RTT
    /// less the ACK hold, and at least half the minimum. The minimum is measured on packets
    /// whose ACK may have waited that long at the receiver, while a retransmission that fills a
    /// gap is acknowledged at once (measured over UDP: 21–35 µs after it left, the minimum RTT
    /// being 38 µs); on a link whose whole round trip is shorter than the hold, the half keeps
    /// the rule alive.
    fn fastest_answer(&self) -> Option<Duration> {
        self.rtt
            .min()
            .map(|m| m.saturating_sub(self.config.ack_hold.min(m / 2)))
    }

    /// Acknowledgement information from the peer, standalone or piggybacked.
    fn on_ack(&mut self, now: Instant, ack: &AckInfo) {
        self.peer_window_end = self.peer_window_end.max(ack.window_end);
        // Loss detection after the ACK needs the per-route delays only if packets remain (not
        // so in a ping-pong, where every ACK clears the queue).
        if !self.sent.acknowledges_all(ack) {
            self.update_loss_delays();
        }
        let rate_interval = self.rtt.smoothed().unwrap_or(self.rtt.rto());
        let fastest = self.fastest_answer();
        let (paths, delays, resent) = (&mut self.paths, &self.loss_delays, &mut self.resent_acked);
        let outcome = self.sent.on_ack_with(
            ack,
            now,
            fastest,
            |p| delays.get(p.route).copied().unwrap_or_default(),
            |event| match event {
                QueueEvent::Acked(p) => {
                    if p.retransmitted {
                        if resent.len() == RESENT_MEMORY {
                            resent.pop_front();
                        }
                        resent.push_back(p.seq);
                    }
                    paths.on_acked(p, now, rate_interval);
                }
                QueueEvent::Lost(p) => paths.on_lost(p),
            },
        );
        if !self.dead {
            self.paths.end_pass(now, self.strike_spacing());
            self.take_route_changes();
        }
        if let Some(sample) = outcome.rtt_sample {
            self.rtt.on_sample(sample);
        }
        // A duplicate report about a packet this side retransmitted: the retransmission was
        // not needed (about any other packet, the network duplicated it).
        let spurious = ack.duplicate.is_some_and(|d| {
            let at = self.resent_acked.iter().position(|&s| s == d);
            at.and_then(|i| self.resent_acked.remove(i)).is_some()
        });
        if spurious {
            self.stats.spurious_retransmissions += 1;
            self.reorder_quarters = (self.reorder_quarters + 1).min(MAX_REORDER_QUARTERS);
            self.reorder_persist = REORDER_PERSIST;
        } else if outcome.retransmissions_acked > 0 && self.reorder_quarters > 0 {
            // One step per ACK, however many retransmitted packets it acknowledges.
            self.reorder_persist = self.reorder_persist.saturating_sub(1);
            if self.reorder_persist == 0 {
                self.reorder_quarters = 0;
            }
        }
        if let Some(nack) = ack.nack {
            self.stats.nacks_received += 1;
            // A NACK answering a copy sent less than half a round trip ago is about an older copy.
            let guard = self.rtt.smoothed().unwrap_or(Duration::ZERO) / 2;
            self.sent.on_nack(nack, now, guard);
        }
    }

    /// Turns the scheduler's route changes into events, rebinding the packets of a route that
    /// went Down when another route is Up.
    fn take_route_changes(&mut self) {
        while let Some(change) = self.paths.poll_change() {
            let event = match change {
                RouteChange::Down(route) => {
                    if self.paths.up_count() > 0 {
                        self.sent.mark_route_due(route);
                    }
                    LinkEvent::RouteDown {
                        rank: self.peer,
                        route,
                    }
                }
                RouteChange::Up(route) => LinkEvent::RouteUp {
                    rank: self.peer,
                    route,
                },
            };
            self.events.push_back(event);
        }
    }

    /// Handles a packet that arrived on `route` and failed its CRC check: `seq` is the DATA
    /// sequence number its header claims (`None` if it was another kind or the header did not
    /// parse). The packet is NACKed if that number is plausible (in the window, not yet
    /// received); it is always counted.
    pub fn handle_corrupt(&mut self, _now: Instant, route: usize, seq: Option<u64>) {
        self.stats.crc_failures += 1;
        self.paths.on_corrupt(route);
        if let Some(seq) = seq {
            if !self.received.has_received(seq) && seq < self.received.window_end() {
                self.ack.nack = Some(seq);
                self.ack.immediate = true;
            }
        }
    }

    fn delayed_ack_due(&self, now: Instant) -> bool {
        self.ack.window_update || self.ack.deadline.is_some_and(|d| d <= now)
    }

    fn transmit(&mut self, route: usize, body: PacketBody) -> Transmit {
        let packet = Packet {
            job_key: self.job_key,
            source: self.local,
            destination: self.peer,
            body,
        };
        self.paths.on_transmit(route, packet.encoded_len());
        Transmit { route, packet }
    }

    fn standalone_ack(&mut self) -> Transmit {
        let nack = self.ack.nack.take();
        let mut info = self.received.ack_info(nack);
        info.duplicate = self.ack.duplicate.take().filter(|_| nack.is_none());
        self.ack = AckState::new(info.window_end);
        self.stats.acks_sent += 1;
        if nack.is_some() {
            self.stats.nacks_sent += 1;
        }
        let route = self.paths.ack_route(self.last_data_route);
        self.transmit(route, PacketBody::Ack(info))
    }

    /// A DATA packet with the current acknowledgement piggybacked; it satisfies a pending
    /// delayed ACK.
    fn data(&mut self, route: usize, seq: u64, payload: PacketPayload) -> Transmit {
        let window_end = self.received.window_end();
        if self.ack.pending > 0 || self.ack.window_update {
            self.stats.acks_piggybacked += 1;
        }
        self.ack.pending = 0;
        self.ack.deadline = None;
        self.ack.window_update = false;
        self.ack.advertised_end = window_end;
        let body = PacketBody::Data {
            seq,
            ack: self.received.next_expected() - 1,
            window_end,
            payload,
        };
        self.transmit(route, body)
    }

    /// The next packet to send now, and its route, if any: PONGs and PINGs first, then an
    /// immediate ACK, retransmissions, new DATA within the window (each carrying the current
    /// ACK), and last a delayed ACK that no DATA carried.
    pub fn poll_transmit(&mut self, now: Instant) -> Option<Transmit> {
        if let Some(t) = self.next_transmit(now) {
            return Some(t);
        }
        // Nothing (more) to send: now apply a deferred acknowledgement, which may open the
        // window or prove packets lost.
        if self.deferred_ack.is_some() {
            self.settle_ack();
            return self.next_transmit(now);
        }
        None
    }

    fn next_transmit(&mut self, now: Instant) -> Option<Transmit> {
        if let Some((route, nonce)) = self.pongs.pop_front() {
            self.stats.pongs_sent += 1;
            return Some(self.transmit(route, PacketBody::Pong { nonce }));
        }
        if !self.dead {
            if let Some((route, nonce)) = self.paths.take_probe() {
                self.stats.pings_sent += 1;
                return Some(self.transmit(route, PacketBody::Ping { nonce }));
            }
            if self.liveness.take_ping() {
                let paths = &self.paths;
                self.keepalive_routes.clear();
                self.keepalive_routes
                    .extend((0..paths.len()).rev().filter(|&r| paths.is_up(r)));
                if self.keepalive_routes.is_empty() {
                    self.keepalive_routes.push(0);
                }
            }
            if let Some(route) = self.keepalive_routes.pop() {
                self.stats.keepalives_sent += 1;
                let nonce = KEEPALIVE_NONCE;
                return Some(self.transmit(route, PacketBody::Ping { nonce }));
            }
            if std::mem::take(&mut self.bye_due) {
                let route = self.paths.primary().unwrap_or(0);
                return Some(self.transmit(route, PacketBody::Bye));
            }
        }
        if self.ack.immediate {
            return Some(self.standalone_ack());
        }
        if !self.dead {
            if self.deferred_ack.is_some() && self.sent.has_due() {
                // The deferred acknowledgement may cover what would be resent.
                self.settle_ack();
            }
            let paths = &self.paths;
            let resend = self
                .sent
                .pop_due(now, |p| paths.pick_retransmit(p.payload.len(), p.route));
            if let Some(r) = resend {
                self.stats.retransmitted += 1;
                self.paths
                    .on_resent(r.previous_route, r.route, r.payload.len());
                return Some(self.data(r.route, r.seq, r.payload));
            }
            let window_open = self.sent.len() < self.config.window as usize
                && (self.next_seq < self.peer_window_end || self.sent.is_empty());
            if window_open {
                if let Some(payload) = self.unsent.pop_front() {
                    let seq = self.next_seq;
                    self.next_seq += 1;
                    let route = self.paths.pick_new(payload.len());
                    self.sent.on_sent(seq, payload.clone(), now, route);
                    self.paths.on_data_sent(route, payload.len());
                    self.stats.sent += 1;
                    return Some(self.data(route, seq, payload));
                }
            }
        }
        if self.delayed_ack_due(now) {
            return Some(self.standalone_ack());
        }
        None
    }

    /// The next payload received in order, for the application.
    pub fn poll_deliver(&mut self) -> Option<Bytes> {
        let payload = self.received.pop()?;
        self.stats.delivered += 1;
        // Tell a sender that may be held back by our window that it opened again.
        let window = self.received.capacity();
        let end = self.received.window_end();
        let room_left = self
            .ack
            .advertised_end
            .saturating_sub(self.received.next_expected());
        if room_left < window / 2 && end >= self.ack.advertised_end + (window / 4).max(1) {
            self.ack.window_update = true;
        }
        Some(payload)
    }

    /// When [`handle_timeout`](Self::handle_timeout) should be called next, if a timer runs: the
    /// delayed ACK, the loss timer, the retransmission timer or the next probe of a Down route.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if let Some((at, _)) = self.deferred_ack {
            return Some(at);
        }
        let ack = self.ack.deadline.filter(|_| self.ack.pending > 0);
        let (retransmit, tail, loss, probe, liveness) = if self.dead {
            (None, None, None, None, None)
        } else {
            (
                self.sent
                    .next_timeout(self.rtt.rto(), self.config.max_backoff),
                self.tail_probe_timeout().and_then(|pto| {
                    self.sent
                        .next_tail_probe(pto, self.rtt.rto(), self.config.max_backoff)
                }),
                self.sent.next_loss_time_with(|p| {
                    self.paths
                        .loss_delay(p.route, self.reorder_quarters)
                        .unwrap_or_else(|| self.loss_delay())
                }),
                self.paths.poll_timeout(),
                self.liveness.poll_timeout(self.awaiting()),
            )
        };
        [ack, retransmit, tail, loss, probe, liveness]
            .into_iter()
            .flatten()
            .min()
    }

    /// Handles expired timers (an early call does nothing).
    pub fn handle_timeout(&mut self, now: Instant) {
        self.settle_ack();
        if self.dead {
            return;
        }
        self.update_loss_delays();
        let (paths, delays) = (&mut self.paths, &self.loss_delays);
        self.sent.detect_lost_with(
            now,
            |p| delays.get(p.route).copied().unwrap_or_default(),
            |event| {
                if let QueueEvent::Lost(p) = event {
                    paths.on_lost(p);
                }
            },
        );
        if self.liveness.on_timeout(now, self.awaiting()) {
            self.dead = true;
            self.bye_due = false;
            self.events
                .push_back(LinkEvent::PeerDead { rank: self.peer });
            return;
        }
        if let Some(seq) = self
            .sent
            .on_timeout(now, self.rtt.rto(), self.config.max_backoff)
        {
            self.stats.timeouts += 1;
            if let Some(p) = self.sent.get(seq) {
                self.paths.on_timer_expired(p.route);
            }
        } else if let Some(pto) = self.tail_probe_timeout() {
            let (rto, max_backoff) = (self.rtt.rto(), self.config.max_backoff);
            if self
                .sent
                .on_tail_probe(now, pto, rto, max_backoff)
                .is_some()
            {
                self.stats.tail_probes += 1;
            }
        }
        self.paths.end_pass(now, self.strike_spacing());
        self.paths.on_timeout(now);
        self.take_route_changes();
    }

    /// The next event, if any.
    pub fn poll_event(&mut self) -> Option<LinkEvent> {
        self.events.pop_front()
    }
}
