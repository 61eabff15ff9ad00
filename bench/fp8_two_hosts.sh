#!/usr/bin/env bash
# fp8 against bf16 dispatch across two emulated hosts (docs/performance.md,
# "fp8 dispatch"): epx_mpi_exchange_bench --epx-only --fp8 on
# tests/mpi/two_hosts.sh, 2 hosts x 2 ranks, the link capped by tc tbf at each
# RATE, ROUNDS rounds per rate (rates alternating). Each run times the bf16 and
# the fp8 dispatch of the same rows interleaved and prints "fp8 vs bf16
# dispatch: time T x, inter-node bytes B x".
# Usage: bench/fp8_two_hosts.sh [BUILD_DIR]
#   (RATES="300mbit 1gbit" ROUNDS=3 TOKENS=256 HIDDEN=7168 REPS=5 SUBNET=10.231.83)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${1:-$root/build}
bench=$build/bin/epx_mpi_exchange_bench
rates=${RATES:-300mbit 1gbit} rounds=${ROUNDS:-3} tokens=${TOKENS:-256} hidden=${HIDDEN:-7168} reps=${REPS:-5}
subnet=${SUBNET:-10.231.83}
[[ -x $bench ]] || { echo "no $bench: build with EPX_WITH_MPI=ON first" >&2; exit 1; }
echo "# $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
for round in $(seq "$rounds"); do
  for rate in $rates; do
    echo "## round $round, 2 emulated hosts x 2 ranks, $rate"
    "$root/tests/mpi/two_hosts.sh" --subnet "$subnet" --rate "$rate" --timeout 900 -- "$bench" --epx-only --fp8 \
      --tokens "$tokens" --hidden "$hidden" --reps "$reps"
    echo "# load $(cut -d' ' -f1-3 /proc/loadavg)"
  done
done
