"""Run under `mpirun -n 4` (python/CMakeLists.txt): Buffer's dispatch and
combine against exchange_ref.py and LowLatencyBuffer's against
ll_reference.py, bit for bit, and the load sums, over MPI: on one node (no
argument or 0) or on emulated nodes of N ranks (argument N). A second
argument lists the payload dtypes (default f32,bf16; bf16 LowLatencyBuffer
rows come from torch). Every rank exits 0 when its checks pass."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import epx  # noqa: E402
from exchange_ref import bf16_bits, bf16_values, combine_reference, make_inputs, reference  # noqa: E402
from ll_reference import check_exchange  # noqa: E402

TOKENS = [5, 9, 0, 3]


def check_buffer_exchange(t, dtype, seed, hidden=16, experts_per_rank=4, topk=3):
    """This rank's dispatch and combine against the reference of every rank's inputs."""
    num_ranks, num_experts = t.num_ranks, experts_per_rank * t.num_ranks
    tokens = TOKENS[:num_ranks]
    xs, idxs, ws = make_inputs(num_ranks, num_experts, topk, tokens, hidden, dtype, seed, holes=True)
    refs = reference(num_ranks, num_experts, xs, idxs, ws)
    rng = np.random.default_rng(seed + 1)
    ys = [rng.standard_normal((len(ref.src), hidden)).astype(np.float32) for ref in refs]
    if dtype == "bf16":
        ys = [bf16_bits(y) for y in ys]
    r, ref = t.rank, refs[t.rank]
    buf = epx.Buffer(t, num_experts=num_experts, hidden=hidden, dtype=dtype, max_tokens_per_rank=max(tokens),
                     max_topk=topk, timeout=60.0)
    res = buf.dispatch(xs[r], idxs[r], ws[r])
    for name, want in (("recv_x", ref.x), ("recv_topk_idx", ref.topk_idx), ("recv_topk_weights", ref.topk_weights),
                       ("recv_src_rank", ref.src_rank), ("recv_src_idx", ref.src_idx)):
        np.testing.assert_array_equal(np.array(getattr(res, name)), want, err_msg=f"rank {r}: {name}")
    assert list(res.num_recv_tokens_per_expert) == ref.counts
    out = buf.combine(ys[r], res.handle)
    yv = [bf16_values(y) if dtype == "bf16" else y for y in ys]
    want = combine_reference(refs, yv, tokens, hidden, t.num_nodes, dtype == "bf16")[r]
    np.testing.assert_array_equal(out, want, err_msg=f"rank {r}: combine")


def main():
    ranks_per_node = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    dtypes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["f32", "bf16"]
    t = epx.mpi_transport(ranks_per_node=ranks_per_node)
    expect_nodes = t.num_ranks // ranks_per_node if ranks_per_node else 1
    assert t.num_nodes == expect_nodes, (t.num_nodes, expect_nodes)
    for seed, dtype in enumerate(dtypes):
        check_buffer_exchange(t, dtype, 21 + seed)
        check_exchange(epx, t, 11 + seed, "numpy" if dtype == "f32" else "torch")
    load = epx.sum_load_over_ranks(t, np.arange(8, dtype=np.int64) * (t.rank + 1))
    np.testing.assert_array_equal(load, np.arange(8) * sum(range(1, t.num_ranks + 1)))
    print(f"rank {t.rank}: the exchange matches the references on {t.num_nodes} node(s) ({t.backend})", flush=True)


if __name__ == "__main__":
    main()
