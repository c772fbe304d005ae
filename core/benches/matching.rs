//! Micro-benchmarks of MPI matching and of the sans-IO protocol's per-message cost.
//!
//! `cargo bench -p rankweave-core --bench matching` (append `-- <filter>` to run a subset,
//! `-- --quick` for a fast pass). Every benchmark counts one matched message per iteration
//! (`Throughput::Elements(1)`), and every iteration leaves the queues as it found them, so the
//! state a benchmark measures stays the same throughout.
//!
//! * `exact/posted_first/N`, `exact/unexpected_first/N`: an exact receive and its message, with
//!   N other outstanding receives (resp. unexpected messages) of other tags, N = 0, 100, 10 000:
//!   the times should not grow with N. The target tag rotates over 16 values, so each
//!   iteration looks its lists up in the index maps instead of finding them in the matcher's
//!   last-used-list cache; `N/same_tag` repeats one tag (a stream, which the cache serves).
//! * `wildcard/{any_any,src_any}/N`: a wildcard receive takes the oldest matching message of a
//!   queue of N unexpected messages (4 sources, 16 tags); one new message arrives per iteration
//!   to keep the queue at N.
//! * `arrive_4_shapes/<shape>`: receives of all four selector shapes are outstanding (in
//!   another context), so an arrival must consult all four posted-receive indexes; the receive
//!   that takes the message has the given shape. Compare with `exact/posted_first/0`, where only
//!   exact receives are in use and an arrival consults one index.
//! * `endpoint/eager_8B/{posted_first,unexpected_first}`: a whole 8-byte eager message through
//!   two `Endpoint`s: `post_send`, `poll_transmit`, `handle`, `start_recv`/`take_recv` (and the
//!   batched credit frames going back). This is the protocol's cost per message, without any
//!   transport.

use std::hint::black_box;
use std::time::Duration;

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use rankweave_core::matching::{ArriveOutcome, MatchKey, Matcher, PostOutcome, Selector};
use rankweave_core::protocol::{Endpoint, EndpointConfig, RecvStart, SendStart};
use rankweave_core::{Arrival, ContextId};

const CTX: ContextId = ContextId(0);
/// Where the background receives of `arrive_4_shapes` live, so that none of them matches.
const OTHER_CTX: ContextId = ContextId(2);
/// Tags of the measured messages (`TARGET_TAG + 0..16`); background traffic uses tags from
/// `BACKGROUND_TAG` on, so it never matches.
const TARGET_TAG: u32 = 7;
const ROTATING_TAGS: u32 = 16;
const BACKGROUND_TAG: u32 = 1_000;
const BACKGROUND: [usize; 3] = [0, 100, 10_000];
const WILDCARD_DEPTHS: [usize; 2] = [100, 10_000];
const SOURCES: u32 = 4;

type M = Matcher<u64, u64>;

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

fn queued(outcome: PostOutcome<u64, u64>) {
    let PostOutcome::Queued(_) = outcome else {
        panic!("the receive matched a message it should not have");
    };
}

fn arrived_unmatched(outcome: ArriveOutcome<u64, u64>) {
    let ArriveOutcome::Queued = outcome else {
        panic!("the message matched a receive it should not have");
    };
}

/// The (receive, message) pair of a match, folded into one number for `black_box`.
fn arrive_matched(outcome: ArriveOutcome<u64, u64>) -> u64 {
    match outcome {
        ArriveOutcome::Matched { recv, unexpected } => recv ^ unexpected.msg,
        ArriveOutcome::Queued => panic!("the message found no receive"),
    }
}

fn post_matched(outcome: PostOutcome<u64, u64>) -> u64 {
    match outcome {
        PostOutcome::Matched { recv, unexpected } => recv ^ unexpected.msg,
        PostOutcome::Queued(_) => panic!("the receive found no message"),
    }
}

/// Outstanding exact receives from source 0, with tags no measured message uses.
fn with_posted(n: usize) -> M {
    let mut m = M::new();
    for i in 0..n {
        let tag = BACKGROUND_TAG + i as u32;
        queued(m.post(sel(CTX, Some(0), Some(tag)), i as u64));
    }
    m
}

/// Unexpected messages from source 0, with tags no measured receive asks for.
fn with_unexpected(n: usize) -> M {
    let mut m = M::new();
    for i in 0..n {
        let tag = BACKGROUND_TAG + i as u32;
        arrived_unmatched(m.arrive(key(CTX, 0, tag), i as u64));
    }
    m
}

/// The next measured tag: rotating over [`ROTATING_TAGS`] values, or always the same.
fn next_tag(i: &mut u32, rotate: bool) -> u32 {
    if rotate {
        *i = (*i + 1) % ROTATING_TAGS;
    }
    TARGET_TAG + *i
}

fn exact(c: &mut Criterion) {
    let mut g = c.benchmark_group("exact");
    g.throughput(Throughput::Elements(1));
    let cases = BACKGROUND
        .iter()
        .map(|&n| (n, true, n.to_string()))
        .chain([(10_000, false, "10000/same_tag".to_string())]);
    for (n, rotate, id) in cases {
        g.bench_function(BenchmarkId::new("posted_first", &id), |b| {
            let mut m = with_posted(n);
            let mut i = 0;
            b.iter(|| {
                let tag = next_tag(&mut i, rotate);
                queued(m.post(black_box(sel(CTX, Some(0), Some(tag))), 1));
                arrive_matched(m.arrive(black_box(key(CTX, 0, tag)), 2))
            });
            assert_eq!((m.posted_len(), m.unexpected_len()), (n, 0));
        });
        g.bench_function(BenchmarkId::new("unexpected_first", &id), |b| {
            let mut m = with_unexpected(n);
            let mut i = 0;
            b.iter(|| {
                let tag = next_tag(&mut i, rotate);
                arrived_unmatched(m.arrive(black_box(key(CTX, 0, tag)), 2));
                post_matched(m.post(black_box(sel(CTX, Some(0), Some(tag))), 1))
            });
            assert_eq!((m.posted_len(), m.unexpected_len()), (0, n));
        });
    }
    g.finish();
}

fn wildcard(c: &mut Criterion) {
    let mut g = c.benchmark_group("wildcard");
    g.throughput(Throughput::Elements(1));
    for depth in WILDCARD_DEPTHS {
        // Messages from 4 sources in turn, with 16 tags.
        let fill = |m: &mut M, next: &mut u32| {
            for _ in 0..depth {
                let k = key(CTX, *next % SOURCES, BACKGROUND_TAG + *next % ROTATING_TAGS);
                arrived_unmatched(m.arrive(k, u64::from(*next)));
                *next += 1;
            }
        };
        g.bench_function(BenchmarkId::new("any_any", depth), |b| {
            let (mut m, mut next) = (M::new(), 0);
            fill(&mut m, &mut next);
            let any = sel(CTX, None, None);
            b.iter(|| {
                let k = key(CTX, next % SOURCES, BACKGROUND_TAG + next % ROTATING_TAGS);
                next = next.wrapping_add(1);
                arrived_unmatched(m.arrive(black_box(k), 2));
                post_matched(m.post(black_box(any), 1))
            });
            assert_eq!(m.unexpected_len(), depth);
        });
        g.bench_function(BenchmarkId::new("src_any", depth), |b| {
            let (mut m, mut next) = (M::new(), 0);
            fill(&mut m, &mut next);
            // Takes source 0's oldest message; source 0 sends the new one, the other sources'
            // messages stay queued.
            let from0 = sel(CTX, Some(0), None);
            b.iter(|| {
                let k = key(CTX, 0, BACKGROUND_TAG + next % ROTATING_TAGS);
                next = next.wrapping_add(1);
                arrived_unmatched(m.arrive(black_box(k), 2));
                post_matched(m.post(black_box(from0), 1))
            });
            assert_eq!(m.unexpected_len(), depth);
        });
    }
    g.finish();
}

fn arrive_4_shapes(c: &mut Criterion) {
    let mut g = c.benchmark_group("arrive_4_shapes");
    g.throughput(Throughput::Elements(1));
    type Shape = fn(u32) -> Selector;
    let shapes: [(&str, Shape); 4] = [
        ("exact", |tag| sel(CTX, Some(0), Some(tag))),
        ("any_tag", |_| sel(CTX, Some(0), None)),
        ("any_source", |tag| sel(CTX, None, Some(tag))),
        ("any_any", |_| sel(CTX, None, None)),
    ];
    for (name, shape) in shapes {
        g.bench_function(name, |b| {
            let mut m = M::new();
            for (i, (_, background)) in shapes.iter().enumerate() {
                let s = background(BACKGROUND_TAG);
                queued(m.post(sel(OTHER_CTX, s.source, s.tag), i as u64));
            }
            let mut i = 0;
            b.iter(|| {
                let tag = next_tag(&mut i, true);
                queued(m.post(black_box(shape(tag)), 1));
                arrive_matched(m.arrive(black_box(key(CTX, 0, tag)), 2))
            });
            assert_eq!((m.posted_len(), m.unexpected_len()), (4, 0));
        });
    }
    g.finish();
}

/// Two endpoints, rank 0 sending to rank 1, with the runtime's default limits.
fn endpoints() -> (Endpoint, Endpoint) {
    let cfg = |rank| EndpointConfig {
        rank,
        size: 2,
        eager_limit: 64 << 10,
        unexpected_limit: 64 << 20,
        max_payload: 64 << 10,
        rts_with_data: false,
    };
    (Endpoint::new(cfg(0)), Endpoint::new(cfg(1)))
}

/// Delivers everything `from` has to transmit to `to`, and discards both sides' events (the
/// runtime would use them to wake futures).
fn pump(from: &mut Endpoint, from_rank: u32, to: &mut Endpoint) {
    while let Some((dst, frame)) = from.poll_transmit() {
        debug_assert_eq!(dst, to.config().rank);
        to.handle(Arrival::Frame {
            from: from_rank,
            frame,
        });
    }
    while from.poll_event().is_some() {}
    while to.poll_event().is_some() {}
}

fn send_eager(sender: &mut Endpoint, payload: &Bytes) {
    match sender.post_send(1, CTX, TARGET_TAG, payload.clone()) {
        Ok(SendStart::Complete) => {}
        other => panic!("expected an eager send, got {other:?}"),
    }
}

fn endpoint(c: &mut Criterion) {
    let mut g = c.benchmark_group("endpoint/eager_8B");
    g.throughput(Throughput::Elements(1));
    let payload = Bytes::from_static(b"8 bytes!");
    let from0 = sel(CTX, Some(0), Some(TARGET_TAG));
    g.bench_function("posted_first", |b| {
        let (mut e0, mut e1) = endpoints();
        b.iter(|| {
            let RecvStart::Pending(id) = e1.start_recv(black_box(from0), None) else {
                panic!("the receive should wait for its message");
            };
            send_eager(&mut e0, &payload);
            pump(&mut e0, 0, &mut e1);
            let received = e1.take_recv(id).expect("delivered").expect("received");
            pump(&mut e1, 1, &mut e0);
            received.data
        });
        assert_eq!(e0.stats().rendezvous_messages_sent, 0, "ran out of credit");
    });
    g.bench_function("unexpected_first", |b| {
        let (mut e0, mut e1) = endpoints();
        b.iter(|| {
            send_eager(&mut e0, &payload);
            pump(&mut e0, 0, &mut e1);
            let RecvStart::Matched(m) = e1.start_recv(black_box(from0), None) else {
                panic!("the message should be waiting");
            };
            pump(&mut e1, 1, &mut e0);
            m.received.data
        });
        assert_eq!(e0.stats().rendezvous_messages_sent, 0, "ran out of credit");
    });
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30)
}

criterion_group! {
    name = benches;
    config = config();
    targets = exact, wildcard, arrive_4_shapes, endpoint
}
criterion_main!(benches);
