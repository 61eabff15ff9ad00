"""epx.torch.MoE against an independent eager PyTorch layer (torch_moe_reference.py): forward
output, aux loss and every gradient (x, norm, router, shared and routed experts) within
TOLERANCE, on 1 rank and on in-process worlds of 2 and 4 ranks (threads).
The same under mpirun: torch_moe_mpi.py (ctest python.torch_moe_mpi)."""
import pytest
import torch

import epx
import epx.torch as et
from torch_moe_reference import CASES, case_config, check_rank, eager_steps, run_epx_rank


def run_world(config, num_ranks):
    world = epx.InprocWorld(num_ranks=num_ranks)
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

    epx.InprocWorld(num_ranks=4).run(fn)


def test_weights_do_not_depend_on_the_number_of_ranks():
    def local_w1(transport):
        return et.MoE(16, 24, 8, 2, transport=transport, seed=3).w1.detach()

    one = epx.InprocWorld(num_ranks=1).run(local_w1)[0]
    four = torch.cat(epx.InprocWorld(num_ranks=4).run(local_w1))
    assert torch.equal(one, four)
