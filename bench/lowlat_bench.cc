#include "lowlat_bench.h"

#include <time.h>

#include <algorithm>
#include <chrono>
#include <memory>

#include <fmt/format.h>

#include "epx/comm/inproc.h"
#include "epx/exchange/buffer.h"
#include "epx/exchange/low_latency.h"
#include "synthetic_routing.h"

namespace epx::bench {
namespace {

enum Method : int { kNormalDispatch, kNormalCombine, kLowLatDispatch, kLowLatCombine, kNumMethods };

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}
int64_t thread_cpu_ns() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}
double median_of(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// What the ranks of one token count share: per-rank start/end of the
// operation being timed, and rank 0's samples.
struct Shared {
  explicit Shared(int num_ranks) : begin(num_ranks), end(num_ranks), cpu(num_ranks) {}
  std::vector<int64_t> begin, end, cpu;
  std::vector<double> samples[kNumMethods], cpu_samples[kNumMethods];
  std::size_t normal_region = 0, lowlat_region = 0;
  std::vector<int64_t> received;  // low-latency rows each rank received (last round)
};

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
  const int R = config.num_ranks, H = config.hidden, K = config.topk;
  std::vector<LowLatBenchRow> rows;
  for (int T : config.tokens) {
    LowLatBenchRow row;
    row.tokens = T;
    // Every rank's routing, to size the capacity and count the rows.
    const RoutingSpec spec{.num_tokens = T, .num_experts = config.num_experts, .topk = K, .seed = config.seed};
    std::vector<RankRouting> routing(R);
    int most = 0;
    for (int r = 0; r < R; ++r) {
      EPX_ASSIGN_OR_RETURN(routing[r], make_routing(spec, r));
      std::vector<int> per_expert(config.num_experts, 0);
      std::vector<char> to_rank(R);
      for (int t = 0; t < T; ++t) {
        std::fill(to_rank.begin(), to_rank.end(), 0);
        for (int k = 0; k < K; ++k) {
          const int e = routing[r].topk_idx[static_cast<std::size_t>(t) * K + k];
          most = std::max(most, ++per_expert[e]);
          ++row.pairs;
          to_rank[placement.rank_of(e)] = 1;
        }
        for (char c : to_rank) row.rows += c;
      }
    }
    row.capacity = config.capacity > 0 ? config.capacity : std::max(1, most);

    Shared shared(R);
    shared.received.assign(R, 0);
    InprocWorld world(topo);
    const CpuSnapshot cpu_before = cpu_snapshot();
    const std::vector<Status> statuses = world.run([&](Transport& t) -> Status {
      const int rank = t.rank();
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
      ll_config.capacity = std::min(row.capacity, T);
      ll_config.max_combine_dtype = config.dtype;
      ll_config.timeout = config.timeout;
      EPX_ASSIGN_OR_RETURN(auto ll, LowLatencyBuffer::create(t, ll_config));
      if (rank == 0) {
        shared.normal_region = normal->region_bytes();
        shared.lowlat_region = ll->region_bytes();
      }
      std::vector<std::byte> x(static_cast<std::size_t>(T) * H * dtype_size(config.dtype));
      for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<std::byte>((i * 7 + rank * 13) % 251 & 0x3f);
      const TensorView xv = TensorView::contiguous(x.data(), config.dtype, {T, H});
      std::vector<std::byte> out(x.size());
      const TensorView outv = TensorView::contiguous(out.data(), config.dtype, {T, H});

      auto timed = [&](Method method, bool record, auto&& op) -> Status {
        EPX_RETURN_IF_ERROR(t.barrier(deadline));
        const int64_t cpu = thread_cpu_ns();
        shared.begin[rank] = now_ns();
        Status status = op();
        shared.end[rank] = now_ns();
        shared.cpu[rank] = thread_cpu_ns() - cpu;
        EPX_RETURN_IF_ERROR(status);
        EPX_RETURN_IF_ERROR(t.barrier(deadline));
        if (rank == 0 && record) {
          const int64_t first = *std::min_element(shared.begin.begin(), shared.begin.end());
          const int64_t last = *std::max_element(shared.end.begin(), shared.end.end());
          shared.samples[method].push_back(static_cast<double>(last - first) * 1e-6);
          int64_t sum = 0;
          for (int64_t ns : shared.cpu) sum += ns;
          shared.cpu_samples[method].push_back(static_cast<double>(sum) * 1e-6);
        }
        return Status::ok();
      };

      const DispatchInputs normal_in{.x = xv, .topk_idx = routing[rank].idx(), .topk_weights = routing[rank].weights()};
      const LowLatencyDispatchInputs ll_in{.x = xv, .topk_idx = routing[rank].idx(), .topk_weights = routing[rank].weights()};
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
      shared.received[rank] = ld.stats.rows_received;
      return Status::ok();
    });
    EPX_RETURN_IF_ERROR(first_error(statuses));
    row.other_cpu_share = other_cpu_share(cpu_before, cpu_snapshot());
    int64_t received = 0;
    for (int64_t n : shared.received) received += n;
    if (received != row.pairs)
      return internal_error("the low-latency dispatch delivered {} rows for {} (token, expert) pairs", received,
                            row.pairs);
    row.normal_region_bytes = shared.normal_region;
    row.lowlat_region_bytes = shared.lowlat_region;
    MethodTiming* timing[kNumMethods] = {&row.normal_dispatch, &row.normal_combine, &row.lowlat_dispatch,
                                         &row.lowlat_combine};
    for (int m = 0; m < kNumMethods; ++m) {
      timing[m]->samples_ms = shared.samples[m];
      timing[m]->time_ms = median_of(shared.samples[m]);
      timing[m]->min_ms = *std::min_element(shared.samples[m].begin(), shared.samples[m].end());
      timing[m]->cpu_ms = median_of(shared.cpu_samples[m]);
    }
    row.dispatch_speedup = row.normal_dispatch.time_ms / row.lowlat_dispatch.time_ms;
    row.combine_speedup = row.normal_combine.time_ms / row.lowlat_combine.time_ms;
    if (progress)
      progress(fmt::format("{} tokens/rank: dispatch normal {:.3f} ms, low-latency {:.3f} ms; combine normal {:.3f} ms, "
                           "low-latency {:.3f} ms",
                           T, row.normal_dispatch.time_ms, row.lowlat_dispatch.time_ms, row.normal_combine.time_ms,
                           row.lowlat_combine.time_ms));
    rows.push_back(std::move(row));
  }
  return rows;
}

}  // namespace epx::bench
