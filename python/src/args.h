// Arguments from Python: integer lists (lists, tuples, numpy arrays, torch
// tensors) and names that choose one value of an enum.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <pybind11/pybind11.h>

#include "arrays.h"
#include "epx/core/clock.h"
#include "errors.h"

namespace epx::py {

// A list, tuple, numpy array or torch tensor of integers (int32 or int64,
// 1-D) as a vector of T; `*kind` (when given) gets the library of an array
// (numpy for a list). InvalidArgumentError naming `name` otherwise, or for a
// value outside T.
template <typename T>
std::vector<T> int_vector(pybind11::handle obj, std::string_view name, ArrayKind* kind = nullptr);
extern template std::vector<int32_t> int_vector<int32_t>(pybind11::handle, std::string_view, ArrayKind*);
extern template std::vector<int64_t> int_vector<int64_t>(pybind11::handle, std::string_view, ArrayKind*);

// The name of `obj`'s Python type ("list"), for errors.
inline std::string type_name(pybind11::handle obj) {
  return pybind11::str(pybind11::type::handle_of(obj).attr("__name__")).cast<std::string>();
}

// The value that `name` chooses among `choices` (name, value); else
// InvalidArgumentError "field = 'name' is not one of a, b, c".
template <typename E>
E parse_choice(std::string_view name, std::string_view field,
               std::initializer_list<std::pair<std::string_view, E>> choices) {
  std::string names;
  for (const auto& [choice, value] : choices) {
    if (choice == name) return value;
    names += (names.empty() ? "" : ", ") + std::string(choice);
  }
  throw_error("InvalidArgumentError", std::string(field) + " = '" + std::string(name) + "' is not one of " + names);
}

// A flag that must be a Python bool (True or False): 1, "yes" or None is an
// InvalidArgumentError naming `name` and the value, not a silent truth test.
inline bool bool_arg(pybind11::handle obj, std::string_view name) {
  if (!pybind11::isinstance<pybind11::bool_>(obj)) {
    throw_error("InvalidArgumentError", fmt::format("{} = {} ({}) is not a bool (True or False)", name,
                                                    pybind11::repr(obj).cast<std::string>(), type_name(obj)));
  }
  return obj.cast<bool>();
}

// A buffer's timeout: `seconds` (> 0, else InvalidArgumentError) in milliseconds.
inline Milliseconds timeout_arg(double seconds) {
  if (!(seconds > 0)) throw_error("InvalidArgumentError", fmt::format("timeout: {} s is not positive", seconds));
  return Milliseconds(static_cast<int64_t>(seconds * 1000));
}

// The widest top-k a buffer accepts: `max_topk` when given, else the C++
// default (8) capped at num_experts, so small worlds work without it.
inline int default_topk(const std::optional<int>& max_topk, int num_experts) {
  if (max_topk) return *max_topk;
  return num_experts > 0 && num_experts < 8 ? num_experts : 8;
}

// An integer argument that C++ holds in 64 bits: signatures show it as
// "int64" (a plain "int" is C++'s 32-bit int), so the explanation of a value
// out of range (epx/_args.py) names the right limits.
struct Int64 {
  int64_t value = 0;
  operator int64_t() const { return value; }  // NOLINT(google-explicit-constructor)
};

// A dtype argument: epx's name ("bf16", "f32", ...) or a torch / numpy dtype
// (torch.bfloat16, numpy.float32), taken by its name ("bfloat16", "float32");
// parse_dtype reads either. Signatures show it as "dtype".
struct DTypeName {
  std::string name;
  operator std::string_view() const { return name; }  // NOLINT(google-explicit-constructor)
};

}  // namespace epx::py

namespace pybind11::detail {
template <>
struct type_caster<epx::py::DTypeName> {
  PYBIND11_TYPE_CASTER(epx::py::DTypeName, const_name("dtype"));
  bool load(handle src, bool /*convert*/) {
    if (isinstance<str>(src)) {
      value.name = src.cast<std::string>();
      return true;
    }
    const std::string type = str(type::handle_of(src).attr("__module__")).cast<std::string>() + "." +
                             str(type::handle_of(src).attr("__name__")).cast<std::string>();
    if (type == "torch.dtype") {
      value.name = str(src).cast<std::string>().substr(6);  // "torch.bfloat16" -> "bfloat16"
      return true;
    }
    if (type == "numpy.dtype" || type.rfind("numpy.dtype[", 0) == 0) {
      value.name = str(src.attr("name")).cast<std::string>();
      return true;
    }
    return false;
  }
  static handle cast(const epx::py::DTypeName& src, return_value_policy /*policy*/, handle /*parent*/) {
    return str(src.name).release();
  }
};

template <>
struct type_caster<epx::py::Int64> {
  PYBIND11_TYPE_CASTER(epx::py::Int64, const_name("int64"));
  bool load(handle src, bool convert) {
    make_caster<int64_t> inner;
    if (!inner.load(src, convert)) return false;
    value.value = cast_op<int64_t>(inner);
    return true;
  }
  static handle cast(epx::py::Int64 src, return_value_policy /*policy*/, handle /*parent*/) {
    return PyLong_FromLongLong(src.value);
  }
};
}  // namespace pybind11::detail
