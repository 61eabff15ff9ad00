// The shapes, routing and "experts'" output of the combine_expanded tests
// (expanded_bf16_test.cc, expanded_receiver_test.cc, expanded_in_place_test.cc).
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "epx/core/dtype.h"
#include "epx/exchange/buffer.h"

namespace epx::expanded_test {

constexpr int kExperts = 16, kHidden = 40, kTopk = 4, kTokens = 11;

// The "experts'" output for (source rank, source token, global expert, column).
inline float y_value(int rank, int token, int expert, int col) {
  return 0.0131f * static_cast<float>((rank * 131 + token * 17 + expert * 7 + col * 3) % 97) - 0.61f;
}

struct Routing {
  std::vector<int32_t> idx;
  std::vector<float> w;
};

// Distinct experts per token, some slots -1, weights growing with k and t.
inline Routing make_routing(int rank, unsigned seed) {
  std::mt19937 rng(seed + static_cast<unsigned>(rank));
  Routing r{std::vector<int32_t>(kTokens * kTopk), std::vector<float>(kTokens * kTopk)};
  std::vector<int32_t> experts(kExperts);
  for (int e = 0; e < kExperts; ++e) experts[e] = e;
  for (int t = 0; t < kTokens; ++t) {
    std::shuffle(experts.begin(), experts.end(), rng);
    for (int k = 0; k < kTopk; ++k) {
      r.idx[t * kTopk + k] = (t + k) % 7 == 3 ? -1 : experts[k];
      r.w[t * kTopk + k] = 0.173f * static_cast<float>(k + 1) + 0.0091f * static_cast<float>(t);
    }
  }
  return r;
}

// Dispatches kTokens rows of ones (bf16, the buffer's hidden) with `routing`.
inline Status dispatch(Buffer& buffer, const Routing& routing, DispatchResult* d) {
  const int64_t hidden = buffer.config().hidden;
  const std::vector<uint16_t> x(static_cast<std::size_t>(kTokens * hidden), f32_to_bf16(1.0f));
  return buffer.dispatch({TensorView::contiguous(const_cast<uint16_t*>(x.data()), DType::kBF16, {kTokens, hidden}),
                          TensorView::contiguous(const_cast<int32_t*>(routing.idx.data()), DType::kI32, {kTokens, kTopk}),
                          TensorView::contiguous(const_cast<float*>(routing.w.data()), DType::kF32, {kTokens, kTopk})},
                         d);
}

// The "experts'" output rows in the expanded layout, into y (bf16 or f32).
inline void fill_y(const Buffer& buffer, const DispatchResult& d, int rank, const TensorView& y) {
  const ExpandedLayout& layout = buffer.expanded_layout(d.handle);
  const int per_rank = kExperts / buffer.placement().num_ranks();
  const int hidden = buffer.config().hidden;
  for (int e = 0; e + 1 < static_cast<int>(layout.expert_offsets.size()); ++e)
    for (int64_t row = layout.expert_offsets[e]; row < layout.expert_offsets[e + 1]; ++row) {
      const int64_t i = layout.recv_row[row];
      for (int c = 0; c < hidden; ++c) {
        const float v = i < 0 ? 0.0f
                              : y_value(d.recv_src_rank.data_as<int32_t>()[i], d.recv_src_idx.data_as<int32_t>()[i],
                                        rank * per_rank + e, c);
        if (y.dtype() == DType::kBF16) y.row<uint16_t>(row)[c] = f32_to_bf16(v);
        else y.row<float>(row)[c] = v;
      }
    }
}

}  // namespace epx::expanded_test
