#!/usr/bin/env python3
"""Does `epx monitor --follow --plain --prometheus` keep up with a run?

A writer appends realistic metrics lines (the trainer's format: per layer
MaxVio, loads per expert and per rank; per rank the times and the
who-waited-for-whom summary; a ranks x ranks wait matrix every 10 steps) at a
fixed rate to a fresh file while `epx monitor` follows it. Every plain line
the monitor prints names the last step it read; its lag is the time it was
printed minus the time the writer wrote that step. The monitor's CPU share is
its user + system time (from wait4) over its wall time.

  bench/monitor_follow.py build/bin/epx --layers 4 --experts 64 --ranks 8 --rate 100 --seconds 20
  bench/monitor_follow.py build/bin/epx --layers 61 --experts 256 --ranks 8 --rate 100 --seconds 20 --json
"""
import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time


def step_line(step, layers, experts, ranks, rng):
    """One metrics line as StepReport::to_json writes it (plus the wait fields)."""
    layer_list = []
    for l in range(layers):
        tpe = [rng.randint(50, 400) for _ in range(experts)]
        per_rank = experts // ranks
        tpr = [sum(tpe[r * per_rank:(r + 1) * per_rank]) for r in range(ranks)]
        mean = sum(tpe) / experts
        layer_list.append({
            "layer": l, "max_vio": max(tpe) / mean - 1, "cv": 0.3, "dropped": 0, "worst_rank": tpr.index(max(tpr)),
            "worst_rank_share": max(tpr) / sum(tpr), "idle_fraction": 1 - (sum(tpr) / ranks) / max(tpr),
            "tokens_per_expert": tpe, "tokens_per_rank": tpr})
    rank_list = []
    for r in range(ranks):
        wait = rng.uniform(0.0005, 0.002)
        rank_list.append({
            "rank": r, "router": 0.001, "dispatch": 0.004, "experts": 0.02, "combine": 0.004, "dense": 0.01,
            "wait": wait, "sync": 0.002, "total": 0.045 + wait, "grad_reduce": 0.003, "grad_wait": 0.001,
            "grad_bytes": 1.5e7, "exchange_wait": rng.uniform(0.0001, 0.001), "waited_for": (r + 1) % ranks,
            "late": rng.uniform(0, 0.001), "slow_data": rng.uniform(0, 0.0005)})
    line = {"step": step, "loss": 3.0 - step * 1e-4, "main_loss": 2.9 - step * 1e-4, "lr": 3e-4, "grad_norm": 0.8,
            "seconds": 0.05, "tokens_per_s": 160000.0, "layers": layer_list, "ranks": rank_list}
    if step % 10 == 0:
        line["wait_matrix"] = {"num_ranks": ranks, "arrival": [rng.uniform(0, 1e-3) for _ in range(ranks * ranks)],
                               "data": [rng.uniform(0, 1e-3) for _ in range(ranks * ranks)]}
    return json.dumps(line, separators=(",", ":"))


def write_run(path, lines, rate, written):
    """Appends one line every 1/rate s (on a fixed schedule); written[step] = time it was written."""
    t0 = time.monotonic()
    with open(path, "a") as f:
        for step, line in enumerate(lines):
            delay = t0 + step / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            f.write(line + "\n")
            f.flush()
            written[step] = time.monotonic()


def read_updates(stream, seen):
    for text in stream:
        m = re.search(r" step (\d+) loss ", text)
        if m:
            seen.append((int(m.group(1)), time.monotonic()))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("epx")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--rate", type=float, default=100, help="steps per second the writer appends")
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--interval", type=float, default=1.0, help="the monitor's --interval")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()

    rng = random.Random(1)
    n = int(a.rate * a.seconds)
    lines = [step_line(s, a.layers, a.experts, a.ranks, rng) for s in range(n)]
    work = tempfile.mkdtemp(prefix="epx_monitor_bench_")
    metrics, prom = os.path.join(work, "metrics.jsonl"), os.path.join(work, "epx.prom")
    rules = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "monitor", "alerts.toml")
    cmd = [a.epx, "monitor", metrics, "--follow", "--plain", "--interval", str(a.interval), "--idle-exit", "2",
           "--alerts", rules, "--prometheus", prom]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    seen, written = [], {}
    reader = threading.Thread(target=read_updates, args=(proc.stdout, seen))
    reader.start()
    start = time.monotonic()
    write_run(metrics, lines, a.rate, written)
    end_write = time.monotonic()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - start
    reader.join()
    lags = [t - written[s] for s, t in seen if s in written]
    last_step = seen[-1][0] if seen else -1
    cpu = usage.ru_utime + usage.ru_stime
    # The share of the writer's time (it wrote for end_write - start s), minus the 2 s --idle-exit wait.
    result = {
        "layers": a.layers, "experts": a.experts, "ranks": a.ranks, "rate": a.rate, "steps": n,
        "interval_s": a.interval, "line_bytes": len(lines[1]), "updates": len(seen), "last_step_seen": last_step,
        "lag_median_s": statistics.median(lags) if lags else None, "lag_max_s": max(lags) if lags else None,
        "cpu_s": cpu, "wall_s": wall, "cpu_share": cpu / (end_write - start),
        "max_rss_mb": usage.ru_maxrss / 1024, "prom_bytes": os.path.getsize(prom) if os.path.exists(prom) else 0,
        "exit": os.waitstatus_to_exitcode(status)}
    subprocess.run(["rm", "-rf", work])
    if a.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:16} {v}")
    return 0 if result["exit"] == 0 and last_step == n - 1 else 1


if __name__ == "__main__":
    sys.exit(main())
