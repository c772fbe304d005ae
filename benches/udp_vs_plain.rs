//! rankweave over UDP against a plain busy-polling UDP ping-pong, interleaved in one run.
//!
//! `cargo bench --bench udp_vs_plain` (`-- --rounds 7` for more repetitions, `--quick` for a
//! smoke run). Configurations run in turn (A B C A B C …) so the VM's drifting vCPU placement
//! hits all of them alike; the report gives medians over the rounds and ratios.
//!
//! * **latency** (one-way, round trip / 2) at 1 B, 1 KiB, 64 KiB, 1 MiB: a plain UDP ping-pong
//!   between two threads busy-polling non-blocking sockets (messages above one datagram are cut
//!   into 65 000-byte datagrams, sent back to back), against rankweave over UDP with the
//!   reliability layer on and off (spin progress policy, 2 in-process ranks, 2 tokio workers).
//! * **bandwidth** at 64 KiB, 1 MiB, 4 MiB, osu_bw style (windows of 64 sends, then a 1-byte
//!   reply): reliability on, off, and on under 1% injected loss.
//!
//! `--latency` or `--bandwidth` runs only that part.
//!
//! Ratios: latency against plain UDP; "cost" = on / off − 1 (latency) or 1 − on / off
//! (bandwidth); under loss, against the lossless figure of the same round. Latency ratios are
//! the median of each round's own ratio (the configurations of a round ran back to back, in
//! reverse order every other round), which the VM's drift disturbs less than a ratio of
//! medians; the absolute columns are medians.

#[path = "support/mod.rs"]
mod support;
use support::{median, runtime};

use std::net::UdpSocket;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rankweave::{Config, ProgressPolicy, TransportKind};
use rankweave_core::ChaosSpec;

const LAT_SIZES: [usize; 4] = [1, 1024, 64 << 10, 1 << 20];
const BW_SIZES: [usize; 3] = [64 << 10, 1 << 20, 4 << 20];
const WINDOW: usize = 64;
const DATAGRAM: usize = 65_000;

struct Plan {
    rounds: usize,
    quick: bool,
}

impl Plan {
    fn latency_iters(&self, size: usize) -> usize {
        let base = if self.quick { 200 } else { 20_000 };
        if size >= 1 << 20 {
            base / 50
        } else if size >= 64 << 10 {
            base / 5
        } else {
            base
        }
    }

    fn bw_windows(&self, size: usize) -> usize {
        let bytes = if self.quick { 64 << 20 } else { 512 << 20 };
        (bytes / (size * WINDOW)).max(2)
    }
}

fn udp_config(reliability: bool, chaos: Option<&str>) -> Config {
    Config {
        transport: TransportKind::Udp,
        reliability: Some(reliability),
        progress: ProgressPolicy::Spin,
        chaos: chaos.map(|s| ChaosSpec::parse(s).expect("chaos spec")),
        ..Config::from_env().expect("RANKWEAVE_* settings")
    }
}

/// Sends `len` bytes as back-to-back datagrams of at most [`DATAGRAM`] bytes.
fn plain_send(s: &UdpSocket, buf: &[u8], len: usize) {
    let mut off = 0;
    loop {
        let n = (len - off).min(DATAGRAM);
        loop {
            match s.send(&buf[..n.max(1)]) {
                Ok(_) => break,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
                Err(e) => panic!("send: {e}"),
            }
        }
        off += n;
        if off >= len {
            return;
        }
    }
}

/// Busy-polls until `len` bytes (at least one datagram) arrived.
fn plain_recv(s: &UdpSocket, buf: &mut [u8], len: usize) {
    let mut got = 0;
    loop {
        match s.recv(buf) {
            Ok(n) => {
                got += n;
                if got >= len.max(1) {
                    return;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) => panic!("recv: {e}"),
        }
    }
}

/// One-way latency in µs of a plain busy-polling UDP ping-pong between two threads.
fn plain_latency(size: usize, iters: usize) -> f64 {
    let a = UdpSocket::bind("127.0.0.1:0").unwrap();
    let b = UdpSocket::bind("127.0.0.1:0").unwrap();
    for s in [&a, &b] {
        s.set_nonblocking(true).unwrap();
        let sock = socket2::SockRef::from(s);
        let _ = sock.set_recv_buffer_size(16 << 20);
        let _ = sock.set_send_buffer_size(16 << 20);
    }
    a.connect(b.local_addr().unwrap()).unwrap();
    b.connect(a.local_addr().unwrap()).unwrap();
    let warmup = iters / 10;
    let echo = std::thread::spawn(move || {
        let mut buf = vec![0u8; DATAGRAM.max(size)];
        for _ in 0..warmup + iters {
            plain_recv(&b, &mut buf, size);
            plain_send(&b, &buf, size);
        }
    });
    let mut buf = vec![1u8; DATAGRAM.max(size)];
    let mut start = Instant::now();
    for i in 0..warmup + iters {
        if i == warmup {
            start = Instant::now();
        }
        plain_send(&a, &buf.clone(), size);
        plain_recv(&a, &mut buf, size);
    }
    let t = start.elapsed().as_secs_f64() * 1e6 / (2.0 * iters as f64);
    echo.join().unwrap();
    t
}

/// One-way latency in µs of a rankweave ping-pong over UDP.
fn rankweave_latency(config: Config, size: usize, iters: usize) -> f64 {
    runtime().block_on(async move {
        let out = rankweave::local_with(config, 2, move |comm| async move {
            support::ping_pong(&comm, size, iters / 10, iters).await
        })
        .await
        .expect("job");
        out[0]
    })
}

/// osu_bw-style bandwidth in MB/s (10^6 bytes per second); NaN if the run did not finish in
/// [`BW_TIME_LIMIT`] (without reliability, datagrams the kernel dropped are never resent).
fn rankweave_bandwidth(config: Config, size: usize, windows: usize) -> f64 {
    runtime().block_on(async move {
        let job = rankweave::local_with(config, 2, move |comm| async move {
            let payload = Bytes::from(vec![7u8; size]);
            let other = 1 - comm.rank();
            let warmup = 1;
            let mut start = Instant::now();
            for w in 0..warmup + windows {
                if w == warmup {
                    start = Instant::now();
                }
                if comm.rank() == 0 {
                    let sends: Vec<_> = (0..WINDOW)
                        .map(|_| comm.send(other, 1, payload.clone()))
                        .collect();
                    for s in sends {
                        s.await.expect("send");
                    }
                    comm.recv(other, 2).await.expect("ack");
                } else {
                    let recvs: Vec<_> = (0..WINDOW).map(|_| comm.recv(other, 1)).collect();
                    for r in recvs {
                        r.await.expect("recv");
                    }
                    comm.send(other, 2, Bytes::from_static(b"k"))
                        .await
                        .expect("ack");
                }
            }
            (size * WINDOW * windows) as f64 / start.elapsed().as_secs_f64() / 1e6
        });
        match tokio::time::timeout(BW_TIME_LIMIT, job).await {
            Ok(out) => out.expect("job")[0],
            Err(_) => {
                eprintln!(
                    "  (a {} bandwidth run did not finish: datagrams lost)",
                    size_name(size)
                );
                f64::NAN
            }
        }
    })
}

/// How long one bandwidth run may take.
const BW_TIME_LIMIT: Duration = Duration::from_secs(60);

fn size_name(size: usize) -> String {
    match size {
        s if s >= 1 << 20 => format!("{} MiB", s >> 20),
        s if s >= 1 << 10 => format!("{} KiB", s >> 10),
        s => format!("{s} B"),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let rounds = args
        .iter()
        .position(|a| a == "--rounds")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(if quick { 1 } else { 5 });
    let plan = Plan { rounds, quick };
    let flag = |f: &str| args.iter().any(|a| a == f);
    let (latency, bandwidth) = match (flag("--latency"), flag("--bandwidth")) {
        (false, false) => (true, true),
        (l, b) => (l, b),
    };
    // The benchmark harness passes `--bench`; ignore anything else.

    println!("# rankweave over UDP vs plain UDP ({rounds} rounds, medians)");
    println!();
    println!("## One-way latency (µs)");
    println!();
    println!(
        "| size | plain UDP | reliability on | ratio | reliability off | ratio | cost of reliability |"
    );
    println!("|---|---|---|---|---|---|---|");
    for size in LAT_SIZES.into_iter().filter(|_| latency) {
        let iters = plan.latency_iters(size);
        let (mut plain, mut on, mut off) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..plan.rounds {
            // Odd rounds run in reverse order, so a drift within a round favours no one.
            let mut order = [0, 1, 2];
            if round % 2 == 1 {
                order.reverse();
            }
            for which in order {
                match which {
                    0 => plain.push(plain_latency(size, iters)),
                    1 => on.push(rankweave_latency(udp_config(true, None), size, iters)),
                    _ => off.push(rankweave_latency(udp_config(false, None), size, iters)),
                }
            }
        }
        // Ratios are taken within each round (the three ran side by side), then their median.
        let ratio = |a: &[f64], b: &[f64]| {
            let mut r: Vec<f64> = a.iter().zip(b).map(|(x, y)| x / y).collect();
            median(&mut r)
        };
        let (on_plain, off_plain, on_off) =
            (ratio(&on, &plain), ratio(&off, &plain), ratio(&on, &off));
        let (p, n, f) = (median(&mut plain), median(&mut on), median(&mut off));
        println!(
            "| {} | {p:.2} | {n:.2} | {on_plain:.2}× | {f:.2} | {off_plain:.2}× | {:+.1}% |",
            size_name(size),
            (on_off - 1.0) * 100.0
        );
    }
    println!();
    println!("## Bandwidth (MB/s, window {WINDOW})");
    println!();
    println!(
        "| size | reliability on | reliability off | cost of reliability | on, 1% loss | vs lossless |"
    );
    println!("|---|---|---|---|---|---|");
    for size in BW_SIZES.into_iter().filter(|_| bandwidth) {
        let windows = plan.bw_windows(size);
        let (mut on, mut off, mut lossy) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..plan.rounds {
            on.push(rankweave_bandwidth(udp_config(true, None), size, windows));
            // Without reliability a window of 64 × 4 MiB overflows loopback socket buffers and the
            // lost frames are never resent: the run would hang, so that cell is not measured.
            off.push(if size <= 1 << 20 {
                rankweave_bandwidth(udp_config(false, None), size, windows)
            } else {
                f64::NAN
            });
            let spec = format!("seed={round},loss=0.01");
            lossy.push(rankweave_bandwidth(
                udp_config(true, Some(&spec)),
                size,
                windows,
            ));
            eprintln!(
                "  bandwidth {} round {round}: on {:.0}, off {:.0}, 1% loss {:.0} MB/s",
                size_name(size),
                on[round],
                off[round],
                lossy[round]
            );
        }
        let (n, f, l) = (median(&mut on), median(&mut off), median(&mut lossy));
        println!(
            "| {} | {n:.0} | {f:.0} | {:+.1}% | {l:.0} | {:.0}% |",
            size_name(size),
            (1.0 - n / f) * 100.0,
            l / n * 100.0
        );
    }
}
