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
#include "stats.h"

namespace epx::bench {

namespace {

Timing summarize(std::vector<double> samples_ms) {
  Timing t;
  t.time_ms = median(samples_ms);
  t.min_ms = *std::min_element(samples_ms.begin(), samples_ms.end());
  t.samples_ms = std::move(samples_ms);
  return t;
}

// Expert loads ~ (i + 1)^-skew, shuffled so hot experts land in every group.
std::vector<double> skewed_load(int num_experts, double skew, std::mt19937_64& rng) {
  std::vector<double> load(num_experts);
  for (int e = 0; e < num_experts; ++e) load[e] = 1000.0 * std::pow(e + 1.0, -skew);
  std::shuffle(load.begin(), load.end(), rng);
  return load;
}

// Everything the methods run on, drawn from the seed in a fixed order: the
// score GEMM's x [T, H] and W [H, E] (logits of order 1: x in [-1, 1], W in
// [-1, 1] / sqrt(H)), the expert bias, the peak GEMM's square matrices, and
// the placement's load before and after a change.
struct Inputs {
  explicit Inputs(const RoutingBenchConfig& c)
      : T(c.num_tokens),
        H(c.hidden),
        E(c.num_experts),
        n(c.peak_n),
        sigmoid{.num_experts = c.num_experts,
                .topk = c.topk,
                .score_function = ScoreFunction::kSigmoid,
                .normalize_weights = true,
                .scaling_factor = 2.5f,
                .num_groups = c.num_groups,
                .topk_groups = c.topk_groups},
        softmax{.num_experts = c.num_experts, .topk = c.topk},
        hier{.num_slots = c.num_slots,
             .num_nodes = c.num_nodes,
             .ranks_per_node = c.ranks_per_node,
             .num_groups = c.num_groups,
             .policy = PlacementPolicy::kHierarchical},
        global(hier) {
    global.policy = PlacementPolicy::kGlobal;
    std::mt19937_64 rng(c.seed);
    std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
    x.resize(static_cast<std::size_t>(T * H));
    w.resize(static_cast<std::size_t>(H * E));
    logits.resize(static_cast<std::size_t>(T * E));
    bias.resize(static_cast<std::size_t>(E));
    for (float& v : x) v = unit(rng);
    const float w_scale = 1.0f / std::sqrt(static_cast<float>(H));
    for (float& v : w) v = unit(rng) * w_scale;
    for (float& v : bias) v = 0.05f * unit(rng);
    for (std::vector<float>* m : {&a, &b, &cmat}) m->resize(static_cast<std::size_t>(n * n));
    for (float& v : a) v = unit(rng);
    for (float& v : b) v = unit(rng);
    load = skewed_load(c.num_experts, c.load_skew, rng);
    changed_load = load;
    std::uniform_real_distribution<double> change(1.0 - c.load_change, 1.0 + c.load_change);
    for (double& l : changed_load) l *= change(rng);
  }

  // logits = x * W.
  void gemm() {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(T), static_cast<int>(E),
                static_cast<int>(H), 1.0f, x.data(), static_cast<int>(H), w.data(), static_cast<int>(E), 0.0f,
                logits.data(), static_cast<int>(E));
  }
  // The square sgemm that measures the peak.
  void peak() {
    const int m = static_cast<int>(n);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, m, m, 1.0f, a.data(), m, b.data(), m, 0.0f,
                cmat.data(), m);
  }
  [[nodiscard]] Result<RouterOutput> route_sigmoid() const {
    return route(sigmoid, TensorView::contiguous(logits.data(), DType::kF32, {T, E}),
                 TensorView::contiguous(bias.data(), DType::kF32, {E}));
  }
  [[nodiscard]] Result<RouterOutput> route_softmax() const {
    return route(softmax, TensorView::contiguous(logits.data(), DType::kF32, {T, E}));
  }

  int64_t T, H, E, n;
  RouterConfig sigmoid, softmax;
  PlacementConfig hier, global;
  std::vector<float> x, w, logits, bias, a, b, cmat;
  std::vector<double> load, changed_load;
};

// Threads epx::route splits these logits over (router.h).
int routing_threads(const RoutingBenchConfig& c) {
  const int64_t pairs = static_cast<int64_t>(c.num_tokens) * c.num_experts;
  const int64_t cores = std::clamp<int64_t>(std::thread::hardware_concurrency(), 1, 8);
  return static_cast<int>(std::clamp<int64_t>(pairs >> 17, 1, cores));
}

// Every method once, outside the timing, with the checks; the balance
// figures into `r`. Returns the hierarchical placement that rebalance starts from.
Result<RedundantPlacement> warm_up(const RoutingBenchConfig& c, Inputs& in, RoutingBenchResult& r) {
  in.gemm();
  if (in.n > 0) in.peak();
  EPX_ASSIGN_OR_RETURN(RouterOutput sig_out, in.route_sigmoid());
  EPX_RETURN_IF_ERROR(in.route_softmax().status());
  if (std::all_of(in.logits.begin(), in.logits.end(), [](float v) { return v == 0.0f; }))
    return internal_error("the score GEMM produced all-zero logits");
  const auto& tpe = sig_out.tokens_per_expert;
  const double total = static_cast<double>(std::accumulate(tpe.begin(), tpe.end(), int64_t{0}));
  if (total != static_cast<double>(in.T * c.topk))
    return internal_error("sigmoid routing kept {} (token, slot) pairs, expected {}", total, in.T * c.topk);
  r.sigmoid_expert_balance = static_cast<double>(*std::max_element(tpe.begin(), tpe.end())) / (total / in.E);

  EPX_ASSIGN_OR_RETURN(RedundantPlacement hier, place_experts(in.load, in.hier));
  EPX_ASSIGN_OR_RETURN(RedundantPlacement glob, place_experts(in.load, in.global));
  EPX_ASSIGN_OR_RETURN(RebalancePlan plan, epx::rebalance(hier, in.changed_load, in.hier, c.expert_bytes));
  EPX_ASSIGN_OR_RETURN(RedundantPlacement contiguous,
                       contiguous_placement(c.num_experts, c.num_nodes * c.ranks_per_node));
  r.hierarchical_policy = hier.policy() == PlacementPolicy::kHierarchical ? "hierarchical" : "global";
  r.balance_before = balance(rank_loads(contiguous, in.load));
  r.balance_hierarchical = balance(rank_loads(hier, in.load));
  r.balance_global = balance(rank_loads(glob, in.load));
  r.rebalance_balance = plan.balance;
  r.rebalance_scratch_balance = plan.scratch_balance;
  r.rebalance_moved_slots = plan.num_moved_slots;
  r.rebalance_moved_bytes = plan.moved_bytes;
  return hier;
}

// Milliseconds `fn` takes.
template <typename Fn>
double time_ms(Fn&& fn) {
  Stopwatch sw;
  fn();
  return sw.seconds() * 1e3;
}

// Milliseconds `fn` takes, its result dropped inside the timing; its error,
// if any, into `failed`.
template <typename Fn>
double time_call_ms(Fn&& fn, Status& failed) {
  return time_ms([&] {
    auto result = fn();
    if (!result.is_ok()) failed = result.status();
  });
}

// Each method's samples, one per round.
struct Samples {
  std::vector<double> gemm, peak, sigmoid, softmax, hier, glob, rebalance;
};

// `c.reps` rounds of the methods interleaved, in the order of routing_bench.h.
Status time_rounds(const RoutingBenchConfig& c, Inputs& in, const RedundantPlacement& hier, Samples& t,
                   const ProgressFn& progress) {
  Status failed = Status::ok();
  for (int rep = 0; rep < c.reps && failed.is_ok(); ++rep) {
    t.gemm.push_back(time_ms([&] { in.gemm(); }));
    t.sigmoid.push_back(time_call_ms([&] { return in.route_sigmoid(); }, failed));
    t.softmax.push_back(time_call_ms([&] { return in.route_softmax(); }, failed));
    if (in.n > 0) t.peak.push_back(time_ms([&] { in.peak(); }));
    t.hier.push_back(time_call_ms([&] { return place_experts(in.load, in.hier); }, failed));
    t.glob.push_back(time_call_ms([&] { return place_experts(in.load, in.global); }, failed));
    t.rebalance.push_back(
        time_call_ms([&] { return epx::rebalance(hier, in.changed_load, in.hier, c.expert_bytes); }, failed));
    if (progress)
      progress(fmt::format("rep {}/{}: gemm {:.2f} ms, route sigmoid {:.3f} ms, softmax {:.3f} ms", rep + 1, c.reps,
                           t.gemm.back(), t.sigmoid.back(), t.softmax.back()));
  }
  return failed;
}

// The medians and the figures derived from them.
void summarize_rounds(const Inputs& in, Samples t, RoutingBenchResult& r) {
  r.gemm = summarize(std::move(t.gemm));
  r.gemm_gflops = 2.0 * static_cast<double>(in.T * in.H * in.E) / (r.gemm.time_ms * 1e6);
  if (in.n > 0) {
    r.peak_gemm = summarize(std::move(t.peak));
    r.peak_gflops = 2.0 * static_cast<double>(in.n * in.n * in.n) / (r.peak_gemm.time_ms * 1e6);
    r.gemm_vs_peak = r.gemm_gflops / r.peak_gflops;
  }
  r.route_sigmoid = summarize(std::move(t.sigmoid));
  r.route_softmax = summarize(std::move(t.softmax));
  r.sigmoid_tokens_per_s = static_cast<double>(in.T) / (r.route_sigmoid.time_ms * 1e-3);
  r.softmax_tokens_per_s = static_cast<double>(in.T) / (r.route_softmax.time_ms * 1e-3);
  r.sigmoid_vs_gemm = r.route_sigmoid.time_ms / r.gemm.time_ms;
  r.softmax_vs_gemm = r.route_softmax.time_ms / r.gemm.time_ms;
  r.place_hierarchical = summarize(std::move(t.hier));
  r.place_global = summarize(std::move(t.glob));
  r.rebalance = summarize(std::move(t.rebalance));
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
  RoutingBenchResult r;
  r.config = c;
  r.blas_threads = openblas_get_num_threads();
  r.blas_config = openblas_get_config();
  r.blas_core = openblas_get_corename();
  r.routing_threads = routing_threads(c);

  Inputs in(c);
  EPX_RETURN_IF_ERROR(in.sigmoid.validate());
  EPX_ASSIGN_OR_RETURN(RedundantPlacement hier, warm_up(c, in, r));
  if (progress) progress(fmt::format("warm-up done; {} interleaved reps", c.reps));

  Samples samples;
  const CpuSnapshot before = cpu_snapshot();
  EPX_RETURN_IF_ERROR(time_rounds(c, in, hier, samples, progress));
  r.other_cpu_share = other_cpu_share(before, cpu_snapshot());
  summarize_rounds(in, std::move(samples), r);
  return r;
}

}  // namespace epx::bench
