/*
 * rw_ring.c - ring exchange latency (rw-bench "ring"; not an OSU program).
 *
 * The periodic chain of IMB-MPI1's Sendrecv: per iteration every rank
 * sends `size` bytes to its right neighbour (rank + 1 mod N) and receives
 * `size` bytes from its left neighbour (rank - 1 mod N), tag 200.  The
 * receive and the send are both started (MPI_Irecv + MPI_Isend) before
 * either is waited for (MPI_Waitall), as rw-bench starts both futures
 * before awaiting them.  With 2 ranks both neighbours are the other rank.
 *
 * Timing as osu_barrier: per size an MPI_Barrier, then every rank times
 * each iteration on its own (nothing separates iterations) and sums the
 * timed ones.  Each rank averages its own times; rank 0 prints the mean
 * over ranks ("Avg Latency(us)"; -f adds min, max, iterations).
 * Defaults as the OSU collectives: sizes 1 .. 1 MiB; 1000 iterations + 100
 * warm-up up to 8192 B, 100 + 10 above.
 */
#include "osu_common.h"

#include <stdio.h>
#include <stdlib.h>

/* rw-bench's tag for the ring. */
#define TAG_RING 200

int main(int argc, char *argv[])
{
    const char *name = "rw_ring";
    struct osu_options opt;
    int nprocs = 0;
    int rank = osu_init(&argc, &argv, name, OSU_COLL, &opt, &nprocs);
    int right, left;
    char *s_buf, *r_buf;

    osu_require_at_least(rank, nprocs, 2);
    right = (rank + 1) % nprocs;
    left = (rank + nprocs - 1) % nprocs;
    s_buf = osu_alloc(opt.max_size, 'a');
    r_buf = osu_alloc(opt.max_size, 'b');

    osu_print_banner_from(rank, name, "Ring Exchange Latency Test",
                          "IMB-MPI1 Sendrecv's chain, timed as osu_barrier",
                          &opt, nprocs);
    osu_print_latency_header(rank, &opt, 1);

    for (size_t size = opt.min_size; size <= opt.max_size;
         size = osu_next_size(size)) {
        const int iters = osu_iters(&opt, size);
        const int skip = osu_skip(&opt, size);
        const int count = (int)size;
        double timer = 0.0;

        MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
        for (int i = 0; i < iters + skip; i++) {
            MPI_Request req[2];
            MPI_Status stat[2]; /* a real array: GCC's stringop-overflow
                                   check misreads MPI_STATUSES_IGNORE */
            double t_start = MPI_Wtime();
            MPI_CHECK(MPI_Irecv(r_buf, count, MPI_CHAR, left, TAG_RING,
                                MPI_COMM_WORLD, &req[0]));
            MPI_CHECK(MPI_Isend(s_buf, count, MPI_CHAR, right, TAG_RING,
                                MPI_COMM_WORLD, &req[1]));
            MPI_CHECK(MPI_Waitall(2, req, stat));
            double t_stop = MPI_Wtime();
            if (i >= skip) {
                timer += t_stop - t_start;
            }
        }
        osu_print_latency_row(rank, nprocs, &opt, 1, size, iters,
                              timer * 1e6 / iters);
    }

    free(s_buf);
    free(r_buf);
    return osu_finish();
}
