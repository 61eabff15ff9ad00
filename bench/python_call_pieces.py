#!/usr/bin/python3
"""Where one call from Python goes: a 1-token dispatch and combine on one in-process rank
(hidden 7168 bf16, top-8 of 256, torch tensors, as bench/python_exchange.py's overhead part),
and the pieces of the binding's cost timed alone.

  PYTHONPATH=build/python /usr/bin/python3 bench/python_call_pieces.py

Each piece: --calls calls in a row timed with perf_counter_ns around each call, the mean per
call; --rounds rounds alternate the pieces, medians over the rounds (us). Pieces:
  dispatch, combine            as a user calls them (combine with out=, y = combine_input's view)
  combine, positional out      the same call without the keyword (pybind11 matches keywords)
  Tensor.__dlpack__            one DLPack export (what the binding once made per tensor argument)
  7 tensor attributes          requires_grad, is_cpu, layout, dtype, shape, stride(), data_ptr()
                               read from Python (what the binding reads per tensor argument)
  DispatchResult.handle        a small pybind11 object made and returned
  combine_input                a torch view of the combine region (DLPack out, and its lease)
  barrier                      a 1-rank barrier: the GIL released and taken back around a wait
The C++ figure for the same operations is `epx bench exchange --tokens 1 --ranks 1
--nodes-shapes 1x1` (bench/python_exchange.py runs both). Prints one JSON object.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_gloo_dispatch import EXPERTS, HIDDEN, make_inputs  # noqa: E402

import torch  # noqa: E402

import epx  # noqa: E402


def pieces(buf, t, x, idx, w, out):
    """{name: (setup or None, the call)}."""
    r = buf.dispatch(x, idx, w)
    handle = r.handle
    held = {}

    def fresh_y():
        held["y"] = buf.combine_input(handle, "bf16", library="torch")

    return {
        "dispatch": (None, lambda: buf.dispatch(x, idx, w)),
        "combine": (fresh_y, lambda: buf.combine(held["y"], handle, out=out)),
        "combine, positional out": (fresh_y, lambda: buf.combine(held["y"], handle, out)),
        "Tensor.__dlpack__": (None, x.__dlpack__),
        "7 tensor attributes": (None, lambda: (x.requires_grad, x.is_cpu, x.layout, x.dtype, x.shape, x.stride(),
                                               x.data_ptr())),
        "DispatchResult.handle": (None, lambda: r.handle),
        "combine_input": (None, lambda: buf.combine_input(handle, "bf16", library="torch")),
        "barrier": (None, lambda: t.barrier(timeout=60.0)),
    }, held


def time_piece(setup, fn, calls):
    """Mean ns per call of fn (setup, when given, runs untimed before each call)."""
    total = 0
    for _ in range(calls):
        if setup is not None:
            setup()
        start = time.perf_counter_ns()
        fn()
        total += time.perf_counter_ns() - start
    return total / calls


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=1500, help="calls per piece and round")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    x, idx64, w = make_inputs(0, 1, 1)
    idx = idx64.to(torch.int32)

    def rank_fn(t):
        buf = epx.Buffer(t, num_experts=EXPERTS, hidden=HIDDEN, dtype="bf16", max_tokens_per_rank=1,
                         max_recv_tokens=EXPERTS, max_combine_dtype="bf16")
        out = torch.empty(1, HIDDEN, dtype=torch.bfloat16)
        table, held = pieces(buf, t, x, idx, w, out)
        samples = {name: [] for name in table}
        for _ in range(args.rounds):
            for name, (setup, fn) in table.items():
                samples[name].append(time_piece(setup, fn, args.calls) / 1e3)
                held.clear()  # no view of the combine region into the next piece
        return {name: round(statistics.median(v), 3) for name, v in samples.items()}

    print(json.dumps({"epx": os.path.dirname(epx.__file__), "us_per_call": epx.InprocWorld(1).run(rank_fn)[0]}))


if __name__ == "__main__":
    main()
