"""epx.LowLatencyBuffer on in-process worlds against the numpy reference of
its documented layout (ll_reference.py): recv_x rows, their sources and
counts, and combine's sums bit for bit; results are copies; the async forms;
over-capacity and bad inputs fail on every rank and the next call works."""
import re

import numpy as np
import pytest

import epx
from ll_reference import (as_numpy, check_dispatch, check_exchange, expected_combine, expected_combine_per_rank,
                          expert_output, rank_inputs, tokens_of)

E, H, K = 8, 16, 3


def world_inputs(seed, num_ranks):
    return [rank_inputs(seed, r, tokens_of(r), E, H, K) for r in range(num_ranks)]


@pytest.mark.parametrize("num_ranks, num_nodes", [(1, 1), (2, 1), (4, 1), (4, 2)])
@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_dispatch_combine_match_reference(num_ranks, num_nodes, library):
    def fn(t):
        check_exchange(epx, t, num_ranks + num_nodes, library)
        return True

    assert epx.InprocWorld(num_ranks=num_ranks, num_nodes=num_nodes).run(fn) == [True] * num_ranks


def test_async_forms_and_out():
    num_ranks = 4
    inputs = world_inputs(5, num_ranks)
    xs, idxs = [x for x, _, _ in inputs], [i for _, i, _ in inputs]
    ones = [np.ones_like(w) for _, _, w in inputs]

    def fn(t):
        x, idx, _ = inputs[t.rank]
        buf = epx.LowLatencyBuffer(t, E, H, dtype="f32", max_tokens_per_rank=16, max_topk=K)
        op = buf.dispatch_async(x, idx)  # no weights: 1
        r = op.wait(timeout=30.0)
        assert op.done() and op.wait() is r
        got = as_numpy(r)
        check_dispatch(got, xs, idxs, t.rank, E, num_ranks, buf.capacity)
        out = np.full((x.shape[0], H), np.nan, dtype=np.float32)
        pending = buf.combine_async(expert_output(got["recv_x"], t.rank), r.handle, out=out)
        assert pending.wait() is out
        np.testing.assert_array_equal(out, expected_combine(xs, idxs, ones, t.rank, E, num_ranks))
        return True

    assert epx.InprocWorld(num_ranks=num_ranks).run(fn) == [True] * num_ranks


def test_second_dispatch_before_wait_is_refused():
    def fn(t):
        x, idx, _ = rank_inputs(1, 0, 4, E, H, K)
        buf = epx.LowLatencyBuffer(t, E, H, dtype="f32", max_tokens_per_rank=4, max_topk=K)
        op = buf.dispatch_async(x, idx)
        with pytest.raises(epx.FailedPreconditionError, match="dispatch_async not yet waited"):
            buf.dispatch(x, idx)
        return True

    assert epx.InprocWorld(num_ranks=1).run(fn) == [True]


def test_over_capacity_fails_everywhere_then_works():
    num_ranks = 2
    inputs = world_inputs(9, num_ranks)

    def fn(t):
        x, idx, w = inputs[t.rank]
        buf = epx.LowLatencyBuffer(t, E, H, dtype="f32", max_tokens_per_rank=16, max_topk=K, capacity=2)
        crowded = idx.copy()
        if t.rank == 0:
            crowded[:, 0] = 5  # 3 rows for expert 5 from rank 0: more than capacity 2
            crowded[:, 1:] = np.where(crowded[:, 1:] == 5, -1, crowded[:, 1:])
        with pytest.raises(epx.ResourceExhaustedError, match="capacity"):
            buf.dispatch(x, crowded, w)
        light = np.full_like(idx, -1)
        light[:, 0] = np.arange(idx.shape[0]) % E
        r = buf.dispatch(x, light, w)
        assert int(np.asarray(r.num_recv_tokens_per_expert).sum()) == sum(
            int((np.arange(tokens_of(s)) % E // (E // num_ranks) == t.rank).sum()) for s in range(num_ranks))
        return True

    assert epx.InprocWorld(num_ranks=num_ranks).run(fn) == [True] * num_ranks


def test_bad_input_on_one_rank_aborts_the_call_on_the_others():
    num_ranks = 4

    def fn(t):
        x, idx, w = rank_inputs(3, t.rank, 4, E, H, K)
        buf = epx.LowLatencyBuffer(t, E, H, dtype="f32", max_tokens_per_rank=4, max_topk=K)
        if t.rank == 2:
            with pytest.raises(epx.InvalidArgumentError, match="topk_idx"):
                buf.dispatch(x, np.full_like(idx, E), w)  # an expert id out of range
        else:
            with pytest.raises(epx.AbortedError):
                buf.dispatch(x, idx, w)
        r = buf.dispatch(x, idx, w)  # the next call works
        buf.combine(expert_output(np.asarray(r.recv_x), t.rank), r.handle)
        return True

    assert epx.InprocWorld(num_ranks=num_ranks).run(fn) == [True] * num_ranks


def test_bad_arguments_raise_before_anything_is_sent():
    def fn(t):
        with pytest.raises(epx.InvalidArgumentError, match="dtype"):
            epx.LowLatencyBuffer(t, E, H, dtype="int7", max_tokens_per_rank=4)
        with pytest.raises(epx.InvalidArgumentError, match="timeout"):
            epx.LowLatencyBuffer(t, E, H, max_tokens_per_rank=4, timeout=0)
        buf = epx.LowLatencyBuffer(t, E, H, dtype="f32", max_tokens_per_rank=4, max_topk=K)
        x, idx, w = rank_inputs(4, 0, 4, E, H, K)
        with pytest.raises(epx.InvalidArgumentError, match="handle"):
            buf.combine(np.zeros((E, 4, H), np.float32), object())
        with pytest.raises(epx.InvalidArgumentError, match="x"):
            buf.dispatch(x.astype(np.float64), idx, w)
        with pytest.raises(epx.InvalidArgumentError, match="topk_idx"):
            buf.dispatch(x, idx.astype(np.float32), w)
        return True

    assert epx.InprocWorld(num_ranks=1).run(fn) == [True]


@pytest.mark.parametrize("num_ranks, num_nodes", [(2, 1), (4, 1), (4, 2)])
def test_combine_per_rank_sums_each_rank_first(num_ranks, num_nodes):
    """combine_per_rank=True reaches LowLatencyConfig: out is the owners' per-rank sums added in
    the order of their first slot, bit for bit, which is not the default top-k order's bits."""
    inputs = [rank_inputs(31, r, 12, E, H, K) for r in range(num_ranks)]
    xs, idxs, ws = ([inp[i] for inp in inputs] for i in range(3))

    def fn(t):
        x, idx, w = inputs[t.rank]
        buf = epx.LowLatencyBuffer(t, E, H, dtype="f32", max_tokens_per_rank=12, max_topk=K, combine_per_rank=True)
        assert buf.combine_per_rank
        r = buf.dispatch(x, idx, w)
        return buf.combine(expert_output(np.asarray(r.recv_x), t.rank), r.handle)

    outs = epx.InprocWorld(num_ranks=num_ranks, num_nodes=num_nodes).run(fn)
    differ = 0
    for rank, out in enumerate(outs):
        want = expected_combine_per_rank(xs, idxs, ws, rank, E, num_ranks)
        assert np.count_nonzero(want) > 0
        np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32), err_msg=f"rank {rank}")
        differ += np.count_nonzero(want.view(np.uint32) != expected_combine(xs, idxs, ws, rank, E, num_ranks).view(np.uint32))
    assert differ > 0, "the per-rank order gave the default's bits everywhere: the test cannot tell them apart"


def test_combine_per_rank_must_be_a_bool():
    def fn(t):
        for bad, shown in ((1, "1 (int)"), ("yes", "'yes' (str)"), (None, "None (NoneType)")):
            with pytest.raises(epx.InvalidArgumentError, match=rf"combine_per_rank = {re.escape(shown)} is not a bool"):
                epx.LowLatencyBuffer(t, E, H, max_tokens_per_rank=4, combine_per_rank=bad)
        assert not epx.LowLatencyBuffer(t, E, H, max_tokens_per_rank=4).combine_per_rank
        return True

    assert epx.InprocWorld(num_ranks=1).run(fn) == [True]


def test_one_token_torch_rows():
    """torch exports a [1, H] tensor with strides (1, 1): still a matrix (a decode step of one token)."""
    import torch

    def fn(t):
        buf = epx.LowLatencyBuffer(t, E, H, dtype="bf16", max_tokens_per_rank=1, max_topk=K)
        x = torch.arange(H, dtype=torch.float32).reshape(1, H).bfloat16()
        r = buf.dispatch(x, torch.tensor([[t.rank, -1, 7 - t.rank]], dtype=torch.int32))
        out = buf.combine(r.recv_x.float(), r.handle)
        assert out.shape == (1, H)
        return out

    for out in epx.InprocWorld(num_ranks=2).run(fn):
        assert torch.equal(out, 2 * torch.arange(H, dtype=torch.float32).reshape(1, H))
