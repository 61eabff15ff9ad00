// `epx bench exchange`: epx dispatch/combine vs memcpy and the naive
// all-to-all, over a grid of token counts and node shapes.
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "cli_checks.h"
#include "commands.h"
#include "exchange_bench.h"
#include "machine.h"
#include "shape_options.h"

namespace epx::app {

// bench_fp8.cc: the --dtype fp8 comparison over the same shapes.
int run_bench_fp8(const BenchExchangeOptions& o, const std::vector<bench::ExchangeBenchConfig>& configs);

namespace {

struct NodeShape {
  int nodes = 0;
  int ranks_per_node = 0;
};

Result<NodeShape> parse_node_shape(const std::string& text) {
  const auto x = text.find('x');
  NodeShape shape;
  try {
    if (x == std::string::npos) throw std::invalid_argument(text);
    std::size_t used = 0;
    shape.nodes = std::stoi(text.substr(0, x), &used);
    if (used != x) throw std::invalid_argument(text);
    shape.ranks_per_node = std::stoi(text.substr(x + 1), &used);
    if (used != text.size() - x - 1) throw std::invalid_argument(text);
  } catch (const std::exception&) {
    return invalid_argument("node shape '{}' is not NODESxRANKS_PER_NODE (e.g. 2x4)", text);
  }
  if (shape.nodes < 1 || shape.ranks_per_node < 1)
    return invalid_argument("node shape '{}' needs at least 1 node and 1 rank per node", text);
  return shape;
}

nlohmann::json timing_json(const bench::MethodTiming& m) {
  return {{"time_ms", m.time_ms},  {"min_ms", m.min_ms}, {"gbps", m.gbps},           {"gbps_total", m.gbps_total},
          {"cpu_ms", m.cpu_ms},    {"page_faults", m.page_faults}, {"samples_ms", m.samples_ms}};
}

nlohmann::json result_json(const bench::ExchangeBenchResult& r) {
  const auto& c = r.config;
  return {{"tokens", c.num_tokens},
          {"nodes", c.num_nodes},
          {"ranks", c.num_ranks},
          {"ranks_per_node", c.num_ranks / c.num_nodes},
          {"path", r.hierarchical ? "two-hop" : "flat"},
          {"schedule", r.schedule},
          {"row_bytes", r.row_bytes},
          {"rows", r.recv_rows},
          {"bytes", r.recv_bytes},
          {"max_recv_rows", r.max_recv_rows},
          {"naive_rows", r.naive_rows},
          {"naive_bytes_moved", r.naive_rows * r.row_bytes},
          {"inter_node_bytes",
           {{"dispatch", r.dispatch_inter_node_bytes},
            {"combine", r.combine_inter_node_bytes},
            {"naive_dispatch", r.naive_dispatch_inter_node_bytes},
            {"naive_combine", r.naive_combine_inter_node_bytes}}},
          {"memory_per_rank_bytes", {{"epx_regions", r.epx_region_bytes}, {"naive", r.naive_bytes}}},
          {"memory_bytes", {{"planned", r.planned_bytes}, {"peak_rss", r.peak_rss_bytes}}},
          {"other_cpu_share", r.other_cpu_share},
          {"dispatch", timing_json(r.dispatch)},
          {"combine", timing_json(r.combine)},
          {"combine_copy_in", timing_json(r.combine_copy_in)},
          {"memcpy", timing_json(r.memcpy)},
          {"naive_dispatch", timing_json(r.naive_dispatch)},
          {"naive_combine", timing_json(r.naive_combine)},
          {"layer_combine", timing_json(r.layer_combine)},
          {"memcpy_layer", timing_json(r.memcpy_layer)},
          {"memcpy_expanded", timing_json(r.memcpy_expanded)},
          {"layer_combine_outside", timing_json(r.layer_combine_outside)},
          {"layer_outside_vs_memcpy", r.layer_outside_vs_memcpy},
          {"layer_outside_vs_naive", r.layer_outside_vs_naive},
          {"layer_bytes", r.layer_bytes},
          {"expanded_bytes", r.expanded_bytes},
          {"layer_combine_vs_memcpy", r.layer_combine_vs_memcpy},
          {"layer_combine_vs_naive", r.layer_combine_vs_naive},
          {"dispatch_vs_memcpy", r.dispatch_vs_memcpy},
          {"combine_vs_memcpy", r.combine_vs_memcpy},
          {"dispatch_vs_naive", r.dispatch_vs_naive},
          {"combine_vs_naive", r.combine_vs_naive},
          {"cpu_ratios",
           {{"dispatch_vs_memcpy", r.dispatch_vs_memcpy_cpu},
            {"combine_vs_memcpy", r.combine_vs_memcpy_cpu},
            {"dispatch_vs_naive", r.dispatch_vs_naive_cpu},
            {"combine_vs_naive", r.combine_vs_naive_cpu},
            {"layer_combine_vs_memcpy", r.layer_combine_vs_memcpy_cpu}}}};
}

void print_table(std::FILE* f, const std::vector<bench::ExchangeBenchResult>& results) {
  fmt::print(f, "{:>7} {:>5}  {:<18} {:>10} {:>10} {:>11} {:>10} {:>9} {:>10}\n", "tokens", "shape", "method",
             "time ms", "GB/s/rank", "GB/s total", "vs memcpy", "vs naive", "cpu ms");
  for (const auto& r : results) {
    const std::string shape = fmt::format("{}x{}", r.config.num_nodes, r.config.num_ranks / r.config.num_nodes);
    auto line = [&](const char* name, const bench::MethodTiming& m, double vs_memcpy, double vs_naive) {
      fmt::print(f, "{:>7} {:>5}  {:<18} {:>10.3f} {:>10.2f} {:>11.2f} {:>10} {:>9} {:>10.1f}\n", r.config.num_tokens,
                 shape, name, m.time_ms, m.gbps, m.gbps_total, vs_memcpy > 0 ? fmt::format("{:.2f}x", vs_memcpy) : "",
                 vs_naive > 0 ? fmt::format("{:.2f}x", vs_naive) : "", m.cpu_ms);
    };
    line("dispatch", r.dispatch, r.dispatch_vs_memcpy, r.dispatch_vs_naive);
    line("combine", r.combine, r.combine_vs_memcpy, r.combine_vs_naive);
    line("combine (copy-in)", r.combine_copy_in, r.memcpy.time_ms / r.combine_copy_in.time_ms,
         r.naive_combine.time_ms / r.combine_copy_in.time_ms);
    line("memcpy (limit)", r.memcpy, 0, 0);
    line("naive dispatch", r.naive_dispatch, 0, 0);
    line("naive combine", r.naive_combine, 0, 0);
    if (r.config.layer_combine) {
      line("layer combine", r.layer_combine, r.layer_combine_vs_memcpy, r.layer_combine_vs_naive);
      if (r.layer_combine_outside.time_ms > 0)
        line("layer (y outside)", r.layer_combine_outside, r.layer_outside_vs_memcpy, r.layer_outside_vs_naive);
      line("memcpy (layer)", r.memcpy_layer, 0, 0);
      if (r.expanded_bytes > 0)
        line("memcpy (expanded)", r.memcpy_expanded, r.memcpy_expanded.time_ms / r.layer_combine.time_ms, 0);
    }
    fmt::print(f, "{:>14}  {} rows, {:.1f} MB received ({} max on one rank); naive moves {} rows; {}; {}",
               "", r.recv_rows, static_cast<double>(r.recv_bytes) / 1e6, r.max_recv_rows, r.naive_rows,
               r.hierarchical ? "two-hop" : "flat", r.schedule);
    if (r.config.num_nodes > 1)
      fmt::print(f, "; inter-node MB: dispatch {:.1f}, combine {:.1f}, naive {:.1f} + {:.1f}",
                 static_cast<double>(r.dispatch_inter_node_bytes) / 1e6,
                 static_cast<double>(r.combine_inter_node_bytes) / 1e6,
                 static_cast<double>(r.naive_dispatch_inter_node_bytes) / 1e6,
                 static_cast<double>(r.naive_combine_inter_node_bytes) / 1e6);
    fmt::print(f, "; other processes took {:.0f}% of the CPU\n", 100 * r.other_cpu_share);
    fmt::print(f, "{:>14}  from CPU time: dispatch {:.2f}x memcpy, {:.2f}x naive; combine {:.2f}x memcpy, {:.2f}x naive\n",
               "", r.dispatch_vs_memcpy_cpu, r.dispatch_vs_naive_cpu, r.combine_vs_memcpy_cpu, r.combine_vs_naive_cpu);
  }
}

// Chrome trace events ("X" spans, one track per rank, one process per shape).
void append_trace(nlohmann::json& events, const Tracer& tracer, int pid, const std::string& label) {
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", pid}, {"args", {{"name", label}}}});
  for (const TraceSpan& s : tracer.spans())
    events.push_back({{"name", s.name},
                      {"ph", "X"},
                      {"pid", pid},
                      {"tid", s.rank},
                      {"ts", static_cast<double>(s.begin_ns) * 1e-3},
                      {"dur", static_cast<double>(s.end_ns - s.begin_ns) * 1e-3}});
}

int usage(const std::string& message) {
  fmt::print(stderr, "epx bench exchange: {}\n", message);
  return kExitUsage;
}

// One benchmark config per (tokens, node shape), each checked (and its
// memory estimated) before any runs; kExitOk, or kExitUsage after the message.
int shape_configs(const BenchExchangeOptions& o, std::vector<bench::ExchangeBenchConfig>* configs) {
  std::vector<NodeShape> shapes;
  for (const std::string& text : o.node_shapes) {
    Result<NodeShape> shape = parse_node_shape(text);
    if (!shape.is_ok()) return usage(fmt::format("--nodes-shapes: {}", shape.status().message()));
    if (shape->nodes * shape->ranks_per_node != o.num_ranks)
      return usage(fmt::format("--nodes-shapes {} has {} ranks but --ranks is {}", text,
                               shape->nodes * shape->ranks_per_node, o.num_ranks));
    shapes.push_back(*shape);
  }
  for (int tokens : o.tokens) {
    if (tokens < 1) return usage(fmt::format("--tokens {} must be at least 1", tokens));
    for (const NodeShape& shape : shapes) {
      bench::ExchangeBenchConfig c{.num_ranks = o.num_ranks,
                                   .num_nodes = shape.nodes,
                                   .num_tokens = tokens,
                                   .hidden = o.hidden,
                                   .num_experts = o.num_experts,
                                   .topk = o.topk,
                                   .dtype = o.dtype == "f32" ? DType::kF32 : DType::kBF16,
                                   .reps = o.reps,
                                   .warmup = o.warmup,
                                   .skew = o.skew,
                                   .seed = o.seed,
                                   .verify = !o.no_verify,
                                   .record_waits = o.record_waits == "on",
                                   .layer_combine = o.layer_combine != "off",
                                   .layer_combine_dtype = o.layer_combine == "bf16" ? DType::kBF16 : DType::kF32,
                                   .layer_combine_weights = o.layer_combine == "receiver" ? CombineWeights::kReceiver
                                                                                          : CombineWeights::kHolder,
                                   .memory_fraction = o.memory_fraction};
      if (Status s = bench::validate_exchange_bench_config(c); !s.is_ok()) return usage(s.message());
      // A shape that cannot fit is refused now, before any is planned or run.
      if (Status s = check_memory_fits(bench::estimate_exchange_bench_memory(c), available_memory()); !s.is_ok())
        return usage(fmt::format("tokens {} on {}x{}: {}", tokens, shape.nodes, shape.ranks_per_node, s.message()));
      configs->push_back(c);
    }
  }
  return kExitOk;
}

// What the shapes' runs gave: the results for the table, one JSON object per
// shape (an error in place of a failed one) and the trace events.
struct ShapeRuns {
  std::vector<bench::ExchangeBenchResult> results;
  nlohmann::json shapes = nlohmann::json::array();
  nlohmann::json trace_events = nlohmann::json::array();
  bool any_failed = false;
};

// Shape `i` of `n`, run and logged, into `runs`.
void run_shape(const BenchExchangeOptions& o, bench::ExchangeBenchConfig c, std::size_t i, std::size_t n,
               const MachineInfo& machine, ShapeRuns& runs) {
  const std::string label = fmt::format("tokens {} {}x{}", c.num_tokens, c.num_nodes, c.num_ranks / c.num_nodes);
  auto tracer = std::make_unique<Tracer>();
  if (o.phases || !o.trace_path.empty()) c.tracer = tracer.get();
  spdlog::info("[{}/{}] {}: starting", i + 1, n, label);
  Result<bench::ExchangeBenchResult> r =
      bench::run_exchange_bench(c, [&](const std::string& line) { spdlog::info("[{}/{}] {}: {}", i + 1, n, label, line); });
  if (!r.is_ok()) {
    runs.any_failed = true;
    spdlog::error("[{}/{}] {}: {}", i + 1, n, label, r.status().to_string());
    runs.shapes.push_back({{"tokens", c.num_tokens},
                           {"nodes", c.num_nodes},
                           {"ranks", c.num_ranks},
                           {"error", r.status().to_string()}});
    return;
  }
  if (r->other_cpu_share > 0.05)
    spdlog::warn("[{}/{}] {}: other processes took {:.0f}% of the {} cores meanwhile: the times are inflated and "
                 "noisy (cpu ms and the ratios less so)",
                 i + 1, n, label, 100 * r->other_cpu_share, machine.cores);
  spdlog::info("[{}/{}] {}: dispatch {:.3f} ms ({:.2f}x memcpy, {:.2f}x naive), combine {:.3f} ms ({:.2f}x memcpy, "
               "{:.2f}x naive)",
               i + 1, n, label, r->dispatch.time_ms, r->dispatch_vs_memcpy, r->dispatch_vs_naive, r->combine.time_ms,
               r->combine_vs_memcpy, r->combine_vs_naive);
  nlohmann::json shape = result_json(*r);
  if (o.phases) {
    nlohmann::json phases = nlohmann::json::array();
    for (const bench::PhaseSummary& p : bench::summarize_phases(*tracer))
      phases.push_back({{"name", p.name}, {"count", p.count}, {"mean_ms", p.mean_ms}, {"max_ms", p.max_ms}});
    shape["phases"] = phases;
  }
  if (!o.trace_path.empty()) append_trace(runs.trace_events, *tracer, static_cast<int>(i), label);
  runs.shapes.push_back(std::move(shape));
  runs.results.push_back(std::move(r).value());
}

void write_trace(const std::string& path, const nlohmann::json& events) {
  std::ofstream trace(path);
  trace << nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump() << "\n";
  if (!trace) spdlog::error("could not write the trace to {}", path);
  else spdlog::info("trace written to {} (open in chrome://tracing or ui.perfetto.dev)", path);
}

// What the table's columns mean, and which layer combine it timed.
void print_legend(std::FILE* table, const BenchExchangeOptions& o, const MachineInfo& machine) {
  fmt::print(table,
             "\nGB/s = received rows x row bytes / time (logical, DeepEP's figure), the same bytes for every method; "
             "vs memcpy = memcpy time / time, vs naive = naive time / time; medians of {} interleaved reps; cpu ms = "
             "CPU time of all rank threads in the operation; {} rank threads share {} cores. layer combine = "
             "MoELayer's combine_expanded ({}); its GB/s and memcpy (layer) are of {} (rows x hidden x {}){}.\n",
             o.reps, o.num_ranks, machine.cores,
             o.layer_combine == "receiver" ? "bf16 expert rows in the combine region, weighted by the receiver, f32 out"
             : o.layer_combine == "bf16"   ? "f32 expert rows, weighted, bf16 partials sent, f32 out"
                                           : "f32 expert rows in the combine region, weighted where they lie, f32 partials only across nodes, "
               "f32 out; layer (y outside): the same with the rows outside the Buffer, f32 partials written first",
             o.layer_combine == "receiver" ? "the bytes a bf16 combine moves" : "the partial bytes it sends",
             o.layer_combine == "bf16" || o.layer_combine == "receiver" ? 2 : 4,
             o.layer_combine == "receiver"
                 ? "; memcpy (expanded) copies the expanded bf16 rows it reads, its vs memcpy = its time / the layer "
                   "combine's"
                 : "");
}

// --phases: each shape's tracer spans, folded per name.
void print_phases(std::FILE* table, const nlohmann::json& shapes) {
  for (const nlohmann::json& shape : shapes) {
    if (!shape.contains("phases")) continue;
    fmt::print(table, "\nphases, tokens {} {}x{} (mean ms per span over ranks and reps):\n",
               shape["tokens"].get<int>(), shape["nodes"].get<int>(),
               shape["ranks"].get<int>() / shape["nodes"].get<int>());
    for (const auto& p : shape["phases"])
      fmt::print(table, "  {:<32} {:>6} spans  mean {:>9.3f}  max {:>9.3f}\n", p["name"].get<std::string>(),
                 p["count"].get<int64_t>(), p["mean_ms"].get<double>(), p["max_ms"].get<double>());
  }
}

// --json: the one object on stdout.
void print_json(const BenchExchangeOptions& o, const MachineInfo& machine, const std::string& date,
                const nlohmann::json& shapes) {
  nlohmann::json j = record_head(machine, date);
  j["config"] = {{"ranks", o.num_ranks},      {"tokens", o.tokens}, {"node_shapes", o.node_shapes},
                 {"hidden", o.hidden},        {"experts", o.num_experts}, {"topk", o.topk},
                 {"dtype", o.dtype},          {"reps", o.reps},     {"warmup", o.warmup},
                 {"skew", o.skew},            {"seed", o.seed},     {"verify", !o.no_verify},
                 {"record_waits", o.record_waits},
                 {"layer_combine", o.layer_combine},
                 {"routing", o.skew == 0 ? "uniform random distinct experts per token" : "zipf-skewed"},
                 {"bandwidth", "logical: received rows x row bytes / median time"}};
  j["shapes"] = shapes;
  fmt::print("{}\n", j.dump(2));
}

}  // namespace

CLI::App* add_bench_exchange_command(CLI::App& bench, BenchExchangeOptions& o) {
  CLI::App* cmd = bench.add_subcommand(
      "exchange",
      "Dispatch and combine against the physical limit (memcpy of the same bytes by the same threads) and a naive "
      "Megatron-style all-to-all; medians of interleaved repetitions");
  cmd->add_option("--tokens", o.tokens, "Tokens per rank, comma-separated")
      ->delimiter(',')
      ->transform(in_range(1, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--nodes-shapes", o.node_shapes,
                  "Node shapes NODESxRANKS_PER_NODE, comma-separated; each must have --ranks ranks")
      ->delimiter(',')
      ->capture_default_str();
  add_shape_options(cmd, {.ranks = &o.num_ranks,
                          .hidden = &o.hidden,
                          .experts = &o.num_experts,
                          .topk = &o.topk,
                          .skew = &o.skew,
                          .seed = &o.seed});
  cmd->add_option("--dtype", o.dtype,
                  "Payload type; fp8 instead times bf16 vs fp8 e4m3 dispatch (f32 and ue8m0 scales, rows "
                  "quantised on send) of the same bf16 rows, bytes and time in one run")
      ->check(CLI::IsMember({"bf16", "f32", "fp8"}))
      ->capture_default_str();
  cmd->add_option("--reps", o.reps, "Timed repetitions of each method")
      ->transform(in_range(1, 10000))
      ->capture_default_str();
  cmd->add_option("--warmup", o.warmup, "Untimed warm-up iterations (the first is checked)")
      ->transform(in_range(1, 100))
      ->capture_default_str();
  cmd->add_flag("--no-verify", o.no_verify, "Skip the check of every method's output after the warm-up");
  cmd->add_option("--record-waits", o.record_waits,
                  "on: epx's operations record who waited for whom (BufferConfig::record_waits, the "
                  "default); off: not, to measure what recording costs")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  cmd->add_option("--layer-combine", o.layer_combine,
                  "on: also time the combine MoELayer runs (combine_expanded: f32 expert rows, weighted, "
                  "f32 partials, f32 out; the Buffer then keeps an f32 combine region) against memcpy of "
                  "its bytes; bf16: the same with bf16 partials (CombineOptions::partial_dtype); receiver: "
                  "weighted by the receiver (CombineOptions::weights_at), bf16 expert rows already in the "
                  "combine region, against memcpy of a bf16 combine's bytes (and of the expanded bf16 rows "
                  "it reads; flat shapes only, e.g. --nodes-shapes 1x8); off: not, which saves its memory")
      ->check(CLI::IsMember({"on", "bf16", "receiver", "off"}))
      ->capture_default_str();
  cmd->add_option("--memory-fraction", o.memory_fraction,
                  "Share of available memory a shape may use; above it methods run one after the other")
      ->transform(in_range(0.05, 1.0))
      ->capture_default_str();
  cmd->add_flag("--phases", o.phases, "Time the exchange's internal phases (tracer spans) and print them");
  cmd->add_option("--trace", o.trace_path, "Write a Chrome trace of the timed repetitions to this file");
  cmd->add_flag("--json", o.json, "Print exactly one JSON object on stdout (table and progress on stderr)");
  return cmd;
}

int run_bench_exchange(const BenchExchangeOptions& o) {
  std::vector<bench::ExchangeBenchConfig> configs;
  if (int code = shape_configs(o, &configs); code != kExitOk) return code;
  if (o.dtype == "fp8") return run_bench_fp8(o, configs);

  const MachineInfo machine = machine_info();
  const std::string date = utc_now();
  spdlog::info("epx bench exchange: {} shapes on {} ({} cores, {:.1f} GiB); {} rank threads",
               configs.size(), machine.cpu_model, machine.cores,
               static_cast<double>(machine.memory_bytes) / (1024.0 * 1024 * 1024), o.num_ranks);
  ShapeRuns runs;
  for (std::size_t i = 0; i < configs.size(); ++i) run_shape(o, configs[i], i, configs.size(), machine, runs);
  if (!o.trace_path.empty()) write_trace(o.trace_path, runs.trace_events);

  std::FILE* table = o.json ? stderr : stdout;
  fmt::print(table, "\n");
  print_table(table, runs.results);
  print_legend(table, o, machine);
  if (o.phases) print_phases(table, runs.shapes);
  if (o.json) print_json(o, machine, date, runs.shapes);
  return runs.any_failed ? kExitFailed : kExitOk;
}

}  // namespace epx::app
