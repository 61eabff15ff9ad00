// `epx bench exchange --dtype fp8`: bf16 vs fp8 dispatch (f32 and ue8m0
// scales) of the same bf16 rows, bytes and time in one run.
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "commands.h"
#include "fp8_dispatch_bench.h"
#include "machine.h"

namespace epx::app {

int run_bench_fp8(const BenchExchangeOptions& o, const std::vector<bench::ExchangeBenchConfig>& configs) {
  const MachineInfo machine = machine_info();
  const std::string date = utc_now();
  spdlog::info("epx bench exchange --dtype fp8: {} shapes on {} ({} cores); {} rank threads", configs.size(),
               machine.cpu_model, machine.cores, o.num_ranks);
  std::vector<bench::Fp8BenchResult> results;
  nlohmann::json shapes = nlohmann::json::array();
  bool any_failed = false;
  for (std::size_t i = 0; i < configs.size(); ++i) {
    const bench::ExchangeBenchConfig& c = configs[i];
    const std::string label = fmt::format("tokens {} {}x{}", c.num_tokens, c.num_nodes, c.num_ranks / c.num_nodes);
    Result<bench::Fp8BenchResult> r = bench::run_fp8_dispatch_bench(
        c, [&](const std::string& line) { spdlog::info("[{}/{}] {}: {}", i + 1, configs.size(), label, line); });
    if (!r.is_ok()) {
      any_failed = true;
      spdlog::error("[{}/{}] {}: {}", i + 1, configs.size(), label, r.status().to_string());
      shapes.push_back({{"tokens", c.num_tokens}, {"nodes", c.num_nodes}, {"error", r.status().to_string()}});
      continue;
    }
    if (r->other_cpu_share > 0.05)
      spdlog::warn("[{}/{}] {}: other processes took {:.0f}% of the {} cores meanwhile: times are inflated and noisy",
                   i + 1, configs.size(), label, 100 * r->other_cpu_share, machine.cores);
    nlohmann::json variants = nlohmann::json::array();
    for (const bench::Fp8Variant& v : r->variants)
      variants.push_back({{"name", v.name},
                          {"row_bytes", v.row_bytes},
                          {"payload_bytes", v.payload_bytes},
                          {"inter_node_bytes", v.inter_node_bytes},
                          {"time_ms", v.time_ms},
                          {"min_ms", v.min_ms},
                          {"time_vs_bf16", v.time_vs_bf16},
                          {"bytes_vs_bf16", v.bytes_vs_bf16},
                          {"samples_ms", v.samples_ms}});
    shapes.push_back({{"tokens", c.num_tokens},
                      {"nodes", c.num_nodes},
                      {"ranks", c.num_ranks},
                      {"path", r->hierarchical ? "two-hop" : "flat"},
                      {"rows", r->recv_rows},
                      {"worst_error_vs_bound", r->worst_error_vs_bound},
                      {"other_cpu_share", r->other_cpu_share},
                      {"variants", variants}});
    results.push_back(std::move(r).value());
  }

  std::FILE* table = o.json ? stderr : stdout;
  fmt::print(table, "\n{:>7} {:>5}  {:<27} {:>9} {:>12} {:>9} {:>10} {:>9} {:>9}\n", "tokens", "shape", "variant",
             "row B", "payload MB", "vs bf16", "time ms", "min ms", "vs bf16");
  for (const bench::Fp8BenchResult& r : results) {
    const std::string shape = fmt::format("{}x{}", r.config.num_nodes, r.config.num_ranks / r.config.num_nodes);
    for (const bench::Fp8Variant& v : r.variants)
      fmt::print(table, "{:>7} {:>5}  {:<27} {:>9} {:>12.2f} {:>9} {:>10.3f} {:>9.3f} {:>8.2f}x\n", r.config.num_tokens,
                 shape, v.name, v.row_bytes > 0 ? fmt::format("{}", v.row_bytes) : "",
                 static_cast<double>(v.payload_bytes) / 1e6,
                 v.row_bytes > 0 ? fmt::format("{:.3f}x", v.bytes_vs_bf16) : "", v.time_ms, v.min_ms, v.time_vs_bf16);
    fmt::print(table, "{:>14}  {} rows, {}; worst fp8 error {:.2f} of the stated bound; other processes {:.0f}% CPU\n",
               "", r.recv_rows, r.hierarchical ? "two-hop" : "flat", r.worst_error_vs_bound, 100 * r.other_cpu_share);
  }
  fmt::print(table,
             "\npayload = dispatch row bytes moved (scales included) summed over ranks; times are medians of {} "
             "interleaved rounds (last rank's end - first rank's start); fp8 times include quantising on send; vs "
             "bf16 = ratio to the bf16 dispatch of the same run; {} rank threads share {} cores.\n",
             o.reps, o.num_ranks, machine.cores);
  if (o.json) {
    nlohmann::json j = record_head(machine, date);
    j["config"] = {{"ranks", o.num_ranks}, {"tokens", o.tokens}, {"node_shapes", o.node_shapes},
                   {"hidden", o.hidden},   {"experts", o.num_experts}, {"topk", o.topk},
                   {"dtype", "fp8"},       {"reps", o.reps},  {"warmup", o.warmup},
                   {"skew", o.skew},       {"seed", o.seed},  {"verify", !o.no_verify}};
    j["shapes"] = shapes;
    fmt::print("{}\n", j.dump(2));
  }
  return any_failed ? kExitFailed : kExitOk;
}

}  // namespace epx::app
