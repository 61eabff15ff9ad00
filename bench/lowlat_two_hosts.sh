#!/usr/bin/env bash
# The low-latency mode against the normal mode across two emulated hosts
# (docs/performance.md, "Low-latency mode"): epx_mpi_exchange_bench --lowlat on
# tests/mpi/two_hosts.sh --cpus 0/1 (each host on its own core), 1 and 2 ranks
# per host, the link uncapped and capped at 300 Mbit/s, ROUNDS rounds. In each
# (ranks per host, link) cell the variants run one after another: BEFORE's
# build (if given), this build, this build with --lowlat-combine-per-rank.
# Each run prints the medians of REPS rounds of (normal dispatch, normal
# combine, low-latency dispatch, low-latency combine), interleaved, and their
# CPU times. Then a table of the medians over the rounds of normal time /
# low-latency time (above 1: low latency faster), by lowlat_two_hosts.py.
# Usage: bench/lowlat_two_hosts.sh [BUILD_DIR] [OUT_DIR]
#   (BEFORE=/path/to/old/build ROUNDS=3 REPS=9 SUBNET=10.231.92)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${1:-$root/build}
out=${2:-$(mktemp -d /tmp/lowlat_two_hosts.XXXXXX)}
rounds=${ROUNDS:-3} reps=${REPS:-9} subnet=${SUBNET:-10.231.92}
bench=$build/bin/epx_mpi_exchange_bench
[[ -x $bench ]] || { echo "no $bench: build with EPX_WITH_MPI=ON first" >&2; exit 1; }
variants=(after perrank)
[[ -n ${BEFORE:-} ]] && variants=(before after perrank)
mkdir -p "$out"
echo "# $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg); runs in $out"
for round in $(seq "$rounds"); do
  for np in 1 2; do
    for rate in uncapped 300mbit; do
      for v in "${variants[@]}"; do
        bin=$bench args=()
        [[ $v == before ]] && bin=$BEFORE/bin/epx_mpi_exchange_bench
        [[ $v == perrank ]] && args=(--lowlat-combine-per-rank)
        echo "$(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg) round $round, $np per host, $rate, $v" | tee -a "$out/log"
        rate_args=()
        [[ $rate != uncapped ]] && rate_args=(--rate "$rate")
        "$root/tests/mpi/two_hosts.sh" --subnet "$subnet" --cpus 0/1 --np-per-host "$np" "${rate_args[@]}" -- \
          "$bin" --lowlat --reps "$reps" "${args[@]}" > "$out/r${round}_np${np}_${rate}_$v.txt" 2>&1
      done
    done
  done
done
echo "# end $(date -u +%T), load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/log"
python3 "$root/bench/lowlat_two_hosts.py" "$out"
