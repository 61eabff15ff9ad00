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
//
// Where the time goes (per step, the largest over ranks): the main thread's
// CPU time and its time runnable but not running (waiting for the core:
// /proc/thread-self/schedstat), the CPU time of the rank's other threads
// (progress threads, MPI's and UCX's), and, when the rank is pinned to one
// core (two_hosts.sh --cpus), that core's softirq time (the network stack)
// and its busy time that is not this process's (other processes).
#include <sched.h>
#include <time.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <fstream>
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
#include "cpu_time.h"
#include "mpi_launch.h"
#include "stats.h"

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
  bool pack_weights = false;  // MoELayerConfig::pack_expert_weights
};

constexpr std::array kModes = {OverlapMode::kNone, OverlapMode::kSharedExperts, OverlapMode::kChunked,
                               OverlapMode::kTwoMicroBatches};
// What one repetition records: the maximum over ranks of each field, and
// the minimum over ranks of the exchange (kExchangeMin).
enum Field { kTotal, kCompute, kRouter, kDispatch, kExperts, kExpertsCpu, kCombine, kMainCpu, kMainWait, kOtherThreads,
             kCoreSoftirq, kCoreOther, kExchangeMin, kFields };

// CPU accounting of one rank at one instant (seconds).
struct CpuClock {
  double main_cpu = 0, main_wait = 0;  // this thread: on a CPU, runnable but waiting for one
  double process_cpu = 0;              // all threads of the process
  double core_softirq = 0, core_busy = 0;  // the pinned core (0 when not pinned to one)
};

// The one CPU this thread may run on, or -1.
int pinned_cpu() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0 || CPU_COUNT(&set) != 1) return -1;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) return c;
  return -1;
}

// Busy and softirq seconds of CPU `cpu` from /proc/stat (jiffies: coarse,
// so they are summed over the repetitions).
void read_core(int cpu, CpuClock* c) {
  std::ifstream in("/proc/stat");
  const std::string want = fmt::format("cpu{}", cpu);
  std::string name;
  while (in >> name) {
    if (name != want) {
      in.ignore(1 << 16, '\n');
      continue;
    }
    double f[8] = {};  // user nice system idle iowait irq softirq steal
    for (double& v : f) in >> v;
    static const double tick = 1.0 / static_cast<double>(sysconf(_SC_CLK_TCK));
    c->core_softirq = (f[5] + f[6]) * tick;
    c->core_busy = (f[0] + f[1] + f[2] + f[5] + f[6]) * tick;
    return;
  }
}

CpuClock cpu_clock(int cpu) {
  CpuClock c;
  if (FILE* f = std::fopen("/proc/thread-self/schedstat", "r")) {
    unsigned long long run = 0, wait = 0;
    if (std::fscanf(f, "%llu %llu", &run, &wait) == 2) {
      c.main_cpu = static_cast<double>(run) * 1e-9;
      c.main_wait = static_cast<double>(wait) * 1e-9;
    }
    std::fclose(f);
  }
  c.process_cpu = process_cpu_seconds();
  if (cpu >= 0) read_core(cpu, &c);
  return c;
}

double mean(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x;
  return v.empty() ? 0.0 : sum / static_cast<double>(v.size());
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
    c.pack_expert_weights = o.pack_weights;
    EPX_ASSIGN_OR_RETURN(auto layer, MoELayer::create(c, t, *buffer, 0));
    layers.push_back(std::move(layer));
  }
  std::vector<float> x(static_cast<std::size_t>(T) * H), g(x.size()), out(x.size()), grad_x(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    x[i] = static_cast<float>(standard_normal(1, static_cast<uint64_t>(t.rank()), i));
    g[i] = static_cast<float>(standard_normal(2, static_cast<uint64_t>(t.rank()), i)) * 1e-3f;
  }
  const auto view = [&](std::vector<float>& v) { return TensorView::contiguous(v.data(), DType::kF32, {T, H}); };
  const int cpu = pinned_cpu();
  for (int rep = -o.warmup; rep < o.reps; ++rep) {
    for (std::size_t m = 0; m < kModes.size(); ++m) {
      MoELayer& layer = *layers[m];
      EPX_RETURN_IF_ERROR(t.barrier(Deadline::after(std::chrono::seconds(120))));
      const CpuClock c0 = cpu_clock(cpu);
      Stopwatch watch;
      EPX_RETURN_IF_ERROR(layer.forward(view(x), view(out)));
      EPX_RETURN_IF_ERROR(layer.backward(view(g), view(grad_x)));
      const double wall = watch.seconds();
      const CpuClock c1 = cpu_clock(cpu);
      const LayerTimes& lt = layer.times();
      const double main_cpu = c1.main_cpu - c0.main_cpu, process_cpu = c1.process_cpu - c0.process_cpu;
      std::array<double, kFields> v = {wall, lt.router + lt.experts + lt.stats, lt.router, lt.dispatch,
                                       lt.experts, lt.experts_cpu, lt.combine, main_cpu, c1.main_wait - c0.main_wait,
                                       process_cpu - main_cpu, c1.core_softirq - c0.core_softirq,
                                       c1.core_busy - c0.core_busy - process_cpu, lt.dispatch + lt.combine};
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
    for (int f = 0; f < kFields; ++f)  // the core's jiffies are too coarse for a median
      med[m][f] = f == kCoreSoftirq || f == kCoreOther ? mean(s[m][f]) : median(s[m][f]);
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
  fmt::print("{:<18} {:>11} {:>9} {:>10} {:>10} {:>12} {:>11}\n", "where (ms/step)", "experts cpu", "main cpu",
             "main wait", "threads", "core softirq", "core others");
  for (std::size_t m = 0; m < kModes.size(); ++m)
    fmt::print("{:<18} {:>11.1f} {:>9.1f} {:>10.1f} {:>10.1f} {:>12.1f} {:>11.1f}\n", overlap_mode_name(kModes[m]),
               med[m][kExpertsCpu], med[m][kMainCpu], med[m][kMainWait], med[m][kOtherThreads], med[m][kCoreSoftirq], med[m][kCoreOther]);
  fmt::print("(experts cpu: the experts phases' CPU time on the main thread; main cpu/wait: the main thread on a core / runnable, waiting for one; threads: the rank's other "
             "threads' CPU; core: the pinned core's softirq and other processes' busy time, means; 0 unpinned)\n");
  if (!o.json) return;
  std::string modes;
  for (std::size_t m = 0; m < kModes.size(); ++m)
    modes += fmt::format("{}\"{}\":{{\"step_ms\":{:.3f},\"dispatch_ms\":{:.3f},\"combine_ms\":{:.3f},"
                         "\"experts_ms\":{:.3f},\"experts_cpu_ms\":{:.3f},\"router_ms\":{:.3f},\"main_cpu_ms\":{:.3f},"
                         "\"main_wait_ms\":{:.3f},\"threads_cpu_ms\":{:.3f},\"core_softirq_ms\":{:.3f},"
                         "\"core_others_ms\":{:.3f}}}",
                         m ? "," : "", overlap_mode_name(kModes[m]), med[m][kTotal], med[m][kDispatch],
                         med[m][kCombine], med[m][kExperts], med[m][kExpertsCpu], med[m][kRouter], med[m][kMainCpu], med[m][kMainWait],
                         med[m][kOtherThreads], med[m][kCoreSoftirq], med[m][kCoreOther]);
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
  app.add_flag("--pack-weights", o.pack_weights, "Pack the routed experts' bf16 weights (MoELayerConfig::pack_expert_weights)");
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
