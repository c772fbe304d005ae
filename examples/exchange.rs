//! Every rank sends a message of each size to its right-hand neighbour and receives one from
//! its left, checking every byte: 0 B to 64 MiB by default, through whatever transport the job
//! uses (with `rwrun`, shared memory between the processes of one host).
//!
//! ```text
//! rwrun -n 4 target/release/examples/exchange
//! rwrun -n 2 target/release/examples/exchange -- 0,1,65536,1048576
//! RANKWEAVE_SHM_SINGLE_COPY=off rwrun -n 8 target/release/examples/exchange
//! ```
//!
//! Run without a launcher it runs 4 in-process ranks.

use rankweave::launch::detect::{Bootstrap, detect_from_env};
use rankweave::prelude::*;

const DEFAULT_SIZES: &[usize] = &[
    0,
    1,
    100,
    1024,
    16 * 1024,
    65_536,
    200_000,
    1 << 20,
    4 << 20,
    16 << 20,
    64 << 20,
];

#[tokio::main]
async fn main() -> Result<(), Error> {
    let sizes: Vec<usize> = match std::env::args().nth(1) {
        None => DEFAULT_SIZES.to_vec(),
        Some(list) => list
            .split(',')
            .map(|s| s.trim().parse())
            .collect::<Result<_, _>>()
            .map_err(|_| Error::InvalidArgument(format!("sizes must be numbers: {list:?}")))?,
    };
    if detect_from_env()? != Bootstrap::Singleton {
        let world = rankweave::init().await?;
        let (me, n) = (world.rank(), world.size());
        let checked = run(world.clone(), sizes.clone()).await?;
        let shm = world.stats().transport.shm;
        rankweave::finalize(world).await?;
        println!(
            "rank {me} of {n}: {checked} sizes up to {} bytes checked (single copy {}, pipelined {})",
            sizes.iter().max().unwrap_or(&0),
            shm.single_copy_sent,
            shm.pipelined_sent
        );
        return Ok(());
    }
    let results = rankweave::local(4, move |comm| run(comm, sizes.clone())).await?;
    let checked = results.into_iter().collect::<Result<Vec<_>, _>>()?;
    println!("4 in-process ranks: {checked:?} sizes checked");
    Ok(())
}

/// The bytes rank `rank` sends in round `round`: a cheap pattern that differs per rank, round
/// and position.
fn pattern(rank: usize, round: usize, len: usize) -> Vec<u8> {
    let seed = (rank * 131 + round * 7 + 1) as u32;
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13).wrapping_add(seed) as u8)
        .collect()
}

async fn run(comm: Communicator, sizes: Vec<usize>) -> Result<usize, Error> {
    let (me, n) = (comm.rank(), comm.size());
    let right = (me + 1) % n;
    let left = (me + n - 1) % n;
    for (round, &len) in sizes.iter().enumerate() {
        // Both start at once (operations start when called), so no rank waits on another.
        let send = comm.send(right, round as u32, pattern(me, round, len));
        let got = comm.recv(left, round as u32).await?;
        send.await?;
        let want = pattern(left, round, len);
        if got.data()[..] != want[..] {
            let at = got
                .data()
                .iter()
                .zip(&want)
                .position(|(a, b)| a != b)
                .unwrap_or(got.data().len().min(want.len()));
            return Err(Error::InvalidArgument(format!(
                "rank {me}: the {len}-byte message from rank {left} differs at byte {at} (length {})",
                got.data().len()
            )));
        }
    }
    Ok(sizes.len())
}
