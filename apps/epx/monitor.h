// `epx monitor`: watch a run's metrics (JSON Lines of `epx train --metrics`),
// live or afterwards: a terminal view refreshed in place, or one plain line
// per update for logs; alert rules (alerts.h) with one line per alert on
// stderr; the Prometheus textfile for node_exporter; --once for cron and CI.
#pragma once

#include <string>

#include <CLI/CLI.hpp>

namespace epx::app {

struct MonitorOptions {
  std::string metrics_path;
  bool follow = false;
  bool plain = false;
  bool once = false;
  bool check = false;  // --check: the rules and the --prometheus location only; no metrics read
  std::string alerts_path;
  std::string prometheus_path;
  double interval = 1.0;  // seconds between refreshes (view, plain line, Prometheus file)
  int window = 20;        // steps of the straggler diagnosis in the view
  double idle_exit = 0;   // --follow: stop after this many seconds without a new line; 0 = never
  int hot_experts = 4;    // per layer, in the view and the Prometheus file
  std::string events_path;  // epx supervise --events: restarts and lost steps under the view
};

// Adds `monitor` bound to `options`.
CLI::App* add_monitor_command(CLI::App& app, MonitorOptions& options);
// 0 done (--once: no rule fired), 1 a rule fired under --once or the file is
// malformed, 2 bad options, a bad rule file or no metrics file (without --follow).
int run_monitor(const MonitorOptions& options);

}  // namespace epx::app
