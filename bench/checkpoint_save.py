#!/usr/bin/python3
"""What a checkpoint costs the training: `epx train` saving only its final checkpoint,
saving every --save-every steps synchronously, and with --async-save, alternated rep by
rep in one run; the cost of a periodic save is (run time - the final-only run's) /
periodic saves, medians over the reps (the final checkpoint is written at once in all three).

    /usr/bin/python3 bench/checkpoint_save.py --epx build/bin/epx            # docs/performance.md
    /usr/bin/python3 bench/checkpoint_save.py --epx build/bin/epx --reps 1 --steps 4 --hidden 32   # smoke

The checkpoints go to a temporary folder under --dir (default: the build folder's
file system, so the disk the user's build is on); its size is printed beside the
sync save's rate, whose limit is the disk's fsync'ed write bandwidth.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util as bu  # noqa: E402

MODES = {"final": [], "sync": ["--save-every"], "async": ["--save-every", "--async-save"]}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epx", required=True, help="the epx binary")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--save-every", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn-hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--batch-tokens", type=int, default=4096, help="tokens per step (the compute between two saves)")
    p.add_argument("--dir", default=os.path.join(bu.ROOT, "build"), help="where the checkpoints are written")
    return p.parse_args()


def command(args, mode, folder):
    cmd = [args.epx, "train", "--config", os.path.join(bu.ROOT, "configs", "train-tiny.toml"), "-q",
           "--steps", str(args.steps), "--hidden", str(args.hidden), "--ffn-hidden", str(args.ffn_hidden),
           "--experts", str(args.experts), "--ranks", str(args.ranks), "--batch-tokens", str(args.batch_tokens),
           "--keep", "1"]
    cmd += ["--save", folder]
    if MODES[mode]:
        cmd += ["--save-every", str(args.save_every)] + MODES[mode][1:]
    return cmd


def run_once(args, mode, root):
    folder = os.path.join(root, mode)
    shutil.rmtree(folder, ignore_errors=True)
    start = time.perf_counter()
    subprocess.run(command(args, mode, folder), check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def folder_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main():
    args = parse_args()
    os.makedirs(args.dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="epx-checkpoint-bench-", dir=args.dir)
    try:
        times = {mode: [] for mode in MODES}
        for _ in range(args.reps):  # alternated, so a change in the machine's load hits every mode alike
            for mode in MODES:
                times[mode].append(run_once(args, mode, root))
        latest = open(os.path.join(root, "sync", "latest")).read().strip()
        checkpoint = folder_bytes(os.path.join(root, "sync", latest))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    saves = (args.steps - 1) // args.save_every  # periodic: the final step's save is the final checkpoint
    base = bu.median(times["final"])
    cost = {mode: (bu.median(times[mode]) - base) / saves for mode in ("sync", "async")}
    print(json.dumps({"benchmark": "checkpoint_save", "run": bu.run_record(), "steps": args.steps,
                      "periodic_saves": saves,
                      "checkpoint_bytes": checkpoint, "median_run_s": {m: bu.median(t) for m, t in times.items()},
                      "cost_per_save_s": cost,
                      "sync_save_mb_per_s": checkpoint / cost["sync"] / 1e6 if cost["sync"] > 0 else None,
                      "async_over_sync": cost["async"] / cost["sync"] if cost["sync"] > 0 else None},
                     indent=1))


if __name__ == "__main__":
    main()
