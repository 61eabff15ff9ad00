// DispatchLayout: where each token must go, computed locally from topk_idx.
//
// A token counts once per rank and once per node however many of its experts
// live there (deduplicated), and once per expert. The layout needs no
// communication; dispatch computes it when the caller does not pass one.
//
//   EPX_ASSIGN_OR_RETURN(auto layout, epx::compute_layout(topk_idx, placement, topology));
//   layout.num_tokens_per_rank[2];   // tokens this rank sends to rank 2
//   layout.in_rank(17, 2);           // does token 17 go to rank 2?
#pragma once

#include <cstdint>
#include <vector>

#include "epx/comm/topology.h"
#include "epx/core/tensor.h"
#include "epx/exchange/placement.h"

namespace epx {

struct DispatchLayout {
  int num_tokens = 0;
  int num_ranks = 0;
  std::vector<int32_t> num_tokens_per_rank;    // [R]
  std::vector<int32_t> num_tokens_per_node;    // [N]
  std::vector<int32_t> num_tokens_per_expert;  // [E]
  std::vector<uint8_t> is_token_in_rank;       // [T, R], row-major, 0 or 1

  [[nodiscard]] bool in_rank(int token, int rank) const {
    return is_token_in_rank[static_cast<std::size_t>(token) * num_ranks + rank] != 0;
  }
};

// Checks topk_idx (i32 [T, K], dense rows): every id is -1 or in [0, E), and no
// token lists an expert twice. InvalidArgument names the first offending entry.
Status validate_topk_idx(const TensorView& topk_idx, int num_experts);

// Validates topk_idx as above, then fills `out` (reusing its storage).
Status compute_layout(const TensorView& topk_idx, const ExpertPlacement& placement, const Topology& topology,
                      DispatchLayout* out);
Result<DispatchLayout> compute_layout(const TensorView& topk_idx, const ExpertPlacement& placement,
                                      const Topology& topology);

}  // namespace epx
