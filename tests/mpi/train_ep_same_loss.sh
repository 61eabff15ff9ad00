#!/usr/bin/env bash
# `epx train --ep N` on MPI processes (EP groups of N, data-parallel to each
# other) gives, bit for bit, the loss curve of the in-process run with the
# same ranks, nodes and EP (the transport's groups keep every reduction
# order), and follows one in-process rank holding every expert within a
# relative 1e-6 on loss, main loss and gradient norm (the layouts sum the same
# numbers in other orders: docs/design.md, EP x EDP; measured below 2e-7).
# MPIEXEC "two-hosts": the MPI run is 2 emulated hosts x NP/2 ranks
# (two_hosts.sh, exit 77 where it cannot run), compared with NODES in-process
# nodes.
# Arguments after `--` go to every run (e.g. --balance bias+eplb).
# Usage: train_ep_same_loss.sh EPX MPIEXEC|two-hosts CONFIG NP NODES EP [EP...] [-- ARGS...]
set -uo pipefail
epx=$1 mpiexec=$2 config=$3 np=$4 nodes=$5
shift 5
eps=()
while [[ $# -gt 0 && $1 != -- ]]; do eps+=("$1"); shift; done
[[ $# -gt 0 ]] && shift
extra=("$@")
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
steps=12
tolerance=1e-6
args=(train --config "$config" --steps "$steps" -q "${extra[@]}")
fail() { echo "FAIL: $*"; exit 1; }

# loss, main_loss, lr, grad_norm of each step, comma-separated.
curve() { grep -o '"loss":[^,]*,"main_loss":[^,]*,"lr":[^,]*,"grad_norm":[^,]*' "$1" | sed -E 's/"[a-z_]+"://g'; }
# The largest relative difference of loss, main loss and gradient norm; exit 1 above the tolerance.
compare() {
  paste -d, <(curve "$1") <(curve "$2") | awk -F, -v tol="$tolerance" -v n="$steps" '
    function rel(a, b) { d = a - b; if (d < 0) d = -d; if (a < 0) a = -a; return a > 0 ? d / a : d }
    { for (i = 1; i <= 4; i++) if (i != 3) { r = rel($i, $(i + 4)); if (r > worst) worst = r }; rows++ }
    END { printf "%.3g\n", worst; exit (rows == n && worst <= tol) ? 0 : 1 }'
}
run_mpi() {  # EP OUT
  if [[ $mpiexec == two-hosts ]]; then
    "$here/two_hosts.sh" --np-per-host $((np / 2)) -- "$epx" "${args[@]}" --ranks "$np" --ep "$1" --backend mpi \
      --metrics "$2" > "$work/hosts.out" 2>&1
    local rc=$?
    [[ $rc == 77 ]] && { cat "$work/hosts.out"; exit 77; }
    [[ $rc == 0 ]] || { cat "$work/hosts.out"; fail "two_hosts.sh exited $rc for --ep $1"; }
  else
    timeout 300 "$mpiexec" --oversubscribe --bind-to none -n "$np" "$epx" "${args[@]}" --ranks "$np" --nodes "$nodes" \
      --ep "$1" --backend mpi --metrics "$2" > /dev/null || fail "the MPI run with --ep $1 failed"
  fi
}

"$epx" "${args[@]}" --ranks 1 --nodes 1 --backend inproc --metrics "$work/one.jsonl" > /dev/null ||
  fail "the 1-rank run failed"
for ep in "${eps[@]}"; do
  run_mpi "$ep" "$work/mpi-$ep.jsonl"
  "$epx" "${args[@]}" --ranks "$np" --nodes "$nodes" --ep "$ep" --backend inproc --metrics "$work/inproc-$ep.jsonl" \
    > /dev/null || fail "the in-process run with --ep $ep failed"
  # Whole metrics lines minus the timings, shortest round-trip numbers: equal text = equal bits.
  "$here/../app/metrics_values.sh" "$work/mpi-$ep.jsonl" > "$work/mpi.values" || fail "no metrics from MPI, --ep $ep"
  "$here/../app/metrics_values.sh" "$work/inproc-$ep.jsonl" > "$work/inproc.values" || fail "no in-process metrics"
  [[ $(wc -l < "$work/mpi.values") == "$steps" ]] || fail "the MPI run with --ep $ep reported no $steps steps"
  diff "$work/mpi.values" "$work/inproc.values" > "$work/diff" ||
    { head -4 "$work/diff"; fail "--ep $ep: the MPI run's metrics differ from the in-process run's"; }
  worst=$(compare "$work/one.jsonl" "$work/mpi-$ep.jsonl") ||
    fail "--ep $ep: $np ranks differ from 1 rank by $worst (relative), above $tolerance"
  echo "--ep $ep: $np MPI ranks == $np in-process ranks bit for bit; largest relative difference from 1 rank $worst"
done
where="$nodes node(s)"
[[ $mpiexec == two-hosts ]] && where="2 emulated hosts"
echo "same loss curve with EP ${eps[*]} on $np MPI processes ($where) and 1 rank${extra[*]:+ (${extra[*]})}"
