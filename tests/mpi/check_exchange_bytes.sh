#!/usr/bin/env bash
# epx's dispatch on two emulated hosts (two_hosts.sh, 2 hosts x 2 ranks):
#  - the payload that crossed nodes, by epx's own counters, equals the
#    (token, destination node) pairs that leave their node times the row size;
#  - the veth saw at least every message byte epx counted as crossing nodes,
#    and at most 10% more plus 3 MB (MPI/UCX headers and wire-up, the
#    collectives' slots, the benchmark's own barriers).
# Usage: check_exchange_bytes.sh BENCH [two_hosts.sh options...]
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bench=$1; shift
out=$(mktemp); trap 'rm -f "$out"' EXIT
"$here/two_hosts.sh" "$@" -- "$bench" --epx-only --nodes 1 --tokens 256 --hidden 7168 --reps 3 2>&1 | tee "$out"
rc=${PIPESTATUS[0]}
[[ $rc == 77 ]] && exit 77
[[ $rc == 0 ]] || { echo "FAIL: two_hosts.sh exited $rc"; exit 1; }
field() { sed -n "s/^$1 .*\\b$2=\\([0-9]*\\).*/\\1/p" "$out" | tail -1; }
pairs=$(field inter_node_dispatch pairs) row=$(field inter_node_dispatch row_bytes)
payload=$(field inter_node_dispatch payload_bytes) expected=$(field inter_node_dispatch expected_payload_bytes)
counted=$(field inter_node_dispatch run_inter_node_message_bytes)
ab=$(field veth_bytes a_to_b) ba=$(field veth_bytes b_to_a)
for v in pairs row payload expected counted ab ba; do
  [[ -n "${!v}" ]] || { echo "FAIL: no $v in the output"; exit 1; }
done
veth=$((ab + ba))
echo "pairs leaving their node: $pairs x $row bytes per dispatch; payload counted $payload, expected $expected"
echo "epx message bytes across nodes $counted; veth bytes $veth (ratio $(awk -v v=$veth -v c=$counted 'BEGIN{printf "%.4f", v/c}'))"
[[ $payload == "$expected" ]] || { echo "FAIL: inter-node payload $payload != pairs x row x dispatches $expected"; exit 1; }
(( veth >= counted )) || { echo "FAIL: the veth carried $veth bytes, less than the $counted epx counted"; exit 1; }
limit=$(awk -v c=$counted 'BEGIN{printf "%d", c * 1.10 + 3000000}')
(( veth <= limit )) || { echo "FAIL: the veth carried $veth bytes, more than $limit (1.1 x $counted + 3 MB)"; exit 1; }
echo "OK: the bytes that crossed the veth are the (token, destination node) pairs times the row size, plus overhead"
