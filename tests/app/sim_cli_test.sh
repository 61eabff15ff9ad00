#!/usr/bin/env bash
# epx sim run from the command line: the progress line goes to stderr only
# (--json stays one parseable object on stdout, with --progress; -q silences
# it; exit codes unchanged), and hardware profiles by name (a scenario copied
# to another folder still runs; an unknown name exits 2 and lists the known
# profiles and where it looked).
# Usage: sim_cli_test.sh EPX_BINARY SOURCE_DIR
set -uo pipefail
epx=$1
src=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
fail() { echo "FAIL $*"; failures=$((failures + 1)); }

# run NAME ARGS...: epx sim run ARGS, stdout into $work/NAME.out, stderr into $work/NAME.err, exit code in $code.
run() {
  local name=$1
  shift
  timeout 60 "$epx" sim run "$@" >"$work/$name.out" 2>"$work/$name.err"
  code=$?
}
# one_json FILE: the file is exactly one JSON object.
one_json() {
  if command -v python3 >/dev/null; then
    python3 -c 'import json, sys; json.load(open(sys.argv[1]))' "$1" 2>/dev/null
  else
    [[ $(wc -l <"$1") -eq 1 ]] && grep -Eq '^\{.*\}$' "$1"
  fi
}

template=$src/configs/sim/template.toml

run progress_json "$template" --steps 3 --progress --json
[[ $code -eq 0 ]] || fail "--progress --json: exit $code, want 0"
one_json "$work/progress_json.out" || fail "--progress --json: stdout is not one JSON object: $(head -c 300 "$work/progress_json.out")"
grep -Eq '^sim: 3/3 \(100%\) elapsed [0-9.]+ s' "$work/progress_json.err" ||
  fail "--progress: no plain progress line on stderr: $(cat "$work/progress_json.err")"
grep -q 'sim: ' "$work/progress_json.out" && fail "--progress: a progress line on stdout"

run progress_tables "$template" --steps 2 --progress
[[ $code -eq 0 ]] || fail "--progress (tables): exit $code, want 0"
grep -q 'step time ms' "$work/progress_tables.out" || fail "--progress: no table on stdout"
grep -q '^sim: ' "$work/progress_tables.out" && fail "--progress: a progress line among the tables"

run quiet "$template" --steps 2 --progress -q --json
[[ $code -eq 0 ]] || fail "-q: exit $code, want 0"
[[ -s "$work/quiet.err" ]] && fail "-q: stderr is not empty: $(cat "$work/quiet.err")"
one_json "$work/quiet.out" || fail "-q --json: stdout is not one JSON object"

# Not a terminal and no --progress: nothing on stderr.
run plain "$template" --steps 2 --json
[[ -s "$work/plain.err" ]] && fail "no terminal, no --progress: stderr is not empty: $(cat "$work/plain.err")"

run bad_input "$src/tests/sim/data/bad_scenario.toml" --progress
[[ $code -eq 2 ]] || fail "a bad scenario with --progress: exit $code, want 2"
run bad_sweep "$template" --progress --sweep model.topk=2,x
[[ $code -eq 2 ]] || fail "a bad sweep value with --progress: exit $code, want 2"

# A scenario copied elsewhere finds its profile by name.
mkdir -p "$work/elsewhere"
cp "$template" "$work/elsewhere/my.toml"
grep -q '^profile = "h100"' "$work/elsewhere/my.toml" || fail "template.toml does not name its profile h100"
run copied "$work/elsewhere/my.toml" --steps 1
[[ $code -eq 0 ]] || fail "a copied scenario: exit $code, want 0: $(cat "$work/copied.err")"

# An unknown name: exit 2, the known profiles and the folders looked in.
sed 's/^profile = "h100"/profile = "h999"/' "$template" >"$work/elsewhere/unknown.toml"
run unknown "$work/elsewhere/unknown.toml" --steps 1
[[ $code -eq 2 ]] || fail "an unknown profile: exit $code, want 2"
grep -Eq "hardware.profile = 'h999': no hardware profile named 'h999'; the known profiles are h100, h200, h800 \(looked in [^)]*configs/hardware" \
  "$work/unknown.err" || fail "an unknown profile: the message does not list the profiles: $(cat "$work/unknown.err")"

# A path still works, relative to the scenario's folder.
sed "s|^profile = \"h100\"|profile = \"../h100-copy.toml\"|" "$template" >"$work/elsewhere/by_path.toml"
cp "$src/configs/hardware/h100.toml" "$work/h100-copy.toml"
run by_path "$work/elsewhere/by_path.toml" --steps 1
[[ $code -eq 0 ]] || fail "a profile by relative path: exit $code, want 0: $(cat "$work/by_path.err")"

# The report shows the kernel family, the routing source and skew, and the whole step's parts.
run report "$template" --steps 2 --set parallelism.mode=train --report "$work/run.html"
[[ $code -eq 0 ]] || fail "--report: exit $code, want 0: $(cat "$work/report.err")"
for part in 'All-to-all kernel: ' 'Routing: .*Expert-load skew \(MaxVio' 'Where the step time goes' \
            'pipeline transfers' 'gradient all-reduce exposed' 'optimizer update' 'Expert-load skew<'; do
  grep -Eq "$part" "$work/run.html" || fail "--report: the page lacks '$part'"
done

if [[ $failures -gt 0 ]]; then
  echo "sim_cli_test: $failures failure(s)"
  exit 1
fi
echo "sim_cli_test: ok"
