//! In-process point-to-point against a tokio `mpsc` baseline, interleaved in one run.
//!
//! `cargo bench --bench inproc_vs_tokio` (add `-- --rounds 5` for more repetitions, `--quick` for
//! a smoke run, `--rate-only` to skip the latency measurements, say under a profiler). Every measurement gets a fresh 2-worker tokio runtime. The configurations run
//! in turn (A B C A B C …) so the VM's drifting vCPU placement hits all of them alike; the
//! report gives medians over the rounds and ratios against the tokio channel.
//!
//! * one-way latency: ping-pong, round trip / 2, at 8 B, 1 KiB, 1 MiB;
//! * message rate: 8-byte messages streamed from one rank to the other (receiver posts windows
//!   of 64 receives), messages per second. Baseline: a bounded tokio channel (capacity 1024,
//!   back-pressure like rankweave's credits); an unbounded channel is shown too, with its ratio
//!   to the bounded one.

#[path = "support/mod.rs"]
mod support;
use support::{median, runtime};

use std::time::{Duration, Instant};

use bytes::Bytes;
use rankweave::{Config, ProgressPolicy};
use tokio::sync::mpsc;

const SIZES: [usize; 3] = [8, 1024, 1 << 20];
const WINDOW: usize = 64;

struct Plan {
    rounds: usize,
    latency_iters: usize,
    rate_messages: usize,
}

fn config(policy: ProgressPolicy) -> Config {
    Config {
        progress: policy,
        ..Config::from_env().expect("RANKWEAVE_* settings")
    }
}

/// One-way latency in µs of a rankweave ping-pong.
fn rankweave_latency(policy: ProgressPolicy, size: usize, iters: usize) -> f64 {
    runtime().block_on(async move {
        let out = rankweave::local_with(config(policy), 2, move |comm| async move {
            support::ping_pong(&comm, size, iters / 10, iters).await
        })
        .await
        .expect("job");
        out[0]
    })
}

/// One-way latency in µs of a tokio mpsc ping-pong between two tasks.
fn tokio_latency(size: usize, iters: usize) -> f64 {
    runtime().block_on(async move {
        let (to_b, mut at_b) = mpsc::channel::<Bytes>(1);
        let (to_a, mut at_a) = mpsc::channel::<Bytes>(1);
        let payload = Bytes::from(vec![1u8; size]);
        let warmup = iters / 10;
        let b = tokio::spawn(async move {
            while let Some(m) = at_b.recv().await {
                if to_a.send(m).await.is_err() {
                    break;
                }
            }
        });
        let mut start = Instant::now();
        for i in 0..warmup + iters {
            if i == warmup {
                start = Instant::now();
            }
            to_b.send(payload.clone()).await.expect("send");
            at_a.recv().await.expect("recv");
        }
        let us = start.elapsed().as_secs_f64() * 1e6 / (2.0 * iters as f64);
        drop(to_b);
        b.await.expect("echo task");
        us
    })
}

/// Messages per second streamed by rankweave, 8-byte payloads.
fn rankweave_rate(policy: ProgressPolicy, messages: usize) -> f64 {
    runtime().block_on(async move {
        let out = rankweave::local_with(config(policy), 2, move |comm| async move {
            let payload = Bytes::from_static(&[7u8; 8]);
            let start = Instant::now();
            if comm.rank() == 0 {
                for _ in 0..messages {
                    // Eager sends are complete as soon as they are started.
                    comm.send(1, 0, payload.clone()).await.expect("send");
                }
            } else {
                let mut left = messages;
                while left > 0 {
                    let n = left.min(WINDOW);
                    let window: Vec<_> = (0..n).map(|_| comm.recv(0, 0)).collect();
                    for r in window {
                        r.await.expect("recv");
                    }
                    left -= n;
                }
            }
            messages as f64 / start.elapsed().as_secs_f64()
        })
        .await
        .expect("job");
        out[1]
    })
}

/// Messages per second streamed through a tokio mpsc channel (capacity 1024).
fn tokio_rate(messages: usize) -> f64 {
    runtime().block_on(async move {
        let (tx, mut rx) = mpsc::channel::<Bytes>(1024);
        let payload = Bytes::from_static(&[7u8; 8]);
        let start = Instant::now();
        let sender = tokio::spawn(async move {
            for _ in 0..messages {
                tx.send(payload.clone()).await.expect("send");
            }
        });
        for _ in 0..messages {
            rx.recv().await.expect("recv");
        }
        sender.await.expect("sender");
        messages as f64 / start.elapsed().as_secs_f64()
    })
}

/// Messages per second streamed through an unbounded tokio mpsc channel (no back-pressure:
/// the sender never waits, so this is the channel's upper bound).
fn tokio_unbounded_rate(messages: usize) -> f64 {
    runtime().block_on(async move {
        let (tx, mut rx) = mpsc::unbounded_channel::<Bytes>();
        let payload = Bytes::from_static(&[7u8; 8]);
        let start = Instant::now();
        let sender = tokio::spawn(async move {
            for _ in 0..messages {
                tx.send(payload.clone()).expect("send");
            }
        });
        for _ in 0..messages {
            rx.recv().await.expect("recv");
        }
        sender.await.expect("sender");
        messages as f64 / start.elapsed().as_secs_f64()
    })
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let rate_only = args.iter().any(|a| a == "--rate-only");
    let rounds = args
        .iter()
        .position(|a| a == "--rounds")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(if quick { 1 } else { 5 });
    let plan = Plan {
        rounds,
        latency_iters: if quick { 200 } else { 20_000 },
        rate_messages: if quick { 10_000 } else { 2_000_000 },
    };
    let started = Instant::now();
    println!(
        "# in-process point-to-point vs tokio mpsc (2-worker runtime), {rounds} interleaved rounds"
    );
    println!(
        "# {:<22} {:>10} {:>12} {:>12} {:>10}",
        "measure", "size", "median", "min..max", "ratio"
    );
    for &size in SIZES.iter().filter(|_| !rate_only) {
        let iters = if size >= 1 << 20 {
            plan.latency_iters / 10
        } else {
            plan.latency_iters
        };
        let (mut spin, mut park, mut base) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..plan.rounds {
            spin.push(rankweave_latency(ProgressPolicy::Spin, size, iters));
            park.push(rankweave_latency(ProgressPolicy::Park, size, iters));
            base.push(tokio_latency(size, iters));
        }
        report("latency us tokio-mpsc", size, &mut base, None);
        let b = median(&mut base.clone());
        report("latency us spin", size, &mut spin, Some(b));
        report("latency us park", size, &mut park, Some(b));
    }
    let (mut spin, mut park, mut hybrid, mut base) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut unbounded = Vec::new();
    for _ in 0..plan.rounds {
        unbounded.push(tokio_unbounded_rate(plan.rate_messages) / 1e6);
        spin.push(rankweave_rate(ProgressPolicy::Spin, plan.rate_messages) / 1e6);
        park.push(rankweave_rate(ProgressPolicy::Park, plan.rate_messages) / 1e6);
        hybrid.push(rankweave_rate(ProgressPolicy::SpinThenPark, plan.rate_messages) / 1e6);
        base.push(tokio_rate(plan.rate_messages) / 1e6);
    }
    report("rate Mmsg/s tokio-mpsc", 8, &mut base, None);
    let b = median(&mut base.clone());
    report("rate Mmsg/s tokio-unbnd", 8, &mut unbounded, Some(b));
    report("rate Mmsg/s spin", 8, &mut spin, Some(b));
    report("rate Mmsg/s park", 8, &mut park, Some(b));
    report("rate Mmsg/s spin-park", 8, &mut hybrid, Some(b));
    println!(
        "# total {:.1?}",
        started.elapsed().max(Duration::from_millis(1))
    );
}

fn report(name: &str, size: usize, samples: &mut [f64], baseline: Option<f64>) {
    let lo = samples.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = samples.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let m = median(samples);
    let ratio = baseline.map_or("-".to_string(), |b| format!("{:.2}x", m / b));
    println!(
        "{:<24} {:>10} {:>12.3} {:>5.2}..{:<6.2} {:>10}",
        name, size, m, lo, hi, ratio
    );
}
