#!/usr/bin/env bash
# The checkpoint fault table (docs/errors.md, Checkpoints), on tiny in-process
# runs: each case checks the exit code, the message, and that nothing was
# touched or run (no metrics line written, the user's files byte-equal).
#   --save onto a file, a foreign folder, a path under a file, '.';
#   --keep; resume from `latest` and from a named step folder;
#   each corruption of a checkpoint (bit flip, bytes appended or cut, swapped
#   or missing expert files, edited or foreign meta.json, an older format,
#   another model); another rank count resumes, saying it reshards;
#   kill -9 during a save, then a resume: the same losses as an uninterrupted run;
#   a full disk during a save (a small tmpfs), too little space before step 1,
#   a read-only --save location (tmpfs -o ro). Mounts need root: skipped with
#   a printed reason otherwise.
# Uses the test hook EPX_TEST_CHECKPOINT_DELAY_MS (a pause between writing a
# checkpoint's files and publishing it) to hit the save window.
# Usage: checkpoint_faults_test.sh EPX_BINARY
set -uo pipefail
epx=$(realpath "$1")
work=$(mktemp -d)
mounts=()
job=
cleanup() {
  [[ -n "$job" ]] && kill -9 "$job" 2>/dev/null
  for m in "${mounts[@]}"; do umount "$m" 2>/dev/null; done
  rm -rf "$work"
}
trap cleanup EXIT
failures=0
last_out=
fail() { echo "FAIL $*"; failures=$((failures + 1)); }
small=(--batch-tokens 64 --hidden 32 --ffn-hidden 32 --experts 8 -q)

# expect DESCRIPTION EXIT TEXT ARGS...: `epx train` exits EXIT and prints TEXT;
# with exit 2, no step ran (no metrics line).
expect() {
  local what=$1 want=$2 text=$3
  shift 3
  rm -f "$work/m.jsonl"
  local out code
  out=$("$epx" train "${small[@]}" --metrics "$work/m.jsonl" "$@" 2>&1)
  code=$?
  if [[ $code -ne $want ]]; then fail "$what: exit $code, want $want: $out"; return 1; fi
  if [[ "$out" != *"$text"* ]]; then fail "$what: output lacks '$text': $out"; return 1; fi
  if [[ $want -eq 2 && -s "$work/m.jsonl" ]]; then fail "$what: a step ran"; return 1; fi
  echo "ok   $what: ${out//$'\n'/ | }"
  last_out=$out
}
losses() { grep -o '"step":[0-9]*,"loss":[^,]*' "$1"; }

# ---- --save never destroys what epx did not write
echo "keep me" > "$work/notes.txt"
cp "$work/notes.txt" "$work/notes.orig"
expect "--save onto a file" 2 "is an existing file" --steps 1 --save "$work/notes.txt" &&
  { cmp -s "$work/notes.txt" "$work/notes.orig" || fail "--save onto a file changed it"; }
mkdir "$work/project" && echo "thesis" > "$work/project/thesis.tex"
expect "--save onto a foreign folder" 2 "holds other files (e.g. 'thesis.tex')" --steps 1 --save "$work/project" &&
  { [[ "$(ls -A "$work/project")" == thesis.tex && "$(cat "$work/project/thesis.tex")" == thesis ]] ||
      fail "--save onto a foreign folder touched it: $(ls -A "$work/project")"; }
expect "--save under a file" 2 "notes.txt exists and is not a folder" --steps 1 --save "$work/notes.txt/ck"
cd "$work/project" || exit 1
expect "--save . in a foreign folder" 2 "--save . is a folder that holds other files" --steps 1 --save .
mkdir "$work/dot"
cd "$work/dot" || exit 1
expect "--save . in an empty folder" 0 "final loss" --steps 1 --save .
cd "$work" || exit 1
[[ "$(ls -A "$work/dot")" == $'.epx-checkpoints\nlatest\nstep-000001' ]] ||
  fail "--save . left: $(ls -A "$work/dot")"
[[ -z "$(ls -A "$work" | grep tmp)" ]] || fail "a temporary folder was left in $work: $(ls -A "$work")"

# ---- --keep, resume from latest and from a named step
expect "run with --save-every 2 --keep 2" 0 "final loss" --steps 6 --save-every 2 --keep 2 --save "$work/ck"
cp "$work/m.jsonl" "$work/ref6.jsonl"
[[ "$(ls -A "$work/ck" | tr '\n' ' ')" == ".epx-checkpoints latest step-000004 step-000006 " ]] ||
  fail "--keep 2 left: $(ls -A "$work/ck")"
[[ "$(cat "$work/ck/latest")" == step-000006 ]] || fail "latest is '$(cat "$work/ck/latest")'"
expect "resume from latest" 0 "final loss" --steps 8 --resume "$work/ck"
[[ $(wc -l < "$work/m.jsonl") -eq 2 ]] || fail "resume from latest ran $(wc -l < "$work/m.jsonl") steps, want 2"
expect "resume from a named step" 0 "final loss" --steps 8 --resume "$work/ck/step-000004"
[[ $(wc -l < "$work/m.jsonl") -eq 4 ]] || fail "resume from step-000004 ran $(wc -l < "$work/m.jsonl") steps, want 4"
diff <(losses "$work/m.jsonl" | head -n 2) <(losses "$work/ref6.jsonl" | tail -n 2) > /dev/null ||
  fail "resume from step-000004: steps 4, 5 differ from the uninterrupted run"

# ---- corruptions: a fresh copy of the checkpoint for each
"$epx" train "${small[@]}" --steps 6 --seed 7 --save "$work/other" > /dev/null 2>&1 || fail "the second checkpoint"
fresh() { rm -rf "$work/c"; cp -r "$work/ck" "$work/c"; c="$work/c/step-000006"; }
flip_bit() {  # FILE OFFSET
  local b
  b=$(od -An -tu1 -j "$2" -N1 "$1" | tr -d ' ')
  printf "\\x$(printf %02x $((b ^ 1)))" | dd of="$1" bs=1 seek="$2" conv=notrunc status=none
}
fresh; flip_bit "$c/experts-2.bin" 5000
expect "flipped bit" 2 "experts-2.bin: the payload's checksum is" --steps 8 --resume "$work/c"
fresh; printf '\0' >> "$c/experts-1.bin"
expect "appended byte" 2 "bytes; meta.json lists" --steps 8 --resume "$work/c"
fresh; truncate -s -1 "$c/dense.bin"
expect "missing byte" 2 "(bytes appended or cut)" --steps 8 --resume "$work/c"
fresh; mv "$c/experts-0.bin" "$c/x"; mv "$c/experts-1.bin" "$c/experts-0.bin"; mv "$c/x" "$c/experts-1.bin"
expect "swapped expert files" 2 "experts-0.bin holds the part of experts-1.bin, not of experts-0.bin" \
  --steps 8 --resume "$work/c"
fresh; rm "$c/experts-3.bin"
expect "missing expert file" 2 "has no experts-3.bin" --steps 8 --resume "$work/c"
fresh; sed -i 's/"version": 3/"version": 2/' "$c/meta.json"
expect "an older format" 2 "checkpoint format version 2; this epx reads 3 (format 3 stores experts in logical order" \
  --steps 8 --resume "$work/c"
fresh; sed -i 's/"step": 6/"step": 4/' "$c/meta.json"
expect "edited meta.json step" 2 "meta.json: its content hashes to" --steps 8 --resume "$work/c"
fresh; cp "$work/other/step-000006/meta.json" "$c/meta.json"
expect "foreign meta.json" 2 "(a file of another checkpoint?)" --steps 8 --resume "$work/c"
fresh
expect "another model" 2 "is of another model: topk=2 in the checkpoint, topk=1 in this run" \
  --steps 8 --resume "$work/c" --topk 1
expect "another rank count reshards" 0 "resharding checkpoint $work/c (step 6) written by 4 ranks on 1 node (EP 4, 8 slots per layer) onto 2 ranks on 1 node (EP 2, 8 slots per layer)" \
  --steps 8 --resume "$work/c" --ranks 2
[[ $(wc -l < "$work/m.jsonl") -eq 2 ]] || fail "resume at 2 ranks ran $(wc -l < "$work/m.jsonl") steps, want 2"
expect "8 ranks on 2 nodes, EP 4, with eplb reshards" 0 "onto 8 ranks on 2 nodes (EP 4, 12 slots per layer, eplb)" \
  --steps 8 --resume "$work/c" --ranks 8 --nodes 2 --ep 4 --balance eplb
expect "resume of nothing" 2 "no checkpoint at $work/none" --steps 8 --resume "$work/none"

# ---- kill -9 during a save, then resume: the losses of an uninterrupted run
"$epx" train "${small[@]}" --steps 8 --metrics "$work/ref.jsonl" > /dev/null 2>&1 || fail "the reference run"
EPX_TEST_CHECKPOINT_DELAY_MS=600 "$epx" train "${small[@]}" --steps 8 --save-every 2 --save "$work/k" \
  --metrics "$work/k.jsonl" > "$work/k.out" 2>&1 &
job=$!
for _ in $(seq 400); do [[ -f "$work/k/.step-000004.tmp/meta.json" ]] && break; sleep 0.025; done
if [[ ! -f "$work/k/.step-000004.tmp/meta.json" ]]; then
  fail "kill -9: the save of step 4 never showed: $(cat "$work/k.out")"
else
  kill -9 "$job"
  wait "$job" 2>/dev/null
  job=
  [[ "$(cat "$work/k/latest")" == step-000002 ]] || fail "kill -9: latest is '$(cat "$work/k/latest")', want step-000002"
  expect "resume after kill -9 during a save" 0 "final loss" --steps 8 --resume "$work/k" --save "$work/k"
  if diff <(losses "$work/m.jsonl") <(losses "$work/ref.jsonl" | tail -n 6) > "$work/diff"; then
    echo "ok   kill -9 + resume: steps 2..7 equal the uninterrupted run's losses"
  else
    fail "kill -9 + resume: the losses differ: $(head -n 4 "$work/diff")"
  fi
  [[ "$(ls -A "$work/k" | tr '\n' ' ')" == ".epx-checkpoints latest step-000002 step-000008 " ]] ||
    fail "kill -9 + resume left: $(ls -A "$work/k")"
fi

# ---- full disk, too little space, read-only location (root: tmpfs mounts)
kb=$(du -sk "$work/ck/step-000006" | cut -f1)
mkdir "$work/full" "$work/tiny" "$work/ro"
if ! mount -t tmpfs -o size=$((kb * 3 / 2))k tmpfs "$work/full" 2>/dev/null; then
  echo "skip full disk, too little space, read-only location: cannot mount a tmpfs (needs root)"
else
  mounts+=("$work/full")
  expect "full disk during the second save" 1 "the previous checkpoints are kept" \
    --steps 6 --save-every 2 --save "$work/full/ck"
  [[ "$last_out" == *"No space left on device"* && "$last_out" == *"step-000004"* ]] ||
    fail "full disk: the message does not say 'No space left on device' and step-000004"
  [[ "$last_out" == *"epx train: ResourceExhausted: rank "*": writing checkpoint step-000004 in "* ]] ||
    fail "full disk: the code is not ResourceExhausted, as docs/errors.md says: $last_out"
  [[ $(wc -l < "$work/m.jsonl") -eq 4 ]] || fail "full disk: $(wc -l < "$work/m.jsonl") steps ran, want 4 (stopped at the save)"
  [[ "$(ls -A "$work/full/ck" | tr '\n' ' ')" == ".epx-checkpoints latest step-000002 " ]] ||
    fail "full disk left: $(ls -A "$work/full/ck")"
  [[ "$(cat "$work/full/ck/latest")" == step-000002 ]] || fail "full disk: latest is '$(cat "$work/full/ck/latest")'"
  expect "the checkpoint before the full disk resumes" 0 "final loss" --steps 3 --resume "$work/full/ck"
  mkdir "$work/full_async"
  mount -t tmpfs -o size=$((kb * 3 / 2))k tmpfs "$work/full_async" && mounts+=("$work/full_async")
  expect "full disk during the second asynchronous save" 1 "the previous checkpoints are kept" \
    --steps 6 --save-every 2 --async-save --save "$work/full_async/ck"
  [[ "$last_out" == *"No space left on device"* && "$last_out" == *"step-000004"* ]] ||
    fail "full disk, asynchronous: the message does not say 'No space left on device' and step-000004"
  [[ "$(ls -A "$work/full_async/ck" | tr '\n' ' ')" == ".epx-checkpoints latest step-000002 " ]] ||
    fail "full disk, asynchronous, left: $(ls -A "$work/full_async/ck")"
  expect "the checkpoint before the asynchronous full disk resumes" 0 "final loss" --steps 3 \
    --resume "$work/full_async/ck"
  mount -t tmpfs -o size=64k tmpfs "$work/tiny" && mounts+=("$work/tiny")
  expect "too little space before step 1" 2 "one checkpoint needs about" --steps 2 --save "$work/tiny/ck"
  [[ -z "$(ls -A "$work/tiny")" ]] || fail "too little space: files were written: $(ls -A "$work/tiny")"
  mount -t tmpfs -o ro,size=1m tmpfs "$work/ro" && mounts+=("$work/ro")
  expect "read-only --save location" 2 "cannot create a file in $work/ro: Read-only file system" \
    --steps 2 --save "$work/ro/ck"
fi

if (( failures > 0 )); then
  echo "$failures check(s) failed"
  exit 1
fi
echo "all checkpoint fault checks passed"
