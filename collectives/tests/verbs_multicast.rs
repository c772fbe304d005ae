//! The multicast broadcasts over the UD multicast route of the simulated InfiniBand fabric,
//! with point-to-point over adaptive verbs connections: every rank gets the root's bytes with
//! no loss, with the fabric losing a share of all UD datagrams (multicast and the UD
//! point-to-point path alike), and with every multicast datagram lost.

mod common;

use std::time::Duration;

use rankweave_collectives::BcastStats;
use rankweave_core::Config;
use rankweave_core::tuning::BcastAlgorithm;
use rankweave_transports::verbs::{AdaptiveSettings, simulated_adaptive_world};

fn config(algorithm: BcastAlgorithm) -> Config {
    let mut c = Config {
        peer_timeout: Duration::from_secs(30),
        ..Config::default()
    };
    c.collectives.bcast = Some(algorithm);
    c.multicast.min_ranks = 2;
    c.multicast.channels = 4;
    c
}

/// Loss: `None`, or per mille of every UD datagram; `u32::MAX`: every multicast datagram.
async fn run(config: Config, n: usize, rounds: usize, loss: Option<u32>) -> Vec<BcastStats> {
    let settings = AdaptiveSettings {
        connect_after: Some(32),
        ..AdaptiveSettings::default()
    };
    let job = simulated_adaptive_world(n, 1, &config, settings).expect("world");
    match loss {
        Some(u32::MAX) => {
            // The broadcast engine's datagrams, and nothing else, travel to multicast groups:
            // drop every datagram whose first byte is not the UD carrier's kind byte.
            job.fabric
                .drop_datagrams_matching(u32::MAX, |b| !matches!(b.first(), Some(b'L' | b'C')));
        }
        Some(per_mille) => job.fabric.set_datagram_loss(per_mille, 0x5eed),
        None => {}
    }
    tokio::time::timeout(
        Duration::from_secs(120),
        common::broadcast_rounds(job.comms, rounds),
    )
    .await
    .expect("broadcasts finished")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_stage_over_ud_multicast_with_and_without_loss() {
    for (loss, n) in [(None, 4), (Some(200), 5), (Some(u32::MAX), 3)] {
        let stats = run(config(BcastAlgorithm::Multicast), n, 15, loss).await;
        let by_multicast: u64 = stats.iter().map(|s| s.multicast_received).sum();
        let repaired: u64 = stats.iter().map(|s| s.ring_repaired).sum();
        match loss {
            None => assert!(by_multicast > 0, "{stats:?}"),
            Some(u32::MAX) => assert!(repaired > 0, "stage 2 repaired: {stats:?}"),
            Some(_) => assert!(by_multicast > 0 && repaired > 0, "{stats:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channels_over_ud_multicast_with_and_without_loss() {
    for (loss, n) in [(None, 4), (Some(150), 4), (Some(u32::MAX), 3)] {
        let stats = run(config(BcastAlgorithm::Channels), n, 15, loss).await;
        let syncs: u64 = stats.iter().map(|s| s.syncs).sum();
        assert!(syncs > 0, "channels synchronised: {stats:?}");
        let by_multicast: u64 = stats.iter().map(|s| s.multicast_received).sum();
        if loss.is_none() {
            assert!(by_multicast > 0, "{stats:?}");
        } else {
            let repaired: u64 = stats.iter().map(|s| s.ring_repaired).sum();
            let mcast_resent: u64 = stats.iter().map(|s| s.nacks_received).sum();
            assert!(repaired + mcast_resent > 0, "{stats:?}");
        }
    }
}
