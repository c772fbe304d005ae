//! What the verbs tests share: reproducible payloads, eager frames, random numbers and a
//! simulated lossy datagram network.

use bytes::Bytes;
use rankweave_core::frame::Frame;

/// `len` pseudo-random bytes from `seed` (xorshift): every seed gives other bytes, so a
/// payload delivered to the wrong place or damaged shows.
pub(crate) fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// An eager frame of context 1, tag 7, with sequence number `seq` and `payload`.
pub(crate) fn frame(seq: u64, payload: impl Into<Bytes>) -> Frame {
    crate::test_frames::eager_frame(1, 7, seq, payload)
}

/// A reproducible xorshift random number generator; the state must not be zero.
pub(crate) struct XorShift(pub(crate) u64);

impl XorShift {
    /// The generator of `seed`.
    pub(crate) fn new(seed: u64) -> XorShift {
        XorShift(seed | 1)
    }

    /// The next number.
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// A simulated lossy, duplicating, reordering datagram network between ranks: the messages
/// in flight, each as (to, from, message).
pub(crate) struct LossyWire<M> {
    in_flight: Vec<(u32, u32, M)>,
    /// Its random numbers (reordering, duplication, and loss where the caller wants).
    pub(crate) rng: XorShift,
}

impl<M: Copy> LossyWire<M> {
    /// An empty network whose random numbers come from `seed`.
    pub(crate) fn new(seed: u64) -> LossyWire<M> {
        LossyWire {
            in_flight: Vec::new(),
            rng: XorShift::new(seed),
        }
    }

    /// Sends `m` from `from` to `to`.
    pub(crate) fn send(&mut self, to: u32, from: u32, m: M) {
        self.in_flight.push((to, from, m));
    }

    /// Whether nothing is in flight.
    pub(crate) fn is_empty(&self) -> bool {
        self.in_flight.is_empty()
    }

    /// Loses everything in flight.
    pub(crate) fn clear(&mut self) {
        self.in_flight.clear();
    }

    /// Takes everything in flight and returns what arrives: in random order when `shuffle`,
    /// without those `drop` (given the network's random numbers) decides are lost, and each
    /// survivor twice with `dup` percent.
    pub(crate) fn arrivals(
        &mut self,
        mut drop: impl FnMut(&M, &mut XorShift) -> bool,
        dup: u64,
        shuffle: bool,
    ) -> Vec<(u32, u32, M)> {
        let mut batch = std::mem::take(&mut self.in_flight);
        if shuffle {
            for i in (1..batch.len()).rev() {
                let j = (self.rng.next() % (i as u64 + 1)) as usize;
                batch.swap(i, j);
            }
        }
        let mut arrived = Vec::new();
        for (to, from, m) in batch {
            if drop(&m, &mut self.rng) {
                continue;
            }
            let copies = if self.rng.next() % 100 < dup { 2 } else { 1 };
            for _ in 0..copies {
                arrived.push((to, from, m));
            }
        }
        arrived
    }
}
