"""Transports from Python: topology, collectives, groups, abort."""

import numpy as np
import pytest

import epx


def test_topology_properties():
    def rank_fn(t):
        return t.rank, t.num_ranks, t.num_nodes, t.node, t.local_rank, t.backend

    got = epx.InprocWorld(4, 2).run(rank_fn)
    assert got == [(r, 4, 2, r // 2, r % 2, "inproc") for r in range(4)]


def test_run_returns_values_in_rank_order_and_connect_checks_the_rank():
    world = epx.InprocWorld(3)
    assert world.run(lambda t: t.rank * 10) == [0, 10, 20]
    with pytest.raises(epx.InvalidArgumentError, match="rank"):
        world.connect(3)
    with pytest.raises(epx.InvalidArgumentError):
        epx.InprocWorld(4, 3)  # 4 ranks do not split into 3 nodes


def test_all_reduce_barrier_split():
    def rank_fn(t):
        t.barrier(timeout=10.0)
        s = t.all_reduce(np.array([t.rank + 1.0, 2.0], np.float64))
        m = t.all_reduce(np.array([t.rank], np.int32), op="max")
        group = t.split(color=t.rank % 2, key=-t.rank)
        g = group.all_reduce(np.array([t.rank], np.int64))
        return s.tolist(), int(m[0]), group.rank, group.num_ranks, int(g[0])

    got = epx.InprocWorld(4).run(rank_fn)
    for r, (s, m, grank, gsize, g) in enumerate(got):
        assert s == [10.0, 8.0] and m == 3
        assert gsize == 2 and g == (2 if r % 2 == 0 else 4)
        assert grank == (1 if r < 2 else 0)  # key -rank: the higher rank comes first


def test_bad_collective_arguments():
    def rank_fn(t):
        with pytest.raises(epx.InvalidArgumentError, match="op"):
            t.all_reduce(np.zeros(2, np.float32), op="prod")
        with pytest.raises(epx.InvalidArgumentError, match="array"):
            t.all_reduce(np.zeros(2, np.uint16))
        with pytest.raises(epx.InvalidArgumentError, match="contiguous"):
            t.all_reduce(np.zeros(4, np.float32)[::2])
        with pytest.raises(epx.InvalidArgumentError, match="timeout"):
            t.barrier(timeout=-1.0)
        return True

    assert epx.InprocWorld(1).run(rank_fn) == [True]


def test_abort_reaches_the_other_ranks():
    def rank_fn(t):
        if t.rank == 0:
            t.abort("stop here")
            return "aborted"
        t.barrier(timeout=20.0)

    with pytest.raises(epx.AbortedError, match="stop here"):
        epx.InprocWorld(2).run(rank_fn)
