// numpy arrays (buffer protocol) and torch CPU tensors in (their data pointer,
// shape, strides and dtype) and out (DLPack).
#include "arrays.h"

#include <dlpack/dlpack.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <pybind11/numpy.h>

#include "args.h"
#include "errors.h"

namespace pb = pybind11;

namespace epx::py {
namespace {

using Dims = std::array<int64_t, TensorView::kMaxDims>;

// A TensorView of `ndim` (1..4) sizes and element strides.
TensorView make_view(void* data, DType dtype, int ndim, const Dims& sizes, const Dims& strides) {
  switch (ndim) {
    case 1: return TensorView(data, dtype, {sizes[0]}, {strides[0]});
    case 2: return TensorView(data, dtype, {sizes[0], sizes[1]}, {strides[0], strides[1]});
    case 3: return TensorView(data, dtype, {sizes[0], sizes[1], sizes[2]}, {strides[0], strides[1], strides[2]});
    default:
      return TensorView(data, dtype, {sizes[0], sizes[1], sizes[2], sizes[3]},
                        {strides[0], strides[1], strides[2], strides[3]});
  }
}

Dims sizes_of(const TensorView& view) {
  Dims sizes{};
  for (int d = 0; d < view.ndim(); ++d) sizes[d] = view.size(d);
  return sizes;
}

Dims strides_of(const TensorView& view) {
  Dims strides{};
  for (int d = 0; d < view.ndim(); ++d) strides[d] = view.stride(d);
  return strides;
}

[[noreturn]] void bad(std::string_view name, std::string_view what) {
  throw_error("InvalidArgumentError", fmt::format("{}: {}", name, what));
}

void check_ndim(std::string_view name, int ndim) {
  if (ndim < 1 || ndim > TensorView::kMaxDims) {
    bad(name, fmt::format("{} dimensions; epx takes 1 to {}", ndim, TensorView::kMaxDims));
  }
}

// torch's objects that the torch paths use, looked up once torch has been
// imported (never imported here for a numpy caller), and kept for the life of
// the process: a tensor argument then costs attribute reads, not a lookup of
// torch in sys.modules and a DLPack export.
struct TorchApi {
  pb::object tensor_type;  // torch.Tensor
  pb::object strided;      // torch.strided
  pb::object from_dlpack;  // a DLPack capsule -> a tensor (torch.utils.dlpack)
  std::vector<std::pair<pb::object, DType>> dtypes;  // torch.float32 -> kF32, ...
  pb::str requires_grad, is_cpu, device, layout, dtype, shape, stride, data_ptr;
};

TorchApi* make_torch_api(pb::handle torch) {
  // torch.utils.dlpack.from_dlpack takes a capsule to the C function
  // _from_dlpack after a few Python-level checks: call that function directly.
  const pb::module_ dlpack = pb::module_::import("torch.utils.dlpack");
  auto* api = new TorchApi;
  api->tensor_type = torch.attr("Tensor");
  api->strided = torch.attr("strided");
  api->from_dlpack = pb::getattr(dlpack, "_from_dlpack", dlpack.attr("from_dlpack"));
  for (const auto& [attr, dtype] : {std::pair{"float32", DType::kF32}, {"float64", DType::kF64},
                                    {"bfloat16", DType::kBF16}, {"int32", DType::kI32}, {"int64", DType::kI64},
                                    {"uint8", DType::kFP8E4M3}}) {
    api->dtypes.emplace_back(torch.attr(attr), dtype);
  }
  const auto interned = [](const char* name) { return pb::reinterpret_steal<pb::str>(PyUnicode_InternFromString(name)); };
  api->requires_grad = interned("requires_grad");
  api->is_cpu = interned("is_cpu");
  api->device = interned("device");
  api->layout = interned("layout");
  api->dtype = interned("dtype");
  api->shape = interned("shape");
  api->stride = interned("stride");
  api->data_ptr = interned("data_ptr");
  return api;
}

// torch's objects, or null while torch is not imported; `import`: imports it first.
const TorchApi* torch_api(bool import = false) {
  static TorchApi* api = nullptr;  // built with the GIL held; never freed (outlives the interpreter's teardown)
  if (api != nullptr) return api;
  if (import) pb::module_::import("torch");
  PyObject* torch = PyDict_GetItemString(PyImport_GetModuleDict(), "torch");  // borrowed
  if (torch == nullptr) return nullptr;
  TorchApi* built = make_torch_api(torch);
  if (api == nullptr) {
    api = built;  // another thread may have built one while an import above let go of the GIL
  } else {
    delete built;
  }
  return api;
}

bool is_torch_tensor(pb::handle obj) {
  const TorchApi* api = torch_api();
  if (api == nullptr) return false;
  const int is = PyObject_IsInstance(obj.ptr(), api->tensor_type.ptr());
  if (is < 0) throw pb::error_already_set();
  return is != 0;
}

// ---- torch in: the tensor's own data pointer, shape, strides and dtype -------

DType dtype_of_torch(const TorchApi& api, pb::handle obj, std::string_view name) {
  const pb::object dtype = obj.attr(api.dtype);
  for (const auto& [object, value] : api.dtypes) {
    if (dtype.is(object)) return value;
  }
  bad(name, fmt::format("{} is not a dtype epx takes (float32, bfloat16, int32, int64, float64, uint8)",
                        pb::str(dtype).cast<std::string>()));
}

// The tensor's sizes and element strides (DLPack's view of them: what torch
// exports is what epx reads).
int torch_dims(const TorchApi& api, pb::handle obj, std::string_view name, Dims& sizes, Dims& strides) {
  const pb::object shape = obj.attr(api.shape);  // torch.Size, a tuple
  if (!PyTuple_Check(shape.ptr())) bad(name, fmt::format("the tensor's shape is a {}, not a tuple", type_name(shape)));
  const auto ndim = static_cast<int>(PyTuple_GET_SIZE(shape.ptr()));
  check_ndim(name, ndim);
  const pb::object stride = obj.attr(api.stride)();
  if (!PyTuple_Check(stride.ptr()) || PyTuple_GET_SIZE(stride.ptr()) != ndim) {
    bad(name, fmt::format("the tensor's stride() is {}, not {} integers", pb::repr(stride).cast<std::string>(), ndim));
  }
  for (int d = 0; d < ndim; ++d) {
    sizes[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape.ptr(), d));
    strides[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(stride.ptr(), d));
  }
  if (PyErr_Occurred() != nullptr) throw pb::error_already_set();
  return ndim;
}

ArrayArg view_torch(pb::handle obj, std::string_view name) {
  const TorchApi& api = *torch_api();
  if (obj.attr(api.requires_grad).cast<bool>()) bad(name, "the tensor requires grad: pass it .detach()ed");
  if (!obj.attr(api.is_cpu).cast<bool>()) {
    bad(name, fmt::format("the tensor is on {}; epx takes CPU tensors", pb::str(obj.attr(api.device)).cast<std::string>()));
  }
  const pb::object layout = obj.attr(api.layout);
  if (!layout.is(api.strided)) {
    bad(name, fmt::format("the tensor's layout is {}; epx takes strided (dense) tensors",
                          pb::str(layout).cast<std::string>()));
  }
  const DType dtype = dtype_of_torch(api, obj, name);
  Dims sizes{}, strides{};
  const int ndim = torch_dims(api, obj, name, sizes, strides);
  // Dimensions of size 1 and empty tensors may have any strides: never used
  // to address, so those take the dense stride (a [1, H] row is a matrix, a
  // [0, H] one too).
  const bool empty = std::any_of(sizes.begin(), sizes.begin() + ndim, [](int64_t n) { return n == 0; });
  int64_t stride = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (sizes[d] <= 1 || empty) strides[d] = stride;
    stride *= std::max<int64_t>(sizes[d], 1);
  }
  void* data = PyLong_AsVoidPtr(obj.attr(api.data_ptr)().ptr());
  if (PyErr_Occurred() != nullptr) throw pb::error_already_set();
  ArrayArg arg;
  arg.kind = ArrayKind::kTorch;
  arg.owner = pb::reinterpret_borrow<pb::object>(obj);  // the tensor holds its storage
  arg.view = make_view(data, dtype, ndim, sizes, strides);
  return arg;
}

// ---- numpy in: the buffer protocol ----------------------------------------

Result<DType> dtype_of_format(const Py_buffer& buffer) {
  const char* format = buffer.format != nullptr ? buffer.format : "B";
  while (*format == '<' || *format == '=' || *format == '@') ++format;
  const char kind = format[0];
  if (format[0] == '\0' || format[1] != '\0') return invalid_argument("format");
  const auto size = buffer.itemsize;
  if (kind == 'f' && size == 4) return DType::kF32;
  if (kind == 'd' && size == 8) return DType::kF64;
  if (kind == 'H' && size == 2) return DType::kBF16;  // bf16 bits (docs/python.md, "Arrays")
  if ((kind == 'i' || kind == 'l' || kind == 'q') && size == 4) return DType::kI32;
  if ((kind == 'i' || kind == 'l' || kind == 'q') && size == 8) return DType::kI64;
  if (kind == 'B' && size == 1) return DType::kFP8E4M3;
  return invalid_argument("format");
}

ArrayArg view_buffer(pb::handle obj, std::string_view name) {
  Py_buffer buffer;
  if (PyObject_GetBuffer(obj.ptr(), &buffer, PyBUF_RECORDS_RO) != 0) throw pb::error_already_set();
  struct Release {
    Py_buffer* b;
    ~Release() { PyBuffer_Release(b); }
  } release{&buffer};
  Result<DType> dtype = dtype_of_format(buffer);
  if (!dtype.is_ok()) {
    const std::string dt = pb::hasattr(obj, "dtype") ? pb::str(obj.attr("dtype")).cast<std::string>()
                                                     : std::string(buffer.format != nullptr ? buffer.format : "?");
    bad(name, fmt::format("{} is not a dtype epx takes (float32, uint16 as bf16, int32, int64, float64, uint8)", dt));
  }
  check_ndim(name, buffer.ndim);
  Dims sizes{}, strides{};
  for (int d = 0; d < buffer.ndim; ++d) {
    sizes[d] = buffer.shape[d];
    if (buffer.strides[d] % buffer.itemsize != 0) {
      bad(name, fmt::format("stride {} of dimension {} is not a multiple of the element size {}", buffer.strides[d], d,
                            buffer.itemsize));
    }
    strides[d] = buffer.strides[d] / buffer.itemsize;
  }
  ArrayArg arg;
  arg.kind = ArrayKind::kNumpy;
  arg.owner = pb::reinterpret_borrow<pb::object>(obj);
  arg.view = make_view(buffer.buf, *dtype, buffer.ndim, sizes, strides);
  return arg;
}

// ---- out ---------------------------------------------------------------------

// How each DType is named by numpy and torch and typed in DLPack (fp8 codes
// and ue8m0 scales are bytes; bf16 is numpy's uint16 by convention).
struct DTypeNames {
  DType dtype;
  const char* numpy;
  const char* torch;
  DLDataType dlpack;
};
constexpr DTypeNames kDTypeNames[] = {
    {DType::kF32, "float32", "float32", {kDLFloat, 32, 1}},   {DType::kF64, "float64", "float64", {kDLFloat, 64, 1}},
    {DType::kBF16, "uint16", "bfloat16", {kDLBfloat, 16, 1}}, {DType::kI32, "int32", "int32", {kDLInt, 32, 1}},
    {DType::kI64, "int64", "int64", {kDLInt, 64, 1}},         {DType::kFP8E4M3, "uint8", "uint8", {kDLUInt, 8, 1}},
    {DType::kUE8M0, "uint8", "uint8", {kDLUInt, 8, 1}},
};

const DTypeNames& names_of(DType dtype) {
  for (const DTypeNames& names : kDTypeNames) {
    if (names.dtype == dtype) return names;
  }
  return kDTypeNames[std::size(kDTypeNames) - 1];  // every DType is listed above
}

// The DLPack export of a view: shape and strides live here, and `owner`
// stays referenced until torch frees the tensor's storage.
struct Export {
  DLManagedTensor managed{};
  Dims shape{}, strides{};
  PyObject* owner = nullptr;
};

void delete_export(DLManagedTensor* managed) {
  auto* exported = static_cast<Export*>(managed->manager_ctx);
  if (Py_IsInitialized()) {
    PyGILState_STATE state = PyGILState_Ensure();  // torch may free storage without the GIL
    Py_XDECREF(exported->owner);
    PyGILState_Release(state);
  }
  delete exported;
}

void delete_capsule(PyObject* capsule) {
  // Not consumed by torch (still "dltensor"): the export is ours to free.
  if (PyCapsule_IsValid(capsule, "dltensor") != 0) {
    auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    managed->deleter(managed);
  }
}

pb::object torch_view(const TensorView& view, pb::object owner) {
  auto* exported = new Export{.shape = sizes_of(view), .strides = strides_of(view)};
  exported->owner = owner.release().ptr();
  DLTensor& t = exported->managed.dl_tensor;
  t.data = view.data();
  t.device = {kDLCPU, 0};
  t.ndim = view.ndim();
  t.dtype = names_of(view.dtype()).dlpack;
  t.shape = exported->shape.data();
  t.strides = exported->strides.data();
  t.byte_offset = 0;
  exported->managed.manager_ctx = exported;
  exported->managed.deleter = delete_export;
  PyObject* capsule = PyCapsule_New(&exported->managed, "dltensor", delete_capsule);
  if (capsule == nullptr) {
    delete_export(&exported->managed);
    throw pb::error_already_set();
  }
  pb::object handle = pb::reinterpret_steal<pb::object>(capsule);
  return torch_api(/*import=*/true)->from_dlpack(handle);
}

// Copies `from` into the same-shaped, same-dtype `to`, any strides.
void copy_elements(const TensorView& from, const TensorView& to) {
  const int ndim = from.ndim();
  const auto elem = static_cast<int64_t>(from.element_size());
  Dims index{};
  const int64_t rows = from.numel() / std::max<int64_t>(1, from.size(ndim - 1));
  const int64_t cols = from.size(ndim - 1);
  for (int64_t r = 0; r < rows && cols > 0; ++r) {
    int64_t src = 0, dst = 0;
    for (int d = 0; d < ndim - 1; ++d) {
      src += index[d] * from.stride(d);
      dst += index[d] * to.stride(d);
    }
    auto* s = static_cast<const std::byte*>(from.data()) + src * elem;
    auto* o = static_cast<std::byte*>(to.data()) + dst * elem;
    if (from.stride(ndim - 1) == 1) {
      std::memcpy(o, s, static_cast<std::size_t>(cols * elem));
    } else {
      for (int64_t c = 0; c < cols; ++c) {
        std::memcpy(o + c * elem, s + c * from.stride(ndim - 1) * elem, static_cast<std::size_t>(elem));
      }
    }
    for (int d = ndim - 2; d >= 0; --d) {  // the next row's index
      if (++index[d] < from.size(d)) break;
      index[d] = 0;
    }
  }
}

}  // namespace

ArrayArg view_array(pb::handle obj, std::string_view name) {
  if (obj.is_none()) bad(name, "None where an array is needed");
  if (is_torch_tensor(obj)) return view_torch(obj, name);
  if (PyObject_CheckBuffer(obj.ptr()) != 0) return view_buffer(obj, name);
  bad(name, fmt::format("a {} is not an array: pass a numpy array or a torch tensor",
                        type_name(obj)));
}

ArrayArg view_optional(pb::handle obj, std::string_view name) {
  if (obj.is_none()) return {};
  return view_array(obj, name);
}

ArrayArg view_ids(pb::handle obj, std::string_view name) {
  ArrayArg arg = view_array(obj, name);
  const DType dtype = arg.view.dtype();
  if (dtype == DType::kI32) return arg;
  if (dtype != DType::kI64) bad(name, fmt::format("ids must be int32 or int64, not {}", dtype_name(dtype)));
  const TensorView& from = arg.view;
  const Dims shape = sizes_of(from);
  ArrayArg copy = new_array(ArrayKind::kNumpy, DType::kI64, std::span<const int64_t>(shape.data(), from.ndim()));
  copy_elements(from, copy.view);  // contiguous int64 first, then narrowed in place order
  ArrayArg narrow = new_array(ArrayKind::kNumpy, DType::kI32, std::span<const int64_t>(shape.data(), from.ndim()));
  const int64_t* wide = copy.view.data_as<int64_t>();
  int32_t* ids = narrow.view.data_as<int32_t>();
  for (int64_t i = 0; i < from.numel(); ++i) {
    if (wide[i] < std::numeric_limits<int32_t>::min() || wide[i] > std::numeric_limits<int32_t>::max()) {
      bad(name, fmt::format("id {} at flat index {} is outside int32", wide[i], i));
    }
    ids[i] = static_cast<int32_t>(wide[i]);
  }
  narrow.kind = arg.kind;
  return narrow;
}

ArrayArg new_array(ArrayKind kind, DType dtype, std::span<const int64_t> shape) {
  pb::tuple dims(shape.size());
  for (std::size_t d = 0; d < shape.size(); ++d) dims[d] = pb::int_(shape[d]);
  pb::object array;
  if (kind == ArrayKind::kTorch) {
    pb::module_ torch = pb::module_::import("torch");
    array = torch.attr("zeros")(dims, pb::arg("dtype") = torch.attr(names_of(dtype).torch));
  } else {
    array = pb::module_::import("numpy").attr("zeros")(dims, pb::arg("dtype") = names_of(dtype).numpy);
  }
  ArrayArg arg = view_array(array, "new array");
  arg.view = make_view(arg.view.data(), dtype, arg.view.ndim(), sizes_of(arg.view), strides_of(arg.view));
  arg.owner = array;  // the array itself (not its DLPack capsule) is what callers return
  return arg;
}

ArrayArg view_output(pb::handle obj, std::string_view name) {
  ArrayArg arg = view_array(obj, name);
  if (arg.kind == ArrayKind::kNumpy && pb::hasattr(obj, "flags") && !obj.attr("flags").attr("writeable").cast<bool>()) {
    throw_error("InvalidArgumentError", fmt::format("{}: the array is read-only", name));
  }
  arg.owner = pb::reinterpret_borrow<pb::object>(obj);  // the array itself, what the call returns
  return arg;
}

pb::object wrap_view(ArrayKind kind, const TensorView& view, pb::object owner) {
  if (kind == ArrayKind::kTorch) return torch_view(view, std::move(owner));
  std::vector<pb::ssize_t> shape, strides;
  const auto elem = static_cast<pb::ssize_t>(view.element_size());
  for (int d = 0; d < view.ndim(); ++d) {
    shape.push_back(view.size(d));
    strides.push_back(view.stride(d) * elem);
  }
  return pb::array(pb::dtype(names_of(view.dtype()).numpy), shape, strides, view.data(), owner);
}

pb::object copy_of(ArrayKind kind, const TensorView& view) {
  const Dims shape = sizes_of(view);
  ArrayArg copy = new_array(kind, view.dtype(), std::span<const int64_t>(shape.data(), view.ndim()));
  copy_elements(view, copy.view);
  return copy.owner;
}

}  // namespace epx::py
