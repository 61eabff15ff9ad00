#include "bench_lowlat.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli_checks.h"
#include "commands.h"
#include "lowlat_bench.h"
#include "machine.h"
#include "shape_options.h"

namespace epx::app {

CLI::App* add_bench_lowlat_command(CLI::App& bench, BenchLowLatOptions& o) {
  CLI::App* cmd = bench.add_subcommand(
      "lowlat",
      "Low-latency dispatch/combine against the normal mode at decode sizes, interleaved in one run; medians");
  cmd->add_option("--tokens", o.tokens, "Tokens per rank, comma-separated")->delimiter(',')->capture_default_str();
  add_shape_options(cmd, {.ranks = &o.num_ranks,
                          .nodes = &o.num_nodes,
                          .hidden = &o.hidden,
                          .experts = &o.num_experts,
                          .topk = &o.topk,
                          .seed = &o.seed,
                          .min_hidden = 4});
  cmd->add_option("--dtype", o.dtype, "Payload type")->check(CLI::IsMember({"bf16", "f32"}))->capture_default_str();
  cmd->add_option("--reps", o.reps, "Timed rounds")->transform(in_range(1, 10000))->capture_default_str();
  cmd->add_option("--warmup", o.warmup, "Untimed rounds first")->transform(in_range(0, 1000))->capture_default_str();
  cmd->add_option("--capacity", o.capacity,
                  "Low-latency rows per (local expert, source rank); 0 = the largest count of the routing")
      ->transform(in_range(0, 1 << 20))
      ->capture_default_str();
  cmd->add_flag("--combine-per-rank", o.combine_per_rank,
                "Low-latency combine: one row per (token, rank), summed by the expert's rank (other bits)");
  cmd->add_flag("--json", o.json, "Print exactly one JSON object on stdout (table on stderr)");
  return cmd;
}

namespace {

nlohmann::json timing_json(const bench::MethodTiming& m) {
  return {{"time_ms", m.time_ms}, {"min_ms", m.min_ms}, {"cpu_ms", m.cpu_ms}, {"samples_ms", m.samples_ms}};
}

}  // namespace

int run_bench_lowlat(const BenchLowLatOptions& o) {
  bench::LowLatBenchConfig c;
  c.num_ranks = o.num_ranks;
  c.num_nodes = o.num_nodes;
  c.tokens = o.tokens;
  c.hidden = o.hidden;
  c.num_experts = o.num_experts;
  c.topk = o.topk;
  c.dtype = o.dtype == "f32" ? DType::kF32 : DType::kBF16;
  c.reps = o.reps;
  c.warmup = o.warmup;
  c.capacity = o.capacity;
  c.combine_per_rank = o.combine_per_rank;
  c.seed = o.seed;
  if (Status s = bench::validate_lowlat_bench_config(c); !s.is_ok()) {
    fmt::print(stderr, "epx bench lowlat: {}\n", s.message());
    return kExitUsage;
  }
  std::FILE* table = o.json ? stderr : stdout;
  const MachineInfo machine = machine_info();
  const std::string date = utc_now();
  fmt::print(stderr, "low-latency vs normal: {} ranks as {} nodes, hidden {}, top-{} of {}, {}, {} reps; {} ({} cores)\n",
             c.num_ranks, c.num_nodes, c.hidden, c.topk, c.num_experts, o.dtype, c.reps, machine.cpu_model,
             machine.cores);
  auto rows = bench::run_lowlat_bench(c, [](const std::string& line) { fmt::print(stderr, "  {}\n", line); });
  if (!rows.is_ok()) {
    fmt::print(stderr, "epx bench lowlat: {}\n", rows.status().to_string());
    return kExitFailed;
  }
  fmt::print(table, "{:>7} {:>9}  {:>12} {:>12} {:>8}  {:>12} {:>12} {:>8}  {:>9} {:>9}\n", "tokens", "capacity",
             "disp normal", "disp lowlat", "ratio", "comb normal", "comb lowlat", "ratio", "MB normal", "MB lowlat");
  nlohmann::json shapes = nlohmann::json::array();
  for (const bench::LowLatBenchRow& r : *rows) {
    fmt::print(table, "{:>7} {:>9}  {:>9.3f} ms {:>9.3f} ms {:>7.2f}x  {:>9.3f} ms {:>9.3f} ms {:>7.2f}x  {:>9.1f} {:>9.1f}\n",
               r.tokens, r.capacity, r.normal_dispatch.time_ms, r.lowlat_dispatch.time_ms, r.dispatch_speedup,
               r.normal_combine.time_ms, r.lowlat_combine.time_ms, r.combine_speedup,
               static_cast<double>(r.normal_region_bytes) / 1e6, static_cast<double>(r.lowlat_region_bytes) / 1e6);
    shapes.push_back({{"tokens", r.tokens},
                      {"capacity", r.capacity},
                      {"pairs", r.pairs},
                      {"rows", r.rows},
                      {"region_bytes_per_rank", {{"normal", r.normal_region_bytes}, {"lowlat", r.lowlat_region_bytes}}},
                      {"normal_dispatch", timing_json(r.normal_dispatch)},
                      {"normal_combine", timing_json(r.normal_combine)},
                      {"lowlat_dispatch", timing_json(r.lowlat_dispatch)},
                      {"lowlat_combine", timing_json(r.lowlat_combine)},
                      {"dispatch_speedup", r.dispatch_speedup},
                      {"combine_speedup", r.combine_speedup},
                      {"other_cpu_share", r.other_cpu_share}});
  }
  fmt::print(table, "ratio = normal median / low-latency median (above 1: low-latency is faster)\n");
  if (o.json) {
    nlohmann::json record = record_head(machine, date);
    record["benchmark"] = "lowlat";
    record["config"] = {{"ranks", c.num_ranks}, {"nodes", c.num_nodes}, {"hidden", c.hidden},
                        {"experts", c.num_experts}, {"topk", c.topk},     {"dtype", o.dtype},
                        {"reps", c.reps},           {"warmup", c.warmup}, {"seed", c.seed}};
    record["shapes"] = shapes;
    fmt::print("{}\n", record.dump());
  }
  return kExitOk;
}

}  // namespace epx::app
