//! The software cost of the shared-memory small-message path, made countable: two
//! shared-memory ranks on one current-thread runtime ping-pong `SIZE`-byte messages, with both
//! transports kept in busy-poll mode (no doorbell signal is ever sent), so every instruction
//! executed inside [`round_trips`] is one rank's work on the path and none is waiting.
//!
//! ```text
//! cargo bench --bench shm_round_trip -- 1 100000        # SIZE ITERATIONS [miss|into|barrier|bcast|allreduce|window]
//! bench/callgrind-shm 1                                  # instructions per round trip
//! bench/callgrind-shm 1 3000 into                        # ... receiving with recv_into
//! bench/callgrind-shm 0 3000 barrier                     # ... per 2-rank barrier
//! bench/callgrind-shm 8 3000 bcast                       # ... per 2-rank 8-byte broadcast
//! bench/callgrind-shm 8 3000 allreduce                   # ... per 2-rank 8-byte all-reduce
//! bench/callgrind-shm 1 6400 window                      # ... per message of osu_bw's windows
//! ```
//!
//! With `miss`, each receive is polled once before its message is sent, as a waiting rank's
//! is: one failed check and one spin burst. With `barrier`, each iteration is a barrier of
//! the two ranks (`SIZE` unused): the collective path's cost next to the point-to-point one, in
//! instructions. (Its wall-clock time is not a barrier's: with both ranks on one thread, a
//! rank that waits spins its whole burst before the other can run.) Wall-clock time is printed too, but on a VM it
//! drifts; callgrind's instruction count (`bench/callgrind-shm`) does not. The book's
//! Performance chapter ("Counting the small-message path") has the method and the history.

#[path = "support/mod.rs"]
mod support;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rankweave::{Collectives, Communicator, Config};
use rankweave_core::{ProgressPolicy, Transport};
use rankweave_transports::shm::{LocalSegments, ShmTransport};

/// Polls `r` once, expecting it to wait (its message is not sent yet).
async fn poll_once_pending(r: &mut rankweave_core::RecvOp) {
    std::future::poll_fn(|cx| {
        assert!(
            Pin::new(&mut *r).poll(cx).is_pending(),
            "nothing was sent yet"
        );
        Poll::Ready(())
    })
    .await;
}

/// `n` round trips between ranks 0 and 1; kept out of line so callgrind can count it alone.
/// With `Mode::Barrier`, `n` barriers of the two ranks instead (the collective path: one
/// message each way, plus starting, running and finishing a collective on each rank).
#[inline(never)]
async fn round_trips(c: &[Communicator], buf: &Bytes, n: usize, mode: Mode) {
    if mode == Mode::Barrier {
        for _ in 0..n {
            let (a, b) = tokio::join!(c[0].barrier(), c[1].barrier());
            a.expect("barrier");
            b.expect("barrier");
        }
        return;
    }
    if mode == Mode::Window {
        // osu_bw's pattern: a window of receives posted, a window of sends, then every
        // receive awaited (`n` windows of WINDOW messages; the count is per message).
        let mut recvs = Vec::with_capacity(WINDOW);
        for _ in 0..n / WINDOW {
            recvs.extend((0..WINDOW).map(|_| c[1].recv(0usize, 1u32)));
            for _ in 0..WINDOW {
                c[0].send(1, 1, buf.clone()).await.expect("send");
            }
            for r in recvs.drain(..) {
                assert_eq!(r.await.expect("recv").len(), buf.len());
            }
        }
        return;
    }
    if mode == Mode::Allreduce {
        // SIZE bytes of f32 (8 bytes: the benchmark's 2-element vector), as osu_allreduce.
        let mine = vec![1.0f32; (buf.len() / 4).max(1)];
        let sum = vec![2.0f32; mine.len()];
        for _ in 0..n {
            let (a, b) = tokio::join!(
                c[0].all_reduce(&mine[..], rankweave::Op::Sum),
                c[1].all_reduce(&mine[..], rankweave::Op::Sum)
            );
            assert_eq!(a.expect("all_reduce"), sum);
            assert_eq!(b.expect("all_reduce"), sum);
        }
        return;
    }
    if mode == Mode::Bcast {
        for _ in 0..n {
            // Rank 0's broadcast finishes at its first look (an eager send); rank 1's takes
            // the message in.
            let (a, b) = tokio::join!(
                c[0].broadcast(0, buf.clone()),
                c[1].broadcast(0, Bytes::new())
            );
            a.expect("broadcast");
            assert_eq!(b.expect("broadcast").len(), buf.len());
        }
        return;
    }
    if mode == Mode::Into {
        // As osu_latency's `MPI_Recv`: each receive into a buffer of the rank's own.
        let mut bufs = [vec![0u8; buf.len()], vec![0u8; buf.len()]];
        for _ in 0..n {
            for (from, to) in [(0usize, 1usize), (1, 0)] {
                let [b0, b1] = &mut bufs;
                let dst = if to == 0 { b0 } else { b1 };
                let r = c[to].recv_into(from, 1u32, &mut dst[..]);
                c[from].send(to, 1, buf.clone()).await.expect("send");
                assert_eq!(r.await.expect("recv_into").len, buf.len());
            }
        }
        return;
    }
    let miss = mode == Mode::Miss;
    for _ in 0..n {
        for (from, to) in [(0usize, 1usize), (1, 0)] {
            let mut r = c[to].recv(from, 1u32);
            if miss {
                poll_once_pending(&mut r).await;
            }
            c[from].send(to, 1, buf.clone()).await.expect("send");
            let m = r.await.expect("recv");
            assert_eq!(m.len(), buf.len());
        }
    }
}

/// Messages per window in `Mode::Window` (osu_bw's default).
const WINDOW: usize = 64;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Each message is there when its receive is first polled.
    Hit,
    /// Each receive is polled once before its message is sent.
    Miss,
    /// As `Hit`, each receive into a buffer of its own (`recv_into`).
    Into,
    /// Barriers instead of round trips.
    Barrier,
    /// Broadcasts of `SIZE` bytes from rank 0 instead of round trips.
    Bcast,
    /// All-reduces of two `f32`s (8 bytes; `SIZE` unused) instead of round trips.
    Allreduce,
    /// Windows of one-way messages, as `osu_bw` sends them (ITERATIONS messages in all).
    Window,
}

fn main() {
    let args = support::positional_args();
    let (Ok(size), Ok(n)) = (
        support::number_arg(&args, 0, 1),
        support::number_arg(&args, 1, 100_000),
    ) else {
        eprintln!(
            "usage: shm_round_trip [SIZE [ITERATIONS [miss|into|barrier|bcast|allreduce|window]]]"
        );
        std::process::exit(2);
    };
    let mode = match args.get(2).map(String::as_str) {
        None => Mode::Hit,
        Some("miss") => Mode::Miss,
        Some("into") => Mode::Into,
        Some("barrier") => Mode::Barrier,
        Some("bcast") => Mode::Bcast,
        Some("allreduce") => Mode::Allreduce,
        Some("window") => Mode::Window,
        Some(other) => {
            eprintln!(
                "shm_round_trip: unknown mode {other:?} (miss, into, barrier, bcast, allreduce or window)"
            );
            std::process::exit(2);
        }
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let mut config = Config::from_env().expect("RANKWEAVE_* settings");
        config.progress = ProgressPolicy::Spin;
        let segments = Arc::new(LocalSegments::default());
        let transports: Vec<Arc<ShmTransport>> = (0..2u32)
            .map(|rank| {
                let t = ShmTransport::new(
                    rank,
                    2,
                    config.shm,
                    Duration::from_secs(5),
                    segments.clone(),
                )
                .expect("shared-memory transport");
                segments.publish(rank, t.address());
                Arc::new(t)
            })
            .collect();
        // As while a rank busy-polls: doorbells stay disarmed, nobody is signalled.
        for t in &transports {
            t.begin_busy_poll();
        }
        let comms: Vec<Communicator> = transports
            .iter()
            .enumerate()
            .map(|(rank, t)| {
                let t: Arc<dyn Transport> = t.clone();
                Communicator::world(rank, 2, t, config.clone()).expect("communicator")
            })
            .collect();
        // A buffer that lives as long as the program, as rw-bench's: clones and drops of its
        // `Bytes` touch no reference count.
        let buf = Bytes::from_static(Vec::leak(vec![b'a'; size]));
        // Warm-up: connections, arenas, matching lists.
        round_trips(&comms, &buf, 100, mode).await;
        let start = Instant::now();
        round_trips(&comms, &buf, n, mode).await;
        let per = start.elapsed().as_nanos() as f64 / n as f64;
        println!("size {size}: {per:.1} ns per round trip (both ranks' work, one thread)");
        for t in &transports {
            t.end_busy_poll();
        }
    });
}
