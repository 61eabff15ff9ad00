"""epx transports for programs that already use torch.distributed."""
import os

import epx
from epx.errors import FailedPreconditionError, InvalidArgumentError


def transport(group=None, ranks_per_node=0, timeout=60.0):
    """epx's transport over the processes of torch.distributed's `group` (None: the default
    group), met through the default group's store. Collective over every process of the default
    group, like torch.distributed.new_group: processes outside `group` get None.

    The socket backend (epx.torchrun_transport): shared memory inside a host, TCP between hosts;
    torch's own collectives (gloo, NCCL) are not used. MASTER_ADDR must be set (env:// sets it):
    each rank advertises the address of its interface that reaches it."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise FailedPreconditionError("epx.torch.transport: torch.distributed is not initialised; call "
                                      "torch.distributed.init_process_group first, or use epx.torchrun_transport()")
    env = dict(os.environ, RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()))
    world = epx.torchrun_transport(ranks_per_node=ranks_per_node, timeout=timeout,
                                   store=dist.distributed_c10d._get_default_store(), env=env)
    if group is None or group == dist.group.WORLD:
        return world
    members = dist.get_process_group_ranks(group)
    if len(set(members)) != len(members):
        raise InvalidArgumentError(f"epx.torch.transport: group lists a rank twice: {members}")
    me = dist.get_rank()
    # The group's processes in the group's order; the others form a group that is dropped.
    color = 0 if me in members else 1
    key = members.index(me) if me in members else me
    sub = world.split(color, key, timeout=timeout)
    return sub if color == 0 else None
