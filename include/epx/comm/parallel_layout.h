// ParallelLayout: how the ranks of a training run form expert-parallel (EP)
// and expert-data-parallel (EDP) groups.
//
// R ranks, EP size `ep` (it divides R): R / ep EP groups, each holding every
// expert once, data-parallel to each other. EP group g is the ranks
// [g * ep, (g + 1) * ep): ranks are numbered node-major, so an EP group fills
// nodes before it spans them (its exchange stays inside a node while it can).
// EDP group j is the ranks {j, j + ep, j + 2 ep, ...}: the ranks that hold
// the same experts, among which expert gradients are summed.
//
//   8 ranks on 2 nodes, ep = 4:  EP groups {0 1 2 3} {4 5 6 7}  (one per node)
//                                EDP groups {0 4} {1 5} {2 6} {3 7}
//
// Each group must have the same number of ranks on each of its nodes (what a
// Transport group needs): ep divides the ranks per node, or the ranks per node
// divide ep. InvalidArgument naming the numbers otherwise.
//
//   EPX_ASSIGN_OR_RETURN(auto layout, epx::ParallelLayout::create(topology, /*ep=*/4));
//   layout.ep_group(5);   // 1
//   layout.edp_group(5);  // 1 (= the rank's place in its EP group)
//   EPX_ASSIGN_OR_RETURN(auto groups, epx::split_parallel(world, layout, deadline));
//   groups.ep->rank();    // 1 on world rank 5
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "epx/comm/topology.h"
#include "epx/comm/transport.h"
#include "epx/core/clock.h"
#include "epx/core/status.h"

namespace epx {

class ParallelLayout {
 public:
  // ep = 0: one EP group of all ranks.
  static Result<ParallelLayout> create(const Topology& topology, int ep);

  [[nodiscard]] int num_ranks() const { return num_ranks_; }
  [[nodiscard]] int ep() const { return ep_; }            // ranks per EP group
  [[nodiscard]] int edp() const { return num_ranks_ / ep_; }  // EP groups = ranks per EDP group
  // The EP group of `rank` and its place in it (its rank in the EP group's transport).
  [[nodiscard]] int ep_group(int rank) const { return rank / ep_; }
  [[nodiscard]] int ep_rank(int rank) const { return rank % ep_; }
  // The EDP group of `rank` (its place in its EP group) and its place in the
  // EDP group (its EP group).
  [[nodiscard]] int edp_group(int rank) const { return rank % ep_; }
  [[nodiscard]] int edp_rank(int rank) const { return rank / ep_; }
  // The world ranks of EP group g / EDP group j, in group-rank order.
  [[nodiscard]] std::vector<int> ep_members(int g) const;
  [[nodiscard]] std::vector<int> edp_members(int j) const;
  // "4 ranks: EP 2 x EDP 2", then one line per group:
  // "EP group 0: ranks 0 1 (node 0)" ... "EDP group 0: ranks 0 2 (nodes 0 1)".
  [[nodiscard]] std::string describe() const;

 private:
  ParallelLayout(const Topology& topology, int ep) : topology_(topology), num_ranks_(topology.num_ranks()), ep_(ep) {}
  std::string describe_group(const char* kind, int index, const std::vector<int>& members) const;
  Topology topology_;
  int num_ranks_;
  int ep_;
};

// The calling rank's two groups: its EP group (rank = ep_rank) and its EDP
// group (rank = edp_rank). Destroy them before the world they came from.
struct ParallelGroups {
  std::unique_ptr<Transport> ep;
  std::unique_ptr<Transport> edp;
};

// Collective over `world` (two splits, EP then EDP). InvalidArgument, without
// communicating, when the layout is not for world's number of ranks; the
// split's errors otherwise (see Transport::split).
Result<ParallelGroups> split_parallel(Transport& world, const ParallelLayout& layout, const Deadline& deadline);

}  // namespace epx
