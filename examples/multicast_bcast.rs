//! Broadcasts of every size from every root, each checked byte for byte, with the multicast
//! broadcast's counters printed at the end: the end-to-end check of `RANKWEAVE_BCAST=multicast`
//! (two-stage) and `=channels` (LA-MPI), at whatever loss `RANKWEAVE_MCAST_CHAOS` injects.
//!
//! ```text
//! RANKWEAVE_BCAST=channels RANKWEAVE_MCAST_CHAOS=loss=10% \
//!     rwrun -n 8 target/release/examples/multicast_bcast -- --max 8388608 --late
//! ```
//!
//! Options: `--max BYTES` (largest broadcast, default 1 MiB; sizes run 0, 1, 8, then ×8 up to
//! it, and `BYTES` itself), `--rounds N` (passes over the sizes, default 2), `--late` (ranks
//! sleep a few pseudo-random milliseconds before some broadcasts, so they start them late).
//! Without a launcher it runs 4 in-process ranks (`-- --ranks 6` for 6).

use std::time::Duration;

use bytes::Bytes;
use rankweave::launch::detect::{Bootstrap, detect_from_env};
use rankweave::prelude::*;

#[derive(Clone, Copy, Debug)]
struct Options {
    max: usize,
    rounds: usize,
    late: bool,
    ranks: usize,
}

fn options() -> Result<Options, Error> {
    let mut o = Options {
        max: 1 << 20,
        rounds: 2,
        late: false,
        ranks: 4,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut number = |name: &str| -> Result<usize, Error> {
            let v = args.next().unwrap_or_default();
            v.parse()
                .map_err(|_| Error::InvalidArgument(format!("{name} needs a number, not {v:?}")))
        };
        match a.as_str() {
            "--max" => o.max = number("--max")?,
            "--rounds" => o.rounds = number("--rounds")?,
            "--ranks" => o.ranks = number("--ranks")?.max(1),
            "--late" => o.late = true,
            "--" => {}
            other => {
                return Err(Error::InvalidArgument(format!("unknown option {other:?}")));
            }
        }
    }
    Ok(o)
}

fn sizes(max: usize) -> Vec<usize> {
    let mut v = vec![0, 1];
    let mut s = 8;
    while s < max {
        v.push(s);
        s *= 8;
    }
    v.push(max);
    v
}

/// What broadcast `b` carries (the root makes it; every rank checks against it).
fn payload(b: usize, len: usize) -> Bytes {
    let seed = (b as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    Bytes::from(
        (0..len)
            .map(|i| ((i as u64).wrapping_mul(seed) >> 29) as u8)
            .collect::<Vec<u8>>(),
    )
}

/// A few milliseconds for some (rank, broadcast) pairs: a deterministic scatter of late starts.
fn lateness(rank: usize, b: usize) -> Option<Duration> {
    let h = (rank as u64 * 31 + b as u64 * 17).wrapping_mul(0x2545_f491_4f6c_dd1d) >> 60;
    (h < 5).then(|| Duration::from_millis(h * 3 + 1))
}

async fn run(comm: Communicator, o: Options) -> Result<String, Error> {
    let (me, n) = (comm.rank(), comm.size());
    let mut checked = 0;
    let mut b = 0;
    for _ in 0..o.rounds {
        for len in sizes(o.max) {
            let root = b % n;
            if o.late {
                if let Some(d) = lateness(me, b) {
                    tokio::time::sleep(d).await;
                }
            }
            let expected = payload(b, len);
            let mine = if me == root {
                expected.clone()
            } else {
                Bytes::new()
            };
            let got = comm.broadcast(root, mine).await?;
            if got != expected {
                return Err(Error::InvalidArgument(format!(
                    "broadcast {b} ({len} bytes from {root}) arrived different ({} bytes)",
                    got.len()
                )));
            }
            checked += 1;
            b += 1;
        }
    }
    let stats = comm.multicast_stats().ok_or_else(|| {
        Error::InvalidArgument("no multicast broadcast ran: set RANKWEAVE_BCAST".into())
    })?;
    Ok(format!(
        "{checked} broadcasts verified; multicast received {}, ring repaired {}, nacks sent {}, \
         syncs {}, sync repairs {}, failovers {}, crc failures {}, faults injected {}",
        stats.multicast_received,
        stats.ring_repaired,
        stats.nacks_sent,
        stats.syncs,
        stats.sync_repairs,
        stats.failovers,
        stats.crc_failures,
        stats.group.faults_injected
    ))
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let o = options()?;
    if detect_from_env()? != Bootstrap::Singleton {
        let world = rankweave::init().await?;
        let (me, n) = (world.rank(), world.size());
        let report = run(world.clone(), o).await?;
        rankweave::finalize(world).await?;
        println!("rank {me} of {n}: {report}");
        return Ok(());
    }
    let reports = rankweave::local(o.ranks, move |c| run(c, o)).await?;
    for (r, report) in reports.into_iter().enumerate() {
        println!("rank {r} of {}: {}", o.ranks, report?);
    }
    Ok(())
}
