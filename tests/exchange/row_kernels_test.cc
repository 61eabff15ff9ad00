// detail::column_order_dots: the dot products of combine_expanded's backward,
// several at once, each with the bits of a plain serial loop in column order;
// detail::sum_row streamed gives the bits it gives through the cache.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "epx/core/buffer.h"
#include "epx/core/dtype.h"
#include "exchange/cpu/row_kernels.h"

namespace epx::detail {
namespace {

constexpr int kCols = 37;  // not a multiple of any vector width

// Values with mixed magnitudes, so another order of additions rounds differently.
float value(int row, int col) {
  const float scale = (col % 3 == 0) ? 1024.0f : ((col % 3 == 1) ? 1.0f : 1.0f / 1024.0f);
  return scale * (static_cast<float>((row * 131 + col * 71) % 97) - 48.0f) / 17.0f;
}

float serial_dot(const float* g, const std::vector<float>& y) {
  float dot = 0.0f;
  for (int c = 0; c < kCols; ++c) dot += g[c] * y[c];
  return dot;
}

// `jobs` dot products of rows of `dtype` against three g rows; every result
// must equal the serial loop bit for bit, whatever the number of jobs.
void check(DType dtype, int num_jobs) {
  SCOPED_TRACE(testing::Message() << dtype_name(dtype) << ", " << num_jobs << " jobs");
  std::vector<float> g(3 * kCols);
  for (int i = 0; i < 3 * kCols; ++i) g[i] = value(100 + i / kCols, i % kCols);
  std::vector<std::vector<float>> y_f32(num_jobs, std::vector<float>(kCols));
  std::vector<std::vector<uint16_t>> y_bf16(num_jobs, std::vector<uint16_t>(kCols));
  std::vector<DotJob> jobs;
  std::vector<float> out(num_jobs, -7.0f);
  for (int j = 0; j < num_jobs; ++j) {
    for (int c = 0; c < kCols; ++c) {
      y_bf16[j][c] = f32_to_bf16(value(j, c));
      y_f32[j][c] = dtype == DType::kBF16 ? bf16_to_f32(y_bf16[j][c]) : value(j, c);
    }
    const auto* y = dtype == DType::kBF16 ? reinterpret_cast<const std::byte*>(y_bf16[j].data())
                                          : reinterpret_cast<const std::byte*>(y_f32[j].data());
    jobs.push_back({g.data() + (j % 3) * kCols, y, &out[j]});
  }
  column_order_dots(jobs, dtype, kCols);
  for (int j = 0; j < num_jobs; ++j) EXPECT_EQ(out[j], serial_dot(g.data() + (j % 3) * kCols, y_f32[j])) << "job " << j;
}

TEST(ColumnOrderDots, EachIsTheSerialLoopBitForBit) {
  for (DType dtype : {DType::kF32, DType::kBF16})
    for (int num_jobs : {0, 1, 3, 4, 5, 8, 9}) check(dtype, num_jobs);
}

// The check can fail: summing one job in two halves (another order) gives
// other bits on these values.
TEST(ColumnOrderDots, AnotherOrderGivesOtherBits) {
  std::vector<float> g(kCols), y(kCols);
  for (int c = 0; c < kCols; ++c) g[c] = value(100, c), y[c] = value(1, c);
  float even = 0.0f, odd = 0.0f;
  for (int c = 0; c < kCols; c += 2) even += g[c] * y[c];
  for (int c = 1; c < kCols; c += 2) odd += g[c] * y[c];
  EXPECT_NE(even + odd, serial_dot(g.data(), y));
}

// sum_row's output written with streamed stores (the two-hop forwarder's f32
// partials at large sizes) is byte for byte the cached output, at row widths
// whose slices stream (copy_row streams from 256 bytes; 37 columns stay
// below it and take the cached fallback) and at 64-byte-aligned and
// unaligned out, and nothing outside out is touched.
TEST(SumRow, StreamedStoresGiveTheCachedBytes) {
  for (DType out_dtype : {DType::kF32, DType::kBF16})
    for (int hidden : {37, 512, 1000, 7168})
      for (std::size_t offset : {0, 4, 36}) {
        SCOPED_TRACE(testing::Message() << dtype_name(out_dtype) << ", hidden " << hidden << ", offset " << offset);
        // Groups: one bf16 row, a node partial of three bf16 rows, one f32 row.
        std::vector<std::vector<uint16_t>> bf16_rows(4, std::vector<uint16_t>(hidden));
        std::vector<float> f32_row(hidden);
        for (int c = 0; c < hidden; ++c) {
          for (int r = 0; r < 4; ++r) bf16_rows[r][c] = f32_to_bf16(value(r, c));
          f32_row[c] = value(9, c);
        }
        const std::byte* rows[5] = {reinterpret_cast<const std::byte*>(bf16_rows[0].data()),
                                    reinterpret_cast<const std::byte*>(bf16_rows[1].data()),
                                    reinterpret_cast<const std::byte*>(bf16_rows[2].data()),
                                    reinterpret_cast<const std::byte*>(bf16_rows[3].data()),
                                    reinterpret_cast<const std::byte*>(f32_row.data())};
        const SumGroup groups[3] = {{&rows[0], 1, DType::kBF16}, {&rows[1], 3, DType::kBF16}, {&rows[4], 1, DType::kF32}};
        const std::size_t bytes = static_cast<std::size_t>(hidden) * dtype_size(out_dtype);
        // 64-byte-aligned bases, so offset 0 is an aligned out.
        AlignedBuffer cached(bytes + 256, 64), streamed(bytes + 256, 64);
        std::memset(cached.data(), 0xA5, cached.size());
        std::memset(streamed.data(), 0xA5, streamed.size());
        sum_row(cached.data() + 64 + offset, out_dtype, groups, nullptr, DType::kF32, hidden, RowStores::kCached);
        sum_row(streamed.data() + 64 + offset, out_dtype, groups, nullptr, DType::kF32, hidden, RowStores::kStreamed);
        finish_streamed_rows();
        ASSERT_EQ(std::memcmp(cached.data(), streamed.data(), cached.size()), 0);
        EXPECT_EQ(cached.data()[64 + offset - 1], std::byte{0xA5});
        EXPECT_EQ(cached.data()[64 + offset + bytes], std::byte{0xA5});
      }
}

}  // namespace
}  // namespace epx::detail
