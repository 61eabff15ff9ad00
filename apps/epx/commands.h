// The subcommands of the `epx` command, in one table (commands()): each adds
// itself and its flags under the `epx` app, and runs from its parsed options,
// returning the process exit code: 0 done, 1 the run failed (a check or a
// shape), 2 bad options (already reported by the caller or by the command),
// 75 (sysexits' EX_TEMPFAIL) a training preempted by SIGTERM or SIGUSR1 that
// saved its checkpoint: run it again with --resume.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <CLI/CLI.hpp>

namespace epx::app {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailed = 1;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitPreempted = 75;

struct DemoOptions {
  int num_ranks = 4;
  int num_nodes = 1;
  int num_tokens = 64;
  int hidden = 256;
  int num_experts = 16;
  int topk = 4;
  double skew = 0.5;
  uint64_t seed = 1;
  std::string dtype = "bf16";
  int reps = 5;
  bool json = false;
};

struct BenchExchangeOptions {
  std::vector<int> tokens = {128, 1024, 4096};
  std::vector<std::string> node_shapes = {"1x8", "2x4"};
  int num_ranks = 8;
  int hidden = 7168;
  int num_experts = 256;
  int topk = 8;
  std::string dtype = "bf16";
  int reps = 5;
  int warmup = 1;
  double skew = 0.0;
  uint64_t seed = 1;
  bool no_verify = false;
  std::string record_waits = "on";  // BufferConfig::record_waits: on or off
  std::string layer_combine = "on";  // also time MoELayer's combine_expanded: on (f32 partials), bf16, receiver or off
  double memory_fraction = 0.85;
  bool phases = false;
  std::string trace_path;
  bool json = false;
};

struct BenchRoutingOptions {
  int tokens = 4096;
  int num_experts = 256;
  int topk = 8;
  int groups = 8;
  int topk_groups = 4;
  int hidden = 7168;
  int reps = 7;
  int peak_n = 2048;
  int nodes = 8;
  int ranks_per_node = 8;
  int slots = 320;
  uint64_t seed = 1;
  bool json = false;
};

struct EplbOptions {
  std::string loads_path;
  int num_slots = 0;
  int num_nodes = 1;
  int ranks_per_node = 1;
  int num_groups = 0;
  int64_t expert_bytes = 0;
  std::string policy = "hierarchical";
  // Rebalance mode: the current slot -> expert map (the format --save writes).
  std::string current_path;
  double tolerance = 0.02;  // rebalance: balance within (1 + tolerance) x from scratch
  // Where to write the printed placement (empty = nowhere).
  std::string save_path;
  bool json = false;
};

struct ReportOptions {
  std::string metrics_path;
  std::string output_path = "report.html";
  int max_points = 1000;
  int heatmap_columns = 64;
  int straggler_window = 100;
  bool json = false;
  std::string events_path;  // epx supervise --events: restarts and lost steps
};

// Options of `epx` itself, before the command's name.
struct GlobalOptions {
  bool quiet = false;  // -q: no progress lines on stderr
};

// A command once added under the `epx` app: `node` is its CLI11 subcommand
// (true after parsing when the user named it) and `run` runs it.
// `before_parse`, where set, runs before the flags are parsed (train reads
// --config FILE there, so that the flags override the file): 0 or an exit code.
struct AddedCommand {
  CLI::App* node = nullptr;
  std::function<int(const GlobalOptions&)> run;
  std::function<int(int argc, char** argv)> before_parse;
};

struct Command {
  std::string_view name;
  AddedCommand (*add)(CLI::App& epx);
};

// Every command of `epx`, in the order `epx --help` lists them.
std::span<const Command> commands();

// "train, supervise, ... and eplb": the command names for a message.
std::string command_names();

CLI::App* add_demo_command(CLI::App& app, DemoOptions& options);
CLI::App* add_bench_exchange_command(CLI::App& bench, BenchExchangeOptions& options);
CLI::App* add_bench_routing_command(CLI::App& bench, BenchRoutingOptions& options);
CLI::App* add_eplb_command(CLI::App& app, EplbOptions& options);

int run_demo(const DemoOptions& options);
int run_bench_exchange(const BenchExchangeOptions& options);
int run_bench_routing(const BenchRoutingOptions& options);
int run_eplb(const EplbOptions& options);
int run_report(const ReportOptions& options);

}  // namespace epx::app
