//! Point-to-point semantics over in-process ranks: ordering with wildcards, probes, truncation,
//! argument checking, `sendrecv` and peer failure.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{Lcg, within};
use rankweave::{Error, MAX_TAG, Source, Status, Tag};

const SENDERS: usize = 4;
const PER_SENDER: u32 = 300;

fn tag_of(src: usize, i: u32) -> u32 {
    (i * 7 + src as u32 * 3) % 5
}

/// Several senders send numbered sequences with varying tags; the receiver posts batches of
/// `(Any, Any)` and `(src, Any)` receives (batches sized so that every receive is satisfiable)
/// and checks that, in posting order, each source's numbers arrive in sequence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_source_order_with_wildcards() {
    within(async {
        let counts = rankweave::local(SENDERS + 1, |comm| async move {
            let me = comm.rank();
            if me > 0 {
                let mut ops = Vec::new();
                for i in 0..PER_SENDER {
                    ops.push(comm.send(0, tag_of(me, i), &[me as u32, i]));
                    if i % 16 == 0 {
                        tokio::task::yield_now().await;
                    }
                }
                for op in ops {
                    op.await.unwrap();
                }
                return vec![];
            }
            let mut remaining = [PER_SENDER as usize; SENDERS + 1];
            remaining[0] = 0;
            let mut next = vec![0u32; SENDERS + 1];
            let mut total = SENDERS * PER_SENDER as usize;
            let mut rng = Lcg(42);
            let (mut specific_recvs, mut any_recvs) = (0, 0);
            while total > 0 {
                let want = (1 + rng.below(24) as usize).min(total);
                let mut spec = [0usize; SENDERS + 1];
                let mut any = 0usize;
                let mut sels = Vec::new();
                for _ in 0..want {
                    let s = 1 + rng.below(SENDERS as u64) as usize;
                    // A receive may only be added if every receive of the batch that could
                    // take a source's messages still finds one.
                    if rng.below(2) == 0 && spec[s] + 1 + any <= remaining[s] {
                        spec[s] += 1;
                        sels.push(Source::Rank(s));
                    } else if (1..=SENDERS).all(|t| spec[t] == 0 || spec[t] + any < remaining[t]) {
                        any += 1;
                        sels.push(Source::Any);
                    } else {
                        break;
                    }
                }
                let ops: Vec<_> = sels
                    .iter()
                    .map(|&sel| (sel, comm.recv(sel, Tag::Any)))
                    .collect();
                for (sel, op) in ops {
                    let msg = op.await.unwrap();
                    let v: Vec<u32> = msg.to_vec().unwrap();
                    let (src, i) = (v[0] as usize, v[1]);
                    assert_eq!(msg.source(), src, "source of {v:?}");
                    match sel {
                        Source::Rank(s) => {
                            assert_eq!(s, src);
                            specific_recvs += 1;
                        }
                        Source::Any => any_recvs += 1,
                    }
                    assert_eq!(i, next[src], "source {src} overtaken");
                    assert_eq!(msg.tag(), tag_of(src, i));
                    next[src] += 1;
                    remaining[src] -= 1;
                    total -= 1;
                }
            }
            assert_eq!(comm.iprobe(Source::Any, Tag::Any).unwrap(), None);
            assert!(specific_recvs > 100 && any_recvs > 100);
            next
        })
        .await
        .unwrap();
        assert_eq!(counts[0][1..], [PER_SENDER; SENDERS]);
    })
    .await
}

/// `iprobe` sees nothing before a send and the status after it; `probe` waits for a message
/// sent later; probed messages are still received intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_and_iprobe() {
    within(async {
        rankweave::local(2, |comm| async move {
            if comm.rank() == 0 {
                comm.recv(1, 100).await.unwrap();
                comm.send(1, 5, "abc").await.unwrap();
                comm.recv(1, 101).await.unwrap();
                tokio::time::sleep(Duration::from_millis(50)).await;
                // Rendezvous-sized: only the envelope is at the receiver until it receives.
                comm.send(1, 9, vec![7u8; 100_000]).await.unwrap();
                return;
            }
            assert_eq!(comm.iprobe(0, 5).unwrap(), None);
            assert_eq!(comm.iprobe(Source::Any, Tag::Any).unwrap(), None);
            comm.send(0, 100, "go").await.unwrap();

            let st = comm.probe(0, 5).await.unwrap();
            assert_eq!(
                st,
                Status {
                    source: 0,
                    tag: 5,
                    len: 3
                }
            );
            assert_eq!(comm.iprobe(0, 5).unwrap(), Some(st));
            assert_eq!(comm.iprobe(Source::Any, Tag::Any).unwrap(), Some(st));
            assert_eq!(comm.iprobe(Source::Any, 5).unwrap(), Some(st));
            assert_eq!(comm.iprobe(0, Tag::Any).unwrap(), Some(st));
            assert_eq!(comm.iprobe(0, 6).unwrap(), None);
            // Probing twice does not consume either.
            assert_eq!(comm.probe(Source::Any, Tag::Any).await.unwrap(), st);
            let m = comm.recv(0, 5).await.unwrap();
            assert_eq!((m.source(), m.tag(), &m.data()[..]), (0, 5, &b"abc"[..]));
            assert_eq!(comm.iprobe(Source::Any, Tag::Any).unwrap(), None);

            // A probe that must wait for a message sent later.
            let mut probe = comm.probe(Source::Any, 9);
            comm.send(0, 101, "go2").await.unwrap();
            assert!(
                tokio::time::timeout(Duration::from_millis(10), &mut probe)
                    .await
                    .is_err(),
                "probe completed before anything was sent"
            );
            let st = probe.await.unwrap();
            assert_eq!(
                st,
                Status {
                    source: 0,
                    tag: 9,
                    len: 100_000
                }
            );
            assert_eq!(comm.iprobe(0, 9).unwrap(), Some(st));
            assert_eq!(comm.stats().unexpected_messages, 1);
            let m = comm.recv(0, 9).await.unwrap();
            assert_eq!(m.len(), 100_000);
            assert!(m.data().iter().all(|&b| b == 7));
            assert_eq!(comm.iprobe(Source::Any, Tag::Any).unwrap(), None);
        })
        .await
        .unwrap();
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_and_iprobe_reject_invalid_arguments() {
    within(async {
        rankweave::local(2, |comm| async move {
            let bad_rank = Error::InvalidRank { rank: 2, size: 2 };
            let bad_tag = Error::InvalidTag {
                tag: MAX_TAG + 1,
                max: MAX_TAG,
            };
            assert_eq!(comm.iprobe(2, 0), Err(bad_rank.clone()));
            assert_eq!(comm.iprobe(2, Tag::Any), Err(bad_rank.clone()));
            assert_eq!(comm.iprobe(0, MAX_TAG + 1), Err(bad_tag.clone()));
            assert_eq!(comm.iprobe(Source::Any, MAX_TAG + 1), Err(bad_tag.clone()));
            assert_eq!(comm.probe(2, Tag::Any).await, Err(bad_rank));
            assert_eq!(comm.probe(Source::Any, MAX_TAG + 1).await, Err(bad_tag));
            assert_eq!(comm.iprobe(Source::Any, MAX_TAG).unwrap(), None);
        })
        .await
        .unwrap();
    })
    .await
}

/// A too-small `recv_into` fails with `Truncated` and leaves the message in line, for eager and
/// rendezvous sizes; a bigger `recv_into` or a `recv` then gets it intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncation_keeps_the_message() {
    within(async {
        rankweave::local(2, |comm| async move {
            let big = common::pattern(2, 200 * 1024);
            if comm.rank() == 0 {
                let small = comm.send(1, 1, common::pattern(1, 100));
                let large = comm.send(1, 2, big);
                small.await.unwrap();
                large.await.unwrap();
                return;
            }
            // Posted before the message arrives.
            let mut tiny = [0u8; 50];
            assert_eq!(
                comm.recv_into(0, 1, &mut tiny).await,
                Err(Error::Truncated {
                    len: 100,
                    capacity: 50,
                    from: 0,
                    tag: 1
                })
            );
            assert_eq!(tiny, [0u8; 50], "a truncated receive must not write");
            let mut buf = [0u8; 128];
            let st = comm.recv_into(0, 1, &mut buf).await.unwrap();
            assert_eq!(
                st,
                Status {
                    source: 0,
                    tag: 1,
                    len: 100
                }
            );
            assert_eq!(&buf[..100], &common::pattern(1, 100)[..]);
            assert_eq!(buf[100..], [0u8; 28]);

            // Rendezvous-sized, wildcard receive.
            let mut buf = vec![0u8; 1000];
            comm.probe(0, 2).await.unwrap();
            assert_eq!(
                comm.recv_into(Source::Any, Tag::Any, &mut buf).await,
                Err(Error::Truncated {
                    len: 200 * 1024,
                    capacity: 1000,
                    from: 0,
                    tag: 2
                })
            );
            let m = comm.recv(Source::Any, Tag::Any).await.unwrap();
            assert_eq!((m.source(), m.tag()), (0, 2));
            assert_eq!(m.data()[..], big[..]);
            assert_eq!(comm.stats().unexpected_messages, 0);
        })
        .await
        .unwrap();
    })
    .await
}

/// A truncated message stays *first* in line: a second too-small receive fails on it again
/// rather than skipping to a later (fitting) message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_message_stays_first_in_line() {
    within(async {
        rankweave::local(2, |comm| async move {
            if comm.rank() == 0 {
                comm.send(1, 4, vec![1u8; 100]).await.unwrap();
                comm.send(1, 4, vec![2u8; 10]).await.unwrap();
                return;
            }
            comm.probe(0, 4).await.unwrap();
            let mut b50 = [0u8; 50];
            // Two small receives posted together: both fail on the first message.
            let err = Err(Error::Truncated {
                len: 100,
                capacity: 50,
                from: 0,
                tag: 4,
            });
            assert_eq!(comm.recv_into(0, 4, &mut b50).await, err);
            assert_eq!(comm.recv_into(Source::Any, 4, &mut b50).await, err);
            let first = comm.recv(0, 4).await.unwrap();
            assert_eq!(first.data()[..], [1u8; 100]);
            let st = comm.recv_into(0, 4, &mut b50).await.unwrap();
            assert_eq!(st.len, 10);
            assert_eq!(b50[..10], [2u8; 10]);
        })
        .await
        .unwrap();
    })
    .await
}

/// A borrowed slice is sent as it stood at the call, eager or rendezvous: the caller may
/// overwrite its buffer as soon as `send` returns, before the send's future is awaited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_borrowed_slice_is_sent_as_it_was_at_the_call() {
    within(async {
        rankweave::local(2, |comm| async move {
            // Within and past the eager limit (64 KiB by default).
            let sizes = [0usize, 1, 1000, 200_000];
            if comm.rank() == 0 {
                for (i, &n) in sizes.iter().enumerate() {
                    let mut buf: Vec<u16> = (0..n).map(|k| (k * 7 + i) as u16).collect();
                    let send = comm.send(1, 5, &buf[..]);
                    buf.iter_mut().for_each(|v| *v = 0xFFFF);
                    send.await.unwrap();
                }
                return;
            }
            for (i, &n) in sizes.iter().enumerate() {
                let m = comm.recv(0, 5).await.unwrap();
                let got: Vec<u16> = m.to_vec().unwrap();
                let want: Vec<u16> = (0..n).map(|k| (k * 7 + i) as u16).collect();
                assert_eq!(got, want, "{n} elements");
            }
        })
        .await
        .unwrap();
    })
    .await
}

/// `recv_into` works with any `Pod` element type, and truncation is measured in bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recv_into_u32_buffer() {
    within(async {
        rankweave::local(2, |comm| async move {
            let values: Vec<u32> = (0..16).map(|i| 0xA5A5_0000 + i * 977).collect();
            if comm.rank() == 0 {
                comm.send(1, 3, &values).await.unwrap();
                comm.send(1, 3, &values[..3]).await.unwrap();
                return;
            }
            let mut short = [0u32; 4];
            assert_eq!(
                comm.recv_into(0, 3, &mut short).await,
                Err(Error::Truncated {
                    len: 64,
                    capacity: 16,
                    from: 0,
                    tag: 3
                })
            );
            let mut buf = [0u32; 16];
            let st = comm.recv_into(0, 3, &mut buf).await.unwrap();
            assert_eq!(
                st,
                Status {
                    source: 0,
                    tag: 3,
                    len: 64
                }
            );
            assert_eq!(buf[..], values[..]);
            let mut buf = [0u32; 16];
            assert_eq!(comm.recv_into(0, 3, &mut buf).await.unwrap().len, 12);
            assert_eq!(buf[..3], values[..3]);
            assert_eq!(buf[3..], [0u32; 13]);
        })
        .await
        .unwrap();
    })
    .await
}

/// Ranks outside the communicator and tags above `MAX_TAG` are errors, never panics, and
/// nothing is sent or posted for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_rank_and_tag_are_errors() {
    within(async {
        rankweave::local(2, |comm| async move {
            if comm.rank() == 1 {
                let m = comm.recv(0, MAX_TAG).await.unwrap();
                assert_eq!(&m.data()[..], b"max");
                // Anything the invalid calls had sent would have arrived before this.
                assert_eq!(comm.iprobe(Source::Any, Tag::Any).unwrap(), None);
                comm.send(0, 0, "done").await.unwrap();
                return;
            }
            let rank = |rank| Error::InvalidRank { rank, size: 2 };
            let tag = |tag| Error::InvalidTag { tag, max: MAX_TAG };
            assert_eq!(comm.send(2, 0, "x").await, Err(rank(2)));
            assert_eq!(comm.send(usize::MAX, 0, "x").await, Err(rank(usize::MAX)));
            assert_eq!(comm.send(2, 0, vec![0u8; 1 << 20]).await, Err(rank(2)));
            assert_eq!(comm.recv(2, 0).await, Err(rank(2)));
            assert_eq!(comm.recv(Source::Rank(7), Tag::Any).await, Err(rank(7)));
            assert_eq!(comm.send(1, MAX_TAG + 1, "x").await, Err(tag(MAX_TAG + 1)));
            assert_eq!(comm.send(1, u32::MAX, "x").await, Err(tag(u32::MAX)));
            assert_eq!(comm.recv(1, MAX_TAG + 1).await, Err(tag(MAX_TAG + 1)));
            assert_eq!(comm.recv(Source::Any, u32::MAX).await, Err(tag(u32::MAX)));
            let mut buf = [0u8; 8];
            assert_eq!(comm.recv_into(2, 0, &mut buf).await, Err(rank(2)));
            assert_eq!(
                comm.recv_into(1, MAX_TAG + 1, &mut buf).await,
                Err(tag(MAX_TAG + 1))
            );
            assert_eq!(comm.stats().posted_receives, 0);
            comm.send(1, MAX_TAG, "max").await.unwrap();
            assert_eq!(&comm.recv(1, 0).await.unwrap().data()[..], b"done");
        })
        .await
        .unwrap();
    })
    .await
}

/// `sendrecv` to an invalid destination fails at once: it must neither wait for the receive
/// half nor consume (and then discard) a matching message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sendrecv_to_invalid_rank_fails_at_once() {
    within(async {
        rankweave::local(2, |comm| async move {
            if comm.rank() == 1 {
                comm.recv(0, 1).await.unwrap();
                comm.send(0, 0, "keep me").await.unwrap();
                return;
            }
            let r =
                tokio::time::timeout(Duration::from_secs(2), comm.sendrecv(2, 0, "x", 1, 0)).await;
            assert_eq!(
                r.map(|r| r.map(drop)),
                Ok(Err(Error::InvalidRank { rank: 2, size: 2 })),
                "sendrecv to rank 2 of 2 must fail without waiting"
            );
            assert_eq!(comm.stats().posted_receives, 0);
            comm.send(1, 1, "go").await.unwrap();
            // The message the failed sendrecv could have matched is still there.
            assert_eq!(&comm.recv(1, 0).await.unwrap().data()[..], b"keep me");
        })
        .await
        .unwrap();
    })
    .await
}

/// Every rank shifts a value by k places around an 8-rank ring with `sendrecv`, for every k.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sendrecv_ring_shift() {
    within(async {
        let n = 8;
        let results = rankweave::local(n, move |comm| async move {
            let r = comm.rank();
            let mut got = Vec::new();
            for k in 1..n {
                let dst = (r + k) % n;
                let src = (r + n - k) % n;
                let msg = comm
                    .sendrecv(dst, k as u32, &[r as u64, k as u64], src, k as u32)
                    .await
                    .unwrap();
                assert_eq!((msg.source(), msg.tag()), (src, k as u32));
                got.push(msg.to_vec::<u64>().unwrap());
            }
            got
        })
        .await
        .unwrap();
        for (r, got) in results.iter().enumerate() {
            let want: Vec<Vec<u64>> = (1..n)
                .map(|k| vec![((r + n - k) % n) as u64, k as u64])
                .collect();
            assert_eq!(got, &want, "rank {r}");
        }
    })
    .await
}

/// (rank, what it did, how that ended)
type Outcome = (usize, String, Result<(), Error>);

/// A rank that panics makes its peers' receives from it fail with `PeerFailed` (whether they
/// were posted before or after the failure), and `local` reports `RankPanicked` for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panicking_rank_fails_peers_instead_of_hanging() {
    within(async {
        let seen: Arc<Mutex<Vec<Outcome>>> = Arc::default();
        let record = Arc::clone(&seen);
        let result = rankweave::local(3, move |comm| {
            let record = Arc::clone(&record);
            async move {
                let put = |what: &str, r: Result<(), Error>| {
                    record
                        .lock()
                        .unwrap()
                        .push((comm.rank(), what.to_string(), r));
                };
                match comm.rank() {
                    1 => {
                        comm.recv(2, 1).await.unwrap();
                        panic!("rank 1 fails on purpose");
                    }
                    2 => {
                        // Posted before rank 1 fails.
                        let early = comm.recv(1, 7);
                        comm.send(1, 1, "go").await.unwrap();
                        put("posted before", early.await.map(drop));
                    }
                    _ => {
                        // Posted whenever; usually after the failure.
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        put("posted after", comm.recv(1, 0).await.map(drop));
                        put(
                            "rendezvous send after",
                            comm.send(1, 0, vec![0u8; 1 << 20]).await,
                        );
                    }
                }
            }
        })
        .await;
        assert_eq!(
            result.map(drop),
            Err(Error::RankPanicked {
                rank: 1,
                message: "rank 1 fails on purpose".into()
            })
        );
        let mut seen = seen.lock().unwrap().clone();
        seen.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
        let failed = || Err(Error::PeerFailed { rank: 1 });
        assert_eq!(
            seen,
            vec![
                (0, "posted after".to_string(), failed()),
                (0, "rendezvous send after".to_string(), failed()),
                (2, "posted before".to_string(), failed()),
            ]
        );
    })
    .await
}

/// When one rank panics and another then panics because of it (an `unwrap` of `PeerFailed`),
/// `local` names the rank that panicked first, as documented, not the lowest-numbered one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_reports_the_first_rank_to_panic() {
    within(async {
        let result = rankweave::local(2, |comm| async move {
            if comm.rank() == 1 {
                panic!("root cause");
            }
            comm.recv(1, 0).await.unwrap();
        })
        .await;
        assert_eq!(
            result,
            Err(Error::RankPanicked {
                rank: 1,
                message: "root cause".into()
            })
        );
    })
    .await
}

/// A rank that panics while one of its rendezvous sends is still waiting for the receiver is
/// still reported as failed: a peer's receive from it fails instead of hanging.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panic_with_pending_rendezvous_send_still_fails_peers() {
    within(async {
        let seen: Arc<Mutex<Option<Result<(), Error>>>> = Arc::default();
        let record = Arc::clone(&seen);
        let result = rankweave::local(2, move |comm| {
            let record = Arc::clone(&record);
            async move {
                if comm.rank() == 0 {
                    let _pending = comm.send(1, 1, vec![0u8; 1 << 20]);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    panic!("rank 0 fails with a send pending");
                }
                let r = tokio::time::timeout(Duration::from_secs(5), comm.recv(0, 2)).await;
                *record.lock().unwrap() = Some(
                    r.unwrap_or(Err(Error::Timeout(Duration::from_secs(5))))
                        .map(drop),
                );
            }
        })
        .await;
        assert_eq!(
            *seen.lock().unwrap(),
            Some(Err(Error::PeerFailed { rank: 0 })),
            "receive from a panicked rank"
        );
        assert_eq!(
            result,
            Err(Error::RankPanicked {
                rank: 0,
                message: "rank 0 fails with a send pending".into()
            })
        );
    })
    .await
}
