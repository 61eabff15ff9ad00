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
// uses, all as kernels on peer memory. Each operation has an *_async form
// (a PendingOp, run on a progress thread as Buffer's). Handles are valid
// until the next dispatch; fp8 payloads are not built (Unimplemented); the
// [rows, topk] f32 arrays (weights, weight gradients) must be dense. Inputs
// must be complete when a call is made: the buffer's stream does not wait
// for the caller's streams.
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
  // Collective, as Buffer::combine_expanded (needs max_combine_dtype = f32);
  // the CUDA backend sends f32 partials only (options.partial_dtype = f32).
  [[nodiscard]] Status combine_expanded(const TensorView& y_expanded, const Handle& handle, const TensorView& out,
                                        const TensorView& weights = {}, const CombineOptions& options = {});
  // Collective, as Buffer::combine_expanded_backward.
  [[nodiscard]] Status combine_expanded_backward(const TensorView& grad_out, const Handle& handle,
                                                 const TensorView& y_expanded, const TensorView& weights,
                                                 const TensorView& grad_y_expanded,
                                                 const TensorView& grad_weights = {});

  // Asynchronous forms, as Buffer's (buffer.h): each queues the operation on
  // this CudaBuffer's progress thread and returns at once; the operations run
  // one at a time in the order issued, and a blocking call first waits for
  // the queued ones. The calling thread is free meanwhile, e.g. to launch its
  // own kernels on its own stream; the exchange's kernels run on the buffer's
  // stream and have finished when wait() returns OK. Inputs and outputs must
  // stay valid and untouched, and the transport unused, until then.
  [[nodiscard]] PendingOp dispatch_async(const DispatchInputs& inputs, DispatchResult* out);
  [[nodiscard]] PendingOp dispatch_cached_async(const TensorView& x, const Handle& handle, TensorView* recv_x);
  [[nodiscard]] PendingOp combine_async(const TensorView& y, const Handle& handle, const TensorView& out,
                                        const CombineOptions& options = {});
  [[nodiscard]] PendingOp dispatch_backward_async(const TensorView& grad_recv_x, const Handle& handle,
                                                  const TensorView& grad_x, const CombineOptions& options = {}) {
    return combine_async(grad_recv_x, handle, grad_x, options);
  }
  [[nodiscard]] PendingOp combine_backward_async(const TensorView& grad_out, const Handle& handle,
                                                 TensorView* grad_y) {
    return dispatch_cached_async(grad_out, handle, grad_y);
  }
  [[nodiscard]] PendingOp combine_expanded_async(const TensorView& y_expanded, const Handle& handle,
                                                 const TensorView& out, const TensorView& weights = {},
                                                 const CombineOptions& options = {});
  [[nodiscard]] PendingOp combine_expanded_backward_async(const TensorView& grad_out, const Handle& handle,
                                                          const TensorView& y_expanded, const TensorView& weights,
                                                          const TensorView& grad_y_expanded,
                                                          const TensorView& grad_weights = {});

 private:
  struct Impl;
  explicit CudaBuffer(std::unique_ptr<Impl> impl);
  // The operations themselves (the public forms first wait for the queued ones).
  Status dispatch_blocking(const DispatchInputs& inputs, DispatchResult* out);
  Status dispatch_cached_blocking(const TensorView& x, const Handle& handle, TensorView* recv_x);
  Result<TensorView> combine_input_blocking(const Handle& handle, DType dtype);
  Status combine_blocking(const TensorView& y, const Handle& handle, const TensorView& out, const CombineOptions& options);
  Result<const ExpandedLayout*> expanded_layout_blocking(const Handle& handle);
  Status expand_blocking(const TensorView& recv_x, const Handle& handle, const TensorView& out);
  Status combine_expanded_blocking(const TensorView& y_expanded, const Handle& handle, const TensorView& out,
                              const TensorView& weights, const CombineOptions& options);
  Status combine_expanded_backward_blocking(const TensorView& grad_out, const Handle& handle, const TensorView& y_expanded,
                                       const TensorView& weights, const TensorView& grad_y_expanded,
                                       const TensorView& grad_weights);
  std::unique_ptr<Impl> impl_;
  // Declared last, destroyed first: queued operations finish before the
  // memory they use goes away (the destructor resets it before it destroys
  // the stream).
  std::unique_ptr<detail::OperationQueue> ops_;
};

}  // namespace epx
