"""torch tensors in: the binding reads a tensor's data_ptr(), shape, stride() and dtype. The
exchange gives the same bits as from numpy arrays over the same memory (contiguous, strided,
offset, single-row and empty tensors), and every tensor it cannot take is refused with the
message naming the argument: wrong dtype, requires grad, not on the CPU, sparse, too many
dimensions, strides the C++ checks refuse (the same message numpy's view of them gets)."""
import numpy as np
import pytest

import epx

torch = pytest.importorskip("torch")

H = 16  # hidden
E = 8   # experts (4 per rank on 2 ranks)
K = 3   # top-k


def routing(tokens, seed):
    """[T, K] distinct experts per token (int32) and their weights (f32)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)]) if tokens else \
        torch.empty(0, K, dtype=torch.int64)
    return idx.to(torch.int32), torch.rand(tokens, K, generator=g)


def bits(a):
    """An array's values as numpy (a view where it can be), bf16 as its bits (so equal means equal bits)."""
    if isinstance(a, torch.Tensor):
        return a.view(torch.int16).numpy().view(np.uint16) if a.dtype == torch.bfloat16 else a.numpy()
    return np.asarray(a)


def tensor_of(a, dtype):
    """The tensor over numpy array a's memory (uint16 bits as bf16)."""
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if dtype == torch.bfloat16 else torch.from_numpy(a)


# Each layout: (name, make x from a [2T+2, H] f32 tensor `big`, tokens T).
LAYOUTS = [
    ("contiguous", lambda big, t: big[:t].clone()),
    ("every other row", lambda big, t: big[::2][:t]),
    ("storage offset", lambda big, t: big[2:2 + t]),
    ("one row", lambda big, t: big[:1]),
    ("empty", lambda big, t: big[:0]),
]


def run(make_x, dtype, library):
    """dispatch and combine on 2 in-process ranks, inputs from torch or as numpy views of the same
    tensors; every result as numpy bits."""
    def rank_fn(t):
        big = torch.randn(2 * 5 + 2, H, generator=torch.Generator().manual_seed(7 + t.rank))
        x = make_x(big.to(dtype), 5)
        idx, w = routing(x.shape[0], 11 + t.rank)
        if library == "numpy":
            x, idx, w = bits(x), idx.numpy(), w.numpy()
        buf = epx.Buffer(t, num_experts=E, hidden=H, dtype="bf16" if dtype == torch.bfloat16 else "f32",
                         max_tokens_per_rank=5, max_topk=K, timeout=20.0)
        res = buf.dispatch(x, idx, w)
        got = {name: bits(getattr(res, name)).copy() for name in
               ("recv_x", "recv_topk_idx", "recv_topk_weights", "recv_src_rank", "recv_src_idx")}
        recv_x = res.recv_x if library == "torch" else tensor_of(res.recv_x, dtype)
        y = (recv_x.float() * 0.5 - 1).to(dtype)  # the experts' rows
        got["out"] = bits(buf.combine(y if library == "torch" else bits(y), res.handle)).copy()
        return got
    return epx.InprocWorld(2).run(rank_fn)


@pytest.mark.parametrize("name,make_x", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_torch_tensors_give_the_bits_of_numpy_arrays_over_the_same_memory(name, make_x, dtype):
    from_torch, from_numpy = run(make_x, dtype, "torch"), run(make_x, dtype, "numpy")
    for rank, (a, b) in enumerate(zip(from_torch, from_numpy)):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"{name}, rank {rank}: {key}")
            assert a[key].dtype == b[key].dtype, key


def one_rank_dispatch(x, idx=None):
    """(class name, message) of the error buf.dispatch(x, idx) raises on one rank; None if none.
    idx defaults to experts 0 and 1 for every row of x."""
    if idx is None:
        idx = np.tile(np.array([0, 1], np.int32), (len(x) if np.ndim(x) else 1, 1))

    def fn(t):
        buf = epx.Buffer(t, num_experts=4, hidden=H, dtype="f32", max_tokens_per_rank=4, max_topk=2, timeout=20.0)
        try:
            buf.dispatch(x, idx)
        except epx.Error as e:
            return type(e).__name__, str(e)
        return None
    return epx.InprocWorld(1).run(fn)[0]


REFUSED = [
    (lambda: torch.ones(3, H, dtype=torch.float16),
     "x: torch.float16 is not a dtype epx takes (float32, bfloat16, int32, int64, float64, uint8)"),
    (lambda: torch.ones(3, H, requires_grad=True), "x: the tensor requires grad: pass it .detach()ed"),
    (lambda: torch.ones(3, H, device="meta"), "x: the tensor is on meta; epx takes CPU tensors"),
    (lambda: torch.ones(3, H).to_sparse(),
     "x: the tensor's layout is torch.sparse_coo; epx takes strided (dense) tensors"),
    (lambda: torch.ones(1, 1, 1, 3, H), "x: 5 dimensions; epx takes 1 to 4"),
    (lambda: torch.tensor(1.0), "x: 0 dimensions; epx takes 1 to 4"),
]


@pytest.mark.parametrize("make,message", REFUSED, ids=["float16", "grad", "meta", "sparse", "5-d", "0-d"])
def test_tensors_epx_cannot_take_are_refused_naming_the_argument(make, message):
    assert one_rank_dispatch(make()) == ("InvalidArgumentError", message)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_tensors_are_refused():
    assert one_rank_dispatch(torch.ones(3, H, device="cuda")) == (
        "InvalidArgumentError", "x: the tensor is on cuda:0; epx takes CPU tensors")


@pytest.mark.parametrize("make", [
    lambda: torch.ones(3, 2 * H)[:, ::2],   # elements 2 apart
    lambda: torch.ones(H, 3).t(),           # column-major
    lambda: torch.ones(1, H).expand(3, H),  # rows 0 apart
], ids=["every other column", "transposed", "expanded"])
def test_strides_the_exchange_refuses_get_the_message_numpy_gets(make):
    x = make()
    from_torch = one_rank_dispatch(x)
    assert from_torch is not None and from_torch[0] == "InvalidArgumentError", from_torch
    assert from_torch == one_rank_dispatch(x.numpy())  # the same memory and strides


def test_ids_out_of_int32_and_of_the_wrong_dtype_name_topk_idx():
    x = torch.ones(2, H)
    assert one_rank_dispatch(x, torch.tensor([[0, 2**40], [1, 2]])) == (
        "InvalidArgumentError", f"topk_idx: id {2**40} at flat index 1 is outside int32")
    assert one_rank_dispatch(x, torch.ones(2, 2)) == (
        "InvalidArgumentError", "topk_idx: ids must be int32 or int64, not f32")
