#include "epx/routing/router.h"

#include <cmath>
#include <random>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "core/guard.h"

namespace epx {
namespace {

TensorView matrix(const std::vector<float>& v, int64_t rows, int64_t cols) {
  return TensorView::contiguous(v.data(), DType::kF32, {rows, cols});
}

std::vector<float> random_logits(int64_t n, unsigned seed, float scale = 2.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// The tiny hand-checked case: 1 token, 4 experts, top-2 softmax.
TEST(Router, HandCheckedSoftmaxTop2) {
  RouterConfig config{.num_experts = 4, .topk = 2};
  std::vector<float> logits = {1.0f, 3.0f, 2.0f, 0.0f};
  auto out = route(config, matrix(logits, 1, 4));
  ASSERT_TRUE(out.is_ok()) << out.status().to_string();
  const double z = std::exp(1.0) + std::exp(3.0) + std::exp(2.0) + std::exp(0.0);
  EXPECT_EQ(out->topk_idx, (std::vector<int32_t>{1, 2}));
  EXPECT_NEAR(out->topk_weights[0], std::exp(3.0) / z, 1e-6);
  EXPECT_NEAR(out->topk_weights[1], std::exp(2.0) / z, 1e-6);
  EXPECT_NEAR(out->scores[0], std::exp(1.0) / z, 1e-6);
}

TEST(Router, SigmoidNormalizedScaled) {
  RouterConfig config{.num_experts = 3, .topk = 2, .score_function = ScoreFunction::kSigmoid,
                      .normalize_weights = true, .scaling_factor = 2.5f};
  std::vector<float> logits = {0.5f, -1.0f, 2.0f};
  auto out = route(config, matrix(logits, 1, 3));
  ASSERT_TRUE(out.is_ok());
  auto sig = [](double x) { return 1.0 / (1.0 + std::exp(-x)); };
  EXPECT_EQ(out->topk_idx, (std::vector<int32_t>{2, 0}));
  const double z = sig(2.0) + sig(0.5);
  EXPECT_NEAR(out->topk_weights[0], 2.5 * sig(2.0) / z, 1e-6);
  EXPECT_NEAR(out->topk_weights[1], 2.5 * sig(0.5) / z, 1e-6);
  EXPECT_NEAR(out->scores[1], sig(-1.0), 1e-6);
}

TEST(Router, SoftmaxAfterTopk) {
  RouterConfig config{.num_experts = 4, .topk = 2, .softmax_after_topk = true};
  std::vector<float> logits = {0.0f, 1.0f, 4.0f, 3.0f};
  auto out = route(config, matrix(logits, 1, 4));
  ASSERT_TRUE(out.is_ok());
  EXPECT_EQ(out->topk_idx, (std::vector<int32_t>{2, 3}));
  EXPECT_NEAR(out->topk_weights[0], 1.0 / (1.0 + std::exp(-1.0)), 1e-6);
  EXPECT_NEAR(out->topk_weights[1], 1.0 / (1.0 + std::exp(1.0)), 1e-6);
}

TEST(Router, TiesGoToLowerExpertId) {
  RouterConfig config{.num_experts = 5, .topk = 3};
  std::vector<float> logits = {1.0f, 2.0f, 1.0f, 2.0f, 1.0f};
  auto out = route(config, matrix(logits, 1, 5));
  ASSERT_TRUE(out.is_ok());
  EXPECT_EQ(out->topk_idx, (std::vector<int32_t>{1, 3, 0}));
}

// 8 experts in 4 groups of 2, top-2 groups, top-4 experts; sigmoid scores are
// monotone in the logits, so the hand reasoning is on logits.
// Group sums of the best 4/2 = 2 scores: g0 {9, 0} -> high (9 alone is the
// best expert), g1 {5, 5}, g2 {6, 6} (best), g3 {8, 1}.
// Ranking by sum of sigmoids: g2 (2*s(6)) > g1 (2*s(5))? vs g0 s(9)+s(0):
// s(9)+s(0) = 0.99988+0.5 = 1.49988 < 2*s(5) = 1.98661; g3 s(8)+s(1) =
// 0.99966+0.73106 = 1.73072. So groups {2, 1} win and expert 0 (the single
// best) is excluded. Top-4 inside: 4, 5 (6, ties: lower id), 2, 3 (5).
TEST(Router, GroupLimitedHandCase) {
  RouterConfig config{.num_experts = 8, .topk = 4, .score_function = ScoreFunction::kSigmoid,
                      .num_groups = 4, .topk_groups = 2};
  std::vector<float> logits = {9, 0, 5, 5, 6, 6, 8, 1};
  auto out = route(config, matrix(logits, 1, 8));
  ASSERT_TRUE(out.is_ok()) << out.status().to_string();
  EXPECT_EQ(out->topk_idx, (std::vector<int32_t>{4, 5, 2, 3}));
}

// Node-limited: the groups come from a map (experts interleaved over 2 nodes).
TEST(Router, GroupMapNodeLimited) {
  RouterConfig config{.num_experts = 4, .topk = 2, .num_groups = 2, .topk_groups = 1,
                      .expert_group = {0, 1, 0, 1}};
  // Each group is scored by its best max(1, 2/1) = 2 probabilities:
  // g0 = {0, 2}: e^3 + e^-5 = 20.09; g1 = {1, 3}: 2 e^2.5 = 24.36 (over the
  // same softmax denominator). g1 wins, so the best single expert 0 is out;
  // the tie 2.5 = 2.5 inside g1 goes to the lower id.
  std::vector<float> logits = {3.0f, 2.5f, -5.0f, 2.5f};
  auto out = route(config, matrix(logits, 1, 4));
  ASSERT_TRUE(out.is_ok());
  EXPECT_EQ(out->topk_idx, (std::vector<int32_t>{1, 3}));
}

// Groups {0, 1} and {2, 3} score s(1) + s(0.5) each, an exact tie: the lower
// group id wins, so the answer is {0, 1} where plain top-2 would give {0, 3}.
TEST(Router, GroupTiesGoToLowerGroupId) {
  RouterConfig config{.num_experts = 4, .topk = 2, .score_function = ScoreFunction::kSigmoid,
                      .num_groups = 2, .topk_groups = 1};
  std::vector<float> logits = {1.0f, 0.5f, 0.5f, 1.0f};
  auto out = route(config, matrix(logits, 1, 4));
  ASSERT_TRUE(out.is_ok());
  EXPECT_EQ(out->topk_idx, (std::vector<int32_t>{0, 1}));
  config.num_groups = 1;
  out = route(config, matrix(logits, 1, 4));
  ASSERT_TRUE(out.is_ok());
  EXPECT_EQ(out->topk_idx, (std::vector<int32_t>{0, 3}));
}

TEST(Router, BiasSelectsButNeverWeighs) {
  RouterConfig config{.num_experts = 4, .topk = 1, .score_function = ScoreFunction::kSigmoid};
  std::vector<float> logits = {2.0f, 1.0f, 0.0f, 0.0f};
  std::vector<float> bias = {0.0f, 0.5f, 0.0f, 0.0f};
  auto biased = route(config, matrix(logits, 1, 4), TensorView::contiguous(bias.data(), DType::kF32, {4}));
  ASSERT_TRUE(biased.is_ok());
  // s(2) = 0.881 loses to s(1) + 0.5 = 1.231; the weight stays s(1) = 0.731.
  EXPECT_EQ(biased->topk_idx[0], 1);
  EXPECT_NEAR(biased->topk_weights[0], 1.0 / (1.0 + std::exp(-1.0)), 1e-6);
  auto plain = route(config, matrix(logits, 1, 4));
  ASSERT_TRUE(plain.is_ok());
  EXPECT_EQ(plain->topk_idx[0], 0);
}

TEST(Router, CapacityPositionPolicy) {
  // 4 tokens, 2 experts, top-1; all four pick expert 0. cf 1.0: capacity
  // ceil(1 * 4 * 1 / 2) = 2; the first two tokens keep expert 0.
  RouterConfig config{.num_experts = 2, .topk = 1, .capacity_factor = 1.0};
  std::vector<float> logits = {1.0f, 0.0f, 3.0f, 0.0f, 2.0f, 0.0f, 4.0f, 0.0f};
  auto out = route(config, matrix(logits, 4, 2));
  ASSERT_TRUE(out.is_ok());
  EXPECT_EQ(out->capacity, 2);
  EXPECT_EQ(out->topk_idx, (std::vector<int32_t>{0, 0, -1, -1}));
  EXPECT_EQ(out->topk_weights[2], 0.0f);
  EXPECT_GT(out->topk_weights[0], 0.0f);
  EXPECT_EQ(out->num_dropped, 2);
  EXPECT_EQ(out->tokens_per_expert, (std::vector<int64_t>{2, 0}));
}

TEST(Router, CapacityScorePolicyAndAlignment) {
  // Same tokens; score policy keeps the highest weights: tokens 3 (4.0) and
  // 1 (3.0). Alignment 3 rounds the capacity 2 up to 3: tokens 3, 1, 2 keep.
  RouterConfig config{.num_experts = 2, .topk = 1, .capacity_factor = 1.0, .drop_policy = DropPolicy::kScore};
  std::vector<float> logits = {1.0f, 0.0f, 3.0f, 0.0f, 2.0f, 0.0f, 4.0f, 0.0f};
  auto out = route(config, matrix(logits, 4, 2));
  ASSERT_TRUE(out.is_ok());
  EXPECT_EQ(out->topk_idx, (std::vector<int32_t>{-1, 0, -1, 0}));
  config.capacity_alignment = 3;
  config.pad_to_capacity = true;
  out = route(config, matrix(logits, 4, 2));
  ASSERT_TRUE(out.is_ok());
  EXPECT_EQ(out->capacity, 3);
  EXPECT_EQ(out->topk_idx, (std::vector<int32_t>{-1, 0, 0, 0}));
  EXPECT_EQ(out->rows_per_expert, (std::vector<int64_t>{3, 3}));
  EXPECT_EQ(out->tokens_per_expert, (std::vector<int64_t>{3, 0}));
}

TEST(Router, CapacityFormula) {
  RouterConfig config{.num_experts = 1, .topk = 1, .capacity_factor = 1.1};
  EXPECT_EQ(expert_capacity(config, 50), 55);  // 1.1 * 50 rounds to 55.00000000000001
  config = {.num_experts = 8, .topk = 2, .capacity_factor = 1.25, .capacity_alignment = 4};
  EXPECT_EQ(expert_capacity(config, 13), 8);  // ceil(1.25 * 13 * 2 / 8) = ceil(4.06) = 5 -> 8
  config.capacity_factor = 0.0;
  EXPECT_EQ(expert_capacity(config, 13), 0);
}

TEST(Router, ScorePolicyTiesGoToLowerToken) {
  RouterConfig config{.num_experts = 2, .topk = 1, .capacity_factor = 0.5, .drop_policy = DropPolicy::kScore};
  std::vector<float> logits = {1.0f, 0.0f, 1.0f, 0.0f, 1.0f, 0.0f, 1.0f, 0.0f};  // capacity 1
  auto out = route(config, matrix(logits, 4, 2));
  ASSERT_TRUE(out.is_ok());
  EXPECT_EQ(out->topk_idx, (std::vector<int32_t>{0, -1, -1, -1}));
}

TEST(Router, DroplessKeepsEverything) {
  RouterConfig config{.num_experts = 4, .topk = 2};
  std::vector<float> logits(64 * 4, 0.0f);
  for (int t = 0; t < 64; ++t) logits[t * 4] = 5.0f;  // everyone wants expert 0
  auto out = route(config, matrix(logits, 64, 4));
  ASSERT_TRUE(out.is_ok());
  EXPECT_EQ(out->capacity, 0);
  EXPECT_EQ(out->num_dropped, 0);
  EXPECT_EQ(out->tokens_per_expert[0], 64);
  for (int32_t e : out->topk_idx) EXPECT_GE(e, 0);
}

// Loss = sum_j c_j * w_j with fixed c; finite differences on the logits.
void check_backward(const RouterConfig& config, unsigned seed) {
  const int64_t T = 5;
  const int E = config.num_experts, K = config.topk;
  std::vector<float> logits = random_logits(T * E, seed);
  std::vector<float> c = random_logits(T * K, seed + 1, 1.0f);
  auto fwd = route(config, matrix(logits, T, E));
  ASSERT_TRUE(fwd.is_ok());
  auto grad = route_backward(config, *fwd, matrix(c, T, K));
  ASSERT_TRUE(grad.is_ok()) << grad.status().to_string();
  auto loss = [&](const std::vector<float>& l) {
    auto o = route(config, matrix(l, T, E));
    double s = 0;
    for (int64_t i = 0; i < T * K; ++i) s += double(c[i]) * o->topk_weights[i];
    return s;
  };
  double norm = 0;
  for (int64_t i = 0; i < T * E; ++i) {
    std::vector<float> plus = logits, minus = logits;
    const float h = 1e-2f;
    plus[i] += h;
    minus[i] -= h;
    const double fd = (loss(plus) - loss(minus)) / (2.0 * h);
    EXPECT_NEAR((*grad)[i], fd, 2e-3 + 1e-2 * std::abs(fd)) << "logit " << i;
    norm += std::abs((*grad)[i]);
  }
  EXPECT_GT(norm, 1e-3);
}

TEST(RouterBackward, SoftmaxMatchesFiniteDifferences) {
  check_backward({.num_experts = 6, .topk = 2, .scaling_factor = 1.5f}, 1);
}
TEST(RouterBackward, SoftmaxNormalizedMatchesFiniteDifferences) {
  check_backward({.num_experts = 6, .topk = 3, .normalize_weights = true}, 2);
}
TEST(RouterBackward, SigmoidNormalizedMatchesFiniteDifferences) {
  check_backward({.num_experts = 6, .topk = 2, .score_function = ScoreFunction::kSigmoid,
                  .normalize_weights = true, .scaling_factor = 2.0f}, 3);
}
TEST(RouterBackward, SoftmaxAfterTopkMatchesFiniteDifferences) {
  check_backward({.num_experts = 6, .topk = 2, .softmax_after_topk = true}, 4);
}
TEST(RouterBackward, DroppedSlotsContributeNothing) {
  RouterConfig config{.num_experts = 2, .topk = 1, .capacity_factor = 1.0};
  std::vector<float> logits = {1.0f, 0.0f, 3.0f, 0.0f, 2.0f, 0.0f, 4.0f, 0.0f};
  auto fwd = route(config, matrix(logits, 4, 2));
  ASSERT_TRUE(fwd.is_ok());
  std::vector<float> g(4, 1.0f);
  auto grad = route_backward(config, *fwd, matrix(g, 4, 1));
  ASSERT_TRUE(grad.is_ok());
  EXPECT_NE((*grad)[0], 0.0f);
  EXPECT_EQ((*grad)[4], 0.0f);
  EXPECT_EQ((*grad)[7], 0.0f);
}

TEST(RouterErrors, NameTheValueAndTheLimit) {
  std::vector<float> logits(4 * 8, 0.0f);
  auto expect = [&](RouterConfig config, const std::string& needle, int64_t cols = 8) {
    auto out = route(config, matrix(logits, 4, cols));
    ASSERT_FALSE(out.is_ok());
    EXPECT_EQ(out.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(out.status().message().find(needle), std::string::npos) << out.status().message();
  };
  expect({.num_experts = 8, .topk = 9}, "topk = 9 is outside [1, num_experts = 8]");
  expect({.num_experts = 8, .topk = 2, .num_groups = 3}, "num_experts = 8 is not divisible by num_groups = 3");
  expect({.num_experts = 8, .topk = 2, .num_groups = 4, .topk_groups = 5},
         "topk_groups = 5 is outside [1, num_groups = 4]");
  expect({.num_experts = 8, .topk = 2}, "logits must be [4, 8]", 4);
  expect({.num_experts = 8, .topk = 5, .num_groups = 4, .topk_groups = 2},
         "topk = 5 is larger than the 4 experts of the smallest 2 groups");
  std::vector<float> bias(7, 0.0f);
  auto out = route({.num_experts = 8, .topk = 2}, matrix(logits, 4, 8),
                   TensorView::contiguous(bias.data(), DType::kF32, {7}));
  ASSERT_FALSE(out.is_ok());
  EXPECT_NE(out.status().message().find("expert_bias must be a host f32[8]"), std::string::npos);
  auto fwd = route({.num_experts = 8, .topk = 2}, matrix(logits, 4, 8));
  ASSERT_TRUE(fwd.is_ok());
  std::vector<float> grad(4 * 3, 0.0f);
  auto back = route_backward({.num_experts = 8, .topk = 2}, *fwd, matrix(grad, 4, 3));
  ASSERT_FALSE(back.is_ok());
  EXPECT_NE(back.status().message().find("grad_topk_weights must be [4, 2]"), std::string::npos);
}

}  // namespace
}  // namespace epx

namespace epx {
namespace {

// A batch large enough to be split over threads routes every token exactly as
// routing that token alone does.
TEST(Router, ThreadSplitDoesNotChangeABit) {
  const int T = 2048, E = 256;
  std::vector<float> logits(T * E);
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  for (float& v : logits) v = u(rng);
  RouterConfig c;
  c.num_experts = E;
  c.topk = 8;
  c.score_function = ScoreFunction::kSigmoid;
  c.num_groups = 8;
  c.topk_groups = 4;
  c.normalize_weights = true;
  Result<RouterOutput> all = route(c, TensorView::contiguous(logits.data(), DType::kF32, {T, E}));
  ASSERT_TRUE(all.is_ok()) << all.status().to_string();
  for (int t = 0; t < T; t += 97) {
    Result<RouterOutput> one = route(c, TensorView::contiguous(logits.data() + t * E, DType::kF32, {1, E}));
    ASSERT_TRUE(one.is_ok());
    for (int k = 0; k < 8; ++k) {
      EXPECT_EQ(one->topk_idx[k], all->topk_idx[t * 8 + k]) << "token " << t;
      EXPECT_EQ(one->topk_weights[k], all->topk_weights[t * 8 + k]) << "token " << t;
    }
  }
}

// route_into reuses an output: a dropping call, then a dropless and a
// smaller one, each the same as route's fresh output, field by field.
TEST(Router, RouteIntoReusedOutputEqualsRoute) {
  const int E = 16;
  const std::vector<float> logits = random_logits(64 * E, 3);
  const RouterConfig dropping{.num_experts = E, .topk = 2, .capacity_factor = 0.5};
  const RouterConfig dropless{.num_experts = E, .topk = 4, .score_function = ScoreFunction::kSigmoid,
                              .normalize_weights = true, .num_groups = 4, .topk_groups = 2};
  RouterOutput reused;
  for (auto [config, tokens] : {std::pair{dropping, 64}, std::pair{dropless, 64}, std::pair{dropless, 5}}) {
    auto fresh = route(config, matrix(logits, tokens, E));
    ASSERT_TRUE(fresh.is_ok()) << fresh.status().to_string();
    ASSERT_TRUE(route_into(config, matrix(logits, tokens, E), {}, &reused).is_ok());
    EXPECT_EQ(reused.num_tokens, fresh->num_tokens);
    EXPECT_EQ(reused.topk, fresh->topk);
    EXPECT_EQ(reused.topk_idx, fresh->topk_idx);
    EXPECT_EQ(reused.topk_weights, fresh->topk_weights);
    EXPECT_EQ(reused.scores, fresh->scores);
    EXPECT_EQ(reused.selected_idx, fresh->selected_idx);
    EXPECT_EQ(reused.selected_probs, fresh->selected_probs);
    EXPECT_EQ(reused.capacity, fresh->capacity);
    EXPECT_EQ(reused.num_dropped, fresh->num_dropped);
    EXPECT_EQ(reused.tokens_per_expert, fresh->tokens_per_expert);
    EXPECT_EQ(reused.rows_per_expert, fresh->rows_per_expert);
  }
  EXPECT_EQ(route_into(dropless, matrix(logits, 4, E), {}, nullptr).code(), StatusCode::kInvalidArgument);
}

// A worker thread that cannot start leaves its tokens to the caller's thread:
// the same output, no exception, no thread left running.
TEST(Router, WorkersThatCannotStartGiveTheSameOutput) {
  if (std::thread::hardware_concurrency() < 2) GTEST_SKIP() << "one core: the router starts no worker threads";
  const int64_t T = 8192;
  const int E = 64;
  const std::vector<float> logits = random_logits(T * E, 11);
  RouterConfig config{.num_experts = E, .topk = 4};
  auto plain = route(config, matrix(logits, T, E));
  ASSERT_TRUE(plain.is_ok()) << plain.status().to_string();
  detail::fail_thread_starts(0, 1);  // T x E = 2^19 pairs: at least one worker, and it is refused
  auto fallback = route(config, matrix(logits, T, E));
  const bool unused = detail::take_injected_thread_failure();
  detail::fail_thread_starts(0, 0);
  EXPECT_FALSE(unused) << "the router started no worker thread";
  ASSERT_TRUE(fallback.is_ok()) << fallback.status().to_string();
  EXPECT_EQ(fallback->topk_idx, plain->topk_idx);
  EXPECT_EQ(fallback->topk_weights, plain->topk_weights);
  EXPECT_EQ(fallback->scores, plain->scores);
}

}  // namespace
}  // namespace epx
