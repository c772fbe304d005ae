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
//!   packets sent at the same time never prove each other lost. A loss timer
//!   ([`next_loss_time`](RetransmitQueue::next_loss_time)) fires when a packet reaches the delay
//!   without a further ACK.
//! * **Timeout**: only the oldest unacknowledged packet runs a timer, of `RTO × 2^retries` with
//!   the exponent truncated at `max_backoff`. When it expires that packet alone is sent again (a
//!   probe; its ACK then proves the others lost), and its retry count goes up. When the count
//!   reaches the retry limit the peer is declared dead. Any ACK from the peer resets the counts
//!   (the peer is alive).
//!
//! One timer rather than one per packet means a lost ACK, or an outage, costs one probe per
//! timeout rather than a retransmission of the whole window: no storms.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::packet::AckInfo;

/// A DATA packet waiting for its acknowledgement.
#[derive(Clone, Debug)]
pub struct SentPacket {
    /// The payload, kept for retransmission.
    pub payload: Bytes,
    /// When it was first sent.
    pub first_sent: Instant,
    /// When it was last sent.
    pub last_sent: Instant,
    /// Timeouts it has had since the peer last answered.
    pub retries: u32,
    /// Whether it was ever sent more than once (then its ACK gives no RTT sample).
    pub retransmitted: bool,
    /// Place of its latest transmission in the order of all transmissions.
    order: u64,
}

/// What an ACK did to the queue.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AckOutcome {
    /// Packets the ACK removed.
    pub newly_acked: usize,
    /// Round-trip sample from the latest-sent newly acknowledged packet, if it was never
    /// retransmitted.
    pub rtt_sample: Option<Duration>,
    /// Shortest time between the last transmission of a newly acknowledged, retransmitted packet
    /// and this ACK. Shorter than the minimum RTT means the ACK was for an earlier copy: the
    /// retransmission was spurious (the packet was only reordered).
    pub retransmission_acked_after: Option<Duration>,
}

/// What a timeout did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimeoutOutcome {
    /// No timer had expired.
    None,
    /// The packet with this sequence number is due for retransmission.
    Retransmit(u64),
    /// The oldest packet reached the retry limit: the peer is dead.
    Dead,
}

/// Unacknowledged DATA packets, by sequence number.
#[derive(Clone, Debug, Default)]
pub struct RetransmitQueue {
    packets: BTreeMap<u64, SentPacket>,
    /// Packets due to be sent again, by sequence number.
    due: BTreeSet<u64>,
    next_order: u64,
    /// Latest send time of an acknowledged transmission.
    largest_acked_sent: Option<Instant>,
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
        self.packets.contains_key(&seq)
    }

    /// The packet `seq`, if unacknowledged.
    pub fn get(&self, seq: u64) -> Option<&SentPacket> {
        self.packets.get(&seq)
    }

    /// Records the first transmission of `seq`.
    pub fn on_sent(&mut self, seq: u64, payload: Bytes, now: Instant) {
        let order = self.bump_order();
        self.packets.insert(
            seq,
            SentPacket {
                payload,
                first_sent: now,
                last_sent: now,
                retries: 0,
                retransmitted: false,
                order,
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
        let mut out = AckOutcome::default();
        let mut latest: Option<SentPacket> = None;
        let mut take = |this: &mut Self, seq: u64| {
            if let Some(p) = this.packets.remove(&seq) {
                this.due.remove(&seq);
                out.newly_acked += 1;
                if p.retransmitted {
                    let after = now.saturating_duration_since(p.last_sent);
                    out.retransmission_acked_after = Some(
                        out.retransmission_acked_after
                            .map_or(after, |a| a.min(after)),
                    );
                }
                if latest.as_ref().is_none_or(|l| p.order > l.order) {
                    latest = Some(p);
                }
            }
        };
        let below: Vec<u64> = self
            .packets
            .range(..=ack.cumulative)
            .map(|(&s, _)| s)
            .collect();
        for seq in below {
            take(self, seq);
        }
        for seq in ack.selective_seqs() {
            take(self, seq);
        }
        if let Some(p) = latest {
            if !p.retransmitted {
                out.rtt_sample = Some(now.saturating_duration_since(p.last_sent));
            }
            self.largest_acked_sent = Some(
                self.largest_acked_sent
                    .map_or(p.last_sent, |t| t.max(p.last_sent)),
            );
        }
        for p in self.packets.values_mut() {
            p.retries = 0;
        }
        self.detect_lost(now, loss_delay);
        out
    }

    /// Marks as due every packet sent (strictly) before an acknowledged one and out for
    /// `loss_delay`.
    pub fn detect_lost(&mut self, now: Instant, loss_delay: Duration) {
        let Some(largest) = self.largest_acked_sent else {
            return;
        };
        for (&seq, p) in &self.packets {
            if p.last_sent < largest && now.saturating_duration_since(p.last_sent) >= loss_delay {
                self.due.insert(seq);
            }
        }
    }

    /// When the next packet sent before an acknowledged one reaches `loss_delay` (then call
    /// [`detect_lost`](Self::detect_lost)).
    pub fn next_loss_time(&self, loss_delay: Duration) -> Option<Instant> {
        let largest = self.largest_acked_sent?;
        self.packets
            .iter()
            .filter(|(seq, p)| p.last_sent < largest && !self.due.contains(seq))
            .map(|(_, p)| p.last_sent + loss_delay)
            .min()
    }

    /// A NACK of `seq`: marks it due unless it was sent less than `nack_guard` ago. Returns
    /// whether it was marked.
    pub fn on_nack(&mut self, seq: u64, now: Instant, nack_guard: Duration) -> bool {
        match self.packets.get(&seq) {
            Some(p) if now.saturating_duration_since(p.last_sent) >= nack_guard => {
                self.due.insert(seq)
            }
            _ => false,
        }
    }

    /// When the oldest packet's timer expires.
    pub fn next_timeout(&self, rto: Duration, max_backoff: u32) -> Option<Instant> {
        let (seq, p) = self.packets.first_key_value()?;
        if self.due.contains(seq) {
            return None; // goes out at the next poll anyway
        }
        Some(p.last_sent + backoff(rto, p.retries, max_backoff))
    }

    /// Handles the timer: if the oldest packet's timer expired, marks it due and counts the retry,
    /// or reports the peer dead when it reached `retry_limit`.
    pub fn on_timeout(
        &mut self,
        now: Instant,
        rto: Duration,
        max_backoff: u32,
        retry_limit: u32,
    ) -> TimeoutOutcome {
        match self.next_timeout(rto, max_backoff) {
            Some(t) if t <= now => {
                let (&seq, p) = self
                    .packets
                    .first_key_value()
                    .expect("timer implies a packet");
                if p.retries >= retry_limit {
                    return TimeoutOutcome::Dead;
                }
                self.packets.get_mut(&seq).expect("present").retries += 1;
                self.due.insert(seq);
                TimeoutOutcome::Retransmit(seq)
            }
            _ => TimeoutOutcome::None,
        }
    }

    /// Takes the lowest due packet for retransmission now: returns its sequence number and
    /// payload and records the transmission.
    pub fn pop_due(&mut self, now: Instant) -> Option<(u64, Bytes)> {
        let seq = self.due.pop_first()?;
        let order = self.bump_order();
        let p = self.packets.get_mut(&seq).expect("due packets are queued");
        p.last_sent = now;
        p.retransmitted = true;
        p.order = order;
        Some((seq, p.payload.clone()))
    }

    /// Whether some packet is due for retransmission.
    pub fn has_due(&self) -> bool {
        !self.due.is_empty()
    }
}

/// `rto × 2^min(retries, max_backoff)`, saturating.
pub fn backoff(rto: Duration, retries: u32, max_backoff: u32) -> Duration {
    let exp = retries.min(max_backoff).min(31);
    rto.saturating_mul(1u32 << exp)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        }
    }

    fn queue(t0: Instant, n: u64) -> RetransmitQueue {
        let mut q = RetransmitQueue::new();
        for s in 1..=n {
            q.on_sent(s, Bytes::from(vec![s as u8]), t0);
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
            q.on_sent(s, Bytes::new(), t0);
        }
        for s in 4..=6 {
            q.on_sent(s, Bytes::new(), t0 + MS);
        }
        let delay = 5 * MS;
        q.on_ack(&ack(0, &[5]), t0 + 2 * MS, delay);
        // 1..4 were sent before 5 but are not out for the loss delay yet; 6 was sent after 5.
        assert!(!q.has_due());
        assert_eq!(q.next_loss_time(delay), Some(t0 + delay));
        q.detect_lost(t0 + delay, delay);
        assert_eq!(q.pop_due(t0 + delay).map(|(s, _)| s), Some(1));
        assert_eq!(q.pop_due(t0 + delay).map(|(s, _)| s), Some(2));
        assert_eq!(q.pop_due(t0 + delay).map(|(s, _)| s), Some(3));
        assert_eq!(q.pop_due(t0 + delay), None);
        // 4 went out together with 5: never proven lost by 5.
        assert_eq!(q.next_loss_time(delay), None);
        // Retransmitted 1..3 are newer than 5 now: not lost again by an ACK of 5.
        q.on_ack(&ack(0, &[5]), t0 + 20 * MS, delay);
        assert!(!q.has_due());
        // The ACK of a retransmitted packet gives no sample (Karn).
        let out = q.on_ack(&ack(1, &[]), t0 + 8 * MS, delay);
        assert_eq!((out.newly_acked, out.rtt_sample), (1, None));
        assert_eq!(out.retransmission_acked_after, Some(8 * MS - delay));
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
        assert_eq!(q.pop_due(t0 + 2 * MS).map(|(s, _)| s), Some(2));
        assert!(!q.on_nack(2, t0 + 2 * MS + MS / 2, MS)); // answers the old copy
    }

    #[test]
    fn timer_probes_oldest_with_backoff_until_dead() {
        let t0 = Instant::now();
        let mut q = queue(t0, 3);
        let rto = 10 * MS;
        assert_eq!(q.next_timeout(rto, 2), Some(t0 + rto));
        assert_eq!(q.on_timeout(t0 + 9 * MS, rto, 2, 3), TimeoutOutcome::None);
        let mut now = t0 + rto;
        let mut expected_gap = rto;
        for retry in 1..=3 {
            assert_eq!(q.on_timeout(now, rto, 2, 3), TimeoutOutcome::Retransmit(1));
            assert_eq!(q.next_timeout(rto, 2), None);
            assert_eq!(q.pop_due(now).map(|(s, _)| s), Some(1));
            assert!(!q.has_due()); // only the oldest is probed
            expected_gap = backoff(rto, retry, 2);
            now += expected_gap;
            assert_eq!(q.next_timeout(rto, 2), Some(now));
        }
        assert_eq!(expected_gap, 4 * rto);
        assert_eq!(q.on_timeout(now, rto, 2, 3), TimeoutOutcome::Dead);
        // An ACK (the peer is alive) resets the count.
        q.on_ack(&ack(0, &[]), now, Duration::MAX);
        assert_eq!(q.next_timeout(rto, 2), Some(now - 4 * rto + rto));
    }
}
