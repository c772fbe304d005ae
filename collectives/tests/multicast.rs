//! The multicast broadcasts over real IP multicast (loopback) between in-process ranks with
//! shared-memory point-to-point: every rank gets the root's bytes at any multicast loss rate.

mod common;

use rankweave_core::tuning::BcastAlgorithm;
use rankweave_core::{ChaosSpec, Config};

fn config(algorithm: BcastAlgorithm, loss: Option<&str>) -> Config {
    let mut c = Config::default();
    c.collectives.bcast = Some(algorithm);
    c.multicast.min_ranks = 2;
    c.multicast.channels = 4;
    c.multicast.fragment = Some(4096);
    c.multicast.chaos = loss.map(|spec| ChaosSpec::parse(spec).expect("chaos spec"));
    c
}

async fn run(config: Config, n: usize, rounds: usize) -> Vec<rankweave_collectives::BcastStats> {
    let comms = rankweave_transports::shm::world(n, &config).expect("world");
    common::broadcast_rounds(comms, rounds).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_stage_over_ip_multicast_at_any_loss() {
    for (loss, n) in [
        (None, 4),
        (Some("seed=3,loss=50%,corrupt=5%,reorder=10%"), 5),
        (Some("loss=100%"), 3),
    ] {
        let stats = run(config(BcastAlgorithm::Multicast, loss), n, 15).await;
        let repaired: u64 = stats.iter().map(|s| s.ring_repaired).sum();
        let by_multicast: u64 = stats.iter().map(|s| s.multicast_received).sum();
        match loss {
            None => assert!(by_multicast > 0, "{stats:?}"),
            Some(_) => assert!(repaired > 0, "stage 2 repaired: {stats:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channels_over_ip_multicast_at_any_loss() {
    for (loss, n) in [
        (None, 4),
        (Some("seed=5,loss=30%,corrupt=5%"), 4),
        (Some("loss=100%"), 3),
    ] {
        let stats = run(config(BcastAlgorithm::Channels, loss), n, 15).await;
        let syncs: u64 = stats.iter().map(|s| s.syncs).sum();
        assert!(syncs > 0, "channels synchronised: {stats:?}");
        if loss.is_some() {
            let repaired: u64 = stats.iter().map(|s| s.ring_repaired).sum();
            let mcast_resent: u64 = stats.iter().map(|s| s.nacks_received).sum();
            assert!(repaired + mcast_resent > 0, "{stats:?}");
        }
    }
}
