/*
 * osu_common.c - option parsing, banners, buffers and the shared collective
 * driver of rankweave's C MPI baselines.  See osu_common.h for the OSU 7.x
 * definitions these follow.
 */
#define _POSIX_C_SOURCE 200809L

#include "osu_common.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void osu_mpi_fail(const char *call, const char *file, int line, int rc)
{
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;

    if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) {
        snprintf(msg, sizeof msg, "error %d", rc);
    }
    fprintf(stderr, "%s:%d: %s failed: %s\n", file, line, call, msg);
    fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, EXIT_FAILURE);
    exit(EXIT_FAILURE); /* not reached */
}

const char *osu_mpi_flavor(void)
{
    static char flavor[64];

#if defined(MPICH_VERSION)
    snprintf(flavor, sizeof flavor, "MPICH %s", MPICH_VERSION);
#elif defined(OPEN_MPI)
    snprintf(flavor, sizeof flavor, "Open MPI %d.%d.%d", OMPI_MAJOR_VERSION,
             OMPI_MINOR_VERSION, OMPI_RELEASE_VERSION);
#else
    snprintf(flavor, sizeof flavor, "MPI %d.%d", MPI_VERSION, MPI_SUBVERSION);
#endif
    return flavor;
}

/* ---- options ----------------------------------------------------------- */

static void set_defaults(struct osu_options *opt, enum osu_kind kind)
{
    memset(opt, 0, sizeof *opt);
    opt->kind = kind;
    opt->min_size = 1;
    opt->window = 64;

    switch (kind) {
    case OSU_LATENCY:
        opt->max_size = OSU_MAX_MSG_PT2PT;
        opt->iterations = 10000;
        opt->skip = 100;
        opt->iterations_large = 1000;
        opt->skip_large = 10;
        break;
    case OSU_BW:
        opt->max_size = OSU_MAX_MSG_PT2PT;
        opt->iterations = 100;
        opt->skip = 10;
        opt->iterations_large = 20;
        opt->skip_large = 2;
        break;
    case OSU_MR:
        /* osu_mbw_mr takes the bandwidth defaults but never switches to
         * the large-message counts. */
        opt->max_size = OSU_MAX_MSG_PT2PT;
        opt->iterations = opt->iterations_large = 100;
        opt->skip = opt->skip_large = 10;
        break;
    case OSU_COLL:
    case OSU_BARRIER:
        opt->max_size = OSU_MAX_MSG_COLL;
        opt->iterations = 1000;
        opt->skip = 100;
        opt->iterations_large = 100;
        opt->skip_large = 10;
        break;
    }
}

static void usage(FILE *out, const char *name, enum osu_kind kind)
{
    struct osu_options d;

    set_defaults(&d, kind);
    fprintf(out, "Usage: %s [options]\n", name);
    fprintf(out, "rankweave C baseline (%s), OSU micro-benchmarks 7.x "
                 "definitions.\nOptions:\n",
            osu_mpi_flavor());
    if (kind != OSU_BARRIER) {
        fprintf(out,
                "  -m MIN:MAX   message sizes, doubling from MIN to MAX bytes "
                "(default %zu:%zu;\n"
                "               also MAX, :MAX or MIN:)\n",
                d.min_size, d.max_size);
    }
    fprintf(out, "  -i ITERS     timed iterations, all sizes (default %d",
            d.iterations);
    if (kind != OSU_BARRIER && d.iterations_large != d.iterations) {
        fprintf(out, ", %d above %d bytes", d.iterations_large,
                OSU_LARGE_MESSAGE_SIZE);
    }
    fprintf(out, ")\n  -x WARMUP    untimed warm-up iterations, all sizes "
                 "(default %d",
            d.skip);
    if (kind != OSU_BARRIER && d.skip_large != d.skip) {
        fprintf(out, ", %d above %d bytes", d.skip_large,
                OSU_LARGE_MESSAGE_SIZE);
    }
    fprintf(out, ")\n");
    if (kind == OSU_BW || kind == OSU_MR) {
        fprintf(out, "  -W WINDOW    messages in flight per iteration "
                     "(default %d)\n",
                d.window);
    }
    if (kind == OSU_COLL || kind == OSU_BARRIER) {
        fprintf(out, "  -f           also print min/max latency over ranks "
                     "and iterations\n");
    }
    fprintf(out, "  -h           this help\n");
}

/* Parse a decimal integer in [lo, hi]; returns 0 on success. */
static int parse_ull(const char *s, unsigned long long lo,
                     unsigned long long hi, unsigned long long *out)
{
    char *end = NULL;
    unsigned long long v;

    if (s == NULL || *s == '\0' || *s == '-' || *s == '+') {
        return -1;
    }
    errno = 0;
    v = strtoull(s, &end, 10);
    if (errno != 0 || end == s || *end != '\0' || v < lo || v > hi) {
        return -1;
    }
    *out = v;
    return 0;
}

static int parse_int(const char *s, int lo, int *out)
{
    unsigned long long v;

    if (parse_ull(s, (unsigned long long)lo, INT_MAX, &v)) {
        return -1;
    }
    *out = (int)v;
    return 0;
}

/* "-m" argument: MAX, MIN:MAX, :MAX or MIN: (as OMB). */
static int parse_sizes(const char *arg, struct osu_options *opt)
{
    /* Bounded so that count arguments fit an int even for alltoall. */
    const unsigned long long cap = (unsigned long long)1 << 30;
    const char *colon = strchr(arg, ':');
    unsigned long long lo = opt->min_size, hi = opt->max_size;
    char buf[64];

    if (colon == NULL) {
        if (parse_ull(arg, 0, cap, &hi)) {
            return -1;
        }
    } else {
        size_t n = (size_t)(colon - arg);

        if (n >= sizeof buf || strchr(colon + 1, ':') != NULL) {
            return -1;
        }
        memcpy(buf, arg, n);
        buf[n] = '\0';
        if (n > 0 && parse_ull(buf, 0, cap, &lo)) {
            return -1;
        }
        if (colon[1] != '\0' && parse_ull(colon + 1, 0, cap, &hi)) {
            return -1;
        }
        if (n == 0 && colon[1] == '\0') {
            return -1;
        }
    }
    if (lo > hi) {
        return -1;
    }
    opt->min_size = (size_t)lo;
    opt->max_size = (size_t)hi;
    return 0;
}

static void bad_usage(int rank, const char *name, enum osu_kind kind,
                      const char *what, int opt, const char *arg)
{
    if (rank == 0) {
        if (arg != NULL) {
            fprintf(stderr, "%s: %s [-%c %s]\n\n", name, what, opt, arg);
        } else {
            fprintf(stderr, "%s: %s [-%c]\n\n", name, what, opt);
        }
        usage(stderr, name, kind);
        fflush(stderr);
    }
    MPI_Finalize();
    exit(EXIT_FAILURE);
}

int osu_init(int *argc, char ***argv, const char *name, enum osu_kind kind,
             struct osu_options *opt, int *nprocs)
{
    const char *optstring;
    int rank = 0;
    int c;

    MPI_CHECK(MPI_Init(argc, argv));
    MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
    MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, nprocs));

    set_defaults(opt, kind);
    switch (kind) {
    case OSU_BW:
    case OSU_MR:
        optstring = ":hm:i:x:W:";
        break;
    case OSU_COLL:
        optstring = ":hm:i:x:f";
        break;
    case OSU_BARRIER:
        optstring = ":hi:x:f";
        break;
    default:
        optstring = ":hm:i:x:";
        break;
    }

    opterr = 0;
    while ((c = getopt(*argc, *argv, optstring)) != -1) {
        switch (c) {
        case 'h':
            if (rank == 0) {
                usage(stdout, name, kind);
                fflush(stdout);
            }
            MPI_Finalize();
            exit(EXIT_SUCCESS);
        case 'm':
            if (parse_sizes(optarg, opt)) {
                bad_usage(rank, name, kind, "Invalid Message Size", c, optarg);
            }
            break;
        case 'i':
            if (parse_int(optarg, 1, &opt->iterations)) {
                bad_usage(rank, name, kind, "Invalid Number of Iterations", c,
                          optarg);
            }
            opt->iterations_large = opt->iterations;
            break;
        case 'x':
            if (parse_int(optarg, 0, &opt->skip)) {
                bad_usage(rank, name, kind,
                          "Invalid Number of Warmup Iterations", c, optarg);
            }
            opt->skip_large = opt->skip;
            break;
        case 'W':
            if (parse_int(optarg, 1, &opt->window) ||
                opt->window > OSU_MAX_WINDOW) {
                bad_usage(rank, name, kind, "Invalid Window Size", c, optarg);
            }
            break;
        case 'f':
            opt->full = 1;
            break;
        case ':':
            bad_usage(rank, name, kind, "Missing argument", optopt, NULL);
            break;
        default:
            bad_usage(rank, name, kind, "Invalid option", optopt, NULL);
            break;
        }
    }
    if (optind < *argc) {
        bad_usage(rank, name, kind, "Unexpected argument", '-',
                  (*argv)[optind]);
    }
    /* Only the ping-pong has a meaningful 0-byte message. */
    if (kind != OSU_LATENCY && opt->min_size == 0) {
        bad_usage(rank, name, kind, "Minimum message size must be at least 1",
                  'm', "0");
    }
    return rank;
}

int osu_finish(void)
{
    MPI_CHECK(MPI_Finalize());
    return EXIT_SUCCESS;
}

static void require(int rank, int ok, const char *what)
{
    if (!ok) {
        if (rank == 0) {
            fprintf(stderr, "This test requires %s\n", what);
            fflush(stderr);
        }
        MPI_Finalize();
        exit(EXIT_FAILURE);
    }
}

void osu_require_exactly(int rank, int nprocs, int n)
{
    char what[64];

    snprintf(what, sizeof what, "exactly %d processes", n);
    require(rank, nprocs == n, what);
}

void osu_require_at_least(int rank, int nprocs, int n)
{
    char what[64];

    snprintf(what, sizeof what, "at least %d processes", n);
    require(rank, nprocs >= n, what);
}

void *osu_alloc(size_t bytes, int fill)
{
    long page = sysconf(_SC_PAGESIZE);
    void *p = NULL;

    if (page <= 0) {
        page = 4096;
    }
    if (bytes == 0) {
        bytes = 1;
    }
    if (posix_memalign(&p, (size_t)page, bytes) != 0) {
        fprintf(stderr, "cannot allocate %zu bytes\n", bytes);
        MPI_Abort(MPI_COMM_WORLD, EXIT_FAILURE);
        exit(EXIT_FAILURE);
    }
    memset(p, fill, bytes); /* touch every page before timing */
    return p;
}

int osu_iters(const struct osu_options *opt, size_t size)
{
    return size > OSU_LARGE_MESSAGE_SIZE ? opt->iterations_large
                                         : opt->iterations;
}

int osu_skip(const struct osu_options *opt, size_t size)
{
    return size > OSU_LARGE_MESSAGE_SIZE ? opt->skip_large : opt->skip;
}

void osu_print_banner(int rank, const char *name, const char *title,
                      const struct osu_options *opt, int nprocs)
{
    osu_print_banner_from(rank, name, title,
                          "OSU micro-benchmarks 7.x definitions", opt, nprocs);
}

void osu_print_banner_from(int rank, const char *name, const char *title,
                           const char *definitions,
                           const struct osu_options *opt, int nprocs)
{
    if (rank != 0) {
        return;
    }
    printf("# rankweave C baseline: %s (%s)\n", name, osu_mpi_flavor());
    printf("# %s, %s\n", title, definitions);
    printf("# ranks: %d  iterations: %d", nprocs, opt->iterations);
    /* A barrier has no message size, so no large counts. */
    if (opt->kind != OSU_BARRIER &&
        opt->iterations_large != opt->iterations) {
        printf(" (%d above %d B)", opt->iterations_large,
               OSU_LARGE_MESSAGE_SIZE);
    }
    printf("  warm-up: %d", opt->skip);
    if (opt->kind != OSU_BARRIER && opt->skip_large != opt->skip) {
        printf(" (%d above %d B)", opt->skip_large, OSU_LARGE_MESSAGE_SIZE);
    }
    if (opt->kind == OSU_BW || opt->kind == OSU_MR) {
        printf("  window: %d", opt->window);
    }
    printf("\n");
    fflush(stdout);
}

void osu_print_latency_header(int rank, const struct osu_options *opt,
                              int sized)
{
    if (rank != 0) {
        return;
    }
    if (sized) {
        printf("%-*s%*s", 10, "# Size", OSU_FIELD_WIDTH, "Avg Latency(us)");
    } else {
        printf("# Avg Latency(us)");
    }
    if (opt->full) {
        printf("%*s%*s%*s", OSU_FIELD_WIDTH, "Min Latency(us)", OSU_FIELD_WIDTH,
               "Max Latency(us)", 12, "Iterations");
    }
    printf("\n");
    fflush(stdout);
}

void osu_print_latency_row(int rank, int nprocs, const struct osu_options *opt,
                           int sized, size_t size, int iters, double latency)
{
    double min_lat = 0.0, max_lat = 0.0, sum_lat = 0.0;

    MPI_CHECK(MPI_Reduce(&latency, &min_lat, 1, MPI_DOUBLE, MPI_MIN, 0,
                         MPI_COMM_WORLD));
    MPI_CHECK(MPI_Reduce(&latency, &max_lat, 1, MPI_DOUBLE, MPI_MAX, 0,
                         MPI_COMM_WORLD));
    MPI_CHECK(MPI_Reduce(&latency, &sum_lat, 1, MPI_DOUBLE, MPI_SUM, 0,
                         MPI_COMM_WORLD));
    if (rank != 0) {
        return;
    }
    if (sized) {
        printf("%-*zu%*.*f", 10, size, OSU_FIELD_WIDTH, OSU_FLOAT_PRECISION,
               sum_lat / nprocs);
    } else {
        /* No size column: OSU prints the value right-aligned in 17. */
        printf("%*.*f", 17, OSU_FLOAT_PRECISION, sum_lat / nprocs);
    }
    if (opt->full) {
        printf("%*.*f%*.*f%*d", OSU_FIELD_WIDTH, OSU_FLOAT_PRECISION, min_lat,
               OSU_FIELD_WIDTH, OSU_FLOAT_PRECISION, max_lat, 12, iters);
    }
    printf("\n");
    fflush(stdout);
}

/* ---- collectives --------------------------------------------------------- */

/*
 * OMB 7.x collective loop: for each size, MPI_Barrier; then per iteration
 * time only the collective on every rank, followed by an untimed
 * MPI_Barrier.  Each rank averages over the timed iterations; rank 0 prints
 * the mean of those per-rank averages (and with -f their min and max).
 */
int osu_run_collective(int argc, char **argv, const char *name,
                       const char *title, osu_coll_fn op, int sbuf_mult,
                       int rbuf_mult)
{
    struct osu_options opt;
    int nprocs = 0;
    int rank = osu_init(&argc, &argv, name, OSU_COLL, &opt, &nprocs);
    size_t smult, rmult;
    char *sbuf, *rbuf;

    osu_require_at_least(rank, nprocs, 2);
    smult = sbuf_mult > 0 ? (size_t)sbuf_mult : (size_t)nprocs;
    rmult = rbuf_mult > 0 ? (size_t)rbuf_mult : (size_t)nprocs;
    if (opt.max_size > (size_t)INT_MAX / (smult > rmult ? smult : rmult)) {
        if (rank == 0) {
            fprintf(stderr, "%s: maximum size too large for %d ranks\n", name,
                    nprocs);
        }
        MPI_Finalize();
        return EXIT_FAILURE;
    }
    sbuf = osu_alloc(opt.max_size * smult, 1);
    rbuf = osu_alloc(opt.max_size * rmult, 0);

    osu_print_banner(rank, name, title, &opt, nprocs);
    if (rank == 0) {
        printf("# Datatype: MPI_CHAR.\n");
    }
    osu_print_latency_header(rank, &opt, 1);

    for (size_t size = opt.min_size; size <= opt.max_size;
         size = osu_next_size(size)) {
        int iters = osu_iters(&opt, size);
        int skip = osu_skip(&opt, size);
        double timer = 0.0;

        MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
        for (int i = 0; i < iters + skip; i++) {
            double t_start = MPI_Wtime();
            op(sbuf, rbuf, (int)size, MPI_COMM_WORLD);
            double t_stop = MPI_Wtime();
            MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
            if (i >= skip) {
                timer += t_stop - t_start;
            }
        }
        osu_print_latency_row(rank, nprocs, &opt, 1, size, iters,
                              timer * 1e6 / iters);
    }

    free(sbuf);
    free(rbuf);
    return osu_finish();
}
