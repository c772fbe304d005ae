//! The per-message cost of the UDP path, made countable: two in-process ranks over UDP
//! (spin progress policy, 2 tokio workers) ping-pong `SIZE`-byte messages, reliability on or
//! off; prints the one-way latency and the datagrams rank 0 sent per round trip (DATA, RTS,
//! CTS and standalone ACKs).
//!
//! ```text
//! cargo bench --bench udp_round_trip -- 1 20000 on      # SIZE ITERATIONS on|off
//! bench/callgrind-udp 1 3000 on                          # instructions per message
//! ```
//!
//! Wall-clock time on a VM drifts (see `udp_vs_plain` for interleaved comparisons); the
//! instruction counts `bench/callgrind-udp` takes from this program do not. The book's
//! reliability chapter ("Measured so far") has the method and the history.

use std::time::Instant;

use bytes::Bytes;
use rankweave::{Config, ProgressPolicy, TransportKind};

/// Round trips before the clock starts.
const WARMUP: usize = 1000;

/// `n` round trips between ranks 0 and 1 (after the warm-up); kept out of line so callgrind
/// can count them alone. Returns rank 0's one-way latency in µs and datagrams sent.
#[inline(never)]
fn round_trips(size: usize, n: usize, reliability: bool) -> (f64, u64) {
    let config = Config {
        transport: TransportKind::Udp,
        reliability: Some(reliability),
        progress: ProgressPolicy::Spin,
        ..Config::from_env().expect("RANKWEAVE_* settings")
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let out = runtime.block_on(async move {
        rankweave::local_with(config, 2, move |comm| async move {
            let payload = Bytes::from(vec![1u8; size]);
            let other = 1 - comm.rank();
            let mut start = Instant::now();
            for i in 0..WARMUP + n {
                if i == WARMUP {
                    start = Instant::now();
                }
                if comm.rank() == 0 {
                    comm.send(other, 0, payload.clone()).await.expect("send");
                    comm.recv(other, 0).await.expect("recv");
                } else {
                    let m = comm.recv(other, 0).await.expect("recv");
                    comm.send(other, 0, m.into_data()).await.expect("send");
                }
            }
            let one_way = start.elapsed().as_secs_f64() * 1e6 / (2.0 * n as f64);
            let sent = comm
                .stats()
                .transport
                .routes
                .iter()
                .map(|r| r.frames_sent)
                .sum();
            (one_way, sent)
        })
        .await
        .expect("job")
    });
    out[0]
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let number = |i: usize, default: usize| args.get(i).map_or(Ok(default), |a| a.parse());
    let (Ok(size), Ok(n)) = (number(0, 1), number(1, 20_000)) else {
        eprintln!("usage: udp_round_trip [SIZE [ITERATIONS [on|off]]]");
        std::process::exit(2);
    };
    let reliability = match args.get(2).map(String::as_str) {
        None | Some("on") => true,
        Some("off") => false,
        Some(other) => {
            eprintln!("udp_round_trip: reliability is on or off, not {other:?}");
            std::process::exit(2);
        }
    };
    let (one_way, sent) = round_trips(size, n, reliability);
    let per_round_trip = sent as f64 / (WARMUP + n) as f64;
    println!(
        "size {size} reliability {}: {one_way:.2} µs one way, {per_round_trip:.2} datagrams sent per round trip by rank 0",
        if reliability { "on" } else { "off" }
    );
}
