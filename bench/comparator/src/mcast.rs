//! The multicast broadcast benchmark (`compare --mcast`): broadcast latency and per-rank
//! completion skew at 8 B and 64 KiB for 2, 4, 8 and 16 ranks, of rankweave's two multicast
//! broadcasts and its binomial tree against MPICH and Open MPI, interleaved in one run.
//!
//! Every measurement is one launch of `rw-bench bcast --skew` (under `rwrun`, with
//! `RANKWEAVE_BCAST` choosing the algorithm and `RANKWEAVE_MCAST_MIN_RANKS=2`, so 2 ranks use
//! multicast too) or of its C twin `rw_bcast_skew` (under `mpiexec.mpich` or
//! `mpirun.openmpi`), for one size. Each round runs every rank count × size × implementation
//! once, in that order, so the VM's drift hits all of them alike; the report gives medians over
//! the rounds. No process is pinned: from 4 ranks on, a 2-core machine is oversubscribed.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::report::{self, summarize};
use crate::run::{Plan, run_with_timeout};

/// Rank counts measured by default (the issue's table).
pub const DEFAULT_RANKS: [usize; 4] = [2, 4, 8, 16];
/// Rank counts of `--quick` (the CI smoke run).
pub const QUICK_RANKS: [usize; 2] = [2, 4];
/// Broadcast sizes (bytes): a small message and one 64 KiB message.
pub const SIZES: [u64; 2] = [8, 64 << 10];

/// Timed iterations and warm-up of every launch (both sizes alike): fewer than OSU's 1000 /
/// 100, because MPICH's busy-polling ranks take milliseconds per broadcast once oversubscribed.
const ITERATIONS: (&str, &str) = ("100", "10");
/// The same for `--quick`.
const QUICK_ITERATIONS: (&str, &str) = ("10", "2");

const LIMIT: Duration = Duration::from_secs(300);

/// One implementation of the broadcast.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Variant {
    /// rankweave, `RANKWEAVE_BCAST=multicast` (two-stage: Hoefler, Siebert and Rehm).
    Multicast,
    /// rankweave, `RANKWEAVE_BCAST=channels` (LA-MPI's channel broadcast).
    Channels,
    /// rankweave, `RANKWEAVE_BCAST=binomial` (point-to-point tree).
    Binomial,
    /// `rw_bcast_skew` built with MPICH.
    Mpich,
    /// `rw_bcast_skew` built with Open MPI.
    OpenMpi,
}

impl Variant {
    /// Every variant, in report and run order.
    pub const ALL: [Variant; 5] = [
        Variant::Multicast,
        Variant::Channels,
        Variant::Binomial,
        Variant::Mpich,
        Variant::OpenMpi,
    ];

    /// The name in tables and the CSV.
    pub fn name(self) -> &'static str {
        match self {
            Variant::Multicast => "rankweave multicast",
            Variant::Channels => "rankweave channels",
            Variant::Binomial => "rankweave binomial",
            Variant::Mpich => "MPICH",
            Variant::OpenMpi => "Open MPI",
        }
    }

    /// `RANKWEAVE_BCAST` of a rankweave variant; `None` for the MPIs.
    pub fn bcast_env(self) -> Option<&'static str> {
        match self {
            Variant::Multicast => Some("multicast"),
            Variant::Channels => Some("channels"),
            Variant::Binomial => Some("binomial"),
            Variant::Mpich | Variant::OpenMpi => None,
        }
    }
}

/// One launch's figures (µs): OSU's average latency, the median completion skew over the
/// non-root ranks and the median time from the root's t0 to the last rank's completion.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Figures {
    pub latency: f64,
    pub skew: f64,
    pub last: f64,
}

/// Reads the row of `size` from `rw-bench bcast --skew` / `rw_bcast_skew` output: `#` lines are
/// comments, a row is the size and the three figures.
pub fn parse(output: &str, size: u64) -> Option<Figures> {
    output
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .find_map(|l| {
            let cols: Vec<f64> = l
                .split_whitespace()
                .map(|c| c.parse::<f64>())
                .collect::<Result<_, _>>()
                .ok()?;
            match cols[..] {
                [s, latency, skew, last] if s as u64 == size => Some(Figures {
                    latency,
                    skew,
                    last,
                }),
                _ => None,
            }
        })
}

/// The command line of one launch.
pub fn command(
    root: &Path,
    bins: &Path,
    v: Variant,
    ranks: usize,
    size: u64,
    quick: bool,
) -> Command {
    let n = ranks.to_string();
    let (iters, warmup) = if quick { QUICK_ITERATIONS } else { ITERATIONS };
    // MIN:MAX: OSU's `-m N` alone means 1..N.
    let m = format!("{size}:{size}");
    let flags = ["-m", &m, "-i", iters, "-x", warmup];
    let mut c = match v {
        Variant::Multicast | Variant::Channels | Variant::Binomial => {
            // rwrun decides RANKWEAVE_SPIN_YIELD at start-up: on when the ranks outnumber the
            // cores, so a waiting rank yields its core to the one it waits for.
            let mut c = Command::new(bins.join("rwrun"));
            c.args(["-n", &n, "--no-tag-output", "--"])
                .arg(bins.join("rw-bench"))
                .args(["bcast", "--skew"]);
            c.env("RANKWEAVE_BCAST", v.bcast_env().unwrap_or("binomial"))
                .env("RANKWEAVE_MCAST_MIN_RANKS", "2");
            c
        }
        Variant::Mpich => {
            let mut c = Command::new("mpiexec.mpich");
            c.args(["-n", &n])
                .arg(root.join("target/bench-c/mpich/rw_bcast_skew"));
            c
        }
        Variant::OpenMpi => {
            let mut c = Command::new("mpirun.openmpi");
            // --oversubscribe also makes Open MPI's waiting ranks yield (mpi_yield_when_idle).
            c.args([
                "--allow-run-as-root",
                "--oversubscribe",
                "--bind-to",
                "none",
                "--mca",
                "btl",
                "self,vader",
                "-n",
                &n,
            ])
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .arg(root.join("target/bench-c/openmpi/rw_bcast_skew"));
            c
        }
    };
    c.args(flags);
    c
}

/// The multicast counter line rw-bench prints, if any (kept for the report's notes).
fn counters(output: &str) -> Option<String> {
    output
        .lines()
        .find(|l| l.starts_with("# multicast counters"))
        .map(|l| l.trim_start_matches("# ").to_string())
}

fn measure(
    plan: &Plan,
    v: Variant,
    ranks: usize,
    size: u64,
) -> Result<(Figures, Option<String>), String> {
    let mut cmd = command(&plan.root, &plan.bins, v, ranks, size, plan.quick);
    let started = Instant::now();
    let out = run_with_timeout(&mut cmd, LIMIT)?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let why = stderr.lines().rev().find(|l| !l.trim().is_empty());
        return Err(format!(
            "exited with {}: {}",
            out.status,
            why.unwrap_or("").trim()
        ));
    }
    let f = parse(&stdout, size).ok_or("printed no data row")?;
    eprintln!(
        "  {:<19} -n {ranks:<2} {:>6} B  latency {:>10.2}  skew {:>10.2}  last {:>10.2} us  ({:.1?})",
        v.name(),
        size,
        f.latency,
        f.skew,
        f.last,
        started.elapsed()
    );
    Ok((f, counters(&stdout)))
}

/// (ranks, size, variant) → every round's figures.
pub type Samples = BTreeMap<(usize, u64, Variant), Vec<Figures>>;

/// Runs the plan for `ranks` and writes `mcast.md` and `mcast.csv` into `plan.out` (with
/// `--book`, `book/src/performance/mcast.md` too).
pub fn execute(plan: &Plan, ranks: &[usize]) -> Result<(), String> {
    let mut samples = Samples::new();
    let mut gaps: BTreeMap<(usize, u64, Variant), String> = BTreeMap::new();
    let mut notes: BTreeMap<(usize, u64, Variant), String> = BTreeMap::new();
    let started = Instant::now();
    for round in 1..=plan.rounds {
        eprintln!("multicast broadcast round {round} of {}", plan.rounds);
        for &n in ranks {
            for size in SIZES {
                for v in Variant::ALL {
                    let key = (n, size, v);
                    if gaps.contains_key(&key) {
                        continue;
                    }
                    match measure(plan, v, n, size) {
                        Ok((f, note)) => {
                            samples.entry(key).or_default().push(f);
                            if let Some(note) = note {
                                notes.insert(key, note);
                            }
                        }
                        Err(why) => {
                            eprintln!("  {:<19} -n {n:<2} {size:>6} B  skipped: {why}", v.name());
                            gaps.insert(key, why);
                        }
                    }
                }
            }
        }
    }
    let md = markdown(plan, ranks, &samples, &gaps, &notes, started.elapsed());
    crate::report::write_table(plan, "mcast", &md, &csv(&samples))?;
    if gaps.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{} measurements failed (see the report)",
            gaps.len()
        ))
    }
}

/// `a / b` formatted as a ratio, or "–" when `b` is not positive (the skew of 2 ranks is 0).
pub fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
        _ => "–".into(),
    }
}

fn size_label(size: u64) -> String {
    if size >= 1024 {
        format!("{} KiB", size >> 10)
    } else {
        format!("{size} B")
    }
}

fn markdown(
    plan: &Plan,
    ranks: &[usize],
    samples: &Samples,
    gaps: &BTreeMap<(usize, u64, Variant), String>,
    notes: &BTreeMap<(usize, u64, Variant), String>,
    elapsed: Duration,
) -> String {
    let (iters, warmup) = if plan.quick {
        QUICK_ITERATIONS
    } else {
        ITERATIONS
    };
    let mut md = String::new();
    let _ = writeln!(
        md,
        "<!-- generated by bench/compare --mcast; do not edit by hand -->"
    );
    let _ = writeln!(
        md,
        "Broadcast from rank 0, `rw-bench bcast --skew` and `rw_bcast_skew` ({iters} iterations \
         after {warmup} warm-up per launch, each preceded by a barrier). Median of {} \
         interleaved rounds, (min–max) over the rounds; took {:.0?}. {}\n",
        plan.rounds,
        elapsed,
        report::provenance()
    );
    let _ = writeln!(
        md,
        "*latency*: OSU's average over the ranks of each rank's mean broadcast call time. \
         *skew*: per iteration the latest minus the earliest completion instant over the \
         non-root ranks (`CLOCK_MONOTONIC`, one clock for every process of the host), median \
         over the iterations (0 by definition on 2 ranks). *last*: the last non-root \
         completion minus the root's start, median. Ratios: rankweave's median ÷ the MPI's \
         (below 1.00 is better for rankweave).\n"
    );
    let _ = writeln!(
        md,
        "| ranks | size | implementation | latency (µs) | skew (µs) | last (µs) | latency ÷ MPICH | latency ÷ Open MPI | skew ÷ MPICH | skew ÷ Open MPI |"
    );
    let _ = writeln!(md, "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|");
    for &n in ranks {
        for size in SIZES {
            let get = |v: Variant| samples.get(&(n, size, v));
            let med = |v: Variant, f: fn(&Figures) -> f64| {
                get(v)
                    .and_then(|s| summarize(&s.iter().map(f).collect::<Vec<_>>()))
                    .map(|s| s.median)
            };
            let lat = |v| med(v, |f| f.latency);
            let skew = |v| med(v, |f| f.skew);
            for v in Variant::ALL {
                let cell = |f: fn(&Figures) -> f64| {
                    get(v)
                        .and_then(|s| summarize(&s.iter().map(f).collect::<Vec<_>>()))
                        .map_or_else(
                            || {
                                gaps.get(&(n, size, v))
                                    .map_or("–".into(), |_| "failed".into())
                            },
                            |s| format!("{:.2} ({:.2}–{:.2})", s.median, s.min, s.max),
                        )
                };
                let last = med(v, |f| f.last).map_or("–".into(), |m| format!("{m:.2}"));
                let ratios = if v.bcast_env().is_some() {
                    format!(
                        "{} | {} | {} | {}",
                        ratio(lat(v), lat(Variant::Mpich)),
                        ratio(lat(v), lat(Variant::OpenMpi)),
                        ratio(skew(v), skew(Variant::Mpich)),
                        ratio(skew(v), skew(Variant::OpenMpi))
                    )
                } else {
                    "| | |".into()
                };
                let _ = writeln!(
                    md,
                    "| {n} | {} | {} | {} | {} | {last} | {ratios} |",
                    size_label(size),
                    v.name(),
                    cell(|f| f.latency),
                    cell(|f| f.skew),
                );
            }
        }
    }
    if !notes.is_empty() {
        let _ = writeln!(md, "\nrankweave's multicast counters in the last round:\n");
        for ((n, size, v), note) in notes {
            let _ = writeln!(
                md,
                "- {n} ranks, {}, {}: {note}",
                size_label(*size),
                v.name()
            );
        }
    }
    if !gaps.is_empty() {
        let _ = writeln!(md, "\nNot measured:\n");
        for ((n, size, v), why) in gaps {
            let _ = writeln!(
                md,
                "- {n} ranks, {}, {}: {why}",
                size_label(*size),
                v.name()
            );
        }
    }
    md
}

fn csv(samples: &Samples) -> String {
    let mut s = String::from("ranks,size,implementation,round,latency_us,skew_us,last_us\n");
    for ((n, size, v), rounds) in samples {
        for (i, f) in rounds.iter().enumerate() {
            let _ = writeln!(
                s,
                "{n},{size},{},{},{},{},{}",
                v.name(),
                i + 1,
                f.latency,
                f.skew,
                f.last
            );
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_skew_row_of_either_side() {
        let rw = "# rw-bench bcast (...): 4 ranks\n# Size         Avg Latency(us)            Skew(us)            Last(us)\n8                        88.67               92.11              144.27\n# multicast counters (sum over 4 ranks, warm-up included): 110 fragments multicast\n";
        assert_eq!(
            parse(rw, 8),
            Some(Figures {
                latency: 88.67,
                skew: 92.11,
                last: 144.27
            })
        );
        assert_eq!(parse(rw, 65536), None);
        assert_eq!(
            counters(rw).as_deref(),
            Some(
                "multicast counters (sum over 4 ranks, warm-up included): 110 fragments multicast"
            )
        );
        let c = "# rankweave C baseline: rw_bcast_skew (MPICH 4.0.2)\n# Size  Avg Latency(us)  Skew(us)  Last(us)\n65536  9345.08  7926.71  16057.67\n";
        assert_eq!(parse(c, 65536).map(|f| f.skew), Some(7926.71));
        // An OSU row without the skew columns is not a skew row.
        assert_eq!(parse("8   1.23\n", 8), None);
    }

    #[test]
    fn commands_select_the_algorithm_and_the_size() {
        let root = Path::new("/r");
        let bins = Path::new("/r/target/release");
        let c = command(root, bins, Variant::Channels, 16, 65536, false);
        assert_eq!(c.get_program(), "/r/target/release/rwrun");
        let args: Vec<_> = c
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            args,
            [
                "-n",
                "16",
                "--no-tag-output",
                "--",
                "/r/target/release/rw-bench",
                "bcast",
                "--skew",
                "-m",
                "65536:65536",
                "-i",
                "100",
                "-x",
                "10"
            ]
        );
        let env: Vec<_> = c
            .get_envs()
            .map(|(k, v)| {
                (
                    k.to_string_lossy().into_owned(),
                    v.map(|v| v.to_string_lossy().into_owned()),
                )
            })
            .collect();
        assert!(env.contains(&("RANKWEAVE_BCAST".into(), Some("channels".into()))));
        assert!(env.contains(&("RANKWEAVE_MCAST_MIN_RANKS".into(), Some("2".into()))));
        let c = command(root, bins, Variant::OpenMpi, 4, 8, true);
        let args: Vec<_> = c
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert!(args.contains(&"--oversubscribe".to_string()));
        assert!(args.ends_with(&[
            "/r/target/bench-c/openmpi/rw_bcast_skew".to_string(),
            "-m".into(),
            "8:8".into(),
            "-i".into(),
            "10".into(),
            "-x".into(),
            "2".into()
        ]));
    }

    #[test]
    fn ratios_skip_a_zero_skew() {
        assert_eq!(ratio(Some(1.0), Some(4.0)), "0.25");
        assert_eq!(ratio(Some(0.0), Some(0.0)), "–");
        assert_eq!(ratio(None, Some(1.0)), "–");
        assert_eq!(size_label(65536), "64 KiB");
        assert_eq!(size_label(8), "8 B");
    }
}
