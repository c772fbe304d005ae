//! [`PathChooser`]: which way a large message to one peer goes, pipelined through the ring or
//! by single copy, learned from how long each took lately.
//!
//! Neither way wins everywhere on the machines this was built on. When the two processes' vCPUs
//! share a cache, the pipelined copy (both sides copy, overlapped, through a ring that stays in
//! that cache) moved 64 KiB to 1 MiB about three times as fast as `process_vm_readv`; when they
//! sit far apart, the same copy crosses the interconnect as dirty lines and took about 1.5 times
//! as long as the single copy, which reads the sender's clean buffer once. A VM's vCPUs move
//! between the two placements while a job runs, so the choice is made per message from
//! measurements (UCX picks a protocol from static performance estimates; these move).
//!
//! The chooser keeps, per size class (a power of two), the last [`KEPT`] times per byte of each
//! path, as the sender sees them: from the send to the first look after the receiver was done
//! with it. Only a send made while nothing else is in flight to the peer is timed (another's
//! time would be in it). Even so a time includes waits that are not the copy's — the receiver
//! busy with its own sends, descheduled, or touching fresh pages — so a path's estimate is the
//! *median* of its recent times, not their average: an average of 4 MiB sends in a
//! bidirectional exchange, a few 30 ms waits among 1 ms copies, chose the wrong path for good.
//! Not their least either: the path taken is timed often and the other only when explored, so
//! the least of the other's rare times is a lucky one kept for long, and at 64 KiB, where the two
//! are close, the choice then flipped back and forth (half the sends the slower way). It takes
//! the faster path, and on every [`EXPLORE_EVERY`]-th timed send of a class the other one, so
//! that an estimate gone stale after a move is refreshed; sends that cannot be timed always
//! take the faster. Pure state: the transport passes the sizes and the times in.

use std::time::Duration;

/// A way for a large payload to reach the peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CopyPath {
    /// In pieces through the ring; both sides copy.
    Pipelined,
    /// The receiver reads the sender's memory with `process_vm_readv`.
    SingleCopy,
}

impl CopyPath {
    fn index(self) -> usize {
        match self {
            CopyPath::Pipelined => 0,
            CopyPath::SingleCopy => 1,
        }
    }

    fn other(self) -> CopyPath {
        match self {
            CopyPath::Pipelined => CopyPath::SingleCopy,
            CopyPath::SingleCopy => CopyPath::Pipelined,
        }
    }
}

/// One timed message of a class in this many goes the way that looks slower.
pub(crate) const EXPLORE_EVERY: u32 = 32;
/// The pipelined copy is taken only when its time is at most this fraction of the single
/// copy's. Its time, as the sender sees it, leaves out what it costs around it: the sender's
/// CPU copying (free for other work with a single copy) and the ring's lines dirtied in both
/// caches. Measured (64 KiB ping-pong, far placement): the pipelined copy's recorded time was
/// 0.84 of the single copy's, its end-to-end latency 1.19 of it.
pub(crate) const PIPELINED_BY: f64 = 0.7;
/// Recent times kept per path and class: a move of the machine shows once half of this many
/// samples were taken after it.
pub(crate) const KEPT: usize = 5;
/// Size classes: 2^15 (32 KiB) and below share the first, 2^30 and above the last.
const FIRST_CLASS: u32 = 15;
const CLASSES: usize = 16;

/// What one size class has learned.
#[derive(Clone, Copy, Debug, Default)]
struct Class {
    /// Recent times of each path ([`CopyPath::index`]).
    recent: [Recent; 2],
    /// Timed messages of this class chosen for so far.
    timed: u32,
}

/// The last [`KEPT`] times per byte (nanoseconds) of one path, oldest overwritten first.
#[derive(Clone, Copy, Debug, Default)]
struct Recent {
    samples: [f64; KEPT],
    taken: usize,
}

impl Recent {
    fn push(&mut self, per_byte: f64) {
        self.samples[self.taken % KEPT] = per_byte;
        self.taken += 1;
    }

    /// The median of the recent times (the lower one of an even count), once there is one.
    fn best(&self) -> Option<f64> {
        let n = self.taken.min(KEPT);
        if n == 0 {
            return None;
        }
        let mut kept = self.samples;
        let kept = &mut kept[..n];
        kept.sort_by(f64::total_cmp);
        Some(kept[(n - 1) / 2])
    }
}

/// The choice between the two paths for one peer (see the [module docs](self)).
#[derive(Clone, Debug, Default)]
pub(crate) struct PathChooser {
    classes: [Class; CLASSES],
}

fn class_of(len: usize) -> usize {
    let log = usize::BITS - len.max(1).leading_zeros() - 1;
    (log.saturating_sub(FIRST_CLASS) as usize).min(CLASSES - 1)
}

impl PathChooser {
    /// The path for a payload of `len` bytes; `timed`: its time will be
    /// [`record`](Self::record)ed.
    pub(crate) fn choose(&mut self, len: usize, timed: bool) -> CopyPath {
        let class = &mut self.classes[class_of(len)];
        if timed {
            class.timed = class.timed.wrapping_add(1);
        }
        let best = match class.recent.map(|r| r.best()) {
            // Each is tried before either is trusted: the pipelined copy first, then the other.
            [None, _] => return CopyPath::Pipelined,
            [_, None] => return CopyPath::SingleCopy,
            [Some(p), Some(s)] if p < s * PIPELINED_BY => CopyPath::Pipelined,
            _ => CopyPath::SingleCopy,
        };
        if timed && class.timed % EXPLORE_EVERY == 0 {
            best.other()
        } else {
            best
        }
    }

    /// A payload of `len` bytes took `took` by `path`.
    pub(crate) fn record(&mut self, path: CopyPath, len: usize, took: Duration) {
        if len == 0 {
            return;
        }
        let sample = took.as_nanos() as f64 / len as f64;
        self.classes[class_of(len)].recent[path.index()].push(sample);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: usize = 1024;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn tries_both_then_takes_the_faster_and_looks_at_the_other_now_and_then() {
        let mut c = PathChooser::default();
        assert_eq!(c.choose(64 * KIB, true), CopyPath::Pipelined);
        c.record(CopyPath::Pipelined, 64 * KIB, us(12));
        assert_eq!(c.choose(64 * KIB, true), CopyPath::SingleCopy);
        c.record(CopyPath::SingleCopy, 64 * KIB, us(8));
        let picks: Vec<CopyPath> = (0..2 * EXPLORE_EVERY)
            .map(|_| c.choose(64 * KIB, true))
            .collect();
        let explored = picks.iter().filter(|&&p| p == CopyPath::Pipelined).count();
        assert_eq!(explored, 2, "{picks:?}");
        // A send that will not be timed never explores: it could teach nothing.
        assert!((0..3 * EXPLORE_EVERY).all(|_| c.choose(64 * KIB, false) == CopyPath::SingleCopy));
    }

    #[test]
    fn a_move_of_the_machine_turns_the_choice_within_a_few_samples() {
        let mut c = PathChooser::default();
        c.record(CopyPath::Pipelined, 1 << 20, us(50));
        c.record(CopyPath::SingleCopy, 1 << 20, us(90));
        assert_eq!(c.choose(1 << 20, false), CopyPath::Pipelined);
        for _ in 0..KEPT - 1 {
            c.record(CopyPath::Pipelined, 1 << 20, us(50));
        }
        // Far apart now: the pipelined copy takes three times as long.
        for _ in 0..KEPT / 2 {
            c.record(CopyPath::Pipelined, 1 << 20, us(150));
        }
        assert_eq!(c.choose(1 << 20, false), CopyPath::Pipelined);
        for _ in 0..1 {
            c.record(CopyPath::Pipelined, 1 << 20, us(150));
        }
        assert_eq!(c.choose(1 << 20, false), CopyPath::SingleCopy);
    }

    #[test]
    fn a_few_long_waits_do_not_turn_the_choice() {
        let mut c = PathChooser::default();
        c.record(CopyPath::Pipelined, 4 << 20, us(2_000));
        c.record(CopyPath::SingleCopy, 4 << 20, us(1_000));
        // The receiver was busy elsewhere for two of the next four single copies.
        for took in [30_000, 1_100, 40_000, 1_050] {
            c.record(CopyPath::SingleCopy, 4 << 20, us(took));
        }
        assert_eq!(c.choose(4 << 20, false), CopyPath::SingleCopy);
    }

    #[test]
    fn one_lucky_time_of_the_path_not_taken_does_not_turn_the_choice() {
        let mut c = PathChooser::default();
        for _ in 0..KEPT {
            c.record(CopyPath::SingleCopy, 64 * KIB, us(7));
            c.record(CopyPath::Pipelined, 64 * KIB, us(9));
        }
        // An explored pipelined send that happened to run fast.
        c.record(CopyPath::Pipelined, 64 * KIB, us(5));
        assert_eq!(c.choose(64 * KIB, false), CopyPath::SingleCopy);
    }

    #[test]
    fn the_pipelined_copy_must_be_clearly_faster_to_be_taken() {
        let mut c = PathChooser::default();
        c.record(CopyPath::Pipelined, 64 * KIB, us(8));
        c.record(CopyPath::SingleCopy, 64 * KIB, us(10));
        assert_eq!(c.choose(64 * KIB, false), CopyPath::SingleCopy);
        c.record(CopyPath::Pipelined, 64 * KIB, us(4));
        c.record(CopyPath::Pipelined, 64 * KIB, us(4));
        assert_eq!(c.choose(64 * KIB, false), CopyPath::Pipelined);
    }

    #[test]
    fn size_classes_learn_apart() {
        let mut c = PathChooser::default();
        c.record(CopyPath::Pipelined, 64 * KIB, us(5));
        c.record(CopyPath::SingleCopy, 64 * KIB, us(10));
        c.record(CopyPath::Pipelined, 4 << 20, us(800));
        c.record(CopyPath::SingleCopy, 4 << 20, us(400));
        assert_eq!(c.choose(64 * KIB, false), CopyPath::Pipelined);
        assert_eq!(c.choose(4 << 20, false), CopyPath::SingleCopy);
        // Sizes within a class share what it learned; the extremes have classes too.
        assert_eq!(class_of(64 * KIB), class_of(127 * KIB));
        assert_eq!(class_of(1), 0);
        assert_eq!(class_of(usize::MAX), CLASSES - 1);
        c.record(CopyPath::Pipelined, 0, us(1)); // ignored, no division by zero
    }
}
