// The router's selection against a plain reference: sort every candidate by
// (selection score descending, expert id ascending), over shapes that reach
// each of route's selection paths (threshold-and-rank, ranked scan, scattered
// group maps, many ties, infinite bias) and thread splits.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "epx/routing/router.h"

namespace epx {
namespace {

struct Case {
  std::string name;
  RouterConfig config;
  std::vector<float> logits;
  std::vector<float> bias;  // empty = none
};

// The reference: group scores (sum of the best n, best first), the best
// topk_groups groups (ties: lower group id), then the best topk of their
// experts (ties: lower id), weights from route's own scores.
void expect_matches_reference(const Case& c) {
  const RouterConfig& cfg = c.config;
  const int E = cfg.num_experts, K = cfg.topk, G = cfg.num_groups;
  const int64_t T = static_cast<int64_t>(c.logits.size()) / E;
  TensorView bias_view;
  if (!c.bias.empty()) bias_view = TensorView::contiguous(c.bias.data(), DType::kF32, {E});
  Result<RouterOutput> out = route(cfg, TensorView::contiguous(c.logits.data(), DType::kF32, {T, E}), bias_view);
  ASSERT_TRUE(out.is_ok()) << c.name << ": " << out.status().to_string();
  std::vector<int> group(E);
  for (int e = 0; e < E; ++e) group[e] = cfg.expert_group.empty() ? e / (E / G) : cfg.expert_group[e];
  bool any_nonzero = false;
  for (int64_t t = 0; t < T; ++t) {
    const float* prob = out->scores.data() + t * E;
    const float* base = cfg.softmax_after_topk ? c.logits.data() + t * E : prob;
    std::vector<float> s(E);
    for (int e = 0; e < E; ++e) s[e] = base[e] + (c.bias.empty() ? 0.0f : c.bias[e]);
    auto better = [&](int a, int b) { return s[a] > s[b] || (s[a] == s[b] && a < b); };
    std::vector<int> candidates;
    if (G > 1) {
      const int per_group = std::max(1, K / cfg.topk_groups);
      std::vector<float> group_score(G);
      for (int g = 0; g < G; ++g) {
        std::vector<int> members;
        for (int e = 0; e < E; ++e)
          if (group[e] == g) members.push_back(e);
        std::sort(members.begin(), members.end(), better);
        float sum = 0.0f;
        for (int j = 0; j < std::min<int>(per_group, members.size()); ++j) sum += s[members[j]];
        group_score[g] = sum;
      }
      std::vector<int> ids(G);
      std::iota(ids.begin(), ids.end(), 0);
      std::sort(ids.begin(), ids.end(), [&](int a, int b) {
        return group_score[a] > group_score[b] || (group_score[a] == group_score[b] && a < b);
      });
      for (int e = 0; e < E; ++e)
        if (std::find(ids.begin(), ids.begin() + cfg.topk_groups, group[e]) != ids.begin() + cfg.topk_groups)
          candidates.push_back(e);
    } else {
      candidates.resize(E);
      std::iota(candidates.begin(), candidates.end(), 0);
    }
    std::sort(candidates.begin(), candidates.end(), better);
    for (int j = 0; j < K; ++j) {
      ASSERT_EQ(out->topk_idx[t * K + j], candidates[j]) << c.name << ": token " << t << " slot " << j;
      ASSERT_EQ(out->selected_idx[t * K + j], candidates[j]) << c.name << ": token " << t << " slot " << j;
      any_nonzero = any_nonzero || out->topk_weights[t * K + j] != 0.0f;
    }
    if (!cfg.softmax_after_topk) {
      float denom = 0.0f;
      for (int j = 0; j < K; ++j) denom += prob[candidates[j]];
      for (int j = 0; j < K; ++j) {
        const float w = cfg.scaling_factor * (prob[candidates[j]] / (cfg.normalize_weights ? denom : 1.0f));
        ASSERT_EQ(out->topk_weights[t * K + j], w) << c.name << ": token " << t << " slot " << j;
      }
    }
  }
  EXPECT_TRUE(any_nonzero) << c.name;
}

std::vector<float> random_values(int64_t n, unsigned seed, float step) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = step > 0 ? std::round(dist(rng) / step) * step : dist(rng);
  return v;
}

TEST(RouterSelect, MatchesPlainReference) {
  const int E = 256;
  std::vector<int32_t> scattered(E);
  for (int e = 0; e < E; ++e) scattered[e] = (e * 5) % 8;
  std::vector<float> bias = random_values(E, 3, 0.0f);
  for (float& b : bias) b *= 0.05f;
  std::vector<float> infinite_bias(E, 0.0f);
  infinite_bias[7] = std::numeric_limits<float>::infinity();
  infinite_bias[100] = -std::numeric_limits<float>::infinity();
  int cases = 0;
  // step 0: distinct values; 0.25: many ties; 100: nearly all equal (too many
  // candidates for the threshold path).
  for (float step : {0.0f, 0.25f, 100.0f})
    for (int k : {1, 2, 3, 8, 12, 17})
      for (int groups : {1, 8, -8})  // -8: 8 groups, scattered map
        for (int fn = 0; fn < 3; ++fn)
          for (int b = 0; b < 3; ++b) {
            const int64_t T = k == 8 ? 1100 : 40;  // 1100 x 256: split over threads
            RouterConfig cfg{.num_experts = E, .topk = k};
            cfg.score_function = fn == 1 ? ScoreFunction::kSigmoid : ScoreFunction::kSoftmax;
            cfg.softmax_after_topk = fn == 2;
            cfg.normalize_weights = fn == 1;
            cfg.scaling_factor = fn == 1 ? 2.5f : 1.0f;
            if (groups != 1) {
              cfg.num_groups = 8;
              cfg.topk_groups = k >= 4 ? 4 : 1;
              if (k == 17) cfg.topk_groups = 6;
              if (groups < 0) cfg.expert_group = scattered;
            }
            Case c{fmt::format("step {} k {} groups {} fn {} bias {}", step, k, groups, fn, b), cfg,
                   random_values(T * E, 11 + k, step), b == 0 ? std::vector<float>{} : b == 1 ? bias : infinite_bias};
            expect_matches_reference(c);
            ++cases;
          }
  EXPECT_EQ(cases, 3 * 6 * 3 * 3 * 3);
}

}  // namespace
}  // namespace epx
