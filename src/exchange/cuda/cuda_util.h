// Private: what the CUDA backend's host code shares: the EPX_CUDA_CHECK
// macro and an owned device allocation.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "epx/comm/topology.h"
#include "epx/core/status.h"
#include "epx/core/tensor.h"

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
// Enqueues the layout kernel of `topk_idx` (a valid i32 [T, K] device view)
// on `stream`, then copies the counts into host_counts [R + N + E] and the
// error word into *host_error; both are ready after the stream syncs.
Status enqueue_layout(const TensorView& topk_idx, int num_experts, const Topology& topology,
                      const LayoutScratch& scratch, int32_t* host_counts, unsigned long long* host_error,
                      cudaStream_t stream);
// OK when the layout kernel found no bad entry (error == ~0), else the CPU's
// message for the flagged row of topk_idx (copied back to name it).
Status layout_error(const TensorView& topk_idx, unsigned long long error, int num_experts);

}  // namespace epx::detail
