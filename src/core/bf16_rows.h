// Whole rows between f32 and bf16, vectorised (SIMD clones): the experts'
// GEMM operands, the layer's rounded weights, the exchange's widened rows.
#pragma once

#include <cstdint>

namespace epx::detail {

// f32 -> bf16, round to nearest even (NaN stays a quiet NaN), n elements.
void to_bf16(const float* in, int64_t n, uint16_t* out);
// bf16 -> f32 (exact), n elements.
void to_f32(const uint16_t* in, int64_t n, float* out);

}  // namespace epx::detail
