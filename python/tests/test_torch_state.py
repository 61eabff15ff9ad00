"""epx.torch.MoE's state and its torch-facing surface: the expert bias is in state_dict and a
loaded module gives the same outputs and MaxVio; deepcopy and torch.save(module) work without
the transport (attach() gives it back); reshard() moves a state_dict saved on R ranks to R'
ranks; torch dtypes, bf16 in -> bf16 out, refused dtype conversions, the drop-in FFN form,
3-D input, errors naming `x`, per-rank generators, docstrings that say creation is collective."""
import copy
import io

import pytest
import torch

import epx
import epx.torch as et

H, F, E, K, T = 16, 24, 8, 2, 6


def layer(t, **kwargs):
    kwargs.setdefault("seed", 7)
    return et.MoE(H, F, E, K, transport=t, **kwargs)


def tokens(rank, step=0):
    return torch.randn(T, H, generator=torch.Generator().manual_seed(1000 * step + rank))


def train_bias(moe, t, steps=4):
    for step in range(steps):
        moe(tokens(t.rank, step) * 3)
        moe.update_bias()


def test_expert_bias_is_in_state_dict_and_restores_outputs_and_max_vio():
    def fn(t):
        moe = layer(t, expert_bias=True, bias_rate=0.05)
        train_bias(moe, t)
        assert torch.count_nonzero(moe.state_dict()["expert_bias"]) > 0
        x = tokens(t.rank, 9) * 3
        want, want_vio = moe(x), moe.load["max_vio"]
        fresh = layer(t, expert_bias=True, bias_rate=0.05, seed=8)
        fresh.load_state_dict(moe.state_dict())
        got = fresh(x)
        return torch.equal(got, want), fresh.load["max_vio"] == want_vio, sorted(moe.state_dict())

    for same_out, same_vio, keys in epx.InprocWorld(2).run(fn):
        assert same_out and same_vio
        assert "expert_bias" in keys and "expert_range" in keys


def test_deepcopy_and_torch_save_keep_the_state_and_drop_the_transport():
    def fn(t):
        moe = layer(t, expert_bias=True, num_shared_experts=1)
        train_bias(moe, t, 2)
        x = tokens(t.rank, 5)
        want = moe(x)
        saved = io.BytesIO()
        torch.save(moe, saved)
        copies = [copy.deepcopy(moe), torch.load(io.BytesIO(saved.getvalue()))]
        results = []
        for c in copies:
            assert c.transport is None and c.buffer is None
            with pytest.raises(epx.FailedPreconditionError, match="attach"):
                c(x)
            c.attach(t)  # collective: every rank attaches its copies in the same order
            results.append(torch.equal(c(x), want))
        return results

    for results in epx.InprocWorld(2).run(fn):
        assert results == [True, True]


def test_attach_refuses_a_transport_that_does_not_hold_the_experts():
    saved = epx.InprocWorld(2).run(lambda t: copy.deepcopy(layer(t)))
    with pytest.raises(epx.InvalidArgumentError, match=r"rank 0 of 4 does not hold this MoE's experts \[0, 4\)"):
        epx.InprocWorld(4).run(lambda t: saved[0].attach(t) if t.rank == 0 else t.barrier())


def outputs_on(num_ranks, state_dicts, x_all, **kwargs):
    """The layer's output for x_all's tokens, split over num_ranks ranks holding state_dicts[rank]."""
    def fn(t):
        moe = layer(t, seed=99, **kwargs)
        moe.load_state_dict(state_dicts[t.rank])
        return moe(x_all.chunk(num_ranks)[t.rank]).detach()
    return torch.cat(epx.InprocWorld(num_ranks).run(fn))


@pytest.mark.parametrize("target", [1, 2, 8])
def test_reshard_moves_a_state_dict_to_another_rank_count(target):
    def saved(t):
        moe = layer(t, expert_bias=True, num_shared_experts=1)
        train_bias(moe, t, 2)
        return moe.state_dict()

    four = epx.InprocWorld(4).run(saved)
    x_all = torch.randn(8 * T, H, generator=torch.Generator().manual_seed(3))
    want = outputs_on(4, four, x_all, expert_bias=True, num_shared_experts=1)
    got = outputs_on(target, et.reshard(list(reversed(four)), target), x_all, expert_bias=True, num_shared_experts=1)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6), (got - want).abs().max()


def test_reshard_and_load_refuse_what_does_not_fit():
    four = epx.InprocWorld(4).run(lambda t: layer(t).state_dict())
    with pytest.raises(ValueError, match="num_ranks = 3 does not divide the 8 experts"):
        et.reshard(four, 3)
    with pytest.raises(ValueError, match="expected experts from 2"):
        et.reshard(four[:1] + four[2:], 2)
    bad = [dict(sd) for sd in four]
    bad[1]["router"] = bad[1]["router"] + 1
    with pytest.raises(ValueError, match="'router' differs between state_dict 0 and 1"):
        et.reshard(bad, 2)

    def load_wrong(t):
        moe = layer(t)
        before = moe.w1.detach().clone()
        with pytest.raises(epx.InvalidArgumentError, match=r"holds experts \[0, 2\) of 8, this rank's MoE holds "
                                                           r"\[[04], [48]\)"):
            moe.load_state_dict(four[0])
        return torch.equal(moe.w1, before)

    assert epx.InprocWorld(2).run(load_wrong) == [True, True]


def test_torch_dtypes_are_taken_and_bf16_input_returns_bf16():
    def fn(t):
        by_name, by_dtype = layer(t, dtype="bf16"), layer(t, dtype=torch.bfloat16)
        assert by_dtype.dtype_name == "bf16" and layer(t, dtype=torch.float32).dtype_name == "f32"
        x = tokens(t.rank)
        out = by_dtype(x.to(torch.bfloat16))
        assert out.dtype == torch.bfloat16 and by_dtype(x).dtype == torch.float32
        return torch.equal(by_name(x), by_dtype(x))

    assert epx.InprocWorld(2).run(fn) == [True, True]
    with pytest.raises(ValueError, match="dtype torch.float16 is not one of"):
        epx.InprocWorld(1).run(lambda t: layer(t, dtype=torch.float16))


@pytest.mark.parametrize("convert", [lambda m: m.half(), lambda m: m.to(torch.bfloat16), lambda m: m.double()])
def test_dtype_conversions_of_the_module_are_refused_before_anything_changes(convert):
    def fn(t):
        moe = layer(t)
        with pytest.raises(epx.InvalidArgumentError, match="keeps float32 parameters"):
            convert(moe)
        moe.float()
        return all(p.dtype == torch.float32 for p in moe.parameters())

    assert epx.InprocWorld(1).run(fn) == [True]


def test_drop_in_ffn_has_no_norm_and_no_residual():
    def fn(t):
        block, ffn = layer(t, num_shared_experts=1), layer(t, num_shared_experts=1, norm_and_residual=False)
        assert "norm" not in dict(ffn.named_parameters())
        x = tokens(t.rank)
        normed = et.rms_norm(x, torch.ones(H), block.norm_eps)
        return torch.allclose(ffn(normed), block(x) - x, atol=1e-6)

    assert epx.InprocWorld(2).run(fn) == [True, True]


def test_three_dimensional_input():
    def fn(t):
        moe = layer(t)
        x = tokens(t.rank)
        flat = moe(x)
        batched = moe(x.reshape(2, T // 2, H))
        return batched.shape == (2, T // 2, H) and torch.equal(batched.reshape(T, H), flat)

    assert epx.InprocWorld(2).run(fn) == [True, True]


@pytest.mark.parametrize("bad,match", [
    (torch.zeros(T, H + 1), r"x: shape \[6, 17\] is not \[tokens, 16\] or \[batch, seq, 16\]"),
    (torch.zeros(H), r"x: shape \[16\] is not"),
    (torch.zeros(T, H, dtype=torch.float64), "x: dtype torch.float64 is not torch.float32 or torch.bfloat16"),
])
def test_errors_name_x(bad, match):
    def fn(t):
        with pytest.raises(epx.InvalidArgumentError, match=match):
            layer(t)(bad)
    epx.InprocWorld(1).run(fn)


def test_rank_generators_differ_per_rank_and_repeat():
    draws = epx.InprocWorld(3).run(lambda t: torch.rand(4, generator=et.rank_generator(t, 5)))
    again = epx.InprocWorld(3).run(lambda t: torch.rand(4, generator=et.rank_generator(t, 5)))
    assert all(torch.equal(a, b) for a, b in zip(draws, again))
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])


def test_docstrings_say_creation_is_collective():
    assert "collective" in epx.Buffer.__doc__.lower()
    assert "collective" in epx.LowLatencyBuffer.__doc__.lower()
    assert "collective" in et.MoE.__doc__.lower()
    for name in ("dispatch", "combine", "dispatch_backward", "combine_backward", "dispatch_cached", "combine_expanded",
                 "combine_expanded_backward", "expand", "expanded_layout", "combine_input", "dispatch_send",
                 "dispatch_recv", "combine_send", "combine_recv", "take_waits", "dispatch_async"):
        doc = getattr(epx.Buffer, name).__doc__ or ""
        assert len(doc.splitlines()) > 1 and len(doc.splitlines()[-1]) > 20, (name, doc)
