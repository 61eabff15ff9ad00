#!/usr/bin/env bash
# Asynchronous checkpoints (epx train --async-save): the files are those of a
# synchronous save, byte for byte (every step folder's dense.bin and expert
# files), the losses are the same, a resume from an asynchronous checkpoint
# continues the uninterrupted run's losses, and --async-save without
# --save-every is refused before anything runs.
# Usage: train_async_save_test.sh EPX_BINARY
set -uo pipefail
epx=$(realpath "$1")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "train_async_save_test: FAIL: $*"; exit 1; }
small=(--batch-tokens 64 --hidden 32 --ffn-hidden 32 --experts 8 --ranks 4 -q)
losses() { grep -o '"step":[0-9]*,"loss":[^,]*' "$1"; }

"$epx" train "${small[@]}" --steps 8 --save-every 2 --keep 10 --save "$work/sync" --metrics "$work/sync.jsonl" \
  >/dev/null || fail "the synchronous run exited with $?"
"$epx" train "${small[@]}" --steps 8 --save-every 2 --keep 10 --async-save --save "$work/async" \
  --metrics "$work/async.jsonl" >/dev/null || fail "the asynchronous run exited with $?"
[[ "$(losses "$work/sync.jsonl")" == "$(losses "$work/async.jsonl")" ]] || fail "the losses differ"
for step in 2 4 6 8; do
  folder=$(printf 'step-%06d' "$step")
  [[ -d "$work/async/$folder" ]] || fail "no $folder from the asynchronous run: $(ls -A "$work/async")"
  for file in "$work/sync/$folder"/*.bin; do
    cmp -s "$file" "$work/async/$folder/${file##*/}" || fail "$folder/${file##*/} differs from the synchronous save's"
  done
done
[[ -z "$(ls -A "$work/async" | grep '\.tmp$')" ]] || fail "a temporary folder was left: $(ls -A "$work/async")"

"$epx" train "${small[@]}" --steps 8 --resume "$work/async/step-000004" --metrics "$work/resumed.jsonl" \
  >/dev/null || fail "the resume exited with $?"
[[ "$(losses "$work/resumed.jsonl")" == "$(losses "$work/sync.jsonl" | tail -n 4)" ]] ||
  fail "the resumed losses differ from the uninterrupted run's steps 4-7"

out=$("$epx" train "${small[@]}" --steps 2 --async-save --save "$work/none" 2>&1)
code=$?
[[ $code == 2 && "$out" == *"save_every = 0"* ]] || fail "--async-save without --save-every: exit $code: $out"
[[ ! -e "$work/none" ]] || fail "--async-save without --save-every wrote $work/none"
echo "train_async_save_test: the same files and losses as synchronous saves; the resume continues the curve"
