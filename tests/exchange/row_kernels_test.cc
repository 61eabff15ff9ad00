// detail::column_order_dots: the dot products of combine_expanded's backward,
// several at once, each with the bits of a plain serial loop in column order.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "epx/core/dtype.h"
#include "exchange/row_kernels.h"

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

}  // namespace
}  // namespace epx::detail
