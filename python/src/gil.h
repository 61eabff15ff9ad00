// The GIL around C++ calls that may wait (STYLE.md, "Bindings").
#pragma once

#include <memory>
#include <utility>

#include <pybind11/pybind11.h>

#include "errors.h"

namespace epx::py {

// Runs fn() (returning a Status) without the GIL, then raises its error.
template <typename F>
void call(F&& fn) {
  Status status;
  {
    pybind11::gil_scoped_release release;
    status = std::forward<F>(fn)();
  }
  check(status);
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
