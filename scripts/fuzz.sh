#!/usr/bin/env bash
# Runs every libFuzzer target of a fuzz build (`make fuzz`, fuzz/CMakeLists.txt).
#
#   scripts/fuzz.sh BUILD_DIR [SECONDS] [JOBS] [TARGET...]
#
# For each target NAME (every fuzz/NAME_fuzz.cc, or those named): first
# replays its committed reproducers (fuzz/regressions/NAME/), then fuzzes for
# SECONDS (default 60) from the seed corpus fuzz/corpus/NAME/, writing new
# inputs only to a scratch corpus BUILD_DIR/fuzz-work/NAME/corpus (kept between
# runs; the committed corpus is never written). JOBS targets run at a time
# (default 2), each logged to BUILD_DIR/fuzz-work/NAME.log; one summary line
# per target. Exits 1 if any target crashed, leaked, hung or ran out of memory,
# naming the reproducer and how to replay it.
set -euo pipefail

build_dir=${1:?usage: scripts/fuzz.sh BUILD_DIR [SECONDS] [JOBS] [TARGET...]}
seconds=${2:-60}
jobs=${3:-2}
shift $(( $# < 3 ? $# : 3 ))
cd "$(dirname "$0")/.."   # the repository root: sim_scenario reads configs/hardware/ from here
build_dir=$(realpath "$build_dir")
work=$build_dir/fuzz-work
max_len=${FUZZ_MAX_LEN:-8192}     # bytes; the real inputs are under 4 KiB
rss_limit_mb=${FUZZ_RSS_MB:-2048}
malloc_limit_mb=${FUZZ_MALLOC_MB:-512}   # one allocation above this is a bug
timeout_s=${FUZZ_TIMEOUT:-30}            # one input running longer is a hang (see replay_timeout)

targets=("$@")
if (( ${#targets[@]} == 0 )); then
  for source in fuzz/*_fuzz.cc; do
    name=$(basename "$source" _fuzz.cc)
    targets+=("$name")
  done
fi

# A smaller quarantine than ASan's 256 MiB: shorter pauses when it is recycled.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=0:quarantine_size_mb=64}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

# A timeout on a loaded machine can be a starved process (seen in ASan's
# quarantine recycling under a load of 20 on 2 cores), not a slow input: the
# input is replayed alone, and only a second timeout is a failure.
replay_timeout() {
  local binary=$1 artifact=$2 log=$3
  echo "== replaying the timeout alone: $artifact" >>"$log"
  "$binary" -timeout="$timeout_s" -rss_limit_mb="$rss_limit_mb" -malloc_limit_mb="$malloc_limit_mb" \
    "$artifact" >>"$log" 2>&1
}

# One target: regressions, then fuzzing. Writes NAME.log and NAME.result.
run_target() {
  local name=$1 binary=$build_dir/fuzz/epx_fuzz_$1
  local dir=$work/$name log=$work/$name.log
  mkdir -p "$dir/corpus" "$dir/artifacts"
  rm -f "$work/$name.result"
  if [[ ! -x $binary ]]; then
    echo "FAIL $name: $binary is not built (cmake --build $build_dir --target epx_fuzz)" >"$work/$name.result"
    return
  fi
  local flags=(-max_len="$max_len" -rss_limit_mb="$rss_limit_mb" -malloc_limit_mb="$malloc_limit_mb"
               -timeout="$timeout_s" -artifact_prefix="$dir/artifacts/" -print_final_stats=1)
  [[ -f fuzz/$name.dict ]] && flags+=(-dict="fuzz/$name.dict")
  local regressions=(fuzz/regressions/"$name"/*)
  : >"$log"
  if [[ -e ${regressions[0]} ]]; then
    if ! "$binary" "${flags[@]}" "${regressions[@]}" >>"$log" 2>&1; then
      echo "FAIL $name: a committed reproducer in fuzz/regressions/$name/ crashes again (log: $log)" >"$work/$name.result"
      return
    fi
  fi
  local started=$SECONDS status=0
  "$binary" "${flags[@]}" -max_total_time="$seconds" "$dir/corpus" "fuzz/corpus/$name" >>"$log" 2>&1 || status=$?
  local execs artifact note=""
  execs=$(awk '/stat::number_of_executed_units/ {print $2}' "$log" | tail -1)
  # A run stopped by a finding prints no final stats: its last status line then.
  [[ -n $execs ]] || execs=$(grep -oE '^#[0-9]+' "$log" | tail -1 | tr -d '#')
  artifact=$(grep -o "Test unit written to [^ ]*" "$log" | tail -1 | cut -d' ' -f5 || true)
  if (( status != 0 )) && [[ $artifact == */timeout-* ]] && replay_timeout "$binary" "$artifact" "$log"; then
    status=0
    note=" (stopped by a timeout that did not recur when replayed alone: $artifact)"
  fi
  if (( status == 0 )); then
    echo "ok   $name: $(( SECONDS - started )) s, ${execs:-?} executions, 0 crashes," \
         "corpus $(ls "$dir/corpus" | wc -l) inputs$note" >"$work/$name.result"
  else
    { echo "FAIL $name: exit $status after $(( SECONDS - started )) s (log: $log)"
      grep -E "^==[0-9]+==ERROR|SUMMARY:|fuzz invariant failed|^[^ ]+:[0-9]+:[0-9]+: runtime error" "$log" | head -5 | sed 's/^/     /'
      echo "     reproducer: ${artifact:-none written}"
      if [[ -n $artifact ]]; then echo "     replay: $binary $artifact"; fi
    } >"$work/$name.result"
  fi
}

mkdir -p "$work"
echo "fuzzing ${targets[*]}: $seconds s each, $jobs at a time (logs in $work)"
running=0
for name in "${targets[@]}"; do
  run_target "$name" &
  if (( ++running >= jobs )); then
    wait -n || true
    running=$(( running - 1 ))
  fi
done
wait

failed=0
for name in "${targets[@]}"; do
  cat "$work/$name.result"
  [[ $(head -c 4 "$work/$name.result") == "FAIL" ]] && failed=1
done
if (( failed )); then
  echo "fuzz: a target failed; keep its reproducer under fuzz/regressions/NAME/ once fixed (docs/errors.md, Fuzzing)"
fi
exit "$failed"
