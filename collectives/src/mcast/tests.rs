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

mod departures {
    use std::time::{Duration, Instant};

    use bytes::Bytes;

    use super::super::assembly::Assembly;
    use super::super::channels::Channels;
    use super::super::two_stage::TwoStage;
    use super::super::wire::{Algorithm, Keys, Packet};
    use super::super::{Protocol, Settings};

    const KEYS: Keys = Keys {
        job_key: 7,
        context: 0,
    };

    fn settings() -> Settings {
        Settings {
            fragment: 100,
            early_limit: 1 << 20,
            root_delay: Duration::ZERO,
            sync: false,
            channels: 2,
            nack_timeout: Duration::from_millis(2),
            retries: 3,
        }
    }

    fn fragments(bid: u64, root: u32, len: usize, algorithm: Algorithm) -> Vec<Bytes> {
        let asm = Assembly::whole(bid, root, &Bytes::from(vec![5u8; len]), settings().fragment);
        (0..asm.count)
            .filter_map(|seq| asm.fragment(bid, seq))
            .map(|f| Packet::Fragment(f).encode(KEYS, algorithm))
            .collect()
    }

    /// A late rank that already holds all of an unstarted broadcast from the ring needs nothing
    /// more from its predecessor, which may leave; one still missing a fragment does need it.
    #[test]
    fn two_stage_needs_its_predecessor_only_for_missing_ring_fragments() {
        let now = Instant::now();
        let mut late = TwoStage::new(2, 3, KEYS, settings());
        let frags = fragments(0, 0, 250, Algorithm::TwoStage);
        assert_eq!(frags.len(), 3);
        late.handle_packet(now, 1, &frags[0]);
        late.handle_packet(now, 1, &frags[1]);
        assert!(late.expects_from(1), "one ring fragment still to come");
        assert!(
            !late.expects_from(0),
            "the root sends it nothing point-to-point"
        );
        late.handle_packet(now, 1, &frags[2]);
        assert!(!late.expects_from(1), "the ring brought everything");
        late.start(now, 0, 0, None);
        assert!(matches!(
            late.poll_event(),
            Some(super::super::Event::Complete { bid: 0, .. })
        ));
    }

    /// A rank waiting for its sync-down needs its sync parent, not the manager that already
    /// sent it down and left; the root of a broadcast it reported missing may leave too.
    #[test]
    fn channels_wait_for_the_sync_parent_not_for_ranks_done_with_them() {
        let now = Instant::now();
        // Rank 3 of 4: its parent in the tree rooted at 0 is 2.
        let mut m = Channels::new(3, 4, KEYS, settings());
        m.start(now, 0, 1, None);
        assert!(
            m.expects_from(1),
            "nothing arrived: it may have to NACK the root"
        );
        m.owner_gone(now);
        assert!(
            m.expects_from(2),
            "sync-up sent, sync-down due from the parent"
        );
        assert!(
            !m.expects_from(0),
            "the manager reaches rank 3 through rank 2"
        );
        assert!(
            !m.expects_from(1),
            "reported missing in the sync: the repair comes down the tree"
        );
    }
}
