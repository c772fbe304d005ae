//! The start-up benchmark's rank program: join the job, one barrier, finalize, nothing else —
//! what `MPI_Init` + `MPI_Barrier` + `MPI_Finalize` do in `bench/c/startup.c`.
//! `bench/compare --startup` times `rwrun -n N` of it against `mpiexec.mpich` and
//! `mpirun.openmpi` of the C program.
//!
//! ```text
//! cargo build --release --example startup --bin rwrun
//! target/release/rwrun -n 8 target/release/examples/startup
//! ```
//!
//! Without a launcher it is a singleton job (rank 0 of 1).

use rankweave::prelude::*;

// One thread, as an MPI rank has: start-up cost is what is measured.
#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Error> {
    let world = rankweave::init().await?;
    world.barrier().await?;
    rankweave::finalize(world).await
}
