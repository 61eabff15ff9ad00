// Arrays across the binding: numpy arrays and PyTorch CPU tensors as
// TensorViews (in), new arrays and zero-copy views of epx's regions (out).
//
// In: a numpy array through the buffer protocol, a torch tensor through its
// data_ptr(), shape, stride() and dtype (what its DLPack export would say,
// without making one), both without copies. dtypes: float32, bfloat16
// (torch.bfloat16, or numpy uint16 holding the bits), int32, int64, float64,
// uint8 (fp8 e4m3 codes and ue8m0 scales). Anything else, a GPU tensor, a
// sparse tensor, a tensor that requires grad or a non-array raises
// epx.InvalidArgumentError naming the argument; shape and stride checks are left to the C++ call
// (the same checks C++ users get).
//
// Out: arrays of the caller's library (ArrayKind): a fresh one owning its
// memory, or a view of memory someone else owns, which keeps `owner` alive.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include <pybind11/pybind11.h>

#include "epx/core/tensor.h"

namespace epx::py {

enum class ArrayKind : uint8_t { kNumpy, kTorch };

// A caller's array, viewed for the length of one call.
struct ArrayArg {
  TensorView view;                 // undefined for None
  ArrayKind kind = ArrayKind::kNumpy;
  pybind11::object owner;          // keeps the viewed memory alive (the array, the capsule, or a copy)
  [[nodiscard]] bool defined() const { return view.defined(); }
};

// Views `obj`. `bf16_hint`: numpy uint16 is taken as bf16 bits (the only
// meaning uint16 has in epx). Raises InvalidArgumentError naming `name`.
ArrayArg view_array(pybind11::handle obj, std::string_view name);
// As view_array, and None gives an undefined view.
ArrayArg view_optional(pybind11::handle obj, std::string_view name);
// A caller's `out=` array: viewed as by view_array, refused when read-only,
// and its owner is `obj` itself (what the call returns to the caller).
ArrayArg view_output(pybind11::handle obj, std::string_view name);
// Expert or token ids: int32 is viewed; int64 is narrowed into an owned int32
// copy (InvalidArgumentError naming the first value outside int32).
ArrayArg view_ids(pybind11::handle obj, std::string_view name);

// A new contiguous array of `kind` (zero-filled), and its view.
ArrayArg new_array(ArrayKind kind, DType dtype, std::span<const int64_t> shape);
// An array of `kind` over `view`'s memory (no copy); holds a reference to
// `owner` for as long as the array or any view of it lives.
pybind11::object wrap_view(ArrayKind kind, const TensorView& view, pybind11::object owner);
// A copy of `view`'s memory in a new array of `kind`.
pybind11::object copy_of(ArrayKind kind, const TensorView& view);

}  // namespace epx::py
