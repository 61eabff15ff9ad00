#!/usr/bin/env bash
# Preemption (docs/operations.md): a signal that Slurm sends before it ends or
# requeues a job (SIGUSR1, SIGTERM) makes `epx train --save DIR` save the
# checkpoint of the step it is at on every rank and exit 75; the same command
# with --resume DIR then runs to the end, and its losses from the saved step on
# equal an uninterrupted run's bit for bit (shortest round-trip values).
#
# Usage: train_preempt_test.sh EPX CONFIG [MPIEXEC FLAGS...]
#   with MPIEXEC: the preempted run is `MPIEXEC FLAGS -n 2 EPX train --backend mpi`,
#   and the signal goes to MPIEXEC, which passes SIGUSR1 on to the ranks.
set -uo pipefail
epx=$1 config=$2
shift 2
launcher=("$@")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
steps=400
common=(train --config "$config" --steps "$steps" --ranks 2 -q)
fail() { echo "train_preempt_test: FAIL: $*" >&2; exit 1; }

"$epx" "${common[@]}" --metrics "$work/ref.jsonl" || fail "the uninterrupted run exited with $?"

preempt_run() {  # preempt_run SIGNAL: start a run, signal it after its 3rd step; sets rc
  local signal=$1
  rm -rf "$work/ck" "$work/a.jsonl"
  if (( ${#launcher[@]} )); then
    "${launcher[@]}" -n 2 "$epx" "${common[@]}" --backend mpi --save "$work/ck" --metrics "$work/a.jsonl" \
      2>"$work/err" &
  else
    "$epx" "${common[@]}" --save "$work/ck" --metrics "$work/a.jsonl" 2>"$work/err" &
  fi
  local pid=$! waited=0
  until [[ -f "$work/a.jsonl" ]] && (( $(wc -l <"$work/a.jsonl") >= 3 )); do
    sleep 0.05
    (( ++waited < 1200 )) || { kill -9 "$pid"; fail "no third step within 60 s"; }
    kill -0 "$pid" 2>/dev/null || fail "the run ended before it was signalled: $(cat "$work/err")"
  done
  kill "-$signal" "$pid"
  wait "$pid"
  rc=$?
}

check_saved() {  # the run saved exactly the steps it reported, and said how to go on
  local done_steps latest
  [[ $rc == 75 ]] || fail "$1: exit $rc, want 75: $(cat "$work/err")"
  grep -q "preempted (SIGTERM or SIGUSR1): saved the checkpoint of step" "$work/err" || fail "$1: no preemption line"
  done_steps=$(wc -l <"$work/a.jsonl")
  latest=$(cat "$work/ck/latest")
  [[ $latest == "$(printf 'step-%06d' "$done_steps")" ]] ||
    fail "$1: latest names $latest, but the metrics hold $done_steps steps"
  (( done_steps < steps )) || fail "$1: the run was not stopped early"
}

preempt_run USR1
check_saved SIGUSR1
"$epx" "${common[@]}" --save "$work/ck" --resume "$work/ck" --metrics "$work/b.jsonl" ||
  fail "the resumed run exited with $?"
python3 - "$work/ref.jsonl" "$work/b.jsonl" <<'PY' || fail "the resumed losses differ from the uninterrupted run's"
import json, sys
ref = {r["step"]: repr(r["loss"]) for r in map(json.loads, open(sys.argv[1]))}
resumed = [json.loads(line) for line in open(sys.argv[2])]
assert resumed, "the resumed run wrote no steps"
bad = [(r["step"], repr(r["loss"]), ref[r["step"]]) for r in resumed if repr(r["loss"]) != ref[r["step"]]]
assert not bad, bad[:3]
print(f"resumed steps {resumed[0]['step']}..{resumed[-1]['step']}: losses equal the uninterrupted run's")
PY
if (( ${#launcher[@]} == 0 )); then
  preempt_run TERM
  check_saved SIGTERM
fi
echo "train_preempt_test: preempted, saved, resumed to the end with the same losses"
