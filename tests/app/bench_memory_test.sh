#!/usr/bin/env bash
# epx bench exchange holds no more memory than it planned: its peak resident
# memory (getrusage) stays within the plan it checks against the memory
# available, plus the process's own 64 MiB. A shape whose plan misses a
# buffer can be killed by the kernel instead of refused with a message.
# Usage: bench_memory_test.sh EPX_BINARY [sanitized]
# With `sanitized` (an ASan/UBSan/TSan build, whose runtime holds its own
# shadow memory and quarantine) the runs are checked for their exit code
# only: the bound is not.
set -uo pipefail
epx=$1
sanitized=${2:-}
failures=0

# check SHAPE LAYER: one shape of 256 tokens per rank at the default hidden.
check() {
  local shape=$1 layer=$2 out code
  out=$(timeout 300 "$epx" bench exchange --tokens 256 --nodes-shapes "$shape" --layer-combine "$layer" \
        --reps 1 --json 2>/dev/null)
  code=$?
  if [[ $code -ne 0 ]]; then echo "FAIL $shape $layer: exit code $code"; failures=$((failures + 1)); return; fi
  local verdict
  verdict=$(python3 -c '
import json, sys
m = json.loads(sys.stdin.read())["shapes"][0]["memory_bytes"]
slack = 64 << 20
ok = sys.argv[1] == "sanitized" or m["peak_rss"] <= m["planned"] + slack
print(("ok  " if ok else "FAIL") + " peak %.3f GiB, planned %.3f GiB" % (m["peak_rss"] / 2**30, m["planned"] / 2**30))
' "${sanitized:-plain}" <<< "$out")
  echo "$verdict ($shape, --layer-combine $layer)"
  [[ $verdict == ok* ]] || failures=$((failures + 1))
}

check 1x8 on
check 2x4 on
check 1x8 receiver
check 1x8 off

if [[ $failures -ne 0 ]]; then echo "$failures case(s) failed"; exit 1; fi
echo "all bench memory cases passed"
