//! [`Liveness`]: is the peer still there?
//!
//! A peer is declared dead when nothing at all (no DATA, ACK, PING, PONG) has been heard from it
//! for [`peer_timeout`](super::LinkConfig::peer_timeout) while the link has reason to hear from
//! it. That reason is either data of ours it has not acknowledged (*awaiting*), or, with
//! keepalive on, simply that the peer has not said goodbye: a live peer answers the keepalive
//! PINGs this link sends whenever it has heard nothing for the keepalive interval, so silence
//! for the whole timeout means its process is gone. This is what lets a rank blocked in a
//! receive from a crashed peer fail with `PeerFailed` instead of hanging, with nothing of its
//! own in flight.
//!
//! A peer that closed cleanly says BYE ([`on_bye`](Liveness::on_bye)): it is no longer pinged,
//! and its silence is normal unless data of ours is still unacknowledged.
//!
//! The clock is the caller's (`now` in every call), so the rules are tested in simulated time.

use std::time::{Duration, Instant};

/// Shortest keepalive interval used, whatever the configuration says.
pub const MIN_KEEPALIVE: Duration = Duration::from_millis(1);

/// The liveness rules of one link (see the [module docs](self)).
#[derive(Clone, Debug)]
pub struct Liveness {
    timeout: Duration,
    keepalive: Option<Duration>,
    /// Silence is counted from here: the latest packet heard, or the start of waiting for an
    /// answer. `None` before any contact.
    since: Option<Instant>,
    /// When the latest keepalive PING was due.
    last_ping: Option<Instant>,
    ping_due: bool,
    peer_closed: bool,
    local_closed: bool,
}

impl Liveness {
    /// Rules with the peer timeout `timeout` and, if `keepalive` is set, a PING after that much
    /// silence (at least [`MIN_KEEPALIVE`]).
    pub fn new(timeout: Duration, keepalive: Option<Duration>) -> Self {
        Self {
            timeout,
            keepalive: keepalive.map(|k| k.max(MIN_KEEPALIVE)),
            since: None,
            last_ping: None,
            ping_due: false,
            peer_closed: false,
            local_closed: false,
        }
    }

    /// A valid packet arrived from the peer.
    pub fn on_heard(&mut self, now: Instant) {
        self.since = Some(self.since.map_or(now, |s| s.max(now)));
    }

    /// The link starts waiting for an answer (data goes out while nothing was in flight). Without
    /// keepalive, silence is counted from here: an idle gap before it says nothing about the peer.
    pub fn on_await_start(&mut self, now: Instant) {
        if self.keepalive.is_none() || self.since.is_none() {
            self.since = Some(self.since.map_or(now, |s| s.max(now)));
        }
    }

    /// The peer said BYE: it closed cleanly and will not answer keepalives any more.
    pub fn on_bye(&mut self) {
        self.peer_closed = true;
        self.ping_due = false;
    }

    /// This side closed: it sends no more keepalives (it still waits for its data's ACKs).
    pub fn on_local_close(&mut self) {
        self.local_closed = true;
        self.ping_due = false;
    }

    /// Whether this side closed.
    pub fn local_closed(&self) -> bool {
        self.local_closed
    }

    /// Whether the peer said BYE.
    pub fn peer_closed(&self) -> bool {
        self.peer_closed
    }

    fn pinging(&self) -> Option<Duration> {
        self.keepalive
            .filter(|_| !self.peer_closed && !self.local_closed)
    }

    /// When silence makes the peer dead, given whether data of ours is unacknowledged.
    fn death_time(&self, awaiting: bool) -> Option<Instant> {
        let since = self.since?;
        (awaiting || self.pinging().is_some()).then(|| since + self.timeout)
    }

    fn ping_time(&self) -> Option<Instant> {
        let keepalive = self.pinging()?;
        let since = self.since?;
        if self.ping_due {
            return None; // goes out at the next poll
        }
        Some(self.last_ping.map_or(since, |p| p.max(since)) + keepalive)
    }

    /// The next deadline of these rules, if any.
    pub fn poll_timeout(&self, awaiting: bool) -> Option<Instant> {
        [self.death_time(awaiting), self.ping_time()]
            .into_iter()
            .flatten()
            .min()
    }

    /// Runs the rules at `now`: returns `true` if the peer is now considered dead; otherwise
    /// marks a keepalive PING due when one is.
    pub fn on_timeout(&mut self, now: Instant, awaiting: bool) -> bool {
        if self.death_time(awaiting).is_some_and(|t| t <= now) {
            self.ping_due = false;
            return true;
        }
        if self.ping_time().is_some_and(|t| t <= now) {
            self.ping_due = true;
            self.last_ping = Some(now);
        }
        false
    }

    /// Takes a due keepalive PING.
    pub fn take_ping(&mut self) -> bool {
        std::mem::take(&mut self.ping_due)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn nothing_runs_before_contact() {
        let l = Liveness::new(5 * S, Some(S));
        assert_eq!(l.poll_timeout(false), None);
        assert_eq!(l.poll_timeout(true), None);
    }

    #[test]
    fn without_keepalive_only_awaited_silence_kills() {
        let t0 = Instant::now();
        let mut l = Liveness::new(5 * S, None);
        l.on_heard(t0);
        assert_eq!(l.poll_timeout(false), None);
        assert!(!l.on_timeout(t0 + 100 * S, false));
        // Waiting starts late: silence counts from then, not from the last packet.
        l.on_await_start(t0 + 100 * S);
        assert_eq!(l.poll_timeout(true), Some(t0 + 105 * S));
        assert!(!l.on_timeout(t0 + 104 * S, true));
        assert!(l.on_timeout(t0 + 105 * S, true));
        assert!(!l.take_ping());
    }

    #[test]
    fn keepalive_pings_after_each_silent_interval_and_kills_after_the_timeout() {
        let t0 = Instant::now();
        let mut l = Liveness::new(5 * S, Some(S));
        l.on_heard(t0);
        assert_eq!(l.poll_timeout(false), Some(t0 + S));
        let mut pings = 0;
        let mut now;
        loop {
            now = l.poll_timeout(false).unwrap();
            if l.on_timeout(now, false) {
                break;
            }
            pings += usize::from(l.take_ping());
        }
        assert_eq!(now, t0 + 5 * S);
        assert_eq!(pings, 4, "one PING per silent second before the timeout");
    }

    #[test]
    fn an_answer_resets_the_clock() {
        let t0 = Instant::now();
        let mut l = Liveness::new(5 * S, Some(S));
        l.on_heard(t0);
        assert!(!l.on_timeout(t0 + S, false));
        assert!(l.take_ping());
        l.on_heard(t0 + S + S / 10); // the PONG
        assert_eq!(l.poll_timeout(false), Some(t0 + 2 * S + S / 10));
        assert!(!l.on_timeout(t0 + 5 * S, false));
    }

    #[test]
    fn bye_stops_pings_and_idle_death_but_not_awaited_death() {
        let t0 = Instant::now();
        let mut l = Liveness::new(5 * S, Some(S));
        l.on_heard(t0);
        l.on_bye();
        assert!(l.peer_closed());
        assert_eq!(l.poll_timeout(false), None);
        assert!(!l.on_timeout(t0 + 100 * S, false));
        assert!(!l.take_ping());
        assert_eq!(l.poll_timeout(true), Some(t0 + 5 * S));
        assert!(l.on_timeout(t0 + 5 * S, true));
    }

    #[test]
    fn local_close_stops_pings() {
        let t0 = Instant::now();
        let mut l = Liveness::new(5 * S, Some(S));
        l.on_heard(t0);
        l.on_local_close();
        assert_eq!(l.poll_timeout(false), None);
        assert_eq!(l.poll_timeout(true), Some(t0 + 5 * S));
    }
}
