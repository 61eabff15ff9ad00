// What an `epx supervise --events` file says about a run's restarts, for
// `epx report --events` and `epx monitor --events`.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "epx/core/status.h"

namespace epx::app {

struct RestartHistory {
  int runs = 0;             // start events
  int restarts = 0;         // starts after the first
  int64_t lost_steps = 0;   // steps done after the checkpoint a failed run's restart resumed from
  std::vector<std::string> failures;  // "rank 3 on b: killed by Killed at step 27"
  std::vector<std::string> excluded;  // "b (replaced by c)"
  std::vector<double> restart_seconds;  // from a failure to the first step after its restart
  std::string gave_up;                // why the supervisor gave up; empty when it did not
};

// Reads the events file (JSON Lines; a line that is not an object is skipped:
// the last may be torn by a kill). NotFound / InvalidArgument as read_input_file.
Result<RestartHistory> read_restart_history(const std::string& path);
// One line: "2 restarts, 14 steps lost; rank 3 on b: killed by Killed at step 27; excluded b; ..."
std::string describe_restarts(const RestartHistory& h);
nlohmann::json restarts_json(const RestartHistory& h);

}  // namespace epx::app
