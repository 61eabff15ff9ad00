// `epx eplb`: a redundant-expert placement for measured per-expert loads, or
// (--current) a rebalance of the placement in use.
#include <cmath>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli_checks.h"
#include "commands.h"
#include "eplb.h"
#include "epx/core/input_file.h"
#include "epx/observe/output_path.h"

namespace epx::app {

namespace {

// The sum of the loads stays below this, so the balance arithmetic (sums
// over ranks, max / mean) stays finite.
constexpr double kMaxLoadSum = 1e300;

// One load: a finite number >= 0.
Result<double> parse_load(const std::string& path, int line_no, const std::string& word) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(word, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != word.size() || !std::isfinite(value))
    return invalid_argument("{}:{}: '{}' is not a finite number", path, line_no, word);
  if (value < 0) return invalid_argument("{}:{}: load {} is negative; loads must be >= 0", path, line_no, word);
  return value;
}

// The comma-separated fields of a line, trimmed; an empty one (",,", a
// leading or trailing comma) is an error, not a missing expert skipped.
Result<std::vector<std::string>> split_fields(const std::string& path, int line_no, const std::string& line) {
  std::vector<std::string> words;
  std::istringstream fields(line);
  std::string field;
  const bool has_comma = line.find(',') != std::string::npos;
  int index = 0;
  while (std::getline(fields, field, ',')) {
    std::istringstream parts(field);
    std::string word;
    int in_field = 0;
    while (parts >> word) {
      words.push_back(word);
      ++in_field;
    }
    if (has_comma && in_field == 0)
      return invalid_argument("{}:{}: field {} is empty (every expert needs a load)", path, line_no, index + 1);
    ++index;
  }
  if (has_comma && !line.empty() && line.find_last_not_of(" \t\r") != std::string::npos &&
      line[line.find_last_not_of(" \t\r")] == ',')
    return invalid_argument("{}:{}: field {} is empty (every expert needs a load)", path, line_no, index + 1);
  return words;
}

}  // namespace

// One number per line, or several separated by whitespace or commas.
Result<std::vector<double>> parse_loads(std::istream& in, const std::string& path) {
  std::vector<double> loads;
  double sum = 0;
  std::string line;
  for (int line_no = 1; std::getline(in, line); ++line_no) {
    EPX_ASSIGN_OR_RETURN(std::vector<std::string> words, split_fields(path, line_no, line));
    for (const std::string& word : words) {
      EPX_ASSIGN_OR_RETURN(double value, parse_load(path, line_no, word));
      sum += value;
      if (!(sum <= kMaxLoadSum))
        return invalid_argument("{}:{}: load {} brings the sum of the loads above the limit {:g}; scale the loads down",
                                path, line_no, word, kMaxLoadSum);
      loads.push_back(value);
    }
  }
  if (loads.empty()) return invalid_argument("--loads file '{}' holds no numbers", path);
  return loads;
}

// The slot -> expert map of a placement file: ids in slot order, separated by
// whitespace or commas, -1 for an empty slot, '#' to the end of a line a
// comment. Each id is checked against the experts, and against the ids
// already on its rank, where it stands (file and line).
Result<RedundantPlacement> parse_placement(std::istream& in, const std::string& path, int num_experts, int num_slots,
                                           int num_ranks, PlacementPolicy policy) {
  const int slots_per_rank = num_slots % num_ranks == 0 ? num_slots / num_ranks : 0;
  std::vector<int32_t> slot_expert;
  std::vector<int> last_slot_of(static_cast<std::size_t>(num_experts), -1);  // expert -> the last slot holding it
  std::string line;
  for (int line_no = 1; std::getline(in, line); ++line_no) {
    line = line.substr(0, line.find('#'));
    for (char& ch : line)
      if (ch == ',') ch = ' ';
    std::istringstream words(line);
    std::string word;
    while (words >> word) {
      const int slot = static_cast<int>(slot_expert.size());
      size_t used = 0;
      long long value = 0;
      bool parsed = true;
      try {
        value = std::stoll(word, &used);
      } catch (const std::exception&) {
        parsed = false;
      }
      if (!parsed || used != word.size())
        return invalid_argument("{}:{}: '{}' (slot {}) is not an integer expert id", path, line_no, word, slot);
      if (slot >= num_slots)
        return invalid_argument("{}:{}: '{}' would be slot {}, but --slots is {} (slots 0..{})", path, line_no, word,
                                slot, num_slots, num_slots - 1);
      if (value < -1 || value >= num_experts)
        return invalid_argument("{}:{}: slot {} holds expert {}, outside [-1, {}) (the --loads file has {} experts)",
                                path, line_no, slot, value, num_experts, num_experts);
      const int other = value >= 0 ? last_slot_of[static_cast<std::size_t>(value)] : -1;
      if (slots_per_rank > 0 && other >= 0 && other / slots_per_rank == slot / slots_per_rank)
        return invalid_argument("{}:{}: slot {} holds expert {}, which rank {} already holds in slot {} (at most one "
                                "replica per rank)",
                                path, line_no, slot, value, slot / slots_per_rank, other);
      if (value >= 0) last_slot_of[static_cast<std::size_t>(value)] = slot;
      slot_expert.push_back(static_cast<int32_t>(value));
    }
  }
  if (static_cast<int>(slot_expert.size()) != num_slots)
    return invalid_argument("--current file '{}' holds {} slots; --slots is {}", path, slot_expert.size(), num_slots);
  auto placement = RedundantPlacement::from_slot_map(std::move(slot_expert), num_experts, num_ranks, policy);
  if (!placement.is_ok())
    return invalid_argument("--current file '{}': {}", path, placement.status().message());
  return placement;
}

namespace {

Result<std::vector<double>> read_loads(const std::string& path) {
  EPX_ASSIGN_OR_RETURN(std::string text, read_input_file(path, "the --loads file", kMaxTableBytes));
  std::istringstream in(std::move(text));
  return parse_loads(in, path);
}

Result<RedundantPlacement> read_placement(const std::string& path, int num_experts, int num_slots, int num_ranks,
                                          PlacementPolicy policy) {
  EPX_ASSIGN_OR_RETURN(std::string text, read_input_file(path, "the --current file", kMaxTableBytes));
  std::istringstream in(std::move(text));
  return parse_placement(in, path, num_experts, num_slots, num_ranks, policy);
}

// The format read_placement reads: a comment head, then one line per rank.
Status write_placement(const std::string& path, const RedundantPlacement& p, int num_nodes, int ranks_per_node) {
  std::ofstream out(path);
  if (!out) return invalid_argument("cannot write --save file '{}'", path);
  out << fmt::format("# epx eplb placement: {} experts, {} slots, {} ranks ({} nodes x {}), {} slots per rank\n",
                     p.num_experts(), p.num_slots(), p.num_ranks(), num_nodes, ranks_per_node, p.slots_per_rank());
  out << "# one line per rank: the logical expert of each of its slots, in slot order (-1 = empty)\n";
  const int spr = p.slots_per_rank();
  for (int r = 0; r < p.num_ranks(); ++r) {
    std::string row;
    for (int j = 0; j < spr; ++j) row += fmt::format("{}{}", j ? " " : "", p.slot_expert()[r * spr + j]);
    out << row << "  # rank " << r << "\n";
  }
  out.close();
  if (!out) return invalid_argument("writing --save file '{}' failed", path);
  return Status::ok();
}

std::string policy_name(PlacementPolicy p) { return p == PlacementPolicy::kHierarchical ? "hierarchical" : "global"; }

}  // namespace

CLI::App* add_eplb_command(CLI::App& app, EplbOptions& o) {
  CLI::App* cmd = app.add_subcommand(
      "eplb",
      "A redundant-expert placement (EPLB-style) for measured per-expert loads: slot -> expert per rank, replica "
      "counts, balance (max/mean per rank) before and after, bytes moved. With --current FILE: rebalance that "
      "placement for the loads, moving as few expert weights as the balance allows");
  cmd->add_option("--loads", o.loads_path, "File of per-expert loads: one per line, or whitespace/comma separated")
      ->required();
  cmd->add_option("--slots", o.num_slots, "Physical expert slots; >= experts and a multiple of the ranks")
      ->required()
      ->transform(in_range(1, 1 << 20));
  cmd->add_option("--nodes", o.num_nodes, "Nodes")->required()->transform(in_range(1, 4096));
  cmd->add_option("--ranks-per-node", o.ranks_per_node, "Ranks per node")->required()->transform(in_range(1, 4096));
  cmd->add_option("--groups", o.num_groups, "Expert groups (must divide the experts); 0 = none")
      ->transform(in_range(0, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--expert-bytes", o.expert_bytes, "Bytes of one expert's weights, for the moved bytes")
      ->transform(in_range(int64_t{0}, int64_t{1} << 50))
      ->capture_default_str();
  cmd->add_option("--policy", o.policy,
                  "hierarchical (groups packed onto nodes; needs --groups a multiple of --nodes, else global) "
                  "or global")
      ->check(CLI::IsMember({"hierarchical", "global"}))
      ->capture_default_str();
  CLI::Option* current = cmd->add_option(
      "--current", o.current_path,
      "Rebalance mode: a file holding the current placement, the logical expert of every physical "
      "slot in slot order (-1 = empty; whitespace, commas or newlines between ids; '#' starts a "
      "comment), as --save writes it. Prints a new placement of near-equal balance that moves few "
      "expert weights, the balance now / rebalanced / from scratch, and the bytes the rebalance "
      "moves against placing from scratch");
  cmd->add_option("--tolerance", o.tolerance,
                  "Rebalance mode: accept a balance up to (1 + this) x the from-scratch placement's")
      ->transform(in_range(0.0, 10.0))
      ->needs(current)
      ->capture_default_str();
  cmd->add_option("--save", o.save_path,
                  "Write the printed placement (from scratch, or rebalanced with --current) to this file, one "
                  "line per rank; --current reads it back");
  cmd->add_flag("--json", o.json, "Print one JSON object instead of the text report");
  return cmd;
}

namespace {

// The placements `epx eplb` compares: from scratch, and with --current the
// placement in use and its rebalance.
struct EplbPlacements {
  std::vector<double> loads;
  std::optional<RedundantPlacement> scratch;
  std::optional<RedundantPlacement> current;
  std::optional<RebalancePlan> plan;

  bool rebalancing() const { return plan.has_value(); }
  const RedundantPlacement& chosen() const { return plan ? plan->placement : *scratch; }
};

// Reads the loads (and --current), places from scratch and, with --current, rebalances.
Result<EplbPlacements> place_for_loads(const EplbOptions& o) {
  EplbPlacements p;
  EPX_ASSIGN_OR_RETURN(p.loads, read_loads(o.loads_path));
  const int num_experts = static_cast<int>(p.loads.size());
  const int num_ranks = o.num_nodes * o.ranks_per_node;
  const PlacementConfig config{.num_slots = o.num_slots, .num_nodes = o.num_nodes, .ranks_per_node = o.ranks_per_node,
                               .num_groups = o.num_groups,
                               .policy = o.policy == "global" ? PlacementPolicy::kGlobal : PlacementPolicy::kHierarchical};
  EPX_ASSIGN_OR_RETURN(p.scratch, place_experts(p.loads, config));
  if (o.current_path.empty()) return p;
  // Rebalance mode: the current placement, and the plan that moves few weights.
  EPX_ASSIGN_OR_RETURN(p.current, read_placement(o.current_path, num_experts, o.num_slots, num_ranks, config.policy));
  EPX_ASSIGN_OR_RETURN(p.plan, rebalance(*p.current, p.loads, config, o.expert_bytes, o.tolerance));
  return p;
}

// The balance and the moved slots of the chosen placement against its before.
struct EplbFigures {
  int num_experts = 0;
  int num_ranks = 0;
  std::vector<double> after_loads;
  double after_balance = 0;
  bool has_before = false;
  double before_balance = 0;
  int moved = 0;
  int scratch_moved = 0;
  int64_t moved_bytes_total = 0;
  int64_t scratch_bytes = 0;
  double scratch_balance = 0;
};

EplbFigures measure_placements(const EplbPlacements& p, const EplbOptions& o) {
  EplbFigures f;
  f.num_experts = static_cast<int>(p.loads.size());
  f.num_ranks = o.num_nodes * o.ranks_per_node;
  const RedundantPlacement& placement = p.chosen();
  f.after_loads = rank_loads(placement, p.loads);
  f.after_balance = balance(f.after_loads);
  // Before: the current placement, else one replica per expert in contiguous
  // blocks when the ranks divide the experts.
  auto contiguous = contiguous_placement(f.num_experts, f.num_ranks);
  const RedundantPlacement* before = p.rebalancing() ? &*p.current : contiguous.is_ok() ? &*contiguous : nullptr;
  f.has_before = before != nullptr;
  f.before_balance = before ? balance(rank_loads(*before, p.loads)) : 0.0;
  // Moved slots: replicas on a rank that does not hold their expert before (all
  // of them when there is no before). Rebalance mode: slots whose expert changes.
  if (p.rebalancing()) {
    f.moved = p.plan->num_moved_slots;
    f.scratch_moved = static_cast<int>(moved_bytes(*p.current, *p.scratch, 1));
  } else {
    for (int s = 0; s < placement.num_slots(); ++s) {
      const int e = placement.slot_expert()[s];
      if (e < 0) continue;
      if (!before || e / (f.num_experts / f.num_ranks) != placement.rank_of_slot(s)) ++f.moved;
    }
  }
  f.moved_bytes_total = static_cast<int64_t>(f.moved) * o.expert_bytes;
  f.scratch_bytes = static_cast<int64_t>(f.scratch_moved) * o.expert_bytes;
  f.scratch_balance = balance(rank_loads(*p.scratch, p.loads));
  return f;
}

void print_eplb_json(const EplbOptions& o, const EplbPlacements& p, const EplbFigures& f) {
  const RedundantPlacement& placement = p.chosen();
  nlohmann::json j;
  j["mode"] = p.rebalancing() ? "rebalance" : "place";
  j["num_experts"] = f.num_experts;
  j["num_slots"] = placement.num_slots();
  j["num_ranks"] = f.num_ranks;
  j["policy"] = policy_name(placement.policy());
  j["slot_expert"] = placement.slot_expert();
  j["slot_rank"] = placement.slot_rank();
  j["replica_counts"] = placement.replica_counts();
  j["rank_loads"] = f.after_loads;
  j["balance_before"] = f.has_before ? nlohmann::json(f.before_balance) : nlohmann::json(nullptr);
  j["balance_after"] = f.after_balance;
  j["expert_bytes"] = o.expert_bytes;
  j["moved_slots"] = f.moved;
  j["moved_bytes"] = f.moved_bytes_total;
  if (p.rebalancing()) {
    j["current"] = o.current_path;
    j["tolerance"] = o.tolerance;
    j["balance_scratch"] = f.scratch_balance;
    j["scratch_moved_slots"] = f.scratch_moved;
    j["scratch_moved_bytes"] = f.scratch_bytes;
  }
  if (!o.save_path.empty()) j["saved"] = o.save_path;
  fmt::print("{}\n", j.dump());
}

// One line per rank: its slots, its load, its experts; then the replica counts above 1.
void print_rank_table(const RedundantPlacement& placement, const EplbFigures& f) {
  const int spr = placement.slots_per_rank();
  for (int r = 0; r < f.num_ranks; ++r) {
    std::string row;
    for (int j = 0; j < spr; ++j) {
      const int e = placement.slot_expert()[r * spr + j];
      row += e < 0 ? " -" : fmt::format(" {}", e);
    }
    fmt::print("rank {:>3} (slots {:>4}..{:<4}) load {:>12.4g}  experts:{}\n", r, r * spr, (r + 1) * spr - 1,
               f.after_loads[r], row);
  }
  std::string counts;
  for (int e = 0; e < f.num_experts; ++e)
    if (placement.num_replicas(e) > 1) counts += fmt::format(" {}:{}", e, placement.num_replicas(e));
  fmt::print("replicas above 1 (expert:count):{}\n", counts.empty() ? " none" : counts);
}

void print_eplb_text(const EplbOptions& o, const EplbPlacements& p, const EplbFigures& f) {
  const RedundantPlacement& placement = p.chosen();
  fmt::print("{} experts, {} slots over {} ranks ({} nodes x {}), policy {}{}\n", f.num_experts, placement.num_slots(),
             f.num_ranks, o.num_nodes, o.ranks_per_node, policy_name(placement.policy()),
             p.rebalancing() ? fmt::format("; rebalanced from {}", o.current_path) : "");
  print_rank_table(placement, f);
  if (p.rebalancing()) {
    fmt::print("balance (max/mean per rank): current {:.4f}, rebalanced {:.4f}, from scratch {:.4f} (tolerance {:g}%)\n",
               f.before_balance, f.after_balance, f.scratch_balance, 100 * o.tolerance);
    fmt::print("moved: rebalance {} of {} slots, {} bytes; from scratch {} slots, {} bytes ({} per expert)\n", f.moved,
               placement.num_slots(), f.moved_bytes_total, f.scratch_moved, f.scratch_bytes, o.expert_bytes);
  } else {
    if (f.has_before)
      fmt::print("balance (max/mean per rank): before {:.4f} (one replica each, contiguous), after {:.4f}\n",
                 f.before_balance, f.after_balance);
    else
      fmt::print(
          "balance (max/mean per rank): after {:.4f} (no contiguous before: {} ranks do not divide {} experts)\n",
          f.after_balance, f.num_ranks, f.num_experts);
    fmt::print("moved bytes from the contiguous layout: {} ({} per expert)\n", f.moved_bytes_total, o.expert_bytes);
  }
  if (!o.save_path.empty()) fmt::print("saved {} slots to {}\n", placement.num_slots(), o.save_path);
}

}  // namespace

int run_eplb(const EplbOptions& o) {
  auto fail = [](const Status& s) {
    fmt::print(stderr, "epx eplb: {}\n", s.message());
    return kExitUsage;
  };
  const CommandPath inputs[] = {{"--loads", o.loads_path, false}, {"--current", o.current_path, false}};
  const CommandPath outputs[] = {{"--save", o.save_path, false}};
  if (Status s = check_outputs_apart(inputs, outputs); !s.is_ok()) return fail(s);
  auto placements = place_for_loads(o);
  if (!placements.is_ok()) return fail(placements.status());
  if (!o.save_path.empty()) {
    Status s = write_placement(o.save_path, placements->chosen(), o.num_nodes, o.ranks_per_node);
    if (!s.is_ok()) return fail(s);
  }
  const EplbFigures figures = measure_placements(*placements, o);
  if (o.json)
    print_eplb_json(o, *placements, figures);
  else
    print_eplb_text(o, *placements, figures);
  return kExitOk;
}

}  // namespace epx::app
