#include "exchange/holder_sums.h"

#include <algorithm>

#include "exchange/row_kernels.h"

namespace epx::detail {
namespace {

// Columns [c0, c0 + n) of a part's partial: the row itself, or its rows
// weighed and summed into `scratch`.
const std::byte* part_slice(const HolderPart& p, int c0, int n, float* scratch) {
  if (p.partial) return p.partial + static_cast<std::size_t>(c0) * sizeof(float);
  weighted_slice(scratch, p.rows, p.weights, p.num_rows, p.row_dtype, static_cast<std::size_t>(c0) * dtype_size(p.row_dtype),
                 n);
  return reinterpret_cast<const std::byte*>(scratch);
}

// acc (+)= one group's slice, as sum_row adds a group of rows.
void add_group(float* acc, bool started, const PartGroup& g, int c0, int n, float* scratch, float* group_sum) {
  if (g.num_parts == 1) {
    add_rows(acc, started, part_slice(g.parts[0], c0, n, scratch), nullptr, DType::kF32, n);
    return;
  }
  if (g.num_parts == 0) std::fill(group_sum, group_sum + n, 0.0f);
  for (int i = 0; i < g.num_parts; ++i)
    add_rows(group_sum, i > 0, part_slice(g.parts[i], c0, n, scratch), nullptr, DType::kF32, n);
  add_rows(acc, started, reinterpret_cast<const std::byte*>(group_sum), nullptr, DType::kF32, n);
}

}  // namespace

void sum_parts(std::byte* out, DType out_dtype, std::span<const PartGroup> groups, const std::byte* bias,
               DType bias_dtype, int hidden, RowStores stores) {
  alignas(64) float acc[kRowSlice];
  alignas(64) float scratch[kRowSlice];
  alignas(64) float group_sum[kRowSlice];
  for (int c0 = 0; c0 < hidden; c0 += kRowSlice) {
    const int n = std::min(kRowSlice, hidden - c0);
    for (std::size_t i = 0; i < groups.size(); ++i) add_group(acc, i > 0, groups[i], c0, n, scratch, group_sum);
    if (groups.empty()) std::fill(acc, acc + n, 0.0f);
    finish_slice(out, out_dtype, c0, acc, bias, bias_dtype, n, stores);
  }
}

}  // namespace epx::detail
