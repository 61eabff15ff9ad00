// The exchange's row copy (exchange/row_copy.h): streamed (non-temporal) and
// cached stores copy exactly the same bytes, whatever the alignment and size,
// and touch nothing outside the destination.
#include "exchange/cpu/row_copy.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace epx::detail {
namespace {

// Copies `bytes` from src + src_offset to dst + dst_offset and checks every
// destination byte, and the guard bytes around it.
void check_copy(RowStores stores, std::size_t dst_offset, std::size_t src_offset, std::size_t bytes) {
  constexpr std::byte kGuard{0xA5};
  std::vector<std::byte> src(bytes + 128), dst(bytes + 256, kGuard);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::byte>((i * 131 + 7) % 251);
  // 64-byte aligned bases, then the offsets under test.
  auto* s = reinterpret_cast<std::byte*>((reinterpret_cast<std::uintptr_t>(src.data()) + 63) / 64 * 64);
  auto* d = reinterpret_cast<std::byte*>((reinterpret_cast<std::uintptr_t>(dst.data()) + 63) / 64 * 64);
  if (s + src_offset + bytes > src.data() + src.size() || d + dst_offset + bytes + 64 > dst.data() + dst.size())
    GTEST_FAIL() << "test buffers too small";
  copy_row(d + dst_offset, s + src_offset, bytes, stores);
  finish_streamed_rows();
  for (std::size_t i = 0; i < bytes; ++i)
    ASSERT_EQ(d[dst_offset + i], s[src_offset + i]) << "byte " << i << " of " << bytes << ", dst offset " << dst_offset
                                                    << ", src offset " << src_offset;
  for (std::byte* p = dst.data(); p < d + dst_offset; ++p) ASSERT_EQ(*p, kGuard) << "written before dst";
  for (std::byte* p = d + dst_offset + bytes; p < dst.data() + dst.size(); ++p) ASSERT_EQ(*p, kGuard) << "written after";
}

TEST(RowCopy, StreamedAndCachedCopyTheSameBytesAtAnyAlignment) {
  for (RowStores stores : {RowStores::kCached, RowStores::kStreamed})
    for (std::size_t dst_offset : {0, 1, 8, 63})
      for (std::size_t src_offset : {0, 3, 32})
        for (std::size_t bytes : {0, 1, 255, 256, 257, 4096, 14336, 14336 + 40}) {
          check_copy(stores, dst_offset, src_offset, bytes);
          if (HasFatalFailure()) return;
        }
}

TEST(RowCopy, StreamsOnlyWhatPassesTheCache) {
  EXPECT_EQ(row_stores_for(0), RowStores::kCached);
  EXPECT_EQ(row_stores_for(std::size_t{1} << 20), RowStores::kCached);         // 1 MiB: below every L3 we cap at
  EXPECT_EQ(row_stores_for(std::size_t{64} << 20), RowStores::kStreamed);      // above the 32 MiB cap
  EXPECT_EQ(row_stores_for(std::size_t{624} << 20), RowStores::kStreamed);     // 1024 tokens x 8 ranks
}

}  // namespace
}  // namespace epx::detail
