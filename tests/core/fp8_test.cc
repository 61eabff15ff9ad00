// fp8 e4m3 / ue8m0 conversions and block quantisation against a direct
// reference: every e4m3 code, rounding ties, saturation, subnormals, zero
// blocks, the largest f32 and bf16 values, and the stated round-trip bound.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "epx/core/fp8.h"

namespace epx {
namespace {

// The value of an e4m3 code by the format's definition, in double.
double reference_e4m3(int code) {
  const int sign = code >> 7, exponent = (code >> 3) & 15, mantissa = code & 7;
  if (exponent == 15 && mantissa == 7) return std::numeric_limits<double>::quiet_NaN();
  const double magnitude =
      exponent == 0 ? mantissa * std::pow(2.0, -9) : (1.0 + mantissa / 8.0) * std::pow(2.0, exponent - 7);
  return sign ? -magnitude : magnitude;
}

// Nearest e4m3 code by search over the 127 non-negative finite values; ties
// to the even code (even mantissa); beyond 448 saturates; NaN -> 0x7f.
uint8_t reference_encode(float value) {
  if (std::isnan(value)) return std::signbit(value) ? 0xff : 0x7f;
  const uint8_t sign = std::signbit(value) ? 0x80 : 0;
  const double a = std::fabs(static_cast<double>(value));
  if (a >= 448.0) return sign | 0x7e;
  static const std::vector<double> values = [] {
    std::vector<double> v;
    for (int code = 0; code <= 0x7e; ++code) v.push_back(reference_e4m3(code));
    return v;
  }();
  int best = 0;
  for (int code = 1; code <= 0x7e; ++code) {
    const double d = std::fabs(values[code] - a), db = std::fabs(values[best] - a);
    if (d < db || (d == db && (code & 1) == 0)) best = code;
  }
  return sign | static_cast<uint8_t>(best);
}

float f32_of_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

TEST(Fp8E4M3, HandCheckedValues) {
  EXPECT_EQ(e4m3_to_f32(0x00), 0.0f);
  EXPECT_EQ(e4m3_to_f32(0x01), 0x1p-9f);   // smallest subnormal
  EXPECT_EQ(e4m3_to_f32(0x08), 0x1p-6f);   // smallest normal
  EXPECT_EQ(e4m3_to_f32(0x38), 1.0f);
  EXPECT_EQ(e4m3_to_f32(0x7e), 448.0f);    // largest finite
  EXPECT_EQ(e4m3_to_f32(0xfe), -448.0f);
  EXPECT_TRUE(std::isnan(e4m3_to_f32(0x7f)));
  EXPECT_TRUE(std::isnan(e4m3_to_f32(0xff)));
  EXPECT_EQ(f32_to_e4m3(1.0f), 0x38);
  EXPECT_EQ(f32_to_e4m3(-2.5f), 0xc2);     // -1.25 * 2^1
}

TEST(Fp8E4M3, EveryCodeDecodesToTheReferenceAndReencodesToItself) {
  int finite = 0;
  for (int code = 0; code < 256; ++code) {
    const double expected = reference_e4m3(code);
    const float got = e4m3_to_f32(static_cast<uint8_t>(code));
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(got)) << code;
      // NaN re-encodes to the NaN of its sign.
      EXPECT_EQ(f32_to_e4m3(got), code) << code;
      continue;
    }
    ++finite;
    EXPECT_EQ(static_cast<double>(got), expected) << "code " << code;
    EXPECT_EQ(std::signbit(got), (code & 0x80) != 0) << "code " << code;
    EXPECT_EQ(f32_to_e4m3(got), code) << "code " << code;
  }
  EXPECT_EQ(finite, 254);
}

TEST(Fp8E4M3, TiesRoundToEvenAndNeighboursToTheNearest) {
  // Every midpoint between adjacent codes (exact in f32), and one f32 ulp on
  // either side of it.
  int ties = 0;
  for (int code = 0; code < 0x7e; ++code) {
    const float lo = e4m3_to_f32(static_cast<uint8_t>(code)), hi = e4m3_to_f32(static_cast<uint8_t>(code + 1));
    const float mid = (lo + hi) / 2;
    ASSERT_EQ(static_cast<double>(mid), (static_cast<double>(lo) + hi) / 2);
    const int even = (code & 1) == 0 ? code : code + 1;
    for (float sign : {1.0f, -1.0f}) {
      const uint8_t s = sign < 0 ? 0x80 : 0;
      EXPECT_EQ(f32_to_e4m3(sign * mid), s | even) << "midpoint of " << code << " and " << code + 1;
      EXPECT_EQ(f32_to_e4m3(sign * std::nextafter(mid, 0.0f)), s | code) << code;
      EXPECT_EQ(f32_to_e4m3(sign * std::nextafter(mid, 1e9f)), s | (code + 1)) << code;
    }
    ++ties;
  }
  EXPECT_EQ(ties, 126);
}

TEST(Fp8E4M3, SaturatesAtTheLargestFiniteValue) {
  for (float v : {448.0f, 448.5f, 463.9f, 464.0f, 480.0f, 1e6f, std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ(f32_to_e4m3(v), 0x7e) << v;
    EXPECT_EQ(f32_to_e4m3(-v), 0xfe) << v;
  }
  EXPECT_EQ(f32_to_e4m3(std::nanf("")), 0x7f);
  EXPECT_EQ(f32_to_e4m3(-std::nanf("")), 0xff);
}

TEST(Fp8E4M3, SubnormalsAndZeros) {
  EXPECT_EQ(f32_to_e4m3(0.0f), 0x00);
  EXPECT_EQ(f32_to_e4m3(-0.0f), 0x80);
  EXPECT_EQ(f32_to_e4m3(0x1p-10f), 0x00);  // half the smallest subnormal: tie to even (0)
  EXPECT_EQ(f32_to_e4m3(std::nextafter(0x1p-10f, 1.0f)), 0x01);
  EXPECT_EQ(f32_to_e4m3(3 * 0x1p-10f), 0x02);  // 1.5 quanta: tie to even (2)
  EXPECT_EQ(f32_to_e4m3(std::numeric_limits<float>::denorm_min()), 0x00);
  EXPECT_EQ(f32_to_e4m3(std::nextafter(0x1p-6f, 0.0f)), 0x08);  // rounds up into the normals
  EXPECT_EQ(f32_to_e4m3(7.5f * 0x1p-9f), 0x08);                 // 7.5 quanta: tie to even (8)
}

TEST(Fp8E4M3, MatchesTheReferenceOverTheF32Range) {
  // A stride through every f32 bit pattern, both signs, NaNs and infinities included.
  int checked = 0;
  for (uint64_t bits = 0; bits <= 0xffffffffull; bits += 4099) {
    const float v = f32_of_bits(static_cast<uint32_t>(bits));
    ASSERT_EQ(f32_to_e4m3(v), reference_encode(v)) << "bits 0x" << std::hex << bits << " value " << v;
    ++checked;
  }
  // Dense around the e4m3 range.
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> dist(-500.0f, 500.0f);
  std::uniform_real_distribution<float> small(-0.02f, 0.02f);
  for (int i = 0; i < 200000; ++i) {
    const float v = (i & 1) ? dist(rng) : small(rng);
    ASSERT_EQ(f32_to_e4m3(v), reference_encode(v)) << v;
    ++checked;
  }
  EXPECT_GT(checked, 1000000);
}

TEST(Ue8m0, PowersOfTwoRoundedUp) {
  for (int code = 0; code < 255; ++code) {
    const float v = ue8m0_to_f32(static_cast<uint8_t>(code));
    EXPECT_EQ(static_cast<double>(v), std::pow(2.0, code - 127)) << code;
    EXPECT_EQ(f32_to_ue8m0_ceil(v), code) << code;  // exact powers map to themselves
    const float up = std::nextafter(v, std::numeric_limits<float>::infinity());
    if (code >= 1 && code < 254) {
      EXPECT_EQ(f32_to_ue8m0_ceil(up), code + 1) << code;
    }
    if (code >= 2) {
      EXPECT_EQ(f32_to_ue8m0_ceil(std::nextafter(v, 0.0f)), code) << code;
    }
  }
  EXPECT_TRUE(std::isnan(ue8m0_to_f32(255)));
  EXPECT_EQ(f32_to_ue8m0_ceil(std::numeric_limits<float>::denorm_min()), 0);
  // The largest scale quantisation makes (amax = FLT_MAX) has a code.
  EXPECT_EQ(f32_to_ue8m0_ceil(std::numeric_limits<float>::max() / 448.0f), 127 + 120);
}

// Quantises one [rows, H] f32 matrix; returns codes and scales.
struct Quantized {
  std::vector<uint8_t> q;
  std::vector<std::byte> scales;
};

Quantized quantize(const std::vector<float>& x, int64_t rows, int64_t H, Fp8ScaleFormat format) {
  Quantized out;
  out.q.assign(x.size(), 0xaa);
  const std::size_t ssize = format == Fp8ScaleFormat::kF32 ? 4 : 1;
  out.scales.assign(static_cast<std::size_t>(rows * H / kFp8BlockSize) * ssize, std::byte{0xaa});
  const Status s = quantize_fp8(TensorView::contiguous(x.data(), DType::kF32, {rows, H}), format,
                                TensorView::contiguous(out.q.data(), DType::kFP8E4M3, {rows, H}),
                                TensorView::contiguous(out.scales.data(), scale_dtype(format), {rows, H / kFp8BlockSize}));
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  return out;
}

float scale_at(const Quantized& qz, Fp8ScaleFormat format, std::size_t block) {
  if (format == Fp8ScaleFormat::kUE8M0) return ue8m0_to_f32(static_cast<uint8_t>(qz.scales[block]));
  float s;
  std::memcpy(&s, qz.scales.data() + 4 * block, 4);
  return s;
}

class Fp8Quantize : public ::testing::TestWithParam<Fp8ScaleFormat> {};

TEST_P(Fp8Quantize, MatchesTheDirectReferenceAndTheStatedBound) {
  const Fp8ScaleFormat format = GetParam();
  const int64_t rows = 6, H = 384;
  std::mt19937 rng(11);
  std::vector<float> x(rows * H);
  // Blocks of very different magnitudes, including zeros, tiny values and
  // the largest finite f32.
  const float magnitudes[] = {1.0f, 1e-3f, 3e4f, 1e-30f, 1e-40f, std::numeric_limits<float>::max()};
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t c = 0; c < H; ++c) {
      const float m = magnitudes[(t * 3 + c / kFp8BlockSize) % 6];
      std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
      x[t * H + c] = m * dist(rng);
    }
  for (int64_t c = 0; c < kFp8BlockSize; ++c) x[1 * H + c] = 0.0f;                     // a zero block
  x[2 * H + 5] = std::numeric_limits<float>::max();                                    // amax = FLT_MAX
  x[2 * H + 6] = -std::numeric_limits<float>::max();
  const Quantized qz = quantize(x, rows, H, format);
  int nonzero = 0;
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t b = 0; b < H / kFp8BlockSize; ++b) {
      const std::size_t block = static_cast<std::size_t>(t * (H / kFp8BlockSize) + b);
      float amax = 0.0f;
      for (int64_t c = b * kFp8BlockSize; c < (b + 1) * kFp8BlockSize; ++c) amax = std::max(amax, std::fabs(x[t * H + c]));
      const float s = scale_at(qz, format, block);
      // The scale the contract states.
      float expected_scale = 1.0f;
      if (amax > 0) {
        expected_scale = std::max(amax / 448.0f, 0x1p-126f);
        if (format == Fp8ScaleFormat::kUE8M0) {
          expected_scale = std::exp2(std::ceil(std::log2(static_cast<double>(expected_scale))));
          EXPECT_GE(static_cast<double>(expected_scale) * 448.0, amax);  // never saturates
        }
      }
      ASSERT_EQ(s, expected_scale) << "row " << t << " block " << b << " amax " << amax;
      for (int64_t c = b * kFp8BlockSize; c < (b + 1) * kFp8BlockSize; ++c) {
        const float v = x[t * H + c];
        const uint8_t code = qz.q[t * H + c];
        ASSERT_EQ(code, reference_encode(v / s)) << "x[" << t << "][" << c << "] = " << v;
        // The stated bound: |x' - x| <= 2^-4 |x| + 2^-10 s, plus 2^-20 |x|.
        const double back = static_cast<double>(e4m3_to_f32(code)) * s;
        const double err = std::fabs(back - v);
        EXPECT_LE(err, (0x1p-4 + 0x1p-20) * std::fabs(v) + 0x1p-10 * s) << "x[" << t << "][" << c << "] = " << v;
        if (format == Fp8ScaleFormat::kUE8M0) {
          EXPECT_LE(std::fabs(v / s), 448.0f);
        }
        nonzero += code != 0 && code != 0x80;
      }
    }
  EXPECT_GT(nonzero, rows * H / 2);
  // The zero block: scale 1, codes 0.
  EXPECT_EQ(scale_at(qz, format, 1 * (H / kFp8BlockSize)), 1.0f);
  for (int64_t c = 0; c < kFp8BlockSize; ++c) EXPECT_EQ(qz.q[1 * H + c], 0);
  // The block holding +-FLT_MAX comes back finite: dequantisation saturates
  // at the largest finite f32 (ue8m0: 256 * 2^120 would be 2^128).
  std::vector<float> back(rows * H);
  const TensorView q_view = TensorView::contiguous(qz.q.data(), DType::kFP8E4M3, {rows, H});
  const TensorView s_view = TensorView::contiguous(qz.scales.data(), scale_dtype(format), {rows, H / kFp8BlockSize});
  ASSERT_TRUE(dequantize_fp8(q_view, s_view, TensorView::contiguous(back.data(), DType::kF32, {rows, H})).is_ok());
  const float big = std::numeric_limits<float>::max();
  EXPECT_EQ(e4m3_to_f32(qz.q[2 * H + 5]), format == Fp8ScaleFormat::kF32 ? 448.0f : 256.0f);
  EXPECT_LE(back[2 * H + 5], big);
  EXPECT_GE(back[2 * H + 5], big * (1 - 0x1p-4f));
  EXPECT_EQ(back[2 * H + 6], -back[2 * H + 5]);
  for (float v : back) ASSERT_TRUE(std::isfinite(v));
}

TEST_P(Fp8Quantize, DequantizesToF32AndBf16) {
  const Fp8ScaleFormat format = GetParam();
  const int64_t rows = 3, H = 256;
  std::vector<float> x(rows * H);
  std::mt19937 rng(3);
  std::normal_distribution<float> dist(0.0f, 2.0f);
  for (float& v : x) v = dist(rng);
  const Quantized qz = quantize(x, rows, H, format);
  const TensorView q = TensorView::contiguous(qz.q.data(), DType::kFP8E4M3, {rows, H});
  const TensorView s = TensorView::contiguous(qz.scales.data(), scale_dtype(format), {rows, H / kFp8BlockSize});
  std::vector<float> out(rows * H, -1.0f);
  ASSERT_TRUE(dequantize_fp8(q, s, TensorView::contiguous(out.data(), DType::kF32, {rows, H})).is_ok());
  std::vector<uint16_t> out16(rows * H, 0);
  ASSERT_TRUE(dequantize_fp8(q, s, TensorView::contiguous(out16.data(), DType::kBF16, {rows, H})).is_ok());
  for (int64_t i = 0; i < rows * H; ++i) {
    const float expected = e4m3_to_f32(qz.q[i]) * scale_at(qz, format, i / kFp8BlockSize);
    ASSERT_EQ(out[i], expected) << i;
    ASSERT_EQ(out16[i], f32_to_bf16(expected)) << i;
    EXPECT_LE(std::fabs(out[i] - x[i]), 0x1p-4f * std::fabs(x[i]) + 0x1p-10f * scale_at(qz, format, i / kFp8BlockSize));
  }
}

// The vectorised dequantisation gives the scalar definition's bits: every
// code (NaN, subnormals, +-0 included) at scales that keep, round, flush to
// f32 subnormals, and saturate (f32 and bf16 limits), into f32 and bf16.
TEST(Fp8Dequantize, EveryCodeAtEveryKindOfScaleMatchesTheScalarDefinition) {
  const int64_t H = 256;  // the 256 codes in two blocks, each block with its own scale
  std::vector<uint8_t> q(H);
  for (int64_t c = 0; c < H; ++c) q[c] = static_cast<uint8_t>(c);
  const float bf16_max = bf16_to_f32(0x7f7f);
  const float scales[] = {1.0f, 0x1p-126f, 0x1p-140f, 3.0f / 448, 1.7e-3f, 0x1p119f, 0x1p120f, 1e36f, 1e37f};
  for (float s0 : scales) {
    for (float s1 : {s0, 1.0f}) {
      const float s[2] = {s0, s1};
      std::vector<float> out(H);
      std::vector<uint16_t> out16(H);
      const TensorView qv = TensorView::contiguous(q.data(), DType::kFP8E4M3, {1, H});
      const TensorView sv = TensorView::contiguous(s, DType::kF32, {1, 2});
      ASSERT_TRUE(dequantize_fp8(qv, sv, TensorView::contiguous(out.data(), DType::kF32, {1, H})).is_ok());
      ASSERT_TRUE(dequantize_fp8(qv, sv, TensorView::contiguous(out16.data(), DType::kBF16, {1, H})).is_ok());
      for (int64_t c = 0; c < H; ++c) {
        const float v = e4m3_to_f32(q[c]) * s[c / kFp8BlockSize];
        const float want = std::clamp(v, -std::numeric_limits<float>::max(), std::numeric_limits<float>::max());
        const uint16_t want16 = f32_to_bf16(std::clamp(v, -bf16_max, bf16_max));
        uint32_t got_bits, want_bits;
        std::memcpy(&got_bits, &out[c], 4);
        std::memcpy(&want_bits, &want, 4);
        ASSERT_EQ(got_bits, want_bits) << "code " << c % 256 << " scale " << s[c / kFp8BlockSize];
        ASSERT_EQ(out16[c], want16) << "code " << c % 256 << " scale " << s[c / kFp8BlockSize];
      }
    }
  }
}

TEST_P(Fp8Quantize, Bf16InputWithTheLargestBf16Value) {
  const Fp8ScaleFormat format = GetParam();
  const int64_t H = 128;
  std::vector<uint16_t> x(H);
  for (int64_t c = 0; c < H; ++c) x[c] = f32_to_bf16(static_cast<float>(c - 64) * 0.37f);
  x[7] = 0x7f7f;  // largest finite bf16
  x[9] = 0xff7f;
  std::vector<uint8_t> q(H);
  std::vector<float> scales32(1);
  std::vector<uint8_t> scales8(1);
  const TensorView s = format == Fp8ScaleFormat::kF32 ? TensorView::contiguous(scales32.data(), DType::kF32, {1, 1})
                                                      : TensorView::contiguous(scales8.data(), DType::kUE8M0, {1, 1});
  ASSERT_TRUE(quantize_fp8(TensorView::contiguous(x.data(), DType::kBF16, {1, H}), format,
                           TensorView::contiguous(q.data(), DType::kFP8E4M3, {1, H}), s)
                  .is_ok());
  const float scale = format == Fp8ScaleFormat::kF32 ? scales32[0] : ue8m0_to_f32(scales8[0]);
  const float big = bf16_to_f32(0x7f7f);
  EXPECT_EQ(scale, format == Fp8ScaleFormat::kF32 ? big / 448.0f : 0x1p120f);
  EXPECT_EQ(e4m3_to_f32(q[7]), format == Fp8ScaleFormat::kF32 ? 448.0f : 256.0f);  // 255 * 2^120 -> 256 * 2^120
  // Back to bf16 it stays finite: saturated at the largest bf16.
  std::vector<uint16_t> back(H);
  ASSERT_TRUE(dequantize_fp8(TensorView::contiguous(q.data(), DType::kFP8E4M3, {1, H}), s,
                             TensorView::contiguous(back.data(), DType::kBF16, {1, H}))
                  .is_ok());
  EXPECT_EQ(back[7], format == Fp8ScaleFormat::kF32 ? f32_to_bf16(448.0f * scale) : 0x7f7f);
  EXPECT_EQ(back[9], back[7] | 0x8000);
  EXPECT_EQ(q[9], q[7] | 0x80);
  for (int64_t c = 0; c < H; ++c) EXPECT_EQ(q[c], reference_encode(bf16_to_f32(x[c]) / scale)) << c;
}

INSTANTIATE_TEST_SUITE_P(Formats, Fp8Quantize, ::testing::Values(Fp8ScaleFormat::kF32, Fp8ScaleFormat::kUE8M0),
                         [](const auto& info) { return std::string(scale_format_name(info.param)); });

TEST(Fp8Quantize, RejectsBadInputsWithoutWriting) {
  std::vector<float> x(2 * 128, 1.0f);
  std::vector<uint8_t> q(2 * 128, 0xaa);
  std::vector<float> s(2, -1.0f);
  const TensorView qv = TensorView::contiguous(q.data(), DType::kFP8E4M3, {2, 128});
  const TensorView sv = TensorView::contiguous(s.data(), DType::kF32, {2, 1});
  x[128 + 17] = std::numeric_limits<float>::infinity();
  Status st = quantize_fp8(TensorView::contiguous(x.data(), DType::kF32, {2, 128}), Fp8ScaleFormat::kF32, qv, sv);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("x[1][17] = inf"), std::string::npos) << st.to_string();
  x[128 + 17] = std::nanf("");
  st = quantize_fp8(TensorView::contiguous(x.data(), DType::kF32, {2, 128}), Fp8ScaleFormat::kF32, qv, sv);
  EXPECT_NE(st.message().find("x[1][17] = nan"), std::string::npos) << st.to_string();
  EXPECT_EQ(q[0], 0xaa);
  EXPECT_EQ(s[0], -1.0f);
  st = quantize_fp8(TensorView::contiguous(x.data(), DType::kF32, {4, 64}), Fp8ScaleFormat::kF32,
                    TensorView::contiguous(q.data(), DType::kFP8E4M3, {4, 64}),
                    TensorView::contiguous(s.data(), DType::kF32, {4, 1}));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("hidden = 64"), std::string::npos) << st.to_string();
  st = quantize_fp8(TensorView::contiguous(x.data(), DType::kF32, {2, 128}), Fp8ScaleFormat::kUE8M0, qv, sv);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << "f32 scales for a ue8m0 quantisation";
  EXPECT_TRUE(parse_scale_format("ue8m0").is_ok());
  EXPECT_FALSE(parse_scale_format("e8m0").is_ok());
}

}  // namespace
}  // namespace epx
