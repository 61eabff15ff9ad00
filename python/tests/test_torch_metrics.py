"""epx.torch.MetricsWriter writes epx train's metrics lines for a PyTorch run: one line per
step with every MoE layer's global load and every rank's times, read back by `epx monitor` and
`epx report` unchanged; an existing file is refused on every rank with nothing of it changed;
a non-finite loss is written as null; val_loss only on the steps given one."""
import json
import os
import subprocess

import pytest
import torch

import epx
import epx.torch as et

H, F, E, K, T = 16, 24, 8, 2, 12


def run_steps(path, steps=3, ranks=2, losses=None, val_losses=None):
    """`steps` forward/backward steps of two MoE layers on `ranks` in-process ranks, with metrics."""
    def fn(t):
        layers = [et.MoE(H, F, E, K, transport=t, layer_index=i, seed=3, expert_bias=True) for i in range(2)]
        metrics = et.MetricsWriter(path, t, layers)
        for step in range(steps):
            x = torch.randn(T, H, generator=torch.Generator().manual_seed(100 * step + t.rank))
            out = layers[1](layers[0](x))
            out.square().mean().backward()
            loss = losses[step] if losses else float(out.square().mean())
            val_loss = val_losses.get(step) if val_losses else None
            metrics.step(step, loss, val_loss=val_loss, lr=1e-3, tokens=T * ranks)
        metrics.close()
    epx.InprocWorld(num_ranks=ranks).run(fn)


def test_one_line_per_step_with_every_layer_and_rank(tmp_path):
    path = str(tmp_path / "m.jsonl")
    run_steps(path)
    lines = open(path).read().splitlines()
    assert len(lines) == 3
    for step, line in enumerate(lines):
        record = json.loads(line)
        assert record["step"] == step and record["num_nodes"] == 1
        assert [layer["layer"] for layer in record["layers"]] == [0, 1]
        for layer in record["layers"]:
            assert sum(layer["tokens_per_expert"]) == 2 * T * K  # both ranks' (token, slot) pairs
            assert len(layer["tokens_per_rank"]) == 2 and layer["max_vio"] >= 0
        assert [r["rank"] for r in record["ranks"]] == [0, 1]
        for r in record["ranks"]:
            assert r["total"] > 0 and r["experts"] > 0 and r["dispatch"] > 0
            assert r["router"] + r["dispatch"] + r["experts"] + r["combine"] + r["dense"] == pytest.approx(r["total"])


def test_an_existing_file_is_refused_on_every_rank_and_kept(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("the user's data\n")
    errors = []

    def fn(t):
        layers = [et.MoE(H, F, E, K, transport=t)]
        try:
            et.MetricsWriter(str(path), t, layers)
        except FileExistsError as e:
            errors.append((t.rank, str(e)))
    epx.InprocWorld(num_ranks=2).run(fn)
    assert sorted(rank for rank, _ in errors) == [0, 1]
    assert path.read_text() == "the user's data\n"


def test_a_nan_loss_is_written_as_null(tmp_path):
    path = str(tmp_path / "m.jsonl")
    run_steps(path, steps=2, losses=[1.5, float("nan")])
    text = open(path).read()
    assert "NaN" not in text
    assert [json.loads(line)["loss"] for line in text.splitlines()] == [1.5, None]


def test_val_loss_only_on_the_steps_that_have_one(tmp_path):
    path = str(tmp_path / "m.jsonl")
    run_steps(path, steps=4, val_losses={1: 2.25, 3: float("inf")})
    records = [json.loads(line) for line in open(path).read().splitlines()]
    assert [r.get("val_loss", "absent") for r in records] == ["absent", 2.25, "absent", None]


def test_epx_monitor_and_report_read_it(tmp_path):
    epx_bin = os.environ.get("EPX_BIN")
    if not epx_bin:
        pytest.skip("EPX_BIN (the epx command) is not set: ctest sets it where the epx command is built")
    path = str(tmp_path / "m.jsonl")
    run_steps(path, steps=4)
    monitor = subprocess.run([epx_bin, "monitor", path, "--plain"], capture_output=True, text=True, timeout=60)
    assert monitor.returncode == 0, monitor.stderr
    assert "step 3" in monitor.stdout, monitor.stdout
    html = str(tmp_path / "r.html")
    report = subprocess.run([epx_bin, "report", path, "-o", html], capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    assert "from 4 steps" in report.stdout and os.path.getsize(html) > 1000


def test_a_write_that_fails_raises_on_every_rank():
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    errors = []

    def fn(t):
        layers = [et.MoE(H, F, E, K, transport=t)]
        metrics = et.MetricsWriter("/dev/full", t, layers, append=True)
        layers[0](torch.randn(T, H))
        try:
            metrics.step(0, 1.0)
        except OSError as e:
            errors.append((t.rank, str(e)))
        metrics.close()
    epx.InprocWorld(num_ranks=2).run(fn)
    assert sorted(rank for rank, _ in errors) == [0, 1]
    assert any("could not write step 0" in text for _, text in errors)
