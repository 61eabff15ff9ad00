"""Run under `mpirun -n 4` (python/CMakeLists.txt): LowLatencyBuffer's
exchange and the load sums over MPI against the numpy references of
ll_reference.py, on one node (no argument or 0) or on emulated nodes of N
ranks (argument N); a second argument lists the libraries (numpy: f32 rows,
torch: bf16 rows; default both). Every rank exits 0 when its checks pass."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import epx  # noqa: E402
from ll_reference import check_exchange  # noqa: E402


def main():
    ranks_per_node = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    t = epx.mpi_transport(ranks_per_node=ranks_per_node)
    expect_nodes = t.num_ranks // ranks_per_node if ranks_per_node else 1
    assert t.num_nodes == expect_nodes, (t.num_nodes, expect_nodes)
    libraries = sys.argv[2].split(",") if len(sys.argv) > 2 else ["numpy", "torch"]
    for seed, library in enumerate(libraries):
        check_exchange(epx, t, 11 + seed, library)
    load = epx.sum_load_over_ranks(t, np.arange(8, dtype=np.int64) * (t.rank + 1))
    np.testing.assert_array_equal(load, np.arange(8) * sum(range(1, t.num_ranks + 1)))
    print(f"rank {t.rank}: the exchange matches the reference on {t.num_nodes} node(s) ({t.backend})", flush=True)


if __name__ == "__main__":
    main()
