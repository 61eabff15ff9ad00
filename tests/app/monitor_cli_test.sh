#!/usr/bin/env bash
# epx monitor end to end, on the metrics of a real (small) epx train run:
# --once exit codes (clean 0, drops 1, a NaN 1, bad rules 2 naming the key),
# --plain, --prometheus contents, --follow on a file a background writer
# appends to (a partial last line included; ended by --idle-exit and by
# SIGTERM), and, where mpirun is, the metrics of a 2-process MPI run.
# Usage: monitor_cli_test.sh EPX_BINARY SOURCE_DIR [MPIEXEC]
set -uo pipefail
epx=$1
src=$2
mpiexec=${3:-}
rules=$src/configs/monitor/alerts.toml
work=$(mktemp -d)
writer_pid=""
cleanup() {
  [[ -n "$writer_pid" ]] && kill "$writer_pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
failures=0
fail() { echo "FAIL $*"; failures=$((failures + 1)); }

# expect WHAT CODE REGEX ARGS...: `epx monitor ARGS` exits CODE and its output
# (stdout and stderr) matches the extended REGEX.
expect() {
  local what=$1 want=$2 regex=$3
  shift 3
  local out code
  out=$(timeout 60 "$epx" monitor "$@" 2>&1)
  code=$?
  if [[ $code -ne $want ]]; then fail "$what: exit code $code, want $want; output: $out"; return; fi
  if ! grep -Eq -- "$regex" <<< "$out"; then fail "$what: output does not match '$regex': $out"; return; fi
  echo "ok   $what"
}

# A real run's metrics: 12 steps, 4 ranks, 2 layers of 8 experts, no drops.
timeout 120 "$epx" train --steps 12 --ranks 4 --batch-tokens 128 --hidden 32 --ffn-hidden 32 --experts 8 -q \
  --metrics "$work/clean.jsonl" > "$work/train.out" 2>&1 || { cat "$work/train.out"; fail "epx train"; exit 1; }
[[ $(wc -l < "$work/clean.jsonl") -eq 12 ]] || { fail "epx train wrote $(wc -l < "$work/clean.jsonl") lines, not 12"; exit 1; }
grep -q '"dropped":[1-9]' "$work/clean.jsonl" && { fail "the clean run dropped tokens"; exit 1; }
# The same with 5 tokens dropped in layer 0 at step 4, and with a NaN loss (null) at step 7.
sed '5s/"dropped":0/"dropped":5/' "$work/clean.jsonl" > "$work/drops.jsonl"
sed '8s/"loss":[^,]*/"loss":null/' "$work/clean.jsonl" > "$work/nan.jsonl"

expect "--once: a clean run passes the template's rules" 0 "no alert over 12 steps \(7 rules\)" \
  --once --alerts "$rules" "$work/clean.jsonl"
expect "--once: drops fire (exit 1) with time, rule, layer, value, threshold" 1 \
  "^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9:]{8}Z FIRING tokens-dropped layer=0 value=5 threshold=0 step=4$" \
  --once --alerts "$rules" "$work/drops.jsonl"
expect "--once: the drop clears at the next step" 1 "CLEARED tokens-dropped layer=0 value=0 threshold=0 step=5$" \
  --once --alerts "$rules" "$work/drops.jsonl"
expect "--once: the verdict counts it" 1 "^epx monitor --once: 1 alerts fired over 12 steps \(0 still firing at the end\)$" \
  --once --alerts "$rules" "$work/drops.jsonl"
expect "--once: a NaN loss fires" 1 "FIRING loss-not-finite value=nan threshold=0 step=7" \
  --once --alerts "$rules" "$work/nan.jsonl"

# A real straggler: steps 20-64 of a 4-process MPI run whose rank 2 was paused
# from outside 30 ms in every 100 ms (SIGSTOP/SIGCONT; the runlog branch's
# straggler_compute.sh). The straggler rule names rank 2 and its cause.
printf '[[rule]]\nname = "straggler"\nkind = "straggler"\nwindow = 20\nfor_steps = 5\n' > "$work/straggler.toml"
expect "a paused rank: the straggler rule names rank 2, cause compute" 1 \
  "FIRING straggler rank=2 value=0\.[0-9]+ threshold=0\.3 step=[0-9]+ \(rank 2 \(compute\): the others waited " \
  --once --alerts "$work/straggler.toml" "$src/tests/app/data/monitor/paused_rank2.jsonl"
expect "a paused rank: the verdict" 1 "^epx monitor --once: [1-9][0-9]* alerts fired over 45 steps" \
  --once --alerts "$work/straggler.toml" "$src/tests/app/data/monitor/paused_rank2.jsonl"
if "$epx" monitor --once --alerts "$work/straggler.toml" "$src/tests/app/data/monitor/paused_rank2.jsonl" |
  grep "FIRING" | grep -qv "rank=2 "; then
  fail "a paused rank: the straggler rule named another rank"
fi

printf '[[rule]]\nname = "vio"\nkind = "max_vio"\nabove = 1\nabov = 2\n' > "$work/unknown_key.toml"
expect "bad rules: an unknown key is named (exit 2)" 2 \
  "unknown_key.toml: rule 'vio': unknown key 'abov' \(a max_vio rule takes name, kind, above, for_steps\)" \
  --once --alerts "$work/unknown_key.toml" "$work/clean.jsonl"
printf '[[rule]]\nname = "idle"\nkind = "rank_idle"\nabove = 2\n' > "$work/range.toml"
expect "bad rules: a value out of range names the range (exit 2)" 2 \
  "range.toml: rule 'idle': above = 2 is outside \[0, 1\]" --alerts "$work/range.toml" "$work/clean.jsonl"
expect "bad rules: a missing rule file (exit 2)" 2 "cannot open the alert rule file '.*none.toml': No such file or directory" \
  --alerts "$work/none.toml" "$work/clean.jsonl"
expect "--once needs --alerts (exit 2)" 2 "--once needs --alerts" --once "$work/clean.jsonl"
expect "--once and --follow exclude each other (exit 2)" 2 "excludes" --once --follow --alerts "$rules" \
  "$work/clean.jsonl"
expect "--idle-exit needs --follow (exit 2)" 2 "--idle-exit 3 needs --follow" --idle-exit 3 "$work/clean.jsonl"
expect "a missing metrics file without --follow (exit 2)" 2 "none.jsonl" "$work/none.jsonl"
expect "--prometheus into a missing folder (exit 2)" 2 "--prometheus $work/no/epx.prom" \
  --prometheus "$work/no/epx.prom" "$work/clean.jsonl"

# --plain: one line, the last state.
expect "--plain: one line of the last state" 0 \
  "^[0-9T:-]+Z step 11 loss [0-9.]+ tok/s [0-9]+ step_s [0-9.e-]+ balancedness [0-9.]+ maxvio [0-9.]+ \(worst layer [01] [0-9.]+\) dropped 0 idle_max [0-9.]+ \(rank [0-3]\) wait_max [0-9.e-]+s \(rank [0-3]\) straggler" \
  --plain "$work/clean.jsonl"
lines=$("$epx" monitor --plain "$work/clean.jsonl" | wc -l)
[[ $lines -eq 1 ]] && echo "ok   --plain prints exactly one line" || fail "--plain printed $lines lines"
# Not a terminal and not --plain: the full view, printed once.
expect "the view, printed once off a terminal: the headline" 0 "^step 11 +loss [0-9.]+ \(main [0-9.]+\) +tokens/s" \
  "$work/clean.jsonl"
expect "the view: the layer table" 0 "^layer +MaxVio +balancedness +dropped +dropped total +hot experts" "$work/clean.jsonl"
expect "the view: the rank table" 0 "^rank +step s +idle +exchange wait s +waited for$" "$work/clean.jsonl"

# --prometheus: the file's families and values; nothing else left in its folder.
mkdir -p "$work/prom"
expect "--prometheus with --once" 1 "1 alerts fired" --once --alerts "$rules" --prometheus "$work/prom/epx.prom" \
  "$work/drops.jsonl"
prom=$work/prom/epx.prom
for want in '^# TYPE epx_train_step gauge$' '^epx_train_step 11$' '^epx_monitor_records_total 12$' \
  '^epx_layer_dropped_tokens_total\{layer="0"\} 5$' '^epx_train_dropped_tokens_total 5$' \
  '^epx_layer_max_vio\{layer="1"\} [0-9.e-]+$' '^epx_rank_idle_fraction\{rank="3"\} [0-9.e-]+$' \
  '^epx_expert_token_share\{layer="0",expert="[0-7]"\} 0\.[0-9]+' '^epx_alerts_firing\{rule="tokens-dropped"\} 0$' \
  '^epx_straggler_rank -?[0-9]+$'; do
  grep -Eq "$want" "$prom" || fail "--prometheus: no line matching '$want' in $(cat "$prom")"
done
[[ $(grep -c '^epx_expert_token_share' "$prom") -eq 8 ]] || fail "--prometheus: not 4 hot experts x 2 layers"
[[ $(ls "$work/prom") == "epx.prom" ]] || fail "--prometheus left $(ls "$work/prom")"
if command -v promtool > /dev/null; then
  promtool check metrics < "$prom" > "$work/promtool.out" 2>&1 || fail "promtool: $(cat "$work/promtool.out")"
fi
echo "ok   --prometheus: families, values, one file"

# --follow: a writer appends the drops run a line every 0.1 s (the file appears
# after the monitor starts; line 6 arrives in two parts); --idle-exit ends it.
writer() {
  sleep 0.3
  local n=0
  while IFS= read -r line; do
    n=$((n + 1))
    if [[ $n -eq 6 ]]; then
      printf '%s' "${line:0:40}" >> "$work/follow.jsonl"
      sleep 0.3
      printf '%s\n' "${line:40}" >> "$work/follow.jsonl"
    else
      printf '%s\n' "$line" >> "$work/follow.jsonl"
    fi
    sleep 0.1
  done < "$work/drops.jsonl"
}
writer &
writer_pid=$!
timeout 30 "$epx" monitor --follow --plain --interval 0.1 --idle-exit 1.5 --alerts "$rules" \
  --prometheus "$work/prom/follow.prom" "$work/follow.jsonl" > "$work/follow.out" 2> "$work/follow.err"
code=$?
wait "$writer_pid"
writer_pid=""
if [[ $code -ne 0 ]]; then fail "--follow: exit $code: $(cat "$work/follow.err")"
elif ! tail -n 1 "$work/follow.out" | grep -q " step 11 loss "; then fail "--follow: last line: $(tail -n 1 "$work/follow.out")"
elif [[ $(wc -l < "$work/follow.out") -lt 3 ]]; then fail "--follow: only $(wc -l < "$work/follow.out") updates"
elif ! grep -q "FIRING tokens-dropped layer=0 value=5" "$work/follow.err"; then fail "--follow: no alert on stderr: $(cat "$work/follow.err")"
elif grep -q "FIRING" "$work/follow.out"; then fail "--follow: alert lines on stdout"
elif ! grep -q '^epx_train_step 11$' "$work/prom/follow.prom"; then fail "--follow: Prometheus file not at step 11"
else echo "ok   --follow: $(wc -l < "$work/follow.out") updates to step 11, the alert on stderr, --idle-exit ended it"; fi

# SIGTERM (how a batch job's step ends) stops --follow with exit 0 after a last refresh.
timeout 30 "$epx" monitor --follow --plain --interval 0.1 "$work/clean.jsonl" > "$work/term.out" 2>&1 &
pid=$!
sleep 1
kill -TERM "$pid"
wait "$pid"
code=$?
if [[ $code -ne 0 ]]; then fail "SIGTERM: exit $code"
elif ! grep -q " step 11 " "$work/term.out"; then fail "SIGTERM: no update: $(cat "$work/term.out")"
else echo "ok   --follow ends on SIGTERM with exit 0"; fi

# On a terminal (a pty from `script`): the view is redrawn in place (ANSI
# cursor home); --plain never writes an escape sequence.
if command -v script > /dev/null; then
  esc=$'\x1b'
  timeout 20 script -qec "'$epx' monitor --follow --interval 0.1 --idle-exit 0.5 '$work/clean.jsonl'" /dev/null \
    > "$work/tty.out" 2>&1
  code=$?
  timeout 20 script -qec "'$epx' monitor --follow --plain --interval 0.1 --idle-exit 0.5 '$work/clean.jsonl'" /dev/null \
    > "$work/tty_plain.out" 2>&1
  if [[ $code -ne 0 ]]; then fail "terminal view: exit $code: $(cat -v "$work/tty.out")"
  elif ! grep -q "${esc}\[H" "$work/tty.out" || ! grep -q "step 11  loss" "$work/tty.out"; then
    fail "terminal view: no in-place redraw of step 11: $(cat -v "$work/tty.out" | head -5)"
  elif grep -q "$esc" "$work/tty_plain.out" || ! grep -q " step 11 loss " "$work/tty_plain.out"; then
    fail "--plain on a terminal: $(cat -v "$work/tty_plain.out" | head -5)"
  else echo "ok   on a terminal: the view redrawn in place; --plain without escapes"; fi
fi

# An MPI run's metrics (rank 0 writes the file): nothing special, the same checks.
if [[ -n "$mpiexec" ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  if timeout 120 "$mpiexec" --oversubscribe --bind-to none -n 2 "$epx" train --backend mpi --ranks 2 --steps 6 \
    --batch-tokens 64 --hidden 32 --ffn-hidden 32 --experts 4 -q --metrics "$work/mpi.jsonl" > "$work/mpi.out" 2>&1; then
    expect "an MPI run's metrics: --once" 0 "no alert over 6 steps" --once --alerts "$rules" "$work/mpi.jsonl"
    expect "an MPI run's metrics: the view lists rank 1" 0 "^ +1 +[0-9.]+ +[0-9.]+ +[0-9.]+ +(-|[0-9]+)$" \
      "$work/mpi.jsonl"
  else
    fail "mpirun -n 2 epx train: $(tail -n 5 "$work/mpi.out")"
  fi
fi

if [[ $failures -ne 0 ]]; then
  echo "$failures epx monitor check(s) failed"
  exit 1
fi
echo "all epx monitor command-line checks passed"
