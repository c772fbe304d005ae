//! Every rank sends messages of each size to its right-hand neighbour and receives them from
//! its left (a window of them at once with `recv`, one message by default, then one with
//! `recv_into`), checking every byte: 0 B to 64 MiB by default, through whatever transport
//! the job uses (with `rwrun`, shared memory between the processes of one host).
//!
//! ```text
//! rwrun -n 4 target/release/examples/exchange
//! rwrun -n 2 target/release/examples/exchange -- 0,1,65536,1048576
//! rwrun -n 3 target/release/examples/exchange -- 65536 16     # windows of 16 messages
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
    let window: usize =
        match std::env::args().nth(2) {
            None => 1,
            Some(w) => w.parse().ok().filter(|&w| w > 0).ok_or_else(|| {
                Error::InvalidArgument(format!("the window must be 1 or more: {w}"))
            })?,
        };
    if detect_from_env()? != Bootstrap::Singleton {
        let world = rankweave::init().await?;
        let (me, n) = (world.rank(), world.size());
        let checked = run(world.clone(), sizes.clone(), window).await?;
        let shm = world.stats().transport.shm;
        rankweave::finalize(world).await?;
        println!(
            "rank {me} of {n}: {checked} sizes up to {} bytes checked (single copy {}, pipelined {}, \
             read into receive {}, lent {})",
            sizes.iter().max().unwrap_or(&0),
            shm.single_copy_sent,
            shm.pipelined_sent,
            shm.read_into_receive,
            shm.payloads_lent
        );
        return Ok(());
    }
    let results = rankweave::local(4, move |comm| run(comm, sizes.clone(), window)).await?;
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

async fn run(comm: Communicator, sizes: Vec<usize>, window: usize) -> Result<usize, Error> {
    let (me, n) = (comm.rank(), comm.size());
    let right = (me + 1) % n;
    let left = (me + n - 1) % n;
    let mut buf = Vec::new();
    for (round, &len) in sizes.iter().enumerate() {
        let want = pattern(left, round, len);
        // Each size received into buffers of the messages' own (`recv`: a window of them,
        // under one tag, so they must arrive in order), then into one of the caller's
        // (`recv_into`, which over shared memory reads a large message from the sender's
        // memory straight there). Sends and receives start at once (operations start when
        // called), so no rank waits on another.
        let tag = 2 * round as u32;
        let nth = |rank, k| pattern(rank, round + k * sizes.len(), len);
        let sends: Vec<_> = (0..window)
            .map(|k| comm.send(right, tag, nth(me, k)))
            .collect();
        let recvs: Vec<_> = (0..window).map(|_| comm.recv(left, tag)).collect();
        for (k, recv) in recvs.into_iter().enumerate() {
            let got = recv.await?;
            check(me, left, len, got.data(), &nth(left, k))?;
        }
        for send in sends {
            send.await?;
        }
        buf.resize(len, 0);
        buf.fill(0);
        let send = comm.send(right, tag + 1, pattern(me, round, len));
        let status = comm.recv_into(left, tag + 1, &mut buf[..]).await?;
        send.await?;
        check(me, left, len, &buf[..status.len], &want)?;
    }
    Ok(sizes.len())
}

/// Whether `got`, the `len`-byte message from rank `left`, is `want`.
fn check(me: usize, left: usize, len: usize, got: &[u8], want: &[u8]) -> Result<(), Error> {
    if got == want {
        return Ok(());
    }
    let at = got
        .iter()
        .zip(want)
        .position(|(a, b)| a != b)
        .unwrap_or(got.len().min(want.len()));
    Err(Error::InvalidArgument(format!(
        "rank {me}: the {len}-byte message from rank {left} differs at byte {at} (length {})",
        got.len()
    )))
}
