//! Round-trip time estimation and the retransmission timeout (Jacobson/Karels, RFC 6298).

use std::time::Duration;

/// Smoothed round-trip time and its variation, from ACK samples.
///
/// Feed it only samples of packets that were never retransmitted (Karn's rule: the ACK of a
/// retransmitted packet cannot tell which transmission it answers).
#[derive(Clone, Debug)]
pub struct RttEstimator {
    // Kept in nanoseconds: `Duration` arithmetic normalizes seconds and nanoseconds (with
    // divisions) on every operation, and this runs for every ACK.
    srtt: Option<u64>,
    rttvar: u64,
    latest: Option<Duration>,
    min: Option<Duration>,
    initial_rto: Duration,
    min_rto: Duration,
    max_rto: Duration,
    max_ack_delay: u64,
    /// [`rto`](Self::rto), computed when an input changes: timers ask for it several times per
    /// packet, samples come once per ACK.
    rto: Duration,
}

/// `d` in nanoseconds, saturating (585 years).
fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl RttEstimator {
    /// An estimator with no samples yet: its RTO is `initial_rto` until the first sample.
    /// Every RTO is clamped to `[min_rto, max_rto]`.
    pub fn new(initial_rto: Duration, min_rto: Duration, max_rto: Duration) -> Self {
        Self {
            srtt: None,
            rttvar: 0,
            latest: None,
            min: None,
            initial_rto,
            min_rto,
            max_rto,
            max_ack_delay: 0,
            rto: Duration::ZERO,
        }
        .with_rto_computed()
    }

    fn with_rto_computed(mut self) -> Self {
        self.compute_rto();
        self
    }

    fn compute_rto(&mut self) {
        let raw = match self.srtt {
            None => self.initial_rto,
            Some(srtt) => Duration::from_nanos(
                srtt.saturating_add(self.rttvar.saturating_mul(4))
                    .saturating_add(self.max_ack_delay),
            ),
        };
        self.rto = raw.clamp(self.min_rto, self.max_rto.max(self.min_rto));
    }

    /// The same estimator, adding `max_ack_delay` (how long the peer may hold back an ACK) to
    /// every RTO computed from samples, as QUIC's probe timeout does: a delayed ACK is then no
    /// reason for a timeout.
    pub fn with_max_ack_delay(self, max_ack_delay: Duration) -> Self {
        Self {
            max_ack_delay: nanos(max_ack_delay),
            ..self
        }
        .with_rto_computed()
    }

    /// Adds one round-trip sample.
    pub fn on_sample(&mut self, rtt: Duration) {
        self.latest = Some(rtt);
        self.min = Some(self.min.map_or(rtt, |m| m.min(rtt)));
        let r = nanos(rtt);
        match self.srtt {
            None => {
                self.srtt = Some(r);
                self.rttvar = r / 2;
            }
            Some(srtt) => {
                let diff = srtt.abs_diff(r);
                self.rttvar = self.rttvar.saturating_mul(3).saturating_add(diff) / 4;
                self.srtt = Some(srtt.saturating_mul(7).saturating_add(r) / 8);
            }
        }
        self.compute_rto();
    }

    /// The smoothed round-trip time, once there is a sample.
    pub fn smoothed(&self) -> Option<Duration> {
        self.srtt.map(Duration::from_nanos)
    }

    /// The most recent sample.
    pub fn latest(&self) -> Option<Duration> {
        self.latest
    }

    /// The smallest sample.
    pub fn min(&self) -> Option<Duration> {
        self.min
    }

    /// The round-trip variation (`RTTVAR`).
    pub fn variation(&self) -> Duration {
        Duration::from_nanos(self.rttvar)
    }

    /// How long a packet sent before an acknowledged one may be out before it counts as lost
    /// (time-threshold loss detection, as RACK and QUIC): `max(9/8·max(SRTT, latest),
    /// SRTT + 4·RTTVAR)`, stretched by `stretch_quarters` quarters; `None` before any sample.
    pub fn loss_delay(&self, stretch_quarters: u32) -> Option<Duration> {
        let (s, l) = (self.srtt?, nanos(self.latest?));
        let base =
            (s.max(l).saturating_mul(9) / 8).max(s.saturating_add(self.rttvar.saturating_mul(4)));
        let stretched = base.saturating_mul(4 + u64::from(stretch_quarters)) / 4;
        Some(Duration::from_nanos(stretched))
    }

    /// The retransmission timeout: `SRTT + 4·RTTVAR + max ACK delay` clamped to
    /// `[min_rto, max_rto]`, or the initial RTO (clamped the same way) before any sample.
    pub fn rto(&self) -> Duration {
        self.rto
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn initial_then_samples() {
        let mut e = RttEstimator::new(10 * MS, MS, 100 * MS);
        assert_eq!(e.rto(), 10 * MS);
        assert_eq!(e.smoothed(), None);
        e.on_sample(4 * MS);
        assert_eq!(e.smoothed(), Some(4 * MS));
        assert_eq!(e.variation(), 2 * MS);
        assert_eq!(e.rto(), 12 * MS);
        // Steady samples shrink the variation towards zero.
        for _ in 0..100 {
            e.on_sample(4 * MS);
        }
        assert_eq!(e.smoothed(), Some(4 * MS));
        assert!(e.rto() < 5 * MS && e.rto() >= 4 * MS);
    }

    #[test]
    fn clamped() {
        let mut e = RttEstimator::new(10 * MS, 2 * MS, 50 * MS);
        e.on_sample(Duration::from_micros(10));
        assert_eq!(e.rto(), 2 * MS);
        e.on_sample(Duration::from_secs(10));
        assert_eq!(e.rto(), 50 * MS);
        let e = RttEstimator::new(Duration::ZERO, 2 * MS, 50 * MS);
        assert_eq!(e.rto(), 2 * MS);
    }

    #[test]
    fn jacobson_update() {
        let mut e = RttEstimator::new(10 * MS, Duration::ZERO, Duration::MAX);
        e.on_sample(8 * MS); // srtt 8, var 4
        e.on_sample(16 * MS); // var = (12 + 8)/4 = 5, srtt = (56 + 16)/8 = 9
        assert_eq!(e.variation(), 5 * MS);
        assert_eq!(e.smoothed(), Some(9 * MS));
        assert_eq!(e.rto(), 29 * MS);
        assert_eq!(e.latest(), Some(16 * MS));
        assert_eq!(e.min(), Some(8 * MS));
        assert_eq!(e.loss_delay(0), Some(29 * MS)); // 9 + 4·5 > 9/8·16
        assert_eq!(e.loss_delay(4), Some(58 * MS));
        assert_eq!(RttEstimator::new(MS, MS, MS).loss_delay(0), None);
        let e = e.with_max_ack_delay(MS);
        assert_eq!(e.rto(), 30 * MS);
        let fresh =
            RttEstimator::new(10 * MS, Duration::ZERO, Duration::MAX).with_max_ack_delay(MS);
        assert_eq!(fresh.rto(), 10 * MS);
    }
}
