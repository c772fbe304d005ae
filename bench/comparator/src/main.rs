//! Runs rankweave's `rw-bench` and the C baselines under MPICH and Open MPI interleaved
//! (A B C A B C …), then writes medians, min–max, ratios, a CSV and SVG plots.
//!
//! Usually started through `bench/compare`, which installs the MPIs and builds everything
//! first. `compare --help` lists the options.

mod mcast;
mod osu;
mod placement;
mod plot;
mod report;
mod run;
mod startup;
mod targets;

use std::path::PathBuf;
use std::process::ExitCode;

use run::{Config, Impl, Plan};

const HELP: &str = "\
compare: rankweave vs MPICH vs Open MPI, interleaved, medians of several rounds

USAGE: compare [OPTIONS]

OPTIONS:
  --rounds N         repetitions of every measurement (default 3)
  --bench LIST       comma-separated benchmarks (default: latency,bw,bibw,mr,barrier,bcast,
                     reduce,allreduce,allgather,alltoall,ring,p2pbarrier; ring and p2pbarrier
                     are every-rank patterns of sends and receives: a ring exchange and a
                     dissemination barrier)
  --config LIST      comma-separated configurations (default: shm,oversubscribed):
                       shm             2 ranks, one per core, shared memory (one process per rank)
                       oversubscribed  4 ranks on the 2 cores
                       udp             rankweave over UDP (reliability on) vs MPI over TCP
  --startup          instead of the OSU benchmarks, the start-up benchmark: launch to exit of
                     a job that joins, runs one barrier and finalizes, for --procs process
                     counts (rwrun vs mpiexec.mpich vs mpirun.openmpi); writes startup.md/.csv
  --mcast            instead of the OSU benchmarks, the multicast broadcast benchmark: latency
                     and per-rank completion skew (rw-bench bcast --skew, C rw_bcast_skew) at
                     8 B and 64 KiB for --procs rank counts, rankweave with RANKWEAVE_BCAST=
                     multicast, channels and binomial (under rwrun) vs MPICH vs Open MPI;
                     100 iterations + 10 warm-up per launch; writes mcast.md/.csv
  --procs LIST       process counts of --startup (default 2,8,32,64) and rank counts of
                     --mcast (default 2,4,8,16)
  --quick            smoke run: sizes 1..64, 10 iterations, 1 round (--startup: 2 processes;
                     --mcast: 2 and 4 ranks, 10 iterations + 2 warm-up)
  --bin-dir DIR      where rwrun, rw-bench and examples/startup are (default
                     $CARGO_TARGET_DIR/release, else target/release under --root)
  --out DIR          where to write results.md, results.csv and plots (default bench/results/latest)
  --book             also write the book's performance chapter data (book/src/performance/)
  --root DIR         repository root (default: current directory)
  -h, --help         this text
";

fn main() -> ExitCode {
    match parse(std::env::args().skip(1).collect()) {
        Ok(Some(plan)) => match plan_execute(&plan) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("compare: {e}");
                ExitCode::FAILURE
            }
        },
        Ok(None) => {
            print!("{HELP}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("compare: {e}\n\n{HELP}");
            ExitCode::from(2)
        }
    }
}

fn plan_execute(plan: &Plan) -> Result<(), String> {
    match (&plan.startup, &plan.mcast) {
        (Some(procs), _) => startup::execute(plan, procs),
        (None, Some(ranks)) => mcast::execute(plan, ranks),
        (None, None) => run::execute(plan),
    }
}

fn parse(args: Vec<String>) -> Result<Option<Plan>, String> {
    let mut plan = Plan {
        rounds: 3,
        benches: osu::ALL.iter().map(|s| s.to_string()).collect(),
        configs: vec![Config::Shm, Config::Oversubscribed],
        quick: false,
        out: PathBuf::from("bench/results/latest"),
        book: false,
        root: PathBuf::from("."),
        impls: vec![Impl::Rankweave, Impl::Mpich, Impl::OpenMpi],
        startup: None,
        mcast: None,
        bins: PathBuf::new(),
    };
    let mut procs: Option<Vec<usize>> = None;
    let mut bins: Option<PathBuf> = None;
    let mut startup_mode = false;
    let mut mcast_mode = false;
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        let mut value = || it.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "-h" | "--help" => return Ok(None),
            "--rounds" => {
                plan.rounds = value()?
                    .parse()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or("--rounds takes a positive number")?
            }
            "--bench" => {
                let list = value()?;
                plan.benches = list.split(',').map(str::to_string).collect();
                if let Some(bad) = plan
                    .benches
                    .iter()
                    .find(|b| !osu::ALL.contains(&b.as_str()))
                {
                    return Err(format!("unknown benchmark {bad:?}"));
                }
            }
            "--config" => {
                plan.configs = value()?
                    .split(',')
                    .map(|c| Config::parse(c).ok_or(format!("unknown configuration {c:?}")))
                    .collect::<Result<_, _>>()?
            }
            "--quick" => {
                plan.quick = true;
                plan.rounds = 1;
            }
            "--startup" => startup_mode = true,
            "--mcast" => mcast_mode = true,
            "--procs" => {
                procs = Some(
                    value()?
                        .split(',')
                        .map(|p| p.trim().parse().ok().filter(|&n: &usize| n > 0))
                        .collect::<Option<_>>()
                        .ok_or("--procs takes comma-separated positive numbers")?,
                )
            }
            "--bin-dir" => bins = Some(PathBuf::from(value()?)),
            "--out" => plan.out = PathBuf::from(value()?),
            "--book" => plan.book = true,
            "--root" => plan.root = PathBuf::from(value()?),
            other => return Err(format!("unknown option {other:?}")),
        }
    }
    if startup_mode && mcast_mode {
        return Err("--startup and --mcast are separate runs; pick one".into());
    }
    if startup_mode {
        let quick = plan.quick.then(|| vec![2]);
        plan.startup = Some(
            procs
                .clone()
                .or(quick)
                .unwrap_or_else(|| startup::DEFAULT_PROCS.to_vec()),
        );
    }
    if mcast_mode {
        let quick = plan.quick.then(|| mcast::QUICK_RANKS.to_vec());
        plan.mcast = Some(
            procs
                .or(quick)
                .unwrap_or_else(|| mcast::DEFAULT_RANKS.to_vec()),
        );
    }
    // Cargo's own rule for where the binaries went, so a build with CARGO_TARGET_DIR set is
    // found without repeating it.
    plan.bins = bins.unwrap_or_else(|| match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => PathBuf::from(dir).join("release"),
        None => plan.root.join("target/release"),
    });
    Ok(Some(plan))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(args: &[&str]) -> Plan {
        parse(args.iter().map(|s| s.to_string()).collect())
            .expect("parses")
            .expect("a plan")
    }

    #[test]
    fn mcast_mode_takes_rank_counts() {
        let p = plan(&["--mcast"]);
        assert_eq!(p.mcast.as_deref(), Some(&mcast::DEFAULT_RANKS[..]));
        assert!(p.startup.is_none());
        let p = plan(&["--mcast", "--quick"]);
        assert_eq!(p.mcast.as_deref(), Some(&mcast::QUICK_RANKS[..]));
        assert_eq!(p.rounds, 1);
        let p = plan(&["--mcast", "--procs", "2,16", "--rounds", "5"]);
        assert_eq!(p.mcast.as_deref(), Some(&[2, 16][..]));
        assert_eq!(p.rounds, 5);
        let p = plan(&["--startup", "--quick"]);
        assert_eq!(p.startup.as_deref(), Some(&[2][..]));
        assert!(parse(vec!["--startup".into(), "--mcast".into()]).is_err());
        let p = plan(&["--bin-dir", "/x/release"]);
        assert_eq!(p.bins, PathBuf::from("/x/release"));
    }
}
