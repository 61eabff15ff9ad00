#include "lowlat_bench.h"


#include <algorithm>
#include <chrono>
#include <memory>

#include <fmt/format.h>

#include "epx/comm/inproc.h"
#include "epx/exchange/buffer.h"
#include "epx/exchange/low_latency.h"
#include "cpu_time.h"
#include "stats.h"
#include "synthetic_routing.h"

namespace epx::bench {
namespace {

enum Method : int { kNormalDispatch, kNormalCombine, kLowLatDispatch, kLowLatCombine, kNumMethods };

// One token count's routing (every rank's), what it moves, and the capacity.
struct Plan {
  std::vector<RankRouting> routing;
  LowLatBenchRow row;  // tokens, capacity, pairs, rows
};

Result<Plan> plan_tokens(const LowLatBenchConfig& config, const ExpertPlacement& placement, int T) {
  const int R = config.num_ranks, K = config.topk;
  Plan plan;
  plan.row.tokens = T;
  const RoutingSpec spec{.num_tokens = T, .num_experts = config.num_experts, .topk = K, .seed = config.seed};
  plan.routing.resize(R);
  int most = 0;
  for (int r = 0; r < R; ++r) {
    EPX_ASSIGN_OR_RETURN(plan.routing[r], make_routing(spec, r));
    std::vector<int> per_expert(config.num_experts, 0);
    std::vector<char> to_rank(R);
    for (int t = 0; t < T; ++t) {
      std::fill(to_rank.begin(), to_rank.end(), 0);
      for (int k = 0; k < K; ++k) {
        const int e = plan.routing[r].topk_idx[static_cast<std::size_t>(t) * K + k];
        most = std::max(most, ++per_expert[e]);
        ++plan.row.pairs;
        to_rank[placement.rank_of(e)] = 1;
      }
      for (char c : to_rank) plan.row.rows += c;
    }
  }
  plan.row.capacity = config.capacity > 0 ? config.capacity : std::max(1, most);
  return plan;
}

// What one rank's run of a token count gives (the same on every rank: the
// timings are reduced over the ranks).
struct RankResult {
  std::vector<double> samples[kNumMethods], cpu_samples[kNumMethods];
  std::size_t normal_region = 0, lowlat_region = 0;  // this rank's
  int64_t received = 0;  // low-latency rows all ranks received (last round)
};

// One rank's part of a token count: both buffers, then the interleaved
// rounds. Each operation: all ranks leave a barrier, then the time from the
// first start to the last end, and the CPU time of all ranks' calls.
Status lowlat_rank(Transport& t, const LowLatBenchConfig& config, const Plan& plan, RankResult* result) {
  const int rank = t.rank(), T = plan.row.tokens, H = config.hidden, K = config.topk;
  const Deadline deadline = Deadline::after(config.timeout);
  BufferConfig normal_config;
  normal_config.num_experts = config.num_experts;
  normal_config.hidden = H;
  normal_config.dtype = config.dtype;
  normal_config.max_topk = K;
  normal_config.max_tokens_per_rank = T;
  normal_config.max_combine_dtype = config.dtype;
  normal_config.timeout = config.timeout;
  EPX_ASSIGN_OR_RETURN(auto normal, Buffer::create(t, normal_config));
  LowLatencyConfig ll_config;
  ll_config.num_experts = config.num_experts;
  ll_config.hidden = H;
  ll_config.dtype = config.dtype;
  ll_config.max_topk = K;
  ll_config.max_tokens_per_rank = T;
  ll_config.capacity = std::min(plan.row.capacity, T);
  ll_config.max_combine_dtype = config.dtype;
  ll_config.timeout = config.timeout;
  ll_config.combine_per_rank = config.combine_per_rank;
  EPX_ASSIGN_OR_RETURN(auto ll, LowLatencyBuffer::create(t, ll_config));
  result->normal_region = normal->region_bytes();
  result->lowlat_region = ll->region_bytes();
  std::vector<std::byte> x(static_cast<std::size_t>(T) * H * dtype_size(config.dtype));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<std::byte>((i * 7 + rank * 13) % 251 & 0x3f);
  const TensorView xv = TensorView::contiguous(x.data(), config.dtype, {T, H});
  std::vector<std::byte> out(x.size());
  const TensorView outv = TensorView::contiguous(out.data(), config.dtype, {T, H});

  auto timed = [&](Method method, bool record, auto&& op) -> Status {
    EPX_RETURN_IF_ERROR(t.barrier(deadline));
    const int64_t cpu = thread_cpu_ns();
    const int64_t begin = now_ns();
    Status status = op();
    double span[2] = {-static_cast<double>(begin), static_cast<double>(now_ns())};  // max: first start, last end
    double cpu_ms = static_cast<double>(thread_cpu_ns() - cpu) * 1e-6;
    EPX_RETURN_IF_ERROR(status);
    EPX_RETURN_IF_ERROR(t.all_reduce(std::span<double>(span, 2), ReduceOp::kMax, deadline));
    EPX_RETURN_IF_ERROR(t.all_reduce(std::span<double>(&cpu_ms, 1), ReduceOp::kSum, deadline));
    if (record) {
      result->samples[method].push_back((span[1] + span[0]) * 1e-6);
      result->cpu_samples[method].push_back(cpu_ms);
    }
    return Status::ok();
  };

  const RankRouting& routing = plan.routing[rank];
  const DispatchInputs normal_in{.x = xv, .topk_idx = routing.idx(), .topk_weights = routing.weights()};
  const LowLatencyDispatchInputs ll_in{.x = xv, .topk_idx = routing.idx(), .topk_weights = routing.weights()};
  DispatchResult d;
  LowLatencyDispatchResult ld;
  for (int round = 0; round < config.warmup + config.reps; ++round) {
    const bool record = round >= config.warmup;
    EPX_RETURN_IF_ERROR(timed(kNormalDispatch, record, [&] { return normal->dispatch(normal_in, &d); }));
    // The experts' output, written into the combine region (untimed).
    EPX_ASSIGN_OR_RETURN(TensorView y, normal->combine_input(d.handle, config.dtype));
    if (d.recv_x.size(0) > 0)
      std::memcpy(y.data(), d.recv_x.data(), static_cast<std::size_t>(d.recv_x.size(0)) * H * dtype_size(config.dtype));
    EPX_RETURN_IF_ERROR(timed(kNormalCombine, record, [&] { return normal->combine(y, d.handle, outv); }));
    EPX_RETURN_IF_ERROR(timed(kLowLatDispatch, record, [&] { return ll->dispatch(ll_in, &ld); }));
    EPX_RETURN_IF_ERROR(timed(kLowLatCombine, record, [&] { return ll->combine(ld.recv_x, ld.handle, outv); }));
  }
  double received = static_cast<double>(ld.stats.rows_received);
  EPX_RETURN_IF_ERROR(t.all_reduce(std::span<double>(&received, 1), ReduceOp::kSum, deadline));
  result->received = static_cast<int64_t>(received);
  return Status::ok();
}

// Fills `row`'s timings from rank 0's result and checks the delivery.
Status finish_row(const RankResult& r, LowLatBenchRow* row) {
  if (r.received != row->pairs)
    return internal_error("the low-latency dispatch delivered {} rows for {} (token, expert) pairs", r.received,
                          row->pairs);
  row->normal_region_bytes = r.normal_region;
  row->lowlat_region_bytes = r.lowlat_region;
  MethodTiming* timing[kNumMethods] = {&row->normal_dispatch, &row->normal_combine, &row->lowlat_dispatch,
                                       &row->lowlat_combine};
  for (int m = 0; m < kNumMethods; ++m) {
    timing[m]->samples_ms = r.samples[m];
    timing[m]->time_ms = median(r.samples[m]);
    timing[m]->min_ms = *std::min_element(r.samples[m].begin(), r.samples[m].end());
    timing[m]->cpu_ms = median(r.cpu_samples[m]);
  }
  row->dispatch_speedup = row->normal_dispatch.time_ms / row->lowlat_dispatch.time_ms;
  row->combine_speedup = row->normal_combine.time_ms / row->lowlat_combine.time_ms;
  return Status::ok();
}

void report_progress(const ProgressFn& progress, const LowLatBenchRow& row) {
  if (!progress) return;
  progress(fmt::format("{} tokens/rank: dispatch normal {:.3f} ms, low-latency {:.3f} ms; combine normal {:.3f} ms, "
                       "low-latency {:.3f} ms",
                       row.tokens, row.normal_dispatch.time_ms, row.lowlat_dispatch.time_ms, row.normal_combine.time_ms,
                       row.lowlat_combine.time_ms));
}

}  // namespace

Status validate_lowlat_bench_config(const LowLatBenchConfig& c) {
  if (c.num_ranks < 1) return invalid_argument("num_ranks = {} must be at least 1", c.num_ranks);
  if (c.num_nodes < 1 || c.num_ranks % c.num_nodes != 0)
    return invalid_argument("num_nodes = {} must divide num_ranks = {}", c.num_nodes, c.num_ranks);
  if (c.tokens.empty()) return invalid_argument("no token counts given");
  for (int t : c.tokens)
    if (t < 1) return invalid_argument("tokens per rank = {} must be at least 1", t);
  if (c.num_experts < 1 || c.num_experts % c.num_ranks != 0)
    return invalid_argument("num_experts = {} must be a positive multiple of num_ranks = {}", c.num_experts,
                            c.num_ranks);
  if (c.topk < 1 || c.topk > c.num_experts)
    return invalid_argument("topk = {} is outside [1, num_experts = {}]", c.topk, c.num_experts);
  if (c.reps < 1) return invalid_argument("reps = {} must be at least 1", c.reps);
  if (c.warmup < 0) return invalid_argument("warmup = {} must not be negative", c.warmup);
  if (c.capacity < 0) return invalid_argument("capacity = {} must be 0 (fit the routing) or positive", c.capacity);
  return Status::ok();
}

Result<std::vector<LowLatBenchRow>> run_lowlat_bench(const LowLatBenchConfig& config, const ProgressFn& progress) {
  EPX_RETURN_IF_ERROR(validate_lowlat_bench_config(config));
  EPX_ASSIGN_OR_RETURN(Topology topo, Topology::create(config.num_ranks, config.num_nodes));
  EPX_ASSIGN_OR_RETURN(ExpertPlacement placement, ExpertPlacement::contiguous(config.num_experts, config.num_ranks));
  std::vector<LowLatBenchRow> rows;
  for (int T : config.tokens) {
    EPX_ASSIGN_OR_RETURN(Plan plan, plan_tokens(config, placement, T));
    std::vector<RankResult> results(config.num_ranks);
    InprocWorld world(topo);
    const CpuSnapshot cpu_before = cpu_snapshot();
    EPX_RETURN_IF_ERROR(first_error(
        world.run([&](Transport& t) { return lowlat_rank(t, config, plan, &results[t.rank()]); })));
    plan.row.other_cpu_share = other_cpu_share(cpu_before, cpu_snapshot());
    EPX_RETURN_IF_ERROR(finish_row(results[0], &plan.row));
    report_progress(progress, plan.row);
    rows.push_back(std::move(plan.row));
  }
  return rows;
}

Result<std::vector<LowLatBenchRow>> run_lowlat_bench_on(Transport& t, LowLatBenchConfig config,
                                                        const ProgressFn& progress) {
  config.num_ranks = t.num_ranks();
  config.num_nodes = t.topology().num_nodes();
  EPX_RETURN_IF_ERROR(validate_lowlat_bench_config(config));
  EPX_ASSIGN_OR_RETURN(ExpertPlacement placement, ExpertPlacement::contiguous(config.num_experts, config.num_ranks));
  std::vector<LowLatBenchRow> rows;
  for (int T : config.tokens) {
    EPX_ASSIGN_OR_RETURN(Plan plan, plan_tokens(config, placement, T));
    RankResult result;
    const CpuSnapshot cpu_before = cpu_snapshot();
    EPX_RETURN_IF_ERROR(lowlat_rank(t, config, plan, &result));
    plan.row.other_cpu_share = other_cpu_share(cpu_before, cpu_snapshot());
    EPX_RETURN_IF_ERROR(finish_row(result, &plan.row));
    if (t.rank() == 0) report_progress(progress, plan.row);
    rows.push_back(std::move(plan.row));
  }
  return rows;
}

}  // namespace epx::bench
