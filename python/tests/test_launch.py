"""epx.launch (the torchrun-style launcher) and the errors of epx.torchrun_transport /
epx.torch.transport; the transports themselves run in the torchrun ctest entries."""
import os
import subprocess
import sys
import textwrap
import time

import pytest

import epx

VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def launch(tmp_path, body, *launcher_args, env=None, timeout=60):
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(body))
    command = [sys.executable, "-m", "epx.launch", *launcher_args, str(script)]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


def test_every_process_gets_torchruns_variables_and_no_mpi_ones(tmp_path):
    out = tmp_path / "env"
    result = launch(tmp_path, f"""
        import json, os
        names = {VARIABLES!r}
        seen = {{n: os.environ.get(n) for n in names}}
        seen["mpi"] = sorted(k for k in os.environ if k.startswith(("OMPI_", "PMIX_", "PMI_")))
        open({str(out)!r} + os.environ["RANK"], "w").write(json.dumps(seen))
    """, "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "3", "--master-addr", "10.1.2.3",
        "--master-port", "4000", env={"OMPI_COMM_WORLD_SIZE": "2", "PMIX_RANK": "1"})
    assert result.returncode == 0, result.stderr
    import json
    for local in range(3):
        seen = json.loads((tmp_path / f"env{3 + local}").read_text())
        assert seen == {"RANK": str(3 + local), "WORLD_SIZE": "6", "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": "3",
                        "GROUP_RANK": "1", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "4000", "mpi": []}


def test_a_failing_process_stops_the_others_and_sets_the_exit_status(tmp_path):
    start = time.monotonic()
    result = launch(tmp_path, """
        import os, sys, time
        if os.environ["RANK"] == "1":
            sys.exit(5)
        time.sleep(60)
    """, "--nproc-per-node", "3", "--grace", "5")
    assert result.returncode == 5, result.stderr
    assert "local rank 1" in result.stderr and "exit status 5" in result.stderr
    assert time.monotonic() - start < 30


def test_the_timeout_kills_every_process_with_status_124(tmp_path):
    result = launch(tmp_path, "import time; time.sleep(60)\n", "--nproc-per-node", "2", "--timeout", "1",
                    "--grace", "1")
    assert result.returncode == 124
    assert "--timeout 1 s passed" in result.stderr


def test_bad_launcher_arguments_are_refused(tmp_path):
    for args, text in ((("--nproc-per-node", "0"), "--nproc-per-node = 0"),
                       (("--nnodes", "2", "--node-rank", "2"), "--node-rank = 2"),
                       (("--master-port", "65535"), "--master-port = 65535")):
        result = launch(tmp_path, "pass\n", *args)
        assert result.returncode == 2 and text in result.stderr, result.stderr


GOOD = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29700"}


@pytest.mark.parametrize("missing", ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"])
def test_torchrun_transport_names_a_missing_variable(missing):
    env = {k: v for k, v in GOOD.items() if k != missing}
    with pytest.raises(epx.FailedPreconditionError, match=f"variable {missing} is not set"):
        epx.torchrun_transport(env=env)


def test_torchrun_transport_refuses_bad_values():
    with pytest.raises(epx.InvalidArgumentError, match="RANK=1 is not below WORLD_SIZE=1"):
        epx.torchrun_transport(env=dict(GOOD, RANK="1"))
    with pytest.raises(epx.InvalidArgumentError, match="RANK='x' is not an integer"):
        epx.torchrun_transport(env=dict(GOOD, RANK="x"))


def test_one_process_world_through_torchs_store():
    t = epx.torchrun_transport(env=GOOD)
    assert (t.backend, t.rank, t.num_ranks, t.num_nodes) == ("socket", 0, 1, 1)
    t.barrier()


def test_launched_transport_is_none_without_a_launcher(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert epx.launched_transport() is None


def test_epx_torch_transport_needs_torch_distributed():
    import epx.torch as et
    with pytest.raises(epx.FailedPreconditionError, match="init_process_group"):
        et.transport()
