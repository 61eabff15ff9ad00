#!/usr/bin/env bash
# The overlap benchmark as recorded in docs/performance.md: epx_moe_overlap_bench
# on two emulated hosts (tests/mpi/two_hosts.sh: network namespaces joined by a
# veth pair capped at RATE with tc tbf), RANKS_PER_HOST ranks each, ROUNDS
# rounds; each round prints the table of every overlap mode next to the parts
# measured alone (the plain layer's compute and exchange).
# Each emulated host runs on its own CPUs (two_hosts.sh --cpus CPUS; default
# 0/1: host a on CPU 0, host b on CPU 1; CPUS= runs them unpinned).
# Usage: bench/overlap_bench.sh [BUILD_DIR]
#   (ROUNDS=3 RATE=1gbit CPUS=0/1 RANKS_PER_HOST=1 TOKENS=256 HIDDEN=1024 FFN=256 EXPERTS=16 TOPK=4 CHUNKS=4 REPS=7)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${1:-$root/build}
bench=$build/bin/epx_moe_overlap_bench
[[ -x $bench ]] || { echo "no $bench: build with EPX_WITH_MPI=ON first" >&2; exit 1; }
rounds=${ROUNDS:-3} rate=${RATE:-1gbit} per_host=${RANKS_PER_HOST:-1} cpus=${CPUS-0/1}
args=(--tokens "${TOKENS:-256}" --hidden "${HIDDEN:-1024}" --ffn-hidden "${FFN:-256}" --experts "${EXPERTS:-16}"
      --topk "${TOPK:-4}" --chunks "${CHUNKS:-4}" --reps "${REPS:-7}" --json)
echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
for round in $(seq "$rounds"); do
  echo "## round $round: 2 emulated hosts x $per_host rank(s), $rate, CPUs ${cpus:-unpinned}"
  "$root/tests/mpi/two_hosts.sh" --np-per-host "$per_host" --rate "$rate" ${cpus:+--cpus "$cpus"} --timeout 900 -- \
    "$bench" "${args[@]}"
done
