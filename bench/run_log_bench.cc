// How fast read_metrics reads a metrics file (docs/performance.md,
// Observability): writes --steps lines of the trainer's own format
// (StepReport::to_json) with --layers x --experts loads, then times, median
// of --reps each, (1) plain read() of the file into one reused buffer (the
// copy out of the page cache, the floor for any reader of the file) and (2)
// read_metrics with a callback that only touches each record.
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <random>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <simdjson.h>

#include "epx/observe/run_log.h"
#include "epx/train/trainer.h"
#include "exchange_bench.h"

namespace {

using Clock = std::chrono::steady_clock;

// A step like a real run's: loads around tokens * topk / experts per expert.
epx::StepReport make_step(int64_t step, int layers, int experts, int ranks, std::mt19937_64& rng) {
  epx::StepReport report;
  report.step = step;
  report.loss = 2.0 + 1.0 / static_cast<double>(step + 1);
  report.main_loss = report.loss - 0.01;
  report.learning_rate = 3e-4;
  report.grad_norm = 0.8123;
  report.seconds = 0.1234;
  report.tokens_per_second = 123456.7;
  std::uniform_int_distribution<int64_t> load(500, 3500);
  for (int l = 0; l < layers; ++l) {
    epx::LoadStats s;
    for (int e = 0; e < experts; ++e) s.tokens_per_expert.push_back(load(rng));
    for (int r = 0; r < ranks; ++r) s.tokens_per_rank.push_back(load(rng) * 16);
    s.max_vio = 0.4321;
    s.cv = 0.1234;
    s.worst_rank_share = 0.15;
    s.idle_fraction = 0.11;
    report.layers.push_back(std::move(s));
  }
  report.ranks.resize(static_cast<std::size_t>(ranks), epx::RankTimes{0.001, 0.01, 0.05, 0.01, 0.02, 0.001, 0.002,
                                                                       0.1, 0.003, 0.001, 1e6});
  return report;
}

double read_only_seconds(const std::string& path) {
  std::vector<char> buffer(std::size_t{8} << 20);
  const auto start = Clock::now();
  const int fd = ::open(path.c_str(), O_RDONLY);
  while (::read(fd, buffer.data(), buffer.size()) > 0) {
  }
  ::close(fd);
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// simdjson's own fastest path for JSON Lines on one thread (DOM parse_many
// over the file in memory), summing every integer of every layer: the rate
// the library itself reaches on these lines, for comparison. Seconds of the
// parse alone (not the load).
double simdjson_dom_seconds(const std::string& path, int64_t& checksum) {
  simdjson::padded_string text;
  if (simdjson::padded_string::load(path).get(text)) return -1;
  simdjson::dom::parser parser;
  const auto start = Clock::now();
  simdjson::dom::document_stream docs;
  if (parser.parse_many(text).get(docs)) return -1;
  for (auto doc : docs) {
    simdjson::dom::array layers;
    if (doc["layers"].get_array().get(layers)) return -1;
    for (simdjson::dom::element layer : layers)
      for (simdjson::dom::element count : layer["tokens_per_expert"].get_array()) checksum += count.get_int64();
  }
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"read_metrics throughput on a generated metrics file"};
  int64_t steps = 1000;
  int layers = 61, experts = 256, ranks = 8, reps = 3;
  std::string path = (std::filesystem::temp_directory_path() / "epx_run_log_bench.jsonl").string();
  app.add_option("--steps", steps, "Lines (steps) in the file")->check(CLI::Range(1, 10000000))->capture_default_str();
  app.add_option("--layers", layers, "MoE layers per step")->check(CLI::Range(1, 1000))->capture_default_str();
  app.add_option("--experts", experts, "Experts per layer")->check(CLI::Range(1, 100000))->capture_default_str();
  app.add_option("--ranks", ranks, "Ranks per step")->check(CLI::Range(1, 100000))->capture_default_str();
  app.add_option("--reps", reps, "Repetitions (median)")->check(CLI::Range(1, 100))->capture_default_str();
  bool reuse = false;
  app.add_option("--file", path, "Where to write the generated file (removed at the end)")->capture_default_str();
  app.add_flag("--reuse", reuse, "Read the --file already there (written by an earlier run with --keep) and keep it");
  bool keep = false;
  app.add_flag("--keep", keep, "Keep the generated file");
  CLI11_PARSE(app, argc, argv);

  if (!reuse) {
    std::mt19937_64 rng(17);
    std::FILE* out = std::fopen(path.c_str(), "wb");
    if (out == nullptr) {
      fmt::print(stderr, "cannot write {}\n", path);
      return 1;
    }
    for (int64_t s = 0; s < steps; ++s) fmt::print(out, "{}\n", make_step(s, layers, experts, ranks, rng).to_json());
    std::fclose(out);
  }
  const double mb = static_cast<double>(std::filesystem::file_size(path)) / 1e6;
  std::vector<double> read_times, parse_times, parse_cpu, others_share;
  int64_t checksum = 0;
  for (int r = 0; r < reps; ++r) {
    read_times.push_back(read_only_seconds(path));
    const auto start = Clock::now();
    const epx::bench::CpuSnapshot before = epx::bench::cpu_snapshot();
    const epx::Status status = epx::read_metrics(path, [&](epx::StepRecord&& record) {
      checksum += record.layers.back().tokens_per_expert.back();
      return epx::Status::ok();
    });
    parse_times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
    const epx::bench::CpuSnapshot after = epx::bench::cpu_snapshot();
    parse_cpu.push_back(after.self_s - before.self_s);
    others_share.push_back(epx::bench::other_cpu_share(before, after));
    if (!status.is_ok()) {
      fmt::print(stderr, "{}\n", status.to_string());
      return 1;
    }
  }
  int64_t dom_checksum = 0;
  const double t_dom = simdjson_dom_seconds(path, dom_checksum);
  if (!reuse && !keep) std::filesystem::remove(path);
  const double t_read = epx::bench::median(read_times), t_parse = epx::bench::median(parse_times);
  fmt::print("file: {} steps x {} layers x {} experts, {} ranks: {:.1f} MB, {:.0f} bytes per line\n", steps, layers,
             experts, ranks, mb, mb * 1e6 / static_cast<double>(steps));
  fmt::print("read() only:   {:8.3f} s  {:8.0f} MB/s\n", t_read, mb / t_read);
  fmt::print("read_metrics:  {:8.3f} s  {:8.0f} MB/s  {:8.0f} steps/s  (checksum {})\n", t_parse, mb / t_parse,
             static_cast<double>(steps) / t_parse, checksum);
  const double t_cpu = epx::bench::median(parse_cpu);
  fmt::print("read_metrics CPU time: {:.3f} s (both threads): {:.0f} MB per CPU-second; other processes used "
             "{:.0f}% of the machine meanwhile\n",
             t_cpu, mb / t_cpu, 100 * epx::bench::median(others_share));
  fmt::print("simdjson DOM parse_many, 1 thread, file in memory: {:.3f} s {:.0f} MB/s (checksum {})\n", t_dom,
             mb / t_dom, dom_checksum);
  fmt::print("100,000 steps of these lines at this rate: {:.1f} s\n", 1e5 * (t_parse / static_cast<double>(steps)));
  return 0;
}
