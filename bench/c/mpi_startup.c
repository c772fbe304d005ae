/*
 * mpi_startup.c - the start-up benchmark's MPI program: MPI_Init, one MPI_Barrier,
 * MPI_Finalize, nothing else.  `compare --startup` times the whole launcher
 * command (launch to exit) for several process counts, interleaved with
 * rankweave's examples/startup.rs under rwrun.
 */
#include <mpi.h>
#include <stdio.h>

int main(int argc, char *argv[])
{
    if (MPI_Init(&argc, &argv) != MPI_SUCCESS) {
        fprintf(stderr, "mpi_startup: MPI_Init failed\n");
        return 1;
    }
    if (MPI_Barrier(MPI_COMM_WORLD) != MPI_SUCCESS) {
        fprintf(stderr, "mpi_startup: MPI_Barrier failed\n");
        MPI_Abort(MPI_COMM_WORLD, 1);
        return 1;
    }
    MPI_Finalize();
    return 0;
}
