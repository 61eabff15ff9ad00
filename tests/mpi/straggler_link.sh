#!/usr/bin/env bash
# A real slow link: `epx train` on three emulated hosts (two_hosts.sh --hosts 3,
# 3 x 2 MPI ranks; ranks 0, 1 on host a, 2, 3 on host b, 4, 5 on host c) with
# only host b's link capped by tc (tbf RATE, both directions, as a slow NIC
# is), and the wait matrices recorded every step. epx train must exit 0 and its
# summary must name a rank of host b with cause link, and no rank of a or c.
# Three hosts: with two, the one link is both ends' (docs/operations.md,
# Finding a straggler). Exits 77 (skip) where two_hosts.sh cannot make the
# hosts (no root, no namespaces, no tc).
# Usage: straggler_link.sh EPX CONFIG [RATE] [STEPS]
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
epx=$1 config=$2 rate=${3:-100mbit} steps=${4:-60}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$here/two_hosts.sh" --hosts 3 --rate "$rate" --rate-host b --timeout 100 -- "$epx" train --config "$config" \
  --ranks 6 --experts 12 --steps "$steps" --backend mpi --wait-matrix-every 1 -q > "$work/out.txt" 2>&1
rc=$?
cat "$work/out.txt"
[[ $rc == 77 ]] && exit 77
[[ $rc == 0 ]] || { echo "FAIL: two_hosts.sh exited $rc"; exit 1; }
grep -qE "^straggler: rank [23] \(link\): " "$work/out.txt" ||
  { echo "FAIL: the summary names no rank of host b (2, 3) with cause link"; exit 1; }
if grep -qE "^straggler: rank [0145] " "$work/out.txt"; then
  echo "FAIL: the summary names a rank of host a or c (not capped)"; exit 1
fi
echo "host b's capped link ($rate) was found: $(grep -E '^straggler: rank [23] \(link\)' "$work/out.txt" | head -1 | cut -c1-40)"
