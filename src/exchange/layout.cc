#include "epx/exchange/layout.h"

#include <algorithm>

#include "exchange/exchange_plan.h"

namespace epx {

Status validate_topk_idx(const TensorView& topk_idx, int num_experts) {
  if (topk_idx.ndim() != 2) return invalid_argument("topk_idx must be 2-D [num_tokens, topk], got {}", topk_idx.describe());
  EPX_RETURN_IF_ERROR(check_matrix(topk_idx, "topk_idx", DType::kI32, topk_idx.size(0), topk_idx.size(1)));
  const int64_t num_tokens = topk_idx.size(0);
  const int64_t topk = topk_idx.size(1);
  for (int64_t t = 0; t < num_tokens; ++t)
    EPX_RETURN_IF_ERROR(detail::check_topk_row(topk_idx.row<int32_t>(t), topk, t, num_experts));
  return Status::ok();
}

Status compute_layout(const TensorView& topk_idx, const ExpertPlacement& placement, const Topology& topology,
                      DispatchLayout* out) {
  if (placement.num_ranks() != topology.num_ranks())
    return invalid_argument("the placement is for {} ranks but the topology has {}", placement.num_ranks(),
                            topology.num_ranks());
  EPX_RETURN_IF_ERROR(validate_topk_idx(topk_idx, placement.num_experts()));
  const int num_tokens = static_cast<int>(topk_idx.size(0));
  const int topk = static_cast<int>(topk_idx.size(1));
  const int num_ranks = topology.num_ranks();
  out->num_tokens = num_tokens;
  out->num_ranks = num_ranks;
  out->num_tokens_per_rank.assign(num_ranks, 0);
  out->num_tokens_per_node.assign(topology.num_nodes(), 0);
  out->num_tokens_per_expert.assign(placement.num_experts(), 0);
  out->is_token_in_rank.assign(static_cast<std::size_t>(num_tokens) * num_ranks, 0);
  std::vector<uint8_t> in_node(topology.num_nodes());
  for (int t = 0; t < num_tokens; ++t) {
    const int32_t* row = topk_idx.row<int32_t>(t);
    uint8_t* in_rank = out->is_token_in_rank.data() + static_cast<std::size_t>(t) * num_ranks;
    std::fill(in_node.begin(), in_node.end(), 0);
    for (int k = 0; k < topk; ++k) {
      if (row[k] < 0) continue;
      ++out->num_tokens_per_expert[row[k]];
      const int r = placement.rank_of(row[k]);
      if (!in_rank[r]) {
        in_rank[r] = 1;
        ++out->num_tokens_per_rank[r];
      }
      const int n = topology.node_of(r);
      if (!in_node[n]) {
        in_node[n] = 1;
        ++out->num_tokens_per_node[n];
      }
    }
  }
  return Status::ok();
}

Result<DispatchLayout> compute_layout(const TensorView& topk_idx, const ExpertPlacement& placement,
                                      const Topology& topology) {
  DispatchLayout layout;
  EPX_RETURN_IF_ERROR(compute_layout(topk_idx, placement, topology, &layout));
  return layout;
}

}  // namespace epx
