#!/usr/bin/env bash
# One of 4 MPI ranks of `epx train --timeout 2` stalls (SIGSTOP) or dies
# (SIGKILL) mid-training:
#  - stall: ranks 0, 1, 3 each print a message naming rank 2 (it did not
#    arrive; where they waited) within 1.1 x 2 s + 1 s of the SIGSTOP, and
#    exit 1 within 3 s more (MpiSession waits 3 s for a clean MPI_Finalize
#    after a failure); after SIGCONT rank 2 exits 1 with a message of its own
#    within 10 s, instead of training on.
#  - kill: ranks 0, 1, 3 name the lost rank 2 (its pid) and exit 1.
# The 1 s allowance covers the step in progress when rank 2 stopped (a few ms
# on train-tiny), the poll interval of a waiting rank and mpirun forwarding
# the line on a loaded 2-core machine. --enable-recovery keeps mpirun from
# killing the job when the first rank exits, so each process is seen on its
# own. Usage: stall.sh EPX MPIEXEC CONFIG [MORE EPX TRAIN OPTIONS]
set -uo pipefail
epx=$1 mpiexec=$2 config=$3
shift 3
more=("$@")
work=$(mktemp -d)
job=
cleanup() {
  [[ -n "$job" ]] && kill -9 "$job" 2>/dev/null
  pkill -9 -f "^$work/" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cp "$epx" "$work/epx"  # a copy under $work, so cleanup finds every process of this test
# Each process's exit code, by world rank (mpirun --enable-recovery exits 0 whatever they do).
cat > "$work/wrap.sh" <<WRAP
#!/usr/bin/env bash
"$work/epx" "\$@"
echo \$? > "$work/exit.\$OMPI_COMM_WORLD_RANK"
WRAP
chmod +x "$work/wrap.sh"
timeout_s=2
fail() { echo "FAIL: $*"; cat "$work/out.txt" 2>/dev/null; exit 1; }
now_ms() { echo $(( $(date +%s%N) / 1000000 )); }

# Starts the job in the background; each output line gets the time it arrived.
start_job() {
  rm -f "$work/out.txt" "$work/m.jsonl" "$work"/exit.*
  ( timeout 120 "$mpiexec" --oversubscribe --bind-to none --enable-recovery -n 4 "$work/wrap.sh" train \
      --config "$config" --ranks 4 --steps 1000000 --backend mpi -q --timeout $timeout_s --metrics "$work/m.jsonl" "${more[@]}" 2>&1 |
      while IFS= read -r line; do echo "$(now_ms) $line"; done > "$work/out.txt" ) &
  job=$!
  for _ in $(seq 600); do
    [[ -f "$work/m.jsonl" && $(wc -l < "$work/m.jsonl") -ge 5 ]] && return 0
    sleep 0.05
  done
  fail "the job did not train 5 steps in 30 s"
}

# The pid of world rank $1 of this test's job.
pid_of_rank() {
  for pid in $(pgrep -f "^$work/epx train"); do
    if tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$1"; then echo "$pid"; return; fi
  done
}

# Waits until the processes $@ have all exited (at most $limit_ms); prints the ms it took.
wait_exit() {
  local t0 limit_ms=$1; shift
  t0=$(now_ms)
  while :; do
    local alive=0
    for p in "$@"; do kill -0 "$p" 2>/dev/null && alive=1; done
    (( alive )) || break
    (( $(now_ms) - t0 > limit_ms )) && break
    sleep 0.02
  done
  echo $(( $(now_ms) - t0 ))
}

survivors() { for r in 0 1 3; do pid_of_rank $r; done; }

# ---- SIGSTOP
start_job
victim=$(pid_of_rank 2)
[[ -n "$victim" ]] || fail "could not find rank 2"
others=($(survivors))
(( ${#others[@]} == 3 )) || fail "could not find ranks 0, 1, 3"
kill -STOP "$victim"
stopped_at=$(now_ms)
took=$(wait_exit 20000 "${others[@]}")
(( took <= 20000 )) || fail "ranks 0, 1, 3 still run 20 s after rank 2 stopped"
msg_bound=$(( timeout_s * 1100 + 1000 ))
for r in 0 1 3; do
  line=$(grep -E " epx train: (DeadlineExceeded|Aborted): rank $r: step [0-9]+, " "$work/out.txt" | head -1)
  [[ -n "$line" ]] || fail "rank $r printed no message naming its step"
  grep -q "rank 2 did not arrive" <<<"$line" || fail "rank $r does not name rank 2: $line"
  at=$(( ${line%% *} - stopped_at ))
  (( at <= msg_bound )) || fail "rank $r reported $at ms after the SIGSTOP; the bound is $msg_bound ms"
  echo "rank $r named rank 2 ${at} ms after the SIGSTOP (bound $msg_bound ms)"
done
(( took <= msg_bound + 3500 )) || fail "ranks 0, 1, 3 exited $took ms after the SIGSTOP; the bound is $((msg_bound + 3500)) ms"
echo "ranks 0, 1, 3 exited ${took} ms after the SIGSTOP"
kill -CONT "$victim"
took=$(wait_exit 10000 "$victim")
(( took < 10000 )) || fail "rank 2 still runs 10 s after SIGCONT"
wait "$job"; job=
expect_exit() {  # expect_exit CODE RANK...
  local want=$1; shift
  for r in "$@"; do
    [[ "$(cat "$work/exit.$r" 2>/dev/null)" == "$want" ]] || fail "rank $r exited $(cat "$work/exit.$r" 2>/dev/null), want $want"
  done
}
expect_exit 1 0 1 2 3
grep -E " epx train: [A-Za-z]+: rank 2: step [0-9]+, " "$work/out.txt" || fail "rank 2 printed no message after SIGCONT"
echo "rank 2 exited 1 ${took} ms after SIGCONT, with a message; ranks 0, 1, 3 exited 1"

# ---- SIGKILL
start_job
victim=$(pid_of_rank 2)
others=($(survivors))
kill -KILL "$victim"
killed_at=$(now_ms)
took=$(wait_exit 20000 "${others[@]}")
for r in 0 1 3; do
  # A loss seen on a group (the gradient all-reduce's duplicate of the world) names the
  # rank in both numberings: "rank 2 (rank 2 of the group) (pid N on host)".
  line=$(grep -E " epx train: [A-Za-z]+: rank $r: .*rank 2 (\(rank [0-9]+ of the group\) )?\(pid $victim on .*\) is gone" \
    "$work/out.txt" | head -1)
  [[ -n "$line" ]] || fail "rank $r does not name the lost rank 2 (pid $victim)"
  at=$(( ${line%% *} - killed_at ))
  (( at <= msg_bound )) || fail "rank $r reported $at ms after the SIGKILL; the bound is $msg_bound ms"
done
(( took <= msg_bound + 3500 )) || fail "ranks 0, 1, 3 exited $took ms after the SIGKILL; the bound is $((msg_bound + 3500)) ms"
wait "$job"; job=
expect_exit 1 0 1 3
expect_exit 137 2
echo "ranks 0, 1, 3 named the killed rank 2 and exited 1, ${took} ms after the SIGKILL"
echo "stall and kill: every rank named rank 2 within the bound"
