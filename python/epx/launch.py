"""Start a program's processes the way torchrun does (docs/python.md, "Launching").

    python3 -m epx.launch --nproc-per-node 4 script.py [args...]
    python3 -m epx.launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --nproc-per-node 4 script.py

Each process gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and
MASTER_PORT (torchrun's names), and runs `python3 script.py args` (with -m: `python3 -m module`).
MPI launcher variables (OMPI_*, PMIX_*, PMI_*) are removed, so a program started by this launcher
under mpirun (one launcher per host) sees only the torchrun environment.

SIGINT, SIGTERM and SIGHUP are passed on to every process. When one process fails (a non-zero
exit or a signal), the others get SIGTERM, then SIGKILL after --grace seconds. After --timeout
seconds every process is killed the same way. The exit status: 0 when every process succeeded,
else the first failure's exit status (128 + N for signal N; 124 for the timeout).
"""
import argparse
import os
import signal
import subprocess
import sys
import time

MPI_PREFIXES = ("OMPI_", "PMIX_", "PMI_")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python3 -m epx.launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc-per-node", type=int, default=1, help="processes on this node")
    p.add_argument("--nnodes", type=int, default=1, help="nodes, each running this launcher")
    p.add_argument("--node-rank", type=int, default=0, help="this node's number, 0 <= node-rank < nnodes")
    p.add_argument("--master-addr", default="127.0.0.1", help="address of node 0 (MASTER_ADDR)")
    p.add_argument("--master-port", type=int, default=29500,
                   help="MASTER_PORT (epx.torchrun_transport's store uses MASTER_PORT + 1)")
    p.add_argument("--timeout", type=float, default=0, help="kill every process after this many seconds (0: never)")
    p.add_argument("--grace", type=float, default=10, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("-m", "--module", action="store_true", help="run `python3 -m program` instead of a script")
    p.add_argument("program", help="the Python script (or module, with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = p.parse_args(argv)
    for name, value, low in (("--nproc-per-node", args.nproc_per_node, 1), ("--nnodes", args.nnodes, 1),
                             ("--master-port", args.master_port, 1)):
        if value < low:
            p.error(f"{name} = {value} must be at least {low}")
    if not 0 <= args.node_rank < args.nnodes:
        p.error(f"--node-rank = {args.node_rank} must be in [0, --nnodes = {args.nnodes})")
    if args.master_port > 65534:
        p.error(f"--master-port = {args.master_port} must be at most 65534 (MASTER_PORT + 1 is used too)")
    if args.timeout < 0 or args.grace < 0:
        p.error("--timeout and --grace must not be negative")
    return args


def environment(args, local_rank):
    env = {k: v for k, v in os.environ.items() if not k.startswith(MPI_PREFIXES)}
    world = args.nnodes * args.nproc_per_node
    env.update(RANK=str(args.node_rank * args.nproc_per_node + local_rank), WORLD_SIZE=str(world),
               LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(args.nproc_per_node), GROUP_RANK=str(args.node_rank),
               MASTER_ADDR=args.master_addr, MASTER_PORT=str(args.master_port))
    return env


def status_of(code):
    """A Popen return code as an exit status (a signal N -> 128 + N)."""
    return 128 - code if code < 0 else code


def stop(procs, grace):
    """SIGTERM to every live process, SIGKILL to those left after `grace` seconds."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    end = time.monotonic() + grace
    while time.monotonic() < end and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def supervise(procs, args):
    """Waits for every process; the exit status (see the module's doc)."""
    deadline = time.monotonic() + args.timeout if args.timeout > 0 else None
    while True:
        codes = [p.poll() for p in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]
            print(f"epx.launch: local rank {rank} (pid {procs[rank].pid}) failed with exit status "
                  f"{status_of(code)}; stopping the others", file=sys.stderr)
            stop(procs, args.grace)
            return status_of(code)
        if all(c == 0 for c in codes):
            return 0
        if deadline is not None and time.monotonic() > deadline:
            print(f"epx.launch: --timeout {args.timeout:g} s passed; stopping every process", file=sys.stderr)
            stop(procs, args.grace)
            return 124
        time.sleep(0.05)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    command = [sys.executable] + (["-m"] if args.module else []) + [args.program] + args.args
    procs = []

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, forward)
    try:
        for local_rank in range(args.nproc_per_node):
            procs.append(subprocess.Popen(command, env=environment(args, local_rank)))
    except OSError as e:
        print(f"epx.launch: cannot start {command[0]}: {e}", file=sys.stderr)
        stop(procs, args.grace)
        return 1
    return supervise(procs, args)


if __name__ == "__main__":
    sys.exit(main())
