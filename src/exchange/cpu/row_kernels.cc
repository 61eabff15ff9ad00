#include "exchange/cpu/row_kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "core/bf16_rows.h"
#include "core/simd_clones.h"
#include "exchange/cpu/row_lanes.h"

namespace epx::detail {
namespace {

EPX_SIMD_CLONES void add_f32(float* acc, const float* src, int n) {
  for (int c = 0; c < n; ++c) acc[c] += src[c];
}

EPX_SIMD_CLONES void add_bf16(float* acc, const uint16_t* src, int n) {
  for (int c = 0; c < n; ++c) acc[c] += bf16_to_f32(src[c]);
}

// Two rows per pass: acc = (acc + a) + b, the same order as two passes.
EPX_SIMD_CLONES void add2_f32(float* acc, const float* a, const float* b, int n) {
  for (int c = 0; c < n; ++c) acc[c] = (acc[c] + a[c]) + b[c];
}

EPX_SIMD_CLONES void add2_bf16(float* acc, const uint16_t* a, const uint16_t* b, int n) {
  for (int c = 0; c < n; ++c) acc[c] = (acc[c] + bf16_to_f32(a[c])) + bf16_to_f32(b[c]);
}

// The first rows of a sum, without zeroing the accumulator first: acc = 0 + a
// and acc = (0 + a) + b, the same bits as a zeroed acc and one or two passes
// (0 + keeps the sign of zero that the zeroed acc gives).
EPX_SIMD_CLONES void start_f32(float* acc, const float* a, int n) {
  for (int c = 0; c < n; ++c) acc[c] = 0.0f + a[c];
}

EPX_SIMD_CLONES void start_bf16(float* acc, const uint16_t* a, int n) {
  for (int c = 0; c < n; ++c) acc[c] = 0.0f + bf16_to_f32(a[c]);
}

EPX_SIMD_CLONES void start2_f32(float* acc, const float* a, const float* b, int n) {
  for (int c = 0; c < n; ++c) acc[c] = (0.0f + a[c]) + b[c];
}

EPX_SIMD_CLONES void start2_bf16(float* acc, const uint16_t* a, const uint16_t* b, int n) {
  for (int c = 0; c < n; ++c) acc[c] = (0.0f + bf16_to_f32(a[c])) + bf16_to_f32(b[c]);
}


inline float widen(float v) { return v; }
inline float widen(uint16_t v) { return bf16_to_f32(v); }

EPX_SIMD_CLONES void add_weighted_f32(float* acc, float w, const float* src, int n) {
  for (int c = 0; c < n; ++c) acc[c] += w * src[c];
}

EPX_SIMD_CLONES void add_weighted_bf16(float* acc, float w, const uint16_t* src, int n) {
  for (int c = 0; c < n; ++c) acc[c] += w * bf16_to_f32(src[c]);
}

// acc = 0 + w * src: the first row of a weighted partial (0 + keeps the
// sign of zero that a zeroed accumulator gives).
EPX_SIMD_CLONES void first_weighted_f32(float* acc, float w, const float* src, int n) {
  for (int c = 0; c < n; ++c) acc[c] = 0.0f + w * src[c];
}

EPX_SIMD_CLONES void first_weighted_bf16(float* acc, float w, const uint16_t* src, int n) {
  for (int c = 0; c < n; ++c) acc[c] = 0.0f + w * bf16_to_f32(src[c]);
}

// Two rows per pass: acc = (acc + wa * a) + wb * b, the same order as two passes.
EPX_SIMD_CLONES void add2_weighted_f32(float* acc, float wa, const float* a, float wb, const float* b, int n) {
  for (int c = 0; c < n; ++c) acc[c] = (acc[c] + wa * a[c]) + wb * b[c];
}

EPX_SIMD_CLONES void add2_weighted_bf16(float* acc, float wa, const uint16_t* a, float wb, const uint16_t* b, int n) {
  for (int c = 0; c < n; ++c) acc[c] = (acc[c] + wa * bf16_to_f32(a[c])) + wb * bf16_to_f32(b[c]);
}

// Four rows per pass: acc = (((acc + w0 * r0) + w1 * r1) + w2 * r2) + w3 * r3,
// or the same from 0 (`from_zero`): the order of four single passes. One
// body for both row types, inlined into each type's clones (target_clones
// cannot multiversion a template under clang).
template <typename T>
[[gnu::always_inline]] inline void add4_weighted(float* acc, bool from_zero, const float* w, const T* r0, const T* r1,
                                                 const T* r2, const T* r3, int n) {
  const float w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
  if (from_zero)
    for (int c = 0; c < n; ++c)
      acc[c] = (((0.0f + w0 * widen(r0[c])) + w1 * widen(r1[c])) + w2 * widen(r2[c])) + w3 * widen(r3[c]);
  else
    for (int c = 0; c < n; ++c)
      acc[c] = (((acc[c] + w0 * widen(r0[c])) + w1 * widen(r1[c])) + w2 * widen(r2[c])) + w3 * widen(r3[c]);
}

EPX_SIMD_CLONES void add4_weighted_bf16(float* acc, bool from_zero, const float* w, const uint16_t* const* r, int n) {
  add4_weighted(acc, from_zero, w, r[0], r[1], r[2], r[3], n);
}

EPX_SIMD_CLONES void add4_weighted_f32(float* acc, bool from_zero, const float* w, const float* const* r, int n) {
  add4_weighted(acc, from_zero, w, r[0], r[1], r[2], r[3], n);
}

void accumulate4_weighted(float* acc, bool from_zero, const float* w, const std::byte* const* rows, std::size_t offset,
                          DType dtype, int n) {
  if (dtype == DType::kBF16) {
    const uint16_t* r[4];
    for (int i = 0; i < 4; ++i) r[i] = reinterpret_cast<const uint16_t*>(rows[i] + offset);
    add4_weighted_bf16(acc, from_zero, w, r, n);
  } else {
    const float* r[4];
    for (int i = 0; i < 4; ++i) r[i] = reinterpret_cast<const float*>(rows[i] + offset);
    add4_weighted_f32(acc, from_zero, w, r, n);
  }
}

void first_weighted(float* acc, float w, const std::byte* src, DType dtype, int n) {
  if (dtype == DType::kBF16)
    first_weighted_bf16(acc, w, reinterpret_cast<const uint16_t*>(src), n);
  else
    first_weighted_f32(acc, w, reinterpret_cast<const float*>(src), n);
}

void accumulate2_weighted(float* acc, float wa, const std::byte* a, float wb, const std::byte* b, DType dtype, int n) {
  if (dtype == DType::kBF16)
    add2_weighted_bf16(acc, wa, reinterpret_cast<const uint16_t*>(a), wb, reinterpret_cast<const uint16_t*>(b), n);
  else
    add2_weighted_f32(acc, wa, reinterpret_cast<const float*>(a), wb, reinterpret_cast<const float*>(b), n);
}

EPX_SIMD_CLONES void store_bf16(uint16_t* dst, const float* acc, int n) {
  for (int c = 0; c < n; ++c) dst[c] = f32_to_bf16(acc[c]);
}

// Four jobs' serial sums side by side over columns [0, n) of f32 rows,
// carried in s (a job may repeat; its sum is the same).
void dots4(const float* const* g, const float* const* y, int n, float* s) {
  float s0 = s[0], s1 = s[1], s2 = s[2], s3 = s[3];
  for (int c = 0; c < n; ++c) {
    s0 += g[0][c] * y[0][c];
    s1 += g[1][c] * y[1][c];
    s2 += g[2][c] * y[2][c];
    s3 += g[3][c] * y[3][c];
  }
  s[0] = s0, s[1] = s1, s[2] = s2, s[3] = s3;
}

// Columns per slice: the accumulator and a partial stay in L1.
constexpr int kSlice = kRowSlice;

}  // namespace

// acc (+)= a, or acc (+)= a + b: `started` says whether acc holds a sum yet.
void add_rows(float* acc, bool started, const std::byte* a, const std::byte* b, DType dtype, int n) {
  const bool bf16 = dtype == DType::kBF16;
  const auto* a16 = reinterpret_cast<const uint16_t*>(a);
  const auto* b16 = reinterpret_cast<const uint16_t*>(b);
  const auto* a32 = reinterpret_cast<const float*>(a);
  const auto* b32 = reinterpret_cast<const float*>(b);
  if (b == nullptr) {
    if (started) bf16 ? add_bf16(acc, a16, n) : add_f32(acc, a32, n);
    else bf16 ? start_bf16(acc, a16, n) : start_f32(acc, a32, n);
  } else {
    if (started) bf16 ? add2_bf16(acc, a16, b16, n) : add2_f32(acc, a32, b32, n);
    else bf16 ? start2_bf16(acc, a16, b16, n) : start2_f32(acc, a32, b32, n);
  }
}

void accumulate(float* acc, const std::byte* src, DType dtype, int n) {
  if (dtype == DType::kBF16)
    add_bf16(acc, reinterpret_cast<const uint16_t*>(src), n);
  else
    add_f32(acc, reinterpret_cast<const float*>(src), n);
}

void accumulate_weighted(float* acc, float w, const std::byte* src, DType dtype, int n) {
  if (dtype == DType::kBF16)
    add_weighted_bf16(acc, w, reinterpret_cast<const uint16_t*>(src), n);
  else
    add_weighted_f32(acc, w, reinterpret_cast<const float*>(src), n);
}

void store(std::byte* dst, DType dtype, const float* acc, int n) {
  if (dtype == DType::kBF16)
    store_bf16(reinterpret_cast<uint16_t*>(dst), acc, n);
  else
    std::memcpy(dst, acc, sizeof(float) * static_cast<std::size_t>(n));
}

void weighted_slice(float* acc, const std::byte* const* rows, const float* weights, int num_rows, DType row_dtype,
                    std::size_t offset, int n) {
  if (num_rows == 0) {
    std::fill(acc, acc + n, 0.0f);
    return;
  }
  // Four rows per pass while four remain, then two, then one: the order of
  // one pass per row, in fewer passes over acc.
  int r = 0;
  for (; r + 3 < num_rows; r += 4) accumulate4_weighted(acc, r == 0, weights + r, rows + r, offset, row_dtype, n);
  if (r == 0) first_weighted(acc, weights[0], rows[0] + offset, row_dtype, n), r = 1;
  for (; r + 1 < num_rows; r += 2)
    accumulate2_weighted(acc, weights[r], rows[r] + offset, weights[r + 1], rows[r + 1] + offset, row_dtype, n);
  if (r < num_rows) accumulate_weighted(acc, weights[r], rows[r] + offset, row_dtype, n);
}

namespace {

// acc[0, blocks * kBlock) = columns [c0, ...) of weighted_partial's fp32 sum, in registers.
EPX_SIMD_CLONES void weighted_blocks(float* acc, const std::byte* const* rows, const float* weights, int num_rows,
                                     DType row_dtype, int c0, int blocks) {
  lanes::Lanes p[lanes::kWide];
  for (int b = 0; b < blocks; ++b) {
    lanes::weighted_block(p, rows, weights, num_rows, row_dtype, c0 + b * lanes::kBlock);
    lanes::store_block(acc + static_cast<std::size_t>(b) * lanes::kBlock, p);
  }
}

}  // namespace

void weighted_partial(std::byte* out, DType out_dtype, const std::byte* const* rows, const float* weights,
                      int num_rows, DType row_dtype, int hidden) {
  alignas(64) float acc[kSlice];
  const std::size_t in_size = dtype_size(row_dtype), out_size = dtype_size(out_dtype);
  for (int c0 = 0; c0 < hidden; c0 += kSlice) {
    const int n = std::min(kSlice, hidden - c0);
    const int blocks = n / lanes::kBlock, done = blocks * lanes::kBlock;
    weighted_blocks(acc, rows, weights, num_rows, row_dtype, c0, blocks);
    if (done < n)
      weighted_slice(acc + done, rows, weights, num_rows, row_dtype, static_cast<std::size_t>(c0 + done) * in_size, n - done);
    store(out + static_cast<std::size_t>(c0) * out_size, out_dtype, acc, n);
  }
}

void column_order_dots(std::span<const DotJob> jobs, DType y_dtype, int n) {
  // bf16 rows are widened a slice at a time (vectorised, exact) into L1, so
  // the serial sums read plain floats.
  alignas(64) float wide[4][kSlice];
  for (std::size_t j = 0; j < jobs.size(); j += 4) {
    // The last group of fewer than four repeats its last job.
    const DotJob* four[4];
    for (std::size_t q = 0; q < 4; ++q) four[q] = &jobs[std::min(j + q, jobs.size() - 1)];
    float sums[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int c0 = 0; c0 < n; c0 += kSlice) {
      const int len = std::min(kSlice, n - c0);
      const float* g[4];
      const float* y[4];
      for (int q = 0; q < 4; ++q) {
        g[q] = four[q]->g + c0;
        if (y_dtype == DType::kBF16) {
          to_f32(reinterpret_cast<const uint16_t*>(four[q]->y) + c0, len, wide[q]);
          y[q] = wide[q];
        } else {
          y[q] = reinterpret_cast<const float*>(four[q]->y) + c0;
        }
      }
      dots4(g, y, len, sums);
    }
    for (int q = 0; q < 4; ++q) *four[q]->out = sums[q];
  }
}

namespace {

// acc[0, blocks * kBlock) = columns [c0, ...) of sum_row's fp32 sum, in registers.
EPX_SIMD_CLONES void sum_row_blocks(float* acc, std::span<const SumGroup> groups, int c0, int blocks) {
  using lanes::Lanes;
  for (int b = 0; b < blocks; ++b) {
    const int c = c0 + b * lanes::kBlock;
    Lanes total[lanes::kWide] = {}, group[lanes::kWide], x[lanes::kWide];
    bool started = false;
    for (const SumGroup& g : groups) {
      if (g.num_rows == 1) {
        lanes::load_block(x, g.rows[0], g.dtype, c);
        lanes::add_block(total, x, started);
      } else {
        lanes::zero_block(group);
        for (int r = 0; r < g.num_rows; ++r) {
          lanes::load_block(x, g.rows[r], g.dtype, c);
          lanes::add_block(group, x, r > 0);
        }
        lanes::add_block(total, group, started);
      }
      started = true;
    }
    lanes::store_block(acc + static_cast<std::size_t>(b) * lanes::kBlock, total);
  }
}

// acc[0, n) = columns [c0, c0 + n) of sum_row's fp32 sum, a pass per row or
// pair of rows over acc (and `partial`, for groups of several rows).
void sum_row_slice(float* acc, float* partial, std::span<const SumGroup> groups, int c0, int n) {
  bool started = false;  // acc = 0 + the groups so far; unread before the first
  for (std::size_t i = 0; i < groups.size(); ++i) {
    const SumGroup& g = groups[i];
    const std::size_t offset = static_cast<std::size_t>(c0) * dtype_size(g.dtype);
    if (g.num_rows == 1) {
      // Runs of single rows go two per pass.
      const SumGroup* next = i + 1 < groups.size() ? &groups[i + 1] : nullptr;
      const bool pair = next && next->num_rows == 1 && next->dtype == g.dtype;
      add_rows(acc, started, g.rows[0] + offset, pair ? next->rows[0] + offset : nullptr, g.dtype, n);
      started = true;
      if (pair) ++i;
      continue;
    }
    if (g.num_rows == 0) std::fill(partial, partial + n, 0.0f);
    for (int r = 0; r < g.num_rows; r += 2) {
      const std::byte* second = r + 1 < g.num_rows ? g.rows[r + 1] + offset : nullptr;
      add_rows(partial, r > 0, g.rows[r] + offset, second, g.dtype, n);
    }
    add_rows(acc, started, reinterpret_cast<const std::byte*>(partial), nullptr, DType::kF32, n);
    started = true;
  }
  if (!started) std::fill(acc, acc + n, 0.0f);
}

}  // namespace

void sum_row(std::byte* out, DType out_dtype, std::span<const SumGroup> groups, const std::byte* bias,
             DType bias_dtype, int hidden, RowStores stores) {
  alignas(64) float acc[kSlice];
  alignas(64) float partial[kSlice];
  for (int c0 = 0; c0 < hidden; c0 += kSlice) {
    const int n = std::min(kSlice, hidden - c0);
    const int blocks = n / lanes::kBlock, done = blocks * lanes::kBlock;
    sum_row_blocks(acc, groups, c0, blocks);
    if (done < n) sum_row_slice(acc + done, partial, groups, c0 + done, n - done);
    finish_slice(out, out_dtype, c0, acc, bias, bias_dtype, n, stores);
  }
}

void finish_slice(std::byte* out, DType out_dtype, int c0, float* acc, const std::byte* bias, DType bias_dtype, int n,
                  RowStores stores) {
  if (bias) accumulate(acc, bias + static_cast<std::size_t>(c0) * dtype_size(bias_dtype), bias_dtype, n);
  std::byte* dst = out + static_cast<std::size_t>(c0) * dtype_size(out_dtype);
  if (stores == RowStores::kStreamed && dtype_size(out_dtype) <= sizeof(float)) {
    // f32 out streams straight from acc; other types are rounded first.
    alignas(64) std::byte rounded[kSlice * sizeof(float)];
    const std::byte* src = reinterpret_cast<const std::byte*>(acc);
    if (out_dtype != DType::kF32) store(rounded, out_dtype, acc, n), src = rounded;
    copy_row(dst, src, static_cast<std::size_t>(n) * dtype_size(out_dtype), stores);
  } else {
    store(dst, out_dtype, acc, n);
  }
}

}  // namespace epx::detail
