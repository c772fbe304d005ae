//! How far the receiver's cache is from the sender's, and so whether the ring's hot window pays.
//!
//! The two vCPUs of a VM like this one sit either close together (a cache line crosses between
//! them in some 10–20 ns: they share a core's caches) or far apart (60–150 ns), and move
//! between the two while the job runs. The hot window (see the ring's module docs) helps a
//! close pair — the few KiB it cycles through stay in the cache both ends share — and costs a
//! far one: a line reused within a few records is still in the reader's cache, and taking it
//! back costs the writer a trip across. So the sender times a load of the consumer's `tail`
//! line every [`LOOK_EVERY`] records (the consumer stores it whenever it releases space, so
//! the load fetches it from the consumer's cache), and keeps early wraps on while the median of
//! the last [`SAMPLES`] looks is below [`NEAR_NS`].

use std::time::Instant;

/// Timed looks per verdict.
const SAMPLES: usize = 8;
/// A look that takes less than this finds the consumer's cache near. It includes the clock's
/// own cost, two reads of about 25 ns here; near looks took about 40 ns, far ones 100 or more.
const NEAR_NS: u32 = 60;
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
        let ns = start.elapsed().as_nanos();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_verdict_follows_the_median_of_each_batch_of_looks() {
        let mut d = CacheDistance::default();
        assert!(d.is_near(), "near until timed");
        // A far batch with a few quick looks (a line still in this cache): far.
        for ns in [120, 30, 140, 110, 35, 150, 100, 130] {
            assert!(d.is_near(), "no verdict before the batch is full");
            d.record(ns);
        }
        assert!(!d.is_near());
        // A near batch with a few slow looks (an idle consumer's line gone to memory): near.
        for ns in [40, 45, 300, 38, 41, 500, 42, 39] {
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
