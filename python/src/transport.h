// The binding's transports, shared by the files that take one (Buffer,
// LowLatencyBuffer, routing): epx.Transport wraps a C++ Transport that
// Buffers keep alive by holding the PyTransport.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include <pybind11/pybind11.h>

#include "epx/comm/transport.h"

namespace epx::py {

struct PyTransport {
  std::unique_ptr<Transport> transport;  // null once closed (MPI, sockets: at interpreter exit)
  bool mpi = false;  // closed at interpreter exit: MPI or sockets
  // The transport; FailedPreconditionError once closed.
  Transport& get() const;
};

// Run at interpreter exit for MPI-backed objects, before the transports and
// the MPI session are closed (Buffers register their own close here).
void at_mpi_exit(std::function<void()> close);

// Closes `state->buffer` (a Buffer's or LowLatencyBuffer's state, which holds
// `transport` and `buffer`) at interpreter exit when its transport is MPI's.
template <typename State>
void close_at_mpi_exit(const std::shared_ptr<State>& state) {
  if (!state->transport->mpi) return;
  at_mpi_exit([weak = std::weak_ptr<State>(state)] {
    if (auto s = weak.lock()) s->buffer.reset();  // called without the GIL
  });
}

// Refuses a call that would corrupt data: aborts `transport` with `message`,
// so the peers fail at once instead of waiting, and raises epx.<error_class>.
[[noreturn]] void refuse_and_abort(const PyTransport& transport, std::string_view error_class,
                                   const std::string& message);

// Seconds (Python float, None = `fallback`) to a deadline.
Deadline deadline_after(pybind11::handle seconds, double fallback);

void register_transport(pybind11::module_& m);

}  // namespace epx::py
