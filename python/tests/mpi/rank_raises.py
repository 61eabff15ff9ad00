"""One rank of `mpirun -n 4`: rank 2 raises in Python while the others wait
for it in a collective. Each other rank prints the exception it got and
exits 3 (expect_abort.py checks it was epx.AbortedError naming rank 2, long
before the collective's 100 s timeout)."""
import sys
import time

import epx


def main():
    t = epx.mpi_transport()
    t.barrier()
    if t.rank == 2:
        raise RuntimeError("rank 2 fails on purpose")
    start = time.monotonic()
    try:
        t.barrier(timeout=100.0)
    except epx.Error as error:
        print(f"rank {t.rank}: {type(error).__name__} after {time.monotonic() - start:.1f} s: {error}", flush=True)
        sys.exit(3)
    print(f"rank {t.rank}: the barrier returned", flush=True)


if __name__ == "__main__":
    main()
