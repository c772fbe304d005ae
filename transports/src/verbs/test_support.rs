//! What the verbs tests share: reproducible payloads and eager frames.

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
