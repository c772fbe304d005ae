//! Micro-benchmarks of the in-process transport's queue, [`Mailbox`] (a rank's inbox: any
//! thread pushes, the owner drains in batches): push then drain on one thread, in batches of 1
//! and 64, and a producer thread streaming to a draining consumer. The shared-memory transport's
//! benchmark is beside this one (`benches/shm.rs`).
//!
//! `cargo bench -p rankweave-transports --bench mailbox`.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use rankweave_transports::inproc::Mailbox;

fn push_drain(c: &mut Criterion) {
    let mut g = c.benchmark_group("mailbox_push_drain");
    for batch in [1u64, 64] {
        let mb: Mailbox<u64> = Mailbox::new();
        let mut out = Vec::with_capacity(batch as usize);
        g.throughput(Throughput::Elements(batch));
        g.bench_with_input(BenchmarkId::from_parameter(batch), &batch, |b, &batch| {
            b.iter(|| {
                for i in 0..batch {
                    mb.push(black_box(i)).expect("open");
                }
                out.clear();
                assert_eq!(mb.drain_into(&mut out), batch as usize);
            })
        });
    }
    g.finish();
}

/// One producer thread pushes `iters` items while this thread drains them all.
fn stream(c: &mut Criterion) {
    let mut g = c.benchmark_group("mailbox_stream");
    g.throughput(Throughput::Elements(1));
    g.bench_function("two_threads", |b| {
        b.iter_custom(|iters| {
            let mb: Arc<Mailbox<u64>> = Arc::new(Mailbox::new());
            let producer = {
                let mb = Arc::clone(&mb);
                std::thread::spawn(move || {
                    for i in 0..iters {
                        mb.push(i).expect("open");
                    }
                })
            };
            let t = Instant::now();
            let (mut got, mut out) = (0u64, Vec::new());
            while got < iters {
                out.clear();
                got += mb.drain_into(&mut out) as u64;
                std::hint::spin_loop();
            }
            let elapsed = t.elapsed();
            producer.join().expect("producer");
            elapsed
        })
    });
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(20)
}

criterion_group! {
    name = benches;
    config = config();
    targets = push_drain, stream
}
criterion_main!(benches);
