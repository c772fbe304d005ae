//! The placement probe: how far apart the two vCPUs are right now.
//!
//! On this kind of VM the two vCPUs move between a near placement (a cache line crosses between
//! them in a few dozen nanoseconds) and a far one (several times that), and every benchmark's
//! absolute times move with them — small messages most. Before each benchmark's runs of a round
//! the comparator measures the one-way time of a cache line handed between two threads pinned
//! to CPUs 0 and 1 (a ping-pong on one atomic word), so a report can say which placement each
//! round of each measurement saw.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// Round trips of one probe (a few milliseconds in either placement).
const ROUND_TRIPS: u64 = 20_000;

/// A word alone on its cache line.
#[repr(align(128))]
struct Line(AtomicU64);

/// What the two sides share: the word they hand back and forth, and a flag for a side that
/// could not be pinned (apart, so that a ping cannot overwrite it).
struct Court {
    ball: Line,
    gave_up: AtomicBool,
}

/// One-way hand-off time in nanoseconds (half the mean round trip), or `None` where two threads
/// cannot be pinned to CPUs 0 and 1. Both sides run in threads of their own, so the caller's
/// CPU affinity (which the benchmarks' launchers inherit) is left alone.
pub fn probe() -> Option<f64> {
    probe_between(0, 1)
}

/// [`probe`] between CPUs `first` (the prober) and `second` (the answerer).
fn probe_between(first: usize, second: usize) -> Option<f64> {
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        return None;
    }
    let court = Arc::new(Court {
        ball: Line(AtomicU64::new(0)),
        gave_up: AtomicBool::new(false),
    });
    let other = court.clone();
    // The answerer waits for each odd value and answers with the next even one.
    let answerer = std::thread::spawn(move || {
        if !pin(second) {
            other.gave_up.store(true, Ordering::Release);
            return false;
        }
        (0..ROUND_TRIPS).all(|i| {
            let ping = 2 * i + 1;
            other.wait_for(ping) && {
                other.ball.0.store(ping + 1, Ordering::Release);
                true
            }
        })
    });
    let prober = std::thread::spawn(move || {
        if !pin(first) {
            court.gave_up.store(true, Ordering::Release);
            return None;
        }
        let start = Instant::now();
        let done = (0..ROUND_TRIPS).all(|i| {
            court.ball.0.store(2 * i + 1, Ordering::Release);
            court.wait_for(2 * i + 2)
        });
        done.then(|| start.elapsed())
    });
    let answered = answerer.join().unwrap_or(false);
    let elapsed = prober.join().ok().flatten().filter(|_| answered)?;
    Some(elapsed.as_nanos() as f64 / (2 * ROUND_TRIPS) as f64)
}

impl Court {
    /// Spins until the ball holds `value`; `false` if the other side gave up instead.
    fn wait_for(&self, value: u64) -> bool {
        while self.ball.0.load(Ordering::Acquire) != value {
            if self.gave_up.load(Ordering::Acquire) {
                return false;
            }
            std::hint::spin_loop();
        }
        true
    }
}

/// Pins the calling thread to `cpu`; whether it could.
fn pin(cpu: usize) -> bool {
    // SAFETY: `set` is a plain bit set on the stack, zeroed (CPU_ZERO) before use, and
    // sched_setaffinity only reads it; pid 0 names the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_ZERO(&mut set);
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_probe_measures_a_time_where_two_cpus_can_be_pinned() {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        // Asked in a thread of its own, so this test's thread keeps its affinity.
        let can_pin = cpus >= 2 && std::thread::spawn(|| pin(0) && pin(1)).join().unwrap();
        match probe() {
            // Far below a millisecond in any placement: it is a cache line's trip.
            Some(ns) => assert!(ns > 0.0 && ns < 1_000_000.0, "{ns} ns"),
            None => assert!(!can_pin, "two CPUs could be pinned, yet no probe"),
        }
    }

    #[test]
    fn a_side_that_cannot_be_pinned_ends_the_probe_without_a_number() {
        // No machine here has these CPUs: whichever side fails, the other stops.
        let absent = libc::CPU_SETSIZE as usize - 1;
        assert_eq!(probe_between(0, absent), None);
        assert_eq!(probe_between(absent, 0), None);
    }
}
