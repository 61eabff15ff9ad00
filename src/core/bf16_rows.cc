#include "core/bf16_rows.h"

#include <cstring>

#include "core/simd_clones.h"

namespace epx::detail {
namespace {

EPX_SIMD_CLONES void to_bf16_impl(const float* in, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &in[i], sizeof(bits));
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    // NaN stays a quiet NaN, as f32_to_bf16 does.
    out[i] = (bits & 0x7fffffffu) > 0x7f800000u ? static_cast<uint16_t>((bits >> 16) | 0x0040u)
                                                 : static_cast<uint16_t>(rounded);
  }
}

EPX_SIMD_CLONES void to_f32_impl(const uint16_t* in, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(in[i]) << 16;
    std::memcpy(&out[i], &bits, sizeof(bits));
  }
}

}  // namespace

void to_bf16(const float* in, int64_t n, uint16_t* out) { to_bf16_impl(in, n, out); }
void to_f32(const uint16_t* in, int64_t n, float* out) { to_f32_impl(in, n, out); }

}  // namespace epx::detail
