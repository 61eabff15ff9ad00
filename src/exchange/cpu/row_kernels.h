// Private: the fp32 row arithmetic of combine and its backward, in one place.
//
// The slice functions work on columns [0, n); weighted_partial and sum_row
// take whole rows, 64 columns at a time in registers (row_lanes.h) and the
// last columns through the slice functions. Every function keeps a fixed
// order of additions per element, so splitting a row never changes a bit. They are compiled for AVX-512, AVX2 and baseline x86-64, picked at
// load time; none uses FMA (the project builds with -ffp-contract=off), so
// every version gives the same bits.
#pragma once

#include <cstddef>
#include <span>

#include "epx/core/dtype.h"
#include "exchange/cpu/row_copy.h"

namespace epx::detail {

// acc[c] += float(src[c]).
void accumulate(float* acc, const std::byte* src, DType dtype, int n);
// acc[c] += w * float(src[c]).
void accumulate_weighted(float* acc, float w, const std::byte* src, DType dtype, int n);
// dst[c] = acc[c], rounded to nearest even for bf16.
void store(std::byte* dst, DType dtype, const float* acc, int n);

// out = 0 + w_0 * r_0 + w_1 * r_1 + ... in fp32 (left to right), then one
// rounding to out_dtype: combine_expanded's partial of one received row,
// its local slots in top-k order. No rows: zeros. The same bits as
// zeroing an fp32 row and calling accumulate_weighted once per row.
void weighted_partial(std::byte* out, DType out_dtype, const std::byte* const* rows, const float* weights,
                      int num_rows, DType row_dtype, int hidden);

// Columns the row functions work on at a time: an f32 slice of this many
// stays in L1 beside a few others.
inline constexpr int kRowSlice = 512;

// The slice [offset, offset + n) (offset in bytes of row_dtype) of
// weighted_partial in fp32 into acc[0, n): the same bits as weighted_partial
// to f32 on those columns.
void weighted_slice(float* acc, const std::byte* const* rows, const float* weights, int num_rows, DType row_dtype,
                    std::size_t offset, int n);

// acc = 0 + a (+ b) when !started, else acc = (acc + a) (+ b): the passes of
// sum_row; b may be null.
void add_rows(float* acc, bool started, const std::byte* a, const std::byte* b, DType dtype, int n);

// One dot product of combine_expanded's backward: *out = <g, y>, g an f32
// row, y a row of the dtype column_order_dots is given.
struct DotJob {
  const float* g = nullptr;
  const std::byte* y = nullptr;
  float* out = nullptr;
};

// Each job's *out = 0 + g[0] * y[0] + g[1] * y[1] + ... in fp32, column by
// column (one serial sum per job: the bits of a plain loop; bf16 y widened
// exactly), n columns. Four jobs run at a time, so their sums overlap instead
// of each waiting on its own additions.
void column_order_dots(std::span<const DotJob> jobs, DType y_dtype, int n);

// A group of rows summed on their own first (one node's partial sum in the
// two-hop combine); a group of one row is that row.
struct SumGroup {
  const std::byte* const* rows = nullptr;
  int num_rows = 0;
  DType dtype = DType::kF32;
};

// out = 0 + g_0 + g_1 + ... (+ bias), each group g = 0 + r_0 + r_1 + ...,
// all in fp32, then one rounding to out_dtype. Works 64 columns at a time in
// registers (the last columns in L1), with the same order of additions per
// element as whole rows would.
// `stores` as copy_row's (the same bits either way); after streamed rows the
// caller calls finish_streamed_rows() before a reader is told.
void sum_row(std::byte* out, DType out_dtype, std::span<const SumGroup> groups, const std::byte* bias,
             DType bias_dtype, int hidden, RowStores stores = RowStores::kCached);

// The end of one slice of sum_row: acc (columns [c0, c0 + n) of a sum, at most
// kRowSlice) plus the bias slice when given, stored into out's slice.
void finish_slice(std::byte* out, DType out_dtype, int c0, float* acc, const std::byte* bias, DType bias_dtype, int n,
                  RowStores stores);

}  // namespace epx::detail
