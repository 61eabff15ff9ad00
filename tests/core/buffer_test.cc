#include "epx/core/buffer.h"

#include <cstdint>

#include <gtest/gtest.h>

#include "epx/core/clock.h"
#include "epx/core/tensor.h"
#include "epx/core/trace.h"

namespace epx {
namespace {

TEST(AlignedBuffer, AlignedAndZeroed) {
  AlignedBuffer buf(1000, 4096, /*zero=*/true);
  ASSERT_NE(buf.data(), nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buf.data()) % 4096, 0u);
  for (std::size_t i = 0; i < buf.size(); ++i) ASSERT_EQ(buf.data()[i], std::byte{0});
  AlignedBuffer moved = std::move(buf);
  EXPECT_EQ(buf.data(), nullptr);
  EXPECT_EQ(moved.size(), 1000u);
  ASSERT_TRUE(moved.reserve(10, "a test").is_ok());
  EXPECT_EQ(moved.size(), 1000u);
  ASSERT_TRUE(moved.reserve(5000, "a test").is_ok());
  EXPECT_EQ(moved.size(), 5000u);
}

TEST(Carver, CountsAndPointsTheSame) {
  int32_t* a = nullptr;
  double* b = nullptr;
  auto carve = [&](Carver& c) {
    a = c.take<int32_t>(3);
    b = c.take<double>(5);
  };
  Carver sizer(nullptr);
  carve(sizer);
  EXPECT_EQ(a, nullptr);
  EXPECT_EQ(sizer.bytes(), 128u);  // 12 bytes, padded to 64, then 40 bytes, padded to 64.
  AlignedBuffer mem(sizer.bytes());
  Carver carver(mem.data());
  carve(carver);
  EXPECT_EQ(reinterpret_cast<std::byte*>(a), mem.data());
  EXPECT_EQ(reinterpret_cast<std::byte*>(b), mem.data() + 64);
  EXPECT_EQ(carver.bytes(), sizer.bytes());
}

TEST(TensorView, ShapesStridesAndRows) {
  float data[12] = {};
  auto v = TensorView::contiguous(data, DType::kF32, {3, 4});
  EXPECT_EQ(v.ndim(), 2);
  EXPECT_EQ(v.numel(), 12);
  EXPECT_EQ(v.stride(0), 4);
  EXPECT_TRUE(v.is_contiguous());
  EXPECT_EQ(v.row<float>(2), data + 8);
  EXPECT_TRUE(check_matrix(v, "x", DType::kF32, 3, 4).is_ok());
  Status bad = check_matrix(v, "x", DType::kF32, 3, 5);
  EXPECT_EQ(bad.message(), "x must be [3, 5], got f32[3, 4] (strides 4, 1)");
  EXPECT_EQ(check_matrix(v, "x", DType::kBF16, 3, 4).code(), StatusCode::kInvalidArgument);
  // A padded view (row stride 6) is accepted; a transposed one is not.
  TensorView padded(data, DType::kF32, {2, 4}, {6, 1});
  EXPECT_FALSE(padded.is_contiguous());
  EXPECT_TRUE(check_matrix(padded, "x", DType::kF32, 2, 4).is_ok());
  TensorView transposed(data, DType::kF32, {4, 3}, {1, 4});
  EXPECT_FALSE(check_matrix(transposed, "x", DType::kF32, 4, 3).is_ok());
  EXPECT_FALSE(TensorView().defined());
}

TEST(Clock, DeadlinesExpire) {
  Deadline past = Deadline::after(std::chrono::milliseconds(0));
  EXPECT_TRUE(past.expired());
  EXPECT_EQ(past.remaining(), Clock::duration::zero());
  Deadline future = Deadline::after(std::chrono::seconds(60));
  EXPECT_FALSE(future.expired());
  EXPECT_GT(future.remaining(), std::chrono::seconds(50));
}

TEST(Tracer, RecordsSpansPerRank) {
  Tracer tracer;
  { ScopedSpan s(&tracer, 1, "combine"); }
  { ScopedSpan s(&tracer, 0, "dispatch"); }
  { ScopedSpan s(nullptr, 0, "ignored"); }
  auto spans = tracer.spans();
  ASSERT_EQ(spans.size(), 2u);
  EXPECT_EQ(spans[0].rank, 0);
  EXPECT_EQ(spans[0].name, "dispatch");
  EXPECT_LE(spans[0].begin_ns, spans[0].end_ns);
  EXPECT_GE(tracer.total_seconds(1, "combine"), 0.0);
  tracer.clear();
  EXPECT_TRUE(tracer.spans().empty());
}

}  // namespace
}  // namespace epx
