//! How far the receiver's cache is from the sender's, and so whether the ring's hot window pays.
//!
//! The two vCPUs of a VM like this one sit either close together (a cache line crosses between
//! them in some 10–20 ns: they share a core's caches) or far apart (60–150 ns), and move
//! between the two while the job runs. The hot window (see the ring's module docs) helps a
//! close pair — the few KiB it cycles through stay in the cache both ends share — and costs a
//! far one: a line reused within a few records is still in the reader's cache, and taking it
//! back costs the writer a trip across. So the sender times a load of the consumer's `tail`
//! line every [`LOOK_EVERY`] records (the consumer stores it whenever it releases space, so
//! the load fetches it from the consumer's cache), less what reading the clock twice costs
//! by itself (the least of a few tries, once per process), and keeps early wraps on while the
//! median of the last [`SAMPLES`] looks is below [`NEAR_NS`].

use std::sync::OnceLock;
use std::time::Instant;

/// Timed looks per verdict.
const SAMPLES: usize = 8;
/// A look that takes less than this, the clock's own cost taken off, finds the consumer's
/// cache near. Here a cache line crosses in 20–30 ns near and 60–250 ns far (the placement
/// probe of `bench/compare`, one-way), and far looks took 60–100 ns net.
const NEAR_NS: u32 = 40;
/// Records sent between timed looks.
const LOOK_EVERY: u32 = 64;

/// The verdict, from the sender's timed looks at the consumer's `tail` line.
#[derive(Debug)]
pub(crate) struct CacheDistance {
    samples: [u32; SAMPLES],
    taken: usize,
    near: bool,
    records: u32,
}

impl Default for CacheDistance {
    /// Near until timed otherwise.
    fn default() -> Self {
        CacheDistance {
            samples: [0; SAMPLES],
            taken: 0,
            near: true,
            records: 0,
        }
    }
}

impl CacheDistance {
    /// Whether the consumer's cache was near at the last verdict.
    pub(crate) fn is_near(&self) -> bool {
        self.near
    }

    /// Counts a record sent; whether the next look at the consumer's `tail` is to be timed.
    #[inline]
    pub(crate) fn look_due(&mut self) -> bool {
        self.records += 1;
        if self.records < LOOK_EVERY {
            return false;
        }
        self.records = 0;
        true
    }

    /// Runs `look` (a load of the consumer's `tail`), timed, and counts its time.
    pub(crate) fn time<T>(&mut self, look: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let seen = look();
        let ns = start.elapsed().as_nanos().saturating_sub(clock_cost());
        self.record(u32::try_from(ns).unwrap_or(u32::MAX));
        seen
    }

    /// Counts one look of `ns` nanoseconds; every [`SAMPLES`] looks, a new verdict.
    pub(crate) fn record(&mut self, ns: u32) {
        self.samples[self.taken % SAMPLES] = ns;
        self.taken += 1;
        if self.taken % SAMPLES == 0 {
            let mut sorted = self.samples;
            sorted.sort_unstable();
            self.near = sorted[SAMPLES / 2] < NEAR_NS;
        }
    }
}

/// Nanoseconds two reads of the clock take with nothing between them: the least of a few
/// tries, measured once per process.
fn clock_cost() -> u128 {
    static COST: OnceLock<u128> = OnceLock::new();
    *COST.get_or_init(|| {
        (0..32)
            .map(|_| {
                let start = Instant::now();
                start.elapsed().as_nanos()
            })
            .min()
            .unwrap_or(0)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_verdict_follows_the_median_of_each_batch_of_looks() {
        let mut d = CacheDistance::default();
        assert!(d.is_near(), "near until timed");
        // A far batch with a few quick looks (a line still in this cache): far.
        for ns in [120, 10, 140, 60, 15, 150, 100, 130] {
            assert!(d.is_near(), "no verdict before the batch is full");
            d.record(ns);
        }
        assert!(!d.is_near());
        // A near batch with a few slow looks (an idle consumer's line gone to memory): near.
        for ns in [20, 25, 300, 18, 21, 500, 22, 19] {
            assert!(!d.is_near());
            d.record(ns);
        }
        assert!(d.is_near());
        // A look is due once every LOOK_EVERY records.
        let due = (0..3 * LOOK_EVERY).filter(|_| d.look_due()).count();
        assert_eq!(due, 3);
        // `time` counts what it timed.
        for _ in 0..SAMPLES {
            assert_eq!(d.time(|| 7), 7);
        }
        assert_eq!(d.taken, 3 * SAMPLES);
    }
}
