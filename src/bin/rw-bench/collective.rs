//! Collective benchmarks after OSU 7.x's osu_barrier and osu_bcast: every rank times each
//! operation on its own, the per-rank averages go to rank 0, which prints their mean (and with
//! `-f` their minimum and maximum).

use std::time::{Duration, Instant};

use bytes::Bytes;
use rankweave::{Collectives, Communicator};

use crate::cli::Options;
use crate::error::{BenchError, Result};
use crate::report::{Reporter, Row};

/// The user tag that carries per-rank latencies to rank 0 (on the world communicator's
/// point-to-point context, which the collectives never use).
const TAG_STATS: u32 = 0x7277_0001;

/// Average, minimum and maximum over the ranks of one latency (µs), on rank 0; `None`
/// elsewhere. Stands in for OSU's three `MPI_Reduce`s until rankweave has reduce.
async fn gather_stats(comm: &Communicator, latency_us: f64) -> Result<Option<(f64, f64, f64)>> {
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

fn row(opts: &Options, size: Option<usize>, iters: usize, (avg, min, max): (f64, f64, f64)) -> Row {
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
    let (iters, skip) = (opts.iterations, opts.warmup);
    let mut timer = Duration::ZERO;
    for i in 0..iters + skip {
        let t = Instant::now();
        comm.barrier().await?;
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

/// osu_bcast: the time of one broadcast from rank 0 (each followed by an untimed barrier),
/// averaged over the iterations and the ranks.
pub async fn bcast(comm: &Communicator, opts: &Options, out: &mut Reporter) -> Result<()> {
    let root = 0;
    for size in opts.sizes() {
        let (iters, skip) = opts.loops(size);
        // One buffer per size, reused; other ranks' contribution is ignored.
        let buf = if comm.rank() == root {
            Bytes::from(vec![1u8; size])
        } else {
            Bytes::new()
        };
        let mut timer = Duration::ZERO;
        for i in 0..iters + skip {
            let t = Instant::now();
            let got = comm.broadcast(root, buf.clone()).await?;
            let dt = t.elapsed();
            comm.barrier().await?;
            if got.len() != size {
                return Err(BenchError::Verify(format!(
                    "bcast: rank {} received {} bytes, expected {size}",
                    comm.rank(),
                    got.len()
                )));
            }
            if i >= skip {
                timer += dt;
            }
        }
        comm.barrier().await?;
        let latency = timer.as_secs_f64() * 1e6 / iters as f64;
        if let Some(stats) = gather_stats(comm, latency).await? {
            out.row(row(opts, Some(size), iters, stats));
        }
    }
    Ok(())
}
