#!/usr/bin/env bash
# Every file the user names is read only if it is a regular file of a sane
# size: a device (/dev/zero), a FIFO, a directory or an oversized (sparse)
# file is refused at once with exit 2 and a message naming the path and what
# it is (or its size and the limit); nothing blocks on a FIFO (each case runs
# under `timeout`), nothing reads without end, and under a 2 GiB address-space
# limit nothing aborts with an uncaught std::bad_alloc.
# Usage: input_files_test.sh EPX_BINARY REPO_ROOT [sanitized]
#   sanitized: the binary runs under a sanitizer, whose runtime cannot run under
#   `ulimit -v`; those cases are left out.
set -uo pipefail
epx=$1
root=$2
sanitized=${3:-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
fail() { echo "FAIL $*"; failures=$((failures + 1)); }

# expect WHAT CODE REGEX ARGS...: exit code CODE within 30 s, output matching REGEX (grep -E).
expect() {
  local what=$1 want=$2 regex=$3
  shift 3
  local out code
  out=$(timeout 30 "$epx" "$@" 2>&1 </dev/null)
  code=$?
  if [[ $code -ne $want ]]; then fail "$what: exit code $code, want $want; output: ${out:0:400}"; return; fi
  if ! printf '%s' "$out" | grep -Eq -- "$regex"; then fail "$what: output does not match '$regex': ${out:0:400}"; return; fi
  echo "ok   $what: $(printf '%s' "$out" | tail -n 1)"
}

not_regular="is a character device, not a regular file"
fifo_msg="is a FIFO \(named pipe\), not a regular file"
dir_msg="is a directory, not a regular file"
mkfifo "$work/fifo"
mkdir "$work/dir"
truncate -s 17M "$work/big.toml"
truncate -s 65M "$work/big_loads.txt"
truncate -s 5G "$work/big_trace.jsonl"
truncate -s 17G "$work/big_text.txt"
loads=$root/tests/balance/data/loads16.txt
placement=$root/tests/balance/data/placement16.txt
eplb=(eplb --loads "$loads" --slots 24 --nodes 2 --ranks-per-node 2 --groups 4)
scenario=$root/configs/sim/template.toml
trace=(--set routing.distribution=trace --set)

# epx train --config
expect "--config /dev/zero" 2 "epx train: the --config file '/dev/zero' $not_regular" train --config /dev/zero --steps 1
expect "--config FIFO" 2 "the --config file '$work/fifo' $fifo_msg" train --config "$work/fifo" --steps 1
expect "--config directory" 2 "the --config file '$work/dir' $dir_msg" train --config "$work/dir" --steps 1
expect "--config oversized" 2 \
  "the --config file '$work/big.toml' is 17 MiB \(17825792 bytes\), above the limit of 16 MiB \(16777216 bytes\)" \
  train --config "$work/big.toml" --steps 1
# epx train --data text:
expect "--data text:/dev/zero" 2 "epx train: text file '/dev/zero' $not_regular" train --data text:/dev/zero --steps 1
expect "--data text:FIFO" 2 "text file '$work/fifo' $fifo_msg" train --data "text:$work/fifo" --steps 1
expect "--data text:directory" 2 "text file '$work/dir' $dir_msg" train --data "text:$work/dir" --steps 1
expect "--data text: oversized" 2 "text file '$work/big_text.txt' is 17 GiB \(18253611008 bytes\), above the limit of 16 GiB" \
  train --data "text:$work/big_text.txt" --steps 1
# epx train --resume: a checkpoint whose files are a FIFO or a device
mkdir -p "$work/ck_fifo" "$work/ck_dev"
mkfifo "$work/ck_fifo/meta.json"
ln -s /dev/zero "$work/ck_dev/meta.json"
expect "--resume with meta.json a FIFO" 2 "the checkpoint file '$work/ck_fifo/meta.json' $fifo_msg" \
  train --resume "$work/ck_fifo" --steps 1
expect "--resume with meta.json /dev/zero" 2 "the checkpoint file '$work/ck_dev/meta.json' $not_regular" \
  train --resume "$work/ck_dev" --steps 1
mkdir -p "$work/ck_latest"
mkfifo "$work/ck_latest/latest"
expect "--resume with 'latest' a FIFO" 2 "the checkpoint file '$work/ck_latest/latest' $fifo_msg" \
  train --resume "$work/ck_latest" --steps 1
# A real checkpoint with one of its expert files replaced by a FIFO.
if timeout 120 "$epx" train --steps 1 --save "$work/ck_real" -q >/dev/null 2>&1; then
  part=$(ls -d "$work"/ck_real/step-*/experts-0.bin | head -1)
  rm -f "$part" && mkfifo "$part"
  expect "--resume with an expert file a FIFO" 2 "the checkpoint file '$part' $fifo_msg" \
    train --resume "$work/ck_real" --steps 2
else
  fail "--resume with an expert file a FIFO: the run that saves the checkpoint failed"
fi

# epx eplb --loads and --current
expect "--loads /dev/zero" 2 "epx eplb: the --loads file '/dev/zero' $not_regular" \
  eplb --loads /dev/zero --slots 24 --nodes 2 --ranks-per-node 2
expect "--loads FIFO" 2 "the --loads file '$work/fifo' $fifo_msg" eplb --loads "$work/fifo" --slots 24 --nodes 2 --ranks-per-node 2
expect "--loads directory" 2 "the --loads file '$work/dir' $dir_msg" eplb --loads "$work/dir" --slots 24 --nodes 2 --ranks-per-node 2
expect "--loads oversized" 2 "the --loads file '$work/big_loads.txt' is 65 MiB \(68157440 bytes\), above the limit of 64 MiB" \
  eplb --loads "$work/big_loads.txt" --slots 24 --nodes 2 --ranks-per-node 2
expect "--current /dev/zero" 2 "the --current file '/dev/zero' $not_regular" "${eplb[@]}" --current /dev/zero
expect "--current FIFO" 2 "the --current file '$work/fifo' $fifo_msg" "${eplb[@]}" --current "$work/fifo"
expect "--current directory" 2 "the --current file '$work/dir' $dir_msg" "${eplb[@]}" --current "$work/dir"
expect "--current oversized" 2 "the --current file '$work/big_loads.txt' is 65 MiB \(68157440 bytes\)" "${eplb[@]}" --current "$work/big_loads.txt"
expect "--current still reads a placement" 0 "moved: rebalance 0 of 24 slots" "${eplb[@]}" --current "$placement"

# epx sim: the scenario file and routing.trace inside it
expect "sim scenario /dev/zero" 2 "epx sim: the scenario file '/dev/zero' $not_regular" sim run /dev/zero
expect "sim scenario FIFO" 2 "the scenario file '$work/fifo' $fifo_msg" sim run "$work/fifo"
expect "sim scenario oversized" 2 "the scenario file '$work/big.toml' is 17 MiB \(17825792 bytes\)" sim run "$work/big.toml"
expect "routing.trace /dev/zero" 2 "epx sim: routing.trace '/dev/zero' $not_regular" \
  sim run "$scenario" --steps 1 "${trace[@]}" routing.trace=/dev/zero
expect "routing.trace FIFO" 2 "routing.trace '$work/fifo' $fifo_msg" sim run "$scenario" --steps 1 "${trace[@]}" routing.trace="$work/fifo"
expect "routing.trace directory" 2 "routing.trace '$work/dir' $dir_msg" sim run "$scenario" --steps 1 "${trace[@]}" routing.trace="$work/dir"
expect "routing.trace oversized" 2 "routing.trace '$work/big_trace.jsonl' is 5.0 GiB \(5368709120 bytes\), above the limit of 4.0 GiB" \
  sim run "$scenario" --steps 1 "${trace[@]}" routing.trace="$work/big_trace.jsonl"
# A scenario file naming the trace, as the issue's user wrote it.
{ cat "$scenario"; printf '\n'; } | sed 's/^distribution = .*/distribution = "trace"/' >"$work/s.toml"
if grep -q '^trace = ' "$work/s.toml"; then sed -i 's|^trace = .*|trace = "/dev/zero"|' "$work/s.toml"
else sed -i 's|^distribution = "trace"|distribution = "trace"\ntrace = "/dev/zero"|' "$work/s.toml"; fi
expect "routing.trace = \"/dev/zero\" in a scenario" 2 "routing.trace '/dev/zero' $not_regular" sim run "$work/s.toml" --steps 1

# epx report and epx monitor: the metrics file and the alert rules
expect "report FIFO" 2 "the metrics file '$work/fifo' $fifo_msg" report "$work/fifo" -o "$work/r.html"
expect "report /dev/zero" 2 "the metrics file '/dev/zero' $not_regular" report /dev/zero -o "$work/r.html"
expect "monitor FIFO" 2 "the metrics file '$work/fifo' $fifo_msg" monitor --plain "$work/fifo"
expect "monitor directory" 2 "the metrics file '$work/dir' $dir_msg" monitor --plain "$work/dir"
printf '{"step":1}\n' >"$work/m.jsonl"
expect "monitor --alerts FIFO" 2 "the alert rule file '$work/fifo' $fifo_msg" monitor --plain --alerts "$work/fifo" "$work/m.jsonl"
expect "monitor --alerts /dev/zero" 2 "the alert rule file '/dev/zero' $not_regular" monitor --plain --alerts /dev/zero "$work/m.jsonl"
[[ ! -e "$work/r.html" ]] || fail "report: an HTML file was written for a refused input"

# Under a 2 GiB address-space limit: refused with exit 2, never exit 134 (an
# uncaught std::bad_alloc), for a device and for a regular file larger than
# the memory the process may have.
if [[ $sanitized != sanitized ]]; then
  truncate -s 3G "$work/text3g.txt"
  out=$( (ulimit -v 2097152; timeout 60 "$epx" train --data text:/dev/zero --steps 1) 2>&1)
  code=$?
  if [[ $code -ne 2 || $out != *"text file '/dev/zero' is a character device"* ]]; then
    fail "ulimit -v 2 GiB, --data text:/dev/zero: exit $code, want 2; output: ${out:0:400}"
  else echo "ok   ulimit -v 2 GiB, --data text:/dev/zero: $(printf '%s' "$out" | tail -n 1)"; fi
  out=$( (ulimit -v 2097152; timeout 60 "$epx" train --data "text:$work/text3g.txt" --steps 1) 2>&1)
  code=$?
  if [[ $code -ne 2 || $out != *"text file '$work/text3g.txt' is 3.0 GiB (3221225472 bytes); reading it needs that much memory but"* ]]; then
    fail "ulimit -v 2 GiB, a 3 GiB text file: exit $code, want 2; output: ${out:0:400}"
  else echo "ok   ulimit -v 2 GiB, a 3 GiB text file: $(printf '%s' "$out" | tail -n 1)"; fi
  # The last resort: an allocation no check foresaw (60 MiB of loads parse
  # into 240 MiB of doubles) ends the command with exit 1 and a message.
  yes 1 | head -c 62914560 >"$work/loads60m.txt"
  out=$( (ulimit -v 400000; timeout 60 "$epx" eplb --loads "$work/loads60m.txt" --slots 24 --nodes 2 --ranks-per-node 2) 2>&1)
  code=$?
  if [[ $code -ne 1 || $out != *"epx eplb: out of memory while running the command (an allocation failed); stopped"* ]]; then
    fail "ulimit -v 400 MB, 60 MiB of loads: exit $code, want 1; output: ${out:0:400}"
  else echo "ok   ulimit -v 400 MB, 60 MiB of loads: $(printf '%s' "$out" | tail -n 1)"; fi
fi

if (( failures > 0 )); then
  echo "$failures input-file checks failed"
  exit 1
fi
echo "all input-file checks passed"
