//! The UDP transport with the reliability layer, end to end: real sockets, in-process ranks.

mod common;

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{Lcg, assert_pattern, pattern, within, within_showing};
use rankweave::{Communicator, Config, Source, Tag, TransportKind};
use rankweave_core::{Carrier, ChaosSpec, Transport};
use rankweave_transports::chaos::ChaosCarrier;
use rankweave_transports::link::{LinkTransport, LinkTransportConfig};
use rankweave_transports::udp::{self, UdpCarrier, UdpSettings};

type ChaosUdp = LinkTransport<ChaosCarrier<UdpCarrier>>;

/// A job of `n` ranks over UDP with every rank's routes wrapped in a chaos carrier; returns the
/// communicators and the transports (to read chaos counters and flip routes).
fn chaos_job(
    n: u32,
    routes: &[IpAddr],
    spec: &ChaosSpec,
    config: &Config,
) -> (Vec<Communicator>, Vec<Arc<ChaosUdp>>) {
    let settings = UdpSettings {
        routes: routes.to_vec(),
        ..UdpSettings::default()
    };
    let carriers = udp::bind_job(n, &settings).expect("bind");
    let key = rankweave_core::rng::random_u64();
    let mut comms = Vec::new();
    let mut transports = Vec::new();
    for (rank, c) in (0u32..).zip(carriers) {
        let mut spec = spec.clone();
        spec.seed = spec.seed.wrapping_add(u64::from(rank) * 7919);
        let t = Arc::new(LinkTransport::new(
            ChaosCarrier::new(c, spec),
            LinkTransportConfig::new(rank, n, key),
        ));
        transports.push(Arc::clone(&t));
        comms.push(Communicator::world(rank as usize, n as usize, t, config.clone()).unwrap());
    }
    (comms, transports)
}

fn udp_config(reliability: bool) -> Config {
    Config {
        transport: TransportKind::Udp,
        reliability: Some(reliability),
        ..Config::default()
    }
}

/// Every pair exchanges messages of sizes from 0 B to 4 MiB, checked byte for byte.
async fn all_pairs_exchange(comms: Vec<Communicator>, sizes: &'static [usize]) {
    let mut tasks = tokio::task::JoinSet::new();
    for comm in comms {
        tasks.spawn(async move {
            let (me, n) = (comm.rank(), comm.size());
            for peer in (0..n).filter(|&p| p != me) {
                let c = comm.clone();
                let sender = tokio::spawn(async move {
                    for (i, &len) in sizes.iter().enumerate() {
                        let seed = (me * 1000 + peer * 10) as u64 + i as u64;
                        c.send(peer, i as u32, Bytes::from(pattern(seed, len)))
                            .await
                            .unwrap();
                    }
                });
                for (i, &len) in sizes.iter().enumerate() {
                    let m = comm
                        .recv(Source::Rank(peer), Tag::Value(i as u32))
                        .await
                        .unwrap();
                    assert_pattern(m.data(), (peer * 1000 + me * 10) as u64 + i as u64, len);
                }
                sender.await.unwrap();
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
}

const SIZES: &[usize] = &[0, 1, 1000, 60_000, 65_536, 100_000, 1 << 20, 4 << 20];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_with_reliability_delivers_every_size() {
    let comms = udp::world(3, &udp_config(true)).unwrap();
    within(all_pairs_exchange(comms.clone(), SIZES)).await;
    let s = comms[0].stats();
    assert!(s.transport.reliability);
    assert!(s.transport.routes[0].frames_sent > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn udp_without_reliability_delivers_on_a_lossless_loopback() {
    let comms = udp::world(3, &udp_config(false)).unwrap();
    within_showing(&comms, all_pairs_exchange(comms.clone(), SIZES)).await;
    let s = comms[1].stats();
    assert!(!s.transport.reliability);
    assert_eq!(s.transport.retransmissions, 0);
    assert!(s.transport.routes[0].frames_received > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_jobs_run_over_udp_when_asked() {
    let out = rankweave::local_with(udp_config(true), 4, |comm| async move {
        let n = comm.size();
        let next = (comm.rank() + 1) % n;
        let prev = (comm.rank() + n - 1) % n;
        let m = comm
            .sendrecv(
                next,
                5,
                Bytes::from(vec![comm.rank() as u8; 3]),
                Source::Rank(prev),
                Tag::Value(5),
            )
            .await
            .unwrap();
        (m.data()[0] as usize, comm.stats().transport.reliability)
    });
    let out = within(out).await.unwrap();
    for (rank, (got, reliable)) in out.into_iter().enumerate() {
        assert_eq!(got, (rank + 3) % 4);
        assert!(reliable);
    }
}

/// The acceptance test: 4 ranks, 20 000+ messages of 0 B to 4 MiB, through 5% loss, 1%
/// corruption, 2% duplication and reordering; every payload checked; the counters show the
/// injected faults were seen and repaired.
/// With nobody busy-polling, lost packets are sent again only by the progress task's timer.
/// Between messages the ranks sit idle (no deadline: the timer waits far away), and each send
/// brings the parked task's timer forward by resetting it, without waking the task; a lost
/// packet must still be retransmitted when that timer fires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_parked_ranks_retransmit_lost_packets_on_their_timers() {
    let spec = ChaosSpec::parse("seed=5,loss=0.3").unwrap();
    let config = Config {
        progress: rankweave::ProgressPolicy::Park,
        ..Config::default()
    };
    let (comms, transports) = chaos_job(2, &[IpAddr::from([127, 0, 0, 1])], &spec, &config);
    let (a, b) = (comms[0].clone(), comms[1].clone());
    within(async move {
        for i in 0..30u64 {
            // Long enough for both progress tasks to park with nothing in flight.
            tokio::time::sleep(Duration::from_millis(3)).await;
            let (sent, got) =
                tokio::join!(a.send(1, 7, Bytes::from(pattern(i, 100))), b.recv(0, 7));
            sent.expect("send");
            assert_pattern(got.expect("recv").data(), i, 100);
        }
    })
    .await;
    let lost: u64 = transports.iter().map(|t| t.carrier().stats().dropped).sum();
    let resent: u64 = comms
        .iter()
        .map(|c| c.stats().transport.retransmissions)
        .sum();
    // (Lost ACKs are not resent: later packets carry the acknowledgement again.)
    assert!(
        lost > 0 && resent > 0,
        "packets were lost ({lost}) and resent ({resent})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_thousand_messages_survive_loss_corruption_duplication_and_reordering() {
    const N: u32 = 4;
    const PER_PAIR: u64 = 1667; // 12 ordered pairs: 20 004 messages
    let spec = ChaosSpec::parse("seed=11,loss=0.05,corrupt=0.01,dup=0.02,reorder=0.05").unwrap();
    let (comms, transports) = chaos_job(
        N,
        &[IpAddr::from([127, 0, 0, 1])],
        &spec,
        &Config::default(),
    );

    /// The size of message `i` from `src` to `dst`: mostly small, some medium, a few up to 4 MiB
    /// (the first is always 0 B and the second 4 MiB).
    fn size_of(src: usize, dst: usize, i: u64) -> usize {
        match i {
            0 => 0,
            1 => 4 << 20,
            _ => {
                let mut g = Lcg((src * 131 + dst) as u64 * 1_000_003 + i);
                match g.below(1000) {
                    0..=899 => g.below(2048) as usize,
                    900..=997 => g.below(256 * 1024) as usize,
                    _ => (1 << 20) + g.below(3 << 20) as usize,
                }
            }
        }
    }

    let run = async {
        let mut tasks = tokio::task::JoinSet::new();
        for comm in comms.clone() {
            tasks.spawn(async move {
                let me = comm.rank();
                let mut pairs = tokio::task::JoinSet::new();
                for peer in (0..comm.size()).filter(|&p| p != me) {
                    let c = comm.clone();
                    pairs.spawn(async move {
                        for i in 0..PER_PAIR {
                            let len = size_of(me, peer, i);
                            let seed = ((me * 16 + peer) as u64) << 32 | i;
                            c.send(peer, 3, Bytes::from(pattern(seed, len)))
                                .await
                                .unwrap();
                        }
                    });
                    let c = comm.clone();
                    pairs.spawn(async move {
                        for i in 0..PER_PAIR {
                            let m = c.recv(Source::Rank(peer), Tag::Value(3)).await.unwrap();
                            let seed = ((peer * 16 + me) as u64) << 32 | i;
                            assert_pattern(m.data(), seed, size_of(peer, me, i));
                        }
                    });
                }
                while let Some(r) = pairs.join_next().await {
                    r.unwrap();
                }
            });
        }
        while let Some(r) = tasks.join_next().await {
            r.unwrap();
        }
    };
    if tokio::time::timeout(
        Duration::from_secs(
            std::env::var("RW_DEBUG_T")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(300),
        ),
        run,
    )
    .await
    .is_err()
    {
        for (t, c) in transports.iter().zip(&comms) {
            eprintln!(
                "rank {}: {:?}\n  chaos {:?}",
                c.rank(),
                c.stats(),
                t.carrier().stats()
            );
            eprintln!("{}", t.describe_links());
        }
        panic!("the exchange did not finish within 300 s");
    }

    let mut injected = (0, 0, 0, 0);
    let mut repaired = (0, 0, 0);
    for (t, comm) in transports.iter().zip(&comms) {
        let c = t.carrier().stats();
        injected.0 += c.dropped;
        injected.1 += c.corrupted;
        injected.2 += c.duplicated;
        injected.3 += c.reordered;
        let s = comm.stats().transport;
        repaired.0 += s.retransmissions;
        repaired.1 += s.crc_failures;
        repaired.2 += s.duplicates_dropped;
    }
    eprintln!("injected (lost, corrupted, duplicated, reordered) = {injected:?}");
    eprintln!("repaired (retransmissions, crc failures, duplicates dropped) = {repaired:?}");
    assert!(injected.0 > 100 && injected.1 > 10 && injected.2 > 20 && injected.3 > 20);
    // Every loss and corruption needs a retransmission; duplicates are recognised.
    assert!(
        repaired.0 >= injected.0 / 2,
        "retransmissions {} for {} losses",
        repaired.0,
        injected.0
    );
    assert!(repaired.1 > 0 && repaired.2 > 0);
    // No storms: retransmissions stay within a small multiple of the faults injected.
    assert!(
        repaired.0 <= 4 * (injected.0 + injected.1) + 1000,
        "retransmission storm: {} retransmissions for {} losses and {} corruptions",
        repaired.0,
        injected.0,
        injected.1
    );
}

/// Two routes; route 1 dies in the middle of a 64 MiB transfer, which completes over route 0;
/// then route 1 comes back and carries traffic again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_dying_mid_transfer_fails_over_and_comes_back() {
    let routes = [IpAddr::from([127, 0, 0, 1]), IpAddr::from([127, 0, 0, 2])];
    let (comms, transports) = chaos_job(2, &routes, &ChaosSpec::seeded(1), &Config::default());
    const LEN: usize = 64 << 20;
    let data = Bytes::from(pattern(64, LEN));

    let sender = comms[0].clone();
    let send = tokio::spawn(async move { sender.send(1, 1, data).await.unwrap() });
    // Operations start when called: the receive is posted now, so the rendezvous goes ahead.
    let recv = comms[1].recv(Source::Rank(0), Tag::Value(1));
    // Take route 1 down (both ranks, both directions) once a quarter of the data went out.
    let t0 = Arc::clone(&transports[0]);
    let killer = tokio::spawn(async move {
        let start = Instant::now();
        loop {
            let s = t0.stats();
            let sent: u64 = s.routes.iter().map(|r| r.bytes_sent).sum();
            if sent >= (LEN / 4) as u64 {
                break s.routes[1].bytes_sent;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "transfer never started"
            );
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
    });
    let on_route1_before_failure = within(killer).await.unwrap();
    transports[0].carrier().set_route_up(1, false);
    transports[1].carrier().set_route_up(1, false);
    let m = within(recv).await.unwrap();
    assert_pattern(m.data(), 64, LEN);
    within(send).await.unwrap();
    let s = comms[0].stats().transport;
    assert!(
        on_route1_before_failure > 0,
        "route 1 carried nothing before the failure"
    );
    assert!(s.route_failovers >= 1, "no failover counted: {s:?}");
    assert!(s.routes[1].failovers >= 1);

    // Bring route 1 back: a probe finds it, and it carries traffic again.
    transports[0].carrier().set_route_up(1, true);
    transports[1].carrier().set_route_up(1, true);
    let recovered = within(async {
        loop {
            // Keep some traffic going so the links run their timers.
            comms[0]
                .send(1, 2, Bytes::from_static(b"tick"))
                .await
                .unwrap();
            comms[1].recv(Source::Rank(0), Tag::Value(2)).await.unwrap();
            if comms[0].stats().transport.route_recoveries >= 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    recovered.await;
    // A recovered route restarts its congestion window from the bottom, so how much of one
    // message it takes depends on timing; it must take a real share within a few messages.
    let before = comms[0].stats().transport.routes[1].bytes_sent;
    let mut carried = 0;
    for round in 0..8u32 {
        let again = Bytes::from(pattern(65 + u64::from(round), 8 << 20));
        let c0 = comms[0].clone();
        let tag = 3 + round;
        let send = tokio::spawn(async move { c0.send(1, tag, again).await.unwrap() });
        let m = within(comms[1].recv(Source::Rank(0), Tag::Value(tag)))
            .await
            .unwrap();
        assert_pattern(m.data(), 65 + u64::from(round), 8 << 20);
        within(send).await.unwrap();
        carried = comms[0].stats().transport.routes[1].bytes_sent - before;
        if carried > 1 << 20 {
            break;
        }
    }
    assert!(
        carried > 1 << 20,
        "route 1 carried only {carried} bytes after recovery"
    );
}

/// Random bytes, packets of another job and datagrams from strangers fired at a live endpoint
/// are dropped and counted; the job is unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_and_random_datagrams_are_dropped_and_counted() {
    let (comms, transports) = chaos_job(
        2,
        &[IpAddr::from([127, 0, 0, 1])],
        &ChaosSpec::seeded(0),
        &Config::default(),
    );
    let target = transports[1].carrier().inner().local_addrs()[0];
    let stranger = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let mut g = Lcg(99);
    // A well-formed packet of another job, from a stranger.
    let foreign = rankweave_core::reliability::Packet {
        job_key: 0xdead_beef,
        source: 0,
        destination: 1,
        body: rankweave_core::reliability::PacketBody::Raw {
            payload: Bytes::from_static(b"hi").into(),
        },
    }
    .encode();
    let fire = |g: &mut Lcg| {
        for _ in 0..200 {
            let len = g.below(2000) as usize;
            let junk: Vec<u8> = (0..len).map(|_| g.next() as u8).collect();
            stranger.send_to(&junk, target).unwrap();
        }
        stranger.send_to(&foreign, target).unwrap();
        // The same from a member of the job: junk is malformed, the other job's key foreign.
        let member = transports[0].carrier().inner();
        for _ in 0..50 {
            let len = g.below(2000) as usize;
            let junk: Vec<u8> = (0..len).map(|_| g.next() as u8).collect();
            member.send(0, 1, &[&junk]).unwrap();
        }
        member.send(0, 1, &[&foreign]).unwrap();
    };
    fire(&mut g);
    let run = async {
        for i in 0..200u32 {
            if i % 50 == 0 {
                fire(&mut g);
            }
            let len = (i as usize * 997) % 70_000;
            let c0 = comms[0].clone();
            let send = tokio::spawn(async move {
                c0.send(1, 0, Bytes::from(pattern(u64::from(i), len)))
                    .await
                    .unwrap()
            });
            let m = comms[1].recv(Source::Rank(0), Tag::Any).await.unwrap();
            assert_pattern(m.data(), u64::from(i), len);
            send.await.unwrap();
        }
    };
    within(run).await;
    let s = comms[1].stats().transport;
    // From strangers everything is foreign (5 × 201), plus the other job's packets from rank 0.
    assert_eq!(s.foreign_dropped, 5 * 201 + 5, "{s:?}");
    assert_eq!(s.malformed_dropped, 5 * 50, "{s:?}");
    assert_eq!(comms[1].stats().protocol_errors, 0);
}

/// osu_bw's pattern: windows of 64 concurrent 1 MiB sends against 64 posted receives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_of_concurrent_large_sends_complete() {
    let (comms, transports) = chaos_job(
        2,
        &[IpAddr::from([127, 0, 0, 1])],
        &ChaosSpec::seeded(0),
        &Config::from_env().unwrap(),
    );
    let run = async {
        for w in 0..3u64 {
            let receiver = comms[1].clone();
            let recvs = tokio::spawn(async move {
                let rs: Vec<_> = (0..64)
                    .map(|_| receiver.recv(Source::Rank(0), Tag::Value(1)))
                    .collect();
                for (i, r) in rs.into_iter().enumerate() {
                    let m = r.await.unwrap();
                    assert_pattern(m.data(), w * 100 + i as u64, 1 << 20);
                }
            });
            let sends: Vec<_> = (0..64u64)
                .map(|i| comms[0].send(1, 1, Bytes::from(pattern(w * 100 + i, 1 << 20))))
                .collect();
            for s in sends {
                s.await.unwrap();
            }
            recvs.await.unwrap();
        }
    };
    if tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .is_err()
    {
        for (t, c) in transports.iter().zip(&comms) {
            eprintln!("rank {}: {:?}", c.rank(), c.stats());
            eprintln!("{}", t.describe_links());
        }
        panic!("windows of 1 MiB sends did not finish within 60 s");
    }
}
