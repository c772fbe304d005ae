//! Striping: large-message bandwidth over two rate-limited routes against one, interleaved.
//!
//! Needs the namespaces of `bench/netns/striping.sh up [RATE]` (two "hosts" joined by two veth
//! "adapters", each limited to RATE with tc htb); without them it prints why and exits 0.
//! `cargo bench --bench striping` (`-- --rounds 5`, `--quick`).
//!
//! Rank 0's sockets live in namespace rwA and rank 1's in rwB (a thread enters the namespace,
//! binds, and leaves: a socket stays in the namespace it was created in), so both ranks are
//! tasks of this process while their traffic crosses the veth pairs and their qdiscs. One
//! configuration uses route 1 only; the other stripes over routes 1 and 2.

#[path = "support/mod.rs"]
mod support;
use support::median;

use std::fs::File;
use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use rankweave::{Communicator, Config, ProgressPolicy};
use rankweave_transports::link::{LinkTransport, LinkTransportConfig};
use rankweave_transports::udp::{UdpCarrier, UdpSettings};

const WINDOW: usize = 16;

fn ns_path(ns: &str) -> String {
    format!("/var/run/netns/{ns}")
}

/// Binds rank `rank`'s routes inside network namespace `ns`.
fn bind_in(ns: &str, rank: u32, settings: &UdpSettings, rt: &tokio::runtime::Handle) -> UdpCarrier {
    std::thread::scope(|s| {
        s.spawn(|| {
            let _enter = rt.enter();
            let f = File::open(ns_path(ns)).expect("namespace");
            // SAFETY: setns on this (scoped, short-lived) thread only changes which network
            // namespace its new sockets are created in; the fd is valid for the call.
            let r = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(r, 0, "setns {ns}: {}", std::io::Error::last_os_error());
            UdpCarrier::bind(rank, settings).expect("bind")
        })
        .join()
        .expect("bind thread")
    })
}

fn job(routes: usize, rt: &tokio::runtime::Handle) -> Vec<Communicator> {
    let addr = |side: u8, r: usize| IpAddr::from([10, 77, r as u8 + 1, side]);
    let settings = |side: u8| UdpSettings {
        routes: (0..routes).map(|r| addr(side, r)).collect(),
        // Small kernel buffers: the reliability window, not a deep socket queue, limits what
        // is in flight on a slow route.
        socket_buffer: 1 << 20,
        ..UdpSettings::default()
    };
    let a = bind_in("rwA", 0, &settings(1), rt);
    let b = bind_in("rwB", 1, &settings(2), rt);
    a.add_peer(1, &b.local_addrs());
    b.add_peer(0, &a.local_addrs());
    let key = rankweave_core::rng::random_u64();
    let config = Config {
        progress: ProgressPolicy::SpinThenPark,
        ..Config::from_env().expect("RANKWEAVE_* settings")
    };
    let _enter = rt.enter();
    [a, b]
        .into_iter()
        .enumerate()
        .map(|(rank, c)| {
            let t = Arc::new(LinkTransport::new(
                c,
                LinkTransportConfig::new(rank as u32, 2, key),
            ));
            Communicator::world(rank, 2, t, config.clone()).expect("world")
        })
        .collect()
}

/// osu_bw-style bandwidth in MB/s over `routes` routes.
fn bandwidth(routes: usize, size: usize, windows: usize) -> (f64, Vec<u64>) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let comms = job(routes, rt.handle());
    rt.block_on(async move {
        let receiver = comms[1].clone();
        let recv = tokio::spawn(async move {
            for _ in 0..windows + 1 {
                let rs: Vec<_> = (0..WINDOW).map(|_| receiver.recv(0, 1)).collect();
                for r in rs {
                    r.await.expect("recv");
                }
                receiver
                    .send(0, 2, Bytes::from_static(b"k"))
                    .await
                    .expect("ack");
            }
        });
        let payload = Bytes::from(vec![3u8; size]);
        let mut start = Instant::now();
        for w in 0..windows + 1 {
            if w == 1 {
                start = Instant::now();
            }
            let ss: Vec<_> = (0..WINDOW)
                .map(|_| comms[0].send(1, 1, payload.clone()))
                .collect();
            for s in ss {
                s.await.expect("send");
            }
            comms[0].recv(1, 2).await.expect("ack");
        }
        let mbs = (size * WINDOW * windows) as f64 / start.elapsed().as_secs_f64() / 1e6;
        recv.await.expect("receiver");
        let per_route = comms[0]
            .stats()
            .transport
            .routes
            .iter()
            .map(|r| r.bytes_sent)
            .collect();
        (mbs, per_route)
    })
}

fn main() {
    if !std::path::Path::new(&ns_path("rwA")).exists() {
        println!(
            "skipped: the striping namespaces are not set up (run bench/netns/striping.sh up)"
        );
        return;
    }
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let rounds = args
        .iter()
        .position(|a| a == "--rounds")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(if quick { 1 } else { 5 });
    let size = 4 << 20;
    let windows = if quick { 2 } else { 6 };
    let (mut one, mut two) = (Vec::new(), Vec::new());
    let mut split = Vec::new();
    for _ in 0..rounds {
        one.push(bandwidth(1, size, windows).0);
        let (bw, per_route) = bandwidth(2, size, windows);
        two.push(bw);
        split = per_route;
    }
    let (o, t) = (median(&mut one), median(&mut two));
    println!("# Striping over rate-limited veth routes ({rounds} rounds, medians, 4 MiB messages)");
    println!();
    println!("| routes | bandwidth (MB/s) | ratio |");
    println!("|---|---|---|");
    println!("| 1 | {o:.1} | 1.00× |");
    println!("| 2 | {t:.1} | {:.2}× |", t / o);
    let total: u64 = split.iter().sum();
    let shares: Vec<String> = split
        .iter()
        .map(|b| format!("{:.0}%", *b as f64 * 100.0 / total.max(1) as f64))
        .collect();
    println!();
    println!(
        "bytes per route in the last two-route run: {}",
        shares.join(" / ")
    );
}
