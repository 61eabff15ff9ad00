"""Every bad input raises the right exception class, naming the argument, before anything is sent;
a failing rank makes the others fail (AbortedError) instead of hanging; timeouts raise TimeoutError."""

import time

import numpy as np
import pytest

import epx

H = 8


def one_rank(fn):
    """fn(buffer) on a 1-rank world; returns its value (exceptions come back as raised, "rank 0: ...")."""
    def rank_fn(t):
        buf = epx.Buffer(t, num_experts=4, hidden=H, dtype="f32", max_tokens_per_rank=4, max_topk=2, timeout=10.0)
        return fn(buf)
    return epx.InprocWorld(1).run(rank_fn)[0]


def good():
    return np.ones((3, H), np.float32), np.array([[0, 1], [2, -1], [3, 0]], np.int32)


def test_the_classes_follow_the_table():
    assert issubclass(epx.InvalidArgumentError, ValueError)
    assert issubclass(epx.OutOfRangeError, ValueError)
    assert issubclass(epx.DeadlineExceededError, TimeoutError)
    assert issubclass(epx.UnimplementedError, NotImplementedError)
    assert issubclass(epx.NotFoundError, LookupError)
    assert issubclass(epx.BufferInUseError, epx.FailedPreconditionError)
    assert issubclass(epx.StaleViewError, epx.FailedPreconditionError)
    assert issubclass(epx.Error, RuntimeError)
    assert epx.AbortedError("x").code == "Aborted"


@pytest.mark.parametrize("name,make", [
    ("x", lambda: (np.ones((3, H + 1), np.float32), good()[1])),              # shape
    ("x", lambda: (np.ones((3, H), np.float64), good()[1])),                  # dtype
    ("x", lambda: (np.ones((3, 2 * H), np.float32)[:, ::2], good()[1])),      # stride
    ("x", lambda: ([[1.0] * H] * 3, good()[1])),                             # type
    ("x", lambda: (None, good()[1])),                                        # None
    ("topk_idx", lambda: (good()[0], np.array([[0, 1], [2, -1], [2**40, 0]], np.int64))),  # int64 out of range
    ("topk_idx", lambda: (good()[0], good()[1].astype(np.float32))),          # dtype
    ("topk_idx", lambda: (good()[0], np.array([[0, 1], [2, -1], [9, 0]], np.int32))),  # expert out of range
    ("x", lambda: (good()[0], good()[1][:2])),                                # rows differ from topk_idx
])
def test_bad_dispatch_inputs(name, make):
    x, idx = make()
    with pytest.raises(epx.InvalidArgumentError) as info:
        one_rank(lambda buf: buf.dispatch(x, idx))
    assert name in str(info.value), str(info.value)
    assert info.value.code == "InvalidArgument"


def test_int64_ids_in_range_are_taken():
    x, idx = good()
    got = one_rank(lambda buf: np.array(buf.dispatch(x, idx.astype(np.int64)).recv_topk_idx))
    assert got.dtype == np.int32 and got.shape == (3, 2)


def test_bad_combine_inputs():
    x, idx = good()

    def fn(buf):
        res = buf.dispatch(x, idx)
        for args, name in [((np.ones((3, H), np.float32), "not a handle"), "handle"),
                           ((np.ones((2, H), np.float32), res.handle), "y"),
                           ((np.ones((3, H), np.float32), res.handle, np.ones((3, H + 1), np.float32)), "out")]:
            with pytest.raises(epx.InvalidArgumentError) as info:
                buf.combine(*args)
            assert name in str(info.value), str(info.value)
        return True

    assert one_rank(fn)


def test_bad_buffer_configs():
    def make(**kw):
        return epx.InprocWorld(2).run(lambda t: epx.Buffer(t, **kw) and None)

    with pytest.raises(epx.InvalidArgumentError, match="dtype"):
        make(num_experts=4, hidden=H, dtype="f16", max_tokens_per_rank=4)
    with pytest.raises(epx.Error):
        make(num_experts=3, hidden=H, dtype="f32", max_tokens_per_rank=4)  # 3 experts on 2 ranks
    with pytest.raises(TypeError):
        epx.Buffer("not a transport", num_experts=4, hidden=H)


torch = pytest.importorskip("torch")


@pytest.mark.parametrize("make,what", [
    (lambda: torch.ones(3, H, requires_grad=True), "grad"),
    (lambda: torch.ones(3, H, device="meta"), "meta"),
    (lambda: torch.ones(3, H, dtype=torch.float16), "float16"),
])
def test_bad_tensors(make, what):
    x = make()
    idx = torch.tensor(good()[1])
    with pytest.raises(epx.InvalidArgumentError) as info:
        one_rank(lambda buf: buf.dispatch(x, idx))
    assert "x" in str(info.value) and what in str(info.value), str(info.value)


def test_a_rank_that_raises_makes_the_others_fail_with_aborted():
    seen = {}

    def rank_fn(t):
        buf = epx.Buffer(t, num_experts=4, hidden=H, dtype="f32", max_tokens_per_rank=4, max_topk=2, timeout=20.0)
        if t.rank == 1:
            raise ValueError("boom")
        try:
            x, idx = good()
            buf.dispatch(x, idx)
        except Exception as e:
            seen[t.rank] = e
            raise

    start = time.monotonic()
    with pytest.raises(ValueError, match="^rank 1: boom"):
        epx.InprocWorld(2).run(rank_fn)
    assert time.monotonic() - start < 10
    assert isinstance(seen[0], epx.AbortedError), repr(seen[0])
    assert "rank 1" in str(seen[0])


def test_a_late_peer_gives_deadline_exceeded():
    def rank_fn(t):
        buf = epx.Buffer(t, num_experts=4, hidden=H, dtype="f32", max_tokens_per_rank=4, max_topk=2, timeout=0.3)
        if t.rank == 1:
            time.sleep(1.0)
        x, idx = good()
        buf.dispatch(x, idx)

    with pytest.raises(epx.DeadlineExceededError) as info:
        epx.InprocWorld(2).run(rank_fn)
    assert isinstance(info.value, TimeoutError)
    assert str(info.value).startswith("rank 0: ")


def test_barrier_timeout():
    def rank_fn(t):
        if t.rank == 1:
            time.sleep(0.8)
            return
        t.barrier(timeout=0.2)

    with pytest.raises(TimeoutError):
        epx.InprocWorld(2).run(rank_fn)
