#include "epx/comm/parallel_layout.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace epx {

Result<ParallelLayout> ParallelLayout::create(const Topology& topology, int ep) {
  const int R = topology.num_ranks(), per_node = topology.ranks_per_node();
  if (ep == 0) ep = R;
  if (ep < 1 || R % ep != 0)
    return invalid_argument("ep = {} must divide ranks = {} (EP groups of equal size)", ep, R);
  if (per_node % ep != 0 && ep % per_node != 0)
    return invalid_argument(
        "ep = {} splits nodes unevenly: with {} ranks per node, ep must divide {} or be a multiple of it (an EP group "
        "fills nodes before spanning them)",
        ep, per_node, per_node);
  return ParallelLayout(topology, ep);
}

std::vector<int> ParallelLayout::ep_members(int g) const {
  std::vector<int> out;
  for (int i = 0; i < ep_; ++i) out.push_back(g * ep_ + i);
  return out;
}

std::vector<int> ParallelLayout::edp_members(int j) const {
  std::vector<int> out;
  for (int r = j; r < num_ranks_; r += ep_) out.push_back(r);
  return out;
}

std::string ParallelLayout::describe_group(const char* kind, int index, const std::vector<int>& members) const {
  std::vector<int> nodes;
  for (int r : members)
    if (nodes.empty() || nodes.back() != topology_.node_of(r)) nodes.push_back(topology_.node_of(r));
  return fmt::format("{} group {}: ranks {} (node{} {})", kind, index, fmt::join(members, " "),
                     nodes.size() == 1 ? "" : "s", fmt::join(nodes, " "));
}

std::string ParallelLayout::describe() const {
  std::string text = fmt::format("{} rank{} on {}: EP {} x EDP {}", num_ranks_, num_ranks_ == 1 ? "" : "s",
                                 topology_.describe(), ep_, edp());
  for (int g = 0; g < edp(); ++g) text.append("\n").append(describe_group("EP", g, ep_members(g)));
  for (int j = 0; j < ep_; ++j) text.append("\n").append(describe_group("EDP", j, edp_members(j)));
  return text;
}

Result<ParallelGroups> split_parallel(Transport& world, const ParallelLayout& layout, const Deadline& deadline) {
  if (layout.num_ranks() != world.num_ranks())
    return invalid_argument("split_parallel: the layout is for {} ranks but the transport has {}", layout.num_ranks(),
                            world.num_ranks());
  const int rank = world.rank();
  ParallelGroups groups;
  EPX_ASSIGN_OR_RETURN(groups.ep, world.split(layout.ep_group(rank), layout.ep_rank(rank), deadline));
  EPX_ASSIGN_OR_RETURN(groups.edp, world.split(layout.edp_group(rank), layout.edp_rank(rank), deadline));
  return groups;
}

}  // namespace epx
