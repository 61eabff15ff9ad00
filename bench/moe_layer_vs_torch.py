#!/usr/bin/python3
"""epx's MoELayer against a plain PyTorch eager MoE layer of the same shape.

The PyTorch layer is what common model code does: RMSNorm, a linear router,
softmax, top-k with renormalised weights, then a Python loop over experts with
index_select / SwiGLU / index_add_. Both run on the same machine with the same
number of threads (epx: --ranks in-process ranks of one thread each; PyTorch:
torch.set_num_threads), interleaved shape by shape and repetition by
repetition; each figure is the median of --rounds runs of a median of --reps.

  /usr/bin/python3 bench/moe_layer_vs_torch.py --bench build/bench/moe_layer_bench
  PYTHONPATH=build/python /usr/bin/python3 bench/moe_layer_vs_torch.py --bench '' --epx-torch

--epx-torch adds epx.torch.MoE (epx's exchange under torch autograd, one
in-process rank, SwiGLU experts in torch) loaded with the eager layer's very
weights (normalize_weights=True, as the eager top-k renormalises; its output is
checked against the eager layer's within 1e-3 first), timed the same way: f32,
torch.set_num_threads(--threads) for both (f32 rows only).

--dtype f32, bf16 or both (the default): the eager layer's weights and
activations in that dtype, moe_layer_bench --dtype the same. --shapes issue20
(the default) runs the three shapes of docs/performance.md; --shapes small the three smaller
ones of the first measurements (git history).

Needs Debian's python3-torch (for /usr/bin/python3). Prints one JSON object per
shape and a table.
"""
import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util as bu  # noqa: E402

SHAPES = {  # tokens, hidden, ffn_hidden, experts, topk
    "small": [(2048, 256, 512, 16, 2), (4096, 512, 1024, 32, 4), (1024, 1024, 2048, 8, 2)],
    "issue20": [(4096, 1024, 512, 64, 8), (4096, 1024, 3584, 8, 2), (2048, 2048, 1024, 32, 4)],
    "tiny": [(256, 64, 128, 8, 2)],  # a smoke run of the script
}


def eager_params(torch, hidden, ffn, experts, dtype=None):
    """The eager layer's weights: RMSNorm scale, router [H, E], per-expert w1, w3 [H, F] and w2 [F, H]."""
    torch.manual_seed(0)
    std = hidden ** -0.5
    dtype = dtype or torch.float32

    def leaf(t):
        return t.to(dtype).requires_grad_()
    # One tensor per expert, as an nn.ModuleList of experts holds them (slicing
    # one stacked tensor would make every expert's backward write a full-size
    # gradient).
    return {"norm_w": leaf(torch.ones(hidden)),
            "router": leaf(torch.randn(hidden, experts) * std),
            "w1": [leaf(torch.randn(hidden, ffn) * std) for _ in range(experts)],
            "w3": [leaf(torch.randn(hidden, ffn) * std) for _ in range(experts)],
            "w2": [leaf(torch.randn(ffn, hidden) * ffn ** -0.5) for _ in range(experts)]}


def param_list(p):
    return [p["norm_w"], p["router"]] + p["w1"] + p["w3"] + p["w2"]


def eager_forward(torch, p, x, topk):
    """What common model code does: RMSNorm, softmax router, top-k renormalised, a loop over experts."""
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * p["norm_w"]
    probs = torch.softmax(n @ p["router"], dim=-1)
    weights, idx = torch.topk(probs, topk, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(len(p["w1"])):
        token, slot = torch.where(idx == e)
        if token.numel() == 0:
            continue
        xe = n.index_select(0, token)
        h = torch.nn.functional.silu(xe @ p["w1"][e]) * (xe @ p["w3"][e])
        out.index_add_(0, token, (h @ p["w2"][e]) * weights[token, slot].unsqueeze(-1))
    return x + out


def time_layer(torch, forward, params, grad, reps):
    """Median seconds of forward (no_grad) and of forward + backward(grad), one warm-up each."""
    def fwd():
        with torch.no_grad():
            forward()

    def both():
        for q in params:
            q.grad = None
        forward().backward(grad)
    return bu.median(bu.time_reps(fwd, reps)), bu.median(bu.time_reps(both, reps))


def torch_layer(torch, tokens, hidden, ffn, experts, topk, threads, reps, dtype="f32"):
    torch.set_num_threads(threads)
    tdtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    p = eager_params(torch, hidden, ffn, experts, tdtype)
    x = torch.randn(tokens, hidden).to(tdtype)
    grad = torch.randn(tokens, hidden).to(tdtype)
    return time_layer(torch, lambda: eager_forward(torch, p, x, topk), param_list(p), grad, reps)


def epx_torch_layer(torch, tokens, hidden, ffn, experts, topk, threads, reps):
    """epx.torch.MoE (one in-process rank) with the eager layer's weights, timed as the eager layer."""
    import epx
    import epx.torch as et
    torch.set_num_threads(threads)
    p = eager_params(torch, hidden, ffn, experts)
    x = torch.randn(tokens, hidden)
    grad = torch.randn(tokens, hidden)

    def rank_fn(t):
        moe = et.MoE(hidden, ffn, experts, topk, transport=t, normalize_weights=True, max_tokens_per_rank=tokens)
        with torch.no_grad():
            moe.norm.copy_(p["norm_w"])
            moe.router.copy_(p["router"])
            for name in ("w1", "w3", "w2"):
                getattr(moe, name).copy_(torch.stack(p[name]))
            err = (moe(x) - eager_forward(torch, p, x, topk)).abs().max().item()
        if err > 1e-3:
            raise RuntimeError(f"epx.torch.MoE differs from the eager layer by {err} (max abs)")
        return time_layer(torch, lambda: moe(x), list(moe.parameters()), grad, reps)
    return epx.InprocWorld(num_ranks=1).run(rank_fn)[0]


def cxx_layer(binary, tokens, hidden, ffn, experts, topk, threads, reps, dtype="f32", compute_dtype=None):
    """moe_layer_bench's JSON object (times, and the GEMM library's rate on the same FLOPs in the same run)."""
    cmd = [binary, "--tokens", str(tokens), "--hidden", str(hidden), "--ffn-hidden", str(ffn),
           "--experts", str(experts), "--topk", str(topk), "--ranks", str(threads), "--reps", str(reps),
           "--dtype", dtype] + (["--compute-dtype", compute_dtype] if compute_dtype else [])
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def shape_row(args, torch, shape, dtype, med):
    tokens, hidden, ffn, experts, topk = shape
    row = {"tokens": tokens, "hidden": hidden, "ffn_hidden": ffn, "experts": experts, "topk": topk,
           "dtype": dtype, "threads": args.threads, "torch_version": torch.__version__}
    for side, times in med.items():
        row[f"{side}_forward_tok_s"] = tokens / times[0]
        row[f"{side}_train_tok_s"] = tokens / times[1]
    if "epx" in med:  # the layer's expert GEMM FLOPs over its time, against the GEMM library's rate
        flop = 6.0 * tokens * topk * hidden * ffn
        row["gemm_gflops"] = med["epx"][2]
        row["epx_forward_gflops"] = flop / med["epx"][0] / 1e9
        row["epx_train_gflops"] = 3 * flop / med["epx"][1] / 1e9
        row["forward_of_gemm"] = row["epx_forward_gflops"] / row["gemm_gflops"]
        row["train_of_gemm"] = row["epx_train_gflops"] / row["gemm_gflops"]
    for side in med:
        if side != "torch":
            prefix = "" if side == "epx" else f"{side}_"
            row[f"{prefix}forward_speedup"] = row[f"{side}_forward_tok_s"] / row["torch_forward_tok_s"]
            row[f"{prefix}train_speedup"] = row[f"{side}_train_tok_s"] / row["torch_train_tok_s"]
    return row


def print_table(rows, sides):
    head = f"{'shape (T x H x F, E, k)':>28} {'dtype':>5}"
    for side in sides:
        head += f" {side + ' fwd':>14} {side + ' f+b':>14}"
    print(head + "   (tokens/s)" + ("   epx GFLOP/s fwd, f+b / GEMM lib" if "epx" in sides else ""))
    for r in rows:
        line = f"{r['tokens']}x{r['hidden']}x{r['ffn_hidden']}, {r['experts']}, {r['topk']}"
        line = f"{line:>28} {r['dtype']:>5}"
        for side in sides:
            if side + "_forward_tok_s" in r:
                line += f" {r[side + '_forward_tok_s']:14.0f} {r[side + '_train_tok_s']:14.0f}"
            else:
                line += f" {'-':>14} {'-':>14}"
        if "gemm_gflops" in r:
            line += (f"   {r['epx_forward_gflops']:.0f} ({r['forward_of_gemm']:.2f}x), "
                     f"{r['epx_train_gflops']:.0f} ({r['train_of_gemm']:.2f}x) / {r['gemm_gflops']:.0f}")
        print(line)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", default="build/bench/moe_layer_bench", help="the C++ side; '' to skip it")
    ap.add_argument("--epx-torch", action="store_true", help="also epx.torch.MoE (PYTHONPATH=build/python)")
    ap.add_argument("--threads", type=int, default=1, help="threads of each side (epx: ranks)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", choices=["f32", "bf16", "both"], default="both")
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="issue20")
    ap.add_argument("--compute-dtype", choices=["f32", "bf16"], default=None,
                    help="epx's expert GEMMs (moe_layer_bench --compute-dtype; default: --dtype)")
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        sys.exit("moe_layer_vs_torch: PyTorch is not installed (Debian: apt-get install python3-torch)")
    sides = (["epx"] if args.bench else []) + ["torch"] + (["epx_torch"] if args.epx_torch else [])
    dtypes = ["f32", "bf16"] if args.dtype == "both" else [args.dtype]
    rows = []
    for shape in SHAPES[args.shapes]:
        for dtype in dtypes:
            rows.append(measure_shape(args, torch, shape, dtype, sides))
            print(json.dumps(rows[-1]), flush=True)
    print_table(rows, sides)


def measure_shape(args, torch, shape, dtype, sides):
    """One shape in one dtype: --rounds interleaved rounds of every side, the median of each."""
    runs = {side: [] for side in sides if side != "epx_torch" or dtype == "f32"}  # epx.torch: f32 rows only
    for rnd in range(args.rounds):
        if "epx" in runs:
            e = cxx_layer(args.bench, *shape, args.threads, args.reps, dtype, args.compute_dtype)
            runs["epx"].append((e["forward_s"], e["train_s"], e["gemm_gflops"]))
        runs["torch"].append(torch_layer(torch, *shape, args.threads, args.reps, dtype))
        if "epx_torch" in runs:
            runs["epx_torch"].append(epx_torch_layer(torch, *shape, args.threads, args.reps))
        print(f"  shape {shape} {dtype}: round {rnd + 1}/{args.rounds}", file=sys.stderr)
    med = {k: tuple(bu.median(list(col)) for col in zip(*v)) for k, v in runs.items()}
    return shape_row(args, torch, shape, dtype, med)


if __name__ == "__main__":
    main()
