// CudaGroup: dispatch and combine on NVIDIA GPUs, all ranks driven by one process.
//
// The ranks of a CudaGroup are either GPUs of this process (one device per
// rank, peer access between them: NVLink inside a node) or R emulated ranks
// sharing one device (separate allocations, the same kernels), so the whole
// conformance table runs on a single GPU. One host thread calls each
// operation once for all ranks, passing one argument per rank; every call
// returns when all ranks' kernels have finished.
//
// The contract is the Buffer's (buffer.h, docs/design.md), bit for bit:
// dispatch rows ordered by (source rank, source token) with the same
// metadata; combine in fp32 in the fixed order (flat: ranks ascending;
// two-hop topologies: per node, then over nodes) with no FMA contraction;
// the expanded layout and its weighted combine; the backward passes. Views
// are device views (TensorView with Device{kCuda, index}) on the rank's device.
// Differences from Buffer: handles are valid until the next dispatch of the
// group (FailedPrecondition after it); combine takes y from anywhere on the
// rank's device (there is no combine region); no tracer and no timeouts
// (every call waits for its kernels).
//
// Ranks as processes are CudaBuffer's (cuda_buffer.h). Not built yet
// (docs/design.md, "The CUDA backend"): NCCL between nodes; a multi-node
// topology is emulated inside the group, so two-hop changes only the
// combine order, not the bytes' path.
//
//   EPX_ASSIGN_OR_RETURN(auto group, epx::CudaGroup::create(topology, config));  // emulated on GPU 0
//   std::vector<epx::DispatchResult> recv;
//   EPX_RETURN_IF_ERROR(group->dispatch(inputs, &recv));  // inputs[r]: rank r's device views
//   ... experts turn recv[r].recv_x into y[r] ...
//   EPX_RETURN_IF_ERROR(group->combine(y, handles_of(recv), out));
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "epx/comm/topology.h"
#include "epx/core/status.h"
#include "epx/core/tensor.h"
#include "epx/exchange/buffer.h"

namespace epx {

// Empty when a CUDA device can be used here, else why not ("epx was built
// without CUDA", "no CUDA device: ...").
std::string cuda_unavailable_reason();
// True when epx was built with the CUDA backend.
bool cuda_built();

class CudaGroup {
 public:
  // `devices`: the device of each rank; empty means every rank on device 0
  // (emulated ranks). Distinct devices get peer access to each other.
  static Result<std::unique_ptr<CudaGroup>> create(const Topology& topology, BufferConfig config,
                                                   std::vector<int> devices = {});
  ~CudaGroup();
  CudaGroup(const CudaGroup&) = delete;
  CudaGroup& operator=(const CudaGroup&) = delete;

  [[nodiscard]] int num_ranks() const;
  [[nodiscard]] Device device_of(int rank) const;
  [[nodiscard]] const BufferConfig& config() const;
  [[nodiscard]] const ExpertPlacement& placement() const;
  [[nodiscard]] bool hierarchical() const;

  // The layout of each rank's topk_idx, computed on its device and copied
  // back (validated: InvalidArgument names the first bad entry).
  [[nodiscard]] Status get_layouts(std::span<const TensorView> topk_idx, std::vector<DispatchLayout>* out);

  // inputs[r] are rank r's; out gets one result per rank. recv_x and the
  // recv_* views are device views valid until the next dispatch-like call.
  [[nodiscard]] Status dispatch(std::span<const DispatchInputs> inputs, std::vector<DispatchResult>* out);
  [[nodiscard]] Status dispatch_cached(std::span<const TensorView> x, std::span<const Handle> handles,
                                       std::vector<TensorView>* recv_x);
  [[nodiscard]] Status combine(std::span<const TensorView> y, std::span<const Handle> handles,
                               std::span<const TensorView> out, std::span<const CombineOptions> options = {});
  [[nodiscard]] Status dispatch_backward(std::span<const TensorView> grad_recv_x, std::span<const Handle> handles,
                                         std::span<const TensorView> grad_x,
                                         std::span<const CombineOptions> options = {}) {
    return combine(grad_recv_x, handles, grad_x, options);
  }
  [[nodiscard]] Status combine_backward(std::span<const TensorView> grad_out, std::span<const Handle> handles,
                                        std::vector<TensorView>* grad_y) {
    return dispatch_cached(grad_out, handles, grad_y);
  }

  // The expanded layout of rank `rank`'s latest dispatch (host copy, built on
  // first use).
  [[nodiscard]] Result<const ExpandedLayout*> expanded_layout(int rank, const Handle& handle);
  [[nodiscard]] Status expand(int rank, const TensorView& recv_x, const Handle& handle, const TensorView& out);
  // weights: one [num_recv, K] f32 device view per rank, or empty for the dispatched weights.
  [[nodiscard]] Status combine_expanded(std::span<const TensorView> y_expanded, std::span<const Handle> handles,
                                        std::span<const TensorView> out, std::span<const TensorView> weights = {});
  // As Buffer::combine_expanded_backward, per rank (grad_weights may be empty or hold undefined views).
  [[nodiscard]] Status combine_expanded_backward(std::span<const TensorView> grad_out, std::span<const Handle> handles,
                                                 std::span<const TensorView> y_expanded,
                                                 std::span<const TensorView> weights,
                                                 std::span<const TensorView> grad_y_expanded,
                                                 std::span<const TensorView> grad_weights = {});

 private:
  struct Impl;
  explicit CudaGroup(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The handles of a dispatch's results, in rank order.
std::vector<Handle> handles_of(const std::vector<DispatchResult>& results);

}  // namespace epx
