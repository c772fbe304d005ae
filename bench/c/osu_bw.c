/*
 * osu_bw.c - unidirectional bandwidth (OSU "osu_bw", OMB 7.x).
 *
 * Per iteration rank 0 posts a window of `-W` (default 64) MPI_Isend of
 * one size from a single buffer and waits for them all; rank 1 posts the
 * matching MPI_Irecv into a single buffer, waits, and answers with a 4-byte
 * ack that rank 0 receives.  Rank 0 times each iteration (window + ack)
 * after `-x` untimed ones and reports
 *
 *     MB/s = size * window * iterations / 1e6 / sum of iteration times
 *
 * (MB = 10^6 bytes).  Defaults: sizes 1 .. 4 MiB; 100 iterations + 10
 * warm-up up to 8192 B, 20 + 2 above.
 */
#include "osu_common.h"

#include <stdio.h>
#include <stdlib.h>

int main(int argc, char *argv[])
{
    const char *name = "osu_bw";
    struct osu_options opt;
    int nprocs = 0;
    int rank = osu_init(&argc, &argv, name, OSU_BW, &opt, &nprocs);
    char *s_buf, *r_buf;
    MPI_Request *req;
    MPI_Status *stat; /* OSU passes a real status array, so do we */

    osu_require_exactly(rank, nprocs, 2);
    s_buf = osu_alloc(opt.max_size, 'a');
    r_buf = osu_alloc(opt.max_size, 'b');
    req = malloc(sizeof *req * (size_t)opt.window);
    stat = malloc(sizeof *stat * (size_t)opt.window);
    if (req == NULL || stat == NULL) {
        MPI_Abort(MPI_COMM_WORLD, EXIT_FAILURE);
    }

    osu_print_banner(rank, name, "OSU MPI Bandwidth Test", &opt, nprocs);
    if (rank == 0) {
        printf("%-*s%*s\n", 10, "# Size", OSU_FIELD_WIDTH, "Bandwidth (MB/s)");
        fflush(stdout);
    }

    for (size_t size = opt.min_size; size <= opt.max_size;
         size = osu_next_size(size)) {
        const int iters = osu_iters(&opt, size);
        const int skip = osu_skip(&opt, size);
        const int count = (int)size;
        const int window = opt.window;
        double t_total = 0.0;

        MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
        for (int i = 0; i < iters + skip; i++) {
            if (rank == 0) {
                double t_start = MPI_Wtime();
                for (int j = 0; j < window; j++) {
                    MPI_CHECK(MPI_Isend(s_buf, count, MPI_CHAR, 1, 100,
                                        MPI_COMM_WORLD, &req[j]));
                }
                MPI_CHECK(MPI_Waitall(window, req, stat));
                MPI_CHECK(MPI_Recv(r_buf, 4, MPI_CHAR, 1, 101, MPI_COMM_WORLD,
                                   MPI_STATUS_IGNORE));
                double t_end = MPI_Wtime();
                if (i >= skip) {
                    t_total += t_end - t_start;
                }
            } else {
                for (int j = 0; j < window; j++) {
                    MPI_CHECK(MPI_Irecv(r_buf, count, MPI_CHAR, 0, 100,
                                        MPI_COMM_WORLD, &req[j]));
                }
                MPI_CHECK(MPI_Waitall(window, req, stat));
                MPI_CHECK(MPI_Send(s_buf, 4, MPI_CHAR, 0, 101, MPI_COMM_WORLD));
            }
        }

        if (rank == 0) {
            double mb = (double)size / 1e6 * iters * window;
            printf("%-*zu%*.*f\n", 10, size, OSU_FIELD_WIDTH,
                   OSU_FLOAT_PRECISION, mb / t_total);
            fflush(stdout);
        }
    }

    free(stat);
    free(req);
    free(s_buf);
    free(r_buf);
    return osu_finish();
}
