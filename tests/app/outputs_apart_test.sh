#!/usr/bin/env bash
# Outputs never overwrite a command's own inputs or each other (docs/errors.md,
# Outputs apart from inputs): every command compares each output path with
# each input and each other output before it writes anything. Each case checks
# exit 2, the message naming both options and the path, and that every file
# keeps its bytes and mtime (a missing path stays missing).
# Usage: outputs_apart_test.sh EPX_BINARY SOURCE_DIR
set -uo pipefail
epx=$(realpath "$1")
src=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work" || exit 1
failures=0
fail() { echo "FAIL $*"; failures=$((failures + 1)); }
small=(--batch-tokens 64 --hidden 32 --ffn-hidden 32 --experts 8 -q)

# The state of every file under $work: path, size, mtime (ns) and checksum.
snapshot() { find "$work" -type f -printf '%P %s %T@\n' | sort; find "$work" -type f -exec sha256sum {} + | sort; }

# refused DESCRIPTION TEXT COMMAND...: exit 2, TEXT in the output, nothing under $work changed.
refused() {
  local what=$1 text=$2
  shift 2
  local before out code
  before=$(snapshot)
  out=$("$@" 2>&1)
  code=$?
  if [[ $code -ne 2 ]]; then fail "$what: exit $code, want 2: $out"; return; fi
  if [[ "$out" != *"$text"* ]]; then fail "$what: output lacks '$text': $out"; return; fi
  if [[ "$(snapshot)" != "$before" ]]; then fail "$what: files changed: $(diff <(echo "$before") <(snapshot))"; return; fi
  echo "ok   $what: ${out//$'\n'/ | }"
}

# Inputs: a metrics file, a checkpoint, loads, a placement, a scenario and its trace.
"$epx" train "${small[@]}" --steps 2 --metrics m.jsonl --save ck > /dev/null 2>&1 || fail "the setup run"
cp "$src/configs/train-tiny.toml" c.toml
printf '5 1 1 1\n' > loads.txt
"$epx" eplb --loads loads.txt --slots 4 --nodes 1 --ranks-per-node 2 --save placement.txt > /dev/null 2>&1 ||
  fail "the setup placement"
cp "$src/configs/sim/template.toml" s.toml
cp "$src/configs/sim/trace-counts-64e.csv" trace.csv
ln -s m.jsonl link.jsonl
ln m.jsonl hard.jsonl
echo "x" > notes.txt
echo "groups:" > rules.toml

# epx report
refused "report METRICS -o METRICS" "--output 'm.jsonl' and metrics 'm.jsonl' are the same file" \
  "$epx" report m.jsonl -o m.jsonl
refused "report through a symbolic link" "--output 'link.jsonl' and metrics 'm.jsonl' are the same file" \
  "$epx" report m.jsonl -o link.jsonl
refused "report through a hard link" "--output 'hard.jsonl' and metrics './m.jsonl' are the same file" \
  "$epx" report ./m.jsonl --output hard.jsonl
# epx eplb
refused "eplb --loads L --save L" "--save 'loads.txt' and --loads 'loads.txt' are the same file" \
  "$epx" eplb --loads loads.txt --slots 4 --nodes 1 --ranks-per-node 2 --save loads.txt
refused "eplb --current P --save P" "--save './placement.txt' and --current 'placement.txt' are the same file" \
  "$epx" eplb --loads loads.txt --slots 4 --nodes 1 --ranks-per-node 2 --current placement.txt --save ./placement.txt
# epx sim run
refused "sim run S --trace S" "--trace 's.toml' and scenario 's.toml' are the same file" \
  "$epx" sim run s.toml --steps 1 --trace s.toml
refused "sim run S --report S" "--report '$work/s.toml' and scenario 's.toml' are the same file" \
  "$epx" sim run s.toml --steps 1 --report "$work/s.toml"
refused "sim run --report ROUTING_TRACE" "--report 'trace.csv' and routing.trace" \
  "$epx" sim run "$src/configs/sim/moe-1t-64e.toml" --steps 1 --set routing.distribution=trace \
  --set "routing.trace=$work/trace.csv" --report trace.csv
refused "sim run --trace F --report F" "--trace 'out.json' and --report 'out.json' are the same file: one output would overwrite the other" \
  "$epx" sim run s.toml --steps 1 --trace out.json --report out.json
# epx monitor
refused "monitor METRICS --prometheus METRICS" "--prometheus 'm.jsonl' and metrics 'm.jsonl' are the same file" \
  "$epx" monitor m.jsonl --prometheus m.jsonl
refused "monitor --alerts R --prometheus R" "--prometheus 'rules.toml' and --alerts 'rules.toml' are the same file" \
  "$epx" monitor m.jsonl --once --alerts rules.toml --prometheus rules.toml
# epx train
refused "train --config C --metrics C" "--metrics 'c.toml' and --config 'c.toml' are the same file" \
  "$epx" train --config c.toml "${small[@]}" --steps 1 --metrics c.toml
refused "train --trace F --metrics F (existing)" "--metrics 'notes.txt' and --trace 'notes.txt' are the same file" \
  "$epx" train "${small[@]}" --steps 1 --trace notes.txt --metrics notes.txt
refused "train --trace F --metrics F (new)" "--metrics 'new.json' and --trace 'new.json' are the same file" \
  "$epx" train "${small[@]}" --steps 1 --trace new.json --metrics new.json
[[ -e new.json ]] && fail "train --trace F --metrics F (new): new.json was created"
refused "train --data text:F --metrics F" "--metrics 'notes.txt' and --data 'notes.txt' are the same file" \
  "$epx" train "${small[@]}" --steps 1 --data text:notes.txt --metrics notes.txt
refused "train --metrics inside the --save folder" "--metrics 'ck/m.jsonl' lies inside the --save folder 'ck'" \
  "$epx" train "${small[@]}" --steps 1 --save ck --metrics ck/m.jsonl
refused "train --metrics inside the --resume folder" "--metrics 'ck/m.jsonl' lies inside the --resume folder 'ck'" \
  "$epx" train "${small[@]}" --steps 3 --resume ck --metrics ck/m.jsonl
refused "train --trace inside a --resume step folder's checkpoint folder" \
  "--trace 'ck/t.json' lies inside the --resume folder 'ck'" \
  "$epx" train "${small[@]}" --steps 3 --resume ck/step-000002 --trace ck/t.json
refused "train --save X --metrics X (new)" "--metrics 'X' is the --save folder 'X'" \
  "$epx" train "${small[@]}" --steps 1 --save X --metrics X
[[ -e X ]] && fail "train --save X --metrics X: X was created"
refused "train --save C --config C" "--save 'c.toml' and --config 'c.toml' are the same file" \
  "$epx" train --config c.toml "${small[@]}" --steps 1 --save c.toml

# Still accepted: --save DIR --resume DIR (a resume), and an output beside its input.
out=$("$epx" train "${small[@]}" --steps 3 --resume ck --save ck --metrics m2.jsonl 2>&1)
[[ $? -eq 0 ]] || fail "--resume ck --save ck: $out"
"$epx" report m.jsonl -o r.html > /dev/null 2>&1 || fail "report m.jsonl -o r.html"

if [[ $failures -ne 0 ]]; then
  echo "$failures outputs-apart checks failed"
  exit 1
fi
echo "all outputs-apart checks passed"
