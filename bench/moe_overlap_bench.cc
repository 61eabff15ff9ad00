// moe_overlap_bench: MoELayer forward + backward with each overlap mode, in
// one run, next to the parts measured alone (the plain layer's compute and
// exchange phases, which overlap nothing there).
//
//   mpirun -n 4 epx_moe_overlap_bench --tokens 256 --hidden 2048 --ffn-hidden 512
//   epx_moe_overlap_bench --backend inproc --ranks 4 --nodes 2
//   tests/mpi/two_hosts.sh --rate 1gbit -- epx_moe_overlap_bench ...   (two emulated hosts)
//
// Repetitions go round the modes (none, shared, chunked, two-micro-batches,
// none, ...) so that drifting machine load falls on every mode alike. Each
// repetition's time is the slowest rank's (the step ends when it does);
// medians over the repetitions. Rank 0 prints a table (and a JSON line with
// --json).
#include <algorithm>
#include <array>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "epx/comm/inproc.h"
#include "epx/comm/mpi.h"
#include "epx/core/clock.h"
#include "epx/core/random.h"
#include "epx/layer/moe_layer.h"
#include "mpi_launch.h"

namespace epx::bench {
namespace {

struct Options {
  std::string backend = "mpi";
  int ranks = 4;  // inproc
  int nodes = 2;  // inproc; under MPI 1 = the real hosts, more = emulated nodes
  int tokens = 256, hidden = 2048, ffn_hidden = 512, experts = 16, topk = 4, shared = 1, chunks = 4;
  int reps = 5, warmup = 1;
  std::string dtype = "bf16";
  bool json = false;
};

constexpr std::array kModes = {OverlapMode::kNone, OverlapMode::kSharedExperts, OverlapMode::kChunked,
                               OverlapMode::kTwoMicroBatches};
// What one repetition records: the maximum over ranks of each field, and
// the minimum over ranks of the exchange (kExchangeMin).
enum Field { kTotal, kCompute, kRouter, kDispatch, kExperts, kCombine, kExchangeMin, kFields };

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// samples[mode][field] = one value per repetition (rank 0's copy is complete).
using Samples = std::array<std::array<std::vector<double>, kFields>, kModes.size()>;

Status bench_rank(Transport& t, const Options& o, Samples* samples) {
  const DType dtype = o.dtype == "f32" ? DType::kF32 : DType::kBF16;
  const int H = o.hidden, T = o.tokens;
  BufferConfig bc;
  bc.num_experts = o.experts;
  bc.hidden = H;
  bc.dtype = dtype;
  bc.max_topk = o.topk;
  bc.max_tokens_per_rank = T;
  bc.timeout = Milliseconds(120000);
  EPX_ASSIGN_OR_RETURN(auto buffer, Buffer::create(t, bc));
  std::vector<std::unique_ptr<MoELayer>> layers;
  for (OverlapMode mode : kModes) {
    MoELayerConfig c;
    c.hidden = H;
    c.ffn_hidden = o.ffn_hidden;
    c.router = {.num_experts = o.experts, .topk = o.topk, .normalize_weights = true};
    c.num_shared_experts = o.shared;
    c.dtype = dtype;
    c.seed = 3;
    c.overlap = mode;
    c.overlap_chunks = o.chunks;
    EPX_ASSIGN_OR_RETURN(auto layer, MoELayer::create(c, t, *buffer, 0));
    layers.push_back(std::move(layer));
  }
  std::vector<float> x(static_cast<std::size_t>(T) * H), g(x.size()), out(x.size()), grad_x(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    x[i] = static_cast<float>(standard_normal(1, static_cast<uint64_t>(t.rank()), i));
    g[i] = static_cast<float>(standard_normal(2, static_cast<uint64_t>(t.rank()), i)) * 1e-3f;
  }
  const auto view = [&](std::vector<float>& v) { return TensorView::contiguous(v.data(), DType::kF32, {T, H}); };
  for (int rep = -o.warmup; rep < o.reps; ++rep) {
    for (std::size_t m = 0; m < kModes.size(); ++m) {
      MoELayer& layer = *layers[m];
      EPX_RETURN_IF_ERROR(t.barrier(Deadline::after(std::chrono::seconds(120))));
      Stopwatch watch;
      EPX_RETURN_IF_ERROR(layer.forward(view(x), view(out)));
      EPX_RETURN_IF_ERROR(layer.backward(view(g), view(grad_x)));
      const LayerTimes& lt = layer.times();
      std::array<double, kFields> v = {watch.seconds(), lt.router + lt.experts + lt.stats, lt.router, lt.dispatch,
                                       lt.experts, lt.combine, lt.dispatch + lt.combine};
      const Deadline deadline = Deadline::after(std::chrono::seconds(120));
      EPX_RETURN_IF_ERROR(t.all_reduce(std::span<double>(v.data(), kExchangeMin), ReduceOp::kMax, deadline));
      EPX_RETURN_IF_ERROR(t.all_reduce(std::span<double>(&v[kExchangeMin], 1), ReduceOp::kMin, deadline));
      if (rep >= 0)
        for (int f = 0; f < kFields; ++f) (*samples)[m][f].push_back(v[f] * 1e3);
    }
  }
  return Status::ok();
}

void report(const Options& o, int num_ranks, int num_nodes, const Samples& s) {
  std::array<std::array<double, kFields>, kModes.size()> med{};
  for (std::size_t m = 0; m < kModes.size(); ++m)
    for (int f = 0; f < kFields; ++f) med[m][f] = median(s[m][f]);
  // The plain layer's phases overlap nothing, so they are the parts measured
  // alone: its compute on the slowest rank, and its exchange on the rank that
  // waited least in it (the others' waits also hold time spent waiting for
  // the last rank's compute, which is not the exchange's).
  const auto& none = med[0];
  const double compute = none[kCompute];
  const double exchange = none[kExchangeMin];
  const double rest = std::max(0.0, none[kTotal] - compute - exchange);
  const double ideal = std::max(compute, exchange) + rest;
  fmt::print("# MoE layer forward+backward: {} ranks / {} nodes, {} tokens/rank, hidden {}, ffn {}, {} experts top-{}, "
             "{} shared, {}, {} chunks; {} reps (median, slowest rank)\n",
             num_ranks, num_nodes, o.tokens, o.hidden, o.ffn_hidden, o.experts, o.topk, o.shared, o.dtype, o.chunks,
             o.reps);
  fmt::print("parts alone (plain layer): compute {:.1f} ms, exchange {:.1f} ms, other {:.1f} ms; sum {:.1f} ms, "
             "max {:.1f} ms\n",
             compute, exchange, rest, compute + exchange + rest, ideal);
  fmt::print("{:<18} {:>9} {:>10} {:>10} {:>9} {:>8} {:>9} {:>9}\n", "mode", "step ms", "dispatch*", "combine*",
             "experts", "router", "vs none", "vs max");
  for (std::size_t m = 0; m < kModes.size(); ++m)
    fmt::print("{:<18} {:>9.1f} {:>10.1f} {:>10.1f} {:>9.1f} {:>8.1f} {:>9.2f} {:>9.2f}\n",
               overlap_mode_name(kModes[m]), med[m][kTotal], med[m][kDispatch], med[m][kCombine], med[m][kExperts],
               med[m][kRouter], med[m][kTotal] / none[kTotal], med[m][kTotal] / ideal);
  fmt::print("(* exposed: the time the caller waited for the exchange)\n");
  if (!o.json) return;
  std::string modes;
  for (std::size_t m = 0; m < kModes.size(); ++m)
    modes += fmt::format("{}\"{}\":{{\"step_ms\":{:.3f},\"dispatch_ms\":{:.3f},\"combine_ms\":{:.3f},"
                         "\"experts_ms\":{:.3f},\"router_ms\":{:.3f}}}",
                         m ? "," : "", overlap_mode_name(kModes[m]), med[m][kTotal], med[m][kDispatch],
                         med[m][kCombine], med[m][kExperts], med[m][kRouter]);
  fmt::print("{{\"ranks\":{},\"nodes\":{},\"tokens\":{},\"hidden\":{},\"ffn_hidden\":{},\"experts\":{},\"topk\":{},"
             "\"compute_ms\":{:.3f},\"exchange_ms\":{:.3f},\"other_ms\":{:.3f},\"modes\":{{{}}}}}\n",
             num_ranks, num_nodes, o.tokens, o.hidden, o.ffn_hidden, o.experts, o.topk, compute, exchange, rest,
             modes);
}

int run(int argc, char** argv) {
  Options o;
  CLI::App app{"MoELayer forward+backward with each overlap mode vs the parts measured alone"};
  app.add_option("--backend", o.backend, "mpi (under mpirun) or inproc (ranks as threads)")
      ->check(CLI::IsMember({"mpi", "inproc"}))
      ->capture_default_str();
  app.add_option("--ranks", o.ranks, "inproc: ranks")->check(CLI::Range(1, 64))->capture_default_str();
  app.add_option("--nodes", o.nodes, "Nodes (inproc: emulated; MPI: 1 = the real hosts, more = emulated)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--tokens", o.tokens, "Tokens per rank")->check(CLI::Range(1, 1 << 16))->capture_default_str();
  app.add_option("--hidden", o.hidden, "Hidden size")->check(CLI::Range(1, 1 << 15))->capture_default_str();
  app.add_option("--ffn-hidden", o.ffn_hidden, "Width of each expert")->check(CLI::Range(1, 1 << 15))->capture_default_str();
  app.add_option("--experts", o.experts, "Routed experts")->check(CLI::Range(1, 4096))->capture_default_str();
  app.add_option("--topk", o.topk, "Experts per token")->check(CLI::Range(1, 64))->capture_default_str();
  app.add_option("--shared", o.shared, "Shared experts")->check(CLI::Range(0, 16))->capture_default_str();
  app.add_option("--chunks", o.chunks, "Chunks of the chunked mode")->check(CLI::Range(1, 64))->capture_default_str();
  app.add_option("--reps", o.reps, "Timed repetitions per mode")->check(CLI::Range(1, 1000))->capture_default_str();
  app.add_option("--warmup", o.warmup, "Untimed repetitions first")->check(CLI::Range(0, 100))->capture_default_str();
  app.add_option("--dtype", o.dtype, "Payload and expert GEMMs")->check(CLI::IsMember({"bf16", "f32"}))
      ->capture_default_str();
  app.add_flag("--json", o.json, "Also print one JSON line");
  CLI11_PARSE(app, argc, argv);

  Samples samples;
  if (o.backend == "inproc") {
    auto topology = Topology::create(o.ranks, o.nodes);
    if (!topology.is_ok()) {
      fmt::print(stderr, "{}\n", topology.status().to_string());
      return 2;
    }
    std::vector<Samples> per_rank(o.ranks);
    const Status s = first_error(run_ranks(*topology, [&](Transport& t) { return bench_rank(t, o, &per_rank[t.rank()]); }));
    if (!s.is_ok()) {
      fmt::print(stderr, "{}\n", s.to_string());
      return 1;
    }
    report(o, o.ranks, o.nodes, per_rank[0]);
    return 0;
  }
  std::unique_ptr<MpiSession> session;
  std::unique_ptr<Transport> connected;
  if (const int code = connect_mpi_rank(&argc, &argv, o.nodes, &session, &connected); code != 0) return code;
  const int R = session->world_size();
  Transport& t = *connected;
  const Status s = bench_rank(t, o, &samples);
  if (!s.is_ok()) {
    fmt::print(stderr, "rank {}: {}\n", t.rank(), s.to_string());
    t.abort(s);
    return 1;
  }
  if (t.rank() == 0) report(o, R, t.topology().num_nodes(), samples);
  return 0;
}

}  // namespace
}  // namespace epx::bench

int main(int argc, char** argv) { return epx::bench::run(argc, argv); }
