#!/usr/bin/python3
"""epx.torch.transport over torch.distributed: run under `python3 -m epx.launch --nproc-per-node 4`.
Every process initialises torch.distributed (gloo, env://), then takes epx's transport of the
default group (met through its store) and of the group of ranks 1 and 3; sums over each must be
right, processes outside the group get None. Exit 0 when every check holds."""
import sys

import numpy as np
import torch.distributed as dist

import epx
import epx.torch as et


def main():
    dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    rank, size = dist.get_rank(), dist.get_world_size()
    world = et.transport()
    assert world.backend == "socket" and world.num_ranks == size, (world.backend, world.num_ranks)
    total = np.array([float(world.rank)])
    world.all_reduce(total)
    assert total[0] == sum(range(size)), total
    members = [1, 3]
    group = dist.new_group(members)
    sub = et.transport(group)
    if rank in members:
        assert sub is not None and sub.num_ranks == 2 and sub.rank == members.index(rank), sub
        got = np.array([float(rank)])
        sub.all_reduce(got)
        assert got[0] == 4.0, got
    else:
        assert sub is None
    world.barrier()
    dist.barrier()  # torch's own collectives still work beside epx's
    print(f"rank {rank}: epx.torch.transport: world of {size} and group {members} agree", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
