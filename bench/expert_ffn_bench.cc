// The experts' grouped SwiGLU FFN against the same library's single large
// GEMM, in the same run: DeepSeek-V3's expert shape (hidden 7168, width 2048),
// 8 local experts, f32 and bf16, forward and forward + backward.
//
//   build/bench/expert_ffn_bench                     # the table in docs/performance.md
//   build/bench/expert_ffn_bench --tokens 64 --reps 5 --dtype bf16
//
// FLOP/s are GEMM FLOPs only (forward 6 rows H F, backward 12 rows H F) over
// wall time, element-wise work included in the time. The single GEMM is
// [8 x tokens, 7168] x [7168, 2048] (f32 output), timed two ways: oneDNN with
// every size fixed at creation (its best kernel for the shape) and with sizes
// given at run time (what the experts use); the better is the reference.
// "grouped" is the default schedule (kAuto); at up to 256 tokens per expert
// both forced schedules are timed too. Each figure is the median of --reps
// repetitions, the methods interleaved; cpu/wall is the process's CPU time
// over wall time in the grouped forward (2 = both cores were ours).
// Progress goes to stderr, the table to stdout.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "epx/experts/ffn.h"
#include "experts/gemm.h"
#include "cpu_time.h"
#include "gemm_reference.h"
#include "stats.h"

namespace {

using Clock = std::chrono::steady_clock;

constexpr int64_t kHidden = 7168;
constexpr int64_t kFfn = 2048;
constexpr int kExperts = 8;

struct Timing {
  std::vector<double> seconds;
  std::vector<double> cpu;  // process CPU seconds over wall seconds
  double median() const { return epx::bench::median(seconds); }
  double median_cpu() const { return epx::bench::median(cpu); }
};

void time_once(Timing& t, const std::function<void()>& f) {
  const double c0 = epx::bench::process_cpu_seconds();
  const auto t0 = Clock::now();
  f();
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
  t.seconds.push_back(wall);
  t.cpu.push_back((epx::bench::process_cpu_seconds() - c0) / wall);
}

// Fills with small values quickly (uniform bits, no per-element RNG call).
void fill(std::vector<float>& v, uint32_t seed, float scale) {
  uint32_t s = seed * 2654435761u + 1;
  for (float& x : v) {
    s = s * 1664525u + 1013904223u;
    x = scale * (float(s >> 8) * (1.0f / 16777216.0f) - 0.5f);
  }
}

struct Data {
  epx::DType dtype;
  int64_t rows;
  std::vector<float> w1, w3, w2, x;  // f32 storage
  std::vector<uint16_t> w1b, w3b, w2b, xb;
  std::vector<float> y, grad_y, grad_x, g1, g3, g2;
  std::vector<int64_t> offsets;
  epx::ExpertFfnCache cache;

  const void* ptr(const std::vector<float>& f, const std::vector<uint16_t>& b) const {
    return dtype == epx::DType::kBF16 ? static_cast<const void*>(b.data()) : f.data();
  }
  epx::ExpertWeights weights() const {
    return {epx::TensorView::contiguous(ptr(w1, w1b), dtype, {kExperts * kHidden, kFfn}),
            epx::TensorView::contiguous(ptr(w3, w3b), dtype, {kExperts * kHidden, kFfn}),
            epx::TensorView::contiguous(ptr(w2, w2b), dtype, {kExperts * kFfn, kHidden})};
  }
  epx::TensorView xv() const { return epx::TensorView::contiguous(ptr(x, xb), dtype, {rows, kHidden}); }
};

std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = epx::f32_to_bf16(v[i]);
  return out;
}

// Everything is made once per dtype, for the largest token count; smaller
// counts use the first rows.
Data make_data(epx::DType dtype, int64_t max_rows) {
  Data d;
  d.dtype = dtype;
  d.rows = max_rows;
  d.w1.resize(kExperts * kHidden * kFfn), d.w3.resize(d.w1.size()), d.w2.resize(d.w1.size());
  fill(d.w1, 1, 0.05f), fill(d.w3, 2, 0.05f), fill(d.w2, 3, 0.05f);
  d.x.resize(max_rows * kHidden);
  fill(d.x, 4, 2.0f);
  if (dtype == epx::DType::kBF16) {
    d.w1b = to_bf16(d.w1), d.w3b = to_bf16(d.w3), d.w2b = to_bf16(d.w2), d.xb = to_bf16(d.x);
    for (auto* v : {&d.w1, &d.w3, &d.w2, &d.x}) std::vector<float>().swap(*v);
  }
  d.y.assign(max_rows * kHidden, 0.0f);
  d.grad_y.resize(max_rows * kHidden);
  fill(d.grad_y, 5, 1.0f);
  d.grad_x.assign(max_rows * kHidden, 0.0f);
  d.g1.assign(kExperts * kHidden * kFfn, 0.0f), d.g3.assign(d.g1.size(), 0.0f), d.g2.assign(d.g1.size(), 0.0f);
  return d;
}

void check(const epx::Status& s, const char* what) {
  if (!s.is_ok()) {
    fmt::print(stderr, "{} failed: {}\n", what, s.to_string());
    std::exit(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Grouped expert FFN (SwiGLU) vs one large GEMM of the same library"};
  std::vector<int64_t> tokens{16, 64, 256, 1024};
  std::vector<std::string> dtypes{"f32", "bf16"};
  int reps = 3;
  int threads = 0;
  bool backward = true;
  bool schedules = true;
  app.add_option("--tokens", tokens, "Tokens per expert")->capture_default_str();
  app.add_option("--dtype", dtypes, "f32 and/or bf16")->capture_default_str();
  app.add_option("--reps", reps, "Repetitions (median)")->check(CLI::Range(1, 100))->capture_default_str();
  app.add_option("--threads", threads, "Threads (0 = one per core)")->capture_default_str();
  app.add_flag("!--no-backward", backward, "Skip forward + backward");
  app.add_flag("!--no-schedules", schedules, "Skip the schedule comparison at small token counts");
  CLI11_PARSE(app, argc, argv);

  const int cores = threads == 0 ? epx::detail::available_cores() : threads;
  fmt::print("expert FFN: hidden {}, width {}, {} experts, {} threads, median of {} reps\n\n", kHidden, kFfn,
             kExperts, cores, reps);
  fmt::print("| dtype | tokens/expert | single GEMM fixed / runtime (GFLOP/s) | grouped fwd (GFLOP/s) | fwd ratio | "
             "fwd+bwd (GFLOP/s) | fwd+bwd ratio | fwd split experts / split GEMMs (GFLOP/s) | cpu/wall |\n");
  fmt::print("|---|---|---|---|---|---|---|---|---|\n");
  for (const std::string& name : dtypes) {
    const epx::DType dtype = *epx::parse_dtype(name);
    fmt::print(stderr, "[{}] preparing weights and inputs\n", name);
    bool first_shape = true;
    Data d = make_data(dtype, kExperts * *std::max_element(tokens.begin(), tokens.end()));
    for (int64_t tpe : tokens) {
      d.rows = kExperts * tpe;
      d.offsets.clear();
      for (int e = 0; e <= kExperts; ++e) d.offsets.push_back(e * tpe);
      epx::ExpertFfnConfig config{.num_experts = kExperts, .hidden = kHidden, .ffn_hidden = kFfn, .dtype = dtype,
                                  .num_threads = threads};
      epx::ExpertFfnConfig split_experts = config, split_gemms = config;
      split_experts.schedule = epx::ExpertFfnSchedule::kSplitExperts;
      split_gemms.schedule = epx::ExpertFfnSchedule::kSplitGemms;
      const bool compare_schedules = schedules && tpe <= 256;
      auto y = epx::TensorView::contiguous(d.y.data(), epx::DType::kF32, {d.rows, kHidden});
      auto gy = epx::TensorView::contiguous(d.grad_y.data(), epx::DType::kF32, {d.rows, kHidden});
      auto gx = epx::TensorView::contiguous(d.grad_x.data(), epx::DType::kF32, {d.rows, kHidden});
      epx::ExpertGrads grads{epx::TensorView::contiguous(d.g1.data(), epx::DType::kF32, {kExperts * kHidden, kFfn}),
                             epx::TensorView::contiguous(d.g3.data(), epx::DType::kF32, {kExperts * kHidden, kFfn}),
                             epx::TensorView::contiguous(d.g2.data(), epx::DType::kF32, {kExperts * kFfn, kHidden})};
      std::vector<float> c(d.rows * kFfn);
      const void* a = d.ptr(d.x, d.xb);
      const void* b = d.ptr(d.w1, d.w1b);
      epx::bench::FixedGemm fixed(dtype, d.rows, kFfn, kHidden, a, b, c.data());
      epx::detail::GemmArgs args{.dtype = dtype, .m = d.rows, .n = kFfn, .k = kHidden, .a = a, .lda = kHidden,
                                 .b = b, .ldb = kFfn, .c = c.data(), .ldc = kFfn};
      auto forward = [&](const epx::ExpertFfnConfig& cfg) {
        check(epx::expert_ffn_forward(cfg, d.weights(), d.xv(), d.offsets, y, &d.cache), "forward");
      };
      auto both = [&] {
        forward(config);
        check(epx::expert_ffn_backward(config, d.weights(), d.xv(), d.offsets, d.cache, gy, gx, grads), "backward");
      };
      // Warm-up: the fixed-size GEMM is new for every shape; the rest (runtime
      // sizes: primitives made once, memory touched) only at the first shape.
      fixed.run();
      if (first_shape) {
        check(epx::detail::gemm(args, cores), "gemm");
        forward(config);
        if (compare_schedules) forward(split_experts), forward(split_gemms);
        if (backward) both();
        first_shape = false;
      }
      Timing t_fixed, t_runtime, t_fwd, t_split, t_gemms, t_both;
      for (int r = 0; r < reps; ++r) {
        fmt::print(stderr, "[{} tokens/expert {}] rep {}/{}\n", name, tpe, r + 1, reps);
        time_once(t_fixed, [&] { fixed.run(); });
        time_once(t_runtime, [&] { check(epx::detail::gemm(args, cores), "gemm"); });
        time_once(t_fwd, [&] { forward(config); });
        if (compare_schedules) {
          time_once(t_split, [&] { forward(split_experts); });
          time_once(t_gemms, [&] { forward(split_gemms); });
        }
        if (backward) time_once(t_both, both);
      }
      const double gemm_flops = 2.0 * double(d.rows) * kHidden * kFfn;
      const double fixed_rate = gemm_flops / t_fixed.median() / 1e9;
      const double runtime_rate = gemm_flops / t_runtime.median() / 1e9;
      const double single = std::max(fixed_rate, runtime_rate);
      const double fwd = 3 * gemm_flops / t_fwd.median() / 1e9;
      std::string both_cell = "-", both_ratio = "-", split_cell = "- / -";
      if (backward) {
        const double rate = 9 * gemm_flops / t_both.median() / 1e9;
        both_cell = fmt::format("{:.0f}", rate);
        both_ratio = fmt::format("{:.2f}", rate / single);
      }
      if (compare_schedules)
        split_cell = fmt::format("{:.0f} / {:.0f}", 3 * gemm_flops / t_split.median() / 1e9,
                                 3 * gemm_flops / t_gemms.median() / 1e9);
      fmt::print("| {} | {} | {:.0f} / {:.0f} | {:.0f} | {:.2f} | {} | {} | {} | {:.2f} |\n", name, tpe, fixed_rate,
                 runtime_rate, fwd, fwd / single, both_cell, both_ratio, split_cell, t_fwd.median_cpu());
      std::fflush(stdout);
    }
  }
  return 0;
}
