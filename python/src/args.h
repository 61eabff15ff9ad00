// Integer lists from Python (lists, tuples, numpy arrays, torch tensors).
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include <pybind11/pybind11.h>

#include "arrays.h"

namespace epx::py {

// A list, tuple, numpy array or torch tensor of integers (int32 or int64,
// 1-D) as a vector of T; `*kind` (when given) gets the library of an array
// (numpy for a list). InvalidArgumentError naming `name` otherwise, or for a
// value outside T.
template <typename T>
std::vector<T> int_vector(pybind11::handle obj, std::string_view name, ArrayKind* kind = nullptr);
extern template std::vector<int32_t> int_vector<int32_t>(pybind11::handle, std::string_view, ArrayKind*);
extern template std::vector<int64_t> int_vector<int64_t>(pybind11::handle, std::string_view, ArrayKind*);

}  // namespace epx::py
