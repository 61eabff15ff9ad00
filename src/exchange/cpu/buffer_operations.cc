// Buffer's and LowLatencyBuffer's public operations: the blocking and
// asynchronous forms (one line each on the shared OperationQueue) and the
// split send/receive forms built on them.
#include <utility>

#include "epx/exchange/buffer.h"
#include "epx/exchange/low_latency.h"
#include "exchange/operation_queue.h"
#include "exchange/cpu/split_phase_state.h"

namespace epx {

// Blocking forms (the queued asynchronous ones first), then the asynchronous
// forms on the progress thread: operation_queue.h.

Status Buffer::dispatch(const DispatchInputs& inputs, DispatchResult* out, const DispatchLayout* layout) {
  return ops_->run("dispatch", [&] { return dispatch_blocking(inputs, out, layout); });
}

Status Buffer::dispatch_cached(const TensorView& x, const Handle& handle, TensorView* recv_x) {
  return ops_->run("dispatch_cached", [&] { return dispatch_cached_blocking(x, handle, recv_x); });
}

// The view is of the combine region, which a queued combine may still use:
// run() waits for it first.
Result<TensorView> Buffer::combine_input(const Handle& handle, DType dtype) {
  return ops_->run("combine_input", [&] { return combine_input_blocking(handle, dtype); });
}

Result<TensorView> Buffer::combine_expanded_input(const Handle& handle, DType dtype) {
  return ops_->run("combine_expanded_input", [&] { return combine_expanded_input_blocking(handle, dtype); });
}

Status Buffer::combine(const TensorView& y, const Handle& handle, const TensorView& out, const CombineOptions& options) {
  return ops_->run("combine", [&] { return combine_blocking(y, handle, out, options); });
}

Status Buffer::dispatch_backward(const TensorView& grad_recv_x, const Handle& handle, const TensorView& grad_x,
                                 const CombineOptions& options) {
  return ops_->run("dispatch_backward",
                   [&] { return dispatch_backward_blocking(grad_recv_x, handle, grad_x, options); });
}

Status Buffer::combine_backward(const TensorView& grad_out, const Handle& handle, TensorView* grad_y) {
  return ops_->run("combine_backward", [&] { return combine_backward_blocking(grad_out, handle, grad_y); });
}

Status Buffer::combine_expanded(const TensorView& y_expanded, const Handle& handle, const TensorView& out,
                                const TensorView& weights, const CombineOptions& options) {
  return ops_->run("combine_expanded",
                   [&] { return combine_expanded_blocking(y_expanded, handle, out, weights, options); });
}

Status Buffer::combine_expanded_backward(const TensorView& grad_out, const Handle& handle,
                                         const TensorView& y_expanded, const TensorView& weights,
                                         const TensorView& grad_y_expanded, const TensorView& grad_weights) {
  return ops_->run("combine_expanded_backward", [&] {
    return combine_expanded_backward_blocking(grad_out, handle, y_expanded, weights, grad_y_expanded, grad_weights);
  });
}

PendingOp Buffer::dispatch_async(const DispatchInputs& inputs, DispatchResult* out, const DispatchLayout* layout) {
  return ops_->submit([=, this] { return dispatch_blocking(inputs, out, layout); });
}

PendingOp Buffer::dispatch_cached_async(const TensorView& x, const Handle& handle, TensorView* recv_x) {
  return ops_->submit([=, this] { return dispatch_cached_blocking(x, handle, recv_x); });
}

PendingOp Buffer::combine_async(const TensorView& y, const Handle& handle, const TensorView& out,
                                const CombineOptions& options) {
  return ops_->submit([=, this] { return combine_blocking(y, handle, out, options); });
}

PendingOp Buffer::dispatch_backward_async(const TensorView& grad_recv_x, const Handle& handle,
                                          const TensorView& grad_x, const CombineOptions& options) {
  return ops_->submit([=, this] { return dispatch_backward_blocking(grad_recv_x, handle, grad_x, options); });
}

PendingOp Buffer::combine_backward_async(const TensorView& grad_out, const Handle& handle, TensorView* grad_y) {
  return ops_->submit([=, this] { return combine_backward_blocking(grad_out, handle, grad_y); });
}

PendingOp Buffer::combine_expanded_async(const TensorView& y_expanded, const Handle& handle, const TensorView& out,
                                         const TensorView& weights, const CombineOptions& options) {
  return ops_->submit([=, this] { return combine_expanded_blocking(y_expanded, handle, out, weights, options); });
}

PendingOp Buffer::combine_expanded_backward_async(const TensorView& grad_out, const Handle& handle,
                                                  const TensorView& y_expanded, const TensorView& weights,
                                                  const TensorView& grad_y_expanded,
                                                  const TensorView& grad_weights) {
  return ops_->submit([=, this] {
    return combine_expanded_backward_blocking(grad_out, handle, y_expanded, weights, grad_y_expanded, grad_weights);
  });
}

// The low-latency buffer's forms, the same way.

Status LowLatencyBuffer::dispatch(const LowLatencyDispatchInputs& inputs, LowLatencyDispatchResult* out) {
  return ops_->run("low-latency dispatch", [&] { return dispatch_blocking(inputs, out); });
}

Status LowLatencyBuffer::combine(const TensorView& y, const LowLatencyHandle& handle, const TensorView& out) {
  return ops_->run("low-latency combine", [&] { return combine_blocking(y, handle, out); });
}

PendingOp LowLatencyBuffer::dispatch_async(const LowLatencyDispatchInputs& inputs, LowLatencyDispatchResult* out) {
  return ops_->submit([=, this] { return dispatch_blocking(inputs, out); });
}

PendingOp LowLatencyBuffer::combine_async(const TensorView& y, const LowLatencyHandle& handle, const TensorView& out) {
  return ops_->submit([=, this] { return combine_blocking(y, handle, out); });
}

// Split forms.

namespace {

// Waits for a split operation until `deadline`. Still running: the caller's
// DeadlineExceeded, and it stays outstanding. Finished (even just after the
// deadline passed): no longer outstanding, and its own status.
Status receive_split(const PendingOp& op, const Deadline& deadline, bool* outstanding) {
  Status status = op.wait(deadline);
  if (!op.done()) return status;
  *outstanding = false;
  return op.wait();
}

}  // namespace

Status Buffer::dispatch_send(const DispatchInputs& inputs, const DispatchLayout* layout) {
  Split& s = *split_;
  if (s.dispatch_outstanding)
    return failed_precondition("dispatch_send: the previous split dispatch has not been received (call dispatch_recv)");
  s.dispatch = dispatch_async(inputs, &s.result, layout);
  s.dispatch_outstanding = true;
  return Status::ok();
}

Status Buffer::dispatch_recv(DispatchResult* out, const Deadline& deadline) {
  Split& s = *split_;
  if (!s.dispatch_outstanding) return failed_precondition("dispatch_recv without a dispatch_send before it");
  if (out == nullptr) return invalid_argument("dispatch_recv needs an output");
  EPX_RETURN_IF_ERROR(receive_split(s.dispatch, deadline, &s.dispatch_outstanding));
  // Moving keeps the handle storage shared with the Buffer, as a blocking
  // dispatch into `out` would.
  *out = std::move(s.result);
  s.result = DispatchResult();
  return Status::ok();
}

Status Buffer::combine_send(const TensorView& y, const Handle& handle, const TensorView& out,
                            const CombineOptions& options) {
  Split& s = *split_;
  if (s.combine_outstanding)
    return failed_precondition("combine_send: the previous split combine has not been received (call combine_recv)");
  s.combine = combine_async(y, handle, out, options);
  s.combine_outstanding = true;
  return Status::ok();
}

Status Buffer::combine_recv(const Deadline& deadline) {
  Split& s = *split_;
  if (!s.combine_outstanding) return failed_precondition("combine_recv without a combine_send before it");
  return receive_split(s.combine, deadline, &s.combine_outstanding);
}

}  // namespace epx
