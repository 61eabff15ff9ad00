#!/usr/bin/env bash
# Prints each line of an `epx train --metrics` file without its timing fields
# ("seconds", "tokens_per_s", the per-rank "ranks" times, the "wait_matrix"), the
# layout's "num_nodes" and a resumed run's "resumed_from": what is left (step,
# losses, learning rate, gradient norm, per-layer loads, eplb) is fixed by the
# inputs, and every number is printed in its shortest round-trip form, so two
# runs that agree bit for bit print the same text and a 1-ulp difference shows.
# Usage: metrics_values.sh METRICS.jsonl   (exit 1 if the file is missing or empty)
set -euo pipefail
file=$1
[[ -s "$file" ]] || { echo "metrics_values.sh: '$file' is missing or empty" >&2; exit 1; }
sed -E -e 's/"seconds":[^,]*,"tokens_per_s":[^,]*,//' -e 's/"num_nodes":[0-9]+,//' -e 's/"resumed_from":[0-9]+,//' -e 's/,"ranks":\[[^]]*\]//' \
  -e 's/,"wait_matrix":\{[^}]*\}//' "$file"
