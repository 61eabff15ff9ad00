// Counter-based random numbers: a value is a pure function of (seed, stream,
// index), with no generator state, so initialisation and data never depend
// on how many ranks or threads produce them, or in which order. Different
// streams are independent sequences. Values are the same on every run with
// the same libm (normals use log and cos).
//
//   float w = epx::standard_normal(/*seed=*/1, /*stream=*/layer * 16 + 2, /*index=*/i) * std;
#pragma once

#include <cmath>
#include <cstdint>
#include <numbers>

namespace epx {

inline constexpr uint64_t kGoldenGamma = 0x9E3779B97F4A7C15ull;  // SplitMix64's increment

// SplitMix64's finalizer (Stafford's mix 13): a bijection with full avalanche.
[[nodiscard]] constexpr uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// (seed, stream) picks a SplitMix64 sequence; index is the step along it. The
// extra mix decorrelates sequences whose start points happen to be close.
[[nodiscard]] constexpr uint64_t random_bits(uint64_t seed, uint64_t stream, uint64_t index) {
  const uint64_t start = mix64(mix64(seed + kGoldenGamma) ^ (stream * 0xD1B54A32D192ED03ull + kGoldenGamma));
  return mix64(mix64(start + (index + 1) * kGoldenGamma));
}

// Uniform in [0, 1), 53 random bits.
[[nodiscard]] constexpr double unit_from_bits(uint64_t bits) { return static_cast<double>(bits >> 11) * 0x1.0p-53; }
[[nodiscard]] inline double uniform01(uint64_t seed, uint64_t stream, uint64_t index) {
  return unit_from_bits(random_bits(seed, stream, index));
}

// N(0, 1): Box-Muller on two independent 53-bit uniforms of one hash.
[[nodiscard]] inline double standard_normal(uint64_t seed, uint64_t stream, uint64_t index) {
  const uint64_t h = random_bits(seed, stream, index);
  const double u1 = 1.0 - unit_from_bits(h);  // (0, 1]: log is finite
  const double u2 = unit_from_bits(mix64(h ^ kGoldenGamma));
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

}  // namespace epx
