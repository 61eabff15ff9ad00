"""Autograd functions over epx's exchange and router (docs/python.md, "epx.torch").

Each function is one epx call forward and epx's own backward pass backward:

- ``dispatch(buffer, x, topk_idx, topk_weights)``: Buffer.dispatch, then the
  received rows laid out per local expert (Buffer.expand) in a tensor torch
  owns. Backward folds the expanded rows' gradient back onto the received
  rows (in slot order) and runs Buffer.dispatch_backward, which also brings
  back the gradient of the top-k weights.
- ``combine(buffer, y_expanded, recv_topk_weights, dispatched, weights_at="holder")``:
  Buffer.combine_expanded; backward is Buffer.combine_expanded_backward
  (gradients of the expert outputs and of the received weights). With
  weights_at="receiver" each token's rank applies the weights it dispatched
  (recv_topk_weights must be the dispatch's; the Buffer needs
  max_expanded_rows); the gradients are the same formulas.
- ``route(config, logits, expert_bias)``: epx.route; backward epx.route_backward.

dispatch and combine are collectives, forward and backward: every rank of
the Buffer's transport calls them in the same order, and every rank must
need their gradients (or none). No view of the Buffer's receive region
outlives a call: what backward needs is copied into torch tensors.
"""
import functools
from dataclasses import dataclass

import torch

import epx

_PAYLOAD_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
_PAYLOAD_ALIASES = {"float32": "f32", "bfloat16": "bf16", torch.float32: "f32", torch.bfloat16: "bf16"}


def first_order(backward):
    """Marks an autograd backward as first-order only: it runs without building a graph, and a
    double backward (create_graph=True, then differentiating its results) raises a RuntimeError
    naming the function instead of silently giving wrong second derivatives."""
    @functools.wraps(backward)
    def wrapped(ctx, *grads):
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not (torch.is_grad_enabled() and any(isinstance(g, torch.Tensor) and g.requires_grad for g in grads)):
            return outputs
        name = backward.__qualname__.split(".")[0].lstrip("_")
        message = (f"epx.torch: {name} has no double backward (its backward is epx's first-order pass): "
                   "differentiate its results without create_graph=True")
        error = torch._C._functions.DelayedError(message.encode(), len(outputs))
        return error(*[o.detach().requires_grad_() if isinstance(o, torch.Tensor) else o for o in outputs])
    return wrapped


def dense(t, dtype=None):
    """t detached, of `dtype`, with row-major strides (what epx's checks want): torch calls a
    tensor contiguous whatever the stride of a dimension of size 1, epx does not."""
    t = t.detach()
    if dtype is not None:
        t = t.to(dtype)
    if t.is_contiguous() and all(s == c for s, c in zip(t.stride(), _row_major(t.shape))):
        return t
    return torch.empty(t.shape, dtype=t.dtype).copy_(t)


def _row_major(shape):
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return list(reversed(strides))


def dtype_name(dtype):
    """epx's name ("f32" or "bf16") of a payload dtype given as that name, "float32",
    "bfloat16", torch.float32 or torch.bfloat16; ValueError naming it otherwise."""
    name = _PAYLOAD_ALIASES.get(dtype, dtype) if isinstance(dtype, (str, torch.dtype)) else None
    if name not in _PAYLOAD_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of 'f32', 'bf16', torch.float32, torch.bfloat16")
    return name


def payload_dtype(dtype):
    """The torch dtype of an epx payload dtype ("f32", "bf16", or the torch dtype itself)."""
    return _PAYLOAD_DTYPES[dtype_name(dtype)]


@dataclass
class Dispatched:
    """What one dispatch gives the experts and the matching combine."""
    x_expanded: torch.Tensor         # [rows, H] payload dtype, per local expert (expert_offsets)
    recv_topk_weights: torch.Tensor  # [num_recv, K] f32 (autograd: the weights' gradient flows back)
    handle: object                   # epx.Handle of the dispatch
    expert_offsets: torch.Tensor     # [num_local + 1] int64: expert l is rows [offsets[l], offsets[l + 1])
    num_tokens: int                  # tokens this rank dispatched


class _HandleBox:
    """Carries the dispatch's handle out of _Dispatch.forward (autograd passes tensors only)."""
    handle = None


def _layout_tensor(values):
    return torch.as_tensor(values, dtype=torch.int64).reshape(-1).clone()


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_idx, topk_weights, buffer, box):
        result = buffer.dispatch(dense(x), dense(topk_idx), dense(topk_weights))
        handle = result.handle
        layout = buffer.expanded_layout(handle)
        offsets = _layout_tensor(layout.expert_offsets)
        rows = int(offsets[-1]) if offsets.numel() else 0
        x_expanded = torch.empty((rows, x.shape[1]), dtype=x.dtype)
        buffer.expand(result.recv_x, handle, out=x_expanded)
        recv_weights = torch.as_tensor(result.recv_topk_weights).clone()
        del result  # no view of the receive region survives this call
        row_of = _layout_tensor(layout.row_of).reshape(recv_weights.shape)
        box.handle = handle
        ctx.buffer, ctx.handle, ctx.x_dtype = buffer, handle, x.dtype
        ctx.num_tokens, ctx.topk = x.shape[0], topk_weights.shape[1]
        ctx.save_for_backward(row_of)
        ctx.mark_non_differentiable(offsets)
        return x_expanded, recv_weights, offsets

    @staticmethod
    @first_order
    def backward(ctx, grad_x_expanded, grad_recv_weights, _grad_offsets):
        (row_of,) = ctx.saved_tensors
        num_recv, hidden = row_of.shape[0], grad_x_expanded.shape[1]
        grad_recv_x = fold_expanded(grad_x_expanded.float(), row_of)
        if grad_recv_weights is None:
            grad_recv_weights = torch.zeros((num_recv, ctx.topk), dtype=torch.float32)
        grad_x = torch.empty((ctx.num_tokens, hidden), dtype=torch.float32)
        grad_weights = torch.empty((ctx.num_tokens, ctx.topk), dtype=torch.float32)
        ctx.buffer.dispatch_backward(grad_recv_x, ctx.handle, grad_x=grad_x,
                                     grad_recv_topk_weights=dense(grad_recv_weights, torch.float32),
                                     grad_topk_weights=grad_weights)
        return grad_x.to(ctx.x_dtype), None, grad_weights, None, None


def fold_expanded(grad_expanded, row_of):
    """grad_recv[r] = sum over slots k (in order) of grad_expanded[row_of[r, k]] (-1: nothing)."""
    rows, hidden = grad_expanded.shape
    padded = torch.cat([grad_expanded, grad_expanded.new_zeros((1, hidden))])
    index = torch.where(row_of < 0, torch.full_like(row_of, rows), row_of)
    out = grad_expanded.new_zeros((row_of.shape[0], hidden))
    for k in range(row_of.shape[1]):
        out += padded.index_select(0, index[:, k])
    return out


def dispatch(buffer, x, topk_idx, topk_weights):
    """Dispatches x [T, H] (payload dtype) to the experts of topk_idx [T, K] (int32)
    with topk_weights [T, K] f32; returns a Dispatched. Differentiable in x and
    topk_weights (through Dispatched.x_expanded and .recv_topk_weights)."""
    box = _HandleBox()
    x_expanded, recv_weights, offsets = _Dispatch.apply(x, topk_idx, topk_weights, buffer, box)
    return Dispatched(x_expanded, recv_weights, box.handle, offsets, x.shape[0])


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_expanded, recv_weights, buffer, handle, num_tokens, payload, weights_at):
        y = dense(y_expanded, torch.float32)
        w = dense(recv_weights, torch.float32)
        out = torch.empty((num_tokens, y.shape[1]), dtype=torch.float32)
        if weights_at == "receiver":  # the weights this rank dispatched, applied here
            buffer.combine_expanded(y, handle, out=out, weights_at="receiver")
        else:
            buffer.combine_expanded(y, handle, out=out, weights=w, weights_at=weights_at)
        ctx.buffer, ctx.handle, ctx.payload = buffer, handle, payload
        ctx.save_for_backward(y, w)
        return out

    @staticmethod
    @first_order
    def backward(ctx, grad_out):
        y, w = ctx.saved_tensors
        grad_y = torch.empty_like(y)
        grad_w = torch.empty_like(w)
        ctx.buffer.combine_expanded_backward(dense(grad_out, ctx.payload), ctx.handle, y, w,
                                             grad_y_expanded=grad_y, grad_weights=grad_w)
        return grad_y, grad_w, None, None, None, None, None


def combine(buffer, y_expanded, recv_topk_weights, dispatched, weights_at="holder"):
    """out [T, H] f32 = the weighted sum of every token's expert outputs (y_expanded
    [rows, H] in the expanded layout of `dispatched`); differentiable in both.
    weights_at: "holder" (each holder rank weighs and sums its rows) or "receiver"."""
    return _Combine.apply(y_expanded, recv_topk_weights, buffer, dispatched.handle, dispatched.num_tokens,
                          dispatched.x_expanded.dtype, weights_at)


class _Route(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, config, expert_bias, box):
        routed = epx.route(config, dense(logits, torch.float32), expert_bias=expert_bias)
        idx = torch.as_tensor(routed.topk_idx).to(torch.int32).clone()
        weights = torch.as_tensor(routed.topk_weights).float().clone()
        box.routed = routed
        ctx.config, ctx.routed = config, routed
        ctx.mark_non_differentiable(idx)
        return idx, weights

    @staticmethod
    @first_order
    def backward(ctx, _grad_idx, grad_weights):
        grad = epx.route_backward(ctx.config, ctx.routed, dense(grad_weights, torch.float32))
        return torch.as_tensor(grad).float().reshape(ctx.routed.num_tokens, ctx.routed.num_experts), None, None, None


class _RoutedBox:
    routed = None


def route(config, logits, expert_bias=None):
    """epx.route of logits [T, E] f32: (topk_idx [T, K] int32, topk_weights [T, K] f32,
    the epx RouterOutput); topk_weights is differentiable in logits (epx.route_backward)."""
    box = _RoutedBox()
    idx, weights = _Route.apply(logits, config, expert_bias, box)
    return idx, weights, box.routed


class _GroupedSwiGLU(torch.autograd.Function):
    """y[rows of expert l] = SwiGLU_l(x[rows of expert l]), f32, one GEMM per expert and
    weight; backward writes each expert's weight gradients straight into one contiguous
    gradient per weight (autograd's slices or unbind would join them in extra copies).
    Every backward returns tensors of its own: autograd may hold one call's gradients
    while another call's backward runs (one module called twice in a graph)."""

    @staticmethod
    def forward(ctx, x, w1, w3, w2, counts):
        # Per-expert intermediates, not one [rows, F] tensor: glibc serves blocks under 32 MiB
        # from memory it keeps, larger ones are fresh pages, whose page faults are costly.
        h1 = [xl @ w1[l] for l, xl in enumerate(x.split(counts))]
        h3 = [xl @ w3[l] for l, xl in enumerate(x.split(counts))]
        y = [(torch.nn.functional.silu(a) * b) @ w2[l] for l, (a, b) in enumerate(zip(h1, h3))]
        ctx.counts = counts
        ctx.save_for_backward(x, w1, w3, w2, *h1, *h3)
        return torch.cat(y) if y else x.new_zeros((0, x.shape[1]))

    @staticmethod
    @first_order
    def backward(ctx, grad_y):
        x, w1, w3, w2, *h = ctx.saved_tensors
        L = len(ctx.counts)
        grad_y = grad_y.contiguous()
        grad_x = torch.empty_like(x)
        grads = [torch.empty_like(w) for w in (w1, w3, w2)]
        pieces = (t.split(ctx.counts) for t in (x, grad_y, grad_x))
        for l, (xl, gyl, gxl) in enumerate(zip(*pieces)):
            _swiglu_backward_one(l, xl, gyl, h[l], h[L + l], gxl, (w1, w3, w2), grads)
        return (grad_x, *grads, None)


def _swiglu_backward_one(l, x, grad_y, h1, h3, grad_x, weights, grads):
    """Expert l's part of _GroupedSwiGLU.backward: grad_x rows and grads[*][l]."""
    w1, w3, w2 = weights
    if x.shape[0] == 0:
        for g in grads:
            g[l].zero_()
        return
    s = torch.sigmoid(h1)
    silu = h1 * s
    torch.mm((silu * h3).t(), grad_y, out=grads[2][l])
    grad_a = grad_y @ w2[l].t()
    grad_h3 = grad_a * silu
    grad_h1 = grad_a * h3 * (s * (1 + h1 * (1 - s)))
    torch.mm(x.t(), grad_h1, out=grads[0][l])
    torch.mm(x.t(), grad_h3, out=grads[1][l])
    torch.mm(grad_h1, w1[l].t(), out=grad_x)
    grad_x.addmm_(grad_h3, w3[l].t())


def grouped_swiglu(x, counts, w1, w3, w2):
    """The experts of one rank: x [rows, H] f32 in the expanded layout (expert l's rows are
    counts[l] consecutive rows), w1, w3 [L, H, F], w2 [L, F, H] f32 -> y [rows, H] f32;
    differentiable in x and the weights."""
    return _GroupedSwiGLU.apply(x.contiguous(), w1.contiguous(), w3.contiguous(), w2.contiguous(), list(counts))
