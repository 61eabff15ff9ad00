// The exchange benchmark: epx's dispatch/combine against the physical limit
// (memcpy of the same bytes) and the baseline users would otherwise write
// (Megatron-style all-to-all, naive_alltoall.h), on in-process ranks.
//
// One shape = (ranks, nodes, tokens per rank, hidden, experts, top-k, dtype).
// For each shape the ranks run a warm-up iteration of every method (checked
// against plain references when `verify` is set), then `reps` repetitions of
// the methods interleaved (epx, memcpy, naive, epx, memcpy, naive, ...), and
// report the median time of each. Every method is timed the same way: all
// ranks leave a barrier, each records when it starts and ends the operation,
// and the time is the last end minus the first start.
//
// Bandwidth is logical, DeepEP's figure: the rows a rank receives in
// dispatch (one per (token, rank) pair) times the row bytes, over the time.
// The same byte count is used for every method, so the GB/s columns compare
// useful work per second; the naive baseline moves more rows to do it.
//
//   epx::bench::ExchangeBenchConfig config{.num_ranks = 8, .num_nodes = 2, .num_tokens = 1024};
//   EPX_ASSIGN_OR_RETURN(auto result, epx::bench::run_exchange_bench(config));
//   result.dispatch.time_ms; result.dispatch_vs_memcpy;
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "epx/core/clock.h"
#include "epx/core/dtype.h"
#include "epx/core/memory.h"
#include "epx/core/status.h"
#include "epx/core/trace.h"
#include "epx/exchange/buffer.h"
#include "stats.h"

namespace epx::bench {

struct ExchangeBenchConfig {
  int num_ranks = 8;
  int num_nodes = 1;      // emulated nodes; > 1 takes the two-hop path
  int num_tokens = 4096;  // per rank
  int hidden = 7168;
  int num_experts = 256;
  int topk = 8;
  DType dtype = DType::kBF16;  // dispatch and combine payload
  int reps = 5;
  int warmup = 1;
  double skew = 0.0;  // routing skew (synthetic_routing.h); 0 = uniform
  uint64_t seed = 1;
  bool verify = true;  // check every method's output after the first warm-up
  Milliseconds timeout{300000};
  Tracer* tracer = nullptr;  // when set: the Buffer's spans plus one "bench.*" span per timed operation
  bool record_waits = true;  // BufferConfig::record_waits of epx's Buffers
  // Also time the MoE layer's combine (MoELayer calls Buffer::combine_expanded:
  // expanded per-expert f32 rows, weighted, f32 partials sent, f32 out) and a
  // memcpy of the bytes it sends. Its Buffers then take max_combine_dtype = f32
  // (and, f32 holder partials, room for the expanded f32 rows in place).
  bool layer_combine = true;
  // The partials' dtype of that combine (CombineOptions::partial_dtype): f32
  // or bf16 (half the bytes, each partial rounded once).
  DType layer_combine_dtype = DType::kF32;
  // Where that combine applies the weights (CombineOptions::weights_at).
  // kReceiver: the experts' rows are bf16 in the combine region
  // (combine_expanded_input), written before timing as MoELayer's experts
  // write them; its yardstick is memcpy of the bytes a bf16 combine needs
  // (received rows x hidden x 2), and memcpy_expanded times a memcpy of the
  // expanded bf16 rows it reads.
  CombineWeights layer_combine_weights = CombineWeights::kHolder;
  // Share of MemAvailable a shape may plan to use. Above it the methods run
  // one after the other (epx, then naive + memcpy) instead of interleaved;
  // when even that does not fit the shape fails with ResourceExhausted.
  double memory_fraction = 0.85;
};

// One method on one shape.
struct MethodTiming {
  double time_ms = 0;     // median over the repetitions
  double min_ms = 0;      // fastest repetition: the least disturbed by other work
  double gbps = 0;        // logical bytes per rank / time (DeepEP's per-GPU figure)
  double gbps_total = 0;  // logical bytes of all ranks / time
  // CPU time the ranks' threads spent in the operation, summed (median over
  // repetitions): with more rank threads than cores this is the cost, the
  // wall time is the cost divided by the cores the run really got.
  double cpu_ms = 0;
  int64_t page_faults = 0;  // per repetition, summed over ranks; 0 once memory is warm
  std::vector<double> samples_ms;
};

struct ExchangeBenchResult {
  ExchangeBenchConfig config;
  std::string schedule;  // "interleaved", or "phased" when memory did not allow all methods at once
  bool hierarchical = false;
  int64_t row_bytes = 0;
  int64_t recv_rows = 0;      // dispatch rows received, summed over ranks
  int64_t max_recv_rows = 0;  // most rows one rank receives (sets BufferConfig::max_recv_tokens)
  int64_t recv_bytes = 0;     // recv_rows * row_bytes: the logical bytes of every method
  int64_t naive_rows = 0;     // (token, expert) rows the naive baseline moves, summed over ranks
  // Payload bytes that crossed emulated nodes in one operation, summed over ranks.
  int64_t dispatch_inter_node_bytes = 0;
  int64_t combine_inter_node_bytes = 0;
  int64_t naive_dispatch_inter_node_bytes = 0;
  int64_t naive_combine_inter_node_bytes = 0;
  std::size_t epx_region_bytes = 0;  // Buffer::region_bytes() of one rank
  // CPU time other processes took while the shape ran, as a share of all the
  // cores (from /proc/stat minus this process): above a few percent the
  // times are inflated and noisy; the ratios less so, as the methods are
  // interleaved, and cpu_ms least.
  double other_cpu_share = 0;
  std::size_t naive_bytes = 0;       // the naive baseline's buffers on one rank
  // Memory the plan expected the shape to hold at once (all ranks, inputs
  // included), and the process's peak resident memory while it ran (VmHWM,
  // reset before the shape after the heap's free memory went back to the
  // system; where the kernel refuses the reset, the process's peak so far).
  std::size_t planned_bytes = 0;
  std::size_t peak_rss_bytes = 0;

  MethodTiming dispatch;         // Buffer::dispatch
  MethodTiming combine;          // Buffer::combine, y already in combine_input (zero-copy)
  MethodTiming combine_copy_in;  // Buffer::combine from a separate y (recv_x)
  MethodTiming memcpy;           // each rank copies recv_rows * row_bytes with plain memcpy
  MethodTiming naive_dispatch;
  MethodTiming naive_combine;
  // The layer's combine (config.layer_combine): Buffer::combine_expanded of
  // expert outputs y_expanded [rows, H] f32 written outside the Buffer, weighted
  // by the dispatched top-k weights, into an f32 out [T, H], as MoELayer runs it;
  // and memcpy of the bytes it sends (received rows x hidden x 4: one f32
  // partial row per (token, rank) pair), in chunks through the memcpy buffers.
  MethodTiming layer_combine;
  MethodTiming memcpy_layer;
  MethodTiming memcpy_expanded;  // receiver weights: memcpy of the expanded bf16 rows
  // Holder weights with f32 partials: layer_combine reads the experts' rows in
  // the combine region (combine_expanded_input, as MoELayer writes them when
  // the Buffer has room); this is the same combine with y_expanded outside
  // the Buffer (each holder writes its f32 partials first).
  MethodTiming layer_combine_outside;
  int64_t layer_bytes = 0;  // recv_rows * hidden * 4 (2: bf16 partials, receiver weights), summed over ranks
  int64_t expanded_bytes = 0;  // receiver weights: (token, expert) rows * hidden * 2, summed over ranks
  double dispatch_vs_memcpy = 0;  // memcpy time / dispatch time (share of the memcpy rate reached)
  double combine_vs_memcpy = 0;
  double dispatch_vs_naive = 0;   // naive time / epx time (speed-up over the baseline)
  double combine_vs_naive = 0;
  double layer_combine_vs_memcpy = 0;  // memcpy_layer time / layer_combine time
  double layer_combine_vs_naive = 0;   // naive combine (also weighted) time / layer_combine time
  double layer_outside_vs_memcpy = 0;  // the same for layer_combine_outside
  double layer_outside_vs_naive = 0;
  // The same ratios from CPU time (MethodTiming::cpu_ms), steadier than wall
  // time when other processes share the cores.
  double dispatch_vs_memcpy_cpu = 0;
  double combine_vs_memcpy_cpu = 0;
  double dispatch_vs_naive_cpu = 0;
  double combine_vs_naive_cpu = 0;
  double layer_combine_vs_memcpy_cpu = 0;
};

// Memory one shape needs, in bytes over all ranks.
struct MemoryPlan {
  std::size_t common = 0;  // inputs and outputs
  std::size_t epx = 0;     // Buffer regions (estimate) + epx_after_create
  std::size_t epx_after_create = 0;  // staging and the layer combine's buffers: allocated by the first operations
  std::size_t naive = 0;   // the naive baseline's buffers (exact) and its in-flight messages
  std::size_t available = 0;
  std::size_t budget = 0;  // available * memory_fraction
  [[nodiscard]] bool fits_interleaved() const { return common + epx + naive <= budget; }
  [[nodiscard]] bool fits_phased() const { return common + std::max(epx, naive) <= budget; }
  // What the shape holds at once: everything interleaved, else the larger of epx and naive.
  [[nodiscard]] std::size_t at_once() const {
    return common + (fits_interleaved() ? epx + naive : std::max(epx, naive));
  }
};

// InvalidArgument naming the first bad field and its limit.
[[nodiscard]] Status validate_exchange_bench_config(const ExchangeBenchConfig& config);

// epx::available_memory() in bytes (0 when unknown).
[[nodiscard]] std::size_t available_memory_bytes();
// The least a shape needs (balanced routing), per rank, before anything is
// planned or allocated: `epx bench exchange` refuses a shape above the
// memory available.
[[nodiscard]] MemoryEstimate estimate_exchange_bench_memory(const ExchangeBenchConfig& config);
// CPU seconds: all cores' busy time (/proc/stat, steal included) and this
// process's own, with the wall clock; two of them give other_cpu_share.
struct CpuSnapshot {
  double machine_busy_s = 0;
  double self_s = 0;
  double wall_s = 0;
};
[[nodiscard]] CpuSnapshot cpu_snapshot();
[[nodiscard]] double other_cpu_share(const CpuSnapshot& before, const CpuSnapshot& after);

using ProgressFn = std::function<void(const std::string& line)>;

// Runs one shape (see the top of this file). Progress lines go to `progress`.
[[nodiscard]] Result<ExchangeBenchResult> run_exchange_bench(const ExchangeBenchConfig& config,
                                                             const ProgressFn& progress = {});

// Spans of a Tracer folded per name: what each phase costs per call.
struct PhaseSummary {
  std::string name;
  int64_t count = 0;       // spans over all ranks
  double mean_ms = 0;      // mean span length
  double max_ms = 0;
  double total_ms = 0;     // summed over ranks and calls
};
[[nodiscard]] std::vector<PhaseSummary> summarize_phases(const Tracer& tracer);

}  // namespace epx::bench
