#include "exchange/cpu/holder_sums.h"

#include <algorithm>

#include "core/simd_clones.h"
#include "exchange/cpu/row_kernels.h"
#include "exchange/cpu/row_lanes.h"

namespace epx::detail {
namespace {

using lanes::kBlock;
using lanes::Lanes;

// Columns [c, c + kBlock) of a part's partial: its f32 row, or 0 + w_0 * r_0
// + w_1 * r_1 + ... (weighted_slice's order).
[[gnu::always_inline]] inline void part_block(Lanes* p, const HolderPart& part, int c) {
  if (part.partial) return lanes::load_block(p, part.partial, DType::kF32, c);
  lanes::weighted_block(p, part.rows, part.weights, part.num_rows, part.row_dtype, c);
}

// acc[0, blocks * kBlock) = columns [c0, ...) of sum_parts' fp32 sum.
EPX_SIMD_CLONES void sum_blocks(float* acc, std::span<const PartGroup> groups, int c0, int blocks) {
  for (int b = 0; b < blocks; ++b) {
    const int c = c0 + b * kBlock;
    Lanes total[lanes::kWide] = {}, group[lanes::kWide], p[lanes::kWide];
    bool started = false;
    for (const PartGroup& g : groups) {
      if (g.num_parts == 1) {
        part_block(p, g.parts[0], c);
        lanes::add_block(total, p, started);
      } else {
        lanes::zero_block(group);
        for (int i = 0; i < g.num_parts; ++i) {
          part_block(p, g.parts[i], c);
          lanes::add_block(group, p, i > 0);
        }
        lanes::add_block(total, group, started);
      }
      started = true;
    }
    lanes::store_block(acc + static_cast<std::size_t>(b) * kBlock, total);
  }
}

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
    const int blocks = n / kBlock, done = blocks * kBlock;
    sum_blocks(acc, groups, c0, blocks);
    for (std::size_t i = 0; i < groups.size() && done < n; ++i)
      add_group(acc + done, i > 0, groups[i], c0 + done, n - done, scratch, group_sum);
    if (groups.empty()) std::fill(acc + done, acc + n, 0.0f);
    finish_slice(out, out_dtype, c0, acc, bias, bias_dtype, n, stores);
  }
}

}  // namespace epx::detail
