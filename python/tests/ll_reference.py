"""A numpy reference of LowLatencyBuffer's documented layout
(epx/exchange/low_latency.h), shared by the in-process and mpirun tests.

dispatch: recv_x [E_local, R * capacity, H] holds, for local expert e, one row
per (source rank, source token) naming it, in (source rank, source token)
order, with its source rank, token index and slot; recv_src_rank is -1 past
the count. combine: out[t] = sum over k ascending of w[t][k] * y(t, k) in
float32, slots with expert -1 skipped.
"""
import numpy as np


def rank_inputs(seed, rank, num_tokens, num_experts, hidden, topk):
    """One rank's x (float32), topk_idx (int32, -1 for some slots, no expert twice) and weights."""
    rng = np.random.default_rng(seed * 1000 + rank)
    x = rng.standard_normal((num_tokens, hidden)).astype(np.float32)
    idx = np.array([rng.permutation(num_experts)[:topk] for _ in range(num_tokens)], dtype=np.int32)
    idx = idx.reshape(num_tokens, topk)
    idx[rng.random(idx.shape) < 0.15] = -1
    w = rng.random((num_tokens, topk)).astype(np.float32)
    return x, idx, w


def expected_rows(idxs, rank, num_experts, num_ranks):
    """For each local expert of `rank` (contiguous placement): its (source, token, slot) rows in order."""
    per_rank = num_experts // num_ranks
    rows = []
    for local in range(per_rank):
        expert = rank * per_rank + local
        rows.append([(s, t, k) for s, idx in enumerate(idxs) for t in range(idx.shape[0])
                     for k in range(idx.shape[1]) if idx[t, k] == expert])
    return rows


def check_dispatch(result, xs, idxs, rank, num_experts, num_ranks, capacity):
    """Asserts result (numpy arrays) against the reference; x rows compared bit for bit."""
    rows = expected_rows(idxs, rank, num_experts, num_ranks)
    recv_x = np.asarray(result["recv_x"])
    assert recv_x.shape == (len(rows), num_ranks * capacity, xs[0].shape[1])
    np.testing.assert_array_equal(result["num_recv_tokens_per_expert"], [len(r) for r in rows])
    for local, expert_rows in enumerate(rows):
        n = len(expert_rows)
        src = np.array(expert_rows, dtype=np.int32).reshape(n, 3)
        np.testing.assert_array_equal(result["recv_src_rank"][local, :n], src[:, 0])
        np.testing.assert_array_equal(result["recv_src_idx"][local, :n], src[:, 1])
        np.testing.assert_array_equal(result["recv_src_slot"][local, :n], src[:, 2])
        assert (result["recv_src_rank"][local, n:] == -1).all()
        want = np.stack([xs[s][t] for s, t, _ in expert_rows]) if n else np.zeros((0, recv_x.shape[2]))
        np.testing.assert_array_equal(recv_x[local, :n].view(np.uint32), want.astype(np.float32).view(np.uint32))


def expert_output(recv_x, rank):
    """What the test's 'experts' make of their rows: x * (local + 1.5) + rank, in float32."""
    local = np.arange(recv_x.shape[0], dtype=np.float32).reshape(-1, 1, 1)
    return (recv_x.astype(np.float32) * (local + np.float32(1.5)) + np.float32(rank)).astype(np.float32)


def expected_combine(xs, idxs, ws, rank, num_experts, num_ranks):
    """out [T, H] of `rank` when every rank's y is expert_output of its rows: float32, documented order."""
    per_rank = num_experts // num_ranks
    idx, w, x = idxs[rank], ws[rank], xs[rank]
    out = np.zeros(x.shape, dtype=np.float32)
    for t in range(idx.shape[0]):
        acc = np.zeros(x.shape[1], dtype=np.float32)
        for k in range(idx.shape[1]):
            expert = idx[t, k]
            if expert < 0:
                continue
            d, local = expert // per_rank, expert % per_rank
            y = (x[t] * np.float32(local + 1.5) + np.float32(d)).astype(np.float32)
            acc = (acc + (np.float32(w[t, k]) * y).astype(np.float32)).astype(np.float32)
        out[t] = acc
    return out


def expected_combine_per_rank(xs, idxs, ws, rank, num_experts, num_ranks):
    """out [T, H] of `rank` with combine_per_rank and float32 y (expert_output): each owner's
    sum over the token's slots on it (k ascending, from 0), then those sums added from 0 in
    the order of each owner's first slot."""
    per_rank = num_experts // num_ranks
    idx, w, x = idxs[rank], ws[rank], xs[rank]
    out = np.zeros(x.shape, dtype=np.float32)
    for t in range(idx.shape[0]):
        owners = []
        for expert in idx[t]:
            if expert >= 0 and expert // per_rank not in owners:
                owners.append(expert // per_rank)
        acc = np.zeros(x.shape[1], dtype=np.float32)
        for d in owners:
            partial = np.zeros(x.shape[1], dtype=np.float32)
            for k, expert in enumerate(idx[t]):
                if expert >= 0 and expert // per_rank == d:
                    y = (x[t] * np.float32(expert % per_rank + 1.5) + np.float32(d)).astype(np.float32)
                    partial = (partial + (np.float32(w[t, k]) * y).astype(np.float32)).astype(np.float32)
            acc = (acc + partial).astype(np.float32)
        out[t] = acc
    return out


def tokens_of(rank):
    """Tokens of each rank in the shared checks: rank 1 has none."""
    return 0 if rank == 1 else 2 * rank + 3


def check_exchange(epx, t, seed, library, num_experts=8, hidden=16, topk=3, capacity=8):
    """One rank's part of a checked LowLatencyBuffer step on transport t (any
    backend): dispatch, the reference's rows, combine bit for bit, a second
    step leaving the first step's copies alone. library: numpy (f32) or
    torch (bf16 payload)."""
    if library == "torch":
        import torch  # only here: importing it costs seconds per process under mpirun

    num_ranks = t.num_ranks
    inputs = [rank_inputs(seed, r, tokens_of(r), num_experts, hidden, topk) for r in range(num_ranks)]
    if library == "torch":  # the reference sees the bf16-rounded rows
        xs = [torch.from_numpy(x).bfloat16().float().numpy() for x, _, _ in inputs]
    else:
        xs = [x for x, _, _ in inputs]
    idxs, ws = [i for _, i, _ in inputs], [w for _, _, w in inputs]
    x, idx, w = inputs[t.rank]
    if library == "torch":
        x, idx, w = torch.from_numpy(x).bfloat16(), torch.from_numpy(idx.astype(np.int64)), torch.from_numpy(w)
    buf = epx.LowLatencyBuffer(t, num_experts=num_experts, hidden=hidden, dtype="f32" if library == "numpy" else "bf16",
                               max_tokens_per_rank=16, max_topk=topk, capacity=capacity)
    assert buf.capacity == capacity and buf.num_local_experts == num_experts // num_ranks
    assert buf.region_bytes > 0
    r = buf.dispatch(x, idx, w)
    got = as_numpy(r)
    check_dispatch(got, xs, idxs, t.rank, num_experts, num_ranks, capacity)
    y = expert_output(got["recv_x"], t.rank)
    out = buf.combine(torch.from_numpy(y) if library == "torch" else y, r.handle)
    assert isinstance(out, np.ndarray) == (library == "numpy")
    want = expected_combine(xs, idxs, ws, t.rank, num_experts, num_ranks)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint32), want.view(np.uint32))
    before = got["recv_x"].copy()
    r2 = buf.dispatch(x, idx, w)
    np.testing.assert_array_equal(as_numpy(r)["recv_x"], before)
    buf.combine(expert_output(as_numpy(r2)["recv_x"], t.rank), r2.handle)


def as_numpy(result):
    """A LowLatencyDispatchResult's arrays as numpy (bf16 rows as float32)."""
    out = {}
    for key in ("recv_x", "num_recv_tokens_per_expert", "recv_src_rank", "recv_src_idx", "recv_src_slot"):
        value = getattr(result, key)
        if key == "recv_x" and hasattr(value, "float"):
            value = value.float()
        out[key] = np.asarray(value)
    return out
