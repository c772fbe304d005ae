//! The multicast broadcasts end to end (the `multicast_bcast` example: broadcasts of every
//! size from every root, each checked byte for byte) as multi-process jobs under `rwrun` and
//! MPICH's `mpiexec`, and as in-process jobs (the example without a launcher), over real IP
//! multicast on loopback, with faults injected on the multicast route:
//! every rank gets identical bytes at 0%, 10%, 50% and 100% loss, with corruption,
//! reordering and late ranks, and the counters show the repairs.

mod common;

use std::process::{Command, Output};
use std::time::Duration;

use common::{assert_every_rank_reported, example, installed, run_with_deadline};

/// One job's ranks' counters, as the example prints them.
#[derive(Debug, Default)]
struct Counters {
    multicast_received: u64,
    ring_repaired: u64,
    nacks_sent: u64,
    sync_repairs: u64,
    failovers: u64,
    faults_injected: u64,
}

fn counters(out: &Output) -> Counters {
    let mut c = Counters::default();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let field = |name: &str| -> u64 {
            line.split(name)
                .nth(1)
                .and_then(|rest| rest.trim_start().split([',', ' ']).next())
                .and_then(|n| n.parse().ok())
                .unwrap_or(0)
        };
        c.multicast_received += field("multicast received");
        c.ring_repaired += field("ring repaired");
        c.nacks_sent += field("nacks sent");
        c.sync_repairs += field("sync repairs");
        c.failovers += field("failovers");
        c.faults_injected += field("faults injected");
    }
    c
}

struct Job<'a> {
    ranks: usize,
    algorithm: &'a str,
    chaos: &'a str,
    args: &'a [&'a str],
}

fn rwrun(job: &Job) -> (Output, Counters) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rwrun"));
    cmd.args([
        "-n",
        &job.ranks.to_string(),
        "--no-tag-output",
        "--timeout",
        "170",
    ])
    .env("RANKWEAVE_BCAST", job.algorithm)
    .env("RANKWEAVE_MCAST_MIN_RANKS", "2")
    .env("RANKWEAVE_MCAST_CHAOS", job.chaos)
    .arg("--")
    .arg(example("multicast_bcast"))
    .args(job.args);
    let out = run_with_deadline(cmd, Duration::from_secs(180));
    assert_every_rank_reported(&out, job.ranks, "broadcasts verified");
    let c = counters(&out);
    (out, c)
}

/// The example without a launcher: `ranks` in-process ranks (tokio tasks).
fn in_process(job: &Job) -> Counters {
    let mut cmd = Command::new(example("multicast_bcast"));
    cmd.env("RANKWEAVE_BCAST", job.algorithm)
        .env("RANKWEAVE_MCAST_MIN_RANKS", "2")
        .env("RANKWEAVE_MCAST_CHAOS", job.chaos)
        .args(["--ranks", &job.ranks.to_string()])
        .args(job.args);
    let out = run_with_deadline(cmd, Duration::from_secs(180));
    assert_every_rank_reported(&out, job.ranks, "broadcasts verified");
    counters(&out)
}

#[test]
fn in_process_from_2_to_64_ranks_at_every_loss_rate() {
    for (ranks, max) in [(2, "8388608"), (8, "8388608"), (64, "1048576")] {
        for algorithm in ["multicast", "channels"] {
            for chaos in [
                "",
                "seed=21,loss=10%,corrupt=2%,reorder=10%",
                "seed=22,loss=50%",
                "loss=100%",
            ] {
                if ranks == 64 && chaos.is_empty() {
                    continue;
                }
                let c = in_process(&Job {
                    ranks,
                    algorithm,
                    chaos,
                    args: &["--max", max, "--rounds", "1", "--late"],
                });
                if !chaos.is_empty() {
                    let repaired = c.ring_repaired + c.nacks_sent + c.sync_repairs;
                    assert!(repaired > 0, "{ranks} {algorithm} {chaos}: {c:?}");
                }
            }
        }
    }
}

/// 0 B to 8 MiB from every root, on 4 processes, at each loss rate; late ranks throughout.
fn every_size_at_every_loss_rate(algorithm: &str) {
    let args = ["--max", "8388608", "--rounds", "1", "--late"];
    for (chaos, loss) in [
        ("", 0),
        ("seed=11,loss=10%,corrupt=2%,reorder=10%", 10),
        ("seed=12,loss=50%,corrupt=5%,reorder=20%", 50),
        ("loss=100%", 100),
    ] {
        let (_, c) = rwrun(&Job {
            ranks: 4,
            algorithm,
            chaos,
            args: &args,
        });
        let repaired = c.ring_repaired + c.nacks_sent + c.sync_repairs;
        match loss {
            0 => assert!(c.multicast_received > 0, "{algorithm}: {c:?}"),
            100 => {
                assert_eq!(c.multicast_received, 0, "{algorithm}: {c:?}");
                assert!(repaired > 0, "{algorithm}: {c:?}");
            }
            _ => {
                assert!(c.faults_injected > 0, "{algorithm}: {c:?}");
                assert!(repaired > 0, "{algorithm} repaired nothing: {c:?}");
            }
        }
    }
}

#[test]
fn two_stage_under_rwrun_every_size_at_every_loss_rate() {
    every_size_at_every_loss_rate("multicast");
}

#[test]
fn channels_under_rwrun_every_size_at_every_loss_rate() {
    every_size_at_every_loss_rate("channels");
}

/// From 2 to 64 processes (small broadcasts on the large jobs: 64 processes share two cores).
#[test]
fn both_algorithms_from_2_to_64_processes() {
    for (ranks, max) in [(2, "1048576"), (16, "65536"), (64, "4096")] {
        for algorithm in ["multicast", "channels"] {
            let (_, c) = rwrun(&Job {
                ranks,
                algorithm,
                chaos: "seed=5,loss=10%,reorder=5%",
                args: &["--max", max, "--rounds", "1"],
            });
            assert!(c.faults_injected > 0, "{ranks} {algorithm}: {c:?}");
        }
    }
}

/// Channels fail over to the point-to-point tree when multicast delivers nothing.
#[test]
fn channels_fail_over_when_multicast_is_dead() {
    let (_, c) = rwrun(&Job {
        ranks: 3,
        algorithm: "channels",
        chaos: "loss=100%",
        args: &["--max", "65536", "--rounds", "12"],
    });
    assert!(c.failovers > 0, "{c:?}");
}

#[test]
fn both_algorithms_under_mpiexec_mpich() {
    if !installed("mpiexec.mpich") {
        eprintln!("skipped: mpiexec.mpich not installed (apt-get install mpich)");
        return;
    }
    for algorithm in ["multicast", "channels"] {
        let mut cmd = Command::new("mpiexec.mpich");
        cmd.args(["-n", "4"])
            .env("RANKWEAVE_BCAST", algorithm)
            .env("RANKWEAVE_MCAST_MIN_RANKS", "2")
            .env("RANKWEAVE_MCAST_CHAOS", "seed=3,loss=20%")
            .arg(example("multicast_bcast"))
            .args(["--max", "1048576", "--late"]);
        let out = run_with_deadline(cmd, Duration::from_secs(180));
        assert_every_rank_reported(&out, 4, "broadcasts verified");
        assert!(counters(&out).faults_injected > 0);
    }
}
