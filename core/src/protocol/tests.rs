//! Deterministic tests of the sans-IO protocol: [`Endpoint`]s wired together by a tiny simulated
//! network, no transport and no runtime.
//!
//! [`Net`] keeps one FIFO queue of frames per (from, to) link. Tests move frames from a sender's
//! `poll_transmit` queue into the receiver's `handle` one at a time, in FIFO order
//! ([`Net::run`], [`Net::deliver`]) or with `Data` fragments shuffled ([`Net::run_shuffled`]),
//! which is the only reordering the protocol allows: `Eager`/`Rts` frames of one peer must
//! arrive in order, data fragments may come in any order.

use std::collections::{BTreeMap, VecDeque};

use bytes::Bytes;

use super::*;
use crate::types::ContextId;

const CTX: ContextId = ContextId::WORLD;

/// A simulated job: one endpoint per rank and a FIFO queue of frames per directed link.
struct Net {
    eps: Vec<Endpoint>,
    links: BTreeMap<(u32, u32), VecDeque<Frame>>,
    /// Events each rank reported and the test has not looked at yet.
    events: Vec<Vec<Event>>,
    /// Largest `stats().unexpected_bytes` each rank ever showed (checked after every step).
    max_unexpected: Vec<u64>,
    /// Receives that [`Endpoint::start_recv`] finished at once, by the stand-in id [`Net::recv`]
    /// returned for them (as a driver keeps them in the receive's future).
    started: BTreeMap<(u32, u64), Result<Matched, Error>>,
    next_started: u64,
    rng: u64,
}

impl Net {
    /// `size` ranks with eager limit 1024, max payload 1000 and a roomy unexpected limit.
    fn new(size: u32) -> Self {
        Self::with(size, 1024, 1 << 20, 1000)
    }

    fn with(size: u32, eager_limit: usize, unexpected_limit: usize, max_payload: usize) -> Self {
        Self::build(size, eager_limit, unexpected_limit, max_payload, false)
    }

    /// Like [`Net::new`], over a transport that hands payloads over by reference (in-process):
    /// rendezvous requests carry their data.
    fn by_reference(size: u32) -> Self {
        Self::build(size, 1024, 1 << 20, usize::MAX, true)
    }

    fn build(
        size: u32,
        eager_limit: usize,
        unexpected_limit: usize,
        max_payload: usize,
        rts_with_data: bool,
    ) -> Self {
        let eps = (0..size)
            .map(|rank| {
                Endpoint::new(EndpointConfig {
                    rank,
                    size,
                    eager_limit,
                    unexpected_limit,
                    max_payload,
                    rts_with_data,
                })
            })
            .collect();
        Net {
            eps,
            links: BTreeMap::new(),
            events: vec![Vec::new(); size as usize],
            max_unexpected: vec![0; size as usize],
            started: BTreeMap::new(),
            next_started: u64::MAX,
            rng: 0x9E37_79B9_7F4A_7C15,
        }
    }

    fn ep(&mut self, rank: u32) -> &mut Endpoint {
        &mut self.eps[rank as usize]
    }

    fn stats(&self, rank: u32) -> Stats {
        self.eps[rank as usize].stats()
    }

    /// Moves what `rank` wants to transmit onto the links and collects its events.
    fn flush(&mut self, rank: u32) {
        let r = rank as usize;
        while let Some((to, frame)) = self.eps[r].poll_transmit() {
            self.links.entry((rank, to)).or_default().push_back(frame);
        }
        while let Some(ev) = self.eps[r].poll_event() {
            self.events[r].push(ev);
        }
        let unexpected = self.eps[r].stats().unexpected_bytes;
        self.max_unexpected[r] = self.max_unexpected[r].max(unexpected);
    }

    fn try_send(&mut self, from: u32, to: u32, tag: u32, data: &[u8]) -> Result<SendStart, Error> {
        let r = self
            .ep(from)
            .post_send(to, CTX, tag, Bytes::copy_from_slice(data));
        self.flush(from);
        r
    }

    fn send(&mut self, from: u32, to: u32, tag: u32, data: &[u8]) -> SendStart {
        self.try_send(from, to, tag, data).expect("send failed")
    }

    fn recv(
        &mut self,
        rank: u32,
        source: Option<u32>,
        tag: Option<u32>,
        max_len: Option<usize>,
    ) -> RecvId {
        let id = self.ep(rank).post_recv(selector(source, tag), max_len);
        self.flush(rank);
        id
    }

    /// Starts a receive as the driver does ([`Endpoint::start_recv`]): one that finds its
    /// message is done at once (kept here under a stand-in id, as a driver keeps it in the
    /// receive's future), and one started while nothing else waits is posted alone, outside
    /// the matcher, until something makes it join.
    fn start(&mut self, rank: u32, sel: Selector, max_len: Option<usize>) -> RecvId {
        let start = self.ep(rank).start_recv(sel, max_len);
        self.flush(rank);
        let done = match start {
            RecvStart::Pending(id) => return id,
            RecvStart::Matched(m) => Ok(m),
            RecvStart::Failed(e) => Err(e),
        };
        let id = self.next_started;
        self.next_started -= 1;
        self.started.insert((rank, id), done);
        RecvId(id)
    }

    fn take(&mut self, rank: u32, id: RecvId) -> Option<Result<Msg, Error>> {
        if let Some(done) = self.started.remove(&(rank, id.0)) {
            return Some(done.map(|m| Msg(m.received)));
        }
        let r = self.ep(rank).take_recv(id);
        self.flush(rank);
        r.map(|r| r.map(Msg))
    }

    /// Takes the results of the rendezvous sends `rank` reported finished, asserting that its
    /// events are exactly such completions and that every send succeeded; returns how many.
    fn take_sends(&mut self, rank: u32) -> usize {
        let events = self.events(rank);
        for ev in &events {
            let Event::SendDone(id) = *ev else {
                panic!("rank {rank}: unexpected event {ev:?}");
            };
            assert_eq!(self.ep(rank).take_send(id), Some(Ok(())));
        }
        events.len()
    }

    /// Drops receive `id` as its future would: withdrawn, or its message given back.
    fn cancel(&mut self, rank: u32, id: RecvId) {
        match self.started.remove(&(rank, id.0)) {
            Some(Ok(m)) => self.ep(rank).give_back(m),
            Some(Err(_)) => {}
            None => self.ep(rank).cancel_recv(id),
        }
        self.flush(rank);
    }

    /// Hands `frame` to `rank` as if it came from `from` (which may be forged).
    fn inject(&mut self, rank: u32, from: u32, frame: Frame) {
        self.ep(rank).handle(Arrival::Frame { from, frame });
        self.flush(rank);
    }

    fn peer_lost(&mut self, rank: u32, lost: u32) {
        self.ep(rank).handle(Arrival::PeerLost { rank: lost });
        self.flush(rank);
    }

    /// Headers of the frames waiting on link `from -> to`, in order.
    fn pending(&self, from: u32, to: u32) -> Vec<Header> {
        self.links
            .get(&(from, to))
            .map(|q| q.iter().map(|f| f.header).collect())
            .unwrap_or_default()
    }

    fn in_flight(&self) -> usize {
        self.links.values().map(VecDeque::len).sum()
    }

    /// Delivers the frame at `index` of link `from -> to`; returns its header.
    fn deliver_at(&mut self, from: u32, to: u32, index: usize) -> Header {
        let frame = self
            .links
            .get_mut(&(from, to))
            .and_then(|q| q.remove(index))
            .unwrap_or_else(|| panic!("no frame {index} on link {from} -> {to}"));
        let header = frame.header;
        self.inject(to, from, frame);
        header
    }

    /// Delivers the next frame of link `from -> to`; returns its header.
    fn deliver(&mut self, from: u32, to: u32) -> Header {
        self.deliver_at(from, to, 0)
    }

    /// Delivers everything, one frame per link in turn, each link in FIFO order, until no frame
    /// is left anywhere.
    fn run(&mut self) {
        while self.in_flight() > 0 {
            let busy: Vec<(u32, u32)> = self
                .links
                .iter()
                .filter(|(_, q)| !q.is_empty())
                .map(|(&k, _)| k)
                .collect();
            for (from, to) in busy {
                self.deliver(from, to);
            }
        }
    }

    fn random(&mut self, below: usize) -> usize {
        // xorshift64: deterministic, good enough to pick frames.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng % below as u64) as usize
    }

    /// Delivers everything in a pseudo-random order the protocol allows: on each link any `Data`
    /// fragment, or the first frame of another kind (those stay in order per link).
    fn run_shuffled(&mut self) {
        loop {
            let mut allowed = Vec::new();
            for (&link, q) in &self.links {
                let mut ordered_seen = false;
                for (i, f) in q.iter().enumerate() {
                    if matches!(f.header, Header::Data { .. }) {
                        allowed.push((link, i));
                    } else if !ordered_seen {
                        ordered_seen = true;
                        allowed.push((link, i));
                    }
                }
            }
            if allowed.is_empty() {
                return;
            }
            let ((from, to), i) = allowed[self.random(allowed.len())];
            self.deliver_at(from, to, i);
        }
    }

    /// The events `rank` reported since the last call.
    fn events(&mut self, rank: u32) -> Vec<Event> {
        std::mem::take(&mut self.events[rank as usize])
    }

    /// The receives `rank` reported finished since the last call (its other events dropped).
    fn finished(&mut self, rank: u32) -> Vec<Event> {
        let mut events = self.events(rank);
        events.retain(|e| matches!(e, Event::RecvDone(_)));
        events
    }

    /// What a driver does for receive `id` of `rank` waiting on one sender: offers it the next
    /// frame on the link from that sender where it lies ([`Endpoint::accept_direct`]). Returns
    /// the message if the receive took it (the frame leaves the link), `None` if it was not
    /// offered or was declined (the frame stays first on the link).
    fn offer(&mut self, rank: u32, id: RecvId) -> Option<Msg> {
        let from = self.ep(rank).direct_want(id)?.want.from;
        let frame = self.links.get(&(from, rank))?.front()?.clone();
        let m = self
            .ep(rank)
            .accept_direct(id, from, &frame.header, &frame.payload)?;
        self.links.get_mut(&(from, rank))?.pop_front();
        self.flush(rank);
        Some(Msg(m.received))
    }
}

/// A selector in the tests' context.
fn selector(source: Option<u32>, tag: Option<u32>) -> Selector {
    Selector {
        context: CTX,
        source,
        tag,
    }
}

/// `len` bytes of a pattern that differs per `seed` and per position.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

/// A received message, compared exactly but printed short (lengths and the first bytes), so a
/// failed assertion on a 10 kB message stays readable.
#[derive(PartialEq, Eq)]
struct Msg(Received);

impl std::fmt::Debug for Msg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Received { source, tag, data } = &self.0;
        let head = &data[..data.len().min(12)];
        write!(
            f,
            "Msg {{ source: {source}, tag: {tag}, {} bytes: {:?}.. }}",
            data.len(),
            Bytes::copy_from_slice(head)
        )
    }
}

fn ok(source: u32, tag: u32, data: &[u8]) -> Option<Result<Msg, Error>> {
    Some(Ok(Msg(Received {
        source,
        tag,
        data: Bytes::copy_from_slice(data),
    })))
}

fn env(tag: u32, seq: u64, len: u64) -> Envelope {
    Envelope {
        context: CTX,
        tag,
        seq,
        len,
    }
}

fn eager_frame(tag: u32, seq: u64, data: &'static [u8]) -> Frame {
    Frame {
        header: Header::Eager(env(tag, seq, data.len() as u64)),
        payload: Bytes::from_static(data),
    }
}

fn pending_id(start: SendStart) -> SendId {
    match start {
        SendStart::Pending(id) => id,
        SendStart::Complete => panic!("expected a rendezvous send"),
    }
}

/// The recv id a CTS on link `from -> to` carries (the first CTS there).
fn cts_recv_id(net: &Net, from: u32, to: u32) -> u64 {
    net.pending(from, to)
        .into_iter()
        .find_map(|h| match h {
            Header::Cts { recv_id, .. } => Some(recv_id),
            _ => None,
        })
        .expect("no CTS in flight")
}

// ---------------------------------------------------------------------------------------------
// Eager
// ---------------------------------------------------------------------------------------------

#[test]
fn eager_with_receive_posted_first() {
    let mut net = Net::new(2);
    let r = net.recv(1, Some(0), Some(5), None);
    assert_eq!(net.take(1, r), None, "nothing arrived yet");
    assert_eq!(net.stats(1).posted_receives, 1);

    assert_eq!(net.send(0, 1, 5, b"hello"), SendStart::Complete);
    assert_eq!(net.pending(0, 1), vec![Header::Eager(env(5, 0, 5))]);
    net.run();

    assert_eq!(net.events(1), vec![Event::RecvDone(r)]);
    assert_eq!(net.take(1, r), ok(0, 5, b"hello"));
    assert_eq!(net.take(1, r), None, "a result is taken once");
    assert_eq!(net.events(0), vec![], "an eager send reports nothing");
    assert_eq!(net.stats(0).eager_messages_sent, 1);
    assert_eq!(net.stats(0).rendezvous_messages_sent, 0);
    let s = net.stats(1);
    assert_eq!((s.posted_receives, s.unexpected_messages), (0, 0));
    assert_eq!(s.unexpected_bytes, 0);
}

#[test]
fn an_eager_send_with_nothing_queued_is_handed_over_at_once() {
    let mut net = Net::new(2);
    let start = |net: &mut Net, to: u32, tag: u32, len: usize| {
        net.ep(0).start_eager(to, CTX, tag, len).expect("send")
    };
    let r = net.recv(1, Some(0), Some(5), None);
    // Straight out: complete, counted as sent, nothing left queued; the payload never
    // reaches the endpoint.
    let envelope = start(&mut net, 1, 5, 2).expect("an eager send with an empty queue goes out");
    assert_eq!(envelope, env(5, 0, 2));
    assert_eq!(net.ep(0).poll_transmit(), None);
    let s = net.stats(0);
    assert_eq!(
        (s.frames_sent, s.bytes_sent, s.eager_messages_sent),
        (1, 2, 1)
    );
    // The receiver takes it like any frame.
    let frame = Frame {
        header: Header::Eager(envelope),
        payload: Bytes::from_static(b"hi"),
    };
    net.links.entry((0, 1)).or_default().push_back(frame);
    net.run();
    assert_eq!(net.take(1, r), ok(0, 5, b"hi"));

    // A message beyond the eager limit is not this case (and nothing changed): post_send
    // starts it as a rendezvous.
    assert_eq!(start(&mut net, 1, 6, 5000), None);
    let rts = net
        .ep(0)
        .post_send(1, CTX, 6, Bytes::from(pattern(5000, 1)));
    assert!(matches!(rts, Ok(SendStart::Pending(_))), "{rts:?}");
    // Behind the queued request (not yet polled), an eager send is not handed over either:
    // post_send queues it after the request, so the two keep their order on the link.
    assert_eq!(start(&mut net, 1, 7, 5), None);
    let eager = net.ep(0).post_send(1, CTX, 7, Bytes::from_static(b"after"));
    assert!(matches!(eager, Ok(SendStart::Complete)), "{eager:?}");
    let kinds: Vec<_> = std::iter::from_fn(|| net.ep(0).poll_transmit())
        .map(|(to, f)| (to, f.header))
        .collect();
    assert!(matches!(kinds[..], [(1, Header::Rts { .. }), (1, Header::Eager(e))] if e.seq == 2));
    assert_eq!(net.stats(0).frames_sent, 3);

    // To itself: through the loopback, never handed to a transport.
    assert_eq!(start(&mut net, 0, 8, 2), None);
    let own = net.ep(0).post_send(0, CTX, 8, Bytes::from_static(b"me"));
    assert!(matches!(own, Ok(SendStart::Complete)), "{own:?}");
    assert_eq!(net.ep(0).poll_transmit(), None);
    assert_eq!(net.stats(0).unexpected_messages, 1);

    // Out of range: the same error as post_send's, and no sequence number spent.
    assert!(matches!(
        net.ep(0).start_eager(2, CTX, 9, 1),
        Err(Error::InvalidRank { rank: 2, size: 2 })
    ));
    assert_eq!(start(&mut net, 1, 9, 1).map(|e| e.seq), Some(3));
}

#[test]
fn eager_unexpected_first() {
    let mut net = Net::new(2);
    assert_eq!(net.send(0, 1, 5, b"hello"), SendStart::Complete);
    net.run();

    assert_eq!(net.events(1), vec![Event::Unexpected]);
    let s = net.stats(1);
    assert_eq!((s.unexpected_messages, s.unexpected_bytes), (1, 5));
    let any = Selector {
        context: CTX,
        source: None,
        tag: None,
    };
    assert_eq!(net.ep(1).probe(&any), Some((0, 5, 5)));

    // A receive for another tag or context does not take it.
    let other_tag = net.recv(1, Some(0), Some(6), None);
    let other_ctx = net.ep(1).post_recv(
        Selector {
            context: ContextId(2),
            source: None,
            tag: None,
        },
        None,
    );
    assert_eq!(net.events(1), vec![]);

    let r = net.recv(1, Some(0), Some(5), None);
    assert_eq!(net.events(1), vec![Event::RecvDone(r)], "matched at once");
    assert_eq!(net.take(1, r), ok(0, 5, b"hello"));
    assert_eq!(net.take(1, other_tag), None);
    assert_eq!(net.take(1, other_ctx), None);
    let s = net.stats(1);
    assert_eq!((s.unexpected_messages, s.unexpected_bytes), (0, 0));
    assert_eq!(s.posted_receives, 2);
}

#[test]
fn eager_empty_message() {
    let mut net = Net::new(2);
    assert_eq!(net.send(0, 1, 0, b""), SendStart::Complete);
    net.run();
    let r = net.recv(1, None, None, Some(0));
    assert_eq!(net.take(1, r), ok(0, 0, b""));
}

// ---------------------------------------------------------------------------------------------
// Rendezvous
// ---------------------------------------------------------------------------------------------

#[test]
fn rendezvous_fragments_in_shuffled_order() {
    let mut net = Net::with(2, 1024, 1 << 20, 1000);
    let msg = pattern(10_000, 1);
    let s = pending_id(net.send(0, 1, 9, &msg));
    assert_eq!(net.stats(0).rendezvous_messages_sent, 1);
    assert!(net.ep(0).has_pending_sends());
    assert!(matches!(
        net.pending(0, 1)[..],
        [Header::Rts { envelope, .. }] if envelope == env(9, 0, 10_000)
    ));

    // The RTS arrives before any receive: the message is unexpected but costs no memory.
    net.deliver(0, 1);
    assert_eq!(net.events(1), vec![Event::Unexpected]);
    let st = net.stats(1);
    assert_eq!((st.unexpected_messages, st.unexpected_bytes), (1, 0));

    let r = net.recv(1, Some(0), Some(9), None);
    assert_eq!(net.events(1), vec![], "data still at the sender");
    assert!(matches!(
        net.pending(1, 0)[..],
        [Header::Cts { send_id, .. }] if send_id == s.0
    ));

    net.deliver(1, 0);
    assert_eq!(net.events(0), vec![Event::SendDone(s)]);
    assert_eq!(net.ep(0).take_send(s), Some(Ok(())));
    assert!(!net.ep(0).has_pending_sends());

    // Ten fragments of at most max_payload bytes, covering the message.
    let frags = net.pending(0, 1);
    assert_eq!(frags.len(), 10);
    for (i, h) in frags.iter().enumerate() {
        assert!(matches!(h, Header::Data { offset, .. } if *offset == i as u64 * 1000));
    }
    assert!(net.links[&(0, 1)].iter().all(|f| f.payload.len() == 1000));

    // Shuffled, and the receive completes only with the last fragment.
    let mut delivered = 0;
    while net.in_flight() > 0 {
        let n = net.links[&(0, 1)].len();
        let i = net.random(n);
        net.deliver_at(0, 1, i);
        delivered += 1;
        let expect = if delivered == 10 {
            vec![Event::RecvDone(r)]
        } else {
            vec![]
        };
        assert_eq!(net.events(1), expect, "after {delivered} fragments");
    }
    assert_eq!(net.take(1, r), ok(0, 9, &msg));
    assert_eq!(net.stats(1).protocol_errors, 0);
}

#[test]
fn rendezvous_with_receive_posted_first() {
    let mut net = Net::with(2, 1024, 1 << 20, 1000);
    let msg = pattern(10_001, 2);
    let r = net.recv(1, None, None, Some(10_001));
    let s = pending_id(net.send(0, 1, 3, &msg));
    net.run_shuffled();
    assert_eq!(net.events(0), vec![Event::SendDone(s)]);
    assert_eq!(net.events(1), vec![Event::RecvDone(r)]);
    assert_eq!(net.ep(0).take_send(s), Some(Ok(())));
    assert_eq!(net.take(1, r), ok(0, 3, &msg));
    // 10 full fragments and a last one-byte fragment.
    assert_eq!(net.stats(0).frames_sent, 1 + 11);
    assert_eq!(net.stats(0).bytes_sent, 10_001);
}

#[test]
fn rendezvous_zero_length_message_when_out_of_credit() {
    // 528 bytes shared by 2 ranks, 264 each: a 200-byte eager message costs 264, nothing is left.
    let mut net = Net::with(2, 1024, 528, 1000);
    assert_eq!(net.send(0, 1, 1, &pattern(200, 3)), SendStart::Complete);
    let s = pending_id(net.send(0, 1, 2, b""));
    assert_eq!(net.stats(0).rendezvous_messages_sent, 1);
    net.run();

    let a = net.recv(1, Some(0), None, None);
    let b = net.recv(1, Some(0), None, None);
    net.run();
    assert_eq!(net.events(0), vec![Event::SendDone(s)]);
    assert_eq!(net.ep(0).take_send(s), Some(Ok(())));
    assert_eq!(
        net.events(1),
        vec![
            Event::Unexpected,
            Event::Unexpected,
            Event::RecvDone(a),
            Event::RecvDone(b),
        ]
    );
    assert_eq!(net.take(1, a), ok(0, 1, &pattern(200, 3)));
    assert_eq!(net.take(1, b), ok(0, 2, b""));
    assert!(!net.ep(0).has_pending_sends());
}

#[test]
fn rendezvous_and_eager_from_one_source_stay_in_order() {
    let mut net = Net::with(2, 1024, 1 << 20, 1000);
    let big = pattern(5000, 4);
    pending_id(net.send(0, 1, 1, &big));
    assert_eq!(net.send(0, 1, 1, b"small"), SendStart::Complete);
    net.run();
    let a = net.recv(1, Some(0), Some(1), None);
    let b = net.recv(1, Some(0), Some(1), None);
    // The eager message is complete at once; the first receive waits for its data.
    assert_eq!(
        net.events(1),
        vec![Event::Unexpected, Event::Unexpected, Event::RecvDone(b)]
    );
    net.run_shuffled();
    assert_eq!(net.events(1), vec![Event::RecvDone(a)]);
    assert_eq!(net.take(1, a), ok(0, 1, &big));
    assert_eq!(net.take(1, b), ok(0, 1, b"small"));
}

// ---------------------------------------------------------------------------------------------
// Eager credit
// ---------------------------------------------------------------------------------------------

#[test]
fn credit_exhaustion_switches_to_rendezvous_and_back() {
    // 2000 bytes shared by 2 ranks: 1000 bytes of credit each; a 100-byte message costs 164,
    // so six go eagerly (984).
    const LIMIT: usize = 2000;
    let mut net = Net::with(2, 500, LIMIT, 1000);
    let msg = |i: usize| pattern(100, i as u8);

    for i in 0..10 {
        let start = net.send(0, 1, 7, &msg(i));
        assert_eq!(matches!(start, SendStart::Complete), i < 6, "message {i}");
        net.run();
    }
    let s = net.stats(0);
    assert_eq!((s.eager_messages_sent, s.rendezvous_messages_sent), (6, 4));
    let r = net.stats(1);
    assert_eq!((r.unexpected_messages, r.unexpected_bytes), (10, 600));

    // Receive in order; credit flows back in batches of at least a quarter of the allowance.
    for i in 0..10 {
        let id = net.recv(1, Some(0), None, None);
        net.run();
        assert_eq!(net.take(1, id), ok(0, 7, &msg(i)), "message {i}");
        if i == 1 {
            assert_eq!(net.pending(1, 0), vec![Header::Credit { bytes: 328 }]);
        }
        net.run();
    }
    assert_eq!(net.take_sends(0), 4);
    assert!(!net.ep(0).has_pending_sends());

    // All 984 bytes came back: six more go eagerly, the seventh does not.
    for i in 10..17 {
        let start = net.send(0, 1, 7, &msg(i));
        assert_eq!(matches!(start, SendStart::Complete), i < 16, "message {i}");
    }
    net.run();
    let s = net.stats(0);
    assert_eq!((s.eager_messages_sent, s.rendezvous_messages_sent), (12, 5));
    for i in 10..17 {
        let id = net.recv(1, Some(0), None, None);
        net.run();
        assert_eq!(net.take(1, id), ok(0, 7, &msg(i)), "message {i}");
    }
    assert_eq!(net.take_sends(0), 1);
    assert!(net.max_unexpected[1] <= LIMIT as u64);
    assert_eq!(net.stats(1).protocol_errors, 0);
}

#[test]
fn credit_bounds_unexpected_memory_with_interleaved_receives() {
    // Several senders stream into one receiver that receives slowly; the unexpected queue never
    // holds more than the limit, and every message arrives in per-sender order.
    const LIMIT: usize = 2000;
    let mut net = Net::with(4, 200, LIMIT, 256);
    let msg = |src: u32, i: usize| pattern(50 + (i * 37) % 250, (src * 40) as u8 + i as u8);
    let mut next = [0usize; 3];
    for round in 0..30 {
        for src in 0..3u32 {
            net.send(src, 3, src, &msg(src, round));
        }
        net.run_shuffled();
        if round % 3 == 2 {
            // Receive a few from each sender.
            for src in 0..3u32 {
                for _ in 0..2 {
                    let id = net.recv(3, Some(src), None, None);
                    net.run_shuffled();
                    let i = next[src as usize];
                    assert_eq!(net.take(3, id), ok(src, src, &msg(src, i)));
                    next[src as usize] += 1;
                    net.run_shuffled();
                }
            }
        }
    }
    for src in 0..3u32 {
        while next[src as usize] < 30 {
            let id = net.recv(3, Some(src), None, None);
            net.run_shuffled();
            let i = next[src as usize];
            assert_eq!(net.take(3, id), ok(src, src, &msg(src, i)));
            next[src as usize] += 1;
        }
    }
    net.run_shuffled();
    assert!(
        net.max_unexpected[3] <= LIMIT as u64,
        "{}",
        net.max_unexpected[3]
    );
    let rdv: u64 = (0..3).map(|r| net.stats(r).rendezvous_messages_sent).sum();
    let eager: u64 = (0..3).map(|r| net.stats(r).eager_messages_sent).sum();
    assert!(rdv > 0 && eager > 0, "eager {eager}, rendezvous {rdv}");
    assert_eq!(eager + rdv, 90);
    let finished: usize = (0..3).map(|r| net.take_sends(r)).sum();
    assert_eq!(finished as u64, rdv);
    assert!((0..3).all(|r| !net.ep(r).has_pending_sends()));
    assert_eq!(net.stats(3).unexpected_messages, 0);
    assert_eq!(net.stats(3).protocol_errors, 0);
}

// ---------------------------------------------------------------------------------------------
// MPI ordering
// ---------------------------------------------------------------------------------------------

/// Ranks 0, 1, 2 send to rank 3; frames are delivered so that rank 3 sees
/// a0 b0 c0 b1 a1 c1 a2 (a* from rank 0, b* from 1, c* from 2).
fn three_senders_interleaved() -> Net {
    let mut net = Net::new(4);
    net.send(0, 3, 1, b"a0");
    net.send(0, 3, 2, b"a1");
    net.send(0, 3, 1, b"a2");
    net.send(1, 3, 1, b"b0");
    net.send(1, 3, 2, b"b1");
    net.send(2, 3, 2, b"c0");
    net.send(2, 3, 1, b"c1");
    for from in [0, 1, 2, 1, 0, 2, 0] {
        net.deliver(from, 3);
    }
    assert_eq!(net.in_flight(), 0);
    net
}

#[test]
fn source_receives_never_overtake_and_wildcards_follow_arrival() {
    let mut net = three_senders_interleaved();
    fn recv(net: &mut Net, source: Option<u32>, tag: Option<u32>) -> Result<Msg, Error> {
        let id = net.recv(3, source, tag, None);
        net.take(3, id).expect("an unexpected message matches")
    }
    // (0, Any): rank 0's messages in send order, whatever their tag.
    assert_eq!(Some(recv(&mut net, Some(0), None)), ok(0, 1, b"a0"));
    assert_eq!(Some(recv(&mut net, Some(0), None)), ok(0, 2, b"a1"));
    // (Any, 1): the earliest-arrived message with tag 1.
    assert_eq!(Some(recv(&mut net, None, Some(1))), ok(1, 1, b"b0"));
    // (Any, Any): the rest in arrival order.
    assert_eq!(Some(recv(&mut net, None, None)), ok(2, 2, b"c0"));
    assert_eq!(Some(recv(&mut net, None, None)), ok(1, 2, b"b1"));
    assert_eq!(Some(recv(&mut net, None, None)), ok(2, 1, b"c1"));
    assert_eq!(Some(recv(&mut net, None, None)), ok(0, 1, b"a2"));
    assert_eq!(net.stats(3).unexpected_messages, 0);
}

#[test]
fn posted_wildcards_are_served_in_arrival_order() {
    let mut net = Net::new(4);
    let any1 = net.recv(3, None, None, None);
    let from1 = net.recv(3, Some(1), None, None);
    let any2 = net.recv(3, None, None, None);
    let any3 = net.recv(3, None, None, None);
    let from0 = net.recv(3, Some(0), None, None);
    net.send(0, 3, 1, b"a0");
    net.send(0, 3, 2, b"a1");
    net.send(1, 3, 1, b"b0");
    net.send(1, 3, 2, b"b1");
    net.send(2, 3, 2, b"c0");
    for from in [0, 1, 2, 1, 0] {
        net.deliver(from, 3);
    }
    // Each message takes the earliest-posted receive it matches.
    assert_eq!(net.take(3, any1), ok(0, 1, b"a0"));
    assert_eq!(net.take(3, from1), ok(1, 1, b"b0"));
    assert_eq!(net.take(3, any2), ok(2, 2, b"c0"));
    assert_eq!(net.take(3, any3), ok(1, 2, b"b1"));
    assert_eq!(net.take(3, from0), ok(0, 2, b"a1"));
    let s = net.stats(3);
    assert_eq!((s.posted_receives, s.unexpected_messages), (0, 0));
}

// ---------------------------------------------------------------------------------------------
// Truncation
// ---------------------------------------------------------------------------------------------

#[test]
fn truncated_unexpected_message_stays_first_in_line() {
    let mut net = Net::new(2);
    let long = pattern(100, 5);
    net.send(0, 1, 1, &long);
    net.send(0, 1, 2, b"short");
    net.run();
    net.events(1);

    let small = net.recv(1, Some(0), None, Some(50));
    assert_eq!(
        net.events(1),
        vec![Event::RecvDone(small), Event::Unexpected]
    );
    assert_eq!(
        net.take(1, small),
        Some(Err(Error::Truncated {
            len: 100,
            capacity: 50,
            from: 0,
            tag: 1,
        }))
    );
    let s = net.stats(1);
    assert_eq!((s.unexpected_messages, s.unexpected_bytes), (2, 105));
    let any = Selector {
        context: CTX,
        source: Some(0),
        tag: None,
    };
    assert_eq!(net.ep(1).probe(&any), Some((0, 1, 100)));

    let big = net.recv(1, Some(0), None, Some(100));
    assert_eq!(net.take(1, big), ok(0, 1, &long));
    let next = net.recv(1, Some(0), None, Some(100));
    assert_eq!(net.take(1, next), ok(0, 2, b"short"));
    assert_eq!(net.stats(1).unexpected_bytes, 0);
}

#[test]
fn truncating_receive_posted_before_arrival() {
    let mut net = Net::new(2);
    let long = pattern(100, 6);
    let small = net.recv(1, Some(0), None, Some(50));
    net.send(0, 1, 1, &long);
    net.send(0, 1, 2, b"later");
    net.run();
    assert_eq!(
        net.events(1),
        vec![Event::RecvDone(small), Event::Unexpected, Event::Unexpected]
    );
    assert_eq!(
        net.take(1, small),
        Some(Err(Error::Truncated {
            len: 100,
            capacity: 50,
            from: 0,
            tag: 1,
        }))
    );
    let a = net.recv(1, Some(0), None, None);
    let b = net.recv(1, Some(0), None, None);
    assert_eq!(net.take(1, a), ok(0, 1, &long));
    assert_eq!(net.take(1, b), ok(0, 2, b"later"));
}

#[test]
fn truncated_message_goes_to_next_posted_receive() {
    let mut net = Net::new(2);
    let long = pattern(100, 7);
    let small = net.recv(1, Some(0), None, Some(10));
    let also_small = net.recv(1, None, None, Some(99));
    let big = net.recv(1, None, Some(1), None);
    net.send(0, 1, 1, &long);
    net.run();
    assert_eq!(
        net.events(1),
        vec![
            Event::RecvDone(small),
            Event::RecvDone(also_small),
            Event::RecvDone(big),
        ]
    );
    assert!(matches!(
        net.take(1, small),
        Some(Err(Error::Truncated { capacity: 10, .. }))
    ));
    assert!(matches!(
        net.take(1, also_small),
        Some(Err(Error::Truncated { capacity: 99, .. }))
    ));
    assert_eq!(net.take(1, big), ok(0, 1, &long));
    assert_eq!(net.stats(1).unexpected_messages, 0);
}

#[test]
fn truncated_rendezvous_leaves_data_at_sender() {
    let mut net = Net::with(2, 1024, 1 << 20, 1000);
    let msg = pattern(3000, 8);
    let s = pending_id(net.send(0, 1, 4, &msg));
    net.send(0, 1, 4, b"after");
    net.run();
    let small = net.recv(1, Some(0), Some(4), Some(2999));
    assert_eq!(
        net.take(1, small),
        Some(Err(Error::Truncated {
            len: 3000,
            capacity: 2999,
            from: 0,
            tag: 4,
        }))
    );
    assert_eq!(net.in_flight(), 0, "no CTS for a truncated receive");
    assert!(net.ep(0).has_pending_sends());

    let a = net.recv(1, Some(0), Some(4), Some(3000));
    let b = net.recv(1, Some(0), Some(4), Some(3000));
    net.run_shuffled();
    assert_eq!(net.ep(0).take_send(s), Some(Ok(())));
    assert_eq!(net.take(1, a), ok(0, 4, &msg));
    assert_eq!(net.take(1, b), ok(0, 4, b"after"));
}

// ---------------------------------------------------------------------------------------------
// Cancellation
// ---------------------------------------------------------------------------------------------

#[test]
fn cancelled_unmatched_receive_is_withdrawn() {
    // Posted in the matcher, and started alone (outside it) as the driver does.
    for alone in [false, true] {
        let mut net = Net::new(2);
        let post = |net: &mut Net| match alone {
            false => net.recv(1, Some(0), Some(5), None),
            true => net.start(1, selector(Some(0), Some(5)), None),
        };
        let r = post(&mut net);
        net.cancel(1, r);
        assert_eq!(net.stats(1).posted_receives, 0);
        net.send(0, 1, 5, b"x");
        net.run();
        assert_eq!(net.events(1), vec![Event::Unexpected]);
        assert_eq!(net.take(1, r), None);
        assert_eq!(net.stats(1).unexpected_messages, 1);
        let again = post(&mut net);
        assert_eq!(net.take(1, again), ok(0, 5, b"x"));
        // Cancelling a finished-and-taken or unknown receive does nothing.
        net.cancel(1, r);
        net.cancel(1, again);
        assert_eq!(net.stats(1).posted_receives, 0);
        assert_eq!(net.stats(1).unexpected_messages, 0);
    }
}

#[test]
fn cancelled_matched_eager_message_goes_back_in_place() {
    let mut net = Net::new(2);
    net.send(0, 1, 1, b"first");
    net.send(0, 1, 2, b"second");
    net.run();
    let r = net.recv(1, Some(0), Some(1), None);
    assert_eq!(net.stats(1).unexpected_messages, 1);
    net.cancel(1, r);
    assert_eq!(net.take(1, r), None);
    let s = net.stats(1);
    assert_eq!((s.unexpected_messages, s.unexpected_bytes), (2, 11));
    assert_eq!(net.in_flight(), 0, "no credit returned for data not taken");

    let a = net.recv(1, Some(0), None, None);
    let b = net.recv(1, Some(0), None, None);
    assert_eq!(net.take(1, a), ok(0, 1, b"first"));
    assert_eq!(net.take(1, b), ok(0, 2, b"second"));
}

#[test]
fn cancelled_matched_message_goes_to_waiting_receive() {
    let mut net = Net::new(2);
    let first = net.recv(1, Some(0), None, None);
    let waiting = net.recv(1, None, None, None);
    net.send(0, 1, 1, b"m");
    net.run();
    assert_eq!(net.events(1), vec![Event::RecvDone(first)]);
    net.cancel(1, first);
    assert_eq!(net.events(1), vec![Event::RecvDone(waiting)]);
    assert_eq!(net.take(1, waiting), ok(0, 1, b"m"));
}

#[test]
fn cancelled_rendezvous_receive_finishes_and_requeues() {
    let mut net = Net::with(2, 1024, 1 << 20, 1000);
    let msg = pattern(10_000, 9);
    let s = pending_id(net.send(0, 1, 3, &msg));
    let r = net.recv(1, Some(0), None, None);
    net.deliver(0, 1); // RTS
    net.deliver(1, 0); // CTS
    assert_eq!(net.ep(0).take_send(s), Some(Ok(())));
    for i in [7, 2, 0] {
        net.deliver_at(0, 1, i);
    }
    net.cancel(1, r);
    // The message went back to the unexpected queue at once (its place in line is kept while
    // the data still arrives), not to `r`.
    assert_eq!(net.events(1), vec![Event::Unexpected]);
    net.run_shuffled();
    assert_eq!(net.events(1), vec![]);
    assert_eq!(net.take(1, r), None);
    let any = Selector {
        context: CTX,
        source: None,
        tag: None,
    };
    assert_eq!(net.ep(1).probe(&any), Some((0, 3, 10_000)));
    let again = net.recv(1, None, None, None);
    assert_eq!(net.take(1, again), ok(0, 3, &msg));
    assert_eq!(net.stats(1).protocol_errors, 0);
    assert_eq!(net.stats(1).unexpected_bytes, 0);
}

#[test]
fn cancelled_rendezvous_receive_feeds_receive_posted_meanwhile() {
    let mut net = Net::with(2, 1024, 1 << 20, 1000);
    let msg = pattern(4000, 10);
    pending_id(net.send(0, 1, 3, &msg));
    let r = net.recv(1, Some(0), None, None);
    net.deliver(0, 1); // RTS
    net.deliver(1, 0); // CTS
    net.deliver(0, 1); // first fragment
    net.cancel(1, r);
    let next = net.recv(1, Some(0), Some(3), None);
    net.events(1);
    net.run_shuffled();
    assert_eq!(net.events(1), vec![Event::RecvDone(next)]);
    assert_eq!(net.take(1, next), ok(0, 3, &msg));
    assert_eq!(net.take(1, r), None);
}

/// Design: a matched receive that is dropped puts its message back "at its original arrival
/// position (order preserved); if the data was still arriving (rendezvous), it finishes
/// arriving and then goes back". While the orphaned data is arriving, a later message from the
/// same source must not overtake it.
#[test]
fn cancelled_rendezvous_receive_is_not_overtaken_by_later_message() {
    let mut net = Net::with(2, 1024, 1 << 20, 1000);
    let big = pattern(4000, 11);
    pending_id(net.send(0, 1, 1, &big));
    assert_eq!(net.send(0, 1, 1, b"later"), SendStart::Complete);
    net.deliver(0, 1); // RTS of the big message
    let r = net.recv(1, Some(0), None, None);
    net.deliver(1, 0); // CTS
    net.cancel(1, r); // orphaned mid-transfer
    net.deliver(0, 1); // the eager "later" message: unexpected

    // The application receives from rank 0 again: it must get the first message sent.
    let next = net.recv(1, Some(0), None, None);
    net.run_shuffled();
    assert_eq!(
        net.take(1, next),
        ok(0, 1, &big),
        "overtaken by a later message"
    );
    let after = net.recv(1, Some(0), None, None);
    assert_eq!(net.take(1, after), ok(0, 1, b"later"));
}

// ---------------------------------------------------------------------------------------------
// Lost peers
// ---------------------------------------------------------------------------------------------

#[test]
fn peer_lost_fails_what_depends_on_it() {
    let mut net = Net::with(3, 1024, 1 << 20, 1000);
    // Rank 1 sent rank 0 an eager message before dying.
    net.send(1, 0, 1, b"last words");
    net.run();
    net.events(0);
    let named = net.recv(0, Some(1), Some(9), None);
    let other_peer = net.recv(0, Some(2), Some(9), None);
    let any = net.recv(0, None, Some(9), None);
    let s = pending_id(net.send(0, 1, 4, &pattern(2000, 12)));
    let s2 = pending_id(net.send(0, 2, 4, &pattern(2000, 13)));
    net.links.clear(); // rank 1 is gone; drop what was in flight (the RTS to 1, 2)
    net.peer_lost(0, 1);

    assert_eq!(
        net.events(0),
        vec![Event::RecvDone(named), Event::SendDone(s)]
    );
    assert_eq!(net.take(0, named), Some(Err(Error::PeerFailed { rank: 1 })));
    assert_eq!(
        net.ep(0).take_send(s),
        Some(Err(Error::PeerFailed { rank: 1 }))
    );
    assert_eq!(net.take(0, other_peer), None);
    assert_eq!(net.take(0, any), None, "any-source receives stay posted");
    assert_eq!(net.ep(0).take_send(s2), None);
    assert_eq!(
        net.try_send(0, 1, 4, b"x"),
        Err(Error::PeerFailed { rank: 1 })
    );
    assert_eq!(net.in_flight(), 0, "a failed send transmits nothing");

    // What rank 1 sent before it died is still there.
    let old = net.recv(0, Some(1), None, None);
    assert_eq!(net.take(0, old), ok(1, 1, b"last words"));
    let more = net.recv(0, Some(1), None, None);
    assert_eq!(
        net.events(0),
        vec![Event::RecvDone(old), Event::RecvDone(more)]
    );
    assert_eq!(net.take(0, more), Some(Err(Error::PeerFailed { rank: 1 })));

    // Rank 2 is unaffected.
    net.send(2, 0, 9, b"alive");
    net.run();
    assert_eq!(net.take(0, other_peer), ok(2, 9, b"alive"));
    // A second PeerLost changes nothing.
    net.peer_lost(0, 1);
    assert_eq!(net.events(0), vec![Event::RecvDone(other_peer)]);
}

#[test]
fn peer_lost_fails_rendezvous_receive_in_flight() {
    let mut net = Net::with(2, 1024, 1 << 20, 1000);
    let msg = pattern(5000, 14);
    pending_id(net.send(0, 1, 1, &msg));
    let r = net.recv(1, Some(0), None, None);
    net.deliver(0, 1); // RTS
    net.deliver(1, 0); // CTS
    net.deliver(0, 1); // one fragment
    net.links.clear();
    net.events(1);
    net.peer_lost(1, 0);
    assert_eq!(net.events(1), vec![Event::RecvDone(r)]);
    assert_eq!(net.take(1, r), Some(Err(Error::PeerFailed { rank: 0 })));
}

#[test]
fn peer_lost_leaves_unmatched_rts_failing_its_receive() {
    let mut net = Net::with(2, 1024, 1 << 20, 1000);
    pending_id(net.send(0, 1, 1, &pattern(5000, 15)));
    net.run();
    net.peer_lost(1, 0);
    let r = net.recv(1, Some(0), None, None);
    assert_eq!(net.take(1, r), Some(Err(Error::PeerFailed { rank: 0 })));
    assert_eq!(net.in_flight(), 0, "no CTS to a lost peer");
}

// ---------------------------------------------------------------------------------------------
// Malformed input: dropped, counted, never a panic, and the endpoint keeps working
// ---------------------------------------------------------------------------------------------

/// Asserts that `rank` counted exactly `errors` protocol errors, reported nothing and sent
/// nothing.
fn assert_rejected(net: &mut Net, rank: u32, errors: u64) {
    assert_eq!(net.stats(rank).protocol_errors, errors);
    assert_eq!(net.events(rank), vec![]);
    assert_eq!(net.in_flight(), 0);
}

#[test]
fn malformed_data_for_unknown_receive() {
    let mut net = Net::new(2);
    let data = Frame {
        header: Header::Data {
            recv_id: 12345,
            offset: 0,
        },
        payload: Bytes::from_static(b"junk"),
    };
    net.inject(1, 0, data);
    assert_rejected(&mut net, 1, 1);
    assert_eq!(net.stats(1).unexpected_messages, 0);
}

#[test]
fn malformed_cts_for_unknown_send() {
    let mut net = Net::new(2);
    net.inject(
        0,
        1,
        Frame::control(Header::Cts {
            send_id: 999,
            recv_id: 0,
        }),
    );
    assert_rejected(&mut net, 0, 1);
}

#[test]
fn malformed_cts_from_wrong_peer_or_twice() {
    let mut net = Net::with(3, 1024, 1 << 20, 1000);
    let msg = pattern(2000, 16);
    let s = pending_id(net.send(0, 1, 1, &msg));
    // Rank 2 forges the CTS for a send to rank 1.
    let forged = Frame::control(Header::Cts {
        send_id: s.0,
        recv_id: 0,
    });
    net.inject(0, 2, forged.clone());
    assert_eq!(net.stats(0).protocol_errors, 1);
    assert_eq!(net.events(0), vec![]);
    assert_eq!(net.pending(0, 2), vec![]);

    let r = net.recv(1, Some(0), None, None);
    net.deliver(0, 1); // RTS
    let cts = net.links[&(1, 0)][0].clone();
    net.deliver(1, 0);
    assert_eq!(net.events(0), vec![Event::SendDone(s)]);
    net.inject(0, 1, cts); // a duplicate CTS
    assert_eq!(net.stats(0).protocol_errors, 2);
    assert_eq!(net.events(0), vec![]);
    net.run_shuffled();
    assert_eq!(net.take(1, r), ok(0, 1, &msg));
    assert_eq!(net.stats(1).protocol_errors, 0);
}

#[test]
fn malformed_data_fragments_out_of_bounds_overlapping_or_from_wrong_peer() {
    let mut net = Net::with(3, 1024, 1 << 20, 1000);
    let msg = pattern(10_000, 17);
    pending_id(net.send(0, 1, 1, &msg));
    let r = net.recv(1, Some(0), None, None);
    net.deliver(0, 1); // RTS
    let recv_id = cts_recv_id(&net, 1, 0);
    net.deliver(1, 0); // CTS
    let data = |offset: u64, len: usize| Frame {
        header: Header::Data { recv_id, offset },
        payload: Bytes::from(vec![0xEE; len]),
    };
    net.inject(1, 0, data(9500, 1000)); // past the end
    net.inject(1, 0, data(u64::MAX, 1)); // offset + len overflows
    net.inject(1, 0, data(10_000, 1)); // starts at the end
    net.inject(1, 2, data(0, 1000)); // right id, wrong peer
    assert_eq!(net.stats(1).protocol_errors, 4);

    net.deliver(0, 1); // real fragment at 0
    net.inject(1, 0, data(500, 1000)); // overlaps it
    net.inject(1, 0, data(0, 1000)); // duplicate
    assert_eq!(net.stats(1).protocol_errors, 6);
    assert_eq!(net.events(1), vec![]);

    net.run_shuffled();
    assert_eq!(net.events(1), vec![Event::RecvDone(r)]);
    assert_eq!(net.take(1, r), ok(0, 1, &msg));
    // Late data for the finished (and taken) receive.
    net.inject(1, 0, data(0, 1000));
    assert_eq!(net.stats(1).protocol_errors, 7);
}

#[test]
fn malformed_eager_length_disagrees_with_payload() {
    let mut net = Net::new(2);
    let bad = Frame {
        header: Header::Eager(env(1, 0, 10)),
        payload: Bytes::from_static(b"short"),
    };
    net.inject(1, 0, bad);
    assert_rejected(&mut net, 1, 1);
    assert_eq!(net.stats(1).unexpected_messages, 0);
    // The genuine message 0 is still accepted.
    net.send(0, 1, 1, b"fine");
    net.run();
    let r = net.recv(1, Some(0), None, None);
    assert_eq!(net.take(1, r), ok(0, 1, b"fine"));
    assert_eq!(net.stats(1).protocol_errors, 1);
}

#[test]
fn malformed_out_of_sequence_messages() {
    let mut net = Net::new(2);
    net.inject(1, 0, eager_frame(1, 5, b"future"));
    assert_rejected(&mut net, 1, 1);
    let rts = Frame::control(Header::Rts {
        envelope: env(1, 3, 5000),
        send_id: 1,
        attached: false,
    });
    net.inject(1, 0, rts);
    assert_rejected(&mut net, 1, 2);

    net.inject(1, 0, eager_frame(1, 0, b"zero"));
    net.inject(1, 0, eager_frame(1, 0, b"replay"));
    assert_eq!(net.stats(1).protocol_errors, 3);
    net.inject(1, 0, eager_frame(1, 1, b"one"));
    assert_eq!(net.events(1), vec![Event::Unexpected, Event::Unexpected]);
    let a = net.recv(1, Some(0), None, None);
    let b = net.recv(1, Some(0), None, None);
    assert_eq!(net.take(1, a), ok(0, 1, b"zero"));
    assert_eq!(net.take(1, b), ok(0, 1, b"one"));
}

#[test]
fn malformed_frame_from_rank_outside_the_job() {
    let mut net = Net::new(2);
    let any = net.recv(1, None, None, None);
    net.inject(1, 2, eager_frame(1, 0, b"ghost"));
    net.inject(1, u32::MAX, eager_frame(1, 0, b"ghost"));
    net.inject(1, 7, Frame::control(Header::Credit { bytes: 1 << 40 }));
    assert_rejected(&mut net, 1, 3);
    assert_eq!(net.take(1, any), None);
    assert_eq!(net.stats(1).frames_received, 3);
}

/// An RTS may claim any length. Whether the endpoint refuses the RTS or the data, a forged
/// length must not make it panic (today the first fragment makes the reassembler allocate the
/// claimed length: `capacity overflow` here, an allocation abort for merely huge lengths).
#[test]
fn malformed_rts_with_absurd_length_does_not_panic() {
    let mut net = Net::new(2);
    let rts = Frame::control(Header::Rts {
        envelope: env(1, 0, u64::MAX),
        send_id: 1,
        attached: false,
    });
    net.inject(1, 0, rts);
    let r = net.recv(1, Some(0), None, None);
    let cts = net.pending(1, 0).into_iter().find_map(|h| match h {
        Header::Cts { recv_id, .. } => Some(recv_id),
        _ => None,
    });
    net.links.clear();
    if let Some(recv_id) = cts {
        let frag = Frame {
            header: Header::Data { recv_id, offset: 0 },
            payload: Bytes::from_static(b"tiny"),
        };
        net.inject(1, 0, frag);
    }
    assert!(
        net.stats(1).protocol_errors >= 1,
        "the forged length went unnoticed"
    );
    assert!(!matches!(net.take(1, r), Some(Ok(_))));
}

// ---------------------------------------------------------------------------------------------
// Self-send
// ---------------------------------------------------------------------------------------------

#[test]
fn self_send_eager() {
    let mut net = Net::new(2);
    assert_eq!(net.send(1, 1, 4, b"me"), SendStart::Complete);
    assert_eq!(net.events(1), vec![Event::Unexpected]);
    let r = net.recv(1, Some(1), Some(4), None);
    assert_eq!(net.events(1), vec![Event::RecvDone(r)]);
    assert_eq!(net.take(1, r), ok(1, 4, b"me"));

    let posted = net.recv(1, None, None, None);
    assert_eq!(net.send(1, 1, 5, b"again"), SendStart::Complete);
    assert_eq!(net.events(1), vec![Event::RecvDone(posted)]);
    assert_eq!(net.take(1, posted), ok(1, 5, b"again"));
    assert_eq!(net.in_flight(), 0, "self-sends never reach the transport");
    assert_eq!(net.stats(1).frames_sent, 0);
}

#[test]
fn self_send_rendezvous() {
    let mut net = Net::with(1, 1024, 1 << 20, 1000);
    let msg = pattern(5500, 18);
    let s = pending_id(net.send(0, 0, 4, &msg));
    assert_eq!(net.events(0), vec![Event::Unexpected]);
    let r = net.recv(0, Some(0), Some(4), None);
    assert_eq!(net.events(0), vec![Event::SendDone(s), Event::RecvDone(r)]);
    assert_eq!(net.ep(0).take_send(s), Some(Ok(())));
    assert_eq!(net.take(0, r), ok(0, 4, &msg));

    // Receive posted first.
    let r = net.recv(0, None, None, None);
    let s = pending_id(net.send(0, 0, 5, &msg));
    assert_eq!(net.events(0), vec![Event::SendDone(s), Event::RecvDone(r)]);
    assert_eq!(net.ep(0).take_send(s), Some(Ok(())));
    assert_eq!(net.take(0, r), ok(0, 5, &msg));
    assert!(!net.ep(0).has_pending_sends());
    assert_eq!(net.in_flight(), 0);
    assert_eq!(net.stats(0).protocol_errors, 0);
}

#[test]
fn self_send_credit_returns() {
    // Credit 1000: a 436-byte message costs 500, so two fit, the third needs rendezvous until
    // the receives give the credit back.
    let mut net = Net::with(1, 1000, 1000, 1000);
    for round in 0..5 {
        for i in 0..2u8 {
            let start = net.send(0, 0, 1, &pattern(436, i));
            assert_eq!(start, SendStart::Complete, "round {round}");
        }
        for i in 0..2u8 {
            let r = net.recv(0, None, None, None);
            assert_eq!(net.take(0, r), ok(0, 1, &pattern(436, i)));
        }
    }
    assert_eq!(net.stats(0).rendezvous_messages_sent, 0);
}

/// The unexpected limit holds "from all senders together": a rank's messages to itself must
/// not let the queue grow past it.
#[test]
fn self_send_counts_against_the_unexpected_limit() {
    const LIMIT: usize = 1000;
    let mut net = Net::with(3, 1000, LIMIT, 1000);
    // Fill rank 1's queue from every rank, itself included, with eager messages only.
    for from in [0, 2, 1] {
        // One 436-byte message uses up a sender's 500 bytes of credit.
        while let SendStart::Complete = net.send(from, 1, 0, &pattern(436, from as u8)) {}
        net.run();
    }
    assert!(
        net.max_unexpected[1] <= LIMIT as u64,
        "unexpected_bytes reached {}",
        net.max_unexpected[1]
    );
}

// ---------------------------------------------------------------------------------------------
// Dropped send futures
// ---------------------------------------------------------------------------------------------

#[test]
fn forgotten_rendezvous_send_still_completes() {
    let mut net = Net::with(2, 1024, 1 << 20, 1000);
    let msg = pattern(3000, 19);
    let s = pending_id(net.send(0, 1, 2, &msg));
    net.ep(0).forget_send(s);
    assert!(net.ep(0).has_pending_sends(), "the data is still needed");
    net.run();
    assert!(net.ep(0).has_pending_sends());

    let r = net.recv(1, Some(0), Some(2), None);
    net.run_shuffled();
    assert_eq!(net.take(1, r), ok(0, 2, &msg));
    assert_eq!(net.events(0), vec![], "no SendDone for a forgotten send");
    assert!(!net.ep(0).has_pending_sends());
    assert_eq!(net.ep(0).take_send(s), None);
}

#[test]
fn forgetting_a_finished_send_releases_it() {
    let mut net = Net::with(2, 1024, 1 << 20, 1000);
    let s = pending_id(net.send(0, 1, 2, &pattern(3000, 20)));
    net.recv(1, Some(0), Some(2), None);
    net.run();
    assert_eq!(net.events(0), vec![Event::SendDone(s)]);
    assert!(net.ep(0).has_pending_sends(), "result not taken yet");
    net.ep(0).forget_send(s);
    assert!(!net.ep(0).has_pending_sends());
    assert_eq!(net.ep(0).take_send(s), None);
}

#[test]
fn forgotten_send_to_lost_peer_is_dropped_silently() {
    let mut net = Net::with(2, 1024, 1 << 20, 1000);
    let s = pending_id(net.send(0, 1, 2, &pattern(3000, 21)));
    net.ep(0).forget_send(s);
    net.links.clear();
    net.peer_lost(0, 1);
    assert_eq!(net.events(0), vec![]);
    assert!(!net.ep(0).has_pending_sends());
}

// ---------------------------------------------------------------------------------------------
// Rendezvous by reference (in-process transports)
// ---------------------------------------------------------------------------------------------

#[test]
fn attached_rendezvous_delivers_on_match_and_completes_the_sender() {
    let mut net = Net::by_reference(2);
    let msg = pattern(10_000, 5);
    let s = pending_id(net.send(0, 1, 4, &msg));
    assert!(matches!(
        net.pending(0, 1)[..],
        [Header::Rts { attached: true, .. }]
    ));
    net.run();
    // The sender still waits: nobody has matched the message yet.
    assert_eq!(net.ep(0).take_send(s), None);
    let r = net.recv(1, Some(0), Some(4), None);
    assert_eq!(net.take(1, r), ok(0, 4, &msg));
    net.run();
    assert_eq!(net.events(0), vec![Event::SendDone(s)]);
    assert_eq!(net.ep(0).take_send(s), Some(Ok(())));
    // RTS and CTS only: no data fragments.
    assert_eq!(net.stats(0).frames_sent, 1);
    assert_eq!(net.stats(1).frames_sent, 1);
    assert_eq!(net.stats(1).unexpected_bytes, 0);
}

#[test]
fn attached_rendezvous_truncation_and_cancel_keep_the_message() {
    let mut net = Net::by_reference(2);
    let msg = pattern(5000, 6);
    let s = pending_id(net.send(0, 1, 1, &msg));
    net.send(0, 1, 1, b"after");
    net.run();
    let small = net.recv(1, Some(0), None, Some(100));
    assert!(matches!(
        net.take(1, small),
        Some(Err(Error::Truncated { len: 5000, .. }))
    ));
    // Matched, then dropped before it was taken: back in its place, ahead of "after".
    let dropped = net.recv(1, Some(0), None, None);
    net.cancel(1, dropped);
    let first = net.recv(1, Some(0), None, None);
    let second = net.recv(1, Some(0), None, None);
    assert_eq!(net.take(1, first), ok(0, 1, &msg));
    assert_eq!(net.take(1, second), ok(0, 1, b"after"));
    net.run();
    assert_eq!(net.ep(0).take_send(s), Some(Ok(())));
}

#[test]
fn attached_rendezvous_survives_the_sender_being_lost() {
    let mut net = Net::by_reference(2);
    let msg = pattern(3000, 7);
    pending_id(net.send(0, 1, 2, &msg));
    net.run();
    net.peer_lost(1, 0);
    // The data is here already: the message is still received intact.
    let r = net.recv(1, Some(0), Some(2), None);
    assert_eq!(net.take(1, r), ok(0, 2, &msg));
    assert_eq!(net.pending(1, 0), vec![]);
}

#[test]
fn malformed_attached_rts_is_rejected() {
    let mut net = Net::by_reference(2);
    let rts = Frame {
        header: Header::Rts {
            envelope: env(1, 0, 5000),
            send_id: 1,
            attached: true,
        },
        payload: Bytes::from_static(b"short"),
    };
    net.inject(1, 0, rts);
    assert_rejected(&mut net, 1, 1);
}

// The short cut of a receive waiting for one sender (`direct_want` / `take_direct`, through `accept_direct`): it takes
// exactly what matching would have given it, and declines everything else.

#[test]
fn a_lone_receive_takes_its_eager_message_where_it_lies() {
    let mut net = Net::new(2);
    let r = net.recv(1, Some(0), Some(7), None);
    assert_eq!(net.ep(1).direct_want(r).map(|d| d.want.from), Some(0));
    net.send(0, 1, 7, b"hello");
    let m = net.offer(1, r).expect("taken in place");
    assert_eq!(Some(Ok(m)), ok(0, 7, b"hello"));
    assert_eq!(net.in_flight(), 0);
    assert_eq!(
        net.events(1),
        vec![],
        "no completion event: the caller has the result"
    );
    let s = net.stats(1);
    assert_eq!((s.frames_received, s.bytes_received), (1, 5));
    assert_eq!((s.posted_receives, s.unexpected_messages), (0, 0));
    assert_eq!(net.take(1, r), None, "the receive is gone");
    // The stream goes on through the usual path, in sequence.
    let r2 = net.recv(1, Some(0), None, None);
    net.send(0, 1, 8, b"next");
    net.run();
    assert_eq!(net.take(1, r2), ok(0, 8, b"next"));
    assert_eq!(net.stats(1).protocol_errors, 0);
}

#[test]
fn the_short_cut_declines_what_matching_would_not_give_the_receive() {
    let mut net = Net::new(3);
    // A wildcard receive: no single sender.
    let any = net.recv(1, None, Some(1), None);
    assert_eq!(net.ep(1).direct_want(any).map(|d| d.want.from), None);
    net.cancel(1, any);
    // Another receive is queued: it may have a claim on the same message.
    let a = net.recv(1, Some(0), None, None);
    let b = net.recv(1, Some(0), Some(1), None);
    assert_eq!(net.ep(1).direct_want(a).map(|d| d.want.from), None);
    assert_eq!(net.ep(1).direct_want(b).map(|d| d.want.from), None);
    net.cancel(1, a);
    // Wrong tag, a message too long, a rendezvous request: declined and left in place.
    net.send(0, 1, 2, b"other tag");
    assert!(net.offer(1, b).is_none());
    assert_eq!(net.pending(0, 1).len(), 1);
    net.run();
    let small = net.recv(1, Some(0), Some(2), Some(4));
    assert_eq!(
        net.take(1, small).map(|r| r.is_err()),
        Some(true),
        "truncated"
    );
    let fits = net.recv(1, Some(0), Some(2), None);
    assert_eq!(net.take(1, fits), ok(0, 2, b"other tag"));
    let big = pattern(2000, 3);
    net.send(0, 1, 1, &big);
    assert!(matches!(net.pending(0, 1)[..], [Header::Rts { .. }]));
    assert!(net.offer(1, b).is_none());
    net.run();
    assert_eq!(net.take(1, b), ok(0, 1, &big));
    // A message from another sender is not this receive's.
    let c = net.recv(1, Some(0), Some(1), None);
    net.send(2, 1, 1, b"from 2");
    let frame = net.links[&(2, 1)].front().cloned().expect("queued");
    assert!(
        net.ep(1)
            .accept_direct(c, 2, &frame.header, &frame.payload)
            .is_none()
    );
    // Nor is a message out of sequence (a replayed one).
    net.send(0, 1, 1, b"in order");
    let mut replay = net.links[&(0, 1)].front().cloned().expect("queued");
    if let Header::Eager(e) = &mut replay.header {
        e.seq += 5;
    }
    assert!(
        net.ep(1)
            .accept_direct(c, 0, &replay.header, &replay.payload)
            .is_none()
    );
    assert_eq!(
        net.offer(1, c),
        Some(Msg(Received {
            source: 0,
            tag: 1,
            data: Bytes::from_static(b"in order")
        }))
    );
    assert_eq!(net.stats(1).protocol_errors, 0);
}

#[test]
fn a_message_taken_in_place_and_given_back_keeps_its_place() {
    let mut net = Net::new(2);
    let r = net.recv(1, Some(0), None, None);
    net.send(0, 1, 1, b"first");
    let frame = net.links.get_mut(&(0, 1)).and_then(VecDeque::pop_front);
    let frame = frame.expect("queued");
    let taken = net.ep(1).accept_direct(r, 0, &frame.header, &frame.payload);
    let taken = taken.expect("taken in place");
    net.send(0, 1, 2, b"second");
    net.run();
    // The application dropped the message unread: it goes back ahead of the later one.
    net.ep(1).give_back(taken);
    let a = net.recv(1, Some(0), None, None);
    let b = net.recv(1, Some(0), None, None);
    assert_eq!(net.take(1, a), ok(0, 1, b"first"));
    assert_eq!(net.take(1, b), ok(0, 2, b"second"));
}

#[test]
fn credit_taken_in_place_is_given_back() {
    // 64 KiB of unexpected limit over two ranks: 32 KiB of credit each, given back in quarters.
    let mut net = Net::with(2, 1024, 64 * 1024, 1000);
    for i in 0..100u32 {
        let r = net.recv(1, Some(0), None, None);
        net.send(0, 1, i, &[1u8; 900]);
        if net.offer(1, r).is_none() {
            // A credit frame was first in line: the usual path delivers both.
            net.run();
            assert_eq!(net.take(1, r).map(|m| m.is_ok()), Some(true));
        }
        net.run();
    }
    let s = net.stats(0);
    assert_eq!(
        s.rendezvous_messages_sent, 0,
        "credit came back: every send stayed eager"
    );
}

// ---------------------------------------------------------------------------------------------
// Lone receives (started while nothing else waits; see `protocol/lone.rs`)
// ---------------------------------------------------------------------------------------------

#[test]
fn a_lone_receive_is_taken_in_place_or_joins_when_its_message_is_handled() {
    let mut net = Net::new(2);
    // Taken straight from the link: nothing was posted in the matcher.
    let r = net.start(1, selector(Some(0), Some(1)), None);
    assert_eq!(net.stats(1).posted_receives, 1);
    assert_eq!(net.ep(1).direct_want(r).map(|d| d.want.from), Some(0));
    assert_eq!(net.take(1, r), None, "still waiting");
    net.send(0, 1, 1, b"in place");
    assert_eq!(
        net.offer(1, r).map(|m| m.0.data),
        Some(Bytes::from_static(b"in place"))
    );
    assert_eq!(net.stats(1).posted_receives, 0);
    // Handled instead (a pump): it joins the matcher, matches, and finishes under its own id.
    let r = net.start(1, selector(Some(0), Some(1)), None);
    net.send(0, 1, 1, b"handled");
    net.run();
    assert_eq!(net.finished(1), vec![Event::RecvDone(r)]);
    assert_eq!(net.take(1, r), ok(0, 1, b"handled"));
    assert_eq!(net.take(1, r), None, "taken once");
    // Neither kept anything behind.
    assert_eq!(net.stats(1).posted_receives, 0);
    assert_eq!(net.stats(1).unexpected_messages, 0);
}

#[test]
fn receives_started_after_a_lone_one_queue_behind_it() {
    let mut net = Net::new(3);
    let first = net.start(1, selector(Some(0), None), None);
    // A second receive for the same sender: the lone one joins first, so it keeps its place.
    let second = net.start(1, selector(Some(0), None), None);
    assert_eq!(
        net.ep(1).direct_want(first).map(|d| d.want.from),
        None,
        "no longer alone"
    );
    let any = net.start(1, selector(None, None), None);
    net.send(0, 1, 1, b"one");
    net.send(0, 1, 2, b"two");
    net.send(2, 1, 3, b"three");
    net.run();
    assert_eq!(net.take(1, first), ok(0, 1, b"one"));
    assert_eq!(net.take(1, second), ok(0, 2, b"two"));
    assert_eq!(net.take(1, any), ok(2, 3, b"three"));
    // A wildcard receive is never posted alone.
    let wild = net.start(1, selector(None, Some(4)), None);
    assert_eq!(net.ep(1).direct_want(wild).map(|d| d.want.from), None);
    net.cancel(1, wild);
}

#[test]
fn a_message_given_back_goes_to_the_lone_receive_waiting_for_it() {
    let mut net = Net::new(2);
    // Taken at once by one receive, then dropped unread while a later receive waits alone:
    // the message is the waiting receive's (it is first in line again).
    net.send(0, 1, 1, b"first");
    net.run();
    let taken = net.start(1, selector(Some(0), None), None);
    let waiting = net.start(1, selector(Some(0), None), None);
    assert_eq!(net.ep(1).direct_want(waiting).map(|d| d.want.from), Some(0));
    net.cancel(1, taken);
    assert_eq!(net.finished(1), vec![Event::RecvDone(waiting)]);
    assert_eq!(net.take(1, waiting), ok(0, 1, b"first"));
    // The same with a receive that matched through the matcher and was dropped before it
    // was taken.
    let matched = net.start(1, selector(Some(0), None), None);
    net.send(0, 1, 2, b"second");
    net.run();
    assert_eq!(net.finished(1), vec![Event::RecvDone(matched)]);
    let waiting = net.start(1, selector(Some(0), None), None);
    net.cancel(1, matched);
    assert_eq!(net.finished(1), vec![Event::RecvDone(waiting)]);
    assert_eq!(net.take(1, waiting), ok(0, 2, b"second"));
}

#[test]
fn a_lone_receive_fails_when_its_peer_is_lost_and_is_not_fooled_by_others() {
    let mut net = Net::new(3);
    let r = net.start(0, selector(Some(1), None), None);
    // Frames to self and from another rank make it join; they are not its messages.
    net.send(0, 0, 5, b"to myself");
    net.send(2, 0, 5, b"from 2");
    net.run();
    assert!(net.finished(0).is_empty());
    assert_eq!(net.take(0, r), None);
    net.peer_lost(0, 1);
    assert_eq!(net.finished(0), vec![Event::RecvDone(r)]);
    assert_eq!(net.take(0, r), Some(Err(Error::PeerFailed { rank: 1 })));
    // Started for a lost peer: fails at once.
    let again = net.start(0, selector(Some(1), None), None);
    assert_eq!(net.take(0, again), Some(Err(Error::PeerFailed { rank: 1 })));
    let mine = net.start(0, selector(Some(0), Some(5)), None);
    assert_eq!(net.take(0, mine), ok(0, 5, b"to myself"));
    let theirs = net.start(0, selector(Some(2), Some(5)), None);
    assert_eq!(net.take(0, theirs), ok(2, 5, b"from 2"));
}

#[test]
fn a_lone_receive_too_small_declines_in_place_and_fails_when_handled() {
    let mut net = Net::new(2);
    let r = net.start(1, selector(Some(0), None), Some(4));
    net.send(0, 1, 1, b"too long");
    assert!(net.offer(1, r).is_none(), "declined in place");
    net.run();
    assert!(matches!(net.take(1, r), Some(Err(Error::Truncated { .. }))));
    // The message stays first in line for a receive that fits.
    let fits = net.start(1, selector(Some(0), None), None);
    assert_eq!(net.take(1, fits), ok(0, 1, b"too long"));
    // Rendezvous requests are never taken in place either; handled, they run as usual.
    let r = net.start(1, selector(Some(0), None), None);
    let big = pattern(3000, 7);
    net.send(0, 1, 2, &big);
    assert!(net.offer(1, r).is_none());
    net.run();
    net.take_sends(0);
    assert_eq!(net.take(1, r), ok(0, 2, &big));
}

/// A rendezvous receive whose request to send was matched may take all its data straight from
/// the transport (`data_want` / `take_data_direct`): it names the one data frame its sender
/// sends, and taking that frame's payload finishes the receive as the frame would have, with
/// no completion event. A receive still posted is not offered, nor one whose data has begun
/// to arrive in pieces.
#[test]
fn a_matched_rendezvous_receive_takes_its_whole_data_in_place() {
    let mut net = Net::with(2, 1024, 1 << 20, usize::MAX);
    let r = net.recv(1, Some(0), Some(7), Some(4096));
    assert_eq!(net.ep(1).data_want(r), None, "nothing matched yet");
    let data = pattern(3000, 4);
    assert!(matches!(net.send(0, 1, 7, &data), SendStart::Pending(_)));
    assert!(matches!(net.deliver(0, 1), Header::Rts { .. }));
    assert!(matches!(net.deliver(1, 0), Header::Cts { .. }));
    let want = net.ep(1).data_want(r).expect("matched, no data yet");
    assert_eq!((want.from, want.len), (0, 3000));
    let frame = net.links.get_mut(&(0, 1)).unwrap().pop_front().unwrap();
    assert_eq!(
        (frame.header, frame.payload.len()),
        (
            Header::Data {
                recv_id: want.recv_id,
                offset: 0
            },
            3000
        ),
        "the frame it names"
    );
    assert_eq!(net.ep(1).take_data_direct(r, &want), Some((0, 7, 3000)));
    net.flush(1);
    assert_eq!(net.events(1), vec![], "the caller has the result");
    assert_eq!(net.take(1, r), None, "the receive is gone");
    let s = net.stats(1);
    // The request and its data, as if both had come through `handle`.
    assert_eq!((s.frames_received, s.posted_receives), (2, 0));
    // In pieces (max payload 1000): once the first has come, the rest goes the usual way.
    let mut net = Net::new(2);
    let r = net.recv(1, Some(0), Some(7), None);
    net.send(0, 1, 7, &data);
    net.deliver(0, 1);
    net.deliver(1, 0);
    assert!(net.ep(1).data_want(r).is_some());
    assert!(matches!(net.deliver(0, 1), Header::Data { offset: 0, .. }));
    assert_eq!(net.ep(1).data_want(r), None, "a piece came");
    net.run();
    assert_eq!(net.take(1, r), ok(0, 7, &data));
    assert_eq!(net.stats(1).protocol_errors, 0);
}
