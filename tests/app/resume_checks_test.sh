#!/usr/bin/env bash
# A resume checks the run, not only the model (docs/errors.md, Checkpoints):
# another seed, --data, --clusters, --zipf or --batch-tokens than the
# checkpoint recorded is refused (exit 2, naming the setting, its old and new
# value; nothing changed) unless --allow-data-change; the metrics file is cut
# back to the checkpoint's step before the resumed run appends, so every step
# is in it once; `epx report` counts each step once in an older file that
# holds steps twice, and says where the run was resumed.
# Usage: resume_checks_test.sh EPX_BINARY SOURCE_DIR
set -uo pipefail
epx=$(realpath "$1")
src=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work" || exit 1
failures=0
fail() { echo "FAIL $*"; failures=$((failures + 1)); }
base=(--hidden 32 --ffn-hidden 32 --experts 8 -q)
small=("${base[@]}" --batch-tokens 64)
opts=("${small[@]}")  # what `refused` passes before its own arguments

snapshot() { find "$work" -type f -printf '%P %s %T@\n' | sort; find "$work" -type f -exec sha256sum {} + | sort; }
steps_of() { grep -o '^{"step":[0-9]*' "$1" | cut -d: -f2 | tr '\n' ' '; }

# refused TEXT ARGS...: `epx train` exits 2 with TEXT and changes no file.
refused() {
  local text=$1
  shift
  local before out code
  before=$(snapshot)
  out=$("$epx" train "${opts[@]}" "$@" 2>&1)
  code=$?
  if [[ $code -ne 2 ]]; then fail "exit $code, want 2, for $*: $out"; return; fi
  if [[ "$out" != *"$text"* ]]; then fail "output lacks '$text' for $*: $out"; return; fi
  [[ "$(snapshot)" == "$before" ]] || { fail "files changed for $*"; return; }
  echo "ok   refused: ${out//$'\n'/ | }"
}

"$epx" train "${small[@]}" --steps 4 --save-every 2 --save ck --metrics m.jsonl > /dev/null 2>&1 || fail "the setup run"
cp m.jsonl ref.jsonl
head -c 3000 "$src/README.md" > a.txt
head -c 3000 "$src/docs/design.md" > b.txt
"$epx" train "${small[@]}" --steps 2 --data text:a.txt --window 8 --save ckt > /dev/null 2>&1 || fail "the text setup run"

# ---- another data setting: refused, naming it with both values
refused "checkpoint ck (step 4) was trained on other data: seed = 1 in the checkpoint, 2 in this run" \
  --steps 6 --resume ck --seed 2 --metrics m.jsonl
refused "clusters = 16 in the checkpoint, 8 in this run" --steps 6 --resume ck --clusters 8 --metrics m.jsonl
refused "zipf = 1.2 in the checkpoint, 2 in this run" --steps 6 --resume ck --zipf 2 --metrics m.jsonl
opts=("${base[@]}")
refused "batch_tokens = 64 in the checkpoint, 128 in this run" --steps 6 --resume ck --batch-tokens 128 --metrics m.jsonl
opts=("${small[@]}")
refused "data = text:$work/a.txt in the checkpoint, text:$work/b.txt in this run" \
  --steps 4 --resume ckt --data text:b.txt --window 8
# ... accepted with --allow-data-change, saying so (also with -q)
out=$("$epx" train "${small[@]}" --steps 6 --resume ck --seed 2 --allow-data-change --metrics other.jsonl 2>&1)
if [[ $? -ne 0 || "$out" != *"training on other data than checkpoint ck (step 4) was trained on (--allow-data-change): seed = 1 in the checkpoint, 2 in this run"* ]]; then
  fail "--allow-data-change: $out"
else
  echo "ok   --allow-data-change: ${out%%$'\n'*}"
fi
# The same settings resume silently (no data line).
out=$("$epx" train "${small[@]}" --steps 5 --resume ck --metrics same.jsonl 2>&1)
[[ $? -eq 0 && "$out" != *"data than checkpoint"* && "$out" != *"data settings"* ]] || fail "a resume with the same data settings: $out"

# ---- the metrics file is cut back to the checkpoint's step, then appended to
out=$("$epx" train "${small[@]}" --steps 4 --resume ck/step-000002 --metrics m.jsonl 2>&1)
code=$?
if [[ $code -ne 0 ]]; then
  fail "resume from step-000002: exit $code: $out"
else
  [[ "$(steps_of m.jsonl)" == "0 1 2 3 " ]] || fail "after the resume from step 2 the metrics hold steps $(steps_of m.jsonl), want 0 1 2 3"
  [[ "$out" == *"m.jsonl: cut back to the steps before the checkpoint's step 2 (2 records kept; the 2 records of steps 2 to 3"* ]] ||
    fail "the cut is not reported: $out"
  grep -q '^{"step":2,.*"resumed_from":2' m.jsonl || fail "the first record after the resume does not say resumed_from 2"
  diff <(head -n 2 m.jsonl) <(head -n 2 ref.jsonl) > /dev/null || fail "the records before the checkpoint changed"
  echo "ok   the metrics file is cut back to steps 0, 1 and the resumed steps 2, 3 appended once"
fi
# ... and the report says the run was resumed
out=$("$epx" report m.jsonl -o r.html 2>&1)
[[ $? -eq 0 && "$out" == *"from 4 steps"* && "$out" == *"resumed from the checkpoint of step 2"* ]] ||
  fail "report of the resumed run: $out"
grep -q "from the checkpoint of step 2" r.html || fail "the report page does not say the run was resumed"

# ---- a file of an older epx holding steps 2, 3 twice: the report counts them once
cat ref.jsonl > dup.jsonl
sed -n '3,4p' ref.jsonl >> dup.jsonl
out=$("$epx" report dup.jsonl -o d.html --json 2>&1)
if [[ $? -ne 0 || "$out" != *'"steps":4'* || "$out" != *'"resumes":[{"replaced":2,"step":2}]'* ]]; then
  fail "report of a file with steps 2, 3 twice: $out"
else
  echo "ok   report of a file with steps 2, 3 twice: 4 steps, resumed at step 2 (2 records replaced)"
fi

# ---- --resume with a metrics file that epx did not write: refused, untouched
echo "my notes" > notes.txt
refused "notes.txt:1: " --steps 6 --resume ck --metrics notes.txt

if [[ $failures -ne 0 ]]; then
  echo "$failures resume checks failed"
  exit 1
fi
echo "all resume checks passed"
