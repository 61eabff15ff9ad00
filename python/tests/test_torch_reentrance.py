"""Every epx.torch autograd function called more than once in one graph: the gradients are the
sum of each call's, as autograd's reference gives them (two MoE modules of equal weights, or
plain torch maths); retain_graph's second backward adds the same again; a double backward
(create_graph=True, then differentiating the results) raises a RuntimeError naming the function."""
import pytest
import torch

import epx
import epx.torch as et

H, F, E, K, T = 16, 24, 8, 2, 6


def inputs(rank, count=2):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(T, H, generator=g) for _ in range(count)]


def grads(modules):
    """Each parameter's gradient summed over `modules` (equal weights: one module's reference)."""
    names = [name for name, _ in modules[0].named_parameters()]
    out = {}
    for name in names:
        found = [dict(m.named_parameters())[name].grad for m in modules]
        out[name] = sum(g for g in found if g is not None)
    return out


def check_close(got, want, what):
    for name in want:
        assert torch.count_nonzero(want[name]) > 0, f"{what}: {name} all zero"
        assert torch.allclose(got[name], want[name], rtol=1e-5, atol=1e-5), \
            f"{what}: {name} off by {(got[name] - want[name]).abs().max()}"


def layer(t, **kwargs):
    return et.MoE(H, F, E, K, transport=t, num_shared_experts=1, aux_loss_coeff=0.01, seed=5, **kwargs)


def run_twice(t, shape, **kwargs):
    """One module used twice against two modules of the same weights used once each."""
    x1, x2 = inputs(t.rank)
    once, ref_a, ref_b = layer(t, **kwargs), layer(t, **kwargs), layer(t, **kwargs)
    if shape == "sum":  # two micro-batches summed into one loss
        (once(x1).square().sum() + once(x2).square().sum()).backward()
        (ref_a(x1).square().sum() + ref_b(x2).square().sum()).backward()
    else:  # chained: layer(layer(x))
        once(once(x1)).square().sum().backward()
        ref_b(ref_a(x1)).square().sum().backward()
    return grads([once]), grads([ref_a, ref_b])


@pytest.mark.parametrize("num_ranks", [1, 2])
@pytest.mark.parametrize("shape", ["sum", "chained"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_one_module_twice_in_a_graph(shape, num_ranks, dtype):
    for got, want in epx.InprocWorld(num_ranks).run(lambda t: run_twice(t, shape, dtype=dtype)):
        check_close(got, want, f"{shape} on {num_ranks} ranks")


def test_retain_graph_adds_the_same_gradients_again():
    def fn(t):
        x1, x2 = inputs(t.rank)
        moe = layer(t)
        loss = moe(x1).square().sum() + moe(x2).square().sum()
        loss.backward(retain_graph=True)
        first = {n: p.grad.clone() for n, p in moe.named_parameters()}
        loss.backward()
        return first, {n: p.grad for n, p in moe.named_parameters()}

    for first, twice in epx.InprocWorld(2).run(fn):
        check_close(twice, {n: 2 * g for n, g in first.items()}, "retain_graph")


def test_grouped_experts_twice_in_a_graph_match_autograd():
    gen = torch.Generator().manual_seed(9)
    counts, L = [4, 0, 3], 3
    x = torch.randn(sum(counts), H, generator=gen, requires_grad=True)
    w1, w3 = (torch.randn(L, H, F, generator=gen).requires_grad_() for _ in range(2))
    w2 = torch.randn(L, F, H, generator=gen).requires_grad_()

    def reference(inp):
        return torch.cat([et.swiglu(p, w1[l], w3[l], w2[l]) for l, p in enumerate(inp.split(counts))])

    def loss(fn):
        return (fn(x).square().sum() + fn(x * 2).sum()) + fn(fn(x)).sum()

    want = torch.autograd.grad(loss(reference), (x, w1, w3, w2))
    got = torch.autograd.grad(loss(lambda inp: et.functions.grouped_swiglu(inp, counts, w1, w3, w2)), (x, w1, w3, w2))
    for g, w, name in zip(got, want, ("x", "w1", "w3", "w2")):
        assert torch.allclose(g, w, rtol=1e-4, atol=1e-4), f"{name} off by {(g - w).abs().max()}"


def test_dispatch_and_combine_twice_in_a_graph():
    """out = combine(dispatch(x) * s) twice, summed: both gradients against plain maths."""
    def fn(t):
        g = torch.Generator().manual_seed(t.rank)
        x = torch.randn(5, 4, generator=g, requires_grad=True)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(5)]).to(torch.int32)
        w = torch.rand(5, K, generator=g).requires_grad_(True)
        buffer = epx.Buffer(t, num_experts=E, hidden=4, dtype="f32", max_tokens_per_rank=5)

        def once(scale):
            d = et.dispatch(buffer, x, idx, w)
            return et.combine(buffer, d.x_expanded * scale, d.recv_topk_weights, d)

        (once(2.0).sum() + once(3.0).square().sum()).backward()
        wx, ww = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        ref = (ww.sum(1, keepdim=True) * wx)
        ((ref * 2).sum() + (ref * 3).square().sum()).backward()
        return x.grad, wx.grad, w.grad, ww.grad

    for gx, wx, gw, ww in epx.InprocWorld(2).run(fn):
        assert torch.allclose(gx, wx, atol=1e-4) and torch.allclose(gw, ww, atol=1e-4)


def double_backward(fn, inp):
    out = fn(inp)
    (g,) = torch.autograd.grad(out.square().sum(), inp, create_graph=True)
    with pytest.raises(RuntimeError) as info:
        g.square().sum().backward()
    return str(info.value)


def test_double_backward_is_refused_naming_the_function():
    gen = torch.Generator().manual_seed(2)
    w1, w3 = (torch.randn(1, H, F, generator=gen) for _ in range(2))
    w2 = torch.randn(1, F, H, generator=gen)
    x = torch.randn(3, H, generator=gen, requires_grad=True)
    message = double_backward(lambda v: et.functions.grouped_swiglu(v, [3], w1, w3, w2), x)
    assert "GroupedSwiGLU has no double backward" in message, message

    config = epx.RouterConfig(E, K)
    logits = torch.randn(3, E, generator=gen, requires_grad=True)
    message = double_backward(lambda v: et.route(config, v)[1], logits)
    assert "Route has no double backward" in message, message

    def fn(t):
        buffer = epx.Buffer(t, num_experts=E, hidden=4, dtype="f32", max_tokens_per_rank=5)
        idx = torch.tensor([[0, 1]] * 3, dtype=torch.int32)
        w = torch.full((3, K), 0.5)
        x4 = torch.randn(3, 4, requires_grad=True)
        dispatch_message = double_backward(lambda v: et.dispatch(buffer, v, idx, w).x_expanded, x4)
        d = et.dispatch(buffer, x4.detach(), idx, w)
        y = d.x_expanded.clone().requires_grad_()
        combine_message = double_backward(lambda v: et.combine(buffer, v, d.recv_topk_weights, d), y)
        return dispatch_message, combine_message

    dispatch_message, combine_message = epx.InprocWorld(1).run(fn)[0]
    assert "Dispatch has no double backward" in dispatch_message, dispatch_message
    assert "Combine has no double backward" in combine_message, combine_message


def test_create_graph_without_a_second_derivative_still_works():
    def fn(t):
        moe = layer(t)
        x = inputs(t.rank, 1)[0].requires_grad_()
        (g,) = torch.autograd.grad(moe(x).square().sum(), x, create_graph=True)
        return g.detach()

    assert torch.count_nonzero(epx.InprocWorld(1).run(fn)[0]) > 0
