//! Loom models of the shared-memory transport's park/notify doorbell
//! (transports/src/shm/doorbell.rs): the owner `arm`s, then looks at its rings; a producer
//! publishes (stores a record's stamp with `Release`), then asks `should_signal`.
//!
//! Run: `LOOM_MAX_PREEMPTIONS=3 cargo test -p loom-tests --release`. See README.md.

use loom::sync::Arc;
use loom::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use loom::thread;
use loom_tests::doorbell_api::Doorbell;
use loom_tests::harness::model;
use loom_tests::ring_api::{
    Pushed, RingConsumer, RingControl, RingGeometry, RingKey, RingProducer,
};
use loom_tests::sync::SharedBytes;

/// How many times the sleeping owner yields before the model declares the wake-up lost (see
/// `SPINS` in `tests/shm_ring.rs`: in a correct run it wakes after a few yields).
const SPINS: usize = 50;

/// One owner's doorbell, the heads of the rings two producers write (stand-ins for
/// `RingControl`'s `head`: stored with `Release`, loaded with `Acquire`), and the signals sent
/// (the transport's datagrams to the owner's signal socket, which stay pending until read).
struct Owner {
    bell: Doorbell,
    heads: [AtomicU64; 2],
    signals: AtomicUsize,
}

impl Owner {
    fn new() -> Arc<Owner> {
        Arc::new(Owner {
            bell: Doorbell::new(),
            heads: [AtomicU64::new(0), AtomicU64::new(0)],
            signals: AtomicUsize::new(0),
        })
    }

    /// Producer `k` publishes its `n`th record, then signals if the doorbell says so. Returns
    /// whether it signalled.
    fn publish(&self, k: usize, n: u64) -> bool {
        self.heads[k].store(n, Ordering::Release);
        let signal = self.bell.should_signal();
        if signal {
            self.signals.fetch_add(1, Ordering::Release);
        }
        signal
    }

    /// The owner's look at ring `k`: its head.
    fn head(&self, k: usize) -> u64 {
        self.heads[k].load(Ordering::Acquire)
    }

    fn signals(&self) -> usize {
        self.signals.load(Ordering::Acquire)
    }
}

/// (1) No lost wake-up: the owner arms and then looks at the ring while a producer publishes
/// and asks `should_signal`. The owner saw the record (and will not sleep) or the producer
/// signals.
#[test]
fn arm_vs_publish_no_lost_wakeup() {
    model(|| {
        let o = Owner::new();
        let producer = {
            let o = o.clone();
            thread::spawn(move || o.publish(0, 1))
        };
        o.bell.arm();
        let saw = o.head(0) == 1;
        let signalled = producer.join().unwrap();
        assert!(
            saw || signalled,
            "owner went to sleep with a record published and nobody signalled it"
        );
        // A signal takes the doorbell with it: an owner that finds its doorbell still armed
        // knows no signal is on its way (what `wakeups_missed` relies on).
        assert_eq!(o.bell.is_armed(), !signalled);
    });
}

/// (2) Two producers, one arm: at most one of them signals (the `compare_exchange` from
/// `PARKED`), and if the owner's look missed either record, one of them did signal.
#[test]
fn two_producers_at_most_one_signal_per_arm() {
    model(|| {
        let o = Owner::new();
        let producers: Vec<_> = (0..2)
            .map(|k| {
                let o = o.clone();
                thread::spawn(move || o.publish(k, 1))
            })
            .collect();
        o.bell.arm();
        let saw_all = o.head(0) == 1 && o.head(1) == 1;
        for p in producers {
            p.join().unwrap();
        }
        let signals = o.signals();
        assert!(signals <= 1, "{signals} signals for one arm");
        assert!(
            saw_all || signals == 1,
            "owner missed a record and nobody signalled it"
        );
    });
}

/// (3) Disarm and re-arm (a busy poller taking over from the parked progress task, then
/// handing back, as in `begin_busy_poll` / `end_busy_poll`): the owner arms and looks, disarms
/// and looks (busy), re-arms and looks, while two producers publish. If the last look missed a
/// record, somebody signalled (so the owner, asleep after it, is woken); no more signals than
/// arms.
#[test]
fn disarm_then_rearm_no_lost_wakeup() {
    model(|| {
        let o = Owner::new();
        let producers: Vec<_> = (0..2)
            .map(|k| {
                let o = o.clone();
                thread::spawn(move || o.publish(k, 1))
            })
            .collect();
        o.bell.arm();
        let _ = (o.head(0), o.head(1));
        o.bell.disarm();
        let _ = (o.head(0), o.head(1));
        o.bell.arm();
        let saw_all = o.head(0) == 1 && o.head(1) == 1;
        for p in producers {
            p.join().unwrap();
        }
        let signals = o.signals();
        assert!(signals <= 2, "{signals} signals for two arms");
        assert!(
            saw_all || signals >= 1,
            "owner went back to sleep with a record published and nobody signalled it"
        );
    });
}

/// (3, liveness) The owner's park loop: arm, look; if there is something new, disarm (busy)
/// and take it, else sleep until a signal arrives (then disarm, as `poll_arrival` does) and
/// go round again; until it has both records of a producer that publishes twice. A lost
/// wake-up leaves the owner asleep, which the bounded sleep reports. At most one signal per
/// arm.
#[test]
fn owner_sleeps_until_signalled() {
    model(|| {
        let o = Owner::new();
        let producer = {
            let o = o.clone();
            thread::spawn(move || {
                o.publish(0, 1);
                o.publish(0, 2);
            })
        };
        let (mut seen, mut woken, mut arms) = (0, 0, 0);
        while seen < 2 {
            o.bell.arm();
            arms += 1;
            let head = o.head(0);
            if head > seen {
                o.bell.disarm();
                seen = head;
                continue;
            }
            let mut slept = 0;
            while o.signals() == woken {
                slept += 1;
                assert!(slept <= SPINS, "owner asleep at head {seen}: lost wake-up");
                thread::yield_now();
            }
            woken = o.signals();
            o.bell.disarm();
        }
        producer.join().unwrap();
        let signals = o.signals();
        assert!(signals <= arms, "{signals} signals for {arms} arms");
    });
}

/// (1, with the real ring) The same handshake as the transport runs it: the producer pushes a
/// record with `RingProducer::try_push` (its `Release` stamp store) and then asks
/// `should_signal`; the owner arms and then asks `RingConsumer::has_records` (a look at the
/// stamp word). The owner sees the
/// record or is signalled.
#[test]
fn ring_push_vs_park() {
    model(|| {
        let geometry = RingGeometry {
            capacity: 128,
            unit: 16,
        };
        let key = RingKey::new(0x5EED, 1);
        let shared = Arc::new((
            Doorbell::new(),
            RingControl::new(),
            SharedBytes::new(geometry.capacity, geometry.unit),
        ));
        let mut p = RingProducer::new(&shared.1, geometry, key);
        let c = RingConsumer::new(&shared.1, geometry, key);
        let producer = {
            let shared = shared.clone();
            thread::spawn(move || {
                let (bell, control, data) = &*shared;
                assert_eq!(p.try_push(control, data, 1, &[b"hi"]), Pushed::Done);
                bell.should_signal()
            })
        };
        let (bell, _, data) = &*shared;
        bell.arm();
        let saw = c.has_records(data);
        let signalled = producer.join().unwrap();
        assert!(
            saw || signalled,
            "owner went to sleep with a record in its ring and nobody signalled it"
        );
    });
}
