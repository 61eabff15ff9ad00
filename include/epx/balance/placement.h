// Expert placement with redundant experts (EPLB-style).
//
// Given the measured load of each logical expert, `place_experts` decides how
// many replicas each expert gets and which physical slot holds each replica,
// so that the per-rank load (an expert's load split evenly over its replicas)
// is as even as the slots allow. Physical slots are numbered rank-major: rank r
// holds slots [r*S/R, (r+1)*S/R). No rank ever holds two replicas of one
// expert. Results are deterministic: the same input gives the same placement.
//
//   epx::PlacementConfig config{.num_slots = 80, .num_nodes = 2, .ranks_per_node = 4};
//   EPX_ASSIGN_OR_RETURN(auto p, epx::place_experts(load, config));   // load.size() == 64
//   p.slot_expert()[17];          // logical expert held by physical slot 17
//   p.replicas(3);                // physical slots holding expert 3
//   EPX_ASSIGN_OR_RETURN(auto ep, p.to_expert_placement());  // for epx::Buffer
//   double b = epx::balance(epx::rank_loads(p, load));        // max / mean per rank
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "epx/core/status.h"
#include "epx/exchange/placement.h"
#include "epx/routing/replicas.h"

namespace epx {

enum class PlacementPolicy {
  // Groups are packed onto nodes (balanced by load, G/N groups per node); each
  // node then replicates and packs only its own experts, so a group never
  // leaves its node. Needs num_groups > 0 with num_nodes dividing num_groups;
  // otherwise the global policy is used (RedundantPlacement::policy() says
  // which one ran).
  kHierarchical,
  // One domain over all ranks: replicate, then pack over every rank.
  kGlobal,
};

struct PlacementConfig {
  int num_slots = 0;       // physical slots S: >= num_experts, a multiple of num_ranks
  int num_nodes = 1;       // N
  int ranks_per_node = 1;  // R = N * ranks_per_node
  int num_groups = 0;      // expert groups G (0 = none); G must divide num_experts
  PlacementPolicy policy = PlacementPolicy::kHierarchical;
};

// Which physical slot holds which logical expert. An expert has at most as many
// replicas as its domain has ranks (ranks_per_node for the hierarchical policy,
// all ranks for the global one), because two replicas never share a rank; when
// that cap leaves slots over (only when a rank has more slots than its domain
// has experts), those slots hold no expert: slot_expert() is -1 there.
class RedundantPlacement {
 public:
  // A placement from a slot -> logical expert map (-1 = empty slot). Checks that
  // every expert in [0, num_experts) has a replica, that ids are in range, that
  // num_ranks divides the slot count and that no rank holds an expert twice.
  static Result<RedundantPlacement> from_slot_map(std::vector<int32_t> slot_expert, int num_experts, int num_ranks,
                                                  PlacementPolicy policy = PlacementPolicy::kGlobal);

  [[nodiscard]] int num_experts() const { return static_cast<int>(replicas_.size()); }
  [[nodiscard]] int num_slots() const { return static_cast<int>(slot_expert_.size()); }
  [[nodiscard]] int num_ranks() const { return num_ranks_; }
  [[nodiscard]] int slots_per_rank() const { return num_slots() / num_ranks_; }
  [[nodiscard]] PlacementPolicy policy() const { return policy_; }

  // slot -> logical expert (-1 = empty).
  [[nodiscard]] const std::vector<int32_t>& slot_expert() const { return slot_expert_; }
  // logical expert -> its physical slots, ascending.
  [[nodiscard]] const std::vector<int32_t>& replicas(int expert) const { return replicas_[expert]; }
  // Every expert's slots: replica_table()[e] == replicas(e).
  [[nodiscard]] const std::vector<std::vector<int32_t>>& replica_table() const { return replicas_; }
  [[nodiscard]] int num_replicas(int expert) const { return static_cast<int>(replicas_[expert].size()); }
  [[nodiscard]] std::vector<int32_t> replica_counts() const;
  [[nodiscard]] int rank_of_slot(int slot) const { return slot / slots_per_rank(); }
  // slot -> rank, for every slot.
  [[nodiscard]] std::vector<int32_t> slot_rank() const;

  // An ExpertPlacement over the physical slots (slot s on rank_of_slot(s)).
  [[nodiscard]] Result<ExpertPlacement> to_expert_placement() const;

 private:
  RedundantPlacement() = default;
  int num_ranks_ = 0;
  PlacementPolicy policy_ = PlacementPolicy::kGlobal;
  std::vector<int32_t> slot_expert_;
  std::vector<std::vector<int32_t>> replicas_;
};

// A placement for `load` (one finite, non-negative value per logical expert).
// InvalidArgument names the bad value and its limit: slots fewer than experts,
// slots not a multiple of ranks, groups not dividing experts, a negative or
// NaN load.
Result<RedundantPlacement> place_experts(const std::vector<double>& load, const PlacementConfig& config);

// One replica per expert, contiguous: slot e holds expert e (slots == experts).
// The "before" of a rebalance report.
Result<RedundantPlacement> contiguous_placement(int num_experts, int num_ranks);

// Load of each rank: every expert's load split evenly over its replicas.
// `load` must have placement.num_experts() entries.
std::vector<double> rank_loads(const RedundantPlacement& placement, const std::vector<double>& load);
// max / mean of `rank_load`; 1 for an all-zero or empty vector.
double balance(const std::vector<double>& rank_load);

// Expert weights moved to go from `from` to `to`: the slots whose expert
// changes (and is not -1 in `to`), times expert_bytes. Both must have the same
// slot count.
int64_t moved_bytes(const RedundantPlacement& from, const RedundantPlacement& to, int64_t expert_bytes);

struct RebalancePlan {
  RedundantPlacement placement;
  double balance = 0;          // of `placement` under the new load
  double scratch_balance = 0;  // of place_experts(new load) from scratch
  int num_moved_slots = 0;
  int64_t moved_bytes = 0;
};

// A placement for the new `load` whose balance is within `tolerance` of the
// from-scratch placement (balance <= scratch_balance * (1 + tolerance)) and
// that moves few expert weights: the candidate that moves the fewest slots
// among the current placement, the current one repaired by slot swaps (with
// its own or the from-scratch replica counts), greedy placements that keep
// replicas where they are, and the from-scratch one renumbered onto the
// current ranks (always within the tolerance). An expert that stays on a rank
// keeps its slot; under the hierarchical policy a group stays on one node.
// `current` must have config's slot count and rank count and load.size() experts.
Result<RebalancePlan> rebalance(const RedundantPlacement& current, const std::vector<double>& load,
                                const PlacementConfig& config, int64_t expert_bytes, double tolerance = 0.02);

// Maps topk_idx [num_tokens, topk] of logical expert ids (-1 = none, kept) to
// physical slot ids, deterministically (row-major order for kLeastLoaded):
// map_to_replicas (routing/replicas.h) over the placement's replica lists.
// InvalidArgument on a size mismatch or an id outside [0, num_experts).
Result<std::vector<int32_t>> choose_replicas(const RedundantPlacement& placement, std::span<const int32_t> topk_idx,
                                             int topk, ReplicaChoice choice);

}  // namespace epx
