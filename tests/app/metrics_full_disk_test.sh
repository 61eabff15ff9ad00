#!/usr/bin/env bash
# A full disk while epx train writes its metrics: the run stops at that step
# with exit 1 and a message naming the step, and the metrics file keeps only
# whole lines (valid JSON Lines). Needs root for a small tmpfs; skipped with
# the reason otherwise (exit 0 with "skip", as ctest's SKIP_REGULAR_EXPRESSION).
# With MPIEXEC, the same under mpirun (2 processes): rank 0 writes, and the
# other rank stops after the same step, told through the per-step all-reduce.
# Usage: metrics_full_disk_test.sh EPX_BINARY [MPIEXEC]
set -uo pipefail
epx=$1
mpiexec=${2:-}
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

# check_stopped WHAT OUTPUT CODE: exit 1, stopped after step N < 500 with the
# file holding steps 1..N-1 as whole JSON lines. Prints N.
check_stopped() {
  local what=$1 out=$2 code=$3 metrics="$work/disk/m.jsonl"
  printf '%s\n' "$out" | tail -n 3 >&2
  if [[ $code -ne 1 ]]; then echo "FAIL $what: exit code $code, want 1" >&2; return 1; fi
  local step
  step=$(printf '%s\n' "$out" | sed -n 's/.*after step \([0-9]*\): writing metrics: cannot write the metrics file .*No space left on device.*/\1/p' | head -n 1)
  if [[ -z "$step" ]]; then echo "FAIL $what: no 'after step N: writing metrics: ... No space left on device'" >&2; return 1; fi
  if (( step >= 500 )); then echo "FAIL $what: the run went on to its last step ($step)" >&2; return 1; fi
  local lines
  lines=$(wc -l < "$metrics")
  # Steps 1..step-1 were written whole; step's line is the one that failed.
  if (( lines != step - 1 )); then echo "FAIL $what: $lines lines in the file, want $((step - 1))" >&2; return 1; fi
  if [[ -n "$(tail -c 1 "$metrics")" ]]; then echo "FAIL $what: the file does not end with a newline" >&2; return 1; fi
  if grep -qv '^{"step":[0-9]*,.*}$' "$metrics"; then echo "FAIL $what: a line is not a whole JSON object" >&2; return 1; fi
  if command -v python3 >/dev/null; then
    python3 -c 'import json, sys; [json.loads(l) for l in open(sys.argv[1])]' "$metrics" ||
      { echo "FAIL $what: a line does not parse" >&2; return 1; }
  fi
  echo "$step"
}

out=$("$epx" train --steps 500 --metrics "$work/disk/m.jsonl" 2>&1)
step=$(check_stopped "in-process" "$out" $?) || exit 1
echo "ok in-process: stopped after step $step of 500 (exit 1), $((step - 1)) whole JSON lines kept"

if [[ -n "$mpiexec" ]]; then
  rm -f "$work/disk/m.jsonl"
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  out=$(timeout 300 "$mpiexec" --oversubscribe --bind-to none -n 2 "$epx" train --ranks 2 --backend mpi --steps 500 \
          --metrics "$work/disk/m.jsonl" 2>&1)
  code=$?
  (( code != 0 )) && code=1  # mpirun reports a rank's failure as its own exit code
  step=$(check_stopped "mpi" "$out" $code) || exit 1
  if ! printf '%s\n' "$out" | grep -q "rank 1: rank 0 stopped the run after step $step"; then
    echo "FAIL mpi: rank 1 does not say it stopped after step $step; the run printed:"
    printf '%s\n' "$out" | tail -n 30
    exit 1
  fi
  echo "ok mpi: both ranks stopped after step $step of 500, $((step - 1)) whole JSON lines kept"
fi
