//! Loom models of the shared-memory transport's SPSC ring (transports/src/shm/ring.rs), compiled
//! against loom's atomics and a loom-checked `SharedBytes` (one `UnsafeCell` per 16-byte unit,
//! and the stamp word at its start an atomic of its own).
//!
//! Run: `LOOM_MAX_PREEMPTIONS=3 cargo test -p loom-tests --release`. See README.md.

use loom::sync::Arc;
use loom::sync::atomic::{AtomicBool, Ordering};
use loom::thread;
use loom_tests::harness::model;
use loom_tests::ring_api::{
    Popped, Pushed, RingConsumer, RingControl, RingGeometry, RingKey, RingProducer,
};
use loom_tests::sync::SharedBytes;

/// The smallest useful geometry: 128 bytes in 16-byte units (one record header), so bodies of
/// up to 16 bytes (footprint 16 for an empty body, 32 otherwise) and a ring full after four
/// 32-byte records.
const GEOMETRY: RingGeometry = RingGeometry {
    capacity: 128,
    unit: 16,
};

/// How many times a spinning thread yields before the model declares it stuck. Loom only
/// reschedules a yielded thread once the others cannot run, and a load after a yield does not
/// return a value the thread already saw if a newer one exists, so in a correct run every
/// spin below ends after a few yields; a thread that waits for something that never comes
/// (a lost signal) reaches the bound.
const SPINS: usize = 50;

/// The shared part of a ring: its control block and its (checked) data area.
struct Ring {
    control: RingControl,
    data: SharedBytes,
}

/// A fresh ring with the producer and consumer ends, both created before any thread starts.
fn ring() -> (Ring, RingProducer, RingConsumer) {
    assert!(GEOMETRY.is_valid());
    assert_eq!(GEOMETRY.max_body(), 16);
    let ring = Ring {
        control: RingControl::new(),
        data: SharedBytes::new(GEOMETRY.capacity, GEOMETRY.unit),
    };
    let producer = RingProducer::new(&ring.control, GEOMETRY, key());
    let consumer = RingConsumer::new(&ring.control, GEOMETRY, key());
    (ring, producer, consumer)
}

/// The key of the modelled ring.
fn key() -> RingKey {
    RingKey::new(0x5EED, 1)
}

/// A body of `len` bytes that differs from every other record's (`seed` is the record number).
fn body(seed: u8, len: usize) -> Vec<u8> {
    (0..len as u8)
        .map(|j| seed.wrapping_mul(16) + j + 1)
        .collect()
}

/// Calls `f` until it returns `Some`, yielding to loom's scheduler in between; panics with
/// `what` after `bound` attempts.
fn spin<T>(what: &str, bound: usize, mut f: impl FnMut() -> Option<T>) -> T {
    for _ in 0..bound {
        if let Some(t) = f() {
            return t;
        }
        thread::yield_now();
    }
    panic!("{what}: no progress after {bound} yields");
}

/// A record as pushed and popped: its kind and body.
type Record = (u8, Vec<u8>);

/// Pops one record, copying it out.
fn pop(c: &mut RingConsumer, r: &Ring) -> Popped<Record> {
    c.pop(&r.data, |kind, b| (kind, b.to_vec()))
}

/// Single-threaded setup (before any thread is spawned): pushes records with these body
/// lengths and reads and releases them, to move the ring's positions forward.
fn advance(r: &Ring, p: &mut RingProducer, c: &mut RingConsumer, bodies: &[usize]) {
    for (i, &len) in bodies.iter().enumerate() {
        let b = body(100 + i as u8, len);
        assert_eq!(p.try_push(&r.control, &r.data, 9, &[&b]), Pushed::Done);
        assert_eq!(pop(c, r), Popped::Record((9, b)));
    }
    c.release(&r.control);
}

/// (a) Records come out exactly as pushed, in order, while the producer pushes concurrently
/// with the consumer popping and releasing, including a record that wraps (a `PAD` filler at
/// the end of the data area) and one that finds the ring full until the consumer releases.
/// The consumer reads like the transport's `InboundRing::read`: a batch (here up to two
/// records, stopping early at `Empty`), then one `release`. A consumer reading bytes the
/// producer is still writing, or a producer overwriting bytes the consumer has not released,
/// is a causality violation on the data area's cells.
#[test]
fn records_in_order_across_wrap() {
    model(|| {
        let (r, mut p, mut c) = ring();
        // Start at position 16 (after one empty-body record), so that the last record wraps
        // while the ring is nearly full.
        advance(&r, &mut p, &mut c, &[0]);
        let r = Arc::new(r);

        // (kind, body): offsets 16..48; 48..80; 80..112; then PAD 112..128 + 0..32 (the
        // wrap), which needs 48 bytes while 32 are free: it waits until the first record is
        // released (a producer that forgot the PAD's bytes would overwrite that record's
        // header).
        let records: Vec<Record> = vec![
            (1, body(1, 8)),
            (2, body(2, 7)),
            (3, body(3, 5)),
            (4, body(4, 1)),
        ];
        let producer = {
            let r = r.clone();
            let records = records.clone();
            thread::spawn(move || {
                for (kind, b) in &records {
                    // Two parts (the first empty for the 1-byte body): the multi-part path.
                    let (x, y) = b.split_at(b.len() / 3);
                    spin("producer on a full ring", SPINS, || {
                        match p.try_push(&r.control, &r.data, *kind, &[x, y]) {
                            Pushed::Done => Some(()),
                            Pushed::Full => None,
                            Pushed::TooLarge => panic!("body of {} refused", b.len()),
                        }
                    });
                }
            })
        };

        let mut got = Vec::new();
        let mut idle = 0;
        while got.len() < records.len() {
            let before = got.len();
            while got.len() < records.len() && got.len() - before < 2 {
                // Each record is first looked at and declined (a receive's in-place offer that
                // does not want it), then read: both see the same bytes.
                let mut peeked = None;
                match c.pop_if(&r.data, |kind, b| {
                    peeked = Some((kind, b.to_vec()));
                    None::<()>
                }) {
                    Popped::Empty => break,
                    Popped::Record(_) => {}
                    Popped::Corrupt => panic!("corrupt record after {got:?}"),
                }
                match pop(&mut c, &r) {
                    Popped::Record(rec) => {
                        assert_eq!(peeked.as_ref(), Some(&rec), "a declined record stays put");
                        got.push(rec)
                    }
                    other => panic!("the declined record vanished: {other:?} after {got:?}"),
                }
            }
            c.release(&r.control);
            if got.len() == before {
                idle += 1;
                assert!(idle <= SPINS, "consumer on an empty ring: no progress");
                thread::yield_now();
            }
        }
        producer.join().unwrap();

        assert_eq!(got, records);
        assert_eq!(pop(&mut c, &r), Popped::Empty);
        assert!(!c.has_records(&r.data));
        assert!(!r.control.has_unreleased(&r.data, GEOMETRY, key()));
    });
}

/// (a′) Early wraps (the hot window): with a 32-byte window the producer starts again at
/// offset 0 as soon as it finds that the consumer has released the space there, so whether a
/// record goes to the start early or after the last one depends on how far the concurrent
/// consumer has got. The first record always wraps early (the ring is empty at offset 64);
/// the second does only if the consumer has already released the first and its filler. The
/// record at offset 0 is published before the filler that leads to it: a consumer reading it
/// before it is written, or a producer overwriting a filler or record not yet released, is a
/// causality violation on the data area's cells. Records come out in order either way.
#[test]
fn early_wraps_race_the_consumer() {
    model(|| {
        let (end, unread) = race_the_consumer(true);
        // The first record went to offset 0 of the next lap, [128, 160); each of the other two
        // went after the last, or (the consumer had released everything) to the next lap's
        // start: [160, 192) or [256, 288), then [192, 224), [256, 288), [288, 320) or [384, 416).
        assert!(
            [224, 288, 320, 416].contains(&end),
            "the producer ended at position {end}"
        );
        assert_eq!(unread, 0, "everything released, fillers included");
    });
}

/// The same race with early wraps turned off (`RingProducer::set_early_wraps`, as the sender
/// does while the consumer's cache is far): the records go one after the other whatever the
/// consumer has released, the third to the start of the next lap by an ordinary wrap.
#[test]
fn no_early_wraps_once_turned_off() {
    model(|| {
        let (end, unread) = race_the_consumer(false);
        assert_eq!(end, 160, "the producer ended at position {end}");
        assert_eq!(unread, 0);
    });
}

/// Pushes three records past a 32-byte hot window (early wraps on or off) while the consumer
/// pops and releases each; checks they come out as pushed, that the producer's count of unread
/// bytes never exceeds the ring, and returns the producer's final position and its count of
/// unread bytes once everything is released.
fn race_the_consumer(early_wraps: bool) -> (u64, u64) {
    let (r, p, mut c) = ring();
    let mut p = p.with_hot_window(32);
    p.set_early_wraps(early_wraps);
    advance(&r, &mut p, &mut c, &[8, 8]);
    assert_eq!(p.position(), 64);
    let r = Arc::new(r);
    let records: Vec<Record> = vec![(1, body(1, 8)), (2, body(2, 8)), (3, body(3, 4))];
    let producer = {
        let r = r.clone();
        let records = records.clone();
        thread::spawn(move || {
            for (kind, b) in &records {
                spin("producer on a full ring", SPINS, || {
                    match p.try_push(&r.control, &r.data, *kind, &[b]) {
                        Pushed::Done => Some(()),
                        Pushed::Full => None,
                        Pushed::TooLarge => panic!("body of {} refused", b.len()),
                    }
                });
                p.look_at_tail(&r.control);
                assert!(p.unread(&r.control) <= GEOMETRY.capacity as u64);
            }
            p
        })
    };
    let mut got = Vec::new();
    while got.len() < records.len() {
        let rec = spin("consumer on an empty ring", 2 * SPINS, || {
            match pop(&mut c, &r) {
                Popped::Empty => None,
                Popped::Record(rec) => Some(rec),
                Popped::Corrupt => panic!("corrupt record after {got:?}"),
            }
        });
        got.push(rec);
        c.release(&r.control);
    }
    let p = producer.join().unwrap();
    assert_eq!(got, records);
    assert_eq!(pop(&mut c, &r), Popped::Empty);
    assert!(!r.control.has_unreleased(&r.data, GEOMETRY, key()));
    (p.position(), p.unread(&r.control))
}

/// The shared part of the back-pressure models: the ring and the producer's "signal" (the
/// transport's datagram to the producer's signal socket), set by the consumer when `release`
/// says the producer asked for space.
struct Signalled {
    ring: Ring,
    signal: AtomicBool,
}

impl Signalled {
    /// Takes the pending signal, if any. Loads before swapping (like `release` and
    /// `should_signal`): after a yield a loom *load* cannot keep returning a value the thread
    /// already saw when a newer store exists, but a loom *RMW* may keep reading the thread's own
    /// last write while the consumer's unordered `store(true)` floats later in the modification
    /// order (legal, but unfair), so a `swap`-only wait could spin forever in the model.
    fn take_signal(&self) -> bool {
        self.signal.load(Ordering::Acquire) && self.signal.swap(false, Ordering::Acquire)
    }
}

/// A ring filled by four 32-byte records (kinds 1 to 4), the producer and consumer ends, and
/// the expected records.
fn full_ring() -> (Arc<Signalled>, RingProducer, RingConsumer, Vec<Record>) {
    let (r, mut p, c) = ring();
    let mut records = Vec::new();
    for kind in 1..=4u8 {
        let b = body(kind, 8);
        assert_eq!(p.try_push(&r.control, &r.data, kind, &[&b]), Pushed::Done);
        records.push((kind, b));
    }
    assert_eq!(
        p.try_push(&r.control, &r.data, 9, &[&[0]]),
        Pushed::Full,
        "four 32-byte records fill 128 bytes"
    );
    let shared = Arc::new(Signalled {
        ring: r,
        signal: AtomicBool::new(false),
    });
    (shared, p, c, records)
}

/// (b) Back-pressure safety, as one straight-line race: on a full ring, the producer's
/// `request_space` (after `Pushed::Full`) races the consumer's pop + `release`. Either the
/// producer sees the freed space or the consumer's `release` reports the request (so the
/// consumer signals it); and `release` never reports a request that was not made.
#[test]
fn request_space_vs_release() {
    model(|| {
        let (s, mut p, mut c, records) = full_ring();
        let producer = {
            let s = s.clone();
            thread::spawn(move || {
                let r = &s.ring;
                match p.try_push(&r.control, &r.data, 5, &[&body(5, 8)]) {
                    Pushed::Done => (false, true),
                    Pushed::Full => (true, p.request_space(&r.control, 8)),
                    Pushed::TooLarge => unreachable!(),
                }
            })
        };
        let r = &s.ring;
        assert_eq!(pop(&mut c, r), Popped::Record(records[0].clone()));
        let told = c.release(&r.control);
        let (asked, room) = producer.join().unwrap();
        assert!(
            room || told,
            "the producer found no room after asking, and the consumer was not told: lost signal"
        );
        assert!(
            asked || !told,
            "release reported a request for space that was never made"
        );
    });
}

/// (b, liveness) Back-pressure end to end: the ring starts full and the producer pushes two
/// more records. On `Pushed::Full` it calls `request_space` and, if that finds no room, waits
/// for the consumer's signal before trying again; the consumer pops and releases one record at
/// a time and signals whenever `release` returns true. The producer must always get through
/// (a lost signal leaves it waiting, which the bounded wait reports), and the consumer must get
/// all six records in order.
#[test]
fn full_ring_producer_always_proceeds() {
    model(|| {
        let (s, mut p, mut c, mut records) = full_ring();
        let more = [(5u8, body(5, 8)), (6u8, body(6, 3))];
        records.extend(more.iter().cloned());
        let producer = {
            let s = s.clone();
            thread::spawn(move || {
                let r = &s.ring;
                for (kind, b) in &more {
                    loop {
                        match p.try_push(&r.control, &r.data, *kind, &[b]) {
                            Pushed::Done => break,
                            Pushed::Full => {
                                if !p.request_space(&r.control, b.len()) {
                                    // Asleep until signalled (a stale signal from an earlier
                                    // request just means one more try).
                                    spin(
                                        "producer waiting for the consumer's signal",
                                        SPINS,
                                        || s.take_signal().then_some(()),
                                    );
                                }
                            }
                            Pushed::TooLarge => panic!("body of {} refused", b.len()),
                        }
                    }
                }
            })
        };

        let r = &s.ring;
        let mut got = Vec::new();
        while got.len() < records.len() {
            // A longer bound than the producer's: if both are stuck (a lost signal), the
            // producer's wait is the one that reports it.
            let rec = spin("consumer on an empty ring", 2 * SPINS, || {
                match pop(&mut c, r) {
                    Popped::Empty => None,
                    Popped::Record(rec) => Some(rec),
                    Popped::Corrupt => panic!("corrupt record after {got:?}"),
                }
            });
            got.push(rec);
            if c.release(&r.control) {
                s.signal.store(true, Ordering::Release);
            }
        }
        producer.join().unwrap();
        assert_eq!(got, records);
        assert_eq!(pop(&mut c, r), Popped::Empty);
        assert!(!r.control.has_unreleased(&r.data, GEOMETRY, key()));
    });
}

/// `discard_all` (the consumer giving the ring up after a goodbye or a broken record) while
/// the producer is still pushing: it releases everything published so far without reading it
/// (the producer may then overwrite those bytes: no causality violation, since nobody reads
/// them), and it stops on a record boundary, so whatever is published after it is read intact
/// and in order (the records read after it are a suffix of those pushed); a final `discard_all`
/// leaves nothing unreleased.
#[test]
fn discard_all_vs_push() {
    model(|| {
        let (r, mut p, mut c) = ring();
        let r = Arc::new(r);
        let records: Vec<Record> = vec![(1, body(1, 8)), (2, body(2, 0)), (3, body(3, 5))];
        let producer = {
            let r = r.clone();
            let records = records.clone();
            thread::spawn(move || {
                for (kind, b) in &records {
                    // 32 + 16 + 32 bytes: they fit without the consumer's help.
                    assert_eq!(p.try_push(&r.control, &r.data, *kind, &[b]), Pushed::Done);
                }
            })
        };
        let first = spin("consumer on an empty ring", SPINS, || {
            match pop(&mut c, &r) {
                Popped::Empty => None,
                Popped::Record(rec) => Some(rec),
                Popped::Corrupt => panic!("corrupt first record"),
            }
        });
        assert_eq!(first, records[0]);
        let _ = c.discard_all(&r.control, &r.data);
        producer.join().unwrap();

        let mut rest = Vec::new();
        loop {
            match pop(&mut c, &r) {
                Popped::Empty => break,
                Popped::Record(rec) => rest.push(rec),
                Popped::Corrupt => panic!("corrupt record after discard_all, read {rest:?}"),
            }
        }
        assert!(
            records[1..].ends_with(&rest),
            "read {rest:?} after discard_all: not the last records pushed"
        );
        let _ = c.discard_all(&r.control, &r.data);
        assert!(!c.has_records(&r.data));
        assert!(!r.control.has_unreleased(&r.data, GEOMETRY, key()));
    });
}
