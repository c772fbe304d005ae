//! Micro-benchmarks of rendezvous reassembly: one 1 MiB message per iteration, from a fresh
//! [`Reassembler`] to the finished `Bytes` (dropped inside the measurement, as the application
//! would eventually drop it). `Throughput::Bytes` is the message size.
//!
//! `cargo bench -p rankweave-core --bench reassembly`.
//!
//! * `whole`: the message in one fragment: kept as that `Bytes`, no copy (in-process path);
//! * `64KiB_in_order`: 16 fragments of 64 KiB in order: one allocation, 16 copies;
//! * `64KiB_reverse`: the same fragments last to first (received ranges merge to the right);
//! * `64KiB_in_order_fresh_buffer`: in order, each message with a pool of its own, so its
//!   buffer is a fresh allocation (page faults and all), as before buffers were pooled.
//!
//! The fragments are prepared once (slices of one buffer); cloning them per iteration is a
//! reference-count increment.

use std::hint::black_box;
use std::time::Duration;

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use std::sync::Arc;

use rankweave_core::buffer_pool::BufferPool;
use rankweave_core::protocol::Reassembler;

const LEN: usize = 1 << 20;
const FRAGMENT: usize = 64 << 10;

/// (offset, fragment) pairs covering `data`.
fn fragments(data: &Bytes) -> Vec<(usize, Bytes)> {
    (0..data.len())
        .step_by(FRAGMENT)
        .map(|off| (off, data.slice(off..(off + FRAGMENT).min(data.len()))))
        .collect()
}

fn assemble(pool: &Arc<BufferPool>, fragments: &[(usize, Bytes)]) -> Bytes {
    let mut r = Reassembler::new(LEN, Arc::clone(pool));
    for (offset, fragment) in fragments {
        r.insert(*offset, fragment.clone()).expect("fragment fits");
    }
    assert!(r.is_complete(), "message incomplete");
    r.finish()
}

fn reassembly(c: &mut Criterion) {
    let data = Bytes::from((0..LEN).map(|i| (i % 251) as u8).collect::<Vec<u8>>());
    let in_order = fragments(&data);
    let reverse: Vec<_> = in_order.iter().rev().cloned().collect();
    let whole = [(0, data.clone())];
    let pool = Arc::new(BufferPool::default());
    assert_eq!(in_order.len(), LEN / FRAGMENT);
    for case in [&whole[..], &in_order, &reverse] {
        assert_eq!(assemble(&pool, case), data, "reassembled message differs");
    }
    assert_eq!(
        assemble(&pool, &whole).as_ptr(),
        data.as_ptr(),
        "whole message was copied"
    );

    let mut g = c.benchmark_group("reassembly_1MiB");
    g.throughput(Throughput::Bytes(LEN as u64));
    for (name, case) in [
        ("whole", &whole[..]),
        ("64KiB_in_order", &in_order),
        ("64KiB_reverse", &reverse),
    ] {
        g.bench_function(name, |b| b.iter(|| assemble(&pool, black_box(case))));
    }
    g.bench_function("64KiB_in_order_fresh_buffer", |b| {
        b.iter(|| assemble(&Arc::default(), black_box(&in_order)))
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
    targets = reassembly
}
criterion_main!(benches);
