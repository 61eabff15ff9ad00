#!/usr/bin/python3
"""Train a small MoE transformer language model on real English text, byte by byte.

    /usr/bin/python3 examples/python/train_lm.py --ranks 2          # 2 in-process ranks (threads)
    mpirun -n 2 /usr/bin/python3 examples/python/train_lm.py        # 2 processes, experts split 2 ways
    /usr/bin/python3 -m epx.launch --nproc-per-node 2 examples/python/train_lm.py   # the torchrun way
    /usr/bin/python3 examples/python/train_lm.py --balance bias --metrics run.jsonl
    build/bin/epx report run.jsonl -o report.html                   # the run's report (train and validation loss, load)

The text: the fortune cookies of Debian's `fortunes` package (/usr/share/games/fortunes,
installed by scripts/setup.sh): about 2.4 MB of English quotations, jokes, poems and
definitions in 41 files of entries separated by "%" lines (ascii-art, pictures, and
translate-me, mostly not English, are left out). Held out, never trained on: the last
--val-fraction of each file's entries (so every topic is in both splits).

The model: a byte embedding, --layers pre-norm blocks x + attention(LayerNorm(x)), then
x + MoE(LayerNorm(x)) with torch's causal multi-head attention and epx.torch.MoE as the FFN
(norm_and_residual=False: the drop-in form), a final LayerNorm and a head over the 256 bytes;
torch's AdamW. Batches, initialisation and held-out windows come from --seed alone, so a seed
gives the same curve on any launcher and, up to summation order, any number of ranks (each rank
trains on its share of the same global batch, as in train_moe.py).

--balance picks the experts' load balancing: none, aux (the global-batch auxiliary loss,
--aux-loss-coeff), bias (aux-loss-free: the expert bias, --bias-rate). EPLB (redundant experts
re-placed by measured load) is not exposed by epx.torch: --balance eplb exits with an error.
"""
import argparse
import json
import math
import os
import sys
import time

import torch
from torch import nn

import epx
import epx.torch as et

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_moe import CURVE_TOLERANCE, MoELanguageModel, compare_curves, global_batch, train_step  # noqa: E402

CORPUS = "/usr/share/games/fortunes"
# Files of CORPUS left out: pictures, and text mostly in other languages.
NOT_PROSE = ("ascii-art", "translate-me")
BALANCING = ("none", "aux", "bias", "eplb")
LN_256 = math.log(256.0)  # the loss of a uniform guess over the bytes


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--batch", type=int, default=16, help="sequences per step over all ranks (a multiple of the ranks)")
    p.add_argument("--seq-len", type=int, default=64, help="bytes per sequence")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn-hidden", type=int, default=128, help="width of each routed expert")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--shared-experts", type=int, default=0)
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32", help="dispatch payload and expert weights")
    p.add_argument("--balance", choices=BALANCING, default="aux", help="expert load balancing")
    p.add_argument("--aux-loss-coeff", type=float, default=0.01, help="for --balance aux")
    p.add_argument("--bias-rate", type=float, default=1e-3, help="for --balance bias: the bias step per update")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ranks", type=int, default=1, help="in-process ranks (threads) when not under mpirun")
    p.add_argument("--corpus", default=CORPUS, help="folder of fortune files (entries between '%%' lines)")
    p.add_argument("--val-fraction", type=float, default=0.1, help="held-out share of each file's entries")
    p.add_argument("--val-batches", type=int, default=4, help="held-out batches of --batch sequences per evaluation")
    p.add_argument("--eval-every", type=int, default=50, help="evaluate on the held-out text every N steps (and last)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--losses-out", help="write the train and validation curves and the final load here (JSON)")
    p.add_argument("--metrics", help="write epx train's metrics lines here (a new file; val_loss on the steps "
                                     "that evaluate), for epx monitor and epx report")
    p.add_argument("--compare", help="a curve from --losses-out: exit 1 if a step differs by more than the tolerance")
    p.add_argument("--tolerance", type=float, default=CURVE_TOLERANCE, help="for --compare, per step")
    p.add_argument("--exact", action="store_true",
                   help="for --compare: every loss must be the same float (as printed in shortest round-trip form), "
                        "e.g. the same number of ranks under another launcher")
    p.add_argument("--check", action="store_true",
                   help=f"exit 1 unless the last train loss is below the first and below ln 256 = {LN_256:.4f}")
    args = p.parse_args(argv)
    if args.balance == "eplb":
        p.error("--balance eplb: EPLB (redundant experts re-placed by load) is not exposed by epx.torch; "
                "it is built for epx train (--balance eplb) and epx eplb only")
    if not 0.0 < args.val_fraction < 1.0:
        p.error(f"--val-fraction {args.val_fraction} is not in (0, 1)")
    for name in ("steps", "val_batches", "eval_every", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} is below 1")
    return args


def split_corpus(folder, val_fraction):
    """(train, validation) byte tensors: each file's entries, the last val_fraction of them held out."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"--corpus {folder}: no such folder; install Debian's package fortunes "
                                "(scripts/setup.sh does)")
    names = sorted(f for f in os.listdir(folder) if not f.endswith((".dat", ".u8")) and f not in NOT_PROSE
                   and os.path.isfile(os.path.join(folder, f)) and not os.path.islink(os.path.join(folder, f)))
    train, val = [], []
    for name in names:
        entries = [e for e in open(os.path.join(folder, name), "rb").read().split(b"\n%\n") if e.strip()]
        held = max(1, round(len(entries) * val_fraction)) if len(entries) > 1 else 0
        train += entries[:len(entries) - held]
        val += entries[len(entries) - held:]
    if not train or not val:
        raise ValueError(f"--corpus {folder}: no fortune entries to train on and hold out")
    joined = [b"\n%\n".join(part) + b"\n" for part in (train, val)]
    return [torch.frombuffer(bytearray(data), dtype=torch.uint8).long() for data in joined]


class Block(nn.Module):
    """Pre-norm: x + causal self-attention(LayerNorm(x)), then x + MoE(LayerNorm(x)), the MoE as a
    drop-in FFN (norm_and_residual=False) on [batch, seq, hidden]."""

    def __init__(self, args, transport, layer_index):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(args.hidden), nn.LayerNorm(args.hidden)
        self.attn = nn.MultiheadAttention(args.hidden, args.heads, batch_first=True)
        self.moe = et.MoE(args.hidden, args.ffn_hidden, args.experts, args.topk, transport=transport,
                          layer_index=layer_index, num_shared_experts=args.shared_experts, dtype=args.dtype,
                          aux_loss_coeff=args.aux_loss_coeff if args.balance == "aux" else 0.0,
                          aux_loss="global-batch", expert_bias=args.balance == "bias", bias_rate=args.bias_rate,
                          seed=args.seed, max_tokens_per_rank=args.batch * args.seq_len, norm_and_residual=False)

    def forward(self, x):
        s = x.shape[1]
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
        a = self.norm1(x)
        x = x + self.attn(a, a, a, attn_mask=mask, need_weights=False)[0]
        return x + self.moe(self.norm2(x))


def validation_loss(model, transport, val, args):
    """Mean cross-entropy over --val-batches fixed held-out batches (every rank its share; collective).
    The MoE layers' load and phase times are those of the last training step again afterwards."""
    R, rank = transport.num_ranks, transport.rank
    mine = slice(rank * args.batch // R, (rank + 1) * args.batch // R)
    saved = [(m.load, dict(m.times)) for m in model.moe_layers()]
    total = torch.zeros(1, dtype=torch.float64)
    with torch.no_grad():
        for i in range(args.val_batches):
            inputs, targets = global_batch(val, i, args)  # the same windows at every evaluation
            logits = model(inputs[mine])
            total += nn.functional.cross_entropy(logits.reshape(-1, 256), targets[mine].reshape(-1),
                                                 reduction="sum").double()
    for m, (load, times) in zip(model.moe_layers(), saved):
        m.load, m.times = load, times
    return float(et.all_reduce_sum(transport, total)[0]) / (args.val_batches * args.batch * args.seq_len)


def global_aux_loss(model, transport):
    """The last step's auxiliary losses summed over ranks and layers (0 without aux loss)."""
    aux = sum(m.aux_loss.detach().double() for m in model.moe_layers()).reshape(1)
    return float(et.all_reduce_sum(transport, aux)[0])


class Curves:
    """The run's record: train loss (with the auxiliary losses) and cross-entropy per step,
    validation loss at its steps, MaxVio per layer per step, training seconds."""

    def __init__(self):
        self.losses, self.main_losses, self.val, self.max_vio, self.seconds = [], [], [], [], 0.0

    def summary(self, args, ranks):
        tail = self.max_vio[-min(10, len(self.max_vio)):]
        return {"ranks": ranks, "balance": args.balance, "losses": self.losses, "main_losses": self.main_losses,
                "val": self.val, "final_val_loss": self.val[-1][1],
                "max_vio_last10": [sum(col) / len(col) for col in zip(*tail)],
                "tokens_per_s": len(self.losses) * args.batch * args.seq_len / self.seconds}


def train(transport, args):
    R, rank = transport.num_ranks, transport.rank
    if args.batch % R != 0:
        raise ValueError(f"--batch {args.batch} is not a multiple of the {R} ranks")
    if args.experts % R != 0:
        raise ValueError(f"--experts {args.experts} is not a multiple of the {R} ranks")
    train_text, val_text = split_corpus(args.corpus, args.val_fraction)
    model = MoELanguageModel(args, transport, block=Block)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    mine = slice(rank * args.batch // R, (rank + 1) * args.batch // R)
    metrics = et.MetricsWriter(args.metrics, transport, model.moe_layers()) if args.metrics else None
    curves = Curves()
    for step in range(args.steps):
        start = time.perf_counter()
        inputs, targets = global_batch(train_text, step, args)
        loss = train_step(model, optimizer, transport, inputs[mine], targets[mine], args)
        main_loss = loss - global_aux_loss(model, transport)
        curves.seconds += time.perf_counter() - start
        curves.losses.append(loss)
        curves.main_losses.append(main_loss)
        curves.max_vio.append([m.load["max_vio"] for m in model.moe_layers()])
        last = step == args.steps - 1
        val_loss = None
        if (step + 1) % args.eval_every == 0 or last:
            val_loss = validation_loss(model, transport, val_text, args)
            curves.val.append([step, val_loss])
        if metrics:  # the evaluation's time counts in this step's seconds
            metrics.step(step, loss, main_loss=main_loss, val_loss=val_loss, lr=args.lr,
                         tokens=args.batch * args.seq_len)
        if rank == 0 and (step % args.log_every == 0 or last):
            vio = " ".join(f"{v:.2f}" for v in curves.max_vio[-1])
            val = f"  val {curves.val[-1][1]:.4f}" if curves.val and curves.val[-1][0] == step else ""
            print(f"step {step:4d}  loss {loss:.4f}  ce {main_loss:.4f}{val}  MaxVio per layer [{vio}]  "
                  f"{curves.seconds:.1f} s", flush=True)
    if metrics:
        metrics.close()
    return curves.summary(args, R)


def run_ranks(args, fn):
    """The launcher's transport: fn(transport) on every rank of the world mpirun, srun, torchrun
    or epx.launch started, else on --ranks in-process ranks (threads). Returns (rank 0's result,
    this process's rank)."""
    transport = epx.launched_transport()
    if transport is not None:
        return fn(transport), transport.rank
    return epx.InprocWorld(num_ranks=args.ranks).run(fn)[0], 0


def check_curve(summary):
    """0 if the run learned: finite losses, the last train loss below the first and below ln 256."""
    losses, val = summary["losses"], summary["final_val_loss"]
    if not all(math.isfinite(x) for x in losses + [val]):
        print("check: a loss is not finite")
        return 1
    ok = losses[-1] < losses[0] and losses[-1] < LN_256
    print(f"check: {'learned' if ok else 'DID NOT LEARN'}: train loss {losses[0]:.4f} -> {losses[-1]:.4f} "
          f"(must end below both the first and ln 256 = {LN_256:.4f})")
    return 0 if ok else 1


def main(argv=None):
    args = parse_args(argv)
    summary, rank = run_ranks(args, lambda t: train(t, args))
    if rank != 0:
        return 0
    vio = " ".join(f"{v:.3f}" for v in summary["max_vio_last10"])
    print(f"{summary['ranks']} rank(s), balance {args.balance}: train loss {summary['losses'][-1]:.4f} "
          f"(ce {summary['main_losses'][-1]:.4f}), validation loss {summary['final_val_loss']:.4f}, "
          f"MaxVio per layer (mean of the last 10 steps) [{vio}], {summary['tokens_per_s']:.0f} tokens/s")
    if args.losses_out:
        with open(args.losses_out, "w") as f:
            json.dump(summary, f)
    status = check_curve(summary) if args.check else int(not all(math.isfinite(x) for x in summary["losses"]))
    if args.compare:
        status = max(status, compare_curves(summary["losses"], args.compare, args.tolerance, args.exact))
    return status


if __name__ == "__main__":
    sys.exit(main())
