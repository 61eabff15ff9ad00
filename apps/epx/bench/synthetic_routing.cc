#include "synthetic_routing.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

namespace epx::bench {

namespace {

// SplitMix64: turns (seed, rank) into well-separated generator seeds.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

Status validate_routing_spec(const RoutingSpec& spec) {
  if (spec.num_tokens < 0) return invalid_argument("num_tokens = {} must be at least 0", spec.num_tokens);
  if (spec.num_experts < 1) return invalid_argument("num_experts = {} must be at least 1", spec.num_experts);
  if (spec.topk < 1) return invalid_argument("topk = {} must be at least 1", spec.topk);
  if (spec.topk > spec.num_experts)
    return invalid_argument("topk = {} is larger than num_experts = {}: a token picks distinct experts", spec.topk,
                            spec.num_experts);
  if (!(spec.skew >= 0.0) || !std::isfinite(spec.skew))
    return invalid_argument("skew = {} must be a finite number >= 0", spec.skew);
  return Status::ok();
}

Result<RankRouting> make_routing(const RoutingSpec& spec, int rank) {
  EPX_RETURN_IF_ERROR(validate_routing_spec(spec));
  RankRouting out;
  out.num_tokens = spec.num_tokens;
  out.topk = spec.topk;
  out.topk_idx.resize(static_cast<std::size_t>(spec.num_tokens) * spec.topk);
  out.topk_weights.resize(out.topk_idx.size());

  std::vector<double> log_weight(spec.num_experts, 0.0);
  for (int e = 0; e < spec.num_experts; ++e) log_weight[e] = -spec.skew * std::log(static_cast<double>(e + 1));

  std::mt19937_64 rng(mix(spec.seed * 0x100000001b3ull + static_cast<uint64_t>(rank)));
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::vector<double> key(spec.num_experts);
  std::vector<int32_t> order(spec.num_experts);
  for (int t = 0; t < spec.num_tokens; ++t) {
    // Gumbel top-k: the k largest log w + G are a weighted draw without replacement.
    for (int e = 0; e < spec.num_experts; ++e) {
      const double u = std::max(unit(rng), 1e-300);
      key[e] = log_weight[e] - std::log(-std::log(u));
    }
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + spec.topk, order.end(),
                      [&](int32_t a, int32_t b) { return key[a] > key[b]; });
    int32_t* idx = out.topk_idx.data() + static_cast<std::size_t>(t) * spec.topk;
    float* w = out.topk_weights.data() + static_cast<std::size_t>(t) * spec.topk;
    float sum = 0.0f;
    for (int k = 0; k < spec.topk; ++k) {
      idx[k] = order[k];
      w[k] = static_cast<float>(0.1 + 0.9 * unit(rng));
      sum += w[k];
    }
    for (int k = 0; k < spec.topk; ++k) w[k] /= sum;
  }
  return out;
}

}  // namespace epx::bench
