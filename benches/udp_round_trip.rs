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

#[path = "support/mod.rs"]
mod support;
use support::number_arg;

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
            let one_way = support::ping_pong(&comm, size, WARMUP, n).await;
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
    let args = support::positional_args();
    let (Ok(size), Ok(n)) = (number_arg(&args, 0, 1), number_arg(&args, 1, 20_000)) else {
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
