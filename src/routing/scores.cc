#include "routing/scores.h"

#include <algorithm>
#include <cmath>

namespace epx::detail {

Status check_logits(const TensorView& logits, int num_experts) {
  if (logits.ndim() != 2) return invalid_argument("logits must be 2-D [num_tokens, {}], got {}", num_experts,
                                                  logits.defined() ? logits.describe() : "an undefined view");
  EPX_RETURN_IF_ERROR(check_matrix(logits, "logits", DType::kF32, logits.size(0), num_experts));
  for (int64_t t = 0; t < logits.size(0); ++t) {
    const float* row = logits.row<const float>(t);
    for (int e = 0; e < num_experts; ++e)
      if (!std::isfinite(row[e])) return invalid_argument("logits[{}][{}] = {} is not finite", t, e, row[e]);
  }
  return Status::ok();
}

std::vector<float> probabilities(ScoreFunction fn, const TensorView& logits, int num_experts) {
  const int64_t T = logits.size(0);
  std::vector<float> out(T * num_experts);
  for (int64_t t = 0; t < T; ++t) {
    const float* row = logits.row<const float>(t);
    float* p = out.data() + t * num_experts;
    if (fn == ScoreFunction::kSigmoid) {
      for (int e = 0; e < num_experts; ++e) p[e] = 1.0f / (1.0f + std::exp(-row[e]));
      continue;
    }
    const float max_logit = *std::max_element(row, row + num_experts);
    float sum = 0.0f;
    for (int e = 0; e < num_experts; ++e) sum += (p[e] = std::exp(row[e] - max_logit));
    for (int e = 0; e < num_experts; ++e) p[e] /= sum;
  }
  return out;
}

std::vector<std::vector<int32_t>> group_members(const RouterConfig& config) {
  std::vector<std::vector<int32_t>> members(std::max(1, config.num_groups));
  const int per_group = config.num_experts / std::max(1, config.num_groups);
  for (int e = 0; e < config.num_experts; ++e) {
    const int g = config.expert_group.empty() ? e / std::max(1, per_group) : config.expert_group[e];
    members[std::clamp(g, 0, static_cast<int>(members.size()) - 1)].push_back(e);
  }
  return members;
}

std::vector<int> group_sizes(const RouterConfig& config) {
  std::vector<int> sizes;
  for (const auto& m : group_members(config)) sizes.push_back(static_cast<int>(m.size()));
  return sizes;
}

}  // namespace epx::detail
