#!/usr/bin/env bash
# `epx train` on two emulated hosts (two_hosts.sh, 2 x 2 ranks: epx finds 2
# nodes of 2 ranks itself) gives, bit for bit, the loss curve of 4 in-process
# ranks as 2 emulated nodes. Usage: two_hosts_train.sh EPX CONFIG
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
epx=$1 config=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$here/two_hosts.sh" -- "$epx" train --config "$config" --ranks 4 --steps 30 --backend mpi -q \
  --metrics "$work/hosts.jsonl" > "$work/out.txt" 2>&1
rc=$?
cat "$work/out.txt"
[[ $rc == 77 ]] && exit 77
[[ $rc == 0 ]] || { echo "FAIL: two_hosts.sh exited $rc"; exit 1; }
"$epx" train --config "$config" --ranks 4 --nodes 2 --steps 30 --backend inproc -q --metrics "$work/inproc.jsonl" \
  > /dev/null || { echo "FAIL: the in-process run failed"; exit 1; }
# Whole metrics lines minus the timings, shortest round-trip numbers: equal text = equal bits.
values() { "$here/../app/metrics_values.sh" "$1"; }
values "$work/hosts.jsonl" > "$work/hosts.values" || { echo "FAIL: no metrics from the two-host run"; exit 1; }
values "$work/inproc.jsonl" > "$work/inproc.values" || { echo "FAIL: no metrics from the in-process run"; exit 1; }
[[ $(wc -l < "$work/hosts.values") == 30 ]] || { echo "FAIL: the two-host run reported no 30 steps"; exit 1; }
diff "$work/hosts.values" "$work/inproc.values" > "$work/diff" ||
  { echo "FAIL: the metrics differ:"; head "$work/diff"; exit 1; }
echo "same loss curve on 2 hosts x 2 MPI ranks as on 4 in-process ranks in 2 emulated nodes (30 steps)"
