// Memory estimates: what a configuration will allocate, per component, and
// whether it fits in the memory this process can have. Commands check this
// before they allocate, so a configuration that cannot fit is refused in
// milliseconds with the numbers instead of being killed by the kernel.
//
//   epx::MemoryEstimate e;
//   e.copies = num_ranks;  // ranks living in this process
//   e.add("expert parameters", bytes, "experts = 1000000000");
//   EPX_RETURN_IF_ERROR(epx::check_memory_fits(e, epx::available_memory()));
//
// Sizes are int64 bytes that saturate at kMemoryUnbounded (about 8 EiB)
// instead of overflowing, so an absurd setting still gives a finite, clearly
// too-large estimate. The estimate is of what epx allocates (heap and mapped
// regions), not of the code and libraries, which add tens of MiB.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "epx/core/status.h"

namespace epx {

inline constexpr int64_t kMemoryUnbounded = INT64_MAX;

// The product of non-negative factors, kMemoryUnbounded when it overflows.
[[nodiscard]] int64_t saturating_product(std::initializer_list<int64_t> factors);
// a + b of non-negative sizes, saturating.
[[nodiscard]] int64_t saturating_sum(int64_t a, int64_t b);

// "3.2 TiB", "512 B", "more than 8 EiB" (binary units, 3 significant digits).
[[nodiscard]] std::string format_bytes(int64_t bytes);

struct MemoryItem {
  std::string name;    // "expert parameters"
  int64_t bytes = 0;   // per rank
  std::string driver;  // the user's setting that drives it: "experts = 1000000000"
};

struct MemoryEstimate {
  std::vector<MemoryItem> items;
  int64_t copies = 1;  // ranks in this process (in-process ranks are threads of one process)
  std::string scope = "per rank";  // what the items are for, in messages ("" for a whole process)

  void add(std::string name, int64_t bytes, std::string driver);
  [[nodiscard]] int64_t per_rank() const;
  [[nodiscard]] int64_t total() const;  // per_rank() * copies
  [[nodiscard]] const MemoryItem* largest() const;
};

struct MemoryAvailable {
  int64_t bytes = kMemoryUnbounded;
  std::string source = "unknown";  // "MemAvailable", "RLIMIT_AS", "cgroup memory.max"
};

// The least of: MemAvailable of /proc/meminfo, the soft RLIMIT_AS, and the
// cgroup v2 memory.max (minus memory.current) of this process's cgroup, where
// each is known. kMemoryUnbounded with source "unknown" when none is.
[[nodiscard]] MemoryAvailable available_memory();

// ResourceExhausted when the estimate's total is above `available`, naming
// the setting behind the largest item, what it drives per rank, the total and
// what is available: "experts = 1000000000 needs 3.2 TiB of expert weights,
// expert gradients, expert AdamW moments per rank (the 4 ranks in this
// process: 12.8 TiB in all); 22.1 GiB is available (MemAvailable of
// /proc/meminfo)".
[[nodiscard]] Status check_memory_fits(const MemoryEstimate& estimate, const MemoryAvailable& available);

}  // namespace epx
