//! Collective benchmarks after OSU 7.x's osu_barrier and osu_bcast: every rank times each
//! operation on its own, the per-rank averages go to rank 0, which prints their mean (and with
//! `-f` their minimum and maximum). `bcast --skew` adds the per-rank completion skew (see
//! [`bcast_skew`]; its C baseline is `bench/c/rw_bcast_skew.c`).

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
/// The user tag that carries a rank's completion instants of `bcast --skew` to rank 0.
const TAG_SKEW: u32 = 0x7277_0002;
/// The user tag that carries a rank's multicast broadcast counters to rank 0.
const TAG_MCAST: u32 = 0x7277_0003;

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

/// A send buffer of ones, made once per size and reused by every iteration of that size, as OSU
/// allocates its buffers once: the timed loop measures the collective, not an allocation.
#[derive(Default)]
struct SendBuffer(Bytes);

impl SendBuffer {
    fn of(&mut self, len: usize) -> Bytes {
        if self.0.len() != len {
            self.0 = crate::pt2pt::send_buffer(len, 1);
        }
        self.0.clone()
    }
}

/// osu_bcast: one broadcast of `size` bytes from rank 0 (with `--skew`, [`bcast_skew`]).
pub async fn bcast(comm: &Communicator, opts: &Options, out: &mut Reporter) -> Result<()> {
    if opts.skew {
        return bcast_skew(comm, opts, out).await;
    }
    let root = 0;
    let mut send = SendBuffer::default();
    timed_sizes(comm, opts, out, |size| {
        // Other ranks' contribution is ignored.
        let buf = if comm.rank() == root {
            send.of(size)
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
    let mut send = SendBuffer::default();
    timed_sizes(comm, opts, out, |size| {
        let data = send.of(size);
        async move {
            let elements: &[i8] = bytemuck::cast_slice(&data);
            let got = comm.reduce(0, elements, Op::Sum).await?;
            let len = got.map_or(size, |v| v.len());
            check_len("reduce", comm, len, size)
        }
    })
    .await
}

/// osu_allreduce: `MPI_Allreduce` (sum) of `size` one-byte elements.
pub async fn allreduce(comm: &Communicator, opts: &Options, out: &mut Reporter) -> Result<()> {
    let mut send = SendBuffer::default();
    timed_sizes(comm, opts, out, |size| {
        let data = send.of(size);
        async move {
            let elements: &[i8] = bytemuck::cast_slice(&data);
            let got = comm.all_reduce(elements, Op::Sum).await?;
            check_len("allreduce", comm, got.len(), size)
        }
    })
    .await
}

/// osu_allgather: every rank contributes `size` bytes and receives `size` from each rank. The
/// send buffer goes as `Bytes` (`all_gather_bytes`), which peers on shared memory read in
/// place, as MPI libraries read `MPI_Allgather`'s send buffer.
pub async fn allgather(comm: &Communicator, opts: &Options, out: &mut Reporter) -> Result<()> {
    let mut send = SendBuffer::default();
    timed_sizes(comm, opts, out, |size| {
        let data = send.of(size);
        async move {
            let got = comm.all_gather_bytes(data).await?;
            check_len("allgather", comm, got.len(), size * comm.size())
        }
    })
    .await
}

/// osu_alltoall: every rank sends `size` bytes to each rank and receives `size` from each
/// (the send buffer as `Bytes`, `all_to_all_bytes`, as for [`allgather`]).
pub async fn alltoall(comm: &Communicator, opts: &Options, out: &mut Reporter) -> Result<()> {
    let mut send = SendBuffer::default();
    timed_sizes(comm, opts, out, |size| {
        let data = send.of(size * comm.size());
        async move {
            let got = comm.all_to_all_bytes(data).await?;
            check_len("alltoall", comm, got.len(), size * comm.size())
        }
    })
    .await
}

/// Nanoseconds of `CLOCK_MONOTONIC`. std's `Instant` reads the same clock but keeps its value
/// private, and the skew compares instants taken in different processes: on one host this clock
/// is shared by all of them (the C baseline reads it with `clock_gettime` too).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC exists on every Unix we run on,
    // so the call cannot fail.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}

/// The median of `v` (the mean of the middle two for an even count); 0 for an empty slice.
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The skew figures of one size from every rank's instants: `t0[i]` is the root's start of
/// timed iteration `i`, `done[r][i]` non-root rank r's completion of it (ns, one clock).
/// Returns (median skew, median last completion − t0) in µs, where an iteration's skew is the
/// latest minus the earliest completion over the non-root ranks.
pub fn skew_medians(t0: &[u64], done: &[Vec<u64>]) -> (f64, f64) {
    let mut skews = Vec::with_capacity(t0.len());
    let mut lasts = Vec::with_capacity(t0.len());
    for (i, &start) in t0.iter().enumerate() {
        let at = done.iter().filter_map(|d| d.get(i).copied());
        let (first, last) = at.fold((u64::MAX, 0), |(lo, hi), t| (lo.min(t), hi.max(t)));
        if first > last {
            continue; // no non-root rank (cannot happen: every benchmark has 2 ranks or more)
        }
        skews.push((last - first) as f64 / 1e3);
        // Signed: a completion is after t0 (the data leaves the root after it), but say so
        // rather than wrap if a clock ever disagreed.
        lasts.push((last as i128 - start as i128) as f64 / 1e3);
    }
    (median(&mut skews), median(&mut lasts))
}

/// `bcast --skew`: per size a barrier; per iteration a barrier, then rank 0 takes t0 and
/// broadcasts `size` bytes, and every rank records the instant its broadcast returned (the
/// clock is [`monotonic_ns`], one for every process of this host). Warm-up iterations are not
/// recorded. After the iterations, untimed, every rank sends its instants to rank 0, which
/// prints per size: the OSU average latency (mean over the ranks of each rank's mean call
/// time), the median over the iterations of the completion skew (latest − earliest completion
/// over the non-root ranks; 0 on 2 ranks, which have one) and the median of the last non-root
/// completion − t0. The barrier before each broadcast (not after it, as OSU) lines the ranks up
/// so that the skew is the broadcast's, plus the barrier's own exit skew.
pub async fn bcast_skew(comm: &Communicator, opts: &Options, out: &mut Reporter) -> Result<()> {
    let root = 0;
    let me = comm.rank();
    for size in opts.sizes() {
        let (iters, skip) = opts.loops(size);
        let payload = if me == root {
            crate::pt2pt::send_buffer(size, 1)
        } else {
            Bytes::new()
        };
        let mut timer = Duration::ZERO;
        // The root keeps its t0s, every other rank its completion instants.
        let mut instants = Vec::with_capacity(iters);
        comm.barrier().await?;
        for i in 0..iters + skip {
            comm.barrier().await?;
            let t0 = monotonic_ns();
            let got = comm.broadcast(root, payload.clone()).await?;
            let done = monotonic_ns();
            check_len("bcast", comm, got.len(), size)?;
            if i >= skip {
                timer += Duration::from_nanos(done - t0);
                instants.push(if me == root { t0 } else { done });
            }
        }
        let latency = timer.as_secs_f64() * 1e6 / iters as f64;
        let stats = gather_stats(comm, latency).await?;
        let skew = gather_instants(comm, &instants).await?;
        if let (Some((avg, _, _)), Some((skew, last))) = (stats, skew) {
            out.row(Row::sized(size, vec![avg, skew, last]));
        }
    }
    if let Some(line) = gather_mcast_counters(comm).await? {
        out.note(line);
    }
    Ok(())
}

/// Sends this rank's instants to rank 0, which returns the skew medians (µs); `None` elsewhere.
async fn gather_instants(comm: &Communicator, instants: &[u64]) -> Result<Option<(f64, f64)>> {
    if comm.rank() != 0 {
        let bytes: Vec<u8> = instants.iter().flat_map(|t| t.to_le_bytes()).collect();
        comm.send(0, TAG_SKEW, bytes).await?;
        return Ok(None);
    }
    let recvs: Vec<_> = (1..comm.size()).map(|r| comm.recv(r, TAG_SKEW)).collect();
    let mut done = Vec::with_capacity(recvs.len());
    for r in recvs {
        let msg = r.await?;
        if msg.len() != instants.len() * 8 {
            return Err(BenchError::Verify(format!(
                "rank {} sent {} bytes of completion instants, expected {}",
                msg.source(),
                msg.len(),
                instants.len() * 8
            )));
        }
        let v = msg
            .data()
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8-byte chunk")))
            .collect();
        done.push(v);
    }
    Ok(Some(skew_medians(instants, &done)))
}

/// Sums every rank's multicast broadcast counters on rank 0 and words them as a comment line;
/// `None` elsewhere and when no rank ran a multicast broadcast (a point-to-point algorithm, or
/// fewer ranks than `RANKWEAVE_MCAST_MIN_RANKS`). It shows what the timings went through:
/// fragments that arrived by multicast, and those that stage 2 or a NACK had to repair.
async fn gather_mcast_counters(comm: &Communicator) -> Result<Option<String>> {
    let mine: [u64; 7] = match comm.multicast_stats() {
        Some(s) => [
            1,
            s.multicast_sent,
            s.multicast_received,
            s.ring_repaired,
            s.nacks_sent,
            s.sync_repairs,
            s.failovers,
        ],
        None => [0; 7],
    };
    if comm.rank() != 0 {
        let bytes: Vec<u8> = mine.iter().flat_map(|v| v.to_le_bytes()).collect();
        comm.send(0, TAG_MCAST, bytes).await?;
        return Ok(None);
    }
    let mut sum = mine;
    let recvs: Vec<_> = (1..comm.size()).map(|r| comm.recv(r, TAG_MCAST)).collect();
    for r in recvs {
        let msg = r.await?;
        if msg.len() != 7 * 8 {
            return Err(BenchError::Verify(format!(
                "rank {} sent a {}-byte counter report, expected 56",
                msg.source(),
                msg.len()
            )));
        }
        for (acc, c) in sum.iter_mut().zip(msg.data().chunks_exact(8)) {
            *acc += u64::from_le_bytes(c.try_into().expect("8-byte chunk"));
        }
    }
    let [
        ranks,
        sent,
        received,
        repaired,
        nacks,
        sync_repairs,
        failovers,
    ] = sum;
    if ranks == 0 {
        return Ok(None);
    }
    Ok(Some(format!(
        "# multicast counters (sum over {ranks} ranks, warm-up included): {sent} fragments \
         multicast, {received} first received by multicast, {repaired} repaired over \
         point-to-point, {nacks} NACKs, {sync_repairs} sync repairs, {failovers} fail-overs"
    )))
}
