//! [`LinkTransport`]: a [`Transport`] made of a [`Carrier`] and the end-to-end reliability layer.
//!
//! This is the thin IO driver around the sans-IO [`ReliableLink`]s (one per peer, created when
//! the peer is first heard from or sent to): it feeds them the datagrams the carrier received and
//! the time, sends what they produce over the routes they chose, and hands the frames they deliver
//! to the message layer. Everything about sequence numbers, ACK/NACK, retransmission, striping and
//! failover lives in `rankweave_core::reliability`; this file only moves bytes and counts.
//!
//! With reliability **off** each frame travels as one raw packet (job key and a header CRC, no
//! sequence number) on route 0: nothing is retransmitted, so a lost datagram is a lost frame. That
//! mode exists to measure what reliability costs and for fabrics that do not lose packets.
//!
//! # What happens to a received datagram
//!
//! 1. No known sender (`from: None`, or a rank outside the job) → dropped, `foreign_dropped`.
//! 2. [`Packet::decode`] with the job key: a CRC mismatch → `crc_failures` and, with reliability
//!    on, reported to the sender's link (which NACKs it); another job's key or a packet addressed
//!    to another rank → `foreign_dropped`; anything else that does not decode → `malformed_dropped`.
//! 3. A packet of the wrong mode (raw while reliability is on, or the reverse) → `malformed_dropped`.
//! 4. Otherwise the link takes it; payloads it delivers (in order, exactly once) are decoded as
//!    frames (`malformed_dropped` if that fails) and handed to the message layer.
//!
//! # Liveness
//!
//! Every link runs keepalive (see `rankweave_core::reliability::liveness`): a peer silent for the
//! peer timeout is reported lost ([`Arrival::PeerLost`]), and operations involving it fail with
//! `PeerFailed`. A closing rank says BYE to every peer it has a link with once its data was
//! acknowledged (or the linger time is up), so its silence afterwards is no failure.
//!
//! # Timers
//!
//! The links' retransmission, delayed-ACK and probe timers are served by
//! [`poll_arrival`](Transport::poll_arrival), which the rank's progress task polls: it arms one
//! tokio timer for the earliest deadline of all links. After the rank closes, a linger task keeps
//! serving the links (up to [`LinkTransportConfig::linger`]) until everything it sent was
//! acknowledged, so a rank that sends and exits does not lose its last messages.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rankweave_core::reliability::{
    LinkConfig, LinkEvent, Packet, PacketBody, PacketError, PacketPayload, ReliableLink,
};
use rankweave_core::stats::{RouteCounters, TransportStats};
use rankweave_core::{Arrival, Capabilities, Carrier, Datagram, Transport, TransportError, wire};
use rustc_hash::{FxHashMap, FxHashSet};
use tokio::time::Sleep;

/// Settings of a [`LinkTransport`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkTransportConfig {
    /// This rank's world rank.
    pub rank: u32,
    /// Ranks in the job.
    pub size: u32,
    /// The job's key: packets carrying another are dropped as foreign.
    pub job_key: u64,
    /// Run the reliability layer (`true`) or send raw packets (`false`).
    pub reliability: bool,
    /// Settings of every peer's link.
    pub link: LinkConfig,
    /// How long a closed rank keeps retransmitting what its peers have not acknowledged yet.
    pub linger: Duration,
}

impl LinkTransportConfig {
    /// Defaults for rank `rank` of a `size`-rank job with key `job_key`: reliability on, the
    /// default peer timeout with keepalive.
    pub fn new(rank: u32, size: u32, job_key: u64) -> Self {
        let link = LinkConfig {
            window: WINDOW,
            ..LinkConfig::default()
        };
        let timeout = link.peer_timeout;
        LinkTransportConfig {
            rank,
            size,
            job_key,
            reliability: true,
            link: link.with_peer_timeout(timeout),
            linger: Duration::from_secs(2),
        }
    }

    /// These settings with peer timeout `timeout` (keepalive after a fifth of it).
    pub fn with_peer_timeout(mut self, timeout: Duration) -> Self {
        self.link = self.link.with_peer_timeout(timeout);
        self
    }

    /// These settings with at most `window` packets unacknowledged per peer, if given
    /// (`Config::link_window`); else the transport's default.
    pub fn with_window(mut self, window: Option<u32>) -> Self {
        if let Some(w) = window {
            self.link.window = w;
        }
        self
    }
}

/// A transport made of a carrier and, optionally, the reliability layer (see the
/// [module docs](self)).
pub struct LinkTransport<C: Carrier> {
    shared: Arc<Shared<C>>,
}

struct Shared<C> {
    carrier: C,
    config: LinkTransportConfig,
    max_payload: usize,
    closed: AtomicBool,
    /// Closed, and done delivering (or given up): see [`Transport::is_drained`].
    drained: AtomicBool,
    /// Futures busy-polling this rank right now ([`Transport::begin_busy_poll`]). While there
    /// are any, they run the links' timers themselves, so a deadline that moves earlier does
    /// not wake the parked progress task (a cross-thread wake per message otherwise).
    busy_pollers: AtomicUsize,
    /// The last drain emptied the carrier (it read until every socket would block) and the
    /// ready queue, and nothing was queued since: the busy poller's next look can skip the
    /// system call that would only find the sockets empty again (see `may_have_arrivals`).
    drained_empty: AtomicBool,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    links: LinkTable,
    /// Peers reported lost (once each).
    lost: FxHashSet<u32>,
    /// Frames and losses ready for the message layer.
    ready: VecDeque<Arrival>,
    /// Scratch: what the carrier received.
    datagrams: Vec<Datagram>,
    /// Scratch: an outgoing packet's header.
    header: Vec<u8>,
    timer: Option<Pin<Box<Sleep>>>,
    /// The deadline the parked progress task's timer is armed for (`None`: no timer), and its
    /// waker: a link whose deadline becomes earlier (a send put a packet in flight, say) wakes
    /// it to re-arm, or the retransmission would wait for some unrelated wake-up.
    armed: Option<Instant>,
    timer_waker: Option<std::task::Waker>,
    /// No link has a deadline before this (it may be earlier than the true earliest deadline,
    /// never later), so [`Shared::advance`] scans the links only when it has passed: busy
    /// pollers call `advance` millions of times a second.
    next_due: Option<Instant>,
    /// The carrier has datagrams behind those the last receive took (it stopped at its
    /// limit): the next receive takes them all. Otherwise it takes one, which is usually the
    /// awaited reply, and stops without asking the carrier whether more came (a `recvfrom`
    /// that would block, on the critical path of a ping-pong).
    carrier_backlog: bool,
    /// Peers whose links received while the carrier had a backlog and have not been serviced
    /// since (see [`Shared::advance`]).
    unserviced: Vec<u32>,
    /// Scratch: the peers one [`Shared::advance`] must service (kept to spare an allocation
    /// per received message).
    touched: Vec<u32>,
    counters: Counters,
}

/// Counters this layer keeps itself; the links keep the rest.
#[derive(Default)]
struct Counters {
    foreign_dropped: u64,
    malformed_dropped: u64,
    crc_failures: u64,
    send_errors: u64,
    peers_lost: u64,
    /// Raw mode only (with reliability on, the links count per route).
    raw: Vec<RouteCounters>,
}

/// The links to each peer, indexed by rank.
///
/// A slot per rank of the job rather than a hash map: servicing a link takes it out of its
/// slot and puts it back (so the rest of the state can be borrowed beside it), on every
/// message, and a hash map paid ~260 instructions per message for the removal and
/// re-insertion. Boxed: a link is large and an empty slot should not be. Links are never
/// removed; the ranks that have one are listed, so that walking the links (timers, the
/// progress task's deadline) costs what there are, not the size of the job.
#[derive(Default)]
struct LinkTable {
    slots: Vec<Option<Box<ReliableLink>>>,
    present: Vec<u32>,
}

impl LinkTable {
    fn with_ranks(size: u32) -> Self {
        LinkTable {
            slots: (0..size).map(|_| None).collect(),
            present: Vec::new(),
        }
    }

    fn get(&self, peer: u32) -> Option<&ReliableLink> {
        self.slots.get(peer as usize)?.as_deref()
    }

    fn get_mut(&mut self, peer: u32) -> Option<&mut ReliableLink> {
        self.slots.get_mut(peer as usize)?.as_deref_mut()
    }

    /// The link to `peer` (a rank of the job), made with `make` if there is none yet.
    fn get_or_insert_with(
        &mut self,
        peer: u32,
        make: impl FnOnce() -> ReliableLink,
    ) -> &mut ReliableLink {
        let present = &mut self.present;
        self.slots[peer as usize].get_or_insert_with(|| {
            present.push(peer);
            Box::new(make())
        })
    }

    /// Takes the link to `peer` out of its slot; [`LinkTable::put`] puts it back.
    fn take(&mut self, peer: u32) -> Option<Box<ReliableLink>> {
        self.slots.get_mut(peer as usize)?.take()
    }

    /// Puts back a link [`LinkTable::take`] took.
    fn put(&mut self, peer: u32, link: Box<ReliableLink>) {
        self.slots[peer as usize] = Some(link);
    }

    /// The links, in the order they were made.
    fn iter(&self) -> impl Iterator<Item = (u32, &ReliableLink)> {
        self.present
            .iter()
            .filter_map(|&p| Some((p, self.slots[p as usize].as_deref()?)))
    }

    /// Calls `f` with each link, in the order they were made.
    fn for_each_mut(&mut self, mut f: impl FnMut(u32, &mut ReliableLink)) {
        for &p in &self.present {
            if let Some(l) = self.slots[p as usize].as_deref_mut() {
                f(p, l);
            }
        }
    }
}

impl<C: Carrier> LinkTransport<C> {
    /// Wraps `carrier`.
    pub fn new(carrier: C, config: LinkTransportConfig) -> Self {
        let routes = carrier.routes().max(1);
        let header_room = if config.reliability {
            Packet::max_data_header_len()
        } else {
            Packet::raw_header_len()
        };
        let max_payload = carrier
            .max_datagram()
            .saturating_sub(header_room + wire::MAX_HEADER_LEN)
            .max(1);
        let state = State {
            counters: Counters {
                raw: vec![RouteCounters::default(); routes],
                ..Counters::default()
            },
            links: LinkTable::with_ranks(config.size),
            ..State::default()
        };
        LinkTransport {
            shared: Arc::new(Shared {
                carrier,
                config,
                max_payload,
                closed: AtomicBool::new(false),
                drained: AtomicBool::new(false),
                busy_pollers: AtomicUsize::new(0),
                drained_empty: AtomicBool::new(false),
                state: Mutex::new(state),
            }),
        }
    }

    /// The carrier underneath.
    pub fn carrier(&self) -> &C {
        &self.shared.carrier
    }

    /// Whether everything sent to `peer` was acknowledged and nothing waits to be sent (true
    /// when there is no link to it, or reliability is off). A driver that moves a peer's
    /// traffic to another transport waits for this, so the peer receives in order.
    pub fn is_idle_towards(&self, peer: u32) -> bool {
        let st = self.shared.lock();
        st.links.get(peer).is_none_or(|l| l.is_idle())
    }

    /// One line per peer link: packets in flight, queued and held, the next timer, whether the
    /// peer is dead, and the route states. For diagnosing a stuck job.
    pub fn describe_links(&self) -> String {
        let st = self.shared.lock();
        let now = Instant::now();
        let mut out = String::new();
        for (p, l) in st.links.iter() {
            let timer = l
                .poll_timeout()
                .map(|t| format!("{:?}", t.saturating_duration_since(now)));
            let routes: Vec<String> = l
                .route_stats()
                .iter()
                .map(|r| format!("{}:{}", if r.up { "up" } else { "down" }, r.in_flight_bytes))
                .collect();
            out.push_str(&format!(
                "peer {p}: in_flight {} queued {} held {} idle {} dead {} timer {:?} routes [{}] {:?}\n",
                l.in_flight(),
                l.queued(),
                l.held(),
                l.is_idle(),
                l.is_dead(),
                timer,
                routes.join(" "),
                l.stats(),
            ));
        }
        out
    }
}

impl<C: Carrier> Shared<C> {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The link to `peer`, a rank of the job (the callers checked).
    fn link<'a>(&self, links: &'a mut LinkTable, peer: u32) -> &'a mut ReliableLink {
        links.get_or_insert_with(peer, || {
            ReliableLink::new(
                self.config.link.clone(),
                self.config.job_key,
                self.config.rank,
                peer,
                self.carrier.routes().max(1),
            )
        })
    }

    /// Receives, runs the links' timers, collects deliveries and sends what the links produced.
    fn advance(&self, st: &mut State, now: Instant) {
        let mut datagrams = std::mem::take(&mut st.datagrams);
        let max = if st.carrier_backlog { usize::MAX } else { 1 };
        match self.carrier.recv_up_to(&mut datagrams, max) {
            Ok((_, more)) => st.carrier_backlog = more,
            Err(e) => {
                st.carrier_backlog = false;
                tracing::debug!(rank = self.config.rank, error = %e, "carrier receive failed");
            }
        }
        let mut touched = std::mem::take(&mut st.touched);
        touched.clear();
        for d in datagrams.drain(..) {
            if let Some(peer) = self.accept(st, now, d) {
                touched.push(peer);
            }
        }
        st.datagrams = datagrams;
        if !self.config.reliability {
            st.touched = touched;
            return;
        }
        // A busy poller is waiting for what just came: hand it over now and service the links
        // (send what they owe, recompute their deadlines: ~700 instructions a message) on the
        // next call, once it is on its way — in a ping-pong, after the reply went out. Only
        // one call in a row defers, so a steady stream still gets its ACKs.
        let hand_over_first = !touched.is_empty()
            && st.unserviced.is_empty()
            && self.busy_pollers.load(Ordering::Relaxed) > 0;
        if st.carrier_backlog || hand_over_first {
            // With a backlog, more is waiting: deliver what came, but neither send nor run
            // timers yet. An ACK still in the socket may undo what the links would do now — a
            // retransmission of a packet an earlier ACK made look lost, a timer that ran out
            // while this rank was busy sending (measured: hundreds of spurious
            // retransmissions per lossless run when each datagram was acted on alone). The
            // next receive reads the rest.
            for &peer in &touched {
                if let Some(mut link) = st.links.take(peer) {
                    self.take_deliveries(st, peer, &mut link);
                    st.links.put(peer, link);
                }
            }
            st.unserviced.extend_from_slice(&touched);
            st.touched = touched;
            return;
        }
        if st.next_due.is_some_and(|d| d <= now) {
            st.next_due = None;
            let next_due = &mut st.next_due;
            st.links.for_each_mut(|peer, l| match l.poll_timeout() {
                Some(t) if t <= now => {
                    l.handle_timeout(now);
                    touched.push(peer);
                }
                Some(t) => *next_due = Some(next_due.map_or(t, |d| d.min(t))),
                None => {}
            });
        }
        touched.append(&mut st.unserviced);
        if touched.len() > 1 {
            touched.sort_unstable();
            touched.dedup();
        }
        for &peer in &touched {
            self.service(st, now, peer);
        }
        st.touched = touched;
    }

    /// Moves what `link` (taken out of `st.links`) delivered to the ready queue.
    fn take_deliveries(&self, st: &mut State, peer: u32, link: &mut ReliableLink) {
        while let Some(p) = link.poll_deliver() {
            self.deliver(st, peer, p);
        }
    }

    /// Decodes one datagram and hands it on; returns the peer whose link must be serviced.
    fn accept(&self, st: &mut State, now: Instant, d: Datagram) -> Option<u32> {
        let c = &mut st.counters;
        let Some(from) = d.from.filter(|&f| f < self.config.size) else {
            c.foreign_dropped += 1;
            return None;
        };
        let packet = match Packet::decode(&d.bytes, self.config.job_key) {
            Ok(p) => p,
            Err(PacketError::CrcMismatch { seq, .. }) => {
                c.crc_failures += 1;
                if self.config.reliability && !st.lost.contains(&from) {
                    self.link(&mut st.links, from)
                        .handle_corrupt(now, d.route, seq);
                    return Some(from);
                }
                return None;
            }
            Err(PacketError::ForeignJob { .. }) => {
                c.foreign_dropped += 1;
                return None;
            }
            Err(_) => {
                c.malformed_dropped += 1;
                return None;
            }
        };
        if packet.source != from || packet.destination != self.config.rank {
            c.foreign_dropped += 1;
            return None;
        }
        match (&packet.body, self.config.reliability) {
            (PacketBody::Raw { payload }, false) => {
                if let Some(r) = c.raw.get_mut(d.route) {
                    r.frames_received += 1;
                    r.bytes_received += d.bytes.len() as u64;
                }
                let payload = payload.clone().into_bytes();
                self.deliver(st, from, payload);
                None
            }
            (PacketBody::Raw { .. }, true) | (_, false) => {
                c.malformed_dropped += 1;
                None
            }
            (_, true) => {
                if st.lost.contains(&from) {
                    return None;
                }
                self.link(&mut st.links, from).receive(now, d.route, packet);
                Some(from)
            }
        }
    }

    /// Decodes a delivered payload as a frame and queues it for the message layer.
    fn deliver(&self, st: &mut State, from: u32, payload: Bytes) {
        match wire::decode(payload) {
            Ok(frame) => {
                st.ready.push_back(Arrival::Frame { from, frame });
                self.drained_empty.store(false, Ordering::Relaxed);
            }
            Err(e) => {
                tracing::debug!(rank = self.config.rank, from, error = %e, "undecodable frame");
                st.counters.malformed_dropped += 1;
            }
        }
    }

    /// Takes a link's deliveries, sends its packets and takes its events.
    fn service(&self, st: &mut State, now: Instant, peer: u32) {
        let Some(mut link) = st.links.take(peer) else {
            return;
        };
        self.take_deliveries(st, peer, &mut link);
        while let Some(t) = link.poll_transmit(now) {
            t.packet.write_header(&mut st.header);
            let sent = match &t.packet.body {
                // The retransmit queue holds a DATA payload until it is acknowledged, so the
                // carrier may send it by reference.
                PacketBody::Data { payload, .. } => self.carrier.send_held(
                    t.route,
                    peer,
                    &[&st.header, payload.head()],
                    payload.body(),
                ),
                _ => {
                    let [head, body] = t
                        .packet
                        .payload()
                        .map_or([&[][..]; 2], PacketPayload::parts);
                    self.carrier.send(t.route, peer, &[&st.header, head, body])
                }
            };
            if sent.is_err() {
                st.counters.send_errors += 1;
            }
        }
        // After the packets: an acknowledgement applied while sending may have made some.
        while let Some(ev) = link.poll_event() {
            match ev {
                LinkEvent::PeerDead { rank } => {
                    if st.lost.insert(rank) {
                        st.counters.peers_lost += 1;
                        st.ready.push_back(Arrival::PeerLost { rank });
                        self.drained_empty.store(false, Ordering::Relaxed);
                        tracing::warn!(
                            rank = self.config.rank,
                            peer = rank,
                            "peer stopped answering"
                        );
                    }
                }
                LinkEvent::RouteDown { rank, route } => {
                    tracing::warn!(rank = self.config.rank, peer = rank, route, "route down");
                }
                LinkEvent::RouteUp { rank, route } => {
                    tracing::info!(rank = self.config.rank, peer = rank, route, "route back up");
                }
            }
        }
        let deadline = link.poll_timeout();
        st.links.put(peer, link);
        if let Some(d) = deadline {
            st.next_due = Some(st.next_due.map_or(d, |n| n.min(d)));
        }
        if self.busy_pollers.load(Ordering::Relaxed) == 0 {
            self.rearm_if_earlier(st, deadline);
        }
    }

    /// Moves the parked progress task's timer to `deadline` if that is earlier than the one it
    /// is armed for.
    ///
    /// The timer is reset in place: it keeps the waker the task registered when it parked, so
    /// the task sleeps on. (Waking it to re-arm, as this did before, ran the progress task —
    /// a readiness peek and a receive, two system calls — each time a busy poller finished a
    /// burst with a packet in flight: about once per message of a ping-pong, which made
    /// reliability cost ~20% of the 1-byte latency.) Only a task that parked without a timer
    /// object yet is woken.
    fn rearm_if_earlier(&self, st: &mut State, deadline: Option<Instant>) {
        let Some(d) = deadline else {
            return;
        };
        if st.armed.is_some_and(|a| d >= a) || st.timer_waker.is_none() {
            // Armed early enough, or the task is running and arms its timer itself.
            return;
        }
        st.armed = Some(d);
        match st.timer.as_mut() {
            Some(t) => t.as_mut().reset(tokio::time::Instant::from_std(d)),
            None => {
                if let Some(w) = st.timer_waker.take() {
                    w.wake();
                }
            }
        }
    }

    fn next_deadline(&self, st: &State) -> Option<Instant> {
        st.links.iter().filter_map(|(_, l)| l.poll_timeout()).min()
    }

    /// Arms the timer for the links' earliest deadline; `Ready` when it has passed.
    fn poll_timer(&self, st: &mut State, cx: &mut Context<'_>) -> Poll<()> {
        match &st.timer_waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => st.timer_waker = Some(cx.waker().clone()),
        }
        st.armed = self.next_deadline(st);
        // Without a deadline the timer is parked far away rather than dropped: it keeps this
        // task's waker, so a deadline that appears later is armed by resetting it.
        let deadline = st.armed.unwrap_or_else(|| Instant::now() + IDLE_TIMER);
        let deadline = tokio::time::Instant::from_std(deadline);
        let timer = match &mut st.timer {
            Some(t) => {
                if t.deadline() != deadline {
                    t.as_mut().reset(deadline);
                }
                t
            }
            None => st
                .timer
                .insert(Box::pin(tokio::time::sleep_until(deadline))),
        };
        timer.as_mut().poll(cx)
    }

    /// Says BYE on every live link (best effort: one datagram each) and closes the carrier.
    fn say_goodbye_and_close(&self) {
        if self.config.reliability {
            let mut st = self.lock();
            let now = Instant::now();
            let peers: Vec<u32> = st.links.iter().map(|(p, _)| p).collect();
            for peer in peers {
                if let Some(l) = st.links.get_mut(peer) {
                    l.close();
                }
                self.service(&mut st, now, peer);
            }
        }
        self.carrier.close();
        self.drained.store(true, Ordering::Release);
    }

    fn all_quiet(&self, st: &State) -> bool {
        st.links
            .iter()
            .all(|(p, l)| l.is_idle() || l.is_dead() || st.lost.contains(&p))
    }

    fn stats(&self, st: &State) -> TransportStats {
        let c = &st.counters;
        let mut t = TransportStats::default();
        t.reliability = self.config.reliability;
        t.foreign_dropped = c.foreign_dropped;
        t.malformed_dropped = c.malformed_dropped;
        t.crc_failures = c.crc_failures;
        t.send_errors = c.send_errors;
        t.peers_lost = c.peers_lost;
        t.routes = c.raw.clone();
        for (_, link) in st.links.iter() {
            let s = link.stats();
            t.retransmissions += s.retransmitted;
            t.timeouts += s.timeouts;
            t.duplicates_dropped += s.duplicates_dropped;
            t.acks_sent += s.acks_sent;
            t.nacks_sent += s.nacks_sent;
            for (r, rs) in link.route_stats().iter().enumerate() {
                if let Some(out) = t.routes.get_mut(r) {
                    out.frames_sent += rs.packets_sent;
                    out.bytes_sent += rs.bytes_sent;
                    out.frames_received += rs.packets_received;
                    out.bytes_received += rs.bytes_received;
                    out.retransmissions += rs.retransmitted;
                    out.failovers += rs.failovers;
                    out.recoveries += rs.recoveries;
                    out.down_for_peers += u64::from(!rs.up);
                }
                t.route_failovers += rs.failovers;
                t.route_recoveries += rs.recoveries;
            }
        }
        t
    }
}

impl<C: Carrier> Transport for LinkTransport<C> {
    fn capabilities(&self) -> Capabilities {
        let reliable = self.shared.config.reliability;
        Capabilities {
            reliable,
            ordered: reliable,
            max_payload: self.shared.max_payload,
            multicast: false,
            rdma: false,
            by_reference: false,
        }
    }

    fn send(&self, to: u32, frame: rankweave_core::frame::Frame) -> Result<(), TransportError> {
        let sh = &*self.shared;
        if to >= sh.config.size {
            return Err(TransportError::PeerUnreachable(to as usize));
        }
        if sh.closed.load(Ordering::Relaxed) {
            return Err(TransportError::Closed);
        }
        // Header and payload stay apart down to the gathered send: no copy of the payload.
        let (head, head_len) = wire::encode_head(&frame);
        let payload = PacketPayload::new(&head[..head_len], frame.payload);
        let mut st = sh.lock();
        if st.lost.contains(&to) {
            // Dropped: its `PeerLost` is queued behind what it sent (see `Transport::send`).
            return Ok(());
        }
        if sh.config.reliability {
            let now = Instant::now();
            sh.link(&mut st.links, to).send(now, payload);
            sh.service(&mut st, now, to);
            return Ok(());
        }
        let packet = Packet {
            job_key: sh.config.job_key,
            source: sh.config.rank,
            destination: to,
            body: PacketBody::Raw { payload },
        };
        let st = &mut *st;
        packet.write_header(&mut st.header);
        let [head, body] = packet.payload().map_or([&[][..]; 2], PacketPayload::parts);
        let len = st.header.len() + head.len() + body.len();
        sh.carrier.send(0, to, &[&st.header, head, body])?;
        if let Some(r) = st.counters.raw.get_mut(0) {
            r.frames_sent += 1;
            r.bytes_sent += len as u64;
        }
        Ok(())
    }

    fn drain(&self, out: &mut Vec<Arrival>) -> Result<usize, TransportError> {
        let sh = &*self.shared;
        let mut st = sh.lock();
        let now = Instant::now();
        sh.advance(&mut st, now);
        // A datagram that delivered nothing (an ACK, say) with more behind it: go on.
        while st.ready.is_empty() && st.carrier_backlog {
            sh.advance(&mut st, now);
        }
        let n = st.ready.len();
        if n > 0 {
            out.extend(st.ready.drain(..));
        }
        sh.drained_empty
            .store(!st.carrier_backlog, Ordering::Relaxed);
        Ok(n)
    }

    /// `false` once right after a drain that left nothing behind, else `true`: knowing whether
    /// a datagram came takes a system call, and a drain reads until the sockets would block, so
    /// the look that a pump takes straight after handling what it drained would only pay one
    /// more `recvfrom` to find them empty — on the critical path of every ping-pong message.
    /// Whatever arrives meanwhile is found by the busy poller's next look or, with nobody
    /// polling, by the progress task, which waits on the sockets' readiness.
    fn may_have_arrivals(&self) -> bool {
        let flag = &self.shared.drained_empty;
        if flag.load(Ordering::Relaxed) {
            flag.store(false, Ordering::Relaxed);
            return false;
        }
        true
    }

    fn poll_arrival(&self, cx: &mut Context<'_>) -> Poll<()> {
        let sh = &*self.shared;
        let mut st = sh.lock();
        if !st.ready.is_empty() || !st.unserviced.is_empty() {
            // Links a busy poller left unserviced are served by the next drain.
            return Poll::Ready(());
        }
        let received = sh.carrier.poll_recv_ready(cx);
        let timer = sh.poll_timer(&mut st, cx);
        if received.is_ready() || timer.is_ready() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    fn close(&self) {
        let sh = &self.shared;
        if sh.closed.swap(true, Ordering::Relaxed) {
            return;
        }
        let quiet = !sh.config.reliability || sh.all_quiet(&sh.lock());
        let handle = tokio::runtime::Handle::try_current();
        match handle {
            Ok(h) if !quiet => {
                h.spawn(linger(Arc::clone(sh)));
            }
            _ => sh.say_goodbye_and_close(),
        }
    }

    fn is_drained(&self) -> bool {
        self.shared.drained.load(Ordering::Acquire)
    }

    fn begin_busy_poll(&self) {
        self.shared.busy_pollers.fetch_add(1, Ordering::AcqRel);
    }

    fn end_busy_poll(&self) {
        let sh = &*self.shared;
        if sh.busy_pollers.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        // The last poller is gone: hand the timers back to the parked progress task, and wake
        // it if deliveries or unserviced links are waiting. Datagrams that arrive later wake
        // it through the carrier's readiness, which busy polling never suppressed.
        let mut st = sh.lock();
        let deadline = st.next_due;
        sh.rearm_if_earlier(&mut st, deadline);
        if !st.ready.is_empty() || !st.unserviced.is_empty() {
            if let Some(w) = st.timer_waker.take() {
                w.wake();
            }
        }
    }

    fn stats(&self) -> TransportStats {
        let sh = &*self.shared;
        sh.stats(&sh.lock())
    }
}

/// Keeps a closed rank's links running until its peers acknowledged everything (or the linger
/// time is up), then closes the carrier. Frames that still arrive are dropped.
async fn linger<C: Carrier>(sh: Arc<Shared<C>>) {
    let until = Instant::now() + sh.config.linger;
    loop {
        {
            let mut st = sh.lock();
            sh.advance(&mut st, Instant::now());
            st.ready.clear();
            if sh.all_quiet(&st) || Instant::now() >= until {
                break;
            }
        }
        let wait = std::future::poll_fn(|cx| {
            let mut st = sh.lock();
            let r = sh.carrier.poll_recv_ready(cx);
            if r.is_ready() || sh.poll_timer(&mut st, cx).is_ready() {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        });
        let _ = tokio::time::timeout_at(tokio::time::Instant::from_std(until), wait).await;
    }
    sh.say_goodbye_and_close();
}

impl<C: Carrier> std::fmt::Debug for LinkTransport<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkTransport")
            .field("rank", &self.shared.config.rank)
            .field("size", &self.shared.config.size)
            .field("reliability", &self.shared.config.reliability)
            .field("routes", &self.shared.carrier.routes())
            .finish_non_exhaustive()
    }
}

/// The job key and source rank of a link packet (magic `RL`, bytes 8..16 and 16..20 of the
/// header; see `rankweave_core::reliability::packet`), without checking anything else: what a
/// carrier that learns its peers on demand reads to tell who an unknown sender claims to be.
pub(crate) fn packet_sender(bytes: &[u8]) -> Option<(u64, u32)> {
    if bytes.len() < 24 || bytes[..2] != rankweave_core::reliability::packet::MAGIC {
        return None;
    }
    let key = u64::from_le_bytes(bytes[8..16].try_into().ok()?);
    let source = u32::from_le_bytes(bytes[16..20].try_into().ok()?);
    Some((key, source))
}

/// Packets a link of this transport keeps unacknowledged at most ([`LinkConfig::window`]; the
/// engine's own default is 256): 4 MiB of 64 KiB datagrams, far beyond a local network's
/// bandwidth-delay product.
///
/// More only queues in the receiver's socket. With 256, a bulk transfer over loopback kept
/// ~16 MiB queued, round trips of 2–4 ms, and retransmission timers that ran out on packets
/// still in the queue; 64 gave 30–60% more bandwidth at 1 and 4 MiB and far fewer timeouts
/// under loss (the book's Reliability chapter has the runs).
const WINDOW: u32 = 64;

/// Where the progress task's timer waits while no link has a deadline.
const IDLE_TIMER: Duration = Duration::from_secs(60);

/// How long a failed peer lookup is remembered before the directory is asked again.
const LOOKUP_RETRY: Duration = Duration::from_millis(200);

/// The peers whose lookup in a job's directory failed just now, so that a carrier learning
/// its peers on demand does not ask again for every datagram (not before [`LOOKUP_RETRY`]).
#[derive(Default)]
pub(crate) struct FailedLookups {
    failed: Mutex<FxHashMap<u32, Instant>>,
}

impl FailedLookups {
    /// Whether the lookup of `rank` failed less than [`LOOKUP_RETRY`] ago.
    pub(crate) fn recently_failed(&self, rank: u32) -> bool {
        let failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        failed
            .get(&rank)
            .is_some_and(|t| t.elapsed() < LOOKUP_RETRY)
    }

    /// Remembers that the lookup of `rank` failed now.
    pub(crate) fn remember(&self, rank: u32) {
        let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        failed.insert(rank, Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inproc::{InprocCarrier, InprocCarrierFabric};
    use crate::test_frames::eager_frame;
    use crate::test_waker::CountingWaker;

    /// Rank `rank` of a 2-rank job over `fabric`, with reliability.
    fn rank_of(fabric: &Arc<InprocCarrierFabric>, rank: u32) -> LinkTransport<InprocCarrier> {
        LinkTransport::new(
            fabric.carrier(rank as usize).unwrap(),
            LinkTransportConfig::new(rank, 2, 42),
        )
    }

    #[test]
    fn the_window_is_the_transports_unless_configured() {
        let c = LinkTransportConfig::new(0, 2, 1);
        assert_eq!(c.link.window, WINDOW);
        assert_eq!(c.clone().with_window(None).link.window, WINDOW);
        assert_eq!(c.with_window(Some(300)).link.window, 300);
    }

    #[tokio::test]
    async fn a_send_moves_the_parked_timer_forward_without_waking_the_task() {
        let fabric = InprocCarrierFabric::new(2, 1, 64 * 1024);
        let t = rank_of(&fabric, 0);
        // Rank 1 never reads: nothing is acknowledged, so the packet stays in flight.
        let _peer = fabric.carrier(1).unwrap();
        let (count, waker) = CountingWaker::new();
        let mut cx = Context::from_waker(&waker);
        assert!(t.poll_arrival(&mut cx).is_pending(), "idle: parks");
        t.send(1, eager_frame(1, 1, 0, vec![1u8; 10])).unwrap();
        assert_eq!(
            count.count(),
            0,
            "the send armed the parked task's timer without waking it"
        );
        // The retransmission timer (initial RTO 10 ms) wakes it.
        let until = Instant::now() + Duration::from_secs(5);
        while count.count() == 0 && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(count.count() > 0, "the timer woke the task");
        assert!(t.poll_arrival(&mut cx).is_ready());
    }

    #[tokio::test]
    async fn a_busy_poller_gets_its_message_before_the_link_is_serviced() {
        let fabric = InprocCarrierFabric::new(2, 1, 64 * 1024);
        let (a, b) = (rank_of(&fabric, 0), rank_of(&fabric, 1));
        let (count, waker) = CountingWaker::new();
        let mut cx = Context::from_waker(&waker);
        assert!(
            b.poll_arrival(&mut cx).is_pending(),
            "b's progress task parks"
        );
        let drain_until_one = |t: &LinkTransport<_>| {
            let mut out = Vec::new();
            let until = Instant::now() + Duration::from_secs(5);
            while out.is_empty() && Instant::now() < until {
                t.drain(&mut out).unwrap();
            }
            out.len()
        };
        // Not busy-polled: the receiving drain services the link at once.
        a.send(1, eager_frame(1, 1, 0, vec![1u8; 10])).unwrap();
        assert_eq!(drain_until_one(&b), 1);
        assert!(b.shared.lock().unserviced.is_empty());
        // Busy-polled: the message is handed over, the link left for the next call.
        b.begin_busy_poll();
        a.send(1, eager_frame(1, 2, 0, vec![2u8; 10])).unwrap();
        assert_eq!(drain_until_one(&b), 1);
        assert_eq!(b.shared.lock().unserviced, [0]);
        // The poller leaves: the parked task is woken to do it, and does.
        let woken = count.count();
        b.end_busy_poll();
        assert_eq!(count.count(), woken + 1);
        assert!(b.poll_arrival(&mut cx).is_ready());
        b.drain(&mut Vec::new()).unwrap();
        assert!(b.shared.lock().unserviced.is_empty());
    }
}
