//! A small seeded generator (SplitMix64) for fault injection and simulations: deterministic for a
//! seed, any seed (0 included) works. Not for anything that must be unpredictable. Plus
//! [`random_u64`] for values that must differ between runs and be unpredictable (job keys).

/// SplitMix64 (Steele, Lea and Flood).
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// `true` with probability `p` (never for `p <= 0`, always for `p >= 1`).
    pub fn chance(&mut self, p: f64) -> bool {
        let u = (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64); // in [0, 1)
        u < p
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_bounded() {
        let (mut a, mut b) = (SplitMix64(7), SplitMix64(7));
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
            let (x, y) = (a.below(10), b.below(10));
            assert_eq!(x, y);
            assert!(x < 10);
        }
        assert!(!a.chance(0.0));
        assert!(a.chance(1.0));
        assert_eq!(a.below(0), 0);
    }
}

/// A fresh random 64-bit value from the operating system's cryptographically secure generator
/// (for job keys, from which multicast groups are derived); never 0. Should the generator be
/// unavailable, falls back to the standard library's per-process random hash keys mixed with
/// the time and the process id (unique, not unpredictable).
pub fn random_u64() -> u64 {
    if let Ok(v) = getrandom::u64() {
        return v.max(1);
    }
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(CALLS.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        h.write_u128(t.as_nanos());
    }
    let mut g = SplitMix64(h.finish());
    g.next_u64().max(1)
}

#[cfg(test)]
mod random_tests {
    #[test]
    fn random_values_differ() {
        let a: std::collections::HashSet<u64> = (0..1000).map(|_| super::random_u64()).collect();
        assert_eq!(a.len(), 1000);
        assert!(!a.contains(&0));
    }
}
