//! An in-process [`Carrier`]: unreliable-datagram semantics between ranks that are tasks of one
//! process, so the reliability layer (and the chaos decorator under it) can run without sockets.
//!
//! An [`InprocCarrierFabric`] holds one receive queue per rank; [`InprocCarrier::send`] copies the
//! datagram's parts into one buffer and appends it to the destination's queue, tagged with the
//! route and the sender's rank. The carrier itself loses, duplicates, reorders and corrupts
//! nothing (wrap it in `ChaosCarrier` for that), but it does keep the datagram contract: a size
//! limit, errors for unknown peers and routes, and silent drops towards a rank that has closed.
//!
//! Every route of a fabric shares the rank's one queue; datagrams keep their route number, and
//! the order of datagrams from one sender to one receiver is the order of the sends.

use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use bytes::BytesMut;
use rankweave_core::{Carrier, Datagram, TransportError};

use crate::sync::atomic::{AtomicBool, Ordering};
use crate::sync::{Mutex, MutexGuard};

/// The receive queues of all ranks of one in-process job that talks through carriers.
pub struct InprocCarrierFabric {
    routes: usize,
    max_datagram: usize,
    queues: Vec<RankQueue>,
}

/// One rank's receive side.
///
/// No wake-up is lost: `poll_recv_ready` stores its waker *then* looks at the queue, a sender
/// appends to the queue *then* takes the waker, each step under its mutex. If the poller looked
/// before the append, its waker was stored before that, so the sender (which takes the waker
/// after the append) finds it.
struct RankQueue {
    /// Datagrams received and not yet taken by `recv`, oldest first.
    queue: Mutex<VecDeque<Datagram>>,
    /// The waker of the last `poll_recv_ready` that found the queue empty; a send takes it.
    waker: Mutex<Option<Waker>>,
    /// Set by `close`: sends from and to this rank stop, `recv` fails.
    closed: AtomicBool,
}

impl RankQueue {
    fn new() -> RankQueue {
        RankQueue {
            queue: Mutex::new(VecDeque::new()),
            waker: Mutex::new(None),
            closed: AtomicBool::new(false),
        }
    }

    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Takes the registered waker, if any, and wakes it (outside the lock).
    fn wake(&self) {
        let waker = lock(&self.waker).take();
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

impl InprocCarrierFabric {
    /// A fabric for `ranks` ranks with `routes` routes each (0 is taken as 1: a carrier has at
    /// least one route), accepting datagrams of at most `max_datagram` bytes.
    pub fn new(ranks: usize, routes: usize, max_datagram: usize) -> Arc<InprocCarrierFabric> {
        Arc::new(InprocCarrierFabric {
            routes: routes.max(1),
            max_datagram,
            queues: (0..ranks).map(|_| RankQueue::new()).collect(),
        })
    }

    /// Number of ranks.
    pub fn ranks(&self) -> usize {
        self.queues.len()
    }

    /// Number of routes of every carrier.
    pub fn routes(&self) -> usize {
        self.routes
    }

    /// The largest datagram, in bytes, a carrier of this fabric sends.
    pub fn max_datagram(&self) -> usize {
        self.max_datagram
    }

    /// The carrier of rank `rank`, or `None` if there is no such rank. Several carriers of one
    /// rank share its receive queue.
    pub fn carrier(self: &Arc<Self>, rank: usize) -> Option<InprocCarrier> {
        let rank32 = u32::try_from(rank).ok()?;
        (rank < self.queues.len()).then(|| InprocCarrier {
            rank: rank32,
            fabric: Arc::clone(self),
        })
    }
}

impl fmt::Debug for InprocCarrierFabric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InprocCarrierFabric")
            .field("ranks", &self.queues.len())
            .field("routes", &self.routes)
            .field("max_datagram", &self.max_datagram)
            .finish()
    }
}

/// One rank's [`Carrier`] on an [`InprocCarrierFabric`].
///
/// * [`send`](Carrier::send): [`TransportError::Closed`] once this rank closed;
///   [`TransportError::PeerUnreachable`] for a rank or route outside the fabric;
///   [`TransportError::Io`] for a datagram longer than the fabric's `max_datagram`. A datagram to
///   a rank that has closed is dropped without an error, as a network would.
/// * [`recv`](Carrier::recv): every queued datagram, with `from = Some(sender's rank)`;
///   [`TransportError::Closed`] once this rank closed.
/// * [`poll_recv_ready`](Carrier::poll_recv_ready): `Ready` when a datagram is queued or the
///   rank has closed (so a waiting task calls `recv` and learns it); otherwise the waker is
///   stored and the next send to this rank (or `close`) wakes it.
#[derive(Clone)]
pub struct InprocCarrier {
    rank: u32,
    fabric: Arc<InprocCarrierFabric>,
}

impl InprocCarrier {
    /// This carrier's rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The fabric it belongs to.
    pub fn fabric(&self) -> &Arc<InprocCarrierFabric> {
        &self.fabric
    }

    fn own(&self) -> &RankQueue {
        // `carrier()` only builds carriers for ranks inside the fabric.
        &self.fabric.queues[self.rank as usize]
    }
}

impl Carrier for InprocCarrier {
    fn routes(&self) -> usize {
        self.fabric.routes
    }

    fn max_datagram(&self) -> usize {
        self.fabric.max_datagram
    }

    fn send(&self, route: usize, to: u32, parts: &[&[u8]]) -> Result<(), TransportError> {
        if self.own().is_closed() {
            return Err(TransportError::Closed);
        }
        let peer = self
            .fabric
            .queues
            .get(to as usize)
            .filter(|_| route < self.fabric.routes)
            .ok_or(TransportError::PeerUnreachable(to as usize))?;
        let len = parts.iter().fold(0usize, |n, p| n.saturating_add(p.len()));
        if len > self.fabric.max_datagram {
            return Err(TransportError::Io {
                op: "inproc carrier send",
                message: format!(
                    "a {len}-byte datagram exceeds the {}-byte limit",
                    self.fabric.max_datagram
                ),
            });
        }
        if peer.is_closed() {
            return Ok(());
        }
        let mut bytes = BytesMut::with_capacity(len);
        for part in parts {
            bytes.extend_from_slice(part);
        }
        {
            let mut queue = lock(&peer.queue);
            // Checked again under the lock: `close` empties the queue under it, so nothing is
            // left behind in a closed rank's queue.
            if peer.is_closed() {
                return Ok(());
            }
            queue.push_back(Datagram {
                route,
                from: Some(self.rank),
                bytes: bytes.freeze(),
            });
        }
        peer.wake();
        Ok(())
    }

    fn recv(&self, out: &mut Vec<Datagram>) -> Result<usize, TransportError> {
        let own = self.own();
        if own.is_closed() {
            return Err(TransportError::Closed);
        }
        let mut queue = lock(&own.queue);
        let n = queue.len();
        out.extend(queue.drain(..));
        Ok(n)
    }

    fn poll_recv_ready(&self, cx: &mut Context<'_>) -> Poll<()> {
        let own = self.own();
        {
            let mut slot = lock(&own.waker);
            match &*slot {
                Some(w) if w.will_wake(cx.waker()) => {}
                _ => *slot = Some(cx.waker().clone()),
            }
        }
        if own.is_closed() || !lock(&own.queue).is_empty() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    fn close(&self) {
        let own = self.own();
        let dropped = {
            let mut queue = lock(&own.queue);
            own.closed.store(true, Ordering::Release);
            std::mem::take(&mut *queue)
        };
        drop(dropped);
        own.wake();
    }
}

impl fmt::Debug for InprocCarrier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InprocCarrier")
            .field("rank", &self.rank)
            .field("routes", &self.fabric.routes)
            .field("max_datagram", &self.fabric.max_datagram)
            .field("closed", &self.own().is_closed())
            .finish()
    }
}

/// Locks `mutex`, ignoring poisoning: no critical section here leaves the data inconsistent if
/// it unwinds.
fn lock<U>(mutex: &Mutex<U>) -> MutexGuard<'_, U> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::test_waker::CountingWaker;

    fn recv_all(c: &InprocCarrier) -> Vec<Datagram> {
        let mut out = Vec::new();
        let n = c.recv(&mut out).unwrap();
        assert_eq!(n, out.len());
        out
    }

    #[test]
    fn delivers_concatenated_parts_in_order_with_sender_and_route() {
        let fabric = InprocCarrierFabric::new(3, 2, 64);
        assert_eq!(
            (fabric.ranks(), fabric.routes(), fabric.max_datagram()),
            (3, 2, 64)
        );
        let (a, b, c) = (
            fabric.carrier(0).unwrap(),
            fabric.carrier(1).unwrap(),
            fabric.carrier(2).unwrap(),
        );
        assert_eq!((a.routes(), a.max_datagram(), a.rank()), (2, 64, 0));
        a.send(0, 1, &[b"he", b"", b"llo"]).unwrap();
        c.send(1, 1, &[b"from c"]).unwrap();
        a.send(1, 1, &[]).unwrap();
        a.send(0, 0, &[b"self"]).unwrap();
        let got = recv_all(&b);
        assert_eq!(
            got,
            vec![
                Datagram {
                    route: 0,
                    from: Some(0),
                    bytes: Bytes::from_static(b"hello"),
                },
                Datagram {
                    route: 1,
                    from: Some(2),
                    bytes: Bytes::from_static(b"from c"),
                },
                Datagram {
                    route: 1,
                    from: Some(0),
                    bytes: Bytes::new(),
                },
            ]
        );
        assert!(recv_all(&b).is_empty(), "recv takes everything");
        let mine = recv_all(&a);
        assert_eq!(mine.len(), 1);
        assert_eq!((mine[0].from, &mine[0].bytes[..]), (Some(0), &b"self"[..]));
        assert!(recv_all(&c).is_empty());
        // `recv` appends.
        a.send(0, 2, &[b"x"]).unwrap();
        let mut out = vec![Datagram {
            route: 9,
            from: None,
            bytes: Bytes::new(),
        }];
        assert_eq!(c.recv(&mut out).unwrap(), 1);
        assert_eq!(out.len(), 2);
        assert_eq!(&out[1].bytes[..], b"x");
    }

    #[test]
    fn many_senders_one_receiver_keeps_per_sender_order() {
        let fabric = InprocCarrierFabric::new(5, 1, 16);
        let threads: Vec<_> = (1..5)
            .map(|r| {
                let c = fabric.carrier(r).unwrap();
                std::thread::spawn(move || {
                    for i in 0..1000u32 {
                        c.send(0, 0, &[&i.to_le_bytes()]).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let got = recv_all(&fabric.carrier(0).unwrap());
        assert_eq!(got.len(), 4000);
        for r in 1..5u32 {
            let seq: Vec<u32> = got
                .iter()
                .filter(|d| d.from == Some(r))
                .map(|d| u32::from_le_bytes(d.bytes[..].try_into().unwrap()))
                .collect();
            assert_eq!(seq, (0..1000).collect::<Vec<_>>());
        }
    }

    #[test]
    fn a_send_wakes_the_waker_registered_by_poll_recv_ready() {
        let fabric = InprocCarrierFabric::new(2, 1, 64);
        let (a, b) = (fabric.carrier(0).unwrap(), fabric.carrier(1).unwrap());
        let (counter, waker) = CountingWaker::new();
        let mut cx = Context::from_waker(&waker);
        assert_eq!(b.poll_recv_ready(&mut cx), Poll::Pending);
        assert_eq!(counter.count(), 0);
        a.send(0, 1, &[b"ping"]).unwrap();
        assert_eq!(counter.count(), 1, "the send woke the poller");
        // A second send does not wake again: the wake-up took the waker.
        a.send(0, 1, &[b"ping"]).unwrap();
        assert_eq!(counter.count(), 1);
        assert_eq!(b.poll_recv_ready(&mut cx), Poll::Ready(()));
        assert_eq!(recv_all(&b).len(), 2);
        // A send to another rank wakes nobody here.
        assert_eq!(b.poll_recv_ready(&mut cx), Poll::Pending);
        b.send(0, 0, &[b"pong"]).unwrap();
        assert_eq!(counter.count(), 1);
        // A registered-but-not-yet-woken waker is replaced by a new one.
        let (other, other_waker) = CountingWaker::new();
        assert_eq!(
            b.poll_recv_ready(&mut Context::from_waker(&other_waker)),
            Poll::Pending
        );
        a.send(0, 1, &[b"ping"]).unwrap();
        assert_eq!((counter.count(), other.count()), (1, 1));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_parked_task_is_woken_across_threads() {
        let fabric = InprocCarrierFabric::new(2, 1, 64);
        let (a, b) = (fabric.carrier(0).unwrap(), fabric.carrier(1).unwrap());
        let receiver = tokio::spawn(async move {
            let mut got = Vec::new();
            while got.len() < 100 {
                std::future::poll_fn(|cx| b.poll_recv_ready(cx)).await;
                b.recv(&mut got).unwrap();
            }
            got
        });
        for i in 0..100u8 {
            a.send(0, 1, &[&[i]]).unwrap();
            if i % 10 == 0 {
                tokio::task::yield_now().await;
            }
        }
        let got = tokio::time::timeout(std::time::Duration::from_secs(10), receiver)
            .await
            .expect("no lost wake-up")
            .unwrap();
        assert_eq!(
            got.iter().map(|d| d.bytes[0]).collect::<Vec<_>>(),
            (0..100).collect::<Vec<u8>>()
        );
    }

    #[test]
    fn close_fails_own_calls_and_drops_datagrams_to_it() {
        let fabric = InprocCarrierFabric::new(2, 1, 64);
        let (a, b) = (fabric.carrier(0).unwrap(), fabric.carrier(1).unwrap());
        a.send(0, 1, &[b"queued before close"]).unwrap();
        let (counter, waker) = CountingWaker::new();
        let mut cx = Context::from_waker(&waker);
        assert_eq!(a.poll_recv_ready(&mut cx), Poll::Pending);
        b.send(0, 0, &[b"to a"]).unwrap();
        assert_eq!(counter.count(), 1);
        assert_eq!(a.poll_recv_ready(&mut cx), Poll::Ready(()));
        b.close();
        b.close(); // idempotent
        assert_eq!(b.send(0, 0, &[b"x"]), Err(TransportError::Closed));
        assert_eq!(b.recv(&mut Vec::new()), Err(TransportError::Closed));
        let mut bcx = Context::from_waker(Waker::noop());
        assert_eq!(
            b.poll_recv_ready(&mut bcx),
            Poll::Ready(()),
            "recv will say Closed"
        );
        // The peer's sends to the closed rank succeed and vanish.
        a.send(0, 1, &[b"lost"]).unwrap();
        assert!(format!("{b:?}").contains("closed: true"));
        // The open rank still receives what was sent before the close.
        assert_eq!(recv_all(&a).len(), 1);
        // Closing wakes a parked receiver.
        let (counter, waker) = CountingWaker::new();
        assert_eq!(
            a.poll_recv_ready(&mut Context::from_waker(&waker)),
            Poll::Pending
        );
        a.close();
        assert_eq!(counter.count(), 1);
        assert_eq!(a.recv(&mut Vec::new()), Err(TransportError::Closed));
        // A fresh carrier of a closed rank is closed too (they share the queue).
        let again = fabric.carrier(1).unwrap();
        assert_eq!(again.send(0, 0, &[]), Err(TransportError::Closed));
    }

    #[test]
    fn errors_for_unknown_peers_routes_and_oversized_datagrams() {
        let fabric = InprocCarrierFabric::new(2, 2, 8);
        assert!(fabric.carrier(2).is_none());
        assert!(fabric.carrier(usize::MAX).is_none());
        let (a, b) = (fabric.carrier(0).unwrap(), fabric.carrier(1).unwrap());
        assert_eq!(
            a.send(0, 2, &[b"x"]),
            Err(TransportError::PeerUnreachable(2))
        );
        assert_eq!(
            a.send(0, u32::MAX, &[b"x"]),
            Err(TransportError::PeerUnreachable(u32::MAX as usize))
        );
        assert_eq!(
            a.send(2, 1, &[b"x"]),
            Err(TransportError::PeerUnreachable(1))
        );
        assert_eq!(
            a.send(usize::MAX, 1, &[b"x"]),
            Err(TransportError::PeerUnreachable(1))
        );
        // Exactly the limit passes, one more byte does not (counted over all parts).
        a.send(1, 1, &[b"1234", b"5678"]).unwrap();
        let e = a.send(1, 1, &[b"1234", b"56789"]).unwrap_err();
        match e {
            TransportError::Io { op, message } => {
                assert_eq!(op, "inproc carrier send");
                assert!(
                    message.contains("9-byte") && message.contains("8-byte"),
                    "{message}"
                );
            }
            other => panic!("expected an Io error, got {other:?}"),
        }
        let got = recv_all(&b);
        assert_eq!(got.len(), 1, "nothing of the failed sends arrived");
        assert_eq!((got[0].route, &got[0].bytes[..]), (1, &b"12345678"[..]));
        // Zero routes means one; zero ranks has no carriers.
        let f = InprocCarrierFabric::new(1, 0, 0);
        let only = f.carrier(0).unwrap();
        assert_eq!(only.routes(), 1);
        only.send(0, 0, &[]).unwrap();
        assert!(only.send(0, 0, &[b"x"]).is_err());
        assert!(InprocCarrierFabric::new(0, 1, 1).carrier(0).is_none());
        assert!(format!("{f:?}").contains("InprocCarrierFabric"));
    }
}
