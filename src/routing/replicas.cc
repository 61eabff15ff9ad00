#include "epx/routing/replicas.h"

#include <algorithm>

namespace epx {

Result<std::vector<int32_t>> map_to_replicas(std::span<const std::vector<int32_t>> replicas,
                                             std::span<const int32_t> topk_idx, int topk, ReplicaChoice choice) {
  if (topk < 1) return invalid_argument("topk = {} is below the minimum 1", topk);
  if (topk_idx.size() % static_cast<size_t>(topk) != 0)
    return invalid_argument("topk_idx has {} entries, not a multiple of topk = {}", topk_idx.size(), topk);
  const int num_experts = static_cast<int>(replicas.size());
  int32_t num_slots = 0;
  for (int e = 0; e < num_experts; ++e) {
    if (replicas[e].empty()) return invalid_argument("expert {} has no replica", e);
    for (int32_t s : replicas[e]) {
      if (s < 0) return invalid_argument("expert {} lists slot {}, below 0", e, s);
      num_slots = std::max(num_slots, s + 1);
    }
  }
  const int64_t num_tokens = static_cast<int64_t>(topk_idx.size()) / topk;
  std::vector<int32_t> out(topk_idx.size(), -1);
  std::vector<int64_t> given(choice == ReplicaChoice::kLeastLoaded ? num_slots : 0, 0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int k = 0; k < topk; ++k) {
      const size_t i = static_cast<size_t>(t) * topk + k;
      const int e = topk_idx[i];
      if (e == -1) continue;
      if (e < 0 || e >= num_experts)
        return invalid_argument("topk_idx[{}][{}] = {} is outside [0, {})", t, k, e, num_experts);
      const auto& slots = replicas[e];
      int32_t slot = slots[static_cast<size_t>(t % static_cast<int64_t>(slots.size()))];
      if (choice == ReplicaChoice::kLeastLoaded) {
        slot = slots.front();
        for (int s : slots)
          if (given[s] < given[slot]) slot = s;
        ++given[slot];
      }
      out[i] = slot;
    }
  }
  return out;
}

}  // namespace epx
