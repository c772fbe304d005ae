//! Runs rankweave's `rw-bench` and the C baselines under MPICH and Open MPI interleaved
//! (A B C A B C …), then writes medians, min–max, ratios, a CSV and SVG plots.
//!
//! Usually started through `bench/compare`, which installs the MPIs and builds everything
//! first. `compare --help` lists the options.

mod osu;
mod plot;
mod report;
mod run;
mod startup;

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
  --procs LIST       process counts of --startup (default 2,8,32,64)
  --quick            smoke run: sizes 1..64, 10 iterations, 1 round (--startup: 2 processes)
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
    match &plan.startup {
        Some(procs) => startup::execute(plan, procs),
        None => run::execute(plan),
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
    };
    let mut procs = startup::DEFAULT_PROCS.to_vec();
    let mut startup_mode = false;
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
            "--procs" => {
                procs = value()?
                    .split(',')
                    .map(|p| p.trim().parse().ok().filter(|&n: &usize| n > 0))
                    .collect::<Option<_>>()
                    .ok_or("--procs takes comma-separated positive numbers")?
            }
            "--out" => plan.out = PathBuf::from(value()?),
            "--book" => plan.book = true,
            "--root" => plan.root = PathBuf::from(value()?),
            other => return Err(format!("unknown option {other:?}")),
        }
    }
    if startup_mode {
        if plan.quick {
            procs = vec![2];
        }
        plan.startup = Some(procs);
    }
    Ok(Some(plan))
}
