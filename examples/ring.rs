//! A token travels around all ranks several times. Its payload is checked at every hop: it
//! carries the lap number and the ranks it has visited in this lap must have stamped it in
//! order.
//!
//! `cargo run --release --example ring` runs 4 in-process ranks; `-- 64` runs 64. Started by a
//! launcher it runs one rank per process instead:
//!
//! ```text
//! rwrun -n 4 target/release/examples/ring
//! mpiexec.mpich -n 4 target/release/examples/ring
//! mpirun.openmpi -n 4 target/release/examples/ring
//! ```

use rankweave::launch::detect::{Bootstrap, detect_from_env};
use rankweave::prelude::*;

const LAPS: u64 = 5;

#[tokio::main]
async fn main() -> Result<(), Error> {
    if detect_from_env()? != Bootstrap::Singleton {
        let world = rankweave::init().await?;
        let (me, n) = (world.rank(), world.size());
        let hops = run(world.clone()).await?;
        rankweave::finalize(world).await?;
        println!("rank {me} of {n}: {hops} hops, payload checked at every hop");
        return Ok(());
    }
    let n: usize = match std::env::args().nth(1) {
        None => 4,
        Some(s) => s.parse().map_err(|_| {
            Error::InvalidArgument(format!("the rank count must be a number, not {s:?}"))
        })?,
    };
    let hops = rankweave::local(n, |comm| async move { run(comm).await }).await?;
    let total: u64 = hops
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?
        .iter()
        .sum();
    println!(
        "ring of {n} ranks: the token made {total} hops in {LAPS} laps, payload checked at every hop"
    );
    Ok(())
}

/// Token layout: `[lap, stamp_0, stamp_1, …]` as u64s; rank r appends r + 1 in its turn.
async fn run(comm: Communicator) -> Result<u64, Error> {
    let (me, n) = (comm.rank(), comm.size());
    let next = (me + 1) % n;
    let prev = (me + n - 1) % n;
    let mut hops = 0;
    for lap in 0..LAPS {
        let mut token: Vec<u64> = if me == 0 {
            vec![lap]
        } else {
            comm.recv(prev, 0).await?.to_vec()?
        };
        let expected: Vec<u64> = std::iter::once(lap)
            .chain((0..me as u64).map(|r| r + 1))
            .collect();
        if token != expected {
            return Err(Error::Protocol {
                peer: prev,
                detail: format!("rank {me} lap {lap}: token {token:?} != {expected:?}"),
            });
        }
        token.push(me as u64 + 1);
        comm.send(next, 0, &token).await?;
        hops += 1;
        if me == 0 {
            // The token comes home carrying every rank's stamp.
            let home: Vec<u64> = comm.recv(prev, 0).await?.to_vec()?;
            let full: Vec<u64> = std::iter::once(lap)
                .chain((0..n as u64).map(|r| r + 1))
                .collect();
            if home != full {
                return Err(Error::Protocol {
                    peer: prev,
                    detail: format!("lap {lap} came home as {home:?}"),
                });
            }
        }
    }
    Ok(hops)
}
