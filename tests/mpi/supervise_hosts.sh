#!/usr/bin/env bash
# `epx supervise --hosts` on two emulated hosts (two_hosts.sh --launch-in-host-a,
# 2 x 2 MPI ranks; docs/operations.md, Unattended runs):
#   kill -9 of a rank of host b mid-run, --exclude-after 1: the supervisor stops the
#     rest, records rank 2 or 3, host b, the step and "killed by Killed", excludes
#     host b and resumes from the latest checkpoint on host a's 2 ranks; the run
#     reaches its last step and its losses after the restart equal, bit for bit
#     (shortest round-trip text), those of a run resumed from the same checkpoint
#     on the same 2 ranks without a supervisor;
#   SIGSTOP of a rank of host b: its agent reports it stopped, the supervisor stops
#     the run at once and restarts it on both hosts (one failure < --exclude-after 2);
#   --spare-hosts: host b killed under --exclude-after 1 with host c spare: the run
#     resumes on a and c (4 ranks);
#   a crash loop (rank 3 fails at step 5 every run): host b excluded, the budget spent, exit 1.
# It prints the restart time of the kill -9 (the "resumed" event). EPX_KEEP=DIR keeps the files.
# Usage: supervise_hosts.sh EPX CONFIG      (exit 77 where two_hosts.sh cannot run)
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
epx=$(realpath "$1") config=$(realpath "$2")
if [[ ${3:-} != --inside ]]; then
  "$here/two_hosts.sh" --hosts 3 --timeout 500 --launch-in-host-a -- bash "${BASH_SOURCE[0]}" "$epx" "$config" --inside
  exit
fi
work=$(mktemp -d)
trap '[[ -n "${EPX_KEEP:-}" ]] && cp -r "$work" "$EPX_KEEP"; rm -rf "$work"' EXIT
fail() { echo "supervise_hosts: FAIL: $*"; exit 1; }
read -r host_a host_b host_c <<<"$EPX_TWO_HOSTS_NAMES"
mapfile -t mpi_args <<<"$EPX_TWO_HOSTS_MPIRUN_ARGS"
launcher_args=()
for a in "${mpi_args[@]}"; do launcher_args+=("--launcher-arg=$a"); done
train=(train --config "$config" --experts 8 --steps 60 --save-every 10 --keep 100 --timeout 10 --backend mpi -q)
losses() { grep -o '"loss":[^,]*' "$1" | cut -d: -f2; }
event() { grep "\"event\":\"$2\"" "$1"; }

# supervised NAME HOSTS [SUPERVISE OPTIONS...]: epx supervise in the background; sets sup
supervised() {
  local name=$1 hosts=$2
  shift 2
  "$epx" supervise --hosts "$hosts" --events "$work/$name.events" --grace 2 "${launcher_args[@]}" "$@" -- \
    "$epx" "${train[@]}" --save "$work/$name" --metrics "$work/$name.jsonl" >"$work/$name.out" 2>&1 &
  sup=$!
}
# the pid of RANK's training process, once the metrics hold LINES lines
rank_pid() {
  local name=$1 rank=$2 lines=$3 waited=0
  until [[ -f "$work/$name.jsonl" ]] && (( $(wc -l <"$work/$name.jsonl") >= lines )); do
    sleep 0.1
    (( ++waited < 1800 )) || fail "$name: no step $lines within 180 s: $(tail -n 20 "$work/$name.out")"
  done
  # the latest attempt: a launch that failed on its own (before any step) was restarted already
  local dir
  dir=$(ls -d "$work/$name.ranks"/attempt-* | sort -V | tail -n 1)
  python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["pid"])' "$dir/rank-$rank.json"
}
finish() {  # NAME: waits for the supervisor, which must exit 0 with the last step saved
  wait "$sup"; local code=$?
  [[ $code == 0 ]] || fail "$1: supervise exited $code: $(tail -n 30 "$work/$1.out")"
  [[ "$(cat "$work/$1/latest")" == step-000060 ]] || fail "$1: latest is $(cat "$work/$1/latest")"
  (( $(losses "$work/$1.jsonl" | wc -l) == 60 )) || fail "$1: the metrics do not hold 60 steps"
}

# 1. kill -9 of rank 3 (host b): host b excluded, resumed on host a's 2 ranks.
supervised killed "$host_a:2,$host_b:2" --exclude-after 1
kill -9 "$(rank_pid killed 3 25)"
finish killed
failed=$(event "$work/killed.events" rank_failed)
[[ $failed == *'"rank":3'* && $failed == *"\"host\":\"$host_b\""* && $failed == *'"cause":"killed by Killed"'* ]] ||
  fail "kill -9: the failure is not rank 3 of $host_b, killed: $failed"
event "$work/killed.events" excluded | grep -q "\"host\":\"$host_b\"" || fail "kill -9: $host_b was not excluded"
restart=$(event "$work/killed.events" start | tail -n 1)
[[ $restart == *"\"hosts\":\"$host_a:2\""* && $restart == *'"ranks":2'* ]] ||
  fail "kill -9: the restart is not on $host_a's 2 ranks: $restart"
step=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["checkpoint_step"])' "$restart")
(( step >= 20 )) || fail "kill -9: resumed from step $step, before the kill"
grep -q "resharding checkpoint" "$work/killed.out" || fail "kill -9: the resume did not reshard onto 2 ranks"
# The reference: the same checkpoint resumed on the same 2 ranks of host a, no supervisor.
mpirun --host "$host_a:2" -np 2 --map-by slot "${mpi_args[@]}" "$epx" "${train[@]}" --ranks 2 \
  --resume "$work/killed/step-$(printf %06d "$step")" --save "$work/ref" --metrics "$work/ref.jsonl" \
  >"$work/ref.out" 2>&1 || fail "the reference run failed: $(tail -n 20 "$work/ref.out")"
(( $(losses "$work/ref.jsonl" | wc -l) == 60 - step )) || fail "the reference run did not write steps $((step + 1))..60"
[[ "$(losses "$work/killed.jsonl" | tail -n +$((step + 1)))" == "$(losses "$work/ref.jsonl")" ]] ||
  fail "kill -9: the losses after the restart differ from the reference resumed at step $step"
seconds=$(event "$work/killed.events" resumed | python3 -c 'import json,sys; print(json.loads(sys.stdin.readline())["restart_seconds"])')
echo "restart time (kill -9 to the first step on 2 ranks): $seconds s"
# epx report --events shows the restart and the steps lost.
"$epx" report "$work/killed.jsonl" --events "$work/killed.events" -o "$work/killed.html" >"$work/report.txt" ||
  fail "epx report --events exited $?"
grep -q "supervised: 1 restart, $(( $(event "$work/killed.events" exit | head -n 1 | python3 -c 'import json,sys; print(json.loads(sys.stdin.readline())["lost_steps"])') )) steps\? lost; rank 3 on $host_b: killed by Killed" "$work/report.txt" ||
  fail "epx report --events: $(cat "$work/report.txt")"
grep -q "supervised (epx supervise --events).*1 restart, [0-9]* steps\? lost; rank 3 on $host_b" "$work/killed.html" ||
  fail "epx report --events: the page's summary does not show the restart"
echo "ok   kill -9 of rank 3 on $host_b: excluded, resumed at step $step on 2 ranks, the same $((60 - step)) losses bit for bit"

# 2. SIGSTOP of rank 2 (host b): stopped at once, restarted on both hosts.
supervised stopped "$host_a:2,$host_b:2"
kill -STOP "$(rank_pid stopped 2 25)"
finish stopped
failed=$(event "$work/stopped.events" rank_failed)
[[ $failed == *'"rank":2'* && $failed == *'"cause":"stopped by Stopped'* && $failed == *"\"host\":\"$host_b\""* ]] ||
  fail "SIGSTOP: no stopped rank 2: $(cat "$work/stopped.events")"
! event "$work/stopped.events" excluded >/dev/null || fail "SIGSTOP: a host was excluded after one failure"
event "$work/stopped.events" start | tail -n 1 | grep -q '"ranks":4' || fail "SIGSTOP: the restart is not on 4 ranks"
echo "ok   SIGSTOP of rank 2 on $host_b: stopped, restarted on both hosts"

# 3. --spare-hosts: host b killed, host c takes its place.
supervised spare "$host_a:2,$host_b:2" --exclude-after 1 --spare-hosts "$host_c:2"
kill -9 "$(rank_pid spare 2 25)"
finish spare
event "$work/spare.events" excluded | grep -q "\"replaced_by\":\"$host_c\"" || fail "spare: $host_b not replaced by $host_c"
event "$work/spare.events" start | tail -n 1 | grep -q "\"hosts\":\"$host_a:2,$host_c:2\"" ||
  fail "spare: the restart is not on $host_a and $host_c: $(cut -c1-200 "$work/spare.events")"
echo "ok   spare host: $host_b replaced by $host_c, 4 ranks again"
# 4. A crash loop (rank 3 fails at step 5 every time): host b excluded after its second
#    failure, and the budget (--max-restarts 1) spent: exit 1, saying so.
EPX_TEST_FAULT=fail:3:5 supervised loop "$host_a:2,$host_b:2" --max-restarts 1 --launcher-arg=-x --launcher-arg=EPX_TEST_FAULT
wait "$sup"; code=$?
[[ $code == 1 ]] || fail "crash loop: supervise exited $code, want 1: $(tail -n 5 "$work/loop.out")"
(( $(event "$work/loop.events" start | wc -l) == 2 && $(event "$work/loop.events" rank_failed | wc -l) == 2 )) ||
  fail "crash loop: want 2 runs and 2 failed ranks: $(cat "$work/loop.events")"
event "$work/loop.events" gave_up >/dev/null && grep -q "(--max-restarts 1): giving up" "$work/loop.out" ||
  fail "crash loop: no give-up: $(tail -n 5 "$work/loop.out")"
echo "ok   crash loop: 2 runs, host $host_b excluded, then it gave up (exit 1)"

echo "supervise_hosts: the supervisor restarted every failure on the hosts left"
