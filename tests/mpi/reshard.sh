#!/usr/bin/env bash
# A checkpoint written by 4 in-process ranks with EP 2 and EPLB resumes under mpirun on
# 2 processes (and one written there resumes in-process on 1 rank): each
# resumed run says it reshards and continues the loss curve of the 4-rank run
# that never stopped, within a relative 5e-7 per step (fp32 sums in another
# order; tests/train/reshard_test.cc measures and explains the bound).
# Usage: reshard.sh EPX MPIEXEC
set -euo pipefail
epx=$1 mpiexec=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
args=(train --batch-tokens 64 --hidden 32 --ffn-hidden 32 --experts 8 --balance bias+eplb --eplb-every 2 -q)
mpi=(timeout 300 "$mpiexec" --oversubscribe --bind-to none -n 2 "$epx")
losses() { grep -o '"loss":[^,]*' "$1" | cut -d: -f2; }

# The reference: 4 in-process ranks in 2 EP groups, checkpoints after steps 5 and 10.
# (All 10 steps lie in the default 20-step warm-up, so --steps changes no learning rate.)
"$epx" "${args[@]}" --steps 10 --ranks 4 --ep 2 --save-every 5 --save "$work/ck" --metrics "$work/ref.jsonl" > /dev/null
# 2 MPI processes resume step 5 and save step 7; 1 in-process rank resumes that.
"${mpi[@]}" "${args[@]}" --steps 7 --ranks 2 --backend mpi --resume "$work/ck/step-000005" --save "$work/ck2" \
  --metrics "$work/mpi.jsonl" > "$work/mpi.out" 2>&1
"$epx" "${args[@]}" --steps 10 --ranks 1 --resume "$work/ck2" --metrics "$work/one.jsonl" > "$work/one.out" 2>&1

status=0
check() {  # NAME OUT METRICS FIRST_STEP
  if ! grep -q "resharding checkpoint" "$2"; then
    echo "FAIL: $1 did not say it reshards: $(cat "$2")"
    status=1
  fi
  local worst
  worst=$(paste <(losses "$3") <(losses "$work/ref.jsonl" | tail -n +$(($4 + 1)) | head -n "$(wc -l < "$3")") |
          awk '{ d = ($1 - $2) / $2; if (d < 0) d = -d; if (d > w) w = d; n++ } END { if (n == 0) print "none"; else printf "%.3g\n", w }')
  if [[ $worst == none ]] || awk -v w="$worst" 'BEGIN { exit !(w > 5e-7) }'; then
    echo "FAIL: $1: largest relative loss difference $worst (bound 5e-7)"
    status=1
  else
    echo "ok   $1: $(wc -l < "$3") steps, largest relative loss difference $worst"
  fi
}
check "2 MPI processes from 4 in-process ranks (EP 2) (steps 5-6)" "$work/mpi.out" "$work/mpi.jsonl" 5
check "1 in-process rank from 2 MPI processes (steps 7-9)" "$work/one.out" "$work/one.jsonl" 7
[[ $status -eq 0 ]] && echo "resharded runs continue the loss curve"
exit $status
