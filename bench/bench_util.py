"""Shared helpers of the Python benchmarks (bench/*.py): timing, medians, the
machine and run record. Standard library only, so every script can import it
before torch or epx.

  import bench_util as bu            # scripts put bench/ on sys.path (they live there)
  times = bu.time_reps(fn, reps=5)   # seconds of each repetition after warm-ups
  bu.median(times), bu.run_record()
"""
import datetime
import os
import statistics
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def median(values):
    return statistics.median(values)


def time_reps(fn, reps, warmup=1):
    """Calls fn() warmup + reps times; returns the reps' wall times in seconds."""
    times = []
    for i in range(warmup + reps):
        start = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def timed(barrier, fn, marks):
    """barrier(), then fn() timed: appends (start, end) to marks; returns fn's value."""
    barrier()
    start = time.perf_counter()
    value = fn()
    marks.append((start, time.perf_counter()))
    return value


def span(starts, ends):
    """One operation on several ranks: the last end minus the first start.
    perf_counter is CLOCK_MONOTONIC, shared by the processes of one host."""
    return max(ends) - min(starts)


def summary_ms(times_s):
    """{"median_ms", "min_ms", "reps"} of a list of seconds."""
    return {"median_ms": 1e3 * median(times_s), "min_ms": 1e3 * min(times_s), "reps": len(times_s)}


def _cpu_model():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def _commit():
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def mem_available_bytes():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def load_average():
    with open("/proc/loadavg") as f:
        return [float(v) for v in f.read().split()[:3]]


def run_record():
    """What docs/performance.md records next to the numbers."""
    return {"date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "cpu": _cpu_model(), "cores": os.cpu_count(), "commit": _commit(), "load_average": load_average(),
            "mem_available_gib": round(mem_available_bytes() / 2**30, 1)}
