/*
 * osu_allgather.c - OSU MPI Allgather Latency Test
 * (OSU "osu_allgather", OMB 7.x).
 *
 * MPI_Allgather: every rank contributes `size` bytes and receives
 * `size * nprocs`.
 *
 * Timing, shared with the other collectives (osu_common.c): per size an
 * MPI_Barrier, then each iteration times only the call on every rank and
 * is followed by an untimed MPI_Barrier; warm-up iterations are not timed.
 * Each rank averages its own times; rank 0 prints the mean over ranks
 * ("Avg Latency(us)").  Defaults: sizes 1 .. 1 MiB; 1000 iterations + 100
 * warm-up up to 8192 B, 100 + 10 above.
 */
#include "osu_common.h"

static void op(void *sbuf, void *rbuf, int count, MPI_Comm comm)
{
    MPI_CHECK(MPI_Allgather(sbuf, count, MPI_CHAR, rbuf, count, MPI_CHAR,
                            comm));
}

int main(int argc, char *argv[])
{
    return osu_run_collective(argc, argv, "osu_allgather",
                              "OSU MPI Allgather Latency Test",
                              op, 1, 0);
}
