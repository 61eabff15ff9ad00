#include "comm/group.h"

#include <algorithm>
#include <map>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/collective.h"

namespace epx::detail {
namespace {

// The world ranks of `t`'s ranks, or empty when they are its own ranks.
std::vector<int> world_ranks_of(const Transport& t) {
  std::vector<int> out(static_cast<std::size_t>(t.num_ranks()));
  bool identity = true;
  for (int r = 0; r < t.num_ranks(); ++r) {
    out[r] = t.world_rank(r);
    identity = identity && out[r] == r;
  }
  if (identity) out.clear();
  return out;
}

int world_of(std::span<const int> world_ranks, int rank) { return world_ranks.empty() ? rank : world_ranks[rank]; }

std::string join(const std::vector<int>& values) { return fmt::format("{}", fmt::join(values, ", ")); }

// Every color must be >= 0; the same verdict on every rank.
Status check_colors(std::span<const int32_t> colors_and_keys, std::span<const int> world_ranks) {
  for (std::size_t r = 0; r * 2 < colors_and_keys.size(); ++r) {
    const int32_t color = colors_and_keys[2 * r];
    if (color < 0)
      return invalid_argument("split: {} passed color {}; a color must be at least 0",
                              rank_name(static_cast<int>(r), world_ranks), color);
  }
  return Status::ok();
}

// color -> its members (parent ranks), ordered by (key, parent rank).
std::map<int, std::vector<int>> form_groups(std::span<const int32_t> colors_and_keys) {
  std::map<int, std::vector<std::pair<int32_t, int>>> keyed;
  for (std::size_t r = 0; r * 2 < colors_and_keys.size(); ++r)
    keyed[colors_and_keys[2 * r]].emplace_back(colors_and_keys[2 * r + 1], static_cast<int>(r));
  std::map<int, std::vector<int>> groups;
  for (auto& [color, members] : keyed) {
    std::sort(members.begin(), members.end());
    for (const auto& member : members) groups[color].push_back(member.second);
  }
  return groups;
}

// The number of nodes of a group whose ranks (in group order) live on
// `nodes`, or 0 when they are not node-major with the same count on each.
int count_group_nodes(const std::vector<int>& nodes) {
  std::vector<int> seen;
  std::vector<int> counts;
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    if (i > 0 && nodes[i] == nodes[i - 1]) {
      ++counts.back();
      continue;
    }
    if (std::find(seen.begin(), seen.end(), nodes[i]) != seen.end()) return 0;  // a node came back
    seen.push_back(nodes[i]);
    counts.push_back(1);
  }
  for (int count : counts) {
    if (count != counts.front()) return 0;
  }
  return static_cast<int>(seen.size());
}

std::string group_label(int color, const std::vector<int>& world_ranks) {
  return fmt::format("group {} (world {} {})", color, world_ranks.size() == 1 ? "rank" : "ranks", join(world_ranks));
}

}  // namespace

Topology GroupPlan::topology() const {
  Result<Topology> topology = Topology::create(static_cast<int>(members.size()), num_nodes);
  EPX_CHECK(topology.is_ok());
  return *topology;
}

std::string rank_name(int rank, std::span<const int> world_ranks) {
  if (world_ranks.empty()) return fmt::format("rank {}", rank);
  return fmt::format("rank {} (rank {} of the group)", world_ranks[rank], rank);
}

Result<GroupPlan> plan_split(Transport& parent, int color, int key, const Deadline& deadline) {
  const int num_ranks = parent.num_ranks();
  const int32_t mine[2] = {color, key};
  std::vector<int32_t> all(static_cast<std::size_t>(2 * num_ranks));
  EPX_RETURN_IF_ERROR(parent.all_gather(std::span<const int32_t>(mine), std::span<int32_t>(all), deadline));
  const std::vector<int> parent_world = world_ranks_of(parent);
  EPX_RETURN_IF_ERROR(check_colors(all, parent_world));

  GroupPlan plan;
  for (const auto& [group_color, members] : form_groups(all)) {
    std::vector<int> nodes;
    std::vector<int> world;
    for (int m : members) {
      nodes.push_back(parent.topology().node_of(m));
      world.push_back(world_of(parent_world, m));
    }
    const int num_nodes = count_group_nodes(nodes);
    if (num_nodes == 0)
      return invalid_argument(
          "split: {} lives on nodes {}; a group's ranks, ordered by (key, rank), must fill one node before the next, "
          "with the same number on each node",
          group_label(group_color, world), join(nodes));
    if (group_color != color) continue;
    plan.color = color;
    plan.rank = static_cast<int>(std::find(members.begin(), members.end(), parent.rank()) - members.begin());
    plan.members = members;
    plan.world_ranks = std::move(world);
    plan.num_nodes = num_nodes;
    plan.label = group_label(color, plan.world_ranks);
  }
  return plan;
}

}  // namespace epx::detail
