//! Micro-benchmarks of the shared-memory transport's own cost, on one thread (no cross-core
//! traffic): a frame sent to a local peer and drained there, inline (1 B, 4 KiB), and at
//! 256 KiB both pipelined through the ring (the default) and by single copy (a pipeline limit
//! of 0). Two ranks of this process talk through real segments and rings.
//!
//! `cargo bench -p rankweave-transports --bench shm`.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use rankweave_core::frame::{Envelope, Frame, Header};
use rankweave_core::types::ContextId;
use rankweave_core::{Arrival, ShmConfig, Transport};
use rankweave_transports::shm::{LocalSegments, ShmTransport};

/// Two connected transports of one job (the receiver has mapped the sender and said whether
/// it can read its memory).
fn pair(config: ShmConfig) -> Vec<ShmTransport> {
    let dir = Arc::new(LocalSegments::default());
    let t: Vec<ShmTransport> = (0..2)
        .map(|r| {
            let t = ShmTransport::new(r, 2, config, Duration::from_secs(1), dir.clone())
                .expect("segment");
            dir.publish(r, t.address());
            t
        })
        .collect();
    let mut out = Vec::new();
    for _ in 0..3 {
        let f = Frame::control(Header::Credit { bytes: 0 });
        t[0].send(1, f).expect("send");
        t[1].drain(&mut out).expect("drain");
        t[0].drain(&mut out).expect("drain");
        out.clear();
    }
    t
}

fn send_drain(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let _guard = rt.enter();
    let single_copy = ShmConfig {
        pipeline_max: 0,
        ..ShmConfig::default()
    };
    let cases = [
        ("inline", 1usize, ShmConfig::default()),
        ("inline", 4096, ShmConfig::default()),
        ("pipelined", 256 * 1024, ShmConfig::default()),
        ("single_copy", 256 * 1024, single_copy),
    ];
    let mut g = c.benchmark_group("shm_send_drain");
    let mut out: Vec<Arrival> = Vec::new();
    let mut seq = 0u64;
    for (path, len, config) in cases {
        let t = pair(config);
        let payload = Bytes::from(vec![7u8; len]);
        g.throughput(Throughput::Bytes(len as u64));
        g.bench_with_input(BenchmarkId::new(path, len), &len, |b, &len| {
            b.iter(|| {
                seq += 1;
                let frame = Frame {
                    header: Header::Eager(Envelope {
                        context: ContextId(0),
                        tag: 1,
                        seq,
                        len: len as u64,
                    }),
                    payload: payload.clone(),
                };
                t[0].send(1, frame).expect("send");
                // A pipelined frame arrives over several drains, the sender writing the next
                // pieces as the receiver frees ring space; the sender also takes the
                // receiver's DONE for single-copy payloads.
                while out.is_empty() {
                    t[1].drain(&mut out).expect("drain");
                    let mut none = Vec::new();
                    t[0].drain(&mut none).expect("drain");
                    assert!(none.is_empty(), "nothing is sent to rank 0");
                }
                assert_eq!(out.len(), 1);
                black_box(out.pop());
            })
        });
    }
    g.finish();
}

criterion_group!(benches, send_drain);
criterion_main!(benches);
