#!/usr/bin/env bash
# A full disk while epx train writes its metrics: the run stops at that step
# with exit 1 and a message naming the step, and the metrics file keeps only
# whole lines (valid JSON Lines). Needs root for a small tmpfs; skipped with
# the reason otherwise (exit 0 with "skip", as ctest's SKIP_REGULAR_EXPRESSION).
# Usage: metrics_full_disk_test.sh EPX_BINARY
set -uo pipefail
epx=$1
work=$(mktemp -d)
mounted=""
cleanup() {
  [[ -n "$mounted" ]] && umount "$mounted" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
mkdir -p "$work/disk"
# 4 pages: about 20 lines of the tiny model's metrics.
if ! mount -t tmpfs -o size=16k tmpfs "$work/disk" 2>"$work/mount.err"; then
  echo "skip: cannot mount a tmpfs (needs root): $(cat "$work/mount.err")"
  exit 0
fi
mounted="$work/disk"
metrics="$work/disk/m.jsonl"
out=$("$epx" train --steps 500 --metrics "$metrics" 2>&1)
code=$?
printf '%s\n' "$out" | tail -n 3
if [[ $code -ne 1 ]]; then echo "FAIL: exit code $code, want 1"; exit 1; fi
step=$(printf '%s\n' "$out" | sed -n 's/.*after step \([0-9]*\): writing metrics: cannot write the metrics file .*No space left on device.*/\1/p' | head -n 1)
if [[ -z "$step" ]]; then echo "FAIL: no 'after step N: writing metrics: ... No space left on device' message"; exit 1; fi
if (( step >= 500 )); then echo "FAIL: the run went on to its last step ($step)"; exit 1; fi
lines=$(wc -l < "$metrics")
# Steps 1..step-1 were written whole; step's line is the one that failed.
if (( lines != step - 1 )); then echo "FAIL: $lines lines in the file, want $((step - 1))"; exit 1; fi
if [[ -n "$(tail -c 1 "$metrics")" ]]; then echo "FAIL: the file does not end with a newline"; exit 1; fi
if grep -qv '^{"step":[0-9]*,.*}$' "$metrics"; then echo "FAIL: a line is not a whole JSON object"; exit 1; fi
if command -v python3 >/dev/null; then
  python3 -c 'import json, sys; [json.loads(l) for l in open(sys.argv[1])]' "$metrics" || { echo "FAIL: a line does not parse"; exit 1; }
fi
echo "ok: stopped after step $step of 500 (exit 1), $lines whole JSON lines kept"
