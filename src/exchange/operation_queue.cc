// PendingOp: what the asynchronous forms of every exchange backend return
// (operation_queue.h queues them).
#include "exchange/operation_queue.h"

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

}  // namespace epx
