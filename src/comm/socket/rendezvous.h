// The socket backend's rendezvous (private): every rank's entry through the
// store, the node-major numbering, and one TCP connection per pair of ranks.
#pragma once

#include <string>
#include <vector>

#include "comm/socket/engine.h"
#include "epx/comm/socket.h"
#include "epx/comm/topology.h"

namespace epx::socket_detail {

struct Mesh {
  int rank = 0;                // this rank, node-major
  Topology topology = *Topology::create(1);
  std::vector<PeerInfo> peers;  // by rank
  std::vector<int> fds;         // by rank: the connection to it (-1 for this rank)
  std::string job;              // unique to the run (rank 0's pid and port)
};

// Collective over every process; bounded by options.setup_timeout.
Result<Mesh> rendezvous(KeyValueStore& store, const SocketOptions& options);

}  // namespace epx::socket_detail
