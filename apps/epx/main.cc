// The `epx` command: thin over the public API.
//
//   epx demo                      a small dispatch/combine, shown and checked
//   epx bench exchange --json     dispatch/combine vs memcpy and a naive all-to-all
//   epx bench routing --json      router and placement cost next to the score GEMM
//   epx bench lowlat --json       low-latency dispatch/combine vs the normal mode at decode sizes
//   epx eplb --loads FILE ...     a redundant-expert placement for measured loads
//   epx train [--config F.toml]   train an MoE model (threads or MPI processes), with load balancing
//   epx sim run SCENARIO.toml     simulate a cluster configuration (docs/simulator.md)
//   epx monitor METRICS.jsonl     watch a run's metrics: live view, alerts, Prometheus (docs/operations.md)
//   epx report METRICS.jsonl      a run's metrics as one HTML page
//   epx supervise -- COMMAND      restart a training from its latest checkpoint when it fails
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <system_error>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "bench_lowlat.h"
#include "cli_checks.h"
#include "commands.h"
#include "monitor.h"
#include "supervise.h"
#include "report.h"
#include "sim.h"
#include "train.h"

namespace {

int run(int argc, char** argv);

// Output that could not be written (a full disk, /dev/full) is a failure:
// a message on stderr and exit 1 (a usage error keeps its 2), never 0.
int finish_output(int code) {
  errno = 0;
  const bool flushed = std::fflush(stdout) == 0;
  const int err = errno;
  if (flushed && std::ferror(stdout) == 0) return code;
  fmt::print(stderr, "epx: cannot write the output to stdout: {}\n", err != 0 ? std::strerror(err) : "a write failed");
  return code == epx::app::kExitOk ? epx::app::kExitFailed : code;
}

// The command's name for a message: the first word that is not an option.
std::string command_name(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (argv[i][0] != '-') return fmt::format("epx {}", argv[i]);
  return "epx";
}

}  // namespace

// The last resorts: output that cannot be written, and an allocation that
// fails where no check foresaw it, end the command with a message and exit 1,
// never with exit 0 or an uncaught exception (abort).
int main(int argc, char** argv) {
  int code = epx::app::kExitFailed;
  try {
    code = run(argc, argv);
  } catch (const std::system_error& e) {  // fmt::print when the output cannot be written
    std::clearerr(stdout);
    fmt::print(stderr, "epx: cannot write the output: {}\n", e.what());
    return epx::app::kExitFailed;
  } catch (const std::bad_alloc&) {
    fmt::print(stderr, "{}: out of memory while running the command (an allocation failed); stopped\n",
               command_name(argc, argv));
    return epx::app::kExitFailed;
  } catch (const std::length_error& e) {
    fmt::print(stderr, "{}: out of memory while running the command (a size above the maximum: {}); stopped\n",
               command_name(argc, argv), e.what());
    return epx::app::kExitFailed;
  }
  return finish_output(code);
}

namespace {

int run(int argc, char** argv) {
  using epx::app::at_least;
  using epx::app::in_range;
  using epx::app::kExitUsage;
  CLI::App app{"epx: expert parallelism for Mixture-of-Experts models (dispatch, combine, load balance).\n"
               "Ranks run as threads of this process (--nodes emulates several machines) or, started by mpirun or srun, "
               "one rank per process.",
               "epx"};
  app.set_version_flag("--version", std::string("epx ") + EPX_VERSION);
  app.require_subcommand(1);
  app.fallthrough();
  bool quiet = false;
  app.add_flag("-q,--quiet", quiet, "No progress lines on stderr");

  // epx demo
  epx::app::DemoOptions demo;
  CLI::App* demo_cmd = app.add_subcommand(
      "demo",
      "A short dispatch/combine over in-process ranks: what moved where, load imbalance, bandwidth, and a round-trip "
      "check (exit 1 if it fails)");
  demo_cmd->add_option("--ranks", demo.num_ranks, "Ranks (threads)")->transform(in_range(1, 256))->capture_default_str();
  demo_cmd->add_option("--nodes", demo.num_nodes, "Emulated nodes; must divide --ranks; > 1 takes the two-hop path")
      ->transform(in_range(1, 256))
      ->capture_default_str();
  demo_cmd->add_option("--tokens", demo.num_tokens, "Tokens per rank")->transform(in_range(0, 65536))->capture_default_str();
  demo_cmd->add_option("--hidden", demo.hidden, "Elements per token row")->transform(in_range(1, 65536))->capture_default_str();
  demo_cmd->add_option("--experts", demo.num_experts, "Experts, placed in equal blocks over the ranks")
      ->transform(in_range(1, 65536))
      ->capture_default_str();
  demo_cmd->add_option("--topk", demo.topk, "Experts per token")->transform(in_range(1, 64))->capture_default_str();
  demo_cmd->add_option("--skew", demo.skew, "Routing skew: expert e drawn with weight (e+1)^-skew; 0 = uniform")
      ->transform(in_range(0.0, 16.0))
      ->capture_default_str();
  demo_cmd->add_option("--seed", demo.seed, "Routing seed")
      ->transform(at_least(uint64_t{0}))
      ->capture_default_str();
  demo_cmd->add_option("--dtype", demo.dtype, "Payload type")->check(CLI::IsMember({"bf16", "f32"}))->capture_default_str();
  demo_cmd->add_option("--reps", demo.reps, "Timed repetitions after the checked warm-up")
      ->transform(in_range(1, 1000))
      ->capture_default_str();
  demo_cmd->add_flag("--json", demo.json, "Print one JSON object instead of the text report");

  // epx bench exchange
  CLI::App* bench_cmd = app.add_subcommand("bench", "Benchmarks");
  bench_cmd->require_subcommand(1);
  epx::app::BenchExchangeOptions bench;
  CLI::App* exchange_cmd = bench_cmd->add_subcommand(
      "exchange",
      "Dispatch and combine against the physical limit (memcpy of the same bytes by the same threads) and a naive "
      "Megatron-style all-to-all; medians of interleaved repetitions");
  exchange_cmd->add_option("--tokens", bench.tokens, "Tokens per rank, comma-separated")
      ->delimiter(',')
      ->transform(in_range(1, 1 << 20))
      ->capture_default_str();
  exchange_cmd->add_option("--nodes-shapes", bench.node_shapes,
                           "Node shapes NODESxRANKS_PER_NODE, comma-separated; each must have --ranks ranks")
      ->delimiter(',')
      ->capture_default_str();
  exchange_cmd->add_option("--ranks", bench.num_ranks, "Ranks (threads)")->transform(in_range(1, 256))->capture_default_str();
  exchange_cmd->add_option("--hidden", bench.hidden, "Elements per token row")
      ->transform(in_range(1, 1 << 20))
      ->capture_default_str();
  exchange_cmd->add_option("--experts", bench.num_experts, "Experts")->transform(in_range(1, 65536))->capture_default_str();
  exchange_cmd->add_option("--topk", bench.topk, "Experts per token")->transform(in_range(1, 64))->capture_default_str();
  exchange_cmd->add_option("--dtype", bench.dtype,
                           "Payload type; fp8 instead times bf16 vs fp8 e4m3 dispatch (f32 and ue8m0 scales, rows "
                           "quantised on send) of the same bf16 rows, bytes and time in one run")
      ->check(CLI::IsMember({"bf16", "f32", "fp8"}))
      ->capture_default_str();
  exchange_cmd->add_option("--reps", bench.reps, "Timed repetitions of each method")
      ->transform(in_range(1, 10000))
      ->capture_default_str();
  exchange_cmd->add_option("--warmup", bench.warmup, "Untimed warm-up iterations (the first is checked)")
      ->transform(in_range(1, 100))
      ->capture_default_str();
  exchange_cmd->add_option("--skew", bench.skew, "Routing skew (0 = uniform random distinct experts)")
      ->transform(in_range(0.0, 16.0))
      ->capture_default_str();
  exchange_cmd->add_option("--seed", bench.seed, "Routing seed")
      ->transform(at_least(uint64_t{0}))
      ->capture_default_str();
  exchange_cmd->add_flag("--no-verify", bench.no_verify, "Skip the check of every method's output after the warm-up");
  exchange_cmd->add_option("--record-waits", bench.record_waits,
                           "on: epx's operations record who waited for whom (BufferConfig::record_waits, the "
                           "default); off: not, to measure what recording costs")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  exchange_cmd->add_option("--layer-combine", bench.layer_combine,
                           "on: also time the combine MoELayer runs (combine_expanded: f32 expert rows, weighted, "
                           "f32 partials, f32 out; the Buffer then keeps an f32 combine region) against memcpy of "
                           "its bytes; bf16: the same with bf16 partials (CombineOptions::partial_dtype); receiver: "
                           "weighted by the receiver (CombineOptions::weights_at), bf16 expert rows already in the "
                           "combine region, against memcpy of a bf16 combine's bytes (and of the expanded bf16 rows "
                           "it reads; flat shapes only, e.g. --nodes-shapes 1x8); off: not, which saves its memory")
      ->check(CLI::IsMember({"on", "bf16", "receiver", "off"}))
      ->capture_default_str();
  exchange_cmd->add_option("--memory-fraction", bench.memory_fraction,
                           "Share of available memory a shape may use; above it methods run one after the other")
      ->transform(in_range(0.05, 1.0))
      ->capture_default_str();
  exchange_cmd->add_flag("--phases", bench.phases, "Time the exchange's internal phases (tracer spans) and print them");
  exchange_cmd->add_option("--trace", bench.trace_path, "Write a Chrome trace of the timed repetitions to this file");
  exchange_cmd->add_flag("--json", bench.json, "Print exactly one JSON object on stdout (table and progress on stderr)");

  // epx bench lowlat
  epx::app::BenchLowLatOptions lowlat;
  CLI::App* lowlat_cmd = epx::app::add_bench_lowlat_command(bench_cmd, lowlat);

  // epx bench routing
  epx::app::BenchRoutingOptions routing;
  CLI::App* routing_cmd = bench_cmd->add_subcommand(
      "routing",
      "The router (sigmoid + bias + group-limited top-k, and softmax top-k; single-threaded) against the fp32 score "
      "GEMM that feeds it (OpenBLAS) and the machine's measured sgemm peak, plus expert placement and rebalance; "
      "medians of interleaved repetitions");
  routing_cmd->add_option("--tokens", routing.tokens, "Tokens")->transform(in_range(1, 1 << 20))->capture_default_str();
  routing_cmd->add_option("--experts", routing.num_experts, "Experts")
      ->transform(in_range(1, 65536))
      ->capture_default_str();
  routing_cmd->add_option("--topk", routing.topk, "Experts per token")->transform(in_range(1, 64))->capture_default_str();
  routing_cmd->add_option("--groups", routing.groups, "Expert groups (router and placement); must divide --experts")
      ->transform(in_range(1, 65536))
      ->capture_default_str();
  routing_cmd->add_option("--topk-groups", routing.topk_groups, "Groups a token may use (sigmoid router)")
      ->transform(in_range(1, 65536))
      ->capture_default_str();
  routing_cmd->add_option("--hidden", routing.hidden, "Hidden size (the GEMM's inner dimension)")
      ->transform(in_range(1, 1 << 20))
      ->capture_default_str();
  routing_cmd->add_option("--reps", routing.reps, "Timed repetitions of each method")
      ->transform(in_range(1, 10000))
      ->capture_default_str();
  routing_cmd->add_option("--peak-n", routing.peak_n, "Size of the square sgemm that measures the fp32 peak; 0 = skip")
      ->transform(in_range(0, 16384))
      ->capture_default_str();
  routing_cmd->add_option("--nodes", routing.nodes, "Placement: nodes")->transform(in_range(1, 4096))->capture_default_str();
  routing_cmd->add_option("--ranks-per-node", routing.ranks_per_node, "Placement: ranks per node")
      ->transform(in_range(1, 4096))
      ->capture_default_str();
  routing_cmd->add_option("--slots", routing.slots, "Placement: physical slots; >= experts and a multiple of the ranks")
      ->transform(in_range(1, 1 << 20))
      ->capture_default_str();
  routing_cmd->add_option("--seed", routing.seed, "Input seed")
      ->transform(at_least(uint64_t{0}))
      ->capture_default_str();
  routing_cmd->add_flag("--json", routing.json, "Print exactly one JSON object on stdout (table and progress on stderr)");

  // epx eplb
  epx::app::EplbOptions eplb;
  CLI::App* eplb_cmd = app.add_subcommand(
      "eplb",
      "A redundant-expert placement (EPLB-style) for measured per-expert loads: slot -> expert per rank, replica "
      "counts, balance (max/mean per rank) before and after, bytes moved. With --current FILE: rebalance that "
      "placement for the loads, moving as few expert weights as the balance allows");
  eplb_cmd->add_option("--loads", eplb.loads_path, "File of per-expert loads: one per line, or whitespace/comma separated")
      ->required();
  eplb_cmd->add_option("--slots", eplb.num_slots, "Physical expert slots; >= experts and a multiple of the ranks")
      ->required()
      ->transform(in_range(1, 1 << 20));
  eplb_cmd->add_option("--nodes", eplb.num_nodes, "Nodes")->required()->transform(in_range(1, 4096));
  eplb_cmd->add_option("--ranks-per-node", eplb.ranks_per_node, "Ranks per node")
      ->required()
      ->transform(in_range(1, 4096));
  eplb_cmd->add_option("--groups", eplb.num_groups, "Expert groups (must divide the experts); 0 = none")
      ->transform(in_range(0, 1 << 20))
      ->capture_default_str();
  eplb_cmd->add_option("--expert-bytes", eplb.expert_bytes, "Bytes of one expert's weights, for the moved bytes")
      ->transform(in_range(int64_t{0}, int64_t{1} << 50))
      ->capture_default_str();
  eplb_cmd->add_option("--policy", eplb.policy,
                       "hierarchical (groups packed onto nodes; needs --groups a multiple of --nodes, else global) "
                       "or global")
      ->check(CLI::IsMember({"hierarchical", "global"}))
      ->capture_default_str();
  eplb_cmd->add_option("--current", eplb.current_path,
                       "Rebalance mode: a file holding the current placement, the logical expert of every physical "
                       "slot in slot order (-1 = empty; whitespace, commas or newlines between ids; '#' starts a "
                       "comment), as --save writes it. Prints a new placement of near-equal balance that moves few "
                       "expert weights, the balance now / rebalanced / from scratch, and the bytes the rebalance "
                       "moves against placing from scratch");
  CLI::Option* current_opt = eplb_cmd->get_option("--current");
  eplb_cmd->add_option("--tolerance", eplb.tolerance,
                       "Rebalance mode: accept a balance up to (1 + this) x the from-scratch placement's")
      ->transform(in_range(0.0, 10.0))
      ->needs(current_opt)
      ->capture_default_str();
  eplb_cmd->add_option("--save", eplb.save_path,
                       "Write the printed placement (from scratch, or rebalanced with --current) to this file, one "
                       "line per rank; --current reads it back");
  eplb_cmd->add_flag("--json", eplb.json, "Print one JSON object instead of the text report");

  // epx train
  epx::app::TrainOptions train;
  CLI::App* train_cmd = epx::app::add_train_command(app, train);

  // epx sim
  epx::app::SimOptions sim;
  const epx::app::SimCommands sim_cmds = epx::app::add_sim_command(app, sim);

  // epx monitor
  epx::app::MonitorOptions monitor;
  CLI::App* monitor_cmd = epx::app::add_monitor_command(app, monitor);

  // epx supervise
  epx::app::SuperviseOptions supervise;
  CLI::App* supervise_cmd = epx::app::add_supervise_command(app, supervise);

  // epx report
  epx::app::ReportOptions report;
  CLI::App* report_cmd = epx::app::add_report_command(app, report);

  // A word where a command belongs that is not one: say so plainly.
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.empty() || arg[0] == '-') continue;
    if (arg != "demo" && arg != "bench" && arg != "eplb" && arg != "train" && arg != "sim" &&
        arg != "monitor" && arg != "report" && arg != "supervise") {
      fmt::print(stderr, "epx: '{}' is not a command; the commands are train, supervise, sim, monitor, report, demo, bench and eplb (see epx --help)\n",
                 epx::printable(arg));
      return kExitUsage;
    }
    // The config file is read before the flags, which override it.
    if (arg == "train" && epx::app::preload_train_config(argc, argv, train) != 0) return kExitUsage;
    break;
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version: on stdout
    // The error quotes the user's words: escaped, so raw bytes never reach the terminal.
    fmt::print(stderr, "{}\nRun with --help for more information.\n", epx::printable(e.what()));
    return kExitUsage;
  }

  auto logger = spdlog::stderr_color_mt("epx");
  logger->set_pattern("[%H:%M:%S.%e] %v");
  logger->set_level(quiet ? spdlog::level::warn : spdlog::level::info);
  spdlog::set_default_logger(logger);

  if (*demo_cmd) return epx::app::run_demo(demo);
  if (*exchange_cmd) return epx::app::run_bench_exchange(bench);
  if (*routing_cmd) return epx::app::run_bench_routing(routing);
  if (*lowlat_cmd) return epx::app::run_bench_lowlat(lowlat);
  if (*eplb_cmd) return epx::app::run_eplb(eplb);
  if (*report_cmd) return epx::app::run_report(report);
  if (*train_cmd) {
    train.compare_given = train_cmd->get_option("--compare-balancing")->count() > 0;
    train.quiet = quiet;
    return epx::app::run_train(train);
  }
  if (app.got_subcommand("sim")) {
    sim.quiet = quiet;
    return epx::app::run_sim(sim_cmds, sim);
  }
  if (*monitor_cmd) return epx::app::run_monitor(monitor);
  if (*supervise_cmd) return epx::app::run_supervise(supervise);
  fmt::print(stderr, "epx: no command given; see epx --help\n");
  return kExitUsage;
}

}  // namespace
