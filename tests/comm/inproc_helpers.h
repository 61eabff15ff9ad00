// Small helpers shared by the in-process transport tests.
#pragma once

#include <chrono>

#include "epx/comm/topology.h"
#include "epx/core/clock.h"

namespace epx::comm_test {

inline Topology make_topology(int num_ranks, int num_nodes = 1) {
  Result<Topology> topology = Topology::create(num_ranks, num_nodes);
  EPX_CHECK(topology.is_ok());
  return *topology;
}

// A deadline no healthy test comes near.
inline Deadline generous() { return Deadline::after(std::chrono::seconds(30)); }

}  // namespace epx::comm_test
