//! Communicator isolation: `dup` and `split` create contexts whose traffic never matches
//! receives of another communicator, and `split` numbers ranks by key.

mod common;

use std::time::Duration;

use common::within;
use rankweave::{Error, Source, Tag};

/// Messages on a dup'ed communicator never match receives on the parent, and vice versa, even
/// with identical (source, tag) and with wildcard receives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dup_is_isolated_from_parent() {
    within(async {
        rankweave::local(2, |world| async move {
            let dup = world.dup().await.unwrap();
            assert_ne!(dup.context(), world.context());
            assert_eq!((dup.rank(), dup.size()), (world.rank(), world.size()));
            if world.rank() == 0 {
                // Phase 1: dup first, then world, same (source, tag).
                dup.send(1, 5, "dup-5").await.unwrap();
                world.send(1, 5, "world-5").await.unwrap();
                // Phase 2: after rank 1 posted receives on both.
                world.recv(1, 0).await.unwrap();
                world.send(1, 6, "world-6").await.unwrap();
                dup.send(1, 6, "dup-6").await.unwrap();
                // Phase 3: wildcard receive on world, a dup message comes first.
                world.recv(1, 0).await.unwrap();
                dup.send(1, 7, "dup-7").await.unwrap();
                world.send(1, 8, "world-8").await.unwrap();
                return;
            }
            // Phase 1: the world receive must skip the earlier dup message.
            let m = world.recv(0, 5).await.unwrap();
            assert_eq!(&m.data()[..], b"world-5");
            assert_eq!(world.iprobe(Source::Any, Tag::Any).unwrap(), None);
            let st = dup.iprobe(Source::Any, Tag::Any).unwrap().unwrap();
            assert_eq!((st.source, st.tag, st.len), (0, 5, 5));
            assert_eq!(&dup.recv(0, 5).await.unwrap().data()[..], b"dup-5");
            // Phase 2: a dup receive posted before the world receive must not take the world
            // message.
            let on_dup = dup.recv(0, 6);
            let on_world = world.recv(0, 6);
            world.send(0, 0, "go").await.unwrap();
            assert_eq!(&on_dup.await.unwrap().data()[..], b"dup-6");
            assert_eq!(&on_world.await.unwrap().data()[..], b"world-6");
            // Phase 3: an (Any, Any) world receive ignores dup traffic.
            let any_world = world.recv(Source::Any, Tag::Any);
            world.send(0, 0, "go").await.unwrap();
            let m = any_world.await.unwrap();
            assert_eq!((m.tag(), &m.data()[..]), (8, &b"world-8"[..]));
            let m = dup.recv(Source::Any, Tag::Any).await.unwrap();
            assert_eq!((m.tag(), &m.data()[..]), (7, &b"dup-7"[..]));
            assert_eq!(world.iprobe(Source::Any, Tag::Any).unwrap(), None);
            assert_eq!(dup.iprobe(Source::Any, Tag::Any).unwrap(), None);
        })
        .await
        .unwrap();
    })
    .await
}

/// Two dups of the same parent, and a dup of a dup, are isolated from each other too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sibling_dups_are_isolated() {
    within(async {
        rankweave::local(2, |world| async move {
            let a = world.dup().await.unwrap();
            let b = world.dup().await.unwrap();
            let c = a.dup().await.unwrap();
            let contexts = [world.context(), a.context(), b.context(), c.context()];
            for i in 0..4 {
                for j in i + 1..4 {
                    assert_ne!(contexts[i], contexts[j]);
                }
            }
            let comms = [world, a, b, c];
            if comms[0].rank() == 0 {
                // Send in the reverse order of the receives.
                for (i, comm) in comms.iter().enumerate().rev() {
                    comm.send(1, 1, vec![i as u8]).await.unwrap();
                }
                return;
            }
            for (i, comm) in comms.iter().enumerate() {
                let m = comm.recv(Source::Any, Tag::Any).await.unwrap();
                assert_eq!((m.source(), m.tag(), m.data()[0]), (0, 1, i as u8));
            }
        })
        .await
        .unwrap();
    })
    .await
}

/// Split a 7-rank world by parity with keys reversing the order: check rank, size and
/// world_rank of the sub-communicators, rank translation of received messages (and of a
/// `Truncated` error), and that sub-communicator traffic never reaches world receives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_by_parity_with_reversed_keys() {
    within(async {
        let n = 7;
        let out = rankweave::local(n, move |world| async move {
            let w = world.rank();
            // World rank 0 posts a world wildcard receive before any sub-communicator traffic.
            let world_any = (w == 0).then(|| world.recv(Source::Any, Tag::Any));
            let sub = world
                .split(Some((w % 2) as u32), -(w as i32))
                .await
                .unwrap()
                .unwrap();
            let members: Vec<usize> = (0..n).filter(|r| r % 2 == w % 2).rev().collect();
            let sub_of = |world_rank: usize| members.iter().position(|&r| r == world_rank).unwrap();
            assert_eq!(sub.size(), members.len());
            assert_eq!(sub.rank(), sub_of(w));
            assert_eq!(sub.world_rank(), w);
            assert_ne!(sub.context(), world.context());

            // Everyone reports its world rank to sub rank 0 on the sub-communicator.
            let (me, size) = (sub.rank(), sub.size());
            if me == 0 {
                for _ in 1..size {
                    let m = sub.recv(Source::Any, 11).await.unwrap();
                    let from_world = m.to_vec::<u64>().unwrap()[0] as usize;
                    assert_eq!(m.source(), sub_of(from_world));
                }
            } else {
                sub.send(0, 11, &[w as u64]).await.unwrap();
            }
            // A ring shift inside the sub-communicator.
            let (next, prev) = ((me + 1) % size, (me + size - 1) % size);
            let m = sub.sendrecv(next, 12, &[w as u64], prev, 12).await.unwrap();
            assert_eq!(m.source(), prev);
            assert_eq!(m.to_vec::<u64>().unwrap(), [members[prev] as u64]);
            // Truncation reports the sender in sub-communicator numbering.
            if me == 1 {
                sub.send(0, 13, vec![0u8; 100]).await.unwrap();
            } else if me == 0 {
                let mut small = [0u8; 10];
                assert_eq!(
                    sub.recv_into(Source::Any, 13, &mut small).await,
                    Err(Error::Truncated {
                        len: 100,
                        capacity: 10,
                        from: 1,
                        tag: 13
                    })
                );
                assert_eq!(sub.recv(1, 13).await.unwrap().len(), 100);
            }
            // Then everyone tells world rank 0 it is done, on the world communicator.
            if w != 0 {
                world.send(0, 99, &[w as u64]).await.unwrap();
            }
            if let Some(any) = world_any {
                // The first world message rank 0 gets is a "done", never sub traffic.
                let m = any.await.unwrap();
                assert_eq!(m.tag(), 99);
                assert_eq!(m.to_vec::<u64>().unwrap(), [m.source() as u64]);
                for _ in 2..n {
                    let m = world.recv(Source::Any, 99).await.unwrap();
                    assert_eq!(m.to_vec::<u64>().unwrap(), [m.source() as u64]);
                }
            }
            assert_eq!(world.iprobe(Source::Any, Tag::Any).unwrap(), None);
            assert_eq!(sub.iprobe(Source::Any, Tag::Any).unwrap(), None);
            (sub.rank(), sub.size())
        })
        .await
        .unwrap();
        // Even ranks {6,4,2,0} and odd ranks {5,3,1}, ordered by descending world rank.
        assert_eq!(
            out,
            vec![(3, 4), (2, 3), (2, 4), (1, 3), (1, 4), (0, 3), (0, 4)]
        );
    })
    .await
}

/// `split(None, _)` returns `None` while the others still get their communicator; with every
/// rank passing `None`, everyone gets `None`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn split_with_undefined_color() {
    within(async {
        let out = rankweave::local(4, |world| async move {
            let w = world.rank();
            let sub = world.split((w != 3).then_some(0), 0).await.unwrap();
            let none = world.split(None, 0).await.unwrap();
            assert!(none.is_none());
            match sub {
                None => {
                    assert_eq!(w, 3);
                    None
                }
                Some(sub) => {
                    // The remaining three still communicate among themselves.
                    let v = sub
                        .sendrecv(
                            (sub.rank() + 1) % 3,
                            0,
                            &[w as u32],
                            (sub.rank() + 2) % 3,
                            0,
                        )
                        .await
                        .unwrap();
                    Some((sub.rank(), sub.size(), v.to_vec::<u32>().unwrap()[0]))
                }
            }
        })
        .await
        .unwrap();
        assert_eq!(
            out,
            vec![Some((0, 3, 2)), Some((1, 3, 0)), Some((2, 3, 1)), None]
        );
    })
    .await
}

/// Two successive splits with the same color give different contexts: traffic of one never
/// matches receives of the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn successive_splits_are_isolated() {
    within(async {
        rankweave::local(2, |world| async move {
            let s1 = world.split(Some(0), 0).await.unwrap().unwrap();
            let s2 = world.split(Some(0), 0).await.unwrap().unwrap();
            assert_ne!(s1.context(), s2.context());
            if world.rank() == 0 {
                s1.send(1, 1, "s1").await.unwrap();
                s2.send(1, 1, "s2").await.unwrap();
                return;
            }
            assert_eq!(&s2.recv(0, 1).await.unwrap().data()[..], b"s2");
            assert_eq!(&s1.recv(0, 1).await.unwrap().data()[..], b"s1");
            assert_eq!(world.iprobe(Source::Any, Tag::Any).unwrap(), None);
        })
        .await
        .unwrap();
    })
    .await
}

/// A peer that fails is reported in the sub-communicator's numbering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_failure_is_reported_in_sub_communicator_numbering() {
    within(async {
        let result = rankweave::local(3, |world| async move {
            let w = world.rank();
            // Reversed: world 2 -> sub 0, world 1 -> sub 1, world 0 -> sub 2.
            let sub = world.split(Some(0), -(w as i32)).await.unwrap().unwrap();
            if w == 2 {
                tokio::time::sleep(Duration::from_millis(20)).await;
                panic!("world rank 2 fails");
            }
            if w == 0 {
                assert_eq!(sub.recv(0, 0).await, Err(Error::PeerFailed { rank: 0 }));
            }
        })
        .await;
        assert_eq!(
            result,
            Err(Error::RankPanicked {
                rank: 2,
                message: "world rank 2 fails".into()
            })
        );
    })
    .await
}
