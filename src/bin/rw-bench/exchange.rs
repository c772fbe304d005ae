//! Every-rank patterns built only from sends and receives: `ring` (the periodic chain of
//! IMB-MPI1's Sendrecv) and `p2pbarrier` (a dissemination barrier). Neither is an OSU program;
//! both are timed as osu_barrier times its barrier, and their C baselines are
//! `bench/c/rw_ring.c` and `bench/c/rw_p2pbarrier.c`.
//!
//! Timing: every rank times each iteration on its own and sums the timed ones; nothing
//! separates iterations (each exchange synchronises a rank with its neighbours, as the barrier
//! does all of them). Each rank's average goes to rank 0, which prints their mean (and with
//! `-f` their minimum and maximum), as for the collectives.

use std::time::{Duration, Instant};

use bytes::Bytes;
use rankweave::{Collectives, Communicator, Message};

use crate::cli::Options;
use crate::collective::{gather_stats, row, timed_unsized};
use crate::error::{BenchError, Result};
use crate::report::Reporter;

/// The ring's tag (`rw_ring.c` uses the same).
const TAG_RING: u32 = 200;
/// Round `k` of the dissemination barrier uses tag `TAG_ROUND0 + k`, so that rounds never
/// match each other's messages (`rw_p2pbarrier.c` uses the same).
const TAG_ROUND0: u32 = 300;

fn check_len(bench: &str, comm: &Communicator, msg: &Message, expected: usize) -> Result<()> {
    if msg.len() == expected {
        return Ok(());
    }
    Err(BenchError::Verify(format!(
        "{bench}: rank {} received {} bytes from rank {}, expected {expected}",
        comm.rank(),
        msg.len(),
        msg.source()
    )))
}

/// Sends `buf` to `to` and receives from `from` on `tag`, both started before either is
/// awaited (the send starts when called), as `MPI_Irecv` + `MPI_Isend` + `MPI_Waitall`.
async fn exchange(
    comm: &Communicator,
    to: usize,
    from: usize,
    tag: u32,
    buf: &Bytes,
    bench: &str,
) -> Result<()> {
    let send = comm.send(to, tag, buf.clone());
    let msg = comm.recv(from, tag).await?;
    send.await?;
    check_len(bench, comm, &msg, buf.len())
}

/// ring: per iteration every rank sends `size` bytes to rank + 1 and receives `size` bytes from
/// rank - 1 (mod N); the time of one exchange, averaged over the iterations and the ranks.
/// Per size a barrier first, as every sized benchmark.
pub async fn ring(comm: &Communicator, opts: &Options, out: &mut Reporter) -> Result<()> {
    let (me, n) = (comm.rank(), comm.size());
    let right = (me + 1) % n;
    let left = (me + n - 1) % n;
    for size in opts.sizes() {
        let (iters, skip) = opts.loops(size);
        // OSU fills its send buffer with 'a'.
        let buf = crate::pt2pt::send_buffer(size, b'a');
        comm.barrier().await?;
        let mut timer = Duration::ZERO;
        for i in 0..iters + skip {
            let t = Instant::now();
            exchange(comm, right, left, TAG_RING, &buf, "ring").await?;
            let dt = t.elapsed();
            if i >= skip {
                timer += dt;
            }
        }
        let latency = timer.as_secs_f64() * 1e6 / iters as f64;
        if let Some(stats) = gather_stats(comm, latency).await? {
            out.row(row(opts, Some(size), iters, stats));
        }
    }
    Ok(())
}

/// The rounds of a dissemination barrier on `n` ranks as seen by rank `me`:
/// `(to, from, tag)` for k = 0, 1, … while 2^k < n.
pub fn dissemination_rounds(me: usize, n: usize) -> Vec<(usize, usize, u32)> {
    let mut rounds = Vec::new();
    let mut distance = 1;
    let mut tag = TAG_ROUND0;
    while distance < n {
        rounds.push(((me + distance) % n, (me + n - distance) % n, tag));
        distance *= 2;
        tag += 1;
    }
    rounds
}

/// p2pbarrier: a dissemination barrier of 0-byte messages, ⌈log2 N⌉ rounds; the time of one
/// barrier, averaged over the iterations and the ranks (osu_barrier's loop).
pub async fn p2p_barrier(comm: &Communicator, opts: &Options, out: &mut Reporter) -> Result<()> {
    let rounds = dissemination_rounds(comm.rank(), comm.size());
    let empty = Bytes::new();
    timed_unsized(comm, opts, out, || async {
        for &(to, from, tag) in &rounds {
            exchange(comm, to, from, tag, &empty, "p2pbarrier").await?;
        }
        Ok(())
    })
    .await
}
