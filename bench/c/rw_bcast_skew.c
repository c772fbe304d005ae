/*
 * rw_bcast_skew.c - broadcast latency and per-rank completion skew
 * (rankweave's `rw-bench bcast --skew`; OSU has no such program).
 *
 * Per size an MPI_Barrier; then per iteration an MPI_Barrier, after which
 * rank 0 takes t0 and every rank calls MPI_Bcast of `size` bytes (MPI_CHAR)
 * from root 0 and records the instant its call returned.  Instants are read
 * from CLOCK_MONOTONIC, which every process of one host shares (all ranks
 * must run on one host).  Warm-up iterations are not recorded.  After the
 * iterations, untimed, the instants are gathered on rank 0, which prints
 * per size:
 *
 *   Avg Latency(us)  the mean over the ranks of each rank's mean call time
 *                    (as osu_bcast; the barrier comes before the call here,
 *                    after it in osu_bcast);
 *   Skew(us)         the median over the iterations of the latest minus the
 *                    earliest completion over the non-root ranks (0 on two
 *                    ranks, which have one non-root rank);
 *   Last(us)         the median over the iterations of the latest non-root
 *                    completion minus t0.
 *
 * Flags, defaults and row layout are the collectives' (osu_common.h):
 * sizes 1 .. 1 MiB, 1000 iterations + 100 warm-up up to 8192 B, 100 + 10
 * above; -m, -i, -x.  -f is not accepted (the columns are fixed).
 */
#define _POSIX_C_SOURCE 200809L

#include "osu_common.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* CLOCK_MONOTONIC in nanoseconds: one clock for every process here. */
static uint64_t monotonic_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;

    return (x > y) - (x < y);
}

/* Median of v[0..n) (sorts v); the mean of the middle two for even n. */
static double median(double *v, int n)
{
    if (n <= 0) {
        return 0.0;
    }
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2.0;
}

int main(int argc, char *argv[])
{
    struct osu_options opt;
    int nprocs = 0;
    int rank = osu_init(&argc, &argv, "rw_bcast_skew", OSU_COLL, &opt, &nprocs);
    int max_iters;
    char *buf;
    uint64_t *mine, *all = NULL;
    double *skews = NULL, *lasts = NULL;

    osu_require_at_least(rank, nprocs, 2);
    if (opt.full) {
        if (rank == 0) {
            fprintf(stderr, "rw_bcast_skew: -f does not apply (fixed columns)\n");
        }
        MPI_Finalize();
        return EXIT_FAILURE;
    }
    max_iters = opt.iterations > opt.iterations_large ? opt.iterations
                                                      : opt.iterations_large;
    buf = osu_alloc(opt.max_size, 1);
    mine = malloc((size_t)max_iters * sizeof *mine);
    if (rank == 0) {
        all = malloc((size_t)max_iters * (size_t)nprocs * sizeof *all);
        skews = malloc((size_t)max_iters * sizeof *skews);
        lasts = malloc((size_t)max_iters * sizeof *lasts);
    }
    if (mine == NULL || (rank == 0 && (all == NULL || skews == NULL ||
                                       lasts == NULL))) {
        fprintf(stderr, "rw_bcast_skew: out of memory\n");
        MPI_Abort(MPI_COMM_WORLD, EXIT_FAILURE);
    }

    osu_print_banner_from(rank, "rw_bcast_skew",
                          "Broadcast Latency and Completion Skew Test",
                          "rw-bench bcast --skew definitions", &opt, nprocs);
    if (rank == 0) {
        printf("# Datatype: MPI_CHAR. Completion skew over the %d non-root "
               "ranks, medians over the iterations.\n",
               nprocs - 1);
        printf("%-*s%*s%*s%*s\n", 10, "# Size", OSU_FIELD_WIDTH,
               "Avg Latency(us)", OSU_FIELD_WIDTH, "Skew(us)", OSU_FIELD_WIDTH,
               "Last(us)");
        fflush(stdout);
    }

    for (size_t size = opt.min_size; size <= opt.max_size;
         size = osu_next_size(size)) {
        int iters = osu_iters(&opt, size);
        int skip = osu_skip(&opt, size);
        double timer = 0.0, latency, sum_lat = 0.0;

        MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
        for (int i = 0; i < iters + skip; i++) {
            uint64_t t0, done;

            MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
            t0 = monotonic_ns();
            MPI_CHECK(MPI_Bcast(buf, (int)size, MPI_CHAR, 0, MPI_COMM_WORLD));
            done = monotonic_ns();
            if (i >= skip) {
                timer += (double)(done - t0) * 1e-9;
                /* The root keeps its t0s, every other rank its completions. */
                mine[i - skip] = rank == 0 ? t0 : done;
            }
        }
        latency = timer * 1e6 / iters;
        MPI_CHECK(MPI_Reduce(&latency, &sum_lat, 1, MPI_DOUBLE, MPI_SUM, 0,
                             MPI_COMM_WORLD));
        MPI_CHECK(MPI_Gather(mine, iters, MPI_UINT64_T, all, iters,
                             MPI_UINT64_T, 0, MPI_COMM_WORLD));
        if (rank == 0) {
            for (int i = 0; i < iters; i++) {
                uint64_t first = UINT64_MAX, last = 0;

                for (int r = 1; r < nprocs; r++) {
                    uint64_t t = all[(size_t)r * (size_t)iters + (size_t)i];

                    first = t < first ? t : first;
                    last = t > last ? t : last;
                }
                skews[i] = (double)(last - first) / 1e3;
                lasts[i] = ((double)last - (double)all[i]) / 1e3;
            }
            printf("%-*zu%*.*f%*.*f%*.*f\n", 10, size, OSU_FIELD_WIDTH,
                   OSU_FLOAT_PRECISION, sum_lat / nprocs, OSU_FIELD_WIDTH,
                   OSU_FLOAT_PRECISION, median(skews, iters), OSU_FIELD_WIDTH,
                   OSU_FLOAT_PRECISION, median(lasts, iters));
            fflush(stdout);
        }
    }

    free(buf);
    free(mine);
    free(all);
    free(skews);
    free(lasts);
    return osu_finish();
}
