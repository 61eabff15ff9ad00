// The routing benchmark: the cost of choosing experts, next to the score GEMM
// that feeds the router, and of placing experts on ranks.
//
// One run times, in `reps` interleaved rounds (gemm, sigmoid route, softmax
// route, square sgemm, hierarchical placement, global placement, rebalance,
// gemm, ...), and reports the median of each:
// - the score GEMM logits[T, E] = x[T, H] * W[H, E], fp32, OpenBLAS
//   cblas_sgemm with its default threads;
// - the physical limit of that GEMM on this machine: a square n x n x n
//   sgemm's rate, the practical fp32 peak, measured in the same rounds;
// - epx::route on those logits, on the threads route itself starts
//   (RoutingBenchResult::routing_threads): sigmoid scores + expert bias
//   + group-limited top-k (DeepSeek-V3) and plain softmax top-k;
// - place_experts (hierarchical and global) and rebalance after a small load
//   change, for a skewed synthetic load.
// Inputs come from `seed`, so every run sees the same numbers.
//
//   epx::bench::RoutingBenchConfig config{.num_tokens = 4096};
//   EPX_ASSIGN_OR_RETURN(auto r, epx::bench::run_routing_bench(config));
//   r.route_sigmoid.time_ms / r.gemm.time_ms;  // r.sigmoid_vs_gemm
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "epx/core/status.h"
#include "exchange_bench.h"

namespace epx::bench {

struct RoutingBenchConfig {
  int num_tokens = 4096;
  int num_experts = 256;
  int topk = 8;
  int num_groups = 8;   // expert groups of the sigmoid router and of placement
  int topk_groups = 4;  // groups a token may use (sigmoid router)
  int hidden = 7168;
  int reps = 7;
  uint64_t seed = 1;
  int peak_n = 2048;  // square sgemm size for the practical peak; 0 = skip
  // Placement: num_nodes x ranks_per_node ranks, num_slots physical slots.
  int num_nodes = 8;
  int ranks_per_node = 8;
  int num_slots = 320;  // 256 + 64 redundant: 5 per rank (256 + 32 does not divide over 64 ranks)
  int64_t expert_bytes = int64_t{3} * 7168 * 2048;  // one DeepSeek-V3 expert in FP8
  double load_skew = 0.8;                           // expert loads ~ (rank + 1)^-skew, shuffled
  double load_change = 0.1;                         // rebalance: each load scaled by 1 +- this, at random
};

struct Timing {
  double time_ms = 0;  // median over the repetitions
  double min_ms = 0;
  std::vector<double> samples_ms;
};

struct RoutingBenchResult {
  RoutingBenchConfig config;
  // OpenBLAS as loaded: threads, build config, kernel core name.
  int blas_threads = 0;
  std::string blas_config;
  std::string blas_core;

  Timing gemm;
  double gemm_gflops = 0;  // 2 T H E / median time
  Timing peak_gemm;
  double peak_gflops = 0;  // 2 n^3 / median time
  double gemm_vs_peak = 0;  // gemm_gflops / peak_gflops

  Timing route_sigmoid;  // sigmoid + bias + group-limited top-k
  Timing route_softmax;  // softmax top-k
  double sigmoid_tokens_per_s = 0;
  double softmax_tokens_per_s = 0;
  double sigmoid_vs_gemm = 0;  // route time / gemm time
  double softmax_vs_gemm = 0;
  // max / mean tokens per expert of the sigmoid routing (random inputs).
  double sigmoid_expert_balance = 0;

  Timing place_hierarchical;
  Timing place_global;
  Timing rebalance;
  std::string hierarchical_policy;  // the policy place_experts really ran
  double balance_before = 0;        // contiguous one-replica placement
  double balance_hierarchical = 0;  // max / mean per rank under the load
  double balance_global = 0;
  double rebalance_balance = 0;  // under the changed load
  double rebalance_scratch_balance = 0;
  int rebalance_moved_slots = 0;
  int64_t rebalance_moved_bytes = 0;

  // Threads epx::route splits these logits over (router.h: one per 2^17
  // (token, expert) pairs, at most min(cores, 8)).
  int routing_threads = 1;

  double other_cpu_share = 0;  // other processes' share of all cores during the run
};

// InvalidArgument naming the first bad field and its limit.
[[nodiscard]] Status validate_routing_bench_config(const RoutingBenchConfig& config);

[[nodiscard]] Result<RoutingBenchResult> run_routing_bench(const RoutingBenchConfig& config,
                                                           const ProgressFn& progress = {});

}  // namespace epx::bench
