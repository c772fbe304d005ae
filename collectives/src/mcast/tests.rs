//! The machines on the simulated network: every rank gets the root's bytes whatever multicast
//! does, and the repairs show in the counters.

use std::time::Duration;

use super::sim::{SimAlgorithm, SimConfig, simulate};

fn check(algorithm: SimAlgorithm, config: &SimConfig) -> super::BcastStats {
    let report = simulate(algorithm, config);
    for (b, per_rank) in report.data.iter().enumerate() {
        let root = if config.rotate_root {
            b % config.ranks
        } else {
            0
        };
        let expected = &per_rank[root];
        assert_eq!(
            expected.len(),
            config.bytes,
            "{algorithm:?} root data of {b}"
        );
        for (r, got) in per_rank.iter().enumerate() {
            assert!(
                report.done[b][r] != Duration::MAX,
                "{algorithm:?} {config:?}: rank {r} never completed broadcast {b}"
            );
            assert_eq!(got, expected, "{algorithm:?}: rank {r}, broadcast {b}");
        }
    }
    assert!(
        report.settled,
        "{algorithm:?} {config:?}: a machine still owes something"
    );
    report.stats
}

#[test]
fn both_algorithms_deliver_at_any_loss_rate() {
    for algorithm in [SimAlgorithm::TwoStage, SimAlgorithm::Channels] {
        for loss in [0.0, 0.1, 0.5, 1.0] {
            for (ranks, bytes) in [(2, 8), (5, 0), (7, 20_000), (16, 100)] {
                let config = SimConfig {
                    ranks,
                    bytes,
                    broadcasts: 19,
                    rotate_root: true,
                    loss,
                    fragment: 8192,
                    channels: 4,
                    seed: ranks as u64 * 31 + (loss * 100.0) as u64,
                    ..SimConfig::default()
                };
                let stats = check(algorithm, &config);
                if loss == 0.0 {
                    assert_eq!(
                        stats.ring_repaired, 0,
                        "{algorithm:?} repaired without loss"
                    );
                } else if loss == 1.0 {
                    assert_eq!(stats.multicast_received, 0);
                    assert!(stats.ring_repaired > 0);
                }
                if algorithm == SimAlgorithm::Channels {
                    assert!(stats.syncs > 0, "channels synchronised");
                    if loss == 1.0 && ranks > 2 {
                        assert!(stats.failovers > 0, "{ranks} ranks failed over");
                    }
                }
            }
        }
    }
}

#[test]
fn corruption_reordering_and_late_ranks_are_repaired() {
    for algorithm in [SimAlgorithm::TwoStage, SimAlgorithm::Channels] {
        let config = SimConfig {
            ranks: 9,
            bytes: 30_000,
            broadcasts: 12,
            rotate_root: true,
            loss: 0.05,
            corrupt: 0.2,
            reorder: 0.3,
            fragment: 4096,
            channels: 3,
            late: vec![
                Duration::ZERO,
                Duration::from_millis(3),
                Duration::ZERO,
                Duration::from_micros(500),
            ],
            seed: 99,
            ..SimConfig::default()
        };
        let stats = check(algorithm, &config);
        assert!(
            stats.crc_failures > 0,
            "{algorithm:?} saw corrupted datagrams"
        );
        assert!(stats.ring_repaired > 0);
    }
}

#[test]
fn multicast_latency_stays_flat_while_the_tree_grows() {
    let at = |algorithm, ranks| {
        let config = SimConfig {
            ranks,
            bytes: 8,
            ..SimConfig::default()
        };
        simulate(algorithm, &config)
    };
    let small = at(SimAlgorithm::TwoStage, 4).latency(0);
    let large = at(SimAlgorithm::TwoStage, 1024).latency(0);
    let tree_small = at(SimAlgorithm::Binomial, 4).latency(0);
    let tree_large = at(SimAlgorithm::Binomial, 1024).latency(0);
    // One multicast reaches everyone: 1024 ranks cost what 4 do, within a few sends.
    assert!(large < small * 2, "two-stage {small:?} -> {large:?}");
    // log2 grows from 2 to 10 rounds.
    assert!(
        tree_large > tree_small * 4,
        "tree {tree_small:?} -> {tree_large:?}"
    );
    assert!(
        at(SimAlgorithm::TwoStage, 1024).skew(0) * 4 < at(SimAlgorithm::Binomial, 1024).skew(0)
    );
}
