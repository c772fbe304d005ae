//! `memcpy` (through `copy_from_slice`) against `byte_copy::copy_slice`, by length and by the
//! distance of the destination past the source modulo a 4 KiB page: shows the slow case of
//! `rep movsb` that `byte_copy` steers around (see its module docs).
//!
//! cargo bench -p rankweave-core --bench byte_copy [-- ITERATIONS]

use std::hint::black_box;
use std::time::Instant;

use rankweave_core::byte_copy::copy_slice;

const PAGE: usize = 4096;

fn gbps(len: usize, iters: usize, mut f: impl FnMut()) -> f64 {
    f();
    let t = Instant::now();
    for _ in 0..iters {
        f();
    }
    (len * iters) as f64 / t.elapsed().as_nanos() as f64
}

fn main() {
    let iters: usize = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .and_then(|a| a.parse().ok())
        .unwrap_or(2000);
    println!("GB/s: memcpy / copy_slice, destination DIST bytes past the source (mod 4 KiB)");
    println!(
        "{:>9} {:>15} {:>15} {:>15}",
        "length", "dist 0", "dist 16", "dist 64"
    );
    for len in [4 << 10, 32 << 10, 256 << 10, 1 << 20] {
        let src = vec![7u8; len + 2 * PAGE];
        let mut dst = vec![0u8; len + 3 * PAGE];
        let s = &src[PAGE - src.as_ptr() as usize % PAGE..][..len];
        let mut cells = Vec::new();
        for dist in [0usize, 16, 64] {
            let at = (s.as_ptr() as usize + dist - dst.as_ptr() as usize % PAGE) % PAGE;
            let d = &mut dst[at..at + len];
            let n = iters.max(1) * (64 << 10) / len;
            let libc = gbps(len, n, || black_box(&mut *d).copy_from_slice(black_box(s)));
            let ours = gbps(len, n, || copy_slice(black_box(&mut *d), black_box(s)));
            cells.push(format!("{libc:6.1} / {ours:6.1}"));
        }
        println!(
            "{len:>9} {:>15} {:>15} {:>15}",
            cells[0], cells[1], cells[2]
        );
    }
}
