//! Every collective, checked against a sequential reference computed locally from the ranks'
//! deterministic inputs: every root, sizes from 0 to 1 MiB, a non-commutative operation.
//!
//! `cargo run --release --example collectives` runs 5 in-process ranks (`-- 12` runs 12).
//! Started by a launcher it runs one rank per process:
//!
//! ```text
//! rwrun -n 4 target/release/examples/collectives
//! mpiexec.mpich -n 4 target/release/examples/collectives
//! ```

use rankweave::launch::detect::{Bootstrap, detect_from_env};
use rankweave::prelude::*;

/// Element counts tried for the sized collectives.
const COUNTS: [usize; 5] = [0, 1, 7, 1000, 1 << 18];

/// What rank `r` contributes at element count `len`.
fn input(r: usize, len: usize) -> Vec<u32> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761) ^ (r as u32 * 7919))
        .collect()
}

/// `v`'s bytes, as the bytes variants take them.
fn as_bytes(v: &[u32]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

fn fail(what: String) -> Error {
    Error::InvalidArgument(format!("check failed: {what}"))
}

fn expect<T: PartialEq + std::fmt::Debug>(what: &str, got: &T, want: &T) -> Result<(), Error> {
    if got == want {
        Ok(())
    } else {
        Err(fail(format!(
            "{what}: got {} bytes of data that differ from the reference",
            std::mem::size_of_val(got)
        )))
    }
}

/// Affine maps `x ↦ a·x + b` as pairs, composed in rank order: associative, not commutative.
fn compose(lower: &[u64], inout: &mut [u64]) {
    for (l, o) in lower.chunks_exact(2).zip(inout.chunks_exact_mut(2)) {
        let (a, b) = (l[0], l[1]);
        let (c, d) = (o[0], o[1]);
        o[0] = a.wrapping_mul(c);
        o[1] = a.wrapping_mul(d).wrapping_add(b);
    }
}

fn affine(r: usize) -> [u64; 2] {
    [r as u64 * 2 + 1, r as u64 + 3]
}

async fn check_all(comm: Communicator) -> Result<usize, Error> {
    let (me, n) = (comm.rank(), comm.size());
    let mut checks = 0;
    comm.barrier().await?;
    for &len in &COUNTS {
        let mine = input(me, len);
        let all: Vec<Vec<u32>> = (0..n).map(|r| input(r, len)).collect();
        let sum: Vec<u32> = (0..len)
            .map(|i| all.iter().fold(0u32, |s, v| s.wrapping_add(v[i])))
            .collect();
        let concat: Vec<u32> = all.concat();
        for root in 0..n {
            let b = comm
                .broadcast(root, bytemuck::cast_slice::<u32, u8>(&mine).to_vec())
                .await?;
            expect(
                "broadcast",
                &b.to_vec(),
                &bytemuck::cast_slice(&all[root]).to_vec(),
            )?;
            let r = comm.reduce(root, &mine, Op::Sum).await?;
            expect("reduce", &r, &(me == root).then(|| sum.clone()))?;
            let g = comm.gather(root, &mine).await?;
            expect("gather", &g, &(me == root).then(|| concat.clone()))?;
            let s = comm.scatter(root, &concat).await?;
            expect("scatter", &s, &all[me])?;
            checks += 4;
        }
        expect("all_reduce", &comm.all_reduce(&mine, Op::Sum).await?, &sum)?;
        expect("all_gather", &comm.all_gather(&mine).await?, &concat)?;
        let blocks: Vec<u32> = (0..n).flat_map(|d| input(me * n + d, len)).collect();
        let want: Vec<u32> = (0..n).flat_map(|s| input(s * n + me, len)).collect();
        expect("all_to_all", &comm.all_to_all(&blocks).await?, &want)?;
        // The bytes variants, which share the caller's bytes with the peers, on every rank and
        // then on odd ranks only, beside the typed calls of the even ones.
        let (mine_b, blocks_b) = (as_bytes(&mine), as_bytes(&blocks));
        let (concat_b, want_b) = (as_bytes(&concat), as_bytes(&want));
        let gathered = comm.all_gather_bytes(mine_b.clone()).await?;
        expect("all_gather_bytes", &gathered, &concat_b)?;
        let swapped = comm.all_to_all_bytes(blocks_b.clone()).await?;
        expect("all_to_all_bytes", &swapped, &want_b)?;
        let (gathered, swapped) = if me % 2 == 1 {
            let gathered = comm.all_gather_bytes(mine_b).await?;
            (gathered, comm.all_to_all_bytes(blocks_b).await?)
        } else {
            let gathered = comm.all_gather::<u8>(&mine_b).await?;
            (gathered, comm.all_to_all::<u8>(&blocks_b).await?)
        };
        expect("all_gather_bytes beside all_gather", &gathered, &concat_b)?;
        expect("all_to_all_bytes beside all_to_all", &swapped, &want_b)?;
        let wide: Vec<u32> = (0..n).flat_map(|_| mine.iter().copied()).collect();
        expect(
            "reduce_scatter",
            &comm.reduce_scatter(&wide, Op::Sum).await?,
            &sum,
        )?;
        checks += 8;
    }
    // Counts that differ from rank to rank.
    let v = comm.all_gatherv(&input(me, me * 3)).await?;
    expect(
        "all_gatherv",
        &v,
        &(0..n).map(|r| input(r, r * 3)).collect(),
    )?;
    let out: Vec<Vec<u32>> = (0..n).map(|d| input(me + d, d)).collect();
    let back = comm.all_to_allv(out).await?;
    expect(
        "all_to_allv",
        &back,
        &(0..n).map(|s| input(s + me, me)).collect(),
    )?;
    // A non-commutative operation, in rank order.
    let op = UserOp::non_commutative(compose);
    let prefix = |upto: usize| {
        (0..upto).fold(vec![1u64, 0], |mut acc, r| {
            let mut o = affine(r).to_vec();
            compose(&acc, &mut o);
            acc = o;
            acc
        })
    };
    let all = comm.all_reduce(&affine(me), op.clone()).await?;
    expect("all_reduce (non-commutative)", &all, &prefix(n))?;
    let sc = comm.scan(&affine(me), op.clone()).await?;
    expect("scan (non-commutative)", &sc, &prefix(me + 1))?;
    let ex = comm.exscan(&affine(me), op).await?;
    expect(
        "exscan (non-commutative)",
        &ex,
        &(me > 0).then(|| prefix(me)),
    )?;
    checks += 5;
    comm.barrier().await?;
    Ok(checks)
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    if detect_from_env()? != Bootstrap::Singleton {
        let world = rankweave::init().await?;
        let (me, n) = (world.rank(), world.size());
        let checks = check_all(world.clone()).await?;
        rankweave::finalize(world).await?;
        println!("rank {me} of {n}: {checks} collective results match the reference");
        return Ok(());
    }
    let n: usize = match std::env::args().nth(1) {
        None => 5,
        Some(s) => s.parse().map_err(|_| {
            Error::InvalidArgument(format!("the rank count must be a number, not {s:?}"))
        })?,
    };
    let results = rankweave::local(n, check_all).await?;
    let checks: usize = results
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?
        .iter()
        .sum();
    println!("{n} ranks: {checks} collective results match the reference");
    Ok(())
}
