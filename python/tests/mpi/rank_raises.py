"""One rank of `mpirun -n 4`: rank 2 raises in Python while the others wait
for it in a dispatch. Each other rank prints the exception it got and exits
3 (expect_abort.py checks it was epx.AbortedError naming rank 2, long before
the dispatch's 100 s timeout)."""
import sys
import time

import numpy as np

import epx


def main():
    t = epx.mpi_transport()
    buf = epx.Buffer(t, num_experts=8, hidden=16, dtype="f32", max_tokens_per_rank=4, max_topk=2, timeout=100.0)
    if t.rank == 2:
        raise RuntimeError("rank 2 fails on purpose")
    start = time.monotonic()
    try:
        buf.dispatch(np.ones((4, 16), dtype=np.float32), np.array([[0, 5]] * 4, dtype=np.int32))
    except epx.Error as error:
        print(f"rank {t.rank}: {type(error).__name__} after {time.monotonic() - start:.1f} s: {error}", flush=True)
        sys.exit(3)
    print(f"rank {t.rank}: the dispatch returned", flush=True)


if __name__ == "__main__":
    main()
