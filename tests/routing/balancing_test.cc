#include <cmath>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "epx/comm/inproc.h"
#include "epx/comm/topology.h"
#include "epx/routing/expert_bias.h"
#include "epx/routing/load_stats.h"
#include "epx/routing/router.h"

namespace epx {
namespace {

TEST(ExpertBias, UpdateMovesTowardsTheMeanByTheRate) {
  ExpertBias bias(4, 0.5f);
  const std::vector<int64_t> load = {10, 2, 4, 4};  // mean 5
  ASSERT_TRUE(bias.update(load).is_ok());
  EXPECT_EQ(bias.values(), (std::vector<float>{-0.5f, 0.5f, 0.5f, 0.5f}));
  const std::vector<int64_t> even = {3, 3, 3, 3};
  ASSERT_TRUE(bias.update(even).is_ok());
  EXPECT_EQ(bias.values(), (std::vector<float>{-0.5f, 0.5f, 0.5f, 0.5f}));
  bias.set_frozen(true);
  ASSERT_TRUE(bias.update(load).is_ok());
  EXPECT_EQ(bias.values()[0], -0.5f);
  EXPECT_EQ(ExpertBias(3).rate(), 1e-3f);
  const std::vector<int64_t> short_load = {1, 2};
  Status bad = bias.update(short_load);
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("load has 2 entries, num_experts = 4"), std::string::npos);
}

TEST(ExpertBias, LoadIsSummedOverRanks) {
  auto topo = Topology::create(4, 2);
  ASSERT_TRUE(topo.is_ok());
  std::vector<std::vector<int64_t>> seen(4);
  auto statuses = run_ranks(*topo, [&](Transport& t) -> Status {
    std::vector<int64_t> load = {t.rank(), 1, 10 * t.rank()};
    EPX_RETURN_IF_ERROR(sum_load_over_ranks(t, load, Deadline::after(std::chrono::seconds(10))));
    seen[t.rank()] = load;
    return Status::ok();
  });
  ASSERT_TRUE(first_error(statuses).is_ok()) << first_error(statuses).to_string();
  for (const auto& load : seen) EXPECT_EQ(load, (std::vector<int64_t>{6, 4, 60}));
}

// A few experts are systematically favoured; the bias learns to even it out.
TEST(ExpertBias, DrivesMaxVioDownOnSkewedScores) {
  const int E = 16, K = 2;
  const int64_t T = 1024;
  RouterConfig config{.num_experts = E, .topk = K, .score_function = ScoreFunction::kSigmoid,
                      .normalize_weights = true};
  std::vector<int32_t> expert_rank(E);
  for (int e = 0; e < E; ++e) expert_rank[e] = e / 4;
  std::mt19937 rng(7);
  std::normal_distribution<float> noise(0.0f, 1.0f);
  auto batch = [&](int64_t n) {
    std::vector<float> logits(n * E);
    for (int64_t t = 0; t < n; ++t)
      for (int e = 0; e < E; ++e) logits[t * E + e] = noise(rng) + (e < 3 ? 1.5f : 0.0f);
    return logits;
  };
  auto max_vio = [&](const std::vector<float>& logits, int64_t n, const ExpertBias& bias, RouterOutput* keep) {
    auto out = route(config, TensorView::contiguous(logits.data(), DType::kF32, {n, E}), bias.view());
    EXPECT_TRUE(out.is_ok());
    auto stats = compute_load_stats(TensorView::contiguous(out->topk_idx.data(), DType::kI32, {n, K}), expert_rank);
    EXPECT_TRUE(stats.is_ok());
    if (keep) *keep = *out;
    return stats->max_vio;
  };

  ExpertBias bias(E);  // the default rate, 1e-3
  const int64_t eval_tokens = 8192;
  const std::vector<float> eval = batch(eval_tokens);
  const double before = max_vio(eval, eval_tokens, bias, nullptr);
  EXPECT_GT(before, 1.0);
  for (int step = 0; step < 1500; ++step) {
    std::vector<float> logits = batch(T);
    auto out = route(config, TensorView::contiguous(logits.data(), DType::kF32, {T, E}), bias.view());
    ASSERT_TRUE(out.is_ok());
    ASSERT_TRUE(bias.update(out->tokens_per_expert).is_ok());
  }
  RouterOutput out;
  const double after = max_vio(eval, eval_tokens, bias, &out);
  EXPECT_LT(after, 0.1) << "MaxVio before " << before;
  EXPECT_GT(bias.values()[5], bias.values()[0]);

  // The bias picked the experts, but every weight is still the normalized
  // sigmoid score of the selected experts, bias-free.
  for (int64_t t = 0; t < eval_tokens; ++t) {
    double sum = 0;
    for (int j = 0; j < K; ++j) sum += out.scores[t * E + out.topk_idx[t * K + j]];
    for (int j = 0; j < K; ++j)
      ASSERT_NEAR(out.topk_weights[t * K + j], out.scores[t * E + out.topk_idx[t * K + j]] / sum, 1e-6);
  }
}

TEST(LoadStats, HandCase) {
  // Experts 0, 1 on rank 0; 2, 3 on rank 1.
  const std::vector<int32_t> idx = {0, 1, 0, 2, 3, -1};
  const std::vector<int32_t> expert_rank = {0, 0, 1, 1};
  auto s = compute_load_stats(TensorView::contiguous(idx.data(), DType::kI32, {3, 2}), expert_rank);
  ASSERT_TRUE(s.is_ok()) << s.status().to_string();
  EXPECT_EQ(s->tokens_per_expert, (std::vector<int64_t>{2, 1, 1, 1}));
  EXPECT_EQ(s->tokens_per_rank, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(s->work_per_rank, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(s->num_dropped, 1);
  EXPECT_DOUBLE_EQ(s->mean_load, 1.25);
  EXPECT_DOUBLE_EQ(s->max_load, 2.0);
  EXPECT_NEAR(s->max_vio, 0.6, 1e-12);
  EXPECT_NEAR(s->cv, std::sqrt(0.1875) / 1.25, 1e-12);
  EXPECT_EQ(s->worst_rank, 0);
  EXPECT_NEAR(s->worst_rank_share, 0.6, 1e-12);
  EXPECT_NEAR(s->idle_fraction, 1.0 / 6.0, 1e-12);
  const std::string json = s->to_json();
  EXPECT_EQ(json.front(), '{');
  EXPECT_NE(json.find("\"tokens_per_expert\":[2,1,1,1]"), std::string::npos) << json;
  EXPECT_NE(json.find("\"num_dropped\":1"), std::string::npos) << json;

  LoadTracker tracker(0.5);
  tracker.add(*s);
  EXPECT_NEAR(tracker.ema_max_vio(), 0.6, 1e-12);
  LoadStats even;
  tracker.add(even);
  EXPECT_NEAR(tracker.ema_max_vio(), 0.3, 1e-12);
  EXPECT_NEAR(tracker.ema_dropped(), 0.5, 1e-12);
  EXPECT_NE(tracker.to_json().find("\"num_steps\":2"), std::string::npos);
}

TEST(LoadStats, RejectsBadInput) {
  const std::vector<int32_t> idx = {0, 7};
  const std::vector<int32_t> expert_rank = {0, 0, 1, 1};
  auto s = compute_load_stats(TensorView::contiguous(idx.data(), DType::kI32, {1, 2}), expert_rank);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.status().message().find("topk_idx[0][1] = 7 is outside [-1, 4)"), std::string::npos);
  const std::vector<int32_t> bad_rank = {0, -2};
  s = compute_load_stats(TensorView::contiguous(idx.data(), DType::kI32, {1, 1}), bad_rank);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.status().message().find("expert_rank[1] = -2 is below 0"), std::string::npos);
}

}  // namespace
}  // namespace epx
