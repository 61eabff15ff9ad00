#!/usr/bin/env bash
# `epx train` on MPI processes gives the same loss curve, bit for bit, as the
# in-process run with the same ranks and nodes (the transport contract fixes
# every reduction order). Arguments after NODES go to the MPI run only: with
# `--overlap chunked` it must still equal the plain in-process run.
# Usage: train_same_loss.sh EPX MPIEXEC CONFIG [NP] [NODES] [MPI-RUN ARGS...]
set -euo pipefail
epx=$1 mpiexec=$2 config=$3 np=${4:-4} nodes=${5:-1}
shift $(( $# < 5 ? $# : 5 ))
mpi_extra=("$@")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
args=(train --config "$config" --ranks "$np" --nodes "$nodes" --steps 40 -q)

timeout 300 "$mpiexec" --oversubscribe --bind-to none -n "$np" "$epx" "${args[@]}" --backend mpi "${mpi_extra[@]}" \
  --metrics "$work/mpi.jsonl" > "$work/mpi.out"
timeout 300 "$epx" "${args[@]}" --backend inproc --metrics "$work/inproc.jsonl" > "$work/inproc.out"

# Whole metrics lines minus the timings: losses, gradient norm, loads, each in
# its shortest round-trip form (equal text = equal bits).
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
values() { "$here/../app/metrics_values.sh" "$1"; }
values "$work/mpi.jsonl" > "$work/mpi.values"
values "$work/inproc.jsonl" > "$work/inproc.values"
n_mpi=$(wc -l < "$work/mpi.values")
n_in=$(wc -l < "$work/inproc.values")
if [[ $n_mpi -ne 40 || $n_in -ne 40 ]]; then
  echo "FAIL: expected 40 steps from both runs, got $n_mpi (MPI) and $n_in (in-process)"
  exit 1
fi
if ! diff "$work/mpi.values" "$work/inproc.values" > "$work/diff"; then
  echo "FAIL: the MPI run's metrics differ from the in-process run's:"
  head -20 "$work/diff"
  exit 1
fi
echo "same loss curve: $np MPI processes ($nodes node(s)${mpi_extra[*]:+, ${mpi_extra[*]}}) and $np in-process ranks agree on all 40 steps"
grep -o '"step":[0-9]*,"loss":[^,]*' "$work/mpi.jsonl" | sed -n '1p;$p'
