#include "args.h"

#include <limits>

#include <fmt/format.h>

#include "errors.h"

namespace pb = pybind11;

namespace epx::py {
namespace {

template <typename T>
T narrow_to(int64_t value, std::string_view name, int64_t index) {
  if (value < std::numeric_limits<T>::min() || value > std::numeric_limits<T>::max())
    throw_error("InvalidArgumentError", fmt::format("{}[{}] = {} is outside [{}, {}]", name, index, value,
                                                    std::numeric_limits<T>::min(), std::numeric_limits<T>::max()));
  return static_cast<T>(value);
}

template <typename T>
std::vector<T> from_sequence(pb::handle obj, std::string_view name) {
  pb::sequence seq = pb::reinterpret_borrow<pb::sequence>(obj);
  std::vector<T> out;
  out.reserve(seq.size());
  for (std::size_t i = 0; i < seq.size(); ++i) {
    pb::object item = seq[i];
    if (!PyIndex_Check(item.ptr()))
      throw_error("InvalidArgumentError", fmt::format("{}[{}] is not an integer", name, i));
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(pb::reinterpret_steal<pb::object>(PyNumber_Index(item.ptr())).ptr(),
                                                         &overflow);
    if (overflow != 0)
      throw_error("InvalidArgumentError", fmt::format("{}[{}] = {} is outside [{}, {}]", name, i,
                                                      pb::str(item).cast<std::string>(),
                                                      std::numeric_limits<T>::min(), std::numeric_limits<T>::max()));
    out.push_back(narrow_to<T>(value, name, static_cast<int64_t>(i)));
  }
  return out;
}

template <typename T>
std::vector<T> from_array(const TensorView& view, std::string_view name) {
  if (view.ndim() != 1 || (view.dtype() != DType::kI32 && view.dtype() != DType::kI64))
    throw_error("InvalidArgumentError",
                fmt::format("{} must be a 1-D int32 or int64 array, got {}", name, view.describe()));
  std::vector<T> out(static_cast<std::size_t>(view.size(0)));
  const auto* base = static_cast<const std::byte*>(view.data());
  const int64_t step = view.stride(0) * static_cast<int64_t>(view.element_size());
  for (int64_t i = 0; i < view.size(0); ++i) {
    const std::byte* at = base + i * step;
    const int64_t value = view.dtype() == DType::kI32 ? *reinterpret_cast<const int32_t*>(at)
                                                      : *reinterpret_cast<const int64_t*>(at);
    out[static_cast<std::size_t>(i)] = narrow_to<T>(value, name, i);
  }
  return out;
}

}  // namespace

template <typename T>
std::vector<T> int_vector(pb::handle obj, std::string_view name, ArrayKind* kind) {
  if (kind != nullptr) *kind = ArrayKind::kNumpy;
  if (pb::isinstance<pb::list>(obj) || pb::isinstance<pb::tuple>(obj)) return from_sequence<T>(obj, name);
  const ArrayArg array = view_array(obj, name);
  if (kind != nullptr) *kind = array.kind;
  return from_array<T>(array.view, name);
}
template std::vector<int32_t> int_vector<int32_t>(pb::handle, std::string_view, ArrayKind*);
template std::vector<int64_t> int_vector<int64_t>(pb::handle, std::string_view, ArrayKind*);

}  // namespace epx::py
