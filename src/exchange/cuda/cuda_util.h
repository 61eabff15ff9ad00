// Private: what the CUDA backend's host code shares: the EPX_CUDA_CHECK
// macro and an owned device allocation.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <span>

#include "epx/comm/topology.h"
#include "epx/core/buffer.h"
#include "epx/core/status.h"
#include "epx/core/tensor.h"
#include "epx/exchange/buffer.h"
#include "exchange/cuda/kernels.h"
#include "exchange/handle_data.h"

// Wraps a CUDA runtime call: a failure returns Internal with the call, file and line.
#define EPX_CUDA_CHECK(expr)                                                                              \
  do {                                                                                                    \
    const cudaError_t epx_cuda_err_ = (expr);                                                             \
    if (epx_cuda_err_ != cudaSuccess)                                                                     \
      return ::epx::internal_error("{} failed at {}:{}: {} ({})", #expr, __FILE__, __LINE__,              \
                                   cudaGetErrorName(epx_cuda_err_), cudaGetErrorString(epx_cuda_err_)); \
  } while (0)

namespace epx::detail {

// One cudaMalloc'd block, freed on its device.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  ~DeviceMemory() { reset(); }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  Status allocate(int device, std::size_t bytes) {
    if (bytes <= bytes_) return Status::ok();
    reset();
    EPX_CUDA_CHECK(cudaSetDevice(device));
    EPX_CUDA_CHECK(cudaMalloc(&ptr_, bytes));
    EPX_CUDA_CHECK(cudaMemset(ptr_, 0, bytes));
    device_ = device;
    bytes_ = bytes;
    return Status::ok();
  }
  void reset() {
    if (ptr_ != nullptr && cudaSetDevice(device_) == cudaSuccess) cudaFree(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  template <typename T = std::byte>
  [[nodiscard]] T* get() const { return static_cast<T*>(ptr_); }

 private:
  void* ptr_ = nullptr;
  int device_ = 0;
  std::size_t bytes_ = 0;
};

// One rank's layout scratch on its device (see cuda::LayoutArgs).
struct LayoutScratch {
  const int32_t* expert_rank = nullptr;
  uint8_t* in_rank = nullptr;
  int32_t* counts = nullptr;  // [R + N + E]
  int32_t* topk_rank = nullptr;
  unsigned long long* error = nullptr;
};
// A rank's private device scratch: its layout (in_rank [T, R], send_row
// [T, R], the slots' ranks [T, K], counts, the error word) and the
// placement's tables (expert -> rank, expert -> local id).
struct RankScratch {
  uint8_t* in_rank = nullptr;
  int32_t* send_row = nullptr;
  int32_t* topk_rank = nullptr;
  int32_t* counts = nullptr;
  unsigned long long* error = nullptr;
  int32_t* expert_rank = nullptr;
  int32_t* local_id = nullptr;
  void carve(Carver& c, int max_tokens, int num_ranks, int num_nodes, int num_experts, int max_topk);
  // Copies the placement's tables to the device (the current device must be the scratch's).
  [[nodiscard]] Status upload_placement(const ExpertPlacement& placement) const;
  // The layout kernel's view of it, writing the slots' ranks to `slot_ranks`.
  [[nodiscard]] LayoutScratch layout(int32_t* slot_ranks) const {
    return {expert_rank, in_rank, counts, slot_ranks, error};
  }
};

// Enqueues the layout kernel of `topk_idx` (a valid i32 [T, K] device view)
// on `stream`, then copies the counts into host_counts [R + N + E] and the
// error word into *host_error; both are ready after the stream syncs.
Status enqueue_layout(const TensorView& topk_idx, int num_experts, const Topology& topology,
                      const LayoutScratch& scratch, int32_t* host_counts, unsigned long long* host_error,
                      cudaStream_t stream);
// OK when the layout kernel found no bad entry (error == ~0), else the CPU's
// message for the flagged row of topk_idx (copied back to name it).
Status layout_error(const TensorView& topk_idx, unsigned long long error, int num_experts);

// The part of a rank's device region that dispatch writes (its peers do):
// receive rows (256-byte aligned) and their metadata.
struct RecvRegion {
  std::byte* recv_x = nullptr;
  int32_t* src_idx = nullptr;
  int32_t* src_rank = nullptr;
  int32_t* topk_idx = nullptr;      // [max_recv, K] local ids
  float* topk_weights = nullptr;    // [max_recv, K]
  void carve(Carver& c, int64_t max_recv, std::size_t row_bytes, int max_topk);
};

// The dispatch kernel's arguments for source rank `src_rank`: the rows of x
// along send_row into every rank's RecvRegion, in the widest copy unit that
// fits; payload only until add_dispatch_meta.
cuda::DispatchArgs make_dispatch_args(const TensorView& x, std::size_t row_bytes, int src_rank, int num_tokens,
                                      const int32_t* send_row, std::span<const RecvRegion> regions);
// The metadata too: source index and rank, local top-k ids, weights (when defined).
void add_dispatch_meta(cuda::DispatchArgs* args, const TensorView& topk_idx, const TensorView& topk_weights,
                       const int32_t* expert_rank, const int32_t* local_id);

// Fills rank id.rank's result: device views (on `device`) of its RecvRegion,
// the handle (`id`, then the host data: counts [R, R], node_counts [R, N],
// expert_counts [R, E] and aligned per-expert counts) and the stats (rows to
// ranks of other nodes count as inter-node bytes). The handle's data is host
// memory, as the CPU backend's: combine and backward read the counts there.
void fill_dispatch_result(const HandleIdentity& id, Device device, const BufferConfig& config,
                          const ExpertPlacement& placement,
                          const Topology& topology, std::span<const int32_t> counts,
                          std::span<const int32_t> node_counts, std::span<const int64_t> expert_counts,
                          const RecvRegion& mine, DispatchResult* out);

// Copies `rows` rows of `row_bytes` (strides in bytes; host or device, either
// way) on `stream`: one plain copy when both sides are dense or there is one
// row (whose stride may be anything, as check_matrix allows), else a 2-D copy
// (its pitches are at least row_bytes for checked views of several rows).
cudaError_t copy_rows_async(void* dst, std::size_t dst_stride, const void* src, std::size_t src_stride,
                            std::size_t row_bytes, int64_t rows, cudaStream_t stream);

// A rank's expanded layout (buffer.h): the host copy, built from the
// received local top-k ids in device memory, and its row maps on the device
// (row_of [num_recv, K], then recv_row [num_rows], int64). Forget it at each
// dispatch (ready = false); build() does the work once per dispatch.
struct DeviceExpandedLayout {
  bool ready = false;
  ExpandedLayout host;
  DeviceMemory maps;
  [[nodiscard]] Status build(int device, const int32_t* recv_topk_idx, int64_t num_recv, int topk,
                             int num_local_experts, int alignment);
  [[nodiscard]] const int64_t* row_of() const { return maps.get<int64_t>(); }
  [[nodiscard]] const int64_t* recv_row() const { return maps.get<int64_t>() + host.row_of.size(); }
};

// expand: recv_x [num_recv, hidden] (bf16 or f32, on `device`) into out
// [layout rows, hidden] of the same dtype, padding rows zero; waits for it.
Status expand_rows(const DeviceExpandedLayout& layout, const TensorView& recv_x, const TensorView& out,
                   int64_t num_recv, int hidden, Device device, cudaStream_t stream);

// The local part of combine_expanded_backward for one rank, from the cached
// dispatch of grad_out (grad_partial: dense rows of the payload dtype).
cuda::ExpandedBackwardArgs expanded_backward_args(const DeviceExpandedLayout& layout, const TensorView& grad_partial,
                                                  const TensorView& y_expanded, const float* weights, int64_t num_recv,
                                                  int topk, int hidden, const TensorView& grad_y_expanded,
                                                  const TensorView& grad_weights);

}  // namespace epx::detail
