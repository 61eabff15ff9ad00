#include "machine.h"

#include <sched.h>
#include <sys/utsname.h>

#include <ctime>
#include <fstream>
#include <thread>

#include <fmt/format.h>

namespace epx::app {

MachineInfo machine_info() {
  MachineInfo info;
  info.cpu_model = "unknown";
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) info.cpu_model = line.substr(line.find_first_not_of(" \t", colon + 1));
      break;
    }
  }
  cpu_set_t set;
  info.cores = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set)
                                                            : static_cast<int>(std::thread::hardware_concurrency());
  std::ifstream meminfo("/proc/meminfo");
  std::string key, unit;
  std::size_t value = 0;
  while (meminfo >> key >> value) {
    std::getline(meminfo, unit);
    if (key == "MemTotal:") {
      info.memory_bytes = value * 1024;
      break;
    }
  }
  utsname u{};
  if (uname(&u) == 0) info.kernel = fmt::format("{} {}", u.sysname, u.release);
  return info;
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return text;
}

nlohmann::json record_head(const MachineInfo& machine, const std::string& date) {
  nlohmann::json j;
  j["machine"] = {{"cpu_model", machine.cpu_model},
                  {"cores", machine.cores},
                  {"memory_bytes", machine.memory_bytes},
                  {"kernel", machine.kernel}};
  j["date"] = date;
  j["epx_version"] = EPX_VERSION;
  return j;
}

}  // namespace epx::app
