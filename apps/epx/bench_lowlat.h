// `epx bench lowlat`: the low-latency dispatch/combine against the normal
// mode at decode sizes (apps/epx/bench/lowlat_bench.h), in one run.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace epx::app {

struct BenchLowLatOptions {
  std::vector<int> tokens = {1, 8, 32, 128};
  int num_ranks = 8;
  int num_nodes = 1;
  int hidden = 7168;
  int num_experts = 256;
  int topk = 8;
  std::string dtype = "bf16";
  int reps = 5;
  int warmup = 1;
  int capacity = 0;
  bool combine_per_rank = false;
  uint64_t seed = 1;
  bool json = false;
};

// Adds `lowlat` under `bench`, filling `options`.
CLI::App* add_bench_lowlat_command(CLI::App& bench, BenchLowLatOptions& options);
int run_bench_lowlat(const BenchLowLatOptions& options);

}  // namespace epx::app
