use std::time::Duration;

use bytes::Bytes;
use rankweave_core::{ChaosSpec, GroupId, MulticastConfig, MulticastFabric, MulticastGroup};

use super::*;

fn fabric(rank: u32) -> IpMulticast {
    IpMulticast::new(&MulticastConfig::default(), rank)
}

/// Drains `group` until `want` datagrams came or a second passed.
async fn collect(group: &dyn MulticastGroup, want: usize) -> Vec<Bytes> {
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
    while got.len() < want && tokio::time::Instant::now() < deadline {
        group.drain(&mut got, 64).unwrap();
        if got.len() < want {
            let _ = tokio::time::timeout(
                Duration::from_millis(10),
                std::future::poll_fn(|cx| group.poll_readable(cx)),
            )
            .await;
        }
    }
    got
}

#[test]
fn groups_map_inside_the_prefix_and_port_range() {
    let f = fabric(0);
    for id in [0u64, 1, u64::MAX, 0x1234_5678_9abc_def0] {
        let a = f.address_of(GroupId(id));
        let ip = u32::from(*a.ip());
        assert_eq!(
            ip >> 18,
            u32::from(Ipv4Addr::new(239, 192, 0, 0)) >> 18,
            "{a}"
        );
        assert!((46000..47024).contains(&a.port()), "{a}");
    }
}

#[tokio::test]
async fn every_member_gets_each_datagram_and_other_groups_stay_apart() {
    let id = GroupId(rankweave_core::rng::random_u64());
    let other = GroupId(id.0 ^ 1);
    let members: Vec<_> = (0..3).map(|r| fabric(r).join(id).unwrap()).collect();
    let stranger = fabric(9).join(other).unwrap();
    let big = Bytes::from(vec![7u8; 60_000]);
    members[0].send(b"hello").unwrap();
    members[1].send(&big).unwrap();
    for m in &members {
        let got = collect(m.as_ref(), 2).await;
        assert_eq!(got.len(), 2, "every member, the sender included, gets both");
        assert_eq!(&got[0][..], b"hello");
        assert_eq!(got[1], big);
    }
    assert!(collect(stranger.as_ref(), 1).await.is_empty());
    let s = members[0].stats();
    assert_eq!((s.datagrams_sent, s.datagrams_received), (1, 2));
}

#[tokio::test]
async fn chaos_drops_per_receiver() {
    let id = GroupId(rankweave_core::rng::random_u64());
    let config = MulticastConfig {
        chaos: Some(ChaosSpec::parse("seed=1,loss=50%").unwrap()),
        ..MulticastConfig::default()
    };
    let lossy: Vec<_> = (0..2)
        .map(|r| IpMulticast::new(&config, r).join(id).unwrap())
        .collect();
    let clean = fabric(5).join(id).unwrap();
    for i in 0..200u32 {
        clean.send(&i.to_le_bytes()).unwrap();
    }
    let all = collect(clean.as_ref(), 200).await;
    assert_eq!(all.len(), 200);
    let a = collect(lossy[0].as_ref(), 200).await;
    let b = collect(lossy[1].as_ref(), 200).await;
    for got in [&a, &b] {
        assert!(
            (50..150).contains(&got.len()),
            "about half lost: {}",
            got.len()
        );
    }
    assert_ne!(a, b, "ranks lose different datagrams");
    assert_eq!(
        lossy[0].stats().faults_injected as usize,
        200 - a.len(),
        "every loss counted"
    );
}
