#!/bin/bash
# check_two_hosts.sh: runs tests/mpi/probe_mpi on two emulated hosts
# (two_hosts.sh) and checks what the issue asks of the harness:
#   - 2 nodes x NP ranks, every check of the probe passes (exit 0);
#   - the bytes that crossed the veth in each direction are at least the
#     probe's payload and at most payload * MAX_RATIO + SLACK (headers, acks,
#     launch and wire-up);
#   - with --rate: the exchange took at least payload / rate (the cap works)
#     and at most MAX_SLOWDOWN times that.
#
#   check_two_hosts.sh PROBE [--bytes N] [--np-per-host NP] [--rate 1gbit]
#                      [--max-ratio 1.10] [--slack 1000000] [--max-slowdown 10]
# Exits 77 when two_hosts.sh skips (not root, no namespaces).
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
probe=$1; shift
bytes=16777216 np=2 rate='' max_ratio=1.10 slack=1000000 max_slowdown=10
while [ $# -gt 0 ]; do
  case $1 in
    --bytes) bytes=$2 ;;
    --np-per-host) np=$2 ;;
    --rate) rate=$2 ;;
    --max-ratio) max_ratio=$2 ;;
    --slack) slack=$2 ;;
    --max-slowdown) max_slowdown=$2 ;;
    *) echo "check_two_hosts.sh: unknown option $1" >&2; exit 2 ;;
  esac
  shift 2
done
out=$(mktemp); trap 'rm -f "$out"' EXIT
args=(--np-per-host "$np")
[ -n "$rate" ] && args+=(--rate "$rate")
"$here/two_hosts.sh" "${args[@]}" -- "$probe" --bytes "$bytes" --expect-nodes 2 --expect-local "$np" 2>&1 | tee "$out"
rc=${PIPESTATUS[0]}
[ "$rc" = 77 ] && exit 77
[ "$rc" = 0 ] || { echo "FAIL: two_hosts.sh exited $rc"; exit 1; }
field() { sed -n "s/^$1 .*\\b$2=\\([0-9.]*\\).*/\\1/p" "$out" | tail -1; }
grep -q '^probe_result OK' "$out" || { echo "FAIL: the probe did not report OK"; exit 1; }
grep -q '^probe_nodes nodes=2 ' "$out" || { echo "FAIL: the probe did not see 2 nodes"; exit 1; }
pab=$(field probe_bytes a_to_b) pba=$(field probe_bytes b_to_a)
vab=$(field veth_bytes a_to_b) vba=$(field veth_bytes b_to_a)
secs=$(field probe_time seconds)
[ -n "$pab" ] && [ -n "$vab" ] && [ -n "$secs" ] || { echo "FAIL: missing probe_bytes/veth_bytes/probe_time lines"; exit 1; }
awk -v pab="$pab" -v pba="$pba" -v vab="$vab" -v vba="$vba" -v r="$max_ratio" -v s="$slack" \
    -v secs="$secs" -v rate="$rate" -v slow="$max_slowdown" '
  function bps(x,   n, u) {  # tc rate -> bytes per second
    n = x + 0; u = tolower(x); sub(/^[0-9.]+/, "", u)
    if (u == "gbit") return n * 1e9 / 8; if (u == "mbit") return n * 1e6 / 8; if (u == "kbit") return n * 1e3 / 8
    if (u == "bit" || u == "") return n / 8; return -1 }
  BEGIN {
    bad = 0
    printf "check: a_to_b payload %d veth %d ratio %.4f; b_to_a payload %d veth %d ratio %.4f\n", pab, vab, vab / pab, pba, vba, vba / pba
    if (vab < pab || vba < pba) { print "FAIL: fewer bytes crossed the veth than the probe sent (shared memory bypass?)"; bad = 1 }
    if (vab > pab * r + s || vba > pba * r + s) { printf "FAIL: veth carried more than payload * %s + %s bytes\n", r, s; bad = 1 }
    if (rate != "") {
      cap = bps(rate); ideal = pab / cap
      printf "check: %d bytes at %s: ideal %.3fs, measured %.3fs (%.1f%% of the cap)\n", pab, rate, ideal, secs, 100 * ideal / secs
      if (cap <= 0) { print "FAIL: cannot read rate " rate; bad = 1 }
      else if (secs < ideal * 0.95) { print "FAIL: faster than the tbf cap allows: the cap is not in effect"; bad = 1 }
      else if (secs > ideal * slow) { printf "FAIL: more than %sx slower than the cap\n", slow; bad = 1 }
    }
    exit bad }'
