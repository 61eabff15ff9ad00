"""Arguments the binding cannot convert raise one line naming the argument: None where an epx
object is expected is a TypeError (it used to crash the interpreter for Buffer and
LowLatencyBuffer), an integer outside its C++ type an InvalidArgumentError with the range;
a torchrun-style environment makes mpi_transport() refuse instead of giving rank 0 of 1."""
import os
import subprocess
import sys

import pytest

import epx
from epx import _epx

INT32 = "[-2147483648, 2147483647] (int)"
INT64 = "[-9223372036854775808, 9223372036854775807] (int64)"


def run_python(code, env=None):
    """`code` in a fresh interpreter (a crash must not take pytest down): (exit code, output)."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=env if env is not None else os.environ.copy())
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize("cls", ["Buffer", "LowLatencyBuffer"])
def test_none_transport_is_a_type_error_not_a_crash(cls):
    code = (f"import epx\ntry:\n    epx.{cls}(None, num_experts=4, hidden=8)\n"
            "except TypeError as e:\n    print('caught:', e)\n")
    rc, out = run_python(code)
    assert rc == 0, f"exit {rc}: {out}"
    assert f"caught: {cls}(): transport = None is not an epx.Transport (NoneType)" in out, out


def one_rank(fn):
    return epx.InprocWorld(1).run(fn)[0]


def raises_one_line(error, text, fn, *args, **kwargs):
    with pytest.raises(error) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert text in message and "\n" not in message, message
    return message


def test_integer_overflow_names_the_argument_and_its_range():
    def fn(t):
        raises_one_line(epx.InvalidArgumentError, f"Buffer(): num_experts = 1099511627776 is outside {INT32}",
                        epx.Buffer, t, num_experts=2**40, hidden=8)
        raises_one_line(epx.InvalidArgumentError, f"Buffer(): hidden = 1099511627776 is outside {INT32}",
                        epx.Buffer, t, 4, 2**40)
        raises_one_line(epx.InvalidArgumentError, f"Buffer(): max_recv_tokens = {2**70} is outside {INT64}",
                        epx.Buffer, t, 4, 8, max_recv_tokens=2**70)
        raises_one_line(epx.InvalidArgumentError, f"LowLatencyBuffer(): capacity = 1099511627776 is outside {INT32}",
                        epx.LowLatencyBuffer, t, 4, 8, capacity=2**40)
        buf = epx.Buffer(t, num_experts=4, hidden=8, dtype="f32", max_tokens_per_rank=4, max_topk=2)
        raises_one_line(TypeError, "timeout = 'soon' (str) is not a number of seconds", buf.dispatch_recv,
                        timeout="soon")
        raises_one_line(TypeError, "timeout = 'soon' (str) is not a number of seconds", t.barrier,
                        timeout="soon")
        raises_one_line(epx.InvalidArgumentError, f"load[1] = {2**70} is outside", epx.sum_load_over_ranks,
                        t, [1, 2**70])
        raises_one_line(TypeError, "Buffer.combine_expanded_backward(): with_grad_weights = 'yes' is not a bool",
                        buf.combine_expanded_backward, None, None, None, with_grad_weights="yes")
        raises_one_line(epx.InvalidArgumentError, f"Transport.split(): color = 1099511627776 is outside {INT32}",
                        t.split, 2**40, 0)
        raises_one_line(TypeError, "sum_load_over_ranks(): transport = None is not an epx.Transport",
                        epx.sum_load_over_ranks, None, [1, 2])
    one_rank(fn)


def test_every_kind_of_binding_is_explained():
    raises_one_line(epx.InvalidArgumentError, f"InprocWorld(): num_ranks = 1099511627776 is outside {INT32}",
                    epx.InprocWorld, 2**40)
    raises_one_line(TypeError, "InprocWorld.run(): fn = None is not callable", epx.InprocWorld(1).run, None)
    raises_one_line(epx.InvalidArgumentError, f"RouterConfig(): topk = 1099511627776 is outside {INT32}",
                    epx.RouterConfig, 8, 2**40)
    config = epx.RouterConfig(8, 2)
    raises_one_line(epx.InvalidArgumentError, f"RouterConfig.topk = 1099511627776 is outside {INT32}",
                    setattr, config, "topk", 2**40)
    raises_one_line(epx.InvalidArgumentError, f"RouterConfig.capacity(): num_tokens = {2**64} is outside {INT64}",
                    config.capacity, 2**64)
    raises_one_line(TypeError, "route(): config = None is not an epx.RouterConfig", epx.route, None, None)
    raises_one_line(epx.InvalidArgumentError, f"Buffer.expanded_rows_bound(): hidden = {2**40} is outside {INT32}",
                    epx.Buffer.expanded_rows_bound, 2, 8, 2**40, 4)
    raises_one_line(epx.InvalidArgumentError, "ExpertBias(): num_experts = -9999999999 is outside",
                    epx.ExpertBias, -9999999999)
    raises_one_line(TypeError, "LoadTracker.add(): stats = 3 is not an epx.LoadStats (int)", epx.LoadTracker().add, 3)


def test_every_function_and_method_is_wrapped():
    """No function of the extension is left as pybind11 made it (a builtin or an instancemethod),
    except those whose arguments are all objects: nothing there for a wrapper to explain."""
    from epx import _args

    def unwrapped(obj):
        return (type(obj).__name__ in ("builtin_function_or_method", "instancemethod")
                and not _args._takes_any_objects(getattr(obj, "__func__", obj).__doc__))

    missing = []
    for name, obj in vars(_epx).items():
        if name.startswith("_"):
            continue
        if isinstance(obj, type):
            for member_name, member in vars(obj).items():
                if isinstance(member, staticmethod):
                    member = member.__func__
                if isinstance(member, property):
                    member = member.fset
                if member_name.startswith("__") and member_name != "__init__":
                    continue
                if unwrapped(member):
                    missing.append(f"{name}.{member_name}")
        elif unwrapped(obj):
            missing.append(name)
    assert not missing, missing
    assert epx.Buffer.combine_input.__epx_explained__ and epx.route.__epx_explained__


def test_the_exchange_calls_go_straight_to_the_binding():
    """dispatch and combine take objects only: no Python wrapper in their path, and a call with
    the wrong arguments still raises pybind11's TypeError."""
    assert type(vars(_epx.Buffer)["dispatch"]).__name__ == "instancemethod"
    assert type(vars(_epx.Buffer)["combine"]).__name__ == "instancemethod"

    def fn(t):
        buf = epx.Buffer(t, num_experts=4, hidden=8, dtype="f32", max_tokens_per_rank=4, max_topk=2)
        with pytest.raises(TypeError, match="incompatible function arguments"):
            buf.dispatch(no_such_argument=1)
    one_rank(fn)


def test_signatures_are_parsed_with_their_types():
    from epx import _args
    params = _args.parse_signature(epx.Buffer.__init__.__doc__)
    types = {name: annotation for name, annotation, _, _ in params}
    assert types["transport"] == "epx._epx.Transport"
    assert types["num_experts"] == "int" and types["max_recv_tokens"] == "int64"
    assert types["expert_rank"] == "Optional[List[int]]" and types["timeout"] == "float"


def test_a_call_that_converts_is_not_changed():
    assert one_rank(lambda t: epx.Buffer(t, 4, 8, dtype="f32", max_tokens_per_rank=4).num_experts) == 4
    # A wrong value that converts still gets epx's own message.
    raises_one_line(epx.InvalidArgumentError, "num_ranks = 0 must be at least 1", epx.Buffer.expanded_rows_bound,
                    0, 8, 16, 5)


def test_torchrun_environment_is_refused_by_mpi_transport():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    env.update(RANK="1", WORLD_SIZE="4", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    code = ("import epx\ntry:\n    t = epx.mpi_transport()\n    print('rank', t.rank, 'of', t.num_ranks)\n"
            "except epx.FailedPreconditionError as e:\n    print('refused:', e)\n")
    rc, out = run_python(code, env)
    assert rc == 0, f"exit {rc}: {out}"
    assert "refused: mpi_transport: WORLD_SIZE=4 and RANK=1 are set (a torchrun-style launch)" in out, out
    assert "mpirun -n 4" in out, out


def test_dtypes_are_taken_as_names_or_torch_and_numpy_dtypes():
    import numpy as np
    import torch

    def fn(t):
        made = [epx.Buffer(t, 4, 8, dtype=d, max_tokens_per_rank=4).dtype
                for d in ("bf16", torch.bfloat16, "f32", torch.float32, np.dtype(np.float32))]
        raises_one_line(TypeError, "Buffer(): dtype = 3 is not a dtype name or a torch / numpy dtype (int)",
                        epx.Buffer, t, 4, 8, dtype=3)
        raises_one_line(epx.InvalidArgumentError, "dtype: dtype 'float16' is not one of", epx.Buffer, t, 4, 8,
                        dtype=torch.float16)
        low = epx.LowLatencyBuffer(t, 4, 8, dtype=torch.bfloat16, max_tokens_per_rank=2).dtype
        return made, low

    made, low = one_rank(fn)
    assert made == ["bf16", "bf16", "f32", "f32", "f32"] and low == "bf16"
    assert epx.Buffer.expanded_rows_bound(4, 8, 16, 5, y_dtype=torch.float32, max_topk=2) == 41
