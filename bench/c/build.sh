#!/usr/bin/env bash
# Build rankweave's C MPI baselines with MPICH and Open MPI.
#
#   bench/c/build.sh            # both MPIs
#   bench/c/build.sh mpich      # only one of: mpich openmpi
#
# Output (relative to the repository root, whatever the cwd):
#   target/bench-c/mpich/<program>    built with mpicc.mpich
#   target/bench-c/openmpi/<program>  built with mpicc.openmpi
# where <program> is osu_<name> for the OSU benchmarks and rw_<name> for the
# two OSU does not have, plus symlinks named like rw-bench's subcommands
# (latency -> osu_latency, mr -> osu_mbw_mr, ring -> rw_ring, ...; bcast_skew ->
# rw_bcast_skew, the C side of `rw-bench bcast --skew`).  A program is rebuilt only when a source is newer.
# Extra compiler flags: EXTRA_CFLAGS (e.g. EXTRA_CFLAGS=-Werror).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out_base="$root/target/bench-c"

cflags=(-std=c11 -O2 -Wall -Wextra)
if [[ -n "${EXTRA_CFLAGS:-}" ]]; then
    # shellcheck disable=SC2206  # word splitting intended
    cflags+=(${EXTRA_CFLAGS})
fi

# rw-bench subcommand -> program (OSU's name, or rw_* where OSU has none)
benches=(
    latency:osu_latency
    bw:osu_bw
    bibw:osu_bibw
    mr:osu_mbw_mr
    barrier:osu_barrier
    bcast:osu_bcast
    reduce:osu_reduce
    allreduce:osu_allreduce
    allgather:osu_allgather
    alltoall:osu_alltoall
    ring:rw_ring
    p2pbarrier:rw_p2pbarrier
    bcast_skew:rw_bcast_skew
    startup:mpi_startup
)

compiler_for() {
    case "$1" in
    mpich) echo mpicc.mpich ;;
    openmpi) echo mpicc.openmpi ;;
    *) return 1 ;;
    esac
}

packages_for() {
    case "$1" in
    mpich) echo "mpich libmpich-dev" ;;
    openmpi) echo "openmpi-bin libopenmpi-dev" ;;
    esac
}

flavors=("$@")
if [[ ${#flavors[@]} -eq 0 ]]; then
    flavors=(mpich openmpi)
fi

# Check every requested compiler before building anything.
missing=0
for flavor in "${flavors[@]}"; do
    if ! cc="$(compiler_for "$flavor")"; then
        echo "build.sh: unknown MPI '$flavor' (expected: mpich, openmpi)" >&2
        exit 2
    fi
    if ! command -v "$cc" >/dev/null 2>&1; then
        echo "build.sh: $cc not found; install it with: apt-get install $(packages_for "$flavor")" >&2
        missing=1
    fi
done
if [[ $missing -ne 0 ]]; then
    exit 1
fi

common_src=("$here/osu_common.c")
common_dep=("$here/osu_common.c" "$here/osu_common.h" "$here/build.sh")

for flavor in "${flavors[@]}"; do
    cc="$(compiler_for "$flavor")"
    out="$root/target/bench-c/$flavor"
    mkdir -p "$out"
    built=0
    for entry in "${benches[@]}"; do
        alias="${entry%%:*}"
        prog="${entry#*:}"
        src="$here/$prog.c"
        bin="$out/$prog"
        stale=0
        if [[ ! -x "$bin" ]]; then
            stale=1
        else
            for dep in "$src" "${common_dep[@]}"; do
                if [[ "$dep" -nt "$bin" ]]; then
                    stale=1
                    break
                fi
            done
        fi
        if [[ $stale -eq 1 ]]; then
            # Build to a temporary name so a failed build never leaves a
            # half-written program behind.
            "$cc" "${cflags[@]}" -o "$bin.tmp.$$" "$src" "${common_src[@]}" || {
                rm -f "$bin.tmp.$$"
                echo "build.sh: building $prog with $cc failed" >&2
                exit 1
            }
            mv -f "$bin.tmp.$$" "$bin"
            built=$((built + 1))
        fi
        ln -sfn "$prog" "$out/$alias"
    done
    echo "build.sh: $flavor: ${#benches[@]} programs in ${out#"$root"/} ($built rebuilt, $cc)"
done
echo "build.sh: done ($out_base)"
