#include "exchange/cuda/cuda_util.h"

#include <vector>

#include "exchange/cuda/kernels.h"
#include "exchange/exchange_plan.h"

namespace epx::detail {

Status enqueue_layout(const TensorView& topk_idx, int num_experts, const Topology& topology,
                      const LayoutScratch& scratch, int32_t* host_counts, unsigned long long* host_error,
                      cudaStream_t stream) {
  const int R = topology.num_ranks(), N = topology.num_nodes();
  cuda::LayoutArgs a;
  a.topk_idx = topk_idx.data_as<const int32_t>();
  a.topk_stride = topk_idx.stride(0);
  a.num_tokens = static_cast<int>(topk_idx.size(0));
  a.topk = static_cast<int>(topk_idx.size(1));
  a.num_experts = num_experts;
  a.num_ranks = R;
  a.num_nodes = N;
  a.ranks_per_node = topology.ranks_per_node();
  a.expert_rank = scratch.expert_rank;
  a.in_rank = scratch.in_rank;
  a.counts = scratch.counts;
  a.topk_rank = scratch.topk_rank;
  a.error = scratch.error;
  EPX_CUDA_CHECK(cuda::launch_layout(a, stream));
  EPX_CUDA_CHECK(cudaMemcpyAsync(host_counts, scratch.counts, sizeof(int32_t) * (R + N + num_experts),
                                 cudaMemcpyDeviceToHost, stream));
  EPX_CUDA_CHECK(cudaMemcpyAsync(host_error, scratch.error, sizeof(unsigned long long), cudaMemcpyDeviceToHost, stream));
  return Status::ok();
}

Status layout_error(const TensorView& topk_idx, unsigned long long error, int num_experts) {
  if (error == ~0ull) return Status::ok();
  const int64_t K = topk_idx.size(1), t = static_cast<int64_t>(error / 4) / K;
  std::vector<int32_t> row(K);
  EPX_CUDA_CHECK(cudaMemcpy(row.data(), topk_idx.row<int32_t>(t), sizeof(int32_t) * K, cudaMemcpyDeviceToHost));
  const Status bad = check_topk_row(row.data(), K, t, num_experts);
  return bad.is_ok() ? internal_error("the layout kernel flagged token {} but its row is good", t) : bad;
}

}  // namespace epx::detail
