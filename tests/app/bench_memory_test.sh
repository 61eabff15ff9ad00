#!/usr/bin/env bash
# epx bench exchange holds no more memory than it planned: each shape's peak
# resident memory (VmHWM, reset before the shape) stays within the plan it
# checks against the memory available, plus 3% and the process's own
# 64 MiB (what the heap keeps from earlier shapes of a run). A shape whose
# plan misses a buffer can be killed by the kernel instead of refused with a
# message.
# Usage: bench_memory_test.sh EPX_BINARY [sanitized]
# With `sanitized` (an ASan/UBSan/TSan build, whose runtime holds its own
# shadow memory and quarantine) the runs are checked for their exit code
# only: the bound is not.
set -uo pipefail
epx=$1
sanitized=${2:-}
failures=0
err=$(mktemp)
trap 'rm -f "$err"' EXIT

# check TOKENS SHAPES LAYER: one run at the default hidden; every shape checked.
check() {
  local tokens=$1 shapes=$2 layer=$3 out code
  out=$(timeout 300 "$epx" bench exchange --tokens "$tokens" --nodes-shapes "$shapes" --layer-combine "$layer" \
        --reps 1 --json 2>"$err")
  code=$?
  if [[ $code -ne 0 ]]; then
    echo "FAIL tokens $tokens, shapes $shapes, --layer-combine $layer: exit code $code: $(tail -c 400 "$err")"
    failures=$((failures + 1))
    return
  fi
  local verdicts
  verdicts=$(python3 -c '
import json, sys
for s in json.loads(sys.stdin.read())["shapes"]:
    m = s["memory_bytes"]
    ok = sys.argv[1] == "sanitized" or m["peak_rss"] <= 1.03 * m["planned"] + (64 << 20)
    print(("ok  " if ok else "FAIL") + " peak %.3f GiB, planned %.3f GiB (%d tokens %dx%d, --layer-combine %s)" % (
        m["peak_rss"] / 2**30, m["planned"] / 2**30, s["tokens"], s["nodes"], s["ranks_per_node"], sys.argv[2]))
' "${sanitized:-plain}" "$layer" <<< "$out")
  echo "$verdicts"
  failures=$((failures + $(grep -c '^FAIL' <<< "$verdicts")))
}

check 256 1x8 on
check 256 2x4 on
check 256 1x8 receiver
check 256 1x8 off
check 128,256 1x8,2x4 on  # later shapes after earlier ones in one process

if [[ $failures -ne 0 ]]; then echo "$failures case(s) failed"; exit 1; fi
echo "all bench memory cases passed"
