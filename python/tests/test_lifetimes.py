"""Region views are zero-copy and guarded (docs/python.md, "Lifetimes")."""

import gc

import numpy as np
import pytest

import epx

H = 8


def make_buffer(t):
    return epx.Buffer(t, num_experts=2 * t.num_ranks, hidden=H, dtype="f32", max_tokens_per_rank=4, max_topk=2,
                      timeout=20.0)


def inputs(rank, scale=1.0):
    x = (np.arange(4 * H, dtype=np.float32).reshape(4, H) + 100 * rank) * scale
    idx = np.array([[0, 1], [1, 2], [2, 3], [3, 0]], dtype=np.int32)
    return x, idx


def test_a_view_survives_the_buffer_object():
    def rank_fn(t):
        buf = make_buffer(t)
        res = buf.dispatch(*inputs(t.rank))
        view = res.recv_x
        expected = view.copy()
        del buf, res
        gc.collect()
        return np.array_equal(view, expected) and view.base is not None

    assert all(epx.InprocWorld(2).run(rank_fn))


def test_a_stale_result_raises():
    def rank_fn(t):
        buf = make_buffer(t)
        first = buf.dispatch(*inputs(t.rank))
        kept = first.recv_x.copy()
        buf.dispatch(*inputs(t.rank, scale=2.0))
        assert first.is_stale
        with pytest.raises(epx.StaleViewError, match="recv_x"):
            first.recv_x
        # what lives in the handle stays readable
        assert np.array(first.recv_src_rank).shape[0] == kept.shape[0]
        return True

    assert all(epx.InprocWorld(2).run(rank_fn))


def test_a_held_view_makes_the_next_dispatch_raise_and_the_peers_abort():
    seen = {}

    def rank_fn(t):
        buf = make_buffer(t)
        res = buf.dispatch(*inputs(t.rank))
        held = res.recv_x[1:] if t.rank == 0 else None  # a slice of the view keeps it referenced
        try:
            buf.dispatch(*inputs(t.rank))
        except epx.Error as e:
            seen[t.rank] = e
            raise
        return held

    with pytest.raises(epx.BufferInUseError, match="^rank 0: .*receive region"):
        epx.InprocWorld(3).run(rank_fn)
    assert isinstance(seen[0], epx.BufferInUseError)
    for r in (1, 2):
        assert isinstance(seen[r], epx.AbortedError), repr(seen[r])
        assert "rank 0" in str(seen[r]), str(seen[r])


def test_a_copy_is_fine():
    def rank_fn(t):
        buf = make_buffer(t)
        res = buf.dispatch(*inputs(t.rank))
        kept = res.recv_x.copy()
        res2 = buf.dispatch(*inputs(t.rank, scale=2.0))
        return np.array_equal(np.array(res2.recv_x), 2 * kept)

    assert all(epx.InprocWorld(2).run(rank_fn))


def test_combine_input_is_written_in_place_and_guarded():
    def rank_fn(t):
        buf = make_buffer(t)
        x, idx = inputs(t.rank)
        res = buf.dispatch(x, idx)
        y = buf.combine_input(res.handle)
        y[:] = res.recv_x
        out = buf.combine(y, res.handle)  # y is the combine region itself: allowed
        del y
        out2 = buf.combine(np.array(res.recv_x), res.handle)
        return np.array_equal(out, out2)

    assert all(epx.InprocWorld(2).run(rank_fn))


torch = pytest.importorskip("torch")


def test_torch_views_are_zero_copy_and_guarded():
    def rank_fn(t):
        buf = make_buffer(t)
        x, idx = inputs(t.rank)
        res = buf.dispatch(torch.from_numpy(x), torch.from_numpy(idx))
        view = res.recv_x
        assert isinstance(view, torch.Tensor)
        assert view.data_ptr() == res.recv_x.data_ptr()  # the same region memory
        kept = view.clone()
        del buf, res
        gc.collect()
        return bool(torch.equal(view, kept))

    assert all(epx.InprocWorld(2).run(rank_fn))

    def holds(t):
        buf = make_buffer(t)
        x, idx = inputs(t.rank)
        res = buf.dispatch(torch.from_numpy(x), torch.from_numpy(idx))
        held = res.recv_x.view(-1)[:3] if t.rank == 1 else None
        buf.dispatch(torch.from_numpy(x), torch.from_numpy(idx))
        return held

    with pytest.raises(epx.BufferInUseError, match="^rank 1: "):
        epx.InprocWorld(2).run(holds)
