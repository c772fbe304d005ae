//! Credit-based flow control over pre-posted receive buffers.
//!
//! Every message on an RC connection (and every RDMA write with immediate data) consumes one
//! receive buffer the peer posted; a message that finds none is not lost but stalls the queue
//! pair (RNR) and, after the retries, breaks it. So a sender holds one *credit* per receive
//! buffer the peer has posted for it and spends one per message. The receiver reposts a buffer
//! as soon as it has taken the message out and *owes* the sender a credit; it returns what it
//! owes on every message it sends the other way, or in a message of its own once it owes
//! [`Credits::update_threshold`] or more.
//!
//! The last credit is kept for those credit-only messages (and the final BYE): data may spend
//! a credit only while at least two are left. So two ranks that both run out can always tell
//! each other about the buffers they reposted, and neither waits for ever. A credit-only
//! message itself consumes a buffer, which is owed back like any other; since one is sent only
//! when the threshold (at least 2) is reached, they do not answer each other without end.

/// One direction's credit state of a connection (see the [module docs](self)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Credits {
    available: u32,
    owed: u32,
    threshold: u32,
}

impl Credits {
    /// A connection whose peer posted `window` receive buffers for us and we as many for it.
    /// `window` must be at least 4 (checked by the transport's settings).
    pub fn new(window: u32) -> Credits {
        Credits {
            available: window,
            owed: 0,
            threshold: (window / 2).max(2),
        }
    }

    /// Credits held now.
    pub fn available(&self) -> u32 {
        self.available
    }

    /// Credits owed to the peer now.
    pub fn owed(&self) -> u32 {
        self.owed
    }

    /// How much must be owed before a credit-only message is sent.
    pub fn update_threshold(&self) -> u32 {
        self.threshold
    }

    /// Whether a data message (or RDMA write with immediate data) may be sent now.
    pub fn can_send_data(&self) -> bool {
        self.available >= 2
    }

    /// Whether a credit-only or BYE message may be sent now (the reserved last credit).
    pub fn can_send_control(&self) -> bool {
        self.available >= 1
    }

    /// Whether enough is owed that a credit-only message is due.
    pub fn update_due(&self) -> bool {
        self.owed >= self.threshold
    }

    /// Spends one credit on a message and returns what the message gives back (everything
    /// owed, up to `u16::MAX`). The caller checked [`can_send_data`](Self::can_send_data) or
    /// [`can_send_control`](Self::can_send_control).
    pub fn spend(&mut self) -> u16 {
        self.available = self.available.saturating_sub(1);
        let give = self.owed.min(u32::from(u16::MAX));
        self.owed -= give;
        give as u16
    }

    /// Spends one credit on a message that cannot carry a credit field (an RDMA write with
    /// immediate data).
    pub fn spend_without_return(&mut self) {
        self.available = self.available.saturating_sub(1);
    }

    /// The peer returned `n` credits.
    pub fn returned(&mut self, n: u16) {
        self.available += u32::from(n);
    }

    /// A receive buffer the peer filled was reposted: one more credit is owed.
    pub fn reposted(&mut self) {
        self.owed += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two ends with their own credit states; `inflight` messages are consumed by the other
    /// end one step later.
    #[test]
    fn the_last_credit_is_reserved_for_credit_updates() {
        let mut c = Credits::new(4);
        assert_eq!(c.update_threshold(), 2);
        for _ in 0..3 {
            assert!(c.can_send_data());
            assert_eq!(c.spend(), 0);
        }
        assert!(!c.can_send_data(), "one left: reserved");
        assert!(c.can_send_control());
        c.reposted();
        assert!(!c.update_due());
        c.reposted();
        assert!(c.update_due());
        assert_eq!(c.spend(), 2, "the update returns all that is owed");
        assert_eq!(c.available(), 0);
        assert!(!c.can_send_control());
        c.returned(3);
        assert!(c.can_send_data());
        assert_eq!(c.owed(), 0);
    }

    /// A randomised exchange between two ends that send whenever the rules allow: whatever
    /// the interleaving, every queued message gets through and no end spends a credit it
    /// does not have (which would be an RNR on the wire).
    #[test]
    fn two_ends_never_deadlock_nor_overrun() {
        use rankweave_core::rng::SplitMix64;
        for seed in 0..200u64 {
            let mut rng = SplitMix64(seed);
            let window = 4 + (rng.next_u64() % 6) as u32;
            let mut ends = [Credits::new(window), Credits::new(window)];
            // Buffers of each end that are posted and empty.
            let mut posted = [window, window];
            let mut to_send = [1000u32, 1000u32];
            // Messages in flight towards end i: (credits carried).
            let mut wire: [Vec<u16>; 2] = [Vec::new(), Vec::new()];
            let mut steps = 0;
            while to_send.iter().any(|&n| n > 0) || wire.iter().any(|w| !w.is_empty()) {
                steps += 1;
                assert!(steps < 100_000, "seed {seed}: no progress");
                let i = (rng.next_u64() % 2) as usize;
                let j = 1 - i;
                match rng.next_u64() % 3 {
                    // End i sends data, or a credit update if one is due.
                    0 => {
                        let c = &mut ends[i];
                        if to_send[i] > 0 && c.can_send_data() {
                            to_send[i] -= 1;
                        } else if c.update_due() && c.can_send_control() {
                        } else {
                            continue;
                        }
                        let give = c.spend();
                        assert!(posted[j] > 0, "seed {seed}: RNR at end {j}");
                        posted[j] -= 1;
                        wire[j].push(give);
                    }
                    // End i takes in one message and reposts its buffer at once.
                    _ => {
                        if wire[i].is_empty() {
                            continue;
                        }
                        let give = wire[i].remove(0);
                        ends[i].returned(give);
                        posted[i] += 1;
                        ends[i].reposted();
                    }
                }
            }
        }
    }
}
