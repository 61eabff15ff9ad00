"""epx.torch.MetricsWriter: a PyTorch run's metrics in `epx train --metrics`'s format.

    metrics = et.MetricsWriter("metrics.jsonl", transport, moe_layers)   # every rank
    for step in range(steps):
        ... forward, backward, optimizer step ...
        metrics.step(step, loss.item(), lr=lr, tokens=global_tokens)    # every rank
        # on steps that evaluate: metrics.step(..., val_loss=held_out_loss)
    metrics.close()

One JSON line per step (docs/operations.md lists the fields), so `epx monitor` and
`epx report` read a PyTorch run as they read `epx train`'s. Per MoE layer: the step's
load over every rank (MaxVio, CV, dropped slots, tokens per expert and per rank,
idle fraction: the last forward's epx.LoadStats). Per rank: the seconds its MoE
layers' forwards spent routing, dispatching, in the experts and combining, `dense`
for the rest of its step (attention, the backward, the optimizer) and `total`, the
rank's time since its previous step() call. Exchange waits are not measured from
Python: those fields stay 0.
"""
import json
import math
import time

import torch

from .moe import all_reduce_sum

# The MoE forward's phases, as MoE.times names them.
_PHASES = ("router", "dispatch", "experts", "combine")


def _number(value):
    """JSON has no NaN or infinity: the trainer writes null there, and the reader reads NaN."""
    value = float(value)
    return value if math.isfinite(value) else None


def _layer_record(index, stats):
    return {"layer": index, "max_vio": _number(stats.max_vio), "cv": _number(stats.cv),
            "dropped": stats.num_dropped, "worst_rank": stats.worst_rank,
            "worst_rank_share": _number(stats.worst_rank_share), "idle_fraction": _number(stats.idle_fraction),
            "tokens_per_expert": list(stats.tokens_per_expert), "tokens_per_rank": list(stats.tokens_per_rank)}


class MetricsWriter:
    """Collective: every rank makes one with the same arguments and calls step() after each
    optimizer step; rank 0 writes. `path` must not exist (nothing of an existing file is
    changed: FileExistsError on every rank) unless append=True (a resumed run adding steps).
    `layers`: the model's epx.torch.MoE modules, in layer order."""

    def __init__(self, path, transport, layers, *, append=False):
        self.transport, self.layers, self.path = transport, list(layers), path
        self._file = None
        failed = None
        if transport.rank == 0:
            try:
                self._file = open(path, "a" if append else "x", encoding="utf-8")
            except OSError as e:
                failed = e
        # Every rank learns whether rank 0 could open the file, so none waits in a later step().
        self._agree(failed, f"could not open {path}")
        self._last = time.perf_counter()

    def _agree(self, failed, what):
        """Collective: raises on every rank when rank 0 failed (its own error there; on the others
        FileExistsError for an existing file, else OSError naming it)."""
        code = 0.0 if failed is None else (1.0 if isinstance(failed, FileExistsError) else 2.0)
        flag = float(all_reduce_sum(self.transport, torch.tensor([code], dtype=torch.float64))[0])
        if flag == 0:
            return
        if failed is not None:
            raise failed
        error = FileExistsError if flag == 1 else OSError
        raise error(f"epx.torch.MetricsWriter: rank 0 {what}")

    def _rank_times(self, seconds):
        """[ranks, phases + 1] seconds: each rank's MoE phases (read and reset) and its step time."""
        R, rank = self.transport.num_ranks, self.transport.rank
        times = torch.zeros(R, len(_PHASES) + 1, dtype=torch.float64)
        for layer in self.layers:
            for i, phase in enumerate(_PHASES):
                times[rank, i] += layer.times.get(phase, 0.0)
            layer.times.clear()
        times[rank, -1] = seconds
        return all_reduce_sum(self.transport, times.flatten()).reshape(R, -1)

    def _rank_record(self, rank, row):
        moe = {phase: float(row[i]) for i, phase in enumerate(_PHASES)}
        total = float(row[-1])
        return {"rank": rank, **moe, "dense": max(total - sum(moe.values()), 0.0), "wait": 0.0, "sync": 0.0,
                "total": total}

    def step(self, step, loss, *, main_loss=None, val_loss=None, lr=0.0, grad_norm=0.0, tokens=0):
        """Collective: one line for `step` (0-based). loss: the step's loss as rank 0 holds it
        (make it the global loss); main_loss: without the auxiliary losses (default: loss);
        val_loss: the held-out loss measured after this step, on the steps that evaluate (None:
        the line has no val_loss); tokens: the step's tokens over every rank (for tokens/s)."""
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        times = self._rank_times(seconds)
        failed = None
        if self._file is not None:
            try:
                self._write(step, loss, main_loss, val_loss, lr, grad_norm, tokens, seconds, times)
            except OSError as e:  # a full disk: every rank raises, none waits in the next step
                failed = e
                self._drop_file()
        self._agree(failed, f"could not write step {step} to {self.path}")

    def _write(self, step, loss, main_loss, val_loss, lr, grad_norm, tokens, seconds, times):
        layers = [_layer_record(i, layer.load["stats"]) for i, layer in enumerate(self.layers) if layer.load]
        record = {"step": int(step), "loss": _number(loss),
                  "main_loss": _number(loss if main_loss is None else main_loss)}
        if val_loss is not None:
            record["val_loss"] = _number(val_loss)
        record.update({"lr": _number(lr), "grad_norm": _number(grad_norm), "seconds": seconds,
                       "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
                       "num_nodes": self.transport.num_nodes, "layers": layers,
                       "ranks": [self._rank_record(r, times[r]) for r in range(self.transport.num_ranks)]})
        self._file.write(json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n")
        self._file.flush()

    def _drop_file(self):
        """After a failed write: the file is closed without its unwritten buffer."""
        try:
            self._file.close()
        except OSError:
            pass
        self._file = None

    def close(self):
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
