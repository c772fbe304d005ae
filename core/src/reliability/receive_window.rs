//! The receiver's side of a link: duplicate suppression, reordering, in-order delivery, and
//! the acknowledgement to send.
//!
//! The window is counted from the first sequence number not yet taken by the application
//! ([`pop`](ReceiveWindow::pop)): packets delivered in order but not yet taken occupy the window
//! too, so a receiver whose application is slow accepts no more than `window` packets, and its
//! ACKs tell the sender where the window ends (flow control).

use std::collections::{BTreeMap, VecDeque};

use bytes::Bytes;

use super::packet::{AckInfo, MAX_SACK_WORDS};

/// What became of an arriving DATA packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arrival {
    /// It was the next expected one: it (and any buffered successors) are ready for delivery.
    InOrder,
    /// It is ahead of a gap: buffered until the gap fills.
    OutOfOrder,
    /// Already received: dropped.
    Duplicate,
    /// Beyond the window: dropped.
    OutOfWindow,
}

/// Sequence numbers received from one peer.
#[derive(Clone, Debug)]
pub struct ReceiveWindow {
    /// The first sequence number not received in order.
    next_expected: u64,
    /// Received ahead of a gap.
    buffered: BTreeMap<u64, Bytes>,
    /// Received in order, not yet taken by the application.
    ready: VecDeque<Bytes>,
    window: u64,
}

impl ReceiveWindow {
    /// A window of `window` packets (at least 1), expecting sequence number 1 first.
    pub fn new(window: u64) -> Self {
        Self {
            next_expected: 1,
            buffered: BTreeMap::new(),
            ready: VecDeque::new(),
            window: window.clamp(1, MAX_SACK_WORDS as u64 * 64),
        }
    }

    /// The first sequence number not yet received in order.
    pub fn next_expected(&self) -> u64 {
        self.next_expected
    }

    /// How many packets the window holds.
    pub fn capacity(&self) -> u64 {
        self.window
    }

    /// Sequence numbers at or above this are beyond the window.
    pub fn window_end(&self) -> u64 {
        self.next_expected - self.ready.len() as u64 + self.window
    }

    /// Whether packets wait out of order, beyond a gap.
    pub fn has_gap(&self) -> bool {
        !self.buffered.is_empty()
    }

    /// Packets held: ready for the application plus buffered out of order.
    pub fn held(&self) -> usize {
        self.ready.len() + self.buffered.len()
    }

    /// Whether `seq` was received already.
    pub fn has_received(&self, seq: u64) -> bool {
        seq < self.next_expected || self.buffered.contains_key(&seq)
    }

    /// Takes one arriving DATA packet.
    pub fn on_data(&mut self, seq: u64, payload: Bytes) -> Arrival {
        if self.has_received(seq) {
            return Arrival::Duplicate;
        }
        if seq >= self.window_end() {
            return Arrival::OutOfWindow;
        }
        if seq != self.next_expected {
            self.buffered.insert(seq, payload);
            return Arrival::OutOfOrder;
        }
        self.ready.push_back(payload);
        self.next_expected += 1;
        while let Some(p) = self.buffered.remove(&self.next_expected) {
            self.ready.push_back(p);
            self.next_expected += 1;
        }
        Arrival::InOrder
    }

    /// The next payload in order, for the application.
    pub fn pop(&mut self) -> Option<Bytes> {
        self.ready.pop_front()
    }

    /// What to acknowledge: cumulative, the selective bitmap of buffered packets, the window end,
    /// and `nack`.
    pub fn ack_info(&self, nack: Option<u64>) -> AckInfo {
        let cumulative = self.next_expected - 1;
        let base = cumulative + 2;
        let mut selective: Vec<u64> = Vec::new();
        for &seq in self.buffered.keys() {
            let i = seq - base;
            let word = (i / 64) as usize;
            if word >= MAX_SACK_WORDS {
                break;
            }
            if selective.len() <= word {
                selective.resize(word + 1, 0);
            }
            selective[word] |= 1 << (i % 64);
        }
        AckInfo {
            cumulative,
            window_end: self.window_end(),
            selective,
            nack,
            duplicate: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(x: u8) -> Bytes {
        Bytes::from(vec![x])
    }

    #[test]
    fn in_order_out_of_order_duplicates() {
        let mut w = ReceiveWindow::new(8);
        assert_eq!(w.on_data(2, b(2)), Arrival::OutOfOrder);
        assert_eq!(w.on_data(4, b(4)), Arrival::OutOfOrder);
        assert_eq!(w.on_data(2, b(2)), Arrival::Duplicate);
        let ack = w.ack_info(None);
        assert_eq!(ack.cumulative, 0);
        assert_eq!(ack.selective_seqs().collect::<Vec<_>>(), vec![2, 4]);
        assert_eq!(w.on_data(1, b(1)), Arrival::InOrder);
        assert_eq!(w.next_expected(), 3);
        assert_eq!(w.on_data(1, b(1)), Arrival::Duplicate);
        assert!(w.has_received(4) && !w.has_received(3));
        assert_eq!(w.pop(), Some(b(1)));
        assert_eq!(w.pop(), Some(b(2)));
        assert_eq!(w.pop(), None);
        assert_eq!(w.on_data(3, b(3)), Arrival::InOrder);
        assert_eq!(w.pop(), Some(b(3)));
        assert_eq!(w.pop(), Some(b(4)));
        let ack = w.ack_info(Some(7));
        assert_eq!(
            (ack.cumulative, ack.nack, ack.selective.len()),
            (4, Some(7), 0)
        );
        assert_eq!(ack.window_end, 5 + 8);
    }

    #[test]
    fn window_counts_undelivered_packets() {
        let mut w = ReceiveWindow::new(4);
        assert_eq!(w.on_data(5, b(5)), Arrival::OutOfWindow);
        for s in 1..=3 {
            assert_eq!(w.on_data(s, b(s as u8)), Arrival::InOrder);
        }
        assert_eq!(w.on_data(4, b(4)), Arrival::InOrder);
        assert_eq!(w.held(), 4);
        assert_eq!(w.window_end(), 5);
        assert_eq!(w.on_data(5, b(5)), Arrival::OutOfWindow);
        assert_eq!(w.pop(), Some(b(1)));
        assert_eq!(w.window_end(), 6);
        assert_eq!(w.on_data(5, b(5)), Arrival::InOrder);
    }

    #[test]
    fn bitmap_spans_words() {
        let mut w = ReceiveWindow::new(256);
        for s in [3, 66, 67, 200] {
            w.on_data(s, b(0));
        }
        let ack = w.ack_info(None);
        assert_eq!(ack.selective.len(), 4);
        assert_eq!(
            ack.selective_seqs().collect::<Vec<_>>(),
            vec![3, 66, 67, 200]
        );
    }
}
