#include "epx/core/memory.h"

#include <gtest/gtest.h>

namespace epx {
namespace {

TEST(Memory, SaturatesInsteadOfOverflowing) {
  EXPECT_EQ(saturating_product({3, 4, 5}), 60);
  EXPECT_EQ(saturating_product({int64_t{1} << 40, int64_t{1} << 30}), kMemoryUnbounded);
  EXPECT_EQ(saturating_product({int64_t{1} << 40, 0, int64_t{1} << 40}), 0);
  EXPECT_EQ(saturating_sum(kMemoryUnbounded, 1), kMemoryUnbounded);
  EXPECT_EQ(saturating_sum(2, 3), 5);
}

TEST(Memory, FormatsBinaryUnits) {
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(1536), "1.5 KiB");
  EXPECT_EQ(format_bytes(int64_t{22} << 30), "22 GiB");
  EXPECT_EQ(format_bytes(int64_t{3277} << 30), "3.2 TiB");
  EXPECT_EQ(format_bytes(kMemoryUnbounded), "more than 8 EiB");
}

TEST(Memory, RefusalNamesTheLargestItemItsSettingAndWhatIsAvailable) {
  MemoryEstimate e;
  e.copies = 4;
  e.add("expert weights", int64_t{3} << 40, "experts = 1000000000");
  e.add("batch", 1024, "batch_tokens = 512");
  EXPECT_EQ(e.per_rank(), (int64_t{3} << 40) + 1024);
  EXPECT_EQ(e.total(), 4 * e.per_rank());
  const Status s = check_memory_fits(e, {.bytes = int64_t{22} << 30, .source = "MemAvailable of /proc/meminfo"});
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(),
            "experts = 1000000000 needs 3.0 TiB of expert weights per rank (the 4 ranks in this process: 12 TiB in "
            "all); 22 GiB is available (MemAvailable of /proc/meminfo)");
  e.add("expert gradients", int64_t{1} << 40, "experts = 1000000000");
  e.copies = 1;
  EXPECT_EQ(check_memory_fits(e, {.bytes = int64_t{22} << 30, .source = "test"}).message(),
            "experts = 1000000000 needs 4.0 TiB of expert weights, expert gradients per rank (4.0 TiB in all); 22 GiB "
            "is available (test)");
  EXPECT_TRUE(check_memory_fits(e, {.bytes = e.total(), .source = "test"}).is_ok());
  EXPECT_FALSE(check_memory_fits(e, {.bytes = e.total() - 1, .source = "test"}).is_ok());
}

TEST(Memory, AvailableMemoryIsKnownOnLinux) {
  const MemoryAvailable a = available_memory();
  EXPECT_GT(a.bytes, 0);
  EXPECT_LT(a.bytes, kMemoryUnbounded) << a.source;
}

}  // namespace
}  // namespace epx
