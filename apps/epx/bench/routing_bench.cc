#include "routing_bench.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <thread>

#include <cblas.h>
#include <fmt/format.h>

#include "epx/balance/placement.h"
#include "epx/core/clock.h"
#include "epx/routing/router.h"

namespace epx::bench {

namespace {

Timing summarize(std::vector<double> samples_ms) {
  Timing t;
  t.samples_ms = samples_ms;
  std::sort(samples_ms.begin(), samples_ms.end());
  const std::size_t n = samples_ms.size();
  t.time_ms = n % 2 ? samples_ms[n / 2] : 0.5 * (samples_ms[n / 2 - 1] + samples_ms[n / 2]);
  t.min_ms = samples_ms.front();
  return t;
}

// Expert loads ~ (i + 1)^-skew, shuffled so hot experts land in every group.
std::vector<double> skewed_load(int num_experts, double skew, std::mt19937_64& rng) {
  std::vector<double> load(num_experts);
  for (int e = 0; e < num_experts; ++e) load[e] = 1000.0 * std::pow(e + 1.0, -skew);
  std::shuffle(load.begin(), load.end(), rng);
  return load;
}

}  // namespace

Status validate_routing_bench_config(const RoutingBenchConfig& c) {
  if (c.num_tokens < 1) return invalid_argument("num_tokens = {} must be at least 1", c.num_tokens);
  if (c.hidden < 1) return invalid_argument("hidden = {} must be at least 1", c.hidden);
  if (c.num_experts < 1) return invalid_argument("num_experts = {} must be at least 1", c.num_experts);
  if (c.topk < 1 || c.topk > c.num_experts)
    return invalid_argument("topk = {} is outside [1, num_experts = {}]", c.topk, c.num_experts);
  if (c.num_groups < 1 || c.num_experts % c.num_groups != 0)
    return invalid_argument("num_groups = {} must be at least 1 and divide num_experts = {}", c.num_groups,
                            c.num_experts);
  if (c.topk_groups < 1 || c.topk_groups > c.num_groups)
    return invalid_argument("topk_groups = {} is outside [1, num_groups = {}]", c.topk_groups, c.num_groups);
  if (c.reps < 1) return invalid_argument("reps = {} must be at least 1", c.reps);
  if (c.peak_n < 0) return invalid_argument("peak_n = {} must not be negative", c.peak_n);
  if (c.num_nodes < 1 || c.ranks_per_node < 1)
    return invalid_argument("placement needs at least 1 node and 1 rank per node, got {} x {}", c.num_nodes,
                            c.ranks_per_node);
  const int num_ranks = c.num_nodes * c.ranks_per_node;
  if (c.num_slots < c.num_experts || c.num_slots % num_ranks != 0)
    return invalid_argument("num_slots = {} must be >= num_experts = {} and a multiple of the {} ranks", c.num_slots,
                            c.num_experts, num_ranks);
  if (!(c.load_change >= 0 && c.load_change < 1))
    return invalid_argument("load_change = {} is outside [0, 1)", c.load_change);
  return Status::ok();
}

Result<RoutingBenchResult> run_routing_bench(const RoutingBenchConfig& c, const ProgressFn& progress) {
  EPX_RETURN_IF_ERROR(validate_routing_bench_config(c));
  auto say = [&](const std::string& line) {
    if (progress) progress(line);
  };
  RoutingBenchResult r;
  r.config = c;
  r.blas_threads = openblas_get_num_threads();
  r.blas_config = openblas_get_config();
  r.blas_core = openblas_get_corename();
  {
    const int64_t pairs = static_cast<int64_t>(c.num_tokens) * c.num_experts;
    const int64_t cores = std::clamp<int64_t>(std::thread::hardware_concurrency(), 1, 8);
    r.routing_threads = static_cast<int>(std::clamp<int64_t>(pairs >> 17, 1, cores));
  }

  const int64_t T = c.num_tokens, H = c.hidden, E = c.num_experts;
  std::mt19937_64 rng(c.seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  // Logits of order 1: x in [-1, 1], W in [-1, 1] / sqrt(H).
  std::vector<float> x(static_cast<std::size_t>(T * H));
  std::vector<float> w(static_cast<std::size_t>(H * E));
  std::vector<float> logits(static_cast<std::size_t>(T * E));
  std::vector<float> bias(static_cast<std::size_t>(E));
  for (float& v : x) v = unit(rng);
  const float w_scale = 1.0f / std::sqrt(static_cast<float>(H));
  for (float& v : w) v = unit(rng) * w_scale;
  for (float& v : bias) v = 0.05f * unit(rng);
  const int64_t n = c.peak_n;
  std::vector<float> a(static_cast<std::size_t>(n * n)), b(static_cast<std::size_t>(n * n)),
      cmat(static_cast<std::size_t>(n * n));
  for (float& v : a) v = unit(rng);
  for (float& v : b) v = unit(rng);

  const TensorView logits_view = TensorView::contiguous(logits.data(), DType::kF32, {T, E});
  const TensorView bias_view = TensorView::contiguous(bias.data(), DType::kF32, {E});
  const RouterConfig sigmoid_config{.num_experts = c.num_experts,
                                    .topk = c.topk,
                                    .score_function = ScoreFunction::kSigmoid,
                                    .normalize_weights = true,
                                    .scaling_factor = 2.5f,
                                    .num_groups = c.num_groups,
                                    .topk_groups = c.topk_groups};
  const RouterConfig softmax_config{.num_experts = c.num_experts, .topk = c.topk};
  EPX_RETURN_IF_ERROR(sigmoid_config.validate());

  const int num_ranks = c.num_nodes * c.ranks_per_node;
  const PlacementConfig hier_config{.num_slots = c.num_slots,
                                    .num_nodes = c.num_nodes,
                                    .ranks_per_node = c.ranks_per_node,
                                    .num_groups = c.num_groups,
                                    .policy = PlacementPolicy::kHierarchical};
  PlacementConfig global_config = hier_config;
  global_config.policy = PlacementPolicy::kGlobal;
  const std::vector<double> load = skewed_load(c.num_experts, c.load_skew, rng);
  std::vector<double> changed_load = load;
  std::uniform_real_distribution<double> change(1.0 - c.load_change, 1.0 + c.load_change);
  for (double& l : changed_load) l *= change(rng);

  auto gemm = [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(T), static_cast<int>(E),
                static_cast<int>(H), 1.0f, x.data(), static_cast<int>(H), w.data(), static_cast<int>(E), 0.0f,
                logits.data(), static_cast<int>(E));
  };
  auto peak = [&] {
    const int m = static_cast<int>(n);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, m, m, 1.0f, a.data(), m, b.data(), m, 0.0f,
                cmat.data(), m);
  };

  // Warm-up: every method once, outside the timing; also the checks.
  gemm();
  if (n > 0) peak();
  EPX_ASSIGN_OR_RETURN(RouterOutput sig_out, route(sigmoid_config, logits_view, bias_view));
  EPX_ASSIGN_OR_RETURN(RouterOutput soft_out, route(softmax_config, logits_view));
  if (std::all_of(logits.begin(), logits.end(), [](float v) { return v == 0.0f; }))
    return internal_error("the score GEMM produced all-zero logits");
  {
    const auto& tpe = sig_out.tokens_per_expert;
    const double total = static_cast<double>(std::accumulate(tpe.begin(), tpe.end(), int64_t{0}));
    if (total != static_cast<double>(T * c.topk))
      return internal_error("sigmoid routing kept {} (token, slot) pairs, expected {}", total, T * c.topk);
    r.sigmoid_expert_balance = static_cast<double>(*std::max_element(tpe.begin(), tpe.end())) / (total / E);
  }
  EPX_ASSIGN_OR_RETURN(RedundantPlacement hier, place_experts(load, hier_config));
  EPX_ASSIGN_OR_RETURN(RedundantPlacement glob, place_experts(load, global_config));
  EPX_ASSIGN_OR_RETURN(RebalancePlan plan, epx::rebalance(hier, changed_load, hier_config, c.expert_bytes));
  EPX_ASSIGN_OR_RETURN(RedundantPlacement contiguous, contiguous_placement(c.num_experts, num_ranks));
  r.hierarchical_policy = hier.policy() == PlacementPolicy::kHierarchical ? "hierarchical" : "global";
  r.balance_before = balance(rank_loads(contiguous, load));
  r.balance_hierarchical = balance(rank_loads(hier, load));
  r.balance_global = balance(rank_loads(glob, load));
  r.rebalance_balance = plan.balance;
  r.rebalance_scratch_balance = plan.scratch_balance;
  r.rebalance_moved_slots = plan.num_moved_slots;
  r.rebalance_moved_bytes = plan.moved_bytes;
  say(fmt::format("warm-up done; {} interleaved reps", c.reps));

  std::vector<double> t_gemm, t_peak, t_sig, t_soft, t_hier, t_glob, t_rebal;
  Status failed = Status::ok();
  auto time_ms = [](auto&& fn) {
    Stopwatch sw;
    fn();
    return sw.seconds() * 1e3;
  };
  const CpuSnapshot before = cpu_snapshot();
  for (int rep = 0; rep < c.reps && failed.is_ok(); ++rep) {
    t_gemm.push_back(time_ms(gemm));
    t_sig.push_back(time_ms([&] {
      Result<RouterOutput> o = route(sigmoid_config, logits_view, bias_view);
      if (!o.is_ok()) failed = o.status();
    }));
    t_soft.push_back(time_ms([&] {
      Result<RouterOutput> o = route(softmax_config, logits_view);
      if (!o.is_ok()) failed = o.status();
    }));
    if (n > 0) t_peak.push_back(time_ms(peak));
    t_hier.push_back(time_ms([&] {
      Result<RedundantPlacement> p = place_experts(load, hier_config);
      if (!p.is_ok()) failed = p.status();
    }));
    t_glob.push_back(time_ms([&] {
      Result<RedundantPlacement> p = place_experts(load, global_config);
      if (!p.is_ok()) failed = p.status();
    }));
    t_rebal.push_back(time_ms([&] {
      Result<RebalancePlan> p = epx::rebalance(hier, changed_load, hier_config, c.expert_bytes);
      if (!p.is_ok()) failed = p.status();
    }));
    say(fmt::format("rep {}/{}: gemm {:.2f} ms, route sigmoid {:.3f} ms, softmax {:.3f} ms", rep + 1, c.reps,
                    t_gemm.back(), t_sig.back(), t_soft.back()));
  }
  const CpuSnapshot after = cpu_snapshot();
  EPX_RETURN_IF_ERROR(failed);
  r.other_cpu_share = other_cpu_share(before, after);

  r.gemm = summarize(t_gemm);
  r.gemm_gflops = 2.0 * static_cast<double>(T * H * E) / (r.gemm.time_ms * 1e6);
  if (n > 0) {
    r.peak_gemm = summarize(t_peak);
    r.peak_gflops = 2.0 * static_cast<double>(n * n * n) / (r.peak_gemm.time_ms * 1e6);
    r.gemm_vs_peak = r.gemm_gflops / r.peak_gflops;
  }
  r.route_sigmoid = summarize(t_sig);
  r.route_softmax = summarize(t_soft);
  r.sigmoid_tokens_per_s = static_cast<double>(T) / (r.route_sigmoid.time_ms * 1e-3);
  r.softmax_tokens_per_s = static_cast<double>(T) / (r.route_softmax.time_ms * 1e-3);
  r.sigmoid_vs_gemm = r.route_sigmoid.time_ms / r.gemm.time_ms;
  r.softmax_vs_gemm = r.route_softmax.time_ms / r.gemm.time_ms;
  r.place_hierarchical = summarize(t_hier);
  r.place_global = summarize(t_glob);
  r.rebalance = summarize(t_rebal);
  (void)soft_out;
  return r;
}

}  // namespace epx::bench
