#include "epx/comm/topology.h"

namespace epx {

Result<Topology> Topology::create(int num_ranks, int num_nodes) {
  if (num_ranks < 1) return invalid_argument("num_ranks = {} must be at least 1", num_ranks);
  if (num_nodes < 1) return invalid_argument("num_nodes = {} must be at least 1", num_nodes);
  if (num_ranks % num_nodes != 0)
    return invalid_argument("num_ranks = {} is not a multiple of num_nodes = {}", num_ranks, num_nodes);
  return Topology(num_ranks, num_nodes);
}

std::string Topology::describe() const {
  return fmt::format("{} node{} x {} rank{}", num_nodes_, num_nodes_ == 1 ? "" : "s", ranks_per_node_,
                     ranks_per_node_ == 1 ? "" : "s");
}

}  // namespace epx
