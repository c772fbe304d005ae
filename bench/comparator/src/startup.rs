//! The start-up benchmark: how long a launcher takes from launch to exit for a job whose ranks
//! only join, meet in one barrier and leave (`examples/startup.rs` under `rwrun`;
//! `bench/c/startup.c` under `mpiexec.mpich` and `mpirun.openmpi`). Interleaved like the OSU
//! measurements: every round runs each process count under each launcher in turn.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::report::{self, summarize};
use crate::run::{Impl, Plan, run_with_timeout};

/// Process counts measured by default (the table).
pub const DEFAULT_PROCS: [usize; 4] = [2, 8, 32, 64];

const LIMIT: Duration = Duration::from_secs(300);

fn command(root: &Path, bins: &Path, imp: Impl, n: usize) -> Command {
    let n = n.to_string();
    match imp {
        Impl::Rankweave => {
            let mut c = Command::new(bins.join("rwrun"));
            c.args(["-n", &n, "--"]).arg(bins.join("examples/startup"));
            c
        }
        Impl::Mpich => {
            let mut c = Command::new("mpiexec.mpich");
            c.args(["-n", &n])
                .arg(root.join("target/bench-c/mpich/startup"));
            c
        }
        Impl::OpenMpi => {
            let mut c = Command::new("mpirun.openmpi");
            c.args(["--allow-run-as-root", "--oversubscribe", "-n", &n])
                .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
                .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
                .arg(root.join("target/bench-c/openmpi/startup"));
            c
        }
    }
}

/// One launch: seconds from spawning the launcher to its exit.
fn measure(root: &Path, bins: &Path, imp: Impl, n: usize) -> Result<f64, String> {
    let mut cmd = command(root, bins, imp, n);
    let started = Instant::now();
    let out = run_with_timeout(&mut cmd, LIMIT)?;
    let secs = started.elapsed().as_secs_f64();
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let why = stderr.lines().rev().find(|l| !l.trim().is_empty());
        return Err(format!(
            "exited with {}: {}",
            out.status,
            why.unwrap_or("").trim()
        ));
    }
    Ok(secs)
}

/// Runs the start-up plan and writes `startup.md` and `startup.csv` into `plan.out`.
pub fn execute(plan: &Plan, procs: &[usize]) -> Result<(), String> {
    let mut samples: BTreeMap<(usize, Impl), Vec<f64>> = BTreeMap::new();
    let mut gaps: BTreeMap<(usize, Impl), String> = BTreeMap::new();
    for round in 1..=plan.rounds {
        eprintln!("start-up round {round} of {}", plan.rounds);
        for &n in procs {
            for &imp in &plan.impls {
                if gaps.contains_key(&(n, imp)) {
                    continue;
                }
                match measure(&plan.root, &plan.bins, imp, n) {
                    Ok(s) => {
                        eprintln!("  {:<9} -n {n:<3} {s:.3} s", imp.name());
                        samples.entry((n, imp)).or_default().push(s);
                    }
                    Err(why) => {
                        eprintln!("  {:<9} -n {n:<3} skipped: {why}", imp.name());
                        gaps.insert((n, imp), why);
                    }
                }
            }
        }
    }
    let md = markdown(plan, procs, &samples, &gaps);
    crate::report::write_table(plan, "startup", &md, &csv(&samples))?;
    Ok(())
}

fn markdown(
    plan: &Plan,
    procs: &[usize],
    samples: &BTreeMap<(usize, Impl), Vec<f64>>,
    gaps: &BTreeMap<(usize, Impl), String>,
) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "### Start-up: launch to exit (seconds)\n");
    let _ = writeln!(
        md,
        "Each job joins, runs one barrier and finalizes. Median of {} interleaved rounds \
         (min–max); ratio = rankweave / the faster MPI (below 1 is faster). {}\n",
        plan.rounds,
        report::provenance()
    );
    let mut header = String::from("| processes |");
    let mut rule = String::from("|---:|");
    for imp in &plan.impls {
        let _ = write!(header, " {} |", imp.name());
        rule.push_str("---:|");
    }
    header.push_str(" ratio |");
    rule.push_str("---:|");
    let _ = writeln!(md, "{header}\n{rule}");
    for &n in procs {
        let mut row = format!("| {n} |");
        let mut medians = BTreeMap::new();
        for &imp in &plan.impls {
            match samples.get(&(n, imp)).and_then(|v| summarize(v)) {
                Some(s) => {
                    medians.insert(imp, s.median);
                    let _ = write!(row, " {:.3} ({:.3}–{:.3}) |", s.median, s.min, s.max);
                }
                None => {
                    let why = gaps.get(&(n, imp)).map_or("no data", String::as_str);
                    let _ = write!(row, " — ({why}) |");
                }
            }
        }
        let best_mpi = medians
            .iter()
            .filter(|(imp, _)| **imp != Impl::Rankweave)
            .map(|(_, m)| *m)
            .reduce(f64::min);
        match (medians.get(&Impl::Rankweave), best_mpi) {
            (Some(rw), Some(best)) if best > 0.0 => {
                let _ = write!(row, " {:.2}× |", rw / best);
            }
            _ => row.push_str(" — |"),
        }
        let _ = writeln!(md, "{row}");
    }
    md
}

fn csv(samples: &BTreeMap<(usize, Impl), Vec<f64>>) -> String {
    let mut out = String::from("processes,implementation,round,seconds\n");
    for ((n, imp), v) in samples {
        for (i, s) in v.iter().enumerate() {
            let _ = writeln!(out, "{n},{},{},{s:.6}", imp.name(), i + 1);
        }
    }
    out
}
