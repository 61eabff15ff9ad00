// fp8 vs bf16 dispatch in one run, on in-process ranks.
//
// Every rank holds the same bf16 x [T, H] and routing (synthetic_routing.h)
// and dispatches it through three Buffers: bf16, fp8 with f32 scales and fp8
// with ue8m0 scales (rows quantised on send); it also times quantize_fp8 of x
// alone. After `warmup` untimed rounds (the first checked: the fp8 rows come
// back within the bound of epx/core/fp8.h of the bf16 rows), `reps` rounds run
// the variants interleaved (bf16, fp8 f32, fp8 ue8m0, quantise, bf16, ...),
// each from a common barrier; a variant's time is the last rank's end minus
// the first rank's start, and its figure the median over the rounds. Bytes
// are what ExchangeStats counts (payload rows, scales included), summed over
// ranks for one dispatch.
//
//   epx::bench::ExchangeBenchConfig config{.num_ranks = 8, .num_nodes = 2, .num_tokens = 512};
//   EPX_ASSIGN_OR_RETURN(auto r, epx::bench::run_fp8_dispatch_bench(config));
//   r.variants[1].time_vs_bf16;
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "exchange_bench.h"

namespace epx::bench {

struct Fp8Variant {
  std::string name;            // "bf16", "fp8 f32 scales", "fp8 ue8m0 scales", "quantise only (f32 scales)"
  int64_t row_bytes = 0;       // bytes of one dispatch row (0 for quantise only)
  int64_t payload_bytes = 0;   // intra + inter node payload bytes of one dispatch, all ranks
  int64_t inter_node_bytes = 0;  // transport bytes between nodes (payload + metadata), all ranks
  double time_ms = 0;          // median
  double min_ms = 0;
  double time_vs_bf16 = 0;     // this time / bf16 time, same run
  double bytes_vs_bf16 = 0;    // payload bytes / bf16 payload bytes
  std::vector<double> samples_ms;
};

struct Fp8BenchResult {
  ExchangeBenchConfig config;  // dtype is the bf16 of x
  bool hierarchical = false;
  int64_t recv_rows = 0;       // dispatch rows received, all ranks
  // Worst |fp8 - bf16| / (stated bound) over the elements checked (<= 1; 0 without verify).
  double worst_error_vs_bound = 0;
  double other_cpu_share = 0;  // as in ExchangeBenchResult
  std::vector<Fp8Variant> variants;
};

[[nodiscard]] Result<Fp8BenchResult> run_fp8_dispatch_bench(const ExchangeBenchConfig& config,
                                                            const ProgressFn& progress = {});

}  // namespace epx::bench
