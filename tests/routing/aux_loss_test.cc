#include "epx/routing/aux_loss.h"

#include <cmath>
#include <functional>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "epx/comm/inproc.h"
#include "epx/comm/topology.h"
#include "epx/routing/router.h"

namespace epx {
namespace {

TensorView f32(const std::vector<float>& v, int64_t rows, int64_t cols) {
  return TensorView::contiguous(v.data(), DType::kF32, {rows, cols});
}
TensorView i32(const std::vector<int32_t>& v, int64_t rows, int64_t cols) {
  return TensorView::contiguous(v.data(), DType::kI32, {rows, cols});
}

std::vector<float> random_logits(int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.5f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Direct reference: E * sum_i f_i P_i in double, from the definitions.
double reference_balancing(ScoreFunction fn, const std::vector<float>& logits, const std::vector<int32_t>& idx,
                           int64_t T, int64_t E, int64_t K) {
  std::vector<double> f(E, 0.0), p(E, 0.0);
  for (int32_t e : idx)
    if (e >= 0) f[e] += 1.0 / double(T * K);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> s(E);
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) {
      const double l = logits[t * E + e];
      s[e] = fn == ScoreFunction::kSoftmax ? std::exp(l) : 1.0 / (1.0 + std::exp(-l));
      sum += s[e];
    }
    for (int64_t e = 0; e < E; ++e) p[e] += s[e] / sum / double(T);
  }
  double loss = 0;
  for (int64_t e = 0; e < E; ++e) loss += f[e] * p[e];
  return double(E) * loss;
}

// Central differences of `loss` around `logits` with topk_idx held fixed
// (no gradient through f), compared with `grad`.
void expect_gradient(const std::function<double(const std::vector<float>&)>& loss, const std::vector<float>& logits,
                     const std::vector<float>& grad) {
  double norm = 0;
  for (std::size_t i = 0; i < logits.size(); ++i) {
    std::vector<float> plus = logits, minus = logits;
    const float h = 1e-2f;
    plus[i] += h;
    minus[i] -= h;
    const double fd = (loss(plus) - loss(minus)) / (2.0 * h);
    EXPECT_NEAR(grad[i], fd, 1e-4 + 1e-2 * std::abs(fd)) << "logit " << i;
    norm += std::abs(grad[i]);
  }
  EXPECT_GT(norm, 1e-4);
}

TEST(AuxLoss, HandValueUniformIsOne) {
  // Equal logits: P_i = 1/E; every expert gets the same share -> loss = 1.
  std::vector<float> logits(4 * 4, 0.0f);
  std::vector<int32_t> idx = {0, 1, 2, 3, 0, 1, 2, 3};  // T = 4, K = 2
  auto out = load_balancing_loss(ScoreFunction::kSoftmax, f32(logits, 4, 4), i32(idx, 4, 2));
  ASSERT_TRUE(out.is_ok()) << out.status().to_string();
  EXPECT_NEAR(out->loss, 1.0, 1e-12);
}

class AuxLossScore : public ::testing::TestWithParam<ScoreFunction> {};

TEST_P(AuxLossScore, MicroBatchValueAndGradient) {
  const ScoreFunction fn = GetParam();
  const int64_t T = 6, E = 5, K = 2;
  std::vector<float> logits = random_logits(T * E, 11);
  RouterConfig config{.num_experts = int(E), .topk = int(K), .score_function = fn};
  auto routed = route(config, f32(logits, T, E));
  ASSERT_TRUE(routed.is_ok());
  std::vector<int32_t> idx = routed->topk_idx;
  idx[3] = -1;  // a dropped slot counts in the denominator only
  auto out = load_balancing_loss(fn, f32(logits, T, E), i32(idx, T, K));
  ASSERT_TRUE(out.is_ok());
  EXPECT_NEAR(out->loss, reference_balancing(fn, logits, idx, T, E, K), 1e-9);
  expect_gradient([&](const std::vector<float>& l) { return reference_balancing(fn, l, idx, T, E, K); }, logits,
                  out->grad_logits);
}

TEST_P(AuxLossScore, SequenceWiseIsTheMeanOverSequences) {
  const ScoreFunction fn = GetParam();
  const int64_t T = 6, E = 4, K = 2, L = 3;
  std::vector<float> logits = random_logits(T * E, 12);
  std::vector<int32_t> idx = {0, 1, 0, 2, 0, 3, 1, 2, 3, 2, 1, 0};
  auto seq_ref = [&](const std::vector<float>& l) {
    double sum = 0;
    for (int64_t s = 0; s < T / L; ++s) {
      std::vector<float> ls(l.begin() + s * L * E, l.begin() + (s + 1) * L * E);
      std::vector<int32_t> is(idx.begin() + s * L * K, idx.begin() + (s + 1) * L * K);
      sum += reference_balancing(fn, ls, is, L, E, K);
    }
    return sum / double(T / L);
  };
  auto out = sequence_load_balancing_loss(fn, f32(logits, T, E), i32(idx, T, K), L);
  ASSERT_TRUE(out.is_ok());
  EXPECT_NEAR(out->loss, seq_ref(logits), 1e-9);
  EXPECT_GT(std::abs(out->loss - reference_balancing(fn, logits, idx, T, E, K)), 1e-6);
  expect_gradient(seq_ref, logits, out->grad_logits);
  auto bad = sequence_load_balancing_loss(fn, f32(logits, T, E), i32(idx, T, K), 4);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("num_tokens = 6 is not a multiple of seq_len = 4"), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Scores, AuxLossScore, ::testing::Values(ScoreFunction::kSoftmax, ScoreFunction::kSigmoid));

TEST(ZLoss, ValueAndGradient) {
  const int64_t T = 3, E = 4;
  std::vector<float> logits = random_logits(T * E, 13);
  auto ref = [&](const std::vector<float>& l) {
    double sum = 0;
    for (int64_t t = 0; t < T; ++t) {
      double z = 0;
      for (int64_t e = 0; e < E; ++e) z += std::exp(double(l[t * E + e]));
      sum += std::log(z) * std::log(z);
    }
    return sum / double(T);
  };
  auto out = router_z_loss(f32(logits, T, E));
  ASSERT_TRUE(out.is_ok());
  EXPECT_NEAR(out->loss, ref(logits), 1e-9);
  EXPECT_GT(out->loss, 0.0);
  expect_gradient(ref, logits, out->grad_logits);
}

TEST(AuxLoss, RejectsBadIndices) {
  std::vector<float> logits(2 * 4, 0.0f);
  std::vector<int32_t> idx = {0, 4};
  auto out = load_balancing_loss(ScoreFunction::kSoftmax, f32(logits, 2, 4), i32(idx, 2, 1));
  ASSERT_FALSE(out.is_ok());
  EXPECT_NE(out.status().message().find("topk_idx[1][0] = 4 is outside [-1, 4)"), std::string::npos);
}

// 4 ranks with different token counts equal one process on the concatenation.
TEST(AuxLoss, GlobalBatchOverFourRanksEqualsConcatenated) {
  const int64_t E = 6, K = 2;
  const std::vector<int64_t> rank_tokens = {3, 5, 0, 4};
  const int64_t T = 12;
  std::vector<float> logits = random_logits(T * E, 14);
  RouterConfig config{.num_experts = int(E), .topk = int(K), .score_function = ScoreFunction::kSigmoid};
  auto routed = route(config, f32(logits, T, E));
  ASSERT_TRUE(routed.is_ok());
  const std::vector<int32_t>& idx = routed->topk_idx;
  auto whole = load_balancing_loss(ScoreFunction::kSigmoid, f32(logits, T, E), i32(idx, T, K));
  ASSERT_TRUE(whole.is_ok());

  auto topo = Topology::create(4, 1);
  ASSERT_TRUE(topo.is_ok());
  std::vector<double> losses(4, -1.0);
  std::vector<std::vector<float>> grads(4);
  auto statuses = run_ranks(*topo, [&](Transport& t) -> Status {
    const int r = t.rank();
    int64_t first = 0;
    for (int i = 0; i < r; ++i) first += rank_tokens[i];
    const int64_t n = rank_tokens[r];
    auto out = global_load_balancing_loss(
        ScoreFunction::kSigmoid, TensorView::contiguous(logits.data() + first * E, DType::kF32, {n, E}),
        TensorView::contiguous(idx.data() + first * K, DType::kI32, {n, K}), t,
        Deadline::after(std::chrono::seconds(10)));
    if (!out.is_ok()) return out.status();
    losses[r] = out->loss;
    grads[r] = out->grad_logits;
    return Status::ok();
  });
  ASSERT_TRUE(first_error(statuses).is_ok()) << first_error(statuses).to_string();
  int64_t first = 0;
  for (int r = 0; r < 4; ++r) {
    EXPECT_NEAR(losses[r], whole->loss, 1e-9) << "rank " << r;
    ASSERT_EQ(static_cast<int64_t>(grads[r].size()), rank_tokens[r] * E);
    for (int64_t i = 0; i < rank_tokens[r] * E; ++i)
      EXPECT_NEAR(grads[r][i], whole->grad_logits[first * E + i], 1e-6) << "rank " << r << " element " << i;
    first += rank_tokens[r];
  }
}

}  // namespace
}  // namespace epx
