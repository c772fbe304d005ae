//! Point-to-point benchmarks: latency, bw, bibw (ranks 0 and 1) and mr (pairs), after OSU 7.x's
//! osu_latency, osu_bw, osu_bibw and osu_mbw_mr.
//!
//! As in OSU, each size starts with a barrier of all ranks, every timed iteration is timed on
//! its own and the times are summed, and each rank sends one buffer per size over and over (one
//! `Bytes`, cloned by reference count: zero-copy in process, as OSU reuses its `s_buf`).

use std::time::{Duration, Instant};

use bytes::Bytes;
use rankweave::{Collectives, Communicator, Message, RecvOp, SendOp, Status};

use crate::cli::Options;
use crate::error::{BenchError, Result};
use crate::report::{Reporter, Row};

/// osu_latency's tag.
const TAG_LATENCY: u32 = 1;
/// osu_bw's and osu_mbw_mr's data and ack tags.
const TAG_DATA: u32 = 100;
const TAG_ACK: u32 = 101;
/// osu_bibw's tag for rank 1 → rank 0 (rank 0 → rank 1 uses `TAG_DATA`).
const TAG_BACK: u32 = 10;
/// The ack of bw and mr: 4 bytes, as OSU's `MPI_Send(s_buf, 4, MPI_CHAR, ...)`.
const ACK_LEN: usize = 4;

/// The buffer every message of one size is sent from, filled with 'a' as OSU's.
fn payload(size: usize) -> Bytes {
    send_buffer(size, b'a')
}

/// A send buffer of `len` bytes of `fill`, starting on a page boundary. OSU programs send from
/// page-aligned buffers (`posix_memalign` to the page size) that live as long as the program;
/// so do these (leaked): their `Bytes` clone and drop without the atomic reference count of a
/// shared buffer, which costs more than the rest of a small send's bookkeeping. Made once per
/// size, so the leak is bounded by the sum of the sizes run (and a page each).
pub(crate) fn send_buffer(len: usize, fill: u8) -> Bytes {
    Bytes::from_static(page_aligned(len, fill))
}

/// `len` bytes of `fill` starting on a page boundary, for the rest of the program (as
/// [`send_buffer`]: a leak bounded by the sizes run).
fn page_aligned(len: usize, fill: u8) -> &'static mut [u8] {
    const PAGE: usize = 4096;
    let whole = Vec::leak(vec![fill; len + PAGE]);
    let skip = whole.as_ptr().align_offset(PAGE).min(PAGE);
    &mut whole[skip..skip + len]
}

fn check_len(msg: &Message, expected: usize, what: &str) -> Result<()> {
    check_status(&msg.status(), expected, what)
}

fn check_status(status: &Status, expected: usize, what: &str) -> Result<()> {
    if status.len != expected {
        return Err(BenchError::Verify(format!(
            "{what}: rank received {} bytes from rank {}, expected {expected}",
            status.len, status.source
        )));
    }
    Ok(())
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// Ping-pong between ranks 0 and 1; one-way latency = round trip / 2, in µs. Each rank
/// receives into a buffer of its own, as osu_latency's `MPI_Recv` does (`recv_into`: a small
/// message is copied from the transport straight there).
pub async fn latency(comm: &Communicator, opts: &Options, out: &mut Reporter) -> Result<()> {
    let me = comm.rank();
    for size in opts.sizes() {
        let (iters, skip) = opts.loops(size);
        let buf = payload(size);
        // Page-aligned, as OSU's receive buffer.
        let rbuf = page_aligned(size, 0);
        comm.barrier().await?;
        let mut total = Duration::ZERO;
        match me {
            0 => {
                for i in 0..iters + skip {
                    let t = Instant::now();
                    comm.send(1, TAG_LATENCY, buf.clone()).await?;
                    let pong = comm.recv_into(1, TAG_LATENCY, rbuf).await?;
                    if i >= skip {
                        total += t.elapsed();
                    }
                    check_status(&pong, size, "latency")?;
                }
            }
            1 => {
                for _ in 0..iters + skip {
                    let ping = comm.recv_into(0, TAG_LATENCY, rbuf).await?;
                    check_status(&ping, size, "latency")?;
                    comm.send(0, TAG_LATENCY, buf.clone()).await?;
                }
            }
            _ => {}
        }
        if me == 0 {
            let us = secs(total) * 1e6 / (2.0 * iters as f64);
            out.row(Row::sized(size, vec![us]));
        }
    }
    Ok(())
}

/// Sends one window to `dst` and waits for all of it, then for `dst`'s 4-byte ack.
async fn send_window(
    comm: &Communicator,
    dst: usize,
    buf: &Bytes,
    window: usize,
    sends: &mut Vec<SendOp>,
) -> Result<()> {
    sends.extend((0..window).map(|_| comm.send(dst, TAG_DATA, buf.clone())));
    for s in sends.drain(..) {
        s.await?;
    }
    comm.recv(dst, TAG_ACK).await?;
    Ok(())
}

/// Posts one window of receives from `src`, waits for all of them, then sends the ack.
async fn recv_window(
    comm: &Communicator,
    src: usize,
    size: usize,
    ack: &Bytes,
    window: usize,
    recvs: &mut Vec<RecvOp>,
) -> Result<()> {
    recvs.extend((0..window).map(|_| comm.recv(src, TAG_DATA)));
    for r in recvs.drain(..) {
        check_len(&r.await?, size, "bandwidth")?;
    }
    comm.send(src, TAG_ACK, ack.clone()).await?;
    Ok(())
}

/// osu_bw: rank 0 sends windows of `-W` messages to rank 1, which acks each window.
pub async fn bw(comm: &Communicator, opts: &Options, out: &mut Reporter) -> Result<()> {
    let me = comm.rank();
    let window = opts.window;
    let ack = payload(ACK_LEN);
    let mut sends = Vec::with_capacity(window);
    let mut recvs = Vec::with_capacity(window);
    for size in opts.sizes() {
        let (iters, skip) = opts.loops(size);
        let buf = payload(size);
        comm.barrier().await?;
        let mut total = Duration::ZERO;
        match me {
            0 => {
                for i in 0..iters + skip {
                    let t = Instant::now();
                    send_window(comm, 1, &buf, window, &mut sends).await?;
                    if i >= skip {
                        total += t.elapsed();
                    }
                }
            }
            1 => {
                for _ in 0..iters + skip {
                    recv_window(comm, 0, size, &ack, window, &mut recvs).await?;
                }
            }
            _ => {}
        }
        if me == 0 {
            let mb = size as f64 / 1e6 * iters as f64 * window as f64;
            out.row(Row::sized(size, vec![mb / secs(total)]));
        }
    }
    Ok(())
}

/// osu_bibw: both ranks post a window of receives, then a window of sends, and wait for both;
/// no ack. Bandwidth counts both directions.
pub async fn bibw(comm: &Communicator, opts: &Options, out: &mut Reporter) -> Result<()> {
    let me = comm.rank();
    let window = opts.window;
    let mut sends: Vec<SendOp> = Vec::with_capacity(window);
    let mut recvs: Vec<RecvOp> = Vec::with_capacity(window);
    for size in opts.sizes() {
        let (iters, skip) = opts.loops(size);
        let buf = payload(size);
        comm.barrier().await?;
        let mut total = Duration::ZERO;
        if me <= 1 {
            let peer = 1 - me;
            // OSU's tags: 0 → 1 uses 100, 1 → 0 uses 10.
            let (send_tag, recv_tag) = if me == 0 {
                (TAG_DATA, TAG_BACK)
            } else {
                (TAG_BACK, TAG_DATA)
            };
            for i in 0..iters + skip {
                let t = Instant::now();
                recvs.extend((0..window).map(|_| comm.recv(peer, recv_tag)));
                sends.extend((0..window).map(|_| comm.send(peer, send_tag, buf.clone())));
                if me == 0 {
                    for s in sends.drain(..) {
                        s.await?;
                    }
                    for r in recvs.drain(..) {
                        check_len(&r.await?, size, "bibw")?;
                    }
                } else {
                    for r in recvs.drain(..) {
                        check_len(&r.await?, size, "bibw")?;
                    }
                    for s in sends.drain(..) {
                        s.await?;
                    }
                }
                if i >= skip {
                    total += t.elapsed();
                }
            }
        }
        if me == 0 {
            let mb = size as f64 / 1e6 * iters as f64 * window as f64 * 2.0;
            out.row(Row::sized(size, vec![mb / secs(total)]));
        }
    }
    Ok(())
}

/// osu_mbw_mr: ranks `0..pairs` send windows to ranks `pairs..2*pairs` (pairs = size / 2),
/// with a barrier of all ranks before every iteration; rank 0's time gives the aggregate
/// bandwidth (MB/s) and message rate (messages/s), as in OSU.
pub async fn mr(comm: &Communicator, opts: &Options, out: &mut Reporter) -> Result<()> {
    let me = comm.rank();
    let pairs = comm.size() / 2;
    let window = opts.window;
    let ack = payload(ACK_LEN);
    let mut sends = Vec::with_capacity(window);
    let mut recvs = Vec::with_capacity(window);
    for size in opts.sizes() {
        let (iters, skip) = opts.loops(size);
        let buf = payload(size);
        comm.barrier().await?;
        let mut total = Duration::ZERO;
        for i in 0..iters + skip {
            comm.barrier().await?;
            if me < pairs {
                let t = Instant::now();
                send_window(comm, me + pairs, &buf, window, &mut sends).await?;
                if i >= skip {
                    total += t.elapsed();
                }
            } else if me < 2 * pairs {
                recv_window(comm, me - pairs, size, &ack, window, &mut recvs).await?;
            }
        }
        if me == 0 {
            let mb = size as f64 / 1e6 * pairs as f64 * iters as f64 * window as f64;
            let bw = mb / secs(total);
            let rate = 1e6 * bw / size as f64;
            out.row(Row::sized(size, vec![bw, rate]));
        }
    }
    Ok(())
}
