#!/usr/bin/env bash
# The MPI backend's benchmark as recorded in docs/performance.md:
#  1. one machine: epx_mpi_exchange_bench with 4 and 8 processes, alternating,
#     ROUNDS rounds (each prints per-method medians; the in-process backend
#     runs the same shape in the same run);
#  2. two emulated hosts (tests/mpi/two_hosts.sh, 2 x 2 ranks, tc tbf RATE on
#     both veth ends): two-hop vs flat dispatch/combine, inter-node bytes and time.
# Usage: bench/mpi_bench.sh [BUILD_DIR] (ROUNDS=3 TOKENS=1024 HIDDEN=7168 RATE=1gbit)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${1:-$root/build}
bench=$build/bin/epx_mpi_exchange_bench
rounds=${ROUNDS:-3} tokens=${TOKENS:-1024} hidden=${HIDDEN:-7168} rate=${RATE:-1gbit}
[[ -x $bench ]] || { echo "no $bench: build with EPX_WITH_MPI=ON first" >&2; exit 1; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
for round in $(seq "$rounds"); do
  for np in 4 8; do
    echo "## round $round, $np processes, one machine"
    timeout 1200 mpirun --oversubscribe --bind-to none -n "$np" "$bench" --tokens "$tokens" --hidden "$hidden" \
      --reps 5 --json
  done
done
for round in $(seq "$rounds"); do
  echo "## round $round, 2 emulated hosts x 2 ranks, $rate"
  "$root/tests/mpi/two_hosts.sh" --rate "$rate" --timeout 900 -- "$bench" --epx-only --tokens 256 --hidden "$hidden" \
    --reps 5 --json
done
