#include "epx/core/memory.h"

#include <sys/resource.h>

#include <algorithm>
#include <charconv>
#include <fstream>

#include <fmt/format.h>

namespace epx {

int64_t saturating_product(std::initializer_list<int64_t> factors) {
  int64_t out = 1;
  for (int64_t f : factors) {
    if (f <= 0) return 0;
    if (__builtin_mul_overflow(out, f, &out)) return kMemoryUnbounded;
  }
  return out;
}

int64_t saturating_sum(int64_t a, int64_t b) {
  int64_t out = 0;
  return __builtin_add_overflow(a, b, &out) ? kMemoryUnbounded : out;
}

std::string format_bytes(int64_t bytes) {
  if (bytes >= kMemoryUnbounded) return "more than 8 EiB";
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  auto v = static_cast<double>(bytes);
  int unit = 0;
  while (v >= 1024 && unit < 6) {
    v /= 1024;
    ++unit;
  }
  if (unit == 0) return fmt::format("{} B", bytes);
  return fmt::format("{:.{}f} {}", v, v < 10 ? 1 : 0, kUnits[unit]);
}

void MemoryEstimate::add(std::string name, int64_t bytes, std::string driver) {
  items.push_back({std::move(name), std::max<int64_t>(bytes, 0), std::move(driver)});
}

int64_t MemoryEstimate::per_rank() const {
  int64_t sum = 0;
  for (const MemoryItem& item : items) sum = saturating_sum(sum, item.bytes);
  return sum;
}

int64_t MemoryEstimate::total() const { return saturating_product({per_rank(), std::max<int64_t>(copies, 1)}); }

const MemoryItem* MemoryEstimate::largest() const {
  const auto it = std::max_element(items.begin(), items.end(),
                                   [](const MemoryItem& a, const MemoryItem& b) { return a.bytes < b.bytes; });
  return it == items.end() ? nullptr : &*it;
}

namespace {

// "MemAvailable:   12345 kB" of /proc/meminfo, in bytes; -1 when absent.
int64_t meminfo_available() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit)
    if (key == "MemAvailable:") return saturating_product({kib, 1024});
  return -1;
}

// The first line of a file as a number; -1 when absent or "max".
int64_t read_number(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  int64_t value = -1;
  if (!(in >> text) || text == "max") return -1;
  const auto [end, err] = std::from_chars(text.data(), text.data() + text.size(), value);
  return err == std::errc() && end == text.data() + text.size() ? value : -1;
}

// memory.max - memory.current of this process's cgroup (v2); -1 when unlimited.
int64_t cgroup_room() {
  std::ifstream in("/proc/self/cgroup");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("0::", 0) != 0) continue;
    const std::string dir = "/sys/fs/cgroup" + line.substr(3);
    const int64_t max = read_number(dir + "/memory.max");
    if (max < 0) return -1;
    const int64_t current = std::max<int64_t>(read_number(dir + "/memory.current"), 0);
    return std::max<int64_t>(max - current, 0);
  }
  return -1;
}

}  // namespace

MemoryAvailable available_memory() {
  MemoryAvailable out;
  auto consider = [&out](int64_t bytes, const char* source) {
    if (bytes >= 0 && bytes < out.bytes) out = {bytes, source};
  };
  consider(meminfo_available(), "MemAvailable of /proc/meminfo");
  rlimit as{};
  if (::getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY)
    consider(static_cast<int64_t>(std::min<rlim_t>(as.rlim_cur, kMemoryUnbounded)), "RLIMIT_AS (ulimit -v)");
  consider(cgroup_room(), "the cgroup's memory.max");
  return out;
}

Status check_memory_fits(const MemoryEstimate& estimate, const MemoryAvailable& available) {
  const int64_t total = estimate.total();
  if (total <= available.bytes) return Status::ok();
  // The setting behind the largest item, and everything it drives.
  const std::string& driver = estimate.largest()->driver;
  int64_t driven = 0;
  std::string names;
  for (const MemoryItem& item : estimate.items) {
    if (item.driver != driver) continue;
    driven = saturating_sum(driven, item.bytes);
    names += fmt::format("{}{}", names.empty() ? "" : ", ", item.name);
  }
  std::string all;
  if (estimate.copies > 1)
    all = fmt::format(" (the {} ranks in this process: {} in all)", estimate.copies, format_bytes(total));
  else if (driven != total)
    all = fmt::format(" ({} in all)", format_bytes(total));
  const std::string scope = estimate.scope.empty() ? "" : " " + estimate.scope;
  return resource_exhausted("{} needs {} of {}{}{}; {} is available ({})", driver, format_bytes(driven), names, scope,
                            all, format_bytes(available.bytes), available.source);
}

}  // namespace epx
