"""The GIL is released inside every epx call that may wait."""

import threading
import time

import numpy as np

import epx


def small_buffer(t, hidden=8):
    return epx.Buffer(t, num_experts=2 * t.num_ranks, hidden=hidden, dtype="f32", max_tokens_per_rank=4, max_topk=2,
                      timeout=20.0)


def inputs(rank, hidden=8):
    x = np.full((4, hidden), rank, dtype=np.float32)
    idx = np.array([[0, 1], [1, 2], [2, 3], [3, 0]], dtype=np.int32)
    return x, idx


def spin(seconds):
    """Python work (it needs the GIL) for `seconds`; the number of iterations."""
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
    return n


def test_a_python_thread_runs_during_a_dispatch_waiting_for_a_late_peer():
    counter = [0]
    stop = threading.Event()

    def count():
        while not stop.is_set():
            counter[0] += 1

    def rank_fn(t):
        buf = small_buffer(t)
        x, idx = inputs(t.rank)
        if t.rank == 1:
            spin(0.4)  # late, and busy in Python: a dispatch holding the GIL would starve it
            buf.dispatch(x, idx)
            return None
        before, start = counter[0], time.monotonic()
        buf.dispatch(x, idx)
        return counter[0] - before, time.monotonic() - start

    thread = threading.Thread(target=count)
    thread.start()
    try:
        counted, waited = epx.InprocWorld(2).run(rank_fn)[0]
    finally:
        stop.set()
        thread.join()
    assert waited >= 0.2
    assert counted > 1000, f"the counting thread advanced {counted} times in {waited:.2f} s"


def test_in_process_ranks_in_python_threads_progress_together():
    world = epx.InprocWorld(4, 2)
    transports = [world.connect(r) for r in range(4)]
    results, errors = [None] * 4, []

    def rank_main(t):
        try:
            buf = small_buffer(t)
            x, idx = inputs(t.rank)
            total = 0.0
            for _ in range(5):
                res = buf.dispatch(x, idx)
                y = np.array(res.recv_x)
                total += float(buf.combine(y, res.handle).sum())
            results[t.rank] = total
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(t,)) for t in transports]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not errors, errors
    assert all(r is not None for r in results)


def test_the_benchmarks_cxx_timed_forms_give_the_public_results_after_a_barrier():
    """Buffer._timed_dispatch/_timed_combine (bench/python_exchange.py's C++ side) wait for every
    rank, then run the same operation: the same rows and sums as dispatch and combine."""

    def rank_fn(t):
        buf = small_buffer(t)
        _, idx = inputs(t.rank)
        # Values that name the rank, the token and the column.
        x = (100 * (t.rank + 1) + 10 * np.arange(4)[:, None] + np.arange(8)[None, :]).astype(np.float32)
        if t.rank == 1:
            spin(0.3)  # late: the other ranks' timed operations start after this one arrives
        arrived = time.monotonic()
        res, start, end = buf._timed_dispatch(x, idx)
        timed_rows = np.array(res.recv_x)
        out, c_start, c_end = buf._timed_combine(np.array(res.recv_x), res.handle)
        public = buf.dispatch(x, idx)
        want = buf.combine(np.array(public.recv_x), public.handle)
        assert start <= end <= c_start <= c_end
        np.testing.assert_array_equal(timed_rows, np.array(public.recv_x))
        np.testing.assert_array_equal(out, want)
        assert np.all(want != 0), "every token reaches a rank: no row of the combine may be zero"
        return arrived, start

    results = epx.InprocWorld(2).run(rank_fn)
    late_arrival = results[1][0]
    # perf_counter and the C++ clock are both CLOCK_MONOTONIC, as time.monotonic is here.
    assert results[0][1] >= late_arrival - 0.01, "rank 0's timed dispatch started before rank 1 arrived"
