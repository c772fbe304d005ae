/*
 * osu_allreduce.c - OSU MPI Allreduce Latency Test
 * (OSU "osu_allreduce", OMB 7.x).
 *
 * MPI_Allreduce (MPI_SUM) of `size` bytes, i.e. `size` MPI_CHAR elements.
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
    MPI_CHECK(MPI_Allreduce(sbuf, rbuf, count, MPI_CHAR, MPI_SUM, comm));
}

int main(int argc, char *argv[])
{
    return osu_run_collective(argc, argv, "osu_allreduce",
                              "OSU MPI Allreduce Latency Test",
                              op, 1, 1);
}
