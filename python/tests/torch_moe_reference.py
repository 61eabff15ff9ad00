"""An independent pure-PyTorch eager MoE layer and the checks of epx.torch.MoE against it.

The eager layer sees every rank's tokens at once and computes the whole job's
objective: each rank's slice is routed on its own (capacity and the micro-batch
aux loss are per rank, as in epx), every token runs through its experts by
gathering, and nothing of epx runs but the weights' initialisation (so both
layers start from the same weights). Used by test_torch_moe.py (in-process
worlds) and torch_moe_mpi.py (under mpirun).
"""
import math

import torch

import epx.torch as et

# Tolerances (absolute, on values of order 1): f32 differs from the eager layer
# only in summation order; bf16 rounds the payload and the expert weights the
# same way in both, but one ulp of difference in a normed value can round to a
# neighbouring bf16 (2^-8 relative).
TOLERANCE = {"f32": 2e-5, "bf16": 3e-2}

BASE = dict(hidden=16, ffn_hidden=24, num_experts=8, topk=2, seed=7)
CASES = {
    "f32": dict(dtype="f32"),
    "bf16": dict(dtype="bf16"),
    "shared_aux_micro": dict(dtype="f32", num_shared_experts=1, aux_loss_coeff=0.1, z_loss_coeff=0.01),
    "aux_global": dict(dtype="f32", aux_loss_coeff=0.1, aux_loss="global-batch"),
    "capacity_bias": dict(dtype="f32", capacity_factor=1.0, expert_bias=True, bias_rate=0.05, steps=2),
    "normalized": dict(dtype="f32", normalize_weights=True, topk=3, num_shared_experts=2),
    # Ranks of 1, 2, 0, 1 tokens ((rank + 1) % 3): empty inputs, single rows.
    "few_tokens": dict(dtype="f32", few_tokens=True, num_shared_experts=1, aux_loss_coeff=0.1,
                       aux_loss="global-batch"),
    # Receiver weights (each token's rank weighs its rows, in top-k order): the same answers.
    "receiver": dict(dtype="f32", combine_weights="receiver", topk=3, aux_loss_coeff=0.1),
    "receiver_bf16": dict(dtype="bf16", combine_weights="receiver"),
}


def case_config(name):
    config = dict(BASE)
    config.update(CASES[name])
    return config


def tokens_of(rank, num_ranks, config, step):
    """Rank `rank`'s tokens and the gradient of its output, the same in every process."""
    count = (rank + 1) % 3 if config.get("few_tokens") else 5 + 3 * rank + num_ranks % 2
    g = torch.Generator().manual_seed(1000 * config["seed"] + 97 * rank + step)
    hidden = config["hidden"]
    return torch.randn((count, hidden), generator=g), torch.randn((count, hidden), generator=g)


def moe_kwargs(config):
    return {k: v for k, v in config.items() if k not in ("steps", "few_tokens")}


def run_epx_rank(transport, config):
    """epx.torch.MoE on this rank: per step its output, x's gradient, the dense parameters'
    gradients (this rank's, not summed), its local experts' gradients, the aux loss."""
    moe = et.MoE(transport=transport, **moe_kwargs(config))
    steps = []
    for step in range(config.get("steps", 1)):
        moe.zero_grad()
        x, g = tokens_of(transport.rank, transport.num_ranks, config, step)
        x.requires_grad_(True)
        out = moe(x)
        loss = (out * g).sum() + moe.aux_loss
        loss.backward()
        steps.append(dict(out=out.detach(), grad_x=x.grad, aux=float(moe.aux_loss),
                          dense=[p.grad.clone() for p in moe.dense_parameters()],
                          experts=[p.grad.clone() for p in moe.expert_parameters()],
                          first_expert=moe.first_expert, max_vio=moe.load["max_vio"]))
        moe.update_bias()
    return steps


class EagerMoE:
    """The whole job's MoE layer in plain torch ops."""

    def __init__(self, config):
        c = config
        self.c = c
        router, shared = et.dense_init(c["seed"], 0, c["hidden"], c["ffn_hidden"], c["num_experts"],
                                       c.get("num_shared_experts", 0))
        experts = [et.expert_init(c["seed"], 0, e, c["hidden"], c["ffn_hidden"]) for e in range(c["num_experts"])]
        self.norm = torch.ones(c["hidden"], requires_grad=True)
        self.router = router.requires_grad_(True)
        self.shared = [w.requires_grad_(True) for w in shared] if shared else []
        self.w1 = torch.stack([w[0] for w in experts]).requires_grad_(True)
        self.w3 = torch.stack([w[1] for w in experts]).requires_grad_(True)
        self.w2 = torch.stack([w[2] for w in experts]).requires_grad_(True)
        self.bias = torch.zeros(c["num_experts"])
        self.payload = torch.bfloat16 if c["dtype"] == "bf16" else torch.float32

    def params(self):
        return [self.norm, self.router] + self.shared + [self.w1, self.w3, self.w2]

    def rounded(self, t):
        return t.to(self.payload).float()

    def route(self, logits):
        """(expert [T, K], weight [T, K]) of one rank's tokens: top-k of softmax + bias, capacity drops."""
        c, E, K = self.c, self.c["num_experts"], self.c["topk"]
        probs = torch.softmax(logits, dim=-1)
        chosen = torch.topk(probs.detach() + self.bias, K, dim=-1).indices
        weight = torch.gather(probs, 1, chosen)
        if c.get("normalize_weights"):
            weight = weight / weight.sum(-1, keepdim=True)
        if c.get("capacity_factor", 0) > 0:
            capacity = math.ceil(c["capacity_factor"] * logits.shape[0] * K / E)
            flat = chosen.reshape(-1)
            seen = torch.cumsum(torch.nn.functional.one_hot(flat, E), dim=0)
            position = seen.gather(1, flat[:, None]).reshape(chosen.shape) - 1
            keep = position < capacity
            chosen = torch.where(keep, chosen, torch.full_like(chosen, -1))
            weight = weight * keep
        return chosen, weight

    def aux_losses(self, logits_by_rank, chosen_by_rank):
        c, E, R = self.c, self.c["num_experts"], len(logits_by_rank)
        total = torch.zeros(())

        def balance(logits, chosen):
            f = torch.stack([(chosen == e).sum() for e in range(E)]).float() / chosen.numel()
            return E * (f * torch.softmax(logits, -1).mean(0)).sum()

        if c.get("aux_loss_coeff", 0) > 0:
            if c.get("aux_loss") == "global-batch":
                total = total + c["aux_loss_coeff"] * balance(torch.cat(logits_by_rank), torch.cat(chosen_by_rank))
            else:
                total = total + c["aux_loss_coeff"] * sum(balance(l, ch) for l, ch in zip(logits_by_rank,
                                                                                          chosen_by_rank)) / R
        if c.get("z_loss_coeff", 0) > 0:
            z = sum(torch.logsumexp(l, -1).pow(2).mean() for l in logits_by_rank) / R
            total = total + c["z_loss_coeff"] * z
        return total

    def forward(self, xs):
        """xs: every rank's tokens -> (every rank's output, the summed aux losses, expert loads)."""
        outs, logits_by_rank, chosen_by_rank = [], [], []
        for x in xs:
            n = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * self.norm
            logits = n @ self.router
            chosen, weight = self.route(logits)
            logits_by_rank.append(logits)
            chosen_by_rank.append(chosen)
            n_in = self.rounded(n)
            moe = torch.zeros_like(x)
            for k in range(chosen.shape[1]):
                for e in range(self.c["num_experts"]):
                    rows = (chosen[:, k] == e).nonzero().reshape(-1)
                    if rows.numel():
                        h = n_in[rows]
                        a = torch.nn.functional.silu(h @ self.rounded(self.w1[e])) * (h @ self.rounded(self.w3[e]))
                        moe = moe.index_add(0, rows, (a @ self.rounded(self.w2[e])) * weight[rows, k:k + 1])
            out = x + moe
            if self.shared:
                w1, w3, w2 = (self.rounded(w) for w in self.shared)
                out = out + (torch.nn.functional.silu(n_in @ w1) * (n_in @ w3)) @ w2
            outs.append(out)
        flat = torch.cat(chosen_by_rank).reshape(-1)
        load = torch.bincount(flat[flat >= 0], minlength=self.c["num_experts"])
        return outs, self.aux_losses(logits_by_rank, chosen_by_rank), load

    def update_bias(self, load):
        rate = self.c.get("bias_rate", 1e-3)
        self.bias = self.bias + rate * torch.sign(load.double().mean() - load.double()).float()


def eager_steps(config, num_ranks):
    """The eager layer on every rank's tokens: per step the outputs, x grads, parameter grads, aux."""
    eager = EagerMoE(config)
    steps = []
    for step in range(config.get("steps", 1)):
        for p in eager.params():
            p.grad = None
        data = [tokens_of(r, num_ranks, config, step) for r in range(num_ranks)]
        xs = [x.clone().requires_grad_(True) for x, _ in data]
        outs, aux, load = eager.forward(xs)
        loss = sum((o * g).sum() for o, (_, g) in zip(outs, data)) + aux
        loss.backward()
        steps.append(dict(out=[o.detach() for o in outs], grad_x=[x.grad for x in xs], aux=float(aux),
                          dense=[p.grad for p in eager.params()[:-3]],
                          experts=[eager.w1.grad, eager.w3.grad, eager.w2.grad]))
        if config.get("expert_bias"):
            eager.update_bias(load)
    return steps


def assert_close(name, got, want, tol):
    err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
    assert err <= tol, f"{name}: max abs error {err:.3g} above {tol:g} (shape {tuple(got.shape)})"


def check_rank(config, rank, num_ranks, epx_steps, eager, dense_sums):
    """Rank `rank`'s output, x grad and local experts' grads, and the summed dense grads, vs eager."""
    tol = TOLERANCE[config["dtype"]]
    for step, (mine, ref) in enumerate(zip(epx_steps, eager)):
        where = f"step {step} rank {rank}"
        assert_close(f"{where} out", mine["out"], ref["out"][rank], tol)
        assert_close(f"{where} grad x", mine["grad_x"], ref["grad_x"][rank], tol)
        local = slice(mine["first_expert"], mine["first_expert"] + mine["experts"][0].shape[0])
        for name, got, want in zip(("w1", "w3", "w2"), mine["experts"], ref["experts"]):
            assert_close(f"{where} grad {name}", got, want[local], tol)
        for i, (got, want) in enumerate(zip(dense_sums[step], ref["dense"])):
            assert_close(f"{where} grad dense[{i}]", got, want, tol * 4)
        if rank == 0 and "aux_sum" in mine:
            assert abs(mine["aux_sum"] - ref["aux"]) <= 1e-5, f"{where} aux {mine['aux_sum']} vs {ref['aux']}"
