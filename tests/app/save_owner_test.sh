#!/usr/bin/env bash
# One writer per checkpoint folder (docs/errors.md, Checkpoints): a second run
# started with the same --save DIR is refused at start naming the first (host,
# pid); the lock of a run killed with -9 is taken over, saying whose it was; a
# new run into a folder holding another run's checkpoints is refused (nothing
# touched) unless --overwrite-checkpoints, and then --keep never prunes the
# other run's step folder. Each case checks the exit code and the files
# (checksums and mtimes before and after).
# Usage: save_owner_test.sh EPX_BINARY
set -uo pipefail
epx=$(realpath "$1")
work=$(mktemp -d)
job=
cleanup() {
  [[ -n "$job" ]] && kill -9 "$job" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
cd "$work" || exit 1
failures=0
fail() { echo "FAIL $*"; failures=$((failures + 1)); }
small=(--batch-tokens 64 --hidden 32 --ffn-hidden 32 --experts 8 -q)
host=$(uname -n)

snapshot() { find "$1" -type f -printf '%P %s %T@\n' | sort; find "$1" -type f -exec sha256sum {} + | sort; }

# run EXIT TEXT ARGS...: `epx train` exits EXIT and prints TEXT; the output in $out.
run() {
  local want=$1 text=$2
  shift 2
  out=$("$epx" train "${small[@]}" "$@" 2>&1)
  local code=$?
  if [[ $code -ne $want ]]; then fail "exit $code, want $want, for $*: $out"; return 1; fi
  if [[ "$out" != *"$text"* ]]; then fail "output lacks '$text' for $*: $out"; return 1; fi
  echo "ok   exit $code: ${out//$'\n'/ | }"
}

# ---- two runs with one --save DIR: the second is refused, naming the first
# The first holds the folder while its rank 0 sleeps before step 1.
EPX_TEST_FAULT=stall:0:1:30 "$epx" train "${small[@]}" --steps 4 --save ck > first.out 2>&1 &
job=$!
for _ in $(seq 400); do grep -q '^pid' ck/.epx-lock 2>/dev/null && break; sleep 0.025; done
if ! grep -q "^pid $job$" ck/.epx-lock 2>/dev/null; then
  fail "the first run's lock file does not name pid $job: $(cat ck/.epx-lock 2>&1) $(cat first.out)"
else
  before=$(snapshot ck)
  run 2 "--save ck is in use by another run: pid $job on host $host, started " --steps 2 --save ck --metrics m2.jsonl
  [[ "$(snapshot ck)" == "$before" ]] || fail "the refused second run changed ck"
  [[ -e m2.jsonl ]] && fail "the refused second run wrote its metrics file"
fi

# ---- a stale lock: the first run killed with -9 leaves its lock file
kill -9 "$job" 2>/dev/null
wait "$job" 2>/dev/null
first=$job
job=
[[ -f ck/.epx-lock ]] || fail "kill -9 left no lock file"
run 0 "the lock of a previous run was left behind: pid $first on host $host, started" --steps 4 --save ck
[[ "$out" == *"is gone (its lock was free"* ]] || fail "the stale-lock line does not say the owner is gone: $out"
[[ "$(ls -A ck | tr '\n' ' ')" == ".epx-checkpoints latest step-000004 " ]] ||
  fail "after the run that took the stale lock: $(ls -A ck) (the lock file must be gone)"
owner=$(grep -o '"run_id": "[0-9a-f]*"' ck/step-000004/meta.json | cut -d'"' -f4)
[[ -n "$owner" ]] || fail "step-000004/meta.json records no run_id"

# ---- a new run into a folder holding another run's checkpoints
before=$(snapshot ck)
run 2 "--save ck holds checkpoints of another run: step-000004 (run $owner); this new run would take over" \
  --steps 3 --save ck
[[ "$(snapshot ck)" == "$before" ]] || fail "the refused new run changed ck"

# ---- --overwrite-checkpoints: accepted; --keep 1 prunes only this run's step folders
theirs=$(snapshot ck/step-000004)
run 0 "final loss" --steps 3 --save-every 1 --keep 1 --save ck --overwrite-checkpoints
[[ "$(ls -A ck | tr '\n' ' ')" == ".epx-checkpoints latest step-000003 step-000004 " ]] ||
  fail "--keep 1 with another run's step folder left: $(ls -A ck)"
[[ "$(snapshot ck/step-000004)" == "$theirs" ]] || fail "the other run's step-000004 changed"
[[ "$(cat ck/latest)" == step-000003 ]] || fail "latest is '$(cat ck/latest)', want step-000003"
# A resume of this run into ck would replace the other run's step-000004: refused too.
before=$(snapshot ck)
run 2 "--save ck holds checkpoints of another run: step-000004 (run $owner); this resumed run would take over" \
  --steps 5 --save-every 1 --keep 1 --resume ck --save ck
[[ "$(snapshot ck)" == "$before" ]] || fail "the refused resumed run changed ck"

if [[ $failures -ne 0 ]]; then
  echo "$failures save-folder owner checks failed"
  exit 1
fi
echo "all save-folder owner checks passed"
