#!/usr/bin/python3
"""A killed process makes the others fail, not hang: 4 processes started with torchrun's
environment (by this script, as torchrun would) connect epx.torchrun_transport(); rank 2 kills
itself (SIGKILL) after a barrier; every other rank must leave its next barrier (timeout 120 s)
with AbortedError naming rank 2 within LIMIT_S seconds.

    kill_one.py [MASTER_PORT]      exit 0 when so, 1 otherwise
"""
import os
import signal
import subprocess
import sys
import time

RANKS = 4
VICTIM = 2
LIMIT_S = 30


def worker():
    import epx
    t = epx.torchrun_transport(timeout=60)
    t.barrier(timeout=60)
    if t.rank == VICTIM:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        for _ in range(1000):
            t.barrier(timeout=120)
            time.sleep(0.01)
    except (epx.AbortedError, epx.DeadlineExceededError) as e:
        print(f"rank {t.rank}: {type(e).__name__} after {time.monotonic() - start:.1f} s: {e}", flush=True)
        sys.exit(3)
    print(f"rank {t.rank}: the barriers completed without rank {VICTIM}", flush=True)
    sys.exit(0)


def main():
    port = sys.argv[1] if len(sys.argv) > 1 else "29630"
    procs = []
    for r in range(RANKS):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(RANKS), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(RANKS),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker"], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    start = time.monotonic()
    ok = True
    for r, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=max(1.0, LIMIT_S + 30 - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            print(f"rank {r} HUNG (killed): {out}")
            ok = False
            continue
        print(f"rank {r}: exit {p.returncode}: {out.strip()[-600:]}")
        if r == VICTIM:
            ok &= p.returncode == -signal.SIGKILL
        else:
            ok &= p.returncode == 3 and f"rank {VICTIM}" in out and "AbortedError" in out
    waited = time.monotonic() - start
    ok &= waited < LIMIT_S + 15
    print(f"kill_one: {'every other rank failed with an error naming rank 2' if ok else 'FAILED'} "
          f"({waited:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    sys.exit(main())
