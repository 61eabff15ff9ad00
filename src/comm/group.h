// What every backend's Transport::split shares (private): gathering every
// rank's (color, key), forming the groups and checking their layout, so that
// every rank reaches the same verdict from the same data.
//
// A group's ranks are the parent ranks with its color, numbered by (key,
// parent rank). They must be node-major with the same count on each of their
// nodes, so the group has a Topology of its own (nodes x local ranks) whose
// "same node" agrees with the parent's: peer memory stays inside a node.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "epx/comm/topology.h"
#include "epx/comm/transport.h"
#include "epx/core/status.h"

namespace epx::detail {

// The group of the calling rank, as every rank computed it.
struct GroupPlan {
  int color = 0;
  int rank = 0;                  // the caller's rank in the group
  std::vector<int> members;      // parent ranks, in group-rank order
  std::vector<int> world_ranks;  // the same ranks as world ranks
  int num_nodes = 1;             // the parent nodes the members live on (the group's nodes, in order)
  std::string label;             // "group 1 (world ranks 4, 5, 6, 7)"

  // The group's topology: members.size() ranks on num_nodes nodes.
  [[nodiscard]] Topology topology() const;
};

// Collective over `parent`: gathers every rank's (color, key) and plans the
// caller's group. InvalidArgument on every rank when a color is negative or a
// group is not node-major with the same count on each of its nodes (the
// message names the group, its world ranks and their nodes).
Result<GroupPlan> plan_split(Transport& parent, int color, int key, const Deadline& deadline);

// How errors name rank `rank` of a transport whose ranks are `world_ranks`
// (empty for a world): "rank 5 (rank 1 of the group)", or "rank 1".
std::string rank_name(int rank, std::span<const int> world_ranks);

}  // namespace epx::detail
