#include "epx/experts/ffn.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <oneapi/dnnl/dnnl_types.h>

#include "experts/gemm.h"

namespace epx {
namespace {

// Tolerances, as a fraction of the largest magnitude in the reference tensor:
// f32 storage differs from the double reference by fp32 rounding only; bf16
// storage is compared with a reference on the same bf16-rounded x and weights,
// and differs by the bf16 rounding of the GEMM operands epx rounds (a; in
// backward also grad_y, grad_h1, grad_h3): 2^-9 relative each, mostly
// cancelling over the sums. Observed worst on these cases: 3.1e-7 (f32) and
// 3.6e-3 (bf16).
constexpr double kTolF32 = 2e-6;
constexpr double kTolBF16 = 1e-2;

// Values stored as f32 or bf16, with the float each element stands for.
struct Stored {
  DType dtype = DType::kF32;
  int64_t rows = 0, cols = 0, ld = 0;
  std::vector<float> f32;      // f32 storage, or the bf16 values as floats
  std::vector<uint16_t> bf16;  // bf16 storage
  const void* data() const { return dtype == DType::kBF16 ? static_cast<const void*>(bf16.data()) : f32.data(); }
  float at(int64_t r, int64_t c) const { return f32[r * ld + c]; }
  TensorView view() const { return TensorView(data(), dtype, {rows, cols}, {ld, 1}); }
};

Stored make_stored(DType dtype, int64_t rows, int64_t cols, std::mt19937& rng, float scale, int64_t ld = 0) {
  Stored s{dtype, rows, cols, ld == 0 ? cols : ld, {}, {}};
  std::uniform_real_distribution<float> dist(-scale, scale);
  s.f32.assign(rows * s.ld, 0.0f);
  for (float& v : s.f32) v = dist(rng);
  if (dtype == DType::kBF16) {
    s.bf16.resize(s.f32.size());
    for (std::size_t i = 0; i < s.f32.size(); ++i) {
      s.bf16[i] = f32_to_bf16(s.f32[i]);
      s.f32[i] = bf16_to_f32(s.bf16[i]);
    }
  }
  return s;
}

void zero_row(Stored& s, int64_t r) {
  for (int64_t c = 0; c < s.cols; ++c) {
    s.f32[r * s.ld + c] = 0.0f;
    if (s.dtype == DType::kBF16) s.bf16[r * s.ld + c] = 0;
  }
}

TensorView f32_view(std::vector<float>& v, int64_t rows, int64_t cols) {
  return TensorView::contiguous(v.data(), DType::kF32, {rows, cols});
}

std::vector<int64_t> offsets_of(const std::vector<int64_t>& counts) {
  std::vector<int64_t> offsets{0};
  for (int64_t c : counts) offsets.push_back(offsets.back() + c);
  return offsets;
}

// A whole problem: config, weights, x, offsets.
struct Problem {
  ExpertFfnConfig config;
  Stored w1, w3, w2, x;
  std::vector<int64_t> offsets;
  int64_t rows() const { return offsets.back(); }
  const PackedExpertWeights* packed = nullptr;  // the weights packed, or null (plain calls)
  ExpertWeights weights() const { return {w1.view(), w3.view(), w2.view(), packed}; }
};

Problem make_problem(DType dtype, int H, int F, const std::vector<int64_t>& counts, unsigned seed, int64_t x_ld = 0) {
  std::mt19937 rng(seed);
  Problem p;
  const int E = static_cast<int>(counts.size());
  p.config = ExpertFfnConfig{.num_experts = E, .hidden = H, .ffn_hidden = F, .dtype = dtype, .num_threads = 1};
  p.offsets = offsets_of(counts);
  // Scales so that h1, h3 and y are of order 1.
  p.w1 = make_stored(dtype, int64_t(E) * H, F, rng, 2.0f / std::sqrt(float(H)));
  p.w3 = make_stored(dtype, int64_t(E) * H, F, rng, 2.0f / std::sqrt(float(H)));
  p.w2 = make_stored(dtype, int64_t(E) * F, H, rng, 2.0f / std::sqrt(float(F)));
  p.x = make_stored(dtype, p.rows(), H, rng, 1.5f, x_ld);
  return p;
}

// The definitions, in double, one row at a time.
struct Reference {
  std::vector<double> y, grad_x, grad_w1, grad_w3, grad_w2;
};

Reference reference(const Problem& p, const std::vector<float>* grad_y) {
  const int E = p.config.num_experts, H = p.config.hidden, F = p.config.ffn_hidden;
  const int64_t rows = p.rows();
  Reference r;
  r.y.assign(rows * H, 0.0);
  r.grad_x.assign(rows * H, 0.0);
  r.grad_w1.assign(int64_t(E) * H * F, 0.0);
  r.grad_w3.assign(int64_t(E) * H * F, 0.0);
  r.grad_w2.assign(int64_t(E) * F * H, 0.0);
  std::vector<double> h1(F), h3(F), a(F), ga(F), gh1(F), gh3(F);
  for (int e = 0; e < E; ++e) {
    for (int64_t t = p.offsets[e]; t < p.offsets[e + 1]; ++t) {
      for (int f = 0; f < F; ++f) {
        double s1 = 0, s3 = 0;
        for (int h = 0; h < H; ++h) {
          s1 += double(p.x.at(t, h)) * p.w1.at(int64_t(e) * H + h, f);
          s3 += double(p.x.at(t, h)) * p.w3.at(int64_t(e) * H + h, f);
        }
        h1[f] = s1, h3[f] = s3;
        const double sig = 1.0 / (1.0 + std::exp(-s1));
        a[f] = s1 * sig * s3;
      }
      for (int h = 0; h < H; ++h) {
        double s = 0;
        for (int f = 0; f < F; ++f) s += a[f] * p.w2.at(int64_t(e) * F + f, h);
        r.y[t * H + h] = s;
      }
      if (grad_y == nullptr) continue;
      const float* gy = grad_y->data() + t * H;
      for (int f = 0; f < F; ++f) {
        double s = 0;
        for (int h = 0; h < H; ++h) s += double(gy[h]) * p.w2.at(int64_t(e) * F + f, h);
        ga[f] = s;
        const double sig = 1.0 / (1.0 + std::exp(-h1[f]));
        gh3[f] = s * h1[f] * sig;
        gh1[f] = s * h3[f] * sig * (1.0 + h1[f] * (1.0 - sig));
      }
      for (int f = 0; f < F; ++f)
        for (int h = 0; h < H; ++h) r.grad_w2[(int64_t(e) * F + f) * H + h] += a[f] * gy[h];
      for (int h = 0; h < H; ++h)
        for (int f = 0; f < F; ++f) {
          r.grad_w1[(int64_t(e) * H + h) * F + f] += double(p.x.at(t, h)) * gh1[f];
          r.grad_w3[(int64_t(e) * H + h) * F + f] += double(p.x.at(t, h)) * gh3[f];
        }
      for (int h = 0; h < H; ++h) {
        double s = 0;
        for (int f = 0; f < F; ++f)
          s += gh1[f] * p.w1.at(int64_t(e) * H + h, f) + gh3[f] * p.w3.at(int64_t(e) * H + h, f);
        r.grad_x[t * H + h] = s;
      }
    }
  }
  return r;
}

// |got - (offset + want)| <= tol * max |want| everywhere, and want is not all zero.
void expect_close(const std::vector<float>& got, const std::vector<double>& want, double tol, const char* what,
                  float offset = 0.0f) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 0;
  for (double w : want) scale = std::max(scale, std::abs(w));
  ASSERT_GT(scale, 0.0) << what << ": the reference is all zero, so the comparison proves nothing";
  double worst = 0;
  std::size_t worst_i = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(double(got[i]) - (double(offset) + want[i]));
    if (!(err <= worst)) worst = err, worst_i = i;  // also catches NaN
  }
  EXPECT_LE(worst, tol * scale) << what << "[" << worst_i << "] = " << got[worst_i] << ", want "
                                << double(offset) + want[worst_i] << " (scale " << scale << ")";
}

std::vector<float> random_f32(int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

struct Outputs {
  std::vector<float> y, grad_x, grad_w1, grad_w3, grad_w2;
};

// Forward, then backward of sum(y * grad_y), with the weight gradients
// starting at `grad_start` (backward adds to them).
Outputs run_both(const Problem& p, const std::vector<float>& grad_y, float grad_start = 0.0f,
                 const ExpertWeights* weights = nullptr) {
  const ExpertWeights w = weights != nullptr ? *weights : p.weights();
  const int64_t E = p.config.num_experts, H = p.config.hidden, F = p.config.ffn_hidden, rows = p.rows();
  Outputs o;
  o.y.assign(rows * H, -7.0f);  // overwritten
  o.grad_x.assign(rows * H, -7.0f);
  o.grad_w1.assign(E * H * F, grad_start);
  o.grad_w3.assign(E * H * F, grad_start);
  o.grad_w2.assign(E * F * H, grad_start);
  ExpertFfnCache cache;
  Status s = expert_ffn_forward(p.config, w, p.x.view(), p.offsets, f32_view(o.y, rows, H), &cache);
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  std::vector<float> gy = grad_y;
  ExpertGrads grads{f32_view(o.grad_w1, E * H, F), f32_view(o.grad_w3, E * H, F), f32_view(o.grad_w2, E * F, H)};
  s = expert_ffn_backward(p.config, w, p.x.view(), p.offsets, cache, f32_view(gy, rows, H),
                          f32_view(o.grad_x, rows, H), grads);
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  return o;
}

void check_against_reference(const Problem& p, double tol, float grad_start = 0.0f) {
  const auto grad_y = random_f32(p.rows() * p.config.hidden, 99);
  const Reference ref = reference(p, &grad_y);
  const Outputs o = run_both(p, grad_y, grad_start);
  expect_close(o.y, ref.y, tol, "y");
  expect_close(o.grad_x, ref.grad_x, tol, "grad_x");
  expect_close(o.grad_w1, ref.grad_w1, tol, "grad_w1", grad_start);
  expect_close(o.grad_w3, ref.grad_w3, tol, "grad_w3", grad_start);
  expect_close(o.grad_w2, ref.grad_w2, tol, "grad_w2", grad_start);
}

// The hand-checkable case first: one expert, H = F = 1, w1 = w3 = w2 = 1, x = 2:
// h1 = h3 = 2, a = silu(2) * 2 = 4 / (1 + e^-2), y = a.
TEST(ExpertFfn, OneByOneByHand) {
  const float one = 1.0f, x = 2.0f;
  ExpertFfnConfig config{.num_experts = 1, .hidden = 1, .ffn_hidden = 1, .num_threads = 1};
  ExpertWeights w{TensorView::contiguous(&one, DType::kF32, {1, 1}), TensorView::contiguous(&one, DType::kF32, {1, 1}),
                  TensorView::contiguous(&one, DType::kF32, {1, 1})};
  float y = 0;
  const std::vector<int64_t> offsets{0, 1};
  ASSERT_TRUE(expert_ffn_forward(config, w, TensorView::contiguous(&x, DType::kF32, {1, 1}), offsets,
                                 TensorView::contiguous(&y, DType::kF32, {1, 1}), nullptr)
                  .is_ok());
  EXPECT_NEAR(y, 4.0 / (1.0 + std::exp(-2.0)), 1e-6);
}

TEST(ExpertFfn, F32MatchesReferenceWithUnevenAndEmptyExperts) {
  for (int threads : {1, 2}) {
    for (auto schedule : {ExpertFfnSchedule::kAuto, ExpertFfnSchedule::kSplitGemms, ExpertFfnSchedule::kSplitExperts}) {
      SCOPED_TRACE(testing::Message() << "threads " << threads << " schedule " << int(schedule));
      Problem p = make_problem(DType::kF32, 48, 80, {7, 0, 33, 1, 0, 12}, 1);
      p.config.num_threads = threads;
      p.config.schedule = schedule;
      check_against_reference(p, kTolF32, 0.25f);
    }
  }
}

TEST(ExpertFfn, BF16MatchesReferenceOnRoundedInputs) {
  for (int threads : {1, 0}) {
    SCOPED_TRACE(testing::Message() << "threads " << threads);
    Problem p = make_problem(DType::kBF16, 64, 96, {20, 3, 0, 41}, 2);
    p.config.num_threads = threads;
    check_against_reference(p, kTolBF16, 0.5f);
  }
}

TEST(ExpertFfn, StridedRowsOfX) {
  Problem p = make_problem(DType::kF32, 32, 40, {5, 9}, 3, /*x_ld=*/40);
  check_against_reference(p, kTolF32);
  Problem q = make_problem(DType::kBF16, 32, 40, {5, 9}, 3, /*x_ld=*/48);
  check_against_reference(q, kTolBF16);
}

TEST(ExpertFfn, AllExpertsEmpty) {
  Problem p = make_problem(DType::kF32, 16, 24, {0, 0, 0}, 4);
  std::vector<float> y;
  ExpertFfnCache cache;
  ASSERT_TRUE(expert_ffn_forward(p.config, p.weights(), p.x.view(), p.offsets,
                                 TensorView::contiguous(y.data(), DType::kF32, {0, 16}), &cache)
                  .is_ok());
  EXPECT_EQ(cache.rows, 0);
}

TEST(ExpertFfn, PaddingRowsGiveZeroOutputAndGradients) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    Problem p = make_problem(dtype, 32, 48, {6, 4}, 5);
    // Each expert's group padded at its end, as the expanded layout does.
    for (int64_t r : {4, 5, 9}) zero_row(p.x, r);
    const int64_t H = 32;
    auto grad_y = random_f32(p.rows() * H, 6);
    const Outputs o = run_both(p, grad_y);
    const Reference ref = reference(p, &grad_y);
    expect_close(o.y, ref.y, dtype == DType::kF32 ? kTolF32 : kTolBF16, "y");
    for (int64_t r : {4, 5, 9})
      for (int64_t h = 0; h < H; ++h) ASSERT_EQ(o.y[r * H + h], 0.0f) << "padding row " << r << " column " << h;
  }
}

// x stored in `dtype` (its values rounded to bf16 first when either side is
// bf16, so both stand for the same numbers).
Stored restore(const Stored& s, DType dtype) {
  Stored out = s;
  out.dtype = dtype;
  out.bf16.resize(s.f32.size());
  for (std::size_t i = 0; i < s.f32.size(); ++i) out.bf16[i] = f32_to_bf16(s.f32[i]);
  if (dtype == DType::kF32) out.bf16.clear();
  return out;
}

void expect_same_bits(const Outputs& got, const Outputs& want) {
  for (auto [g, w, what] : {std::tuple{&got.y, &want.y, "y"}, {&got.grad_x, &want.grad_x, "grad_x"},
                            {&got.grad_w1, &want.grad_w1, "grad_w1"}, {&got.grad_w3, &want.grad_w3, "grad_w3"},
                            {&got.grad_w2, &want.grad_w2, "grad_w2"}}) {
    ASSERT_EQ(g->size(), w->size()) << what;
    ASSERT_TRUE(std::any_of(w->begin(), w->end(), [](float v) { return v != 0.0f; })) << what << " is all zero";
    for (std::size_t i = 0; i < g->size(); ++i) ASSERT_EQ((*g)[i], (*w)[i]) << what << "[" << i << "]";
  }
}

// The auto compute type's rule, by CPU: bf16 GEMMs with AVX512-BF16 on AMD
// (measured faster) or with AMX (assumed), f32 otherwise (AVX512-BF16 on
// Intel measured slower), and never for an f32 payload.
TEST(ExpertFfn, AutoComputeDtypeIsBf16OnlyWithAmdBf16OrAmx) {
  const int avx512 = dnnl_cpu_isa_avx512_core, bf16 = dnnl_cpu_isa_avx512_core_bf16,
            amx = dnnl_cpu_isa_avx512_core_amx, avx2 = dnnl_cpu_isa_avx2, vnni = dnnl_cpu_isa_avx512_core_vnni,
            avx2_vnni = dnnl_cpu_isa_avx2_vnni;
  EXPECT_TRUE(detail::bf16_gemm_beats_f32(amx, /*amd=*/false));
  EXPECT_TRUE(detail::bf16_gemm_beats_f32(amx, /*amd=*/true));
  EXPECT_FALSE(detail::bf16_gemm_beats_f32(vnni, /*amd=*/true));
  EXPECT_FALSE(detail::bf16_gemm_beats_f32(avx2_vnni, /*amd=*/true));
  EXPECT_TRUE(detail::bf16_gemm_beats_f32(bf16, /*amd=*/true));
  EXPECT_FALSE(detail::bf16_gemm_beats_f32(bf16, /*amd=*/false));
  EXPECT_FALSE(detail::bf16_gemm_beats_f32(avx512, /*amd=*/true));
  EXPECT_FALSE(detail::bf16_gemm_beats_f32(avx2, /*amd=*/false));
  EXPECT_EQ(faster_compute_dtype(DType::kF32), DType::kF32);
  EXPECT_EQ(faster_compute_dtype(DType::kBF16), detail::bf16_gemm_beats_f32() ? DType::kBF16 : DType::kF32);
}

// compute_dtype apart from dtype: x converted on its way into the GEMMs
// gives the bits of x stored in the compute dtype (a bf16 payload widens
// exactly; an f32 payload rounds to nearest even as the bf16 path does).
TEST(ExpertFfn, ComputeDtypeApartFromThePayloadGivesTheComputeDtypesBits) {
  for (DType compute : {DType::kF32, DType::kBF16}) {
    const DType payload = compute == DType::kF32 ? DType::kBF16 : DType::kF32;
    SCOPED_TRACE(testing::Message() << "payload " << dtype_name(payload) << ", compute " << dtype_name(compute));
    Problem want = make_problem(compute, 40, 56, {19, 0, 5, 33}, 11);  // 19, 5: rows past whole blocks of 16
    std::mt19937 rng(12);
    want.x = restore(make_stored(DType::kBF16, want.rows(), 40, rng, 1.5f), compute);
    Problem got = want;
    got.x = restore(want.x, payload);
    got.config.dtype = payload;
    got.config.compute_dtype = compute;
    const auto grad_y = random_f32(want.rows() * 40, 13);
    expect_same_bits(run_both(got, grad_y, 0.5f), run_both(want, grad_y, 0.5f));
  }
}

TEST(ExpertFfn, WeightsOfThePayloadDtypeAreRefusedWhenComputeDiffers) {
  Problem p = make_problem(DType::kBF16, 16, 24, {3}, 14);
  p.config.compute_dtype = DType::kF32;
  std::vector<float> y(3 * 16);
  const Status s = expert_ffn_forward(p.config, p.weights(), p.x.view(), p.offsets, f32_view(y, 3, 16), nullptr);
  EXPECT_NE(s.message().find("weights.w1"), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find("f32"), std::string::npos) << s.to_string();
}

// d/dv of sum(y * g) by central differences, for every weight and x value of
// a tiny f32 problem, against the backward.
TEST(ExpertFfn, BackwardMatchesFiniteDifferences) {
  Problem p = make_problem(DType::kF32, 4, 3, {2, 0, 3}, 7);
  const int64_t H = 4, rows = p.rows();
  const auto g = random_f32(rows * H, 8);
  const Outputs o = run_both(p, g);
  auto loss = [&](const Problem& q) {
    std::vector<float> y(rows * H);
    Status s = expert_ffn_forward(q.config, q.weights(), q.x.view(), q.offsets, f32_view(y, rows, H), nullptr);
    EXPECT_TRUE(s.is_ok()) << s.to_string();
    double sum = 0;
    for (int64_t i = 0; i < rows * H; ++i) sum += double(y[i]) * g[i];
    return sum;
  };
  auto check = [&](Stored Problem::*member, const std::vector<float>& grad, const char* what) {
    double scale = 0;
    for (float v : grad) scale = std::max(scale, double(std::abs(v)));
    ASSERT_GT(scale, 0.0) << what;
    for (std::size_t i = 0; i < grad.size(); ++i) {
      Problem plus = p, minus = p;
      const float step = 1e-2f;
      (plus.*member).f32[i] += step;
      (minus.*member).f32[i] -= step;
      const double fd = (loss(plus) - loss(minus)) / (2.0 * step);
      EXPECT_NEAR(grad[i], fd, 2e-3 * scale + 1e-4) << what << "[" << i << "]";
    }
  };
  check(&Problem::x, o.grad_x, "grad_x");
  check(&Problem::w1, o.grad_w1, "grad_w1");
  check(&Problem::w3, o.grad_w3, "grad_w3");
  check(&Problem::w2, o.grad_w2, "grad_w2");
}

// Ranks run as threads and each passes num_threads = 1: four calls at once
// give the same bits as the same calls one after another.
TEST(ExpertFfn, ConcurrentCallsWithOneThreadEach) {
  constexpr int kCallers = 4;
  std::vector<Problem> problems;
  std::vector<std::vector<float>> grad_ys;
  std::vector<Outputs> alone;
  for (int i = 0; i < kCallers; ++i) {
    problems.push_back(make_problem(i % 2 ? DType::kBF16 : DType::kF32, 64, 128, {10 + i, 0, 50, 3 * i}, 20 + i));
    grad_ys.push_back(random_f32(problems.back().rows() * 64, 30 + i));
    alone.push_back(run_both(problems.back(), grad_ys.back()));
  }
  std::vector<std::vector<Outputs>> together(kCallers);
  std::vector<std::thread> threads;
  for (int i = 0; i < kCallers; ++i)
    threads.emplace_back([&, i] {
      for (int rep = 0; rep < 3; ++rep) together[i].push_back(run_both(problems[i], grad_ys[i]));
    });
  for (auto& t : threads) t.join();
  for (int i = 0; i < kCallers; ++i) {
    const Reference ref = reference(problems[i], &grad_ys[i]);
    expect_close(alone[i].y, ref.y, i % 2 ? kTolBF16 : kTolF32, "y alone");
    for (const Outputs& o : together[i]) {
      EXPECT_EQ(o.y, alone[i].y) << "caller " << i;
      EXPECT_EQ(o.grad_x, alone[i].grad_x) << "caller " << i;
      EXPECT_EQ(o.grad_w1, alone[i].grad_w1) << "caller " << i;
      EXPECT_EQ(o.grad_w3, alone[i].grad_w3) << "caller " << i;
      EXPECT_EQ(o.grad_w2, alone[i].grad_w2) << "caller " << i;
    }
  }
}

// The same inputs and thread count give the same bits, run after run.
TEST(ExpertFfn, SameBitsEveryRun) {
  for (auto schedule : {ExpertFfnSchedule::kSplitGemms, ExpertFfnSchedule::kSplitExperts}) {
    Problem p = make_problem(DType::kBF16, 96, 160, {40, 7, 0, 90}, 40);
    p.config.num_threads = 2;
    p.config.schedule = schedule;
    const auto grad_y = random_f32(p.rows() * 96, 41);
    const Outputs first = run_both(p, grad_y);
    for (int rep = 0; rep < 3; ++rep) {
      const Outputs again = run_both(p, grad_y);
      EXPECT_EQ(again.y, first.y);
      EXPECT_EQ(again.grad_x, first.grad_x);
      EXPECT_EQ(again.grad_w1, first.grad_w1);
      EXPECT_EQ(again.grad_w2, first.grad_w2);
    }
  }
}

// A bf16 y (the layer's receiver-weighted combine writes y straight into the
// Buffer's combine region in bf16): each value is the f32 y's rounded to
// nearest even, on tails of partial row blocks too.
TEST(ExpertFfn, Bf16YIsTheF32YRounded) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const Problem p = make_problem(dtype, 48, 80, {21, 0, 16, 5}, 43);
    const int64_t rows = p.rows(), H = 48;
    std::vector<float> y32(rows * H);
    std::vector<uint16_t> y16(rows * H);
    ASSERT_TRUE(expert_ffn_forward(p.config, p.weights(), p.x.view(), p.offsets, f32_view(y32, rows, H), nullptr).is_ok());
    const Status s16 = expert_ffn_forward(p.config, p.weights(), p.x.view(), p.offsets,
                                          TensorView::contiguous(y16.data(), DType::kBF16, {rows, H}), nullptr);
    ASSERT_TRUE(s16.is_ok()) << s16.to_string();
    int differs = 0;
    for (int64_t i = 0; i < rows * H; ++i) {
      EXPECT_EQ(y16[i], f32_to_bf16(y32[i])) << dtype_name(dtype) << " element " << i;
      differs += bf16_to_f32(y16[i]) != y32[i];
    }
    EXPECT_GT(differs, 0) << "nothing was rounded";
  }
}

// bf16 GEMMs: the data pass keeps grad_y rounded for the weight pass, which
// rounds grad_y itself when the state holds none (a state gathered from
// parts); both give the same bits, and the kept rows are grad_y's rounding.
TEST(ExpertFfn, WeightPassReadsTheDataPassRoundingOfGradY) {
  Problem p = make_problem(DType::kBF16, 48, 80, {20, 0, 33, 5}, 42);
  const int64_t E = p.config.num_experts, H = 48, F = 80, rows = p.rows();
  std::vector<float> y(rows * H), grad_x(rows * H), gy = random_f32(rows * H, 43);
  ExpertFfnCache cache;
  ASSERT_TRUE(expert_ffn_forward(p.config, p.weights(), p.x.view(), p.offsets, f32_view(y, rows, H), &cache).is_ok());
  ExpertFfnGradState state;
  ASSERT_TRUE(expert_ffn_backward_data(p.config, p.weights(), p.x.view(), p.offsets, cache, f32_view(gy, rows, H),
                                       f32_view(grad_x, rows, H), &state)
                  .is_ok());
  ASSERT_EQ(state.grad_y.size(), static_cast<std::size_t>(rows * H) * 2);
  for (int64_t i = 0; i < rows * H; ++i) {
    uint16_t kept;
    std::memcpy(&kept, state.grad_y.data() + i * 2, 2);
    ASSERT_EQ(kept, f32_to_bf16(gy[i])) << "grad_y[" << i << "]";
  }
  auto weight_pass = [&](const ExpertFfnGradState& s) {
    std::vector<float> g(static_cast<std::size_t>(E * H * F * 2 + E * F * H), 0.5f);
    float* w1 = g.data();
    float* w3 = w1 + E * H * F;
    float* w2 = w3 + E * H * F;
    ExpertGrads grads{TensorView::contiguous(w1, DType::kF32, {E * H, F}),
                      TensorView::contiguous(w3, DType::kF32, {E * H, F}),
                      TensorView::contiguous(w2, DType::kF32, {E * F, H})};
    EXPECT_TRUE(expert_ffn_backward_weights(p.config, p.weights(), p.x.view(), p.offsets, f32_view(gy, rows, H), s,
                                            grads)
                    .is_ok());
    return g;
  };
  const std::vector<float> kept = weight_pass(state);
  ExpertFfnGradState without = state;
  without.grad_y.clear();
  EXPECT_EQ(kept, weight_pass(without));
}

void expect_invalid(const Status& s, const std::string& text) {
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find(text), std::string::npos) << "message: " << s.message() << "\nwanted: " << text;
}

TEST(ExpertFfn, RejectsBadInputs) {
  Problem p = make_problem(DType::kF32, 8, 12, {3, 2}, 9);
  const int64_t rows = p.rows();
  std::vector<float> y(rows * 8);
  auto forward = [&](const ExpertFfnConfig& config, std::span<const int64_t> offsets, const TensorView& x) {
    return expert_ffn_forward(config, p.weights(), x, offsets, f32_view(y, rows, 8), nullptr);
  };
  const TensorView x = p.x.view();
  expect_invalid(forward(p.config, std::vector<int64_t>{0, 5}, x), "offsets has 2 entries; it must have num_experts + 1 = 3");
  expect_invalid(forward(p.config, std::vector<int64_t>{0, 4, 3}, x), "offsets[2] = 3 is below offsets[1] = 4");
  expect_invalid(forward(p.config, std::vector<int64_t>{0, 3, 4}, x), "offsets[2] = 4 must equal the rows of x, 5");
  expect_invalid(forward(p.config, std::vector<int64_t>{1, 3, 5}, x), "offsets[0] = 1 must be 0");
  ExpertFfnConfig bad = p.config;
  bad.dtype = DType::kI32;
  expect_invalid(forward(bad, p.offsets, x), "dtype = i32 is not supported by the experts");
  bad = p.config;
  bad.num_threads = -2;
  expect_invalid(forward(bad, p.offsets, x), "num_threads = -2 must be >= 0");
  bad = p.config;
  bad.hidden = 0;
  expect_invalid(forward(bad, p.offsets, x), "hidden = 0 must be positive");
  bad = p.config;
  bad.dtype = DType::kBF16;
  expect_invalid(forward(bad, p.offsets, x), "weights.w1 must be bf16");
  const Stored x_wide = make_stored(DType::kF32, rows, 9, *std::make_unique<std::mt19937>(1), 1.0f);
  expect_invalid(forward(p.config, p.offsets, x_wide.view()), "x must be [5, 8]");
  expect_invalid(expert_ffn_forward(p.config, p.weights(), x, p.offsets, f32_view(y, rows - 1, 8), nullptr),
                 "y must be [5, 8]");

  // Backward: a cache from another call.
  ExpertFfnCache cache;
  ASSERT_TRUE(expert_ffn_forward(p.config, p.weights(), x, p.offsets, f32_view(y, rows, 8), &cache).is_ok());
  cache.rows = 4;
  std::vector<float> gy(rows * 8, 1.0f), gx(rows * 8), g1(2 * 8 * 12), g3(2 * 8 * 12), g2(2 * 12 * 8);
  ExpertGrads grads{f32_view(g1, 16, 12), f32_view(g3, 16, 12), f32_view(g2, 24, 8)};
  expect_invalid(expert_ffn_backward(p.config, p.weights(), x, p.offsets, cache, f32_view(gy, rows, 8),
                                     f32_view(gx, rows, 8), grads),
                 "cache holds 4 rows (h1 60 and h3 60 values) but x has 5 rows");
  cache.rows = rows;
  ExpertGrads short_grads{f32_view(g1, 16, 12), f32_view(g3, 16, 12), f32_view(g2, 23, 8)};
  expect_invalid(expert_ffn_backward(p.config, p.weights(), x, p.offsets, cache, f32_view(gy, rows, 8),
                                     f32_view(gx, rows, 8), short_grads),
                 "grads.w2 must be [24, 8]");
}

// The rows of expert e from `first[e]` on, `count[e]` of them, for each
// expert: a chunk of p's rows, as an overlap mode's chunk holds them.
Problem chunk_of(const Problem& p, const std::vector<int64_t>& first, const std::vector<int64_t>& count) {
  Problem c = p;
  c.offsets = offsets_of(count);
  const int64_t H = p.config.hidden;
  c.x = make_stored(DType::kBF16, c.rows(), H, *std::make_unique<std::mt19937>(0), 1.0f);
  for (std::size_t e = 0; e < count.size(); ++e)
    for (int64_t r = 0; r < count[e]; ++r)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t from = (p.offsets[e] + first[e] + r) * p.x.ld + h, to = (c.offsets[e] + r) * c.x.ld + h;
        c.x.bf16[to] = p.x.bf16[from], c.x.f32[to] = p.x.f32[from];
      }
  return c;
}

// Packed weights (bf16 GEMMs), with uneven row counts, an expert with no
// rows and partial row blocks: the rows of two chunks (one call each, as the
// overlap modes make them) get the whole call's bits in y (f32 and bf16) and
// grad_x; everything is the plain calls' within fp32 summation order; and a
// planted mix-up of two experts' packed weights is caught.
TEST(ExpertFfn, PackedWeightsKeepTheirBitsAcrossChunksAndMatchThePlainCalls) {
  Problem p = make_problem(DType::kBF16, 96, 64, {37, 0, 5, 70, 16}, 44);
  const int64_t H = 96, rows = p.rows();
  const auto grad_y = random_f32(rows * H, 45);
  const Outputs plain = run_both(p, grad_y);
  PackedExpertWeights packed;
  const Status s = pack_expert_weights(p.config, p.weights(), &packed);
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  p.packed = &packed;
  const int64_t calls = detail::packed_gemm_calls();
  const Outputs whole = run_both(p, grad_y);
  ASSERT_GT(detail::packed_gemm_calls(), calls) << "no call read the packed weights";
  auto close = [](const std::vector<float>& got, const std::vector<float>& want, const char* what) {
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t i = 0; i < got.size(); ++i)
      ASSERT_NEAR(got[i], want[i], 1e-4 * (1.0 + std::abs(want[i]))) << what << "[" << i << "]";
  };
  close(whole.y, plain.y, "y"), close(whole.grad_x, plain.grad_x, "grad_x");
  close(whole.grad_w1, plain.grad_w1, "grad_w1"), close(whole.grad_w2, plain.grad_w2, "grad_w2");

  const std::vector<int64_t> head{20, 0, 2, 33, 16}, tail{17, 0, 3, 37, 0}, zero(5, 0);
  for (const auto& [first, count] : {std::pair{zero, head}, std::pair{head, tail}}) {
    Problem c = chunk_of(p, first, count);
    std::vector<float> gy(c.rows() * H);
    for (std::size_t e = 0; e < count.size(); ++e)
      std::copy_n(grad_y.begin() + (p.offsets[e] + first[e]) * H, count[e] * H, gy.begin() + c.offsets[e] * H);
    const ExpertWeights weights = p.weights();  // the weights packed, not c's copy of them
    const Outputs part = run_both(c, gy, 0.0f, &weights);
    std::vector<uint16_t> y16(c.rows() * H);
    ASSERT_TRUE(expert_ffn_forward(c.config, weights, c.x.view(), c.offsets,
                                   TensorView::contiguous(y16.data(), DType::kBF16, {c.rows(), H}), nullptr).is_ok());
    for (std::size_t e = 0; e < count.size(); ++e)
      for (int64_t i = 0; i < count[e] * H; ++i) {
        const int64_t at = (p.offsets[e] + first[e]) * H + i, in_chunk = c.offsets[e] * H + i;
        ASSERT_EQ(part.y[in_chunk], whole.y[at]) << "y, expert " << e << " element " << i;
        ASSERT_EQ(y16[in_chunk], f32_to_bf16(whole.y[at])) << "bf16 y, expert " << e << " element " << i;
        ASSERT_EQ(part.grad_x[in_chunk], whole.grad_x[at]) << "grad_x, expert " << e << " element " << i;
      }
  }

  // Experts 0 and 3 swapped in every packed list: far from the plain calls.
  PackedExpertWeights swapped = packed;
  for (auto* list : {&swapped.w1, &swapped.w3, &swapped.w2, &swapped.w2_t, &swapped.w1_t, &swapped.w3_t})
    std::swap((*list)[0], (*list)[3]);
  p.packed = &swapped;
  const Outputs mixed = run_both(p, grad_y);
  double worst = 0;
  for (std::size_t i = 0; i < mixed.y.size(); ++i) worst = std::max(worst, double(std::abs(mixed.y[i] - plain.y[i])));
  EXPECT_GT(worst, 0.1) << "a mix-up of experts 0 and 3 went unseen";
}

// Packed weights serve bf16 GEMMs only, and only the weights they came from.
TEST(ExpertFfn, PackedWeightsAreRefusedForF32OrOtherWeights) {
  Problem f32 = make_problem(DType::kF32, 32, 32, {5, 3}, 46);
  PackedExpertWeights packed;
  Status s = pack_expert_weights(f32.config, f32.weights(), &packed);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("bf16 GEMMs only"), std::string::npos) << s.to_string();

  Problem a = make_problem(DType::kBF16, 32, 32, {5, 3}, 47), b = make_problem(DType::kBF16, 32, 32, {5, 3}, 48);
  ASSERT_TRUE(pack_expert_weights(a.config, a.weights(), &packed).is_ok());
  b.packed = &packed;
  std::vector<float> y(b.rows() * 32);
  s = expert_ffn_forward(b.config, b.weights(), b.x.view(), b.offsets, f32_view(y, b.rows(), 32), nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("packed from other weights"), std::string::npos) << s.to_string();
}

}  // namespace
}  // namespace epx
