// Private: the combine's row sums in registers, a block of columns at a time.
//
// The slice functions of row_kernels.h make one pass over an L1 accumulator
// per row (or per two or four rows); a sum of many rows read from memory then spends its time on
// those passes and on rows read a slice at a time in turn. The block
// functions here instead read every row of a sum in one pass, side by side,
// 64 columns at a time, and keep the partial sums in registers, with the
// additions in the slice functions' order, so the bits are theirs. Lanes is
// 16 floats: one AVX-512 register, two AVX2 or four SSE ones, as the
// EPX_SIMD_CLONES caller is compiled; every helper is inlined into it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "epx/core/dtype.h"

namespace epx::detail::lanes {

using Lanes = float __attribute__((vector_size(64)));
using Halves = uint16_t __attribute__((vector_size(32)));
using Words = uint32_t __attribute__((vector_size(64)));

inline constexpr int kLanes = 16;
inline constexpr int kWide = 4;                  // registers per block
inline constexpr int kBlock = kLanes * kWide;    // columns per block

// Lanes [c, c + 16) of a row of `dtype` (f32, or bf16 widened exactly).
[[gnu::always_inline]] inline void load(Lanes* out, const std::byte* row, DType dtype, int c) {
  if (dtype == DType::kBF16) {
    Halves h;
    std::memcpy(&h, row + static_cast<std::size_t>(c) * sizeof(uint16_t), sizeof h);
    const Words bits = __builtin_convertvector(h, Words) << 16;
    std::memcpy(out, &bits, sizeof bits);
  } else {
    std::memcpy(out, row + static_cast<std::size_t>(c) * sizeof(float), sizeof(Lanes));
  }
}

// Columns [c, c + kBlock) of a row.
[[gnu::always_inline]] inline void load_block(Lanes* out, const std::byte* row, DType dtype, int c) {
  for (int j = 0; j < kWide; ++j) load(&out[j], row, dtype, c + j * kLanes);
}

[[gnu::always_inline]] inline void zero_block(Lanes* t) {
  for (int j = 0; j < kWide; ++j) t[j] = Lanes{};
}

// t = 0 + x when !started, else t + x: add_rows' two passes (0 + keeps the
// sign of zero that a zeroed accumulator gives).
[[gnu::always_inline]] inline void add_block(Lanes* t, const Lanes* x, bool started) {
  for (int j = 0; j < kWide; ++j) t[j] = (started ? t[j] : Lanes{}) + x[j];
}

// t = t + w * (columns [c, c + kBlock) of row): one weighted pass.
[[gnu::always_inline]] inline void add_weighted_block(Lanes* t, float w, const std::byte* row, DType dtype, int c) {
  const Lanes wide_w = Lanes{} + w;
  for (int j = 0; j < kWide; ++j) {
    Lanes x;
    load(&x, row, dtype, c + j * kLanes);
    t[j] = t[j] + wide_w * x;
  }
}

// p = 0 + w_0 * r_0 + w_1 * r_1 + ... on columns [c, c + kBlock) (zeros
// for no rows): weighted_slice's order.
[[gnu::always_inline]] inline void weighted_block(Lanes* p, const std::byte* const* rows, const float* weights,
                                                  int num_rows, DType dtype, int c) {
  zero_block(p);
  for (int r = 0; r < num_rows; ++r) add_weighted_block(p, weights[r], rows[r], dtype, c);
}

[[gnu::always_inline]] inline void store_block(float* acc, const Lanes* t) { std::memcpy(acc, t, sizeof(Lanes) * kWide); }

}  // namespace epx::detail::lanes
