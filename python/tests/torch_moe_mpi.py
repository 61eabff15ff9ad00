"""epx.torch.MoE under mpirun against the eager layer (torch_moe_reference.py).

    mpirun -n 4 /usr/bin/python3 python/tests/torch_moe_mpi.py

Every rank regenerates every rank's tokens from the seed, runs the eager layer
on the whole batch and compares its own slice, its local experts' gradients and
the dense gradients summed over the ranks (all_reduce_grads). Exit 0 when every
case passes on every rank; a failing rank prints the case and exits 1.
"""
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import epx  # noqa: E402
import epx.torch as et  # noqa: E402
from torch_moe_reference import CASES, case_config, check_rank, eager_steps, run_epx_rank  # noqa: E402


def check_case(transport, name):
    config = case_config(name)
    mine = run_epx_rank(transport, config)
    for step in mine:  # the dense gradients summed over the ranks
        step["dense"] = [et.all_reduce_sum(transport, g).float() for g in step["dense"]]
        step["aux_sum"] = float(et.all_reduce_sum(transport, torch.tensor([step["aux"]])))
    eager = eager_steps(config, transport.num_ranks)
    check_rank(config, transport.rank, transport.num_ranks, mine, eager, [s["dense"] for s in mine])


def main():
    transport = epx.mpi_transport()
    failed = 0
    for name in sorted(CASES):
        try:
            check_case(transport, name)
        except AssertionError:
            failed += 1
            print(f"rank {transport.rank}: case {name} FAILED", flush=True)
            traceback.print_exc()
    ok = et.all_reduce_sum(transport, torch.tensor([float(failed)]))
    if transport.rank == 0:
        print(f"torch_moe_mpi: {len(CASES)} cases on {transport.num_ranks} ranks: "
              f"{'all passed' if ok.item() == 0 else f'{int(ok.item())} failures'}", flush=True)
    return 0 if ok.item() == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
