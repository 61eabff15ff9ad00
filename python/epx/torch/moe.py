"""epx.torch.MoE: a Mixture-of-Experts block over epx's exchange.

    out = x + combine(experts(dispatch(RMSNorm(x), route(RMSNorm(x) @ router))))
            + shared_experts(RMSNorm(x))

as the C++ MoELayer (include/epx/layer/moe_layer.h), in torch: every rank
holds one MoE per model layer and calls forward with its own tokens; the norm,
the router and the shared experts are dense parameters (replicated: sum their
gradients over ranks before an optimizer step, e.g. all_reduce_grads); the
routed experts are this rank's local experts (contiguous blocks of E / R) and
their gradients already hold every rank's tokens. Forward and backward are
collectives. Initialisation is a pure function of (seed, layer_index, logical
expert), so 1 rank holding every expert starts where R ranks do.
"""
import math

import torch
from torch import nn

import epx

from . import functions

_MASK64 = (1 << 64) - 1
# Streams of the initialisation, per layer (as the C++ layer's).
ROUTER_STREAM, SHARED_STREAM, EXPERT_STREAM = 1, 2, 3


def _splitmix64(z):
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def init_normal(shape, seed, layer_index, stream, sub, std):
    """N(0, std^2) values drawn from their own stream: a pure function of the arguments."""
    key = _splitmix64(_splitmix64(seed) ^ (layer_index << 40) ^ (stream << 32) ^ sub) >> 1
    generator = torch.Generator().manual_seed(key)
    return torch.randn(shape, generator=generator, dtype=torch.float32) * std


def expert_init(seed, layer_index, expert, hidden, ffn_hidden, init_std=0.0):
    """The initial (w1 [H, F], w3 [H, F], w2 [F, H]) of logical expert `expert`."""
    std_h = init_std or 1.0 / math.sqrt(hidden)
    std_f = init_std or 1.0 / math.sqrt(ffn_hidden)
    return (init_normal((hidden, ffn_hidden), seed, layer_index, EXPERT_STREAM, 4 * expert + 1, std_h),
            init_normal((hidden, ffn_hidden), seed, layer_index, EXPERT_STREAM, 4 * expert + 3, std_h),
            init_normal((ffn_hidden, hidden), seed, layer_index, EXPERT_STREAM, 4 * expert + 2, std_f))


def dense_init(seed, layer_index, hidden, ffn_hidden, num_experts, num_shared_experts, init_std=0.0):
    """The initial router [H, E] and shared (w1 [H, S], w3 [H, S], w2 [S, H]) (S = shared width; None if 0)."""
    std_h = init_std or 1.0 / math.sqrt(hidden)
    router = init_normal((hidden, num_experts), seed, layer_index, ROUTER_STREAM, 0, std_h)
    width = num_shared_experts * ffn_hidden
    if width == 0:
        return router, None
    std_s = init_std or 1.0 / math.sqrt(width)
    shared = (init_normal((hidden, width), seed, layer_index, SHARED_STREAM, 1, std_h),
              init_normal((hidden, width), seed, layer_index, SHARED_STREAM, 3, std_h),
              init_normal((width, hidden), seed, layer_index, SHARED_STREAM, 2, std_s))
    return router, shared


def swiglu(x, w1, w3, w2):
    """SwiGLU FFN: (silu(x w1) * (x w3)) w2."""
    return (torch.nn.functional.silu(x @ w1) * (x @ w3)) @ w2


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def all_reduce_sum(transport, tensor):
    """Sum of `tensor` over every rank of `transport` (a new f64 tensor; not differentiable)."""
    data = functions.dense(tensor, torch.float64).clone()
    result = transport.all_reduce(data, op="sum")
    return data if result is None else torch.as_tensor(result)


def all_reduce_grads(parameters, transport):
    """Sums the gradients of `parameters` over the ranks of `transport` (one all-reduce)."""
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return
    flat = functions.dense(torch.cat([p.grad.reshape(-1).float() for p in params]))
    result = transport.all_reduce(flat, op="sum")
    flat = flat if result is None else torch.as_tensor(result)
    offset = 0
    for p in params:
        n = p.grad.numel()
        p.grad.copy_(flat[offset:offset + n].reshape(p.grad.shape))
        offset += n


class MoE(nn.Module):
    """One MoE block on `transport` (epx.InprocWorld's rank transport or epx.mpi_transport()).

    Balancing (as `epx train`): aux_loss_coeff with aux_loss "micro-batch" (each rank's tokens)
    or "global-batch" (f and P over every rank's tokens, one all-reduce); z_loss_coeff;
    expert_bias (aux-loss-free: call update_bias() after each optimizer step);
    capacity_factor (> 0 drops the tokens over each expert's capacity on each rank).
    combine_weights "holder" or "receiver" (MoELayerConfig::combine_weights: each token's rank
    applies its top-k weights, in top-k order; the Buffer is flat with max_expanded_rows).
    dtype "f32" or "bf16": the dispatch payload and the expert GEMMs' weights (f32 maths).
    After each forward: aux_loss (this rank's share, a tensor to add to the loss) and
    load (tokens_per_expert over every rank, max_vio, dropped).
    """

    def __init__(self, hidden, ffn_hidden, num_experts, topk, *, transport, layer_index=0,
                 num_shared_experts=0, dtype="f32", score_function="softmax", normalize_weights=False,
                 capacity_factor=0.0, aux_loss_coeff=0.0, aux_loss="micro-batch", z_loss_coeff=0.0,
                 expert_bias=False, bias_rate=1e-3, norm_eps=1e-6, seed=1, init_std=0.0,
                 max_tokens_per_rank=4096, buffer=None, combine_weights="holder"):
        super().__init__()
        if aux_loss not in ("micro-batch", "global-batch"):
            raise ValueError(f"aux_loss '{aux_loss}' is not one of micro-batch, global-batch")
        if combine_weights not in ("holder", "receiver"):
            raise ValueError(f"combine_weights '{combine_weights}' is not one of holder, receiver")
        if combine_weights == "receiver" and buffer is not None and buffer.max_expanded_rows == 0:
            raise ValueError("combine_weights 'receiver' needs a Buffer with max_expanded_rows > 0")
        ranks = transport.num_ranks
        if num_experts % ranks != 0:
            raise ValueError(f"num_experts = {num_experts} is not a multiple of the {ranks} ranks")
        self.hidden, self.ffn_hidden, self.num_experts, self.topk = hidden, ffn_hidden, num_experts, topk
        self.transport, self.layer_index, self.norm_eps = transport, layer_index, norm_eps
        self.dtype_name, self.payload = dtype, functions.payload_dtype(dtype)
        self.aux_loss_coeff, self.aux_loss_kind, self.z_loss_coeff = aux_loss_coeff, aux_loss, z_loss_coeff
        self.use_expert_bias, self.score_function = expert_bias, score_function
        self.router_config = epx.RouterConfig(num_experts=num_experts, topk=topk, score_function=score_function,
                                              normalize_weights=normalize_weights, capacity_factor=capacity_factor)
        self.bias = epx.ExpertBias(num_experts, rate=bias_rate)
        self.combine_weights = combine_weights
        self.buffer = buffer or self._make_buffer(transport, max_tokens_per_rank)
        self.num_local = num_experts // ranks
        self.first_expert = transport.rank * self.num_local
        self._init_parameters(seed, init_std, num_shared_experts)
        self.aux_loss = torch.zeros(())
        self.load = None
        self._scratch = functions.GradientScratch()

    def _make_buffer(self, transport, max_tokens_per_rank):
        """The Buffer; receiver weights: flat, with room for the expanded rows of y (f32)."""
        kwargs = dict(num_experts=self.num_experts, hidden=self.hidden, dtype=self.dtype_name,
                      max_tokens_per_rank=max_tokens_per_rank, max_topk=self.topk)
        if self.combine_weights == "receiver":
            kwargs.update(algorithm="flat", max_expanded_rows=epx.Buffer.expanded_rows_bound(
                transport.num_ranks, self.num_experts, self.hidden, max_tokens_per_rank, y_dtype="f32",
                max_topk=self.topk))
        return epx.Buffer(transport, **kwargs)

    def _init_parameters(self, seed, init_std, num_shared_experts):
        H, F = self.hidden, self.ffn_hidden
        self.norm = nn.Parameter(torch.ones(H))
        router, shared = dense_init(seed, self.layer_index, H, F, self.num_experts, num_shared_experts, init_std)
        self.router = nn.Parameter(router)
        self.shared = nn.ParameterList([nn.Parameter(w) for w in shared]) if shared else None
        weights = [expert_init(seed, self.layer_index, self.first_expert + l, H, F, init_std)
                   for l in range(self.num_local)]
        self.w1 = nn.Parameter(torch.stack([w[0] for w in weights]))
        self.w3 = nn.Parameter(torch.stack([w[1] for w in weights]))
        self.w2 = nn.Parameter(torch.stack([w[2] for w in weights]))

    def dense_parameters(self):
        """Replicated parameters (sum their gradients over ranks): norm, router, shared experts."""
        return [self.norm, self.router] + (list(self.shared) if self.shared is not None else [])

    def expert_parameters(self):
        """This rank's local experts' w1, w3, w2 ([num_local, ...] each)."""
        return [self.w1, self.w3, self.w2]

    def _stored(self, w):
        """A weight as the GEMMs read it: rounded to bf16 for bf16 layers (the gradient passes through)."""
        return w if self.payload == torch.float32 else w.to(self.payload).float()

    def _experts(self, x_expanded, offsets):
        bounds = offsets.tolist()
        counts = [bounds[l + 1] - bounds[l] for l in range(self.num_local)]
        w1, w3, w2 = (self._stored(w) for w in (self.w1, self.w3, self.w2))
        return functions.grouped_swiglu(x_expanded.float(), counts, w1, w3, w2, self._scratch)

    def forward(self, x):
        """x [T, H] f32 -> out [T, H] f32; sets aux_loss and load."""
        n = rms_norm(x, self.norm, self.norm_eps)
        logits = n @ self.router
        bias = self.bias if self.use_expert_bias else None
        topk_idx, topk_weights, routed = functions.route(self.router_config, logits, bias)
        counts = torch.as_tensor(routed.tokens_per_expert).double()  # kept (token, slot) pairs, counted by epx.route
        self.aux_loss = self._auxiliary_losses(logits, counts, float(topk_idx.numel()))
        payload = n.to(self.payload)
        dispatched = functions.dispatch(self.buffer, payload, topk_idx, topk_weights)
        y = self._experts(dispatched.x_expanded, dispatched.expert_offsets)
        out = x + functions.combine(self.buffer, y, dispatched.recv_topk_weights, dispatched, self.combine_weights)
        if self.shared is not None:
            out = out + swiglu(payload.float(), *[self._stored(w) for w in self.shared])
        self.load = self._load_stats(counts, routed.num_dropped)
        return out

    def _auxiliary_losses(self, logits, counts, pairs):
        """This rank's share of the weighted auxiliary and z losses (summed over ranks: the layer's);
        counts: this rank's kept (token, slot) pairs per expert, pairs: its (token, slot) pairs."""
        R, E = self.transport.num_ranks, self.num_experts
        aux = logits.new_zeros(())
        if self.aux_loss_coeff > 0:
            probs = self._balance_probs(logits)
            p_sum = probs.sum(0)
            c = self.aux_loss_coeff
            if self.aux_loss_kind == "global-batch":
                totals = all_reduce_sum(self.transport, torch.cat([counts, torch.tensor([pairs, logits.shape[0]],
                                                                                          dtype=torch.float64)]))
                counts, pairs, tokens = totals[:E], float(totals[E]), float(totals[E + 1])
                p_all = p_sum + (all_reduce_sum(self.transport, p_sum).float() - p_sum).detach()
                loss = E * ((counts / max(pairs, 1.0)).float() * p_all / max(tokens, 1.0)).sum()
                aux = aux + c * loss - (c * (1.0 - 1.0 / R) * loss).detach()
            elif logits.shape[0] > 0:
                loss = E * ((counts / pairs).float() * p_sum / logits.shape[0]).sum()
                aux = aux + c / R * loss
        if self.z_loss_coeff > 0 and logits.shape[0] > 0:
            aux = aux + self.z_loss_coeff / R * torch.logsumexp(logits, -1).pow(2).mean()
        return aux

    def _balance_probs(self, logits):
        if self.score_function == "sigmoid":
            s = torch.sigmoid(logits)
            return s / s.sum(-1, keepdim=True)
        return torch.softmax(logits, -1)

    def _load_stats(self, counts, num_dropped):
        """Tokens per expert over every rank, MaxVio, dropped slots (one all-reduce)."""
        E = self.num_experts
        local = torch.cat([counts, torch.tensor([num_dropped], dtype=torch.float64)])
        total = all_reduce_sum(self.transport, local)
        tokens = total[:E].to(torch.int64)
        mean = float(tokens.double().mean())
        max_vio = float(tokens.max()) / mean - 1.0 if mean > 0 else 0.0
        return {"tokens_per_expert": tokens, "max_vio": max_vio, "dropped": int(total[E])}

    def update_bias(self):
        """Aux-loss-free balancing: moves the expert bias by the last forward's global load."""
        if self.use_expert_bias and self.load is not None:
            self.bias.update(self.load["tokens_per_expert"].tolist())

    def extra_repr(self):
        return (f"hidden={self.hidden}, ffn_hidden={self.ffn_hidden}, num_experts={self.num_experts}, "
                f"topk={self.topk}, local_experts=[{self.first_expert}, {self.first_expert + self.num_local}), "
                f"dtype={self.dtype_name}")
