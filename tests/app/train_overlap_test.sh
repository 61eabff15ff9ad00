#!/usr/bin/env bash
# `epx train --overlap MODE` gives the loss curve of --overlap none bit for bit
# (in-process, two emulated nodes), with bias balancing and with EPLB
# re-placement (redundant experts; two-micro-batches refuses them and says so).
# Usage: train_overlap_test.sh EPX CONFIG
set -euo pipefail
epx=$1 config=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
run() {  # name, then arguments
  local name=$1
  shift
  "$epx" train --config "$config" --ranks 4 --nodes 2 --steps 25 -q --metrics "$work/$name.jsonl" "$@" > /dev/null
}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# Whole metrics lines minus the timings (losses, gradient norm, loads), each
# number in its shortest round-trip form: equal text = equal bits.
values() { "$here/metrics_values.sh" "$work/$1.jsonl"; }
same() {
  values "$1" > "$work/$1.values"
  values "$2" > "$work/$2.values"
  if ! diff "$work/$1.values" "$work/$2.values" > "$work/diff"; then
    echo "FAIL: $2 differs from $1:"
    head -6 "$work/diff"
    exit 1
  fi
  echo "same metrics: $2 == $1 ($(wc -l < "$work/$1.values") steps)"
}
run plain --overlap none
for mode in shared chunked two-micro-batches; do
  run "$mode" --overlap "$mode" --overlap-chunks 3
  same plain "$mode"
done
run eplb --balance eplb --eplb-every 8 --overlap none
run eplb-chunked --balance eplb --eplb-every 8 --overlap chunked --overlap-chunks 5
same eplb eplb-chunked
if "$epx" train --config "$config" --steps 2 -q --balance eplb --overlap two-micro-batches > "$work/out" 2>&1; then
  echo "FAIL: two-micro-batches with redundant experts was accepted"
  exit 1
fi
grep -q "redundant experts" "$work/out" || { echo "FAIL: unclear error:"; cat "$work/out"; exit 1; }
echo "two-micro-batches with eplb refused: $(head -1 "$work/out")"
