// Topology: how ranks are grouped into nodes.
//
// Ranks are numbered node-major: node n holds ranks [n * ranks_per_node,
// (n + 1) * ranks_per_node). Inside a node ranks share memory (peer-mapped
// buffers); between nodes they exchange messages.
//
//   EPX_ASSIGN_OR_RETURN(auto topo, epx::Topology::create(/*num_ranks=*/8, /*num_nodes=*/2));
//   topo.node_of(5);        // 1
//   topo.local_rank_of(5);  // 1
//   topo.rank_of(1, 1);     // 5
#pragma once

#include <string>

#include "epx/core/status.h"

namespace epx {

class Topology {
 public:
  // InvalidArgument unless num_ranks >= 1, num_nodes >= 1 and num_nodes divides num_ranks.
  static Result<Topology> create(int num_ranks, int num_nodes = 1);

  [[nodiscard]] int num_ranks() const { return num_ranks_; }
  [[nodiscard]] int num_nodes() const { return num_nodes_; }
  [[nodiscard]] int ranks_per_node() const { return ranks_per_node_; }
  [[nodiscard]] int node_of(int rank) const { return rank / ranks_per_node_; }
  [[nodiscard]] int local_rank_of(int rank) const { return rank % ranks_per_node_; }
  [[nodiscard]] int rank_of(int node, int local_rank) const { return node * ranks_per_node_ + local_rank; }
  [[nodiscard]] bool same_node(int a, int b) const { return node_of(a) == node_of(b); }
  // "2 nodes x 4 ranks".
  [[nodiscard]] std::string describe() const;

 private:
  Topology(int num_ranks, int num_nodes)
      : num_ranks_(num_ranks), num_nodes_(num_nodes), ranks_per_node_(num_ranks / num_nodes) {}
  int num_ranks_;
  int num_nodes_;
  int ranks_per_node_;
};

}  // namespace epx
