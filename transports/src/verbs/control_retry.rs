//! What the control exchanges over UD share, sans-IO: the retransmission timer of a Request
//! or Reply waiting for its answer (doubling backoff, a bounded number of sends) and the
//! counters of an exchange.
//!
//! Both the connection set-up ([`super::connection_manager`]) and the lane fail-back
//! ([`super::lane_reconnect`]) send a request, a reply and a confirm as UD datagrams, resend
//! the request and the reply after [`CmConfig::retransmit`] (doubling each time) up to
//! [`CmConfig::attempts`] sends, and count the same things.

use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;

use super::connection_manager::{CmConfig, CmMessage};

/// Counters of a control exchange: the connection set-up
/// ([`CmCounters`](super::connection_manager::CmCounters)) or the lane fail-back
/// ([`LaneCounters`](super::lane_reconnect::LaneCounters)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ControlCounters {
    /// Requests sent, retransmissions included.
    pub requests_sent: u64,
    /// Replies sent, retransmissions and answers to duplicates included.
    pub replies_sent: u64,
    /// Confirms sent.
    pub confirms_sent: u64,
    /// Retransmissions after a timeout.
    pub retransmissions: u64,
    /// Messages that were duplicates or stale and changed nothing.
    pub duplicates: u64,
    /// Requests ignored because this rank's own simultaneous request wins the tie-break.
    pub ties_won: u64,
    /// Own attempts abandoned (turned into answers) because the peer's simultaneous request
    /// won.
    pub ties_lost: u64,
    /// Connections (or lanes, on this side) established.
    pub established: u64,
    /// Attempts that ran out of sends, or (lanes) whose queue pair the driver could not make.
    pub failed: u64,
}

impl ControlCounters {
    /// Counts the sending of `m`, by its kind.
    pub(crate) fn count_sent(&mut self, m: &CmMessage) {
        match m {
            CmMessage::Request { .. } | CmMessage::LaneRequest { .. } => self.requests_sent += 1,
            CmMessage::Reply { .. } | CmMessage::LaneReply { .. } => self.replies_sent += 1,
            CmMessage::Confirm { .. } | CmMessage::LaneConfirm { .. } => self.confirms_sent += 1,
        }
    }
}

/// The settings an exchange runs with: `config` with at least one send per attempt.
pub(crate) fn normalized(config: CmConfig) -> CmConfig {
    CmConfig {
        attempts: config.attempts.max(1),
        ..config
    }
}

/// The retransmission timer of a message waiting for its answer: how often it was sent, and
/// when it is due again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RetryTimer {
    sends: u32,
    due: Instant,
}

/// What a due [`RetryTimer`] asks of its exchange.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Expiry<K> {
    /// Send the waiting message of `K` (given) again.
    Resend(K, CmMessage),
    /// The attempt of `K` ran out of sends: it failed (and is idle now).
    GiveUp(K),
}

impl RetryTimer {
    /// The timer of a message first sent at `now`.
    pub(crate) fn started(now: Instant, config: &CmConfig) -> RetryTimer {
        RetryTimer {
            sends: 1,
            due: now + backoff(config, 1),
        }
    }

    /// The timer is due at `now`: counts another send and re-arms it, or, when the attempt
    /// has made all its sends, says it gives up.
    fn expire(&mut self, now: Instant, config: &CmConfig) -> bool {
        if self.sends >= config.attempts {
            return false;
        }
        self.sends += 1;
        self.due = now + backoff(config, self.sends);
        true
    }
}

/// The wait after the `sends`-th send: [`CmConfig::retransmit`], doubled after each send.
fn backoff(config: &CmConfig, sends: u32) -> Duration {
    config
        .retransmit
        .saturating_mul(1u32 << sends.saturating_sub(1).min(16))
}

/// The state of one exchange (with a peer, or with a peer on one lane) that
/// [`earliest_due`] and [`expire_due`] run the retransmission timer of.
pub(crate) trait ExchangeState<K>: Copy {
    /// No exchange under way (where an attempt that ran out of sends ends).
    const IDLE: Self;

    /// While the exchange of `key` waits for an answer: its retransmission timer and the
    /// message to send again.
    fn waiting(&mut self, key: K) -> Option<(&mut RetryTimer, CmMessage)>;
}

/// The earliest retransmission deadline among `states`, if any waits for an answer.
pub(crate) fn earliest_due<K: Copy, S: ExchangeState<K>>(
    states: &FxHashMap<K, S>,
) -> Option<Instant> {
    states
        .iter()
        .filter_map(|(&key, state)| {
            let mut state = *state;
            state.waiting(key).map(|(timer, _)| timer.due)
        })
        .min()
}

/// Runs the timers of `states` due at `now`: re-arms those with sends left, and makes idle
/// those that ran out of sends, counting retransmissions and failures in `counters`;
/// returns what each expired exchange must do, in the order of `states`.
pub(crate) fn expire_due<K: Copy, S: ExchangeState<K>>(
    states: &mut FxHashMap<K, S>,
    now: Instant,
    config: &CmConfig,
    counters: &mut ControlCounters,
) -> Vec<Expiry<K>> {
    let mut expired = Vec::new();
    for (&key, state) in states.iter_mut() {
        let Some((timer, message)) = state.waiting(key) else {
            continue;
        };
        if timer.due > now {
            continue;
        }
        if timer.expire(now, config) {
            counters.retransmissions += 1;
            expired.push(Expiry::Resend(key, message));
        } else {
            counters.failed += 1;
            *state = S::IDLE;
            expired.push(Expiry::GiveUp(key));
        }
    }
    expired
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One exchange that waits for an answer to a Confirm (any message does).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Test {
        Idle,
        Waiting(RetryTimer),
    }

    impl ExchangeState<u32> for Test {
        const IDLE: Test = Test::Idle;

        fn waiting(&mut self, key: u32) -> Option<(&mut RetryTimer, CmMessage)> {
            match self {
                Test::Waiting(timer) => Some((timer, CmMessage::Confirm { seq: key })),
                Test::Idle => None,
            }
        }
    }

    #[test]
    fn the_backoff_doubles_and_the_attempt_gives_up_after_its_sends() {
        let config = CmConfig {
            retransmit: Duration::from_millis(10),
            attempts: 3,
        };
        let t0 = Instant::now();
        let mut counters = ControlCounters::default();
        let mut states = FxHashMap::default();
        states.insert(5u32, Test::Waiting(RetryTimer::started(t0, &config)));
        let ms = Duration::from_millis;
        assert_eq!(earliest_due(&states), Some(t0 + ms(10)));
        assert!(expire_due(&mut states, t0, &config, &mut counters).is_empty());
        let t1 = t0 + ms(10);
        let resend = Expiry::Resend(5, CmMessage::Confirm { seq: 5 });
        assert_eq!(
            expire_due(&mut states, t1, &config, &mut counters),
            vec![resend]
        );
        assert_eq!(earliest_due(&states), Some(t1 + ms(20)));
        let t2 = t1 + ms(20);
        assert_eq!(
            expire_due(&mut states, t2, &config, &mut counters),
            vec![resend]
        );
        assert_eq!(earliest_due(&states), Some(t2 + ms(40)));
        let t3 = t2 + ms(40);
        let give_up = expire_due(&mut states, t3, &config, &mut counters);
        assert_eq!(give_up, vec![Expiry::GiveUp(5)]);
        assert_eq!(states[&5], Test::Idle);
        assert_eq!(earliest_due(&states), None);
        assert_eq!((counters.retransmissions, counters.failed), (2, 1));
    }
}
