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
  s.summarize();
  return s;
}

void LoadStats::summarize() {
  const auto E = static_cast<double>(tokens_per_expert.size());
  max_load = mean_load = max_vio = cv = worst_rank_share = idle_fraction = 0.0;
  worst_rank = 0;
  if (tokens_per_expert.empty()) return;
  double total = 0.0;
  for (int64_t n : tokens_per_expert) total += static_cast<double>(n);
  mean_load = total / E;
  max_load = static_cast<double>(*std::max_element(tokens_per_expert.begin(), tokens_per_expert.end()));
  if (mean_load <= 0 || work_per_rank.empty()) return;
  max_vio = max_load / mean_load - 1.0;
  double var = 0.0;
  for (int64_t n : tokens_per_expert) var += (n - mean_load) * (n - mean_load);
  cv = std::sqrt(var / E) / mean_load;
  const auto worst = std::max_element(work_per_rank.begin(), work_per_rank.end());
  worst_rank = static_cast<int>(worst - work_per_rank.begin());
  worst_rank_share = static_cast<double>(*worst) / total;
  idle_fraction = 1.0 - (total / static_cast<double>(work_per_rank.size())) / static_cast<double>(*worst);
}

Status sum_load_stats_over_ranks(Transport& transport, LoadStats* stats, const Deadline& deadline) {
  const std::size_t E = stats->tokens_per_expert.size();
  const std::size_t R = stats->tokens_per_rank.size();
  if (stats->work_per_rank.size() != R)
    return invalid_argument("work_per_rank has {} entries, tokens_per_rank {}", stats->work_per_rank.size(), R);
  // One all-reduce: [tokens_per_expert | tokens_per_rank | work_per_rank | num_dropped].
  std::vector<int64_t> packed;
  packed.reserve(E + 2 * R + 1);
  packed.insert(packed.end(), stats->tokens_per_expert.begin(), stats->tokens_per_expert.end());
  packed.insert(packed.end(), stats->tokens_per_rank.begin(), stats->tokens_per_rank.end());
  packed.insert(packed.end(), stats->work_per_rank.begin(), stats->work_per_rank.end());
  packed.push_back(stats->num_dropped);
  EPX_RETURN_IF_ERROR(transport.all_reduce(std::span<int64_t>(packed), ReduceOp::kSum, deadline));
  auto it = packed.begin();
  std::copy(it, it + static_cast<std::ptrdiff_t>(E), stats->tokens_per_expert.begin());
  it += static_cast<std::ptrdiff_t>(E);
  std::copy(it, it + static_cast<std::ptrdiff_t>(R), stats->tokens_per_rank.begin());
  it += static_cast<std::ptrdiff_t>(R);
  std::copy(it, it + static_cast<std::ptrdiff_t>(R), stats->work_per_rank.begin());
  stats->num_dropped = packed.back();
  stats->summarize();
  return Status::ok();
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
