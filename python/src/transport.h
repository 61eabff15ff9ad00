// The binding's transports, shared by the files that take one (Buffer,
// LowLatencyBuffer, routing): epx.Transport wraps a C++ Transport that
// Buffers keep alive by holding the PyTransport.
#pragma once

#include <functional>
#include <memory>

#include <pybind11/pybind11.h>

#include "epx/comm/transport.h"

namespace epx::py {

struct PyTransport {
  std::unique_ptr<Transport> transport;  // null once closed (MPI, at interpreter exit)
  bool mpi = false;
  // The transport; FailedPreconditionError once closed.
  Transport& get() const;
};

// Run at interpreter exit for MPI-backed objects, before the transports and
// the MPI session are closed (Buffers register their own close here).
void at_mpi_exit(std::function<void()> close);

// Seconds (Python float, None = `fallback`) to a deadline.
Deadline deadline_after(pybind11::handle seconds, double fallback);

void register_transport(pybind11::module_& m);

}  // namespace epx::py
