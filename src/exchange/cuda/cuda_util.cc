#include "exchange/cuda/cuda_util.h"

#include <vector>

#include "exchange/cuda/kernels.h"
#include "exchange/exchange_plan.h"
#include "exchange/handle_data.h"

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

void RecvRegion::carve(Carver& c, int64_t max_recv, std::size_t row_bytes, int max_topk) {
  const auto rows = static_cast<std::size_t>(max_recv);
  recv_x = c.take<std::byte>(rows * row_bytes, 256);
  src_idx = c.take<int32_t>(rows);
  src_rank = c.take<int32_t>(rows);
  topk_idx = c.take<int32_t>(rows * max_topk);
  topk_weights = c.take<float>(rows * max_topk);
}

void RankScratch::carve(Carver& c, int max_tokens, int num_ranks, int num_nodes, int num_experts, int max_topk) {
  const auto tokens = static_cast<std::size_t>(max_tokens);
  in_rank = c.take<uint8_t>(tokens * num_ranks);
  send_row = c.take<int32_t>(tokens * num_ranks);
  topk_rank = c.take<int32_t>(tokens * max_topk);
  counts = c.take<int32_t>(static_cast<std::size_t>(num_ranks + num_nodes + num_experts));
  error = c.take<unsigned long long>(1);
  expert_rank = c.take<int32_t>(num_experts);
  local_id = c.take<int32_t>(num_experts);
}

Status RankScratch::upload_placement(const ExpertPlacement& placement) const {
  const int E = placement.num_experts();
  std::vector<int32_t> local(E);
  for (int e = 0; e < E; ++e) local[e] = placement.local_id(e);
  EPX_CUDA_CHECK(cudaMemcpy(expert_rank, placement.expert_rank().data(), sizeof(int32_t) * E, cudaMemcpyHostToDevice));
  EPX_CUDA_CHECK(cudaMemcpy(local_id, local.data(), sizeof(int32_t) * E, cudaMemcpyHostToDevice));
  return Status::ok();
}

cuda::DispatchArgs make_dispatch_args(const TensorView& x, std::size_t row_bytes, int src_rank, int num_tokens,
                                      const int32_t* send_row, std::span<const RecvRegion> regions) {
  cuda::DispatchArgs a;
  a.x = static_cast<const std::byte*>(x.data());
  a.x_stride_bytes = x.row_stride_bytes();
  a.row_bytes = row_bytes;
  std::vector<const void*> addresses{a.x, a.x + a.x_stride_bytes};  // rows 0 and 1
  for (std::size_t d = 0; d < regions.size(); ++d) {
    const RecvRegion& g = regions[d];
    addresses.push_back(g.recv_x);
    a.targets.recv_x[d] = g.recv_x;
    a.targets.src_idx[d] = g.src_idx;
    a.targets.src_rank[d] = g.src_rank;
    a.targets.topk_idx[d] = g.topk_idx;
    a.targets.topk_weights[d] = g.topk_weights;
  }
  a.unit = row_copy_unit(row_bytes, addresses);
  a.num_tokens = num_tokens;
  a.num_ranks = static_cast<int>(regions.size());
  a.src_rank = src_rank;
  a.send_row = send_row;
  return a;
}

void add_dispatch_meta(cuda::DispatchArgs* a, const TensorView& topk_idx, const TensorView& topk_weights,
                       const int32_t* expert_rank, const int32_t* local_id) {
  a->topk_idx = topk_idx.data_as<const int32_t>();
  a->topk_stride = topk_idx.stride(0);
  if (topk_weights.defined()) {
    a->topk_weights = topk_weights.data_as<const float>();
    a->weights_stride = topk_weights.stride(0);
  }
  a->topk = static_cast<int>(topk_idx.size(1));
  a->expert_rank = expert_rank;
  a->local_id = local_id;
}

void fill_dispatch_result(const HandleIdentity& id, Device device, const BufferConfig& config,
                          const ExpertPlacement& placement, const Topology& topology, std::span<const int32_t> counts,
                          std::span<const int32_t> node_counts, std::span<const int64_t> expert_counts,
                          const RecvRegion& mine, DispatchResult* out) {
  const int R = topology.num_ranks();
  auto h = std::make_shared<HandleData>();
  static_cast<HandleIdentity&>(*h) = id;
  h->counts.assign(counts.begin(), counts.end());
  h->node_counts.assign(node_counts.begin(), node_counts.end());
  h->num_recv = num_recv_rows(counts, R, id.rank);
  h->num_local_experts = placement.num_local_experts(id.rank);
  h->expert_alignment = config.expert_alignment;
  h->num_recv_tokens_per_expert =
      aligned_recv_expert_counts(expert_counts, R, placement, id.rank, config.expert_alignment);
  const int64_t n = h->num_recv;
  DispatchResult& o = *out;
  o = DispatchResult{};
  o.recv_x = TensorView::contiguous(mine.recv_x, config.dtype, {n, config.hidden}, device);
  o.recv_topk_idx = TensorView::contiguous(mine.topk_idx, DType::kI32, {n, id.topk}, device);
  if (id.has_weights)
    o.recv_topk_weights = TensorView::contiguous(mine.topk_weights, DType::kF32, {n, id.topk}, device);
  o.recv_src_rank = TensorView::contiguous(mine.src_rank, DType::kI32, {n}, device);
  o.recv_src_idx = TensorView::contiguous(mine.src_idx, DType::kI32, {n}, device);
  o.num_recv_tokens_per_expert = h->num_recv_tokens_per_expert;
  const auto row_bytes = static_cast<int64_t>(config.hidden * dtype_size(config.dtype));
  for (int d = 0; d < R; ++d) {
    const int64_t rows = counts[static_cast<std::size_t>(id.rank) * R + d];
    o.stats.rows_sent += rows;
    (topology.same_node(id.rank, d) ? o.stats.intra_node_payload_bytes : o.stats.inter_node_payload_bytes) +=
        rows * row_bytes;
  }
  o.stats.rows_received = n;
  o.handle = Handle(std::move(h));
}

cudaError_t copy_rows_async(void* dst, std::size_t dst_stride, const void* src, std::size_t src_stride,
                            std::size_t row_bytes, int64_t rows, cudaStream_t stream) {
  if (rows <= 0 || row_bytes == 0) return cudaSuccess;
  if (rows == 1 || (dst_stride == row_bytes && src_stride == row_bytes))
    return cudaMemcpyAsync(dst, src, row_bytes * static_cast<std::size_t>(rows), cudaMemcpyDefault, stream);
  return cudaMemcpy2DAsync(dst, dst_stride, src, src_stride, row_bytes, static_cast<std::size_t>(rows),
                           cudaMemcpyDefault, stream);
}

Status DeviceExpandedLayout::build(int device, const int32_t* recv_topk_idx, int64_t num_recv, int topk,
                                   int num_local_experts, int alignment) {
  if (ready) return Status::ok();
  std::vector<int32_t> recv_topk(static_cast<std::size_t>(num_recv * topk));
  EPX_CUDA_CHECK(cudaSetDevice(device));
  if (!recv_topk.empty())
    EPX_CUDA_CHECK(cudaMemcpy(recv_topk.data(), recv_topk_idx, sizeof(int32_t) * recv_topk.size(),
                              cudaMemcpyDeviceToHost));
  build_expanded_layout(recv_topk, num_recv, topk, num_local_experts, alignment, &host);
  const std::size_t a = host.row_of.size(), b = host.recv_row.size();
  EPX_RETURN_IF_ERROR(maps.allocate(device, sizeof(int64_t) * (a + b + 1)));
  if (a > 0)
    EPX_CUDA_CHECK(cudaMemcpy(maps.get<int64_t>(), host.row_of.data(), sizeof(int64_t) * a, cudaMemcpyHostToDevice));
  if (b > 0)
    EPX_CUDA_CHECK(
        cudaMemcpy(maps.get<int64_t>() + a, host.recv_row.data(), sizeof(int64_t) * b, cudaMemcpyHostToDevice));
  ready = true;
  return Status::ok();
}

Status expand_rows(const DeviceExpandedLayout& layout, const TensorView& recv_x, const TensorView& out,
                   int64_t num_recv, int hidden, Device device, cudaStream_t stream) {
  if (recv_x.ndim() != 2 || (recv_x.dtype() != DType::kF32 && recv_x.dtype() != DType::kBF16))
    return invalid_argument("recv_x must be a 2-D bf16 or f32 array, got {}", recv_x.describe());
  EPX_RETURN_IF_ERROR(check_matrix(recv_x, "recv_x", recv_x.dtype(), num_recv, hidden, device));
  EPX_RETURN_IF_ERROR(check_matrix(out, "out", recv_x.dtype(), layout.host.num_rows(), hidden, device));
  EPX_CUDA_CHECK(cudaSetDevice(device.index));
  EPX_CUDA_CHECK(cuda::launch_expand(static_cast<const std::byte*>(recv_x.data()), recv_x.row_stride_bytes(),
                                     layout.recv_row(), layout.host.num_rows(),
                                     static_cast<std::size_t>(hidden) * recv_x.element_size(),
                                     static_cast<std::byte*>(out.data()), out.row_stride_bytes(), stream));
  EPX_CUDA_CHECK(cudaStreamSynchronize(stream));
  return Status::ok();
}

cuda::ExpandedBackwardArgs expanded_backward_args(const DeviceExpandedLayout& layout, const TensorView& grad_partial,
                                                  const TensorView& y_expanded, const float* weights, int64_t num_recv,
                                                  int topk, int hidden, const TensorView& grad_y_expanded,
                                                  const TensorView& grad_weights) {
  cuda::ExpandedBackwardArgs a;
  a.grad_partial = static_cast<const std::byte*>(grad_partial.data());
  a.grad_bf16 = grad_partial.dtype() == DType::kBF16;
  a.y = static_cast<const std::byte*>(y_expanded.data());
  a.y_stride_bytes = y_expanded.row_stride_bytes();
  a.y_bf16 = y_expanded.dtype() == DType::kBF16;
  a.row_of = layout.row_of();
  a.recv_row = layout.recv_row();
  a.weights = weights;
  a.num_recv = num_recv;
  a.num_rows = layout.host.num_rows();
  a.topk = topk;
  a.hidden = hidden;
  a.grad_y = grad_y_expanded.data_as<float>();
  a.grad_y_stride_bytes = grad_y_expanded.row_stride_bytes();
  if (grad_weights.defined()) a.grad_weights = grad_weights.data_as<float>();
  return a;
}

}  // namespace epx::detail
