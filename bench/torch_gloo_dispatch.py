#!/usr/bin/python3
"""epx's MPI dispatch + combine from Python against a Megatron-style token
dispatcher on torch.distributed's gloo backend, in the same processes.

  mpirun --oversubscribe --bind-to none -n 8 /usr/bin/python3 bench/torch_gloo_dispatch.py --tokens 1024 4096
  (PYTHONPATH=build/python for epx; --gloo-only runs without the module)

Every process (rank r of n, one thread each: torch.set_num_threads(1)) holds
x [T, 7168] bf16 and a uniform top-8 of 256 routing (distinct experts per token,
seeded by rank), experts in contiguous blocks of E / n per rank. Both methods
run on the same x and routing.

gloo (what Megatron-LM's MoEAlltoAllTokenDispatcher does, on CPU):
  dispatch: sort the (token, slot) pairs by expert and gather one row per pair
  (permute), per-expert counts by all_to_all_single, rows by all_to_all_single
  with per-rank splits, then the received chunks re-sorted from (source rank,
  local expert) to (local expert, source rank) order (sort_chunks_by_idxs);
  combine: the chunks sorted back, all_to_all_single back, rows times their
  routing weights and index_add_ into the tokens (unpermute; bf16, as Megatron's
  scatter_add in the activation dtype). gloo has no bf16 all-to-all in
  torch 1.13 (nor int16: "Invalid scalar type"), so the rows travel as a float16 view of
  the same bytes (free).
epx: Buffer.dispatch(x, topk_idx, topk_weights) on epx.mpi_transport() (one
row per (token, rank)), Buffer.combine(y, handle) with y in the Buffer's
combine input region (the experts wrote there; as `epx bench exchange`); and
the same two operations timed from C++ (Buffer._timed_dispatch and
_timed_combine), alternating with the Python calls: python_{op}_paired_ratio
is the median over repetitions of the C++ time / the Python time beside it.

Timing: every operation starts after a barrier (gloo's for gloo, the epx
transport's for epx); each rank records its start and end (perf_counter, one
clock for the processes of a host); the time is the last end minus the first
start. One warm-up of each method, checked (combine of the dispatched rows must
give back x: gloo weights sum to 1, epx sums the copies: x times the ranks a
token reached); then --reps repetitions interleaved (gloo, epx, gloo, ...) when
both fit in memory at once, else one method after the other. Medians. Rank 0
prints one JSON object per token count.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util as bu  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

HIDDEN, EXPERTS, TOPK = 7168, 256, 8


def init_gloo(port):
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0")))
    size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=size)
    return rank, size


def make_inputs(rank, tokens, seed):
    """x [T, H] bf16, topk_idx [T, K] int64 (distinct experts), weights [T, K] f32 summing to 1."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    idx = torch.rand(tokens, EXPERTS, generator=g).argsort(dim=1)[:, :TOPK].contiguous()
    w = torch.rand(tokens, TOPK, generator=g) + 0.1
    w /= w.sum(dim=1, keepdim=True)
    x = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
    return x, idx, w


def ranks_reached(idx, num_ranks):
    """[T, R] bool: token t has an expert on rank r (experts in contiguous blocks of E / R)."""
    hit = torch.zeros(idx.shape[0], num_ranks, dtype=torch.bool)
    hit.scatter_(1, idx.long() // (EXPERTS // num_ranks), True)
    return hit


def rows_per_rank(idx, num_ranks):
    """Rows each rank receives from this one: epx one per (token, rank), gloo one per (token, expert)."""
    dest = idx // (EXPERTS // num_ranks)
    return ranks_reached(idx, num_ranks).sum(dim=0), torch.bincount(dest.reshape(-1), minlength=num_ranks)


class GlooDispatcher:
    """Megatron's all-to-all token dispatcher on gloo; buffers allocated once."""

    def __init__(self, tokens, num_ranks, max_recv_rows):
        self.n, self.local = num_ranks, EXPERTS // num_ranks
        self.permuted = torch.empty(tokens * TOPK, HIDDEN, dtype=torch.bfloat16)
        self.recv = torch.empty(max_recv_rows, HIDDEN, dtype=torch.bfloat16)
        self.sorted = torch.empty_like(self.recv)
        self.out = torch.empty(tokens, HIDDEN, dtype=torch.bfloat16)

    def dispatch(self, x, idx, w):
        k = idx.shape[1]
        expert = idx.reshape(-1)
        _, order = torch.sort(expert, stable=True)
        self.token = torch.div(order, k, rounding_mode="floor")
        self.prob = w.reshape(-1)[order].to(torch.bfloat16).unsqueeze(1)
        torch.index_select(x, 0, self.token, out=self.permuted)
        counts = torch.bincount(expert, minlength=EXPERTS)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts)  # source s's counts of my local experts
        self.in_splits = counts.view(self.n, self.local).sum(dim=1).tolist()
        self.chunk_rows = recv_counts.tolist()  # (source, local expert) order
        self.out_splits = recv_counts.view(self.n, self.local).sum(dim=1).tolist()
        rows = sum(self.out_splits)
        recv = self.recv[:rows]
        dist.all_to_all_single(recv.view(torch.float16), self.permuted.view(torch.float16), self.out_splits,
                               self.in_splits)
        chunks = recv.split(self.chunk_rows)
        by_expert = [chunks[s * self.local + e] for e in range(self.local) for s in range(self.n)]
        return torch.cat(by_expert, out=self.sorted[:rows])

    def combine(self, y):
        rows = y.shape[0]
        sizes = [self.chunk_rows[s * self.local + e] for e in range(self.local) for s in range(self.n)]
        chunks = y.split(sizes)
        by_source = [chunks[e * self.n + s] for s in range(self.n) for e in range(self.local)]
        back = torch.cat(by_source, out=self.recv[:rows])
        dist.all_to_all_single(self.permuted.view(torch.float16), back.view(torch.float16), self.in_splits,
                               self.out_splits)
        self.permuted.mul_(self.prob)
        self.out.zero_()
        return self.out.index_add_(0, self.token, self.permuted)

    def bytes(self):
        return sum(t.numel() * t.element_size() for t in (self.permuted, self.recv, self.sorted, self.out))


class EpxDispatcher:
    """epx's Buffer on the MPI transport, sized for this routing."""

    def __init__(self, transport, tokens, max_recv_rows):
        import epx
        self.transport = transport
        self.buf = epx.Buffer(transport, num_experts=EXPERTS, hidden=HIDDEN, dtype="bf16",
                              max_tokens_per_rank=tokens, max_recv_tokens=max_recv_rows,
                              max_combine_dtype="bf16")
        self.out = torch.empty(tokens, HIDDEN, dtype=torch.bfloat16)

    def dispatch(self, x, idx32, w):
        self.result = self.buf.dispatch(x, idx32, w)

    def experts(self):
        """Untimed: the experts' output (here recv_x) written into the combine input region."""
        self.y = self.buf.combine_input(self.result.handle, "bf16", library="torch")
        self.y.copy_(self.result.recv_x)

    def combine(self):
        self.buf.combine(self.y, self.result.handle, out=self.out)
        del self.y, self.result  # no view of the regions may outlive them into the next dispatch
        return self.out

    # The same operations timed from C++ (the transport's barrier and the operation in one call
    # without the GIL): (start, end) on perf_counter's clock.
    def dispatch_cxx(self, x, idx32, w):
        self.result, start, end = self.buf._timed_dispatch(x, idx32, w)
        return start, end

    def combine_cxx(self):
        _, start, end = self.buf._timed_combine(self.y, self.result.handle, self.out)
        del self.y, self.result
        return start, end


def spans(marks):
    """Per repetition: the last end over ranks minus the first start (all_reduce MAX of -start, end)."""
    t = torch.tensor([[-s, e] for s, e in marks], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(e + s) for s, e in t.tolist()]


def check_gloo(x, out):
    err = (out.float() - x.float()).abs().max().item()
    if err > 0.05 * x.float().abs().max().item():
        raise SystemExit(f"torch_gloo_dispatch: gloo combine differs from x by {err}")


def check_epx(x, idx, out, num_ranks):
    want = x.float() * ranks_reached(idx, num_ranks).sum(dim=1, keepdim=True)
    err = (out.float() - want).abs().max().item()
    if err > 0.02 * want.abs().max().item():
        raise SystemExit(f"torch_gloo_dispatch: epx combine differs from x * ranks reached by {err}")


def memory_plan(tokens, num_ranks, max_recv_rows, max_gloo_rows):
    """Bytes of all processes: gloo's buffers, epx's regions (receive + bf16 combine) and x/out."""
    row = HIDDEN * 2
    gloo = num_ranks * (tokens * TOPK + 2 * max_gloo_rows + tokens) * row
    epx = num_ranks * (2 * max_recv_rows + tokens) * row
    common = num_ranks * (tokens * row + 400 * 2**20)  # x, and each python+torch process
    return {"gloo_gib": gloo / 2**30, "epx_gib": epx / 2**30, "common_gib": common / 2**30}


def run_shape(args, rank, n, tokens, transport):
    x, idx, w = make_inputs(rank, tokens, args.seed)
    idx32 = idx.to(torch.int32)
    recv_rows, gloo_rows = rows_per_rank(idx, n)
    dist.all_reduce(recv_rows)
    dist.all_reduce(gloo_rows)
    max_recv, max_gloo = int(recv_rows.max()), int(gloo_rows.max())
    plan = memory_plan(tokens, n, max_recv, max_gloo)
    avail = torch.tensor([bu.mem_available_bytes() / 2**30])
    dist.all_reduce(avail, op=dist.ReduceOp.MIN)
    both = plan["common_gib"] + plan["gloo_gib"] + (0 if transport is None else plan["epx_gib"])
    interleaved = both <= 0.85 * float(avail)
    marks = {k: [] for k in ("gloo dispatch", "gloo combine", "epx dispatch", "epx combine", "epx C++ dispatch",
                             "epx C++ combine")}

    def run_gloo(g, rep):
        recv = bu.timed(dist.barrier, lambda: g.dispatch(x, idx, w), marks["gloo dispatch"])
        out = bu.timed(dist.barrier, lambda: g.combine(recv), marks["gloo combine"])
        if rep == 0:
            check_gloo(x, out)

    def run_epx(e, rep):
        # From Python, and the same timed from C++: Python first on even repetitions.
        for cxx in (False, True) if rep % 2 == 0 else (True, False):
            if cxx:
                marks["epx C++ dispatch"].append(e.dispatch_cxx(x, idx32, w))
                e.experts()
                marks["epx C++ combine"].append(e.combine_cxx())
            else:
                bu.timed(transport.barrier, lambda: e.dispatch(x, idx32, w), marks["epx dispatch"])
                e.experts()
                bu.timed(transport.barrier, e.combine, marks["epx combine"])
            if rep == 0:
                check_epx(x, idx, e.out, n)

    methods = [] if args.epx_only else [("gloo", lambda: GlooDispatcher(tokens, n, max_gloo), run_gloo)]
    if transport is not None:
        methods.append(("epx", lambda: EpxDispatcher(transport, tokens, max_recv), run_epx))
    if interleaved:
        objs = [make() for _, make, _ in methods]
        for rep in range(1 + args.reps):
            for obj, (_, _, run) in zip(objs, methods):
                run(obj, rep)
        del objs
    else:
        for _, make, run in methods:
            obj = make()
            for rep in range(1 + args.reps):
                run(obj, rep)
            del obj
    times = {name: spans(m)[1:] for name, m in marks.items() if m}  # drop the warm-ups
    return report(args, n, tokens, recv_rows, plan, interleaved, times)


def report(args, n, tokens, recv_rows, plan, interleaved, times):
    rec = {"processes": n, "tokens": tokens, "hidden": HIDDEN, "experts": EXPERTS, "topk": TOPK,
           "epx_rows_received": int(recv_rows.sum()), "gloo_rows_moved": n * tokens * TOPK,
           "schedule": "interleaved" if interleaved else "phased", "memory_estimate": plan,
           "torch": torch.__version__, **{k: bu.summary_ms(v) for k, v in times.items()}}
    if "epx dispatch" in times:
        rec["epx_dispatch_gbps_all_ranks"] = rec["epx_rows_received"] * HIDDEN * 2 / rec["epx dispatch"]["median_ms"] / 1e6
    if "epx dispatch" in times:
        for op in ("dispatch", "combine"):
            paired = [c / p for c, p in zip(times[f"epx C++ {op}"], times[f"epx {op}"])]
            rec[f"python_{op}_paired_ratio"] = bu.median(paired)
    if "epx dispatch" in times and "gloo dispatch" in times:
        for op in ("dispatch", "combine"):
            rec[f"{op}_ratio"] = rec[f"gloo {op}"]["median_ms"] / rec[f"epx {op}"]["median_ms"]
        total = {m: rec[f"{m} dispatch"]["median_ms"] + rec[f"{m} combine"]["median_ms"] for m in ("gloo", "epx")}
        rec["dispatch_plus_combine_ratio"] = total["gloo"] / total["epx"]
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--port", type=int, default=29531)
    ap.add_argument("--gloo-only", action="store_true", help="without epx (no module needed)")
    ap.add_argument("--epx-only", action="store_true",
                    help="without the gloo dispatcher (epx from Python alone, e.g. against epx_mpi_exchange_bench)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rank, n = init_gloo(args.port)
    transport = None
    if not args.gloo_only:
        import epx
        transport = epx.mpi_transport()
    if rank == 0:
        print(json.dumps({"run": bu.run_record(), "processes": n}), flush=True)
    for tokens in args.tokens:
        rec = run_shape(args, rank, n, tokens, transport)
        if rank == 0:
            print(json.dumps(rec), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
