//! Building the command lines and running them interleaved.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::osu;

/// Which implementation runs a measurement.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Impl {
    /// rankweave's `rw-bench`.
    Rankweave,
    /// The C baselines built with MPICH.
    Mpich,
    /// The C baselines built with Open MPI.
    OpenMpi,
}

impl Impl {
    pub fn name(self) -> &'static str {
        match self {
            Impl::Rankweave => "rankweave",
            Impl::Mpich => "MPICH",
            Impl::OpenMpi => "Open MPI",
        }
    }
}

/// A machine configuration to measure in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Config {
    /// 2 ranks, one per core, shared memory (one process per rank, pinned).
    Shm,
    /// 4 ranks on the 2 cores.
    Oversubscribed,
    /// rankweave over UDP (one process per rank, under `rwrun`) against MPI over TCP.
    Udp,
}

impl Config {
    pub fn parse(s: &str) -> Option<Config> {
        match s {
            "shm" => Some(Config::Shm),
            "oversubscribed" | "oversub" => Some(Config::Oversubscribed),
            "udp" => Some(Config::Udp),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Config::Shm => "shm",
            Config::Oversubscribed => "oversubscribed",
            Config::Udp => "udp",
        }
    }

    fn ranks(self) -> usize {
        match self {
            Config::Oversubscribed => 4,
            _ => 2,
        }
    }
}

/// What to run.
pub struct Plan {
    pub rounds: usize,
    pub benches: Vec<String>,
    pub configs: Vec<Config>,
    pub quick: bool,
    pub out: PathBuf,
    pub book: bool,
    pub root: PathBuf,
    pub impls: Vec<Impl>,
    /// Run the start-up benchmark for these process counts instead of the OSU benchmarks.
    pub startup: Option<Vec<usize>>,
    /// Run the multicast broadcast benchmark for these rank counts instead (`--mcast`).
    pub mcast: Option<Vec<usize>>,
    /// The directory holding `rwrun`, `rw-bench` and `examples/startup` (cargo's release
    /// directory).
    pub bins: PathBuf,
}

/// One measurement's samples: (config, bench, impl) → size → figures of every round.
pub type Samples = BTreeMap<(Config, String, Impl), BTreeMap<u64, Vec<f64>>>;

/// Why a measurement has no numbers.
pub type Gaps = BTreeMap<(Config, String, Impl), String>;

/// The placement probe taken before each round's runs of a measurement: (config, bench) → one
/// figure per round, ns (see [`placement`](crate::placement)).
pub type Probes = BTreeMap<(Config, String), Vec<f64>>;

const RUN_TIMEOUT: Duration = Duration::from_secs(180);

/// The OSU flags of each run that makes up one measurement (the rows of its runs together).
/// Shared memory uses OSU's own iteration counts and sizes in one run. Four ranks on two cores
/// run fewer iterations, because MPICH takes milliseconds per operation there and OSU's counts
/// would take the better part of an hour: up to 1 KiB in one run, and 64 KiB to 1 MiB (the
/// large cells of the collectives' targets) in a second run with fewer still. The barriers,
/// one figure each, keep the default 1 000 iterations (100 warm-up) there: 100 barriers of a
/// few microseconds are a millisecond, less than one scheduler tick, and their average
/// followed how the four processes happened to share the cores more than the barrier
/// (MPICH's ~8 ms ones take some 9 s a run).
fn osu_sweeps(plan: &Plan, config: Config, bench: &str) -> Vec<Vec<String>> {
    let sized = osu::is_sized(bench);
    let sweeps: &[(&[&str], &[&str])] = if plan.quick {
        &[(&["-m", "1:64"], &["-i", "10", "-x", "2"])]
    } else if config == Config::Oversubscribed && !sized {
        &[(&[], &["-i", "1000", "-x", "100"])]
    } else if config == Config::Oversubscribed {
        &[
            (&["-m", "1:1024"], &["-i", "100", "-x", "10"]),
            (&["-m", "65536:1048576"], &["-i", "20", "-x", "2"]),
        ]
    } else {
        &[(&[], &[])]
    };
    // The barriers have no message size: one run.
    sweeps
        .iter()
        .take(if sized { sweeps.len() } else { 1 })
        .map(|(sizes, counts)| {
            let sizes = if sized { *sizes } else { &[][..] };
            sizes.iter().chain(*counts).map(|s| s.to_string()).collect()
        })
        .collect()
}

fn command(
    plan: &Plan,
    imp: Impl,
    config: Config,
    bench: &str,
    flags: &[String],
) -> Result<Command, String> {
    let n = config.ranks().to_string();
    let root = &plan.root;
    let bins = &plan.bins;
    let pinned = config == Config::Shm;
    let mut cmd = match imp {
        Impl::Rankweave if config == Config::Udp => {
            // One process per rank, as the MPIs run, over UDP with the reliability layer.
            let mut c = Command::new(bins.join("rwrun"));
            c.args(["-n", &n, "--transport", "udp", "--no-tag-output", "--"])
                .arg(bins.join("rw-bench"))
                .arg(bench);
            c
        }
        Impl::Rankweave => {
            // One process per rank on this host: rwrun's default transport is shared memory.
            let mut c = Command::new(bins.join("rwrun"));
            c.args(["-n", &n, "--no-tag-output"]);
            if pinned {
                c.args(["--bind-to", "core"]);
            }
            c.arg("--").arg(bins.join("rw-bench")).arg(bench);
            c
        }
        Impl::Mpich => {
            let mut c = Command::new("mpiexec.mpich");
            c.args(["-n", &n]);
            if pinned {
                c.args(["-bind-to", "core"]);
            }
            if config == Config::Udp {
                // Debian's MPICH is ch4:ucx, and UCX keeps its own shared memory between local
                // ranks unless told to use TCP only (MPIR_CVAR_NOLOCAL alone is not enough).
                c.args([
                    "-genv",
                    "MPIR_CVAR_NOLOCAL",
                    "1",
                    "-genv",
                    "UCX_TLS",
                    "tcp,self",
                ]);
            }
            c.arg(binary(root, "mpich", bench));
            c
        }
        Impl::OpenMpi => {
            let mut c = Command::new("mpirun.openmpi");
            c.args(["--allow-run-as-root", "-n", &n]);
            c.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
                .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
            if pinned {
                c.args(["--bind-to", "core"]);
            } else {
                c.args(["--oversubscribe", "--bind-to", "none"]);
            }
            let btl = if config == Config::Udp {
                "self,tcp"
            } else {
                "self,vader"
            };
            c.args(["--mca", "btl", btl]);
            c.arg(binary(root, "openmpi", bench));
            c
        }
    };
    cmd.args(flags);
    Ok(cmd)
}

fn binary(root: &Path, mpi: &str, bench: &str) -> PathBuf {
    root.join("target/bench-c")
        .join(mpi)
        .join(osu::c_program(bench))
}

/// Runs one measurement (each of its sweeps); returns its rows or why there are none.
fn measure(plan: &Plan, imp: Impl, config: Config, bench: &str) -> Result<Vec<(u64, f64)>, String> {
    let started = Instant::now();
    let mut rows = Vec::new();
    for flags in osu_sweeps(plan, config, bench) {
        let mut cmd = command(plan, imp, config, bench, &flags)?;
        let out = run_with_timeout(&mut cmd, RUN_TIMEOUT)?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let why = stderr
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("");
            return Err(format!("exited with {}: {}", out.status, why.trim()));
        }
        let swept = osu::parse(&stdout, osu::metric(bench));
        if swept.is_empty() {
            return Err(format!("printed no data rows (flags {flags:?})"));
        }
        rows.extend(swept);
    }
    eprintln!(
        "  {:<9} {:<15} {:<9} {:>3} rows in {:.1?}",
        imp.name(),
        config.name(),
        bench,
        rows.len(),
        started.elapsed()
    );
    Ok(rows)
}

pub fn run_with_timeout(
    cmd: &mut Command,
    limit: Duration,
) -> Result<std::process::Output, String> {
    use std::io::Read;
    use std::process::Stdio;
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start {:?}: {e}", cmd.get_program()))?;
    // The pipes are drained while the child runs: one that fills (64 KiB of output, say a
    // backtrace per iteration) would otherwise stop the child until the deadline.
    fn drain(pipe: Option<impl Read + Send + 'static>) -> std::sync::mpsc::Receiver<Vec<u8>> {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut out = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut out);
            }
            let _ = tx.send(out);
        });
        rx
    }
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    let deadline = Instant::now() + limit;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            // 1 ms polls: the start-up benchmark times whole launches of a few milliseconds.
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(1)),
            Ok(None) => {
                // Ask for a state dump first (rwrun forwards SIGUSR1 to its ranks, and each
                // rw-bench rank prints its counters and state): a hang is worth a look.
                let _ = Command::new("kill")
                    .args(["-USR1", &child.id().to_string()])
                    .status();
                std::thread::sleep(Duration::from_secs(2));
                let _ = child.kill();
                let _ = child.wait();
                // Ranks that outlived the launcher may hold the pipe: not waited for long.
                let stderr = stderr
                    .recv_timeout(Duration::from_secs(2))
                    .unwrap_or_default();
                let stderr = String::from_utf8_lossy(&stderr);
                for line in stderr.lines().filter(|l| l.contains("SIGUSR1")) {
                    eprintln!("  state at timeout: {line}");
                }
                return Err(format!("timed out after {limit:?}"));
            }
            Err(e) => return Err(format!("waiting: {e}")),
        }
    };
    let collected = |rx: std::sync::mpsc::Receiver<Vec<u8>>| {
        rx.recv()
            .map_err(|_| "collecting output: the reader stopped".to_string())
    };
    Ok(std::process::Output {
        status,
        stdout: collected(stdout)?,
        stderr: collected(stderr)?,
    })
}

/// Runs the whole plan, interleaved, and writes the reports.
pub fn execute(plan: &Plan) -> Result<(), String> {
    let mut samples = Samples::new();
    let mut gaps = Gaps::new();
    let mut probes = Probes::new();
    let started = Instant::now();
    for round in 1..=plan.rounds {
        eprintln!("round {round} of {}", plan.rounds);
        for &config in &plan.configs {
            for bench in &plan.benches {
                // A B C, then again next round: drift in the VM's placement hits all alike.
                // Point-to-point benchmarks are between two ranks: the shm configuration has them.
                if config == Config::Oversubscribed && osu::is_pt2pt(bench) {
                    continue;
                }
                if let Some(ns) = crate::placement::probe() {
                    probes.entry((config, bench.clone())).or_default().push(ns);
                }
                for &imp in &plan.impls {
                    let key = (config, bench.clone(), imp);
                    if gaps.contains_key(&key) {
                        continue;
                    }
                    match measure(plan, imp, config, bench) {
                        Ok(rows) => {
                            let by_size = samples.entry(key).or_default();
                            for (size, v) in rows {
                                by_size.entry(size).or_default().push(v);
                            }
                        }
                        Err(why) => {
                            eprintln!(
                                "  {:<9} {:<15} {:<9} skipped: {why}",
                                imp.name(),
                                config.name(),
                                bench
                            );
                            gaps.insert(key, why);
                        }
                    }
                }
            }
        }
    }
    let elapsed = started.elapsed();
    crate::report::write(plan, &samples, &gaps, &probes, elapsed)
}

#[cfg(test)]
mod tests {

    /// Output past a pipe's 64 KiB is drained while the child runs (the child would stop at a
    /// full pipe until the deadline otherwise); a child past the deadline is killed.
    #[test]
    fn long_output_is_drained_and_a_late_child_is_cut_off() {
        let mut talker = Command::new("sh");
        talker.args([
            "-c",
            "head -c 300000 /dev/zero; head -c 200000 /dev/zero >&2",
        ]);
        let started = Instant::now();
        let out = run_with_timeout(&mut talker, Duration::from_secs(20)).unwrap();
        assert_eq!((out.stdout.len(), out.stderr.len()), (300_000, 200_000));
        assert!(started.elapsed() < Duration::from_secs(10));
        let mut sleeper = Command::new("sleep");
        sleeper.arg("30");
        let err = run_with_timeout(&mut sleeper, Duration::from_millis(200)).unwrap_err();
        assert!(err.contains("timed out"), "{err}");
    }
    use super::*;

    fn plan(quick: bool) -> Plan {
        Plan {
            rounds: 1,
            benches: Vec::new(),
            configs: Vec::new(),
            quick,
            out: PathBuf::new(),
            book: false,
            root: PathBuf::new(),
            impls: Vec::new(),
            startup: None,
            mcast: None,
            bins: PathBuf::new(),
        }
    }

    #[test]
    fn oversubscribed_collectives_reach_the_large_sizes_in_a_second_sweep() {
        let sweeps = osu_sweeps(&plan(false), Config::Oversubscribed, "allreduce");
        assert_eq!(sweeps.len(), 2);
        assert_eq!(sweeps[0][..2], ["-m", "1:1024"]);
        assert_eq!(sweeps[1][..2], ["-m", "65536:1048576"]);
        // A barrier has no sizes: one run, iteration counts only.
        let barrier = osu_sweeps(&plan(false), Config::Oversubscribed, "barrier");
        assert_eq!(barrier, [["-i", "1000", "-x", "100"]]);
        // Shared memory keeps OSU's defaults; a quick run has one small sweep.
        assert_eq!(
            osu_sweeps(&plan(false), Config::Shm, "bcast"),
            [Vec::<String>::new()]
        );
        assert_eq!(
            osu_sweeps(&plan(true), Config::Oversubscribed, "bcast").len(),
            1
        );
    }
}
