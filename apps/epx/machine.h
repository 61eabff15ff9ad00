// What the command reports about the machine it ran on, for benchmark
// records: CPU model, cores, memory, and the date.
#pragma once

#include <cstddef>
#include <string>

#include <nlohmann/json.hpp>

namespace epx::app {

struct MachineInfo {
  std::string cpu_model;     // "model name" of /proc/cpuinfo, or "unknown"
  int cores = 0;             // hardware threads this process may use
  std::size_t memory_bytes = 0;  // MemTotal
  std::string kernel;        // uname -sr
};

[[nodiscard]] MachineInfo machine_info();
// Now, as ISO 8601 UTC: "2025-01-31T12:00:00Z".
[[nodiscard]] std::string utc_now();

// The head every benchmark's JSON record starts with: machine, date, version.
[[nodiscard]] nlohmann::json record_head(const MachineInfo& machine, const std::string& date);

}  // namespace epx::app
