#include "epx/routing/load_stats.h"

#include <algorithm>
#include <cmath>

#include <fmt/ranges.h>

namespace epx {

Result<LoadStats> compute_load_stats(const TensorView& topk_idx, std::span<const int32_t> expert_rank) {
  if (topk_idx.ndim() != 2)
    return invalid_argument("topk_idx must be 2-D, got {}",
                            topk_idx.defined() ? topk_idx.describe() : "an undefined view");
  EPX_RETURN_IF_ERROR(check_matrix(topk_idx, "topk_idx", DType::kI32, topk_idx.size(0), topk_idx.size(1)));
  const int64_t E = static_cast<int64_t>(expert_rank.size());
  if (E == 0) return invalid_argument("expert_rank is empty; it needs one rank per expert");
  int num_ranks = 0;
  for (int64_t e = 0; e < E; ++e) {
    if (expert_rank[e] < 0) return invalid_argument("expert_rank[{}] = {} is below 0", e, expert_rank[e]);
    num_ranks = std::max(num_ranks, expert_rank[e] + 1);
  }
  LoadStats s;
  s.tokens_per_expert.assign(E, 0);
  s.tokens_per_rank.assign(num_ranks, 0);
  s.work_per_rank.assign(num_ranks, 0);
  std::vector<int64_t> last_token(num_ranks, -1);
  for (int64_t t = 0; t < topk_idx.size(0); ++t) {
    const int32_t* row = topk_idx.row<const int32_t>(t);
    for (int64_t j = 0; j < topk_idx.size(1); ++j) {
      const int32_t e = row[j];
      if (e < -1 || e >= E) return invalid_argument("topk_idx[{}][{}] = {} is outside [-1, {})", t, j, e, E);
      if (e < 0) {
        ++s.num_dropped;
        continue;
      }
      ++s.tokens_per_expert[e];
      const int r = expert_rank[e];
      ++s.work_per_rank[r];
      if (last_token[r] != t) {
        last_token[r] = t;
        ++s.tokens_per_rank[r];
      }
    }
  }
  double total = 0.0;
  for (int64_t n : s.tokens_per_expert) total += static_cast<double>(n);
  s.mean_load = total / static_cast<double>(E);
  s.max_load = static_cast<double>(*std::max_element(s.tokens_per_expert.begin(), s.tokens_per_expert.end()));
  if (s.mean_load > 0) {
    s.max_vio = s.max_load / s.mean_load - 1.0;
    double var = 0.0;
    for (int64_t n : s.tokens_per_expert) var += (n - s.mean_load) * (n - s.mean_load);
    s.cv = std::sqrt(var / static_cast<double>(E)) / s.mean_load;
    const auto worst = std::max_element(s.work_per_rank.begin(), s.work_per_rank.end());
    s.worst_rank = static_cast<int>(worst - s.work_per_rank.begin());
    s.worst_rank_share = static_cast<double>(*worst) / total;
    s.idle_fraction = 1.0 - (total / num_ranks) / static_cast<double>(*worst);
  }
  return s;
}

std::string LoadStats::to_json() const {
  return fmt::format(
      "{{\"tokens_per_expert\":[{}],\"tokens_per_rank\":[{}],\"work_per_rank\":[{}],\"num_dropped\":{},"
      "\"max_load\":{},\"mean_load\":{},\"max_vio\":{},\"cv\":{},\"worst_rank\":{},\"worst_rank_share\":{},"
      "\"idle_fraction\":{}}}",
      fmt::join(tokens_per_expert, ","), fmt::join(tokens_per_rank, ","), fmt::join(work_per_rank, ","),
      num_dropped, max_load, mean_load, max_vio, cv, worst_rank, worst_rank_share, idle_fraction);
}

void LoadTracker::add(const LoadStats& stats) {
  const double d = num_steps_ == 0 ? 0.0 : decay_;
  auto mix = [d](double& ema, double value) { ema = d * ema + (1.0 - d) * value; };
  mix(max_vio_, stats.max_vio);
  mix(cv_, stats.cv);
  mix(idle_, stats.idle_fraction);
  mix(dropped_, static_cast<double>(stats.num_dropped));
  ++num_steps_;
}

std::string LoadTracker::to_json() const {
  return fmt::format("{{\"num_steps\":{},\"ema_max_vio\":{},\"ema_cv\":{},\"ema_idle_fraction\":{},\"ema_dropped\":{}}}",
                     num_steps_, max_vio_, cv_, idle_, dropped_);
}

}  // namespace epx
