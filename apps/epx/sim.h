// `epx sim`: the cluster simulator's command (run a scenario, sweep a key,
// calibrate this machine, fit the link model to DeepEP's published points,
// predict the in-process exchange, the goodput of a long run under failures).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace epx::app {

struct SimOptions {
  // run
  std::string scenario_path;
  std::vector<std::string> sets;  // key=value
  std::string sweep;              // key=v1,v2,...
  int steps = 0;                  // 0 = the scenario's run.steps
  std::string trace_path;
  std::string report_path;  // --report: the run as an HTML page
  bool json = false;
  bool progress = false;  // --progress: progress lines on stderr even when it is not a terminal
  bool quiet = false;     // -q/--quiet: none
  // calibrate
  int64_t calibrate_mb = 256;
  int calibrate_threads = 0;
  std::string calibrate_out;
  // fit
  std::string fit_profile = "h800";
  // predict-exchange
  std::string profile_path;
  int tokens = 4096;
  int ranks = 8;
  std::string node_shape = "1x8";
  int hidden = 7168;
  int experts = 256;
  int topk = 8;
  std::string dtype = "bf16";
  // goodput
  int64_t gpus = 1024;
  double failures_per_gpu_hour = 1.97e-5;  // docs/simulator.md: Llama 3's 54-day pre-training snapshot
  double save_seconds = 30;
  double restart_seconds = 600;
  std::vector<double> intervals_min;  // empty: the default ladder
};

struct SimCommands {
  CLI::App* sim = nullptr;  // `epx sim` itself
  CLI::App* run = nullptr;
  CLI::App* keys = nullptr;
  CLI::App* calibrate = nullptr;
  CLI::App* fit = nullptr;
  CLI::App* predict = nullptr;
  CLI::App* goodput = nullptr;
};

// Adds `sim` and its subcommands bound to `options`.
SimCommands add_sim_command(CLI::App& app, SimOptions& options);
// Runs whichever subcommand was given; the exit code.
int run_sim(const SimCommands& commands, const SimOptions& options);

}  // namespace epx::app
