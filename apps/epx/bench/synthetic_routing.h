// Synthetic routing for benchmarks and demos: each token picks `topk`
// distinct experts, uniformly or with a Zipf-like skew, from a seed.
//
// The routing of a rank depends only on (spec, rank), so every run and every
// method of a benchmark sees the same tokens going to the same experts.
//
//   epx::bench::RoutingSpec spec{.num_tokens = 4096, .num_experts = 256, .topk = 8};
//   EPX_ASSIGN_OR_RETURN(auto routing, epx::bench::make_routing(spec, /*rank=*/3));
//   routing.idx();      // i32 [4096, 8], distinct experts per row
//   routing.weights();  // f32 [4096, 8], positive, each row sums to 1
#pragma once

#include <cstdint>
#include <vector>

#include "epx/core/status.h"
#include "epx/core/tensor.h"

namespace epx::bench {

struct RoutingSpec {
  int num_tokens = 0;
  int num_experts = 0;
  int topk = 0;
  // 0: every expert equally likely. s > 0: expert e drawn with weight
  // (e + 1)^-s, so low expert ids (and the ranks holding them) are hot.
  double skew = 0.0;
  uint64_t seed = 1;
};

struct RankRouting {
  int num_tokens = 0;
  int topk = 0;
  std::vector<int32_t> topk_idx;    // [num_tokens, topk] global expert ids, distinct per row
  std::vector<float> topk_weights;  // [num_tokens, topk] positive, each row sums to 1

  [[nodiscard]] TensorView idx() const {
    return TensorView::contiguous(topk_idx.data(), DType::kI32, {num_tokens, topk});
  }
  [[nodiscard]] TensorView weights() const {
    return TensorView::contiguous(topk_weights.data(), DType::kF32, {num_tokens, topk});
  }
};

// InvalidArgument when topk > num_experts, a count is negative or skew < 0.
[[nodiscard]] Status validate_routing_spec(const RoutingSpec& spec);

// The routing of `rank` (distinct experts per token, sampled without
// replacement by Gumbel top-k over log-popularity).
[[nodiscard]] Result<RankRouting> make_routing(const RoutingSpec& spec, int rank);

}  // namespace epx::bench
