#include "epx/routing/router.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <thread>

#include "routing/scores.h"

namespace epx {

Status RouterConfig::validate() const {
  if (num_experts < 1) return invalid_argument("num_experts = {} must be at least 1", num_experts);
  if (topk < 1 || topk > num_experts)
    return invalid_argument("topk = {} is outside [1, num_experts = {}]", topk, num_experts);
  if (num_groups < 1 || num_groups > num_experts)
    return invalid_argument("num_groups = {} is outside [1, num_experts = {}]", num_groups, num_experts);
  if (topk_groups < 1 || topk_groups > num_groups)
    return invalid_argument("topk_groups = {} is outside [1, num_groups = {}]", topk_groups, num_groups);
  if (expert_group.empty()) {
    if (num_experts % num_groups != 0)
      return invalid_argument("num_experts = {} is not divisible by num_groups = {}", num_experts, num_groups);
  } else {
    if (static_cast<int64_t>(expert_group.size()) != num_experts)
      return invalid_argument("expert_group has {} entries, num_experts = {}", expert_group.size(), num_experts);
    for (int e = 0; e < num_experts; ++e)
      if (expert_group[e] < 0 || expert_group[e] >= num_groups)
        return invalid_argument("expert_group[{}] = {} is outside [0, num_groups = {})", e, expert_group[e],
                                num_groups);
  }
  if (num_groups > 1) {
    std::vector<int> sizes = detail::group_sizes(*this);
    std::sort(sizes.begin(), sizes.end());
    if (sizes.front() == 0) return invalid_argument("a group of the {} groups has no expert", num_groups);
    const int fewest = std::accumulate(sizes.begin(), sizes.begin() + topk_groups, 0);
    if (topk > fewest)
      return invalid_argument("topk = {} is larger than the {} experts of the smallest {} groups", topk, fewest,
                              topk_groups);
  }
  if (softmax_after_topk && score_function != ScoreFunction::kSoftmax)
    return invalid_argument("softmax_after_topk needs score_function softmax");
  if (!std::isfinite(scaling_factor))
    return invalid_argument("scaling_factor = {} is not finite", scaling_factor);
  if (!(capacity_factor >= 0.0) || !std::isfinite(capacity_factor))
    return invalid_argument("capacity_factor = {} must be finite and >= 0", capacity_factor);
  if (capacity_alignment < 1)
    return invalid_argument("capacity_alignment = {} must be at least 1", capacity_alignment);
  if (pad_to_capacity && capacity_factor == 0.0)
    return invalid_argument("pad_to_capacity needs capacity_factor > 0, got {}", capacity_factor);
  return Status::ok();
}

int64_t expert_capacity(const RouterConfig& config, int64_t num_tokens) {
  if (config.capacity_factor <= 0.0 || config.num_experts < 1) return 0;
  const double raw = config.capacity_factor * static_cast<double>(num_tokens) * config.topk / config.num_experts;
  // The product is rounded: 1.1 * 50 is 55.00000000000001, whose ceiling
  // would be 56. A relative 1e-9 below an integer counts as that integer.
  int64_t capacity = static_cast<int64_t>(std::ceil(raw - 1e-9 * std::max(1.0, raw)));
  const int64_t align = std::max(1, config.capacity_alignment);
  return (capacity + align - 1) / align * align;
}

namespace {

// Best `k` of candidates[0, n) by score, ties to the lower id, written best
// first (k <= n). An insertion into a sorted list of k: no allocation, and
// for small k far cheaper than sorting all n.
void top_k_of(const float* score, const int32_t* candidates, int n, int k, int32_t* out) {
  auto better = [score](int32_t a, int32_t b) { return score[a] > score[b] || (score[a] == score[b] && a < b); };
  int count = 0;
  for (int i = 0; i < n; ++i) {
    const int32_t c = candidates[i];
    if (count == k) {
      if (!better(c, out[k - 1])) continue;
      --count;
    }
    int j = count;
    for (; j > 0 && better(c, out[j - 1]); --j) out[j] = out[j - 1];
    out[j] = c;
    ++count;
  }
}

// Drops over-capacity (token, slot) pairs from out in place.
void apply_capacity(const RouterConfig& config, RouterOutput& out) {
  const int64_t T = out.num_tokens;
  const int K = out.topk;
  std::vector<std::vector<int64_t>> slots(config.num_experts);  // flat (token * K + slot)
  for (int64_t s = 0; s < T * K; ++s) slots[out.topk_idx[s]].push_back(s);
  for (auto& list : slots) {
    if (static_cast<int64_t>(list.size()) <= out.capacity) continue;
    if (config.drop_policy == DropPolicy::kScore) {
      std::stable_sort(list.begin(), list.end(), [&](int64_t a, int64_t b) {
        return out.topk_weights[a] > out.topk_weights[b];
      });
    }
    for (std::size_t i = out.capacity; i < list.size(); ++i) {
      out.topk_idx[list[i]] = -1;
      out.topk_weights[list[i]] = 0.0f;
      ++out.num_dropped;
    }
  }
}

}  // namespace

Result<RouterOutput> route(const RouterConfig& config, const TensorView& logits, const TensorView& expert_bias) {
  EPX_RETURN_IF_ERROR(config.validate());
  EPX_RETURN_IF_ERROR(detail::check_logits(logits, config.num_experts));
  const int E = config.num_experts;
  const int K = config.topk;
  const int64_t T = logits.size(0);
  const float* bias = nullptr;
  if (expert_bias.defined()) {
    if (expert_bias.ndim() != 1 || expert_bias.dtype() != DType::kF32 || expert_bias.size(0) != E ||
        expert_bias.stride(0) != 1 || expert_bias.device().kind != DeviceKind::kHost)
      return invalid_argument("expert_bias must be a host f32[{}] with unit stride, got {}", E,
                              expert_bias.describe());
    bias = expert_bias.data_as<const float>();
  }

  RouterOutput out;
  out.num_tokens = T;
  out.num_experts = E;
  out.topk = K;
  out.topk_idx.assign(T * K, -1);
  out.topk_weights.assign(T * K, 0.0f);
  out.selected_idx.assign(T * K, -1);
  out.selected_probs.assign(T * K, 0.0f);
  out.scores = detail::probabilities(config.score_function, logits, E);

  const std::vector<std::vector<int32_t>> groups = detail::group_members(config);
  const int per_group = std::max(1, K / config.topk_groups);
  std::vector<int32_t> group_ids(config.num_groups);
  std::iota(group_ids.begin(), group_ids.end(), 0);
  std::vector<int32_t> all_experts(E);
  std::iota(all_experts.begin(), all_experts.end(), 0);
  // Tokens are independent: each range writes only its own rows, so how the
  // tokens are split over threads never changes a bit.
  auto route_tokens = [&](int64_t t_begin, int64_t t_end) {
    std::vector<float> select(E);
    std::vector<float> group_score(config.num_groups);
    std::vector<int32_t> candidates;
    std::vector<int32_t> best(E);
    std::vector<int32_t> best_groups(config.topk_groups);
    for (int64_t t = t_begin; t < t_end; ++t) {
      const float* row = logits.row<const float>(t);
      const float* prob = out.scores.data() + t * E;
      const float* base = config.softmax_after_topk ? row : prob;
      for (int e = 0; e < E; ++e) select[e] = base[e] + (bias ? bias[e] : 0.0f);

      int32_t* sel = out.selected_idx.data() + t * K;
      if (config.num_groups > 1) {
        for (int g = 0; g < config.num_groups; ++g) {
          const int size = static_cast<int>(groups[g].size());
          const int n = std::min(per_group, size);
          top_k_of(select.data(), groups[g].data(), size, n, best.data());
          float sum = 0.0f;
          for (int j = 0; j < n; ++j) sum += select[best[j]];
          group_score[g] = sum;
        }
        top_k_of(group_score.data(), group_ids.data(), config.num_groups, config.topk_groups, best_groups.data());
        candidates.clear();
        for (int32_t g : best_groups) candidates.insert(candidates.end(), groups[g].begin(), groups[g].end());
        top_k_of(select.data(), candidates.data(), static_cast<int>(candidates.size()), K, sel);
      } else {
        top_k_of(select.data(), all_experts.data(), E, K, sel);
      }

      float* p = out.selected_probs.data() + t * K;
      if (config.softmax_after_topk) {
        float max_logit = row[sel[0]];
        for (int j = 1; j < K; ++j) max_logit = std::max(max_logit, row[sel[j]]);
        float sum = 0.0f;
        for (int j = 0; j < K; ++j) sum += (p[j] = std::exp(row[sel[j]] - max_logit));
        for (int j = 0; j < K; ++j) p[j] /= sum;
      } else {
        for (int j = 0; j < K; ++j) p[j] = prob[sel[j]];
      }
      float denom = 1.0f;
      if (config.normalize_weights) {
        denom = 0.0f;
        for (int j = 0; j < K; ++j) denom += p[j];
      }
      for (int j = 0; j < K; ++j) {
        out.topk_idx[t * K + j] = sel[j];
        out.topk_weights[t * K + j] = config.scaling_factor * (p[j] / denom);
      }
    }
  };
  // Large batches use the machine's cores (at most 8 threads); small ones stay on the caller's.
  constexpr int64_t kMinWorkPerThread = 1 << 17;  // (token, expert) pairs
  const int64_t max_threads = std::clamp<int64_t>(std::thread::hardware_concurrency(), 1, 8);
  const int64_t num_threads = std::clamp<int64_t>(T * E / kMinWorkPerThread, 1, max_threads);
  std::vector<std::thread> workers;
  for (int64_t i = 1; i < num_threads; ++i)
    workers.emplace_back(route_tokens, T * i / num_threads, T * (i + 1) / num_threads);
  route_tokens(0, T / num_threads);
  for (std::thread& w : workers) w.join();
  out.capacity = expert_capacity(config, T);
  if (out.capacity > 0) apply_capacity(config, out);
  out.tokens_per_expert.assign(E, 0);
  for (int32_t e : out.topk_idx)
    if (e >= 0) ++out.tokens_per_expert[e];
  out.rows_per_expert = out.tokens_per_expert;
  if (config.pad_to_capacity) std::fill(out.rows_per_expert.begin(), out.rows_per_expert.end(), out.capacity);
  return out;
}

Result<std::vector<float>> route_backward(const RouterConfig& config, const RouterOutput& forward,
                                          const TensorView& grad_topk_weights) {
  EPX_RETURN_IF_ERROR(config.validate());
  const int E = config.num_experts;
  const int K = config.topk;
  const int64_t T = forward.num_tokens;
  if (forward.num_experts != E || forward.topk != K ||
      static_cast<int64_t>(forward.selected_idx.size()) != T * K ||
      static_cast<int64_t>(forward.scores.size()) != T * E)
    return invalid_argument("forward was made for num_experts = {}, topk = {}; the config has {} and {}",
                            forward.num_experts, forward.topk, E, K);
  if (grad_topk_weights.ndim() != 2)
    return invalid_argument("grad_topk_weights must be 2-D, got {}", grad_topk_weights.describe());
  EPX_RETURN_IF_ERROR(check_matrix(grad_topk_weights, "grad_topk_weights", DType::kF32, T, K));

  std::vector<float> grad(T * E, 0.0f);
  std::vector<float> g_p(K);
  for (int64_t t = 0; t < T; ++t) {
    const float* gw = grad_topk_weights.row<const float>(t);
    const float* p = forward.selected_probs.data() + t * K;
    const int32_t* sel = forward.selected_idx.data() + t * K;
    const int32_t* kept = forward.topk_idx.data() + t * K;
    // Through scaling and normalization: w_j = c * p_j / Z.
    float denom = 1.0f;
    if (config.normalize_weights) {
      denom = 0.0f;
      for (int j = 0; j < K; ++j) denom += p[j];
    }
    float dot = 0.0f;  // sum_m gw_m * w_m / c, over kept slots
    for (int j = 0; j < K; ++j) {
      const float g = kept[j] >= 0 ? gw[j] : 0.0f;
      g_p[j] = config.scaling_factor * g / denom;
      dot += g * p[j];
    }
    if (config.normalize_weights)
      for (int j = 0; j < K; ++j) g_p[j] -= config.scaling_factor * dot / (denom * denom);

    // Through the score function.
    float* out = grad.data() + t * E;
    if (config.softmax_after_topk) {
      float inner = 0.0f;
      for (int j = 0; j < K; ++j) inner += g_p[j] * p[j];
      for (int j = 0; j < K; ++j) out[sel[j]] = p[j] * (g_p[j] - inner);
    } else if (config.score_function == ScoreFunction::kSigmoid) {
      for (int j = 0; j < K; ++j) out[sel[j]] = g_p[j] * p[j] * (1.0f - p[j]);
    } else {
      const float* s = forward.scores.data() + t * E;
      float inner = 0.0f;
      for (int j = 0; j < K; ++j) inner += g_p[j] * p[j];
      for (int e = 0; e < E; ++e) out[e] = -s[e] * inner;
      for (int j = 0; j < K; ++j) out[sel[j]] += s[sel[j]] * g_p[j];
    }
  }
  return grad;
}

}  // namespace epx
