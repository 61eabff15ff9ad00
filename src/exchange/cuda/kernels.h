// Private: the CUDA kernels of the exchange, behind plain C++ launchers.
//
// Each launcher enqueues its kernel on `stream` and returns the launch error
// (cudaSuccess as 0). Pointers are device pointers reachable from the
// stream's device: the rank's own memory, a peer GPU's through peer access,
// another process's through an opened IPC handle, or (emulated ranks) other
// allocations on the same device. Sums are fp32 in the contract's fixed order
// with every multiply and add rounded on its own (no FMA contraction), so the
// bits equal the CPU backend's.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace epx::cuda {

inline constexpr int kMaxRanks = 64;

// Layout of one rank's tokens. in_rank [T, R] gets 0/1; counts [R + N + E]
// (zeroed by the launcher) gets tokens per rank, per node, per expert;
// topk_rank [T, K] the rank of each slot's expert (-1 for none); *error the
// smallest (t * K + k) * 4 + kind of a bad entry (kind 1: out of range,
// 2: listed twice), or ~0 when every entry is good.
struct LayoutArgs {
  const int32_t* topk_idx = nullptr;
  int64_t topk_stride = 0;  // elements between rows
  int num_tokens = 0;
  int topk = 0;
  int num_experts = 0;
  int num_ranks = 0;
  int num_nodes = 0;
  int ranks_per_node = 0;
  const int32_t* expert_rank = nullptr;  // [E]
  uint8_t* in_rank = nullptr;
  int32_t* counts = nullptr;
  int32_t* topk_rank = nullptr;
  unsigned long long* error = nullptr;
};
cudaError_t launch_layout(const LayoutArgs& args, cudaStream_t stream);

// send_row [T, R]: the row of token t on rank d = base[d] + the number of
// earlier tokens of this rank that go to d, or -1 when t does not go there.
struct SendRowArgs {
  const uint8_t* in_rank = nullptr;
  int num_tokens = 0;
  int num_ranks = 0;
  int64_t base[kMaxRanks] = {};
  int32_t* send_row = nullptr;
};
cudaError_t launch_send_rows(const SendRowArgs& args, cudaStream_t stream);

// Where rank d's received rows and their metadata live.
struct RecvTargets {
  std::byte* recv_x[kMaxRanks] = {};
  int32_t* src_idx[kMaxRanks] = {};
  int32_t* src_rank[kMaxRanks] = {};
  int32_t* topk_idx[kMaxRanks] = {};   // [max_recv, K] local ids
  float* topk_weights[kMaxRanks] = {};  // [max_recv, K]
};

// One copy of each (token, destination) row into the destination's receive
// rows at send_row, in units of `unit` bytes (16, 8, 4 or 2; see
// row_copy_unit). With metadata (topk_idx set) also the source index and
// rank and the top-k ids translated to the destination's local ids.
struct DispatchArgs {
  const std::byte* x = nullptr;
  std::size_t x_stride_bytes = 0;
  std::size_t row_bytes = 0;
  int unit = 16;
  int num_tokens = 0;
  int num_ranks = 0;
  int src_rank = 0;
  const int32_t* send_row = nullptr;
  // Metadata (nullptr topk_idx: payload only, a cached dispatch).
  const int32_t* topk_idx = nullptr;
  int64_t topk_stride = 0;
  const float* topk_weights = nullptr;  // nullptr: weights 0
  int64_t weights_stride = 0;
  int topk = 0;
  const int32_t* expert_rank = nullptr;
  const int32_t* local_id = nullptr;
  RecvTargets targets;
};
cudaError_t launch_dispatch(const DispatchArgs& args, cudaStream_t stream);

// out[t] = sum over ranks d holding t of y_d[send_row[t, d]], in fp32:
// flat, 0 + y_0 + y_1 + ... in ascending rank order; hierarchical, per node
// (0 + its ranks ascending), then 0 + node partials ascending; then + bias.
// Stored as bf16 (round to nearest even) or f32. Optionally the top-k weight
// gradients: grad_topk_weights[t, k] = grad_recv_w_{r}[send_row[t, r], k],
// r = topk_rank[t, k] (0 for -1).
struct CombineArgs {
  const std::byte* y[kMaxRanks] = {};
  std::size_t y_stride_bytes[kMaxRanks] = {};
  bool y_bf16 = false;
  const float* grad_recv_weights[kMaxRanks] = {};  // [num_recv_d, K], dense
  int num_tokens = 0;
  int hidden = 0;
  int num_ranks = 0;
  int ranks_per_node = 0;  // == num_ranks: one node
  bool hierarchical = false;
  const int32_t* send_row = nullptr;
  const std::byte* bias = nullptr;  // optional [T, H]
  std::size_t bias_stride_bytes = 0;
  bool bias_bf16 = false;
  std::byte* out = nullptr;
  std::size_t out_stride_bytes = 0;
  bool out_bf16 = false;
  const int32_t* topk_rank = nullptr;
  int topk = 0;
  float* grad_topk_weights = nullptr;  // optional [T, K], dense
};
cudaError_t launch_combine(const CombineArgs& args, cudaStream_t stream);

// out[i] = recv_x[recv_row[i]], or zeros where recv_row[i] < 0 (padding).
cudaError_t launch_expand(const std::byte* recv_x, std::size_t recv_stride_bytes, const int64_t* recv_row,
                          int64_t num_rows, std::size_t row_bytes, std::byte* out, std::size_t out_stride_bytes,
                          cudaStream_t stream);

// partial[i] = 0 + w[i, 0] * y[row_of[i, 0]] + w[i, 1] * y[row_of[i, 1]] + ...
// over the slots with row_of >= 0, in fp32 (partial dense [num_recv, H]).
cudaError_t launch_expanded_partial(const std::byte* y, std::size_t y_stride_bytes, bool y_bf16, const int64_t* row_of,
                                    const float* weights, int64_t num_recv, int topk, int hidden, float* partial,
                                    cudaStream_t stream);

// The backward of combine_expanded's local part: grad_y[row_of[i, k]] = w[i, k] *
// grad_partial[i] (f32; padding rows 0) and, when grad_weights is set,
// grad_weights[i, k] = <grad_partial[i], y[row_of[i, k]]> summed in column
// order (0 where the slot is not local).
struct ExpandedBackwardArgs {
  const std::byte* grad_partial = nullptr;  // [num_recv, H] of the payload dtype, dense
  bool grad_bf16 = false;
  const std::byte* y = nullptr;
  std::size_t y_stride_bytes = 0;
  bool y_bf16 = false;
  const int64_t* row_of = nullptr;
  const int64_t* recv_row = nullptr;
  const float* weights = nullptr;
  int64_t num_recv = 0;
  int64_t num_rows = 0;
  int topk = 0;
  int hidden = 0;
  float* grad_y = nullptr;
  std::size_t grad_y_stride_bytes = 0;
  float* grad_weights = nullptr;  // optional [num_recv, K], dense
};
cudaError_t launch_expanded_backward(const ExpandedBackwardArgs& args, cudaStream_t stream);

}  // namespace epx::cuda
