/*
 * osu_latency.c - point-to-point latency (OSU "osu_latency", OMB 7.x).
 *
 * Two ranks ping-pong one message of each size: rank 0 MPI_Send then
 * MPI_Recv, rank 1 MPI_Recv then MPI_Send.  After `-x` untimed round trips,
 * rank 0 times each of `-i` round trips and reports the one-way latency
 *
 *     latency (us) = sum of round-trip times * 1e6 / (2 * iterations)
 *
 * Defaults: sizes 1 .. 4 MiB; 10000 iterations + 100 warm-up up to 8192 B,
 * 1000 + 10 above.
 */
#include "osu_common.h"

#include <stdio.h>
#include <stdlib.h>

int main(int argc, char *argv[])
{
    const char *name = "osu_latency";
    struct osu_options opt;
    int nprocs = 0;
    int rank = osu_init(&argc, &argv, name, OSU_LATENCY, &opt, &nprocs);
    char *s_buf, *r_buf;

    osu_require_exactly(rank, nprocs, 2);
    s_buf = osu_alloc(opt.max_size, 'a');
    r_buf = osu_alloc(opt.max_size, 'b');

    osu_print_banner(rank, name, "OSU MPI Latency Test", &opt, nprocs);
    if (rank == 0) {
        printf("%-*s%*s\n", 10, "# Size", OSU_FIELD_WIDTH, "Latency (us)");
        fflush(stdout);
    }

    for (size_t size = opt.min_size; size <= opt.max_size;
         size = osu_next_size(size)) {
        const int iters = osu_iters(&opt, size);
        const int skip = osu_skip(&opt, size);
        const int count = (int)size;
        double t_total = 0.0;

        MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
        for (int i = 0; i < iters + skip; i++) {
            if (rank == 0) {
                double t_start = MPI_Wtime();
                MPI_CHECK(MPI_Send(s_buf, count, MPI_CHAR, 1, 1,
                                   MPI_COMM_WORLD));
                MPI_CHECK(MPI_Recv(r_buf, count, MPI_CHAR, 1, 1,
                                   MPI_COMM_WORLD, MPI_STATUS_IGNORE));
                double t_end = MPI_Wtime();
                if (i >= skip) {
                    t_total += t_end - t_start;
                }
            } else {
                MPI_CHECK(MPI_Recv(r_buf, count, MPI_CHAR, 0, 1,
                                   MPI_COMM_WORLD, MPI_STATUS_IGNORE));
                MPI_CHECK(MPI_Send(s_buf, count, MPI_CHAR, 0, 1,
                                   MPI_COMM_WORLD));
            }
        }

        if (rank == 0) {
            double latency = t_total * 1e6 / (2.0 * iters);
            printf("%-*zu%*.*f\n", 10, size, OSU_FIELD_WIDTH,
                   OSU_FLOAT_PRECISION, latency);
            fflush(stdout);
        }
    }

    free(s_buf);
    free(r_buf);
    return osu_finish();
}
