// Element types of payloads and their conversions.
//
// f32 and bf16 payloads; fp8 e4m3 payloads with per-128-channel scales, f32
// or ue8m0 (power-of-two), whose conversions live in epx/core/fp8.h.
//
//   uint16_t b = epx::f32_to_bf16(1.0f / 3.0f);   // round to nearest even
//   float f = epx::bf16_to_f32(b);                 // 0.333984375
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>

#include "epx/core/status.h"

namespace epx {

enum class DType : uint8_t {
  kF32,
  kBF16,
  kFP8E4M3,  // fp8 e4m3 (OCP E4M3FN) payloads, scaled per 128 channels (epx/core/fp8.h)
  kUE8M0,    // power-of-two scale factors 2^(code - 127)
  kI32,
  kI64,
  kF64,
};

// The DType of a C++ element type.
template <typename T>
constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::kF32; }
template <> constexpr DType dtype_of<double>() { return DType::kF64; }
template <> constexpr DType dtype_of<int32_t>() { return DType::kI32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::kI64; }

[[nodiscard]] std::size_t dtype_size(DType dtype);
[[nodiscard]] std::string_view dtype_name(DType dtype);
// Accepts "f32", "fp32", "float32", "bf16", "bfloat16", "fp8", "e4m3", "i32", "i64", "f64".
[[nodiscard]] Result<DType> parse_dtype(std::string_view name);

// IEEE binary32 -> bfloat16 bits, round to nearest, ties to even. NaN stays a
// (quiet) NaN; overflow rounds to infinity as IEEE rounding says.
[[nodiscard]] inline uint16_t f32_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

[[nodiscard]] inline float bf16_to_f32(uint16_t value) {
  const uint32_t bits = static_cast<uint32_t>(value) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Reads element i of a row of f32 or bf16 as float.
[[nodiscard]] inline float load_as_f32(const void* row, DType dtype, std::size_t i) {
  if (dtype == DType::kBF16) return bf16_to_f32(static_cast<const uint16_t*>(row)[i]);
  return static_cast<const float*>(row)[i];
}

// Writes `value` as element i of a row of f32 or bf16 (bf16: round to nearest even).
inline void store_from_f32(void* row, DType dtype, std::size_t i, float value) {
  if (dtype == DType::kBF16) {
    static_cast<uint16_t*>(row)[i] = f32_to_bf16(value);
  } else {
    static_cast<float*>(row)[i] = value;
  }
}

}  // namespace epx
