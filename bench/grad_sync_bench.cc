// epx_grad_sync_bench: `epx train` with the gradient all-reduce overlapped
// with the backward (--grad-overlap on) against after it (off), on
// in-process ranks. Each round trains the same model once per mode, the
// modes alternating; per mode, medians over the steps after the first of:
// the step time, the slowest rank's seconds in the reductions (grad_reduce)
// and waiting for them after the backward (grad_wait), and the bytes each
// rank contributed to collectives (TransportCounters::collective_bytes of the
// world and of the gradient thread's groups) against the gradient bytes and
// a ring all-reduce's 2 (n - 1) / n x gradient bytes. Table on stdout.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "epx/comm/inproc.h"
#include "epx/train/trainer.h"
#include "exchange_bench.h"

namespace epx::bench {
namespace {

struct Options {
  int num_ranks = 4, layers = 4, hidden = 128, ffn_hidden = 256, experts = 8, shared_experts = 1, rounds = 2;
  int64_t steps = 25, batch_tokens = 2048, bucket_kib = 4096;
};

struct ModeSamples {
  std::vector<double> step_ms, reduce_ms, wait_ms, collective_bytes;  // per step (bytes: per run)
};

TrainConfig make_config(const Options& o, bool overlap) {
  TrainConfig c;
  c.num_ranks = o.num_ranks;
  c.steps = o.steps;
  c.batch_tokens = o.batch_tokens;
  c.model.num_layers = o.layers;
  c.model.layer.hidden = o.hidden;
  c.model.layer.ffn_hidden = o.ffn_hidden;
  c.model.layer.num_shared_experts = o.shared_experts;
  c.model.layer.router = {.num_experts = o.experts, .topk = 2, .normalize_weights = true};
  c.schedule.total_steps = o.steps;
  c.grad_overlap = overlap;
  c.grad_bucket_bytes = o.bucket_kib * 1024;
  return c;
}

// One training run; rank 0's reports give the times, the world the bytes.
Status run_mode(const Options& o, bool overlap, ModeSamples* out) {
  TrainConfig config = make_config(o, overlap);
  EPX_ASSIGN_OR_RETURN(Topology topology, Topology::create(o.num_ranks, 1));
  InprocWorld world(topology);
  std::vector<StepReport> reports;
  EPX_RETURN_IF_ERROR(first_error(world.run([&](Transport& t) -> Status {
    TrainConfig mine = config;
    mine.transport = &t;
    return train(mine, [&](const StepReport& r) { reports.push_back(r); }).status();
  })));
  for (std::size_t s = 1; s < reports.size(); ++s) {
    double reduce = 0, wait = 0;
    for (const RankTimes& t : reports[s].ranks) {
      reduce = std::max(reduce, t.grad_reduce);
      wait = std::max(wait, t.grad_wait);
    }
    out->step_ms.push_back(reports[s].seconds * 1e3);
    out->reduce_ms.push_back(reduce * 1e3);
    out->wait_ms.push_back(wait * 1e3);
  }
  out->collective_bytes.push_back(static_cast<double>(world.total_counters().collective_bytes) /
                                  static_cast<double>(o.num_ranks * std::max<int64_t>(o.steps, 1)));
  return Status::ok();
}

// Gradient floats per rank: dense ones (input, per layer norm, router and
// shared experts, final norm, head) and this rank's experts (w1, w3, w2).
std::pair<double, double> gradient_bytes(const Options& o) {
  const TrainConfig c = make_config(o, false);
  const double H = o.hidden, F = o.ffn_hidden, E = o.experts, L = o.layers;
  const double S = o.shared_experts * F;
  const double dense = c.model.num_inputs() * H + H + H * c.model.num_outputs() + L * (H + H * E + 3 * H * S);
  const double experts = L * 3 * (E / o.num_ranks) * H * F;
  return {dense * 4, experts * 4};
}

Status run(const Options& o) {
  ModeSamples modes[2];  // off, on
  for (int round = 0; round < o.rounds; ++round)
    for (int m = 0; m < 2; ++m) {
      fmt::print(stderr, "round {}, grad-overlap {}\n", round + 1, m ? "on" : "off");
      EPX_RETURN_IF_ERROR(run_mode(o, m == 1, &modes[m]));
    }
  const auto [dense, experts] = gradient_bytes(o);
  const double n = o.num_ranks;
  fmt::print("{} ranks, {} layers, hidden {}, ffn {}, {} experts top-2, {} shared, {} tokens per step, {} steps x {} "
             "rounds, buckets {} KiB\n",
             o.num_ranks, o.layers, o.hidden, o.ffn_hidden, o.experts, o.shared_experts, o.batch_tokens, o.steps,
             o.rounds, o.bucket_kib);
  fmt::print("gradient bytes per rank: dense {:.0f} (all-reduced over {} ranks; ring 2(n-1)/n x = {:.0f}), "
             "experts {:.0f} (EDP of 1: not reduced)\n",
             dense, o.num_ranks, 2 * (n - 1) / n * dense, experts);
  fmt::print("| grad-overlap | step ms | grad_reduce ms | grad_wait ms | reduce / step | wait / step | "
             "collective bytes per rank per step |\n|---|---|---|---|---|---|---|\n");
  for (int m = 0; m < 2; ++m) {
    const ModeSamples& s = modes[m];
    const double step = median(s.step_ms), reduce = median(s.reduce_ms), wait = median(s.wait_ms);
    fmt::print("| {} | {:.2f} | {:.2f} | {:.2f} | {:.1f}% | {:.1f}% | {:.0f} |\n", m ? "on" : "off", step, reduce,
               wait, 100 * reduce / step, 100 * wait / step, median(s.collective_bytes));
  }
  return Status::ok();
}

}  // namespace
}  // namespace epx::bench

int main(int argc, char** argv) {
  epx::bench::Options o;
  CLI::App app{"epx train with the gradient all-reduce overlapped with the backward, and without"};
  app.add_option("--ranks", o.num_ranks)->capture_default_str();
  app.add_option("--layers", o.layers)->capture_default_str();
  app.add_option("--hidden", o.hidden)->capture_default_str();
  app.add_option("--ffn-hidden", o.ffn_hidden)->capture_default_str();
  app.add_option("--experts", o.experts)->capture_default_str();
  app.add_option("--shared-experts", o.shared_experts)->capture_default_str();
  app.add_option("--steps", o.steps)->capture_default_str();
  app.add_option("--batch-tokens", o.batch_tokens)->capture_default_str();
  app.add_option("--bucket-kib", o.bucket_kib)->capture_default_str();
  app.add_option("--rounds", o.rounds)->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  const epx::Status status = epx::bench::run(o);
  if (!status.is_ok()) {
    fmt::print(stderr, "epx_grad_sync_bench: {}\n", status.to_string());
    return 1;
  }
  return 0;
}
