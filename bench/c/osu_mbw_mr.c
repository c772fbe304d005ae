/*
 * osu_mbw_mr.c - multiple bandwidth / message rate (OSU "osu_mbw_mr",
 * OMB 7.x), run with one pair for rankweave's `mr`.
 *
 * Ranks are split into pairs by block order: rank r < P sends to r + P,
 * where P = nprocs / 2 (with 2 ranks: one pair, 0 -> 1; an odd last rank
 * idles).  Every iteration starts with an untimed MPI_Barrier; then each
 * sender times a window of `-W` (default 64) MPI_Isend + MPI_Waitall plus a
 * 4-byte ack from its receiver (which posted the matching MPI_Irecv
 * window).  Rank 0's own times give
 *
 *     MB/s       = size * P * window * iterations / 1e6 / sum of times
 *     Messages/s = MB/s * 1e6 / size = P * window * iterations / sum of times
 *
 * Defaults: sizes 1 .. 4 MiB; 100 iterations + 10 warm-up at EVERY size
 * (osu_mbw_mr has no large-message switch).
 */
#include "osu_common.h"

#include <stdio.h>
#include <stdlib.h>

int main(int argc, char *argv[])
{
    const char *name = "osu_mbw_mr";
    struct osu_options opt;
    int nprocs = 0;
    int rank = osu_init(&argc, &argv, name, OSU_MR, &opt, &nprocs);
    char *s_buf, *r_buf;
    MPI_Request *req;
    MPI_Status *stat; /* OSU passes a real status array, so do we */

    osu_require_at_least(rank, nprocs, 2);
    const int pairs = nprocs / 2;
    s_buf = osu_alloc(opt.max_size, 'a');
    r_buf = osu_alloc(opt.max_size, 'b');
    req = malloc(sizeof *req * (size_t)opt.window);
    stat = malloc(sizeof *stat * (size_t)opt.window);
    if (req == NULL || stat == NULL) {
        MPI_Abort(MPI_COMM_WORLD, EXIT_FAILURE);
    }

    osu_print_banner(rank, name,
                     "OSU MPI Multiple Bandwidth / Message Rate Test", &opt,
                     nprocs);
    if (rank == 0) {
        printf("# [ pairs: %d ] [ window size: %d ]\n", pairs, opt.window);
        printf("%-*s%*s%*s\n", 10, "# Size", OSU_FIELD_WIDTH, "MB/s",
               OSU_FIELD_WIDTH, "Messages/s");
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
            MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
            if (rank < pairs) {
                const int target = rank + pairs;
                double t_start = MPI_Wtime();
                for (int j = 0; j < window; j++) {
                    MPI_CHECK(MPI_Isend(s_buf, count, MPI_CHAR, target, 100,
                                        MPI_COMM_WORLD, &req[j]));
                }
                MPI_CHECK(MPI_Waitall(window, req, stat));
                MPI_CHECK(MPI_Recv(r_buf, 4, MPI_CHAR, target, 101,
                                   MPI_COMM_WORLD, MPI_STATUS_IGNORE));
                double t_end = MPI_Wtime();
                if (i >= skip) {
                    t_total += t_end - t_start;
                }
            } else if (rank < 2 * pairs) {
                const int source = rank - pairs;
                for (int j = 0; j < window; j++) {
                    MPI_CHECK(MPI_Irecv(r_buf, count, MPI_CHAR, source, 100,
                                        MPI_COMM_WORLD, &req[j]));
                }
                MPI_CHECK(MPI_Waitall(window, req, stat));
                MPI_CHECK(MPI_Send(s_buf, 4, MPI_CHAR, source, 101,
                                   MPI_COMM_WORLD));
            }
        }

        if (rank == 0) {
            double mb = (double)size / 1e6 * pairs * iters * window;
            double bw = mb / t_total;
            double rate = bw * 1e6 / (double)size;
            printf("%-*zu%*.*f%*.*f\n", 10, size, OSU_FIELD_WIDTH,
                   OSU_FLOAT_PRECISION, bw, OSU_FIELD_WIDTH,
                   OSU_FLOAT_PRECISION, rate);
            fflush(stdout);
        }
    }

    free(stat);
    free(req);
    free(s_buf);
    free(r_buf);
    return osu_finish();
}
