//! `rw-bench`: OSU-style micro-benchmarks over rankweave.
//!
//! `rw-bench <latency|bw|bibw|mr|barrier|bcast|reduce|allreduce|allgather|alltoall|ring|p2pbarrier>
//! [OPTIONS]`; `rw-bench --help` documents everything. The benchmarks follow the OSU
//! micro-benchmarks 7.x (definitions, defaults, output columns) so their rows line up with
//! OSU's; `ring` and `p2pbarrier`, which OSU does not have, keep its defaults and output format.
//!
//! Structure: [`run`] is the rank body — it only needs a [`Communicator`] and the options, not
//! how ranks were started. [`launch`] starts ranks: in-process (`rankweave::local_with`) when
//! no launcher started this process, else one rank per process through `rankweave::init_job`
//! (under `rwrun`, `mpiexec.mpich`, `mpirun.openmpi`, ...).

mod cli;
mod collective;
mod error;
mod exchange;
mod pt2pt;
mod report;
#[cfg(test)]
mod tests;

use std::process::ExitCode;

use rankweave::launch::detect::{Bootstrap, detect_from_env};
use rankweave::{Communicator, Config};

use crate::cli::{Bench, Command, DEFAULT_RANKS, Options};
use crate::error::{BenchError, Result};
use crate::report::{Report, Reporter};

/// The rank body: runs `opts.bench` on `comm`. Rank 0 returns the report (and prints it as it
/// goes when `opts.print`); the other ranks return `None`. Every rank of `comm` must call it
/// with the same options.
pub async fn run(comm: Communicator, opts: Options) -> Result<Option<Report>> {
    cli::check_ranks(opts.bench, comm.size())?;
    let mut out = Reporter::new(&comm, &opts);
    match opts.bench {
        Bench::Latency => pt2pt::latency(&comm, &opts, &mut out).await?,
        Bench::Bw => pt2pt::bw(&comm, &opts, &mut out).await?,
        Bench::Bibw => pt2pt::bibw(&comm, &opts, &mut out).await?,
        Bench::Mr => pt2pt::mr(&comm, &opts, &mut out).await?,
        Bench::Barrier => collective::barrier(&comm, &opts, &mut out).await?,
        Bench::Bcast => collective::bcast(&comm, &opts, &mut out).await?,
        Bench::Reduce => collective::reduce(&comm, &opts, &mut out).await?,
        Bench::Allreduce => collective::allreduce(&comm, &opts, &mut out).await?,
        Bench::Allgather => collective::allgather(&comm, &opts, &mut out).await?,
        Bench::Alltoall => collective::alltoall(&comm, &opts, &mut out).await?,
        Bench::Ring => exchange::ring(&comm, &opts, &mut out).await?,
        Bench::P2pBarrier => exchange::p2p_barrier(&comm, &opts, &mut out).await?,
    }
    if opts.stats {
        eprintln!("# rank {} counters: {:?}", comm.rank(), comm.stats());
    }
    Ok(out.finish())
}

/// The launcher that started this process, if any.
fn launcher() -> Result<Option<Bootstrap>> {
    match detect_from_env().map_err(rankweave::Error::from)? {
        Bootstrap::Singleton => Ok(None),
        other => Ok(Some(other)),
    }
}

/// Starts the ranks and runs [`run`] on each.
async fn launch(config: Config, mut opts: Options, bootstrap: Option<Bootstrap>) -> Result<()> {
    match bootstrap {
        Some(bootstrap) => {
            if opts.ranks.is_some() {
                return Err(BenchError::Usage(
                    "--ranks is for in-process runs; this process was started by a launcher, which sets the number of ranks".into(),
                ));
            }
            opts.launch = match &bootstrap {
                Bootstrap::Pmi(_) => "one process per rank, PMI-1".into(),
                Bootstrap::Rendezvous(job) => {
                    format!("one process per rank, {}", job.launcher.name())
                }
                Bootstrap::Singleton => "singleton".into(),
            };
            let comm = rankweave::init_job(config, bootstrap).await?;
            let dump = spawn_stats_dump(&comm);
            let result = run(comm.clone(), opts).await;
            // Its handle on the rank must be gone before the rank leaves the job.
            if let Some(dump) = dump {
                dump.abort();
                let _ = dump.await;
            }
            // Leave the job either way, so the other ranks are not left waiting.
            let finalized = rankweave::finalize(comm).await;
            result?;
            finalized?;
            Ok(())
        }
        None => {
            let n = opts.ranks.unwrap_or(DEFAULT_RANKS);
            cli::check_ranks(opts.bench, n)?;
            opts.launch = "in-process".into();
            let results =
                rankweave::local_with(config, n, move |comm| run(comm, opts.clone())).await?;
            first_error(results)
        }
    }
}

/// On `SIGUSR1`, prints this rank's counters (frames and bytes sent and received, receives
/// posted, messages unexpected, the transport's own) to standard error: what a rank that seems
/// stuck has done and still waits for (`kill -USR1 <pid>`). `None` if the signal cannot be
/// watched.
fn spawn_stats_dump(comm: &rankweave::Communicator) -> Option<tokio::task::JoinHandle<()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut usr1 = signal(SignalKind::user_defined1()).ok()?;
    let comm = comm.clone();
    Some(tokio::spawn(async move {
        while usr1.recv().await.is_some() {
            eprintln!(
                "rw-bench: rank {} of {} (SIGUSR1): {:?}",
                comm.rank(),
                comm.size(),
                comm.stats()
            );
        }
    }))
}

/// The error to report from an in-process job: the first rank's own failure rather than a peer
/// that only saw it fail.
fn first_error(results: Vec<Result<Option<Report>>>) -> Result<()> {
    let mut errors: Vec<BenchError> = results.into_iter().filter_map(|r| r.err()).collect();
    let root = errors
        .iter()
        .position(|e| !matches!(e, BenchError::Comm(rankweave::Error::PeerFailed { .. })));
    match root {
        Some(i) => Err(errors.swap_remove(i)),
        None => match errors.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(()),
        },
    }
}

fn real_main(args: &[String]) -> Result<()> {
    let opts = match cli::parse(args)? {
        Command::Help => {
            print!("{}", cli::HELP);
            return Ok(());
        }
        Command::Run(opts) => opts,
    };
    let config = Config::from_env()?;
    let bootstrap = launcher()?;
    // One rank per process runs on one thread, as an MPI rank does: the benchmark loop, the
    // collectives' tasks and the progress task take turns on it, so handing a collective's
    // result back never needs a cross-thread wake-up. In-process ranks share the default pool.
    let mut builder = if bootstrap.is_some() {
        tokio::runtime::Builder::new_current_thread()
    } else {
        tokio::runtime::Builder::new_multi_thread()
    };
    let runtime = builder
        .enable_all()
        .build()
        .map_err(|e| BenchError::Other(format!("cannot start the tokio runtime: {e}")))?;
    runtime.block_on(launch(config, opts, bootstrap))
}

fn main() -> ExitCode {
    let mut args = Vec::new();
    for a in std::env::args_os().skip(1) {
        match a.into_string() {
            Ok(s) => args.push(s),
            Err(bad) => {
                eprintln!("rw-bench: argument {bad:?} is not valid UTF-8");
                return ExitCode::from(2);
            }
        }
    }
    match real_main(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rw-bench: {e}");
            if e.is_usage() {
                eprintln!("Try `rw-bench --help`.");
            }
            ExitCode::from(e.exit_code())
        }
    }
}
