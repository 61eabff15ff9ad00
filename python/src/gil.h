// The GIL around C++ calls that may wait (STYLE.md, "Bindings").
#pragma once

#include <memory>
#include <type_traits>
#include <utility>

#include <pybind11/pybind11.h>

#include "errors.h"

namespace epx::py {

// Runs fn() without the GIL, then, with it again: for a Status, raises its
// error; for a Result<T>, returns the value or raises.
template <typename F>
auto call(F&& fn) {
  auto out = [&] {
    pybind11::gil_scoped_release release;
    return std::forward<F>(fn)();
  }();
  if constexpr (std::is_same_v<decltype(out), Status>) {
    check(out);
  } else {
    return unwrap(std::move(out));
  }
}

// Destroys `owned` (a buffer whose progress thread may wait) without the GIL,
// whether or not this thread holds it (atexit closers run without it).
template <typename T>
void reset_without_gil(std::unique_ptr<T>& owned) {
  if (!owned) return;
  if (PyGILState_Check() != 0) {
    pybind11::gil_scoped_release release;
    owned.reset();
  } else {
    owned.reset();
  }
}

}  // namespace epx::py
