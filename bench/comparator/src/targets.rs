//! The cells the project's performance targets name (the shared-memory and collectives
//! issues' acceptance lists), each with its result in this run and whether it meets the
//! target: the table a reader checks first.

use std::fmt::Write as _;

use crate::report::{ratios, size_label, summarize};
use crate::run::{Config, Impl, Samples};

/// What a cell must reach.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Goal {
    /// rankweave's time at most this multiple of the better MPI's.
    TimeRatioAtMost(f64),
    /// rankweave's bandwidth at least this multiple of the better MPI's.
    RateRatioAtLeast(f64),
    /// rankweave's median time under this many microseconds, whatever the MPIs do.
    MicrosBelow(f64),
}

/// One target: a benchmark at one size (0 for the barriers) in one configuration.
#[derive(Clone, Copy, Debug)]
pub struct Target {
    pub issue: &'static str,
    pub config: Config,
    pub bench: &'static str,
    pub size: u64,
    pub goal: Goal,
}

const fn t(
    issue: &'static str,
    config: Config,
    bench: &'static str,
    size: u64,
    goal: Goal,
) -> Target {
    Target {
        issue,
        config,
        bench,
        size,
        goal,
    }
}

const KIB: u64 = 1024;
const MIB: u64 = 1024 * 1024;
const SHM: &str = "shared memory";
const COLL: &str = "collectives";
const FASTER: Goal = Goal::TimeRatioAtMost(1.0);

/// The shared-memory issue's targets.
const SHM_TARGETS: &[Target] = &[
    t(SHM, Config::Shm, "latency", 1, FASTER),
    t(SHM, Config::Shm, "latency", KIB, FASTER),
    t(SHM, Config::Shm, "latency", 64 * KIB, FASTER),
    t(SHM, Config::Shm, "latency", MIB, FASTER),
    t(
        SHM,
        Config::Shm,
        "bw",
        64 * KIB,
        Goal::RateRatioAtLeast(1.0),
    ),
    t(SHM, Config::Shm, "bw", MIB, Goal::RateRatioAtLeast(1.0)),
    t(SHM, Config::Shm, "bw", 4 * MIB, Goal::RateRatioAtLeast(1.0)),
    t(
        SHM,
        Config::Oversubscribed,
        "ring",
        8,
        Goal::MicrosBelow(50.0),
    ),
    t(
        SHM,
        Config::Oversubscribed,
        "p2pbarrier",
        0,
        Goal::MicrosBelow(50.0),
    ),
];

/// The collectives issue's cells, the same on 2 ranks and on 4 ranks on 2 cores.
const COLLECTIVE_CELLS: &[(&str, u64)] = &[
    ("bcast", 8),
    ("bcast", 64 * KIB),
    ("bcast", MIB),
    ("allreduce", 8),
    ("allreduce", 64 * KIB),
    ("allreduce", MIB),
    ("barrier", 0),
];

/// The targets, in the issues' order.
pub fn targets() -> Vec<Target> {
    let collectives = [Config::Shm, Config::Oversubscribed]
        .into_iter()
        .flat_map(|config| {
            COLLECTIVE_CELLS
                .iter()
                .map(move |&(bench, size)| t(COLL, config, bench, size, FASTER))
        });
    SHM_TARGETS.iter().copied().chain(collectives).collect()
}

/// What this run says about `target`: (rankweave's median, the figure the goal is about,
/// met), or `None` if the run has no numbers for it.
pub fn assess(samples: &Samples, target: &Target) -> Option<(f64, f64, bool)> {
    let ours = samples
        .get(&(target.config, target.bench.to_string(), Impl::Rankweave))?
        .get(&target.size)
        .and_then(|v| summarize(v))?
        .median;
    let ratio = || {
        ratios(samples, target.config, target.bench)?
            .get(&target.size)
            .copied()
    };
    Some(match target.goal {
        Goal::TimeRatioAtMost(max) => ratio().map(|r| (ours, r, r <= max))?,
        Goal::RateRatioAtLeast(min) => ratio().map(|r| (ours, r, r >= min))?,
        Goal::MicrosBelow(max) => (ours, ours, ours < max),
    })
}

/// The Markdown table of every target this run measured.
pub fn table(samples: &Samples) -> String {
    let mut s = String::new();
    let mut rows = 0;
    let mut met = 0;
    for target in &targets() {
        let Some((ours, figure, ok)) = assess(samples, target) else {
            continue;
        };
        let (what, goal) = match target.goal {
            Goal::TimeRatioAtMost(max) => (format!("{figure:.2}×"), format!("≤ {max:.2}×")),
            Goal::RateRatioAtLeast(min) => (format!("{figure:.2}×"), format!("≥ {min:.2}×")),
            Goal::MicrosBelow(max) => (format!("{figure:.2} µs"), format!("< {max:.0} µs")),
        };
        let size = if target.size == 0 {
            "–".to_string()
        } else {
            size_label(target.size)
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {:.2} | {} | {} | {} |",
            target.issue,
            target.config.name(),
            target.bench,
            size,
            ours,
            what,
            goal,
            if ok { "yes" } else { "**no**" }
        );
        rows += 1;
        met += usize::from(ok);
    }
    if rows == 0 {
        return String::new();
    }
    format!(
        "{met} of {rows} targets met in this run.\n\n\
         | issue | config | benchmark | size | rankweave | result | target | met |\n\
         |---|---|---|---|---|---|---|---|\n{s}"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples(cells: &[(Config, &str, Impl, u64, &[f64])]) -> Samples {
        let mut s = Samples::new();
        for &(config, bench, imp, size, v) in cells {
            s.entry((config, bench.to_string(), imp))
                .or_default()
                .insert(size, v.to_vec());
        }
        s
    }

    #[test]
    fn targets_are_judged_by_their_goal() {
        let s = samples(&[
            (
                Config::Shm,
                "latency",
                Impl::Rankweave,
                1,
                &[0.30, 0.20, 0.25],
            ),
            (
                Config::Shm,
                "latency",
                Impl::OpenMpi,
                1,
                &[0.25, 0.25, 0.25],
            ),
            (Config::Shm, "latency", Impl::Mpich, 1, &[0.50, 0.50, 0.50]),
            (Config::Shm, "bw", Impl::Rankweave, MIB, &[9.0, 9.0, 9.0]),
            (Config::Shm, "bw", Impl::OpenMpi, MIB, &[10.0, 10.0, 10.0]),
            (
                Config::Oversubscribed,
                "ring",
                Impl::Rankweave,
                8,
                &[40.0, 60.0, 45.0],
            ),
        ]);
        let all = targets();
        let find = |bench: &str| all.iter().find(|t| t.bench == bench).unwrap();
        // Round ratios 1.2, 0.8, 1.0 against Open MPI (the faster): median 1.0, met.
        let (ours, r, ok) = assess(&s, find("latency")).unwrap();
        assert_eq!((ours, ok), (0.25, true));
        assert!((r - 1.0).abs() < 1e-9);
        // 64 KiB was not measured: no verdict.
        assert!(assess(&s, &all[2]).is_none());
        let bw = all
            .iter()
            .find(|t| t.bench == "bw" && t.size == MIB)
            .unwrap();
        let (_, r, ok) = assess(&s, bw).unwrap();
        assert!(!ok && (r - 0.9).abs() < 1e-9);
        // An absolute target looks at rankweave's median alone.
        assert_eq!(assess(&s, find("ring")).unwrap(), (45.0, 45.0, true));
        let table = table(&s);
        assert!(table.starts_with("2 of 3 targets met"), "{table}");
        assert!(
            table
                .contains("| shared memory | shm | bw | 1 MiB | 9.00 | 0.90× | ≥ 1.00× | **no** |")
        );
    }
}
