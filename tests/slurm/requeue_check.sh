#!/usr/bin/env bash
# requeue_check.sh: the two halves of the preemption-and-requeue test of
# configs/slurm/one-node.sbatch (tests/slurm/CMakeLists.txt,
# epx_slurm_sbatch_requeue), run by single_node.sh in the job's directory
# (--during, --after) with EPX_SLURM_JOB_ID and SLURM_CONF set.
#
#   requeue_check.sh signal STEPS   once the job's training has written STEPS
#                                   metrics lines (epx-train-JOB.jsonl), send
#                                   SIGUSR1 to its steps the way the template
#                                   says (`scancel --signal=USR1 JOB`: every
#                                   step, not the batch shell)
#   requeue_check.sh check          after the job: the metrics file holds
#                                   every step once, the requeued run resumed
#                                   (its first record says resumed_from, a step
#                                   after the signal), and every step's loss
#                                   equals that of an uninterrupted in-process
#                                   run of the same command, bit for bit
#
# EPX, CONFIG and TRAIN_ARGS are the template's (the test's environment);
# TRAIN_ARGS must hold --steps N.
set -uo pipefail
job=${EPX_SLURM_JOB_ID:?set by single_node.sh}
metrics=epx-train-$job.jsonl
say() { echo "requeue_check: $*"; }
fail() { echo "requeue_check: FAIL: $*" >&2; exit 1; }

case ${1:-} in
  signal)
    want=${2:?requeue_check.sh signal STEPS}
    lines=0
    for ((i = 0; i < 1200; i++)); do  # 120 s
      [[ -f "$metrics" ]] && lines=$(wc -l <"$metrics")
      ((lines >= want)) && break
      sleep 0.1
    done
    ((lines >= want)) || fail "the training wrote $lines of $want metrics lines in 120 s"
    timeout 30 scancel --signal=USR1 "$job" || fail "scancel --signal=USR1 $job exited with $?"
    say "sent SIGUSR1 to the steps of job $job after $lines steps"
    ;;
  check)
    [[ "${TRAIN_ARGS:-}" =~ --steps[=\ ]([0-9]+) ]] || fail "TRAIN_ARGS has no --steps N: '${TRAIN_ARGS:-}'"
    steps=${BASH_REMATCH[1]}
    [[ -s "$metrics" ]] || fail "no metrics file $metrics"
    # The uninterrupted run: the same training, in-process ranks (the MPI
    # backend's losses equal the in-process ones bit for bit).
    # shellcheck disable=SC2086  # TRAIN_ARGS is a list of flags, as in the template
    timeout 120 "$EPX" train --config "$CONFIG" --ranks 4 $TRAIN_ARGS -q --metrics reference.jsonl >reference.out 2>&1 ||
      fail "the uninterrupted run exited with $?: $(tail -5 reference.out)"
    python3 - "$metrics" reference.jsonl "$steps" <<'PY' || fail "the requeued job's metrics are not an uninterrupted run's"
import json, sys
records = [json.loads(line) for line in open(sys.argv[1])]
reference = {r["step"]: repr(r["loss"]) for r in map(json.loads, open(sys.argv[2]))}
steps = int(sys.argv[3])
got = [r["step"] for r in records]
assert got == list(range(steps)), f"steps {got[:3]}...{got[-3:]} ({len(got)} records), want 0..{steps - 1} once each"
resumed = [r for r in records if "resumed_from" in r]
assert len(resumed) == 1, f"{len(resumed)} records say resumed_from, want 1 (one requeue)"
start = resumed[0]["resumed_from"]
assert resumed[0]["step"] == start and 0 < start < steps, f"resumed_from {start} at step {resumed[0]['step']}"
bad = [(r["step"], repr(r["loss"]), reference[r["step"]]) for r in records if repr(r["loss"]) != reference[r["step"]]]
assert not bad, f"{len(bad)} losses differ (step, requeued job, uninterrupted): {bad[:3]}"
print(f"requeue_check: the requeued run resumed from step {start}; steps 0..{steps - 1} once each, "
      f"losses equal the uninterrupted run's bit for bit (last {records[-1]['loss']!r})")
PY
    ;;
  *)
    echo "usage: requeue_check.sh signal STEPS | check" >&2
    exit 2 ;;
esac
