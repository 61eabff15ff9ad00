#include "epx/core/dtype.h"

#include <cmath>
#include <limits>

#include <gtest/gtest.h>

namespace epx {
namespace {

float bits_to_f32(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

TEST(BF16, ExactValuesRoundTrip) {
  for (float v : {0.0f, -0.0f, 1.0f, -2.0f, 0.5f, 65536.0f, 1.0f / 128})
    EXPECT_EQ(bf16_to_f32(f32_to_bf16(v)), v) << v;
}

TEST(BF16, RoundsToNearestEven) {
  // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(f32_to_bf16(bits_to_f32(0x3f808000u)), 0x3f80u);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd mantissa) and 1 + 2^-6: up to even.
  EXPECT_EQ(f32_to_bf16(bits_to_f32(0x3f818000u)), 0x3f82u);
  // Just above halfway rounds up; just below rounds down.
  EXPECT_EQ(f32_to_bf16(bits_to_f32(0x3f808001u)), 0x3f81u);
  EXPECT_EQ(f32_to_bf16(bits_to_f32(0x3f807fffu)), 0x3f80u);
  // 1/3 = 0x3eaaaaab -> 0x3eab (0.333984375).
  EXPECT_EQ(f32_to_bf16(1.0f / 3.0f), 0x3eabu);
  EXPECT_EQ(bf16_to_f32(0x3eab), 0.333984375f);
}

TEST(BF16, SpecialValues) {
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  // A signalling NaN whose payload sits only in the low bits must stay a NaN.
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(bits_to_f32(0x7f800001u)))));
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::infinity())),
            std::numeric_limits<float>::infinity());
  // The largest float rounds up to infinity.
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::max())), std::numeric_limits<float>::infinity());
}

TEST(DType, SizesNamesAndParsing) {
  EXPECT_EQ(dtype_size(DType::kF32), 4u);
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(dtype_size(DType::kFP8E4M3), 1u);
  EXPECT_EQ(dtype_name(DType::kBF16), "bf16");
  EXPECT_EQ(parse_dtype("bfloat16").value(), DType::kBF16);
  Result<DType> bad = parse_dtype("f16");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("'f16'"), std::string::npos);
}

}  // namespace
}  // namespace epx
