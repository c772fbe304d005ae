//! Micro-benchmarks of the shared-memory transport's own cost, on one thread (no cross-core
//! traffic): a frame sent to a local peer and drained there, inline (1 B, 4 KiB) and by single
//! copy (256 KiB). Two ranks of this process talk through real segments and rings.
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

fn send_drain(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let _guard = rt.enter();
    let dir = Arc::new(LocalSegments::default());
    let t: Vec<ShmTransport> = (0..2)
        .map(|r| {
            let t = ShmTransport::new(
                r,
                2,
                ShmConfig::default(),
                Duration::from_secs(1),
                dir.clone(),
            )
            .expect("segment");
            dir.publish(r, t.address());
            t
        })
        .collect();
    let mut g = c.benchmark_group("shm_send_drain");
    let mut out: Vec<Arrival> = Vec::new();
    let mut seq = 0u64;
    // Connect both ways first (the receiver maps the sender and says it can read it).
    let warm = |t: &[ShmTransport], out: &mut Vec<Arrival>| {
        for _ in 0..3 {
            let f = Frame::control(Header::Credit { bytes: 0 });
            t[0].send(1, f).expect("send");
            t[1].drain(out).expect("drain");
            t[0].drain(out).expect("drain");
            out.clear();
        }
    };
    warm(&t, &mut out);
    for len in [1usize, 4096, 256 * 1024] {
        let payload = Bytes::from(vec![7u8; len]);
        g.throughput(Throughput::Bytes(len as u64));
        g.bench_with_input(BenchmarkId::from_parameter(len), &len, |b, &len| {
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
                t[1].drain(&mut out).expect("drain");
                assert_eq!(out.len(), 1);
                black_box(out.pop());
                // The sender takes the receiver's DONE for single-copy payloads.
                t[0].drain(&mut out).expect("drain");
            })
        });
    }
    g.finish();
}

criterion_group!(benches, send_drain);
criterion_main!(benches);
