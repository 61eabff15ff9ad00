#!/usr/bin/python3
"""epx's dispatch and combine called from Python against the same from C++, in one run.

  PYTHONPATH=build/python /usr/bin/python3 bench/python_exchange.py --epx build/bin/epx

1. Call overhead: one token per rank (hidden 7168 bf16, top-8 of 256) on
   in-process worlds of 1 and 4 ranks, --overhead-reps repetitions: Python's
   median per dispatch and per combine, and C++'s (`epx bench exchange
   --tokens 1 --ranks R --nodes-shapes 1xR`) in the same run; the overhead is
   the difference.
2. `epx bench exchange`'s shape (8 in-process ranks, hidden 7168 bf16, top-8
   of 256, experts in blocks of 32 per rank, --tokens 128 1024 4096 per rank,
   --shapes 1x8 2x4): the C++ command with --json and --layer-combine off (its
   Buffer then keeps a bf16 combine region, as the Python one does, and it
   needs the memory to run 4096 tokens), then the same operations from Python
   with torch tensors on an epx.InprocWorld of the same shape.
3. Paired, in the Python process: every repetition also runs the same
   dispatch and combine timed from C++ on the same Buffer and memory
   (Buffer._timed_dispatch and _timed_combine: the transport's barrier and the
   operation in one call without the GIL), Python first on even repetitions
   and C++ first on odd ones. paired_ratio is the median over repetitions of
   the C++ time / the Python time beside it: both sides of a pair see the same
   machine state, unlike part 2's separate process.
Timing as the C++ benchmark: every operation starts after the transport's
barrier and is followed by another, each rank records its start and end, the
time is the last end minus the first start; one checked warm-up, then --reps repetitions, medians; combine
is the zero-copy form (y copied into Buffer.combine_input outside the timing).
The routing is uniform and distinct per token like the C++ one but drawn by
torch (other rows, the same distribution): the received row counts are printed
side by side. ratio = C++ time / Python time (1 = no overhead). The machine may be
shared: --rounds alternates the C++ command and the Python runs so that both
see the same load, and the medians pool every round's repetitions. On a
shared machine the same operation can run much slower for seconds at a time
(in one process, from one repetition to the next), so a ratio across
processes needs many short rounds: round_ratios gives the lowest and highest
of the rounds' own median ratios. Each
operation's CPU time (the ranks' thread CPU time summed; the C++ bench's
cpu_ms) is printed too: unlike wall time it does not grow with other load,
so cpu_ratio = C++ CPU / Python CPU shows the work the Python layer adds. spread_ms: the
median of (last start - first start) + (last end - first end) of the Python ranks, the
time they took the GIL one after another around the operation.
Prints one JSON object per line; the last one is the summary.
"""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util as bu  # noqa: E402
from torch_gloo_dispatch import EXPERTS, HIDDEN, make_inputs, ranks_reached, rows_per_rank  # noqa: E402

import torch  # noqa: E402

import epx  # noqa: E402


def cxx_bench(binary, tokens, ranks, shapes, reps):
    """`epx bench exchange --json`: {(tokens, "NxM"): {"dispatch", "combine": samples in ms, "dispatch_cpu",
    "combine_cpu": the medians of the ranks' summed CPU ms, "rows"}}."""
    cmd = [binary, "bench", "exchange", "--json", "--layer-combine", "off", "--ranks", str(ranks), "--reps", str(reps),
           "--tokens", ",".join(map(str, tokens)), "--nodes-shapes", ",".join(shapes)]
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    res = {}
    for s in out["shapes"]:
        key = (s["tokens"], f"{s['nodes']}x{s['ranks_per_node']}")
        res[key] = {"rows": s["rows"]}
        for op in ("dispatch", "combine"):
            res[key][op] = s[op]["samples_ms"]
            res[key][f"{op}_cpu"] = [s[op]["cpu_ms"]]
    return res


# Python's calls, and the same operations timed from C++ in the same process.
METHODS = ("dispatch", "combine", "cxx_dispatch", "cxx_combine")


class Marks:
    """Start and end of each rank's operations; spans() = last end - first start per repetition."""

    def __init__(self, ranks):
        self.ranks = {m: [[] for _ in range(ranks)] for m in METHODS}

        self.cpu = {m: [[] for _ in range(ranks)] for m in METHODS}

    def timed(self, t, method, fn):
        cpu = time.thread_time()
        value = bu.timed(lambda: t.barrier(timeout=60.0), fn, self.ranks[method][t.rank])
        self.cpu[method][t.rank].append(time.thread_time() - cpu)
        # As the C++ bench: no rank goes on before all have ended, so no rank's
        # next Python work (holding the GIL) delays another rank's end.
        t.barrier(timeout=60.0)
        return value

    def timed_cxx(self, t, method, fn):
        """fn() -> (value, start, end): the transport's barrier and the operation timed from C++ in
        one call without the GIL (Buffer._timed_dispatch, _timed_combine); as timed() otherwise."""
        cpu = time.thread_time()
        value, start, end = fn()
        self.ranks[method][t.rank].append((start, end))
        self.cpu[method][t.rank].append(time.thread_time() - cpu)
        t.barrier(timeout=60.0)
        return value

    def spans(self, method, skip):
        per_rank = self.ranks[method]
        reps = len(per_rank[0])
        return [bu.span([r[i][0] for r in per_rank], [r[i][1] for r in per_rank]) for i in range(skip, reps)]

    def spreads(self, method, skip):
        """Per repetition, the last start minus the first, plus the last end minus the first: the
        time the ranks spend taking the GIL one after the other around the operation (C++ ranks
        start and end together)."""
        per_rank = self.ranks[method]
        spreads = []
        for i in range(skip, len(per_rank[0])):
            starts, ends = [r[i][0] for r in per_rank], [r[i][1] for r in per_rank]
            spreads.append(max(starts) - min(starts) + max(ends) - min(ends))
        return spreads

    def cpu_seconds(self, method, skip):
        """The ranks' thread CPU time per repetition, summed (the barrier before each op included)."""
        per_rank = self.cpu[method]
        return [sum(r[i] for r in per_rank) for i in range(skip, len(per_rank[0]))]


def check_rank(x, idx, out, num_ranks):
    want = x.float() * ranks_reached(idx, num_ranks).sum(dim=1, keepdim=True)
    if not torch.equal(out.float(), want.to(torch.bfloat16).float()):
        raise RuntimeError("python_exchange: combine differs from x times the ranks each token reached")


def python_bench(tokens, ranks, nodes, reps, seed):
    """The same operations from Python on an InprocWorld, and timed from C++ beside them:
    {op: spans in s, f"{op}_cpu": summed CPU s, f"{op}_spread": GIL spreads in s for op in METHODS;
    "dispatch_paired", "combine_paired": C++ span / Python span per repetition; "rows"}."""
    inputs = [make_inputs(r, tokens, seed) for r in range(ranks)]
    per_rank = sum(rows_per_rank(idx, ranks)[0] for _, idx, _ in inputs)
    marks = Marks(ranks)

    def rank_fn(t):
        x, idx64, w = inputs[t.rank]
        idx = idx64.to(torch.int32)
        buf = epx.Buffer(t, num_experts=EXPERTS, hidden=HIDDEN, dtype="bf16", max_tokens_per_rank=tokens,
                         max_recv_tokens=int(per_rank.max()), max_combine_dtype="bf16")
        out = torch.empty(tokens, HIDDEN, dtype=torch.bfloat16)
        for rep in range(1 + reps):
            # Python first on even repetitions, C++ first on odd ones.
            for cxx in (False, True) if rep % 2 == 0 else (True, False):
                exchange(t, buf, (x, idx, w), out, marks, cxx)
                if rep == 0:
                    check_rank(x, idx, out, ranks)
        t.barrier(timeout=60.0)

    epx.InprocWorld(num_ranks=ranks, num_nodes=nodes).run(rank_fn)
    res = {"rows": int(per_rank.sum())}
    for op in METHODS:
        res[op] = marks.spans(op, 1)
        res[f"{op}_cpu"] = marks.cpu_seconds(op, 1)
        res[f"{op}_spread"] = marks.spreads(op, 1)
    for op in ("dispatch", "combine"):
        res[f"{op}_paired"] = [c / p for c, p in zip(res[f"cxx_{op}"], res[op])]
    return res


def exchange(t, buf, inputs, out, marks, cxx):
    """One dispatch and combine, called from Python (buf.dispatch, buf.combine) or timed from C++
    (buf._timed_dispatch, buf._timed_combine: the same operations on the same Buffer and memory)."""
    x, idx, w = inputs
    if cxx:
        r = marks.timed_cxx(t, "cxx_dispatch", lambda: buf._timed_dispatch(x, idx, w))
    else:
        r = marks.timed(t, "dispatch", lambda: buf.dispatch(x, idx, w))
    y = buf.combine_input(r.handle, "bf16", library="torch")
    y.copy_(r.recv_x)  # the experts' output, written in place
    if cxx:
        marks.timed_cxx(t, "cxx_combine", lambda: buf._timed_combine(y, r.handle, out))
    else:
        marks.timed(t, "combine", lambda: buf.combine(y, r.handle, out=out))


def pool(into, res):
    """Appends one round's samples (lists) to the pooled ones, and the round's medians to
    into["rounds"][key]."""
    for k, v in res.items():
        if isinstance(v, list):
            into[k] = into.get(k, []) + v
            into.setdefault("rounds", {}).setdefault(k, []).append(bu.median(v))
        else:
            into[k] = v
    return into


def round_ratios(py, cxx, op):
    """[lowest, highest] of C++ median / Python median over the rounds (the i-th C++ round
    against the i-th Python round)."""
    ratios = [c * 1e-3 / p for c, p in zip(cxx["rounds"][op], py["rounds"][op])]
    return [min(ratios), max(ratios)]


def compare(tokens, ranks, shape, py, cxx):
    rec = {"tokens": tokens, "ranks": ranks, "shape": shape, "rows_python": py["rows"], "rows_cxx": cxx["rows"]}
    for op in ("dispatch", "combine"):
        rec[f"python_{op}"] = bu.summary_ms(py[op])
        rec[f"cxx_{op}"] = bu.summary_ms([ms * 1e-3 for ms in cxx[op]])
        rec[f"python_{op}_cpu_ms"] = 1e3 * bu.median(py[f"{op}_cpu"])
        rec[f"cxx_{op}_cpu_ms"] = bu.median(cxx[f"{op}_cpu"])
        rec[f"{op}_ratio"] = rec[f"cxx_{op}"]["median_ms"] / rec[f"python_{op}"]["median_ms"]
        rec[f"{op}_round_ratios"] = round_ratios(py, cxx, op)
        rec[f"inproc_cxx_{op}"] = bu.summary_ms(py[f"cxx_{op}"])
        rec[f"{op}_paired_ratio"] = bu.median(py[f"{op}_paired"])
        rec[f"{op}_cpu_ratio"] = rec[f"cxx_{op}_cpu_ms"] / rec[f"python_{op}_cpu_ms"]
        rec[f"python_{op}_spread_ms"] = 1e3 * bu.median(py[f"{op}_spread"])
        rec[f"{op}_overhead_us"] = 1e3 * (rec[f"python_{op}"]["median_ms"] - rec[f"cxx_{op}"]["median_ms"])
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epx", default="build/bin/epx", help="the epx binary (C++ side)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 1024, 4096])
    ap.add_argument("--shapes", nargs="+", default=["1x8", "2x4"])
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per round")
    ap.add_argument("--overhead-ranks", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--overhead-reps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=6, help="C++ and Python alternated this many times, pooled")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(json.dumps({"run": bu.run_record(), "torch": torch.__version__}), flush=True)
    rows = []
    for ranks in args.overhead_ranks:
        shape = f"1x{ranks}"
        cxx, py = {}, {}
        for _ in range(args.rounds):
            pool(cxx, cxx_bench(args.epx, [1], ranks, [shape], args.overhead_reps)[(1, shape)])
            pool(py, python_bench(1, ranks, 1, args.overhead_reps, args.seed))
        rows.append({"part": "overhead", **compare(1, ranks, shape, py, cxx)})
        print(json.dumps(rows[-1]), flush=True)
    ranks = 8
    cxx, py = {}, {}
    for _ in range(args.rounds):
        for key, res in cxx_bench(args.epx, args.tokens, ranks, args.shapes, args.reps).items():
            pool(cxx.setdefault(key, {}), res)
        for tokens in args.tokens:
            for shape in args.shapes:
                nodes = int(shape.split("x")[0])
                pool(py.setdefault((tokens, shape), {}), python_bench(tokens, ranks, nodes, args.reps, args.seed))
    for tokens in args.tokens:
        for shape in args.shapes:
            key = (tokens, shape)
            rows.append({"part": "exchange", **compare(tokens, ranks, shape, py[key], cxx[key])})
            print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"load_average_end": bu.load_average(), "summary": [
        {k: r[k] for k in ("part", "tokens", "ranks", "shape", "dispatch_ratio", "combine_ratio",
                           "dispatch_round_ratios", "combine_round_ratios", "dispatch_paired_ratio",
                           "combine_paired_ratio", "dispatch_cpu_ratio",
                           "combine_cpu_ratio", "dispatch_overhead_us", "combine_overhead_us",
                           "python_dispatch_spread_ms", "python_combine_spread_ms")} for r in rows]}))


if __name__ == "__main__":
    main()
