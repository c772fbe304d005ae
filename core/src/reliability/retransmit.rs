//! The sender's unacknowledged DATA packets and when to send them again.
//!
//! Rules (each packet is retransmitted only for one of these reasons):
//!
//! * **ACK**: a cumulative or selective acknowledgement removes the packet.
//! * **NACK**: the receiver saw the packet corrupted: it is sent again at once, unless it was
//!   (re)sent less than `nack_guard` ago (then the NACK answers an older copy).
//! * **Loss detection** (time-based, as in RACK and QUIC's time threshold): once a packet
//!   transmitted after it was acknowledged, a packet is lost when it has been out for the loss
//!   delay (the link uses `max(9/8·SRTT, SRTT + 4·RTTVAR)`, not clamped to the minimum RTO). It
//!   is then sent again at once. Being time-based, this tolerates reordering within a burst:
//!   packets sent at the same time never prove each other lost. An ACK of a retransmitted
//!   packet that comes sooner than the minimum round trip after its latest copy left answers
//!   an earlier copy (RACK's rule): the delivery is then dated from the first transmission, so
//!   the late ACK of an original does not make everything sent before a timeout probe look
//!   lost. A loss timer
//!   ([`next_loss_time`](RetransmitQueue::next_loss_time)) fires when a packet reaches the delay
//!   without a further ACK.
//! * **Timeout**: only the oldest unacknowledged packet runs a timer, of `RTO × 2^retries` with
//!   the exponent truncated at `max_backoff`, from its latest transmission or the latest ACK
//!   that acknowledged anything, whichever is later (RFC 6298's restart: while ACKs make
//!   progress, loss detection finds the losses). When it expires that packet alone is sent again (a
//!   probe; its ACK then proves the others lost), and its retry count goes up. When the count
//!   reaches the retry limit the peer is declared dead. Any ACK from the peer resets the counts
//!   (the peer is alive).
//!
//! * **Tail probe** (RACK's tail loss probe, RFC 8985 §7): when nothing was acknowledged for a
//!   probe timeout (the link uses `2·SRTT` plus the peer's ACK delay) after the latest
//!   transmission, and that is sooner than the timer above, the *newest* packet is sent again,
//!   once per such stall. A lost packet at the end of a burst has no later packet whose ACK
//!   would reveal it; the probe's ACK does (or the probe is the lost packet), so a tail loss
//!   costs about two round trips instead of the minimum RTO. It counts no retry, and goes on
//!   the route of the packet's latest transmission, so that a dead route still runs into the
//!   timer that detects it.
//!
//! * **Rebinding**: when the link marks a route down, every packet whose latest transmission
//!   went on it is due at once ([`mark_route_due`](RetransmitQueue::mark_route_due)).
//!
//! One timer rather than one per packet means a lost ACK, or an outage, costs one probe per
//! timeout rather than a retransmission of the whole window: no storms.
//!
//! Every packet remembers the route of its latest transmission; the queue reports packets it
//! removes (acknowledged) and marks due (lost) through a [`QueueEvent`] callback, which is how
//! the link's [`PathScheduler`](super::paths::PathScheduler) learns what each route delivers and
//! loses.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use super::packet::{AckInfo, PacketPayload};
use super::seq_slots::SeqSlots;

/// A DATA packet waiting for its acknowledgement.
#[derive(Clone, Debug)]
pub struct SentPacket {
    /// The payload, kept for retransmission.
    pub payload: PacketPayload,
    /// When it was first sent.
    pub first_sent: Instant,
    /// When it was last sent.
    pub last_sent: Instant,
    /// Timeouts it has had since the peer last answered.
    pub retries: u32,
    /// Whether it was ever sent more than once (then its ACK gives no RTT sample).
    pub retransmitted: bool,
    /// The route of its latest transmission.
    pub route: usize,
    /// Whether every transmission went on [`route`](Self::route) (then its ACK proves that
    /// route delivers).
    pub single_route: bool,
    /// Place of its latest transmission in the order of all transmissions.
    pub(super) order: u64,
    /// Its sequence number.
    pub seq: u64,
}

/// What an ACK did to the queue.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AckOutcome {
    /// Packets the ACK removed.
    pub newly_acked: usize,
    /// Round-trip sample from the latest-sent newly acknowledged packet that was never
    /// retransmitted (Karn's rule), if any.
    pub rtt_sample: Option<Duration>,
    /// Newly acknowledged packets that had been retransmitted.
    pub retransmissions_acked: usize,
}

/// A packet leaving the queue's "in flight" state, reported to the caller's callback.
#[derive(Clone, Copy, Debug)]
pub enum QueueEvent<'a> {
    /// The packet was acknowledged and removed.
    Acked(&'a SentPacket),
    /// Loss detection found the packet lost and marked it due (an ACK proved it missing, or a
    /// timer expired).
    Lost(&'a SentPacket),
}

/// A retransmission taken from the queue by [`pop_due`](RetransmitQueue::pop_due).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resend {
    /// Its sequence number.
    pub seq: u64,
    /// Its payload.
    pub payload: PacketPayload,
    /// The route of its previous transmission.
    pub previous_route: usize,
    /// The route it goes out on now.
    pub route: usize,
}

/// Unacknowledged DATA packets, by sequence number.
#[derive(Clone, Debug, Default)]
pub struct RetransmitQueue {
    packets: SeqSlots<SentPacket>,
    /// Packets due to be sent again, by sequence number.
    due: BTreeSet<u64>,
    next_order: u64,
    /// Latest send time of an acknowledged transmission.
    largest_acked_sent: Option<Instant>,
    /// Whether some packet may have a nonzero retry count (saves a pass on every ACK).
    retries_counted: bool,
    /// When an ACK last acknowledged something: the timer restarts from there.
    last_progress: Option<Instant>,
    /// The latest transmission of any packet.
    last_sent: Option<Instant>,
    /// Whether the tail probe went since the last progress (one per stall).
    tail_probed: bool,
    /// The packet marked due as the tail probe, until it is sent.
    probe: Option<u64>,
}

impl RetransmitQueue {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    /// Packets not yet acknowledged.
    pub fn len(&self) -> usize {
        self.packets.len()
    }

    /// Whether every packet sent was acknowledged.
    pub fn is_empty(&self) -> bool {
        self.packets.is_empty()
    }

    /// Whether `seq` is waiting for its acknowledgement.
    pub fn contains(&self, seq: u64) -> bool {
        self.packets.contains(seq)
    }

    /// Whether `ack` acknowledges every packet in the queue (then no loss detection follows).
    pub fn acknowledges_all(&self, ack: &AckInfo) -> bool {
        self.packets
            .last()
            .is_none_or(|(seq, _)| seq <= ack.cumulative)
    }

    /// The packet `seq`, if unacknowledged.
    pub fn get(&self, seq: u64) -> Option<&SentPacket> {
        self.packets.get(seq)
    }

    /// Records the first transmission of `seq`, on `route`.
    pub fn on_sent(
        &mut self,
        seq: u64,
        payload: impl Into<PacketPayload>,
        now: Instant,
        route: usize,
    ) {
        debug_assert!(
            self.packets
                .last()
                .is_none_or(|(last, p)| last < seq && p.first_sent <= now),
            "first transmissions go in sequence order at nondecreasing times"
        );
        let order = self.bump_order();
        self.last_sent = Some(now);
        self.packets.insert(
            seq,
            SentPacket {
                payload: payload.into(),
                first_sent: now,
                last_sent: now,
                retries: 0,
                retransmitted: false,
                route,
                single_route: true,
                order,
                seq,
            },
        );
    }

    fn bump_order(&mut self) -> u64 {
        self.next_order += 1;
        self.next_order
    }

    /// Removes what `ack` acknowledges, then marks packets the ACK proves lost as due (loss
    /// delay `loss_delay`). Any ACK resets the retry counts: the peer is alive.
    pub fn on_ack(&mut self, ack: &AckInfo, now: Instant, loss_delay: Duration) -> AckOutcome {
        self.on_ack_with(ack, now, None, |_| loss_delay, |_| {})
    }

    /// [`on_ack`](Self::on_ack) with a loss delay per packet (`loss_delay(p)`: the link uses the
    /// round trip of the packet's route), reporting each packet removed and each marked lost to
    /// `on_event`.
    ///
    /// `min_rtt`, the shortest round trip seen, tells which copy of a retransmitted packet an
    /// ACK is for (RACK, RFC 8985 §6.2): one that comes sooner than that after the latest copy
    /// left answers an earlier copy. Loss detection then dates the delivery from the first
    /// transmission, not the latest. Dating it from the latest would, after a spurious
    /// timeout (the original's ACK was only late), make every packet sent before the probe
    /// look lost and send the whole window again.
    pub fn on_ack_with(
        &mut self,
        ack: &AckInfo,
        now: Instant,
        min_rtt: Option<Duration>,
        loss_delay: impl Fn(&SentPacket) -> Duration,
        mut on_event: impl FnMut(QueueEvent<'_>),
    ) -> AckOutcome {
        let mut out = AckOutcome::default();
        // When the latest delivered copy of a newly acknowledged packet left, and (order,
        // last_sent) of the latest-sent one that was never retransmitted (Karn: only those give
        // RTT samples).
        let mut latest: Option<Instant> = None;
        let mut latest_clean: Option<(u64, Instant)> = None;
        let mut take = |this: &mut Self, seq: u64| {
            if let Some(p) = this.packets.remove(seq) {
                this.due.remove(&seq);
                on_event(QueueEvent::Acked(&p));
                out.newly_acked += 1;
                let mut delivered = p.last_sent;
                if p.retransmitted {
                    let after = now.saturating_duration_since(p.last_sent);
                    if min_rtt.is_some_and(|m| after < m) {
                        delivered = p.first_sent;
                    }
                    out.retransmissions_acked += 1;
                }
                latest = latest.max(Some(delivered));
                if !p.retransmitted {
                    latest_clean = latest_clean.max(Some((p.order, p.last_sent)));
                }
            }
        };
        while let Some((seq, _)) = self.packets.first() {
            if seq > ack.cumulative {
                break;
            }
            take(self, seq);
        }
        for seq in ack.selective_seqs() {
            take(self, seq);
        }
        if let Some((_, sent)) = latest_clean {
            out.rtt_sample = Some(now.saturating_duration_since(sent));
        }
        if let Some(sent) = latest {
            self.largest_acked_sent = Some(self.largest_acked_sent.map_or(sent, |t| t.max(sent)));
            self.last_progress = Some(now);
            self.tail_probed = false;
        }
        if std::mem::take(&mut self.retries_counted) {
            for p in self.packets.values_mut() {
                p.retries = 0;
            }
        }
        self.detect_lost_with(now, loss_delay, on_event);
        out
    }

    /// Marks as due every packet sent (strictly) before an acknowledged one and out for
    /// `loss_delay`.
    pub fn detect_lost(&mut self, now: Instant, loss_delay: Duration) {
        self.detect_lost_with(now, |_| loss_delay, |_| {});
    }

    /// [`detect_lost`](Self::detect_lost) with a loss delay per packet, reporting each packet
    /// newly marked lost to `on_event` (as [`QueueEvent::Lost`]).
    pub fn detect_lost_with(
        &mut self,
        now: Instant,
        loss_delay: impl Fn(&SentPacket) -> Duration,
        mut on_event: impl FnMut(QueueEvent<'_>),
    ) {
        let Some(largest) = self.largest_acked_sent else {
            return;
        };
        for (seq, p) in sent_before(&self.packets, largest) {
            if now.saturating_duration_since(p.last_sent) >= loss_delay(p) && self.due.insert(seq) {
                on_event(QueueEvent::Lost(p));
            }
        }
    }

    /// Marks due every packet whose latest transmission went on `route` (the route went down:
    /// they are sent again at once, on other routes). Returns how many were newly marked.
    pub fn mark_route_due(&mut self, route: usize) -> usize {
        let mut marked = 0;
        for (seq, p) in self.packets.iter() {
            if p.route == route && self.due.insert(seq) {
                marked += 1;
            }
        }
        marked
    }

    /// When the next packet sent before an acknowledged one reaches `loss_delay` (then call
    /// [`detect_lost`](Self::detect_lost)).
    pub fn next_loss_time(&self, loss_delay: Duration) -> Option<Instant> {
        self.next_loss_time_with(|_| loss_delay)
    }

    /// [`next_loss_time`](Self::next_loss_time) with a loss delay per packet.
    pub fn next_loss_time_with(
        &self,
        loss_delay: impl Fn(&SentPacket) -> Duration,
    ) -> Option<Instant> {
        let largest = self.largest_acked_sent?;
        sent_before(&self.packets, largest)
            .filter(|(seq, _)| !self.due.contains(seq))
            .map(|(_, p)| p.last_sent + loss_delay(p))
            .min()
    }

    /// A NACK of `seq`: marks it due unless it was sent less than `nack_guard` ago. Returns
    /// whether it was marked.
    pub fn on_nack(&mut self, seq: u64, now: Instant, nack_guard: Duration) -> bool {
        match self.packets.get(seq) {
            Some(p) if now.saturating_duration_since(p.last_sent) >= nack_guard => {
                self.due.insert(seq)
            }
            _ => false,
        }
    }

    /// When the oldest packet's timer expires: `RTO × 2^retries` after its latest transmission
    /// or the latest ACK that acknowledged something, whichever is later (while ACKs make
    /// progress, loss detection finds losses and the timer stays quiet, RFC 6298 5.3).
    pub fn next_timeout(&self, rto: Duration, max_backoff: u32) -> Option<Instant> {
        let (seq, p) = self.packets.first()?;
        if self.due.contains(&seq) {
            return None; // goes out at the next poll anyway
        }
        let from = self
            .last_progress
            .map_or(p.last_sent, |t| t.max(p.last_sent));
        Some(from + backoff(rto, p.retries, max_backoff))
    }

    /// Handles the timer: if the oldest packet's timer expired, marks it due, counts the retry
    /// and returns its sequence number. (Whether the peer is dead is decided by silence, not by
    /// a retry count: see [`Liveness`](super::Liveness).)
    pub fn on_timeout(&mut self, now: Instant, rto: Duration, max_backoff: u32) -> Option<u64> {
        match self.next_timeout(rto, max_backoff) {
            Some(t) if t <= now => {
                let (seq, p) = self.packets.first_mut()?;
                p.retries += 1;
                self.retries_counted = true;
                self.due.insert(seq);
                Some(seq)
            }
            _ => None,
        }
    }

    /// When the tail probe is due: `pto` after the latest transmission or progress, whichever
    /// is later, unless the probe went already in this stall, a packet is due anyway, or the
    /// retransmission timer (`rto`, `max_backoff`) comes first.
    pub fn next_tail_probe(
        &self,
        pto: Duration,
        rto: Duration,
        max_backoff: u32,
    ) -> Option<Instant> {
        if self.tail_probed || !self.due.is_empty() {
            return None;
        }
        let sent = self.last_sent?;
        let at = self.last_progress.map_or(sent, |t| t.max(sent)) + pto;
        let timer = self.next_timeout(rto, max_backoff)?;
        (at < timer).then_some(at)
    }

    /// Handles the tail probe's timer: if it expired, marks the newest packet due and returns
    /// its sequence number.
    pub fn on_tail_probe(
        &mut self,
        now: Instant,
        pto: Duration,
        rto: Duration,
        max_backoff: u32,
    ) -> Option<u64> {
        match self.next_tail_probe(pto, rto, max_backoff) {
            Some(t) if t <= now => {
                let seq = self.packets.last()?.0;
                self.tail_probed = true;
                self.probe = Some(seq);
                self.due.insert(seq);
                Some(seq)
            }
            _ => None,
        }
    }

    /// Takes the lowest due packet for retransmission now, on the route `pick` chooses for it
    /// (given the packet as it was last sent), and records the transmission.
    pub fn pop_due(
        &mut self,
        now: Instant,
        pick: impl FnOnce(&SentPacket) -> usize,
    ) -> Option<Resend> {
        loop {
            let seq = self.due.pop_first()?;
            let order = self.bump_order();
            let is_probe = self.probe.take_if(|&mut p| p == seq).is_some();
            // Due packets are always queued (ACKs remove both); skip one that is not.
            let Some(p) = self.packets.get_mut(seq) else {
                continue;
            };
            let previous_route = p.route;
            // The probe keeps its route: finding another would hide a dead route from the
            // timer that detects it.
            let route = if is_probe { p.route } else { pick(p) };
            p.last_sent = now;
            self.last_sent = Some(now);
            p.retransmitted = true;
            p.order = order;
            p.single_route &= route == previous_route;
            p.route = route;
            return Some(Resend {
                seq,
                payload: p.payload.clone(),
                previous_route,
                route,
            });
        }
    }

    /// Whether some packet is due for retransmission.
    pub fn has_due(&self) -> bool {
        !self.due.is_empty()
    }
}

/// The packets last sent before `t`, lowest sequence number first.
///
/// Stops at the first packet sent only once at or after `t`: first transmissions go in
/// sequence order at nondecreasing times ([`on_sent`](RetransmitQueue::on_sent)), so every packet
/// after it was first sent, and so last sent, no earlier. With a window of packets in
/// flight, an ACK then looks at the few sent before the acknowledged one, not at all.
fn sent_before(
    packets: &SeqSlots<SentPacket>,
    t: Instant,
) -> impl Iterator<Item = (u64, &SentPacket)> + '_ {
    packets
        .iter()
        .take_while(move |(_, p)| p.retransmitted || p.last_sent < t)
        .filter(move |(_, p)| p.last_sent < t)
}

/// `rto × 2^min(retries, max_backoff)`, saturating.
pub fn backoff(rto: Duration, retries: u32, max_backoff: u32) -> Duration {
    let exp = retries.min(max_backoff).min(31);
    rto.saturating_mul(1u32 << exp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    const MS: Duration = Duration::from_millis(1);

    fn ack(cumulative: u64, sel: &[u64]) -> AckInfo {
        let mut selective = Vec::new();
        for &s in sel {
            let i = s - cumulative - 2;
            let w = (i / 64) as usize;
            if selective.len() <= w {
                selective.resize(w + 1, 0);
            }
            selective[w] |= 1 << (i % 64);
        }
        AckInfo {
            cumulative,
            window_end: u64::MAX,
            selective,
            nack: None,
            duplicate: None,
        }
    }

    fn queue(t0: Instant, n: u64) -> RetransmitQueue {
        let mut q = RetransmitQueue::new();
        for s in 1..=n {
            q.on_sent(s, Bytes::from(vec![s as u8]), t0, 0);
        }
        q
    }

    #[test]
    fn backoff_is_truncated() {
        assert_eq!(backoff(MS, 0, 3), MS);
        assert_eq!(backoff(MS, 2, 3), 4 * MS);
        assert_eq!(backoff(MS, 9, 3), 8 * MS);
        assert_eq!(backoff(Duration::MAX, 5, 5), Duration::MAX);
    }

    #[test]
    fn cumulative_and_selective_ack_remove_and_sample() {
        let t0 = Instant::now();
        let mut q = queue(t0, 6);
        let out = q.on_ack(&ack(2, &[4]), t0 + 5 * MS, Duration::MAX);
        assert_eq!(out.newly_acked, 3);
        assert_eq!(out.rtt_sample, Some(5 * MS));
        assert_eq!(q.len(), 3);
        assert!(q.contains(3) && !q.contains(4));
        // 3 was sent before 4 (order 3 < 4) but only one transmission later: not yet lost.
        assert!(!q.has_due());
        // A duplicate ACK removes nothing and samples nothing.
        assert_eq!(
            q.on_ack(&ack(2, &[4]), t0 + 6 * MS, Duration::MAX),
            AckOutcome::default()
        );
    }

    #[test]
    fn loss_detection_by_time_threshold() {
        let t0 = Instant::now();
        let mut q = RetransmitQueue::new();
        for s in 1..=3 {
            q.on_sent(s, Bytes::new(), t0, 0);
        }
        for s in 4..=6 {
            q.on_sent(s, Bytes::new(), t0 + MS, 1);
        }
        let delay = 5 * MS;
        q.on_ack(&ack(0, &[5]), t0 + 2 * MS, delay);
        // 1..4 were sent before 5 but are not out for the loss delay yet; 6 was sent after 5.
        assert!(!q.has_due());
        assert_eq!(q.next_loss_time(delay), Some(t0 + delay));
        q.detect_lost(t0 + delay, delay);
        assert_eq!(q.pop_due(t0 + delay, |_| 0).map(|r| r.seq), Some(1));
        assert_eq!(q.pop_due(t0 + delay, |_| 0).map(|r| r.seq), Some(2));
        assert_eq!(q.pop_due(t0 + delay, |_| 0).map(|r| r.seq), Some(3));
        assert_eq!(q.pop_due(t0 + delay, |_| 0), None);
        // 4 went out together with 5: never proven lost by 5.
        assert_eq!(q.next_loss_time(delay), None);
        // Retransmitted 1..3 are newer than 5 now: not lost again by an ACK of 5.
        q.on_ack(&ack(0, &[5]), t0 + 20 * MS, delay);
        assert!(!q.has_due());
        // The ACK of a retransmitted packet gives no sample (Karn).
        let out = q.on_ack(&ack(1, &[]), t0 + 8 * MS, delay);
        assert_eq!(
            (out.newly_acked, out.rtt_sample, out.retransmissions_acked),
            (1, None, 1)
        );
    }

    #[test]
    fn same_instant_burst_is_never_lost_by_reordering() {
        let t0 = Instant::now();
        let mut q = queue(t0, 100);
        q.on_ack(&ack(0, &[100]), t0 + 50 * MS, Duration::ZERO);
        assert!(!q.has_due());
        assert_eq!(q.next_loss_time(Duration::ZERO), None);
    }

    #[test]
    fn nack_marks_due_with_guard() {
        let t0 = Instant::now();
        let mut q = queue(t0, 3);
        assert!(q.on_nack(2, t0 + 2 * MS, MS));
        assert!(!q.on_nack(2, t0 + 2 * MS, MS)); // already due
        assert!(!q.on_nack(9, t0 + 2 * MS, MS)); // unknown
        assert_eq!(q.pop_due(t0 + 2 * MS, |_| 0).map(|r| r.seq), Some(2));
        assert!(!q.on_nack(2, t0 + 2 * MS + MS / 2, MS)); // answers the old copy
    }

    #[test]
    fn timer_probes_oldest_with_truncated_backoff() {
        let t0 = Instant::now();
        let mut q = queue(t0, 3);
        let rto = 10 * MS;
        assert_eq!(q.next_timeout(rto, 2), Some(t0 + rto));
        assert_eq!(q.on_timeout(t0 + 9 * MS, rto, 2), None);
        let mut now = t0 + rto;
        let mut expected_gap = rto;
        for retry in 1..=3 {
            assert_eq!(q.on_timeout(now, rto, 2), Some(1));
            assert_eq!(q.next_timeout(rto, 2), None);
            assert_eq!(q.pop_due(now, |_| 0).map(|r| r.seq), Some(1));
            assert!(!q.has_due()); // only the oldest is probed
            expected_gap = backoff(rto, retry, 2);
            now += expected_gap;
            assert_eq!(q.next_timeout(rto, 2), Some(now));
        }
        assert_eq!(expected_gap, 4 * rto);
        // Truncated: the fourth retry waits no longer than the third.
        assert_eq!(q.on_timeout(now, rto, 2), Some(1));
        assert_eq!(q.pop_due(now, |_| 0).map(|r| r.seq), Some(1));
        now += expected_gap;
        assert_eq!(q.next_timeout(rto, 2), Some(now));
        // An ACK (the peer is alive) resets the count.
        q.on_ack(&ack(0, &[]), now, Duration::MAX);
        assert_eq!(q.next_timeout(rto, 2), Some(now - 4 * rto + rto));
    }

    #[test]
    fn the_late_ack_of_an_original_after_a_timeout_probe_proves_nothing_lost() {
        let t0 = Instant::now();
        let min_rtt = Some(MS);
        let rto = 5 * MS;
        // Packets 1..=10 out; nothing acknowledged for an RTO: packet 1 is sent again as a
        // probe at `t0 + rto + MS`.
        let probed = || {
            let mut q = RetransmitQueue::new();
            for s in 1..=10 {
                q.on_sent(s, Bytes::new(), t0 + (s as u32) * MS / 10, 0);
            }
            assert_eq!(q.on_timeout(t0 + rto + MS, rto, 8), Some(1));
            assert!(q.pop_due(t0 + rto + MS, |_| 0).is_some());
            q
        };
        // The original's ACK was only late: it comes 0.1 ms after the probe left, sooner than
        // any round trip, so it answers the original. Packets 2..=10 went after the original:
        // nothing proves them lost.
        let at = t0 + rto + MS + MS / 10;
        let mut q = probed();
        q.on_ack_with(&ack(1, &[]), at, min_rtt, |_| Duration::ZERO, |_| {});
        assert!(
            !q.has_due(),
            "no packet sent before the probe was taken for lost"
        );
        // Without knowing the minimum round trip the probe would date the delivery, and the
        // rest of the window would be sent again (what the link did before).
        let mut q = probed();
        q.on_ack_with(&ack(1, &[]), at, None, |_| Duration::ZERO, |_| {});
        assert!(q.has_due());
        // An ACK that comes a round trip after the probe is the probe's: real evidence.
        let mut q = probed();
        q.on_ack_with(
            &ack(1, &[]),
            at + 2 * MS,
            min_rtt,
            |_| Duration::ZERO,
            |_| {},
        );
        assert!(
            q.has_due(),
            "packets sent before a delivered probe and still out are lost"
        );
    }

    #[test]
    fn routes_events_rebinding_and_timer_restart() {
        let t0 = Instant::now();
        let mut q = RetransmitQueue::new();
        for s in 1..=4 {
            q.on_sent(s, Bytes::from(vec![0; s as usize]), t0, (s % 2) as usize);
        }
        // 2 and 4 went on route 0, 1 and 3 on route 1. Route 1 goes down: 1 and 3 are due.
        assert_eq!(q.mark_route_due(1), 2);
        assert_eq!(q.mark_route_due(1), 0);
        let r = q.pop_due(t0 + MS, |p| {
            assert_eq!(p.route, 1);
            0
        });
        assert_eq!(
            r,
            Some(Resend {
                seq: 1,
                payload: Bytes::from(vec![0; 1]).into(),
                previous_route: 1,
                route: 0
            })
        );
        let p1 = q.get(1).unwrap();
        assert!(p1.retransmitted && !p1.single_route && p1.route == 0);
        // An ACK of 2 reports it acked; 3 (sent before 2 was acked... at the same instant) is
        // not lost; events come through the callback.
        let mut events = Vec::new();
        let out = q.on_ack_with(
            &ack(0, &[2]),
            t0 + 2 * MS,
            None,
            |_| Duration::ZERO,
            |e| match e {
                QueueEvent::Acked(p) => events.push(("acked", p.route, p.payload.len())),
                QueueEvent::Lost(p) => events.push(("lost", p.route, p.payload.len())),
            },
        );
        assert_eq!(events, vec![("acked", 0, 2)]);
        assert_eq!(out.rtt_sample, Some(2 * MS));
        // The timer restarts from the ACK that made progress (after 1's resend at t0 + 1 ms).
        let rto = 10 * MS;
        assert_eq!(q.next_timeout(rto, 3), Some(t0 + 2 * MS + rto));
        q.pop_due(t0 + 2 * MS, |_| 0); // 3, on route 0 now
        // A later packet on route 1 is acknowledged; with a per-packet (per-route) loss delay,
        // 1, 3 and 4 (route 0, delay zero) are lost and reported once each.
        q.on_sent(5, Bytes::new(), t0 + 5 * MS, 1);
        events.clear();
        let mut lost = |q: &mut RetransmitQueue, at| {
            q.on_ack_with(
                &ack(0, &[2, 5]),
                at,
                None,
                |p| {
                    if p.route == 0 {
                        Duration::ZERO
                    } else {
                        Duration::MAX
                    }
                },
                |e| {
                    if let QueueEvent::Lost(p) = e {
                        events.push(("lost", p.route, p.payload.len()));
                    }
                },
            );
        };
        lost(&mut q, t0 + 6 * MS);
        lost(&mut q, t0 + 7 * MS);
        assert_eq!(events, vec![("lost", 0, 1), ("lost", 0, 3), ("lost", 0, 4)]);
        assert_eq!(q.next_timeout(rto, 3), None); // the oldest is due
    }
}
