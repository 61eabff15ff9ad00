// Private: the fp32 sums of combine_expanded with the weights applied by the
// holders (CombineWeights::kHolder), read where the rows lie.
//
// A holder's partial of one received row is 0 + w_0 * y_0 + w_1 * y_1 + ...
// over its local slots in top-k order (weighted_partial). A holder either
// wrote that partial out as an f32 row, or left its expanded rows in its
// combine region for the reader to weigh and sum; both give the same bits.
#pragma once

#include <cstddef>
#include <span>

#include "epx/core/dtype.h"
#include "exchange/cpu/row_copy.h"

namespace epx::detail {

// One holder's share of one token.
struct HolderPart {
  const std::byte* partial = nullptr;  // an f32 partial row already summed; or null, then:
  const std::byte* const* rows = nullptr;  // the holder's expanded rows of the token, in top-k order
  const float* weights = nullptr;          // their weights
  int num_rows = 0;
  DType row_dtype = DType::kF32;
};

// Parts summed on their own first (two-hop: the holders of one node); a
// group of one part is that part.
struct PartGroup {
  const HolderPart* parts = nullptr;
  int num_parts = 0;
};

// out = 0 + g_0 + g_1 + ... (+ bias), each group g = 0 + p_0 + p_1 + ...,
// each p a part's f32 partial, then one rounding to out_dtype: the bits
// sum_row gives on the partials written out as f32 rows (groups of one
// row per part). Works 64 columns at a time in registers (a slice's last
// columns in L1), so a part's rows are read once and its partial is never
// stored. `stores` as sum_row's.
void sum_parts(std::byte* out, DType out_dtype, std::span<const PartGroup> groups, const std::byte* bias,
               DType bias_dtype, int hidden, RowStores stores = RowStores::kCached);

}  // namespace epx::detail
