//! [`AdaptiveTransport`]: adaptive connection management (Yu, ch. 3). Every rank starts with
//! one UD queue pair per port and no RC connection; a peer's traffic goes over UD (made
//! reliable by the link layer) until it deserves an RC connection, which the
//! [`ConnectionManager`] sets up over UD; then it moves to RC.
//!
//! The parts, each its own module:
//!
//! * UD: a [`LinkTransport`] over a [`UdCarrier`], one route per port: sequence numbers, CRC,
//!   ACK/NACK and retransmission from `rankweave_core::reliability`, MTU-sized frames, and
//!   striping and failover across ports by its path scheduler.
//! * RC: an [`RcTransport`] whose queue pairs are made per peer on demand.
//! * The connection set-up: a [`ConnectionManager`] whose messages ride the UD carrier's side
//!   channel.
//! * RC lane fail-back: a [`LaneReconnector`] whose lane messages ride the same side channel;
//!   when a port comes back, each failed lane on it is re-established on new queue pairs
//!   (see [`super::lane_reconnect`]).
//!
//! The driver here counts frames per peer. When the count passes
//! [`AdaptiveSettings::connect_after`] (or a frame too large for one UD datagram is sent), it
//! makes the RC queue pair for the peer and starts the exchange; frames keep going over UD
//! meanwhile (a large frame, and everything after it, waits). When the connection is
//! established, later frames wait until everything already sent over UD to that peer is
//! acknowledged, then they and all later ones go over RC: a peer never receives an RC frame
//! before a UD frame sent earlier, because it handed that UD frame to its message layer
//! before it acknowledged it, and drains UD before RC. A failed exchange leaves the peer on
//! UD (and starts again after another `connect_after` frames); with a large frame waiting it
//! starts again at once: that frame was accepted (its send may have completed), so it waits
//! for a connection as long as UD's liveness reports the peer alive.
//!
//! Closing: the two sides close once nothing is held, and a frame held for a connection waits
//! at most [`RcSettings::linger`] after [`close`](Transport::close): a peer that closed first
//! answers no exchange, and UD's liveness never reports a peer that said BYE, so without that
//! bound such a frame would keep the rank from ever draining.
//!
//! Losses: a peer is reported lost once. While it has an RC connection, the RC side's report
//! (BYE after its last frame, or a failed work request) is the one that counts: a UD loss
//! report is held for [`AdaptiveSettings::loss_grace`] in case RC frames are still coming.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use rankweave_core::frame::Frame;
use rankweave_core::{Arrival, Capabilities, Transport, TransportError, TransportStats};
use rustc_hash::FxHashSet;
use tokio::time::Sleep;

use super::connection_manager::{CmConfig, CmCounters, CmEvent, CmMessage, ConnectionManager};
use super::error::VerbsError;
use super::lane_reconnect::{LaneCounters, LaneEvent, LaneReconnector};
use super::provider::Provider;
use super::rc::{RcSettings, RcTransport};
use super::shared_port::{PortHandle, SharedPort};
use super::ud_carrier::{UdCarrier, UdCounters, UdSettings};
use crate::link::{LinkTransport, LinkTransportConfig};

/// Settings of an [`AdaptiveTransport`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdaptiveSettings {
    /// Frames sent to a peer over UD before an RC connection to it is made; `None`: never
    /// (UD only, frames limited to one datagram and the message layer fragments).
    pub connect_after: Option<u64>,
    /// The connection exchange's retransmission.
    pub cm: CmConfig,
    /// The UD carrier's buffers and queue key.
    pub ud: UdSettings,
    /// The RC connections' settings.
    pub rc: RcSettings,
    /// How long a UD loss report of an RC-connected peer waits for the RC side's.
    pub loss_grace: Duration,
}

impl Default for AdaptiveSettings {
    fn default() -> Self {
        AdaptiveSettings {
            connect_after: Some(16),
            cm: CmConfig::default(),
            ud: UdSettings::default(),
            rc: RcSettings::default(),
            loss_grace: Duration::from_secs(1),
        }
    }
}

/// Counters of an [`AdaptiveTransport`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AdaptiveCounters {
    /// Frames sent over UD.
    pub frames_over_ud: u64,
    /// Frames sent over RC.
    pub frames_over_rc: u64,
    /// Peers whose traffic moved to RC.
    pub switched_to_rc: u64,
    /// The connection manager's counters.
    pub cm: CmCounters,
    /// The lane fail-back exchanges' counters.
    pub lanes: LaneCounters,
    /// The UD carrier's counters.
    pub ud: UdCounters,
    /// Connection-management datagrams that did not decode.
    pub malformed_control: u64,
    /// Queue pair operations the connection manager asked for that failed.
    pub connect_errors: u64,
    /// Frames still held (waiting for a connection or for UD's acknowledgements) when the
    /// linger after close ran out: dropped.
    pub dropped_on_close: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    /// Over UD (an RC connection may be under way).
    Ud,
    /// Connected; frames wait until UD is acknowledged.
    Switching,
    /// Over RC.
    Rc,
}

struct PeerPath {
    path: Path,
    /// Frames sent since the last connection attempt.
    sent: u64,
    /// Frames waiting (for the connection, or for UD to be acknowledged), in order.
    held: VecDeque<Frame>,
    /// When UD reported the peer lost while it had an RC connection.
    ud_lost_at: Option<Instant>,
}

struct State {
    cm: ConnectionManager,
    lanes: LaneReconnector,
    peers: Vec<PeerPath>,
    lost: FxHashSet<u32>,
    ready: VecDeque<Arrival>,
    scratch: Vec<Arrival>,
    control: Vec<(u32, bytes::Bytes)>,
    timer: Option<Pin<Box<Sleep>>>,
    closing: bool,
    /// When [`close`](Transport::close) was called: held frames wait until the linger is up.
    closing_since: Option<Instant>,
    closed: bool,
    counters: AdaptiveCounters,
}

/// One rank's transport with connections made on demand (see the [module docs](self)).
pub struct AdaptiveTransport<P: Provider> {
    rank: u32,
    size: u32,
    settings: AdaptiveSettings,
    ud: LinkTransport<UdCarrier<PortHandle<P>>>,
    ud_max_payload: usize,
    rc: RcTransport<PortHandle<P>>,
    state: Mutex<State>,
}

impl<P: Provider> std::fmt::Debug for AdaptiveTransport<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdaptiveTransport")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish_non_exhaustive()
    }
}

impl<P: Provider> AdaptiveTransport<P> {
    /// Rank `rank`'s transport: `carrier` (its UD routes, peers set) under a link layer with
    /// `link`, and `rc` for the RC connections (made with [`RcTransport::on_demand`], one
    /// lane per port).
    pub fn new(
        carrier: UdCarrier<PortHandle<P>>,
        rc: RcTransport<PortHandle<P>>,
        link: LinkTransportConfig,
        settings: AdaptiveSettings,
    ) -> AdaptiveTransport<P> {
        let (rank, size) = (link.rank, link.size);
        let ud = LinkTransport::new(carrier, link);
        let ud_max_payload = ud.capabilities().max_payload;
        AdaptiveTransport {
            rank,
            size,
            settings,
            ud,
            ud_max_payload,
            rc,
            state: Mutex::new(State {
                cm: ConnectionManager::new(rank, settings.cm),
                lanes: LaneReconnector::new(rank, settings.cm),
                peers: (0..size)
                    .map(|_| PeerPath {
                        path: Path::Ud,
                        sent: 0,
                        held: VecDeque::new(),
                        ud_lost_at: None,
                    })
                    .collect(),
                lost: FxHashSet::default(),
                ready: VecDeque::new(),
                scratch: Vec::new(),
                control: Vec::new(),
                timer: None,
                closing: false,
                closing_since: None,
                closed: false,
                counters: AdaptiveCounters::default(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Its counters.
    pub fn counters(&self) -> AdaptiveCounters {
        let s = self.lock();
        AdaptiveCounters {
            cm: s.cm.counters(),
            lanes: s.lanes.counters(),
            ud: self.ud.carrier().counters(),
            ..s.counters
        }
    }

    /// Whether frames to `peer` go over RC now.
    pub fn is_over_rc(&self, peer: u32) -> bool {
        self.lock()
            .peers
            .get(peer as usize)
            .is_some_and(|p| p.path == Path::Rc)
    }

    /// The UD side (its link layer and carrier), for statistics and tests.
    pub fn ud(&self) -> &LinkTransport<UdCarrier<PortHandle<P>>> {
        &self.ud
    }

    /// The RC side, for statistics and tests.
    pub fn rc(&self) -> &RcTransport<PortHandle<P>> {
        &self.rc
    }

    /// Sends a connection or lane message over the UD carrier's side channel.
    fn send_control(&self, to: u32, m: CmMessage) {
        let mut bytes = Vec::with_capacity(CmMessage::MAX_LEN);
        m.encode(&mut bytes);
        if let Err(e) = self.ud.carrier().send_control(to, &bytes) {
            // Lost like any datagram: the sender's state machine retransmits.
            tracing::debug!(rank = self.rank, to, error = %e, "connection message not sent");
        }
    }

    /// RC lane fail-back: carries out the lane events on the RC side, starts the exchange for
    /// every failed lane whose port came back (and is not being exchanged already), and sends
    /// the lane messages.
    fn run_lanes(&self, s: &mut State, now: Instant) {
        // Events first: a lane the exchange just established is not started again.
        while let Some(ev) = s.lanes.poll_event() {
            match ev {
                LaneEvent::Open { peer, lane, remote } => {
                    let opened = self
                        .rc
                        .reopen_lane(peer, usize::from(lane))
                        .and_then(|local| {
                            self.rc.connect_lane(peer, usize::from(lane), remote)?;
                            Ok(local)
                        });
                    match opened {
                        Ok(local) => s.lanes.accepted(now, peer, lane, local),
                        Err(e) => {
                            tracing::debug!(rank = self.rank, peer, lane, error = %e, "lane not reopened");
                            s.counters.connect_errors += 1;
                            s.lanes.open_failed(peer, lane);
                        }
                    }
                }
                LaneEvent::Connect { peer, lane, remote } => {
                    if let Err(e) = self.rc.connect_lane(peer, usize::from(lane), remote) {
                        tracing::debug!(rank = self.rank, peer, lane, error = %e, "lane not connected");
                        s.counters.connect_errors += 1;
                    }
                }
                LaneEvent::Established { peer, lane } => {
                    self.rc.lane_established(peer, usize::from(lane));
                }
                LaneEvent::Failed { peer, lane } => {
                    self.rc.abandon_reopened_lane(peer, usize::from(lane));
                }
            }
        }
        for (peer, lane) in self.rc.lanes_to_reopen() {
            let Ok(lane_byte) = u8::try_from(lane) else {
                continue;
            };
            if s.lanes.is_busy(peer, lane_byte) {
                continue;
            }
            match self.rc.reopen_lane(peer, lane) {
                Ok(local) => {
                    s.lanes.start(now, peer, lane_byte, local);
                }
                Err(e) => {
                    tracing::debug!(rank = self.rank, peer, lane, error = %e, "lane not reopened");
                    s.counters.connect_errors += 1;
                }
            }
        }
        while let Some((to, m)) = s.lanes.poll_transmit() {
            self.send_control(to, m);
        }
    }

    /// Carries out what the connection manager decided, then sends its messages.
    fn run_cm(&self, s: &mut State) {
        let mut again = Vec::new();
        loop {
            self.run_cm_once(s, &mut again);
            if again.is_empty() {
                return;
            }
            // A large frame waits for these peers and their exchange failed: the frame was
            // accepted already (its send may have completed), so it is not dropped while the
            // peer lives; the exchange starts again (a dead peer is reported by UD's liveness).
            let now = Instant::now();
            for peer in again.drain(..) {
                match self.rc.open_peer(peer) {
                    Ok(local) => s.cm.start(now, peer, local),
                    Err(e) => {
                        tracing::warn!(rank = self.rank, peer, error = %e, "no RC queue pair");
                        s.counters.connect_errors += 1;
                        if let Some(p) = s.peers.get_mut(peer as usize) {
                            p.held.clear();
                        }
                        if s.lost.insert(peer) {
                            s.ready.push_back(Arrival::PeerLost { rank: peer });
                        }
                    }
                }
            }
        }
    }

    fn run_cm_once(&self, s: &mut State, again: &mut Vec<u32>) {
        // Events first: the queue pair is connected before the Reply (or Confirm) that lets
        // the peer send on it leaves, as an InfiniBand CM moves its queue pair to RTR before
        // it answers. Sent first, a Reply could reach a peer on another thread that connects
        // and writes before this side's queue pair is ready: the write fails, and each side
        // reports the other lost (seen once in a few hundred multi-rank runs).
        while let Some(ev) = s.cm.poll_event() {
            match ev {
                CmEvent::Connect { peer, remote } => {
                    if let Err(e) = self.rc.connect_peer(peer, remote) {
                        tracing::warn!(rank = self.rank, peer, error = %e, "RC connect failed");
                        s.counters.connect_errors += 1;
                    }
                }
                CmEvent::Established { peer } => {
                    if let Some(p) = s.peers.get_mut(peer as usize) {
                        p.path = Path::Switching;
                    }
                }
                CmEvent::Failed { peer } => {
                    let Some(p) = s.peers.get_mut(peer as usize) else {
                        continue;
                    };
                    p.sent = 0;
                    // What waits fits UD up to the first large frame; that one waits for
                    // another exchange.
                    while let Some(f) = p.held.pop_front() {
                        if f.payload.len() > self.ud_max_payload {
                            p.held.push_front(f);
                            if !s.lost.contains(&peer) && !again.contains(&peer) {
                                again.push(peer);
                            }
                            break;
                        }
                        s.counters.frames_over_ud += 1;
                        let _ = self.ud.send(peer, f);
                    }
                }
            }
        }
        while let Some((to, m)) = s.cm.poll_transmit() {
            self.send_control(to, m);
        }
    }

    /// Moves switching peers whose UD traffic is all acknowledged to RC, with what they hold.
    fn switch_ready(&self, s: &mut State) {
        for peer in 0..self.size {
            let p = &mut s.peers[peer as usize];
            if p.path != Path::Switching || !self.ud.is_idle_towards(peer) {
                continue;
            }
            p.path = Path::Rc;
            s.counters.switched_to_rc += 1;
            while let Some(f) = p.held.pop_front() {
                s.counters.frames_over_rc += 1;
                let _ = self.rc.send(peer, f);
            }
        }
    }

    /// Receives from both sides, runs the connection manager, and queues arrivals.
    fn advance(&self, s: &mut State, now: Instant) -> Result<(), TransportError> {
        let mut scratch = std::mem::take(&mut s.scratch);
        scratch.clear();
        self.ud.drain(&mut scratch)?;
        self.take_arrivals(s, &mut scratch, now, false);
        let mut control = std::mem::take(&mut s.control);
        self.ud.carrier().take_control(&mut control);
        for (from, bytes) in control.drain(..) {
            let m = match CmMessage::decode(&bytes) {
                Ok(m) => m,
                Err(e) => {
                    tracing::debug!(rank = self.rank, from, error = %e, "bad connection message");
                    s.counters.malformed_control += 1;
                    continue;
                }
            };
            if m.is_lane_message() {
                s.lanes.handle_message(now, from, m);
                continue;
            }
            let local = match m {
                CmMessage::Confirm { .. } if !self.rc_known(from) => continue,
                _ => match self.rc.open_peer(from) {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!(rank = self.rank, from, error = %e, "no RC queue pair");
                        s.counters.connect_errors += 1;
                        continue;
                    }
                },
            };
            s.cm.handle_message(now, from, local, m);
        }
        s.control = control;
        if s.cm.poll_timeout().is_some_and(|t| t <= now) {
            s.cm.handle_timeout(now);
        }
        if s.lanes.poll_timeout().is_some_and(|t| t <= now) {
            s.lanes.handle_timeout(now);
        }
        self.run_cm(s);
        self.switch_ready(s);
        self.rc.drain(&mut scratch)?;
        self.take_arrivals(s, &mut scratch, now, true);
        self.run_lanes(s, now);
        // UD loss reports held for RC-connected peers whose grace ran out.
        for peer in 0..self.size {
            let p = &mut s.peers[peer as usize];
            if p.ud_lost_at
                .is_some_and(|t| now >= t + self.settings.loss_grace)
            {
                p.ud_lost_at = None;
                if s.lost.insert(peer) {
                    s.ready.push_back(Arrival::PeerLost { rank: peer });
                }
            }
        }
        s.scratch = scratch;
        if s.closing && !s.closed {
            self.drop_held_after_linger(s, now);
            if s.peers.iter().all(|p| p.held.is_empty()) {
                s.closed = true;
                self.ud.close();
                self.rc.close();
            }
        }
        Ok(())
    }

    /// Closing, with the linger up: drops what is still held. A large frame waits for its
    /// exchange as long as the peer lives, and the exchange starts again after each failure;
    /// but a peer that has closed already (the frame was one it no longer needed, such as a
    /// broadcast repair that crossed its completion) answers no exchange, and UD's liveness,
    /// which would end the wait for a dead peer, never reports one that said BYE with nothing
    /// of ours unacknowledged. Without this bound the rank would never drain, and its shutdown
    /// would never return.
    fn drop_held_after_linger(&self, s: &mut State, now: Instant) {
        if s.closing_since
            .is_none_or(|t| now < t + self.settings.rc.linger)
        {
            return;
        }
        for (peer, p) in s.peers.iter_mut().enumerate() {
            if p.held.is_empty() {
                continue;
            }
            tracing::debug!(
                rank = self.rank,
                peer,
                frames = p.held.len(),
                "closing: frames still waiting for a connection dropped after the linger"
            );
            s.counters.dropped_on_close += p.held.len() as u64;
            p.held.clear();
        }
    }

    fn rc_known(&self, peer: u32) -> bool {
        self.rc.is_connected(peer)
    }

    fn take_arrivals(&self, s: &mut State, from: &mut Vec<Arrival>, now: Instant, rc: bool) {
        for a in from.drain(..) {
            match a {
                Arrival::PeerLost { rank } => {
                    let connected = s
                        .peers
                        .get(rank as usize)
                        .is_some_and(|p| p.path != Path::Ud);
                    if !rc && connected {
                        if let Some(p) = s.peers.get_mut(rank as usize) {
                            p.ud_lost_at.get_or_insert(now);
                        }
                    } else if s.lost.insert(rank) {
                        // Frames waiting for a connection to it go nowhere now.
                        if let Some(p) = s.peers.get_mut(rank as usize) {
                            p.held.clear();
                        }
                        s.ready.push_back(Arrival::PeerLost { rank });
                    }
                }
                frame => s.ready.push_back(frame),
            }
        }
    }

    fn next_deadline(&self, s: &State) -> Option<Instant> {
        let grace = s
            .peers
            .iter()
            .filter_map(|p| p.ud_lost_at.map(|t| t + self.settings.loss_grace))
            .min();
        [s.cm.poll_timeout(), s.lanes.poll_timeout(), grace]
            .into_iter()
            .flatten()
            .min()
    }
}

impl<P: Provider> Transport for AdaptiveTransport<P> {
    fn capabilities(&self) -> Capabilities {
        let connect = self.settings.connect_after.is_some();
        Capabilities {
            reliable: true,
            ordered: true,
            max_payload: if connect {
                usize::MAX
            } else {
                self.ud_max_payload
            },
            multicast: false,
            rdma: connect,
            by_reference: false,
        }
    }

    fn send(&self, to: u32, frame: Frame) -> Result<(), TransportError> {
        if to >= self.size {
            return Err(TransportError::PeerUnreachable(to as usize));
        }
        let mut guard = self.lock();
        let s = &mut *guard;
        if s.closing {
            return Err(TransportError::Closed);
        }
        if to == self.rank {
            return self.rc.send(to, frame);
        }
        if s.lost.contains(&to) {
            return Ok(());
        }
        let large = frame.payload.len() > self.ud_max_payload;
        let now = Instant::now();
        let p = &mut s.peers[to as usize];
        match p.path {
            Path::Rc => {
                s.counters.frames_over_rc += 1;
                return self.rc.send(to, frame);
            }
            Path::Switching => {
                p.held.push_back(frame);
                self.switch_ready(s);
                return Ok(());
            }
            Path::Ud => {}
        }
        p.sent += 1;
        let Some(threshold) = self.settings.connect_after else {
            if large {
                return Err(TransportError::Io {
                    op: "verbs UD send",
                    message: format!(
                        "a frame of {} bytes exceeds one datagram ({} bytes)",
                        frame.payload.len(),
                        self.ud_max_payload
                    ),
                });
            }
            s.counters.frames_over_ud += 1;
            return self.ud.send(to, frame);
        };
        let wants_rc = large || p.sent > threshold;
        if large || !p.held.is_empty() {
            p.held.push_back(frame);
        } else {
            s.counters.frames_over_ud += 1;
            self.ud.send(to, frame)?;
        }
        if wants_rc && !s.cm.is_connecting(to) && !s.cm.is_connected(to) {
            match self.rc.open_peer(to) {
                Ok(local) => s.cm.start(now, to, local),
                Err(e) => {
                    tracing::warn!(rank = self.rank, to, error = %e, "no RC queue pair");
                    s.counters.connect_errors += 1;
                }
            }
            self.run_cm(s);
        }
        Ok(())
    }

    fn drain(&self, out: &mut Vec<Arrival>) -> Result<usize, TransportError> {
        let mut guard = self.lock();
        let s = &mut *guard;
        self.advance(s, Instant::now())?;
        let n = s.ready.len();
        out.extend(s.ready.drain(..));
        Ok(n)
    }

    fn poll_arrival(&self, cx: &mut Context<'_>) -> Poll<()> {
        let mut guard = self.lock();
        let s = &mut *guard;
        if !s.ready.is_empty() {
            return Poll::Ready(());
        }
        let mut ready = self.ud.poll_arrival(cx).is_ready();
        ready |= self.rc.poll_arrival(cx).is_ready();
        // A switching peer waits for UD's acknowledgements (`ud.poll_arrival` wakes us for
        // them); once they are in, `drain` must run to move it.
        ready |= switching(s).into_iter().any(|p| self.ud.is_idle_towards(p));
        match self.next_deadline(s) {
            Some(deadline) => {
                let deadline = tokio::time::Instant::from_std(deadline);
                match &mut s.timer {
                    Some(t) if t.deadline() == deadline => {}
                    Some(t) => t.as_mut().reset(deadline),
                    None => s.timer = Some(Box::pin(tokio::time::sleep_until(deadline))),
                }
                if let Some(t) = &mut s.timer {
                    ready |= t.as_mut().poll(cx).is_ready();
                }
            }
            None => s.timer = None,
        }
        if ready {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    fn begin_busy_poll(&self) {
        self.ud.begin_busy_poll();
    }

    fn end_busy_poll(&self) {
        self.ud.end_busy_poll();
    }

    fn waiter_parked(&self) {
        self.ud.waiter_parked();
    }

    fn close(&self) {
        let mut guard = self.lock();
        let s = &mut *guard;
        if s.closing {
            return;
        }
        s.closing = true;
        s.closing_since = Some(Instant::now());
        // Frames still held wait for their connection or for UD's acknowledgements; the two
        // sides close (and say BYE) once none is left.
        let _ = self.advance(s, Instant::now());
    }

    fn is_drained(&self) -> bool {
        let mut guard = self.lock();
        let s = &mut *guard;
        let _ = self.advance(s, Instant::now());
        s.closed && self.ud.is_drained() && self.rc.is_drained()
    }

    fn stats(&self) -> TransportStats {
        let mut stats = self.ud.stats();
        stats.peers_lost = self.lock().lost.len() as u64;
        stats
    }
}

/// One rank's two sides before its peers are known: the UD carrier (one route per port) and
/// the RC transport whose connections are made on demand (one lane per port).
pub struct AdaptiveParts<P: Provider> {
    /// The UD carrier.
    pub carrier: UdCarrier<PortHandle<P>>,
    /// The RC transport.
    pub rc: RcTransport<PortHandle<P>>,
}

impl<P: Provider> AdaptiveParts<P> {
    /// Opens rank `rank`'s UD queue pairs and RC transport on `ports` (at least one, at most
    /// [`MAX_LANES`](super::stream::MAX_LANES)) for a `size`-rank job.
    pub fn open(
        ports: &[SharedPort<P>],
        rank: u32,
        size: u32,
        settings: &AdaptiveSettings,
    ) -> Result<AdaptiveParts<P>, VerbsError> {
        let handles = || ports.iter().map(SharedPort::handle).collect();
        Ok(AdaptiveParts {
            carrier: UdCarrier::new(handles(), rank, size, settings.ud)?,
            rc: RcTransport::on_demand(handles(), rank, size, settings.rc)?,
        })
    }

    /// The transport of job `job_key` over these parts (the carrier's peers set, or its
    /// directory given), with the link layer's `peer_timeout`.
    pub fn into_transport(
        self,
        job_key: u64,
        peer_timeout: Duration,
        settings: AdaptiveSettings,
    ) -> Arc<AdaptiveTransport<P>> {
        let rank = self.carrier.rank();
        let size = self.carrier.size();
        let link = LinkTransportConfig::new(rank, size, job_key).with_peer_timeout(peer_timeout);
        Arc::new(AdaptiveTransport::new(
            self.carrier,
            self.rc,
            link,
            settings,
        ))
    }
}

fn switching(s: &State) -> Vec<u32> {
    (0u32..)
        .zip(&s.peers)
        .filter(|(_, p)| p.path == Path::Switching)
        .map(|(r, _)| r)
        .collect()
}

/// Connects the UD carriers of one process's ranks to each other: `carriers[rank]`'s
/// addresses go to every other (the exchange a multi-process job does through its key-value
/// store, O(1) per rank: one UD address per port).
pub fn introduce<P: Provider>(carriers: &[&UdCarrier<P>]) -> Result<(), VerbsError> {
    let table: Vec<_> = carriers.iter().map(|c| c.addresses()).collect();
    for c in carriers {
        c.set_peers(&table)?;
    }
    Ok(())
}
