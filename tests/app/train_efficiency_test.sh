#!/usr/bin/env bash
# `epx train`'s summary ends with one efficiency line whose numbers are sane:
# a positive step time, positive measured rates, GEMMs + exchange = the
# limit, a share of the limit in (0, 1000]%; with -q too; and a run of one
# step says why it has none.
# Usage: train_efficiency_test.sh EPX CONFIG
set -euo pipefail
epx=$1 config=$2
fail() { echo "FAIL: $*"; exit 1; }
out=$("$epx" train --config "$config" --steps 3 -q 2>&1) || fail "epx train exited $?: $out"
lines=$(grep -c '^efficiency: ' <<< "$out" || true)
[[ $lines == 1 ]] || fail "$lines efficiency lines in: $out"
line=$(grep '^efficiency: ' <<< "$out")
echo "$line"
num='([0-9.e+-]+)'
re="^efficiency: step $num ms median; limit $num ms, bound by (rank [0-3] alone|the machine \(4 ranks at once\)): "
re+="GEMMs $num ms at $num GFLOP/s \+ exchange $num ms at $num GB/s memcpy \((one thread|4 threads) measured\): "
re+="$num% of the limit \(over the last 2 steps\)$"
[[ $line =~ $re ]] || fail "the line does not read as expected"
step=${BASH_REMATCH[1]} limit=${BASH_REMATCH[2]} bound=${BASH_REMATCH[3]} gemm=${BASH_REMATCH[4]}
gflops=${BASH_REMATCH[5]} exch=${BASH_REMATCH[6]} gbs=${BASH_REMATCH[7]} threads=${BASH_REMATCH[8]} pct=${BASH_REMATCH[9]}
[[ ($bound == rank* && $threads == "one thread") || ($bound == the* && $threads == "4 threads") ]] ||
  fail "bound '$bound' measured with '$threads'"
awk -v step="$step" -v limit="$limit" -v gemm="$gemm" -v gflops="$gflops" -v exch="$exch" \
    -v gbs="$gbs" -v pct="$pct" 'BEGIN {
  bad = ""
  if (!(step > 0 && step < 60000)) bad = bad " step " step " ms"
  if (!(gflops > 0.001 && gflops < 1e5)) bad = bad " GEMM rate " gflops " GFLOP/s"
  if (!(gbs > 0.001 && gbs < 1e4)) bad = bad " memcpy rate " gbs " GB/s"
  if (!(gemm > 0 && exch > 0)) bad = bad " GEMMs " gemm " ms, exchange " exch " ms"
  d = gemm + exch - limit; if (d < 0) d = -d
  if (d > 0.01 * limit + 0.002) bad = bad " GEMMs + exchange = " gemm + exch " ms, not the limit " limit " ms"
  r = 100 * limit / step; e = r - pct; if (e < 0) e = -e
  if (!(pct > 0 && pct <= 1000) || e > 0.02 * r + 1) bad = bad " share " pct "% (limit/step: " r "%)"
  if (bad != "") { print "FAIL:" bad; exit 1 }
}'
one=$("$epx" train --config "$config" --steps 1 -q 2>&1) || fail "epx train --steps 1 exited $?: $one"
grep -q '^efficiency: not measured: no step after the first to compare with its limit$' <<< "$one" ||
  fail "--steps 1 gave no 'not measured' line: $one"
echo "efficiency line sane"
