#!/usr/bin/env bash
# What epx says and which code it exits with on odd input: a word where a
# number belongs, seeds outside their range, an empty strategy list, output
# that cannot be written (/dev/full), bad values in a config file (named with
# file and key), an empty or hardware-less scenario, raw control bytes in
# what is echoed back, and epx monitor on a file with no step (or none at all).
# Every case checks the exit code and the message.
# Usage: messages_test.sh EPX_BINARY SOURCE_DIR
set -uo pipefail
epx=$1
src=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
fail() { echo "FAIL $*"; failures=$((failures + 1)); }
small=(--steps 2 --batch-tokens 64 --hidden 32 --ffn-hidden 32 --experts 8 -q)

# expect WHAT CODE TEXT COMMAND...: COMMAND exits CODE and its output (stdout
# and stderr) contains TEXT.
expect() {
  local what=$1 want=$2 text=$3
  shift 3
  local out code
  out=$(timeout 60 "$@" 2>&1)
  code=$?
  if [[ $code -ne $want ]]; then fail "$what: exit code $code, want $want; output: $(tail -c 600 <<< "$out")"; return; fi
  if [[ "$out" != *"$text"* ]]; then fail "$what: output lacks '$text': $(tail -c 600 <<< "$out")"; return; fi
  echo "ok   $what"
}

# expect_full WHAT COMMAND...: COMMAND with stdout on /dev/full exits 1 and says so on stderr.
expect_full() {
  local what=$1
  shift
  local err code
  err=$(timeout 60 "$@" 2>&1 > /dev/full)
  code=$?
  if [[ $code -ne 1 ]]; then fail "$what: exit code $code, want 1; stderr: $(tail -c 600 <<< "$err")"; return; fi
  if [[ "$err" != *"cannot write the output"*"No space left on device"* ]]; then
    fail "$what: stderr does not say the output could not be written: $(tail -c 600 <<< "$err")"; return
  fi
  echo "ok   $what"
}

# ---- numbers on the command line
expect "--ranks four: not an integer" 2 "--ranks: 'four' is not an integer" "$epx" train --ranks four "${small[@]}"
expect "--ranks 2.5: not an integer" 2 "--ranks: '2.5' is not an integer" "$epx" train --ranks 2.5 "${small[@]}"
expect "--seed -1: outside the seed's range" 2 "--seed: Value -1 not in range 0 to 18446744073709551615" \
  "$epx" train --seed -1 "${small[@]}"
expect "--seed 1e23: outside the seed's range" 2 "--seed: Value 1e23 not in range 0 to 18446744073709551615" \
  "$epx" train --seed 1e23 "${small[@]}"
expect "demo --seed -1" 2 "--seed: Value -1 not in range 0 to" "$epx" demo --seed -1
expect "monitor --interval soon: not a number" 2 "--interval: 'soon' is not a number" "$epx" monitor --interval soon x.jsonl
expect "--compare-balancing ',,': no strategy" 2 "--compare-balancing ',,' names no strategy" \
  "$epx" train --compare-balancing ",," "${small[@]}"

# ---- output that cannot be written
expect_full "epx --help > /dev/full" "$epx" --help
expect_full "epx train > /dev/full" "$epx" train "${small[@]}"
expect_full "epx sim run > /dev/full" "$epx" sim run "$src/configs/sim/template.toml" --steps 1 -q
out=$(timeout 60 "$epx" train "${small[@]}" --metrics - 2>&1 > /dev/full)
code=$?
if [[ $code -ne 1 || "$out" != *"cannot write the metrics file '-': No space left on device"* ]]; then
  fail "epx train --metrics - > /dev/full: exit $code, want 1 naming the metrics: $out"
else echo "ok   epx train --metrics - > /dev/full"; fi
expect "epx train --metrics /dev/full" 1 "No space left on device" "$epx" train "${small[@]}" --metrics /dev/full

# ---- bad values in a config file name the file and the key
printf '[optim]\nlr = nan\n' > "$work/lr.toml"
expect "lr = nan in a config" 2 "$work/lr.toml: optim.lr = nan: learning rate nan must be finite and above 0" \
  "$epx" train --config "$work/lr.toml" "${small[@]}"
printf '[model]\ndtype = "f16"\n' > "$work/dtype.toml"
expect "dtype = 'f16' in a config" 2 "$work/dtype.toml: model.dtype = 'f16': dtype 'f16' is not f32 or bf16" \
  "$epx" train --config "$work/dtype.toml" "${small[@]}"
printf '[balance]\nstrategy = "eplbx"\n' > "$work/balance.toml"
expect "strategy = 'eplbx' in a config" 2 "$work/balance.toml: balance.strategy = 'eplbx': unknown balancing 'eplbx'" \
  "$epx" train --config "$work/balance.toml" "${small[@]}"
printf '[run]\ngrad_overlap = "maybe"\n' > "$work/overlap.toml"
expect "grad_overlap = 'maybe' in a config" 2 "run.grad_overlap = 'maybe': grad_overlap 'maybe' is not on or off" \
  "$epx" train --config "$work/overlap.toml" "${small[@]}"

# ---- scenarios without what a scenario needs
: > "$work/empty.toml"
expect "an empty scenario" 2 "empty.toml: the scenario is empty" "$epx" sim run "$work/empty.toml"
printf '[model]\nlayers = 2\n' > "$work/nohw.toml"
expect "a scenario without hardware" 2 "nohw.toml: hardware.profile is not set" "$epx" sim run "$work/nohw.toml"

# ---- raw control bytes are escaped wherever they are echoed
esc=$'\x1b'
# expect_escaped WHAT TEXT COMMAND...: exit 2, TEXT in the output, and no
# control byte in it but newline and tab.
expect_escaped() {
  local what=$1 text=$2
  shift 2
  local out code
  out=$(timeout 60 "$@" 2>&1)
  code=$?
  if [[ $code -ne 2 ]]; then fail "$what: exit code $code, want 2"; return; fi
  if LC_ALL=C grep -q '[[:cntrl:]]' <<< "$(tr -d '\n\t' <<< "$out")"; then
    fail "$what: a raw control byte reached the output: $(od -c <<< "$out" | head -n 5)"; return
  fi
  if [[ "$out" != *"$text"* ]]; then fail "$what: output lacks '$text': $out"; return; fi
  echo "ok   $what"
}
expect_escaped "a command word with an escape sequence" "'\\x1b[31mboom' is not a command" "$epx" "${esc}[31mboom"
expect_escaped "a flag value with an escape sequence" "--ranks: '\\x1b[2J' is not an integer" \
  "$epx" train --ranks "${esc}[2J"
printf '[model]\ndtype = "\\u001b[2J"\n' > "$work/esc.toml"
expect_escaped "a config string with an escape sequence" "dtype '\\x1b[2J' is not f32 or bf16" \
  "$epx" train --config "$work/esc.toml"
printf 'x = 1\n\x1b[2J\x01\xff\n' > "$work/binary.toml"
expect_escaped "a binary config file" "binary.toml" "$epx" train --config "$work/binary.toml"

# ---- epx monitor on a file with no step record, or none at all
: > "$work/empty.jsonl"
expect "monitor: an empty file" 2 "'$work/empty.jsonl' holds no complete step record" "$epx" monitor "$work/empty.jsonl"
expect "monitor --once: an empty file" 2 "holds no complete step record" \
  "$epx" monitor --once --alerts "$src/configs/monitor/alerts.toml" "$work/empty.jsonl"
expect "monitor: a file never created" 2 "cannot open the metrics file '$work/absent.jsonl'" \
  "$epx" monitor "$work/absent.jsonl"
expect "monitor --follow --idle-exit: a file that never appears" 1 \
  "'$work/absent.jsonl' did not appear within 0.5 s (--idle-exit)" \
  "$epx" monitor --follow --plain --interval 0.1 --idle-exit 0.5 "$work/absent.jsonl"
expect "monitor --follow --idle-exit: a file that stays empty" 1 "held no complete step record after 0.5 s" \
  "$epx" monitor --follow --plain --interval 0.1 --idle-exit 0.5 "$work/empty.jsonl"

if [[ $failures -ne 0 ]]; then echo "$failures case(s) failed"; exit 1; fi
echo "all message cases passed"
