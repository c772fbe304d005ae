use proptest::prelude::*;

use super::*;

const C0: ContextId = ContextId(0);
const C1: ContextId = ContextId(2);

fn key(context: ContextId, source: u32, tag: u32) -> MatchKey {
    MatchKey {
        context,
        source,
        tag,
    }
}

fn sel(context: ContextId, source: Option<u32>, tag: Option<u32>) -> Selector {
    Selector {
        context,
        source,
        tag,
    }
}

fn exact(source: u32, tag: u32) -> Selector {
    sel(C0, Some(source), Some(tag))
}

type M = Matcher<u32, &'static str>;

/// The key of a receive that must have been queued.
fn queued<R: fmt::Debug, T: fmt::Debug>(outcome: PostOutcome<R, T>) -> PostedKey {
    match outcome {
        PostOutcome::Queued(key) => key,
        other => panic!("expected the receive to queue, got {other:?}"),
    }
}

/// (receive, message) of a post that must have matched.
fn post_matched<R, T>(outcome: PostOutcome<R, T>) -> (R, T) {
    match outcome {
        PostOutcome::Matched { recv, unexpected } => (recv, unexpected.msg),
        PostOutcome::Queued(_) => panic!("expected the receive to match"),
    }
}

/// (receive, message) of an arrival or requeue, or `None` if it queued.
fn delivered<R, T>(outcome: ArriveOutcome<R, T>) -> Option<(R, T)> {
    match outcome {
        ArriveOutcome::Matched { recv, unexpected } => Some((recv, unexpected.msg)),
        ArriveOutcome::Queued => None,
    }
}

/// Asserts that nothing is queued and no index list head is left behind.
fn assert_empty<R, T>(m: &Matcher<R, T>) {
    assert_eq!((m.posted_len(), m.unexpected_len()), (0, 0));
    assert_eq!(m.index_lists(), (0, 0), "no list may be left non-empty");
    assert!(
        m.max_heads() <= super::list::SPARE_HEADS,
        "empty heads must be swept: {} held",
        m.max_heads()
    );
}

#[test]
fn exact_receive_matches_only_its_envelope() {
    let mut m = M::new();
    queued(m.post(exact(1, 5), 0));
    assert_eq!(delivered(m.arrive(key(C0, 1, 6), "tag")), None);
    assert_eq!(delivered(m.arrive(key(C0, 2, 5), "src")), None);
    assert_eq!(delivered(m.arrive(key(C0, 1, 5), "hit")), Some((0, "hit")));
    assert_eq!((m.posted_len(), m.unexpected_len()), (0, 2));
    m.check_invariants();
}

#[test]
fn every_selector_shape_matches_both_ways() {
    let k = key(C0, 1, 5);
    let shapes = [
        exact(1, 5),
        sel(C0, Some(1), None),
        sel(C0, None, Some(5)),
        sel(C0, None, None),
    ];
    for s in shapes {
        assert!(s.matches(&k));
        let mut m = M::new();
        queued(m.post(s, 7));
        assert_eq!(delivered(m.arrive(k, "late")), Some((7, "late")));
        assert_eq!(delivered(m.arrive(k, "early")), None);
        assert_eq!(post_matched(m.post(s, 8)), (8, "early"));
        assert_empty(&m);
    }
    assert!(!sel(C0, Some(2), None).matches(&k));
    assert!(!sel(C0, None, Some(6)).matches(&k));
    assert!(!sel(C1, None, None).matches(&k));
}

#[test]
fn message_takes_earliest_posted_receive_whatever_its_shape() {
    let shapes = [
        sel(C0, None, None),
        exact(1, 5),
        sel(C0, Some(1), None),
        sel(C0, None, Some(5)),
    ];
    // Every rotation of the posting order: the shape never beats the posting order.
    for first in 0..shapes.len() {
        let mut m = M::new();
        for i in 0..shapes.len() {
            queued(m.post(shapes[(first + i) % shapes.len()], i as u32));
        }
        for i in 0..shapes.len() {
            assert_eq!(
                delivered(m.arrive(key(C0, 1, 5), "x")),
                Some((i as u32, "x"))
            );
        }
        assert_empty(&m);
    }
}

#[test]
fn receive_takes_earliest_arrived_message() {
    let mut m = M::new();
    for (src, tag, msg) in [(2, 1, "a"), (1, 2, "b"), (1, 1, "c"), (2, 2, "d")] {
        assert_eq!(delivered(m.arrive(key(C0, src, tag), msg)), None);
    }
    assert_eq!(post_matched(m.post(sel(C0, None, None), 0)).1, "a");
    assert_eq!(post_matched(m.post(sel(C0, Some(1), None), 1)).1, "b");
    assert_eq!(post_matched(m.post(sel(C0, None, Some(2)), 2)).1, "d");
    assert_eq!(post_matched(m.post(exact(1, 1), 3)).1, "c");
    assert_empty(&m);
}

#[test]
fn any_tag_receives_keep_per_source_order() {
    let mut m = M::new();
    let arrivals = [
        (1, 3, "1a"),
        (2, 3, "2a"),
        (1, 1, "1b"),
        (2, 0, "2b"),
        (1, 2, "1c"),
    ];
    for (src, tag, msg) in arrivals {
        assert_eq!(delivered(m.arrive(key(C0, src, tag), msg)), None);
    }
    let from1: Vec<_> = (0..3)
        .map(|r| post_matched(m.post(sel(C0, Some(1), None), r)).1)
        .collect();
    assert_eq!(from1, ["1a", "1b", "1c"]);
    assert_eq!(post_matched(m.post(sel(C0, Some(2), None), 3)).1, "2a");
    assert_eq!(post_matched(m.post(sel(C0, Some(2), None), 4)).1, "2b");
    // The same order when the receives are posted first.
    for r in 10..13 {
        queued(m.post(sel(C0, Some(3), None), r));
    }
    let served: Vec<_> = [(9, "x"), (0, "y"), (9, "z")]
        .into_iter()
        .map(|(tag, msg)| delivered(m.arrive(key(C0, 3, tag), msg)).unwrap())
        .collect();
    assert_eq!(served, [(10, "x"), (11, "y"), (12, "z")]);
    assert_empty(&m);
}

#[test]
fn contexts_never_cross() {
    let mut m = M::new();
    queued(m.post(sel(C0, None, None), 0));
    assert_eq!(delivered(m.arrive(key(C1, 1, 5), "c1")), None);
    assert!(m.probe(&sel(C0, None, None)).is_none());
    assert_eq!(m.probe(&sel(C1, Some(1), Some(5))).unwrap().msg, "c1");
    assert_eq!(post_matched(m.post(sel(C1, None, None), 1)), (1, "c1"));
    assert_eq!(delivered(m.arrive(key(C0, 1, 5), "c0")), Some((0, "c0")));
    assert_empty(&m);
}

#[test]
fn cancel_withdraws_only_a_still_queued_receive() {
    let mut m = M::new();
    let a = queued(m.post(exact(1, 1), 0));
    let b = queued(m.post(exact(1, 1), 1));
    assert_eq!(m.cancel(a), Some(0));
    assert_eq!(m.cancel(a), None, "already cancelled");
    // The message now goes to the next receive in line.
    assert_eq!(delivered(m.arrive(key(C0, 1, 1), "m")), Some((1, "m")));
    assert_eq!(m.cancel(b), None, "already matched");
    // A stale key must not withdraw a newer receive that reuses its slot.
    let c = queued(m.post(exact(1, 1), 2));
    assert_eq!(m.cancel(a), None);
    assert_eq!(m.cancel(b), None);
    assert_eq!(m.posted_len(), 1);
    assert_eq!(m.cancel(c), Some(2));
    assert_empty(&m);
}

#[test]
fn requeue_restores_arrival_position() {
    let mut m = M::new();
    assert_eq!(delivered(m.arrive(key(C0, 1, 1), "A")), None);
    assert_eq!(delivered(m.arrive(key(C0, 1, 2), "B")), None);
    let PostOutcome::Matched { unexpected: b, .. } = m.post(exact(1, 2), 0) else {
        panic!("B should match");
    };
    assert_eq!(delivered(m.arrive(key(C0, 1, 2), "C")), None);
    assert_eq!(delivered(m.requeue(b)), None);
    m.check_invariants();
    let order: Vec<_> = (1..4)
        .map(|r| post_matched(m.post(sel(C0, Some(1), None), r)).1)
        .collect();
    assert_eq!(order, ["A", "B", "C"]);
    assert_empty(&m);
}

#[test]
fn requeue_restores_position_in_every_index() {
    let mut m = M::new();
    for (src, tag, msg) in [(1, 1, "A"), (1, 2, "B"), (2, 2, "C"), (1, 2, "D")] {
        assert_eq!(delivered(m.arrive(key(C0, src, tag), msg)), None);
    }
    let PostOutcome::Matched { unexpected: b, .. } = m.post(exact(1, 2), 0) else {
        panic!("B should match");
    };
    assert_eq!(m.probe(&sel(C0, None, Some(2))).unwrap().msg, "C");
    assert_eq!(delivered(m.requeue(b)), None);
    m.check_invariants();
    assert_eq!(m.probe(&exact(1, 2)).unwrap().msg, "B");
    assert_eq!(m.probe(&sel(C0, None, Some(2))).unwrap().msg, "B");
    assert_eq!(m.probe(&sel(C0, Some(1), None)).unwrap().msg, "A");
    assert_eq!(m.probe(&sel(C0, None, None)).unwrap().msg, "A");
    let order: Vec<_> = (1..5)
        .map(|r| post_matched(m.post(sel(C0, None, None), r)).1)
        .collect();
    assert_eq!(order, ["A", "B", "C", "D"]);
    assert_empty(&m);
}

#[test]
fn requeue_goes_to_earliest_posted_matching_receive() {
    let mut m = M::new();
    assert_eq!(delivered(m.arrive(key(C0, 1, 1), "A")), None);
    let PostOutcome::Matched { unexpected: a, .. } = m.post(sel(C0, None, None), 0) else {
        panic!("A should match");
    };
    queued(m.post(exact(2, 1), 1));
    queued(m.post(sel(C0, None, Some(1)), 2));
    queued(m.post(sel(C0, Some(1), None), 3));
    let ArriveOutcome::Matched { recv, unexpected } = m.requeue(a) else {
        panic!("A should match a queued receive");
    };
    assert_eq!((recv, unexpected.seq, unexpected.msg), (2, 0, "A"));
}

#[test]
fn take_posted_from_withdraws_receives_naming_the_source() {
    let mut m = M::new();
    queued(m.post(exact(1, 1), 0));
    queued(m.post(sel(C0, None, None), 1));
    queued(m.post(sel(C1, Some(1), None), 2));
    queued(m.post(exact(2, 1), 3));
    queued(m.post(sel(C0, None, Some(1)), 4));
    queued(m.post(exact(1, 5), 5));
    assert_eq!(m.take_posted_from(1), vec![0, 2, 5]);
    assert_eq!(m.posted_len(), 3);
    assert_eq!(m.take_posted_from(1), Vec::<u32>::new());
    // The any-source receives still work, in posting order.
    assert_eq!(delivered(m.arrive(key(C0, 1, 1), "x")), Some((1, "x")));
    assert_eq!(delivered(m.arrive(key(C0, 1, 1), "y")), Some((4, "y")));
    assert_eq!(m.take_posted_from(2), vec![3]);
    assert_empty(&m);
}

#[test]
fn probe_does_not_remove() {
    let mut m = M::new();
    assert!(m.probe(&sel(C0, None, None)).is_none());
    assert_eq!(delivered(m.arrive(key(C0, 1, 1), "A")), None);
    for _ in 0..2 {
        let u = m.probe(&sel(C0, Some(1), None)).unwrap();
        assert_eq!((u.seq, u.key, u.msg), (0, key(C0, 1, 1), "A"));
    }
    assert!(m.probe(&exact(1, 2)).is_none());
    assert_eq!(m.unexpected_len(), 1);
    assert_eq!(post_matched(m.post(exact(1, 1), 0)), (0, "A"));
    assert_empty(&m);
}

#[test]
fn a_stream_is_matched_without_indexing() {
    let mut m = M::new();
    for msg in ["A", "B", "C"] {
        assert_eq!(delivered(m.arrive(key(C0, 1, 1), msg)), None);
    }
    assert_eq!(m.unexpected_len(), 3);
    assert_eq!(m.index_lists(), (0, 0), "arrivals wait unindexed");
    assert_eq!(post_matched(m.post(exact(1, 1), 0)), (0, "A"));
    assert_eq!(m.probe(&exact(1, 1)).unwrap().msg, "B");
    let u = m.take_if(&exact(1, 1), |u| u.msg == "B").unwrap();
    assert_eq!(u.msg, "B");
    assert!(
        m.take_if(&exact(1, 1), |_| false).is_none(),
        "refused: stays"
    );
    assert_eq!(m.index_lists(), (0, 0), "a stream indexes nothing");
    // A receive for another tag walks past "C" and indexes it; "C" keeps its place.
    queued(m.post(exact(1, 2), 1));
    assert_eq!(m.index_lists().1, 4, "one list per selector shape");
    assert_eq!(delivered(m.arrive(key(C0, 1, 1), "D")), None);
    assert_eq!(post_matched(m.post(sel(C0, None, None), 2)), (2, "C"));
    assert_eq!(post_matched(m.post(sel(C0, Some(1), None), 3)), (3, "D"));
    assert_eq!(delivered(m.arrive(key(C0, 1, 2), "E")), Some((1, "E")));
    m.check_invariants();
    assert_empty(&m);
}

#[test]
fn ten_thousand_outstanding_exact_receives() {
    const N: u32 = 10_000;
    let mut m: Matcher<u32, u32> = Matcher::new();
    for i in 0..N {
        queued(m.post(exact(i % 7, i), i));
    }
    assert_eq!(m.posted_len(), N as usize);
    // 7919 is coprime with N, so this visits every receive once, far from posting order.
    for k in 0..N {
        let i = (k * 7919) % N;
        assert_eq!(delivered(m.arrive(key(C0, i % 7, i), k)), Some((i, k)));
    }
    assert_empty(&m);
}

#[test]
fn ten_thousand_outstanding_wildcard_receives() {
    const N: u32 = 10_000;
    let mut m: Matcher<u32, u32> = Matcher::new();
    // Receives of all four shapes interleaved; each arrival matches exactly one of them.
    for i in 0..N {
        let s = match i % 4 {
            0 => exact(i, i),
            1 => sel(C0, Some(i), None),
            2 => sel(C0, None, Some(i)),
            _ => sel(C1, None, None),
        };
        queued(m.post(s, i));
    }
    let mut any_any_served = 0;
    for k in 0..N {
        let i = (k * 7919) % N;
        let (envelope, want) = match i % 4 {
            0 => (key(C0, i, i), i),
            1 => (key(C0, i, N + i), i),
            2 => (key(C0, N + i, i), i),
            _ => {
                // C1 has only any-any receives: they take C1 messages in posting order.
                any_any_served += 1;
                (key(C1, i, i), 4 * any_any_served - 1)
            }
        };
        assert_eq!(delivered(m.arrive(envelope, k)), Some((want, k)));
    }
    assert_empty(&m);
}

#[test]
fn heavy_traffic_leaves_nothing_behind() {
    let mut m: Matcher<u32, u32> = Matcher::new();
    let shapes = |i: u32| match i % 4 {
        0 => sel(C0, Some(i % 5), Some(i % 3)),
        1 => sel(C0, Some(i % 5), None),
        2 => sel(C1, None, Some(i % 3)),
        _ => sel(C1, None, None),
    };
    let mut keys = Vec::new();
    let mut matched = Vec::new();
    for i in 0..20_000u32 {
        let ctx = if i % 2 == 0 { C0 } else { C1 };
        match i % 5 {
            0 | 1 => {
                if let Some(u) = m.probe(&shapes(i)).cloned() {
                    assert_eq!(
                        m.post(shapes(i), i),
                        PostOutcome::Matched {
                            recv: i,
                            unexpected: u
                        }
                    );
                } else {
                    keys.push(queued(m.post(shapes(i), i)));
                }
            }
            2 | 3 => {
                if let ArriveOutcome::Matched { unexpected, .. } =
                    m.arrive(key(ctx, i % 5, i % 3), i)
                {
                    matched.push(unexpected);
                }
            }
            _ => {
                if i % 3 == 0 && !keys.is_empty() {
                    let _ = m.cancel(keys[(i as usize * 31) % keys.len()]);
                } else if let Some(u) = matched.pop() {
                    let _ = m.requeue(u);
                }
            }
        }
    }
    assert!(m.posted_len() + m.unexpected_len() > 0);
    m.check_invariants();
    for src in 0..5 {
        m.take_posted_from(src);
    }
    for k in keys {
        let _ = m.cancel(k);
    }
    for ctx in [C0, C1] {
        while let PostOutcome::Matched { .. } = m.post(sel(ctx, None, None), 0) {}
    }
    // Each drain above ends by queueing one any-any receive.
    assert_eq!(m.posted_len(), 2);
    for ctx in [C0, C1] {
        assert!(delivered(m.arrive(key(ctx, 0, 0), 0)).is_some());
    }
    assert_empty(&m);
}

// ---------------------------------------------------------------------------------------------
// Model-based property test: the matcher against linear scans over plain vectors.

/// The obvious implementation of the same rules.
#[derive(Default)]
struct Model {
    /// (receive, selector), in posting order.
    posted: Vec<(u32, Selector)>,
    /// Sorted by `seq`.
    unexpected: Vec<Unexpected<u32>>,
    next_seq: u64,
}

impl Model {
    fn post(&mut self, s: Selector, recv: u32) -> Option<Unexpected<u32>> {
        match self.unexpected.iter().position(|u| s.matches(&u.key)) {
            Some(i) => Some(self.unexpected.remove(i)),
            None => {
                self.posted.push((recv, s));
                None
            }
        }
    }

    fn arrive(&mut self, key: MatchKey, msg: u32) -> Option<(u32, Unexpected<u32>)> {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.deliver(Unexpected { seq, key, msg })
    }

    fn deliver(&mut self, u: Unexpected<u32>) -> Option<(u32, Unexpected<u32>)> {
        match self.posted.iter().position(|(_, s)| s.matches(&u.key)) {
            Some(i) => Some((self.posted.remove(i).0, u)),
            None => {
                let at = self.unexpected.partition_point(|q| q.seq < u.seq);
                self.unexpected.insert(at, u);
                None
            }
        }
    }

    fn cancel(&mut self, recv: u32) -> Option<u32> {
        let i = self.posted.iter().position(|(r, _)| *r == recv)?;
        Some(self.posted.remove(i).0)
    }

    fn probe(&self, s: &Selector) -> Option<&Unexpected<u32>> {
        self.unexpected.iter().find(|u| s.matches(&u.key))
    }

    fn take_if(&mut self, s: &Selector, accept: bool) -> Option<Unexpected<u32>> {
        let i = self.unexpected.iter().position(|u| s.matches(&u.key))?;
        accept.then(|| self.unexpected.remove(i))
    }

    fn take_posted_from(&mut self, source: u32) -> Vec<u32> {
        let (taken, kept) = self
            .posted
            .drain(..)
            .partition(|(_, s)| s.source == Some(source));
        self.posted = kept;
        taken.into_iter().map(|(r, _)| r).collect::<Vec<_>>()
    }
}

#[derive(Clone, Debug)]
enum Op {
    Post(Selector),
    Arrive(MatchKey),
    /// Cancel the n-th (modulo) key ever returned by a queued post, possibly stale.
    Cancel(usize),
    /// Requeue the n-th (modulo) message currently held by a matched receive.
    Requeue(usize),
    Probe(Selector),
    /// Take the earliest matching message only if its payload is even.
    TakeIfEven(Selector),
    TakePostedFrom(u32),
}

fn any_context() -> impl Strategy<Value = ContextId> {
    prop_oneof![Just(C0), Just(C1)]
}

fn any_selector() -> impl Strategy<Value = Selector> {
    let part = || proptest::option::weighted(0.6, 0..3u32);
    (any_context(), part(), part()).prop_map(|(c, s, t)| sel(c, s, t))
}

fn any_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => any_selector().prop_map(Op::Post),
        4 => (any_context(), 0..3u32, 0..3u32).prop_map(|(c, s, t)| Op::Arrive(key(c, s, t))),
        2 => any::<usize>().prop_map(Op::Cancel),
        2 => any::<usize>().prop_map(Op::Requeue),
        1 => any_selector().prop_map(Op::Probe),
        2 => any_selector().prop_map(Op::TakeIfEven),
        1 => (0..3u32).prop_map(Op::TakePostedFrom),
    ]
}

/// An arrival or requeue outcome in the model's terms.
fn as_delivery(outcome: ArriveOutcome<u32, u32>) -> Option<(u32, Unexpected<u32>)> {
    match outcome {
        ArriveOutcome::Matched { recv, unexpected } => Some((recv, unexpected)),
        ArriveOutcome::Queued => None,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn matches_reference_model(ops in proptest::collection::vec(any_op(), 1..400)) {
        let mut m: Matcher<u32, u32> = Matcher::new();
        let mut model = Model::default();
        let mut keys: Vec<(PostedKey, u32)> = Vec::new();
        let mut held: Vec<Unexpected<u32>> = Vec::new();
        for (n, op) in ops.into_iter().enumerate() {
            let n = n as u32;
            match op {
                Op::Post(s) => match (m.post(s, n), model.post(s, n)) {
                    (PostOutcome::Queued(k), None) => keys.push((k, n)),
                    (PostOutcome::Matched { recv, unexpected }, Some(want)) => {
                        prop_assert_eq!(recv, n);
                        prop_assert_eq!(&unexpected, &want);
                        held.push(unexpected);
                    }
                    (got, want) => prop_assert!(false, "post {:?}: got {:?}, want {:?}", s, got, want),
                },
                Op::Arrive(k) => {
                    let got = as_delivery(m.arrive(k, n));
                    prop_assert_eq!(&got, &model.arrive(k, n));
                    held.extend(got.map(|(_, u)| u));
                }
                Op::Cancel(i) => {
                    if !keys.is_empty() {
                        let (k, recv) = keys[i % keys.len()];
                        prop_assert_eq!(m.cancel(k), model.cancel(recv));
                    }
                }
                Op::Requeue(i) => {
                    if !held.is_empty() {
                        let u = held.swap_remove(i % held.len());
                        let got = as_delivery(m.requeue(u.clone()));
                        prop_assert_eq!(&got, &model.deliver(u));
                        held.extend(got.map(|(_, u)| u));
                    }
                }
                Op::Probe(s) => prop_assert_eq!(m.probe(&s), model.probe(&s)),
                Op::TakeIfEven(s) => {
                    let accept = model.probe(&s).is_some_and(|u| u.msg % 2 == 0);
                    let got = m.take_if(&s, |u| u.msg % 2 == 0);
                    prop_assert_eq!(&got, &model.take_if(&s, accept));
                    held.extend(got);
                }
                Op::TakePostedFrom(src) => {
                    prop_assert_eq!(m.take_posted_from(src), model.take_posted_from(src));
                }
            }
            prop_assert_eq!(m.posted_len(), model.posted.len());
            prop_assert_eq!(m.unexpected_len(), model.unexpected.len());
            m.check_invariants();
        }
    }
}
