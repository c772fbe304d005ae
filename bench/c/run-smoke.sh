#!/usr/bin/env bash
# Smoke test of rankweave's C MPI baselines (a CI step).
#
# Builds everything (bench/c/build.sh), then runs every program once with
# MPICH and with Open MPI at tiny sizes and few iterations
# (-m 1:64 -i 10 -x 2; barrier and p2pbarrier take no -m): point-to-point
# with 2 ranks, collectives, ring, p2pbarrier and bcast_skew with 2 ranks and with 4
# ranks (oversubscribed on small machines).  A run passes when it exits 0 within the time limit and prints
# at least one data row.  Measured numbers are not checked.
#
#   bench/c/run-smoke.sh            # both MPIs
#   bench/c/run-smoke.sh openmpi    # only one of: mpich openmpi
#
# Environment:
#   SMOKE_TIMEOUT       seconds allowed per run (default 60)
#   OPENMPI_EXTRA_ARGS  extra mpirun.openmpi arguments (e.g. "--mca btl self,tcp")
#   MPICH_EXTRA_ARGS    extra mpiexec.mpich arguments
# Logs of every run: target/bench-c/smoke/<mpi>-<bench>-n<ranks>.log
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"

flavors=("$@")
if [[ ${#flavors[@]} -eq 0 ]]; then
    flavors=(mpich openmpi)
fi

"$here/build.sh" "${flavors[@]}" || exit 1

timeout_s="${SMOKE_TIMEOUT:-60}"
ncpu="$(nproc 2>/dev/null || echo 1)"
logdir="$root/target/bench-c/smoke"
mkdir -p "$logdir"

small=(-m 1:64 -i 10 -x 2)
pt2pt=(latency bw bibw mr)
collectives=(barrier bcast reduce allreduce allgather alltoall ring p2pbarrier bcast_skew)

# Open MPI refuses to run as root unless told twice.
if [[ "$(id -u)" -eq 0 ]]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

# Sets the global array `cmd` to the launcher words for <flavor> <nranks>.
set_launcher() {
    local flavor="$1" n="$2"
    local extra=()
    case "$flavor" in
    mpich)
        # shellcheck disable=SC2206  # word splitting intended
        extra=(${MPICH_EXTRA_ARGS:-})
        cmd=(mpiexec.mpich "${extra[@]}" -n "$n")
        ;;
    openmpi)
        # shellcheck disable=SC2206  # word splitting intended
        extra=(${OPENMPI_EXTRA_ARGS:-})
        cmd=(mpirun.openmpi)
        if [[ "$(id -u)" -eq 0 ]]; then cmd+=(--allow-run-as-root); fi
        if ((n > ncpu)); then cmd+=(--oversubscribe); fi
        cmd+=("${extra[@]}" -n "$n")
        ;;
    esac
}

# Seconds since the epoch with fractions, and differences, without bc.
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }

runs=0
failures=0
cmd=()
t_all=$(now)

run_one() { # flavor bench nranks
    local flavor="$1" bench="$2" n="$3"
    local bin="$root/target/bench-c/$flavor/$bench"
    local log="$logdir/$flavor-$bench-n$n.log"
    local args=("${small[@]}")
    local rc rows t0 t1 status

    if [[ "$bench" == barrier || "$bench" == p2pbarrier ]]; then
        args=(-i 10 -x 2)
    fi
    set_launcher "$flavor" "$n"
    cmd+=("$bin" "${args[@]}")

    t0=$(now)
    timeout --kill-after=5 "$timeout_s" "${cmd[@]}" >"$log" 2>&1 </dev/null
    rc=$?
    t1=$(now)

    # Data rows: "size value [value...]" or, for barrier, one value.
    rows=$(grep -cE '^[[:space:]]*[0-9]+(\.[0-9]+)?([[:space:]]+[0-9]+(\.[0-9]+)?)*[[:space:]]*$' "$log")
    runs=$((runs + 1))
    if [[ $rc -eq 0 && $rows -ge 1 ]]; then
        status=ok
    else
        status=FAIL
        failures=$((failures + 1))
    fi
    printf '%-4s  %-7s  %-10s  n=%d  rows=%-2d  rc=%-3d  %6ss\n' \
        "$status" "$flavor" "$bench" "$n" "$rows" "$rc" "$(elapsed "$t0" "$t1")"
    if [[ $status == FAIL ]]; then
        [[ $rc -eq 124 || $rc -eq 137 ]] && echo "      (timed out after ${timeout_s}s)"
        echo "      command: ${cmd[*]}"
        sed 's/^/      | /' "$log" | tail -n 40
    fi
}

for flavor in "${flavors[@]}"; do
    for bench in "${pt2pt[@]}"; do
        run_one "$flavor" "$bench" 2
    done
    for bench in "${collectives[@]}"; do
        run_one "$flavor" "$bench" 2
        run_one "$flavor" "$bench" 4
    done
done

t_end=$(now)
printf 'run-smoke.sh: %d runs, %d failed, %ss (logs in %s)\n' \
    "$runs" "$failures" "$(elapsed "$t_all" "$t_end")" "${logdir#"$root"/}"
[[ $failures -eq 0 ]]
