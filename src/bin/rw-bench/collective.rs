//! Collective benchmarks after OSU 7.x's osu_barrier and osu_bcast: every rank times each
//! operation on its own, the per-rank averages go to rank 0, which prints their mean (and with
//! `-f` their minimum and maximum).

use std::future::Future;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rankweave::{Collectives, Communicator, Op};

use crate::cli::Options;
use crate::error::{BenchError, Result};
use crate::report::{Reporter, Row};

/// The user tag that carries per-rank latencies to rank 0 (on the world communicator's
/// point-to-point context, which the collectives never use).
const TAG_STATS: u32 = 0x7277_0001;

/// Average, minimum and maximum over the ranks of one latency (µs), on rank 0; `None`
/// elsewhere (OSU's three `MPI_Reduce`s, as plain messages so that the statistics never
/// depend on the collectives being measured).
pub async fn gather_stats(comm: &Communicator, latency_us: f64) -> Result<Option<(f64, f64, f64)>> {
    if comm.rank() != 0 {
        comm.send(0, TAG_STATS, latency_us.to_le_bytes().to_vec())
            .await?;
        return Ok(None);
    }
    let recvs: Vec<_> = (1..comm.size()).map(|r| comm.recv(r, TAG_STATS)).collect();
    let (mut sum, mut min, mut max) = (latency_us, latency_us, latency_us);
    for r in recvs {
        let msg = r.await?;
        let bytes: [u8; 8] = msg.data()[..].try_into().map_err(|_| {
            BenchError::Verify(format!(
                "rank {} sent a {}-byte latency report, expected 8",
                msg.source(),
                msg.len()
            ))
        })?;
        let v = f64::from_le_bytes(bytes);
        sum += v;
        min = min.min(v);
        max = max.max(v);
    }
    Ok(Some((sum / comm.size() as f64, min, max)))
}

pub fn row(
    opts: &Options,
    size: Option<usize>,
    iters: usize,
    (avg, min, max): (f64, f64, f64),
) -> Row {
    if opts.full {
        Row {
            size,
            values: vec![avg, min, max],
            iterations: Some(iters),
        }
    } else {
        Row {
            size,
            values: vec![avg],
            iterations: None,
        }
    }
}

/// osu_barrier: the time of one barrier, averaged over the iterations and the ranks.
pub async fn barrier(comm: &Communicator, opts: &Options, out: &mut Reporter) -> Result<()> {
    timed_unsized(comm, opts, out, || async { Ok(comm.barrier().await?) }).await
}

/// osu_barrier's loop for an operation without a size: every iteration times `op` alone on
/// every rank, warm-up iterations are not timed, and rank 0 reports the mean over the ranks.
pub async fn timed_unsized<F, Fut>(
    comm: &Communicator,
    opts: &Options,
    out: &mut Reporter,
    mut op: F,
) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<()>>,
{
    let (iters, skip) = (opts.iterations, opts.warmup);
    let mut timer = Duration::ZERO;
    for i in 0..iters + skip {
        let t = Instant::now();
        op().await?;
        let dt = t.elapsed();
        if i >= skip {
            timer += dt;
        }
    }
    comm.barrier().await?;
    let latency = timer.as_secs_f64() * 1e6 / iters as f64;
    if let Some(stats) = gather_stats(comm, latency).await? {
        out.row(row(opts, None, iters, stats));
    }
    Ok(())
}

/// The OSU loop shared by the sized collectives: per size a barrier, then each iteration
/// times only the operation on every rank and is followed by an untimed barrier; warm-up
/// iterations are not timed. `op(size)` runs the operation once and checks what it returned.
async fn timed_sizes<F, Fut>(
    comm: &Communicator,
    opts: &Options,
    out: &mut Reporter,
    mut op: F,
) -> Result<()>
where
    F: FnMut(usize) -> Fut,
    Fut: Future<Output = Result<()>>,
{
    for size in opts.sizes() {
        let (iters, skip) = opts.loops(size);
        comm.barrier().await?;
        let mut timer = Duration::ZERO;
        for i in 0..iters + skip {
            let t = Instant::now();
            op(size).await?;
            let dt = t.elapsed();
            comm.barrier().await?;
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

fn check_len(bench: &str, comm: &Communicator, got: usize, expected: usize) -> Result<()> {
    if got == expected {
        return Ok(());
    }
    Err(BenchError::Verify(format!(
        "{bench}: rank {} received {got} bytes, expected {expected}",
        comm.rank()
    )))
}

/// osu_bcast: one broadcast of `size` bytes from rank 0.
pub async fn bcast(comm: &Communicator, opts: &Options, out: &mut Reporter) -> Result<()> {
    let root = 0;
    timed_sizes(comm, opts, out, |size| {
        // Other ranks' contribution is ignored.
        let buf = if comm.rank() == root {
            Bytes::from(vec![1u8; size])
        } else {
            Bytes::new()
        };
        async move {
            let got = comm.broadcast(root, buf).await?;
            check_len("bcast", comm, got.len(), size)
        }
    })
    .await
}

/// osu_reduce: `MPI_Reduce` (sum) of `size` one-byte elements to rank 0.
pub async fn reduce(comm: &Communicator, opts: &Options, out: &mut Reporter) -> Result<()> {
    timed_sizes(comm, opts, out, |size| {
        let data = vec![1i8; size];
        async move {
            let got = comm.reduce(0, &data, Op::Sum).await?;
            let len = got.map_or(size, |v| v.len());
            check_len("reduce", comm, len, size)
        }
    })
    .await
}

/// osu_allreduce: `MPI_Allreduce` (sum) of `size` one-byte elements.
pub async fn allreduce(comm: &Communicator, opts: &Options, out: &mut Reporter) -> Result<()> {
    timed_sizes(comm, opts, out, |size| {
        let data = vec![1i8; size];
        async move {
            let got = comm.all_reduce(&data, Op::Sum).await?;
            check_len("allreduce", comm, got.len(), size)
        }
    })
    .await
}

/// osu_allgather: every rank contributes `size` bytes and receives `size` from each rank.
pub async fn allgather(comm: &Communicator, opts: &Options, out: &mut Reporter) -> Result<()> {
    timed_sizes(comm, opts, out, |size| {
        let data = vec![1u8; size];
        async move {
            let got = comm.all_gather(&data).await?;
            check_len("allgather", comm, got.len(), size * comm.size())
        }
    })
    .await
}

/// osu_alltoall: every rank sends `size` bytes to each rank and receives `size` from each.
pub async fn alltoall(comm: &Communicator, opts: &Options, out: &mut Reporter) -> Result<()> {
    timed_sizes(comm, opts, out, |size| {
        let data = vec![1u8; size * comm.size()];
        async move {
            let got = comm.all_to_all(&data).await?;
            check_len("alltoall", comm, got.len(), size * comm.size())
        }
    })
    .await
}
