// The table of `epx` commands, and the small adapters that give each
// command's options a home for the life of the process.
#include "commands.h"

#include <memory>

#include <fmt/format.h>

#include "bench_lowlat.h"
#include "monitor.h"
#include "report.h"
#include "sim.h"
#include "supervise.h"
#include "train.h"

namespace epx::app {

namespace {

// A command whose options need nothing from the global ones: add it with
// `add_flags`, run it with `run`.
template <typename Options>
AddedCommand plain_command(CLI::App& app, CLI::App* (*add_flags)(CLI::App&, Options&),
                           int (*run)(const Options&)) {
  auto options = std::make_shared<Options>();
  return {add_flags(app, *options), [options, run](const GlobalOptions&) { return run(*options); }, nullptr};
}

AddedCommand add_train(CLI::App& app) {
  auto options = std::make_shared<TrainOptions>();
  CLI::App* node = add_train_command(app, *options);
  auto run = [options, node](const GlobalOptions& global) {
    options->compare_given = node->get_option("--compare-balancing")->count() > 0;
    options->quiet = global.quiet;
    return run_train(*options);
  };
  auto preload = [options](int argc, char** argv) { return preload_train_config(argc, argv, *options); };
  return {node, run, preload};
}

AddedCommand add_supervise(CLI::App& app) { return plain_command(app, add_supervise_command, run_supervise); }

AddedCommand add_sim(CLI::App& app) {
  auto options = std::make_shared<SimOptions>();
  const SimCommands nodes = add_sim_command(app, *options);
  auto run = [options, nodes](const GlobalOptions& global) {
    options->quiet = global.quiet;
    return run_sim(nodes, *options);
  };
  return {nodes.sim, run, nullptr};
}

AddedCommand add_monitor(CLI::App& app) { return plain_command(app, add_monitor_command, run_monitor); }
AddedCommand add_report(CLI::App& app) { return plain_command(app, add_report_command, run_report); }
AddedCommand add_demo(CLI::App& app) { return plain_command(app, add_demo_command, run_demo); }
AddedCommand add_eplb(CLI::App& app) { return plain_command(app, add_eplb_command, run_eplb); }

// `epx bench exchange | routing | lowlat`.
AddedCommand add_bench(CLI::App& app) {
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks");
  bench->require_subcommand(1);
  const AddedCommand exchange = plain_command(*bench, add_bench_exchange_command, run_bench_exchange);
  const AddedCommand routing = plain_command(*bench, add_bench_routing_command, run_bench_routing);
  const AddedCommand lowlat = plain_command(*bench, add_bench_lowlat_command, run_bench_lowlat);
  auto run = [exchange, routing, lowlat](const GlobalOptions& global) {
    for (const AddedCommand& c : {exchange, routing, lowlat})
      if (*c.node) return c.run(global);
    return kExitUsage;  // CLI11 requires one of them: not reached
  };
  return {bench, run, nullptr};
}

constexpr Command kCommands[] = {
    {"train", add_train}, {"supervise", add_supervise}, {"sim", add_sim},   {"monitor", add_monitor},
    {"report", add_report}, {"demo", add_demo},         {"bench", add_bench}, {"eplb", add_eplb},
};

}  // namespace

std::span<const Command> commands() { return kCommands; }

std::string command_names() {
  std::string names;
  const std::size_t n = std::size(kCommands);
  for (std::size_t i = 0; i < n; ++i)
    names += fmt::format("{}{}", i == 0 ? "" : (i + 1 == n ? " and " : ", "), kCommands[i].name);
  return names;
}

}  // namespace epx::app
