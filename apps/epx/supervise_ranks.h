// `epx supervise --hosts`: the supervisor starts the ranks itself (mpirun or
// srun), each under a rank agent that records how its rank ended, so a
// failure names its rank and host; a host that failed --exclude-after times
// is left out (or replaced by a spare) and the run resumes on the ranks left.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "epx/core/status.h"

namespace epx::app {

struct HostSlots {
  std::string name;
  int slots = 0;
};

// "a:2,b:2" (a host without ":N" has 1 slot); an error names the bad entry.
Result<std::vector<HostSlots>> parse_hosts(const std::string& text, const std::string& option);
std::string format_hosts(const std::vector<HostSlots>& hosts);  // back to "a:2,b:2"
int total_slots(const std::vector<HostSlots>& hosts);

// How one rank ended, as its agent wrote it (DIR/rank-R.json).
struct RankEnd {
  int rank = -1;
  std::string hostname;         // as the rank's host names itself
  std::string state;            // running, stopped, exited, killed
  int exit_code = -1;           // exited
  int signal = 0;               // killed or stopped: the signal
  bool stop_requested = false;  // a signal reached the agent first: the launcher (or we) stopped it
  double time = 0;              // seconds since the epoch of the last change
};
std::vector<RankEnd> read_rank_ends(const std::string& dir);

// The rank whose end caused the run's: a stopped rank first, else the
// earliest one that died by a signal, else the earliest that exited non-zero
// (neither asked for: a rank whose peer died often exits 1 first).
std::optional<RankEnd> first_failure(const std::vector<RankEnd>& ends);
std::string describe_cause(const RankEnd& end);

// `epx supervise --rank-agent DIR -- CMD`: runs CMD (one rank) as a child,
// passes SIGTERM/SIGUSR1/SIGINT on, and records its state in DIR/rank-R.json
// (R from the launcher's environment); exits as CMD did (128+N for signal N).
int run_rank_agent(const std::string& dir, const std::vector<std::string>& command);

// The hosts a run uses, their failures, and the spares left.
class HostPool {
 public:
  HostPool(std::vector<HostSlots> hosts, std::vector<HostSlots> spares, int exclude_after)
      : hosts_(std::move(hosts)), spares_(std::move(spares)), exclude_after_(exclude_after) {}
  const std::vector<HostSlots>& hosts() const { return hosts_; }
  // The host of `rank` under block placement (the first host's slots first).
  std::string host_of(int rank) const;
  // Counts a failure of `host`; at exclude_after it is left out (replaced by
  // the first spare, if any): the event saying so, else nullopt.
  std::optional<nlohmann::json> count_failure(const std::string& host);

 private:
  std::vector<HostSlots> hosts_, spares_;
  int exclude_after_;
  std::map<std::string, int> failures_;
};

// The launcher's command line: `launcher` (mpirun or srun) over `hosts`,
// each rank `exe supervise --rank-agent DIR -- train...` with --ranks set to
// the hosts' slots.
std::vector<std::string> launch_line(const std::string& launcher, const std::vector<HostSlots>& hosts,
                                     const std::vector<std::string>& launcher_args, const std::string& exe,
                                     const std::string& agent_dir, const std::vector<std::string>& train);

}  // namespace epx::app
