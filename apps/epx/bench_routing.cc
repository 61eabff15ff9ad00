// `epx bench routing`: the router and expert placement, against the score
// GEMM that feeds the router and the machine's measured sgemm peak.
#include <cstdlib>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "cli_checks.h"
#include "commands.h"
#include "machine.h"
#include "routing_bench.h"
#include "shape_options.h"

namespace epx::app {

namespace {

nlohmann::json timing_json(const bench::Timing& t) {
  return {{"time_ms", t.time_ms}, {"min_ms", t.min_ms}, {"samples_ms", t.samples_ms}};
}

// An environment variable, or null when unset.
nlohmann::json env_json(const char* name) {
  const char* value = std::getenv(name);
  return value ? nlohmann::json(value) : nlohmann::json(nullptr);
}

void print_table(std::FILE* f, const bench::RoutingBenchResult& r) {
  const auto& c = r.config;
  fmt::print(f, "{:<48} {:>10} {:>10} {:>16}\n", "method", "median ms", "min ms", "figure");
  auto line = [&](const std::string& name, const bench::Timing& t, const std::string& figure) {
    fmt::print(f, "{:<48} {:>10.3f} {:>10.3f} {:>16}\n", name, t.time_ms, t.min_ms, figure);
  };
  line(fmt::format("score gemm {}x{}x{} (fp32, {} BLAS threads)", c.num_tokens, c.hidden, c.num_experts,
                   r.blas_threads),
       r.gemm, fmt::format("{:.1f} GFLOP/s", r.gemm_gflops));
  if (c.peak_n > 0)
    line(fmt::format("peak: sgemm {0}x{0}x{0} (limit)", c.peak_n), r.peak_gemm,
         fmt::format("{:.1f} GFLOP/s", r.peak_gflops));
  line(fmt::format("route sigmoid+bias, {}/{} groups, top-{}", c.topk_groups, c.num_groups, c.topk), r.route_sigmoid,
       fmt::format("{:.2f} Mtok/s", r.sigmoid_tokens_per_s * 1e-6));
  line(fmt::format("route softmax top-{}", c.topk), r.route_softmax,
       fmt::format("{:.2f} Mtok/s", r.softmax_tokens_per_s * 1e-6));
  const std::string shape = fmt::format("{}e/{}x{}r/{}s", c.num_experts, c.num_nodes, c.ranks_per_node, c.num_slots);
  line(fmt::format("place_experts {} {}", r.hierarchical_policy, shape), r.place_hierarchical,
       fmt::format("balance {:.3f}", r.balance_hierarchical));
  line(fmt::format("place_experts global {}", shape), r.place_global, fmt::format("balance {:.3f}", r.balance_global));
  line(fmt::format("rebalance (loads x 1+-{})", c.load_change), r.rebalance,
       fmt::format("{} slots moved", r.rebalance_moved_slots));
  fmt::print(f,
             "\nscore gemm: {:.0f}% of the measured sgemm peak; routing / gemm time: sigmoid {:.1f}%, softmax {:.1f}%\n"
             "balance (max/mean per rank): contiguous {:.3f}, hierarchical {:.3f}, global {:.3f}; rebalance {:.3f} "
             "(from scratch {:.3f}), {:.1f} MB moved\n"
             "medians of {} interleaved reps; routing on {} threads (route's own split), placement single-threaded; {} "
             "(core {}); other "
             "processes took {:.0f}% of the CPU\n",
             100 * r.gemm_vs_peak, 100 * r.sigmoid_vs_gemm, 100 * r.softmax_vs_gemm, r.balance_before,
             r.balance_hierarchical, r.balance_global, r.rebalance_balance, r.rebalance_scratch_balance,
             static_cast<double>(r.rebalance_moved_bytes) / 1e6, c.reps, r.routing_threads, r.blas_config, r.blas_core,
             100 * r.other_cpu_share);
}

// A timing with its own figures added (`extra`: a JSON object).
nlohmann::json timing_json(const bench::Timing& t, const nlohmann::json& extra) {
  nlohmann::json j = timing_json(t);
  j.update(extra);
  return j;
}

// OpenBLAS as loaded, and the environment that steers it.
nlohmann::json blas_json(const bench::RoutingBenchResult& r) {
  return {{"library", "OpenBLAS"},
          {"threads", r.blas_threads},
          {"config", r.blas_config},
          {"core", r.blas_core},
          {"env",
           {{"OPENBLAS_NUM_THREADS", env_json("OPENBLAS_NUM_THREADS")},
            {"OMP_NUM_THREADS", env_json("OMP_NUM_THREADS")},
            {"OPENBLAS_CORETYPE", env_json("OPENBLAS_CORETYPE")},
            {"OPENBLAS_L2_SIZE", env_json("OPENBLAS_L2_SIZE")}}}};
}

// --json: the one object on stdout.
nlohmann::json result_json(const bench::RoutingBenchResult& r, const MachineInfo& machine, const std::string& date) {
  const auto& c = r.config;
  nlohmann::json j = record_head(machine, date);
  j["config"] = {{"tokens", c.num_tokens},       {"experts", c.num_experts},
                 {"topk", c.topk},               {"groups", c.num_groups},
                 {"topk_groups", c.topk_groups}, {"hidden", c.hidden},
                 {"reps", c.reps},               {"seed", c.seed},
                 {"peak_n", c.peak_n},           {"schedule", "interleaved"},
                 {"routing_threads", r.routing_threads}};
  j["blas"] = blas_json(r);
  j["gemm"] = timing_json(r.gemm, {{"gflops", r.gemm_gflops},
                                   {"flops", 2.0 * c.num_tokens * static_cast<double>(c.hidden) * c.num_experts}});
  if (c.peak_n > 0) {
    j["peak_gemm"] = timing_json(r.peak_gemm, {{"gflops", r.peak_gflops}, {"n", c.peak_n}});
    j["gemm_vs_peak"] = r.gemm_vs_peak;
  }
  j["route_sigmoid"] = timing_json(r.route_sigmoid, {{"tokens_per_s", r.sigmoid_tokens_per_s},
                                                     {"vs_gemm", r.sigmoid_vs_gemm},
                                                     {"expert_balance", r.sigmoid_expert_balance}});
  j["route_softmax"] =
      timing_json(r.route_softmax, {{"tokens_per_s", r.softmax_tokens_per_s}, {"vs_gemm", r.softmax_vs_gemm}});
  j["placement"] = {{"experts", c.num_experts},
                    {"nodes", c.num_nodes},
                    {"ranks_per_node", c.ranks_per_node},
                    {"slots", c.num_slots},
                    {"groups", c.num_groups},
                    {"load_skew", c.load_skew},
                    {"balance_contiguous", r.balance_before}};
  j["place_hierarchical"] =
      timing_json(r.place_hierarchical, {{"policy_ran", r.hierarchical_policy}, {"balance", r.balance_hierarchical}});
  j["place_global"] = timing_json(r.place_global, {{"balance", r.balance_global}});
  j["rebalance"] = timing_json(r.rebalance, {{"load_change", c.load_change},
                                             {"balance", r.rebalance_balance},
                                             {"scratch_balance", r.rebalance_scratch_balance},
                                             {"moved_slots", r.rebalance_moved_slots},
                                             {"moved_bytes", r.rebalance_moved_bytes},
                                             {"expert_bytes", c.expert_bytes}});
  j["other_cpu_share"] = r.other_cpu_share;
  return j;
}

}  // namespace

CLI::App* add_bench_routing_command(CLI::App& bench, BenchRoutingOptions& o) {
  CLI::App* cmd = bench.add_subcommand(
      "routing",
      "The router (sigmoid + bias + group-limited top-k, and softmax top-k; single-threaded) against the fp32 score "
      "GEMM that feeds it (OpenBLAS) and the machine's measured sgemm peak, plus expert placement and rebalance; "
      "medians of interleaved repetitions");
  cmd->add_option("--tokens", o.tokens, "Tokens")->transform(in_range(1, 1 << 20))->capture_default_str();
  add_shape_options(cmd, {.hidden = &o.hidden, .experts = &o.num_experts, .topk = &o.topk, .seed = &o.seed});
  cmd->add_option("--groups", o.groups, "Expert groups (router and placement); must divide --experts")
      ->transform(in_range(1, 65536))
      ->capture_default_str();
  cmd->add_option("--topk-groups", o.topk_groups, "Groups a token may use (sigmoid router)")
      ->transform(in_range(1, 65536))
      ->capture_default_str();
  cmd->add_option("--reps", o.reps, "Timed repetitions of each method")
      ->transform(in_range(1, 10000))
      ->capture_default_str();
  cmd->add_option("--peak-n", o.peak_n, "Size of the square sgemm that measures the fp32 peak; 0 = skip")
      ->transform(in_range(0, 16384))
      ->capture_default_str();
  cmd->add_option("--nodes", o.nodes, "Placement: nodes")->transform(in_range(1, 4096))->capture_default_str();
  cmd->add_option("--ranks-per-node", o.ranks_per_node, "Placement: ranks per node")
      ->transform(in_range(1, 4096))
      ->capture_default_str();
  cmd->add_option("--slots", o.slots, "Placement: physical slots; >= experts and a multiple of the ranks")
      ->transform(in_range(1, 1 << 20))
      ->capture_default_str();
  cmd->add_flag("--json", o.json, "Print exactly one JSON object on stdout (table and progress on stderr)");
  return cmd;
}

int run_bench_routing(const BenchRoutingOptions& o) {
  const bench::RoutingBenchConfig config{.num_tokens = o.tokens,
                                         .num_experts = o.num_experts,
                                         .topk = o.topk,
                                         .num_groups = o.groups,
                                         .topk_groups = o.topk_groups,
                                         .hidden = o.hidden,
                                         .reps = o.reps,
                                         .seed = o.seed,
                                         .peak_n = o.peak_n,
                                         .num_nodes = o.nodes,
                                         .ranks_per_node = o.ranks_per_node,
                                         .num_slots = o.slots};
  if (Status s = bench::validate_routing_bench_config(config); !s.is_ok()) {
    fmt::print(stderr, "epx bench routing: {}\n", s.message());
    return kExitUsage;
  }
  const MachineInfo machine = machine_info();
  const std::string date = utc_now();
  spdlog::info("epx bench routing: {} tokens, {} experts, top-{}, hidden {} on {} ({} cores)", o.tokens,
               o.num_experts, o.topk, o.hidden, machine.cpu_model, machine.cores);
  Result<bench::RoutingBenchResult> r =
      bench::run_routing_bench(config, [](const std::string& line) { spdlog::info("routing: {}", line); });
  if (!r.is_ok()) {
    spdlog::error("epx bench routing: {}", r.status().to_string());
    return kExitFailed;
  }
  if (r->other_cpu_share > 0.05)
    spdlog::warn("other processes took {:.0f}% of the {} cores meanwhile: the times are inflated and noisy",
                 100 * r->other_cpu_share, machine.cores);
  std::FILE* table = o.json ? stderr : stdout;
  fmt::print(table, "\n");
  print_table(table, *r);

  if (o.json) fmt::print("{}\n", result_json(*r, machine, date).dump(2));
  return kExitOk;
}

}  // namespace epx::app
