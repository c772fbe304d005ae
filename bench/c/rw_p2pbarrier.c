/*
 * rw_p2pbarrier.c - a dissemination barrier built from point-to-point
 * messages (rw-bench "p2pbarrier"; not an OSU program).
 *
 * Round k = 0, 1, ... while 2^k < N: every rank sends a 0-byte message to
 * rank + 2^k and receives one from rank - 2^k (mod N), on tag 300 + k so
 * that rounds never match each other's messages.  In each round the
 * receive and the send are both started (MPI_Irecv + MPI_Isend) before
 * either is waited for (MPI_Waitall).  ceil(log2 N) rounds make a barrier:
 * no rank leaves before every rank has entered.
 *
 * Timing as osu_barrier: every rank times each of `-i` barriers (after
 * `-x` untimed ones; nothing separates iterations).  Each rank averages
 * its own times; rank 0 prints the mean over ranks under
 * "# Avg Latency(us)" - one value, no size column (-f adds min, max,
 * iterations).  Defaults: 1000 iterations + 100 warm-up.
 */
#include "osu_common.h"

#include <stdio.h>

/* rw-bench's tag of round 0; round k uses TAG_ROUND0 + k. */
#define TAG_ROUND0 300
/* 2^k < N <= INT_MAX: at most 31 rounds. */
#define MAX_ROUNDS 32

int main(int argc, char *argv[])
{
    const char *name = "rw_p2pbarrier";
    struct osu_options opt;
    int nprocs = 0;
    int rank = osu_init(&argc, &argv, name, OSU_BARRIER, &opt, &nprocs);
    int to[MAX_ROUNDS], from[MAX_ROUNDS];
    int rounds = 0;
    char s_buf = 0, r_buf = 0;
    double timer = 0.0;

    osu_require_at_least(rank, nprocs, 2);
    for (long distance = 1; distance < nprocs; distance *= 2) {
        to[rounds] = (int)((rank + distance) % nprocs);
        from[rounds] = (int)((rank - distance + nprocs) % nprocs);
        rounds++;
    }

    osu_print_banner_from(
        rank, name, "Point-to-Point Dissemination Barrier Latency Test",
        "0-byte MPI_Irecv + MPI_Isend per round, timed as osu_barrier", &opt,
        nprocs);
    osu_print_latency_header(rank, &opt, 0);

    for (int i = 0; i < opt.iterations + opt.skip; i++) {
        double t_start = MPI_Wtime();
        for (int k = 0; k < rounds; k++) {
            MPI_Request req[2];
            MPI_Status stat[2]; /* a real array: GCC's stringop-overflow
                                   check misreads MPI_STATUSES_IGNORE */
            MPI_CHECK(MPI_Irecv(&r_buf, 0, MPI_CHAR, from[k], TAG_ROUND0 + k,
                                MPI_COMM_WORLD, &req[0]));
            MPI_CHECK(MPI_Isend(&s_buf, 0, MPI_CHAR, to[k], TAG_ROUND0 + k,
                                MPI_COMM_WORLD, &req[1]));
            MPI_CHECK(MPI_Waitall(2, req, stat));
        }
        double t_stop = MPI_Wtime();
        if (i >= opt.skip) {
            timer += t_stop - t_start;
        }
    }
    MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));

    osu_print_latency_row(rank, nprocs, &opt, 0, 0, opt.iterations,
                          timer * 1e6 / opt.iterations);
    return osu_finish();
}
