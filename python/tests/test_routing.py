"""epx.route, route_backward, ExpertBias and the load statistics against
numpy references written here (docs/python.md, "Routing").

Selection is checked exactly: the reference ranks epx's own float32 scores
(checked against a float64 softmax/sigmoid separately) plus the bias in
float32, so ties are the same ties on both sides and go to the lower id.
route_backward is checked against torch autograd of the same weights.
"""
import json

import numpy as np
import pytest
import torch

import epx

RNG = np.random.default_rng(18)


def grid_logits(num_tokens, num_experts, rng=RNG):
    """Logits on a grid of 0.5: many exact ties."""
    return (rng.integers(-6, 7, size=(num_tokens, num_experts)) * 0.5).astype(np.float32)


def softmax64(x):
    z = np.exp(x.astype(np.float64) - x.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def sigmoid64(x):
    return 1.0 / (1.0 + np.exp(-x.astype(np.float64)))


def top_k(select, k, allowed=None):
    """The best k ids of each row, ties to the lower id, best first."""
    out = np.empty((select.shape[0], k), dtype=np.int32)
    for t, row in enumerate(select):
        ids = np.arange(row.shape[0]) if allowed is None else np.flatnonzero(allowed[t])
        order = sorted(ids, key=lambda e: (-row[e], e))
        out[t] = order[:k]
    return out


def group_mask(select, config):
    """Group-limited routing: the experts of each token's best topk_groups groups."""
    num_experts, groups = config.num_experts, config.num_groups
    group_of = np.repeat(np.arange(groups), num_experts // groups)
    per_group = max(1, config.topk // config.topk_groups)
    mask = np.zeros(select.shape, dtype=bool)
    for t, row in enumerate(select):
        scores = []
        for g in range(groups):
            best = sorted(row[group_of == g], reverse=True)[:per_group]
            total = np.float32(0.0)
            for v in best:
                total = np.float32(total + v)
            scores.append(total)
        kept = sorted(range(groups), key=lambda g: (-scores[g], g))[:config.topk_groups]
        mask[t] = np.isin(group_of, kept)
    return mask


def capacity_of(config, num_tokens):
    if config.capacity_factor == 0:
        return 0
    raw = config.capacity_factor * num_tokens * config.topk / config.num_experts
    cap = int(np.ceil(raw - 1e-9 * max(1.0, raw)))
    align = config.capacity_alignment
    return (cap + align - 1) // align * align


def reference_route(config, logits, scores, bias=None):
    """(selected_idx, pre-drop weights, topk_idx, topk_weights); `scores` is epx's."""
    base = logits if config.softmax_after_topk else scores
    select = base if bias is None else (base + bias.astype(np.float32)).astype(np.float32)
    allowed = group_mask(select, config) if config.num_groups > 1 else None
    selected = top_k(select, config.topk, allowed)
    if config.softmax_after_topk:
        weights = softmax64(np.take_along_axis(logits, selected, axis=1))
    else:
        weights = np.take_along_axis(scores, selected, axis=1).astype(np.float64)
    if config.normalize_weights:
        weights = weights / weights.sum(axis=1, keepdims=True)
    weights = weights * config.scaling_factor
    topk_idx, topk_weights = drop_over_capacity(config, selected, weights)
    return selected, weights, topk_idx, topk_weights


def drop_over_capacity(config, selected, weights):
    topk_idx, topk_weights = selected.copy(), weights.copy()
    cap = capacity_of(config, selected.shape[0])
    if cap == 0:
        return topk_idx, topk_weights
    for e in range(config.num_experts):
        slots = list(zip(*np.nonzero(selected == e)))  # row-major: token order, then slot order
        if config.drop_policy == "score":
            slots.sort(key=lambda s: (-weights[s], s[0], s[1]))
        for s in slots[cap:]:
            topk_idx[s], topk_weights[s] = -1, 0.0
    return topk_idx, topk_weights


def check_route(config, logits, bias=None):
    r = epx.route(config, logits, bias)
    expect_scores = sigmoid64(logits) if config.score_function == "sigmoid" else softmax64(logits)
    np.testing.assert_allclose(r.scores, expect_scores, rtol=1e-5, atol=1e-7)
    selected, weights, topk_idx, topk_weights = reference_route(config, logits, r.scores, bias)
    np.testing.assert_array_equal(r.selected_idx, selected)
    np.testing.assert_array_equal(r.topk_idx, topk_idx)
    np.testing.assert_allclose(r.topk_weights, topk_weights, rtol=1e-5, atol=1e-7)
    kept = topk_idx[topk_idx >= 0]
    counts = np.bincount(kept, minlength=config.num_experts)
    np.testing.assert_array_equal(r.tokens_per_expert, counts)
    cap = capacity_of(config, logits.shape[0])
    assert r.capacity == cap
    assert r.num_dropped == int((topk_idx < 0).sum())
    rows = np.full(config.num_experts, cap) if config.pad_to_capacity else counts
    np.testing.assert_array_equal(r.rows_per_expert, rows)
    return r


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
@pytest.mark.parametrize("normalize", [False, True])
def test_route_matches_reference(score_function, normalize):
    config = epx.RouterConfig(16, 4, score_function=score_function, normalize_weights=normalize,
                              scaling_factor=2.5)
    check_route(config, grid_logits(64, 16))


def test_route_ties_go_to_the_lower_id():
    config = epx.RouterConfig(8, 3)
    logits = np.zeros((2, 8), dtype=np.float32)
    logits[1, [2, 5, 6]] = 1.0
    r = check_route(config, logits)
    np.testing.assert_array_equal(r.topk_idx, [[0, 1, 2], [2, 5, 6]])


def test_bias_selects_but_never_weighs():
    config = epx.RouterConfig(16, 2)
    logits = grid_logits(48, 16)
    bias = (RNG.integers(-4, 5, size=16) * 0.05).astype(np.float32)
    r = check_route(config, logits, bias)
    plain = epx.route(config, logits)
    assert not np.array_equal(r.topk_idx, plain.topk_idx)
    np.testing.assert_array_equal(r.topk_weights, np.take_along_axis(r.scores, r.topk_idx, axis=1))
    # An ExpertBias object routes as its values do.
    eb = epx.ExpertBias(16)
    eb.set_values(bias)
    np.testing.assert_array_equal(epx.route(config, logits, eb).topk_idx, r.topk_idx)


def test_softmax_after_topk_and_groups():
    check_route(epx.RouterConfig(16, 4, softmax_after_topk=True), grid_logits(40, 16))
    grouped = epx.RouterConfig(16, 4, num_groups=4, topk_groups=2, normalize_weights=True)
    check_route(grouped, grid_logits(40, 16))
    check_route(grouped, grid_logits(40, 16), (RNG.integers(-3, 4, size=16) * 0.02).astype(np.float32))


@pytest.mark.parametrize("policy", ["position", "score"])
def test_capacity_drops(policy):
    config = epx.RouterConfig(8, 2, capacity_factor=0.75, drop_policy=policy, capacity_alignment=2,
                              pad_to_capacity=True)
    logits = grid_logits(50, 8)
    logits[:, 3] += 2.0  # an over-full expert
    r = check_route(config, logits)
    assert r.num_dropped > 0
    assert config.capacity(50) == r.capacity


def test_torch_in_torch_out():
    config = epx.RouterConfig(8, 2)
    logits = grid_logits(10, 8)
    r = epx.route(config, torch.from_numpy(logits))
    assert isinstance(r.topk_idx, torch.Tensor) and r.topk_idx.dtype == torch.int32
    assert isinstance(r.tokens_per_expert, torch.Tensor) and r.tokens_per_expert.dtype == torch.int64
    np.testing.assert_array_equal(r.topk_idx.numpy(), epx.route(config, logits).topk_idx)
    # Results are copies: writing one changes nothing epx holds.
    r.topk_idx[:] = 7
    assert r.topk_idx is r.topk_idx and int(r.selected_idx.min()) >= 0


def torch_weights(config, logits, selected, kept):
    """The routing weights as torch computes them from the logits (autograd reference)."""
    if config.softmax_after_topk:
        w = torch.softmax(torch.gather(logits, 1, selected), dim=1)
    else:
        scores = torch.sigmoid(logits) if config.score_function == "sigmoid" else torch.softmax(logits, dim=1)
        w = torch.gather(scores, 1, selected)
    if config.normalize_weights:
        w = w / w.sum(dim=1, keepdim=True)
    return w * config.scaling_factor * kept


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(normalize_weights=True, scaling_factor=1.5),
    dict(score_function="sigmoid", normalize_weights=True),
    dict(softmax_after_topk=True),
    dict(capacity_factor=0.5),
])
def test_route_backward_matches_autograd(kwargs):
    config = epx.RouterConfig(12, 3, **kwargs)
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((30, 12)).astype(np.float32)
    grad = rng.standard_normal((30, 3)).astype(np.float32)
    r = epx.route(config, logits)
    got = epx.route_backward(config, r, grad)
    x = torch.tensor(logits, dtype=torch.float64, requires_grad=True)
    selected = torch.from_numpy(r.selected_idx.astype(np.int64))
    kept = torch.from_numpy((r.topk_idx >= 0).astype(np.float64))
    torch_weights(config, x, selected, kept).mul(torch.from_numpy(grad).double()).sum().backward()
    assert got.shape == (30, 12) and got.dtype == np.float32
    np.testing.assert_allclose(got, x.grad.numpy(), rtol=1e-4, atol=1e-6)
    # torch in, torch out.
    got_t = epx.route_backward(config, epx.route(config, torch.from_numpy(logits)), torch.from_numpy(grad))
    assert isinstance(got_t, torch.Tensor)
    np.testing.assert_array_equal(got_t.numpy(), got)


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_experts=0, topk=1), "num_experts"),
    (dict(num_experts=4, topk=5), "topk"),
    (dict(num_experts=8, topk=2, num_groups=3), "num_groups"),
    (dict(num_experts=8, topk=2, num_groups=2, topk_groups=3), "topk_groups"),
    (dict(num_experts=8, topk=2, score_function="relu"), "score_function"),
    (dict(num_experts=8, topk=2, drop_policy="random"), "drop_policy"),
    (dict(num_experts=8, topk=2, capacity_factor=-1.0), "capacity_factor"),
    (dict(num_experts=8, topk=2, capacity_alignment=0), "capacity_alignment"),
    (dict(num_experts=8, topk=2, pad_to_capacity=True), "pad_to_capacity"),
    (dict(num_experts=8, topk=2, score_function="sigmoid", softmax_after_topk=True), "softmax_after_topk"),
    (dict(num_experts=4, topk=1, num_groups=2, expert_group=[0, 1, 2, 0]), "expert_group"),
    (dict(num_experts=4, topk=1, expert_group=[0, 0]), "expert_group"),
])
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(epx.InvalidArgumentError, match=field):
        epx.RouterConfig(**kwargs)


def test_bad_inputs_raise_before_routing():
    config = epx.RouterConfig(8, 2)
    with pytest.raises(epx.InvalidArgumentError, match="logits"):
        epx.route(config, np.zeros((4, 8), dtype=np.float64))
    with pytest.raises(epx.InvalidArgumentError, match="logits"):
        epx.route(config, np.zeros((4, 9), dtype=np.float32))
    with pytest.raises(epx.InvalidArgumentError, match="expert_bias"):
        epx.route(config, np.zeros((4, 8), dtype=np.float32), np.zeros(7, dtype=np.float32))
    with pytest.raises(epx.InvalidArgumentError, match="logits"):
        epx.route(config, torch.zeros(4, 8, requires_grad=True))
    r = epx.route(config, np.zeros((4, 8), dtype=np.float32))
    with pytest.raises(epx.InvalidArgumentError, match="grad_topk_weights"):
        epx.route_backward(config, r, np.zeros((4, 3), dtype=np.float32))
    with pytest.raises(epx.InvalidArgumentError):
        epx.route_backward(epx.RouterConfig(16, 2), r, np.zeros((4, 2), dtype=np.float32))
    config.topk = 9  # attributes are checked again by route
    with pytest.raises(epx.InvalidArgumentError, match="topk"):
        epx.route(config, np.zeros((4, 8), dtype=np.float32))


def test_config_attributes_round_trip():
    c = epx.RouterConfig(8, 2, score_function="sigmoid", drop_policy="score", capacity_factor=1.25,
                         num_groups=2, topk_groups=1, expert_group=np.array([0, 1] * 4))
    assert (c.num_experts, c.topk, c.score_function, c.drop_policy) == (8, 2, "sigmoid", "score")
    assert c.expert_group == [0, 1] * 4 and c.capacity_factor == 1.25
    c.score_function = "softmax"
    c.expert_group = None
    assert c.score_function == "softmax" and c.expert_group == []
    with pytest.raises(epx.InvalidArgumentError, match="score_function"):
        c.score_function = "tanh"
    assert "RouterConfig(num_experts=8" in repr(c)


def test_expert_bias_update_and_freeze():
    bias = epx.ExpertBias(4, rate=0.5)
    assert bias.num_experts == 4 and bias.rate == 0.5 and not bias.frozen
    load = np.array([10, 2, 6, 6])  # mean 6
    bias.update(load)
    np.testing.assert_array_equal(bias.values, np.float32([-0.5, 0.5, 0.0, 0.0]))
    bias.update([0, 0, 0, 24])
    np.testing.assert_array_equal(bias.values, np.float32([0.0, 1.0, 0.5, -0.5]))
    bias.frozen = True
    bias.update(torch.tensor([1, 2, 3, 4]))
    np.testing.assert_array_equal(bias.values, np.float32([0.0, 1.0, 0.5, -0.5]))
    values = bias.values
    values[:] = 9  # a copy
    assert bias.values[0] == 0.0
    bias.set_values(np.float32([1, 2, 3, 4]))
    np.testing.assert_array_equal(bias.values, np.float32([1, 2, 3, 4]))
    with pytest.raises(epx.InvalidArgumentError, match="load"):
        bias.update([1, 2, 3])
    with pytest.raises(epx.InvalidArgumentError, match="load"):
        bias.update([1, -2, 3, 4])
    with pytest.raises(epx.InvalidArgumentError, match="values"):
        bias.set_values(np.float32([1, 2]))
    with pytest.raises(epx.InvalidArgumentError, match="num_experts"):
        epx.ExpertBias(0)


def reference_load_stats(topk_idx, expert_rank):
    num_ranks = max(expert_rank) + 1
    rank_of = np.asarray(expert_rank)
    kept = topk_idx[topk_idx >= 0]
    per_expert = np.bincount(kept, minlength=len(expert_rank))
    work = np.bincount(rank_of[kept], minlength=num_ranks)
    tokens = np.zeros(num_ranks, dtype=np.int64)
    for row in topk_idx:
        for r in set(rank_of[row[row >= 0]]):
            tokens[r] += 1
    mean = per_expert.mean()
    return dict(tokens_per_expert=per_expert.tolist(), tokens_per_rank=tokens.tolist(),
                work_per_rank=work.tolist(), num_dropped=int((topk_idx < 0).sum()),
                max_vio=per_expert.max() / mean - 1, cv=per_expert.std() / mean,
                worst_rank=int(np.argmax(work)), idle_fraction=1 - work.mean() / work.max())


def test_load_stats_and_tracker():
    topk_idx = np.array([[0, 1], [1, 5], [2, -1], [7, 6], [0, 3]], dtype=np.int64)
    expert_rank = [0, 0, 1, 1, 2, 2, 3, 3]
    stats = epx.compute_load_stats(topk_idx, expert_rank)
    ref = reference_load_stats(topk_idx, expert_rank)
    for key, value in ref.items():
        assert getattr(stats, key) == pytest.approx(value), key
    assert json.loads(stats.to_json())["tokens_per_rank"] == ref["tokens_per_rank"]
    tracker = epx.LoadTracker(decay=0.5)
    tracker.add(stats)
    tracker.add(epx.compute_load_stats(np.array([[0, 2], [4, 6]], dtype=np.int32), expert_rank))
    assert tracker.num_steps == 2
    assert tracker.ema_max_vio == pytest.approx(0.5 * ref["max_vio"] + 0.5 * 1.0)
    assert json.loads(tracker.to_json())["num_steps"] == 2
    with pytest.raises(epx.InvalidArgumentError):
        epx.compute_load_stats(np.array([[8, 0]], dtype=np.int32), expert_rank)


def test_sum_load_over_ranks_in_process():
    world = epx.InprocWorld(num_ranks=4, num_nodes=2)

    def fn(t):
        load = np.arange(6, dtype=np.int64) * (t.rank + 1)
        total = epx.sum_load_over_ranks(t, load)
        stats = epx.sum_load_stats_over_ranks(
            t, epx.compute_load_stats(np.array([[t.rank, -1]], dtype=np.int32), [0, 1, 2, 3]))
        return total, list(stats.tokens_per_expert), epx.sum_load_over_ranks(t, [1, 2])

    for total, per_expert, listed in world.run(fn):
        np.testing.assert_array_equal(total, np.arange(6) * 10)
        assert per_expert == [1, 1, 1, 1]
        np.testing.assert_array_equal(listed, [4, 8])
