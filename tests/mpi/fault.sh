#!/usr/bin/env bash
# A rank killed (SIGKILL) in the middle of training: every other rank must
# exit within the timeout with a message naming the lost rank, and the
# checkpoint written before the fault must resume cleanly (the resumed run's
# losses equal an uninterrupted run's).
#
# mpirun normally kills the whole job as soon as one process dies, before
# the others can say anything; --enable-recovery lets them run on, so this
# test sees epx's own detection. Usage: fault.sh EPX MPIEXEC CONFIG
set -euo pipefail
epx=$1 mpiexec=$2 config=$3
work=$(mktemp -d)
job=
cleanup() {
  [[ -n "$job" ]] && kill -9 "$job" 2>/dev/null || true
  pkill -9 -f "$work/" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpi=("$mpiexec" --oversubscribe --bind-to none -n 4)
# A copy of the binary under $work, so cleanup can find every process of this test.
cp "$epx" "$work/epx"
args=(train --config "$config" --ranks 4 --steps 200 --backend mpi -q)

# The uninterrupted run, for the losses after the resume.
timeout 300 "${mpi[@]}" "$work/epx" "${args[@]}" --metrics "$work/ref.jsonl" > /dev/null

# The run that loses a rank: checkpoints every 10 steps. With --enable-recovery
# mpirun exits 0 whatever its processes do, so each rank writes its own exit code.
cat > "$work/rank.sh" <<'RANK'
#!/usr/bin/env bash
"$@"
code=$?
echo "rank $OMPI_COMM_WORLD_RANK exit $code" >> "$(dirname "$1")/codes.txt"
exit $code
RANK
chmod +x "$work/rank.sh"
"${mpi[@]}" --enable-recovery "$work/rank.sh" "$work/epx" "${args[@]}" --save "$work/ckpt" --save-every 10 \
  > "$work/out.txt" 2>&1 &
job=$!
for _ in $(seq 600); do
  [[ -f "$work/ckpt/latest" ]] && break
  sleep 0.05
done
[[ -f "$work/ckpt/latest" ]] || { echo "FAIL: no checkpoint after 30 s"; cat "$work/out.txt"; exit 1; }
victim=
for pid in $(pgrep -f "^$work/epx train"); do
  if tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qx 'OMPI_COMM_WORLD_RANK=2'; then victim=$pid; fi
done
[[ -n "$victim" ]] || { echo "FAIL: could not find the process of rank 2"; exit 1; }
kill -9 "$victim"
killed_at=$(date +%s%N)
for _ in $(seq 1200); do kill -0 "$job" 2>/dev/null || break; sleep 0.05; done
if kill -0 "$job" 2>/dev/null; then
  echo "FAIL: the job is still running 60 s after rank 2 (pid $victim) was killed"
  cat "$work/out.txt"
  exit 1
fi
wait "$job" || true
job=
for r in 0 1 3; do
  grep -qx "rank $r exit 1" "$work/codes.txt" ||
    { echo "FAIL: rank $r did not exit 1 after rank 2 was lost:"; cat "$work/codes.txt"; exit 1; }
done
elapsed_ms=$(( ($(date +%s%N) - killed_at) / 1000000 ))
echo "--- what the ranks printed after rank 2 (pid $victim) was killed:"
grep "epx train" "$work/out.txt" || true
# A loss seen on a group (the gradient all-reduce's duplicate of the world)
# names the rank in both numberings: "rank 2 (rank 2 of the group) (pid N on host)".
named=$(grep -cE "rank 2 (\(rank [0-9]+ of the group\) )?\(pid $victim on [^)]*\) is gone" "$work/out.txt" || true)
if [[ $named -ne 3 ]]; then
  echo "FAIL: expected each of ranks 0, 1 and 3 to name the lost rank 2 (pid $victim); $named did"
  cat "$work/out.txt"
  exit 1
fi
echo "all 3 other ranks exited naming rank 2, ${elapsed_ms} ms after the kill"

# Resume from the last checkpoint written before the fault (DIR/latest names it).
latest=$(cat "$work/ckpt/latest")
step=$((10#${latest#step-}))
timeout 300 "${mpi[@]}" "$work/epx" "${args[@]}" --resume "$work/ckpt" --metrics "$work/resumed.jsonl" > /dev/null
# Whole metrics lines minus the timings, shortest round-trip numbers: equal text = equal bits.
losses() { "$(dirname "${BASH_SOURCE[0]}")/../app/metrics_values.sh" "$1"; }
resumed=$(losses "$work/resumed.jsonl" | wc -l)
if [[ $resumed -ne $((200 - step)) ]]; then
  echo "FAIL: the resumed run reported $resumed steps; from step $step it should run $((200 - step))"
  exit 1
fi
if ! diff <(losses "$work/resumed.jsonl") <(losses "$work/ref.jsonl" | tail -n "$resumed") > "$work/diff"; then
  echo "FAIL: the resumed run's losses differ from the uninterrupted run's:"
  head "$work/diff"
  exit 1
fi
echo "resumed from the checkpoint of step $step: steps $step..199 match the uninterrupted run bit for bit"
