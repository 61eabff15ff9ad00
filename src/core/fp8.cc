#include "epx/core/fp8.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

namespace epx {
namespace {

// The 256 e4m3 values, from the format's definition.
std::array<float, 256> make_e4m3_table() {
  std::array<float, 256> table{};
  for (int code = 0; code < 256; ++code) {
    const int exponent = (code >> 3) & 0xf;
    const int mantissa = code & 0x7;
    float magnitude;
    if (exponent == 0xf && mantissa == 0x7)
      magnitude = std::numeric_limits<float>::quiet_NaN();
    else if (exponent == 0)
      magnitude = std::ldexp(static_cast<float>(mantissa), -9);
    else
      magnitude = std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
    table[code] = (code & 0x80) ? -magnitude : magnitude;
  }
  return table;
}

const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = make_e4m3_table();
  return table;
}

Status check_hidden(const TensorView& view, std::string_view name) {
  if (view.ndim() != 2) return invalid_argument("{} must be 2-D [rows, hidden], got {}", name, view.describe());
  if (view.size(1) % kFp8BlockSize != 0)
    return invalid_argument("{} has hidden = {}, which is not a multiple of the fp8 block size {}", name, view.size(1),
                            kFp8BlockSize);
  if (view.dtype() != DType::kF32 && view.dtype() != DType::kBF16)
    return invalid_argument("{} must be f32 or bf16, got {}", name, view.describe());
  return Status::ok();
}

Result<Fp8ScaleFormat> format_of(DType dtype) {
  if (dtype == DType::kF32) return Fp8ScaleFormat::kF32;
  if (dtype == DType::kUE8M0) return Fp8ScaleFormat::kUE8M0;
  return invalid_argument("fp8 scales must be f32 or ue8m0, got {}", dtype_name(dtype));
}

// One block: its scale from amax, then the codes.
template <Fp8ScaleFormat kFormat>
void quantize_block(const float* x, uint8_t* q, std::byte* scale_out, float amax) {
  float scale = 1.0f;  // a block of zeros
  uint8_t code = 127;  // 2^0
  if (amax != 0.0f) {
    scale = std::max(amax / kE4M3Max, kFp8MinScale);
    if constexpr (kFormat == Fp8ScaleFormat::kUE8M0) {
      code = f32_to_ue8m0_ceil(scale);
      scale = ue8m0_to_f32(code);
    }
  }
  if constexpr (kFormat == Fp8ScaleFormat::kF32)
    std::memcpy(scale_out, &scale, sizeof(scale));
  else
    *reinterpret_cast<uint8_t*>(scale_out) = code;
  for (int c = 0; c < kFp8BlockSize; ++c) q[c] = f32_to_e4m3(x[c] / scale);
}

// The first non-finite element of row t, or -1.
int64_t first_non_finite(const TensorView& x, int64_t t) {
  const int64_t H = x.size(1);
  bool bad = false;
  if (x.dtype() == DType::kF32) {
    const auto* row = x.row<uint32_t>(t);
    for (int64_t c = 0; c < H; ++c) bad |= (row[c] & 0x7f800000u) == 0x7f800000u;
  } else {
    const auto* row = x.row<uint16_t>(t);
    for (int64_t c = 0; c < H; ++c) bad |= (row[c] & 0x7f80u) == 0x7f80u;
  }
  if (!bad) return -1;
  for (int64_t c = 0; c < H; ++c)
    if (!std::isfinite(load_as_f32(x.row<std::byte>(t), x.dtype(), static_cast<std::size_t>(c)))) return c;
  return -1;
}

}  // namespace

float e4m3_to_f32(uint8_t code) { return e4m3_table()[code]; }

DType scale_dtype(Fp8ScaleFormat format) { return format == Fp8ScaleFormat::kF32 ? DType::kF32 : DType::kUE8M0; }

std::string_view scale_format_name(Fp8ScaleFormat format) {
  return format == Fp8ScaleFormat::kF32 ? "f32" : "ue8m0";
}

Result<Fp8ScaleFormat> parse_scale_format(std::string_view name) {
  if (name == "f32" || name == "fp32") return Fp8ScaleFormat::kF32;
  if (name == "ue8m0") return Fp8ScaleFormat::kUE8M0;
  return invalid_argument("fp8 scale format '{}' is not one of f32, ue8m0", name);
}

Status quantize_fp8(const TensorView& x, Fp8ScaleFormat format, const TensorView& q, const TensorView& scales) {
  EPX_RETURN_IF_ERROR(check_hidden(x, "x"));
  const int64_t rows = x.size(0), H = x.size(1), blocks = H / kFp8BlockSize;
  EPX_RETURN_IF_ERROR(check_matrix(x, "x", x.dtype(), rows, H));
  EPX_RETURN_IF_ERROR(check_matrix(q, "q", DType::kFP8E4M3, rows, H));
  EPX_RETURN_IF_ERROR(check_matrix(scales, "scales", scale_dtype(format), rows, blocks));
  // Finite first, so nothing is written on an error.
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t c = first_non_finite(x, t);
    if (c >= 0)
      return invalid_argument("x[{}][{}] = {} is not finite; fp8 quantisation needs finite values", t, c,
                              load_as_f32(x.row<std::byte>(t), x.dtype(), static_cast<std::size_t>(c)));
  }
  const std::size_t scale_size = dtype_size(scale_dtype(format));
  float block[kFp8BlockSize];
  for (int64_t t = 0; t < rows; ++t) {
    const std::byte* row = x.row<std::byte>(t);
    auto* q_row = q.row<uint8_t>(t);
    auto* s_row = scales.row<std::byte>(t);
    for (int64_t b = 0; b < blocks; ++b) {
      float amax = 0.0f;
      if (x.dtype() == DType::kF32) {
        std::memcpy(block, row + b * kFp8BlockSize * 4, sizeof(block));
      } else {
        const auto* src = reinterpret_cast<const uint16_t*>(row) + b * kFp8BlockSize;
        for (int c = 0; c < kFp8BlockSize; ++c) block[c] = bf16_to_f32(src[c]);
      }
      for (int c = 0; c < kFp8BlockSize; ++c) amax = std::max(amax, std::fabs(block[c]));
      if (format == Fp8ScaleFormat::kF32)
        quantize_block<Fp8ScaleFormat::kF32>(block, q_row + b * kFp8BlockSize, s_row + b * scale_size, amax);
      else
        quantize_block<Fp8ScaleFormat::kUE8M0>(block, q_row + b * kFp8BlockSize, s_row + b * scale_size, amax);
    }
  }
  return Status::ok();
}

Status dequantize_fp8(const TensorView& q, const TensorView& scales, const TensorView& out) {
  EPX_RETURN_IF_ERROR(check_hidden(out, "out"));
  const int64_t rows = out.size(0), H = out.size(1), blocks = H / kFp8BlockSize;
  EPX_RETURN_IF_ERROR(check_matrix(out, "out", out.dtype(), rows, H));
  EPX_RETURN_IF_ERROR(check_matrix(q, "q", DType::kFP8E4M3, rows, H));
  EPX_ASSIGN_OR_RETURN(const Fp8ScaleFormat format, format_of(scales.dtype()));
  EPX_RETURN_IF_ERROR(check_matrix(scales, "scales", scale_dtype(format), rows, blocks));
  const std::array<float, 256>& table = e4m3_table();
  // Saturate at the largest finite output: x near FLT_MAX may round up to 2^128.
  const float limit = out.dtype() == DType::kF32 ? std::numeric_limits<float>::max() : bf16_to_f32(0x7f7f);
  for (int64_t t = 0; t < rows; ++t) {
    const auto* q_row = q.row<uint8_t>(t);
    std::byte* out_row = out.row<std::byte>(t);
    for (int64_t b = 0; b < blocks; ++b) {
      const float scale = format == Fp8ScaleFormat::kF32 ? scales.row<float>(t)[b] : ue8m0_to_f32(scales.row<uint8_t>(t)[b]);
      for (int64_t c = b * kFp8BlockSize; c < (b + 1) * kFp8BlockSize; ++c)
        store_from_f32(out_row, out.dtype(), static_cast<std::size_t>(c),
                       std::clamp(table[q_row[c]] * scale, -limit, limit));
    }
  }
  return Status::ok();
}

}  // namespace epx
