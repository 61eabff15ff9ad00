// `epx supervise -- COMMAND...`: runs a training command (epx train, or a
// launcher running it: mpirun, srun) and restarts it from its latest
// checkpoint when it fails, within a restart budget; a command that stops
// making steps is stopped and restarted the same way. Every start, exit and
// restart is a JSON line in the events file (docs/operations.md, Supervised
// runs). With --hosts it starts the ranks itself (supervise_ranks.h).
#pragma once

#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace epx::app {

struct SuperviseOptions {
  std::vector<std::string> command;  // after `--`
  int max_restarts = 3;              // within restart_window_s
  double restart_window_s = 3600;
  double stall_s = 0;     // > 0: stop the command when its --metrics file has not grown for this long
  double grace_s = 30;    // SIGTERM to the command's process group, then SIGKILL after this
  std::string events_path;  // JSON Lines; empty: none
  // --hosts: the supervisor starts the ranks itself (the command is then
  // `epx train ...` alone) and knows each rank's host.
  std::string hosts, spare_hosts;        // "a:2,b:2"
  std::string launcher = "mpirun";       // mpirun or srun
  std::vector<std::string> launcher_args;
  int exclude_after = 2;                 // failures of a host before it is left out
  std::string rank_agent_dir;            // internal: run the command as one rank's agent
};

CLI::App* add_supervise_command(CLI::App& app, SuperviseOptions& options);
// 0 the command finished, 75 it was preempted (saved; for a requeue), 1 the
// budget is spent or the command cannot be restarted, 2 bad options.
int run_supervise(const SuperviseOptions& options);

}  // namespace epx::app
