"""epx.torch.MoE against an independent eager PyTorch layer (torch_moe_reference.py): forward
output, aux loss and every gradient (x, norm, router, shared and routed experts) within
TOLERANCE, on 1 rank and on in-process worlds of 2 and 4 ranks (threads).
The same under mpirun: torch_moe_mpi.py (ctest python.torch_moe_mpi)."""
import pytest
import torch

import epx
import epx.torch as et
from torch_moe_reference import CASES, case_config, check_rank, eager_steps, run_epx_rank


def run_world(config, num_ranks, num_nodes=1):
    world = epx.InprocWorld(num_ranks=num_ranks, num_nodes=num_nodes)
    return world.run(lambda transport: run_epx_rank(transport, config))


def summed_dense(results):
    """Per step, each dense parameter's gradient summed over ranks (what all_reduce_grads gives)."""
    steps = len(results[0])
    return [[sum(rank[step]["dense"][i] for rank in results) for i in range(len(results[0][step]["dense"]))]
            for step in range(steps)]


@pytest.mark.parametrize("num_ranks", [1, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_eager_layer(case, num_ranks):
    config = case_config(case)
    results = run_world(config, num_ranks)
    eager = eager_steps(config, num_ranks)
    dense = summed_dense(results)
    for step in range(len(eager)):
        results[0][step]["aux_sum"] = sum(rank[step]["aux"] for rank in results)
    for rank in range(num_ranks):
        check_rank(config, rank, num_ranks, results[rank], eager, dense)


@pytest.mark.parametrize("case", ["bf16", "capacity_bias", "few_tokens", "receiver"])
def test_two_emulated_nodes(case):
    """4 ranks on 2 emulated nodes: the two-hop exchange (receiver weights: flat), the same answers."""
    config = case_config(case)
    results = run_world(config, 4, num_nodes=2)
    eager, dense = eager_steps(config, 4), summed_dense(results)
    for rank in range(4):
        check_rank(config, rank, 4, results[rank], eager, dense)


def test_two_ranks_bf16_shared():
    config = case_config("bf16")
    config["num_shared_experts"] = 1
    results = run_world(config, 2)
    eager, dense = eager_steps(config, 2), summed_dense(results)
    for rank in range(2):
        check_rank(config, rank, 2, results[rank], eager, dense)


def test_expert_bias_moves_and_max_vio_is_reported():
    config = case_config("capacity_bias")
    results = run_world(config, 2)
    for step in results[0]:
        assert step["max_vio"] >= 0.0
    assert results[0][0]["max_vio"] == results[1][0]["max_vio"]


def test_all_reduce_grads_sums_over_ranks():
    def fn(transport):
        p = torch.nn.Parameter(torch.zeros(3))
        p.grad = torch.full((3,), float(transport.rank + 1))
        et.all_reduce_grads([p], transport)
        return p.grad

    for grad in epx.InprocWorld(num_ranks=3).run(fn):
        assert torch.equal(grad, torch.full((3,), 6.0))


def test_bad_configurations_raise_value_errors():
    def fn(transport):
        with pytest.raises(ValueError, match="num_experts = 6 is not a multiple of the 4 ranks"):
            et.MoE(16, 24, 6, 2, transport=transport)
        with pytest.raises(ValueError, match="aux_loss 'sequence'"):
            et.MoE(16, 24, 8, 2, transport=transport, aux_loss="sequence")
        with pytest.raises(ValueError, match="dtype 'fp8'"):
            et.MoE(16, 24, 8, 2, transport=transport, dtype="fp8")
        with pytest.raises(ValueError, match="combine_weights 'sender' is not one of holder, receiver"):
            et.MoE(16, 24, 8, 2, transport=transport, combine_weights="sender")
        holder_buffer = epx.Buffer(transport, num_experts=8, hidden=16, dtype="f32", max_tokens_per_rank=4)
        with pytest.raises(ValueError, match="needs a Buffer with max_expanded_rows > 0"):
            et.MoE(16, 24, 8, 2, transport=transport, combine_weights="receiver", buffer=holder_buffer)

    epx.InprocWorld(num_ranks=4).run(fn)


def test_receiver_weights_size_the_region_for_the_worst_case():
    """Buffer.expanded_rows_bound (what MoE sizes its Buffer with): 4 ranks x 5 tokens received
    x min(top-2, 2 local experts) rows, in f32 rows of the region, + 1."""
    assert epx.Buffer.expanded_rows_bound(4, 8, 16, 5, y_dtype="f32", max_topk=2) == 4 * 5 * 2 + 1
    assert epx.Buffer.expanded_rows_bound(4, 8, 16, 5, y_dtype="bf16", max_topk=2) == 4 * 5 * 2 // 2 + 1
    assert epx.Buffer.expanded_rows_bound(4, 8, 16, 5, y_dtype="f32", max_topk=2, expert_alignment=4) == 40 + 2 * 3 + 1
    with pytest.raises(epx.InvalidArgumentError, match="num_ranks = 0 must be at least 1"):
        epx.Buffer.expanded_rows_bound(0, 8, 16, 5)
    with pytest.raises(epx.InvalidArgumentError, match="y_dtype: .*i7"):
        epx.Buffer.expanded_rows_bound(4, 8, 16, 5, y_dtype="i7")

    def fn(transport):
        moe = et.MoE(16, 24, 8, 2, transport=transport, combine_weights="receiver", max_tokens_per_rank=5)
        return moe.buffer.max_expanded_rows

    assert epx.InprocWorld(num_ranks=4).run(fn) == [41] * 4


def test_weights_do_not_depend_on_the_number_of_ranks():
    def local_w1(transport):
        return et.MoE(16, 24, 8, 2, transport=transport, seed=3).w1.detach()

    one = epx.InprocWorld(num_ranks=1).run(local_w1)[0]
    four = torch.cat(epx.InprocWorld(num_ranks=4).run(local_w1))
    assert torch.equal(one, four)


def test_functions_alone_match_a_dense_computation():
    """et.dispatch + experts y = (l + 1) x (l: the local expert) + et.combine, against
    out[t] = sum_k w[t, k] (e_k + 1) x[t] computed directly, with both gradients."""
    E, K, H, R = 8, 3, 4, 2

    def fn(transport):
        g = torch.Generator().manual_seed(transport.rank)
        x = torch.randn(5, H, generator=g, requires_grad=True)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(5)]).to(torch.int32)
        idx[0, 1] = -1
        w = torch.rand(5, K, generator=g).requires_grad_(True)
        buffer = epx.Buffer(transport, num_experts=E, hidden=H, dtype="f32", max_tokens_per_rank=5)
        d = et.dispatch(buffer, x, idx, w)
        first = transport.rank * (E // R)
        scale = torch.cat([torch.full((int(d.expert_offsets[l + 1] - d.expert_offsets[l]), 1), first + l + 1.0)
                           for l in range(E // R)])
        out = et.combine(buffer, d.x_expanded * scale, d.recv_topk_weights, d)
        (out * torch.arange(H)).sum().backward()
        return out.detach(), x.grad, w.grad, x.detach(), idx, w.detach()

    for out, grad_x, grad_w, x, idx, w in epx.InprocWorld(num_ranks=R).run(fn):
        x = x.clone().requires_grad_(True)
        w = w.clone().requires_grad_(True)
        factor = torch.where(idx >= 0, idx.float() + 1, torch.zeros(()))
        want = ((w * factor).sum(1, keepdim=True)) * x
        (want * torch.arange(H)).sum().backward()
        assert torch.allclose(out, want.detach(), atol=1e-5)
        assert torch.allclose(grad_x, x.grad, atol=1e-5)
        assert torch.allclose(grad_w, w.grad, atol=1e-5)


def test_grouped_experts_match_autograd_and_accumulate_across_backwards():
    gen = torch.Generator().manual_seed(4)
    L, H, F, counts = 3, 8, 16, [5, 0, 7]
    x = torch.randn(sum(counts), H, generator=gen, requires_grad=True)
    w1, w3 = (torch.randn(L, H, F, generator=gen).requires_grad_() for _ in range(2))
    w2 = torch.randn(L, F, H, generator=gen).requires_grad_()
    grad = torch.randn(sum(counts), H, generator=gen)
    pieces = x.split(counts)
    want_y = torch.cat([(torch.nn.functional.silu(p @ w1[l]) * (p @ w3[l])) @ w2[l] for l, p in enumerate(pieces)])
    want = torch.autograd.grad(want_y, (x, w1, w3, w2), grad)
    y = et.functions.grouped_swiglu(x, counts, w1, w3, w2)
    assert torch.allclose(y, want_y, atol=1e-5)
    for step in (1, 2):  # .grad must hold the sum of both backwards, not twice the last
        et.functions.grouped_swiglu(x, counts, w1, w3, w2).backward(grad)
        for got, expected in zip((x.grad, w1.grad, w3.grad, w2.grad), want):
            assert torch.allclose(got, step * expected, atol=1e-4), f"step {step}"
    assert w1.grad[1].abs().max() == 0  # the expert without rows


def test_fewer_than_eight_experts():
    def step(t):
        layer = et.MoE(16, 32, 4, 2, transport=t, aux_loss_coeff=0.01)
        layer(torch.randn(6, 16, generator=torch.Generator().manual_seed(t.rank))).sum().backward()
        return int(layer.load["tokens_per_expert"].sum())
    assert epx.InprocWorld(2).run(step) == [24, 24]  # 2 ranks x 6 tokens x top-2, over both ranks
