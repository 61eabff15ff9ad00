#!/usr/bin/python3
"""epx's MoELayer against a plain PyTorch eager MoE layer of the same shape.

The PyTorch layer is what common model code does: RMSNorm, a linear router,
softmax, top-k with renormalised weights, then a Python loop over experts with
index_select / SwiGLU / index_add_. Both run on the same machine with the same
number of threads (epx: --ranks in-process ranks of one thread each; PyTorch:
torch.set_num_threads), interleaved shape by shape and repetition by
repetition; each figure is the median of --rounds runs of a median of --reps.

  /usr/bin/python3 bench/moe_layer_vs_torch.py --bench build/bench/moe_layer_bench

Needs Debian's python3-torch (for /usr/bin/python3). Prints one JSON object per
shape and a table.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_util as bu  # noqa: E402

SHAPES = [  # tokens, hidden, ffn_hidden, experts, topk
    (2048, 256, 512, 16, 2),
    (4096, 512, 1024, 32, 4),
    (1024, 1024, 2048, 8, 2),
]


def eager_params(torch, hidden, ffn, experts):
    """The eager layer's weights: RMSNorm scale, router [H, E], per-expert w1, w3 [H, F] and w2 [F, H]."""
    torch.manual_seed(0)
    std = hidden ** -0.5
    # One tensor per expert, as an nn.ModuleList of experts holds them (slicing
    # one stacked tensor would make every expert's backward write a full-size
    # gradient).
    return {"norm_w": torch.ones(hidden, requires_grad=True),
            "router": (torch.randn(hidden, experts) * std).requires_grad_(),
            "w1": [(torch.randn(hidden, ffn) * std).requires_grad_() for _ in range(experts)],
            "w3": [(torch.randn(hidden, ffn) * std).requires_grad_() for _ in range(experts)],
            "w2": [(torch.randn(ffn, hidden) * ffn ** -0.5).requires_grad_() for _ in range(experts)]}


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


def torch_layer(torch, tokens, hidden, ffn, experts, topk, threads, reps):
    torch.set_num_threads(threads)
    p = eager_params(torch, hidden, ffn, experts)
    x = torch.randn(tokens, hidden)
    grad = torch.randn(tokens, hidden)
    return time_layer(torch, lambda: eager_forward(torch, p, x, topk), param_list(p), grad, reps)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", default="build/bench/moe_layer_bench")
    ap.add_argument("--threads", type=int, default=1, help="threads of each side (epx: ranks)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        sys.exit("moe_layer_vs_torch: PyTorch is not installed (Debian: apt-get install python3-torch)")
    rows = []
    for tokens, hidden, ffn, experts, topk in SHAPES:
        runs = {"epx": [], "torch": []}
        for rnd in range(args.rounds):
            cmd = [args.bench, "--tokens", str(tokens), "--hidden", str(hidden), "--ffn-hidden", str(ffn),
                   "--experts", str(experts), "--topk", str(topk), "--ranks", str(args.threads),
                   "--reps", str(args.reps)]
            e = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
            runs["epx"].append((e["forward_s"], e["train_s"]))
            runs["torch"].append(torch_layer(torch, tokens, hidden, ffn, experts, topk, args.threads, args.reps))
            print(f"  shape {tokens}x{hidden}x{ffn} E={experts} k={topk}: round {rnd + 1}/{args.rounds}", file=sys.stderr)
        med = {k: (statistics.median(f for f, _ in v), statistics.median(b for _, b in v)) for k, v in runs.items()}
        row = {"tokens": tokens, "hidden": hidden, "ffn_hidden": ffn, "experts": experts, "topk": topk,
               "threads": args.threads, "torch_version": torch.__version__,
               "epx_forward_tok_s": tokens / med["epx"][0], "torch_forward_tok_s": tokens / med["torch"][0],
               "epx_train_tok_s": tokens / med["epx"][1], "torch_train_tok_s": tokens / med["torch"][1]}
        row["forward_speedup"] = row["epx_forward_tok_s"] / row["torch_forward_tok_s"]
        row["train_speedup"] = row["epx_train_tok_s"] / row["torch_train_tok_s"]
        print(json.dumps(row))
        rows.append(row)
    print(f"{'shape (T x H x F, E, k)':>28} {'epx fwd':>10} {'torch fwd':>10} {'x':>6} {'epx f+b':>10} {'torch f+b':>10} {'x':>6}")
    for r in rows:
        shape = f"{r['tokens']}x{r['hidden']}x{r['ffn_hidden']}, {r['experts']}, {r['topk']}"
        print(f"{shape:>28} {r['epx_forward_tok_s']:10.0f} {r['torch_forward_tok_s']:10.0f} {r['forward_speedup']:6.2f}"
              f" {r['epx_train_tok_s']:10.0f} {r['torch_train_tok_s']:10.0f} {r['train_speedup']:6.2f}")


if __name__ == "__main__":
    main()
