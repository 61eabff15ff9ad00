// fp8 e4m3 payloads with one scale per 128 channels of a row.
//
// e4m3 is OCP FP8 E4M3FN: 1 sign, 4 exponent (bias 7), 3 mantissa bits, no
// infinities, NaN = S.1111.111 only, subnormals m * 2^-9, largest finite 448.
// Encoding rounds to nearest, ties to even, and saturates: a finite value or
// an infinity beyond 448 becomes +-448; NaN stays NaN (0x7f, sign kept).
//
// quantize_fp8 splits each row into blocks of 128 channels, block scale
// s = amax / 448 (f32 scales) or the smallest power of two >= amax / 448
// (ue8m0 scales: no value saturates), and stores e4m3(x / s). Dequantized
// x' = e4m3_to_f32(q) * s satisfies, per element (derivation in docs/design.md),
//   |x' - x| <= 2^-4 |x| + 2^-10 s        (plus f32 rounding, below 2^-20 |x|)
// and, with bf16 output, one more bf16 rounding. A block of zeros gets scale 1
// and codes +-0 (sign kept); a block whose amax is below 448 * 2^-126 gets the
// smallest normal f32 scale 2^-126. Non-finite inputs are InvalidArgument.
//
//   std::vector<uint8_t> q(T * H); std::vector<float> s(T * H / 128);
//   EPX_RETURN_IF_ERROR(epx::quantize_fp8(x, epx::Fp8ScaleFormat::kF32,
//       TensorView::contiguous(q.data(), DType::kFP8E4M3, {T, H}),
//       TensorView::contiguous(s.data(), DType::kF32, {T, H / 128})));
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "epx/core/status.h"
#include "epx/core/tensor.h"

namespace epx {

inline constexpr int kFp8BlockSize = 128;   // channels per scale
inline constexpr float kE4M3Max = 448.0f;   // largest finite e4m3
inline constexpr float kFp8MinScale = 0x1p-126f;  // smallest scale used (smallest normal f32)

enum class Fp8ScaleFormat : uint8_t {
  kF32,    // scale = amax / 448, an f32 per block
  kUE8M0,  // scale = 2^(code - 127) >= amax / 448, one byte per block
};

// kF32 or kUE8M0: the DType of a scales array.
[[nodiscard]] DType scale_dtype(Fp8ScaleFormat format);
[[nodiscard]] std::string_view scale_format_name(Fp8ScaleFormat format);  // "f32" / "ue8m0"
// Accepts "f32", "fp32", "ue8m0".
[[nodiscard]] Result<Fp8ScaleFormat> parse_scale_format(std::string_view name);

// f32 -> e4m3 code for a value that is not NaN: round to nearest even,
// saturating to +-448. Branch-free, so loops over it vectorize.
[[nodiscard]] inline uint8_t f32_to_e4m3_not_nan(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint32_t sign = (bits >> 24) & 0x80u;
  // Beyond 448 (infinity included) saturates: clamp on the bits, which order
  // like the magnitudes.
  uint32_t a = bits & 0x7fffffffu;
  const uint32_t over = 0u - static_cast<uint32_t>(a > 0x43e00000u);  // all ones when saturating
  a = (a & ~over) | (0x43e00000u & over);
  // Normal (>= 2^-6): keep 3 mantissa bits, rounding to nearest even on the
  // f32 bits (a carry moves into the exponent), then rebias 127 -> 7.
  const uint32_t normal = ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
  // Subnormal (< 2^-6, codes m * 2^-9): adding 2^14 leaves an f32 whose last
  // mantissa bit is worth 2^-9, so the addition rounds to nearest even there;
  // the low bits are then m (8 = the smallest normal, code 0x08).
  constexpr uint32_t kMagic = 141u << 23;  // 2^14
  float magnitude, magic;
  std::memcpy(&magnitude, &a, sizeof(magnitude));
  std::memcpy(&magic, &kMagic, sizeof(magic));
  const float shifted = magnitude + magic;
  uint32_t sub;
  std::memcpy(&sub, &shifted, sizeof(sub));
  const uint32_t small = 0u - static_cast<uint32_t>(a < (121u << 23));  // masks instead of branches
  const uint32_t code = ((sub - kMagic) & small) | (normal & ~small);
  return static_cast<uint8_t>(sign | code);
}

// f32 -> e4m3 code: round to nearest even, saturating to +-448 (see above);
// NaN -> NaN of the same sign.
[[nodiscard]] inline uint8_t f32_to_e4m3(float value) {
  if (value != value) return std::signbit(value) ? 0xff : 0x7f;
  return f32_to_e4m3_not_nan(value);
}

// e4m3 code -> f32 (exact; 0x7f and 0xff are NaN).
[[nodiscard]] float e4m3_to_f32(uint8_t code);

// The smallest power of two >= scale as a ue8m0 code (scale > 0 and finite;
// codes 0..254 are 2^-127..2^127; 255 is NaN).
[[nodiscard]] inline uint8_t f32_to_ue8m0_ceil(float scale) {
  uint32_t bits;
  std::memcpy(&bits, &scale, sizeof(bits));
  const uint32_t exponent = (bits >> 23) & 0xffu;
  const uint32_t mantissa = bits & 0x7fffffu;
  if (exponent == 0) return mantissa > 0x400000u ? 1 : 0;  // f32 subnormal: 2^-126 or 2^-127
  return static_cast<uint8_t>(exponent + (mantissa != 0 ? 1u : 0u));
}

[[nodiscard]] inline float ue8m0_to_f32(uint8_t code) {
  if (code == 0) return 0x1p-127f;
  if (code == 0xff) return __builtin_nanf("");
  const uint32_t bits = static_cast<uint32_t>(code) << 23;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Quantizes x [rows, H] (f32 or bf16, H a multiple of 128) into
// q [rows, H] e4m3 and scales [rows, H / 128] of scale_dtype(format). All
// three may have any row stride (column stride 1), so q and scales can be
// interleaved in one row. Checked first, nothing written on an error:
// shapes, dtypes, host memory, H, and that x is finite (x[t][c] named).
[[nodiscard]] Status quantize_fp8(const TensorView& x, Fp8ScaleFormat format, const TensorView& q,
                                  const TensorView& scales);
// out [rows, H] (f32 or bf16) = e4m3_to_f32(q) * scale of its block,
// saturated at the largest finite value of out's dtype (a block whose amax is
// near it may round up past it); bf16 rounds once, to nearest even. The scale
// format is scales.dtype() (kF32 or kUE8M0).
[[nodiscard]] Status dequantize_fp8(const TensorView& q, const TensorView& scales, const TensorView& out);

}  // namespace epx
