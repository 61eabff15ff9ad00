// exp for vectorized loops: the one polynomial the router's scores and the
// experts' SwiGLU share.
#pragma once

#include <cstdint>
#include <cstring>

namespace epx::detail {

// exp(c) for c in [-87.3, 88.7] (the caller clamps), written so that loops
// calling it vectorize: c = k ln2 + r with |r| <= ln2 / 2 (Cody-Waite split
// of ln2), exp(r) by its Taylor series to r^7 / 7! (truncation below 6e-9
// relative, so within about 2 ulp of the correctly rounded value), times 2^k
// built from the exponent bits. No FMA, no reassociation: every SIMD clone
// gives the same bits.
[[gnu::always_inline]] inline float exp_in_range(float c) {
  const float k = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = (c - k * 0.693145751953125f) - k * 1.428606765330187e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace epx::detail
