/*
 * osu_barrier.c - MPI_Barrier latency (OSU "osu_barrier", OMB 7.x).
 *
 * Every rank times each of `-i` MPI_Barrier calls (after `-x` untimed ones;
 * the barrier is the operation, so nothing separates iterations).  Each
 * rank averages its own times; rank 0 prints the mean of the per-rank
 * averages under "# Avg Latency(us)" - one value, no size column.
 * Defaults: 1000 iterations + 100 warm-up.
 */
#include "osu_common.h"

#include <stdio.h>

int main(int argc, char *argv[])
{
    const char *name = "osu_barrier";
    struct osu_options opt;
    int nprocs = 0;
    int rank = osu_init(&argc, &argv, name, OSU_BARRIER, &opt, &nprocs);
    double timer = 0.0;

    osu_require_at_least(rank, nprocs, 2);
    osu_print_banner(rank, name, "OSU MPI Barrier Latency Test", &opt, nprocs);
    osu_print_latency_header(rank, &opt, 0);

    for (int i = 0; i < opt.iterations + opt.skip; i++) {
        double t_start = MPI_Wtime();
        MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
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
