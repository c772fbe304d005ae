/*
 * osu_bibw.c - bidirectional bandwidth (OSU "osu_bibw", OMB 7.x).
 *
 * Per iteration both ranks post a window of `-W` (default 64) MPI_Irecv,
 * then a window of MPI_Isend of one size to each other (single send and
 * single receive buffer per rank), and wait for all of them (rank 0: sends
 * then receives; rank 1: receives then sends).  There is no ack.  Rank 0
 * times each iteration after `-x` untimed ones and reports
 *
 *     MB/s = size * window * 2 * iterations / 1e6 / sum of iteration times
 *
 * Defaults: sizes 1 .. 4 MiB; 100 iterations + 10 warm-up up to 8192 B,
 * 20 + 2 above.
 */
#include "osu_common.h"

#include <stdio.h>
#include <stdlib.h>

int main(int argc, char *argv[])
{
    const char *name = "osu_bibw";
    struct osu_options opt;
    int nprocs = 0;
    int rank = osu_init(&argc, &argv, name, OSU_BW, &opt, &nprocs);
    char *s_buf, *r_buf;
    MPI_Request *send_req, *recv_req;
    MPI_Status *stat; /* OSU passes real status arrays, so do we */

    osu_require_exactly(rank, nprocs, 2);
    s_buf = osu_alloc(opt.max_size, 'a');
    r_buf = osu_alloc(opt.max_size, 'b');
    send_req = malloc(sizeof *send_req * (size_t)opt.window);
    recv_req = malloc(sizeof *recv_req * (size_t)opt.window);
    stat = malloc(sizeof *stat * (size_t)opt.window);
    if (send_req == NULL || recv_req == NULL || stat == NULL) {
        MPI_Abort(MPI_COMM_WORLD, EXIT_FAILURE);
    }

    osu_print_banner(rank, name, "OSU MPI Bi-Directional Bandwidth Test",
                     &opt, nprocs);
    if (rank == 0) {
        printf("%-*s%*s\n", 10, "# Size", OSU_FIELD_WIDTH, "Bandwidth (MB/s)");
        fflush(stdout);
    }

    const int peer = 1 - rank;
    /* rank 0 sends with tag 100 and receives tag 10; rank 1 the reverse */
    const int send_tag = rank == 0 ? 100 : 10;
    const int recv_tag = rank == 0 ? 10 : 100;

    for (size_t size = opt.min_size; size <= opt.max_size;
         size = osu_next_size(size)) {
        const int iters = osu_iters(&opt, size);
        const int skip = osu_skip(&opt, size);
        const int count = (int)size;
        const int window = opt.window;
        double t_total = 0.0;

        MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
        for (int i = 0; i < iters + skip; i++) {
            double t_start = MPI_Wtime();
            for (int j = 0; j < window; j++) {
                MPI_CHECK(MPI_Irecv(r_buf, count, MPI_CHAR, peer, recv_tag,
                                    MPI_COMM_WORLD, &recv_req[j]));
            }
            for (int j = 0; j < window; j++) {
                MPI_CHECK(MPI_Isend(s_buf, count, MPI_CHAR, peer, send_tag,
                                    MPI_COMM_WORLD, &send_req[j]));
            }
            if (rank == 0) {
                MPI_CHECK(MPI_Waitall(window, send_req, stat));
                MPI_CHECK(MPI_Waitall(window, recv_req, stat));
            } else {
                MPI_CHECK(MPI_Waitall(window, recv_req, stat));
                MPI_CHECK(MPI_Waitall(window, send_req, stat));
            }
            double t_end = MPI_Wtime();
            if (i >= skip) {
                t_total += t_end - t_start;
            }
        }

        if (rank == 0) {
            double mb = (double)size / 1e6 * iters * window * 2;
            printf("%-*zu%*.*f\n", 10, size, OSU_FIELD_WIDTH,
                   OSU_FLOAT_PRECISION, mb / t_total);
            fflush(stdout);
        }
    }

    free(stat);
    free(send_req);
    free(recv_req);
    free(s_buf);
    free(r_buf);
    return osu_finish();
}
