// `epx supervise --hosts`: rank agents, their reports, the host pool and the
// launcher's command line.
#include "supervise_ranks.h"

#include <dirent.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <thread>

#include <fmt/format.h>

#include "commands.h"

namespace epx::app {

Result<std::vector<HostSlots>> parse_hosts(const std::string& text, const std::string& option) {
  std::vector<HostSlots> hosts;
  std::size_t from = 0;
  while (from <= text.size()) {
    const std::size_t comma = std::min(text.find(',', from), text.size());
    const std::string entry = text.substr(from, comma - from);
    from = comma + 1;
    const std::size_t colon = entry.rfind(':');
    HostSlots h{entry.substr(0, colon), 1};
    if (colon != std::string::npos) {
      const std::string n = entry.substr(colon + 1);
      char* end = nullptr;
      const long slots = std::strtol(n.c_str(), &end, 10);
      if (n.empty() || *end != '\0' || slots < 1 || slots > 4096)
        return invalid_argument("{} {}: '{}' needs HOST:SLOTS with SLOTS in [1, 4096]", option, text, entry);
      h.slots = static_cast<int>(slots);
    }
    if (h.name.empty()) return invalid_argument("{} {}: an empty host name (expected e.g. a:2,b:2)", option, text);
    for (const HostSlots& g : hosts)
      if (g.name == h.name) return invalid_argument("{} {}: host {} is named twice", option, text, h.name);
    hosts.push_back(h);
  }
  return hosts;
}

std::string format_hosts(const std::vector<HostSlots>& hosts) {
  std::string s;
  for (const HostSlots& h : hosts) s += fmt::format("{}{}:{}", s.empty() ? "" : ",", h.name, h.slots);
  return s;
}

int total_slots(const std::vector<HostSlots>& hosts) {
  int n = 0;
  for (const HostSlots& h : hosts) n += h.slots;
  return n;
}

// ---- rank reports -----------------------------------------------------------

std::vector<RankEnd> read_rank_ends(const std::string& dir) {
  std::vector<RankEnd> ends;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return ends;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.rfind("rank-", 0) != 0 || name.size() < 6 || name.substr(name.size() - 5) != ".json") continue;
    std::ifstream in(dir + "/" + name);
    const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) continue;  // written by rename: whole or absent; anything else is not ours
    RankEnd r;
    r.rank = j.value("rank", -1);
    r.hostname = j.value("hostname", "");
    r.state = j.value("state", "");
    r.exit_code = j.value("exit_code", -1);
    r.signal = j.value("signal", 0);
    r.stop_requested = j.value("stop_requested", false);
    r.time = j.value("time", 0.0);
    ends.push_back(r);
  }
  ::closedir(d);
  std::sort(ends.begin(), ends.end(), [](const RankEnd& a, const RankEnd& b) { return a.rank < b.rank; });
  return ends;
}

int failure_rank(const RankEnd& e) {
  if (e.state == "stopped") return 3;
  if (e.stop_requested) return 0;
  if (e.state == "killed") return 2;
  // Exit 2 (settings refused) and 127 (not found) are the command's, not a host's.
  const bool failed = e.state == "exited" && e.exit_code != 0 && e.exit_code != kExitUsage && e.exit_code != 127 &&
                      e.exit_code != kExitPreempted;
  return failed ? 1 : 0;
}

std::optional<RankEnd> first_failure(const std::vector<RankEnd>& ends) {
  std::optional<RankEnd> first;
  for (const RankEnd& e : ends) {
    const int r = failure_rank(e);
    if (r > 0 && (!first || r > failure_rank(*first) || (r == failure_rank(*first) && e.time < first->time)))
      first = e;
  }
  return first;
}

std::string describe_cause(const RankEnd& e) {
  if (e.state == "stopped") return fmt::format("stopped by {}: no steps", strsignal(e.signal));
  if (e.state == "killed") return fmt::format("killed by {}", strsignal(e.signal));
  return fmt::format("exited with {}", e.exit_code);
}

// ---- the rank agent -----------------------------------------------------------

namespace {

std::atomic<int> g_agent_signal{0};
extern "C" void on_agent_signal(int s) { g_agent_signal.store(s); }

int rank_from_environment() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"})
    if (const char* v = std::getenv(name); v != nullptr && *v != '\0') return std::atoi(v);
  return -1;
}

double epoch_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// DIR/rank-R.json, replaced whole (a temporary file renamed over it).
void write_report(const std::string& dir, const nlohmann::json& report) {
  const std::string path = fmt::format("{}/rank-{}.json", dir, report["rank"].get<int>());
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << report.dump() << '\n';
    if (!out.flush()) return;  // a report that cannot be written leaves the rank unnamed, no more
  }
  ::rename(tmp.c_str(), path.c_str());
}

pid_t start_rank(const std::vector<std::string>& command) {
  std::vector<char*> argv;
  for (const std::string& a : command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // the agent killed (a launcher's teardown): so is its rank
    if (::getppid() != parent) std::_Exit(137);
    ::execvp(argv[0], argv.data());
    std::fprintf(stderr, "epx supervise: cannot run %s: %s\n", argv[0], std::strerror(errno));
    std::_Exit(127);
  }
  return pid;
}

}  // namespace

int run_rank_agent(const std::string& dir, const std::vector<std::string>& command) {
  const int rank = rank_from_environment();
  if (rank < 0) {
    fmt::print(stderr, "epx supervise --rank-agent: no rank in the environment (OMPI_COMM_WORLD_RANK, PMIX_RANK, "
                       "PMI_RANK, SLURM_PROCID): it runs under mpirun or srun\n");
    return kExitUsage;
  }
  if (command.empty()) return kExitUsage;
  struct sigaction sa {};
  sa.sa_handler = on_agent_signal;
  sigemptyset(&sa.sa_mask);
  for (int s : {SIGTERM, SIGUSR1, SIGINT}) sigaction(s, &sa, nullptr);
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  nlohmann::json report{{"rank", rank}, {"hostname", host}, {"state", "running"}, {"time", epoch_seconds()}};
  const pid_t pid = start_rank(command);
  if (pid < 0) return kExitFailed;
  report["pid"] = pid;
  write_report(dir, report);
  int status = 0;
  for (;;) {
    // The rank's end first: a signal that comes after it (the launcher's
    // teardown) does not make a death of its own a requested one.
    const pid_t got = ::waitpid(pid, &status, WNOHANG | WUNTRACED | WCONTINUED);
    if (got < 0 && errno != EINTR) return kExitFailed;
    if (got == pid && (WIFEXITED(status) || WIFSIGNALED(status))) break;
    if (const int s = g_agent_signal.exchange(0); s != 0) {
      ::kill(pid, s);
      report["stop_requested"] = true;
      report["time"] = epoch_seconds();
      write_report(dir, report);
    }
    if (got == pid && (WIFSTOPPED(status) || WIFCONTINUED(status))) {
      report["state"] = WIFSTOPPED(status) ? "stopped" : "running";
      report["signal"] = WIFSTOPPED(status) ? WSTOPSIG(status) : 0;
      report["time"] = epoch_seconds();
      write_report(dir, report);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  report["time"] = epoch_seconds();
  if (WIFEXITED(status)) {
    report["state"] = "exited";
    report["exit_code"] = WEXITSTATUS(status);
  } else {
    report["state"] = "killed";
    report["signal"] = WTERMSIG(status);
  }
  write_report(dir, report);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// ---- hosts and the launcher -------------------------------------------------

std::string HostPool::host_of(int rank) const {
  for (const HostSlots& h : hosts_) {
    if (rank < h.slots) return h.name;
    rank -= h.slots;
  }
  return "";
}

std::optional<nlohmann::json> HostPool::count_failure(const std::string& host) {
  const int n = ++failures_[host];
  if (n < exclude_after_) return std::nullopt;
  auto it = std::find_if(hosts_.begin(), hosts_.end(), [&](const HostSlots& h) { return h.name == host; });
  if (it == hosts_.end()) return std::nullopt;
  nlohmann::json event{{"event", "excluded"}, {"host", host}, {"failures", n}};
  if (!spares_.empty()) {
    event["replaced_by"] = spares_.front().name;
    *it = spares_.front();
    spares_.erase(spares_.begin());
  } else {
    hosts_.erase(it);
  }
  event["hosts"] = format_hosts(hosts_);
  event["ranks"] = total_slots(hosts_);
  return event;
}

namespace {

// `args` with `--ranks N` (replaced where given, else appended).
std::vector<std::string> with_ranks(std::vector<std::string> args, int n) {
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--ranks" && i + 1 < args.size()) {
      args[i + 1] = std::to_string(n);
      return args;
    }
    if (args[i].rfind("--ranks=", 0) == 0) {
      args[i] = fmt::format("--ranks={}", n);
      return args;
    }
  }
  args.push_back("--ranks");
  args.push_back(std::to_string(n));
  return args;
}

}  // namespace

std::vector<std::string> launch_line(const std::string& launcher, const std::vector<HostSlots>& hosts,
                                     const std::vector<std::string>& launcher_args, const std::string& exe,
                                     const std::string& agent_dir, const std::vector<std::string>& train) {
  const int n = total_slots(hosts);
  std::vector<std::string> line;
  if (launcher == "srun") {
    std::string names;
    for (const HostSlots& h : hosts) names += (names.empty() ? "" : ",") + h.name;
    line = {"srun", "--nodelist=" + names, fmt::format("--nodes={}", hosts.size()), fmt::format("--ntasks={}", n),
            fmt::format("--ntasks-per-node={}", hosts.front().slots), "--distribution=block"};
  } else {
    line = {"mpirun", "--host", format_hosts(hosts), "-np", std::to_string(n), "--map-by", "slot"};
  }
  line.insert(line.end(), launcher_args.begin(), launcher_args.end());
  for (const std::string& a : {exe, std::string("supervise"), std::string("--rank-agent"), agent_dir, std::string("--")})
    line.push_back(a);
  const std::vector<std::string> ranked = with_ranks(train, n);
  line.insert(line.end(), ranked.begin(), ranked.end());
  return line;
}

}  // namespace epx::app
