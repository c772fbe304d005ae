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
    double timer = 0.0, latency, min_lat = 0.0, max_lat = 0.0, sum_lat = 0.0;

    osu_require_at_least(rank, nprocs, 2);
    osu_print_banner(rank, name, "OSU MPI Barrier Latency Test", &opt, nprocs);
    if (rank == 0) {
        printf("# Avg Latency(us)");
        if (opt.full) {
            printf("%*s%*s%*s", OSU_FIELD_WIDTH, "Min Latency(us)",
                   OSU_FIELD_WIDTH, "Max Latency(us)", 12, "Iterations");
        }
        printf("\n");
        fflush(stdout);
    }

    for (int i = 0; i < opt.iterations + opt.skip; i++) {
        double t_start = MPI_Wtime();
        MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
        double t_stop = MPI_Wtime();
        if (i >= opt.skip) {
            timer += t_stop - t_start;
        }
    }
    MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));

    latency = timer * 1e6 / opt.iterations;
    MPI_CHECK(MPI_Reduce(&latency, &min_lat, 1, MPI_DOUBLE, MPI_MIN, 0,
                         MPI_COMM_WORLD));
    MPI_CHECK(MPI_Reduce(&latency, &max_lat, 1, MPI_DOUBLE, MPI_MAX, 0,
                         MPI_COMM_WORLD));
    MPI_CHECK(MPI_Reduce(&latency, &sum_lat, 1, MPI_DOUBLE, MPI_SUM, 0,
                         MPI_COMM_WORLD));
    if (rank == 0) {
        /* OSU prints the value right-aligned in 17 columns when there is no
         * size column. */
        printf("%*.*f", 17, OSU_FLOAT_PRECISION, sum_lat / nprocs);
        if (opt.full) {
            printf("%*.*f%*.*f%*d", OSU_FIELD_WIDTH, OSU_FLOAT_PRECISION,
                   min_lat, OSU_FIELD_WIDTH, OSU_FLOAT_PRECISION, max_lat, 12,
                   opt.iterations);
        }
        printf("\n");
        fflush(stdout);
    }
    return osu_finish();
}
