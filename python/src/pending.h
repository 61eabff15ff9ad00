// epx.PendingOp: an asynchronous operation from Python (Buffer's and
// LowLatencyBuffer's *_async forms). wait(timeout=None) returns the
// operation's result, built with the GIL once it succeeded; done() does not
// block. The arguments stay referenced until the operation ends; a dropped
// PendingOp waits for its operation first (without the GIL).
#pragma once

#include <functional>
#include <vector>

#include <pybind11/pybind11.h>

#include "epx/exchange/buffer.h"

namespace epx::py {

// A PendingOp object for `op`: `keep` is held until it ends, `finish` builds
// wait()'s result.
pybind11::object pending(PendingOp op, std::vector<pybind11::object> keep, std::function<pybind11::object()> finish);

void register_pending(pybind11::module_& m);

}  // namespace epx::py
