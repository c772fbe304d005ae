//! Pieces the benchmark programs share (included with `#[path]`; not a bench target itself).
#![allow(dead_code)]

/// A fresh 2-worker tokio runtime with IO and time, one per measurement.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// The median of `v` (sorted in place); NaN when empty.
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Ranks 0 and 1 of `comm` ping-pong `size`-byte messages (rank 1 echoes what it received):
/// `warmup` untimed round trips, then `iters` timed ones. Returns this rank's one-way latency
/// in µs (round trip / 2).
pub async fn ping_pong(
    comm: &rankweave::Communicator,
    size: usize,
    warmup: usize,
    iters: usize,
) -> f64 {
    let payload = bytes::Bytes::from(vec![1u8; size]);
    let other = 1 - comm.rank();
    let mut start = std::time::Instant::now();
    for i in 0..warmup + iters {
        if i == warmup {
            start = std::time::Instant::now();
        }
        if comm.rank() == 0 {
            comm.send(other, 0, payload.clone()).await.expect("send");
            comm.recv(other, 0).await.expect("recv");
        } else {
            let m = comm.recv(other, 0).await.expect("recv");
            comm.send(other, 0, m.into_data()).await.expect("send");
        }
    }
    start.elapsed().as_secs_f64() * 1e6 / (2.0 * iters as f64)
}

/// The program's arguments that are not `--` options (the benchmark harness passes `--bench`).
pub fn positional_args() -> Vec<String> {
    std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect()
}

/// Positional argument `i` parsed as a number, `default` when absent.
pub fn number_arg(
    args: &[String],
    i: usize,
    default: usize,
) -> Result<usize, std::num::ParseIntError> {
    args.get(i).map_or(Ok(default), |a| a.parse())
}
