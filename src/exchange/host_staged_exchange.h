// Private: a host-staged exchange of rows that live on a device.
//
// StagedExchange runs the Buffer contract for device views by copying them
// to host memory, running a host Buffer on the transport (which does the
// two-hop path across nodes, deduplicated per node), and copying the results
// back. CudaBuffer uses it between nodes, where no peer memory reaches: the
// bytes cross the PCIe link twice and the network once, so it is correct
// but not fast (docs/design.md, "The CUDA backend").
//
// The device side is a DeviceCopier, so the staging logic runs on the CPU in
// every build: the tests give it host memory tagged as a device
// (tests/exchange/host_staged_exchange_test.cc). Results are those of the host Buffer,
// bit for bit. Collective like Buffer: a rank whose device view is wrong
// still takes part (passing nothing) so the others return Aborted. Handles
// are the host Buffer's; device views of a dispatch (recv_x and the recv_*
// metadata) are overwritten by the next dispatch-like call, and
// combine_input's by the next combine-like call.
#pragma once

#include <cstddef>
#include <memory>

#include "epx/exchange/buffer.h"

namespace epx::detail {

// How bytes move between host memory and one device.
class DeviceCopier {
 public:
  virtual ~DeviceCopier() = default;
  [[nodiscard]] virtual Device device() const = 0;
  // Starts copying `rows` rows of `row_bytes` (strides in bytes) between
  // host and device memory, either way; done after sync().
  [[nodiscard]] virtual Status copy_rows(void* dst, std::size_t dst_stride, const void* src, std::size_t src_stride,
                                         std::size_t row_bytes, int64_t rows) = 0;
  [[nodiscard]] virtual Status sync() = 0;
  // Zero-filled device memory, owned by the copier until it is destroyed.
  [[nodiscard]] virtual Result<std::byte*> allocate(std::size_t bytes) = 0;
};

class StagedExchange {
 public:
  // Collective: every rank of `transport` calls it with the same config.
  static Result<std::unique_ptr<StagedExchange>> create(Transport& transport, BufferConfig config,
                                                        std::unique_ptr<DeviceCopier> copier);
  ~StagedExchange();
  StagedExchange(const StagedExchange&) = delete;
  StagedExchange& operator=(const StagedExchange&) = delete;

  // As Buffer's, with device views in and out.
  [[nodiscard]] Status dispatch(const DispatchInputs& inputs, DispatchResult* out);
  [[nodiscard]] Status dispatch_cached(const TensorView& x, const Handle& handle, TensorView* recv_x);
  [[nodiscard]] Result<TensorView> combine_input(const Handle& handle, DType dtype);
  [[nodiscard]] Status combine(const TensorView& y, const Handle& handle, const TensorView& out,
                               const CombineOptions& options = {});
  [[nodiscard]] Result<const ExpandedLayout*> expanded_layout(const Handle& handle);
  [[nodiscard]] Status expand(const TensorView& recv_x, const Handle& handle, const TensorView& out);
  [[nodiscard]] Status combine_expanded(const TensorView& y_expanded, const Handle& handle, const TensorView& out,
                                        const TensorView& weights = {}, const CombineOptions& options = {});
  [[nodiscard]] Status combine_expanded_backward(const TensorView& grad_out, const Handle& handle,
                                                 const TensorView& y_expanded, const TensorView& weights,
                                                 const TensorView& grad_y_expanded,
                                                 const TensorView& grad_weights = {});

 private:
  struct Impl;
  explicit StagedExchange(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace epx::detail
