//! Ping-pong between pairs of ranks: rank 2k and rank 2k+1 bounce a message back and forth, and
//! rank 0 prints the one-way latency (round trip / 2) for sizes from 1 byte to 1 MiB.
//!
//! `cargo run --release --example ping_pong` runs 4 in-process ranks (two pairs);
//! `cargo run --release --example ping_pong -- 2` runs one pair.

use std::time::Instant;

use bytes::Bytes;
use rankweave::prelude::*;

const ITERS: usize = 2_000;
const WARMUP: usize = 200;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let n: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().expect("the rank count must be a number"))
        .unwrap_or(4);
    assert!(
        n >= 2 && n % 2 == 0,
        "ping_pong needs an even number of ranks"
    );
    let results = rankweave::local(n, |comm| async move {
        let me = comm.rank();
        let partner = me ^ 1;
        let mut rows = Vec::new();
        let mut size = 1usize;
        while size <= 1 << 20 {
            let payload = Bytes::from(vec![0xA5u8; size]);
            let iters = if size >= 64 << 10 { ITERS / 10 } else { ITERS };
            let mut start = Instant::now();
            for i in 0..WARMUP + iters {
                if i == WARMUP {
                    start = Instant::now();
                }
                if me % 2 == 0 {
                    comm.send(partner, 1, payload.clone()).await?;
                    let back = comm.recv(partner, 1).await?;
                    assert_eq!(back.len(), size, "pong has the ping's size");
                } else {
                    let ping = comm.recv(partner, 1).await?;
                    comm.send(partner, 1, ping.into_data()).await?;
                }
            }
            let one_way_us = start.elapsed().as_secs_f64() * 1e6 / (2.0 * iters as f64);
            rows.push((size, one_way_us));
            size *= 4;
        }
        comm.barrier().await?;
        Ok::<_, Error>(rows)
    })
    .await?;
    println!("# rankweave in-process ping-pong, {n} ranks, pairs (0,1)…");
    println!("# {:>10}  {:>14}", "Size", "Latency (us)");
    for (size, us) in results.into_iter().next().expect("rank 0 reports")? {
        println!("{size:>12}  {us:>14.3}");
    }
    Ok(())
}
