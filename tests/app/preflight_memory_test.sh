#!/usr/bin/env bash
# epx train's preflight cannot itself run out of memory: settings that size
# the model (eplb slots, shared experts, experts and groups, hidden) are
# refused by a range check or by the arithmetic estimate, under a 1 GiB
# address-space limit (ulimit -v), with exit 2 and the setting named. Before,
# the preflight built the eplb placement to size it (13.9 GB for 2^31 slots)
# and counted the router's groups one by one.
# Usage: preflight_memory_test.sh EPX_BINARY [sanitized]
# With `sanitized` (an ASan/UBSan/TSan build, whose runtime reserves far more
# address space than any such limit) the cases run without the limit: the
# messages and exit codes are still checked, the memory bound is not.
set -uo pipefail
epx=$1
sanitized=${2:-}
failures=0
fail() { echo "FAIL $*"; failures=$((failures + 1)); }

# expect WHAT CODE TEXT ARGS...: `epx train ARGS` under ulimit -v 1 GiB exits
# CODE and its output (stdout and stderr) contains TEXT.
expect() {
  local what=$1 want=$2 text=$3
  shift 3
  local out code
  out=$(if [[ -z "$sanitized" ]]; then ulimit -v $((1024 * 1024)) || exit 125; fi; timeout 60 "$epx" train "$@" 2>&1)
  code=$?
  if [[ $code -ne $want ]]; then fail "$what: exit code $code, want $want; output: $(tail -c 600 <<< "$out")"; return; fi
  if [[ "$out" != *"$text"* ]]; then fail "$what: output lacks '$text': $(tail -c 600 <<< "$out")"; return; fi
  echo "ok   $what: $(grep -F -- "$text" <<< "$out" | head -n 1)"
}

expect "2^31 eplb slots: the range check names eplb_slots" 2 \
  "eplb_slots = 2147483640 is above experts = 16 x ranks = 4 = 64" --balance eplb --eplb-slots 2147483640 --dry-run
expect "10^8 eplb slots (a run, not a dry run)" 2 "eplb_slots = 100000000 is above experts = 16 x ranks = 4 = 64" \
  --balance eplb --eplb-slots 100000000 --steps 1
expect "eplb slots written as 1e8" 2 "eplb_slots = 100000000 is above" --balance eplb --eplb-slots 1e8 --dry-run
expect "eplb slots within experts x ranks that cannot fit: the estimate names eplb_slots" 2 \
  "eplb_slots = 40000000 needs" --balance eplb --experts 10000000 --eplb-slots 40000000 --dry-run
expect "10^8 shared experts: the estimate names shared_experts" 2 "shared_experts = 100000000 needs" \
  --shared-experts 100000000 --dry-run
expect "2*10^9 experts in 2*10^9 groups: the router's check is arithmetic" 2 "experts = 2000000000 needs" \
  --experts 2000000000 --groups 2000000000 --topk 1 --dry-run
expect "hidden 10^9: the estimate names hidden" 2 "hidden = 1000000000 needs" --hidden 1000000000 --dry-run
expect "a setting that fits still passes under the limit" 0 "dry run: every check passed" --dry-run

if [[ $failures -ne 0 ]]; then echo "$failures case(s) failed"; exit 1; fi
echo "all preflight memory cases passed"
