//! Micro-benchmarks of the CRC32C every link packet carries: one checksum over a contiguous
//! buffer, and the same bytes in two parts (header + payload, as `write_header` computes it
//! for a gathered send). `Throughput::Bytes` is the checksummed length.
//!
//! `cargo bench -p rankweave-core --bench crc32c`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use rankweave_core::wire::{checksum, checksum_parts};

fn crc(c: &mut Criterion) {
    let data: Vec<u8> = (0..1usize << 20).map(|i| (i * 7 % 251) as u8).collect();
    let mut g = c.benchmark_group("crc32c");
    for len in [64usize, 1024, 8 * 1024, 64 * 1024, 1 << 20] {
        let buf = &data[..len];
        // The two forms must agree, or the gathered send would carry a wrong CRC.
        assert_eq!(
            checksum(buf),
            checksum_parts(&[&buf[..len / 2], &buf[len / 2..]])
        );
        g.throughput(Throughput::Bytes(len as u64));
        g.bench_with_input(BenchmarkId::new("contiguous", len), &buf, |b, buf| {
            b.iter(|| checksum(black_box(buf)))
        });
        let header = len.min(56);
        g.bench_with_input(BenchmarkId::new("header+payload", len), &buf, |b, buf| {
            b.iter(|| checksum_parts(black_box(&[&buf[..header], &buf[header..]])))
        });
    }
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
    targets = crc
}
criterion_main!(benches);
