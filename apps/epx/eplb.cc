// `epx eplb`: a redundant-expert placement for measured per-expert loads.
#include <cmath>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "commands.h"
#include "epx/balance/placement.h"

namespace epx::app {

namespace {

// One number per line, or several separated by whitespace or commas.
Result<std::vector<double>> read_loads(const std::string& path) {
  std::ifstream in(path);
  if (!in) return invalid_argument("cannot open --loads file '{}'", path);
  std::vector<double> loads;
  std::string line;
  for (int line_no = 1; std::getline(in, line); ++line_no) {
    for (char& ch : line)
      if (ch == ',') ch = ' ';
    std::istringstream words(line);
    std::string word;
    while (words >> word) {
      size_t used = 0;
      double value = 0;
      bool parsed = true;
      try {
        value = std::stod(word, &used);
      } catch (const std::exception&) {
        parsed = false;
      }
      if (!parsed || used != word.size() || !std::isfinite(value))
        return invalid_argument("{}:{}: '{}' is not a finite number", path, line_no, word);
      if (value < 0) return invalid_argument("{}:{}: load {} is negative; loads must be >= 0", path, line_no, word);
      loads.push_back(value);
    }
  }
  if (loads.empty()) return invalid_argument("--loads file '{}' holds no numbers", path);
  return loads;
}

std::string policy_name(PlacementPolicy p) { return p == PlacementPolicy::kHierarchical ? "hierarchical" : "global"; }

}  // namespace

int run_eplb(const EplbOptions& o) {
  auto fail = [](const Status& s) {
    fmt::print(stderr, "epx eplb: {}\n", s.message());
    return kExitUsage;
  };
  auto loads = read_loads(o.loads_path);
  if (!loads.is_ok()) return fail(loads.status());
  const int num_experts = static_cast<int>(loads->size());
  const int num_ranks = o.num_nodes * o.ranks_per_node;
  const PlacementConfig config{.num_slots = o.num_slots, .num_nodes = o.num_nodes, .ranks_per_node = o.ranks_per_node,
                               .num_groups = o.num_groups,
                               .policy = o.policy == "global" ? PlacementPolicy::kGlobal : PlacementPolicy::kHierarchical};
  auto placement = place_experts(*loads, config);
  if (!placement.is_ok()) return fail(placement.status());

  // Before: one replica per expert in contiguous blocks, when the ranks divide the experts.
  auto before = contiguous_placement(num_experts, num_ranks);
  const bool has_before = before.is_ok();
  const double before_balance = has_before ? balance(rank_loads(*before, *loads)) : 0.0;
  const auto after_loads = rank_loads(*placement, *loads);
  const double after_balance = balance(after_loads);
  // Moved bytes: each replica on a rank that does not hold its expert under
  // the contiguous layout (all of them when there is no contiguous layout).
  int64_t moved = 0;
  for (int s = 0; s < placement->num_slots(); ++s) {
    const int e = placement->slot_expert()[s];
    if (e < 0) continue;
    if (!has_before || e / (num_experts / num_ranks) != placement->rank_of_slot(s)) moved += o.expert_bytes;
  }

  const int spr = placement->slots_per_rank();
  if (o.json) {
    nlohmann::json j;
    j["num_experts"] = num_experts;
    j["num_slots"] = placement->num_slots();
    j["num_ranks"] = num_ranks;
    j["policy"] = policy_name(placement->policy());
    j["slot_expert"] = placement->slot_expert();
    j["slot_rank"] = placement->slot_rank();
    j["replica_counts"] = placement->replica_counts();
    j["rank_loads"] = after_loads;
    j["balance_before"] = has_before ? nlohmann::json(before_balance) : nlohmann::json(nullptr);
    j["balance_after"] = after_balance;
    j["expert_bytes"] = o.expert_bytes;
    j["moved_bytes"] = moved;
    fmt::print("{}\n", j.dump());
    return kExitOk;
  }
  fmt::print("{} experts, {} slots over {} ranks ({} nodes x {}), policy {}\n", num_experts, placement->num_slots(),
             num_ranks, o.num_nodes, o.ranks_per_node, policy_name(placement->policy()));
  for (int r = 0; r < num_ranks; ++r) {
    std::string row;
    for (int j = 0; j < spr; ++j) {
      const int e = placement->slot_expert()[r * spr + j];
      row += e < 0 ? " -" : fmt::format(" {}", e);
    }
    fmt::print("rank {:>3} (slots {:>4}..{:<4}) load {:>12.4g}  experts:{}\n", r, r * spr, (r + 1) * spr - 1,
               after_loads[r], row);
  }
  std::string counts;
  for (int e = 0; e < num_experts; ++e)
    if (placement->num_replicas(e) > 1) counts += fmt::format(" {}:{}", e, placement->num_replicas(e));
  fmt::print("replicas above 1 (expert:count):{}\n", counts.empty() ? " none" : counts);
  if (has_before)
    fmt::print("balance (max/mean per rank): before {:.4f} (one replica each, contiguous), after {:.4f}\n",
               before_balance, after_balance);
  else
    fmt::print("balance (max/mean per rank): after {:.4f} (no contiguous before: {} ranks do not divide {} experts)\n",
               after_balance, num_ranks, num_experts);
  fmt::print("moved bytes from the contiguous layout: {} ({} per expert)\n", moved, o.expert_bytes);
  return kExitOk;
}

}  // namespace epx::app
