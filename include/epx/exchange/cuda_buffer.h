// CudaBuffer: dispatch and combine for one rank on its GPU, on any Transport.
//
// The per-rank form of the CUDA backend, for ranks that are processes (MPI:
// one GPU each) or threads (inproc): the Buffer contract of buffer.h with
// device views, the same kernels as CudaGroup (cuda_group.h), and the
// transport for the control path only: counts are all-gathered, the receive
// and combine regions are device peer memory (map_cuda_peer_memory: CUDA IPC
// handles between processes), and every kernel writes straight into the
// peers' regions. Collective like Buffer: all ranks call each operation in
// the same order; a rank that rejects its input makes the others return
// Aborted; waits are bounded by the transport's deadlines.
//
// Across nodes (a topology of several nodes) the bytes are host-staged: each
// call copies its device views to host memory, runs a host Buffer on the
// transport (two-hop, deduplicated per node) and copies the results back.
// Correct, bit for bit the host Buffer's, but it crosses PCIe twice; GPU
// memory registered with the network (NCCL, GPUDirect RDMA) is not built.
// Inside one node: dispatch, cached dispatch, combine (with bias and weight
// gradients), the expanded layout, its weighted combine and the backward
// uses, all as kernels on peer memory. Handles are valid until the next
// dispatch; fp8 payloads are not built (Unimplemented).
//
//   EPX_ASSIGN_OR_RETURN(auto buffer, epx::CudaBuffer::create(transport, config, /*device=*/local_rank));
//   epx::DispatchResult recv;
//   EPX_RETURN_IF_ERROR(buffer->dispatch({.x = x, .topk_idx = idx}, &recv));  // device views
//   EPX_RETURN_IF_ERROR(buffer->combine(y, recv.handle, out));
#pragma once

#include <memory>

#include "epx/comm/transport.h"
#include "epx/exchange/buffer.h"

namespace epx {

class CudaBuffer {
 public:
  // Collective: every rank of `transport` calls it with the same config.
  static Result<std::unique_ptr<CudaBuffer>> create(Transport& transport, BufferConfig config, int device);
  ~CudaBuffer();
  CudaBuffer(const CudaBuffer&) = delete;
  CudaBuffer& operator=(const CudaBuffer&) = delete;

  [[nodiscard]] Device device() const;
  [[nodiscard]] const BufferConfig& config() const;

  [[nodiscard]] Status dispatch(const DispatchInputs& inputs, DispatchResult* out);
  [[nodiscard]] Status dispatch_cached(const TensorView& x, const Handle& handle, TensorView* recv_x);
  // A [num_recv, H] device view of `dtype` in this rank's combine region:
  // experts that write there save combine one copy.
  [[nodiscard]] Result<TensorView> combine_input(const Handle& handle, DType dtype);
  [[nodiscard]] Status combine(const TensorView& y, const Handle& handle, const TensorView& out,
                               const CombineOptions& options = {});
  [[nodiscard]] Status dispatch_backward(const TensorView& grad_recv_x, const Handle& handle,
                                         const TensorView& grad_x, const CombineOptions& options = {}) {
    return combine(grad_recv_x, handle, grad_x, options);
  }
  [[nodiscard]] Status combine_backward(const TensorView& grad_out, const Handle& handle, TensorView* grad_y) {
    return dispatch_cached(grad_out, handle, grad_y);
  }

  // The expanded per-expert layout (buffer.h), as Buffer's: a host copy,
  // built on first use and valid until the next dispatch.
  [[nodiscard]] Result<const ExpandedLayout*> expanded_layout(const Handle& handle);
  // Local: received rows into the expanded layout (device views).
  [[nodiscard]] Status expand(const TensorView& recv_x, const Handle& handle, const TensorView& out);
  // Collective, as Buffer::combine_expanded (needs max_combine_dtype = f32).
  [[nodiscard]] Status combine_expanded(const TensorView& y_expanded, const Handle& handle, const TensorView& out,
                                        const TensorView& weights = {}, const CombineOptions& options = {});
  // Collective, as Buffer::combine_expanded_backward.
  [[nodiscard]] Status combine_expanded_backward(const TensorView& grad_out, const Handle& handle,
                                                 const TensorView& y_expanded, const TensorView& weights,
                                                 const TensorView& grad_y_expanded,
                                                 const TensorView& grad_weights = {});

 private:
  struct Impl;
  explicit CudaBuffer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace epx
