//! The multicast broadcasts over real IP multicast (loopback) between in-process ranks with
//! shared-memory point-to-point: every rank gets the root's bytes at any multicast loss rate.

use bytes::Bytes;
use rankweave_collectives::Collectives;
use rankweave_core::tuning::BcastAlgorithm;
use rankweave_core::{ChaosSpec, Communicator, Config};

fn config(algorithm: BcastAlgorithm, loss: Option<&str>) -> Config {
    let mut c = Config::default();
    c.collectives.bcast = Some(algorithm);
    c.multicast.min_ranks = 2;
    c.multicast.channels = 4;
    c.multicast.fragment = Some(4096);
    c.multicast.chaos = loss.map(|spec| ChaosSpec::parse(spec).expect("chaos spec"));
    c
}

fn payload(b: usize, len: usize) -> Bytes {
    Bytes::from(
        (0..len)
            .map(|i| (i as u8).wrapping_mul(13).wrapping_add(b as u8))
            .collect::<Vec<u8>>(),
    )
}

async fn run(config: Config, n: usize, rounds: usize) -> Vec<rankweave_collectives::BcastStats> {
    let comms = rankweave_transports::shm::world(n, &config).expect("world");
    let tasks: Vec<_> = comms
        .into_iter()
        .map(|comm: Communicator| {
            tokio::spawn(async move {
                for b in 0..rounds {
                    let root = b % comm.size();
                    let len = [0, 1, 8, 5000, 70_000][b % 5];
                    let mine = if comm.rank() == root {
                        payload(b, len)
                    } else {
                        Bytes::new()
                    };
                    let got = comm.broadcast(root, mine).await.expect("broadcast");
                    assert_eq!(got, payload(b, len), "rank {} broadcast {b}", comm.rank());
                }
                comm.multicast_stats().expect("the engine ran")
            })
        })
        .collect();
    let mut stats = Vec::new();
    for t in tasks {
        stats.push(t.await.expect("rank"));
    }
    stats
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
