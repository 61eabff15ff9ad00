// Buffer's public operations: the blocking forms (after the queued
// asynchronous ones), the asynchronous forms on the progress thread, and the
// split send/receive forms built on them.
#include <utility>

#include "epx/exchange/buffer.h"
#include "epx/exchange/low_latency.h"
#include "core/guard.h"
#include "exchange/progress.h"
#include "exchange/split_phase_state.h"

namespace epx {

bool PendingOp::done() const {
  if (!state_) return true;
  std::lock_guard lock(state_->mutex);
  return state_->done;
}

Status PendingOp::wait(const Deadline& deadline) const {
  if (!state_) return Status::ok();
  std::unique_lock lock(state_->mutex);
  if (!state_->done_cv.wait_until(lock, deadline.when(), [&] { return state_->done; }))
    return deadline_exceeded("the asynchronous exchange operation had not finished by the deadline; it is still "
                             "running (wait again)");
  return state_->status;
}

Status PendingOp::wait() const { return state_ ? wait(state_->bound) : Status::ok(); }

Status Buffer::settle() { return progress_->drain(); }

PendingOp Buffer::submit(std::function<Status()> op) { return PendingOp(progress_->submit(std::move(op))); }

// Blocking forms.

Status Buffer::dispatch(const DispatchInputs& inputs, DispatchResult* out, const DispatchLayout* layout) {
  return detail::guard("dispatch", [&] {
    EPX_RETURN_IF_ERROR(settle());
    return dispatch_blocking(inputs, out, layout);
  });
}

Status Buffer::dispatch_cached(const TensorView& x, const Handle& handle, TensorView* recv_x) {
  return detail::guard("dispatch_cached", [&] {
    EPX_RETURN_IF_ERROR(settle());
    return dispatch_cached_blocking(x, handle, recv_x);
  });
}

Result<TensorView> Buffer::combine_input(const Handle& handle, DType dtype) {
  // The view is of the combine region, which a queued combine may still use.
  return detail::guard("combine_input", [&]() -> Result<TensorView> {
    EPX_RETURN_IF_ERROR(settle());
    return combine_input_blocking(handle, dtype);
  });
}

Result<TensorView> Buffer::combine_expanded_input(const Handle& handle, DType dtype) {
  // As combine_input: the region may still be in use by a queued combine.
  return detail::guard("combine_expanded_input", [&]() -> Result<TensorView> {
    EPX_RETURN_IF_ERROR(settle());
    return combine_expanded_input_blocking(handle, dtype);
  });
}

Status Buffer::combine(const TensorView& y, const Handle& handle, const TensorView& out, const CombineOptions& options) {
  return detail::guard("combine", [&] {
    EPX_RETURN_IF_ERROR(settle());
    return combine_blocking(y, handle, out, options);
  });
}

Status Buffer::dispatch_backward(const TensorView& grad_recv_x, const Handle& handle, const TensorView& grad_x,
                                 const CombineOptions& options) {
  return detail::guard("dispatch_backward", [&] {
    EPX_RETURN_IF_ERROR(settle());
    return dispatch_backward_blocking(grad_recv_x, handle, grad_x, options);
  });
}

Status Buffer::combine_backward(const TensorView& grad_out, const Handle& handle, TensorView* grad_y) {
  return detail::guard("combine_backward", [&] {
    EPX_RETURN_IF_ERROR(settle());
    return combine_backward_blocking(grad_out, handle, grad_y);
  });
}

Status Buffer::combine_expanded(const TensorView& y_expanded, const Handle& handle, const TensorView& out,
                                const TensorView& weights, const CombineOptions& options) {
  return detail::guard("combine_expanded", [&] {
    EPX_RETURN_IF_ERROR(settle());
    return combine_expanded_blocking(y_expanded, handle, out, weights, options);
  });
}

Status Buffer::combine_expanded_backward(const TensorView& grad_out, const Handle& handle,
                                         const TensorView& y_expanded, const TensorView& weights,
                                         const TensorView& grad_y_expanded, const TensorView& grad_weights) {
  return detail::guard("combine_expanded_backward", [&] {
    EPX_RETURN_IF_ERROR(settle());
    return combine_expanded_backward_blocking(grad_out, handle, y_expanded, weights, grad_y_expanded, grad_weights);
  });
}

// Asynchronous forms: the arguments are captured by value (views and
// handles are cheap to copy); what they point at is the caller's to keep.

PendingOp Buffer::dispatch_async(const DispatchInputs& inputs, DispatchResult* out, const DispatchLayout* layout) {
  return submit([this, inputs, out, layout] { return dispatch_blocking(inputs, out, layout); });
}

PendingOp Buffer::dispatch_cached_async(const TensorView& x, const Handle& handle, TensorView* recv_x) {
  return submit([this, x, handle, recv_x] { return dispatch_cached_blocking(x, handle, recv_x); });
}

PendingOp Buffer::combine_async(const TensorView& y, const Handle& handle, const TensorView& out,
                                const CombineOptions& options) {
  return submit([this, y, handle, out, options] { return combine_blocking(y, handle, out, options); });
}

PendingOp Buffer::dispatch_backward_async(const TensorView& grad_recv_x, const Handle& handle,
                                          const TensorView& grad_x, const CombineOptions& options) {
  return submit([this, grad_recv_x, handle, grad_x, options] {
    return dispatch_backward_blocking(grad_recv_x, handle, grad_x, options);
  });
}

PendingOp Buffer::combine_backward_async(const TensorView& grad_out, const Handle& handle, TensorView* grad_y) {
  return submit([this, grad_out, handle, grad_y] { return combine_backward_blocking(grad_out, handle, grad_y); });
}

PendingOp Buffer::combine_expanded_async(const TensorView& y_expanded, const Handle& handle, const TensorView& out,
                                         const TensorView& weights, const CombineOptions& options) {
  return submit([this, y_expanded, handle, out, weights, options] {
    return combine_expanded_blocking(y_expanded, handle, out, weights, options);
  });
}

PendingOp Buffer::combine_expanded_backward_async(const TensorView& grad_out, const Handle& handle,
                                                  const TensorView& y_expanded, const TensorView& weights,
                                                  const TensorView& grad_y_expanded,
                                                  const TensorView& grad_weights) {
  return submit([this, grad_out, handle, y_expanded, weights, grad_y_expanded, grad_weights] {
    return combine_expanded_backward_blocking(grad_out, handle, y_expanded, weights, grad_y_expanded, grad_weights);
  });
}

// The low-latency buffer's forms, the same way.

Status LowLatencyBuffer::dispatch(const LowLatencyDispatchInputs& inputs, LowLatencyDispatchResult* out) {
  return detail::guard("low-latency dispatch", [&] {
    EPX_RETURN_IF_ERROR(progress_->drain());
    return dispatch_blocking(inputs, out);
  });
}

Status LowLatencyBuffer::combine(const TensorView& y, const LowLatencyHandle& handle, const TensorView& out) {
  return detail::guard("low-latency combine", [&] {
    EPX_RETURN_IF_ERROR(progress_->drain());
    return combine_blocking(y, handle, out);
  });
}

PendingOp LowLatencyBuffer::dispatch_async(const LowLatencyDispatchInputs& inputs, LowLatencyDispatchResult* out) {
  return PendingOp(progress_->submit([this, inputs, out] { return dispatch_blocking(inputs, out); }));
}

PendingOp LowLatencyBuffer::combine_async(const TensorView& y, const LowLatencyHandle& handle, const TensorView& out) {
  return PendingOp(progress_->submit([this, y, handle, out] { return combine_blocking(y, handle, out); }));
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
