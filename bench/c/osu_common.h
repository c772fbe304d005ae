/*
 * osu_common.h - shared pieces of rankweave's C MPI baseline benchmarks.
 *
 * These programs re-implement (they are our own code, not copies) the
 * measurements of the OSU micro-benchmarks 7.x so that Debian's MPICH and
 * Open MPI can be measured with exactly the definitions rankweave's `rw-bench`
 * uses; rw_ring.c and rw_p2pbarrier.c, which OSU does not have, keep the
 * same conventions.  What follows OMB 7.x:
 *
 *   - message sizes: doubling from MIN to MAX (`-m MIN:MAX`); defaults
 *     1 .. 4 MiB for point-to-point and message rate, 1 .. 1 MiB for
 *     collectives.  OMB 7.x skips a size that holds zero elements, so it
 *     never prints a 0-byte row; here `latency -m 0:N` adds one (an
 *     extension, off by default); the other programs reject a 0 minimum.
 *   - iterations / warm-up ("skip"), small vs. large where "large" means
 *     size > 8192 bytes:
 *         latency        10000 / 100    large 1000 / 10
 *         bw, bibw         100 / 10     large   20 / 2     window 64
 *         mr (mbw_mr)      100 / 10     (no large switch)  window 64
 *         collectives     1000 / 100    large  100 / 10   (and rw_ring)
 *         barrier         1000 / 100    (no size; and rw_p2pbarrier)
 *     `-i N` sets the iterations for small AND large sizes, `-x N` the
 *     warm-up for both, exactly like OMB 7.x.
 *   - output: `%-10d%20.2f` rows under OSU's column headers; every other line
 *     starts with '#'.
 */
#ifndef RW_OSU_COMMON_H
#define RW_OSU_COMMON_H

#include <mpi.h>
#include <stddef.h>

/* OSU's switch between "small" and "large" messages (bytes, exclusive). */
#define OSU_LARGE_MESSAGE_SIZE 8192

/* Default size ranges (OMB 7.x: MAX_MESSAGE_SIZE and MAX_MSG_SIZE_COLL). */
#define OSU_MAX_MSG_PT2PT ((size_t)1 << 22)
#define OSU_MAX_MSG_COLL ((size_t)1 << 20)

/* Upper bound for -W, only to keep request arrays sane. */
#define OSU_MAX_WINDOW 4096

/* Float fields are FIELD_WIDTH wide with FLOAT_PRECISION decimals, the size
 * column is 10 wide and left-aligned: the OSU layout. */
#define OSU_FIELD_WIDTH 20
#define OSU_FLOAT_PRECISION 2

/* Which family of defaults and which flags a program takes. */
enum osu_kind {
    OSU_LATENCY, /* ping-pong                               */
    OSU_BW,      /* bw and bibw: windowed, large switch      */
    OSU_MR,      /* mbw_mr: windowed, no large switch        */
    OSU_COLL,    /* sized collectives                        */
    OSU_BARRIER, /* barrier: no sizes                        */
};

struct osu_options {
    enum osu_kind kind;
    size_t min_size;
    size_t max_size;
    int iterations;       /* size <= 8192 */
    int iterations_large; /* size >  8192 */
    int skip;             /* warm-up, size <= 8192 */
    int skip_large;       /* warm-up, size >  8192 */
    int window;           /* bw, bibw, mr */
    int full;             /* collectives: also print min/max/iterations (-f) */
};

/* Abort the whole job with a message naming the failing call. */
#define MPI_CHECK(call)                                                        \
    do {                                                                       \
        int mpi_check_rc_ = (call);                                            \
        if (mpi_check_rc_ != MPI_SUCCESS) {                                    \
            osu_mpi_fail(#call, __FILE__, __LINE__, mpi_check_rc_);            \
        }                                                                      \
    } while (0)

void osu_mpi_fail(const char *call, const char *file, int line, int rc);

/*
 * MPI_Init, then parse argv into `opt` with the defaults of `kind`.
 * On -h prints usage and exits 0; on a bad option prints why and exits 1
 * (every rank parses the same argv, so every rank takes the same branch).
 * Returns this rank; *nprocs receives the size of MPI_COMM_WORLD.
 */
int osu_init(int *argc, char ***argv, const char *name, enum osu_kind kind,
             struct osu_options *opt, int *nprocs);

/* MPI_Finalize and return EXIT_SUCCESS (for `return osu_finish();`). */
int osu_finish(void);

/* Exit (all ranks) unless the job has exactly / at least `n` ranks. */
void osu_require_exactly(int rank, int nprocs, int n);
void osu_require_at_least(int rank, int nprocs, int n);

/* Page-aligned, zero-touched buffer; aborts on failure. */
void *osu_alloc(size_t bytes, int fill);

/* Iterations / warm-up for a message of `size` bytes. */
int osu_iters(const struct osu_options *opt, size_t size);
int osu_skip(const struct osu_options *opt, size_t size);

/* Next size in the sweep: OSU doubles, and 0 is followed by 1. */
static inline size_t osu_next_size(size_t size) { return size ? size * 2 : 1; }

/* Rank 0 prints the banner lines ("# rankweave C baseline: ...", the
 * MPI library, ranks, iterations) - all comment lines. */
void osu_print_banner(int rank, const char *name, const char *title,
                      const struct osu_options *opt, int nprocs);

/* The same, with `definitions` in place of "OSU micro-benchmarks 7.x
 * definitions" (for the rw_* programs, which OSU does not have). */
void osu_print_banner_from(int rank, const char *name, const char *title,
                           const char *definitions,
                           const struct osu_options *opt, int nprocs);

/* Rank 0 prints the "Avg Latency(us)" header (with -f, the min / max /
 * iterations columns too); `sized` adds the "# Size" column. */
void osu_print_latency_header(int rank, const struct osu_options *opt,
                              int sized);

/* Reduces each rank's average `latency` (us) to rank 0, which prints one
 * row: the size (when `sized`) and the mean over ranks, with -f the min,
 * max and `iters` too - the collectives' and osu_barrier's row. */
void osu_print_latency_row(int rank, int nprocs, const struct osu_options *opt,
                           int sized, size_t size, int iters, double latency);

/* Library name and version: "MPICH 4.0.2" / "Open MPI 4.1.4". */
const char *osu_mpi_flavor(void);

/*
 * Sized collectives: everything except the call itself is shared.
 * `op` performs one collective of `size` bytes per rank (count = size
 * MPI_CHARs, as OMB 7.x's default datatype).  Buffers are allocated by
 * the driver: sbuf has `size * sbuf_mult` bytes, rbuf `size * rbuf_mult`,
 * where a multiplier of 0 means "times the number of ranks".
 */
typedef void (*osu_coll_fn)(void *sbuf, void *rbuf, int count, MPI_Comm comm);

int osu_run_collective(int argc, char **argv, const char *name,
                       const char *title, osu_coll_fn op, int sbuf_mult,
                       int rbuf_mult);

#endif /* RW_OSU_COMMON_H */
