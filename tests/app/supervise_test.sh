#!/usr/bin/env bash
# epx supervise (docs/operations.md, Supervised runs), on in-process training runs:
#   kill -9 of the training: restarted from its latest checkpoint, it reaches its last step and
#     its loss curve (the metrics file, cut back at the resume) equals an uninterrupted run's;
#   SIGSTOP of the training: --stall-seconds stops it (SIGTERM, then SIGKILL) and restarts it;
#   a kill during a restart: of the restarted run (restarted again), of the supervisor (its run dies
#     with it, latest stays valid, the next supervisor resumes; epx monitor --events counts it);
#   a crash loop (a rank failing at the same step every time): gives up after --max-restarts;
#   SIGUSR1 to the supervisor: passed on, the training saves and exits 75, and so does supervise;
#   a command without --save: refused (exit 2).
# Usage: supervise_test.sh EPX CONFIG
set -uo pipefail
epx=$(realpath "$1") config=$2
work=$(mktemp -d)
sup=
trap '[[ -n "$sup" ]] && kill -9 "$sup" 2>/dev/null; pkill -9 -f "$work" 2>/dev/null; rm -rf "$work"' EXIT
fail() { echo "supervise_test: FAIL: $*"; exit 1; }
train=(train --config "$config" --steps 300 -q)
losses() { python3 -c 'import json,sys; print([repr(json.loads(l)["loss"]) for l in open(sys.argv[1])])' "$1"; }
events() { grep -c "\"event\":\"$2\"" "$1"; }

# supervised RUN_NAME [SUPERVISE OPTIONS...]: starts `epx supervise` in the background; sets sup
supervised() {
  local name=$1
  shift
  "$epx" supervise --events "$work/$name.events" "$@" -- \
    "$epx" "${train[@]}" --save "$work/$name" --save-every 50 --metrics "$work/$name.jsonl" \
    >"$work/$name.out" 2>&1 &
  sup=$!
}
# the training's pid (the supervisor's child) once its metrics hold LINES lines
child_at() {
  local name=$1 lines=$2 waited=0 pid
  until [[ -f "$work/$name.jsonl" ]] && (( $(wc -l <"$work/$name.jsonl") >= lines )); do
    sleep 0.05
    (( ++waited < 1200 )) || fail "$name: no step $lines within 60 s: $(cat "$work/$name.out")"
  done
  pid=$(pgrep -P "$sup" | head -n 1)
  [[ -n "$pid" ]] || fail "$name: no training process under the supervisor"
  echo "$pid"
}

"$epx" "${train[@]}" --metrics "$work/ref.jsonl" >/dev/null || fail "the uninterrupted run exited with $?"

supervised killed
kill -9 "$(child_at killed 120)"
wait "$sup"; code=$?; sup=
[[ $code == 0 ]] || fail "after kill -9: supervise exited $code: $(tail -n 5 "$work/killed.out")"
[[ $(events "$work/killed.events" start) == 2 ]] || fail "after kill -9: not one restart: $(cat "$work/killed.events")"
grep -q '"signal":"Killed"' "$work/killed.events" || fail "after kill -9: the exit event does not say Killed"
[[ "$(cat "$work/killed/latest")" == step-000300 ]] || fail "after kill -9: latest is $(cat "$work/killed/latest")"
[[ "$(losses "$work/killed.jsonl")" == "$(losses "$work/ref.jsonl")" ]] ||
  fail "after kill -9: the loss curve differs from the uninterrupted run's"
echo "ok   kill -9: restarted from its checkpoint, the same 300 losses as an uninterrupted run"

# waits until the events file NAME.events holds N start events
starts_reach() {
  local waited=0
  until (( $(events "$work/$1.events" start 2>/dev/null || echo 0) >= $2 )); do
    sleep 0.02
    (( ++waited < 3000 )) || fail "$1: no start $2 within 60 s"
  done
}

# A kill during the restart: the restarted run killed before its first step.
supervised again
kill -9 "$(child_at again 120)"
starts_reach again 2
pid=$(pgrep -P "$sup" | head -n 1)
[[ -n "$pid" ]] && kill -9 "$pid"
wait "$sup"; code=$?; sup=
[[ $code == 0 && $(events "$work/again.events" start) == 3 ]] ||
  fail "killed while restarting: exit $code, want 0 after 3 starts: $(cat "$work/again.events")"
[[ "$(losses "$work/again.jsonl")" == "$(losses "$work/ref.jsonl")" ]] || fail "killed while restarting: the curve differs"
echo "ok   the restarted run killed while restarting: restarted again, the same losses"

# The supervisor itself killed while restarting: its run dies with it, latest stays valid, and
# the supervisor started again resumes from it.
supervised again2
kill -9 "$(child_at again2 120)"
starts_reach again2 2
kill -9 "$sup"; wait "$sup" 2>/dev/null; sup=
for _ in $(seq 100); do pgrep -f "$work/again2 " >/dev/null || break; sleep 0.05; done
! pgrep -f "$work/again2 " >/dev/null || fail "supervisor killed: its run lives on"
[[ "$(cat "$work/again2/latest")" == step-000100 ]] || fail "supervisor killed: latest is $(cat "$work/again2/latest")"
supervised again2
wait "$sup"; code=$?; sup=
[[ $code == 0 ]] || fail "supervisor killed, started again: exit $code: $(tail -n 5 "$work/again2.out")"
[[ "$(losses "$work/again2.jsonl")" == "$(losses "$work/ref.jsonl")" ]] || fail "supervisor killed: the curve differs"
out=$("$epx" monitor "$work/again2.jsonl" --events "$work/again2.events" --plain); code=$?
[[ $code == 0 && $out == *"supervised: 2 restarts, "* ]] || fail "epx monitor --events: exit $code: $out"
echo "ok   the supervisor killed while restarting: nothing left running, latest valid, resumed by the next one"

supervised stopped --stall-seconds 2 --grace 1
kill -STOP "$(child_at stopped 120)"
wait "$sup"; code=$?; sup=
[[ $code == 0 ]] || fail "after SIGSTOP: supervise exited $code: $(tail -n 5 "$work/stopped.out")"
grep -q '"cause":"stalled' "$work/stopped.events" || fail "after SIGSTOP: no stalled exit: $(cat "$work/stopped.events")"
[[ "$(losses "$work/stopped.jsonl")" == "$(losses "$work/ref.jsonl")" ]] || fail "after SIGSTOP: the curve differs"
echo "ok   SIGSTOP: stopped after 2 s without a step, restarted, the same losses"

EPX_TEST_FAULT=fail:1:120 supervised loop --max-restarts 2
wait "$sup"; code=$?; sup=
[[ $code == 1 ]] || fail "crash loop: supervise exited $code, want 1"
[[ $(events "$work/loop.events" start) == 3 && $(events "$work/loop.events" gave_up) == 1 ]] ||
  fail "crash loop: want 3 starts and a give-up: $(cat "$work/loop.events")"
grep -q "2 restarts within 3600 s (--max-restarts 2): giving up" "$work/loop.out" || fail "crash loop: no give-up line"
echo "ok   crash loop: 3 runs, then it gave up (exit 1)"

supervised preempted
child_at preempted 60 >/dev/null
kill -USR1 "$sup"
wait "$sup"; code=$?; sup=
[[ $code == 75 ]] || fail "SIGUSR1: supervise exited $code, want 75: $(tail -n 5 "$work/preempted.out")"
[[ $(events "$work/preempted.events" start) == 1 ]] || fail "SIGUSR1: it restarted"
echo "ok   SIGUSR1: passed on; the training saved, both exited 75"

out=$("$epx" supervise -- "$epx" "${train[@]}" 2>&1); code=$?
[[ $code == 2 && "$out" == *"names no save folder"* ]] || fail "no --save: exit $code: $out"
out=$("$epx" report "$work/ref.jsonl" --events "$work/no.events" -o "$work/r.html" 2>&1); code=$?
[[ $code == 2 && "$out" == *"no.events"* ]] || fail "report --events of a missing file: exit $code: $out"
echo "supervise_test: all supervisor checks passed"
