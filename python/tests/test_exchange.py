"""The exchange from Python against the numpy reference of exchange_ref.py, bit for bit."""

import numpy as np
import pytest

import epx
from exchange_ref import bf16_bits, bf16_values, combine_reference, make_inputs, reference

SHAPES = [  # (ranks, nodes, tokens per rank)
    (1, 1, [7]),
    (4, 1, [5, 9, 0, 3]),
    (4, 2, [6, 2, 8, 4]),
    (8, 2, [3, 1, 4, 1, 5, 9, 2, 6]),
]


def exchange(num_ranks, num_nodes, tokens, dtype, holes=False, skew=False, hidden=16, experts_per_rank=4, topk=3,
             seed=0):
    """Dispatch and combine on an in-process world; returns what each rank got and the reference."""
    num_experts = experts_per_rank * num_ranks
    topk = min(topk, num_experts)
    xs, idxs, ws = make_inputs(num_ranks, num_experts, topk, tokens, hidden, dtype, seed, holes, skew)
    refs = reference(num_ranks, num_experts, xs, idxs, ws)
    rng = np.random.default_rng(seed + 1)
    ys = [rng.standard_normal((len(ref.src), hidden)).astype(np.float32) for ref in refs]
    if dtype == "bf16":
        ys = [bf16_bits(y) for y in ys]

    def rank_fn(t):
        r = t.rank
        buf = epx.Buffer(t, num_experts=num_experts, hidden=hidden, dtype=dtype, max_tokens_per_rank=max(tokens),
                         max_topk=topk, timeout=20.0)
        res = buf.dispatch(xs[r], idxs[r], ws[r])
        got = {name: np.array(getattr(res, name)) for name in
               ("recv_x", "recv_topk_idx", "recv_topk_weights", "recv_src_rank", "recv_src_idx")}
        got["counts"] = list(res.num_recv_tokens_per_expert)
        got["rows"] = (res.stats.rows_received, res.handle.num_recv_tokens, res.handle.num_tokens)
        got["out"] = buf.combine(ys[r], res.handle)
        return got

    got = epx.InprocWorld(num_ranks, num_nodes).run(rank_fn)
    yv = [bf16_values(y) if dtype == "bf16" else y for y in ys]
    outs = combine_reference(refs, yv, tokens, hidden, num_nodes, dtype == "bf16")
    return got, refs, outs


@pytest.mark.parametrize("num_ranks,num_nodes,tokens", SHAPES)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("holes,skew", [(False, False), (True, False), (False, True)])
def test_dispatch_and_combine_match_the_reference(num_ranks, num_nodes, tokens, dtype, holes, skew):
    got, refs, outs = exchange(num_ranks, num_nodes, tokens, dtype, holes, skew)
    for r, (g, ref) in enumerate(zip(got, refs)):
        np.testing.assert_array_equal(g["recv_src_rank"], ref.src_rank, err_msg=f"rank {r}")
        np.testing.assert_array_equal(g["recv_src_idx"], ref.src_idx, err_msg=f"rank {r}")
        np.testing.assert_array_equal(g["recv_x"], ref.x, err_msg=f"rank {r}")
        np.testing.assert_array_equal(g["recv_topk_idx"], ref.topk_idx, err_msg=f"rank {r}")
        np.testing.assert_array_equal(g["recv_topk_weights"], ref.topk_weights, err_msg=f"rank {r}")
        assert g["counts"] == ref.counts, f"rank {r}"
        assert g["rows"] == (len(ref.src), len(ref.src), tokens[r])
        same_bits(g["out"], outs[r], f"combine out of rank {r}")


def same_bits(a, b, msg=""):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, f"{msg}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    np.testing.assert_array_equal(np.ascontiguousarray(a).view(width), np.ascontiguousarray(b).view(width), err_msg=msg)


def world_inputs(num_ranks, tokens, hidden=16, experts_per_rank=3, topk=3, seed=5):
    num_experts = experts_per_rank * num_ranks
    xs, idxs, ws = make_inputs(num_ranks, num_experts, topk, tokens, hidden, "f32", seed, holes=True)
    return num_experts, xs, idxs, ws, reference(num_ranks, num_experts, xs, idxs, ws)


def sequential_sum(terms, shape):
    """fp32, first term first (np.cumsum adds in order)."""
    if not terms:
        return np.zeros(shape, np.float32)
    return np.cumsum(np.stack(terms).astype(np.float32), axis=0, dtype=np.float32)[-1]


def test_the_backward_passes_match_the_reference():
    R, N, tokens, H = 4, 2, [5, 3, 0, 6], 16
    E, xs, idxs, ws, refs = world_inputs(R, tokens, H)
    rng = np.random.default_rng(9)
    grad_recv = [rng.standard_normal((len(ref.src), H)).astype(np.float32) for ref in refs]
    grad_recv_w = [rng.standard_normal((len(ref.src), 3)).astype(np.float32) for ref in refs]
    grad_out = [rng.standard_normal((t, H)).astype(np.float32) for t in tokens]

    def rank_fn(t):
        r = t.rank
        buf = epx.Buffer(t, num_experts=E, hidden=H, dtype="f32", max_tokens_per_rank=8, max_topk=3)
        res = buf.dispatch(xs[r], idxs[r], ws[r])
        gx, gw = buf.dispatch_backward(grad_recv[r], res.handle, grad_recv_topk_weights=grad_recv_w[r])
        gy = np.array(buf.combine_backward(grad_out[r], res.handle))
        return gx, gw, gy

    got = epx.InprocWorld(R, N).run(rank_fn)
    expected_gx = combine_reference(refs, grad_recv, tokens, H, N, False)
    for s in range(R):
        same_bits(got[s][0], expected_gx[s], f"grad_x of rank {s}")
        per = E // R
        gw = np.zeros((tokens[s], 3), np.float32)
        for t in range(tokens[s]):
            for k, e in enumerate(idxs[s][t]):
                if e >= 0:
                    gw[t, k] = grad_recv_w[e // per][refs[e // per].row_of[(s, t)], k]
        same_bits(got[s][1], gw, f"grad_topk_weights of rank {s}")
        rows = [grad_out[src][t] for src, t in refs[s].src]
        same_bits(got[s][2], np.stack(rows) if rows else np.zeros((0, H), np.float32), f"grad_y of rank {s}")


def expanded_reference(ref, per, alignment):
    """expert_offsets, recv_row, row_of of one rank."""
    offsets, recv_row = [0], []
    row_of = np.full(ref.topk_idx.shape, -1, np.int64)
    for e in range(per):
        for row in range(ref.topk_idx.shape[0]):
            for k in np.nonzero(ref.topk_idx[row] == e)[0]:
                row_of[row, k] = len(recv_row)
                recv_row.append(row)
        while len(recv_row) % alignment:
            recv_row.append(-1)
        offsets.append(len(recv_row))
    return np.array(offsets), np.array(recv_row, np.int64), row_of


@pytest.mark.parametrize("alignment", [1, 4])
def test_the_expanded_layout_and_its_passes_match_the_reference(alignment):
    R, N, tokens, H = 4, 2, [6, 2, 5, 0], 16
    E, xs, idxs, ws, refs = world_inputs(R, tokens, H, seed=11)
    per = E // R
    rng = np.random.default_rng(3)
    grad_out = [rng.standard_normal((t, H)).astype(np.float32) for t in tokens]
    expected = [expanded_reference(ref, per, alignment) for ref in refs]
    y_exp = [rng.standard_normal((len(e[1]), H)).astype(np.float32) for e in expected]

    def rank_fn(t):
        r = t.rank
        buf = epx.Buffer(t, num_experts=E, hidden=H, dtype="f32", max_tokens_per_rank=8, max_topk=3,
                         expert_alignment=alignment)
        res = buf.dispatch(xs[r], idxs[r], ws[r])
        layout = buf.expanded_layout(res.handle)
        expanded = buf.expand(res.recv_x, res.handle)
        out = buf.combine_expanded(y_exp[r], res.handle)
        gy, gw = buf.combine_expanded_backward(grad_out[r], res.handle, y_exp[r], with_grad_weights=True)
        return layout, expanded, out, gy, gw

    got = epx.InprocWorld(R, N).run(rank_fn)
    partials = []
    for r, (ref, (offsets, recv_row, row_of)) in enumerate(zip(refs, expected)):
        layout, expanded = got[r][0], got[r][1]
        np.testing.assert_array_equal(layout.expert_offsets, offsets)
        np.testing.assert_array_equal(layout.recv_row, recv_row)
        np.testing.assert_array_equal(layout.row_of, row_of)
        assert layout.num_rows == len(recv_row)
        want = np.zeros((len(recv_row), H), np.float32)
        want[recv_row >= 0] = ref.x[recv_row[recv_row >= 0]]
        same_bits(expanded, want, f"expand on rank {r}")
        partials.append(np.stack([
            sequential_sum([ref.topk_weights[row, k] * y_exp[r][row_of[row, k]] for k in range(3) if row_of[row, k] >= 0],
                           (H,)) for row in range(len(ref.src))]) if ref.src else np.zeros((0, H), np.float32))
        gy = np.zeros((len(recv_row), H), np.float32)
        gw = np.zeros(ref.topk_idx.shape, np.float32)
        for row, (s, t) in enumerate(ref.src):
            for k in range(3):
                if row_of[row, k] >= 0:
                    gy[row_of[row, k]] = ref.topk_weights[row, k] * grad_out[s][t]
                    gw[row, k] = sequential_sum(list(grad_out[s][t] * y_exp[r][row_of[row, k]]), ())
        same_bits(got[r][3], gy, f"grad_y_expanded on rank {r}")
        same_bits(got[r][4], gw, f"grad_weights on rank {r}")
    outs = combine_reference(refs, partials, tokens, H, N, False)
    for s in range(R):
        same_bits(got[s][2], outs[s], f"combine_expanded out of rank {s}")


def receiver_reference(refs, expanded, yv, idxs, ws, tokens, hidden, per):
    """out per source rank with receiver weights: each token's rank sums w[t, k] * y(t, k) in
    fp32 from 0 in top-k order, y(t, k) the expanded row of slot k on the expert's rank."""
    outs = []
    for s, idx in enumerate(idxs):
        out = np.zeros((tokens[s], hidden), np.float32)
        for t in range(tokens[s]):
            acc = np.zeros(hidden, np.float32)
            for k, e in enumerate(idx[t]):
                if e >= 0:
                    d = e // per
                    row = expanded[d][2][refs[d].row_of[(s, t)], k]
                    acc = (acc + (np.float32(ws[s][t, k]) * yv[d][row]).astype(np.float32)).astype(np.float32)
            out[t] = acc
        outs.append(out)
    return outs


@pytest.mark.parametrize("num_ranks,num_nodes", [(1, 1), (4, 1), (4, 2)])
@pytest.mark.parametrize("y_dtype", ["f32", "bf16"])
def test_receiver_weights_sum_in_top_k_order(num_ranks, num_nodes, y_dtype):
    """combine_expanded(weights_at="receiver") on a Buffer with max_expanded_rows: y copied in,
    y written into combine_expanded_input (zero copy), and weights passed by the token's rank,
    each bit for bit the receiver's top-k sum; the holder's bits differ."""
    tokens, H = [5, 8, 0, 6][:num_ranks], 16
    E, xs, idxs, ws, refs = world_inputs(num_ranks, tokens, H, seed=13)
    per = E // num_ranks
    expanded = [expanded_reference(ref, per, 1) for ref in refs]
    rng = np.random.default_rng(17)
    ys = [rng.standard_normal((len(e[1]), H)).astype(np.float32) for e in expanded]
    if y_dtype == "bf16":
        ys = [bf16_bits(y) for y in ys]
    w2 = [rng.random((t, 3)).astype(np.float32) for t in tokens]

    def rank_fn(t):
        r = t.rank
        buf = epx.Buffer(t, num_experts=E, hidden=H, dtype="f32", max_tokens_per_rank=8, max_topk=3,
                         algorithm="flat", max_expanded_rows=128)
        assert buf.max_expanded_rows == 128
        res = buf.dispatch(xs[r], idxs[r], ws[r])
        out = lambda: np.full((tokens[r], H), -7.0, np.float32)  # noqa: E731
        holder = buf.combine_expanded(ys[r].astype(np.float32) if y_dtype == "f32" else bf16_values(ys[r]),
                                      res.handle, out=out())
        copied = buf.combine_expanded(ys[r], res.handle, out=out(), weights_at="receiver")
        passed = buf.combine_expanded(ys[r], res.handle, out=out(), weights=w2[r], weights_at="receiver")
        view = buf.combine_expanded_input(res.handle, dtype=y_dtype)
        view[...] = ys[r]
        zero_copy = buf.combine_expanded(view, res.handle, out=out(), weights_at="receiver")
        del view
        return holder, copied, passed, zero_copy

    got = epx.InprocWorld(num_ranks, num_nodes).run(rank_fn)
    yv = [bf16_values(y) if y_dtype == "bf16" else y for y in ys]
    want = receiver_reference(refs, expanded, yv, idxs, ws, tokens, H, per)
    want2 = receiver_reference(refs, expanded, yv, idxs, w2, tokens, H, per)
    holder_differs = 0
    for s in range(num_ranks):
        assert tokens[s] == 0 or np.count_nonzero(want[s]) > 0
        same_bits(got[s][1], want[s], f"copied in, rank {s}")
        same_bits(got[s][2], want2[s], f"weights passed, rank {s}")
        same_bits(got[s][3], want[s], f"zero copy, rank {s}")
        holder_differs += np.count_nonzero(np.asarray(got[s][0]).view(np.uint32) != want[s].view(np.uint32))
    assert num_ranks == 1 or holder_differs > 0, "holder and receiver bits agree: the test cannot tell them apart"


def test_receiver_weights_arguments_name_the_bad_value():
    E, H = 4, 16

    def rank_fn(t):
        with pytest.raises(epx.InvalidArgumentError, match="max_expanded_rows = -1"):
            epx.Buffer(t, num_experts=E, hidden=H, dtype="f32", max_tokens_per_rank=4, max_expanded_rows=-1)
        buf = epx.Buffer(t, num_experts=E, hidden=H, dtype="f32", max_tokens_per_rank=4, max_topk=2,
                         max_expanded_rows=16)
        res = buf.dispatch(np.ones((2, H), np.float32), np.array([[0, 1], [2, -1]], np.int32),
                           np.ones((2, 2), np.float32))
        y = np.ones((buf.expanded_layout(res.handle).num_rows, H), np.float32)
        with pytest.raises(epx.InvalidArgumentError, match="weights_at = 'sender' is not one of holder, receiver"):
            buf.combine_expanded(y, res.handle, weights_at="sender")
        with pytest.raises(epx.InvalidArgumentError, match="partial_dtype: .*f16"):
            buf.combine_expanded(y, res.handle, partial_dtype="f16")
        with pytest.raises(epx.InvalidArgumentError, match="dtype: .*i7"):
            buf.combine_expanded_input(res.handle, dtype="i7")
        return True

    assert epx.InprocWorld(1, 1).run(rank_fn) == [True]


def test_async_and_split_forms_give_the_blocking_bits():
    R, N, tokens, H = 4, 2, [4, 7, 2, 5], 16
    E, xs, idxs, ws, refs = world_inputs(R, tokens, H, seed=21)
    rng = np.random.default_rng(4)
    ys = [rng.standard_normal((len(ref.src), H)).astype(np.float32) for ref in refs]

    def rank_fn(t):
        r = t.rank
        buf = epx.Buffer(t, num_experts=E, hidden=H, dtype="f32", max_tokens_per_rank=8, max_topk=3)
        blocking = buf.dispatch(xs[r], idxs[r], ws[r])
        recv_blocking = blocking.recv_x.copy()
        out_blocking = buf.combine(ys[r], blocking.handle)
        op = buf.dispatch_async(xs[r], idxs[r], ws[r])
        res = op.wait()
        assert op.done()
        recv_async = res.recv_x.copy()
        out_async = buf.combine_async(ys[r], res.handle).wait(timeout=20.0)
        buf.dispatch_send(xs[r], idxs[r], ws[r])
        res = buf.dispatch_recv(timeout=20.0)
        recv_split = res.recv_x.copy()
        buf.combine_send(ys[r], res.handle)
        out_split = buf.combine_recv()
        buf.combine_async(ys[r], res.handle)  # dropped: it completes before the Buffer goes
        waits = buf.take_waits()
        return recv_blocking, out_blocking, recv_async, out_async, recv_split, out_split, waits

    for r, g in enumerate(epx.InprocWorld(R, N).run(rank_fn)):
        same_bits(g[0], refs[r].x)
        for i in (2, 4):
            same_bits(g[i], g[0], f"recv_x on rank {r}")
        for i in (3, 5):
            same_bits(g[i], g[1], f"combine out on rank {r}")
        assert len(g[6].arrival) == R and g[6].num_ops >= 6


@pytest.mark.parametrize("scales", ["f32", "ue8m0"])
def test_fp8_payloads_round_trip_within_the_quantisation_tolerance(scales):
    R, tokens, H = 2, [5, 4], 256
    E = 4
    rng = np.random.default_rng(8)
    xs = [rng.standard_normal((t, H)).astype(np.float32) for t in tokens]
    idxs = [np.stack([rng.choice(E, 2, replace=False) for _ in range(t)]).astype(np.int32) for t in tokens]
    refs = reference(R, E, xs, idxs, [np.ones((t, 2), np.float32) for t in tokens])

    def rank_fn(t):
        buf = epx.Buffer(t, num_experts=E, hidden=H, dtype="fp8", fp8_scales=scales, max_tokens_per_rank=8, max_topk=2)
        res = buf.dispatch(xs[t.rank], idxs[t.rank])
        q, s = res.recv_x, res.recv_scales
        assert q.dtype == np.uint8 and s.shape == (q.shape[0], H // 128)
        same_bits(buf.recv_scales(res.handle), s, "recv_scales")
        return epx.dequantize_fp8(q, s)

    for r, got in enumerate(epx.InprocWorld(R).run(rank_fn)):
        want = refs[r].x
        amax = np.abs(want).reshape(want.shape[0], -1, 128).max(axis=2).repeat(128, axis=1)
        assert np.all(np.abs(got - want) <= np.abs(want) / 16 + amax * 2.0**-9), f"rank {r}"


def test_torch_in_torch_out():
    torch = pytest.importorskip("torch")
    R, tokens, H = 2, [3, 4], 16
    E, xs, idxs, ws, refs = world_inputs(R, tokens, H, seed=2)

    def rank_fn(t):
        r = t.rank
        buf = epx.Buffer(t, num_experts=E, hidden=H, dtype="bf16", max_tokens_per_rank=8, max_topk=3)
        x = torch.from_numpy(xs[r]).to(torch.bfloat16)
        res = buf.dispatch(x, torch.from_numpy(idxs[r]).long(), torch.from_numpy(ws[r]))
        recv = res.recv_x
        assert isinstance(recv, torch.Tensor) and recv.dtype == torch.bfloat16
        out = buf.combine(recv.float().clone(), res.handle)
        assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
        return recv.float().numpy().copy(), res.recv_topk_idx.numpy().copy()

    for r, (recv, idx) in enumerate(epx.InprocWorld(R).run(rank_fn)):
        want = torch.from_numpy(refs[r].x).to(torch.bfloat16).float().numpy()
        same_bits(recv, want, f"rank {r}")
        np.testing.assert_array_equal(idx, refs[r].topk_idx)


@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_out_arguments_are_what_the_calls_return(library):
    if library == "torch":
        torch = pytest.importorskip("torch")
        new, adopt = (lambda shape: torch.zeros(shape)), torch.from_numpy
    else:
        new, adopt = (lambda shape: np.zeros(shape, np.float32)), (lambda a: a)
    R, tokens, H = 2, [3, 4], 16
    E, xs, idxs, ws, refs = world_inputs(R, tokens, H, seed=3)

    def rank_fn(t):
        r, T = t.rank, tokens[t.rank]
        buf = epx.Buffer(t, num_experts=E, hidden=H, dtype="f32", max_tokens_per_rank=8, max_topk=3)
        res = buf.dispatch(adopt(xs[r]), adopt(idxs[r]), adopt(ws[r]))
        rows = res.recv_x.shape[0]
        y = adopt(np.ones((rows, H), np.float32))
        out, grad_x, grad_w = new((T, H)), new((T, H)), new((T, 3))
        assert buf.combine(y, res.handle, out=out) is out
        got = buf.dispatch_backward(y, res.handle, grad_x=grad_x, grad_recv_topk_weights=adopt(np.ones((rows, 3), np.float32)),
                                    grad_topk_weights=grad_w)
        assert got[0] is grad_x and got[1] is grad_w
        expanded = new((buf.expanded_layout(res.handle).num_rows, H))
        res = buf.dispatch(adopt(xs[r]), adopt(idxs[r]), adopt(ws[r]))
        assert buf.expand(res.recv_x, res.handle, out=expanded) is expanded
        del res
        return True

    assert epx.InprocWorld(R).run(rank_fn) == [True, True]


def test_bf16_helpers_round_trip():
    a = np.array([1.0, -2.5, 3.14159, 1e-3, 65504.0], np.float32)
    bits = epx.bf16_from_f32(a)
    assert bits.dtype == np.uint16
    same_bits(bits, bf16_bits(a))
    assert np.allclose(epx.bf16_to_f32(bits), a, rtol=2**-8)
