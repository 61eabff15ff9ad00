"""epx.torch.MoE: a Mixture-of-Experts block over epx's exchange.

    out = x + combine(experts(dispatch(RMSNorm(x), route(RMSNorm(x) @ router))))
            + shared_experts(RMSNorm(x))

(with norm_and_residual=False, a drop-in FFN: out = combine(...) + shared_experts(x))

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
import time
from collections import OrderedDict

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


_EXPERT_WEIGHTS = ("w1", "w3", "w2")
# Not pickled or deep-copied: the transport and the Buffer belong to one process's run
# (attach() gives them back); ExpertBias and RouterConfig are rebuilt from plain values.
_DROPPED_ON_COPY = ("transport", "buffer", "bias", "router_config", "load")


def rank_generator(transport, seed):
    """A torch.Generator of this rank's own stream: a pure function of (seed, rank). In-process
    ranks (InprocWorld) are threads sharing torch's global generator, so draws from it (dropout,
    torch.randn without generator=) interleave in thread order and are not reproducible; give
    each rank's random draws this generator instead."""
    key = _splitmix64(_splitmix64(seed) ^ (transport.rank << 32)) >> 1
    return torch.Generator().manual_seed(key)


class MoE(nn.Module):
    """One MoE block on `transport` (epx.InprocWorld's rank transport or epx.mpi_transport()).

    Creating one is collective: every rank of the transport creates its MoE (and so its
    epx.Buffer) with the same settings, in the same order; forward and backward are collectives.

    Balancing (as `epx train`): aux_loss_coeff with aux_loss "micro-batch" (each rank's tokens)
    or "global-batch" (f and P over every rank's tokens, one all-reduce); z_loss_coeff;
    expert_bias (aux-loss-free: call update_bias() after each optimizer step; the bias is the
    buffer `expert_bias`, saved in state_dict); capacity_factor (> 0 drops the tokens over each
    expert's capacity on each rank).
    combine_weights "holder" or "receiver" (MoELayerConfig::combine_weights: each token's rank
    applies its top-k weights, in top-k order; the Buffer is flat with max_expanded_rows).
    dtype "f32" / torch.float32 or "bf16" / torch.bfloat16: the dispatch payload and the expert
    GEMMs' weights (f32 maths, f32 parameters). norm_and_residual=False drops the built-in RMSNorm
    and residual (a drop-in FFN, as Megatron's MoELayer: out = experts(x) + shared(x)).
    forward takes x [tokens, hidden] or [batch, seq, hidden], float32 or bfloat16, and returns
    out of x's shape and dtype. After each forward: aux_loss (this rank's share, a tensor to add
    to the loss) and load (tokens_per_expert over every rank, max_vio, dropped).
    copy.deepcopy and torch.save(module) keep the parameters and buffers but not the transport:
    call attach(transport) on every rank before the copy's forward.
    """

    def __init__(self, hidden, ffn_hidden, num_experts, topk, *, transport, layer_index=0,
                 num_shared_experts=0, dtype="f32", score_function="softmax", normalize_weights=False,
                 capacity_factor=0.0, aux_loss_coeff=0.0, aux_loss="micro-batch", z_loss_coeff=0.0,
                 expert_bias=False, bias_rate=1e-3, norm_eps=1e-6, seed=1, init_std=0.0,
                 max_tokens_per_rank=4096, buffer=None, combine_weights="holder", norm_and_residual=True):
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
        self.layer_index, self.norm_eps, self.norm_and_residual = layer_index, norm_eps, norm_and_residual
        self.dtype_name = functions.dtype_name(dtype)
        self.payload = functions.payload_dtype(self.dtype_name)
        self.aux_loss_coeff, self.aux_loss_kind, self.z_loss_coeff = aux_loss_coeff, aux_loss, z_loss_coeff
        self.use_expert_bias, self.score_function = expert_bias, score_function
        self._router_kwargs = dict(num_experts=num_experts, topk=topk, score_function=score_function,
                                   normalize_weights=normalize_weights, capacity_factor=capacity_factor)
        self._bias_settings = (bias_rate, False)
        self.combine_weights, self.max_tokens_per_rank = combine_weights, max_tokens_per_rank
        self.num_local = num_experts // ranks
        self.first_expert = transport.rank * self.num_local
        self._rebuild_routing()
        self.register_buffer("expert_bias", torch.zeros(num_experts))
        self.register_buffer("expert_range", torch.tensor([self.first_expert, self.num_local, num_experts]))
        self._init_parameters(seed, init_std, num_shared_experts)
        self.transport, self.buffer = None, None
        self.attach(transport, buffer)
        self.aux_loss = torch.zeros(())
        self.load = None
        self.times = {}  # forward seconds per phase since MetricsWriter last read them

    def _rebuild_routing(self):
        self.router_config = epx.RouterConfig(**self._router_kwargs)
        rate, frozen = self._bias_settings
        self.bias = epx.ExpertBias(self.num_experts, rate=rate)
        self.bias.frozen = frozen

    def attach(self, transport, buffer=None):
        """Gives this MoE its transport (and Buffer: made here unless given). Collective: every
        rank calls it, after copy.deepcopy or torch.load of the module, with the rank that holds
        this module's experts (a state_dict of another rank count: reshard() it first)."""
        ranks, rank = transport.num_ranks, transport.rank
        if ranks * self.num_local != self.num_experts or rank * self.num_local != self.first_expert:
            raise epx.InvalidArgumentError(
                f"transport: rank {rank} of {ranks} does not hold this MoE's experts "
                f"[{self.first_expert}, {self.first_expert + self.num_local}) of {self.num_experts}; "
                "reshard its state_dicts (epx.torch.reshard) and load them into a new MoE")
        self.transport = transport
        self.buffer = buffer or self._make_buffer(transport, self.max_tokens_per_rank)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_bias_settings"] = (self.bias.rate, self.bias.frozen)
        state["aux_loss"] = self.aux_loss.detach()  # a graph's output cannot be copied
        for name in _DROPPED_ON_COPY:
            state.pop(name, None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self.transport, self.buffer, self.load = None, None, None
        self._rebuild_routing()

    def _apply(self, fn):
        """Refuses conversions that would leave float32 or the CPU (module.half(), .to(torch.bfloat16),
        .cuda()) before anything is converted; .float() and .to("cpu") pass."""
        try:
            probe = fn(torch.zeros((), dtype=torch.float32))
        except Exception:  # noqa: BLE001 - the conversion itself fails below with torch's message
            probe = None
        if isinstance(probe, torch.Tensor) and (probe.dtype != torch.float32 or probe.device.type != "cpu"):
            raise epx.InvalidArgumentError(
                f"epx.torch.MoE keeps float32 parameters on the CPU; this conversion would make them "
                f"{probe.dtype} on {probe.device.type}: for a bf16 layer create MoE(..., dtype=torch.bfloat16) "
                "(bf16 payload and expert GEMM weights) and pass bf16 or f32 input, returned in its dtype")
        return super()._apply(fn)

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
        self.norm = nn.Parameter(torch.ones(H)) if self.norm_and_residual else None
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
        norm = [self.norm] if self.norm is not None else []
        return norm + [self.router] + (list(self.shared) if self.shared is not None else [])

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
        return functions.grouped_swiglu(x_expanded.float(), counts, w1, w3, w2)

    def _check_input(self, x):
        """x as [tokens, hidden] float32; errors name `x`."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
        if x.device.type != "cpu":
            raise epx.InvalidArgumentError(f"x: a {x.device.type} tensor; epx.torch takes CPU tensors only")
        if x.dtype not in (torch.float32, torch.bfloat16):
            raise epx.InvalidArgumentError(f"x: dtype {x.dtype} is not torch.float32 or torch.bfloat16")
        if x.dim() not in (2, 3) or x.shape[-1] != self.hidden:
            raise epx.InvalidArgumentError(f"x: shape {list(x.shape)} is not [tokens, {self.hidden}] or "
                                           f"[batch, seq, {self.hidden}]")
        if self.transport is None:
            raise epx.FailedPreconditionError(
                "this MoE has no transport (copy.deepcopy and torch.save drop it): call attach(transport) "
                "on every rank first")
        return x.reshape(-1, self.hidden).float()

    def forward(self, x):
        """x [tokens, H] or [batch, seq, H] (f32 or bf16) -> out of x's shape and dtype; sets aux_loss and load."""
        flat = self._check_input(x)
        clock = time.perf_counter()
        n = rms_norm(flat, self.norm, self.norm_eps) if self.norm_and_residual else flat
        logits = n @ self.router
        bias = self.expert_bias if self.use_expert_bias else None
        topk_idx, topk_weights, routed = functions.route(self.router_config, logits, bias)
        counts = torch.as_tensor(routed.tokens_per_expert).double()  # kept (token, slot) pairs, counted by epx.route
        self.aux_loss = self._auxiliary_losses(logits, counts, float(topk_idx.numel()))
        clock = self._time("router", clock)
        payload = n.to(self.payload)
        dispatched = functions.dispatch(self.buffer, payload, topk_idx, topk_weights)
        clock = self._time("dispatch", clock)
        y = self._experts(dispatched.x_expanded, dispatched.expert_offsets)
        clock = self._time("experts", clock)
        out = functions.combine(self.buffer, y, dispatched.recv_topk_weights, dispatched, self.combine_weights)
        clock = self._time("combine", clock)
        if self.norm_and_residual:
            out = flat + out
        if self.shared is not None:
            out = out + swiglu(payload.float(), *[self._stored(w) for w in self.shared])
        self.load = self._load_stats(topk_idx)
        return out.reshape(x.shape).to(x.dtype)

    def _time(self, phase, since):
        """Adds the seconds since `since` to this rank's forward time in `phase` (times, read and
        reset by MetricsWriter); returns the clock now."""
        now = time.perf_counter()
        self.times[phase] = self.times.get(phase, 0.0) + now - since
        return now

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

    def _load_stats(self, topk_idx):
        """The step's load over every rank (epx.LoadStats, one all-reduce), and its headline
        numbers: tokens per expert, MaxVio, dropped slots."""
        expert_rank = [e // self.num_local for e in range(self.num_experts)]
        stats = epx.compute_load_stats(topk_idx, expert_rank)
        stats = epx.sum_load_stats_over_ranks(self.transport, stats)
        return {"tokens_per_expert": torch.tensor(stats.tokens_per_expert, dtype=torch.int64),
                "max_vio": stats.max_vio, "dropped": stats.num_dropped, "stats": stats}

    def update_bias(self):
        """Aux-loss-free balancing: moves the expert bias (the buffer expert_bias) by the last
        forward's global load."""
        if self.use_expert_bias and self.load is not None:
            self.bias.set_values(functions.dense(self.expert_bias, torch.float32))
            self.bias.update(self.load["tokens_per_expert"].tolist())
            with torch.no_grad():
                self.expert_bias.copy_(torch.as_tensor(self.bias.values))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Refuses, before copying anything of this module, a state_dict of other experts."""
        saved = state_dict.get(prefix + "expert_range")
        if saved is not None and not torch.equal(saved.to(torch.int64), self.expert_range):
            first, num, total = (int(v) for v in saved.tolist())
            raise epx.InvalidArgumentError(
                f"state_dict '{prefix}expert_range': it holds experts [{first}, {first + num}) of {total}, this "
                f"rank's MoE holds [{self.first_expert}, {self.first_expert + self.num_local}) of "
                f"{self.num_experts}; reshard the ranks' state_dicts with epx.torch.reshard")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self):
        return (f"hidden={self.hidden}, ffn_hidden={self.ffn_hidden}, num_experts={self.num_experts}, "
                f"topk={self.topk}, local_experts=[{self.first_expert}, {self.first_expert + self.num_local}), "
                f"dtype={self.dtype_name}, norm_and_residual={self.norm_and_residual}")


def _moe_prefixes(state_dict):
    return [key[:-len("expert_range")] for key in state_dict if key.endswith("expert_range")]


def _ordered_by_experts(state_dicts, prefix):
    """The state_dicts in expert order; ValueError unless they hold [0, E) once each."""
    ranges = [[int(v) for v in sd[prefix + "expert_range"].tolist()] for sd in state_dicts]
    order = sorted(range(len(state_dicts)), key=lambda r: ranges[r][0])
    expected = 0
    for r in order:
        first, num, total = ranges[r]
        if first != expected or total != ranges[order[0]][2]:
            raise ValueError(f"state_dicts: '{prefix}expert_range' of state_dict {r} is experts "
                             f"[{first}, {first + num}) of {total}, expected experts from {expected}")
        expected += num
    if expected != ranges[order[0]][2]:
        raise ValueError(f"state_dicts: '{prefix}' experts cover [0, {expected}) of {ranges[order[0]][2]}")
    return [state_dicts[r] for r in order]


def reshard(state_dicts, num_ranks):
    """The state_dicts of every rank of a model with epx.torch.MoE layers (as saved on R ranks, in
    any order) -> num_ranks state_dicts, one per rank of the new world: each MoE's experts w1, w3,
    w2 regrouped into contiguous blocks of E / num_ranks, every other entry (replicated: it must be
    equal on every rank) copied. Raises ValueError naming the first entry that does not fit."""
    if not state_dicts:
        raise ValueError("state_dicts: empty (one per rank expected)")
    if num_ranks < 1:
        raise ValueError(f"num_ranks = {num_ranks} must be at least 1")
    out = [OrderedDict() for _ in range(num_ranks)]
    experts = {}
    for prefix in _moe_prefixes(state_dicts[0]):
        ordered = _ordered_by_experts(state_dicts, prefix)
        total = int(ordered[0][prefix + "expert_range"][2])
        if total % num_ranks != 0:
            raise ValueError(f"num_ranks = {num_ranks} does not divide the {total} experts of '{prefix}'")
        per = total // num_ranks
        for name in _EXPERT_WEIGHTS:
            experts[prefix + name] = torch.cat([sd[prefix + name] for sd in ordered]).split(per)
        experts[prefix + "expert_range"] = [torch.tensor([r * per, per, total]) for r in range(num_ranks)]
    for key, value in state_dicts[0].items():
        if key in experts:
            for r in range(num_ranks):
                out[r][key] = experts[key][r].clone()
            continue
        for i, sd in enumerate(state_dicts):
            if key not in sd or not torch.equal(sd[key], value):
                raise ValueError(f"state_dicts: '{key}' differs between state_dict 0 and {i}; only the experts "
                                 "of epx.torch.MoE layers may differ between ranks")
        for r in range(num_ranks):
            out[r][key] = value.clone()
    return out
