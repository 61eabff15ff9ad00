#include "epx/core/fp8.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <vector>


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

// A block's scale and its code (ue8m0) from its amax.
struct BlockScale {
  float scale = 1.0f;  // a block of zeros
  uint8_t code = 127;  // 2^0
};

BlockScale block_scale(float amax, Fp8ScaleFormat format) {
  BlockScale s;
  if (amax == 0.0f) return s;
  s.scale = std::max(amax / kE4M3Max, kFp8MinScale);
  if (format == Fp8ScaleFormat::kUE8M0) {
    s.code = f32_to_ue8m0_ceil(s.scale);
    s.scale = ue8m0_to_f32(s.code);
  }
  return s;
}

// The row loops below come in AVX-512, AVX2 and baseline versions, picked at
// load time (as core/simd_clones.h's EPX_SIMD_CLONES); they divide and add in
// IEEE f32 without FMA, so all give the same bits. Their AVX-512 version is
// x86-64-v4 (AVX-512 F, BW, VL, DQ), not avx512f alone: they narrow and widen
// between 8-, 16- and 32-bit lanes, which without BW/VL the compiler did in
// 256-bit registers with spills, several times slower.
#if defined(__SANITIZE_THREAD__)
#define EPX_FP8_CLONES
#else
#define EPX_FP8_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#endif

// Largest |x| of n elements as f32 bits (finite values order like their
// bits; anything at or above 0x7f800000 is an infinity or a NaN).
EPX_FP8_CLONES uint32_t amax_bits_f32(const uint32_t* x, int n) {
  uint32_t m = 0;
  for (int c = 0; c < n; ++c) m = std::max(m, x[c] & 0x7fffffffu);
  return m;
}
EPX_FP8_CLONES uint32_t amax_bits_bf16(const uint16_t* x, int n) {
  uint32_t m = 0;
  for (int c = 0; c < n; ++c) m = std::max(m, static_cast<uint32_t>(x[c] & 0x7fffu));
  return m << 16;
}

EPX_FP8_CLONES void encode_f32(const float* x, float scale, uint8_t* q, int n) {
  for (int c = 0; c < n; ++c) q[c] = f32_to_e4m3_not_nan(x[c] / scale);
}
EPX_FP8_CLONES void encode_bf16(const uint16_t* x, float scale, uint8_t* q, int n) {
  for (int c = 0; c < n; ++c) q[c] = f32_to_e4m3_not_nan(bf16_to_f32(x[c]) / scale);
}

// e4m3 code -> f32 by arithmetic, the table's bits: the code's exponent and
// mantissa placed in an f32's (bits 30..20) read as a number are its value
// times 2^-120 (subnormal codes land on f32 subnormals m * 2^-129, exactly),
// so one exact multiply rebiases; 0x7f / 0xff are NaN as in the table.
inline float e4m3_to_f32_bits(uint32_t code) {
  const uint32_t magnitude = (code & 0x7fu) << 20;
  float v;
  std::memcpy(&v, &magnitude, sizeof(v));
  v *= 0x1p120f;
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint32_t nan = 0u - static_cast<uint32_t>((code & 0x7fu) == 0x7fu);  // quiet NaN; the sign is set below
  bits = (bits & ~nan) | (0x7fc00000u & nan);
  bits |= (code & 0x80u) << 24;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

// clamp(e4m3(q) * scale, -limit, limit), keeping NaN (std::clamp's result),
// on the bits (magnitudes order like their bits), so the loops below vectorise.
inline float decode_one(uint8_t q, float scale, uint32_t limit_bits) {
  const float v = e4m3_to_f32_bits(q) * scale;
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint32_t a = bits & 0x7fffffffu;
  // All ones to saturate: beyond the limit, infinities included, NaN not.
  const uint32_t over = 0u - (static_cast<uint32_t>(a > limit_bits) & static_cast<uint32_t>(a <= 0x7f800000u));
  bits = (bits & ~over) | (((bits & 0x80000000u) | limit_bits) & over);
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// f32_to_bf16 (epx/core/dtype.h) without its branch.
inline uint16_t to_bf16_select(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint32_t nan = (bits >> 16) | 0x0040u;
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

// out = decode_one of each code, in f32 or rounded to bf16.
EPX_FP8_CLONES void decode_f32(const uint8_t* q, float scale, uint32_t limit_bits, float* out, int n) {
  for (int c = 0; c < n; ++c) out[c] = decode_one(q[c], scale, limit_bits);
}
EPX_FP8_CLONES void decode_bf16(const uint8_t* q, float scale, uint32_t limit_bits, uint16_t* out, int n) {
  for (int c = 0; c < n; ++c) out[c] = to_bf16_select(decode_one(q[c], scale, limit_bits));
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
  // Pass 1: every block's amax, which also finds non-finite values, so
  // nothing is written on an error.
  thread_local std::vector<uint32_t> amax;
  amax.resize(static_cast<std::size_t>(rows * blocks));
  const bool f32 = x.dtype() == DType::kF32;
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t first = b * kFp8BlockSize;
      const uint32_t m = f32 ? amax_bits_f32(x.row<uint32_t>(t) + first, kFp8BlockSize)
                             : amax_bits_bf16(x.row<uint16_t>(t) + first, kFp8BlockSize);
      amax[t * blocks + b] = m;
      if (m < 0x7f800000u) continue;
      for (int64_t c = first; c < first + kFp8BlockSize; ++c) {
        const float v = load_as_f32(x.row<std::byte>(t), x.dtype(), static_cast<std::size_t>(c));
        if (!std::isfinite(v))
          return invalid_argument("x[{}][{}] = {} is not finite; fp8 quantisation needs finite values", t, c, v);
      }
    }
  }
  // Pass 2: scales and codes.
  for (int64_t t = 0; t < rows; ++t) {
    auto* q_row = q.row<uint8_t>(t);
    for (int64_t b = 0; b < blocks; ++b) {
      float block_amax;
      std::memcpy(&block_amax, &amax[t * blocks + b], sizeof(block_amax));
      const BlockScale s = block_scale(block_amax, format);
      if (format == Fp8ScaleFormat::kF32)
        scales.row<float>(t)[b] = s.scale;
      else
        scales.row<uint8_t>(t)[b] = s.code;
      const int64_t first = b * kFp8BlockSize;
      if (f32)
        encode_f32(x.row<float>(t) + first, s.scale, q_row + first, kFp8BlockSize);
      else
        encode_bf16(x.row<uint16_t>(t) + first, s.scale, q_row + first, kFp8BlockSize);
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
  // Saturate at the largest finite output: x near FLT_MAX may round up to 2^128.
  const uint32_t limit_bits = out.dtype() == DType::kF32 ? 0x7f7fffffu : 0x7f7f0000u;  // FLT_MAX, largest bf16
  for (int64_t t = 0; t < rows; ++t) {
    const auto* q_row = q.row<uint8_t>(t);
    std::byte* out_row = out.row<std::byte>(t);
    for (int64_t b = 0; b < blocks; ++b) {
      const float scale = format == Fp8ScaleFormat::kF32 ? scales.row<float>(t)[b] : ue8m0_to_f32(scales.row<uint8_t>(t)[b]);
      const int64_t first = b * kFp8BlockSize;
      if (out.dtype() == DType::kF32)
        decode_f32(q_row + first, scale, limit_bits, reinterpret_cast<float*>(out_row) + first, kFp8BlockSize);
      else
        decode_bf16(q_row + first, scale, limit_bits, reinterpret_cast<uint16_t*>(out_row) + first, kFp8BlockSize);
    }
  }
  return Status::ok();
}

}  // namespace epx
