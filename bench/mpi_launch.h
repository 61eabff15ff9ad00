// How the MPI benchmarks start: one rank per process, on the real hosts or
// on emulated nodes.
#pragma once

#include <memory>

#include <fmt/format.h>

#include "epx/comm/mpi.h"
#include "epx/comm/transport.h"

namespace epx::bench {

// Initialises MPI and connects this process's rank; `nodes` 1 = the real
// hosts, more = the processes split into that many emulated nodes (it must
// divide them). Returns 0, or prints why not and returns the exit code: 2
// for a bad --nodes, 1 for a failure. Declare `*session` before
// `*transport`, so the transport goes first.
inline int connect_mpi_rank(int* argc, char*** argv, int nodes, std::unique_ptr<MpiSession>* session,
                            std::unique_ptr<Transport>* transport) {
  auto opened = MpiSession::init(argc, argv);
  if (!opened.is_ok()) {
    fmt::print(stderr, "{}\n", opened.status().to_string());
    return 1;
  }
  *session = std::move(opened).value();
  const int R = (*session)->world_size();
  if (nodes < 1 || R % nodes != 0) {
    fmt::print(stderr, "--nodes {} must divide the {} processes\n", nodes, R);
    return 2;
  }
  MpiOptions options;
  options.ranks_per_node = nodes > 1 ? R / nodes : 0;
  auto connected = (*session)->connect(options);
  if (!connected.is_ok()) {
    fmt::print(stderr, "{}\n", connected.status().to_string());
    return 1;
  }
  *transport = std::move(connected).value();
  return 0;
}

}  // namespace epx::bench
