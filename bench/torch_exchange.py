#!/usr/bin/env python3
"""PyTorch doing epx's exchange job on one GPU: the baseline of cuda_exchange_bench.

R emulated ranks, each with x [T, H] bf16 and a uniform top-k routing over E
experts placed in contiguous blocks of E / R per rank. Dispatch: every rank d
gathers the rows of the tokens that list one of its experts, ordered by
(source rank, token), with one index_select over all ranks' stacked x (row
indices computed once, outside the timed region: the most favourable case for
PyTorch). Combine: index_add_ of each rank's rows back into the stacked
output, in rank order (bf16 accumulation: PyTorch's own, not epx's fp32
contract). Timing as the C++ benchmark: CUDA events, warm-up, the median of
--reps calls, --sets rotating input sets. Prints one JSON object.

  python3 bench/torch_exchange.py --ranks 8 --tokens 4096 --hidden 7168 --experts 256 --topk 8
"""
import argparse
import json
import statistics
import sys

import torch


def median_ms(fn, warmup, reps):
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(warmup):
        fn(i)
    times = []
    for i in range(reps):
        start.record()
        fn(warmup + i)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--sets", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default="")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("torch_exchange: no CUDA device", file=sys.stderr)
        return 77
    dev = torch.device("cuda", 0)
    R, T, H, E, K = a.ranks, a.tokens, a.hidden, a.experts, a.topk
    g = torch.Generator(device="cpu").manual_seed(a.seed)
    # Uniform k distinct experts per token, for all R * T tokens (source rank major).
    idx = torch.rand(R * T, E, generator=g).argsort(dim=1)[:, :K].to(dev)
    rank_of_expert = torch.arange(E, device=dev) // (E // R)
    in_rank = torch.zeros(R * T, R, dtype=torch.bool, device=dev)
    in_rank.scatter_(1, rank_of_expert[idx], True)
    # Rows of rank d: the stacked token ids, ascending = (source rank, token) order.
    rows = [torch.nonzero(in_rank[:, d]).squeeze(1) for d in range(R)]
    num_rows = sum(int(r.numel()) for r in rows)
    xs = [torch.randn(R * T, H, device=dev, dtype=torch.bfloat16, generator=None) for _ in range(a.sets)]
    recv = [torch.empty(int(r.numel()), H, device=dev, dtype=torch.bfloat16) for r in rows]
    ys = [[torch.randn(int(r.numel()), H, device=dev, dtype=torch.bfloat16) for r in rows] for _ in range(a.sets)]
    out = torch.zeros(R * T, H, device=dev, dtype=torch.bfloat16)

    def dispatch(i):
        x = xs[i % a.sets]
        for d in range(R):
            torch.index_select(x, 0, rows[d], out=recv[d])

    def combine(i):
        out.zero_()
        for d in range(R):
            out.index_add_(0, rows[d], ys[i % a.sets][d])

    dispatch_ms = median_ms(dispatch, a.warmup, a.reps)
    combine_ms = median_ms(combine, a.warmup, a.reps)
    result = {"torch": torch.__version__, "device": torch.cuda.get_device_name(dev), "ranks": R, "tokens": T,
              "hidden": H, "experts": E, "topk": K, "rows": num_rows, "bytes": num_rows * H * 2,
              "torch_dispatch_ms": dispatch_ms, "torch_combine_ms": combine_ms}
    text = json.dumps(result)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
