#include "epx/exchange/placement.h"

namespace epx {

Result<ExpertPlacement> ExpertPlacement::contiguous(int num_experts, int num_ranks) {
  if (num_ranks < 1) return invalid_argument("num_ranks = {} must be at least 1", num_ranks);
  if (num_experts < 1) return invalid_argument("num_experts = {} must be at least 1", num_experts);
  if (num_experts % num_ranks != 0)
    return invalid_argument(
        "num_experts = {} is not a multiple of num_ranks = {}; pass a placement map to place experts unevenly",
        num_experts, num_ranks);
  std::vector<int32_t> expert_rank(num_experts);
  const int per_rank = num_experts / num_ranks;
  for (int e = 0; e < num_experts; ++e) expert_rank[e] = e / per_rank;
  return from_map(std::move(expert_rank), num_ranks);
}

Result<ExpertPlacement> ExpertPlacement::from_map(std::vector<int32_t> expert_rank, int num_ranks) {
  if (num_ranks < 1) return invalid_argument("num_ranks = {} must be at least 1", num_ranks);
  if (expert_rank.empty()) return invalid_argument("the placement map is empty: there must be at least one expert");
  ExpertPlacement p;
  p.num_ranks_ = num_ranks;
  p.local_id_.resize(expert_rank.size());
  p.local_experts_.resize(num_ranks);
  for (std::size_t e = 0; e < expert_rank.size(); ++e) {
    const int32_t r = expert_rank[e];
    if (r < 0 || r >= num_ranks)
      return invalid_argument("expert_rank[{}] = {} is outside [0, {})", e, r, num_ranks);
    p.local_id_[e] = static_cast<int32_t>(p.local_experts_[r].size());
    p.local_experts_[r].push_back(static_cast<int32_t>(e));
  }
  p.expert_rank_ = std::move(expert_rank);
  return p;
}

}  // namespace epx
