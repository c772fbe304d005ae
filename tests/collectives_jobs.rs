//! The `collectives` example (every collective checked against a sequential reference) as
//! multi-process jobs: one process per rank over UDP with the reliability layer, under `rwrun`
//! (also with injected loss and reordering) and under MPICH's `mpiexec` (PMI-1).

mod common;

use std::process::{Command, Output};
use std::time::Duration;

use common::{assert_every_rank_reported, example, installed, run_with_deadline};

fn assert_checked(out: &Output, n: usize) {
    assert_every_rank_reported(out, n, "collective results match the reference");
}

fn rwrun(n: usize, extra: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rwrun"));
    cmd.args(["-n", &n.to_string(), "--no-tag-output", "--timeout", "170"])
        .args(extra)
        .arg("--")
        .arg(example("collectives"));
    run_with_deadline(cmd, Duration::from_secs(180))
}

#[test]
fn every_collective_under_rwrun_on_3_and_4_processes() {
    for n in [3, 4] {
        assert_checked(&rwrun(n, &[]), n);
    }
}

/// Over shared memory with the direct all-reduce, all-gather and all-to-all taken from 1 KiB
/// (not only from 1 MiB and 64 KiB), so that every size the example tries from 1000 elements
/// up, on 2, 3 and 5 processes (blocks of uneven length for the all-reduce), reads the other
/// processes' vectors: with `process_vm_readv`, and the all-reduce's inputs with loads from
/// the peers' arenas where they fit.
#[test]
fn all_reduce_all_gather_and_all_to_all_by_direct_reads_between_processes() {
    // With arenas (the default: all-reduce inputs that fit are read with loads) on 2, 3 and 5
    // processes, and without (read with `process_vm_readv`) on 3.
    for (n, arena) in [(2, "4m"), (3, "4m"), (5, "4m"), (3, "0")] {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_rwrun"));
        cmd.args(["-n", &n.to_string(), "--no-tag-output", "--timeout", "170"])
            .arg(example("collectives"))
            .env_remove("RANKWEAVE_TRANSPORT")
            .env("RANKWEAVE_ALLREDUCE_DIRECT", "1k")
            .env("RANKWEAVE_ALLGATHER_DIRECT", "1k")
            .env("RANKWEAVE_ALLTOALL_DIRECT", "1k")
            .env("RANKWEAVE_SHM_ARENA", arena);
        assert_checked(&run_with_deadline(cmd, Duration::from_secs(180)), n);
    }
}

/// Over shared memory with the barrier through flags (`RANKWEAVE_BARRIER=flags`) on 2 (one
/// exchange of flags) and 4 processes (linear through rank 0).
#[test]
fn every_collective_with_the_flag_barrier_between_processes() {
    for n in [2, 4] {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_rwrun"));
        cmd.args(["-n", &n.to_string(), "--no-tag-output", "--timeout", "170"])
            .arg(example("collectives"))
            .env_remove("RANKWEAVE_TRANSPORT")
            .env("RANKWEAVE_BARRIER", "flags");
        assert_checked(&run_with_deadline(cmd, Duration::from_secs(180)), n);
    }
}

#[test]
fn every_collective_under_rwrun_with_loss_and_reordering() {
    assert_checked(
        &rwrun(
            3,
            &["--chaos", "loss=0.01,corrupt=0.005,reorder=0.02,seed=7"],
        ),
        3,
    );
}

#[test]
fn every_collective_under_mpiexec_mpich() {
    if !installed("mpiexec.mpich") {
        eprintln!("skipped: mpiexec.mpich not installed (apt-get install mpich)");
        return;
    }
    let mut cmd = Command::new("mpiexec.mpich");
    cmd.args(["-n", "3"]).arg(example("collectives"));
    assert_checked(&run_with_deadline(cmd, Duration::from_secs(180)), 3);
}
