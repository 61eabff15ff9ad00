#!/usr/bin/env bash
# A real straggler: one of 4 MPI processes of `epx train` is paused from
# outside, 50 ms in every 100 ms (SIGSTOP/SIGCONT in a loop), for the whole
# run. epx train must exit 0 and its summary must name that rank first (the
# largest share of the waiting) with cause compute ("straggler: rank 2
# (compute): ..."). Another rank may follow with a smaller share: with 4
# processes on 2 cores, the rank with the most rows (rank 1 here, about 1.2x
# the mean) is a real, milder straggler on a 2-core machine.
# Usage: straggler_compute.sh EPX MPIEXEC CONFIG [STEPS]
set -uo pipefail
epx=$1 mpiexec=$2 config=$3 steps=${4:-150}
victim_rank=2
work=$(mktemp -d)
job= victim= pauser=
cleanup() {
  [[ -n "$pauser" ]] && kill "$pauser" 2>/dev/null
  [[ -n "$victim" ]] && kill -CONT "$victim" 2>/dev/null
  [[ -n "$job" ]] && kill -9 "$job" 2>/dev/null
  for pid in $(pgrep -f "^$work/epx train"); do kill -9 "$pid" 2>/dev/null; done
  [[ -n "${KEEP_WORK:-}" ]] && cp "$work/m.jsonl" "$KEEP_WORK" 2>/dev/null; rm -rf "$work"
}
trap cleanup EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cp "$epx" "$work/epx"  # a copy under $work, so cleanup finds every process of this test
fail() { echo "FAIL: $*"; cat "$work/out.txt" 2>/dev/null; exit 1; }

timeout 100 "$mpiexec" --oversubscribe --bind-to none -n 4 "$work/epx" train --config "$config" --ranks 4 \
  --steps "$steps" --backend mpi -q --metrics "$work/m.jsonl" > "$work/out.txt" 2>&1 &
job=$!
# The victim: world rank 2's process, once the run has started.
for _ in $(seq 600); do
  for pid in $(pgrep -f "^$work/epx train"); do
    if tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$victim_rank"; then
      victim=$pid
    fi
  done
  [[ -n "$victim" && -s "$work/m.jsonl" ]] && break
  sleep 0.05
done
[[ -n "$victim" && -s "$work/m.jsonl" ]] || fail "the job did not start training in 30 s"
( while kill -STOP "$victim" 2>/dev/null; do
    sleep 0.05
    kill -CONT "$victim" 2>/dev/null
    sleep 0.05
  done ) &
pauser=$!
wait "$job"
rc=$?
job=
kill "$pauser" 2>/dev/null; wait "$pauser" 2>/dev/null; pauser=
kill -CONT "$victim" 2>/dev/null; victim=
cat "$work/out.txt"
(( rc == 0 )) || fail "epx train exited $rc"
first=$(grep -m 1 "^straggler: " "$work/out.txt")
[[ "$first" == "straggler: rank $victim_rank (compute): "* ]] ||
  fail "the summary's first straggler is not rank $victim_rank with cause compute: ${first:-no straggler line}"
echo "the paused rank $victim_rank was found with cause compute"
