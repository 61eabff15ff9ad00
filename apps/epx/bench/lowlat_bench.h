// The low-latency benchmark: LowLatencyBuffer's dispatch and combine against
// the normal Buffer's at the same decode sizes, in one run, on in-process
// ranks (run_lowlat_bench) or on a connected transport's, e.g. MPI processes
// on two hosts (run_lowlat_bench_on, from epx_mpi_exchange_bench --lowlat).
//
// For each token count the ranks build both buffers for exactly that many
// tokens per rank, run `warmup` untimed rounds, then `reps` rounds of
// (normal dispatch, normal combine, low-latency dispatch, low-latency
// combine), interleaved, and report the median of each. Every operation is
// timed the same way: all ranks leave a barrier, each records when it starts
// and ends, and the time is the last end minus the first start.
//
// What is compared: the normal dispatch (one row per (token, rank), with
// layout and count exchange) and its combine with y already in the combine
// region (zero-copy; unweighted sum per rank), against the low-latency
// dispatch (one row per (token, expert), counts carried with the rows) and
// its weighted combine in top-k order with y = recv_x.
//
//   epx::bench::LowLatBenchConfig config;  // 8 ranks, hidden 7168, top-8 of 256
//   config.tokens = {1, 8, 32, 128};
//   EPX_ASSIGN_OR_RETURN(auto rows, epx::bench::run_lowlat_bench(config));
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "epx/comm/transport.h"
#include "epx/core/clock.h"
#include "epx/core/dtype.h"
#include "epx/core/status.h"
#include "exchange_bench.h"

namespace epx::bench {

struct LowLatBenchConfig {
  int num_ranks = 8;
  int num_nodes = 1;  // emulated nodes; > 1 sends rows between nodes as messages
  std::vector<int> tokens = {1, 8, 32, 128};  // per rank
  int hidden = 7168;
  int num_experts = 256;
  int topk = 8;
  DType dtype = DType::kBF16;
  int reps = 5;
  int warmup = 1;
  // Rows per (local expert, source rank); 0: the largest count of the run's
  // routing (the tightest capacity that fits it).
  int capacity = 0;
  bool combine_per_rank = false;  // LowLatencyConfig::combine_per_rank
  uint64_t seed = 1;
  Milliseconds timeout{120000};
};

struct LowLatBenchRow {
  int tokens = 0;
  int capacity = 0;
  int64_t pairs = 0;  // (token, expert) rows of one dispatch, summed over ranks
  int64_t rows = 0;   // (token, rank) rows of the normal dispatch, summed over ranks
  std::size_t normal_region_bytes = 0;  // per rank
  std::size_t lowlat_region_bytes = 0;  // per rank
  MethodTiming normal_dispatch, normal_combine, lowlat_dispatch, lowlat_combine;
  double dispatch_speedup = 0;  // normal median / low-latency median
  double combine_speedup = 0;
  double other_cpu_share = 0;   // as in ExchangeBenchResult
};

[[nodiscard]] Status validate_lowlat_bench_config(const LowLatBenchConfig& config);
// One row per token count. Progress lines go to `progress`.
[[nodiscard]] Result<std::vector<LowLatBenchRow>> run_lowlat_bench(const LowLatBenchConfig& config,
                                                                   const ProgressFn& progress = {});
// The same on `t`'s ranks (every rank calls it; num_ranks and num_nodes come
// from `t`). Every rank gets the same rows; progress lines on rank 0.
[[nodiscard]] Result<std::vector<LowLatBenchRow>> run_lowlat_bench_on(Transport& t, LowLatBenchConfig config,
                                                                      const ProgressFn& progress = {});

}  // namespace epx::bench
