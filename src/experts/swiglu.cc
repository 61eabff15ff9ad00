#include "experts/swiglu.h"

#include <algorithm>
#include <cstring>

namespace epx::detail {
namespace {

#define EPX_EXPERTS_SIMD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

// sigmoid(z) = 1 / (1 + exp(-z)), vectorizable: exp(v) = 2^k exp(r) with
// v = k ln2 + r, |r| <= ln2 / 2 (Cody-Waite), exp(r) by its Taylor series to
// r^7 / 7! (a few ulp). v is clamped to [-87, 88]: for z above 87 the
// result is 1 - 2^-126 rounded, i.e. 1; for z below -88 it is below 1e-38.
inline float sigmoid(float z) {
  const float v = std::min(std::max(-z, -87.0f), 88.0f);
  const float k = (v * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = (v - k * 0.693145751953125f) - k * 1.428606765330187e-06f;
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
  return 1.0f / (1.0f + p * scale);
}

EPX_EXPERTS_SIMD_CLONES void forward_f32(const float* h1, const float* h3, int64_t n, float* a) {
  for (int64_t i = 0; i < n; ++i) a[i] = h1[i] * sigmoid(h1[i]) * h3[i];
}

// d silu(z) / dz = s (1 + z (1 - s)) with s = sigmoid(z).
EPX_EXPERTS_SIMD_CLONES void backward_f32(const float* h1, const float* h3, const float* grad_a, int64_t n, float* a,
                                          float* grad_h1, float* grad_h3) {
  for (int64_t i = 0; i < n; ++i) {
    const float z = h1[i];
    const float s = sigmoid(z);
    const float silu = z * s;
    const float g = grad_a[i];
    a[i] = silu * h3[i];
    grad_h3[i] = g * silu;
    grad_h1[i] = g * h3[i] * (s * (1.0f + z * (1.0f - s)));
  }
}

EPX_EXPERTS_SIMD_CLONES void to_bf16_impl(const float* in, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &in[i], sizeof(bits));
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    // NaN stays a quiet NaN, as f32_to_bf16 does.
    out[i] = (bits & 0x7fffffffu) > 0x7f800000u ? static_cast<uint16_t>((bits >> 16) | 0x0040u)
                                                 : static_cast<uint16_t>(rounded);
  }
}

// Chunks that stay in L1/L2 between the f32 pass and the bf16 rounding.
constexpr int64_t kChunk = 4096;

}  // namespace

void to_bf16(const float* in, int64_t n, uint16_t* out) { to_bf16_impl(in, n, out); }

void swiglu_forward(const float* h1, const float* h3, int64_t n, DType dtype, void* a) {
  if (dtype != DType::kBF16) {
    forward_f32(h1, h3, n, static_cast<float*>(a));
    return;
  }
  float tmp[kChunk];
  for (int64_t i = 0; i < n; i += kChunk) {
    const int64_t len = std::min(kChunk, n - i);
    forward_f32(h1 + i, h3 + i, len, tmp);
    to_bf16_impl(tmp, len, static_cast<uint16_t*>(a) + i);
  }
}

void swiglu_backward(const float* h1, const float* h3, const float* grad_a, int64_t n, DType dtype, void* a,
                     void* grad_h1, void* grad_h3) {
  if (dtype != DType::kBF16) {
    backward_f32(h1, h3, grad_a, n, static_cast<float*>(a), static_cast<float*>(grad_h1),
                 static_cast<float*>(grad_h3));
    return;
  }
  float a32[kChunk], g1[kChunk], g3[kChunk];
  for (int64_t i = 0; i < n; i += kChunk) {
    const int64_t len = std::min(kChunk, n - i);
    backward_f32(h1 + i, h3 + i, grad_a + i, len, a32, g1, g3);
    to_bf16_impl(a32, len, static_cast<uint16_t*>(a) + i);
    to_bf16_impl(g1, len, static_cast<uint16_t*>(grad_h1) + i);
    to_bf16_impl(g3, len, static_cast<uint16_t*>(grad_h3) + i);
  }
}

}  // namespace epx::detail
