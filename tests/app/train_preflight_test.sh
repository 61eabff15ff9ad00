#!/usr/bin/env bash
# epx train's preflight: settings, memory and output paths are checked before
# step 1. Each case checks the exit code, the message, and that nothing was
# left behind; --dry-run checks everything and writes nothing.
# Usage: train_preflight_test.sh EPX_BINARY DATA_DIR
set -uo pipefail
epx=$1
data=$2
work=$(mktemp -d)
mounted=""
cleanup() {
  [[ -n "$mounted" ]] && umount "$mounted" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
failures=0
fail() { echo "FAIL $*"; failures=$((failures + 1)); }

# expect WHAT CODE TEXT ARGS...: exit code CODE, output containing TEXT, and
# no file left in $work/out (the folder the outputs point into).
expect() {
  local what=$1 want=$2 text=$3
  shift 3
  rm -rf "$work/out" && mkdir -p "$work/out"
  local out code
  out=$(timeout 60 "$epx" train --steps 3 "$@" 2>&1)
  code=$?
  if [[ $code -ne $want ]]; then fail "$what: exit code $code, want $want; output: $out"; return; fi
  if [[ "$out" != *"$text"* ]]; then fail "$what: output lacks '$text': $out"; return; fi
  if [[ $want -ne 0 && -n "$(ls -A "$work/out")" ]]; then fail "$what: left files: $(ls -A "$work/out")"; return; fi
  echo "ok   $what: $(printf '%s' "$out" | tail -n 1)"
}

touch "$work/a_file"
expect "memory: 10^9 experts refused before step 1" 2 "experts = 1000000000 needs" \
  --config "$data/huge_experts.toml" --metrics "$work/out/m.jsonl"
expect "memory: the refusal says what is available" 2 "is available" --config "$data/huge_experts.toml"
expect "batch_tokens above its limit" 2 "run.batch_tokens = 99999999999 is above the limit 16777216" \
  --config "$data/huge_batch.toml"
expect "negative hidden: its real minimum" 2 "model.hidden = -5 must be at least 1" --config "$data/negative_hidden.toml"
expect "--config naming a directory" 2 "the --config file '$data' is a directory, not a regular file" --config "$data"
expect "--metrics under a regular file" 2 "--metrics $work/a_file/m.jsonl: cannot" --metrics "$work/a_file/m.jsonl"
expect "--metrics in a missing folder" 2 "--metrics $work/out/none/m.jsonl: cannot create a file in" \
  --metrics "$work/out/none/m.jsonl"
expect "--metrics naming a directory" 2 "--metrics $work/out: cannot write" --metrics "$work/out"
expect "--trace under a regular file" 2 "--trace $work/a_file/t.json: cannot" --trace "$work/a_file/t.json"
expect "--dry-run passes and writes nothing" 0 "dry run: every check passed; nothing was written" \
  --dry-run --metrics "$work/out/m.jsonl" --trace "$work/out/t.json"
expect "--dry-run prints the estimate per component" 0 "expert AdamW moments" --dry-run
expect "--dry-run of a configuration that cannot fit" 2 "experts = 1000000000 needs" --dry-run \
  --config "$data/huge_experts.toml"

# --metrics -: stdout holds the JSON lines and nothing else.
out=$("$epx" train --steps 3 --metrics - 2>"$work/stderr")
code=$?
lines=$(printf '%s\n' "$out" | grep -c .)
if [[ $code -ne 0 ]]; then fail "--metrics -: exit $code"
elif [[ $lines -ne 3 ]] || printf '%s\n' "$out" | grep -qv '^{"step":.*}$'; then fail "--metrics -: stdout is not 3 JSON lines: $out"
elif ! grep -q "final loss" "$work/stderr"; then fail "--metrics -: the summary is not on stderr"
else echo "ok   --metrics -: 3 JSON lines on stdout, the summary on stderr"; fi

# A read-only file system (root ignores permissions, not a read-only mount).
if mkdir -p "$work/ro" && mount -t tmpfs -o ro,size=64k tmpfs "$work/ro" 2>/dev/null; then
  mounted="$work/ro"
  expect "--metrics on a read-only file system" 2 "Read-only file system" --metrics "$work/ro/m.jsonl"
  expect "--trace on a read-only file system" 2 "Read-only file system" --trace "$work/ro/t.json"
  umount "$work/ro" && mounted=""
else
  echo "skip read-only file system cases: cannot mount a tmpfs here (needs root)"
fi

if [[ $failures -ne 0 ]]; then echo "$failures case(s) failed"; exit 1; fi
echo "all preflight cases passed"
