/*
 * osu_bcast.c - OSU MPI Broadcast Latency Test (OSU "osu_bcast", OMB 7.x).
 *
 * MPI_Bcast of `size` bytes (MPI_CHAR) from root 0.
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
    (void)rbuf;
    MPI_CHECK(MPI_Bcast(sbuf, count, MPI_CHAR, 0, comm));
}

int main(int argc, char *argv[])
{
    return osu_run_collective(argc, argv, "osu_bcast",
                              "OSU MPI Broadcast Latency Test",
                              op, 1, 1);
}
