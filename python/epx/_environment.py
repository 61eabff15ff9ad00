"""Transports of processes started by a launcher: torchrun's environment (the socket
backend, met through torch.distributed's store) and the choice between it, MPI and
none (docs/python.md, "Launching")."""

import datetime
import os
import socket

from . import _epx
from .errors import FailedPreconditionError, InvalidArgumentError

# What torchrun gives every process (epx.launch gives the same).
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# The store epx makes when torch.distributed is not initialised listens on MASTER_PORT + this
# (MASTER_PORT stays free for the user's init_process_group).
STORE_PORT_OFFSET = 1

_made = [0]  # socket transports made by this process: each gets its own store keys


def _int_variable(env, name, low=0):
    text = env.get(name)
    if text is None:
        raise FailedPreconditionError(
            f"torchrun_transport: the environment variable {name} is not set; start the processes with torchrun, "
            f"`python3 -m epx.launch` or set {', '.join(TORCHRUN_VARIABLES)} yourself")
    try:
        value = int(text)
    except ValueError:
        raise InvalidArgumentError(f"torchrun_transport: {name}={text!r} is not an integer") from None
    if value < low:
        raise InvalidArgumentError(f"torchrun_transport: {name}={value} is below {low}")
    return value


def _reachable_address(master_addr, master_port):
    """The address of this host's interface that routes to MASTER_ADDR (what the other ranks reach)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((master_addr, master_port))
        except OSError as e:
            raise InvalidArgumentError(f"torchrun_transport: MASTER_ADDR={master_addr!r} cannot be reached: {e}") from None
        return s.getsockname()[0]


def _torch_store(env, rank, world_size, timeout):
    """The default process group's store when torch.distributed is initialised, else a TCPStore of
    rank 0 on MASTER_PORT + STORE_PORT_OFFSET (dropped once the transport is connected)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    port = _int_variable(env, "MASTER_PORT", 1) + STORE_PORT_OFFSET
    if port > 65535:
        raise InvalidArgumentError(f"torchrun_transport: MASTER_PORT + {STORE_PORT_OFFSET} = {port} is above 65535")
    return dist.TCPStore(env["MASTER_ADDR"], port, world_size, rank == 0,
                         datetime.timedelta(seconds=timeout), wait_for_workers=False)


def torchrun_transport(ranks_per_node=0, timeout=60.0, store=None, env=None):
    """This process's rank when the processes were started the torchrun way (torchrun, srun with
    those variables, or `python3 -m epx.launch`): RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    must be set. Collective over the WORLD_SIZE processes.

    The socket backend: shared memory between the ranks of one host, TCP between hosts. The
    ranks meet through `store` (a torch.distributed Store), by default the default process
    group's store when torch.distributed is initialised, else a TCPStore that rank 0 serves on
    MASTER_PORT + 1 during the call. ranks_per_node > 0 splits each host into emulated nodes."""
    env = os.environ if env is None else env
    rank = _int_variable(env, "RANK")
    world_size = _int_variable(env, "WORLD_SIZE", 1)
    if rank >= world_size:
        raise InvalidArgumentError(f"torchrun_transport: RANK={rank} is not below WORLD_SIZE={world_size}")
    if "MASTER_ADDR" not in env:
        _int_variable(env, "MASTER_ADDR")  # raises, naming it
    master_port = _int_variable(env, "MASTER_PORT", 1)
    address = _reachable_address(env["MASTER_ADDR"], master_port)
    own_store = store is None
    if own_store:
        store = _torch_store(env, rank, world_size, timeout)
    _made[0] += 1
    prefix = f"epx/{_made[0]}"

    def get(key, seconds):
        store.set_timeout(datetime.timedelta(seconds=seconds))
        return store.get(key)

    transport = _epx.socket_transport(rank, world_size, address, store.set, get, ranks_per_node=ranks_per_node,
                                      prefix=prefix, timeout=timeout)
    # Every rank has read every entry once all are here: rank 0's store may go.
    transport.barrier(timeout=timeout)
    _check_local_world_size(env, transport, ranks_per_node)
    return transport


def _check_local_world_size(env, transport, ranks_per_node):
    local = env.get("LOCAL_WORLD_SIZE")
    if local is None or ranks_per_node != 0:
        return
    per_host = transport.num_ranks // transport.num_nodes
    if str(per_host) != local:
        transport.abort(f"LOCAL_WORLD_SIZE={local} but {per_host} ranks share this hostname")
        raise FailedPreconditionError(
            f"torchrun_transport: LOCAL_WORLD_SIZE={local} but epx found {per_host} ranks per host (by hostname); "
            f"give every node its own hostname")


def launched_transport(ranks_per_node=0, timeout=60.0):
    """The transport of however this process was started: epx.mpi_transport() under mpirun or
    srun --mpi, torchrun_transport() under torchrun or epx.launch (RANK and WORLD_SIZE set), None
    when neither (one process: use epx.InprocWorld)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return torchrun_transport(ranks_per_node=ranks_per_node, timeout=timeout)
    if _epx.launched_by_mpi():
        return _epx.mpi_transport(ranks_per_node=ranks_per_node)
    return None
