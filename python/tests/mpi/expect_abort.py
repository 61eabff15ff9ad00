"""ctest driver: runs rank_raises.py under mpirun -n 4 and checks that the
job failed, rank 2 with its own exception, and every other rank with
epx.AbortedError (exit code 3) well before the dispatch's 100 s timeout.
Usage: expect_abort.py MPIEXEC [MPIEXEC_FLAGS...]"""
import os
import re
import subprocess
import sys
import time


def main():
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank_raises.py")
    command = sys.argv[1:] + ["-n", "4", sys.executable, script]
    start = time.monotonic()
    run = subprocess.run(command, capture_output=True, text=True, timeout=180)
    elapsed = time.monotonic() - start
    output = run.stdout + run.stderr
    print(output)
    failures = []
    if run.returncode == 0:
        failures.append("mpirun exited 0")
    if "RuntimeError: rank 2 fails on purpose" not in output:
        failures.append("rank 2's exception is missing")
    for rank in (0, 1, 3):
        if not re.search(rf"^rank {rank}: AbortedError after [0-9.]+ s: .*rank 2", output, re.M):
            failures.append(f"rank {rank} did not report AbortedError naming rank 2")
    if elapsed > 60:
        failures.append(f"the job took {elapsed:.0f} s")
    if failures:
        print("FAILED: " + "; ".join(failures))
        sys.exit(1)
    print(f"every other rank got AbortedError; the job ended in {elapsed:.1f} s")


if __name__ == "__main__":
    main()
