// Writes a synthetic metrics file in the trainer's format (StepReport::to_json
// with the wait fields) for benchmarking `epx report` at sizes no
// test run reaches: e.g. 100,000 steps x 61 layers x 256 experts (~8 GB).
//
//   report_metrics_gen --steps 100000 --layers 61 --experts 256 --ranks 64 --out big.jsonl
//
// Per step: a falling loss, each layer's expert loads a slowly drifting skew
// (a few hot experts), per-rank times with rank 3 arriving late, an EPLB
// re-placement every --eplb-every steps and a wait matrix every
// --wait-matrix-every steps. Deterministic for its arguments.
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

namespace {

struct GenOptions {
  int64_t steps = 1000;
  int layers = 61, experts = 256, ranks = 64, eplb_every = 1000, wait_matrix_every = 100;
  int64_t tokens = 65536;  // per layer per step, counted once per top-k choice
  std::string out = "metrics.jsonl";
};

void append_layers(fmt::memory_buffer& b, const GenOptions& o, int64_t step, std::mt19937_64& rng) {
  std::vector<int64_t> load(static_cast<std::size_t>(o.experts));
  for (int l = 0; l < o.layers; ++l) {
    // Expert e's weight rises and falls with the step, hotter for a few.
    double total = 0;
    std::vector<double> w(load.size());
    for (int e = 0; e < o.experts; ++e) {
      w[static_cast<std::size_t>(e)] = 1.0 + 0.5 * std::sin(0.001 * static_cast<double>(step) + e * 0.7 + l) +
                                       (e % 37 == l % 37 ? 2.0 : 0.0) + 0.1 * static_cast<double>(rng() % 100) / 100;
      total += w[static_cast<std::size_t>(e)];
    }
    int64_t max = 0;
    for (std::size_t e = 0; e < load.size(); ++e) {
      load[e] = static_cast<int64_t>(static_cast<double>(o.tokens) * w[e] / total);
      max = std::max(max, load[e]);
    }
    const double mean = static_cast<double>(o.tokens) / o.experts;
    fmt::format_to(std::back_inserter(b),
                   "{}{{\"layer\":{},\"max_vio\":{:.5f},\"cv\":0.3,\"dropped\":0,\"worst_rank\":{},\"worst_rank_share\":"
                   "0.05,\"idle_fraction\":{:.5f},\"tokens_per_expert\":[{}],\"tokens_per_rank\":[]}}",
                   l ? "," : "", l, static_cast<double>(max) / mean - 1, l % o.ranks, 0.1 + 0.05 * std::sin(l),
                   fmt::join(load, ","));
  }
}

void append_ranks(fmt::memory_buffer& b, const GenOptions& o) {
  for (int r = 0; r < o.ranks; ++r) {
    const bool slow = r == 3;
    fmt::format_to(std::back_inserter(b),
                   "{}{{\"rank\":{},\"router\":0.002,\"dispatch\":{},\"experts\":0.05,\"combine\":0.01,\"dense\":0.02,"
                   "\"wait\":{},\"sync\":0.01,\"total\":0.15,\"grad_reduce\":0.01,\"grad_wait\":0.001,\"grad_bytes\":1e6,"
                   "\"exchange_wait\":{},\"waited_for\":{},\"late\":{},\"slow_data\":0}}",
                   r ? "," : "", r, slow ? 0.01 : 0.03, slow ? 0.0 : 0.02, slow ? 0.0 : 0.02, slow ? -1 : 3,
                   slow ? 0.02 * (o.ranks - 1) : 0.0);
  }
}

void append_wait_matrix(fmt::memory_buffer& b, const GenOptions& o) {
  std::vector<double> arrival(static_cast<std::size_t>(o.ranks) * o.ranks, 0.0), data(arrival.size(), 0.0);
  for (int r = 0; r < o.ranks; ++r) {
    if (r == 3) continue;
    arrival[static_cast<std::size_t>(r) * o.ranks + 3] = 0.02;
    data[static_cast<std::size_t>(r) * o.ranks + (r + 1) % o.ranks] = 0.001;
  }
  fmt::format_to(std::back_inserter(b), ",\"wait_matrix\":{{\"num_ranks\":{},\"arrival\":[{}],\"data\":[{}]}}", o.ranks,
                 fmt::join(arrival, ","), fmt::join(data, ","));
}

}  // namespace

int main(int argc, char** argv) {
  GenOptions o;
  CLI::App app{"Writes a synthetic epx metrics file (JSON Lines) for benchmarking epx report"};
  app.add_option("--steps", o.steps)->check(CLI::Range(int64_t{1}, int64_t{1} << 40))->capture_default_str();
  app.add_option("--layers", o.layers)->check(CLI::Range(1, 1024))->capture_default_str();
  app.add_option("--experts", o.experts)->check(CLI::Range(1, 65536))->capture_default_str();
  app.add_option("--ranks", o.ranks)->check(CLI::Range(4, 4096))->capture_default_str();
  app.add_option("--eplb-every", o.eplb_every)->check(CLI::Range(1, 1 << 30))->capture_default_str();
  app.add_option("--wait-matrix-every", o.wait_matrix_every)->check(CLI::Range(1, 1 << 30))->capture_default_str();
  app.add_option("--out", o.out)->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  std::FILE* f = std::fopen(o.out.c_str(), "w");
  if (!f) {
    fmt::print(stderr, "report_metrics_gen: cannot write '{}'\n", o.out);
    return 1;
  }
  std::mt19937_64 rng(1);
  fmt::memory_buffer b;
  for (int64_t s = 0; s < o.steps; ++s) {
    b.clear();
    const double loss = 2.0 + 8.0 / std::sqrt(1.0 + static_cast<double>(s) / 100);
    fmt::format_to(std::back_inserter(b),
                   "{{\"step\":{},\"loss\":{:.6f},\"main_loss\":{:.6f},\"lr\":0.0003,\"grad_norm\":1.0,\"seconds\":0.15,"
                   "\"tokens_per_s\":{:.1f},\"layers\":[",
                   s, loss, loss - 0.01, 400000.0 + 1000 * std::sin(0.01 * static_cast<double>(s)));
    append_layers(b, o, s, rng);
    b.append(std::string_view("],\"ranks\":["));
    append_ranks(b, o);
    b.push_back(']');
    if ((s + 1) % o.wait_matrix_every == 0) append_wait_matrix(b, o);
    if ((s + 1) % o.eplb_every == 0)
      fmt::format_to(std::back_inserter(b),
                     ",\"eplb\":{{\"balance_before\":[1.3],\"balance_after\":[1.05],\"moved_slots\":32,"
                     "\"moved_bytes\":1000000}}");
    b.append(std::string_view("}\n"));
    if (std::fwrite(b.data(), 1, b.size(), f) != b.size()) {
      fmt::print(stderr, "report_metrics_gen: writing '{}' failed at step {}\n", o.out, s);
      std::fclose(f);
      return 1;
    }
  }
  return std::fclose(f) == 0 ? 0 : 1;
}
