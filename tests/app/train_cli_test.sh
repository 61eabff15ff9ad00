#!/usr/bin/env bash
# epx train's command line: bad settings fail with exit code 2, a message
# naming the key or value, and no file written; a small run and a resume work.
# Usage: train_cli_test.sh EPX_BINARY DATA_DIR
set -uo pipefail
epx=$1
data=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0

# expect_usage_error DESCRIPTION EXPECTED_TEXT ARGS...
expect_usage_error() {
  local what=$1 expected=$2
  shift 2
  local out code
  out=$("$epx" train --metrics "$work/metrics.jsonl" --save "$work/ckpt" "$@" 2>&1)
  code=$?
  if [[ $code -ne 2 ]]; then
    echo "FAIL $what: exit code $code, want 2; output: $out"; failures=$((failures + 1)); return
  fi
  if [[ "$out" != *"$expected"* ]]; then
    echo "FAIL $what: output lacks '$expected': $out"; failures=$((failures + 1)); return
  fi
  if [[ -e "$work/metrics.jsonl" || -e "$work/ckpt" ]]; then
    echo "FAIL $what: a file was written"; failures=$((failures + 1)); rm -rf "$work/metrics.jsonl" "$work/ckpt"; return
  fi
  echo "ok   $what: $out"
}

expect_usage_error "unknown key" "unknown key 'model.expertz'" --config "$data/bad_key.toml"
expect_usage_error "topk above experts" "topk = 8" --config "$data/bad_topk.toml"
expect_usage_error "toml syntax" "bad_syntax.toml:2" --config "$data/bad_syntax.toml"
expect_usage_error "missing config file" "$work/none.toml" --config "$work/none.toml"
expect_usage_error "negative learning rate" "learning rate -0.1" --lr -0.1
expect_usage_error "missing text file" "$work/none.txt" --data "text:$work/none.txt"
expect_usage_error "unknown balancing" "unknown balancing 'magic'" --balance magic
expect_usage_error "experts not a multiple of ranks" "experts = 16 must be a multiple of ranks = 3" --ranks 3
expect_usage_error "eplb slots not a multiple of ranks" "eplb_slots = 18 must be a multiple of ranks = 4" \
  --balance bias+eplb --eplb-slots 18
expect_usage_error "eplb slots below experts" "eplb_slots = 12 is below experts = 16" --balance eplb --eplb-slots 12
expect_usage_error "grad overlap neither on nor off" "--grad-overlap" --grad-overlap maybe

# A small run with metrics, a trace and a checkpoint, then a resume.
small=(--batch-tokens 64 --hidden 32 --ffn-hidden 32 --experts 8 -q)
if ! "$epx" train "${small[@]}" --steps 6 --metrics "$work/m.jsonl" --trace "$work/t.json" --trace-steps 2 --save "$work/ck" \
     > "$work/out.txt" 2>&1; then
  echo "FAIL small run:"; cat "$work/out.txt"; failures=$((failures + 1))
else
  lines=$(wc -l < "$work/m.jsonl")
  [[ $lines -eq 6 ]] || { echo "FAIL metrics has $lines lines, want 6"; failures=$((failures + 1)); }
  grep -q '"max_vio"' "$work/m.jsonl" || { echo "FAIL metrics lack max_vio"; failures=$((failures + 1)); }
  grep -q '"grad_wait"' "$work/m.jsonl" || { echo "FAIL metrics lack grad_wait"; failures=$((failures + 1)); }
  grep -q '"traceEvents"' "$work/t.json" || { echo "FAIL trace has no traceEvents"; failures=$((failures + 1)); }
  grep -q '"dispatch"' "$work/t.json" || { echo "FAIL trace has no dispatch span"; failures=$((failures + 1)); }
  [[ "$(cat "$work/ck/latest")" == step-000006 && -f "$work/ck/step-000006/meta.json" && -f "$work/ck/step-000006/experts-3.bin" ]] ||
    { echo "FAIL checkpoint incomplete"; failures=$((failures + 1)); }
  grep -q "final loss" "$work/out.txt" || { echo "FAIL no summary table"; failures=$((failures + 1)); }
  echo "ok   small run: 6 metrics lines, trace, checkpoint, summary"
  if ! "$epx" train "${small[@]}" --steps 8 --resume "$work/ck" --metrics "$work/m.jsonl" > "$work/out2.txt" 2>&1; then
    echo "FAIL resume:"; cat "$work/out2.txt"; failures=$((failures + 1))
  else
    lines=$(wc -l < "$work/m.jsonl")
    [[ $lines -eq 8 ]] || { echo "FAIL resumed metrics has $lines lines, want 8 (6 + 2 appended)"; failures=$((failures + 1)); }
    echo "ok   resume: 2 more steps appended"
    cp "$work/m.jsonl" "$work/m.before"
    out=$("$epx" train "${small[@]}" --ranks 2 --steps 8 --resume "$work/ck" --metrics "$work/m.jsonl" 2>&1)
    code=$?
    # Another layout reshards (docs/errors.md, Checkpoints); the metrics file is cut back to the
    # checkpoint's 6 steps and the 2 steps after it written anew.
    if [[ $code -ne 0 || "$out" != *"resharding checkpoint $work/ck (step 6) written by 4 ranks"*"onto 2 ranks"* ]]; then
      echo "FAIL resume with other ranks: exit $code: $out"; failures=$((failures + 1))
    elif [[ $(wc -l < "$work/m.jsonl") -ne 8 ]]; then
      echo "FAIL resume with other ranks: metrics has $(wc -l < "$work/m.jsonl") lines, want 8"; failures=$((failures + 1))
    else
      echo "ok   resume with other ranks reshards: ${out%%$'\n'*}"
    fi
  fi
fi

# EPLB: a re-placement after steps 2 and 4 (1-based; none after the last) shows in the metrics.
if ! "$epx" train "${small[@]}" --steps 6 --balance bias+eplb --eplb-every 2 --metrics "$work/e.jsonl" \
     > "$work/out3.txt" 2>&1; then
  echo "FAIL eplb run:"; cat "$work/out3.txt"; failures=$((failures + 1))
else
  replaced=$(grep -c '"eplb":{"balance_before"' "$work/e.jsonl")
  [[ $replaced -eq 2 ]] || { echo "FAIL eplb metrics show $replaced re-placements, want 2"; failures=$((failures + 1)); }
  echo "ok   eplb run: 2 re-placements in the metrics"
fi

if (( failures > 0 )); then
  echo "$failures check(s) failed"
  exit 1
fi
echo "all epx train command-line checks passed"
