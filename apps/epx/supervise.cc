// `epx supervise`: restarts a training command from its latest checkpoint.
#include "supervise.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <fstream>
#include <optional>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli_checks.h"
#include "commands.h"
#include "epx/core/clock.h"
#include "epx/core/status.h"
#include "machine.h"
#include "supervise_ranks.h"

namespace epx::app {
namespace {

using SteadyClock = std::chrono::steady_clock;
constexpr auto kPoll = std::chrono::milliseconds(100);

// What the supervisor needs to know of the command: where it saves and
// writes its metrics, and where its --resume value is (to point it at the
// latest checkpoint on a restart).
struct Plan {
  std::vector<std::string> command;
  std::string save_dir, metrics_path;
  std::optional<HostPool> pool;  // --hosts: the ranks' hosts
  std::string agent_root;        // --hosts: the rank agents' reports, a folder per attempt
};

// The value of `flag` in `args` (`--flag VALUE` or `--flag=VALUE`), or empty.
std::string value_of(const std::vector<std::string>& args, const std::string& flag) {
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (args[i] == flag && i + 1 < args.size()) return args[i + 1];
    if (args[i].rfind(flag + "=", 0) == 0) return args[i].substr(flag.size() + 1);
  }
  return "";
}

// `args` with --resume pointed at `dir` (replaced where given, else appended).
std::vector<std::string> with_resume(std::vector<std::string> args, const std::string& dir) {
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--resume" && i + 1 < args.size()) {
      args[i + 1] = dir;
      return args;
    }
    if (args[i].rfind("--resume=", 0) == 0) {
      args[i] = "--resume=" + dir;
      return args;
    }
  }
  args.push_back("--resume");
  args.push_back(dir);
  return args;
}

// The step of the checkpoint DIR/latest names, or -1.
int64_t latest_step(const std::string& dir) {
  std::ifstream in(dir + "/latest");
  std::string name;
  if (!(in >> name) || name.rfind("step-", 0) != 0) return -1;
  return std::strtoll(name.c_str() + 5, nullptr, 10);
}

// The step of the last whole line of the metrics file, or -1.
int64_t last_metrics_step(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in || path.empty()) return -1;
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  const std::streamoff from = std::max<std::streamoff>(0, size - (std::streamoff{1} << 20));
  in.seekg(from);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::size_t end = text.rfind('\n');
  if (end == std::string::npos || end == 0) return -1;
  const std::size_t before = text.rfind('\n', end - 1);
  const std::size_t start = before == std::string::npos ? 0 : before + 1;
  const std::string line = text.substr(start, end - start);
  const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
  return j.is_object() && j.contains("step") && j["step"].is_number_integer() ? j["step"].get<int64_t>() : -1;
}

int64_t file_size(const std::string& path) {
  struct stat st {};
  return !path.empty() && ::stat(path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
}

// The events file: one JSON object per line, flushed at once.
class Events {
 public:
  explicit Events(const std::string& path) : wanted_(!path.empty()) {
    if (wanted_) out_.open(path, std::ios::app);
  }
  [[nodiscard]] bool ok() const { return !wanted_ || (out_.is_open() && out_.good()); }
  void write(nlohmann::json event) {
    event["time"] = utc_now();
    fmt::print(stderr, "epx supervise: {}\n", event.dump());
    if (out_.is_open()) out_ << event.dump() << '\n' << std::flush;
  }

 private:
  bool wanted_ = false;
  std::ofstream out_;
};

// Signals to the supervisor: passed on to the command (SIGTERM, SIGUSR1: a
// preemption it saves for), and no restart after.
std::atomic<int> g_signal{0};
extern "C" void on_supervisor_signal(int s) { g_signal.store(s); }

void catch_signals() {
  struct sigaction sa {};
  sa.sa_handler = on_supervisor_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int s : {SIGTERM, SIGUSR1, SIGINT}) sigaction(s, &sa, nullptr);
  ::signal(SIGCHLD, SIG_DFL);  // an inherited SIG_IGN would leave no exit status to wait for
}

// Starts `args` in a process group of its own; the pid, or -1 (errno set).
pid_t start(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, 0);
    // The supervisor killed: so is its run (a run left behind would hold the
    // --save lock against the supervisor started next; the checkpoints stay).
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) std::_Exit(137);
    ::execvp(argv[0], argv.data());
    std::fprintf(stderr, "epx supervise: cannot run %s: %s\n", argv[0], std::strerror(errno));
    std::_Exit(127);
  }
  if (pid > 0) ::setpgid(pid, pid);
  return pid;
}

// How one run of the command ended.
struct Ended {
  int exit_code = -1;      // when it exited
  int signal = 0;          // when a signal ended it
  bool stalled = false;    // the supervisor stopped it: no new step for stall_s
  int forwarded = 0;       // a signal the supervisor passed on to it
  std::optional<RankEnd> failed;  // --hosts: the rank whose end ended the run
  SteadyClock::time_point noticed;  // when the supervisor saw the end (or the stall, or the failed rank)
};

// Restart time: from the failure the supervisor noticed to the restarted
// run's first step (an event "resumed").
struct Restarting {
  int attempt = 0;
  std::optional<SteadyClock::time_point> failed_at;  // none: the first run
};

// SIGTERM to the command's process group, SIGKILL after `grace_s`.
void stop_group(pid_t pid, double grace_s, int* status) {
  ::killpg(pid, SIGTERM);
  const auto deadline = SteadyClock::now() + std::chrono::duration<double>(grace_s);
  while (SteadyClock::now() < deadline) {
    if (::waitpid(pid, status, WNOHANG) == pid) return;
    std::this_thread::sleep_for(kPoll);
  }
  ::killpg(pid, SIGKILL);
  ::waitpid(pid, status, 0);
}

// What the command left running in its process group (ranks of a launcher
// that died) is killed before a restart, so no old rank holds the --save
// folder's lock or writes into it. Bounded: 10 s.
void end_group(pid_t pid) {
  ::killpg(pid, SIGKILL);
  for (int i = 0; i < 100 && ::killpg(pid, 0) == 0; ++i) std::this_thread::sleep_for(kPoll);
}

// Waits for the command; passes the supervisor's signals on; stops it when
// its metrics file has not grown for stall_s.
Ended wait_for(pid_t pid, const Plan& plan, const std::string& agent_dir, const Restarting& restarting,
               const SuperviseOptions& o, Events& events) {
  Ended ended;
  int status = 0;
  int64_t size = file_size(plan.metrics_path);
  auto last_growth = SteadyClock::now();
  bool grown = false;  // the watch starts at the first new step: start-up and loading take their time
  for (;;) {
    const pid_t got = ::waitpid(pid, &status, WNOHANG);
    ended.noticed = SteadyClock::now();
    if (got == pid) break;
    if (got < 0 && errno != EINTR) {  // the command is not ours to wait for: count it as failed
      ended.signal = SIGKILL;
      stop_group(pid, 0, &status);
      return ended;
    }
    if (const int s = g_signal.exchange(0); s != 0) {
      // As SIGUSR1, which epx train saves for like SIGTERM and which mpirun
      // passes on to its ranks (it answers SIGTERM by killing them).
      ::kill(pid, SIGUSR1);
      ended.forwarded = s;
    }
    if (const int64_t now_size = file_size(plan.metrics_path); now_size != size) {
      if (now_size > size) {  // a new step; a file cut back at a resume is no step
        last_growth = SteadyClock::now();
        if (!grown && restarting.failed_at)
          events.write({{"event", "resumed"}, {"attempt", restarting.attempt},
                        {"step", last_metrics_step(plan.metrics_path)},
                        {"restart_seconds", std::chrono::duration<double>(last_growth - *restarting.failed_at).count()}});
        grown = true;
      }
      size = now_size;
    }
    if (o.stall_s > 0 && grown && SteadyClock::now() - last_growth > std::chrono::duration<double>(o.stall_s)) {
      ended.noticed = SteadyClock::now();
      ended.stalled = true;
      stop_group(pid, o.grace_s, &status);
      break;
    }
    if (!agent_dir.empty() && (ended.failed = first_failure(read_rank_ends(agent_dir)))) {
      ended.noticed = SteadyClock::now();
      stop_group(pid, o.grace_s, &status);  // the rest of the ranks, at once
      break;
    }
    std::this_thread::sleep_for(kPoll);
  }
  if (WIFEXITED(status)) ended.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) ended.signal = WTERMSIG(status);
  end_group(pid);
  if (!agent_dir.empty() && !(ended.failed && ended.failed->state == "stopped")) {
    // Every report is in now: the one seen first may be a rank that only
    // followed the failed one (a peer gone: exit 1).
    std::vector<RankEnd> ends = read_rank_ends(agent_dir);
    if (ended.failed) ends.push_back(*ended.failed);
    ended.failed = first_failure(ends);
  }
  return ended;
}

nlohmann::json exit_event(const Ended& e, int attempt, const Plan& plan, double seconds) {
  const int64_t last = last_metrics_step(plan.metrics_path), saved = latest_step(plan.save_dir);
  nlohmann::json j{{"event", "exit"}, {"attempt", attempt}, {"seconds", seconds}, {"last_step", last},
                   {"checkpoint_step", saved}};
  if (e.exit_code != 0) j["lost_steps"] = std::max<int64_t>(0, last + 1 - std::max<int64_t>(0, saved));  // steps count from 0
  if (e.exit_code >= 0) j["exit_code"] = e.exit_code;
  if (e.signal != 0) j["signal"] = strsignal(e.signal);
  if (e.stalled) j["cause"] = "stalled: no new step in the metrics file";
  return j;
}

// Restarts within the window so far; false (and why) once the budget is spent.
bool budget_left(std::deque<SteadyClock::time_point>* restarts, const SuperviseOptions& o) {
  const auto window = std::chrono::duration<double>(o.restart_window_s);
  while (!restarts->empty() && SteadyClock::now() - restarts->front() > window) restarts->pop_front();
  return static_cast<int>(restarts->size()) < o.max_restarts;
}

Result<Plan> make_plan(const SuperviseOptions& o) {
  Plan plan{o.command, value_of(o.command, "--save"), value_of(o.command, "--metrics"), std::nullopt, ""};
  if (plan.command.empty()) return invalid_argument("no command to supervise: epx supervise [OPTIONS] -- COMMAND...");
  if (plan.save_dir.empty())
    return invalid_argument("the command names no save folder (epx train --save DIR): a restart could only "
                            "start from step 0");
  if (o.stall_s > 0 && plan.metrics_path.empty())
    return invalid_argument("--stall-seconds {} watches the command's --metrics file, but the command has none",
                            o.stall_s);
  if (o.hosts.empty()) {
    if (!o.spare_hosts.empty() || !o.launcher_args.empty())
      return invalid_argument("--spare-hosts and --launcher-arg need --hosts (the supervisor starts the ranks)");
    return plan;
  }
  auto hosts = parse_hosts(o.hosts, "--hosts");
  if (!hosts.is_ok()) return hosts.status();
  std::vector<HostSlots> spares;
  if (!o.spare_hosts.empty()) {
    auto parsed = parse_hosts(o.spare_hosts, "--spare-hosts");
    if (!parsed.is_ok()) return parsed.status();
    spares = *parsed;
  }
  if (o.launcher == "srun")
    for (const HostSlots& h : *hosts)
      if (h.slots != hosts->front().slots)
        return invalid_argument("--launcher srun --hosts {}: srun places the same ranks on every host; give every "
                                "host the same slots", o.hosts);
  if (const std::string& c = plan.command.front(); c == "mpirun" || c == "mpiexec" || c == "srun")
    return invalid_argument("with --hosts the supervisor starts the ranks ({} is built for you): the command is "
                            "epx train ... alone", c);
  plan.pool.emplace(*hosts, spares, o.exclude_after);
  plan.agent_root = plan.save_dir + ".ranks";
  return plan;
}

std::optional<int> restart_if_budget(const Plan& plan, std::deque<SteadyClock::time_point>* restarts,
                                     const SuperviseOptions& o, Events& events);

// The decision after one run: an exit code for the supervisor, or nullopt to restart.
std::optional<int> after_run(const Ended& e, const Plan& plan, std::deque<SteadyClock::time_point>* restarts,
                             const SuperviseOptions& o, Events& events) {
  const bool asked_to_stop = e.forwarded != 0 || g_signal.load() != 0;
  if (e.exit_code == 0) return kExitOk;
  if (e.stalled && !asked_to_stop) return restart_if_budget(plan, restarts, o, events);  // its 75 is ours
  if (e.exit_code == kExitPreempted) return kExitPreempted;  // saved: the scheduler requeues
  if (asked_to_stop)  // no restart: the scheduler's requeue resumes from the checkpoint there is
    return latest_step(plan.save_dir) >= 0 ? kExitPreempted : kExitFailed;
  if (e.exit_code == kExitUsage || e.exit_code == 127) {
    nlohmann::json event{{"event", "gave_up"}, {"cause", "the command's settings were refused; a restart would be too"}};
    if (plan.pool) {
      event["hosts"] = format_hosts(plan.pool->hosts());
      fmt::print(stderr, "epx supervise: the ranks of --hosts {} ({} ranks) cannot run this training (its message "
                 "above): giving up; the checkpoints are in {}\n", format_hosts(plan.pool->hosts()),
                 total_slots(plan.pool->hosts()), plan.save_dir);
    }
    events.write(event);
    return kExitFailed;
  }
  return restart_if_budget(plan, restarts, o, events);
}

// --hosts: the failed rank's event; its host counted, and left out at
// --exclude-after failures. false when no host is left to run on.
bool record_rank_failure(const Ended& e, int attempt, Plan& plan, const SuperviseOptions& o, Events& events) {
  if (!e.failed) return true;
  const std::string host = plan.pool->host_of(e.failed->rank);
  events.write({{"event", "rank_failed"}, {"attempt", attempt}, {"rank", e.failed->rank}, {"host", host},
                {"hostname", e.failed->hostname}, {"step", last_metrics_step(plan.metrics_path) + 1},
                {"cause", describe_cause(*e.failed)}});
  if (std::optional<nlohmann::json> excluded = plan.pool->count_failure(host)) {
    events.write(*excluded);
    if (plan.pool->hosts().empty()) {
      events.write({{"event", "gave_up"}, {"cause", "every host is excluded"}});
      fmt::print(stderr, "epx supervise: every host is excluded (--exclude-after {}): giving up; the checkpoints are "
                 "in {}\n", o.exclude_after, plan.save_dir);
      return false;
    }
  }
  return true;
}

// nullopt (restart) while the budget lasts; else exit 1, saying so.
std::optional<int> restart_if_budget(const Plan& plan, std::deque<SteadyClock::time_point>* restarts,
                                     const SuperviseOptions& o, Events& events) {
  if (latest_step(plan.save_dir) < 0)
    fmt::print(stderr, "epx supervise: no checkpoint in {} yet: the restart starts as the first run did\n",
               plan.save_dir);
  if (!budget_left(restarts, o)) {
    events.write({{"event", "gave_up"}, {"restarts", restarts->size()}, {"window_s", o.restart_window_s},
                  {"checkpoint_step", latest_step(plan.save_dir)}});
    fmt::print(stderr, "epx supervise: {} restarts within {} s (--max-restarts {}): giving up; its checkpoints are "
               "in {} (epx train --resume)\n", restarts->size(), o.restart_window_s, o.max_restarts, plan.save_dir);
    return kExitFailed;
  }
  restarts->push_back(SteadyClock::now());
  return std::nullopt;
}


// This program's path, for the rank agents the launcher starts.
std::string own_path() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string("epx");
}

// A fresh folder for one attempt's rank reports (stale reports removed).
Result<std::string> agent_folder(const Plan& plan, int attempt) {
  const std::string dir = fmt::format("{}/attempt-{}", plan.agent_root, attempt);
  for (const std::string& d : {plan.agent_root, dir})
    if (::mkdir(d.c_str(), 0755) != 0 && errno != EEXIST)
      return failed_precondition("cannot make the rank reports' folder {}: {}", d, std::strerror(errno));
  for (const RankEnd& e : read_rank_ends(dir)) ::unlink(fmt::format("{}/rank-{}.json", dir, e.rank).c_str());
  return dir;
}

// The command line of one attempt, and the folder of its rank reports
// (--hosts), or why not.
Result<std::vector<std::string>> attempt_line(const Plan& plan, int attempt, const SuperviseOptions& o,
                                              std::string* agent_dir) {
  // A restart resumes from the save folder; so does a first run whose folder
  // has a checkpoint and whose command names no --resume (a supervisor started
  // again after its own end).
  const bool resume = latest_step(plan.save_dir) >= 0 &&
                      (attempt > 0 || (value_of(plan.command, "--resume").empty()));
  std::vector<std::string> train = resume ? with_resume(plan.command, plan.save_dir) : plan.command;
  if (!plan.pool) return train;
  auto dir = agent_folder(plan, attempt);
  if (!dir.is_ok()) return dir.status();
  *agent_dir = *dir;
  return launch_line(o.launcher, plan.pool->hosts(), o.launcher_args, own_path(), *dir, train);
}

}  // namespace

CLI::App* add_supervise_command(CLI::App& app, SuperviseOptions& o) {
  CLI::App* cmd = app.add_subcommand(
      "supervise",
      "Run a training command (epx train, or mpirun/srun running it) and restart it from its latest checkpoint "
      "(--resume of its --save folder) when it fails or stops making steps, within a restart budget; a preempted "
      "run (exit 75) is passed on for the scheduler's requeue (docs/operations.md)");
  cmd->add_option("command", o.command, "The command, after --: e.g. -- epx train --config c.toml --save ck")
      ->required();
  cmd->add_option("--max-restarts", o.max_restarts, "Restarts allowed within --restart-window; then give up (exit 1)")
      ->transform(in_range(0, 1000000))
      ->capture_default_str();
  cmd->add_option("--restart-window", o.restart_window_s, "Seconds over which restarts are counted")
      ->transform(in_range(1.0, 1e9))
      ->capture_default_str();
  cmd->add_option("--stall-seconds", o.stall_s,
                  "Stop and restart the command when its --metrics file has not grown for this long since its last "
                  "step (counted from the first step it writes; 0 = off; epx train --timeout already ends a run "
                  "whose rank stopped answering)")
      ->transform(in_range(0.0, 1e9))
      ->capture_default_str();
  cmd->add_option("--grace", o.grace_s, "Seconds between SIGTERM and SIGKILL when stopping a stalled command")
      ->transform(in_range(0.0, 3600.0))
      ->capture_default_str();
  cmd->add_option("--events", o.events_path,
                  "Append each start, exit, failed rank, excluded host and give-up as a JSON line here");
  cmd->add_option("--hosts", o.hosts,
                  "Start the ranks here (HOST:SLOTS,...; one rank per slot, the first host's first) with --launcher, "
                  "each under an agent that records how it ended, so a failure names its rank and host; the "
                  "command is then epx train ... alone (its --ranks is set to the slots)");
  cmd->add_option("--spare-hosts", o.spare_hosts, "With --hosts: hosts (HOST:SLOTS,...) that replace excluded ones, in order");
  cmd->add_option("--exclude-after", o.exclude_after,
                  "With --hosts: failures of a host after which the run goes on without it (or on a spare host)")
      ->transform(in_range(1, 1000000))
      ->capture_default_str();
  cmd->add_option("--launcher", o.launcher, "With --hosts: mpirun or srun")
      ->check(CLI::IsMember({"mpirun", "srun"}))
      ->capture_default_str();
  cmd->add_option("--launcher-arg", o.launcher_args,
                  "With --hosts: one more argument for the launcher, before the command (repeatable; e.g. "
                  "--launcher-arg=--mca --launcher-arg=btl --launcher-arg=self,tcp)")
      ->allow_extra_args(false);
  cmd->add_option("--rank-agent", o.rank_agent_dir, "Internal: run the command as one rank's agent, reporting here")
      ->group("");
  return cmd;
}

int run_supervise(const SuperviseOptions& o) {
  if (!o.rank_agent_dir.empty()) return run_rank_agent(o.rank_agent_dir, o.command);
  Result<Plan> plan = make_plan(o);
  if (!plan.is_ok()) {
    fmt::print(stderr, "epx supervise: {}\n", plan.status().message());
    return kExitUsage;
  }
  Events events(o.events_path);
  if (!events.ok()) {
    fmt::print(stderr, "epx supervise: cannot open --events {}: {}\n", o.events_path, std::strerror(errno));
    return kExitUsage;
  }
  catch_signals();
  std::deque<SteadyClock::time_point> restarts;
  Restarting restarting;
  for (int attempt = 0;; ++attempt) {
    std::string agent_dir;
    const Result<std::vector<std::string>> line = attempt_line(*plan, attempt, o, &agent_dir);
    if (!line.is_ok()) {
      fmt::print(stderr, "epx supervise: {}\n", line.status().message());
      return kExitFailed;
    }
    const std::vector<std::string>& args = *line;
    nlohmann::json start_event{{"event", "start"}, {"attempt", attempt}, {"command", args}};
    if (plan->pool) {
      start_event["hosts"] = format_hosts(plan->pool->hosts());
      start_event["ranks"] = total_slots(plan->pool->hosts());
    }
    if (attempt > 0) start_event["checkpoint_step"] = latest_step(plan->save_dir);
    events.write(start_event);
    Stopwatch watch;
    const pid_t pid = start(args);
    if (pid < 0) {
      fmt::print(stderr, "epx supervise: cannot start {}: {}\n", args[0], std::strerror(errno));
      return kExitFailed;
    }
    restarting.attempt = attempt;
    const Ended ended = wait_for(pid, *plan, agent_dir, restarting, o, events);
    restarting.failed_at = ended.noticed;
    events.write(exit_event(ended, attempt, *plan, watch.seconds()));
    if (plan->pool && !record_rank_failure(ended, attempt, *plan, o, events)) return kExitFailed;
    if (std::optional<int> code = after_run(ended, *plan, &restarts, o, events)) return *code;
  }
}

}  // namespace epx::app
