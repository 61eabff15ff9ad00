"""A numpy reference of epx's exchange contract (include/epx/exchange/buffer.h),
written from the documented rules, not from the implementation:

- dispatch: rank r receives one row per (source token, rank r) pair whose top-k
  names an expert of r, deduplicated, ordered by (source rank, source token);
  top-k ids become r's local ids (-1 where the expert lives elsewhere), weights
  0 there; per-local-expert counts.
- combine: out[t] = the sum over the ranks holding t of y_r[row of t] in fp32:
  flat, in ascending rank order; hierarchical (more than one node), per node in
  ascending rank order, then over nodes in ascending node order.
"""

import numpy as np


def bf16_bits(a):
    """float32 -> bf16 bits, round to nearest even (finite inputs)."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_values(bits):
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def make_inputs(num_ranks, num_experts, topk, tokens, hidden, dtype, seed, holes=False, skew=False):
    """Per rank: x [T, H] (f32, or bf16 bits as uint16), topk_idx [T, K] int32, weights [T, K] f32.
    Rows encode (source rank, token, column) in f32; bf16 rows are random bits."""
    rng = np.random.default_rng(seed)
    xs, idxs, ws = [], [], []
    for r in range(num_ranks):
        t = tokens[r]
        if dtype == "f32":
            x = (r * 65536 + np.arange(t)[:, None] * 256 + np.arange(hidden)[None, :] % 256).astype(np.float32)
        else:
            x = bf16_bits(rng.standard_normal((t, hidden)).astype(np.float32))
        p = None
        if skew:  # most tokens go to the first few experts
            p = 1.0 / (1.0 + np.arange(num_experts)) ** 2
            p = p / p.sum()
        idx = np.stack([rng.choice(num_experts, size=topk, replace=False, p=p) for _ in range(t)]) if t else \
            np.zeros((0, topk), dtype=np.int64)
        idx = idx.astype(np.int32).reshape(t, topk)
        if holes and t:
            idx[rng.random((t, topk)) < 0.25] = -1
            idx[0, :] = -1  # a token that goes nowhere
        w = rng.random((t, topk)).astype(np.float32)
        xs.append(x)
        idxs.append(idx)
        ws.append(w)
    return xs, idxs, ws


class RankRef:
    """What one rank receives."""

    def __init__(self, rank, num_ranks, num_experts, xs, idxs, ws):
        per = num_experts // num_ranks
        self.src = []  # (source rank, token)
        for s in range(num_ranks):
            for t in range(idxs[s].shape[0]):
                ids = idxs[s][t]
                if np.any((ids >= 0) & (ids // per == rank)):
                    self.src.append((s, t))
        self.row_of = {src: i for i, src in enumerate(self.src)}
        n = len(self.src)
        k = idxs[0].shape[1]
        self.src_rank = np.array([s for s, _ in self.src], dtype=np.int32)
        self.src_idx = np.array([t for _, t in self.src], dtype=np.int32)
        self.x = np.stack([xs[s][t] for s, t in self.src]) if n else np.zeros((0, xs[0].shape[1]), xs[0].dtype)
        self.topk_idx = np.full((n, k), -1, dtype=np.int32)
        self.topk_weights = np.zeros((n, k), dtype=np.float32)
        for i, (s, t) in enumerate(self.src):
            ids = idxs[s][t]
            mine = (ids >= 0) & (ids // per == rank)
            self.topk_idx[i, mine] = ids[mine] % per
            self.topk_weights[i, mine] = ws[s][t][mine]
        self.counts = [int(np.sum(self.topk_idx == e)) for e in range(per)]


def reference(num_ranks, num_experts, xs, idxs, ws):
    return [RankRef(r, num_ranks, num_experts, xs, idxs, ws) for r in range(num_ranks)]


def combine_reference(refs, ys, num_tokens, hidden, num_nodes, out_bf16):
    """out per source rank: sums of the y rows of each token in the documented order (fp32)."""
    num_ranks = len(refs)
    per_node = num_ranks // num_nodes
    outs = []
    for s in range(num_ranks):
        acc = np.zeros((num_tokens[s], hidden), dtype=np.float32)
        for t in range(num_tokens[s]):
            holders = [(r, refs[r].row_of[(s, t)]) for r in range(num_ranks) if (s, t) in refs[r].row_of]
            if num_nodes == 1:
                total = None
                for r, row in holders:
                    total = ys[r][row].copy() if total is None else np.float32(total + ys[r][row])
            else:
                total = None
                for node in range(num_nodes):
                    part = None
                    for r, row in holders:
                        if r // per_node == node:
                            part = ys[r][row].copy() if part is None else np.float32(part + ys[r][row])
                    if part is not None:
                        total = part if total is None else np.float32(total + part)
            if total is not None:
                acc[t] = total
        outs.append(bf16_bits(acc) if out_bf16 else acc)
    return outs
