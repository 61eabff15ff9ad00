#!/usr/bin/env python3
"""What recording who waited for whom costs a training step (docs/performance.md,
Observability).

Runs `epx train` on each shape with --record-waits on and off, alternating
(on, off, off, on, ...) so drift of a shared machine hits both alike, and
reports per shape: the median step time of each mode (the median over runs of
each run's median step, the first step left out as warm-up), their difference
as a share of the step, the fastest run of each mode (the least disturbed by
other work), and the spread of the run medians (the noise floor).

  bench/waits_cost.py build/bin/epx --runs 5
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

SHAPES = {
    # 4 ranks, 2 layers of 8 experts: exchange-bound, the worst case for a fixed per-operation cost.
    "small": ["--ranks", "4", "--batch-tokens", "256", "--hidden", "64", "--ffn-hidden", "64", "--experts", "8",
              "--layers", "2"],
    # 8 ranks on 2 emulated nodes (two-hop), 4 layers of 16 experts, top-2.
    "medium": ["--ranks", "8", "--nodes", "2", "--batch-tokens", "2048", "--hidden", "256", "--ffn-hidden", "256",
               "--experts", "16", "--layers", "4"],
}


def run_once(epx, shape_args, steps, mode, folder):
    path = os.path.join(folder, f"m_{mode}.jsonl")
    if os.path.exists(path):
        os.remove(path)
    cmd = [epx, "train", "-q", "--steps", str(steps), "--record-waits", mode, "--metrics", path] + shape_args
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(path) as f:
        lines = [json.loads(line) for line in f]
    seconds = [line["seconds"] for line in lines[1:]]
    waits = [max(r["exchange_wait"] for r in line["ranks"]) for line in lines[1:]]
    return statistics.median(seconds), statistics.median(waits)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("epx")
    parser.add_argument("--runs", type=int, default=5, help="runs of each mode per shape")
    parser.add_argument("--steps", type=int, default=30, help="steps per run")
    parser.add_argument("--shapes", default="small,medium")
    args = parser.parse_args()
    print("| shape | step, on (ms) | step, off (ms) | on - off | share of step | fastest run, on / off (ms) | "
          "spread of run medians | median max exchange_wait (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for name in args.shapes.split(","):
            runs = {"on": [], "off": []}
            wait = []
            for i in range(args.runs):
                for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
                    step, w = run_once(args.epx, SHAPES[name], args.steps, mode, folder)
                    runs[mode].append(step)
                    if mode == "on":
                        wait.append(w)
            on, off = statistics.median(runs["on"]), statistics.median(runs["off"])
            spread = max(max(v) - min(v) for v in runs.values()) / off
            print(f"| {name} | {on * 1e3:.3f} | {off * 1e3:.3f} | {(on - off) * 1e3:+.3f} ms | "
                  f"{(on - off) / off * 100:+.2f}% | {min(runs['on']) * 1e3:.3f} / {min(runs['off']) * 1e3:.3f} | "
                  f"{spread * 100:.1f}% | {statistics.median(wait) * 1e3:.3f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
