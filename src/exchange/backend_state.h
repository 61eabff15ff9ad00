// Private: the state every exchange backend's Impl begins with (Buffer,
// LowLatencyBuffer, CudaBuffer): its transport, its checked configuration
// and expert placement, the group's topology, which Buffer it is (the id
// every rank agrees on, stamped into each handle) and how many dispatches it
// has run, this rank's place, the row sizes of its regions, and the peer
// memory that holds them. Each backend adds what is its own (regions,
// staging, streams) and fills these in its create.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "epx/comm/transport.h"
#include "epx/exchange/placement.h"

namespace epx::detail {

template <typename Config>
struct BackendState {
  BackendState(Transport& t, Config c, ExpertPlacement p)
      : transport(t), config(std::move(c)), placement(std::move(p)), topology(t.topology()) {}

  Transport& transport;
  Config config;
  ExpertPlacement placement;
  Topology topology;
  uint64_t id = 0;
  int64_t dispatch_seq = 0;  // dispatches so far; collective, so equal on every rank
  int rank = 0;
  int num_ranks = 0;
  std::size_t row_bytes = 0;          // one dispatch row
  std::size_t combine_row_bytes = 0;  // one combine row
  std::unique_ptr<PeerMemory> memory;
};

}  // namespace epx::detail
