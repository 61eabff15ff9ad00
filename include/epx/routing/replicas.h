// Replica choice: which physical slot serves a (token, logical expert) pair
// when experts have redundant replicas (EPLB). Plain data in, so that both the
// MoE layer and the placement tools (epx_balance) use this one implementation.
//
//   // replicas[e]: the physical slots holding logical expert e, ascending
//   EPX_ASSIGN_OR_RETURN(auto slot_idx, epx::map_to_replicas(replicas, topk_idx, topk, epx::ReplicaChoice::kTokenModulo));
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "epx/core/status.h"

namespace epx {

enum class ReplicaChoice {
  kTokenModulo,  // replica (token index mod replica count) of the expert
  kLeastLoaded,  // the replica that has been given the fewest (token, k) so far; ties to the lowest slot
};

// Maps topk_idx [num_tokens, topk] of logical expert ids (-1 = none, kept) to
// physical slot ids, deterministically (row-major order for kLeastLoaded).
// `replicas[e]` lists expert e's slots (non-empty, each in [0, num_slots)).
// InvalidArgument on a size mismatch, an id outside [0, replicas.size()) or
// an expert without a replica.
Result<std::vector<int32_t>> map_to_replicas(std::span<const std::vector<int32_t>> replicas,
                                             std::span<const int32_t> topk_idx, int topk, ReplicaChoice choice);

}  // namespace epx
